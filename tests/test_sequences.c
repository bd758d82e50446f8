/*
 * test_sequences.c - sequences of valid-looking calls whose every step is
 * allowed, checked against what akv.h promises afterwards: the figures of
 * akv_headroom_get, akv_engine_info_get and the admission diagnostics agree
 * with what happened, refused calls change nothing, and no call reports
 * AKV_OK for what it did not do.
 */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "internal.h"
#include "testutil.h"

#define LAYERS 2
#define ROW_ELEMS 16 /* kv_heads 2 x head_dim 8 */

/* A host engine of LAYERS layers with headroom on `route`: a modelled device
 * with room for exactly `chunks` chunks of `chunk_pages` pages after the
 * engine's own allocations. */
static akv_engine *hr_engine(akv_route route, uint32_t pool_gib, uint32_t chunks,
                             uint32_t chunk_pages) {
  akv_engine_config ec = akvt_small_config(route, pool_gib);
  akv_engine *e = NULL, *probe = NULL;
  akv_engine_info pi;
  const uint32_t slack = route == AKV_ROUTE_PAGED ? 1 : 0;
  ec.n_dense_layers = LAYERS;
  ec.headroom_gib = 1;
  ec.headroom_chunk_pages = chunk_pages;
  assert_int_equal(akv_engine_create(&ec, &probe), AKV_OK);
  assert_int_equal(akv_engine_info_get(probe, &pi), AKV_OK);
  assert_int_equal(akv_engine_destroy(probe), AKV_OK);
  ec.host_fake_free_bytes =
      pi.device_bytes_allocated + (uint64_t)chunks * (chunk_pages + slack) * pi.page_bytes;
  assert_int_equal(akv_engine_create(&ec, &e), AKV_OK);
  return e;
}

static void fill(akv_context *c, uint32_t n) {
  static uint16_t k[64 * ROW_ELEMS], v[64 * ROW_ELEMS];
  for (uint32_t i = 0; i < 64 * ROW_ELEMS; i++) {
    k[i] = (uint16_t)(i * 7u + 1u);
    v[i] = (uint16_t)(i * 13u + 3u);
  }
  const void *kr[LAYERS] = {k, k}, *vr[LAYERS] = {v, v};
  assert_int_equal(akv_context_append(c, n, kr, vr), AKV_OK);
}

/* ------------------------------------------------------------ headroom */

/** akv_headroom_info.releases counts calls: two releases inside one step are
 *  two calls that gave chunks back, although one step end frees both. */
static void test_headroom_releases_count_calls_mid_step(void **state) {
  (void)state;
  for (int route = AKV_ROUTE_ARENA; route <= AKV_ROUTE_PAGED; route++) {
    akv_engine *e = hr_engine((akv_route)route, 0, 4, 2);
    akv_stream s;
    akv_context *c[2];
    akv_headroom_info h;
    uint64_t now = 77, pend = 77;
    assert_int_equal(akv_stream_create(e, &s), AKV_OK);
    for (int i = 0; i < 2; i++) {
      assert_int_equal(akv_context_open(e, NULL, &c[i]), AKV_OK);
      fill(c[i], 40);
    }
    assert_int_equal(akv_step_begin(e, c, 2), AKV_OK);
    assert_int_equal(akv_headroom_release(e, 1, &now, &pend), AKV_OK);
    assert_int_equal(now, 0);
    assert_true(pend > 0);
    assert_int_equal(akv_headroom_release(e, 1, &now, &pend), AKV_OK);
    assert_true(pend > 0);
    assert_int_equal(akv_headroom_get(e, &h), AKV_OK);
    assert_int_equal(h.pages_pending, 4);
    assert_int_equal(h.releases, 2);
    assert_int_equal(akvt_null_layers(e, s, LAYERS), AKV_OK);
    assert_int_equal(akv_headroom_get(e, &h), AKV_OK);
    assert_int_equal(h.pages, 4);
    assert_int_equal(h.pages_pending, 0);
    assert_int_equal(h.releases, 2);
    /* Outside a step: one more call, one more count. */
    assert_int_equal(akv_headroom_release(e, 1, &now, &pend), AKV_OK);
    assert_true(now > 0);
    assert_int_equal(akv_headroom_get(e, &h), AKV_OK);
    assert_int_equal(h.releases, 3);
    /* Inside a step again, then a quarantine frees it: still one call. */
    assert_int_equal(akv_step_begin(e, c, 2), AKV_OK);
    assert_int_equal(akv_headroom_release(e, UINT64_MAX, &now, &pend), AKV_OK);
    akv_quarantine_report qr;
    assert_int_equal(akv_engine_quarantine(e, &qr), AKV_OK);
    assert_int_equal(akv_headroom_get(e, &h), AKV_OK);
    assert_int_equal(h.pages, 0);
    assert_int_equal(h.releases, 4);
    assert_int_equal(akv_stream_destroy(e, s), AKV_OK);
    assert_int_equal(akv_engine_destroy(e), AKV_OK);
  }
}

