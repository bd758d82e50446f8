/*
 * test_headroom.c - the headroom route (DESIGN §6) on the host backend.
 *
 *  - admission: the headroom extension fills windows past target + burst
 *    round-robin; reclaim-headroom is rung 0, taken before borrowed pages;
 *    headroom pages leave (mapped or free) and come back, counted and logged;
 *    an out-of-range removal changes nothing;
 *  - engine: the create log line names every term; decode on the arena and
 *    paged routes with headroom (0 GiB pool and 1 GiB pool; whole history and
 *    part of it; release before a step, in the middle of a step with leases
 *    in flight, and all of it; take again) is bit-identical to resident
 *    attention, and host rows stay authoritative;
 *  - a mid-step release frees nothing before step_end; outside a step the
 *    memory is freed before the call returns, and a device allocation of that
 *    size then succeeds where it failed before;
 *  - illegal calls return their status and change nothing;
 *  - schedule perturbation with mid-step releases, and fault injection of
 *    every backend operation of a run with a mid-step release.
 *
 * AKVT_HR_SCHEDULES=n (default 400) schedules; AKVT_FAULT_STRIDE=k fails every
 * k-th operation only (default 1: all).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "admission.h"
#include "akv_attention.h"
#include "internal.h"
#include "testutil.h"

#define NONE AKV_ADM_NONE

static uint64_t env_u64(const char *name, uint64_t dflt) {
  const char *s = getenv(name);
  if (s == NULL || *s == '\0') return dflt;
  return strtoull(s, NULL, 10);
}

static akv_adm *mk(uint32_t n_pages, uint32_t hr_pages, uint32_t slots, uint32_t logical) {
  akv_adm_config cfg = {n_pages, slots, logical, 256, hr_pages};
  akv_adm *adm = NULL;
  assert_int_equal(akv_adm_create(&cfg, &adm), AKV_OK);
  return adm;
}

static uint32_t resident_count(const akv_adm *adm, uint32_t slot, uint32_t logical) {
  uint32_t n = 0;
  for (uint32_t l = 0; l < logical; l++) n += akv_adm_page_of(adm, slot, l) != NONE;
  return n;
}

/** Headroom extends each window past target + burst, round-robin. */
static void test_adm_extension_round_robin(void **state) {
  (void)state;
  akv_adm *adm = mk(2, 6, 2, 16);
  uint64_t cnt[AKV_ADM_RULE_COUNT];
  assert_int_equal(akv_adm_admit(adm, 0, 0, 1, 1, 0), AKV_OK);
  assert_int_equal(akv_adm_admit(adm, 0, 1, 2, 1, 0), AKV_OK);
  /* Without headroom present the windows stop at target + burst. */
  akv_adm_request rq[2] = {{0, 8}, {1, 8}};
  assert_int_equal(akv_adm_step(adm, 1, rq, 2), AKV_OK);
  assert_int_equal(akv_adm_pages_held(adm, 0), 1);
  assert_int_equal(akv_adm_pages_held(adm, 1), 1);
  assert_int_equal(akv_adm_headroom_add(adm, 1, 6), AKV_OK);
  assert_int_equal(akv_adm_headroom_pages(adm), 6);
  assert_int_equal(akv_adm_step(adm, 2, rq, 2), AKV_OK);
  /* 8 pages live: 1 + 3 each, the extension split evenly. */
  assert_int_equal(akv_adm_pages_held(adm, 0), 4);
  assert_int_equal(akv_adm_pages_held(adm, 1), 4);
  assert_int_equal(akv_adm_headroom_held(adm, 0), 3);
  /* Sink kept, then the newest pages. */
  for (uint32_t s = 0; s < 2; s++) {
    assert_true(akv_adm_page_of(adm, s, 0) != NONE);
    for (uint32_t l = 5; l < 8; l++) assert_true(akv_adm_page_of(adm, s, l) != NONE);
  }
  akv_adm_counters(adm, cnt);
  assert_int_equal(cnt[AKV_ADM_HEADROOM], 6);
  assert_int_equal(cnt[AKV_ADM_HEADROOM_TAKE], 6);
  /* A new full page, no free page and no idle context: the extension
   * shrinks from its oldest page, keeping the tail hot. */
  rq[0].full_pages = 9;
  assert_int_equal(akv_adm_step(adm, 3, rq, 2), AKV_OK);
  assert_true(akv_adm_page_of(adm, 0, 8) != NONE);
  assert_true(akv_adm_page_of(adm, 0, 0) != NONE);
  assert_int_equal(akv_adm_page_of(adm, 0, 5), NONE);
  char buf[1024];
  akv_adm_explain(adm, 0, buf, sizeof buf);
  assert_non_null(strstr(buf, "headroom"));
  akv_adm_destroy(adm);
}

