"""Hostile use of the Python package, as an outside tester trying to crash it.

The rule every test holds the package to: no sequence of public calls may
crash the interpreter, read freed memory or silently hand back wrong data;
every misuse raises one of activekv's exceptions, or ValueError/TypeError,
with a message that says what was wrong. Host backend, no GPU needed.
"""
import gc
import threading
import time

import numpy as np
import pytest

import activekv as akv

from conftest import held_by_another_thread, quiet, small

L, H, D = 3, 2, 8


def rows(rng, layers, n, dtype=np.float32):
    shape = (layers, n, H, D) if layers else (n, H, D)
    return rng.standard_normal(shape).astype(dtype)


def full_step(eng, ctxs, keep=None):
    """One step over ctxs; keep(layer, view) may take arrays out of the view."""
    with eng.step(ctxs):
        for layer in range(L):
            lease = eng.lease_begin(layer)
            view = lease.wait_ready()
            if keep is not None:
                keep(layer, view)
            attn = lease.mark_consumed()
            lease.seal(lease.write_back(), attn)
            lease.retire()


def misuse(exc=(akv.ActiveKVError, ValueError, TypeError)):
    return pytest.raises(exc)


# ------------------------------------------------------------ lifetimes


def test_every_object_of_a_closed_engine_raises_bad_handle():
    rng = np.random.default_rng(0)
    eng = akv.Engine(**small())
    ctx = eng.open_context()
    ctx.append(rows(rng, L, 3), rows(rng, L, 3))
    stream = eng.stream_create()
    eng.close()
    eng.close()
    calls = [eng.info, eng.headroom, eng.admission_counters, eng.admission_log,
             lambda: eng.explain(), lambda: eng.explain(ctx), lambda: eng.last_error,
             eng.default_stream, eng.stream_create, eng.open_context, eng.quarantine,
             lambda: eng.step_begin([ctx]), eng.step_end, lambda: eng.lease_begin(0),
             lambda: eng.headroom_release(0), lambda: eng.headroom_take(0),
             lambda: ctx.length, lambda: ctx.id, lambda: ctx.read(0, 0, 1),
             lambda: ctx.append(rows(rng, L, 1), rows(rng, L, 1)),
             lambda: ctx.append_layer(0, rows(rng, 0, 1), rows(rng, 0, 1)),
             stream.synchronize, lambda: stream.handle]
    for call in calls:
        with pytest.raises(akv.BadHandle):
            call()
    ctx.close()  # no-ops after the engine
    stream.destroy()
    assert repr(ctx) == "<activekv.Context closed>"


def test_close_inside_with_then_exit_and_double_close():
    with akv.Engine(**small()) as eng:
        with eng.open_context() as ctx:
            ctx.close()
            ctx.close()
        eng.close()
    eng.close()
    with pytest.raises(akv.BadHandle):
        ctx.length


def test_closed_context_raises_bad_handle_everywhere(engine):
    rng = np.random.default_rng(1)
    ctx = engine.open_context()
    other = engine.open_context()
    other.append(rows(rng, L, 2), rows(rng, L, 2))
    ctx.close()
    for call in (lambda: ctx.read(0, 0, 1), lambda: ctx.append(rows(rng, L, 1), rows(rng, L, 1)),
                 lambda: ctx.append_layer(0, rows(rng, 0, 1), rows(rng, 0, 1)),
                 lambda: ctx.length, lambda: engine.step_begin([ctx]),
                 lambda: engine.explain(ctx)):
        with pytest.raises(akv.BadHandle):
            call()
    engine.step_begin([other])
    lease = engine.lease_begin(0)
    lease.wait_ready()
    attn = lease.mark_consumed()
    with pytest.raises(akv.BadHandle):
        lease.write_back([ctx])
    lease.seal(lease.write_back(), attn)
    lease.retire()
    for layer in (1, 2):
        lease = engine.lease_begin(layer)
        lease.wait_ready()
        attn = lease.mark_consumed()
        lease.seal(lease.write_back(), attn)
        lease.retire()
    engine.step_end()


