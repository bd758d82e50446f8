/*
 * model_cpu.c - the synthetic transformer on the CPU.
 *
 * fp32 math on bf16-rounded weights; every matmul input is rounded to bf16
 * first, as a bf16 engine would hold it. Loops run in a fixed order, so the
 * logits are a pure function of (weights seed, tokens, positions, K/V bytes).
 * Meant for small geometries (the demo, tests on machines without a GPU):
 * weights are held as fp32, so creation refuses geometries past a bound.
 *
 * Attention is the library's C reference, akv_attention_ref_bf16, over
 * whatever view model_attend is given (the engine's staged layer or the
 * model's resident store) and, at sliding-window layers, over the model's
 * own window rows.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "akv_attention.h"
#include "model.h"


typedef struct cpu_layer {
  float *attn_norm; /* [hidden] */
  float *wqkv;      /* [(n_heads + 2 kv_heads) head_dim][hidden] */
  float *wo;        /* [hidden][n_heads head_dim] */
  float *mlp_norm;  /* [hidden] */
  float *wgateup;   /* [2 ffn][hidden]: gate rows, then up rows */
  float *wdown;     /* [hidden][ffn] */
} cpu_layer;

typedef struct cpu_model {
  model base;
  uint32_t q_dim, kv_dim, qkv_dim;
  float *embed;      /* [vocab][hidden] */
  float *lm_head;    /* [vocab][hidden] */
  float *final_norm; /* [hidden] */
  cpu_layer *layers; /* [n_layers] */
  double *inv_freq;  /* [head_dim / 2] */
  uint64_t weight_bytes;

  /* activations, [max_batch][...] */
  float *x;         /* residual stream [hidden] */
  float *xin;       /* bf16-exact matmul input [max(hidden, q_dim, ffn)] */
  float *qkv;       /* [qkv_dim] */
  float *gateup;    /* [2 ffn] */
  float *part;      /* [max_batch][hidden]: a projection's output before the all-reduce */
  uint16_t *q;      /* [n_heads][head_dim] bf16, after RoPE */
  uint16_t *k_new;  /* [kv_heads][head_dim] bf16, after RoPE */
  uint16_t *v_new;  /* [kv_heads][head_dim] bf16 */
  float *attn;      /* [n_heads][head_dim] fp32, written by attention */
  void *workspace;
  size_t workspace_bytes;
  uint64_t scratch_bytes;

  /* the forward in progress */
  uint32_t n_ctx;
  uint32_t pos[MODEL_MAX_BATCH];
  int32_t layer;   /* layer whose attention is expected, -1 outside a forward */
  int attended;    /* model_attend ran for `layer` */
  uint32_t cur_l;  /* the layer the forward is in (dense or sliding): its scales */

  /* resident K/V store: [dense layer][ctx][K|V][max_tokens][row] */
  uint8_t *resident;
  uint32_t res_ctx, res_max_tokens;
  uint64_t row_bytes;

  /* sliding-window rows: [lane][sliding layer][ctx][K|V][window rows][row] */
  uint8_t *window;
  uint32_t win_lanes, win_ctx;
} cpu_model;

static void cpu_say(model *m, const char *fmt, const char *detail) {
  snprintf(m->error, sizeof m->error, fmt, detail);
}

/* Draws a tensor of `count` bf16-rounded weights into fp32 storage. */
static void cpu_fill(float *dst, uint64_t count, const model_geometry *g, uint64_t seed,
                     uint32_t tensor, uint32_t layer) {
  uint64_t key = model_tensor_key(seed, tensor, layer);
  float unit = model_tensor_unit(tensor, g), offset = model_tensor_offset(tensor);
  for (uint64_t i = 0; i < count; ++i)
    dst[i] = model_bf16_to_f32(model_weight_bf16(key, i, unit, offset));
}

/*
 * Tensor parallel: rank `r` of `n` draws a `rows` x `cols` shard of a full
 * tensor of full_cols columns: shard row j is full row row_map(j), shard
 * column k is full column col0 + k. The unit comes from the full geometry
 * `fg` (fan-ins are the full model's), so every rank draws the full model's
 * weights and n = 1 draws exactly what cpu_fill does.
 */
