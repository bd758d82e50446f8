"""A third outside audit of the Python package: caller code that runs in the
middle of a call (an integer's __index__, a thread switch, a finalizer), and
what it can do to the memory the call is about to hand out.

What could crash the interpreter runs in a subprocess (sys.executable -c),
so a segfault is a failed test with its output, not a crashed pytest.
Host backend, no GPU needed.
"""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import activekv as akv
from activekv import _api

from conftest import quiet, small

L, H, D = 3, 2, 8

PRELUDE = """
import sys, threading
import numpy as np, activekv as akv
from conftest import quiet, small
L = 3

def staged(eng):
    '''An engine with one context of 2 rows, a step open and every layer
    staged; returns (ctx, leases, views), the last lease sealed, the others
    retired.'''
    ctx = eng.open_context()
    ctx.append(np.ones((L, 2, 2, 8), np.float32), np.ones((L, 2, 2, 8), np.float32))
    eng.step_begin([ctx])
    leases, views = [], []
    for layer in range(L):
        lease = eng.lease_begin(layer)
        views.append(lease.wait_ready())
        attn = lease.mark_consumed()
        lease.seal(lease.write_back(), attn)
        leases.append(lease)
        if layer < L - 1:
            lease.retire()
    return ctx, leases, views

_destroyed = []
_real_destroy = akv._api.lib.akv_engine_destroy


def _counted_destroy(h):
    st = _real_destroy(h)
    if st == 0:
        _destroyed.append(h)
    return st


akv._api.lib.akv_engine_destroy = _counted_destroy


def memory_check(eng, arrays):
    '''Prints FREED UNDER AN ARRAY when the engine's memory was freed while
    `arrays` (zero-copy arrays over it) are alive: what a crash shows
    under a sanitizer, told without one.'''
    if arrays and _destroyed:
        print("FREED UNDER AN ARRAY")


def end_everything(eng, ctx, lease):
    '''Retires the last lease, ends the step, closes the context and the
    engine: with no array alive, the engine's memory is freed.'''
    lease.retire()
    eng.step_end()
    ctx.close()
    eng.close()
"""


def run_py(body, timeout=120):
    """Runs PRELUDE + `body` in a fresh interpreter with this package;
    returns the CompletedProcess (rc, stdout, stderr)."""
    code = "import sys; sys.path.insert(0, %r)\n" % os.path.dirname(__file__) + \
        textwrap.dedent(PRELUDE) + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=timeout)


def rows(n, value=1.0):
    return np.full((L, n, H, D), value, np.float32)


# ---------------------------------------- caller code inside an integer


def test_view_index_whose_index_closes_the_engine_never_gets_freed_memory():
    """View.keys(i) checked that the lease was live and then read i: a numpy
    integer subclass whose __index__ retired the lease and closed the engine
    (no array alive: its memory freed) got an array over the freed staging
    buffer, and reading it crashed (SIGSEGV)."""
    r = run_py("""
        eng = akv.Engine(**small())
        ctx, leases, views = staged(eng)

        class Closing(np.int64):
            def __index__(self):
                end_everything(eng, ctx, leases[-1])
                return 0

        try:
            k = views[-1].keys(Closing(0))
        except akv.ActiveKVError as exc:
            print("refused", type(exc).__name__)
        else:
            memory_check(eng, [k])
            print("array", float(k.sum()), eng.live_arrays)
            del k
        if eng._handle is not None:
            end_everything(eng, ctx, leases[-1])
        print("done")
    """)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "done" in r.stdout and "FREED" not in r.stdout


# ---------------------------------------- a second thread


