/*
 * attention_bw.cu - how close the CUDA decode attention gets to the memory
 * read ceiling.
 *
 * Decode attention reads every K and V byte of the history once, so its floor
 * is bytes / bandwidth. For the llama-3-8b layer (32 query heads, 8 KV heads,
 * head_dim 128, bf16) one context of 31,744 tokens is 31744*8*128*2*2 bytes
 * = 130 MB, 29.6 us at 4.4 TB/s; with FP8 E4M3 K/V (one byte per element,
 * counted as such) 65 MB, 14.8 us. The target is >= 60% of that ceiling for
 * both dtypes and for 1 and 4 contexts.
 *
 * For each dtype (bf16, FP8 E4M3 with per-head scales) and 1 and 4 contexts
 * (contiguous and paged) the program times the launcher
 * with CUDA events: warm-up first, then many launches, each timed alone, over
 * input sets rotated so that the data read is several times the L2; it
 * reports the median. It also measures a plain streaming-read kernel over the
 * same buffers in the same run, as the achievable ceiling, and the same bytes
 * read in the chunk kernel's order with loads only (read_order: the ceiling
 * of the kernel's shape without its arithmetic), the same bytes on the
 * kernel's blocks and occupancy read as contiguous spans (read_span) and by
 * the plain loop, the same bytes as tiles on one block per SM handed out
 * statically or to whichever block asks next (read_tiles: what an even split
 * over the SMs costs), and 32 calls back to back between one pair of events
 * (a decode step's layers, launch latency overlapped), and checks the
 * results (CUDA vs the C reference, paged == contiguous bit for bit) once,
 * printing an FNV-1a digest of the output so that two builds run in one
 * device call can be compared bit for bit.
 *
 * Build (from the repository root):
 *   nvcc -O3 -arch=sm_90 -std=c++17 -Iinclude bench/attention_bw.cu \
 *        src/kernels/attention_cuda.cu src/kernels/attention_ref.c -o build/attention_bw
 * The kernel's tuning knobs can be varied at build time with
 * -DAKV_ATTN_KERNEL=1|2|3 -DAKV_ATTN_WARPS=N -DAKV_ATTN_LOADS=N
 * -DAKV_ATTN_STAGES=N -DAKV_ATTN_PDL=0|1 -DAKV_ATTN_PIECE_TOKENS=N
 * -DAKV_ATTN_MINB=N -DAKV_ATTN_COMBINE_WARPS=N -DAKV_ATTN_K3_FP8_F16=0|1
 * -DAKV_ATTN_K3_SPAN=1|WARPS
 * (applied to all three files). KERNEL 3 is the library's tensor-core chunk
 * kernel (WARPS warps per block, LOADS / 4 bf16 or LOADS / 2 FP8 blocks of
 * 16 rows in flight per warp, MINB its resident blocks per SM asked of the
 * compiler, K3_FP8_F16 0 takes FP8 through tf32 instead of f16); KERNEL 1 is
 * the tiled CUDA-core kernel (LOADS row slots per thread and tile, doubled
 * for FP8; STAGES 0 its register pipeline, >= 2 a cp.async ring), KERNEL 2
 * the warp-streaming CUDA-core kernel. PDL 1 launches the combine kernel
 * with programmatic dependent launch, PIECE_TOKENS cuts chunks into pieces
 * of that many rows (0: whole), COMBINE_WARPS the combine kernel's warps.
 * -DAKV_ATTN_BENCH_CHUNK_ONLY=1 is a diagnostic, not a variant: the combine
 * kernel is not launched, so the figure is the chunk kernel's alone (its
 * outputs are never written and the check reports FAILED, as it must).
 * -DAKV_ATTN_BENCH_TRACE=1 is a diagnostic too: kernel 3's warps record the
 * global timer at fixed points (entry, query set up, each group's scores
 * and V products, loop end, partial written) and, after the timed runs,
 * one more launch prints its timeline ("trace" lines); the timer reads cost
 * a few percent, so its timings are not the library's.
 * The defaults below are the library's.
 *
 * Usage: attention_bw [--tokens N] [--chunk N] [--contexts 1,4] [--dtype bf16,fp8]
 *                     [--iters N] [--warmup N] [--json FILE] [--label TEXT] [--no-check]
 * Output: a table on stdout and one JSON object per line per configuration
 * (stdout, and appended to FILE with --json).
 */
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <string>
#include <vector>

#include "akv_attention.h"
#include "akv_cuda.h"

/* The library's knobs (src/kernels/attention_cuda.cu), for the report. */
#ifndef AKV_ATTN_KERNEL
#define AKV_ATTN_KERNEL 3
#endif
#ifndef AKV_ATTN_WARPS
#define AKV_ATTN_WARPS 8
#endif
#ifndef AKV_ATTN_LOADS
#define AKV_ATTN_LOADS (AKV_ATTN_KERNEL == 3 ? 8 : 4)
#endif
#ifndef AKV_ATTN_STAGES
#define AKV_ATTN_STAGES 0
#endif
#ifndef AKV_ATTN_PDL
#define AKV_ATTN_PDL 0
#endif
#ifndef AKV_ATTN_PIECE_TOKENS
#define AKV_ATTN_PIECE_TOKENS 256 /* the library's (attention_pieces.h) */
#endif
#ifndef AKV_ATTN_COMBINE_WARPS
#define AKV_ATTN_COMBINE_WARPS 16
#endif
#ifndef AKV_ATTN_MINB
#define AKV_ATTN_MINB (AKV_ATTN_KERNEL == 3 ? 1 : 0)
#endif
#ifndef AKV_ATTN_K3_FP8_F16
#define AKV_ATTN_K3_FP8_F16 1
#endif
#ifndef AKV_ATTN_K3_SPAN
#define AKV_ATTN_K3_SPAN AKV_ATTN_WARPS
#endif

static const uint32_t kPieceTokens = AKV_ATTN_PIECE_TOKENS > 0 ? AKV_ATTN_PIECE_TOKENS : 256;
static const double kCeilingGBps = 4400.0; /* kernel read ceiling, shared/MEASURED.md */

#define CK(call)                                                                      \
  do {                                                                                \
    const cudaError_t e_ = (call);                                                    \
    if (e_ != cudaSuccess) {                                                          \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
      exit(1);                                                                        \
    }                                                                                 \
  } while (0)