def test_retired_lease_and_its_view_are_dead(engine):
    rng = np.random.default_rng(2)
    ctx = engine.open_context()
    ctx.append(rows(rng, L, 2), rows(rng, L, 2))
    engine.step_begin([ctx])
    lease = engine.lease_begin(0)
    view = lease.wait_ready()
    attn = lease.mark_consumed()
    tail = lease.write_back()
    lease.seal(tail, attn)
    lease.retire()
    for call in (lease.wait_ready, lease.mark_consumed, lease.write_back,
                 lambda: lease.seal(tail, attn), lease.retire, lease.try_retire,
                 lambda: view.keys(0), lambda: view.values(0), view.kv_tensors):
        with pytest.raises(akv.BadHandle):
            call()
    for layer in (1, 2):
        run = engine.lease_begin(layer)
        run.wait_ready()
        a = run.mark_consumed()
        run.seal(run.write_back(), a)
        run.retire()
    engine.step_end()


def test_leases_released_by_quarantine_are_dead_in_python():
    rng = np.random.default_rng(3)
    eng = akv.Engine(**small())
    ctx = eng.open_context()
    ctx.append(rows(rng, L, 2), rows(rng, L, 2))
    eng.step_begin([ctx])
    lease = eng.lease_begin(0)
    view = lease.wait_ready()
    eng.quarantine()
    with pytest.raises(akv.BadHandle, match="retired"):
        lease.retire()  # refused in Python: the C record may be handed out again
    with pytest.raises(akv.BadHandle):
        view.keys(0)
    eng.close()


def test_views_outliving_lease_step_context_and_engine_never_read_freed_memory():
    """The zero-copy arrays keep the engine's memory alive: close() closes the
    engine for every call but frees its memory when the last array is gone."""
    rng = np.random.default_rng(4)
    k, v = rows(rng, L, 5), rows(rng, L, 5)
    eng = akv.Engine(**small())
    ctx = eng.open_context()
    ctx.append(k, v)
    kept = {}

    def keep(layer, view):
        if layer == 0:
            kept["k"] = view.keys(0)
            kept["v"] = view.values(0)[:5]  # a derived view
            kept["kt"], _ = view.kv_tensors()  # a CPU torch tensor (if torch is there)

    try:
        import torch  # noqa: F401
    except ImportError:
        keep0 = keep

        def keep(layer, view):  # noqa: F811
            if layer == 0:
                kept["k"] = view.keys(0)
                kept["v"] = view.values(0)[:5]
        del keep0
    full_step(eng, [ctx], keep)
    assert eng.live_arrays >= 2
    ctx.close()
    eng.close()
    with pytest.raises(akv.BadHandle):
        eng.info()
    # memory still mapped: reading (and writing) it is safe; the rows are those
    # of the last lease that used the buffer, not necessarily layer 0's
    assert kept["k"].shape == (6, H, D)
    assert np.isfinite(kept["v"].astype(np.float64)).all() or True
    kept["k"][:] = 0.0
    float(kept["k"].sum())
    if "kt" in kept:
        float(kept["kt"].sum())
    assert eng._pending_destroy  # destroy deferred
    kept.clear()
    gc.collect()
    assert eng.live_arrays == 0 and not eng._pending_destroy  # destroyed now


def test_view_arrays_dropped_before_close_destroy_at_close(engine):
    rng = np.random.default_rng(5)
    ctx = engine.open_context()
    ctx.append(rows(rng, L, 2), rows(rng, L, 2))
    full_step(engine, [ctx], lambda layer, view: view.keys(0))
    gc.collect()
    assert engine.live_arrays == 0
    engine.close()
    assert not engine._pending_destroy


def test_engine_dropped_while_a_view_array_lives():
    rng = np.random.default_rng(6)
    eng = akv.Engine(**small())
    ctx = eng.open_context()
    ctx.append(rows(rng, L, 3), rows(rng, L, 3))
    kept = []
    full_step(eng, [ctx], lambda layer, view: kept.append(view.keys(0)))
    del eng, ctx
    gc.collect()
    for a in kept:
        float(a.sum())  # the array keeps the engine (and its memory) alive
    del a  # the loop's last array too: the engine goes here, not in a later test
    kept.clear()
    gc.collect()


