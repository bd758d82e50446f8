/*
 * test_gpu_attention.cu - the CUDA decode attention against the C reference.
 *
 * Bound: relative L2 error ||cuda - ref|| / ||ref|| <= 1e-5 per context.
 * Both sides compute in fp32 from bf16 inputs; they differ only in the order
 * of their sums (tiles with a running maximum and shuffle trees on the GPU,
 * two passes in row order on the CPU) and in exp2 (ex2.approx vs libm), so the
 * error is a few fp32 roundings (about 1e-6), far under the bound, while any
 * indexing mistake gives errors near 1.
 * FP8 (E4M3, E5M2) with per-head scales: the same bound against the C
 * reference, and the same bound against a float64 attention over the decoded
 * and scaled values (attn_naive_f64), so one GPU pass proves the FP8 kernels
 * without trusting the reference.
 * Also checked, with outputs poisoned (NaN) before every launch:
 *  - every output element is written;
 *  - CUDA paged == CUDA contiguous, bit for bit (page_tokens == chunk_tokens);
 *  - the same launch twice gives the same bits;
 *  - one context alone (one cooperative launch) gives the bits it gets in a
 *    batch too large for the device at once (two kernels);
 *  - argument checks refuse without enqueueing anything;
 *  - a page table that overflows max_pages marks only its context with NaN;
 *  - a launch captured in a CUDA graph gives the same bits on every replay,
 *    and one workspace serves calls of different lengths;
 *  - NaN q or K elements, FP8 NaN codes and overflowing scores give NaN in
 *    exactly the reference's places, and zeros (the reference's bytes)
 *    where every score is -inf or a context is empty;
 *  - workspace, out and q exactly adjacent in one allocation give the bits
 *    of separate buffers; overlapping ones are refused.
 * Exits 77 (ctest: skipped) when no CUDA device is usable.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* cmocka.h declares no C linkage for C++ callers itself. */
extern "C" {
#include <cmocka.h>
}
#include <math.h>

#include <cuda_runtime.h>

#include "akv_attention.h"
#include "akv_cuda.h"
#define ATTN_TEST_SEED 0x2545F4914F6CDD1Dull
#include "attn_testdata.h"

#define REL_L2_TOL 1e-5

static double worst_err = 0.0;

