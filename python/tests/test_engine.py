"""The Python API on the host backend: lifecycle, every error path as an
exception, zero-copy views, per-layer prefill, and a small decode that is
bit-identical to a numpy reference attention over the resident history."""
import threading
import time

import numpy as np
import pytest

import activekv as akv
from activekv import _lib

from conftest import quiet, small

L, H, D = 3, 2, 8


def rows(rng, layers, n, dtype=np.float32):
    shape = (layers, n, H, D) if layers else (n, H, D)
    return rng.standard_normal(shape).astype(dtype)


def run_layer(eng, layer, fill=None, stream=None):
    """One layer of a step in the two-call form; `fill(view)` writes the new rows."""
    lease = eng.lease_begin(layer)
    view = lease.wait_ready(stream)
    if fill is not None:
        fill(view)
    attn = lease.mark_consumed()
    tail = lease.write_back()
    lease.seal(tail, attn)
    return lease.retire()


# ------------------------------------------------------------ lifecycle


def test_fit_report_and_line():
    r = akv.fit(**{k: v for k, v in small().items() if k != "log"})
    assert isinstance(r, akv.FitReport) and r.ok
    assert r.row_bytes == H * D * 4
    assert r.history_bytes == L * 32 * r.row_bytes * 2
    assert r.effective_concurrency == 2
    assert "effective_concurrency" in r.line and str(r.history_bytes) in r.line
    big = akv.fit(n_dense_layers=80, kv_heads=8, head_dim=128, max_tokens=131072,
                  page_tokens=256, max_contexts=64, host_pool_gib=1)
    assert not big.ok and big.host_pool_gib_needed > 1


def test_engine_lifecycle_info_and_config():
    lines = []
    eng = akv.Engine(**small(log=lambda level, msg: lines.append((level, msg))))
    with eng:
        assert eng.backend == "host"
        info = eng.info()
        assert isinstance(info, akv.EngineInfo)
        assert info.backend == "host" and info.route == "stage"
        assert info.effective_concurrency == 2 and info.row_bytes == H * D * 4
        assert set(info.backend_ops) == set(akv._api.OP_KINDS)
        assert not info.transport_failed and not info.quarantined
        cfg = eng.config
        assert cfg["dtype"] == "f32" and cfg["n_dense_layers"] == L and cfg["backend"] == "host"
        assert eng.last_error == ""
        assert any(level == "info" and "host fit" in msg for level, msg in lines)
        with eng.open_context() as ctx:
            assert ctx.length == len(ctx) == 0 and ctx.id > 0
        assert eng.admission_counters()["admit"] == 1
        assert eng.admission_counters()["release"] == 1
        assert [d.rule for d in eng.admission_log()][-2:] == ["admit", "release"]
    assert repr(eng) == "<activekv.Engine closed>"
    eng.close()  # twice: a no-op
    with pytest.raises(akv.BadHandle):
        eng.info()
    with pytest.raises(akv.BadHandle):
        eng.open_context()


def test_objects_of_a_closed_engine_raise_bad_handle_without_reaching_c():
    eng = akv.Engine(**small())
    ctx = eng.open_context()
    s = eng.stream_create()
    eng.close()  # destroys the stream it made and every open context
    for call in (lambda: ctx.length, lambda: ctx.append(np.zeros((L, 1, H, D), np.float32),
                                                       np.zeros((L, 1, H, D), np.float32)),
                 lambda: ctx.read(0, 0, 0), s.synchronize, lambda: eng.lease_begin(0)):
        with pytest.raises(akv.BadHandle):
            call()
    ctx.close()  # closing what the engine already freed is a no-op
    s.destroy()


def test_step_context_manager_and_default_stream(engine):
    rng = np.random.default_rng(1)
    ctx = engine.open_context()
    ctx.append(rows(rng, L, 5), rows(rng, L, 5))
    s = engine.default_stream()
    assert isinstance(s, akv.Stream) and engine.default_stream() is s
    with engine.step([ctx]):
        for layer in range(L):
            r = run_layer(engine, layer)
            assert isinstance(r, akv.Receipt) and r.layer == layer and r.step == 1
    assert ctx.length == 6 and engine.info().steps == 1


