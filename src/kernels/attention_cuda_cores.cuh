/*
 * attention_cuda_cores.cuh - chunk kernels 1 and 2 of attention_cuda.cu, the
 * CUDA-core kernels the library used before the tensor-core kernel 3. Built
 * for the benchmark's comparison variants (-DAKV_ATTN_KERNEL=1 or 2); the
 * measurements are in docs/benchmarks.md. Included once, inside
 * attention_cuda.cu's anonymous namespace, after the shared element, load
 * and locator definitions it uses; not a header of its own.
 */
#ifndef AKV_ATTENTION_CUDA_CORES_CUH
#define AKV_ATTENTION_CUDA_CORES_CUH

/* Kernel 1's geometry. */
template <int D, int GT, int E = kBf16>
struct Cfg {
  static constexpr int LANES = D / 8;         /* lanes per head row (8 elements each) */
  static constexpr int TPW = 32 / LANES;      /* rows per warp per load */
  /* FP8 loads are half as wide: twice as many keep the same bytes in flight. */
  static constexpr int WIDEN = E == kBf16 ? 1 : 2;
  static constexpr int U_BASE =
      (GT >= 8 ? (AKV_ATTN_LOADS + 1) / 2 : AKV_ATTN_LOADS) * WIDEN;
  static constexpr int U_MIN = 32 / (kWarps * TPW) > 0 ? 32 / (kWarps * TPW) : 1;
  /* 16-byte loads per thread per tile, for K and for V each. */
  static constexpr int U = U_BASE > U_MIN ? U_BASE : U_MIN;
  static constexpr int TILE = U * kWarps * TPW; /* rows per tile, a multiple of 32 */
  static constexpr int VALS = TILE / 32;        /* scores per lane in the stats step */
  static constexpr int LOG_LANES = LANES == 8 ? 3 : LANES == 16 ? 4 : 5;
  static constexpr int LOG_GT = GT == 1 ? 0 : GT == 2 ? 1 : GT == 4 ? 2 : 3;
  /* After the reduce-scatter, lane slice dl holds head dl >> HEAD_SHIFT. */
  static constexpr int HEAD_SHIFT = LOG_LANES - LOG_GT;
  static constexpr int PAD = 4; /* keeps score writes free of bank conflicts */
  static_assert(TILE % 32 == 0, "tile must be a multiple of a warp");
  static_assert(GT <= kWarps, "one warp per head in the stats step");
  static_assert(GT <= LANES, "reduce-scatter needs a lane per head");
};

/*
 * Reduce-scatter of N per-head sums over the lanes of one head row (a
 * butterfly within groups of 2*OFF lanes). At each level a lane keeps the half
 * of its values selected by its lane bit and receives the partner's copy of
 * that half; once one value is left it is a plain butterfly sum. Afterwards
 * v[0] of a lane holds the full sum of head (lane % LANES) >> HEAD_SHIFT.
 * log2(GT) + log2(LANES/GT) + (GT-1) shuffles instead of GT * log2(LANES).
 */
template <int OFF, int N>
struct ReduceScatter {
  static __device__ __forceinline__ void run(float *v, int lane) {
    if constexpr (N > 1) {
      const bool upper = (lane & OFF) != 0;
#pragma unroll
      for (int i = 0; i < N / 2; ++i) {
        const float send = upper ? v[i] : v[i + N / 2];
        const float keep = upper ? v[i + N / 2] : v[i];
        v[i] = keep + __shfl_xor_sync(0xFFFFFFFFu, send, OFF);
      }
      if constexpr (OFF > 1) ReduceScatter<OFF / 2, N / 2>::run(v, lane);
    } else {
      v[0] += __shfl_xor_sync(0xFFFFFFFFu, v[0], OFF);
      if constexpr (OFF > 1) ReduceScatter<OFF / 2, 1>::run(v, lane);
    }
  }
};

/* Two blocks per SM (at most 128 registers) with the library's knobs,
 * except for 8-head subgroups, whose q and accumulators alone take 128.
 * With the shared-memory pipeline (3 stages of 32 KiB at the library's
 * knobs) shared memory also caps a block pair per SM. */
constexpr int min_blocks(int gt) {
  return (gt >= 8 || kWarps != 8 || AKV_ATTN_LOADS > 4) ? 1 : 2;
}

