"""Exceptions: one class per akv_status, grouped in a small hierarchy.

Every failure of a C call raises the class of its status, carrying the status
value, its C name (``"AKV_ERR_CAPACITY"``) and the engine's message
(akv_engine_last_error). Arguments the package refuses before reaching C
raise the class of the status the C call would have returned
(InvalidArgument, BadHandle, ...), so one ``except`` covers both.

    ActiveKVError
      UsageError      the call is not allowed now or with these arguments
        InvalidArgument (also a ValueError), BadHandle, StepState, LeaseOrder,
        LeaseState, OwnerMismatch, FenceMismatch, InUse, Busy, UnevenLayers,
        Disagree, NotReady
      ConfigError     the configuration or this build/machine
        Config, NoFit, NotSupported
      CapacityError   refused for room: queue, retry, or resize
        RefusedQueue, AdmissionRefused, OutOfMemory, Capacity
      TransportError  the transport failed: quarantine and destroy
        Backend, Quarantined, UncertainFence, Timeout, Comm

NotReady is not a failure: Lease.try_retire returns None for it and never
raises it; the class exists so that every status has one.

A status this package does not know (a newer library) raises ActiveKVError
itself, named ``AKV_STATUS_<n>``.
"""
from __future__ import annotations

from typing import Dict, Optional, Type

__all__ = [
    "ActiveKVError",
    "UsageError",
    "ConfigError",
    "CapacityError",
    "TransportError",
    "InvalidArgument",
    "BadHandle",
    "Config",
    "NoFit",
    "RefusedQueue",
    "AdmissionRefused",
    "OutOfMemory",
    "Capacity",
    "StepState",
    "LeaseOrder",
    "LeaseState",
    "OwnerMismatch",
    "FenceMismatch",
    "Backend",
    "Quarantined",
    "Busy",
    "UncertainFence",
    "NotSupported",
    "InUse",
    "UnevenLayers",
    "Timeout",
    "Comm",
    "Disagree",
    "NotReady",
    "STATUS_NAMES",
    "status_name",
    "error_for",
]

# akv_status, value -> C name, exactly as include/akv.h declares it
# (python/tests/test_abi.py checks this table against the header).
STATUS_NAMES: Dict[int, str] = {
    0: "AKV_OK",
    1: "AKV_ERR_INVALID_ARGUMENT",
    2: "AKV_ERR_BAD_HANDLE",
    3: "AKV_ERR_CONFIG",
    4: "AKV_ERR_NO_FIT",
    5: "AKV_ERR_REFUSED_QUEUE",
    6: "AKV_ERR_ADMISSION_REFUSED",
    7: "AKV_ERR_OUT_OF_MEMORY",
    8: "AKV_ERR_CAPACITY",
    9: "AKV_ERR_STEP_STATE",
    10: "AKV_ERR_LEASE_ORDER",
    11: "AKV_ERR_LEASE_STATE",
    12: "AKV_ERR_OWNER_MISMATCH",
    13: "AKV_ERR_FENCE_MISMATCH",
    14: "AKV_ERR_BACKEND",
    15: "AKV_ERR_QUARANTINED",
    16: "AKV_ERR_BUSY",
    17: "AKV_ERR_UNCERTAIN_FENCE",
    18: "AKV_ERR_NOT_SUPPORTED",
    19: "AKV_ERR_IN_USE",
    20: "AKV_ERR_UNEVEN_LAYERS",
    21: "AKV_ERR_TIMEOUT",
    22: "AKV_ERR_COMM",
    23: "AKV_ERR_DISAGREE",
    24: "AKV_ERR_NOT_READY",
}
STATUS_VALUES: Dict[str, int] = {v: k for k, v in STATUS_NAMES.items()}


def status_name(status: int) -> str:
    """The C name of a status value; ``AKV_STATUS_<n>`` for one this package
    does not know."""
    return STATUS_NAMES.get(status, f"AKV_STATUS_{status}")


class ActiveKVError(Exception):
    """A libactivekv call failed.

    Attributes: ``status`` (the akv_status value), ``name`` (its C name) and
    ``message`` (the engine's last error in words, or the package's own
    explanation when it refused the call before reaching C).
    """

    #: the C name this class stands for (None for the groups)
    c_name: Optional[str] = None

    def __init__(self, status: int, name: str, message: str) -> None:
        super().__init__(status, name, message)
        self.status = status
        self.name = name
        self.message = message

    def __str__(self) -> str:
        return f"{self.name}: {self.message}" if self.message else self.name

    @classmethod
    def make(cls, message: str) -> "ActiveKVError":
        """An instance of this status class with `message` (for refusals the
        package makes itself)."""
        assert cls.c_name is not None
        return cls(STATUS_VALUES[cls.c_name], cls.c_name, message)


class UsageError(ActiveKVError):
    """The call is not allowed in the current state or with these arguments."""


class ConfigError(ActiveKVError):
    """The configuration, or what this build and machine support."""


class CapacityError(ActiveKVError):
    """Refused for room (host slots, device pages, memory, max_tokens)."""


