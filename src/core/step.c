/*
 * step.c - the step boundary: the only point where residency changes.
 *
 * step_begin runs admission over the step's contexts and enqueues the fills
 * of newly resident pages on the H2D queue; step_end requires every layer's
 * lease retired and grows each context by the row the step wrote back.
 */
#include <stdio.h>
#include <string.h>

#include "internal.h"

/* Submits the fill copies gathered so far as one batch. */
static akv_status akv_step_flush_fills(akv_engine *e, size_t *n) {
  akv_status st = AKV_OK;
  if (*n == 0) return AKV_OK;
  st = akv_copy_submit(e, e->q_h2d, AKV_COPY_H2D, *n, e->sc_fill.dst,
                       (const void *const *)e->sc_fill.src, e->sc_fill.bytes);
  *n = 0;
  return st;
}

/* Enqueues the H2D fill of every page admission newly mapped. Each fill
 * copies one logical page of one context, for every dense layer (K and V
 * side by side: one copy per layer). The copies go in batches of at most
 * sc_fill.cap (AKV_FILL_BATCH at most): one fill of n_dense_layers copies may
 * span several batches, so no geometry the config accepts overruns it.
 *
 * Physical reuse waits for every fence: a page admission hands out here may
 * have been read by earlier steps (device->device materialisations on the
 * arena route, attention in place on the paged route). Every such reader
 * belongs to a lease of an earlier step, and a boundary is reached only with
 * no live lease (akv_step_end enforces it): each of those leases retired,
 * and retire returned only after waiting on every event of the lease. So
 * nothing that read a page can still be running when its fill is enqueued,
 * and the fill needs no wait. */
static akv_status akv_step_fill_pages(akv_engine *e) {
  akv_status st = AKV_OK;
  const akv_adm_fill *fills = NULL;
  size_t n_fills = akv_adm_fills(e->adm, &fills);
  size_t n = 0;

  for (size_t f = 0; f < n_fills; f++) {
    const akv_adm_fill *fl = &fills[f];
    akv_context *c = e->slot_owner[fl->slot]; /* admission fills only admitted slots */
    if (c == NULL) {
      snprintf(e->bk.error, sizeof(e->bk.error), "page %u filled for slot %u, which no context holds",
               fl->physical, fl->slot);
      st = AKV_ERR_BACKEND;
      goto fail;
    }
    for (uint32_t l = 0; l < e->cfg.n_dense_layers; l++) {
      if (n == e->sc_fill.cap) AKV_CHECK(akv_step_flush_fills(e, &n));
      e->sc_fill.dst[n] = e->page_ptr[fl->physical] + (uint64_t)l * e->page_seg_bytes;
      e->sc_fill.src[n] = akv_host_layer(e, c, l) + (uint64_t)fl->logical * e->page_seg_bytes;
      e->sc_fill.bytes[n] = e->page_seg_bytes;
      n++;
    }
    /* The fill reads host rows: it holds a host page lease until step_end,
     * by which point every lease of the step retired behind it on the same
     * H2D queue. */
    c->fill_generation = akv_ticket_take(e, c);
    c->fill_leases++;
  }
  AKV_CHECK(akv_step_flush_fills(e, &n));
  if (n_fills > 0) {
    /* Materialisations of this step read the filled pages: the D2D queue
     * waits for the fills on the device. */
    AKV_CHECK(akv_bk_record(&e->bk, e->ev_fill, e->q_h2d));
    AKV_CHECK(akv_bk_wait(&e->bk, e->q_d2d, e->ev_fill));
  }
  return AKV_OK;
fail:
  /* Admission already moved residency at this boundary: a page whose fill
   * was not submitted is mapped without its content, so every failure here
   * marks the transport failed (quarantine, never a retry). */
  return akv_transport_failed(e, st, "step_begin: page fill");
}

/* Paged route: the step's page map (context i of the step, page p: the
 * physical page retaining it or AKV_PAGE_STAGED), built in pinned memory and
 * copied on the H2D queue behind the fills, so every lease's history-ready
 * event covers it. The previous step's map is no longer read: a boundary is
 * reached only with every lease of that step retired. */
