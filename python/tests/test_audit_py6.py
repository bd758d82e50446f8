"""A sixth audit of the Python package: a retired lease's accessors, the
copy and pickle refusals of every handle-naming class, integer rows for the
dtypes numpy holds natively, an array resized while a call converts its
arguments, objects used in a forked child, and a short sweep of the
transformers adapter (a CPU device named with an index).

Host backend, no GPU needed; the adapter tests skip, with the reason shown,
without torch and transformers.
"""
import copy
import gc
import inspect
import os
import pickle
import subprocess
import sys
import textwrap
import weakref

import numpy as np
import pytest

import activekv as akv

from conftest import tiny_llama, quiet, small

L, H, D = 3, 2, 8


def run_py(body, timeout=60):
    """Runs `body` in a fresh interpreter with this package; returns the
    CompletedProcess (rc, stdout, stderr)."""
    code = "import sys; sys.path.insert(0, %r)\n" % os.path.dirname(__file__) + \
        textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=timeout)


def _rows(n, dtype=np.float32, start=1.0):
    return (np.arange(L * n * H * D, dtype=np.float64).reshape(L, n, H, D) + start).astype(dtype)


def _finish(eng, lease, first):
    """Seals and retires `lease` (wait_ready made), then runs the layers from
    `first` on and ends the step."""
    attn = lease.mark_consumed()
    lease.seal(lease.write_back(), attn)
    lease.retire()
    for layer in range(first, L):
        lease = eng.lease_begin(layer)
        lease.wait_ready()
        attn = lease.mark_consumed()
        lease.seal(lease.write_back(), attn)
        lease.retire()
    eng.step_end()


# ------------------------------------------------------------ a retired lease


def test_retired_lease_accessors_refuse_with_bad_handle_and_the_receipt_has_the_fences(engine):
    """Lease.view raised BadHandle once the lease retired, while
    Lease.attention and Lease.tail still answered the dead lease's fences.
    All three are now valid until the lease retires and raise BadHandle
    after, as every call on a dead lease; the retire's Receipt holds both
    fences."""
    ctx = engine.open_context()
    k = _rows(2)
    ctx.append(k, k)
    engine.step_begin([ctx])
    lease = engine.lease_begin(0)
    lease.wait_ready()
    attn = lease.mark_consumed()
    tail = lease.write_back()
    assert lease.attention == attn and lease.tail == tail and lease.view is not None
    lease.seal(tail, attn)
    receipt = lease.retire()
    assert receipt.attention == attn and receipt.tail == tail
    for name in ("view", "attention", "tail"):
        with pytest.raises(akv.BadHandle, match="retired"):
            getattr(lease, name)
    assert lease.layer == 0  # what the lease was, not a handle
    for layer in (1, 2):
        lease = engine.lease_begin(layer)
        lease.wait_ready()
        a = lease.mark_consumed()
        lease.seal(lease.write_back(), a)
        lease.retire()
    engine.step_end()


def test_lease_released_by_quarantine_or_closed_with_its_engine_refuses_its_fences():
    """A lease a quarantine released and a lease of a closed engine are dead
    too: their fences are refused (BadHandle), not answered."""
    eng = akv.Engine(**small())
    ctx = eng.open_context()
    ctx.append(_rows(2), _rows(2))
    eng.step_begin([ctx])
    lease = eng.lease_begin(0)
    lease.wait_ready()
    lease.mark_consumed()
    lease.write_back()
    eng.quarantine()
    for name in ("view", "attention", "tail"):
        with pytest.raises(akv.BadHandle):
            getattr(lease, name)
    eng.close()
    with pytest.raises(akv.BadHandle, match="engine is closed"):
        lease.attention


# ------------------------------------------------------------ copies


def test_view_deepcopy_and_pickle_name_the_view_and_copy_still_gives_the_same_view(engine):
    """copy.deepcopy(view) and pickle.dumps(view) raised 'an activekv.Lease
    cannot be copied' from inside the copy: the message named a class the
    caller never passed. They now name the View; copy.copy stays allowed (the
    same lease's view, dead with it)."""
    ctx = engine.open_context()
    ctx.append(_rows(2), _rows(2))
    engine.step_begin([ctx])
    lease = engine.lease_begin(0)
    view = lease.wait_ready()
    for how in (copy.deepcopy, pickle.dumps, lambda v: pickle.dumps(v, protocol=0)):
        with pytest.raises(TypeError, match=r"activekv\.View") as info:
            how(view)
        assert "Lease" not in str(info.value)
    twin = copy.copy(view)
    assert type(twin) is akv.View and twin.len == view.len and twin.base == view.base
    np.testing.assert_array_equal(twin.keys(0)[:2], view.keys(0)[:2])
    _finish(engine, lease, 1)
    with pytest.raises(akv.BadHandle):
        twin.keys(0)


