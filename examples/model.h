/*
 * model.h - the synthetic transformer the activekv CLI decodes with.
 *
 * A decoder of a real geometry with random weights drawn from a seed:
 * embedding, then per layer RMSNorm, fused Q/K/V projection, RoPE, GQA
 * attention, output projection with residual, RMSNorm, SwiGLU MLP with
 * residual; then a final RMSNorm and the LM head producing fp32 logits.
 *
 * Layers are dense (attention over the whole history, done by the caller
 * through a per-layer callback: that is what the engine stages) or, in a
 * hybrid geometry, sliding-window layers (attention over the last `window`
 * tokens, done by the model itself over a small ring of rows it keeps
 * resident: those are never staged).
 *
 * Two implementations share this interface: model_cpu.c (fp32 math on
 * bf16-rounded weights, small geometries, no GPU) and model_cuda.cu (bf16
 * weights generated on the device, GEMVs on bf16 tensor cores). Both are deterministic:
 * every reduction has a fixed order, so the same inputs give the same logits
 * bit for bit, run after run. Both draw identical bf16 weights from a seed.
 *
 * K/V dtype (model_options.kv_dtype): bf16 rows, or FP8 E4M3 rows. With FP8
 * the model quantizes each new K/V row on write (after RoPE, from its bf16
 * value) with fixed per-(layer, KV head) scales (model_kv_scale), as a
 * serving stack with calibrated scales does, and passes the layer's scales
 * with every attention call; the synthetic prefilled history is the bf16
 * history quantized the same way (model_quantize_row). Both models quantize
 * with the same code (model_f32_to_e4m3), so host and device agree bit for
 * bit.
 *
 * The model never touches the engine. Attention over a layer's history goes
 * through model_attend(m, layer, view): it writes each context's new K/V row
 * (this step's projection, after RoPE) at row len[i] of the view and attends
 * over len[i]+1 rows with the library's reference attention function (the C
 * one on the CPU, the CUDA launcher on the GPU). The view is either the
 * engine's staged layer or the model's own resident store (model_resident_*),
 * which is what makes the resident route a bit-exact reference: same function,
 * same chunk size, same K/V bytes.
 *
 * Not thread-safe. Errors: functions returning int give 0 on success and -1 on
 * failure, with the reason in model_error(m).
 */
#ifndef ACTIVEKV_EXAMPLE_MODEL_H
#define ACTIVEKV_EXAMPLE_MODEL_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "akv_attention.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Shared helpers compile for host and device alike. */
#if defined(__CUDACC__)
#define MODEL_FN static __host__ __device__ __forceinline__
#else
#define MODEL_FN static inline
#endif

/* Batch limit of one forward call (contexts decoded together). */
#define MODEL_MAX_BATCH 64

/* Largest parameter count the CPU model accepts: 2^28 parameters, 1 GiB of
 * fp32 weights (268.44 M, counted in decimal like every parameter count the
 * CLI prints). */
#define MODEL_CPU_MAX_PARAMS ((uint64_t)256 << 20)

typedef struct model_geometry {
  uint32_t n_layers; /* every layer, dense and sliding-window */
  uint32_t n_heads;  /* query heads */
  uint32_t kv_heads; /* K/V heads; n_heads % kv_heads == 0 (GQA) */
  uint32_t head_dim; /* multiple of 8; CUDA attention: 64, 128 or 256 */
  uint32_t hidden;   /* multiple of 8 */
  uint32_t ffn;      /* multiple of 8 */
  uint32_t vocab;
  float rope_theta;
  float norm_eps;
  /* Hybrid geometries: with window > 0 and dense_every >= 2, layer l is dense
   * when l % dense_every == dense_every - 1 and a sliding-window layer over
   * the last `window` tokens (the new one included) otherwise; e.g.
   * dense_every 6 gives five sliding layers, then one dense. window 0: every
   * layer is dense. */
  uint32_t window;
  uint32_t dense_every;
} model_geometry;

