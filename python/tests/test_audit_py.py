"""An outside audit of the Python package: integers that answer differently
each time they are read, zero-copy arrays outliving everything in
reference cycles and at interpreter exit, copies of views.

What could crash the interpreter runs in a subprocess (sys.executable -c),
so a segfault is a failed test with its output, not a crashed pytest.
Host backend, no GPU needed.
"""
import copy
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import activekv as akv

from conftest import quiet, small

L, H, D = 3, 2, 8


class Shifty(int):
    """An int whose __int__ (and __index__) says another number than its
    value: a check that reads it once and a use that reads it again see two
    different integers."""

    other = 0

    def __int__(self):
        return type(self).other

    __index__ = __int__


def shifty(value, other):
    cls = type("Shifty", (Shifty,), {"other": other})
    return cls(value)


def run_py(body, timeout=60):
    """Runs `body` in a fresh interpreter with this package; returns the
    CompletedProcess (rc, stdout, stderr)."""
    code = "import sys; sys.path.insert(0, %r)\n" % os.path.dirname(__file__) + \
        textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=timeout)


def one_step(eng, ctxs, keep=None):
    with eng.step(ctxs):
        for layer in range(L):
            lease = eng.lease_begin(layer)
            view = lease.wait_ready()
            if keep is not None:
                keep(layer, lease, view)
            attn = lease.mark_consumed()
            lease.seal(lease.write_back(), attn)
            lease.retire()


# ------------------------------------------------- integers read once


def test_view_context_index_is_read_once_and_never_names_memory_outside_the_buffer():
    """View.keys(i) checked i, then read it again for the array's offset: an
    int whose __int__ said -1 passed the check as 0 and got an array one
    context stride before the staging buffer (memory the engine does not
    own; writing it corrupts whatever lives there)."""
    r = run_py("""
        import numpy as np, activekv as akv
        from test_audit_py import shifty
        from conftest import quiet
        eng = akv.Engine(backend="host", n_dense_layers=1, kv_heads=8, head_dim=128,
                         dtype="f32", max_tokens=1024, page_tokens=16, max_contexts=1,
                         host_pool_gib=1, log=quiet)
        ctx = eng.open_context()
        rows = np.full((1, 1000, 8, 128), 3.0, np.float32)
        ctx.append(rows, rows)
        eng.step_begin([ctx])
        lease = eng.lease_begin(0)
        view = lease.wait_ready()
        lo, hi = view.base, view.base + view.n_contexts * view.context_stride
        for i in (shifty(0, -1), shifty(0, 5)):
            try:
                k = view.keys(i)
            except akv.InvalidArgument:
                print("refused")
                continue
            p = k.__array_interface__["data"][0]
            assert lo <= p < hi, ("outside", hex(p), hex(lo), hex(hi))
            assert k.shape == (1001, 8, 128) and float(k[:1000].min()) == 3.0
            print("context 0")
    """)
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr)
    assert r.stdout.split() == ["context", "0", "context", "0"], r.stdout


def test_integer_arguments_are_read_once():
    """An integer argument is range-checked and passed to C as one value:
    read(layer) of an int whose __int__ says 2**32 + 0 (which c_uint32 wraps
    to layer 0) reads the layer it is, not layer 0."""
    rng = np.random.default_rng(1)
    with akv.Engine(**small()) as eng:
        ctx = eng.open_context()
        k = rng.standard_normal((L, 5, H, D)).astype(np.float32)
        ctx.append(k, -k)
        got_k, got_v = ctx.read(shifty(1, 1 << 32), shifty(0, 1 << 32), shifty(5, 1 << 33))
        np.testing.assert_array_equal(got_k, k[1])
        np.testing.assert_array_equal(got_v, -k[1])
        # the same through append_layer and lease_begin
        ctx.append_layer(shifty(2, 1 << 32), k[2, :1], k[2, :1])
        assert eng.admission_counters() is not None
        with pytest.raises(akv.UnevenLayers):
            eng.step_begin([ctx])  # layer 2 got the row (with the wrapped value, layer 0 did)
        ctx.append_layer(0, k[0, :1], k[0, :1])
        ctx.append_layer(1, k[1, :1], k[1, :1])
        assert len(ctx) == 6
        eng.step_begin([ctx])
        lease = eng.lease_begin(shifty(0, 1 << 32 | 1))
        assert lease.layer == 0
        lease.wait_ready()
        attn = lease.mark_consumed()
        lease.seal(lease.write_back(), attn)
        lease.retire()
        for layer in (1, 2):
            lease = eng.lease_begin(layer)
            lease.wait_ready()
            attn = lease.mark_consumed()
            lease.seal(lease.write_back(), attn)
            lease.retire()
        eng.step_end()
        assert len(ctx) == 7