def test_view_array_made_on_another_thread_while_the_engine_closes_is_never_over_freed_memory():
    """View.keys/values/kv_tensors were not calls on the engine (no Busy
    guard): a thread that had checked the lease was live, switched out
    before its array was counted, while the engine's thread retired the
    lease and closed the engine (no array alive: its memory freed), then got
    an array over the freed staging buffer, and reading it crashed. The
    switch is forced with a trace function that parks the thread where the
    array is about to be made."""
    r = run_py("""
        eng = akv.Engine(**small())
        ctx, leases, views = staged(eng)
        parked, go, got = threading.Event(), threading.Event(), []

        def tracer(frame, event, arg):
            if event == "call" and frame.f_code.co_name == "_export_array":
                parked.set()
                go.wait(30)
            return None

        def reader():
            sys.settrace(tracer)
            try:
                got.append(views[-1].keys(0))
            except akv.ActiveKVError as exc:
                got.append(exc)
            finally:
                sys.settrace(None)

        t = threading.Thread(target=reader)
        t.start()
        assert parked.wait(30)
        try:
            end_everything(eng, ctx, leases[-1])
            print("closed meanwhile")
        except akv.Busy:
            print("busy")
        go.set()
        t.join(30)
        out = got[0]
        if isinstance(out, np.ndarray):
            memory_check(eng, [out])
            print("array", float(out.sum()))
            del out, got[:]
        if eng._handle is not None:
            end_everything(eng, ctx, leases[-1])
        print("done")
    """)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "busy" in r.stdout and "done" in r.stdout and "FREED" not in r.stdout


# ---------------------------------------- what an array's base lets through


def test_copied_array_base_never_outlives_the_engines_memory():
    """copy.copy of a zero-copy array's base (its _Export, ndarray.base) made
    a second export that the engine did not count: an array over it kept
    the staging buffer's address while close() freed it once the original
    array was gone, and reading it crashed."""
    r = run_py("""
        import copy
        eng = akv.Engine(**small())
        ctx, leases, views = staged(eng)
        a = views[-1].keys(0)
        try:
            b = np.asarray(copy.copy(a.base))
        except TypeError as exc:
            print("refused:", exc)
            b = None
        try:
            copy.deepcopy(a.base)
        except TypeError:
            print("deepcopy refused")
        except Exception as exc:
            print("deepcopy:", type(exc).__name__)
        del a
        end_everything(eng, ctx, leases[-1])
        if b is not None:
            memory_check(eng, [b])
            print("copy", float(b.sum()))
        print("done")
    """)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "refused" in r.stdout and "deepcopy refused" in r.stdout and "done" in r.stdout
    assert "FREED" not in r.stdout


def test_array_interface_of_an_array_base_cannot_be_pointed_elsewhere():
    """An export's __array_interface__ was a plain dict attribute: changing
    its data pointer (arr.base.__array_interface__["data"] = (addr, False))
    made np.asarray(arr.base) an array over any address, and reading it
    crashed. Each read now gives a new dict of the engine's own values."""
    r = run_py("""
        eng = akv.Engine(**small())
        ctx, leases, views = staged(eng)
        a = views[-1].keys(0)
        want = a.__array_interface__["data"][0]
        try:
            a.base.__array_interface__["data"] = (4096, False)
        except TypeError:
            pass
        try:
            a.base.__array_interface__ = {"shape": (1 << 20,), "typestr": "<f4",
                                          "data": (4096, False), "version": 3}
        except AttributeError:
            print("attribute read-only")
        b = np.asarray(a.base)
        assert b.__array_interface__["data"][0] == want, b.__array_interface__
        print("same", float(b.sum()))
        del a, b
        end_everything(eng, ctx, leases[-1])
        print("done")
    """)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "attribute read-only" in r.stdout and "done" in r.stdout


# ---------------------------------------- __init__ called again


def test_engine_init_called_again_is_refused_and_leaks_nothing(destroys):
    """Engine.__init__ called on a live engine made a second engine in the
    same object: the first one's handle was dropped without a destroy (its
    memory and threads leaked for the life of the process), and its
    contexts went on reading through the new engine's checks."""
    eng = akv.Engine(**small())
    ctx = eng.open_context()
    ctx.append(rows(2), rows(2))
    h = eng._handle
    with pytest.raises(akv.InvalidArgument):
        eng.__init__(**small())
    assert eng._handle == h and len(ctx) == 2
    for obj, args in ((ctx, (eng, None)), (eng.default_stream(), (eng, None))):
        before = obj._handle
        with pytest.raises(akv.InvalidArgument):
            obj.__init__(*args)
        assert obj._handle == before  # the handle is still the object's
    ctx.close()
    eng.close()
    assert destroys == [h]


