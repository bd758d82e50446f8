/*
 * test_sizes.c - sizes and arithmetic: every size the engine forms is 64-bit
 * and checked, every scratch array is sized from its own worst case, and the
 * bookkeeping is bounded by the pools (src/core/budget.h).
 *
 *  - page fills at the largest geometry validation accepts (65536 dense
 *    layers) on the arena and paged routes: the fill copies of one page
 *    outnumber any fixed batch, and the staged rows are checked;
 *  - a property test over random configs with values near every type
 *    limit: akv_fit and akv_engine_create agree, and create fails on
 *    arithmetic only with AKV_ERR_CONFIG naming the setting;
 *  - max_tokens near UINT32_MAX (ceil(max_tokens / page_tokens) must not
 *    wrap);
 *  - bookkeeping that would grow with max_tokens / page_tokens is refused,
 *    naming page_tokens and a value that fits.
 * Host backend throughout; its pools are lazily committed, so large pools
 * cost address space only.
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
#include "akv_attention.h"
#include "testutil.h"

/* ------------------------------------------------------------- log sink */

typedef struct logbuf {
  char last_error[1024]; /* the last ERROR line */
  unsigned errors;
} logbuf;

static void log_into(void *user, akv_log_level level, const char *message) {
  logbuf *b = user;
  if (level == AKV_LOG_ERROR) {
    snprintf(b->last_error, sizeof b->last_error, "%s", message);
    b->errors++;
  }
  akvt_silent_log(NULL, level, message);
}

static akv_engine_config host_config(logbuf *lb) {
  akv_engine_config c = AKV_ENGINE_CONFIG_INIT;
  c.backend = AKV_BACKEND_HOST;
  c.log_fn = log_into;
  c.log_user = lb;
  return c;
}

/* ------------------------------------------- fills at 65536 dense layers */

#define BIG_LAYERS 65536u
#define BIG_HEAD_DIM 2u /* kv_heads 1, bf16: 4-byte K row, 8-byte row pair */
#define BIG_PREFILL 5u  /* page_tokens 2: two full pages, both filled at the boundary */

static uint16_t big_elem(uint32_t layer, uint32_t token, int kv, uint32_t j) {
  return akvt_elem(7, layer, token, kv, j);
}

