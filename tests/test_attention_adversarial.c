/*
 * test_attention_adversarial.c - hostile arguments against the reference
 * attention (akv_attention.h): misaligned pointers, strides and page ids
 * whose byte offsets overflow 64 bits, non-finite softmax scales, views that
 * no engine made, sizes that overflow. Every refused call returns
 * AKV_ERR_INVALID_ARGUMENT and leaves the output (and the argument struct of
 * akv_attention_args_from_view) untouched.
 *
 * Every overflow case is built so that, without the check, the wrapped
 * offsets land on readable memory: the call would return AKV_OK over the
 * wrong rows instead of crashing.
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

#define N_HEADS 4u
#define KV_HEADS 2u
#define HEAD_DIM 8u
#define MAX_CTX 3u
#define MAX_ROWS 8u
#define ROW_BYTES ((uint64_t)KV_HEADS * HEAD_DIM * 2u)
#define OUT_FLOATS (MAX_CTX * N_HEADS * HEAD_DIM)

/* Buffers of one call, aligned for every element type (the misaligned cases
 * offset from these). */
typedef struct fixture {
  _Alignas(64) uint16_t q[MAX_CTX * N_HEADS * HEAD_DIM + 8];
  _Alignas(64) uint16_t kv[2][MAX_CTX * MAX_ROWS * KV_HEADS * HEAD_DIM];
  _Alignas(64) float out[OUT_FLOATS + 8];
  _Alignas(64) float keep[OUT_FLOATS + 8];
  _Alignas(64) unsigned char ws[1 << 16];
  uint32_t len[MAX_CTX];
} fixture;

static uint16_t f32_to_bf16(float f) {
  uint32_t b;
  memcpy(&b, &f, sizeof b);
  return (uint16_t)(b >> 16); /* the values below are exact in bf16 */
}

static fixture *fixture_new(void) {
  fixture *f = (fixture *)calloc(1, sizeof *f);
  assert_non_null(f);
  for (size_t i = 0; i < sizeof f->q / sizeof f->q[0]; ++i)
    f->q[i] = f32_to_bf16((float)((int)(i % 7) - 3) * 0.25f);
  for (int s = 0; s < 2; ++s)
    for (size_t i = 0; i < sizeof f->kv[s] / sizeof f->kv[s][0]; ++i)
      f->kv[s][i] = f32_to_bf16((float)((int)((i * (3 + s)) % 11) - 5) * 0.125f);
  for (size_t i = 0; i < sizeof f->out / sizeof f->out[0]; ++i) f->out[i] = -12345.0f;
  memcpy(f->keep, f->out, sizeof f->out);
  return f;
}

/* A one-context page table over the fixture's rows: two pages of
 * page_tokens rows at page_stride, the last holding last[0] rows. */
static akv_page_table one_ctx_table(fixture *f, uint32_t page_tokens, const uint32_t *indptr,
                                    const uint32_t *indices, const uint32_t *last,
                                    uint64_t page_stride) {
  akv_page_table t;
  memset(&t, 0, sizeof t);
  t.batch = 1;
  t.page_tokens = page_tokens;
  t.max_pages = 2;
  t.indptr = indptr;
  t.indices = indices;
  t.last_page_len = last;
  t.k_pages = f->kv[0];
  t.v_pages = f->kv[1];
  t.page_stride = page_stride;
  t.row_bytes = ROW_BYTES;
  return t;
}

/* Valid paged arguments over the fixture (the table is passed apart). */
static akv_attention_paged_args paged_args(fixture *f) {
  akv_attention_paged_args pa;
  memset(&pa, 0, sizeof pa);
  pa.dtype = AKV_DTYPE_BF16;
  pa.n_heads = N_HEADS;
  pa.kv_heads = KV_HEADS;
  pa.head_dim = HEAD_DIM;
  pa.scale = 0.35f;
  pa.q = f->q;
  pa.out = f->out;
  pa.workspace = f->ws;
  pa.workspace_bytes = sizeof f->ws;
  return pa;
}

