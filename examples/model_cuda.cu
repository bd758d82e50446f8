/*
 * model_cuda.cu - the synthetic transformer on the GPU.
 *
 * Weights are bf16, drawn on the device by a hash kernel from the seed (never
 * copied from the host), the same values model_cpu.c draws. Matmuls are
 * GEMV-style for a batch of up to 8 tokens per launch, streaming each weight
 * once with 16-byte loads straight into bf16 tensor-core MMAs (m16n8k16, fp32
 * accumulate): the 8 tokens are the MMA's n dimension, so a decode batch costs
 * one pass over the weights. Every sum has a fixed order (MMAs in k order
 * within a warp, then the warps' partials in warp order); no atomics anywhere,
 * so a step is a pure function of its inputs and the K/V bytes attention reads,
 * and a token's result does not depend on which other tokens share its batch.
 *
 * Everything runs on the model's own non-blocking stream; model_forward ends
 * by copying the logits to the host and synchronising that stream.
 *
 * Attention is the library's CUDA launcher, akv_attention_decode_cuda, over
 * the view model_attend is given (the engine's staged layer or the model's
 * resident store) and, at sliding-window layers, over the model's own window
 * rows, with the model's chunk size.
 *
 * Tensor parallel (model_options.tp_size, allreduce_dev): the model is rank
 * tp_rank's shard, drawn at the full model's indices as model_cpu.c draws it
 * (k_fill_shard), and the partial outputs of the attention output projection
 * and of the MLP are summed over the ranks by the caller's allreduce_dev on
 * the model's stream, then added to the residual stream. This file knows no
 * NCCL: the caller's callback does the collective (the CLI's is
 * ncclAllReduce, examples/tp_nccl.c).
 */
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "akv_attention.h"
#include "akv_cuda.h"
#include "model.h"

#define GEMV_ROWS 16   /* output rows per block: the MMA's m */
#define GEMV_MAX_NB 8  /* tokens per launch: the MMA's n */
#define GEMV_WARPS 16  /* warps per block, each a contiguous slice of k */
#define GEMV_UNROLL 4  /* k32 steps whose loads are in flight together */

/* Kernel parameters passed by value. */
struct cuda_i32x { int32_t v[MODEL_MAX_BATCH]; };
struct cuda_u64x { uint64_t v[MODEL_MAX_BATCH]; };

struct cuda_layer {
  uint16_t *attn_norm, *wqkv, *wo, *mlp_norm, *wgateup, *wdown;
};

struct cuda_model {
  model base;
  model_geometry full_g; /* the whole model (tensor parallel: base.g is the shard) */
  uint32_t tp;           /* ranks, >= 1 */
  cudaStream_t stream;
  uint32_t q_dim, kv_dim, qkv_dim, widest;
  uint64_t row_bytes;

  uint8_t *weights; /* one allocation for every tensor */
  uint64_t weight_bytes;
  uint16_t *embed, *lm_head, *final_norm;
  cuda_layer *layers; /* host array of device pointers */
  double *inv_freq;   /* [head_dim / 2], device */

  uint8_t *scratch; /* one allocation for the activations */
  uint64_t scratch_bytes;
  float *x;         /* [B][hidden] residual stream */
  uint16_t *xin;    /* [B][widest] bf16 matmul input, row stride = the matmul's K */
  float *qkv;       /* [B][qkv_dim] */
  float *gateup;    /* [B][2 ffn] */
  uint16_t *q;      /* [B][n_heads][head_dim] after RoPE */
  uint16_t *k_new;  /* [B][kv_dim] after RoPE */
  uint16_t *v_new;  /* [B][kv_dim] */
  float *attn;      /* [B][n_heads][head_dim] */
  float *logits_d;  /* [B][vocab] */
  float *part;      /* [B][hidden] a projection's output before the all-reduce (with
                       allreduce_dev only, else NULL) */
  float *logits_h;  /* pinned host [B][vocab] */
  void *workspace;
  size_t workspace_bytes; /* sized for opt.max_tokens rows per context */

  uint8_t *resident; /* [dense layer][ctx][K|V][max_tokens][row] */
  uint32_t res_ctx, res_max_tokens;

  uint8_t *window; /* [lane][sliding layer][ctx][K|V][window rows][row] */
  uint32_t win_lanes, win_ctx;

  uint32_t n_ctx;
  uint32_t pos[MODEL_MAX_BATCH];
  int32_t layer;
  int attended;
  uint32_t cur_l; /* the layer the forward is in (dense or sliding): its scales */
};

#define CM_CHECK(call)                                                                \
  do {                                                                                \
    cudaError_t e_ = (call);                                                          \
    if (e_ != cudaSuccess) {                                                          \
      snprintf(cm->base.error, sizeof cm->base.error, "%s: %s (%s:%d)", #call,        \
               cudaGetErrorString(e_), __FILE__, __LINE__);                           \
      return -1;                                                                      \
    }                                                                                 \
  } while (0)

#define CM_LAUNCHED() CM_CHECK(cudaGetLastError())

/* ------------------------------------------------------------------------ */
/* Kernels                                                                   */
/* ------------------------------------------------------------------------ */

__global__ void k_fill_weights(uint16_t *dst, uint64_t n, uint64_t key, float unit,
                               float offset) {
  for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n;
       i += (uint64_t)gridDim.x * blockDim.x)
    dst[i] = model_weight_bf16(key, i, unit, offset);
}

/*
 * Tensor parallel: which full-model row each row of a shard is. Shard rows
 * [start[s], start[s+1]) are full rows full0[s] + (j - start[s]); start[n]
 * is the shard's row count. One segment with full0 0 is the identity.
 */
struct cuda_row_map {
  uint64_t start[4];
  uint64_t full0[3];
  uint32_t n;
};

/* A rows x cols shard of a tensor of full_cols columns: shard element (j, k)
 * is the full tensor's element (row map(j), col0 + k), drawn as
 * k_fill_weights draws it, so a shard holds exactly the full model's bits. */
