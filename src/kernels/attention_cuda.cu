/*
 * attention_cuda.cu - the CUDA decode attention kernels (akv_cuda.h).
 *
 * Two kernels per call, both on the caller's stream:
 *  1. chunk kernel: one block per (context, kv head, head subgroup, span of
 *     pieces) writes, for every query head of the subgroup, the span's
 *     partial (m, l, acc[head_dim]) of akv_attention.h into the workspace.
 *     The library builds chunk kernel 3 (akv_attn_chunk_kernel3) with spans
 *     of 8 pieces: each of the block's 8 warps streams one piece in groups of
 *     16-row blocks, scores and V products on the tensor cores (mma.sync),
 *     its own running maximum and sum, the next group's K and V loaded while
 *     the current one is used; the warps are merged in warp order. Kernels 1
 *     and 2 write one partial per piece (a span of 1).
 *     Kernels 1 (tiled, CUDA cores) and 2 (warp-streaming, CUDA cores),
 *     in attention_cuda_cores.cuh, stay buildable for the benchmark
 *     (AKV_ATTN_KERNEL; docs/benchmarks.md has the measurements that chose
 *     kernel 3).
 *  2. combine kernel: one block per (context, query head, 32-dim slice)
 *     merges the context's partials in one pass: each warp folds a fixed
 *     subset of the partials in order into its own running maximum, then the
 *     warps are merged in warp order (AKV_ATTN_COMBINE_WARPS warps). With
 *     AKV_ATTN_PDL (sm_90) it is launched with
 *     programmatic dependent launch and waits in griddepcontrol.wait for the
 *     chunk grid before it reads a partial.
 *
 * Determinism: every value is produced by a fixed thread from a fixed set of
 * inputs in a fixed order (mma.sync, shuffle butterflies, sums in warp
 * order); there are no atomics and no dependence on scheduling. The paged
 * and contiguous variants instantiate the same kernels and differ only in
 * how a chunk's first row is found (the "locator"), so over the same rows they
 * give the same bits.
 *
 * Geometry handled here: head_dim 64, 128, 256; subgroups of GT = 1, 2, 4 or
 * 8 query heads (a group larger than 8 is split into several subgroups, each
 * re-reading the K/V rows; heads past the group's end are computed on a zero
 * query and not stored).
 *
 * Element types: the kernels are instantiated per dtype (bf16, FP8 E4M3, FP8
 * E5M2). FP8 codes are decoded exactly (every code is an f16 value); the K
 * scale is folded into the score factor and the V scale applied once in the
 * combine. Kernel 3's numerics are described where it is defined.
 *
 * Kernel 1 (-DAKV_ATTN_KERNEL=1, attention_cuda_cores.cuh): the block streams the piece's K and V rows
 * with 16-byte loads; within the piece it walks tiles of TILE rows: each
 * thread owns U 16-byte K slices and U V slices of the tile; the scores go
 * to shared memory, one warp per head folds the tile into a running maximum
 * and sum, then every thread accumulates its V slices. The K/V slices arrive
 * by registers one tile ahead (AKV_ATTN_STAGES=0) or by cp.async in a ring of
 * AKV_ATTN_STAGES tiles in shared memory; each thread reads back only the
 * slices it copied, so the ring needs no barrier of its own. An FP8 tile has
 * twice the rows of a bf16 tile (U doubled), so the bytes in flight per
 * thread are the same.
 *
 * Kernel 2 (-DAKV_ATTN_KERNEL=2): the same blocks and partials, but the
 * block's warps stream their own rows of the piece independently, each with
 * its own running maximum, sum and accumulators for every head of the
 * subgroup, with no block barrier until the warps' partials are merged in
 * warp order at the end (see akv_attn_chunk_kernel2).
 *
 * Pieces (attention_pieces.h): one warp of kernel 3 (one block of kernels 1
 * and 2) covers one piece of a chunk; the cut and the spans depend on
 * chunk_tokens alone, so every route computes the same partials. The
 * library cuts chunks of 512 rows or more into pieces of 256 or more.
 */
#include <cuda_runtime.h>

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include <mutex>
#include <type_traits>

#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cooperative_groups.h>

#include "akv_cuda.h"
#include "attention_pieces.h"

namespace {

/* Tuning knobs, fixed for the library; bench/attention_bw.cu builds variants
 * with other values (-DAKV_ATTN_KERNEL=1 -DAKV_ATTN_WARPS=8, ...).
 * Which chunk kernel is built: 3 = the tensor-core kernel (the library's),
 * 1 = the tiled kernel (all warps load a tile, scores through shared
 * memory, block barriers per tile), 2 = the warp-streaming kernel (every
 * warp streams its own rows with its own running maximum, sum and
 * accumulator on the CUDA cores). All write the same partials in the same
 * workspace; the combine kernel is shared. Measured on the H200
 * (docs/benchmarks.md, attention kernel). */
#ifndef AKV_ATTN_KERNEL
#define AKV_ATTN_KERNEL 3
#endif
/* Warps per chunk block. Kernel 3: 8 warps, each streaming a whole piece
 * of its own (AKV_ATTN_K3_SPAN), so a block covers 8 consecutive chunks and
 * writes one partial: a one-context grid of 31,744 tokens is 128 blocks,
 * one per SM, and the combine folds 16 partials per head instead of 124. */
#ifndef AKV_ATTN_WARPS
#define AKV_ATTN_WARPS 8
#endif
/* Kernels 1 and 2: 16-byte loads per thread and tile; kernel 3: in flight
 * per warp, LOADS / 4 blocks of 16 rows for bf16, LOADS / 2 for FP8. */
#ifndef AKV_ATTN_LOADS
#define AKV_ATTN_LOADS (AKV_ATTN_KERNEL == 3 ? 8 : 4)
#endif
/* Tiles of K/V kept in flight per block through cp.async into shared memory
 * (each thread copies and later reads only its own 16-byte slices, so no
 * extra barrier guards the buffers); 0 = the register pipeline, which loads
 * the next tile into registers one tile ahead. Measured on the H200
 * (docs/benchmarks.md): the register pipeline is faster (1 context 59 us
 * against 64 us with 3 stages), so the library builds it; the cp.async
 * pipeline stays available to the benchmark. */
#ifndef AKV_ATTN_STAGES
#define AKV_ATTN_STAGES 0
#endif
/* 1 = the combine kernel is launched with programmatic dependent launch
 * (sm_90): it is scheduled while the chunk kernel's last blocks run and waits
 * in griddepcontrol.wait for the chunk grid to complete and flush. */
#ifndef AKV_ATTN_PDL
#define AKV_ATTN_PDL 0 /* measured no faster (docs/benchmarks.md) */
#endif
/* 1 = when the chunk grid of kernel 3 fits the device at once (one FP8 or
 * bf16 context of llama3-8b: 128 blocks on 132 SMs), the call is one
 * cooperative launch: the chunk blocks write their partials, meet in a grid
 * barrier, and each then folds the partials of combine blocks of its own
 * (akv_attn_fused_kernel3) with the combine kernel's arithmetic, so the
 * outputs are the two-kernel path's to the bit. Larger grids, and devices
 * that refuse the launch, take the two kernels. Measured on the H200
 * (docs/benchmarks.md). */
#ifndef AKV_ATTN_FUSED
#define AKV_ATTN_FUSED 1
#endif
/* Benchmark diagnostic, never the library's: 1 = the combine kernel is not
 * launched, so the benchmark times the chunk kernel alone (docs/benchmarks.md
 * splits one context's time with it). */
#ifndef AKV_ATTN_BENCH_CHUNK_ONLY
#define AKV_ATTN_BENCH_CHUNK_ONLY 0
#endif
/* Benchmark diagnostic, never the library's: 1 = kernel 3's warps record the
 * global timer at fixed points into akv_attn_trace (akv_attn_bench_trace_read
 * reads it back), so the benchmark can say where one launch's time goes. */
#ifndef AKV_ATTN_BENCH_TRACE
#define AKV_ATTN_BENCH_TRACE 0
#endif
static_assert(AKV_ATTN_KERNEL >= 1 && AKV_ATTN_KERNEL <= 3, "AKV_ATTN_KERNEL is 1, 2 or 3");
/* Kernels 2 and 3: the least number of resident blocks per SM asked of the
 * compiler (__launch_bounds__). Kernel 2, for subgroups of up to 4 heads
 * (8 heads ask for half as many); 0 = enough blocks for 16 warps per SM (128
 * registers per thread). Kernel 3: 0 = 12 warps per SM (168 registers). */
#ifndef AKV_ATTN_MINB
#define AKV_ATTN_MINB (AKV_ATTN_KERNEL == 3 ? 1 : 0) /* kernel 3: one 8-warp block, 255 registers */
#endif
#if AKV_ATTN_KERNEL != 1
#pragma nv_diag_suppress 177 /* kernel 1's helpers are left unreferenced */
#endif
/* Warps per block of the combine kernel (1 to 32). The two-pass combine it
 * replaced (AKV_ATTN_WARPS warps, a pass over the maxima, then the sums) was
 * measured slower in every cell (docs/benchmarks.md) and removed. */
#ifndef AKV_ATTN_COMBINE_WARPS
#define AKV_ATTN_COMBINE_WARPS 16
#endif
static_assert(AKV_ATTN_COMBINE_WARPS >= 1 && AKV_ATTN_COMBINE_WARPS <= 32,
              "AKV_ATTN_COMBINE_WARPS is 1 to 32");
constexpr int kCombWarps = AKV_ATTN_COMBINE_WARPS;
constexpr int kStages = AKV_ATTN_STAGES;
static_assert(kStages == 0 || kStages >= 2, "AKV_ATTN_STAGES is 0 or >= 2");
constexpr int kRing = kStages > 0 ? kStages : 1; /* ring slots; the ring is unused at 0 */
constexpr int kWarps = AKV_ATTN_WARPS; /* warps per block; also caps the subgroup size */
constexpr int kThreads = kWarps * 32;
/* Contexts per launch pair (their lengths travel in the kernel parameters). */
/* Capacity of the launch parameters' per-context lengths and per-kv-head
 * scales (AKV_ATTN_PARAM_SLOTS: a benchmark knob that shrinks both to time
 * what the parameter block's size costs a launch; only for shapes within
 * it). */
#ifndef AKV_ATTN_PARAM_SLOTS
constexpr uint32_t kMaxLaunchContexts = 256;
constexpr uint32_t kScaleSlots = AKV_ATTENTION_MAX_SCALE_HEADS;
#else
constexpr uint32_t kMaxLaunchContexts = AKV_ATTN_PARAM_SLOTS;
constexpr uint32_t kScaleSlots = AKV_ATTN_PARAM_SLOTS;
#endif
constexpr float kLog2e = AKV_ATTN_LOG2E_F; /* attention_pieces.h, as the reference */
constexpr size_t kWsAlign = 256;                   /* same layout as attention_ref.c */

/* Element kinds the chunk kernel is instantiated for. */
enum ElemKind { kBf16 = 0, kE4m3 = 1, kE5m2 = 2 };

/* 8 elements of one lane: the vector loaded per row and slice (16 B of bf16,
 * 8 B of FP8) and its decoding to fp32. */
template <int E>
struct Elem;

/* Common parameters of the chunk kernel (pointers already offset to the
 * first context of the launch). */
struct ChunkParams {
  const uint16_t *q;
  float *acc;
  float *ml;
  uint32_t n_heads;
  uint32_t group;         /* query heads per kv head */
  uint32_t n_sub;         /* subgroups per kv head */
  uint32_t kv_slots;      /* kv_heads * n_sub */
  uint32_t stride_chunks; /* piece slots per (context, head) in the workspace */
  uint32_t pieces;        /* pieces per chunk (attention_pieces.h) */
  uint32_t piece_rows;    /* rows per piece */
  float scale_log2;       /* scale * log2(e) */
  uint32_t has_scales;    /* 1: the score factor of kv head g is scale_log2 * k_scale[g] */
  float k_scale[kScaleSlots];
};

struct CombineParams {
  const float *acc;
  const float *ml;
  float *out;
  uint32_t n_heads;
  uint32_t group;
  uint32_t stride_chunks;
  uint32_t pieces;
  uint32_t piece_rows;
  uint32_t has_scales; /* 1: the output of query head h is multiplied by v_scale[h / group] */
  float v_scale[kScaleSlots];
};

/* Locator of the contiguous layout, with the optional page overrides of
 * akv_attention_args (map == nullptr: none). */
struct ContigLoc {
  const char *k;
  const char *v;
  uint64_t context_stride;
  uint64_t row_bytes;
  uint32_t chunk_tokens;
  uint32_t map_stride;
  const uint32_t *map; /* already offset to the launch's first context */
  const char *pk;
  const char *pv;
  uint64_t page_stride;
  uint32_t len[kMaxLaunchContexts];

