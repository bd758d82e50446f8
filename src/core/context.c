/*
 * context.c - contexts: host slots, prefilled appends, reads, and the host
 * page leases tickets take on a slot.
 */
#include <string.h>

#include "config.h"
#include "internal.h"
#include "records.h"

/* A context record is never freed (records.h) and its engine pointer names
 * an engine record, also never freed: checking a closed handle, or one whose
 * engine was destroyed, reads only live memory. */
bool akv_context_ok(const akv_context *c) {
  return c != NULL && AKV_LOAD(c->magic) == AKV_MAGIC_CONTEXT &&
         AKV_LOAD(c->magic_end) == AKV_MAGIC_CONTEXT && akv_engine_ok(AKV_LOAD(c->engine)) &&
         AKV_LOAD(c->open);
}

/* The claim of a context call (akv_engine_claim): the record reads as a
 * live context, then its engine is claimed, then the context is checked
 * again, now as a live context of that engine. Its engine changes only
 * through a close (under that engine's claim) and a later open of the
 * record by another engine, so once claimed it holds. */
akv_status akv_context_claim(const akv_context *c, akv_engine **out) {
  akv_engine *e;
  akv_status st;
  if (c == NULL || AKV_LOAD(c->magic) != AKV_MAGIC_CONTEXT ||
      AKV_LOAD(c->magic_end) != AKV_MAGIC_CONTEXT)
    return AKV_ERR_BAD_HANDLE;
  e = AKV_LOAD(c->engine);
  if ((st = akv_engine_claim(e)) != AKV_OK) return st;
  if (!akv_context_ok(c) || AKV_LOAD(c->engine) != e) {
    akv_engine_release(e);
    return AKV_ERR_BAD_HANDLE;
  }
  *out = e;
  return AKV_OK;
}

uint8_t *akv_host_layer(const akv_engine *e, const akv_context *c, uint32_t layer) {
  return c->host + (uint64_t)layer * e->seg_bytes;
}

/* A ticket takes a host page lease on the context's slot. */
uint64_t akv_ticket_take(akv_engine *e, akv_context *c) {
  (void)e;
  c->host_leases++;
  return c->generation;
}

/* Source authority survives until its replacement is valid. What protects
 * it: akv_context_close refuses while the context holds a host page lease
 * (host_leases > 0), so a slot's generation cannot move, and its rows
 * cannot go to another owner, while DMA may still read or write them. This
 * check is the tripwire behind that rule: a ticket whose slot changed
 * owner or generation under it is not released, and the caller marks the
 * transport failed (akv_lease_retire, akv_step_end). */
bool akv_ticket_valid(const akv_engine *e, uint32_t slot, uint64_t generation) {
  const akv_context *c = slot < e->concurrency ? e->slot_owner[slot] : NULL;
  return c != NULL && c->generation == generation && e->slot_generation[slot] == generation &&
         c->host_leases > 0;
}

void akv_ticket_release(akv_engine *e, uint32_t slot) { e->slot_owner[slot]->host_leases--; }

uint32_t akv_admission_floor(const akv_engine *e) {
  /* A context of one logical page has no page besides its sink. */
  return e->max_logical_pages < 2 ? e->max_logical_pages : 2;
}

/* Copies n token-major K and V rows of one layer after the rows that layer
 * holds and counts them there. The caller checked the capacity. */
static void akv_context_copy_rows(akv_engine *e, akv_context *c, uint32_t layer, uint32_t n,
                                  const void *k_rows, const void *v_rows) {
  uint8_t *dst = akv_host_layer(e, c, layer) + (uint64_t)c->layer_len[layer] * e->pair_bytes;
  const uint8_t *k = k_rows, *v = v_rows;
  for (uint32_t t = 0; t < n; t++, dst += e->pair_bytes) {
    memcpy(dst, k + (uint64_t)t * e->row_bytes, e->row_bytes);
    memcpy(dst + e->row_bytes, v + (uint64_t)t * e->row_bytes, e->row_bytes);
  }
  c->layer_len[layer] += n;
}

/* The context's length is the minimum over its layers: rows every dense
 * layer holds. Staging, admission and write-back all read c->len, so rows a
 * layer holds beyond it are never staged; step_begin refuses the context
 * while the layers differ (AKV_ERR_UNEVEN_LAYERS). */
