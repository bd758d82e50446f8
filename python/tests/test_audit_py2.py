"""A second outside audit of the Python package: a refused call cut short
by a KeyboardInterrupt as it returns (the status it answered is lost with
the exception), and misuse from outside.

A Ctrl-C is raised by the interpreter right after a foreign call returns;
here a wrapper of the library function raises KeyboardInterrupt right
after the real call (or in place of a refusal the library would have made
with nothing changed). After it the object must still own its handle where
the library kept it, and read as dead only where the library ended it.
Host backend, no GPU needed.
"""
import sys

import numpy as np
import pytest

import activekv as akv
from activekv import _api
from activekv.errors import STATUS_VALUES as ST

from conftest import quiet, small

L, H, D = 3, 2, 8


def rows(n, value=1.0):
    return np.full((L, n, H, D), value, np.float32)


def interrupt_after(monkeypatch, name, answer=None):
    """The next call of library function `name` runs (or, with `answer`,
    answers that status without running: a refusal, nothing changed) and is
    cut short as it returns by a KeyboardInterrupt."""
    real = getattr(_api.lib, name)
    seen = []

    def call(*args):
        monkeypatch.setattr(_api.lib, name, real)
        seen.append(real(*args) if answer is None else answer)
        raise KeyboardInterrupt

    monkeypatch.setattr(_api.lib, name, call)
    return seen


def finish(eng, streams=None):
    """Runs every layer of the open step and ends it."""
    for layer in range(L):
        lease = eng.lease_begin(layer)
        lease.wait_ready(None if streams is None else streams[layer])
        attn = lease.mark_consumed()
        lease.seal(lease.write_back(), attn)
        lease.retire()
    eng.step_end()


# ------------------------------------------- a refusal cut short as it returns


def test_refused_context_close_cut_short_keeps_the_context(monkeypatch, destroys):
    """Context.close of a context the open step holds is refused (InUse),
    nothing changed; cut short as the refusal returned, the context read as
    closed (its handle gone from the object) while the library kept it: its
    rows were lost to the caller, and it stayed open until the engine went."""
    eng = akv.Engine(**small())
    ctx = eng.open_context()
    ctx.append(rows(2), rows(2))
    eng.step_begin([ctx])
    seen = interrupt_after(monkeypatch, "akv_context_close")
    with pytest.raises(KeyboardInterrupt):
        ctx.close()
    assert seen == [ST["AKV_ERR_IN_USE"]]
    assert ctx._handle is not None  # the library kept it: so does the object
    finish(eng)
    assert len(ctx) == 3
    ctx.close()
    assert ctx._handle is None
    a, b = eng.open_context(), eng.open_context()  # both host slots free again
    del a, b
    eng.close()
    assert len(destroys) == 1


def test_context_close_cut_short_after_closing_leaves_it_dead(monkeypatch):
    """The other side: a close that happened, cut short, reads as closed."""
    with akv.Engine(**small()) as eng:
        ctx = eng.open_context()
        seen = interrupt_after(monkeypatch, "akv_context_close")
        with pytest.raises(KeyboardInterrupt):
            ctx.close()
        assert seen == [0]
        assert ctx._handle is None
        with pytest.raises(akv.BadHandle):
            len(ctx)
        eng.open_context().close()
        eng.open_context().close()


def test_refused_stream_destroy_cut_short_keeps_the_stream(monkeypatch, destroys):
    """Stream.destroy of a stream an unretired lease used is refused
    (InUse); cut short as it returned, the stream read as destroyed while
    the library kept it live, and akv_engine_destroy refuses an engine with
    a live stream: close() was refused for good (Busy), the engine, its
    threads and its memory leaked until the process ended."""
    eng = akv.Engine(**small())
    ctx = eng.open_context()
    ctx.append(rows(2), rows(2))
    s = eng.stream_create()
    eng.step_begin([ctx])
    lease = eng.lease_begin(0)
    lease.wait_ready(s)
    seen = interrupt_after(monkeypatch, "akv_stream_destroy")
    with pytest.raises(KeyboardInterrupt):
        s.destroy()
    assert seen == [ST["AKV_ERR_IN_USE"]]
    assert s._handle is not None
    attn = lease.mark_consumed()
    lease.seal(lease.write_back(), attn)
    lease.retire()
    for layer in range(1, L):
        lz = eng.lease_begin(layer)
        lz.wait_ready(s)
        attn = lz.mark_consumed()
        lz.seal(lz.write_back(), attn)
        lz.retire()
    eng.step_end()
    s.synchronize()
    del lease, lz
    eng.close()
    assert len(destroys) == 1