  __device__ __forceinline__ bool locate(uint32_t ctx, uint32_t chunk, const char *&kp,
                                         const char *&vp, uint32_t &n) const {
    const uint32_t l = len[ctx];
    const uint64_t first = (uint64_t)chunk * chunk_tokens;
    if (first >= l) return false;
    const uint64_t rest = l - first;
    n = rest < chunk_tokens ? (uint32_t)rest : chunk_tokens;
    if (map != nullptr && chunk < map_stride) {
      const uint32_t page = __ldg(map + (uint64_t)ctx * map_stride + chunk);
      if (page != AKV_PAGE_STAGED) {
        const uint64_t off = (uint64_t)page * page_stride;
        kp = pk + off;
        vp = pv + off;
        return true;
      }
    }
    const uint64_t off = ctx * context_stride + first * row_bytes;
    kp = k + off;
    vp = v + off;
    return true;
  }
  __device__ __forceinline__ uint32_t chunks(uint32_t ctx, bool &bad) const {
    bad = false;
    return len[ctx] / chunk_tokens + (len[ctx] % chunk_tokens != 0);
  }
  /* Rows of the last of nch >= 1 chunks. */
  __device__ __forceinline__ uint32_t last_rows(uint32_t ctx, uint32_t nch) const {
    return len[ctx] - (nch - 1u) * chunk_tokens;
  }
};

/* Locator of the paged layout (FlashInfer style page table). */
struct PagedLoc {
  const char *k;
  const char *v;
  uint64_t page_stride;
  uint64_t row_bytes;
  const uint32_t *indptr;
  const uint32_t *indices;
  const uint32_t *last_page_len;
  uint32_t page_tokens;
  uint32_t max_pages;

  __device__ __forceinline__ bool locate(uint32_t ctx, uint32_t chunk, const char *&kp,
                                         const char *&vp, uint32_t &n) const {
    const uint32_t b = indptr[ctx], e = indptr[ctx + 1];
    if (e <= b || chunk >= e - b) return false;
    const uint32_t page = indices[b + chunk];
    if (chunk + 1 == e - b) {
      const uint32_t last = last_page_len[ctx];
      n = last < page_tokens ? last : page_tokens;
    } else {
      n = page_tokens;
    }
    const uint64_t off = (uint64_t)page * page_stride;
    kp = k + off;
    vp = v + off;
    return true;
  }
  __device__ __forceinline__ uint32_t chunks(uint32_t ctx, bool &bad) const {
    const uint32_t b = indptr[ctx], e = indptr[ctx + 1];
    bad = e < b || e - b > max_pages;
    return bad ? 0u : e - b;
  }
  /* Rows of the last page, clamped as locate() clamps them. */
  __device__ __forceinline__ uint32_t last_rows(uint32_t ctx, uint32_t nch) const {
    (void)nch;
    const uint32_t last = last_page_len[ctx];
    return last < page_tokens ? last : page_tokens;
  }
};

__device__ __forceinline__ void bf16x8_to_f32(const uint4 &r, float (&f)[8]) {
  f[0] = __uint_as_float(r.x << 16);
  f[1] = __uint_as_float(r.x & 0xFFFF0000u);
  f[2] = __uint_as_float(r.y << 16);
  f[3] = __uint_as_float(r.y & 0xFFFF0000u);
  f[4] = __uint_as_float(r.z << 16);
  f[5] = __uint_as_float(r.z & 0xFFFF0000u);
  f[6] = __uint_as_float(r.w << 16);
  f[7] = __uint_as_float(r.w & 0xFFFF0000u);
}

__device__ __forceinline__ uint4 load16(const char *p) {
  return __ldg(reinterpret_cast<const uint4 *>(p));
}

/* Two FP8 codes (the lower address in the low byte) to two floats, exactly. */
__device__ __forceinline__ void fp8x2_to_f32(uint32_t two, __nv_fp8_interpretation_t kind,
                                             float &a, float &b) {
  const __half2_raw r = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(two & 0xFFFFu), kind);
  const float2 f = __half22float2(__half2(r));
  a = f.x;
  b = f.y;
}

__device__ __forceinline__ void fp8x8_to_f32(const uint2 &r, __nv_fp8_interpretation_t kind,
                                             float (&f)[8]) {
  fp8x2_to_f32(r.x, kind, f[0], f[1]);
  fp8x2_to_f32(r.x >> 16, kind, f[2], f[3]);
  fp8x2_to_f32(r.y, kind, f[4], f[5]);
  fp8x2_to_f32(r.y >> 16, kind, f[6], f[7]);
}

template <>
struct Elem<kBf16> {
  using Vec = uint4;
  static constexpr int BYTES = 2; /* per element */
  static __device__ __forceinline__ Vec load(const char *p) { return load16(p); }
  static __device__ __forceinline__ Vec zero() { return make_uint4(0u, 0u, 0u, 0u); }
  static __device__ __forceinline__ void decode(const Vec &r, float (&f)[8]) { bf16x8_to_f32(r, f); }
};

template <>
struct Elem<kE4m3> {
  using Vec = uint2;
  static constexpr int BYTES = 1;
  static __device__ __forceinline__ Vec load(const char *p) {
    return __ldg(reinterpret_cast<const uint2 *>(p));
  }
  static __device__ __forceinline__ Vec zero() { return make_uint2(0u, 0u); }
  static __device__ __forceinline__ void decode(const Vec &r, float (&f)[8]) {
    fp8x8_to_f32(r, __NV_E4M3, f);
  }
};

template <>
struct Elem<kE5m2> {
  using Vec = uint2;
  static constexpr int BYTES = 1;
  static __device__ __forceinline__ Vec load(const char *p) {
    return __ldg(reinterpret_cast<const uint2 *>(p));
  }
  static __device__ __forceinline__ Vec zero() { return make_uint2(0u, 0u); }
  static __device__ __forceinline__ void decode(const Vec &r, float (&f)[8]) {
    fp8x8_to_f32(r, __NV_E5M2, f);
  }
};

/* 16-byte asynchronous copy global -> shared; a row past the chunk copies
 * nothing and fills zeros (src-size 0), like the register path's zero row. */
__device__ __forceinline__ void cp_async16(uint4 *smem, const char *gmem, bool valid) {
  const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
  const int sz = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(sz)
               : "memory");
}
/* The 8-byte form for FP8 slices (cp.async.cg takes 16 bytes only). */
__device__ __forceinline__ void cp_async16(uint2 *smem, const char *gmem, bool valid) {
  const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
  const int sz = valid ? 8 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(s), "l"(gmem), "r"(sz)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int off = 16; off >= 1; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, off));
  return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int off = 16; off >= 1; off >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, off);
  return v;
}

/* Kernel 3: pieces per block, one per warp (AKV_ATTN_K3_SPAN == warps, the
 * default), merged in warp order into one partial, so the combine folds
 * 1/span as many partials; 1: the block's warps share one piece (each warp
 * every warps-th group of 16-row blocks). Measured on the H200
 * (docs/benchmarks.md): spans of 8 took one FP8 context from 32.6 to 28.0
 * us and one bf16 context from 45.1 to 40.2 us. */
#ifndef AKV_ATTN_K3_SPAN
#define AKV_ATTN_K3_SPAN AKV_ATTN_WARPS
#endif
constexpr uint32_t kSpan3 = AKV_ATTN_KERNEL == 3 ? AKV_ATTN_K3_SPAN : 1;
static_assert(kSpan3 == 1 || kSpan3 == (uint32_t)AKV_ATTN_WARPS,
              "AKV_ATTN_K3_SPAN is 1 or the warps per block");

/* The combine's arithmetic, shared by the combine kernel and the fused
 * kernel's fold (akv_attn_fused_kernel3) so that both give the same bits. */

/* Partials of context ctx (spans of pieces over its chunks; 0: no rows);
 * bad: a page table the combine cannot read (the output is NaN). */
template <class Loc>
__device__ __forceinline__ uint32_t combine_count(const CombineParams &p, const Loc &loc,
                                                  uint32_t ctx, bool &bad) {
  const uint32_t n_chunks = loc.chunks(ctx, bad);
  uint32_t nch = 0;
  if (n_chunks > 0) {
    const uint32_t last = loc.last_rows(ctx, n_chunks);
    nch = (n_chunks - 1u) * p.pieces + last / p.piece_rows + (last % p.piece_rows != 0);
    nch = nch / kSpan3 + (nch % kSpan3 != 0); /* partials: spans of pieces */
  }
  return nch;
}

/* Folds w[0..N) of the kCombWarps, side by side: fold w takes the
 * partials w, w + kCombWarps, ... of the slot at slot0, in order, into a
 * running maximum m, sum l and output o of dim d. Each fold's arithmetic is
 * the same whatever N (the combine kernel runs one fold per warp, the fused
 * kernel two); N only lets one round of loads serve N folds. The loads go
 * to L2 (ld.global.cg): in the fused kernel other blocks of the same grid
 * wrote the partials. A fold w >= kCombWarps is none (no partials). */
template <int D, int N>
__device__ __forceinline__ void combine_fold(const CombineParams &p, size_t slot0, uint32_t d,
                                             const uint32_t (&w)[N], uint32_t nch, float (&m)[N],
                                             float (&l)[N], float (&o)[N]) {
#pragma unroll
  for (int j = 0; j < N; ++j) {
    m[j] = -INFINITY;
    l[j] = 0.0f;
    o[j] = 0.0f;
  }
#pragma unroll 4
  for (uint32_t k = 0; k < nch; k += kCombWarps) {
    float mc[N], lc[N], ac[N];
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const uint32_t c = w[j] + k;
      mc[j] = lc[j] = ac[j] = 0.0f;
      if (w[j] < (uint32_t)kCombWarps && c < nch) {
        mc[j] = __ldcg(p.ml + (slot0 + c) * 2);
        lc[j] = __ldcg(p.ml + (slot0 + c) * 2 + 1);
        ac[j] = __ldcg(p.acc + (slot0 + c) * D + d);
      }
    }
#pragma unroll
    for (int j = 0; j < N; ++j) {
      if (w[j] >= (uint32_t)kCombWarps || w[j] + k >= nch) continue;
      const float mn = fmaxf(m[j], mc[j]);
      const float mu = (mn == -INFINITY) ? 0.0f : mn;
      const float sa = exp2f(m[j] - mu), sc = exp2f(mc[j] - mu);
      l[j] = fmaf(lc[j], sc, l[j] * sa);
      o[j] = fmaf(ac[j], sc, o[j] * sa);
      m[j] = mn;
    }
  }
}

/* The kCombWarps folds (s_m, s_l, s_o[w][lane]) merged in fold order: the
 * output of query head `head` at this lane's dim. */
__device__ __forceinline__ float combine_merge(const CombineParams &p, const float *s_m,
                                               const float *s_l, const float (*s_o)[32],
                                               uint32_t head, int lane, bool bad) {
  float big = -INFINITY;
#pragma unroll
  for (int w = 0; w < kCombWarps; ++w) big = fmaxf(big, s_m[w]);
  const float big_use = (big == -INFINITY) ? 0.0f : big;
  float sum = 0.0f, lsum = 0.0f;
#pragma unroll
  for (int w = 0; w < kCombWarps; ++w) {
    const float wgt = exp2f(s_m[w] - big_use);
    sum = fmaf(wgt, s_o[w][lane], sum);
    lsum = fmaf(wgt, s_l[w], lsum);
  }
  /* Zeros only where lsum == 0 (no rows, or every score -inf), as in the
   * reference's combine (akv_attention.h, "Algorithm"): a NaN lsum (a NaN
   * score, or one that overflowed) gives NaN, never a plausible 0. */
  float r = (lsum != 0.0f) ? sum / lsum : 0.0f;
  if (p.has_scales) r *= p.v_scale[head / p.group];
  if (bad) r = __int_as_float(0x7FC00000);
  return r;
}