/* 1 when the geometry has sliding-window layers. */
static inline int model_hybrid(const model_geometry *g) {
  return g->window > 0 && g->dense_every >= 2;
}
static inline int model_layer_dense(const model_geometry *g, uint32_t l) {
  return !model_hybrid(g) || l % g->dense_every == g->dense_every - 1;
}
/* Dense layers before layer l (the engine's layer index of a dense l). */
static inline uint32_t model_dense_before(const model_geometry *g, uint32_t l) {
  return model_hybrid(g) ? l / g->dense_every : l;
}
static inline uint32_t model_dense_layers(const model_geometry *g) {
  return model_dense_before(g, g->n_layers);
}
static inline uint32_t model_window_layers(const model_geometry *g) {
  return g->n_layers - model_dense_layers(g);
}
/* The model layer of dense layer d (d < model_dense_layers). */
static inline uint32_t model_dense_layer(const model_geometry *g, uint32_t d) {
  return model_hybrid(g) ? d * g->dense_every + g->dense_every - 1 : d;
}
/* A geometry's hybrid fields are usable: 0, or a message in err and -1. */
static inline int model_hybrid_check(const model_geometry *g, char *err, size_t cap) {
  if (g->window > 0 && g->dense_every < 2) {
    snprintf(err, cap, "--window %u needs --dense-every of at least 2 (1 makes every layer dense)",
             g->window);
    return -1;
  }
  if (model_hybrid(g) && g->dense_every > g->n_layers) {
    snprintf(err, cap,
             "--dense-every %u leaves no dense layer in %u layers; lower --dense-every or raise "
             "--layers",
             g->dense_every, g->n_layers);
    return -1;
  }
  return 0;
}

typedef struct model_options {
  uint64_t seed;         /* weights and nothing else */
  uint32_t max_batch;    /* most contexts per forward, <= MODEL_MAX_BATCH */
  uint32_t chunk_tokens; /* attention chunk size, passed to the attention function */
  uint32_t max_tokens;   /* longest history attended (rows, new one included): sizes the
                            attention workspace */
  int device;            /* CUDA device ordinal (CUDA model only) */
  akv_dtype kv_dtype;    /* AKV_DTYPE_BF16 (0) or AKV_DTYPE_FP8_E4M3 */
  /*
   * Tensor parallel (Megatron-style): with tp_size >= 2 the geometry given
   * to the creator is rank tp_rank's shard (n_heads, kv_heads and ffn
   * already divided by tp_size); the rank draws the full model's weights at
   * its shard's indices (its Q/K/V heads and their Wo columns, its gate/up
   * rows and their Wdown columns; norms, embedding and LM head whole) and
   * sums its partial outputs over the ranks after the attention output
   * projection and after the MLP, through the all-reduce of its kind:
   *  - CPU model: allreduce(allreduce_user, v, n), v a host array;
   *  - CUDA model: allreduce_dev(allreduce_user, v, n, stream), v a device
   *    array of the model's device and `stream` the model's cudaStream_t:
   *    the sum is enqueued on `stream` (in place) and the model reads v
   *    after it on that stream; the call returns once it is enqueued.
   * v[0..n) must come back as the sum over ranks, the same bits on every
   * rank and in the same order for every call of a run (the staged and the
   * resident forwards of a --check compare bit for bit). The callback
   * returns 0, or nonzero to fail the forward. tp_size 0 or 1: unsharded, no
   * reduction needed (the callback may still be set: it is called, with one
   * rank, and a sum over one rank leaves v as it is, so the logits are those
   * of an unsharded model).
   */
  uint32_t tp_rank, tp_size;
  int (*allreduce)(void *user, float *v, uint64_t n);
  int (*allreduce_dev)(void *user, float *v, uint64_t n, void *stream);
  void *allreduce_user;
} model_options;

/* Bytes of one K/V element of a model's rows. */
static inline uint32_t model_kv_elem_bytes(akv_dtype dt) { return dt == AKV_DTYPE_FP8_E4M3 ? 1u : 2u; }
/* 0 when the model takes this K/V dtype and geometry, else -1 with err set. */
static inline int model_kv_dtype_check(akv_dtype dt, uint32_t kv_heads, char *err, size_t cap) {
  if (dt != AKV_DTYPE_BF16 && dt != AKV_DTYPE_FP8_E4M3) {
    snprintf(err, cap, "K/V dtype %d: the model stores bf16 or FP8 E4M3 rows", (int)dt);
    return -1;
  }
  if (dt == AKV_DTYPE_FP8_E4M3 && kv_heads > AKV_ATTENTION_MAX_SCALE_HEADS) {
    snprintf(err, cap, "FP8 K/V takes at most %u kv heads (one scale each), not %u",
             AKV_ATTENTION_MAX_SCALE_HEADS, kv_heads);
    return -1;
  }
  return 0;
}

/* Memory the model holds, in bytes. On the CPU model "device" means host. */
typedef struct model_memory {
  uint64_t weights;
  uint64_t scratch;  /* activations, attention workspace, logits */
  uint64_t resident; /* the resident K/V store of the dense layers (0 until reserved) */
  uint64_t window;   /* the sliding-window rows, every lane (0 until reserved) */
  uint64_t device_used; /* CUDA: total - free on the device now (every process); CPU: 0 */
} model_memory;

