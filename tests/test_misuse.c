/*
 * test_misuse.c - promises of akv.h attacked from a caller's side: calls
 * made where the header says they are refused, callbacks that misbehave,
 * handles and fences carried across leases and engines. Each refused call
 * must return its specific status and change nothing; nothing may crash,
 * read or write out of bounds, or report AKV_OK for what it did not do.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "internal.h"
#include "testutil.h"

#define LAYERS 3
#define ROW_ELEMS 16 /* kv_heads 2 x head_dim 8 (akvt_small_engine) */

typedef akvt_fx fx; /* a small host engine, one stream, n contexts of zero rows */
#define fx_open akvt_fx_open

static void fx_close(fx *f) {
  assert_int_equal(akv_stream_destroy(f->e, f->s), AKV_OK);
  assert_int_equal(akv_engine_destroy(f->e), AKV_OK);
}

/* Begin, attend, write back, seal one layer; the fences go to *attn / *tail. */
static akv_lease *to_sealed(fx *f, uint32_t layer, akv_fence *attn, akv_fence *tail) {
  akv_lease *ls = NULL;
  assert_int_equal(akv_lease_begin(f->e, layer, &ls), AKV_OK);
  assert_int_equal(akv_lease_attend(ls, f->s, akvt_noop_hook, NULL, attn), AKV_OK);
  assert_int_equal(akv_lease_write_back(ls, NULL, 0, tail), AKV_OK);
  return ls;
}

static void noop_fn(void *arg) { (void)arg; }

/* Every layer from `from` on to retired, then the step's end. */
static void finish_step(fx *f, uint32_t from) {
  for (uint32_t l = from; l < LAYERS; l++) {
    akv_fence attn, tail;
    akv_lease *ls = to_sealed(f, l, &attn, &tail);
    assert_int_equal(akv_lease_seal(ls, tail, attn), AKV_OK);
    assert_int_equal(akv_lease_retire(ls, NULL), AKV_OK);
  }
  assert_int_equal(akv_step_end(f->e), AKV_OK);
}

/* ---------------------------------------------------- fences across engines */

/* A fence names one recording: seal compares serials, so a fence of another
 * engine's lease is a substitute even when both engines ran the same calls. */
static void test_seal_refuses_another_engines_fences(void **state) {
  fx a, b;
  akv_fence attn_a, tail_a, attn_b, tail_b;
  akv_lease *la, *lb;
  (void)state;
  fx_open(&a, AKV_ROUTE_STAGE, 0, 1, 4);
  fx_open(&b, AKV_ROUTE_STAGE, 0, 1, 4);
  assert_int_equal(akv_step_begin(a.e, a.c, 1), AKV_OK);
  assert_int_equal(akv_step_begin(b.e, b.c, 1), AKV_OK);
  la = to_sealed(&a, 0, &attn_a, &tail_a);
  lb = to_sealed(&b, 0, &attn_b, &tail_b);
  assert_int_equal(akv_lease_seal(la, tail_b, attn_b), AKV_ERR_FENCE_MISMATCH);
  assert_int_equal(akv_lease_seal(la, tail_a, attn_b), AKV_ERR_FENCE_MISMATCH);
  assert_int_equal(akv_lease_seal(la, tail_b, attn_a), AKV_ERR_FENCE_MISMATCH);
  assert_int_equal(la->body->state, AKV_LEASE_CONSUMED);
  assert_int_equal(akv_lease_seal(la, tail_a, attn_a), AKV_OK);
  assert_int_equal(akv_lease_seal(lb, tail_b, attn_b), AKV_OK);
  assert_int_equal(akv_lease_retire(la, NULL), AKV_OK);
  assert_int_equal(akv_lease_retire(lb, NULL), AKV_OK);
  for (uint32_t l = 1; l < LAYERS; l++) {
    akv_fence x, y;
    la = to_sealed(&a, l, &x, &y);
    assert_int_equal(akv_lease_seal(la, y, x), AKV_OK);
    assert_int_equal(akv_lease_retire(la, NULL), AKV_OK);
    lb = to_sealed(&b, l, &x, &y);
    assert_int_equal(akv_lease_seal(lb, y, x), AKV_OK);
    assert_int_equal(akv_lease_retire(lb, NULL), AKV_OK);
  }
  assert_int_equal(akv_step_end(a.e), AKV_OK);
  assert_int_equal(akv_step_end(b.e), AKV_OK);
  fx_close(&a);
  fx_close(&b);
}

/* ------------------------------------------------- hooks that misbehave */

/* An attention hook that quarantines its own engine, destroys the stream it
 * was given and the engine, then returns `rc`: attend must not touch the
 * lease or the engine after the hook returns. */
typedef struct killer {
  akv_engine *e;
  int rc;
  akv_status q, sd, ed;
} killer;

