/*
 * test_audit_attn_cfg.c - a hostile caller's audit of the reference
 * attention (akv_attention.h), the CUDA launchers' host-side refusals
 * (akv_cuda.h, where built) and the configuration surface of akv.h
 * (akv_engine_config_init, akv_fit, akv_engine_create, akv_context_open).
 *
 * Every refused call must return the documented status and leave its
 * outputs byte for byte as they were (each is filled with a pattern first);
 * every accepted call must stay inside the buffers it was given: rows,
 * workspaces and outputs are allocated at exactly the size the contract
 * names (the sanitizer build catches one byte past them) and carry a guard
 * pattern behind them that is checked in every build.
 */
#include <float.h>
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
#ifdef AKV_WITH_CUDA
#include "akv_cuda.h"
#endif

#define GUARD 64u
#define PAT 0xA5u

static void silent_log(void *user, akv_log_level level, const char *message) {
  (void)user, (void)level, (void)message;
}

/* A buffer of exactly n bytes (plus GUARD pattern bytes behind it, checked
 * by guard_ok); n may be 0. */
static unsigned char *xbuf(size_t n) {
  unsigned char *p = (unsigned char *)malloc(n + GUARD);
  assert_non_null(p);
  memset(p, PAT, n + GUARD);
  return p;
}

static int guard_ok(const unsigned char *p, size_t n) {
  for (size_t i = 0; i < GUARD; ++i)
    if (p[n + i] != PAT) return 0;
  return 1;
}

static int all_pat(const unsigned char *p, size_t n) {
  for (size_t i = 0; i < n; ++i)
    if (p[i] != PAT) return 0;
  return 1;
}

static uint32_t rng_next(uint32_t *s) {
  *s = *s * 1664525u + 1013904223u;
  return *s >> 8;
}

/* bf16 of a small value in [-1, 1) (exact). */
static uint16_t rnd_bf16(uint32_t *s) {
  const float f = (float)((int)(rng_next(s) % 64u) - 32) / 32.0f;
  uint32_t b;
  memcpy(&b, &f, sizeof b);
  return (uint16_t)(b >> 16);
}

/* A finite, small FP8 code of either kind (exponent field kept low). */
static uint8_t rnd_fp8(uint32_t *s) { return (uint8_t)(rng_next(s) & 0xB7u); }

/* ------------------------------------------------------------------------ */
/* Reference attention: exact workspace, exact rows, paged parity            */
/* ------------------------------------------------------------------------ */

typedef struct geo {
  akv_dtype dtype;
  uint32_t n_ctx, n_heads, kv_heads, head_dim, chunk;
  uint32_t len[4];
} geo;

static uint32_t esize_of(akv_dtype d) { return d == AKV_DTYPE_BF16 ? 2u : 1u; }

/*
 * Runs g contiguously with a workspace of exactly the reported bytes, rows
 * allocated to exactly the last row read, then as a page table with
 * page_tokens == chunk over the same rows: same bits. A workspace one byte
 * short is refused with nothing written.
 */
static void run_geo(const geo *g, uint32_t seed) {
  const uint32_t es = esize_of(g->dtype);
  const uint64_t row = (uint64_t)g->kv_heads * g->head_dim * es;
  uint32_t max_len = 0;
  for (uint32_t i = 0; i < g->n_ctx; ++i)
    if (g->len[i] > max_len) max_len = g->len[i];
  const uint32_t pages_per_ctx = (max_len + g->chunk - 1) / g->chunk;
  const uint64_t stride = (uint64_t)pages_per_ctx * g->chunk * row;
  /* Rows: every context at i * stride; the allocation ends at the last row
   * of the last context (its len >= 1 in every geometry below). */
  const size_t kv_bytes = (size_t)((g->n_ctx - 1) * stride + g->len[g->n_ctx - 1] * row);
  unsigned char *k = xbuf(kv_bytes), *v = xbuf(kv_bytes);
  const size_t q_elems = (size_t)g->n_ctx * g->n_heads * g->head_dim;
  uint16_t *q = (uint16_t *)xbuf(q_elems * 2);
  uint32_t s = seed;
  for (size_t i = 0; i < q_elems; ++i) q[i] = rnd_bf16(&s);
  for (size_t i = 0; i < kv_bytes; i += es) {
    if (es == 2) {
      const uint16_t a = rnd_bf16(&s), b = rnd_bf16(&s);
      memcpy(k + i, &a, 2);
      memcpy(v + i, &b, 2);
    } else {
      k[i] = rnd_fp8(&s);
      v[i] = rnd_fp8(&s);
    }
  }
  float ks[4] = {0.5f, 2.0f, 1.0f, 0.25f}, vs[4] = {1.5f, 0.75f, 1.0f, 3.0f};
  size_t ws_bytes = 0;
  assert_int_equal(akv_attention_workspace_bytes(g->n_ctx, g->n_heads, g->head_dim, max_len,
                                                 g->chunk, &ws_bytes),
                   AKV_OK);
  unsigned char *ws = xbuf(ws_bytes);
  const size_t out_bytes = q_elems * sizeof(float);
  float *out = (float *)xbuf(out_bytes), *out2 = (float *)xbuf(out_bytes);

  akv_attention_args a;
  memset(&a, 0, sizeof a);
  a.dtype = g->dtype;
  a.n_contexts = g->n_ctx;
  a.n_heads = g->n_heads;
  a.kv_heads = g->kv_heads;
  a.head_dim = g->head_dim;
  a.chunk_tokens = g->chunk;
  a.scale = 0.3f;
  a.q = q;
  a.k_base = k;
  a.v_base = v;
  a.context_stride = stride;
  a.row_bytes = row;
  a.len = g->len;
  a.out = out;
  a.workspace = ws;
  a.workspace_bytes = ws_bytes;
  if (es == 1 || (seed & 1u)) {
    assert_true(g->kv_heads <= 4);
    a.k_scale = ks;
    a.v_scale = vs;
  }
  /* One byte short: refused, nothing written anywhere. */
  if (ws_bytes > 0) {
    a.workspace_bytes = ws_bytes - 1;
    assert_int_equal(akv_attention_ref_bf16(&a), AKV_ERR_INVALID_ARGUMENT);
    assert_true(all_pat((const unsigned char *)out, out_bytes + GUARD));
    assert_true(all_pat(ws, ws_bytes + GUARD));
    a.workspace_bytes = ws_bytes;
  }
  assert_int_equal(akv_attention_ref_bf16(&a), AKV_OK);
  assert_true(guard_ok((const unsigned char *)out, out_bytes));
  assert_true(guard_ok(ws, ws_bytes));
  for (uint32_t i = 0; i < g->n_ctx; ++i)
    for (size_t j = 0; j < (size_t)g->n_heads * g->head_dim; ++j) {
      const float o = out[(size_t)i * g->n_heads * g->head_dim + j];
      if (g->len[i] == 0) assert_true(o == 0.0f);
      else assert_true(isfinite(o));
    }

  /* The same rows as a page table (page_tokens == chunk): same bits. */
  uint32_t indptr[5] = {0}, last[4] = {0};
  uint32_t *indices = (uint32_t *)xbuf((size_t)g->n_ctx * pages_per_ctx * 4u + 4u);
  for (uint32_t i = 0; i < g->n_ctx; ++i) {
    const uint32_t np = (g->len[i] + g->chunk - 1) / g->chunk;
    for (uint32_t p = 0; p < np; ++p) indices[indptr[i] + p] = i * pages_per_ctx + p;
    indptr[i + 1] = indptr[i] + np;
    last[i] = np ? g->len[i] - (np - 1) * g->chunk : 0;
  }
  akv_page_table t;
  memset(&t, 0, sizeof t);
  t.batch = g->n_ctx;
  t.page_tokens = g->chunk;
  t.max_pages = pages_per_ctx;
  t.indptr = indptr;
  t.indices = indices;
  t.last_page_len = last;
  t.k_pages = k;
  t.v_pages = v;
  t.page_stride = (uint64_t)g->chunk * row;
  t.row_bytes = row;
  akv_attention_paged_args pa;
  memset(&pa, 0, sizeof pa);
  pa.dtype = g->dtype;
  pa.n_heads = g->n_heads;
  pa.kv_heads = g->kv_heads;
  pa.head_dim = g->head_dim;
  pa.scale = a.scale;
  pa.q = q;
  pa.out = out2;
  pa.workspace = ws;
  pa.workspace_bytes = ws_bytes;
  pa.k_scale = a.k_scale;
  pa.v_scale = a.v_scale;
  size_t ws_paged = 0;
  assert_int_equal(akv_attention_workspace_bytes(g->n_ctx, g->n_heads, g->head_dim,
                                                 pages_per_ctx * g->chunk, g->chunk, &ws_paged),
                   AKV_OK);
  assert_true(ws_paged == ws_bytes); /* the same slots: max_pages chunks */
  assert_int_equal(akv_attention_paged_ref_bf16(&pa, t), AKV_OK);
  assert_true(guard_ok((const unsigned char *)out2, out_bytes));
  assert_true(guard_ok(ws, ws_bytes));
  assert_memory_equal(out, out2, out_bytes);

  /* Page overrides over the same rows: page_map naming the very pages the
   * contiguous rows sit in, read at k_pages = k_base: same bits again. */
  uint32_t *map = (uint32_t *)xbuf((size_t)g->n_ctx * pages_per_ctx * 4u);
  for (uint32_t i = 0; i < g->n_ctx; ++i)
    for (uint32_t p = 0; p < pages_per_ctx; ++p)
      map[i * pages_per_ctx + p] = (p % 2u) ? AKV_PAGE_STAGED : i * pages_per_ctx + p;
  memset(out2, PAT, out_bytes);
  a.out = out2;
  a.page_map = map;
  a.page_map_stride = pages_per_ctx;
  a.k_pages = k;
  a.v_pages = v;
  a.page_stride = (uint64_t)g->chunk * row;
  assert_int_equal(akv_attention_ref_bf16(&a), AKV_OK);
  assert_memory_equal(out, out2, out_bytes);
  assert_true(guard_ok(ws, ws_bytes));

  free(map);
  free(indices);
  free(out2);
  free(out);
  free(ws);
  free(q);
  free(v);
  free(k);
}

