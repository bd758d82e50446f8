/*
 * test_gpu_faults.cu - fault injection through the operations table on the
 * CUDA backend (DESIGN §7, §9), for a reduced set of points: for each kind of
 * fallible operation, its first, middle and last occurrence in a two-step
 * decode is failed in turn. Every run must return a failure status, quarantine
 * (or, when the fault hits quarantine's own drain, report the uncertain fence
 * and keep everything retained), and lose no host row that was authoritative
 * before the failing step.
 *
 * Exits 77 (skipped) on a machine without a usable CUDA device.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <vector>

extern "C" {
#include <cmocka.h>
}

#include "akv.h"
#include "akv_cuda.h"

static const uint32_t LAYERS = 3, KVH = 2, HD = 64, PT = 64, NCTX = 2, STEPS = 3;
static const uint32_t ROW_ELEMS = KVH * HD;
static const uint32_t PREFILL[NCTX] = {130, 67};

__host__ __device__ static inline uint16_t elem(uint32_t ctx, uint32_t layer, uint32_t token,
                                                uint32_t kv, uint32_t j) {
  uint32_t x = ctx * 0x9E3779B1u ^ layer * 0x85EBCA77u ^ token * 0xC2B2AE3Du ^ kv * 0x27D4EB2Fu ^
               j * 0x165667B1u;
  x ^= x >> 15;
  x *= 0x2C1B3C6Du;
  x ^= x >> 12;
  return (uint16_t)(0x3c00u | (x & 0x3ffu));
}

struct rows_args {
  uint8_t *base;
  uint64_t stride, v_offset, row_stride;
  uint32_t len[NCTX];
  uint32_t layer;
};

__global__ void write_rows(rows_args a) {
  uint32_t i = blockIdx.x;
  uint16_t *k = (uint16_t *)(a.base + i * a.stride + (uint64_t)a.len[i] * a.row_stride);
  uint16_t *v = (uint16_t *)(a.base + i * a.stride + a.v_offset + (uint64_t)a.len[i] * a.row_stride);
  for (uint32_t j = threadIdx.x; j < ROW_ELEMS; j += blockDim.x) {
    k[j] = elem(i, a.layer, a.len[i], 0, j);
    v[j] = elem(i, a.layer, a.len[i], 1, j);
  }
}

static int hook(void *, const akv_view *view, akv_stream stream) {
  rows_args a;
  a.base = (uint8_t *)view->base;
  a.stride = view->context_stride;
  a.v_offset = view->v_offset;
  a.row_stride = view->row_stride;
  a.layer = view->layer;
  for (uint32_t i = 0; i < view->n_contexts; i++) a.len[i] = view->len[i];
  write_rows<<<view->n_contexts, 128, 0, akv_stream_to_cuda(stream)>>>(a);
  return cudaGetLastError() == cudaSuccess ? 0 : 1;
}

static void quiet(void *, akv_log_level, const char *msg) {
  if (getenv("AKVT_VERBOSE")) fprintf(stderr, "  [akv] %s\n", msg);
}

struct outcome {
  akv_status status;       /* first failing call's status */
  int create_failed;
  int quarantine_ok;       /* quarantine established completion */
  int uncertain;           /* quarantine reported an uncertain fence */
  int destroyed;
  uint64_t rows_bad;
  uint64_t ops[AKV_OP_KIND_COUNT];
};

