/*
 * backend_cuda.cu - the CUDA backend (backend.h), CUDA runtime API only.
 *
 * Mapping:
 *  - queue  = cudaStream_t created with cudaStreamNonBlocking (never the
 *             legacy default stream, so the caller's default-stream work does
 *             not serialise with the engine's copies);
 *  - event  = cudaEvent_t created with cudaEventDisableTiming;
 *  - host memory = pinned memory from a host memory pool of the backend
 *             (cudaMemPoolCreate, location host, the device granted
 *             read-write access, so copies run at pinned speed), allocated
 *             with cudaMallocFromPoolAsync on the backend's own allocation
 *             stream; where the build (CUDA < 13) or the device
 *             (cudaDevAttrHostMemoryPoolsSupported) has no host pools,
 *             cudaHostAlloc(cudaHostAllocDefault);
 *  - device memory = cudaMalloc.
 *
 * Teardown never synchronises the device. cudaFree, cudaFreeHost and
 * cudaHostUnregister wait until the whole device is idle, the caller's
 * unrelated kernels included (measured on an H200 with a 1 s kernel on a
 * caller's stream: each returned after the kernel, 1000-1095 ms, also for
 * 4 KiB). The stream-ordered frees (device_free_async, host_free_async) use
 * cudaFreeAsync on the engine's own queue instead: it returned in 0.01 ms
 * for pool memory and 8.9 ms for 1 GiB of cudaMalloc memory (the unmapping,
 * released in full), the caller's kernel still running. Stream and event
 * destruction and cudaMemPoolDestroy return at once and release their
 * resources once outstanding work is done (0.01 / 0.21 ms measured). The one
 * exception is the cudaHostAlloc fallback: cudaFreeHost synchronises the
 * device, so there host_free_async waits for the caller's work in flight.
 * Queues and events are the CUDA handles cast to akv_bqueue* / akv_bevent*.
 * CUDA's event semantics are exactly those backend.h asks for (a record
 * replaces the capture; waiting on a never-recorded event is a no-op).
 *
 * Errors: every cudart return code is checked. A failure is written to the
 * context's last-error string (akv_cuda_last_error) and mapped to
 * AKV_ERR_OUT_OF_MEMORY (cudaErrorMemoryAllocation) or AKV_ERR_BACKEND
 * (anything else); the runtime's non-sticky "last error" is then cleared with
 * cudaGetLastError() so that the caller's own error checks do not report the
 * engine's failures as theirs.
 *
 * Devices: the backend never changes the calling thread's current device.
 * Calls that depend on it (init, allocation, queue and event creation, device
 * synchronisation, memory figures, usage samples, the gather kernel's launch
 * and the batched copies) switch to the backend's device if another one is
 * current and switch back before they return, so the engine may be driven
 * from any thread, whatever device that thread has current (a runtime's
 * other GPU, or device 0 of a new thread). Stream- and event-bound calls
 * (copies on a stream, records, waits, queries) need no switch.
 *
 * Memory figure: peak_used_bytes of mem_info is the largest value of
 * (total - free) from cudaMemGetInfo seen by this backend context, sampled at
 * init, after every device allocation, at every queue and device
 * synchronisation and at every mem_info call. It counts everything resident
 * on the device (other processes, the CUDA context itself, the caller's
 * allocations), and misses peaks between samples. Event synchronisation, on
 * the hot path, does not sample.
 *
 * Statuses: a NULL context (or one failing its magic check), a NULL queue or a NULL event is
 * AKV_ERR_BAD_HANDLE (a NULL queue would otherwise mean CUDA's legacy default
 * stream); a NULL output, a zero-byte allocation, an unknown copy direction or
 * a NULL copy pointer is AKV_ERR_INVALID_ARGUMENT. A zero-byte copy is a
 * no-op; zero-byte entries of a batch are skipped. CUDA handles themselves
 * cannot be validated beyond NULL.
 *
 * Hot path: copy, copy_batch, event_record, queue_wait, event_query and
 * host_fn neither allocate nor block.
 */
#include <cuda_runtime.h>

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "backend_cuda.h"
#include "cuda_device.h"

