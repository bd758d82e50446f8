/*
 * test_cuda_args.c - the CUDA launchers' argument checks (akv_cuda.h) that
 * refuse a call before it touches the device, so they run on a machine
 * without a GPU (label cpu). Every pointer is a fake, aligned, non-NULL
 * device address that a refused call never dereferences.
 *
 * Teeth: each refused call differs from a baseline in one field. Without a
 * CUDA device the baseline passes every check and fails at the launch
 * (AKV_ERR_BACKEND), which proves the refusals come from the field under
 * test; with a device the baseline is not called (the fake pointers would be
 * launched on) and tests/gpu/test_gpu_attention.cu covers the launches.
 *
 * Parity: where the reference refuses a call before it reads a row, it runs
 * on the same arguments and must return the same status
 * (test_cuda_same_status_as_reference).
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include "akv_cuda.h"

#define KV_HEADS 2u
#define N_HEADS 4u
#define HEAD_DIM 64u
#define ROW_BYTES ((uint64_t)KV_HEADS * HEAD_DIM * 2u)

/* Fake device addresses, 256-byte aligned; never dereferenced. */
#define FAKE(n) ((void *)(uintptr_t)(0x7f0000000000ull + (uint64_t)(n) * 0x100000ull))
/* Fake addresses of what a call writes, 16 TiB apart and below FAKE(0):
 * the workspaces and outputs of the largest geometries below (about 1 TiB)
 * meet nothing the call reads (akv_attention.h, "Overlap"). */
#define FAR(n) ((void *)(uintptr_t)((uint64_t)(n) * 0x100000000000ull))

