"""Lifetimes of the package's objects: what frees an engine dropped without
close(), and what an exception raised between a library call and the
package's bookkeeping (a Ctrl-C, a MemoryError) leaves behind.

An engine whose last reference goes is freed then, by its reference count,
not at a later garbage collection (its pinned host pool and device memory
are held until then); its contexts, leases, streams and arrays keep it
alive while they live. A call that creates a handle (engine, context,
stream, lease) and is interrupted as the library returns leaves no handle
behind that nothing can free: the handle is written by the library into the
object that owns it, and a create whose object cannot reach the caller is
undone (a lease, which cannot be undone, is handed out again by
lease_begin of its layer).

The interrupts are injected: each test wraps one library function so that it
raises right after the real call returned (a real signal lands there only by
chance). Host backend, no GPU needed.
"""
import contextlib
import gc
import threading
import weakref

import numpy as np
import pytest

import activekv as akv
from activekv import _api, _lib

from conftest import small

L, H, D = 3, 2, 8


def rows(rng, n, layers=L):
    return rng.standard_normal((layers, n, H, D)).astype(np.float32)


@contextlib.contextmanager
def no_collector(destroys):
    """The block runs with the cyclic garbage collector off: what is freed
    there is freed by reference counts. Engines an earlier test left to the
    collector go first, and are not counted."""
    gc.collect()
    destroys.clear()
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def run_layer(eng, lease, stream=None):
    view = lease.wait_ready(stream)
    for i in range(view.n_contexts):
        view.keys(i)[-1] = 1.0
        view.values(i)[-1] = 2.0
    attn = lease.mark_consumed()
    lease.seal(lease.write_back(), attn)
    return lease.retire()


# ------------------------------------------------------------ dropped engines


def test_dropped_engine_is_destroyed_by_its_reference_count(destroys):
    with no_collector(destroys):
        eng = akv.Engine(**small())
        h = eng._handle
        ref = weakref.ref(eng)
        del eng
        assert ref() is None
        assert destroys == [h]


def test_dropped_engine_with_contexts_streams_and_a_finished_step(destroys):
    """Contexts, streams (the default one included) and the leases of a
    finished step name their engine; the engine names them only weakly."""
    rng = np.random.default_rng(1)
    with no_collector(destroys):
        eng = akv.Engine(**small())
        h = eng._handle
        ctx = eng.open_context()
        ctx.append(rows(rng, 2), rows(rng, 2))
        other = eng.stream_create()
        eng.step_begin([ctx])
        for layer in range(L):
            run_layer(eng, eng.lease_begin(layer))
        eng.step_end()
        lease = eng.lease_begin  # a bound method holds the engine as well
        del eng
        assert destroys == []  # the context, the stream and the method hold it
        del ctx, other, lease
        assert destroys == [h]


def test_children_keep_their_engine_alive(destroys):
    rng = np.random.default_rng(2)
    with no_collector(destroys):
        eng = akv.Engine(**small())
        h = eng._handle
        ctx = eng.open_context()
        ctx.append(rows(rng, 1), rows(rng, 1))
        del eng
        assert destroys == []
        assert ctx.length == 1  # usable: its engine lives
        eng = ctx.engine
        stream = eng.stream_create()
        del eng, ctx
        assert destroys == []
        stream.synchronize()
        del stream
        assert destroys == [h]


def test_dropped_engine_mid_step_is_quarantined_and_destroyed(destroys):
    """An engine dropped with a lease unretired: close alone is refused, a
    quarantine releases the lease first (as for a garbage-collected engine),
    and that happens when the last of the engine, its context and its lease
    goes."""
    rng = np.random.default_rng(3)
    with no_collector(destroys):
        eng = akv.Engine(**small())
        h = eng._handle
        ctx = eng.open_context()
        ctx.append(rows(rng, 2), rows(rng, 2))
        eng.step_begin([ctx])
        lease = eng.lease_begin(0)
        view = lease.wait_ready()
        del eng, ctx
        assert destroys == []
        del lease, view
        assert destroys == [h]


