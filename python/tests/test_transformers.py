"""activekv.transformers: an ActiveKVCache in unmodified transformers models, on the CPU.

Every test compares against transformers' own DynamicCache with deterministic
algorithms and requires bit-identical logits (torch.equal) on every step.
Skipped, with the reason shown, when torch or transformers is missing.
"""
from __future__ import annotations

import inspect

import pytest

try:
    import torch
    import transformers
    from transformers.cache_utils import CacheLayerMixin  # noqa: F401 - transformers 5.x API
except ImportError as exc:
    pytest.skip("the transformers adapter tests need torch and transformers>=5 (%s)" % exc,
                allow_module_level=True)

import activekv as akv  # noqa: E402
from activekv.transformers import ActiveKVCache, ActiveKVLayer  # noqa: E402
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.cache_utils import DynamicSlidingWindowLayer  # noqa: E402

VOCAB = 128


@pytest.fixture(autouse=True)
def deterministic():
    prev = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(prev)


def tiny_llama(dtype=torch.bfloat16, layers=3):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, max_position_embeddings=512)
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg).to(dtype).eval()


def tiny_gemma3(dtype=torch.bfloat16):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                           num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=16, sliding_window=4, max_position_embeddings=512,
                           layer_types=["sliding_attention", "sliding_attention",
                                        "full_attention"] * 2)
    cfg._attn_implementation = "sdpa"
    return Gemma3ForCausalLM(cfg).to(dtype).eval()


def cache_kw(model):
    """transformers >= 5.20 names the argument `cache`, earlier 5.x `past_key_values`."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def decode(model, cache, prompt, steps, attention_mask=None):
    """Prefill then greedy steps; returns every step's logits (prefill's last position first)."""
    kw = cache_kw(model)
    logits = []
    mask = attention_mask
    with torch.no_grad():
        out = model(input_ids=prompt, attention_mask=mask, use_cache=True, **{kw: cache})
        logits.append(out.logits[:, -1].clone())
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(steps):
            if mask is not None:
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            out = model(input_ids=token, attention_mask=mask, use_cache=True, **{kw: cache})
            logits.append(out.logits[:, -1].clone())
            token = out.logits[:, -1].argmax(-1, keepdim=True)
    return logits


def assert_bitwise(ref, got):
    assert len(ref) == len(got)
    for i, (a, b) in enumerate(zip(ref, got)):
        assert torch.equal(a, b), "step %d: logits differ (max |diff| %g)" % (
            i, (a.float() - b.float()).abs().max().item())


def prompt_ids(batch, length, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, length), generator=g)


@pytest.mark.parametrize("route,pool", [("stage", 0), ("arena", 1)])
@pytest.mark.parametrize("batch", [1, 3])
def test_manual_loop_bitwise(route, pool, batch):
    model = tiny_llama()
    prompt = prompt_ids(batch, 21)
    ref = decode(model, DynamicCache(config=model.config), prompt, steps=12)
    with ActiveKVCache(model, max_cache_len=64, batch_size=batch, route=route,
                       device_pool_gib=pool, page_tokens=8, hooks=True) as cache:
        got = decode(model, cache, prompt, steps=12)
        assert cache.engine.info().route == route
        stats = cache.stats
        unretired = len(cache._driver.sealed)
        info = cache.engine.info()
    assert_bitwise(ref, got)
    # Every full-attention layer of every step was staged, and the forward hooks sealed
    # every lease (none waited for the next layer's update).
    assert stats["leases"] == 12 * 3
    assert stats["hook_seals"] == 12 * 3 and stats["fallback_seals"] == 0
    # every lease is retired once: early (try_retire, off the critical path, when its
    # fences have passed) or at the next step boundary; the last step's that are still
    # sealed, at close
    assert stats["try_retire"] is True
    assert stats["retired_early"] + stats["retired_blocking"] + unretired == stats["leases"]
    assert unretired <= 3
    assert info.bytes_h2d + info.bytes_d2d > 0
    if route == "arena":
        assert info.bytes_d2d > 0, "arena route retained nothing"


def test_history_reaches_the_host_pool():
    """The prompt's rows (append_layer) and every decoded row (write-back through the
    staging buffer) are in each context's host rows, equal to DynamicCache's keys/values."""
    model = tiny_llama()
    prompt = prompt_ids(2, 10)
    ref_cache = DynamicCache(config=model.config)
    decode(model, ref_cache, prompt, steps=5)
    with ActiveKVCache(model, max_cache_len=32, batch_size=2) as cache:
        decode(model, cache, prompt, steps=5)
        # The last step's new rows are staged; DynamicCache holds 10 + 5 + 1 - 1 rows of
        # history after 5 steps plus the prefill (the last token's row is in both).
        cache.finish()
        for d, layer_idx in enumerate(cache.dense_layers):
            keys = ref_cache.layers[layer_idx].keys
            values = ref_cache.layers[layer_idx].values
            n = keys.shape[-2]
            for b, ctx in enumerate(cache.contexts):
                assert len(ctx) == n
                k, v = ctx.read(d, 0, n)
                k = torch.from_numpy(k).view(torch.bfloat16)
                v = torch.from_numpy(v).view(torch.bfloat16)
                assert torch.equal(k, keys[b].transpose(0, 1)), (d, b)
                assert torch.equal(v, values[b].transpose(0, 1)), (d, b)


def test_generate_bitwise_with_padding():
    """model.generate() with a left-padded batch of 2: padding rows are stored like any
    other row, and sequences and per-step logits match DynamicCache exactly."""
    model = tiny_llama()
    prompt = prompt_ids(2, 12)
    mask = torch.ones_like(prompt)
    mask[1, :4] = 0  # row 1 is left-padded
    args = dict(input_ids=prompt, attention_mask=mask, max_new_tokens=9, do_sample=False,
                return_dict_in_generate=True, output_logits=True, pad_token_id=0)
    kw = cache_kw(model)
    ref = model.generate(**args, **{kw: DynamicCache(config=model.config)})
    with ActiveKVCache(model, max_cache_len=32, batch_size=2) as cache:
        got = model.generate(**args, **{kw: cache})
        stats = cache.stats
    assert torch.equal(ref.sequences, got.sequences)
    assert_bitwise(list(ref.logits), list(got.logits))
    assert stats["leases"] == 8 * 3  # 9 new tokens: the prefill and 8 decode steps


def test_without_hooks_the_next_update_seals():
    """A cache built from a config (no model, no forward hooks) seals each lease at the
    next layer's update and at the next step boundary, with the same logits."""
    model = tiny_llama(layers=2)
    prompt = prompt_ids(1, 9)
    ref = decode(model, DynamicCache(config=model.config), prompt, steps=6)
    with ActiveKVCache(config=model.config, device="cpu", dtype=torch.bfloat16,
                       max_cache_len=32) as cache:
        got = decode(model, cache, prompt, steps=6)
        pending_last = cache.stats
        cache.finish()  # the step boundary seals the last layer's lease
        stats = cache.stats
    assert_bitwise(ref, got)
    assert pending_last["fallback_seals"] == 6 * 2 - 1
    assert stats["hook_seals"] == 0 and stats["fallback_seals"] == 6 * 2


