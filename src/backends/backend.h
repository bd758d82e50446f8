/*
 * backend.h - the internal operations table every backend implements.
 *
 * A backend is a `static const akv_backend_ops` table plus a context pointer
 * (ggml-backend style). The core never includes cuda_runtime.h: it only sees
 * opaque queues and events through this table. Optional slots may be NULL and
 * the dispatcher (backend.c) supplies the fallback.
 *
 * Semantics every backend must honour (the host backend models them exactly):
 *  - Operations enqueued on one queue run in order, asynchronously to the
 *    caller and to other queues.
 *  - event_record(e, q) captures "everything enqueued on q so far"; a later
 *    record on the same event replaces the capture (CUDA semantics).
 *  - queue_wait(q, e) makes later work on q wait until the capture of e that
 *    was current at the time of the call has completed. Waiting on an event
 *    never recorded is a no-op.
 *  - event_query reports whether the current capture has completed.
 *  - *_synchronize block the calling thread; they fail (nonzero status) if
 *    completion cannot be established.
 *  - Every entry returns AKV_OK or an error status; a failure leaves the queue
 *    in an unknown state (the core marks the transport failed).
 */
#ifndef AKV_BACKEND_H
#define AKV_BACKEND_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "akv.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct akv_bqueue akv_bqueue; /* opaque backend queue */
typedef struct akv_bevent akv_bevent; /* opaque backend event */

typedef enum akv_copy_dir {
  AKV_COPY_H2D = 0,
  AKV_COPY_D2H = 1,
  AKV_COPY_D2D = 2
} akv_copy_dir;

typedef struct akv_backend_params {
  int device_ordinal;
  uint64_t delay_seed;    /* host backend: injected delays; 0 = none */
  uint32_t delay_max_us;
  uint64_t fake_free_bytes; /* host backend: modelled device capacity (testing); 0 = none */
} akv_backend_params;

typedef struct akv_backend_ops {
  const char *name;
  akv_backend_kind kind;

  /* Lifetime. probe returns AKV_OK if the backend can run on this machine. */
  akv_status (*probe)(const akv_backend_params *params);
  akv_status (*init)(const akv_backend_params *params, void **ctx);
  void (*shutdown)(void *ctx);

  /* Memory. host_alloc returns pinned memory; device_alloc device memory. */
  akv_status (*host_alloc)(void *ctx, size_t bytes, void **out);
  void (*host_free)(void *ctx, void *ptr);
  akv_status (*device_alloc)(void *ctx, size_t bytes, void **out);
  void (*device_free)(void *ctx, void *ptr);

  /* Queues and events. */
  akv_status (*queue_create)(void *ctx, akv_bqueue **out);
  void (*queue_destroy)(void *ctx, akv_bqueue *q);
  akv_status (*event_create)(void *ctx, akv_bevent **out);
  void (*event_destroy)(void *ctx, akv_bevent *e);
  akv_status (*event_record)(void *ctx, akv_bevent *e, akv_bqueue *q);
  akv_status (*queue_wait)(void *ctx, akv_bqueue *q, akv_bevent *e);
  akv_status (*event_query)(void *ctx, akv_bevent *e, bool *done);
  akv_status (*event_synchronize)(void *ctx, akv_bevent *e);
  akv_status (*queue_synchronize)(void *ctx, akv_bqueue *q);
  akv_status (*device_synchronize)(void *ctx);

  /* Copies, enqueued on q. */
  akv_status (*copy)(void *ctx, akv_bqueue *q, akv_copy_dir dir, void *dst, const void *src,
                     size_t bytes);
  /* Optional (NULL: the dispatcher loops over copy). count >= 1. */
  akv_status (*copy_batch)(void *ctx, akv_bqueue *q, akv_copy_dir dir, size_t count,
                           void *const *dst, const void *const *src, const size_t *bytes);
  /* Host function on a queue. */
  akv_status (*host_fn)(void *ctx, akv_bqueue *q, void (*fn)(void *), void *arg);

  /* Optional: device memory figures (free/total now, process peak). */
  akv_status (*mem_info)(void *ctx, uint64_t *free_bytes, uint64_t *total_bytes,
                         uint64_t *peak_used_bytes);

  /* Optional: the backend's own words for its last failure (e.g. cudart's
   * error string), appended to the engine's last error. */
  const char *(*error_detail)(void *ctx);

  /* Optional stream-ordered frees (NULL: the dispatcher frees at once with
   * device_free / host_free). The memory is released once q reaches this
   * point; the call itself never blocks and waits on no other queue, so
   * teardown can hand memory back without synchronising the device (as
   * cudaFree and cudaFreeHost do). Nothing may use the memory after q
   * reaches the free; q may be destroyed right after the call. */
  void (*device_free_async)(void *ctx, void *ptr, akv_bqueue *q);
  void (*host_free_async)(void *ctx, void *ptr, akv_bqueue *q);

  /* Optional (NULL: never): true when the calling thread is the one that
   * runs q's work (a host function enqueued on q is calling back), where
   * queue_destroy would have to drain and join the thread it runs on. */
  bool (*queue_is_current)(void *ctx, akv_bqueue *q);

  /* Optional (NULL: never): true when work enqueued on q has not finished
   * running, so that queue_destroy, which drains q, would wait for it
   * (perhaps, through q's waits on other queues, for the caller itself).
   * A backend whose queue_destroy never waits leaves it NULL. */
  bool (*queue_pending)(void *ctx, akv_bqueue *q);

  /* Optional (NULL: never): true when the calling thread runs a host
   * function of this backend (host_fn) and must make no call of the
   * backend's runtime there, so no library call on an engine of this
   * backend may run on it (CUDA: a cudaLaunchHostFunc callback, where CUDA
   * calls are not permitted). */
  bool (*calls_forbidden)(void);
} akv_backend_ops;

/* The tables. akv_backend_cuda_ops is NULL-equivalent when CUDA is not built. */
extern const akv_backend_ops akv_backend_host_ops;
#ifdef AKV_WITH_CUDA
extern const akv_backend_ops akv_backend_cuda_ops;
#endif

#ifdef __cplusplus
}
#endif

#endif /* AKV_BACKEND_H */
