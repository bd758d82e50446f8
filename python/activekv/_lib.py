"""ctypes mirror of include/akv.h and include/akv_attention.h: the structs,
the enums and every prototype.

The mirrors must match the C layout exactly; python/tests/test_abi.py compiles
a C program that prints sizeof/offsetof of every public struct (and the
constants below) and compares them with these classes. Change both together,
and only as akv.h's ABI promise allows (structs grow at their end, enums are
appended).

The shared library is found next to this file (the wheel installs it there),
or where ACTIVEKV_LIBRARY points (a build tree's libactivekv.so, for
development).
"""
from __future__ import annotations

import ctypes
import importlib.util
import os
import sys
from ctypes import (
    POINTER,
    Structure,
    c_char,
    c_char_p,
    c_float,
    c_int,
    c_int32,
    c_size_t,
    c_uint,
    c_uint32,
    c_uint64,
    c_void_p,
)

__all__ = ["lib", "library_path", "include_dir", "has_symbol", "out_struct", "STRUCTS",
           "CONSTANTS"]

# enum sizes: every akv enum is a C int
c_enum = c_int

AKV_OP_KIND_COUNT = 7
AKV_ADM_RULE_COUNT = 13
AKV_PAGE_STAGED = 0xFFFFFFFF
AKV_TARGET_FAIR_SHARE = 0xFFFFFFFF
AKV_CONFIG_VERSION = 1
AKV_ATTENTION_MAX_HEAD_DIM = 256
AKV_ATTENTION_MAX_SCALE_HEADS = 256
AKV_ATTENTION_MAX_CHUNK_TOKENS = 0xFF000000

# Numeric macros of the headers mirrored here, by C name: the ABI test
# compares each with the header's value.
CONSTANTS = {
    "AKV_OP_KIND_COUNT": AKV_OP_KIND_COUNT,
    "AKV_ADM_RULE_COUNT": AKV_ADM_RULE_COUNT,
    "AKV_PAGE_STAGED": AKV_PAGE_STAGED,
    "AKV_TARGET_FAIR_SHARE": AKV_TARGET_FAIR_SHARE,
    "AKV_CONFIG_VERSION": AKV_CONFIG_VERSION,
    "AKV_ATTENTION_MAX_HEAD_DIM": AKV_ATTENTION_MAX_HEAD_DIM,
    "AKV_ATTENTION_MAX_SCALE_HEADS": AKV_ATTENTION_MAX_SCALE_HEADS,
    "AKV_ATTENTION_MAX_CHUNK_TOKENS": AKV_ATTENTION_MAX_CHUNK_TOKENS,
}

# The library version whose structs these mirrors are (akv.h: the structs the
# library fills keep their size within a soname, libactivekv.so.0.MINOR
# before 1.0). A newer library may fill larger ones, so it is refused at load.
MIRRORED_VERSION = (0, 3)

LOG_FN = ctypes.CFUNCTYPE(None, c_void_p, c_enum, c_char_p)
HOST_FN = ctypes.CFUNCTYPE(None, c_void_p)

akv_engine_p = c_void_p
akv_context_p = c_void_p
akv_lease_p = c_void_p
akv_stream = c_void_p


class akv_fence(Structure):
    _fields_ = [("serial", c_uint64)]


class akv_engine_config(Structure):
    _fields_ = [
        ("struct_size", c_uint32),
        ("version", c_uint32),
        ("backend", c_enum),
        ("device_ordinal", c_int),
        ("n_dense_layers", c_uint32),
        ("kv_heads", c_uint32),
        ("head_dim", c_uint32),
        ("dtype", c_enum),
        ("max_tokens", c_uint32),
        ("page_tokens", c_uint32),
        ("host_pool_gib", c_uint32),
        ("device_pool_gib", c_uint32),
        ("max_contexts", c_uint32),
        ("fit_mode", c_enum),
        ("route", c_enum),
        ("log_fn", LOG_FN),
        ("log_user", c_void_p),
        ("log_level", c_enum),
        ("host_delay_seed", c_uint64),
        ("host_delay_max_us", c_uint32),
        ("fault_fail_nth", c_uint32),
        ("fault_kind", c_int32),
        ("poison_holes", c_uint32),
        ("headroom_gib", c_uint32),
        ("headroom_reserve_gib", c_uint32),
        ("host_fake_free_bytes", c_uint64),
        ("headroom_chunk_pages", c_uint32),
    ]


