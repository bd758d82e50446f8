"""A fifth audit of the Python package: the lengths an ActiveKVCache reports
after a forward cut short between its layers, a hybrid model's cut-short
forwards, the forward hooks of a cache dropped without close(), the order in
which Lease.seal reads its arguments, and misuse of the public API by a
caller who did not write it.

Host backend, no GPU needed; the adapter tests skip, with the reason shown,
without torch and transformers.
"""
import gc
import inspect
import weakref

import numpy as np
import pytest

import activekv as akv

from conftest import tiny_llama as _llama, quiet, small

# ------------------------------------------------------------ models


def _gemma3(types):
    """A tiny Gemma 3 text model whose layers are `types` ("s" sliding-window,
    "f" full attention), float32, SDPA."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    names = {"s": "sliding_attention", "f": "full_attention"}
    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                           num_hidden_layers=len(types), num_attention_heads=4,
                           num_key_value_heads=2, head_dim=8, sliding_window=4,
                           max_position_embeddings=128, layer_types=[names[t] for t in types])
    cfg._attn_implementation = "sdpa"
    model = Gemma3ForCausalLM(cfg).to(torch.float32).eval()
    params = inspect.signature(model.forward).parameters
    return torch, model, "cache" if "cache" in params else "past_key_values"


class _Cut(Exception):
    """What the model raises between two layers in these tests."""


def _cut_at(model, layer):
    """Makes `layer`'s MLP raise once (after that layer's attention, so after
    its cache update)."""
    mlp = model.model.layers[layer].mlp
    real = mlp.forward

    def cut(*args, **kwargs):
        mlp.forward = real
        raise _Cut("the forward stops here")

    mlp.forward = cut


def _kv_of(model, kw, ids, torch):
    """Every layer's K/V of a forward over `ids`, as a DynamicCache holds them
    (a sliding layer's window only: enough for a prompt within the window)."""
    from transformers import DynamicCache

    ref = DynamicCache(config=model.config)
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True, **{kw: ref})
    return [(layer.keys, layer.values) for layer in ref.layers], out, ref


def _cache(model, **kw):
    from activekv.transformers import ActiveKVCache

    return ActiveKVCache(model, max_cache_len=32, batch_size=1, log=quiet, **kw)


def _closed(cache):
    engine = cache.engine
    cache.close()
    gc.collect()
    assert engine._handle is None and not engine._pending_destroy


# ------------------------------------------------------------ 1. lengths after a cut


@pytest.mark.parametrize("hooks", [False, True])
def test_cache_lengths_after_a_decode_cut_short_are_the_last_whole_steps(hooks):
    """A decode forward cut short after layer 1's update: get_seq_length(i)
    said 6, 6, 5 for layers 0, 1, 2 (get_mask_sizes likewise), so the
    cache's length depended on which layer was asked. Now every layer
    reports the last whole step's 5 (as akv_context_length reports the
    minimum over a context's layers) until the step is completed;
    layer_lengths gives each layer's own count and cut_short the error the
    next forward raises."""
    torch, model, kw = _llama()
    cache = _cache(model, hooks=hooks)
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True, **{kw: cache})
        assert cache.cut_short is None
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        _cut_at(model, 1)
        with pytest.raises(_Cut):
            model(input_ids=tok, use_cache=True, **{kw: cache})
        assert [cache.get_seq_length(i) for i in range(3)] == [5, 5, 5]
        assert cache.get_seq_length() == 5
        assert [cache.get_mask_sizes(1, i) for i in range(3)] == [(6, 0)] * 3
        assert cache.layer_lengths == [6, 6, 5]
        assert [layer.get_seq_length() for layer in cache.layers] == [6, 6, 5]
        assert isinstance(cache.cut_short, akv.StepState)
        with pytest.raises(akv.StepState):
            model(input_ids=tok, use_cache=True, **{kw: cache})
        assert [cache.get_seq_length(i) for i in range(3)] == [5, 5, 5]
        # completed with the token's K/V: the step is whole, every layer says 6
        kv, _, _ = _kv_of(model, kw, torch.cat([ids, tok], 1), torch)
        cache.update(kv[2][0][:, :, -1:], kv[2][1][:, :, -1:], 2)
        assert [cache.get_seq_length(i) for i in range(3)] == [6, 6, 6]
        assert cache.cut_short is None
        model(input_ids=tok, use_cache=True, **{kw: cache})
        assert [cache.get_seq_length(i) for i in range(3)] == [7, 7, 7]
    _closed(cache)