static void test_workspace_exact_every_cut(void **state) {
  (void)state;
  static const geo gs[] = {
      {AKV_DTYPE_BF16, 3, 4, 2, 8, 1, {0, 5, 3}},
      {AKV_DTYPE_BF16, 3, 4, 2, 8, 255, {256, 0, 1}},
      {AKV_DTYPE_BF16, 3, 4, 4, 8, 256, {513, 256, 255}},
      {AKV_DTYPE_BF16, 3, 2, 1, 16, 511, {1022, 511, 1}},
      {AKV_DTYPE_BF16, 3, 4, 2, 8, 512, {1025, 0, 600}},
      {AKV_DTYPE_BF16, 3, 2, 2, 4, 1023, {5, 2046, 1024}},
      {AKV_DTYPE_BF16, 3, 2, 1, 3, 1537, {3074, 1540, 1538}},
      {AKV_DTYPE_BF16, 2, 8, 1, 256, 300, {900, 899}},
      {AKV_DTYPE_FP8_E4M3, 3, 4, 2, 8, 768, {1, 1600, 769}},
      {AKV_DTYPE_FP8_E5M2, 4, 6, 3, 5, 7, {0, 22, 0, 13}},
      {AKV_DTYPE_BF16, 1, 1, 1, 1, 1, {1}},
  };
  for (size_t i = 0; i < sizeof gs / sizeof gs[0]; ++i) run_geo(&gs[i], (uint32_t)i * 77u + 1u);
}

/* One contiguous bf16 call over len[0..n) rows of a small fixture. */
typedef struct small {
  _Alignas(64) uint16_t q[4 * 4 * 8];
  _Alignas(64) uint16_t k[4 * 16 * 2 * 8];
  _Alignas(64) uint16_t v[4 * 16 * 2 * 8];
  _Alignas(64) float out[4 * 4 * 8 + 16];
  _Alignas(64) unsigned char ws[1 << 15];
  _Alignas(64) uint32_t len[8];
  _Alignas(64) float ks[4], vs[4];
} small;

static small *small_new(void) {
  small *f = (small *)calloc(1, sizeof *f);
  assert_non_null(f);
  uint32_t s = 99;
  for (size_t i = 0; i < sizeof f->q / 2; ++i) f->q[i] = rnd_bf16(&s);
  for (size_t i = 0; i < sizeof f->k / 2; ++i) f->k[i] = rnd_bf16(&s);
  for (size_t i = 0; i < sizeof f->v / 2; ++i) f->v[i] = rnd_bf16(&s);
  for (int i = 0; i < 4; ++i) f->ks[i] = f->vs[i] = 1.0f;
  memset(f->out, PAT, sizeof f->out);
  return f;
}

static akv_attention_args small_args(small *f, uint32_t n, uint32_t l0) {
  akv_attention_args a;
  memset(&a, 0, sizeof a);
  a.dtype = AKV_DTYPE_BF16;
  a.n_contexts = n;
  a.n_heads = 4;
  a.kv_heads = 2;
  a.head_dim = 8;
  a.chunk_tokens = 4;
  a.scale = 0.25f;
  a.q = f->q;
  a.k_base = f->k;
  a.v_base = f->v;
  a.row_bytes = 2 * 8 * 2;
  a.context_stride = 16 * a.row_bytes;
  for (uint32_t i = 0; i < 8; ++i) f->len[i] = l0;
  a.len = f->len;
  a.out = f->out;
  a.workspace = f->ws;
  a.workspace_bytes = sizeof f->ws;
  return a;
}

static void expect_refused(small *f, const akv_attention_args *a, akv_status want) {
  memset(f->out, PAT, sizeof f->out);
  memset(f->ws, PAT, sizeof f->ws);
  assert_int_equal(akv_attention_ref_bf16(a), want);
  assert_true(all_pat((const unsigned char *)f->out, sizeof f->out));
  assert_true(all_pat(f->ws, sizeof f->ws));
}

/* Chunks at the bound: refused one row above it whatever the lengths; at it
 * (and one row below), a tiny history is one piece and gives the bits of the
 * same rows in a chunk of their own size, inside a workspace of exactly the
 * reported 200 MB, of which one slot is written. */