def test_lease_init_called_again_is_refused(engine):
    """Lease.__init__ called again emptied the lease's box: the begun lease
    was lost to its object while the object still claimed it, so
    lease_begin(layer) could not hand it out again and the step could not
    end (close refused for good)."""
    ctx = engine.open_context()
    ctx.append(rows(2), rows(2))
    engine.step_begin([ctx])
    lease = engine.lease_begin(0)
    with pytest.raises(akv.InvalidArgument):
        lease.__init__(engine, None, 0)
    for layer in range(L):
        lease = lease if layer == 0 else engine.lease_begin(layer)
        lease.wait_ready()
        attn = lease.mark_consumed()
        lease.seal(lease.write_back(), attn)
        lease.retire()
    engine.step_end()
    assert len(ctx) == 3
    ctx.close()


@pytest.mark.parametrize("cls", [akv.Context, akv.Lease, akv.Stream])
def test_objects_built_by_hand_around_a_non_engine_raise_the_packages_error(cls):
    """Context/Lease/Stream(not_an_engine, None) made an object whose every
    call failed with AttributeError from inside the package, not the
    package's InvalidArgument."""
    with pytest.raises(akv.InvalidArgument):
        cls("not an engine", None)


# ---------------------------------------- an interrupted lease_begin, kept


def test_lease_begin_cut_short_is_handed_out_again_while_its_traceback_lives(monkeypatch, engine):
    """lease_begin cut short as the library returned (Ctrl-C) loses the
    Lease to the caller, and lease_begin(layer) hands the begun lease out
    again, but only once the lost Lease object was freed: while the
    exception's traceback still held the interrupted frame (the caller kept
    the exception, or, on Python 3.12, a reference cycle until the next
    garbage collection) the lease read as owned and the library refused the
    layer, so the step could not be finished."""
    ctx = engine.open_context()
    ctx.append(rows(2), rows(2))
    engine.step_begin([ctx])
    real = _api.lib.akv_lease_begin

    def cut_short(*args):
        monkeypatch.setattr(_api.lib, "akv_lease_begin", real)
        st = real(*args)
        assert st == 0
        raise KeyboardInterrupt

    monkeypatch.setattr(_api.lib, "akv_lease_begin", cut_short)
    kept = []
    try:
        engine.lease_begin(0)
    except KeyboardInterrupt as exc:
        kept.append(exc)  # its traceback holds the interrupted frame
    lease = engine.lease_begin(0)  # the begun lease, handed out again
    for layer in range(L):
        lease = lease if layer == 0 else engine.lease_begin(layer)
        lease.wait_ready()
        attn = lease.mark_consumed()
        lease.seal(lease.write_back(), attn)
        lease.retire()
    engine.step_end()
    assert len(ctx) == 3
    ctx.close()
    del kept


# ---------------------------------------- objects that say they are the package's


def test_objects_lying_about_their_class_never_reach_the_library_as_handles():
    """isinstance believes an object's own __class__: a duck object saying it
    was a Context (with the engine and an _h of its own), or a Context
    subclass overriding _h, passed the check and handed the library any
    number as a context handle (step_begin, write_back, explain), and the
    library read the record at that address (SIGSEGV); a duck Lease made a
    View over any address. Each is now refused with InvalidArgument."""
    r = run_py("""
        from activekv import _lib
        eng = akv.Engine(**small())

        class DuckContext:
            __class__ = akv.Context
            _engine = eng
            def _h(self):
                return 0x1000

        class SubContext(akv.Context):
            def _h(self):
                return 0x1000

        class DuckStream:
            __class__ = akv.Stream
            _engine = eng
            def _h(self):
                return 0x1000

        fakes = [DuckContext(), SubContext(eng, None)]
        for fake in fakes:
            for call in (lambda: eng.step_begin([fake]), lambda: eng.explain(fake)):
                try:
                    call()
                    print("accepted")
                except akv.InvalidArgument:
                    print("refused")
        ctx, leases, views = staged(eng)
        lease = leases[-1]
        for fake in fakes:
            try:
                lease.write_back([fake])
                print("accepted")
            except akv.InvalidArgument:
                print("refused")
        try:
            lease.mark_consumed(DuckStream())
            print("accepted")
        except akv.InvalidArgument:
            print("refused")

        v = _lib.akv_view()
        lens = (_lib.c_uint32 * 1)(4)
        v.n_contexts, v.base, v.len, v.kv_heads, v.head_dim = 1, 0x1000, lens, 2, 8
        v.dtype, v.row_stride = 2, 64

        class Box:
            view = v

        class DuckLease:
            __class__ = akv.Lease
            _engine = eng
            _box = Box()
            def _h(self):
                return 1

        try:
            print("array", float(akv.View(DuckLease(), v).keys(0).sum()))
        except akv.InvalidArgument:
            print("refused")
        end_everything(eng, ctx, lease)
        print("done")
    """)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "accepted" not in r.stdout and r.stdout.count("refused") == 8, r.stdout
    assert "done" in r.stdout


