"""Misuse by an outside caller that the earlier misuse tests did not reach:
log callbacks that raise, are interrupted or drop other engines; sentinel
values given as plain integers; Ctrl-C right after a call that ends
handles; torch tensors with no host elements; engines inherited by a forked
child; copies of a transformers cache.

Each test fails on the package before its fix. Host backend, no GPU needed.
"""
import gc

import numpy as np
import pytest

import activekv as akv

from conftest import in_forked_child as _in_forked_child, quiet, small

L, H, D = 3, 2, 8


@pytest.fixture
def unraisable(monkeypatch):
    """Exceptions Python reported as unraisable (sys.unraisablehook)."""
    seen = []
    monkeypatch.setattr("sys.unraisablehook", lambda u: seen.append(u.exc_value))
    return seen


def pooled(**over):
    """An arena engine with a device pool: an open with a target below the
    floor (the sink and the newest page) is raised to it and logged (info),
    a log line from inside an engine call after create."""
    return small(route="arena", device_pool_gib=1, log_level="info", **over)


def below_floor(eng):
    """Opens a context with a target below the floor: one info line."""
    return eng.open_context(target_pages=1)


# ------------------------------------------------------------ log callbacks


def test_log_callback_exception_is_reported_not_dropped(unraisable):
    """A log callback that raises (a bug in the caller's logger) lost every
    line with no sign of it: the exception was dropped silently."""

    def broken(level, message):
        raise ValueError("the caller's logger is broken")

    with akv.Engine(**small(log=broken, log_level="info")) as eng:
        eng.info()
    assert any(isinstance(e, ValueError) and "broken" in str(e) for e in unraisable)


def test_log_callback_of_the_wrong_arity_is_reported_not_dropped(unraisable):
    with akv.Engine(**small(log=lambda: None, log_level="info")):
        pass
    assert any(isinstance(e, TypeError) for e in unraisable)


def test_keyboard_interrupt_in_a_log_callback_reaches_the_caller(destroys):
    """Ctrl-C while the log callback runs (inside a library call) was dropped
    with the callback's other exceptions: the call went on as if nothing
    happened. It is raised by the call once the library returned; an engine
    whose create was interrupted is freed, not leaked."""
    calls = []

    def interrupted(level, message):
        calls.append(message)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        akv.Engine(**small(log=interrupted, log_level="info"))
    assert calls  # the create logged its fit line
    assert len(destroys) == 1  # the engine the interrupted create made is freed


def test_keyboard_interrupt_in_a_log_callback_during_a_call_is_raised_by_it():
    state = {"armed": False, "lines": 0}

    def log(level, message):
        if state["armed"]:
            state["armed"] = False
            state["lines"] += 1
            raise KeyboardInterrupt

    with akv.Engine(**pooled(log=log)) as eng:
        state["armed"] = True
        with pytest.raises(KeyboardInterrupt):
            below_floor(eng)
        assert state["lines"] == 1  # the open logged (target raised to the floor)
        # the open itself completed before the interrupt was raised, and no
        # context reached the caller: it was closed again (its slot free, as
        # an interrupted create frees its engine), and the engine stays usable
        assert len(eng._contexts) == 0
        assert eng.admission_counters()["release"] == 1
        below_floor(eng).close()


def test_engine_dropped_inside_another_engines_log_callback_is_freed(destroys):
    """An engine whose last reference goes while another engine's log
    callback runs (dropped by the callback, or collected by a garbage
    collection the callback's allocations set off) was never freed: its
    close was refused as a call "from a log callback", although akv.h allows
    calls on another engine there, and its pinned pool stayed allocated for
    the life of the process."""
    box = {"b": akv.Engine(**small())}
    b_handle = box["b"]._handle

    def log(level, message):
        if box.pop("b", None) is not None:  # the last reference to engine B
            gc.collect()  # freed as its last reference went; the collector finds nothing

    with akv.Engine(**small(log=log, log_level="info")):
        assert "b" not in box
        assert b_handle in destroys


def test_log_callback_may_use_another_engine():
    """akv.h: the callback may call the library on another engine."""
    seen = []
    with akv.Engine(**small()) as other:

        def log(level, message):
            seen.append(other.info().backend)

        with akv.Engine(**small(log=log, log_level="info")):
            pass
    assert seen and set(seen) == {"host"}


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


# ------------------------------------------------------------ Ctrl-C right after a C call


def interrupted_after(monkeypatch, name):
    """Makes lib.<name> run the real call, then raise KeyboardInterrupt, as a
    Ctrl-C pressed during the call is raised at the first bytecode after it
    returned (the retire of a step waits on the host: a likely moment).
    Returns the list of the real call's arguments, one entry per call."""
    real = getattr(akv._api.lib, name)
    calls = []

    def call(*args):
        calls.append(args)
        real(*args)
        raise KeyboardInterrupt

    monkeypatch.setattr(akv._api.lib, name, call)
    return calls


