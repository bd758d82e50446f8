"""A Hugging Face ``transformers`` cache whose full-attention history lives in ActiveKV.

``ActiveKVCache`` is a ``transformers.Cache`` (5.x) whose full-attention layers are
``ActiveKVLayer`` objects on transformers' own ``CacheLayerMixin`` API. Pass it to an
unmodified model as its cache (``cache=`` from transformers 5.20 on, ``past_key_values=``
before) in a manual step loop or in ``model.generate(...)``::

    from activekv.transformers import ActiveKVCache
    with ActiveKVCache(model, max_cache_len=4096, batch_size=2) as cache:
        out = model.generate(input_ids, past_key_values=cache, max_new_tokens=64)

What happens, per layer as transformers calls ``cache.update(k, v, layer_idx)``:

- **Prefill** (the layer holds no rows yet): each batch row's K/V, ``[H, T, D]`` on the
  model's device, is copied to the host as ``[T, H, D]`` contiguous rows and appended to
  that row's engine context (``Context.append_layer``); the prompt's own K/V is returned
  for the prompt's attention, as ``DynamicLayer`` does on an empty cache.
- **Decode** (one new token): at the first full-attention layer of a step the previous
  step's remaining leases are retired (blocking, the only host wait of the loop) and the
  engine's step is ended and the next one begun over every row's context. Each
  full-attention layer then begins a lease, makes torch's current stream wait (on the
  device) for the staged history, writes the token's K/V into the staging buffer at row
  ``len`` on torch's stream, and returns zero-copy strided views ``[B, H, len+1, D]`` over
  the staging buffer, which the model's own attention (SDPA) reads.
- **After attention**: the lease is sealed at the next layer's update (the last one at the
  step boundary): the attention-consumed event is recorded on torch's stream, which by then
  holds the layer's attention, the write-back of the new rows is enqueued and the lease
  sealed, all without a host wait; leases whose fences have all passed are then retired
  with ``akv_lease_try_retire``, which queries events and never waits (it answers
  ``AKV_ERR_NOT_READY`` while one is pending, and the lease waits for the step boundary).
  With ``hooks=True`` a forward hook on each attention module seals the lease right after
  its attention instead (the staging buffer is free a layer's compute sooner, at the cost of
  a module hook per layer on the host).
- **Sliding-window layers** of hybrid models stay transformers' own layer classes
  (``DynamicSlidingWindowLayer``, chosen from ``config.layer_types`` as ``DynamicCache``
  chooses them); only full-attention layers are staged, dense index ``d`` being the d-th
  full-attention layer.

Routes: "stage" (device pool 0) and "arena" (retained pages copied device-to-device into
the staging buffer) hand SDPA one contiguous history per row. "paged" is refused:
it leaves retained pages in the device pool and describes them with a page table
(``akv_view.page_map``), which only a paged attention kernel can read; SDPA takes one
dense K/V tensor per row.

Threading: like the engine, a cache is used from one thread at a time (an update from a
second thread while one is in flight raises Busy). Tensors returned by ``update`` alias
the engine's staging buffers: they are valid for that layer's attention only (the buffer
is reused two layers later) and must not be kept; one kept anyway keeps the engine's
memory alive (stale rows, never freed memory).

Lifetime: ``close()`` (or leaving the ``with`` block) ends the open step, closes the
contexts and the engine and removes the forward hooks. Call ``finish()`` to end the open
step but keep the history readable (``contexts[i].read(...)``).
"""

from __future__ import annotations

import contextlib
import ctypes
import operator
import weakref
from typing import Any, Sequence

import numpy as np

try:
    import torch
    from transformers import cache_utils as _cache_utils
    from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache, DynamicLayer
except ImportError as exc:  # pragma: no cover - exercised only without the optional deps
    raise ImportError(
        "activekv.transformers needs torch and transformers>=5 "
        "(pip install torch transformers): " + str(exc)
    ) from exc

import activekv as akv
from activekv import _lib
from activekv._api import _counted_export, _target_pages, _uint
from activekv.errors import (
    STATUS_VALUES,
    ActiveKVError,
    BadHandle,
    Busy,
    LeaseOrder,
    Quarantined,
    StepState,
    TransportError,
    UnevenLayers,
    error_for,
)

__all__ = ["ActiveKVCache", "ActiveKVLayer", "dense_layer_indices", "engine_config_for"]

_DTYPES = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}

# transformers' layers that hold tokens (see ActiveKVCache.__init__, kv_layers): the
# K/V layers and the linear-attention ones (conv, recurrent), where transformers has them.
# A transformers whose linear-attention layers say no token count (no get_seq_length:
# releases before it was added) leaves them uncounted, as before they were counted:
# docs/python.md says what that leaves unchecked.
_LINEAR_LAYER = getattr(_cache_utils, "LinearAttentionCacheLayerMixin", None)
if _LINEAR_LAYER is not None and not callable(getattr(_LINEAR_LAYER, "get_seq_length", None)):
    _LINEAR_LAYER = None
_TOKEN_LAYERS = (DynamicLayer,) if _LINEAR_LAYER is None else (DynamicLayer, _LINEAR_LAYER)

# torch's current CUDA stream as a raw cudaStream_t without building a Stream object
# (a few microseconds a layer); the public call is the fallback.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


# A decode update's K/V that require grad under grad mode (see _Driver.check_states).
_GRAD_REFUSED = ("ActiveKVCache: a decode update with K/V that require grad while grad mode is "
                 "on; the engine's history carries no autograd graph: decode under "
                 "torch.no_grad() or torch.inference_mode()")


# akv_lease_try_retire's "not yet" (AKV_ERR_NOT_READY, 24): fences pending, nothing changed.
_NOT_READY = STATUS_VALUES["AKV_ERR_NOT_READY"]
_BAD_HANDLE = STATUS_VALUES["AKV_ERR_BAD_HANDLE"]


# Sealed leases gathered before akv_lease_try_retire is tried: each try queries the
# oldest lease's tail event (one cudaEventQuery, a few microseconds in a decoding
# process), so trying after every layer costs host time for nothing; a lease left sealed
# only holds its staging buffer's reuse, which the engine orders on the device anyway.
_RETIRE_BATCH = 4


def _try_retire_pending(status: int) -> bool:
    """True when a failed akv_lease_try_retire only means "fences still pending" (it then
    changed nothing): AKV_ERR_NOT_READY, matched by value. Every other status, one newer
    than this package knows included, is an error and is raised."""
    return status == _NOT_READY


# --------------------------------------------------------------------------- #
# The lease hot path. The structs are the package's one mirror of akv.h        #
# (activekv._lib), allocated once per cache and refilled; the calls have their #
# prototypes set once on a private CDLL object, so the per-layer decode path   #
# builds no Python objects.                                                    #
# --------------------------------------------------------------------------- #

_Fence = _lib.akv_fence
_View = _lib.akv_view
_Receipt = _lib.akv_receipt


class _LeaseAPI:
    """The lease calls of akv.h with prototypes set once on a private CDLL handle."""

    def __init__(self, lib_path: str):
        lib = ctypes.CDLL(lib_path)
        vp, u32, st = ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int

        def proto(name, *args):
            fn = getattr(lib, name)
            fn.argtypes = list(args)
            fn.restype = st
            return fn

        self.begin = proto("akv_lease_begin", vp, u32, ctypes.POINTER(vp))
        self.wait_ready = proto("akv_lease_wait_ready", vp, vp, ctypes.POINTER(_View))
        self.mark_consumed = proto("akv_lease_mark_consumed", vp, vp, ctypes.POINTER(_Fence))
        self.write_back = proto("akv_lease_write_back", vp, vp, u32, ctypes.POINTER(_Fence))
        self.seal = proto("akv_lease_seal", vp, _Fence, _Fence)
        self.retire = proto("akv_lease_retire", vp, ctypes.POINTER(_Receipt))
        self.stream_synchronize = proto("akv_stream_synchronize", vp, vp)
        self.last_error = lib.akv_engine_last_error
        self.last_error.argtypes = [vp]
        self.last_error.restype = ctypes.c_char_p
        self.status_string = lib.akv_status_string
        self.status_string.argtypes = [st]
        self.status_string.restype = ctypes.c_char_p
        self.try_retire = None
        if hasattr(lib, "akv_lease_try_retire"):
            self.try_retire = proto("akv_lease_try_retire", vp, ctypes.POINTER(_Receipt))
        self._lib = lib  # keeps the handle (and so the library) alive


def _lib_path(engine: Any) -> str:
    lib = getattr(engine, "_lib", None)
    path = getattr(lib, "_name", None)
    if not path:
        raise RuntimeError("activekv.transformers: the engine does not expose its loaded library")
    return path


def _raw(handle: Any) -> int:
    """The address held by a ctypes pointer / c_void_p / int handle."""
    if isinstance(handle, int):
        return handle
    value = ctypes.cast(handle, ctypes.c_void_p).value
    if not value:
        raise RuntimeError("activekv.transformers: a NULL engine handle")
    return value


def _error(status: int, message: str) -> Exception:
    """The package's exception for a C status (one class per status), with the message."""
    return error_for(status, message)


# --------------------------------------------------------------------------- #
# Geometry                                                                     #
# --------------------------------------------------------------------------- #


def _text_config(config: Any) -> Any:
    get = getattr(config, "get_text_config", None)
    if get is None:
        return config
    try:
        return get(decoder=True)
    except TypeError:
        return get()


