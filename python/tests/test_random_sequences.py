"""Randomized, stateful, model-checked sequences over the public Python API.

Two seeded drivers. Each keeps a shadow model of what must be true and checks
every call's result, or its exception's class, against it:

- ``test_engine_sequence``: Engine, Context, steps, leases, views, streams and
  headroom-free host engines of random geometry, dtype and route. The model
  holds every context's rows per layer as bytes, which objects are alive, and
  where the open step and each lease stand. Legal decode steps (so that deep
  states are reached) are mixed with hostile calls: layers out of order, a
  second retire, calls after close, rows of the wrong dtype, shape or
  strides, bools, floats, negative and huge integers, objects of another
  engine, arrays kept past their lease and past their engine, exceptions
  raised by the log callback, a forked child. After a refused call nothing
  observable changed (lengths, the rows read back); a staged view shows
  exactly the model's rows; a dead object raises the package's exception.
- ``test_cache_sequence``: ``ActiveKVCache`` over a tiny random Llama against
  ``DynamicCache`` on the same inputs: random batch, prefill length and decode
  steps, forwards interrupted from a forward hook, ``finish``/``close`` at
  random points, ``get_seq_length``, ``get_mask_sizes`` and the refused Cache
  methods. The logits of every forward both caches complete must be
  bit-identical (``torch.equal``), as docs/python.md promises on the host
  backend.

SEEDS (CACHE_SEEDS) run by default; ``ACTIVEKV_RANDOM_SEEDS=N``
(``ACTIVEKV_RANDOM_CACHE_SEEDS=N``) runs seeds 0 .. N-1 instead
(``ACTIVEKV_RANDOM_FIRST=M`` starts them at M).
"""
from __future__ import annotations

import copy
import gc
import os
import pickle
import sys
import weakref

import numpy as np
import pytest

import activekv as akv
from activekv import _api

from conftest import in_forked_child

SEEDS = list(range(24))
CACHE_SEEDS = list(range(6))


def _seeds(default, var="ACTIVEKV_RANDOM_SEEDS"):
    n = os.environ.get(var)
    if not n:
        return default
    first = int(os.environ.get("ACTIVEKV_RANDOM_FIRST", "0"))
    return list(range(first, first + int(n)))


NP_DTYPE = {"f32": np.float32, "f16": np.float16, "bf16": np.uint16, "fp8_e4m3": np.uint8,
            "fp8_e5m2": np.uint8}
ITEMSIZE = {"f32": 4, "f16": 2, "bf16": 2, "fp8_e4m3": 1, "fp8_e5m2": 1}

# integers the package must refuse (InvalidArgument) where a layer, row, count,
# page number or context index is expected; (value, description)
BAD_INTS = [True, False, np.bool_(True), 1.0, 0.0, -1, np.int64(-1), 1 << 32, 1 << 64,
            -(1 << 70), None, "0", b"0", [0], complex(0), np.float32(0)]

LEASE_STATES = ("begun", "ready", "consumed", "written", "sealed")


# counts over the run, printed at the end with ACTIVEKV_RANDOM_STATS=1
STATS = {"faults": 0, "calls": 0, "refused": 0, "steps": 0, "deepest": 0, "forks": 0, "sequences": 0}


class Divergence(AssertionError):
    pass


# ----------------------------------------------------------------- the model


class ShadowContext:
    def __init__(self, obj, engine):
        self.obj = obj
        self.engine = engine
        self.rows = [[] for _ in range(engine.layers)]  # per layer: [(k bytes, v bytes)]
        self.open = True

    @property
    def length(self):
        return min(len(r) for r in self.rows)

    def even(self):
        return len({len(r) for r in self.rows}) == 1


class ShadowLease:
    def __init__(self, obj, layer):
        self.obj = obj
        self.layer = layer
        self.state = "begun"
        self.view = None
        self.new = None  # per step context: (k bytes, v bytes) at mark_consumed
        self.written = set()  # indices of step contexts written back
        self.attn = None
        self.tail = None


class ShadowEngine:
    """What must be true of one Engine."""

    def __init__(self, obj, cfg):
        self.obj = obj
        self.cfg = cfg
        self.layers = cfg["n_dense_layers"]
        self.heads = cfg["kv_heads"]
        self.dim = cfg["head_dim"]
        self.dtype = cfg["dtype"]
        self.max_tokens = cfg["max_tokens"]
        self.max_contexts = cfg["max_contexts"]
        self.row_bytes = self.heads * self.dim * ITEMSIZE[self.dtype]
        self.contexts = []  # ShadowContext, open and closed
        self.open = True
        self.quarantined = False  # a quarantine ran: every change is refused from then on
        self.step = None  # None, or {"ctxs": [ShadowContext], "leases": [ShadowLease]}
        self.streams = []  # (Stream, alive)
        self.failed = False  # the transport failed (an injected fault)

    def live_contexts(self):
        return [c for c in self.contexts if c.open]

    def in_step(self, c):
        return self.step is not None and any(s is c for s in self.step["ctxs"])

    def unretired(self):
        if self.step is None:
            return []
        return [ls for ls in self.step["leases"] if ls.state in LEASE_STATES]


class _Fault(Exception):
    """A call on the engine with an injected fault failed its transport."""


