/*
 * engine.c - engine lifetime: create (every allocation the engine will ever
 * make), destroy (never waits), diagnostics and quarantine (DESIGN §7).
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config.h"
#include "fit.h"
#include "internal.h"
#include "plan.h"
#include "records.h"
#ifdef AKV_WITH_CUDA
#include "backend_cuda.h" /* C declarations only, no CUDA header */
#endif

const char *akv_route_name(akv_route r) {
  switch (r) {
    case AKV_ROUTE_STAGE: return "stage";
    case AKV_ROUTE_ARENA: return "arena";
    case AKV_ROUTE_PAGED: return "paged";
    default: return "unknown";
  }
}

/* Atomic loads: a thread that has not claimed the engine reads the magic
 * (akv_engine_claim), while the owner may be poisoning it (destroy). */
bool akv_engine_ok(const akv_engine *e) {
  return e != NULL && AKV_LOAD(e->magic) == AKV_MAGIC_ENGINE &&
         AKV_LOAD(e->magic_end) == AKV_MAGIC_ENGINE;
}

static void akv_engine_poison(akv_engine *e) {
  AKV_STORE(e->magic, AKV_MAGIC_DEAD);
  AKV_STORE(e->magic_end, AKV_MAGIC_DEAD);
}

bool akv_engine_forked(const akv_engine *e) {
  return akv_rec_forked(&e->fork_gen);
}

/* Invariant: at most one thread is inside the calls of an engine (akv.h,
 * Thread safety), as for a group (akv_group_claim, whose rules these are).
 * Every public call that takes an engine, or a handle that belongs to one
 * (context, lease; a stream is passed with its engine), claims the engine
 * once the handle is checked and releases it on every return; the thread
 * already inside may claim again (calls from an attention hook of
 * akv_lease_attend, from the log callback, and the library's own calls to
 * its public functions: akv_context_open's akv_admission_explain, a group's
 * calls on its engine); any other thread is refused with AKV_ERR_IN_USE,
 * having read only the record's magic and written nothing of the engine: no
 * last error, no log line, no counter. Without this a second thread's call
 * ran, unlocked, on the state the first one was changing (lease states, slot
 * tables, counters, the last error), and a destroy freed the host pool under
 * another thread's akv_context_read. The claim never waits, so it cannot
 * deadlock, also where the caller's code runs on a worker thread
 * (akv_stream_launch_host, whose function gets AKV_ERR_IN_USE while a call
 * is in progress). The record is read as a live engine before its owner word
 * is written (records are never freed) and checked again once claimed: a
 * destroy poisons it before it releases the engine. Cost: one
 * compare-exchange and one store on the engine per outermost call (nested calls only
 * count their depth), plus the thread's own cancel state, twice (measured:
 * about 5 ns and 7 ns a call). Handles are told apart by their magic words
 * alone, as before: the records' address ranges (akv_rec_owns) take a
 * process-wide mutex, too dear on the hot path. */
akv_status akv_engine_claim(const akv_engine *ce) {
  akv_engine *e = (akv_engine *)ce; /* a record: only the claim words are written */
  const void *me = akv_rec_thread(), *none = NULL; /* never another thread's */
  if (!akv_engine_ok(e)) return AKV_ERR_BAD_HANDLE;
  /* Invariant: a forked child never runs a call on an engine of its parent
   * (akv.h, fork). The engine's queue threads stayed in the parent: a step
   * there waited for queues that never run, and a destroy joined threads
   * the child does not have. Such a handle is no handle of this process. */
  if (akv_engine_forked(e)) return AKV_ERR_BAD_HANDLE;
  if (!atomic_compare_exchange_strong(&e->owner, &none, me) && none != me) return AKV_ERR_IN_USE;
  /* Invariant: an engine call is not a cancellation point (see
   * akv_group_claim). A thread cancelled inside one (in a wait of retire,
   * synchronize or quarantine, or in the log callback's write) left the
   * engine midway through a change and claimed by a dead thread, so every
   * other thread was refused for good. Cancellation is off from the
   * outermost claim to its release; a pending cancel acts at the caller's
   * next cancellation point after the call returned. */
  if (e->depth++ == 0) pthread_setcancelstate(PTHREAD_CANCEL_DISABLE, &e->cancel_state);
  if (!akv_engine_ok(e)) {
    akv_engine_release(e);
    return AKV_ERR_BAD_HANDLE;
  }
  /* Invariant: no engine call runs inside a host function of a backend
   * whose runtime may not be called there (CUDA: a function enqueued with
   * akv_stream_launch_host runs on a CUDA runtime thread, where CUDA calls
   * are not permitted; every engine call makes them or may). Checked once
   * claimed, so the engine's backend cannot be torn down under the check;
   * refused as any call the claim refuses: nothing written. */
  if (akv_bk_calls_forbidden(&e->bk)) {
    akv_engine_release(e);
    return AKV_ERR_IN_USE;
  }
  return AKV_OK;
}