/** Under admission pressure headroom goes first, before borrowed pages. */
static void test_adm_reclaim_headroom_first(void **state) {
  (void)state;
  akv_adm *adm = mk(4, 2, 2, 16);
  uint64_t cnt[AKV_ADM_RULE_COUNT];
  assert_int_equal(akv_adm_headroom_add(adm, 0, 2), AKV_OK);
  assert_int_equal(akv_adm_admit(adm, 0, 0, 1, 1, 1), AKV_OK); /* target 1, burst 1 */
  akv_adm_request a = {0, 6};
  assert_int_equal(akv_adm_step(adm, 1, &a, 1), AKV_OK);
  assert_int_equal(akv_adm_pages_held(adm, 0), 6); /* 1 target + 1 borrowed + 4 headroom */
  assert_int_equal(akv_adm_headroom_held(adm, 0), 4);
  /* B's target 3 fits the pool (1 + 3 = 4): headroom never refuses anyone. */
  assert_int_equal(akv_adm_admit(adm, 1, 1, 2, 3, 0), AKV_OK);
  akv_adm_request rq[2] = {{0, 6}, {1, 3}};
  assert_int_equal(akv_adm_step(adm, 2, rq, 2), AKV_OK);
  assert_int_equal(akv_adm_pages_held(adm, 1), 3);
  akv_adm_counters(adm, cnt);
  assert_int_equal(cnt[AKV_ADM_RECLAIM_HEADROOM], 3);
  assert_int_equal(cnt[AKV_ADM_RECLAIM_BORROWED], 0);
  assert_int_equal(akv_adm_pages_held(adm, 0), 3); /* target + borrowed + 1 headroom */
  akv_adm_decision rows[64];
  size_t n = akv_adm_log_read(adm, rows, 64), found = 0;
  for (size_t i = 0; i < n; i++)
    if (rows[i].rule == AKV_ADM_RECLAIM_HEADROOM && rows[i].context == 2 && rows[i].victim == 1)
      found += rows[i].pages;
  assert_int_equal(found, 3);
  akv_adm_destroy(adm);
}

/** Removal takes mapped and free headroom pages; out of range changes nothing. */
static void test_adm_remove_and_add(void **state) {
  (void)state;
  akv_adm *adm = mk(1, 4, 1, 16);
  uint64_t cnt[AKV_ADM_RULE_COUNT];
  assert_int_equal(akv_adm_headroom_add(adm, 0, 4), AKV_OK);
  assert_int_equal(akv_adm_headroom_add(adm, 0, 1), AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_adm_admit(adm, 0, 0, 1, 1, 0), AKV_OK);
  akv_adm_request a = {0, 4};
  assert_int_equal(akv_adm_step(adm, 1, &a, 1), AKV_OK);
  assert_int_equal(akv_adm_pages_held(adm, 0), 4); /* 1 pool + 3 headroom; 1 headroom free */
  assert_int_equal(akv_adm_headroom_remove(adm, 2, 5), AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_adm_headroom_pages(adm), 4);
  assert_int_equal(akv_adm_headroom_remove(adm, 2, 4), AKV_OK);
  assert_int_equal(akv_adm_headroom_pages(adm), 0);
  assert_int_equal(akv_adm_pages_held(adm, 0), 1);
  for (uint32_t p = 1; p < 5; p++) assert_int_equal(akv_adm_page_owner(adm, p), NONE);
  akv_adm_counters(adm, cnt);
  assert_int_equal(cnt[AKV_ADM_HEADROOM_RELEASE], 4);
  /* Nothing is free and headroom is gone: the window stops at target. */
  assert_int_equal(akv_adm_step(adm, 3, &a, 1), AKV_OK);
  assert_int_equal(akv_adm_pages_held(adm, 0), 1);
  char buf[1024];
  akv_adm_explain(adm, 0, buf, sizeof buf);
  assert_non_null(strstr(buf, "headroom given back"));
  /* Taken again: the extension comes back at the next boundary. */
  assert_int_equal(akv_adm_headroom_add(adm, 4, 2), AKV_OK);
  assert_int_equal(akv_adm_step(adm, 5, &a, 1), AKV_OK);
  assert_int_equal(akv_adm_pages_held(adm, 0), 3);
  assert_int_equal(resident_count(adm, 0, 4), 3);
  akv_adm_destroy(adm);
}

/** A release logs one row per context that lost pages and one summary row,
 *  however the round-robin extension interleaved the pages' owners. */
