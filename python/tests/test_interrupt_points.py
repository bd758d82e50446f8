"""Every point where a Ctrl-C can land inside a call of the package, tried
one at a time.

A KeyboardInterrupt is raised by the interpreter at a function's start and
right after a builtin or foreign call returns. Each test runs one
operation with an interrupt injected at the n-th such point (n = 1, 2, ...
until the operation completes uninterrupted): a profile hook raises it at
a function of the package starting or a builtin it called returning (not
inside a log callback, whose exceptions cannot leave it), and a wrapper of
every library function right after the real call returns. After each
interrupt the engine must be brought to its end by what a caller can see
(the objects it holds, what a lease kept, retried calls), without a
quarantine except for a cache that says it is unusable, and every engine
the library made must be destroyed: no
handle lost, no state read wrong, no rows other than an uninterrupted
run's. Host backend, no GPU needed.
"""
import contextlib
import os
import sys

import numpy as np
import pytest

import activekv as akv
from activekv import _api, _lib

from conftest import small

L, H, D = 3, 2, 8
MAX_POINTS = 400  # far above any operation here: an endless loop fails instead


def rows(rng, n):
    return rng.standard_normal((L, n, H, D)).astype(np.float32)


_SINK = _api._LogSink.__call__.__code__
_PACKAGE = os.path.dirname(_api.__file__)


def _in_log_callback(frame):
    """Inside an engine's log callback: an exception cannot leave a ctypes
    callback (it is reported as unraisable and the library goes on), so a
    Ctrl-C there is the callback's own (_LogSink holds one raised by the
    logger for the engine call). Not injected there."""
    while frame is not None:
        if frame.f_code is _SINK:
            return True
        frame = frame.f_back
    return False


class Interrupter:
    """Counts the interruption points of an armed block and raises
    KeyboardInterrupt at the n-th."""

    def __init__(self, monkeypatch):
        self.n = 0
        self.seen = 0
        self.armed_now = False
        self.fired = False
        self.creates = []  # engines the library made
        self.destroyed = []
        names = list(_lib._PROTOTYPES) + [k for k in _lib._OPTIONAL if _lib.has_symbol(k)]
        for name in names:
            monkeypatch.setattr(_api.lib, name, self._wrap(name, getattr(_api.lib, name)))

    def _wrap(self, name, real):
        def call(*args):
            st = real(*args)
            if name == "akv_engine_create" and st == 0:
                self.creates.append(args)
            if name == "akv_engine_destroy" and st == 0:
                self.destroyed.append(args[0])
            if self.armed_now:
                self.tick()  # right after the library returned
            return st

        return call

    def tick(self):
        self.seen += 1
        if self.seen == self.n:
            self.armed_now = False
            sys.setprofile(None)
            self.fired = True
            raise KeyboardInterrupt

    def _profile(self, frame, event, arg):
        # the package's own points: a function of it starting, a builtin it
        # called returning (the test's and contextlib's frames are not part
        # of the operation)
        if event in ("call", "c_return") and frame.f_code.co_filename.startswith(_PACKAGE) \
                and not _in_log_callback(frame):
            self.tick()

    @contextlib.contextmanager
    def at(self, n):
        """Runs the block with the interrupt armed at point n; a
        KeyboardInterrupt it raises is swallowed (self.fired says whether
        one was)."""
        self.n, self.seen, self.fired = n, 0, False
        self.armed_now = True
        # An interrupt landing in a finalizer is unraisable: Python's own
        # hook prints it and lets it go; pytest's keeps its traceback, whose
        # frames would hold the finalized object alive. Let go here.
        hook, sys.unraisablehook = sys.unraisablehook, lambda args: None
        sys.setprofile(self._profile)
        try:
            yield
        except KeyboardInterrupt:
            assert self.fired
        finally:
            sys.setprofile(None)
            sys.unraisablehook = hook
            self.armed_now = False


def every_point(monkeypatch, scenario):
    """Runs scenario(it, n) for n = 1, 2, ... until an uninterrupted run."""
    it = Interrupter(monkeypatch)
    for n in range(1, MAX_POINTS):
        scenario(it, n)
        if not it.fired:
            assert n > 3  # the operation has points of its own: the hook reached them
            print("interruption points:", n - 1)
            return n
    pytest.fail("the operation did not complete within %d interruption points" % MAX_POINTS)


