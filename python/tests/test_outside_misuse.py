"""Misuse by an outside caller that the earlier misuse tests did not reach:
log callbacks that raise, are interrupted or drop other engines, and
sentinel values given as plain integers.

Each test fails on the package before its fix. Host backend, no GPU needed.
"""
import gc

import numpy as np
import pytest

import activekv as akv

from conftest import quiet, small

L, H, D = 3, 2, 8


@pytest.fixture
def destroys(monkeypatch):
    """Handles akv_engine_destroy freed, in order."""
    real = akv._api.lib.akv_engine_destroy
    freed = []

    def counted(h):
        st = real(h)
        if st == 0:
            freed.append(h)
        return st

    monkeypatch.setattr(akv._api.lib, "akv_engine_destroy", counted)
    return freed


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
        # the open itself completed before the interrupt was raised: the
        # engine holds the context and stays usable
        assert len(eng._contexts) == 1
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
            gc.collect()  # an engine is in a cycle (its log trampoline): collected here

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
