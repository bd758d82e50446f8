/*
 * test_audit_s34.c - a promise audit of the public C API (akv.h): the
 * admission explanation near its buffer's end, the headroom route's outputs
 * on refusal, reads near the row limits, streams of another engine, the fit
 * arithmetic at the edges of its ranges. Each test names the promise it
 * checks and fails while the library breaks it.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "akv.h"
#include "testutil.h"

#define PAT 0xA5

static size_t str_len_max(const char *s, size_t cap) {
  size_t n = 0;
  while (n < cap && s[n] != '\0') n++;
  return n;
}

static int all_pat(const void *p, size_t n) {
  const unsigned char *b = p;
  for (size_t i = 0; i < n; i++)
    if (b[i] != PAT) return 0;
  return 1;
}

/* Checks one explanation call at every cap from 1 to the full length + 2:
 * NUL-terminated inside cap, a prefix of the full text, nothing written past
 * cap (akv.h, akv_admission_explain: "NUL-terminated, truncated to cap"). */
static void check_explain_caps(const akv_engine *e, const akv_context *c) {
  char full[2048];
  char buf[2048 + 16];
  assert_int_equal(akv_admission_explain(e, c, full, sizeof full), AKV_OK);
  const size_t len = strlen(full);
  assert_true(len > 0 && len + 3 < sizeof full);
  for (size_t cap = 1; cap <= len + 2; cap++) {
    memset(buf, PAT, sizeof buf);
    assert_int_equal(akv_admission_explain(e, c, buf, cap), AKV_OK);
    const size_t got = str_len_max(buf, cap);
    if (got == cap) fail_msg("cap %zu: not NUL-terminated inside cap", cap);
    if (got != (cap - 1 < len ? cap - 1 : len))
      fail_msg("cap %zu: %zu characters, expected %zu", cap, got,
               cap - 1 < len ? cap - 1 : len);
    if (memcmp(buf, full, got) != 0) fail_msg("cap %zu: not a prefix of the full text", cap);
    if (!all_pat(buf + cap, sizeof buf - cap)) fail_msg("cap %zu: written past cap", cap);
  }
}

/* Promise (akv_admission_explain): NUL-terminated, truncated to cap, for a
 * context (with the floor sentence appended when the floor raised its
 * target), for NULL after an admission refusal and after a host-slot
 * refusal (shrink mode: the lowered concurrency sentence). */
static void test_explain_truncation_every_cap(void **state) {
  (void)state;
  akv_engine_config ec = akvt_small_config(AKV_ROUTE_ARENA, 1);
  akv_engine *e = NULL;
  assert_int_equal(akv_engine_create(&ec, &e), AKV_OK);
  akv_context_config cc = AKV_CONTEXT_CONFIG_INIT;
  akv_context *c1 = NULL, *c2 = NULL, *c3 = NULL;
  cc.target_pages = 1; /* raised to the floor of 2 */
  cc.burst_pages = 3;
  assert_int_equal(akv_context_open(e, &cc, &c1), AKV_OK);
  check_explain_caps(e, c1);
  check_explain_caps(e, NULL); /* nothing refused yet */
  /* Refused by admission: a target larger than the pool. */
  akv_engine_info info;
  assert_int_equal(akv_engine_info_get(e, &info), AKV_OK);
  cc.target_pages = info.device_pages + 1;
  cc.burst_pages = 0;
  assert_int_equal(akv_context_open(e, &cc, &c2), AKV_ERR_ADMISSION_REFUSED);
  assert_null(c2);
  check_explain_caps(e, NULL);
  /* Refused for want of a host slot. */
  akv_context *more[3] = {NULL, NULL, NULL};
  for (int i = 0; i < 3; i++) assert_int_equal(akv_context_open(e, NULL, &more[i]), AKV_OK);
  assert_int_equal(akv_context_open(e, NULL, &c3), AKV_ERR_REFUSED_QUEUE);
  check_explain_caps(e, NULL);
  assert_int_equal(akv_engine_destroy(e), AKV_OK);
}

/* Promise (akv_admission_explain, Conventions): a refusal (a context not
 * open on this engine: another engine's, a closed one; cap 0) leaves buf
 * untouched, every byte. */