void akv_engine_release(const akv_engine *ce) {
  akv_engine *e = (akv_engine *)ce;
  if (--e->depth == 0) {
    const int cancel = e->cancel_state;
    const bool give = e->give_on_release;
    e->give_on_release = false;
    /* A release store (the claim's compare-exchange acquires): everything
     * this call wrote is seen by the next thread to claim the engine. */
    atomic_store_explicit(&e->owner, NULL, memory_order_release);
    pthread_setcancelstate(cancel, NULL);
    /* A record destroyed by a nested call goes back to its pool now, its
     * claim released (akv_engine_give). */
    if (give) akv_rec_give(&akv_engine_records, e);
  }
}

/* A record just taken from the pool, dead, is claimed before it is made
 * live, so no thread holding a stale handle to it (a destroyed engine's:
 * "Handle lifetimes") reaches it half-built: such a thread is refused
 * (AKV_ERR_IN_USE) until create returns. Its owner word may be held a
 * moment by such a thread that read the magic live before the destroy and
 * claims after it (it finds the magic dead and lets go at once); never for
 * longer, as a record is back in the pool only with its claim released
 * (akv_engine_give: a destroy nested in a hook's attend gives the record
 * back when that attend returns). */
static void akv_engine_claim_record(akv_engine *e) {
  akv_rec_owner_wait(&e->owner, akv_rec_thread());
  if (e->depth++ == 0) pthread_setcancelstate(PTHREAD_CANCEL_DISABLE, &e->cancel_state);
}

/* Engine serials come from one process-wide counter (as fence serials do,
 * lease.c): a serial names one engine for the life of the process, so it
 * tells a destroyed engine from a newer one on the same record. Never 0
 * (the serial of a record no engine holds). */
static _Atomic uint64_t akv_engine_serials;

uint64_t akv_engine_serial(const akv_engine *e) {
  /* Read without the claim (a group checks its engine with it): atomic, as
   * destroy's store of 0. */
  return akv_engine_ok(e) ? __atomic_load_n(&e->serial, __ATOMIC_RELAXED) : 0;
}

akv_status akv_engine_reentered(akv_engine *e) {
  if (e->log_depth == 0) return AKV_OK;
  /* Invariant (akv.h, akv_log_fn): a call refused here changes nothing, the
   * last error included: it is the error being logged, which the callback
   * and then the caller of the logging call read. Not through akv_fail
   * either: that would log, and so call the callback again. */
  return AKV_ERR_IN_USE;
}

/* Invariant (akv.h, Conventions: a refusal's last error names the call):
 * every refusal after a transport failure says which call it refused. */
akv_status akv_engine_enter(akv_engine *e, const char *call) {
  if (e->log_depth > 0) return akv_engine_reentered(e);
  if (e->transport_failed)
    return akv_fail(e, AKV_ERR_QUARANTINED,
                    "%s: transport failed earlier; only diagnostics, quarantine and destroy "
                    "are accepted",
                    call);
  return AKV_OK;
}

akv_status akv_transport_failed(akv_engine *e, akv_status st, const char *where) {
  e->transport_failed = true;
  akv_fail(e, AKV_ERR_BACKEND, "%s: %s (%s); transport marked failed", where, e->bk.error,
           akv_status_string(st));
  akv_log(e, AKV_LOG_ERROR, "%s", e->last_error);
  return AKV_ERR_BACKEND;
}

AKV_API akv_status akv_engine_config_init(akv_engine_config *config) {
  static const akv_engine_config init = AKV_ENGINE_CONFIG_INIT;
  if (config == NULL) return AKV_ERR_INVALID_ARGUMENT;
  *config = init;
  return AKV_OK;
}

static const akv_backend_ops *akv_pick_backend(const akv_engine_config *cfg,
                                               const akv_backend_params *params,
                                               akv_status *st) {
  *st = AKV_OK;
#ifdef AKV_WITH_CUDA
  if (cfg->backend == AKV_BACKEND_CUDA || cfg->backend == AKV_BACKEND_AUTO) {
    if (akv_backend_cuda_ops.probe(params) == AKV_OK) return &akv_backend_cuda_ops;
    if (cfg->backend == AKV_BACKEND_CUDA) {
      *st = AKV_ERR_NOT_SUPPORTED;
      return NULL;
    }
    akv_log_cfg(cfg, AKV_LOG_INFO, "no usable CUDA device: falling back to the host backend");
  }
#else
  if (cfg->backend == AKV_BACKEND_CUDA) {
    *st = AKV_ERR_NOT_SUPPORTED;
    return NULL;
  }
#endif
  (void)params;
  return &akv_backend_host_ops;
}

/* Frees everything the engine allocated and poisons every handle record it
 * holds: its open contexts, its lease handles and itself. The records go
 * back to their pools, never to free(); the engine's own record goes back
 * in akv_engine_give, once its claim is released. */
