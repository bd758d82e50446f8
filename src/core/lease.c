/*
 * lease.c - the lease state machine of DESIGN §5: one staged dense layer,
 * from begin to retire.
 *
 *   IDLE/RETIRED --begin--> BEGUN --wait_ready--> READY --mark_consumed--> CONSUMED
 *        ^                    \______________ attend (hook form) ______________/ |
 *        |                                                             write_back (1..n)
 *        +---------retire / try_retire (all passed)-- SEALED <----seal-----------+
 *
 * Every call checks its state first and returns a specific status without
 * changing anything when the transition is illegal. Backend failures after
 * work was submitted mark the transport failed; the lease then stays live
 * until quarantine proves completion.
 */
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

#include "internal.h"

/* Fence serials come from one process-wide counter, not one per engine: a
 * fence names one recording of one engine, so seal refuses a fence of
 * another engine (or of a destroyed one) even when both engines made the
 * same calls. Never 0 (0 is the serial of a fence never recorded). */
static _Atomic uint64_t akv_fence_serials;

static uint64_t akv_fence_next(void) { return atomic_fetch_add(&akv_fence_serials, 1) + 1; }

akv_lease_body *akv_lease_resolve(const akv_lease *h) {
  const akv_lease_body *ls;
  /* A handle record is never freed (records.h); its body is read only while
   * the record is live, and a live record's engine has not been destroyed
   * (destroy poisons every handle record the engine holds). */
  if (h == NULL || AKV_LOAD(h->magic) != AKV_MAGIC_LEASE ||
      AKV_LOAD(h->magic_end) != AKV_MAGIC_LEASE)
    return NULL;
  ls = h->body;
  if (ls->handle != h || ls->serial != h->serial || !akv_engine_ok(ls->engine) ||
      ls->engine != AKV_LOAD(h->engine))
    return NULL;
  return (akv_lease_body *)ls;
}

/* The claim of a lease call (akv_engine_claim): the record reads as a live
 * lease handle, then the engine that holds the record is claimed, and only
 * then is the body read (the engine's destroy frees it). A record's engine
 * changes only at a destroy (under that engine's claim) and a later
 * create, so once claimed it holds. */
akv_status akv_lease_claim(const akv_lease *h, akv_engine **out) {
  akv_engine *e;
  akv_status st;
  if (h == NULL || AKV_LOAD(h->magic) != AKV_MAGIC_LEASE ||
      AKV_LOAD(h->magic_end) != AKV_MAGIC_LEASE)
    return AKV_ERR_BAD_HANDLE;
  e = AKV_LOAD(h->engine);
  if ((st = akv_engine_claim(e)) != AKV_OK) return st;
  if (AKV_LOAD(h->engine) != e || akv_lease_resolve(h) == NULL) {
    akv_engine_release(e);
    return AKV_ERR_BAD_HANDLE;
  }
  *out = e;
  return AKV_OK;
}

/* Common entry: live handle, engine usable. */
static akv_status akv_lease_enter(const akv_lease *h, akv_lease_body **out, const char *call) {
  akv_lease_body *ls = akv_lease_resolve(h);
  if (ls == NULL) return AKV_ERR_BAD_HANDLE;
  *out = ls;
  return akv_engine_enter(ls->engine, call);
}

/* The next free handle record of the engine, in FIFO order. At most one
 * lease per layer is unretired, and each holds one record: the ring of
 * AKV_LEASE_HANDLES_PER_LAYER per layer is never empty. */
static akv_lease *akv_lease_handle_take(akv_engine *e, akv_lease_body *ls) {
  akv_lease *h = e->lease_ring[e->lease_head];
  e->lease_head = (e->lease_head + 1) % e->n_lease_recs;
  e->lease_free--;
  h->body = ls;
  h->serial = ls->serial;
  AKV_STORE(h->magic_end, AKV_MAGIC_LEASE);
  AKV_STORE(h->magic, AKV_MAGIC_LEASE); /* live last */
  ls->handle = h;
  return h;
}

/* Kills the lease's handle (retire, quarantine's release): from now on it
 * answers AKV_ERR_BAD_HANDLE. It queues behind every free record, so it is
 * handed out again only after at least (AKV_LEASE_HANDLES_PER_LAYER - 1) x
 * n_dense_layers later begins (the other unretired leases hold at most
 * n_dense_layers - 1 records). */
static void akv_lease_handle_give(akv_engine *e, akv_lease_body *ls) {
  akv_lease *h = ls->handle;
  if (h == NULL) return;
  AKV_STORE(h->magic, AKV_MAGIC_DEAD);
  AKV_STORE(h->magic_end, AKV_MAGIC_DEAD);
  ls->handle = NULL;
  e->lease_ring[(e->lease_head + e->lease_free) % e->n_lease_recs] = h;
  e->lease_free++;
}

static const char *akv_lease_state_name(akv_lease_state s) {
  static const char *const names[] = {"idle", "begun", "ready", "consumed", "sealed", "retired"};
  return names[s];
}

