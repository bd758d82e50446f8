"""Misuse of the Python package that the adversarial tests did not reach: byte
order, raw stream handles, engines and caches abandoned mid-step, copies of
handle objects, and the transformers Cache operations on hybrid models.

Each test names what a caller did and holds the package to: no leaked
engine, no silently wrong rows, no refused call that changed something.
Host backend, no GPU needed.
"""
import copy
import gc
import pickle
import threading

import numpy as np
import pytest

import activekv as akv
from activekv import _lib

from conftest import quiet, small

L, H, D = 3, 2, 8


def rows(rng, n, dtype=np.float32, layers=L):
    return rng.standard_normal((layers, n, H, D)).astype(dtype)


def finish_step(eng, lease, stream):
    """Seals and retires `lease` (the step's layer 0, made ready), runs the
    other layers on `stream` and ends the step."""
    for layer in range(L):
        if layer:
            lease = eng.lease_begin(layer)
            lease.wait_ready(stream)
        attn = lease.mark_consumed()
        lease.seal(lease.write_back(), attn)
        lease.retire()
    eng.step_end()


def begin_on_stream(eng, k):
    """A context holding k (as both K and V), a stream of the engine's, and the
    step's layer 0 lease, begun but not yet waited on."""
    ctx = eng.open_context()
    ctx.append(k, k)
    stream = eng.stream_create()
    eng.step_begin([ctx])
    return stream, eng.lease_begin(0)


# ------------------------------------------------------------ rows


@pytest.mark.parametrize("dtype,raw", [("bf16", ">u2"), ("bf16", ">i2"), ("f16", ">f2"),
                                       ("f32", ">f4")])
def test_rows_in_the_other_byte_order_are_refused(dtype, raw):
    """Rows given big-endian (raw bit patterns for bf16; float16 and float32,
    whose integer rows are refused, test_audit_py6) would be stored
    byte-swapped: other values than the caller's, silently."""
    rng = np.random.default_rng(0)
    with akv.Engine(**small(dtype=dtype)) as eng, eng.open_context() as ctx:
        k = rng.integers(0, 1 << 15, (L, 2, H, D)).astype(raw)
        with pytest.raises(akv.InvalidArgument, match="byte order"):
            ctx.append(k, k)
        with pytest.raises(akv.InvalidArgument, match="byte order"):
            ctx.append_layer(0, k[0], k[0])
        assert ctx.length == 0
        native = k.astype(k.dtype.newbyteorder("="))
        ctx.append(native, native)
        assert ctx.read(1, 0, 2)[0].tobytes() == native[1].tobytes()


# ------------------------------------------------------------ streams


def test_wait_ready_with_a_raw_stream_handle_synchronizes_on_the_host_backend():
    """wait_ready(stream.handle) must block like wait_ready(stream): Python
    reads the view's arrays at once on the host backend."""
    rng = np.random.default_rng(1)
    release, ran = threading.Event(), []

    @_lib.HOST_FN
    def slow(_arg):  # work the caller enqueued on the stream before wait_ready
        release.wait(10)
        ran.append(True)

    with akv.Engine(**small()) as eng:
        k = rows(rng, 3)
        stream, lease = begin_on_stream(eng, k)
        assert _lib.lib.akv_stream_launch_host(eng._handle, stream.handle, slow, None) == 0
        timer = threading.Timer(0.3, release.set)
        timer.start()
        try:
            view = lease.wait_ready(stream.handle)
            assert ran == [True], "wait_ready returned before the stream ran"
            assert np.array_equal(view.keys(0)[:3], k[0])
        finally:
            release.set()
            timer.join()
            stream.synchronize()
        finish_step(eng, lease, stream.handle)
        stream.destroy()