static void test_adm_remove_logs_one_row_per_context(void **state) {
  (void)state;
  akv_adm *adm = mk(2, 8, 2, 16);
  assert_int_equal(akv_adm_headroom_add(adm, 0, 8), AKV_OK);
  assert_int_equal(akv_adm_admit(adm, 0, 0, 1, 1, 0), AKV_OK);
  assert_int_equal(akv_adm_admit(adm, 0, 1, 2, 1, 0), AKV_OK);
  akv_adm_request rq[2] = {{0, 8}, {1, 8}};
  assert_int_equal(akv_adm_step(adm, 1, rq, 2), AKV_OK);
  /* Pass 3 handed the headroom out one page per context per round. */
  for (uint32_t p = 2; p < 10; p++) assert_int_equal(akv_adm_page_owner(adm, p), (p - 2) % 2);
  akv_adm_decision before[256], rows[256];
  const size_t n0 = akv_adm_log_read(adm, before, 256);
  assert_int_equal(akv_adm_headroom_remove(adm, 2, 8), AKV_OK);
  const size_t n = akv_adm_log_read(adm, rows, 256);
  assert_int_equal(n, n0 + 3);
  const akv_adm_decision *r = &rows[n0];
  for (int i = 0; i < 3; i++) {
    assert_int_equal(r[i].step, 2);
    assert_int_equal(r[i].context, UINT32_MAX);
    assert_int_equal(r[i].rule, AKV_ADM_HEADROOM_RELEASE);
  }
  assert_int_equal(r[0].victim, 1); /* context ids, in the order of their first loss */
  assert_int_equal(r[0].pages, 4);
  assert_int_equal(r[1].victim, 2);
  assert_int_equal(r[1].pages, 4);
  assert_int_equal(r[2].victim, UINT32_MAX);
  assert_int_equal(r[2].pages, 8);
  /* The rows before the release are all still there. */
  assert_memory_equal(rows, before, n0 * sizeof *rows);
  akv_adm_destroy(adm);
}

/* ---------------------------------------------------------------- engine */

typedef struct logcap {
  char text[8192];
  size_t len;
} logcap;

static void capture(void *user, akv_log_level level, const char *message) {
  logcap *l = user;
  (void)level;
  int n = snprintf(l->text + l->len, sizeof l->text - l->len, "%s\n", message);
  if (n > 0 && l->len + (size_t)n < sizeof l->text) l->len += (size_t)n;
}

static akvt_cfg hr_cfg(akv_route route, uint32_t pool_gib, uint32_t pages) {
  akvt_cfg c = akvt_default_cfg();
  c.route = route;
  c.device_pool_gib = pool_gib;
  c.headroom_pages = pages;
  c.release_bytes = UINT64_MAX;
  if (pool_gib == 0) c.target_pages = 0;
  return c;
}

static void expect_exact(const akvt_cfg *c, const akvt_result *r) {
  if (r->status != AKV_OK) fail_msg("%s returned %s", r->failed_call, akv_status_string(r->status));
  assert_int_equal(r->outputs_compared, (uint64_t)c->steps * c->layers * c->n_ctx);
  assert_int_equal(r->outputs_mismatched, 0);
  assert_int_equal(r->rows_mismatched, 0);
  assert_true(r->rows_checked > 0);
  assert_int_equal(r->rows_checked, r->rows_expected);
  assert_true(r->destroyed);
}

/** The create log line names the cap, the profile, the reserve and the pages. */
static void test_create_logs_every_term(void **state) {
  (void)state;
  logcap lc;
  memset(&lc, 0, sizeof lc);
  akvt_cfg c = hr_cfg(AKV_ROUTE_ARENA, 0, 12);
  c.log_fn = capture;
  c.log_user = &lc;
  c.steps = 1;
  akvt_result r;
  akvt_run(&c, &r);
  expect_exact(&c, &r);
  const char *line = strstr(lc.text, "headroom = min(headroom_gib 1.00 GiB, free after the engine's "
                                     "allocations ");
  assert_non_null(line);
  assert_non_null(strstr(line, "- headroom_reserve_gib 0.00 GiB) = "));
  assert_non_null(strstr(line, "-> 12 pages of 1536 B in 1 chunks of 12 pages"));
  assert_int_equal(r.headroom_start.enabled, 1);
  assert_int_equal(r.headroom_start.max_pages, 12);
  assert_int_equal(r.headroom_start.pages, 12);
  assert_int_equal(r.info.headroom_pages, 12);
  assert_int_equal(r.headroom_start.bytes, 12 * 1536);
  assert_int_equal(r.adm_counters[AKV_ADM_HEADROOM_TAKE], 12);
}