/* ----------------------------------------------------------- admission */

/** akv_admission_explain(NULL) explains the last refused open, also one
 *  refused for want of a host slot (AKV_ERR_REFUSED_QUEUE), and not an
 *  older admission refusal instead. */
static void test_explain_names_the_last_refusal_queue_or_admission(void **state) {
  (void)state;
  akv_engine *e = akvt_small_engine(AKV_ROUTE_ARENA, 1);
  akv_context *c[4], *extra = NULL, *big = NULL;
  akv_context_config cc = AKV_CONTEXT_CONFIG_INIT;
  char buf[1024];
  assert_non_null(e);
  for (int i = 0; i < 4; i++) assert_int_equal(akv_context_open(e, NULL, &c[i]), AKV_OK);
  assert_int_equal(akv_admission_explain(e, NULL, buf, sizeof buf), AKV_OK);
  assert_non_null(strstr(buf, "No context has been refused"));
  assert_int_equal(akv_context_open(e, NULL, &extra), AKV_ERR_REFUSED_QUEUE);
  assert_null(extra);
  assert_int_equal(akv_admission_explain(e, NULL, buf, sizeof buf), AKV_OK);
  assert_null(strstr(buf, "No context has been refused"));
  assert_non_null(strstr(buf, "host slot"));
  /* Then an admission refusal: explained instead. */
  assert_int_equal(akv_context_close(c[3]), AKV_OK);
  cc.target_pages = UINT32_MAX - 1;
  assert_int_equal(akv_context_open(e, &cc, &big), AKV_ERR_ADMISSION_REFUSED);
  assert_int_equal(akv_admission_explain(e, NULL, buf, sizeof buf), AKV_OK);
  assert_null(strstr(buf, "host slot"));
  assert_non_null(strstr(buf, "was refused"));
  /* And a queue refusal again after it. Ids: 1..4 for the first four, none
   * for the queue refusal, 5 for the admission refusal, 6 now. */
  assert_int_equal(akv_context_open(e, NULL, &c[3]), AKV_OK);
  {
    uint32_t id0 = 0, id3 = 0;
    assert_int_equal(akv_context_id(c[0], &id0), AKV_OK);
    assert_int_equal(akv_context_id(c[3], &id3), AKV_OK);
    assert_int_equal(id3, id0 + 5);
  }
  assert_int_equal(akv_context_open(e, NULL, &extra), AKV_ERR_REFUSED_QUEUE);
  assert_int_equal(akv_admission_explain(e, NULL, buf, sizeof buf), AKV_OK);
  assert_non_null(strstr(buf, "host slot"));
  /* Truncated to the buffer, NUL-terminated. */
  assert_int_equal(akv_admission_explain(e, NULL, buf, 8), AKV_OK);
  assert_int_equal(strlen(buf), 7);
  for (int i = 0; i < 4; i++) assert_int_equal(akv_context_close(c[i]), AKV_OK);
  assert_int_equal(akv_engine_destroy(e), AKV_OK);
}