static void akv_engine_free_all(akv_engine *e) {
  akv_bk *bk = &e->bk;
  if (e->slot_owner != NULL)
    for (uint32_t i = 0; i < e->concurrency; i++) {
      akv_context *c = e->slot_owner[i];
      if (c == NULL) continue;
      AKV_STORE(c->open, false);
      AKV_STORE(c->magic, AKV_MAGIC_DEAD);
      AKV_STORE(c->magic_end, AKV_MAGIC_DEAD);
      akv_rec_give(&akv_context_records, c);
    }
  if (e->contexts_reserved) akv_rec_unreserve(&akv_context_records, e->concurrency);
  if (e->lease_recs != NULL)
    for (uint32_t i = 0; i < e->n_lease_recs; i++) {
      if (e->lease_recs[i] == NULL) continue;
      AKV_STORE(e->lease_recs[i]->magic, AKV_MAGIC_DEAD);
      AKV_STORE(e->lease_recs[i]->magic_end, AKV_MAGIC_DEAD);
      akv_rec_give(&akv_lease_records, e->lease_recs[i]);
    }
  if (e->leases != NULL) {
    for (uint32_t l = 0; l < e->cfg.n_dense_layers; l++) {
      akv_lease_body *ls = &e->leases[l];
      akv_bk_event_destroy(bk, ls->ev_h2d);
      akv_bk_event_destroy(bk, ls->ev_d2d);
      akv_bk_event_destroy(bk, ls->ev_attn);
      akv_bk_event_destroy(bk, ls->ev_tail);
      free(ls->contexts);
      free(ls->len);
      free(ls->generation);
      free(ls->written);
      free(ls->tickets);
    }
  }
  akv_bk_event_destroy(bk, e->ev_fill);
  /* Teardown waits on nothing of the caller's (DESIGN §7). Enforced here:
   * destroy runs only with every lease retired and no step open, or after a
   * quarantine that established completion, so every reader and writer of
   * this memory is proven complete and the engine's queues hold no work.
   * The memory therefore goes back in the order of the engine's own H2D
   * queue (stream-ordered frees: cudaFreeAsync on CUDA), never through
   * cudaFree / cudaFreeHost, which would wait until the whole device is
   * idle, the caller's kernels included. Destroying the queues right after
   * is allowed: the frees still run. Without the queue (a create that
   * failed before making it) the frees are immediate. */
  for (int b = 0; b < AKV_N_BUFFERS; b++) akv_bk_device_free_async(bk, e->staging[b], e->q_h2d);
  akv_bk_device_free_async(bk, e->dev_pool, e->q_h2d);
  akv_bk_device_free_async(bk, e->page_map_dev, e->q_h2d);
  akv_bk_device_free_async(bk, e->poison, e->q_h2d);
  akv_bk_host_free_async(bk, e->page_map_host, e->q_h2d);
  akv_bk_host_free_async(bk, e->host_pool, e->q_h2d);
  akv_headroom_free_all(e); /* its chunks the same way, on the H2D queue */
  /* Host backend: each queue_destroy joins the queue's worker thread. The
   * engine's queues are idle (see above), so the join waits for no caller
   * work, only for the engine's own three workers to run the frees above
   * and exit: the one documented exception (akv_engine_destroy in akv.h,
   * measured in docs/api.md). CUDA: cudaStreamDestroy returns at once. */
  akv_bk_queue_destroy(bk, e->q_h2d);
  akv_bk_queue_destroy(bk, e->q_d2h);
  akv_bk_queue_destroy(bk, e->q_d2d);
  akv_bk_shutdown(bk);
  akv_adm_destroy(e->adm);
  free(e->leases);
  free(e->lease_recs);
  free(e->lease_ring);
  free(e->slot_owner);
  free(e->slot_generation);
  free(e->slot_layer_len);
  free(e->step_ctx);
  free(e->adm_req);
  akv_scratch *scratch[] = {&e->sc_stage, &e->sc_mat, &e->sc_wb, &e->sc_fill};
  for (size_t i = 0; i < sizeof scratch / sizeof scratch[0]; i++) {
    free(scratch[i]->dst);
    free(scratch[i]->src);
    free(scratch[i]->bytes);
  }
  akv_engine_poison(e);
  /* names no engine: a stale serial never matches (plan.h) */
  __atomic_store_n(&e->serial, 0, __ATOMIC_RELAXED);
}

/* Poisoned before it is released: a thread that claims it next sees a dead
 * engine (akv_engine_claim). Then back to its pool: `created` puts the
 * record at the tail of its FIFO (a destroy), otherwise back at the head (a
 * create that failed, which then does not count against the reuse bound). */
static void akv_engine_give(akv_engine *e, bool created) {
  /* Invariant: a record is back in its pool only with its claim released
   * (owner NULL, depth 0), so the create that takes it next never waits on
   * it (akv_engine_claim_record). A destroy nested in another call on the
   * engine (from an attention hook) leaves the claim to that outer call, so
   * the record goes back at the outer call's release. Given back at once,
   * it waited in the pool still claimed, and a hook that never returned to
   * its attend (longjmp) kept it claimed for good: the create on another
   * thread that was handed it later waited for ever. */
  if (created && e->depth > 1) {
    e->give_on_release = true;
    akv_engine_release(e);
    return;
  }
  akv_engine_release(e);
  if (created)
    akv_rec_give(&akv_engine_records, e);
  else
    akv_rec_untake(&akv_engine_records, e);
}