# ------------------------------------------------------------ errors


def test_errors_carry_status_name_and_engine_message(engine):
    ctx = engine.open_context()
    with pytest.raises(akv.Capacity) as ei:
        ctx.append(np.zeros((L, 33, H, D), np.float32), np.zeros((L, 33, H, D), np.float32))
    e = ei.value
    assert isinstance(e, akv.CapacityError) and isinstance(e, akv.ActiveKVError)
    assert e.status == 8 and e.name == "AKV_ERR_CAPACITY"
    assert "max_tokens=32" in e.message and e.message.endswith(engine.last_error)
    assert ctx.length == 0  # nothing appended


def test_argument_and_state_errors(engine):
    rng = np.random.default_rng(2)
    a, b = engine.open_context(), engine.open_context()
    a.append(rows(rng, L, 3), rows(rng, L, 3))
    b.append(rows(rng, L, 2), rows(rng, L, 2))
    # package-side checks raise the status class the C call would
    with pytest.raises(akv.InvalidArgument):
        a.append(np.zeros((L, 1, H, D), np.float64), np.zeros((L, 1, H, D), np.float64))
    with pytest.raises(ValueError):  # InvalidArgument is a ValueError too
        a.append(np.zeros((L - 1, 1, H, D), np.float32), np.zeros((L - 1, 1, H, D), np.float32))
    with pytest.raises(akv.InvalidArgument):
        a.append(np.zeros((L, 2, H, D), np.float32)[:, ::2], np.zeros((L, 1, H, D), np.float32))
    with pytest.raises(akv.InvalidArgument):
        a.append(np.zeros((L, 1, H, D), np.float16), np.zeros((L, 1, H, D), np.float16))
    # C-side refusals
    with pytest.raises(akv.InvalidArgument):
        a.read(L, 0, 1)
    with pytest.raises(akv.InvalidArgument):
        a.read(0, 2, 5)
    with pytest.raises(akv.InvalidArgument):
        engine.step_begin([])
    with pytest.raises(akv.InvalidArgument):
        engine.step_begin([a, a])
    with pytest.raises(akv.StepState):
        engine.step_end()
    with pytest.raises(akv.StepState):
        engine.lease_begin(0)
    assert len(a) == 3 and len(b) == 2  # refusals changed nothing

    engine.step_begin([a, b])
    with pytest.raises(akv.StepState):
        engine.step_begin([a])
    with pytest.raises(akv.StepState):
        engine.open_context()
    with pytest.raises(akv.InUse):
        a.close()
    with pytest.raises(akv.InUse):
        a.append(rows(rng, L, 1), rows(rng, L, 1))
    with pytest.raises(akv.InUse):
        a.read(0, 0, 1)
    with pytest.raises(akv.InvalidArgument):
        engine.lease_begin(1)  # out of order
    lease0 = engine.lease_begin(0)
    with pytest.raises(akv.LeaseOrder):
        engine.lease_begin(1)  # lease 0 neither sealed nor retired
    with pytest.raises(akv.LeaseState):
        lease0.mark_consumed()  # before wait_ready
    with pytest.raises(akv.LeaseState):
        lease0.write_back()
    with pytest.raises(akv.LeaseState):
        lease0.retire()  # not sealed
    lease0.wait_ready()
    with pytest.raises(akv.LeaseState):
        lease0.wait_ready()  # twice
    attn = lease0.mark_consumed()
    with pytest.raises(akv.Busy):
        engine.close()  # open step, live lease: nothing freed
    assert engine.info().backend == "host"  # still usable
    with pytest.raises(akv.BadHandle):
        lease0.write_back([akv.Context(engine, None)])  # a dead Python-side handle
    tail = lease0.write_back([a])
    with pytest.raises(akv.LeaseState):
        lease0.seal(tail, attn)  # b not written back yet
    tail = lease0.write_back([b])
    with pytest.raises(akv.FenceMismatch):
        lease0.seal(attn, tail)  # swapped
    with pytest.raises(akv.FenceMismatch):
        lease0.seal(tail, akv.Fence(attn.serial + 1000))
    lease0.seal(tail, attn)
    lease0.retire()
    with pytest.raises(akv.BadHandle):
        lease0.retire()  # a retired lease is dead on the Python side
    with pytest.raises(akv.BadHandle):
        lease0.try_retire()
    for layer in range(1, L):
        run_layer(engine, layer)
    engine.step_end()
    assert len(a) == 4 and len(b) == 3
    a.close()
    with pytest.raises(akv.BadHandle):
        a.length
    with pytest.raises(akv.BadHandle):
        engine.step_begin([a])