class akv_fit_report(Structure):
    _fields_ = [
        ("row_bytes", c_uint64),
        ("history_bytes", c_uint64),
        ("host_pool_bytes", c_uint64),
        ("fits", c_uint64),
        ("effective_concurrency", c_uint32),
        ("ok", c_uint32),
        ("host_pool_gib_needed", c_uint32),
        ("page_bytes", c_uint64),
        ("device_pages", c_uint64),
        ("line", c_char * 512),
    ]


class akv_engine_info(Structure):
    _fields_ = [
        ("backend", c_enum),
        ("route", c_enum),
        ("effective_concurrency", c_uint32),
        ("row_bytes", c_uint64),
        ("history_bytes", c_uint64),
        ("page_bytes", c_uint64),
        ("device_pages", c_uint32),
        ("staging_bytes", c_uint64),
        ("device_bytes_allocated", c_uint64),
        ("device_peak_bytes", c_uint64),
        ("bytes_h2d", c_uint64),
        ("bytes_d2h", c_uint64),
        ("bytes_d2d", c_uint64),
        ("copies_h2d", c_uint64),
        ("copies_d2h", c_uint64),
        ("copies_d2d", c_uint64),
        ("steps", c_uint64),
        ("leases_retired", c_uint64),
        ("backend_ops", c_uint64 * AKV_OP_KIND_COUNT),
        ("transport_failed", c_int),
        ("quarantined", c_int),
        ("bytes_in_place", c_uint64),
        ("headroom_pages", c_uint32),
        ("headroom_bytes", c_uint64),
    ]


class akv_quarantine_report(Structure):
    _fields_ = [
        ("h2d_ok", c_int),
        ("d2h_ok", c_int),
        ("d2d_ok", c_int),
        ("device_ok", c_int),
        ("leases_released", c_uint32),
        ("tickets_released", c_uint32),
        ("retained_leases", c_uint32),
        ("uncertain", c_char * 128),
    ]


class akv_context_config(Structure):
    _fields_ = [
        ("struct_size", c_uint32),
        ("version", c_uint32),
        ("target_pages", c_uint32),
        ("burst_pages", c_uint32),
    ]


class akv_view(Structure):
    _fields_ = [
        ("step", c_uint64),
        ("layer", c_uint32),
        ("n_contexts", c_uint32),
        ("kv_heads", c_uint32),
        ("head_dim", c_uint32),
        ("dtype", c_enum),
        ("row_stride", c_uint64),
        ("base", c_void_p),
        ("context_stride", c_uint64),
        ("v_offset", c_uint64),
        ("len", POINTER(c_uint32)),
        ("contexts", POINTER(c_void_p)),
        ("page_tokens", c_uint32),
        ("page_map_stride", c_uint32),
        ("page_map", POINTER(c_uint32)),
        ("page_map_host", POINTER(c_uint32)),
        ("pages", c_void_p),
        ("page_stride", c_uint64),
    ]


class akv_receipt(Structure):
    _fields_ = [
        ("step", c_uint64),
        ("layer", c_uint32),
        ("tickets", c_uint32),
        ("readers", c_uint32),
        ("bytes_h2d", c_uint64),
        ("bytes_d2d", c_uint64),
        ("bytes_d2h", c_uint64),
        ("attention", akv_fence),
        ("tail", akv_fence),
        ("bytes_in_place", c_uint64),
    ]


class akv_adm_decision(Structure):
    _fields_ = [
        ("step", c_uint64),
        ("context", c_uint32),
        ("rule", c_enum),
        ("victim", c_uint32),
        ("pages", c_uint32),
    ]