static void akv_context_sync_len(const akv_engine *e, akv_context *c) {
  uint32_t min = c->layer_len[0];
  for (uint32_t l = 1; l < e->cfg.n_dense_layers; l++)
    if (c->layer_len[l] < min) min = c->layer_len[l];
  c->len = min;
}

bool akv_context_uneven(const akv_engine *e, const akv_context *c) {
  for (uint32_t l = 0; l < e->cfg.n_dense_layers; l++)
    if (c->layer_len[l] != c->len) return true;
  return false;
}

/* Part of the open step, or read by a host lease: closing or reading it now
 * would race the step's staging and write-back. */
bool akv_context_in_use(const akv_context *c) {
  return c->in_step || c->host_leases > 0;
}

static uint32_t akv_default_target(const akv_engine *e) {
  if (e->n_pages == 0) return 0;
  return e->n_pages / e->concurrency;
}

/* The id of the next open attempt. Invariant (akv.h, akv_context_id): ids
 * run 1 .. UINT32_MAX - 1 and then start again at 1, 0 and UINT32_MAX (the
 * admission log's "engine" and "none") are never issued, and an id a live
 * context holds is never issued again while it lives, so decisions and the
 * admission rules (which compare ids) never confuse two live contexts. */
static uint32_t akv_next_context_id(akv_engine *e) {
  for (;;) {
    if (e->next_context_id >= UINT32_MAX - 1) e->next_context_id = 0;
    const uint32_t id = ++e->next_context_id;
    bool taken = false;
    for (uint32_t i = 0; i < e->concurrency && !taken; i++)
      taken = e->slot_owner[i] != NULL && e->slot_owner[i]->id == id;
    if (!taken) return id;
  }
}