typedef uint64_t (*cpu_row_map)(const model_geometry *g, uint32_t r, uint64_t j);
static void cpu_fill_shard(float *dst, uint64_t rows, uint64_t cols, uint64_t full_cols,
                           uint64_t col0, const model_geometry *g, const model_geometry *fg,
                           uint32_t r, cpu_row_map row_map, uint64_t seed, uint32_t tensor,
                           uint32_t layer) {
  uint64_t key = model_tensor_key(seed, tensor, layer);
  float unit = model_tensor_unit(tensor, fg), offset = model_tensor_offset(tensor);
  for (uint64_t j = 0; j < rows; ++j) {
    const uint64_t fr = row_map ? row_map(g, r, j) : j;
    for (uint64_t k = 0; k < cols; ++k)
      dst[j * cols + k] =
          model_bf16_to_f32(model_weight_bf16(key, fr * full_cols + col0 + k, unit, offset));
  }
}
/* Wqkv: the shard's Q rows, then its K rows, then its V rows. */
static uint64_t cpu_qkv_row(const model_geometry *g, uint32_t r, uint64_t j) {
  const uint64_t q = (uint64_t)g->n_heads * g->head_dim, kv = (uint64_t)g->kv_heads * g->head_dim;
  /* full sizes are the shard's times the rank count, which the caller folds
   * into `r` below: r carries rank | size << 16 */
  const uint64_t rank = r & 0xffffu, size = r >> 16;
  if (j < q) return rank * q + j;
  if (j < q + kv) return size * q + rank * kv + (j - q);
  return size * q + size * kv + rank * kv + (j - q - kv);
}
/* Wgate|up: the shard's gate rows, then its up rows. */
static uint64_t cpu_gateup_row(const model_geometry *g, uint32_t r, uint64_t j) {
  const uint64_t rank = r & 0xffffu, size = r >> 16, f = g->ffn;
  return j < f ? rank * f + j : size * f + rank * f + (j - f);
}

static float cpu_round_bf16(float v) { return model_bf16_to_f32(model_f32_to_bf16(v)); }

/* y[n] = sum_k W[n][k] x[k], k ascending; `add` accumulates into y. */
static void cpu_matvec(const float *w, const float *x, float *y, uint32_t rows, uint32_t cols,
                       int add) {
  for (uint32_t n = 0; n < rows; ++n) {
    const float *row = w + (uint64_t)n * cols;
    float acc = 0.0f;
    for (uint32_t k = 0; k < cols; ++k) acc += row[k] * x[k];
    y[n] = add ? y[n] + acc : acc;
  }
}

/* out = bf16(x * rsqrt(mean(x^2) + eps) * w) */
static void cpu_rmsnorm(const float *x, const float *w, float *out, uint32_t n, float eps) {
  float ss = 0.0f;
  for (uint32_t i = 0; i < n; ++i) ss += x[i] * x[i];
  float r = 1.0f / sqrtf(ss / (float)n + eps);
  for (uint32_t i = 0; i < n; ++i) out[i] = cpu_round_bf16(x[i] * r * w[i]);
}

/* Rotate-half RoPE of one head at position pos, result rounded to bf16. */
static void cpu_rope(const cpu_model *cm, const float *in, uint16_t *out, uint32_t pos) {
  uint32_t half = cm->base.g.head_dim / 2;
  for (uint32_t j = 0; j < half; ++j) {
    double a = (double)pos * cm->inv_freq[j];
    float c = (float)cos(a), s = (float)sin(a);
    float x0 = in[j], x1 = in[j + half];
    out[j] = model_f32_to_bf16(x0 * c - x1 * s);
    out[j + half] = model_f32_to_bf16(x1 * c + x0 * s);
  }
}

static void cpu_destroy(model *m) {
  cpu_model *cm = (cpu_model *)m;
  if (cm == NULL) return;
  free(cm->embed);
  free(cm->lm_head);
  free(cm->final_norm);
  if (cm->layers) {
    for (uint32_t l = 0; l < m->g.n_layers; ++l) {
      cpu_layer *L = &cm->layers[l];
      free(L->attn_norm);
      free(L->wqkv);
      free(L->wo);
      free(L->mlp_norm);
      free(L->wgateup);
      free(L->wdown);
    }
  }
  free(cm->layers);
  free(cm->inv_freq);
  free(cm->x);
  free(cm->xin);
  free(cm->qkv);
  free(cm->gateup);
  free(cm->part);
  free(cm->q);
  free(cm->k_new);
  free(cm->v_new);
  free(cm->attn);
  free(cm->workspace);
  free(cm->resident);
  free(cm->window);
  free(cm);
}