/** Bit-identical cells: routes x pools x headroom sizes x releases. */
static void test_cells_bit_identical(void **state) {
  (void)state;
  const akv_route routes[2] = {AKV_ROUTE_ARENA, AKV_ROUTE_PAGED};
  uint32_t cells = 0;
  for (int ri = 0; ri < 2; ri++)
    for (uint32_t pool = 0; pool <= 1; pool++)
      for (uint32_t pages = 3; pages <= 24; pages += 21) /* part of the history, all of it */
        for (int rel = 0; rel < 4; rel++) {
          akvt_cfg c = hr_cfg(routes[ri], pool, pages);
          c.headroom_chunk_pages = pages == 24 ? 4 : 0;
          if (pool == 1) {
            c.target_pages = 1; /* the pool holds little: headroom does the rest */
            c.burst_pages = 0;
          }
          if (rel == 1) c.release_step = 2;                        /* before step 2 */
          if (rel == 2) c.release_step = 2, c.release_mid_step = 1, c.release_layer = 1;
          if (rel == 3) c.release_step = 2, c.release_bytes = 1, c.take_step = 3;
          akvt_result r;
          akvt_run(&c, &r);
          expect_exact(&c, &r);
          cells++;
          if (rel == 0) {
            /* Headroom really retains: rows are read from it. */
            if (r.adm_counters[AKV_ADM_HEADROOM] == 0)
              fail_msg("route %d pool %u pages %u: no headroom fill", ri, pool, pages);
            if (routes[ri] == AKV_ROUTE_PAGED) assert_true(r.info.bytes_in_place > 0);
            else assert_true(r.info.bytes_d2d > 0);
          }
          if (rel == 2) {
            if (r.headroom_end.bytes != 0)
              fail_msg("route %d pool %u pages %u: %llu B left, pending %llu, start %llu",
                       ri, pool, pages, (unsigned long long)r.headroom_end.bytes,
                       (unsigned long long)r.released_pending,
                       (unsigned long long)r.headroom_start.bytes);
            assert_int_equal(r.released_now, 0);
            assert_true(r.released_pending > 0);
            /* Nothing freed while the step's leases are in flight. */
            assert_int_equal(r.headroom_bytes_after_release_call, r.headroom_start.bytes);
            assert_int_equal(r.headroom_end.bytes, 0);
            assert_int_equal(r.headroom_end.bytes_released, r.headroom_start.bytes);
          }
          if (rel == 1) {
            assert_int_equal(r.released_now, r.headroom_start.bytes);
            assert_int_equal(r.headroom_end.pages, 0);
            assert_int_equal(r.adm_counters[AKV_ADM_HEADROOM_RELEASE], pages);
          }
          if (rel == 3) {
            assert_true(r.released_now > 0);
            assert_true(r.taken > 0);
            assert_int_equal(r.headroom_end.pages, pages);
            assert_int_equal(r.headroom_end.takes, 1);
          }
        }
  printf("headroom: %u cells (arena, paged x pool 0/1 GiB x 3/24 pages x none, before, mid-step, "
         "partial+take) bit-identical\n", cells);
}

/** Whole history in headroom with a 0 GiB pool: only new rows cross after step 1. */
static void test_whole_history_resident(void **state) {
  (void)state;
  akvt_cfg st = hr_cfg(AKV_ROUTE_STAGE, 0, 0), hr = hr_cfg(AKV_ROUTE_PAGED, 0, 24);
  akvt_result rs, rh;
  akvt_run(&st, &rs);
  akvt_run(&hr, &rh);
  expect_exact(&st, &rs);
  expect_exact(&hr, &rh);
  assert_true(rh.info.bytes_h2d < rs.info.bytes_h2d);
  assert_int_equal(rh.adm_counters[AKV_ADM_SHRINK], 0);
}

/* The small host engine of the tests below: 3 layers, pages of 8 rows, two
 * contexts, 1 GiB of headroom asked for. */
static akv_engine_config hr_config(akv_route route) {
  akv_engine_config ec = AKV_ENGINE_CONFIG_INIT;
  ec.backend = AKV_BACKEND_HOST;
  ec.n_dense_layers = 3;
  ec.kv_heads = 2;
  ec.head_dim = 8;
  ec.max_tokens = 96;
  ec.page_tokens = 8;
  ec.max_contexts = 2;
  ec.host_pool_gib = 1;
  ec.route = route;
  ec.log_fn = akvt_silent_log;
  ec.headroom_gib = 1;
  return ec;
}

static akv_engine *hr_engine(akv_route route, uint32_t pages, uint64_t *alloc_out) {
  akv_engine_config ec = hr_config(route);
  akv_engine *e = NULL;
  akv_engine_info info;
  ec.headroom_chunk_pages = pages / 2;
  assert_int_equal(akv_engine_create(&ec, &e), AKV_OK);
  assert_int_equal(akv_engine_info_get(e, &info), AKV_OK);
  assert_int_equal(info.headroom_pages, 0); /* no free memory reported: none taken */
  akv_engine_destroy(e);
  ec.host_fake_free_bytes = info.device_bytes_allocated +
                            (uint64_t)pages * info.page_bytes +
                            (route == AKV_ROUTE_PAGED ? 2 * info.page_bytes : 0);
  assert_int_equal(akv_engine_create(&ec, &e), AKV_OK);
  *alloc_out = ec.host_fake_free_bytes;
  return e;
}