def test_stream_destroy_cut_short_after_destroying_leaves_it_dead(monkeypatch, destroys):
    eng = akv.Engine(**small())
    s = eng.stream_create()
    seen = interrupt_after(monkeypatch, "akv_stream_destroy")
    with pytest.raises(KeyboardInterrupt):
        s.destroy()
    assert seen == [0]
    assert s._handle is None
    got = [eng.stream_create() for _ in range(8)]  # all 8 free again
    del got
    eng.close()
    assert len(destroys) == 1


def test_refused_engine_destroy_cut_short_keeps_the_engine(monkeypatch, destroys):
    """akv_engine_destroy refusing (Busy, nothing freed) as close() calls it,
    cut short as it returned: the engine read as closed with its C engine
    alive, and nothing could free it any more."""
    eng = akv.Engine(**small())
    ctx = eng.open_context()
    interrupt_after(monkeypatch, "akv_engine_destroy", answer=ST["AKV_ERR_BUSY"])
    with pytest.raises(KeyboardInterrupt):
        eng.close()
    assert eng._handle is not None
    assert len(ctx) == 0  # still usable
    eng.close()
    assert len(destroys) == 1


def test_engine_destroy_cut_short_after_destroying_leaves_it_closed(monkeypatch, destroys):
    eng = akv.Engine(**small())
    seen = interrupt_after(monkeypatch, "akv_engine_destroy")
    with pytest.raises(KeyboardInterrupt):
        eng.close()
    assert seen == [0] and len(destroys) == 1
    assert eng._handle is None
    with pytest.raises(akv.BadHandle):
        eng.info()
    eng.close()  # a no-op, never a second destroy


def test_refused_step_begin_cut_short_leaves_no_step_read_as_open(monkeypatch, destroys):
    """step_begin of a context with uneven layers is refused
    (UnevenLayers); cut short as it returned, the engine read as inside a
    step the library never opened: close() was refused (Busy, "a step is
    open") and step_end refused (StepState), for good."""
    eng = akv.Engine(**small())
    ctx = eng.open_context()
    ctx.append_layer(0, rows(1)[0], rows(1)[0])
    seen = interrupt_after(monkeypatch, "akv_step_begin")
    with pytest.raises(KeyboardInterrupt):
        eng.step_begin([ctx])
    assert seen == [ST["AKV_ERR_UNEVEN_LAYERS"]]
    assert not eng._step_open
    del ctx
    eng.close()
    assert len(destroys) == 1


def test_step_begin_cut_short_after_opening_reads_as_open(monkeypatch, destroys):
    eng = akv.Engine(**small())
    ctx = eng.open_context()
    ctx.append(rows(1), rows(1))
    seen = interrupt_after(monkeypatch, "akv_step_begin")
    with pytest.raises(KeyboardInterrupt):
        eng.step_begin([ctx])
    assert seen == [0] and eng._step_open
    with pytest.raises(akv.Busy):
        eng.close()
    finish(eng)
    assert len(ctx) == 2
    del ctx
    eng.close()
    assert len(destroys) == 1


