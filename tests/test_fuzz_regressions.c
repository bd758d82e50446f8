/*
 * test_fuzz_regressions.c - inputs the public-API fuzzer (fuzz/fuzz_api.c)
 * found, each reduced to the calls that matter and checked against what the
 * headers promise. One test per finding; the comment of each says what the
 * input did and what went wrong before the fix.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "akv.h"
#include "akv_attention.h"
#include "akv_group.h"
#include "testutil.h"

/* All lengths 0 with a workspace of 0 bytes, NULL (akv_attention.h: "a
 * workspace of 0 bytes, NULL included, serves calls whose lengths are all
 * 0"). The reference formed the partials' pointer as NULL + 0, undefined
 * behaviour that UBSan reports ("applying zero offset to null pointer"). The
 * call must succeed with zeros, on both variants. */
static void test_attention_null_workspace_all_empty(void **state) {
  (void)state;
  uint16_t q[2 * 8] = {0};
  uint16_t kv[2 * 8] = {0};
  float out[2 * 8];
  uint32_t len[2] = {0, 0};
  size_t ws = 1;
  akv_attention_args a;
  assert_int_equal(akv_attention_workspace_bytes(2, 1, 8, 0, 16, &ws), AKV_OK);
  assert_int_equal(ws, 0);
  memset(&a, 0, sizeof(a));
  a.dtype = AKV_DTYPE_BF16;
  a.n_contexts = 2;
  a.n_heads = 1;
  a.kv_heads = 1;
  a.head_dim = 8;
  a.chunk_tokens = 16;
  a.scale = 0.35f;
  a.q = q;
  a.k_base = kv;
  a.v_base = kv;
  a.context_stride = 16;
  a.row_bytes = 16;
  a.len = len;
  a.out = out;
  a.workspace = NULL;
  a.workspace_bytes = 0;
  memset(out, 0x7b, sizeof(out));
  assert_int_equal(akv_attention_ref_bf16(&a), AKV_OK);
  for (size_t i = 0; i < 16; i++) assert_true(out[i] == 0.0f);

  {
    uint32_t indptr[3] = {0, 0, 0}, last[2] = {0, 0}, idx[1] = {0};
    akv_page_table t = {2, 16, 0, indptr, idx, last, kv, kv, 16 * 16, 16};
    akv_attention_paged_args pa;
    memset(&pa, 0, sizeof(pa));
    pa.dtype = AKV_DTYPE_BF16;
    pa.n_heads = 1;
    pa.kv_heads = 1;
    pa.head_dim = 8;
    pa.scale = 0.35f;
    pa.q = q;
    pa.out = out;
    memset(out, 0x7b, sizeof(out));
    assert_int_equal(akv_attention_paged_ref_bf16(&pa, t), AKV_OK);
    for (size_t i = 0; i < 16; i++) assert_true(out[i] == 0.0f);
  }
}

/* A log callback that calls a diagnostic which fails (akv.h allows
 * diagnostics there: akv_context_read, akv_admission_explain, ...), on an
 * engine logging at DEBUG. The failure was reported through akv_fail, which
 * logs the error at DEBUG, which called the callback again, which made the
 * same failing call: recursion without end (a stack overflow). A call made
 * from the callback must return its status and log nothing. */
typedef struct reenter {
  akv_context *ctx;
  akv_engine *e;
  int armed;
  int depth, max_depth, calls;
} reenter;

static void reenter_log(void *user, akv_log_level level, const char *message) {
  reenter *r = user;
  char buf[64];
  uint8_t row[2 * 64];
  (void)level;
  (void)message;
  if (!r->armed) return;
  r->calls++;
  r->depth++;
  if (r->depth > r->max_depth) r->max_depth = r->depth;
  if (r->depth < 64) {
    /* diagnostics that fail: a layer out of range, a context of no engine */
    assert_int_equal(akv_context_read(r->ctx, 99, 0, 1, row, row), AKV_ERR_INVALID_ARGUMENT);
    assert_int_equal(akv_admission_explain(r->e, (const akv_context *)r, buf, sizeof(buf)),
                     AKV_ERR_BAD_HANDLE);
    /* a call that changes the engine: refused, logging nothing */
    assert_int_equal(akv_headroom_take(r->e, 1, NULL), AKV_ERR_IN_USE);
  }
  r->depth--;
}

static void test_log_callback_failing_diagnostic_does_not_recurse(void **state) {
  (void)state;
  reenter r;
  akv_engine_config ec = akvt_small_config(AKV_ROUTE_STAGE, 0);
  uint8_t row[2 * 64];
  memset(&r, 0, sizeof(r));
  ec.log_fn = reenter_log;
  ec.log_user = &r;
  ec.log_level = AKV_LOG_DEBUG;
  assert_int_equal(akv_engine_create(&ec, &r.e), AKV_OK);
  assert_int_equal(akv_context_open(r.e, NULL, &r.ctx), AKV_OK);
  r.armed = 1;
  /* fails outside the callback: logged once, and the callback's own
   * failing calls log nothing */
  assert_int_equal(akv_context_read(r.ctx, 99, 0, 1, row, row), AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(r.max_depth, 1);
  assert_int_equal(r.calls, 1);
  r.armed = 0;
  assert_int_equal(akv_context_close(r.ctx), AKV_OK);
  assert_int_equal(akv_engine_destroy(r.e), AKV_OK);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_attention_null_workspace_all_empty),
      cmocka_unit_test(test_log_callback_failing_diagnostic_does_not_recurse),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