/** Outside a step the memory is reusable when the call returns. */
static void test_release_makes_memory_reusable(void **state) {
  (void)state;
  uint64_t cap = 0, freed = 0, pending = 9;
  akv_engine *e = hr_engine(AKV_ROUTE_ARENA, 16, &cap);
  akv_headroom_info hi;
  void *p = NULL;
  assert_int_equal(akv_headroom_get(e, &hi), AKV_OK);
  assert_int_equal(hi.pages, 16);
  assert_int_equal(hi.chunk_pages, 8);
  const uint64_t want = hi.bytes / 2;
  /* The modelled device is full: an allocation of that size fails now. */
  assert_int_equal(akv_bk_device_alloc(&e->bk, want, &p), AKV_ERR_OUT_OF_MEMORY);
  assert_int_equal(akv_headroom_release(e, want, &freed, &pending), AKV_OK);
  assert_int_equal(freed, want);
  assert_int_equal(pending, 0);
  assert_int_equal(akv_bk_device_alloc(&e->bk, want, &p), AKV_OK);
  akv_bk_device_free(&e->bk, p);
  assert_int_equal(akv_headroom_get(e, &hi), AKV_OK);
  assert_int_equal(hi.pages, 8);
  assert_int_equal(hi.releases, 1);
  /* Take it again: the device has room, so the chunk comes back. */
  uint64_t taken = 0;
  assert_int_equal(akv_headroom_take(e, UINT64_MAX, &taken), AKV_OK);
  assert_int_equal(taken, want);
  assert_int_equal(akv_headroom_get(e, &hi), AKV_OK);
  assert_int_equal(hi.pages, 16);
  /* Nothing left: a second take takes nothing. */
  assert_int_equal(akv_headroom_take(e, UINT64_MAX, &taken), AKV_OK);
  assert_int_equal(taken, 0);
  assert_int_equal(akv_engine_destroy(e), AKV_OK);
}

/** Paged route: a chunk's allocation carries a page of slack; asking for one
 *  allocation's bytes gives back that one chunk, not two, in and out of a
 *  step. */
static void test_release_paged_counts_allocations(void **state) {
  (void)state;
  uint64_t cap = 0, freed = 0, pending = 0;
  akv_engine *e = hr_engine(AKV_ROUTE_PAGED, 16, &cap);
  akv_headroom_info hi;
  void *p = NULL;
  assert_int_equal(akv_headroom_get(e, &hi), AKV_OK);
  assert_int_equal(hi.pages, 16);
  assert_int_equal(hi.chunk_pages, 8);
  const uint64_t one = hi.bytes / 2; /* one allocation: 8 pages and the slack page */
  assert_int_equal(one, 9 * e->page_bytes);
  assert_int_equal(akv_headroom_release(e, one, &freed, &pending), AKV_OK);
  assert_int_equal(freed, one);
  assert_int_equal(pending, 0);
  assert_int_equal(akv_headroom_get(e, &hi), AKV_OK);
  assert_int_equal(hi.pages, 8);
  assert_int_equal(hi.bytes, one);
  assert_int_equal(hi.bytes_released, one);
  assert_int_equal(akv_bk_device_alloc(&e->bk, one, &p), AKV_OK);
  akv_bk_device_free(&e->bk, p);
  uint64_t taken = 0;
  assert_int_equal(akv_headroom_take(e, UINT64_MAX, &taken), AKV_OK);
  assert_int_equal(taken, one);
  /* Inside a step the same request marks one chunk. */
  akv_context *ctx = NULL;
  akv_stream s = NULL;
  assert_int_equal(akv_context_open(e, NULL, &ctx), AKV_OK);
  assert_int_equal(akv_stream_create(e, &s), AKV_OK);
  assert_int_equal(akv_step_begin(e, &ctx, 1), AKV_OK);
  assert_int_equal(akv_headroom_release(e, one, &freed, &pending), AKV_OK);
  assert_int_equal(freed, 0);
  assert_int_equal(pending, one);
  assert_int_equal(akv_headroom_get(e, &hi), AKV_OK);
  assert_int_equal(hi.pages_pending, 8);
  assert_int_equal(akvt_null_layers(e, s, 3), AKV_OK);
  assert_int_equal(akv_headroom_get(e, &hi), AKV_OK);
  assert_int_equal(hi.pages, 8);
  assert_int_equal(hi.pages_pending, 0);
  assert_int_equal(akv_stream_destroy(e, s), AKV_OK);
  assert_int_equal(akv_context_close(ctx), AKV_OK);
  assert_int_equal(akv_engine_destroy(e), AKV_OK);
}

typedef struct ref_job {
  akv_view view;
  uint32_t len1[2];
  uint16_t q[2 * 4 * 8];
  float out[2 * 4 * 8], flat[2 * 4 * 8];
  void *ws;
  size_t ws_bytes;
  akv_status st, st_flat;
  int pages_null;
  uint32_t named; /* page map entries naming a page (no page exists: must be 0) */
} ref_job;

