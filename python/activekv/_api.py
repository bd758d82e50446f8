"""The Pythonic layer over akv.h: Engine, Context, Lease, View, Stream.

Threading, ownership and stream rules are akv.h's: an engine and everything
made from it is used from one thread at a time; fit() is safe from any
thread. Calls that enqueue return once the work is enqueued; only
Lease.retire, Engine.quarantine, Stream.synchronize and (host backend)
Lease.wait_ready block.

Handles are guarded on the Python side as well: once an engine is closed,
every object made from it raises BadHandle without reaching C (the C
handles are freed memory then); a closed context, a retired lease and a
destroyed stream do the same. "One thread at a time" is enforced: a call
from a second thread while one is in flight raises Busy (Engine._enter).
Zero-copy arrays keep the engine's memory alive (_Export): close() defers
freeing it until the last one is gone.

Lifetimes: every object made from an engine holds it (a zero-copy array
holds only its memory, _Memory); the engine holds them only weakly, so an
engine dropped without close() is freed when its last reference goes (a
dropped context is closed likewise). A call that makes a handle writes it
into the object that owns it (_Owning): cut short as it returns (Ctrl-C,
MemoryError), it loses nothing.
"""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import operator
import os
import sys
import threading
import warnings
import weakref
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np

from . import _lib as L
from .errors import (
    ActiveKVError,
    BadHandle,
    Busy,
    InUse,
    InvalidArgument,
    NotSupported,
    STATUS_VALUES,
    error_for,
)

lib = L.lib

# ----------------------------------------------------------------- enums

BACKENDS = {"auto": 0, "host": 1, "cuda": 2}
ROUTES = {"stage": 0, "arena": 1, "paged": 2}
DTYPES = {"bf16": 0, "f16": 1, "f32": 2, "fp8_e4m3": 3, "fp8_e5m2": 4}
FIT_MODES = {"refuse": 0, "shrink": 1}
LOG_LEVELS = {"error": 0, "warn": 1, "info": 2, "debug": 3}
OP_KINDS = {"alloc": 0, "copy": 1, "record": 2, "wait": 3, "query": 4, "sync": 5, "hostfn": 6}
# akv_adm_rule in enum order, as akv_adm_rule_string names them with "_" for "-"
ADM_RULES = ["own_reuse", "free", "reclaim_borrowed", "reclaim_above_target", "reclaim_idle",
             "shrink", "refuse", "admit", "release", "reclaim_headroom", "headroom",
             "headroom_release", "headroom_take"]
_ITEMSIZE = {"bf16": 2, "f16": 2, "f32": 4, "fp8_e4m3": 1, "fp8_e5m2": 1}
# numpy has no bfloat16 and no FP8: bf16 rows are uint16 bit patterns on
# numpy, FP8 rows uint8 codes
_NP_DTYPE = {"bf16": np.dtype(np.uint16), "f16": np.dtype(np.float16), "f32": np.dtype(np.float32),
             "fp8_e4m3": np.dtype(np.uint8), "fp8_e5m2": np.dtype(np.uint8)}
