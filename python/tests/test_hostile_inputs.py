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

from conftest import held_by_another_thread, quiet, small

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


def test_torch_tensor_subclasses_are_tensors():
    """A torch.Tensor subclass defined outside torch went through np.asarray:
    bf16 ones (no numpy type) and ones requiring grad were refused, while
    plain tensors of the same data are rows."""
    torch = pytest.importorskip("torch")

    class Mine(torch.Tensor):
        pass

    g = torch.Generator().manual_seed(3)
    k = torch.randn(2, H, D, generator=g)
    with akv.Engine(**small(dtype="bf16")) as eng, eng.open_context() as ctx:
        kb = k.to(torch.bfloat16)
        ctx.append_layer(0, kb.as_subclass(Mine), kb.as_subclass(Mine))
        assert np.array_equal(ctx.read(0, 0, 2)[0], kb.view(torch.int16).numpy().view(np.uint16))
    with akv.Engine(**small()) as eng, eng.open_context() as ctx:
        sub = k.clone().requires_grad_(True).as_subclass(Mine)
        ctx.append_layer(0, sub, sub)
        assert np.array_equal(ctx.read(0, 0, 2)[1], k.numpy())
        with pytest.raises(akv.InvalidArgument):
            ctx.append_layer(1, k.half().as_subclass(Mine), k)  # checked as a tensor


# ------------------------------------------------------------------ views


def test_view_geometry_cannot_be_changed_under_its_arrays(engine):
    """keys/values/kv_tensors build arrays over the staging buffer from the
    view's base, lengths and strides: a view with len[0] raised, or base or
    n_contexts changed, handed out arrays over memory that is not the
    engine's, and reading them crashed the interpreter."""
    rng = np.random.default_rng(4)
    ctx = engine.open_context()
    k, v = rows(rng, 3), rows(rng, 3)
    ctx.append(k, v)
    with engine.step([ctx]):
        for layer in range(L):
            lease = engine.lease_begin(layer)
            view = lease.wait_ready()
            for name, value in (("len", [1 << 26]), ("base", 4096), ("n_contexts", 5000),
                                ("row_stride", 1 << 30), ("context_stride", 1 << 30),
                                ("v_offset", 1 << 30), ("kv_heads", 64), ("head_dim", 1 << 20),
                                ("dtype", "f16"), ("page_tokens", 0), ("page_map", None)):
                with pytest.raises(AttributeError):
                    setattr(view, name, value)
            view.len[0] = 1 << 26  # a new list each time: the view keeps its own
            with pytest.raises(AttributeError):
                del view.base
            assert view.len[0] == 3 and view.n_contexts == 1
            assert np.array_equal(view.keys(0)[:3], k[layer])
            assert np.array_equal(view.values(0)[:3], v[layer])
            attn = lease.mark_consumed()
            lease.seal(lease.write_back(), attn)
            lease.retire()


def test_view_keys_of_none_raises_invalid_argument(engine):
    """None meant "every context" inside the view's check and then failed in
    int(): TypeError instead of the documented InvalidArgument."""
    rng = np.random.default_rng(5)
    ctx = engine.open_context()
    ctx.append(rows(rng, 2), rows(rng, 2))
    with engine.step([ctx]):
        for layer in range(L):
            lease = engine.lease_begin(layer)
            view = lease.wait_ready()
            for bad in (None, 1, -1, 0.0, True, np.uint64(1)):  # one context: index 0 only
                with pytest.raises(akv.InvalidArgument):
                    view.keys(bad)
                with pytest.raises(akv.InvalidArgument):
                    view.values(bad)
            attn = lease.mark_consumed()
            lease.seal(lease.write_back(), attn)
            lease.retire()


# ------------------------------------------------------------------ the transformers adapter


def _cache(batch_size=1, **kw):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers import LlamaConfig

    from activekv.transformers import ActiveKVCache

    cfg = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    kw = dict(dict(config=cfg, device="cpu", dtype=torch.float32, max_cache_len=8,
                   page_tokens=4, log=quiet), **kw)
    return torch, ActiveKVCache(batch_size=batch_size, **kw)