class akv_headroom_info(Structure):
    _fields_ = [
        ("enabled", c_uint32),
        ("profile_free_bytes", c_uint64),
        ("cap_bytes", c_uint64),
        ("reserve_bytes", c_uint64),
        ("max_pages", c_uint32),
        ("chunk_pages", c_uint32),
        ("pages", c_uint32),
        ("pages_held", c_uint32),
        ("pages_pending", c_uint32),
        ("bytes", c_uint64),
        ("bytes_released", c_uint64),
        ("releases", c_uint64),
        ("takes", c_uint64),
    ]


# ---- akv_attention.h: the reference attention's arguments


class akv_attention_args(Structure):
    _fields_ = [
        ("dtype", c_enum),
        ("n_contexts", c_uint32),
        ("n_heads", c_uint32),
        ("kv_heads", c_uint32),
        ("head_dim", c_uint32),
        ("chunk_tokens", c_uint32),
        ("scale", c_float),
        ("q", c_void_p),
        ("k_base", c_void_p),
        ("v_base", c_void_p),
        ("context_stride", c_uint64),
        ("row_bytes", c_uint64),
        ("len", POINTER(c_uint32)),
        ("out", POINTER(c_float)),
        ("workspace", c_void_p),
        ("workspace_bytes", c_size_t),
        ("page_map", POINTER(c_uint32)),
        ("page_map_stride", c_uint32),
        ("k_pages", c_void_p),
        ("v_pages", c_void_p),
        ("page_stride", c_uint64),
        ("k_scale", POINTER(c_float)),
        ("v_scale", POINTER(c_float)),
    ]


class akv_page_table(Structure):
    _fields_ = [
        ("batch", c_uint32),
        ("page_tokens", c_uint32),
        ("max_pages", c_uint32),
        ("indptr", POINTER(c_uint32)),
        ("indices", POINTER(c_uint32)),
        ("last_page_len", POINTER(c_uint32)),
        ("k_pages", c_void_p),
        ("v_pages", c_void_p),
        ("page_stride", c_uint64),
        ("row_bytes", c_uint64),
    ]


class akv_attention_paged_args(Structure):
    _fields_ = [
        ("dtype", c_enum),
        ("n_heads", c_uint32),
        ("kv_heads", c_uint32),
        ("head_dim", c_uint32),
        ("scale", c_float),
        ("q", c_void_p),
        ("out", POINTER(c_float)),
        ("workspace", c_void_p),
        ("workspace_bytes", c_size_t),
        ("k_scale", POINTER(c_float)),
        ("v_scale", POINTER(c_float)),
    ]


# akv_attention_fn: int (*)(void *user, const akv_view *view, akv_stream stream)
ATTENTION_FN = ctypes.CFUNCTYPE(c_int, c_void_p, POINTER(akv_view), c_void_p)

# Every public struct, by its C name: the ABI test walks this table.
STRUCTS = {
    "akv_fence": akv_fence,
    "akv_engine_config": akv_engine_config,
    "akv_fit_report": akv_fit_report,
    "akv_engine_info": akv_engine_info,
    "akv_quarantine_report": akv_quarantine_report,
    "akv_context_config": akv_context_config,
    "akv_view": akv_view,
    "akv_receipt": akv_receipt,
    "akv_adm_decision": akv_adm_decision,
    "akv_headroom_info": akv_headroom_info,
    "akv_attention_args": akv_attention_args,
    "akv_page_table": akv_page_table,
    "akv_attention_paged_args": akv_attention_paged_args,
}