def test_cache_lengths_after_a_prefill_cut_short_are_zero_everywhere():
    """A prefill cut short after layer 1: get_seq_length said 5, 5, 0.
    No forward reached every layer, so the cache holds no whole token: 0
    from every layer, and the next forward is refused (UnevenLayers)."""
    torch, model, kw = _llama()
    cache = _cache(model)
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        _cut_at(model, 1)
        with pytest.raises(_Cut):
            model(input_ids=ids, use_cache=True, **{kw: cache})
        assert [cache.get_seq_length(i) for i in range(3)] == [0, 0, 0]
        assert cache.layer_lengths == [5, 5, 0]
        assert isinstance(cache.cut_short, akv.UnevenLayers)
    _closed(cache)


# ------------------------------------------------------------ 4. a hybrid model's cut


@pytest.mark.parametrize("types,cut", [("ssf", 0), ("ssf", 1), ("fss", 0), ("fss", 1),
                                       ("sff", 0), ("fsfs", 2)])
@pytest.mark.parametrize("again", ["prompt", "token"])
def test_hybrid_prefill_cut_short_is_refused_by_name_at_every_layer(types, cut, again):
    """A hybrid model's prefill cut short between its layers, then a forward
    again: the sliding-window layers took the prompt a second time without a
    word (Gemma 3's sliding, sliding, full: layers at 10, 10, 5 rows, and the
    forward 'succeeded'), or a torch shape error came out of the mask, or the
    full layer called it a chunked prefill (NotImplementedError). Every case
    now raises UnevenLayers naming the layers, at the first layer of the
    forward, and changes nothing."""
    torch, model, kw = _gemma3(types)
    cache = _cache(model)
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        _cut_at(model, cut)
        with pytest.raises(_Cut):
            model(input_ids=ids, use_cache=True, **{kw: cache})
        before = cache.layer_lengths
        assert len(set(before)) == 2
        assert len({cache.get_seq_length(i) for i in range(len(types))}) == 1
        with pytest.raises(akv.UnevenLayers) as ei:
            model(input_ids=ids if again == "prompt" else ids[:, :1], use_cache=True,
                  **{kw: cache})
        msg = str(ei.value)
        assert "cut short" in msg and "close()" in msg, msg
        assert cache.layer_lengths == before
    _closed(cache)


def test_hybrid_prefill_cut_short_completed_decodes_as_a_dynamic_cache():
    """The way on the error names works on a hybrid model: the layers the
    prefill did not reach, updated with the same prompt's K/V, make the cache
    whole, and the next token's logits are a DynamicCache's."""
    torch, model, kw = _gemma3("ssf")
    cache = _cache(model)
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        _cut_at(model, 0)
        with pytest.raises(_Cut):
            model(input_ids=ids, use_cache=True, **{kw: cache})
        kv, out, ref = _kv_of(model, kw, ids, torch)
        for layer in (1, 2):
            cache.update(kv[layer][0], kv[layer][1], layer)
        assert cache.cut_short is None and cache.layer_lengths == [3, 3, 3]
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        a = model(input_ids=tok, use_cache=True, **{kw: cache}).logits
        b = model(input_ids=tok, use_cache=True, **{kw: ref}).logits
        assert torch.equal(a, b)
    _closed(cache)