__global__ void k_fill_shard(uint16_t *dst, uint64_t rows, uint64_t cols, uint64_t full_cols,
                             uint64_t col0, cuda_row_map map, uint64_t key, float unit,
                             float offset) {
  const uint64_t n = rows * cols;
  for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n;
       i += (uint64_t)gridDim.x * blockDim.x) {
    const uint64_t j = i / cols, k = i % cols;
    uint32_t s = 0;
    while (s + 1 < map.n && j >= map.start[s + 1]) ++s;
    const uint64_t fr = map.full0[s] + (j - map.start[s]);
    dst[i] = model_weight_bf16(key, fr * full_cols + col0 + k, unit, offset);
  }
}

__device__ __forceinline__ float bf(uint16_t h) { return __uint_as_float((uint32_t)h << 16); }
__device__ __forceinline__ uint16_t to_bf(float f) { return model_f32_to_bf16(f); }

/* Weight rows are read once per step: stream them past L1. */
__device__ __forceinline__ uint4 ld_stream(const uint4 *p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}

/* D += A B on bf16 tensor cores, fp32 accumulate (m16n8k16, A row-major, B
 * column-major; fragment layout as the PTX ISA documents it). */
__device__ __forceinline__ void mma_bf16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

/*
 * Y[b][n] (+)= sum_k W[n][k] X[b][k] for nb <= 8 tokens and 16 rows n per
 * block. K % 8 == 0; W and X rows 16-byte aligned (ldx % 8 == 0).
 *
 * k is walked in steps of 32. Lane (g = lane/4, t = lane%4) loads 16 bytes,
 * k0 + 8t .. k0 + 8t + 7, of weight rows g and g+8 and of token g's input.
 * Two MMAs consume them: the first the words .x/.y, the second .z/.w. This
 * pairs the MMA's logical k with a permutation of the physical k, the same
 * permutation for W and X, so the products are the right ones and every load
 * is a full 16 bytes. Warp w of the block takes the w-th contiguous slice of
 * the k steps; the partials are added in warp order.
 */
__global__ void __launch_bounds__(GEMV_WARPS * 32)
    k_gemv(const uint16_t *__restrict__ W, const uint16_t *__restrict__ X,
           float *__restrict__ Y, uint32_t N, uint32_t K, uint32_t ldx, uint32_t ldy,
           uint32_t nb, int add) {
  __shared__ float part[GEMV_WARPS][32][4];
  const uint32_t lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const uint32_t g = lane >> 2, t = lane & 3;
  const uint32_t row0 = blockIdx.x * GEMV_ROWS + g, row1 = row0 + 8;
  const uint32_t chunks = K >> 3, steps = (chunks + 3) >> 2;
  const uint32_t s_begin = steps * warp / GEMV_WARPS, s_end = steps * (warp + 1) / GEMV_WARPS;
  const uint4 zero = make_uint4(0, 0, 0, 0);
  const bool r0ok = row0 < N, r1ok = row1 < N, xok = g < nb;
  const uint4 *w0 = reinterpret_cast<const uint4 *>(W + (uint64_t)(r0ok ? row0 : 0) * K);
  const uint4 *w1 = reinterpret_cast<const uint4 *>(W + (uint64_t)(r1ok ? row1 : 0) * K);
  const uint4 *x = reinterpret_cast<const uint4 *>(X + (uint64_t)(xok ? g : 0) * ldx);

  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (uint32_t s = s_begin; s < s_end; s += GEMV_UNROLL) {
    uint4 a[GEMV_UNROLL], b[GEMV_UNROLL], c[GEMV_UNROLL];
#pragma unroll
    for (int u = 0; u < GEMV_UNROLL; ++u) {
      const uint32_t ch = (s + u) * 4 + t;
      const bool in = s + u < s_end && ch < chunks;
      a[u] = in && r0ok ? ld_stream(w0 + ch) : zero;
      b[u] = in && r1ok ? ld_stream(w1 + ch) : zero;
      c[u] = in && xok ? __ldg(x + ch) : zero;
    }
#pragma unroll
    for (int u = 0; u < GEMV_UNROLL; ++u) {
      mma_bf16(acc, a[u].x, b[u].x, a[u].y, b[u].y, c[u].x, c[u].y);
      mma_bf16(acc, a[u].z, b[u].z, a[u].w, b[u].w, c[u].z, c[u].w);
    }
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) part[warp][lane][i] = acc[i];
  __syncthreads();
  if (warp != 0) return;
  /* accumulator i: row (i < 2 ? g : g + 8), token 2t + (i & 1) */
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float sum = part[0][lane][i];
#pragma unroll
    for (int v = 1; v < GEMV_WARPS; ++v) sum += part[v][lane][i];
    const uint32_t row = i < 2 ? row0 : row1, tok = 2 * t + (i & 1);
    if (row < N && tok < nb) {
      float *y = Y + (uint64_t)tok * ldy + row;
      *y = add ? *y + sum : sum;
    }
  }
}

/* Sum over a block of 256 threads in a fixed order; every thread gets it. */
__device__ float block_sum_256(float v) {
  __shared__ float part[8];
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = v;
  __syncthreads();
  float s = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) s += part[i];
  __syncthreads();
  return s;
}

/* One block (256 threads) per token: out = bf16(x * rsqrt(mean(x^2)+eps) * w). */
__global__ void __launch_bounds__(256) k_rmsnorm(const float *__restrict__ x,
                                                 const uint16_t *__restrict__ w,
                                                 uint16_t *__restrict__ out, uint32_t n,
                                                 float eps) {
  const float *xr = x + (uint64_t)blockIdx.x * n;
  uint16_t *o = out + (uint64_t)blockIdx.x * n;
  float ss = 0.0f;
  for (uint32_t i = threadIdx.x; i < n; i += 256) ss = fmaf(xr[i], xr[i], ss);
  float r = rsqrtf(block_sum_256(ss) / (float)n + eps);
  for (uint32_t i = threadIdx.x; i < n; i += 256) o[i] = to_bf(xr[i] * r * bf(w[i]));
}

__global__ void k_embed(const uint16_t *__restrict__ table, cuda_i32x tokens, float *x,
                        uint32_t hidden) {
  const uint16_t *row = table + (uint64_t)tokens.v[blockIdx.x] * hidden;
  float *xr = x + (uint64_t)blockIdx.x * hidden;
  for (uint32_t i = threadIdx.x; i < hidden; i += blockDim.x) xr[i] = bf(row[i]);
}