@pytest.mark.parametrize("bad", [True, False, np.bool_(True), -1, 1 << 64, 2.0, "1"])
def test_stream_arguments_that_are_not_handles_are_refused(bad):
    """A bool is an int to Python: stream=True passed as stream 1 (on CUDA
    cudaStreamLegacy) and False as stream 0; negative values and values past
    64 bits were passed on too. Each is InvalidArgument, and the lease stays
    usable. The host backend's own handle check refuses 1 as well, so the
    conversion every call goes through (also on CUDA, where 1 is a valid
    stream) is checked directly."""
    rng = np.random.default_rng(2)
    with akv.Engine(**small()) as eng:
        with pytest.raises(akv.InvalidArgument):
            eng._stream_arg(bad)
        k = rows(rng, 3)
        stream, lease = begin_on_stream(eng, k)
        with pytest.raises(akv.InvalidArgument):
            lease.wait_ready(bad)
        view = lease.wait_ready(stream)
        assert np.array_equal(view.keys(0)[:3], k[0])
        finish_step(eng, lease, stream)
        stream.destroy()


def test_stream_with_block_left_by_an_exception_keeps_the_exception():
    rng = np.random.default_rng(2)
    with akv.Engine(**small()) as eng:
        ctx = eng.open_context()
        ctx.append(rows(rng, 2), rows(rng, 2))
        with pytest.raises(RuntimeError, match="the caller's"):
            with eng.stream_create() as s:
                eng.step_begin([ctx])
                eng.lease_begin(0).wait_ready(s)
                raise RuntimeError("the caller's")  # the stream's destroy is refused (InUse)
        eng.quarantine()


# ------------------------------------------------------------ abandoned engines


def _open_lease(eng, rng):
    ctx = eng.open_context()
    ctx.append(rows(rng, 2), rows(rng, 2))
    eng.step_begin([ctx])
    lease = eng.lease_begin(0)
    lease.wait_ready()
    return ctx, lease


def test_engine_with_block_left_by_an_exception_mid_step_frees_the_engine(destroys):
    """The exception left a lease unretired: close alone is refused (Busy),
    and the engine (its GiB of host pool) would stay allocated until the
    process exits."""
    rng = np.random.default_rng(3)
    with pytest.raises(RuntimeError, match="mid step"):
        with akv.Engine(**small()) as eng:
            _open_lease(eng, rng)
            with pytest.raises(akv.Busy):
                eng.close()  # a plain close is still refused and changes nothing
            assert eng.info().steps == 0
            raise RuntimeError("mid step")
    assert eng._handle is None
    assert len(destroys) == 1
    with pytest.raises(akv.BadHandle):
        eng.info()


def test_engine_step_block_left_by_an_exception_then_engine_block(destroys):
    rng = np.random.default_rng(4)
    with pytest.raises(KeyError):
        with akv.Engine(**small()) as eng:
            ctx = eng.open_context()
            ctx.append(rows(rng, 2), rows(rng, 2))
            with eng.step([ctx]):
                eng.lease_begin(0).wait_ready()
                raise KeyError("in the step")
    assert eng._handle is None and len(destroys) == 1


def test_engine_garbage_collected_mid_step_is_freed(destroys):
    gc.collect()  # engines an earlier test left to the collector are not counted
    destroys.clear()
    rng = np.random.default_rng(5)
    eng = akv.Engine(**small())
    ctx, lease = _open_lease(eng, rng)
    del eng, ctx, lease
    gc.collect()
    assert len(destroys) == 1


# ------------------------------------------------------------ copies


def test_close_with_live_arrays_after_a_transport_failure_waits_for_quarantine():
    """close() with zero-copy arrays alive defers akv_engine_destroy to the
    last array's end. After a transport failure (no quarantine yet) that
    destroy is refused (AKV_ERR_BUSY), and the deferred call's status was
    ignored: the engine was reported closed, could no longer be
    quarantined, and its memory stayed allocated. close() now refuses with
    Busy first, as it does without arrays, and changes nothing."""
    rng = np.random.default_rng(3)
    cfg = small(route="paged", device_pool_gib=1)
    kk = rows(rng, 3)
    with akv.Engine(**cfg) as probe:  # the copies one step takes
        ctx = probe.open_context()
        ctx.append(kk, kk)
        _one_step(probe, ctx)
        n = probe.info().backend_ops["copy"]
    eng = akv.Engine(**dict(cfg, fault_fail_nth=n + 1, fault_kind="copy"))
    ctx = eng.open_context()
    ctx.append(kk, kk)
    kept = _one_step(eng, ctx)
    with pytest.raises(akv.Backend):
        eng.step_begin([ctx])  # its copy is the injected failure
    assert eng.info().transport_failed and eng.live_arrays > 0
    streams = list(eng._streams)
    with pytest.raises(akv.Busy):
        eng.close()
    assert eng._streams == streams and not eng._pending_destroy
    eng.quarantine()
    eng.close()
    assert eng._pending_destroy
    kept.clear()
    gc.collect()
    assert eng.live_arrays == 0 and not eng._pending_destroy


