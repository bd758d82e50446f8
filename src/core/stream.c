/*
 * stream.c - compute queues for callers that have none (the host backend's
 * worker threads), and host functions on a caller's stream.
 */
#include "internal.h"
#include "records.h"

#define AKV_N_STREAMS (sizeof(((akv_engine *)0)->streams) / sizeof(((akv_engine *)0)->streams[0]))

/* Host backend: a stream is known only by the handle this engine gave out
 * and has not destroyed. Handles are records of a never-freed FIFO pool, so
 * a destroyed stream stays refused for at least AKV_STREAM_HANDLE_REUSE_MIN
 * later creates, although its queue's memory may already hold a new queue.
 * Only pointers are compared: a foreign value is never dereferenced. */
akv_bqueue *akv_stream_queue(const akv_engine *e, akv_stream s) {
  if (s == NULL) return NULL;
  if (e->backend != AKV_BACKEND_HOST) {
    /* CUDA: the caller's cudaStream_t, which the library cannot validate;
     * but a handle this library gave out (a host engine's stream, an
     * engine, a context, a lease, a group, a world) is never one, and the
     * CUDA runtime would read that record as its own stream object.
     * Refused by address range alone (records.h: never freed, never
     * dereferenced here). */
    if (akv_rec_any_handle(s)) return NULL;
    return (akv_bqueue *)s;
  }
  for (size_t i = 0; i < AKV_N_STREAMS; i++)
    if (e->streams[i].live && e->streams[i].handle == s) return e->streams[i].queue;
  return NULL;
}

bool akv_engine_on_own_stream(const akv_engine *e) {
  for (size_t i = 0; i < AKV_N_STREAMS; i++)
    if (e->streams[i].live && akv_bk_queue_is_current(&e->bk, e->streams[i].queue)) return true;
  return false;
}

static akv_status akv_stream_create_claimed(akv_engine *e, akv_stream *out) {
  akv_status st = akv_engine_enter(e, "stream_create");
  if (st != AKV_OK) return st;
  if (out == NULL) return akv_fail(e, AKV_ERR_INVALID_ARGUMENT, "stream_create: out is NULL");
  for (size_t i = 0; i < AKV_N_STREAMS; i++) {
    struct akv_stream_handle *h = NULL;
    if (e->streams[i].live) continue;
    if (e->backend == AKV_BACKEND_HOST &&
        (h = akv_rec_take(&akv_stream_records)) == NULL)
      return akv_fail(e, AKV_ERR_OUT_OF_MEMORY, "stream_create: no stream handle record");
    st = akv_bk_queue_create(&e->bk, &e->streams[i].queue);
    if (st != AKV_OK) {
      if (h != NULL) akv_rec_untake(&akv_stream_records, h);
      return akv_transport_failed(e, st, "stream_create");
    }
    if (h != NULL) {
      h->engine = e;
      h->queue = e->streams[i].queue;
      h->magic = h->magic_end = AKV_MAGIC_STREAM;
    }
    e->streams[i].handle = h != NULL ? (akv_stream)h : (akv_stream)e->streams[i].queue;
    e->streams[i].live = true;
    *out = e->streams[i].handle;
    return AKV_OK;
  }
  return akv_fail(e, AKV_ERR_OUT_OF_MEMORY, "stream_create: at most %zu streams per engine",
                  AKV_N_STREAMS);
}