/* Rotate-half RoPE on the q and k heads of one token; v is rounded to bf16. */
__global__ void k_rope(const float *__restrict__ qkv, const double *__restrict__ inv_freq,
                       cuda_i32x pos, uint16_t *q, uint16_t *k, uint16_t *v, uint32_t n_heads,
                       uint32_t kv_heads, uint32_t hd) {
  const uint32_t b = blockIdx.x, half = hd / 2;
  const uint32_t q_dim = n_heads * hd, kv_dim = kv_heads * hd;
  const float *in = qkv + (uint64_t)b * (q_dim + 2 * kv_dim);
  const uint32_t pairs = (n_heads + kv_heads) * half;
  for (uint32_t p = threadIdx.x; p < pairs; p += blockDim.x) {
    uint32_t head = p / half, j = p % half;
    double s, c;
    sincos((double)pos.v[b] * inv_freq[j], &s, &c);
    float cf = (float)c, sf = (float)s;
    const float *src = in + head * hd; /* q heads, then k heads: contiguous */
    uint16_t *dst = head < n_heads ? q + ((uint64_t)b * n_heads + head) * hd
                                   : k + ((uint64_t)b * kv_heads + (head - n_heads)) * hd;
    float x0 = src[j], x1 = src[j + half];
    dst[j] = to_bf(x0 * cf - x1 * sf);
    dst[j + half] = to_bf(x1 * cf + x0 * sf);
  }
  for (uint32_t i = threadIdx.x; i < kv_dim; i += blockDim.x)
    v[(uint64_t)b * kv_dim + i] = to_bf(in[q_dim + kv_dim + i]);
}

__global__ void k_to_bf16(const float *__restrict__ in, uint16_t *__restrict__ out, uint64_t n) {
  for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n;
       i += (uint64_t)gridDim.x * blockDim.x)
    out[i] = to_bf(in[i]);
}

/* x[i] = x[i] + part[i]: the all-reduced partial added to the residual
 * stream, the one rounded add k_gemv's `add` makes (so one rank gives the
 * bits of an unsharded model). */
__global__ void k_add(float *__restrict__ x, const float *__restrict__ part, uint64_t n) {
  for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n;
       i += (uint64_t)gridDim.x * blockDim.x)
    x[i] = __fadd_rn(x[i], part[i]);
}

/* h = silu(gate) * up, as bf16 rows of ffn. */
__global__ void k_swiglu(const float *__restrict__ gateup, uint16_t *__restrict__ out,
                         uint32_t ffn) {
  const float *g = gateup + (uint64_t)blockIdx.y * 2 * ffn;
  uint16_t *o = out + (uint64_t)blockIdx.y * ffn;
  for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < ffn; i += gridDim.x * blockDim.x) {
    float gt = g[i];
    o[i] = to_bf(gt / (1.0f + expf(-gt)) * g[ffn + i]);
  }
}

/* Writes token b's new K and V rows at byte offset off.v[b] of the view. */
__global__ void k_write_rows(uint8_t *base, cuda_u64x off, uint64_t v_offset,
                             const uint16_t *__restrict__ k_new,
                             const uint16_t *__restrict__ v_new, uint32_t row_bytes) {
  const uint32_t b = blockIdx.x, n = row_bytes / 16;
  const uint4 *ks = reinterpret_cast<const uint4 *>(reinterpret_cast<const uint8_t *>(k_new) +
                                                    (uint64_t)b * row_bytes);
  const uint4 *vs = reinterpret_cast<const uint4 *>(reinterpret_cast<const uint8_t *>(v_new) +
                                                    (uint64_t)b * row_bytes);
  uint4 *kd = reinterpret_cast<uint4 *>(base + off.v[b]);
  uint4 *vd = reinterpret_cast<uint4 *>(base + off.v[b] + v_offset);
  for (uint32_t i = threadIdx.x; i < n; i += blockDim.x) {
    kd[i] = ks[i];
    vd[i] = vs[i];
  }
}

/* Per-head reciprocals of the scales of one layer, for the FP8 row writer. */
struct cuda_inv_scales {
  float k[AKV_ATTENTION_MAX_SCALE_HEADS];
  float v[AKV_ATTENTION_MAX_SCALE_HEADS];
};

/* FP8: token b's new K and V rows (bf16, after RoPE) quantized to E4M3 with
 * the layer's fixed scales (model_quantize_row, the same code on the host)
 * and written at byte offset off.v[b] of the view. */
__global__ void k_write_rows_fp8(uint8_t *base, cuda_u64x off, uint64_t v_offset,
                                 const uint16_t *__restrict__ k_new,
                                 const uint16_t *__restrict__ v_new, uint32_t kv_dim,
                                 uint32_t head_dim, const __grid_constant__ cuda_inv_scales inv) {
  const uint32_t b = blockIdx.x;
  uint8_t *kd = base + off.v[b];
  uint8_t *vd = kd + v_offset;
  for (uint32_t i = threadIdx.x; i < kv_dim; i += blockDim.x) {
    const uint32_t h = i / head_dim;
    kd[i] = model_f32_to_e4m3(model_bf16_to_f32(k_new[(uint64_t)b * kv_dim + i]) * inv.k[h]);
    vd[i] = model_f32_to_e4m3(model_bf16_to_f32(v_new[(uint64_t)b * kv_dim + i]) * inv.v[h]);
  }
}

/* ------------------------------------------------------------------------ */
/* Host side                                                                 */
/* ------------------------------------------------------------------------ */

static cuda_model *cm_of(model *m) { return reinterpret_cast<cuda_model *>(m); }

/* Y (+)= W X for nb tokens, in launches of at most GEMV_MAX_NB tokens. */
static int cm_gemv(cuda_model *cm, const uint16_t *W, uint32_t N, uint32_t K, const uint16_t *X,
                   float *Y, uint32_t ldy, uint32_t nb, int add) {
  dim3 grid((N + GEMV_ROWS - 1) / GEMV_ROWS), block(GEMV_WARPS * 32);
  for (uint32_t b0 = 0; b0 < nb; b0 += GEMV_MAX_NB) {
    uint32_t n = nb - b0 < GEMV_MAX_NB ? nb - b0 : GEMV_MAX_NB;
    k_gemv<<<grid, block, 0, cm->stream>>>(W, X + (uint64_t)b0 * K, Y + (uint64_t)b0 * ldy, N, K,
                                           K, ldy, n, add);
    CM_LAUNCHED();
  }
  return 0;
}