def test_owner_mismatch_from_c(engine):
    rng = np.random.default_rng(3)
    a, b = engine.open_context(), engine.open_context()
    for c in (a, b):
        c.append(rows(rng, L, 2), rows(rng, L, 2))
    engine.step_begin([a])
    lease = engine.lease_begin(0)
    lease.wait_ready()
    attn = lease.mark_consumed()
    with pytest.raises(akv.OwnerMismatch):
        lease.write_back([b])  # b is not part of this lease
    lease.seal(lease.write_back(), attn)
    if _lib.has_symbol("akv_lease_try_retire"):
        receipt = lease.try_retire()  # None while fences are pending
        if receipt is None:
            lease.retire()
    else:
        with pytest.raises(akv.NotSupported):
            lease.try_retire()  # this library has no akv_lease_try_retire
        lease.retire()  # the refusal changed nothing
    for layer in range(1, L):
        run_layer(engine, layer)
    engine.step_end()


def test_try_retire_none_while_pending_then_the_receipt(engine):
    """The attention fence is recorded behind a host function that waits on a gate:
    try_retire answers None (AKV_ERR_NOT_READY is not raised) and changes nothing
    until the gate opens, then retires with the receipt retire() would give."""
    rng = np.random.default_rng(10)
    ctx = engine.open_context()
    ctx.append(rows(rng, L, 3), rows(rng, L, 3))
    gate = threading.Event()
    hook = _lib.HOST_FN(lambda _arg: gate.wait(30))
    engine.step_begin([ctx])
    try:
        lease = engine.lease_begin(0)
        with pytest.raises(akv.LeaseState):
            lease.try_retire()  # not sealed
        s = engine.default_stream()
        lease.wait_ready(s)
        assert _lib.lib.akv_stream_launch_host(engine._handle, s.handle, hook, None) == 0
        attn = lease.mark_consumed()  # behind the gate
        lease.seal(lease.write_back(), attn)
        error_before = engine.last_error
        for _ in range(3):
            assert lease.try_retire() is None
        assert engine.last_error == error_before  # nothing changed, nothing recorded
        assert engine.info().leases_retired == 0
    finally:
        gate.set()
    s.synchronize()
    receipt = None
    for _ in range(2000):  # the tail write-back follows the attention event
        receipt = lease.try_retire()
        if receipt is not None:
            break
        time.sleep(0.001)
    assert isinstance(receipt, akv.Receipt)
    assert receipt.layer == 0 and receipt.step == 1 and receipt.attention == attn
    assert receipt.bytes_h2d > 0 and receipt.bytes_d2h > 0
    assert engine.info().leases_retired == 1
    with pytest.raises(akv.BadHandle):
        lease.try_retire()  # dead after retiring
    for layer in range(1, L):
        run_layer(engine, layer)
    engine.step_end()
    assert ctx.length == 4


def test_config_errors():
    with pytest.raises(akv.InvalidArgument):
        akv.Engine(**small(no_such_field=1))
    with pytest.raises(akv.InvalidArgument):
        akv.Engine(**small(route="teleport"))
    with pytest.raises(akv.InvalidArgument):
        akv.Engine(**small(max_tokens=-1))
    with pytest.raises(akv.Config) as ei:
        akv.Engine(**small(page_tokens=64))  # page_tokens > max_tokens
    assert isinstance(ei.value, akv.ConfigError) and ei.value.message
    with pytest.raises(akv.Config):
        akv.fit(n_dense_layers=0, kv_heads=1, head_dim=1, max_tokens=4, page_tokens=4)
    with pytest.raises(akv.NoFit) as ei:
        akv.Engine(**small(n_dense_layers=80, kv_heads=8, head_dim=128, max_tokens=131072,
                           page_tokens=256, max_contexts=64, dtype="bf16"))
    assert "host_pool_gib" in ei.value.message