/* A valid contiguous call over n_ctx contexts of MAX_ROWS rows each. */
static akv_attention_args contig_args(fixture *f, uint32_t n_ctx, uint32_t chunk) {
  akv_attention_args a;
  memset(&a, 0, sizeof a);
  a.dtype = AKV_DTYPE_BF16;
  a.n_contexts = n_ctx;
  a.n_heads = N_HEADS;
  a.kv_heads = KV_HEADS;
  a.head_dim = HEAD_DIM;
  a.chunk_tokens = chunk;
  a.scale = 0.35f;
  a.q = f->q;
  a.k_base = f->kv[0];
  a.v_base = f->kv[1];
  a.context_stride = MAX_ROWS * ROW_BYTES;
  a.row_bytes = ROW_BYTES;
  for (uint32_t i = 0; i < MAX_CTX; ++i) f->len[i] = MAX_ROWS - i;
  a.len = f->len;
  a.out = f->out;
  a.workspace = f->ws;
  a.workspace_bytes = sizeof f->ws;
  return a;
}

static void assert_out_untouched(const fixture *f) {
  assert_memory_equal(f->out, f->keep, sizeof f->out);
}

/* The reference reads q as bf16 and writes out and the workspace as fp32:
 * pointers not aligned for those types are refused, not dereferenced. */
static void test_misaligned_pointers_refused(void **state) {
  (void)state;
  fixture *f = fixture_new();
  akv_attention_args a = contig_args(f, 2, 4);
  assert_int_equal(akv_attention_ref_bf16(&a), AKV_OK); /* the baseline is accepted */
  memcpy(f->keep, f->out, sizeof f->out);

  a = contig_args(f, 2, 4);
  a.q = (const char *)f->q + 1;
  assert_int_equal(akv_attention_ref_bf16(&a), AKV_ERR_INVALID_ARGUMENT);
  assert_out_untouched(f);

  a = contig_args(f, 2, 4);
  a.workspace = f->ws + 2;
  a.workspace_bytes = sizeof f->ws - 2;
  assert_int_equal(akv_attention_ref_bf16(&a), AKV_ERR_INVALID_ARGUMENT);
  assert_out_untouched(f);

  a = contig_args(f, 2, 4);
  a.out = (float *)(void *)((char *)f->out + 2);
  assert_int_equal(akv_attention_ref_bf16(&a), AKV_ERR_INVALID_ARGUMENT);
  assert_out_untouched(f);

  /* The paged variant shares the checks. */
  const uint32_t indptr[2] = {0, 2}, indices[2] = {0, 1}, last[1] = {3};
  const akv_page_table t = one_ctx_table(f, 4, indptr, indices, last, 4 * ROW_BYTES);
  akv_attention_paged_args pa = paged_args(f);
  pa.q = (const char *)f->q + 1;
  assert_int_equal(akv_attention_paged_ref_bf16(&pa, t), AKV_ERR_INVALID_ARGUMENT);
  pa.q = f->q;
  pa.workspace = f->ws + 1;
  pa.workspace_bytes = sizeof f->ws - 1;
  assert_int_equal(akv_attention_paged_ref_bf16(&pa, t), AKV_ERR_INVALID_ARGUMENT);
  pa.workspace = f->ws;
  pa.workspace_bytes = sizeof f->ws;
  pa.out = (float *)(void *)((char *)f->out + 1);
  assert_int_equal(akv_attention_paged_ref_bf16(&pa, t), AKV_ERR_INVALID_ARGUMENT);
  assert_out_untouched(f);
  pa.out = f->out;
  assert_int_equal(akv_attention_paged_ref_bf16(&pa, t), AKV_OK);
  free(f);
}

/* context_stride 2^63: context 2 would start at 2 * 2^63 = 0 mod 2^64, i.e.
 * on context 0's rows (context 1 is empty, so nothing reads at 2^63). */