static int cm_attend_rows(cuda_model *cm, const model_kv_view *v, const uint32_t *write_row,
                          const uint32_t *len1);

/* Tensor parallel: part[n_ctx][hidden] summed over the ranks by the caller's
 * all-reduce, enqueued on the model's stream, then added to the residual. */
static int cm_reduce_add(cuda_model *cm, uint32_t n_ctx) {
  model *m = &cm->base;
  const uint64_t n = (uint64_t)n_ctx * m->g.hidden;
  if (m->opt.allreduce_dev(m->opt.allreduce_user, cm->part, n, cm->stream) != 0) {
    snprintf(m->error, sizeof m->error,
             "the tensor parallel all-reduce could not be enqueued (a peer or the "
             "communicator stopped)");
    return -1;
  }
  k_add<<<(unsigned)((n + 255) / 256), 256, 0, cm->stream>>>(cm->x, cm->part, n);
  CM_LAUNCHED();
  return 0;
}

static int cm_forward(model *m, uint32_t lane, uint32_t n_ctx, const int32_t *tokens,
                      const uint32_t *pos, model_layer_fn fn, void *user, float *logits) {
  cuda_model *cm = cm_of(m);
  const model_geometry *g = &m->g;
  const uint32_t H = g->hidden, F = g->ffn;
  if (n_ctx == 0 || n_ctx > m->opt.max_batch) {
    snprintf(m->error, sizeof m->error, "forward: %u contexts, the model was built for 1..%u",
             n_ctx, m->opt.max_batch);
    return -1;
  }
  cuda_i32x tok, ps;
  memset(&tok, 0, sizeof tok);
  memset(&ps, 0, sizeof ps);
  for (uint32_t b = 0; b < n_ctx; ++b) {
    if (tokens[b] < 0 || (uint32_t)tokens[b] >= g->vocab) {
      snprintf(m->error, sizeof m->error, "forward: token %d outside the vocabulary of %u",
               tokens[b], g->vocab);
      return -1;
    }
    if (pos[b] > INT32_MAX) {
      snprintf(m->error, sizeof m->error, "forward: position %u too large", pos[b]);
      return -1;
    }
    tok.v[b] = tokens[b];
    ps.v[b] = (int32_t)pos[b];
    cm->pos[b] = pos[b];
  }
  cm->n_ctx = n_ctx;
  cudaStream_t s = cm->stream;

  k_embed<<<n_ctx, 256, 0, s>>>(cm->embed, tok, cm->x, H);
  CM_LAUNCHED();
  for (uint32_t l = 0; l < g->n_layers; ++l) {
    const cuda_layer *L = &cm->layers[l];
    k_rmsnorm<<<n_ctx, 256, 0, s>>>(cm->x, L->attn_norm, cm->xin, H, g->norm_eps);
    CM_LAUNCHED();
    if (cm_gemv(cm, L->wqkv, cm->qkv_dim, H, cm->xin, cm->qkv, cm->qkv_dim, n_ctx, 0)) return -1;
    k_rope<<<n_ctx, 256, 0, s>>>(cm->qkv, cm->inv_freq, ps, cm->q, cm->k_new, cm->v_new,
                                 g->n_heads, g->kv_heads, g->head_dim);
    CM_LAUNCHED();

    cm->attended = 0;
    cm->cur_l = l;
    m->error[0] = '\0';
    if (!model_layer_dense(g, l)) {
      /* sliding-window layer: the model's own rows of this lane */
      uint32_t wrow[MODEL_MAX_BATCH], len1[MODEL_MAX_BATCH];
      model_kv_view wv;
      if (model_window_view(m, cm->window, cm->win_lanes, cm->win_ctx, lane, l, cm->row_bytes,
                            n_ctx, pos, wrow, len1, &wv) != 0 ||
          cm_attend_rows(cm, &wv, wrow, len1) != 0)
        return -1;
    } else {
      cm->layer = (int32_t)l;
      int rc = fn(user, m, l);
      cm->layer = -1;
      if (rc != 0) {
        if (m->error[0] == '\0')
          snprintf(m->error, sizeof m->error, "layer %u: attention failed", l);
        return -1;
      }
    }
    if (!cm->attended) {
      snprintf(m->error, sizeof m->error, "layer %u: the layer callback did not attend", l);
      return -1;
    }

    /* Without an all-reduce the projections add into the residual stream
     * directly; with one (tensor parallel) each rank's partial goes to
     * `part`, is summed over the ranks, then added: with one rank the same
     * single rounded add, so the same bits. */
    const int reduce = m->opt.allreduce_dev != NULL;
    uint64_t n_attn = (uint64_t)n_ctx * cm->q_dim;
    k_to_bf16<<<(unsigned)((n_attn + 255) / 256), 256, 0, s>>>(cm->attn, cm->xin, n_attn);
    CM_LAUNCHED();
    if (cm_gemv(cm, L->wo, H, cm->q_dim, cm->xin, reduce ? cm->part : cm->x, H, n_ctx, !reduce))
      return -1;
    if (reduce && cm_reduce_add(cm, n_ctx) != 0) return -1;
    k_rmsnorm<<<n_ctx, 256, 0, s>>>(cm->x, L->mlp_norm, cm->xin, H, g->norm_eps);
    CM_LAUNCHED();
    if (cm_gemv(cm, L->wgateup, 2 * F, H, cm->xin, cm->gateup, 2 * F, n_ctx, 0)) return -1;
    k_swiglu<<<dim3((F + 255) / 256, n_ctx), 256, 0, s>>>(cm->gateup, cm->xin, F);
    CM_LAUNCHED();
    if (cm_gemv(cm, L->wdown, H, F, cm->xin, reduce ? cm->part : cm->x, H, n_ctx, !reduce))
      return -1;
    if (reduce && cm_reduce_add(cm, n_ctx) != 0) return -1;
  }
  k_rmsnorm<<<n_ctx, 256, 0, s>>>(cm->x, cm->final_norm, cm->xin, H, g->norm_eps);
  CM_LAUNCHED();
  if (cm_gemv(cm, cm->lm_head, g->vocab, H, cm->xin, cm->logits_d, g->vocab, n_ctx, 0)) return -1;
  size_t lb = (size_t)n_ctx * g->vocab * sizeof(float);
  CM_CHECK(cudaMemcpyAsync(cm->logits_h, cm->logits_d, lb, cudaMemcpyDeviceToHost, s));
  CM_CHECK(cudaStreamSynchronize(s));
  memcpy(logits, cm->logits_h, lb);
  return 0;
}