#define AK(call)                                                                   \
  do {                                                                             \
    const akv_status s_ = (call);                                                  \
    if (s_ != AKV_OK) {                                                            \
      fprintf(stderr, "%s:%d %s: status %d (%s)\n", __FILE__, __LINE__, #call, (int)s_, \
              cudaGetErrorString(cudaGetLastError()));                             \
      exit(1);                                                                     \
    }                                                                              \
  } while (0)

__device__ __forceinline__ uint64_t splitmix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

/* Random bf16 in [-1, 1): never time on zeros. */
__global__ void fill_bf16(uint16_t *p, size_t n, uint64_t seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    const uint64_t x = splitmix(i ^ (seed << 40));
    const float f = (float)(x >> 40) * (1.0f / 16777216.0f) * 2.0f - 1.0f;
    p[i] = (uint16_t)(__float_as_uint(f) >> 16);
  }
}

/* Random FP8 E4M3 codes: sign, mantissa, exponent field 1..9 (2^-6 .. 7.5),
 * never NaN; with the scales below, values of about unit size. */
__global__ void fill_e4m3(uint8_t *p, size_t n, uint64_t seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    const uint64_t x = splitmix(i ^ (seed << 40));
    p[i] = (uint8_t)(((x >> 8) & 0x80u) | ((1u + (uint32_t)((x >> 16) % 9u)) << 3) | (x & 7u));
  }
}

/* The ceiling: every thread streams 16-byte loads, 4 in flight. */
/* Empty kernels: what a launch costs by itself, regular or cooperative, and
 * a cooperative launch with one grid barrier (launch_costs). */
__global__ void empty_kernel(unsigned *sink) {
  if (sink == nullptr) __trap();
}
__global__ void barrier_kernel(unsigned *sink) {
  cooperative_groups::this_grid().sync();
  if (sink == nullptr) __trap();
}

__global__ void read_all(const uint4 *__restrict__ p, size_t n, unsigned *sink) {
  unsigned acc = 0;
  const size_t stride = (size_t)gridDim.x * blockDim.x;
  size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
  for (; i + 3 * stride < n; i += 4 * stride) {
    const uint4 a = __ldg(p + i), b = __ldg(p + i + stride), c = __ldg(p + i + 2 * stride),
                d = __ldg(p + i + 3 * stride);
    acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^
           d.z ^ d.w;
  }
  for (; i < n; i += stride) {
    const uint4 a = __ldg(p + i);
    acc ^= a.x ^ a.y ^ a.z ^ a.w;
  }
  if (acc == 0x9E3779B9u) sink[0] = acc; /* keeps the loads alive */
}

/* The same bytes read in the chunk kernel's order, to tell the cost of the
 * order from the cost of the arithmetic (loads only, no attention). Rows of
 * one context: [token][kv head][head_bytes]; K rows at base + ctx *
 * ctx_stride, V rows seg bytes after. Pieces of `piece` rows; 8 warps per
 * block, 16 K and 16 V 16-byte loads in flight per lane (kernel 3's group).
 *  by_head (kernel 3's mapping): block (context, kv head, span of 8
 *    pieces), warp w streams piece 8 span + w of that head;
 *  by_row: block (context, piece), warp w streams kv head w (w + 8, ...) of
 *    that piece, so a block's warps read whole rows together. */
template <int HB>
__global__ void __launch_bounds__(256) read_order(const char *__restrict__ base, uint64_t ctx_stride,
                                                  uint64_t seg, uint32_t tokens, uint32_t piece,
                                                  uint32_t kv_heads, uint32_t row_bytes,
                                                  int by_row, unsigned *sink) {
  constexpr int LPR = HB / 16, RPI = 32 / LPR, U = 16;
  const uint32_t pieces = (tokens + piece - 1) / piece, spans = (pieces + 7) / 8;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  uint32_t ctx, p, h0, hstep;
  if (by_row) {
    ctx = blockIdx.x / pieces;
    p = blockIdx.x % pieces;
    h0 = warp;
    hstep = 8;
  } else {
    ctx = blockIdx.x / (kv_heads * spans);
    const uint32_t r = blockIdx.x % (kv_heads * spans);
    h0 = r / spans;
    hstep = kv_heads;
    p = (r % spans) * 8 + warp;
    if (p >= pieces) return;
  }
  const uint32_t t0 = p * piece, t1 = min(t0 + piece, tokens);
  unsigned acc = 0;
  for (uint32_t h = h0; h < kv_heads; h += hstep) {
    const char *k = base + ctx * ctx_stride + (size_t)h * HB + (lane % LPR) * 16;
    for (uint32_t t = t0; t < t1; t += U * RPI) {
      uint4 kr[U], vr[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const uint32_t row = min(t + lane / LPR + RPI * u, t1 - 1);
        kr[u] = __ldg(reinterpret_cast<const uint4 *>(k + (size_t)row * row_bytes));
        vr[u] = __ldg(reinterpret_cast<const uint4 *>(k + seg + (size_t)row * row_bytes));
      }
#pragma unroll
      for (int u = 0; u < U; ++u) acc ^= kr[u].x ^ kr[u].y ^ kr[u].z ^ kr[u].w ^ vr[u].x ^ vr[u].y ^ vr[u].z ^ vr[u].w;
    }
  }
  if (acc == 0x9E3779B9u) sink[0] = acc; /* keeps the loads alive */
}

/* The same bytes with the kernel's occupancy and bytes in flight (the
 * blocks of read_order by_head, 8 warps each, 16 K and 16 V 16-byte loads
 * per lane at a time), but every warp streams a contiguous range of its
 * context's K and V: tells the cost of the rows' 128- or 256-byte
 * segments from that of the occupancy and the rounds. */
template <int U>
__global__ void __launch_bounds__(256) read_span(const char *__restrict__ base, uint64_t ctx_stride,
                                                 uint64_t seg, uint64_t ctx_bytes,
                                                 uint32_t blocks_per_ctx, unsigned *sink) {
  const uint32_t ctx = blockIdx.x / blocks_per_ctx, b = blockIdx.x % blocks_per_ctx;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const uint64_t n = ctx_bytes / 16, wn = blocks_per_ctx * 8ull;
  const uint64_t per = (n + wn - 1) / wn, w = (uint64_t)b * 8 + warp;
  const uint64_t i0 = w * per, i1 = min(i0 + per, n);
  const uint4 *k = reinterpret_cast<const uint4 *>(base + ctx * ctx_stride);
  const uint4 *v = reinterpret_cast<const uint4 *>(base + ctx * ctx_stride + seg);
  unsigned acc = 0;
  for (uint64_t i = i0; i < i1; i += 32 * U) {
    uint4 kr[U], vr[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const uint64_t e = min(i + lane + 32 * u, i1 - 1);
      kr[u] = __ldg(k + e);
      vr[u] = __ldg(v + e);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) acc ^= kr[u].x ^ kr[u].y ^ kr[u].z ^ kr[u].w ^ vr[u].x ^ vr[u].y ^ vr[u].z ^ vr[u].w;
  }
  if (acc == 0x9E3779B9u) sink[0] = acc; /* keeps the loads alive */
}