def test_every_handle_naming_class_names_itself_when_copied_or_pickled(engine):
    """Every class that names a C handle refuses deepcopy and pickle with a
    TypeError naming its own class."""
    ctx = engine.open_context()
    ctx.append(_rows(2), _rows(2))
    stream = engine.stream_create()
    engine.step_begin([ctx])
    lease = engine.lease_begin(0)
    view = lease.wait_ready(stream)
    for obj, name in ((engine, "Engine"), (ctx, "Context"), (stream, "Stream"),
                      (lease, "Lease"), (view, "View")):
        for how in (copy.deepcopy, pickle.dumps):
            with pytest.raises(TypeError, match=r"activekv\.%s\b" % name):
                how(obj)
    _finish(engine, lease, 1)
    stream.destroy()


# ------------------------------------------------------------ integer rows


@pytest.mark.parametrize("dtype,ints", [("f32", (np.int32, np.uint32))])
def test_integer_rows_are_refused_for_f32(dtype, ints):
    """An int32 array for an f32 engine was taken as raw bits: the
    integers 1, 2, 3 were stored as the floats 1e-45, 3e-45, ... silently.
    docs/python.md lists raw bits for bf16, f16 and FP8 only, so integer
    rows for an f32 engine are refused (InvalidArgument, nothing appended),
    numpy's and torch's alike; bits meant as bits pass as
    .view(np.float32)."""
    npf = {"f32": np.float32, "f16": np.float16}[dtype]
    with akv.Engine(**small(dtype=dtype)) as eng:
        ctx = eng.open_context()
        for it in ints:
            k = _rows(2, it)
            with pytest.raises(akv.InvalidArgument, match="raw bits"):
                ctx.append(k, k)
            with pytest.raises(akv.InvalidArgument, match="raw bits"):
                ctx.append_layer(0, k[0], k[0])
            with pytest.raises(akv.InvalidArgument, match="raw bits"):
                ctx.append(_rows(2, npf), k)  # v alone
        assert len(ctx) == 0 and ctx.read(0, 0, 0)[0].shape == (0, H, D)
        good = _rows(2, npf)
        ctx.append(good, good.view({4: np.int32, 2: np.int16}[good.itemsize]).view(npf))
        np.testing.assert_array_equal(ctx.read(1, 0, 2)[0], good[1])
        torch = pytest.importorskip("torch")
        tint = {"f32": torch.int32, "f16": torch.int16}[dtype]
        t = torch.from_numpy(good).view(tint)
        with pytest.raises(akv.InvalidArgument, match="raw bits"):
            ctx.append(t, t)
        assert len(ctx) == 2


@pytest.mark.parametrize("dtype,ints", [("bf16", (np.uint16, np.int16)),
                                        ("f16", (np.uint16, np.int16)),
                                        ("fp8_e4m3", (np.uint8, np.int8)),
                                        ("fp8_e5m2", (np.uint8, np.int8))])
def test_raw_bits_stay_accepted_where_documented(dtype, ints):
    """bf16 and f16 (uint16/int16 bit patterns) and FP8 (uint8/int8 codes)
    take integer rows as raw bits, as docs/python.md has always said."""
    with akv.Engine(**small(dtype=dtype)) as eng:
        ctx = eng.open_context()
        for n, it in enumerate(ints):
            k = (np.arange(L * H * D).reshape(L, 1, H, D) % 100).astype(it)
            ctx.append(k, k)
            assert ctx.read(2, n, 1)[0].tobytes() == k[2].tobytes()
        assert len(ctx) == 2


# ------------------------------------------------------------ resized arrays


class _Sub(np.ndarray):
    """An ndarray subclass: np.asarray gives a view of it, not the object."""