/* Chunk kernels 1 and 2 (CUDA cores; benchmark variants). */
#include "attention_cuda_cores.cuh"


#if AKV_ATTN_KERNEL == 3
/*
 * Kernel 3, the tensor-core chunk kernel. One block per (context, kv head,
 * subgroup, span of AKV_ATTN_K3_SPAN pieces): with spans (the library's),
 * warp w streams piece w of the span; with a span of 1 the block's warps
 * share one piece (warp w takes its groups w, w + warps, ...). Each warp
 * keeps its own softmax state; the warps are merged in warp order at the
 * end into the span's partial. Per group, with g = lane / 4 and
 * c = lane % 4 (the fragment coordinates of mma.sync):
 *  - scores S[16 rows][8 heads] = K Q^T on the tensor cores: bf16 K with
 *    mma.m16n8k16 (bf16 in, fp32 accumulate), FP8 K decoded exactly to fp32
 *    with mma.m16n8k8.tf32 (every FP8 and bf16 value is a tf32 value). Lane
 *    (g, c) loads rows g and g + 8 of the group, 16-byte chunks c, c + 4, ...
 *    of the head's row; the dot product's k index is a permutation of the
 *    head dimension chosen so that those registers are the A fragments as
 *    loaded, and the query's B fragments follow the same permutation. The
 *    subgroup's heads are the 8 columns (fewer heads: zero queries);
 *  - online softmax per head (maximum over the group by a butterfly over
 *    the 8 lanes that share c; the running sum kept per lane and summed at
 *    the end), rescaling skipped when every factor is exactly 1 (x * 1 = x,
 *    so no bit changes);
 *  - O^T[dims][heads] += V^T P^T on the tensor cores with mma.m16n8k8.tf32:
 *    V decoded exactly to fp32 (A fragments: lane (g, c) loads rows c, c + 4,
 *    c + 8, c + 12 of the group), P passed through shared memory to the B
 *    layout and split into two tf32 terms (P = hi + lo, 22 significant bits;
 *    two mmas), so the product keeps fp32-level precision.
 * Rows past the piece are never read (see load_k and load_v). The next
 * group's K is loaded as soon as the scores are taken and its V as soon as
 * the products are done, so one group's K and V are in flight per warp.
 * Every value comes from a fixed lane, a fixed instruction sequence and a
 * fixed order (mma.sync, butterflies, warp order): deterministic, and the
 * same for every locator.
 */
/* d += A B on the tensor cores, fp32 accumulate: one mma.sync of the given
 * shape and input type (A: four 32-bit registers, B: two). */
#define AKV_MMA_F32(name, shape, type)                                                   \
  __device__ __forceinline__ void name(float (&d)[4], uint32_t a0, uint32_t a1,         \
                                       uint32_t a2, uint32_t a3, uint32_t b0,           \
                                       uint32_t b1) {                                   \
    asm("mma.sync.aligned." shape ".row.col.f32." type "." type                         \
        ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"                  \
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                                \
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));                        \
  }
AKV_MMA_F32(mma_bf16_16816, "m16n8k16", "bf16")
AKV_MMA_F32(mma_tf32_1688, "m16n8k8", "tf32")
AKV_MMA_F32(mma_f16_16816, "m16n8k16", "f16")
#undef AKV_MMA_F32

/* Two FP8 codes (low 16 bits, lower element in the low byte) to f16x2,
 * exactly (every E4M3 and E5M2 value is an f16 value). */
template <int E>
__device__ __forceinline__ uint32_t fp8x2_to_h2(uint32_t two) {
  const __half2_raw r = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(two & 0xFFFFu),
                                                   E == kE4m3 ? __NV_E4M3 : __NV_E5M2);
  return (uint32_t)r.x | ((uint32_t)r.y << 16);
}

/* The two E4M3 / E5M2 codes in the high half of w to f16x2 (the same
 * values as fp8x2_to_h2<E>(w >> 16)), the half selected by the conversion
 * instead of a shift. */
template <int E>
__device__ __forceinline__ uint32_t fp8x2_hi_to_h2(uint32_t w) {
  uint32_t r;
  if constexpr (E == kE4m3)
    asm("{\n .reg .b16 lo, hi;\n mov.b32 {lo, hi}, %1;\n cvt.rn.f16x2.e4m3x2 %0, hi;\n}" : "=r"(r) : "r"(w));
  else
    asm("{\n .reg .b16 lo, hi;\n mov.b32 {lo, hi}, %1;\n cvt.rn.f16x2.e5m2x2 %0, hi;\n}" : "=r"(r) : "r"(w));
  return r;
}

/* Two floats to f16x2, round to nearest (x in the low half). */
__device__ __forceinline__ uint32_t f32x2_to_h2(float x, float y) {
  const __half2 h = __floats2half2_rn(x, y);
  return *reinterpret_cast<const uint32_t *>(&h);
}

/* fp32 rounded to tf32 (to nearest, ties away), as a 32-bit pattern. */
__device__ __forceinline__ uint32_t to_tf32(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
  return r;
}

/* Elements 2j and 2j + 1 of a loaded slice (words w) as fp32 bit patterns,
 * exactly: bf16 pair j is word j; an FP8 pair j is half-word j. */
template <int E>
__device__ __forceinline__ void pair_f32(const uint32_t *w, int j, uint32_t &x, uint32_t &y) {
  if constexpr (E == kBf16) {
    x = w[j] << 16;
    y = w[j] & 0xFFFF0000u;
  } else {
    float a, b;
    fp8x2_to_f32(w[j >> 1] >> (16 * (j & 1)), E == kE4m3 ? __NV_E4M3 : __NV_E5M2, a, b);
    x = __float_as_uint(a);
    y = __float_as_uint(b);
  }
}

/* Kernel 3's K/V loads: 0 = plain non-coherent loads (__ldg); 64, 128 or
 * 256 = the same loads with the L2 prefetch-size hint of that many bytes
 * (ld.global.nc.L2::NB), so that a miss fetches the sector's neighbours
 * from DRAM with it (the neighbouring kv heads of a row, read by the other
 * blocks of the same span). The same bytes reach the same registers. */
#ifndef AKV_ATTN_K3_L2PF
#define AKV_ATTN_K3_L2PF 0
#endif
static_assert(AKV_ATTN_K3_L2PF == 0 || AKV_ATTN_K3_L2PF == 64 || AKV_ATTN_K3_L2PF == 128 ||
                  AKV_ATTN_K3_L2PF == 256,
              "AKV_ATTN_K3_L2PF is 0, 64, 128 or 256");
#define AKV_STR2(x) #x
#define AKV_STR(x) AKV_STR2(x)
#define AKV_L2PF_SUFFIX ".L2::" AKV_STR(AKV_ATTN_K3_L2PF) "B"

template <int N>
struct Words; /* N 32-bit words loaded at once (16 or 8 bytes) */
template <>
struct Words<4> {
  static __device__ __forceinline__ void load(uint32_t *w, const char *p) {
#if AKV_ATTN_K3_L2PF
    asm("ld.global.nc" AKV_L2PF_SUFFIX ".v4.u32 {%0,%1,%2,%3}, [%4];"
        : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3])
        : "l"(p));
#else
    const uint4 r = __ldg(reinterpret_cast<const uint4 *>(p));
    w[0] = r.x, w[1] = r.y, w[2] = r.z, w[3] = r.w;
#endif
  }
};
template <>
struct Words<2> {
  static __device__ __forceinline__ void load(uint32_t *w, const char *p) {
#if AKV_ATTN_K3_L2PF
    asm("ld.global.nc" AKV_L2PF_SUFFIX ".v2.u32 {%0,%1}, [%2];" : "=r"(w[0]), "=r"(w[1]) : "l"(p));
#else
    const uint2 r = __ldg(reinterpret_cast<const uint2 *>(p));
    w[0] = r.x, w[1] = r.y;
#endif
  }
};

#ifndef AKV_ATTN_K3_FP8_F16
#define AKV_ATTN_K3_FP8_F16 1
#endif
/* FP8 on f16 mmas: 1 = P enters the V product as two f16 terms (hi + lo, 22
 * significant bits, two mmas); 0 = one term (P rounded to f16, 11 bits, one
 * mma), for the benchmark's comparison. */
#ifndef AKV_ATTN_K3_PV_SPLIT
#define AKV_ATTN_K3_PV_SPLIT 1
#endif


template <int D, int E>
struct Cfg3 {
  static constexpr int BYTES = E == kBf16 ? 2 : 1;
  /* K: 16-byte chunks per row and lane (bf16: 8 dims each, FP8: 16). */
  static constexpr int KCH = E == kBf16 ? D / 32 : D / 64;
  /* Query fragment registers: bf16 pairs, or one fp32 per dim for tf32. */
  /* FP8 on f16 mmas (AKV_ATTN_K3_FP8_F16, the default): every FP8 code is
   * an f16 value, so K and V enter the mmas as decoded by one conversion per
   * pair; otherwise FP8 goes through tf32 as bf16 V does. */
  static constexpr bool F16 = E != kBf16 && AKV_ATTN_K3_FP8_F16 != 0;
  static constexpr int QR = E == kBf16 ? 4 * KCH : F16 ? 8 * KCH : 16 * KCH;
  /* V: elements per row and lane, per load, loads per row, words per load. */
  static constexpr int EV = D / 8;
  static constexpr int VEC = 16 / BYTES < EV ? 16 / BYTES : EV;
  static constexpr int NV = EV / VEC;
  static constexpr int VW = VEC * BYTES / 4;
  /* PV mmas per 8 rows (two dims of a lane each) and accumulators per lane. */
  static constexpr int PVM = EV / 2;
  static constexpr int ACC = 4 * PVM;
  /* 16-row blocks per group (one group's K and V in flight per warp):
   * AKV_ATTN_LOADS / 4 for bf16, AKV_ATTN_LOADS / 2 for FP8 (rows half as
   * wide, twice as many for the same bytes). */
  static constexpr int RG = E == kBf16 ? (AKV_ATTN_LOADS / 4 > 0 ? AKV_ATTN_LOADS / 4 : 1)
                                       : (AKV_ATTN_LOADS / 2 > 0 ? AKV_ATTN_LOADS / 2 : 1);
  /* Score accumulators: mma k-steps per 16 rows / 4 (a power of two). */
  static constexpr int KSTEPS = E == kBf16 ? 2 * KCH : F16 ? 4 * KCH : 8 * KCH;
  static constexpr int SA = KSTEPS >= 16 ? 4 : KSTEPS >= 8 ? 2 : 1;
  static_assert(KCH >= 1 && NV >= 1 && (VW == 4 || VW == 2), "head_dim 64, 128 or 256");
};

#if AKV_ATTN_BENCH_TRACE
/* Points per warp: entry, query set up, then per group (up to 8) its scores
 * done and its V products done, then the loop's end and the partial
 * written; in the fused kernel also the grid barrier passed and the fold
 * done; then the block merge's first and second barrier passed. Warps past kTraceWarps are not recorded. */
constexpr int kTracePts = 24;
constexpr uint32_t kTraceWarps = 8192;
__device__ unsigned long long akv_attn_trace[kTraceWarps * kTracePts];
__device__ unsigned int akv_attn_trace_sm[kTraceWarps]; /* each warp's SM */
#define AKV_TRACE(pt, dep)                                                                \
  do {                                                                                    \
    unsigned long long t_;                                                                \
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t_) : "f"(dep) : "memory");         \
    if (lane == 0 && trace_warp < kTraceWarps && (pt) < kTracePts)                        \
      akv_attn_trace[(size_t)trace_warp * kTracePts + (pt)] = t_;                         \
  } while (0)
#else
#define AKV_TRACE(pt, dep) ((void)0)
#endif