static int cpu_attend_rows(cpu_model *cm, const model_kv_view *v, const uint32_t *write_row,
                           const uint32_t *len1);

/* Tensor parallel: part[n_ctx][hidden] summed over ranks (the caller's
 * all-reduce), then added to the residual stream. */
static int cpu_reduce_add(cpu_model *cm, uint32_t n_ctx) {
  model *m = &cm->base;
  const uint64_t n = (uint64_t)n_ctx * m->g.hidden;
  if (m->opt.allreduce(m->opt.allreduce_user, cm->part, n) != 0) {
    snprintf(m->error, sizeof m->error, "the tensor parallel all-reduce failed (a peer stopped)");
    return -1;
  }
  for (uint64_t i = 0; i < n; ++i) cm->x[i] = cm->x[i] + cm->part[i];
  return 0;
}

static int cpu_forward(model *m, uint32_t lane, uint32_t n_ctx, const int32_t *tokens,
                       const uint32_t *pos, model_layer_fn fn, void *user, float *logits) {
  cpu_model *cm = (cpu_model *)m;
  const model_geometry *g = &m->g;
  const uint32_t H = g->hidden, F = g->ffn, hd = g->head_dim;
  if (n_ctx == 0 || n_ctx > m->opt.max_batch) {
    snprintf(m->error, sizeof m->error, "forward: %u contexts, the model was built for 1..%u",
             n_ctx, m->opt.max_batch);
    return -1;
  }
  for (uint32_t b = 0; b < n_ctx; ++b) {
    if (tokens[b] < 0 || (uint32_t)tokens[b] >= g->vocab) {
      snprintf(m->error, sizeof m->error, "forward: token %d outside the vocabulary of %u",
               tokens[b], g->vocab);
      return -1;
    }
    cm->pos[b] = pos[b];
    memcpy(cm->x + (uint64_t)b * H, cm->embed + (uint64_t)tokens[b] * H, H * sizeof(float));
  }
  cm->n_ctx = n_ctx;

  for (uint32_t l = 0; l < g->n_layers; ++l) {
    const cpu_layer *L = &cm->layers[l];
    for (uint32_t b = 0; b < n_ctx; ++b) {
      float *x = cm->x + (uint64_t)b * H;
      float *qkv = cm->qkv + (uint64_t)b * cm->qkv_dim;
      cpu_rmsnorm(x, L->attn_norm, cm->xin, H, g->norm_eps);
      cpu_matvec(L->wqkv, cm->xin, qkv, cm->qkv_dim, H, 0);
      for (uint32_t h = 0; h < g->n_heads; ++h)
        cpu_rope(cm, qkv + h * hd, cm->q + ((uint64_t)b * g->n_heads + h) * hd, pos[b]);
      for (uint32_t h = 0; h < g->kv_heads; ++h) {
        cpu_rope(cm, qkv + cm->q_dim + h * hd, cm->k_new + ((uint64_t)b * g->kv_heads + h) * hd,
                 pos[b]);
      }
      for (uint32_t i = 0; i < cm->kv_dim; ++i)
        cm->v_new[(uint64_t)b * cm->kv_dim + i] = model_f32_to_bf16(qkv[cm->q_dim + cm->kv_dim + i]);
    }

    cm->attended = 0;
    cm->cur_l = l;
    if (!model_layer_dense(g, l)) {
      /* sliding-window layer: the model's own rows of this lane */
      uint32_t wrow[MODEL_MAX_BATCH], len1[MODEL_MAX_BATCH];
      model_kv_view wv;
      if (model_window_view(m, cm->window, cm->win_lanes, cm->win_ctx, lane, l, cm->row_bytes,
                            n_ctx, pos, wrow, len1, &wv) != 0 ||
          cpu_attend_rows(cm, &wv, wrow, len1) != 0)
        return -1;
    } else {
      cm->layer = (int32_t)l;
      if (fn(user, m, l) != 0) {
        cm->layer = -1;
        if (m->error[0] == '\0')
          snprintf(m->error, sizeof m->error, "layer %u: attention failed", l);
        return -1;
      }
      cm->layer = -1;
    }
    if (!cm->attended) {
      snprintf(m->error, sizeof m->error, "layer %u: the layer callback did not attend", l);
      return -1;
    }

    if (m->opt.allreduce == NULL) {
      for (uint32_t b = 0; b < n_ctx; ++b) {
        float *x = cm->x + (uint64_t)b * H;
        const float *attn = cm->attn + (uint64_t)b * cm->q_dim;
        for (uint32_t i = 0; i < cm->q_dim; ++i) cm->xin[i] = cpu_round_bf16(attn[i]);
        cpu_matvec(L->wo, cm->xin, x, H, cm->q_dim, 1);

        cpu_rmsnorm(x, L->mlp_norm, cm->xin, H, g->norm_eps);
        cpu_matvec(L->wgateup, cm->xin, cm->gateup, 2 * F, H, 0);
        for (uint32_t i = 0; i < F; ++i) {
          float gt = cm->gateup[i], up = cm->gateup[F + i];
          cm->xin[i] = cpu_round_bf16(gt / (1.0f + expf(-gt)) * up);
        }
        cpu_matvec(L->wdown, cm->xin, x, H, F, 1);
      }
      continue;
    }
    /* Tensor parallel: each rank's partial projection, summed over ranks,
     * then added to the residual (with one rank: x + acc, as above). */
    for (uint32_t b = 0; b < n_ctx; ++b) {
      const float *attn = cm->attn + (uint64_t)b * cm->q_dim;
      for (uint32_t i = 0; i < cm->q_dim; ++i) cm->xin[i] = cpu_round_bf16(attn[i]);
      cpu_matvec(L->wo, cm->xin, cm->part + (uint64_t)b * H, H, cm->q_dim, 0);
    }
    if (cpu_reduce_add(cm, n_ctx) != 0) return -1;
    for (uint32_t b = 0; b < n_ctx; ++b) {
      const float *x = cm->x + (uint64_t)b * H;
      cpu_rmsnorm(x, L->mlp_norm, cm->xin, H, g->norm_eps);
      cpu_matvec(L->wgateup, cm->xin, cm->gateup, 2 * F, H, 0);
      for (uint32_t i = 0; i < F; ++i) {
        float gt = cm->gateup[i], up = cm->gateup[F + i];
        cm->xin[i] = cpu_round_bf16(gt / (1.0f + expf(-gt)) * up);
      }
      cpu_matvec(L->wdown, cm->xin, cm->part + (uint64_t)b * H, H, F, 0);
    }
    if (cpu_reduce_add(cm, n_ctx) != 0) return -1;
  }

  for (uint32_t b = 0; b < n_ctx; ++b) {
    cpu_rmsnorm(cm->x + (uint64_t)b * H, cm->final_norm, cm->xin, H, g->norm_eps);
    cpu_matvec(cm->lm_head, cm->xin, logits + (uint64_t)b * g->vocab, g->vocab, H, 0);
  }
  return 0;
}