def test_stream_argument_lying_about_being_an_int_raises_the_packages_error(engine):
    """A stream argument whose __class__ said int passed the raw-handle
    check and int() raised a TypeError from inside the package, not the
    package's InvalidArgument; a numpy integer subclass's __int__ ran
    there (the caller's code inside the call)."""

    class Duck:
        __class__ = int

    class Loud(np.uint64):
        def __int__(self):
            raise AssertionError("the caller's __int__ ran")

        __index__ = __int__

    ctx = engine.open_context()
    ctx.append(rows(1), rows(1))
    engine.step_begin([ctx])
    lease = engine.lease_begin(0)
    with pytest.raises(akv.InvalidArgument):
        lease.wait_ready(Duck())
    with pytest.raises(akv.InvalidArgument):  # not an engine stream: the library's refusal
        lease.wait_ready(Loud(12345))
    for layer in range(L):
        lease = lease if layer == 0 else engine.lease_begin(layer)
        lease.wait_ready()
        attn = lease.mark_consumed()
        lease.seal(lease.write_back(), attn)
        lease.retire()
    engine.step_end()
    ctx.close()


# ---------------------------------------- handles read before the caller's code


def _reopen_until(eng, handle, limit=1 << 17):
    """Opens and closes contexts of `eng` until one gets `handle` (the
    library hands a dead record out again after as many later opens as the
    process-wide pool has free records: 1280 in a fresh process, more once
    many engines were alive at once); returns that context, left open."""
    for _ in range(limit):
        c = eng.open_context()
        if c._handle == handle:
            return c
        c.close()
    raise AssertionError("the handle record never came back")


def test_append_whose_rows_close_the_context_never_writes_into_a_newer_one(engine):
    """Context.append read the context's handle, then converted k and v: an
    __array__ that closed the context and opened contexts until the library
    handed the dead record out again made the append write its rows into
    that newer context (the call on a closed context must raise BadHandle).
    The same for append_layer."""
    for layer_call in (False, True):
        ctx = engine.open_context()
        h = ctx._handle
        other = []

        class Rows:
            def __array__(self, dtype=None, copy=None):
                if not other:
                    ctx.close()
                    other.append(_reopen_until(engine, h))
                shape = (2, H, D) if layer_call else (L, 2, H, D)
                return np.full(shape, 7, np.float32)

        with pytest.raises(akv.BadHandle):
            if layer_call:
                ctx.append_layer(0, Rows(), Rows())
            else:
                ctx.append(Rows(), Rows())
        assert len(other[0]) == 0  # nothing written into the newer context
        other[0].close()


def test_step_begin_iterator_cannot_swap_the_handles_it_names(engine):
    """step_begin read each context's handle while iterating the caller's
    sequence: a generator that, after yielding a context,
    closed it and reopened contexts until the record came back made the
    step begin over that newer context (the closed one must be refused)."""
    ctx = engine.open_context()
    ctx.append(rows(2), rows(2))
    h = ctx._handle
    other = []

    def contexts():
        yield ctx
        ctx.close()
        other.append(_reopen_until(engine, h))

    with pytest.raises(akv.BadHandle):
        engine.step_begin(contexts())
    assert not engine._step_open
    other[0].close()
