/*
 * test_public_api.c - the public API through libactivekv.so alone (no
 * internal headers): versions, status strings, config initialisers, NULL and
 * foreign handles, and a create/open/append/read/close/destroy round trip on
 * the host backend.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "akv.h"

static void quiet(void *user, akv_log_level level, const char *message) {
  (void)user;
  (void)level;
  (void)message;
}

/* A host-backend engine of `layers` dense layers, rows of 2 KV heads x 4
 * dims, max_tokens rows per context, 2 contexts, pages of 4 tokens. */
static akv_engine *host_engine(uint32_t layers, uint32_t max_tokens) {
  akv_engine_config cfg = AKV_ENGINE_CONFIG_INIT;
  akv_engine *e = NULL;
  cfg.backend = AKV_BACKEND_HOST;
  cfg.n_dense_layers = layers;
  cfg.kv_heads = 2;
  cfg.head_dim = 4;
  cfg.max_tokens = max_tokens;
  cfg.page_tokens = 4;
  cfg.max_contexts = 2;
  cfg.host_pool_gib = 1;
  cfg.log_fn = quiet;
  assert_int_equal(akv_engine_create(&cfg, &e), AKV_OK);
  return e;
}

static void test_versions(void **state) {
  (void)state;
  assert_int_equal(akv_version_number(), AKV_VERSION_NUMBER);
  assert_string_equal(akv_version_string(), "0.2.0");
}

static void test_status_strings_distinct(void **state) {
  (void)state;
  for (int a = 0; a < AKV_STATUS_COUNT_; a++) {
    const char *sa = akv_status_string((akv_status)a);
    assert_non_null(sa);
    assert_string_not_equal(sa, "unknown status");
    for (int b = 0; b < a; b++) assert_string_not_equal(sa, akv_status_string((akv_status)b));
  }
  assert_string_equal(akv_status_string((akv_status)999), "unknown status");
  for (int r = 0; r < AKV_ADM_RULE_COUNT; r++)
    assert_string_not_equal(akv_adm_rule_string((akv_adm_rule)r), "unknown");
}

static void test_config_init(void **state) {
  akv_engine_config a = AKV_ENGINE_CONFIG_INIT, b;
  (void)state;
  memset(&b, 0xab, sizeof(b));
  assert_int_equal(akv_engine_config_init(&b), AKV_OK);
  /* field by field: padding bytes are not part of the value */
  assert_int_equal(a.struct_size, b.struct_size);
  assert_int_equal(a.version, b.version);
  assert_int_equal(a.backend, b.backend);
  assert_int_equal(a.device_ordinal, b.device_ordinal);
  assert_int_equal(a.n_dense_layers, b.n_dense_layers);
  assert_int_equal(a.page_tokens, b.page_tokens);
  assert_int_equal(a.host_pool_gib, b.host_pool_gib);
  assert_int_equal(a.device_pool_gib, b.device_pool_gib);
  assert_int_equal(a.fit_mode, b.fit_mode);
  assert_int_equal(a.route, b.route);
  assert_null(b.log_fn);
  assert_null(b.log_user);
  assert_int_equal(a.log_level, b.log_level);
  assert_int_equal(b.host_delay_seed, 0);
  assert_int_equal(b.fault_fail_nth, 0);
  assert_int_equal(b.fault_kind, -1);
  assert_int_equal(a.struct_size, sizeof(akv_engine_config));
  assert_int_equal(a.version, AKV_CONFIG_VERSION);
  assert_int_equal(a.fault_kind, -1);
  assert_int_equal(akv_engine_config_init(NULL), AKV_ERR_INVALID_ARGUMENT);
}

