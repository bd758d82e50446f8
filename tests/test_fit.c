/*
 * test_fit.c - host-fit arithmetic and config validation (DESIGN §3, src/core/fit.c).
 *
 * Table-driven: every row is one config and the exact report (or status) it
 * must produce, including the floor boundaries where one token more or less
 * per history changes the count, every validation error and the overflows.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "fit.h"

#define GIB ((uint64_t)1 << 30)

static void quiet(void *user, akv_log_level level, const char *message) {
  (void)user;
  (void)level;
  (void)message;
}

/* A config edit: field, value. Rows list the fields they change from the
 * base geometry (Llama-3.1-8B-like: 32 layers, 8 kv heads, head_dim 128,
 * bf16, 32768 tokens, 16-token pages, 64 GiB host, 8 GiB device, 16 contexts). */
typedef enum field {
  F_END = 0,
  F_LAYERS,
  F_HEADS,
  F_DIM,
  F_DTYPE,
  F_TOKENS,
  F_PAGE,
  F_HOST,
  F_DEVICE,
  F_CTX,
  F_MODE,
  F_ROUTE,
  F_BACKEND,
  F_SIZE,
  F_VERSION
} field;

typedef struct edit {
  field f;
  int64_t v;
} edit;

typedef struct row {
  const char *name;
  edit edits[8]; /* terminated by F_END */
  akv_status status;
  /* Expected report (status AKV_OK only). */
  uint32_t ok;
  uint64_t fits;
  uint32_t eff;
  uint32_t needed_gib;
  uint64_t row_bytes;
  uint64_t history_bytes;
  uint64_t page_bytes;
  uint64_t device_pages;
  /* A phrase the `why` text must contain ("" for an empty why). */
  const char *why;
} row;

static akv_engine_config base_config(void) {
  akv_engine_config c = AKV_ENGINE_CONFIG_INIT;
  c.n_dense_layers = 32;
  c.kv_heads = 8;
  c.head_dim = 128;
  c.dtype = AKV_DTYPE_BF16;
  c.max_tokens = 32768;
  c.page_tokens = 16;
  c.host_pool_gib = 64;
  c.device_pool_gib = 8;
  c.max_contexts = 16;
  return c;
}

static void apply(akv_engine_config *c, const edit *e) {
  for (; e->f != F_END; e++) {
    switch (e->f) {
    case F_LAYERS: c->n_dense_layers = (uint32_t)e->v; break;
    case F_HEADS: c->kv_heads = (uint32_t)e->v; break;
    case F_DIM: c->head_dim = (uint32_t)e->v; break;
    case F_DTYPE: c->dtype = (akv_dtype)e->v; break;
    case F_TOKENS: c->max_tokens = (uint32_t)e->v; break;
    case F_PAGE: c->page_tokens = (uint32_t)e->v; break;
    case F_HOST: c->host_pool_gib = (uint32_t)e->v; break;
    case F_DEVICE: c->device_pool_gib = (uint32_t)e->v; break;
    case F_CTX: c->max_contexts = (uint32_t)e->v; break;
    case F_MODE: c->fit_mode = (akv_fit_mode)e->v; break;
    case F_ROUTE: c->route = (akv_route)e->v; break;
    case F_BACKEND: c->backend = (akv_backend_kind)e->v; break;
    case F_SIZE: c->struct_size = (uint32_t)e->v; break;
    case F_VERSION: c->version = (uint32_t)e->v; break;
    case F_END: break;
    }
  }
}

#define MIN_SIZE (offsetof(akv_engine_config, route) + sizeof(akv_route))
/* 128 KiB per token across 32 layers (4096 B per row pair). */
#define TOK (32u * 4096u)