/* Enqueues the write of each context's new K/V row at row write_row[i] of
 * the view, then attention over len1[i] rows. */
static int cm_attend_rows(cuda_model *cm, const model_kv_view *v, const uint32_t *write_row,
                          const uint32_t *len1) {
  model *m = &cm->base;
  cuda_u64x off;
  memset(&off, 0, sizeof off);
  for (uint32_t i = 0; i < v->n_contexts; ++i)
    off.v[i] = i * v->context_stride + (uint64_t)write_row[i] * v->row_stride;
  if (m->opt.kv_dtype == AKV_DTYPE_FP8_E4M3) { /* quantized on write, after RoPE */
    cuda_inv_scales inv;
    memset(&inv, 0, sizeof inv);
    for (uint32_t h = 0; h < m->g.kv_heads; ++h) {
      inv.k[h] = model_kv_inv_scale(cm->cur_l, h, 0);
      inv.v[h] = model_kv_inv_scale(cm->cur_l, h, 1);
    }
    k_write_rows_fp8<<<v->n_contexts, 256, 0, cm->stream>>>(
        (uint8_t *)v->base, off, v->v_offset, cm->k_new, cm->v_new, (uint32_t)cm->kv_dim,
        m->g.head_dim, inv);
  } else {
    k_write_rows<<<v->n_contexts, 128, 0, cm->stream>>>((uint8_t *)v->base, off, v->v_offset,
                                                       cm->k_new, cm->v_new,
                                                       (uint32_t)cm->row_bytes);
  }
  CM_LAUNCHED();

  float ks[AKV_ATTENTION_MAX_SCALE_HEADS], vs[AKV_ATTENTION_MAX_SCALE_HEADS];
  akv_attention_args a = model_attention_args(m, cm->cur_l, v, len1, cm->q, cm->attn,
                                              cm->workspace, cm->workspace_bytes, ks, vs);
  akv_status st = akv_attention_decode_cuda(&a, cm->stream);
  if (st != AKV_OK) {
    snprintf(m->error, sizeof m->error, "attend: akv_attention_decode_cuda failed: %s",
             akv_status_string(st));
    return -1;
  }
  cm->attended = 1;
  return 0;
}

static int cm_attend(model *m, uint32_t layer, const model_kv_view *v) {
  cuda_model *cm = cm_of(m);
  uint32_t len1[MODEL_MAX_BATCH];
  if (model_attend_check(m, cm->layer, cm->n_ctx, cm->row_bytes, cm->pos, layer, v, len1) != 0)
    return -1;
  return cm_attend_rows(cm, v, v->len, len1); /* the new row goes after the history */
}

static int cm_resident_reserve(model *m, uint32_t n_ctx, uint32_t max_tokens) {
  cuda_model *cm = cm_of(m);
  if (cm->resident != NULL || n_ctx == 0 || n_ctx > m->opt.max_batch || max_tokens == 0) {
    snprintf(m->error, sizeof m->error, "resident_reserve: reserved already or bad size (%u x %u)",
             n_ctx, max_tokens);
    return -1;
  }
  uint64_t bytes = (uint64_t)model_dense_layers(&m->g) * n_ctx * 2 * max_tokens * cm->row_bytes;
  void *p = NULL;
  cudaError_t e = cudaMalloc(&p, bytes);
  if (e != cudaSuccess) {
    snprintf(m->error, sizeof m->error,
             "resident K/V store of %.2f GiB: %s; lower --contexts or --tokens", bytes / 1073741824.0,
             cudaGetErrorString(e));
    return -1;
  }
  cm->resident = (uint8_t *)p;
  cm->res_ctx = n_ctx;
  cm->res_max_tokens = max_tokens;
  CM_CHECK(cudaMemsetAsync(cm->resident, 0, bytes, cm->stream));
  CM_CHECK(cudaStreamSynchronize(cm->stream));
  return 0;
}

/* Context ctx's K rows of dense layer d (the engine's index). */
static uint8_t *cm_resident_k(const cuda_model *cm, uint32_t d, uint32_t ctx) {
  uint64_t seg = (uint64_t)cm->res_max_tokens * cm->row_bytes;
  return cm->resident + ((uint64_t)d * cm->res_ctx + ctx) * 2 * seg;
}

static int cm_resident_append(model *m, uint32_t ctx, uint32_t first, uint32_t n_tokens,
                              const void *const *k_rows, const void *const *v_rows) {
  cuda_model *cm = cm_of(m);
  if (cm->resident == NULL || ctx >= cm->res_ctx || first > cm->res_max_tokens ||
      n_tokens > cm->res_max_tokens - first) {
    snprintf(m->error, sizeof m->error,
             "resident_append: rows %u..%u of context %u do not fit the store", first,
             first + n_tokens, ctx);
    return -1;
  }
  uint64_t seg = (uint64_t)cm->res_max_tokens * cm->row_bytes;
  size_t bytes = (size_t)n_tokens * cm->row_bytes;
  for (uint32_t d = 0; d < model_dense_layers(&m->g); ++d) {
    uint8_t *k = cm_resident_k(cm, d, ctx) + (uint64_t)first * cm->row_bytes;
    CM_CHECK(cudaMemcpyAsync(k, k_rows[d], bytes, cudaMemcpyHostToDevice, cm->stream));
    CM_CHECK(cudaMemcpyAsync(k + seg, v_rows[d], bytes, cudaMemcpyHostToDevice, cm->stream));
  }
  CM_CHECK(cudaStreamSynchronize(cm->stream));
  return 0;
}

static int cm_resident_view(model *m, uint32_t layer, const uint32_t *len, uint32_t n_ctx,
                            model_kv_view *out) {
  cuda_model *cm = cm_of(m);
  if (model_resident_view_fill(m, cm->resident != NULL, cm->res_ctx, cm->res_max_tokens,
                               cm->row_bytes, layer, len, n_ctx, out) != 0)
    return -1;
  out->base = cm_resident_k(cm, model_dense_before(&m->g, layer), 0);
  return 0;
}