/*
 * A layer's K/V history as the attention function reads it: the library's
 * own akv_view, whether the engine staged it or the model's resident store
 * holds it (then page_map is NULL). Context i's row t has its K at
 * base + i*context_stride + t*row_stride and its V at that address +
 * v_offset (a row: kv_heads * head_dim bf16); with page_map set (the
 * engine's paged route) full pages are read in place instead. len[i] rows
 * are already there (a host array); model_attend writes row len[i] and
 * attends over len[i]+1.
 */
typedef akv_view model_kv_view;

typedef struct model model;

/*
 * Called by model_forward once per dense layer (`layer` is the model's layer
 * index; sliding-window layers never reach it), after the layer's Q/K/V projections
 * and RoPE are computed (on the model's stream for CUDA). Before it returns,
 * model_attend(m, layer, view) must have run on a view of the layer's history
 * (CPU: completed, possibly on another thread; CUDA: enqueued, which
 * model_attend does on the model's stream). Return 0, or nonzero to stop the
 * forward with an error.
 */
typedef int (*model_layer_fn)(void *user, model *m, uint32_t layer);

typedef struct model_ops {
  const char *name;
  void (*destroy)(model *m);
  int (*forward)(model *m, uint32_t lane, uint32_t n_ctx, const int32_t *tokens,
                 const uint32_t *pos, model_layer_fn fn, void *user, float *logits);
  int (*attend)(model *m, uint32_t layer, const model_kv_view *view);
  int (*resident_reserve)(model *m, uint32_t n_ctx, uint32_t max_tokens);
  int (*resident_append)(model *m, uint32_t ctx, uint32_t first, uint32_t n_tokens,
                         const void *const *k_rows, const void *const *v_rows);
  int (*resident_view)(model *m, uint32_t layer, const uint32_t *len, uint32_t n_ctx,
                       model_kv_view *out);
  int (*window_reserve)(model *m, uint32_t lanes, uint32_t n_ctx);
  int (*window_append)(model *m, uint32_t lane, uint32_t ctx, uint32_t first, uint32_t n_tokens,
                       const void *const *k_rows, const void *const *v_rows);
  void (*memory)(model *m, model_memory *out);
} model_ops;

/* The common head of every implementation's model body. */
struct model {
  const model_ops *ops;
  model_geometry g;
  model_options opt;
  void *stream; /* CUDA: the cudaStream_t the model computes on; CPU: NULL */
  char error[256];
};

/* Creators. On failure *out is untouched, err names the reason, -1. */
int model_cpu_create(const model_geometry *g, const model_options *opt, model **out, char *err,
                     size_t cap);
/* Defined only in builds with CUDA (model_cuda.cu). */
int model_cuda_create(const model_geometry *g, const model_options *opt, model **out, char *err,
                      size_t cap);
/* 1 when a CUDA device can be used, else 0 (CUDA builds only). */
int model_cuda_available(void);
/* CUDA devices visible to this process (0 when none or no driver); with
 * why != NULL, the runtime's reason when it could not count them ("" else).
 * CUDA builds only. */
int model_cuda_device_count(char *why, size_t cap);

static inline void model_destroy(model *m) {
  if (m) m->ops->destroy(m);
}
static inline const char *model_error(const model *m) { return m->error; }
/* CUDA: the model's cudaStream_t (cast it to akv_stream); CPU: NULL. */
static inline void *model_stream(const model *m) { return m->stream; }

/*
 * One decode step for n_ctx contexts: tokens[i] is context i's input token,
 * pos[i] its position (= rows of history already held). Calls fn(user, m, l)
 * for each dense layer l in order, attends the sliding-window layers itself
 * over window lane `lane` (see model_window_reserve), then writes fp32
 * logits to the host array logits[n_ctx][vocab]. Returns when the logits are
 * on the host. Without sliding-window layers `lane` is not used.
 */
static inline int model_forward(model *m, uint32_t lane, uint32_t n_ctx, const int32_t *tokens,
                                const uint32_t *pos, model_layer_fn fn, void *user,
                                float *logits) {
  return m->ops->forward(m, lane, n_ctx, tokens, pos, fn, user, logits);
}

/*
 * The attention of `layer` in the current forward over `view` (see
 * model_kv_view). CPU: runs now, on the calling thread (which may be a queue
 * worker; nothing else may use the model meanwhile). CUDA: enqueued on the
 * model's stream; `view` may be discarded when this returns.
 */
static inline int model_attend(model *m, uint32_t layer, const model_kv_view *view) {
  return m->ops->attend(m, layer, view);
}

/* Allocates the resident K/V store of the dense layers: n_ctx contexts of
 * max_tokens rows, zeroed. Call once. */
