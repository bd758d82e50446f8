/*
 * admission.c - the device page pool allocator (DESIGN §4).
 *
 * Definitions (docs/admission.md states them for operators):
 *  - eff_target: the admitted target, or 0 while admission has revoked it.
 *  - window (wanted set) of an active slot at a boundary: W = min(full_pages,
 *    eff_target + burst) logical pages in priority order: the sink (0), then
 *    full_pages-1, full_pages-2, ... (newest first). Floor = the first two.
 *  - spare page: a resident page of the slot outside its window.
 *  - idle slot: admitted and not part of the latest boundary (at admission:
 *    not part of the last boundary and admitted before it).
 *  - borrowed pages of V: held(V) - eff_target(V) when V's target is intact
 *    (only burst fills can put V above its target).
 *  - above-target pages of V: every page of an active V whose target is
 *    revoked (its target is 0, so all its pages are above it).
 *  - idle-context pages of V: every page of an idle V whose target admission
 *    revoked (it is reclaimed whole, sink last). Pages within an intact
 *    target are never reclaimed, active or idle.
 *  - recency: the last boundary a slot was active in, or the boundary count at
 *    its admission; least recently active first, ties: latest admitted first.
 *
 * A step runs two passes over the active slots in admission order (oldest
 * admission first). Pass 1 (by right) fills the first min(W, eff_target)
 * window positions: own spare, then free page or reclaim only while the slot
 * holds fewer than its target. Pass 2 (window) fills all W positions: own
 * spare, free page, (reclaim while below target), then shrink. So every slot's
 * target is served before anyone borrows a free page in the same boundary.
 * Because admission keeps the intact targets within the pool, pass 1 always
 * gives every active slot with an intact target its first min(W, target)
 * positions (the floor, sink + newest page, among them when target >= 2).
 *
 * Admission: the sum of intact targets must fit n_pages after revoking idle
 * targets least recently active first (only as many as needed); a revoked
 * slot keeps its pages until someone reclaims them and gets its target back
 * at the first boundary it is part of where that fits again (re-admission
 * may revoke idle targets in turn). Log rows: a page move names the taker,
 * its rule, the victim (or NONE) and the pages (consecutive identical moves
 * merge); a revocation is an `admit` row naming the admitted context, the
 * revoked one as victim and the revoked target as pages; counters count
 * pages for the page rules and events (rows with no victim) for refuse,
 * admit and release.
 *
 * Headroom (DESIGN §6): physical pages [n_pages, n_pages + hr_live) are
 * revocable headroom, present between akv_adm_headroom_add and _remove.
 * Targets are admitted against n_pages alone, so headroom never decides an
 * admission. While headroom is present, pass 3 extends each active window to
 * all its full pages (see akv_adm_fill_headroom); pages a slot holds beyond
 * target + burst are its headroom extension, the first rung of reclamation
 * (reclaim-headroom, before borrowed pages). A slot below its target still
 * always finds a free page or a victim: the live pages (n_pages + hr_live)
 * are at least the intact targets.
 *
 * Nothing allocates after akv_adm_create; nothing moves outside akv_adm_step,
 * akv_adm_release and akv_adm_headroom_add/_remove.
 */
#include "admission.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define AKV_ADM_IDLE_SNAPSHOT 8

typedef enum akv_adm_short {
  AKV_ADM_SHORT_NONE = 0,
  AKV_ADM_SHORT_NO_FREE_PAGE = 1,   /* at its target; burst pages are borrowed only while free */
  AKV_ADM_SHORT_NOTHING_RECLAIM = 2 /* below its target and nothing reclaimable (not expected) */
} akv_adm_short;

typedef struct akv_adm_slot {
  uint32_t admitted;
  uint32_t id;
  uint32_t target;     /* admitted target */
  uint32_t burst;
  uint32_t eff_target; /* target, or 0 while revoked */
  uint32_t revoked;
  uint32_t held;       /* resident pages */
  uint64_t seq;        /* admission sequence: processing order */
  uint64_t recency;    /* last boundary active in, or boundary count at admission */
  uint32_t full_pages; /* at the current / last active boundary */
  uint32_t window;     /* W at the current / last active boundary */
  /* Explain material. */
  uint64_t admit_step;
  uint64_t seen_step; /* caller's step of the last active boundary */
  uint32_t seen;      /* 1 once active at some boundary */
  uint32_t gained[AKV_ADM_RULE_COUNT];
  uint32_t short_by;
  akv_adm_short short_reason;
  uint64_t lost_step;
  uint32_t lost_to;
  uint32_t lost_pages;
  akv_adm_rule lost_rule;
  uint32_t lost_any;
  uint64_t revoked_step;
  uint32_t revoked_by;
} akv_adm_slot;

typedef struct akv_adm_refusal {
  uint32_t valid;
  uint64_t step;
  uint32_t id;
  uint32_t target;
  uint32_t burst;
  uint64_t sum_targets;
  uint64_t revocable;
  uint32_t n_idle;
  uint32_t idle_id[AKV_ADM_IDLE_SNAPSHOT];
  uint32_t idle_target[AKV_ADM_IDLE_SNAPSHOT];
} akv_adm_refusal;

struct akv_adm {
  akv_adm_config cfg;
  akv_adm_slot *slots;    /* [max_contexts] */
  uint32_t *map;          /* [max_contexts * max_logical_pages]: physical or NONE */
  uint32_t *page_slot;    /* [n_phys]: owner slot or NONE */
  uint32_t *page_logical; /* [n_phys] */
  uint32_t *free_ring;    /* [n_phys]: FIFO, oldest freed page handed out first */
  uint32_t free_head;
  uint32_t n_free;
  akv_adm_fill *fills;    /* [n_phys]: at most one entry per physical page */
  size_t n_fills;
  uint32_t *fill_at;      /* [n_phys]: index into fills or NONE */
  uint32_t *order;        /* [max_contexts]: scratch, slots in processing order */
  uint32_t *cand;         /* [max_contexts]: scratch, revocable idle slots */
  uint32_t *cursor;       /* [max_contexts]: scratch, pass 3 window position per slot */
  uint64_t *mark;         /* [max_contexts]: scratch, duplicate detection */
  uint64_t mark_stamp;
  uint64_t counters[AKV_ADM_RULE_COUNT];
  akv_adm_decision *log; /* [log_capacity] ring */
  size_t log_next;
  size_t log_count;
  uint64_t epoch;        /* boundaries processed */
  uint64_t seq_next;
  uint64_t sum_targets;  /* sum of eff_target over admitted slots */
  uint32_t n_phys;       /* n_pages + n_headroom_pages: every array above is this long */
  uint32_t hr_live;      /* headroom pages present: [n_pages, n_pages + hr_live) */
  uint64_t cur_step;
  akv_adm_refusal refusal;
};

/* ------------------------------------------------------------------ */
/* Names                                                               */
/* ------------------------------------------------------------------ */