/* Dynamic shared memory of the chunk kernel: kStages tiles of K and V. */
template <int D, int GT, int E>
constexpr size_t stage_bytes() {
  return (size_t)kStages * 2u * (size_t)Cfg<D, GT, E>::U * kThreads *
         sizeof(typename Elem<E>::Vec);
}

template <int D, int GT, int E, class Loc>
__global__ void __launch_bounds__(kThreads, min_blocks(GT))
    akv_attn_chunk_kernel(const __grid_constant__ ChunkParams p, const __grid_constant__ Loc loc) {
  using C = Cfg<D, GT, E>;
  using EL = Elem<E>;
  using Vec = typename EL::Vec;
  __shared__ float s_p[GT][C::TILE + C::PAD]; /* scores, then probabilities */
  __shared__ float s_alpha[GT];               /* rescale of the running sums */
  __shared__ __align__(16) float s_red[kWarps][D];

  /* blockIdx.x = (chunk * pieces + piece) * kv_slots + kv head * n_sub +
   * subgroup: the blocks of all kv heads of one piece are neighbours, so
   * together they read whole rows. `pslot` is the piece's partial slot. */
  const uint32_t pslot = blockIdx.x / p.kv_slots;
  const uint32_t chunk = pslot / p.pieces;
  const uint32_t piece = pslot - chunk * p.pieces;
  const uint32_t slot = blockIdx.x - pslot * p.kv_slots;
  const uint32_t kvh = slot / p.n_sub;
  const uint32_t sub = slot - kvh * p.n_sub;
  const uint32_t ctx = blockIdx.y;
#if AKV_ATTN_PDL
  /* Lets the combine grid be scheduled once every chunk block has started;
   * it still waits for this grid's completion before reading partials. */
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
  const char *kp;
  const char *vp;
  uint32_t n = 0;
  /* Block-uniform: a block past its context's last chunk, or past the last
   * row of its chunk, leaves at once; the combine reads only the partials of
   * pieces that hold rows (akv_attn_context_slots). */
  if (!loc.locate(ctx, chunk, kp, vp, n)) return;
  {
    const uint32_t first = piece * p.piece_rows; /* < 2^32: akv_attn_chunk_ok */
    if (first >= n) return;
    const uint32_t rest = n - first;
    n = rest < p.piece_rows ? rest : p.piece_rows;
    kp += (uint64_t)first * loc.row_bytes;
    vp += (uint64_t)first * loc.row_bytes;
  }

  const int warp = (int)(threadIdx.x >> 5);
  const int lane = (int)(threadIdx.x & 31);
  const int tok = lane / C::LANES; /* row slot within a warp load */
  const int dl = lane % C::LANES;  /* 16-byte slice: dims [dl*8, dl*8+8) */
  const uint32_t head0 = kvh * p.group + sub * GT;
  const uint32_t left = p.group - sub * GT;
  const int hvalid = left < (uint32_t)GT ? (int)left : GT;
  const uint64_t rb = loc.row_bytes;
  const size_t head_off = ((size_t)kvh * D + (size_t)dl * 8u) * EL::BYTES;
  /* The score factor of this kv head: the K scale folded in (one rounding,
   * as in attention_ref.c). */
  const float score_f = p.has_scales ? p.scale_log2 * p.k_scale[kvh] : p.scale_log2;
  const char *kd = kp + head_off;
  const char *vd = vp + head_off;

  float q[GT][8];
#pragma unroll
  for (int h = 0; h < GT; ++h) {
    if (h < hvalid) {
      const uint16_t *qh = p.q + ((size_t)ctx * p.n_heads + head0 + h) * D + dl * 8;
      bf16x8_to_f32(load16(reinterpret_cast<const char *>(qh)), q[h]);
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) q[h][j] = 0.0f;
    }
  }

  float acc[GT][8];