@pytest.mark.parametrize("types,cut", [("sfsf", 0), ("fsfs", 0), ("fsfs", 2), ("sfsf", 2)])
def test_hybrid_decode_cut_short_is_refused_by_name(types, cut):
    """A hybrid model's decode step cut short at a sliding-window layer: the
    full-attention layers' step was whole (or not begun), so the next forward
    went on and the sliding layers before the cut took a second token (one
    row ahead of the rest for good, no error). It is now StepState at the
    first layer, nothing changed, and the lengths are the last whole step's."""
    torch, model, kw = _gemma3(types)
    cache = _cache(model)
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True, **{kw: cache})
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        _cut_at(model, cut)
        with pytest.raises(_Cut):
            model(input_ids=tok, use_cache=True, **{kw: cache})
        before = cache.layer_lengths
        assert [cache.get_seq_length(i) for i in range(4)] == [3] * 4
        with pytest.raises(akv.StepState) as ei:
            model(input_ids=tok, use_cache=True, **{kw: cache})
        assert "cut short" in str(ei.value) and "close()" in str(ei.value)
        assert cache.layer_lengths == before
    _closed(cache)


def test_prompt_again_after_a_forward_cut_short_past_its_last_update_says_it_is_whole():
    """A forward cut short after its last layer's update left every layer
    holding its tokens: the same prompt again is a multi-token update after
    the prompt (NotImplementedError), whose message now says the cache holds
    the prompt and to go on with the next token."""
    torch, model, kw = _gemma3("ssf")
    cache = _cache(model)
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        _cut_at(model, 2)
        with pytest.raises(_Cut):
            model(input_ids=ids, use_cache=True, **{kw: cache})
        with pytest.raises(NotImplementedError, match="holds 3 tokens"):
            model(input_ids=ids, use_cache=True, **{kw: cache})
        model(input_ids=ids[:, -1:], use_cache=True, **{kw: cache})
        assert cache.layer_lengths == [4, 4, 4]
    _closed(cache)


# ------------------------------------------------------------ 2. hooks of a dropped cache


def _hook_count(model):
    return sum(len(m._forward_hooks) for m in model.modules())


def test_hooks_of_a_cache_dropped_without_close_go_with_it():
    """A cache made with hooks=True and dropped without close() left its
    forward hooks on the model (inert, but one set per dropped cache, each
    run on every later forward). They are now removed when the cache is
    freed, by its reference count: nothing in the hooks or the finalizer
    holds the cache."""
    torch, model, kw = _llama()
    assert _hook_count(model) == 0
    enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(3):
            cache = _cache(model, hooks=True)
            assert _hook_count(model) == 3
            with torch.no_grad():
                model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=True, **{kw: cache})
                model(input_ids=torch.tensor([[4]]), use_cache=True, **{kw: cache})
            ref, eng = weakref.ref(cache), weakref.ref(cache.engine)
            del cache
            assert ref() is None and eng() is None  # no cycle: freed at once
            assert _hook_count(model) == 0
    finally:
        if enabled:
            gc.enable()
    # attach / detach / close still leave none behind
    cache = _cache(model)
    cache.attach(model)
    cache.attach(model)
    assert _hook_count(model) == 3
    cache.detach()
    assert _hook_count(model) == 0
    cache.attach(model)
    cache.close()
    assert _hook_count(model) == 0
    del cache
    gc.collect()
    assert _hook_count(model) == 0


# ------------------------------------------------------------ 3. Lease.seal's order


def _sealable(eng):
    ctx = eng.open_context()
    k = np.zeros((3, 2, 2, 8), np.float32)
    ctx.append(k, k)
    eng.step_begin([ctx])
    lease = eng.lease_begin(0)
    lease.wait_ready()
    attn = lease.mark_consumed()
    tail = lease.write_back()
    return ctx, lease, tail, attn