static akv_status akv_lease_wrong_state(akv_lease_body *ls, const char *call, const char *needs) {
  return akv_fail(ls->engine, AKV_ERR_LEASE_STATE, "%s: lease of layer %u is %s; needs %s", call,
                  ls->layer, akv_lease_state_name(ls->state), needs);
}

static bool akv_reader_live(const akv_reader *r) {
  return r->lease->serial == r->lease_serial && r->lease->state != AKV_LEASE_RETIRED &&
         r->lease->state != AKV_LEASE_IDLE;
}

/* The prior readers of a new lease: the previous stage's own readers (its
 * attention-consumed and tail write-back events) plus the readers it carried
 * for the other buffer. Readers already retired were waited on by the host. */
static void akv_lease_collect_prior(const akv_lease_body *pred, akv_reader *out, uint32_t *n_out) {
  uint32_t n = 0;
  if (pred != NULL && pred->state != AKV_LEASE_RETIRED) {
    akv_reader own[2] = {{pred->ev_attn, pred->buffer, (akv_lease_body *)pred, pred->serial},
                         {pred->ev_tail, pred->buffer, (akv_lease_body *)pred, pred->serial}};
    out[n++] = own[0];
    out[n++] = own[1];
  }
  if (pred != NULL)
    for (uint32_t i = 0; i < pred->n_prior && n < AKV_MAX_PRIOR; i++)
      if (pred->prior[i].buffer != pred->buffer && akv_reader_live(&pred->prior[i]))
        out[n++] = pred->prior[i];
  *n_out = n;
}

static void akv_lease_add_ticket(akv_lease_body *ls, akv_copy_dir dir, akv_context *c, uint64_t bytes) {
  akv_ticket *t = &ls->tickets[ls->n_tickets++];
  t->dir = dir;
  t->slot = c->slot;
  t->generation = c->generation;
  t->bytes = bytes;
  if (dir != AKV_COPY_D2D) t->generation = akv_ticket_take(ls->engine, c);
}

/* Releases the lease's host page leases, all or none: if one ticket's slot
 * changed owner or generation under it (akv_ticket_valid), none is released
 * and false is returned. */
static bool akv_lease_release_tickets(akv_lease_body *ls) {
  akv_engine *e = ls->engine;
  for (uint32_t i = 0; i < ls->n_tickets; i++) {
    const akv_ticket *t = &ls->tickets[i];
    if (t->dir != AKV_COPY_D2D && !akv_ticket_valid(e, t->slot, t->generation)) {
      snprintf(e->bk.error, sizeof(e->bk.error),
               "invariant violated: slot %u changed generation under a live ticket of layer %u",
               t->slot, ls->layer);
      return false;
    }
  }
  for (uint32_t i = 0; i < ls->n_tickets; i++)
    if (ls->tickets[i].dir != AKV_COPY_D2D) akv_ticket_release(e, ls->tickets[i].slot);
  ls->n_tickets = 0;
  return true;
}

/* Builds the copies that stage context i's history for the lease's layer:
 * retained pages device->device (sc_mat; the paged route reads them in place
 * and copies nothing), everything else host->device (sc_stage) in the
 * longest contiguous runs (K and V of a run are one byte range). Context i
 * adds at most one run more than its resident pages, and one sc_mat entry
 * per resident page; resident pages are distinct physical pages, so the
 * step's contexts together stay within the caps of budget.h. */
static void akv_lease_plan_context(akv_lease_body *ls, uint32_t i, size_t *n_h2d, size_t *n_d2d) {
  akv_engine *e = ls->engine;
  akv_context *c = ls->contexts[i];
  const uint64_t row = e->pair_bytes;
  const uint32_t pt = e->cfg.page_tokens;
  const uint32_t len = ls->len[i];
  const uint32_t full = e->n_pages + e->hr_max_pages > 0 ? len / pt : 0;
  uint8_t *stage = e->staging[ls->buffer] + (uint64_t)i * e->seg_bytes;
  const uint8_t *host = akv_host_layer(e, c, ls->layer);
  uint32_t run_start = 0;
  uint64_t h2d_bytes = 0, d2d_bytes = 0;

  for (uint32_t p = 0; p <= full; p++) {
    uint32_t phys = p < full ? akv_adm_page_of(e->adm, c->slot, p) : AKV_ADM_NONE;
    uint32_t end = p < full ? p * pt : len; /* where the pending H2D run stops */
    bool flush = p == full || phys != AKV_ADM_NONE;
    if (flush && end > run_start) {
      e->sc_stage.dst[*n_h2d] = stage + (uint64_t)run_start * row;
      e->sc_stage.src[*n_h2d] = host + (uint64_t)run_start * row;
      e->sc_stage.bytes[*n_h2d] = (uint64_t)(end - run_start) * row;
      h2d_bytes += e->sc_stage.bytes[*n_h2d];
      (*n_h2d)++;
    }
    if (p < full && phys != AKV_ADM_NONE && e->cfg.route == AKV_ROUTE_PAGED) {
      ls->bytes_in_place += e->page_seg_bytes;
      if (e->poison != NULL) { /* testing aid: the hole reads NaN */
        e->sc_mat.dst[*n_d2d] = stage + (uint64_t)p * pt * row;
        e->sc_mat.src[*n_d2d] = e->poison;
        e->sc_mat.bytes[*n_d2d] = e->page_seg_bytes;
        (*n_d2d)++;
      }
      run_start = (p + 1) * pt;
    } else if (p < full && phys != AKV_ADM_NONE) {
      e->sc_mat.dst[*n_d2d] = stage + (uint64_t)p * pt * row;
      e->sc_mat.src[*n_d2d] = e->page_ptr[phys] + (uint64_t)ls->layer * e->page_seg_bytes;
      e->sc_mat.bytes[*n_d2d] = e->page_seg_bytes;
      d2d_bytes += e->page_seg_bytes;
      (*n_d2d)++;
      run_start = (p + 1) * pt;
    }
  }
  if (h2d_bytes > 0) akv_lease_add_ticket(ls, AKV_COPY_H2D, c, h2d_bytes);
  if (d2d_bytes > 0) akv_lease_add_ticket(ls, AKV_COPY_D2D, c, d2d_bytes);
  ls->bytes_h2d += h2d_bytes;
  ls->bytes_d2d += d2d_bytes;
}