/* On the compute queue: the new rows, then the reference attention over the
 * view as given (page map included) and over the staged rows alone. */
static void ref_job_run(void *arg) {
  ref_job *j = arg;
  const akv_view *v = &j->view;
  akv_attention_args a;
  for (uint32_t i = 0; i < v->n_contexts; i++) {
    uint8_t *k = (uint8_t *)v->base + i * v->context_stride + (uint64_t)v->len[i] * v->row_stride;
    memset(k, 0x3c, v->row_stride);
    j->len1[i] = v->len[i] + 1;
  }
  memset(&a, 0, sizeof a);
  j->pages_null = v->pages == NULL;
  j->named = 0;
  for (uint32_t e = 0; v->page_map != NULL && e < v->n_contexts * v->page_map_stride; e++)
    j->named += v->page_map[e] != AKV_PAGE_STAGED;
  if (v->page_map == NULL || j->named > 0) {
    j->st = j->st_flat = AKV_ERR_INVALID_ARGUMENT; /* reading those would fault */
    return;
  }
  j->st = akv_attention_args_from_view(v, &a);
  a.n_heads = 4;
  a.scale = 0.35f;
  a.q = j->q;
  a.len = j->len1;
  a.workspace = j->ws;
  a.workspace_bytes = j->ws_bytes;
  a.out = j->out;
  if (j->st == AKV_OK) j->st = akv_attention_ref_bf16(&a);
  a.page_map = NULL; /* every entry is staged: the same bits from base */
  a.k_pages = a.v_pages = NULL;
  a.out = j->flat;
  j->st_flat = akv_attention_ref_bf16(&a);
}

static int ref_hook(void *user, const akv_view *view, akv_stream stream) {
  ref_job *jobs = user;
  ref_job *j = &jobs[view->layer];
  j->view = *view;
  return akv_stream_launch_host(view->contexts[0]->engine, stream, ref_job_run, j) == AKV_OK ? 0
                                                                                             : 1;
}

/** Paged route, no pool, headroom enabled but nothing measured free above the
 *  reserve: no page exists to read in place, and a view handed to the
 *  reference attention still attends (every page staged), on every layer. */
static void test_paged_without_headroom_pages_attends(void **state) {
  (void)state;
  akv_engine_config ec = hr_config(AKV_ROUTE_PAGED);
  akv_engine *e = NULL;
  akv_engine_info info;
  akv_headroom_info hi;
  ec.headroom_reserve_gib = 1; /* more than the modelled device has free */
  assert_int_equal(akv_engine_create(&ec, &e), AKV_OK);
  assert_int_equal(akv_engine_info_get(e, &info), AKV_OK);
  assert_int_equal(akv_engine_destroy(e), AKV_OK);
  ec.host_fake_free_bytes = info.device_bytes_allocated + 64 * info.page_bytes;
  assert_int_equal(akv_engine_create(&ec, &e), AKV_OK);
  assert_int_equal(akv_headroom_get(e, &hi), AKV_OK);
  assert_int_equal(hi.enabled, 1);
  assert_int_equal(hi.pages, 0);

  akv_context *c[2];
  static uint16_t rows[40 * 16 * 2];
  for (uint32_t i = 0; i < 40 * 16 * 2; i++) rows[i] = (uint16_t)(0x3c00 + (i * 37u) % 512u);
  const void *kr[3] = {rows, rows, rows}, *vr[3] = {rows + 40 * 16, rows + 40 * 16, rows + 40 * 16};
  for (int i = 0; i < 2; i++) {
    assert_int_equal(akv_context_open(e, NULL, &c[i]), AKV_OK);
    assert_int_equal(akv_context_append(c[i], 40 - (uint32_t)i * 9, kr, vr), AKV_OK);
  }
  static ref_job jobs[3];
  size_t ws = 0;
  assert_int_equal(akv_attention_workspace_bytes(2, 4, 8, 96, 8, &ws), AKV_OK);
  for (int l = 0; l < 3; l++) {
    memset(&jobs[l], 0, sizeof jobs[l]);
    for (int k = 0; k < 2 * 4 * 8; k++) jobs[l].q[k] = (uint16_t)(0x3c00 + k * 3 + l);
    jobs[l].ws = malloc(ws);
    jobs[l].ws_bytes = ws;
    jobs[l].st = jobs[l].st_flat = AKV_ERR_BACKEND;
  }
  akv_stream s = NULL;
  assert_int_equal(akv_stream_create(e, &s), AKV_OK);
  for (uint32_t step = 0; step < 2; step++) {
    assert_int_equal(akv_step_begin(e, c, 2), AKV_OK);
    for (uint32_t l = 0; l < 3; l++) {
      akv_lease *ls = NULL;
      akv_fence attn, tail;
      assert_int_equal(akv_lease_begin(e, l, &ls), AKV_OK);
      assert_int_equal(akv_lease_attend(ls, s, ref_hook, jobs, &attn), AKV_OK);
      assert_int_equal(akv_lease_write_back(ls, NULL, 0, &tail), AKV_OK);
      assert_int_equal(akv_lease_seal(ls, tail, attn), AKV_OK);
      assert_int_equal(akv_lease_retire(ls, NULL), AKV_OK);
      /* Retired: the job ran. */
      if (jobs[l].named > 0)
        fail_msg("step %u layer %u: the page map names %u pages, but none exists", step, l,
                 jobs[l].named);
      if (jobs[l].st != AKV_OK)
        fail_msg("step %u layer %u: reference attention over the paged view returned %s "
                 "(view.pages %s)",
                 step, l, akv_status_string(jobs[l].st), jobs[l].pages_null ? "NULL" : "set");
      assert_int_equal(jobs[l].st_flat, AKV_OK);
      assert_memory_equal(jobs[l].out, jobs[l].flat, sizeof jobs[l].out);
    }
    assert_int_equal(akv_step_end(e), AKV_OK);
  }
  assert_int_equal(akv_stream_destroy(e, s), AKV_OK);
  for (int l = 0; l < 3; l++) free(jobs[l].ws);
  for (int i = 0; i < 2; i++) assert_int_equal(akv_context_close(c[i]), AKV_OK);
  assert_int_equal(akv_engine_destroy(e), AKV_OK);
}