def dense_layer_indices(config: Any) -> tuple[list[int], list[Any]]:
    """(full-attention layer indices, transformers' own layer objects for every layer).

    The layer classes come from ``DynamicCache(config=config)``, so a hybrid model's
    sliding-window (and any other non-full) layers are exactly the ones ``DynamicCache``
    would use; a layer whose class is exactly ``DynamicLayer`` is a full-attention layer
    and is staged through the engine instead.
    """
    probe = DynamicCache(config=config)
    layers = list(probe.layers)
    n_layers = _text_config(config).num_hidden_layers
    if not layers:  # a transformers without config-driven layer selection: all full
        layers = [DynamicLayer() for _ in range(n_layers)]
    dense = [i for i, layer in enumerate(layers) if type(layer) is DynamicLayer]
    return dense, layers


def _layer_geometry(lc: Any) -> tuple[int, int]:
    """(KV heads, head_dim) of one layer's config (or of a homogeneous model's)."""
    head_dim = getattr(lc, "head_dim", None) or lc.hidden_size // lc.num_attention_heads
    kv_heads = getattr(lc, "num_key_value_heads", None) or lc.num_attention_heads
    return int(kv_heads), int(head_dim)


def _dense_geometry(tc: Any, dense: Sequence[int]) -> tuple[int, int]:
    """(KV heads, head_dim) of the full-attention layers, the ones the engine stages.

    A heterogeneous config (transformers' ``per_layer_config``: Gemma 4 gives its
    full-attention layers another head_dim, and may give them other KV heads, than its
    sliding layers) refuses to give those attributes globally (a RuntimeError); they are
    read from each full-attention layer's own config. The engine has one geometry:
    full-attention layers that disagree raise ValueError."""
    if not getattr(tc, "is_heterogeneous", False):
        return _layer_geometry(tc)
    per_layer = tc.per_layer_config
    found: dict = {}
    for i in dense:
        found.setdefault(_layer_geometry(per_layer[i]), []).append(i)
    if len(found) != 1:
        raise ValueError(
            "ActiveKVCache: the full-attention layers differ in (kv_heads, head_dim): %s; the "
            "engine stages one geometry" % ", ".join("%s at layers %s" % (g, idx)
                                                     for g, idx in found.items()))
    return next(iter(found))


def engine_config_for(
    config: Any,
    *,
    max_cache_len: int,
    batch_size: int,
    dtype: torch.dtype,
    backend: str,
    device_ordinal: int = 0,
    host_pool_gib: int | None = None,
    device_pool_gib: int = 0,
    route: str = "stage",
    page_tokens: int = 256,
) -> dict:
    """The akv.Engine keyword arguments for a model config (see ActiveKVCache).

    Raises ValueError for route="paged" (see the module docstring), an unsupported dtype,
    a model without full-attention layers or non-positive sizes; the fit itself
    (akv.fit) raises the package's exceptions.
    """
    if route == "paged":
        raise ValueError(
            "ActiveKVCache: route='paged' is not supported: it leaves retained pages in the "
            "device pool and describes them with a page table (akv_view.page_map) that only a "
            "paged attention kernel can read, while transformers' attention (SDPA) takes one "
            "contiguous K/V tensor per row; use route='stage' or route='arena'"
        )
    if route not in ("stage", "arena"):
        raise ValueError("ActiveKVCache: route must be 'stage' or 'arena', not %r" % (route,))
    if not isinstance(dtype, torch.dtype) or dtype not in _DTYPES:
        if not isinstance(dtype, torch.dtype):
            # a name ("float16", "bf16") or numpy's type: said as such, not as a dtype that
            # "is not f16"
            raise ValueError("ActiveKVCache: dtype=%r is not a torch.dtype; pass "
                             "torch.bfloat16, torch.float16 or torch.float32" % (dtype,))
        raise ValueError("ActiveKVCache: K/V dtype %s is not torch.bfloat16, torch.float16 or "
                         "torch.float32 (bf16, f16, f32)" % (dtype,))
    sizes = dict(max_cache_len=max_cache_len, batch_size=batch_size, page_tokens=page_tokens,
                 device_pool_gib=device_pool_gib)
    if host_pool_gib is not None:
        sizes["host_pool_gib"] = host_pool_gib
    for name, value in sizes.items():
        # Python or numpy integers, never bool, float or str: int() would turn 1.5 GiB
        # into 1 and "1" into 1 silently
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise TypeError("ActiveKVCache: %s=%r is not an int" % (name, value))
    max_cache_len, batch_size, page_tokens, device_pool_gib = (
        int(max_cache_len), int(batch_size), int(page_tokens), int(device_pool_gib))
    if max_cache_len <= 0 or batch_size <= 0:
        raise ValueError("ActiveKVCache: max_cache_len and batch_size must be positive")
    tc = _text_config(config)
    dense, _ = dense_layer_indices(config)
    if not dense:
        raise ValueError("ActiveKVCache: the model has no full-attention layer to stage")
    kv_heads, head_dim = _dense_geometry(tc, dense)
    cfg = dict(
        backend=backend,
        device_ordinal=device_ordinal,
        n_dense_layers=len(dense),
        kv_heads=int(kv_heads),
        head_dim=int(head_dim),
        dtype=_DTYPES[dtype],
        max_tokens=int(max_cache_len),
        page_tokens=int(min(page_tokens, max_cache_len)),
        device_pool_gib=int(device_pool_gib),
        max_contexts=int(batch_size),
        fit_mode="refuse",
        route=route,
    )
    if host_pool_gib is None:
        # The smallest whole-GiB pinned pool that holds batch_size histories (DESIGN §3:
        # an explicit size, computed from the geometry, never from free memory).
        report = akv.fit(**dict(cfg, host_pool_gib=1))
        host_pool_gib = int(report.host_pool_gib_needed)
    cfg["host_pool_gib"] = int(host_pool_gib)
    return cfg


# --------------------------------------------------------------------------- #
# Staging-buffer tensors                                                       #
# --------------------------------------------------------------------------- #


def _buffer_tensor(engine: Any, address: int, nbytes: int, dtype: torch.dtype,
                   device: torch.device):
    """A flat tensor of `dtype` aliasing [address, address+nbytes) of the engine's memory
    (zero copy). Its base is an akv export: while it, or any tensor derived from it (those
    update returns), is alive, the engine's memory is not freed (Engine.close defers it),
    so a tensor kept past close() holds stale rows but never freed memory. No stream
    entry: ordering is the engine's events. Called with inference mode off (see _views)."""
    # counted first, then the engine checked (_counted_export): a close made by the
    # caller's code on this thread inside the update (a gc callback, a finalizer) never
    # leaves a tensor over a freed staging buffer
    if device.type == "cuda":
        exp = _counted_export(engine, address, (nbytes,), None, "|u1", True)
        flat = torch.as_tensor(exp, device=device)
    else:
        import numpy as np  # noqa: PLC0415 - numpy is a dependency of activekv

        flat = torch.from_numpy(np.asarray(_counted_export(engine, address, (nbytes,), None,
                                                           "|u1", False)))
    return flat.view(dtype)


# --------------------------------------------------------------------------- #
# The engine driver shared by the layers of one cache                          #
# --------------------------------------------------------------------------- #