def test_refused_step_end_cut_short_keeps_the_step_open(monkeypatch, destroys):
    """step_end with a lease unretired is refused (StepState); cut short as
    it returned, the engine read as outside a step: close() then destroyed
    the caller's streams before the library refused the destroy (a refused
    close changed things: the caller's Stream was dead)."""
    eng = akv.Engine(**small())
    ctx = eng.open_context()
    ctx.append(rows(1), rows(1))
    spare = eng.stream_create()
    eng.step_begin([ctx])
    lease = eng.lease_begin(0)
    lease.wait_ready()
    seen = interrupt_after(monkeypatch, "akv_step_end")
    with pytest.raises(KeyboardInterrupt):
        eng.step_end()
    assert seen == [ST["AKV_ERR_STEP_STATE"]]
    assert eng._step_open
    with pytest.raises(akv.Busy):
        eng.close()
    assert spare._handle is not None
    spare.synchronize()
    attn = lease.mark_consumed()
    lease.seal(lease.write_back(), attn)
    lease.retire()
    for layer in range(1, L):
        lz = eng.lease_begin(layer)
        lz.wait_ready()
        attn = lz.mark_consumed()
        lz.seal(lz.write_back(), attn)
        lz.retire()
    eng.step_end()
    del lease, lz, ctx
    eng.close()
    assert len(destroys) == 1


def test_step_end_cut_short_after_ending_reads_as_closed(monkeypatch, destroys):
    eng = akv.Engine(**small())
    ctx = eng.open_context()
    ctx.append(rows(1), rows(1))
    eng.step_begin([ctx])
    for layer in range(L):
        lease = eng.lease_begin(layer)
        lease.wait_ready()
        attn = lease.mark_consumed()
        lease.seal(lease.write_back(), attn)
        lease.retire()
    seen = interrupt_after(monkeypatch, "akv_step_end")
    with pytest.raises(KeyboardInterrupt):
        eng.step_end()
    assert seen == [0] and not eng._step_open
    assert len(ctx) == 2
    del ctx, lease
    eng.close()
    assert len(destroys) == 1


# ------------------------------------- the same refusals, cut short anywhere


def _stepping():
    eng = akv.Engine(**small())
    ctx = eng.open_context()
    ctx.append(rows(1), rows(1))
    return eng, ctx


def _refusal_scenarios():
    """name -> (set up, the refused call, check after it, finish): every
    refusal changes nothing, so after an interrupt anywhere in it the
    engine is what it was before the call."""

    def ctx_close_in_step():
        eng, ctx = _stepping()
        eng.step_begin([ctx])
        return eng, {"ctx": ctx}, ctx.close

    def stream_in_use():
        eng, ctx = _stepping()
        s = eng.stream_create()
        eng.step_begin([ctx])
        lease = eng.lease_begin(0)
        lease.wait_ready(s)
        return eng, {"ctx": ctx, "s": s, "lease": lease}, s.destroy

    def uneven_step_begin():
        eng = akv.Engine(**small())
        ctx = eng.open_context()
        ctx.append_layer(0, rows(1)[0], rows(1)[0])
        return eng, {"ctx": ctx}, lambda: eng.step_begin([ctx])

    def early_step_end():
        eng, ctx = _stepping()
        spare = eng.stream_create()
        eng.step_begin([ctx])
        lease = eng.lease_begin(0)
        lease.wait_ready()
        return eng, {"ctx": ctx, "spare": spare, "lease": lease}, eng.step_end

    def close_in_step():
        eng, ctx = _stepping()
        spare = eng.stream_create()
        eng.step_begin([ctx])
        return eng, {"ctx": ctx, "spare": spare}, eng.close

    return {"context_close": ctx_close_in_step, "stream_destroy": stream_in_use,
            "step_begin": uneven_step_begin, "step_end": early_step_end,
            "engine_close": close_in_step}


@pytest.mark.parametrize("what", ["context_close", "stream_destroy", "step_begin", "step_end",
                                  "engine_close"])
