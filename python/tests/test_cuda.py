"""The package on the CUDA backend: zero-copy torch views of the staged rows
on torch's current stream. Skipped (visibly) without torch or a GPU."""
import numpy as np
import pytest

import activekv as akv

from conftest import small

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device: the CUDA views are NOT tested here", allow_module_level=True)

L, H, D = 3, 2, 64


def cuda_cfg(**over):
    return small(backend="cuda", head_dim=D, dtype="bf16", **over)


def test_default_stream_is_torchs_current_stream():
    with akv.Engine(**cuda_cfg()) as eng:
        assert eng.backend == "cuda"
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            assert eng.default_stream() == s.cuda_stream
        # torch's default stream is cudaStream_t 0, named cudaStreamLegacy (1)
        assert eng.default_stream() == (torch.cuda.current_stream().cuda_stream or 1)
        rng = np.random.default_rng(0)
        with eng.open_context() as ctx:  # a whole step on torch's default stream
            ctx.append(rng.integers(0, 2**15, (L, 3, H, D), dtype=np.uint16),
                       rng.integers(0, 2**15, (L, 3, H, D), dtype=np.uint16))
            with eng.step([ctx]):
                for layer in range(L):
                    lease = eng.lease_begin(layer)
                    lease.wait_ready().keys(0)[3] = 1.0
                    attn = lease.mark_consumed()
                    lease.seal(lease.write_back(), attn)
                    lease.retire()
            k, _ = ctx.read(2, 3, 1)
            assert (k == 0x3F80).all()  # 1.0 in bf16



@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs: the engine on "
                    "cuda:1, torch's current device cuda:0 (NOT tested on one GPU)")
def test_streams_of_another_device_are_refused():
    """An engine on cuda:1 takes torch's current stream of cuda:1 as its
    default, whatever torch's current device, and refuses a stream of cuda:0
    (InvalidArgument) instead of enqueueing its work there."""
    torch.cuda.set_device(0)
    with akv.Engine(**cuda_cfg(device_ordinal=1)) as eng:
        assert eng.default_stream() == (torch.cuda.current_stream(1).cuda_stream or 1)
        other = torch.cuda.Stream(device=0)
        with pytest.raises(akv.InvalidArgument, match="on cuda:0, the engine is on cuda:1"):
            eng._stream_arg(other)
        mine = torch.cuda.Stream(device=1)
        assert eng._stream_arg(mine)[0] == mine.cuda_stream


@pytest.mark.parametrize("route,pool", [("stage", 0), ("arena", 1)])
def test_cuda_views_zero_copy_and_decode_matches_reference(route, pool):
    g = torch.Generator().manual_seed(0)
    prefill = [5, 8]
    with akv.Engine(**cuda_cfg(route=route, device_pool_gib=pool)) as eng:
        ctxs = [eng.open_context() for _ in prefill]
        ref = []
        for c, n in zip(ctxs, prefill):
            k = torch.randn(L, n, H, D, generator=g).to(torch.bfloat16)
            v = torch.randn(L, n, H, D, generator=g).to(torch.bfloat16)
            c.append(k, v)
            ref.append([[k[l].cuda(), v[l].cuda()] for l in range(L)])
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            for _ in range(3):
                with eng.step(ctxs):
                    for layer in range(L):
                        lease = eng.lease_begin(layer)
                        view = lease.wait_ready()  # torch's current stream: `stream`
                        K, V = view.kv_tensors()
                        assert K.is_cuda and K.dtype == torch.bfloat16
                        assert K.data_ptr() == view.base  # zero copy
                        assert K.shape == (2, H, max(view.len) + 1, D)
                        for i in range(2):
                            n = view.len[i]
                            keys, vals = view.keys(i), view.values(i)
                            assert keys.data_ptr() == view.base + i * view.context_stride
                            assert torch.equal(keys[:n], ref[i][layer][0])
                            assert torch.equal(K[i, :, :n].transpose(0, 1), ref[i][layer][0])
                            kn = torch.randn(1, H, D, generator=g).to(torch.bfloat16).cuda()
                            vn = torch.randn(1, H, D, generator=g).to(torch.bfloat16).cuda()
                            keys[n] = kn[0]  # written on `stream`, through the view
                            vals[n] = vn[0]
                            q = torch.randn(1, H, 1, D, generator=g).to(torch.bfloat16).cuda()
                            got = torch.nn.functional.scaled_dot_product_attention(
                                q, keys[: n + 1].transpose(0, 1)[None].contiguous(),
                                vals[: n + 1].transpose(0, 1)[None].contiguous())
                            rk = torch.cat([ref[i][layer][0], kn])
                            rv = torch.cat([ref[i][layer][1], vn])
                            want = torch.nn.functional.scaled_dot_product_attention(
                                q, rk.transpose(0, 1)[None].contiguous(),
                                rv.transpose(0, 1)[None].contiguous())
                            assert torch.equal(got, want)
                            ref[i][layer] = [rk, rv]
                        attn = lease.mark_consumed()
                        lease.seal(lease.write_back(), attn)
                        lease.retire()
        for i, c in enumerate(ctxs):
            for layer in range(L):
                k, v = c.read(layer, 0, c.length)  # through the C API: the bytes written
                assert np.array_equal(k, ref[i][layer][0].cpu().view(torch.int16).numpy()
                                      .view(np.uint16))
                assert np.array_equal(v, ref[i][layer][1].cpu().view(torch.int16).numpy()
                                      .view(np.uint16))


@pytest.mark.parametrize("dtype,tname", [("fp8_e4m3", "float8_e4m3fn"),
                                         ("fp8_e5m2", "float8_e5m2")])
def test_cuda_fp8_views_are_torch_float8(dtype, tname):
    tdt = getattr(torch, tname, None)
    if tdt is None:
        pytest.skip("this torch has no %s" % tname)
    g = torch.Generator().manual_seed(1)
    with akv.Engine(**small(backend="cuda", head_dim=D, dtype=dtype)) as eng, \
            eng.open_context() as ctx:
        k = torch.randn(L, 4, H, D, generator=g).to(tdt)
        ctx.append(k, k)
        with eng.step([ctx]):
            for layer in range(L):
                lease = eng.lease_begin(layer)
                view = lease.wait_ready()
                K, V = view.kv_tensors()
                keys = view.keys(0)
                assert K.is_cuda and K.dtype == tdt and keys.dtype == tdt
                assert K.data_ptr() == view.base and keys.data_ptr() == view.base
                assert torch.equal(keys[:4].view(torch.uint8).cpu(), k[layer].view(torch.uint8))
                keys[4].view(torch.uint8).fill_(0x38)  # 1.0 in E4M3, 0.5 in E5M2
                attn = lease.mark_consumed()
                lease.seal(lease.write_back(), attn)
                lease.retire()
        k_row, _ = ctx.read(2, 4, 1)
        assert k_row.dtype == np.uint8 and (k_row == 0x38).all()