def _one_step(eng, ctx):
    """One step over ctx on a stream of the engine's; layer 0's K array kept."""
    stream = eng.stream_create()
    eng.step_begin([ctx])
    lease = eng.lease_begin(0)
    kept = [lease.wait_ready(stream).keys(0)]
    finish_step(eng, lease, stream)
    return kept


def test_handle_objects_cannot_be_copied_or_pickled():
    """A copy would keep the C handle after the original closed it, and the
    library hands dead handle records out again: the copy would later name
    (and close) a newer object."""
    rng = np.random.default_rng(7)
    with akv.Engine(**small()) as eng:
        ctx = eng.open_context()
        ctx.append(rows(rng, 1), rows(rng, 1))
        stream = eng.stream_create()
        eng.step_begin([ctx])
        lease = eng.lease_begin(0)
        for obj in (eng, ctx, stream, lease):
            for how in (copy.copy, copy.deepcopy, pickle.dumps):
                with pytest.raises(TypeError, match="cannot be copied"):
                    how(obj)
        eng.quarantine()
        stream.destroy()


# ------------------------------------------------------------ the transformers adapter


def _tiny(hybrid):
    pytest.importorskip("transformers")
    from transformers import Gemma3TextConfig, LlamaConfig

    if hybrid:
        return Gemma3TextConfig(vocab_size=32, hidden_size=32, intermediate_size=64,
                                num_hidden_layers=3, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=8, sliding_window=4,
                                layer_types=["sliding_attention", "sliding_attention",
                                             "full_attention"])
    return LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8)


def _cache(hybrid=False, batch_size=1, **kw):
    torch = pytest.importorskip("torch")
    from activekv.transformers import ActiveKVCache

    kw = dict(dict(device="cpu", dtype=torch.float32, max_cache_len=16, page_tokens=4,
                   log=quiet), **kw)
    return torch, ActiveKVCache(config=_tiny(hybrid), batch_size=batch_size, **kw)


def _kv(torch, b, t, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, 2, t, 8, generator=g), torch.randn(b, 2, t, 8, generator=g)


@pytest.mark.parametrize("op", ["crop", "reorder_cache", "batch_select_indices",
                                "batch_repeat_interleave"])
def test_cache_operations_on_a_hybrid_model_change_no_layer_when_refused(op):
    """transformers' Cache walks the layers in order: the sliding-window layers
    before the first full-attention one were cropped / reordered / selected
    / repeated before that layer refused."""
    torch, cache = _cache(hybrid=True, batch_size=2)
    with cache:
        for layer in range(3):
            cache.update(*_kv(torch, 2, 3, seed=layer), layer)
        before = [(cache.layers[i].keys.clone(), cache.layers[i].values.clone())
                  for i in range(2)]
        arg = {"crop": -1, "reorder_cache": torch.tensor([1, 0]),
               "batch_select_indices": torch.tensor([1]), "batch_repeat_interleave": 2}[op]
        with pytest.raises(NotImplementedError):
            getattr(cache, op)(arg)
        for i in range(2):
            assert torch.equal(cache.layers[i].keys, before[i][0])
            assert torch.equal(cache.layers[i].values, before[i][1])
        assert [cache.get_seq_length(i) for i in range(3)] == [3, 3, 3]
        cache.crop(0)  # what every layer accepts still reaches them all
        cache.batch_repeat_interleave(1)
        assert [cache.get_seq_length(i) for i in range(3)] == [3, 3, 3]


@pytest.mark.parametrize("device", ["meta", "xpu"])
def test_cache_for_a_device_the_engine_cannot_serve_is_refused_at_construction(device):
    torch = pytest.importorskip("torch")
    from activekv.transformers import ActiveKVCache

    with pytest.raises(ValueError, match="cpu .host backend. and cuda"):
        ActiveKVCache(config=_tiny(False), device=device, dtype=torch.float32, max_cache_len=16,
                      page_tokens=4, log=quiet)


