/*
 * test_attention_ref.c - the CPU reference attention (akv_attention.h).
 *
 * Checks, on random bf16 and FP8 (E4M3, E5M2) inputs drawn fresh per case:
 *  - the reference against a naive float64 softmax attention: relative L2
 *    error ||out - ref|| / ||ref|| <= 1e-5 per context (all arithmetic is
 *    fp32 over bf16 inputs or exactly decoded FP8 codes, so the error is a
 *    few fp32 roundings; the float64 side decodes FP8 with ldexp and applies
 *    the per-head scales in float64);
 *  - FP8 with scales gives the bits of bf16 over the decoded values with the
 *    same scales; chunks cut into pieces (attention_pieces.h) at lengths
 *    around the piece boundaries;
 *  - paged == contiguous, bit for bit, with page_tokens == chunk_tokens;
 *  - lengths 0, 1, chunk-1, chunk, chunk+1, odd; GQA groups 1, 3, 4, 8;
 *  - determinism (same input twice -> same bits);
 *  - argument checks leave the output untouched;
 *  - the checker has teeth (a corrupted row is detected).
 * Every byte the kernels must not read (row padding, rows at and beyond len,
 * unused pages) is filled with bf16 NaN, so a stray read poisons the output.
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

#include "akv_attention.h"
#include "attention_pieces.h"
#include "attn_testdata.h"

#define REL_L2_TOL 1e-5

/* Largest relative L2 error seen, printed so the margin under the bound shows. */
static double worst_err = 0.0;

/* ------------------------------------------------------------------ helpers */

static void poison_f32(float *p, size_t n) {
  const uint32_t nan_bits = 0x7FBADBADu;
  for (size_t i = 0; i < n; ++i) memcpy(&p[i], &nan_bits, sizeof nan_bits);
}

/* A test problem: contiguous history in the akv_view layout, plus q. */
typedef struct problem {
  akv_dtype dtype;
  int scaled;                  /* pass k_scale / v_scale (always for FP8) */
  float k_scale[16], v_scale[16]; /* per kv head */
  uint32_t n_ctx, n_heads, kv_heads, head_dim, chunk;
  uint32_t len[16];
  uint32_t cap; /* rows of room per context */
  uint64_t row_bytes, context_stride, v_offset;
  char *base; /* n_ctx * context_stride bytes */
  uint16_t *q;
  float scale;
} problem;

static void problem_init_dt(problem *p, akv_dtype dt, uint32_t n_ctx, uint32_t n_heads,
                            uint32_t kv_heads, uint32_t head_dim, uint32_t chunk,
                            const uint32_t *len, float amp) {
  memset(p, 0, sizeof *p);
  assert_true(n_ctx <= 16);
  assert_true(kv_heads <= 16);
  p->dtype = dt;
  p->scaled = dt != AKV_DTYPE_BF16;
  /* Scales of FP8 rows whose codes reach about 8: values up to about 1,
   * different per head and for K and V, not powers of two. */
  for (uint32_t g = 0; g < kv_heads; ++g) {
    p->k_scale[g] = 0.11f * (1.0f + 0.37f * (float)g);
    p->v_scale[g] = 0.13f * (1.0f + 0.21f * (float)((g * 5u) % 7u));
  }
  p->n_ctx = n_ctx;
  p->n_heads = n_heads;
  p->kv_heads = kv_heads;
  p->head_dim = head_dim;
  p->chunk = chunk;
  p->cap = 1;
  for (uint32_t i = 0; i < n_ctx; ++i) {
    p->len[i] = len[i];
    if (len[i] + 1 > p->cap) p->cap = len[i] + 1;
  }
  /* Padding everywhere the kernels must not look: 32 bytes per row, a spare
   * row per context, 64 bytes between K and V and between contexts. */
  p->row_bytes = (uint64_t)kv_heads * head_dim * attn_elem_bytes(dt) + 32u;
  p->v_offset = p->cap * p->row_bytes + 64u;
  p->context_stride = 2u * p->v_offset;
  p->base = (char *)malloc(n_ctx * p->context_stride);
  assert_non_null(p->base);
  fill_nan_dt(p->base, n_ctx * p->context_stride, dt);
  for (uint32_t i = 0; i < n_ctx; ++i) {
    for (uint32_t t = 0; t < len[i]; ++t) {
      char *k = p->base + i * p->context_stride + t * p->row_bytes;
      fill_random_dt(k, (size_t)kv_heads * head_dim, dt, 1.0f);
      fill_random_dt(k + p->v_offset, (size_t)kv_heads * head_dim, dt, 1.0f);
    }
  }
  p->q = (uint16_t *)malloc((size_t)n_ctx * n_heads * head_dim * 2u);
  assert_non_null(p->q);
  fill_random16(p->q, (size_t)n_ctx * n_heads * head_dim, amp);
  p->scale = 1.0f / sqrtf((float)head_dim);
}

static void problem_init(problem *p, uint32_t n_ctx, uint32_t n_heads, uint32_t kv_heads,
                         uint32_t head_dim, uint32_t chunk, const uint32_t *len, float amp) {
  problem_init_dt(p, AKV_DTYPE_BF16, n_ctx, n_heads, kv_heads, head_dim, chunk, len, amp);
}

static void problem_free(problem *p) {
  free(p->base);
  free(p->q);
}

static size_t out_elems(const problem *p) { return (size_t)p->n_ctx * p->n_heads * p->head_dim; }

static uint32_t max_len(const problem *p) {
  uint32_t m = 0;
  for (uint32_t i = 0; i < p->n_ctx; ++i)
    if (p->len[i] > m) m = p->len[i];
  return m;
}