static void test_explain_refusals_leave_buf(void **state) {
  (void)state;
  akv_engine *a = akvt_small_engine(AKV_ROUTE_ARENA, 1);
  akv_engine *b = akvt_small_engine(AKV_ROUTE_ARENA, 1);
  assert_non_null(a);
  assert_non_null(b);
  akv_context *ca = NULL, *cb = NULL, *dead = NULL;
  assert_int_equal(akv_context_open(a, NULL, &ca), AKV_OK);
  assert_int_equal(akv_context_open(b, NULL, &cb), AKV_OK);
  assert_int_equal(akv_context_open(a, NULL, &dead), AKV_OK);
  assert_int_equal(akv_context_close(dead), AKV_OK);
  char buf[256];
  memset(buf, PAT, sizeof buf);
  assert_int_equal(akv_admission_explain(a, cb, buf, sizeof buf), AKV_ERR_BAD_HANDLE);
  assert_true(all_pat(buf, sizeof buf));
  assert_int_equal(akv_admission_explain(a, dead, buf, sizeof buf), AKV_ERR_BAD_HANDLE);
  assert_true(all_pat(buf, sizeof buf));
  assert_int_equal(akv_admission_explain(a, ca, buf, 0), AKV_ERR_INVALID_ARGUMENT);
  assert_true(all_pat(buf, sizeof buf));
  assert_int_equal(akv_admission_explain(NULL, ca, buf, sizeof buf), AKV_ERR_BAD_HANDLE);
  assert_true(all_pat(buf, sizeof buf));
  assert_int_equal(akv_engine_destroy(a), AKV_OK);
  assert_int_equal(akv_admission_explain(a, NULL, buf, sizeof buf), AKV_ERR_BAD_HANDLE);
  assert_true(all_pat(buf, sizeof buf));
  assert_int_equal(akv_engine_destroy(b), AKV_OK);
}

/* Opens with target `t` and burst `b`; returns the status (closes nothing). */
static akv_status open_tb(akv_engine *e, uint32_t t, uint32_t b, akv_context **out) {
  akv_context_config cc = AKV_CONTEXT_CONFIG_INIT;
  cc.target_pages = t;
  cc.burst_pages = b;
  return akv_context_open(e, &cc, out);
}

/* Promise (akv_admission_explain, akv_context_open: the floor raise is
 * "stated by akv_admission_explain"): the explanation of the last refused
 * open states what that open asked for, its burst included. A refused
 * open with target 1 and burst 5 was explained as "it asked for a target
 * of 2 pages (+5 burst) ... It asked for a target of 1 page (+0 burst),
 * raised to 2 (+0 burst)": the burst the caller asked for was reported as
 * 0, contradicting the sentence before it. */
static void test_explain_refused_open_states_its_burst(void **state) {
  (void)state;
  akv_engine *e = akvt_small_engine(AKV_ROUTE_ARENA, 1);
  akv_engine_info info;
  akv_context *a = NULL, *b = NULL;
  char buf[2048];
  assert_non_null(e);
  assert_int_equal(akv_engine_info_get(e, &info), AKV_OK);
  assert_int_equal(open_tb(e, info.device_pages - 1, 0, &a), AKV_OK);
  assert_int_equal(open_tb(e, 1, 5, &b), AKV_ERR_ADMISSION_REFUSED);
  assert_int_equal(akv_admission_explain(e, NULL, buf, sizeof buf), AKV_OK);
  if (strstr(buf, "target of 2 pages (+5 burst)") == NULL ||
      strstr(buf, "asked for a target of 1 page (+5 burst), raised to 2 (+5 burst)") == NULL)
    fail_msg("explanation misstates the refused open's burst: %s", buf);
  assert_int_equal(akv_engine_destroy(e), AKV_OK);
}

/* Promise (akv_admission_explain: "why it waited or was refused"): the
 * target a refusal's explanation says would be admitted now is admitted.
 * With one page of the pool left free of targets, the explanation said "A
 * target of at most 1 page would be admitted now", but an open with target
 * 1 is raised to the floor of 2 pages and refused again; only target 0 is
 * admitted then. With room for the floor, the named target is admitted. */