_CAI_TYPESTR = {"bf16": "<i2", "f16": "<f2", "f32": "<f4", "fp8_e4m3": "|u1", "fp8_e5m2": "|u1"}
# torch's own type of each dtype (by attribute name: the FP8 types need torch
# >= 2.1); the view types torch cannot express natively come as raw bits
_TORCH_DTYPE = {"bf16": "bfloat16", "f16": "float16", "f32": "float32",
                "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


def _inv(table: Dict[str, int]) -> Dict[int, str]:
    return {v: k for k, v in table.items()}


def _enum(table: Dict[str, int], what: str, value: Union[str, int]) -> int:
    if isinstance(value, str):
        key = value.lower()
        if key in table:
            return table[key]
    raise InvalidArgument.make(f"{what}={value!r}: expected one of {', '.join(table)}")


# numpy's own integer scalar types (a subclass of one is read through it)
_NP_INT_TYPES = frozenset(np.dtype(c).type for c in np.typecodes["AllInteger"])


def _index(value: Any) -> Optional[int]:
    """The int a Python or numpy integer (not a bool) stands for, None for
    anything else. Read once, by operator.index (an int subclass gives its
    own value, whatever its __int__ says): the value checked is the value
    used, so a range check cannot pass one number and C get another.

    Invariant: reading it runs none of the caller's Python code. The type is
    taken from type(), not isinstance (which believes a lying __class__),
    and a subclass of a numpy integer type is read by that numpy type's own
    __index__ (C): an override ran in the middle of the package's calls,
    after the handles were checked, and could close the engine there (a
    View's array was then made over freed memory)."""
    t = type(value)
    if issubclass(t, (bool, np.bool_)) or not issubclass(t, (int, np.integer)):
        return None
    if issubclass(t, int) or t in _NP_INT_TYPES:
        return operator.index(value)
    base = next((b for b in t.__mro__ if b in _NP_INT_TYPES), None)
    return None if base is None else base.__index__(value)


_U64_MAX = (1 << 64) - 1


def _u64(value: Optional[int], what: str) -> int:
    """A byte count for a uint64_t argument; None means "all" (UINT64_MAX)."""
    if value is None:
        return _U64_MAX
    v = _index(value)
    if v is None or not 0 <= v <= _U64_MAX:
        raise InvalidArgument.make(f"{what}={value!r}: expected an integer in 0..2**64-1 or None")
    return v


_U32_MAX = 0xFFFFFFFF


def _uint(value: Any, what: str, hi: int = _U32_MAX) -> int:
    """An integer argument in 0..hi: Python or numpy ints only (not bool,
    float, str or None), refused with InvalidArgument before reaching C, so
    ctypes never truncates or wraps it."""
    v = _index(value)
    if v is None:
        raise InvalidArgument.make(f"{what}={value!r}: expected an integer")
    if not 0 <= v <= hi:
        raise InvalidArgument.make(f"{what}={value!r}: out of range 0..{hi}")
    return v


def _target_pages(value: Any, what: str) -> int:
    """An explicit device target in pages: as _uint, but below UINT32_MAX,
    which the library reads as AKV_TARGET_FAIR_SHARE (the fair share is
    asked for with None, never with that number)."""
    if _index(value) == L.AKV_TARGET_FAIR_SHARE:
        raise InvalidArgument.make(
            f"{what}={value!r}: out of range 0..{L.AKV_TARGET_FAIR_SHARE - 1} (that value is "
            "AKV_TARGET_FAIR_SHARE to the library; pass None for the fair share)")
    return _uint(value, what, L.AKV_TARGET_FAIR_SHARE - 1)


def _check(status: int, engine_handle: Optional[int] = None, what: str = "") -> None:
    """Raises the status's exception unless it is AKV_OK."""
    if status == 0:
        return
    msg = ""
    if engine_handle:
        msg = (lib.akv_engine_last_error(engine_handle) or b"").decode(errors="replace")
    if not msg:
        msg = (lib.akv_status_string(status) or b"").decode(errors="replace")
    raise error_for(status, f"{what}: {msg}" if what else msg)


def _torch():
    try:
        import torch  # noqa: PLC0415 - optional, imported on first use
    except ImportError as exc:  # pragma: no cover - depends on the machine
        raise NotSupported.make("this needs torch, which is not installed") from exc
    return torch


def _torch_dtype(torch: Any, dtype: str) -> Any:
    """torch's type for an engine dtype, None where this torch has none (FP8
    before torch 2.1)."""
    return getattr(torch, _TORCH_DTYPE[dtype], None)


def _need(name: str) -> None:
    """NotSupported unless the loaded library exports `name` (entry points
    added after 0.2.0; a library from ACTIVEKV_LIBRARY may predate them)."""
    if not L.has_symbol(name):
        raise NotSupported.make(f"this libactivekv has no {name}")


# ----------------------------------------------------------------- config

_CONFIG_FIELDS = (
    "backend", "device_ordinal", "n_dense_layers", "kv_heads", "head_dim", "dtype",
    "max_tokens", "page_tokens", "host_pool_gib", "device_pool_gib", "max_contexts",
    "fit_mode", "route", "log_level", "host_delay_seed", "host_delay_max_us",
    "fault_fail_nth", "fault_kind", "poison_holes", "headroom_gib", "headroom_reserve_gib",
    "host_fake_free_bytes", "headroom_chunk_pages",
)
_ENUM_FIELDS = {"backend": BACKENDS, "route": ROUTES, "dtype": DTYPES, "fit_mode": FIT_MODES,
                "log_level": LOG_LEVELS}


def _make_config(cfg: Dict[str, Any]) -> Tuple[L.akv_engine_config, Dict[str, Any]]:
    """An akv_engine_config from keyword arguments named after its fields.
    Returns the struct and the config as a dict (enum fields as strings).

    The defaults come from akv_engine_config_init, which writes the library's
    own sizeof(akv_engine_config): into spare room when the library is newer
    than this mirror (struct_size then says the mirror's size, and the
    library defaults the fields it has beyond it); a library older than the
    mirror reads only its own struct_size, so a field past it raises
    NotSupported instead of being ignored."""
    init = L.out_struct(L.akv_engine_config)
    _check(lib.akv_engine_config_init(ctypes.byref(init)))
    lib_size = init.struct_size
    c = L.akv_engine_config.from_buffer_copy(init)
    c.struct_size = min(lib_size, ctypes.sizeof(c))
    out: Dict[str, Any] = {}
    for key, value in cfg.items():
        if key in ("struct_size", "version", "log_fn", "log_user"):
            raise InvalidArgument.make(
                f"{key} is set by the package (pass log=callable(level, message) for logging)")
        if key not in _CONFIG_FIELDS:
            raise InvalidArgument.make(
                f"unknown config field {key!r}; the fields are {', '.join(_CONFIG_FIELDS)}")
        field = getattr(L.akv_engine_config, key)
        if field.offset + field.size > c.struct_size:
            raise NotSupported.make(
                f"{key}: this libactivekv's akv_engine_config ({c.struct_size} bytes) predates "
                "the field")
        if key in _ENUM_FIELDS:
            value = _enum(_ENUM_FIELDS[key], key, value)
        elif key == "fault_kind" and isinstance(value, str):
            value = _enum(OP_KINDS, key, value)
        given, value = value, _index(value)
        if value is None:
            raise InvalidArgument.make(f"{key}={given!r}: expected an integer")
        try:
            setattr(c, key, value)
        except (TypeError, OverflowError) as exc:
            raise InvalidArgument.make(f"{key}={given!r}: {exc}") from exc
        if getattr(c, key) != value:
            raise InvalidArgument.make(f"{key}={given!r} does not fit its C field")
    for key in _CONFIG_FIELDS:
        v = getattr(c, key)
        out[key] = _inv(_ENUM_FIELDS[key])[v] if key in _ENUM_FIELDS else v
    return c, out


# ----------------------------------------------------------------- fit


@dataclasses.dataclass(frozen=True)
class FitReport:
    """akv_fit_report: the host-fit arithmetic of DESIGN §3 (``line`` is the
    formula with every term, as the engine logs it)."""

    row_bytes: int
    history_bytes: int
    host_pool_bytes: int
    fits: int
    effective_concurrency: int
    ok: bool
    host_pool_gib_needed: int
    page_bytes: int
    device_pages: int
    line: str


def _struct_dict(s: ctypes.Structure) -> Dict[str, Any]:
    return {name: getattr(s, name) for name, *_ in s._fields_}


def fit(**cfg: Any) -> FitReport:
    """Host fit for a config (akv_engine_config field names as keywords),
    without creating anything. Thread-safe. Raises InvalidArgument or Config
    (bad geometry, overflow; the message is the library's reason, the one an
    Engine of the config would give); a config that does not fit is a report
    with ``ok`` False, not an exception."""
    c, _ = _make_config(cfg)
    r = L.out_struct(L.akv_fit_report)
    # The library gives a refusal's reason to the config's log callback (the
    # line akv_engine_create logs for the config); kept for the exception.
    reasons: List[str] = []
    held: List[BaseException] = []

    def sink(user: Any, level: int, message: bytes) -> None:
        try:
            if level == 0 and message:
                reasons.append(message.decode(errors="replace"))
        except BaseException as exc:  # Ctrl-C here: raised once the library returned
            held.append(exc)

    cb = L.LOG_FN(sink)
    c.log_fn = cb
    st = lib.akv_fit(ctypes.byref(c), ctypes.byref(r))
    if held:
        raise held[0]
    if st != 0:
        msg = "; ".join(reasons) or (lib.akv_status_string(st) or b"").decode(errors="replace")
        raise error_for(st, f"fit: {msg}")
    d = _struct_dict(r)
    d["ok"] = bool(d["ok"])
    d["line"] = r.line.decode(errors="replace")
    return FitReport(**d)


# ----------------------------------------------------------------- records


@dataclasses.dataclass(frozen=True)
class Fence:
    """akv_fence: names one event the engine recorded."""

    serial: int

    def _c(self) -> L.akv_fence:
        return L.akv_fence(_u64(_fence_serial(self), "Fence.serial"))


def _fence_serial(f: Fence) -> Any:
    """A Fence's serial, read once from its own storage (None, which _u64
    would read as "all", as -1: refused)."""
    v = f.__dict__.get("serial")
    return -1 if v is None else v


@dataclasses.dataclass(frozen=True)
class EngineInfo:
    """akv_engine_info: geometry, memory and counters (backend and route as
    strings, backend_ops keyed by op kind)."""

    backend: str
    route: str
    effective_concurrency: int
    row_bytes: int
    history_bytes: int
    page_bytes: int
    device_pages: int
    staging_bytes: int
    device_bytes_allocated: int
    device_peak_bytes: int
    bytes_h2d: int
    bytes_d2h: int
    bytes_d2d: int
    copies_h2d: int
    copies_d2h: int
    copies_d2d: int
    steps: int
    leases_retired: int
    backend_ops: Dict[str, int]
    transport_failed: bool
    quarantined: bool
    bytes_in_place: int
    headroom_pages: int
    headroom_bytes: int


@dataclasses.dataclass(frozen=True)
class Headroom:
    """akv_headroom_info: the engine's revocable headroom (DESIGN §6).
    ``enabled``: the config asked for headroom on a retaining route;
    ``pages``: present now, of which ``pages_held`` retain history and
    ``pages_pending`` were asked back during the open step (freed at its
    end); ``chunk_pages``: the unit of release and take; ``bytes``: device
    bytes allocated for headroom now."""

    enabled: bool
    profile_free_bytes: int
    cap_bytes: int
    reserve_bytes: int
    max_pages: int
    chunk_pages: int
    pages: int
    pages_held: int
    pages_pending: int
    bytes: int
    bytes_released: int
    releases: int
    takes: int


@dataclasses.dataclass(frozen=True)
class Decision:
    """akv_adm_decision: one admission decision (victim None when none;
    context None for the engine's own headroom rows)."""

    step: int
    context: Optional[int]
    rule: str
    victim: Optional[int]
    pages: int


@dataclasses.dataclass(frozen=True)
class Receipt:
    """akv_receipt: proof that every ticket and reader of a lease completed."""

    step: int
    layer: int
    tickets: int
    readers: int
    bytes_h2d: int
    bytes_d2d: int
    bytes_d2h: int
    attention: Fence
    tail: Fence
    bytes_in_place: int


@dataclasses.dataclass(frozen=True)
class QuarantineReport:
    """akv_quarantine_report."""

    h2d_ok: bool
    d2h_ok: bool
    d2d_ok: bool
    device_ok: bool
    leases_released: int
    tickets_released: int
    retained_leases: int
    uncertain: str


def _receipt(r: L.akv_receipt) -> Receipt:
    return Receipt(r.step, r.layer, r.tickets, r.readers, r.bytes_h2d, r.bytes_d2d, r.bytes_d2h,
                   Fence(r.attention.serial), Fence(r.tail.serial), r.bytes_in_place)


# ----------------------------------------------------------------- arrays


# The dtypes whose integer arrays of their size are taken as raw bits, as
# docs/python.md has always listed them: bf16 and f16 (uint16/int16 bit
# patterns) and FP8 (uint8/int8 codes). f32 was never among them: an int32
# array there holds integer values, which the library's byte copy stored as
# float bit patterns (np.arange(n, dtype=np.int32) became denormals),
# silently; its only input is numpy's float32 (or bits as .view(np.float32)).
_RAW_BITS_DTYPES = frozenset(("bf16", "f16", "fp8_e4m3", "fp8_e5m2"))


def _refuse_integer_rows(what: str, given: Any, dtype: str) -> None:
    if dtype not in _RAW_BITS_DTYPES:
        raise InvalidArgument.make(
            f"{what}: {given} rows for a {dtype} engine: integer arrays are taken as raw bits "
            f"only for bf16, f16 and FP8; pass {_NP_DTYPE[dtype]} values "
            f"(bit patterns you mean as such: .view(np.{_NP_DTYPE[dtype]}))")


def _host_rows(obj: Any, dtype: str, what: str) -> np.ndarray:
    """A C-contiguous numpy view (no copy) of rows given as numpy, a CPU
    torch tensor or any buffer, checked against the engine's dtype: the
    matching float type, or, for bf16, f16 and FP8, raw bit patterns of the
    same size (int16/uint16 for bf16 and f16, uint8/int8 codes for FP8);
    torch.bfloat16, torch.float8_e4m3fn and torch.float8_e5m2 are accepted.
    Integer rows for f32 are refused (_RAW_BITS_DTYPES).

    The array is read by the caller's C call only after every argument was
    converted (the caller's code: an __array__, a subclass) and _check_pins
    found the memory each one views still in place."""
    isz = _ITEMSIZE[dtype]
    mod = type(obj).__module__
    loaded = sys.modules.get("torch")  # a tensor exists only once torch is imported
    if mod.startswith("torch") or (loaded is not None and isinstance(obj, loaded.Tensor)):
        # subclasses defined elsewhere included: np.asarray would refuse bf16 and
        # tensors that require grad
        torch = _torch()
        if not isinstance(obj, torch.Tensor):
            raise InvalidArgument.make(f"{what}: a {type(obj).__name__}, not rows")
        if obj.is_quantized:  # .numpy() would raise TypeError; their bytes are not rows
            raise InvalidArgument.make(f"{what}: a quantized {obj.dtype} tensor; rows are "
                                       "plain elements of the engine's dtype")
        if obj.layout != torch.strided or obj.is_nested:
            kind = "nested" if obj.is_nested else str(obj.layout)
            raise InvalidArgument.make(f"{what}: a {kind} tensor; rows are dense")
        if obj.device.type != "cpu":
            raise InvalidArgument.make(f"{what}: a {obj.device.type} tensor; rows are copied from "
                                       "host memory (pass a CPU tensor)")
        if not obj.is_contiguous():
            raise InvalidArgument.make(f"{what}: tensor is not contiguous")
        if obj.is_floating_point() and obj.dtype != _torch_dtype(torch, dtype):
            raise InvalidArgument.make(f"{what}: {obj.dtype} rows for a {dtype} engine")
        if obj.is_complex() or obj.dtype == torch.bool or obj.element_size() != isz:
            raise InvalidArgument.make(f"{what}: {obj.element_size()}-byte {obj.dtype} elements "
                                       f"for a {dtype} engine ({isz} bytes)")
        if not obj.is_floating_point():
            _refuse_integer_rows(what, obj.dtype, dtype)
        # rows are only read: no autograd, and conj/neg bits made real
        obj = obj.detach().resolve_conj().resolve_neg()
        int_t = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[isz]
        try:
            arr = obj.view(int_t).numpy() if obj.is_floating_point() else obj.numpy()
        except (RuntimeError, TypeError, NotImplementedError) as exc:
            # a tensor subclass with no host elements of its own (fake,
            # functional, ...): torch refuses to export it
            raise InvalidArgument.make(f"{what}: a {type(obj).__name__} torch cannot export as "
                                       f"host rows ({exc})") from exc
    else:
        if isinstance(obj, np.ma.MaskedArray) and np.ma.is_masked(obj):
            # np.asarray drops the mask: the hidden elements' data would be
            # stored as if it were rows
            raise InvalidArgument.make(f"{what}: a masked array with masked elements; pass "
                                       "plain rows (np.ma.filled with the value you mean)")
        try:
            arr = np.asarray(obj)
        except Exception as exc:  # noqa: BLE001 - any non-array input
            raise InvalidArgument.make(f"{what}: not an array ({exc})") from exc
        if arr.dtype.kind == "f" and arr.dtype.newbyteorder("=") != _NP_DTYPE[dtype]:
            # (the right type in the other byte order: refused below, by name)
            raise InvalidArgument.make(f"{what}: {arr.dtype} rows for a {dtype} engine")
        if arr.dtype.kind not in "fiu" or arr.dtype.itemsize != isz:
            raise InvalidArgument.make(f"{what}: dtype {arr.dtype} for a {dtype} engine "
                                       f"({isz}-byte elements)")
        if arr.dtype.kind != "f":
            _refuse_integer_rows(what, arr.dtype, dtype)
        if not arr.dtype.isnative:
            # the library copies bytes: a swapped byte order would be stored
            # as different values
            raise InvalidArgument.make(f"{what}: dtype {arr.dtype} is not in the machine's byte "
                                       "order (convert with .astype(dtype.newbyteorder('=')))")
    if not arr.flags.c_contiguous:
        raise InvalidArgument.make(f"{what}: array is not C-contiguous")
    return arr


_NDARRAY_BASE = np.ndarray.__dict__["base"].__get__
_NDARRAY_FLAGS = np.ndarray.__dict__["flags"].__get__
_NDARRAY_IFACE = np.ndarray.__dict__["__array_interface__"].__get__
_NDARRAY_NBYTES = np.ndarray.__dict__["nbytes"].__get__


# ctypes' base of every C data type: a ctypes object's memory moves under the
# arrays that view it (ctypes.resize reallocates it, exports or not)
_CDATA = next(c for c in ctypes.Array.__mro__ if c.__name__ == "_CData")


def _ndarray_extent(owner: np.ndarray) -> Tuple[int, int]:
    return _NDARRAY_IFACE(owner)["data"][0], _NDARRAY_NBYTES(owner)


def _cdata_extent(owner: Any) -> Tuple[int, int]:
    return ctypes.addressof(owner), ctypes.sizeof(owner)


def _pin(arr: np.ndarray) -> Optional[Tuple[Callable[[Any], Tuple[int, int]], Any, Tuple[int, int]]]:
    """What must stay in place for `arr` to view live memory: the object
    that owns the memory arr views, a reader of where that memory is now,
    and what it reads now; None when nothing can move it under the array.

    The owner is a numpy array that owns its data (arr itself, or the end of
    its chain of bases: ndarray.resize(..., refcheck=False) frees it) or a
    ctypes object (at the end of that chain, or behind its memoryview:
    ctypes.resize reallocates its memory whatever views it). Other memory
    cannot move under an array that views it: a torch tensor's storage
    (not resizable once exported), a buffer's export (bytearray, array,
    mmap refuse a resize while exported). Read through ndarray's and
    ctypes' own C accessors: no caller code runs."""
    owner = arr
    while True:
        base = _NDARRAY_BASE(owner)
        if not issubclass(type(base), np.ndarray):
            break
        owner = base
    if _NDARRAY_FLAGS(owner).owndata:
        return _ndarray_extent, owner, _ndarray_extent(owner)
    if type(base) is memoryview:  # (memoryview cannot be subclassed)
        try:
            base = base.obj
        except ValueError:  # released by the caller: nothing to follow
            return None
    if issubclass(type(base), _CDATA):
        return _cdata_extent, base, _cdata_extent(base)
    return None


def _check_pins(what: str, pins: Sequence[Tuple[str, Any]]) -> None:
    """Raises InvalidArgument when the memory a converted argument views
    moved or shrank after it was converted: the caller's code converting a
    later argument (its __array__) resized the array or ctypes object that
    owns it (ndarray.resize(..., refcheck=False), ctypes.resize), which freed
    the memory the earlier argument's view still named, and the library read
    freed memory."""
    for name, pin in pins:
        if pin is None:
            continue
        extent, owner, then = pin
        if extent(owner) != then:
            raise InvalidArgument.make(
                f"{what}: the memory under {name} was resized while the call converted its "
                "arguments; its rows were no longer where they were (pass arrays that stay "
                "as they are during the call)")


class _Export:
    """One zero-copy array over memory the engine owns (its staging buffers):
    the object numpy (``__array_interface__``) or torch
    (``__cuda_array_interface__``, v3) wraps without a copy, and which the
    array keeps alive as its base. While any export lives, the engine's
    memory stays allocated: Engine.close() (also the one of an Engine
    dropped or collected: an export holds the engine's _Memory, not the
    Engine) then closes the engine for every call but defers freeing it
    (akv_engine_destroy) until the last export is gone, so an array kept too
    long can hold stale rows but never points at freed memory. No 'stream'
    entry on CUDA: the compute stream already waits for the staged rows on
    the device."""

    # Invariant: an export describes memory the engine owns and is counted
    # (engine._exports) for as long as it lives. Its interface is not
    # writable (slots, read-only properties that give a new dict each time:
    # a plain dict attribute could be pointed at any address through
    # ndarray.base), and it is not copied (a copy was an export nobody
    # counted: close() freed the memory under the copy's arrays).
    __slots__ = ("_iface", "_cuda", "_mem", "_ref", "__weakref__")

    def __init__(self, engine: "Engine", ptr: int, shape: Tuple[int, ...],
                 strides: Optional[Tuple[int, ...]], typestr: str, cuda: bool) -> None:
        self._iface = (tuple(shape), typestr, ptr, None if strides is None else tuple(strides))
        self._cuda = cuda
        # the engine's _Memory, not the Engine (see _Memory)
        self._mem = engine._mem
        # Counted by a weak reference in the engine's list, which the export's
        # end takes out again through its callback, list.remove: C, no Python
        # frame, so no exception can land between the export's end and its
        # count (a __del__ that counted could be cut short at its start, and
        # the engine's memory was then never freed). Appended with no frame
        # before it; cut short before, the export is not counted, and no
        # array was made over it either.
        exports = engine._exports
        ref = weakref.ref(self, exports.remove)
        self._ref = ref
        exports.append(ref)

    def _interface(self, cuda: bool) -> Dict[str, Any]:
        if self._cuda is not cuda:
            raise AttributeError("__cuda_array_interface__" if cuda else "__array_interface__")
        shape, typestr, ptr, strides = self._iface
        return {"shape": shape, "typestr": typestr, "data": (ptr, False), "strides": strides,
                "version": 3}

    @property
    def __array_interface__(self) -> Dict[str, Any]:
        return self._interface(False)

    @property
    def __cuda_array_interface__(self) -> Dict[str, Any]:
        return self._interface(True)

    def __copy__(self) -> Any:
        raise TypeError("the base of an activekv zero-copy array cannot be copied (copy the "
                        "array: np.array(a) or a.copy())")

    def __deepcopy__(self, memo: Any) -> Any:
        self.__copy__()

    def __reduce_ex__(self, protocol: Any) -> Any:
        self.__copy__()

    def __del__(self) -> None:
        # The last export gone (its own reference, still listed until its
        # callback runs just after this, aside): the deferred destroy. Cut
        # short, the engine's close() or its own end does it
        # (_Memory.destroy_pending).
        mem = getattr(self, "_mem", None)
        if mem is not None and mem.pending:
            exports = mem.exports
            ref = getattr(self, "_ref", None)
            if not exports or (len(exports) == 1 and exports[0] is ref):
                mem.destroy_pending(ending=ref)


class _Memory:
    """What the zero-copy arrays over an engine's memory hold of it (each
    _Export), in place of the Engine: the live exports, the destroy close()
    deferred behind them, and the log trampoline the C engine calls until it
    is destroyed. Invariant: nothing here leads back to the Engine or to the
    caller's objects (the log sink reaches the caller's callback only through
    a weak reference to the Engine). An ndarray is invisible to the garbage
    collector, so a reference cycle through one (an object holding the
    engine, whose method is the engine's log callback, and a view array) was
    never collected when the array held the Engine: the engine, its threads
    and its pinned memory were never freed."""

    __slots__ = ("exports", "pending", "forks", "log_cb")

    def __init__(self, forks: int) -> None:
        # live zero-copy arrays (_Export: a weak reference each, removed by
        # its callback) and the C handle whose destroy waits for the last
        self.exports: List["weakref.ReferenceType[_Export]"] = []
        self.pending: Dict[str, int] = {}
        self.forks = forks
        self.log_cb: Any = None

    def __del__(self) -> None:
        # The last holder gone (the Engine and every export): a destroy that
        # each export's end missed (two ending at once on two threads each saw
        # the other still listed) is made here, never lost
        if getattr(self, "pending", None):  # made in full (an __init__ cut short is not)
            try:
                self.destroy_pending()
            except Exception:  # noqa: BLE001 - a finalizer (interpreter exit)
                pass

    def destroy_pending(self, ending: Any = None) -> None:
        """The destroy close() deferred behind live arrays, once none is left
        (`ending`: the reference of an export ending now, still listed)."""
        if self.forks != _FORKS[0]:
            return  # the parent's engine (see _FORKS): nothing to free here
        pending = self.pending
        exports = self.exports
        if "h" not in pending or (exports and exports != [ending]):
            return
        # taken with no point between it and the call where an exception can
        # land (pop is a call, and one landing after it lost the destroy)
        h = pending["h"]
        try:
            del pending["h"]
            st = lib.akv_engine_destroy(h)
        except Exception:  # at interpreter exit lib may be gone
            return
        except BaseException:
            # cut short anywhere here (see _BAD_HANDLE): a destroy not made
            # stays pending, for the next end (_Memory.__del__ at the latest)
            if "h" not in pending and _engine_alive(h):
                pending["h"] = h
            raise
        if st != 0:  # close() checked what destroy refuses; say so if it still did
            warnings.warn(f"activekv: the deferred destroy of a closed engine failed "
                          f"({lib.akv_status_string(st).decode(errors='replace')}); its "
                          "memory stays allocated",
                          ResourceWarning, stacklevel=2)


def _counted_export(engine: "Engine", ptr: int, shape: Tuple[int, ...],
                    strides: Optional[Tuple[int, ...]], typestr: str, cuda: bool,
                    live: Optional[Callable[[], Any]] = None) -> "_Export":
    """An _Export over engine memory, counted, made only while the engine
    (and what `live` checks, e.g. the lease) is still open: BadHandle
    otherwise, before any array is made over it.

    Invariant: no array over engine memory that may already be freed. The
    one-call-at-a-time guard keeps other threads out, but the caller's code
    can still run on this thread inside the call, between the check that
    the lease is live and the export being counted (a gc callback or a
    finalizer at an allocation there, a signal handler): an Engine.close()
    made there (a nested call, which the guard lets through) found no array
    counted and freed the staging buffer at once. Checked again once the
    export is counted: a close before that is seen here, one after it
    defers the free behind the export."""
    exp = _Export(engine, ptr, shape, strides, typestr, cuda)
    try:
        if engine._handle is None:
            raise BadHandle.make("the engine was closed during the call (by the caller's code "
                                 "on this thread: a finalizer, a gc callback, a signal handler)")
        if live is not None:
            live()
    except BaseException:
        # not kept by the traceback's frame: a kept exception would hold the
        # engine's memory (the export defers its destroy)
        exp = None
        raise
    return exp


def _export_array(engine: "Engine", ptr: int, shape: Tuple[int, ...], strides: Tuple[int, ...],
                  dtype: str, cuda: bool, live: Optional[Callable[[], Any]] = None) -> Any:
    """A numpy array (host) or torch tensor (CUDA) over engine memory, whose
    base is an _Export (see there and _counted_export)."""
    if cuda:
        torch = _torch()
        exp = _counted_export(engine, ptr, shape, strides, _CAI_TYPESTR[dtype], True, live)
        return _as_torch_type(torch, torch.as_tensor(exp, device="cuda"), dtype)
    return np.asarray(_counted_export(engine, ptr, shape, strides, _NP_DTYPE[dtype].str, False,
                                      live))


# ----------------------------------------------------------------- engine

_CUDA_STREAM_LEGACY = 1  # cudaStreamLegacy, ((cudaStream_t)0x1)


def _torch_stream_handle(stream: Any) -> int:
    """A torch.cuda.Stream as the engine's compute stream. torch's default
    stream is CUDA's legacy default stream, cudaStream_t 0; the engine refuses
    a NULL stream (NULL is ambiguous under per-thread default streams), so it
    is named by its explicit handle cudaStreamLegacy, the same stream."""
    return int(stream.cuda_stream) or _CUDA_STREAM_LEGACY


LogFn = Callable[[str, str], None]


# Per thread: ``logging``, the log sinks (_LogSink) of the engines whose log
# callback runs on it now (Engine._enter refuses calls on those engines);
# ``calls``, how many engine calls it is in (create included);
# ``interrupt``, a KeyboardInterrupt or SystemExit a log callback raised
# during one of them, which the call raises once the library returned
# (_LogSink, Engine._leave).
_TLS = threading.local()


# Forks since import, as the child sees it (os.register_at_fork): an engine
# made before a fork belongs to the parent. The child has its Python objects
# but none of the library's threads, so a step there waits forever, and so
# does its close (draining a host stream whose worker is not in the child):
# Engine._enter refuses every call from the child, its garbage collection
# included.
_FORKS = [0]


def _forked() -> None:
    _FORKS[0] += 1


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)