AKV_API const char *akv_adm_rule_string(akv_adm_rule rule) {
  switch (rule) {
  case AKV_ADM_OWN_REUSE:
    return "own-reuse";
  case AKV_ADM_FREE:
    return "free";
  case AKV_ADM_RECLAIM_BORROWED:
    return "reclaim-borrowed";
  case AKV_ADM_RECLAIM_ABOVE_TARGET:
    return "reclaim-above-target";
  case AKV_ADM_RECLAIM_IDLE:
    return "reclaim-idle";
  case AKV_ADM_SHRINK:
    return "shrink";
  case AKV_ADM_REFUSE:
    return "refuse";
  case AKV_ADM_ADMIT:
    return "admit";
  case AKV_ADM_RELEASE:
    return "release";
  case AKV_ADM_RECLAIM_HEADROOM:
    return "reclaim-headroom";
  case AKV_ADM_HEADROOM:
    return "headroom";
  case AKV_ADM_HEADROOM_RELEASE:
    return "headroom-release";
  case AKV_ADM_HEADROOM_TAKE:
    return "headroom-take";
  case AKV_ADM_RULE_COUNT:
    break;
  }
  return "unknown";
}

/* ------------------------------------------------------------------ */
/* Create / destroy                                                    */
/* ------------------------------------------------------------------ */

static void *akv_adm_calloc(size_t n, size_t size) {
  return calloc(n > 0 ? n : 1, size);
}

/* Bytes of one array of n elements (at least one element: see akv_adm_calloc). */
static int akv_adm_array_bytes(uint64_t n, uint64_t size, uint64_t *acc) {
  uint64_t bytes;
  if (n == 0) n = 1;
  if (n > UINT64_MAX / size) return 0;
  bytes = n * size;
  if (bytes > UINT64_MAX - *acc || *acc + bytes > (uint64_t)SIZE_MAX) return 0;
  *acc += bytes;
  return 1;
}

int akv_adm_bytes(const akv_adm_config *config, uint64_t *out) {
  const akv_adm *adm = NULL; /* for the element sizes only */
  uint64_t acc = sizeof *adm, n_map = 0;
  if (config == NULL || out == NULL) return 0;
  if (config->max_logical_pages != 0 &&
      config->max_contexts > UINT64_MAX / config->max_logical_pages)
    return 0;
  n_map = (uint64_t)config->max_contexts * config->max_logical_pages;
  /* Every per-page array covers the physical pages, the pool's and the
   * headroom's (akv_adm_create: n_phys). */
  const uint64_t n_phys = (uint64_t)config->n_pages + config->n_headroom_pages;
  /* The arrays akv_adm_create allocates, in its order. */
  if (!akv_adm_array_bytes(config->max_contexts, sizeof *adm->slots, &acc) ||
      !akv_adm_array_bytes(n_map, sizeof *adm->map, &acc) ||
      !akv_adm_array_bytes(n_phys, sizeof *adm->page_slot, &acc) ||
      !akv_adm_array_bytes(n_phys, sizeof *adm->page_logical, &acc) ||
      !akv_adm_array_bytes(n_phys, sizeof *adm->free_ring, &acc) ||
      !akv_adm_array_bytes(n_phys, sizeof *adm->fills, &acc) ||
      !akv_adm_array_bytes(n_phys, sizeof *adm->fill_at, &acc) ||
      !akv_adm_array_bytes(config->max_contexts, sizeof *adm->order, &acc) ||
      !akv_adm_array_bytes(config->max_contexts, sizeof *adm->cand, &acc) ||
      !akv_adm_array_bytes(config->max_contexts, sizeof *adm->cursor, &acc) ||
      !akv_adm_array_bytes(config->max_contexts, sizeof *adm->mark, &acc) ||
      !akv_adm_array_bytes(config->log_capacity, sizeof *adm->log, &acc))
    return 0;
  *out = acc;
  return 1;
}

akv_status akv_adm_create(const akv_adm_config *config, akv_adm **out) {
  akv_status st = AKV_OK;
  akv_adm *adm = NULL;
  if (config == NULL || out == NULL || config->max_contexts == 0 ||
      config->max_logical_pages == 0 || config->log_capacity == 0) {
    st = AKV_ERR_INVALID_ARGUMENT;
    goto fail;
  }
  if (config->n_headroom_pages > UINT32_MAX - 1 - config->n_pages) {
    st = AKV_ERR_INVALID_ARGUMENT;
    goto fail;
  }
  if ((size_t)config->max_logical_pages > SIZE_MAX / sizeof(uint32_t) / config->max_contexts) {
    st = AKV_ERR_INVALID_ARGUMENT;
    goto fail;
  }
  adm = calloc(1, sizeof *adm);
  if (adm == NULL) {
    st = AKV_ERR_OUT_OF_MEMORY;
    goto fail;
  }
  adm->cfg = *config;
  /* Physical pages: the pool's [0, n_pages), then the headroom's
   * [n_pages, n_pages + n_headroom_pages), absent until akv_adm_pages_add. */
  const uint32_t n_phys = config->n_pages + config->n_headroom_pages;
  adm->n_phys = n_phys;
  size_t n_map = (size_t)config->max_contexts * config->max_logical_pages;
  adm->slots = akv_adm_calloc(config->max_contexts, sizeof *adm->slots);
  adm->map = akv_adm_calloc(n_map, sizeof *adm->map);
  adm->page_slot = akv_adm_calloc(n_phys, sizeof *adm->page_slot);
  adm->page_logical = akv_adm_calloc(n_phys, sizeof *adm->page_logical);
  adm->free_ring = akv_adm_calloc(n_phys, sizeof *adm->free_ring);
  adm->fills = akv_adm_calloc(n_phys, sizeof *adm->fills);
  adm->fill_at = akv_adm_calloc(n_phys, sizeof *adm->fill_at);
  adm->order = akv_adm_calloc(config->max_contexts, sizeof *adm->order);
  adm->cand = akv_adm_calloc(config->max_contexts, sizeof *adm->cand);
  adm->cursor = akv_adm_calloc(config->max_contexts, sizeof *adm->cursor);
  adm->mark = akv_adm_calloc(config->max_contexts, sizeof *adm->mark);
  adm->log = akv_adm_calloc(config->log_capacity, sizeof *adm->log);
  if (!adm->slots || !adm->map || !adm->page_slot || !adm->page_logical ||
      !adm->free_ring || !adm->fills || !adm->fill_at || !adm->order || !adm->cand || !adm->cursor ||
      !adm->mark || !adm->log) {
    st = AKV_ERR_OUT_OF_MEMORY;
    goto fail;
  }
  for (size_t i = 0; i < n_map; i++) adm->map[i] = AKV_ADM_NONE;
  for (uint32_t p = 0; p < n_phys; p++) {
    adm->page_slot[p] = AKV_ADM_NONE;
    adm->page_logical[p] = AKV_ADM_NONE;
    adm->free_ring[p] = p;
    adm->fill_at[p] = AKV_ADM_NONE;
  }
  adm->n_free = config->n_pages;
  *out = adm;
  return AKV_OK;
fail:
  akv_adm_destroy(adm);
  return st;
}

void akv_adm_destroy(akv_adm *adm) {
  if (adm == NULL) return;
  free(adm->slots);
  free(adm->map);
  free(adm->page_slot);
  free(adm->page_logical);
  free(adm->free_ring);
  free(adm->fills);
  free(adm->fill_at);
  free(adm->order);
  free(adm->cand);
  free(adm->cursor);
  free(adm->mark);
  free(adm->log);
  free(adm);
}