static void test_explain_refusal_advice_is_admissible(void **state) {
  (void)state;
  for (uint32_t left = 1; left <= 3; left++) {
    akv_engine *e = akvt_small_engine(AKV_ROUTE_ARENA, 1);
    akv_engine_info info;
    akv_context *a = NULL, *b = NULL;
    char buf[2048];
    assert_non_null(e);
    assert_int_equal(akv_engine_info_get(e, &info), AKV_OK);
    assert_int_equal(open_tb(e, info.device_pages - left, 0, &a), AKV_OK);
    assert_int_equal(open_tb(e, left + 1, 0, &b), AKV_ERR_ADMISSION_REFUSED);
    assert_int_equal(akv_admission_explain(e, NULL, buf, sizeof buf), AKV_OK);
    const char *at = strstr(buf, "A target of at most ");
    if (at != NULL) {
      unsigned n = 0;
      assert_int_equal(sscanf(at, "A target of at most %u page", &n), 1);
      assert_int_equal(n, left);
      if (open_tb(e, n, 0, &b) != AKV_OK)
        fail_msg("left %u: the explanation names target %u as admissible, which is refused: %s",
                 left, n, buf);
    } else {
      if (left >= 2) fail_msg("left %u: no admissible target named: %s", left, buf);
      assert_non_null(strstr(buf, "Only target 0"));
      assert_int_equal(open_tb(e, left, 0, &b), AKV_ERR_ADMISSION_REFUSED);
      assert_int_equal(open_tb(e, 0, 0, &b), AKV_OK);
    }
    assert_int_equal(akv_engine_destroy(e), AKV_OK);
  }
}

/* Promise (akv_context_config, akv_context_open, as made precise): the
 * floor is the sink and the newest page, 2 pages, and 1 where a context has
 * one page only (max_tokens <= page_tokens): there a target of 1 is not
 * raised (it holds the context's only page) and the explanation says so. */
static void test_floor_of_one_page_context(void **state) {
  (void)state;
  akv_engine_config ec = akvt_small_config(AKV_ROUTE_ARENA, 1);
  ec.max_tokens = 8; /* = page_tokens: one page per context */
  akv_engine *e = NULL;
  akv_context *c = NULL, *d = NULL;
  char buf[1024];
  assert_int_equal(akv_engine_create(&ec, &e), AKV_OK);
  assert_int_equal(open_tb(e, 1, 0, &c), AKV_OK);
  assert_int_equal(akv_admission_explain(e, c, buf, sizeof buf), AKV_OK);
  if (strstr(buf, "against its target of 1 (+0 burst)") == NULL || strstr(buf, "raised") != NULL)
    fail_msg("one-page context: target 1 changed: %s", buf);
  assert_int_equal(open_tb(e, 0, 1, &d), AKV_OK);
  assert_int_equal(akv_admission_explain(e, d, buf, sizeof buf), AKV_OK);
  if (strstr(buf, "against its target of 0 (+1 burst)") == NULL || strstr(buf, "raised") != NULL)
    fail_msg("one-page context: burst 1 changed: %s", buf);
  assert_int_equal(akv_engine_destroy(e), AKV_OK);
  /* two pages per context: raised to 2 */
  ec.max_tokens = 9;
  assert_int_equal(akv_engine_create(&ec, &e), AKV_OK);
  assert_int_equal(open_tb(e, 1, 0, &c), AKV_OK);
  assert_int_equal(akv_admission_explain(e, c, buf, sizeof buf), AKV_OK);
  assert_non_null(strstr(buf, "against its target of 2 (+0 burst)"));
  assert_non_null(strstr(buf, "raised to 2"));
  assert_int_equal(akv_engine_destroy(e), AKV_OK);
}

/* An engine of the route with headroom of exactly `chunks` chunks of
 * `chunk_pages` pages on a modelled device (host_fake_free_bytes), as the
 * harness makes one (testutil.c). */