/* The child's side of an akv_engine_create whose log callback forked once
 * the engine's queue threads had started (from akv_engine_allocate on).
 * Invariant (akv.h, fork): those threads are the parent's, so in the child
 * the engine is one of the parent's: never handed out (it returned AKV_OK
 * with a handle every call refused, destroy included), never freed (the
 * free joins the queue threads, which are not here: it would wait for
 * ever) and its record never back in the pool; the child's copy of its
 * memory goes with the child. Only the claim is let go. */
static akv_status akv_engine_create_forked(akv_engine *e) {
  akv_engine_release(e);
  return AKV_ERR_BAD_HANDLE;
}

static akv_status akv_alloc_lease_arrays(akv_engine *e, akv_lease_body *ls, uint32_t layer) {
  uint32_t n = e->concurrency;
  ls->engine = e;
  ls->layer = layer;
  ls->buffer = layer % AKV_N_BUFFERS;
  ls->contexts = calloc(n, sizeof(*ls->contexts));
  ls->len = calloc(n, sizeof(*ls->len));
  ls->generation = calloc(n, sizeof(*ls->generation));
  ls->written = calloc(n, sizeof(*ls->written));
  ls->tickets = calloc((size_t)3 * n, sizeof(*ls->tickets));
  if (!ls->contexts || !ls->len || !ls->generation || !ls->written || !ls->tickets)
    return AKV_ERR_OUT_OF_MEMORY;
  return AKV_OK;
}

/* Allocates a scratch of `cap` entries (at least one). */
static bool akv_scratch_alloc(akv_scratch *sc, uint64_t cap) {
  sc->cap = (size_t)(cap > 0 ? cap : 1); /* cap fits size_t: akv_budget_compute */
  sc->dst = calloc(sc->cap, sizeof(*sc->dst));
  sc->src = calloc(sc->cap, sizeof(*sc->src));
  sc->bytes = calloc(sc->cap, sizeof(*sc->bytes));
  return sc->dst != NULL && sc->src != NULL && sc->bytes != NULL;
}

