/*
 * test_gpu_cells.cu - bitwise cells on the GPU (DESIGN §9): stage, arena and
 * paged routes over context lengths (1, page-1, page, page+1, odd, 31,744), device
 * pools (0, tight, roomy) and 1 or 4 contexts. Each cell runs several decode
 * steps through the CUDA engine with the library's CUDA attention as the hook
 * and compares every attention output bit for bit against the same kernel
 * over a fully resident device copy of the history. After the run the host
 * rows (prefill plus every written-back row) are compared byte for byte.
 * Every route runs its cells twice: bf16 rows, and FP8 E4M3 rows (one byte
 * per element: half the staged bytes) attended with per-(layer, KV head)
 * scales.
 *
 * Headroom cells (DESIGN §6): arena and paged with revocable headroom, a
 * 0 GiB pool whose history lives in headroom, and a tight pool plus headroom
 * whose headroom is all given back in the middle of step 2 (leases in
 * flight); after that step's end a cudaMalloc of the released size must
 * succeed and decode goes on bit-identically.
 *
 * Exits 77 (skipped) on a machine without a usable CUDA device.
 * AKV_CELLS_QUICK=1 keeps only lengths 1, page-1 and page+1 (for sanitizer runs).
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

#define CK(x)                                                                        \
  do {                                                                               \
    cudaError_t e_ = (x);                                                            \
    if (e_ != cudaSuccess) fail_msg("%s: %s", #x, cudaGetErrorString(e_));           \
  } while (0)
#define AK(x)                                                                        \
  do {                                                                               \
    akv_status s_ = (x);                                                             \
    if (s_ != AKV_OK) fail_msg("%s: %s", #x, akv_status_string(s_));                 \
  } while (0)

static const uint32_t LAYERS = 2, KVH = 8, HD = 128, QH = 32, PT = 256, STEPS = 3;
static const uint32_t ROW_ELEMS = KVH * HD;

static uint64_t row_bytes_of(akv_dtype dt) { return (uint64_t)ROW_ELEMS * (dt == AKV_DTYPE_BF16 ? 2 : 1); }

/* The K (kv 0) and V (kv 1) scale of KV head h in layer l of the FP8 cells. */
static float cell_scale(uint32_t l, uint32_t h, uint32_t kv) {
  return 0.0625f * (1.0f + 0.125f * (float)((l * 3u + h + kv * 5u) % 7u));
}

/* bf16 bit pattern of element j of (ctx, layer, token, kv): integer-only, so
 * host and device produce the same bits. Magnitudes in [2^-7, 1). */
__host__ __device__ static inline uint16_t cell_elem(uint32_t salt, uint32_t ctx, uint32_t layer,
                                                     uint32_t token, uint32_t kv, uint32_t j) {
  uint64_t x = ((uint64_t)salt << 56) ^ ((uint64_t)ctx << 48) ^ ((uint64_t)layer << 40) ^
               ((uint64_t)token << 16) ^ ((uint64_t)kv << 15) ^ j;
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  x ^= x >> 31;
  uint32_t sign = (uint32_t)(x >> 63);
  uint32_t expo = 120u + (uint32_t)((x >> 32) % 7u);
  uint32_t mant = (uint32_t)(x & 0x7fu);
  return (uint16_t)((sign << 15) | (expo << 7) | mant);
}

/* The FP8 E4M3 code of the same element: the bf16 pattern's sign and low
 * mantissa bits, an exponent field in 1..9 (values 2^-6 .. 7.5), never NaN. */
__host__ __device__ static inline uint8_t cell_elem8(uint32_t salt, uint32_t ctx, uint32_t layer,
                                                     uint32_t token, uint32_t kv, uint32_t j) {
  const uint16_t b = cell_elem(salt, ctx, layer, token, kv, j);
  const uint32_t e = 1u + (uint32_t)(((b >> 7) ^ (b >> 3)) % 9u);
  return (uint8_t)(((b >> 8) & 0x80u) | (e << 3) | (b & 7u));
}

/* Writes the new row (token = len[i]) of each context at row len[i] of the
 * given K/V layout. grid.x = contexts, block covers ROW_ELEMS. */