def _forked_repr(engine: Any, what: str) -> Optional[str]:
    """The repr of an object of `engine` in a child forked after the engine
    was made (where every call on either raises BadHandle), None elsewhere
    (and for an engine never made). Reads the engine's own attributes only:
    no call, never raises."""
    d = getattr(engine, "__dict__", None)
    if type(d) is not dict or "_forks" not in d or d["_forks"] == _FORKS[0]:
        return None
    return (f"<activekv.{what} of process {d.get('_pid')}, unusable in this forked child (every "
            "call raises BadHandle)>")


def _take_interrupt() -> Optional[BaseException]:
    return _TLS.__dict__.pop("interrupt", None)


def _guarded(fn: Callable) -> Callable:
    """Runs a method of an Engine, or of an object made from one, as the one
    call in flight on that engine (Engine._enter): a second thread is refused
    with Busy instead of racing the first inside the library."""

    @functools.wraps(fn)
    def call(self, *args, **kwargs):
        eng = self if isinstance(self, Engine) else self._engine
        held = eng._enter(fn.__name__, fn.__qualname__)
        try:
            return fn(self, *args, **kwargs)
        finally:
            if held:
                # Engine._leave, inline: the engine is released before any
                # point where an exception could land (a frame's start)
                tls = _TLS.__dict__
                tls["calls"] -= 1
                del eng._slot["owner"]
                if "interrupt" in tls:
                    interrupt = tls.pop("interrupt")
                    if interrupt is not None:
                        raise interrupt

    return call


# _Owning: a call that makes a handle (akv_engine_create, akv_context_open,
# akv_stream_create, akv_lease_begin) writes it (*out) straight into the
# _Box of the object that owns it, built and registered with its engine
# before the call: no Python code runs between the library returning and the
# object owning the handle, so an exception raised as the call returns (a
# KeyboardInterrupt lands at the first bytecode after it, a MemoryError in
# the bookkeeping) cannot lose it. The library writes *out only on success:
# a NULL box after the call means nothing was made. A create whose object
# cannot reach the caller after all is undone (the engine destroyed, the
# context closed, the stream destroyed); a lease cannot be undone, and
# lease_begin of its layer hands it out again (Engine.lease_begin).


class _Box(ctypes.c_void_p):
    """The storage of one C handle: what the creating call writes through
    (ctypes.byref) and what its object reads as ``_handle`` (None when
    NULL). Objects naming the same handle share its box, so clearing it
    (closed, retired, released) clears it for all of them at once."""


def _as_box(handle: Any) -> _Box:
    """The box of a new Context, Lease or Stream object: the package passes
    the box its creating call wrote (_Owning); None gives a dead object
    (BadHandle). Invariant: an object's handle is one the library made. A
    number is refused (InvalidArgument): the library reads the record a
    handle points at, and a forged one (Context(engine, 0x1000)) crashed the
    process."""
    if type(handle) is _Box:  # not isinstance: see _ctx_handle
        return handle
    if handle is None:
        return _Box()
    raise InvalidArgument.make(f"{handle!r} is not a handle: contexts, leases and streams are "
                               "made by Engine.open_context, lease_begin and stream_create")


def _init_once(obj: Any, engine: Any) -> None:
    """The start of Context/Lease/Stream.__init__. Invariant: an object names
    one handle for its life, of one Engine. A second __init__ emptied its box
    (a context's host slot and rows, a begun lease, lost to the caller while
    the object still claimed them), and an object around anything but an
    Engine failed every call with AttributeError from inside the package."""
    if "_box" in obj.__dict__:
        raise InvalidArgument.make(f"{type(obj).__name__}.__init__: already made (an object "
                                   "names one handle for its life)")
    if not issubclass(type(engine), Engine):
        raise InvalidArgument.make(f"{type(obj).__name__}: {engine!r} is not an Engine; "
                                   "contexts, leases and streams are made by the engine")


def _set_handle(obj: Any, value: Optional[int]) -> None:
    obj._box.value = value


# ``obj._handle``: the handle in ``obj._box``, None when there is none. Read
# through C (attrgetter), so reading runs no Python frame; the package
# writes ``obj._box.value`` itself for the same reason (a Python setter's
# frame is a point where an interrupt lands, between clearing a handle and
# the call that ends it, or after a refusal and before the handle is back).
_handle_attr = functools.partial(property, operator.attrgetter("_box.value"), _set_handle)


# _Ending: the calls that end a handle (akv_engine_destroy, akv_context_close,
# akv_stream_destroy, akv_lease_retire / _try_retire, and
# akv_engine_quarantine for the leases it releases) run with the objects'
# handles already cleared, and give them back only when the library refused
# (nothing changed then). A KeyboardInterrupt raised as such a call returns
# (a Ctrl-C during a blocking retire is raised at the first bytecode after
# it) so leaves a dead object, never one holding a dead handle: the library
# hands dead handle records out again ("Handle lifetimes" in akv.h), and the
# object would later close, retire or destroy whatever newer object got it.
# Lease.retire and try_retire know better: the library fills the receipt
# only when it retired the lease, so one cut short gives the handle back
# when the receipt is untouched (try_retire's "not ready" is common).
#
# _Recorded: state the package mirrors from the library (Engine._step_open)
# is set the same way: to what the call does, before the call, and back
# only on a refusal. The status of a call cut short as it returns is lost
# with the exception, so a flag set after the call would say otherwise than
# the library (a step read as closed: close destroyed the streams, then was
# refused; one read as open after step_end: close refused for good).


# A refusal cut short: an ending call (_Ending) or a _Recorded one refused,
# with nothing changed, and a KeyboardInterrupt raised as it returned loses
# the refusal with its status; the handle cleared or the state recorded for
# the call would stay so (a context, stream or engine the library kept read
# as closed and could never be closed again; a step read as open that the
# library never opened, and close refused for good). Such a call is made
# inside try, with everything from the clearing (or recording) to the
# putting back; cut short anywhere there (an exception other than the
# refusal's own), the library is asked what the call did (the probes below
# change nothing but the engine's last_error, and log a debug line, as any
# refusal) and the object follows its answer. These run only on that path:
# the calls themselves cost nothing more.

# _STALE: a handle passed to C is read after the last point where the
# caller's code can run during the call (an argument's __array__, an
# iterator, a __getattr__ of a stream argument): that code may close the
# object, and the library hands a dead handle record out again after enough
# later opens ("Handle lifetimes" in akv.h), so a handle read before it
# named whichever newer object got the record (an append wrote its rows
# into another engine's context). The early self._h() calls only keep
# BadHandle ahead of argument errors.

