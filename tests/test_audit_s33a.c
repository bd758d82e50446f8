/*
 * test_audit_s33a.c - a promise audit of the core C API (akv.h). Each test
 * names the promise it checks and fails while the library breaks it.
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

/* The refusal's last error is its own (it changed) and names the call. */
static void assert_last_error_names(const akv_engine *e, const char *before, const char *call) {
  const char *now = akv_engine_last_error(e);
  if (strcmp(now, before) == 0 || strstr(now, call) == NULL)
    fail_msg("%s refused without its own last error naming it (last error: \"%s\")", call, now);
}

/* Sets the engine's last error to a known refusal of a diagnostic (allowed
 * also after a transport failure). */
static const char *mark(const akv_context *c) {
  assert_int_equal(akv_context_length(c, NULL), AKV_ERR_INVALID_ARGUMENT);
  return "context_length: out is NULL";
}

#define REFUSED(e, c, call, want, name)                 \
  do {                                                  \
    const char *before_ = mark(c);                      \
    assert_int_equal((call), (want));                   \
    assert_last_error_names((e), before_, (name));      \
  } while (0)

static int failing_hook(void *user, const akv_view *view, akv_stream stream) {
  (void)user;
  (void)view;
  (void)stream;
  return 1;
}

static void noop_fn(void *arg) { (void)arg; }

/* Promise (akv.h, Conventions): "a call refused on a live engine writes
 * what went wrong, in words naming the call, to that engine's last error".
 * After a transport failure every call but diagnostics, quarantine and
 * destroy is refused with AKV_ERR_QUARANTINED; that refusal wrote one
 * fixed sentence ("transport failed earlier; ...") naming no call, so a
 * caller reading the last error could not tell which call was refused
 * (and two refusals in a row left the same text). */
static void test_quarantined_refusals_name_the_call(void **state) {
  (void)state;
  akvt_fx f;
  akvt_fx_open(&f, AKV_ROUTE_ARENA, 1, 3, 20);
  akv_context *step[2] = {f.c[0], f.c[1]};
  akv_lease *l = NULL;
  akv_fence a = {0}, t = {0};
  akv_receipt r;
  akv_view v;
  akv_stream s2 = NULL;
  akv_context *c = NULL;
  uint64_t u = 0;
  uint16_t row[16] = {0};
  const void *rows[3] = {row, row, row};
  assert_int_equal(akv_step_begin(f.e, step, 2), AKV_OK);
  assert_int_equal(akv_lease_begin(f.e, 0, &l), AKV_OK);
  /* A hook returning nonzero fails the transport; the lease stays ready. */
  assert_int_equal(akv_lease_attend(l, f.s, failing_hook, NULL, &a), AKV_ERR_BACKEND);
  REFUSED(f.e, f.c[2], akv_context_open(f.e, NULL, &c), AKV_ERR_QUARANTINED, "context_open");
  REFUSED(f.e, f.c[2], akv_context_close(f.c[2]), AKV_ERR_QUARANTINED, "context_close");
  REFUSED(f.e, f.c[2], akv_context_append(f.c[2], 1, rows, rows), AKV_ERR_QUARANTINED,
          "context_append");
  REFUSED(f.e, f.c[2], akv_context_append_layer(f.c[2], 0, 1, row, row), AKV_ERR_QUARANTINED,
          "context_append_layer");
  REFUSED(f.e, f.c[2], akv_step_begin(f.e, step, 2), AKV_ERR_QUARANTINED, "step_begin");
  REFUSED(f.e, f.c[2], akv_step_end(f.e), AKV_ERR_QUARANTINED, "step_end");
  REFUSED(f.e, f.c[2], akv_lease_begin(f.e, 1, &l), AKV_ERR_QUARANTINED, "lease_begin");
  REFUSED(f.e, f.c[2], akv_lease_wait_ready(l, f.s, &v), AKV_ERR_QUARANTINED, "lease_wait_ready");
  REFUSED(f.e, f.c[2], akv_lease_mark_consumed(l, f.s, &a), AKV_ERR_QUARANTINED,
          "lease_mark_consumed");
  REFUSED(f.e, f.c[2], akv_lease_attend(l, f.s, akvt_noop_hook, NULL, &a), AKV_ERR_QUARANTINED,
          "lease_attend");
  REFUSED(f.e, f.c[2], akv_lease_write_back(l, NULL, 0, &t), AKV_ERR_QUARANTINED,
          "lease_write_back");
  REFUSED(f.e, f.c[2], akv_lease_seal(l, t, a), AKV_ERR_QUARANTINED, "lease_seal");
  REFUSED(f.e, f.c[2], akv_lease_retire(l, &r), AKV_ERR_QUARANTINED, "lease_retire");
  REFUSED(f.e, f.c[2], akv_lease_try_retire(l, &r), AKV_ERR_QUARANTINED, "lease_try_retire");
  REFUSED(f.e, f.c[2], akv_stream_create(f.e, &s2), AKV_ERR_QUARANTINED, "stream_create");
  REFUSED(f.e, f.c[2], akv_stream_synchronize(f.e, f.s), AKV_ERR_QUARANTINED,
          "stream_synchronize");
  REFUSED(f.e, f.c[2], akv_stream_launch_host(f.e, f.s, noop_fn, NULL), AKV_ERR_QUARANTINED,
          "stream_launch_host");
  REFUSED(f.e, f.c[2], akv_headroom_release(f.e, 1, &u, &u), AKV_ERR_QUARANTINED,
          "headroom_release");
  REFUSED(f.e, f.c[2], akv_headroom_take(f.e, 1, &u), AKV_ERR_QUARANTINED, "headroom_take");
  /* destroy refuses a failed transport not quarantined: it names itself too */
  REFUSED(f.e, f.c[2], akv_engine_destroy(f.e), AKV_ERR_BUSY, "engine_destroy");
  assert_int_equal(akv_engine_quarantine(f.e, NULL), AKV_OK);
  assert_int_equal(akv_stream_destroy(f.e, f.s), AKV_OK);
  assert_int_equal(akv_engine_destroy(f.e), AKV_OK);
}