/* Runs the contiguous reference; returns its status. */
static akv_status run_contig(const problem *p, float *out) {
  size_t ws_bytes = 0;
  assert_int_equal(akv_attention_workspace_bytes(p->n_ctx, p->n_heads, p->head_dim, max_len(p),
                                                 p->chunk, &ws_bytes),
                   AKV_OK);
  void *ws = malloc(ws_bytes ? ws_bytes : 1);
  assert_non_null(ws);
  akv_attention_args a;
  memset(&a, 0, sizeof a);
  a.dtype = p->dtype;
  if (p->scaled) {
    a.k_scale = p->k_scale;
    a.v_scale = p->v_scale;
  }
  a.n_contexts = p->n_ctx;
  a.n_heads = p->n_heads;
  a.kv_heads = p->kv_heads;
  a.head_dim = p->head_dim;
  a.chunk_tokens = p->chunk;
  a.scale = p->scale;
  a.q = p->q;
  a.k_base = p->base;
  a.v_base = p->base + p->v_offset;
  a.context_stride = p->context_stride;
  a.row_bytes = p->row_bytes;
  a.len = p->len;
  a.out = out;
  a.workspace = ws;
  a.workspace_bytes = ws_bytes;
  akv_status st = akv_attention_ref_bf16(&a);
  free(ws);
  return st;
}

/* A paged copy of the same history (attn_paged_build): pages shuffled in a
 * pool with three pages nobody owns, NaN wherever no row is. */
static void paged_build(attn_paged *pg, const problem *p) {
  assert_int_equal(attn_paged_build_dt(pg, p->dtype, p->n_ctx, p->len, p->kv_heads, p->head_dim,
                                       p->base, p->context_stride, p->row_bytes, p->v_offset,
                                       p->chunk, 3),
                   0);
}

static akv_status run_paged(const problem *p, const attn_paged *pg, float *out) {
  size_t ws_bytes = 0;
  assert_int_equal(akv_attention_workspace_bytes(pg->t.batch, p->n_heads, p->head_dim,
                                                 pg->t.max_pages * pg->t.page_tokens,
                                                 pg->t.page_tokens, &ws_bytes),
                   AKV_OK);
  void *ws = malloc(ws_bytes ? ws_bytes : 1);
  assert_non_null(ws);
  akv_attention_paged_args a;
  memset(&a, 0, sizeof a);
  a.dtype = p->dtype;
  if (p->scaled) {
    a.k_scale = p->k_scale;
    a.v_scale = p->v_scale;
  }
  a.n_heads = p->n_heads;
  a.kv_heads = p->kv_heads;
  a.head_dim = p->head_dim;
  a.scale = p->scale;
  a.q = p->q;
  a.out = out;
  a.workspace = ws;
  a.workspace_bytes = ws_bytes;
  akv_status st = akv_attention_paged_ref_bf16(&a, pg->t);
  free(ws);
  return st;
}

/* Naive float64 softmax attention of context i into ref[n_heads][head_dim],
 * over the rows' values (FP8: decoded code x the head's scale, in float64). */
static void naive_f64(const problem *p, uint32_t i, double *ref) {
  const uint32_t d = p->head_dim, group = p->n_heads / p->kv_heads, n = p->len[i];
  double *s = (double *)malloc((n ? n : 1) * sizeof(double));
  assert_non_null(s);
  for (uint32_t h = 0; h < p->n_heads; ++h) {
    const uint32_t kvh = h / group;
    const uint16_t *q = p->q + ((size_t)i * p->n_heads + h) * d;
    const size_t head_off = (size_t)kvh * d * attn_elem_bytes(p->dtype);
    const double ks = p->scaled ? (double)p->k_scale[kvh] : 1.0;
    const double vs = p->scaled ? (double)p->v_scale[kvh] : 1.0;
    double m = -INFINITY, l = 0.0;
    for (uint32_t t = 0; t < n; ++t) {
      const char *k = p->base + i * p->context_stride + t * p->row_bytes + head_off;
      double dot = 0.0;
      for (uint32_t j = 0; j < d; ++j) dot += bf16_to_f64(q[j]) * (elem_to_f64(k, j, p->dtype) * ks);
      s[t] = dot * (double)p->scale;
      if (s[t] > m) m = s[t];
    }
    for (uint32_t j = 0; j < d; ++j) ref[(size_t)h * d + j] = 0.0;
    for (uint32_t t = 0; t < n; ++t) {
      const double w = exp(s[t] - m);
      const char *v = p->base + i * p->context_stride + p->v_offset + t * p->row_bytes + head_off;
      l += w;
      for (uint32_t j = 0; j < d; ++j)
        ref[(size_t)h * d + j] += w * (elem_to_f64(v, j, p->dtype) * vs);
    }
    for (uint32_t j = 0; j < d; ++j) ref[(size_t)h * d + j] = n ? ref[(size_t)h * d + j] / l : 0.0;
  }
  free(s);
}

/* Relative L2 error of context i's output against float64; NaN -> +inf. */
static double rel_l2_ctx(const problem *p, const float *out, uint32_t i) {
  const size_t per = (size_t)p->n_heads * p->head_dim;
  double *ref = (double *)malloc(per * sizeof(double));
  assert_non_null(ref);
  naive_f64(p, i, ref);
  double num = 0.0, den = 0.0;
  for (size_t e = 0; e < per; ++e) {
    const double o = (double)out[(size_t)i * per + e];
    if (isnan(o)) {
      free(ref);
      return INFINITY;
    }
    num += (o - ref[e]) * (o - ref[e]);
    den += ref[e] * ref[e];
  }
  free(ref);
  if (den == 0.0) return num == 0.0 ? 0.0 : INFINITY;
  return sqrt(num / den);
}

/* Checks every context against float64, then paged == contiguous bitwise. */
static void check_problem_dt(akv_dtype dt, uint32_t n_ctx, uint32_t n_heads, uint32_t kv_heads,
                             uint32_t head_dim, uint32_t chunk, const uint32_t *len, float amp) {
  problem p;
  attn_paged pg;
  problem_init_dt(&p, dt, n_ctx, n_heads, kv_heads, head_dim, chunk, len, amp);
  const size_t n = out_elems(&p);
  float *out = (float *)malloc(n * sizeof(float));
  float *out_paged = (float *)malloc(n * sizeof(float));
  assert_non_null(out);
  assert_non_null(out_paged);
  poison_f32(out, n);
  poison_f32(out_paged, n);

  assert_int_equal(run_contig(&p, out), AKV_OK);
  for (uint32_t i = 0; i < n_ctx; ++i) {
    const double err = rel_l2_ctx(&p, out, i);
    if (!(err <= REL_L2_TOL))
      print_error("dtype %d ctx %u len %u heads %u/%u dim %u chunk %u amp %g: rel L2 %.3e > "
                  "%.0e\n",
                  (int)dt, i, len[i], n_heads, kv_heads, head_dim, chunk, (double)amp, err,
                  REL_L2_TOL);
    assert_true(err <= REL_L2_TOL);
    if (err > worst_err) worst_err = err;
  }

  paged_build(&pg, &p);
  assert_int_equal(run_paged(&p, &pg, out_paged), AKV_OK);
  assert_memory_equal(out, out_paged, n * sizeof(float));

  attn_paged_free(&pg);
  free(out);
  free(out_paged);
  problem_free(&p);
}