def finish_step(eng, lease0=None, first=0):
    """Runs the open step's layers from `first` (lease0: that layer's lease
    if the caller holds it) and ends the step."""
    for layer in range(first, L):
        lease = lease0 if (lease0 is not None and layer == first) else eng.lease_begin(layer)
        view = lease.wait_ready()
        for i in range(view.n_contexts):
            view.keys(i)[-1] = float(layer)
            view.values(i)[-1] = -float(layer)
        del view
        attn = lease.mark_consumed()
        lease.seal(lease.write_back(), attn)
        lease.retire()
    eng.step_end()


def check_end(it, eng, steps):
    """The engine ran `steps` steps, was never quarantined, and closes."""
    info = eng.info()
    assert info.steps == steps and not info.quarantined
    assert not eng._slot  # no call left holding the engine
    eng.close()
    assert len(it.destroyed) == len(it.creates)


def test_engine_create(monkeypatch):
    def scenario(it, n):
        eng = None
        with it.at(n):
            eng = akv.Engine(**small())
        if eng is not None:
            eng.close()
        del eng
        assert len(it.destroyed) == len(it.creates)

    every_point(monkeypatch, scenario)


def test_open_context(monkeypatch):
    def scenario(it, n):
        eng = akv.Engine(**small())
        got = []
        with it.at(n):
            got.append(eng.open_context())
        while True:  # every host slot is free or held by what the caller got
            try:
                got.append(eng.open_context())
            except akv.RefusedQueue:
                break
        assert len(got) == 2
        rng = np.random.default_rng(n)
        for c in got:
            c.append(rows(rng, 1), rows(rng, 1))
        eng.step_begin(got)
        finish_step(eng)
        del got, c
        check_end(it, eng, 1)

    every_point(monkeypatch, scenario)


@pytest.mark.parametrize("default", [False, True])
def test_stream_create(monkeypatch, default):
    def scenario(it, n):
        eng = akv.Engine(**small())
        got = []
        with it.at(n):
            got.append(eng.default_stream() if default else eng.stream_create())
        while True:
            try:
                got.append(eng.stream_create())
            except akv.OutOfMemory:
                break
        live = {s._handle for s in got} | {b.value for b in eng._streams if b.value}
        assert len(live) == 8  # none lost: each is the caller's or the engine's
        del got
        check_end(it, eng, 0)

    every_point(monkeypatch, scenario)


def _stepping(n):
    eng = akv.Engine(**small())
    ctx = eng.open_context()
    rng = np.random.default_rng(n)
    ctx.append(rows(rng, 2), rows(rng, 2))
    return eng, ctx


def test_step_begin(monkeypatch):
    def scenario(it, n):
        eng, ctx = _stepping(n)
        with it.at(n):
            eng.step_begin([ctx])
        if not eng._step_open:
            eng.step_begin([ctx])
        finish_step(eng)
        assert len(ctx) == 3
        check_end(it, eng, 1)

    every_point(monkeypatch, scenario)


def test_lease_begin(monkeypatch):
    def scenario(it, n):
        eng, ctx = _stepping(n)
        eng.step_begin([ctx])
        got = []
        with it.at(n):
            got.append(eng.lease_begin(0))
        finish_step(eng, got[0] if got else eng.lease_begin(0))
        del got
        check_end(it, eng, 1)

    every_point(monkeypatch, scenario)


@pytest.mark.parametrize("op", ["wait_ready", "mark_consumed", "write_back", "seal", "retire",
                                "try_retire"])