static const row rows[] = {
    /* --- verdicts and floor boundaries ----------------------------------- */
    {"exact: 64 GiB / 4 GiB = 16", {{F_END, 0}}, AKV_OK, 1, 16, 16, 64, 2048, 4 * GIB,
     16 * TOK, 4096, ""},
    {"one token more: 15 fit", {{F_TOKENS, 32769}}, AKV_OK, 0, 15, 15, 65, 2048,
     4 * GIB + TOK, 16 * TOK, 4096, "set host_pool_gib=65 (or more) to keep max_contexts=16"},
    {"one token less: still 16", {{F_TOKENS, 32767}}, AKV_OK, 1, 16, 16, 64, 2048,
     4 * GIB - TOK, 16 * TOK, 4096, ""},
    {"one GiB less: 15 fit", {{F_HOST, 63}}, AKV_OK, 0, 15, 15, 64, 2048, 4 * GIB, 16 * TOK,
     4096, "set max_contexts=15 (or fewer)"},
    /* 1 GiB per history exactly (1 layer x 4 tokens x 256 MiB per row pair):
     * 3 GiB admits 3; one token fewer per history admits 4, one more 2. */
    {"k: 3 GiB / 1 GiB",
     {{F_LAYERS, 1}, {F_HEADS, 1024}, {F_DIM, 65536}, {F_TOKENS, 4}, {F_PAGE, 1}, {F_HOST, 3}},
     AKV_OK, 0, 3, 3, 16, (uint64_t)1 << 27, GIB, GIB / 4, 32,
     "floor(3 GiB / 1 GiB per history) = 3"},
    {"k+1: one token fewer",
     {{F_LAYERS, 1}, {F_HEADS, 1024}, {F_DIM, 65536}, {F_TOKENS, 3}, {F_PAGE, 1}, {F_HOST, 3}},
     AKV_OK, 0, 4, 4, 12, (uint64_t)1 << 27, 3 * GIB / 4, GIB / 4, 32,
     "floor(3 GiB / 768 MiB per history) = 4"},
    {"k-1: one token more",
     {{F_LAYERS, 1}, {F_HEADS, 1024}, {F_DIM, 65536}, {F_TOKENS, 5}, {F_PAGE, 1}, {F_HOST, 3}},
     AKV_OK, 0, 2, 2, 20, (uint64_t)1 << 27, 5 * GIB / 4, GIB / 4, 32,
     "floor(3 GiB / 1.25 GiB per history) = 2"},
    /* 1025 MiB per history prints as 1.001 GiB (rounded, not truncated). */
    {"sizes round to thousandths",
     {{F_LAYERS, 1}, {F_HEADS, 512}, {F_DIM, 512}, {F_TOKENS, 1025}, {F_HOST, 1}, {F_CTX, 1}},
     AKV_OK, 0, 0, 0, 2, 1u << 19, 1025ull << 20, 16ull << 20, 512,
     "floor(1 GiB / 1.001 GiB per history) = 0; set host_pool_gib=2 (or more)"},
    {"f32 doubles the row", {{F_DTYPE, AKV_DTYPE_F32}}, AKV_OK, 0, 8, 8, 128, 4096, 8 * GIB,
     32 * TOK, 2048, "set max_contexts=8 (or fewer)"},
    {"f16 like bf16", {{F_DTYPE, AKV_DTYPE_F16}, {F_CTX, 1}}, AKV_OK, 1, 16, 1, 4, 2048, 4 * GIB,
     16 * TOK, 4096, ""},
    /* FP8: one byte per element halves the row, the history and the page,
     * so twice the contexts fit the same host pool and twice the pages the
     * same device pool. */
    {"fp8 e4m3 halves the row", {{F_DTYPE, AKV_DTYPE_FP8_E4M3}}, AKV_OK, 1, 32, 16, 32, 1024,
     2 * GIB, 8 * TOK, 8192, ""},
    {"fp8 e5m2 like e4m3", {{F_DTYPE, AKV_DTYPE_FP8_E5M2}, {F_CTX, 32}}, AKV_OK, 1, 32, 32, 64,
     1024, 2 * GIB, 8 * TOK, 8192, ""},
    {"no history fits", {{F_HOST, 3}, {F_CTX, 2}}, AKV_OK, 0, 0, 0, 8, 2048, 4 * GIB, 16 * TOK,
     4096, "host_pool_gib=3 holds no history at all; or set max_tokens=12288 (or fewer)"},
    {"shrink mode says what it runs", {{F_HOST, 20}, {F_MODE, AKV_FIT_SHRINK}}, AKV_OK, 0, 5, 5,
     64, 2048, 4 * GIB, 16 * TOK, 4096, "; shrink mode runs 5 contexts"},
    {"device pool 0 is pure staging", {{F_DEVICE, 0}}, AKV_OK, 1, 16, 16, 64, 2048, 4 * GIB,
     16 * TOK, 0, ""},
    {"struct of exactly the fields read", {{F_SIZE, (int64_t)MIN_SIZE}}, AKV_OK, 1, 16, 16, 64,
     2048, 4 * GIB, 16 * TOK, 4096, ""},
    {"page as long as the context", {{F_PAGE, 32768}, {F_DEVICE, 4}}, AKV_OK, 1, 16, 16, 64,
     2048, 4 * GIB, 4 * GIB, 1, ""},
    /* 4 B per row pair, 1-token pages: 15 GiB = 4026531840 pages fits 32 bits. */
    {"device pages just below 2^32",
     {{F_LAYERS, 1}, {F_HEADS, 1}, {F_DIM, 1}, {F_PAGE, 1}, {F_DEVICE, 15}, {F_CTX, 1}}, AKV_OK, 1,
     64 * GIB / (32768 * 4), 1, 1, 2, 32768 * 4, 4, 15 * GIB / 4, ""},
    /* --- validation ------------------------------------------------------- */
    {"struct_size too small", {{F_SIZE, (int64_t)MIN_SIZE - 1}}, AKV_ERR_CONFIG, 0, 0, 0, 0, 0, 0,
     0, 0, "struct_size="},
    {"struct_size 0", {{F_SIZE, 0}}, AKV_ERR_CONFIG, 0, 0, 0, 0, 0, 0, 0, 0,
     "AKV_ENGINE_CONFIG_INIT"},
    {"version", {{F_VERSION, 2}}, AKV_ERR_CONFIG, 0, 0, 0, 0, 0, 0, 0, 0,
     "config version=2 is not between 1 and 1"},
    {"version 0", {{F_VERSION, 0}}, AKV_ERR_CONFIG, 0, 0, 0, 0, 0, 0, 0, 0,
     "config version=0 is not between 1 and 1"},
    {"zero layers", {{F_LAYERS, 0}}, AKV_ERR_CONFIG, 0, 0, 0, 0, 0, 0, 0, 0,
     "n_dense_layers is 0"},
    {"zero kv_heads", {{F_HEADS, 0}}, AKV_ERR_CONFIG, 0, 0, 0, 0, 0, 0, 0, 0, "kv_heads is 0"},
    {"zero head_dim", {{F_DIM, 0}}, AKV_ERR_CONFIG, 0, 0, 0, 0, 0, 0, 0, 0, "head_dim is 0"},
    {"zero max_tokens", {{F_TOKENS, 0}}, AKV_ERR_CONFIG, 0, 0, 0, 0, 0, 0, 0, 0,
     "max_tokens is 0"},
    {"zero page_tokens", {{F_PAGE, 0}}, AKV_ERR_CONFIG, 0, 0, 0, 0, 0, 0, 0, 0,
     "page_tokens is 0"},
    {"zero max_contexts", {{F_CTX, 0}}, AKV_ERR_CONFIG, 0, 0, 0, 0, 0, 0, 0, 0,
     "max_contexts is 0"},
    {"zero host pool", {{F_HOST, 0}}, AKV_ERR_CONFIG, 0, 0, 0, 0, 0, 0, 0, 0,
     "host_pool_gib is 0"},
    {"absurd layers", {{F_LAYERS, 65537}}, AKV_ERR_CONFIG, 0, 0, 0, 0, 0, 0, 0, 0,
     "n_dense_layers=65537 is out of range; at most 65536"},
    {"absurd kv_heads", {{F_HEADS, 65537}}, AKV_ERR_CONFIG, 0, 0, 0, 0, 0, 0, 0, 0,
     "kv_heads=65537 is out of range"},
    {"absurd head_dim", {{F_DIM, 65537}}, AKV_ERR_CONFIG, 0, 0, 0, 0, 0, 0, 0, 0,
     "head_dim=65537 is out of range"},
    {"absurd host pool", {{F_HOST, (1 << 20) + 1}}, AKV_ERR_CONFIG, 0, 0, 0, 0, 0, 0, 0, 0,
     "host_pool_gib=1048577 is out of range"},
    {"absurd device pool", {{F_DEVICE, (1 << 20) + 1}}, AKV_ERR_CONFIG, 0, 0, 0, 0, 0, 0, 0, 0,
     "device_pool_gib=1048577 is out of range"},
    {"absurd max_contexts", {{F_CTX, (1 << 20) + 1}}, AKV_ERR_CONFIG, 0, 0, 0, 0, 0, 0, 0, 0,
     "max_contexts=1048577 is out of range"},
    {"page longer than context", {{F_PAGE, 32769}}, AKV_ERR_CONFIG, 0, 0, 0, 0, 0, 0, 0, 0,
     "page_tokens=32769 exceeds max_tokens=32768"},
    {"unknown dtype", {{F_DTYPE, 5}}, AKV_ERR_CONFIG, 0, 0, 0, 0, 0, 0, 0, 0,
     "dtype=5 is not an akv_dtype"},
    {"negative dtype", {{F_DTYPE, -1}}, AKV_ERR_CONFIG, 0, 0, 0, 0, 0, 0, 0, 0,
     "dtype=-1 is not an akv_dtype"},
    {"unknown fit_mode", {{F_MODE, 2}}, AKV_ERR_CONFIG, 0, 0, 0, 0, 0, 0, 0, 0,
     "fit_mode=2 is not an akv_fit_mode"},
    {"unknown route", {{F_ROUTE, 3}}, AKV_ERR_CONFIG, 0, 0, 0, 0, 0, 0, 0, 0,
     "route=3 is not an akv_route"},
    {"unknown backend", {{F_BACKEND, 3}}, AKV_ERR_CONFIG, 0, 0, 0, 0, 0, 0, 0, 0,
     "backend=3 is not an akv_backend_kind"},
    /* The device pool is checked against the page on the routes that
     * allocate it (arena, paged); the stage route never does, so there the
     * same pools are no error (the report states the division all the same). */
    {"device pool holds no page: arena",
     {{F_LAYERS, 1}, {F_HEADS, 1024}, {F_DIM, 65536}, {F_TOKENS, 16}, {F_PAGE, 8}, {F_DEVICE, 1},
      {F_ROUTE, AKV_ROUTE_ARENA}},
     AKV_ERR_CONFIG, 0, 0, 0, 0, 0, 0, 0, 0, "device_pool_gib=1 holds no page of 2 GiB"},
    {"device pool holds no page: paged",
     {{F_LAYERS, 1}, {F_HEADS, 1024}, {F_DIM, 65536}, {F_TOKENS, 16}, {F_PAGE, 8}, {F_DEVICE, 1},
      {F_ROUTE, AKV_ROUTE_PAGED}},
     AKV_ERR_CONFIG, 0, 0, 0, 0, 0, 0, 0, 0, "device_pool_gib=1 holds no page of 2 GiB"},
    {"device pool holds no page: stage never allocates it",
     {{F_LAYERS, 1}, {F_HEADS, 1024}, {F_DIM, 65536}, {F_TOKENS, 16}, {F_PAGE, 8}, {F_DEVICE, 1},
      {F_ROUTE, AKV_ROUTE_STAGE}},
     AKV_OK, 1, 16, 16, 64, (uint64_t)1 << 27, 4 * GIB, 2 * GIB, 0, ""},
    {"device pages reach 2^32: arena",
     {{F_LAYERS, 1}, {F_HEADS, 1}, {F_DIM, 1}, {F_PAGE, 1}, {F_DEVICE, 16},
      {F_ROUTE, AKV_ROUTE_ARENA}},
     AKV_ERR_CONFIG, 0, 0, 0, 0, 0, 0, 0, 0, "would hold 4294967296 pages"},
    {"device pages reach 2^32: stage never allocates them",
     {{F_LAYERS, 1}, {F_HEADS, 1}, {F_DIM, 1}, {F_PAGE, 1}, {F_DEVICE, 16},
      {F_ROUTE, AKV_ROUTE_STAGE}},
     AKV_OK, 1, 64 * GIB / (32768 * 4), 16, 1, 2, 32768 * 4, 4, (uint64_t)1 << 32, ""},
    /* --- overflow --------------------------------------------------------- */
    /* 65536 layers x 2^32-1 tokens x 2^35 B per row pair: far beyond 2^64. */
    {"history overflows 64 bits",
     {{F_LAYERS, 65536}, {F_HEADS, 65536}, {F_DIM, 65536}, {F_DTYPE, AKV_DTYPE_F32},
      {F_TOKENS, 0xFFFFFFFF}},
     AKV_ERR_CONFIG, 0, 0, 0, 0, 0, 0, 0, 0, "history_bytes = 65536 layers x 4294967295 tokens"},
    /* 2^16 x 2^13 x 2^35 = 2^64: one past the largest uint64. */
    {"history exactly 2^64",
     {{F_LAYERS, 65536}, {F_HEADS, 65536}, {F_DIM, 65536}, {F_DTYPE, AKV_DTYPE_F32},
      {F_TOKENS, 8192}},
     AKV_ERR_CONFIG, 0, 0, 0, 0, 0, 0, 0, 0, "overflows 64 bits"},
    /* 2^16 x 2^12 x 2^35 = 2^63 fits; the needed GiB (2^33 per context) does
     * not fit 32 bits and saturates. */
    {"history 2^63: needed GiB saturates",
     {{F_LAYERS, 65536}, {F_HEADS, 65536}, {F_DIM, 65536}, {F_DTYPE, AKV_DTYPE_F32},
      {F_TOKENS, 4096}, {F_CTX, 1}, {F_DEVICE, 0}},
     AKV_OK, 0, 0, 0, UINT32_MAX, (uint64_t)1 << 34, (uint64_t)1 << 63,
     (uint64_t)16 << 51, 0, "max_contexts=1 would need more than 4294967294 GiB of host pool"},
    /* 2 GiB histories x 1048576 contexts need 2^21 GiB: beyond the accepted pool. */
    {"needed beyond the accepted pool",
     {{F_TOKENS, 16384}, {F_CTX, 1 << 20}}, AKV_OK, 0, 32, 32, 1u << 21, 2048, 2 * GIB,
     16 * TOK, 4096, "would need host_pool_gib=2097152, beyond the 1048576 accepted"},
};