static akv_engine *hr_engine(akv_route route, uint32_t chunks, uint32_t chunk_pages,
                             akv_engine_config *out_cfg) {
  akv_engine_config ec = akvt_small_config(route, 1);
  akv_engine *e = NULL;
  akv_engine_info pi;
  const uint32_t slack = route == AKV_ROUTE_PAGED ? 1 : 0;
  ec.headroom_gib = 1;
  ec.headroom_chunk_pages = chunk_pages;
  ec.host_fake_free_bytes = 0;
  assert_int_equal(akv_engine_create(&ec, &e), AKV_OK);
  assert_int_equal(akv_engine_info_get(e, &pi), AKV_OK);
  assert_int_equal(akv_engine_destroy(e), AKV_OK);
  ec.host_fake_free_bytes =
      pi.device_bytes_allocated + (uint64_t)chunks * (chunk_pages + slack) * pi.page_bytes;
  e = NULL;
  assert_int_equal(akv_engine_create(&ec, &e), AKV_OK);
  if (out_cfg) *out_cfg = ec;
  return e;
}

/* Promise (akv_headroom_release): "the fewest whole chunks whose allocations
 * cover `bytes`, newest first; all of it when bytes exceeds what is present;
 * bytes == 0 gives nothing back"; *freed_now says how many bytes; releases
 * counts calls that gave back at least one chunk; bytes_released what went
 * back; akv_headroom_take takes whole chunks up to `bytes` and says so in
 * *taken, never past the pages measured at create. Both routes. */
static void test_headroom_chunk_arithmetic(void **state) {
  (void)state;
  const akv_route routes[2] = {AKV_ROUTE_ARENA, AKV_ROUTE_PAGED};
  for (int r = 0; r < 2; r++) {
    akv_engine *e = hr_engine(routes[r], 4, 2, NULL);
    akv_headroom_info hi, h2;
    assert_int_equal(akv_headroom_get(e, &hi), AKV_OK);
    assert_int_equal(hi.enabled, 1);
    assert_int_equal(hi.chunk_pages, 2);
    assert_int_equal(hi.pages, 8);
    assert_int_equal(hi.max_pages, 8);
    const uint64_t chunk = hi.bytes / 4;
    assert_true(chunk > 0 && chunk * 4 == hi.bytes);
    uint64_t now = 77, pend = 77;
    /* bytes 0: nothing, outputs 0, not counted */
    assert_int_equal(akv_headroom_release(e, 0, &now, &pend), AKV_OK);
    assert_int_equal(now, 0);
    assert_int_equal(pend, 0);
    assert_int_equal(akv_headroom_get(e, &h2), AKV_OK);
    assert_int_equal(h2.releases, 0);
    assert_int_equal(h2.pages, 8);
    /* 1 byte: one whole chunk */
    assert_int_equal(akv_headroom_release(e, 1, &now, &pend), AKV_OK);
    assert_int_equal(now, chunk);
    assert_int_equal(pend, 0);
    /* exactly one chunk: one chunk */
    assert_int_equal(akv_headroom_release(e, chunk, &now, NULL), AKV_OK);
    assert_int_equal(now, chunk);
    /* one chunk and a byte: two chunks */
    assert_int_equal(akv_headroom_release(e, chunk + 1, &now, NULL), AKV_OK);
    assert_int_equal(now, 2 * chunk);
    assert_int_equal(akv_headroom_get(e, &h2), AKV_OK);
    assert_int_equal(h2.pages, 0);
    assert_int_equal(h2.bytes, 0);
    assert_int_equal(h2.releases, 3);
    assert_int_equal(h2.bytes_released, 4 * chunk);
    /* nothing present: OK, 0, not counted */
    now = 77;
    assert_int_equal(akv_headroom_release(e, UINT64_MAX, &now, NULL), AKV_OK);
    assert_int_equal(now, 0);
    assert_int_equal(akv_headroom_get(e, &h2), AKV_OK);
    assert_int_equal(h2.releases, 3);
    /* take: below one chunk takes nothing, then whole chunks, capped at
     * the pages measured at create */
    uint64_t taken = 77;
    assert_int_equal(akv_headroom_take(e, chunk - 1, &taken), AKV_OK);
    assert_int_equal(taken, 0);
    assert_int_equal(akv_headroom_take(e, 2 * chunk + chunk / 2, &taken), AKV_OK);
    assert_int_equal(taken, 2 * chunk);
    assert_int_equal(akv_headroom_take(e, UINT64_MAX, &taken), AKV_OK);
    assert_int_equal(taken, 2 * chunk);
    assert_int_equal(akv_headroom_take(e, UINT64_MAX, &taken), AKV_OK);
    assert_int_equal(taken, 0);
    assert_int_equal(akv_headroom_get(e, &h2), AKV_OK);
    assert_int_equal(h2.pages, 8);
    assert_int_equal(h2.takes, 2);
    assert_int_equal(h2.bytes, 4 * chunk);
    assert_int_equal(akv_engine_destroy(e), AKV_OK);
  }
}

