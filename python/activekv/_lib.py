"""ctypes mirror of include/akv.h: the structs, the enums and every prototype.

The mirrors must match the C layout exactly; python/tests/test_abi.py compiles
a C program that prints sizeof/offsetof of every public struct and compares
them with these classes. Change both together, and only as akv.h's ABI promise
allows (structs grow at their end, enums are appended).

The shared library is found next to this file (the wheel installs it there),
or where ACTIVEKV_LIBRARY points (a build tree's libactivekv.so, for
development).
"""
from __future__ import annotations

import ctypes
import os
from ctypes import (
    POINTER,
    Structure,
    c_char,
    c_char_p,
    c_int,
    c_int32,
    c_size_t,
    c_uint,
    c_uint32,
    c_uint64,
    c_void_p,
)

__all__ = ["lib", "library_path", "include_dir", "has_symbol", "STRUCTS"]

# enum sizes: every akv enum is a C int
c_enum = c_int

AKV_OP_KIND_COUNT = 7
AKV_ADM_RULE_COUNT = 9
AKV_PAGE_STAGED = 0xFFFFFFFF
AKV_TARGET_FAIR_SHARE = 0xFFFFFFFF
AKV_CONFIG_VERSION = 1

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
    "akv_context_append_layer": (c_enum, [akv_context_p, c_uint32, c_uint32, c_void_p, c_void_p]),
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
}
# Entry points a library may or may not have (added after 0.2.0); declared
# when present, has_symbol() says which.
_OPTIONAL = {
    "akv_lease_try_retire": (c_enum, [akv_lease_p, P(akv_receipt)]),
}

_HERE = os.path.dirname(os.path.abspath(__file__))


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


def _load() -> ctypes.CDLL:
    path = library_path()
    if not os.path.exists(path):
        raise ImportError(
            f"activekv: {path} not found; install the package with `pip install .` from the "
            "checkout (it builds the library), or point ACTIVEKV_LIBRARY at a libactivekv.so"
        )
    dll = ctypes.CDLL(path)
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