constexpr int min_blocks3() {
  return AKV_ATTN_MINB > 0 ? AKV_ATTN_MINB : (12 / kWarps > 0 ? 12 / kWarps : 1);
}

/* Shared memory of kernel 3, all of it dynamic (so that one opt-in above
 * 48 KiB covers it): every warp's P of a group ([warp][row][head]), its
 * maxima and sums ([warp][head] each), then its
 * accumulators for the merge ([warp][register][lane]). */
template <int D, int E>
__host__ __device__ constexpr size_t pt_floats3() {
  return (size_t)kWarps * 16u * Cfg3<D, E>::RG * 8u;
}
template <int D, int E>
constexpr size_t merge_bytes3() {
  return (pt_floats3<D, E>() + 2u * kWarps * 8u + (size_t)kWarps * Cfg3<D, E>::ACC * 32u) *
         sizeof(float);
}

/* Kernel 3's work, the body of the chunk kernel and of the fused kernel:
 * returns (uniformly over the block) once the block's partial is written,
 * or at once for a block without rows. */
template <int D, int GT, int E, class Loc>
__device__ __forceinline__ void chunk3_body(const ChunkParams &p, const Loc &loc) {
  using C = Cfg3<D, E>;
  constexpr int RG = C::RG;
  extern __shared__ __align__(16) float s_dyn[]; /* merge_bytes3 */
  float(*s_pt)[16 * RG][8] = reinterpret_cast<float(*)[16 * RG][8]>(s_dyn); /* P of a group */
  float(*s_m)[8] = reinterpret_cast<float(*)[8]>(s_dyn + pt_floats3<D, E>());
  float(*s_l)[8] = s_m + kWarps;
  float *s_acc = s_dyn + pt_floats3<D, E>() + 2u * kWarps * 8u; /* [warp][ACC][32] */

  /* The block's partial slot: one piece whose groups the warps share
   * (kSpan3 == 1, as in kernel 1), or kSpan3 consecutive pieces, one per
   * warp. */
  const uint32_t pgrp = blockIdx.x / p.kv_slots;
  const uint32_t slot = blockIdx.x - pgrp * p.kv_slots;
  const uint32_t kvh = slot / p.n_sub;
  const uint32_t sub = slot - kvh * p.n_sub;
  const uint32_t ctx = blockIdx.y;
#if AKV_ATTN_PDL
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
  const int warp = (int)(threadIdx.x >> 5);
  const int lane = (int)(threadIdx.x & 31);
#if AKV_ATTN_BENCH_TRACE
  const uint32_t trace_warp = (blockIdx.y * gridDim.x + blockIdx.x) * kWarps + (uint32_t)warp;
  AKV_TRACE(0, 0.0f);
  if (lane == 0 && trace_warp < kTraceWarps) {
    unsigned int sm_;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm_));
    akv_attn_trace_sm[trace_warp] = sm_;
  }
#endif
  const uint32_t pslot = kSpan3 > 1 ? pgrp * kSpan3 + (uint32_t)warp : pgrp;
  const uint32_t chunk = pslot / p.pieces;
  const uint32_t piece = pslot - chunk * p.pieces;
  const char *kp = nullptr;
  const char *vp = nullptr;
  uint32_t n = 0; /* rows of this warp's piece; 0: past the context's end */
  if (loc.locate(ctx, chunk, kp, vp, n)) {
    /* piece * piece_rows < 2^32: the launchers take no chunk beyond
     * akv_attn_chunk_ok. */
    const uint32_t first = piece * p.piece_rows;
    if (first >= n) {
      n = 0;
    } else {
      const uint32_t rest = n - first;
      n = rest < p.piece_rows ? rest : p.piece_rows;
      kp += (uint64_t)first * loc.row_bytes;
      vp += (uint64_t)first * loc.row_bytes;
    }
  } else {
    n = 0;
  }
  /* A block without rows writes no partial (the combine reads only the
   * slots that have rows); the test is uniform over the block. With spans,
   * a warp past the end keeps m = -inf, l = 0, acc = 0: weight 0 in the
   * merge. */
  if (kSpan3 > 1 ? __syncthreads_or(n > 0) == 0 : n == 0) return;
  const int g = lane >> 2; /* fragment row group: K rows g, g + 8; head g of Q */
  const int c = lane & 3;  /* thread in group: V rows c + 4i; heads 2c, 2c + 1 of S */
  const uint32_t head0 = kvh * p.group + sub * GT;
  const uint32_t left = p.group - sub * GT;
  const int hvalid = left < (uint32_t)GT ? (int)left : GT;
  const uint64_t rb = loc.row_bytes;
  const size_t head_off = (size_t)kvh * D * C::BYTES;
  const float score_f = p.has_scales ? p.scale_log2 * p.k_scale[kvh] : p.scale_log2;
  const char *kd = kp + head_off + (size_t)c * 16u;
  const char *vd = vp + head_off + (size_t)g * C::VEC * C::BYTES;

  /* B fragments of the query of head g (zero past the subgroup's heads). */
  uint32_t qf[C::QR];
#pragma unroll
  for (int i = 0; i < C::QR; ++i) qf[i] = 0u;
  /* FP8 on f16 mmas: the query of head g is scaled by 2^qe (qe from its
   * largest magnitude, so that it lies in [2^14, 2^15)) and rounded to f16;
   * every component within 2^31 of the largest keeps its bf16 value
   * exactly, and the score factor of the head takes 2^-qe back (powers of
   * two: exact). */
  float sfh[2] = {score_f, score_f}; /* score factor of heads 2c, 2c + 1 */
  if constexpr (C::F16) {
    float qv[C::KCH][16];
    float mq = 0.0f;
#pragma unroll
    for (int i = 0; i < C::KCH; ++i) {
      uint32_t w[8] = {0u, 0u, 0u, 0u, 0u, 0u, 0u, 0u};
      if (g < hvalid) {
        const char *qh =
            reinterpret_cast<const char *>(p.q + ((size_t)ctx * p.n_heads + head0 + g) * D);
        Words<4>::load(w, qh + (size_t)(c + 4 * i) * 32u);
        Words<4>::load(w + 4, qh + (size_t)(c + 4 * i) * 32u + 16u);
      }
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        qv[i][2 * e] = __uint_as_float(w[e] << 16);
        qv[i][2 * e + 1] = __uint_as_float(w[e] & 0xFFFF0000u);
        mq = fmaxf(mq, fmaxf(fabsf(qv[i][2 * e]), fabsf(qv[i][2 * e + 1])));
      }
    }
    mq = fmaxf(mq, __shfl_xor_sync(0xFFFFFFFFu, mq, 1));
    mq = fmaxf(mq, __shfl_xor_sync(0xFFFFFFFFu, mq, 2));
    int qe = 0;
    if (mq > 0.0f && mq <= 3.402823466e38f) {
      int ex;
      (void)frexpf(mq, &ex);
      qe = 15 - ex < 100 ? 15 - ex : 100; /* >= -113: 2^-qe stays a normal float */
    }
    const float up = __int_as_float((127 + qe) << 23);
#pragma unroll
    for (int i = 0; i < C::KCH; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        qf[8 * i + 2 * j] = f32x2_to_h2(qv[i][4 * j] * up, qv[i][4 * j + 1] * up);
        qf[8 * i + 2 * j + 1] = f32x2_to_h2(qv[i][4 * j + 2] * up, qv[i][4 * j + 3] * up);
      }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int eh = __shfl_sync(0xFFFFFFFFu, qe, 4 * (2 * c + h)); /* lane of head 2c + h */
      sfh[h] = score_f * __int_as_float((127 - eh) << 23);
    }
  } else if (g < hvalid) {
    const char *qh = reinterpret_cast<const char *>(p.q + ((size_t)ctx * p.n_heads + head0 + g) * D);
#pragma unroll
    for (int i = 0; i < C::KCH; ++i) {
      if constexpr (E == kBf16) {
        Words<4>::load(qf + 4 * i, qh + (size_t)(c + 4 * i) * 16u);
      } else {
        uint32_t w[8];
        Words<4>::load(w, qh + (size_t)(c + 4 * i) * 32u);
        Words<4>::load(w + 4, qh + (size_t)(c + 4 * i) * 32u + 16u);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          qf[16 * i + 2 * e] = w[e] << 16;
          qf[16 * i + 2 * e + 1] = w[e] & 0xFFFF0000u;
        }
      }
    }
  }

  float acc[C::PVM][4];
#pragma unroll
  for (int j = 0; j < C::PVM; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
  float m_run[2] = {-INFINITY, -INFINITY}; /* heads 2c, 2c + 1; the same on the 8 lanes of c */
  float l_run[2] = {0.0f, 0.0f};           /* this lane's rows only, summed at the end */

  /* A group is RG blocks of 16 rows; block sg holds rows 16 sg + (g, g + 8)
   * of K and 16 sg + (c, c + 4, c + 8, c + 12) of V for this lane. */
  uint32_t kr[RG][2][C::KCH][4];
  uint32_t vr[RG][4][C::NV][C::VW];
  /* Rows past the piece (only in its last group) are never read. K: such a
   * row's loads re-read the piece's last row (in bounds, no per-row branch
   * or zero fill) and its score is set to -inf below, by a select, whatever
   * those bytes hold. V: its registers are zero, as its probability is, so
   * that 0 * V cannot bring in a NaN from an infinite V element; a group
   * wholly inside the piece is loaded without the per-row checks. */
  auto load_k = [&](uint32_t t0) {
#pragma unroll
    for (int sg = 0; sg < RG; ++sg)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const uint32_t t = min(t0 + 16u * sg + g + 8 * r, n - 1u);
#pragma unroll
        for (int i = 0; i < C::KCH; ++i) Words<4>::load(kr[sg][r][i], kd + t * rb + (size_t)i * 64u);
      }
  };
  /* check: std::true_type checks every row (the piece's last group),
   * std::false_type loads a group wholly inside the piece. */
  auto load_v_rows = [&](uint32_t t0, auto check) {
#pragma unroll
    for (int sg = 0; sg < RG; ++sg)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const uint32_t t = t0 + 16u * sg + c + 4 * r;
#pragma unroll
        for (int q = 0; q < C::NV; ++q) {
          if (!decltype(check)::value || t < n) {
            Words<C::VW>::load(vr[sg][r][q], vd + t * rb + (size_t)q * 8u * C::VEC * C::BYTES);
          } else {
#pragma unroll
            for (int w = 0; w < C::VW; ++w) vr[sg][r][q][w] = 0u;
          }
        }
      }
  };
  auto load_v = [&](uint32_t t0) {
    if (t0 + 16u * RG <= n)
      load_v_rows(t0, std::false_type{});
    else
      load_v_rows(t0, std::true_type{});
  };

  const uint32_t groups = (n + 16u * RG - 1u) / (16u * RG);
  AKV_TRACE(1, sfh[0]);
  /* Groups of this warp: all of its own piece (spans), or every kWarps-th. */
  constexpr uint32_t kStep = kSpan3 > 1 ? 1u : (uint32_t)kWarps;
  uint32_t grp = kSpan3 > 1 ? 0u : (uint32_t)warp;
  if (grp < groups) {
    load_k(grp * 16u * RG);
    load_v(grp * 16u * RG);
  }
  for (; grp < groups; grp += kStep) {
    const uint32_t t0 = grp * 16u * RG;
    const uint32_t nxt = grp + kStep;

    /* Scores: lane (g, c) gets rows 16 sg + (g, g + 8) x heads 2c, 2c + 1. */
    /* The dot products run in SA independent accumulators (mma k-step k
     * into accumulator k % SA), summed pairwise at the end: chains of 4
     * dependent mmas instead of one chain over the whole head dimension. */
    float sc[RG][4];
#pragma unroll
    for (int sg = 0; sg < RG; ++sg) {
      float part[C::SA][4];
#pragma unroll
      for (int a = 0; a < C::SA; ++a) part[a][0] = part[a][1] = part[a][2] = part[a][3] = 0.0f;
#pragma unroll
      for (int i = 0; i < C::KCH; ++i) {
        if constexpr (C::F16) {
          /* Word j of the chunk: dims 4j, 4j + 1 (low half) and 4j + 2, 4j + 3. */
#pragma unroll
          for (int j = 0; j < 4; ++j)
            mma_f16_16816(part[(4 * i + j) % C::SA], fp8x2_to_h2<E>(kr[sg][0][i][j]),
                          fp8x2_to_h2<E>(kr[sg][1][i][j]), fp8x2_hi_to_h2<E>(kr[sg][0][i][j]),
                          fp8x2_hi_to_h2<E>(kr[sg][1][i][j]), qf[8 * i + 2 * j],
                          qf[8 * i + 2 * j + 1]);
        } else if constexpr (E == kBf16) {
#pragma unroll
          for (int h = 0; h < 2; ++h)
            mma_bf16_16816(part[(2 * i + h) % C::SA], kr[sg][0][i][2 * h], kr[sg][1][i][2 * h],
                           kr[sg][0][i][2 * h + 1], kr[sg][1][i][2 * h + 1], qf[4 * i + 2 * h],
                           qf[4 * i + 2 * h + 1]);
        } else {
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            uint32_t x0, x1, y0, y1;
            pair_f32<E>(kr[sg][0][i], j, x0, x1); /* row g: dims 2j, 2j + 1 of the chunk */
            pair_f32<E>(kr[sg][1][i], j, y0, y1); /* row g + 8 */
            mma_tf32_1688(part[(8 * i + j) % C::SA], x0, y0, x1, y1, qf[16 * i + 2 * j],
                          qf[16 * i + 2 * j + 1]);
          }
        }
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float t[C::SA];
#pragma unroll
        for (int a = 0; a < C::SA; ++a) t[a] = part[a][e];
#pragma unroll
        for (int w = C::SA / 2; w >= 1; w /= 2)
#pragma unroll
          for (int a = 0; a < w; ++a) t[a] += t[a + w];
        sc[sg][e] = t[0];
      }
    }
    if (nxt < groups) load_k(nxt * 16u * RG);

    AKV_TRACE(grp < 8u ? 2 + 2 * (int)grp : 99, sc[0][0]);
    /* Online softmax over the group, per head, in the base-2 domain. */
    float s[RG][4];
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int sg = 0; sg < RG; ++sg) {
      const bool lo_ok = t0 + 16u * sg + g < n, hi_ok = t0 + 16u * sg + g + 8 < n;
      s[sg][0] = lo_ok ? sc[sg][0] * sfh[0] : -INFINITY;
      s[sg][1] = lo_ok ? sc[sg][1] * sfh[1] : -INFINITY;
      s[sg][2] = hi_ok ? sc[sg][2] * sfh[0] : -INFINITY;
      s[sg][3] = hi_ok ? sc[sg][3] * sfh[1] : -INFINITY;
      mx[0] = fmaxf(mx[0], fmaxf(s[sg][0], s[sg][2]));
      mx[1] = fmaxf(mx[1], fmaxf(s[sg][1], s[sg][3]));
    }