static akv_status akv_engine_allocate(akv_engine *e) {
  akv_status st = AKV_OK;
  akv_bk *bk = &e->bk;
  const akv_engine_config *c = &e->cfg;
  uint32_t n = e->concurrency;
  akv_backend_params params = {c->device_ordinal, c->host_delay_seed, c->host_delay_max_us,
                               c->host_fake_free_bytes};

  st = akv_bk_init(bk, &params);
  if (st != AKV_OK) {
    akv_fail(e, st, "backend %s failed to start: %s", bk->ops->name, bk->error);
    goto fail;
  }
  if ((st = akv_bk_queue_create(bk, &e->q_h2d)) != AKV_OK ||
      (st = akv_bk_queue_create(bk, &e->q_d2h)) != AKV_OK ||
      (st = akv_bk_queue_create(bk, &e->q_d2d)) != AKV_OK ||
      (st = akv_bk_event_create(bk, &e->ev_fill)) != AKV_OK) {
    akv_fail(e, st, "queue/event creation failed: %s", bk->error);
    goto fail;
  }
  /* The pools and staging buffers first: a geometry larger than the
   * machine fails there, cleanly, before any bookkeeping sized from it is
   * allocated and initialised (that bookkeeping is bounded by the pools:
   * budget.h). */
  e->host_pool_bytes = (uint64_t)c->host_pool_gib * AKV_GIB;
  st = akv_bk_host_alloc(bk, e->host_pool_bytes, (void **)&e->host_pool);
  if (st != AKV_OK) {
    akv_fail(e, st, "pinned host pool of %u GiB could not be allocated (host_pool_gib): %s",
             c->host_pool_gib, bk->error);
    goto fail;
  }
  if (c->route != AKV_ROUTE_STAGE && c->device_pool_gib > 0) {
    e->dev_pool_bytes = (uint64_t)c->device_pool_gib * AKV_GIB;
    st = akv_bk_device_alloc(bk, e->dev_pool_bytes, (void **)&e->dev_pool);
    if (st != AKV_OK) {
      akv_fail(e, st, "device pool of %u GiB could not be allocated (device_pool_gib): %s",
               c->device_pool_gib, bk->error);
      goto fail;
    }
    e->device_allocated += e->dev_pool_bytes;
  }
  e->staging_bytes = (uint64_t)n * e->seg_bytes;
  for (int b = 0; b < AKV_N_BUFFERS; b++) {
    st = akv_bk_device_alloc(bk, e->staging_bytes, (void **)&e->staging[b]);
    if (st != AKV_OK) {
      akv_fail(e, st, "staging buffer of %llu bytes could not be allocated: %s",
               (unsigned long long)e->staging_bytes, bk->error);
      goto fail;
    }
    e->device_allocated += e->staging_bytes;
  }
  e->slot_owner = calloc(n, sizeof(*e->slot_owner));
  e->slot_generation = calloc(n, sizeof(*e->slot_generation));
  e->slot_layer_len = calloc((size_t)n * c->n_dense_layers, sizeof(*e->slot_layer_len));
  e->step_ctx = calloc(n, sizeof(*e->step_ctx));
  e->adm_req = calloc(n, sizeof(*e->adm_req));
  e->leases = calloc(c->n_dense_layers, sizeof(*e->leases));
  e->n_lease_recs = c->n_dense_layers * AKV_LEASE_HANDLES_PER_LAYER;
  e->lease_recs = calloc(e->n_lease_recs, sizeof(*e->lease_recs));
  e->lease_ring = calloc(e->n_lease_recs, sizeof(*e->lease_ring));
  /* Scratch: one buffer, one owner, each sized from its own worst case
   * (budget.h states each bound and why it holds). */
  bool scratch_ok = akv_scratch_alloc(&e->sc_stage, e->budget.sc_stage) &&
                    akv_scratch_alloc(&e->sc_mat, e->budget.sc_mat) &&
                    akv_scratch_alloc(&e->sc_wb, e->budget.sc_wb) &&
                    akv_scratch_alloc(&e->sc_fill, e->budget.sc_fill);
  if (!e->slot_owner || !e->slot_generation || !e->slot_layer_len || !e->step_ctx ||
      !e->adm_req || !e->leases || !e->lease_recs || !e->lease_ring || !scratch_ok) {
    st = akv_fail(e, AKV_ERR_OUT_OF_MEMORY, "engine bookkeeping allocation failed");
    goto fail;
  }
  /* Handle records: every context this engine can hold open at once, and
   * its lease handles, so that open and begin never allocate. */
  if ((st = akv_rec_reserve(&akv_context_records, n)) != AKV_OK) {
    akv_fail(e, st, "context handle records could not be reserved");
    goto fail;
  }
  e->contexts_reserved = true;
  for (uint32_t i = 0; i < e->n_lease_recs; i++) {
    e->lease_recs[i] = akv_rec_take(&akv_lease_records);
    if (e->lease_recs[i] == NULL) {
      st = akv_fail(e, AKV_ERR_OUT_OF_MEMORY, "lease handle records could not be allocated");
      goto fail;
    }
    AKV_STORE(e->lease_recs[i]->engine, e); /* a dead record: its magic is poisoned */
    e->lease_ring[i] = e->lease_recs[i];
  }
  e->lease_head = 0;
  e->lease_free = e->n_lease_recs;
  for (uint32_t l = 0; l < c->n_dense_layers; l++) {
    st = akv_alloc_lease_arrays(e, &e->leases[l], l);
    if (st != AKV_OK) {
      akv_fail(e, st, "lease bookkeeping allocation failed");
      goto fail;
    }
  }
  for (uint32_t l = 0; l < c->n_dense_layers; l++) {
    akv_lease_body *ls = &e->leases[l];
    if ((st = akv_bk_event_create(bk, &ls->ev_h2d)) != AKV_OK ||
        (st = akv_bk_event_create(bk, &ls->ev_d2d)) != AKV_OK ||
        (st = akv_bk_event_create(bk, &ls->ev_attn)) != AKV_OK ||
        (st = akv_bk_event_create(bk, &ls->ev_tail)) != AKV_OK) {
      akv_fail(e, st, "event creation failed: %s", bk->error);
      goto fail;
    }
  }

  if (c->route == AKV_ROUTE_PAGED && e->budget.page_map_bytes > 0) {
    /* The step's page map: rebuilt in pinned memory at each boundary and
     * copied to the device on the H2D queue ahead of the step's leases. */
    e->page_map_bytes = e->budget.page_map_bytes; /* n x max_logical_pages entries, checked */
    st = akv_bk_host_alloc(bk, e->page_map_bytes, (void **)&e->page_map_host);
    if (st == AKV_OK) st = akv_bk_device_alloc(bk, e->page_map_bytes, (void **)&e->page_map_dev);
    if (st != AKV_OK) {
      akv_fail(e, st, "page map of %llu bytes could not be allocated: %s",
               (unsigned long long)e->page_map_bytes, bk->error);
      goto fail;
    }
    e->device_allocated += e->page_map_bytes;
    if (c->poison_holes) {
      /* One page-layer of 0xFF bytes on the device, the source of every
       * poison copy: filled once here from pinned memory. */
      uint8_t *fill = NULL;
      st = akv_bk_device_alloc(bk, e->page_seg_bytes, (void **)&e->poison);
      if (st == AKV_OK) st = akv_bk_host_alloc(bk, e->page_seg_bytes, (void **)&fill);
      if (st == AKV_OK) {
        memset(fill, 0xFF, e->page_seg_bytes);
        st = akv_bk_copy(bk, e->q_h2d, AKV_COPY_H2D, e->poison, fill, e->page_seg_bytes);
        if (st == AKV_OK) st = akv_bk_queue_sync(bk, e->q_h2d);
      }
      /* In the H2D queue's order: behind the copy that reads it, also when
       * the synchronise above failed (no device-wide wait either way). */
      akv_bk_host_free_async(bk, fill, e->q_h2d);
      if (st != AKV_OK) {
        akv_fail(e, st, "poison page could not be prepared: %s", bk->error);
        goto fail;
      }
      e->device_allocated += e->page_seg_bytes;
    }
  }
  /* Headroom is profiled after every other device allocation of the engine. */
  if ((st = akv_headroom_setup(e)) != AKV_OK) goto fail;
  {
    /* Without device pages nothing is ever resident: the map tracks one
     * logical page per slot (budget.h, tracked_pages). */
    akv_adm_config ac = {e->n_pages, n, e->budget.tracked_pages, AKV_ADM_LOG_ENTRIES,
                         e->hr_max_pages};
    st = akv_adm_create(&ac, &e->adm);
    if (st != AKV_OK) {
      akv_fail(e, st, "admission allocator creation failed");
      goto fail;
    }
  }
  if ((st = akv_headroom_start(e)) != AKV_OK) goto fail;
  return AKV_OK;
fail:
  return st;
}