static void check_problem(uint32_t n_ctx, uint32_t n_heads, uint32_t kv_heads, uint32_t head_dim,
                          uint32_t chunk, const uint32_t *len, float amp) {
  check_problem_dt(AKV_DTYPE_BF16, n_ctx, n_heads, kv_heads, head_dim, chunk, len, amp);
}

/* ------------------------------------------------------------------ tests */

static void test_workspace_bytes(void **state) {
  (void)state;
  size_t b = 0;
  /* pieces per chunk of 256 rows in this build: 1 (the library's), or 2 with
   * -DAKV_ATTN_PIECE_TOKENS=128 */
  const size_t p256 = akv_attn_pieces(256);
  assert_true(p256 == (AKV_ATTN_PIECE_TOKENS > 0 ? 256u / AKV_ATTN_PIECE_TOKENS : 1u) ||
              (p256 == 1 && AKV_ATTN_PIECE_TOKENS > 256));
  assert_int_equal(akv_attention_workspace_bytes(1, 1, 128, 256, 256, &b), AKV_OK);
  /* one chunk of 256 rows = p256 pieces: acc p256 x 128 floats, ml p256 x 2
   * floats rounded up to 256 B */
  assert_int_equal(b, p256 * 512u + 256u);
  /* a chunk of up to 255 rows is one piece whatever the build */
  assert_int_equal(akv_attention_workspace_bytes(1, 1, 128, 255, 255, &b),
                   AKV_OK);
  assert_int_equal(b, akv_attn_pieces(255) * 512u + 256u);
  assert_int_equal(akv_attention_workspace_bytes(4, 32, 128, 31744, 256, &b), AKV_OK);
  assert_int_equal(b, (size_t)4 * 32 * 124 * p256 * 128 * 4 + (size_t)4 * 32 * 124 * p256 * 2 * 4);
  assert_int_equal(akv_attention_workspace_bytes(2, 8, 64, 0, 16, &b), AKV_OK);
  assert_int_equal(b, 0u);
  assert_int_equal(akv_attention_workspace_bytes(1, 1, 128, 256, 0, &b), AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_attention_workspace_bytes(0, 1, 128, 256, 16, &b), AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_attention_workspace_bytes(1, 1, 512, 256, 16, &b), AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_attention_workspace_bytes(1, 1, 128, 256, 16, NULL),
                   AKV_ERR_INVALID_ARGUMENT);
  /* 2^32 * 2^32 * 256 * 4 bytes overflows size_t on every platform. */
  assert_int_equal(akv_attention_workspace_bytes(UINT32_MAX, UINT32_MAX, 256, UINT32_MAX, 1, &b),
                   AKV_ERR_INVALID_ARGUMENT);
}

static void test_matches_float64(void **state) {
  (void)state;
  const uint32_t len[4] = {300, 77, 1, 512};
  check_problem(4, 32, 8, 128, 64, len, 1.0f);  /* group 4, llama geometry */
  check_problem(4, 8, 8, 64, 32, len, 1.0f);    /* group 1 (MHA) */
  check_problem(4, 64, 8, 128, 256, len, 1.0f); /* group 8, one chunk mostly */
  check_problem(4, 12, 4, 80, 48, len, 1.0f);   /* group 3, head_dim 80 (reference only) */
  check_problem(4, 16, 1, 64, 100, len, 1.0f);  /* MQA, group 16 */
  /* Sharper softmax: scores several times larger. */
  check_problem(4, 32, 8, 128, 64, len, 6.0f);
  print_message("worst relative L2 error against float64: %.3e (bound %.0e)\n", worst_err,
                REL_L2_TOL);
}

static void test_lengths_around_chunk(void **state) {
  (void)state;
  const uint32_t chunk = 16;
  const uint32_t len[6] = {1, chunk - 1, chunk, chunk + 1, 3 * chunk + 7, 5 * chunk};
  check_problem(6, 32, 8, 128, chunk, len, 1.0f);
  check_problem(6, 8, 2, 64, chunk, len, 2.0f);
  /* chunk of one row */
  const uint32_t len1[3] = {1, 2, 9};
  check_problem(3, 4, 4, 64, 1, len1, 1.0f);
}

static void test_gqa_groups(void **state) {
  (void)state;
  const uint32_t len[2] = {129, 255};
  const uint32_t groups[4] = {1, 3, 4, 8};
  for (int g = 0; g < 4; ++g) check_problem(2, 2 * groups[g], 2, 128, 64, len, 1.0f);
}

static void test_zero_length_gives_zeros(void **state) {
  (void)state;
  const uint32_t len[3] = {0, 5, 0};
  problem p;
  attn_paged pg;
  problem_init(&p, 3, 8, 2, 64, 4, len, 1.0f);
  const size_t n = out_elems(&p), per = (size_t)8 * 64;
  float *out = (float *)malloc(n * sizeof(float));
  float *out2 = (float *)malloc(n * sizeof(float));
  assert_non_null(out);
  assert_non_null(out2);
  poison_f32(out, n);
  poison_f32(out2, n);
  assert_int_equal(run_contig(&p, out), AKV_OK);
  for (size_t e = 0; e < per; ++e) {
    assert_true(out[e] == 0.0f);
    assert_true(out[2 * per + e] == 0.0f);
  }
  assert_true(rel_l2_ctx(&p, out, 1) <= REL_L2_TOL);
  paged_build(&pg, &p);
  assert_int_equal(run_paged(&p, &pg, out2), AKV_OK);
  assert_memory_equal(out, out2, n * sizeof(float));
  attn_paged_free(&pg);

  /* All contexts empty: a workspace of 0 bytes (and NULL) is enough. */
  const uint32_t none[2] = {0, 0};
  problem e;
  problem_init(&e, 2, 4, 4, 64, 8, none, 1.0f);
  akv_attention_args a;
  memset(&a, 0, sizeof a);
  a.dtype = AKV_DTYPE_BF16;
  a.n_contexts = 2;
  a.n_heads = 4;
  a.kv_heads = 4;
  a.head_dim = 64;
  a.chunk_tokens = 8;
  a.scale = 0.125f;
  a.q = e.q;
  a.k_base = e.base;
  a.v_base = e.base + e.v_offset;
  a.context_stride = e.context_stride;
  a.row_bytes = e.row_bytes;
  a.len = e.len;
  a.out = out;
  poison_f32(out, 2 * 4 * 64);
  assert_int_equal(akv_attention_ref_bf16(&a), AKV_OK);
  for (size_t i = 0; i < 2 * 4 * 64; ++i) assert_true(out[i] == 0.0f);
  problem_free(&e);

  free(out);
  free(out2);
  problem_free(&p);
}

