/*
 * backend_cuda.h - what the core may ask the CUDA backend beyond its ops table.
 *
 * The table itself (akv_backend_cuda_ops) is declared in backend.h under
 * AKV_WITH_CUDA. This header adds only C declarations; it does not include
 * cuda_runtime.h, so the core can include it.
 */
#ifndef AKV_BACKEND_CUDA_H
#define AKV_BACKEND_CUDA_H

#include "backend.h"

#ifdef __cplusplus
extern "C" {
#endif

/**
 * The last CUDA runtime error the backend context `ctx` (from
 * akv_backend_cuda_ops.init) met, in words: the operation, the cudaError_t
 * name and its description, e.g. "cudaMalloc(1073741824 B):
 * cudaErrorMemoryAllocation: out of memory". "" when none happened yet.
 * Never NULL; a NULL ctx gives a fixed message. The string lives in the
 * context and is valid until the next failing operation or shutdown.
 * Not thread-safe: call it from the thread that drives the backend.
 */
const char *akv_cuda_last_error(void *ctx);

/**
 * 1 when the backend context's pinned host memory comes from a host memory
 * pool and goes back in stream order (host_free_async never synchronises the
 * device); 0 for the cudaHostAlloc fallback, whose cudaFreeHost waits until
 * the device is idle, and for a NULL or dead ctx. Thread-safe (reads a value
 * fixed at init).
 */
int akv_cuda_host_pool_stream_ordered(void *ctx);

#ifdef __cplusplus
}
#endif

#endif /* AKV_BACKEND_CUDA_H */