def test_dropped_engine_with_a_live_array_waits_for_the_array(destroys):
    rng = np.random.default_rng(4)
    with no_collector(destroys):
        eng = akv.Engine(**small())
        h = eng._handle
        ctx = eng.open_context()
        ctx.append(rows(rng, 2), rows(rng, 2))
        eng.step_begin([ctx])
        lease = eng.lease_begin(0)
        kept = lease.wait_ready().keys(0)
        attn = lease.mark_consumed()
        lease.seal(lease.write_back(), attn)
        lease.retire()
        for layer in range(1, L):
            run_layer(eng, eng.lease_begin(layer))
        eng.step_end()
        del eng, ctx, lease
        assert destroys == []
        float(kept.sum())  # the engine's memory is still there
        del kept
        assert destroys == [h]


@pytest.mark.parametrize("hybrid", [False, True])
@pytest.mark.parametrize("steps", [0, 2])
def test_dropped_cache_frees_its_engine_by_its_reference_count(destroys, hybrid, steps):
    """The usual transformers pattern, make a cache, generate, drop it, frees
    the engine as the cache goes (the decode step left open between forwards
    included), not at a later garbage collection."""
    from test_misuse import _cache, _kv

    torch, cache = _cache(hybrid=hybrid)
    full = [i for i, layer in enumerate(cache.layers)
            if type(layer).__name__ == "ActiveKVLayer"]
    with no_collector(destroys):
        h = cache.engine._handle
        for layer in range(len(cache.layers)):
            cache.update(*_kv(torch, 1, 3, seed=layer), layer)
        for _step in range(steps):
            for layer in range(len(cache.layers)):
                cache.update(*_kv(torch, 1, 1, seed=layer), layer)
        assert full
        del cache
        assert destroys == [h]


# ------------------------------------------------------------ interrupted creates


def raise_after(monkeypatch, name, exc=KeyboardInterrupt, times=1):
    """Makes the package's `name` call raise `exc` right after the real call
    returned AKV_OK, the first `times` times it does (where a Ctrl-C lands
    at the first bytecode after it). Returns the statuses of the real
    calls."""
    real = getattr(_api.lib, name)
    statuses = []

    def call(*args):
        st = real(*args)
        statuses.append(st)
        if st == 0 and statuses.count(0) <= times:
            raise exc()
        return st

    monkeypatch.setattr(_api.lib, name, call)
    return statuses


@pytest.mark.parametrize("exc", [KeyboardInterrupt, MemoryError])
def test_interrupted_engine_create_frees_the_engine(monkeypatch, destroys, exc):
    statuses = raise_after(monkeypatch, "akv_engine_create", exc)
    with no_collector(destroys):
        with pytest.raises(exc):
            akv.Engine(**small())
        assert statuses == [0]  # the library made the engine
        assert len(destroys) == 1  # and it was destroyed at once
        with akv.Engine(**small()):
            pass
        assert len(destroys) == 2


def test_engine_create_interrupted_after_the_call_frees_the_engine(monkeypatch, destroys):
    """The rest of the create (its first info) cut short: destroyed too."""
    raise_after(monkeypatch, "akv_engine_info_get", MemoryError)
    with no_collector(destroys):
        with pytest.raises(MemoryError):
            akv.Engine(**small())
        assert len(destroys) == 1


@pytest.mark.parametrize("exc", [KeyboardInterrupt, MemoryError])
def test_interrupted_open_context_closes_the_context(monkeypatch, engine, exc):
    """The context a cut-short open made is closed again: its host slot is
    free (small(): two), and nothing is left for the engine's close."""
    statuses = raise_after(monkeypatch, "akv_context_open", exc, times=3)
    for _ in range(3):
        with pytest.raises(exc):
            engine.open_context()
    assert statuses == [0, 0, 0]
    assert engine.admission_counters()["release"] == 3
    a, b = engine.open_context(), engine.open_context()  # both slots free
    with pytest.raises(akv.RefusedQueue):
        engine.open_context()
    assert len(engine._contexts) == 2
    a.close()
    b.close()


def test_dropped_context_is_closed(engine):
    """A context whose object goes without close() (also one a Ctrl-C took
    from the caller as open_context returned) is closed then."""
    a = engine.open_context()
    engine.open_context()  # dropped at once
    b = engine.open_context()  # the slot is free again
    with pytest.raises(akv.RefusedQueue):
        engine.open_context()
    assert engine.admission_counters()["release"] == 1
    a.close()
    b.close()