/* Context ctx's K rows of sliding layer `layer` (the model's index) in `lane`. */
static uint8_t *cm_window_k(const cuda_model *cm, uint32_t lane, uint32_t layer, uint32_t ctx) {
  return cm->window + model_window_offset(&cm->base, lane, layer, ctx, cm->win_ctx, cm->row_bytes);
}

static int cm_window_reserve(model *m, uint32_t lanes, uint32_t n_ctx) {
  cuda_model *cm = cm_of(m);
  if (model_window_reserve_check(m, cm->window != NULL, lanes, n_ctx) != 0) return -1;
  uint64_t bytes = model_window_bytes(m, lanes, n_ctx, cm->row_bytes);
  void *p = NULL;
  cudaError_t e = cudaMalloc(&p, bytes);
  if (e != cudaSuccess) {
    snprintf(m->error, sizeof m->error,
             "sliding-window rows of %.2f GiB: %s; lower --contexts or --window",
             bytes / 1073741824.0, cudaGetErrorString(e));
    return -1;
  }
  cm->window = (uint8_t *)p;
  cm->win_lanes = lanes;
  cm->win_ctx = n_ctx;
  CM_CHECK(cudaMemsetAsync(cm->window, 0, bytes, cm->stream));
  CM_CHECK(cudaStreamSynchronize(cm->stream));
  return 0;
}

static int cm_window_append(model *m, uint32_t lane, uint32_t ctx, uint32_t first,
                            uint32_t n_tokens, const void *const *k_rows,
                            const void *const *v_rows) {
  cuda_model *cm = cm_of(m);
  if (model_window_append_check(m, cm->window != NULL, cm->win_lanes, cm->win_ctx, lane, ctx,
                                first, n_tokens) != 0)
    return -1;
  const uint64_t seg = (uint64_t)model_window_rows(m) * cm->row_bytes;
  const uint32_t W = m->g.window;
  for (uint32_t l = 0, w = 0; l < m->g.n_layers; ++l) {
    if (model_layer_dense(&m->g, l)) continue;
    uint8_t *k = cm_window_k(cm, lane, l, ctx);
    /* token t at row t % W: at most two contiguous runs per pass of W tokens */
    for (uint32_t t = 0; t < n_tokens;) {
      const uint32_t row = (first + t) % W, run = n_tokens - t < W - row ? n_tokens - t : W - row;
      const size_t bytes = (size_t)run * cm->row_bytes;
      const uint64_t src = (uint64_t)t * cm->row_bytes, dst = (uint64_t)row * cm->row_bytes;
      CM_CHECK(cudaMemcpyAsync(k + dst, (const uint8_t *)k_rows[w] + src, bytes,
                               cudaMemcpyHostToDevice, cm->stream));
      CM_CHECK(cudaMemcpyAsync(k + seg + dst, (const uint8_t *)v_rows[w] + src, bytes,
                               cudaMemcpyHostToDevice, cm->stream));
      t += run;
    }
    ++w;
  }
  CM_CHECK(cudaStreamSynchronize(cm->stream));
  return 0;
}

static void cm_memory(model *m, model_memory *out) {
  cuda_model *cm = cm_of(m);
  memset(out, 0, sizeof *out);
  out->weights = cm->weight_bytes;
  out->scratch = cm->scratch_bytes + cm->workspace_bytes;
  if (cm->resident)
    out->resident =
        (uint64_t)model_dense_layers(&m->g) * cm->res_ctx * 2 * cm->res_max_tokens * cm->row_bytes;
  if (cm->window) out->window = model_window_bytes(m, cm->win_lanes, cm->win_ctx, cm->row_bytes);
  size_t fr = 0, total = 0;
  if (cudaMemGetInfo(&fr, &total) == cudaSuccess) out->device_used = total - fr;
}

static void cm_destroy(model *m) {
  cuda_model *cm = cm_of(m);
  if (cm == NULL) return;
  if (cm->stream) cudaStreamSynchronize(cm->stream);
  cudaFree(cm->resident);
  cudaFree(cm->window);
  cudaFree(cm->workspace);
  cudaFree(cm->scratch);
  cudaFree(cm->weights);
  cudaFree(cm->inv_freq);
  cudaFreeHost(cm->logits_h);
  if (cm->stream) cudaStreamDestroy(cm->stream);
  free(cm->layers);
  free(cm);
}

static const model_ops cm_ops = {
    "cuda",           cm_destroy,        cm_forward,       cm_attend,
    cm_resident_reserve, cm_resident_append, cm_resident_view, cm_window_reserve,
    cm_window_append,    cm_memory,
};

/* Carves aligned pieces out of one allocation (pass base NULL to size it). */
struct cm_carver {
  uint8_t *base;
  uint64_t used;
  template <typename T>
  T *take(uint64_t count) {
    uint64_t at = (used + 255) & ~(uint64_t)255;
    used = at + count * sizeof(T);
    return base ? reinterpret_cast<T *>(base + at) : nullptr;
  }
};

/* Lays out every weight tensor; with base set, also records the pointers. */
static uint64_t cm_layout_weights(cuda_model *cm, uint8_t *base) {
  const model_geometry *g = &cm->base.g;
  const uint64_t H = g->hidden, F = g->ffn;
  cm_carver c = {base, 0};
  cm->embed = c.take<uint16_t>((uint64_t)g->vocab * H);
  cm->lm_head = c.take<uint16_t>((uint64_t)g->vocab * H);
  cm->final_norm = c.take<uint16_t>(H);
  for (uint32_t l = 0; l < g->n_layers; ++l) {
    cuda_layer *L = &cm->layers[l];
    L->attn_norm = c.take<uint16_t>(H);
    L->wqkv = c.take<uint16_t>((uint64_t)cm->qkv_dim * H);
    L->wo = c.take<uint16_t>(H * cm->q_dim);
    L->mlp_norm = c.take<uint16_t>(H);
    L->wgateup = c.take<uint16_t>(2 * F * H);
    L->wdown = c.take<uint16_t>(H * F);
  }
  return c.used;
}