_BAD_HANDLE = STATUS_VALUES["AKV_ERR_BAD_HANDLE"]
_INVALID_ARGUMENT = STATUS_VALUES["AKV_ERR_INVALID_ARGUMENT"]
_STEP_STATE = STATUS_VALUES["AKV_ERR_STEP_STATE"]


def _engine_alive(h: int) -> bool:
    """Whether engine handle h still names a live engine: a destroyed one
    answers AKV_ERR_BAD_HANDLE to every call and changes nothing ("Handle
    lifetimes" in akv.h)."""
    info = L.out_struct(L.akv_engine_info)
    return lib.akv_engine_info_get(h, ctypes.byref(info)) != _BAD_HANDLE


def _context_alive(h: int) -> bool:
    """As _engine_alive, for a context handle."""
    return lib.akv_context_id(h, ctypes.byref(ctypes.c_uint32())) != _BAD_HANDLE


def _stream_alive(eh: int, h: int, backend: str) -> bool:
    """Whether stream h is still one of engine eh's. Host backend: a
    destroyed stream is refused by every call that takes one
    (AKV_ERR_INVALID_ARGUMENT), and a synchronize of a live one only waits
    for its work. Where that cannot tell (a quarantined engine refuses the
    synchronize first) and on CUDA (a cudaStream_t, which the library
    cannot check): the destroy again, which looks it up in the engine's own
    list first and refuses one it no longer holds (AKV_ERR_INVALID_ARGUMENT),
    one it refused the same way as before (and destroys one the first call
    never reached: then it is not alive)."""
    if backend == "host":
        st = lib.akv_stream_synchronize(eh, h)
        if st in (0, _INVALID_ARGUMENT):
            return st == 0
    return lib.akv_stream_destroy(eh, h) not in (0, _INVALID_ARGUMENT)


def _step_open_now(h: int, default: bool) -> bool:
    """Whether the engine has a step open, as the library says: a step_begin
    of no contexts is refused with AKV_ERR_STEP_STATE inside a step and
    AKV_ERR_INVALID_ARGUMENT outside one (the step is checked first), and
    changes nothing either way. `default` where it answers neither (a
    quarantined engine)."""
    st = lib.akv_step_begin(h, None, 0)
    return True if st == _STEP_STATE else False if st == _INVALID_ARGUMENT else default


class _NotCopyable:
    """Objects that name a C handle are not copied: a copy would keep the
    handle after the original closed, retired or destroyed it, and the
    library hands dead handle records out again (akv.h, "Handle
    lifetimes"), so the copy could later name, and close, a newer object."""

    def __copy__(self) -> Any:
        raise TypeError(f"an activekv.{type(self).__name__} cannot be copied (it names a C "
                        "handle)")

    def __deepcopy__(self, memo: Any) -> Any:
        self.__copy__()

    def __reduce_ex__(self, protocol: Any) -> Any:
        self.__copy__()


class _ClosedOnExit(_NotCopyable):
    """A context manager that closes its object on exit. When the block is
    left by an exception, a failure of close itself is suppressed so that
    the original exception is the one the caller sees."""

    def __enter__(self):
        return self

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is None:
            self.close()
        else:
            with contextlib.suppress(ActiveKVError):
                self.close()


class _LogSink:
    """An engine's log callback (what its C trampoline calls), apart from the
    engine: the trampoline lives as long as the engine, and a trampoline of
    a bound method of the engine would put the engine in a reference cycle,
    freed only by a garbage collection instead of when its last reference
    goes. It reaches the caller's callback (Engine._log) through a weak
    reference to the engine: the engine's _Memory, which its arrays hold,
    keeps the trampoline, and nothing there may lead back to the caller's
    objects (see _Memory). Lines logged once the Engine object is gone (its
    deferred destroy, a destroy during a garbage collection) have nobody to
    go to and are dropped. It also keeps the error lines of a failed create,
    which has no engine to hold its message. While it runs, this thread's
    ``logging`` holds it (Engine._enter refuses the engine's own calls
    there)."""

    __slots__ = ("engine", "own", "errors")

    def __init__(self, engine: "weakref.ReferenceType[Engine]", own: bool) -> None:
        self.engine = engine
        self.own = own  # a callback was given; else the library's stderr lines
        self.errors: List[str] = []

    def __call__(self, user: Any, level: int, message: bytes) -> None:
        text = message.decode(errors="replace") if message else ""
        name = _inv(LOG_LEVELS).get(level, "debug")
        if level == 0:
            self.errors.append(text)
            del self.errors[:-4]
        if not self.own:
            with contextlib.suppress(Exception):  # stderr closed (interpreter exit)
                sys.stderr.write(f"activekv {name}: {text}\n")
            return
        eng = self.engine()
        log = None if eng is None else eng.__dict__.get("_log")
        if log is None:
            return
        logging = _TLS.__dict__.setdefault("logging", [])
        logging.append(self)
        try:
            log(name, text)
        except Exception:
            # Nothing can unwind into C: ctypes reports it (sys.unraisablehook,
            # "Exception ignored on calling ctypes callback function") and the
            # library goes on.
            raise
        except BaseException as exc:  # KeyboardInterrupt, SystemExit
            if getattr(_TLS, "calls", 0) <= 0:
                raise  # a library thread: reported as above
            # held for the engine call on this thread to raise once the
            # library returned (Engine._leave; Engine.__init__ for create)
            if getattr(_TLS, "interrupt", None) is None:
                _TLS.interrupt = exc
        finally:
            logging.pop()