AKV_API akv_status akv_engine_create(const akv_engine_config *caller, akv_engine **out) {
  akv_status st = AKV_OK;
  akv_engine *e = NULL;
  akv_fit_report fit;
  char why[1024] = "";
  akv_engine_config full = AKV_ENGINE_CONFIG_INIT;
  const akv_engine_config *config = &full;

  if (caller == NULL || out == NULL) return AKV_ERR_INVALID_ARGUMENT;
  /* An older caller's smaller struct: its fields, then the defaults. */
  st = akv_config_merge(&akv_engine_config_layout, &full, caller, why, sizeof(why));
  if (st == AKV_OK) st = akv_fit_compute(config, &fit, why, sizeof(why));
  if (st != AKV_OK) {
    akv_log_cfg(config, AKV_LOG_ERROR, "engine config rejected: %s", why);
    return st;
  }
  akv_log_cfg(config, AKV_LOG_INFO, "%s", fit.line);
  if (!fit.ok) {
    if (config->fit_mode == AKV_FIT_REFUSE || fit.effective_concurrency == 0) {
      akv_log_cfg(config, AKV_LOG_ERROR, "%s", why);
      return AKV_ERR_NO_FIT;
    }
    akv_log_cfg(config, AKV_LOG_WARN,
                "shrink mode: concurrency lowered from max_contexts=%u to %u; opening more "
                "returns AKV_ERR_REFUSED_QUEUE",
                config->max_contexts, fit.effective_concurrency);
  }

  /* The engine is a record of the process-wide pool, never freed: a
   * destroyed handle reads as dead, never as freed memory. */
  e = akv_rec_take(&akv_engine_records);
  if (e == NULL) return AKV_ERR_OUT_OF_MEMORY;
  /* Claimed while it is built (akv_engine_claim_record), and zeroed
   * between the claim words and the end magic: the claim words are the
   * record's, and a stale handle's claim may read the magic meanwhile. */
  akv_engine_claim_record(e);
  memset((char *)e + offsetof(akv_engine, serial), 0,
         offsetof(akv_engine, magic_end) - offsetof(akv_engine, serial));
  akv_rec_fork_stamp(&e->fork_gen);
  AKV_STORE(e->magic, AKV_MAGIC_ENGINE);
  AKV_STORE(e->magic_end, AKV_MAGIC_ENGINE);
  __atomic_store_n(&e->serial, atomic_fetch_add(&akv_engine_serials, 1) + 1, __ATOMIC_RELAXED);
  e->cfg = *config;
  e->cfg.struct_size = sizeof(akv_engine_config);
  e->fit = fit;
  e->concurrency = fit.effective_concurrency;
  e->row_bytes = fit.row_bytes;
  e->pair_bytes = 2 * fit.row_bytes;
  e->seg_bytes = (uint64_t)config->max_tokens * e->pair_bytes;
  e->page_bytes = fit.page_bytes;
  e->page_seg_bytes = (uint64_t)config->page_tokens * e->pair_bytes;
  e->n_pages = config->route != AKV_ROUTE_STAGE ? (uint32_t)fit.device_pages : 0;
  /* Sizes of everything besides the pools, checked by akv_fit_compute. */
  st = akv_budget_compute(config, fit.effective_concurrency, config->page_tokens, &e->budget,
                          why, sizeof(why));
  if (st != AKV_OK) {
    akv_log_cfg(config, AKV_LOG_ERROR, "engine config rejected: %s", why);
    goto fail;
  }
  e->max_logical_pages = e->budget.max_logical_pages;
  if (config->route == AKV_ROUTE_STAGE && config->device_pool_gib > 0)
    akv_log_cfg(config, AKV_LOG_INFO,
                "route stage retains nothing: device_pool_gib=%u is not allocated",
                config->device_pool_gib);

  {
    akv_status pick;
    akv_backend_params params = {config->device_ordinal, config->host_delay_seed,
                                 config->host_delay_max_us, config->host_fake_free_bytes};
    const akv_backend_ops *ops = akv_pick_backend(config, &params, &pick);
    if (ops == NULL) {
      akv_log_cfg(config, AKV_LOG_ERROR,
                  "backend cuda requested but unavailable (no CUDA build or no device); "
                  "set backend to AKV_BACKEND_AUTO or AKV_BACKEND_HOST");
      st = pick;
      goto fail;
    }
    akv_bk_setup(&e->bk, ops, config->fault_fail_nth, config->fault_kind);
    e->backend = ops->kind;
  }

  /* Invariant (akv.h, fork): an engine belongs to the process its queue
   * threads run in. The log lines above run the caller's callback, which may
   * fork; up to here the record holds memory only, so the engine is stamped
   * again right before its backend starts: a child forked in those lines
   * completes an engine of its own (it was stamped with the parent's fork
   * count, and every call on the engine create returned to it, destroy
   * included, answered AKV_ERR_BAD_HANDLE while its queue threads ran on in
   * the child for good). */
  akv_rec_fork_stamp(&e->fork_gen);
  st = akv_engine_allocate(e);
  if (st != AKV_OK) akv_log(e, AKV_LOG_ERROR, "engine creation failed: %s", e->last_error);
  if (akv_engine_forked(e)) return akv_engine_create_forked(e);
  if (st != AKV_OK) goto fail;
#ifdef AKV_WITH_CUDA
  if (e->bk.ops == &akv_backend_cuda_ops && !akv_cuda_host_pool_stream_ordered(e->bk.ctx))
    akv_log(e, AKV_LOG_WARN,
            "pinned host memory from cudaHostAlloc (no host memory pools in this runtime or on "
            "this device, or the host pool refused a block): akv_engine_destroy will wait in "
            "cudaFreeHost until the device is idle, the caller's work included");
#endif
  akv_log(e, AKV_LOG_INFO,
          "engine ready: backend %s, route %s, %u contexts, %u device pages of %llu B, "
          "staging 2 x %llu B",
          e->bk.ops->name, akv_route_name(config->route),
          e->concurrency, e->n_pages, (unsigned long long)e->page_bytes,
          (unsigned long long)e->staging_bytes);
  if (akv_engine_forked(e)) return akv_engine_create_forked(e);
  *out = e;
  akv_engine_release(e);
  return AKV_OK;
fail:
  akv_engine_free_all(e);
  akv_engine_give(e, false);
  return st;
}