/* The same promise for the refusals of akv_engine_destroy (a step open)
 * and akv_engine_quarantine (completion not established): "destroy
 * refused: ..." and "quarantine could not establish completion ..." did
 * not name akv_engine_destroy / akv_engine_quarantine as every other call's
 * last error names its call (engine_info_get, stream_destroy, ...). */
static void test_engine_refusals_name_the_call(void **state) {
  (void)state;
  akvt_fx f;
  akvt_fx_open(&f, AKV_ROUTE_STAGE, 0, 2, 4);
  akv_context *step[1] = {f.c[0]};
  assert_int_equal(akv_step_begin(f.e, step, 1), AKV_OK);
  REFUSED(f.e, f.c[1], akv_engine_destroy(f.e), AKV_ERR_BUSY, "engine_destroy");
  assert_int_equal(akvt_null_layers(f.e, f.s, 3), AKV_OK);
  assert_int_equal(akv_stream_destroy(f.e, f.s), AKV_OK);
  assert_int_equal(akv_engine_destroy(f.e), AKV_OK);

  /* A quarantine whose first synchronise fails (fault injection). */
  akv_engine_config ec = akvt_small_config(AKV_ROUTE_STAGE, 0);
  akv_engine *e = NULL;
  akv_context *c = NULL;
  ec.fault_kind = AKV_OP_SYNC;
  ec.fault_fail_nth = 1;
  assert_int_equal(akv_engine_create(&ec, &e), AKV_OK);
  assert_int_equal(akv_context_open(e, NULL, &c), AKV_OK);
  REFUSED(e, c, akv_engine_quarantine(e, NULL), AKV_ERR_UNCERTAIN_FENCE, "engine_quarantine");
  assert_int_equal(akv_engine_quarantine(e, NULL), AKV_OK);
  assert_int_equal(akv_engine_destroy(e), AKV_OK);
}

/* The same promise for an akv_step_begin whose page fills or page map
 * could not be submitted: it returns AKV_ERR_BACKEND (transport failed)
 * with a last error that said "page fill: ..." or "page map: ...", naming
 * no call the caller made. */
static void step_begin_fails_on_first_copy(akv_route route, uint32_t len) {
  akv_engine_config ec = akvt_small_config(route, 1);
  akv_engine *e = NULL;
  akv_context *c = NULL;
  static uint16_t rows_mem[64 * 16];
  const void *rows[3] = {rows_mem, rows_mem, rows_mem};
  ec.fault_kind = AKV_OP_COPY;
  ec.fault_fail_nth = 1; /* appends are host copies: the first is the boundary's */
  assert_int_equal(akv_engine_create(&ec, &e), AKV_OK);
  assert_int_equal(akv_context_open(e, NULL, &c), AKV_OK);
  assert_int_equal(akv_context_append(c, len, rows, rows), AKV_OK);
  REFUSED(e, c, akv_step_begin(e, &c, 1), AKV_ERR_BACKEND, "step_begin");
  assert_int_equal(akv_engine_quarantine(e, NULL), AKV_OK);
  assert_int_equal(akv_engine_destroy(e), AKV_OK);
}

static void test_step_begin_transport_failure_names_the_call(void **state) {
  (void)state;
  step_begin_fails_on_first_copy(AKV_ROUTE_ARENA, 40); /* full pages: a page fill */
  step_begin_fails_on_first_copy(AKV_ROUTE_PAGED, 4);  /* no full page: the page map */
}