/* Page overrides (the paged route's view): the history laid out as the
 * engine keeps it (K and V rows of a token side by side), some full chunks
 * moved into scattered pages with their staged rows poisoned, and a page map
 * naming them: same bits as the plain call over the original layout. A
 * locator that read a moved chunk from its old place would read NaN. Also
 * checks akv_attention_args_from_view on a view of that shape. */
static void test_page_overrides_same_bits(void **state) {
  (void)state;
  const uint32_t len[4] = {300, 64, 17, 257};
  const uint32_t pt = 32, stride = 12, pool_pages = 40;
  problem p;
  problem_init(&p, 4, 16, 4, 64, pt, len, 2.0f);
  const size_t n = out_elems(&p);
  float *want = (float *)malloc(n * sizeof(float));
  float *got = (float *)malloc(n * sizeof(float));
  uint32_t map[4 * 12];
  const uint64_t rs = 2 * p.row_bytes, cs = (uint64_t)p.cap * rs;
  const uint64_t page_stride = pt * rs + 48u; /* padding between pages */
  char *pool = (char *)malloc(pool_pages * page_stride);
  char *base = (char *)malloc(4 * cs);
  assert_non_null(want);
  assert_non_null(got);
  assert_non_null(pool);
  assert_non_null(base);
  fill_nan16(pool, pool_pages * page_stride);
  fill_nan16(base, 4 * cs);
  assert_int_equal(run_contig(&p, want), AKV_OK);
  for (uint32_t i = 0; i < 4; ++i)
    for (uint32_t t = 0; t < len[i]; ++t) {
      const char *src = p.base + i * p.context_stride + (size_t)t * p.row_bytes;
      memcpy(base + i * cs + t * rs, src, p.row_bytes);
      memcpy(base + i * cs + t * rs + p.row_bytes, src + p.v_offset, p.row_bytes);
    }
  uint32_t next = 0, moved = 0;
  for (uint32_t i = 0; i < 4; ++i) {
    for (uint32_t c = 0; c < stride; ++c) {
      map[i * stride + c] = AKV_PAGE_STAGED;
      if ((c + 1) * pt > len[i] || rng_next() % 3 == 0) continue; /* partial or kept staged */
      const uint32_t phys = (next++ * 7u) % pool_pages;             /* scattered */
      for (uint32_t r = 0; r < pt; ++r) {
        char *src = base + i * cs + (size_t)(c * pt + r) * rs;
        memcpy(pool + phys * page_stride + r * rs, src, rs); /* K and V */
        fill_nan16(src, rs);
      }
      map[i * stride + c] = phys;
      moved++;
    }
  }
  assert_true(moved >= 6);
  akv_view v;
  memset(&v, 0, sizeof v);
  v.n_contexts = 4;
  v.kv_heads = p.kv_heads;
  v.head_dim = p.head_dim;
  v.dtype = AKV_DTYPE_BF16;
  v.row_stride = rs;
  v.base = base;
  v.context_stride = cs;
  v.v_offset = p.row_bytes;
  v.len = p.len;
  v.page_tokens = pt;
  v.page_map_stride = stride;
  v.page_map = map;
  v.page_map_host = map;
  v.pages = pool;
  v.page_stride = page_stride;
  size_t ws_bytes = 0;
  assert_int_equal(akv_attention_workspace_bytes(4, p.n_heads, p.head_dim, max_len(&p), pt,
                                                 &ws_bytes),
                   AKV_OK);
  void *ws = malloc(ws_bytes);
  assert_non_null(ws);
  akv_attention_args a;
  memset(&a, 0, sizeof a);
  assert_int_equal(akv_attention_args_from_view(&v, &a), AKV_OK);
  assert_int_equal(a.chunk_tokens, pt);
  assert_ptr_equal(a.page_map, map);
  assert_ptr_equal(a.v_pages, pool + p.row_bytes);
  assert_ptr_equal(a.v_base, base + p.row_bytes);
  assert_int_equal(a.row_bytes, rs);
  a.n_heads = p.n_heads;
  a.scale = p.scale;
  a.q = p.q;
  a.len = p.len;
  a.out = got;
  a.workspace = ws;
  a.workspace_bytes = ws_bytes;
  poison_f32(got, n);
  assert_int_equal(akv_attention_ref_bf16(&a), AKV_OK);
  assert_memory_equal(got, want, n * sizeof(float));
  /* without the map the moved chunks are NaN: the overrides carried it */
  a.page_map = NULL;
  assert_int_equal(akv_attention_ref_bf16(&a), AKV_OK);
  assert_true(isnan(got[0]) || memcmp(got, want, n * sizeof(float)) != 0);
  /* an inconsistent override is refused */
  a.page_map = map;
  a.k_pages = NULL;
  assert_int_equal(akv_attention_ref_bf16(&a), AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_attention_args_from_view(NULL, &a), AKV_ERR_INVALID_ARGUMENT);
  free(ws);
  free(pool);
  free(base);
  free(want);
  free(got);
  problem_free(&p);
}

static void test_deterministic(void **state) {
  (void)state;
  const uint32_t len[3] = {1000, 333, 64};
  problem p;
  problem_init(&p, 3, 32, 8, 128, 64, len, 2.0f);
  const size_t n = out_elems(&p);
  float *a = (float *)malloc(n * sizeof(float));
  float *b = (float *)malloc(n * sizeof(float));
  assert_non_null(a);
  assert_non_null(b);
  poison_f32(a, n);
  memset(b, 0, n * sizeof(float));
  assert_int_equal(run_contig(&p, a), AKV_OK);
  assert_int_equal(run_contig(&p, b), AKV_OK);
  assert_memory_equal(a, b, n * sizeof(float));
  free(a);
  free(b);
  problem_free(&p);
}