static akv_status akv_engine_destroy_claimed(akv_engine *e) {
  if (e->log_depth > 0) return akv_engine_reentered(e);
  /* The destructor never waits, submits or drains: live work means busy. */
  if (e->step_open || e->leases_live > 0 || e->retained ||
      (e->transport_failed && !e->quarantined))
    return akv_fail(e, AKV_ERR_BUSY,
                    "engine_destroy: refused: %s; nothing was freed",
                    e->retained       ? "resources retained on an uncertain fence"
                    : e->step_open    ? "a step is open (retire its leases, end it)"
                    : e->leases_live  ? "unretired leases"
                                      : "transport failed: quarantine first");
  for (size_t i = 0; i < sizeof(e->streams) / sizeof(e->streams[0]); i++)
    if (e->streams[i].live)
      return akv_fail(e, AKV_ERR_BUSY,
                      "engine_destroy: refused: a stream from akv_stream_create is live; "
                      "nothing was freed");
  akv_engine_free_all(e);
  return AKV_OK;
}

/* Another thread's destroy is refused while a call is in progress (the
 * claim): nothing is freed under a running call. From an attention hook of
 * this engine's akv_lease_attend (the same thread, nested) it frees, as
 * before: attend touches nothing of the engine after its hook unless the
 * handle still names its begin (akv_lease_attend), and its release only
 * writes the claim words of the dead record, which stays claimed until
 * then (akv_engine_claim_record). */
AKV_API akv_status akv_engine_destroy(akv_engine *e) {
  akv_status st = akv_engine_claim(e);
  if (st != AKV_OK) return st;
  st = akv_engine_destroy_claimed(e);
  if (st == AKV_OK)
    akv_engine_give(e, true);
  else
    akv_engine_release(e);
  return st;
}

/* Another thread gets a static string and the engine's last error stays
 * the one its call in progress may be writing. */
AKV_API const char *akv_engine_last_error(const akv_engine *e) {
  const char *msg;
  akv_status st = akv_engine_claim(e);
  if (st == AKV_ERR_IN_USE) return "engine in use by another thread";
  if (st != AKV_OK) return "bad engine handle";
  msg = e->last_error;
  akv_engine_release(e);
  return msg;
}