P = POINTER
_PROTOTYPES = {
    "akv_version_number": (c_uint, []),
    "akv_version_string": (c_char_p, []),
    "akv_status_string": (c_char_p, [c_enum]),
    "akv_engine_config_init": (c_enum, [P(akv_engine_config)]),
    "akv_fit": (c_enum, [P(akv_engine_config), P(akv_fit_report)]),
    "akv_engine_create": (c_enum, [P(akv_engine_config), P(akv_engine_p)]),
    "akv_engine_destroy": (c_enum, [akv_engine_p]),
    "akv_engine_last_error": (c_char_p, [akv_engine_p]),
    "akv_engine_info_get": (c_enum, [akv_engine_p, P(akv_engine_info)]),
    "akv_engine_quarantine": (c_enum, [akv_engine_p, P(akv_quarantine_report)]),
    "akv_stream_create": (c_enum, [akv_engine_p, P(akv_stream)]),
    "akv_stream_destroy": (c_enum, [akv_engine_p, akv_stream]),
    "akv_stream_synchronize": (c_enum, [akv_engine_p, akv_stream]),
    "akv_stream_launch_host": (c_enum, [akv_engine_p, akv_stream, HOST_FN, c_void_p]),
    "akv_context_open": (c_enum, [akv_engine_p, P(akv_context_config), P(akv_context_p)]),
    "akv_context_close": (c_enum, [akv_context_p]),
    "akv_context_append": (c_enum, [akv_context_p, c_uint32, P(c_void_p), P(c_void_p)]),
    "akv_context_read": (c_enum, [akv_context_p, c_uint32, c_uint32, c_uint32, c_void_p, c_void_p]),
    "akv_context_length": (c_enum, [akv_context_p, P(c_uint32)]),
    "akv_context_id": (c_enum, [akv_context_p, P(c_uint32)]),
    "akv_step_begin": (c_enum, [akv_engine_p, P(akv_context_p), c_uint32]),
    "akv_step_end": (c_enum, [akv_engine_p]),
    "akv_lease_begin": (c_enum, [akv_engine_p, c_uint32, P(akv_lease_p)]),
    "akv_lease_wait_ready": (c_enum, [akv_lease_p, akv_stream, P(akv_view)]),
    "akv_lease_mark_consumed": (c_enum, [akv_lease_p, akv_stream, P(akv_fence)]),
    "akv_lease_attend": (c_enum, [akv_lease_p, akv_stream, ATTENTION_FN, c_void_p, P(akv_fence)]),
    "akv_lease_write_back": (c_enum, [akv_lease_p, P(akv_context_p), c_uint32, P(akv_fence)]),
    "akv_lease_seal": (c_enum, [akv_lease_p, akv_fence, akv_fence]),
    "akv_lease_retire": (c_enum, [akv_lease_p, P(akv_receipt)]),
    "akv_adm_rule_string": (c_char_p, [c_enum]),
    "akv_admission_counters": (c_enum, [akv_engine_p, P(c_uint64), c_size_t]),
    "akv_admission_log": (c_enum, [akv_engine_p, P(akv_adm_decision), c_size_t, P(c_size_t)]),
    "akv_admission_explain": (c_enum, [akv_engine_p, akv_context_p, c_char_p, c_size_t]),
    # akv_attention.h
    "akv_attention_args_from_view": (c_enum, [P(akv_view), P(akv_attention_args)]),
    "akv_attention_workspace_bytes": (
        c_enum, [c_uint32, c_uint32, c_uint32, c_uint32, c_uint32, P(c_size_t)]),
    "akv_attention_ref_bf16": (c_enum, [P(akv_attention_args)]),
    "akv_attention_paged_ref_bf16": (c_enum, [P(akv_attention_paged_args), akv_page_table]),
}
# Entry points added after 0.2.0, which a library from ACTIVEKV_LIBRARY may
# lack: declared when present, has_symbol() says which, and the methods that
# need one raise NotSupported without it. (The library the package is built
# with has every one; test_abi.py checks that.)
_OPTIONAL = {
    "akv_context_append_layer": (c_enum, [akv_context_p, c_uint32, c_uint32, c_void_p, c_void_p]),
    "akv_lease_try_retire": (c_enum, [akv_lease_p, P(akv_receipt)]),
    "akv_headroom_get": (c_enum, [akv_engine_p, P(akv_headroom_info)]),
    "akv_headroom_release": (c_enum, [akv_engine_p, c_uint64, P(c_uint64), P(c_uint64)]),
    "akv_headroom_take": (c_enum, [akv_engine_p, c_uint64, P(c_uint64)]),
}