/* The checks above must be able to fail: a changed row and a corrupted output
 * are both detected, and rows beyond len are ignored bit for bit. */
static void test_checker_has_teeth(void **state) {
  (void)state;
  const uint32_t len[1] = {200};
  problem p;
  problem_init(&p, 1, 8, 2, 64, 32, len, 2.0f);
  const size_t n = out_elems(&p);
  float *a = (float *)malloc(n * sizeof(float));
  float *b = (float *)malloc(n * sizeof(float));
  assert_non_null(a);
  assert_non_null(b);
  assert_int_equal(run_contig(&p, a), AKV_OK);
  assert_true(rel_l2_ctx(&p, a, 0) <= REL_L2_TOL);

  /* One output element off by 1e-3 of the norm: the L2 check notices. */
  double norm = 0.0;
  for (size_t e = 0; e < n; ++e) norm += (double)a[e] * a[e];
  a[7] += (float)(1e-3 * sqrt(norm));
  assert_true(rel_l2_ctx(&p, a, 0) > REL_L2_TOL);

  /* A V row changed after the run: the recomputed output differs. */
  uint16_t *v = (uint16_t *)(p.base + p.v_offset + 100 * p.row_bytes);
  v[3] = f32_to_bf16((float)bf16_to_f64(v[3]) + 0.5f);
  assert_int_equal(run_contig(&p, b), AKV_OK);
  assert_true(rel_l2_ctx(&p, b, 0) <= REL_L2_TOL); /* float64 sees the same change */
  assert_int_equal(run_contig(&p, a), AKV_OK);
  assert_memory_equal(a, b, n * sizeof(float));
  v[3] = f32_to_bf16((float)bf16_to_f64(v[3]) - 0.5f - 0.25f);
  assert_int_equal(run_contig(&p, a), AKV_OK);
  assert_memory_not_equal(a, b, n * sizeof(float));

  /* The row at index len (the step's new row) is not read: changing it from
   * NaN to a number changes nothing. */
  assert_int_equal(run_contig(&p, b), AKV_OK);
  fill_random16((uint16_t *)(p.base + 200 * p.row_bytes), (size_t)2 * 64, 1.0f);
  fill_random16((uint16_t *)(p.base + p.v_offset + 200 * p.row_bytes), (size_t)2 * 64, 1.0f);
  assert_int_equal(run_contig(&p, a), AKV_OK);
  assert_memory_equal(a, b, n * sizeof(float));
  free(a);
  free(b);
  problem_free(&p);
}