static void test_context_stride_overflow_refused(void **state) {
  (void)state;
  fixture *f = fixture_new();
  akv_attention_args a = contig_args(f, 3, 4);
  f->len[0] = 2;
  f->len[1] = 0;
  f->len[2] = 2;
  a.context_stride = UINT64_C(1) << 63;
  assert_int_equal(akv_attention_ref_bf16(&a), AKV_ERR_INVALID_ARGUMENT);
  assert_out_untouched(f);
  /* The same call with context 2 empty touches no wrapped offset. */
  f->len[2] = 0;
  assert_int_equal(akv_attention_ref_bf16(&a), AKV_OK);
  free(f);
}

/* row_bytes 2^63 with chunks of one row: row 2 would be read at offset
 * 2 * 2^63 = 0, row 1 comes from a page override. */
static void test_row_offset_overflow_refused(void **state) {
  (void)state;
  fixture *f = fixture_new();
  akv_attention_args a = contig_args(f, 1, 1);
  const uint32_t map[3] = {AKV_PAGE_STAGED, 0, AKV_PAGE_STAGED};
  f->len[0] = 3;
  a.row_bytes = UINT64_C(1) << 63;
  a.page_map = map;
  a.page_map_stride = 3;
  a.k_pages = f->kv[0];
  a.v_pages = f->kv[1];
  a.page_stride = ROW_BYTES;
  assert_int_equal(akv_attention_ref_bf16(&a), AKV_ERR_INVALID_ARGUMENT);
  assert_out_untouched(f);
  /* Rows 0 and 1 at row_bytes 2^62: offsets fit, row 1 comes from the
   * page (nothing is read at 2^62). */
  f->len[0] = 2;
  a.row_bytes = UINT64_C(1) << 62;
  assert_int_equal(akv_attention_ref_bf16(&a), AKV_OK);
  free(f);
}

/* A page override whose entry * page_stride wraps 64 bits. */
static void test_page_map_offset_overflow_refused(void **state) {
  (void)state;
  fixture *f = fixture_new();
  akv_attention_args a = contig_args(f, 1, 2);
  const uint32_t map[2] = {0, 2};
  f->len[0] = 4;
  a.page_map = map;
  a.page_map_stride = 2;
  a.k_pages = f->kv[0];
  a.v_pages = f->kv[1];
  a.page_stride = UINT64_C(1) << 63;
  assert_int_equal(akv_attention_ref_bf16(&a), AKV_ERR_INVALID_ARGUMENT);
  assert_out_untouched(f);
  free(f);
}

/* Paged: page id 2 at page_stride 2^63 would be read at offset 0. */
static void test_paged_page_offset_overflow_refused(void **state) {
  (void)state;
  fixture *f = fixture_new();
  const uint32_t indptr[2] = {0, 2}, indices[2] = {0, 2}, last[1] = {2};
  akv_page_table t = one_ctx_table(f, 2, indptr, indices, last, UINT64_C(1) << 63);
  const akv_attention_paged_args pa = paged_args(f);
  assert_int_equal(akv_attention_paged_ref_bf16(&pa, t), AKV_ERR_INVALID_ARGUMENT);
  assert_out_untouched(f);
  /* The same table with page ids 0 and 0 is fine. */
  const uint32_t same[2] = {0, 0};
  t.indices = same;
  assert_int_equal(akv_attention_paged_ref_bf16(&pa, t), AKV_OK);
  free(f);
}

/* The softmax scale must be finite: +inf gives NaN outputs and -inf gives
 * zeros for a non-empty history, neither an attention. */