static inline int model_resident_reserve(model *m, uint32_t n_ctx, uint32_t max_tokens) {
  return m->ops->resident_reserve(m, n_ctx, max_tokens);
}
/* Copies n_tokens prefilled rows of every dense layer (k_rows[d], v_rows[d]
 * for dense layer d, host, token-major: the arrays akv_context_append takes)
 * to rows [first, first+n_tokens) of context ctx. Synchronous. */
static inline int model_resident_append(model *m, uint32_t ctx, uint32_t first,
                                        uint32_t n_tokens, const void *const *k_rows,
                                        const void *const *v_rows) {
  return m->ops->resident_append(m, ctx, first, n_tokens, k_rows, v_rows);
}
/* The resident store of dense layer `layer` (the model's index) for contexts
 * 0..n_ctx-1 holding len[i] rows; `len` must stay valid while the view is used. */
static inline int model_resident_view(model *m, uint32_t layer, const uint32_t *len,
                                      uint32_t n_ctx, model_kv_view *out) {
  return m->ops->resident_view(m, layer, len, n_ctx, out);
}
/*
 * Hybrid geometries: allocates `lanes` independent sets of sliding-window
 * rows for n_ctx contexts, zeroed. A forward reads and writes one lane, so a
 * checked run and its resident reference each keep their own. Each set holds
 * min(window, max_tokens) rows per context and sliding layer; token t lives
 * in row t % window. Call once; an error without sliding-window layers.
 */
static inline int model_window_reserve(model *m, uint32_t lanes, uint32_t n_ctx) {
  return m->ops->window_reserve(m, lanes, n_ctx);
}
/* Writes tokens [first, first+n_tokens) of every sliding layer (k_rows[w],
 * v_rows[w] for the w-th sliding layer, host, token-major) into lane `lane`
 * of context ctx, token t at row t % window (later tokens overwrite earlier
 * ones: pass the last window - 1 tokens of a history). Synchronous. */
static inline int model_window_append(model *m, uint32_t lane, uint32_t ctx, uint32_t first,
                                      uint32_t n_tokens, const void *const *k_rows,
                                      const void *const *v_rows) {
  return m->ops->window_append(m, lane, ctx, first, n_tokens, k_rows, v_rows);
}
static inline void model_memory_get(model *m, model_memory *out) { m->ops->memory(m, out); }

/* For the implementations of attend: checks that `layer` is the layer in
 * progress (cur_layer, -1 when none), that the view matches the forward's
 * n_ctx contexts of row_bytes rows (rows at least that far apart, a paged
 * view paged at the model's chunk size) and that context i holds pos[i] rows
 * with room for one more in the workspace; fills len1[i] = pos[i] + 1, the
 * rows attention covers. Returns 0 or -1 with m->error set. */
static inline int model_attend_check(model *m, int cur_layer, uint32_t n_ctx, uint64_t row_bytes,
                                     const uint32_t *pos, uint32_t layer, const model_kv_view *v,
                                     uint32_t *len1) {
  if (cur_layer < 0 || (uint32_t)cur_layer != layer) {
    snprintf(m->error, sizeof m->error, "attend: layer %u is not the layer in progress", layer);
    return -1;
  }
  if (v == NULL || v->base == NULL || v->len == NULL || v->n_contexts != n_ctx ||
      v->row_stride < row_bytes || v->v_offset < row_bytes) {
    snprintf(m->error, sizeof m->error,
             "attend: the view does not match the forward (contexts %u vs %u, rows %llu B apart "
             "for %llu B rows)",
             v ? v->n_contexts : 0, n_ctx, v ? (unsigned long long)v->row_stride : 0ull,
             (unsigned long long)row_bytes);
    return -1;
  }
  if (v->page_map != NULL && v->page_tokens != m->opt.chunk_tokens) {
    snprintf(m->error, sizeof m->error,
             "attend: the view's pages hold %u rows, the model attends in chunks of %u (set "
             "--page-tokens and the chunk alike)",
             v->page_tokens, m->opt.chunk_tokens);
    return -1;
  }
  for (uint32_t i = 0; i < n_ctx; ++i) {
    if (v->len[i] != pos[i]) {
      snprintf(m->error, sizeof m->error,
               "attend: context %u holds %u rows but its token is at position %u", i, v->len[i],
               pos[i]);
      return -1;
    }
    if (v->len[i] + 1 > m->opt.max_tokens) {
      snprintf(m->error, sizeof m->error,
               "attend: context %u has %u rows, the attention workspace was sized for %u", i,
               v->len[i] + 1, m->opt.max_tokens);
      return -1;
    }
    len1[i] = v->len[i] + 1;
  }
  return 0;
}

/* For the implementations of attend: the attention arguments over `v` with
 * len1[i] = v->len[i] + 1 rows (the new row included), the model's query,
 * output and workspace. Both models call the library's kernels with exactly
 * these arguments, so staged and resident attention see the same call. */