static void test_chunk_at_the_bound(void **state) {
  (void)state;
  small *f = small_new();
  size_t w = 0, w2 = 0;
  w = 77;
  assert_int_equal(akv_attention_workspace_bytes(1, 1, 1, 1, AKV_ATTENTION_MAX_CHUNK_TOKENS + 1u,
                                                 &w),
                   AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_attention_workspace_bytes(1, 1, 1, 0, UINT32_MAX, &w),
                   AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(w, 77);
  akv_attention_args a = small_args(f, 1, 3);
  a.chunk_tokens = AKV_ATTENTION_MAX_CHUNK_TOKENS + 1u;
  expect_refused(f, &a, AKV_ERR_INVALID_ARGUMENT);
  a.chunk_tokens = UINT32_MAX;
  f->len[0] = 0;
  expect_refused(f, &a, AKV_ERR_INVALID_ARGUMENT);

  /* The reference result: 3 rows in one chunk of 3 (one piece). */
  a = small_args(f, 1, 3);
  a.n_heads = 1;
  a.kv_heads = 1;
  a.head_dim = 1;
  a.row_bytes = 2;
  a.chunk_tokens = 3;
  float ref;
  assert_int_equal(akv_attention_ref_bf16(&a), AKV_OK);
  memcpy(&ref, f->out, sizeof ref);
  const uint32_t chunks[2] = {AKV_ATTENTION_MAX_CHUNK_TOKENS, AKV_ATTENTION_MAX_CHUNK_TOKENS - 1u};
  for (int c = 0; c < 2; ++c) {
    assert_int_equal(akv_attention_workspace_bytes(1, 1, 1, 3, chunks[c], &w), AKV_OK);
    assert_int_equal(akv_attention_workspace_bytes(1, 1, 1, 1, chunks[c], &w2), AKV_OK);
    assert_true(w == w2 && w > (size_t)16 << 20); /* every piece slot of the chunk */
    unsigned char *ws = (unsigned char *)malloc(w);
    assert_non_null(ws);
    a.chunk_tokens = chunks[c];
    a.workspace = ws;
    a.workspace_bytes = w - 1;
    memset(f->out, PAT, sizeof f->out);
    assert_int_equal(akv_attention_ref_bf16(&a), AKV_ERR_INVALID_ARGUMENT);
    assert_true(all_pat((const unsigned char *)f->out, sizeof f->out));
    a.workspace_bytes = w;
    assert_int_equal(akv_attention_ref_bf16(&a), AKV_OK);
    assert_memory_equal(f->out, &ref, sizeof ref);
    assert_true(all_pat((const unsigned char *)f->out + sizeof ref, sizeof f->out - sizeof ref));
    free(ws);
  }
  free(f);
}

/* Row offsets at the edge of "Addressing": a stride that cannot be formed is
 * no error where no row lies behind it (len 1: row 0 only; len 0: nothing),
 * and is one as soon as one row does. */
static void test_strides_only_where_rows_are(void **state) {
  (void)state;
  small *f = small_new();
  akv_attention_args a = small_args(f, 2, 1);
  float ref[4 * 4 * 8];
  a.context_stride = 0; /* both contexts read row 0 of the same rows */
  assert_int_equal(akv_attention_ref_bf16(&a), AKV_OK);
  memcpy(ref, f->out, sizeof ref);
  assert_true(all_pat((const unsigned char *)f->out + 2 * 4 * 8 * 4, 8 * 4));

  /* row_bytes UINT64_MAX: only row 0 of each context is read. */
  a.row_bytes = UINT64_MAX;
  memset(f->out, PAT, sizeof f->out);
  assert_int_equal(akv_attention_ref_bf16(&a), AKV_OK);
  assert_memory_equal(f->out, ref, 2 * 4 * 8 * 4);
  f->len[1] = 2; /* row 1 of context 1 at 2^64 - 1 bytes: refused */
  expect_refused(f, &a, AKV_ERR_INVALID_ARGUMENT);

  /* A context stride past ptrdiff_t behind a context of no rows. */
  a = small_args(f, 2, 1);
  a.context_stride = UINT64_MAX;
  f->len[1] = 0;
  memset(f->out, PAT, sizeof f->out);
  assert_int_equal(akv_attention_ref_bf16(&a), AKV_OK);
  assert_memory_equal(f->out, ref, 4 * 8 * 4);
  for (int j = 0; j < 4 * 8; ++j) assert_true(f->out[4 * 8 + j] == 0.0f);
  f->len[1] = 1;
  expect_refused(f, &a, AKV_ERR_INVALID_ARGUMENT);
  /* Exactly PTRDIFF_MAX + 1 for context 1: refused; a stride whose offset
   * plus the row wraps only the address space: refused. */
  a.context_stride = (uint64_t)PTRDIFF_MAX + 1u;
  expect_refused(f, &a, AKV_ERR_INVALID_ARGUMENT);
  a.context_stride = (uint64_t)PTRDIFF_MAX - 8u;
  expect_refused(f, &a, AKV_ERR_INVALID_ARGUMENT);

  /* Page overrides: an entry of a chunk past page_map_stride is never read,
   * one inside it at an offset past ptrdiff_t is refused. */
  _Alignas(4) uint32_t map[2] = {0, 0};
  a = small_args(f, 1, 5); /* chunks 0 (4 rows) and 1 (1 row) */
  a.page_map = map;
  a.page_map_stride = 1;
  a.k_pages = f->k;
  a.v_pages = f->v;
  a.page_stride = UINT64_MAX; /* page 0 only: offset 0 */
  memset(f->out, PAT, sizeof f->out);
  assert_int_equal(akv_attention_ref_bf16(&a), AKV_OK);
  memcpy(ref, f->out, 4 * 8 * 4);
  a.page_map = NULL;
  memset(f->out, PAT, sizeof f->out);
  assert_int_equal(akv_attention_ref_bf16(&a), AKV_OK);
  assert_memory_equal(f->out, ref, 4 * 8 * 4);
  a.page_map = map;
  map[0] = 1; /* page 1 at 2^64 - 1 bytes */
  expect_refused(f, &a, AKV_ERR_INVALID_ARGUMENT);
  map[0] = AKV_PAGE_STAGED;
  memset(f->out, PAT, sizeof f->out);
  assert_int_equal(akv_attention_ref_bf16(&a), AKV_OK);
  assert_memory_equal(f->out, ref, 4 * 8 * 4);
  /* page_map set but incomplete: refused. */
  a.page_map_stride = 0;
  expect_refused(f, &a, AKV_ERR_INVALID_ARGUMENT);
  a.page_map_stride = 1;
  a.v_pages = NULL;
  expect_refused(f, &a, AKV_ERR_INVALID_ARGUMENT);
  free(f);
}

static void test_scales_hostile(void **state) {
  (void)state;
  small *f = small_new();
  akv_attention_args a = small_args(f, 1, 6);
  const float bad[] = {NAN, INFINITY, -INFINITY, 0.0f, -0.0f, -1.0f, -FLT_MIN};
  a.k_scale = f->ks;
  a.v_scale = f->vs;
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; ++i)
    for (int which = 0; which < 2; ++which) {
      f->ks[1] = f->vs[1] = 1.0f;
      (which ? f->vs : f->ks)[1] = bad[i];
      expect_refused(f, &a, AKV_ERR_INVALID_ARGUMENT);
    }
  f->ks[1] = f->vs[1] = 1.0f;
  /* One array only, either one. */
  a.v_scale = NULL;
  expect_refused(f, &a, AKV_ERR_INVALID_ARGUMENT);
  a.v_scale = f->vs;
  a.k_scale = NULL;
  expect_refused(f, &a, AKV_ERR_INVALID_ARGUMENT);
  /* FP8 without scales. */
  a.k_scale = a.v_scale = NULL;
  a.dtype = AKV_DTYPE_FP8_E5M2;
  expect_refused(f, &a, AKV_ERR_INVALID_ARGUMENT);
  a.dtype = AKV_DTYPE_FP8_E4M3;
  expect_refused(f, &a, AKV_ERR_INVALID_ARGUMENT);
  a.dtype = AKV_DTYPE_BF16;
  /* Softmax scales: not finite, or a score factor that overflows. */
  const float bad_scale[] = {NAN, INFINITY, -INFINITY, FLT_MAX, -FLT_MAX};
  for (size_t i = 0; i < sizeof bad_scale / sizeof bad_scale[0]; ++i) {
    a.scale = bad_scale[i];
    expect_refused(f, &a, AKV_ERR_INVALID_ARGUMENT);
  }
  /* Finite factor without K scales, overflowing with one. */
  a.scale = FLT_MAX / 2.0f;
  memset(f->out, PAT, sizeof f->out);
  assert_int_equal(akv_attention_ref_bf16(&a), AKV_OK);
  a.k_scale = f->ks;
  a.v_scale = f->vs;
  f->ks[0] = 4.0f;
  expect_refused(f, &a, AKV_ERR_INVALID_ARGUMENT);
  f->ks[0] = 1.0f;
  /* Taken: zero, negative and subnormal softmax scales, subnormal K/V scales. */
  const float ok_scale[] = {0.0f, -0.0f, -3.0f, FLT_TRUE_MIN, -FLT_TRUE_MIN};
  for (size_t i = 0; i < sizeof ok_scale / sizeof ok_scale[0]; ++i) {
    a.scale = ok_scale[i];
    memset(f->out, PAT, sizeof f->out);
    assert_int_equal(akv_attention_ref_bf16(&a), AKV_OK);
    for (int j = 0; j < 4 * 8; ++j) assert_true(isfinite(f->out[j]));
  }
  a.scale = 0.25f;
  f->ks[0] = f->vs[1] = FLT_TRUE_MIN;
  memset(f->out, PAT, sizeof f->out);
  assert_int_equal(akv_attention_ref_bf16(&a), AKV_OK);
  for (int j = 0; j < 4 * 8; ++j) assert_true(isfinite(f->out[j]));
  /* Misaligned scale arrays. */
  f->ks[0] = f->vs[1] = 1.0f;
  a.k_scale = (const float *)((const char *)f->ks + 2);
  expect_refused(f, &a, AKV_ERR_INVALID_ARGUMENT);
  a.k_scale = f->ks;
  a.v_scale = (const float *)((const char *)f->vs + 1);
  expect_refused(f, &a, AKV_ERR_INVALID_ARGUMENT);
  /* Scales with more kv_heads than the bound: refused before they are read
   * (the arrays hold 4). */
  a.v_scale = f->vs;
  a.kv_heads = AKV_ATTENTION_MAX_SCALE_HEADS + 1u;
  a.n_heads = a.kv_heads;
  a.head_dim = 1;
  a.row_bytes = (uint64_t)a.kv_heads * 2u;
  expect_refused(f, &a, AKV_ERR_INVALID_ARGUMENT);
  free(f);
}

