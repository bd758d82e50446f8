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
  assert_string_equal(akv_version_string(), "0.3.0");
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
 * never aliases the new context (30 opens here, well within the
 * AKV_CONTEXT_HANDLE_REUSE_MIN the header promises; the bound itself is
 * test_closed_handle_reuse_bound_with_others_open and test_handles.c). */
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


static void noop_job(void *arg) { (void)arg; }

/* The hook of the lease tests: enqueues nothing but a host no-op. */
static int noop_hook(void *user, const akv_view *view, akv_stream stream) {
  (void)view;
  return akv_stream_launch_host((akv_engine *)user, stream, noop_job, NULL) == AKV_OK ? 0 : 1;
}

/* One legal layer of the open step on stream s, up to sealed. */
static akv_lease *lease_to_sealed(akv_engine *e, uint32_t layer, akv_stream s) {
  akv_lease *ls = NULL;
  akv_fence attn, tail;
  assert_int_equal(akv_lease_begin(e, layer, &ls), AKV_OK);
  assert_int_equal(akv_lease_attend(ls, s, noop_hook, e, &attn), AKV_OK);
  assert_int_equal(akv_lease_write_back(ls, NULL, 0, &tail), AKV_OK);
  assert_int_equal(akv_lease_seal(ls, tail, attn), AKV_OK);
  return ls;
}

/* Issue item 1: a stream an unretired lease used cannot be destroyed
 * (AKV_ERR_IN_USE, nothing changes); the lease goes on with it, and once the
 * lease retired the stream is destroyed. */
static void test_stream_destroy_refused_while_a_lease_uses_it(void **state) {
  akv_engine *e = host_engine(1, 8);
  akv_context *c = NULL;
  akv_stream s = NULL, other = NULL;
  akv_lease *ls = NULL;
  akv_view view;
  akv_fence attn, tail;
  (void)state;
  assert_int_equal(akv_stream_create(e, &s), AKV_OK);
  assert_int_equal(akv_stream_create(e, &other), AKV_OK);
  assert_int_equal(akv_context_open(e, NULL, &c), AKV_OK);
  assert_int_equal(akv_step_begin(e, &c, 1), AKV_OK);
  assert_int_equal(akv_lease_begin(e, 0, &ls), AKV_OK);
  /* begun, not yet on a stream: any stream may go */
  assert_int_equal(akv_stream_destroy(e, other), AKV_OK);
  assert_int_equal(akv_lease_wait_ready(ls, s, &view), AKV_OK);
  assert_int_equal(akv_stream_destroy(e, s), AKV_ERR_IN_USE);
  assert_int_equal(akv_stream_launch_host(e, s, noop_job, NULL), AKV_OK); /* still live */
  assert_int_equal(akv_lease_mark_consumed(ls, s, &attn), AKV_OK);
  assert_int_equal(akv_stream_destroy(e, s), AKV_ERR_IN_USE);
  assert_int_equal(akv_lease_write_back(ls, NULL, 0, &tail), AKV_OK);
  assert_int_equal(akv_stream_destroy(e, s), AKV_ERR_IN_USE);
  assert_int_equal(akv_lease_seal(ls, tail, attn), AKV_OK);
  assert_int_equal(akv_stream_destroy(e, s), AKV_ERR_IN_USE); /* sealed is not retired */
  assert_int_equal(akv_lease_retire(ls, NULL), AKV_OK);
  assert_int_equal(akv_step_end(e), AKV_OK);
  assert_int_equal(akv_stream_destroy(e, s), AKV_OK);
  /* a destroyed stream is refused by every call that takes one */
  assert_int_equal(akv_stream_destroy(e, s), AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_stream_synchronize(e, s), AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_stream_launch_host(e, s, noop_job, NULL), AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_step_begin(e, &c, 1), AKV_OK);
  assert_int_equal(akv_lease_begin(e, 0, &ls), AKV_OK);
  assert_int_equal(akv_lease_wait_ready(ls, s, &view), AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_lease_attend(ls, s, noop_hook, e, &attn), AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_stream_create(e, &s), AKV_OK);
  assert_int_equal(akv_lease_wait_ready(ls, s, &view), AKV_OK);
  assert_int_equal(akv_lease_mark_consumed(ls, s, &attn), AKV_OK);
  assert_int_equal(akv_lease_write_back(ls, NULL, 0, &tail), AKV_OK);
  assert_int_equal(akv_lease_seal(ls, tail, attn), AKV_OK);
  assert_int_equal(akv_lease_retire(ls, NULL), AKV_OK);
  assert_int_equal(akv_step_end(e), AKV_OK);
  assert_int_equal(akv_stream_destroy(e, s), AKV_OK);
  assert_int_equal(akv_engine_destroy(e), AKV_OK);
}