def test_cuda_backend_unavailable_is_not_supported():
    try:
        import torch
        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    if has_gpu:
        pytest.skip("a GPU is present: backend='cuda' is supported here")
    with pytest.raises(akv.NotSupported):
        akv.Engine(**small(backend="cuda"))


def test_capacity_errors():
    with akv.Engine(**small(fit_mode="shrink", max_contexts=4,
                            n_dense_layers=32, kv_heads=8, head_dim=128,
                            max_tokens=1536, page_tokens=256)) as eng:
        n = eng.info().effective_concurrency
        assert n < 4
        ctxs = [eng.open_context() for _ in range(n)]
        with pytest.raises(akv.RefusedQueue) as ei:
            eng.open_context()
        assert isinstance(ei.value, akv.CapacityError)
        for c in ctxs:
            c.close()
    with akv.Engine(**small(device_pool_gib=1, route="arena")) as eng:
        pages = eng.info().device_pages
        with pytest.raises(akv.AdmissionRefused):
            eng.open_context(target_pages=pages + 1)
        assert "refused" in eng.explain() or eng.explain()
    with akv.Engine(**small()) as eng:
        streams = [eng.stream_create() for _ in range(8)]
        with pytest.raises(akv.OutOfMemory):
            eng.stream_create()
        for s in streams:
            s.destroy()


def test_transport_failure_backend_then_quarantined():
    rng = np.random.default_rng(4)
    eng = akv.Engine(**small(fault_fail_nth=1, fault_kind="copy"))
    ctx = eng.open_context()
    ctx.append(rows(rng, L, 3), rows(rng, L, 3))
    eng.step_begin([ctx])
    with pytest.raises(akv.Backend) as ei:
        eng.lease_begin(0)  # its first copy is the injected failure
    assert isinstance(ei.value, akv.TransportError)
    assert eng.info().transport_failed
    with pytest.raises(akv.Quarantined):
        eng.lease_begin(0)
    with pytest.raises(akv.Quarantined):
        eng.stream_create()
    report = eng.quarantine()
    assert report.h2d_ok and report.d2h_ok and report.device_ok
    k, _ = ctx.read(0, 0, 3)  # authoritative rows survive
    assert k.shape == (3, H, D)
    eng.close()


def test_uncertain_fence():
    eng = akv.Engine(**small(fault_fail_nth=1, fault_kind="sync"))
    with pytest.raises(akv.UncertainFence) as ei:
        eng.quarantine()  # its first synchronise is the injected failure
    assert isinstance(ei.value, akv.TransportError)
    with pytest.raises(akv.Busy):
        eng.close()  # everything stays retained: never freed
    eng._handle = None  # retained on purpose; leave it to the process


def test_uneven_layers_and_append_layer(engine):
    rng = np.random.default_rng(5)
    ctx = engine.open_context()
    k = [rows(rng, 0, 4) for _ in range(L)]
    v = [rows(rng, 0, 4) for _ in range(L)]
    ctx.append_layer(2, k[2][:2], v[2][:2])
    ctx.append_layer(0, k[0], v[0])
    assert ctx.length == 0
    ctx.append_layer(1, k[1][:3], v[1][:3])
    assert ctx.length == 2  # layers hold 4, 3, 2
    ctx.append_layer(2, k[2][2:], v[2][2:])
    assert ctx.length == 3  # the minimum over the layers
    with pytest.raises(akv.UnevenLayers) as ei:
        engine.step_begin([ctx])
    assert isinstance(ei.value, akv.UsageError) and "different row counts" in ei.value.message
    with pytest.raises(akv.InvalidArgument):
        ctx.append_layer(L, k[0], v[0])
    with pytest.raises(akv.Capacity):
        ctx.append_layer(0, rows(rng, 0, 29), rows(rng, 0, 29))
    with pytest.raises(akv.InvalidArgument):
        ctx.append_layer(1, k[1][3:], v[1][:2])  # shapes differ
    ctx.append_layer(1, k[1][3:], v[1][3:])
    assert ctx.length == 4
    for layer in range(L):
        rk, rv = ctx.read(layer, 0, 4)
        assert rk.tobytes() == k[layer].tobytes() and rv.tobytes() == v[layer].tobytes()
    with engine.step([ctx]):
        for layer in range(L):
            run_layer(engine, layer)
    assert ctx.length == 5