struct new_rows_args {
  uint8_t *k_base, *v_base;
  uint64_t context_stride, row_stride;
  uint32_t len[8];
  uint32_t ctx_id[8];
  uint32_t layer;
  uint32_t fp8; /* 1: E4M3 codes, 0: bf16 */
};

__global__ void write_new_rows(new_rows_args a) {
  uint32_t i = blockIdx.x;
  uint8_t *k = a.k_base + i * a.context_stride + (uint64_t)a.len[i] * a.row_stride;
  uint8_t *v = a.v_base + i * a.context_stride + (uint64_t)a.len[i] * a.row_stride;
  for (uint32_t j = threadIdx.x; j < ROW_ELEMS; j += blockDim.x) {
    if (a.fp8) {
      k[j] = cell_elem8(1, a.ctx_id[i], a.layer, a.len[i], 0, j);
      v[j] = cell_elem8(1, a.ctx_id[i], a.layer, a.len[i], 1, j);
    } else {
      ((uint16_t *)k)[j] = cell_elem(1, a.ctx_id[i], a.layer, a.len[i], 0, j);
      ((uint16_t *)v)[j] = cell_elem(1, a.ctx_id[i], a.layer, a.len[i], 1, j);
    }
  }
}

__global__ void write_queries(uint16_t *q, uint32_t n_ctx, uint32_t layer, uint32_t step) {
  uint32_t i = blockIdx.x;
  for (uint32_t j = threadIdx.x; j < QH * HD; j += blockDim.x)
    q[(uint64_t)i * QH * HD + j] = cell_elem(2, i, layer, step, 0, j);
}

struct cell {
  akv_dtype dtype;
  akv_route route;
  uint32_t n_ctx;
  uint32_t len;
  uint32_t pool_gib;   /* 0 = stage */
  uint32_t target;     /* AKV_TARGET_FAIR_SHARE = roomy */
  const char *pool_name;
  uint32_t headroom_gib;  /* 0 = off */
  int release_mid;        /* give all headroom back mid step 2 */
};

struct run_state {
  cudaStream_t stream;
  uint16_t *q;         /* [n_ctx][QH][HD] */
  float *out_staged;   /* [LAYERS][n_ctx][QH][HD] */
  void *ws;
  size_t ws_bytes;
  uint32_t n_ctx;
  uint32_t step;
  akv_route route;
  akv_dtype dtype;
};

static const char *route_name(akv_route r) {
  return r == AKV_ROUTE_ARENA ? "arena" : r == AKV_ROUTE_PAGED ? "paged" : "stage";
}

/* Writes the new rows and attends. view == NULL: the resident layout given
 * by the pointers and strides; otherwise the engine's view (staged rows and,
 * on the paged route, retained pages in place) through
 * akv_attention_args_from_view. */
static akv_status attend(run_state *rs, uint32_t layer, uint8_t *k_base, uint8_t *v_base,
                         uint64_t ctx_stride, uint64_t row_stride, const uint32_t *len,
                         float *out, const akv_view *view) {
  new_rows_args nr;
  memset(&nr, 0, sizeof(nr));
  nr.k_base = k_base;
  nr.v_base = v_base;
  nr.context_stride = ctx_stride;
  nr.row_stride = row_stride;
  nr.layer = layer;
  nr.fp8 = rs->dtype != AKV_DTYPE_BF16;
  uint32_t lens1[8];
  for (uint32_t i = 0; i < rs->n_ctx; i++) {
    nr.len[i] = len[i];
    nr.ctx_id[i] = i;
    lens1[i] = len[i] + 1;
  }
  write_new_rows<<<rs->n_ctx, 256, 0, rs->stream>>>(nr);
  write_queries<<<rs->n_ctx, 256, 0, rs->stream>>>(rs->q, rs->n_ctx, layer, rs->step);
  if (cudaGetLastError() != cudaSuccess) return AKV_ERR_BACKEND;
  akv_attention_args a;
  memset(&a, 0, sizeof(a));
  a.dtype = rs->dtype;
  float ks[KVH], vs[KVH]; /* read by the launcher during the call */
  if (rs->dtype != AKV_DTYPE_BF16) {
    for (uint32_t h = 0; h < KVH; ++h) {
      ks[h] = cell_scale(layer, h, 0);
      vs[h] = cell_scale(layer, h, 1);
    }
    a.k_scale = ks;
    a.v_scale = vs;
  }
  a.n_contexts = rs->n_ctx;
  a.kv_heads = KVH;
  a.head_dim = HD;
  a.k_base = k_base;
  a.v_base = v_base;
  a.context_stride = ctx_stride;
  a.row_bytes = row_stride;
  a.chunk_tokens = PT;
  if (view != NULL && (akv_attention_args_from_view(view, &a) != AKV_OK || a.dtype != rs->dtype))
    return AKV_ERR_BACKEND;
  if (a.chunk_tokens != PT || (view != NULL && (a.k_base != k_base || a.row_bytes != row_stride)))
    return AKV_ERR_BACKEND;
  a.n_heads = QH;
  a.scale = 0.08838834764831845f;
  a.q = rs->q;
  a.len = lens1;
  a.out = out;
  a.workspace = rs->ws;
  a.workspace_bytes = rs->ws_bytes;
  return akv_attention_decode_cuda(&a, rs->stream);
}