static void test_nonfinite_softmax_scale_refused(void **state) {
  (void)state;
  fixture *f = fixture_new();
  const float bad[3] = {INFINITY, -INFINITY, NAN};
  for (int i = 0; i < 3; ++i) {
    akv_attention_args a = contig_args(f, 2, 4);
    a.scale = bad[i];
    assert_int_equal(akv_attention_ref_bf16(&a), AKV_ERR_INVALID_ARGUMENT);
    assert_out_untouched(f);
  }
  /* Zero and negative finite scales are attentions (uniform, reversed). */
  akv_attention_args a = contig_args(f, 2, 4);
  a.scale = 0.0f;
  assert_int_equal(akv_attention_ref_bf16(&a), AKV_OK);
  a.scale = -0.5f;
  assert_int_equal(akv_attention_ref_bf16(&a), AKV_OK);
  free(f);
}

/* FP8 scales: the header asks for finite positive floats; subnormal ones are
 * finite and positive and are taken. */
static void test_fp8_scale_edges(void **state) {
  (void)state;
  fixture *f = fixture_new();
  float ks[KV_HEADS], vs[KV_HEADS];
  const float bad[5] = {0.0f, -0.0f, -1.0f, NAN, INFINITY};
  for (int i = 0; i < 5; ++i) {
    for (uint32_t g = 0; g < KV_HEADS; ++g) ks[g] = vs[g] = 1.0f;
    akv_attention_args a = contig_args(f, 2, 4);
    a.dtype = AKV_DTYPE_FP8_E4M3;
    a.k_scale = ks;
    a.v_scale = vs;
    ks[KV_HEADS - 1] = bad[i];
    assert_int_equal(akv_attention_ref_bf16(&a), AKV_ERR_INVALID_ARGUMENT);
    ks[KV_HEADS - 1] = 1.0f;
    vs[KV_HEADS - 1] = bad[i];
    assert_int_equal(akv_attention_ref_bf16(&a), AKV_ERR_INVALID_ARGUMENT);
    assert_out_untouched(f);
  }
  for (uint32_t g = 0; g < KV_HEADS; ++g) ks[g] = vs[g] = 0x1p-140f; /* subnormal */
  akv_attention_args a = contig_args(f, 2, 4);
  a.dtype = AKV_DTYPE_FP8_E5M2;
  a.k_scale = ks;
  a.v_scale = vs;
  assert_int_equal(akv_attention_ref_bf16(&a), AKV_OK);
  for (uint32_t i = 0; i < 2 * N_HEADS * HEAD_DIM; ++i) assert_true(isfinite(f->out[i]));
  free(f);
}

/* A view no engine made: zeroed, or with NULL bases that v_offset would
 * move off NULL. Refused, and *args keeps every field. */
static void test_args_from_bogus_view(void **state) {
  (void)state;
  fixture *f = fixture_new();
  akv_attention_args a = contig_args(f, 2, 4), before = a;
  akv_view v;
  memset(&v, 0, sizeof v);
  assert_int_equal(akv_attention_args_from_view(&v, &a), AKV_ERR_INVALID_ARGUMENT);
  assert_memory_equal(&a, &before, sizeof a);

  v.n_contexts = 2;
  v.kv_heads = KV_HEADS;
  v.head_dim = HEAD_DIM;
  v.dtype = AKV_DTYPE_BF16;
  v.row_stride = 2 * ROW_BYTES;
  v.context_stride = 2 * MAX_ROWS * ROW_BYTES;
  v.v_offset = ROW_BYTES;
  v.len = f->len;
  assert_int_equal(akv_attention_args_from_view(&v, &a), AKV_ERR_INVALID_ARGUMENT);
  assert_memory_equal(&a, &before, sizeof a);

  /* A paged view without its pages, or without a page size. */
  const uint32_t map[2] = {AKV_PAGE_STAGED, AKV_PAGE_STAGED};
  v.base = f->kv[0];
  v.page_map = map;
  v.page_map_stride = 1;
  v.page_tokens = 4;
  v.page_stride = 4 * 2 * ROW_BYTES;
  assert_int_equal(akv_attention_args_from_view(&v, &a), AKV_ERR_INVALID_ARGUMENT);
  assert_memory_equal(&a, &before, sizeof a);
  v.pages = f->kv[1];
  v.page_tokens = 0;
  assert_int_equal(akv_attention_args_from_view(&v, &a), AKV_ERR_INVALID_ARGUMENT);
  assert_memory_equal(&a, &before, sizeof a);

  /* A whole view converts. */
  v.page_tokens = 4;
  assert_int_equal(akv_attention_args_from_view(&v, &a), AKV_OK);
  assert_ptr_equal(a.k_base, f->kv[0]);
  assert_ptr_equal(a.v_base, (const char *)f->kv[0] + ROW_BYTES);
  assert_ptr_equal(a.v_pages, (const char *)f->kv[1] + ROW_BYTES);
  assert_int_equal(a.chunk_tokens, 4);
  free(f);
}