/* Writes each context's new K/V row at row write_row[i] of the view, then
 * attends over len1[i] rows. */
static int cpu_attend_rows(cpu_model *cm, const model_kv_view *v, const uint32_t *write_row,
                           const uint32_t *len1) {
  model *m = &cm->base;
  for (uint32_t i = 0; i < v->n_contexts; ++i) {
    uint8_t *k = (uint8_t *)v->base + i * v->context_stride + (uint64_t)write_row[i] * v->row_stride;
    if (m->opt.kv_dtype == AKV_DTYPE_FP8_E4M3) { /* quantized on write, after RoPE */
      model_quantize_row(&m->g, cm->cur_l, 0, cm->k_new + (uint64_t)i * cm->kv_dim, k);
      model_quantize_row(&m->g, cm->cur_l, 1, cm->v_new + (uint64_t)i * cm->kv_dim,
                         k + v->v_offset);
    } else {
      memcpy(k, cm->k_new + (uint64_t)i * cm->kv_dim, cm->row_bytes);
      memcpy(k + v->v_offset, cm->v_new + (uint64_t)i * cm->kv_dim, cm->row_bytes);
    }
  }

  float ks[AKV_ATTENTION_MAX_SCALE_HEADS], vs[AKV_ATTENTION_MAX_SCALE_HEADS];
  akv_attention_args a = model_attention_args(m, cm->cur_l, v, len1, cm->q, cm->attn,
                                              cm->workspace, cm->workspace_bytes, ks, vs);
  akv_status st = akv_attention_ref_bf16(&a);
  if (st != AKV_OK) {
    cpu_say(m, "attend: akv_attention_ref_bf16 failed: %s", akv_status_string(st));
    return -1;
  }
  cm->attended = 1;
  return 0;
}