class Engine(_ClosedOnExit):
    """One engine (akv_engine): pools, queues, admission.

    Keyword arguments are akv_engine_config's field names; enums as strings:
    backend="auto"|"host"|"cuda", route="stage"|"arena"|"paged",
    dtype="bf16"|"f16"|"f32"|"fp8_e4m3"|"fp8_e5m2", fit_mode="refuse"|"shrink",
    log_level="error"|"warn"|"info"|"debug"; fault_kind an int or an op kind
    name. Headroom (arena and paged routes): headroom_gib,
    headroom_reserve_gib, headroom_chunk_pages, and host_fake_free_bytes
    (host backend: model a device of that many bytes, for tests). ``log``
    is a callable(level, message) receiving every log line (from any thread
    the library logs on); None (default) keeps the library's default,
    stderr. An exception the callback raises is reported as unraisable
    (sys.unraisablehook) and the library goes on; a KeyboardInterrupt or
    SystemExit raised in it during an engine call on the same thread is
    raised by that call once the library returned. The callback must not
    call the engine that is logging (Busy); other engines it may.

    Allocates everything at creation (akv_engine_create). Not thread-safe:
    use it and its contexts, leases and streams from one thread at a time.
    Not fork-safe: in a child forked after creation every call raises
    BadHandle (make an engine in the child).
    A context manager: leaving the block closes it.

    Raises: InvalidArgument (a field), Config, NoFit (refuse mode; the
    message names the setting to change), OutOfMemory, NotSupported (CUDA
    requested but unavailable), Backend.
    """

    _handle = _handle_attr()

    def __init__(self, *, log: Optional[LogFn] = None, **cfg: Any) -> None:
        if "_box" in self.__dict__:
            # Invariant: one Engine object, one C engine. A second __init__
            # made another engine in the same object and dropped the first's
            # handle without a destroy (leaked for the life of the process).
            raise InvalidArgument.make("Engine.__init__: this engine is already made; make a "
                                       "new Engine")
        # What the engine holds of the objects made from it is weak (their
        # boxes, weak sets): they hold the engine, so an engine dropped
        # without close() is freed when its last reference goes, by its
        # reference count (__del__), never left to a garbage collection.
        self._box = _Box()
        self._forks, self._pid = _FORKS[0], os.getpid()  # see _FORKS
        # one call at a time (_enter): {"owner": the thread in a call};
        # _release gives it back with no Python frame (see _leave)
        self._slot: Dict[str, int] = {}
        self._release = functools.partial(dict.__delitem__, self._slot, "owner")
        # live zero-copy arrays and the C handle whose destroy waits for the
        # last: the arrays' _Memory, shared
        self._mem = _Memory(self._forks)
        self._exports = self._mem.exports
        self._pending_destroy = self._mem.pending
        # the boxes of the leases begun and not known dead (retired or
        # released): a lease whose Lease object was lost is still here, for
        # lease_begin to hand out again and for quarantine and close to end
        self._lease_boxes: List[_Box] = []
        self._retained = False  # an uncertain quarantine retains everything
        self._quarantined = False  # a quarantine established completion
        if log is not None and not callable(log):
            raise TypeError(f"Engine: log={log!r} is not callable (level, message)")
        self._lib = lib
        # streams of akv_stream_create not destroyed yet: their boxes (close
        # destroys them, Stream objects alive or not); the default one's
        # box, and its Stream while one is alive
        self._streams: List[_Box] = []
        self._default_box: Optional[_Box] = None
        self._default_ref: Optional["weakref.ReferenceType[Stream]"] = None
        self._contexts: "weakref.WeakSet[Context]" = weakref.WeakSet()
        # boxes of contexts dropped while the open step held them (InUse):
        # closed when the step ends (_close_orphans)
        self._orphans: List[_Box] = []
        self._step_open = False  # between a successful step_begin and step_end / quarantine
        c, self._cfg_dict = _make_config(cfg)
        self._dtype = self._cfg_dict["dtype"]
        # The trampoline lives as long as the engine (the C side keeps the
        # function pointer); see _LogSink.
        self._log = log
        self._sink = _LogSink(weakref.ref(self), log is not None)
        self._log_cb = self._mem.log_cb = L.LOG_FN(self._sink)
        c.log_fn = self._log_cb
        self._cfg = c
        cref, out = ctypes.byref(c), ctypes.byref(self._box)  # the engine owns it: _Owning
        tls = _TLS.__dict__
        try:
            tls["calls"] = tls.get("calls", 0) + 1  # counted inline: no frame here
            try:
                st = lib.akv_engine_create(cref, out)
            finally:
                tls["calls"] -= 1
            interrupt = _take_interrupt()
            if interrupt is not None:  # Ctrl-C in the log callback: no engine for the caller
                raise interrupt
            if st != 0:
                msg = "; ".join(self._sink.errors) or lib.akv_status_string(st).decode()
                raise error_for(st, f"engine create: {msg}")
            info = self.info()
            self._cfg_dict["backend"] = info.backend
        except BaseException:
            # no engine reaches the caller: destroy the one the call made (a
            # fresh engine, nothing to refuse); cut short too, __del__ does it
            h, self._box.value = self._box.value, None
            if h is not None:
                lib.akv_engine_destroy(h)
            raise

    # Invariant: an Engine whose __init__ did not run (Engine.__new__, a subclass whose
    # __init__ skips it) or stopped before its state was made answers every call and
    # property with BadHandle, as a closed engine does, never with AttributeError from
    # inside the package (the objects made around one, a Context(engine, None), too).
    # Called only when an attribute is missing: the made engine's calls never pay for it.
    _STATE = frozenset((
        "_box", "_forks", "_pid", "_slot", "_release", "_mem", "_exports", "_pending_destroy",
        "_lease_boxes", "_retained", "_quarantined", "_lib", "_streams", "_default_box",
        "_default_ref", "_contexts", "_orphans", "_step_open", "_cfg_dict", "_dtype", "_log",
        "_sink", "_log_cb", "_cfg"))

    def __getattr__(self, name: str) -> Any:
        if name in Engine._STATE:
            raise BadHandle.make(f"this {type(self).__name__} was never made (Engine.__init__ "
                                 "did not run, or failed): make a new Engine")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # -- one call at a time
    def _enter(self, what: str, key: Optional[str] = None) -> bool:
        """Makes this thread the one in a call on the engine. Returns True
        when it took the engine (the caller then calls _leave), False for a
        call nested in one this thread already makes. The call that took it
        is recorded as ``_what`` (`key`, else `what`: _guarded passes the
        method's qualified name), for a nested call to see whose call it is
        in (Engine.close). Raises Busy when
        another thread is in a call (akv.h: one thread at a time; detected
        here instead of racing inside the library); BadHandle in a forked
        child of the process that made the engine (_FORKS); Busy from the
        engine's own log callback (the library is inside one of the engine's
        calls then; another engine may be called there, as akv.h allows)."""
        if self._forks != _FORKS[0]:
            raise BadHandle.make(f"{what}: the engine was made in process {self._pid}, before a "
                                 "fork; the library's threads and queues are not in this child "
                                 "(make an engine here)")
        tls = _TLS.__dict__  # this thread's: one dict lookup per key below (hot path)
        logging = tls.get("logging")
        if logging and any(e is self._sink for e in logging):
            raise Busy.make(f"{what}: called from the engine's log callback; the callback runs "
                            "inside the engine's own calls and must not call it")
        me = threading.get_ident()
        slot = self._slot
        if slot.get("owner") == me:
            return False
        calls = tls.get("calls", 0)
        # Taken by one atomic dict operation, which says afterwards who took
        # it: an exception landing as it returns (a Ctrl-C there) gives back
        # what it took. (A lock taken there had no owner recorded, and every
        # later call, the engine's close and its release included, was
        # refused with Busy for good.)
        try:
            owner = slot.setdefault("owner", me)
        except BaseException:
            if slot.get("owner") == me:  # not nested (checked above): taken by this call
                del slot["owner"]
            raise
        if owner != me:
            raise Busy.make(f"{what}: the engine is in a call on another thread; an engine and "
                            "everything made from it are used from one thread at a time")
        tls["calls"] = calls + 1
        self._what = key or what
        return True

    def _leave(self) -> None:
        """Ends the call _enter began. Raises the KeyboardInterrupt (or
        SystemExit) a log callback raised during the call, now that the
        library returned.

        An exception landing at this method's start would leave the engine
        taken: callers that must not (the adapter's finally blocks) call
        ``_release()`` (C, no frame) and then ``_left()`` instead; _guarded
        does the same inline."""
        self._release()
        self._left()

    def _left(self) -> None:
        """The rest of _leave once the engine is released."""
        tls = _TLS.__dict__  # the count and _take_interrupt(), inline (hot path)
        tls["calls"] -= 1
        if "interrupt" in tls:
            interrupt = tls.pop("interrupt")
            if interrupt is not None:
                raise interrupt

    # -- zero-copy exports (see _Export)
    def _destroy_pending(self, ending: Any = None) -> None:
        """The destroy close() deferred behind live arrays, once none is left
        (see _Memory)."""
        self._mem.destroy_pending(ending)

    @property
    def live_arrays(self) -> int:
        """Zero-copy arrays over the engine's memory (View.keys/values/
        kv_tensors and what was derived from them) still alive. While there
        are any, close() closes the engine but frees its memory only when the
        last one is gone."""
        return len(self._exports)

    # -- lifetime
    def _h(self) -> int:
        if self._handle is None:
            raise BadHandle.make("the engine is closed")
        return self._handle

    def _ctx_handle(self, ctx: Any, what: str) -> int:
        """The C handle of one of this engine's live contexts.

        Invariant: a handle the package passes to C is one the library made.
        The type is checked with type(), not isinstance, which believes an
        object's own __class__: a duck object saying it was a Context (or a
        subclass overriding _h) handed the library any number as a context
        handle, and the library read the record at that address (a crash).
        Only the engine makes contexts, always of this exact class; the same
        holds for leases (View) and streams (_stream_arg)."""
        if type(ctx) is not Context:
            raise InvalidArgument.make(f"{what}: {ctx!r} is not a Context")
        if ctx._engine is not self:
            raise InvalidArgument.make(f"{what}: the context belongs to another engine")
        return Context._h(ctx)

    @_guarded
    def close(self) -> None:
        """Destroys the engine (akv_engine_destroy) after destroying the
        streams this package made for it. Never waits or drains: with an open
        step, an unretired lease or an uncertain quarantine it raises Busy and
        frees nothing (the engine stays usable). Closing twice is a no-op.

        While zero-copy arrays over the engine's memory are alive
        (``live_arrays``), the engine is closed for every call (BadHandle)
        at once, but its memory is freed only when the last of them is
        gone, so an array kept past close never reads freed memory."""
        if self._handle is None:
            if self._pending_destroy:
                self._destroy_pending()  # the last array's end was cut short before it
            return
        outer = self.__dict__.get("_what")
        if outer not in ("Engine.close", "ActiveKVCache.close"):
            # Nested in another call on this engine, on this thread: the caller's code
            # running inside that call (a gc callback or a finalizer at an allocation
            # there, a signal handler, a tracer). Freed there, the engine was gone under
            # the call, which went on with its handles and made arrays over the freed
            # staging buffer (or, in an ActiveKVCache's update, failed with
            # AttributeError and kept the engine taken). Refused as a call from the
            # engine's log callback is (Busy); nothing changed.
            raise Busy.make(f"engine close: called inside another call on this engine on the "
                            f"same thread ({outer}: a finalizer, gc callback or signal handler "
                            "running there); nothing was freed")
        if self._step_open:
            # Checked before the streams: a stream an unretired lease used
            # refuses to go (InUse), and the others must stay as they are.
            raise Busy.make("engine close: destroy refused: a step is open (retire its leases, "
                            "end it); nothing was freed")
        if self._retained:
            raise Busy.make("engine close: destroy refused: quarantine could not establish "
                            "completion, everything stays retained; nothing was freed")
        # Checked here too (akv_engine_destroy refuses it as well): before the
        # streams go, and before a destroy deferred behind live arrays, whose
        # refusal could no longer reach the caller.
        info = self.info()
        if info.transport_failed and not info.quarantined:
            raise Busy.make("engine close: destroy refused: the transport failed, quarantine "
                            "first; nothing was freed")
        for box in list(self._streams):
            self._stream_destroy(box)
        h = self._handle
        if self._exports:
            # closed for every call before the destroy is deferred (no point
            # between the two where an exception can land): never a deferred
            # destroy behind an engine that reads as open
            try:
                self._box.value = None
                self._pending_destroy["h"] = h
            except BaseException:  # cut short between the two: still open
                if "h" not in self._pending_destroy:
                    self._box.value = h
                raise
            if not self._exports:  # the last one went meanwhile
                self._destroy_pending()
        else:
            # the handle goes before the call (see _Ending), back only on a refusal
            try:
                self._box.value = None
                st = lib.akv_engine_destroy(h)
                if st != 0:
                    self._box.value = h
                    _check(st, h, "engine close")
            except ActiveKVError:
                raise  # the refusal: the handle is back
            except BaseException:  # cut short anywhere here (see _BAD_HANDLE)
                self._box.value = h if _engine_alive(h) else None
                raise
        self._box.value = None
        for ctx in list(self._contexts):
            ctx._box.value = None
        self._contexts.clear()
        for box in self._lease_boxes:
            box.value = None
        self._lease_boxes = []

    def _close_abandoning(self) -> None:
        """close() for an engine nobody can finish any more: a ``with``
        block left by an exception and an engine garbage-collected. Where
        close refuses (Busy: an open step, e.g. a lease the exception left
        unretired, or a failed transport), a quarantine establishes
        completion and releases the leases first, so the engine's memory
        is freed instead of held until the process exits. An uncertain
        quarantine still retains everything (UncertainFence)."""
        try:
            self.close()
        except Busy:
            if (self._handle is None or self._retained
                    or self._slot.get("owner") == threading.get_ident()):
                # (the last: nested in a call on this thread, which close refuses; a
                # quarantine there would release the leases that call is using)
                raise
            self.quarantine()
            self.close()

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is None:
            self.close()
        else:
            with contextlib.suppress(ActiveKVError):
                self._close_abandoning()

    def __del__(self) -> None:
        if "_box" not in self.__dict__:
            return  # never made (see __getattr__): nothing to free
        if getattr(self, "_handle", None) is not None:
            with contextlib.suppress(Exception):
                self._close_abandoning()
        elif self.__dict__.get("_pending_destroy"):
            self._destroy_pending()  # the last array's end was cut short before it

    # -- diagnostics
    @property
    @_guarded
    def last_error(self) -> str:
        """The engine's last error in words ("" before any)."""
        return lib.akv_engine_last_error(self._h()).decode(errors="replace")

    @_guarded
    def info(self) -> EngineInfo:
        """Geometry, memory and counters (akv_engine_info_get). Enqueues
        nothing; allowed at any time, also after a transport failure."""
        i = L.out_struct(L.akv_engine_info)
        _check(lib.akv_engine_info_get(self._h(), ctypes.byref(i)), self._handle, "info")
        d = _struct_dict(i)
        d["backend"] = _inv(BACKENDS)[i.backend]
        d["route"] = _inv(ROUTES)[i.route]
        d["backend_ops"] = {k: int(i.backend_ops[v]) for k, v in OP_KINDS.items()}
        d["transport_failed"] = bool(i.transport_failed)
        d["quarantined"] = bool(i.quarantined)
        return EngineInfo(**d)

    # -- revocable headroom (DESIGN §6)
    @_guarded
    def headroom(self) -> Headroom:
        """The engine's headroom figures (akv_headroom_get). Enqueues
        nothing, never blocks; allowed at any time, also after a transport
        failure. An engine without headroom reports ``enabled`` False."""
        _need("akv_headroom_get")
        i = L.out_struct(L.akv_headroom_info)
        _check(lib.akv_headroom_get(self._h(), ctypes.byref(i)), self._handle, "headroom")
        d = _struct_dict(i)
        d["enabled"] = bool(d["enabled"])
        return Headroom(**d)

    @_guarded
    def headroom_release(self, nbytes: Optional[int] = None) -> Tuple[int, int]:
        """Gives at least `nbytes` of headroom back (whole chunks, newest
        first; None or more than is present: all of it; 0: nothing) and
        returns ``(freed_now, pending)`` in bytes. Outside a step the memory
        is freed before the call returns (freed_now); inside one nothing is
        freed or blocks: the chunks are marked (pending) and step_end frees
        them once every lease of the step retired. Decode stays
        bit-identical: the rows come from the host copy again. Raises
        NotSupported (headroom not enabled), Quarantined, BadHandle."""
        _need("akv_headroom_release")
        n = _u64(nbytes, "headroom_release: nbytes")
        freed, pending = ctypes.c_uint64(), ctypes.c_uint64()
        _check(lib.akv_headroom_release(self._h(), n, ctypes.byref(freed), ctypes.byref(pending)),
               self._handle, "headroom_release")
        return freed.value, pending.value

    @_guarded
    def headroom_take(self, nbytes: Optional[int] = None) -> int:
        """Takes headroom again, up to `nbytes` (whole chunks; None: as much
        as allowed), never past the pages measured at create nor past
        free - reserve as the device reports it now; returns the bytes
        taken (0 when nothing could be). Only outside a step; allocates
        device memory (blocking, not for the hot path). Raises NotSupported
        (headroom not enabled), StepState (a step is open or a release is
        pending), Quarantined, BadHandle."""
        _need("akv_headroom_take")
        n = _u64(nbytes, "headroom_take: nbytes")
        taken = ctypes.c_uint64()
        _check(lib.akv_headroom_take(self._h(), n, ctypes.byref(taken)), self._handle,
               "headroom_take")
        return taken.value

    @property
    def backend(self) -> str:
        """The backend in use: "host" or "cuda"."""
        return self._cfg_dict["backend"]

    @property
    def dtype(self) -> str:
        return self._dtype

    @property
    def config(self) -> Dict[str, Any]:
        """The effective config as a dict: defaults filled in, enums as
        strings, backend the one in use."""
        return dict(self._cfg_dict)

    @_guarded
    def admission_counters(self) -> Dict[str, int]:
        """Per-rule admission counters since create, keyed by rule name
        (ADM_RULES: akv_adm_rule_string's names with "_" for "-"): pages for
        the fill, reclaim and headroom rules, events for
        refuse/admit/release."""
        out = (ctypes.c_uint64 * L.AKV_ADM_RULE_COUNT)()
        _check(lib.akv_admission_counters(self._h(), out, L.AKV_ADM_RULE_COUNT), self._handle,
               "admission_counters")
        return {ADM_RULES[r]: int(out[r]) for r in range(L.AKV_ADM_RULE_COUNT)}

    @_guarded
    def admission_log(self) -> List[Decision]:
        """The newest admission decisions, oldest first (bounded log)."""
        cap = 256
        arr = (L.akv_adm_decision * cap)()
        n = ctypes.c_size_t()
        _check(lib.akv_admission_log(self._h(), arr, cap, ctypes.byref(n)), self._handle,
               "admission_log")
        rules = ADM_RULES
        none = 0xFFFFFFFF  # UINT32_MAX: no victim / the engine's own headroom row
        return [Decision(d.step, None if d.context == none else d.context,
                         rules[d.rule] if d.rule < len(rules) else str(d.rule),
                         None if d.victim == none else d.victim, d.pages)
                for d in arr[: n.value]]

    @_guarded
    def explain(self, ctx: Optional["Context"] = None) -> str:
        """A paragraph explaining a context's admission; ctx None explains the
        last refused open."""
        buf = ctypes.create_string_buffer(4096)
        h = None if ctx is None else self._ctx_handle(ctx, "explain")
        _check(lib.akv_admission_explain(self._h(), h, buf, len(buf)), self._handle, "explain")
        return buf.value.decode(errors="replace")

    @_guarded
    def quarantine(self) -> QuarantineReport:
        """Synchronises every engine queue, then the device (blocks). On
        success leases and tickets are released; raises UncertainFence when
        completion could not be established (everything stays retained)."""
        r = L.out_struct(L.akv_quarantine_report)
        h = self._h()
        # What a quarantine that establishes completion does (the leases
        # released, their handles dead; the step ended) is recorded before the
        # call and undone only when it did not (see _Ending).
        held = [(box, box.value) for box in self._lease_boxes if box.value is not None]
        before = (self._step_open, self._quarantined)
        fn, ref, called = lib.akv_engine_quarantine, ctypes.byref(r), False
        try:
            for box, _ in held:
                box.value = None
            self._step_open, self._quarantined = False, True
            called = True  # nothing can raise from here to the call
            st = fn(h, ref)
        except BaseException:
            # Cut short before the call, the library did nothing; as it
            # returned, the report (filled either way) says whether it
            # established completion: if not, everything stays retained.
            if not called or not (r.h2d_ok and r.d2h_ok and r.d2d_ok and r.device_ok):
                self._step_open, self._quarantined = before
                for box, lh in held:
                    box.value = lh
                self._retained = self._retained or called
            raise
        if st != 0:
            self._step_open, self._quarantined = before
            for box, lh in held:
                box.value = lh
        self._retained = st == STATUS_VALUES["AKV_ERR_UNCERTAIN_FENCE"]
        report = QuarantineReport(bool(r.h2d_ok), bool(r.d2h_ok), bool(r.d2d_ok),
                                  bool(r.device_ok), r.leases_released, r.tickets_released,
                                  r.retained_leases, r.uncertain.decode(errors="replace"))
        _check(st, self._handle, "quarantine")
        return report

    # -- contexts and steps
    @_guarded
    def open_context(self, target_pages: Optional[int] = None, burst_pages: int = 0) -> "Context":
        """Opens a context (akv_context_open): a host slot and its device
        target (None: the fair share, pool / concurrency; an explicit target
        lies in 0..2**32 - 2, as 2**32 - 1 is the library's fair-share
        sentinel). Not inside a step. Raises RefusedQueue (no host slot:
        queue it), AdmissionRefused, StepState, Config, InvalidArgument,
        Quarantined."""
        target = (L.AKV_TARGET_FAIR_SHARE if target_pages is None
                  else _target_pages(target_pages, "open_context: target_pages"))
        burst = _uint(burst_pages, "open_context: burst_pages")
        cc = L.akv_context_config(ctypes.sizeof(L.akv_context_config), L.AKV_CONFIG_VERSION,
                                  target, burst)
        h = self._h()
        if self._orphans and not self._step_open:
            self._close_orphans()  # dropped contexts still open: their host slots first
        ctx = Context(self, _Box())  # owns the handle the call writes: _Owning
        self._contexts.add(ctx)
        try:
            _check(lib.akv_context_open(h, ctypes.byref(cc), ctypes.byref(ctx._box)),
                   self._handle, "open_context")
            interrupt = _take_interrupt()
            if interrupt is not None:  # Ctrl-C in the log callback: no context for the caller
                raise interrupt
        except BaseException:
            ctx._discard()  # undone: closed (and when cut short, closed as it is dropped)
            raise
        return ctx

    @_guarded
    def step_begin(self, contexts: Sequence["Context"]) -> None:
        """Opens a decode step over `contexts` (the step boundary; residency
        changes here). Raises InvalidArgument, BadHandle, StepState,
        Capacity, UnevenLayers, Backend, Quarantined."""
        self._h()
        if isinstance(contexts, (Context, str, bytes)) or not hasattr(contexts, "__iter__"):
            raise InvalidArgument.make(f"step_begin: {contexts!r}: expected a sequence of Contexts")
        contexts = list(contexts)  # the caller's code (an iterator's) runs here, not below
        hs = [self._ctx_handle(c, "step_begin") for c in contexts]
        arr = (ctypes.c_void_p * max(1, len(hs)))(*hs)
        h, n, before = self._h(), len(hs), self._step_open
        # recorded before the call, undone only on a refusal (_Recorded)
        try:
            self._step_open = True
            st = lib.akv_step_begin(h, arr, n)
            if st != 0:
                self._step_open = before
                _check(st, self._handle, "step_begin")
        except ActiveKVError:
            raise  # the refusal: the state is back
        except BaseException:  # cut short anywhere here (see _BAD_HANDLE)
            self._step_open = _step_open_now(h, before)
            raise

    @_guarded
    def step_end(self) -> None:
        """Closes the step; every layer's lease must be retired. Each
        context grows by one row. Raises StepState, Quarantined."""
        h, before = self._h(), self._step_open
        try:
            self._step_open = False  # _Recorded
            st = lib.akv_step_end(h)
            if st != 0:
                self._step_open = before
                _check(st, self._handle, "step_end")
        except ActiveKVError:
            raise  # the refusal: the state is back
        except BaseException:  # cut short anywhere here (see _BAD_HANDLE)
            self._step_open = _step_open_now(h, before)
            raise
        if self._orphans:
            self._close_orphans()

    def _close_orphans(self) -> None:
        """Closes the contexts dropped while the step held them (see _Ending)."""
        # Each leaves the list only once closed: one cut short stays for the
        # next step's end (the engine's destroy frees it otherwise).
        orphans = self._orphans
        for box in list(orphans):
            if box.value is not None:
                h = box.value
                try:
                    box.value = None
                    st = lib.akv_context_close(h)
                    if st != 0:  # still held (a later step): at the next end, or the destroy
                        box.value = h
                except BaseException:  # cut short anywhere here (see _BAD_HANDLE)
                    box.value = h if _context_alive(h) else None
                    raise
            if box.value is None:
                orphans.remove(box)

    @contextlib.contextmanager
    def step(self, contexts: Sequence["Context"]) -> Iterator["Engine"]:
        """``with engine.step(ctxs):`` step_begin, then step_end when the
        block completes. When the block raises, step_end is still tried and
        its own refusal is dropped, so the original exception propagates."""
        self.step_begin(contexts)
        try:
            yield self
        except BaseException:
            with contextlib.suppress(ActiveKVError):
                self.step_end()
            raise
        self.step_end()

    @_guarded
    def lease_begin(self, layer: int) -> "Lease":
        """Begins the lease of dense layer `layer` of the open step (layers in
        order 0..n_dense_layers-1); enqueues its history copies. Raises
        InvalidArgument, StepState, LeaseOrder, Backend, Quarantined.

        A begun lease cannot be undone: when its Lease object was lost (a
        KeyboardInterrupt or MemoryError raised as lease_begin returned, or
        the object dropped) and the lease is neither retired nor released,
        lease_begin(layer) returns it again instead of calling the library
        (which would refuse the layer), so the step can still be finished;
        mark_consumed(None) then uses the stream wait_ready was given."""
        layer = _uint(layer, "lease_begin: layer")
        h = self._h()
        boxes = [b for b in self._lease_boxes if b.value is not None]
        for box in boxes:
            owner = box.owner
            if box.layer == layer and (owner is None or owner() is None):
                # begun in this step, its Lease lost (cut short as it was
                # made, or dropped): a lease cannot be undone, so it is this
                # layer's lease and is handed out again
                return Lease(self, box)
        box = _Box()
        box.layer, box.stream, box.owner = layer, None, None
        lease = Lease(self, box)  # owns the handle the call writes: _Owning
        # Invariant: a box has an owner only once lease_begin returned its
        # Lease. Cut short before (as the library returned), the Lease may
        # live on in the exception's traceback, in a reference cycle that
        # only a garbage collection frees (Python 3.12): the lease is still
        # lost to the caller, and lease_begin(layer) must hand it out again
        # at once, not after the next collection.
        owner, box.owner = box.owner, None
        boxes.append(box)
        self._lease_boxes = boxes
        _check(lib.akv_lease_begin(h, layer, ctypes.byref(box)), self._handle, "lease_begin")
        box.owner = owner
        return lease

    # -- streams
    @_guarded
    def stream_create(self) -> "Stream":
        """A compute queue of the engine's backend (host: a worker thread;
        CUDA: a non-blocking stream). Destroy it before closing the engine
        (close does so for streams still live, their Stream objects alive or
        not). At most 8 per engine."""
        return self._stream_new(False)

    def _stream_new(self, default: bool) -> "Stream":
        """stream_create; `default`: as the engine's default stream."""
        h = self._h()
        s = Stream(self, _Box())  # owns the handle the call writes: _Owning
        self._streams.append(s._box)
        if default:
            self._default_box, self._default_ref = s._box, weakref.ref(s)
        try:
            _check(lib.akv_stream_create(h, ctypes.byref(s._box)), self._handle,
                   "stream_create")
            interrupt = _take_interrupt()
            if interrupt is not None:  # Ctrl-C in the log callback: no stream for the caller
                raise interrupt
        except BaseException:
            # undone: destroyed (a new stream, no lease uses it); cut short
            # too, close destroys it
            with contextlib.suppress(ActiveKVError):
                self._stream_destroy(s._box)
            raise
        return s

    def _stream_destroy(self, box: _Box) -> None:
        """Destroys the stream in `box` (see _Ending) and forgets the box."""
        if box.value is not None:
            h, eh = box.value, self._handle
            try:
                box.value = None
                st = lib.akv_stream_destroy(eh, h)
                if st != 0:
                    box.value = h
                    _check(st, eh, "stream destroy")
            except ActiveKVError:
                raise  # the refusal: the handle is back
            except BaseException:
                # cut short anywhere here (see _BAD_HANDLE)
                box.value = h if _stream_alive(eh, h, self.backend) else None
                raise
        with contextlib.suppress(ValueError):
            self._streams.remove(box)

    @_guarded
    def default_stream(self) -> Union[int, "Stream"]:
        """The stream used when a call is given stream=None: on CUDA torch's
        current stream (its cudaStream_t as an int; torch's default stream,
        0, as cudaStreamLegacy, 1: the same stream); on the host backend one
        engine-owned Stream, created on first use and destroyed on close."""
        self._h()
        if self.backend == "cuda":
            # the engine's device, not torch's current one (they differ when
            # the caller's current device is another GPU)
            return _torch_stream_handle(
                _torch().cuda.current_stream(int(self._cfg_dict.get("device_ordinal", 0))))
        box = self._default_box
        if box is None or box.value is None:
            return self._stream_new(True)
        # the engine keeps the stream's box, not its Stream (which holds the
        # engine): the same Stream while one is alive, else a new one for it
        s = self._default_ref() if self._default_ref is not None else None
        if s is None:
            s = Stream(self, box)
            self._default_ref = weakref.ref(s)
        return s

    def _stream_arg(self, stream: Any) -> Tuple[Optional[int], Any]:
        """(the akv_stream value, the Stream object or None)."""
        if stream is None:
            stream = self.default_stream()
        if type(stream) is Stream:  # not isinstance: see _ctx_handle
            if stream._engine is not self:
                raise InvalidArgument.make("the stream belongs to another engine")
            return Stream._h(stream), stream
        if hasattr(stream, "cuda_stream"):  # torch.cuda.Stream
            # A CUDA stream is a stream only to the CUDA backend, and only on
            # the engine's device: the host backend names its queues by
            # akv_stream_create handles, and work of one device enqueued on
            # another device's stream fails in the backend (the transport is
            # marked failed) instead of here.
            if self.backend != "cuda":
                raise InvalidArgument.make(
                    f"stream {stream!r}: a CUDA stream given to a {self.backend}-backend engine "
                    "(pass one of its Streams, or None)")
            dev = getattr(stream, "device", None)
            index = getattr(dev, "index", None)
            ordinal = int(self._cfg_dict.get("device_ordinal", 0))
            if index is not None and int(index) != ordinal:
                raise InvalidArgument.make(
                    f"stream {stream!r}: on cuda:{index}, the engine is on cuda:{ordinal}")
            return _torch_stream_handle(stream), None
        # A bool is an int to Python: True would pass as stream 1 (on CUDA
        # cudaStreamLegacy), silently. Raw handles are pointers: 0 .. 2^64 - 1.
        # Read by _index, as every integer argument: int() ran the caller's
        # __int__, and an object whose __class__ said int raised TypeError.
        v = _index(stream)
        if v is not None:
            if 0 <= v < 1 << 64:
                return v, None
            raise InvalidArgument.make(f"stream {v}: a raw handle lies in 0 .. 2^64 - 1")
        raise InvalidArgument.make(f"stream {stream!r}: expected a Stream, a torch.cuda.Stream, "
                                   "an int (cudaStream_t) or None")

    def __repr__(self) -> str:
        # Never raises. In a forked child it says the engine is the parent's (every call
        # there raises BadHandle), as the reprs of what was made from it do; the state is
        # read as a call on the engine (_guarded), as Context's repr reads its own: while
        # another thread is in a call it says nothing of it.
        if "_cfg_dict" not in self.__dict__:
            return "<activekv.Engine not made>"
        forked = _forked_repr(self, "Engine")
        if forked:
            return forked
        try:
            return self._repr()
        except ActiveKVError:
            return "<activekv.Engine>"

    @_guarded
    def _repr(self) -> str:
        if self._handle is None:
            return "<activekv.Engine closed>"
        return f"<activekv.Engine {self.backend} {self._cfg_dict['route']} {self._dtype}>"