static void big_decode(akv_route route) {
  logbuf lb;
  akv_engine_config ec = host_config(&lb);
  akv_engine *e = NULL;
  akv_context *ctx = NULL;
  akv_stream s = NULL;
  uint64_t bad = 0;
  memset(&lb, 0, sizeof lb);
  ec.n_dense_layers = BIG_LAYERS;
  ec.kv_heads = 1;
  ec.head_dim = BIG_HEAD_DIM;
  ec.max_tokens = 8;
  ec.page_tokens = 2;
  ec.max_contexts = 1;
  ec.host_pool_gib = 4; /* 1/64 of it holds 65536 lease records */
  ec.device_pool_gib = 1;
  ec.route = route;
  assert_int_equal(akv_engine_create(&ec, &e), AKV_OK);
  assert_int_equal(akv_stream_create(e, &s), AKV_OK);
  assert_int_equal(akv_context_open(e, NULL, &ctx), AKV_OK);
  {
    const uint32_t row_elems = BIG_HEAD_DIM;
    uint16_t *rows = malloc((size_t)BIG_LAYERS * 2 * BIG_PREFILL * row_elems * sizeof(uint16_t));
    const void **kp = malloc(BIG_LAYERS * sizeof(void *)), **vp = malloc(BIG_LAYERS * sizeof(void *));
    assert_non_null(rows);
    assert_non_null(kp);
    assert_non_null(vp);
    for (uint32_t l = 0; l < BIG_LAYERS; l++) {
      uint16_t *k = rows + (size_t)l * 2 * BIG_PREFILL * row_elems, *v = k + BIG_PREFILL * row_elems;
      for (uint32_t t = 0; t < BIG_PREFILL; t++)
        for (uint32_t j = 0; j < row_elems; j++) {
          k[t * row_elems + j] = big_elem(l, t, 0, j);
          v[t * row_elems + j] = big_elem(l, t, 1, j);
        }
      kp[l] = k;
      vp[l] = v;
    }
    assert_int_equal(akv_context_append(ctx, BIG_PREFILL, kp, vp), AKV_OK);
    free(rows);
    free(kp);
    free(vp);
  }
  /* The boundary fills both full pages for every layer: 2 x 65536 copies. */
  assert_int_equal(akv_step_begin(e, &ctx, 1), AKV_OK);
  for (uint32_t l = 0; l < BIG_LAYERS; l++) {
    akv_lease *ls = NULL;
    akv_view v;
    akv_fence attn, tail;
    assert_int_equal(akv_lease_begin(e, l, &ls), AKV_OK);
    assert_int_equal(akv_lease_wait_ready(ls, s, &v), AKV_OK);
    assert_int_equal(akv_stream_synchronize(e, s), AKV_OK);
    if (route == AKV_ROUTE_PAGED && l == 0) {
      assert_non_null(v.page_map_host);
      assert_true(v.page_map_host[0] != AKV_PAGE_STAGED); /* read in place */
    }
    /* every history row, staged or read in place, and the new row */
    for (uint32_t t = 0; t <= BIG_PREFILL; t++) {
      uint16_t *k = (uint16_t *)akvt_view_row(&v, 0, t), *vv = (uint16_t *)((uint8_t *)k + v.v_offset);
      for (uint32_t j = 0; j < BIG_HEAD_DIM; j++) {
        if (t == BIG_PREFILL) {
          k[j] = big_elem(l, t, 0, j);
          vv[j] = big_elem(l, t, 1, j);
        } else if (k[j] != big_elem(l, t, 0, j) || vv[j] != big_elem(l, t, 1, j)) {
          bad++;
        }
      }
    }
    assert_int_equal(akv_lease_mark_consumed(ls, s, &attn), AKV_OK);
    assert_int_equal(akv_lease_write_back(ls, NULL, 0, &tail), AKV_OK);
    assert_int_equal(akv_lease_seal(ls, tail, attn), AKV_OK);
    assert_int_equal(akv_lease_retire(ls, NULL), AKV_OK);
  }
  assert_int_equal(akv_step_end(e), AKV_OK);
  assert_int_equal(bad, 0);
  {
    akv_engine_info info;
    uint64_t counters[AKV_ADM_RULE_COUNT];
    assert_int_equal(akv_engine_info_get(e, &info), AKV_OK);
    assert_int_equal(akv_admission_counters(e, counters, AKV_ADM_RULE_COUNT), AKV_OK);
    assert_int_equal(counters[AKV_ADM_FREE], 2); /* the two full pages */
    if (route == AKV_ROUTE_ARENA) assert_true(info.bytes_d2d > 0);
    else assert_true(info.bytes_in_place > 0);
  }
  /* the written-back row of the last and the first layer */
  {
    uint16_t k[BIG_HEAD_DIM], v[BIG_HEAD_DIM];
    uint32_t layers[2] = {0, BIG_LAYERS - 1};
    for (int i = 0; i < 2; i++) {
      assert_int_equal(akv_context_read(ctx, layers[i], BIG_PREFILL, 1, k, v), AKV_OK);
      for (uint32_t j = 0; j < BIG_HEAD_DIM; j++) {
        assert_int_equal(k[j], big_elem(layers[i], BIG_PREFILL, 0, j));
        assert_int_equal(v[j], big_elem(layers[i], BIG_PREFILL, 1, j));
      }
    }
  }
  assert_int_equal(akv_context_close(ctx), AKV_OK);
  assert_int_equal(akv_stream_destroy(e, s), AKV_OK);
  assert_int_equal(akv_engine_destroy(e), AKV_OK);
  assert_int_equal(lb.errors, 0);
}

static void test_page_fills_at_the_largest_layer_count_arena(void **state) {
  (void)state;
  big_decode(AKV_ROUTE_ARENA);
}

static void test_page_fills_at_the_largest_layer_count_paged(void **state) {
  (void)state;
  big_decode(AKV_ROUTE_PAGED);
}

/* --------------------------------------- max_tokens near UINT32_MAX */