static int cpu_attend(model *m, uint32_t layer, const model_kv_view *v) {
  cpu_model *cm = (cpu_model *)m;
  uint32_t len1[MODEL_MAX_BATCH];
  if (model_attend_check(m, cm->layer, cm->n_ctx, cm->row_bytes, cm->pos, layer, v, len1) != 0)
    return -1;
  return cpu_attend_rows(cm, v, v->len, len1); /* the new row goes after the history */
}

static int cpu_resident_reserve(model *m, uint32_t n_ctx, uint32_t max_tokens) {
  cpu_model *cm = (cpu_model *)m;
  if (cm->resident != NULL || n_ctx == 0 || n_ctx > m->opt.max_batch || max_tokens == 0) {
    snprintf(m->error, sizeof m->error, "resident_reserve: reserved already or bad size (%u x %u)",
             n_ctx, max_tokens);
    return -1;
  }
  uint64_t bytes = (uint64_t)model_dense_layers(&m->g) * n_ctx * 2 * max_tokens * cm->row_bytes;
  cm->resident = calloc(1, bytes);
  if (cm->resident == NULL) {
    snprintf(m->error, sizeof m->error, "resident_reserve: out of memory for %llu bytes",
             (unsigned long long)bytes);
    return -1;
  }
  cm->res_ctx = n_ctx;
  cm->res_max_tokens = max_tokens;
  return 0;
}

/* Context ctx's K rows of dense layer d (the engine's index). */
static uint8_t *cpu_resident_k(const cpu_model *cm, uint32_t d, uint32_t ctx) {
  uint64_t seg = (uint64_t)cm->res_max_tokens * cm->row_bytes;
  return cm->resident + ((uint64_t)d * cm->res_ctx + ctx) * 2 * seg;
}

static int cpu_resident_append(model *m, uint32_t ctx, uint32_t first, uint32_t n_tokens,
                               const void *const *k_rows, const void *const *v_rows) {
  cpu_model *cm = (cpu_model *)m;
  if (cm->resident == NULL || ctx >= cm->res_ctx || first > cm->res_max_tokens ||
      n_tokens > cm->res_max_tokens - first) {
    snprintf(m->error, sizeof m->error,
             "resident_append: rows %u..%u of context %u do not fit the store", first,
             first + n_tokens, ctx);
    return -1;
  }
  uint64_t seg = (uint64_t)cm->res_max_tokens * cm->row_bytes;
  for (uint32_t d = 0; d < model_dense_layers(&m->g); ++d) {
    uint8_t *k = cpu_resident_k(cm, d, ctx) + (uint64_t)first * cm->row_bytes;
    memcpy(k, k_rows[d], (uint64_t)n_tokens * cm->row_bytes);
    memcpy(k + seg, v_rows[d], (uint64_t)n_tokens * cm->row_bytes);
  }
  return 0;
}

static int cpu_resident_view(model *m, uint32_t layer, const uint32_t *len, uint32_t n_ctx,
                            model_kv_view *out) {
  cpu_model *cm = (cpu_model *)m;
  if (model_resident_view_fill(m, cm->resident != NULL, cm->res_ctx, cm->res_max_tokens,
                               cm->row_bytes, layer, len, n_ctx, out) != 0)
    return -1;
  out->base = cpu_resident_k(cm, model_dense_before(&m->g, layer), 0);
  return 0;
}