/* ------------------------------------------------------------------ */
/* Log and counters                                                    */
/* ------------------------------------------------------------------ */

/* Appends a decision; a page move identical in (step, context, rule, victim)
 * to the newest row is merged into it (pages add up). */
static void akv_adm_log(akv_adm *adm, uint64_t step, uint32_t context, akv_adm_rule rule,
                        uint32_t victim, uint32_t pages, int mergeable) {
  if (mergeable && adm->log_count > 0) {
    size_t last = (adm->log_next + adm->cfg.log_capacity - 1) % adm->cfg.log_capacity;
    akv_adm_decision *d = &adm->log[last];
    if (d->step == step && d->context == context && d->rule == rule && d->victim == victim) {
      d->pages += pages;
      return;
    }
  }
  akv_adm_decision *d = &adm->log[adm->log_next];
  d->step = step;
  d->context = context;
  d->rule = rule;
  d->victim = victim;
  d->pages = pages;
  adm->log_next = (adm->log_next + 1) % adm->cfg.log_capacity;
  if (adm->log_count < adm->cfg.log_capacity) adm->log_count++;
}

/* ------------------------------------------------------------------ */
/* Pages                                                               */
/* ------------------------------------------------------------------ */

static uint32_t *akv_adm_map_at(const akv_adm *adm, uint32_t slot, uint32_t logical) {
  return &adm->map[(size_t)slot * adm->cfg.max_logical_pages + logical];
}

static uint32_t akv_adm_free_pop(akv_adm *adm) {
  uint32_t p = adm->free_ring[adm->free_head];
  adm->free_head = (adm->free_head + 1) % adm->n_phys;
  adm->n_free--;
  return p;
}

static void akv_adm_free_push(akv_adm *adm, uint32_t p) {
  uint32_t at = (uint32_t)(((uint64_t)adm->free_head + adm->n_free) % adm->n_phys);
  adm->free_ring[at] = p;
  adm->n_free++;
}

/* Maps physical page p to (slot, logical) by `rule`: p is either just popped
 * from the free list or still owned by its previous slot (own reuse, shrink,
 * reclaim). Records the fill, the counter, the log row and the explain
 * material of both sides. (The page's previous readers are no concern here:
 * the engine moves residency only at a step boundary, where no reader of any
 * page is live; see akv_step_end.)
 *
 * A page moves at most once per boundary, so fills never name a physical
 * page twice. Own reuse and shrink move a page to a higher-priority window
 * position of the same slot, from which neither takes it again. Reclaim runs
 * only in pass 1 (in pass 2 every slot already holds min(W, target)) and
 * takes up to held - target of a borrowed victim's oldest pages; the victim's
 * own pass-1 moves landed in its first min(W, target) positions, which hold
 * its newest pages, so they are never among those taken. Pages a slot gained
 * in pass 1 bring it to at most its target, so it is no victim afterwards.
 * tests/test_admission.c checks fills == moves at every step; fill_at keeps
 * the contract (one entry per physical page, at most n_pages entries) by
 * construction all the same, should a later rule break the argument. */
static void akv_adm_move(akv_adm *adm, uint32_t p, uint32_t slot, uint32_t logical,
                         akv_adm_rule rule) {
  akv_adm_slot *taker = &adm->slots[slot];
  uint32_t from = adm->page_slot[p];
  uint32_t victim_id = AKV_ADM_NONE;
  if (from != AKV_ADM_NONE) {
    akv_adm_slot *v = &adm->slots[from];
    *akv_adm_map_at(adm, from, adm->page_logical[p]) = AKV_ADM_NONE;
    v->held--;
    if (from != slot) {
      victim_id = v->id;
      if (v->lost_any && v->lost_step == adm->cur_step && v->lost_to == taker->id &&
          v->lost_rule == rule) {
        v->lost_pages++;
      } else {
        v->lost_any = 1;
        v->lost_step = adm->cur_step;
        v->lost_to = taker->id;
        v->lost_rule = rule;
        v->lost_pages = 1;
      }
    }
  }
  adm->page_slot[p] = slot;
  adm->page_logical[p] = logical;
  *akv_adm_map_at(adm, slot, logical) = p;
  taker->held++;
  taker->gained[rule]++;

  akv_adm_fill *f;
  if (adm->fill_at[p] != AKV_ADM_NONE) {
    f = &adm->fills[adm->fill_at[p]];
  } else {
    adm->fill_at[p] = (uint32_t)adm->n_fills;
    f = &adm->fills[adm->n_fills++];
  }
  f->slot = slot;
  f->logical = logical;
  f->physical = p;

  adm->counters[rule]++;
  akv_adm_log(adm, adm->cur_step, taker->id, rule, victim_id, 1, 1);
}

static void akv_adm_clear_fills(akv_adm *adm) {
  for (size_t i = 0; i < adm->n_fills; i++) adm->fill_at[adm->fills[i].physical] = AKV_ADM_NONE;
  adm->n_fills = 0;
}

/* Oldest resident non-sink page of `slot` with logical in [1, below), else the
 * sink when allow_sink, else NONE. Returns the logical page. */
static uint32_t akv_adm_oldest(const akv_adm *adm, uint32_t slot, uint32_t below, int allow_sink) {
  uint32_t lim = below < adm->cfg.max_logical_pages ? below : adm->cfg.max_logical_pages;
  for (uint32_t l = 1; l < lim; l++)
    if (*akv_adm_map_at(adm, slot, l) != AKV_ADM_NONE) return l;
  if (allow_sink && *akv_adm_map_at(adm, slot, 0) != AKV_ADM_NONE) return 0;
  return AKV_ADM_NONE;
}

/* Window position i of a slot (0 = sink, then newest first). */
static uint32_t akv_adm_window_logical(const akv_adm_slot *s, uint32_t i) {
  return i == 0 ? 0 : s->full_pages - i;
}

/* Oldest spare page (resident, outside the window): non-sink pages below the
 * window's oldest position or at/after full_pages, then the sink when the
 * window is empty. */
static uint32_t akv_adm_spare(const akv_adm *adm, uint32_t slot) {
  const akv_adm_slot *s = &adm->slots[slot];
  if (s->held == 0) return AKV_ADM_NONE;
  if (s->window == 0) return akv_adm_oldest(adm, slot, adm->cfg.max_logical_pages, 1);
  uint32_t lo = s->full_pages - s->window + 1; /* oldest non-sink window page */
  uint32_t l = akv_adm_oldest(adm, slot, lo, 0);
  if (l != AKV_ADM_NONE) return l;
  for (l = s->full_pages; l < adm->cfg.max_logical_pages; l++)
    if (*akv_adm_map_at(adm, slot, l) != AKV_ADM_NONE) return l;
  return AKV_ADM_NONE;
}