/* Tiles of U x 4 KiB read by blocks of 256 threads, the next tile's loads
 * issued before the current one is consumed; tile t is handed to block
 * t % gridDim.x in turn (DYN false), or to whichever block asks next
 * through a ticket counter (DYN true): tells what a static split of the
 * bytes over the SMs costs against one that follows each SM's pace. The
 * counter is never reset: launch j's tickets start at `base` (each block
 * draws until it gets a ticket past the last tile, so a launch consumes
 * exactly tiles + gridDim.x of them). Dynamic shared memory keeps one block
 * per SM, as the chunk kernel's registers do. */
template <int U, bool DYN>
__global__ void __launch_bounds__(256) read_tiles(const uint4 *__restrict__ p, size_t n16,
                                                  uint32_t tiles, unsigned *ticket, unsigned base,
                                                  unsigned *sink) {
  __shared__ unsigned s_t[2];
  const uint32_t tid = threadIdx.x;
  uint32_t k = 0;
  auto grab = [&]() -> uint32_t {
    return DYN ? atomicAdd(ticket, 1u) - base : blockIdx.x + (k++) * gridDim.x;
  };
  auto load = [&](uint4 *v, uint32_t t) {
    const size_t b = (size_t)t * U * 256u;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const size_t e = min(b + (size_t)u * 256u + tid, n16 - 1);
      v[u] = __ldg(p + e);
    }
  };
  if (tid == 0) s_t[0] = grab();
  if (!DYN) k = 1;
  __syncthreads();
  uint32_t cur = s_t[0];
  uint4 v[U];
  if (cur < tiles) load(v, cur);
  int slot = 1;
  unsigned acc = 0;
  while (cur < tiles) {
    if (tid == 0) s_t[slot] = grab();
    __syncthreads();
    const uint32_t nxt = s_t[slot];
    slot ^= 1;
    uint4 w[U];
    if (nxt < tiles) load(w, nxt);
#pragma unroll
    for (int u = 0; u < U; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
#pragma unroll
    for (int u = 0; u < U; ++u) v[u] = w[u];
    cur = nxt;
  }
  if (acc == 0x9E3779B9u) sink[0] = acc; /* keeps the loads alive */
}

#ifndef AKV_ATTN_BENCH_TRACE
#define AKV_ATTN_BENCH_TRACE 0
#endif
#if AKV_ATTN_BENCH_TRACE
/* Diagnostic builds: kernel 3's per-warp timer points (attention_cuda.cu). */
extern "C" int akv_attn_bench_trace_clear(void);
extern "C" int akv_attn_bench_trace_read(unsigned long long *dst, size_t count, int *points,
                                         size_t *warps);
extern "C" int akv_attn_bench_trace_sm_read(unsigned int *dst, size_t count);
static const int kTracePts = 24; /* the points named in print_trace */

/* One launch's timeline from the warps' own timer points: each point's
 * spread over warps (from the first warp's entry), and the medians of the
 * steps between points. */
static void print_trace(const char *what) {
  int points = 0;
  size_t nwarps = 0;
  akv_attn_bench_trace_read(nullptr, 0, &points, &nwarps); /* its shape */
  std::vector<unsigned long long> t(nwarps * kTracePts);
  if (points != kTracePts || akv_attn_bench_trace_read(t.data(), t.size(), nullptr, nullptr) != 0) {
    printf("trace %s: unreadable (%d points per warp, %d named here)\n", what, points, kTracePts);
    return;
  }
  unsigned long long t0 = ~0ull;
  size_t warps = 0;
  for (size_t w = 0; w < nwarps; ++w)
    if (t[w * kTracePts] != 0) {
      t0 = std::min(t0, t[w * kTracePts]);
      ++warps;
    }
  if (warps == 0) return;
  /* AKV_TRACE_RAW=DIR: every warp's points (ns from the first entry, -1 where
   * not recorded) and its SM, one line each, in DIR/trace-<what>.txt. */
  if (const char *dir = getenv("AKV_TRACE_RAW")) {
    std::vector<unsigned int> sm(nwarps);
    std::string path = std::string(dir) + "/trace-" + what + ".txt";
    for (char &ch : path)
      if (ch == ' ') ch = '_';
    FILE *f = akv_attn_bench_trace_sm_read(sm.data(), nwarps) == 0 ? fopen(path.c_str(), "w")
                                                                  : nullptr;
    if (f != nullptr) {
      fprintf(f, "# warp sm then %d points, ns from the first entry (-1: none)\n", kTracePts);
      for (size_t w = 0; w < nwarps; ++w) {
        if (t[w * kTracePts] == 0) continue;
        fprintf(f, "%zu %u", w, sm[w]);
        for (int p = 0; p < kTracePts; ++p) {
          const unsigned long long v = t[w * kTracePts + p];
          fprintf(f, " %lld", v == 0 ? -1ll : (long long)(v - t0));
        }
        fprintf(f, "\n");
      }
      fclose(f);
    }
  }
  static const char *names[kTracePts] = {"entry",   "query",   "S0", "V0", "S1", "V1", "S2",
                                         "V2",      "S3",      "V3", "S4", "V4", "S5", "V5",
                                         "S6",      "V6",      "S7", "V7", "loop end",
                                         "written", "synced",  "folded", "merge1", "merge2"};
  printf("trace %s: %zu warps; microseconds from the first entry: point min / median / max "
         "(warps)\n", what, warps);
  for (int p = 0; p < kTracePts; ++p) {
    std::vector<double> v;
    for (size_t w = 0; w < nwarps; ++w)
      if (t[w * kTracePts] != 0 && t[w * kTracePts + p] != 0)
        v.push_back((double)(t[w * kTracePts + p] - t0) / 1e3);
    if (v.empty()) continue;
    std::sort(v.begin(), v.end());
    printf("trace %s   %-8s %7.2f %7.2f %7.2f (%zu)\n", what, names[p], v.front(),
           v[v.size() / 2], v.back(), v.size());
  }
  /* Medians of each step of a warp: from the previous recorded point. */
  printf("trace %s steps (median over warps, us):", what);
  for (int p = 1; p < kTracePts; ++p) {
    std::vector<double> v;
    for (size_t w = 0; w < nwarps; ++w) {
      const unsigned long long *r = &t[w * kTracePts];
      if (r[0] == 0 || r[p] == 0) continue;
      int q = p - 1;
      while (q > 0 && r[q] == 0) --q;
      v.push_back((double)(r[p] - r[q]) / 1e3);
    }
    if (v.empty()) continue;
    std::sort(v.begin(), v.end());
    printf(" %s %.2f", names[p], v[v.size() / 2]);
  }
  printf("\n");
}
#endif