#pragma unroll
    for (int off = 4; off < 32; off <<= 1) {
      mx[0] = fmaxf(mx[0], __shfl_xor_sync(0xFFFFFFFFu, mx[0], off));
      mx[1] = fmaxf(mx[1], __shfl_xor_sync(0xFFFFFFFFu, mx[1], off));
    }
    float alpha[2], pr[RG][4];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float m_new = fmaxf(m_run[h], mx[h]);
      const float m_use = (m_new == -INFINITY) ? 0.0f : m_new;
      alpha[h] = exp2f(m_run[h] - m_use);
      float sum = 0.0f;
#pragma unroll
      for (int sg = 0; sg < RG; ++sg) {
        pr[sg][h] = exp2f(s[sg][h] - m_use);
        pr[sg][h + 2] = exp2f(s[sg][h + 2] - m_use);
        sum += pr[sg][h] + pr[sg][h + 2];
      }
      l_run[h] = l_run[h] * alpha[h] + sum;
      m_run[h] = m_new;
    }
    if (__any_sync(0xFFFFFFFFu, alpha[0] != 1.0f || alpha[1] != 1.0f)) {
#pragma unroll
      for (int j = 0; j < C::PVM; ++j) {
        acc[j][0] *= alpha[0];
        acc[j][1] *= alpha[1];
        acc[j][2] *= alpha[0];
        acc[j][3] *= alpha[1];
      }
    }

    /* P to the B layout of the PV product: lane (g, c) needs
     * P[row 16 sg + 8 half + c (+ 4)][head g]. */
#pragma unroll
    for (int sg = 0; sg < RG; ++sg) {
      *reinterpret_cast<float2 *>(&s_pt[warp][16 * sg + g][2 * c]) =
          make_float2(pr[sg][0], pr[sg][1]);
      *reinterpret_cast<float2 *>(&s_pt[warp][16 * sg + g + 8][2 * c]) =
          make_float2(pr[sg][2], pr[sg][3]);
    }
    __syncwarp();
    if constexpr (C::F16) {
      /* One k16 mma per 16 rows: k slots 2c, 2c + 1, 2c + 8, 2c + 9 are rows
       * c, c + 4, c + 8, c + 12. P is scaled by 2^14 (exact; undone at the
       * end) so that every probability down to 2^-28 is a normal f16, and
       * split into two f16 terms (22 significant bits). */
#pragma unroll
      for (int sg = 0; sg < RG; ++sg) {
        float b[4];
#pragma unroll
        for (int r = 0; r < 4; ++r) b[r] = s_pt[warp][16 * sg + c + 4 * r][g] * 16384.0f;
        const __half2 h01 = __floats2half2_rn(b[0], b[1]), h23 = __floats2half2_rn(b[2], b[3]);
        const float2 f01 = __half22float2(h01), f23 = __half22float2(h23);
        const uint32_t hi01 = *reinterpret_cast<const uint32_t *>(&h01);
        const uint32_t hi23 = *reinterpret_cast<const uint32_t *>(&h23);
        const uint32_t lo01 = f32x2_to_h2(b[0] - f01.x, b[1] - f01.y);
        const uint32_t lo23 = f32x2_to_h2(b[2] - f23.x, b[3] - f23.y);
#pragma unroll
        for (int q = 0; q < C::NV; ++q) {
#pragma unroll
          for (int j = 0; j < C::VEC / 2; ++j) {
            /* The codes of rows (c, c + 4) and (c + 8, c + 12) of dims d
             * (a0, a2) and d + 1 (a1, a3) paired by one byte permute each,
             * then decoded: a0 = (row c, row c + 4) of dim d. */
            const uint32_t b = 2u * (uint32_t)(j & 1);
            const uint32_t w0 = vr[sg][0][q][j >> 1], w1 = vr[sg][1][q][j >> 1];
            const uint32_t w2 = vr[sg][2][q][j >> 1], w3 = vr[sg][3][q][j >> 1];
            const uint32_t a0 = fp8x2_to_h2<E>(__byte_perm(w0, w1, b | ((b + 4u) << 4)));
            const uint32_t a1 = fp8x2_to_h2<E>(__byte_perm(w0, w1, (b + 1u) | ((b + 5u) << 4)));
            const uint32_t a2 = fp8x2_to_h2<E>(__byte_perm(w2, w3, b | ((b + 4u) << 4)));
            const uint32_t a3 = fp8x2_to_h2<E>(__byte_perm(w2, w3, (b + 1u) | ((b + 5u) << 4)));
            float(&a)[4] = acc[q * (C::VEC / 2) + j];
            if constexpr (AKV_ATTN_K3_PV_SPLIT != 0) mma_f16_16816(a, a0, a1, a2, a3, lo01, lo23);
            mma_f16_16816(a, a0, a1, a2, a3, hi01, hi23);
          }
        }
      }
    } else {
#pragma unroll
    for (int sg = 0; sg < RG; ++sg) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const float b0 = s_pt[warp][16 * sg + 8 * half + c][g];
        const float b1 = s_pt[warp][16 * sg + 8 * half + c + 4][g];
        const uint32_t h0 = to_tf32(b0), h1 = to_tf32(b1);
        const uint32_t l0 = to_tf32(b0 - __uint_as_float(h0));
        const uint32_t l1 = to_tf32(b1 - __uint_as_float(h1));
#pragma unroll
        for (int q = 0; q < C::NV; ++q) {
#pragma unroll
          for (int j = 0; j < C::VEC / 2; ++j) {
            uint32_t x0, x1, y0, y1;
            pair_f32<E>(vr[sg][2 * half][q], j, x0, x1);     /* row c: dims d, d + 1 */
            pair_f32<E>(vr[sg][2 * half + 1][q], j, y0, y1); /* row c + 4 */
            float(&a)[4] = acc[q * (C::VEC / 2) + j];
            mma_tf32_1688(a, x0, x1, y0, y1, l0, l1);
            mma_tf32_1688(a, x0, x1, y0, y1, h0, h1);
          }
        }
      }
    }
    }
    if (nxt < groups) load_v(nxt * 16u * RG);
    AKV_TRACE(grp < 8u ? 3 + 2 * (int)grp : 99, acc[0][0]);
    __syncwarp(); /* s_pt is rewritten by the next group */
  }
  AKV_TRACE(18, acc[0][0]);
  /* The running sums over the 8 lanes of each c. */
#pragma unroll
  for (int off = 4; off < 32; off <<= 1) {
    l_run[0] += __shfl_xor_sync(0xFFFFFFFFu, l_run[0], off);
    l_run[1] += __shfl_xor_sync(0xFFFFFFFFu, l_run[1], off);
  }
  if (g == 0) {
    s_m[warp][2 * c] = m_run[0];
    s_m[warp][2 * c + 1] = m_run[1];
    s_l[warp][2 * c] = l_run[0];
    s_l[warp][2 * c + 1] = l_run[1];
  }
  float *my = s_acc + (size_t)warp * C::ACC * 32u + lane;
  constexpr float unscale = C::F16 ? 1.0f / 16384.0f : 1.0f; /* the P scale, exactly */
#pragma unroll
  for (int j = 0; j < C::PVM; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) my[(j * 4 + e) * 32] = acc[j][e] * unscale;
  __syncthreads();
  AKV_TRACE(22, s_m[0][0]);

  /* Merge in warp order: M = max_w m_w, weights 2^(m_w - M). Thread t
   * writes the outputs k = t, t + kThreads, ... of the [ACC][32] layout,
   * whose head is 2 (k % 4) + (k / 32) % 2: with an even number of warps
   * every output of a thread has the same head, so each thread computes that
   * head's weights itself, straight after the one barrier (no second
   * barrier, no weights through shared memory); with an odd number it
   * computes both of its lane's heads. Every thread that computes a head's
   * weights runs the same operations on the same values in the same order,
   * so they agree bit for bit, and they are the operations the merge always
   * used. */
  constexpr int NH = kWarps % 2 == 0 ? 1 : 2;
  const size_t slot0 = ((size_t)ctx * p.n_heads + head0) * p.stride_chunks + pgrp;
  int hs[NH];
  float wgt[NH][kWarps];
#pragma unroll
  for (int i = 0; i < NH; ++i) {
    const int h = 2 * (lane & 3) + (NH == 1 ? (warp & 1) : i);
    hs[i] = h;
    float big = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) big = fmaxf(big, s_m[w][h]);
    const float big_use = (big == -INFINITY) ? 0.0f : big;
    float l = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      wgt[i][w] = exp2f(s_m[w][h] - big_use);
      l = fmaf(wgt[i][w], s_l[w][h], l);
    }
    /* One writer per head: lanes 0-3 of warps 0 and 1 (of warp 0 for both
     * heads with an odd number of warps). */
    if (h < hvalid && (lane >> 2) == 0 && (NH == 2 || warp < 2)) {
      float *ml = p.ml + (slot0 + (size_t)h * p.stride_chunks) * 2;
      ml[0] = big;
      ml[1] = l;
    }
  }
  AKV_TRACE(23, wgt[0][0]);
  constexpr int KN = (C::ACC * 32 + kThreads - 1) / kThreads;