static akv_status akv_step_publish_map(akv_engine *e, akv_context *const *ctxs, uint32_t n) {
  akv_status st;
  const uint32_t stride = e->max_logical_pages;
  for (uint32_t i = 0; i < n; i++) {
    uint32_t *row = e->page_map_host + (uint64_t)i * stride;
    const uint32_t full = ctxs[i]->len / e->cfg.page_tokens;
    for (uint32_t p = 0; p < stride; p++) {
      const uint32_t phys = p < full ? akv_adm_page_of(e->adm, ctxs[i]->slot, p) : AKV_ADM_NONE;
      row[p] = phys == AKV_ADM_NONE ? AKV_PAGE_STAGED : e->page_entry[phys];
    }
  }
  /* Counted in copies_h2d and bytes_h2d as the rows' copies are. */
  void *dst = e->page_map_dev;
  const void *src = e->page_map_host;
  const size_t bytes = (size_t)n * stride * sizeof(uint32_t); /* <= page_map_bytes */
  AKV_CHECK(akv_copy_submit(e, e->q_h2d, AKV_COPY_H2D, 1, &dst, &src, &bytes));
  return AKV_OK;
fail:
  return akv_transport_failed(e, st, "step_begin: page map");
}

static akv_status akv_step_begin_claimed(akv_engine *e, akv_context *const *ctxs, uint32_t n) {
  akv_status st = akv_engine_enter(e, "step_begin");
  if (st != AKV_OK) return st;
  if (e->step_open) return akv_fail(e, AKV_ERR_STEP_STATE, "step_begin: a step is already open");
  if (ctxs == NULL || n == 0 || n > e->concurrency)
    return akv_fail(e, AKV_ERR_INVALID_ARGUMENT,
                    "step_begin: %u contexts given; between 1 and %u (effective concurrency)", n,
                    e->concurrency);
  for (uint32_t i = 0; i < n; i++) {
    /* Invariant: a context of another engine is read by its atomic handle
     * words only (magics, engine, open flag: akv_context_ok and the engine
     * word below). Its engine may be in use by another thread (this call
     * holds only e's claim), which writes the record's other fields, the
     * engine word too when it opens the record again. */
    if (!akv_context_ok(ctxs[i]) || AKV_LOAD(ctxs[i]->engine) != e)
      return akv_fail(e, AKV_ERR_BAD_HANDLE, "step_begin: context %u is not an open context of "
                      "this engine", i);
    for (uint32_t j = 0; j < i; j++)
      if (ctxs[j] == ctxs[i])
        return akv_fail(e, AKV_ERR_INVALID_ARGUMENT, "step_begin: context %u listed twice",
                        ctxs[i]->id);
    /* Every layer of a context in a step holds exactly len rows: staging and
     * write-back address row len on every layer alike. */
    if (akv_context_uneven(e, ctxs[i]))
      return akv_fail(e, AKV_ERR_UNEVEN_LAYERS,
                      "step_begin: context %u has layers holding different row counts (its "
                      "length is the minimum, %u); append the missing rows with "
                      "akv_context_append_layer first",
                      ctxs[i]->id, ctxs[i]->len);
    if ((uint64_t)ctxs[i]->len + 1 > e->cfg.max_tokens)
      return akv_fail(e, AKV_ERR_CAPACITY, "step_begin: context %u holds max_tokens=%u rows",
                      ctxs[i]->id, e->cfg.max_tokens);
  }
  /* The boundary being opened; e->step takes it only at the end, once the
   * begin succeeded (see the invariant there). */
  const uint64_t step = e->step + 1;
  if (e->n_pages + e->hr_max_pages > 0) {
    for (uint32_t i = 0; i < n; i++) {
      e->adm_req[i].slot = ctxs[i]->slot;
      e->adm_req[i].full_pages = ctxs[i]->len / e->cfg.page_tokens;
    }
    /* Unreachable from the public API: admission refuses only requests the
     * checks above already refused (a slot not admitted: every open
     * context's is; more full pages than a slot tracks: len + 1 <=
     * max_tokens; a slot listed twice), and changes nothing when it does. */
    st = akv_adm_step(e->adm, step, e->adm_req, n);
    if (st != AKV_OK) return akv_fail(e, st, "step_begin: admission step failed");
    st = akv_step_fill_pages(e);
    if (st != AKV_OK) return st;
  }
  /* Every paged view carries the page map, so it is published at every
   * boundary, also when no page exists (headroom enabled but none measured
   * free: every entry AKV_PAGE_STAGED); otherwise attention would read a map
   * nothing ever wrote. */
  if (e->page_map_dev != NULL && (st = akv_step_publish_map(e, ctxs, n)) != AKV_OK) return st;
  /* Invariant (akv.h: a failing call changes nothing): the step counter
   * counts the boundaries that opened. It moves here, with step_open, and
   * nowhere before: a begin refused by a check, or one whose fills or page
   * map could not be submitted (admission had moved residency: the
   * transport is failed, and the admission log names the boundary that did
   * not open), leaves it as it was. */
  e->step = step;
  for (uint32_t i = 0; i < n; i++) {
    e->step_ctx[i] = ctxs[i];
    ctxs[i]->in_step = true;
  }
  e->step_n = n;
  e->step_open = true;
  e->next_layer = 0;
  e->last_begun = NULL;
  return AKV_OK;
}