/* Reclaim class of victim v, or AKV_ADM_RULE_COUNT if none: headroom (held
 * above target + burst: reclaim rung 0), borrowed (intact target, held above
 * it), above target (target revoked, active at this
 * boundary), idle (target revoked, idle: reclaimed whole). Pages within an
 * intact target are never reclaimed, whether their context is active or idle;
 * only admission revokes a target. Because admission keeps the intact targets
 * within the pool, a slot below its target always finds a free page or a
 * victim here. */
static akv_adm_rule akv_adm_victim_class(const akv_adm_slot *v, int idle) {
  if (!v->admitted || v->held == 0) return AKV_ADM_RULE_COUNT;
  /* Reclaim 0 (headroom): pages an intact target holds beyond target +
   * burst, which only the headroom extension of a window (pass 3) puts
   * there. Taken back first. (With a revoked target every page is already
   * above target: rungs 2 and 3.) */
  if (!v->revoked && (uint64_t)v->held > (uint64_t)v->eff_target + v->burst)
    return AKV_ADM_RECLAIM_HEADROOM;
  if (!v->revoked) return v->held > v->eff_target ? AKV_ADM_RECLAIM_BORROWED : AKV_ADM_RULE_COUNT;
  return idle ? AKV_ADM_RECLAIM_IDLE : AKV_ADM_RECLAIM_ABOVE_TARGET;
}

/* Position of a reclaim class in the reclamation order (lower goes first). */
static int akv_adm_reclaim_rank(akv_adm_rule r) {
  switch (r) {
  case AKV_ADM_RECLAIM_HEADROOM:
    return 0;
  case AKV_ADM_RECLAIM_BORROWED:
    return 1;
  case AKV_ADM_RECLAIM_ABOVE_TARGET:
    return 2;
  case AKV_ADM_RECLAIM_IDLE:
    return 3;
  default:
    return 4;
  }
}

/* Idle: admitted and not part of the latest boundary. Between boundaries a
 * slot admitted since the last one is not idle (recency == epoch): it has not
 * yet had a boundary to be active in. */
static int akv_adm_is_idle(const akv_adm *adm, const akv_adm_slot *s) {
  return s->admitted && s->recency < adm->epoch;
}

/* a is less recently active than b (reclaimed first). */
static int akv_adm_lra_before(const akv_adm_slot *a, const akv_adm_slot *b) {
  if (a->recency != b->recency) return a->recency < b->recency;
  return a->seq > b->seq; /* tie: the latest admitted yields first */
}

/* The victim slot for `taker` by the reclamation order, or NONE. */
static uint32_t akv_adm_pick_victim(const akv_adm *adm, uint32_t taker, akv_adm_rule *rule) {
  uint32_t best = AKV_ADM_NONE;
  akv_adm_rule best_rule = AKV_ADM_RULE_COUNT;
  for (uint32_t s = 0; s < adm->cfg.max_contexts; s++) {
    if (s == taker) continue;
    akv_adm_rule r = akv_adm_victim_class(&adm->slots[s], akv_adm_is_idle(adm, &adm->slots[s]));
    if (r == AKV_ADM_RULE_COUNT) continue;
    if (best == AKV_ADM_NONE || akv_adm_reclaim_rank(r) < akv_adm_reclaim_rank(best_rule) ||
        (r == best_rule && akv_adm_lra_before(&adm->slots[s], &adm->slots[best]))) {
      best = s;
      best_rule = r;
    }
  }
  *rule = best_rule;
  return best;
}

/* Fills window positions [0, limit) of `slot`. by_right: pass 1 (free pages
 * and reclaim only below target, no shrink); otherwise pass 2. */
static void akv_adm_fill_slot(akv_adm *adm, uint32_t slot, uint32_t limit, int by_right) {
  akv_adm_slot *s = &adm->slots[slot];
  for (uint32_t i = 0; i < limit; i++) {
    uint32_t l = akv_adm_window_logical(s, i);
    if (*akv_adm_map_at(adm, slot, l) != AKV_ADM_NONE) continue;
    /* 1. one of its own pages that fell outside its window */
    uint32_t own = akv_adm_spare(adm, slot);
    if (own != AKV_ADM_NONE) {
      akv_adm_move(adm, *akv_adm_map_at(adm, slot, own), slot, l, AKV_ADM_OWN_REUSE);
      continue;
    }
    int below_target = s->held < s->eff_target;
    /* 2. a free page (pass 1: only toward its target) */
    if (adm->n_free > 0 && (!by_right || below_target)) {
      akv_adm_move(adm, akv_adm_free_pop(adm), slot, l, AKV_ADM_FREE);
      continue;
    }
    /* 3. reclaim, only while it holds fewer than its target */
    if (below_target) {
      akv_adm_rule rule;
      uint32_t v = akv_adm_pick_victim(adm, slot, &rule);
      if (v != AKV_ADM_NONE) {
        uint32_t vl = akv_adm_oldest(adm, v, adm->cfg.max_logical_pages, 1);
        akv_adm_move(adm, *akv_adm_map_at(adm, v, vl), slot, l, rule);
        continue;
      }
    }
    if (by_right) continue;
    /* 4. shrink from its oldest non-sink page, keeping the tail hot: take a
     * resident window page of lower priority than position i. */
    uint32_t old = akv_adm_oldest(adm, slot, i == 0 ? adm->cfg.max_logical_pages : l, 0);
    if (old == AKV_ADM_NONE) return; /* nothing of lower priority is resident */
    akv_adm_move(adm, *akv_adm_map_at(adm, slot, old), slot, l, AKV_ADM_SHRINK);
  }
}

/* An idle slot holding pages beyond target + burst (its headroom extension),
 * least recently active first, or NONE: what pass 3 may take back when no
 * page is free. */
static uint32_t akv_adm_idle_headroom_victim(const akv_adm *adm, uint32_t taker) {
  uint32_t best = AKV_ADM_NONE;
  for (uint32_t s = 0; s < adm->cfg.max_contexts; s++) {
    const akv_adm_slot *v = &adm->slots[s];
    if (s == taker || !akv_adm_is_idle(adm, v)) continue;
    if (akv_adm_victim_class(v, 1) != AKV_ADM_RECLAIM_HEADROOM) continue;
    if (best == AKV_ADM_NONE || akv_adm_lra_before(v, &adm->slots[best])) best = s;
  }
  return best;
}

/* Pass 3, the headroom extension (only while headroom pages are present):
 * every active slot's window grows to all its full pages, and the positions
 * past target + burst are filled round-robin, one page per slot per round in
 * admission order, from a free page (rule headroom), else from the headroom
 * extension of an idle slot (reclaim-headroom), else by shrinking from the
 * slot's own oldest page (keeping the tail hot). Pages placed here are
 * beyond target + burst: reclaim rung 0 takes them back first. */