def test_cache_first_update_refused_leaves_the_batch_open():
    """The first update fixes the batch (one context per row): a refused one
    (V of another dtype or batch, K of other heads) must not fix it."""
    torch, cache = _cache(batch_size=2)
    with cache:
        k, v = _kv(torch, 2, 3)
        for bk, bv in ((k, v.double()), (k, v[:1]), (k[:, :1].repeat(1, 3, 1, 1),) * 2,
                       (k, v[..., :4]), (k, v[:, :, :2])):
            with pytest.raises(ValueError):
                cache.layers[0].update(bk, bv)
            assert cache.contexts == [] and not cache.layers[0].is_initialized
        k1, v1 = _kv(torch, 1, 3)
        for layer in range(2):
            out = cache.layers[layer].update(k1, v1)
            assert torch.equal(out[0], k1)
        assert len(cache.contexts) == 1 and cache.get_seq_length() == 3


def test_cache_after_a_quarantine_from_outside_never_passes_dead_lease_handles():
    """cache.engine.quarantine() released the cache's leases: their handles
    are dead records the library hands out again, so the cache must not
    call the library with them (seal, retire) at its next update, finish or
    close."""
    torch, cache = _cache()
    for layer in range(2):
        cache.layers[layer].update(*_kv(torch, 1, 3, seed=layer))
    for layer in range(2):
        cache.layers[layer].update(*_kv(torch, 1, 1, seed=layer))
    api = cache._driver.api
    calls = []
    for name in ("mark_consumed", "write_back", "seal", "retire", "try_retire"):
        real = getattr(api, name)

        def spy(*a, _real=real, _name=name):
            calls.append(_name)
            return _real(*a)

        setattr(api, name, spy)
    cache.engine.quarantine()
    with pytest.raises(akv.Quarantined):
        cache.layers[0].update(*_kv(torch, 1, 1))
    with pytest.raises(akv.Quarantined):
        cache.finish()
    engine = cache.engine
    cache.close()
    assert calls == []
    assert engine._handle is None


def test_cache_dropped_without_close_mid_decode_frees_its_engine(destroys):
    """The usual transformers pattern: make a cache, generate, drop it. The
    decode step stays open between forwards, so the engine's close alone is
    refused (Busy)."""
    for _ in range(2):
        torch, cache = _cache()
        for layer in range(2):
            cache.layers[layer].update(*_kv(torch, 1, 3, seed=layer))
        for _step in range(2):
            for layer in range(2):
                cache.layers[layer].update(*_kv(torch, 1, 1, seed=layer))
        del cache
        gc.collect()
    assert len(destroys) == 2


@pytest.mark.parametrize("kw", [dict(target_pages=-1), dict(target_pages=2 ** 32),
                                dict(target_pages="2"), dict(burst_pages=1.5),
                                dict(burst_pages=None), dict(hooks="no")])
def test_cache_arguments_used_at_the_first_update_are_refused_at_construction(kw, destroys):
    """target_pages / burst_pages reach the library only when the first update
    opens the contexts: a bad one made every update fail instead."""
    with pytest.raises((akv.InvalidArgument, TypeError)):
        _cache(**kw)
    assert destroys == []  # refused before any engine was made



def test_cuda_stream_given_to_a_host_engine_is_refused():
    """A torch.cuda.Stream (anything with ``cuda_stream``) names a CUDA queue:
    a host-backend engine refuses it by type (InvalidArgument) instead of
    passing its cudaStream_t on as one of its own stream handles, and the
    lease stays usable."""

    class CudaStreamLike:
        cuda_stream = 7  # what torch.cuda.Stream exposes
        device = None

    rng = np.random.default_rng(3)
    with akv.Engine(**small()) as eng:
        k = rows(rng, 3)
        stream, lease = begin_on_stream(eng, k)
        with pytest.raises(akv.InvalidArgument, match="CUDA stream given to a host-backend"):
            lease.wait_ready(CudaStreamLike())
        view = lease.wait_ready(stream)
        assert np.array_equal(view.keys(0)[:3], k[0])
        finish_step(eng, lease, stream)
        stream.destroy()
