"""ActiveKV for Python: a thin, typed layer over libactivekv's C API (akv.h).

    import activekv as akv
    print(akv.fit(n_dense_layers=32, kv_heads=8, head_dim=128, max_tokens=32768,
                  max_contexts=4, host_pool_gib=16).line)
    with akv.Engine(backend="host", n_dense_layers=2, kv_heads=2, head_dim=64,
                    dtype="f32", max_tokens=256, page_tokens=16, max_contexts=2,
                    host_pool_gib=1) as eng, eng.open_context() as ctx:
        ctx.append(k, v)                    # [layers, tokens, kv_heads, head_dim]
        with eng.step([ctx]):
            for layer in range(2):
                lease = eng.lease_begin(layer)
                view = lease.wait_ready()   # zero-copy arrays of the staged rows
                ...                         # write row len[i], attend
                attn = lease.mark_consumed()
                lease.seal(lease.write_back(), attn)
                lease.retire()

torch is optional: it is imported on first use (CUDA views, the default CUDA
stream, kv_tensors). docs/python.md is the guide.
"""
from ._api import (
    Context,
    Decision,
    Engine,
    EngineInfo,
    Fence,
    FitReport,
    Headroom,
    Lease,
    QuarantineReport,
    Receipt,
    Stream,
    View,
    fit,
    version,
)
from ._lib import include_dir, library_path
from .errors import *  # noqa: F401,F403 - the exception hierarchy
from .errors import __all__ as _errors_all

__version__ = version()

__all__ = [
    "Context", "Decision", "Engine", "EngineInfo", "Fence", "FitReport", "Headroom", "Lease",
    "QuarantineReport", "Receipt", "Stream", "View", "fit", "version", "include_dir",
    "library_path",
] + list(_errors_all)