def test_config_integers_are_read_once():
    """A config value is checked and stored as one value: max_tokens of an int
    whose __int__ says another number is the int it is."""
    with akv.Engine(**small(max_tokens=shifty(32, (1 << 32) + 16))) as eng:
        assert eng.config["max_tokens"] == 32
    rep = akv.fit(**dict((k, v) for k, v in small(max_tokens=shifty(32, 7)).items()
                         if k != "log"))
    assert rep.ok and rep.row_bytes > 0
    with pytest.raises(akv.InvalidArgument):
        akv.Engine(**small(max_tokens=shifty(1 << 32, 32)))
    with pytest.raises(akv.InvalidArgument):
        akv.Engine(**small(max_tokens=True))


def test_target_pages_and_byte_counts_are_read_once():
    with akv.Engine(**small()) as eng:
        # the fair-share sentinel, however its __int__ disguises it
        with pytest.raises(akv.InvalidArgument):
            eng.open_context(target_pages=shifty(0xFFFFFFFF, 1))
        ctx = eng.open_context(target_pages=shifty(0, 0xFFFFFFFF), burst_pages=shifty(0, -1))
        ctx.close()
        with pytest.raises(akv.NotSupported):  # no headroom: checked value reaches C
            eng.headroom_release(shifty(1, -1))