static void test_fit_table(void **state) {
  (void)state;
  for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
    const row *t = &rows[i];
    akv_engine_config c = base_config();
    apply(&c, t->edits);
    akv_fit_report r;
    memset(&r, 0xAB, sizeof r);
    akv_fit_report untouched = r;
    char why[512];
    akv_status st = akv_fit_compute(&c, &r, why, sizeof why);
    print_message("%-36s status %d | %s\n", t->name, (int)st, why);
    assert_int_equal(st, t->status);
    assert_non_null(strstr(why, t->why));
    if (t->why[0] == '\0') assert_string_equal(why, "");
    if (st != AKV_OK) {
      assert_memory_equal(&r, &untouched, sizeof r); /* report untouched on failure */
      assert_int_equal(akv_fit(&c, &r), st);
      continue;
    }
    assert_int_equal(r.ok, t->ok);
    assert_int_equal(r.fits, t->fits);
    assert_int_equal(r.effective_concurrency, t->eff);
    assert_int_equal(r.host_pool_gib_needed, t->needed_gib);
    assert_int_equal(r.row_bytes, t->row_bytes);
    assert_int_equal(r.history_bytes, t->history_bytes);
    assert_int_equal(r.page_bytes, t->page_bytes);
    assert_int_equal(r.device_pages, t->device_pages);
    assert_int_equal(r.host_pool_bytes, (uint64_t)c.host_pool_gib * GIB);
    /* The arithmetic the report states holds. */
    assert_int_equal(r.fits, r.host_pool_bytes / r.history_bytes);
    assert_int_equal(r.ok, r.fits >= c.max_contexts);
    assert_true(strncmp(r.line, "host fit: ", 10) == 0);
    if (r.host_pool_gib_needed != UINT32_MAX) {
      /* needed is the smallest pool that fits max_contexts. */
      assert_true((uint64_t)r.host_pool_gib_needed * GIB / r.history_bytes >= c.max_contexts);
      assert_true((uint64_t)(r.host_pool_gib_needed - 1) * GIB / r.history_bytes <
                  c.max_contexts);
    }
    /* The public entry gives the same report. */
    akv_fit_report p;
    assert_int_equal(akv_fit(&c, &p), AKV_OK);
    assert_memory_equal(&p, &r, sizeof r);
  }
}