static int killer_hook(void *user, const akv_view *view, akv_stream stream) {
  killer *k = user;
  akv_quarantine_report r;
  (void)view;
  k->q = akv_engine_quarantine(k->e, &r);
  k->sd = akv_stream_destroy(k->e, stream);
  k->ed = akv_engine_destroy(k->e);
  return k->rc;
}

static void hook_destroys_engine(int rc) {
  fx f;
  killer k;
  akv_lease *ls = NULL;
  akv_fence attn = {77};
  fx_open(&f, AKV_ROUTE_STAGE, 0, 2, 3);
  assert_int_equal(akv_step_begin(f.e, f.c, 2), AKV_OK);
  assert_int_equal(akv_lease_begin(f.e, 0, &ls), AKV_OK);
  memset(&k, 0, sizeof k);
  k.e = f.e;
  k.rc = rc;
  assert_int_equal(akv_lease_attend(ls, f.s, killer_hook, &k, &attn), AKV_ERR_BAD_HANDLE);
  assert_int_equal(k.q, AKV_OK);
  assert_int_equal(k.sd, AKV_OK);
  assert_int_equal(k.ed, AKV_OK);
  assert_int_equal(attn.serial, 77); /* untouched */
  assert_int_equal(akv_engine_destroy(f.e), AKV_ERR_BAD_HANDLE);
  assert_int_equal(akv_lease_retire(ls, NULL), AKV_ERR_BAD_HANDLE);
}

static void test_hook_destroys_engine_and_fails(void **state) {
  (void)state;
  hook_destroys_engine(1);
}

static void test_hook_destroys_engine_and_succeeds(void **state) {
  (void)state;
  hook_destroys_engine(0);
}

/* ------------------------------------------------------ destroyed streams */

/* A destroyed stream is refused by every call that takes a stream, also
 * after later streams were created: the host backend reuses a destroyed
 * queue's memory at once, so the handle must not be the queue's address. */
static void test_destroyed_stream_stays_refused_after_later_creates(void **state) {
  fx f;
  akv_stream dead[AKV_STREAM_HANDLE_REUSE_MIN];
  akv_lease *ls = NULL;
  akv_view view;
  akv_fence attn;
  (void)state;
  fx_open(&f, AKV_ROUTE_STAGE, 0, 1, 2);
  for (uint32_t i = 0; i < AKV_STREAM_HANDLE_REUSE_MIN; i++) {
    akv_stream s = NULL;
    assert_int_equal(akv_stream_create(f.e, &s), AKV_OK);
    for (uint32_t j = 0; j < i; j++) {
      assert_ptr_not_equal(s, dead[j]);
      assert_int_equal(akv_stream_synchronize(f.e, dead[j]), AKV_ERR_INVALID_ARGUMENT);
    }
    assert_int_equal(akv_stream_destroy(f.e, s), AKV_OK);
    dead[i] = s;
  }
  /* None of them is taken for a live stream by the lease calls either. */
  assert_int_equal(akv_step_begin(f.e, f.c, 1), AKV_OK);
  assert_int_equal(akv_lease_begin(f.e, 0, &ls), AKV_OK);
  for (uint32_t j = 0; j < AKV_STREAM_HANDLE_REUSE_MIN; j++) {
    assert_int_equal(akv_stream_destroy(f.e, dead[j]), AKV_ERR_INVALID_ARGUMENT);
    assert_int_equal(akv_stream_launch_host(f.e, dead[j], noop_fn, NULL),
                     AKV_ERR_INVALID_ARGUMENT);
    assert_int_equal(akv_lease_wait_ready(ls, dead[j], &view), AKV_ERR_INVALID_ARGUMENT);
    assert_int_equal(akv_lease_attend(ls, dead[j], akvt_noop_hook, NULL, &attn),
                     AKV_ERR_INVALID_ARGUMENT);
  }
  assert_int_equal(ls->body->state, AKV_LEASE_BEGUN);
  {
    akv_fence tail;
    assert_int_equal(akv_lease_attend(ls, f.s, akvt_noop_hook, NULL, &attn), AKV_OK);
    assert_int_equal(akv_lease_write_back(ls, NULL, 0, &tail), AKV_OK);
    assert_int_equal(akv_lease_seal(ls, tail, attn), AKV_OK);
    assert_int_equal(akv_lease_retire(ls, NULL), AKV_OK);
  }
  finish_step(&f, 1);
  fx_close(&f);
}

/* ------------------------------------------ refusals inside the log callback */

/* akv.h (akv_log_fn): a call that changes the engine, made from the
 * engine's log callback, returns AKV_ERR_IN_USE and changes nothing. Its
 * refusal wrote the engine's last error, so the error being logged (the
 * outer call's) was replaced by "called from the engine's log callback"
 * both inside the callback and after the failing call returned. */