/** akv_admission_explain(NULL) after a refusal for want of a host slot
 *  states each figure once: the host slots (the effective concurrency) and,
 *  where the host fit lowered it, max_contexts and the host pool (it printed
 *  the effective concurrency twice, once as if it were the slots taken). */
static void test_explain_of_a_queue_refusal_states_each_figure_once(void **state) {
  (void)state;
  char buf[512];
  /* Refuse mode: 4 slots, max_contexts 4. */
  akv_engine *e = akvt_small_engine(AKV_ROUTE_STAGE, 0);
  akv_context *c[4], *extra = NULL;
  assert_non_null(e);
  for (int i = 0; i < 4; i++) assert_int_equal(akv_context_open(e, NULL, &c[i]), AKV_OK);
  assert_int_equal(akv_context_open(e, NULL, &extra), AKV_ERR_REFUSED_QUEUE);
  assert_int_equal(akv_admission_explain(e, NULL, buf, sizeof buf), AKV_OK);
  assert_string_equal(buf, "an open was refused at step 0: all 4 host slots were taken (the "
                           "effective concurrency, max_contexts); queue the request and retry "
                           "after a close.");
  for (int i = 0; i < 4; i++) assert_int_equal(akv_context_close(c[i]), AKV_OK);
  assert_int_equal(akv_engine_destroy(e), AKV_OK);
  /* Shrink mode: 512 MiB histories, so the 1 GiB host pool holds 2 of the 5
   * asked for (the pools are lazily committed mappings, never touched). */
  akv_engine_config ec = akvt_small_config(AKV_ROUTE_STAGE, 0);
  akv_engine_info info;
  ec.n_dense_layers = 1;
  ec.kv_heads = 8;
  ec.head_dim = 128;
  ec.max_tokens = 131072;
  ec.page_tokens = 256;
  ec.max_contexts = 5;
  ec.fit_mode = AKV_FIT_SHRINK;
  assert_int_equal(akv_engine_create(&ec, &e), AKV_OK);
  assert_int_equal(akv_engine_info_get(e, &info), AKV_OK);
  assert_int_equal(info.effective_concurrency, 2);
  for (int i = 0; i < 2; i++) assert_int_equal(akv_context_open(e, NULL, &c[i]), AKV_OK);
  assert_int_equal(akv_context_open(e, NULL, &extra), AKV_ERR_REFUSED_QUEUE);
  assert_null(extra);
  assert_int_equal(akv_admission_explain(e, NULL, buf, sizeof buf), AKV_OK);
  assert_string_equal(buf, "an open was refused at step 0: all 2 host slots were taken (the "
                           "effective concurrency: max_contexts=5 lowered to the histories the "
                           "1 GiB host pool holds); queue the request and retry after a close.");
  for (int i = 0; i < 2; i++) assert_int_equal(akv_context_close(c[i]), AKV_OK);
  assert_int_equal(akv_engine_destroy(e), AKV_OK);
}

/** akv_engine_info counts every H2D copy it submits in both copies_h2d and
 *  bytes_h2d: on the paged route that includes the step's page map (one
 *  copy of n x page_map_stride entries per step), besides the page fills
 *  (one batch) and the staged rows the receipts count. */