static void test_fit_line_exact(void **state) {
  (void)state;
  akv_engine_config c = base_config();
  c.max_tokens = 31744;
  c.max_contexts = 4;
  akv_fit_report r;
  char why[256] = "x";
  assert_int_equal(akv_fit_compute(&c, &r, why, sizeof why), AKV_OK);
  assert_string_equal(r.line,
                      "host fit: effective_concurrency = min(max_contexts=4, floor(64 GiB host "
                      "pool / 3.875 GiB per history)) = min(4, 16) = 4; history = 32 dense "
                      "layers x 31744 tokens x 4096 B per row pair (K+V, 8 kv_heads x 128 "
                      "head_dim x 2 B bf16) = 4160749568 B");
  assert_string_equal(why, "");
  assert_int_equal(r.history_bytes, 4160749568ull);
  assert_int_equal(r.page_bytes, 2097152);
  assert_int_equal(r.device_pages, 4096);
}

static void test_fit_refusal_exact(void **state) {
  (void)state;
  akv_engine_config c = base_config();
  c.max_tokens = 31744;
  c.host_pool_gib = 16;
  c.max_contexts = 8;
  akv_fit_report r;
  char why[512];
  assert_int_equal(akv_fit_compute(&c, &r, why, sizeof why), AKV_OK);
  assert_int_equal(r.ok, 0);
  assert_int_equal(r.effective_concurrency, 4);
  assert_int_equal(r.host_pool_gib_needed, 31);
  assert_string_equal(why, "max_contexts=8 does not fit the host pool: floor(16 GiB / 3.875 GiB "
                           "per history) = 4; set host_pool_gib=31 (or more) to keep "
                           "max_contexts=8; to keep host_pool_gib=16 set max_contexts=4 (or "
                           "fewer), or max_tokens=16384 (or fewer); or set fit_mode=shrink to "
                           "run 4 contexts");
  /* The values it names do fit. */
  akv_engine_config more = c;
  more.host_pool_gib = 31;
  assert_int_equal(akv_fit(&more, &r), AKV_OK);
  assert_int_equal(r.ok, 1);
  more.host_pool_gib = 30;
  assert_int_equal(akv_fit(&more, &r), AKV_OK);
  assert_int_equal(r.ok, 0);
  akv_engine_config fewer = c;
  fewer.max_contexts = 4;
  assert_int_equal(akv_fit(&fewer, &r), AKV_OK);
  assert_int_equal(r.ok, 1);
  akv_engine_config shorter = c;
  shorter.max_tokens = 16384;
  assert_int_equal(akv_fit(&shorter, &r), AKV_OK);
  assert_int_equal(r.ok, 1);
  shorter.max_tokens = 16385;
  assert_int_equal(akv_fit(&shorter, &r), AKV_OK);
  assert_int_equal(r.ok, 0);
}