#pragma unroll
  for (int h = 0; h < GT; ++h)
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[h][j] = 0.0f;
  float m_run = -INFINITY; /* running max and sum of head `warp` (warps < GT) */
  float l_run = 0.0f;

  /* Row slot `u` of this thread in the tile starting at t0; rows past the
   * chunk read as zero (never from memory). */
  Vec kr[C::U];
  Vec vr[C::U];
  auto load_rows = [&](Vec(&r)[C::U], const char *base, uint32_t t0) {
#pragma unroll
    for (int u = 0; u < C::U; ++u) {
      const uint32_t t = t0 + u * (kWarps * C::TPW) + warp * C::TPW + tok;
      r[u] = t < n ? EL::load(base + t * rb) : EL::zero();
    }
  };
  /* Shared-memory pipeline: slot (stage, K|V, u) of thread x is
   * s_buf[((stage * 2 + kv) * U + u) * kThreads + x] (16 consecutive bytes per
   * thread: conflict-free). Tile i lives in stage i % kStages. */
  extern __shared__ uint4 s_raw[];
  Vec *s_buf = reinterpret_cast<Vec *>(s_raw);
  auto issue_tile = [&](uint32_t i) {
    const uint32_t t0 = i * C::TILE;
    if (t0 < n) {
      Vec *sk = s_buf + (size_t)((i % kRing) * 2 * C::U) * kThreads + threadIdx.x;
      Vec *sv = sk + (size_t)C::U * kThreads;
#pragma unroll
      for (int u = 0; u < C::U; ++u) {
        const uint32_t t = t0 + u * (kWarps * C::TPW) + warp * C::TPW + tok;
        const bool ok = t < n;
        cp_async16(sk + u * kThreads, ok ? kd + t * rb : kd, ok);
      }
#pragma unroll
      for (int u = 0; u < C::U; ++u) {
        const uint32_t t = t0 + u * (kWarps * C::TPW) + warp * C::TPW + tok;
        const bool ok = t < n;
        cp_async16(sv + u * kThreads, ok ? vd + t * rb : vd, ok);
      }
    }
    cp_async_commit(); /* one group per tile, empty past the chunk */
  };
  if constexpr (kStages > 0) {
#pragma unroll
    for (int i = 0; i < kStages - 1; ++i) issue_tile((uint32_t)i);
  } else {
    load_rows(kr, kd, 0);
    load_rows(vr, vd, 0);
  }

  /* Register pipeline (kStages == 0), without extra registers: the next
   * tile's K is loaded as soon as this tile's scores are taken, the next V as
   * soon as this tile's V is accumulated, so loads stay in flight across the
   * barriers. Shared-memory pipeline: tile i + kStages - 1 is requested when
   * tile i starts (its stage was last read before the previous tile's final
   * barrier), so kStages - 1 tiles stay in flight during the arithmetic. */
  uint32_t tile = 0;
  const Vec *s_cur = s_buf; /* this thread's slots of the current tile */
  for (uint32_t t0 = 0; t0 < n; t0 += C::TILE, ++tile) {
    const uint32_t t_next = t0 + C::TILE;
    if constexpr (kStages > 0) {
      issue_tile(tile + kStages - 1);
      cp_async_wait<kStages - 1>(); /* this thread's copies of tile `tile` landed */
      s_cur = s_buf + (size_t)((tile % kRing) * 2 * C::U) * kThreads + threadIdx.x;
#pragma unroll
      for (int u = 0; u < C::U; ++u) kr[u] = s_cur[u * kThreads];
    }

    /* Scores of the tile, scaled into the base-2 domain. */
#pragma unroll
    for (int u = 0; u < C::U; ++u) {
      float kf[8];
      EL::decode(kr[u], kf);
      float part[GT];
#pragma unroll
      for (int h = 0; h < GT; ++h) {
        float s = 0.0f;
#pragma unroll
        for (int j = 0; j < 8; ++j) s = fmaf(q[h][j], kf[j], s);
        part[h] = s;
      }
      ReduceScatter<C::LANES / 2, GT>::run(part, lane);
      if ((dl & ((1 << C::HEAD_SHIFT) - 1)) == 0) {
        const int tl = u * (kWarps * C::TPW) + warp * C::TPW + tok;
        s_p[dl >> C::HEAD_SHIFT][tl] = (t0 + tl < n) ? part[0] * score_f : -INFINITY;
      }
    }
    if constexpr (kStages == 0)
      if (t_next < n) load_rows(kr, kd, t_next);
    __syncthreads();

    /* Warp h folds head h's tile into its running maximum and sum. */
    if (warp < GT) {
      float vals[C::VALS];
      float mx = -INFINITY;
#pragma unroll
      for (int i = 0; i < C::VALS; ++i) {
        vals[i] = s_p[warp][lane + 32 * i];
        mx = fmaxf(mx, vals[i]);
      }
      mx = warp_max(mx);
      const float m_new = fmaxf(m_run, mx);
      const float m_use = (m_new == -INFINITY) ? 0.0f : m_new;
      float sum = 0.0f;
#pragma unroll
      for (int i = 0; i < C::VALS; ++i) {
        const float e = exp2f(vals[i] - m_use);
        s_p[warp][lane + 32 * i] = e;
        sum += e;
      }
      sum = warp_sum(sum);
      const float alpha = exp2f(m_run - m_use);
      l_run = l_run * alpha + sum;
      m_run = m_new;
      if (lane == 0) s_alpha[warp] = alpha;
    }
    __syncthreads();

    /* Rescale, then accumulate the tile's V slices. */
#pragma unroll
    for (int h = 0; h < GT; ++h) {
      const float a = s_alpha[h];
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[h][j] *= a;
    }
#pragma unroll
    for (int u = 0; u < C::U; ++u) {
      const int tl = u * (kWarps * C::TPW) + warp * C::TPW + tok;
      float vf[8];
      if constexpr (kStages > 0)
        EL::decode(s_cur[(C::U + u) * kThreads], vf);
      else
        EL::decode(vr[u], vf);
#pragma unroll
      for (int h = 0; h < GT; ++h) {
        const float pr = s_p[h][tl];
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[h][j] = fmaf(pr, vf[j], acc[h][j]);
      }
    }
    if constexpr (kStages == 0)
      if (t_next < n) load_rows(vr, vd, t_next);
    (void)t_next;
    __syncthreads(); /* s_p and s_alpha are rewritten by the next tile */
  }

  /* Sum the row slots of each warp (lanes dl, dl+LANES, ...). */