class TransportError(ActiveKVError):
    """The transport failed: only diagnostics, quarantine and close remain."""


def _cls(name: str, base: type, c_name: str, doc: str, extra: tuple = ()) -> type:
    return type(name, (base,) + extra, {"c_name": c_name, "__doc__": doc})


InvalidArgument = _cls("InvalidArgument", UsageError, "AKV_ERR_INVALID_ARGUMENT",
                       "A required value was missing or out of range.", (ValueError,))
BadHandle = _cls("BadHandle", UsageError, "AKV_ERR_BAD_HANDLE",
                 "A closed, retired or foreign handle; also raised by the package for an "
                 "engine used in a child forked after it was made.")
Config = _cls("Config", ConfigError, "AKV_ERR_CONFIG", "Invalid configuration or geometry.")
NoFit = _cls("NoFit", ConfigError, "AKV_ERR_NO_FIT",
             "refuse mode: max_contexts does not fit the host pool (the message names the fix).")
RefusedQueue = _cls("RefusedQueue", CapacityError, "AKV_ERR_REFUSED_QUEUE",
                    "shrink mode: every host slot is taken; queue the request and retry.")
AdmissionRefused = _cls("AdmissionRefused", CapacityError, "AKV_ERR_ADMISSION_REFUSED",
                        "The device page pool cannot admit the target (see Engine.explain).")
OutOfMemory = _cls("OutOfMemory", CapacityError, "AKV_ERR_OUT_OF_MEMORY",
                   "An allocation failed, or a fixed table is full.")
Capacity = _cls("Capacity", CapacityError, "AKV_ERR_CAPACITY",
                "A context has no room left (max_tokens).")
StepState = _cls("StepState", UsageError, "AKV_ERR_STEP_STATE", "Step misuse.")
LeaseOrder = _cls("LeaseOrder", UsageError, "AKV_ERR_LEASE_ORDER",
                  "Lease begin while the previous lease is neither sealed nor retired.")
LeaseState = _cls("LeaseState", UsageError, "AKV_ERR_LEASE_STATE",
                  "The lease is not in a state that allows this call.")
OwnerMismatch = _cls("OwnerMismatch", UsageError, "AKV_ERR_OWNER_MISMATCH",
                     "Write-back named an owner the lease did not begin with.")
FenceMismatch = _cls("FenceMismatch", UsageError, "AKV_ERR_FENCE_MISMATCH",
                     "Seal was given a fence other than the one recorded.")
Backend = _cls("Backend", TransportError, "AKV_ERR_BACKEND",
               "A backend operation failed; the transport is now marked failed.")
Quarantined = _cls("Quarantined", TransportError, "AKV_ERR_QUARANTINED",
                   "The transport failed earlier; only diagnostics, quarantine, close.")
Busy = _cls("Busy", UsageError, "AKV_ERR_BUSY",
            "Close with live work; nothing was freed. Also raised by the package when an "
            "engine is called from a second thread while another is in a call, or from its "
            "own log callback; nothing changed.")
UncertainFence = _cls("UncertainFence", TransportError, "AKV_ERR_UNCERTAIN_FENCE",
                      "Quarantine could not establish completion; everything stays retained.")
NotSupported = _cls("NotSupported", ConfigError, "AKV_ERR_NOT_SUPPORTED",
                    "Not available in this build, on this machine, or in this library version.")
InUse = _cls("InUse", UsageError, "AKV_ERR_IN_USE", "In use by the open step.")
UnevenLayers = _cls("UnevenLayers", UsageError, "AKV_ERR_UNEVEN_LAYERS",
                    "A context's dense layers hold different row counts.")
Timeout = _cls("Timeout", TransportError, "AKV_ERR_TIMEOUT",
               "Group: a rank did not reach an agreement point in time; the communicator "
               "was aborted and this rank's engine quarantined.")
Comm = _cls("Comm", TransportError, "AKV_ERR_COMM",
            "Group: the communicator failed; it was aborted and this rank's engine "
            "quarantined.")
Disagree = _cls("Disagree", UsageError, "AKV_ERR_DISAGREE",
                "Group: ranks gave different inputs at an agreement point; nothing changed "
                "on any rank.")
NotReady = _cls("NotReady", UsageError, "AKV_ERR_NOT_READY",
                "Fences still pending (akv_lease_try_retire); nothing changed. "
                "Lease.try_retire returns None instead of raising it.")

_BY_NAME: Dict[str, Type[ActiveKVError]] = {
    c.c_name: c
    for c in (InvalidArgument, BadHandle, Config, NoFit, RefusedQueue, AdmissionRefused,
              OutOfMemory, Capacity, StepState, LeaseOrder, LeaseState, OwnerMismatch,
              FenceMismatch, Backend, Quarantined, Busy, UncertainFence, NotSupported, InUse,
              UnevenLayers, Timeout, Comm, Disagree, NotReady)
}


def error_for(status: int, message: str) -> ActiveKVError:
    """The exception for a status value: its own class when the package knows
    the status, ActiveKVError otherwise."""
    name = status_name(status)
    cls = _BY_NAME.get(name, ActiveKVError)
    return cls(status, name, message)