def _kv(torch, b, t, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, H, t, D, generator=g), torch.randn(b, H, t, D, generator=g)


def _prefill(cache, torch, b=1, t=3):
    for layer in range(2):
        cache.update(*_kv(torch, b, t, seed=layer), layer)


@pytest.mark.parametrize("value", [1.5, True, "1", 1.0, -1])
def test_cache_host_pool_gib_that_is_not_an_integer_is_refused_not_truncated(value):
    with pytest.raises((TypeError, ValueError)):
        _cache(host_pool_gib=value)


def test_cache_numpy_integer_sizes_are_integers():
    torch, cache = _cache(max_cache_len=np.int64(8), batch_size=np.uint32(1),
                          host_pool_gib=np.int32(1), page_tokens=np.int16(4))
    with cache:
        assert cache.engine.config["max_tokens"] == 8
        assert cache.engine.config["host_pool_gib"] == 1


def test_cache_get_max_length_is_the_capacity():
    torch, cache = _cache(max_cache_len=8)
    with cache:
        assert cache.get_max_length() == 8
        assert cache.get_max_length(1) == 8
        assert cache.layers[0].get_max_length() == 8


@pytest.mark.parametrize("layer_idx", [-1, -2, True, False, np.bool_(True)])
def test_cache_update_with_a_negative_or_bool_layer_index_is_refused(layer_idx):
    """Python's list indexing would take -1 as the last layer and True as
    layer 1: K/V of one layer stored as another's."""
    torch, cache = _cache()
    with cache:
        with pytest.raises((IndexError, TypeError)):
            cache.update(*_kv(torch, 1, 3), layer_idx)
        assert [cache.get_seq_length(i) for i in range(2)] == [0, 0]
        assert cache.contexts == []
        _prefill(cache, torch)
        with pytest.raises((IndexError, TypeError)):
            cache.update(*_kv(torch, 1, 1), layer_idx)
        assert [cache.get_seq_length(i) for i in range(2)] == [3, 3]


def test_cache_update_with_a_numpy_layer_index():
    torch, cache = _cache()
    with cache:
        for layer in range(2):
            cache.update(*_kv(torch, 1, 3, seed=layer), np.int64(layer))
        for layer in range(2):
            cache.update(*_kv(torch, 1, 1, seed=5 + layer), np.uint8(layer))
        assert cache.get_seq_length() == 4


def test_cache_decode_with_tensors_requiring_grad_is_refused_and_changes_nothing():
    """Outside torch.no_grad(), K/V of a model that requires grad: writing them
    into the staging buffer in place failed half way (K written, V not, the
    layer's length not counted) and left autograd history on the buffer."""
    torch, cache = _cache(batch_size=2)
    _, ref = _cache(batch_size=2)
    with cache, ref:
        _prefill(cache, torch, b=2)
        _prefill(ref, torch, b=2)
        k, v = _kv(torch, 2, 1, seed=9)
        with pytest.raises(ValueError, match="grad"):
            cache.update(k.requires_grad_(True), v, 0)
        with pytest.raises(ValueError, match="grad"):
            cache.update(k, v.requires_grad_(True) * 1, 0)
        assert [cache.get_seq_length(i) for i in range(2)] == [3, 3]
        for layer in range(2):  # under no_grad the same tensors are fine
            with torch.no_grad():
                a = cache.update(*_kv(torch, 2, 1, seed=10 + layer), layer)
            b = ref.update(*_kv(torch, 2, 1, seed=10 + layer), layer)
            assert not a[0].requires_grad
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        cache.finish()
        ref.finish()
        for i in range(2):
            for layer in range(2):
                got, want = cache.contexts[i].read(layer, 0, 4), ref.contexts[i].read(layer, 0, 4)
                assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])


@pytest.mark.parametrize("first,then", [("inference", "no_grad"), ("no_grad", "inference"),
                                        ("inference", "plain")])