#pragma unroll
  for (int off = C::LANES; off < 32; off <<= 1)
#pragma unroll
    for (int h = 0; h < GT; ++h)
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[h][j] += __shfl_xor_sync(0xFFFFFFFFu, acc[h][j], off);

  /* Then the warps, in warp order, one head at a time. */
  const size_t slot0 = ((size_t)ctx * p.n_heads + head0) * p.stride_chunks + pslot;
#pragma unroll
  for (int h = 0; h < GT; ++h) {
    if (lane < C::LANES) {
      float4 *dst = reinterpret_cast<float4 *>(&s_red[warp][dl * 8]);
      dst[0] = make_float4(acc[h][0], acc[h][1], acc[h][2], acc[h][3]);
      dst[1] = make_float4(acc[h][4], acc[h][5], acc[h][6], acc[h][7]);
    }
    __syncthreads();
    if (h < hvalid) {
      for (int d = (int)threadIdx.x; d < D; d += kThreads) {
        float s = 0.0f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) s += s_red[w][d];
        p.acc[(slot0 + (size_t)h * p.stride_chunks) * D + d] = s;
      }
    }
    __syncthreads();
  }
  if (warp < hvalid && lane == 0) {
    float *ml = p.ml + (slot0 + (size_t)warp * p.stride_chunks) * 2;
    ml[0] = m_run;
    ml[1] = l_run;
  }
}

#if AKV_ATTN_KERNEL == 2
/*
 * Kernel 2, the warp-streaming chunk kernel. One block per (context, kv
 * head, subgroup, piece), as kernel 1, writing the same partial per query
 * head and piece. The piece's rows are dealt to the warps in a fixed pattern:
 * warp w owns the rows t = b * TILE + u * STEP + w * TPW + tok (batch b, row
 * slot u < U, tok < TPW rows per warp load, STEP = warps * TPW), a function of
 * the compile-time knobs and the piece's row count only. Each warp streams
 * its rows with no block barrier: per batch it takes the U row slots' scores
 * (dot products, a reduce-scatter across the lanes of a row, so lane dl holds
 * the score of head dl >> HEAD_SHIFT), folds them into its own running
 * maximum and sum, then accumulates the V slots with the probabilities
 * broadcast from the lanes that hold them. Each K (V) register is reloaded
 * with the next batch's row as soon as its scores (its V product) are taken,
 * so two batches' worth of 16-byte loads (K and V) stay in flight per warp
 * while it waits; with AKV_ATTN_STAGES >= 2 the slots come instead from a
 * per-thread cp.async ring in shared memory that runs STAGES - 1 batches
 * ahead (no registers held by loads in flight). At the end the warps' partials are merged in warp order
 * through shared memory: M = max_w m_w, l = sum_w 2^(m_w - M) l_w,
 * acc = sum_w 2^(m_w - M) acc_w (fused multiply-adds in warp order).
 * Every value is produced by a fixed thread from fixed inputs in a fixed
 * order, so the result is deterministic and the same for every locator.
 */