namespace {

constexpr uint32_t kCtxMagic = 0x41564B43u; /* "CKVA" */
constexpr uint32_t kCtxDead = 0xDEADC0DEu;

/* Descriptors of one device->device gather launch (see gather_submit). */
#define AKV_GATHER_MAX 1024
struct akv_gather_batch {
  const uint4 *src[AKV_GATHER_MAX];
  uint4 *dst[AKV_GATHER_MAX];
  uint32_t words[AKV_GATHER_MAX]; /* 16-byte words per descriptor */
};

struct akv_cuda_ctx {
  uint32_t magic;
  int device;
  cudaStream_t alloc_stream; /* non-blocking; pinned pool allocations only */
  cudaMemPool_t host_pool;   /* pinned host pool; nullptr: cudaHostAlloc fallback */
  uint64_t peak_used;
  char last_error[256];
  akv_gather_batch gather; /* kernel parameters of the D2D gather, reused */
  /* Pinned allocations the host pool refused and cudaHostAlloc made instead
   * (cuda_host_alloc): freed with cudaFreeHost, never through the pool. */
  void *host_fallback[8];
  uint32_t n_host_fallback;
};

/* Index of ptr among the ctx's cudaHostAlloc fallbacks, or -1. */
static int host_fallback_find(const akv_cuda_ctx *c, const void *ptr) {
  for (uint32_t i = 0; i < c->n_host_fallback; ++i)
    if (c->host_fallback[i] == ptr) return (int)i;
  return -1;
}

static akv_cuda_ctx *as_ctx(void *ctx) {
  akv_cuda_ctx *c = static_cast<akv_cuda_ctx *>(ctx);
  return (c != nullptr && c->magic == kCtxMagic) ? c : nullptr;
}

static cudaStream_t as_stream(akv_bqueue *q) {
  return reinterpret_cast<cudaStream_t>(q);
}
static cudaEvent_t as_event(akv_bevent *e) {
  return reinterpret_cast<cudaEvent_t>(e);
}

static akv_status map_error(cudaError_t err) {
  return err == cudaErrorMemoryAllocation ? AKV_ERR_OUT_OF_MEMORY : AKV_ERR_BACKEND;
}

/* Records a failure and clears the runtime's non-sticky last error. */
static void note_error(akv_cuda_ctx *c, const char *what, cudaError_t err) {
  if (c != nullptr)
    snprintf(c->last_error, sizeof c->last_error, "%s: %s: %s", what, cudaGetErrorName(err),
             cudaGetErrorString(err));
  (void)cudaGetLastError();
}

/* The checking macros of this file, one family. AKV_CUDA_TRY: a cudart call;
 * on failure, note, map, goto fail. */
#define AKV_CUDA_TRY(c, call, what)  \
  do {                               \
    const cudaError_t err_ = (call); \
    if (err_ != cudaSuccess) {       \
      note_error((c), (what), err_); \
      st = map_error(err_);          \
      goto fail;                     \
    }                                \
  } while (0)

/* Argument checks of the same family: a NULL or dead context, queue or event
 * is AKV_ERR_BAD_HANDLE (as on the host backend); other bad arguments are
 * AKV_ERR_INVALID_ARGUMENT. */
#define AKV_CUDA_REQUIRE(cond, status) \
  do {                                 \
    if (!(cond)) {                     \
      st = (status);                   \
      goto fail;                       \
    }                                  \
  } while (0)

/* The backend's device made current for a call, the caller's restored
 * after it (cuda_device.h). */
static cudaError_t device_enter(const akv_cuda_ctx *c, int *prev) {
  return akv_cuda_device_enter(c->device, prev);
}

static void device_leave(const akv_cuda_ctx *c, int prev) { akv_cuda_device_leave(c->device, prev); }

/* Samples (total - free) into the peak. A failed sample is not an error of
 * the operation that triggered it: the peak simply misses that sample. */
static void sample_usage(akv_cuda_ctx *c) {
  size_t free_b = 0, total_b = 0;
  int prev = -1;
  /* cudaMemGetInfo reads the current device: the backend's is made current
   * for the sample, so another device's usage never enters the peak. */
  if (device_enter(c, &prev) != cudaSuccess) {
    (void)cudaGetLastError();
    return;
  }
  const cudaError_t err = cudaMemGetInfo(&free_b, &total_b);
  device_leave(c, prev);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return;
  }
  const uint64_t used = (uint64_t)(total_b - free_b);
  if (used > c->peak_used) c->peak_used = used;
}

static cudaMemcpyKind copy_kind(akv_copy_dir dir) {
  switch (dir) {
    case AKV_COPY_H2D: return cudaMemcpyHostToDevice;
    case AKV_COPY_D2H: return cudaMemcpyDeviceToHost;
    default: return cudaMemcpyDeviceToDevice;
  }
}

static bool dir_ok(akv_copy_dir dir) {
  return dir == AKV_COPY_H2D || dir == AKV_COPY_D2H || dir == AKV_COPY_D2D;
}

/* ------------------------------------------------------------ lifetime */

static akv_status cuda_probe(const akv_backend_params *params) {
  int n = 0;
  const int ordinal = params != nullptr ? params->device_ordinal : 0;
  /* No driver, no device, or a driver older than the runtime: quietly "not
   * supported" (the caller falls back to the host backend). */
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return AKV_ERR_NOT_SUPPORTED;
  }
  if (n <= 0 || ordinal < 0 || ordinal >= n) return AKV_ERR_NOT_SUPPORTED;
  return AKV_OK;
}

/* Creates the pinned host pool where the build and the device support host
 * memory pools; otherwise leaves host_pool NULL (cudaHostAlloc fallback).
 * Without device access the device reads pool memory through a slow path
 * (measured 6.7 GB/s H2D instead of 55), so access is granted or the pool
 * is not used. A failure here is not an error: the fallback works. */