static void akv_adm_fill_headroom(akv_adm *adm, uint32_t n) {
  for (uint32_t i = 0; i < n; i++) adm->cursor[i] = adm->slots[adm->order[i]].window;
  for (int progress = 1; progress;) {
    progress = 0;
    for (uint32_t i = 0; i < n; i++) {
      const uint32_t slot = adm->order[i];
      akv_adm_slot *s = &adm->slots[slot];
      uint32_t *cur = &adm->cursor[i];
      while (*cur < s->full_pages &&
             *akv_adm_map_at(adm, slot, akv_adm_window_logical(s, *cur)) != AKV_ADM_NONE)
        (*cur)++;
      if (*cur >= s->full_pages) continue;
      const uint32_t l = akv_adm_window_logical(s, *cur);
      uint32_t v;
      if (adm->n_free > 0) {
        akv_adm_move(adm, akv_adm_free_pop(adm), slot, l, AKV_ADM_HEADROOM);
      } else if ((v = akv_adm_idle_headroom_victim(adm, slot)) != AKV_ADM_NONE) {
        uint32_t vl = akv_adm_oldest(adm, v, adm->cfg.max_logical_pages, 1);
        akv_adm_move(adm, *akv_adm_map_at(adm, v, vl), slot, l, AKV_ADM_RECLAIM_HEADROOM);
      } else {
        uint32_t old = akv_adm_oldest(adm, slot, *cur == 0 ? adm->cfg.max_logical_pages : l, 0);
        if (old == AKV_ADM_NONE) {
          *cur = s->full_pages; /* nothing of lower priority is resident */
          continue;
        }
        akv_adm_move(adm, *akv_adm_map_at(adm, slot, old), slot, l, AKV_ADM_SHRINK);
      }
      (*cur)++;
      progress = 1;
    }
  }
}

/* ------------------------------------------------------------------ */
/* Admission arithmetic                                                */
/* ------------------------------------------------------------------ */

/* Puts the idle slots with a revocable target (intact, > 0) into adm->cand,
 * least recently active first; returns their number. */
static uint32_t akv_adm_revocable(akv_adm *adm, uint32_t exclude) {
  uint32_t n = 0;
  for (uint32_t s = 0; s < adm->cfg.max_contexts; s++) {
    const akv_adm_slot *v = &adm->slots[s];
    if (s == exclude || !v->admitted || !akv_adm_is_idle(adm, v) || v->revoked ||
        v->eff_target == 0)
      continue;
    uint32_t j = n++;
    while (j > 0 && akv_adm_lra_before(v, &adm->slots[adm->cand[j - 1]])) {
      adm->cand[j] = adm->cand[j - 1];
      j--;
    }
    adm->cand[j] = s;
  }
  return n;
}

/* Can `target` more pages of target be admitted, revoking idle targets LRA
 * first? On success with commit, revokes exactly the LRA prefix needed. */
static int akv_adm_make_room(akv_adm *adm, uint64_t step, uint32_t slot, uint32_t by_id,
                             uint32_t target, int commit, uint64_t *revocable_out) {
  uint64_t n_pages = adm->cfg.n_pages;
  uint32_t n = akv_adm_revocable(adm, slot);
  uint64_t revocable = 0;
  for (uint32_t i = 0; i < n; i++) revocable += adm->slots[adm->cand[i]].eff_target;
  if (revocable_out) *revocable_out = revocable;
  if (adm->sum_targets + target <= n_pages) return 1;
  if (adm->sum_targets - revocable + target > n_pages) return 0;
  if (!commit) return 1;
  for (uint32_t i = 0; i < n && adm->sum_targets + target > n_pages; i++) {
    akv_adm_slot *v = &adm->slots[adm->cand[i]];
    adm->sum_targets -= v->eff_target;
    akv_adm_log(adm, step, by_id, AKV_ADM_ADMIT, v->id, v->eff_target, 0);
    v->eff_target = 0;
    v->revoked = 1;
    v->revoked_step = step;
    v->revoked_by = by_id;
  }
  return 1;
}

akv_status akv_adm_admit(akv_adm *adm, uint64_t step, uint32_t slot, uint32_t id,
                         uint32_t target, uint32_t burst) {
  akv_status st = AKV_OK;
  if (adm == NULL || slot >= adm->cfg.max_contexts || adm->slots[slot].admitted) {
    st = AKV_ERR_INVALID_ARGUMENT;
    goto fail;
  }
  uint64_t revocable = 0;
  if (target > 0 && !akv_adm_make_room(adm, step, slot, id, target, 0, &revocable)) {
    akv_adm_refusal *r = &adm->refusal;
    memset(r, 0, sizeof *r);
    r->valid = 1;
    r->step = step;
    r->id = id;
    r->target = target;
    r->burst = burst;
    r->sum_targets = adm->sum_targets;
    r->revocable = revocable;
    for (uint32_t s = 0; s < adm->cfg.max_contexts; s++) {
      const akv_adm_slot *v = &adm->slots[s];
      if (!v->admitted || !akv_adm_is_idle(adm, v)) continue;
      if (r->n_idle < AKV_ADM_IDLE_SNAPSHOT) {
        r->idle_id[r->n_idle] = v->id;
        r->idle_target[r->n_idle] = v->eff_target;
      }
      r->n_idle++;
    }
    adm->counters[AKV_ADM_REFUSE]++;
    akv_adm_log(adm, step, id, AKV_ADM_REFUSE, AKV_ADM_NONE, target, 0);
    st = AKV_ERR_ADMISSION_REFUSED;
    goto fail;
  }
  if (target > 0) akv_adm_make_room(adm, step, slot, id, target, 1, NULL);

  akv_adm_slot *s = &adm->slots[slot];
  memset(s, 0, sizeof *s);
  s->admitted = 1;
  s->id = id;
  s->target = target;
  s->burst = burst;
  s->eff_target = target;
  s->seq = adm->seq_next++;
  s->recency = adm->epoch;
  s->admit_step = step;
  s->lost_to = AKV_ADM_NONE;
  s->revoked_by = AKV_ADM_NONE;
  adm->sum_targets += target;
  adm->counters[AKV_ADM_ADMIT]++;
  akv_adm_log(adm, step, id, AKV_ADM_ADMIT, AKV_ADM_NONE, target, 0);
  return AKV_OK;
fail:
  return st;
}

akv_status akv_adm_release(akv_adm *adm, uint64_t step, uint32_t slot) {
  akv_status st = AKV_OK;
  if (adm == NULL || slot >= adm->cfg.max_contexts || !adm->slots[slot].admitted) {
    st = AKV_ERR_INVALID_ARGUMENT;
    goto fail;
  }
  akv_adm_clear_fills(adm);
  akv_adm_slot *s = &adm->slots[slot];
  uint32_t freed = s->held;
  /* Pages return to the free list oldest logical first. */
  for (uint32_t l = 0; l < adm->cfg.max_logical_pages && s->held > 0; l++) {
    uint32_t *m = akv_adm_map_at(adm, slot, l);
    if (*m == AKV_ADM_NONE) continue;
    adm->page_slot[*m] = AKV_ADM_NONE;
    adm->page_logical[*m] = AKV_ADM_NONE;
    akv_adm_free_push(adm, *m);
    *m = AKV_ADM_NONE;
    s->held--;
  }
  adm->sum_targets -= s->eff_target;
  uint32_t id = s->id;
  memset(s, 0, sizeof *s);
  adm->counters[AKV_ADM_RELEASE]++;
  akv_adm_log(adm, step, id, AKV_ADM_RELEASE, AKV_ADM_NONE, freed, 0);
  return AKV_OK;
fail:
  return st;
}