/* ceil(max_tokens / page_tokens) formed as (max_tokens + page_tokens - 1) /
 * page_tokens wraps in 32 bits: with page_tokens = max_tokens = 2^32 - 1 it
 * gave 0 logical pages and create failed with AKV_ERR_INVALID_ARGUMENT,
 * although akv_fit accepted the geometry. A page is an attention chunk, at
 * most AKV_ATTENTION_MAX_CHUNK_TOKENS rows (akv.h, page_tokens): 2^32 - 1
 * is now a config error, and the largest page taken, 255 * 2^24 rows under
 * max_tokens 2^32 - 1, still wraps the 32-bit sum (2 logical pages). */
static void test_max_tokens_near_uint32_max(void **state) {
  logbuf lb;
  akv_engine_config ec = host_config(&lb);
  akv_fit_report rep;
  akv_engine *e = NULL;
  (void)state;
  memset(&lb, 0, sizeof lb);
  ec.n_dense_layers = 1;
  ec.kv_heads = 1;
  ec.head_dim = 1; /* 4-byte row pair: a history of 16 GiB - 4 B */
  ec.max_tokens = UINT32_MAX;
  ec.page_tokens = UINT32_MAX;
  ec.max_contexts = 1;
  ec.host_pool_gib = 16;
  ec.route = AKV_ROUTE_STAGE;
  assert_int_equal(akv_fit(&ec, &rep), AKV_ERR_CONFIG);
  assert_int_equal(akv_engine_create(&ec, &e), AKV_ERR_CONFIG);
  assert_null(e);
  lb.errors = 0; /* the refusal's line */
  ec.page_tokens = AKV_ATTENTION_MAX_CHUNK_TOKENS;
  assert_int_equal(akv_fit(&ec, &rep), AKV_OK);
  assert_int_equal(rep.ok, 1);
  assert_int_equal(akv_engine_create(&ec, &e), AKV_OK);
  assert_int_equal(akv_engine_destroy(e), AKV_OK);

  /* the same near the limit with a page of 2^31 tokens: 2 logical pages */
  ec.page_tokens = 1u << 31;
  assert_int_equal(akv_fit(&ec, &rep), AKV_OK);
  assert_int_equal(akv_engine_create(&ec, &e), AKV_OK);
  assert_int_equal(akv_engine_destroy(e), AKV_OK);
  assert_int_equal(lb.errors, 0);
}

/* ------------------------------------------- bookkeeping is bounded */

/* page_tokens 1 and max_tokens 2^28 on a 1 GiB host pool: a page map of 2^28
 * entries per context would cost 1 GiB of host memory and seconds at create.
 * Refused (by akv_fit and by create alike) with AKV_ERR_CONFIG, naming
 * page_tokens and the smallest value that fits; that value is accepted. On
 * the stage route nothing is resident, nothing is tracked per logical page,
 * and the same geometry is accepted. */
static void test_bookkeeping_bounded_by_the_pools(void **state) {
  logbuf lb;
  akv_engine_config ec = host_config(&lb);
  akv_fit_report rep;
  akv_engine *e = NULL;
  unsigned fit_pt = 0;
  const char *at;
  (void)state;
  memset(&lb, 0, sizeof lb);
  ec.n_dense_layers = 1;
  ec.kv_heads = 1;
  ec.head_dim = 1;
  ec.max_tokens = 1u << 28; /* a history of exactly 1 GiB */
  ec.page_tokens = 1;
  ec.max_contexts = 1;
  ec.host_pool_gib = 1;
  ec.device_pool_gib = 1;
  ec.route = AKV_ROUTE_ARENA;
  assert_int_equal(akv_fit(&ec, &rep), AKV_ERR_CONFIG);
  assert_int_equal(akv_engine_create(&ec, &e), AKV_ERR_CONFIG);
  assert_null(e);
  assert_non_null(strstr(lb.last_error, "bookkeeping"));
  at = strstr(lb.last_error, "raise page_tokens to ");
  assert_non_null(at);
  assert_int_equal(sscanf(at, "raise page_tokens to %u", &fit_pt), 1);
  assert_true(fit_pt > 1);

  ec.page_tokens = fit_pt;
  assert_int_equal(akv_fit(&ec, &rep), AKV_OK);
  assert_int_equal(akv_engine_create(&ec, &e), AKV_OK);
  assert_int_equal(akv_engine_destroy(e), AKV_OK);
  ec.page_tokens = fit_pt - 1; /* the smallest that fits */
  assert_int_equal(akv_fit(&ec, &rep), AKV_ERR_CONFIG);

  ec.page_tokens = 1;
  ec.route = AKV_ROUTE_PAGED;
  assert_int_equal(akv_fit(&ec, &rep), AKV_ERR_CONFIG);
  ec.route = AKV_ROUTE_STAGE;
  assert_int_equal(akv_fit(&ec, &rep), AKV_OK);
  assert_int_equal(akv_engine_create(&ec, &e), AKV_OK);
  assert_int_equal(akv_engine_destroy(e), AKV_OK);
}