static void test_invalid_arguments(void **state) {
  (void)state;
  const uint32_t len[2] = {40, 17};
  problem p;
  problem_init(&p, 2, 8, 2, 64, 16, len, 1.0f);
  const size_t n = out_elems(&p);
  float *out = (float *)malloc(n * sizeof(float));
  float *keep = (float *)malloc(n * sizeof(float));
  assert_non_null(out);
  assert_non_null(keep);
  size_t ws_bytes = 0;
  assert_int_equal(akv_attention_workspace_bytes(2, 8, 64, 40, 16, &ws_bytes), AKV_OK);
  void *ws = malloc(ws_bytes);
  assert_non_null(ws);

  akv_attention_args good;
  memset(&good, 0, sizeof good);
  good.dtype = AKV_DTYPE_BF16;
  good.n_contexts = 2;
  good.n_heads = 8;
  good.kv_heads = 2;
  good.head_dim = 64;
  good.chunk_tokens = 16;
  good.scale = 0.125f;
  good.q = p.q;
  good.k_base = p.base;
  good.v_base = p.base + p.v_offset;
  good.context_stride = p.context_stride;
  good.row_bytes = p.row_bytes;
  good.len = p.len;
  good.out = out;
  good.workspace = ws;
  good.workspace_bytes = ws_bytes;

  poison_f32(out, n);
  memcpy(keep, out, n * sizeof(float));
  akv_attention_args a;
#define EXPECT_BAD(mutation, status)                      \
  do {                                                    \
    a = good;                                             \
    mutation;                                             \
    assert_int_equal(akv_attention_ref_bf16(&a), status); \
    assert_memory_equal(out, keep, n * sizeof(float));    \
  } while (0)
  assert_int_equal(akv_attention_ref_bf16(NULL), AKV_ERR_INVALID_ARGUMENT);
  EXPECT_BAD(a.q = NULL, AKV_ERR_INVALID_ARGUMENT);
  EXPECT_BAD(a.k_base = NULL, AKV_ERR_INVALID_ARGUMENT);
  EXPECT_BAD(a.v_base = NULL, AKV_ERR_INVALID_ARGUMENT);
  EXPECT_BAD(a.len = NULL, AKV_ERR_INVALID_ARGUMENT);
  EXPECT_BAD(a.workspace = NULL, AKV_ERR_INVALID_ARGUMENT);
  EXPECT_BAD(a.workspace_bytes = ws_bytes - 1, AKV_ERR_INVALID_ARGUMENT);
  EXPECT_BAD(a.n_contexts = 0, AKV_ERR_INVALID_ARGUMENT);
  EXPECT_BAD(a.n_heads = 7, AKV_ERR_INVALID_ARGUMENT);
  EXPECT_BAD(a.kv_heads = 0, AKV_ERR_INVALID_ARGUMENT);
  EXPECT_BAD(a.head_dim = 0, AKV_ERR_INVALID_ARGUMENT);
  EXPECT_BAD(a.head_dim = 257, AKV_ERR_INVALID_ARGUMENT);
  EXPECT_BAD(a.chunk_tokens = 0, AKV_ERR_INVALID_ARGUMENT);
  EXPECT_BAD(a.row_bytes = 2 * 64 * 2 - 2, AKV_ERR_INVALID_ARGUMENT);
  EXPECT_BAD(a.dtype = AKV_DTYPE_F16, AKV_ERR_NOT_SUPPORTED);
  /* A smaller chunk needs more partials than the workspace holds. */
  EXPECT_BAD(a.chunk_tokens = 8, AKV_ERR_INVALID_ARGUMENT);
#undef EXPECT_BAD
  assert_int_equal(akv_attention_ref_bf16(&good), AKV_OK);
  assert_memory_not_equal(out, keep, n * sizeof(float));

  /* Paged table checks. */
  attn_paged pg;
  paged_build(&pg, &p);
  size_t pws = 0;
  assert_int_equal(akv_attention_workspace_bytes(2, 8, 64, pg.t.max_pages * 16, 16, &pws), AKV_OK);
  void *pw = malloc(pws);
  assert_non_null(pw);
  akv_attention_paged_args pa;
  memset(&pa, 0, sizeof pa);
  pa.dtype = AKV_DTYPE_BF16;
  pa.n_heads = 8;
  pa.kv_heads = 2;
  pa.head_dim = 64;
  pa.scale = 0.125f;
  pa.q = p.q;
  pa.out = out;
  pa.workspace = pw;
  pa.workspace_bytes = pws;
  poison_f32(out, n);
  memcpy(keep, out, n * sizeof(float));
  akv_page_table t;
#define EXPECT_BAD_TABLE(mutation, status)                          \
  do {                                                              \
    t = pg.t;                                                       \
    mutation;                                                       \
    assert_int_equal(akv_attention_paged_ref_bf16(&pa, t), status); \
    assert_memory_equal(out, keep, n * sizeof(float));              \
  } while (0)
  EXPECT_BAD_TABLE(t.max_pages = pg.t.max_pages - 1, AKV_ERR_INVALID_ARGUMENT);
  EXPECT_BAD_TABLE(t.page_tokens = 0, AKV_ERR_INVALID_ARGUMENT);
  EXPECT_BAD_TABLE(t.indptr = NULL, AKV_ERR_INVALID_ARGUMENT);
  EXPECT_BAD_TABLE(t.indices = NULL, AKV_ERR_INVALID_ARGUMENT);
  EXPECT_BAD_TABLE(t.k_pages = NULL, AKV_ERR_INVALID_ARGUMENT);
  EXPECT_BAD_TABLE(t.batch = 0, AKV_ERR_INVALID_ARGUMENT);
  EXPECT_BAD_TABLE(t.row_bytes = 8, AKV_ERR_INVALID_ARGUMENT);
  {
    uint32_t bad_last[2] = {pg.last[0], 17};
    EXPECT_BAD_TABLE(t.last_page_len = bad_last, AKV_ERR_INVALID_ARGUMENT);
    bad_last[1] = 0;
    EXPECT_BAD_TABLE(t.last_page_len = bad_last, AKV_ERR_INVALID_ARGUMENT);
    uint32_t bad_indptr[3] = {0, 3, 2};
    EXPECT_BAD_TABLE(t.indptr = bad_indptr, AKV_ERR_INVALID_ARGUMENT);
    uint32_t bad_start[3] = {1, 3, 4};
    EXPECT_BAD_TABLE(t.indptr = bad_start, AKV_ERR_INVALID_ARGUMENT);
  }
#undef EXPECT_BAD_TABLE
  pa.workspace_bytes = pws - 1;
  assert_int_equal(akv_attention_paged_ref_bf16(&pa, pg.t), AKV_ERR_INVALID_ARGUMENT);
  pa.workspace_bytes = pws;
  pa.dtype = AKV_DTYPE_F32;
  assert_int_equal(akv_attention_paged_ref_bf16(&pa, pg.t), AKV_ERR_NOT_SUPPORTED);
  pa.dtype = AKV_DTYPE_BF16;
  assert_memory_equal(out, keep, n * sizeof(float));
  assert_int_equal(akv_attention_paged_ref_bf16(NULL, pg.t), AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_attention_paged_ref_bf16(&pa, pg.t), AKV_OK);

  free(pw);
  attn_paged_free(&pg);
  free(ws);
  free(out);
  free(keep);
  problem_free(&p);
}

/* With pieces (a build with -DAKV_ATTN_PIECE_TOKENS=128) chunks of 256 rows
 * are cut into two pieces of 128 (attention_pieces.h), chunks of 384 into
 * three, chunks of 300 into two of 150; the library's build keeps each chunk
 * whole. Either way lengths on either side of every chunk and piece boundary
 * match float64, and paged == contiguous bit for bit. */
static void test_pieces(void **state) {
  (void)state;
  const uint32_t len[9] = {127, 128, 129, 255, 256, 257, 383, 385, 700};
  check_problem(9, 16, 4, 64, 256, len, 2.0f);
  check_problem(9, 8, 2, 128, 384, len, 1.0f);
  check_problem(9, 8, 8, 64, 300, len, 1.0f);
  check_problem_dt(AKV_DTYPE_FP8_E4M3, 9, 16, 4, 64, 256, len, 2.0f);
}

/* FP8 (E4M3 and E5M2) with per-head K and V scales against float64 (tolerance
 * REL_L2_TOL, the bf16 bound), paged == contiguous bit for bit: lengths
 * around the chunk and the pieces, GQA groups 1 to 16, head_dim 64 to 256,
 * softmax mild and sharp. */
static void test_fp8_matches_float64(void **state) {
  (void)state;
  const akv_dtype dts[2] = {AKV_DTYPE_FP8_E4M3, AKV_DTYPE_FP8_E5M2};
  const uint32_t len[6] = {300, 77, 1, 512, 0, 129};
  const uint32_t around[6] = {1, 15, 16, 17, 55, 80};
  for (int k = 0; k < 2; ++k) {
    const akv_dtype dt = dts[k];
    check_problem_dt(dt, 6, 32, 8, 128, 64, len, 1.0f);  /* llama geometry */
    check_problem_dt(dt, 6, 32, 8, 128, 256, len, 1.0f); /* two pieces per chunk */
    check_problem_dt(dt, 6, 8, 8, 64, 32, len, 1.0f);    /* MHA */
    check_problem_dt(dt, 6, 16, 1, 256, 100, len, 1.0f); /* MQA, head_dim 256 */
    check_problem_dt(dt, 6, 12, 4, 80, 48, len, 1.0f);   /* group 3, head_dim 80 */
    check_problem_dt(dt, 6, 32, 8, 128, 64, len, 6.0f);  /* sharper softmax */
    check_problem_dt(dt, 6, 8, 2, 64, 16, around, 1.0f); /* around the chunk */
  }
  print_message("worst relative L2 error against float64 (bf16 and FP8): %.3e (bound %.0e)\n",
                worst_err, REL_L2_TOL);
}