static akv_status akv_lease_begin_claimed(akv_engine *e, uint32_t layer, akv_lease **out) {
  akv_status st = akv_engine_enter(e, "lease_begin");
  akv_lease_body *ls, *pred;
  akv_reader prior[AKV_MAX_PRIOR];
  uint32_t n_prior = 0;
  size_t n_h2d = 0, n_d2d = 0;
  if (st != AKV_OK) return st;
  if (out == NULL) return akv_fail(e, AKV_ERR_INVALID_ARGUMENT, "lease_begin: out is NULL");
  if (!e->step_open) return akv_fail(e, AKV_ERR_STEP_STATE, "lease_begin: no step is open");
  if (layer >= e->cfg.n_dense_layers || layer != e->next_layer)
    return akv_fail(e, AKV_ERR_INVALID_ARGUMENT,
                    "lease_begin: layer %u given; the step's next layer is %u of %u", layer,
                    e->next_layer, e->cfg.n_dense_layers);
  pred = e->last_begun;
  if (pred != NULL && pred->state != AKV_LEASE_SEALED && pred->state != AKV_LEASE_RETIRED)
    return akv_fail(e, AKV_ERR_LEASE_ORDER,
                    "lease_begin: the lease of layer %u is %s; seal or retire it first",
                    pred->layer, akv_lease_state_name(pred->state));
  ls = &e->leases[layer];
  akv_lease_collect_prior(pred, prior, &n_prior);

  /* From here on the lease is live: partial submissions stay with it until a
   * retire or a quarantine proves completion. */
  ls->serial = ++e->lease_serial;
  akv_lease_handle_take(e, ls); /* the previous handle of this layer died at its retire */
  ls->step = e->step;
  ls->state = AKV_LEASE_BEGUN;
  ls->stream = NULL;
  ls->used_d2d = false;
  ls->fence_attn = ls->fence_tail = 0;
  memcpy(ls->prior, prior, sizeof(prior));
  ls->n_prior = n_prior;
  ls->n_contexts = e->step_n;
  ls->n_written = 0;
  ls->n_tickets = 0;
  ls->bytes_h2d = ls->bytes_d2d = ls->bytes_d2h = ls->bytes_in_place = 0;
  for (uint32_t i = 0; i < e->step_n; i++) {
    ls->contexts[i] = e->step_ctx[i];
    ls->len[i] = e->step_ctx[i]->len;
    ls->generation[i] = e->step_ctx[i]->generation;
    ls->written[i] = 0;
  }
  e->leases_live++;
  e->next_layer++;
  e->last_begun = ls;

  for (uint32_t i = 0; i < ls->n_contexts; i++) akv_lease_plan_context(ls, i, &n_h2d, &n_d2d);
  /* On the paged route the only device->device entries are poison fills
   * (testing aid); they go on the H2D queue, behind the same waits. */
  ls->used_d2d = n_d2d > 0 && e->cfg.route != AKV_ROUTE_PAGED;

#ifndef AKV_TEST_DROP_PRIOR_READER_WAITS
  /* No copy into a buffer is submitted before its queue waits on every prior
   * reader of that buffer (attention and write-back of the lease that used
   * it last, if not yet retired). */
  for (uint32_t r = 0; r < n_prior; r++) {
    if (prior[r].buffer != ls->buffer) continue;
    /* A listed lease is sealed, so its tail was recorded on the D2H queue
     * after that queue waited on its attention event: waiting on the tail
     * covers both readers on the device, one wait per queue instead of two. */
    if (prior[r].event == prior[r].lease->ev_attn) continue;
    AKV_CHECK(akv_bk_wait(&e->bk, e->q_h2d, prior[r].event));
    if (ls->used_d2d) AKV_CHECK(akv_bk_wait(&e->bk, e->q_d2d, prior[r].event));
  }
#endif
  /* Poison fills (paged route, testing aid) are counted nowhere (akv.h,
   * poison_holes): the backend's batch, not akv_copy_submit. */
  if (n_d2d > 0 && !ls->used_d2d)
    AKV_CHECK(akv_bk_copy_batch(&e->bk, e->q_h2d, AKV_COPY_D2D, n_d2d, e->sc_mat.dst,
                                (const void *const *)e->sc_mat.src, e->sc_mat.bytes));
  if (ls->used_d2d) {
    AKV_CHECK(akv_copy_submit(e, e->q_d2d, AKV_COPY_D2D, n_d2d, e->sc_mat.dst,
                              (const void *const *)e->sc_mat.src, e->sc_mat.bytes));
    AKV_CHECK(akv_bk_record(&e->bk, ls->ev_d2d, e->q_d2d));
  }
  AKV_CHECK(akv_copy_submit(e, e->q_h2d, AKV_COPY_H2D, n_h2d, e->sc_stage.dst,
                            (const void *const *)e->sc_stage.src, e->sc_stage.bytes));
  AKV_CHECK(akv_bk_record(&e->bk, ls->ev_h2d, e->q_h2d));
  /* Invariant (akv.h, akv_engine_info): bytes_in_place counts a lease only
   * once it was placed, every wait, copy and record of its begin submitted;
   * a begin that failed on the way counts nowhere. */
  e->bytes_in_place += ls->bytes_in_place;
  *out = ls->handle;
  return AKV_OK;
fail:
  return akv_transport_failed(e, st, "lease_begin");
}