typedef struct errlog {
  akv_engine *e;
  int armed, refused;
  char seen[256];
} errlog;

static void errlog_fn(void *user, akv_log_level level, const char *message) {
  errlog *r = user;
  akv_context *c = NULL;
  (void)level;
  (void)message;
  if (!r->armed) return;
  r->armed = 0;
  r->refused = akv_context_open(r->e, NULL, &c) == AKV_ERR_IN_USE && c == NULL;
  snprintf(r->seen, sizeof(r->seen), "%s", akv_engine_last_error(r->e));
}

static void test_log_callback_refusal_keeps_last_error(void **state) {
  errlog r;
  akv_engine_config ec = akvt_small_config(AKV_ROUTE_STAGE, 0);
  akv_context *ctx = NULL;
  uint8_t row[2 * ROW_ELEMS];
  (void)state;
  memset(&r, 0, sizeof(r));
  ec.log_fn = errlog_fn;
  ec.log_user = &r;
  ec.log_level = AKV_LOG_DEBUG;
  assert_int_equal(akv_engine_create(&ec, &r.e), AKV_OK);
  assert_int_equal(akv_context_open(r.e, NULL, &ctx), AKV_OK);
  r.armed = 1;
  assert_int_equal(akv_context_read(ctx, 99, 0, 1, row, row), AKV_ERR_INVALID_ARGUMENT);
  assert_true(r.refused);
  /* the callback read the error it was told about, and so does the caller */
  assert_null(strstr(r.seen, "log callback"));
  assert_string_equal(akv_engine_last_error(r.e), r.seen);
  assert_int_equal(akv_context_close(ctx), AKV_OK);
  assert_int_equal(akv_engine_destroy(r.e), AKV_OK);
}

/* ---------------------------------------------------------- context ids */

/* akv.h (akv_context_id): ids were "never reused", but the counter was 32
 * bits: after 2^32 opens it wrapped to 0, and UINT32_MAX, which the
 * admission log uses for "the engine" and "no victim", was issued too; a
 * wrapped id could equal a live context's, and the admission rules compare
 * ids. The counter is moved to its end here (internal.h) instead of opening
 * 2^32 contexts. */
static void test_context_ids_wrap_past_markers_and_live_ids(void **state) {
  fx f;
  akv_context *b = NULL, *c = NULL;
  uint32_t ida = 0, idb = 0, idc = 0;
  akv_adm_decision d[64];
  size_t nd = 0;
  (void)state;
  fx_open(&f, AKV_ROUTE_STAGE, 0, 0, 0);
  f.e->next_context_id = 0;
  assert_int_equal(akv_context_open(f.e, NULL, &f.c[0]), AKV_OK);
  f.n = 1;
  assert_int_equal(akv_context_id(f.c[0], &ida), AKV_OK);
  assert_int_equal(ida, 1);
  f.e->next_context_id = UINT32_MAX - 2;
  assert_int_equal(akv_context_open(f.e, NULL, &b), AKV_OK);
  assert_int_equal(akv_context_id(b, &idb), AKV_OK);
  assert_int_equal(idb, UINT32_MAX - 1);
  assert_int_equal(akv_context_close(b), AKV_OK);
  /* next: not UINT32_MAX, not 0, not 1 (the open context's): 2 */
  assert_int_equal(akv_context_open(f.e, NULL, &c), AKV_OK);
  assert_int_equal(akv_context_id(c, &idc), AKV_OK);
  assert_int_equal(idc, 2);
  assert_int_equal(akv_admission_log(f.e, d, 64, &nd), AKV_OK);
  for (size_t i = 0; i < nd && i < 64; i++) assert_int_not_equal(d[i].context, 0);
  assert_int_equal(akv_context_close(c), AKV_OK);
  assert_int_equal(akv_context_close(f.c[0]), AKV_OK);
  fx_close(&f);
}

/* ------------------------------------------------------- testing aids */

/* host_delay_max_us bounds one injected delay; uncapped, a slip of the
 * value (UINT32_MAX) had an engine sleep up to 71 minutes before an
 * operation. Above AKV_HOST_DELAY_MAX_US it is refused at create. */
static void test_host_delay_bound_is_capped(void **state) {
  akv_engine_config ec = akvt_small_config(AKV_ROUTE_STAGE, 0);
  akv_engine *e = NULL;
  (void)state;
  ec.host_delay_seed = 7;
  ec.host_delay_max_us = AKV_HOST_DELAY_MAX_US + 1u;
  assert_int_equal(akv_engine_create(&ec, &e), AKV_ERR_CONFIG);
  assert_null(e);
  ec.host_delay_max_us = UINT32_MAX;
  assert_int_equal(akv_engine_create(&ec, &e), AKV_ERR_CONFIG);
  assert_null(e);
  ec.host_delay_max_us = AKV_HOST_DELAY_MAX_US;
  assert_int_equal(akv_engine_create(&ec, &e), AKV_OK);
  assert_int_equal(akv_engine_destroy(e), AKV_OK);
}