static akv_status akv_engine_info_get_claimed(const akv_engine *e, akv_engine_info *out) {
  if (out == NULL)
    return akv_fail((akv_engine *)e, AKV_ERR_INVALID_ARGUMENT, "engine_info_get: out is NULL");
  memset(out, 0, sizeof(*out));
  out->backend = e->backend;
  out->route = e->cfg.route;
  out->effective_concurrency = e->concurrency;
  out->row_bytes = e->row_bytes;
  out->history_bytes = e->fit.history_bytes;
  out->page_bytes = e->page_bytes;
  out->device_pages = e->n_pages;
  out->staging_bytes = e->staging_bytes * AKV_N_BUFFERS;
  out->device_bytes_allocated = e->device_allocated;
  {
    uint64_t fr, tot, peak;
    if (akv_bk_mem_info((akv_bk *)&e->bk, &fr, &tot, &peak) == AKV_OK)
      out->device_peak_bytes = peak;
  }
  out->bytes_h2d = e->bytes_h2d;
  out->bytes_d2h = e->bytes_d2h;
  out->bytes_d2d = e->bytes_d2d;
  out->bytes_in_place = e->bytes_in_place;
  out->copies_h2d = e->copies_h2d;
  out->copies_d2h = e->copies_d2h;
  out->copies_d2d = e->copies_d2d;
  out->steps = e->steps_done;
  out->leases_retired = e->leases_retired;
  memcpy(out->backend_ops, e->bk.counts, sizeof(out->backend_ops));
  out->transport_failed = e->transport_failed;
  out->quarantined = e->quarantined;
  out->headroom_pages = akv_adm_headroom_pages(e->adm);
  out->headroom_bytes = (uint64_t)e->hr_chunks * e->hr_alloc_bytes;
  return AKV_OK;
}

AKV_API akv_status akv_engine_info_get(const akv_engine *e, akv_engine_info *out) {
  akv_status st = akv_engine_claim(e);
  if (st != AKV_OK) return st;
  st = akv_engine_info_get_claimed(e, out);
  akv_engine_release(e);
  return st;
}

static akv_status akv_engine_quarantine_claimed(akv_engine *e, akv_quarantine_report *report) {
  akv_quarantine_report r;
  akv_status st;
  if (e->log_depth > 0) return akv_engine_reentered(e);
  /* Invariant: quarantine never waits for the function that calls it. From
   * a function running on one of this engine's streams
   * (akv_stream_launch_host) the device synchronisation below waits for
   * that stream, whose worker is the caller: it waited for itself until the
   * sync timeout, then left the engine closed and everything retained on
   * an uncertain fence. Refused at once, nothing marked, *report alone. */
  if (akv_engine_on_own_stream(e))
    return akv_fail(e, AKV_ERR_IN_USE,
                    "engine_quarantine: called from a function running on a stream of this engine, "
                    "which it would wait for; nothing marked");
  memset(&r, 0, sizeof(r));
  e->transport_failed = true; /* from now on: diagnostics, quarantine, destroy */
  /* Partial submissions quarantine until a drain proves completion: both copy
   * queues, the materialisation queue, then the device. */
  r.h2d_ok = akv_bk_queue_sync(&e->bk, e->q_h2d) == AKV_OK;
  r.d2h_ok = akv_bk_queue_sync(&e->bk, e->q_d2h) == AKV_OK;
  r.d2d_ok = akv_bk_queue_sync(&e->bk, e->q_d2d) == AKV_OK;
  r.device_ok = akv_bk_device_sync(&e->bk) == AKV_OK;
  if (r.h2d_ok && r.d2h_ok && r.d2d_ok && r.device_ok) {
    uint32_t before_tickets = 0;
    for (uint32_t l = 0; l < e->cfg.n_dense_layers; l++) {
      akv_lease_body *ls = &e->leases[l];
      if (ls->state != AKV_LEASE_IDLE && ls->state != AKV_LEASE_RETIRED) {
        r.leases_released++;
        before_tickets += ls->n_tickets;
      }
    }
    akv_leases_release_all(e);
    r.tickets_released = before_tickets;
    /* Completion is established: nothing in flight reads the headroom asked
     * back during the failed step, so it is freed now (an uncertain drain
     * below keeps it, with everything else). */
    (void)akv_headroom_apply_pending(e);
    e->retained = false;
    e->quarantined = true;
    st = AKV_OK;
    akv_log(e, AKV_LOG_WARN, "quarantine: completion established; %u leases and %u tickets released",
            r.leases_released, r.tickets_released);
  } else {
    /* Nothing is recycled on an uncertain fence: every owner, buffer and
     * lease stays retained and destroy will refuse. */
    for (uint32_t l = 0; l < e->cfg.n_dense_layers; l++) {
      akv_lease_body *ls = &e->leases[l];
      if (ls->state != AKV_LEASE_IDLE && ls->state != AKV_LEASE_RETIRED) r.retained_leases++;
    }
    snprintf(r.uncertain, sizeof(r.uncertain), "%s%s%s%s", r.h2d_ok ? "" : "h2d-queue ",
             r.d2h_ok ? "" : "d2h-queue ", r.d2d_ok ? "" : "d2d-queue ",
             r.device_ok ? "" : "device");
    e->retained = true;
    st = akv_fail(e, AKV_ERR_UNCERTAIN_FENCE,
                  "engine_quarantine: could not establish completion (%s); %u leases, the pools and "
                  "buffers stay retained",
                  r.uncertain, r.retained_leases);
    akv_log(e, AKV_LOG_ERROR, "%s", e->last_error);
  }
  if (report != NULL) *report = r;
  return st;
}

AKV_API akv_status akv_engine_quarantine(akv_engine *e, akv_quarantine_report *report) {
  akv_status st = akv_engine_claim(e);
  if (st != AKV_OK) return st;
  st = akv_engine_quarantine_claimed(e, report);
  akv_engine_release(e);
  return st;
}