def test_torch_cpu_tensors_as_rows():
    torch = pytest.importorskip("torch")
    with akv.Engine(**small(dtype="bf16")) as eng, eng.open_context() as ctx:
        k = torch.randn(L, 3, H, D, dtype=torch.bfloat16)
        v = torch.randn(L, 3, H, D, dtype=torch.bfloat16)
        ctx.append(k, v)
        rk, rv = ctx.read(1, 0, 3)
        assert rk.dtype == np.uint16  # bf16 bits on numpy
        assert torch.equal(torch.from_numpy(rk.view(np.int16)).view(torch.bfloat16), k[1])
        with pytest.raises(akv.InvalidArgument):
            ctx.append(k.float(), v.float())  # f32 rows for a bf16 engine
        with pytest.raises(akv.InvalidArgument):
            ctx.append(k.half(), v.half())  # same size, wrong type


# ------------------------------------------------------------ zero copy


def test_views_are_zero_copy_write_through_reaches_the_host_rows(engine):
    rng = np.random.default_rng(6)
    ctx = engine.open_context()
    ctx.append(rows(rng, L, 6), rows(rng, L, 6))
    with engine.step([ctx]):
        for layer in range(L):
            lease = engine.lease_begin(layer)
            view = lease.wait_ready()
            keys, vals = view.keys(0), view.values(0)
            assert keys.shape == (7, H, D) and view.len == [6]
            # the arrays are the staging buffer itself, not a copy
            assert keys.__array_interface__["data"][0] == view.base
            assert vals.__array_interface__["data"][0] == view.base + view.v_offset
            assert keys.strides == (view.row_stride, D * 4, 4)
            keys[6] = 100.0 + layer
            vals[6] = -100.0 - layer
            attn = lease.mark_consumed()
            lease.seal(lease.write_back(), attn)
            lease.retire()
    for layer in range(L):
        k, v = ctx.read(layer, 6, 1)  # through the C API: the bytes written through the view
        assert (k == 100.0 + layer).all() and (v == -100.0 - layer).all()


def test_kv_tensors_cpu_torch_zero_copy(engine):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(7)
    a, b = engine.open_context(), engine.open_context()
    a.append(rows(rng, L, 5), rows(rng, L, 5))
    b.append(rows(rng, L, 3), rows(rng, L, 3))
    with engine.step([a, b]):
        for layer in range(L):
            lease = engine.lease_begin(layer)
            view = lease.wait_ready()
            K, V = view.kv_tensors()
            assert K.shape == (2, H, 6, D) and V.shape == (2, H, 6, D)
            assert K.data_ptr() == view.base and V.data_ptr() == view.base + view.v_offset
            assert np.array_equal(K[1, :, :3].permute(1, 0, 2).numpy(), view.keys(1)[:3])
            K[0, :, 5] = 3.0  # context 0's new row, through torch
            V[1, :, 3] = 4.0  # context 1's new row
            view.keys(1)[3] = 5.0
            view.values(0)[5] = 6.0
            attn = lease.mark_consumed()
            lease.seal(lease.write_back(), attn)
            lease.retire()
    assert (a.read(2, 5, 1)[0] == 3.0).all() and (a.read(2, 5, 1)[1] == 6.0).all()
    assert (b.read(0, 3, 1)[0] == 5.0).all() and (b.read(0, 3, 1)[1] == 4.0).all()