# ------------------------------------------------------------ wrong types and values

BAD_INTS = [-1, 2 ** 32, 2 ** 64, 2 ** 70, 1.5, float("nan"), None, True, "0", b"0", [0]]


@pytest.mark.parametrize("field", ["n_dense_layers", "max_tokens", "host_pool_gib", "kv_heads"])
@pytest.mark.parametrize("value", BAD_INTS)
def test_config_bad_integer_values(field, value):
    with misuse():
        akv.Engine(**small(**{field: value}))


@pytest.mark.parametrize("field,value", [
    ("dtype", 2), ("dtype", "float32"), ("dtype", None), ("backend", "gpu"), ("route", 1),
    ("fit_mode", True), ("log_level", "loud"), ("fault_kind", "nope"), ("struct_size", 4),
    ("log_fn", 0), ("not_a_field", 1), ("", 1)])
def test_config_bad_enum_and_unknown_fields(field, value):
    with misuse():
        akv.Engine(**small(**{field: value}))


def test_engine_config_numpy_ints_are_fine_and_positional_or_bad_log_refused():
    with akv.Engine(**small(n_dense_layers=np.int64(3), max_tokens=np.uint32(32))) as eng:
        assert eng.config["n_dense_layers"] == 3
    cfg = small()
    del cfg["log"]
    with pytest.raises(TypeError):
        akv.Engine(quiet, **cfg)  # positional: not silently taken as the log sink
    with pytest.raises(TypeError, match="not callable"):
        akv.Engine(log=5, **cfg)


@pytest.mark.parametrize("value", BAD_INTS + [3, 2 ** 32 - 1])
def test_layer_indices(engine, value):
    rng = np.random.default_rng(7)
    ctx = engine.open_context()
    with misuse():
        ctx.append_layer(value, rows(rng, 0, 1), rows(rng, 0, 1))
    with misuse():
        ctx.read(value, 0, 1)
    ctx.append(rows(rng, L, 1), rows(rng, L, 1))
    with engine.step([ctx]):
        with misuse():
            engine.lease_begin(value)
        for layer in range(L):
            lease = engine.lease_begin(np.int32(layer))
            lease.wait_ready()
            attn = lease.mark_consumed()
            lease.seal(lease.write_back(), attn)
            lease.retire()


@pytest.mark.parametrize("first,n", [(-1, 1), (0, -1), (1.0, 1), (0, None), (0, 2 ** 31),
                                     (2 ** 32 - 1, 2), (0, 33), (32, 1), (True, 1)])
def test_read_ranges_refused_without_allocating(engine, first, n):
    ctx = engine.open_context()
    with misuse():
        ctx.read(0, first, n)


def test_read_rows_past_the_length(engine):
    rng = np.random.default_rng(8)
    ctx = engine.open_context()
    ctx.append(rows(rng, L, 2), rows(rng, L, 2))
    with pytest.raises(akv.InvalidArgument):
        ctx.read(0, 1, 2)
    k, _ = ctx.read(0, 2, 0)
    assert k.shape == (0, H, D)


@pytest.mark.parametrize("kw", [dict(target_pages=-1), dict(target_pages=1.5),
                                dict(target_pages=2 ** 70), dict(burst_pages=None),
                                dict(burst_pages=-3), dict(target_pages="1")])
def test_open_context_bad_values(engine, kw):
    with misuse():
        engine.open_context(**kw)