def test_a_refusal_cut_short_anywhere_changes_nothing(monkeypatch, what):
    from test_interrupt_points import every_point

    make = _refusal_scenarios()[what]

    def scenario(it, n):
        eng, objs, call = make()
        step_open = eng._step_open
        with it.at(n):
            with pytest.raises(akv.ActiveKVError):
                call()
        # refused, cut short or not: every object keeps what it had
        assert eng._handle is not None and eng._step_open == step_open
        for name in ("ctx", "s", "spare"):
            if name in objs:
                assert objs[name]._handle is not None, name
        assert not eng._slot
        if "s" in objs or "spare" in objs:
            (objs.get("s") or objs["spare"]).synchronize()
        ctx = objs["ctx"]
        if what == "step_begin":
            ctx.append_layer(1, rows(1)[0], rows(1)[0])
            ctx.append_layer(2, rows(1)[0], rows(1)[0])
            eng.step_begin([ctx])
        lease = objs.pop("lease", None)
        for layer in range(L):
            lz = lease if (layer == 0 and lease is not None) else eng.lease_begin(layer)
            if lz is not lease:
                lz.wait_ready(objs.get("s"))
            attn = lz.mark_consumed()
            lz.seal(lz.write_back(), attn)
            lz.retire()
        eng.step_end()
        assert len(ctx) == 2
        objs.clear()
        del lease, lz, ctx
        eng.close()
        assert len(it.destroyed) == len(it.creates)

    every_point(monkeypatch, scenario)


@pytest.mark.parametrize("call", ["wait_ready", "mark_consumed", "write_back"])
def test_a_refused_second_lease_call_cut_short_keeps_the_first_result(monkeypatch, call):
    """A second wait_ready / mark_consumed / write_back is refused
    (LeaseState) and leaves what the first returned for Lease.view,
    .attention and .tail; cut short as the refusal returned, the lease
    gave None instead (the unfilled struct of the refused call), and a
    caller that lost the first result (an earlier interrupt) could no
    longer seal the lease."""
    with akv.Engine(**small()) as eng:
        ctx = eng.open_context()
        ctx.append(rows(1), rows(1))
        eng.step_begin([ctx])
        lease = eng.lease_begin(0)
        view = lease.wait_ready()
        attn = lease.mark_consumed()
        tail = lease.write_back()
        fn = {"wait_ready": "akv_lease_wait_ready", "mark_consumed": "akv_lease_mark_consumed",
              "write_back": "akv_lease_write_back"}[call]
        seen = interrupt_after(monkeypatch, fn)
        with pytest.raises(KeyboardInterrupt):
            getattr(lease, call)()
        assert seen == [ST["AKV_ERR_LEASE_STATE"]]
        assert lease.view is not None and lease.view.len == view.len
        assert lease.attention == attn and lease.tail == tail
        lease.seal(lease.tail, lease.attention)
        lease.retire()
        finish_from(eng, 1)
        assert len(ctx) == 2


def finish_from(eng, first):
    for layer in range(first, L):
        lease = eng.lease_begin(layer)
        lease.wait_ready()
        attn = lease.mark_consumed()
        lease.seal(lease.write_back(), attn)
        lease.retire()
    eng.step_end()


# ------------------------------------------------------ the transformers adapter