/* NaN codes and infinities are values, not arguments: AKV_OK, and the
 * context's output is NaN while the other context stays finite. */
static void test_fp8_nan_codes(void **state) {
  (void)state;
  static const uint8_t nan_codes[2][3] = {{0x7F, 0xFF, 0x7F}, {0x7D, 0xFE, 0x7F}};
  const akv_dtype dts[2] = {AKV_DTYPE_FP8_E4M3, AKV_DTYPE_FP8_E5M2};
  for (int d = 0; d < 2; ++d)
    for (int c = 0; c < 3; ++c) {
      _Alignas(16) uint8_t k[2 * 4 * 8], v[2 * 4 * 8];
      _Alignas(16) uint16_t q[2 * 2 * 8];
      _Alignas(16) float out[2 * 2 * 8], ks[1] = {1.0f}, vs[1] = {1.0f};
      _Alignas(16) unsigned char ws[8192];
      uint32_t len[2] = {4, 4};
      uint32_t s = 5;
      for (size_t i = 0; i < sizeof k; ++i) {
        k[i] = rnd_fp8(&s);
        v[i] = rnd_fp8(&s);
      }
      for (size_t i = 0; i < 2 * 2 * 8; ++i) q[i] = rnd_bf16(&s);
      (c == 2 ? v : k)[2 * 8 + 3] = nan_codes[d][c]; /* context 0, row 2 */
      akv_attention_args a;
      memset(&a, 0, sizeof a);
      a.dtype = dts[d];
      a.n_contexts = 2;
      a.n_heads = 2;
      a.kv_heads = 1;
      a.head_dim = 8;
      a.chunk_tokens = 2;
      a.scale = 0.5f;
      a.q = q;
      a.k_base = k;
      a.v_base = v;
      a.context_stride = 4 * 8;
      a.row_bytes = 8;
      a.len = len;
      a.out = out;
      a.workspace = ws;
      a.workspace_bytes = sizeof ws;
      a.k_scale = ks;
      a.v_scale = vs;
      assert_int_equal(akv_attention_ref_bf16(&a), AKV_OK);
      /* Every code above is a NaN of its format: the context that holds it
       * has a NaN output element, the other context none. */
      int nan_seen = 0;
      for (int j = 0; j < 16; ++j) {
        nan_seen |= isnan(out[j]) != 0;
        assert_true(isfinite(out[16 + j]));
      }
      assert_true(nan_seen);
    }
}

static void test_misaligned_and_dtypes(void **state) {
  (void)state;
  small *f = small_new();
  akv_attention_args a = small_args(f, 2, 3);
  a.q = (const char *)f->q + 1;
  expect_refused(f, &a, AKV_ERR_INVALID_ARGUMENT);
  a = small_args(f, 2, 3);
  a.out = (float *)((char *)f->out + 2);
  expect_refused(f, &a, AKV_ERR_INVALID_ARGUMENT);
  a = small_args(f, 2, 3);
  a.workspace = f->ws + 2;
  a.workspace_bytes = sizeof f->ws - 2;
  expect_refused(f, &a, AKV_ERR_INVALID_ARGUMENT);
  a = small_args(f, 2, 0); /* all empty: a misaligned workspace is still refused */
  a.workspace = f->ws + 1;
  a.workspace_bytes = 0;
  expect_refused(f, &a, AKV_ERR_INVALID_ARGUMENT);
  a = small_args(f, 2, 3);
  a.len = (const uint32_t *)((const char *)f->len + 2);
  expect_refused(f, &a, AKV_ERR_INVALID_ARGUMENT);
  /* All lengths 0: a workspace of 0 bytes, NULL included, serves. */
  a = small_args(f, 2, 0);
  a.workspace = NULL;
  a.workspace_bytes = 0;
  memset(f->out, PAT, sizeof f->out);
  assert_int_equal(akv_attention_ref_bf16(&a), AKV_OK);
  for (int j = 0; j < 2 * 4 * 8; ++j) assert_true(f->out[j] == 0.0f);
  f->len[1] = 1;
  expect_refused(f, &a, AKV_ERR_INVALID_ARGUMENT);
  /* Every dtype the reference does not take, wherever else the call stands. */
  const int dts[] = {AKV_DTYPE_F16, AKV_DTYPE_F32, 5, 255, -1, 0x7FFFFFFF};
  for (size_t i = 0; i < sizeof dts / sizeof dts[0]; ++i) {
    a = small_args(f, 2, 3);
    a.dtype = (akv_dtype)dts[i];
    expect_refused(f, &a, AKV_ERR_NOT_SUPPORTED);
  }
  /* Geometry. */
  a = small_args(f, 2, 3);
  a.n_heads = 3; /* not a multiple of kv_heads */
  expect_refused(f, &a, AKV_ERR_INVALID_ARGUMENT);
  a = small_args(f, 2, 3);
  a.row_bytes = 2 * 8 * 2 - 1;
  expect_refused(f, &a, AKV_ERR_INVALID_ARGUMENT);
  a = small_args(f, 2, 3);
  a.head_dim = AKV_ATTENTION_MAX_HEAD_DIM + 1u;
  a.row_bytes = UINT64_MAX;
  expect_refused(f, &a, AKV_ERR_INVALID_ARGUMENT);
  a = small_args(f, 2, 3);
  a.n_contexts = 0;
  expect_refused(f, &a, AKV_ERR_INVALID_ARGUMENT);
  a = small_args(f, 2, 3);
  a.v_base = NULL;
  expect_refused(f, &a, AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_attention_ref_bf16(NULL), AKV_ERR_INVALID_ARGUMENT);
  free(f);
}

/* Page tables the reference must refuse from the table alone, before it
 * reads an element past what the table's own first entries allow. */