/* ------------------------------------------------------------------ */
/* The step boundary                                                   */
/* ------------------------------------------------------------------ */

static akv_status akv_adm_check_requests(akv_adm *adm, const akv_adm_request *requests,
                                         uint32_t n) {
  if (n > 0 && requests == NULL) return AKV_ERR_INVALID_ARGUMENT;
  if (n > adm->cfg.max_contexts) return AKV_ERR_INVALID_ARGUMENT;
  adm->mark_stamp++; /* scratch only: no observable state changes */
  for (uint32_t i = 0; i < n; i++) {
    uint32_t slot = requests[i].slot;
    if (slot >= adm->cfg.max_contexts || !adm->slots[slot].admitted)
      return AKV_ERR_INVALID_ARGUMENT;
    if (requests[i].full_pages > adm->cfg.max_logical_pages) return AKV_ERR_INVALID_ARGUMENT;
    if (adm->mark[slot] == adm->mark_stamp) return AKV_ERR_INVALID_ARGUMENT;
    adm->mark[slot] = adm->mark_stamp;
  }
  return AKV_OK;
}

akv_status akv_adm_step(akv_adm *adm, uint64_t step, const akv_adm_request *requests,
                        uint32_t n_requests) {
  akv_status st = AKV_OK;
  if (adm == NULL) {
    st = AKV_ERR_INVALID_ARGUMENT;
    goto fail;
  }
  st = akv_adm_check_requests(adm, requests, n_requests);
  if (st != AKV_OK) goto fail;

  akv_adm_clear_fills(adm);
  adm->epoch++;
  adm->cur_step = step;
  for (uint32_t i = 0; i < n_requests; i++) {
    akv_adm_slot *s = &adm->slots[requests[i].slot];
    s->recency = adm->epoch;
    s->full_pages = requests[i].full_pages;
    s->seen = 1;
    s->seen_step = step;
    memset(s->gained, 0, sizeof s->gained);
  }
  /* Processing order: admission order, oldest first (insertion sort into
   * order[0..n) by seq; n <= max_contexts). */
  uint32_t n = 0;
  for (uint32_t i = 0; i < n_requests; i++) {
    uint32_t slot = requests[i].slot;
    uint32_t j = n++;
    while (j > 0 && adm->slots[adm->order[j - 1]].seq > adm->slots[slot].seq) {
      adm->order[j] = adm->order[j - 1];
      j--;
    }
    adm->order[j] = slot;
  }
  /* Re-admission: an active slot whose target was revoked gets it back when
   * the targets fit, revoking idle targets LRA first like an admission. */
  for (uint32_t i = 0; i < n; i++) {
    akv_adm_slot *s = &adm->slots[adm->order[i]];
    if (!s->revoked || s->target == 0) continue;
    if (!akv_adm_make_room(adm, step, adm->order[i], s->id, s->target, 1, NULL)) continue;
    s->revoked = 0;
    s->eff_target = s->target;
    adm->sum_targets += s->target;
    adm->counters[AKV_ADM_ADMIT]++;
    akv_adm_log(adm, step, s->id, AKV_ADM_ADMIT, AKV_ADM_NONE, s->target, 0);
  }

  for (uint32_t i = 0; i < n; i++) {
    akv_adm_slot *s = &adm->slots[adm->order[i]];
    uint64_t cap = (uint64_t)s->eff_target + s->burst;
    s->window = (uint32_t)(cap < s->full_pages ? cap : s->full_pages);
  }
  /* Pass 1: by right, toward each target. */
  for (uint32_t i = 0; i < n; i++) {
    akv_adm_slot *s = &adm->slots[adm->order[i]];
    uint32_t limit = s->window < s->eff_target ? s->window : s->eff_target;
    akv_adm_fill_slot(adm, adm->order[i], limit, 1);
  }
  /* Pass 2: the whole window (burst from free pages, then shrink). */
  for (uint32_t i = 0; i < n; i++) {
    akv_adm_slot *s = &adm->slots[adm->order[i]];
    akv_adm_fill_slot(adm, adm->order[i], s->window, 0);
  }
  /* Pass 3: the headroom extension, while headroom pages are present. */
  if (adm->hr_live > 0) akv_adm_fill_headroom(adm, n);
  /* Explain material: how far each active slot is from its window. */
  for (uint32_t i = 0; i < n; i++) {
    akv_adm_slot *s = &adm->slots[adm->order[i]];
    uint32_t resident = 0;
    for (uint32_t w = 0; w < s->window; w++)
      if (*akv_adm_map_at(adm, adm->order[i], akv_adm_window_logical(s, w)) != AKV_ADM_NONE)
        resident++;
    s->short_by = s->window - resident;
    s->short_reason = s->short_by == 0                ? AKV_ADM_SHORT_NONE
                      : s->held >= s->eff_target      ? AKV_ADM_SHORT_NO_FREE_PAGE
                                                      : AKV_ADM_SHORT_NOTHING_RECLAIM;
  }
  return AKV_OK;
fail:
  return st;
}

/* ------------------------------------------------------------------ */
/* Headroom pages                                                      */
/* ------------------------------------------------------------------ */

akv_status akv_adm_headroom_add(akv_adm *adm, uint64_t step, uint32_t count) {
  if (adm == NULL || count > adm->cfg.n_headroom_pages - adm->hr_live)
    return AKV_ERR_INVALID_ARGUMENT;
  if (count == 0) return AKV_OK;
  akv_adm_clear_fills(adm);
  for (uint32_t k = 0; k < count; k++) {
    const uint32_t p = adm->cfg.n_pages + adm->hr_live + k;
    adm->page_slot[p] = AKV_ADM_NONE;
    adm->page_logical[p] = AKV_ADM_NONE;
    akv_adm_free_push(adm, p);
  }
  adm->hr_live += count;
  adm->counters[AKV_ADM_HEADROOM_TAKE] += count;
  akv_adm_log(adm, step, AKV_ADM_NONE, AKV_ADM_HEADROOM_TAKE, AKV_ADM_NONE, count, 0);
  return AKV_OK;
}