static void host_pool_create(akv_cuda_ctx *c) {
  c->host_pool = nullptr;
#if CUDART_VERSION >= 13000
  int supported = 0;
  if (cudaDeviceGetAttribute(&supported, cudaDevAttrHostMemoryPoolsSupported, c->device) !=
          cudaSuccess ||
      supported == 0) {
    (void)cudaGetLastError();
    return;
  }
  cudaMemPoolProps props;
  memset(&props, 0, sizeof props);
  props.allocType = cudaMemAllocationTypePinned;
  props.location.type = cudaMemLocationTypeHost;
  props.location.id = 0; /* ignored for the host */
  cudaMemPool_t pool = nullptr;
  if (cudaMemPoolCreate(&pool, &props) != cudaSuccess) {
    (void)cudaGetLastError();
    return;
  }
  cudaMemAccessDesc access;
  memset(&access, 0, sizeof access);
  access.location.type = cudaMemLocationTypeDevice;
  access.location.id = c->device;
  access.flags = cudaMemAccessFlagsProtReadWrite;
  if (cudaMemPoolSetAccess(pool, &access, 1) != cudaSuccess) {
    (void)cudaGetLastError();
    (void)cudaMemPoolDestroy(pool);
    return;
  }
  c->host_pool = pool;
#else
  (void)c;
#endif
}

static akv_status cuda_init(const akv_backend_params *params, void **out) {
  akv_status st = AKV_ERR_INVALID_ARGUMENT;
  akv_cuda_ctx *c = nullptr;
  int prev = -1; /* the caller's current device, restored on every return */
  if (params == nullptr || out == nullptr) goto fail;
  st = cuda_probe(params);
  if (st != AKV_OK) goto fail;
  c = static_cast<akv_cuda_ctx *>(calloc(1, sizeof *c));
  st = AKV_ERR_OUT_OF_MEMORY;
  if (c == nullptr) goto fail; /* calloc */
  c->magic = kCtxMagic;
  c->device = params->device_ordinal;
  c->last_error[0] = '\0';
  AKV_CUDA_TRY(c, device_enter(c, &prev), "cudaSetDevice");
  /* Creates the primary context now rather than inside the first copy. */
  AKV_CUDA_TRY(c, cudaFree(nullptr), "cudaFree(NULL) (context creation)");
  AKV_CUDA_TRY(c, cudaStreamCreateWithFlags(&c->alloc_stream, cudaStreamNonBlocking),
               "cudaStreamCreateWithFlags(NonBlocking) (allocation stream)");
  host_pool_create(c);
  sample_usage(c);
  device_leave(c, prev);
  *out = c;
  return AKV_OK;
fail:
  if (c != nullptr && c->alloc_stream != nullptr) (void)cudaStreamDestroy(c->alloc_stream);
  if (c != nullptr && prev >= 0) device_leave(c, prev);
  free(c);
  return st;
}

/* Returns at once: the pool and the stream are released by the runtime once
 * their outstanding frees (stream-ordered, on the engine's queues) ran. */
static void cuda_shutdown(void *ctx) {
  akv_cuda_ctx *c = as_ctx(ctx);
  if (c == nullptr) return;
  bool failed = false;
  if (c->host_pool != nullptr && cudaMemPoolDestroy(c->host_pool) != cudaSuccess) failed = true;
  if (c->alloc_stream != nullptr && cudaStreamDestroy(c->alloc_stream) != cudaSuccess)
    failed = true;
  /* Only a failure of these calls is cleared from the runtime's last error:
   * an error the caller has not read yet stays theirs to read. */
  if (failed) (void)cudaGetLastError();
  c->magic = kCtxDead;
  free(c);
}

/* ------------------------------------------------------------ memory */