/* Enum fields of the engine config outside their enums are refused like
 * route, fit_mode, backend and dtype (AKV_ERR_CONFIG at akv_fit and at
 * create, nothing created): a log_level past AKV_LOG_DEBUG logged everything
 * and a fault_kind outside akv_op_kind (and not -1) never fired, silently. */
static void test_config_enums_out_of_range_are_refused(void **state) {
  const int32_t bad_levels[] = {-1, AKV_LOG_DEBUG + 1, 1000};
  const int32_t bad_kinds[] = {-2, AKV_OP_KIND_COUNT, INT32_MAX, INT32_MIN};
  akv_fit_report rep;
  akv_engine *e = NULL;
  (void)state;
  for (size_t i = 0; i < sizeof bad_levels / sizeof bad_levels[0]; i++) {
    akv_engine_config ec = akvt_small_config(AKV_ROUTE_STAGE, 0);
    ec.log_level = (akv_log_level)bad_levels[i];
    assert_int_equal(akv_fit(&ec, &rep), AKV_ERR_CONFIG);
    assert_int_equal(akv_engine_create(&ec, &e), AKV_ERR_CONFIG);
    assert_null(e);
  }
  for (size_t i = 0; i < sizeof bad_kinds / sizeof bad_kinds[0]; i++) {
    akv_engine_config ec = akvt_small_config(AKV_ROUTE_STAGE, 0);
    ec.fault_kind = bad_kinds[i];
    assert_int_equal(akv_fit(&ec, &rep), AKV_ERR_CONFIG);
    assert_int_equal(akv_engine_create(&ec, &e), AKV_ERR_CONFIG);
    assert_null(e);
  }
  /* Every value of the enums (and fault_kind -1) is taken. */
  for (int32_t lv = AKV_LOG_ERROR; lv <= AKV_LOG_DEBUG; lv++) {
    akv_engine_config ec = akvt_small_config(AKV_ROUTE_STAGE, 0);
    ec.log_level = (akv_log_level)lv;
    assert_int_equal(akv_engine_create(&ec, &e), AKV_OK);
    assert_int_equal(akv_engine_destroy(e), AKV_OK);
    e = NULL;
  }
  for (int32_t k = -1; k < AKV_OP_KIND_COUNT; k++) {
    akv_engine_config ec = akvt_small_config(AKV_ROUTE_STAGE, 0);
    ec.fault_kind = k;
    assert_int_equal(akv_fit(&ec, &rep), AKV_OK);
    assert_int_equal(akv_engine_create(&ec, &e), AKV_OK);
    assert_int_equal(akv_engine_destroy(e), AKV_OK);
    e = NULL;
  }
}

/* akv.h (akv_context_append): the two pointer arrays are required even for
 * 0 tokens, their entries are not; akv_context_append_layer takes NULL rows
 * for 0 tokens. Pinned so the two calls keep one documented rule. */
static void test_append_of_zero_tokens_needs_the_arrays_not_the_rows(void **state) {
  fx f;
  const void *none[LAYERS] = {NULL, NULL, NULL};
  uint32_t len = 7;
  (void)state;
  fx_open(&f, AKV_ROUTE_STAGE, 0, 1, 2);
  assert_int_equal(akv_context_append(f.c[0], 0, NULL, none), AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_context_append(f.c[0], 0, none, NULL), AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_context_append(f.c[0], 0, none, none), AKV_OK);
  assert_int_equal(akv_context_append(f.c[0], 1, none, none), AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_context_append_layer(f.c[0], 1, 0, NULL, NULL), AKV_OK);
  assert_int_equal(akv_context_append_layer(f.c[0], 1, 1, NULL, NULL), AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_context_length(f.c[0], &len), AKV_OK);
  assert_int_equal(len, 2);
  assert_int_equal(akv_context_close(f.c[0]), AKV_OK);
  fx_close(&f);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_seal_refuses_another_engines_fences),
      cmocka_unit_test(test_hook_destroys_engine_and_fails),
      cmocka_unit_test(test_hook_destroys_engine_and_succeeds),
      cmocka_unit_test(test_destroyed_stream_stays_refused_after_later_creates),
      cmocka_unit_test(test_log_callback_refusal_keeps_last_error),
      cmocka_unit_test(test_context_ids_wrap_past_markers_and_live_ids),
      cmocka_unit_test(test_host_delay_bound_is_capped),
      cmocka_unit_test(test_config_enums_out_of_range_are_refused),
      cmocka_unit_test(test_append_of_zero_tokens_needs_the_arrays_not_the_rows),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