static inline void model_layer_scales(const model *m, uint32_t layer, float *k_scale,
                                      float *v_scale);
/* FP8: the scales of model layer `layer` go to k_scale / v_scale (caller's
 * arrays of kv_heads, read by the attention call only) and into the
 * arguments; bf16: no scales. */
static inline akv_attention_args model_attention_args(const model *m, uint32_t layer,
                                                      const model_kv_view *v,
                                                      const uint32_t *len1, const void *q,
                                                      float *out, void *workspace,
                                                      size_t workspace_bytes, float *k_scale,
                                                      float *v_scale) {
  akv_attention_args a;
  memset(&a, 0, sizeof a);
  if (m->opt.kv_dtype == AKV_DTYPE_FP8_E4M3) {
    model_layer_scales(m, layer, k_scale, v_scale);
    a.k_scale = k_scale;
    a.v_scale = v_scale;
  }
  /* The view's layout and, on the paged route, its page map and page size
   * (model_attend_check made sure that equals the model's chunk). */
  a.chunk_tokens = m->opt.chunk_tokens;
  (void)akv_attention_args_from_view(v, &a); /* v is never NULL here */
  a.n_heads = m->g.n_heads;
  a.q = q;
  a.len = len1;
  a.scale = 1.0f / sqrtf((float)m->g.head_dim);
  a.out = out;
  a.workspace = workspace;
  a.workspace_bytes = workspace_bytes;
  return a;
}

/* A view over a store of `rows` rows per context (context i's K rows, then
 * its V rows, contexts one after another) with len[i] rows each and no page
 * map; every field but `layer` is set. */
static inline void model_store_view(const model *m, void *base, uint32_t rows,
                                    uint64_t row_bytes, uint32_t n_ctx, const uint32_t *len,
                                    model_kv_view *out) {
  memset(out, 0, sizeof *out);
  out->base = base;
  out->n_contexts = n_ctx;
  out->kv_heads = m->g.kv_heads;
  out->head_dim = m->g.head_dim;
  out->dtype = m->opt.kv_dtype;
  out->context_stride = 2 * (uint64_t)rows * row_bytes;
  out->v_offset = (uint64_t)rows * row_bytes;
  out->row_stride = row_bytes;
  out->len = len;
}

/* For the implementations of resident_view: checks the request against a
 * store of res_ctx contexts x res_max_tokens rows (have_store = the store
 * exists) and fills every field of *out but base. Returns 0 or -1 with
 * m->error set. */
static inline int model_resident_view_fill(model *m, int have_store, uint32_t res_ctx,
                                           uint32_t res_max_tokens, uint64_t row_bytes,
                                           uint32_t layer, const uint32_t *len, uint32_t n_ctx,
                                           model_kv_view *out) {
  if (!have_store || layer >= m->g.n_layers || !model_layer_dense(&m->g, layer) ||
      n_ctx > res_ctx) {
    snprintf(m->error, sizeof m->error,
             "resident_view: no store for layer %u x %u contexts (dense layers only)", layer,
             n_ctx);
    return -1;
  }
  for (uint32_t i = 0; i < n_ctx; ++i) {
    if (len[i] >= res_max_tokens) {
      snprintf(m->error, sizeof m->error, "resident_view: context %u is full (%u rows)", i,
               len[i]);
      return -1;
    }
  }
  model_store_view(m, NULL, res_max_tokens, row_bytes, n_ctx, len, out);
  out->layer = layer;
  return 0;
}

/* Rows per context and sliding layer in one window lane. */
static inline uint32_t model_window_rows(const model *m) {
  return m->g.window < m->opt.max_tokens ? m->g.window : m->opt.max_tokens;
}

/* Bytes of `lanes` window lanes for n_ctx contexts. */
static inline uint64_t model_window_bytes(const model *m, uint32_t lanes, uint32_t n_ctx,
                                          uint64_t row_bytes) {
  return (uint64_t)lanes * model_window_layers(&m->g) * n_ctx * 2 * model_window_rows(m) *
         row_bytes;
}

/* Byte offset, in window lanes of n_ctx contexts laid out
 * [lane][sliding layer][ctx][K|V][rows][row], of context ctx's K rows of
 * sliding layer `layer` (the model's index) in `lane`. */
static inline uint64_t model_window_offset(const model *m, uint32_t lane, uint32_t layer,
                                           uint32_t ctx, uint32_t n_ctx, uint64_t row_bytes) {
  const uint32_t w = layer - model_dense_before(&m->g, layer);
  const uint64_t seg = (uint64_t)model_window_rows(m) * row_bytes;
  return (((uint64_t)lane * model_window_layers(&m->g) + w) * n_ctx + ctx) * 2 * seg;
}

