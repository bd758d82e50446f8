/*
 * stream.c - compute queues for callers that have none (the host backend's
 * worker threads), and host functions on a caller's stream.
 */
#include "internal.h"

#define AKV_N_STREAMS (sizeof(((akv_engine *)0)->streams) / sizeof(((akv_engine *)0)->streams[0]))

bool akv_stream_known(const akv_engine *e, akv_stream s) {
  if (s == NULL) return false;
  if (e->backend != AKV_BACKEND_HOST) return true;
  for (size_t i = 0; i < AKV_N_STREAMS; i++)
    if (e->streams[i].live && (akv_stream)e->streams[i].queue == s) return true;
  return false;
}

AKV_API akv_status akv_stream_create(akv_engine *e, akv_stream *out) {
  akv_status st = akv_engine_enter(e);
  if (st != AKV_OK) return st;
  if (out == NULL) return akv_fail(e, AKV_ERR_INVALID_ARGUMENT, "stream_create: out is NULL");
  for (size_t i = 0; i < AKV_N_STREAMS; i++) {
    if (e->streams[i].live) continue;
    st = akv_bk_queue_create(&e->bk, &e->streams[i].queue);
    if (st != AKV_OK) return akv_transport_failed(e, st, "stream_create");
    e->streams[i].live = true;
    *out = (akv_stream)e->streams[i].queue;
    return AKV_OK;
  }
  return akv_fail(e, AKV_ERR_OUT_OF_MEMORY, "stream_create: at most %zu streams per engine",
                  AKV_N_STREAMS);
}

/* The layer of an unretired lease whose compute stream is s, or -1. */
static int akv_stream_user(const akv_engine *e, akv_stream s) {
  for (uint32_t l = 0; l < e->cfg.n_dense_layers; l++) {
    const akv_lease_body *ls = &e->leases[l];
    if (ls->stream == s && (ls->state == AKV_LEASE_READY || ls->state == AKV_LEASE_CONSUMED ||
                            ls->state == AKV_LEASE_SEALED))
      return (int)l;
  }
  return -1;
}

AKV_API akv_status akv_stream_destroy(akv_engine *e, akv_stream s) {
  int user;
  if (!akv_engine_ok(e)) return AKV_ERR_BAD_HANDLE;
  if (e->log_depth > 0) return akv_engine_reentered(e, "stream_destroy");
  for (size_t i = 0; i < AKV_N_STREAMS; i++) {
    if (e->streams[i].live && (akv_stream)e->streams[i].queue == s) {
      /* A stream outlives every lease that used it: an unretired lease
       * records on it (mark_consumed) and retire waits on what it recorded
       * there, so every call that takes the lease's stream finds it live.
       * (Quarantine's release counts as a retire.) */
      if ((user = akv_stream_user(e, s)) >= 0)
        return akv_fail(e, AKV_ERR_IN_USE,
                        "stream_destroy: the unretired lease of layer %d used this stream; "
                        "retire it first",
                        user);
      akv_bk_queue_destroy(&e->bk, e->streams[i].queue);
      e->streams[i].live = false;
      e->streams[i].queue = NULL;
      return AKV_OK;
    }
  }
  return akv_fail(e, AKV_ERR_INVALID_ARGUMENT, "stream_destroy: not a stream of this engine");
}

AKV_API akv_status akv_stream_synchronize(akv_engine *e, akv_stream s) {
  akv_status st = akv_engine_enter(e);
  if (st != AKV_OK) return st;
  if (!akv_stream_known(e, s))
    return akv_fail(e, AKV_ERR_INVALID_ARGUMENT,
                    "stream_synchronize: not a live stream of this engine");
  st = akv_bk_queue_sync(&e->bk, (akv_bqueue *)s);
  if (st != AKV_OK) return akv_transport_failed(e, st, "stream_synchronize");
  return AKV_OK;
}

AKV_API akv_status akv_stream_launch_host(akv_engine *e, akv_stream s, void (*fn)(void *),
                                          void *arg) {
  akv_status st = akv_engine_enter(e);
  if (st != AKV_OK) return st;
  if (fn == NULL || !akv_stream_known(e, s))
    return akv_fail(e, AKV_ERR_INVALID_ARGUMENT,
                    "stream_launch_host: NULL function or not a live stream of this engine");
  st = akv_bk_host_fn(&e->bk, (akv_bqueue *)s, fn, arg);
  if (st != AKV_OK) return akv_transport_failed(e, st, "stream_launch_host");
  return AKV_OK;
}