static void test_page_table_hostile(void **state) {
  (void)state;
  small *f = small_new();
  _Alignas(4) uint32_t indptr[4] = {0, 2, 2, 3}, indices[4] = {0, 1, 3, 0},
                       last[3] = {4, 0, 1};
  akv_page_table t;
  memset(&t, 0, sizeof t);
  t.batch = 3;
  t.page_tokens = 4;
  t.max_pages = 2;
  t.indptr = indptr;
  t.indices = indices;
  t.last_page_len = last;
  t.k_pages = f->k;
  t.v_pages = f->v;
  t.row_bytes = 2 * 8 * 2;
  t.page_stride = 4 * t.row_bytes;
  akv_attention_paged_args pa;
  memset(&pa, 0, sizeof pa);
  pa.dtype = AKV_DTYPE_BF16;
  pa.n_heads = 4;
  pa.kv_heads = 2;
  pa.head_dim = 8;
  pa.scale = 0.25f;
  pa.q = f->q;
  pa.out = f->out;
  pa.workspace = f->ws;
  pa.workspace_bytes = sizeof f->ws;
#define PAGED_REFUSED(want)                                                        \
  do {                                                                             \
    memset(f->out, PAT, sizeof f->out);                                            \
    memset(f->ws, PAT, sizeof f->ws);                                              \
    assert_int_equal(akv_attention_paged_ref_bf16(&pa, t), (want));                \
    assert_true(all_pat((const unsigned char *)f->out, sizeof f->out));            \
    assert_true(all_pat(f->ws, sizeof f->ws));                                     \
  } while (0)
  /* The baseline: context 1 has no page, its last_page_len 0 is no error. */
  memset(f->out, PAT, sizeof f->out);
  assert_int_equal(akv_attention_paged_ref_bf16(&pa, t), AKV_OK);
  for (int j = 0; j < 4 * 8; ++j) assert_true(f->out[4 * 8 + j] == 0.0f);
  /* Duplicate page ids are taken. */
  indices[1] = 0;
  memset(f->out, PAT, sizeof f->out);
  assert_int_equal(akv_attention_paged_ref_bf16(&pa, t), AKV_OK);
  indices[1] = 1;
  /* last_page_len 0 or above page_tokens where the context has pages. */
  last[0] = 0;
  PAGED_REFUSED(AKV_ERR_INVALID_ARGUMENT);
  last[0] = 5;
  PAGED_REFUSED(AKV_ERR_INVALID_ARGUMENT);
  last[0] = UINT32_MAX;
  PAGED_REFUSED(AKV_ERR_INVALID_ARGUMENT);
  last[0] = 4;
  /* indptr: not from 0, decreasing, a context above max_pages, or an end
   * near UINT32_MAX that no indices array could hold (refused by max_pages
   * before any index is read). */
  indptr[0] = 1;
  PAGED_REFUSED(AKV_ERR_INVALID_ARGUMENT);
  indptr[0] = 0;
  indptr[2] = 1;
  PAGED_REFUSED(AKV_ERR_INVALID_ARGUMENT);
  indptr[2] = 2;
  indptr[3] = UINT32_MAX;
  PAGED_REFUSED(AKV_ERR_INVALID_ARGUMENT);
  indptr[3] = 3;
  t.max_pages = 1;
  PAGED_REFUSED(AKV_ERR_INVALID_ARGUMENT);
  t.max_pages = 2;
  /* A batch far beyond the arrays, refused by indptr[0] before any other
   * element is read. */
  indptr[0] = 7;
  t.batch = UINT32_MAX;
  PAGED_REFUSED(AKV_ERR_INVALID_ARGUMENT);
  t.batch = 3;
  indptr[0] = 0;
  /* Page ids whose rows lie past ptrdiff_t. */
  indices[2] = UINT32_MAX;
  t.page_stride = (uint64_t)1 << 32;
  PAGED_REFUSED(AKV_ERR_INVALID_ARGUMENT);
  t.page_stride = ((uint64_t)PTRDIFF_MAX / UINT32_MAX) + 1u;
  PAGED_REFUSED(AKV_ERR_INVALID_ARGUMENT);
  indices[2] = 3;
  t.page_stride = 4 * t.row_bytes;
  /* NULL indices with pages; NULL indices without pages is taken. */
  t.indices = NULL;
  PAGED_REFUSED(AKV_ERR_INVALID_ARGUMENT);
  uint32_t empty_ptr[4] = {0, 0, 0, 0};
  t.indptr = empty_ptr;
  t.max_pages = 0;
  pa.workspace = NULL;
  pa.workspace_bytes = 0;
  memset(f->out, PAT, sizeof f->out);
  assert_int_equal(akv_attention_paged_ref_bf16(&pa, t), AKV_OK);
  for (int j = 0; j < 3 * 4 * 8; ++j) assert_true(f->out[j] == 0.0f);
  /* ... but max_pages above 0 sizes the workspace even then. */
  t.max_pages = 1;
  PAGED_REFUSED(AKV_ERR_INVALID_ARGUMENT);
  /* max_pages whose piece slots overflow 32 bits: refused. */
  t.max_pages = UINT32_MAX;
  t.page_tokens = 1024; /* 4 pieces per page */
  pa.workspace = f->ws;
  pa.workspace_bytes = SIZE_MAX;
  PAGED_REFUSED(AKV_ERR_INVALID_ARGUMENT);
  t.page_tokens = AKV_ATTENTION_MAX_CHUNK_TOKENS + 1u;
  t.max_pages = 0;
  PAGED_REFUSED(AKV_ERR_INVALID_ARGUMENT);
#undef PAGED_REFUSED
  free(f);
}