/* Promise (akv_headroom_release / _take, Conventions): "on any error
 * nothing is released and the outputs are left as they were" - not
 * enabled (AKV_ERR_NOT_SUPPORTED), a take inside a step or with a release
 * pending (AKV_ERR_STEP_STATE), after a transport failure
 * (AKV_ERR_QUARANTINED), dead engine (AKV_ERR_BAD_HANDLE). */
static void test_headroom_refusals_leave_outputs(void **state) {
  (void)state;
  uint64_t a, b;
  akvt_fx f;
  akvt_fx_open(&f, AKV_ROUTE_ARENA, 1, 2, 20);
  memset(&a, PAT, sizeof a);
  memset(&b, PAT, sizeof b);
  assert_int_equal(akv_headroom_release(f.e, 1, &a, &b), AKV_ERR_NOT_SUPPORTED);
  assert_int_equal(akv_headroom_take(f.e, 1, &a), AKV_ERR_NOT_SUPPORTED);
  assert_true(all_pat(&a, sizeof a) && all_pat(&b, sizeof b));
  assert_int_equal(akv_stream_destroy(f.e, f.s), AKV_OK);
  assert_int_equal(akv_engine_destroy(f.e), AKV_OK);
  assert_int_equal(akv_headroom_release(f.e, 1, &a, &b), AKV_ERR_BAD_HANDLE);
  assert_int_equal(akv_headroom_take(f.e, 1, &a), AKV_ERR_BAD_HANDLE);
  assert_true(all_pat(&a, sizeof a) && all_pat(&b, sizeof b));

  akv_engine *e = hr_engine(AKV_ROUTE_PAGED, 4, 2, NULL);
  akv_stream s = NULL;
  akv_context *c = NULL;
  static uint16_t zero[64 * 16];
  const void *rows[3] = {zero, zero, zero};
  assert_int_equal(akv_stream_create(e, &s), AKV_OK);
  assert_int_equal(akv_context_open(e, NULL, &c), AKV_OK);
  assert_int_equal(akv_context_append(c, 40, rows, rows), AKV_OK);
  assert_int_equal(akv_step_begin(e, &c, 1), AKV_OK);
  akv_headroom_info before, after;
  assert_int_equal(akv_headroom_get(e, &before), AKV_OK);
  assert_int_equal(akv_headroom_take(e, UINT64_MAX, &a), AKV_ERR_STEP_STATE);
  assert_true(all_pat(&a, sizeof a));
  /* mid-step release: pending, then a take is refused until step end */
  uint64_t now = 77, pend = 77;
  assert_int_equal(akv_headroom_release(e, 1, &now, &pend), AKV_OK);
  assert_int_equal(now, 0);
  assert_true(pend > 0);
  assert_int_equal(akvt_null_layers(e, s, 3), AKV_OK);
  assert_int_equal(akv_headroom_get(e, &after), AKV_OK);
  assert_int_equal(after.pages_pending, 0);
  assert_int_equal(after.pages + before.chunk_pages, before.pages);
  assert_int_equal(after.bytes_released, pend);
  /* a failed transport: refused, outputs alone, nothing released */
  assert_int_equal(akv_step_begin(e, &c, 1), AKV_OK);
  akv_lease *l = NULL;
  assert_int_equal(akv_lease_begin(e, 0, &l), AKV_OK);
  akv_fence fa;
  assert_int_equal(akv_lease_attend(l, s, NULL, NULL, &fa), AKV_ERR_INVALID_ARGUMENT);
  extern int akvt_s34_fail_hook(void *, const akv_view *, akv_stream);
  assert_int_equal(akv_lease_attend(l, s, akvt_s34_fail_hook, NULL, &fa), AKV_ERR_BACKEND);
  assert_int_equal(akv_headroom_get(e, &before), AKV_OK);
  assert_int_equal(akv_headroom_release(e, UINT64_MAX, &a, &b), AKV_ERR_QUARANTINED);
  assert_int_equal(akv_headroom_take(e, UINT64_MAX, &a), AKV_ERR_QUARANTINED);
  assert_true(all_pat(&a, sizeof a) && all_pat(&b, sizeof b));
  assert_int_equal(akv_headroom_get(e, &after), AKV_OK);
  assert_memory_equal(&before, &after, sizeof before);
  assert_int_equal(akv_engine_quarantine(e, NULL), AKV_OK);
  assert_int_equal(akv_stream_destroy(e, s), AKV_OK);
  assert_int_equal(akv_engine_destroy(e), AKV_OK);
}

