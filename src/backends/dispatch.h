/*
 * dispatch.h - the core's only door to a backend.
 *
 * Wraps an akv_backend_ops table: counts every fallible operation per kind,
 * injects the configured fault (fail the N-th counted operation), supplies
 * fallbacks for optional slots, and keeps the last failure in words. The core
 * calls these wrappers, never the table directly, so fault injection works
 * the same on every backend.
 */
#ifndef AKV_DISPATCH_H
#define AKV_DISPATCH_H

#include "backend.h"

typedef struct akv_bk {
  const akv_backend_ops *ops;
  void *ctx;
  uint64_t counts[AKV_OP_KIND_COUNT]; /* fallible ops issued, per kind */
  uint64_t counted;                   /* ops that matched the fault filter */
  uint32_t fail_nth;                  /* 0 = never */
  int32_t fail_kind;                  /* -1 = every kind */
  uint64_t injected;                  /* faults injected so far */
  char error[320];                    /* last failure in words */
} akv_bk;

void akv_bk_setup(akv_bk *bk, const akv_backend_ops *ops, uint32_t fail_nth, int32_t fail_kind);
akv_status akv_bk_init(akv_bk *bk, const akv_backend_params *params);
void akv_bk_shutdown(akv_bk *bk);

akv_status akv_bk_host_alloc(akv_bk *bk, size_t bytes, void **out);
void akv_bk_host_free(akv_bk *bk, void *ptr);
akv_status akv_bk_device_alloc(akv_bk *bk, size_t bytes, void **out);
void akv_bk_device_free(akv_bk *bk, void *ptr);
/* Stream-ordered frees on q (see backend.h); NULL ptr is ignored. Without the
 * backend slot, or with q NULL, they free at once like the calls above. */
void akv_bk_device_free_async(akv_bk *bk, void *ptr, akv_bqueue *q);
void akv_bk_host_free_async(akv_bk *bk, void *ptr, akv_bqueue *q);
akv_status akv_bk_queue_create(akv_bk *bk, akv_bqueue **out);
void akv_bk_queue_destroy(akv_bk *bk, akv_bqueue *q);
/* True when the calling thread runs q's work (backend.h, queue_is_current). */
bool akv_bk_queue_is_current(const akv_bk *bk, akv_bqueue *q);
/* True when q holds work that has not run yet (backend.h, queue_pending). */
bool akv_bk_queue_pending(const akv_bk *bk, akv_bqueue *q);
/* True when the calling thread runs a host function of this backend and may
 * make no library call on its engines (backend.h, calls_forbidden). */
bool akv_bk_calls_forbidden(const akv_bk *bk);
akv_status akv_bk_event_create(akv_bk *bk, akv_bevent **out);
void akv_bk_event_destroy(akv_bk *bk, akv_bevent *e);

akv_status akv_bk_record(akv_bk *bk, akv_bevent *e, akv_bqueue *q);
akv_status akv_bk_wait(akv_bk *bk, akv_bqueue *q, akv_bevent *e);
akv_status akv_bk_query(akv_bk *bk, akv_bevent *e, bool *done);
akv_status akv_bk_event_sync(akv_bk *bk, akv_bevent *e);
akv_status akv_bk_queue_sync(akv_bk *bk, akv_bqueue *q);
akv_status akv_bk_device_sync(akv_bk *bk);
akv_status akv_bk_copy(akv_bk *bk, akv_bqueue *q, akv_copy_dir dir, void *dst, const void *src,
                       size_t bytes);
akv_status akv_bk_copy_batch(akv_bk *bk, akv_bqueue *q, akv_copy_dir dir, size_t count,
                             void *const *dst, const void *const *src, const size_t *bytes);
akv_status akv_bk_host_fn(akv_bk *bk, akv_bqueue *q, void (*fn)(void *), void *arg);
akv_status akv_bk_mem_info(akv_bk *bk, uint64_t *free_bytes, uint64_t *total_bytes,
                           uint64_t *peak_used_bytes);

#endif /* AKV_DISPATCH_H */