def test_bad_contexts_for_step_write_back_and_explain(engine):
    rng = np.random.default_rng(9)
    ctx = engine.open_context()
    ctx.append(rows(rng, L, 1), rows(rng, L, 1))
    with akv.Engine(**small()) as other:
        foreign = other.open_context()
        foreign.append(rows(rng, L, 1), rows(rng, L, 1))
        for bad in ([None], [1], ["ctx"], ctx, "ab", 5, [ctx, ctx], [], [foreign],
                    [ctx, foreign]):
            with misuse():
                engine.step_begin(bad)
        with misuse():
            engine.explain(5)
        with misuse():
            engine.explain(foreign)
        engine.step_begin([ctx])
        lease = engine.lease_begin(0)
        lease.wait_ready()
        attn = lease.mark_consumed()
        for bad in ([None], [foreign], ctx, 7):
            with misuse():
                lease.write_back(bad)
        lease.seal(lease.write_back([ctx]), attn)
        lease.retire()
        for layer in (1, 2):
            lease = engine.lease_begin(layer)
            lease.wait_ready()
            a = lease.mark_consumed()
            lease.seal(lease.write_back(), a)
            lease.retire()
        engine.step_end()
    assert ctx.length == 2


def test_bad_streams_and_fences(engine):
    rng = np.random.default_rng(10)
    ctx = engine.open_context()
    ctx.append(rows(rng, L, 1), rows(rng, L, 1))
    dead = engine.stream_create()
    dead.destroy()
    with akv.Engine(**small()) as other:
        foreign = other.stream_create()
        engine.step_begin([ctx])
        lease = engine.lease_begin(0)
        for bad in (12345, True, -1, 2 ** 70, 1.5, "s", dead, foreign, object()):
            with misuse():
                lease.wait_ready(bad)
        lease.wait_ready()
        for bad in (12345, dead, foreign):
            with misuse():
                lease.mark_consumed(bad)
        attn = lease.mark_consumed()
        tail = lease.write_back()
        for t, a in ((akv.Fence(-1), attn), (akv.Fence(2 ** 70), attn), (tail, akv.Fence(None)),
                     (tail, akv.Fence(1.5)), (None, attn), (tail.serial, attn.serial),
                     (attn, tail)):
            with misuse():
                lease.seal(t, a)
        lease.seal(tail, attn)
        lease.retire()
        for layer in (1, 2):
            lease = engine.lease_begin(layer)
            lease.wait_ready()
            a = lease.mark_consumed()
            lease.seal(lease.write_back(), a)
            lease.retire()
        engine.step_end()


def test_view_context_index(engine):
    rng = np.random.default_rng(11)
    a, b = engine.open_context(), engine.open_context()
    for c in (a, b):
        c.append(rows(rng, L, 2), rows(rng, L, 2))

    def keep(layer, view):
        for bad in (-1, 2, 1.5, True, None, "0", 2 ** 70):
            with misuse():
                view.keys(bad)
        assert view.keys(np.int64(1)).shape == (3, H, D)

    full_step(engine, [a, b], keep)


BAD_ROWS = [
    ("float64", lambda k: k.astype(np.float64)),
    ("float16", lambda k: k.astype(np.float16)),
    ("int8", lambda k: k.astype(np.int8)),
    ("complex64", lambda k: k.astype(np.complex64)),
    ("bool", lambda k: k.astype(bool)),
    ("object", lambda k: k.astype(object)),
    ("str", lambda k: k.astype(str)),
    ("big-endian", lambda k: k.astype(">f4")),
    ("transposed", lambda k: np.swapaxes(k, 2, 3)),
    ("strided", lambda k: np.concatenate([k, k], axis=-1)[..., ::2]),
    ("fortran", lambda k: np.asfortranarray(k)),
    ("broadcast", lambda k: np.broadcast_to(k[:, :1], k.shape)),
    ("3d", lambda k: k[0]),
    ("5d", lambda k: k[None]),
    ("heads", lambda k: k[:, :, :1].copy()),
    ("dims", lambda k: k[..., :4].copy()),
    ("layers", lambda k: k[:2].copy()),
    ("none", lambda k: None),
    ("list", lambda k: k.tolist()),
    ("scalar", lambda k: np.float32(1.0)),
    ("bytes", lambda k: k.tobytes()),
]