static akv_status akv_context_open_claimed(akv_engine *e, const akv_context_config *config,
                                           akv_context **out) {
  akv_status st = akv_engine_enter(e, "context_open");
  akv_context_config cc = AKV_CONTEXT_CONFIG_INIT;
  akv_context *c = NULL;
  if (st != AKV_OK) return st;
  if (out == NULL) return akv_fail(e, AKV_ERR_INVALID_ARGUMENT, "context_open: out is NULL");
  if (config != NULL) {
    /* An older caller's smaller struct: its fields, then the defaults. */
    char why[256];
    if (akv_config_merge(&akv_context_config_layout, &cc, config, why, sizeof why) != AKV_OK)
      return akv_fail(e, AKV_ERR_CONFIG, "context_open: %s", why);
    if (cc.version == 0 || cc.version > AKV_CONFIG_VERSION)
      return akv_fail(e, AKV_ERR_CONFIG,
                      "context_open: config version=%u is not between 1 and %u (use "
                      "AKV_CONTEXT_CONFIG_INIT)",
                      (unsigned)cc.version, (unsigned)AKV_CONFIG_VERSION);
  }
  if (e->step_open)
    return akv_fail(e, AKV_ERR_STEP_STATE, "context_open: not allowed inside a step");
  uint32_t slot = UINT32_MAX;
  for (uint32_t i = 0; i < e->concurrency && slot == UINT32_MAX; i++)
    if (e->slot_owner[i] == NULL) slot = i;
  if (slot == UINT32_MAX) {
    /* akv_admission_explain(NULL) explains the last refused open, this kind
     * included (akv.h); nothing else of the engine changes. */
    e->refused_queue = true;
    e->refused_queue_step = e->step;
    return akv_fail(e, AKV_ERR_REFUSED_QUEUE,
                    "context_open: all %u host slots are taken (effective concurrency); queue "
                    "the request and retry after a close",
                    e->concurrency);
  }
  if (cc.target_pages == AKV_TARGET_FAIR_SHARE) cc.target_pages = akv_default_target(e);
  if (e->n_pages == 0 && (cc.target_pages > 0 || cc.burst_pages > 0)) {
    cc.target_pages = 0;
    cc.burst_pages = 0;
  }
  const uint32_t asked_target = cc.target_pages, asked_burst = cc.burst_pages;
  /* The admission floor (DESIGN §4): a context that retains anything holds
   * at least its sink page and its newest page. A target of 1 is raised to
   * the floor; with target 0 (pure staging by right) a burst of 1 is raised
   * to it too. A target of 0 and no burst stays: pure staging. */
  const uint32_t floor = akv_admission_floor(e);
  if (cc.target_pages > 0 && cc.target_pages < floor) cc.target_pages = floor;
  if (cc.target_pages == 0 && cc.burst_pages > 0 && cc.burst_pages < floor) cc.burst_pages = floor;
  if (cc.target_pages != asked_target || cc.burst_pages != asked_burst)
    akv_log(e, AKV_LOG_INFO,
            "context_open: target %u + burst %u raised to %u + %u, the floor of %u pages (the "
            "sink and the newest page)",
            asked_target, asked_burst, cc.target_pages, cc.burst_pages, floor);
  /* A record of the process-wide pool, in FIFO order: a closed handle
   * queues behind at least AKV_CONTEXT_HANDLE_REUSE_MIN free records. The
   * engine reserved its concurrency at create, so this take never
   * allocates and never fails; the check guards the invariant. It comes
   * before admission, so that even this failure changes nothing (no id
   * taken, no admission counted or logged). */
  c = akv_rec_take(&akv_context_records);
  if (c == NULL)
    return akv_fail(e, AKV_ERR_OUT_OF_MEMORY, "context_open: no context handle record");
  /* Every open that reaches admission takes a fresh id, refused ones included
   * (explain names them). */
  const uint32_t id = akv_next_context_id(e);
  st = akv_adm_admit(e->adm, e->step, slot, id, cc.target_pages, cc.burst_pages);
  if (st != AKV_OK) {
    char why[900];
    akv_rec_untake(&akv_context_records, c); /* never handed out: back to the head */
    e->refused_asked_target = asked_target;
    e->refused_target = cc.target_pages;
    e->refused_asked_burst = asked_burst;
    e->refused_burst = cc.burst_pages;
    e->refused_queue = false;
    akv_admission_explain(e, NULL, why, sizeof(why));
    return akv_fail(e, st, "context_open: %s", why);
  }
  AKV_STORE(c->engine, e);
  c->slot = slot;
  c->host = e->host_pool + (uint64_t)slot * e->fit.history_bytes;
  c->host_leases = 0;
  c->fill_leases = 0;
  e->slot_owner[slot] = c;
  c->id = id;
  AKV_STORE(c->open, true);
  c->len = 0;
  c->layer_len = e->slot_layer_len + (uint64_t)slot * e->cfg.n_dense_layers;
  memset(c->layer_len, 0, (size_t)e->cfg.n_dense_layers * sizeof(*c->layer_len));
  c->target = cc.target_pages;
  c->burst = cc.burst_pages;
  c->asked_target = asked_target;
  c->asked_burst = asked_burst;
  /* no ticket holds a free slot, so its generation may move */
  c->generation = ++e->slot_generation[slot];
  c->in_step = false;
  AKV_STORE(c->magic_end, AKV_MAGIC_CONTEXT);
  AKV_STORE(c->magic, AKV_MAGIC_CONTEXT); /* live last */
  e->open_contexts++;
  *out = c;
  return AKV_OK;
}

AKV_API akv_status akv_context_open(akv_engine *e, const akv_context_config *config,
                                    akv_context **out) {
  akv_status st = akv_engine_claim(e);
  if (st != AKV_OK) return st;
  st = akv_context_open_claimed(e, config, out);
  akv_engine_release(e);
  return st;
}

static akv_status akv_context_close_claimed(akv_engine *e, akv_context *c) {
  akv_status st;
  if ((st = akv_engine_enter(e, "context_close")) != AKV_OK) return st;
  if (akv_context_in_use(c))
    return akv_fail(e, AKV_ERR_IN_USE, "context_close: context %u is part of the open step",
                    c->id);
  st = akv_adm_release(e->adm, e->step, c->slot);
  if (st != AKV_OK) return akv_fail(e, st, "context_close: admission release failed");
  AKV_STORE(c->open, false);
  c->len = 0;
  memset(c->layer_len, 0, (size_t)e->cfg.n_dense_layers * sizeof(*c->layer_len));
  AKV_STORE(c->magic, AKV_MAGIC_DEAD);
  AKV_STORE(c->magic_end, AKV_MAGIC_DEAD);
  e->slot_owner[c->slot] = NULL;
  e->open_contexts--;
  akv_rec_give(&akv_context_records, c); /* dead, at the tail of the FIFO */
  return AKV_OK;
}