static void test_h2d_bytes_count_the_page_map(void **state) {
  (void)state;
  akv_engine *e = akvt_small_engine(AKV_ROUTE_PAGED, 1);
  akv_stream s;
  akv_context *c[2];
  akv_engine_info a, b;
  uint64_t row_stride = 0;
  static uint16_t rows[64 * ROW_ELEMS];
  const void *r3[3] = {rows, rows, rows};
  uint64_t staged = 0, stride = 0;
  assert_non_null(e);
  assert_int_equal(akv_stream_create(e, &s), AKV_OK);
  for (int i = 0; i < 2; i++) {
    assert_int_equal(akv_context_open(e, NULL, &c[i]), AKV_OK);
    assert_int_equal(akv_context_append(c[i], (uint32_t)(9 + i), r3, r3), AKV_OK);
  }
  assert_int_equal(akv_engine_info_get(e, &a), AKV_OK);
  assert_int_equal(akv_step_begin(e, c, 2), AKV_OK);
  for (uint32_t l = 0; l < 3; l++) {
    akv_lease *ls;
    akv_fence attn, tail;
    akv_view v;
    akv_receipt r;
    assert_int_equal(akv_lease_begin(e, l, &ls), AKV_OK);
    assert_int_equal(akv_lease_wait_ready(ls, s, &v), AKV_OK);
    stride = v.page_map_stride;
    row_stride = v.row_stride;
    assert_int_equal(akv_lease_mark_consumed(ls, s, &attn), AKV_OK);
    assert_int_equal(akv_lease_write_back(ls, NULL, 0, &tail), AKV_OK);
    assert_int_equal(akv_lease_seal(ls, tail, attn), AKV_OK);
    assert_int_equal(akv_lease_retire(ls, &r), AKV_OK);
    staged += r.bytes_h2d;
  }
  assert_int_equal(akv_step_end(e), AKV_OK);
  assert_int_equal(akv_engine_info_get(e, &b), AKV_OK);
  assert_true(stride > 0);
  /* Each context holds one full page of 8 rows: filled for every layer. */
  const uint64_t fills = 2 * 3 * 8 * row_stride;
  assert_int_equal(b.copies_h2d - a.copies_h2d, 3 + 1 + 1);
  assert_int_equal(b.bytes_h2d - a.bytes_h2d, staged + fills + 2 * stride * sizeof(uint32_t));
  for (int i = 0; i < 2; i++) assert_int_equal(akv_context_close(c[i]), AKV_OK);
  assert_int_equal(akv_stream_destroy(e, s), AKV_OK);
  assert_int_equal(akv_engine_destroy(e), AKV_OK);
}

/* An engine of 3 layers (akvt_small_engine's geometry) whose `nth` copy
 * submission fails. */
static akv_engine *copy_fault_engine(akv_route route, uint32_t pool_gib, uint32_t nth) {
  akv_engine_config ec = akvt_small_config(route, pool_gib);
  akv_engine *e = NULL;
  ec.fault_fail_nth = nth;
  ec.fault_kind = AKV_OP_COPY;
  assert_int_equal(akv_engine_create(&ec, &e), AKV_OK);
  return e;
}

/** A copy whose submission failed is counted nowhere: neither in
 *  copies_h2d / copies_d2h nor in bytes_h2d / bytes_d2h (a failed batch of
 *  page fills and a failed write-back counted their bytes before). */
