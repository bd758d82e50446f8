"""A ninth audit of the Python package, as an outside adversarial test
writer would make it: an ActiveKVCache asked for a CUDA device on a machine
without one, what a forked child reads of an engine's repr, the lengths an
ActiveKVCache gives for a layer counted from the end, and hostile inputs the
earlier audits did not try.

Host backend, no GPU needed; the adapter tests skip, with the reason shown,
without torch and transformers.
"""
import contextlib
import gc
import os
import signal
import threading
import time

import numpy as np
import pytest

import activekv as akv

from conftest import tiny_llama as _llama, quiet, small

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


# ------------------------------------------------------------ 5. gc at odd moments


class _GcCloser:
    """A gc callback that, armed, runs `action` at the start of the
    `skip`-th collection after arming (with the threshold at 1, a collection
    starts at nearly every allocation: inside the package's own code) and
    keeps what it raised. Restores the collector's settings on exit."""

    def __init__(self, skip, action):
        self.skip, self.action = skip, action
        self.fired, self.error = False, None

    def __call__(self, phase, info):
        if phase != "start" or self.fired:
            return
        if self.skip > 0:
            self.skip -= 1
            return
        self.fired = True
        try:
            self.action()
        except BaseException as exc:  # noqa: BLE001 - recorded for the test
            # its type and words only: its traceback's frames lead (f_back) to the
            # frames of the call it ran inside, whose arrays would hold the memory
            self.error = (type(exc), str(exc))

    def __enter__(self):
        self.threshold = gc.get_threshold()
        gc.callbacks.append(self)
        gc.set_threshold(1)
        return self

    def __exit__(self, *exc):
        gc.set_threshold(*self.threshold)
        gc.callbacks.remove(self)


def _staged_layer_0():
    """An engine of one context of 4 rows, in a step, with layer 0 leased and staged:
    (engine, context, stream, lease, view)."""
    eng = akv.Engine(**small(max_contexts=1))
    ctx = eng.open_context()
    k = np.ones((L, 4, H, D), np.float32)
    ctx.append(k, k)
    stream = eng.stream_create()
    eng.step_begin([ctx])
    lease = eng.lease_begin(0)
    return eng, ctx, stream, lease, lease.wait_ready(stream)


def _finish_step(eng, stream, lease):
    """Ends the step _staged_layer_0 began: layer 0's lease and then every later
    layer's sealed and retired in order, and the step ended."""
    for layer in range(L):
        if layer:
            lease = eng.lease_begin(layer)
            lease.wait_ready(stream)
        attn = lease.mark_consumed()
        lease.seal(lease.write_back(), attn)
        lease.retire()
    eng.step_end()


def test_engine_closed_by_a_gc_callback_inside_view_keys_never_leaves_an_array_over_freed_memory(
        destroys):
    """The one-call-at-a-time guard lets a call nested on the same thread
    through, and a gc callback (or a finalizer) runs the caller's code at an
    allocation inside View.keys: one that retired the lease, ended the step
    and closed the engine there, after keys had checked the lease and before
    its array was counted, had the engine destroyed at once (no array alive)
    and keys then handed out an array over the freed staging buffer. Now a
    close nested in another call on the engine raises Busy (nothing freed),
    and keys checks the lease again once its array is counted (BadHandle for
    one retired meanwhile): at every allocation where the callback can
    land, no array outlives the memory it views."""
    fired_inside = 0
    for skip in range(80):
        eng, ctx, stream, lease, view = _staged_layer_0()

        def end_everything():
            _finish_step(eng, stream, lease)
            eng.close()

        destroys.clear()
        array, error = None, None
        with _GcCloser(skip, end_everything) as closer:
            try:
                array = view.keys(0)
            except akv.BadHandle:
                error = True
        if not closer.fired:
            break  # keys ran to its end before the skip-th collection
        if array is not None:
            # the array's memory is the engine's, allocated: never destroyed under it
            assert destroys == [], (skip, closer.error)
            assert array.shape == (5, H, D) and float(array[0, 0, 0]) == 1.0
        else:
            assert error
        if closer.error is not None and closer.error[0] is akv.Busy:
            fired_inside += 1
            assert "inside another call" in closer.error[1]
        del array
        with contextlib.suppress(akv.ActiveKVError):
            end_everything()
        eng.close()
        gc.collect()
        assert eng._handle is None and not eng._pending_destroy, skip
    else:
        pytest.fail("keys never ran to its end within 80 collections")
    assert fired_inside > 0  # some landed inside the call