static akv_status cuda_host_alloc(void *ctx, size_t bytes, void **out) {
  akv_status st = AKV_ERR_INVALID_ARGUMENT;
  akv_cuda_ctx *c = as_ctx(ctx);
  int prev = -1;
  void *p = nullptr;
  char what[64];
  AKV_CUDA_REQUIRE(c != nullptr, AKV_ERR_BAD_HANDLE);
  AKV_CUDA_REQUIRE(out != nullptr && bytes != 0, AKV_ERR_INVALID_ARGUMENT);
  AKV_CUDA_TRY(c, device_enter(c, &prev), "cudaSetDevice");
  if (c->host_pool != nullptr) {
    /* Stream-ordered allocation, made usable on every stream by waiting for
     * the allocation stream (it holds nothing else; create-time only). */
    snprintf(what, sizeof what, "cudaMallocFromPoolAsync(host, %zu B)", bytes);
    cudaError_t err = cudaMallocFromPoolAsync(&p, bytes, c->host_pool, c->alloc_stream);
    if (err == cudaSuccess) {
      err = cudaStreamSynchronize(c->alloc_stream);
      if (err != cudaSuccess) (void)cudaFreeAsync(p, c->alloc_stream);
    }
    if (err == cudaErrorMemoryAllocation &&
        c->n_host_fallback < sizeof c->host_fallback / sizeof c->host_fallback[0]) {
      /* The pool can refuse a large block that cudaHostAlloc still pins
       * (seen on the H200 machines for a 16 GiB pool); that block is then
       * freed with cudaFreeHost, which waits for the device (the documented
       * exception of the fallback, cuda_host_free). */
      (void)cudaGetLastError();
      snprintf(what, sizeof what, "cudaHostAlloc(%zu B) after the host pool refused it", bytes);
      p = nullptr;
      err = cudaHostAlloc(&p, bytes, cudaHostAllocDefault);
      if (err == cudaSuccess) c->host_fallback[c->n_host_fallback++] = p;
    }
    device_leave(c, prev);
    AKV_CUDA_TRY(c, err, what);
  } else {
    snprintf(what, sizeof what, "cudaHostAlloc(%zu B)", bytes);
    const cudaError_t err = cudaHostAlloc(&p, bytes, cudaHostAllocDefault);
    device_leave(c, prev);
    AKV_CUDA_TRY(c, err, what);
  }
  *out = p;
  return AKV_OK;
fail:
  return st;
}

/* Pool memory goes back on the allocation stream (nothing else is on it:
 * freed at once, no device synchronisation); the cudaHostAlloc fallback
 * uses cudaFreeHost, which synchronises the device. */
static void cuda_host_free(void *ctx, void *ptr) {
  akv_cuda_ctx *c = as_ctx(ctx);
  if (ptr == nullptr) return;
  const int fb = c != nullptr ? host_fallback_find(c, ptr) : -1;
  if (fb >= 0) c->host_fallback[fb] = c->host_fallback[--c->n_host_fallback];
  if (c != nullptr && c->host_pool != nullptr && fb < 0) {
    const cudaError_t err = cudaFreeAsync(ptr, c->alloc_stream);
    if (err != cudaSuccess) note_error(c, "cudaFreeAsync(host pool)", err);
    return;
  }
  const cudaError_t err = cudaFreeHost(ptr);
  if (err != cudaSuccess) note_error(c, "cudaFreeHost", err);
}

/* Stream-ordered: freed when q reaches this point; waits on nothing. The
 * cudaHostAlloc fallback cannot be freed in stream order: cudaFreeHost, the
 * documented exception (it waits until the device is idle). */
static void cuda_host_free_async(void *ctx, void *ptr, akv_bqueue *q) {
  akv_cuda_ctx *c = as_ctx(ctx);
  if (ptr == nullptr) return;
  if (c == nullptr || c->host_pool == nullptr || q == nullptr || host_fallback_find(c, ptr) >= 0) {
    cuda_host_free(ctx, ptr);
    return;
  }
  const cudaError_t err = cudaFreeAsync(ptr, as_stream(q));
  if (err != cudaSuccess) note_error(c, "cudaFreeAsync(host pool)", err);
}

static akv_status cuda_device_alloc(void *ctx, size_t bytes, void **out) {
  akv_status st = AKV_ERR_INVALID_ARGUMENT;
  akv_cuda_ctx *c = as_ctx(ctx);
  int prev = -1;
  void *p = nullptr;
  char what[64];
  AKV_CUDA_REQUIRE(c != nullptr, AKV_ERR_BAD_HANDLE);
  AKV_CUDA_REQUIRE(out != nullptr && bytes != 0, AKV_ERR_INVALID_ARGUMENT);
  AKV_CUDA_TRY(c, device_enter(c, &prev), "cudaSetDevice");
  snprintf(what, sizeof what, "cudaMalloc(%zu B)", bytes);
  {
    const cudaError_t err = cudaMalloc(&p, bytes);
    if (err == cudaSuccess) sample_usage(c);
    device_leave(c, prev);
    AKV_CUDA_TRY(c, err, what);
  }
  *out = p;
  return AKV_OK;
fail:
  return st;
}

static void cuda_device_free(void *ctx, void *ptr) {
  akv_cuda_ctx *c = as_ctx(ctx);
  if (ptr == nullptr) return;
  /* cudaFree needs no current-device switch: the pointer names its device. */
  const cudaError_t err = cudaFree(ptr);
  if (err != cudaSuccess) note_error(c, "cudaFree", err);
}

/* cudaFreeAsync accepts cudaMalloc memory: the free runs when q reaches it,
 * without synchronising the device (the unmapping costs the calling thread
 * about 9 ms per GiB, measured; it waits for no work). */
static void cuda_device_free_async(void *ctx, void *ptr, akv_bqueue *q) {
  akv_cuda_ctx *c = as_ctx(ctx);
  if (ptr == nullptr) return;
  if (q == nullptr) {
    cuda_device_free(ctx, ptr);
    return;
  }
  const cudaError_t err = cudaFreeAsync(ptr, as_stream(q));
  if (err != cudaSuccess) note_error(c, "cudaFreeAsync", err);
}