AKV_API akv_status akv_context_close(akv_context *c) {
  akv_engine *e;
  akv_status st = akv_context_claim(c, &e);
  if (st != AKV_OK) return st;
  st = akv_context_close_claimed(e, c);
  akv_engine_release(e);
  return st;
}

static akv_status akv_context_append_claimed(akv_engine *e, akv_context *c, uint32_t n_tokens,
                                             const void *const *k_rows, const void *const *v_rows) {
  akv_status st;
  if ((st = akv_engine_enter(e, "context_append")) != AKV_OK) return st;
  if (k_rows == NULL || v_rows == NULL)
    return akv_fail(e, AKV_ERR_INVALID_ARGUMENT, "context_append: row arrays are NULL");
  for (uint32_t l = 0; l < e->cfg.n_dense_layers; l++)
    if (n_tokens > 0 && (k_rows[l] == NULL || v_rows[l] == NULL))
      return akv_fail(e, AKV_ERR_INVALID_ARGUMENT, "context_append: layer %u rows are NULL", l);
  if (c->in_step)
    return akv_fail(e, AKV_ERR_IN_USE, "context_append: context %u is part of the open step",
                    c->id);
  /* Capacity against the layer holding the most rows (64-bit sum): checked
   * for every layer before any row is copied, so a refusal appends nothing. */
  for (uint32_t l = 0; l < e->cfg.n_dense_layers; l++)
    if ((uint64_t)c->layer_len[l] + n_tokens > e->cfg.max_tokens)
      return akv_fail(e, AKV_ERR_CAPACITY,
                      "context_append: layer %u: %u + %u rows exceed max_tokens=%u; nothing "
                      "appended", l, c->layer_len[l], n_tokens, e->cfg.max_tokens);
  /* n_tokens == 0 copies nothing: row pointers may then be NULL */
  for (uint32_t l = 0; n_tokens > 0 && l < e->cfg.n_dense_layers; l++)
    akv_context_copy_rows(e, c, l, n_tokens, k_rows[l], v_rows[l]);
  akv_context_sync_len(e, c);
  return AKV_OK;
}

AKV_API akv_status akv_context_append(akv_context *c, uint32_t n_tokens,
                                      const void *const *k_rows, const void *const *v_rows) {
  akv_engine *e;
  akv_status st = akv_context_claim(c, &e);
  if (st != AKV_OK) return st;
  st = akv_context_append_claimed(e, c, n_tokens, k_rows, v_rows);
  akv_engine_release(e);
  return st;
}

static akv_status akv_context_append_layer_claimed(akv_engine *e, akv_context *c, uint32_t layer,
                                                   uint32_t n_tokens, const void *k_rows,
                                                   const void *v_rows) {
  akv_status st;
  if ((st = akv_engine_enter(e, "context_append_layer")) != AKV_OK) return st;
  if (layer >= e->cfg.n_dense_layers)
    return akv_fail(e, AKV_ERR_INVALID_ARGUMENT,
                    "context_append_layer: layer %u out of range (%u dense layers)", layer,
                    e->cfg.n_dense_layers);
  if (n_tokens > 0 && (k_rows == NULL || v_rows == NULL))
    return akv_fail(e, AKV_ERR_INVALID_ARGUMENT, "context_append_layer: layer %u rows are NULL",
                    layer);
  if (c->in_step)
    return akv_fail(e, AKV_ERR_IN_USE,
                    "context_append_layer: context %u is part of the open step", c->id);
  /* 64-bit sum: layer_len + n_tokens cannot wrap past max_tokens */
  if ((uint64_t)c->layer_len[layer] + n_tokens > e->cfg.max_tokens)
    return akv_fail(e, AKV_ERR_CAPACITY,
                    "context_append_layer: layer %u: %u + %u rows exceed max_tokens=%u; nothing "
                    "appended", layer, c->layer_len[layer], n_tokens, e->cfg.max_tokens);
  if (n_tokens > 0) akv_context_copy_rows(e, c, layer, n_tokens, k_rows, v_rows);
  akv_context_sync_len(e, c);
  return AKV_OK;
}