def test_dropped_context_of_the_open_step_is_closed_at_its_end(destroys):
    rng = np.random.default_rng(5)
    with no_collector(destroys):
        eng = akv.Engine(**small())
        ctx = eng.open_context()
        ctx.append(rows(rng, 2), rows(rng, 2))
        eng.step_begin([ctx])
        del ctx  # InUse: cannot be closed now, and is not lost
        assert eng.admission_counters()["release"] == 0
        for layer in range(L):
            run_layer(eng, eng.lease_begin(layer))
        eng.step_end()
        assert eng.info().steps == 1
        assert eng.admission_counters()["release"] == 1  # closed at the step's end
        a, b = eng.open_context(), eng.open_context()  # both slots free
        del a, b
        eng.close()
        assert len(destroys) == 1


@pytest.mark.parametrize("exc", [KeyboardInterrupt, MemoryError])
@pytest.mark.parametrize("default", [False, True])
def test_interrupted_stream_create_destroys_the_stream(monkeypatch, destroys, exc, default):
    """At most 8 streams per engine: nine cut-short creates leave every one
    free, and the engine closes."""
    statuses = raise_after(monkeypatch, "akv_stream_create", exc, times=9)
    with no_collector(destroys):
        eng = akv.Engine(**small())
        for _ in range(9):
            with pytest.raises(exc):
                eng.default_stream() if default else eng.stream_create()
        assert statuses == [0] * 9
        assert not any(box.value for box in eng._streams)
        streams = [eng.stream_create() for _ in range(7)]
        s = eng.default_stream()
        assert eng.default_stream() is s
        with pytest.raises(akv.OutOfMemory):
            eng.stream_create()
        del streams, s
        eng.close()
        assert len(destroys) == 1


@pytest.mark.parametrize("exc", [KeyboardInterrupt, MemoryError])
def test_interrupted_lease_begin_hands_the_lease_out_again(monkeypatch, exc):
    """A begun lease cannot be undone, and one lost blocked step_end until a
    quarantine: lease_begin of its layer hands it out again, and the step
    ends as any other."""
    rng = np.random.default_rng(6)
    statuses = raise_after(monkeypatch, "akv_lease_begin", exc, times=2)
    with akv.Engine(**small()) as eng:
        ctx = eng.open_context()
        k, v = rows(rng, 2), rows(rng, 2)
        ctx.append(k, v)
        eng.step_begin([ctx])
        with pytest.raises(exc):
            eng.lease_begin(0)
        receipts = [run_layer(eng, eng.lease_begin(0))]
        with pytest.raises(exc):
            eng.lease_begin(1)
        receipts += [run_layer(eng, eng.lease_begin(layer)) for layer in (1, 2)]
        assert statuses == [0, 0, 0]  # one begin each
        assert [r.layer for r in receipts] == [0, 1, 2]
        eng.step_end()
        info = eng.info()
        assert info.steps == 1 and not info.quarantined and info.leases_retired == 3
        got_k, got_v = ctx.read(0, 0, 3)
        assert (got_k[:2] == k[0]).all() and (got_k[2] == 1.0).all() and (got_v[2] == 2.0).all()
        ctx.close()


def test_dropped_ready_lease_is_handed_out_with_its_stream(engine):
    rng = np.random.default_rng(7)
    ctx = engine.open_context()
    ctx.append(rows(rng, 1), rows(rng, 1))
    stream = engine.stream_create()
    engine.step_begin([ctx])
    lease = engine.lease_begin(0)
    lease.wait_ready(stream)
    handle = lease._handle
    del lease
    lease = engine.lease_begin(0)
    assert lease._handle == handle and lease.layer == 0
    attn = lease.mark_consumed()  # on the stream wait_ready was given
    lease.seal(lease.write_back(), attn)
    lease.retire()
    with pytest.raises((akv.InvalidArgument, akv.StepState)):
        engine.lease_begin(0)  # retired: not handed out again
    for layer in (1, 2):
        run_layer(engine, engine.lease_begin(layer), stream)
    engine.step_end()
    stream.destroy()
    ctx.close()