def test_lease_calls(monkeypatch, op):
    """A lease call cut short, and the step ends normally. Where the lease
    shows the call did not happen, it is made again; where it did, the
    library refuses it a second time (LeaseState), and what it returned
    (the view, a fence) the lease gives again (Lease.view, .attention,
    .tail); a retire that happened left the lease dead."""
    def scenario(it, n):
        eng, ctx = _stepping(n)
        eng.step_begin([ctx])
        lease = eng.lease_begin(0)
        stream = eng.default_stream()
        kept = {"wait_ready": lambda: lease.view, "mark_consumed": lambda: lease.attention,
                "write_back": lambda: lease.tail, "seal": lambda: None}
        calls = [("wait_ready", lambda: lease.wait_ready(stream)),
                 ("mark_consumed", lambda: lease.mark_consumed()),
                 ("write_back", lambda: lease.write_back()),
                 ("seal", lambda: lease.seal(got["write_back"], got["mark_consumed"])),
                 ("retire", lambda: lease.retire()) if op != "try_retire" else
                 ("try_retire", lambda: lease.try_retire() or lease.retire())]
        got = {}
        for name, fn in calls:
            if name != op:
                got[name] = fn()
                continue
            with it.at(n):
                got[name] = fn()
            if name in got:
                continue
            if name in ("retire", "try_retire") and lease._handle is None:
                continue  # it happened: the lease is dead (_Ending)
            if name in kept and name != "seal" and kept[name]() is not None:
                got[name] = kept[name]()  # it happened: the lease kept what it returned
                with pytest.raises(akv.LeaseState):
                    fn()  # and the library refuses it again
                continue
            try:
                got[name] = fn()  # it did not happen: made again
            except akv.LeaseState:
                assert name == "seal"  # "is sealed": it happened
        if op == "wait_ready":
            view = got["wait_ready"]
            assert view.n_contexts == 1 and view.len == [2]
        del got, calls, kept
        finish_step(eng, first=1)
        check_end(it, eng, 1)

    every_point(monkeypatch, scenario)


def test_step_end(monkeypatch):
    def scenario(it, n):
        eng, ctx = _stepping(n)
        eng.step_begin([ctx])
        for layer in range(L):
            lease = eng.lease_begin(layer)
            lease.wait_ready()
            attn = lease.mark_consumed()
            lease.seal(lease.write_back(), attn)
            lease.retire()
        with it.at(n):
            eng.step_end()
        if eng._step_open:
            eng.step_end()
        assert len(ctx) == 3
        check_end(it, eng, 1)

    every_point(monkeypatch, scenario)


@pytest.mark.parametrize("what", ["context", "stream"])
def test_close_and_destroy(monkeypatch, what):
    def scenario(it, n):
        eng = akv.Engine(**small())
        obj = eng.open_context() if what == "context" else eng.stream_create()
        with it.at(n):
            obj.close() if what == "context" else obj.destroy()
        if obj._handle is not None:
            obj.close() if what == "context" else obj.destroy()
        if what == "context":
            a, b = eng.open_context(), eng.open_context()  # both slots free
            a.close()
            b.close()
        else:
            got = [eng.stream_create() for _ in range(8)]
            del got
        check_end(it, eng, 0)

    every_point(monkeypatch, scenario)


def test_engine_close(monkeypatch):
    def scenario(it, n):
        eng, ctx = _stepping(n)
        eng.stream_create()
        with it.at(n):
            eng.close()
        if eng._handle is not None:
            eng.close()
        assert len(it.destroyed) == len(it.creates)

    every_point(monkeypatch, scenario)


def test_quarantine(monkeypatch):
    def scenario(it, n):
        eng, ctx = _stepping(n)
        eng.step_begin([ctx])
        eng.lease_begin(0).wait_ready()
        with it.at(n):
            eng.quarantine()
        if not eng._quarantined:
            eng.quarantine()
        eng.close()
        assert len(it.destroyed) == len(it.creates)

    every_point(monkeypatch, scenario)