/* ------------------------------------------------------------ queues, events */

static akv_status cuda_queue_create(void *ctx, akv_bqueue **out) {
  akv_status st = AKV_ERR_INVALID_ARGUMENT;
  akv_cuda_ctx *c = as_ctx(ctx);
  int prev = -1;
  cudaStream_t s = nullptr;
  AKV_CUDA_REQUIRE(c != nullptr, AKV_ERR_BAD_HANDLE);
  AKV_CUDA_REQUIRE(out != nullptr, AKV_ERR_INVALID_ARGUMENT);
  AKV_CUDA_TRY(c, device_enter(c, &prev), "cudaSetDevice");
  {
    const cudaError_t err = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    device_leave(c, prev);
    AKV_CUDA_TRY(c, err, "cudaStreamCreateWithFlags(NonBlocking)");
  }
  *out = reinterpret_cast<akv_bqueue *>(s);
  return AKV_OK;
fail:
  return st;
}

static void cuda_queue_destroy(void *ctx, akv_bqueue *q) {
  akv_cuda_ctx *c = as_ctx(ctx);
  if (q == nullptr) return;
  const cudaError_t err = cudaStreamDestroy(as_stream(q));
  if (err != cudaSuccess) note_error(c, "cudaStreamDestroy", err);
}

static akv_status cuda_event_create(void *ctx, akv_bevent **out) {
  akv_status st = AKV_ERR_INVALID_ARGUMENT;
  akv_cuda_ctx *c = as_ctx(ctx);
  int prev = -1;
  cudaEvent_t e = nullptr;
  AKV_CUDA_REQUIRE(c != nullptr, AKV_ERR_BAD_HANDLE);
  AKV_CUDA_REQUIRE(out != nullptr, AKV_ERR_INVALID_ARGUMENT);
  AKV_CUDA_TRY(c, device_enter(c, &prev), "cudaSetDevice");
  {
    const cudaError_t err = cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
    device_leave(c, prev);
    AKV_CUDA_TRY(c, err, "cudaEventCreateWithFlags(DisableTiming)");
  }
  *out = reinterpret_cast<akv_bevent *>(e);
  return AKV_OK;
fail:
  return st;
}

static void cuda_event_destroy(void *ctx, akv_bevent *e) {
  akv_cuda_ctx *c = as_ctx(ctx);
  if (e == nullptr) return;
  const cudaError_t err = cudaEventDestroy(as_event(e));
  if (err != cudaSuccess) note_error(c, "cudaEventDestroy", err);
}

static akv_status cuda_event_record(void *ctx, akv_bevent *e, akv_bqueue *q) {
  akv_status st = AKV_ERR_INVALID_ARGUMENT;
  akv_cuda_ctx *c = as_ctx(ctx);
  /* A NULL queue would be the legacy default stream: refused. */
  AKV_CUDA_REQUIRE(c != nullptr && e != nullptr && q != nullptr, AKV_ERR_BAD_HANDLE);
  AKV_CUDA_TRY(c, cudaEventRecord(as_event(e), as_stream(q)), "cudaEventRecord");
  return AKV_OK;
fail:
  return st;
}

static akv_status cuda_queue_wait(void *ctx, akv_bqueue *q, akv_bevent *e) {
  akv_status st = AKV_ERR_INVALID_ARGUMENT;
  akv_cuda_ctx *c = as_ctx(ctx);
  AKV_CUDA_REQUIRE(c != nullptr && e != nullptr && q != nullptr, AKV_ERR_BAD_HANDLE);
  AKV_CUDA_TRY(c, cudaStreamWaitEvent(as_stream(q), as_event(e), cudaEventWaitDefault),
               "cudaStreamWaitEvent");
  return AKV_OK;
fail:
  return st;
}

static akv_status cuda_event_query(void *ctx, akv_bevent *e, bool *done) {
  akv_status st = AKV_ERR_INVALID_ARGUMENT;
  akv_cuda_ctx *c = as_ctx(ctx);
  cudaError_t err;
  AKV_CUDA_REQUIRE(c != nullptr && e != nullptr, AKV_ERR_BAD_HANDLE);
  AKV_CUDA_REQUIRE(done != nullptr, AKV_ERR_INVALID_ARGUMENT);
  err = cudaEventQuery(as_event(e));
  if (err == cudaErrorNotReady) {
    /* Not an error: the capture has not completed yet. Should the runtime
     * have latched it as its last error, that entry is ours: drop it. */
    if (cudaPeekAtLastError() == cudaErrorNotReady) (void)cudaGetLastError();
    *done = false;
    return AKV_OK;
  }
  AKV_CUDA_TRY(c, err, "cudaEventQuery");
  *done = true;
  return AKV_OK;
fail:
  return st;
}