def test_float32_bitwise():
    model = tiny_llama(dtype=torch.float32)
    prompt = prompt_ids(2, 7)
    ref = decode(model, DynamicCache(config=model.config), prompt, steps=5)
    with ActiveKVCache(model, max_cache_len=16, batch_size=2) as cache:
        got = decode(model, cache, prompt, steps=5)
        assert cache.engine_config["dtype"] == "f32"
    assert_bitwise(ref, got)


def test_gemma3_sliding_layers_stay_with_transformers():
    try:
        model = tiny_gemma3()
    except Exception as exc:  # pragma: no cover - depends on the installed transformers
        pytest.skip("a Gemma3 text model does not construct offline here: %s" % exc)
    prompt = prompt_ids(2, 11)  # longer than the 4-token window
    ref = decode(model, DynamicCache(config=model.config), prompt, steps=8)
    with ActiveKVCache(model, max_cache_len=32, batch_size=2, route="arena",
                       device_pool_gib=1, page_tokens=4) as cache:
        got = decode(model, cache, prompt, steps=8)
        assert cache.dense_layers == [2, 5]
        assert cache.engine_config["n_dense_layers"] == 2
        kinds = [type(layer) for layer in cache.layers]
        assert kinds == [DynamicSlidingWindowLayer, DynamicSlidingWindowLayer, ActiveKVLayer] * 2
        assert cache.stats["leases"] == 8 * 2
    assert_bitwise(ref, got)


def test_paged_route_refused():
    model = tiny_llama(layers=1)
    with pytest.raises(ValueError, match="page table"):
        ActiveKVCache(model, max_cache_len=16, route="paged", device_pool_gib=1)


def test_host_pool_is_the_smallest_that_fits():
    model = tiny_llama(layers=1)
    with ActiveKVCache(model, max_cache_len=16, batch_size=2) as cache:
        cfg = cache.engine_config
        report = akv.fit(**dict(cfg))
        assert report.ok and cfg["host_pool_gib"] == report.host_pool_gib_needed == 1
        assert cfg["kv_heads"] == 2 and cfg["head_dim"] == 16 and cfg["max_contexts"] == 2


