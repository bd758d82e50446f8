"""FP8 K/V (AKV_DTYPE_FP8_E4M3, AKV_DTYPE_FP8_E5M2: one byte per element) from
Python, on the host backend: the fit, rows in and out as uint8 codes, zero-copy
views (numpy uint8, torch float8), write-back, and the C reference attention
(akv_attention.h) over an FP8 view with per-head scales, against a float64
attention over the decoded values."""
import ctypes

import numpy as np
import pytest

import activekv as akv
from activekv import _lib

from conftest import small

L, H, D = 3, 2, 8
PT = 4  # page_tokens of small(): the attention chunk
FP8 = ["fp8_e4m3", "fp8_e5m2"]


def codes(rng, dtype, shape):
    """Random finite FP8 codes of moderate magnitude (about 2^-4 .. 2^3)."""
    sign = rng.integers(0, 2, shape) << 7
    if dtype == "fp8_e4m3":  # 4 exponent bits (bias 7), 3 mantissa bits
        exp, man = rng.integers(3, 11, shape) << 3, rng.integers(0, 8, shape)
    else:  # E5M2: 5 exponent bits (bias 15), 2 mantissa bits
        exp, man = rng.integers(11, 19, shape) << 2, rng.integers(0, 4, shape)
    return (sign | exp | man).astype(np.uint8)


def decode(c, dtype):
    """FP8 codes -> float64, exactly (OCP E4M3 "fn" and E5M2)."""
    if dtype == "fp8_e5m2":  # the top byte of an IEEE f16
        return (c.astype(np.uint16) << 8).view(np.float16).astype(np.float64)
    c = c.astype(np.int64)
    e, m = (c >> 3) & 0xF, c & 7
    v = np.where(e == 0, m / 8.0 * 2.0 ** -6, (1 + m / 8.0) * 2.0 ** (e - 7))
    v = np.where((c & 0x7F) == 0x7F, np.nan, v)
    return np.where(c & 0x80, -v, v)