/* Runs the decode with a fault at (nth, kind); 0 = no fault. */
static outcome run(uint32_t nth, int32_t kind) {
  outcome o;
  memset(&o, 0, sizeof(o));
  akv_engine_config ec = AKV_ENGINE_CONFIG_INIT;
  ec.backend = AKV_BACKEND_CUDA;
  ec.n_dense_layers = LAYERS;
  ec.kv_heads = KVH;
  ec.head_dim = HD;
  ec.max_tokens = 256;
  ec.page_tokens = PT;
  ec.max_contexts = NCTX;
  ec.host_pool_gib = 1;
  ec.device_pool_gib = 1;
  ec.route = AKV_ROUTE_ARENA;
  ec.log_fn = quiet;
  ec.fault_fail_nth = nth;
  ec.fault_kind = kind;
  akv_engine *e = NULL;
  cudaStream_t s;
  akv_context *ctx[NCTX] = {NULL, NULL};
  uint32_t done_steps = 0;
  o.status = akv_engine_create(&ec, &e);
  if (o.status != AKV_OK) {
    o.create_failed = 1;
    return o;
  }
  if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess) fail_msg("stream");
  {
    std::vector<uint16_t> kb(256 * ROW_ELEMS), vb(256 * ROW_ELEMS);
    for (uint32_t i = 0; i < NCTX && o.status == AKV_OK; i++) {
      std::vector<const void *> kp(LAYERS), vp(LAYERS);
      std::vector<std::vector<uint16_t>> store(2 * LAYERS);
      for (uint32_t l = 0; l < LAYERS; l++) {
        store[2 * l].resize((size_t)PREFILL[i] * ROW_ELEMS);
        store[2 * l + 1].resize((size_t)PREFILL[i] * ROW_ELEMS);
        for (uint32_t t = 0; t < PREFILL[i]; t++)
          for (uint32_t j = 0; j < ROW_ELEMS; j++) {
            store[2 * l][(size_t)t * ROW_ELEMS + j] = elem(i, l, t, 0, j);
            store[2 * l + 1][(size_t)t * ROW_ELEMS + j] = elem(i, l, t, 1, j);
          }
        kp[l] = store[2 * l].data();
        vp[l] = store[2 * l + 1].data();
      }
      o.status = akv_context_open(e, NULL, &ctx[i]);
      if (o.status == AKV_OK) o.status = akv_context_append(ctx[i], PREFILL[i], kp.data(), vp.data());
    }
  }
  for (uint32_t st = 0; st < STEPS && o.status == AKV_OK; st++) {
    akv_lease *lease[LAYERS];
    o.status = akv_step_begin(e, ctx, NCTX);
    for (uint32_t l = 0; l < LAYERS && o.status == AKV_OK; l++) {
      akv_fence attn, tail;
      o.status = akv_lease_begin(e, l, &lease[l]);
      if (o.status == AKV_OK && l >= 2) o.status = akv_lease_retire(lease[l - 2], NULL);
      if (o.status == AKV_OK)
        o.status = akv_lease_attend(lease[l], akv_stream_from_cuda(s), hook, NULL, &attn);
      if (o.status == AKV_OK) o.status = akv_lease_write_back(lease[l], NULL, 0, &tail);
      if (o.status == AKV_OK) o.status = akv_lease_seal(lease[l], tail, attn);
    }
    for (uint32_t l = LAYERS - 2; l < LAYERS && o.status == AKV_OK; l++)
      o.status = akv_lease_retire(lease[l], NULL);
    if (o.status == AKV_OK) o.status = akv_step_end(e);
    if (o.status == AKV_OK) done_steps++;
  }
  if (o.status != AKV_OK) {
    akv_quarantine_report q;
    akv_status qs = akv_engine_quarantine(e, &q);
    o.quarantine_ok = qs == AKV_OK;
    o.uncertain = qs == AKV_ERR_UNCERTAIN_FENCE;
  }
  /* Every row that was authoritative before the failing step, unchanged. */
  for (uint32_t i = 0; i < NCTX; i++) {
    uint32_t len = 0;
    if (ctx[i] == NULL || akv_context_length(ctx[i], &len) != AKV_OK) continue;
    if (len != PREFILL[i] + done_steps) o.rows_bad += 1;
    std::vector<uint16_t> k((size_t)len * ROW_ELEMS), v((size_t)len * ROW_ELEMS);
    for (uint32_t l = 0; l < LAYERS; l++) {
      akv_status rs = akv_context_read(ctx[i], l, 0, len, k.data(), v.data());
      if (rs != AKV_OK) {
        /* retained on an uncertain fence: the slot is still leased */
        if (!(o.uncertain && rs == AKV_ERR_IN_USE)) o.rows_bad += len;
        continue;
      }
      for (uint32_t t = 0; t < len; t++)
        for (uint32_t j = 0; j < ROW_ELEMS; j++)
          if (k[(size_t)t * ROW_ELEMS + j] != elem(i, l, t, 0, j) ||
              v[(size_t)t * ROW_ELEMS + j] != elem(i, l, t, 1, j)) {
            o.rows_bad++;
            t = len;
            break;
          }
    }
  }
  akv_engine_info info;
  if (akv_engine_info_get(e, &info) == AKV_OK) memcpy(o.ops, info.backend_ops, sizeof(o.ops));
  cudaStreamSynchronize(s);
  cudaStreamDestroy(s);
  akv_status ds = akv_engine_destroy(e);
  o.destroyed = ds == AKV_OK;
  if (o.uncertain) assert_int_equal(ds, AKV_ERR_BUSY); /* retained, reported, never freed */
  return o;
}

static void test_clean_run_then_faults(void **) {
  outcome clean = run(0, -1);
  assert_int_equal(clean.status, AKV_OK);
  assert_int_equal(clean.rows_bad, 0);
  assert_true(clean.destroyed);
  const akv_op_kind kinds[] = {AKV_OP_ALLOC, AKV_OP_COPY, AKV_OP_RECORD, AKV_OP_WAIT, AKV_OP_SYNC};
  uint32_t runs = 0, uncertain = 0;
  for (akv_op_kind k : kinds) {
    uint64_t n = clean.ops[k];
    assert_true(n > 0);
    const uint64_t points[] = {1, (n + 1) / 2, n};
    for (uint64_t p : points) {
      outcome o = run((uint32_t)p, (int32_t)k);
      runs++;
      if (o.status == AKV_OK) fail_msg("kind %d op %llu: no failure reported", k, (unsigned long long)p);
      if (o.create_failed) {
        assert_true(o.status == AKV_ERR_OUT_OF_MEMORY || o.status == AKV_ERR_BACKEND);
        continue;
      }
      assert_int_equal(o.status, AKV_ERR_BACKEND);
      if (o.uncertain) uncertain++;
      else assert_true(o.quarantine_ok && o.destroyed);
      if (o.rows_bad != 0)
        fail_msg("kind %d op %llu: %llu host rows lost or changed", k, (unsigned long long)p,
                 (unsigned long long)o.rows_bad);
    }
  }
  printf("cuda fault injection: %u runs (first/middle/last op of 5 kinds), %u with an uncertain "
         "fence retained; no host row lost\n", runs, uncertain);
}

int main(void) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    printf("SKIP: no CUDA device\n");
    return 77;
  }
  const struct CMUnitTest tests[] = {cmocka_unit_test(test_clean_run_then_faults)};
  return cmocka_run_group_tests(tests, NULL, NULL);
}
