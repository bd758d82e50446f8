/*
 * backend.c - the dispatcher in front of every backend (see dispatch.h).
 */
#include <stdio.h>
#include <string.h>

#include "dispatch.h"

void akv_bk_setup(akv_bk *bk, const akv_backend_ops *ops, uint32_t fail_nth, int32_t fail_kind) {
  memset(bk, 0, sizeof(*bk));
  bk->ops = ops;
  bk->fail_nth = fail_nth;
  bk->fail_kind = fail_kind;
}

/* Counts one fallible operation of `kind`; returns nonzero when the fault
 * injector wants it failed. */
static int akv_bk_count(akv_bk *bk, akv_op_kind kind, const char *what) {
  bk->counts[kind]++;
  if (bk->fail_kind >= 0 && (akv_op_kind)bk->fail_kind != kind) return 0;
  bk->counted++;
  if (bk->fail_nth != 0 && bk->counted == bk->fail_nth) {
    bk->injected++;
    snprintf(bk->error, sizeof(bk->error), "injected fault: %s (operation %llu)", what,
             (unsigned long long)bk->counted);
    return 1;
  }
  return 0;
}

static akv_status akv_bk_result(akv_bk *bk, akv_status st, const char *what) {
  if (st != AKV_OK) {
    const char *detail = bk->ops->error_detail != NULL && bk->ctx != NULL
                             ? bk->ops->error_detail(bk->ctx)
                             : NULL;
    snprintf(bk->error, sizeof(bk->error), "%s backend: %s failed (%s)%s%s", bk->ops->name, what,
             akv_status_string(st), detail != NULL ? ": " : "", detail != NULL ? detail : "");
  }
  return st;
}

#define AKV_BK_OP(bk, kind, what, call)                             \
  do {                                                              \
    if (akv_bk_count((bk), (kind), (what))) return AKV_ERR_BACKEND; \
    return akv_bk_result((bk), (call), (what));                     \
  } while (0)

akv_status akv_bk_init(akv_bk *bk, const akv_backend_params *params) {
  AKV_BK_OP(bk, AKV_OP_ALLOC, "backend init", bk->ops->init(params, &bk->ctx));
}

void akv_bk_shutdown(akv_bk *bk) {
  if (bk->ctx != NULL) bk->ops->shutdown(bk->ctx);
  bk->ctx = NULL;
}

akv_status akv_bk_host_alloc(akv_bk *bk, size_t bytes, void **out) {
  if (akv_bk_count(bk, AKV_OP_ALLOC, "pinned host allocation")) return AKV_ERR_OUT_OF_MEMORY;
  return akv_bk_result(bk, bk->ops->host_alloc(bk->ctx, bytes, out), "pinned host allocation");
}

void akv_bk_host_free(akv_bk *bk, void *ptr) {
  if (ptr != NULL) bk->ops->host_free(bk->ctx, ptr);
}

akv_status akv_bk_device_alloc(akv_bk *bk, size_t bytes, void **out) {
  if (akv_bk_count(bk, AKV_OP_ALLOC, "device allocation")) return AKV_ERR_OUT_OF_MEMORY;
  return akv_bk_result(bk, bk->ops->device_alloc(bk->ctx, bytes, out), "device allocation");
}

void akv_bk_device_free(akv_bk *bk, void *ptr) {
  if (ptr != NULL) bk->ops->device_free(bk->ctx, ptr);
}

void akv_bk_device_free_async(akv_bk *bk, void *ptr, akv_bqueue *q) {
  if (ptr == NULL) return;
  if (q != NULL && bk->ops->device_free_async != NULL)
    bk->ops->device_free_async(bk->ctx, ptr, q);
  else
    bk->ops->device_free(bk->ctx, ptr);
}

void akv_bk_host_free_async(akv_bk *bk, void *ptr, akv_bqueue *q) {
  if (ptr == NULL) return;
  if (q != NULL && bk->ops->host_free_async != NULL)
    bk->ops->host_free_async(bk->ctx, ptr, q);
  else
    bk->ops->host_free(bk->ctx, ptr);
}

akv_status akv_bk_queue_create(akv_bk *bk, akv_bqueue **out) {
  AKV_BK_OP(bk, AKV_OP_ALLOC, "queue create", bk->ops->queue_create(bk->ctx, out));
}

void akv_bk_queue_destroy(akv_bk *bk, akv_bqueue *q) {
  if (q != NULL) bk->ops->queue_destroy(bk->ctx, q);
}