AKV_API akv_status akv_lease_begin(akv_engine *e, uint32_t layer, akv_lease **out) {
  akv_status st = akv_engine_claim(e);
  if (st != AKV_OK) return st;
  st = akv_lease_begin_claimed(e, layer, out);
  akv_engine_release(e);
  return st;
}

static void akv_lease_view(const akv_lease_body *ls, akv_view *v) {
  const akv_engine *e = ls->engine;
  memset(v, 0, sizeof(*v));
  v->step = ls->step;
  v->layer = ls->layer;
  v->n_contexts = ls->n_contexts;
  v->kv_heads = e->cfg.kv_heads;
  v->head_dim = e->cfg.head_dim;
  v->dtype = e->cfg.dtype;
  v->row_stride = e->pair_bytes;
  v->base = e->staging[ls->buffer];
  v->context_stride = e->seg_bytes;
  v->v_offset = e->row_bytes;
  v->len = ls->len;
  v->contexts = (akv_context *const *)ls->contexts;
  if (e->page_map_dev != NULL) {
    v->page_tokens = e->cfg.page_tokens;
    v->page_map_stride = e->max_logical_pages;
    v->page_map = e->page_map_dev;
    v->page_map_host = e->page_map_host;
    v->pages = e->page_base + (uint64_t)ls->layer * e->page_seg_bytes;
    v->page_stride = e->page_bytes;
  }
}

static akv_status akv_lease_wait_ready_claimed(akv_lease *handle, akv_stream stream,
                                               akv_view *view) {
  akv_lease_body *ls = NULL;
  akv_status st = akv_lease_enter(handle, &ls, "lease_wait_ready");
  akv_engine *e;
  akv_bqueue *q;
  if (st != AKV_OK) return st;
  e = ls->engine;
  if (view == NULL || (q = akv_stream_queue(e, stream)) == NULL)
    return akv_fail(e, AKV_ERR_INVALID_ARGUMENT,
                    "lease_wait_ready: view is NULL or stream is not a stream of this engine");
  if (ls->state != AKV_LEASE_BEGUN) return akv_lease_wrong_state(ls, "lease_wait_ready", "begun");
  /* The compute stream waits on the device for the history-ready events. */
  AKV_CHECK(akv_bk_wait(&e->bk, q, ls->ev_h2d));
  if (ls->used_d2d) AKV_CHECK(akv_bk_wait(&e->bk, q, ls->ev_d2d));
  ls->stream = stream;
  ls->state = AKV_LEASE_READY;
  akv_lease_view(ls, view);
  return AKV_OK;
fail:
  return akv_transport_failed(e, st, "lease_wait_ready");
}

AKV_API akv_status akv_lease_wait_ready(akv_lease *handle, akv_stream stream, akv_view *view) {
  akv_engine *e;
  akv_status st = akv_lease_claim(handle, &e);
  if (st != AKV_OK) return st;
  st = akv_lease_wait_ready_claimed(handle, stream, view);
  akv_engine_release(e);
  return st;
}