static akv_status cuda_event_synchronize(void *ctx, akv_bevent *e) {
  akv_status st = AKV_ERR_INVALID_ARGUMENT;
  akv_cuda_ctx *c = as_ctx(ctx);
  AKV_CUDA_REQUIRE(c != nullptr && e != nullptr, AKV_ERR_BAD_HANDLE);
  AKV_CUDA_TRY(c, cudaEventSynchronize(as_event(e)), "cudaEventSynchronize");
  return AKV_OK;
fail:
  return st;
}

static akv_status cuda_queue_synchronize(void *ctx, akv_bqueue *q) {
  akv_status st = AKV_ERR_INVALID_ARGUMENT;
  akv_cuda_ctx *c = as_ctx(ctx);
  AKV_CUDA_REQUIRE(c != nullptr && q != nullptr, AKV_ERR_BAD_HANDLE);
  AKV_CUDA_TRY(c, cudaStreamSynchronize(as_stream(q)), "cudaStreamSynchronize");
  sample_usage(c);
  return AKV_OK;
fail:
  return st;
}

static akv_status cuda_device_synchronize(void *ctx) {
  akv_status st = AKV_ERR_INVALID_ARGUMENT;
  akv_cuda_ctx *c = as_ctx(ctx);
  int prev = -1;
  AKV_CUDA_REQUIRE(c != nullptr, AKV_ERR_BAD_HANDLE);
  AKV_CUDA_TRY(c, device_enter(c, &prev), "cudaSetDevice");
  {
    const cudaError_t err = cudaDeviceSynchronize();
    if (err == cudaSuccess) sample_usage(c);
    device_leave(c, prev);
    AKV_CUDA_TRY(c, err, "cudaDeviceSynchronize");
  }
  return AKV_OK;
fail:
  return st;
}

/* ------------------------------------------------------------ copies */

static akv_status cuda_copy(void *ctx, akv_bqueue *q, akv_copy_dir dir, void *dst, const void *src,
                            size_t bytes) {
  akv_status st = AKV_ERR_INVALID_ARGUMENT;
  akv_cuda_ctx *c = as_ctx(ctx);
  AKV_CUDA_REQUIRE(c != nullptr && q != nullptr, AKV_ERR_BAD_HANDLE);
  AKV_CUDA_REQUIRE(dir_ok(dir), AKV_ERR_INVALID_ARGUMENT);
  if (bytes == 0) return AKV_OK;
  AKV_CUDA_REQUIRE(dst != nullptr && src != nullptr, AKV_ERR_INVALID_ARGUMENT);
  AKV_CUDA_TRY(c, cudaMemcpyAsync(dst, src, bytes, copy_kind(dir), as_stream(q)),
               "cudaMemcpyAsync");
  return AKV_OK;
fail:
  return st;
}

#if CUDART_VERSION >= 13000
/* One cudaMemcpyBatchAsync over copies [0, n), all of direction dir. Sources
 * are read in stream order (they are the engine's pinned pool or device
 * pages, valid until the copy's event completes). The location hints only
 * matter for managed or pageable memory; they name the truth for ours. */
static cudaError_t batch_submit(const akv_cuda_ctx *c, cudaStream_t s, akv_copy_dir dir, size_t n,
                                void *const *dst, const void *const *src, const size_t *bytes) {
  cudaMemcpyAttributes attr;
  memset(&attr, 0, sizeof attr);
  attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  attr.srcLocHint.type = dir == AKV_COPY_H2D ? cudaMemLocationTypeHost : cudaMemLocationTypeDevice;
  attr.srcLocHint.id = dir == AKV_COPY_H2D ? 0 : c->device;
  attr.dstLocHint.type = dir == AKV_COPY_D2H ? cudaMemLocationTypeHost : cudaMemLocationTypeDevice;
  attr.dstLocHint.id = dir == AKV_COPY_D2H ? 0 : c->device;
  /* Prefer the copy engines: staging overlaps the caller's attention. */
  attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
  size_t attr_idx = 0;
  return cudaMemcpyBatchAsync(dst, src, bytes, n, &attr, &attr_idx, 1, s);
}
#endif

/* Submits copies [0, n) (all with bytes > 0): one batch call, or one
 * cudaMemcpyAsync each where the batch call is not supported. */
/* Device->device batches (materialising retained pages into a staging
 * buffer) run as one gather kernel instead of the copy engine: the page
 * descriptors travel in the kernel parameters (no device-side table, nothing
 * allocated), each block copies 16-byte words of one descriptor, so a batch
 * of many 512 KiB pages moves at device-memory speed. */
__global__ void __launch_bounds__(256) akv_gather_kernel(const __grid_constant__ akv_gather_batch b) {
  const uint32_t d = blockIdx.y;
  const uint32_t n = b.words[d];
  const uint4 *__restrict__ src = b.src[d];
  uint4 *__restrict__ dst = b.dst[d];
  for (uint32_t w = blockIdx.x * blockDim.x + threadIdx.x; w < n; w += gridDim.x * blockDim.x)
    dst[w] = src[w];
}