akv_status akv_adm_headroom_remove(akv_adm *adm, uint64_t step, uint32_t count) {
  if (adm == NULL || count > adm->hr_live) return AKV_ERR_INVALID_ARGUMENT;
  if (count == 0) return AKV_OK;
  akv_adm_clear_fills(adm);
  const uint32_t first = adm->cfg.n_pages + adm->hr_live - count;
  /* Mapped pages leave their slots (the host stays authoritative: the rows
   * are staged again from it). The log gets one row per slot that lost
   * pages, whatever the interleaving of owners (pass 3 hands headroom out
   * round-robin, so neighbouring pages usually belong to different slots),
   * then one summary row: a release of any size costs the bounded log at
   * most max_contexts + 1 rows. Scratch: cursor[slot] counts the pages a
   * slot lost here, cand lists those slots in the order of their first loss
   * (both are rewritten by every step before use). */
  uint32_t n_victims = 0;
  for (uint32_t s = 0; s < adm->cfg.max_contexts; s++) adm->cursor[s] = 0;
  for (uint32_t p = first; p < first + count; p++) {
    const uint32_t from = adm->page_slot[p];
    if (from == AKV_ADM_NONE) continue;
    akv_adm_slot *v = &adm->slots[from];
    if (adm->cursor[from]++ == 0) adm->cand[n_victims++] = from;
    *akv_adm_map_at(adm, from, adm->page_logical[p]) = AKV_ADM_NONE;
    v->held--;
    if (v->lost_any && v->lost_step == step && v->lost_to == AKV_ADM_NONE &&
        v->lost_rule == AKV_ADM_HEADROOM_RELEASE) {
      v->lost_pages++;
    } else {
      v->lost_any = 1;
      v->lost_step = step;
      v->lost_to = AKV_ADM_NONE;
      v->lost_rule = AKV_ADM_HEADROOM_RELEASE;
      v->lost_pages = 1;
    }
    adm->page_slot[p] = AKV_ADM_NONE;
    adm->page_logical[p] = AKV_ADM_NONE;
  }
  for (uint32_t i = 0; i < n_victims; i++)
    akv_adm_log(adm, step, AKV_ADM_NONE, AKV_ADM_HEADROOM_RELEASE, adm->slots[adm->cand[i]].id,
                adm->cursor[adm->cand[i]], 0);
  /* Free pages among them leave the free list (kept in its FIFO order). */
  uint32_t kept = 0;
  for (uint32_t k = 0; k < adm->n_free; k++) {
    uint32_t p = adm->free_ring[(adm->free_head + k) % adm->n_phys];
    if (p >= first && p < first + count) continue;
    adm->free_ring[(adm->free_head + kept) % adm->n_phys] = p;
    kept++;
  }
  adm->n_free = kept;
  adm->hr_live -= count;
  adm->counters[AKV_ADM_HEADROOM_RELEASE] += count;
  akv_adm_log(adm, step, AKV_ADM_NONE, AKV_ADM_HEADROOM_RELEASE, AKV_ADM_NONE, count, 0);
  return AKV_OK;
}

uint32_t akv_adm_page_owner(const akv_adm *adm, uint32_t physical) {
  if (adm == NULL || physical >= adm->n_phys) return AKV_ADM_NONE;
  return adm->page_slot[physical];
}

uint32_t akv_adm_headroom_pages(const akv_adm *adm) { return adm != NULL ? adm->hr_live : 0; }

uint32_t akv_adm_headroom_held(const akv_adm *adm, uint32_t slot) {
  if (adm == NULL || slot >= adm->cfg.max_contexts) return 0;
  const akv_adm_slot *s = &adm->slots[slot];
  uint64_t by_right = (uint64_t)s->eff_target + s->burst;
  return !s->revoked && s->held > by_right ? (uint32_t)(s->held - by_right) : 0;
}

/* ------------------------------------------------------------------ */
/* Queries                                                             */
/* ------------------------------------------------------------------ */

uint32_t akv_adm_page_of(const akv_adm *adm, uint32_t slot, uint32_t logical) {
  if (adm == NULL || slot >= adm->cfg.max_contexts || logical >= adm->cfg.max_logical_pages)
    return AKV_ADM_NONE;
  return *akv_adm_map_at(adm, slot, logical);
}

uint32_t akv_adm_pages_held(const akv_adm *adm, uint32_t slot) {
  if (adm == NULL || slot >= adm->cfg.max_contexts) return 0;
  return adm->slots[slot].held;
}

size_t akv_adm_fills(const akv_adm *adm, const akv_adm_fill **out) {
  if (adm == NULL) {
    if (out) *out = NULL;
    return 0;
  }
  if (out) *out = adm->fills;
  return adm->n_fills;
}

void akv_adm_counters(const akv_adm *adm, uint64_t out[AKV_ADM_RULE_COUNT]) {
  if (adm == NULL || out == NULL) return;
  memcpy(out, adm->counters, sizeof adm->counters);
}

size_t akv_adm_log_read(const akv_adm *adm, akv_adm_decision *out, size_t cap) {
  if (adm == NULL || out == NULL) return 0;
  size_t n = adm->log_count < cap ? adm->log_count : cap;
  size_t cap_log = adm->cfg.log_capacity;
  /* The newest n rows, oldest first. */
  size_t first = (adm->log_next + cap_log - n) % cap_log;
  for (size_t i = 0; i < n; i++) out[i] = adm->log[(first + i) % cap_log];
  return n;
}

/* ------------------------------------------------------------------ */
/* Explain                                                             */
/* ------------------------------------------------------------------ */

typedef struct akv_adm_text {
  char *buf;
  size_t cap;
  size_t len; /* characters that would have been written */
} akv_adm_text;

static void akv_adm_say(akv_adm_text *t, const char *fmt, ...) {
  va_list ap;
  char *at = NULL;
  size_t room = 0;
  if (t->buf != NULL && t->len < t->cap) {
    at = t->buf + t->len;
    room = t->cap - t->len;
  }
  va_start(ap, fmt);
  int n = vsnprintf(at, room, fmt, ap);
  va_end(ap);
  if (n > 0) t->len += (size_t)n;
}

static const char *akv_adm_plural(uint64_t n) { return n == 1 ? "" : "s"; }

static const char *akv_adm_rule_words(akv_adm_rule rule) {
  switch (rule) {
  case AKV_ADM_RECLAIM_BORROWED:
    return "borrowed pages";
  case AKV_ADM_RECLAIM_ABOVE_TARGET:
    return "pages above its revoked target";
  case AKV_ADM_RECLAIM_IDLE:
    return "an idle context with a revoked target";
  case AKV_ADM_RECLAIM_HEADROOM:
    return "headroom pages beyond its target + burst, taken back first";
  case AKV_ADM_HEADROOM_RELEASE:
    return "headroom given back to the caller";
  default:
    return akv_adm_rule_string(rule);
  }
}

