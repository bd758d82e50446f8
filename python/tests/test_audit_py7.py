"""A seventh audit of the Python package, as a runtime driving the
transformers adapter would use it: small models built from a config, in
generate() and in a manual decode loop, checked bit for bit against
DynamicCache where docs/python.md promises it.

Host backend, no GPU needed; the adapter tests skip, with the reason shown,
without torch or transformers (or without the model family they build).
"""
import inspect

import numpy as np
import pytest

import activekv as akv

from conftest import quiet

VOCAB = 128


def _torch_transformers():
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("transformers.cache_utils").CacheLayerMixin  # noqa: B018 - 5.x API
    return torch


@pytest.fixture
def deterministic():
    torch = _torch_transformers()
    prev = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield torch
    torch.use_deterministic_algorithms(prev)


def _cache_kw(model):
    """transformers >= 5.20 names the argument `cache`, earlier 5.x `past_key_values`."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _generate(model, ids, cache=None, **kw):
    if cache is not None:
        kw[_cache_kw(model)] = cache
    return model.generate(ids, do_sample=False, pad_token_id=0, return_dict_in_generate=True,
                          output_scores=True, **kw)


def _same_generation(ref, got):
    assert got.sequences.shape == ref.sequences.shape
    assert all(__import__("torch").equal(a, b) for a, b in zip(ref.scores, got.scores)), \
        "scores differ from DynamicCache's"
    assert __import__("torch").equal(ref.sequences, got.sequences)


# ------------------------------------------- heterogeneous per-layer configs


def _tiny_gemma4(torch, shared=0):
    gemma4 = pytest.importorskip("transformers.models.gemma4")
    torch.manual_seed(0)
    cfg = gemma4.Gemma4TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
        sliding_window=4, max_position_embeddings=512,
        layer_types=["sliding_attention", "full_attention"] * 2,
        num_kv_shared_layers=shared, hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=VOCAB)
    cfg._attn_implementation = "sdpa"
    return gemma4.Gemma4ForCausalLM(cfg).float().eval()


@pytest.mark.parametrize("shared", [0, 2])
def test_cache_geometry_of_a_per_layer_config_comes_from_its_full_attention_layers(
        deterministic, shared):
    """Gemma 4's config gives its full-attention layers another head_dim (and may give
    them other KV heads) than its sliding layers (`per_layer_config`); reading the
    global `head_dim` of such a config raises transformers' RuntimeError
    (AmbiguousGlobalPerLayerAttributeError), so no cache could be made for the model.
    The engine's geometry is that of the full-attention layers it stages; with KV
    sharing, the layers that reuse another layer's K/V hold none."""
    torch = deterministic
    from activekv.transformers import ActiveKVCache

    model = _tiny_gemma4(torch, shared)
    ids = torch.randint(1, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    ref = _generate(model, ids, attention_mask=mask, max_new_tokens=6)
    with ActiveKVCache(model, max_cache_len=32, batch_size=2, page_tokens=4, log=quiet) as cache:
        assert (cache.engine_config["head_dim"], cache.engine_config["kv_heads"]) == (32, 2)
        got = _generate(model, ids, cache, attention_mask=mask, max_new_tokens=6)
        assert cache.get_seq_length() == 7 + 6 - 1
    _same_generation(ref, got)


def test_cache_for_full_attention_layers_of_different_geometries_is_refused_by_name():
    """One engine stages one geometry: a per-layer config whose full-attention layers
    disagree is a ValueError naming them, before any engine exists."""
    torch = _torch_transformers()
    transformers = pytest.importorskip("transformers")
    from activekv.transformers import ActiveKVCache

    try:
        cfg = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            per_layer_config={1: {"num_key_value_heads": 4}})
    except TypeError as exc:  # a transformers without per-layer configs
        pytest.skip("this transformers has no per_layer_config (%s)" % exc)
    if not getattr(cfg, "is_heterogeneous", False):
        pytest.skip("this transformers has no heterogeneous configs")
    with pytest.raises(ValueError, match=r"\(4, 16\) at layers \[1\]"):
        ActiveKVCache(config=cfg, device="cpu", dtype=torch.float32, max_cache_len=16,
                      log=quiet)


# ---------------------------------------- linear-attention (conv) layers


def _tiny_lfm2(torch):
    lfm2 = pytest.importorskip("transformers.models.lfm2")
    torch.manual_seed(0)
    cfg = lfm2.Lfm2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                          num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                          layer_types=["conv", "full_attention", "conv", "full_attention"],
                          pad_token_id=0, bos_token_id=1, eos_token_id=2)
    cfg._attn_implementation = "sdpa"
    return lfm2.Lfm2ForCausalLM(cfg).float().eval()


def _linear_layers_counted() -> bool:
    """Whether this transformers' linear-attention layers say their token count (and
    the cache counts them); older releases have no get_seq_length there."""
    from transformers import cache_utils

    mixin = getattr(cache_utils, "LinearAttentionCacheLayerMixin", None)
    return mixin is not None and callable(getattr(mixin, "get_seq_length", None))