@pytest.mark.parametrize("name,bad", BAD_ROWS, ids=[n for n, _ in BAD_ROWS])
def test_append_bad_rows_changes_nothing(engine, name, bad):
    rng = np.random.default_rng(12)
    ctx = engine.open_context()
    k, v = rows(rng, L, 4), rows(rng, L, 4)
    with misuse():
        ctx.append(bad(k), v)
    with misuse():
        ctx.append(k, bad(v))
    if name != "3d":  # one layer's rows are 3-d: that one is right for append_layer
        x = bad(k)
        if name not in ("5d", "layers") and isinstance(x, np.ndarray) and x.ndim == 4:
            x = x[0]  # the same fault in one layer's rows
        with misuse():
            ctx.append_layer(0, x, v[0])
    assert ctx.length == 0
    ctx.append(k, v)  # still usable
    assert np.array_equal(ctx.read(1, 0, 4)[0], k[1])


def test_append_torch_tensors_hostile():
    torch = pytest.importorskip("torch")
    with akv.Engine(**small()) as eng, eng.open_context() as ctx:
        k = torch.randn(L, 2, H, D)
        for bad in (k.double(), k.half(), k.transpose(2, 3), k[..., ::2], k.to("meta"),
                    k.to_sparse(), torch.zeros(L, 2, H, D, dtype=torch.complex64)[..., :D].real):
            with misuse():
                ctx.append(bad, k)
        g = k.clone().requires_grad_(True)
        ctx.append(g, g)  # read only: autograd is not in the way
        assert np.array_equal(ctx.read(0, 0, 2)[0], k[0].numpy())


def test_tokens_beyond_max_tokens_append_nothing(engine):
    rng = np.random.default_rng(13)
    ctx = engine.open_context()
    ctx.append(rows(rng, L, 30), rows(rng, L, 30))
    with pytest.raises(akv.Capacity):
        ctx.append(rows(rng, L, 3), rows(rng, L, 3))
    with pytest.raises(akv.Capacity):
        ctx.append_layer(1, rows(rng, 0, 3), rows(rng, 0, 3))
    assert ctx.length == 30
    ctx.append(rows(rng, L, 2), rows(rng, L, 2))
    assert ctx.length == 32
    with pytest.raises(akv.CapacityError):
        engine.step_begin([ctx])  # no room for the step's row: never staged past the end


@pytest.mark.parametrize("value", [-1, 1.5, True, "1", 2 ** 64])
def test_headroom_and_fit_bad_values(engine, value):
    with misuse():
        engine.headroom_release(value)
    with misuse():
        engine.headroom_take(value)
    cfg = {k: v for k, v in small().items() if k != "log"}
    with misuse():
        akv.fit(**dict(cfg, max_tokens=value))


def test_state_machine_misuse_changes_nothing(engine):
    rng = np.random.default_rng(14)
    ctx = engine.open_context()
    ctx.append(rows(rng, L, 2), rows(rng, L, 2))
    with pytest.raises(akv.StepState):
        engine.lease_begin(0)
    with pytest.raises(akv.StepState):
        engine.step_end()
    engine.step_begin([ctx])
    with pytest.raises(akv.StepState):
        engine.step_begin([ctx])
    with pytest.raises(akv.Busy):
        engine.close()
    with pytest.raises(akv.InUse):
        ctx.close()
    with pytest.raises(akv.InUse):
        ctx.append(rows(rng, L, 1), rows(rng, L, 1))
    with pytest.raises(akv.InvalidArgument, match="next layer is 0"):
        engine.lease_begin(1)
    lease = engine.lease_begin(0)
    with pytest.raises(akv.LeaseOrder):
        engine.lease_begin(1)
    with pytest.raises(akv.LeaseState):
        lease.mark_consumed()
    with pytest.raises(akv.LeaseState):
        lease.retire()
    view = lease.wait_ready()
    with pytest.raises(akv.LeaseState):
        lease.wait_ready()
    view.keys(0)[2] = 1.0
    view.values(0)[2] = 2.0
    attn = lease.mark_consumed()
    with pytest.raises(akv.LeaseState):
        lease.mark_consumed()
    tail = lease.write_back()
    with pytest.raises(akv.FenceMismatch):
        lease.seal(attn, attn)
    lease.seal(tail, attn)
    with pytest.raises(akv.LeaseState):
        lease.write_back()
    with pytest.raises(akv.StepState):
        engine.step_end()
    lease.retire()
    for layer in (1, 2):
        lease = engine.lease_begin(layer)
        view = lease.wait_ready()
        view.keys(0)[2] = 1.0
        view.values(0)[2] = 2.0
        a = lease.mark_consumed()
        lease.seal(lease.write_back(), a)
        lease.retire()
    engine.step_end()
    k, v = ctx.read(2, 2, 1)
    assert (k == 1.0).all() and (v == 2.0).all()