class Stream(_NotCopyable):
    """A compute queue from Engine.stream_create (akv_stream). Host backend:
    a worker thread; CUDA: a cudaStream_t (``.handle``)."""

    _handle = _handle_attr()

    def __init__(self, engine: Engine, box: Optional[_Box]) -> None:
        _init_once(self, engine)
        self._engine = engine
        self._box = _as_box(box)  # shared with the engine's list (Engine._streams)

    def _h(self) -> int:
        self._engine._h()
        if self._handle is None:
            raise BadHandle.make("the stream is destroyed")
        return self._handle

    @property
    @_guarded
    def handle(self) -> int:
        """The raw akv_stream (a cudaStream_t on CUDA). A call on the engine
        like any other (Busy from a second thread while one is in flight,
        BadHandle in a forked child): read unguarded, a second thread saw
        the handle a refused destroy clears for its call (BadHandle for a
        live stream), and a child got the parent's stream."""
        return self._h()

    @_guarded
    def synchronize(self) -> None:
        """Blocks until everything enqueued on the stream ran."""
        _check(lib.akv_stream_synchronize(self._engine._h(), self._h()), self._engine._handle,
               "stream synchronize")

    @_guarded
    def destroy(self) -> None:
        """Drains (host backend) and destroys the stream. Destroying twice is
        a no-op."""
        if self._handle is None or self._engine._handle is None:
            self._box.value = None
            return
        self._engine._stream_destroy(self._box)  # the handle goes first: see _Ending

    def __enter__(self) -> "Stream":
        return self

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is None:
            self.destroy()
        else:  # a refusal (InUse: a lease still uses it) must not hide the exception
            with contextlib.suppress(ActiveKVError):
                self.destroy()