def test_live_lease_is_not_handed_out_twice(engine):
    rng = np.random.default_rng(8)
    ctx = engine.open_context()
    ctx.append(rows(rng, 1), rows(rng, 1))
    engine.step_begin([ctx])
    lease = engine.lease_begin(0)
    with pytest.raises(akv.InvalidArgument):
        engine.lease_begin(0)  # the library's answer: layer 0 is begun
    for layer in range(L):
        run_layer(engine, lease if layer == 0 else engine.lease_begin(layer))
    engine.step_end()
    ctx.close()


def test_quarantine_releases_a_lost_lease(engine):
    """A lease lost and not taken again: the quarantine kills its handle too,
    so a later lease_begin never hands out a dead one."""
    rng = np.random.default_rng(9)
    ctx = engine.open_context()
    ctx.append(rows(rng, 1), rows(rng, 1))
    engine.step_begin([ctx])
    engine.lease_begin(0)  # dropped
    engine.quarantine()
    assert not any(box.value for box in engine._lease_boxes)
    with pytest.raises(akv.Quarantined):
        engine.lease_begin(0)


# ------------------------------------------------------------ the open step


def test_interrupted_step_begin_leaves_the_step_open(monkeypatch, destroys):
    """A step_begin cut short as it returned left the engine reading as if no
    step were open: close() destroyed its streams, then was refused."""
    rng = np.random.default_rng(10)
    raise_after(monkeypatch, "akv_step_begin")
    with no_collector(destroys):
        eng = akv.Engine(**small())
        ctx = eng.open_context()
        ctx.append(rows(rng, 1), rows(rng, 1))
        stream = eng.stream_create()
        with pytest.raises(KeyboardInterrupt):
            eng.step_begin([ctx])
        with pytest.raises(akv.Busy):
            eng.close()  # refused first: the stream is left as it was
        stream.synchronize()
        for layer in range(L):
            run_layer(eng, eng.lease_begin(layer), stream)
        eng.step_end()
        stream.destroy()
        ctx.close()
        eng.close()
        assert len(destroys) == 1


def test_interrupted_step_end_leaves_the_step_ended(monkeypatch, destroys):
    """A step_end cut short as it returned left the step reading as open:
    close() was refused (Busy) for good, and so was step_end."""
    rng = np.random.default_rng(11)
    raise_after(monkeypatch, "akv_step_end")
    with no_collector(destroys):
        eng = akv.Engine(**small())
        ctx = eng.open_context()
        ctx.append(rows(rng, 1), rows(rng, 1))
        eng.step_begin([ctx])
        for layer in range(L):
            run_layer(eng, eng.lease_begin(layer))
        with pytest.raises(KeyboardInterrupt):
            eng.step_end()
        assert eng.info().steps == 1 and len(ctx) == 2
        ctx.close()
        eng.close()
        assert len(destroys) == 1


def test_refused_step_calls_change_nothing(engine):
    rng = np.random.default_rng(12)
    ctx = engine.open_context()
    ctx.append(rows(rng, 1), rows(rng, 1))
    with pytest.raises(akv.StepState):
        engine.step_end()  # no step
    engine.close()  # not read as open


# ------------------------------------------------------------ ActiveKVCache


def _decode(cache, torch, steps, seed=0, hook=None):
    """Prefill 3 tokens, then `steps` decode steps over every layer; hook(step,
    layer) runs before each decode update and may arm an interrupt (the
    update it interrupts is then retried)."""
    from test_misuse import _kv

    n = len(cache.layers)
    for layer in range(n):
        cache.update(*_kv(torch, 1, 3, seed=seed + layer), layer)
    for step in range(steps):
        for layer in range(n):
            kv = _kv(torch, 1, 1, seed=seed + 100 * (step + 1) + layer)
            if hook is not None and hook(step, layer):
                with pytest.raises(KeyboardInterrupt):
                    cache.update(*kv, layer)
            cache.update(*kv, layer)


def _rows(cache, n):
    cache.finish()
    ctx = cache.contexts[0]
    return [ctx.read(d, 0, n) for d in range(len(cache.dense_layers))]