#pragma unroll
  for (int i = 0; i < KN; ++i) {
    const int k = (int)threadIdx.x + i * kThreads;
    if (C::ACC * 32 % kThreads != 0 && k >= C::ACC * 32) break;
    const int r = k >> 5;
    const int j = r >> 2, e = r & 3;
    const int hi = NH == 1 ? 0 : (e & 1);
    const int h = hs[hi];
    if (h >= hvalid) continue;
    const int q = j / (C::VEC / 2), jj = j - q * (C::VEC / 2);
    const int d = q * 8 * C::VEC + (lane >> 2) * C::VEC + 2 * jj + (e >> 1);
    float a = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w)
      a = fmaf(hi == 0 ? wgt[0][w] : wgt[NH - 1][w], s_acc[((size_t)w * C::ACC + r) * 32 + lane], a);
    p.acc[(slot0 + (size_t)h * p.stride_chunks) * D + d] = a;
  }
  AKV_TRACE(19, 0.0f);
}

template <int D, int GT, int E, class Loc>
__global__ void __launch_bounds__(kThreads, min_blocks3())
    akv_attn_chunk_kernel3(const __grid_constant__ ChunkParams p,
                           const __grid_constant__ Loc loc) {
  chunk3_body<D, GT, E, Loc>(p, loc);
}

/* Shared memory the fused kernel's fold takes from kernel 3's (s_m, s_l,
 * s_o of the combine kernel). */
constexpr size_t fold_bytes3() { return (size_t)kCombWarps * 34u * sizeof(float); }

/* The fused kernel: kernel 3's chunk grid, launched cooperatively (every
 * block resident at once, which the grid barrier needs; launch_pair checks
 * the fit and falls back to the two kernels). After the barrier the
 * partials of the whole grid are written and visible (the barrier's arrive
 * is a release at gpu scope after a block barrier, its wait an acquire), and
 * block b folds combine blocks b, b + blocks, ... of the combine kernel's
 * grid ((query head, 32-dim slice), context), each with that kernel's
 * arithmetic: the kCombWarps folds of combine_fold (warp w takes folds w,
 * w + warps, ..., their loads in one round), merged in order by warp 0 in
 * combine_merge. No block leaves before the barrier: chunk3_body returns,
 * never exits the kernel. */
template <int D, int GT, int E, class Loc>
__global__ void __launch_bounds__(kThreads, min_blocks3())
    akv_attn_fused_kernel3(const __grid_constant__ ChunkParams p,
                           const __grid_constant__ CombineParams pp,
                           const __grid_constant__ Loc loc) {
  chunk3_body<D, GT, E, Loc>(p, loc);
  constexpr uint32_t NDS = D / 32;
  constexpr int NF = (kCombWarps + kWarps - 1) / kWarps; /* folds per warp */
  const uint32_t per_ctx = pp.n_heads * NDS;
  const uint32_t total = per_ctx * gridDim.y;
  const uint32_t blocks = gridDim.x * gridDim.y;
  const int warp = (int)(threadIdx.x >> 5);
  const int lane = (int)(threadIdx.x & 31);
  uint32_t w[NF];
#pragma unroll
  for (int j = 0; j < NF; ++j) w[j] = (uint32_t)(warp + j * kWarps); /* >= kCombWarps: none */
  /* Where the first combine block's partials lie, found before the barrier
   * (from the parameters and the page table, which no block writes). */
  uint32_t b = blockIdx.y * gridDim.x + blockIdx.x;
  uint32_t ctx = 0, head = 0, d = 0, nch = 0;
  bool bad = false;
  auto locate = [&]() {
    ctx = b / per_ctx;
    const uint32_t hs = b - ctx * per_ctx;
    head = hs / NDS;
    d = (hs - head * NDS) * 32u + (uint32_t)lane;
    nch = combine_count(pp, loc, ctx, bad);
  };
  if (b < total) locate();
  cooperative_groups::this_grid().sync(); /* also a block barrier: s_dyn is free */
#if AKV_ATTN_BENCH_TRACE
  const uint32_t trace_warp = (blockIdx.y * gridDim.x + blockIdx.x) * kWarps + (uint32_t)warp;
#endif
  AKV_TRACE(20, 0.0f);
  extern __shared__ __align__(16) float s_dyn[];
  float *s_m = s_dyn;
  float *s_l = s_dyn + kCombWarps;
  float(*s_o)[32] = reinterpret_cast<float(*)[32]>(s_dyn + 2 * kCombWarps);
  while (b < total) {
    const size_t slot0 = ((size_t)ctx * pp.n_heads + head) * pp.stride_chunks;
    float m[NF], l[NF], o[NF];
    combine_fold<D, NF>(pp, slot0, d, w, nch, m, l, o);
#pragma unroll
    for (int j = 0; j < NF; ++j) {
      if (w[j] >= (uint32_t)kCombWarps) continue;
      s_o[w[j]][lane] = o[j];
      if (lane == 0) {
        s_m[w[j]] = m[j];
        s_l[w[j]] = l[j];
      }
    }
    __syncthreads();
    if (warp == 0)
      pp.out[((size_t)ctx * pp.n_heads + head) * D + d] =
          combine_merge(pp, s_m, s_l, s_o, head, lane, bad);
    __syncthreads(); /* s_m, s_l, s_o are rewritten by the next combine block */
    b += blocks;
    if (b < total) locate();
  }
  AKV_TRACE(21, 0.0f);
}
#endif /* AKV_ATTN_KERNEL == 3 */


/* The one-pass combine: one block of kCombWarps warps per (context, query
 * head, 32-dim slice); lane `lane` owns dim slice * 32 + lane. Warp w folds
 * the partials w, w + kCombWarps, ... in order into its own running maximum,
 * sum and accumulator (each partial's loads are independent of the fold, so
 * a warp has all of its few partials in flight at once); the warps are then
 * merged in warp order. One read of each partial, no second pass over the
 * maxima: the order depends on the number of partials alone. */
template <int D, class Loc>
__global__ void __launch_bounds__(kCombWarps * 32)
    akv_attn_combine_kernel(const __grid_constant__ CombineParams p,
                            const __grid_constant__ Loc loc) {
  constexpr uint32_t NDS = D / 32;
  __shared__ float s_m[kCombWarps];
  __shared__ float s_l[kCombWarps];
  __shared__ float s_o[kCombWarps][32];

#if AKV_ATTN_PDL
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
  const uint32_t head = blockIdx.x / NDS;
  const uint32_t d = (blockIdx.x - head * NDS) * 32u + (threadIdx.x & 31u);
  const uint32_t ctx = blockIdx.y;
  const int warp = (int)(threadIdx.x >> 5);
  const int lane = (int)(threadIdx.x & 31);
  bool bad = false;
  const uint32_t nch = combine_count(p, loc, ctx, bad);
  const size_t slot0 = ((size_t)ctx * p.n_heads + head) * p.stride_chunks;

  const uint32_t w[1] = {(uint32_t)warp};
  float m[1], l[1], o[1];
  combine_fold<D, 1>(p, slot0, d, w, nch, m, l, o);
  s_o[warp][lane] = o[0];
  if (lane == 0) {
    s_m[warp] = m[0];
    s_l[warp] = l[0];
  }
  __syncthreads();

  if (warp == 0)
    p.out[((size_t)ctx * p.n_heads + head) * D + d] = combine_merge(p, s_m, s_l, s_o, head, lane, bad);
}

/* ------------------------------------------------------------------ host */

template <class Loc>
using ChunkFn = void (*)(ChunkParams, Loc);
template <class Loc>
using CombineFn = void (*)(CombineParams, Loc);
template <class Loc>
using FusedFn = void (*)(ChunkParams, CombineParams, Loc);

template <int D, int GT, int E, class Loc>
ChunkFn<Loc> chunk_of(size_t *smem, FusedFn<Loc> *fused) {
  *fused = nullptr;
#if AKV_ATTN_KERNEL == 3
  static_assert(merge_bytes3<D, E>() <= 227u * 1024u,
                "AKV_ATTN_WARPS x head_dim accumulators exceed the shared memory of an SM");
  static_assert(fold_bytes3() <= merge_bytes3<D, E>(), "the fold's shared memory is kernel 3's");
  *smem = merge_bytes3<D, E>();
#if AKV_ATTN_FUSED && !AKV_ATTN_BENCH_CHUNK_ONLY
  *fused = akv_attn_fused_kernel3<D, GT, E, Loc>;
#endif
  return akv_attn_chunk_kernel3<D, GT, E, Loc>;
#elif AKV_ATTN_KERNEL == 2
  static_assert(stage_bytes2<D, GT, E>() + 20u * 1024u <= 227u * 1024u,
                "AKV_ATTN_STAGES x AKV_ATTN_LOADS batches exceed the shared memory of an SM");
  *smem = stage_bytes2<D, GT, E>(); /* the cp.async ring; 0 for the register pipeline */
  return akv_attn_chunk_kernel2<D, GT, E, Loc>;
#else
  static_assert(stage_bytes<D, GT, E>() + 16u * 1024u <= 227u * 1024u,
                "AKV_ATTN_STAGES x AKV_ATTN_LOADS tiles exceed the shared memory of an SM");
  *smem = stage_bytes<D, GT, E>();
  return akv_attn_chunk_kernel<D, GT, E, Loc>;
#endif
}

template <int D, int E, class Loc>
ChunkFn<Loc> pick_chunk_gt(int gt, size_t *smem, FusedFn<Loc> *fused) {
  switch (gt) {
    case 1: return chunk_of<D, 1, E, Loc>(smem, fused);
    case 2: return chunk_of<D, 2, E, Loc>(smem, fused);
    case 4:
      if constexpr (kWarps >= 4 || AKV_ATTN_KERNEL != 1) return chunk_of<D, 4, E, Loc>(smem, fused);
      return nullptr;
    case 8:
      if constexpr (kWarps >= 8 || AKV_ATTN_KERNEL != 1) return chunk_of<D, 8, E, Loc>(smem, fused);
      return nullptr;
    default: return nullptr;
  }
}

template <int E, class Loc>
ChunkFn<Loc> pick_chunk_dim(uint32_t head_dim, int gt, size_t *smem, FusedFn<Loc> *fused) {
  switch (head_dim) {
    case 64: return pick_chunk_gt<64, E, Loc>(gt, smem, fused);
    case 128: return pick_chunk_gt<128, E, Loc>(gt, smem, fused);
    case 256: return pick_chunk_gt<256, E, Loc>(gt, smem, fused);
    default: return nullptr;
  }
}

/* The chunk kernel for (dtype, head_dim, gt), its dynamic shared memory and
 * the fused kernel of the same shape (nullptr: none built). */
template <class Loc>
ChunkFn<Loc> pick_chunk(akv_dtype dtype, uint32_t head_dim, int gt, size_t *smem,
                        FusedFn<Loc> *fused) {
  *smem = 0;
  *fused = nullptr;
  switch (dtype) {
    case AKV_DTYPE_BF16: return pick_chunk_dim<kBf16, Loc>(head_dim, gt, smem, fused);
    case AKV_DTYPE_FP8_E4M3: return pick_chunk_dim<kE4m3, Loc>(head_dim, gt, smem, fused);
    case AKV_DTYPE_FP8_E5M2: return pick_chunk_dim<kE5m2, Loc>(head_dim, gt, smem, fused);
    default: return nullptr;
  }
}

template <class Loc>
CombineFn<Loc> pick_combine(uint32_t head_dim) {
  switch (head_dim) {
    case 64: return akv_attn_combine_kernel<64, Loc>;
    case 128: return akv_attn_combine_kernel<128, Loc>;
    case 256: return akv_attn_combine_kernel<256, Loc>;
    default: return nullptr;
  }
}

static bool aligned16(const void *p) { return ((uintptr_t)p & 15u) == 0; }
static bool aligned16(uint64_t v) { return (v & 15u) == 0; }

static uint32_t div_up(uint32_t a, uint32_t b) { return a / b + (a % b != 0); }