static uint64_t cm_layout_scratch(cuda_model *cm, uint8_t *base) {
  const model_geometry *g = &cm->base.g;
  const uint64_t B = cm->base.opt.max_batch;
  cm_carver c = {base, 0};
  cm->x = c.take<float>(B * g->hidden);
  cm->xin = c.take<uint16_t>(B * cm->widest);
  cm->qkv = c.take<float>(B * cm->qkv_dim);
  cm->gateup = c.take<float>(B * 2 * (uint64_t)g->ffn);
  cm->q = c.take<uint16_t>(B * cm->q_dim);
  cm->k_new = c.take<uint16_t>(B * cm->kv_dim);
  cm->v_new = c.take<uint16_t>(B * cm->kv_dim);
  cm->attn = c.take<float>(B * cm->q_dim);
  cm->logits_d = c.take<float>(B * g->vocab);
  cm->part = cm->base.opt.allreduce_dev ? c.take<float>(B * g->hidden) : nullptr;
  return c.used;
}

static int cm_fill(cuda_model *cm, uint16_t *dst, uint64_t count, uint32_t tensor,
                   uint32_t layer) {
  const model_geometry *g = &cm->base.g;
  uint64_t key = model_tensor_key(cm->base.opt.seed, tensor, layer);
  uint64_t blocks = (count + 255) / 256;
  if (blocks > 65535u * 16u) blocks = 65535u * 16u;
  k_fill_weights<<<(unsigned)blocks, 256, 0, cm->stream>>>(dst, count, key,
                                                           model_tensor_unit(tensor, g),
                                                           model_tensor_offset(tensor));
  CM_LAUNCHED();
  return 0;
}

/*
 * Tensor parallel: a rows x cols shard of `tensor` (the full tensor has
 * full_cols columns; shard column k is full column col0 + k, shard rows map
 * through `map`), drawn with the full model's unit, so that every rank holds
 * the full model's bits at its shard's indices (model_cpu.c's
 * cpu_fill_shard, the same map).
 */
static int cm_fill_shard(cuda_model *cm, uint16_t *dst, uint64_t rows, uint64_t cols,
                         uint64_t full_cols, uint64_t col0, const cuda_row_map &map,
                         uint32_t tensor, uint32_t layer) {
  uint64_t key = model_tensor_key(cm->base.opt.seed, tensor, layer);
  uint64_t blocks = (rows * cols + 255) / 256;
  if (blocks > 65535u * 16u) blocks = 65535u * 16u;
  k_fill_shard<<<(unsigned)blocks, 256, 0, cm->stream>>>(
      dst, rows, cols, full_cols, col0, map, key, model_tensor_unit(tensor, &cm->full_g),
      model_tensor_offset(tensor));
  CM_LAUNCHED();
  return 0;
}

/* The shard's projections of layer l: its Q rows, then its K rows, then its
 * V rows of Wqkv; its Wo columns; its gate rows, then its up rows; its
 * Wdown columns. */
static int cm_fill_layer_shard(cuda_model *cm, const cuda_layer *L, uint32_t l) {
  const model_geometry *g = &cm->base.g;
  const uint64_t H = g->hidden, F = g->ffn, tp = cm->tp, r = cm->base.opt.tp_rank;
  const uint64_t q = cm->q_dim, kv = cm->kv_dim;
  cuda_row_map qkv, ident, gateup;
  memset(&qkv, 0, sizeof qkv);
  memset(&ident, 0, sizeof ident);
  memset(&gateup, 0, sizeof gateup);
  /* full Wqkv rows: tp*q Q rows, then tp*kv K rows, then tp*kv V rows */
  qkv.n = 3;
  qkv.start[1] = q;
  qkv.start[2] = q + kv;
  qkv.start[3] = q + 2 * kv;
  qkv.full0[0] = r * q;
  qkv.full0[1] = tp * q + r * kv;
  qkv.full0[2] = tp * q + tp * kv + r * kv;
  ident.n = 1;
  ident.start[1] = H;
  /* full Wgate|up rows: tp*F gate rows, then tp*F up rows */
  gateup.n = 2;
  gateup.start[1] = F;
  gateup.start[2] = 2 * F;
  gateup.full0[0] = r * F;
  gateup.full0[1] = tp * F + r * F;
  return cm_fill_shard(cm, L->wqkv, cm->qkv_dim, H, H, 0, qkv, MODEL_T_WQKV, l) ||
         cm_fill_shard(cm, L->wo, H, q, q * tp, r * q, ident, MODEL_T_WO, l) ||
         cm_fill_shard(cm, L->wgateup, 2 * F, H, H, 0, gateup, MODEL_T_WGATEUP, l) ||
         cm_fill_shard(cm, L->wdown, H, F, F * tp, r * F, ident, MODEL_T_WDOWN, l);
}