@pytest.mark.parametrize("hybrid", [False, True])
@pytest.mark.parametrize("call,at", [("akv_step_begin", 0), ("akv_step_begin", 2),
                                     ("akv_step_end", 1), ("akv_step_end", 2)])
def test_cache_update_cut_short_at_the_step_boundary_can_be_retried(monkeypatch, call, at,
                                                                    hybrid):
    """An interrupt as the engine's step_begin or step_end returned, inside a
    decode update: the retried update goes on, and the rows are those of an
    uninterrupted run (the cache read the step as not begun, or not ended,
    and refused every later update)."""
    from test_misuse import _cache

    torch, ref = _cache(hybrid=hybrid)
    with ref:
        _decode(ref, torch, 3)
        want = _rows(ref, 6)
    torch, cache = _cache(hybrid=hybrid)
    first = cache.dense_layers[0]  # the update that moves the step boundary
    real = getattr(_api.lib, call)
    armed = []

    def interrupting(*args):
        st = real(*args)
        if armed and st == 0:
            armed.clear()
            raise KeyboardInterrupt
        return st

    monkeypatch.setattr(_api.lib, call, interrupting)

    def hook(step, layer):
        if (step, layer) == (at, first):
            armed.append(True)
            return True
        return False

    with cache:
        _decode(cache, torch, 3, hook=hook)
        assert not armed  # the interrupt was raised
        got = _rows(cache, 6)
    for (wk, wv), (gk, gv) in zip(want, got):
        assert np.array_equal(wk, gk) and np.array_equal(wv, gv)


def test_cache_update_cut_short_after_a_lease_began_is_unusable_and_closes(destroys):
    """An interrupt as the lease's begin returned: the lease was lost and the
    retried update raised StepState; now the cache says why it is unusable
    and close() frees the engine (a quarantine releases the lease)."""
    from test_misuse import _cache, _kv

    torch, cache = _cache()
    for layer in range(2):
        cache.update(*_kv(torch, 1, 3, seed=layer), layer)
    api = cache._driver.api
    real = api.begin

    def interrupting(*args):
        api.begin = real
        st = real(*args)
        raise KeyboardInterrupt

    api.begin = interrupting
    with pytest.raises(KeyboardInterrupt):
        cache.update(*_kv(torch, 1, 1), 0)
    with pytest.raises(akv.Quarantined, match="KeyboardInterrupt"):
        cache.update(*_kv(torch, 1, 1), 0)
    h = cache.engine._handle
    cache.close()
    assert h in destroys


def test_try_retire_cut_short_while_not_ready_keeps_the_lease(monkeypatch):
    """try_retire clears the handle before its call (a retire cut short must
    not leave a dead handle behind) and gave it back only when the library
    answered "not ready": an interrupt landing after that answer left the
    lease dead to Python and alive in the library (step_end refused for
    good). The receipt, filled only by a retire, now tells the two apart."""
    rng = np.random.default_rng(13)
    real = _api.lib.akv_lease_try_retire
    statuses = []

    def interrupted(*args):
        st = real(*args)
        statuses.append(st)
        if st == 24 and statuses.count(24) == 1:  # AKV_ERR_NOT_READY
            raise KeyboardInterrupt
        return st

    monkeypatch.setattr(_api.lib, "akv_lease_try_retire", interrupted)
    gate = threading.Event()
    hook = _lib.HOST_FN(lambda _arg: gate.wait(30))
    with akv.Engine(**small()) as eng:
        ctx = eng.open_context()
        ctx.append(rows(rng, 1), rows(rng, 1))
        eng.step_begin([ctx])
        lease = eng.lease_begin(0)
        s = eng.default_stream()
        lease.wait_ready(s)
        try:
            # the attention event, and the write-back behind it, wait for the gate
            assert _lib.lib.akv_stream_launch_host(eng._handle, s.handle, hook, None) == 0
            attn = lease.mark_consumed()
            lease.seal(lease.write_back(), attn)
            with pytest.raises(KeyboardInterrupt):
                lease.try_retire()
        finally:
            gate.set()
        assert statuses == [24]
        assert lease._handle is not None  # alive, as in the library
        lease.retire()
        for layer in (1, 2):
            run_layer(eng, eng.lease_begin(layer))
        eng.step_end()
        ctx.close()