static void test_fit_arguments(void **state) {
  (void)state;
  akv_engine_config c = base_config();
  akv_fit_report r;
  char why[128];
  assert_int_equal(akv_fit(NULL, &r), AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_fit(&c, NULL), AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_fit_compute(NULL, &r, why, sizeof why), AKV_ERR_INVALID_ARGUMENT);
  assert_string_equal(why, "config is NULL");
  /* why is optional and truncated to its capacity. */
  c.max_contexts = 0;
  assert_int_equal(akv_fit_compute(&c, &r, NULL, 0), AKV_ERR_CONFIG);
  char tiny[8];
  assert_int_equal(akv_fit_compute(&c, &r, tiny, sizeof tiny), AKV_ERR_CONFIG);
  assert_string_equal(tiny, "max_con");
  char none[1] = {'z'};
  assert_int_equal(akv_fit_compute(&c, &r, none, 0), AKV_ERR_CONFIG);
  assert_int_equal(none[0], 'z');
}

/* The logged formula names the one-byte element, so an operator sees why a
 * FP8 history is half the size. */
/* A geometry whose page (1 GiB + 32 KiB: 32769 tokens of a 32 KiB row pair,
 * one layer) does not fit a 1 GiB device pool; the 2 GiB host pool holds one
 * history. The host backend's pools are lazily committed mappings. */