/* Context ctx's K rows of sliding layer `layer` (the model's index) in `lane`. */
static uint8_t *cpu_window_k(const cpu_model *cm, uint32_t lane, uint32_t layer, uint32_t ctx) {
  return cm->window + model_window_offset(&cm->base, lane, layer, ctx, cm->win_ctx, cm->row_bytes);
}

static int cpu_window_reserve(model *m, uint32_t lanes, uint32_t n_ctx) {
  cpu_model *cm = (cpu_model *)m;
  if (model_window_reserve_check(m, cm->window != NULL, lanes, n_ctx) != 0) return -1;
  uint64_t bytes = model_window_bytes(m, lanes, n_ctx, cm->row_bytes);
  cm->window = calloc(1, bytes);
  if (cm->window == NULL) {
    snprintf(m->error, sizeof m->error, "window_reserve: out of memory for %llu bytes",
             (unsigned long long)bytes);
    return -1;
  }
  cm->win_lanes = lanes;
  cm->win_ctx = n_ctx;
  return 0;
}

static int cpu_window_append(model *m, uint32_t lane, uint32_t ctx, uint32_t first,
                             uint32_t n_tokens, const void *const *k_rows,
                             const void *const *v_rows) {
  cpu_model *cm = (cpu_model *)m;
  if (model_window_append_check(m, cm->window != NULL, cm->win_lanes, cm->win_ctx, lane, ctx,
                                first, n_tokens) != 0)
    return -1;
  const uint64_t seg = (uint64_t)model_window_rows(m) * cm->row_bytes;
  for (uint32_t l = 0, w = 0; l < m->g.n_layers; ++l) {
    if (model_layer_dense(&m->g, l)) continue;
    uint8_t *k = cpu_window_k(cm, lane, l, ctx);
    for (uint32_t t = 0; t < n_tokens; ++t) {
      const uint64_t row = (uint64_t)((first + t) % m->g.window) * cm->row_bytes;
      memcpy(k + row, (const uint8_t *)k_rows[w] + (uint64_t)t * cm->row_bytes, cm->row_bytes);
      memcpy(k + seg + row, (const uint8_t *)v_rows[w] + (uint64_t)t * cm->row_bytes,
             cm->row_bytes);
    }
    ++w;
  }
  return 0;
}

static void cpu_memory(model *m, model_memory *out) {
  cpu_model *cm = (cpu_model *)m;
  memset(out, 0, sizeof *out);
  out->weights = cm->weight_bytes;
  out->scratch = cm->scratch_bytes;
  if (cm->resident)
    out->resident =
        (uint64_t)model_dense_layers(&m->g) * cm->res_ctx * 2 * cm->res_max_tokens * cm->row_bytes;
  if (cm->window) out->window = model_window_bytes(m, cm->win_lanes, cm->win_ctx, cm->row_bytes);
}

static const model_ops cpu_ops = {
    "cpu",           cpu_destroy,        cpu_forward,       cpu_attend,
    cpu_resident_reserve, cpu_resident_append, cpu_resident_view, cpu_window_reserve,
    cpu_window_append,   cpu_memory,
};

static float *cpu_alloc(uint64_t count, uint64_t *total) {
  *total += count * sizeof(float);
  return malloc(count * sizeof(float));
}