def _needs_adapter():
    """Skips (shown) where torch or transformers is missing: the adapter's
    module cannot be imported there."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")


def _deep_cache(layers=6, **kw):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers import LlamaConfig

    _needs_adapter()
    from activekv.transformers import ActiveKVCache

    cfg = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=8)
    kw = dict(dict(device="cpu", dtype=torch.float32, max_cache_len=16, page_tokens=4,
                   log=quiet), **kw)
    return torch, ActiveKVCache(config=cfg, **kw)


def _decode(cache, torch, steps, seed=0):
    """Prefill and `steps` decode steps; an update cut short by a
    KeyboardInterrupt is made again unless the layer's length shows it
    happened. Returns how many were cut short."""
    n, cut = len(cache.layers), 0
    for step in range(steps):
        for layer in range(n):
            g = torch.Generator().manual_seed(seed + 100 * step + layer)
            before = cache.layers[layer].get_seq_length()
            t = 3 if before == 0 else 1
            k, v = torch.randn(1, 2, t, 8, generator=g), torch.randn(1, 2, t, 8, generator=g)
            try:
                cache.update(k, v, layer)
            except KeyboardInterrupt:
                cut += 1
                if cache.layers[layer].get_seq_length() == before:
                    cache.update(k, v, layer)
    return cut


@pytest.mark.parametrize("call", ["try_retire", "retire"])
@pytest.mark.parametrize("answer", ["refused", "done"])
def test_cache_retire_cut_short_loses_no_lease(call, answer):
    """The adapter takes a sealed lease off its list before akv_lease_try_retire
    (or akv_lease_retire at the step boundary) and puts it back when the call
    refused ("not ready", common for try_retire); cut short as such a refusal
    returned, the lease stayed off the list unretired, and every later step
    boundary was refused (StepState) until the cache was closed."""
    _needs_adapter()
    from activekv.transformers import _NOT_READY

    torch, cache = _deep_cache()
    with cache:
        drv = cache._driver
        if call == "try_retire" and not drv.try_retire_ok:
            pytest.skip("a library without akv_lease_try_retire")
        real = getattr(drv.api, call)
        fired = []

        def once(lease, ref):
            if fired:  # the interrupt is injected once
                return real(lease, ref)
            setattr(drv.api, call, real)
            if answer == "done":
                fired.append(real(lease, ref))
            else:
                # refused, nothing changed: "not ready", or for retire a lease
                # state the library would refuse (here answered without the call)
                fired.append(_NOT_READY if call == "try_retire" else ST["AKV_ERR_LEASE_STATE"])
            raise KeyboardInterrupt

        setattr(drv.api, call, once)
        assert _decode(cache, torch, 4) == 1
        assert len(fired) == 1
        leases = drv.leases
        assert drv.failed is None
        # every lease begun is retired or on the list: the step can end
        cache.finish()
        assert not cache.engine._step_open and not drv.sealed
        assert [len(c) for c in cache.contexts] == [cache.layers[0].get_seq_length()]
        assert drv.leases == leases


# ------------------------------------- cut short between any two bytecodes


class OpcodeInterrupter:
    """Raises KeyboardInterrupt before the n-th bytecode executed in the
    given functions of the package (their own frames): stricter than the
    points where the interpreter raises one (test_interrupt_points), so
    every bytecode between clearing a handle and putting it back is tried.

    Python 3.12 and later count instructions through sys.monitoring: there,
    opcode events asked for from a sys.settrace call event (f_trace_opcodes)
    are not delivered to a frame entered below the function that installed
    the trace, so the sweep would never fire and test nothing. 3.11 takes
    the settrace route."""

    def __init__(self, codes):
        self.codes = {c.__code__ if hasattr(c, "__code__") else c for c in codes}
        self.n = self.seen = 0
        self.fired = False

    # -- 3.11: sys.settrace opcode events
    def _local(self, frame, event, arg):
        if event == "opcode":
            self.seen += 1
            if self.seen == self.n:
                sys.settrace(None)
                frame.f_trace = None
                self.fired = True
                raise KeyboardInterrupt
        return self._local

    def _global(self, frame, event, arg):
        if frame.f_code in self.codes:
            frame.f_trace_opcodes = True
            return self._local
        return None

    # -- 3.12+: sys.monitoring instruction events on the given code objects
    def _instruction(self, code, offset):
        self.seen += 1
        if self.seen == self.n:
            self._monitor(0)
            self.fired = True
            raise KeyboardInterrupt

    def _monitor(self, events):
        for code in self.codes:
            sys.monitoring.set_local_events(self.tool, code, events)

    def _run(self, fn):
        try:
            fn()
        except KeyboardInterrupt:
            assert self.fired
        except akv.ActiveKVError:
            pass  # the refusal itself

    def run(self, n, fn):
        self.n, self.seen, self.fired = n, 0, False
        mon = getattr(sys, "monitoring", None)
        if mon is None:
            sys.settrace(self._global)
            try:
                self._run(fn)
            finally:
                sys.settrace(None)
            return
        self.tool = next(t for t in (3, 4, 0, 1, 2, 5) if mon.get_tool(t) is None)
        mon.use_tool_id(self.tool, "activekv-opcode-interrupter")
        try:
            mon.register_callback(self.tool, mon.events.INSTRUCTION, self._instruction)
            self._monitor(mon.events.INSTRUCTION)
            self._run(fn)
        finally:
            self._monitor(0)
            mon.register_callback(self.tool, mon.events.INSTRUCTION, None)
            mon.free_tool_id(self.tool)


def _unwrap(fn):
    return getattr(fn, "__wrapped__", fn)


def _stream_alive(eng, h):
    return _api.lib.akv_stream_synchronize(eng._handle, h) != ST["AKV_ERR_INVALID_ARGUMENT"]


def _ending_cases():
    """name -> (the functions swept, set up -> (engine, call, check)); check
    asserts that the objects agree with the library after the call, cut
    short or not, and brings the engine to where it closes."""

    def context(refused):
        eng, ctx = _stepping()
        if refused:
            eng.step_begin([ctx])
        h = ctx._handle

        def check():
            assert (ctx._handle is not None) == _api._context_alive(h)
            if refused:
                assert ctx._handle is not None
                finish(eng)
                ctx.close()
        return eng, ctx.close, check

    def stream(refused):
        eng, ctx = _stepping()
        s = eng.stream_create()
        lease = None
        if refused:
            eng.step_begin([ctx])
            lease = eng.lease_begin(0)
            lease.wait_ready(s)
        h = s._handle

        def check():
            assert (s._handle is not None) == _stream_alive(eng, h)
            if refused:
                assert s._handle is not None
                attn = lease.mark_consumed()
                lease.seal(lease.write_back(), attn)
                lease.retire()
                finish_from(eng, 1)
        return eng, s.destroy, check

    def step_begin(refused):
        eng, ctx = _stepping()
        if refused:
            ctx.append_layer(0, rows(1)[0], rows(1)[0])

        def check():
            assert eng._step_open == _api._step_open_now(eng._handle, None)
            if eng._step_open:
                finish(eng)
        return eng, lambda: eng.step_begin([ctx]), check

    def step_end(refused):
        eng, ctx = _stepping()
        eng.step_begin([ctx])
        first = 1 if refused else L
        for layer in range(first):
            lease = eng.lease_begin(layer)
            lease.wait_ready()
            attn = lease.mark_consumed()
            lease.seal(lease.write_back(), attn)
            lease.retire()

        def check():
            assert eng._step_open == _api._step_open_now(eng._handle, None)
            if eng._step_open:
                finish_from(eng, first)
        return eng, eng.step_end, check

    def retire(refused):
        eng, ctx = _stepping()
        eng.step_begin([ctx])
        lease = eng.lease_begin(0)
        lease.wait_ready()
        if not refused:
            attn = lease.mark_consumed()
            lease.seal(lease.write_back(), attn)
        h = lease._handle

        def check():
            # a seal with no fences: refused either way, changing nothing
            zero = _api.L.akv_fence(0)
            dead = _api.lib.akv_lease_seal(h, zero, zero) == ST["AKV_ERR_BAD_HANDLE"]
            assert (lease._handle is None) == dead
            if not dead:
                if refused:
                    attn = lease.mark_consumed()
                    lease.seal(lease.write_back(), attn)
                lease.retire()
            finish_from(eng, 1)
        return eng, lease.retire, check

    return {
        "context_close": ([_unwrap(akv.Context.close)], context),
        "stream_destroy": ([_unwrap(akv.Stream.destroy), akv.Engine._stream_destroy], stream),
        "step_begin": ([_unwrap(akv.Engine.step_begin)], step_begin),
        "step_end": ([_unwrap(akv.Engine.step_end)], step_end),
        "retire": ([_unwrap(akv.Lease.retire), akv.Lease._retire_with], retire),
    }


@pytest.mark.parametrize("refused", [True, False], ids=["refused", "done"])
@pytest.mark.parametrize("what", ["context_close", "stream_destroy", "step_begin", "step_end",
                                  "retire"])
def test_an_ending_call_cut_short_at_any_bytecode_agrees_with_the_library(what, refused):
    codes, make = _ending_cases()[what]
    it = OpcodeInterrupter(codes)
    for n in range(1, 2000):
        eng, call, check = make(refused)
        it.run(n, call)
        check()
        eng.close()
        assert eng._handle is None
        if not it.fired:
            assert n > 10
            return
    pytest.fail("never completed")


@pytest.mark.parametrize("refused", [True, False], ids=["refused", "done"])
def test_engine_close_cut_short_at_any_bytecode_agrees_with_the_library(refused, monkeypatch):
    """Engine.close's own bytecodes, with akv_engine_destroy refusing (the
    library's answer with nothing changed) or destroying."""
    it = OpcodeInterrupter([_unwrap(akv.Engine.close)])
    real = _api.lib.akv_engine_destroy
    for n in range(1, 2000):
        eng = akv.Engine(**small())
        eng.stream_create()
        h = eng._handle
        if refused:
            monkeypatch.setattr(_api.lib, "akv_engine_destroy", lambda h: ST["AKV_ERR_BUSY"])
        it.run(n, eng.close)
        monkeypatch.setattr(_api.lib, "akv_engine_destroy", real)
        assert (eng._handle is not None) == _api._engine_alive(h)
        eng.close()
        assert eng._handle is None and not _api._engine_alive(h)
        if not it.fired:
            assert n > 10
            return
    pytest.fail("never completed")