int akvt_s34_fail_hook(void *user, const akv_view *view, akv_stream stream) {
  (void)user;
  (void)view;
  (void)stream;
  return 1;
}

/* Promise (DESIGN §6, akv.h routes): every route gives attention output
 * bit-identical to resident attention and leaves the authoritative host
 * rows exact, also at the edges of the page geometry: one logical page per
 * context (page_tokens == max_tokens: only the sink, never a full page),
 * pages of one row, a context filled to its last row, with pool pages,
 * headroom pages and a headroom release in the middle of a step. */
static void test_decode_at_page_geometry_edges(void **state) {
  (void)state;
  const akv_route routes[3] = {AKV_ROUTE_STAGE, AKV_ROUTE_ARENA, AKV_ROUTE_PAGED};
  const uint32_t pts[3] = {24, 1, 5}; /* max_tokens 24 */
  for (int r = 0; r < 3; r++)
    for (int p = 0; p < 3; p++)
      for (int hr = 0; hr < 3; hr++) {
        if (hr > 0 && routes[r] == AKV_ROUTE_STAGE) continue;
        akvt_cfg c = akvt_default_cfg();
        akvt_result res;
        c.route = routes[r];
        c.max_tokens = 24;
        c.page_tokens = pts[p];
        c.n_ctx = 3;
        c.prefill[0] = 0;
        c.prefill[1] = 11;
        c.prefill[2] = 24 - 4; /* full after the 4 steps */
        c.steps = 4;
        c.device_pool_gib = routes[r] == AKV_ROUTE_STAGE ? 0 : 1;
        c.target_pages = routes[r] == AKV_ROUTE_STAGE ? AKV_TARGET_FAIR_SHARE : 2;
        c.burst_pages = 1;
        if (hr > 0) {
          c.headroom_pages = 6;
          c.headroom_chunk_pages = 2;
        }
        if (hr == 2) {
          c.release_step = 2;
          c.release_mid_step = 1;
          c.release_layer = 1;
          c.release_bytes = 1;
        }
        akvt_run(&c, &res);
        if (res.status != AKV_OK || res.outputs_mismatched != 0 || res.rows_mismatched != 0 ||
            res.rows_checked != res.rows_expected || !res.destroyed)
          fail_msg("route %d page_tokens %u headroom case %d: status %s at %s, %llu of %llu "
                   "outputs and %llu of %llu rows differ (%llu expected), destroyed %d",
                   r, pts[p], hr, akv_status_string(res.status),
                   res.failed_call ? res.failed_call : "-",
                   (unsigned long long)res.outputs_mismatched,
                   (unsigned long long)res.outputs_compared,
                   (unsigned long long)res.rows_mismatched, (unsigned long long)res.rows_checked,
                   (unsigned long long)res.rows_expected, res.destroyed);
      }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_explain_truncation_every_cap),
      cmocka_unit_test(test_explain_refusals_leave_buf),
      cmocka_unit_test(test_explain_refused_open_states_its_burst),
      cmocka_unit_test(test_explain_refusal_advice_is_admissible),
      cmocka_unit_test(test_floor_of_one_page_context),
      cmocka_unit_test(test_headroom_chunk_arithmetic),
      cmocka_unit_test(test_headroom_refusals_leave_outputs),
      cmocka_unit_test(test_decode_at_page_geometry_edges),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