/* ------------------------------------------------------ property test */

typedef struct rng {
  uint64_t s;
} rng;

static uint64_t next(rng *r) {
  uint64_t z = (r->s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

/* A value near a limit of the field: 0, 1, 2, small, around the accepted
 * maximum, or around the top of uint32_t. */
static uint32_t near(rng *r, uint32_t accepted_max, uint32_t typical) {
  if (next(r) % 3 != 0) return 1 + (uint32_t)(next(r) % typical); /* an ordinary value */
  switch (next(r) % 12) {
    case 0: return 0;
    case 1: return 1;
    case 2: return 2;
    case 3: return accepted_max - 1;
    case 4: return accepted_max;
    case 5: return accepted_max + 1; /* wraps to 0 for UINT32_MAX */
    case 6: return UINT32_MAX;
    case 7: return UINT32_MAX - 1;
    case 8: return 1u << 31;
    case 9: return (uint32_t)(next(r) % ((uint64_t)typical * 4 + 1));
    default: return 1 + (uint32_t)(next(r) % typical);
  }
}

/* Setting names that a refusal may name. */
static int names_a_setting(const char *msg) {
  static const char *const names[] = {"struct_size",  "version",        "backend",
                                      "n_dense_layers", "kv_heads",     "head_dim",
                                      "dtype",        "max_tokens",     "page_tokens",
                                      "host_pool_gib", "device_pool_gib", "max_contexts",
                                      "fit_mode",     "route"};
  for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
    if (strstr(msg, names[i]) != NULL) return 1;
  return 0;
}

static void test_property_fit_and_create_agree(void **state) {
  const char *env = getenv("AKVT_SIZE_CONFIGS");
  uint32_t n_configs = env != NULL ? (uint32_t)atoi(env) : 1000;
  rng r = {0x5eed};
  uint32_t created = 0, refused_config = 0, no_fit = 0, oom = 0;
  (void)state;
  for (uint32_t i = 0; i < n_configs; i++) {
    logbuf lb;
    akv_engine_config ec = host_config(&lb);
    akv_fit_report rep;
    akv_engine *e = NULL;
    akv_status fst, cst;
    memset(&lb, 0, sizeof lb);
    ec.n_dense_layers = near(&r, 65536, 8);
    ec.kv_heads = near(&r, 65536, 4);
    ec.head_dim = near(&r, 65536, 16);
    ec.max_tokens = near(&r, UINT32_MAX, 256);
    ec.page_tokens = next(&r) % 3 == 0 ? ec.max_tokens : near(&r, UINT32_MAX, 16);
    ec.max_contexts = near(&r, 1u << 20, 4);
    /* small pools (lazily committed on the host backend) */
    ec.host_pool_gib = next(&r) % 8 == 0 ? near(&r, 1u << 20, 2) : (uint32_t)(next(&r) % 18);
    ec.device_pool_gib = next(&r) % 8 == 0 ? near(&r, 1u << 20, 2) : (uint32_t)(next(&r) % 3);
    ec.route = (akv_route)(next(&r) % 3);
    ec.fit_mode = (akv_fit_mode)(next(&r) % 2);
    ec.dtype = (akv_dtype)(next(&r) % 3);
    if (next(&r) % 32 == 0) ec.dtype = (akv_dtype)near(&r, 2, 2);
    if (next(&r) % 32 == 0) ec.route = (akv_route)near(&r, 2, 2);
    if (next(&r) % 32 == 0) ec.version = near(&r, 1, 1);
    if (next(&r) % 32 == 0) ec.struct_size = near(&r, sizeof(akv_engine_config), 64);
    if (next(&r) % 4 == 0) {
      /* the smallest rows: a history of nearly 2^32 tokens fits 16 GiB */
      ec.n_dense_layers = 1 + (uint32_t)(next(&r) % 2);
      ec.kv_heads = 1;
      ec.head_dim = 1;
      ec.dtype = AKV_DTYPE_BF16;
      ec.max_contexts = 1 + (uint32_t)(next(&r) % 2);
      ec.host_pool_gib = next(&r) % 2 ? 17 : 64;
    }
    /* an accepted host pool holds at most 64 GiB (address space only) */
    if (ec.host_pool_gib > 64 && ec.host_pool_gib <= (1u << 20)) ec.host_pool_gib = 64;
    if (ec.device_pool_gib > 64 && ec.device_pool_gib <= (1u << 20)) ec.device_pool_gib = 64;

    fst = akv_fit(&ec, &rep);
    cst = akv_engine_create(&ec, &e);
    /* never a wrapped size passed on as a bad argument */
    assert_int_not_equal(cst, AKV_ERR_INVALID_ARGUMENT);
    if (fst == AKV_ERR_CONFIG) {
      if (cst != AKV_ERR_CONFIG)
        fail_msg("config %u: akv_fit says AKV_ERR_CONFIG, create says %s", i,
                 akv_status_string(cst));
      /* (a struct too short to hold log_fn logs to stderr: nothing to see here) */
      if (ec.struct_size >= offsetof(akv_engine_config, log_user) + sizeof(void *) &&
          !names_a_setting(lb.last_error))
        fail_msg("config %u: create refused without naming a setting: %s", i, lb.last_error);
      refused_config++;
      continue;
    }
    assert_int_equal(fst, AKV_OK);
    if (!rep.ok && (ec.fit_mode == AKV_FIT_REFUSE || rep.effective_concurrency == 0)) {
      if (cst != AKV_ERR_NO_FIT)
        fail_msg("config %u: the host fit fails (ok 0), create says %s", i, akv_status_string(cst));
      no_fit++;
      continue;
    }
    /* akv_fit accepts: create succeeds, or fails cleanly for lack of memory */
    if (cst == AKV_ERR_OUT_OF_MEMORY) {
      assert_null(e);
      oom++;
      continue;
    }
    if (cst != AKV_OK)
      fail_msg("config %u: akv_fit accepts, create says %s: %s (layers %u, heads %u, dim %u, "
               "max_tokens %u, page_tokens %u, contexts %u, host %u GiB, device %u GiB, route %d)",
               i, akv_status_string(cst), lb.last_error, ec.n_dense_layers, ec.kv_heads,
               ec.head_dim, ec.max_tokens, ec.page_tokens, ec.max_contexts, ec.host_pool_gib,
               ec.device_pool_gib, (int)ec.route);
    {
      akv_engine_info info;
      assert_int_equal(akv_engine_info_get(e, &info), AKV_OK);
      assert_int_equal(info.effective_concurrency, rep.effective_concurrency);
      assert_int_equal(info.history_bytes, rep.history_bytes);
      assert_int_equal(info.page_bytes, rep.page_bytes);
    }
    assert_int_equal(akv_engine_destroy(e), AKV_OK);
    created++;
  }
  printf("sizes: %u configs: %u created, %u refused as AKV_ERR_CONFIG, %u AKV_ERR_NO_FIT, %u out "
         "of memory\n",
         n_configs, created, refused_config, no_fit, oom);
  assert_true(created > 0);
  assert_true(refused_config > 0);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_max_tokens_near_uint32_max),
      cmocka_unit_test(test_bookkeeping_bounded_by_the_pools),
      cmocka_unit_test(test_property_fit_and_create_agree),
      cmocka_unit_test(test_page_fills_at_the_largest_layer_count_arena),
      cmocka_unit_test(test_page_fills_at_the_largest_layer_count_paged),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