class Context(_ClosedOnExit):
    """One request's history (akv_context). Made by Engine.open_context; a
    context manager that closes it. A context dropped without close() is
    closed when its last reference goes, or when the step that holds it
    ends; one dropped while another thread is in a call on its engine is
    closed at the engine's next step end or open_context (its host slot is
    free again for that open)."""

    _handle = _handle_attr()

    def __init__(self, engine: Engine, box: Optional[_Box]) -> None:
        _init_once(self, engine)
        self._engine = engine
        self._box = _as_box(box)

    def _h(self) -> int:
        self._engine._h()
        if self._handle is None:
            raise BadHandle.make("the context is closed")
        return self._handle

    def _discard(self) -> None:
        """Closes the context where it can (a dropped or undone one); one the
        open step holds (InUse), or dropped while another thread is in a call
        on the engine (Busy), is closed when the step ends or at the next
        open_context (Engine._orphans); in a forked child, the engine's
        destroy frees it."""
        box = self.__dict__.get("_box")
        if box is not None and box.value is not None:
            try:
                self.close()
            except (InUse, Busy):
                # held by the open step, or another thread is in a call on the
                # engine: closed at the step's end or the next open_context
                self._engine._orphans.append(box)
            except Exception:  # noqa: BLE001 - a finalizer: left to the engine's destroy
                pass
            except BaseException:
                # cut short (a Ctrl-C landing in the finalizer): a context still
                # open is closed when the step ends, as a refused one (nobody
                # else can close it any more: its host slot was lost until the
                # engine went)
                if box.value is not None and box not in self._engine._orphans:
                    self._engine._orphans.append(box)
                raise

    def __del__(self) -> None:
        self._discard()

    def __hash__(self) -> int:
        return id(self)

    def __eq__(self, other: object) -> bool:
        return self is other

    @property
    def engine(self) -> Engine:
        return self._engine

    @property
    @_guarded
    def id(self) -> int:
        """The context's id as admission decisions name it (unique per
        engine lifetime)."""
        out = ctypes.c_uint32()
        _check(lib.akv_context_id(self._h(), ctypes.byref(out)), self._engine._handle, "id")
        return out.value

    @property
    @_guarded
    def length(self) -> int:
        """Rows held per dense layer (the minimum over the layers after
        uneven append_layer calls)."""
        out = ctypes.c_uint32()
        _check(lib.akv_context_length(self._h(), ctypes.byref(out)), self._engine._handle,
               "length")
        return out.value

    def __len__(self) -> int:
        return self.length

    def _geometry(self) -> Tuple[int, int, int]:
        c = self._engine._cfg_dict
        return c["n_dense_layers"], c["kv_heads"], c["head_dim"]

    @_guarded
    def append(self, k: Any, v: Any) -> None:
        """Appends prefilled rows to every dense layer: k and v of shape
        [n_dense_layers, n_tokens, kv_heads, head_dim], C-contiguous, of the
        engine's dtype (numpy, a CPU torch tensor, or any buffer). A
        synchronous host copy; the arrays are read during the call only.
        Not while the context is in the open step. Raises InvalidArgument,
        Capacity (nothing appended), InUse, BadHandle, Quarantined."""
        h = self._h()
        dt = self._engine._dtype
        ka = _host_rows(k, dt, "k")
        kpin = _pin(ka)
        va = _host_rows(v, dt, "v")  # the caller's code may run here (an __array__)
        _check_pins("append", (("k", kpin),))
        nl, kh, hd = self._geometry()
        if ka.ndim != 4 or ka.shape[0] != nl or ka.shape[2:] != (kh, hd) or va.shape != ka.shape:
            raise InvalidArgument.make(
                f"append: k {ka.shape} and v {va.shape}; expected both "
                f"[{nl}, n_tokens, {kh}, {hd}]")
        n = ka.shape[1]
        if n > 0xFFFFFFFF:
            raise InvalidArgument.make(f"append: {n} tokens")
        kp = (ctypes.c_void_p * nl)(*[ka.ctypes.data + l * ka.strides[0] for l in range(nl)])
        vp = (ctypes.c_void_p * nl)(*[va.ctypes.data + l * va.strides[0] for l in range(nl)])
        h = self._h()  # again, after the caller's code (_STALE)
        _check(lib.akv_context_append(h, n, kp, vp), self._engine._handle, "append")

    @_guarded
    def append_layer(self, layer: int, k: Any, v: Any) -> None:
        """Appends rows to ONE dense layer, after the rows that layer holds:
        k and v of shape [n_tokens, kv_heads, head_dim]. Layers may be filled
        in any order; ``length`` is the minimum over the layers, and a step
        refuses the context (UnevenLayers) until the layers are even. Raises
        InvalidArgument (layer out of range, shape), Capacity (nothing
        appended), InUse, BadHandle, Quarantined."""
        h = self._h()
        dt = self._engine._dtype
        ka = _host_rows(k, dt, "k")
        kpin = _pin(ka)
        va = _host_rows(v, dt, "v")  # the caller's code may run here (an __array__)
        _check_pins("append_layer", (("k", kpin),))
        _, kh, hd = self._geometry()
        if ka.ndim != 3 or ka.shape[1:] != (kh, hd) or va.shape != ka.shape:
            raise InvalidArgument.make(
                f"append_layer: k {ka.shape} and v {va.shape}; expected both "
                f"[n_tokens, {kh}, {hd}]")
        if ka.shape[0] > 0xFFFFFFFF:  # n_tokens is a uint32_t: ctypes would truncate it
            raise InvalidArgument.make(f"append_layer: {ka.shape[0]} tokens")
        layer = _uint(layer, "append_layer: layer")
        _need("akv_context_append_layer")
        h = self._h()  # again, after the caller's code (_STALE)
        _check(lib.akv_context_append_layer(h, layer, ka.shape[0], ka.ctypes.data, va.ctypes.data),
               self._engine._handle, "append_layer")

    @_guarded
    def read(self, layer: int, first: int, n: int) -> Tuple[np.ndarray, np.ndarray]:
        """Copies rows [first, first+n) of one layer out of the authoritative
        host pool: (k, v) numpy arrays [n, kv_heads, head_dim] (bf16 as
        uint16 bit patterns). Not while the context's rows may be written by
        the open step (InUse). Raises InvalidArgument, InUse, BadHandle."""
        h = self._h()
        _, kh, hd = self._geometry()
        layer = _uint(layer, "read: layer")
        first = _uint(first, "read: first")
        n = _uint(n, "read: n")
        max_tokens = self._engine._cfg_dict["max_tokens"]
        if first + n > max_tokens:  # refused before allocating the result
            raise InvalidArgument.make(f"read: rows [{first}, {first + n}) past max_tokens "
                                       f"{max_tokens}")
        npdt = _NP_DTYPE[self._engine._dtype]
        k = np.empty((n, kh, hd), npdt)
        v = np.empty((n, kh, hd), npdt)
        _check(lib.akv_context_read(h, layer, first, n, k.ctypes.data, v.ctypes.data),
               self._engine._handle, "read")
        return k, v

    @_guarded
    def close(self) -> None:
        """Closes the context and releases its host slot and device pages.
        Raises InUse (part of the open step). Closing twice is a no-op."""
        if self._handle is None or self._engine._handle is None:
            self._box.value = None
            return
        h = self._box.value
        try:
            self._box.value = None  # see _Ending
            st = lib.akv_context_close(h)
            if st != 0:
                self._box.value = h
                _check(st, self._engine._handle, "context close")
        except ActiveKVError:
            raise  # the refusal: the handle is back
        except BaseException:  # cut short anywhere here (see _BAD_HANDLE)
            self._box.value = h if _context_alive(h) else None
            raise
        self._engine._contexts.discard(self)

    def __repr__(self) -> str:
        # The state is read as a call on the engine (_guarded): read
        # unguarded, a second thread saw the handle a refused close clears
        # for its call, and called a live context closed. While another
        # thread is in a call (Busy) it says nothing of the state; in a
        # forked child it says the context is the parent's (_forked_repr).
        forked = _forked_repr(self.__dict__.get("_engine"), "Context")
        if forked:
            return forked
        try:
            return self._repr()
        except ActiveKVError:
            return "<activekv.Context>"

    @_guarded
    def _repr(self) -> str:
        if self._handle is None or self._engine._handle is None:
            return "<activekv.Context closed>"
        return f"<activekv.Context id={self.id} length={self.length}>"


_NOT_READY = STATUS_VALUES["AKV_ERR_NOT_READY"]  # 24: try_retire's "not yet"