/* Issue item 3: a destroyed engine's handle, and the handles of its
 * contexts, answer AKV_ERR_BAD_HANDLE (read under ASan: no freed memory is
 * touched), also after later engines were created, for the
 * AKV_ENGINE_HANDLE_REUSE_MIN creates the header promises. */
static void test_destroyed_engine_and_its_contexts_are_bad_handles(void **state) {
  akv_engine *e = host_engine(1, 8), *later[AKV_ENGINE_HANDLE_REUSE_MIN];
  akv_context *open_at_destroy = NULL, *closed = NULL, *c2 = NULL;
  akv_engine_info info;
  uint32_t len = 77;
  char buf[64];
  uint64_t counters[AKV_ADM_RULE_COUNT];
  size_t n = 0;
  akv_stream s = NULL;
  akv_lease *ls = NULL;
  (void)state;
  assert_int_equal(akv_context_open(e, NULL, &closed), AKV_OK);
  assert_int_equal(akv_context_close(closed), AKV_OK);
  assert_int_equal(akv_context_open(e, NULL, &open_at_destroy), AKV_OK);
  assert_int_equal(akv_engine_destroy(e), AKV_OK);
  for (int k = 0; k <= AKV_ENGINE_HANDLE_REUSE_MIN; k++) {
    assert_int_equal(akv_engine_destroy(e), AKV_ERR_BAD_HANDLE);
    assert_int_equal(akv_engine_info_get(e, &info), AKV_ERR_BAD_HANDLE);
    assert_string_equal(akv_engine_last_error(e), "bad engine handle");
    assert_int_equal(akv_engine_quarantine(e, NULL), AKV_ERR_BAD_HANDLE);
    assert_int_equal(akv_context_open(e, NULL, &c2), AKV_ERR_BAD_HANDLE);
    assert_int_equal(akv_step_begin(e, &open_at_destroy, 1), AKV_ERR_BAD_HANDLE);
    assert_int_equal(akv_step_end(e), AKV_ERR_BAD_HANDLE);
    assert_int_equal(akv_lease_begin(e, 0, &ls), AKV_ERR_BAD_HANDLE);
    assert_int_equal(akv_stream_create(e, &s), AKV_ERR_BAD_HANDLE);
    assert_int_equal(akv_stream_synchronize(e, s), AKV_ERR_BAD_HANDLE);
    assert_int_equal(akv_admission_counters(e, counters, AKV_ADM_RULE_COUNT), AKV_ERR_BAD_HANDLE);
    assert_int_equal(akv_admission_log(e, NULL, 0, &n), AKV_ERR_BAD_HANDLE);
    assert_int_equal(akv_admission_explain(e, NULL, buf, sizeof(buf)), AKV_ERR_BAD_HANDLE);
    for (int w = 0; w < 2; w++) {
      akv_context *c = w ? open_at_destroy : closed;
      assert_int_equal(akv_context_length(c, &len), AKV_ERR_BAD_HANDLE);
      assert_int_equal(akv_context_id(c, &len), AKV_ERR_BAD_HANDLE);
      assert_int_equal(akv_context_read(c, 0, 0, 0, NULL, NULL), AKV_ERR_BAD_HANDLE);
      assert_int_equal(akv_context_append(c, 0, NULL, NULL), AKV_ERR_BAD_HANDLE);
      assert_int_equal(akv_context_close(c), AKV_ERR_BAD_HANDLE);
    }
    assert_int_equal(len, 77);
    if (k == AKV_ENGINE_HANDLE_REUSE_MIN) break;
    /* a later engine, with a context: neither may answer for the old ones */
    later[k] = host_engine(1, 8);
    assert_ptr_not_equal(later[k], e);
    assert_int_equal(akv_context_open(later[k], NULL, &c2), AKV_OK);
    if (k % 2 == 1) assert_int_equal(akv_engine_destroy(later[k]), AKV_OK);
  }
  for (int k = 0; k < AKV_ENGINE_HANDLE_REUSE_MIN; k += 2)
    assert_int_equal(akv_engine_destroy(later[k]), AKV_OK);
}