AKV_API akv_status akv_context_append_layer(akv_context *c, uint32_t layer, uint32_t n_tokens,
                                            const void *k_rows, const void *v_rows) {
  akv_engine *e;
  akv_status st = akv_context_claim(c, &e);
  if (st != AKV_OK) return st;
  st = akv_context_append_layer_claimed(e, c, layer, n_tokens, k_rows, v_rows);
  akv_engine_release(e);
  return st;
}

static akv_status akv_context_read_claimed(akv_engine *e, const akv_context *c, uint32_t layer,
                                           uint32_t first, uint32_t n, void *k_out, void *v_out) {
  if (layer >= e->cfg.n_dense_layers)
    return akv_fail(e, AKV_ERR_INVALID_ARGUMENT,
                    "context_read: layer %u is not one of the %u dense layers", layer,
                    e->cfg.n_dense_layers);
  if ((uint64_t)first + n > c->layer_len[layer])
    return akv_fail(e, AKV_ERR_INVALID_ARGUMENT,
                    "context_read: rows [%u, %llu) of layer %u, which holds %u rows", first,
                    (unsigned long long)first + n, layer, c->layer_len[layer]);
  if (n > 0 && (k_out == NULL || v_out == NULL))
    return akv_fail(e, AKV_ERR_INVALID_ARGUMENT, "context_read: %s is NULL for %u rows",
                    k_out == NULL ? "k_out" : "v_out", n);
  /* Invariant (akv.h, akv_context_read: allowed while no lease of an open
   * step can write the rows, also after a transport failure): the only
   * writers of a context's host rows are the write-backs of the leases of
   * the step it is part of, and a context leaves the step (in_step) only at
   * akv_step_end, with every lease retired, or at a quarantine that proved
   * completion; an uncertain quarantine keeps it in the step. So in_step is
   * the refusal, not every host page lease: the page fills of a step_begin
   * whose submissions failed hold leases on contexts that never joined a
   * step, and those copies only read the rows. */
  if (c->in_step)
    return akv_fail(e, AKV_ERR_IN_USE, "context_read: context %u is part of the open step",
                    c->id);
  if (n == 0) return AKV_OK; /* the buffers may then be NULL */
  {
    const uint8_t *src = akv_host_layer(e, c, layer) + (uint64_t)first * e->pair_bytes;
    for (uint32_t t = 0; t < n; t++, src += e->pair_bytes) {
      memcpy((uint8_t *)k_out + (uint64_t)t * e->row_bytes, src, e->row_bytes);
      memcpy((uint8_t *)v_out + (uint64_t)t * e->row_bytes, src + e->row_bytes, e->row_bytes);
    }
  }
  return AKV_OK;
}

AKV_API akv_status akv_context_read(const akv_context *c, uint32_t layer, uint32_t first,
                                    uint32_t n, void *k_out, void *v_out) {
  akv_engine *e;
  akv_status st = akv_context_claim(c, &e);
  if (st != AKV_OK) return st;
  st = akv_context_read_claimed(e, c, layer, first, n, k_out, v_out);
  akv_engine_release(e);
  return st;
}

static akv_status akv_context_length_claimed(akv_engine *e, const akv_context *c, uint32_t *out) {
  if (out == NULL) return akv_fail(e, AKV_ERR_INVALID_ARGUMENT, "context_length: out is NULL");
  *out = c->len;
  return AKV_OK;
}

AKV_API akv_status akv_context_length(const akv_context *c, uint32_t *out) {
  akv_engine *e;
  akv_status st = akv_context_claim(c, &e);
  if (st != AKV_OK) return st;
  st = akv_context_length_claimed(e, c, out);
  akv_engine_release(e);
  return st;
}

static akv_status akv_context_id_claimed(akv_engine *e, const akv_context *c, uint32_t *out) {
  if (out == NULL) return akv_fail(e, AKV_ERR_INVALID_ARGUMENT, "context_id: out is NULL");
  *out = c->id;
  return AKV_OK;
}

AKV_API akv_status akv_context_id(const akv_context *c, uint32_t *out) {
  akv_engine *e;
  akv_status st = akv_context_claim(c, &e);
  if (st != AKV_OK) return st;
  st = akv_context_id_claimed(e, c, out);
  akv_engine_release(e);
  return st;
}