static void test_null_and_foreign_handles(void **state) {
  akv_engine_info info;
  uint32_t n;
  int not_a_handle[64];
  (void)state;
  memset(not_a_handle, 0, sizeof(not_a_handle));
  assert_int_equal(akv_engine_destroy(NULL), AKV_ERR_BAD_HANDLE);
  assert_int_equal(akv_engine_info_get(NULL, &info), AKV_ERR_BAD_HANDLE);
  assert_int_equal(akv_engine_info_get((akv_engine *)not_a_handle, &info), AKV_ERR_BAD_HANDLE);
  assert_int_equal(akv_context_length(NULL, &n), AKV_ERR_BAD_HANDLE);
  assert_int_equal(akv_context_length((akv_context *)not_a_handle, &n), AKV_ERR_BAD_HANDLE);
  assert_int_equal(akv_lease_retire((akv_lease *)not_a_handle, NULL), AKV_ERR_BAD_HANDLE);
  assert_int_equal(akv_step_end((akv_engine *)not_a_handle), AKV_ERR_BAD_HANDLE);
  assert_string_equal(akv_engine_last_error(NULL), "bad engine handle");
  assert_int_equal(akv_engine_create(NULL, NULL), AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_fit(NULL, NULL), AKV_ERR_INVALID_ARGUMENT);
}

static void test_round_trip_host_backend(void **state) {
  akv_engine *e = NULL;
  akv_context *c = NULL;
  akv_engine_info info;
  uint16_t k[3][5 * 8], v[3][5 * 8], out_k[5 * 8], out_v[5 * 8];
  const void *kp[3] = {k[0], k[1], k[2]}, *vp[3] = {v[0], v[1], v[2]};
  uint32_t len = 0, id = 0;
  (void)state;
  for (int l = 0; l < 3; l++)
    for (int j = 0; j < 5 * 8; j++) {
      k[l][j] = (uint16_t)(l * 1000 + j);
      v[l][j] = (uint16_t)(l * 1000 + j + 500);
    }
  e = host_engine(3, 16);
  assert_int_equal(akv_engine_info_get(e, &info), AKV_OK);
  assert_int_equal(info.backend, AKV_BACKEND_HOST);
  assert_int_equal(info.row_bytes, 16);
  assert_int_equal(info.effective_concurrency, 2);
  assert_int_equal(akv_context_open(e, NULL, &c), AKV_OK);
  assert_int_equal(akv_context_id(c, &id), AKV_OK);
  assert_true(id > 0);
  assert_int_equal(akv_context_append(c, 5, kp, vp), AKV_OK);
  assert_int_equal(akv_context_length(c, &len), AKV_OK);
  assert_int_equal(len, 5);
  for (uint32_t l = 0; l < 3; l++) {
    assert_int_equal(akv_context_read(c, l, 0, 5, out_k, out_v), AKV_OK);
    assert_memory_equal(out_k, k[l], sizeof(out_k));
    assert_memory_equal(out_v, v[l], sizeof(out_v));
  }
  /* a refused append changes nothing */
  assert_int_equal(akv_context_append(c, 12, kp, vp), AKV_ERR_CAPACITY);
  assert_int_equal(akv_context_length(c, &len), AKV_OK);
  assert_int_equal(len, 5);
  assert_string_not_equal(akv_engine_last_error(e), "");
  assert_int_equal(akv_context_close(c), AKV_OK);
  assert_int_equal(akv_engine_destroy(e), AKV_OK);
}

/* A closed handle stays dead after another context takes its host slot: it
 * never aliases the new context, for as many opens as the engine has handle
 * records per slot (16) times its slots, less the slots themselves. */