static akv_status akv_lease_mark_consumed_claimed(akv_lease *handle, akv_stream stream,
                                                  akv_fence *attention) {
  akv_lease_body *ls = NULL;
  akv_status st = akv_lease_enter(handle, &ls, "lease_mark_consumed");
  akv_engine *e;
  akv_bqueue *q;
  if (st != AKV_OK) return st;
  e = ls->engine;
  if (attention == NULL)
    return akv_fail(e, AKV_ERR_INVALID_ARGUMENT, "lease_mark_consumed: attention is NULL");
  if (ls->state != AKV_LEASE_READY)
    return akv_lease_wrong_state(ls, "lease_mark_consumed", "ready (after wait_ready)");
  /* ls->stream is live: akv_stream_destroy refuses a stream an unretired
   * lease used (stream.c). */
  if (stream != ls->stream || (q = akv_stream_queue(e, stream)) == NULL)
    return akv_fail(e, AKV_ERR_INVALID_ARGUMENT,
                    "lease_mark_consumed: stream differs from the one given to wait_ready");
  AKV_CHECK(akv_bk_record(&e->bk, ls->ev_attn, q));
  ls->fence_attn = akv_fence_next();
  ls->state = AKV_LEASE_CONSUMED;
  attention->serial = ls->fence_attn;
  return AKV_OK;
fail:
  return akv_transport_failed(e, st, "lease_mark_consumed");
}

AKV_API akv_status akv_lease_mark_consumed(akv_lease *handle, akv_stream stream,
                                           akv_fence *attention) {
  akv_engine *e;
  akv_status st = akv_lease_claim(handle, &e);
  if (st != AKV_OK) return st;
  st = akv_lease_mark_consumed_claimed(handle, stream, attention);
  akv_engine_release(e);
  return st;
}

static akv_status akv_lease_attend_claimed(akv_lease *handle, akv_stream stream,
                                           akv_attention_fn hook, void *user,
                                           akv_fence *attention) {
  akv_lease_body *ls = NULL;
  akv_status st = akv_lease_enter(handle, &ls, "lease_attend");
  akv_view view;
  if (st != AKV_OK) return st;
  if (hook == NULL || attention == NULL)
    return akv_fail(ls->engine, AKV_ERR_INVALID_ARGUMENT, "lease_attend: hook or attention NULL");
  if (ls->state != AKV_LEASE_BEGUN) return akv_lease_wrong_state(ls, "lease_attend", "begun");
  if ((st = akv_lease_wait_ready_claimed(handle, stream, &view)) != AKV_OK) return st;
  /* What names this begin for the life of the process: the body, its begin's
   * serial (unique per engine) and its engine's serial (unique in the
   * process). Only compared after the hook, never dereferenced. */
  const akv_lease_body *const body = ls;
  const akv_engine *const engine = ls->engine; /* a record: readable after any destroy */
  const uint64_t lease_serial = ls->serial, engine_serial = ls->engine->serial;
  /* The hook runs with the engine claimed by this thread (the wrapper's
   * claim, akv_engine_claim): its calls on the engine nest, other threads'
   * are refused until attend returns. */
  const int rc = hook(user, &view, stream);
  /* The hook is the caller's code and may have ended the lease meanwhile (a
   * quarantine releases it, a retire ends it; a destroy after that frees the
   * engine's lease bodies). Invariant: nothing of the lease or its engine is
   * touched again unless the handle still names this very begin. A hook
   * that ended the lease may also have let the handle's record be handed
   * out again (later begins on this engine, or, after a destroy, to a newer
   * engine's lease: "Handle lifetimes"); the record then reads live, but
   * names another begin, which this attend must neither mark consumed nor
   * fail. */
  /* Invariant (akv.h, fork): a hook that forked returns twice, and in the
   * child this attend is a call on the parent's engine, whose queue threads
   * stayed in the parent (one may hold a queue's mutex there for good): it
   * goes no further than any other call of the child on that engine. */
  if (akv_engine_forked(engine)) return AKV_ERR_BAD_HANDLE;
  /* Invariant: after its hook, attend reads the lease record only while its
   * own engine lives, and asks that by the engine record's atomic words
   * alone (magics, serial). The engine record cannot have become another
   * engine's meanwhile: this attend holds its claim, and a destroy nested in
   * the hook gives the record back only at the claim's release
   * (akv_engine_give). A live engine still holds all its lease records (they
   * go back to their pool only at its destroy), and this thread holds its
   * claim, so the plain reads below race with nothing. A destroyed one gave
   * them back: the hook may have created newer engines that took this very
   * record, and another thread using one of them writes the record and the
   * body it names, which a plain read here would race with. */
  if (!akv_engine_ok(engine) ||
      __atomic_load_n(&engine->serial, __ATOMIC_RELAXED) != engine_serial ||
      AKV_LOAD(handle->engine) != engine)
    return AKV_ERR_BAD_HANDLE;
  ls = akv_lease_resolve(handle);
  if (ls == NULL || ls != body || ls->serial != lease_serial || ls->engine->serial != engine_serial)
    return AKV_ERR_BAD_HANDLE;
  if (rc != 0) {
    snprintf(ls->engine->bk.error, sizeof(ls->engine->bk.error),
             "attention hook of layer %u returned nonzero", ls->layer);
    return akv_transport_failed(ls->engine, AKV_ERR_BACKEND, "lease_attend");
  }
  /* Invariant: attend reports what became of its lease (akv.h,
   * akv_attention_fn). A hook that took its own lease on without ending it
   * (its akv_lease_mark_consumed, perhaps its write-back and seal too) left
   * it consumed or sealed, with the attention event recorded by that call:
   * attend then hands out that call's fence and returns AKV_OK. Without
   * this attend's own mark_consumed was refused (AKV_ERR_LEASE_STATE, a
   * warning and a last error) for a lease that had advanced, so the caller
   * took a step that went on for one that failed. Only mark_consumed moves
   * a ready lease on, so a lease not ready here has its attention fence. */
  if (ls->state != AKV_LEASE_READY) {
    /* An engine that failed meanwhile (the hook's write-back failed, say)
     * answers as it answers every call: nothing written. */
    if ((st = akv_engine_enter(ls->engine, "lease_attend")) != AKV_OK) return st;
    attention->serial = ls->fence_attn;
    return AKV_OK;
  }
  return akv_lease_mark_consumed_claimed(handle, stream, attention);
}