bool akv_bk_queue_is_current(const akv_bk *bk, akv_bqueue *q) {
  return q != NULL && bk->ops->queue_is_current != NULL && bk->ops->queue_is_current(bk->ctx, q);
}

bool akv_bk_queue_pending(const akv_bk *bk, akv_bqueue *q) {
  return q != NULL && bk->ops->queue_pending != NULL && bk->ops->queue_pending(bk->ctx, q);
}

bool akv_bk_calls_forbidden(const akv_bk *bk) {
  return bk->ops != NULL && bk->ops->calls_forbidden != NULL && bk->ops->calls_forbidden();
}

akv_status akv_bk_event_create(akv_bk *bk, akv_bevent **out) {
  AKV_BK_OP(bk, AKV_OP_ALLOC, "event create", bk->ops->event_create(bk->ctx, out));
}

void akv_bk_event_destroy(akv_bk *bk, akv_bevent *e) {
  if (e != NULL) bk->ops->event_destroy(bk->ctx, e);
}

akv_status akv_bk_record(akv_bk *bk, akv_bevent *e, akv_bqueue *q) {
  AKV_BK_OP(bk, AKV_OP_RECORD, "event record", bk->ops->event_record(bk->ctx, e, q));
}

akv_status akv_bk_wait(akv_bk *bk, akv_bqueue *q, akv_bevent *e) {
  AKV_BK_OP(bk, AKV_OP_WAIT, "queue wait", bk->ops->queue_wait(bk->ctx, q, e));
}

akv_status akv_bk_query(akv_bk *bk, akv_bevent *e, bool *done) {
  AKV_BK_OP(bk, AKV_OP_QUERY, "event query", bk->ops->event_query(bk->ctx, e, done));
}

akv_status akv_bk_event_sync(akv_bk *bk, akv_bevent *e) {
  AKV_BK_OP(bk, AKV_OP_SYNC, "event synchronize", bk->ops->event_synchronize(bk->ctx, e));
}

akv_status akv_bk_queue_sync(akv_bk *bk, akv_bqueue *q) {
  AKV_BK_OP(bk, AKV_OP_SYNC, "queue synchronize", bk->ops->queue_synchronize(bk->ctx, q));
}

akv_status akv_bk_device_sync(akv_bk *bk) {
  AKV_BK_OP(bk, AKV_OP_SYNC, "device synchronize", bk->ops->device_synchronize(bk->ctx));
}

akv_status akv_bk_copy(akv_bk *bk, akv_bqueue *q, akv_copy_dir dir, void *dst, const void *src,
                       size_t bytes) {
  AKV_BK_OP(bk, AKV_OP_COPY, "copy", bk->ops->copy(bk->ctx, q, dir, dst, src, bytes));
}

/* A batch counts as one operation; without a batch slot it is a loop of
 * copies, still counted once (it is one submission to the caller). */
akv_status akv_bk_copy_batch(akv_bk *bk, akv_bqueue *q, akv_copy_dir dir, size_t count,
                             void *const *dst, const void *const *src, const size_t *bytes) {
  akv_status st = AKV_OK;
  if (count == 0) return AKV_OK;
  if (akv_bk_count(bk, AKV_OP_COPY, "batched copy")) return AKV_ERR_BACKEND;
  if (bk->ops->copy_batch != NULL && count > 1)
    return akv_bk_result(bk, bk->ops->copy_batch(bk->ctx, q, dir, count, dst, src, bytes),
                         "batched copy");
  for (size_t i = 0; i < count && st == AKV_OK; i++)
    st = bk->ops->copy(bk->ctx, q, dir, dst[i], src[i], bytes[i]);
  return akv_bk_result(bk, st, "batched copy");
}

akv_status akv_bk_host_fn(akv_bk *bk, akv_bqueue *q, void (*fn)(void *), void *arg) {
  AKV_BK_OP(bk, AKV_OP_HOSTFN, "host function", bk->ops->host_fn(bk->ctx, q, fn, arg));
}

akv_status akv_bk_mem_info(akv_bk *bk, uint64_t *free_bytes, uint64_t *total_bytes,
                           uint64_t *peak_used_bytes) {
  if (bk->ops->mem_info == NULL || bk->ctx == NULL) {
    *free_bytes = *total_bytes = *peak_used_bytes = 0;
    return AKV_ERR_NOT_SUPPORTED;
  }
  return bk->ops->mem_info(bk->ctx, free_bytes, total_bytes, peak_used_bytes);
}