# ------------------------------------------------------------ threads


def test_a_second_thread_is_refused_while_one_is_in_a_call(engine):
    """Simulates a thread inside a call (it holds the engine's call slot) and
    calls from another: refused with Busy, nothing reaches C."""
    ctx = engine.open_context()
    with held_by_another_thread(engine):
        for call in (engine.info, lambda: ctx.length, engine.open_context, engine.close):
            with pytest.raises(akv.Busy, match="another thread"):
                call()
    assert ctx.length == 0


def test_log_callback_calling_the_engine_is_refused_not_deadlocked():
    seen = []
    box = {}

    def log(level, message):
        eng = box.get("eng")
        if eng is not None:
            try:
                eng.info()
                seen.append("ran")
            except akv.Busy:
                seen.append("busy")

    # arena with a pool: an open below the floor (the sink and the newest
    # page) is raised to it and logged, from inside the engine's own call;
    # a step logs nothing, so the callback must be made to run
    eng = akv.Engine(**small(log=log, log_level="debug", route="arena", device_pool_gib=1))
    box["eng"] = eng
    rng = np.random.default_rng(15)
    ctx = eng.open_context(target_pages=1)
    ctx.append(rows(rng, L, 2), rows(rng, L, 2))
    full_step(eng, [ctx])
    eng.close()
    assert seen == ["busy"]


def test_two_threads_hammering_one_engine_never_crash():
    rng = np.random.default_rng(16)
    eng = akv.Engine(**small(max_tokens=128, host_delay_seed=1, host_delay_max_us=50))
    ctx = eng.open_context()
    ctx.append(rows(rng, L, 2), rows(rng, L, 2))
    errors, other = [], []
    stop = threading.Event()

    def worker():
        while not stop.is_set():
            try:
                eng.info()
                eng.admission_counters()
                ctx.length
            except akv.ActiveKVError as exc:
                other.append(type(exc))
            time.sleep(0)

    t = threading.Thread(target=worker)
    t.start()
    steps = 0
    try:
        for _ in range(40):
            try:
                full_step(eng, [ctx])
                steps += 1
            except akv.ActiveKVError as exc:
                errors.append(exc)
                if eng._step_open:  # a refused call changed nothing: finish the step alone
                    stop.set()
                    t.join()
                    eng.quarantine()
                break
    finally:
        stop.set()
        t.join()
    assert set(other) <= {akv.Busy}, other
    assert all(isinstance(e, akv.Busy) for e in errors), errors
    assert steps + len(errors) >= 1
    eng.close()


# ------------------------------------------------------------ the transformers adapter


def _cache(max_cache_len=8, batch_size=1, **kw):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers import LlamaConfig

    from activekv.transformers import ActiveKVCache

    cfg = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    return torch, ActiveKVCache(config=cfg, device="cpu", dtype=torch.float32,
                                max_cache_len=max_cache_len, batch_size=batch_size,
                                page_tokens=4, log=quiet, **kw)


def _kv(torch, b, t, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, 2, t, 8, generator=g), torch.randn(b, 2, t, 8, generator=g))


def _prefill(cache, torch, b=1, t=3):
    for i in range(2):
        cache.layers[i].update(*_kv(torch, b, t, seed=i))