static void test_workspace_bytes_hostile(void **state) {
  (void)state;
  size_t w = 12345, prev = 0;
  /* Overflowing products, each factor at its bound. */
  assert_int_equal(akv_attention_workspace_bytes(UINT32_MAX, UINT32_MAX, 256, UINT32_MAX, 1, &w),
                   AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_attention_workspace_bytes(UINT32_MAX, UINT32_MAX, 256, 256, 256, &w),
                   AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_attention_workspace_bytes(0, 1, 1, 1, 1, &w), AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_attention_workspace_bytes(1, 0, 1, 1, 1, &w), AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_attention_workspace_bytes(1, 1, 0, 1, 1, &w), AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_attention_workspace_bytes(1, 1, 257, 1, 1, &w), AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_attention_workspace_bytes(1, 1, 1, 1, 0, &w), AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(w, 12345);
  assert_int_equal(akv_attention_workspace_bytes(1, 1, 1, 1, 1, NULL), AKV_ERR_INVALID_ARGUMENT);
  /* max_tokens 0: 0 bytes. */
  assert_int_equal(akv_attention_workspace_bytes(UINT32_MAX, UINT32_MAX, 256, 0, 1, &w), AKV_OK);
  assert_int_equal(w, 0);
  /* Never shrinks as max_tokens grows, across every cut (256-row pieces). */
  for (uint32_t chunk = 1; chunk <= 2048; chunk = chunk * 3 + 1) {
    prev = 0;
    for (uint32_t m = 0; m <= 6000; m += 97) {
      assert_int_equal(akv_attention_workspace_bytes(3, 5, 7, m, chunk, &w), AKV_OK);
      assert_true(w >= prev);
      prev = w;
    }
    /* The largest max_tokens: no wrap in ceil(max_tokens / chunk). */
    assert_int_equal(akv_attention_workspace_bytes(1, 1, 1, UINT32_MAX, chunk, &w), AKV_OK);
    assert_true(w >= prev);
  }
}

/* akv_attention_args_from_view: forged views refused with *args untouched;
 * accepted ones fill only the documented fields. */
static void test_args_from_view_forged(void **state) {
  (void)state;
  static uint32_t map[4], len[2] = {1, 2};
  static unsigned char rows[256];
  akv_view v;
  memset(&v, 0, sizeof v);
  v.n_contexts = 2;
  v.kv_heads = 2;
  v.head_dim = 8;
  v.dtype = AKV_DTYPE_FP8_E5M2;
  v.row_stride = 16;
  v.base = rows;
  v.context_stride = 64;
  v.v_offset = 128;
  v.len = len;
  akv_attention_args a, keep;
  memset(&a, PAT, sizeof a);
  memcpy(&keep, &a, sizeof a);
#define VIEW_REFUSED()                                                             \
  do {                                                                             \
    assert_int_equal(akv_attention_args_from_view(&v, &a), AKV_ERR_INVALID_ARGUMENT); \
    assert_memory_equal(&a, &keep, sizeof a);                                      \
  } while (0)
  akv_view good = v;
  v.base = NULL;
  VIEW_REFUSED();
  v = good;
  v.v_offset = UINT64_MAX; /* V past the end of the address space */
  VIEW_REFUSED();
  v.v_offset = (uint64_t)(UINTPTR_MAX - (uintptr_t)rows) + 1u;
  VIEW_REFUSED();
  v = good;
  v.page_map = map;
  VIEW_REFUSED(); /* no pages */
  v.pages = rows;
  VIEW_REFUSED(); /* no page_tokens */
  v.page_tokens = 4;
  VIEW_REFUSED(); /* no page_map_stride */
  v.page_map_stride = 2;
  v.pages = (const void *)(UINTPTR_MAX - 64u); /* V pages wrap */
  VIEW_REFUSED();
  assert_int_equal(akv_attention_args_from_view(NULL, &a), AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_attention_args_from_view(&v, NULL), AKV_ERR_INVALID_ARGUMENT);
  assert_memory_equal(&a, &keep, sizeof a);
#undef VIEW_REFUSED
  /* Accepted, off the paged route: chunk_tokens and the caller's fields kept,
   * the page overrides cleared. */
  v = good;
  v.page_tokens = 9; /* no page_map: not the paged route */
  assert_int_equal(akv_attention_args_from_view(&v, &a), AKV_OK);
  assert_int_equal(a.dtype, AKV_DTYPE_FP8_E5M2);
  assert_int_equal(a.n_contexts, 2);
  assert_true(a.k_base == rows && a.v_base == rows + 128);
  assert_true(a.page_map == NULL && a.k_pages == NULL && a.v_pages == NULL);
  assert_int_equal(a.page_map_stride, 0);
  assert_true(a.page_stride == 0);
  assert_memory_equal(&a.chunk_tokens, &keep.chunk_tokens, sizeof a.chunk_tokens);
  assert_memory_equal(&a.n_heads, &keep.n_heads, sizeof a.n_heads);
  assert_memory_equal(&a.scale, &keep.scale, sizeof a.scale);
  assert_memory_equal(&a.q, &keep.q, sizeof a.q);
  assert_memory_equal(&a.len, &keep.len, sizeof a.len);
  assert_memory_equal(&a.out, &keep.out, sizeof a.out);
  assert_memory_equal(&a.workspace, &keep.workspace, sizeof a.workspace);
  assert_memory_equal(&a.workspace_bytes, &keep.workspace_bytes, sizeof a.workspace_bytes);
  assert_memory_equal(&a.k_scale, &keep.k_scale, sizeof a.k_scale);
  assert_memory_equal(&a.v_scale, &keep.v_scale, sizeof a.v_scale);
  /* Paged: chunk_tokens is the page size. */
  v.page_map = map;
  v.pages = rows + 32;
  v.page_map_stride = 2;
  v.page_tokens = 4;
  v.page_stride = 48;
  assert_int_equal(akv_attention_args_from_view(&v, &a), AKV_OK);
  assert_int_equal(a.chunk_tokens, 4);
  assert_true(a.page_map == map && a.page_map_stride == 2);
  assert_true(a.k_pages == rows + 32 && a.v_pages == rows + 160 && a.page_stride == 48);
}

#ifdef AKV_WITH_CUDA
static int have_device(void) {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

#define FAKE(n) ((void *)(uintptr_t)(0x7f0000000000ull + (uint64_t)(n) * 0x100000ull))

/* The launchers' host-side refusals the reference shares, on hostile values
 * the reference's own tests above use; without a device the baseline
 * reaches the launch and fails there (AKV_ERR_BACKEND), so each refusal
 * comes from the field under test. */
static void test_cuda_host_refusals(void **state) {
  (void)state;
  static uint32_t len[2] = {5, 3};
  static float ks[2] = {1.0f, 1.0f}, vs[2] = {1.0f, 1.0f};
  akv_attention_args a;
  memset(&a, 0, sizeof a);
  a.dtype = AKV_DTYPE_BF16;
  a.n_contexts = 2;
  a.n_heads = 4;
  a.kv_heads = 2;
  a.head_dim = 64;
  a.chunk_tokens = 4;
  a.scale = 0.125f;
  a.q = FAKE(1);
  a.k_base = FAKE(2);
  a.v_base = FAKE(3);
  a.row_bytes = 2 * 64 * 2;
  a.context_stride = 8 * a.row_bytes;
  a.len = len;
  a.out = (float *)FAKE(4);
  a.workspace = FAKE(5);
  a.workspace_bytes = (size_t)1 << 30;
  const akv_attention_args base = a;
  if (!have_device()) assert_int_equal(akv_attention_decode_cuda(&a, 0), AKV_ERR_BACKEND);
  a.chunk_tokens = AKV_ATTENTION_MAX_CHUNK_TOKENS + 1u;
  assert_int_equal(akv_attention_decode_cuda(&a, 0), AKV_ERR_INVALID_ARGUMENT);
  a = base;
  a.k_scale = ks; /* only one array */
  assert_int_equal(akv_attention_decode_cuda(&a, 0), AKV_ERR_INVALID_ARGUMENT);
  a.v_scale = vs;
  ks[1] = -0.0f;
  assert_int_equal(akv_attention_decode_cuda(&a, 0), AKV_ERR_INVALID_ARGUMENT);
  ks[1] = 1.0f;
  a.scale = FLT_MAX;
  assert_int_equal(akv_attention_decode_cuda(&a, 0), AKV_ERR_INVALID_ARGUMENT);
  a = base;
  a.context_stride = (uint64_t)PTRDIFF_MAX + 1u; /* context 1's rows */
  assert_int_equal(akv_attention_decode_cuda(&a, 0), AKV_ERR_INVALID_ARGUMENT);
  a = base;
  a.dtype = AKV_DTYPE_F16;
  assert_int_equal(akv_attention_decode_cuda(&a, 0), AKV_ERR_NOT_SUPPORTED);
  a = base;
  a.workspace_bytes = 0; /* too small for 2 chunks */
  assert_int_equal(akv_attention_decode_cuda(&a, 0), AKV_ERR_INVALID_ARGUMENT);
  /* Paged: the host never reads the table's arrays (device memory). */
  akv_page_table t;
  memset(&t, 0, sizeof t);
  t.batch = 2;
  t.page_tokens = 4;
  t.max_pages = 2;
  t.indptr = (const uint32_t *)FAKE(6);
  t.indices = (const uint32_t *)FAKE(7);
  t.last_page_len = (const uint32_t *)FAKE(8);
  t.k_pages = FAKE(9);
  t.v_pages = FAKE(10);
  t.page_stride = 4 * base.row_bytes;
  t.row_bytes = base.row_bytes;
  akv_attention_paged_args pa;
  memset(&pa, 0, sizeof pa);
  pa.dtype = AKV_DTYPE_BF16;
  pa.n_heads = 4;
  pa.kv_heads = 2;
  pa.head_dim = 64;
  pa.scale = 0.125f;
  pa.q = FAKE(1);
  pa.out = (float *)FAKE(4);
  pa.workspace = FAKE(5);
  pa.workspace_bytes = (size_t)1 << 30;
  const akv_page_table tb = t;
  if (!have_device()) assert_int_equal(akv_attention_paged_cuda(&pa, t, 0), AKV_ERR_BACKEND);
  t.page_tokens = AKV_ATTENTION_MAX_CHUNK_TOKENS + 1u;
  assert_int_equal(akv_attention_paged_cuda(&pa, t, 0), AKV_ERR_INVALID_ARGUMENT);
  t = tb;
  t.max_pages = UINT32_MAX; /* piece slots past the grid */
  assert_int_equal(akv_attention_paged_cuda(&pa, t, 0), AKV_ERR_INVALID_ARGUMENT);
  t = tb;
  t.indptr = (const uint32_t *)((const char *)FAKE(6) + 2);
  assert_int_equal(akv_attention_paged_cuda(&pa, t, 0), AKV_ERR_INVALID_ARGUMENT);
  t = tb;
  t.last_page_len = NULL;
  assert_int_equal(akv_attention_paged_cuda(&pa, t, 0), AKV_ERR_INVALID_ARGUMENT);
  t = tb;
  pa.workspace_bytes = 0;
  assert_int_equal(akv_attention_paged_cuda(&pa, t, 0), AKV_ERR_INVALID_ARGUMENT);
}
#endif

/* ------------------------------------------------------------------------ */
/* Configuration                                                             */
/* ------------------------------------------------------------------------ */

static akv_engine_config small_cfg(void) {
  akv_engine_config c;
  assert_int_equal(akv_engine_config_init(&c), AKV_OK);
  c.backend = AKV_BACKEND_HOST;
  c.n_dense_layers = 2;
  c.kv_heads = 2;
  c.head_dim = 8;
  c.max_tokens = 64;
  c.page_tokens = 16;
  c.host_pool_gib = 1;
  c.max_contexts = 4;
  c.log_fn = silent_log;
  return c;
}

/* akv_fit refuses with `want`, leaving the report alone, and
 * akv_engine_create returns the same, leaving *out alone. */
static void expect_cfg(const akv_engine_config *c, akv_status want) {
  akv_fit_report r, keep;
  memset(&r, PAT, sizeof r);
  memcpy(&keep, &r, sizeof r);
  const akv_status fit = akv_fit(c, &r);
  assert_int_equal(fit, want);
  assert_memory_equal(&r, &keep, sizeof r);
  akv_engine *e = (akv_engine *)(uintptr_t)0x1234;
  assert_int_equal(akv_engine_create(c, &e), want);
  assert_true(e == (akv_engine *)(uintptr_t)0x1234);
}

static void test_config_init(void **state) {
  (void)state;
  const akv_engine_config want = AKV_ENGINE_CONFIG_INIT;
  akv_engine_config c;
  memset(&c, PAT, sizeof c);
  assert_int_equal(akv_engine_config_init(&c), AKV_OK);
  assert_int_equal(c.struct_size, sizeof c);
  assert_int_equal(c.version, AKV_CONFIG_VERSION);
  assert_int_equal(c.page_tokens, want.page_tokens);
  assert_int_equal(c.max_contexts, want.max_contexts);
  assert_int_equal(c.fault_kind, -1);
  assert_int_equal(c.log_level, AKV_LOG_INFO);
  assert_true(c.log_fn == NULL && c.log_user == NULL);
  assert_true(c.host_fake_free_bytes == 0 && c.headroom_chunk_pages == 0);
  assert_int_equal(akv_engine_config_init(NULL), AKV_ERR_INVALID_ARGUMENT);
  /* The defaults alone are no engine (no geometry): a config error. */
  expect_cfg(&c, AKV_ERR_CONFIG);
}

static void test_config_enums_and_header(void **state) {
  (void)state;
  akv_engine_config c = small_cfg();
  akv_fit_report r;
  assert_int_equal(akv_fit(&c, &r), AKV_OK);
  assert_int_equal(r.ok, 1);
#define BAD(field, value)                  \
  do {                                     \
    c = small_cfg();                       \
    memcpy(&c.field, &(int32_t){(value)}, sizeof(int32_t)); \
    expect_cfg(&c, AKV_ERR_CONFIG);        \
  } while (0)
  BAD(backend, 3);
  BAD(backend, -1);
  BAD(backend, INT32_MIN);
  BAD(dtype, 5);
  BAD(dtype, -1);
  BAD(fit_mode, 2);
  BAD(fit_mode, -1);
  BAD(route, 3);
  BAD(route, -1);
  BAD(log_level, 4);
  BAD(log_level, -1);
  BAD(fault_kind, -2);
  BAD(fault_kind, AKV_OP_KIND_COUNT);
  BAD(fault_kind, INT32_MIN);
  BAD(version, 0);
  BAD(version, AKV_CONFIG_VERSION + 1);
  BAD(version, -1);
#undef BAD
  /* struct_size below the geometry's end: refused; exactly there: the rest
   * is defaulted (fault_kind -1, log_level INFO, ...) and the config fits. */
  const uint32_t min = (uint32_t)(offsetof(akv_engine_config, route) + sizeof(akv_route));
  const uint32_t sizes_bad[] = {0, 4, 8, min - 1};
  for (size_t i = 0; i < sizeof sizes_bad / sizeof sizes_bad[0]; ++i) {
    c = small_cfg();
    c.struct_size = sizes_bad[i];
    expect_cfg(&c, AKV_ERR_CONFIG);
  }
  c = small_cfg();
  c.struct_size = min;
  c.fault_kind = 99;     /* past struct_size: not read */
  c.log_level = 77;      /* likewise */
  c.host_delay_max_us = UINT32_MAX;
  memset(&r, 0, sizeof r);
  assert_int_equal(akv_fit(&c, &r), AKV_OK);
  assert_int_equal(r.ok, 1);
  /* The log fields past it are not read either: create logs to stderr then;
   * no create here (it would print). A struct_size ending mid-field takes
   * only the whole fields before it. */
  c.struct_size = (uint32_t)(offsetof(akv_engine_config, log_level) + 2);
  assert_int_equal(akv_fit(&c, &r), AKV_OK);
  c.struct_size = (uint32_t)(offsetof(akv_engine_config, fault_kind) + sizeof(int32_t));
  expect_cfg(&c, AKV_ERR_CONFIG); /* fault_kind 99 and log_level 77 now read */
}

static void test_config_sizes_extreme(void **state) {
  (void)state;
  akv_engine_config c;
  /* Each range bound and one past it. */
  c = small_cfg();
  c.n_dense_layers = 65537;
  expect_cfg(&c, AKV_ERR_CONFIG);
  c = small_cfg();
  c.kv_heads = 65537;
  expect_cfg(&c, AKV_ERR_CONFIG);
  c = small_cfg();
  c.head_dim = 65537;
  expect_cfg(&c, AKV_ERR_CONFIG);
  c = small_cfg();
  c.max_contexts = (1u << 20) + 1u;
  expect_cfg(&c, AKV_ERR_CONFIG);
  c = small_cfg();
  c.host_pool_gib = (1u << 20) + 1u;
  expect_cfg(&c, AKV_ERR_CONFIG);
  c = small_cfg();
  c.host_pool_gib = 0;
  expect_cfg(&c, AKV_ERR_CONFIG);
  c = small_cfg();
  c.device_pool_gib = UINT32_MAX;
  expect_cfg(&c, AKV_ERR_CONFIG);
  c = small_cfg();
  c.host_delay_max_us = AKV_HOST_DELAY_MAX_US + 1u;
  expect_cfg(&c, AKV_ERR_CONFIG);
  c = small_cfg();
  c.page_tokens = 0;
  expect_cfg(&c, AKV_ERR_CONFIG);
  c = small_cfg();
  c.page_tokens = c.max_tokens + 1u;
  expect_cfg(&c, AKV_ERR_CONFIG);
  c = small_cfg();
  c.max_tokens = 0;
  c.page_tokens = 0;
  expect_cfg(&c, AKV_ERR_CONFIG);
  /* history = 2^16 layers x 2^32 tokens x 2^34 B x 2: past 64 bits. */
  c = small_cfg();
  c.n_dense_layers = 65536;
  c.kv_heads = 65536;
  c.head_dim = 65536;
  c.dtype = AKV_DTYPE_F32;
  c.max_tokens = UINT32_MAX;
  c.page_tokens = 1;
  expect_cfg(&c, AKV_ERR_CONFIG);
  /* Every factor at its bound but a history that fits 64 bits and no pool:
   * the verdict, not an error (refuse: no fit). */
  c = small_cfg();
  c.n_dense_layers = 65536;
  c.kv_heads = 65536;
  c.head_dim = 65536;
  c.dtype = AKV_DTYPE_F32;
  c.max_tokens = 16;
  c.page_tokens = 16;
  akv_fit_report r;
  memset(&r, 0, sizeof r);
  assert_int_equal(akv_fit(&c, &r), AKV_OK);
  assert_int_equal(r.ok, 0);
  assert_true(r.fits == 0 && r.effective_concurrency == 0);
  assert_true(r.host_pool_gib_needed == UINT32_MAX || r.host_pool_gib_needed > (1u << 20));
  akv_engine *e = (akv_engine *)(uintptr_t)0x1234;
  assert_int_equal(akv_engine_create(&c, &e), AKV_ERR_NO_FIT);
  assert_true(e == (akv_engine *)(uintptr_t)0x1234);
  c.fit_mode = AKV_FIT_SHRINK; /* shrinks to nothing: still no fit */
  assert_int_equal(akv_engine_create(&c, &e), AKV_ERR_NO_FIT);
  assert_true(e == (akv_engine *)(uintptr_t)0x1234);
  /* A page of more than the device pool on a retaining route; taken on stage. */
  c = small_cfg();
  c.route = AKV_ROUTE_ARENA;
  c.device_pool_gib = 1;
  c.kv_heads = 65536;
  c.head_dim = 65536;
  c.max_tokens = 64;
  c.page_tokens = 64;
  expect_cfg(&c, AKV_ERR_CONFIG);
  c.route = AKV_ROUTE_STAGE;
  memset(&r, 0, sizeof r);
  assert_int_equal(akv_fit(&c, &r), AKV_OK);
  /* More than 2^32 - 1 pages: refused on a retaining route. */
  c = small_cfg();
  c.route = AKV_ROUTE_PAGED;
  c.n_dense_layers = 1;
  c.kv_heads = 1;
  c.head_dim = 1;
  c.dtype = AKV_DTYPE_FP8_E4M3;
  c.page_tokens = 1;
  c.device_pool_gib = 8; /* 2^32 pages of 2 B */
  expect_cfg(&c, AKV_ERR_CONFIG);
}

/* device_pool_gib (akv.h): on the paged route with headroom_gib > 0 the pool
 * holds at most 2^32 - 1 - 2^30 pages, else AKV_ERR_CONFIG; the bound is a
 * config error like the 2^32 - 1 one, whatever the host fit says. */
static void test_config_paged_headroom_page_bound(void **state) {
  (void)state;
  akv_engine_config c = small_cfg();
  c.route = AKV_ROUTE_PAGED;
  c.n_dense_layers = 1;
  c.kv_heads = 1;
  c.head_dim = 1;
  c.dtype = AKV_DTYPE_FP8_E4M3;
  c.page_tokens = 1;
  c.max_tokens = 1;
  c.max_contexts = 1;
  c.device_pool_gib = 6; /* 3 x 2^30 pages of 2 B: at the bound's edge, above it */
  c.headroom_gib = 1;
  expect_cfg(&c, AKV_ERR_CONFIG);
  /* Host fit failing too (a history of 2^32 B against 1 GiB). */
  c.max_tokens = (uint32_t)1 << 31;
  expect_cfg(&c, AKV_ERR_CONFIG);
  c.fit_mode = AKV_FIT_SHRINK;
  expect_cfg(&c, AKV_ERR_CONFIG);
  /* Without headroom the same pool is within 2^32 - 1 pages: the host fit
   * decides (no fit). */
  c.headroom_gib = 0;
  akv_fit_report r;
  memset(&r, 0, sizeof r);
  assert_int_equal(akv_fit(&c, &r), AKV_OK);
  assert_int_equal(r.ok, 0);
  assert_true(r.device_pages == 3ull << 30);
}

static void test_context_config_hostile(void **state) {
  (void)state;
  akv_engine_config c = small_cfg();
  c.route = AKV_ROUTE_ARENA;
  c.device_pool_gib = 1;
  akv_engine *e = NULL;
  assert_int_equal(akv_engine_create(&c, &e), AKV_OK);
  akv_context *const sentinel = (akv_context *)(uintptr_t)0x4321;
  akv_context *ctx = sentinel;
  struct {
    akv_context_config cc;
    unsigned char tail[64];
  } big;
  akv_context_config cc = AKV_CONTEXT_CONFIG_INIT;
  const uint32_t sizes_bad[] = {0, 1, 4, 7};
  for (size_t i = 0; i < sizeof sizes_bad / sizeof sizes_bad[0]; ++i) {
    cc = (akv_context_config)AKV_CONTEXT_CONFIG_INIT;
    cc.struct_size = sizes_bad[i];
    assert_int_equal(akv_context_open(e, &cc, &ctx), AKV_ERR_CONFIG);
    assert_true(ctx == sentinel);
  }
  const uint32_t versions_bad[] = {0, AKV_CONFIG_VERSION + 1u, UINT32_MAX};
  for (size_t i = 0; i < sizeof versions_bad / sizeof versions_bad[0]; ++i) {
    cc = (akv_context_config)AKV_CONTEXT_CONFIG_INIT;
    cc.version = versions_bad[i];
    assert_int_equal(akv_context_open(e, &cc, &ctx), AKV_ERR_CONFIG);
    assert_true(ctx == sentinel);
  }
  /* A target no pool holds: refused by admission, nothing written. */
  cc = (akv_context_config)AKV_CONTEXT_CONFIG_INIT;
  cc.target_pages = UINT32_MAX - 1u;
  cc.burst_pages = UINT32_MAX;
  assert_int_equal(akv_context_open(e, &cc, &ctx), AKV_ERR_ADMISSION_REFUSED);
  assert_true(ctx == sentinel);
  assert_int_equal(akv_context_open(e, &cc, NULL), AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_context_open(NULL, &cc, &ctx), AKV_ERR_BAD_HANDLE);
  assert_true(ctx == sentinel);
  /* Only the header (8 bytes): the defaults for the rest, whatever follows. */
  memset(&big, 0xFF, sizeof big);
  big.cc.struct_size = 8;
  big.cc.version = 1;
  akv_context *c1 = NULL, *c2 = NULL, *c3 = NULL;
  assert_int_equal(akv_context_open(e, &big.cc, &c1), AKV_OK);
  /* A struct larger than the library's: its known fields are taken. */
  big.cc.struct_size = (uint32_t)sizeof big;
  big.cc.target_pages = 0;
  big.cc.burst_pages = UINT32_MAX; /* borrows while free, no right */
  assert_int_equal(akv_context_open(e, &big.cc, &c2), AKV_OK);
  big.cc.struct_size = UINT32_MAX;
  big.cc.burst_pages = 0;
  assert_int_equal(akv_context_open(e, &big.cc, &c3), AKV_OK);
  assert_int_equal(akv_context_close(c3), AKV_OK);
  assert_int_equal(akv_context_close(c2), AKV_OK);
  assert_int_equal(akv_context_close(c1), AKV_OK);
  assert_int_equal(akv_engine_destroy(e), AKV_OK);
}

/* Every backend operation of a create failing in turn: only the documented
 * statuses, *out untouched, nothing leaked (the sanitizer build checks). */
static void test_config_create_faults(void **state) {
  (void)state;
  akv_fit_report r;
  akv_engine *e = NULL;
  akv_engine_config c = small_cfg();
  assert_int_equal(akv_fit(NULL, &r), AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_fit(&c, NULL), AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_engine_create(NULL, &e), AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_engine_create(&c, NULL), AKV_ERR_INVALID_ARGUMENT);
  c.fit_mode = (akv_fit_mode)7; /* NULL out wins over a bad config */
  assert_int_equal(akv_engine_create(&c, NULL), AKV_ERR_INVALID_ARGUMENT);
  uint32_t n = 1;
  for (; n < 100; ++n) {
    c = small_cfg();
    c.route = AKV_ROUTE_PAGED;
    c.device_pool_gib = 1;
    c.poison_holes = 1;
    c.log_level = AKV_LOG_ERROR;
    c.fault_fail_nth = n;
    e = (akv_engine *)(uintptr_t)0x1234;
    const akv_status st = akv_engine_create(&c, &e);
    if (st == AKV_OK) {
      assert_true(e != (akv_engine *)(uintptr_t)0x1234);
      assert_int_equal(akv_engine_destroy(e), AKV_OK);
      break;
    }
    assert_true(st == AKV_ERR_OUT_OF_MEMORY || st == AKV_ERR_BACKEND);
    assert_true(e == (akv_engine *)(uintptr_t)0x1234);
  }
  assert_true(n > 1 && n < 100);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_workspace_exact_every_cut),
      cmocka_unit_test(test_chunk_at_the_bound),
      cmocka_unit_test(test_strides_only_where_rows_are),
      cmocka_unit_test(test_scales_hostile),
      cmocka_unit_test(test_fp8_nan_codes),
      cmocka_unit_test(test_misaligned_and_dtypes),
      cmocka_unit_test(test_page_table_hostile),
      cmocka_unit_test(test_workspace_bytes_hostile),
      cmocka_unit_test(test_args_from_view_forged),
#ifdef AKV_WITH_CUDA
      cmocka_unit_test(test_cuda_host_refusals),
#endif
      cmocka_unit_test(test_config_init),
      cmocka_unit_test(test_config_enums_and_header),
      cmocka_unit_test(test_config_sizes_extreme),
      cmocka_unit_test(test_config_paged_headroom_page_bound),
      cmocka_unit_test(test_context_config_hostile),
      cmocka_unit_test(test_config_create_faults),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