struct Options {
  uint32_t tokens = 31744;
  uint32_t chunk = 256;
  std::vector<uint32_t> contexts{1, 4};
  std::vector<akv_dtype> dtypes{AKV_DTYPE_BF16, AKV_DTYPE_FP8_E4M3};
  int iters = 200;
  int warmup = 20;
  const char *json = nullptr;
  const char *label = "default";
  bool check = true;
};

static void usage(void) {
  fprintf(stderr,
          "usage: attention_bw [--tokens N] [--chunk N] [--contexts 1,4] [--dtype bf16,fp8] "
          "[--iters N] [--warmup N] [--json FILE] [--label TEXT] [--no-check]\n");
  exit(2);
}

static Options parse(int argc, char **argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const char *a = argv[i];
    const bool has = i + 1 < argc;
    if (!strcmp(a, "--tokens") && has) o.tokens = (uint32_t)atoi(argv[++i]);
    else if (!strcmp(a, "--chunk") && has) o.chunk = (uint32_t)atoi(argv[++i]);
    else if (!strcmp(a, "--iters") && has) o.iters = atoi(argv[++i]);
    else if (!strcmp(a, "--warmup") && has) o.warmup = atoi(argv[++i]);
    else if (!strcmp(a, "--json") && has) o.json = argv[++i];
    else if (!strcmp(a, "--label") && has) o.label = argv[++i];
    else if (!strcmp(a, "--no-check")) o.check = false;
    else if (!strcmp(a, "--dtype") && has) {
      o.dtypes.clear();
      for (char *tok = strtok(argv[++i], ","); tok; tok = strtok(nullptr, ",")) {
        if (!strcmp(tok, "bf16")) o.dtypes.push_back(AKV_DTYPE_BF16);
        else if (!strcmp(tok, "fp8")) o.dtypes.push_back(AKV_DTYPE_FP8_E4M3);
        else usage();
      }
    } else if (!strcmp(a, "--contexts") && has) {
      o.contexts.clear();
      for (char *tok = strtok(argv[++i], ","); tok; tok = strtok(nullptr, ","))
        o.contexts.push_back((uint32_t)atoi(tok));
    } else {
      usage();
    }
  }
  if (o.tokens == 0 || o.chunk == 0 || o.iters < 1 || o.warmup < 0 || o.contexts.empty() ||
      o.dtypes.empty())
    usage();
  return o;
}

struct Stats {
  double median_us, p10_us, p90_us;
};

/* Times launch(set) `iters` times, each between its own pair of events. */
template <class F>
static Stats time_launches(cudaStream_t s, int sets, int warmup, int iters, F launch) {
  for (int i = 0; i < warmup; ++i) launch(i % sets);
  CK(cudaStreamSynchronize(s));
  std::vector<cudaEvent_t> ev(2 * (size_t)iters);
  for (auto &e : ev) CK(cudaEventCreate(&e));
  for (int i = 0; i < iters; ++i) {
    CK(cudaEventRecord(ev[2 * i], s));
    launch((warmup + i) % sets);
    CK(cudaEventRecord(ev[2 * i + 1], s));
  }
  CK(cudaStreamSynchronize(s));
  std::vector<double> us((size_t)iters);
  for (int i = 0; i < iters; ++i) {
    float ms = 0.0f;
    CK(cudaEventElapsedTime(&ms, ev[2 * i], ev[2 * i + 1]));
    us[i] = ms * 1000.0;
  }
  for (auto &e : ev) CK(cudaEventDestroy(e));
  std::sort(us.begin(), us.end());
  Stats st;
  st.median_us = us[us.size() / 2];
  st.p10_us = us[us.size() / 10];
  st.p90_us = us[(us.size() * 9) / 10];
  return st;
}

/* Times `calls` launches issued back to back (launch(i % sets), as a decode
 * step issues one attention call per layer) between one pair of events, `reps`
 * times; returns the median time per call. The launches after the first are
 * queued behind the kernels before them, so what the isolated timing above
 * pays for an idle stream (the first launch's latency, the last kernel's
 * drain before its event) is paid once per `calls`. */
template <class F>
static double time_back_to_back(cudaStream_t s, int sets, int warmup, int reps, int calls,
                                F launch) {
  for (int i = 0; i < warmup; ++i) launch(i % sets);
  CK(cudaStreamSynchronize(s));
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  std::vector<double> us((size_t)reps);
  for (int r = 0; r < reps; ++r) {
    CK(cudaEventRecord(a, s));
    for (int i = 0; i < calls; ++i) launch(i % sets);
    CK(cudaEventRecord(b, s));
    CK(cudaEventSynchronize(b));
    float ms = 0.0f;
    CK(cudaEventElapsedTime(&ms, a, b));
    us[(size_t)r] = ms * 1000.0 / calls;
  }
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
  std::sort(us.begin(), us.end());
  return us[us.size() / 2];
}

struct Set {
  char *kv;        /* contiguous: [ctx][K rows | V rows] */
  char *kpool;     /* paged: pages of K, shuffled */
  char *vpool;
  uint32_t *indptr, *indices, *last; /* device page table */
  uint16_t *q;
};