template <int D, int GT, int E>
struct Cfg2 {
  static constexpr int LANES = D / 8;    /* lanes per head row (8 elements each) */
  static constexpr int TPW = 32 / LANES; /* rows per warp load */
  /* FP8 loads are half as wide: twice as many keep the same bytes in flight. */
  static constexpr int WIDEN = E == kBf16 ? 1 : 2;
  /* Row slots per warp and batch, for K and for V each. */
  static constexpr int U = (GT >= 8 ? (AKV_ATTN_LOADS + 1) / 2 : AKV_ATTN_LOADS) * WIDEN;
  static constexpr int STEP = kWarps * TPW; /* rows between a warp's row slots */
  static constexpr int TILE = U * STEP;     /* rows per batch of the block */
  static constexpr int LOG_LANES = LANES == 8 ? 3 : LANES == 16 ? 4 : 5;
  static constexpr int LOG_GT = GT == 1 ? 0 : GT == 2 ? 1 : GT == 4 ? 2 : 3;
  /* After the reduce-scatter, lane slice dl holds head dl >> HEAD_SHIFT. */
  static constexpr int HEAD_SHIFT = LOG_LANES - LOG_GT;
  /* Heads merged per round at the end: the largest power of two up to GT
   * whose accumulators of every warp fit 16 KiB of shared memory (1 when
   * even one head does not). */
  static constexpr int HB = GT * kWarps * D <= 4096          ? GT
                            : (GT / 2) * kWarps * D <= 4096 ? (GT > 1 ? GT / 2 : 1)
                            : (GT / 4) * kWarps * D <= 4096 ? (GT > 2 ? GT / 4 : 1)
                            : (GT > 4 ? GT / 8 : 1);
  static_assert(GT <= LANES, "reduce-scatter needs a lane per head");
  static_assert(GT % HB == 0, "merge rounds cover the subgroup");
};

constexpr int min_blocks2(int gt) {
  return AKV_ATTN_MINB > 0 ? (gt >= 8 ? (AKV_ATTN_MINB + 1) / 2 : AKV_ATTN_MINB)
                           : ((gt >= 8 ? 8 : 16) / kWarps > 0 ? (gt >= 8 ? 8 : 16) / kWarps : 1);
}

/* Dynamic shared memory of chunk kernel 2: kStages batches of K and V. */
template <int D, int GT, int E>
constexpr size_t stage_bytes2() {
  return (size_t)kStages * 2u * (size_t)Cfg2<D, GT, E>::U * kThreads *
         sizeof(typename Elem<E>::Vec);
}

/* The V slice of a lane from its K slice (integer arithmetic: the two may
 * lie in different allocations). */
__device__ __forceinline__ const char *vslice(const char *k, uint64_t delta) {
  return reinterpret_cast<const char *>((uintptr_t)k + (uintptr_t)delta);
}