/* Sizes that overflow are refused; a size is never smaller than what the
 * call then checks, and one byte less is refused. */
static void test_workspace_bytes_hostile(void **state) {
  (void)state;
  size_t b = 12345;
  assert_int_equal(akv_attention_workspace_bytes(UINT32_MAX, UINT32_MAX, 256, UINT32_MAX, 1, &b),
                   AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_attention_workspace_bytes(UINT32_MAX, UINT32_MAX, 256, 1, 1, &b),
                   AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_attention_workspace_bytes(1, 1, 256, 1, 0, &b), AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_attention_workspace_bytes(1, 0, 256, 1, 1, &b), AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_attention_workspace_bytes(1, 1, 0, 1, 1, &b), AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(b, 12345); /* untouched on refusal */
  /* max_tokens 0: no partials, no bytes. */
  assert_int_equal(akv_attention_workspace_bytes(3, 4, 8, 0, 1, &b), AKV_OK);
  assert_int_equal(b, 0);

  /* One byte short of the figure is refused, the figure is accepted. */
  fixture *f = fixture_new();
  akv_attention_args a = contig_args(f, 3, 1);
  assert_int_equal(akv_attention_workspace_bytes(3, N_HEADS, HEAD_DIM, MAX_ROWS, 1, &b), AKV_OK);
  assert_true(b <= sizeof f->ws);
  a.workspace_bytes = b - 1;
  assert_int_equal(akv_attention_ref_bf16(&a), AKV_ERR_INVALID_ARGUMENT);
  assert_out_untouched(f);
  a.workspace_bytes = b;
  assert_int_equal(akv_attention_ref_bf16(&a), AKV_OK);
  free(f);
}

/* A finite softmax scale, or finite K scales, whose score factor
 * c_g = (scale * log2(e)) * k_scale[g] overflows fp32 makes every score
 * infinite or NaN, exactly as a non-finite scale does: refused too. */
static void test_score_factor_overflow_refused(void **state) {
  (void)state;
  fixture *f = fixture_new();
  const float huge[2] = {3e38f, -3e38f}; /* finite; times log2(e): +-inf */
  for (int i = 0; i < 2; ++i) {
    akv_attention_args a = contig_args(f, 2, 4);
    a.scale = huge[i];
    assert_int_equal(akv_attention_ref_bf16(&a), AKV_ERR_INVALID_ARGUMENT);
    assert_out_untouched(f);
    const uint32_t indptr[2] = {0, 2}, indices[2] = {0, 1}, last[1] = {3};
    const akv_page_table t = one_ctx_table(f, 4, indptr, indices, last, 4 * ROW_BYTES);
    akv_attention_paged_args pa = paged_args(f);
    pa.scale = huge[i];
    assert_int_equal(akv_attention_paged_ref_bf16(&pa, t), AKV_ERR_INVALID_ARGUMENT);
    assert_out_untouched(f);
  }
  /* FP8: each factor finite alone, their product not. */
  float ks[KV_HEADS], vs[KV_HEADS];
  for (uint32_t g = 0; g < KV_HEADS; ++g) ks[g] = vs[g] = 1.0f;
  ks[KV_HEADS - 1] = 1e30f;
  akv_attention_args a = contig_args(f, 2, 4);
  a.dtype = AKV_DTYPE_FP8_E4M3;
  a.k_scale = ks;
  a.v_scale = vs;
  a.scale = 1e10f;
  assert_int_equal(akv_attention_ref_bf16(&a), AKV_ERR_INVALID_ARGUMENT);
  assert_out_untouched(f);
  /* The same factors one step smaller are finite and taken. */
  a.scale = 1e8f;
  assert_int_equal(akv_attention_ref_bf16(&a), AKV_OK);
  a = contig_args(f, 2, 4);
  a.scale = 2e38f; /* times log2(e): 2.9e38, finite */
  assert_int_equal(akv_attention_ref_bf16(&a), AKV_OK);
  free(f);
}

/* The uint32 and float arrays of a call are read as such: one that is not
 * 4-byte aligned is refused, not dereferenced. */
static void test_misaligned_arrays_refused(void **state) {
  (void)state;
  fixture *f = fixture_new();
  _Alignas(16) unsigned char buf[4][64];
  memset(buf, 0, sizeof buf);
  /* Copies of valid arrays, 1 byte past a 16-byte boundary. */
#define MISALIGNED(i, src, bytes) \
  (memcpy(buf[i] + 1, (src), (bytes)), (const void *)(buf[i] + 1))

  akv_attention_args a = contig_args(f, 2, 4);
  a.len = (const uint32_t *)MISALIGNED(0, f->len, 2 * sizeof(uint32_t));
  assert_int_equal(akv_attention_ref_bf16(&a), AKV_ERR_INVALID_ARGUMENT);
  assert_out_untouched(f);

  const uint32_t map[2] = {AKV_PAGE_STAGED, 0};
  a = contig_args(f, 2, 4);
  a.page_map = (const uint32_t *)MISALIGNED(0, map, sizeof map);
  a.page_map_stride = 1;
  a.k_pages = f->kv[0];
  a.v_pages = f->kv[1];
  a.page_stride = 4 * ROW_BYTES;
  assert_int_equal(akv_attention_ref_bf16(&a), AKV_ERR_INVALID_ARGUMENT);
  assert_out_untouched(f);
  a.page_map = map; /* the aligned map is taken */
  assert_int_equal(akv_attention_ref_bf16(&a), AKV_OK);
  memcpy(f->keep, f->out, sizeof f->out);

  float ks[KV_HEADS], vs[KV_HEADS];
  for (uint32_t g = 0; g < KV_HEADS; ++g) ks[g] = vs[g] = 1.0f;
  a = contig_args(f, 2, 4);
  a.dtype = AKV_DTYPE_FP8_E4M3;
  a.k_scale = (const float *)MISALIGNED(1, ks, sizeof ks);
  a.v_scale = vs;
  assert_int_equal(akv_attention_ref_bf16(&a), AKV_ERR_INVALID_ARGUMENT);
  a.k_scale = ks;
  a.v_scale = (const float *)MISALIGNED(1, vs, sizeof vs);
  assert_int_equal(akv_attention_ref_bf16(&a), AKV_ERR_INVALID_ARGUMENT);
  assert_out_untouched(f);

  /* The page table's three arrays. */
  const uint32_t indptr[2] = {0, 2}, indices[2] = {0, 1}, last[1] = {3};
  const akv_attention_paged_args pa = paged_args(f);
  akv_page_table t = one_ctx_table(f, 4, indptr, indices, last, 4 * ROW_BYTES);
  t.indptr = (const uint32_t *)MISALIGNED(0, indptr, sizeof indptr);
  assert_int_equal(akv_attention_paged_ref_bf16(&pa, t), AKV_ERR_INVALID_ARGUMENT);
  t = one_ctx_table(f, 4, indptr, indices, last, 4 * ROW_BYTES);
  t.indices = (const uint32_t *)MISALIGNED(2, indices, sizeof indices);
  assert_int_equal(akv_attention_paged_ref_bf16(&pa, t), AKV_ERR_INVALID_ARGUMENT);
  t = one_ctx_table(f, 4, indptr, indices, last, 4 * ROW_BYTES);
  t.last_page_len = (const uint32_t *)MISALIGNED(3, last, sizeof last);
  assert_int_equal(akv_attention_paged_ref_bf16(&pa, t), AKV_ERR_INVALID_ARGUMENT);
  assert_out_untouched(f);
  t = one_ctx_table(f, 4, indptr, indices, last, 4 * ROW_BYTES);
  assert_int_equal(akv_attention_paged_ref_bf16(&pa, t), AKV_OK);
#undef MISALIGNED
  free(f);
}

/* A table without pages may leave indices NULL (akv_attention.h, "Empty
 * arrays"; the CUDA launcher takes it too, tests/test_cuda_args.c): every
 * context gets zeros, whatever max_pages says. With pages it is refused. */
static void test_paged_null_indices_without_pages(void **state) {
  (void)state;
  fixture *f = fixture_new();
  const uint32_t indptr[3] = {0, 0, 0}, last[2] = {0, 0};
  const akv_attention_paged_args pa = paged_args(f);
  akv_page_table t = one_ctx_table(f, 4, indptr, NULL, last, 4 * ROW_BYTES);
  t.batch = 2;
  assert_int_equal(akv_attention_paged_ref_bf16(&pa, t), AKV_OK);
  for (uint32_t i = 0; i < 2 * N_HEADS * HEAD_DIM; ++i) assert_true(f->out[i] == 0.0f);
  memcpy(f->keep, f->out, sizeof f->out);
  /* max_pages 0: a workspace of 0 bytes, NULL included, is enough. */
  akv_attention_paged_args pz = pa;
  pz.workspace = NULL;
  pz.workspace_bytes = 0;
  t.max_pages = 0;
  assert_int_equal(akv_attention_paged_ref_bf16(&pz, t), AKV_OK);
  /* max_pages 2 still sizes the workspace: 0 bytes are too few. */
  t.max_pages = 2;
  assert_int_equal(akv_attention_paged_ref_bf16(&pz, t), AKV_ERR_INVALID_ARGUMENT);
  /* Pages without indices: refused, the output untouched. */
  for (size_t i = 0; i < sizeof f->out / sizeof f->out[0]; ++i) f->out[i] = -12345.0f;
  memcpy(f->keep, f->out, sizeof f->out);
  const uint32_t some[3] = {0, 0, 1}, last1[2] = {0, 3};
  t = one_ctx_table(f, 4, some, NULL, last1, 4 * ROW_BYTES);
  t.batch = 2;
  assert_int_equal(akv_attention_paged_ref_bf16(&pa, t), AKV_ERR_INVALID_ARGUMENT);
  assert_out_untouched(f);
  free(f);
}

/* AKV_ATTENTION_MAX_CHUNK_TOKENS: the first row of a piece within a chunk is
 * a uint32_t (attention_pieces.h); a larger chunk is refused whatever the
 * lengths, before anything is read, and the largest one is taken. The
 * limit's two sides use contexts of 0 rows (a chunk that large would need a
 * workspace of gigabytes for any row) and a workspace of 0 bytes. */
static void test_chunk_tokens_limit(void **state) {
  (void)state;
  fixture *f = fixture_new();
  size_t b = 12345;
  assert_int_equal(
      akv_attention_workspace_bytes(3, N_HEADS, HEAD_DIM, 0, AKV_ATTENTION_MAX_CHUNK_TOKENS, &b),
      AKV_OK);
  assert_int_equal(b, 0);
  b = 12345;
  assert_int_equal(akv_attention_workspace_bytes(3, N_HEADS, HEAD_DIM, 0,
                                                 AKV_ATTENTION_MAX_CHUNK_TOKENS + 1u, &b),
                   AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_attention_workspace_bytes(3, N_HEADS, HEAD_DIM, 8, UINT32_MAX, &b),
                   AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(b, 12345);

  akv_attention_args a = contig_args(f, 3, AKV_ATTENTION_MAX_CHUNK_TOKENS + 1u);
  for (uint32_t i = 0; i < MAX_CTX; ++i) f->len[i] = 0;
  a.workspace = NULL;
  a.workspace_bytes = 0;
  assert_int_equal(akv_attention_ref_bf16(&a), AKV_ERR_INVALID_ARGUMENT);
  a.chunk_tokens = UINT32_MAX;
  assert_int_equal(akv_attention_ref_bf16(&a), AKV_ERR_INVALID_ARGUMENT);
  assert_out_untouched(f);
  /* A context of UINT32_MAX rows in one chunk of as many, over a K/V base
   * nothing may read: refused by the chunk size before any row. */
  f->len[0] = UINT32_MAX;
  a.k_base = (const void *)(uintptr_t)0x1000;
  a.v_base = (const void *)(uintptr_t)0x2000;
  a.row_bytes = ROW_BYTES;
  a.workspace = f->ws;
  a.workspace_bytes = SIZE_MAX;
  assert_int_equal(akv_attention_ref_bf16(&a), AKV_ERR_INVALID_ARGUMENT);
  assert_out_untouched(f);
  a = contig_args(f, 3, AKV_ATTENTION_MAX_CHUNK_TOKENS);
  for (uint32_t i = 0; i < MAX_CTX; ++i) f->len[i] = 0;
  a.workspace = NULL;
  a.workspace_bytes = 0;
  assert_int_equal(akv_attention_ref_bf16(&a), AKV_OK);
  for (uint32_t i = 0; i < OUT_FLOATS; ++i) assert_true(f->out[i] == 0.0f);
  for (size_t i = 0; i < sizeof f->out / sizeof f->out[0]; ++i) f->out[i] = -12345.0f;

  const uint32_t indptr[2] = {0, 0}, last[1] = {0};
  akv_attention_paged_args pa = paged_args(f);
  pa.workspace = NULL;
  pa.workspace_bytes = 0;
  akv_page_table t = one_ctx_table(f, AKV_ATTENTION_MAX_CHUNK_TOKENS + 1u, indptr, NULL, last,
                                   4 * ROW_BYTES);
  t.max_pages = 0;
  assert_int_equal(akv_attention_paged_ref_bf16(&pa, t), AKV_ERR_INVALID_ARGUMENT);
  t.page_tokens = UINT32_MAX;
  assert_int_equal(akv_attention_paged_ref_bf16(&pa, t), AKV_ERR_INVALID_ARGUMENT);
  assert_out_untouched(f);
  t.page_tokens = AKV_ATTENTION_MAX_CHUNK_TOKENS;
  assert_int_equal(akv_attention_paged_ref_bf16(&pa, t), AKV_OK);
  for (uint32_t i = 0; i < N_HEADS * HEAD_DIM; ++i) assert_true(f->out[i] == 0.0f);
  free(f);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_misaligned_pointers_refused),
      cmocka_unit_test(test_context_stride_overflow_refused),
      cmocka_unit_test(test_row_offset_overflow_refused),
      cmocka_unit_test(test_page_map_offset_overflow_refused),
      cmocka_unit_test(test_paged_page_offset_overflow_refused),
      cmocka_unit_test(test_nonfinite_softmax_scale_refused),
      cmocka_unit_test(test_fp8_scale_edges),
      cmocka_unit_test(test_args_from_bogus_view),
      cmocka_unit_test(test_workspace_bytes_hostile),
      cmocka_unit_test(test_score_factor_overflow_refused),
      cmocka_unit_test(test_misaligned_arrays_refused),
      cmocka_unit_test(test_paged_null_indices_without_pages),
      cmocka_unit_test(test_chunk_tokens_limit),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
