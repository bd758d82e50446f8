"""Forward hooks of two caches on one model: a cache's hook seals its lease
only after its own forward's attention.

Host backend, no GPU needed; the tests skip, with the reason shown, without
torch and transformers.
"""
import pytest

from conftest import tiny_llama as _model, quiet


class _Cut(Exception):
    """What the model raises inside an attention module in these tests."""


def _cut_in_attention(model, layer):
    """Makes `layer`'s attention output projection raise once: after the cache update
    of that layer, before its attention module returns (so before the forward hooks of
    that module run)."""
    proj = model.model.layers[layer].self_attn.o_proj
    real = proj.forward

    def cut(*args, **kwargs):
        proj.forward = real
        raise _Cut("the forward stops inside the attention")

    proj.forward = cut
    return lambda: setattr(proj, "forward", real)


def test_hook_seals_only_after_its_own_caches_attention():
    """Two caches with hooks on one model. A's forward stops inside layer 1's
    attention, after A's update of that layer: A's lease of layer 1 stays pending
    (its attention never finished). A forward of the same model with B then ran
    A's hook of layer 1 too, which sealed A's lease there: a consumed event taken
    on B's forward, not after A's attention (on another thread, A's attention could
    still be reading the staged rows). Now a hook acts only on its own cache's
    forward (the cache the module was handed): B's forward leaves A's lease alone,
    and A still reports its forward cut short."""
    torch, model, kw = _model()
    from activekv.transformers import ActiveKVCache

    import activekv as akv

    a = ActiveKVCache(model, max_cache_len=32, batch_size=1, hooks=True, log=quiet)
    b = ActiveKVCache(model, max_cache_len=32, batch_size=1, hooks=True, log=quiet)
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        model(input_ids=ids, use_cache=True, **{kw: a})  # a prefill takes no leases
        model(input_ids=ids[:, :1], use_cache=True, **{kw: a})
        seals_a = a.stats["hook_seals"]
        assert seals_a == 3  # one per layer of A's own decode: the hooks work
        undo = _cut_in_attention(model, 1)
        with pytest.raises(_Cut):
            model(input_ids=ids[:, :1], use_cache=True, **{kw: a})
        undo()
        cut_seals = a.stats["hook_seals"]
        assert cut_seals == seals_a + 1  # layer 0 of the cut forward, not layer 1
        model(input_ids=ids, use_cache=True, **{kw: b})
        model(input_ids=ids[:, :1], use_cache=True, **{kw: b})
        assert b.stats["hook_seals"] == 3
        assert a.stats["hook_seals"] == cut_seals  # B's forward sealed nothing of A's
        with pytest.raises(akv.StepState) as ei:
            model(input_ids=ids[:, :1], use_cache=True, **{kw: a})
        assert "cut short" in str(ei.value), str(ei.value)
    a.close()
    b.close()


def test_hooks_of_a_cache_handed_positionally_still_seal():
    """A forward whose attention module got no cache keyword (a model that passes
    it positionally) counts as the cache's own, as before: the hooks still seal."""
    from activekv.transformers import _own_forward

    sentinel = object()
    assert _own_forward({}, sentinel)
    assert _own_forward({"cache": sentinel}, sentinel)
    assert _own_forward({"past_key_values": sentinel}, sentinel)
    assert not _own_forward({"past_key_values": object()}, sentinel)

    class Wrapper:
        self_attention_cache = sentinel

    assert _own_forward({"past_key_value": Wrapper()}, sentinel)
    assert not _own_forward({"cache": Wrapper()}, object())


def test_cache_backend_name_in_any_case_as_engine_takes_it():
    """Engine(backend="HOST") is taken (backend names in any case), but
    ActiveKVCache(backend="HOST") was refused as a backend that cannot serve a
    model on cpu. The cache now takes the names as the Engine does; a name of
    another backend is still refused."""
    torch, model, kw = _model()
    from activekv.transformers import ActiveKVCache

    for name in ("host", "HOST", "Host"):
        cache = ActiveKVCache(model, max_cache_len=16, batch_size=1, backend=name, log=quiet)
        assert cache.engine.backend == "host"
        with torch.no_grad():
            model(input_ids=torch.tensor([[1, 2]]), use_cache=True, **{kw: cache})
        cache.close()
    for name in ("cuda", "CUDA", "gpu", 3):
        with pytest.raises(ValueError):
            ActiveKVCache(model, max_cache_len=16, batch_size=1, backend=name, log=quiet)