def reached(monkeypatch, name):
    """Records the calls that reach lib.<name> (passed on unchanged)."""
    real = getattr(akv._api.lib, name)
    calls = []

    def call(*args):
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(akv._api.lib, name, call)
    return calls


def test_engine_close_interrupted_after_the_destroy_leaves_it_closed(monkeypatch, destroys):
    """The destroy ran, but the engine kept its handle: close again (or the
    garbage collector's close) called the library on the dead engine, and
    once its handle record is handed out again (akv.h, "Handle lifetimes")
    would destroy a newer engine of someone else's."""
    eng = akv.Engine(**small())
    with monkeypatch.context() as m:
        interrupted_after(m, "akv_engine_destroy")
        with pytest.raises(KeyboardInterrupt):
            eng.close()
    assert len(destroys) == 1
    eng.close()  # a no-op: the engine is closed
    assert len(destroys) == 1
    with pytest.raises(akv.BadHandle, match="closed"):
        eng.info()
    assert repr(eng) == "<activekv.Engine closed>"


def test_context_close_interrupted_after_the_close_leaves_it_closed(monkeypatch):
    with akv.Engine(**small()) as eng:
        ctx = eng.open_context()
        with monkeypatch.context() as m:
            calls = interrupted_after(m, "akv_context_close")
            with pytest.raises(KeyboardInterrupt):
                ctx.close()
        assert len(calls) == 1
        ctx.close()  # a no-op: the context is closed
        with pytest.raises(akv.BadHandle, match="closed"):
            ctx.length
        eng.open_context().close()  # its host slot is free again


def test_lease_retire_interrupted_after_the_retire_leaves_it_retired(monkeypatch):
    """A retired lease's handle record is handed to a later lease of the
    engine (15 steps on): the object that kept it would retire that one."""
    with akv.Engine(**small()) as eng:
        ctx = eng.open_context()
        k = np.zeros((L, 2, H, D), np.float32)
        ctx.append(k, k)
        with eng.step([ctx]):
            for layer in range(L):
                lease = eng.lease_begin(layer)
                lease.wait_ready()
                attn = lease.mark_consumed()
                lease.seal(lease.write_back(), attn)
                if layer == 0:
                    with monkeypatch.context() as m:
                        calls = interrupted_after(m, "akv_lease_retire")
                        with pytest.raises(KeyboardInterrupt):
                            lease.retire()
                    assert len(calls) == 1
                    with monkeypatch.context() as m:
                        calls = reached(m, "akv_lease_retire")
                        with pytest.raises(akv.BadHandle, match="retired"):
                            lease.retire()
                        assert calls == []  # refused without reaching the library
                else:
                    lease.retire()
        assert len(ctx) == 3


def test_quarantine_interrupted_after_it_ran_leaves_its_leases_dead_and_the_step_ended(
        monkeypatch, destroys):
    """Quarantine blocks (it synchronizes every queue and the device): a
    Ctrl-C there is raised once it returned. The leases it released kept
    their handles and the step read as open: close() raised Busy, and a
    later step_begin could hand those records to new leases."""
    eng = akv.Engine(**small())
    ctx = eng.open_context()
    k = np.zeros((L, 2, H, D), np.float32)
    ctx.append(k, k)
    eng.step_begin([ctx])
    lease = eng.lease_begin(0)
    lease.wait_ready()
    with monkeypatch.context() as m:
        calls = interrupted_after(m, "akv_engine_quarantine")
        with pytest.raises(KeyboardInterrupt):
            eng.quarantine()
    assert len(calls) == 1
    with monkeypatch.context() as m:
        calls = reached(m, "akv_lease_retire")
        with pytest.raises(akv.BadHandle, match="retired"):
            lease.retire()
        assert calls == []  # refused without reaching the library
    eng.close()  # the quarantine ended the step: nothing refuses the close
    assert len(destroys) == 1


def test_stream_destroy_interrupted_after_the_destroy_leaves_it_destroyed(monkeypatch):
    with akv.Engine(**small()) as eng:
        stream = eng.stream_create()
        with monkeypatch.context() as m:
            calls = interrupted_after(m, "akv_stream_destroy")
            with pytest.raises(KeyboardInterrupt):
                stream.destroy()
        assert len(calls) == 1
        stream.destroy()  # a no-op: the stream is destroyed
        with pytest.raises(akv.BadHandle, match="destroyed"):
            stream.synchronize()
    # the engine closed (its close destroys the streams it still lists)