/** Illegal calls return their status and change nothing. */
static void test_illegal_calls(void **state) {
  (void)state;
  uint64_t cap = 0, freed = 5, pending = 5, taken = 5;
  akv_headroom_info before, after;
  assert_int_equal(akv_headroom_release(NULL, 1, &freed, &pending), AKV_ERR_BAD_HANDLE);
  assert_int_equal(akv_headroom_take(NULL, 1, &taken), AKV_ERR_BAD_HANDLE);
  assert_int_equal(akv_headroom_get(NULL, &before), AKV_ERR_BAD_HANDLE);
  assert_int_equal(freed, 5);
  akv_engine *off = akvt_small_engine(AKV_ROUTE_ARENA, 1);
  assert_int_equal(akv_headroom_release(off, 1, &freed, &pending), AKV_ERR_NOT_SUPPORTED);
  assert_int_equal(akv_headroom_take(off, 1, &taken), AKV_ERR_NOT_SUPPORTED);
  assert_int_equal(akv_headroom_get(off, NULL), AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_engine_destroy(off), AKV_OK);

  akv_engine *e = hr_engine(AKV_ROUTE_PAGED, 8, &cap);
  akv_context *ctx = NULL;
  akv_context_config cc = AKV_CONTEXT_CONFIG_INIT;
  assert_int_equal(akv_context_open(e, &cc, &ctx), AKV_OK);
  assert_int_equal(akv_step_begin(e, &ctx, 1), AKV_OK);
  assert_int_equal(akv_headroom_get(e, &before), AKV_OK);
  assert_int_equal(akv_headroom_take(e, 1, &taken), AKV_ERR_STEP_STATE);
  assert_int_equal(taken, 5);
  assert_int_equal(akv_headroom_release(e, 0, &freed, &pending), AKV_OK); /* 0 bytes: nothing */
  assert_int_equal(freed, 0);
  assert_int_equal(pending, 0);
  assert_int_equal(akv_headroom_release(e, 1, NULL, &pending), AKV_OK);
  assert_true(pending > 0);
  assert_int_equal(akv_headroom_get(e, &after), AKV_OK);
  assert_int_equal(after.bytes, before.bytes); /* nothing freed mid-step */
  assert_int_equal(after.pages_pending, 4);
  assert_int_equal(akv_engine_destroy(e), AKV_ERR_BUSY);
  for (uint32_t l = 0; l < 3; l++) {
    akv_lease *ls = NULL;
    akv_fence a, t;
    akv_stream s = NULL;
    assert_int_equal(akv_stream_create(e, &s), AKV_OK);
    assert_int_equal(akv_lease_begin(e, l, &ls), AKV_OK);
    assert_int_equal(akv_lease_wait_ready(ls, s, &(akv_view){0}), AKV_OK);
    assert_int_equal(akv_lease_mark_consumed(ls, s, &a), AKV_OK);
    assert_int_equal(akv_lease_write_back(ls, NULL, 0, &t), AKV_OK);
    assert_int_equal(akv_lease_seal(ls, t, a), AKV_OK);
    assert_int_equal(akv_lease_retire(ls, NULL), AKV_OK);
    assert_int_equal(akv_stream_destroy(e, s), AKV_OK);
  }
  assert_int_equal(akv_step_end(e), AKV_OK);
  assert_int_equal(akv_headroom_get(e, &after), AKV_OK);
  assert_int_equal(after.pages, 4);
  assert_int_equal(after.pages_pending, 0);
  assert_int_equal(after.bytes, before.bytes / 2);
  assert_int_equal(akv_context_close(ctx), AKV_OK);
  assert_int_equal(akv_engine_destroy(e), AKV_OK);
}