def test_cache_closed_by_a_gc_callback_inside_an_update_is_refused_not_half_done():
    """cache.close() from a gc callback that runs inside the cache's own
    decode update (on the same thread, so not refused as another thread's
    call) ended the step and closed the engine under the update, which
    then failed with AttributeError ('NoneType' object has no attribute
    '_release') and left the engine taken. A close() there is now refused
    (Busy) and the update completes; one that lands before the update
    takes the engine makes the update raise BadHandle. Either way the
    cache closes cleanly afterwards."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers import LlamaConfig

    from activekv.transformers import ActiveKVCache

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    refused = 0
    for skip in range(200):
        cache = ActiveKVCache(config=cfg, device="cpu", dtype=torch.float32, max_cache_len=16,
                              log=quiet)
        engine = cache.engine
        kv = torch.ones(1, 2, 4, 8)
        with torch.no_grad():
            for layer in range(2):
                cache.update(kv, kv, layer)
            with _GcCloser(skip, cache.close) as closer:
                try:
                    out = cache.update(kv[:, :, :1], kv[:, :, :1], 0)
                except akv.BadHandle:
                    out = None
        if not closer.fired:
            cache.close()
            break
        if out is None:  # closed before the update took the engine
            assert closer.error is None and cache.engine is None
        else:
            assert closer.error is not None and closer.error[0] is akv.Busy, (skip, closer.error)
            refused += 1
            assert out[0].shape == (1, 2, 5, 8) and float(out[0][0, 0, 0, 0]) == 1.0
            assert cache.engine is engine and cache.layer_lengths == [5, 4]
            del out
        cache.close()
        gc.collect()
        assert engine._handle is None and not engine._pending_destroy, skip
        assert "owner" not in engine._slot, skip
    else:
        pytest.fail("the update never ran to its end within 200 collections")
    assert refused > 0


def test_engine_with_block_left_by_an_exception_inside_its_own_call_quarantines_nothing():
    """A `with engine:` block left by an exception quarantines an open step
    so that the engine can be freed (docs/python.md). Left inside one of the
    engine's own calls on the same thread (a gc callback's code), its close
    is refused (Busy, nested), and the quarantine it then made released the
    leases the call in flight was using: View.keys failed with BadHandle
    and the step was gone. Nested, nothing is quarantined now: the call
    completes and the step goes on."""
    nested_seen = 0
    for skip in range(80):
        eng, ctx, stream, lease, view = _staged_layer_0()
        where = []

        def leave_with_block():
            where.append(eng._slot.get("owner") == threading.get_ident())
            eng.__exit__(RuntimeError, RuntimeError("the block fails"), None)

        with _GcCloser(skip, leave_with_block) as closer:
            try:
                array = view.keys(0)
            except akv.BadHandle:
                array = None
        if not closer.fired:  # keys ran to its end first
            del array
            eng.__exit__(RuntimeError, RuntimeError("done"), None)
            break
        if where == [True]:  # inside keys: nothing may change
            nested_seen += 1
            assert array is not None and array.shape == (5, H, D), skip
            assert not eng.info().quarantined
            array = None
            _finish_step(eng, stream, lease)
            assert len(ctx) == 5
        else:  # before keys took the engine: abandoned and freed, keys refused
            assert where == [False] and array is None, skip
        del array
        eng.close()
        gc.collect()
        assert eng._handle is None and not eng._pending_destroy, skip
    else:
        pytest.fail("keys never ran to its end within 80 collections")
    assert nested_seen > 0