static void test_closed_handle_never_aliases(void **state) {
  akv_engine *e = NULL;
  akv_context *old = NULL, *c = NULL, *other = NULL;
  uint16_t k[8] = {1, 2, 3, 4, 5, 6, 7, 8}, v[8] = {9, 10, 11, 12, 13, 14, 15, 16};
  const void *kp[1] = {k}, *vp[1] = {v};
  uint32_t len = 99, id_old = 0, id = 0;
  (void)state;
  e = host_engine(1, 8);
  assert_int_equal(akv_context_open(e, NULL, &other), AKV_OK); /* holds slot 0 throughout */
  assert_int_equal(akv_context_open(e, NULL, &old), AKV_OK);
  assert_int_equal(akv_context_id(old, &id_old), AKV_OK);
  assert_int_equal(akv_context_close(old), AKV_OK);
  /* 16 records per slot x 2 slots, one held by `other`: 30 more opens of
   * the free slot keep `old` dead */
  for (int round = 0; round < 30; ++round) {
    assert_int_equal(akv_context_open(e, NULL, &c), AKV_OK); /* the slot `old` had */
    assert_ptr_not_equal(c, old);
    assert_ptr_not_equal(c, other);
    assert_int_equal(akv_context_append(c, 1, kp, vp), AKV_OK);
    /* every call with the closed handle is refused and changes nothing */
    len = 99;
    assert_int_equal(akv_context_length(old, &len), AKV_ERR_BAD_HANDLE);
    assert_int_equal(len, 99);
    assert_int_equal(akv_context_id(old, &id), AKV_ERR_BAD_HANDLE);
    assert_int_equal(akv_context_append(old, 1, kp, vp), AKV_ERR_BAD_HANDLE);
    assert_int_equal(akv_context_close(old), AKV_ERR_BAD_HANDLE);
    assert_int_equal(akv_context_length(c, &len), AKV_OK);
    assert_int_equal(len, 1); /* the refused append on `old` did not land here */
    assert_int_equal(akv_context_id(c, &id), AKV_OK);
    assert_true(id > id_old);
    assert_int_equal(akv_context_close(c), AKV_OK);
    assert_int_equal(akv_context_length(c, &len), AKV_ERR_BAD_HANDLE);
  }
  assert_int_equal(akv_context_close(other), AKV_OK);
  assert_int_equal(akv_engine_destroy(e), AKV_OK);
}

/* An older caller's smaller config struct keeps working (akv.h, ABI): the
 * struct is exactly struct_size bytes (so a read past its end is a heap
 * overflow under ASan) and every field past it takes its _INIT default. */
static void *older_copy(const void *full, size_t size) {
  void *p = malloc(size);
  assert_non_null(p);
  memcpy(p, full, size);
  memcpy(p, &(uint32_t){(uint32_t)size}, sizeof(uint32_t)); /* struct_size */
  return p;
}

#define FIELD_END(type, f) (offsetof(type, f) + sizeof(((type *)0)->f))

static void test_older_context_config_sizes(void **state) {
  akv_engine_config cfg = AKV_ENGINE_CONFIG_INIT;
  akv_engine *e = NULL;
  akv_context *c = NULL;
  char text[1024];
  (void)state;
  cfg.backend = AKV_BACKEND_HOST;
  cfg.n_dense_layers = 2;
  cfg.kv_heads = 2;
  cfg.head_dim = 4;
  cfg.max_tokens = 64;
  cfg.page_tokens = 4;
  cfg.max_contexts = 2;
  cfg.host_pool_gib = 1;
  cfg.device_pool_gib = 1;
  cfg.route = AKV_ROUTE_ARENA;
  cfg.log_fn = quiet;
  assert_int_equal(akv_engine_create(&cfg, &e), AKV_OK);
  {
    /* every size that ends at a field, from the header alone to today's */
    static const size_t sizes[] = {FIELD_END(akv_context_config, version),
                                   FIELD_END(akv_context_config, target_pages),
                                   FIELD_END(akv_context_config, burst_pages),
                                   sizeof(akv_context_config)};
    akv_context_config cc = AKV_CONTEXT_CONFIG_INIT;
    cc.target_pages = 3;
    cc.burst_pages = 5;
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
      void *older = older_copy(&cc, sizes[i]);
      char want[64];
      assert_int_equal(akv_context_open(e, older, &c), AKV_OK);
      free(older);
      assert_int_equal(akv_admission_explain(e, c, text, sizeof text), AKV_OK);
      /* a field the struct does not hold keeps its default: target fair
       * share (pool / 2 contexts), burst 0 */
      if (sizes[i] < FIELD_END(akv_context_config, target_pages))
        assert_null(strstr(text, "target of 3 "));
      else if (sizes[i] < FIELD_END(akv_context_config, burst_pages))
        assert_non_null(strstr(text, "target of 3 (+0 burst)"));
      else
        assert_non_null(strstr(text, "target of 3 (+5 burst)"));
      snprintf(want, sizeof want, "(+%u burst)",
               sizes[i] < FIELD_END(akv_context_config, burst_pages) ? 0u : 5u);
      assert_non_null(strstr(text, want));
      assert_int_equal(akv_context_close(c), AKV_OK);
    }
    /* shorter than its header: refused, nothing opened */
    {
      void *older = older_copy(&cc, sizeof(uint32_t));
      c = NULL;
      assert_int_equal(akv_context_open(e, older, &c), AKV_ERR_CONFIG);
      assert_null(c);
      free(older);
    }
    cc.version = 0;
    assert_int_equal(akv_context_open(e, &cc, &c), AKV_ERR_CONFIG);
    cc.version = AKV_CONFIG_VERSION + 1;
    assert_int_equal(akv_context_open(e, &cc, &c), AKV_ERR_CONFIG);
  }
  assert_int_equal(akv_engine_destroy(e), AKV_OK);
}