template <int D, int GT, int E, class Loc>
__global__ void __launch_bounds__(kThreads, min_blocks2(GT))
    akv_attn_chunk_kernel2(const __grid_constant__ ChunkParams p,
                           const __grid_constant__ Loc loc) {
  using C = Cfg2<D, GT, E>;
  using EL = Elem<E>;
  using Vec = typename EL::Vec;
  __shared__ float s_m[kWarps][GT];
  __shared__ float s_l[kWarps][GT];
  __shared__ __align__(16) float s_red[kWarps][C::HB][D];

  /* The block's piece, as in kernel 1. */
  const uint32_t pslot = blockIdx.x / p.kv_slots;
  const uint32_t chunk = pslot / p.pieces;
  const uint32_t piece = pslot - chunk * p.pieces;
  const uint32_t slot = blockIdx.x - pslot * p.kv_slots;
  const uint32_t kvh = slot / p.n_sub;
  const uint32_t sub = slot - kvh * p.n_sub;
  const uint32_t ctx = blockIdx.y;
#if AKV_ATTN_PDL
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
  const char *kp;
  const char *vp;
  uint32_t n = 0;
  if (!loc.locate(ctx, chunk, kp, vp, n)) return;
  {
    const uint32_t first = piece * p.piece_rows; /* < 2^32: akv_attn_chunk_ok */
    if (first >= n) return;
    const uint32_t rest = n - first;
    n = rest < p.piece_rows ? rest : p.piece_rows;
    kp += (uint64_t)first * loc.row_bytes;
    vp += (uint64_t)first * loc.row_bytes;
  }

  const int warp = (int)(threadIdx.x >> 5);
  const int lane = (int)(threadIdx.x & 31);
  const int tok = lane / C::LANES; /* row within a warp load */
  const int dl = lane % C::LANES;  /* 8-element slice: dims [dl*8, dl*8+8) */
  const int hs = dl >> C::HEAD_SHIFT; /* head whose score this lane holds */
  const uint32_t head0 = kvh * p.group + sub * GT;
  const uint32_t left = p.group - sub * GT;
  const int hvalid = left < (uint32_t)GT ? (int)left : GT;
  const uint64_t rb = loc.row_bytes;
  const size_t head_off = ((size_t)kvh * D + (size_t)dl * 8u) * EL::BYTES;
  const float score_f = p.has_scales ? p.scale_log2 * p.k_scale[kvh] : p.scale_log2;
  /* This lane's first row and its slices of K and V. */
  const uint32_t row0 = (uint32_t)(warp * C::TPW + tok);
  const uint32_t wrow0 = (uint32_t)(warp * C::TPW); /* the warp's first row */
  const char *kd = kp + head_off + (uint64_t)row0 * rb;
  /* V slice = K slice + kv_delta (bytes, modulo 2^64: K and V may be
   * different allocations). */
  const uint64_t kv_delta = (uint64_t)(uintptr_t)vp - (uint64_t)(uintptr_t)kp;
  const uint64_t step_bytes = (uint64_t)C::STEP * rb;
  const uint64_t tile_bytes = (uint64_t)C::TILE * rb;

  float q[GT][8];
#pragma unroll
  for (int h = 0; h < GT; ++h) {
    if (h < hvalid) {
      const uint16_t *qh = p.q + ((size_t)ctx * p.n_heads + head0 + h) * D + dl * 8;
      bf16x8_to_f32(load16(reinterpret_cast<const char *>(qh)), q[h]);
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) q[h][j] = 0.0f;
    }
  }
  float acc[GT][8];