static int hook(void *user, const akv_view *view, akv_stream stream) {
  run_state *rs = (run_state *)user;
  uint8_t *base = (uint8_t *)view->base;
  if (akv_stream_to_cuda(stream) != rs->stream) return 1;
  if ((view->page_map != NULL) != (rs->route == AKV_ROUTE_PAGED)) return 1;
  return attend(rs, view->layer, base, base + view->v_offset, view->context_stride,
                view->row_stride, view->len,
                rs->out_staged + (uint64_t)view->layer * rs->n_ctx * QH * HD, view) == AKV_OK
             ? 0
             : 1;
}

static void silent(void *, akv_log_level level, const char *msg) {
  if (level <= AKV_LOG_WARN || getenv("AKVT_VERBOSE")) fprintf(stderr, "  [akv] %s\n", msg);
}

static void run_cell(const cell *c, uint64_t *compared) {
  const uint32_t max_tokens = ((c->len + 4 + STEPS + PT - 1) / PT) * PT;
  const uint64_t ROW_BYTES = row_bytes_of(c->dtype);
  const bool fp8 = c->dtype != AKV_DTYPE_BF16;
  akv_engine_config ec = AKV_ENGINE_CONFIG_INIT;
  ec.backend = AKV_BACKEND_CUDA;
  ec.n_dense_layers = LAYERS;
  ec.kv_heads = KVH;
  ec.head_dim = HD;
  ec.dtype = c->dtype;
  ec.max_tokens = max_tokens;
  ec.page_tokens = PT;
  ec.max_contexts = c->n_ctx;
  {
    uint64_t hist = (uint64_t)LAYERS * max_tokens * ROW_BYTES * 2 * c->n_ctx;
    ec.host_pool_gib = (uint32_t)((hist + (1ull << 30) - 1) >> 30);
  }
  ec.device_pool_gib = c->pool_gib;
  ec.route = c->route;
  /* Tight paged cells poison the staging holes (NaN): a page read from the
   * staging buffer instead of in place would show in every bit. */
  ec.poison_holes = c->route == AKV_ROUTE_PAGED && c->target != AKV_TARGET_FAIR_SHARE;
  ec.log_fn = silent;
  ec.headroom_gib = c->headroom_gib;
  akv_engine *e = NULL;
  AK(akv_engine_create(&ec, &e));
  akv_engine_info info;
  AK(akv_engine_info_get(e, &info));
  assert_int_equal(info.backend, AKV_BACKEND_CUDA);

  run_state rs;
  memset(&rs, 0, sizeof(rs));
  rs.n_ctx = c->n_ctx;
  rs.route = c->route;
  rs.dtype = c->dtype;
  CK(cudaStreamCreateWithFlags(&rs.stream, cudaStreamNonBlocking));
  CK(cudaMalloc(&rs.q, (size_t)c->n_ctx * QH * HD * 2));
  size_t out_elems = (size_t)LAYERS * c->n_ctx * QH * HD;
  float *out_res;
  CK(cudaMalloc(&rs.out_staged, out_elems * 4));
  CK(cudaMalloc(&out_res, out_elems * 4));
  AK(akv_attention_workspace_bytes(c->n_ctx, QH, HD, max_tokens, PT, &rs.ws_bytes));
  CK(cudaMalloc(&rs.ws, rs.ws_bytes));

  /* Resident reference: [ctx][layer][K|V][max_tokens][row] on the device. */
  const uint64_t seg = (uint64_t)max_tokens * ROW_BYTES;
  uint8_t *resident;
  CK(cudaMalloc(&resident, (size_t)c->n_ctx * LAYERS * 2 * seg));

  std::vector<uint8_t> rows((size_t)LAYERS * 2 * (c->len + 3) * ROW_BYTES);
  std::vector<akv_context *> ctx(c->n_ctx);
  std::vector<uint32_t> lens(c->n_ctx);
  for (uint32_t i = 0; i < c->n_ctx; i++) {
    uint32_t n = c->len + (c->n_ctx > 1 ? i : 0);
    const void *kp[LAYERS], *vp[LAYERS];
    for (uint32_t l = 0; l < LAYERS; l++) {
      uint8_t *kb = rows.data() + (size_t)(l * 2) * n * ROW_BYTES;
      uint8_t *vb = kb + (size_t)n * ROW_BYTES;
      for (uint32_t t = 0; t < n; t++)
        for (uint32_t j = 0; j < ROW_ELEMS; j++) {
          const size_t e = (size_t)t * ROW_ELEMS + j;
          if (fp8) {
            kb[e] = cell_elem8(1, i, l, t, 0, j);
            vb[e] = cell_elem8(1, i, l, t, 1, j);
          } else {
            ((uint16_t *)kb)[e] = cell_elem(1, i, l, t, 0, j);
            ((uint16_t *)vb)[e] = cell_elem(1, i, l, t, 1, j);
          }
        }
      kp[l] = kb;
      vp[l] = vb;
      uint8_t *rk = resident + ((uint64_t)i * LAYERS * 2 + l * 2) * seg;
      CK(cudaMemcpy(rk, kb, (size_t)n * ROW_BYTES, cudaMemcpyHostToDevice));
      CK(cudaMemcpy(rk + seg, vb, (size_t)n * ROW_BYTES, cudaMemcpyHostToDevice));
    }
    akv_context_config cc = AKV_CONTEXT_CONFIG_INIT;
    cc.target_pages = c->target;
    AK(akv_context_open(e, &cc, &ctx[i]));
    AK(akv_context_append(ctx[i], n, kp, vp));
    lens[i] = n;
  }

  std::vector<float> a((size_t)out_elems), b((size_t)out_elems);
  uint64_t staged_h2d = 0;
  for (uint32_t s = 0; s < STEPS; s++) {
    rs.step = s;
    akv_lease *lease[LAYERS];
    uint64_t released = 0;
    AK(akv_step_begin(e, ctx.data(), c->n_ctx));
    for (uint32_t l = 0; l < LAYERS; l++) {
      akv_fence attn, tail;
      AK(akv_lease_begin(e, l, &lease[l]));
      if (c->release_mid && s == 1 && l == 0) {
        uint64_t now_b = 1, pend_b = 0;
        AK(akv_headroom_release(e, UINT64_MAX, &now_b, &pend_b));
        assert_int_equal(now_b, 0); /* leases in flight: nothing freed yet */
        released = pend_b;
      }
      if (l >= 2) AK(akv_lease_retire(lease[l - 2], NULL));
      AK(akv_lease_attend(lease[l], akv_stream_from_cuda(rs.stream), hook, &rs, &attn));
      AK(akv_lease_write_back(lease[l], NULL, 0, &tail));
      AK(akv_lease_seal(lease[l], tail, attn));
    }
    for (uint32_t l = LAYERS >= 2 ? LAYERS - 2 : 0; l < LAYERS; l++) {
      akv_receipt r;
      AK(akv_lease_retire(lease[l], &r));
      staged_h2d += r.bytes_h2d;
    }
    AK(akv_step_end(e));
    if (released > 0) {
      /* Freed by step_end: the caller's allocator can have it now. */
      void *p = NULL;
      CK(cudaMalloc(&p, released));
      CK(cudaFree(p));
      akv_headroom_info hi;
      AK(akv_headroom_get(e, &hi));
      assert_int_equal(hi.pages, 0);
      assert_int_equal(hi.bytes, 0);
    }
    /* resident: the same kernel, same new rows, over the resident copy */
    for (uint32_t l = 0; l < LAYERS; l++) {
      uint8_t *k0 = resident + (uint64_t)l * 2 * seg;
      AK(attend(&rs, l, k0, k0 + seg, (uint64_t)LAYERS * 2 * seg, ROW_BYTES, lens.data(),
                out_res + (uint64_t)l * c->n_ctx * QH * HD, NULL));
    }
    CK(cudaStreamSynchronize(rs.stream));
    CK(cudaMemcpy(a.data(), rs.out_staged, out_elems * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(b.data(), out_res, out_elems * 4, cudaMemcpyDeviceToHost));
    for (uint32_t l = 0; l < LAYERS; l++)
      for (uint32_t i = 0; i < c->n_ctx; i++) {
        size_t off = ((size_t)l * c->n_ctx + i) * QH * HD;
        if (memcmp(a.data() + off, b.data() + off, (size_t)QH * HD * 4) != 0)
          fail_msg("cell %s route=%s len=%u ctx=%u pool=%s: step %u layer %u context %u differs",
                   fp8 ? "fp8" : "bf16", route_name(c->route), c->len, c->n_ctx, c->pool_name, s,
                   l, i);
        (*compared)++;
      }
    for (uint32_t i = 0; i < c->n_ctx; i++) lens[i]++;
  }

  /* Host rows: everything prefilled and written back, byte for byte. */
  for (uint32_t i = 0; i < c->n_ctx; i++) {
    uint32_t n = 0;
    AK(akv_context_length(ctx[i], &n));
    assert_int_equal(n, lens[i]);
    std::vector<uint8_t> hk((size_t)n * ROW_BYTES), hv((size_t)n * ROW_BYTES), rk(hk.size()), rv(hv.size());
    for (uint32_t l = 0; l < LAYERS; l++) {
      AK(akv_context_read(ctx[i], l, 0, n, hk.data(), hv.data()));
      uint8_t *r0 = resident + ((uint64_t)i * LAYERS * 2 + l * 2) * seg;
      CK(cudaMemcpy(rk.data(), r0, (size_t)n * ROW_BYTES, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(rv.data(), r0 + seg, (size_t)n * ROW_BYTES, cudaMemcpyDeviceToHost));
      assert_memory_equal(hk.data(), rk.data(), (size_t)n * ROW_BYTES);
      assert_memory_equal(hv.data(), rv.data(), (size_t)n * ROW_BYTES);
    }
  }
  AK(akv_engine_info_get(e, &info));
  printf("  cell %-4s %-5s len=%-5u ctx=%u pool=%-5s headroom=%u GiB%s: %u steps bit-identical; "
         "H2D %.1f MB, D2D %.1f MB, in place %.1f MB\n",
         fp8 ? "fp8" : "bf16", route_name(c->route), c->len, c->n_ctx, c->pool_name,
         c->headroom_gib, c->release_mid ? " (released mid step 2)" : "", STEPS,
         info.bytes_h2d / 1e6, info.bytes_d2d / 1e6, info.bytes_in_place / 1e6);
  if (c->headroom_gib > 0 && !c->release_mid) assert_true(info.headroom_pages > 0);
  if (c->route == AKV_ROUTE_ARENA && c->len >= 2 * PT) assert_true(info.bytes_d2d > 0);
  if (c->route == AKV_ROUTE_PAGED) assert_int_equal(info.bytes_d2d, 0);
  /* paged: from two pages on, some history was read in place */
  if (c->route == AKV_ROUTE_PAGED && c->len >= 2 * PT) assert_true(info.bytes_in_place > 0);
  if (c->route != AKV_ROUTE_PAGED) assert_int_equal(info.bytes_in_place, 0);

  for (uint32_t i = 0; i < c->n_ctx; i++) AK(akv_context_close(ctx[i]));
  AK(akv_engine_destroy(e));
  CK(cudaFree(resident));
  CK(cudaFree(rs.ws));
  CK(cudaFree(out_res));
  CK(cudaFree(rs.out_staged));
  CK(cudaFree(rs.q));
  CK(cudaStreamDestroy(rs.stream));
}

static void run_route(akv_route route, akv_dtype dtype) {
  const uint32_t lens[] = {1, PT - 1, PT, PT + 1, 1001, 31744};
  bool quick = getenv("AKV_CELLS_QUICK") != NULL;
  uint64_t compared = 0;
  int cells = 0;
  for (uint32_t k = 0; k < sizeof(lens) / sizeof(lens[0]); k++) {
    if (quick && k != 0 && k != 1 && k != 3) continue;
    for (int v = 0; v < 2; v++) {
      cell c;
      c.dtype = dtype;
      c.route = route;
      c.len = lens[k];
      if (route == AKV_ROUTE_STAGE) {
        c.n_ctx = v ? 4 : 1;
        c.pool_gib = 0;
        c.target = 0;
        c.pool_name = "0";
      } else {
        c.n_ctx = (k + v) % 2 ? 4 : 1;
        c.pool_gib = v ? 2 : 1;
        c.target = v ? AKV_TARGET_FAIR_SHARE : 2; /* roomy / tight (sink + 1) */
        c.pool_name = v ? "roomy" : "tight";
      }
      c.headroom_gib = 0;
      c.release_mid = 0;
      run_cell(&c, &compared);
      cells++;
    }
  }
  printf("route %s %s: %d cells, %llu layer outputs compared, all bit-identical\n",
         dtype == AKV_DTYPE_BF16 ? "bf16" : "fp8", route_name(route), cells,
         (unsigned long long)compared);
  assert_true(cells >= (quick ? 6 : 12));
}

/* Headroom cells: lengths x {0 GiB pool + headroom, tight pool + headroom
 * released mid-step}, 1 or 4 contexts: 12 per route. */
static void run_headroom(akv_route route) {
  const uint32_t lens[] = {1, PT - 1, PT + 1, 1001, 4 * PT, 31744};
  bool quick = getenv("AKV_CELLS_QUICK") != NULL;
  uint64_t compared = 0;
  int cells = 0;
  for (uint32_t k = 0; k < sizeof(lens) / sizeof(lens[0]); k++) {
    if (quick && k != 0 && k != 2 && k != 4) continue;
    for (int v = 0; v < 2; v++) {
      cell c;
      c.dtype = AKV_DTYPE_BF16;
      c.route = route;
      c.len = lens[k];
      c.n_ctx = (k + v) % 2 ? 4 : 1;
      c.pool_gib = v ? 1 : 0;
      c.target = v ? 2 : 0;
      c.pool_name = v ? "tight" : "0";
      c.headroom_gib = 4;
      c.release_mid = v;
      run_cell(&c, &compared);
      cells++;
    }
  }
  printf("route %s with headroom: %d cells, %llu layer outputs compared, all bit-identical\n",
         route_name(route), cells, (unsigned long long)compared);
  assert_true(cells >= (quick ? 6 : 12));
}

static void test_arena_headroom_cells(void **) { run_headroom(AKV_ROUTE_ARENA); }
static void test_paged_headroom_cells(void **) { run_headroom(AKV_ROUTE_PAGED); }
static void test_stage_cells(void **) { run_route(AKV_ROUTE_STAGE, AKV_DTYPE_BF16); }
static void test_arena_cells(void **) { run_route(AKV_ROUTE_ARENA, AKV_DTYPE_BF16); }
static void test_paged_cells(void **) { run_route(AKV_ROUTE_PAGED, AKV_DTYPE_BF16); }
static void test_stage_cells_fp8(void **) { run_route(AKV_ROUTE_STAGE, AKV_DTYPE_FP8_E4M3); }
static void test_arena_cells_fp8(void **) { run_route(AKV_ROUTE_ARENA, AKV_DTYPE_FP8_E4M3); }
static void test_paged_cells_fp8(void **) { run_route(AKV_ROUTE_PAGED, AKV_DTYPE_FP8_E4M3); }

int main(void) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    printf("SKIP: no CUDA device\n");
    return 77;
  }
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_stage_cells),
      cmocka_unit_test(test_arena_cells),
      cmocka_unit_test(test_paged_cells),
      cmocka_unit_test(test_stage_cells_fp8),
      cmocka_unit_test(test_arena_cells_fp8),
      cmocka_unit_test(test_paged_cells_fp8),
      cmocka_unit_test(test_arena_headroom_cells),
      cmocka_unit_test(test_paged_headroom_cells),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