/** Schedule perturbation: mid-step releases under random per-queue delays. */
static void test_perturbed_releases(void **state) {
  (void)state;
  const uint64_t n = env_u64("AKVT_HR_SCHEDULES", 400);
  uint64_t outputs = 0;
  for (uint64_t seed = 1; seed <= n; seed++) {
    akvt_cfg c = hr_cfg((seed & 1) ? AKV_ROUTE_PAGED : AKV_ROUTE_ARENA, (seed >> 1) & 1,
                        ((seed >> 2) & 1) ? 24 : 6);
    c.headroom_chunk_pages = ((seed >> 2) & 1) ? 6 : 3;
    c.delay_seed = seed;
    c.delay_max_us = 1 + (uint32_t)(seed % 8);
    c.layers = 3 + (uint32_t)((seed >> 3) % 2);
    c.steps = 3;
    c.two_call = (seed >> 4) & 1;
    c.release_step = 2;
    c.release_mid_step = 1;
    c.release_layer = (uint32_t)(seed % c.layers);
    if ((seed >> 5) & 1) c.release_bytes = 1; /* one chunk */
    akvt_result r;
    akvt_run(&c, &r);
    if (r.status != AKV_OK || r.outputs_mismatched || r.rows_mismatched)
      fail_msg("seed %llu: %s %s, %llu outputs and %llu rows differ", (unsigned long long)seed,
               r.failed_call ? r.failed_call : "-", akv_status_string(r.status),
               (unsigned long long)r.outputs_mismatched, (unsigned long long)r.rows_mismatched);
    expect_exact(&c, &r);
    outputs += r.outputs_compared;
  }
  printf("headroom perturbation: %llu schedules with a mid-step release, %llu outputs, all "
         "bit-identical\n", (unsigned long long)n, (unsigned long long)outputs);
}

/** Every backend operation of a run with a mid-step release, failed in turn. */
static void test_faults_during_release(void **state) {
  (void)state;
  const uint64_t stride = env_u64("AKVT_FAULT_STRIDE", 1);
  for (int ri = 0; ri < 2; ri++) {
    akvt_cfg c = hr_cfg(ri ? AKV_ROUTE_PAGED : AKV_ROUTE_ARENA, 0, 12);
    c.headroom_chunk_pages = 6;
    c.steps = 3;
    c.release_step = 2;
    c.release_mid_step = 1;
    c.release_layer = 1;
    akvt_result clean;
    akvt_run(&c, &clean);
    expect_exact(&c, &clean);
    uint64_t total = 0;
    for (int k = 0; k < AKV_OP_KIND_COUNT; k++) total += clean.info.backend_ops[k];
    uint32_t failed_runs = 0;
    for (uint64_t nth = 1; nth <= total; nth += stride) {
      akvt_cfg f = c;
      akvt_result r;
      f.fault_fail_nth = (uint32_t)nth;
      akvt_run(&f, &r);
      if (r.status == AKV_OK) continue; /* the op was not reached */
      failed_runs++;
      /* The engine quarantined, lost no authoritative host row, and freed
       * everything (the pending release included) only once completion was
       * established. */
      if (r.rows_mismatched != 0 || r.rows_checked != r.rows_expected)
        fail_msg("fault %llu (%s): %llu rows differ", (unsigned long long)nth, r.failed_call,
                 (unsigned long long)r.rows_mismatched);
      if (r.status == AKV_ERR_CONFIG) continue;
      if (strcmp(r.failed_call, "akv_engine_create") == 0) continue;
      assert_int_equal(r.quarantine_status, AKV_OK);
      assert_int_equal(r.headroom_end.pages_pending, 0);
      assert_true(r.destroyed);
    }
    assert_true(failed_runs > 0);
    printf("headroom faults (%s): %llu operations failed in turn, %u runs failed; all "
           "quarantined with every host row intact\n",
           ri ? "paged" : "arena", (unsigned long long)total, failed_runs);
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_adm_extension_round_robin),
      cmocka_unit_test(test_adm_reclaim_headroom_first),
      cmocka_unit_test(test_adm_remove_and_add),
      cmocka_unit_test(test_adm_remove_logs_one_row_per_context),
      cmocka_unit_test(test_create_logs_every_term),
      cmocka_unit_test(test_cells_bit_identical),
      cmocka_unit_test(test_whole_history_resident),
      cmocka_unit_test(test_release_makes_memory_reusable),
      cmocka_unit_test(test_release_paged_counts_allocations),
      cmocka_unit_test(test_paged_without_headroom_pages_attends),
      cmocka_unit_test(test_illegal_calls),
      cmocka_unit_test(test_perturbed_releases),
      cmocka_unit_test(test_faults_during_release),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