/* For the implementations of window_reserve: 0 when the request is usable
 * (sliding layers exist, nothing reserved yet, sizes in range), else -1
 * with m->error set. */
static inline int model_window_reserve_check(model *m, int reserved, uint32_t lanes,
                                             uint32_t n_ctx) {
  if (!model_hybrid(&m->g) || reserved || lanes == 0 || n_ctx == 0 ||
      n_ctx > m->opt.max_batch) {
    snprintf(m->error, sizeof m->error,
             "window_reserve: no sliding layers, reserved already or bad size (%u x %u)", lanes,
             n_ctx);
    return -1;
  }
  return 0;
}

/* For the implementations of window_append: checks the request against
 * `lanes` lanes of n_ctx contexts (have_store = reserved). 0, or -1 with
 * m->error set. */
static inline int model_window_append_check(model *m, int have_store, uint32_t lanes,
                                            uint32_t n_ctx, uint32_t lane, uint32_t ctx,
                                            uint32_t first, uint32_t n_tokens) {
  if (!have_store || lane >= lanes || ctx >= n_ctx ||
      (uint64_t)first + n_tokens > m->opt.max_tokens) {
    snprintf(m->error, sizeof m->error,
             "window_append: tokens %u..%u of context %u, lane %u: no such window rows", first,
             first + n_tokens, ctx, lane);
    return -1;
  }
  return 0;
}

/*
 * For the implementations of forward, at sliding-window layer `layer`: the
 * view over `lane` of the window rows `store` (lanes x store_ctx contexts,
 * NULL when not reserved), the row each context's new token goes to
 * (write_row[i] = pos[i] % window, replacing the token that just left the
 * window) and the rows attention covers (len1[i] = min(pos[i] + 1, window),
 * the new token included; also the view's len). 0, or -1 with m->error set.
 */
static inline int model_window_view(model *m, uint8_t *store, uint32_t lanes, uint32_t store_ctx,
                                    uint32_t lane, uint32_t layer, uint64_t row_bytes,
                                    uint32_t n_ctx, const uint32_t *pos, uint32_t *write_row,
                                    uint32_t *len1, model_kv_view *out) {
  const uint32_t rows = model_window_rows(m), w = m->g.window;
  if (store == NULL || lane >= lanes || n_ctx > store_ctx) {
    snprintf(m->error, sizeof m->error,
             "sliding layer %u: no window rows for lane %u x %u contexts (model_window_reserve)",
             layer, lane, n_ctx);
    return -1;
  }
  for (uint32_t i = 0; i < n_ctx; ++i) {
    write_row[i] = pos[i] % w;
    len1[i] = pos[i] + 1 < w ? pos[i] + 1 : w;
    if (write_row[i] >= rows || len1[i] > m->opt.max_tokens) {
      snprintf(m->error, sizeof m->error,
               "sliding layer: context %u at position %u is past the %u rows the model was sized for",
               i, pos[i], m->opt.max_tokens);
      return -1;
    }
  }
  model_store_view(m, store + model_window_offset(m, lane, layer, 0, store_ctx, row_bytes), rows,
                   row_bytes, n_ctx, len1, out);
  out->layer = layer;
  return 0;
}

/* ------------------------------------------------------------------------ */
/* Shared numerics: seeded values and bf16, identical on host and device     */
/* ------------------------------------------------------------------------ */

/* Tensor ids for the weight generator. */
enum {
  MODEL_T_EMBED = 1,
  MODEL_T_LM_HEAD = 2,
  MODEL_T_FINAL_NORM = 3,
  MODEL_T_ATTN_NORM = 4,
  MODEL_T_WQKV = 5,
  MODEL_T_WO = 6,
  MODEL_T_MLP_NORM = 7,
  MODEL_T_WGATEUP = 8,
  MODEL_T_WDOWN = 9
};

MODEL_FN uint64_t model_mix64(uint64_t x) {
  /* splitmix64 finaliser */
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

/* A per-tensor key: every (seed, tensor, layer) draws an independent stream. */
MODEL_FN uint64_t model_tensor_key(uint64_t seed, uint32_t tensor, uint32_t layer) {
  return model_mix64(seed ^ model_mix64(((uint64_t)tensor << 32) | layer));
}

/* A signed 24-bit integer in [-2^23, 2^23) for element `index` of a tensor.
 * Integers keep host and device bit-identical (no contraction, no rounding). */
MODEL_FN int32_t model_draw24(uint64_t key, uint64_t index) {
  return (int32_t)(model_mix64(key + index * 0xd1b54a32d192ed03ull) >> 40) - (1 << 23);
}

MODEL_FN uint16_t model_f32_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* quiet NaN */
  u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even */
  return (uint16_t)(u >> 16);
}