#pragma unroll
  for (int h = 0; h < GT; ++h)
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[h][j] = 0.0f;
  /* Running maximum and sum of head hs over this warp's rows (the same on
   * every lane that holds head hs). */
  float m_run = -INFINITY;
  float l_run = 0.0f;

  /* Row slot u of the batch at t0 is row t0 + u * STEP + row0; rows past the
   * piece read as zero (never from memory). rem: rows of the piece from this
   * lane's row slot 0 of the current batch on (row slot u is a row of the
   * piece when rem > u * STEP). */
  uint32_t rem = n > row0 ? n - row0 : 0u;
  /* Register pipeline (kStages == 0): the batch's K and V slots. */
  Vec kr[C::U];
  Vec vr[C::U];
  /* Shared-memory pipeline (kStages >= 2): a ring of kStages batches per
   * thread, filled by cp.async; slot (stage, K|V, u) of this thread is
   * ring[((stage * 2 + kv) * U + u) * kThreads] (consecutive threads,
   * consecutive slots: conflict-free). Each thread reads back only what it
   * copied, after its own wait, and refills a stage only after it used the
   * stage's values (one batch earlier), so no barrier guards the ring.
   * The issue side runs kStages - 1 batches ahead. */
  extern __shared__ uint4 s_raw[];
  Vec *const ring = reinterpret_cast<Vec *>(s_raw) + threadIdx.x;
  const char *k_iss = kd;       /* slot-0 K slice of the next batch to request */
  uint32_t r_iss = rem;         /* its rem */
  uint32_t t_iss = 0;           /* its first row */
  const char *const k_any = kp + head_off; /* row 0: a valid address for empty copies */
  auto issue = [&](int stage) {
    if (t_iss + wrow0 < n) { /* warp-uniform: the warp still has rows there */
      Vec *sk = ring + (size_t)(stage * 2 * C::U) * kThreads;
#pragma unroll
      for (int u = 0; u < C::U; ++u) {
        const bool ok = r_iss > (uint32_t)(u * C::STEP);
        cp_async16(sk + u * kThreads, ok ? k_iss + (uint64_t)u * step_bytes : k_any, ok);
      }
#pragma unroll
      for (int u = 0; u < C::U; ++u) {
        const bool ok = r_iss > (uint32_t)(u * C::STEP);
        cp_async16(sk + (C::U + u) * kThreads,
                   ok ? vslice(k_iss, kv_delta) + (uint64_t)u * step_bytes
                      : vslice(k_any, kv_delta),
                   ok);
      }
    }
    cp_async_commit(); /* one group per batch, empty past the warp's rows */
    k_iss += tile_bytes;
    r_iss = r_iss > (uint32_t)C::TILE ? r_iss - (uint32_t)C::TILE : 0u;
    t_iss += C::TILE;
  };
  int stage = 0; /* the ring stage of the current batch */
  if constexpr (kStages > 0) {
#pragma unroll
    for (int i = 0; i < kStages - 1; ++i) issue(i);
  } else {
#pragma unroll
    for (int u = 0; u < C::U; ++u) {
      const bool ok = rem > (uint32_t)(u * C::STEP);
      kr[u] = ok ? EL::load(kd + (uint64_t)u * step_bytes) : EL::zero();
      vr[u] = ok ? EL::load(vslice(kd, kv_delta) + (uint64_t)u * step_bytes) : EL::zero();
    }
  }
  (void)k_any;

  /* The loop bound is warp-uniform: a warp stops after its last row. */
  for (uint32_t t0 = 0; t0 + wrow0 < n; t0 += C::TILE) {
    kd += tile_bytes; /* the next batch's row slot 0 */
    const uint32_t rn = rem > (uint32_t)C::TILE ? rem - (uint32_t)C::TILE : 0u; /* next batch's */
    const Vec *cur = ring + (size_t)(stage * 2 * C::U) * kThreads;
    if constexpr (kStages > 0) {
      /* The stage of batch b - 1 (used up) takes batch b + kStages - 1. */
      issue(stage == 0 ? kStages - 1 : stage - 1);
      cp_async_wait<(kStages > 0 ? kStages - 1 : 0)>(); /* this batch's copies landed */
    }

    /* Scores of the batch, scaled into the base-2 domain; K slot u is
     * reloaded with the next batch's row once its score is taken. */
    float s[C::U];
#pragma unroll
    for (int u = 0; u < C::U; ++u) {
      float kf[8];
      if constexpr (kStages > 0)
        EL::decode(cur[u * kThreads], kf);
      else
        EL::decode(kr[u], kf);
      float part[GT];
#pragma unroll
      for (int h = 0; h < GT; ++h) {
        float a = 0.0f;
#pragma unroll
        for (int j = 0; j < 8; ++j) a = fmaf(q[h][j], kf[j], a);
        part[h] = a;
      }
      ReduceScatter<C::LANES / 2, GT>::run(part, lane);
      s[u] = rem > (uint32_t)(u * C::STEP) ? part[0] * score_f : -INFINITY;
      if constexpr (kStages == 0)
        kr[u] = rn > (uint32_t)(u * C::STEP) ? EL::load(kd + (uint64_t)u * step_bytes)
                                             : EL::zero();
    }

    /* Fold the batch into the running maximum and sum of head hs. */
    float mx = s[0];
#pragma unroll
    for (int u = 1; u < C::U; ++u) mx = fmaxf(mx, s[u]);
#pragma unroll
    for (int off = C::LANES; off < 32; off <<= 1)
      mx = fmaxf(mx, __shfl_xor_sync(0xFFFFFFFFu, mx, off));
    const float m_new = fmaxf(m_run, mx);
    const float m_use = (m_new == -INFINITY) ? 0.0f : m_new;
    float sum = 0.0f;
#pragma unroll
    for (int u = 0; u < C::U; ++u) {
      s[u] = exp2f(s[u] - m_use);
      sum += s[u];
    }
#pragma unroll
    for (int off = C::LANES; off < 32; off <<= 1) sum += __shfl_xor_sync(0xFFFFFFFFu, sum, off);
    const float alpha = exp2f(m_run - m_use);
    l_run = l_run * alpha + sum;
    m_run = m_new;

    /* Rescale the accumulators (skipped, warp-uniformly, when no head's
     * maximum moved: a factor of exactly 1). */
    if (__any_sync(0xFFFFFFFFu, alpha != 1.0f)) {
#pragma unroll
      for (int h = 0; h < GT; ++h) {
        const float a = __shfl_sync(0xFFFFFFFFu, alpha, h << C::HEAD_SHIFT);
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[h][j] *= a;
      }
    }

    /* Accumulate the V slots; V slot u is reloaded once it is used. */
#pragma unroll
    for (int u = 0; u < C::U; ++u) {
      float vf[8];
      if constexpr (kStages > 0)
        EL::decode(cur[(C::U + u) * kThreads], vf);
      else
        EL::decode(vr[u], vf);
#pragma unroll
      for (int h = 0; h < GT; ++h) {
        const float pr = __shfl_sync(0xFFFFFFFFu, s[u], tok * C::LANES + (h << C::HEAD_SHIFT));
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[h][j] = fmaf(pr, vf[j], acc[h][j]);
      }
      if constexpr (kStages == 0)
        vr[u] = rn > (uint32_t)(u * C::STEP)
                    ? EL::load(vslice(kd, kv_delta) + (uint64_t)u * step_bytes)
                    : EL::zero();
    }
    rem = rn;
    stage = stage + 1 == kRing ? 0 : stage + 1;
  }

  /* Sum the warp's rows per lane slice (lanes dl, dl + LANES, ...). */