/* The workspace layout of attention_ref.c (acc region, then ml region). */
static bool ws_layout(uint32_t n_contexts, uint32_t n_heads, uint32_t head_dim,
                      uint32_t max_chunks, size_t *acc_bytes, size_t *total) {
  const unsigned __int128 slots = (unsigned __int128)n_contexts * n_heads * max_chunks;
  unsigned __int128 acc = slots * head_dim * sizeof(float);
  unsigned __int128 ml = slots * 2 * sizeof(float);
  acc = (acc + kWsAlign - 1) / kWsAlign * kWsAlign;
  ml = (ml + kWsAlign - 1) / kWsAlign * kWsAlign;
  if (acc + ml > (unsigned __int128)SIZE_MAX) return false;
  *acc_bytes = (size_t)acc;
  *total = (size_t)(acc + ml);
  return true;
}

/* Subgroup size: the smallest of 1, 2, 4, 8 covering min(group, 8); kernel 1
 * takes at most one head per warp (its stats step), kernel 2 any. */
static int pick_gt(uint32_t group) {
  const uint32_t g = group < 8 ? group : 8;
  const int gt = g <= 1 ? 1 : g <= 2 ? 2 : g <= 4 ? 4 : 8;
  return (AKV_ATTN_KERNEL != 1 || gt < kWarps) ? gt : kWarps;
}

/* The chunk kernel's grid.x (piece slots * kv slots) must fit 2^31 - 1. */
static bool grid_fits(uint64_t piece_slots, uint32_t n_heads, uint32_t kv_heads) {
  const uint32_t group = n_heads / kv_heads;
  const uint64_t slots = (uint64_t)kv_heads * div_up(group, (uint32_t)pick_gt(group));
  return piece_slots <= 0x7FFFFFFFull && piece_slots * slots <= 0x7FFFFFFFull;
}

/* Checks of both variants: those the reference makes too
 * (akv_attn_args_check, one function, so both return the same status for
 * the same call), then the kernels' own alignment and shape rules. */
static akv_status check_common(akv_dtype dtype, uint32_t n_heads, uint32_t kv_heads,
                               uint32_t head_dim, uint64_t row_bytes, float scale, const void *q,
                               const float *out, const void *workspace, const float *k_scale,
                               const float *v_scale) {
  const akv_status st = akv_attn_args_check(dtype, n_heads, kv_heads, head_dim, row_bytes, scale,
                                            q, out, k_scale, v_scale);
  if (st != AKV_OK) return st;
  if (!aligned16(q) || !aligned16(row_bytes) || !aligned16(workspace) ||
      ((uintptr_t)out & 3u) != 0)
    return AKV_ERR_INVALID_ARGUMENT;
  if (head_dim != 64 && head_dim != 128 && head_dim != 256) return AKV_ERR_NOT_SUPPORTED;
  /* The launch parameters hold kScaleSlots scales (launch_params copies
   * kv_heads of them): the public bound in the library's build, fewer in a
   * benchmark build with AKV_ATTN_PARAM_SLOTS. */
  if (k_scale != nullptr && kv_heads > kScaleSlots) return AKV_ERR_NOT_SUPPORTED;
  const uint32_t group = n_heads / kv_heads;
  const uint32_t n_sub = div_up(group, (uint32_t)pick_gt(group));
  if ((uint64_t)kv_heads * n_sub > 65535u) return AKV_ERR_INVALID_ARGUMENT;
  return AKV_OK;
}

/* The chunk and combine parameters of the launch that covers contexts from
 * c0 on: pointers offset to c0 in q, out and the workspace (acc region, then
 * the ml region at acc_bytes; stride chunk slots per context and head). */
static void launch_params(uint32_t n_heads, uint32_t kv_heads, uint32_t head_dim, float scale,
                          const void *q, float *out, void *workspace, size_t acc_bytes,
                          uint32_t stride, uint32_t chunk_tokens, const float *k_scale,
                          const float *v_scale, uint32_t c0, ChunkParams *cp,
                          CombineParams *pp) {
  const uint32_t group = n_heads / kv_heads;
  const uint32_t n_sub = div_up(group, (uint32_t)pick_gt(group));
  const size_t q_per_ctx = (size_t)n_heads * head_dim; /* elements */
  const size_t slots_per_ctx = (size_t)n_heads * stride;
  float *acc = static_cast<float *>(workspace);
  float *ml = reinterpret_cast<float *>(static_cast<char *>(workspace) + acc_bytes);
  *cp = ChunkParams{};
  cp->q = static_cast<const uint16_t *>(q) + (size_t)c0 * q_per_ctx;
  cp->acc = acc + (size_t)c0 * slots_per_ctx * head_dim;
  cp->ml = ml + (size_t)c0 * slots_per_ctx * 2;
  cp->n_heads = n_heads;
  cp->group = group;
  cp->n_sub = n_sub;
  cp->kv_slots = kv_heads * n_sub;
  cp->stride_chunks = stride;
  cp->pieces = akv_attn_pieces(chunk_tokens);
  cp->piece_rows = akv_attn_piece_rows(chunk_tokens);
  cp->scale_log2 = scale * kLog2e;
  *pp = CombineParams{};
  pp->acc = cp->acc;
  pp->ml = cp->ml;
  pp->out = out + (size_t)c0 * q_per_ctx;
  pp->n_heads = n_heads;
  pp->group = group;
  pp->stride_chunks = stride;
  pp->pieces = cp->pieces;
  pp->piece_rows = cp->piece_rows;
  /* check_common bounded kv_heads by the arrays when scales are given. */
  if (k_scale != nullptr) {
    cp->has_scales = pp->has_scales = 1;
    for (uint32_t g = 0; g < kv_heads; ++g) {
      cp->k_scale[g] = k_scale[g];
      pp->v_scale[g] = v_scale[g];
    }
  }
}

/* Blocks of fn (kThreads threads, smem bytes of dynamic shared memory,
 * opted in already) that the current device keeps resident at once, the
 * bound of a cooperative launch; 0 where the device takes none, a query
 * fails, or a launch of fn on this device was refused (coop_refused).
 * Cached per (device, function), the only things it depends on (64 pairs;
 * past them the queries run on every call). */
struct CoopEntry {
  const void *fn;
  int dev;
  uint64_t blocks;
};
static std::mutex coop_mu;
static CoopEntry coop_cache[64];
static size_t coop_used = 0;

static uint64_t coop_blocks(const void *fn, size_t smem, int dev) {
  {
    std::lock_guard<std::mutex> g(coop_mu);
    for (size_t i = 0; i < coop_used; ++i)
      if (coop_cache[i].fn == fn && coop_cache[i].dev == dev) return coop_cache[i].blocks;
  }
  int coop = 0, sms = 0, per_sm = 0;
  if (cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, fn, kThreads, smem) != cudaSuccess) {
    (void)cudaGetLastError(); /* this failed query's error, not the caller's: no fusing */
    return 0;
  }
  const uint64_t blocks = coop != 0 && sms > 0 && per_sm > 0 ? (uint64_t)sms * (uint64_t)per_sm : 0;
  std::lock_guard<std::mutex> g(coop_mu);
  for (size_t i = 0; i < coop_used; ++i) /* another thread's answer: the same */
    if (coop_cache[i].fn == fn && coop_cache[i].dev == dev) return coop_cache[i].blocks;
  if (coop_used < sizeof coop_cache / sizeof coop_cache[0])
    coop_cache[coop_used++] = CoopEntry{fn, dev, blocks};
  return blocks;
}

/* A cooperative launch of fn on dev was refused (a share of the SMs taken
 * by another context, say): later calls take the two kernels at once
 * instead of being refused again. */
static void coop_refused(const void *fn, int dev) {
  std::lock_guard<std::mutex> g(coop_mu);
  for (size_t i = 0; i < coop_used; ++i)
    if (coop_cache[i].fn == fn && coop_cache[i].dev == dev) coop_cache[i].blocks = 0;
}

template <class Loc>
akv_status launch_pair(akv_dtype dtype, uint32_t head_dim, int gt, dim3 grid_chunk,
                       const ChunkParams &cp, dim3 grid_combine, const CombineParams &pp,
                       const Loc &loc, cudaStream_t stream) {
  size_t smem = 0;
  FusedFn<Loc> fused_fn = nullptr;
  ChunkFn<Loc> chunk_fn = pick_chunk<Loc>(dtype, head_dim, gt, &smem, &fused_fn);
  CombineFn<Loc> combine_fn = pick_combine<Loc>(head_dim);
  if (chunk_fn == nullptr || combine_fn == nullptr) return AKV_ERR_NOT_SUPPORTED;
  cudaLaunchConfig_t cfg = {};
  cfg.blockDim = dim3(kThreads, 1, 1);
  cfg.dynamicSmemBytes = 0;
  cfg.stream = stream;
  cfg.attrs = nullptr;
  cfg.numAttrs = 0;
  /* Kernel 3 with spans: one block per span of pieces. */
  grid_chunk.x = div_up(grid_chunk.x / cp.kv_slots, kSpan3) * cp.kv_slots;
  /* One cooperative launch where the whole chunk grid is resident at once
   * (akv_attn_fused_kernel3; its fold walks the combine grid of
   * grid_combine's shape, which it derives from n_heads, head_dim and
   * gridDim.y). The bits are the two kernels', so the choice depends on
   * the device's room alone and changes no result. */
  if (fused_fn != nullptr && grid_chunk.x > 0 && grid_combine.y == grid_chunk.y &&
      grid_combine.x == pp.n_heads * (head_dim / 32u)) {
    if (smem > 48u * 1024u &&
        cudaFuncSetAttribute(fused_fn, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem) !=
            cudaSuccess)
      return AKV_ERR_BACKEND;
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) return AKV_ERR_BACKEND;
    if ((uint64_t)grid_chunk.x * grid_chunk.y <= coop_blocks((const void *)fused_fn, smem, dev)) {
      cudaLaunchAttribute coop[1];
      coop[0].id = cudaLaunchAttributeCooperative;
      coop[0].val.cooperative = 1;
      cfg.gridDim = grid_chunk;
      cfg.dynamicSmemBytes = smem;
      cfg.attrs = coop;
      cfg.numAttrs = 1;
      if (cudaLaunchKernelEx(&cfg, fused_fn, cp, pp, loc) == cudaSuccess) return AKV_OK;
      /* Refused (too large for the SMs this context has, or no cooperative
       * launch here): nothing was enqueued; clear the launch's error and
       * take the two kernels, now and on later calls. A broken context
       * fails them too (its error is sticky), and the call reports it. */
      (void)cudaGetLastError();
      coop_refused((const void *)fused_fn, dev);
      cfg.attrs = nullptr;
      cfg.numAttrs = 0;
    }
  }
  if (grid_chunk.x > 0) {
    /* Above 48 KiB of dynamic shared memory needs the opt-in; it is a
     * per-device attribute of the function, so it is set on every call
     * (cheap, idempotent, right for whichever device is current). */
    if (smem > 48u * 1024u &&
        cudaFuncSetAttribute(chunk_fn, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem) !=
            cudaSuccess)
      return AKV_ERR_BACKEND;
    cfg.gridDim = grid_chunk;
    cfg.dynamicSmemBytes = smem;
    if (cudaLaunchKernelEx(&cfg, chunk_fn, cp, loc) != cudaSuccess) return AKV_ERR_BACKEND;
  }
#if AKV_ATTN_BENCH_CHUNK_ONLY
  /* Benchmark diagnostic build only: the chunk kernel timed alone (the
   * output is never written; the benchmark's check fails, by design). */
  (void)grid_combine, (void)pp, (void)combine_fn;
  return AKV_OK;
#endif
  cfg.gridDim = grid_combine;
  cfg.blockDim = dim3(kCombWarps * 32, 1, 1);
  cfg.dynamicSmemBytes = 0;
#if AKV_ATTN_PDL
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  if (grid_chunk.x > 0) {
    cfg.attrs = attr;
    cfg.numAttrs = 1;
  }
#endif
  if (cudaLaunchKernelEx(&cfg, combine_fn, pp, loc) != cudaSuccess) return AKV_ERR_BACKEND;
  return AKV_OK;
}

} // namespace

#if AKV_ATTN_BENCH_TRACE
/* Benchmark diagnostic builds only: clear the trace, or read at most count
 * of its values ([warp][point]; dst NULL: none) and give its shape in
 * *points and *warps (where not NULL). */