int model_cpu_create(const model_geometry *g, const model_options *opt, model **out, char *err,
                     size_t cap) {
  if (g == NULL || opt == NULL || out == NULL) {
    snprintf(err, cap, "model_cpu_create: NULL argument");
    return -1;
  }
  if (g->n_layers == 0 || g->n_heads == 0 || g->kv_heads == 0 || g->n_heads % g->kv_heads ||
      g->head_dim == 0 || g->head_dim % 8 || g->hidden == 0 || g->hidden % 8 || g->ffn == 0 ||
      g->ffn % 8 || g->vocab == 0 || g->head_dim > AKV_ATTENTION_MAX_HEAD_DIM ||
      opt->max_batch == 0 || opt->max_batch > MODEL_MAX_BATCH || opt->max_tokens == 0 ||
      opt->chunk_tokens == 0) {
    snprintf(err, cap,
             "geometry: layers, heads, kv heads, head_dim, hidden, ffn and vocab must be > 0, "
             "heads a multiple of kv heads, head_dim/hidden/ffn multiples of 8, head_dim <= %u, "
             "batch 1..%d, max tokens and chunk > 0",
             AKV_ATTENTION_MAX_HEAD_DIM, MODEL_MAX_BATCH);
    return -1;
  }
  if (model_hybrid_check(g, err, cap) != 0) return -1;
  const uint32_t tp = opt->tp_size > 1 ? opt->tp_size : 1;
  if (opt->tp_rank >= tp || tp > 0xffffu ||
      (tp > 1 && opt->kv_dtype != AKV_DTYPE_BF16)) {
    snprintf(err, cap, "tensor parallel: rank %u of %u (bf16 K/V only)", opt->tp_rank, tp);
    return -1;
  }
  model_geometry fg = *g; /* the full model's geometry: its fan-ins scale the weights */
  fg.n_heads *= tp;
  fg.kv_heads *= tp;
  fg.ffn *= tp;
  if (model_kv_dtype_check(opt->kv_dtype, g->kv_heads, err, cap) != 0) return -1;
  uint64_t params = model_param_count(g);
  if (params > MODEL_CPU_MAX_PARAMS) {
    /* Decimal millions, as the CLI prints every parameter count. */
    snprintf(err, cap,
             "the CPU model holds at most %.2f M parameters and this geometry has %.2f M; "
             "use --preset tiny, shrink --layers/--hidden/--ffn/--vocab, or use --backend cuda",
             (double)MODEL_CPU_MAX_PARAMS / 1e6, (double)params / 1e6);
    return -1;
  }

  cpu_model *cm = calloc(1, sizeof *cm);
  if (cm == NULL) goto oom;
  model *m = &cm->base;
  m->ops = &cpu_ops;
  m->g = *g;
  m->opt = *opt;
  cm->layer = -1;
  cm->q_dim = g->n_heads * g->head_dim;
  cm->kv_dim = g->kv_heads * g->head_dim;
  cm->qkv_dim = cm->q_dim + 2 * cm->kv_dim;
  cm->row_bytes = (uint64_t)cm->kv_dim * model_kv_elem_bytes(opt->kv_dtype);

  const uint64_t H = g->hidden, F = g->ffn, B = opt->max_batch;
  uint64_t wb = 0;
  cm->embed = cpu_alloc((uint64_t)g->vocab * H, &wb);
  cm->lm_head = cpu_alloc((uint64_t)g->vocab * H, &wb);
  cm->final_norm = cpu_alloc(H, &wb);
  cm->layers = calloc(g->n_layers, sizeof *cm->layers);
  if (!cm->embed || !cm->lm_head || !cm->final_norm || !cm->layers) goto oom_free;
  cpu_fill(cm->embed, (uint64_t)g->vocab * H, g, opt->seed, MODEL_T_EMBED, 0);
  cpu_fill(cm->lm_head, (uint64_t)g->vocab * H, g, opt->seed, MODEL_T_LM_HEAD, 0);
  cpu_fill(cm->final_norm, H, g, opt->seed, MODEL_T_FINAL_NORM, 0);
  for (uint32_t l = 0; l < g->n_layers; ++l) {
    cpu_layer *L = &cm->layers[l];
    L->attn_norm = cpu_alloc(H, &wb);
    L->wqkv = cpu_alloc((uint64_t)cm->qkv_dim * H, &wb);
    L->wo = cpu_alloc(H * cm->q_dim, &wb);
    L->mlp_norm = cpu_alloc(H, &wb);
    L->wgateup = cpu_alloc(2 * F * H, &wb);
    L->wdown = cpu_alloc(H * F, &wb);
    if (!L->attn_norm || !L->wqkv || !L->wo || !L->mlp_norm || !L->wgateup || !L->wdown)
      goto oom_free;
    cpu_fill(L->attn_norm, H, g, opt->seed, MODEL_T_ATTN_NORM, l);
    cpu_fill(L->mlp_norm, H, g, opt->seed, MODEL_T_MLP_NORM, l);
    if (tp == 1) {
      cpu_fill(L->wqkv, (uint64_t)cm->qkv_dim * H, g, opt->seed, MODEL_T_WQKV, l);
      cpu_fill(L->wo, H * cm->q_dim, g, opt->seed, MODEL_T_WO, l);
      cpu_fill(L->wgateup, 2 * F * H, g, opt->seed, MODEL_T_WGATEUP, l);
      cpu_fill(L->wdown, H * F, g, opt->seed, MODEL_T_WDOWN, l);
    } else {
      const uint32_t rs = opt->tp_rank | tp << 16; /* rank and size for the row maps */
      cpu_fill_shard(L->wqkv, cm->qkv_dim, H, H, 0, g, &fg, rs, cpu_qkv_row, opt->seed,
                     MODEL_T_WQKV, l);
      cpu_fill_shard(L->wo, H, cm->q_dim, (uint64_t)cm->q_dim * tp,
                     (uint64_t)opt->tp_rank * cm->q_dim, g, &fg, rs, NULL, opt->seed, MODEL_T_WO,
                     l);
      cpu_fill_shard(L->wgateup, 2 * F, H, H, 0, g, &fg, rs, cpu_gateup_row, opt->seed,
                     MODEL_T_WGATEUP, l);
      cpu_fill_shard(L->wdown, H, F, F * tp, (uint64_t)opt->tp_rank * F, g, &fg, rs, NULL,
                     opt->seed, MODEL_T_WDOWN, l);
    }
  }
  cm->weight_bytes = wb;

  cm->inv_freq = malloc((g->head_dim / 2) * sizeof(double));
  if (cm->inv_freq == NULL) goto oom_free;
  for (uint32_t j = 0; j < g->head_dim / 2; ++j)
    cm->inv_freq[j] = pow((double)g->rope_theta, -2.0 * j / (double)g->head_dim);

  uint64_t sb = 0, widest = H;
  if (cm->q_dim > widest) widest = cm->q_dim;
  if (F > widest) widest = F;
  cm->x = cpu_alloc(B * H, &sb);
  cm->xin = cpu_alloc(widest, &sb);
  cm->qkv = cpu_alloc(B * cm->qkv_dim, &sb);
  cm->gateup = cpu_alloc(2 * F, &sb);
  cm->part = cpu_alloc(B * H, &sb);
  cm->attn = cpu_alloc(B * cm->q_dim, &sb);
  cm->q = malloc(B * cm->q_dim * sizeof(uint16_t));
  cm->k_new = malloc(B * cm->kv_dim * sizeof(uint16_t));
  cm->v_new = malloc(B * cm->kv_dim * sizeof(uint16_t));
  sb += B * (cm->q_dim + 2 * cm->kv_dim) * sizeof(uint16_t);
  if (!cm->x || !cm->xin || !cm->qkv || !cm->gateup || !cm->part || !cm->attn || !cm->q || !cm->k_new ||
      !cm->v_new)
    goto oom_free;
  if (akv_attention_workspace_bytes(opt->max_batch, g->n_heads, g->head_dim, opt->max_tokens,
                                    opt->chunk_tokens, &cm->workspace_bytes) != AKV_OK) {
    cpu_destroy(&cm->base);
    snprintf(err, cap, "attention workspace: bad sizes (head_dim %u, max tokens %u, chunk %u)",
             g->head_dim, opt->max_tokens, opt->chunk_tokens);
    return -1;
  }
  if (cm->workspace_bytes) {
    cm->workspace = malloc(cm->workspace_bytes);
    if (cm->workspace == NULL) {
      /* The workspace grows with contexts x tokens, not with the weights:
       * say so, not "out of memory for N parameters". */
      const unsigned long long ws = (unsigned long long)cm->workspace_bytes;
      cpu_destroy(&cm->base);
      snprintf(err, cap,
               "the CPU model is out of memory for its attention workspace of %llu bytes (%u "
               "contexts x %u tokens, chunk %u): fewer contexts or tokens, or a larger chunk",
               ws, opt->max_batch, opt->max_tokens, opt->chunk_tokens);
      return -1;
    }
  }
  cm->scratch_bytes = sb + cm->workspace_bytes;
  *out = m;
  return 0;

oom_free:
  cpu_destroy(&cm->base);
oom:
  snprintf(err, cap, "the CPU model is out of memory for %.2f M parameters", (double)params / 1e6);
  return -1;
}