class _Driver:
    """Owns the engine, the contexts, the step and the leases of one ActiveKVCache."""

    def __init__(self, engine_cfg: dict, device: torch.device, dtype: torch.dtype,
                 n_dense: int, target_pages, burst_pages: int, log, log_level: str):
        kwargs = dict(engine_cfg, log_level=log_level)
        if log is not None:
            kwargs["log"] = log
        self.engine = akv.Engine(**kwargs)
        try:
            self.api = _LeaseAPI(_lib_path(self.engine))
            self.eng = _raw(self.engine._handle)
            info = self.engine.info()
            self.backend = self.engine.backend
            if (self.backend == "cuda") != (device.type == "cuda"):
                raise ValueError(
                    "ActiveKVCache: the engine's backend is %r but the model is on %s"
                    % (self.backend, device))
            self.staging_extent = int(info.staging_bytes) // 2  # one of the two buffers
        except BaseException:
            self.engine.close()
            raise
        self.device = device
        self.device_index = device.index if device.index is not None else 0
        self.dtype = dtype
        self.itemsize = torch.empty((), dtype=dtype).element_size()
        self.n_dense = n_dense
        self.max_tokens = int(engine_cfg["max_tokens"])
        self.kv_heads = int(engine_cfg["kv_heads"])
        self.head_dim = int(engine_cfg["head_dim"])
        self.max_contexts = int(engine_cfg["max_contexts"])
        self.target_pages = target_pages
        self.burst_pages = burst_pages
        self.contexts: list | None = None
        self.batch = 0
        # Every K/V layer of the model in order: (model layer index, dense index for a
        # full-attention layer, else transformers' own layer object); set by the cache.
        self.kv_layers: list = []
        self.others: list = []  # the layer objects of kv_layers (sliding-window, ...)
        self.first_kv = 0  # the model layer where a forward starts
        self.first_kv_dense = True  # ... and it is full-attention layer 0
        self.layer_len = [0] * n_dense  # rows each dense layer holds, this step's included
        self.next_dense = 0  # the dense layer the open step leases next
        # The one lease begun but not sealed yet: (dense index, handle, stream).
        self.pending: tuple[int, int, int] | None = None
        self.sealed: list[int] = []  # sealed, unretired leases, oldest first
        self.failed: BaseException | None = None
        self.closing = False  # close() began: unusable, and close() again finishes it
        self.host_stream = None
        self.host_stream_raw = 0
        if self.backend == "host":
            self.host_stream = self.engine.default_stream()
            self.host_stream_raw = _raw(getattr(self.host_stream, "_handle", self.host_stream))
        # Preallocated structs of the hot path.
        self.view = _View()
        self.view_ref = ctypes.byref(self.view)
        self.attn = [_Fence() for _ in range(n_dense)]
        self.tail = [_Fence() for _ in range(n_dense)]
        self.attn_refs = [ctypes.byref(f) for f in self.attn]
        self.tail_refs = [ctypes.byref(f) for f in self.tail]
        self.lease_box = ctypes.c_void_p()
        self.lease_ref = ctypes.byref(self.lease_box)
        # Staging buffer base -> (rows, K, V, K row, V row) views of the open step (_views).
        self.views: dict[int, tuple] = {}
        self.receipt = _Receipt()
        self.receipt_ref = ctypes.byref(self.receipt)
        self.buffers: dict[int, torch.Tensor] = {}  # staging buffer base -> flat tensor
        self.try_retire_ok = self.api.try_retire is not None
        # Counters for the harness and the tests.
        self.leases = 0
        self.retired_early = 0  # by try_retire, off the critical path
        self.retired_blocking = 0
        self.hook_seals = 0
        self.fallback_seals = 0

    @property
    def step_open(self) -> bool:
        """The engine's step is open: read from the engine, which records it right at its
        call (Engine.step_begin / step_end), so an interrupt landing anywhere in between
        leaves both agreeing (a flag of the cache's own, set around those calls, could
        not be set at the library's call itself)."""
        engine = self.engine
        return engine is not None and engine._step_open

    def torch_stream(self) -> int:
        """torch's current CUDA stream as an akv_stream. torch's default stream is the legacy
        default stream, whose cudaStream_t is 0; the engine refuses a NULL stream, so it is
        named by its other handle, cudaStreamLegacy ((cudaStream_t)0x1), the same stream."""
        raw = _raw_stream
        if raw is not None:
            return raw(self.device_index) or 1  # 1 = cudaStreamLegacy
        return torch.cuda.current_stream(self.device).cuda_stream or 1

    # -- errors -------------------------------------------------------------

    def check(self, status: int, what: str) -> None:
        if status != 0:
            msg = self.api.last_error(self.eng)
            text = "%s: %s" % (what, msg.decode("utf-8", "replace") if msg else "")
            err = _error(status, text)
            if isinstance(err, TransportError):  # transport failed / quarantined: done
                self.failed = err
            raise err

    def forget_quarantined(self) -> None:
        """After a quarantine of the engine made outside the cache (``cache.engine
        .quarantine()``) the leases it released are dead handles, which the library hands
        out again to later leases (of any engine): they are dropped here, never passed to
        the library again, and the cache is unusable (Quarantined)."""
        if self.engine is not None and self.engine._quarantined and self.failed is None:
            self.failed = Quarantined.make("ActiveKVCache: its engine was quarantined")
            self.pending = None
            self.sealed.clear()

    def enter(self, what: str):
        """Checks the cache is usable and takes its engine for a call (Engine._enter):
        returns (engine, held). The engine is read before the check and checked again once
        taken: the caller's code can run on this thread in between (a gc callback or a
        finalizer at an allocation), and a close() made there (a call of its own then)
        left the cache without an engine, which the call read next (AttributeError).
        Once taken, a close() there is nested in this call and refused (Busy)."""
        engine = self.engine
        self.usable()
        held = engine._enter(what)
        try:
            if self.engine is not engine:  # closed in between: nothing was done
                self.usable()
        except BaseException:
            if held:
                engine._release()  # no frame before the engine is given back
                engine._left()
            raise
        return engine, held

    def usable(self) -> None:
        if self.engine is None or self.closing:
            raise BadHandle.make("ActiveKVCache is closed")
        self.forget_quarantined()
        if self.failed is not None:
            failed = self.failed
            what = str(failed) or type(failed).__name__  # a bare KeyboardInterrupt says ""
            raise Quarantined.make("ActiveKVCache is unusable after an earlier failure (%s); "
                                   "close it" % (what,)) from failed
        if self.engine._handle is None:
            raise BadHandle.make("ActiveKVCache: its engine was closed")

    # -- prefill ------------------------------------------------------------

    def open_contexts(self, batch: int) -> None:
        if batch > self.max_contexts:
            raise ValueError(
                "ActiveKVCache: batch of %d rows but the cache was made for batch_size=%d"
                % (batch, self.max_contexts))
        ctxs = []
        try:
            for _ in range(batch):
                ctxs.append(self.engine.open_context(target_pages=self.target_pages,
                                                     burst_pages=self.burst_pages))
        except BaseException:
            for c in ctxs:
                c.close()
            raise
        self.contexts = ctxs
        self.batch = batch
        # The shape of one decode step's K and V (check_states' fast path).
        self.decode_shape = torch.Size((batch, self.kv_heads, 1, self.head_dim))

    def check_init(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """ValueError for what a full-attention layer's lazy_initialization refuses: K or V
        not [batch, kv_heads, tokens, head_dim] with batch >= 1, of another dtype or device,
        K and V of different shapes, a batch larger than batch_size before the contexts
        are open, of another size than theirs after. Changes nothing."""
        for name, t in (("K", key_states), ("V", value_states)):
            shape = list(t.shape)
            if (t.dim() != 4 or shape[0] < 1 or shape[1] != self.kv_heads
                    or shape[3] != self.head_dim):
                raise ValueError("ActiveKVCache: %s of shape %s; expected [batch, %d, tokens, %d] "
                                 "(batch, kv_heads, tokens, head_dim) with batch >= 1"
                                 % (name, shape, self.kv_heads, self.head_dim))
            if t.dtype != self.dtype or t.device != self.device:
                raise ValueError("ActiveKVCache was made for %s on %s, got %s %s on %s"
                                 % (self.dtype, self.device, name, t.dtype, t.device))
        if key_states.shape != value_states.shape:
            raise ValueError("ActiveKVCache: K %s and V %s differ"
                             % (list(key_states.shape), list(value_states.shape)))
        batch = int(key_states.shape[0])
        if self.contexts is None and batch > self.max_contexts:
            raise ValueError(
                "ActiveKVCache: batch of %d rows but the cache was made for batch_size=%d"
                % (batch, self.max_contexts))
        if self.contexts is not None and batch != self.batch:
            raise ValueError("ActiveKVCache holds %d rows, got K of shape %s"
                             % (self.batch, list(key_states.shape)))

    def check_states(self, key_states: Any, value_states: Any, tokens: int | None) -> None:
        """ValueError/TypeError unless K and V are [batch, kv_heads, tokens, head_dim] tensors
        of the cache's dtype on its device (tokens None: any). Checked before anything
        changes: torch's copy_ would broadcast a wrong shape and convert a wrong dtype."""
        if tokens == 1:  # the decode step's fast path: one comparison each, no message
            shape, dtype, device = self.decode_shape, self.dtype, self.device
            if (key_states.shape == shape and value_states.shape == shape
                    and key_states.dtype is dtype and value_states.dtype is dtype
                    and key_states.device == device and value_states.device == device
                    and not key_states.requires_grad and not value_states.requires_grad):
                return
        for name, t in (("key_states", key_states), ("value_states", value_states)):
            if not isinstance(t, torch.Tensor):
                raise TypeError("ActiveKVCache: %s is a %s, not a tensor" % (name, type(t).__name__))
            shape = tuple(t.shape)
            if (len(shape) != 4 or shape[0] != self.batch or shape[1] != self.kv_heads
                    or shape[3] != self.head_dim or (tokens is not None and shape[2] != tokens)):
                raise ValueError(
                    "ActiveKVCache: %s of shape %s; expected [%d, %d, %s, %d] (batch, kv_heads, "
                    "tokens, head_dim)" % (name, list(shape), self.batch, self.kv_heads,
                                           "T" if tokens is None else tokens, self.head_dim))
            if t.dtype != self.dtype or t.device != self.device:
                raise ValueError("ActiveKVCache was made for %s on %s, got %s %s on %s"
                                 % (self.dtype, self.device, name, t.dtype, t.device))
        if key_states.shape != value_states.shape:
            raise ValueError("ActiveKVCache: key_states %s and value_states %s differ"
                             % (list(key_states.shape), list(value_states.shape)))
        if (tokens is not None and torch.is_grad_enabled()
                and (key_states.requires_grad or value_states.requires_grad)):
            # The decode row is written in place into the engine's staging buffer, which
            # cannot carry autograd history (and the history it stages carries none): the
            # gradient through the cache would silently be wrong. A prefill only copies.
            raise ValueError(_GRAD_REFUSED)

    def append(self, d: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.check_states(key_states, value_states, None)
        n = int(key_states.shape[-2])
        # Every full-attention layer of one forward sees the same tokens: a prefill of
        # another count than a layer already prefilled (or a decode row at a layer the
        # prefill skipped) would leave the layers uneven for good, with no way back.
        held = max(self.layer_len)
        if held and n != held:
            raise ValueError("ActiveKVCache: a prefill of %d tokens at full-attention layer %d "
                             "while the others hold %d rows; every layer's prefill is the same "
                             "prompt" % (n, d, held))
        if self.layer_len[d] + n > self.max_tokens:
            raise ValueError("ActiveKVCache: %d rows exceed max_cache_len=%d"
                             % (self.layer_len[d] + n, self.max_tokens))
        # [B, H, T, D] on the model's device -> [B, T, H, D] contiguous there (token-major
        # rows, the host pool's layout), then one device-to-host transfer each for K and V.
        # A sparse or mkldnn K/V (contiguous() refuses them) by its dense values.
        if key_states.layout is not torch.strided:
            key_states = key_states.to_dense()
        if value_states.layout is not torch.strided:
            value_states = value_states.to_dense()
        k_host = key_states.detach().transpose(1, 2).contiguous().cpu()
        v_host = value_states.detach().transpose(1, 2).contiguous().cpu()
        done = 0
        try:
            for b, ctx in enumerate(self.contexts):
                ctx.append_layer(d, k_host[b], v_host[b])
                done += 1
            self.layer_len[d] += n
        except BaseException as exc:
            if done < len(self.contexts) and self._appended(self.contexts[done], d):
                done += 1  # its append happened (an interrupt landed as it returned)
            if done:
                # Rows appended cannot be taken back: the rows before the failure hold this
                # layer's prompt, the others not, and the same prefill again would append
                # it twice. The cache is unusable (close() remains).
                self.failed = UnevenLayers.make(
                    "ActiveKVCache: the prefill of full-attention layer %d failed after %d of "
                    "%d rows were appended (%r)" % (d, done, len(self.contexts), exc))
            raise

    def _appended(self, ctx, d: int) -> bool:
        """Whether the context's layer d holds a row past the cache's count: its append
        happened though the cache did not count it. Asked of the library (a read of that
        row, which it refuses past the layer's rows); True when it cannot tell."""
        try:
            ctx.read(d, self.layer_len[d], 1)
        except akv.InvalidArgument:
            return False
        except Exception:  # noqa: BLE001 - unknown: taken as appended (the safe side)
            return True
        return True

    def check_forward(self, key_states: Any, value_states: Any, at_boundary: bool) -> None:
        """What the full-attention layers of a forward will refuse, checked at one of the
        model's other layers (sliding-window, ...) first, which transformers updates in the
        same forward and which would otherwise take K/V that the full-attention layers then
        refuse. Independent of the layer: a closed or failed cache and a batch of another
        size or of another dtype or device (the model computes every layer's K/V alike); at
        a layer before the first full-attention one (`at_boundary`: the forward starts the
        prefill or the next step) also a prompt or a row past max_cache_len, a
        multi-token update after the prompt, a step that cannot begin (StepState,
        UnevenLayers) and a decode with K/V that require grad under grad mode. Raises what
        the full-attention layer would."""
        self.usable()
        # What transformers' own layers take unchecked: a K or V that is not a tensor failed
        # inside them with AttributeError, and one of another rank or K and V of other
        # batch or token counts changed the layer before failing (a sliding-window layer
        # counted the tokens, then torch.cat refused). Heads and head_dim are the layer's
        # own (a hybrid model's other layers may differ from the full-attention ones).
        for name, t in (("key_states", key_states), ("value_states", value_states)):
            if not isinstance(t, torch.Tensor):
                raise TypeError("ActiveKVCache.update: %s is a %s, not a tensor"
                                % (name, type(t).__name__))
            if t.dim() != 4:
                raise ValueError("ActiveKVCache: %s of shape %s; expected [batch, kv_heads, "
                                 "tokens, head_dim]" % (name, list(t.shape)))
        if (key_states.shape[0] != value_states.shape[0]
                or key_states.shape[2] != value_states.shape[2]):
            raise ValueError("ActiveKVCache: key_states %s and value_states %s hold other "
                             "batch or token counts"
                             % (list(key_states.shape), list(value_states.shape)))
        if value_states.dtype != key_states.dtype or value_states.device != key_states.device:
            raise ValueError("ActiveKVCache was made for %s on %s, got V %s on %s"
                             % (self.dtype, self.device, value_states.dtype, value_states.device))
        if key_states.dtype != self.dtype or key_states.device != self.device:
            raise ValueError("ActiveKVCache was made for %s on %s, got K %s on %s"
                             % (self.dtype, self.device, key_states.dtype, key_states.device))
        n_new = int(key_states.shape[-2])
        if at_boundary and not max(self.layer_len) and n_new > self.max_tokens:
            raise ValueError("ActiveKVCache: %d rows exceed max_cache_len=%d"
                             % (n_new, self.max_tokens))
        batch = int(key_states.shape[0])
        if self.contexts is None:
            if batch > self.max_contexts:
                raise ValueError(
                    "ActiveKVCache: batch of %d rows but the cache was made for batch_size=%d"
                    % (batch, self.max_contexts))
            return
        if batch != self.batch:
            raise ValueError("ActiveKVCache holds %d rows, got K of shape %s"
                             % (self.batch, list(key_states.shape)))
        if not at_boundary or not max(self.layer_len):
            return
        if self.partial():
            raise self.partial_error()
        if n_new != 1:
            raise NotImplementedError(
                "ActiveKVCache: an update of %d tokens after the prompt (chunked prefill, "
                "assisted or speculative decoding) is not supported; decode one token per "
                "step (every layer holds %d tokens: a forward cut short after its last "
                "layer's update left them all there, so go on with the next token)"
                % (n_new, self.whole_length()))
        if self.layer_len[0] + 1 > self.max_tokens:
            raise ValueError("ActiveKVCache: a new row exceeds max_cache_len=%d" % self.max_tokens)
        # begin_step's refusals: the previous step interrupted between layers, a prefill
        # that did not reach every full-attention layer
        if self.step_open and self.next_dense != self.n_dense and not self.step_untouched():
            raise self.partial_step_error()
        if min(self.layer_len) != max(self.layer_len):
            raise UnevenLayers.make(
                "ActiveKVCache: full-attention layers hold different lengths (%s); a "
                "prefill did not reach every layer" % (self.layer_len,))
        if torch.is_grad_enabled() and (key_states.requires_grad or (
                isinstance(value_states, torch.Tensor) and value_states.requires_grad)):
            raise ValueError(_GRAD_REFUSED)

    # -- a forward cut short between its layers ------------------------------
    #
    # Invariant: every full-attention layer of one forward takes the same tokens, and
    # rows given to a layer cannot be taken back (a step adds one row to every layer,
    # an append cannot be undone). A forward cut short between its layers (an exception
    # in the model, a refused update, a Ctrl-C) leaves the layers before the cut holding
    # its tokens and the others not. Nothing is dropped or filled in silently: every
    # later update, finish() and the first layer of a forward refuse with the state in
    # words and the two ways on (the remaining layers updated with the same tokens'
    # K/V, which completes the cut-short forward; or close(), which frees everything).

    def partial_step_error(self) -> Exception:
        """StepState for a decode step whose forward stopped after `next_dense` layers."""
        k, n = self.next_dense, self.n_dense
        return StepState.make(
            "ActiveKVCache: the open step updated %d of %d full-attention layers: a forward "
            "was cut short between its layers, and its token's rows, given to full-attention "
            "layers 0..%d, cannot be taken back. To go on, update full-attention layers "
            "%d..%d with that token's K/V, in order; otherwise close() the cache, which "
            "ends the step and frees the engine, and start again with a new one"
            % (k, n, k - 1, k, n - 1))

    def partial_prefill_error(self) -> Exception:
        """UnevenLayers for a prefill that reached some full-attention layers only."""
        held = [d for d in range(self.n_dense) if self.layer_len[d]]
        missing = [d for d in range(self.n_dense) if not self.layer_len[d]]
        return UnevenLayers.make(
            "ActiveKVCache: full-attention layers hold different lengths (%s): a prefill was "
            "cut short between its layers (a prefill did not reach every layer), and the "
            "rows appended to layers %s cannot be taken back. To go on, update the "
            "full-attention layers %s with the same prompt's K/V; otherwise close() the "
            "cache, which frees the engine, and prefill a new one"
            % (self.layer_len, held, missing))

    def partial(self) -> bool:
        """A forward was cut short between its layers (see partial_step_error)."""
        return ((self.step_open and self.next_dense != self.n_dense
                 and not self.step_untouched())
                or (max(self.layer_len) > 0 and min(self.layer_len) == 0))

    def partial_error(self) -> Exception:
        if max(self.layer_len) > 0 and min(self.layer_len) == 0:
            return self.partial_prefill_error()
        return self.partial_step_error()

    # -- every K/V layer of the model ----------------------------------------
    #
    # A hybrid model's other K/V layers (sliding-window, chunked: transformers' own
    # DynamicLayer subclasses) take the same tokens in the same forward; a forward cut
    # short can leave them uneven as well, with the full-attention layers even (a cut
    # before the first full-attention layer, or after the last). Their counts are read
    # from the layers themselves (``get_seq_length``: every token a layer took, its
    # window's evicted ones included), never kept apart, so an interrupt cannot make the
    # two disagree.

    def layer_counts(self) -> list:
        """(model layer index, tokens it holds) for every K/V layer of the model, in order."""
        dense = self.layer_len
        return [(i, dense[ref] if type(ref) is int else int(ref.get_seq_length()))
                for i, ref in self.kv_layers]

    def whole_length(self) -> int:
        """The tokens every K/V layer of the model holds: the length of the last forward
        that reached every layer (as akv_context_length is the minimum over a context's
        layers). Equal to every layer's own count unless a forward was cut short between
        its layers (or is under way)."""
        low = min(self.layer_len)
        for ref in self.others:
            n = int(ref.get_seq_length())  # a linear-attention layer's is a tensor
            if n < low:
                low = n
        return low

    def cut_short(self) -> Exception | None:
        """The error a new forward raises after one cut short between its layers (the K/V
        layers uneven), None when every layer holds the same tokens. StepState when every
        layer held the prompt (a decode step cut short), UnevenLayers when some do not hold
        it yet (a prefill cut short)."""
        if not self.others:
            if max(self.layer_len) == min(self.layer_len):
                return None
            return self.partial_error()
        counts = self.layer_counts()
        lo = min(c for _, c in counts)
        hi = max(c for _, c in counts)
        if lo == hi:
            return None
        held = [i for i, c in counts if c > lo]
        lack = [i for i, c in counts if c == lo]
        what = "prompt" if lo == 0 else "token" if hi - lo == 1 else "%d tokens" % (hi - lo)
        text = ("ActiveKVCache: the model's K/V layers hold different lengths (%s): a forward "
                "was cut short between its layers (%s), and its %s, given to model layers %s "
                "(%d rows), cannot be taken back; layers %s hold %d rows. To go on, update "
                "model layers %s with the same %s's K/V, in order; otherwise close() the "
                "cache, which ends the step and frees the engine, and start again with a new "
                "one" % ([c for _, c in counts],
                         "a prefill did not reach every layer" if lo == 0 else
                         "its step did not reach every layer", what, held, hi, lack, lo, lack,
                         what))
        return UnevenLayers.make(text) if lo == 0 else StepState.make(text)

    def check_cut(self, model_idx: int, n_new: int) -> None:
        """At the first K/V layer of the model (where a forward starts): the cut_short
        error unless this update brings that layer level with the others (a forward
        being completed, n_new being the tokens it lacks). Changes nothing."""
        err = self.cut_short()
        if err is None:
            return
        counts = dict(self.layer_counts())
        if counts[model_idx] + n_new == max(counts.values()) and n_new > 0:
            return  # the layer lacks exactly these tokens: the cut-short forward completed
        raise err

    # -- decode -------------------------------------------------------------

    def step_untouched(self) -> bool:
        """A step is open and nothing of it leased yet: one whose begin_step was cut short
        (an interrupt as the engine's step_begin returned) is taken as this step."""
        return (self.step_open and self.next_dense == 0 and self.pending is None
                and not self.sealed)

    def begin_step(self) -> None:
        """The step boundary: retire what is left of the previous step, end it, begin this one.

        step_open is the engine's (see there): an interrupt landing in between leaves it
        saying what the engine did, so the update can be retried."""
        if self.step_open:
            if self.step_untouched():
                return
            self.end_step()
        if min(self.layer_len) == 0:
            raise self.partial_prefill_error()  # see partial_step_error
        for d in range(self.n_dense):
            if self.layer_len[d] != self.layer_len[0]:
                raise UnevenLayers.make(
                    "ActiveKVCache: full-attention layers hold different lengths (%s); a "
                    "prefill did not reach every layer" % (self.layer_len,))
        self.next_dense = 0
        self.engine.step_begin(self.contexts)

    def end_step(self) -> None:
        """Seals the pending lease, retires every lease of the step (blocking), ends the step."""
        if self.pending is not None:
            self.seal_pending()
            self.fallback_seals += 1
        if self.next_dense != self.n_dense:
            raise self.partial_step_error()  # see there
        self.retire_all()
        self.engine.step_end()

    def stage(self, d: int, key_states: torch.Tensor, value_states: torch.Tensor):
        """Leases dense layer d, writes the step's row, returns the K/V views for attention.

        The hot path of the adapter: two C calls (begin, wait_ready), two copies of the new
        row (one kernel each) and, once per staging buffer and step, the views; everything
        else is cached (see _views)."""
        api = self.api
        if self.pending is not None:
            # Fallback when no forward hook sealed the previous layer: its attention was
            # enqueued on torch's stream before this layer's update, so the event recorded
            # now follows it.
            self.seal_pending()
            self.fallback_seals += 1
            if len(self.sealed) >= _RETIRE_BATCH:
                self.try_retire()
        if d != self.next_dense:
            raise LeaseOrder.make("ActiveKVCache: full-attention layer %d updated out of order "
                                  "(expected %d)" % (d, self.next_dense))
        length = self.layer_len[d]  # the row fits: ActiveKVLayer.update checked it
        stream = self.host_stream_raw if self.host_stream is not None else self.torch_stream()
        lease_box = self.lease_box
        lease_box.value = None  # the library writes the lease here only when it begins one
        try:
            st = api.begin(self.eng, d, self.lease_ref)
            if st != 0:
                self.check(st, "lease_begin")
            lease = lease_box.value
            self.leases += 1
            st = api.wait_ready(lease, stream, self.view_ref)
            if st != 0:
                self.failed = error_for(st, "lease_wait_ready failed")
                self.check(st, "lease_wait_ready")
            self.pending = (d, lease, stream)
            self.next_dense = d + 1
            return self._write_row(d, length, stream, key_states, value_states)
        except BaseException as exc:
            # The lease is begun (from the moment the call returned: an interrupt landing
            # right after it included), but not recorded, its row not written or not
            # counted: sealing it would write back whatever the staging row holds, and the
            # layer's length would be one short. Nothing recovers that; close()
            # quarantines the engine and frees it. A begin the library refused changed
            # nothing (a failed transport sets failed in check).
            if lease_box.value is not None and self.failed is None:
                self.failed = exc
            raise

    def _write_row(self, d: int, length: int, stream: int, key_states: torch.Tensor,
                   value_states: torch.Tensor):
        """stage's second half, after the lease began: the row written, the views."""
        api = self.api
        if self.host_stream is not None:
            # Host backend: Python attention runs on this thread, so the staged history must
            # be complete before update returns.
            self.check(api.stream_synchronize(self.eng, stream), "stream_synchronize")
        view = self.view
        lens = view.len
        for i in range(self.batch):
            if lens[i] != length:
                err = UnevenLayers.make(
                    "ActiveKVCache: context %d staged %d rows, expected %d (were rows "
                    "appended to cache.contexts directly?)" % (i, lens[i], length))
                self.failed = err
                raise err
        views = self.views.get(view.base)
        key = (length, view.context_stride, view.row_stride, view.v_offset)
        if views is None or views[0] != key:
            views = self._views(view, key)
        _, keys, values, k_row, v_row = views
        # The step's new row at index len, written on torch's stream before attention.
        try:
            k_row.copy_(key_states)
            v_row.copy_(value_states)
        except RuntimeError:
            # copy_ reads strided tensors only: a sparse or mkldnn K/V of the right shape,
            # dtype and device passes the checks, and refused here, after the lease began,
            # it left the cache unusable. Taken by its dense values, as the prefill takes
            # it (this path costs nothing until copy_ refuses).
            k_row.copy_(key_states.to_dense())
            v_row.copy_(value_states.to_dense())
        self.layer_len[d] = length + 1
        return keys, values

    def _views(self, view, key: tuple):
        """(key, keys, values, key row, value row) over the staging buffer at view.base, key
        being (rows staged, context stride, row stride, V offset).

        Every dense layer of a step stages the same number of rows (checked above), and the
        engine alternates between its two staging buffers with a layout fixed at create, so
        the views of one buffer serve every layer of the step that leases it: built once per
        buffer and step instead of once per layer."""
        # Made with inference mode off, whatever the caller's mode: these tensors outlive
        # the update (flat for the cache's life, the views for the step), and a tensor made
        # in inference mode cannot be written outside it, so a later update under no_grad
        # would fail half way (lease begun, row not written).
        with torch.inference_mode(False):
            return self._make_views(view, key)

    def _make_views(self, view, key: tuple):
        base = view.base
        flat = self.buffers.get(base)
        if flat is None:
            flat = _buffer_tensor(self.engine, base, self.staging_extent, self.dtype,
                                  self.device)
            self.buffers[base] = flat
        isz = self.itemsize
        heads, dim = view.kv_heads, view.head_dim
        length = key[0]
        cs, rs, vo = key[1] // isz, key[2] // isz, key[3] // isz
        size = (self.batch, heads, length + 1, dim)
        strides = (cs, dim, rs, 1)
        row = (self.batch, heads, 1, dim)
        views = (key,
                 flat.as_strided(size, strides, 0),
                 flat.as_strided(size, strides, vo),
                 flat.as_strided(row, strides, length * rs),
                 flat.as_strided(row, strides, length * rs + vo))
        self.views[base] = views
        return views

    def seal_pending(self) -> None:
        """Attention consumed (event on the lease's stream), write-back, seal: no host wait."""
        d, lease, stream = self.pending
        api = self.api
        attn = self.attn_refs[d]
        tail = self.tail[d]
        self.pending = None
        try:
            st = api.mark_consumed(lease, stream, attn)
            if st != 0:
                self.check(st, "lease_mark_consumed")
            st = api.write_back(lease, None, 0, self.tail_refs[d])
            if st != 0:
                self.check(st, "lease_write_back")
            st = api.seal(lease, tail, self.attn[d])
            if st != 0:
                self.check(st, "lease_seal")
            self.sealed.append(lease)
        except BaseException as exc:
            # The lease is off `pending` and not on `sealed` (an interrupt or a refusal
            # part way): nothing retires it, and step_end would refuse for good. The
            # cache is unusable; close() quarantines the engine, which releases it.
            if self.failed is None:
                self.failed = exc
            raise

    def after_attention(self, d: int) -> None:
        """Forward hook of full-attention layer d's attention module."""
        self.forget_quarantined()
        pending = self.pending
        if pending is None or pending[0] != d or self.failed is not None:
            return  # another cache's forward, or already sealed
        engine = self.engine
        try:
            held = engine._enter("ActiveKVCache forward hook")
        except Busy:
            # Another thread is in a call on this cache (this hook fired on a forward of the
            # same model with another cache): no lease call alongside it; the next update
            # seals the lease instead.
            return
        try:
            if self.pending is not pending:
                return
            self.seal_pending()
            self.hook_seals += 1
            if len(self.sealed) >= _RETIRE_BATCH:
                self.try_retire()
        finally:
            if held:
                engine._release()  # no frame before the engine is given back
                engine._left()

    def try_retire(self) -> None:
        """Retires the oldest sealed leases whose fences have all passed; never waits."""
        if not self.try_retire_ok:
            return
        fn = self.api.try_retire
        sealed = self.sealed
        while sealed:
            lease = sealed[0]
            try:
                del sealed[0]  # off the list before the call: see retire_all
                st = fn(lease, self.receipt_ref)
                if st != 0:
                    sealed.insert(0, lease)
                    if st != _NOT_READY:
                        self.check(st, "lease_try_retire")
                    return  # fences pending: nothing changed; retire() at the boundary waits
            except ActiveKVError:
                raise  # the refusal: the lease is back on the list
            except BaseException:
                self._cut_short(lease)
                raise
            self.retired_early += 1

    def retire_all(self) -> None:
        """Retires the sealed leases, oldest first (blocking). Each is taken off the list
        before its call and put back only when the library refused: a KeyboardInterrupt
        raised as a retire returns (a Ctrl-C during the wait) leaves no retired lease on the
        list, whose dead handle the library hands to a newer lease later. Taken off by
        index and del, not pop: pop is a call, and an interrupt landing as it returned lost
        a lease not yet retired (step_end then refused for good)."""
        sealed = self.sealed
        while sealed:
            lease = sealed[0]
            try:
                del sealed[0]
                st = self.api.retire(lease, self.receipt_ref)
                if st != 0:
                    sealed.insert(0, lease)
                    self.check(st, "lease_retire")
            except ActiveKVError:
                raise  # the refusal: the lease is back on the list
            except BaseException:
                self._cut_short(lease)
                raise
            self.retired_blocking += 1

    def _cut_short(self, lease: int) -> None:
        """A retire or try_retire of `lease` cut short (a KeyboardInterrupt anywhere from
        taking it off ``sealed`` to putting it back): its status is lost, and the lease
        would stay off the list unretired when the call refused (try_retire's "not ready"
        is common) or was not made: the step could never end. Back on the list, it was
        refused. Else the library says whether it retired it: a retired lease's handle is
        dead and answers AKV_ERR_BAD_HANDLE to everything, changing nothing; a seal with
        no fences is asked (refused either way); a live one goes back on the list. Only
        this path pays for it."""
        if lease in self.sealed:
            return
        zero = _Fence()
        if self.api.seal(lease, zero, zero) != _BAD_HANDLE:
            self.sealed.insert(0, lease)

    # -- teardown -----------------------------------------------------------

    def abandon_step(self) -> None:
        """Brings an interrupted step to its end so the engine can close.

        Leases the layers the step did not reach with whatever the staging buffer holds at
        the new row: only for close(), after which the history is discarded.
        """
        if self.pending is not None:
            self.seal_pending()
        api = self.api
        stream = self.host_stream_raw if self.host_stream is not None else self.torch_stream()
        while self.next_dense < self.n_dense:
            d = self.next_dense
            lease = ctypes.c_void_p()
            self.check(api.begin(self.eng, d, ctypes.byref(lease)), "lease_begin")
            self.check(api.wait_ready(lease.value, stream, self.view_ref), "lease_wait_ready")
            self.pending = (d, lease.value, stream)
            self.next_dense = d + 1
            self.seal_pending()
        self.retire_all()
        self.engine.step_end()

    def close(self) -> None:
        """Brings an open step to its end (abandon_step; after a failure, or when that
        fails, quarantine, which establishes completion and releases the leases), then
        closes the contexts and the engine. Raises only when the engine could not be freed
        (Busy: quarantine could not establish completion) or for an interrupt."""
        if self.engine is None:
            return
        self.closing = True
        interrupt = None
        self.forget_quarantined()
        if self.step_open:
            if self.failed is None:
                try:
                    self.abandon_step()
                except Exception:  # noqa: BLE001 - quarantine below ends the step instead
                    pass
                except BaseException as exc:  # KeyboardInterrupt: finish closing, re-raise
                    interrupt = exc
            if self.step_open:
                with contextlib.suppress(ActiveKVError):
                    self.engine.quarantine()
                self.pending = None
                self.sealed.clear()
        self.views.clear()
        self.buffers.clear()
        for ctx in self.contexts or ():
            with contextlib.suppress(ActiveKVError):
                ctx.close()
        self.contexts = None
        # The failure's traceback holds the frames it passed through, and so the tensors
        # over the staging buffers they held (an update cut short in _views): kept, they
        # would defer the engine's destroy (zero-copy arrays keep its memory) until the
        # cache itself goes. Closed, the cache needs it no more.
        self.failed = None
        self.host_stream = None  # a Stream holds the engine; close destroys it
        # Forgotten once closed: cut short before (an interrupt landing at close's start),
        # the cache keeps it and a second close() frees it, instead of holding it unclosed.
        engine = self.engine
        try:
            engine.close()
        except ActiveKVError:
            self.engine = None  # cannot be freed (Busy: everything retained); closed to us
            raise
        self.engine = None
        if interrupt is not None:
            raise interrupt


# --------------------------------------------------------------------------- #
# The transformers objects                                                     #
# --------------------------------------------------------------------------- #


class ActiveKVLayer(CacheLayerMixin):
    """One full-attention layer of an ActiveKVCache (dense layer ``dense_index``).

    ``update`` appends the prompt's rows (prefill) or stages the layer's history and
    returns views of it with the new row written (decode); see the module docstring.
    ``keys``/``values`` stay None: the history lives in the engine, not in tensors.
    """

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, driver: _Driver, dense_index: int, max_cache_len: int):
        super().__init__()
        self._driver = driver
        self.dense_index = dense_index
        self._max_cache_len = max_cache_len

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        drv = self._driver
        # K and V are checked in full before the contexts are opened: the first update
        # fixes the batch, and a refused one must leave it open for the right tensors.
        drv.check_init(key_states, value_states)
        if drv.contexts is None:
            drv.open_contexts(int(key_states.shape[0]))
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        drv = self._driver
        # One thread at a time, as for the engine: a second thread is refused (Busy).
        engine, held = drv.enter("ActiveKVCache.update")
        try:
            return self._update(drv, key_states, value_states)
        finally:
            if held:
                engine._release()  # no frame before the engine is given back
                engine._left()

    def _update(self, drv: _Driver, key_states: torch.Tensor, value_states: torch.Tensor):
        if not isinstance(key_states, torch.Tensor) or not isinstance(value_states, torch.Tensor):
            raise TypeError("ActiveKVCache.update takes K and V tensors, got %s and %s"
                            % (type(key_states).__name__, type(value_states).__name__))
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.dim() != 4 or key_states.shape[0] != drv.batch:
            raise ValueError("ActiveKVCache holds %d rows, got K of shape %s"
                             % (drv.batch, list(key_states.shape)))
        d = self.dense_index
        n_new = key_states.shape[-2]
        if d == 0 and drv.first_kv_dense:
            drv.check_cut(drv.first_kv, int(n_new))  # a forward starts here: see check_cut
        if drv.layer_len[d] == 0:
            drv.append(d, key_states, value_states)
            return key_states, value_states
        if n_new != 1:
            if min(drv.layer_len) == 0:
                # the prompt again at a layer that holds it: a prefill cut short between
                # its layers (see _Driver.partial_step_error), not a chunked prefill
                raise drv.partial_prefill_error()
            raise NotImplementedError(
                "ActiveKVCache: an update of %d tokens after the prompt (chunked prefill, "
                "assisted or speculative decoding) is not supported; decode one token per "
                "step (every layer holds %d tokens: a forward cut short after its last "
                "layer's update left them all there, so go on with the next token)"
                % (n_new, drv.whole_length()))
        # Everything is checked before the step boundary moves: a refused update changes
        # nothing, and the same update with the right tensors may follow.
        drv.check_states(key_states, value_states, 1)
        if drv.layer_len[d] + 1 > drv.max_tokens:
            raise ValueError("ActiveKVCache: a new row exceeds max_cache_len=%d" % drv.max_tokens)
        if d == 0:
            drv.begin_step()
        return drv.stage(d, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # the tokens every K/V layer holds (ActiveKVCache.get_seq_length): after a forward
        # cut short, the last whole forward's, whichever layer asks
        return self._driver.whole_length() + query_length, 0

    def get_seq_length(self) -> int:
        """The rows this layer holds (its own count: after a forward cut short between its
        layers, one that reached this layer shows here; ActiveKVCache.get_seq_length
        reports the tokens every layer holds)."""
        return self._driver.layer_len[self.dense_index]

    def get_max_length(self) -> int:
        return self._max_cache_len  # a fixed capacity (the engine's max_tokens)

    def offload(self):
        pass  # the history is in the engine's pinned host pool already

    def prefetch(self):
        pass

    # A layer drives its cache's engine (the driver): a copy would be a second layer
    # over the same dense layer and step, and deepcopy and pickle failed inside with
    # the Engine's TypeError. Refused here, naming the layer, as the cache's own.
    def __copy__(self):
        raise TypeError("an ActiveKVLayer cannot be copied: it drives its ActiveKVCache's "
                        "engine (make another cache)")

    def __deepcopy__(self, memo):
        self.__copy__()

    def __reduce_ex__(self, protocol):
        self.__copy__()

    def reset(self) -> None:
        raise NotImplementedError("ActiveKVCache cannot be reset; close it and make a new one")

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove != 0:
            raise NotImplementedError("ActiveKVCache cannot drop rows (crop)")

    def reorder_cache(self, beam_idx) -> None:
        raise NotImplementedError("ActiveKVCache does not support beam search (reorder_cache)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if repeats != 1:
            raise NotImplementedError("ActiveKVCache has one context per row; it cannot repeat rows")

    def batch_select_indices(self, indices) -> None:
        raise NotImplementedError("ActiveKVCache cannot select rows")


def _remove_hooks(handles: list) -> None:
    """Removes the forward hooks whose handles are in `handles` and empties it (in place:
    the cache's finalizer holds the same list)."""
    while handles:
        handles.pop().remove()


def _nested_refusal(what: str) -> Exception:
    """Busy for ActiveKVCache.close()/finish() made inside another call on the cache's
    engine on the same thread: the caller's code running inside that call (a gc callback
    or a finalizer at an allocation there, a signal handler). Made there, it ended the
    step and freed the engine under the update in flight, which then failed with
    AttributeError and kept the engine taken; refused, nothing changes."""
    return Busy.make("ActiveKVCache.%s: called inside another call on the cache on the same "
                     "thread (a finalizer, gc callback or signal handler running there); "
                     "nothing changed" % what)


def _model_device_dtype(model) -> tuple[torch.device, torch.dtype]:
    param = next(model.parameters())
    return param.device, param.dtype


# The keyword under which transformers hands an attention module its cache: "cache"
# (recent), "past_key_values", "past_key_value" (older releases).
_CACHE_KWARGS = ("cache", "past_key_values", "past_key_value")


def _own_forward(kwargs: dict, cache) -> bool:
    """Whether an attention module's forward (its keyword arguments) ran with `cache`:
    the cache itself, or a wrapper holding it as its self-attention cache
    (EncoderDecoderCache). A forward whose cache came positionally, or under a keyword
    not listed, counts as the cache's own (the lease's pending layer is then checked as
    before)."""
    for key in _CACHE_KWARGS:
        other = kwargs.get(key)
        if other is not None:
            return other is cache or getattr(other, "self_attention_cache", None) is cache
    return True


def _attention_modules(model) -> dict[int, Any]:
    """layer_idx -> the attention module of that layer (the innermost module carrying it)."""
    found: dict[int, Any] = {}
    for module in model.modules():
        idx = getattr(module, "layer_idx", None)
        if not isinstance(idx, int):
            continue
        prev = found.get(idx)
        is_attn = "Attention" in type(module).__name__
        if prev is None or (is_attn and "Attention" not in type(prev).__name__):
            found[idx] = module
    return found


class ActiveKVCache(Cache):
    """A transformers Cache whose full-attention layers are staged by an ActiveKV engine.

    Args:
        model: the model to serve; geometry, device and dtype come from it and its attention
            modules get the forward hooks (``attach``). Pass ``config=``, ``device=`` and
            ``dtype=`` instead to build a cache without a model (no hooks: each lease is then
            sealed at the next layer's update).
        max_cache_len: rows per context, prompt and generated tokens together (the engine's
            max_tokens).
        batch_size: rows of the batch (the engine's max_contexts); one context per row.
        host_pool_gib: pinned host pool; None = the smallest whole GiB that fits
            ``batch_size`` histories (akv.fit).
        device_pool_gib: device page pool, whole GiB; 0 = stage everything.
        route: "stage" or "arena" ("paged" is refused: SDPA cannot read a page table).
        backend: "host" or "cuda"; None = the model's device decides.
        page_tokens: tokens per page.
        target_pages / burst_pages: admission of each context (None = fair share).
        log / log_level: the engine's log sink and level.
        hooks: False (the default) seals each lease at the next layer's update (the last
            one at the step boundary); True registers forward hooks (``attach``) that seal it
            right after its attention. Neither waits on the host. Measured on the H200
            (docs/benchmarks.md), the module hooks cost more host time than they save in a
            decode bound by the host; with them the staging buffer is free for reuse one
            layer's compute sooner, which matters only when staging is not the bottleneck.

    Raises ValueError for an unusable configuration and the package's exceptions
    (akv.ActiveKVError subclasses) for what the engine refuses (NoFit, OutOfMemory, ...).
    Not thread-safe; see the module docstring for stream behaviour and lifetimes.

    Errors during a forward:

    - A refused update (a K/V of the wrong shape, dtype or device, TypeError/ValueError)
      changes nothing: the same update with the right tensors may follow.
    - A forward cut short between its layers (an exception in the model or in a forward
      hook, a refused update at a later layer, a KeyboardInterrupt) leaves its token (or
      prompt) in the full-attention layers it reached and not in the others; rows given
      to a layer cannot be taken back, and none are dropped or made up. Every later
      update, the next forward and ``finish()`` raise StepState (decode) or UnevenLayers
      (prefill) naming the layers and the ways on: update the remaining full-attention
      layers with the same token's (prompt's) K/V, which completes the cut-short forward,
      or ``close()`` the cache and start again with a new one. This holds for every K/V
      layer of the model, a hybrid model's sliding-window layers included: the first layer
      of the next forward refuses, whichever kind it is. Meanwhile ``get_seq_length(i)``
      is the length of the last forward that reached every layer, the same for every
      ``i`` (as ``akv_context_length`` is the minimum over a context's layers);
      ``layer_lengths`` gives each layer's own count and ``cut_short`` the error the next
      forward raises (None when the layers are even).
    - An update cut short after its layer's lease began, before its row was written
      (an interrupt inside the update), and a failed transport leave the cache unusable:
      every call raises Quarantined naming the failure, and ``close()`` frees everything.
    """

    def __init__(
        self,
        model: Any = None,
        *,
        max_cache_len: int,
        batch_size: int = 1,
        config: Any = None,
        device: Any = None,
        dtype: torch.dtype | None = None,
        host_pool_gib: int | None = None,
        device_pool_gib: int = 0,
        route: str = "stage",
        backend: str | None = None,
        page_tokens: int = 256,
        target_pages: int | None = None,
        burst_pages: int = 0,
        log=None,
        log_level: str = "warn",
        hooks: bool = False,
    ):
        if model is not None:
            config = model.config
            m_device, m_dtype = _model_device_dtype(model)
            device = m_device if device is None else device
            dtype = m_dtype if dtype is None else dtype
        if config is None or device is None or dtype is None:
            raise ValueError("ActiveKVCache needs a model, or config=, device= and dtype=")
        device = torch.device(device)
        if device.type == "cpu":
            # one CPU: "cpu:0" is torch's cpu, whose tensors say "cpu" (an index kept
            # here refused every update: cpu:0 != cpu)
            device = torch.device("cpu")
        if device.type not in ("cpu", "cuda"):
            # refused before the engine exists: the host backend copies from and hands
            # views to CPU memory, the CUDA backend to one CUDA device
            raise ValueError("ActiveKVCache: a model on %s; the engine serves cpu (host backend) "
                             "and cuda devices" % (device,))
        if device.type == "cuda" and device.index is None:
            # torch's current device; without CUDA in this torch (or no device) asking for
            # it raises torch's own error, while "cuda:0" reached the engine, which refuses
            # a CUDA backend it cannot serve with NotSupported: device 0 then, so "cuda"
            # and "cuda:0" are refused alike
            index = torch.cuda.current_device() if torch.cuda.is_available() else 0
            device = torch.device("cuda", index)
        want = "cuda" if device.type == "cuda" else "host"
        # Backend names in any case, as Engine takes them ("HOST", "Cuda").
        if backend is None or (isinstance(backend, str) and backend.lower() == want):
            backend = want
        else:
            raise ValueError("ActiveKVCache: backend=%r cannot serve a model on %s" % (backend, device))
        # Checked before the engine exists; they are used only when the first update opens
        # the contexts, which would refuse them then, on every update.
        if target_pages is not None:
            _target_pages(target_pages, "ActiveKVCache: target_pages")
        _uint(burst_pages, "ActiveKVCache: burst_pages")
        if not isinstance(hooks, bool):
            raise TypeError("ActiveKVCache: hooks=%r is not a bool" % (hooks,))
        dense, layers = dense_layer_indices(config)
        ecfg = engine_config_for(
            config, max_cache_len=max_cache_len, batch_size=batch_size, dtype=dtype,
            backend=backend, device_ordinal=device.index or 0, host_pool_gib=host_pool_gib,
            device_pool_gib=device_pool_gib, route=route, page_tokens=page_tokens)
        driver = _Driver(ecfg, device, dtype, len(dense), target_pages, burst_pages, log, log_level)
        max_cache_len = ecfg["max_tokens"]  # a Python int (a numpy one is accepted)
        for d, layer_idx in enumerate(dense):
            layers[layer_idx] = ActiveKVLayer(driver, d, max_cache_len)
        # The model's layers that hold tokens: the full-attention ones, transformers' own
        # that take K/V through update (sliding-window, chunked: DynamicLayer subclasses)
        # and its linear-attention (conv, recurrent) layers, whose states transformers'
        # own calls advance (get_conv_state, increase_count: in place) before a later
        # full-attention layer of the same forward may refuse it; not the dummy layers.
        # In order (see _Driver.layer_counts).
        driver.kv_layers = [(i, layer.dense_index if isinstance(layer, ActiveKVLayer) else layer)
                            for i, layer in enumerate(layers)
                            if isinstance(layer, (ActiveKVLayer,) + _TOKEN_LAYERS)]
        driver.others = [ref for _, ref in driver.kv_layers if type(ref) is not int]
        # The first layer of a forward that takes K/V through update, where it is checked
        # (see _Driver.check_cut); a linear-attention layer before it is counted only.
        driver.first_kv = next(i for i, layer in enumerate(layers)
                               if isinstance(layer, (ActiveKVLayer, DynamicLayer)))
        driver.first_kv_dense = driver.first_kv == dense[0]
        super().__init__(layers=layers)
        self._driver = driver
        self.engine_config = ecfg
        self.dense_layers = dense  # dense index d -> model layer index
        self._max_cache_len = max_cache_len
        # The forward hooks' handles. A cache dropped without close() removes them when it
        # is freed (the finalizer holds this list and nothing of the cache): left on the
        # model they were inert but stayed, one set per dropped cache.
        self._hooks: list = []
        weakref.finalize(self, _remove_hooks, self._hooks)
        if model is not None and hooks:
            self.attach(model)

    # -- binding --------------------------------------------------------------

    def attach(self, model) -> "ActiveKVCache":
        """Registers a forward hook on each full-attention layer's attention module (the
        module carrying ``layer_idx``): after attention it records the consumed event,
        enqueues the write-back and seals the lease, without a host wait. Idempotent. The
        hooks go with ``detach()``, ``close()``, or the cache itself when it is freed
        without either (they hold the cache only weakly)."""
        self.detach()
        modules = _attention_modules(model)
        ref = weakref.ref(self._driver)
        cref = weakref.ref(self)
        for d, layer_idx in enumerate(self.dense_layers):
            module = modules.get(layer_idx)
            if module is None:
                continue  # no hook: the fallback seals at the next update

            def hook(_module, _args, kwargs, _output, _d=d, _ref=ref, _cref=cref):
                # Only this cache's forward seals its lease: a forward of the same model
                # with another cache (on another thread: while this cache's own attention
                # may still read the staged rows) is not this lease's consumer.
                if not _own_forward(kwargs, _cref()):
                    return
                drv = _ref()
                if drv is not None and drv.engine is not None:
                    drv.after_attention(_d)

            self._hooks.append(module.register_forward_hook(hook, with_kwargs=True))
        return self

    def detach(self) -> None:
        """Removes the forward hooks (leases are then sealed at the next update)."""
        _remove_hooks(self._hooks)

    # -- access ---------------------------------------------------------------

    @property
    def engine(self):
        """The akv.Engine (owned by the cache; closed by close())."""
        return self._driver.engine

    @property
    def contexts(self) -> list:
        """One akv.Context per batch row, in batch order (empty before the prefill)."""
        return list(self._driver.contexts or ())

    @property
    def layer_lengths(self) -> list:
        """The tokens each model layer holds, in model order (a linear-attention layer's
        own count included; None for a layer that holds none: dummy, KV-sharing). Equal
        for every such layer between forwards;
        uneven after a forward cut short between its layers (see ``cut_short``), while
        ``get_seq_length`` reports the tokens every layer holds."""
        out: list = [None] * len(self.layers)
        for i, n in self._driver.layer_counts():
            out[i] = n
        return out

    @property
    def cut_short(self) -> Exception | None:
        """None, or the error (StepState, UnevenLayers) the next forward raises because one
        was cut short between its layers; its message names the layers and the ways on."""
        return self._driver.cut_short()

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """The tokens the cache holds: those every K/V layer of the model holds, the same
        for every ``layer_idx`` (a layer without K/V: transformers' answer). After a forward
        cut short between its layers, the length of the last forward that reached every
        layer (as ``akv_context_length``, the minimum over a context's layers), until the
        layers it did not reach are updated with its K/V; ``layer_lengths`` and
        ``cache.layers[i].get_seq_length()`` give each layer's own count."""
        # A negative index is a layer counted from the end, as transformers' list takes it
        # (its own count there said otherwise after a forward cut short).
        if (isinstance(layer_idx, (int, np.integer))
                and -len(self.layers) <= layer_idx < len(self.layers)
                and isinstance(self.layers[layer_idx], (ActiveKVLayer,) + _TOKEN_LAYERS)):
            return self._driver.whole_length()
        return super().get_seq_length(layer_idx)

    @property
    def stats(self) -> dict:
        """Lease counters: leases, hook/fallback seals, early/blocking retires."""
        drv = self._driver
        return dict(leases=drv.leases, hook_seals=drv.hook_seals,
                    fallback_seals=drv.fallback_seals, retired_early=drv.retired_early,
                    retired_blocking=drv.retired_blocking, try_retire=drv.try_retire_ok)

    # -- lifetime -------------------------------------------------------------

    def finish(self) -> None:
        """Ends the open decode step (seal, blocking retire, step_end) so the contexts can be
        read or appended to; the next decode update begins a new step. Blocks the host."""
        drv = self._driver
        # One thread at a time: end_step's lease calls go to the library directly, so the
        # engine is taken first (Busy, nothing changed, while another thread is in a call).
        engine, held = drv.enter("ActiveKVCache.finish")
        try:
            if not held:
                raise _nested_refusal("finish")
            if drv.step_open:
                drv.end_step()
        finally:
            if held:
                engine._release()  # no frame before the engine is given back
                engine._left()

    def close(self) -> None:
        """Ends the open step, closes contexts and engine, removes the hooks. Idempotent.
        Busy (nothing changed) while another thread is in a call on the cache, and from
        inside one of its calls on this thread (a gc callback, a finalizer)."""
        engine = self._driver.engine
        if engine is None:
            self.detach()
            return
        held = engine._enter("ActiveKVCache.close")  # as finish(): before any lease call
        try:
            if not held:
                raise _nested_refusal("close")
            self.detach()
            self._driver.close()
        finally:
            if held:
                engine._release()  # no frame before the engine is given back
                engine._left()

    # A cache names C handles (its engine, contexts and leases) as the engine does: a copy
    # would drive the same engine and step (rows decoded through it land in both) and close
    # the other's engine. Refused like the engine's (TypeError).
    def __copy__(self):
        raise TypeError("an ActiveKVCache cannot be copied: it owns an engine and its contexts "
                        "(make another cache)")

    def __deepcopy__(self, memo):
        self.__copy__()

    def __reduce_ex__(self, protocol):
        self.__copy__()

    def __enter__(self) -> "ActiveKVCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def early_initialization(self, batch_size: int, num_heads, head_dim, dtype: torch.dtype,
                             device, *args, **kwargs) -> None:
        """Cache.early_initialization, refused before any layer changes. transformers
        initialises the layers in order: on a hybrid model the sliding-window layers before
        the first full-attention one were set up before that layer refused (a batch larger
        than batch_size, heads or head_dim other than the model's, another dtype or
        device), leaving the cache half initialised. Here every full-attention layer's
        refusal is checked first (ValueError), then those layers are initialised (the
        first opens the contexts; what the engine refuses there changes nothing either),
        then transformers initialises the others. One thread at a time (Busy)."""
        drv = self._driver
        engine, held = drv.enter("ActiveKVCache.early_initialization")
        try:
            n = len(self.layers)
            heads = [num_heads] * n if isinstance(num_heads, int) else list(num_heads)
            dims = [head_dim] * n if isinstance(head_dim, int) else list(head_dim)
            if len(heads) != n or len(dims) != n:
                raise ValueError("ActiveKVCache.early_initialization: num_heads and head_dim "
                                 "take an int or one entry per layer (%d layers), got %d and %d"
                                 % (n, len(heads), len(dims)))
            todo = [(layer, torch.zeros((batch_size, heads[i], 0, dims[i]), dtype=dtype,
                                        device=device))
                    for i, layer in enumerate(self.layers)
                    if isinstance(layer, ActiveKVLayer) and not layer.is_initialized]
            for _layer, fake in todo:
                drv.check_init(fake, fake)
            for layer, fake in todo:
                layer.lazy_initialization(fake, fake)
            return super().early_initialization(batch_size, num_heads, head_dim, dtype, device,
                                                *args, **kwargs)
        finally:
            if held:
                engine._release()  # no frame before the engine is given back
                engine._left()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args, **kwargs):
        """Cache.update with `layer_idx` checked first: list indexing would take -1 as the
        last layer and True as layer 1, storing one layer's K/V as another's. TypeError
        for a layer index that is not an integer (bool included), IndexError out of
        range; nothing changes."""
        if isinstance(layer_idx, (bool, np.bool_)) or not isinstance(layer_idx, (int, np.integer)):
            raise TypeError("ActiveKVCache.update: layer_idx=%r is not an integer" % (layer_idx,))
        # read once (an int subclass gives its own value, whatever its __int__ says): the
        # index checked is the index used
        layer_idx = operator.index(layer_idx)
        if not 0 <= layer_idx < len(self.layers):
            raise IndexError("ActiveKVCache.update: layer_idx=%d outside the model's %d layers"
                             % (layer_idx, len(self.layers)))
        if isinstance(self.layers[layer_idx], ActiveKVLayer):
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)
        # A hybrid model's other layer: refused here when the full-attention layers of
        # this forward would refuse it, before this layer takes it; and, like them, one
        # thread at a time (Busy while another thread is in a call on the cache).
        drv = self._driver
        engine, held = drv.enter("ActiveKVCache.update")
        try:
            if layer_idx == drv.first_kv:  # a forward starts here: see _Driver.check_cut
                n_new = (int(key_states.shape[-2]) if isinstance(key_states, torch.Tensor)
                         and key_states.dim() == 4 else 0)
                drv.check_cut(layer_idx, n_new)
            drv.check_forward(key_states, value_states, layer_idx < self.dense_layers[0])
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)
        finally:
            if held:
                engine._release()  # no frame before the engine is given back
                engine._left()

    # -- unsupported Cache operations ----------------------------------------

    def reset(self):
        raise NotImplementedError("ActiveKVCache cannot be reset; close it and make a new one")

    # Cache's own crop / reorder_cache / batch_* walk the layers in order: on a hybrid
    # model the sliding-window layers before the first full-attention layer would be
    # changed before that layer refuses, leaving the layers at different lengths or row
    # orders. Each is refused here before any layer is touched; what every layer accepts
    # (crop(0), batch_repeat_interleave(1)) is passed on.

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove != 0:
            raise NotImplementedError("ActiveKVCache cannot drop rows (crop)")
        super().crop(tokens_to_remove)

    def reorder_cache(self, beam_idx) -> None:
        raise NotImplementedError("ActiveKVCache does not support beam search (reorder_cache)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if repeats != 1:
            raise NotImplementedError("ActiveKVCache has one context per row; it cannot repeat rows")
        super().batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices) -> None:
        raise NotImplementedError("ActiveKVCache cannot select rows")