def test_refusals_change_nothing():
    """A batch larger than the cache, a multi-token update after the prompt and a
    max_cache_len overflow are refused with clear errors."""
    model = tiny_llama(layers=1)
    kw = cache_kw(model)
    with ActiveKVCache(model, max_cache_len=12, batch_size=1) as cache:
        with pytest.raises(ValueError, match="batch_size=1"):
            model(input_ids=prompt_ids(2, 4), use_cache=True, **{kw: cache})
    with ActiveKVCache(model, max_cache_len=12, batch_size=1) as cache:
        model(input_ids=prompt_ids(1, 4), use_cache=True, **{kw: cache})
        with pytest.raises(NotImplementedError, match="chunked prefill"):
            model(input_ids=prompt_ids(1, 3), use_cache=True, **{kw: cache})
    with ActiveKVCache(model, max_cache_len=12, batch_size=1) as cache:
        with pytest.raises(ValueError, match="max_cache_len"):
            model(input_ids=prompt_ids(1, 13), use_cache=True, **{kw: cache})
    # A decode row past max_cache_len is refused before the step boundary moves.
    with ActiveKVCache(model, max_cache_len=5, batch_size=1) as cache, torch.no_grad():
        model(input_ids=prompt_ids(1, 4), use_cache=True, **{kw: cache})
        model(input_ids=prompt_ids(1, 1), use_cache=True, **{kw: cache})
        with pytest.raises(ValueError, match="exceeds max_cache_len=5"):
            model(input_ids=prompt_ids(1, 1), use_cache=True, **{kw: cache})
        assert cache.get_seq_length() == 5


def test_close_mid_step_and_twice():
    """An error inside the forward leaves a step half leased; close() still brings it to
    its end and frees the engine (which refuses to close with an open step), twice is a no-op."""
    model = tiny_llama(layers=2)
    kw = cache_kw(model)
    cache = ActiveKVCache(model, max_cache_len=16)
    with torch.no_grad():
        model(input_ids=prompt_ids(1, 5), use_cache=True, **{kw: cache})

        def fail(*_a, **_k):
            raise RuntimeError("interrupted")

        handle = model.model.layers[1].register_forward_pre_hook(fail)
        try:
            with pytest.raises(RuntimeError, match="interrupted"):
                model(input_ids=prompt_ids(1, 1), use_cache=True, **{kw: cache})
        finally:
            handle.remove()
    drv = cache._driver
    assert drv.step_open and drv.next_dense == 1  # layer 0 leased, layer 1 never reached
    cache.close()
    assert drv.engine is None and not drv.step_open
    cache.close()


def test_try_retire_not_ready_is_matched_by_value_and_other_statuses_raise():
    """The adapter's opportunistic retire: AKV_ERR_NOT_READY (24) leaves the lease for the
    step boundary; any other failure, a status newer than the package included, raises
    (a transport failure also marks the cache failed)."""
    from activekv import transformers as T

    assert T._NOT_READY == 24 and akv.errors.STATUS_NAMES[24] == "AKV_ERR_NOT_READY"
    assert T._try_retire_pending(24)
    assert not any(T._try_retire_pending(st) for st in (0, 11, 14, 23, 25, 99))
    model = tiny_llama(layers=1)
    with ActiveKVCache(model, max_cache_len=16) as cache:
        drv = cache._driver
        assert drv.try_retire_ok and drv.api.try_retire is not None
        real = drv.api.try_retire
        calls = []

        def fake(status):
            def fn(lease, receipt):
                calls.append(lease)
                return status
            return fn

        try:
            drv.sealed = [0xDEAD]
            drv.api.try_retire = fake(24)
            drv.try_retire()  # pending: nothing changed, nothing raised
            assert drv.sealed == [0xDEAD] and calls == [0xDEAD] and drv.failed is None
            drv.api.try_retire = fake(99)
            with pytest.raises(akv.ActiveKVError) as ei:
                drv.try_retire()
            assert ei.value.name == "AKV_STATUS_99" and drv.failed is None
            drv.api.try_retire = fake(14)
            with pytest.raises(akv.Backend):
                drv.try_retire()
            assert isinstance(drv.failed, akv.TransportError)
        finally:
            drv.sealed = []
            drv.failed = None
            drv.api.try_retire = real


def test_the_adapter_uses_the_package_mirrors():
    """One definition of each struct: the adapter's hot-path structs are activekv._lib's."""
    from activekv import _lib
    from activekv import transformers as T

    assert T._View is _lib.akv_view and T._Fence is _lib.akv_fence
    assert T._Receipt is _lib.akv_receipt