def test_cache_layer_index_is_read_once():
    """ActiveKVCache.update checked layer_idx, then passed int(layer_idx) on:
    an int whose __int__ says 1 stored layer 0's prompt as layer 1's."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from test_misuse import _cache, _kv

    torch, cache = _cache()
    with cache:
        cache.update(*_kv(torch, 1, 3), shifty(0, 1))
        assert cache.layers[0].get_seq_length() == 3
        assert cache.layers[1].get_seq_length() == 0
        cache.update(*_kv(torch, 1, 3, seed=1), 1)
        assert [len(c) for c in cache.contexts] == [3]


# ------------------------------------------------- arrays outliving things


def test_view_array_in_a_cycle_read_by_a_finalizer_after_close_is_not_freed_memory():
    """A view array held by an object in a reference cycle whose __del__ reads
    and writes it, the engine closed before the collection: the memory is
    freed only once the array is gone, after every finalizer ran."""
    r = run_py("""
        import gc, numpy as np, activekv as akv
        from conftest import quiet
        gc.disable()
        eng = akv.Engine(backend="host", n_dense_layers=1, kv_heads=8, head_dim=128,
                         dtype="f32", max_tokens=1024, page_tokens=16, max_contexts=1,
                         host_pool_gib=1, log=quiet)
        ctx = eng.open_context()
        rows = np.full((1, 1000, 8, 128), 2.0, np.float32)
        ctx.append(rows, rows)
        class Reader:
            def __del__(self):
                self.k[:] = 5.0
                print("sum", float(self.k[:1000].sum()), "live", eng.live_arrays, flush=True)
        holders = []
        for order in range(2):
            with eng.step([ctx]):
                lease = eng.lease_begin(0)
                view = lease.wait_ready()
                if order:
                    r = Reader(); k = view.keys(0)
                else:
                    k = view.keys(0); r = Reader()
                a = lease.mark_consumed(); lease.seal(lease.write_back(), a); lease.retire()
            r.k, r.me = k, r
            del k, r, view, lease
        ctx.close()
        eng.close()
        assert eng._pending_destroy and eng.live_arrays == 2
        gc.collect()
        assert eng.live_arrays == 0 and not eng._pending_destroy
        print("done")
    """)
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr)
    lines = r.stdout.splitlines()
    assert lines[-1] == "done" and len(lines) == 3, r.stdout
    for line in lines[:2]:
        assert line.startswith("sum %r" % (5.0 * 1000 * 8 * 128)), line


@pytest.mark.parametrize("where", ["lease_ready", "lease_sealed", "closed_with_array",
                                   "cycle_with_array"])
def test_interpreter_exit_with_live_engine_objects_is_clean(where):
    """The interpreter exits (module globals torn down, finalizers at
    shutdown) with an engine mid-step, a lease begun or sealed, a view array
    alive after close, or everything in a reference cycle: exit status 0,
    nothing reported on stderr."""
    r = run_py("""
        import numpy as np, activekv as akv
        where = %r
        lines = []
        eng = akv.Engine(backend="host", n_dense_layers=2, kv_heads=2, head_dim=8,
                         dtype="f32", max_tokens=32, page_tokens=4, max_contexts=2,
                         host_pool_gib=1, log_level="debug", host_delay_seed=3,
                         host_delay_max_us=500, log=lambda lv, m: lines.append(m))
        ctx = eng.open_context()
        z = np.ones((2, 5, 2, 8), np.float32)
        ctx.append(z, z)
        eng.step_begin([ctx])
        lease = eng.lease_begin(0)
        view = lease.wait_ready()
        K = view.keys(0)
        if where != "lease_ready":
            a = lease.mark_consumed(); lease.seal(lease.write_back(), a)
        if where == "closed_with_array":
            lease.retire()
            l1 = eng.lease_begin(1); l1.wait_ready(); a = l1.mark_consumed()
            l1.seal(l1.write_back(), a); l1.retire(); eng.step_end()
            eng.close()
        if where == "cycle_with_array":
            eng.me, ctx.me, lease.me = eng, ctx, lease
            K = [K]; K.append(K)
        print("exiting", flush=True)
    """ % where)
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr)
    assert r.stdout.strip() == "exiting"
    assert r.stderr == "", r.stderr


def test_copy_of_a_view_is_dead_with_its_lease_and_its_arrays_hold_the_memory():
    """copy.copy(View) is allowed (a View only describes), but it is the same
    lease's view: dead (BadHandle) once the lease retires; deepcopy and pickle
    refuse (the lease cannot be copied)."""
    import pickle

    with akv.Engine(**small()) as eng:
        ctx = eng.open_context()
        ctx.append(np.ones((L, 2, H, D), np.float32), np.ones((L, 2, H, D), np.float32))
        kept = {}

        def keep(layer, lease, view):
            if layer == 0:
                twin = copy.copy(view)
                assert twin.len == view.len and twin.base == view.base
                kept["twin"], kept["k"] = twin, twin.keys(0)
                with pytest.raises(TypeError):
                    copy.deepcopy(view)
                with pytest.raises(TypeError):
                    pickle.dumps(view)
                # an array pickles as a copy of its rows
                back = pickle.loads(pickle.dumps(kept["k"]))
                assert back.base is None or not hasattr(back.base, "_engine")
                np.testing.assert_array_equal(back[:2], 1.0)

        one_step(eng, [ctx], keep)
        with pytest.raises(akv.BadHandle):
            kept["twin"].keys(0)
        with pytest.raises(akv.BadHandle):
            kept["twin"].kv_tensors()
        assert eng.live_arrays == 1
        eng.close()
        assert eng._pending_destroy
        float(kept["k"].sum())  # stale but allocated
        del kept["k"]
        assert not eng._pending_destroy


def test_forked_child_drops_arrays_and_objects_without_touching_the_parents_engine():
    """A child forked while view arrays, a lease and contexts are alive: every
    call there is BadHandle, and dropping all of it (the closed engine's
    deferred destroy included) frees nothing in the child and never hangs;
    the parent finishes its step after."""
    if not hasattr(os, "fork"):
        pytest.skip("no fork")
    r = run_py("""
        import os, gc, numpy as np, activekv as akv
        from conftest import quiet
        eng = akv.Engine(backend="host", n_dense_layers=1, kv_heads=2, head_dim=8,
                         dtype="f32", max_tokens=32, page_tokens=4, max_contexts=2,
                         host_pool_gib=1, log=quiet)
        ctx = eng.open_context()
        z = np.ones((1, 5, 2, 8), np.float32)
        ctx.append(z, z)
        eng.step_begin([ctx])
        lease = eng.lease_begin(0)
        K = lease.wait_ready().keys(0)
        pid = os.fork()
        if pid == 0:
            code = 0
            for f in (lease.mark_consumed, eng.close, ctx.close, lambda: len(ctx),
                      lambda: lease.view):
                try:
                    f()
                    code = 3
                except akv.BadHandle:
                    pass
            K[:] = 7.0  # the child's own copy of the pages
            del K, lease, ctx, eng
            gc.collect()
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.WEXITSTATUS(status) == 0, status
        assert float(K[:5].min()) == 1.0
        a = lease.mark_consumed(); lease.seal(lease.write_back(), a); lease.retire()
        eng.step_end()
        assert len(ctx) == 6
        eng.close()
        print("ok")
    """)
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr)
    assert r.stdout.strip() == "ok"


class _Runner:
    """The usual owner of an engine: the engine's log callback is one of its
    methods (a reference cycle) and it keeps a view array."""

    def __init__(self, **over):
        self.lines = []
        self.eng = akv.Engine(**small(log=self.on_log, **over))
        self.ctx = self.eng.open_context()
        self.ctx.append(np.full((L, 3, H, D), 4.0, np.float32),
                        np.full((L, 3, H, D), 4.0, np.float32))

        def keep(layer, lease, view):
            if layer == 0:
                self.k = view.keys(0)

        one_step(self.eng, [self.ctx], keep)

    def on_log(self, level, message):
        self.lines.append(message)


def _collect(until, tries=4):
    import gc

    for _ in range(tries):
        gc.collect()
        if until():
            return True
    return False


def test_engine_in_a_cycle_through_a_view_array_is_freed_by_the_garbage_collector(destroys):
    """An object holding an engine whose log callback is its own method, and a
    view array: the array held the Engine, and the collector cannot see
    through an ndarray, so the cycle was never collected (the engine, its
    threads and its memory lived until the process exited). Now the array
    holds only the engine's memory: the cycle is collected, the engine closed,
    and its memory freed once the array is gone."""
    r = _Runner()
    assert r.lines  # the callback is the owner's method
    del r
    assert _collect(lambda: len(destroys) == 1), destroys


def test_engine_holding_its_own_view_array_is_freed_by_the_garbage_collector(destroys):
    with akv.Engine(**small()) as probe:
        pass
    destroys.clear()
    eng = akv.Engine(**small())
    ctx = eng.open_context()
    ctx.append(np.ones((L, 2, H, D), np.float32), np.ones((L, 2, H, D), np.float32))

    def keep(layer, lease, view):
        if layer == 0:
            eng.kept = view.keys(0)  # engine -> array -> engine

    one_step(eng, [ctx], keep)
    del eng, ctx, keep
    assert _collect(lambda: len(destroys) == 1), destroys
    assert probe._handle is None


def test_array_kept_past_its_engines_collection_still_holds_the_memory(destroys):
    r = _Runner()
    k = r.k
    del r
    _collect(lambda: False, tries=2)
    assert destroys == []  # the engine object went; its memory stays for k
    assert float(k[:3].min()) == 4.0
    k[:] = 1.0
    assert float(k.sum()) == k.size
    del k
    assert len(destroys) == 1


@pytest.mark.parametrize("route", ["stage", "arena"])
@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16", "fp8_e4m3"])
def test_every_zero_copy_array_lies_inside_its_staging_buffer(route, dtype):
    """keys/values/kv_tensors of contexts of very different lengths, one of
    them at max_tokens after the step's row: every element of every array
    (its lowest and highest address by shape and strides) lies inside one
    staging buffer (info().staging_bytes holds two)."""
    torch = pytest.importorskip("torch")
    npdt = {"f32": np.float32, "f16": np.float16, "bf16": np.uint16, "fp8_e4m3": np.uint8}[dtype]
    cfg = small(n_dense_layers=2, kv_heads=3, dtype=dtype, route=route, max_tokens=20,
                max_contexts=3, device_pool_gib=0 if route == "stage" else 1)
    with akv.Engine(**cfg) as eng:
        buf = eng.info().staging_bytes // 2
        ctxs = [eng.open_context() for _ in range(3)]
        for ctx, n in zip(ctxs, (19, 1, 7)):
            rows = np.ones((2, n, 3, D), npdt)
            ctx.append(rows, rows)
        seen = 0
        with eng.step(ctxs):
            for layer in range(2):
                lease = eng.lease_begin(layer)
                view = lease.wait_ready()
                arrays = [view.keys(i) for i in range(3)] + [view.values(i) for i in range(3)]
                raw = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
                arrays += [t.view(raw[t.element_size()]).numpy() for t in view.kv_tensors()]
                for a in arrays:
                    p = a.__array_interface__["data"][0]
                    ext = [(s - 1) * st for s, st in zip(a.shape, a.strides)]
                    lo = p + sum(min(0, x) for x in ext)
                    hi = p + sum(max(0, x) for x in ext) + a.itemsize
                    assert view.base <= lo and hi <= view.base + buf, (a.shape, lo - view.base,
                                                                       hi - view.base, buf)
                    seen += 1
                del arrays, a
                attn = lease.mark_consumed()
                lease.seal(lease.write_back(), attn)
                lease.retire()
        assert seen == 16 and [len(c) for c in ctxs] == [20, 2, 8]


def test_deferred_destroy_missed_by_two_arrays_ending_at_once_is_made_when_the_memory_goes(
        destroys):
    """Two arrays ending at once on two threads: each export's end sees the
    other still listed and leaves the destroy to it. (Played here by a second
    listed reference that goes without an export's end.) The destroy is made
    when the last holder of the engine's memory goes, the Engine object
    included, never lost."""
    import weakref

    eng = akv.Engine(**small())
    ctx = eng.open_context()
    ctx.append(np.ones((L, 2, H, D), np.float32), np.ones((L, 2, H, D), np.float32))
    kept = []
    one_step(eng, [ctx], lambda layer, lease, view: kept.append(view.keys(0)))
    del ctx
    eng.close()
    assert eng._pending_destroy and destroys == []
    mem = eng._mem
    del eng  # the Engine goes first: the arrays hold only its memory
    assert destroys == []

    class Other:
        pass

    other = Other()
    mem.exports.append(weakref.ref(other))  # the other thread's array, still listed
    kept.clear()
    assert destroys == [] and len(mem.exports) == 1  # this array's end left it to the other
    mem.exports.clear()  # the other's count gone, its end (the check) missed
    assert destroys == []
    del mem
    assert len(destroys) == 1


def test_objects_built_from_a_forged_handle_are_refused_not_read():
    """Context(engine, 0x1000): the classes are public, and a number given as
    the handle went to C, which read the record at that address (a segfault
    for an unmapped one). A handle is what the engine made; a number is
    InvalidArgument, None a dead object."""
    r = run_py("""
        import numpy as np, activekv as akv
        from conftest import small
        eng = akv.Engine(**small())
        junk = np.full(4096, 0x41, np.uint8)
        for h in (0x1000, junk.ctypes.data, eng._handle, -1, 2**70, 1.5, "ctx"):
            for make in (lambda: akv.Context(eng, h), lambda: akv.Lease(eng, h, 0),
                         lambda: akv.Stream(eng, h)):
                try:
                    obj = make()
                except akv.InvalidArgument:
                    continue
                for call in ("length", "close", "mark_consumed", "synchronize", "retire"):
                    try:
                        getattr(obj, call)() if call != "length" else len(obj)
                    except (akv.ActiveKVError, AttributeError, TypeError):
                        pass
                print("made from", h)
        akv.Context(eng, None).close()  # dead: closing twice is a no-op
        akv.Stream(eng, None).destroy()
        try:
            akv.Lease(eng, None, 0).retire()
            raise SystemExit("a dead lease retired")
        except akv.BadHandle:
            pass
        eng.close()
        print("ok")
    """)
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr)
    assert r.stdout.strip() == "ok", r.stdout


def test_view_built_by_hand_from_a_forged_struct_is_refused():
    """View is public: View(lease, akv_view(base=0x1000, ...)) handed out
    arrays over that address (a segfault when read). A View is made from the
    lease's own view, which the library filled."""
    r = run_py("""
        import ctypes, numpy as np, activekv as akv
        from activekv import _lib as L
        from conftest import small
        eng = akv.Engine(**small(n_dense_layers=1))
        ctx = eng.open_context()
        ctx.append(np.ones((1, 2, 2, 8), np.float32), np.ones((1, 2, 2, 8), np.float32))
        eng.step_begin([ctx])
        lease = eng.lease_begin(0)
        real = lease.wait_ready()
        forged = L.akv_view()
        ctypes.memmove(ctypes.byref(forged), ctypes.byref(real._c), ctypes.sizeof(forged))
        forged.base = 0x1000
        for args in ((lease, forged), (None, real._c), (real, real._c), (lease, None)):
            try:
                v = akv.View(*args)
                print("made", float(v.keys(0).sum()))
            except akv.InvalidArgument:
                pass
        assert akv.View(lease, real._c).len == real.len  # its own view: fine
        np.testing.assert_array_equal(lease.view.keys(0)[:2], 1.0)
        a = lease.mark_consumed(); lease.seal(lease.write_back(), a); lease.retire()
        eng.step_end()
        eng.close()
        print("ok")
    """)
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr)
    assert r.stdout.strip() == "ok", r.stdout