def test_cache_decode_steps_under_different_grad_modes(first, then):
    """The staging buffer's tensors were made under the first step's mode: made
    in inference mode, a later step outside it failed half way through its
    first update (an inference tensor cannot be written outside it)."""
    torch, cache = _cache()
    _, ref = _cache()
    modes = {"inference": torch.inference_mode, "no_grad": torch.no_grad,
             "plain": torch.enable_grad}
    with cache, ref:
        _prefill(cache, torch)
        _prefill(ref, torch)
        for step, mode in enumerate((first, then, first, then)):
            for layer in range(2):
                kv = _kv(torch, 1, 1, seed=20 + 2 * step + layer)
                with modes[mode]():
                    a = cache.update(*kv, layer)
                    b = ref.update(*kv, layer)
                    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        assert cache.get_seq_length() == 7


def test_cache_prefill_of_another_length_than_the_other_layers_is_refused():
    """A layer's prefill of another token count than the layers already
    prefilled (or a decode row at a layer the prefill skipped) was appended:
    the layers then held different lengths for good (UnevenLayers at every
    step, with no way back). Refused before anything changes."""
    torch, cache = _cache()
    _, ref = _cache()
    with cache, ref:
        cache.update(*_kv(torch, 1, 3, seed=0), 0)
        for bad in (_kv(torch, 1, 5, seed=1), _kv(torch, 1, 1, seed=1)):
            with pytest.raises(ValueError, match="prefill"):
                cache.update(*bad, 1)
            assert cache.layer_lengths == [3, 0]  # each layer's own count: unchanged
            assert [cache.get_seq_length(i) for i in range(2)] == [0, 0]  # no whole forward
            with pytest.raises(akv.InvalidArgument):
                cache.contexts[0].read(1, 0, 1)  # layer 1 holds nothing
        cache.update(*_kv(torch, 1, 3, seed=1), 1)
        _prefill(ref, torch)
        for layer in range(2):
            a = cache.update(*_kv(torch, 1, 1, seed=7 + layer), layer)
            b = ref.update(*_kv(torch, 1, 1, seed=7 + layer), layer)
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        assert cache.get_seq_length() == 4


