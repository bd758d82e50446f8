"""Misuse by an outside caller that the earlier misuse tests did not reach:
sentinel values given as plain integers.

Each test fails on the package before its fix. Host backend, no GPU needed.
"""
import numpy as np
import pytest

import activekv as akv

from conftest import quiet, small

L, H, D = 3, 2, 8


@pytest.fixture
def destroys(monkeypatch):
    """Handles akv_engine_destroy freed, in order."""
    real = akv._api.lib.akv_engine_destroy
    freed = []

    def counted(h):
        st = real(h)
        if st == 0:
            freed.append(h)
        return st

    monkeypatch.setattr(akv._api.lib, "akv_engine_destroy", counted)
    return freed


# ------------------------------------------------------------ sentinels


def test_open_context_target_pages_of_the_fair_share_sentinel_is_refused():
    """target_pages=2**32 - 1 is AKV_TARGET_FAIR_SHARE to the library: an
    explicit target of that many pages (in range for a uint32_t) was taken
    as "the fair share" silently, instead of being refused like any other
    target the pool cannot hold. The fair share is target_pages=None."""
    with akv.Engine(**small(route="arena", device_pool_gib=1, log=quiet)) as eng:
        with pytest.raises(akv.InvalidArgument, match="None"):
            eng.open_context(target_pages=0xFFFFFFFF)
        with pytest.raises(akv.InvalidArgument):
            eng.open_context(target_pages=np.uint32(0xFFFFFFFF))
        assert eng.admission_counters()["admit"] == 0  # nothing was opened
        eng.open_context(target_pages=None).close()


def test_cache_target_pages_of_the_fair_share_sentinel_is_refused(destroys):
    """The same for ActiveKVCache(target_pages=2**32 - 1): taken as the fair
    share at the first update."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers import LlamaConfig

    from activekv.transformers import ActiveKVCache

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         vocab_size=64)
    with pytest.raises(akv.InvalidArgument, match="None"):
        ActiveKVCache(config=config, device="cpu", dtype=torch.float32, max_cache_len=16,
                      page_tokens=4, target_pages=0xFFFFFFFF, log=quiet)
    assert destroys == []  # refused before any engine was made