static void akv_adm_explain_refusal(const akv_adm *adm, akv_adm_text *t) {
  const akv_adm_refusal *r = &adm->refusal;
  if (!r->valid) {
    akv_adm_say(t, "No context has been refused admission.");
    return;
  }
  uint64_t n_pages = adm->cfg.n_pages;
  akv_adm_say(t,
              "context %u was refused at step %llu: it asked for a target of %u page%s (+%u "
              "burst), but admitted targets %llu + %u = %llu exceed the %llu-page pool",
              (unsigned)r->id, (unsigned long long)r->step, (unsigned)r->target,
              akv_adm_plural(r->target), (unsigned)r->burst, (unsigned long long)r->sum_targets,
              (unsigned)r->target, (unsigned long long)(r->sum_targets + r->target),
              (unsigned long long)n_pages);
  if (r->n_idle == 0) {
    akv_adm_say(t, ", and no idle context holds a target that could be revoked");
  } else {
    akv_adm_say(t, ", and the idle context%s ", akv_adm_plural(r->n_idle));
    uint32_t shown = r->n_idle < AKV_ADM_IDLE_SNAPSHOT ? r->n_idle : AKV_ADM_IDLE_SNAPSHOT;
    for (uint32_t i = 0; i < shown; i++)
      akv_adm_say(t, "%s%u (target %u)", i == 0 ? "" : (i + 1 == shown ? " and " : ", "),
                  (unsigned)r->idle_id[i], (unsigned)r->idle_target[i]);
    if (r->n_idle > shown) akv_adm_say(t, " and %u more", (unsigned)(r->n_idle - shown));
    akv_adm_say(t, " could give back only %llu page%s", (unsigned long long)r->revocable,
                akv_adm_plural(r->revocable));
  }
  uint64_t kept = r->sum_targets - r->revocable; /* targets that stay */
  uint64_t room = kept <= n_pages ? n_pages - kept : 0;
  /* Invariant (akv.h, akv_admission_explain): the target the explanation
   * says would be admitted is one an open would admit. An open raises a
   * target below the floor (the sink and the newest page: 2 pages, 1 where
   * a context has only one page) to the floor, so with less room than the
   * floor no target but 0 is admitted, and saying "at most 1 page" sent the
   * caller to an open that was refused again. */
  const uint64_t floor = adm->cfg.max_logical_pages < 2 ? adm->cfg.max_logical_pages : 2;
  if (room >= floor)
    akv_adm_say(t, " (%llu short). A target of at most %llu page%s would be admitted now; close a "
                   "context, lower the target, or open it with target 0 (pure staging).",
                (unsigned long long)(r->target - room), (unsigned long long)room,
                akv_adm_plural(room));
  else
    akv_adm_say(t, " (%llu short). Only target 0 (pure staging) would be admitted now: %llu "
                   "page%s of the pool %s free of targets, and a target is raised to the floor "
                   "of %llu pages (the sink and the newest page); close a context, or open it "
                   "with target 0.",
                (unsigned long long)(r->target - room), (unsigned long long)room,
                akv_adm_plural(room), room == 1 ? "is" : "are", (unsigned long long)floor);
}

size_t akv_adm_explain(const akv_adm *adm, uint32_t slot, char *buf, size_t cap) {
  akv_adm_text t = {buf, cap, 0};
  if (buf != NULL && cap > 0) buf[0] = '\0';
  if (adm == NULL) return 0;
  if (slot == AKV_ADM_NONE) {
    akv_adm_explain_refusal(adm, &t);
    return t.len;
  }
  if (slot >= adm->cfg.max_contexts || !adm->slots[slot].admitted) {
    akv_adm_say(&t, "slot %u holds no admitted context.", (unsigned)slot);
    return t.len;
  }
  const akv_adm_slot *s = &adm->slots[slot];
  akv_adm_say(&t, "context %u holds %u page%s against its target of %u (+%u burst)",
              (unsigned)s->id, (unsigned)s->held, akv_adm_plural(s->held), (unsigned)s->target,
              (unsigned)s->burst);
  if (s->revoked)
    akv_adm_say(&t, "; its target was revoked at step %llu to admit context %u while it was "
                    "idle: its pages may be reclaimed, and it gets its target back at a step it "
                    "is part of once the targets fit again",
                (unsigned long long)s->revoked_step, (unsigned)s->revoked_by);
  if (!s->seen) {
    akv_adm_say(&t, "; admitted at step %llu, it has not been part of a step yet.",
                (unsigned long long)s->admit_step);
    return t.len;
  }
  if (s->window == 0)
    akv_adm_say(&t, ". At step %llu its window was empty (%u full page%s, target + burst %llu)",
                (unsigned long long)s->seen_step, (unsigned)s->full_pages,
                akv_adm_plural(s->full_pages),
                (unsigned long long)((uint64_t)s->eff_target + s->burst));
  else
    akv_adm_say(&t, ". At step %llu its window wanted %u of its %u full page%s (the sink, then "
                    "the newest)",
                (unsigned long long)s->seen_step, (unsigned)s->window, (unsigned)s->full_pages,
                akv_adm_plural(s->full_pages));
  static const char *const verbs[AKV_ADM_RULE_COUNT] = {
      [AKV_ADM_OWN_REUSE] = "remapped %u own page%s that left its window",
      [AKV_ADM_FREE] = "took %u free page%s",
      [AKV_ADM_RECLAIM_BORROWED] = "reclaimed %u borrowed page%s",
      [AKV_ADM_RECLAIM_ABOVE_TARGET] = "reclaimed %u page%s above others' targets",
      [AKV_ADM_RECLAIM_IDLE] = "reclaimed %u page%s of idle contexts",
      [AKV_ADM_SHRINK] = "shrank its window by %u page%s",
      [AKV_ADM_RECLAIM_HEADROOM] = "took back %u headroom page%s from others",
      [AKV_ADM_HEADROOM] = "retained %u more page%s in headroom"};
  uint32_t n_moves = 0, done = 0;
  for (int r = 0; r < AKV_ADM_RULE_COUNT; r++) n_moves += verbs[r] != NULL && s->gained[r] > 0;
  for (int r = 0; r < AKV_ADM_RULE_COUNT; r++) {
    if (verbs[r] == NULL || s->gained[r] == 0) continue;
    akv_adm_say(&t, done == 0 ? "; it " : (done + 1 == n_moves ? " and " : ", "));
    akv_adm_say(&t, verbs[r], (unsigned)s->gained[r], akv_adm_plural(s->gained[r]));
    done++;
  }
  if (n_moves == 0) akv_adm_say(&t, "; no page moved for it");
  const char *verb = s->short_by == 1 ? "was" : "were";
  if (s->short_by == 0)
    akv_adm_say(&t, s->window > 0 ? "; all of them were resident." : ".");
  else if (s->revoked)
    akv_adm_say(&t, "; %u %s not resident: with its target revoked it could borrow only free "
                    "pages, and none was free.",
                (unsigned)s->short_by, verb);
  else if (s->short_reason == AKV_ADM_SHORT_NO_FREE_PAGE)
    akv_adm_say(&t, "; %u %s not resident: it held its target, and burst pages are borrowed "
                    "only while free; none was free.",
                (unsigned)s->short_by, verb);
  else
    akv_adm_say(&t, "; %u %s not resident: it was below its target and nothing was "
                    "reclaimable.",
                (unsigned)s->short_by, verb);
  {
    uint64_t by_right = (uint64_t)s->eff_target + s->burst;
    if (!s->revoked && s->held > by_right)
      akv_adm_say(&t, " %llu of its pages are headroom (beyond target + burst): revocable, "
                      "taken back first under pressure.",
                  (unsigned long long)(s->held - by_right));
  }
  if (akv_adm_is_idle(adm, s))
    akv_adm_say(&t, " It has been idle since step %llu.", (unsigned long long)s->seen_step);
  if (s->lost_any && s->lost_to == AKV_ADM_NONE)
    akv_adm_say(&t, " At step %llu it lost %u of its pages (%s).",
                (unsigned long long)s->lost_step, (unsigned)s->lost_pages,
                akv_adm_rule_words(s->lost_rule));
  else if (s->lost_any)
    akv_adm_say(&t, " At step %llu context %u reclaimed %u of its pages (%s).",
                (unsigned long long)s->lost_step, (unsigned)s->lost_to, (unsigned)s->lost_pages,
                akv_adm_rule_words(s->lost_rule));
  return t.len;
}