static akv_engine_config one_big_page(akv_route route) {
  akv_engine_config c = AKV_ENGINE_CONFIG_INIT;
  c.backend = AKV_BACKEND_HOST;
  c.n_dense_layers = 1;
  c.kv_heads = 64;
  c.head_dim = 128;
  c.max_tokens = 32769;
  c.page_tokens = 32769;
  c.host_pool_gib = 2;
  c.device_pool_gib = 1;
  c.max_contexts = 1;
  c.route = route;
  c.log_fn = quiet;
  return c;
}

/** akv_fit and akv_engine_create agree: a device pool too small for one
 *  page is refused on the routes that allocate the pool and taken on the
 *  stage route, which never allocates it (akv_fit refused it there too). */
static void test_stage_route_never_checks_the_device_pool(void **state) {
  (void)state;
  for (int route = AKV_ROUTE_STAGE; route <= AKV_ROUTE_PAGED; route++) {
    const akv_engine_config c = one_big_page((akv_route)route);
    const akv_status want = route == AKV_ROUTE_STAGE ? AKV_OK : AKV_ERR_CONFIG;
    akv_fit_report r;
    akv_engine *e = NULL;
    assert_int_equal(akv_fit(&c, &r), want);
    assert_int_equal(akv_engine_create(&c, &e), want);
    if (want != AKV_OK) {
      assert_null(e);
      continue;
    }
    assert_int_equal(r.ok, 1);
    assert_int_equal(r.device_pages, 0);
    akv_engine_info info;
    assert_int_equal(akv_engine_info_get(e, &info), AKV_OK);
    assert_int_equal(info.device_pages, 0);
    assert_int_equal(info.device_bytes_allocated, info.staging_bytes); /* no pool */
    assert_int_equal(akv_engine_destroy(e), AKV_OK);
  }
}