/* Issue item 4: a retired lease handle answers AKV_ERR_BAD_HANDLE, also
 * while the next step's lease of the same layer is live, and never acts on
 * it; the same for a lease released by quarantine and for every lease
 * handle of a destroyed engine. */
static void test_retired_lease_handle_is_dead(void **state) {
  akv_engine *e = host_engine(2, 16);
  akv_context *c = NULL;
  akv_stream s = NULL;
  akv_lease *old0 = NULL, *old1 = NULL, *now0 = NULL, *now1 = NULL;
  akv_view view;
  akv_fence attn, tail;
  akv_receipt r;
  (void)state;
  assert_int_equal(akv_stream_create(e, &s), AKV_OK);
  assert_int_equal(akv_context_open(e, NULL, &c), AKV_OK);
  assert_int_equal(akv_step_begin(e, &c, 1), AKV_OK);
  old0 = lease_to_sealed(e, 0, s);
  old1 = lease_to_sealed(e, 1, s);
  assert_int_equal(akv_lease_retire(old0, NULL), AKV_OK);
  assert_int_equal(akv_lease_retire(old0, &r), AKV_ERR_BAD_HANDLE); /* retired: dead */
  assert_int_equal(akv_lease_retire(old1, NULL), AKV_OK);
  assert_int_equal(akv_step_end(e), AKV_OK);
  /* the next step: layer 0's lease is live and begun */
  assert_int_equal(akv_step_begin(e, &c, 1), AKV_OK);
  assert_int_equal(akv_lease_begin(e, 0, &now0), AKV_OK);
  assert_ptr_not_equal(now0, old0);
  assert_int_equal(akv_lease_wait_ready(old0, s, &view), AKV_ERR_BAD_HANDLE);
  assert_int_equal(akv_lease_attend(old0, s, noop_hook, e, &attn), AKV_ERR_BAD_HANDLE);
  assert_int_equal(akv_lease_attend(now0, s, noop_hook, e, &attn), AKV_OK); /* still begun */
  assert_int_equal(akv_lease_mark_consumed(old0, s, &attn), AKV_ERR_BAD_HANDLE);
  assert_int_equal(akv_lease_write_back(old0, NULL, 0, &tail), AKV_ERR_BAD_HANDLE);
  assert_int_equal(akv_lease_write_back(now0, NULL, 0, &tail), AKV_OK);
  assert_int_equal(akv_lease_seal(old0, tail, attn), AKV_ERR_BAD_HANDLE);
  assert_int_equal(akv_lease_retire(old0, &r), AKV_ERR_BAD_HANDLE);
  assert_int_equal(akv_lease_seal(now0, tail, attn), AKV_OK);
  assert_int_equal(akv_lease_retire(old0, &r), AKV_ERR_BAD_HANDLE); /* not now0's retire */
  assert_int_equal(akv_lease_retire(now0, NULL), AKV_OK);
  assert_int_equal(akv_lease_begin(e, 1, &now1), AKV_OK);
  /* quarantine releases now1: its handle is dead from then on */
  assert_int_equal(akv_engine_quarantine(e, NULL), AKV_OK);
  assert_int_equal(akv_lease_attend(now1, s, noop_hook, e, &attn), AKV_ERR_BAD_HANDLE);
  assert_int_equal(akv_stream_destroy(e, s), AKV_OK);
  assert_int_equal(akv_engine_destroy(e), AKV_OK);
  assert_int_equal(akv_lease_retire(now1, NULL), AKV_ERR_BAD_HANDLE);
  assert_int_equal(akv_lease_seal(old1, tail, attn), AKV_ERR_BAD_HANDLE);
}

/* Issue item 5: a closed context handle stays dead for
 * AKV_CONTEXT_HANDLE_REUSE_MIN later opens, whatever else stays open (here
 * the engine's other three slots stay open throughout). */
