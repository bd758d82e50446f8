"""An eighth audit of the Python package: thread-safety and fork behaviour of
the plain API (Engine, Context, Stream, Lease, View): what another thread
sees of an object while a call on its engine is in flight (a refused
destroy or close, whose handle is cleared for the call and put back), and
what a forked child sees of a Stream.

Deterministic: the second thread runs from inside the first thread's call
(the engine's log callback, which the library calls there with the debug
line of the refusal), and is joined before the call goes on.

Host backend, no GPU needed.
"""
import os
import threading

import numpy as np
import pytest

import activekv as akv

from conftest import in_forked_child as _in_forked_child, small

L, H, D = 3, 2, 8


class _Probe:
    """A log callback that, while armed, runs `probe` once on a second
    thread from inside the engine call that logs (the refusal's debug line)
    and keeps what it returned or raised."""

    def __init__(self):
        self.probe = None
        self.result = None

    def __call__(self, level, message):
        probe, self.probe = self.probe, None
        if probe is None:
            return
        out = {}

        def run():
            try:
                out["value"] = probe()
            except BaseException as exc:  # noqa: BLE001 - recorded for the test
                out["error"] = exc

        t = threading.Thread(target=run)
        t.start()
        t.join(30)
        self.result = out


def _engine_with_probe():
    probe = _Probe()
    eng = akv.Engine(**small(log=probe, log_level="debug"))
    ctx = eng.open_context()
    k = np.zeros((L, 2, H, D), np.float32)
    ctx.append(k, k)
    return eng, ctx, probe


def _finish_step(eng, ctx, first_lease, stream):
    attn = first_lease.mark_consumed()
    first_lease.seal(first_lease.write_back(), attn)
    first_lease.retire()
    for layer in range(1, L):
        lease = eng.lease_begin(layer)
        lease.wait_ready(stream)
        attn = lease.mark_consumed()
        lease.seal(lease.write_back(), attn)
        lease.retire()
    eng.step_end()


# ------------------------------------------------------------ threads


def test_stream_handle_from_another_thread_during_a_refused_destroy_is_busy():
    """Stream.handle was read without taking the engine: from a second
    thread while a Stream.destroy that the library refused (InUse: a lease
    uses the stream) was in flight, it raised BadHandle ("the stream is
    destroyed") for a stream that stayed alive, since the destroy clears the
    handle for the call and puts it back on a refusal. It is a call on the
    engine like any other: Busy from a second thread."""
    eng, ctx, probe = _engine_with_probe()
    stream = eng.stream_create()
    handle = stream.handle
    eng.step_begin([ctx])
    lease = eng.lease_begin(0)
    lease.wait_ready(stream)
    probe.probe = lambda: stream.handle
    with pytest.raises(akv.InUse):
        stream.destroy()
    assert probe.result is not None, "the refusal logged nothing"
    assert isinstance(probe.result.get("error"), akv.Busy), probe.result
    assert stream.handle == handle  # alive, as the refusal says
    _finish_step(eng, ctx, lease, stream)
    stream.destroy()
    with pytest.raises(akv.BadHandle):
        stream.handle
    eng.close()


def test_context_repr_from_another_thread_during_a_refused_close_is_not_closed():
    """repr(context) read the context's handle without taking the engine:
    from a second thread while a close the library refused (InUse: the open
    step holds the context) was in flight, it said "<activekv.Context
    closed>" of a context that stayed open. A repr never raises; while
    another thread is in a call on the engine it says nothing of the
    context's state."""
    eng, ctx, probe = _engine_with_probe()
    stream = eng.stream_create()
    eng.step_begin([ctx])
    lease = eng.lease_begin(0)
    lease.wait_ready(stream)
    probe.probe = lambda: repr(ctx)
    with pytest.raises(akv.InUse):
        ctx.close()
    assert probe.result is not None, "the refusal logged nothing"
    assert "error" not in probe.result, probe.result
    assert "closed" not in probe.result["value"], probe.result
    _finish_step(eng, ctx, lease, stream)
    assert repr(ctx) == f"<activekv.Context id={ctx.id} length=3>"
    ctx.close()
    assert repr(ctx) == "<activekv.Context closed>"
    eng.close()
    assert repr(ctx) == "<activekv.Context closed>"


# ------------------------------------------------------------ fork


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork here")
def test_stream_handle_in_a_forked_child_is_refused():
    """In a child forked after the engine was made, every call on it or on
    what was made from it raises BadHandle (docs/python.md); Stream.handle
    answered the parent's stream (a worker thread that is not in the child),
    for the child to hand to the library. It raises BadHandle now, as
    Stream.synchronize does; the parent's stream is untouched."""
    eng = akv.Engine(**small())
    stream = eng.stream_create()
    handle = stream.handle

    def child():
        try:
            stream.handle
            return 2  # answered the parent's handle
        except akv.BadHandle as exc:
            return 0 if "fork" in str(exc) else 3

    assert _in_forked_child(child) == 0
    assert stream.handle == handle
    stream.synchronize()
    stream.destroy()
    eng.close()
