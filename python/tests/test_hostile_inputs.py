"""Hostile inputs: arrays, integers and Cache calls that a caller can pass by
mistake, each of which must be refused before anything changes (or work
exactly), never be taken as something else than what was given.

The transformers tests are skipped, with the reason shown, when torch or
transformers is missing.
"""
from __future__ import annotations

import numpy as np
import pytest
from numpy.lib.stride_tricks import as_strided

import activekv as akv

from conftest import quiet, small

L, H, D = 3, 2, 8


def rows(rng, n, dtype=np.float32, layers=L):
    return rng.standard_normal((layers, n, H, D)).astype(dtype)


# ------------------------------------------------------------------ arrays


def test_append_layer_with_more_rows_than_uint32_is_refused_not_truncated(engine):
    """n_tokens is a uint32_t: 2**32 + 1 rows would reach C as 1 row."""
    ctx = engine.open_context()
    base = np.zeros((1, H, D), np.float32)
    # a C-contiguous array of 2**32 + 1 rows over one row of memory: the
    # package refuses it on its shape, so nothing past the row is ever read
    huge = as_strided(base, shape=(2 ** 32 + 1, H, D), strides=base.strides)
    assert huge.flags.c_contiguous
    with pytest.raises(akv.InvalidArgument):
        ctx.append_layer(1, huge, huge)
    with pytest.raises(akv.InvalidArgument):
        ctx.read(1, 0, 1)  # layer 1 holds nothing
    assert ctx.length == 0


def test_masked_rows_are_refused_not_appended_with_their_hidden_data(engine):
    rng = np.random.default_rng(1)
    ctx = engine.open_context()
    k, v = rows(rng, 2), rows(rng, 2)
    mk = np.ma.masked_array(k, mask=np.zeros(k.shape, bool))
    mk.mask[1, 0, 0, 0] = True
    with pytest.raises(akv.InvalidArgument, match="masked"):
        ctx.append(mk, v)
    with pytest.raises(akv.InvalidArgument, match="masked"):
        ctx.append_layer(0, v[0], mk[1])
    assert ctx.length == 0
    with pytest.raises(akv.InvalidArgument):
        ctx.read(0, 0, 1)
    # nothing masked: the data is exactly the rows
    ctx.append(np.ma.masked_array(k), v)
    assert np.array_equal(ctx.read(2, 0, 2)[0], k[2])


@pytest.mark.filterwarnings("ignore:.*quantized:UserWarning")
def test_quantized_torch_tensors_raise_invalid_argument():
    torch = pytest.importorskip("torch")
    with akv.Engine(**small(dtype="fp8_e4m3")) as eng, eng.open_context() as ctx:
        q = torch.quantize_per_tensor(torch.zeros(2, H, D), 0.1, 0, torch.quint8)
        with pytest.raises(akv.InvalidArgument):
            ctx.append_layer(0, q, q)
        assert ctx.length == 0