def _resizing_v(victim, shape):
    """A V whose __array__ resizes `victim` (refcheck=False), which frees the
    memory a view of it named, then fills the freed memory with junk."""
    class V:
        def __array__(self, dtype=None, copy=None):
            victim.resize((victim.size * 4096,), refcheck=False)
            junk = [np.full(victim.size // 4096, -7.0, np.float32) for _ in range(64)]
            del junk
            return np.ones(shape, np.float32)
    return V()


@pytest.mark.parametrize("how", ["subclass", "view"])
def test_array_resized_while_the_call_converts_its_other_argument_is_refused(engine, how):
    """K converted first and V's __array__ then resized the array K's view
    names (ndarray.resize(..., refcheck=False)): the memory was freed, and
    the library copied freed memory into the context (junk rows, or a crash
    for a large array). The memory under each converted argument is checked
    once every argument is converted: refused (InvalidArgument), nothing
    appended."""
    ctx = engine.open_context()
    want = _rows(2)
    for call in ("append", "append_layer"):
        if how == "subclass":
            k = _Sub(want.shape, np.float32)
            k[...] = want
            owner = k
        else:
            owner = want.copy()
            k = owner[:]  # a view: its base owns the memory
        shape = want.shape if call == "append" else want.shape[1:]
        v = _resizing_v(owner, shape)
        with pytest.raises(akv.InvalidArgument, match="resized"):
            if call == "append":
                ctx.append(k, v)
            else:
                ctx.append_layer(0, k[0], v)
        assert len(ctx) == 0
        assert ctx.read(0, 0, 0)[0].size == 0
    ctx.append(want, want)  # the right call follows
    np.testing.assert_array_equal(ctx.read(2, 0, 2)[0], want[2])


def test_rows_are_copied_during_the_call_and_no_reference_is_kept(engine):
    """append and append_layer read the arrays during the call only: after it
    returns the package holds no reference (the array can be resized with
    numpy's own reference check, and is freed when the caller drops it) and
    no pointer (the rows read back are those at the call, whatever happens
    to the array after)."""
    ctx = engine.open_context()
    k, v = _rows(2), _rows(2, start=100.0)
    keep_k, keep_v = k.copy(), v.copy()
    ctx.append(k, v)
    ctx.append_layer(0, k[0, :1].copy(), v[0, :1].copy())  # layer 0 ahead by one row
    k.resize((k.size * 1024,))  # refcheck=True: refused if anyone else held it
    v.resize((v.size * 1024,))
    kr, vr = weakref.ref(k), weakref.ref(v)  # (a weak reference fails numpy's refcheck too)
    k[:] = -1.0
    del k, v
    gc.collect()
    assert kr() is None and vr() is None
    junk = [np.full(L * 2 * H * D, -3.0, np.float32) for _ in range(256)]
    del junk
    rk, rv = ctx.read(1, 0, 2)
    np.testing.assert_array_equal(rk, keep_k[1])
    np.testing.assert_array_equal(rv, keep_v[1])
    rk0, _ = ctx.read(0, 0, 3)
    np.testing.assert_array_equal(rk0[:2], keep_k[0])
    np.testing.assert_array_equal(rk0[2], keep_k[0, 0])


# ------------------------------------------------------------ fork


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork here")
def test_forked_child_refuses_a_leases_fences_and_views_and_exits_cleanly():
    """In a child forked with a lease in flight, Lease.attention and
    Lease.tail answered the parent's fences without the engine being asked
    (every other call raised BadHandle). They raise BadHandle now, as
    Lease.view and View.keys do; the child's normal exit (finalizers,
    atexit) frees nothing of the parent's and returns; the parent finishes
    its step."""
    r = run_py("""
        import os, sys, gc, time, numpy as np, activekv as akv
        from conftest import quiet
        eng = akv.Engine(backend="host", n_dense_layers=1, kv_heads=2, head_dim=8,
                         dtype="f32", max_tokens=32, page_tokens=4, max_contexts=2,
                         host_pool_gib=1, log=quiet)
        ctx = eng.open_context()
        z = np.ones((1, 5, 2, 8), np.float32)
        ctx.append(z, z)
        eng.step_begin([ctx])
        lease = eng.lease_begin(0)
        view = lease.wait_ready()
        K = view.keys(0)
        attn = lease.mark_consumed()
        tail = lease.write_back()
        pid = os.fork()
        if pid == 0:
            bad = []
            for name, f in (("attention", lambda: lease.attention),
                            ("tail", lambda: lease.tail), ("view", lambda: lease.view),
                            ("keys", lambda: view.keys(0)), ("kv", lambda: view.values(0)),
                            ("seal", lambda: lease.seal(tail, attn))):
                try:
                    f()
                    bad.append(name)
                except akv.BadHandle as exc:
                    if "fork" not in str(exc):
                        bad.append(name + " (message)")
            if bad:
                print("child reached the parent's engine:", bad, flush=True)
                os._exit(3)
            del K, view, lease, ctx, eng
            gc.collect()
            sys.exit(0)  # a normal exit: finalizers and atexit run
        deadline = time.monotonic() + 30
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            assert time.monotonic() < deadline, "the child hung"
            time.sleep(0.05)
        assert os.waitstatus_to_exitcode(status) == 0, status
        assert lease.attention == attn and lease.tail == tail
        lease.seal(tail, attn)
        lease.retire()
        eng.step_end()
        assert len(ctx) == 6
        del K, view
        eng.close()
        print("ok")
    """)
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr)
    assert r.stdout.strip() == "ok"
    assert "Traceback" not in r.stderr, r.stderr


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork here")
def test_forked_child_refuses_a_cache_and_its_exit_leaves_the_parents_decode_alone():
    """An ActiveKVCache (hooks on, a decode step open) inherited by a forked
    child: a forward, finish() and close() there raise BadHandle naming the
    fork, the child's normal exit (the cache's finalizer, the engine's
    __del__) returns without touching the parent's engine, and the parent
    decodes on, bit-identical to a cache never forked."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    r = run_py("""
        import os, sys, gc, time, inspect, torch, activekv as akv
        from transformers import LlamaConfig, LlamaForCausalLM
        from activekv.transformers import ActiveKVCache
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=8, max_position_embeddings=128)
        cfg._attn_implementation = "sdpa"
        m = LlamaForCausalLM(cfg).eval()
        kw = "cache" if "cache" in inspect.signature(m.forward).parameters else "past_key_values"
        ids = torch.randint(0, 64, (1, 4))
        torch.set_grad_enabled(False)

        def run(fork):
            c = ActiveKVCache(m, max_cache_len=32, batch_size=1, hooks=True)
            out = [m(ids, **{kw: c}).logits, m(ids[:, :1], **{kw: c}).logits]
            if fork:
                pid = os.fork()
                if pid == 0:
                    for f in (lambda: m(ids[:, :1], **{kw: c}), c.finish, c.close):
                        try:
                            f()
                            os._exit(3)
                        except akv.BadHandle as exc:
                            if "fork" not in str(exc):
                                os._exit(4)
                    del c
                    gc.collect()
                    sys.exit(0)
                deadline = time.monotonic() + 30
                while True:
                    done, status = os.waitpid(pid, os.WNOHANG)
                    if done:
                        break
                    assert time.monotonic() < deadline, "the child hung"
                    time.sleep(0.05)
                assert os.waitstatus_to_exitcode(status) == 0, status
            out += [m(ids[:, 1:2], **{kw: c}).logits, m(ids[:, 2:3], **{kw: c}).logits]
            assert c.get_seq_length() == 7
            c.close()
            return out

        a, b = run(True), run(False)
        assert all(torch.equal(x, y) for x, y in zip(a, b))
        print("ok")
    """, timeout=120)
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr)
    assert r.stdout.strip() == "ok"


# ------------------------------------------------------------ the adapter


def _llama(layers=2):
    return tiny_llama(layers)


def test_cache_layer_copy_deepcopy_and_pickle_name_the_layer():
    """copy.copy(cache.layers[i]) made a second ActiveKVLayer driving the same
    engine and step; deepcopy and pickle failed inside with the Engine's
    TypeError. All three are refused naming the ActiveKVLayer, as the
    cache's own are."""
    torch, model, kw = _llama()
    from activekv.transformers import ActiveKVCache

    with torch.no_grad(), ActiveKVCache(model, max_cache_len=16) as cache:
        model(torch.tensor([[1, 2, 3]]), **{kw: cache})
        for how in (copy.copy, copy.deepcopy, pickle.dumps):
            with pytest.raises(TypeError, match="ActiveKVLayer") as info:
                how(cache.layers[0])
            assert "Engine" not in str(info.value)
            with pytest.raises(TypeError, match="ActiveKVCache"):
                how(cache)
        assert cache.get_seq_length() == 3


@pytest.mark.parametrize("device", ["cpu:0", "cpu"])
def test_cache_for_a_cpu_device_named_with_an_index_serves_the_model(device):
    """ActiveKVCache(config=..., device="cpu:0") was made, then refused every
    update: the model's tensors say "cpu", and cpu:0 != cpu. A CPU device is
    one device: the cache serves it, bit-identical to one made for "cpu"."""
    torch, model, kw = _llama()
    from activekv.transformers import ActiveKVCache

    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad(), ActiveKVCache(config=model.config, device=device,
                                        dtype=torch.float32, max_cache_len=16) as cache, \
            ActiveKVCache(model, max_cache_len=16) as ref:
        for step in (ids, ids[:, :1], ids[:, 1:2]):
            got = model(step, **{kw: cache}).logits
            want = model(step, **{kw: ref}).logits
            assert torch.equal(got, want)
        assert cache.get_seq_length() == 6