/* akv_fit refused a config with AKV_ERR_CONFIG and said nothing of why:
 * the reason was computed and dropped, so a caller (the Python package's
 * fit(), a sizing tool) had a bare status where akv_engine_create logs the
 * setting. The reason now goes to config->log_fn, the line create logs;
 * the report stays untouched. */
typedef struct fit_log {
  int lines;
  char last[1024];
} fit_log;

static void fit_log_fn(void *user, akv_log_level level, const char *message) {
  fit_log *l = user;
  if (level != AKV_LOG_ERROR) return;
  l->lines++;
  snprintf(l->last, sizeof l->last, "%s", message);
}

static void test_fit_refusal_logs_its_reason(void **state) {
  (void)state;
  fit_log log_fit = {0}, log_create = {0};
  akv_engine_config cfg = akvt_small_config(AKV_ROUTE_ARENA, 1);
  akv_fit_report rep, untouched;
  cfg.page_tokens = 0;
  cfg.log_fn = fit_log_fn;
  cfg.log_user = &log_fit;
  memset(&rep, 0xAB, sizeof rep);
  memcpy(&untouched, &rep, sizeof rep);
  assert_int_equal(akv_fit(&cfg, &rep), AKV_ERR_CONFIG);
  assert_memory_equal(&rep, &untouched, sizeof rep);
  assert_int_equal(log_fit.lines, 1);
  if (strstr(log_fit.last, "page_tokens") == NULL)
    fail_msg("akv_fit's refusal logged no reason naming page_tokens: \"%s\"", log_fit.last);
  /* The same words as akv_engine_create for the same config. */
  akv_engine *e = NULL;
  cfg.log_user = &log_create;
  assert_int_equal(akv_engine_create(&cfg, &e), AKV_ERR_CONFIG);
  assert_null(e);
  assert_string_equal(log_fit.last, log_create.last);
  /* A config that fits (or does not fit: a verdict, not a refusal) logs
   * nothing at error level. */
  cfg = akvt_small_config(AKV_ROUTE_ARENA, 1);
  cfg.log_fn = fit_log_fn;
  log_fit.lines = 0;
  cfg.log_user = &log_fit;
  assert_int_equal(akv_fit(&cfg, &rep), AKV_OK);
  cfg.max_contexts = 1u << 20;
  assert_int_equal(akv_fit(&cfg, &rep), AKV_OK);
  assert_int_equal(rep.ok, 0);
  assert_int_equal(log_fit.lines, 0);
  /* Without a callback: the status alone, as before. */
  cfg.page_tokens = 0;
  cfg.log_fn = NULL;
  assert_int_equal(akv_fit(&cfg, &rep), AKV_ERR_CONFIG);
}

/* akv_context_read's refusal named all three conditions at once ("layer 0
 * rows [15, 15) outside the 2 layers (this layer holds 12 rows)" for rows
 * past the end of a layer that exists): each now says which one it is. */
static void test_context_read_refusal_says_which(void **state) {
  (void)state;
  akvt_fx f;
  akvt_fx_open(&f, AKV_ROUTE_ARENA, 1, 1, 12);
  uint8_t buf[4096];
  assert_int_equal(akv_context_read(f.c[0], 7, 0, 1, buf, buf), AKV_ERR_INVALID_ARGUMENT);
  assert_non_null(strstr(akv_engine_last_error(f.e), "layer 7 is not one of the 3 dense layers"));
  assert_int_equal(akv_context_read(f.c[0], 0, 11, 4, buf, buf), AKV_ERR_INVALID_ARGUMENT);
  assert_non_null(strstr(akv_engine_last_error(f.e), "rows [11, 15) of layer 0, which holds 12 rows"));
  assert_int_equal(akv_context_read(f.c[0], 0, 0, 1, NULL, buf), AKV_ERR_INVALID_ARGUMENT);
  assert_non_null(strstr(akv_engine_last_error(f.e), "k_out is NULL for 1 rows"));
  assert_int_equal(akv_context_read(f.c[0], 0, 0, 1, buf, buf), AKV_OK);
  assert_int_equal(akv_stream_destroy(f.e, f.s), AKV_OK);
  assert_int_equal(akv_engine_destroy(f.e), AKV_OK);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_quarantined_refusals_name_the_call),
      cmocka_unit_test(test_engine_refusals_name_the_call),
      cmocka_unit_test(test_step_begin_transport_failure_names_the_call),
      cmocka_unit_test(test_fit_refusal_logs_its_reason),
      cmocka_unit_test(test_context_read_refusal_says_which),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