@pytest.mark.parametrize("hybrid", [False, True])
@pytest.mark.parametrize("at", ["prefill", "boundary", "layer"])
def test_cache_update(monkeypatch, hybrid, at):
    """An ActiveKVCache update cut short at each point, and retried unless
    the layer's length shows it happened: the run goes on and the rows are
    an uninterrupted run's, or the cache says it is unusable (naming the
    interrupt); in every case close() frees its engine."""
    pytest.importorskip("transformers")
    from test_misuse import _cache, _kv

    def run(cache, torch, it=None, n=0):
        layers = range(len(cache.layers))
        dense = cache.dense_layers
        target = {"prefill": (-1, dense[0]), "boundary": (1, dense[0]),
                  "layer": (1, dense[-1])}[at]
        for step in range(-1, 3):
            for layer in layers:
                kv = _kv(torch, 1, 3 if step < 0 else 1, seed=100 * (step + 1) + layer)
                if it is not None and (step, layer) == target:
                    before = cache.layers[layer].get_seq_length()
                    with it.at(n):
                        cache.update(*kv, layer)
                    # retried when it did not happen, as a caller can tell (the
                    # layer's length; a completed update retried would be a
                    # second token, which the cache cannot tell from the next)
                    if it.fired and cache.layers[layer].get_seq_length() == before:
                        try:
                            cache.update(*kv, layer)
                        except akv.Quarantined as exc:
                            assert "KeyboardInterrupt" in str(exc)
                            return None
                    continue
                cache.update(*kv, layer)
        cache.finish()
        ctx = cache.contexts[0]
        return [ctx.read(d, 0, 6) for d in range(len(dense))]

    torch, ref = _cache(hybrid=hybrid)
    with ref:
        want = run(ref, torch)

    def scenario(it, n):
        torch, cache = _cache(hybrid=hybrid)
        got = run(cache, torch, it, n)
        if got is not None:
            for (wk, wv), (gk, gv) in zip(want, got):
                assert np.array_equal(wk, gk) and np.array_equal(wv, gv)
        assert not cache.engine._slot
        cache.close()
        assert len(it.destroyed) == len(it.creates)

    every_point(monkeypatch, scenario)


def test_engine_abandoned_mid_step(monkeypatch):
    """A with block left by an exception mid-step quarantines and frees the
    engine (_close_abandoning); cut short, closing again frees it."""
    def scenario(it, n):
        eng, ctx = _stepping(n)
        eng.step_begin([ctx])
        eng.lease_begin(0).wait_ready()
        with it.at(n):
            eng._close_abandoning()
        if eng._handle is not None:
            eng._close_abandoning()
        assert len(it.destroyed) == len(it.creates)

    every_point(monkeypatch, scenario)


@pytest.mark.parametrize("call", ["close", "finish"])
def test_cache_close_and_finish(monkeypatch, call):
    """ActiveKVCache.close() or finish() mid-decode, cut short at each point:
    calling it again completes it, and close() frees the engine."""
    pytest.importorskip("transformers")
    from test_misuse import _cache, _kv

    def scenario(it, n):
        torch, cache = _cache()
        for step in range(-1, 2):
            for layer in range(2):
                cache.update(*_kv(torch, 1, 3 if step < 0 else 1, seed=step + layer), layer)
        with it.at(n):
            getattr(cache, call)()
        if call == "finish" and cache.engine is not None and not cache._driver.failed:
            try:
                cache.finish()
            except akv.StepState:
                pass  # a step cut short between its layers: close() ends it
        assert cache.engine is None or not cache.engine._slot
        cache.close()
        cache.close()
        assert len(it.destroyed) == len(it.creates)

    every_point(monkeypatch, scenario)


def test_cache_forward_hook(monkeypatch):
    """The forward hook's seal (hooks=True), cut short at each point: the
    run goes on (the next update seals what the hook did not) with the rows
    of an uninterrupted run, or the cache says it is unusable; close()
    frees the engine either way."""
    pytest.importorskip("transformers")
    from test_misuse import _cache, _kv

    def run(cache, torch, it=None, n=0):
        for step in range(-1, 3):
            for layer in range(2):
                cache.update(*_kv(torch, 1, 3 if step < 0 else 1, seed=10 * step + layer), layer)
                if step >= 0:
                    if it is not None and (step, layer) == (1, 0):
                        with it.at(n):
                            cache._driver.after_attention(0)
                    else:
                        cache._driver.after_attention(layer)
        try:
            cache.finish()
        except akv.Quarantined as exc:
            assert "KeyboardInterrupt" in str(exc)
            return None
        ctx = cache.contexts[0]
        return [ctx.read(d, 0, 6) for d in range(2)]

    torch, ref = _cache()
    with ref:
        want = run(ref, torch)

    def scenario(it, n):
        torch, cache = _cache()
        try:
            got = run(cache, torch, it, n)
        except akv.Quarantined as exc:
            assert "KeyboardInterrupt" in str(exc)
            got = None
        if got is not None:
            for (wk, wv), (gk, gv) in zip(want, got):
                assert np.array_equal(wk, gk) and np.array_equal(wv, gv)
        assert not cache.engine._slot
        cache.close()
        assert len(it.destroyed) == len(it.creates)

    every_point(monkeypatch, scenario)