@pytest.mark.parametrize("what", ["finish", "try_retire", "try_retire_not_ready"])
def test_cache_retires_cut_short_at_any_bytecode_lose_no_lease(what):
    """The adapter's retire_all (at finish) and try_retire, cut short between
    any two of their bytecodes: every lease is retired or still listed, so
    the step ends and the cache goes on."""
    _needs_adapter()
    from activekv.transformers import _Driver, _NOT_READY

    it = OpcodeInterrupter([_Driver.retire_all, _Driver.try_retire, _Driver.end_step])
    for n in range(1, 3000):
        torch, cache = _deep_cache()
        with cache:
            drv = cache._driver
            if what != "finish" and not drv.try_retire_ok:
                pytest.skip("a library without akv_lease_try_retire")
            _decode(cache, torch, 2)
            drv.seal_pending()
            assert len(drv.sealed) >= 2
            if what == "finish":
                it.run(n, cache.finish)
            else:
                if what == "try_retire_not_ready":
                    drv.api.try_retire = lambda lease, ref: _NOT_READY
                it.run(n, drv.try_retire)
            drv.api = type(drv.api)(akv.library_path())  # the real calls again
            assert drv.failed is None
            cache.finish()
            assert not cache.engine._step_open and not drv.sealed
            assert [len(c) for c in cache.contexts] == [cache.layers[0].get_seq_length()]
            _decode(cache, torch, 2, seed=7)  # and it goes on
            cache.finish()
        if not it.fired:
            assert n > 10
            return
    pytest.fail("never completed")