MODEL_FN float model_bf16_to_f32(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

/*
 * Weight `index` of a tensor as bf16: the 24-bit draw times `unit` (= scale *
 * 2^-23, so uniform in [-scale, scale)) plus `offset` (1 for norm weights),
 * one multiply and one add, each rounded, then rounded to bf16: the same bits
 * on the host and on the device.
 */
MODEL_FN uint16_t model_weight_bf16(uint64_t key, uint64_t index, float unit, float offset) {
#if defined(__CUDA_ARCH__)
  float v = __fadd_rn(__fmul_rn((float)model_draw24(key, index), unit), offset); /* no FMA */
#else
  float v = (float)model_draw24(key, index) * unit + offset; /* ISO C: not contracted */
#endif
  return model_f32_to_bf16(v);
}

/* Scale of a tensor's uniform draw: 1/sqrt(fan_in) for projections, 1 for
 * the embedding, 0.1 around 1 for norm weights. Host only. */
static inline float model_tensor_unit(uint32_t tensor, const model_geometry *g) {
  double scale = 1.0;
  switch (tensor) {
    case MODEL_T_EMBED: scale = 1.0; break;
    case MODEL_T_FINAL_NORM:
    case MODEL_T_ATTN_NORM:
    case MODEL_T_MLP_NORM: scale = 0.1; break;
    case MODEL_T_WQKV:
    case MODEL_T_WGATEUP:
    case MODEL_T_LM_HEAD: scale = 1.0 / sqrt((double)g->hidden); break;
    case MODEL_T_WO: scale = 1.0 / sqrt((double)g->n_heads * g->head_dim); break;
    case MODEL_T_WDOWN: scale = 1.0 / sqrt((double)g->ffn); break;
    default: break;
  }
  return (float)(scale / (double)(1u << 23));
}

static inline float model_tensor_offset(uint32_t tensor) {
  return (tensor == MODEL_T_FINAL_NORM || tensor == MODEL_T_ATTN_NORM ||
          tensor == MODEL_T_MLP_NORM)
             ? 1.0f
             : 0.0f;
}

/*
 * The synthetic prefilled history: row `token` of context `ctx`, layer
 * `layer`, K (kv = 0) or V (kv = 1), `n` bf16 values with a random sign, a
 * magnitude in [2^-8, 1) and a random 7-bit mantissa. Seeded by `seed` only,
 * so the engine's host pool and the resident store get the same bytes. Host
 * only, and fast: four values per mix, built as bits in 16-bit lanes.
 */
static inline void model_history_row(uint64_t seed, uint32_t ctx, uint32_t layer, int kv,
                                     uint32_t token, uint16_t *out, uint32_t n) {
  /* A domain of its own: the offset keeps history keys apart from weight keys. */
  uint64_t s = model_mix64(model_mix64(seed + 0x686973746f7279ull) ^
                           model_mix64(((uint64_t)ctx << 40) ^ ((uint64_t)layer << 33) ^
                                       ((uint64_t)(kv & 1) << 32) ^ token));
  for (uint32_t j = 0; j < n; j += 4) {
    s += 0x9e3779b97f4a7c15ull;
    uint64_t r = s;
    r = (r ^ (r >> 30)) * 0xbf58476d1ce4e5b9ull;
    r = (r ^ (r >> 27)) * 0x94d049bb133111ebull;
    r ^= r >> 31;
    /* per 16-bit lane: sign = bit 15, mantissa = bits 0..6, exponent field
     * 0x77 + (bits 7..9) in 0x77..0x7e, i.e. 2^-8 .. 2^-1 */
    uint64_t lanes = (r & 0x807f807f807f807full) |
                     ((((r >> 7) & 0x0007000700070007ull) + 0x0077007700770077ull) << 7);
    uint16_t v4[4];
    for (int k = 0; k < 4; ++k) v4[k] = (uint16_t)(lanes >> (16 * k));
    memcpy(out + j, v4, (n - j < 4 ? n - j : 4) * sizeof(uint16_t));
  }
}

/* ------------------------------------------------------------------------ */
/* FP8 K/V: fixed per-head scales and the quantizer                          */
/* ------------------------------------------------------------------------ */

/*
 * The fixed scale of K (kv = 0) or V (kv = 1) of KV head `head` in model
 * layer `layer`: 2^-7 x {1, 1.25, 1.5, 1.75}, varying with the layer and the
 * head. E4M3 reaches 448 x scale, 3.5 to 6.1: the model's K and V rows (about
 * unit variance, the prefilled history below 1) fit with room to spare, and
 * values below 2^-6 x scale fall on the subnormal grid.
 */
static inline float model_kv_scale(uint32_t layer, uint32_t head, int kv) {
  return 0x1p-7f * (1.0f + 0.25f * (float)((layer + 3u * head + (uint32_t)(kv & 1)) % 4u));
}
/* The reciprocal the quantizer multiplies by (one fp32 division, on the host). */
static inline float model_kv_inv_scale(uint32_t layer, uint32_t head, int kv) {
  return 1.0f / model_kv_scale(layer, head, kv);
}
static inline void model_layer_scales(const model *m, uint32_t layer, float *k_scale,
                                      float *v_scale) {
  for (uint32_t h = 0; h < m->g.kv_heads; ++h) {
    k_scale[h] = model_kv_scale(layer, h, 0);
    v_scale[h] = model_kv_scale(layer, h, 1);
  }
}

/*
 * fp32 -> OCP FP8 E4M3, round to nearest even, saturating to +-448 (NaN stays
 * NaN: 0x7F with the sign). Integer and exact float steps only, so host and
 * device give the same code for the same input.
 */
MODEL_FN uint8_t model_f32_to_e4m3(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  const uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
  u &= 0x7fffffffu;
  if (u > 0x7f800000u) return (uint8_t)(sign | 0x7fu); /* NaN */
  if (u < 0x3c800000u) {                               /* below 2^-6: multiples of 2^-9 */
    float a;
    memcpy(&a, &u, 4);
    /* a * 512 < 8 is exact; adding and taking away 2^23 rounds it to an
     * integer, ties to even (an FMA of the two steps gives the same value). */
    const float r = (a * 512.0f + 8388608.0f) - 8388608.0f;
    return (uint8_t)(sign | (uint8_t)r); /* 8 is the code of 2^-6 */
  }
  u += 0x7ffffu + ((u >> 20) & 1u); /* 3 mantissa bits, ties to even */
  const uint32_t e = u >> 23;       /* biased fp32 exponent after rounding */
  if (e > 127u + 8u) return (uint8_t)(sign | 0x7eu); /* 512 and above (inf too) */
  uint32_t code = ((e - 120u) << 3) | ((u >> 20) & 7u);
  if (code > 0x7eu) code = 0x7eu; /* 480 saturates to 448 */
  return (uint8_t)(sign | code);
}

/* Quantizes one bf16 K (kv 0) or V (kv 1) row of model layer `layer`
 * (kv_heads x head_dim values) to E4M3 codes with the layer's fixed scales. */
static inline void model_quantize_row(const model_geometry *g, uint32_t layer, int kv,
                                      const uint16_t *row, uint8_t *out) {
  for (uint32_t h = 0; h < g->kv_heads; ++h) {
    const float inv = model_kv_inv_scale(layer, h, kv);
    for (uint32_t j = 0; j < g->head_dim; ++j) {
      const uint32_t e = h * g->head_dim + j;
      out[e] = model_f32_to_e4m3(model_bf16_to_f32(row[e]) * inv);
    }
  }
}

/* a*b and a+b, saturating at UINT64_MAX. */
static inline uint64_t model_sat_mul(uint64_t a, uint64_t b) {
  return (a != 0 && b > UINT64_MAX / a) ? UINT64_MAX : a * b;
}
static inline uint64_t model_sat_add(uint64_t a, uint64_t b) {
  return b > UINT64_MAX - a ? UINT64_MAX : a + b;
}

/* Parameters (weights) of a geometry, for sizing and messages. Saturates at
 * UINT64_MAX: the count is what MODEL_CPU_MAX_PARAMS is checked against
 * before anything is allocated, so it must never wrap to a small number
 * (--layers 63727 --hidden 16777216 --ffn 5751144 wrapped 1.8e19 to
 * 151 M). */
static inline uint64_t model_param_count(const model_geometry *g) {
  const uint64_t h = g->hidden, f = g->ffn;
  const uint64_t q = model_sat_mul(g->n_heads, g->head_dim);
  const uint64_t qkv = model_sat_mul((uint64_t)g->n_heads + 2u * (uint64_t)g->kv_heads,
                                     g->head_dim);
  uint64_t per_layer = model_sat_mul(2, h);
  per_layer = model_sat_add(per_layer, model_sat_mul(qkv, h));
  per_layer = model_sat_add(per_layer, model_sat_mul(h, q));
  per_layer = model_sat_add(per_layer, model_sat_mul(model_sat_mul(2, f), h));
  per_layer = model_sat_add(per_layer, model_sat_mul(h, f));
  uint64_t n = model_sat_add(model_sat_mul(model_sat_mul(2, g->vocab), h), h);
  return model_sat_add(n, model_sat_mul(per_layer, g->n_layers));
}

#ifdef __cplusplus
}
#endif

#endif /* ACTIVEKV_EXAMPLE_MODEL_H */
