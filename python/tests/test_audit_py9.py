"""A ninth audit of the Python package, as an outside adversarial test
writer would make it: an ActiveKVCache asked for a CUDA device on a machine
without one, what a forked child reads of an engine's repr, the lengths an
ActiveKVCache gives for a layer counted from the end, and hostile inputs the
earlier audits did not try.

Host backend, no GPU needed; the adapter tests skip, with the reason shown,
without torch and transformers.
"""
import gc
import inspect
import os
import signal
import threading
import time

import numpy as np
import pytest

import activekv as akv

from conftest import quiet, small

L, H, D = 3, 2, 8


# ------------------------------------------------------------ helpers


def _in_forked_child(body, timeout=20.0):
    """Runs body() in a forked child; returns (exit code, what it wrote to
    the pipe it is given). The exit code is None when it hung past
    `timeout` (the child is killed then)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            os.close(r)
            code = body(w)
        finally:
            os._exit(code)
    os.close(w)
    deadline = time.monotonic() + timeout
    code = None
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            code = os.waitstatus_to_exitcode(status)
            break
        time.sleep(0.05)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    with os.fdopen(r, "rb") as f:
        out = f.read().decode()
    return code, out


def _llama(layers=3):
    """A tiny Llama (float32, SDPA) and the name of its cache argument."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=8, max_position_embeddings=128)
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg).to(torch.float32).eval()
    params = inspect.signature(model.forward).parameters
    return torch, model, "cache" if "cache" in params else "past_key_values"


class _Cut(Exception):
    """What the model raises between two layers in these tests."""


def _cut_at(model, layer):
    """Makes `layer`'s MLP raise once (after that layer's cache update)."""
    mlp = model.model.layers[layer].mlp
    real = mlp.forward

    def cut(*args, **kwargs):
        mlp.forward = real
        raise _Cut("the forward stops here")

    mlp.forward = cut


# ------------------------------------------------------------ 1. "cuda" without CUDA