class Driver:
    def __init__(self, seed):
        self.faulty = None  # the engine made with fault_fail_nth, the run's only one
        self.seed = seed
        self.rng = np.random.default_rng(seed)
        self.log = []  # the calls made, for the failure message
        self.engines = []
        self.stale = []  # (array, engine shadow) kept past their lease
        self.unraisable = []
        self.raising_log_lines = 0

    # -- helpers
    def note(self, what):
        self.log.append(what)

    def fail(self, msg):
        tail = "\n  ".join(x for i, x in enumerate(self.log[-400:]) if x != "step_end")[-3000:]
        raise Divergence(f"seed {self.seed}: {msg}\nlast calls:\n  {tail}")

    def chance(self, p):
        return self.rng.random() < p

    def pick(self, seq):
        return seq[int(self.rng.integers(len(seq)))]

    def call(self, what, expect, fn, *a, **kw):
        """Calls fn; `expect` is None (must succeed) or an exception class (or
        tuple) it must raise. Returns (ok, result or exception)."""
        self.note(what)
        STATS["calls"] += 1
        try:
            r = fn(*a, **kw)
        except akv.ActiveKVError as e:
            f = self.faulty
            if (isinstance(e, akv.TransportError) and f is not None and f.open and not f.failed
                    and not f.quarantined):
                # the injected fault (fault_fail_nth) took the transport down
                raise _Fault(what, e)
            if expect is None:
                self.fail(f"{what}: raised {type(e).__name__}: {e}")
            if not isinstance(e, expect):
                self.fail(f"{what}: raised {type(e).__name__} ({e}), expected {expect}")
            STATS["refused"] += 1
            return False, e
        except Exception as e:  # noqa: BLE001 - anything else is a divergence
            if expect is not None and isinstance(e, expect) and not issubclass(
                    type(e), (OSError, SystemError, ctypes_errors())):
                return False, e
            self.fail(f"{what}: raised {type(e).__name__}: {e} (expected "
                      f"{'success' if expect is None else expect})")
        if expect is not None:
            self.fail(f"{what}: succeeded ({r!r}), expected {expect}")
        return True, r

    def rows(self, e, shape):
        """Random bytes of the engine's dtype, shape [..., heads, dim]."""
        n = int(np.prod(shape)) * ITEMSIZE[e.dtype]
        raw = self.rng.integers(0, 256, n, dtype=np.uint8)
        return raw.view(NP_DTYPE[e.dtype]).reshape(shape)

    def as_input(self, e, arr):
        """The same rows in another accepted form (numpy raw bits, torch)."""
        kind = self.rng.integers(4)
        if kind == 1 and e.dtype in ("bf16", "f16"):
            return arr.view(np.int16)
        if kind == 1 and e.dtype.startswith("fp8"):
            return arr.view(np.int8)
        if kind == 2:
            torch = _torch()
            if torch is not None:
                if e.dtype == "bf16":
                    return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
                if e.dtype == "fp8_e4m3" and hasattr(torch, "float8_e4m3fn"):
                    return torch.from_numpy(arr).view(torch.float8_e4m3fn)
                if e.dtype == "fp8_e5m2" and hasattr(torch, "float8_e5m2"):
                    return torch.from_numpy(arr).view(torch.float8_e5m2)
                if e.dtype in ("f32", "f16"):
                    return torch.from_numpy(arr)
        if kind == 3:
            return memoryview(np.ascontiguousarray(arr))
        return arr

    def bad_rows(self, e, shape):
        """(rows the package must refuse, description)."""
        good = self.rows(e, shape)
        k = int(self.rng.integers(8))
        if k == 0:
            wrong = np.float64 if e.dtype != "f32" else np.float16
            return np.zeros(shape, wrong), "float dtype of another size"
        if k == 1 and e.dtype == "f32":
            return good.view(np.int32), "int32 rows for f32"
        if k == 1:
            other = {"bf16": np.float16, "f16": np.uint8, "fp8_e4m3": np.uint16,
                     "fp8_e5m2": np.float16}[e.dtype]
            if other == np.float16 and e.dtype == "bf16":
                return good.view(np.float16), "f16 rows for bf16"
            return np.zeros(shape, other), "rows of another size"
        if k == 2 and (shape[0] if len(shape) == 3 else shape[1]) > 1:
            # non-contiguous: every other token of a twice-as-long array
            big = self.rows(e, (shape[0] * 2,) + tuple(shape[1:])) if len(shape) == 3 else \
                self.rows(e, (shape[0], shape[1] * 2) + tuple(shape[2:]))
            if len(shape) == 3:
                return big[::2], "non-contiguous rows"
            return big[:, ::2], "non-contiguous rows"
        if k == 3:
            return self.rows(e, tuple(shape[:-1]) + (e.dim + 1,)), "wrong head_dim"
        if k == 4:
            return self.rows(e, tuple(shape[:-2]) + (e.heads + 1, e.dim)), "wrong kv_heads"
        if k == 5:
            return self.pick(["rows", None, 3, object()]), "not an array"
        if k == 6:
            torch = _torch()
            if torch is not None and e.dtype == "f32" and good.ndim >= 2 and good.shape[-2] > 1:
                return torch.from_numpy(good).transpose(-1, -2), "non-contiguous torch tensor"
            if good.size:
                return np.ma.masked_array(good, mask=np.ones(good.shape, bool)), "masked array"
            return good[None], "another rank"
        if ITEMSIZE[e.dtype] > 1:
            return good.byteswap().view(good.dtype.newbyteorder(">")), "other byte order"
        return good[None], "another rank"

    # -- engines
    def new_engine(self, log=None, faults=False):
        if self.faulty is not None:
            return None
        route = self.pick(["stage", "stage", "arena"])
        dtype = self.pick(["f32", "f16", "bf16", "fp8_e4m3", "fp8_e5m2"])
        page = int(self.rng.integers(1, 5))
        cfg = dict(backend="host", n_dense_layers=int(self.rng.integers(1, 4)),
                   kv_heads=int(self.rng.integers(1, 3)), head_dim=int(self.pick([1, 4, 8])),
                   dtype=dtype, max_tokens=int(self.rng.integers(page, 40)), page_tokens=page,
                   max_contexts=int(self.rng.integers(1, 4)), host_pool_gib=1, route=route,
                   device_pool_gib=1 if route == "arena" else 0,
                   log_level=self.pick(["error", "warn", "info", "debug"]))
        if route == "arena":
            # the arena's device pool (1 GiB) must be few enough pages for the
            # bookkeeping limit (akv_fit): wider rows, else the stage route
            cfg["head_dim"] = int(self.pick([16, 32, 64]))
            try:
                akv.fit(**cfg)
            except akv.Config:
                cfg.update(route="stage", device_pool_gib=0)
        if faults:
            cfg.update(fault_fail_nth=int(self.rng.integers(1, 400)),
                       fault_kind=self.pick(["copy", "record", "wait", "query", "sync"]))
            self.note(f"Engine({cfg})")
            try:
                eng = akv.Engine(log=self.quiet_log, **cfg)
            except (akv.TransportError, akv.OutOfMemory):
                return None  # the fault hit the create: no engine
            e = ShadowEngine(eng, cfg)
            self.engines.append(e)
            self.faulty = e
            return e
        if log is None:
            log = self.quiet_log if not self.chance(0.3) else self.raising_log
        ok, eng = self.call(f"Engine({cfg})", None, akv.Engine, log=log, **cfg)
        e = ShadowEngine(eng, cfg)
        if eng.dtype != dtype or eng.backend != "host":
            self.fail(f"engine says dtype {eng.dtype}, backend {eng.backend}")
        self.engines.append(e)
        return e

    def quiet_log(self, level, message):
        if not isinstance(level, str) or not isinstance(message, str):
            self.fail(f"log callback given {level!r}, {message!r}")

    def raising_log(self, level, message):
        self.raising_log_lines += 1
        raise RuntimeError(f"log callback raising on {level}: {message}")

    # -- the checks run after every call
    def check_engine(self, e):
        eng = e.obj
        if not e.open:
            if not self.chance(0.2):
                return
            for what, fn in (("info", eng.info), ("open_context", eng.open_context),
                             ("step_end", eng.step_end), ("lease_begin", lambda: eng.lease_begin(0)),
                             ("stream_create", eng.stream_create), ("quarantine", eng.quarantine)):
                self.call(f"closed engine {what}", akv.BadHandle, fn)
            self.call("closed engine close", None, eng.close)
            return
        for c in e.contexts:
            self.check_context(e, c)

    def check_context(self, e, c, full=False):
        ctx = c.obj
        if not c.open or not e.open:
            self.call("closed context length", akv.BadHandle, lambda: ctx.length)
            self.call("closed context read", akv.BadHandle, ctx.read, 0, 0, 0)
            self.call("closed context append_layer", akv.BadHandle, ctx.append_layer, 0,
                      self.rows(e, (1, e.heads, e.dim)), self.rows(e, (1, e.heads, e.dim)))
            return
        ok, n = self.call("length", None, lambda: ctx.length)
        if n != c.length:
            self.fail(f"context length {n}, model {c.length}")
        if e.in_step(c):
            self.call("read in step", akv.InUse, ctx.read, 0, 0, min(1, c.length))
            return
        layers = range(e.layers) if full else [int(self.rng.integers(e.layers))]
        for layer in layers:
            held = len(c.rows[layer])
            if held == 0 and not full:
                continue
            first = int(self.rng.integers(0, held + 1)) if not full else 0
            n = held - first if full else int(self.rng.integers(0, held - first + 1))
            ok, (k, v) = self.call(f"read({layer}, {first}, {n})", None, ctx.read, layer, first, n)
            kb, vb = k.tobytes(), v.tobytes()
            want = c.rows[layer][first:first + n]
            if kb != b"".join(r[0] for r in want) or vb != b"".join(r[1] for r in want):
                self.fail(f"read({layer}, {first}, {n}) differs from the model")
            if k.dtype != NP_DTYPE[e.dtype] or k.shape != (n, e.heads, e.dim):
                self.fail(f"read gave {k.dtype} {k.shape}")
        # one row past what the layer holds is refused
        layer = int(self.rng.integers(e.layers))
        self.call("read past the rows", akv.InvalidArgument, ctx.read, layer,
                  len(c.rows[layer]), 1)

    def check_view(self, e, ls, view):
        """A staged view shows exactly the model's rows of its layer."""
        ctxs = e.step["ctxs"]
        if view.n_contexts != len(ctxs) or view.layer != ls.layer:
            self.fail(f"view of {view.n_contexts} contexts, layer {view.layer}")
        if view.len != [c.length for c in ctxs]:
            self.fail(f"view.len {view.len}, model {[c.length for c in ctxs]}")
        for i, c in enumerate(ctxs):
            ok, k = self.call(f"view.keys({i})", None, view.keys, i)
            ok, v = self.call(f"view.values({i})", None, view.values, i)
            n = c.length
            if k.shape != (n + 1, e.heads, e.dim) or k.dtype != NP_DTYPE[e.dtype]:
                self.fail(f"view.keys({i}) is {k.dtype} {k.shape}")
            rows = c.rows[ls.layer][:n]
            if np.ascontiguousarray(k[:n]).tobytes() != b"".join(r[0] for r in rows):
                self.fail(f"view.keys({i}) of layer {ls.layer} differs from the model")
            if np.ascontiguousarray(v[:n]).tobytes() != b"".join(r[1] for r in rows):
                self.fail(f"view.values({i}) of layer {ls.layer} differs from the model")
            if self.chance(0.3):
                self.stale.append((k, e))
        if self.chance(0.15) and _torch() is not None:
            ok, (kt, vt) = self.call("view.kv_tensors()", None, view.kv_tensors)
            for i, c in enumerate(ctxs):
                n = c.length
                got = kt[i, :, :n].transpose(0, 1).contiguous().numpy().tobytes() if e.dtype \
                    in ("f32", "f16") else kt[i, :, :n].transpose(0, 1).contiguous().view(
                        _torch().uint8).numpy().tobytes()
                if got != b"".join(r[0] for r in c.rows[ls.layer][:n]):
                    self.fail(f"kv_tensors K of context {i} differs from the model")
            if self.chance(0.5):
                self.stale.append((vt, e))
        for bad in (self.pick(BAD_INTS), len(ctxs), -1):
            self.call(f"view.keys({bad!r})", akv.InvalidArgument, view.keys, bad)

    # -- operations
    def op_open(self, e):
        eng = e.obj
        if self.chance(0.2):
            bad = self.pick([b for b in BAD_INTS if b is not None] + [0xFFFFFFFF])
            # arguments are checked before the handle: either refusal is right
            self.call(f"open_context(target_pages={bad!r})",
                      (akv.BadHandle, akv.InvalidArgument), eng.open_context, bad)
            return
        target = int(self.rng.integers(0, 4)) if self.chance(0.2) else None
        if not e.open:
            expect = akv.BadHandle
        elif e.quarantined:
            expect = akv.Quarantined
        elif e.step is not None:
            expect = akv.StepState
        elif len(e.live_contexts()) >= e.max_contexts:
            expect = akv.RefusedQueue
        elif target:
            # an explicit target may not fit the device pool
            expect = "maybe"
        else:
            expect = None
        if expect == "maybe":
            self.note(f"open_context({target}) (admission may refuse)")
            try:
                ok, ctx = True, eng.open_context(target)
            except akv.AdmissionRefused:
                ok = False
        else:
            ok, ctx = self.call(f"open_context({target})", expect, eng.open_context, target)
        if ok:
            e.contexts.append(ShadowContext(ctx, e))

    def op_close_context(self, e):
        live = e.live_contexts()
        if not live:
            return
        c = self.pick(e.contexts)
        expect = None
        if e.open and c.open and e.in_step(c):
            expect = akv.InUse
        elif e.open and c.open and e.quarantined:
            expect = akv.Quarantined
        ok, _ = self.call("context close", expect, c.obj.close)
        if ok:
            c.open = False

    def append_expect(self, e, c, n, layer=None):
        if not e.open or not c.open:
            return akv.BadHandle
        if e.in_step(c):
            return akv.InUse
        if e.quarantined:
            return akv.Quarantined
        held = max(len(r) for r in c.rows) if layer is None else len(c.rows[layer])
        if held + n > e.max_tokens:
            return akv.Capacity
        return None

    def op_append(self, e):
        if not e.contexts:
            return
        c = self.pick(e.contexts)
        n = int(self.rng.integers(0, 5))
        shape = (e.layers, n, e.heads, e.dim)
        if self.chance(0.25):
            k, what = self.bad_rows(e, shape)
            v = self.rows(e, shape)
            if self.chance(0.5):
                k, v = v, k
            expect = akv.BadHandle if (not e.open or not c.open) else akv.InvalidArgument
            self.call(f"append({what})", expect, c.obj.append, k, v)
            return
        k, v = self.rows(e, shape), self.rows(e, shape)
        expect = self.append_expect(e, c, n)
        ok, _ = self.call(f"append({n})", expect, c.obj.append, self.as_input(e, k),
                          self.as_input(e, v))
        if ok:
            for layer in range(e.layers):
                for t in range(n):
                    c.rows[layer].append((k[layer, t].tobytes(), v[layer, t].tobytes()))

    def op_append_layer(self, e):
        if not e.contexts:
            return
        c = self.pick(e.contexts)
        n = int(self.rng.integers(0, 4))
        layer = int(self.rng.integers(e.layers))
        shape = (n, e.heads, e.dim)
        dead = not e.open or not c.open
        if self.chance(0.2):
            bad = self.pick(BAD_INTS + [e.layers])
            expect = akv.BadHandle if dead else akv.InvalidArgument
            if not dead and bad == e.layers and type(bad) is int:
                # in range for the package, out of range for the library, which may
                # answer another refusal that applies first
                expect = (akv.InvalidArgument, self.append_expect(e, c, n, 0) or
                          akv.InvalidArgument)
            self.call(f"append_layer({bad!r})", expect,
                      c.obj.append_layer, bad, self.rows(e, shape), self.rows(e, shape))
            return
        if self.chance(0.2):
            k, what = self.bad_rows(e, shape)
            self.call(f"append_layer({what})", akv.BadHandle if dead else akv.InvalidArgument,
                      c.obj.append_layer, layer, k, self.rows(e, shape))
            return
        k, v = self.rows(e, shape), self.rows(e, shape)
        ok, _ = self.call(f"append_layer({layer}, {n})", self.append_expect(e, c, n, layer),
                          c.obj.append_layer, np.int32(layer) if self.chance(0.3) else layer,
                          self.as_input(e, k), self.as_input(e, v))
        if ok:
            for t in range(n):
                c.rows[layer].append((k[t].tobytes(), v[t].tobytes()))

    def op_read_bad(self, e):
        if not e.contexts:
            return
        c = self.pick(e.contexts)
        args = [0, 0, 0]
        args[int(self.rng.integers(3))] = self.pick(BAD_INTS)
        expect = akv.BadHandle if (not e.open or not c.open) else akv.InvalidArgument
        self.call(f"read{tuple(args)!r}", expect, c.obj.read, *args)

    def step_begin_expect(self, e, chosen):
        """Every refusal that applies (the library checks them in its own order;
        any one of them, with nothing changed, is right); None: success."""
        if not e.open or any(not c.open for c in chosen):
            return akv.BadHandle
        errs = []
        if not chosen or len({id(c) for c in chosen}) != len(chosen) \
                or len(chosen) > e.max_contexts:
            errs.append(akv.InvalidArgument)
        if e.quarantined:
            errs.append(akv.Quarantined)
        if e.step is not None:
            errs.append(akv.StepState)
        if any(not c.even() for c in chosen):
            errs.append(akv.UnevenLayers)
        if any(c.length + 1 > e.max_tokens for c in chosen):
            errs.append(akv.Capacity)
        return tuple(errs) or None

    def op_step_begin(self, e, legal=False):
        live = e.live_contexts()
        if legal:
            chosen = [c for c in live if c.even() and c.length < e.max_tokens]
            self.rng.shuffle(chosen)
            chosen = chosen[:int(self.rng.integers(1, len(chosen) + 1))] if chosen else []
            if not chosen:
                return False
        else:
            pool = e.contexts if e.contexts else []
            chosen = [self.pick(pool) for _ in range(int(self.rng.integers(0, 3)))] if pool else []
        expect = self.step_begin_expect(e, chosen)
        objs = [c.obj for c in chosen]
        if expect is None and self.chance(0.3):
            objs = tuple(objs) if self.chance(0.5) else iter(objs)
        ok, _ = self.call(f"step_begin({len(chosen)} contexts)", expect, e.obj.step_begin, objs)
        if ok:
            e.step = {"ctxs": chosen, "leases": []}
        return ok

    def next_layer(self, e):
        return len(e.step["leases"])

    def in_step_refusal(self, e):
        """The refusal of a call that needs an open step (lease_begin, step_end)
        before anything of the step is looked at; None when there is a step."""
        if not e.open:
            return akv.BadHandle
        if e.quarantined:
            return akv.Quarantined
        if e.step is None:
            return akv.StepState
        return None

    def lease_begin_expect(self, e, layer):
        refusal = self.in_step_refusal(e)
        if refusal is not None:
            return refusal
        leases = e.step["leases"]
        if leases and leases[-1].state not in ("sealed", "retired"):
            # the previous lease neither sealed nor retired
            return (akv.LeaseOrder, akv.InvalidArgument) if layer != len(leases) else akv.LeaseOrder
        if layer != len(leases):
            return (akv.InvalidArgument, akv.LeaseOrder)
        return None

    def lease_begin_expect_all(self, e, layer):
        expect = self.lease_begin_expect(e, layer)
        if layer >= e.layers and expect is not akv.BadHandle:
            if expect is None:
                return akv.InvalidArgument
            return tuple(set((expect if isinstance(expect, tuple) else (expect,)) +
                             (akv.InvalidArgument,)))
        return expect

    def op_lease_begin(self, e, layer=None):
        if layer is None:
            layer = int(self.rng.integers(0, e.layers + 1))
            if self.chance(0.1):
                bad = self.pick(BAD_INTS)
                self.call(f"lease_begin({bad!r})", akv.BadHandle if not e.open
                          else akv.InvalidArgument, e.obj.lease_begin, bad)
                return None
        expect = self.lease_begin_expect_all(e, layer)
        ok, lease = self.call(f"lease_begin({layer})", expect, e.obj.lease_begin,
                              np.uint32(layer) if self.chance(0.2) else layer)
        if ok:
            if lease.layer != layer:
                self.fail(f"lease_begin({layer}) gave the lease of layer {lease.layer}")
            ls = ShadowLease(lease, layer)
            e.step["leases"].append(ls)
            return ls
        return None

    def current(self, e):
        if e.step is None or not e.step["leases"]:
            return None
        return e.step["leases"][-1]

    def op_wait_ready(self, e, ls, stream=None):
        expect = self.lease_expect(e, ls, "begun")
        ok, view = self.call("wait_ready", expect, ls.obj.wait_ready, stream)
        if ok:
            ls.state, ls.view = "ready", view
            self.check_view(e, ls, view)
            again = ls.obj.view
            if again is None or again.base != view.base or again.len != view.len:
                self.fail("Lease.view differs from what wait_ready returned")

    def lease_expect(self, e, ls, state):
        if not e.open:
            return akv.BadHandle
        if ls.state in ("retired", "released"):
            return akv.BadHandle
        if e.quarantined:
            return akv.Quarantined
        if ls.state != state:
            return akv.LeaseState
        return None

    def op_mark_consumed(self, e, ls, write=True):
        expect = self.lease_expect(e, ls, "ready")
        new = None
        if expect is None:
            new = []
            for i, c in enumerate(e.step["ctxs"]):
                k, v = ls.view.keys(i), ls.view.values(i)
                n = c.length
                if write or self.chance(0.5):
                    k[n] = self.rows(e, (e.heads, e.dim))
                    v[n] = self.rows(e, (e.heads, e.dim))
                new.append((np.ascontiguousarray(k[n]).tobytes(),
                            np.ascontiguousarray(v[n]).tobytes()))
        ok, fence = self.call("mark_consumed", expect, ls.obj.mark_consumed)
        if ok:
            ls.state, ls.new, ls.attn = "consumed", new, fence
            if ls.obj.attention != fence:
                self.fail("Lease.attention differs from mark_consumed's fence")

    def op_write_back(self, e, ls, partial=False):
        ctxs = e.step["ctxs"] if e.step is not None else []
        idx = None
        if partial and ctxs:
            left = [i for i in range(len(ctxs)) if i not in ls.written]
            pool = left if left and self.chance(0.8) else list(range(len(ctxs)))
            self.rng.shuffle(pool)
            idx = pool[:int(self.rng.integers(1, len(pool) + 1))]
        if not e.open or ls.state in ("retired", "released"):
            expect = akv.BadHandle
        elif e.quarantined:
            expect = akv.Quarantined
        elif ls.state not in ("consumed", "written"):
            expect = akv.LeaseState
        elif idx is None and ls.written:
            expect = akv.LeaseState
        elif idx is not None and any(i in ls.written for i in idx):
            expect = akv.LeaseState
        elif idx is not None and any(not ctxs[i].open for i in idx):
            expect = akv.BadHandle
        else:
            expect = None
        owners = None if idx is None else [ctxs[i].obj for i in idx]
        ok, tail = self.call(f"write_back({idx})", expect, ls.obj.write_back, owners)
        if ok:
            ls.written |= set(range(len(ctxs))) if idx is None else set(idx)
            ls.state, ls.tail = "written", tail
            if ls.obj.tail != tail:
                self.fail("Lease.tail differs from write_back's fence")

    def op_seal(self, e, ls, honest=True):
        tail, attn = ls.tail, ls.attn
        expect = self.lease_expect(e, ls, "written")
        bad = False
        if not honest and tail is not None and attn is not None:
            k = int(self.rng.integers(4))
            if k == 0:
                tail, attn = attn, tail
            elif k == 1:
                tail = akv.Fence(tail.serial + 1000)
            elif k == 2:
                tail, attn = tail.serial, attn.serial
                if expect is None or expect is akv.LeaseState:
                    expect = akv.InvalidArgument
                if not e.open or ls.state in ("retired", "released"):
                    expect = akv.BadHandle
            else:
                attn = copy.copy(attn)  # an equal Fence is the same fence
            bad = k in (0, 1)
        if bad and expect is None:
            expect = akv.FenceMismatch
        if expect is None and len(ls.written) != len(e.step["ctxs"]):
            expect = akv.LeaseState
        if tail is None or attn is None:
            tail, attn = akv.Fence(1), akv.Fence(2)
            if expect is None:
                expect = (akv.FenceMismatch, akv.LeaseState)
        ok, _ = self.call(f"seal(honest={honest})", expect, ls.obj.seal, tail, attn)
        if ok:
            ls.state = "sealed"

    def op_retire(self, e, ls, use_try=False):
        if not e.open or ls.state in ("retired", "released"):
            expect = akv.BadHandle
        elif e.quarantined:
            expect = akv.Quarantined
        elif ls.state != "sealed":
            expect = akv.LeaseState
        else:
            expect = None
        if use_try:
            self.note("try_retire")
            try:
                r = ls.obj.try_retire()
            except akv.ActiveKVError as exc:
                if expect is None or not isinstance(exc, expect):
                    self.fail(f"try_retire raised {type(exc).__name__} ({exc}), expected "
                              f"{expect or 'success or None'}")
                return
            if expect is not None:
                self.fail(f"try_retire answered {r!r}, expected {expect}")
            if r is None:
                # a fence still pending (timing): nothing changed; retire() blocks,
                # so that the sequence does not depend on the timing
                ok, r = self.call("retire after try_retire", None, ls.obj.retire)
        else:
            ok, r = self.call("retire", expect, ls.obj.retire)
            if not ok:
                return
        ls.state = "retired"
        if r.layer != ls.layer or r.attention != ls.attn or r.tail != ls.tail:
            self.fail(f"receipt {r} does not match the lease")
        # every later call on the lease is refused as dead, its fences too
        self.call("retired lease.view", akv.BadHandle, lambda: ls.obj.view)
        self.call("retired lease.attention", akv.BadHandle, lambda: ls.obj.attention)
        if ls.view is not None and self.chance(0.5):
            self.call("retired view.keys", akv.BadHandle, ls.view.keys, 0)

    def step_end_expect(self, e):
        refusal = self.in_step_refusal(e)
        if refusal is not None:
            return refusal
        leases = e.step["leases"]
        if len(leases) != e.layers or any(ls.state != "retired" for ls in leases):
            return akv.StepState
        return None

    def op_step_end(self, e):
        expect = self.step_end_expect(e)
        ok, _ = self.call("step_end", expect, e.obj.step_end)
        if ok:
            STATS["steps"] += 1
            STATS["deepest"] = max([STATS["deepest"]] + [len(c.rows[0]) for c in e.step["ctxs"]])
            for ls in e.step["leases"]:
                for i, c in enumerate(e.step["ctxs"]):
                    c.rows[ls.layer].append(ls.new[i])
            e.step = None

    def op_lease_move(self, e):
        """One move on the step's current lease: the legal next call most of
        the time, a random (often illegal) one otherwise."""
        if e.step is None:
            return
        ls = self.current(e)
        legal = self.chance(0.7)
        earlier = [x for x in e.step["leases"] if x.state == "sealed" and x is not ls]
        if legal and earlier:
            self.op_retire(e, earlier[0], use_try=self.chance(0.3))
            return
        if ls is None or ls.state == "retired":
            if legal and (ls is None or len(e.step["leases"]) < e.layers):
                self.op_lease_begin(e, self.next_layer(e))
            elif legal:
                self.op_step_end(e)
            else:
                self.pick([lambda: self.op_lease_begin(e), lambda: self.op_step_end(e)])()
            return
        moves = {
            "begun": lambda: self.op_wait_ready(e, ls),
            "ready": lambda: self.op_mark_consumed(e, ls, write=self.chance(0.8)),
            "consumed": lambda: self.op_write_back(e, ls, partial=self.chance(0.3)),
            "written": (lambda: self.op_write_back(e, ls, partial=True))
            if len(ls.written) < len(e.step["ctxs"]) else lambda: self.op_seal(e, ls),
            "sealed": lambda: self.op_retire(e, ls, use_try=self.chance(0.3)),
        }
        if legal:
            moves[ls.state]()
            return
        self.pick([
            lambda: self.op_wait_ready(e, ls),
            lambda: self.op_mark_consumed(e, ls),
            lambda: self.op_write_back(e, ls, partial=self.chance(0.5)),
            lambda: self.op_seal(e, ls, honest=self.chance(0.5)),
            lambda: self.op_retire(e, ls, use_try=self.chance(0.5)),
            lambda: self.op_lease_begin(e),
            lambda: self.op_step_end(e),
            lambda: self.op_old_lease(e),
        ])()

    def op_old_lease(self, e):
        """A call on a lease of an earlier layer or step (retired: dead)."""
        old = [ls for en in self.engines for ls in getattr(en, "_old", [])]
        if e.step is not None:
            old += [ls for ls in e.step["leases"] if ls.state == "retired"]
        if not old:
            return
        ls = self.pick(old)
        fn = self.pick([lambda: ls.obj.wait_ready(), lambda: ls.obj.mark_consumed(),
                        lambda: ls.obj.write_back(), lambda: ls.obj.retire(),
                        lambda: ls.obj.try_retire(),
                        lambda: ls.obj.seal(akv.Fence(1), akv.Fence(2))])
        self.call(f"call on a retired lease of layer {ls.layer}", akv.BadHandle, fn)

    def op_full_step(self, e):
        """A whole legal decode step over some of the contexts."""
        if e.step is not None or not e.open or e.quarantined:
            return
        if not self.op_step_begin(e, legal=True):
            return
        stream = None
        if self.chance(0.3):
            stream = self.stream_for(e)
        for layer in range(e.layers):
            ls = self.op_lease_begin(e, layer)
            self.op_wait_ready(e, ls, stream)
            self.op_mark_consumed(e, ls, write=self.chance(0.9))
            if self.chance(0.2) and len(e.step["ctxs"]) > 1:
                while len(ls.written) < len(e.step["ctxs"]):
                    self.op_write_back(e, ls, partial=True)
            else:
                self.op_write_back(e, ls)
            self.op_seal(e, ls)
            if self.chance(0.8):
                self.op_retire(e, ls, use_try=self.chance(0.3))
            if ls.state != "retired" and (layer == e.layers - 1 or self.chance(0.5)):
                self.op_retire(e, ls)
        for ls in e.step["leases"]:
            if ls.state != "retired":
                self.op_retire(e, ls)
        self.op_step_end(e)

    def stream_for(self, e):
        live = [s for s, alive in e.streams if alive]
        if live and self.chance(0.6):
            s = self.pick(live)
            return s.handle if self.chance(0.3) else s
        if not e.open:
            expect = akv.BadHandle
        elif e.quarantined:
            expect = akv.Quarantined
        else:
            # at most 8 live per engine (akv.h: AKV_ERR_OUT_OF_MEMORY), the package's
            # default stream among them once made
            box = e.obj._default_box
            made = box is not None and box.value is not None and not any(
                st._box is box for st, alive in e.streams if alive)
            expect = None if len(live) + made < 8 else akv.OutOfMemory
        ok, s = self.call("stream_create", expect, e.obj.stream_create)
        if ok:
            e.streams.append((s, True))
            return s
        return None

    def op_stream_destroy(self, e):
        if not e.streams:
            return
        i = int(self.rng.integers(len(e.streams)))
        s, alive = e.streams[i]
        used = e.step is not None and any(
            ls.state in LEASE_STATES and ls.obj._stream is s for ls in e.step["leases"])
        expect = akv.InUse if (alive and e.open and used) else None
        ok, _ = self.call("stream destroy", expect, s.destroy)
        if ok:
            e.streams[i] = (s, False)
            self.call("destroyed stream handle", akv.BadHandle, lambda: s.handle)
            if e.open:
                self.call("destroyed stream synchronize", akv.BadHandle, s.synchronize)

    def op_close_engine(self, e):
        if not e.open:
            self.call("engine close again", None, e.obj.close)
            return
        expect = akv.Busy if e.step is not None else None
        ok, _ = self.call("engine close", expect, e.obj.close)
        if ok:
            e.open = False
            for st, alive in e.streams:
                if alive:
                    self.call("stream of a closed engine", akv.BadHandle, lambda: st.handle)
            e.streams = [(st, False) for st, _ in e.streams]

    def op_quarantine(self, e):
        if not e.open:
            self.call("quarantine closed", akv.BadHandle, e.obj.quarantine)
            return
        ok, rep = self.call("quarantine", None, e.obj.quarantine)
        released = len(e.unretired())
        if rep.leases_released != released:
            self.fail(f"quarantine released {rep.leases_released} leases, model {released}")
        if e.step is not None:
            for ls in e.step["leases"]:
                if ls.state in LEASE_STATES:
                    ls.state = "released"
            e.__dict__.setdefault("_old", []).extend(e.step["leases"])
            e.step = None
        e.quarantined = True

    def op_foreign(self, e):
        """Objects of another engine where this engine's are expected."""
        others = [o for o in self.engines if o is not e and o.open and o.live_contexts()]
        if not others or not e.open:
            return
        o = self.pick(others)
        c = self.pick(o.live_contexts())
        self.call("step_begin(foreign context)", akv.InvalidArgument, e.obj.step_begin, [c.obj])
        ls = self.current(e)
        if ls is not None and ls.state in ("consumed",) and not e.quarantined:
            self.call("write_back(foreign owner)", akv.InvalidArgument, ls.obj.write_back,
                      [c.obj])
        live = [s for s, a in o.streams if a]
        if ls is not None and ls.state == "begun" and live and not e.quarantined:
            self.call("wait_ready(foreign stream)", akv.InvalidArgument, ls.obj.wait_ready,
                      live[0])

    def op_copy(self, e):
        objs = [e.obj] + [c.obj for c in e.contexts[:1]]
        ls = self.current(e)
        if ls is not None:
            objs.append(ls.obj)
        o = self.pick(objs)
        fn = self.pick([copy.copy, copy.deepcopy, pickle.dumps])
        self.call(f"{fn.__name__}({type(o).__name__})", TypeError, fn, o)

    def op_stale(self):
        """Touches arrays kept past their lease (or their engine): they may show
        anything a later lease staged, but never freed memory."""
        if not self.stale:
            return
        a, e = self.stale[int(self.rng.integers(len(self.stale)))]
        self.note(f"touch a stale {type(a).__name__}")
        float(np.asarray(a).view(np.uint8).sum()) if isinstance(a, np.ndarray) else \
            float(a.view(_torch().uint8).sum())
        busy = e.open and e.step is not None and e.unretired()
        if not busy and isinstance(a, np.ndarray) and a.flags.writeable:
            # no lease is between begin and retire: nothing staged is read now
            a[...] = self.rows(e, a.shape)

    def op_fork(self, e):
        if not hasattr(os, "fork") or not e.open:
            return
        c = e.live_contexts()[0] if e.live_contexts() else None
        ls = self.current(e)
        view = ls.view if ls is not None and ls.state in LEASE_STATES else None

        def child():
            calls = [e.obj.info, e.obj.open_context, lambda: e.obj.lease_begin(0), e.obj.close]
            if c is not None:
                calls += [lambda: c.obj.length, lambda: c.obj.read(0, 0, 0), c.obj.close]
            if ls is not None and ls.state in LEASE_STATES:
                calls += [ls.obj.retire, lambda: ls.obj.attention]
            if view is not None:
                calls.append(lambda: view.keys(0))
            for fn in calls:
                try:
                    fn()
                except akv.BadHandle:
                    continue
                except BaseException:  # noqa: BLE001 - the child reports by exit code
                    return 3
                return 2
            gc.collect()
            return 0

        self.note("fork")
        STATS["forks"] += 1
        code = in_forked_child(child)
        if code != 0:
            self.fail(f"forked child exited {code} (2: a call succeeded, 3: another error, "
                      "None: hung)")

    def op_log_raise_check(self, e):
        """An engine whose log callback raises goes on as any other."""

    # -- the run
    def run(self, n_ops):
        old_hook = sys.unraisablehook
        # kept as words: the traceback would hold the engine's frames
        sys.unraisablehook = lambda u: self.unraisable.append(
            (u.exc_type, str(u.exc_value), repr(u.object)))
        try:
            self._run(n_ops)
        finally:
            sys.unraisablehook = old_hook
        for typ, text, obj in self.unraisable:
            if not (typ is RuntimeError and "log callback raising" in text):
                self.fail(f"unraisable {typ.__name__}: {text} ({obj})")

    def finish_step(self, en):
        """Walks the open step to its end with legal calls."""
        for _ in range(8 * en.layers + 4):
            if en.step is None:
                return
            ls = self.current(en)
            earlier = [x for x in en.step["leases"] if x.state == "sealed" and x is not ls]
            if earlier:  # sealed, and the next layer begun: retired any time
                self.op_retire(en, earlier[0])
            elif ls is None or ls.state == "retired":
                if len(en.step["leases"]) < en.layers:
                    self.op_lease_begin(en, self.next_layer(en))
                else:
                    self.op_step_end(en)
            elif ls.state == "begun":
                self.op_wait_ready(en, ls)
            elif ls.state == "ready":
                self.op_mark_consumed(en, ls)
            elif ls.state == "consumed":
                self.op_write_back(en, ls)
            elif ls.state == "written" and len(ls.written) < len(en.step["ctxs"]):
                self.op_write_back(en, ls, partial=True)
            elif ls.state == "written":
                self.op_seal(en, ls)
            else:
                self.op_retire(en, ls)
        if en.step is not None:
            self.fail(f"the open step made no progress with legal calls: leases "
                      f"{[(ls.layer, ls.state) for ls in en.step['leases']]}, step_end "
                      f"expects {self.step_end_expect(en)}, quarantined {en.quarantined}, "
                      f"failed {en.failed}, open {en.open}")

    def after_fault(self, e, what, exc):
        """The transport failed under `what`: every change is refused from then on,
        the committed rows stay readable, close waits for a quarantine."""
        self.note(f"{what}: transport failed ({type(exc).__name__}: {exc})")
        STATS["faults"] += 1
        e.failed = True
        for c in e.live_contexts():
            self.check_context(e, c, full=True)
        self.call("open_context after the fault", akv.TransportError, e.obj.open_context)
        if e.live_contexts():
            c = e.live_contexts()[0]
            self.call("append after the fault", (akv.TransportError, akv.InUse), c.obj.append,
                      *(self.rows(e, (e.layers, 1, e.heads, e.dim)),) * 2)
        self.call("close before a quarantine", akv.Busy, e.obj.close)
        self.note("quarantine")
        try:
            e.obj.quarantine()
        except akv.UncertainFence:
            self.call("close after an uncertain quarantine", akv.Busy, e.obj.close)
            e.open = False
            return
        e.step = None
        e.quarantined = True
        for c in e.live_contexts():
            self.check_context(e, c, full=True)
        self.call("close after the quarantine", None, e.obj.close)
        e.open = False

    def _run(self, n_ops):
        e = self.new_engine(faults=self.chance(0.15))
        if e is None:
            return
        if self.faulty is None and self.chance(0.5):
            self.new_engine()
        try:
            self.prefill(e)
        except _Fault as fault:
            self.after_fault(e, *fault.args)
        self.loop(n_ops)

    def prefill(self, e):
        for _ in range(int(self.rng.integers(1, 3))):
            self.op_open(e)
            if e.contexts:
                c = e.contexts[-1]
                n = int(self.rng.integers(0, max(1, e.max_tokens // 2)))
                k, v = self.rows(e, (e.layers, n, e.heads, e.dim)), \
                    self.rows(e, (e.layers, n, e.heads, e.dim))
                ok, _ = self.call(f"prefill append({n})", self.append_expect(e, c, n),
                                  c.obj.append, k, v)
                if ok:
                    for layer in range(e.layers):
                        for t in range(n):
                            c.rows[layer].append((k[layer, t].tobytes(), v[layer, t].tobytes()))

    def loop(self, n_ops):
        ops = [
            (self.op_full_step, 16), (self.op_lease_move, 14), (self.op_open, 3),
            (self.op_close_context, 2), (self.op_append, 4), (self.op_append_layer, 4),
            (self.op_read_bad, 2), (lambda x: self.op_step_begin(x), 3),
            (self.op_stream_destroy, 1), (lambda x: self.stream_for(x), 1),
            (self.op_foreign, 1), (self.op_copy, 1), (lambda x: self.op_stale(), 2),
            (self.op_close_engine, 0.15), (self.op_quarantine, 0.1), (self.op_fork, 0.05),
            (lambda x: self.new_engine(), 0.3),
        ]
        weights = np.array([w for _, w in ops], float)
        weights /= weights.sum()
        for _ in range(n_ops):
            cands = [en for en in self.engines if en.open] or self.engines
            e = self.pick(cands) if self.chance(0.3) else cands[0]
            fn = ops[int(self.rng.choice(len(ops), p=weights))][0]
            try:
                fn(e)
                for en in self.engines:
                    self.check_engine(en)
            except _Fault as fault:
                self.after_fault(self.faulty, *fault.args)
        # the end: finish or abandon every engine, then touch what was kept
        for en in list(self.engines):
            if en.open and self.chance(0.5):
                if en.step is not None and not en.quarantined:
                    try:
                        self.finish_step(en)
                    except _Fault as fault:
                        self.after_fault(en, *fault.args)
                        continue
                    for c in en.live_contexts():
                        self.check_context(en, c, full=True)
                if en.step is None:
                    self.op_close_engine(en)
        # drop every engine, context, lease and view; what was kept stays readable
        refs = [weakref.ref(en.obj) for en in self.engines]
        for en in self.engines:
            for c in en.contexts:
                c.obj = None
            if en.step is not None:
                for ls in en.step["leases"]:
                    ls.obj = ls.view = None
            en.__dict__.pop("_old", None)
            en.obj = None
            en.streams = []
        self.engines = []
        gc.collect()
        for r in refs:
            if r() is not None:
                self.fail("an engine outlived every reference to it")
        for a, _ in self.stale:
            self.note("touch an array after its engine was dropped")
            if isinstance(a, np.ndarray):
                a.view(np.uint8).sum()
                if a.flags.writeable:
                    a[...] = 0
            else:
                a.view(_torch().uint8).sum()
        self.stale = []


def ctypes_errors():
    import ctypes
    return (ctypes.ArgumentError,)


_TORCH = []


def _torch():
    if not _TORCH:
        try:
            import torch
            _TORCH.append(torch)
        except ImportError:
            _TORCH.append(None)
    return _TORCH[0]


@pytest.mark.parametrize("seed", _seeds(SEEDS))
def test_engine_sequence(seed):
    Driver(seed).run(n_ops=int(os.environ.get("ACTIVEKV_RANDOM_OPS", "120")))
    STATS["sequences"] += 1
    if os.environ.get("ACTIVEKV_RANDOM_STATS"):
        import resource
        print("STATS", STATS, "maxrss MiB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10)


# ----------------------------------------------------------------- the transformers adapter


class _Closed(Exception):
    """The cache was closed mid-sequence (the sequence ends there)."""


class CacheDriver:
    """ActiveKVCache against DynamicCache on the same inputs (docs/python.md: bit-identical
    logits on the host backend under deterministic algorithms). The model of the cache is
    the DynamicCache itself: its layers' K/V, its length, and the forward that cut it short."""

    def __init__(self, seed, torch, model, kw):
        self.seed = seed
        self.rng = np.random.default_rng(10_000 + seed)
        self.torch = torch
        self.model = model
        self.kw = kw
        self.log = []
        self.n_layers = model.config.num_hidden_layers
        self.vocab = model.config.vocab_size

    def note(self, what):
        self.log.append(what)

    def fail(self, msg):
        tail = "\n  ".join(self.log[-20:])
        raise Divergence(f"cache seed {self.seed}: {msg}\nlast calls:\n  {tail}")

    def chance(self, p):
        return self.rng.random() < p

    def tokens(self, n):
        return self.torch.from_numpy(self.rng.integers(0, self.vocab, (self.batch, n)))

    def forward(self, cache, ids, mask=None):
        return self.model(input_ids=ids, attention_mask=mask, use_cache=True,
                          **{self.kw: cache}).logits[:, -1].clone()

    def expect_raise(self, what, exc, fn, *a, **k):
        self.note(what)
        try:
            fn(*a, **k)
        except exc:
            return
        except Exception as e:  # noqa: BLE001 - anything else is a divergence
            self.fail(f"{what}: raised {type(e).__name__}: {e}, expected {exc}")
        self.fail(f"{what}: succeeded, expected {exc}")

    def same_logits(self, what, a, b):
        if not self.torch.equal(a, b):
            self.fail(f"{what}: logits differ (max |diff| "
                      f"{(a.float() - b.float()).abs().max().item():g})")

    def check_lengths(self):
        n = self.ref.get_seq_length()
        for i in (0, self.n_layers - 1, -1, -self.n_layers):
            got = self.cache.get_seq_length(i)
            if got != self.whole:
                self.fail(f"get_seq_length({i}) = {got}, model {self.whole}")
        lens = self.cache.layer_lengths
        want = [self.ref.layers[i].get_seq_length() for i in range(self.n_layers)]
        if lens != [w if w else None for w in want] and lens != want:
            self.fail(f"layer_lengths {lens}, DynamicCache's layers {want}")
        if (self.cache.cut_short is None) != (len(set(want)) == 1):
            self.fail(f"cut_short {self.cache.cut_short!r} with layers at {want}")
        if self.whole == n and len(set(want)) == 1:
            q = int(self.rng.integers(1, 3))
            got, ref = self.cache.get_mask_sizes(q, 0), self.ref.get_mask_sizes(q, 0)
            if tuple(got) != tuple(ref):
                self.fail(f"get_mask_sizes({q}) = {got}, DynamicCache {ref}")

    def check_history(self):
        """finish(), then every context's rows equal DynamicCache's K/V."""
        self.note("finish")
        self.cache.finish()
        for d in range(self.n_layers):
            keys, values = self.ref.layers[d].keys, self.ref.layers[d].values
            for b in range(self.batch):
                k, v = self.cache.contexts[b].read(d, 0, self.whole)
                want_k = keys[b, :, :self.whole].transpose(0, 1).contiguous()
                want_v = values[b, :, :self.whole].transpose(0, 1).contiguous()
                got_k, got_v = self.torch.from_numpy(k), self.torch.from_numpy(v)
                if want_k.dtype == self.torch.bfloat16:
                    got_k, got_v = got_k.view(self.torch.bfloat16), got_v.view(self.torch.bfloat16)
                if not (self.torch.equal(got_k, want_k) and self.torch.equal(got_v, want_v)):
                    self.fail(f"context {b} layer {d}: the host rows differ from DynamicCache's")

    def interrupted(self, ids):
        """A forward cut short by an exception from a forward hook on a random decoder
        layer (before or after it). Returns the K/V each layer was given by the same
        forward run to its end on a copy of DynamicCache, and the layers it reached."""
        torch = self.torch
        j = int(self.rng.integers(self.n_layers))
        post = self.chance(0.5)
        layer = self.model.model.layers[j]

        def boom(*_a, **_k):
            raise KeyError("interrupted")

        handle = (layer.register_forward_hook if post else layer.register_forward_pre_hook)(boom)
        reached = j + 1 if post else j
        self.note(f"forward of {ids.shape[1]} tokens interrupted {'after' if post else 'before'}"
                  f" layer {j}")
        try:
            for cache in (self.ref, self.cache):
                try:
                    self.forward(cache, ids)
                except KeyError:
                    pass
                else:
                    self.fail("the interrupted forward completed")
        finally:
            handle.remove()
        # the K/V of every layer of that forward: the same forward, run to its end on a copy
        full = copy.deepcopy(self.pre)
        given = {}
        orig = type(full).update

        def record(cache, k, v, layer_idx, *a, **kw):
            given[layer_idx] = (k.clone(), v.clone())
            return orig(cache, k, v, layer_idx, *a, **kw)

        full.update = record.__get__(full)
        with torch.no_grad():
            self.forward(full, ids)
        return reached, given, full

    def run(self, n_actions):
        torch = self.torch
        self.batch = int(self.rng.integers(1, 4))
        prompt = int(self.rng.integers(1, 9))
        steps_room = int(self.rng.integers(2, 14))
        max_len = prompt + steps_room
        route = self.pick_route()
        hooks = self.chance(0.5)
        self.note(f"ActiveKVCache(batch {self.batch}, prompt {prompt}, max {max_len}, {route}, "
                  f"hooks={hooks})")
        from activekv.transformers import ActiveKVCache
        from transformers import DynamicCache
        page = int(self.rng.integers(1, 5))
        try:
            self.cache = ActiveKVCache(self.model, max_cache_len=max_len, batch_size=self.batch,
                                       hooks=hooks, page_tokens=page, **route)
        except akv.Config:
            # the arena's 1 GiB device pool: too many pages of these tiny rows to keep
            # books on (akv_fit); the stage route then
            self.note("arena refused (Config): stage")
            self.cache = ActiveKVCache(self.model, max_cache_len=max_len, batch_size=self.batch,
                                       hooks=hooks, page_tokens=page)
        self.ref = DynamicCache(config=self.model.config)
        self.whole = 0
        self.last = torch.zeros((self.batch, self.vocab))
        closed = False
        try:
            with torch.no_grad():
                ids = self.tokens(prompt)
                self.pre = copy.deepcopy(self.ref)
                if self.chance(0.3):
                    try:
                        self.recover(ids)
                    except _Closed:
                        closed = True
                else:
                    a, b = self.forward(self.ref, ids), self.forward(self.cache, ids)
                    self.same_logits("prefill", a, b)
                    self.last = a
                self.whole = prompt
                if not closed:
                    self.check_lengths()
                for _ in range(0 if closed else n_actions):
                    r = self.rng.random()
                    room = self.whole < max_len
                    if r < 0.55 and room:
                        self.decode()
                    elif r < 0.65 and room:
                        self.pre = copy.deepcopy(self.ref)
                        try:
                            self.recover(self.next_ids())
                        except _Closed:
                            closed = True
                            break
                    elif r < 0.7:
                        self.check_history()
                    elif r < 0.85:
                        self.refusal(max_len)
                    elif r < 0.88:
                        self.note("close")
                        self.cache.close()
                        closed = True
                        break
                    elif not room:
                        self.expect_raise("decode past max_cache_len", ValueError, self.forward,
                                          self.cache, self.next_ids())
                        self.check_lengths()
                    self.check_lengths()
                if not closed and self.chance(0.5):
                    self.check_history()
        finally:
            self.cache.close()
        # after close every forward and finish is refused by the package
        with torch.no_grad():
            self.expect_raise("forward after close", akv.BadHandle, self.forward, self.cache,
                              self.next_ids())
        self.expect_raise("finish after close", akv.BadHandle, self.cache.finish)
        self.cache.close()

    def pick_route(self):
        if self.chance(0.7):
            return dict(route="stage")
        return dict(route="arena", device_pool_gib=1)

    def next_ids(self):
        return self.last.argmax(-1, keepdim=True) if self.chance(0.8) else self.tokens(1)

    def decode(self):
        ids = self.next_ids()
        self.note(f"decode {ids.flatten().tolist()}")
        a, b = self.forward(self.ref, ids), self.forward(self.cache, ids)
        self.same_logits(f"decode at {self.whole}", a, b)
        self.last = a
        self.whole += 1

    def recover(self, ids):
        """A forward cut short, the refusal of the next one, then the layers it did not
        reach updated with its K/V (docs/python.md, A forward cut short)."""
        torch = self.torch
        before = self.whole
        reached, given, full = self.interrupted(ids)
        n = ids.shape[1]
        want = before + n if reached == self.n_layers else before
        if self.cache.get_seq_length() != want:
            self.fail(f"get_seq_length {self.cache.get_seq_length()} after a forward cut "
                      f"short after {reached} of {self.n_layers} layers, model {want}")
        uneven = 0 < reached < self.n_layers
        if uneven:
            if self.cache.cut_short is None:
                self.fail(f"cut_short is None with {reached} of {self.n_layers} layers reached")
            exc = akv.UnevenLayers if before == 0 else akv.StepState
            self.expect_raise("the next forward after a cut", exc, self.forward, self.cache,
                              self.tokens(1))
            if before == 0 or self.chance(0.5):
                self.expect_raise("finish after a cut", (akv.StepState, akv.UnevenLayers),
                                  self.cache.finish) if before else None
            if self.chance(0.15):
                # the other way on: close() ends the cut-short step and frees the engine
                self.note("close after a cut")
                self.cache.close()
                if self.cache.engine is not None:
                    self.fail("close after a cut left the engine")
                raise _Closed()
            # the layers it did not reach, with the same K/V, in order
            for layer in range(reached, self.n_layers):
                k, v = given[layer]
                self.note(f"update({layer}) with the forward's K/V")
                self.cache.update(k, v, layer)
        elif reached == 0:
            if self.cache.cut_short is not None:
                self.fail(f"cut_short {self.cache.cut_short!r} with no layer reached")
            a, b = self.forward(self.ref, ids), self.forward(self.cache, ids)
            self.same_logits("the forward again", a, b)
            self.last = a
            self.whole = before + n
            return
        # the cache is whole again: the reference is the forward run to its end
        self.ref = full
        self.whole = before + n
        if self.cache.cut_short is not None:
            self.fail(f"cut_short {self.cache.cut_short!r} once every layer holds the tokens")
        # the interrupted forward's logits are lost: the next token is a random one
        self.last = torch.zeros((self.batch, self.vocab))
        self.last[:, int(self.rng.integers(self.vocab))] = 1

    def refusal(self, max_len):
        """A refused call; nothing changes (the decode after it stays bit-identical)."""
        torch = self.torch
        cache = self.cache
        k = int(self.rng.integers(11))
        shape = (self.batch, self.model.config.num_key_value_heads, 1,
                 self.model.config.head_dim)
        good = torch.zeros(shape, dtype=self.model.dtype)
        if k == 0:
            self.expect_raise("crop(1)", NotImplementedError, cache.crop, 1)
        elif k == 1:
            self.expect_raise("reorder_cache", NotImplementedError, cache.reorder_cache,
                              torch.arange(self.batch))
        elif k == 2:
            self.expect_raise("batch_select_indices", NotImplementedError,
                              cache.batch_select_indices, torch.arange(self.batch))
        elif k == 3:
            self.expect_raise("batch_repeat_interleave(2)", NotImplementedError,
                              cache.batch_repeat_interleave, 2)
        elif k == 4:
            self.expect_raise("reset", NotImplementedError, cache.reset)
        elif k == 5:
            bad = self.pick([True, 1.0, "0", None])
            self.expect_raise(f"update(layer_idx={bad!r})", TypeError, cache.update, good, good,
                              bad)
        elif k == 6:
            bad = self.pick([-1, self.n_layers, np.int64(-self.n_layers)])
            self.expect_raise(f"update(layer_idx={bad!r})", IndexError, cache.update, good, good,
                              bad)
        elif k == 7:
            other = torch.float16 if self.model.dtype != torch.float16 else torch.float32
            self.expect_raise("update(another dtype)", ValueError, cache.update,
                              good.to(other), good.to(other), 0)
        elif k == 8:
            self.expect_raise("forward of a larger batch", ValueError, self.model,
                              input_ids=torch.zeros((self.batch + 1, 1), dtype=torch.long),
                              use_cache=True, **{self.kw: cache})
        elif k == 9:
            self.expect_raise("multi-token update after the prompt", NotImplementedError,
                              self.forward, cache, self.tokens(2))
        else:
            self.expect_raise("copy", TypeError, copy.copy, cache)
            self.note("crop(0), batch_repeat_interleave(1)")
            cache.crop(0)
            cache.batch_repeat_interleave(1)
            self.ref.crop(0)

    def pick(self, seq):
        return seq[int(self.rng.integers(len(seq)))]


_MODELS = {}


@pytest.mark.parametrize("seed", _seeds(CACHE_SEEDS, "ACTIVEKV_RANDOM_CACHE_SEEDS"))
def test_cache_sequence(seed):
    from conftest import tiny_llama
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    rng = np.random.default_rng(seed)
    layers = int(rng.integers(1, 4))
    dtype = torch.float32 if rng.random() < 0.6 else torch.bfloat16
    key = (layers, dtype)
    if key not in _MODELS:
        torch_, model, kw = tiny_llama(layers)
        _MODELS[key] = (model.to(dtype), kw)
    model, kw = _MODELS[key]
    prev = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        CacheDriver(seed, torch, model, kw).run(int(os.environ.get("ACTIVEKV_RANDOM_CACHE_OPS",
                                                                   "14")))
    finally:
        torch.use_deterministic_algorithms(prev)
    STATS["sequences"] += 1