@pytest.mark.parametrize("layout", ["sparse", "mkldnn"])
def test_cache_takes_sparse_and_mkldnn_kv_by_their_values(layout):
    """A sparse (or mkldnn) K/V of the right shape, dtype and device passes
    the decode checks; copy_ then refused it after the lease began, with a
    RuntimeError, and the cache was unusable for good (Quarantined). The
    prefill refused it with torch's RuntimeError. Both now take its dense
    values: the rows are those of the dense tensors."""
    torch = pytest.importorskip("torch")
    conv = {"sparse": lambda t: t.to_sparse(), "mkldnn": lambda t: t.to_mkldnn()}[layout]
    if layout == "mkldnn" and not torch.backends.mkldnn.is_available():
        pytest.skip("no mkldnn")

    def run(odd):
        _, cache = _deep_cache(layers=2)
        with cache:
            g = torch.Generator().manual_seed(3)
            for step in range(3):
                for layer in range(2):
                    t = 3 if step == 0 else 1
                    k = torch.randn(1, 2, t, 8, generator=g)
                    v = torch.randn(1, 2, t, 8, generator=g)
                    if odd:
                        k, v = conv(k), conv(v)
                    out_k, out_v = cache.update(k, v, layer)
                    assert out_k.shape[2] == cache.layers[layer].get_seq_length()
            cache.finish()
            return [cache.contexts[0].read(d, 0, 5) for d in range(2)]

    want, got = run(False), run(True)
    for (wk, wv), (gk, gv) in zip(want, got):
        assert np.array_equal(wk, gk) and np.array_equal(wv, gv)