/* An FP8 call is a bf16 call over the decoded values: every E4M3 and E5M2
 * value is a bf16 value, so a bf16 history holding the decoded codes,
 * attended with the same scales (optional for bf16), gives the same bits.
 * The scales matter: other scales give other bits, and doubling every V
 * scale doubles the output exactly. */
static void test_fp8_is_bf16_of_decoded(void **state) {
  (void)state;
  const akv_dtype dts[2] = {AKV_DTYPE_FP8_E4M3, AKV_DTYPE_FP8_E5M2};
  const uint32_t len[3] = {200, 31, 513};
  for (int k = 0; k < 2; ++k) {
    problem f, b;
    problem_init_dt(&f, dts[k], 3, 16, 4, 64, 64, len, 1.0f);
    problem_init(&b, 3, 16, 4, 64, 64, len, 1.0f);
    memcpy(b.q, f.q, (size_t)3 * 16 * 64 * 2);
    for (uint32_t i = 0; i < 3; ++i)
      for (uint32_t t = 0; t < len[i]; ++t)
        for (int kv = 0; kv < 2; ++kv) {
          const char *src = f.base + i * f.context_stride + t * f.row_bytes + kv * f.v_offset;
          uint16_t *dst =
              (uint16_t *)(b.base + i * b.context_stride + t * b.row_bytes + kv * b.v_offset);
          for (size_t j = 0; j < (size_t)4 * 64; ++j)
            dst[j] = f32_to_bf16((float)elem_to_f64(src, j, dts[k])); /* exact */
        }
    b.scaled = 1;
    memcpy(b.k_scale, f.k_scale, sizeof b.k_scale);
    memcpy(b.v_scale, f.v_scale, sizeof b.v_scale);
    const size_t n = out_elems(&f);
    float *of = (float *)malloc(n * sizeof(float)), *ob = (float *)malloc(n * sizeof(float));
    assert_non_null(of);
    assert_non_null(ob);
    poison_f32(of, n);
    poison_f32(ob, n);
    assert_int_equal(run_contig(&f, of), AKV_OK);
    assert_int_equal(run_contig(&b, ob), AKV_OK);
    assert_memory_equal(of, ob, n * sizeof(float));
    /* bf16 with unit scales passed equals bf16 without scales */
    b.scaled = 0;
    assert_int_equal(run_contig(&b, ob), AKV_OK);
    b.scaled = 1;
    for (uint32_t g = 0; g < 4; ++g) b.k_scale[g] = b.v_scale[g] = 1.0f;
    assert_int_equal(run_contig(&b, of), AKV_OK);
    assert_memory_equal(of, ob, n * sizeof(float));
    /* V scales doubled: the output doubles, exactly */
    assert_int_equal(run_contig(&f, of), AKV_OK);
    for (uint32_t g = 0; g < 4; ++g) f.v_scale[g] *= 2.0f;
    assert_int_equal(run_contig(&f, ob), AKV_OK);
    for (size_t e = 0; e < n; ++e) assert_true(ob[e] == 2.0f * of[e]);
    /* another K scale of one head changes that head's outputs only */
    f.k_scale[1] *= 1.5f;
    assert_int_equal(run_contig(&f, of), AKV_OK);
    const size_t per_kv = (size_t)4 * 64; /* 4 query heads per kv head */
    assert_memory_equal(of, ob, per_kv * sizeof(float));
    assert_memory_not_equal(of + per_kv, ob + per_kv, per_kv * sizeof(float));
    assert_memory_equal(of + 2 * per_kv, ob + 2 * per_kv, 2 * per_kv * sizeof(float));
    free(of);
    free(ob);
    problem_free(&f);
    problem_free(&b);
  }
}

/* FP8 argument checks: scales required and sane, rows of one byte per
 * element, every refusal leaves the output untouched. */