_HERE = os.path.dirname(os.path.abspath(__file__))

# Spare bytes behind every struct the library fills (out_struct): akv.h lets
# structs grow at their end, so a library newer than these mirrors writes its
# new fields there instead of past the Python object.
_OUT_SLACK = 1024


def out_struct(cls: type) -> Structure:
    """A zeroed instance of `cls` backed by a buffer with room to spare, for
    the library to fill (info, headroom, fit, quarantine reports, config
    init)."""
    return cls.from_buffer(bytearray(ctypes.sizeof(cls) + _OUT_SLACK))


def library_path() -> str:
    """The libactivekv.so this package loads: $ACTIVEKV_LIBRARY, else the one
    installed next to this file."""
    env = os.environ.get("ACTIVEKV_LIBRARY")
    if env:
        return env
    return os.path.join(_HERE, "libactivekv.so")


def include_dir() -> str | None:
    """The directory of akv.h installed with the package (None if absent)."""
    d = os.path.join(_HERE, "include")
    return d if os.path.isfile(os.path.join(d, "akv.h")) else None


# Shared libraries a CUDA build of libactivekv loads that torch also ships
# (its nvidia-* wheels), under the same sonames: the CUDA runtime, linked,
# and NCCL, opened at run time by a group (dlopen).
_SHARED_WITH_TORCH = (b"libcudart.so", b"libnccl.so")


def _torch_first(path: str) -> None:
    """Imports torch before libactivekv when the library loads a CUDA
    runtime or NCCL and torch is installed but not imported yet.

    The dynamic loader binds a soname once per process: whichever of
    libactivekv and torch loads first decides which libcudart.so.13 /
    libnccl.so.2 both use. torch needs its own (often newer) copies and
    fails to import after an older one (``undefined symbol:
    ncclCommResume``); the library works with newer ones (both keep their
    ABI within a major version). A host-only build loads neither and leaves
    torch alone."""
    if "torch" in sys.modules:
        return
    try:
        with open(path, "rb") as f:
            image = f.read()
    except OSError:
        return
    if not any(name in image for name in _SHARED_WITH_TORCH):
        return
    if importlib.util.find_spec("torch") is None:
        return
    try:
        import torch  # noqa: F401,PLC0415 - for the load order only
    except Exception:  # noqa: BLE001 - a torch that cannot import is not ours to report
        pass


def check_version(number: int, path: str) -> None:
    """ImportError unless the library's AKV_VERSION_NUMBER (major * 10000 +
    minor * 100 + patch) is of an ABI these mirrors cover: the same or an
    older major.minor. A newer library fills structs (receipts, views, the
    admission log's entries) that may have grown past the mirrors, and would
    write past the Python objects."""
    have = (number // 10000, number // 100 % 100)
    if have > MIRRORED_VERSION:
        raise ImportError(
            "activekv: %s is libactivekv %d.%d, newer than the %d.%d this package mirrors; "
            "install the activekv package of that library" % ((path,) + have + MIRRORED_VERSION))


def _load() -> ctypes.CDLL:
    path = library_path()
    if not os.path.exists(path):
        raise ImportError(
            f"activekv: {path} not found; install the package with `pip install .` from the "
            "checkout (it builds the library), or point ACTIVEKV_LIBRARY at a libactivekv.so"
        )
    _torch_first(path)
    dll = ctypes.CDLL(path)
    dll.akv_version_number.restype = ctypes.c_uint
    dll.akv_version_number.argtypes = []
    check_version(int(dll.akv_version_number()), path)
    for name, (res, args) in _PROTOTYPES.items():
        fn = getattr(dll, name)
        fn.restype = res
        fn.argtypes = args
    for name, (res, args) in _OPTIONAL.items():
        if hasattr(dll, name):
            fn = getattr(dll, name)
            fn.restype = res
            fn.argtypes = args
    return dll


lib = _load()


def has_symbol(name: str) -> bool:
    """True when the loaded library exports `name`."""
    return hasattr(lib, name)