def test_retire_cut_short_after_retiring_leaves_the_lease_dead(monkeypatch, engine):
    rng = np.random.default_rng(14)
    raise_after(monkeypatch, "akv_lease_retire")
    ctx = engine.open_context()
    ctx.append(rows(rng, 1), rows(rng, 1))
    engine.step_begin([ctx])
    lease = engine.lease_begin(0)
    lease.wait_ready()
    attn = lease.mark_consumed()
    lease.seal(lease.write_back(), attn)
    with pytest.raises(KeyboardInterrupt):
        lease.retire()
    assert lease._handle is None
    with pytest.raises(akv.BadHandle):
        lease.retire()
    for layer in (1, 2):
        run_layer(engine, engine.lease_begin(layer))
    engine.step_end()
    ctx.close()


def test_quarantine_cut_short_after_an_uncertain_fence_retains_everything(monkeypatch):
    """An uncertain quarantine (completion not established) retains every
    lease; one cut short as it returned was taken as a success (leases dead,
    step ended, nothing retained). The report, filled either way, decides
    now."""
    rng = np.random.default_rng(15)
    k = rows(rng, 1)

    def begun(eng):
        ctx = eng.open_context()
        ctx.append(k, k)
        eng.step_begin([ctx])
        return ctx, eng.lease_begin(0)

    with akv.Engine(**small()) as probe:  # the synchronisations before the quarantine
        ctx, lease = begun(probe)
        n = probe.info().backend_ops["sync"]
        probe.quarantine()
    del ctx, lease
    eng = akv.Engine(**small(fault_fail_nth=n + 1, fault_kind="sync"))
    ctx, lease = begun(eng)
    statuses = raise_after(monkeypatch, "akv_engine_quarantine", times=0)
    real = _api.lib.akv_engine_quarantine

    def interrupted(*args):
        real(*args)
        raise KeyboardInterrupt

    monkeypatch.setattr(_api.lib, "akv_engine_quarantine", interrupted)
    with pytest.raises(KeyboardInterrupt):
        eng.quarantine()  # its first synchronise is the injected failure
    assert statuses == [17]  # AKV_ERR_UNCERTAIN_FENCE
    assert eng._retained and eng._step_open and lease._handle is not None
    with pytest.raises(akv.Busy):
        eng.close()  # retained: nothing freed
    eng._box.value = None  # retained on purpose; leave it to the process


@pytest.mark.parametrize("call", ["akv_lease_wait_ready", "akv_lease_mark_consumed",
                                  "akv_lease_write_back"])
def test_lease_call_cut_short_after_it_happened_keeps_its_result(monkeypatch, engine, call):
    """What wait_ready, mark_consumed and write_back return was lost with an
    interrupt landing as they returned, and the library refuses them a
    second time: only a quarantine ended the lease. The lease keeps it now
    (Lease.view, .attention, .tail) and the step ends normally."""
    rng = np.random.default_rng(16)
    k = rows(rng, 2)
    ctx = engine.open_context()
    ctx.append(k, k)
    engine.step_begin([ctx])
    lease = engine.lease_begin(0)
    assert lease.view is None and lease.attention is None and lease.tail is None
    raise_after(monkeypatch, call)
    steps = [("akv_lease_wait_ready", lease.wait_ready, lambda: lease.view),
             ("akv_lease_mark_consumed", lease.mark_consumed, lambda: lease.attention),
             ("akv_lease_write_back", lease.write_back, lambda: lease.tail)]
    got = []
    for name, fn, kept in steps:
        if name == call:
            with pytest.raises(KeyboardInterrupt):
                fn()
            with pytest.raises(akv.LeaseState):
                fn()  # it happened: refused a second time
            got.append(kept())
        else:
            got.append(fn())
    view, attn, tail = got
    assert np.array_equal(view.keys(0)[:2], k[0])  # the staged history, as wait_ready gave it
    assert attn == lease.attention and tail == lease.tail
    lease.seal(tail, attn)
    lease.retire()
    for layer in (1, 2):
        run_layer(engine, engine.lease_begin(layer))
    engine.step_end()
    assert not engine.info().quarantined
    ctx.close()