static void test_failed_copies_count_no_bytes(void **state) {
  (void)state;
  static uint16_t rows[64 * ROW_ELEMS];
  const void *r3[3] = {rows, rows, rows};
  akv_engine_info info;
  akv_quarantine_report qr;
  akv_context *c;
  akv_stream s;
  /* Arena route: the first copy is the first step's batch of page fills. */
  akv_engine *e = copy_fault_engine(AKV_ROUTE_ARENA, 1, 1);
  assert_int_equal(akv_context_open(e, NULL, &c), AKV_OK);
  assert_int_equal(akv_context_append(c, 20, r3, r3), AKV_OK);
  assert_int_equal(akv_step_begin(e, &c, 1), AKV_ERR_BACKEND);
  assert_int_equal(akv_engine_info_get(e, &info), AKV_OK);
  assert_int_equal(info.copies_h2d, 0);
  assert_int_equal(info.bytes_h2d, 0);
  assert_int_equal(akv_engine_quarantine(e, &qr), AKV_OK);
  assert_int_equal(akv_engine_destroy(e), AKV_OK);
  /* Stage route: copy 1 stages layer 0, copy 2 is its write-back. */
  e = copy_fault_engine(AKV_ROUTE_STAGE, 0, 2);
  assert_int_equal(akv_stream_create(e, &s), AKV_OK);
  assert_int_equal(akv_context_open(e, NULL, &c), AKV_OK);
  assert_int_equal(akv_context_append(c, 20, r3, r3), AKV_OK);
  assert_int_equal(akv_step_begin(e, &c, 1), AKV_OK);
  {
    akv_lease *ls;
    akv_fence attn, tail;
    assert_int_equal(akv_lease_begin(e, 0, &ls), AKV_OK);
    assert_int_equal(akv_lease_attend(ls, s, akvt_noop_hook, NULL, &attn), AKV_OK);
    assert_int_equal(akv_lease_write_back(ls, NULL, 0, &tail), AKV_ERR_BACKEND);
  }
  assert_int_equal(akv_engine_info_get(e, &info), AKV_OK);
  assert_int_equal(info.copies_h2d, 1);
  assert_int_equal(info.bytes_h2d, 20 * 2 * 32);
  assert_int_equal(info.copies_d2h, 0);
  assert_int_equal(info.bytes_d2h, 0);
  assert_int_equal(akv_engine_quarantine(e, &qr), AKV_OK);
  assert_int_equal(akv_stream_destroy(e, s), AKV_OK);
  assert_int_equal(akv_engine_destroy(e), AKV_OK);
}

/** bytes_in_place counts a lease only once its begin submitted everything:
 *  a lease_begin whose copy submission failed counts nowhere (it added its
 *  pages read in place before submitting anything). */
static void test_failed_lease_begin_counts_nothing_in_place(void **state) {
  (void)state;
  static uint16_t rows[64 * ROW_ELEMS];
  const void *r3[3] = {rows, rows, rows};
  akv_engine_info info;
  akv_quarantine_report qr;
  akv_context *c;
  akv_lease *ls = NULL;
  /* Copy 1 is the step's batch of page fills (two full pages of 8 rows),
   * copy 2 its page map, copy 3 the staged rest of layer 0. Without a
   * fault the lease reads the two pages in place. */
  for (uint32_t nth = 0; nth <= 3; nth += 3) {
    akv_engine *e = copy_fault_engine(AKV_ROUTE_PAGED, 1, nth);
    assert_int_equal(akv_context_open(e, NULL, &c), AKV_OK);
    assert_int_equal(akv_context_append(c, 20, r3, r3), AKV_OK);
    assert_int_equal(akv_step_begin(e, &c, 1), AKV_OK);
    assert_int_equal(akv_lease_begin(e, 0, &ls), nth == 0 ? AKV_OK : AKV_ERR_BACKEND);
    assert_int_equal(akv_engine_info_get(e, &info), AKV_OK);
    assert_int_equal(info.copies_h2d, nth == 0 ? 3 : 2);
    assert_int_equal(info.bytes_in_place, nth == 0 ? 2 * info.page_bytes / 3 : 0);
    assert_int_equal(info.transport_failed, nth == 0 ? 0 : 1);
    assert_int_equal(akv_engine_quarantine(e, &qr), AKV_OK);
    assert_int_equal(akv_engine_destroy(e), AKV_OK);
  }
}

/* ----------------------------------------------------------- quarantine */

/** A quarantine of a healthy engine closes it like a failure does: the
 *  info says transport_failed (and quarantined) although no backend op
 *  failed, and every call but diagnostics and destroy is refused. */