static void test_fp8_invalid_arguments(void **state) {
  (void)state;
  const uint32_t len[2] = {40, 17};
  problem p;
  problem_init_dt(&p, AKV_DTYPE_FP8_E4M3, 2, 8, 2, 64, 16, len, 1.0f);
  const size_t n = out_elems(&p);
  float *out = (float *)malloc(n * sizeof(float));
  float *keep = (float *)malloc(n * sizeof(float));
  assert_non_null(out);
  assert_non_null(keep);
  size_t ws_bytes = 0;
  assert_int_equal(akv_attention_workspace_bytes(2, 8, 64, 40, 16, &ws_bytes), AKV_OK);
  void *ws = malloc(ws_bytes);
  assert_non_null(ws);
  static float many[AKV_ATTENTION_MAX_SCALE_HEADS + 1];
  for (uint32_t g = 0; g <= AKV_ATTENTION_MAX_SCALE_HEADS; ++g) many[g] = 0.5f;
  const float zero[2] = {0.1f, 0.0f}, neg[2] = {-0.1f, 0.1f}, inf[2] = {0.1f, INFINITY},
              nan2[2] = {NAN, 0.1f};

  akv_attention_args good;
  memset(&good, 0, sizeof good);
  good.dtype = AKV_DTYPE_FP8_E4M3;
  good.n_contexts = 2;
  good.n_heads = 8;
  good.kv_heads = 2;
  good.head_dim = 64;
  good.chunk_tokens = 16;
  good.scale = 0.125f;
  good.q = p.q;
  good.k_base = p.base;
  good.v_base = p.base + p.v_offset;
  good.context_stride = p.context_stride;
  good.row_bytes = p.row_bytes;
  good.len = p.len;
  good.out = out;
  good.workspace = ws;
  good.workspace_bytes = ws_bytes;
  good.k_scale = p.k_scale;
  good.v_scale = p.v_scale;

  poison_f32(out, n);
  memcpy(keep, out, n * sizeof(float));
  akv_attention_args a;
#define EXPECT_BAD(mutation, status)                      \
  do {                                                    \
    a = good;                                             \
    mutation;                                             \
    assert_int_equal(akv_attention_ref_bf16(&a), status); \
    assert_memory_equal(out, keep, n * sizeof(float));    \
  } while (0)
  EXPECT_BAD((a.k_scale = NULL, a.v_scale = NULL), AKV_ERR_INVALID_ARGUMENT);
  EXPECT_BAD(a.k_scale = NULL, AKV_ERR_INVALID_ARGUMENT);
  EXPECT_BAD(a.v_scale = NULL, AKV_ERR_INVALID_ARGUMENT);
  EXPECT_BAD(a.k_scale = zero, AKV_ERR_INVALID_ARGUMENT);
  EXPECT_BAD(a.v_scale = neg, AKV_ERR_INVALID_ARGUMENT);
  EXPECT_BAD(a.v_scale = inf, AKV_ERR_INVALID_ARGUMENT);
  EXPECT_BAD(a.k_scale = nan2, AKV_ERR_INVALID_ARGUMENT);
  /* rows of one byte per element: 2 kv heads x 64 dims = 128 bytes at least */
  EXPECT_BAD(a.row_bytes = 2 * 64 - 1, AKV_ERR_INVALID_ARGUMENT);
  EXPECT_BAD(a.dtype = AKV_DTYPE_F32, AKV_ERR_NOT_SUPPORTED);
  EXPECT_BAD(a.dtype = (akv_dtype)5, AKV_ERR_NOT_SUPPORTED);
  /* bf16 rows are twice as long as these FP8 rows allow */
  EXPECT_BAD((a.dtype = AKV_DTYPE_BF16, a.row_bytes = 2 * 64 * 2 - 2), AKV_ERR_INVALID_ARGUMENT);
  /* bf16 with a single scale array is refused as well */
  EXPECT_BAD((a.dtype = AKV_DTYPE_BF16, a.row_bytes = 2 * 64 * 2, a.v_scale = NULL),
             AKV_ERR_INVALID_ARGUMENT);
#undef EXPECT_BAD
  /* more kv heads than scales can travel with: refused (MQA-like geometry,
   * n_heads == kv_heads, rows long enough) */
  {
    const uint32_t kvh = AKV_ATTENTION_MAX_SCALE_HEADS + 1, one[1] = {1};
    const size_t row = (size_t)kvh * 64;
    char *rows = (char *)calloc(2, row);
    uint16_t *q = (uint16_t *)calloc((size_t)kvh * 64, 2);
    float *o = (float *)malloc((size_t)kvh * 64 * sizeof(float));
    size_t wb = 0;
    assert_int_equal(akv_attention_workspace_bytes(1, kvh, 64, 1, 16, &wb), AKV_OK);
    void *w = malloc(wb);
    assert_true(rows && q && o && w);
    a = good;
    a.n_contexts = 1;
    a.n_heads = a.kv_heads = kvh;
    a.q = q;
    a.k_base = rows;
    a.v_base = rows + row;
    a.row_bytes = row;
    a.context_stride = 2 * row;
    a.len = one;
    a.out = o;
    a.workspace = w;
    a.workspace_bytes = wb;
    a.k_scale = a.v_scale = many;
    poison_f32(o, (size_t)kvh * 64);
    assert_int_equal(akv_attention_ref_bf16(&a), AKV_ERR_INVALID_ARGUMENT);
    assert_true(isnan(o[0]));
    a.n_heads = a.kv_heads = kvh - 1; /* 256 kv heads: taken */
    assert_int_equal(akv_attention_ref_bf16(&a), AKV_OK);
    assert_true(o[0] == 0.0f); /* zero codes: zero values */
    free(rows);
    free(q);
    free(o);
    free(w);
  }
  assert_int_equal(akv_attention_ref_bf16(&good), AKV_OK);
  assert_memory_not_equal(out, keep, n * sizeof(float));

  /* The paged variant takes the same scales and refuses the same way. */
  attn_paged pg;
  paged_build(&pg, &p);
  size_t pws = 0;
  assert_int_equal(akv_attention_workspace_bytes(2, 8, 64, pg.t.max_pages * 16, 16, &pws), AKV_OK);
  void *pw = malloc(pws);
  assert_non_null(pw);
  akv_attention_paged_args pa;
  memset(&pa, 0, sizeof pa);
  pa.dtype = AKV_DTYPE_FP8_E4M3;
  pa.n_heads = 8;
  pa.kv_heads = 2;
  pa.head_dim = 64;
  pa.scale = 0.125f;
  pa.q = p.q;
  pa.out = out;
  pa.workspace = pw;
  pa.workspace_bytes = pws;
  poison_f32(out, n);
  memcpy(keep, out, n * sizeof(float));
  assert_int_equal(akv_attention_paged_ref_bf16(&pa, pg.t), AKV_ERR_INVALID_ARGUMENT);
  pa.k_scale = p.k_scale;
  assert_int_equal(akv_attention_paged_ref_bf16(&pa, pg.t), AKV_ERR_INVALID_ARGUMENT);
  pa.v_scale = zero;
  assert_int_equal(akv_attention_paged_ref_bf16(&pa, pg.t), AKV_ERR_INVALID_ARGUMENT);
  assert_memory_equal(out, keep, n * sizeof(float));
  pa.v_scale = p.v_scale;
  assert_int_equal(akv_attention_paged_ref_bf16(&pa, pg.t), AKV_OK);
  assert_memory_not_equal(out, keep, n * sizeof(float));

  free(pw);
  attn_paged_free(&pg);
  free(ws);
  free(out);
  free(keep);
  problem_free(&p);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_workspace_bytes),
      cmocka_unit_test(test_pieces),
      cmocka_unit_test(test_fp8_matches_float64),
      cmocka_unit_test(test_fp8_is_bf16_of_decoded),
      cmocka_unit_test(test_fp8_invalid_arguments),
      cmocka_unit_test(test_matches_float64),
      cmocka_unit_test(test_lengths_around_chunk),
      cmocka_unit_test(test_gqa_groups),
      cmocka_unit_test(test_zero_length_gives_zeros),
      cmocka_unit_test(test_deterministic),
      cmocka_unit_test(test_page_overrides_same_bits),
      cmocka_unit_test(test_checker_has_teeth),
      cmocka_unit_test(test_invalid_arguments),
  };
  return cmocka_run_group_tests_name("attention_ref", tests, NULL, NULL);
}