AKV_API akv_status akv_stream_create(akv_engine *e, akv_stream *out) {
  akv_status st = akv_engine_claim(e);
  if (st != AKV_OK) return st;
  st = akv_stream_create_claimed(e, out);
  akv_engine_release(e);
  return st;
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

static akv_status akv_stream_destroy_claimed(akv_engine *e, akv_stream s) {
  int user;
  if (e->log_depth > 0) return akv_engine_reentered(e);
  for (size_t i = 0; i < AKV_N_STREAMS; i++) {
    if (e->streams[i].live && e->streams[i].handle == s) {
      /* A stream outlives every lease that used it: an unretired lease
       * records on it (mark_consumed) and retire waits on what it recorded
       * there, so every call that takes the lease's stream finds it live.
       * (Quarantine's release counts as a retire.) */
      /* Invariant: a queue is never destroyed from its own worker. A
       * function enqueued on the stream (akv_stream_launch_host) that
       * destroys it would drain and join the thread it runs on, then free
       * the queue under itself; refused, the stream stays live. */
      if (akv_bk_queue_is_current(&e->bk, e->streams[i].queue))
        return akv_fail(e, AKV_ERR_IN_USE,
                        "stream_destroy: called from a function running on this stream");
      /* Invariant: a stream function never waits for itself. One running
       * on another stream of this engine that destroys this one would
       * drain it, and this stream may wait, through the engine's queues,
       * for work behind that function (a history-ready wait left by a
       * wait_ready that failed half-way, which no lease names): the drain
       * never ends, the join hangs and the engine stays claimed for good.
       * Refused while this stream has work not yet run; an idle one cannot
       * wait for anything (nothing is enqueued on it while the engine is
       * claimed) and goes at once. */
      if (akv_engine_on_own_stream(e) && akv_bk_queue_pending(&e->bk, e->streams[i].queue))
        return akv_fail(e, AKV_ERR_IN_USE,
                        "stream_destroy: called from a function running on a stream of this "
                        "engine while this stream has work not yet run (it may wait for that "
                        "function)");
      if ((user = akv_stream_user(e, s)) >= 0)
        return akv_fail(e, AKV_ERR_IN_USE,
                        "stream_destroy: the unretired lease of layer %d used this stream; "
                        "retire it first",
                        user);
      akv_bk_queue_destroy(&e->bk, e->streams[i].queue);
      if (e->backend == AKV_BACKEND_HOST) {
        struct akv_stream_handle *h = (struct akv_stream_handle *)s;
        h->magic = h->magic_end = AKV_MAGIC_DEAD;
        h->queue = NULL;
        akv_rec_give(&akv_stream_records, h); /* dead, at the tail of the FIFO */
      }
      e->streams[i].live = false;
      e->streams[i].queue = NULL;
      e->streams[i].handle = NULL;
      return AKV_OK;
    }
  }
  return akv_fail(e, AKV_ERR_INVALID_ARGUMENT, "stream_destroy: not a stream of this engine");
}

AKV_API akv_status akv_stream_destroy(akv_engine *e, akv_stream s) {
  akv_status st = akv_engine_claim(e);
  if (st != AKV_OK) return st;
  st = akv_stream_destroy_claimed(e, s);
  akv_engine_release(e);
  return st;
}

static akv_status akv_stream_synchronize_claimed(akv_engine *e, akv_stream s) {
  akv_status st = akv_engine_enter(e, "stream_synchronize");
  akv_bqueue *q;
  if (st != AKV_OK) return st;
  if ((q = akv_stream_queue(e, s)) == NULL)
    return akv_fail(e, AKV_ERR_INVALID_ARGUMENT,
                    "stream_synchronize: not a live stream of this engine");
  /* Invariant: a queue's worker never waits for its own queue. A function
   * enqueued on a stream (akv_stream_launch_host) that synchronises it
   * would wait for itself until the sync timeout and then fail the
   * transport; so would one that synchronises another stream of the
   * engine, which may wait through the engine's queues for work behind
   * the function (a history-ready event behind a write-back behind an
   * attention event recorded after the function). A function must not
   * synchronise (akv.h): refused from any stream of the engine, nothing
   * changes. */
  if (akv_engine_on_own_stream(e))
    return akv_fail(e, AKV_ERR_IN_USE,
                    "stream_synchronize: called from a function running on a stream of this "
                    "engine");
  st = akv_bk_queue_sync(&e->bk, q);
  if (st != AKV_OK) return akv_transport_failed(e, st, "stream_synchronize");
  return AKV_OK;
}

AKV_API akv_status akv_stream_synchronize(akv_engine *e, akv_stream s) {
  akv_status st = akv_engine_claim(e);
  if (st != AKV_OK) return st;
  st = akv_stream_synchronize_claimed(e, s);
  akv_engine_release(e);
  return st;
}

static akv_status akv_stream_launch_host_claimed(akv_engine *e, akv_stream s, void (*fn)(void *),
                                                 void *arg) {
  akv_status st = akv_engine_enter(e, "stream_launch_host");
  akv_bqueue *q;
  if (st != AKV_OK) return st;
  if (fn == NULL || (q = akv_stream_queue(e, s)) == NULL)
    return akv_fail(e, AKV_ERR_INVALID_ARGUMENT,
                    "stream_launch_host: NULL function or not a live stream of this engine");
  st = akv_bk_host_fn(&e->bk, q, fn, arg);
  /* Invariant: a queue's worker never waits for its own operation. A
   * function on a stream that launches onto a full ring it waits for (its
   * own stream's, or another stream's whose worker waits, through the
   * engine's queues, for work behind the function) would wait for itself;
   * the backend refuses that launch at once, nothing enqueued, and so
   * nothing of the engine failed: refused, not a transport failure (which
   * closed the engine over a launch that never happened). */
  if (st == AKV_ERR_IN_USE)
    return akv_fail(e, AKV_ERR_IN_USE,
                    "stream_launch_host: called from a function running on a stream of this "
                    "engine while the target's ring is full and waits for that function (it "
                    "would wait for itself); nothing enqueued");
  if (st != AKV_OK) return akv_transport_failed(e, st, "stream_launch_host");
  return AKV_OK;
}

AKV_API akv_status akv_stream_launch_host(akv_engine *e, akv_stream s, void (*fn)(void *),
                                          void *arg) {
  akv_status st = akv_engine_claim(e);
  if (st != AKV_OK) return st;
  st = akv_stream_launch_host_claimed(e, s, fn, arg);
  akv_engine_release(e);
  return st;
}