def test_cache_update_interrupted_in_the_boundary_retire_can_be_retried(monkeypatch):
    """ActiveKVCache retires the step's leases at the next step's first
    update (blocking: where a Ctrl-C lands). A lease retired as the
    interrupt came stayed on the cache's list: the retried update passed its
    dead handle to the library again (BadHandle: the cache was stuck; once
    the record is handed out again, a newer lease would be retired)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers import LlamaConfig

    from activekv.transformers import ActiveKVCache

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         vocab_size=64)
    g = torch.Generator().manual_seed(7)

    def kv(t):
        return torch.randn(1, 2, t, 8, generator=g), torch.randn(1, 2, t, 8, generator=g)

    with ActiveKVCache(config=config, device="cpu", dtype=torch.float32, max_cache_len=16,
                       page_tokens=4, log=quiet) as cache:
        for layer in range(2):
            cache.update(*kv(3), layer)  # the prompt
        step1 = [kv(1) for _ in range(2)]
        for layer in range(2):
            cache.update(*step1[layer], layer)
        drv = cache._driver
        real = drv.api.retire

        def interrupted(*args):
            st = real(*args)
            assert st == 0
            raise KeyboardInterrupt

        step2 = [kv(1) for _ in range(2)]
        monkeypatch.setattr(drv.api, "retire", interrupted)
        with pytest.raises(KeyboardInterrupt):
            cache.update(*step2[0], 0)  # the boundary: step 1's first retire is cut short
        monkeypatch.setattr(drv.api, "retire", real)
        for layer in range(2):
            cache.update(*step2[layer], layer)  # the same update again
        cache.finish()
        ctx = cache.contexts[0]
        assert len(ctx) == 5
        for layer in range(2):
            k, v = ctx.read(layer, 3, 2)
            for row, step in ((0, step1), (1, step2)):
                assert np.array_equal(k[row], step[layer][0][0, :, 0].numpy())
                assert np.array_equal(v[row], step[layer][1][0, :, 0].numpy())


# ------------------------------------------------------------ rows that are no rows


def _nested(torch):
    return torch.nested.nested_tensor([torch.zeros(2, H, D)] * L)


def _fake(torch):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        return torch.zeros(L, 2, H, D)


@pytest.mark.parametrize("make", [_nested, _fake], ids=["nested", "fake"])
def test_torch_tensors_without_host_elements_raise_invalid_argument(engine, make):
    """A nested tensor (NotImplementedError from torch's view) and a fake
    tensor (RuntimeError from .numpy()) escaped as torch's own errors instead
    of the package's InvalidArgument."""
    torch = pytest.importorskip("torch")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the nested tensor API's prototype warning
        bad = make(torch)
    good = torch.zeros(L, 2, H, D)
    ctx = engine.open_context()
    with pytest.raises(akv.InvalidArgument):
        ctx.append(bad, good)
    with pytest.raises(akv.InvalidArgument):
        ctx.append(good, bad)
    with pytest.raises(akv.InvalidArgument):
        ctx.append_layer(0, bad[0] if make is _fake else bad, good[0])
    assert len(ctx) == 0


# ------------------------------------------------------------ fork


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="no os.fork here")
def test_engine_inherited_by_a_forked_child_is_refused_and_never_hangs():
    """A forked child has the engine's Python object but none of the
    library's threads: a step there hung in wait_ready, and so did the child's
    exit, whose garbage collection closed the engine (draining a host stream
    whose worker is not in the child). Every call from the child now raises
    BadHandle, and the child's exit frees nothing and returns."""
    eng = akv.Engine(**small())
    ctx = eng.open_context()
    k = np.zeros((L, 2, H, D), np.float32)
    ctx.append(k, k)
    stream = eng.stream_create()

    def child():
        for call in (eng.info, lambda: ctx.length, stream.synchronize,
                     lambda: eng.step_begin([ctx]), eng.close, ctx.close, stream.destroy):
            try:
                call()
                return 2  # reached the library
            except akv.BadHandle as exc:
                if "fork" not in str(exc):
                    return 3
        eng.__del__()  # what the child's exit runs: returns, frees nothing
        return 0

    assert _in_forked_child(child) == 0
    # the parent's engine is untouched
    with eng.step([ctx]):
        for layer in range(L):
            lease = eng.lease_begin(layer)
            lease.wait_ready(stream)
            attn = lease.mark_consumed()
            lease.seal(lease.write_back(), attn)
            lease.retire()
    assert len(ctx) == 3
    eng.close()


# ------------------------------------------------------------ copies of a cache


def test_cache_cannot_be_copied():
    """copy.copy(cache) made a second Cache over the same engine, contexts
    and step: decoding through either appended rows to both, and closing
    either closed the other's engine, silently. A cache names C handles as
    the engine does, and is refused like it (TypeError)."""
    import copy
    import pickle

    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers import LlamaConfig

    from activekv.transformers import ActiveKVCache

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         vocab_size=64)
    with ActiveKVCache(config=config, device="cpu", dtype=torch.float32, max_cache_len=16,
                       page_tokens=4, log=quiet) as cache:
        for layer in range(2):
            cache.update(torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 8), layer)
        for make in (copy.copy, copy.deepcopy, pickle.dumps):
            with pytest.raises(TypeError, match="ActiveKVCache cannot be copied"):
                make(cache)
        assert cache.get_seq_length() == 3