AKV_API akv_status akv_lease_attend(akv_lease *handle, akv_stream stream, akv_attention_fn hook,
                                    void *user, akv_fence *attention) {
  akv_engine *e;
  akv_status st = akv_lease_claim(handle, &e);
  if (st != AKV_OK) return st;
  st = akv_lease_attend_claimed(handle, stream, hook, user, attention);
  akv_engine_release(e);
  return st;
}

/* Index of `c` among the lease's owners, or -1. */
static int akv_lease_owner_index(const akv_lease_body *ls, const akv_context *c) {
  for (uint32_t i = 0; i < ls->n_contexts; i++)
    if (ls->contexts[i] == c && ls->generation[i] == c->generation) return (int)i;
  return -1;
}

static akv_status akv_lease_write_back_claimed(akv_lease *handle, akv_context *const *owners,
                                               uint32_t n_owners, akv_fence *tail) {
  akv_lease_body *ls = NULL;
  akv_status st = akv_lease_enter(handle, &ls, "lease_write_back");
  akv_engine *e;
  uint32_t n;
  size_t nb = 0;
  if (st != AKV_OK) return st;
  e = ls->engine;
  if (tail == NULL || (owners == NULL && n_owners != 0) || (owners != NULL && n_owners == 0) ||
      n_owners > ls->n_contexts)
    return akv_fail(e, AKV_ERR_INVALID_ARGUMENT,
                    "lease_write_back: tail NULL or owners/n_owners inconsistent");
  if (ls->state != AKV_LEASE_CONSUMED)
    return akv_lease_wrong_state(ls, "lease_write_back", "consumed (after attention)");
  /* Validate every owner before anything is enqueued. */
  n = owners == NULL ? ls->n_contexts : n_owners;
  for (uint32_t k = 0; k < n; k++) {
    akv_context *c = owners == NULL ? ls->contexts[k] : owners[k];
    int idx;
    if (owners != NULL && !akv_context_ok(c))
      return akv_fail(e, AKV_ERR_BAD_HANDLE, "lease_write_back: owner %u is not a context", k);
    /* A context of another engine is read by its atomic handle words only
     * (step.c, akv_step_begin): not its id, which that engine's thread
     * writes when it opens the record again. */
    if (AKV_LOAD(c->engine) != e)
      return akv_fail(e, AKV_ERR_OWNER_MISMATCH,
                      "lease_write_back: owner %u is a context of another engine, not a host "
                      "owner this lease began with",
                      k);
    idx = akv_lease_owner_index(ls, c);
    if (idx < 0)
      return akv_fail(e, AKV_ERR_OWNER_MISMATCH,
                      "lease_write_back: context %u is not a host owner this lease began with",
                      c->id);
    if (ls->written[idx])
      return akv_fail(e, AKV_ERR_LEASE_STATE,
                      "lease_write_back: context %u was already written back by this lease",
                      c->id);
    for (uint32_t j = 0; owners != NULL && j < k; j++)
      if (owners[j] == c)
        return akv_fail(e, AKV_ERR_INVALID_ARGUMENT, "lease_write_back: context %u listed twice",
                        c->id);
  }
  if (owners == NULL && ls->n_written > 0)
    return akv_fail(e, AKV_ERR_LEASE_STATE,
                    "lease_write_back: some owners were already written; name the rest");

  /* The write-back queue waits on the device for attention to be consumed. */
  if (ls->n_written == 0) AKV_CHECK(akv_bk_wait(&e->bk, e->q_d2h, ls->ev_attn));
  for (uint32_t k = 0; k < n; k++) {
    akv_context *c = owners == NULL ? ls->contexts[k] : owners[k];
    int idx = akv_lease_owner_index(ls, c);
    uint64_t off = (uint64_t)ls->len[idx] * e->pair_bytes;
    /* The new token's K and V rows: one range of pair_bytes. */
    e->sc_wb.dst[nb] = akv_host_layer(e, c, ls->layer) + off;
    e->sc_wb.src[nb] = e->staging[ls->buffer] + (uint64_t)idx * e->seg_bytes + off;
    e->sc_wb.bytes[nb] = e->pair_bytes; /* nb < n <= n_contexts <= sc_wb.cap */
    nb++;
    akv_lease_add_ticket(ls, AKV_COPY_D2H, c, 2 * e->row_bytes);
    ls->written[idx] = 1;
    ls->n_written++;
    ls->bytes_d2h += 2 * e->row_bytes;
  }
  /* The engine's counters take the batch in akv_copy_submit; the lease's
   * receipt figures are the lease's own. */
  AKV_CHECK(akv_copy_submit(e, e->q_d2h, AKV_COPY_D2H, nb, e->sc_wb.dst,
                            (const void *const *)e->sc_wb.src, e->sc_wb.bytes));
  AKV_CHECK(akv_bk_record(&e->bk, ls->ev_tail, e->q_d2h));
  ls->fence_tail = akv_fence_next();
  tail->serial = ls->fence_tail;
  return AKV_OK;
fail:
  return akv_transport_failed(e, st, "lease_write_back");
}