/* Submits one gather launch per AKV_GATHER_MAX descriptors when every copy is
 * 16-byte aligned and at most 64 GiB; returns cudaErrorNotSupported (nothing
 * enqueued) otherwise, and the caller falls back to the copy engine. */
static cudaError_t gather_submit(akv_cuda_ctx *c, cudaStream_t s, size_t n, void *const *dst,
                                 const void *const *src, const size_t *bytes) {
  akv_gather_batch &b = c->gather; /* an engine is used from one thread at a time */
  uint32_t max_words = 0;
  for (size_t i = 0; i < n; ++i)
    if (((uintptr_t)dst[i] | (uintptr_t)src[i] | bytes[i]) % 16 != 0 ||
        bytes[i] / 16 > UINT32_MAX)
      return cudaErrorNotSupported;
  for (size_t first = 0; first < n; first += AKV_GATHER_MAX) {
    const size_t m = n - first < AKV_GATHER_MAX ? n - first : AKV_GATHER_MAX;
    max_words = 0;
    for (size_t i = 0; i < m; ++i) {
      b.src[i] = (const uint4 *)src[first + i];
      b.dst[i] = (uint4 *)dst[first + i];
      b.words[i] = (uint32_t)(bytes[first + i] / 16);
      if (b.words[i] > max_words) max_words = b.words[i];
    }
    {
      const uint32_t per_block = 256 * 8;
      dim3 grid((max_words + per_block - 1) / per_block, (unsigned)m);
      if (grid.x == 0) grid.x = 1;
      /* The launch's own status: a triple-chevron launch is checked through
       * cudaGetLastError, which would also take (and clear) an error the
       * caller's own work left unread and report it as this launch's. */
      cudaLaunchConfig_t cfg = {};
      cfg.gridDim = grid;
      cfg.blockDim = dim3(256);
      cfg.stream = s;
      const cudaError_t err = cudaLaunchKernelEx(&cfg, akv_gather_kernel, b);
      if (err != cudaSuccess) return err;
    }
  }
  return cudaSuccess;
}

static akv_status batch_run(akv_cuda_ctx *c, cudaStream_t s, akv_copy_dir dir, size_t n,
                            void *const *dst, const void *const *src, const size_t *bytes) {
  akv_status st = AKV_ERR_BACKEND;
  if (dir == AKV_COPY_D2D) {
    const cudaError_t err = gather_submit(c, s, n, dst, src, bytes);
    if (err == cudaSuccess) return AKV_OK;
    if (err != cudaErrorNotSupported) AKV_CUDA_TRY(c, err, "gather kernel launch");
  }
  if (n >= 2) {
#if CUDART_VERSION >= 13000
    const cudaError_t err = batch_submit(c, s, dir, n, dst, src, bytes);
    if (err == cudaSuccess) return AKV_OK;
    if (err != cudaErrorNotSupported) AKV_CUDA_TRY(c, err, "cudaMemcpyBatchAsync");
    (void)cudaGetLastError(); /* not supported: fall through to the loop */
#endif
  }
  for (size_t i = 0; i < n; ++i)
    AKV_CUDA_TRY(c, cudaMemcpyAsync(dst[i], src[i], bytes[i], copy_kind(dir), s),
                 "cudaMemcpyAsync (batch fallback)");
  return AKV_OK;
fail:
  return st;
}

static akv_status cuda_copy_batch(void *ctx, akv_bqueue *q, akv_copy_dir dir, size_t count,
                                  void *const *dst, const void *const *src, const size_t *bytes) {
  akv_status st = AKV_ERR_INVALID_ARGUMENT;
  akv_cuda_ctx *c = as_ctx(ctx);
  size_t run = 0;
  int prev = -1;
  AKV_CUDA_REQUIRE(c != nullptr && q != nullptr, AKV_ERR_BAD_HANDLE);
  AKV_CUDA_REQUIRE(
      dir_ok(dir) && count != 0 && dst != nullptr && src != nullptr && bytes != nullptr,
      AKV_ERR_INVALID_ARGUMENT);
  for (size_t i = 0; i < count; ++i)
    AKV_CUDA_REQUIRE(bytes[i] == 0 || (dst[i] != nullptr && src[i] != nullptr),
                     AKV_ERR_INVALID_ARGUMENT);
  /* The gather kernel is launched on q, which must then be the current
   * device's (a kernel on another device's stream is refused): the
   * backend's device is made current for the submissions, the caller's
   * restored after. */
  AKV_CUDA_TRY(c, device_enter(c, &prev), "cudaSetDevice");
  /* Empty copies are skipped; each run of non-empty ones is one submission
   * (the arrays are used in place, nothing is allocated). */
  for (size_t i = 0; i <= count; ++i) {
    if (i < count && bytes[i] != 0) {
      ++run;
      continue;
    }
    if (run > 0) {
      const size_t first = i - run;
      st = batch_run(c, as_stream(q), dir, run, dst + first, src + first, bytes + first);
      if (st != AKV_OK) goto fail;
      run = 0;
    }
  }
  device_leave(c, prev);
  return AKV_OK;
fail:
  if (prev >= 0) device_leave(c, prev);
  return st;
}