/* Paged route, 1-token pages of one layer's 320 B row pair (1 kv head x
 * head_dim 80, bf16): `gib` GiB of device pool hold gib x 2^30 / 320 pages. */
static akv_engine_config many_pages(akv_route route, uint32_t gib, uint32_t headroom_gib) {
  akv_engine_config c = AKV_ENGINE_CONFIG_INIT;
  c.backend = AKV_BACKEND_HOST;
  c.n_dense_layers = 1;
  c.kv_heads = 1;
  c.head_dim = 80;
  c.max_tokens = 64;
  c.page_tokens = 1;
  c.host_pool_gib = 1;
  c.device_pool_gib = gib;
  c.max_contexts = 4;
  c.route = route;
  c.headroom_gib = headroom_gib;
  c.log_fn = quiet;
  return c;
}

/** A paged route's page map entry is the grid offset (up to 2^30 pages
 *  with headroom) plus a pool page number, in 32 bits with AKV_PAGE_STAGED
 *  reserved: with headroom a pool of more than 2^32 - 1 - 2^30 pages would
 *  give entries that read as staged (exactly 3 x 2^30 pages: the last one)
 *  or wrap (more), and is refused by arithmetic, before any allocation.
 *  Without headroom, or on another route, no offset is added. */
static void test_page_map_entries_fit_32_bits(void **state) {
  (void)state;
  const uint64_t bound = (uint64_t)UINT32_MAX - ((uint64_t)1 << 30);
  akv_fit_report r;
  char why[512];
  /* 960 GiB: 3 x 2^30 pages, one past the bound; 959 GiB: below it. */
  akv_engine_config c = many_pages(AKV_ROUTE_PAGED, 960, 1);
  assert_int_equal(960 * GIB / 320, bound + 1);
  assert_int_equal(akv_fit_compute(&c, &r, why, sizeof why), AKV_ERR_CONFIG);
  assert_non_null(strstr(why, "holds 3221225472 pages"));
  assert_non_null(strstr(why, "at most 3221225471 pages"));
  assert_int_equal(akv_fit(&c, &r), AKV_ERR_CONFIG);
  {
    /* Refused at create before anything is allocated (akv_fit refused it). */
    akv_engine *e = NULL;
    assert_int_equal(akv_engine_create(&c, &e), AKV_ERR_CONFIG);
    assert_null(e);
  }
  c = many_pages(AKV_ROUTE_PAGED, 961, 1); /* entries would wrap */
  assert_int_equal(akv_fit(&c, &r), AKV_ERR_CONFIG);
  c = many_pages(AKV_ROUTE_PAGED, 959, 1);
  assert_int_equal(akv_fit(&c, &r), AKV_OK);
  assert_int_equal(r.device_pages, 959 * GIB / 320);
  assert_true(r.device_pages <= bound);
  /* No offset: without headroom, or on the arena route (no page map). */
  c = many_pages(AKV_ROUTE_PAGED, 960, 0);
  assert_int_equal(akv_fit(&c, &r), AKV_OK);
  assert_int_equal(r.device_pages, bound + 1);
  c = many_pages(AKV_ROUTE_ARENA, 960, 1);
  assert_int_equal(akv_fit(&c, &r), AKV_OK);
}