AKV_API akv_status akv_lease_write_back(akv_lease *handle, akv_context *const *owners,
                                        uint32_t n_owners, akv_fence *tail) {
  akv_engine *e;
  akv_status st = akv_lease_claim(handle, &e);
  if (st != AKV_OK) return st;
  st = akv_lease_write_back_claimed(handle, owners, n_owners, tail);
  akv_engine_release(e);
  return st;
}

static akv_status akv_lease_seal_claimed(akv_lease *handle, akv_fence tail, akv_fence attention) {
  akv_lease_body *ls = NULL;
  akv_status st = akv_lease_enter(handle, &ls, "lease_seal");
  akv_engine *e;
  if (st != AKV_OK) return st;
  e = ls->engine;
  if (ls->state != AKV_LEASE_CONSUMED)
    return akv_lease_wrong_state(ls, "lease_seal", "consumed and written back");
  if (ls->n_written != ls->n_contexts)
    return akv_fail(e, AKV_ERR_LEASE_STATE,
                    "lease_seal: %u of %u owners written back; write back the rest first",
                    ls->n_written, ls->n_contexts);
  if (attention.serial != ls->fence_attn || tail.serial != ls->fence_tail)
    return akv_fail(e, AKV_ERR_FENCE_MISMATCH,
                    "lease_seal: fences (tail %llu, attention %llu) are not the current tail "
                    "%llu and attention %llu of layer %u",
                    (unsigned long long)tail.serial, (unsigned long long)attention.serial,
                    (unsigned long long)ls->fence_tail, (unsigned long long)ls->fence_attn,
                    ls->layer);
  ls->state = AKV_LEASE_SEALED;
  return AKV_OK;
}

AKV_API akv_status akv_lease_seal(akv_lease *handle, akv_fence tail, akv_fence attention) {
  akv_engine *e;
  akv_status st = akv_lease_claim(handle, &e);
  if (st != AKV_OK) return st;
  st = akv_lease_seal_claimed(handle, tail, attention);
  akv_engine_release(e);
  return st;
}

/* Invariant (the proof retire and try_retire rest on): a sealed lease's
 * tail event passed only after every other event of the lease passed. The
 * events form one chain on the device, each link a queue wait made before
 * the next record:
 *  - history ready (ev_h2d, and ev_d2d when used_d2d) are recorded by begin;
 *  - wait_ready makes the compute stream wait on both, and mark_consumed
 *    (or attend) records ev_attn on that same stream after it (mark_consumed
 *    refuses another stream), so ev_attn passes after the history events;
 *  - the first write_back makes the D2H queue wait on ev_attn before its
 *    copies, and every write_back records ev_tail on that queue after them;
 *    seal requires a write-back of every owner, so a sealed lease's last
 *    ev_tail record follows the wait.
 * A queue wait holds everything behind it until the event passed (host
 * backend: the worker blocks without timeout; CUDA: cudaStreamWaitEvent),
 * so ev_tail passed proves ev_attn, ev_d2d and ev_h2d passed: one query or
 * one wait on it proves the lease complete, as begin's prior-reader wait on
 * the tail already relies on. No event of the lease is recorded again
 * before its retire (a layer's next lease begins after this one retired). */

/* The common end of retire and try_retire, once every fence is proven:
 * fills the receipt and only then releases the tickets and the layer.
 * Returns false (nothing released) when a ticket's host slot changed
 * generation under it (akv_lease_release_tickets). */