#define CUDA_OK(call)                                                                \
  do {                                                                               \
    const cudaError_t e_ = (call);                                                   \
    if (e_ != cudaSuccess) print_error("%s: %s\n", #call, cudaGetErrorString(e_)); \
    assert_int_equal(e_, cudaSuccess);                                               \
  } while (0)

/* ------------------------------------------------------------------ helpers */

static void *xmalloc(size_t n) {
  void *p = malloc(n ? n : 1);
  assert_non_null(p);
  return p;
}

/* One problem: host history in the akv_view layout, its device copy, q. */
typedef struct problem {
  akv_dtype dtype;
  float k_scale[64], v_scale[64]; /* FP8: per kv head; bf16: not passed */
  uint32_t n_ctx, n_heads, kv_heads, head_dim, chunk;
  uint32_t *len;
  uint32_t cap;
  uint64_t row_bytes, context_stride, v_offset;
  char *base;
  uint16_t *q;
  float scale;
  /* device */
  char *d_base;
  uint16_t *d_q;
} problem;

static void problem_init_dt(problem *p, akv_dtype dt, uint32_t n_ctx, uint32_t n_heads,
                            uint32_t kv_heads, uint32_t head_dim, uint32_t chunk,
                            const uint32_t *len, float amp) {
  memset(p, 0, sizeof *p);
  assert_true(kv_heads <= 64);
  p->dtype = dt;
  for (uint32_t g = 0; g < kv_heads; ++g) {
    p->k_scale[g] = 0.11f * (1.0f + 0.37f * (float)(g % 5u));
    p->v_scale[g] = 0.13f * (1.0f + 0.21f * (float)((g * 5u) % 7u));
  }
  p->n_ctx = n_ctx;
  p->n_heads = n_heads;
  p->kv_heads = kv_heads;
  p->head_dim = head_dim;
  p->chunk = chunk;
  p->len = (uint32_t *)xmalloc(n_ctx * sizeof(uint32_t));
  p->cap = 1;
  for (uint32_t i = 0; i < n_ctx; ++i) {
    p->len[i] = len[i];
    if (len[i] + 1 > p->cap) p->cap = len[i] + 1;
  }
  p->row_bytes = (uint64_t)kv_heads * head_dim * attn_elem_bytes(dt) + 32u;
  p->v_offset = p->cap * p->row_bytes + 64u;
  p->context_stride = 2u * p->v_offset;
  const size_t bytes = (size_t)n_ctx * p->context_stride;
  p->base = (char *)xmalloc(bytes);
  fill_nan_dt(p->base, bytes, dt);
  const size_t row_elems = (size_t)kv_heads * head_dim;
  for (uint32_t i = 0; i < n_ctx; ++i)
    for (uint32_t t = 0; t < len[i]; ++t) {
      char *k = p->base + i * p->context_stride + t * p->row_bytes;
      fill_random_dt(k, row_elems, dt, 1.0f);
      fill_random_dt(k + p->v_offset, row_elems, dt, 1.0f);
    }
  const size_t q_elems = (size_t)n_ctx * n_heads * head_dim;
  p->q = (uint16_t *)xmalloc(q_elems * 2u);
  fill_random16(p->q, q_elems, amp);
  p->scale = 1.0f / sqrtf((float)head_dim);
  CUDA_OK(cudaMalloc((void **)&p->d_base, bytes));
  CUDA_OK(cudaMemcpy(p->d_base, p->base, bytes, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMalloc((void **)&p->d_q, q_elems * 2u));
  CUDA_OK(cudaMemcpy(p->d_q, p->q, q_elems * 2u, cudaMemcpyHostToDevice));
}

static void problem_init(problem *p, uint32_t n_ctx, uint32_t n_heads, uint32_t kv_heads,
                         uint32_t head_dim, uint32_t chunk, const uint32_t *len, float amp) {
  problem_init_dt(p, AKV_DTYPE_BF16, n_ctx, n_heads, kv_heads, head_dim, chunk, len, amp);
}

static void problem_free(problem *p) {
  CUDA_OK(cudaFree(p->d_base));
  CUDA_OK(cudaFree(p->d_q));
  free(p->len);
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

/* Contiguous arguments; pointers host or device as asked. */
static akv_attention_args make_args(const problem *p, bool device, float *out, void *ws,
                                    size_t ws_bytes) {
  akv_attention_args a;
  memset(&a, 0, sizeof a);
  a.dtype = p->dtype;
  if (p->dtype != AKV_DTYPE_BF16) {
    a.k_scale = p->k_scale;
    a.v_scale = p->v_scale;
  }
  a.n_contexts = p->n_ctx;
  a.n_heads = p->n_heads;
  a.kv_heads = p->kv_heads;
  a.head_dim = p->head_dim;
  a.chunk_tokens = p->chunk;
  a.scale = p->scale;
  a.q = device ? (const void *)p->d_q : (const void *)p->q;
  const char *b = device ? p->d_base : p->base;
  a.k_base = b;
  a.v_base = b + p->v_offset;
  a.context_stride = p->context_stride;
  a.row_bytes = p->row_bytes;
  a.len = p->len;
  a.out = out;
  a.workspace = ws;
  a.workspace_bytes = ws_bytes;
  return a;
}

static size_t ws_bytes_for(const problem *p, uint32_t max_tokens, uint32_t chunk) {
  size_t b = 0;
  assert_int_equal(akv_attention_workspace_bytes(p->n_ctx, p->n_heads, p->head_dim, max_tokens,
                                                 chunk, &b),
                   AKV_OK);
  return b;
}

/* The C reference of the whole problem. */
static void run_reference(const problem *p, float *out) {
  const size_t wsb = ws_bytes_for(p, max_len(p), p->chunk);
  void *ws = xmalloc(wsb);
  akv_attention_args a = make_args(p, false, out, ws, wsb);
  assert_int_equal(akv_attention_ref_bf16(&a), AKV_OK);
  free(ws);
}

/* Poisons d_out with NaN (0xFF bytes), runs the contiguous CUDA launcher on
 * its own stream, copies the result to out. */
static void run_cuda_contig(const problem *p, float *d_out, void *d_ws, size_t ws_bytes,
                            float *out) {
  const size_t n = out_elems(p);
  cudaStream_t s;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  CUDA_OK(cudaMemsetAsync(d_out, 0xFF, n * sizeof(float), s));
  CUDA_OK(cudaMemsetAsync(d_ws, 0xFF, ws_bytes, s));
  akv_attention_args a = make_args(p, true, d_out, d_ws, ws_bytes);
  assert_int_equal(akv_attention_decode_cuda(&a, s), AKV_OK);
  CUDA_OK(cudaStreamSynchronize(s));
  CUDA_OK(cudaGetLastError());
  CUDA_OK(cudaMemcpy(out, d_out, n * sizeof(float), cudaMemcpyDeviceToHost));
  CUDA_OK(cudaStreamDestroy(s));
}

/* A device page pool holding the same history, pages shuffled: built on the
 * host (attn_paged_build, two pages nobody owns), then uploaded. */
typedef struct dpaged {
  akv_page_table t; /* device pointers */
  char *d_k, *d_v;
  uint32_t *d_indptr, *d_indices, *d_last;
} dpaged;

/* cudaMalloc + cudaMemcpy of bytes from host; returns the device copy. */
template <typename T>
static T *upload(const T *host, size_t bytes) {
  T *d = NULL;
  CUDA_OK(cudaMalloc((void **)&d, bytes));
  CUDA_OK(cudaMemcpy(d, host, bytes, cudaMemcpyHostToDevice));
  return d;
}

static void dpaged_build(dpaged *pg, const problem *p) {
  memset(pg, 0, sizeof *pg);
  attn_paged h;
  assert_int_equal(attn_paged_build_dt(&h, p->dtype, p->n_ctx, p->len, p->kv_heads, p->head_dim,
                                       p->base, p->context_stride, p->row_bytes, p->v_offset,
                                       p->chunk, 2),
                   0);
  pg->d_k = upload(h.k_pool, h.pool_bytes);
  pg->d_v = upload(h.v_pool, h.pool_bytes);
  pg->d_indptr = upload(h.indptr, (p->n_ctx + 1) * sizeof(uint32_t));
  pg->d_indices = upload(h.indices, (h.total + 1) * sizeof(uint32_t));
  pg->d_last = upload(h.last, p->n_ctx * sizeof(uint32_t));
  pg->t = h.t; /* geometry; the pointers become the device copies */
  pg->t.indptr = pg->d_indptr;
  pg->t.indices = pg->d_indices;
  pg->t.last_page_len = pg->d_last;
  pg->t.k_pages = pg->d_k;
  pg->t.v_pages = pg->d_v;
  attn_paged_free(&h);
}

static void dpaged_free(dpaged *pg) {
  CUDA_OK(cudaFree(pg->d_k));
  CUDA_OK(cudaFree(pg->d_v));
  CUDA_OK(cudaFree(pg->d_indptr));
  CUDA_OK(cudaFree(pg->d_indices));
  CUDA_OK(cudaFree(pg->d_last));
}

static akv_attention_paged_args make_paged_args(const problem *p, float *d_out, void *d_ws,
                                                size_t ws_bytes) {
  akv_attention_paged_args a;
  memset(&a, 0, sizeof a);
  a.dtype = p->dtype;
  if (p->dtype != AKV_DTYPE_BF16) {
    a.k_scale = p->k_scale;
    a.v_scale = p->v_scale;
  }
  a.n_heads = p->n_heads;
  a.kv_heads = p->kv_heads;
  a.head_dim = p->head_dim;
  a.scale = p->scale;
  a.q = p->d_q;
  a.out = d_out;
  a.workspace = d_ws;
  a.workspace_bytes = ws_bytes;
  return a;
}

static void run_cuda_paged(const problem *p, const dpaged *pg, float *d_out, void *d_ws,
                           size_t ws_bytes, float *out) {
  const size_t n = out_elems(p);
  cudaStream_t s;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  CUDA_OK(cudaMemsetAsync(d_out, 0xFF, n * sizeof(float), s));
  CUDA_OK(cudaMemsetAsync(d_ws, 0xFF, ws_bytes, s));
  akv_attention_paged_args a = make_paged_args(p, d_out, d_ws, ws_bytes);
  assert_int_equal(akv_attention_paged_cuda(&a, pg->t, s), AKV_OK);
  CUDA_OK(cudaStreamSynchronize(s));
  CUDA_OK(cudaGetLastError());
  CUDA_OK(cudaMemcpy(out, d_out, n * sizeof(float), cudaMemcpyDeviceToHost));
  CUDA_OK(cudaStreamDestroy(s));
}

static double rel_l2(const float *out, const float *ref, size_t n) {
  double num = 0.0, den = 0.0;
  for (size_t e = 0; e < n; ++e) {
    if (isnan(out[e]) || isnan(ref[e])) return INFINITY;
    const double d = (double)out[e] - (double)ref[e];
    num += d * d;
    den += (double)ref[e] * ref[e];
  }
  if (den == 0.0) return num == 0.0 ? 0.0 : INFINITY;
  return sqrt(num / den);
}

static double worst_f64 = 0.0; /* FP8: CUDA against float64 */

/* Relative L2 error of one context's CUDA output against float64. */
static double rel_l2_f64(const problem *p, uint32_t i, const float *got) {
  const size_t per = (size_t)p->n_heads * p->head_dim;
  double *ref = (double *)xmalloc(per * sizeof(double));
  const char *k = p->base + i * p->context_stride;
  const bool fp8 = p->dtype != AKV_DTYPE_BF16;
  attn_naive_f64(p->dtype, p->n_heads, p->kv_heads, p->head_dim, (double)p->scale,
                 p->q + (size_t)i * per, k, k + p->v_offset, p->row_bytes, p->len[i],
                 fp8 ? p->k_scale : NULL, fp8 ? p->v_scale : NULL, ref);
  double num = 0.0, den = 0.0;
  for (size_t e = 0; e < per; ++e) {
    if (isnan(got[e])) {
      free(ref);
      return INFINITY;
    }
    num += ((double)got[e] - ref[e]) * ((double)got[e] - ref[e]);
    den += ref[e] * ref[e];
  }
  free(ref);
  if (den == 0.0) return num == 0.0 ? 0.0 : INFINITY;
  return sqrt(num / den);
}

/* The whole check for one geometry. */
static void check_problem_dt(akv_dtype dt, uint32_t n_ctx, uint32_t n_heads, uint32_t kv_heads,
                             uint32_t head_dim, uint32_t chunk, const uint32_t *len, float amp) {
  problem p;
  dpaged pg;
  problem_init_dt(&p, dt, n_ctx, n_heads, kv_heads, head_dim, chunk, len, amp);
  const size_t n = out_elems(&p), per = (size_t)n_heads * head_dim;
  float *ref = (float *)xmalloc(n * sizeof(float));
  float *got = (float *)xmalloc(n * sizeof(float));
  float *again = (float *)xmalloc(n * sizeof(float));
  float *paged = (float *)xmalloc(n * sizeof(float));
  run_reference(&p, ref);

  const size_t wsb = ws_bytes_for(&p, max_len(&p), chunk);
  float *d_out;
  void *d_ws;
  CUDA_OK(cudaMalloc((void **)&d_out, n * sizeof(float)));
  CUDA_OK(cudaMalloc(&d_ws, wsb ? wsb : 16));

  run_cuda_contig(&p, d_out, d_ws, wsb, got);
  for (uint32_t i = 0; i < n_ctx; ++i) {
    for (size_t e = 0; e < per; ++e) {
      if (isnan(got[i * per + e]))
        print_error("ctx %u element %zu not written (NaN)\n", i, e);
      assert_false(isnan(got[i * per + e]));
    }
    const double err = rel_l2(got + i * per, ref + i * per, per);
    if (!(err <= REL_L2_TOL))
      print_error("dtype %d ctx %u len %u heads %u/%u dim %u chunk %u: rel L2 %.3e > %.0e\n",
                  (int)dt, i, p.len[i], n_heads, kv_heads, head_dim, chunk, err, REL_L2_TOL);
    assert_true(err <= REL_L2_TOL);
    if (err > worst_err) worst_err = err;
    if (dt != AKV_DTYPE_BF16) {
      const double e64 = rel_l2_f64(&p, i, got + i * per);
      if (!(e64 <= REL_L2_TOL))
        print_error("dtype %d ctx %u len %u: CUDA vs float64 rel L2 %.3e > %.0e\n", (int)dt, i,
                    p.len[i], e64, REL_L2_TOL);
      assert_true(e64 <= REL_L2_TOL);
      if (e64 > worst_f64) worst_f64 = e64;
    }
  }

  run_cuda_contig(&p, d_out, d_ws, wsb, again);
  assert_memory_equal(got, again, n * sizeof(float));

  dpaged_build(&pg, &p);
  size_t pwsb = 0;
  assert_int_equal(akv_attention_workspace_bytes(n_ctx, n_heads, head_dim,
                                                 pg.t.max_pages * chunk, chunk, &pwsb),
                   AKV_OK);
  void *d_pws;
  CUDA_OK(cudaMalloc(&d_pws, pwsb ? pwsb : 16));
  run_cuda_paged(&p, &pg, d_out, d_pws, pwsb, paged);
  if (memcmp(got, paged, n * sizeof(float)) != 0)
    print_error("paged differs from contiguous: heads %u/%u dim %u chunk %u\n", n_heads, kv_heads,
                head_dim, chunk);
  assert_memory_equal(got, paged, n * sizeof(float));

  CUDA_OK(cudaFree(d_pws));
  dpaged_free(&pg);
  CUDA_OK(cudaFree(d_out));
  CUDA_OK(cudaFree(d_ws));
  free(ref);
  free(got);
  free(again);
  free(paged);
  problem_free(&p);
}

static void check_problem(uint32_t n_ctx, uint32_t n_heads, uint32_t kv_heads, uint32_t head_dim,
                          uint32_t chunk, const uint32_t *len, float amp) {
  check_problem_dt(AKV_DTYPE_BF16, n_ctx, n_heads, kv_heads, head_dim, chunk, len, amp);
}

/* ------------------------------------------------------------------ tests */

static void test_llama_geometry(void **state) {
  (void)state;
  const uint32_t len[4] = {3000, 257, 1, 1024};
  check_problem(4, 32, 8, 128, 256, len, 1.0f);
  check_problem(4, 32, 8, 128, 256, len, 6.0f); /* sharper softmax */
  const uint32_t edge[5] = {1, 63, 64, 65, 64 * 7 + 13};
  check_problem(5, 32, 8, 128, 64, edge, 1.0f);
}

static void test_head_dims_and_groups(void **state) {
  (void)state;
  const uint32_t len[5] = {1, 15, 16, 17, 201};
  check_problem(5, 8, 8, 64, 16, len, 1.0f);    /* D 64, group 1 */
  check_problem(5, 16, 8, 64, 16, len, 1.0f);   /* D 64, group 2 */
  check_problem(5, 64, 8, 64, 16, len, 1.0f);   /* D 64, group 8 */
  check_problem(5, 4, 2, 256, 16, len, 1.0f);   /* D 256, group 2 */
  check_problem(5, 16, 2, 256, 32, len, 1.0f);  /* D 256, group 8 */
  check_problem(5, 12, 4, 128, 32, len, 1.0f);  /* group 3: a masked head */
  check_problem(5, 16, 1, 64, 48, len, 1.0f);   /* group 16: two subgroups */
  check_problem(5, 40, 4, 128, 100, len, 1.0f); /* group 10: 8 + 2 of 8 */
  check_problem(5, 64, 8, 128, 1, len, 1.0f);   /* chunk of one row */
}

static void test_zero_lengths_and_many_contexts(void **state) {
  (void)state;
  /* 300 contexts: more than one launch group; some of length 0. */
  uint32_t len[300];
  for (uint32_t i = 0; i < 300; ++i) len[i] = (i % 7 == 0) ? 0 : 1 + (uint32_t)(rng_next() % 40);
  check_problem(300, 8, 2, 64, 16, len, 1.0f);

  /* Zero-length contexts get zeros (written, not left poisoned). */
  const uint32_t z[3] = {0, 9, 0};
  problem p;
  problem_init(&p, 3, 8, 2, 128, 8, z, 1.0f);
  const size_t n = out_elems(&p), per = (size_t)8 * 128;
  float *got = (float *)xmalloc(n * sizeof(float));
  const size_t wsb = ws_bytes_for(&p, max_len(&p), 8);
  float *d_out;
  void *d_ws;
  CUDA_OK(cudaMalloc((void **)&d_out, n * sizeof(float)));
  CUDA_OK(cudaMalloc(&d_ws, wsb));
  run_cuda_contig(&p, d_out, d_ws, wsb, got);
  for (size_t e = 0; e < per; ++e) {
    assert_true(got[e] == 0.0f);
    assert_true(got[2 * per + e] == 0.0f);
  }
  CUDA_OK(cudaFree(d_out));
  CUDA_OK(cudaFree(d_ws));
  free(got);
  problem_free(&p);

  /* All contexts empty: only the combine runs; workspace may be 0 bytes. */
  const uint32_t none[2] = {0, 0};
  problem e;
  problem_init(&e, 2, 4, 4, 64, 8, none, 1.0f);
  float *d_out2;
  float out2[2 * 4 * 64];
  CUDA_OK(cudaMalloc((void **)&d_out2, sizeof out2));
  CUDA_OK(cudaMemset(d_out2, 0xFF, sizeof out2));
  akv_attention_args a = make_args(&e, true, d_out2, NULL, 0);
  assert_int_equal(akv_attention_decode_cuda(&a, 0), AKV_OK);
  CUDA_OK(cudaDeviceSynchronize());
  CUDA_OK(cudaMemcpy(out2, d_out2, sizeof out2, cudaMemcpyDeviceToHost));
  for (size_t i = 0; i < 2 * 4 * 64; ++i) assert_true(out2[i] == 0.0f);
  CUDA_OK(cudaFree(d_out2));
  problem_free(&e);
}

/* The llama-3-8b layer at the benchmark's length, one context. */
static void test_long_history(void **state) {
  (void)state;
  const uint32_t len[1] = {31744};
  check_problem(1, 32, 8, 128, 256, len, 1.0f);
  print_message("worst relative L2 error CUDA vs reference: %.3e (bound %.0e)\n", worst_err,
                REL_L2_TOL);
}

/* FP8 E4M3 and E5M2 with per-head scales: every geometry the bf16 tests
 * cover (head_dim 64/128/256, groups 1 to 16, masked heads, chunks of one
 * row, chunks cut into pieces), against the C reference and float64. */
static void test_fp8(void **state) {
  (void)state;
  const akv_dtype dts[2] = {AKV_DTYPE_FP8_E4M3, AKV_DTYPE_FP8_E5M2};
  const uint32_t len[4] = {3000, 257, 1, 1024};
  const uint32_t edge[5] = {1, 63, 64, 65, 64 * 7 + 13};
  const uint32_t around[7] = {1, 15, 16, 17, 127, 129, 201};
  for (int k = 0; k < 2; ++k) {
    const akv_dtype dt = dts[k];
    check_problem_dt(dt, 4, 32, 8, 128, 256, len, 1.0f); /* llama, two pieces per chunk */
    check_problem_dt(dt, 4, 32, 8, 128, 256, len, 6.0f); /* sharper softmax */
    check_problem_dt(dt, 5, 32, 8, 128, 64, edge, 1.0f);
    check_problem_dt(dt, 7, 8, 8, 64, 16, around, 1.0f);    /* D 64, group 1 */
    check_problem_dt(dt, 7, 64, 8, 64, 128, around, 1.0f);  /* D 64, group 8 */
    check_problem_dt(dt, 7, 4, 2, 256, 16, around, 1.0f);   /* D 256, group 2 */
    check_problem_dt(dt, 7, 16, 2, 256, 256, around, 1.0f); /* D 256, group 8, pieces */
    check_problem_dt(dt, 7, 12, 4, 128, 32, around, 1.0f);  /* group 3: a masked head */
    check_problem_dt(dt, 7, 16, 1, 64, 48, around, 1.0f);   /* group 16: two subgroups */
    check_problem_dt(dt, 7, 64, 8, 128, 1, around, 1.0f);   /* chunk of one row */
  }
  const uint32_t one[1] = {31744}; /* the benchmark's history */
  check_problem_dt(AKV_DTYPE_FP8_E4M3, 1, 32, 8, 128, 256, one, 1.0f);
  print_message("worst relative L2 error FP8: CUDA vs reference (with bf16) %.3e, CUDA vs "
                "float64 %.3e (bound %.0e)\n",
                worst_err, worst_f64, REL_L2_TOL);
}

/* A grid that fits the device at once is one cooperative launch (the fused
 * kernel: chunk blocks, a grid barrier, the combine's fold in the same
 * blocks); a larger one is the chunk and combine kernels. Both must give the
 * same bits: every context of a batch too large to fit is run again alone
 * (a grid of 16 blocks), from the same bytes, and compared. */
static void test_fused_matches_two_kernels(void **state) {
  (void)state;
  int dev = 0, sms = 0;
  CUDA_OK(cudaGetDevice(&dev));
  CUDA_OK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  /* 4,096 rows at chunk 256: 16 pieces, 2 spans of 8, times 8 kv heads =
   * 16 blocks per context; at most 2 blocks of kernel 3 fit an SM. */
  const uint32_t n_ctx = (uint32_t)(2 * sms) / 16u + 2u;
  uint32_t *len = (uint32_t *)xmalloc(n_ctx * sizeof(uint32_t));
  for (uint32_t i = 0; i < n_ctx; ++i) len[i] = 4096u - 97u * (i % 3u); /* last piece short */
  const akv_dtype dts[3] = {AKV_DTYPE_BF16, AKV_DTYPE_FP8_E4M3, AKV_DTYPE_FP8_E5M2};
  for (int k = 0; k < 3; ++k) {
    problem p;
    problem_init_dt(&p, dts[k], n_ctx, 32, 8, 128, 256, len, 1.0f);
    const size_t n = out_elems(&p), per = (size_t)p.n_heads * p.head_dim;
    float *all = (float *)xmalloc(n * sizeof(float));
    float *one = (float *)xmalloc(per * sizeof(float));
    const size_t wsb = ws_bytes_for(&p, max_len(&p), p.chunk);
    float *d_out;
    void *d_ws;
    CUDA_OK(cudaMalloc((void **)&d_out, n * sizeof(float)));
    CUDA_OK(cudaMalloc(&d_ws, wsb));
    run_cuda_contig(&p, d_out, d_ws, wsb, all);
    for (uint32_t i = 0; i < n_ctx; ++i) {
      CUDA_OK(cudaMemset(d_out, 0xFF, per * sizeof(float)));
      CUDA_OK(cudaMemset(d_ws, 0xFF, wsb));
      akv_attention_args a = make_args(&p, true, d_out, d_ws, wsb);
      a.n_contexts = 1;
      a.q = p.d_q + (size_t)i * per;
      a.k_base = p.d_base + (size_t)i * p.context_stride;
      a.v_base = p.d_base + (size_t)i * p.context_stride + p.v_offset;
      a.len = p.len + i;
      assert_int_equal(akv_attention_decode_cuda(&a, 0), AKV_OK);
      CUDA_OK(cudaDeviceSynchronize());
      CUDA_OK(cudaMemcpy(one, d_out, per * sizeof(float), cudaMemcpyDeviceToHost));
      if (memcmp(one, all + i * per, per * sizeof(float)) != 0)
        print_error("dtype %d context %u: alone (one launch) differs from the batch of %u "
                    "(two kernels)\n",
                    (int)dts[k], i, n_ctx);
      assert_memory_equal(one, all + i * per, per * sizeof(float));
    }
    CUDA_OK(cudaFree(d_out));
    CUDA_OK(cudaFree(d_ws));
    free(all);
    free(one);
    problem_free(&p);
  }
  free(len);
}

/* FP8 argument checks: scales required and sane, one-byte rows; nothing is
 * enqueued by a refused call. */
static void test_fp8_invalid_arguments(void **state) {
  (void)state;
  const uint32_t len[2] = {40, 17};
  problem p;
  problem_init_dt(&p, AKV_DTYPE_FP8_E4M3, 2, 8, 2, 128, 16, len, 1.0f);
  const size_t n = out_elems(&p);
  const size_t wsb = ws_bytes_for(&p, 40, 16);
  float *d_out;
  char *d_ws;
  CUDA_OK(cudaMalloc((void **)&d_out, n * sizeof(float)));
  CUDA_OK(cudaMalloc((void **)&d_ws, wsb + 64));
  CUDA_OK(cudaMemset(d_out, 0xFF, n * sizeof(float)));
  const akv_attention_args good = make_args(&p, true, d_out, d_ws, wsb);
  const float zero[2] = {0.1f, 0.0f}, inf[2] = {INFINITY, 0.1f};
  akv_attention_args a;
#define EXPECT_BAD(mutation, status)                            \
  do {                                                          \
    a = good;                                                   \
    mutation;                                                   \
    assert_int_equal(akv_attention_decode_cuda(&a, 0), status); \
  } while (0)
  EXPECT_BAD((a.k_scale = NULL, a.v_scale = NULL), AKV_ERR_INVALID_ARGUMENT);
  EXPECT_BAD(a.v_scale = NULL, AKV_ERR_INVALID_ARGUMENT);
  EXPECT_BAD(a.k_scale = zero, AKV_ERR_INVALID_ARGUMENT);
  EXPECT_BAD(a.v_scale = inf, AKV_ERR_INVALID_ARGUMENT);
  EXPECT_BAD(a.row_bytes = 2 * 128 - 16, AKV_ERR_INVALID_ARGUMENT);
  EXPECT_BAD(a.dtype = AKV_DTYPE_F32, AKV_ERR_NOT_SUPPORTED);
#undef EXPECT_BAD
  dpaged pg;
  dpaged_build(&pg, &p);
  size_t pwsb = 0;
  assert_int_equal(akv_attention_workspace_bytes(2, 8, 128, pg.t.max_pages * 16, 16, &pwsb),
                   AKV_OK);
  akv_attention_paged_args pa = make_paged_args(&p, d_out, d_ws, pwsb);
  pa.k_scale = NULL;
  assert_int_equal(akv_attention_paged_cuda(&pa, pg.t, 0), AKV_ERR_INVALID_ARGUMENT);
  pa.k_scale = zero;
  assert_int_equal(akv_attention_paged_cuda(&pa, pg.t, 0), AKV_ERR_INVALID_ARGUMENT);
  CUDA_OK(cudaDeviceSynchronize());
  unsigned char *h = (unsigned char *)xmalloc(n * sizeof(float));
  CUDA_OK(cudaMemcpy(h, d_out, n * sizeof(float), cudaMemcpyDeviceToHost));
  for (size_t i = 0; i < n * sizeof(float); ++i) assert_int_equal(h[i], 0xFF);
  a = good;
  assert_int_equal(akv_attention_decode_cuda(&a, 0), AKV_OK);
  CUDA_OK(cudaDeviceSynchronize());
  CUDA_OK(cudaGetLastError());
  free(h);
  dpaged_free(&pg);
  CUDA_OK(cudaFree(d_out));
  CUDA_OK(cudaFree(d_ws));
  problem_free(&p);
}

static void test_invalid_arguments(void **state) {
  (void)state;
  const uint32_t len[2] = {40, 17};
  problem p;
  problem_init(&p, 2, 8, 2, 128, 16, len, 1.0f);
  const size_t n = out_elems(&p);
  const size_t wsb = ws_bytes_for(&p, 40, 16);
  float *d_out;
  char *d_ws;
  CUDA_OK(cudaMalloc((void **)&d_out, n * sizeof(float)));
  CUDA_OK(cudaMalloc((void **)&d_ws, wsb + 64));
  CUDA_OK(cudaMemset(d_out, 0xFF, n * sizeof(float)));
  const akv_attention_args good = make_args(&p, true, d_out, d_ws, wsb);
  akv_attention_args a;
  assert_int_equal(akv_attention_decode_cuda(NULL, 0), AKV_ERR_INVALID_ARGUMENT);
#define EXPECT_BAD(mutation, status)                         \
  do {                                                       \
    a = good;                                                \
    mutation;                                                \
    assert_int_equal(akv_attention_decode_cuda(&a, 0), status); \
  } while (0)
  EXPECT_BAD(a.workspace_bytes = wsb - 1, AKV_ERR_INVALID_ARGUMENT);
  EXPECT_BAD(a.workspace = d_ws + 4, AKV_ERR_INVALID_ARGUMENT);
  EXPECT_BAD(a.k_base = p.d_base + 2, AKV_ERR_INVALID_ARGUMENT);
  EXPECT_BAD(a.v_base = p.d_base + p.v_offset + 8, AKV_ERR_INVALID_ARGUMENT);
  EXPECT_BAD(a.row_bytes = p.row_bytes + 2, AKV_ERR_INVALID_ARGUMENT);
  EXPECT_BAD(a.context_stride = p.context_stride + 4, AKV_ERR_INVALID_ARGUMENT);
  EXPECT_BAD(a.q = (const char *)p.d_q + 2, AKV_ERR_INVALID_ARGUMENT);
  EXPECT_BAD(a.n_heads = 9, AKV_ERR_INVALID_ARGUMENT);
  EXPECT_BAD(a.chunk_tokens = 0, AKV_ERR_INVALID_ARGUMENT);
  EXPECT_BAD(a.len = NULL, AKV_ERR_INVALID_ARGUMENT);
  EXPECT_BAD(a.out = NULL, AKV_ERR_INVALID_ARGUMENT);
  EXPECT_BAD(a.dtype = AKV_DTYPE_F16, AKV_ERR_NOT_SUPPORTED);
  EXPECT_BAD((a.head_dim = 96, a.row_bytes = 2 * 96 * 2), AKV_ERR_NOT_SUPPORTED);
  EXPECT_BAD(a.scale = INFINITY, AKV_ERR_INVALID_ARGUMENT);
  EXPECT_BAD(a.scale = NAN, AKV_ERR_INVALID_ARGUMENT);
  /* Context 1 at 2^63 bytes: its row offsets do not fit ptrdiff_t. */
  EXPECT_BAD(a.context_stride = UINT64_C(1) << 63, AKV_ERR_INVALID_ARGUMENT);
  /* Page overrides: incomplete or misaligned. */
  EXPECT_BAD((a.page_map = (const uint32_t *)d_ws, a.page_map_stride = 0, a.k_pages = p.d_base,
              a.v_pages = p.d_base),
             AKV_ERR_INVALID_ARGUMENT);
  EXPECT_BAD((a.page_map = (const uint32_t *)d_ws, a.page_map_stride = 4, a.k_pages = NULL,
              a.v_pages = p.d_base),
             AKV_ERR_INVALID_ARGUMENT);
  EXPECT_BAD((a.page_map = (const uint32_t *)d_ws, a.page_map_stride = 4, a.k_pages = p.d_base,
              a.v_pages = p.d_base, a.page_stride = 8),
             AKV_ERR_INVALID_ARGUMENT);
#undef EXPECT_BAD
  /* Nothing was enqueued: the output is still all NaN bytes. */
  CUDA_OK(cudaDeviceSynchronize());
  unsigned char *h = (unsigned char *)xmalloc(n * sizeof(float));
  CUDA_OK(cudaMemcpy(h, d_out, n * sizeof(float), cudaMemcpyDeviceToHost));
  for (size_t i = 0; i < n * sizeof(float); ++i) assert_int_equal(h[i], 0xFF);

  /* Paged launcher checks. */
  dpaged pg;
  dpaged_build(&pg, &p);
  size_t pwsb = 0;
  assert_int_equal(akv_attention_workspace_bytes(2, 8, 128, pg.t.max_pages * 16, 16, &pwsb),
                   AKV_OK);
  akv_attention_paged_args pa = make_paged_args(&p, d_out, d_ws, pwsb);
  akv_page_table t = pg.t;
  assert_int_equal(akv_attention_paged_cuda(NULL, t, 0), AKV_ERR_INVALID_ARGUMENT);
  pa.workspace_bytes = pwsb - 1;
  assert_int_equal(akv_attention_paged_cuda(&pa, t, 0), AKV_ERR_INVALID_ARGUMENT);
  pa.workspace_bytes = pwsb;
  t.k_pages = pg.d_k + 8;
  assert_int_equal(akv_attention_paged_cuda(&pa, t, 0), AKV_ERR_INVALID_ARGUMENT);
  t = pg.t;
  t.page_stride += 4;
  assert_int_equal(akv_attention_paged_cuda(&pa, t, 0), AKV_ERR_INVALID_ARGUMENT);
  t = pg.t; /* indices may be NULL (test_paged_null_indices); indptr may not */
  t.indptr = NULL;
  assert_int_equal(akv_attention_paged_cuda(&pa, t, 0), AKV_ERR_INVALID_ARGUMENT);
  t = pg.t;
  t.page_tokens = 0;
  assert_int_equal(akv_attention_paged_cuda(&pa, t, 0), AKV_ERR_INVALID_ARGUMENT);
  CUDA_OK(cudaDeviceSynchronize());
  CUDA_OK(cudaMemcpy(h, d_out, n * sizeof(float), cudaMemcpyDeviceToHost));
  for (size_t i = 0; i < n * sizeof(float); ++i) assert_int_equal(h[i], 0xFF);

  /* A good call after all that still works. */
  a = good;
  assert_int_equal(akv_attention_decode_cuda(&a, 0), AKV_OK);
  CUDA_OK(cudaDeviceSynchronize());
  CUDA_OK(cudaGetLastError());

  free(h);
  dpaged_free(&pg);
  CUDA_OK(cudaFree(d_out));
  CUDA_OK(cudaFree(d_ws));
  problem_free(&p);
}

/* A table whose context 1 has more pages than max_pages: that context's
 * output is NaN, the others are still right (and nothing is read out of
 * bounds, which compute-sanitizer checks in the GPU pass). */
static void test_paged_overflow_marks_context(void **state) {
  (void)state;
  const uint32_t len[3] = {32, 80, 16};
  problem p;
  problem_init(&p, 3, 8, 2, 64, 16, len, 1.0f);
  const size_t n = out_elems(&p), per = (size_t)8 * 64;
  float *ref = (float *)xmalloc(n * sizeof(float));
  float *got = (float *)xmalloc(n * sizeof(float));
  run_reference(&p, ref);
  dpaged pg;
  dpaged_build(&pg, &p); /* pages: 2, 5, 1 */
  pg.t.max_pages = 3;
  size_t wsb = 0;
  assert_int_equal(akv_attention_workspace_bytes(3, 8, 64, 3 * 16, 16, &wsb), AKV_OK);
  float *d_out;
  void *d_ws;
  CUDA_OK(cudaMalloc((void **)&d_out, n * sizeof(float)));
  CUDA_OK(cudaMalloc(&d_ws, wsb));
  run_cuda_paged(&p, &pg, d_out, d_ws, wsb, got);
  for (size_t e = 0; e < per; ++e) assert_true(isnan(got[per + e]));
  assert_true(rel_l2(got, ref, per) <= REL_L2_TOL);
  assert_true(rel_l2(got + 2 * per, ref + 2 * per, per) <= REL_L2_TOL);
  CUDA_OK(cudaFree(d_out));
  CUDA_OK(cudaFree(d_ws));
  dpaged_free(&pg);
  free(ref);
  free(got);
  problem_free(&p);
}

/* A table without pages may leave indices NULL (akv_attention.h, "Empty
 * arrays"), as the reference takes it: every context gets zeros, whatever
 * max_pages says. A NULL indices in a table with pages reads no page: the
 * contexts with pages get NaN, the empty ones zeros. */
static void test_paged_null_indices(void **state) {
  (void)state;
  const uint32_t none[2] = {0, 0};
  problem e;
  problem_init(&e, 2, 8, 2, 64, 16, none, 1.0f);
  dpaged pe;
  dpaged_build(&pe, &e);
  const size_t ne = out_elems(&e);
  float *got = (float *)xmalloc(ne * sizeof(float));
  size_t wsb = 0;
  assert_int_equal(akv_attention_workspace_bytes(2, 8, 64, 2 * 16, 16, &wsb), AKV_OK);
  float *d_out;
  void *d_ws;
  CUDA_OK(cudaMalloc((void **)&d_out, 3 * 8 * 64 * sizeof(float)));
  CUDA_OK(cudaMalloc(&d_ws, wsb));
  pe.t.indices = NULL;
  pe.t.max_pages = 2;
  run_cuda_paged(&e, &pe, d_out, d_ws, wsb, got);
  for (size_t i = 0; i < ne; ++i) assert_true(got[i] == 0.0f);
  pe.t.max_pages = 0; /* no partials: a workspace of 0 bytes, NULL included */
  CUDA_OK(cudaMemset(d_out, 0xFF, ne * sizeof(float)));
  akv_attention_paged_args pa = make_paged_args(&e, d_out, NULL, 0);
  assert_int_equal(akv_attention_paged_cuda(&pa, pe.t, 0), AKV_OK);
  CUDA_OK(cudaDeviceSynchronize());
  CUDA_OK(cudaMemcpy(got, d_out, ne * sizeof(float), cudaMemcpyDeviceToHost));
  for (size_t i = 0; i < ne; ++i) assert_true(got[i] == 0.0f);
  free(got);
  dpaged_free(&pe);
  problem_free(&e);

  const uint32_t len[3] = {0, 40, 0};
  problem p;
  problem_init(&p, 3, 8, 2, 64, 16, len, 1.0f);
  dpaged pg;
  dpaged_build(&pg, &p); /* pages: 0, 3, 0 */
  const size_t n = out_elems(&p), per = (size_t)8 * 64;
  got = (float *)xmalloc(n * sizeof(float));
  size_t wsb3 = 0;
  assert_int_equal(akv_attention_workspace_bytes(3, 8, 64, pg.t.max_pages * 16, 16, &wsb3),
                   AKV_OK);
  void *d_ws3;
  CUDA_OK(cudaMalloc(&d_ws3, wsb3));
  pg.t.indices = NULL;
  run_cuda_paged(&p, &pg, d_out, d_ws3, wsb3, got);
  for (size_t e2 = 0; e2 < per; ++e2) {
    assert_true(got[e2] == 0.0f);
    assert_true(isnan(got[per + e2]));
    assert_true(got[2 * per + e2] == 0.0f);
  }
  CUDA_OK(cudaFree(d_out));
  CUDA_OK(cudaFree(d_ws));
  CUDA_OK(cudaFree(d_ws3));
  dpaged_free(&pg);
  free(got);
  problem_free(&p);
}

/* A launch captured in a CUDA graph and replayed gives the same bits every
 * time, and one workspace serves calls of different lengths (its regions
 * move with the call's longest context) without being cleared in between.
 * Every result is compared bit for bit with a direct call on a fresh,
 * poisoned workspace. */
/* Poisons d_out (n floats), runs the contiguous launcher on stream s with
 * the workspace as it is (not poisoned), copies the result to got. */
static void run_on_workspace_as_is(const akv_attention_args *a, float *d_out, size_t n,
                                   cudaStream_t s, float *got) {
  CUDA_OK(cudaMemsetAsync(d_out, 0xFF, n * sizeof(float), s));
  assert_int_equal(akv_attention_decode_cuda(a, s), AKV_OK);
  CUDA_OK(cudaStreamSynchronize(s));
  CUDA_OK(cudaMemcpy(got, d_out, n * sizeof(float), cudaMemcpyDeviceToHost));
}

static void test_graph_replay_and_workspace_reuse(void **state) {
  (void)state;
  const uint32_t len[3] = {3000, 257, 1100};
  problem p;
  problem_init_dt(&p, AKV_DTYPE_FP8_E4M3, 3, 32, 8, 128, 256, len, 1.0f);
  const size_t n = out_elems(&p);
  float *want = (float *)xmalloc(n * sizeof(float));
  float *got = (float *)xmalloc(n * sizeof(float));
  const size_t wsb = ws_bytes_for(&p, max_len(&p), p.chunk);
  float *d_out;
  void *d_ws;
  CUDA_OK(cudaMalloc((void **)&d_out, n * sizeof(float)));
  CUDA_OK(cudaMalloc(&d_ws, wsb));
  run_cuda_contig(&p, d_out, d_ws, wsb, want);

  cudaStream_t s;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  CUDA_OK(cudaMemsetAsync(d_ws, 0xFF, wsb, s));
  CUDA_OK(cudaStreamSynchronize(s));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  akv_attention_args a = make_args(&p, true, d_out, d_ws, wsb);
  assert_int_equal(akv_attention_decode_cuda(&a, s), AKV_OK);
  CUDA_OK(cudaStreamEndCapture(s, &graph));
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  for (int rep = 0; rep < 4; ++rep) {
    CUDA_OK(cudaMemsetAsync(d_out, 0xFF, n * sizeof(float), s));
    CUDA_OK(cudaGraphLaunch(exec, s));
    CUDA_OK(cudaStreamSynchronize(s));
    CUDA_OK(cudaMemcpy(got, d_out, n * sizeof(float), cudaMemcpyDeviceToHost));
    if (memcmp(got, want, n * sizeof(float)) != 0) print_error("graph replay %d differs\n", rep);
    assert_memory_equal(got, want, n * sizeof(float));
  }
  CUDA_OK(cudaGraphExecDestroy(exec));
  CUDA_OK(cudaGraphDestroy(graph));

  /* Shorter calls on the same (unpoisoned) workspace, then the long one
   * again: each equals its own direct call. */
  const uint32_t shorter[3][3] = {{40, 0, 700}, {0, 0, 0}, {256, 512, 1}};
  for (int k = 0; k < 3; ++k) {
    problem q;
    problem_init_dt(&q, AKV_DTYPE_FP8_E4M3, 3, 32, 8, 128, 256, shorter[k], 1.0f);
    float *want_q = (float *)xmalloc(n * sizeof(float));
    const size_t qb = ws_bytes_for(&q, max_len(&q), q.chunk);
    void *d_qws;
    CUDA_OK(cudaMalloc(&d_qws, qb ? qb : 16));
    run_cuda_contig(&q, d_out, d_qws, qb, want_q);
    akv_attention_args b = make_args(&q, true, d_out, d_ws, wsb);
    run_on_workspace_as_is(&b, d_out, n, s, got);
    assert_memory_equal(got, want_q, n * sizeof(float));
    CUDA_OK(cudaFree(d_qws));
    free(want_q);
    problem_free(&q);
  }
  run_on_workspace_as_is(&a, d_out, n, s, got);
  assert_memory_equal(got, want, n * sizeof(float));

  CUDA_OK(cudaStreamDestroy(s));
  CUDA_OK(cudaFree(d_out));
  CUDA_OK(cudaFree(d_ws));
  free(want);
  free(got);
  problem_free(&p);
}

/* ------------------------------------------------ non-finite values, bytes */

/* Element j of kv head g of row t of context i of K (which 0) or V (1). */
static char *elem_at(problem *p, uint32_t i, uint32_t t, int which, uint32_t g, uint32_t j) {
  const uint32_t es = attn_elem_bytes(p->dtype);
  return p->base + i * p->context_stride + t * p->row_bytes + (which ? p->v_offset : 0u) +
         ((size_t)g * p->head_dim + j) * es;
}

static void set_elem(problem *p, char *at, uint16_t bf16, uint8_t fp8) {
  if (p->dtype == AKV_DTYPE_BF16) memcpy(at, &bf16, 2);
  else *(uint8_t *)at = fp8;
}

/*
 * akv_attention.h, "Algorithm": a NaN q or K element, an FP8 NaN code or a
 * score that overflows gives NaN (the reference's combine writes zeros only
 * for a denominator of exactly 0: no rows, or every score -inf). The CUDA
 * combine keeps the same promise: NaN in exactly the reference's places,
 * the reference's bytes where it writes zeros, and the usual bound
 * elsewhere; the paged launcher gives the contiguous one's bytes. Contexts
 * (8 heads over 2 kv heads, heads 0-3 read kv head 0, chunks of 256):
 *  0: clean; 1: NaN in q of head 3; 2: NaN (bf16 NaN, FP8 NaN code) in K
 *  row 299 of kv head 1 (heads 4-7); 3: q of head 2 and K row 100 of kv
 *  head 0 both 2^127 (bf16) or the largest code (FP8) in dim 0: that score
 *  overflows to +inf (head 2); 4: bf16: q of head 5 is 2^127 in dim 0 and 0
 *  elsewhere, every K row of kv head 1 -2^127 in dim 0: every score of head
 *  5 is -inf (zeros); FP8: a NaN code in K row 255 of kv head 0 (the last
 *  row of a piece; heads 0-3); 5: empty (zeros).
 */
static void check_nonfinite(akv_dtype dt) {
  const uint32_t len[6] = {37, 300, 600, 530, 1030, 0};
  problem p;
  problem_init_dt(&p, dt, 6, 8, 2, 128, 256, len, 1.0f);
  const uint32_t d = p.head_dim, per = p.n_heads * d;
  const uint16_t BF_NAN = 0x7FC0u, BF_BIG = 0x7F00u /* 2^127 */, BF_NBIG = 0xFF00u;
  const uint8_t F8_NAN = 0x7Fu; /* NaN in E4M3 and in E5M2 */
  const uint8_t F8_MAX = dt == AKV_DTYPE_FP8_E4M3 ? 0x7Eu : 0x7Bu; /* 448, 57344 */
  p.q[(size_t)1 * per + 3 * d + 5] = BF_NAN;
  set_elem(&p, elem_at(&p, 2, 299, 0, 1, 7), BF_NAN, F8_NAN);
  /* Dim 0 of q is 0 for the other heads of the huge K elements' kv head,
   * so that only the planted head's scores leave the usual range. */
  for (uint32_t h = 0; h < 4; ++h) p.q[(size_t)3 * per + h * d] = 0u;
  for (uint32_t h = 4; h < 8; ++h) p.q[(size_t)4 * per + h * d] = 0u;
  p.q[(size_t)3 * per + 2 * d + 0] = BF_BIG;
  set_elem(&p, elem_at(&p, 3, 100, 0, 0, 0), BF_BIG, F8_MAX);
  if (dt == AKV_DTYPE_BF16) {
    for (uint32_t j = 0; j < d; ++j) p.q[(size_t)4 * per + 5 * d + j] = j == 0 ? BF_BIG : 0u;
    for (uint32_t t = 0; t < len[4]; ++t) set_elem(&p, elem_at(&p, 4, t, 0, 1, 0), BF_NBIG, 0);
  } else {
    set_elem(&p, elem_at(&p, 4, 255, 0, 0, 3), 0, F8_NAN);
  }
  CUDA_OK(cudaMemcpy(p.d_base, p.base, (size_t)p.n_ctx * p.context_stride,
                     cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(p.d_q, p.q, out_elems(&p) * 2u, cudaMemcpyHostToDevice));

  const size_t n = out_elems(&p);
  float *ref = (float *)xmalloc(n * sizeof(float));
  float *got = (float *)xmalloc(n * sizeof(float));
  float *paged = (float *)xmalloc(n * sizeof(float));
  run_reference(&p, ref);
  /* The planted values reach the reference as the header says. */
  const struct {
    uint32_t ctx, h0, h1;
    int nan;
  } want[] = {{1, 3, 4, 1}, {2, 4, 8, 1}, {3, 2, 3, 1}, {4, dt == AKV_DTYPE_BF16 ? 5u : 0u,
                                                          dt == AKV_DTYPE_BF16 ? 6u : 4u,
                                                          dt != AKV_DTYPE_BF16}};
  for (size_t w = 0; w < sizeof want / sizeof want[0]; ++w)
    for (uint32_t h = want[w].h0; h < want[w].h1; ++h)
      for (uint32_t j = 0; j < d; ++j) {
        const float r = ref[(size_t)want[w].ctx * per + h * d + j];
        assert_true(want[w].nan ? isnan(r) : r == 0.0f);
      }
  for (size_t e = 0; e < (size_t)per; ++e) assert_true(ref[5 * (size_t)per + e] == 0.0f);

  const size_t wsb = ws_bytes_for(&p, max_len(&p), p.chunk);
  float *d_out;
  void *d_ws;
  CUDA_OK(cudaMalloc((void **)&d_out, n * sizeof(float)));
  CUDA_OK(cudaMalloc(&d_ws, wsb));
  run_cuda_contig(&p, d_out, d_ws, wsb, got);
  for (uint32_t i = 0; i < p.n_ctx; ++i) {
    double num = 0.0, den = 0.0;
    for (uint32_t e = 0; e < per; ++e) {
      const float r = ref[(size_t)i * per + e], g = got[(size_t)i * per + e];
      /* A head the reference zeroed whole (no rows, every score -inf):
       * the same bytes. */
      bool zero_head = true;
      const float *head = ref + (size_t)i * per + e / d * d;
      for (uint32_t j = 0; j < d; ++j) zero_head = zero_head && head[j] == 0.0f;
      if (isnan(r) != isnan(g) || (zero_head && memcmp(&r, &g, sizeof r) != 0))
        print_error("dtype %d ctx %u head %u dim %u: CUDA %g, reference %g\n", (int)dt, i,
                    e / d, e % d, (double)g, (double)r);
      assert_int_equal(isnan(r) != 0, isnan(g) != 0);
      if (zero_head) assert_memory_equal(&r, &g, sizeof r);
      if (isnan(r)) continue;
      num += ((double)g - r) * ((double)g - r);
      den += (double)r * r;
    }
    assert_true(den == 0.0 ? num == 0.0 : sqrt(num / den) <= REL_L2_TOL);
  }
  dpaged pg;
  dpaged_build(&pg, &p);
  size_t pwsb = 0;
  assert_int_equal(akv_attention_workspace_bytes(p.n_ctx, p.n_heads, d, pg.t.max_pages * p.chunk,
                                                 p.chunk, &pwsb),
                   AKV_OK);
  void *d_pws;
  CUDA_OK(cudaMalloc(&d_pws, pwsb ? pwsb : 16));
  run_cuda_paged(&p, &pg, d_out, d_pws, pwsb, paged);
  assert_memory_equal(got, paged, n * sizeof(float));
  CUDA_OK(cudaFree(d_pws));
  dpaged_free(&pg);
  CUDA_OK(cudaFree(d_out));
  CUDA_OK(cudaFree(d_ws));
  free(ref);
  free(got);
  free(paged);
  problem_free(&p);
}

static void test_nonfinite_matches_reference(void **state) {
  (void)state;
  check_nonfinite(AKV_DTYPE_BF16);
  check_nonfinite(AKV_DTYPE_FP8_E4M3);
  check_nonfinite(AKV_DTYPE_FP8_E5M2);
}

/* akv_attention.h, "Overlap", on device memory: workspace, out and q in
 * one allocation, each right after the other, give the bytes of separate
 * buffers; out one element into the workspace, or q one element into out,
 * is refused before anything is enqueued (both keep their poison). */
static void test_adjacent_device_buffers(void **state) {
  (void)state;
  const uint32_t len[3] = {700, 5, 300};
  problem p;
  problem_init(&p, 3, 8, 2, 128, 256, len, 1.0f);
  const size_t n = out_elems(&p), wsb = ws_bytes_for(&p, max_len(&p), p.chunk);
  assert_true(wsb % 256 == 0);
  float *want = (float *)xmalloc(n * sizeof(float));
  float *got = (float *)xmalloc(n * sizeof(float));
  float *d_out;
  void *d_ws;
  CUDA_OK(cudaMalloc((void **)&d_out, n * sizeof(float)));
  CUDA_OK(cudaMalloc(&d_ws, wsb));
  run_cuda_contig(&p, d_out, d_ws, wsb, want);
  /* [workspace | out | q] */
  const size_t out_bytes = n * sizeof(float), q_bytes = n * 2u;
  char *d_all;
  CUDA_OK(cudaMalloc((void **)&d_all, wsb + out_bytes + q_bytes));
  CUDA_OK(cudaMemcpy(d_all + wsb + out_bytes, p.q, q_bytes, cudaMemcpyHostToDevice));
  uint16_t *d_q_keep = p.d_q;
  p.d_q = (uint16_t *)(void *)(d_all + wsb + out_bytes);
  run_cuda_contig(&p, (float *)(void *)(d_all + wsb), d_all, wsb, got);
  assert_memory_equal(got, want, out_bytes);
  /* Overlapping: refused, nothing enqueued (the poison stays). */
  CUDA_OK(cudaMemset(d_all, 0xFF, wsb + out_bytes));
  akv_attention_args a = make_args(&p, true, (float *)(void *)(d_all + wsb - 16), d_all, wsb);
  assert_int_equal(akv_attention_decode_cuda(&a, 0), AKV_ERR_INVALID_ARGUMENT);
  a = make_args(&p, true, (float *)(void *)(d_all + wsb), d_all, wsb);
  a.q = d_all + wsb + out_bytes - 16;
  assert_int_equal(akv_attention_decode_cuda(&a, 0), AKV_ERR_INVALID_ARGUMENT);
  CUDA_OK(cudaDeviceSynchronize());
  unsigned char *back = (unsigned char *)xmalloc(wsb + out_bytes);
  CUDA_OK(cudaMemcpy(back, d_all, wsb + out_bytes, cudaMemcpyDeviceToHost));
  for (size_t i = 0; i < wsb + out_bytes; ++i) assert_int_equal(back[i], 0xFF);
  free(back);
  p.d_q = d_q_keep;
  CUDA_OK(cudaFree(d_all));
  CUDA_OK(cudaFree(d_out));
  CUDA_OK(cudaFree(d_ws));
  free(want);
  free(got);
  problem_free(&p);
}

int main(void) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count == 0) {
    printf("SKIP: no CUDA device (%s)\n",
           err != cudaSuccess ? cudaGetErrorString(err) : "device count 0");
    return 77;
  }
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_llama_geometry),
      cmocka_unit_test(test_head_dims_and_groups),
      cmocka_unit_test(test_zero_lengths_and_many_contexts),
      cmocka_unit_test(test_invalid_arguments),
      cmocka_unit_test(test_paged_overflow_marks_context),
      cmocka_unit_test(test_paged_null_indices),
      cmocka_unit_test(test_long_history),
      cmocka_unit_test(test_fp8),
      cmocka_unit_test(test_fp8_invalid_arguments),
      cmocka_unit_test(test_fused_matches_two_kernels),
      cmocka_unit_test(test_graph_replay_and_workspace_reuse),
      cmocka_unit_test(test_nonfinite_matches_reference),
      cmocka_unit_test(test_adjacent_device_buffers),
  };
  return cmocka_run_group_tests_name("gpu_attention", tests, NULL, NULL);
}