def test_a_dropped_context_whose_refused_close_is_cut_short_is_closed_at_the_step_end(
        monkeypatch):
    """A context dropped while the open step holds it is closed when the step
    ends (its refused close puts it on the engine's orphans). A Ctrl-C
    landing as that refusal returned, in the finalizer, skipped the orphans:
    nothing could close it any more and its host slot was lost until the
    engine went (open_context refused with RefusedQueue)."""
    with akv.Engine(**small()) as eng:
        ctx = eng.open_context()
        ctx.append(rows(1), rows(1))
        eng.step_begin([ctx])
        seen = interrupt_after(monkeypatch, "akv_context_close")
        hook, sys.unraisablehook = sys.unraisablehook, lambda args: None
        try:
            del ctx  # its finalizer: refused (InUse), cut short
        finally:
            sys.unraisablehook = hook
        assert seen == [ST["AKV_ERR_IN_USE"]]
        finish(eng)
        a, b = eng.open_context(), eng.open_context()  # both host slots free again
        a.close()
        b.close()


def test_the_deferred_destroy_cut_short_at_any_bytecode_is_not_lost():
    """close() with a zero-copy array alive defers the engine's destroy to
    the array's end (_Memory.destroy_pending); cut short between taking the
    pending handle and the destroy, the engine was never freed."""
    it = OpcodeInterrupter([_api._Memory.destroy_pending, _api._Export.__del__])
    for n in range(1, 2000):
        eng, ctx = _stepping()
        eng.step_begin([ctx])
        lease = eng.lease_begin(0)
        keys = lease.wait_ready().keys(0)
        attn = lease.mark_consumed()
        lease.seal(lease.write_back(), attn)
        lease.retire()
        finish_from(eng, 1)
        del lease, ctx
        eng.close()
        h, mem = eng._pending_destroy["h"], eng._mem
        assert _api._engine_alive(h)
        held = [keys]
        del keys
        hook, sys.unraisablehook = sys.unraisablehook, lambda args: None
        try:
            it.run(n, held.clear)  # the array's end: the deferred destroy
        finally:
            sys.unraisablehook = hook
        # destroyed, or still pending (made at the memory's end at the latest)
        assert (not _api._engine_alive(h)) or mem.pending.get("h") == h
        del eng
        mem.destroy_pending()
        assert not _api._engine_alive(h)
        if not it.fired:
            assert n > 5
            return
    pytest.fail("never completed")


def test_a_context_dropped_while_another_thread_is_in_a_call_gives_its_slot_back():
    """A context dropped (its finalizer) while another thread is in a call
    on the engine cannot close then (Busy); it was left to the engine's
    destroy, and its host slot stayed taken for the engine's whole life
    (open_context refused, RefusedQueue, with nobody holding a context)."""
    from conftest import held_by_another_thread

    with akv.Engine(**small()) as eng:
        ctx = eng.open_context()
        with held_by_another_thread(eng):
            del ctx
        a, b = eng.open_context(), eng.open_context()  # both host slots free
        a.close()
        b.close()
        assert not eng._orphans