#pragma unroll
  for (int off = C::LANES; off < 32; off <<= 1)
#pragma unroll
    for (int h = 0; h < GT; ++h)
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[h][j] += __shfl_xor_sync(0xFFFFFFFFu, acc[h][j], off);

  /* Merge the warps in warp order, HB heads per round. */
  if (lane < C::LANES && (dl & ((1 << C::HEAD_SHIFT) - 1)) == 0) {
    s_m[warp][hs] = m_run;
    s_l[warp][hs] = l_run;
  }
  const size_t slot0 = ((size_t)ctx * p.n_heads + head0) * p.stride_chunks + pslot;
#pragma unroll
  for (int h0 = 0; h0 < GT; h0 += C::HB) {
    if (h0 > 0) __syncthreads(); /* the previous round's readers are done */
    if (lane < C::LANES) {
#pragma unroll
      for (int hh = 0; hh < C::HB; ++hh) {
        float4 *dst = reinterpret_cast<float4 *>(&s_red[warp][hh][dl * 8]);
        dst[0] = make_float4(acc[h0 + hh][0], acc[h0 + hh][1], acc[h0 + hh][2], acc[h0 + hh][3]);
        dst[1] = make_float4(acc[h0 + hh][4], acc[h0 + hh][5], acc[h0 + hh][6], acc[h0 + hh][7]);
      }
    }
    __syncthreads();
    for (int i = (int)threadIdx.x; i < C::HB * D; i += kThreads) {
      const int hh = i / D;
      const int d = i - hh * D;
      const int h = h0 + hh;
      if (h >= hvalid) continue;
      float big = -INFINITY;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) big = fmaxf(big, s_m[w][h]);
      const float big_use = (big == -INFINITY) ? 0.0f : big;
      float a = 0.0f;
      float l = 0.0f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const float wgt = exp2f(s_m[w][h] - big_use);
        a = fmaf(wgt, s_red[w][hh][d], a);
        l = fmaf(wgt, s_l[w][h], l);
      }
      const size_t hslot = slot0 + (size_t)h * p.stride_chunks;
      p.acc[hslot * D + d] = a;
      if (d == 0) {
        p.ml[hslot * 2] = big;
        p.ml[hslot * 2 + 1] = l;
      }
    }
  }
}
#endif /* AKV_ATTN_KERNEL == 2 */

#endif /* AKV_ATTENTION_CUDA_CORES_CUH */