def test_seal_reads_the_fences_before_the_lease_handle():
    """Lease.seal read the lease's handle, then each fence's serial, which a
    Fence subclass (a property) or an object whose __class__ says Fence ran
    the caller's code for: code that retired the lease and closed the engine
    there had seal hand the library the handle of a freed engine's lease.
    The fences are now read first (exact Fence values only; a serial is read
    without the caller's code), the handle after; nothing changes on a
    refusal and the right seal follows."""
    ran = []

    class Sly(akv.Fence):
        @property
        def serial(self):
            ran.append(1)
            return 1

    class Duck:
        __class__ = akv.Fence

        @property
        def serial(self):
            ran.append(2)
            return 1

    with akv.Engine(**small()) as eng:
        ctx, lease, tail, attn = _sealable(eng)
        sly = Sly.__new__(Sly)
        for t, a in ((sly, attn), (tail, sly), (Duck(), attn), (tail, Duck())):
            with pytest.raises(akv.InvalidArgument):
                lease.seal(t, a)
        assert ran == []
        lease.seal(tail, attn)
        lease.retire()
        for layer in (1, 2):
            ls = eng.lease_begin(layer)
            ls.wait_ready()
            a = ls.mark_consumed()
            ls.seal(ls.write_back(), a)
            ls.retire()
        eng.step_end()
        ctx.close()


def test_seal_with_fences_whose_serial_is_not_an_integer():
    """A Fence built with a serial that is not an integer in 0..2**64-1 is
    refused by seal (InvalidArgument), read once (a numpy integer subclass's
    __index__ is not called)."""
    called = []

    class Index(np.int64):
        def __index__(self):
            called.append(1)
            return 1

    with akv.Engine(**small()) as eng:
        ctx, lease, tail, attn = _sealable(eng)
        for bad in (akv.Fence(None), akv.Fence(-1), akv.Fence(2 ** 64), akv.Fence(1.0),
                    akv.Fence("1"), akv.Fence(True), akv.Fence([1])):
            with pytest.raises(akv.InvalidArgument):
                lease.seal(bad, attn)
            with pytest.raises(akv.InvalidArgument):
                lease.seal(tail, bad)
        with pytest.raises(akv.FenceMismatch):
            lease.seal(akv.Fence(Index(tail.serial + 7)), attn)
        assert called == []
        lease.seal(tail, attn)
        lease.retire()
        eng.quarantine()  # ends the step; the engine closes with the block


# ------------------------------------------------------------ the audit: a sliding layer's update


def test_hybrid_sliding_layer_update_refuses_what_its_layer_would_mangle():
    """An update of a hybrid model's sliding-window layer was handed to
    transformers' own layer unchecked: a K or V that is not a tensor failed
    there with AttributeError ('str' object has no attribute 'device'), and
    a 2-D K/V or K and V of other token counts changed the layer before
    torch refused (its count grew: every later forward was then refused as
    cut short). They now raise TypeError / ValueError before the layer
    changes, as the full-attention layers' own update does; the right update
    follows."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers import Gemma3TextConfig

    from activekv.transformers import ActiveKVCache

    cfg = Gemma3TextConfig(vocab_size=32, hidden_size=32, intermediate_size=64,
                           num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=8, sliding_window=4,
                           layer_types=["sliding_attention", "sliding_attention", "full_attention"])
    kv = torch.zeros(1, 2, 3, 8)
    with ActiveKVCache(config=cfg, device="cpu", dtype=torch.float32, max_cache_len=16,
                       page_tokens=4, log=quiet) as cache:
        for layer in (0, 1):
            for args, exc in (((("x", "y")), TypeError), ((kv, None), TypeError),
                              ((torch.zeros(2, 8), torch.zeros(2, 8)), ValueError),
                              ((torch.zeros(()), torch.zeros(())), ValueError),
                              ((kv, torch.zeros(1, 2, 2, 8)), ValueError),
                              ((kv, torch.zeros(2, 2, 3, 8)), ValueError),
                              ((kv, kv.double()), ValueError)):
                with pytest.raises(exc):
                    cache.update(*args, layer)
                assert cache.layer_lengths == [3 if layer else 0, 0, 0]
                assert cache.layers[layer].keys is None or cache.layers[layer].keys.shape[2] == 3
            cache.update(kv, kv, layer)
        cache.update(kv, kv, 2)
        assert cache.layer_lengths == [3, 3, 3] and cache.cut_short is None