static bool akv_lease_finish(akv_lease_body *ls, akv_receipt *receipt) {
  akv_engine *e = ls->engine;
  akv_receipt r;
  memset(&r, 0, sizeof(r));
  r.step = ls->step;
  r.layer = ls->layer;
  r.tickets = ls->n_tickets;
  r.readers = 2;
  r.bytes_h2d = ls->bytes_h2d;
  r.bytes_d2d = ls->bytes_d2d;
  r.bytes_d2h = ls->bytes_d2h;
  r.bytes_in_place = ls->bytes_in_place;
  r.attention.serial = ls->fence_attn;
  r.tail.serial = ls->fence_tail;
  /* Only now, with every fence proven, are tickets and the layer released. */
  if (!akv_lease_release_tickets(ls)) return false;
  ls->state = AKV_LEASE_RETIRED;
  akv_lease_handle_give(e, ls); /* the handle is dead from here on */
  e->leases_live--;
  e->leases_retired++;
  if (receipt != NULL) *receipt = r;
  return true;
}

/* retire (wait) and try_retire (!wait): one wait on the tail, or one query
 * of it, proves every event of the lease passed (the chain invariant above
 * akv_lease_finish). A query that finds the tail pending is no failure: no
 * last error, no log line, nothing changed. */
static akv_status akv_lease_retire_claimed(akv_lease *handle, akv_receipt *receipt, bool wait) {
  const char *what = wait ? "lease_retire" : "lease_try_retire";
  akv_lease_body *ls = NULL;
  akv_status st = akv_lease_enter(handle, &ls, what);
  akv_engine *e;
  bool done = false;
  if (st != AKV_OK) return st;
  e = ls->engine;
  if (ls->state != AKV_LEASE_SEALED) return akv_lease_wrong_state(ls, what, "sealed");
  /* Invariant: a retire never waits for the function that calls it. From a
   * function running on a stream of this engine (akv_stream_launch_host,
   * which must not synchronise) an event not passed yet may be behind that
   * very function (an attention event recorded on its stream after it, or a
   * write-back waiting for one): retire waited for itself until the sync
   * timeout and failed the transport. There it waits for nothing: the tail
   * is queried first (it passes last), and a tail not passed refuses the
   * retire at once with nothing changed (akv_lease_try_retire is the call
   * for it). */
  if (wait && !akv_engine_on_own_stream(e)) {
    AKV_CHECK(akv_bk_event_sync(&e->bk, ls->ev_tail));
  } else {
    AKV_CHECK(akv_bk_query(&e->bk, ls->ev_tail, &done));
    if (!done && !wait) return AKV_ERR_NOT_READY;
    if (!done)
      return akv_fail(e, AKV_ERR_IN_USE,
                      "lease_retire: called from a function running on a stream of this "
                      "engine while an event of layer %u has not passed (it may be behind the "
                      "function); nothing changed",
                      ls->layer);
  }
  if (!akv_lease_finish(ls, receipt)) {
    st = AKV_ERR_BACKEND;
    goto fail;
  }
  return AKV_OK;
fail:
  return akv_transport_failed(e, st, what);
}

AKV_API akv_status akv_lease_retire(akv_lease *handle, akv_receipt *receipt) {
  akv_engine *e;
  akv_status st = akv_lease_claim(handle, &e);
  if (st != AKV_OK) return st;
  st = akv_lease_retire_claimed(handle, receipt, true);
  akv_engine_release(e);
  return st;
}

AKV_API akv_status akv_lease_try_retire(akv_lease *handle, akv_receipt *receipt) {
  akv_engine *e;
  akv_status st = akv_lease_claim(handle, &e);
  if (st != AKV_OK) return st;
  st = akv_lease_retire_claimed(handle, receipt, false);
  akv_engine_release(e);
  return st;
}

void akv_leases_release_all(akv_engine *e) {
  for (uint32_t l = 0; l < e->cfg.n_dense_layers; l++) {
    akv_lease_body *ls = &e->leases[l];
    if (ls->state == AKV_LEASE_IDLE || ls->state == AKV_LEASE_RETIRED) continue;
    /* Completion is proven; a ticket whose slot changed generation under
     * it keeps its count (the slot stays unclosable) and is reported. */
    if (!akv_lease_release_tickets(ls)) akv_log(e, AKV_LOG_ERROR, "%s", e->bk.error);
    ls->state = AKV_LEASE_RETIRED;
    akv_lease_handle_give(e, ls);
  }
  e->leases_live = 0;
  for (uint32_t i = 0; i < e->concurrency; i++) {
    akv_context *c = e->slot_owner[i];
    if (c == NULL) continue;
    if (c->fill_leases > 0 && !akv_ticket_valid(e, i, c->fill_generation))
      akv_log(e, AKV_LOG_ERROR,
              "invariant violated: slot %u changed generation under a page fill's host page "
              "lease",
              i);
    else
      for (; c->fill_leases > 0; c->fill_leases--) akv_ticket_release(e, i);
    c->in_step = false;
  }
  e->step_open = false;
  e->step_n = 0;
}