static void test_quarantine_of_a_healthy_engine_reads_as_failed(void **state) {
  (void)state;
  akv_engine *e = akvt_small_engine(AKV_ROUTE_STAGE, 0);
  akv_engine_info a, b;
  akv_quarantine_report qr;
  akv_context *c = NULL;
  assert_non_null(e);
  assert_int_equal(akv_engine_info_get(e, &a), AKV_OK);
  assert_int_equal(a.transport_failed, 0);
  assert_int_equal(akv_engine_quarantine(e, &qr), AKV_OK);
  assert_int_equal(akv_engine_info_get(e, &b), AKV_OK);
  assert_int_equal(b.transport_failed, 1);
  assert_int_equal(b.quarantined, 1);
  for (int k = 0; k < AKV_OP_KIND_COUNT; k++)
    if (k != AKV_OP_SYNC) assert_int_equal(b.backend_ops[k], a.backend_ops[k]);
  assert_int_equal(akv_context_open(e, NULL, &c), AKV_ERR_QUARANTINED);
  assert_null(c);
  assert_int_equal(akv_engine_destroy(e), AKV_OK);
}

/* --------------------------------------------------------------- leases */


/* Event queries one akv_lease_try_retire issued, polled until it retires:
 * the queries of the successful call (each earlier call made one: the tail
 * had not passed). */
static uint64_t queries_of_retiring_call(akv_engine *e, akv_lease *ls) {
  akv_engine_info a, b;
  akv_receipt r;
  akv_status st;
  do {
    assert_int_equal(akv_engine_info_get(e, &a), AKV_OK);
    st = akv_lease_try_retire(ls, &r);
    assert_true(st == AKV_OK || st == AKV_ERR_NOT_READY);
  } while (st == AKV_ERR_NOT_READY);
  assert_int_equal(akv_engine_info_get(e, &b), AKV_OK);
  return b.backend_ops[AKV_OP_QUERY] - a.backend_ops[AKV_OP_QUERY];
}

/** akv_lease_try_retire's cost as akv.h states it: one event query (the
 *  tail, which passes last) when it retires a lease, whether it
 *  materialised retained pages device to device (arena route) or not. */
static void test_try_retire_query_count(void **state) {
  (void)state;
  for (int route = AKV_ROUTE_STAGE; route <= AKV_ROUTE_ARENA; route++) {
    akv_engine *e = akvt_small_engine((akv_route)route, route == AKV_ROUTE_STAGE ? 0 : 1);
    akv_stream s;
    akv_context *c;
    static uint16_t rows[64 * ROW_ELEMS];
    const void *r3[3] = {rows, rows, rows};
    assert_non_null(e);
    assert_int_equal(akv_stream_create(e, &s), AKV_OK);
    assert_int_equal(akv_context_open(e, NULL, &c), AKV_OK);
    assert_int_equal(akv_context_append(c, 40, r3, r3), AKV_OK);
    /* Two steps: the second one reads pages the first one filled. */
    for (int step = 0; step < 2; step++) {
      assert_int_equal(akv_step_begin(e, &c, 1), AKV_OK);
      for (uint32_t l = 0; l < 3; l++) {
        akv_lease *ls;
        akv_fence attn, tail;
        assert_int_equal(akv_lease_begin(e, l, &ls), AKV_OK);
        const int d2d = ls->body->used_d2d;
        assert_int_equal(akv_lease_attend(ls, s, akvt_noop_hook, NULL, &attn), AKV_OK);
        assert_int_equal(akv_lease_write_back(ls, NULL, 0, &tail), AKV_OK);
        assert_int_equal(akv_lease_seal(ls, tail, attn), AKV_OK);
        if (route == AKV_ROUTE_ARENA && step == 1) assert_true(d2d);
        assert_int_equal(queries_of_retiring_call(e, ls), 1);
      }
      assert_int_equal(akv_step_end(e), AKV_OK);
    }
    assert_int_equal(akv_context_close(c), AKV_OK);
    assert_int_equal(akv_stream_destroy(e, s), AKV_OK);
    assert_int_equal(akv_engine_destroy(e), AKV_OK);
  }
}

/* -------------------------------------------------------------- threads */

/* One thread's share of the hammer: engines of its own, created, filled
 * with contexts, closed and destroyed, while the other threads do the same
 * against the same process-wide handle record pools; the functions that
 * take no engine in between. Counts what went wrong. */
typedef struct hammer {
  int failures;
  akv_engine *dead_engine;
  akv_context *dead_context;
} hammer;

