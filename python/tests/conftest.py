"""Shared fixtures of the package tests (host backend: no GPU needed)."""
import contextlib
import os
import threading

import pytest

import activekv as akv

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


@contextlib.contextmanager
def held_by_another_thread(engine):
    """While the block runs, another thread holds the engine's call slot, as
    a thread inside a call on it would (Engine._enter)."""
    inside, release = threading.Event(), threading.Event()

    def hold():
        held = engine._enter("test")
        inside.set()
        release.wait(10)
        if held:
            engine._leave()

    t = threading.Thread(target=hold)
    t.start()
    inside.wait(10)
    try:
        yield
    finally:
        release.set()
        t.join()


def quiet(level, message):
    """A log sink that drops everything (tests check messages through exceptions)."""


def small(**over):
    """A small host-backend geometry: 3 dense layers, 2 KV heads x 8 dims, f32."""
    cfg = dict(backend="host", n_dense_layers=3, kv_heads=2, head_dim=8, dtype="f32",
               max_tokens=32, page_tokens=4, max_contexts=2, host_pool_gib=1, log=quiet)
    cfg.update(over)
    return cfg


@pytest.fixture
def engine():
    with akv.Engine(**small()) as e:
        yield e


def header_dir():
    """akv.h: the copy installed with the package, else the checkout's."""
    d = akv.include_dir()
    if d is None and os.path.isfile(os.path.join(REPO, "include", "akv.h")):
        d = os.path.join(REPO, "include")
    return d


@pytest.fixture
def destroys(monkeypatch):
    """The handles akv_engine_destroy freed, in order (the library's own
    destroy, counted)."""
    real = akv._api.lib.akv_engine_destroy
    freed = []

    def counted(h):
        st = real(h)
        if st == 0:
            freed.append(h)
        return st

    monkeypatch.setattr(akv._api.lib, "akv_engine_destroy", counted)
    return freed


def tiny_llama(layers=3):
    """A tiny Llama (float32, SDPA, seeded) for the adapter's tests, and the name of its
    cache argument ("cache" in recent transformers, "past_key_values" before). Skips,
    with the reason shown, without torch and transformers."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import inspect

    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=8, max_position_embeddings=128)
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg).to(torch.float32).eval()
    params = inspect.signature(model.forward).parameters
    return torch, model, "cache" if "cache" in params else "past_key_values"


def in_forked_child(body, timeout=20.0):
    """Runs body() in a forked child and returns its exit code (the child
    reports with os._exit: 0 for success); None when it hung past
    `timeout` (the child is killed then)."""
    import signal
    import time

    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            code = body()
        finally:
            os._exit(code)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None