def test_cache_for_cuda_without_cuda_is_not_supported_whichever_way_the_device_is_named():
    """ActiveKVCache(device="cuda:0") on a machine without CUDA reaches the
    engine, which refuses a CUDA backend it cannot serve with NotSupported;
    device="cuda" (and torch.device("cuda")) asked torch for its current
    device first and raised torch's own RuntimeError ("Found no NVIDIA
    driver", or "Torch not compiled with CUDA enabled"). Every spelling of
    a CUDA device now raises the same NotSupported."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the refusal is for machines without it")
    from transformers import LlamaConfig

    from activekv.transformers import ActiveKVCache

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    errors = {}
    for device in ("cuda", "cuda:0", torch.device("cuda"), torch.device("cuda", 0)):
        with pytest.raises(akv.NotSupported) as info:
            ActiveKVCache(config=cfg, device=device, dtype=torch.float32, max_cache_len=16,
                          log=quiet)
        errors[str(device)] = str(info.value)
    assert len(set(errors.values())) == 1, errors
    gc.collect()


# ------------------------------------------------------------ 2. repr in a forked child


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork here")
def test_engine_repr_in_a_forked_child_says_it_is_unusable_there():
    """In a child forked after the engine was made, every call on it raises
    BadHandle (docs/python.md), but repr(engine) there read as an open
    engine ("<activekv.Engine host stage f32>"). It now says the engine is
    the parent's and unusable in the child, and so does a context's repr
    (which said nothing); neither raises, and the parent's reprs are
    unchanged."""
    eng = akv.Engine(**small())
    ctx = eng.open_context()
    parent = (repr(eng), repr(ctx))
    assert parent == ("<activekv.Engine host stage f32>",
                      f"<activekv.Context id={ctx.id} length=0>")

    def child(w):
        out = "\n".join((repr(eng), repr(ctx)))
        try:
            eng.info()
            return 2  # reached the library
        except akv.BadHandle:
            pass
        os.write(w, out.encode())
        return 0

    code, out = _in_forked_child(child)
    assert code == 0, out
    e_repr, c_repr = out.split("\n")
    pid = os.getpid()
    for text, what in ((e_repr, "Engine"), (c_repr, "Context")):
        assert text.startswith(f"<activekv.{what} "), text
        assert str(pid) in text and "fork" in text and "BadHandle" in text, text
        assert "host stage" not in text and "closed" not in text, text
    assert (repr(eng), repr(ctx)) == parent
    ctx.close()
    eng.close()
    assert repr(eng) == "<activekv.Engine closed>"


def test_engine_repr_from_another_thread_during_a_call_never_raises():
    """repr(engine) is read as a call on the engine, as a context's is: while
    another thread is in a call it says nothing of the state (a close in
    flight there clears the handle for its call), and it never raises."""
    from conftest import held_by_another_thread

    eng = akv.Engine(**small())
    with held_by_another_thread(eng):
        assert repr(eng) == "<activekv.Engine>"
    assert repr(eng) == "<activekv.Engine host stage f32>"
    eng.close()


# ------------------------------------------------------------ 3. a layer from the end


def test_cache_length_of_a_layer_counted_from_the_end_is_the_whole_length():
    """After a forward cut short between its layers, cache.get_seq_length(i)
    is the tokens every layer holds, "the same for every i"
    (docs/python.md); a negative i, which transformers' list takes from the
    end, gave that layer's own count instead (6 for layer -3 while every
    other index said 5). It is the whole length now, as for the same layer
    counted from the start."""
    torch, model, kw = _llama()
    from activekv.transformers import ActiveKVCache

    cache = ActiveKVCache(model, max_cache_len=32, batch_size=1, log=quiet)
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True, **{kw: cache})
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        _cut_at(model, 0)
        with pytest.raises(_Cut):
            model(input_ids=tok, use_cache=True, **{kw: cache})
    assert cache.layer_lengths == [6, 5, 5]
    assert [cache.get_seq_length(i) for i in range(-3, 3)] == [5] * 6
    assert cache.get_seq_length(3) == 0  # past the layers: transformers' answer
    assert [cache.get_mask_sizes(1, i) for i in range(-3, 3)] == [(6, 0)] * 6
    cache.close()


# ------------------------------------------------------------ 4. ctypes memory moved


@pytest.mark.parametrize("how", ["asarray", "frombuffer", "ctypeslib"])
@pytest.mark.parametrize("call", ["append", "append_layer"])
def test_ctypes_rows_reallocated_while_the_call_converts_v_are_refused(engine, how, call):
    """Rows may be "any buffer" (docs/python.md), a ctypes array included.
    K converted first, then V's __array__ (the caller's code) ran
    ctypes.resize on the ctypes array under K, which reallocates its memory
    whatever views it (ctypes keeps no count of its exports, unlike
    bytearray, array or mmap): the library copied the freed block into the
    context (0xff junk came back as NaN rows). Such an array is refused
    (InvalidArgument), as a numpy array resized there is, and nothing is
    appended; an untouched ctypes array is taken."""
    import ctypes

    ctx = engine.open_context()
    shape = (L, 4, H, D) if call == "append" else (4, H, D)
    n = int(np.prod(shape))

    def rows(ct):
        a = {"asarray": lambda: np.asarray(ct),
             "frombuffer": lambda: np.frombuffer(ct, np.float32),
             "ctypeslib": lambda: np.ctypeslib.as_array(ct)}[how]()
        return a.reshape(shape)

    def do(k, v):
        if call == "append":
            ctx.append(k, v)
        else:
            ctx.append_layer(0, k, v)

    good = (ctypes.c_float * n)(*range(n))
    do(rows(good), np.zeros(shape, np.float32))  # taken as it is
    before = ctx.read(0, 0, 4)
    assert np.array_equal(before[0].ravel(), np.arange(4 * H * D, dtype=np.float32))

    victim = (ctypes.c_float * n)(*([1.0] * n))
    addr = ctypes.addressof(victim)
    junk = []

    class MovingV:
        def __array__(self, dtype=None, copy=None):
            ctypes.resize(victim, ctypes.sizeof(victim) * 64)  # realloc: moved, old freed
            junk.extend(bytearray(b"\xff" * (n * 4)) for _ in range(64))
            return np.zeros(shape, np.float32)

    with pytest.raises(akv.InvalidArgument, match="resized"):
        do(rows(victim), MovingV())
    assert ctypes.addressof(victim) != addr  # the memory did move
    if call == "append":
        assert len(ctx) == 4
    with pytest.raises(akv.InvalidArgument):
        ctx.read(0, 4, 1)  # nothing was appended past the first rows
    after = ctx.read(0, 0, 4)
    assert all(np.array_equal(a, b) for a, b in zip(before, after))
    ctx.close()