static int cm_setup(cuda_model *cm) {
  const model_geometry *g = &cm->base.g;
  const uint64_t H = g->hidden, F = g->ffn;
  CM_CHECK(cudaSetDevice(cm->base.opt.device));
  CM_CHECK(cudaStreamCreateWithFlags(&cm->stream, cudaStreamNonBlocking));
  cm->base.stream = cm->stream;

  uint64_t wb = cm_layout_weights(cm, NULL);
  void *p = NULL;
  cudaError_t e = cudaMalloc(&p, wb);
  if (e != cudaSuccess) {
    snprintf(cm->base.error, sizeof cm->base.error,
             "%.2f GiB of weights: %s; shrink the geometry (--layers/--hidden/--ffn/--vocab)",
             wb / 1073741824.0, cudaGetErrorString(e));
    return -1;
  }
  cm->weights = (uint8_t *)p;
  cm->weight_bytes = wb;
  cm_layout_weights(cm, cm->weights);
  if (cm_fill(cm, cm->embed, (uint64_t)g->vocab * H, MODEL_T_EMBED, 0)) return -1;
  if (cm_fill(cm, cm->lm_head, (uint64_t)g->vocab * H, MODEL_T_LM_HEAD, 0)) return -1;
  if (cm_fill(cm, cm->final_norm, H, MODEL_T_FINAL_NORM, 0)) return -1;
  for (uint32_t l = 0; l < g->n_layers; ++l) {
    cuda_layer *L = &cm->layers[l];
    if (cm->tp > 1) {
      if (cm_fill(cm, L->attn_norm, H, MODEL_T_ATTN_NORM, l) ||
          cm_fill(cm, L->mlp_norm, H, MODEL_T_MLP_NORM, l) || cm_fill_layer_shard(cm, L, l))
        return -1;
      continue;
    }
    if (cm_fill(cm, L->attn_norm, H, MODEL_T_ATTN_NORM, l) ||
        cm_fill(cm, L->wqkv, (uint64_t)cm->qkv_dim * H, MODEL_T_WQKV, l) ||
        cm_fill(cm, L->wo, H * cm->q_dim, MODEL_T_WO, l) ||
        cm_fill(cm, L->mlp_norm, H, MODEL_T_MLP_NORM, l) ||
        cm_fill(cm, L->wgateup, 2 * F * H, MODEL_T_WGATEUP, l) ||
        cm_fill(cm, L->wdown, H * F, MODEL_T_WDOWN, l))
      return -1;
  }

  uint64_t sb = cm_layout_scratch(cm, NULL);
  CM_CHECK(cudaMalloc(&p, sb));
  cm->scratch = (uint8_t *)p;
  cm->scratch_bytes = sb;
  cm_layout_scratch(cm, cm->scratch);
  CM_CHECK(cudaMemsetAsync(cm->scratch, 0, sb, cm->stream));
  CM_CHECK(cudaMallocHost(&p, (size_t)cm->base.opt.max_batch * g->vocab * sizeof(float)));
  cm->logits_h = (float *)p;

  uint32_t half = g->head_dim / 2;
  double *inv = (double *)malloc(half * sizeof(double));
  if (inv == NULL) {
    snprintf(cm->base.error, sizeof cm->base.error, "out of host memory");
    return -1;
  }
  for (uint32_t j = 0; j < half; ++j)
    inv[j] = pow((double)g->rope_theta, -2.0 * j / (double)g->head_dim);
  e = cudaMalloc(&p, half * sizeof(double));
  if (e == cudaSuccess) {
    cm->inv_freq = (double *)p;
    e = cudaMemcpy(cm->inv_freq, inv, half * sizeof(double), cudaMemcpyHostToDevice);
  }
  free(inv);
  CM_CHECK(e);

  if (akv_attention_workspace_bytes(cm->base.opt.max_batch, g->n_heads, g->head_dim,
                                    cm->base.opt.max_tokens, cm->base.opt.chunk_tokens,
                                    &cm->workspace_bytes) != AKV_OK) {
    snprintf(cm->base.error, sizeof cm->base.error,
             "attention workspace: bad sizes (head_dim %u, max tokens %u, chunk %u)", g->head_dim,
             cm->base.opt.max_tokens, cm->base.opt.chunk_tokens);
    return -1;
  }
  if (cm->workspace_bytes) {
    CM_CHECK(cudaMalloc(&p, cm->workspace_bytes));
    cm->workspace = p;
  }
  CM_CHECK(cudaStreamSynchronize(cm->stream));
  return 0;
}

extern "C" int model_cuda_available(void) {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

extern "C" int model_cuda_device_count(char *why, size_t cap) {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (why != NULL && cap > 0)
    snprintf(why, cap, "%s", e == cudaSuccess ? "" : cudaGetErrorString(e));
  return e == cudaSuccess ? n : 0;
}

extern "C" int model_cuda_create(const model_geometry *g, const model_options *opt, model **out,
                                 char *err, size_t cap) {
  if (g == NULL || opt == NULL || out == NULL) {
    snprintf(err, cap, "model_cuda_create: NULL argument");
    return -1;
  }
  if (g->n_layers == 0 || g->n_heads == 0 || g->kv_heads == 0 || g->n_heads % g->kv_heads ||
      g->head_dim == 0 || g->head_dim % 8 || g->hidden == 0 || g->hidden % 8 || g->ffn == 0 ||
      g->ffn % 8 || g->vocab == 0 || opt->max_batch == 0 || opt->max_batch > MODEL_MAX_BATCH ||
      opt->max_tokens == 0 || opt->chunk_tokens == 0) {
    snprintf(err, cap,
             "geometry: layers, heads, kv heads, head_dim, hidden, ffn and vocab must be > 0, "
             "heads a multiple of kv heads, head_dim/hidden/ffn multiples of 8, batch 1..%d",
             MODEL_MAX_BATCH);
    return -1;
  }
  if (model_hybrid_check(g, err, cap) != 0) return -1;
  if (model_kv_dtype_check(opt->kv_dtype, g->kv_heads, err, cap) != 0) return -1;
  if (g->head_dim != 64 && g->head_dim != 128 && g->head_dim != 256) {
    snprintf(err, cap, "--head-dim %u: the CUDA attention kernels take 64, 128 or 256",
             g->head_dim);
    return -1;
  }
  const uint32_t tp = opt->tp_size > 1 ? opt->tp_size : 1;
  if (opt->tp_rank >= tp || (tp > 1 && (opt->kv_dtype != AKV_DTYPE_BF16 ||
                                        opt->allreduce_dev == NULL))) {
    snprintf(err, cap, "tensor parallel: rank %u of %u (bf16 K/V only, with allreduce_dev)",
             opt->tp_rank, tp);
    return -1;
  }
  cuda_model *cm = (cuda_model *)calloc(1, sizeof *cm);
  cuda_layer *layers = (cuda_layer *)calloc(g->n_layers, sizeof *layers);
  if (cm == NULL || layers == NULL) {
    free(cm);
    free(layers);
    snprintf(err, cap, "out of host memory");
    return -1;
  }
  cm->base.ops = &cm_ops;
  cm->base.g = *g;
  cm->base.opt = *opt;
  cm->full_g = *g; /* the full model's geometry: its fan-ins scale the weights */
  cm->full_g.n_heads *= tp;
  cm->full_g.kv_heads *= tp;
  cm->full_g.ffn *= tp;
  cm->tp = tp;
  cm->layers = layers;
  cm->layer = -1;
  cm->q_dim = g->n_heads * g->head_dim;
  cm->kv_dim = g->kv_heads * g->head_dim;
  cm->qkv_dim = cm->q_dim + 2 * cm->kv_dim;
  cm->widest = g->hidden;
  if (cm->q_dim > cm->widest) cm->widest = cm->q_dim;
  if (g->ffn > cm->widest) cm->widest = g->ffn;
  cm->row_bytes = (uint64_t)cm->kv_dim * model_kv_elem_bytes(opt->kv_dtype);
  if (cm_setup(cm) != 0) {
    snprintf(err, cap, "%s", cm->base.error);
    cm_destroy(&cm->base);
    return -1;
  }
  *out = &cm->base;
  return 0;
}