def bf16_bits(a):
    return (a.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


def bf16_value(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def ok(status):
    assert status == 0, _lib.lib.akv_status_string(status).decode()


def c_floats(values):
    arr = (ctypes.c_float * len(values))(*values)
    return arr, ctypes.cast(arr, ctypes.POINTER(ctypes.c_float))


def attend(view, q, k_scale, v_scale, n_heads):
    """The C reference attention over the view (contiguous), and again through a
    page table over the same rows (akv_attention_paged_ref_bf16): both outputs."""
    n = view.n_contexts
    args = _lib.akv_attention_args()
    ok(_lib.lib.akv_attention_args_from_view(ctypes.byref(view._c), ctypes.byref(args)))
    assert args.dtype == akv._api.DTYPES[view.dtype] and args.row_bytes == view.row_stride
    lens = [x + 1 for x in view.len]
    c_len = (ctypes.c_uint32 * n)(*lens)
    ks, ks_p = c_floats(k_scale)
    vs, vs_p = c_floats(v_scale)
    ws_bytes = ctypes.c_size_t()
    ok(_lib.lib.akv_attention_workspace_bytes(n, n_heads, D, max(lens), PT,
                                              ctypes.byref(ws_bytes)))
    ws = (ctypes.c_uint8 * ws_bytes.value)()
    out = np.full((n, n_heads, D), np.nan, np.float32)
    args.n_heads, args.chunk_tokens, args.scale = n_heads, PT, 1.0 / np.sqrt(D)
    args.q = q.ctypes.data
    args.len = ctypes.cast(c_len, ctypes.POINTER(ctypes.c_uint32))
    args.out = out.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
    args.workspace, args.workspace_bytes = ctypes.addressof(ws), ws_bytes.value
    args.k_scale, args.v_scale = ks_p, vs_p
    ok(_lib.lib.akv_attention_ref_bf16(ctypes.byref(args)))
    # FP8 needs both scales: without them the reference refuses
    args.k_scale = args.v_scale = None
    assert _lib.lib.akv_attention_ref_bf16(ctypes.byref(args)) == 1  # INVALID_ARGUMENT

    # The same rows as pages of PT rows each, in place in the staging buffer.
    page_stride = PT * args.row_bytes
    assert args.context_stride % page_stride == 0
    per_ctx = args.context_stride // page_stride
    pages = [-(-x // PT) for x in lens]
    indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.uint32)
    indices = np.concatenate([i * per_ctx + np.arange(p) for i, p in enumerate(pages)])
    indices = indices.astype(np.uint32)
    last = np.array([x - (p - 1) * PT for x, p in zip(lens, pages)], np.uint32)
    u32 = ctypes.POINTER(ctypes.c_uint32)
    table = _lib.akv_page_table(n, PT, max(pages), indptr.ctypes.data_as(u32),
                                indices.ctypes.data_as(u32), last.ctypes.data_as(u32),
                                args.k_base, args.v_base, page_stride, args.row_bytes)
    ok(_lib.lib.akv_attention_workspace_bytes(n, n_heads, D, max(pages) * PT, PT,
                                              ctypes.byref(ws_bytes)))
    ws2 = (ctypes.c_uint8 * ws_bytes.value)()
    out2 = np.full((n, n_heads, D), np.nan, np.float32)
    pargs = _lib.akv_attention_paged_args(
        args.dtype, n_heads, H, D, args.scale, q.ctypes.data,
        out2.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), ctypes.addressof(ws2),
        ws_bytes.value, ks_p, vs_p)
    ok(_lib.lib.akv_attention_paged_ref_bf16(ctypes.byref(pargs), table))
    return out, out2


def attention_f64(qf, k, v, k_scale, v_scale, n_heads):
    """float64 GQA decode attention for one context: qf [n_heads, D], k and v
    [T, H, D] decoded values, scaled per KV head."""
    k = k * np.asarray(k_scale)[None, :, None]
    v = v * np.asarray(v_scale)[None, :, None]
    out = np.empty((n_heads, D))
    for h in range(n_heads):
        g = h // (n_heads // H)
        s = k[:, g, :] @ qf[h] / np.sqrt(D)
        p = np.exp(s - s.max())
        out[h] = (p / p.sum()) @ v[:, g, :]
    return out


@pytest.mark.parametrize("dtype", FP8)
def test_fit_counts_one_byte_per_element(dtype):
    geo = {k: v for k, v in small().items() if k not in ("log", "dtype")}
    r8 = akv.fit(**geo, dtype=dtype)
    r16 = akv.fit(**geo, dtype="bf16")
    assert r8.row_bytes == H * D and r16.row_bytes == 2 * r8.row_bytes
    assert r16.history_bytes == 2 * r8.history_bytes and r16.page_bytes == 2 * r8.page_bytes


@pytest.mark.parametrize("dtype", FP8)
def test_fp8_rows_views_write_back_and_reference_attention(dtype):
    rng = np.random.default_rng(20)
    n_heads = 2 * H
    k_scale, v_scale = [0.5, 1.25], [2.0, 0.75]
    with akv.Engine(**small(dtype=dtype)) as eng:
        assert eng.dtype == dtype and eng.config["dtype"] == dtype
        assert eng.info().row_bytes == H * D
        a, b = eng.open_context(), eng.open_context()
        ka, va = codes(rng, dtype, (L, 5, H, D)), codes(rng, dtype, (L, 5, H, D))
        a.append(ka, va)
        ref = [[[ka[layer], va[layer]] for layer in range(L)], []]
        for layer in range(L):  # per layer, as int8 codes (the same bytes)
            kb, vb = codes(rng, dtype, (3, H, D)), codes(rng, dtype, (3, H, D))
            b.append_layer(layer, kb.view(np.int8), vb.view(np.int8))
            ref[1].append([kb, vb])
        rk, rv = b.read(2, 0, 3)
        assert rk.dtype == np.uint8 and rk.tobytes() == ref[1][2][0].tobytes()
        for bad in (np.float32, np.float16, np.uint16):
            with pytest.raises(akv.InvalidArgument):
                a.append(np.zeros((L, 1, H, D), bad), np.zeros((L, 1, H, D), bad))
        assert a.length == 5 and b.length == 3  # the refusals appended nothing

        for _ in range(3):
            with eng.step([a, b]):
                for layer in range(L):
                    lease = eng.lease_begin(layer)
                    view = lease.wait_ready()
                    assert view.dtype == dtype
                    for i, ctx_ref in enumerate(ref):
                        n = view.len[i]
                        keys, vals = view.keys(i), view.values(i)
                        assert keys.dtype == np.uint8 and keys.shape == (n + 1, H, D)
                        assert keys.strides == (view.row_stride, D, 1)
                        assert keys.__array_interface__["data"][0] == (
                            view.base + i * view.context_stride)
                        assert keys[:n].tobytes() == ctx_ref[layer][0].tobytes()
                        assert vals[:n].tobytes() == ctx_ref[layer][1].tobytes()
                        kn, vn = codes(rng, dtype, (1, H, D)), codes(rng, dtype, (1, H, D))
                        keys[n], vals[n] = kn[0], vn[0]
                        ctx_ref[layer] = [np.concatenate([ctx_ref[layer][0], kn]),
                                          np.concatenate([ctx_ref[layer][1], vn])]
                    q = bf16_bits(rng.standard_normal((2, n_heads, D)))
                    out, out_paged = attend(view, q, k_scale, v_scale, n_heads)
                    assert out.tobytes() == out_paged.tobytes()  # same rows, same bits
                    want = np.stack([
                        attention_f64(bf16_value(q[i]), decode(ref[i][layer][0], dtype),
                                      decode(ref[i][layer][1], dtype), k_scale, v_scale,
                                      n_heads) for i in range(2)])
                    err = np.linalg.norm(out - want) / np.linalg.norm(want)
                    assert err <= 1e-5, f"relative L2 {err:.3g}"
                    attn = lease.mark_consumed()
                    lease.seal(lease.write_back(), attn)
                    r = lease.retire()
                    assert r.bytes_d2h == 2 * 2 * H * D  # one K and one V row per context
        assert a.length == 8 and b.length == 6
        for i, ctx in enumerate((a, b)):
            for layer in range(L):
                k, v = ctx.read(layer, 0, ctx.length)
                assert k.tobytes() == ref[i][layer][0].tobytes()
                assert v.tobytes() == ref[i][layer][1].tobytes()


@pytest.mark.parametrize("dtype", FP8)
def test_fp8_torch_rows_and_kv_tensors(dtype):
    torch = pytest.importorskip("torch")
    tdt = getattr(torch, {"fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}[dtype], None)
    if tdt is None:
        pytest.skip("this torch has no %s" % dtype)
    other = torch.float8_e5m2 if dtype == "fp8_e4m3" else torch.float8_e4m3fn
    rng = np.random.default_rng(21)
    with akv.Engine(**small(dtype=dtype)) as eng, eng.open_context() as ctx:
        k = torch.randn(L, 4, H, D).to(tdt)
        v = torch.randn(L, 4, H, D).to(tdt)
        ctx.append(k, v)
        rk, _ = ctx.read(1, 0, 4)
        assert torch.equal(torch.from_numpy(rk).view(tdt).view(torch.uint8),
                           k[1].view(torch.uint8))
        for bad in (k.to(other), k.to(torch.bfloat16), k.view(torch.uint8).to(torch.int16)):
            with pytest.raises(akv.InvalidArgument):
                ctx.append(bad, bad)
        ctx.append(k.view(torch.uint8)[:, :1].contiguous(), v.view(torch.uint8)[:, :1].contiguous())
        assert ctx.length == 5
        written = []
        with eng.step([ctx]):
            for layer in range(L):
                lease = eng.lease_begin(layer)
                view = lease.wait_ready()
                K, V = view.kv_tensors()
                assert K.dtype == tdt and V.dtype == tdt and K.shape == (1, H, 6, D)
                assert K.data_ptr() == view.base and V.data_ptr() == view.base + view.v_offset
                # torch's decoding of the staged codes is the exact FP8 decoding
                want = decode(view.keys(0)[:5], dtype).transpose(1, 0, 2)
                assert np.array_equal(K[0, :, :5].float().numpy().astype(np.float64), want)
                new_k = codes(rng, dtype, (H, D))
                K[0, :, 5].copy_(torch.from_numpy(new_k).view(tdt))  # through torch
                view.values(0)[5] = new_k[::-1]  # through numpy
                attn = lease.mark_consumed()
                lease.seal(lease.write_back(), attn)
                lease.retire()
                written.append(new_k)
        for layer, new_k in enumerate(written):
            k_row, v_row = ctx.read(layer, 5, 1)
            assert k_row[0].tobytes() == new_k.tobytes()
            assert v_row[0].tobytes() == new_k[::-1].tobytes()