int main(int argc, char **argv) {
  const Options o = parse(argc, argv);
  int dev = 0;
  cudaDeviceProp prop;
  CK(cudaGetDevice(&dev));
  CK(cudaGetDeviceProperties(&prop, dev));
  const uint32_t n_heads = 32, kv_heads = 8, head_dim = 128;
  /* Per-head scales of the FP8 runs (host arrays, read at each launch). */
  float k_scale[8], v_scale[8];
  for (uint32_t h = 0; h < kv_heads; ++h) {
    k_scale[h] = 0.125f * (1.0f + 0.0625f * (float)h);
    v_scale[h] = 0.125f * (1.0f + 0.0625f * (float)((h * 3u) % 8u));
  }
  FILE *jf = o.json ? fopen(o.json, "a") : nullptr;
  if (o.json && !jf) {
    perror(o.json);
    return 1;
  }
  printf("device %s, %d SMs, L2 %d MiB; kernel knobs kernel=%d warps=%d loads=%d stages=%d "
         "pdl=%d piece_tokens=%d minb=%d combine_warps=%d k3_span=%d; label %s\n",
         prop.name, prop.multiProcessorCount, prop.l2CacheSize >> 20, AKV_ATTN_KERNEL,
         AKV_ATTN_WARPS, AKV_ATTN_LOADS, AKV_ATTN_STAGES, AKV_ATTN_PDL, AKV_ATTN_PIECE_TOKENS,
         AKV_ATTN_MINB, AKV_ATTN_COMBINE_WARPS, AKV_ATTN_K3_SPAN, o.label);
  printf("%-7s %-5s %4s %7s %5s %12s %10s %10s %10s %9s %8s %9s %8s\n", "variant", "dtype",
         "ctx", "tokens", "chunk", "bytes", "median_us", "p10_us", "p90_us", "GB/s", "ratio",
         "read_GB/s", "vs_read");

  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  unsigned *sink;
  CK(cudaMalloc(&sink, sizeof(unsigned)));
  bool all_ok = true;

  /* What a launch of the attention's one-context grid costs with nothing to
   * do: regular, cooperative, cooperative with one grid barrier (the fused
   * kernel's shape: 128 blocks of 256 threads). */
  {
    const dim3 grid(128), block(256);
    auto coop = [&](void (*fn)(unsigned *)) {
      cudaLaunchConfig_t cfg = {};
      cudaLaunchAttribute at[1];
      at[0].id = cudaLaunchAttributeCooperative;
      at[0].val.cooperative = 1;
      cfg.gridDim = grid;
      cfg.blockDim = block;
      cfg.stream = s;
      cfg.attrs = at;
      cfg.numAttrs = 1;
      CK(cudaLaunchKernelEx(&cfg, fn, sink));
    };
    const Stats e0 = time_launches(s, 1, o.warmup, o.iters,
                                   [&](int) { empty_kernel<<<grid, block, 0, s>>>(sink); });
    const Stats e1 = time_launches(s, 1, o.warmup, o.iters, [&](int) { coop(empty_kernel); });
    const Stats e2 = time_launches(s, 1, o.warmup, o.iters, [&](int) { coop(barrier_kernel); });
    printf("launch empty kernel, 128 blocks: regular %.2f us, cooperative %.2f us, cooperative "
           "with one grid barrier %.2f us (medians, each between its own events)\n",
           e0.median_us, e1.median_us, e2.median_us);
  }

  for (akv_dtype dt : o.dtypes)
  for (uint32_t n_ctx : o.contexts) {
    const bool fp8 = dt != AKV_DTYPE_BF16;
    const char *dt_name = fp8 ? "fp8" : "bf16";
    const uint64_t row_bytes = (uint64_t)kv_heads * head_dim * (fp8 ? 1u : 2u);
    const uint64_t seg = (uint64_t)o.tokens * row_bytes; /* one context's K (or V) */
    const uint64_t ctx_stride = 2 * seg;
    const uint64_t kv_bytes = n_ctx * ctx_stride;
    const uint32_t pages_per_ctx = (o.tokens + o.chunk - 1) / o.chunk;
    const uint32_t total_pages = pages_per_ctx * n_ctx;
    const uint64_t page_stride = (uint64_t)o.chunk * row_bytes;
    const uint64_t pool_bytes = (uint64_t)total_pages * page_stride;
    /* Enough sets that the bytes cycled through are >= 3x the L2 (and >= 2). */
    int sets = (int)((3ull * prop.l2CacheSize + kv_bytes - 1) / kv_bytes);
    sets = std::max(2, std::min(sets, 8));

    std::vector<Set> set((size_t)sets);
    const uint32_t last_rows = o.tokens - (pages_per_ctx - 1) * o.chunk;
    std::vector<uint32_t> h_indptr(n_ctx + 1), h_last(n_ctx, last_rows);
    for (uint32_t i = 0; i <= n_ctx; ++i) h_indptr[i] = i * pages_per_ctx;
    std::vector<uint32_t> h_indices(total_pages);
    std::vector<uint32_t> perm(total_pages);
    uint64_t rng = 0x1234567ull + n_ctx;
    for (int si = 0; si < sets; ++si) {
      Set &x = set[si];
      CK(cudaMalloc(&x.kv, kv_bytes));
      CK(cudaMalloc(&x.kpool, pool_bytes));
      CK(cudaMalloc(&x.vpool, pool_bytes));
      CK(cudaMalloc(&x.q, (size_t)n_ctx * n_heads * head_dim * 2));
      CK(cudaMalloc(&x.indptr, h_indptr.size() * 4));
      CK(cudaMalloc(&x.indices, h_indices.size() * 4));
      CK(cudaMalloc(&x.last, h_last.size() * 4));
      if (fp8)
        fill_e4m3<<<1024, 256, 0, s>>>((uint8_t *)x.kv, kv_bytes, 17 + si);
      else
        fill_bf16<<<1024, 256, 0, s>>>((uint16_t *)x.kv, kv_bytes / 2, 17 + si);
      fill_bf16<<<64, 256, 0, s>>>(x.q, (size_t)n_ctx * n_heads * head_dim, 1000 + si);
      CK(cudaGetLastError());
      /* The paged pool holds the same rows as kv, pages in a shuffled order. */
      for (uint32_t p = 0; p < total_pages; ++p) perm[p] = p;
      for (uint32_t p = total_pages - 1; p > 0; --p) {
        rng = rng * 6364136223846793005ull + 1442695040888963407ull;
        const uint32_t j = (uint32_t)((rng >> 33) % (p + 1));
        std::swap(perm[p], perm[j]);
      }
      for (uint32_t i = 0; i < n_ctx; ++i)
        for (uint32_t c = 0; c < pages_per_ctx; ++c) {
          const uint32_t phys = perm[i * pages_per_ctx + c];
          h_indices[i * pages_per_ctx + c] = phys;
          const uint32_t rows = c + 1 == pages_per_ctx ? h_last[i] : o.chunk;
          const char *src = x.kv + i * ctx_stride + (uint64_t)c * o.chunk * row_bytes;
          CK(cudaMemcpyAsync(x.kpool + phys * page_stride, src, rows * row_bytes,
                             cudaMemcpyDeviceToDevice, s));
          CK(cudaMemcpyAsync(x.vpool + phys * page_stride, src + seg, rows * row_bytes,
                             cudaMemcpyDeviceToDevice, s));
        }
      const cudaMemcpyKind h2d = cudaMemcpyHostToDevice;
      CK(cudaMemcpyAsync(x.indptr, h_indptr.data(), h_indptr.size() * 4, h2d, s));
      CK(cudaMemcpyAsync(x.indices, h_indices.data(), h_indices.size() * 4, h2d, s));
      CK(cudaMemcpyAsync(x.last, h_last.data(), h_last.size() * 4, h2d, s));
      CK(cudaStreamSynchronize(s)); /* the host vectors are reused for the next set */
    }

    std::vector<uint32_t> len(n_ctx, o.tokens);
    size_t ws_bytes = 0;
    AK(akv_attention_workspace_bytes(n_ctx, n_heads, head_dim, o.tokens, o.chunk, &ws_bytes));
    void *ws;
    float *out, *out_paged;
    const size_t out_elems = (size_t)n_ctx * n_heads * head_dim;
    CK(cudaMalloc(&ws, ws_bytes));
    CK(cudaMalloc(&out, out_elems * sizeof(float)));
    CK(cudaMalloc(&out_paged, out_elems * sizeof(float)));

    auto contig_args = [&](int si, float *dst) {
      akv_attention_args a;
      memset(&a, 0, sizeof a);
      a.dtype = dt;
      if (fp8) {
        a.k_scale = k_scale;
        a.v_scale = v_scale;
      }
      a.n_contexts = n_ctx;
      a.n_heads = n_heads;
      a.kv_heads = kv_heads;
      a.head_dim = head_dim;
      a.chunk_tokens = o.chunk;
      a.scale = 1.0f / sqrtf((float)head_dim);
      a.q = set[si].q;
      a.k_base = set[si].kv;
      a.v_base = set[si].kv + seg;
      a.context_stride = ctx_stride;
      a.row_bytes = row_bytes;
      a.len = len.data();
      a.out = dst;
      a.workspace = ws;
      a.workspace_bytes = ws_bytes;
      return a;
    };
    auto paged_call = [&](int si, float *dst) {
      akv_attention_paged_args a;
      memset(&a, 0, sizeof a);
      a.dtype = dt;
      if (fp8) {
        a.k_scale = k_scale;
        a.v_scale = v_scale;
      }
      a.n_heads = n_heads;
      a.kv_heads = kv_heads;
      a.head_dim = head_dim;
      a.scale = 1.0f / sqrtf((float)head_dim);
      a.q = set[si].q;
      a.out = dst;
      a.workspace = ws;
      a.workspace_bytes = ws_bytes;
      akv_page_table t;
      memset(&t, 0, sizeof t);
      t.batch = n_ctx;
      t.page_tokens = o.chunk;
      t.max_pages = pages_per_ctx;
      t.indptr = set[si].indptr;
      t.indices = set[si].indices;
      t.last_page_len = set[si].last;
      t.k_pages = set[si].kpool;
      t.v_pages = set[si].vpool;
      t.page_stride = page_stride;
      t.row_bytes = row_bytes;
      AK(akv_attention_paged_cuda(&a, t, s));
    };

    /* Correctness once: paged == contiguous bits; CUDA vs C reference. */
    const char *check = "skipped";
    if (o.check) {
      CK(cudaMemsetAsync(out, 0xFF, out_elems * 4, s));
      CK(cudaMemsetAsync(out_paged, 0xFF, out_elems * 4, s));
      const akv_attention_args a = contig_args(0, out);
      AK(akv_attention_decode_cuda(&a, s));
      paged_call(0, out_paged);
      CK(cudaStreamSynchronize(s));
      std::vector<float> g(out_elems), gp(out_elems), ref(out_elems);
      CK(cudaMemcpy(g.data(), out, out_elems * 4, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(gp.data(), out_paged, out_elems * 4, cudaMemcpyDeviceToHost));
      const bool same = memcmp(g.data(), gp.data(), out_elems * 4) == 0;
      /* The reference over the first context only (a second of CPU time). */
      std::vector<char> hkv(ctx_stride);
      std::vector<uint16_t> hq((size_t)n_heads * head_dim);
      CK(cudaMemcpy(hkv.data(), set[0].kv, ctx_stride, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(hq.data(), set[0].q, hq.size() * 2, cudaMemcpyDeviceToHost));
      size_t rws = 0;
      AK(akv_attention_workspace_bytes(1, n_heads, head_dim, o.tokens, o.chunk, &rws));
      std::vector<char> rwsb(rws);
      akv_attention_args r = contig_args(0, ref.data());
      r.n_contexts = 1;
      r.q = hq.data();
      r.k_base = hkv.data();
      r.v_base = hkv.data() + seg;
      r.workspace = rwsb.data();
      r.workspace_bytes = rws;
      AK(akv_attention_ref_bf16(&r));
      double num = 0.0, den = 0.0;
      for (size_t e = 0; e < (size_t)n_heads * head_dim; ++e) {
        const double d = (double)g[e] - ref[e];
        num += d * d;
        den += (double)ref[e] * ref[e];
      }
      const double err = den > 0 ? sqrt(num / den) : INFINITY;
      const bool ok = same && err <= 1e-5 && !isnan(err);
      all_ok = all_ok && ok;
      /* FNV-1a of the contiguous output's bytes: two builds (kernel
       * variants) of one device call compare their outputs bit for bit. */
      uint64_t digest = 1469598103934665603ull;
      for (size_t e = 0; e < out_elems * 4; ++e) {
        digest ^= reinterpret_cast<const unsigned char *>(g.data())[e];
        digest *= 1099511628211ull;
      }
      static char buf[160];
      snprintf(buf, sizeof buf, "%s (paged==contig %s, rel L2 vs ref %.2e, out %016llx)",
               ok ? "ok" : "FAILED", same ? "yes" : "NO", err, (unsigned long long)digest);
      check = buf;
    }

    /* The ceiling in this run: stream the same bytes with a plain kernel. */
    const size_t n16 = kv_bytes / 16;
    const Stats rd = time_launches(s, sets, o.warmup, o.iters, [&](int si) {
      read_all<<<prop.multiProcessorCount * 8, 256, 0, s>>>((const uint4 *)set[si].kv, n16, sink);
    });
    CK(cudaGetLastError());
    const double read_gbps = (double)kv_bytes / (rd.median_us * 1e3);
    /* The same bytes in the chunk kernel's order (by kv head) and by rows. */
    const uint32_t pieces = (o.tokens + kPieceTokens - 1) / kPieceTokens;
    double order_gbps[2];
    for (int by_row = 0; by_row < 2; ++by_row) {
      const uint32_t blocks = n_ctx * (by_row ? pieces : kv_heads * ((pieces + 7) / 8));
      const Stats st = time_launches(s, sets, o.warmup, o.iters, [&](int si) {
        if (fp8)
          read_order<128><<<blocks, 256, 0, s>>>(set[si].kv, ctx_stride, seg, o.tokens,
                                                 kPieceTokens, kv_heads, (uint32_t)row_bytes,
                                                 by_row, sink);
        else
          read_order<256><<<blocks, 256, 0, s>>>(set[si].kv, ctx_stride, seg, o.tokens,
                                                 kPieceTokens, kv_heads, (uint32_t)row_bytes,
                                                 by_row, sink);
      });
      CK(cudaGetLastError());
      order_gbps[by_row] = (double)kv_bytes / (st.median_us * 1e3);
    }
    /* The same bytes with the kernel's blocks and occupancy: contiguous
     * spans with 16 or 8 K and V loads per lane at a time, and the plain
     * read's loop on the kernel's block count. */
    double span_gbps[3];
    {
      const uint32_t bpc = kv_heads * ((pieces + 7) / 8);
      const uint64_t ctx_bytes = (uint64_t)o.tokens * row_bytes;
      for (int u = 0; u < 3; ++u) {
        const Stats st = time_launches(s, sets, o.warmup, o.iters, [&](int si) {
          if (u == 0)
            read_span<16><<<n_ctx * bpc, 256, 0, s>>>(set[si].kv, ctx_stride, seg, ctx_bytes, bpc, sink);
          else if (u == 1)
            read_span<8><<<n_ctx * bpc, 256, 0, s>>>(set[si].kv, ctx_stride, seg, ctx_bytes, bpc, sink);
          else
            read_all<<<n_ctx * bpc, 256, 0, s>>>((const uint4 *)set[si].kv, n16, sink);
        });
        CK(cudaGetLastError());
        span_gbps[u] = (double)kv_bytes / (st.median_us * 1e3);
      }
    }
    /* Static against dynamic tiles on one block per SM (read_tiles). */
    double tiles_gbps[2][3][2];
    {
      unsigned *ticket;
      CK(cudaMalloc(&ticket, sizeof(unsigned)));
      CK(cudaMemset(ticket, 0, sizeof(unsigned)));
      unsigned next_base = 0;
      const size_t one_per_sm = 120u * 1024u;
      printf("tiles  %-5s %4u:", dt_name, n_ctx);
      auto run_tiles = [&](auto kern, int u, bool dyn, int grid) -> double {
        CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)one_per_sm));
        const uint32_t tiles = (uint32_t)((n16 + (size_t)u * 256u - 1) / ((size_t)u * 256u));
        const Stats st = time_launches(s, sets, o.warmup, o.iters, [&](int si) {
          kern<<<grid, 256, one_per_sm, s>>>((const uint4 *)set[si].kv, n16, tiles, ticket,
                                              next_base, sink);
          if (dyn) next_base += tiles + (unsigned)grid; /* only dynamic launches draw */
        });
        CK(cudaGetLastError());
        const double g = (double)kv_bytes / (st.median_us * 1e3);
        printf(" %s U%d grid %d %.2f us (%.1f%%);", dyn ? "dyn" : "static", u, grid, st.median_us,
               100.0 * g / kCeilingGBps);
        return g;
      };
      /* [grid 128, all SMs][U 4, 8, 16][static, dynamic] */
      const int sms = prop.multiProcessorCount;
      for (int gi = 0; gi < 2; ++gi) {
        const int grid = gi ? sms : 128;
        tiles_gbps[gi][0][0] = run_tiles(read_tiles<4, false>, 4, false, grid);
        tiles_gbps[gi][0][1] = run_tiles(read_tiles<4, true>, 4, true, grid);
        tiles_gbps[gi][1][0] = run_tiles(read_tiles<8, false>, 8, false, grid);
        tiles_gbps[gi][1][1] = run_tiles(read_tiles<8, true>, 8, true, grid);
        tiles_gbps[gi][2][0] = run_tiles(read_tiles<16, false>, 16, false, grid);
        tiles_gbps[gi][2][1] = run_tiles(read_tiles<16, true>, 16, true, grid);
      }
      printf("\n");
      CK(cudaFree(ticket));
    }
    printf("read   %-5s %4u: plain %.0f GB/s (%.1f%%), kernel order by kv head %.0f GB/s (%.1f%%), "
           "by row %.0f GB/s (%.1f%%)\n",
           dt_name, n_ctx, read_gbps, 100.0 * read_gbps / kCeilingGBps, order_gbps[0],
           100.0 * order_gbps[0] / kCeilingGBps, order_gbps[1], 100.0 * order_gbps[1] / kCeilingGBps);
    printf("read   %-5s %4u: on the kernel's blocks: contiguous spans, 16 loads %.0f GB/s (%.1f%%), "
           "8 loads %.0f GB/s (%.1f%%); plain loop %.0f GB/s (%.1f%%)\n",
           dt_name, n_ctx, span_gbps[0], 100.0 * span_gbps[0] / kCeilingGBps, span_gbps[1],
           100.0 * span_gbps[1] / kCeilingGBps, span_gbps[2], 100.0 * span_gbps[2] / kCeilingGBps);

    const Stats sc = time_launches(s, sets, o.warmup, o.iters, [&](int si) {
      const akv_attention_args a = contig_args(si, out);
      AK(akv_attention_decode_cuda(&a, s));
    });
    const Stats sp = time_launches(s, sets, o.warmup, o.iters,
                                   [&](int si) { paged_call(si, out_paged); });
    CK(cudaGetLastError());
    /* Back to back: 32 calls (a decode step's layers of llama3-8b) between
     * one pair of events, the contiguous and paged calls and the plain read. */
    constexpr int kB2bCalls = 32, kB2bReps = 25;
    const double b2b_contig = time_back_to_back(s, sets, o.warmup, kB2bReps, kB2bCalls, [&](int si) {
      const akv_attention_args a = contig_args(si, out);
      AK(akv_attention_decode_cuda(&a, s));
    });
    const double b2b_paged = time_back_to_back(s, sets, o.warmup, kB2bReps, kB2bCalls,
                                               [&](int si) { paged_call(si, out_paged); });
    const double b2b_read = time_back_to_back(s, sets, o.warmup, kB2bReps, kB2bCalls, [&](int si) {
      read_all<<<prop.multiProcessorCount * 8, 256, 0, s>>>((const uint4 *)set[si].kv, n16, sink);
    });
    CK(cudaGetLastError());
    const double b2b_read_gbps = (double)kv_bytes / (b2b_read * 1e3);
    printf("b2b    %-5s %4u: %d calls back to back, per call: contiguous %.2f us (%.1f%%), "
           "paged %.2f us (%.1f%%); plain read %.2f us (%.1f%%)\n",
           dt_name, n_ctx, kB2bCalls, b2b_contig,
           100.0 * (double)kv_bytes / (b2b_contig * 1e3) / kCeilingGBps, b2b_paged,
           100.0 * (double)kv_bytes / (b2b_paged * 1e3) / kCeilingGBps, b2b_read,
           100.0 * b2b_read_gbps / kCeilingGBps);

#if AKV_ATTN_BENCH_TRACE
    {
      akv_attn_bench_trace_clear();
      const akv_attention_args a = contig_args(0, out);
      AK(akv_attention_decode_cuda(&a, s));
      CK(cudaStreamSynchronize(s));
      char what[64];
      snprintf(what, sizeof what, "%s %u ctx", dt_name, n_ctx);
      print_trace(what);
    }
#endif
    const struct {
      const char *name;
      Stats st;
      double b2b_us;
    } rows[2] = {{"contig", sc, b2b_contig}, {"paged", sp, b2b_paged}};
    for (const auto &r : rows) {
      const double gbps = (double)kv_bytes / (r.st.median_us * 1e3);
      const double ratio = gbps / kCeilingGBps;
      printf("%-7s %-5s %4u %7u %5u %12llu %10.1f %10.1f %10.1f %9.0f %7.1f%% %9.0f %7.1f%%\n",
             r.name, dt_name, n_ctx, o.tokens, o.chunk, (unsigned long long)kv_bytes,
             r.st.median_us, r.st.p10_us, r.st.p90_us, gbps, 100.0 * ratio, read_gbps,
             100.0 * gbps / read_gbps);
      char line[3072];
      snprintf(line, sizeof line,
               "{\"bench\":\"attention_bw\",\"label\":\"%s\",\"variant\":\"%s\",\"dtype\":\"%s\","
               "\"device\":\"%s\","
               "\"contexts\":%u,\"tokens\":%u,\"chunk\":%u,\"n_heads\":%u,\"kv_heads\":%u,"
               "\"head_dim\":%u,\"warps\":%d,\"loads\":%d,\"stages\":%d,\"pdl\":%d,"
               "\"piece_tokens\":%d,\"kernel\":%d,\"minb\":%d,\"combine_warps\":%d,"
               "\"k3_fp8_f16\":%d,\"k3_span\":%d,\"bytes\":%llu,"
               "\"sets\":%d,"
               "\"iters\":%d,\"median_us\":%.2f,\"p10_us\":%.2f,\"p90_us\":%.2f,\"gbps\":%.1f,"
               "\"ceiling_gbps\":%.0f,\"ratio\":%.4f,\"read_gbps\":%.1f,\"ratio_vs_read\":%.4f,"
               "\"read_by_head_gbps\":%.1f,\"read_by_row_gbps\":%.1f,\"read_span16_gbps\":%.1f,"
               "\"read_span8_gbps\":%.1f,\"read_plain_kernel_blocks_gbps\":%.1f,"
               "\"read_tiles_gbps\":{\"grid128\":{\"u4\":[%.1f,%.1f],\"u8\":[%.1f,%.1f],"
               "\"u16\":[%.1f,%.1f]},\"grid_sms\":{\"u4\":[%.1f,%.1f],\"u8\":[%.1f,%.1f],"
               "\"u16\":[%.1f,%.1f]}},"
               "\"b2b_calls\":%d,\"b2b_us\":%.2f,\"b2b_ratio\":%.4f,\"b2b_read_gbps\":%.1f,"
               "\"meets_60pct\":%s,\"check\":\"%s\"}",
               o.label, r.name, dt_name, prop.name, n_ctx, o.tokens, o.chunk, n_heads, kv_heads,
               head_dim, AKV_ATTN_WARPS, AKV_ATTN_LOADS, AKV_ATTN_STAGES, AKV_ATTN_PDL,
               AKV_ATTN_PIECE_TOKENS, AKV_ATTN_KERNEL, AKV_ATTN_MINB, AKV_ATTN_COMBINE_WARPS,
               AKV_ATTN_K3_FP8_F16, AKV_ATTN_K3_SPAN, (unsigned long long)kv_bytes, sets, o.iters,
               r.st.median_us, r.st.p10_us, r.st.p90_us, gbps, kCeilingGBps, ratio, read_gbps,
               gbps / read_gbps, order_gbps[0], order_gbps[1], span_gbps[0], span_gbps[1], span_gbps[2], tiles_gbps[0][0][0],
               tiles_gbps[0][0][1], tiles_gbps[0][1][0], tiles_gbps[0][1][1], tiles_gbps[0][2][0],
               tiles_gbps[0][2][1], tiles_gbps[1][0][0], tiles_gbps[1][0][1], tiles_gbps[1][1][0],
               tiles_gbps[1][1][1], tiles_gbps[1][2][0], tiles_gbps[1][2][1], kB2bCalls, r.b2b_us,
               (double)kv_bytes / (r.b2b_us * 1e3) / kCeilingGBps, b2b_read_gbps,
               ratio >= 0.6 ? "true" : "false",
               check);
      printf("JSON %s\n", line);
      if (jf) fprintf(jf, "%s\n", line);
    }
    printf("check %s %u ctx: %s\n", dt_name, n_ctx, check);

    for (auto &x : set) {
      CK(cudaFree(x.kv));
      CK(cudaFree(x.kpool));
      CK(cudaFree(x.vpool));
      CK(cudaFree(x.q));
      CK(cudaFree(x.indptr));
      CK(cudaFree(x.indices));
      CK(cudaFree(x.last));
    }
    CK(cudaFree(ws));
    CK(cudaFree(out));
    CK(cudaFree(out_paged));
  }
  CK(cudaFree(sink));
  CK(cudaStreamDestroy(s));
  if (jf) fclose(jf);
  return all_ok ? 0 : 1;
}