AKV_API akv_status akv_step_begin(akv_engine *e, akv_context *const *ctxs, uint32_t n) {
  akv_status st = akv_engine_claim(e);
  if (st != AKV_OK) return st;
  st = akv_step_begin_claimed(e, ctxs, n);
  akv_engine_release(e);
  return st;
}

static akv_status akv_step_end_claimed(akv_engine *e) {
  akv_status st = akv_engine_enter(e, "step_end");
  if (st != AKV_OK) return st;
  if (!e->step_open) return akv_fail(e, AKV_ERR_STEP_STATE, "step_end: no step is open");
  /* Invariant (DESIGN §7): logical cancellation revokes publication but
   * physical reuse waits for every fence. Enforced here: a step ends, and so
   * the next boundary (the only point where pages change hands) is reached,
   * only with no live lease; every lease retired, and retire waited on each
   * of its events. The page fills of the next boundary rely on it. */
  if (e->next_layer != e->cfg.n_dense_layers || e->leases_live > 0)
    return akv_fail(e, AKV_ERR_STEP_STATE,
                    "step_end: %u of %u layers leased, %u leases not retired", e->next_layer,
                    e->cfg.n_dense_layers, e->leases_live);
  /* Fill tickets: proven complete by the retires behind them on the H2D
   * queue. Each must still hold the slot at the generation it was taken at
   * (akv_ticket_valid); if one does not, nothing is released or published
   * and the transport is marked failed. */
  for (uint32_t i = 0; i < e->concurrency; i++) {
    akv_context *c = e->slot_owner[i];
    if (c != NULL && c->fill_leases > 0 &&
        (c->host_leases < c->fill_leases || !akv_ticket_valid(e, i, c->fill_generation))) {
      snprintf(e->bk.error, sizeof(e->bk.error),
               "invariant violated: slot %u changed generation under a page fill's host page "
               "lease",
               i);
      return akv_transport_failed(e, AKV_ERR_BACKEND, "step_end");
    }
  }
  for (uint32_t i = 0; i < e->step_n; i++) {
    akv_context *c = e->step_ctx[i];
    c->len++;
    for (uint32_t l = 0; l < e->cfg.n_dense_layers; l++) c->layer_len[l]++;
    c->in_step = false;
  }
  for (uint32_t i = 0; i < e->concurrency; i++) {
    akv_context *c = e->slot_owner[i];
    if (c == NULL) continue;
    for (; c->fill_leases > 0; c->fill_leases--) akv_ticket_release(e, i);
  }
  e->step_open = false;
  e->step_n = 0;
  e->steps_done++;
  /* Headroom asked back during the step: every lease of the step has retired
   * (each retire waited on its copies and its attention), so nothing reads
   * those pages any more; they leave admission and their memory is freed. */
  st = akv_headroom_apply_pending(e);
  if (st != AKV_OK) return st;
  return AKV_OK;
}

AKV_API akv_status akv_step_end(akv_engine *e) {
  akv_status st = akv_engine_claim(e);
  if (st != AKV_OK) return st;
  st = akv_step_end_claimed(e);
  akv_engine_release(e);
  return st;
}