class Lease(_NotCopyable):
    """One staged layer, begin..retire (akv_lease). Made by
    Engine.lease_begin. After retire the object is dead (BadHandle)."""

    _handle = _handle_attr()

    def __init__(self, engine: Engine, box: Optional[_Box],
                 layer: Optional[int] = None) -> None:
        _init_once(self, engine)
        self._engine = engine
        if type(box) is not _Box:
            box = _as_box(box)
            box.layer, box.stream = layer, None
        self._box = box  # shared with the engine's list (Engine._lease_boxes)
        box.owner = weakref.ref(self)
        self.layer: int = box.layer
        # the stream given to wait_ready, as given (the box keeps its raw
        # value only: a Stream there would hold the engine from the engine)
        self._stream: Any = None

    def _h(self) -> int:
        self._engine._h()
        if self._handle is None:
            raise BadHandle.make(f"the lease of layer {self.layer} is retired")
        return self._handle

    @_guarded
    def wait_ready(self, stream: Any = None) -> "View":
        """Makes `stream` wait (on the device) for the staged history and
        returns the view. stream None: Engine.default_stream(). On the host
        backend this also synchronizes the stream (blocks) so that Python
        code can read and write the view's arrays at once. Raises
        LeaseState, InvalidArgument, Backend, Quarantined."""
        self._h()
        s, sobj = self._engine._stream_arg(stream)
        h = self._h()  # after _stream_arg, which may run the caller's code (_STALE)
        v = L.akv_view()
        # recorded before the call, for mark_consumed(None): the lease keeps
        # the stream from here (a refused wait_ready leaves the lease begun,
        # and the next one records its own)
        self._stream = stream if stream is not None else (sobj if sobj is not None else s)
        box = self._box
        box.stream = s
        # the library fills the lease's own view (Lease.view keeps it); a
        # refused call (a second one) leaves the first's
        fn, ref = lib.akv_lease_wait_ready, ctypes.byref(v)
        prev = (getattr(box, "view", None), getattr(box, "synced", False))
        try:
            box.view, box.synced = v, False
            st = fn(h, s, ref)
            if st != 0:
                box.view, box.synced = prev
                _check(st, self._engine._handle, "wait_ready")
        except ActiveKVError:
            raise  # the refusal: the first's view is back
        except BaseException:  # cut short anywhere here: filled only on success
            if not v.n_contexts:
                box.view, box.synced = prev
            raise
        self._sync_view()
        return View(self, v)

    def _sync_view(self) -> None:
        """Host backend: synchronizes the stream wait_ready was given, once,
        so that Python code can read and write the view's arrays at once."""
        box = self._box
        if self._engine.backend == "host" and not box.synced:
            # the stream as a Stream or as its raw handle (Stream.handle) alike
            _check(lib.akv_stream_synchronize(self._engine._handle, box.stream),
                   self._engine._handle, "wait_ready: stream synchronize")
        box.synced = True

    # What wait_ready, mark_consumed and write_back return is written by the
    # library into the lease's own storage (_Owning): one cut short as it
    # returned (a Ctrl-C) loses nothing, and the library refuses it a second
    # time (LeaseState). These give it again.

    @property
    @_guarded
    def view(self) -> Optional["View"]:
        """The view wait_ready returned, again; None before one succeeded.
        (Host backend: the stream is synchronized first, as wait_ready does,
        if that was cut short.) Valid until the lease retires."""
        self._h()
        v = getattr(self._box, "view", None)
        if v is None or not v.n_contexts:  # filled by the library only on success
            return None
        self._sync_view()
        return View(self, v)

    # view, attention and tail alike: valid until the lease retires (or a
    # quarantine releases it, or its engine closes), BadHandle after that, as
    # every other call on a dead lease; the Receipt of the retire holds both
    # fences. (attention and tail answered a dead lease's fences, view raised.)

    @property
    @_guarded
    def attention(self) -> Optional[Fence]:
        """The fence mark_consumed returned, again; None before one
        succeeded. Valid until the lease retires (BadHandle after; the
        Receipt has it)."""
        self._h()
        f = getattr(self._box, "attn", None)
        return Fence(f.serial) if f is not None and f.serial else None

    @property
    @_guarded
    def tail(self) -> Optional[Fence]:
        """The tail fence the last successful write_back returned, again;
        None before one. Valid until the lease retires (BadHandle after; the
        Receipt has it)."""
        self._h()
        f = getattr(self._box, "tail", None)
        return Fence(f.serial) if f is not None and f.serial else None

    @_guarded
    def mark_consumed(self, stream: Any = None) -> Fence:
        """Records the attention-consumed event on `stream` (None: the stream
        given to wait_ready) and returns its fence."""
        self._h()
        if stream is None:
            # as given to wait_ready; a lease handed out again by lease_begin
            # has that stream's raw value only
            stream = self._stream if self._stream is not None else self._box.stream
        s, _ = self._engine._stream_arg(stream)
        h = self._h()  # after _stream_arg, which may run the caller's code (_STALE)
        f = L.akv_fence()
        # filled by the library on success (Lease.attention); a refused call
        # (a second one) leaves the first's
        fn, ref, box = lib.akv_lease_mark_consumed, ctypes.byref(f), self._box
        prev = getattr(box, "attn", None)
        try:
            box.attn = f
            st = fn(h, s, ref)
            if st != 0:
                box.attn = prev
                _check(st, self._engine._handle, "mark_consumed")
        except ActiveKVError:
            raise  # the refusal: the first's fence is back
        except BaseException:  # cut short anywhere here: filled only on success
            if not f.serial:
                box.attn = prev
            raise
        return Fence(f.serial)

    @_guarded
    def write_back(self, owners: Optional[Sequence[Context]] = None) -> Fence:
        """Enqueues the copy of each owner's new row to its host rows behind
        the attention event (owners None: all of the lease's contexts) and
        returns the tail fence. Raises LeaseState, OwnerMismatch, Backend."""
        self._h()
        tail = L.akv_fence()
        if owners is None:
            arr, n = None, 0
        else:
            if isinstance(owners, (Context, str, bytes)) or not hasattr(owners, "__iter__"):
                raise InvalidArgument.make(f"write_back: owners={owners!r}: expected a sequence "
                                           "of Contexts or None")
            owners = list(owners)  # the caller's code (an iterator's) runs here, not below
            hs = [self._engine._ctx_handle(c, "write_back") for c in owners]
            arr, n = (ctypes.c_void_p * max(1, len(hs)))(*hs), len(hs)
        h = self._h()  # after the caller's code (_STALE)
        fn, ref, box = lib.akv_lease_write_back, ctypes.byref(tail), self._box
        # filled by the library on success (Lease.tail); an earlier write_back's
        # tail stays when this one is refused
        prev = getattr(box, "tail", None)
        try:
            box.tail = tail
            st = fn(h, arr, n, ref)
            if st != 0:
                box.tail = prev
                _check(st, self._engine._handle, "write_back")
        except ActiveKVError:
            raise  # the refusal: the earlier tail is back
        except BaseException:  # cut short anywhere here: filled only on success
            if not tail.serial:
                box.tail = prev
            raise
        return Fence(tail.serial)

    @_guarded
    def seal(self, tail: Fence, attention: Fence) -> None:
        """Seals the lease with its current tail fence and its attention
        fence. Raises LeaseState, FenceMismatch; InvalidArgument for
        anything but two Fence values (of the package's exact class, whose
        serial is an integer in 0..2**64-1)."""
        self._h()
        # The fences are read first, the handle after (_STALE): reading a
        # fence's serial could run the caller's code (a Fence subclass's
        # property, a lying __class__), which could retire the lease and
        # close the engine; the handle read before it then named freed
        # memory. Only exact Fences are taken: their serial is a plain
        # attribute, read by _u64 without any of the caller's code.
        if type(tail) is not Fence or type(attention) is not Fence:
            raise InvalidArgument.make(f"seal takes two Fence values, got {type(tail).__name__} "
                                       f"and {type(attention).__name__}")
        ct = L.akv_fence(_u64(_fence_serial(tail), "seal: tail"))
        ca = L.akv_fence(_u64(_fence_serial(attention), "seal: attention"))
        h = self._h()  # after the fences (_STALE)
        _check(lib.akv_lease_seal(h, ct, ca), self._engine._handle, "seal")

    @_guarded
    def retire(self) -> Receipt:
        """Waits (blocking) on every consumer event and copy ticket, then
        releases the layer; the lease is dead afterwards. Raises LeaseState,
        Backend (nothing released), Quarantined."""
        st, r = self._retire_with(lib.akv_lease_retire, self._h())
        if st != 0:
            _check(st, self._engine._handle, "retire")
        return _receipt(r)

    @_guarded
    def try_retire(self) -> Optional[Receipt]:
        """Non-blocking retire (akv_lease_try_retire): when every fence of
        the sealed lease has passed, retires it exactly as retire() does and
        returns the Receipt (the lease is dead afterwards); while one is
        pending returns None and nothing changed (AKV_ERR_NOT_READY is never
        raised): call it again, or retire() to block. Queries events, never
        waits. Raises LeaseState (not sealed), Backend (a query failed),
        Quarantined; NotSupported with a library that lacks the call."""
        h = self._h()
        _need("akv_lease_try_retire")
        st, r = self._retire_with(lib.akv_lease_try_retire, h)
        if st == _NOT_READY:
            return None
        if st != 0:
            _check(st, self._engine._handle, "try_retire")
        return _receipt(r)

    def _retire_with(self, fn, h):
        """(status, receipt) of fn (akv_lease_retire or akv_lease_try_retire)
        on handle h. The lease's handle is cleared for the call (see _Ending)
        and put back unless the lease was retired: on a refusal, and when the
        call is cut short as it returns, in which case the receipt says which
        it was (the library fills it only when it retired the lease, step >=
        1; for try_retire "not ready" is a common answer)."""
        r = L.akv_receipt()
        # built first: nothing that can raise between clearing and the call
        ref = ctypes.byref(r)
        try:
            self._box.value = None  # see _Ending
            st = fn(h, ref)
            if st != 0:
                self._box.value = h
        except BaseException:
            self._box.value = h if r.step == 0 else None
            raise
        return st, r


_EVERY_CONTEXT = object()  # View._check_live: every context of the view


class View:
    """What attention sees of one staged layer (akv_view); valid until the
    lease retires. Row t of context i: K at base + i*context_stride +
    t*row_stride, V at that address + v_offset. Rows [0, len[i]) are the
    history; the caller writes the step's new row at index len[i].

    keys(i)/values(i) and kv_tensors() are zero-copy views of the staging
    buffer: numpy on the host backend, torch on CUDA (bf16 is uint16 on
    numpy, torch.bfloat16 on torch; FP8 is uint8 codes on numpy,
    torch.float8_e4m3fn / torch.float8_e5m2 on a torch that has them, uint8
    otherwise). Writing through them writes the staged
    rows. On the paged route, rows of retained pages are not in the staging
    buffer: those calls raise NotSupported for a context with such pages
    (read page_map / use the C attention instead).

    Read-only: keys/values/kv_tensors build arrays from the view's base,
    lengths and strides, so a changed one would hand out arrays over memory
    that is not the engine's. Setting an attribute raises AttributeError;
    ``len`` gives a new list each time and ``page_map`` is a read-only array
    (the package uses its own copies)."""

    def __init__(self, lease: Lease, v: L.akv_view) -> None:
        # Invariant: a View describes its lease's own akv_view, the one the
        # library filled (Lease.wait_ready). The class is public: one built
        # from any other struct (a base of 0x1000) handed out arrays over
        # memory that is not the engine's, and reading them crashed.
        # (the type by type(), not isinstance: see Engine._ctx_handle)
        if type(lease) is not Lease or v is not getattr(lease._box, "view", None):
            raise InvalidArgument.make("View: a view is made by Lease.wait_ready (or Lease.view) "
                                       "from the view the library filled")
        page_map: Optional[np.ndarray] = None
        if v.page_map_host:
            n = v.n_contexts * v.page_map_stride
            page_map = np.ctypeslib.as_array(v.page_map_host, shape=(n,)).copy().reshape(
                v.n_contexts, v.page_map_stride)
        shown = None
        if page_map is not None:
            shown = page_map.copy()
            shown.flags.writeable = False
        fields = dict(
            _lease=lease, _c=v, _page_map=page_map,
            step=v.step, layer=v.layer, n_contexts=v.n_contexts, kv_heads=v.kv_heads,
            head_dim=v.head_dim, dtype=_inv(DTYPES)[v.dtype], base=v.base or 0,
            row_stride=v.row_stride, context_stride=v.context_stride, v_offset=v.v_offset,
            _len=tuple(v.len[i] for i in range(v.n_contexts)), page_tokens=v.page_tokens,
            page_map_stride=v.page_map_stride, pages=v.pages or 0, page_stride=v.page_stride,
            page_map=shown)
        for name, value in fields.items():
            object.__setattr__(self, name, value)

    # A View names its lease (a C handle): deepcopy and pickle refuse it as the
    # lease's own do, naming the View (they raised the Lease's TypeError from
    # inside the copy). copy.copy is allowed: the same lease's view, dead with it.
    def __copy__(self) -> "View":
        twin = object.__new__(type(self))
        twin.__dict__.update(self.__dict__)
        return twin

    def __deepcopy__(self, memo: Any) -> Any:
        raise TypeError(f"an activekv.{type(self).__name__} cannot be deep-copied or pickled "
                        "(it describes its lease's staging memory; copy.copy gives the same "
                        "view, np.array(view.keys(i)) a copy of the rows)")

    def __reduce_ex__(self, protocol: Any) -> Any:
        self.__deepcopy__(None)

    @property
    def len(self) -> List[int]:
        """Rows staged per context (the history; the step's row goes at
        index len[i]); a new list each time."""
        return list(self._len)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"View.{name} is read-only (the view describes the engine's "
                             "staging memory)")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"View.{name} is read-only")

    @property
    def _cuda(self) -> bool:
        return self._lease._engine.backend == "cuda"

    @property
    def _engine(self) -> Engine:
        """The lease's engine: keys/values/kv_tensors are calls on it
        (_guarded). Invariant: an array is made over the staging buffer only
        by the one call in flight on the engine, so no other thread can
        retire the lease and close the engine (freeing the buffer) between
        the check that the lease is live and the array being counted
        (Engine.live_arrays, which defers the free)."""
        return self._lease._engine

    def _check_live(self, i: Any = _EVERY_CONTEXT) -> Optional[int]:
        """Raises unless the lease is live and context `i` (every one by
        default) is in the staging buffer; returns `i` as the int checked,
        the one the caller must use (an array's offset is computed from it:
        an index read again could name memory outside the buffer)."""
        every = i is _EVERY_CONTEXT  # kv_tensors; keys(None) is refused like keys(1.5)
        index = None if every else _index(i)
        self._lease._h()  # after reading i: nothing between this and the array
        ctxs = range(self.n_contexts) if every else [index]
        if not every and (index is None or not 0 <= index < self.n_contexts):
            raise InvalidArgument.make(f"context {i!r} of a view of {self.n_contexts}")
        if self._page_map is not None:
            for c in ctxs:
                full = (self._len[c] // self.page_tokens) if self.page_tokens else 0
                row = self._page_map[c, : min(full, self.page_map_stride)]
                if (row != L.AKV_PAGE_STAGED).any():
                    raise NotSupported.make(
                        f"context {c}: retained pages are read in place (paged route); the "
                        "staging buffer does not hold them")
        return index

    def _array(self, offset: int, shape: Tuple[int, ...], strides: Tuple[int, ...]):
        # the lease checked again once the export is counted (see _counted_export)
        return _export_array(self._lease._engine, self.base + offset, shape, strides,
                             self.dtype, self._cuda, self._lease._h)

    def _rows(self, i: int, v: bool):
        i = self._check_live(i)
        isz = _ITEMSIZE[self.dtype]
        off = i * self.context_stride + (self.v_offset if v else 0)
        return self._array(off, (self._len[i] + 1, self.kv_heads, self.head_dim),
                           (self.row_stride, self.head_dim * isz, isz))

    @_guarded
    def keys(self, i: int):
        """Context i's K rows [len[i]+1, kv_heads, head_dim], zero-copy (the
        last row is the step's new row, for the caller to write)."""
        return self._rows(i, False)

    @_guarded
    def values(self, i: int):
        """Context i's V rows [len[i]+1, kv_heads, head_dim], zero-copy."""
        return self._rows(i, True)

    @_guarded
    def kv_tensors(self):
        """(K, V) torch tensors [n_contexts, kv_heads, max_len+1, head_dim]:
        strided zero-copy views over the staging buffer (CUDA, or CPU torch
        on the host backend), the layout SDPA takes. Rows past len[i]+1 of a
        shorter context are stale: mask them."""
        self._check_live()
        torch = _torch()
        isz = _ITEMSIZE[self.dtype]
        rows = max(self._len) + 1
        shape = (self.n_contexts, self.kv_heads, rows, self.head_dim)
        strides = (self.context_stride, self.head_dim * isz, self.row_stride, isz)
        out = []
        for off in (0, self.v_offset):
            a = self._array(off, shape, strides)
            if not self._cuda:
                if self.dtype == "bf16":  # uint16 bits -> int16 (torch has no uint16 view)
                    a = a.view(np.int16)
                a = _as_torch_type(torch, torch.from_numpy(a), self.dtype)
            out.append(a)
        return out[0], out[1]


def _as_torch_type(torch: Any, t: Any, dtype: str) -> Any:
    """A raw-bits tensor (int16 for bf16, uint8 for FP8) as torch's own type
    of the dtype, without a copy; FP8 stays uint8 on a torch without it."""
    if dtype in ("bf16", "fp8_e4m3", "fp8_e5m2"):
        want = _torch_dtype(torch, dtype)
        if want is not None:
            return t.view(want)
    return t


def version() -> str:
    """The loaded library's version string."""
    return lib.akv_version_string().decode()