static int have_device(void) {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

static uint32_t g_len[2] = {5, 3};
static float g_ks[KV_HEADS] = {1.0f, 1.0f}, g_vs[KV_HEADS] = {1.0f, 1.0f};

static akv_attention_args contig(void) {
  akv_attention_args a;
  memset(&a, 0, sizeof a);
  a.dtype = AKV_DTYPE_BF16;
  a.n_contexts = 2;
  a.n_heads = N_HEADS;
  a.kv_heads = KV_HEADS;
  a.head_dim = HEAD_DIM;
  a.chunk_tokens = 4;
  a.scale = 0.125f;
  a.q = FAKE(1);
  a.k_base = FAKE(2);
  a.v_base = FAKE(3);
  a.context_stride = 8 * ROW_BYTES;
  a.row_bytes = ROW_BYTES;
  a.len = g_len;
  a.out = (float *)FAR(2);
  a.workspace = FAR(1);
  a.workspace_bytes = (size_t)1 << 20;
  return a;
}

static akv_attention_paged_args paged(akv_page_table *t) {
  akv_attention_paged_args pa;
  memset(&pa, 0, sizeof pa);
  pa.dtype = AKV_DTYPE_BF16;
  pa.n_heads = N_HEADS;
  pa.kv_heads = KV_HEADS;
  pa.head_dim = HEAD_DIM;
  pa.scale = 0.125f;
  pa.q = FAKE(1);
  pa.out = (float *)FAR(2);
  pa.workspace = FAR(1);
  pa.workspace_bytes = (size_t)1 << 20;
  memset(t, 0, sizeof *t);
  t->batch = 2;
  t->page_tokens = 4;
  t->max_pages = 2;
  t->indptr = (const uint32_t *)FAKE(6);
  t->indices = (const uint32_t *)FAKE(7);
  t->last_page_len = (const uint32_t *)FAKE(8);
  t->k_pages = FAKE(9);
  t->v_pages = FAKE(10);
  t->page_stride = 4 * ROW_BYTES;
  t->row_bytes = ROW_BYTES;
  return pa;
}

/* The baselines pass every check (no device: the launch fails). */
static void baselines(void) {
  if (have_device()) {
    print_message("CUDA device present: baselines not launched on fake pointers\n");
    return;
  }
  akv_attention_args a = contig();
  assert_int_equal(akv_attention_decode_cuda(&a, 0), AKV_ERR_BACKEND);
  a.dtype = AKV_DTYPE_FP8_E4M3;
  a.row_bytes = a.context_stride = 16 * KV_HEADS * HEAD_DIM;
  a.k_scale = g_ks;
  a.v_scale = g_vs;
  assert_int_equal(akv_attention_decode_cuda(&a, 0), AKV_ERR_BACKEND);
  akv_page_table t;
  akv_attention_paged_args pa = paged(&t);
  assert_int_equal(akv_attention_paged_cuda(&pa, t, 0), AKV_ERR_BACKEND);
}

/* A finite softmax scale (or finite K scales) whose score factor
 * scale * log2(e) * k_scale[g] overflows fp32 is refused, as in the
 * reference. */
static void test_cuda_score_factor_overflow_refused(void **state) {
  (void)state;
  baselines();
  akv_attention_args a = contig();
  a.scale = 3e38f;
  assert_int_equal(akv_attention_decode_cuda(&a, 0), AKV_ERR_INVALID_ARGUMENT);
  a.scale = -3e38f;
  assert_int_equal(akv_attention_decode_cuda(&a, 0), AKV_ERR_INVALID_ARGUMENT);
  akv_page_table t;
  akv_attention_paged_args pa = paged(&t);
  pa.scale = 3e38f;
  assert_int_equal(akv_attention_paged_cuda(&pa, t, 0), AKV_ERR_INVALID_ARGUMENT);

  float ks[KV_HEADS] = {1.0f, 1e30f};
  a = contig();
  a.dtype = AKV_DTYPE_FP8_E4M3;
  a.k_scale = ks;
  a.v_scale = g_vs;
  a.scale = 1e10f;
  assert_int_equal(akv_attention_decode_cuda(&a, 0), AKV_ERR_INVALID_ARGUMENT);
  pa = paged(&t);
  pa.k_scale = ks;
  pa.v_scale = g_vs;
  pa.scale = 1e10f;
  assert_int_equal(akv_attention_paged_cuda(&pa, t, 0), AKV_ERR_INVALID_ARGUMENT);
  if (!have_device()) {
    a.scale = 1e8f; /* the factor is finite: past the checks */
    assert_int_equal(akv_attention_decode_cuda(&a, 0), AKV_ERR_BACKEND);
  }
}

/* The device's uint32 arrays (page map, page table) are read 4 bytes at a
 * time by the kernels: a misaligned one would fault on the device (a sticky
 * error that ends the CUDA context). The host arrays (len, scales) are read
 * through their types too. All are refused. */
static void test_cuda_misaligned_arrays_refused(void **state) {
  (void)state;
  baselines();
  akv_attention_args a = contig();
  a.page_map = (const uint32_t *)((char *)FAKE(11) + 2);
  a.page_map_stride = 2;
  a.k_pages = FAKE(9);
  a.v_pages = FAKE(10);
  a.page_stride = 4 * ROW_BYTES;
  assert_int_equal(akv_attention_decode_cuda(&a, 0), AKV_ERR_INVALID_ARGUMENT);
  if (!have_device()) {
    a.page_map = (const uint32_t *)FAKE(11);
    assert_int_equal(akv_attention_decode_cuda(&a, 0), AKV_ERR_BACKEND);
  }

  _Alignas(16) unsigned char buf[2][32];
  memcpy(buf[0] + 1, g_len, sizeof g_len);
  a = contig();
  a.len = (const uint32_t *)(void *)(buf[0] + 1);
  assert_int_equal(akv_attention_decode_cuda(&a, 0), AKV_ERR_INVALID_ARGUMENT);

  memcpy(buf[1] + 2, g_ks, sizeof g_ks);
  a = contig();
  a.dtype = AKV_DTYPE_FP8_E4M3;
  a.k_scale = (const float *)(void *)(buf[1] + 2);
  a.v_scale = g_vs;
  assert_int_equal(akv_attention_decode_cuda(&a, 0), AKV_ERR_INVALID_ARGUMENT);
  a.k_scale = g_ks;
  a.v_scale = (const float *)(void *)(buf[1] + 2);
  assert_int_equal(akv_attention_decode_cuda(&a, 0), AKV_ERR_INVALID_ARGUMENT);

  akv_page_table t;
  akv_attention_paged_args pa = paged(&t);
  t.indptr = (const uint32_t *)((char *)FAKE(6) + 1);
  assert_int_equal(akv_attention_paged_cuda(&pa, t, 0), AKV_ERR_INVALID_ARGUMENT);
  pa = paged(&t);
  t.indices = (const uint32_t *)((char *)FAKE(7) + 2);
  assert_int_equal(akv_attention_paged_cuda(&pa, t, 0), AKV_ERR_INVALID_ARGUMENT);
  pa = paged(&t);
  t.last_page_len = (const uint32_t *)((char *)FAKE(8) + 3);
  assert_int_equal(akv_attention_paged_cuda(&pa, t, 0), AKV_ERR_INVALID_ARGUMENT);
}

/* The grid limits akv_cuda.h states: the call just inside each passes the
 * checks (no device: the launch fails), the one just past it is refused. */
static void test_cuda_grid_limits(void **state) {
  (void)state;
  const int dev = have_device();
  akv_attention_args a = contig();
  a.workspace_bytes = SIZE_MAX;
  /* kv_heads * ceil(group / 8): 65535 * 1, then 65536 * 1 and 32768 * 2. */
  a.kv_heads = a.n_heads = 65535;
  a.row_bytes = (uint64_t)a.kv_heads * HEAD_DIM * 2u;
  a.context_stride = 8 * a.row_bytes;
  if (!dev) assert_int_equal(akv_attention_decode_cuda(&a, 0), AKV_ERR_BACKEND);
  a.kv_heads = a.n_heads = 65536;
  a.row_bytes = (uint64_t)a.kv_heads * HEAD_DIM * 2u;
  a.context_stride = 8 * a.row_bytes;
  assert_int_equal(akv_attention_decode_cuda(&a, 0), AKV_ERR_INVALID_ARGUMENT);
  a.kv_heads = 32768;
  a.n_heads = 32768 * 9;
  a.row_bytes = (uint64_t)a.kv_heads * HEAD_DIM * 2u;
  a.context_stride = 8 * a.row_bytes;
  assert_int_equal(akv_attention_decode_cuda(&a, 0), AKV_ERR_INVALID_ARGUMENT);
  a.n_heads = 32768 * 8; /* ceil(8 / 8) = 1 */
  if (!dev) assert_int_equal(akv_attention_decode_cuda(&a, 0), AKV_ERR_BACKEND);

  /* Piece slots times that figure: chunks of one row. */
  uint32_t len[1] = {0x7FFFFFFFu};
  a = contig();
  a.workspace_bytes = SIZE_MAX;
  a.n_contexts = 1;
  a.n_heads = a.kv_heads = 1;
  a.row_bytes = a.context_stride = HEAD_DIM * 2u;
  a.chunk_tokens = 1;
  a.len = len;
  if (!dev) assert_int_equal(akv_attention_decode_cuda(&a, 0), AKV_ERR_BACKEND);
  len[0] = 0x80000000u;
  assert_int_equal(akv_attention_decode_cuda(&a, 0), AKV_ERR_INVALID_ARGUMENT);
  len[0] = 0x40000000u; /* 2^30 slots times 2 kv heads: 2^31 */
  a.n_heads = a.kv_heads = 2;
  a.row_bytes = a.context_stride = 2u * HEAD_DIM * 2u;
  assert_int_equal(akv_attention_decode_cuda(&a, 0), AKV_ERR_INVALID_ARGUMENT);

  akv_page_table t;
  akv_attention_paged_args pa = paged(&t);
  pa.workspace_bytes = SIZE_MAX;
  pa.n_heads = pa.kv_heads = 1;
  t.row_bytes = HEAD_DIM * 2u;
  t.page_tokens = 1;
  t.max_pages = 0x7FFFFFFFu;
  if (!dev) assert_int_equal(akv_attention_paged_cuda(&pa, t, 0), AKV_ERR_BACKEND);
  t.max_pages = 0x80000000u;
  assert_int_equal(akv_attention_paged_cuda(&pa, t, 0), AKV_ERR_INVALID_ARGUMENT);
}

/* A table without pages may leave indices NULL (akv_attention.h, "Empty
 * arrays"), as the reference takes it: the launcher cannot read indptr, so it
 * takes a NULL indices whatever max_pages says and then reads no page (a
 * context that has pages gets NaN). No device: the calls pass every check
 * and fail at the launch. */
static void test_cuda_paged_null_indices_taken(void **state) {
  (void)state;
  baselines();
  if (have_device()) return; /* tests/gpu/test_gpu_attention.cu runs it */
  akv_page_table t;
  akv_attention_paged_args pa = paged(&t);
  t.indices = NULL;
  assert_int_equal(akv_attention_paged_cuda(&pa, t, 0), AKV_ERR_BACKEND);
  t.max_pages = 0;
  pa.workspace = NULL;
  pa.workspace_bytes = 0;
  assert_int_equal(akv_attention_paged_cuda(&pa, t, 0), AKV_ERR_BACKEND);
  /* The other arrays always have elements: NULL stays refused. */
  pa = paged(&t);
  t.indices = NULL;
  t.indptr = NULL;
  assert_int_equal(akv_attention_paged_cuda(&pa, t, 0), AKV_ERR_INVALID_ARGUMENT);
  pa = paged(&t);
  t.indices = NULL;
  t.last_page_len = NULL;
  assert_int_equal(akv_attention_paged_cuda(&pa, t, 0), AKV_ERR_INVALID_ARGUMENT);
}

/* The refusals below come before the reference reads anything but len (a
 * host array here too), so it runs on the same fake pointers: both give the
 * same status. */
static void expect_both_refuse(const akv_attention_args *a) {
  assert_int_equal(akv_attention_decode_cuda(a, 0), AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_attention_ref_bf16(a), AKV_ERR_INVALID_ARGUMENT);
}
static void expect_both_refuse_paged(const akv_attention_paged_args *pa, akv_page_table t) {
  assert_int_equal(akv_attention_paged_cuda(pa, t, 0), AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_attention_paged_ref_bf16(pa, t), AKV_ERR_INVALID_ARGUMENT);
}

/* AKV_ATTENTION_MAX_CHUNK_TOKENS: piece row offsets within a chunk are 32
 * bits in the kernels; a larger chunk is refused whatever the lengths (here
 * all 0: nothing would be read), the largest one is taken. */
static void test_cuda_chunk_tokens_limit(void **state) {
  (void)state;
  const int dev = have_device();
  static uint32_t none[2] = {0, 0};
  akv_attention_args a = contig();
  a.len = none;
  a.workspace = NULL;
  a.workspace_bytes = 0;
  a.chunk_tokens = AKV_ATTENTION_MAX_CHUNK_TOKENS;
  if (!dev) assert_int_equal(akv_attention_decode_cuda(&a, 0), AKV_ERR_BACKEND);
  a.chunk_tokens = AKV_ATTENTION_MAX_CHUNK_TOKENS + 1u;
  expect_both_refuse(&a);
  a.chunk_tokens = UINT32_MAX;
  expect_both_refuse(&a);
  /* With rows: a context of UINT32_MAX rows in one chunk, refused before the
   * rows' offsets are even looked at. */
  static uint32_t full[2] = {UINT32_MAX, 1};
  a = contig();
  a.len = full;
  a.workspace_bytes = SIZE_MAX;
  a.chunk_tokens = UINT32_MAX;
  expect_both_refuse(&a);

  akv_page_table t;
  akv_attention_paged_args pa = paged(&t);
  pa.workspace_bytes = SIZE_MAX;
  t.page_tokens = AKV_ATTENTION_MAX_CHUNK_TOKENS;
  if (!dev) assert_int_equal(akv_attention_paged_cuda(&pa, t, 0), AKV_ERR_BACKEND);
  t.page_tokens = AKV_ATTENTION_MAX_CHUNK_TOKENS + 1u;
  expect_both_refuse_paged(&pa, t);
  t.page_tokens = UINT32_MAX;
  expect_both_refuse_paged(&pa, t);
}

/* Status parity: every refusal the reference makes before it reads a row
 * (here: before it reads anything but len and the scales, host arrays on
 * both sides) is made by the launcher with the same status, one field off
 * the baseline at a time. Shared rules only: what CUDA alone asks for
 * (alignment to 16 bytes, head_dim 64/128/256, the grid limits) is tested
 * above, and the table's contents, device memory to the launcher, are the
 * reference's alone (akv_cuda.h says what CUDA does with them). */
static void test_cuda_same_status_as_reference(void **state) {
  (void)state;
  baselines();
  static uint32_t huge_len[2] = {UINT32_MAX, 3};
  size_t wsb = 0;
  assert_int_equal(akv_attention_workspace_bytes(2, N_HEADS, HEAD_DIM, 5, 4, &wsb), AKV_OK);
  float nan_scale[KV_HEADS] = {1.0f, NAN}, zero_scale[KV_HEADS] = {1.0f, 0.0f};
#define SAME(mutation, status)                                        \
  do {                                                                \
    akv_attention_args a = contig();                                  \
    mutation;                                                         \
    assert_int_equal(akv_attention_ref_bf16(&a), status);             \
    assert_int_equal(akv_attention_decode_cuda(&a, 0), status);       \
  } while (0)
  SAME(a.q = NULL, AKV_ERR_INVALID_ARGUMENT);
  SAME(a.out = NULL, AKV_ERR_INVALID_ARGUMENT);
  SAME(a.n_heads = 0, AKV_ERR_INVALID_ARGUMENT);
  SAME(a.kv_heads = 0, AKV_ERR_INVALID_ARGUMENT);
  SAME(a.n_heads = 3, AKV_ERR_INVALID_ARGUMENT);
  SAME(a.head_dim = 0, AKV_ERR_INVALID_ARGUMENT);
  SAME(a.head_dim = AKV_ATTENTION_MAX_HEAD_DIM + 16u, AKV_ERR_INVALID_ARGUMENT);
  SAME(a.dtype = AKV_DTYPE_F32, AKV_ERR_NOT_SUPPORTED);
  SAME(a.dtype = (akv_dtype)77, AKV_ERR_NOT_SUPPORTED);
  SAME(a.row_bytes = ROW_BYTES - 16u, AKV_ERR_INVALID_ARGUMENT);
  SAME(a.k_scale = g_ks, AKV_ERR_INVALID_ARGUMENT);
  SAME(a.v_scale = g_vs, AKV_ERR_INVALID_ARGUMENT);
  SAME(a.dtype = AKV_DTYPE_FP8_E5M2, AKV_ERR_INVALID_ARGUMENT);
  SAME((a.k_scale = nan_scale, a.v_scale = g_vs), AKV_ERR_INVALID_ARGUMENT);
  SAME((a.k_scale = g_ks, a.v_scale = zero_scale), AKV_ERR_INVALID_ARGUMENT);
  SAME(a.scale = INFINITY, AKV_ERR_INVALID_ARGUMENT);
  SAME(a.scale = NAN, AKV_ERR_INVALID_ARGUMENT);
  SAME(a.n_contexts = 0, AKV_ERR_INVALID_ARGUMENT);
  SAME(a.chunk_tokens = 0, AKV_ERR_INVALID_ARGUMENT);
  SAME(a.chunk_tokens = AKV_ATTENTION_MAX_CHUNK_TOKENS + 1u, AKV_ERR_INVALID_ARGUMENT);
  SAME(a.len = NULL, AKV_ERR_INVALID_ARGUMENT);
  SAME(a.k_base = NULL, AKV_ERR_INVALID_ARGUMENT);
  SAME(a.v_base = NULL, AKV_ERR_INVALID_ARGUMENT);
  SAME((a.page_map = (const uint32_t *)FAKE(11), a.page_map_stride = 0),
       AKV_ERR_INVALID_ARGUMENT);
  SAME((a.page_map = (const uint32_t *)FAKE(11), a.page_map_stride = 2, a.v_pages = FAKE(10)),
       AKV_ERR_INVALID_ARGUMENT);
  SAME(a.context_stride = UINT64_MAX - 15u, AKV_ERR_INVALID_ARGUMENT);
  SAME((a.len = huge_len, a.row_bytes = a.context_stride = (uint64_t)1 << 40),
       AKV_ERR_INVALID_ARGUMENT);
  SAME(a.workspace_bytes = wsb - 1u, AKV_ERR_INVALID_ARGUMENT);
  SAME((a.workspace = NULL, a.workspace_bytes = wsb), AKV_ERR_INVALID_ARGUMENT);
#undef SAME
  /* The paged variants refuse these before the reference reads the table. */
#define SAME_PAGED(mutation, status)                                  \
  do {                                                                \
    akv_page_table t;                                                 \
    akv_attention_paged_args pa = paged(&t);                          \
    mutation;                                                         \
    assert_int_equal(akv_attention_paged_ref_bf16(&pa, t), status);   \
    assert_int_equal(akv_attention_paged_cuda(&pa, t, 0), status);    \
  } while (0)
  SAME_PAGED(pa.q = NULL, AKV_ERR_INVALID_ARGUMENT);
  SAME_PAGED(pa.dtype = AKV_DTYPE_F16, AKV_ERR_NOT_SUPPORTED);
  SAME_PAGED(t.row_bytes = ROW_BYTES - 16u, AKV_ERR_INVALID_ARGUMENT);
  SAME_PAGED(pa.scale = -INFINITY, AKV_ERR_INVALID_ARGUMENT);
  SAME_PAGED(t.batch = 0, AKV_ERR_INVALID_ARGUMENT);
  SAME_PAGED(t.page_tokens = 0, AKV_ERR_INVALID_ARGUMENT);
  SAME_PAGED(t.page_tokens = UINT32_MAX, AKV_ERR_INVALID_ARGUMENT);
  SAME_PAGED(t.indptr = NULL, AKV_ERR_INVALID_ARGUMENT);
  SAME_PAGED(t.last_page_len = NULL, AKV_ERR_INVALID_ARGUMENT);
  SAME_PAGED(t.k_pages = NULL, AKV_ERR_INVALID_ARGUMENT);
  SAME_PAGED(t.v_pages = NULL, AKV_ERR_INVALID_ARGUMENT);
  SAME_PAGED(t.indptr = (const uint32_t *)((char *)FAKE(6) + 2), AKV_ERR_INVALID_ARGUMENT);
#undef SAME_PAGED
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_cuda_score_factor_overflow_refused),
      cmocka_unit_test(test_cuda_misaligned_arrays_refused),
      cmocka_unit_test(test_cuda_grid_limits),
      cmocka_unit_test(test_cuda_paged_null_indices_taken),
      cmocka_unit_test(test_cuda_chunk_tokens_limit),
      cmocka_unit_test(test_cuda_same_status_as_reference),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