static void test_closed_handle_reuse_bound_with_others_open(void **state) {
  akv_engine_config cfg = AKV_ENGINE_CONFIG_INIT;
  akv_engine *e = NULL;
  akv_context *keep[3], *old = NULL, *c = NULL;
  uint32_t len = 5;
  (void)state;
  cfg.backend = AKV_BACKEND_HOST;
  cfg.n_dense_layers = 1;
  cfg.kv_heads = 2;
  cfg.head_dim = 4;
  cfg.max_tokens = 8;
  cfg.page_tokens = 4;
  cfg.max_contexts = 4;
  cfg.host_pool_gib = 1;
  cfg.log_fn = quiet;
  assert_int_equal(akv_engine_create(&cfg, &e), AKV_OK);
  assert_int_equal(akv_context_open(e, NULL, &old), AKV_OK);
  for (int i = 0; i < 3; i++) assert_int_equal(akv_context_open(e, NULL, &keep[i]), AKV_OK);
  assert_int_equal(akv_context_close(old), AKV_OK);
  for (int k = 0; k < AKV_CONTEXT_HANDLE_REUSE_MIN; k++) {
    assert_int_equal(akv_context_open(e, NULL, &c), AKV_OK);
    assert_ptr_not_equal(c, old);
    assert_int_equal(akv_context_length(old, &len), AKV_ERR_BAD_HANDLE);
    assert_int_equal(akv_context_close(c), AKV_OK);
  }
  assert_int_equal(len, 5);
  for (int i = 0; i < 3; i++) assert_int_equal(akv_context_close(keep[i]), AKV_OK);
  assert_int_equal(akv_engine_destroy(e), AKV_OK);
}

/* Runs one whole decode step over `c` alone on the host backend, writing
 * `fill` into every byte of the new K and V rows of each layer. */
static void one_step(akv_engine *e, akv_stream q, akv_context *c, uint32_t layers, uint8_t fill) {
  for (uint32_t l = 0; l < layers; l++) {
    akv_lease *ls = NULL;
    akv_view view;
    akv_fence attn, tail;
    akv_receipt r;
    uint8_t *row;
    assert_int_equal(akv_lease_begin(e, l, &ls), AKV_OK);
    assert_int_equal(akv_lease_wait_ready(ls, q, &view), AKV_OK);
    assert_int_equal(akv_stream_synchronize(e, q), AKV_OK); /* the staged rows are readable */
    row = (uint8_t *)view.base + (uint64_t)view.len[0] * view.row_stride;
    memset(row, fill, view.v_offset);
    memset(row + view.v_offset, fill, view.v_offset);
    assert_int_equal(akv_lease_mark_consumed(ls, q, &attn), AKV_OK);
    assert_int_equal(akv_lease_write_back(ls, NULL, 0, &tail), AKV_OK);
    assert_int_equal(akv_lease_seal(ls, tail, attn), AKV_OK);
    assert_int_equal(akv_lease_retire(ls, &r), AKV_OK);
  }
}

/* akv_context_append_layer: rows go after each layer's own rows, layers in
 * any order; the length is the minimum over the layers; step_begin refuses
 * an uneven context with AKV_ERR_UNEVEN_LAYERS and changes nothing; every
 * refused call appends nothing. */