static void test_older_engine_config_sizes(void **state) {
  /* every field end from the geometry's (the oldest layout) to today's */
  static const size_t sizes[] = {
      FIELD_END(akv_engine_config, route),           FIELD_END(akv_engine_config, log_fn),
      FIELD_END(akv_engine_config, log_user),        FIELD_END(akv_engine_config, log_level),
      FIELD_END(akv_engine_config, host_delay_seed), FIELD_END(akv_engine_config, host_delay_max_us),
      FIELD_END(akv_engine_config, fault_fail_nth),  FIELD_END(akv_engine_config, fault_kind),
      FIELD_END(akv_engine_config, poison_holes),    sizeof(akv_engine_config)};
  akv_engine_config cfg = AKV_ENGINE_CONFIG_INIT;
  akv_fit_report full_rep, rep;
  (void)state;
  cfg.backend = AKV_BACKEND_HOST;
  cfg.n_dense_layers = 2;
  cfg.kv_heads = 2;
  cfg.head_dim = 4;
  cfg.max_tokens = 64;
  cfg.page_tokens = 4;
  cfg.max_contexts = 2;
  cfg.host_pool_gib = 1;
  cfg.device_pool_gib = 1;
  cfg.route = AKV_ROUTE_PAGED;
  cfg.log_fn = quiet;
  cfg.log_level = AKV_LOG_ERROR;
  cfg.fault_kind = 3;       /* non-defaults, so that a default shows */
  cfg.fault_fail_nth = 0;   /* (a fault would fail create) */
  cfg.poison_holes = 1;
  assert_int_equal(akv_fit(&cfg, &full_rep), AKV_OK);
  for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
    akv_engine_config *older = older_copy(&cfg, sizes[i]);
    akv_engine *e = NULL;
    akv_engine_info info;
    assert_int_equal(akv_fit(older, &rep), AKV_OK);
    assert_memory_equal(&rep, &full_rep, sizeof rep);
    assert_int_equal(akv_engine_create(older, &e), AKV_OK);
    free(older);
    assert_int_equal(akv_engine_info_get(e, &info), AKV_OK);
    assert_int_equal(info.route, AKV_ROUTE_PAGED);
    assert_int_equal(info.history_bytes, full_rep.history_bytes);
    assert_int_equal(akv_engine_destroy(e), AKV_OK);
  }
  {
    akv_engine_config *older = older_copy(&cfg, FIELD_END(akv_engine_config, route) - 1);
    akv_engine *e = NULL;
    assert_int_equal(akv_fit(older, &rep), AKV_ERR_CONFIG);
    free(older);
    cfg.struct_size = (uint32_t)(FIELD_END(akv_engine_config, route) - 1);
    assert_int_equal(akv_engine_create(&cfg, &e), AKV_ERR_CONFIG);
    assert_null(e);
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_versions),
      cmocka_unit_test(test_status_strings_distinct),
      cmocka_unit_test(test_config_init),
      cmocka_unit_test(test_null_and_foreign_handles),
      cmocka_unit_test(test_round_trip_host_backend),
      cmocka_unit_test(test_closed_handle_never_aliases),
      cmocka_unit_test(test_older_context_config_sizes),
      cmocka_unit_test(test_older_engine_config_sizes),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