def test_cache_on_a_model_with_conv_layers_decodes_as_a_dynamic_cache(deterministic):
    torch = deterministic
    from activekv.transformers import ActiveKVCache, ActiveKVLayer

    model = _tiny_lfm2(torch)
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    ref = _generate(model, ids, max_new_tokens=6, min_new_tokens=6)
    with ActiveKVCache(model, max_cache_len=32, batch_size=2, page_tokens=4, log=quiet) as cache:
        assert [isinstance(layer, ActiveKVLayer) for layer in cache.layers] == \
            [False, True, False, True]
        got = _generate(model, ids, cache, max_new_tokens=6, min_new_tokens=6)
        assert cache.get_seq_length() == 9 + 6 - 1
        counted = 14 if _linear_layers_counted() else None
        assert cache.layer_lengths == [counted, 14, counted, 14]
    _same_generation(ref, got)


def test_refused_decode_after_conv_layers_took_its_token_is_a_forward_cut_short(deterministic):
    """A conv (linear-attention) layer keeps its state through transformers' own calls
    (get_conv_state, increase_count: updated in place), before the first full-attention
    layer sees the forward. A decode the full-attention layer then refused (K/V that
    require grad under grad mode) had advanced the conv layers already; the cache said
    nothing (cut_short None, get_seq_length one past the full-attention layers'), and
    the same token again under no_grad decoded with the conv layers two tokens on:
    wrong logits, silently. The conv layers are counted with the others: the refusal
    leaves a forward cut short, reported as one, and the next forward is refused by
    name (StepState) instead of decoding wrong rows."""
    torch = deterministic
    from activekv.transformers import ActiveKVCache

    if not _linear_layers_counted():
        pytest.skip("this transformers' linear-attention layers have no get_seq_length: "
                    "the cache cannot count them (docs/python.md)")
    model = _tiny_lfm2(torch)
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    token = torch.randint(3, VOCAB, (2, 1), generator=torch.Generator().manual_seed(2))
    with ActiveKVCache(model, max_cache_len=32, batch_size=2, page_tokens=4, log=quiet) as cache:
        with torch.no_grad():
            model(ids, **{_cache_kw(model): cache})
        assert cache.cut_short is None and cache.get_seq_length() == 9
        with pytest.raises(ValueError, match="require grad"):
            model(token, **{_cache_kw(model): cache})  # grad mode on: refused at layer 1
        assert cache.layer_lengths == [10, 9, 9, 9]
        assert cache.get_seq_length() == 9
        assert isinstance(cache.cut_short, akv.StepState)
        with torch.no_grad(), pytest.raises(akv.StepState, match=r"layers \[1, 2, 3\]"):
            model(token, **{_cache_kw(model): cache})


# ------------------------------------------------------------- arguments


@pytest.mark.parametrize("dtype", ["float16", "bf16", np.float32, []])
def test_cache_dtype_that_is_not_a_torch_dtype_is_refused_as_such(dtype):
    """`dtype="float16"` (transformers takes dtype names in from_pretrained) was refused
    with "K/V dtype float16 is not bf16, f16 or f32", a contradiction on its face; the
    refusal now says what dtype= takes."""
    torch = _torch_transformers()
    transformers = pytest.importorskip("transformers")
    from activekv.transformers import ActiveKVCache

    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=16)
    with pytest.raises(ValueError, match=r"not a torch\.dtype.*torch\.bfloat16, torch\.float16 "
                                         r"or torch\.float32"):
        ActiveKVCache(config=cfg, device="cpu", dtype=dtype, max_cache_len=16, log=quiet)
    with pytest.raises(ValueError, match=r"torch\.float64 is not torch\.bfloat16"):
        ActiveKVCache(config=cfg, device="cpu", dtype=torch.float64, max_cache_len=16,
                      log=quiet)


def test_fit_refusal_names_its_reason():
    """akv.fit() of a config the library refuses raised a bare "fit: invalid
    configuration": the library dropped the reason it computed. It now hands
    it to the config's log callback (the line engine create logs), and the
    exception carries it, as Engine's does."""
    geometry = dict(n_dense_layers=2, kv_heads=2, head_dim=64, max_tokens=64, page_tokens=0,
                    host_pool_gib=1, max_contexts=2)
    with pytest.raises(akv.Config) as fit_err:
        akv.fit(**geometry)
    assert "page_tokens" in str(fit_err.value)
    with pytest.raises(akv.Config) as create_err:
        akv.Engine(backend="host", log=quiet, **geometry)
    assert str(fit_err.value).split("fit: ", 1)[1] in str(create_err.value)
    # A verdict is not a refusal: a config that does not fit is a report.
    geometry.update(page_tokens=16, max_contexts=1 << 20)
    assert akv.fit(**geometry).ok is False