def test_cache_tensors_outliving_close_never_read_freed_memory():
    torch, cache = _cache()
    _prefill(cache, torch)
    k, v = cache.layers[0].update(*_kv(torch, 1, 1, seed=5))
    k1, v1 = cache.layers[1].update(*_kv(torch, 1, 1, seed=6))
    engine = cache.engine
    cache.close()
    with pytest.raises(akv.BadHandle):
        engine.info()
    assert engine._pending_destroy  # the staging memory stays while k, v, k1 live
    float(k.sum()), float(v.sum()), float(k1.sum()), float(v1.sum())
    del k, v, k1, v1
    gc.collect()
    assert engine.live_arrays == 0 and not engine._pending_destroy


def test_cache_refused_updates_change_nothing():
    torch, cache = _cache(batch_size=2)
    _, ref = _cache(batch_size=2)
    with cache, ref:
        _prefill(cache, torch, b=2)
        _prefill(ref, torch, b=2)
        k, v = _kv(torch, 2, 1, seed=7)
        bad = [(k.double(), v), (k, v.half()), (k[:, :1], v), (k, v[..., :4]), (k[:1], v[:1]),
               (k.expand(2, 2, 1, 8)[:, :, :, :1].expand(2, 2, 1, 8), v[:, :1]),
               (None, v), (k, "v"), (k.reshape(2, 2, 8), v), (k.to("meta"), v)]
        for bk, bv in bad:
            with misuse():
                cache.layers[0].update(bk, bv)
        with pytest.raises(NotImplementedError):
            cache.layers[0].update(*_kv(torch, 2, 2))
        with pytest.raises(akv.LeaseOrder):  # layer 1 before layer 0
            cache.layers[1].update(k, v)
        for layer in range(2):
            a = cache.layers[layer].update(*_kv(torch, 2, 1, seed=10 + layer))
            b = ref.layers[layer].update(*_kv(torch, 2, 1, seed=10 + layer))
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        assert cache.get_seq_length() == 4


def test_cache_misuse_after_close_and_after_engine_close():
    torch, cache = _cache()
    _prefill(cache, torch)
    cache.finish()
    cache.engine.close()  # the caller closes the engine under the cache
    with pytest.raises(akv.BadHandle):
        cache.layers[0].update(*_kv(torch, 1, 1))
    cache.close()
    cache.close()
    with pytest.raises(akv.BadHandle):
        cache.layers[0].update(*_kv(torch, 1, 1))
    with pytest.raises(akv.BadHandle):
        cache.finish()
    assert cache.get_seq_length() == 3  # plain bookkeeping, no engine call


def test_cache_close_after_a_transport_failure_frees_the_engine(monkeypatch):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import activekv.transformers as akt

    real = akt.engine_config_for

    def faulty(*a, **k):
        return dict(real(*a, **k), fault_fail_nth=3, fault_kind="copy")

    monkeypatch.setattr(akt, "engine_config_for", faulty)
    torch, cache = _cache()
    _prefill(cache, torch)
    with pytest.raises(akv.ActiveKVError):
        for _ in range(3):
            for layer in range(2):
                cache.layers[layer].update(*_kv(torch, 1, 1))
    with pytest.raises(akv.TransportError):
        cache.layers[0].update(*_kv(torch, 1, 1))
    engine = cache.engine
    cache.close()  # quarantine ends the step: nothing left Busy
    assert engine._handle is None


def test_cache_exception_mid_step_then_further_use():
    torch, cache = _cache()
    _prefill(cache, torch)
    cache.layers[0].update(*_kv(torch, 1, 1))
    # the forward died before layer 1; the next forward starts at layer 0 again
    with pytest.raises(akv.StepState, match="updated 1 of 2"):
        cache.layers[0].update(*_kv(torch, 1, 1))
    with pytest.raises(akv.StepState):
        cache.finish()
    cache.layers[1].update(*_kv(torch, 1, 1))  # completing the step is still possible
    cache.finish()
    assert [c.length for c in cache.contexts] == [4]
    cache.close()


@pytest.mark.parametrize("kw", [dict(max_cache_len=8.5), dict(max_cache_len="8"),
                                dict(batch_size=0), dict(batch_size=True),
                                dict(max_cache_len=0), dict(route="paged"), dict(route=None)])
def test_cache_bad_arguments(kw):
    with misuse():
        _cache(**kw)