def test_paged_view_refuses_rows_it_does_not_hold():
    rng = np.random.default_rng(8)
    with akv.Engine(**small(device_pool_gib=1, route="paged")) as eng:
        ctx = eng.open_context()
        ctx.append(rows(rng, L, 9), rows(rng, L, 9))
        for step in range(2):  # the first step fills the pages, the second reads them in place
            eng.step_begin([ctx])
            for layer in range(L):
                lease = eng.lease_begin(layer)
                view = lease.wait_ready()
                assert view.page_map is not None and view.page_map.shape[0] == 1
                in_place = (view.page_map[0, : view.len[0] // 4] != _lib.AKV_PAGE_STAGED).any()
                if in_place:
                    with pytest.raises(akv.NotSupported):
                        view.keys(0)
                else:
                    view.keys(0)[view.len[0]] = 1.0
                attn = lease.mark_consumed()
                lease.seal(lease.write_back(), attn)
                lease.retire()
            eng.step_end()
        assert in_place, "the second step should read retained pages in place"


# ------------------------------------------------------------ decode


def attention(q, k, v):
    """Reference decode attention for one context: q [H, D], k and v [T, H, D]
    (f32), one query head per KV head; fixed operation order."""
    k = np.ascontiguousarray(k, np.float32)
    v = np.ascontiguousarray(v, np.float32)
    s = np.einsum("hd,thd->ht", q, k) / np.float32(np.sqrt(D))
    s = np.exp(s - s.max(axis=1, keepdims=True))
    p = s / s.sum(axis=1, keepdims=True)
    return np.einsum("ht,thd->hd", p, v)


def to_f32(a, dtype):
    if dtype == "bf16":
        return (a.astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float32)


def from_f32(a, dtype):
    if dtype == "bf16":
        return (a.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return a.astype(np.float32)


@pytest.mark.parametrize("route,pool,dtype", [("stage", 0, "f32"), ("arena", 1, "f32"),
                                              ("stage", 0, "bf16"), ("arena", 1, "bf16")])
def test_small_decode_bit_identical_to_numpy_reference(route, pool, dtype):
    rng = np.random.default_rng(9)
    prefill = [5, 8]  # odd, and one page boundary (page_tokens = 4)
    steps = 7
    with akv.Engine(**small(route=route, device_pool_gib=pool, dtype=dtype)) as eng:
        ctxs = [eng.open_context() for _ in prefill]
        ref = []  # resident history: ref[c][layer] = (k, v) in the engine's dtype
        for c, n in zip(ctxs, prefill):
            k = from_f32(rows(rng, L, n), dtype)
            v = from_f32(rows(rng, L, n), dtype)
            c.append(k, v)
            ref.append([[k[layer], v[layer]] for layer in range(L)])
        for _ in range(steps):
            with eng.step(ctxs):
                for layer in range(L):
                    lease = eng.lease_begin(layer)
                    view = lease.wait_ready()
                    for i in range(len(ctxs)):
                        kn = from_f32(rows(rng, 0, 1), dtype)
                        vn = from_f32(rows(rng, 0, 1), dtype)
                        q = rng.standard_normal((H, D)).astype(np.float32)
                        keys, vals = view.keys(i), view.values(i)
                        n = view.len[i]
                        assert keys[:n].tobytes() == ref[i][layer][0].tobytes()
                        keys[n], vals[n] = kn[0], vn[0]
                        got = attention(q, to_f32(keys, dtype), to_f32(vals, dtype))
                        rk = np.concatenate([ref[i][layer][0], kn])
                        rv = np.concatenate([ref[i][layer][1], vn])
                        want = attention(q, to_f32(rk, dtype), to_f32(rv, dtype))
                        assert got.tobytes() == want.tobytes()
                        ref[i][layer] = [rk, rv]
                    attn = lease.mark_consumed()
                    lease.seal(lease.write_back(), attn)
                    lease.retire()
        info = eng.info()
        assert info.steps == steps
        if route == "arena":
            assert info.bytes_d2d > 0  # retained pages really came from the pool
        for i, c in enumerate(ctxs):
            assert c.length == prefill[i] + steps
            for layer in range(L):
                k, v = c.read(layer, 0, c.length)
                assert k.tobytes() == ref[i][layer][0].tobytes()
                assert v.tobytes() == ref[i][layer][1].tobytes()