static void test_append_layer(void **state) {
  enum { L = 3, ROW = 16, MAXT = 8 };
  akv_engine *e = NULL;
  akv_context *c = NULL, *dead = NULL;
  akv_stream q = NULL;
  uint8_t rows[L][MAXT * ROW], vrows[L][MAXT * ROW];
  uint8_t out_k[MAXT * ROW], out_v[MAXT * ROW];
  const void *kp[L], *vp[L];
  uint32_t len = 99;
  (void)state;
  for (int l = 0; l < L; l++) {
    for (int j = 0; j < MAXT * ROW; j++) {
      rows[l][j] = (uint8_t)(l * 50 + j);
      vrows[l][j] = (uint8_t)(l * 50 + j + 7);
    }
    kp[l] = rows[l];
    vp[l] = vrows[l];
  }
  e = host_engine(L, MAXT);
  assert_int_equal(akv_stream_create(e, &q), AKV_OK);
  assert_int_equal(akv_context_open(e, NULL, &c), AKV_OK);

  /* layers out of order and uneven: the length is the minimum */
  assert_int_equal(akv_context_append_layer(c, 2, 2, rows[2], vrows[2]), AKV_OK);
  assert_int_equal(akv_context_length(c, &len), AKV_OK);
  assert_int_equal(len, 0);
  assert_int_equal(akv_context_append_layer(c, 0, 3, rows[0], vrows[0]), AKV_OK);
  assert_int_equal(akv_context_append_layer(c, 1, 1, rows[1], vrows[1]), AKV_OK);
  assert_int_equal(akv_context_length(c, &len), AKV_OK);
  assert_int_equal(len, 1);
  /* a layer's own rows are readable up to what it holds, not beyond */
  assert_int_equal(akv_context_read(c, 0, 0, 3, out_k, out_v), AKV_OK);
  assert_memory_equal(out_k, rows[0], 3 * ROW);
  assert_memory_equal(out_v, vrows[0], 3 * ROW);
  assert_int_equal(akv_context_read(c, 1, 0, 2, out_k, out_v), AKV_ERR_INVALID_ARGUMENT);

  /* an uneven context cannot join a step; nothing changes */
  assert_int_equal(akv_step_begin(e, &c, 1), AKV_ERR_UNEVEN_LAYERS);
  assert_string_not_equal(akv_engine_last_error(e), "");
  assert_int_equal(akv_step_end(e), AKV_ERR_STEP_STATE); /* no step was opened */
  assert_int_equal(akv_context_append_layer(c, 1, 1, rows[1], vrows[1]), AKV_OK); /* not in a step */
  assert_int_equal(akv_context_length(c, &len), AKV_OK);
  assert_int_equal(len, 2);

  /* refusals append nothing on any layer */
  assert_int_equal(akv_context_append_layer(c, L, 1, rows[0], vrows[0]), AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_context_append_layer(c, UINT32_MAX, 1, rows[0], vrows[0]),
                   AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_context_append_layer(c, 1, 1, NULL, vrows[1]), AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_context_append_layer(c, 1, 1, rows[1], NULL), AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_context_append_layer(c, 0, MAXT - 2, rows[0], vrows[0]), AKV_ERR_CAPACITY);
  assert_int_equal(akv_context_append_layer(c, 0, UINT32_MAX, rows[0], vrows[0]), AKV_ERR_CAPACITY);
  /* the all-layer append checks the fullest layer (layer 0, 3 rows) */
  assert_int_equal(akv_context_append(c, MAXT - 2, kp, vp), AKV_ERR_CAPACITY);
  assert_int_equal(akv_context_append_layer(c, 1, 0, NULL, NULL), AKV_OK); /* n == 0: no rows */
  assert_int_equal(akv_context_length(c, &len), AKV_OK);
  assert_int_equal(len, 2);
  assert_int_equal(akv_context_read(c, 0, 0, 3, out_k, out_v), AKV_OK);
  assert_memory_equal(out_k, rows[0], 3 * ROW);
  assert_int_equal(akv_context_read(c, 0, 0, 4, out_k, out_v), AKV_ERR_INVALID_ARGUMENT);

  /* the all-layer append goes after each layer's own rows */
  assert_int_equal(akv_context_append(c, 1, kp, vp), AKV_OK); /* layers hold 4, 3, 3 */
  assert_int_equal(akv_context_length(c, &len), AKV_OK);
  assert_int_equal(len, 3);
  assert_int_equal(akv_context_read(c, 0, 3, 1, out_k, out_v), AKV_OK);
  assert_memory_equal(out_k, rows[0], ROW);
  assert_int_equal(akv_context_read(c, 1, 0, 3, out_k, out_v), AKV_OK);
  assert_memory_equal(out_k, rows[1], ROW);          /* first append_layer */
  assert_memory_equal(out_k + ROW, rows[1], ROW);    /* second append_layer */
  assert_memory_equal(out_k + 2 * ROW, rows[1], ROW); /* the all-layer append */
  assert_int_equal(akv_context_append_layer(c, 1, 1, rows[1] + ROW, vrows[1] + ROW), AKV_OK);
  assert_int_equal(akv_context_append_layer(c, 2, 1, rows[2] + 2 * ROW, vrows[2] + 2 * ROW),
                   AKV_OK);
  assert_int_equal(akv_context_length(c, &len), AKV_OK);
  assert_int_equal(len, 4); /* every layer holds 4 */
  assert_int_equal(akv_context_read(c, 2, 0, 4, out_k, out_v), AKV_OK);
  assert_memory_equal(out_k, rows[2], 2 * ROW);
  assert_memory_equal(out_k + 2 * ROW, rows[2], ROW);
  assert_memory_equal(out_k + 3 * ROW, rows[2] + 2 * ROW, ROW);
  assert_memory_equal(out_v + 3 * ROW, vrows[2] + 2 * ROW, ROW);

  /* even again: the step runs and appends one row on every layer */
  assert_int_equal(akv_step_begin(e, &c, 1), AKV_OK);
  assert_int_equal(akv_context_append_layer(c, 0, 1, rows[0], vrows[0]), AKV_ERR_IN_USE);
  one_step(e, q, c, L, 0xA5);
  assert_int_equal(akv_step_end(e), AKV_OK);
  assert_int_equal(akv_context_length(c, &len), AKV_OK);
  assert_int_equal(len, 5);
  for (uint32_t l = 0; l < L; l++) {
    uint8_t a5[ROW];
    memset(a5, 0xA5, sizeof(a5));
    assert_int_equal(akv_context_read(c, l, 4, 1, out_k, out_v), AKV_OK);
    assert_memory_equal(out_k, a5, ROW);
    assert_memory_equal(out_v, a5, ROW);
  }
  /* after the step, per-layer appends continue from the step's row */
  assert_int_equal(akv_context_append_layer(c, 1, 1, rows[1], vrows[1]), AKV_OK);
  assert_int_equal(akv_context_read(c, 1, 5, 1, out_k, out_v), AKV_OK);
  assert_memory_equal(out_k, rows[1], ROW);
  assert_int_equal(akv_context_length(c, &len), AKV_OK);
  assert_int_equal(len, 5);

  /* a closed handle is refused; a new context on the slot starts even, empty */
  dead = c;
  assert_int_equal(akv_context_close(c), AKV_OK);
  assert_int_equal(akv_context_append_layer(dead, 0, 1, rows[0], vrows[0]), AKV_ERR_BAD_HANDLE);
  assert_int_equal(akv_context_append_layer(NULL, 0, 1, rows[0], vrows[0]), AKV_ERR_BAD_HANDLE);
  assert_int_equal(akv_context_open(e, NULL, &c), AKV_OK);
  assert_int_equal(akv_context_length(c, &len), AKV_OK);
  assert_int_equal(len, 0);
  assert_int_equal(akv_context_read(c, 1, 0, 1, out_k, out_v), AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_context_append(c, 1, kp, vp), AKV_OK);
  assert_int_equal(akv_step_begin(e, &c, 1), AKV_OK); /* even: no leftover per-layer rows */
  one_step(e, q, c, L, 0x11);
  assert_int_equal(akv_step_end(e), AKV_OK);
  assert_int_equal(akv_context_close(c), AKV_OK);
  assert_int_equal(akv_stream_destroy(e, q), AKV_OK);
  assert_int_equal(akv_engine_destroy(e), AKV_OK);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_versions),
      cmocka_unit_test(test_status_strings_distinct),
      cmocka_unit_test(test_config_init),
      cmocka_unit_test(test_null_and_foreign_handles),
      cmocka_unit_test(test_round_trip_host_backend),
      cmocka_unit_test(test_closed_handle_never_aliases),
      cmocka_unit_test(test_stream_destroy_refused_while_a_lease_uses_it),
      cmocka_unit_test(test_destroyed_engine_and_its_contexts_are_bad_handles),
      cmocka_unit_test(test_retired_lease_handle_is_dead),
      cmocka_unit_test(test_closed_handle_reuse_bound_with_others_open),
      cmocka_unit_test(test_append_layer),
      cmocka_unit_test(test_older_context_config_sizes),
      cmocka_unit_test(test_older_engine_config_sizes),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
