"""A fourth outside audit of the Python package: a model's forward cut short
inside an ActiveKVCache, objects whose __init__ never ran, and the promises
of the docstrings around them.

Host backend, no GPU needed; the adapter tests skip, with the reason shown,
without torch and transformers.
"""
import gc

import numpy as np
import pytest

import activekv as akv

from conftest import tiny_llama as _model, quiet, small

# ------------------------------------------------------------ the transformers adapter


class _Cut(Exception):
    """What the model raises between two layers in these tests."""


def _cut_at(model, layer):
    """Makes `layer`'s MLP raise once (after that layer's attention, so after its
    cache update); returns the undo."""
    mlp = model.model.layers[layer].mlp
    real = mlp.forward

    def cut(*args, **kwargs):
        mlp.forward = real
        raise _Cut("the forward stops here")

    mlp.forward = cut
    return lambda: setattr(mlp, "forward", real)


def _kv_of(model, kw, ids, torch):
    """Every layer's K/V of a forward over `ids` (a DynamicCache's)."""
    from transformers import DynamicCache

    ref = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, use_cache=True, **{kw: ref})
    return [(layer.keys, layer.values) for layer in ref.layers]


@pytest.mark.parametrize("hooks", [False, True])
def test_cache_forward_cut_short_between_layers_names_the_state_and_the_way_on(hooks):
    """A decode forward cut short between its layers (an exception in the
    model after layer 1's attention): every later forward and finish() raised
    a bare StepState ("the open step updated 2 of 3 full-attention layers")
    that said neither what happened nor how to go on. It now names the cut,
    the layers that hold the token, the layers still to update and close();
    nothing changes on the refusals, the way on it names works, and close()
    frees the engine."""
    torch, model, kw = _model()
    from activekv.transformers import ActiveKVCache

    cache = ActiveKVCache(model, max_cache_len=32, batch_size=1, hooks=hooks, log=quiet)
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True, **{kw: cache})
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        undo = _cut_at(model, 1)
        with pytest.raises(_Cut):
            model(input_ids=tok, use_cache=True, **{kw: cache})
        undo()
        # each layer's own count shows the cut; the cache's length is the last whole
        # step's, the same for every layer (test_audit_py5)
        assert cache.layer_lengths == [6, 6, 5]
        lengths = [cache.get_seq_length(i) for i in range(3)]
        assert lengths == [5, 5, 5]
        for call in (lambda: model(input_ids=tok, use_cache=True, **{kw: cache}), cache.finish):
            with pytest.raises(akv.StepState) as ei:
                call()
            msg = str(ei.value)
            assert "cut short" in msg and "layers 0..1" in msg and "layers 2..2" in msg, msg
            assert "close()" in msg, msg
            assert [cache.get_seq_length(i) for i in range(3)] == lengths
        # the way on it names: the remaining layer updated with that token's K/V
        kv = _kv_of(model, kw, torch.cat([ids, tok], 1), torch)
        cache.update(kv[2][0][:, :, -1:], kv[2][1][:, :, -1:], 2)
        cache.finish()
        assert [c.length for c in cache.contexts] == [6]
        k, _ = cache.contexts[0].read(2, 5, 1)
        assert np.array_equal(k[0], kv[2][0][0, :, -1].numpy())
        model(input_ids=tok, use_cache=True, **{kw: cache})  # the next forward goes on
    engine = cache.engine
    cache.close()
    gc.collect()
    assert engine._handle is None and not engine._pending_destroy