def _hybrid_cache(batch_size=1, max_cache_len=16,
                  types=("sliding_attention", "sliding_attention", "full_attention")):
    """Gemma 3 layers: sliding, sliding, full attention (by default)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers import Gemma3TextConfig

    from activekv.transformers import ActiveKVCache

    cfg = Gemma3TextConfig(vocab_size=32, hidden_size=32, intermediate_size=64,
                           num_hidden_layers=len(types), num_attention_heads=4,
                           num_key_value_heads=2, head_dim=8, sliding_window=4,
                           layer_types=list(types))
    return torch, ActiveKVCache(config=cfg, device="cpu", dtype=torch.float32,
                                max_cache_len=max_cache_len, batch_size=batch_size,
                                page_tokens=4, log=quiet)


def _forward(cache, torch, b, t, seed):
    for layer in range(3):
        cache.update(*_kv(torch, b, t, seed=seed + layer), layer)


def _sliding(cache):
    return [(layer.keys.clone(), layer.values.clone(), layer.get_seq_length())
            for layer in cache.layers[:2]]


def _same(a, b):
    return all(torch_equal(x[0], y[0]) and torch_equal(x[1], y[1]) and x[2] == y[2]
               for x, y in zip(a, b))


def torch_equal(a, b):
    import torch

    return a.shape == b.shape and torch.equal(a, b)


def test_hybrid_cache_forward_the_full_layers_refuse_changes_no_sliding_layer():
    """transformers updates the layers of a forward in order: on a hybrid model
    the sliding-window layers before the first full-attention one took a
    multi-token update, a batch of another size or a row past max_cache_len
    before the full-attention layer refused it, so the sliding layers were a
    step ahead of the rest."""
    torch, cache = _hybrid_cache(batch_size=2, max_cache_len=5)
    with cache:
        _forward(cache, torch, 2, 3, seed=0)
        _forward(cache, torch, 2, 1, seed=10)
        before = _sliding(cache)
        for b, t, exc in ((2, 2, NotImplementedError), (3, 1, ValueError), (1, 1, ValueError)):
            with pytest.raises(exc):
                cache.update(*_kv(torch, b, t, seed=20), 0)
            assert _same(before, _sliding(cache))
        _forward(cache, torch, 2, 1, seed=30)  # the fifth and last row
        before = _sliding(cache)
        with pytest.raises(ValueError, match="max_cache_len"):
            cache.update(*_kv(torch, 2, 1, seed=40), 0)
        assert _same(before, _sliding(cache))
        assert [cache.get_seq_length(i) for i in range(3)] == [5, 5, 5]


def test_hybrid_cache_prefill_the_full_layers_refuse_changes_no_sliding_layer():
    torch, cache = _hybrid_cache(max_cache_len=5)
    with cache:
        for k, v, exc in (_kv(torch, 1, 6) + (ValueError,),  # past max_cache_len
                          (_kv(torch, 1, 3)[0].double(), _kv(torch, 1, 3)[1].double(),
                           ValueError)):
            with pytest.raises(exc):
                cache.update(k, v, 0)
            assert cache.layers[0].get_seq_length() == 0 and cache.layers[0].keys is None
        _forward(cache, torch, 1, 3, seed=0)
        assert [cache.get_seq_length(i) for i in range(3)] == [3, 3, 3]


def test_hybrid_cache_decode_requiring_grad_changes_no_sliding_layer():
    """A model's decode forward with grad mode on: the full-attention layer
    refused K/V that require grad, after the sliding layers before it had
    taken theirs (they then ran a token ahead for good)."""
    torch, cache = _hybrid_cache()
    with cache:
        _forward(cache, torch, 1, 3, seed=0)
        before = _sliding(cache)
        k, v = _kv(torch, 1, 1, seed=5)
        with pytest.raises(ValueError, match="grad"):
            cache.update(k.requires_grad_(True), v, 0)
        assert _same(before, _sliding(cache))
        with torch.no_grad():
            _forward(cache, torch, 1, 1, seed=6)
        assert [cache.get_seq_length(i) for i in range(3)] == [4, 4, 4]


def test_hybrid_cache_forward_after_an_interrupted_one_changes_no_sliding_layer():
    """A forward after one interrupted between layers (StepState at the first
    full-attention layer), or after a prefill that skipped a full-attention
    layer (UnevenLayers there): the sliding layer before it had taken the
    token first."""
    types = ("sliding_attention", "full_attention", "sliding_attention", "full_attention")
    torch, cache = _hybrid_cache(types=types)
    with cache:
        for layer in range(4):
            cache.update(*_kv(torch, 1, 3, seed=layer), layer)
        for layer in range(2):  # the forward stops after layer 1
            cache.update(*_kv(torch, 1, 1, seed=10 + layer), layer)
        before = cache.layers[0].keys.clone()
        with pytest.raises(akv.StepState):
            cache.update(*_kv(torch, 1, 1, seed=20), 0)
        assert torch.equal(before, cache.layers[0].keys)
        for layer in (2, 3):  # completing the step recovers
            cache.update(*_kv(torch, 1, 1, seed=10 + layer), layer)
        for layer in range(4):
            cache.update(*_kv(torch, 1, 1, seed=30 + layer), layer)
        assert [cache.get_seq_length(i) for i in range(4)] == [5, 5, 5, 5]
    torch, cache = _hybrid_cache(types=types)
    with cache:
        for layer in range(3):  # the prefill stops before layer 3
            cache.update(*_kv(torch, 1, 3, seed=layer), layer)
        before = cache.layers[0].keys.clone()
        with pytest.raises(akv.UnevenLayers):
            cache.update(*_kv(torch, 1, 1, seed=20), 0)
        assert torch.equal(before, cache.layers[0].keys)


def test_hybrid_cache_early_initialization_refused_initializes_no_layer():
    """transformers' Cache.early_initialization initialises the layers in order:
    on a hybrid model the sliding-window layers before the full-attention one
    were initialised before it refused a batch larger than batch_size (or
    heads, head_dim or a dtype other than the model's), leaving the cache half
    initialised."""
    torch, cache = _hybrid_cache(batch_size=2)
    with cache:
        cpu = torch.device("cpu")
        for args in ((3, 2, 8, torch.float32, cpu),        # batch beyond batch_size
                     (2, 3, 8, torch.float32, cpu),        # kv heads
                     (2, 2, 16, torch.float32, cpu),       # head_dim
                     (2, 2, 8, torch.float64, cpu),        # dtype
                     (2, [2, 2], 8, torch.float32, cpu)):  # not one entry per layer
            with pytest.raises(ValueError):
                cache.early_initialization(*args)
            assert [layer.is_initialized for layer in cache.layers] == [False] * 3
            assert cache.contexts == []
        cache.early_initialization(2, [2, 2, 2], 8, torch.float32, cpu)
        assert [layer.is_initialized for layer in cache.layers] == [True] * 3
        assert len(cache.contexts) == 2
        contexts = cache.contexts
        cache.early_initialization(1, 2, 8, torch.float32, cpu)  # initialised: a no-op
        assert cache.contexts == contexts
        _forward(cache, torch, 2, 3, seed=0)
        _forward(cache, torch, 2, 1, seed=3)
        assert [cache.get_seq_length(i) for i in range(3)] == [4, 4, 4]


def test_hybrid_cache_after_close_refuses_sliding_layers_too():
    torch, cache = _hybrid_cache()
    _forward(cache, torch, 1, 3, seed=0)
    cache.close()
    before = _sliding(cache)
    with pytest.raises(akv.BadHandle):
        cache.update(*_kv(torch, 1, 1, seed=5), 0)
    assert _same(before, _sliding(cache))


def _append_interrupted_at(n):
    """Context.append_layer that raises KeyboardInterrupt at its n-th call (1-based)
    and appends as usual otherwise."""
    real = akv.Context.append_layer
    calls = []

    def flaky(self, layer, k, v):
        calls.append(layer)
        if len(calls) == n:
            raise KeyboardInterrupt
        return real(self, layer, k, v)

    return flaky


def test_cache_prefill_failing_between_rows_is_not_appended_twice(monkeypatch):
    """A prefill appends a layer's rows row by row (one context each): one that
    failed after the first row's append left that context a layer ahead, and
    the same prefill again appended its rows a second time."""
    torch, cache = _cache(batch_size=2)
    flaky = _append_interrupted_at(2)  # e.g. Ctrl-C between the two rows
    with cache:
        monkeypatch.setattr(akv.Context, "append_layer", flaky)
        with pytest.raises(KeyboardInterrupt):
            cache.update(*_kv(torch, 2, 3), 0)
        with pytest.raises(akv.ActiveKVError):  # not taken a second time
            cache.update(*_kv(torch, 2, 3), 0)
        assert [c.length for c in cache.contexts] == [0, 0]
        assert cache.contexts[1].read(0, 0, 0)[0].shape == (0, H, D)
        with pytest.raises(akv.InvalidArgument):
            cache.contexts[0].read(0, 3, 1)  # context 0's layer 0 holds 3 rows, not 6


def test_cache_prefill_failing_at_the_first_row_changes_nothing(monkeypatch):
    torch, cache = _cache(batch_size=2)
    flaky = _append_interrupted_at(1)
    with cache:
        monkeypatch.setattr(akv.Context, "append_layer", flaky)
        with pytest.raises(KeyboardInterrupt):
            cache.update(*_kv(torch, 2, 3), 0)
        _prefill(cache, torch, b=2)  # nothing was appended: the prefill may run again
        assert [c.length for c in cache.contexts] == [3, 3]


def test_cache_decode_interrupted_inside_an_update_leaves_the_cache_unusable(monkeypatch):
    """An interrupt (Ctrl-C) inside an update after the layer's lease began, before
    its row was written and counted: the next layer's update sealed the lease
    and wrote back whatever the staging row held, and the layer's length
    stayed one short. The cache now refuses further use (Quarantined) and
    close() frees the engine."""
    torch, cache = _cache()  # skipped without torch and transformers
    import activekv.transformers as akt

    _prefill(cache, torch)

    def interrupted(self, view, key):
        raise KeyboardInterrupt

    monkeypatch.setattr(akt._Driver, "_views", interrupted)
    with pytest.raises(KeyboardInterrupt):
        cache.update(*_kv(torch, 1, 1, seed=3), 0)
    monkeypatch.undo()
    with pytest.raises(akv.Quarantined):
        cache.update(*_kv(torch, 1, 1, seed=4), 1)
    engine = cache.engine
    cache.close()
    assert engine._handle is None and not engine._pending_destroy


def test_hybrid_cache_update_of_a_sliding_layer_from_a_second_thread_is_busy():
    """One thread at a time (Busy) held for the full-attention layers only: a
    second thread's update of a sliding-window layer ran alongside the first
    thread's call and changed that layer."""
    torch, cache = _hybrid_cache()
    with cache:
        _forward(cache, torch, 1, 3, seed=0)
        before = _sliding(cache)
        with held_by_another_thread(cache.engine):
            for layer in range(3):
                with pytest.raises(akv.Busy):
                    cache.update(*_kv(torch, 1, 1, seed=9), layer)
        assert _same(before, _sliding(cache))
        _forward(cache, torch, 1, 1, seed=10)
        assert [cache.get_seq_length(i) for i in range(3)] == [4, 4, 4]


def test_cache_finish_and_close_from_a_second_thread_are_busy_and_change_nothing():
    """finish() and close() sealed and retired the step's leases through the
    library's lease calls before the engine's own call refused the second
    thread: they ran alongside the first thread's call, and the refused call
    had changed the step."""
    torch, cache = _cache(batch_size=2)
    _prefill(cache, torch, b=2)
    for layer in range(2):
        cache.update(*_kv(torch, 2, 1, seed=3 + layer), layer)
    stats = cache.stats
    with held_by_another_thread(cache.engine):
        for call in (cache.finish, cache.close):
            with pytest.raises(akv.Busy):
                call()
            assert cache.stats == stats and cache._driver.pending is not None
    assert cache.engine is not None
    for layer in range(2):  # the cache goes on
        cache.update(*_kv(torch, 2, 1, seed=7 + layer), layer)
    cache.finish()
    assert [c.length for c in cache.contexts] == [5, 5]
    cache.close()
    assert cache.engine is None


def test_cache_forward_hook_on_another_thread_leaves_the_lease_to_the_next_update():
    """The forward hooks seal through the library's lease calls: a hook firing
    on one thread (the same model run there with another cache) while the
    cache's own thread was in a call raced it inside the library. It now
    leaves the lease to the next update's seal."""
    torch, cache = _cache()
    _, ref = _cache()
    with cache, ref:
        _prefill(cache, torch)
        _prefill(ref, torch)
        a = cache.update(*_kv(torch, 1, 1, seed=3), 0)
        with held_by_another_thread(cache.engine):
            pending = cache._driver.pending
            cache._driver.after_attention(0)  # what the hook of layer 0 calls
            assert cache._driver.pending == pending and cache.stats["hook_seals"] == 0
        b = ref.update(*_kv(torch, 1, 1, seed=3), 0)
        assert torch.equal(a[0], b[0])
        for c in (cache, ref):
            c.update(*_kv(torch, 1, 1, seed=4), 1)
            c.finish()
        assert cache.stats["fallback_seals"] == 2
        assert np.array_equal(cache.contexts[0].read(0, 0, 4)[0], ref.contexts[0].read(0, 0, 4)[0])