static void test_fp8_line(void **state) {
  (void)state;
  akv_engine_config c = base_config();
  c.dtype = AKV_DTYPE_FP8_E4M3;
  akv_fit_report r;
  assert_int_equal(akv_fit(&c, &r), AKV_OK);
  assert_non_null(strstr(r.line, "x 1 B fp8-e4m3"));
  c.dtype = AKV_DTYPE_FP8_E5M2;
  assert_int_equal(akv_fit(&c, &r), AKV_OK);
  assert_non_null(strstr(r.line, "x 1 B fp8-e5m2"));
}

static void test_dtype_size(void **state) {
  (void)state;
  assert_int_equal(akv_fit_dtype_size(AKV_DTYPE_BF16), 2);
  assert_int_equal(akv_fit_dtype_size(AKV_DTYPE_F16), 2);
  assert_int_equal(akv_fit_dtype_size(AKV_DTYPE_F32), 4);
  assert_int_equal(akv_fit_dtype_size(AKV_DTYPE_FP8_E4M3), 1);
  assert_int_equal(akv_fit_dtype_size(AKV_DTYPE_FP8_E5M2), 1);
  assert_int_equal(akv_fit_dtype_size((akv_dtype)5), 0);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_fit_table),
      cmocka_unit_test(test_fit_line_exact),
      cmocka_unit_test(test_fit_refusal_exact),
      cmocka_unit_test(test_fit_arguments),
      cmocka_unit_test(test_dtype_size),
      cmocka_unit_test(test_fp8_line),
      cmocka_unit_test(test_stage_route_never_checks_the_device_pool),
      cmocka_unit_test(test_page_map_entries_fit_32_bits),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