static void *hammer_thread(void *arg) {
  hammer *h = arg;
  for (int it = 0; it < 25; it++) {
    akv_engine_config ec = AKV_ENGINE_CONFIG_INIT;
    akv_fit_report fr;
    akv_engine *e = NULL;
    akv_context *c[3] = {NULL, NULL, NULL};
    ec.backend = AKV_BACKEND_HOST;
    ec.n_dense_layers = 2;
    ec.kv_heads = 1;
    ec.head_dim = 8;
    ec.max_tokens = 32;
    ec.page_tokens = 8;
    ec.max_contexts = 3;
    ec.host_pool_gib = 1;
    ec.route = (akv_route)(it % 3);
    ec.device_pool_gib = it % 3 ? 1 : 0;
    ec.log_fn = akvt_silent_log;
    h->failures += akv_fit(&ec, &fr) != AKV_OK || !fr.ok;
    h->failures += strcmp(akv_status_string(AKV_ERR_BUSY), "unknown status") == 0;
    h->failures += akv_version_number() != AKV_VERSION_NUMBER;
    if (akv_engine_create(&ec, &e) != AKV_OK) {
      h->failures++;
      continue;
    }
    for (int round = 0; round < 4; round++) {
      for (int i = 0; i < 3; i++) h->failures += akv_context_open(e, NULL, &c[i]) != AKV_OK;
      for (int i = 0; i < 3; i++) {
        uint32_t id = 0;
        h->failures += akv_context_id(c[i], &id) != AKV_OK || id == 0;
      }
      for (int i = 0; i < 3; i++) h->failures += akv_context_close(c[i]) != AKV_OK;
      for (int i = 0; i < 3; i++) h->failures += akv_context_close(c[i]) != AKV_ERR_BAD_HANDLE;
    }
    h->failures += akv_context_open(e, NULL, &c[0]) != AKV_OK;
    h->failures += akv_engine_destroy(e) != AKV_OK;
    h->dead_engine = e;
    h->dead_context = c[0]; /* freed with its engine */
  }
  return NULL;
}

/** akv_engine_create / destroy and akv_context_open / close from several
 *  threads at once (each thread its own engines; the handle record pools
 *  are shared and take a process-wide mutex), with akv_fit,
 *  akv_status_string and akv_version_number in between: every call
 *  succeeds and every dead handle stays dead. Run it under
 *  -DAKV_SANITIZE=thread to check the locking itself. */
static void test_threads_create_open_close_destroy(void **state) {
  (void)state;
  enum { N = 4 };
  pthread_t t[N];
  hammer h[N];
  memset(h, 0, sizeof h);
  for (int i = 0; i < N; i++) assert_int_equal(pthread_create(&t[i], NULL, hammer_thread, &h[i]), 0);
  for (int i = 0; i < N; i++) assert_int_equal(pthread_join(t[i], NULL), 0);
  for (int i = 0; i < N; i++) {
    uint32_t len;
    assert_int_equal(h[i].failures, 0);
    assert_int_equal(akv_context_length(h[i].dead_context, &len), AKV_ERR_BAD_HANDLE);
    assert_int_equal(akv_engine_destroy(h[i].dead_engine), AKV_ERR_BAD_HANDLE);
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_headroom_releases_count_calls_mid_step),
      cmocka_unit_test(test_explain_names_the_last_refusal_queue_or_admission),
      cmocka_unit_test(test_explain_of_a_queue_refusal_states_each_figure_once),
      cmocka_unit_test(test_try_retire_query_count),
      cmocka_unit_test(test_quarantine_of_a_healthy_engine_reads_as_failed),
      cmocka_unit_test(test_h2d_bytes_count_the_page_map),
      cmocka_unit_test(test_threads_create_open_close_destroy),
      cmocka_unit_test(test_failed_copies_count_no_bytes),
      cmocka_unit_test(test_failed_lease_begin_counts_nothing_in_place),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