/* Host functions (host_fn) run on a CUDA runtime thread, where no CUDA call
 * is permitted; the library's engine calls make CUDA calls. Invariant: while
 * a host function of this backend runs, its thread is marked, and every
 * engine call on a CUDA engine from it is refused before it touches the
 * engine (calls_forbidden, checked by the engine's claim). A trampoline
 * marks the thread around the caller's function; it owns its small record
 * and frees it when it runs (or the launch frees it when it is refused). */
static thread_local int cuda_host_fn_depth = 0;

struct CudaHostCall {
  void (*fn)(void *);
  void *arg;
};

static void CUDART_CB cuda_host_trampoline(void *p) {
  const CudaHostCall call = *static_cast<CudaHostCall *>(p);
  free(p);
  ++cuda_host_fn_depth;
  call.fn(call.arg);
  --cuda_host_fn_depth;
}

static bool cuda_calls_forbidden(void) { return cuda_host_fn_depth > 0; }

static akv_status cuda_host_fn(void *ctx, akv_bqueue *q, void (*fn)(void *), void *arg) {
  akv_status st = AKV_ERR_INVALID_ARGUMENT;
  akv_cuda_ctx *c = as_ctx(ctx);
  CudaHostCall *call = nullptr;
  AKV_CUDA_REQUIRE(c != nullptr && q != nullptr, AKV_ERR_BAD_HANDLE);
  AKV_CUDA_REQUIRE(fn != nullptr, AKV_ERR_INVALID_ARGUMENT);
  call = static_cast<CudaHostCall *>(malloc(sizeof(CudaHostCall)));
  AKV_CUDA_REQUIRE(call != nullptr, AKV_ERR_OUT_OF_MEMORY);
  call->fn = fn;
  call->arg = arg;
  AKV_CUDA_TRY(c, cudaLaunchHostFunc(as_stream(q), cuda_host_trampoline, call),
               "cudaLaunchHostFunc");
  return AKV_OK;
fail:
  free(call); /* not enqueued: the trampoline will not run */
  return st;
}

static akv_status cuda_mem_info(void *ctx, uint64_t *free_bytes, uint64_t *total_bytes,
                                uint64_t *peak_used_bytes) {
  akv_status st = AKV_ERR_INVALID_ARGUMENT;
  akv_cuda_ctx *c = as_ctx(ctx);
  int prev = -1;
  size_t free_b = 0, total_b = 0;
  AKV_CUDA_REQUIRE(c != nullptr, AKV_ERR_BAD_HANDLE);
  AKV_CUDA_TRY(c, device_enter(c, &prev), "cudaSetDevice");
  {
    const cudaError_t err = cudaMemGetInfo(&free_b, &total_b);
    device_leave(c, prev);
    AKV_CUDA_TRY(c, err, "cudaMemGetInfo");
  }
  if ((uint64_t)(total_b - free_b) > c->peak_used) c->peak_used = (uint64_t)(total_b - free_b);
  if (free_bytes != nullptr) *free_bytes = free_b;
  if (total_bytes != nullptr) *total_bytes = total_b;
  if (peak_used_bytes != nullptr) *peak_used_bytes = c->peak_used;
  return AKV_OK;
fail:
  return st;
}

#undef AKV_CUDA_TRY
#undef AKV_CUDA_REQUIRE

}  // namespace

extern "C" const char *akv_cuda_last_error(void *ctx) {
  akv_cuda_ctx *c = as_ctx(ctx);
  return c != nullptr ? c->last_error : "no CUDA backend context";
}

extern "C" int akv_cuda_host_pool_stream_ordered(void *ctx) {
  akv_cuda_ctx *c = as_ctx(ctx);
  return c != nullptr && c->host_pool != nullptr && c->n_host_fallback == 0 ? 1 : 0;
}

extern "C" const akv_backend_ops akv_backend_cuda_ops = {
    /* name */ "cuda",
    /* kind */ AKV_BACKEND_CUDA,
    cuda_probe,
    cuda_init,
    cuda_shutdown,
    cuda_host_alloc,
    cuda_host_free,
    cuda_device_alloc,
    cuda_device_free,
    cuda_queue_create,
    cuda_queue_destroy,
    cuda_event_create,
    cuda_event_destroy,
    cuda_event_record,
    cuda_queue_wait,
    cuda_event_query,
    cuda_event_synchronize,
    cuda_queue_synchronize,
    cuda_device_synchronize,
    cuda_copy,
    cuda_copy_batch,
    cuda_host_fn,
    cuda_mem_info,
    akv_cuda_last_error,
    cuda_device_free_async,
    cuda_host_free_async,
    /* queue_is_current */ nullptr,
    /* queue_pending */ nullptr,
    cuda_calls_forbidden,
};