def test_cache_prefill_cut_short_between_layers_is_not_called_a_chunked_prefill():
    """A prefill forward cut short between its layers, then the same prompt
    again: the first layer, which holds the prompt, refused it with
    NotImplementedError "chunked prefill ... not supported", which the
    caller never asked for and which said nothing of the layers left
    without the prompt. It is now UnevenLayers naming the cut, the layers
    that hold the prompt and those that do not, and close(); the way on it
    names (the remaining layers updated with the same prompt's K/V) works."""
    torch, model, kw = _model()
    from activekv.transformers import ActiveKVCache

    cache = ActiveKVCache(model, max_cache_len=32, batch_size=1, log=quiet)
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        undo = _cut_at(model, 1)
        with pytest.raises(_Cut):
            model(input_ids=ids, use_cache=True, **{kw: cache})
        undo()
        assert cache.layer_lengths == [5, 5, 0]
        assert [cache.get_seq_length(i) for i in range(3)] == [0, 0, 0]
        for call in (lambda: model(input_ids=ids, use_cache=True, **{kw: cache}),
                     lambda: model(input_ids=ids[:, :1], use_cache=True, **{kw: cache})):
            with pytest.raises(akv.UnevenLayers) as ei:
                call()
            msg = str(ei.value)
            assert "cut short" in msg and "[0, 1]" in msg and "[2]" in msg, msg
            assert "close()" in msg, msg
            assert cache.layer_lengths == [5, 5, 0]
        kv = _kv_of(model, kw, ids, torch)
        cache.update(kv[2][0], kv[2][1], 2)
        out = model(input_ids=ids[:, -1:], use_cache=True, **{kw: cache})
        assert [cache.get_seq_length(i) for i in range(3)] == [6, 6, 6]
    engine = cache.engine
    cache.close()
    gc.collect()
    assert engine._handle is None and not engine._pending_destroy


# ------------------------------------------------------------ an Engine never made


class _SkipsInit(akv.Engine):
    def __init__(self):  # never calls Engine.__init__
        pass


def _never_made(kind):
    if kind == "new":
        return akv.Engine.__new__(akv.Engine)
    if kind == "subclass":
        return _SkipsInit()
    eng = akv.Engine.__new__(akv.Engine)
    with pytest.raises(akv.InvalidArgument):
        eng.__init__(**small(no_such_field=1))  # stops before the engine is made
    return eng


@pytest.mark.parametrize("kind", ["new", "subclass", "failed"])
def test_engine_never_made_raises_bad_handle_not_attribute_error(kind, monkeypatch):
    """An Engine whose __init__ never ran (Engine.__new__, a subclass that
    skips it) failed every call and property with AttributeError from inside
    the package ('Engine' object has no attribute '_forks'), its repr too,
    and so did the Context made around it: the promise of the module
    docstring is BadHandle for an engine that is not open. Now every call
    and property raises BadHandle, repr says so, and dropping it is quiet."""
    unraisable = []
    monkeypatch.setattr("sys.unraisablehook", unraisable.append)
    eng = _never_made(kind)
    calls = [eng.close, eng.info, eng.headroom, eng.quarantine, eng.open_context,
             eng.stream_create, eng.default_stream, eng.admission_counters, eng.admission_log,
             eng.explain, lambda: eng.step_begin([]), eng.step_end, lambda: eng.lease_begin(0),
             lambda: eng.headroom_release(0), lambda: eng.headroom_take(0),
             lambda: eng.last_error, lambda: eng.live_arrays, lambda: eng.backend,
             lambda: eng.dtype, lambda: eng.config,
             lambda: akv.Context(eng, None).close(), lambda: akv.Context(eng, None).length,
             lambda: akv.Stream(eng, None).synchronize(),
             lambda: akv.Lease(eng, None).retire()]
    if kind == "failed":
        # made as far as a closed engine: close() and a closed context's close()
        # are no-ops there, and no array lives
        calls = [c for i, c in enumerate(calls) if i not in (0, 16, 20)]
        assert eng.live_arrays == 0
        eng.close()
        akv.Context(eng, None).close()
    for call in calls:
        with pytest.raises(akv.BadHandle):
            call()
    assert "activekv.Engine" in repr(eng)
    with pytest.raises(AttributeError):
        eng.no_such_attribute  # other names are still plain AttributeError
    del eng, calls
    gc.collect()
    assert unraisable == []