extern "C" int akv_attn_bench_trace_clear(void) {
  void *p = nullptr;
  return cudaGetSymbolAddress(&p, akv_attn_trace) == cudaSuccess &&
                 cudaMemset(p, 0, sizeof(akv_attn_trace)) == cudaSuccess
             ? 0
             : -1;
}
extern "C" int akv_attn_bench_trace_read(unsigned long long *dst, size_t count, int *points,
                                         size_t *warps) {
  if (points != nullptr) *points = kTracePts;
  if (warps != nullptr) *warps = kTraceWarps;
  if (dst == nullptr) return 0;
  if (count > (size_t)kTraceWarps * kTracePts) count = (size_t)kTraceWarps * kTracePts;
  return cudaMemcpyFromSymbol(dst, akv_attn_trace, count * sizeof(unsigned long long)) ==
                 cudaSuccess
             ? 0
             : -1;
}
/* The SM of each of the first count warps. */
extern "C" int akv_attn_bench_trace_sm_read(unsigned int *dst, size_t count) {
  if (count > (size_t)kTraceWarps) count = kTraceWarps;
  return cudaMemcpyFromSymbol(dst, akv_attn_trace_sm, count * sizeof(unsigned int)) == cudaSuccess
             ? 0
             : -1;
}
#endif

extern "C" AKV_API akv_status akv_attention_decode_cuda(const akv_attention_args *args,
                                                        cudaStream_t stream) {
  akv_status st = AKV_ERR_INVALID_ARGUMENT;
  uint32_t max_len = 0;
  uint64_t slots = 0;
  size_t acc_bytes = 0, total = 0;
  /* *args is read once, here, as the reference reads it (it may lie in
   * memory the enqueued kernels write: mapped host memory). */
  akv_attention_args local;
  const akv_attention_args *a = &local;
  if (args == nullptr || !akv_attn_aligned_to(args, alignof(akv_attention_args))) goto fail;
  local = *args;
  st = check_common(a->dtype, a->n_heads, a->kv_heads, a->head_dim, a->row_bytes, a->scale, a->q,
                    a->out, a->workspace, a->k_scale, a->v_scale);
  if (st != AKV_OK) goto fail;
  st = AKV_ERR_INVALID_ARGUMENT;
  /* The chunk bound keeps every piece's first row (piece * piece_rows, a
   * uint32_t in the chunk kernels) within 32 bits: akv_attn_chunk_ok, the
   * reference's rule. */
  if (a->n_contexts == 0 || !akv_attn_chunk_ok(a->chunk_tokens) || a->len == nullptr ||
      a->k_base == nullptr || a->v_base == nullptr)
    goto fail;
  if (!aligned16(a->k_base) || !aligned16(a->v_base) || !aligned16(a->context_stride)) goto fail;
  /* len is read here through its type; the page map by the kernel, 4 bytes
   * at a time (a misaligned one would fault on the device). */
  if (!akv_attn_aligned4(a->len) || !akv_attn_aligned4(a->page_map)) goto fail;
  if (!akv_attn_array_fits(a->len, a->n_contexts, 4u)) goto fail; /* before len is read */
  if (a->page_map != nullptr &&
      (a->page_map_stride == 0 || a->k_pages == nullptr || a->v_pages == nullptr ||
       !aligned16(a->k_pages) || !aligned16(a->v_pages) || !aligned16(a->page_stride)))
    goto fail;
  /* The page map's shape, [n_contexts][page_map_stride] uint32, fits the
   * address space (the launches offset it per group of contexts). */
  if (a->page_map != nullptr) {
    akv_attn_span map;
    uint64_t map_bytes;
    if (!akv_attn_mul4(a->n_contexts, a->page_map_stride, 4u, 1u, &map_bytes) ||
        !akv_attn_span_at(a->page_map, map_bytes, &map))
      goto fail;
  }
  {
    /* Rows 0..len-1 of every context at k_base/v_base have offsets that fit
     * ptrdiff_t (akv_attn_rows_addressable). The page map is device memory:
     * its entries are not read here. */
    const uint64_t extent = (uint64_t)a->kv_heads * a->head_dim * akv_attn_elem_bytes(a->dtype);
    for (uint32_t i = 0; i < a->n_contexts; ++i) {
      const uint32_t len = a->len[i];
      if (len > max_len) max_len = len;
      if (len != 0 &&
          (!akv_attn_rows_addressable(a->k_base, i, a->context_stride, len - 1u, a->row_bytes,
                                      extent) ||
           !akv_attn_rows_addressable(a->v_base, i, a->context_stride, len - 1u, a->row_bytes,
                                      extent)))
        goto fail;
    }
  }
  /* Piece slots per (context, head): the stride of the workspace. */
  slots = (uint64_t)div_up(max_len, a->chunk_tokens) * akv_attn_pieces(a->chunk_tokens);
  if (!grid_fits(slots, a->n_heads, a->kv_heads)) goto fail;
  if (!ws_layout(a->n_contexts, a->n_heads, a->head_dim, (uint32_t)slots, &acc_bytes, &total))
    goto fail;
  if (a->workspace_bytes < total || (total != 0 && a->workspace == nullptr)) goto fail;
  if (!akv_attn_contig_clear(a, total, 0)) goto fail;

  {
    const int gt = pick_gt(a->n_heads / a->kv_heads);
    const uint32_t stride = (uint32_t)slots;

    /* c0 is 64 bits: past the last group of a batch above 2^32 - 256
     * contexts, a uint32_t would wrap to 0 and launch forever. */
    for (uint64_t c0 = 0; c0 < a->n_contexts; c0 += kMaxLaunchContexts) {
      const uint32_t nc = a->n_contexts - c0 < kMaxLaunchContexts
                              ? (uint32_t)(a->n_contexts - c0)
                              : kMaxLaunchContexts;
      ContigLoc loc = {};
      loc.k = static_cast<const char *>(a->k_base) + (size_t)c0 * a->context_stride;
      loc.v = static_cast<const char *>(a->v_base) + (size_t)c0 * a->context_stride;
      loc.context_stride = a->context_stride;
      loc.row_bytes = a->row_bytes;
      loc.chunk_tokens = a->chunk_tokens;
      if (a->page_map != nullptr) {
        loc.map = a->page_map + (size_t)c0 * a->page_map_stride;
        loc.map_stride = a->page_map_stride;
        loc.pk = static_cast<const char *>(a->k_pages);
        loc.pv = static_cast<const char *>(a->v_pages);
        loc.page_stride = a->page_stride;
      }
      uint32_t grid_x = 0; /* piece slots of the launch's longest context */
      for (uint32_t i = 0; i < nc; ++i) {
        loc.len[i] = a->len[c0 + i];
        const uint32_t ch = div_up(loc.len[i], a->chunk_tokens);
        if (ch > grid_x) grid_x = ch;
      }
      grid_x *= akv_attn_pieces(a->chunk_tokens); /* <= stride: grid_fits bounds it */
      ChunkParams cp;
      CombineParams pp;
      launch_params(a->n_heads, a->kv_heads, a->head_dim, a->scale, a->q, a->out, a->workspace,
                    acc_bytes, stride, a->chunk_tokens, a->k_scale, a->v_scale, (uint32_t)c0, &cp,
                    &pp);
      st = launch_pair<ContigLoc>(a->dtype, a->head_dim, gt, dim3(grid_x * cp.kv_slots, nc, 1), cp,
                                  dim3(a->n_heads * (a->head_dim / 32u), nc, 1), pp, loc, stream);
      if (st != AKV_OK) goto fail;
    }
  }
  return AKV_OK;
fail:
  return st;
}

extern "C" AKV_API akv_status akv_attention_paged_cuda(const akv_attention_paged_args *args,
                                                       akv_page_table t, cudaStream_t stream) {
  akv_status st = AKV_ERR_INVALID_ARGUMENT;
  uint64_t slots = 0;
  size_t acc_bytes = 0, total = 0;
  akv_attention_paged_args local; /* read once, as akv_attention_decode_cuda reads its struct */
  const akv_attention_paged_args *a = &local;
  if (args == nullptr || !akv_attn_aligned_to(args, alignof(akv_attention_paged_args)))
    goto fail;
  local = *args;
  st = check_common(a->dtype, a->n_heads, a->kv_heads, a->head_dim, t.row_bytes, a->scale, a->q,
                    a->out, a->workspace, a->k_scale, a->v_scale);
  if (st != AKV_OK) goto fail;
  st = AKV_ERR_INVALID_ARGUMENT;
  /* indices may be NULL: a table without pages has none (akv_attention.h,
   * "Empty arrays"), and indptr, device memory, cannot tell the host whether
   * the table has pages. Then no chunk kernel runs (nothing would read a
   * page id) and the combine sees max_pages 0: an empty context gets zeros,
   * one with pages NaN, as any context beyond max_pages does. */
  if (t.batch == 0 || !akv_attn_chunk_ok(t.page_tokens) || t.indptr == nullptr ||
      t.last_page_len == nullptr || t.k_pages == nullptr || t.v_pages == nullptr)
    goto fail;
  if (!aligned16(t.k_pages) || !aligned16(t.v_pages) || !aligned16(t.page_stride)) goto fail;
  /* The kernels read the table's arrays 4 bytes at a time. */
  if (!akv_attn_aligned4(t.indptr) || !akv_attn_aligned4(t.indices) ||
      !akv_attn_aligned4(t.last_page_len))
    goto fail;
  slots = (uint64_t)t.max_pages * akv_attn_pieces(t.page_tokens);
  if (!grid_fits(slots, a->n_heads, a->kv_heads)) goto fail;
  if (!ws_layout(t.batch, a->n_heads, a->head_dim, (uint32_t)slots, &acc_bytes, &total))
    goto fail;
  if (a->workspace_bytes < total || (total != 0 && a->workspace == nullptr)) goto fail;
  {
    /* akv_attention.h, "Overlap": the table's indices and pages are not
     * known on the host (indptr is device memory); the rest is checked. */
    akv_attn_writes w;
    if (!akv_attn_dense_clear(t.batch, a->n_heads, a->head_dim, a->kv_heads, a->q, a->out,
                              a->workspace, total, a->k_scale, a->v_scale, &w) ||
        !akv_attn_array_clear(&w, t.indptr, (uint64_t)t.batch + 1u, 4u) ||
        !akv_attn_array_clear(&w, t.last_page_len, t.batch, 4u))
      goto fail;
  }

  {
    const int gt = pick_gt(a->n_heads / a->kv_heads);
    const uint32_t stride = (uint32_t)slots;

    for (uint64_t c0 = 0; c0 < t.batch; c0 += kMaxLaunchContexts) { /* 64 bits: see above */
      const uint32_t nc =
          t.batch - c0 < kMaxLaunchContexts ? (uint32_t)(t.batch - c0) : kMaxLaunchContexts;
      PagedLoc loc = {};
      loc.k = static_cast<const char *>(t.k_pages);
      loc.v = static_cast<const char *>(t.v_pages);
      loc.page_stride = t.page_stride;
      loc.row_bytes = t.row_bytes;
      loc.indptr = t.indptr + c0; /* values stay absolute offsets into indices */
      loc.indices = t.indices;
      loc.last_page_len = t.last_page_len + c0;
      loc.page_tokens = t.page_tokens;
      loc.max_pages = t.indices != nullptr ? t.max_pages : 0u;
      ChunkParams cp;
      CombineParams pp;
      launch_params(a->n_heads, a->kv_heads, a->head_dim, a->scale, a->q, a->out, a->workspace,
                    acc_bytes, stride, t.page_tokens, a->k_scale, a->v_scale, (uint32_t)c0, &cp,
                    &pp);
      const uint32_t grid_x = t.indices != nullptr ? stride : 0u; /* no page ids: no pages read */
      st = launch_pair<PagedLoc>(a->dtype, a->head_dim, gt, dim3(grid_x * cp.kv_slots, nc, 1), cp,
                                 dim3(a->n_heads * (a->head_dim / 32u), nc, 1), pp, loc, stream);
      if (st != AKV_OK) goto fail;
    }
  }
  return AKV_OK;
fail:
  return st;
}
