/*
 * attention_ref.c - the CPU reference of GQA decode attention (akv_attention.h).
 *
 * The structure is the one the CUDA kernels follow (src/attention_cuda.cu):
 * stage 1 computes one partial (m, l, acc[head_dim]) per (context, query head,
 * chunk) into the workspace; stage 2 combines a context's partials. Within a
 * chunk the reference works in two passes (exact chunk maximum first, then the
 * exponentials and sums in row order), which the GPU replaces by tiles with a
 * running maximum; the two agree to rounding.
 *
 * Contiguous and paged calls share chunk_partial() and combine(): with
 * page_tokens == chunk_tokens each chunk sees the same rows in the same order,
 * so the two give the same bits.
 *
 * No allocation: per-call scratch lives on the stack (head_dim is bounded by
 * AKV_ATTENTION_MAX_HEAD_DIM), partials in the caller's workspace.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "akv_attention.h"

/* log2(e) as a float: scores are kept in the base-2 domain (exp2). */
#define AKV_LOG2E_F 1.44269504088896340736f

/* Workspace regions start on this alignment (matches attention_cuda.cu). */
#define AKV_WS_ALIGN ((size_t)256)

static float bf16_to_f32(uint16_t h) {
  uint32_t bits = (uint32_t)h << 16;
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}

static size_t align_up(size_t x) { return (x + AKV_WS_ALIGN - 1) & ~(AKV_WS_ALIGN - 1); }

/* Multiplies with an overflow check; returns 0 on overflow. */
static int mul_ok(size_t a, size_t b, size_t *out) {
  if (a != 0 && b > SIZE_MAX / a) return 0;
  *out = a * b;
  return 1;
}

/* Workspace layout shared by every variant:
 *   acc: float [n_contexts][n_heads][max_chunks][head_dim], then aligned,
 *   ml:  float [n_contexts][n_heads][max_chunks][2] (m, l).
 * Returns 0 on overflow. */
static int ws_layout(uint32_t n_contexts, uint32_t n_heads, uint32_t head_dim,
                     uint32_t max_chunks, size_t *acc_bytes, size_t *total) {
  size_t slots, acc, ml;
  if (!mul_ok((size_t)n_contexts, (size_t)n_heads, &slots)) return 0;
  if (!mul_ok(slots, (size_t)max_chunks, &slots)) return 0;
  if (!mul_ok(slots, (size_t)head_dim * sizeof(float), &acc)) return 0;
  if (!mul_ok(slots, 2 * sizeof(float), &ml)) return 0;
  if (acc > SIZE_MAX - 2 * AKV_WS_ALIGN || ml > SIZE_MAX - 2 * AKV_WS_ALIGN) return 0;
  acc = align_up(acc);
  ml = align_up(ml);
  if (acc > SIZE_MAX - ml) return 0;
  *acc_bytes = acc;
  *total = acc + ml;
  return 1;
}

static uint32_t div_up(uint32_t a, uint32_t b) { return a / b + (a % b != 0); }

akv_status akv_attention_workspace_bytes(uint32_t n_contexts, uint32_t n_heads,
                                         uint32_t head_dim, uint32_t max_tokens,
                                         uint32_t chunk_tokens, size_t *out) {
  akv_status st = AKV_ERR_INVALID_ARGUMENT;
  size_t acc_bytes, total;
  if (out == NULL || n_contexts == 0 || n_heads == 0 || head_dim == 0 || chunk_tokens == 0 ||
      head_dim > AKV_ATTENTION_MAX_HEAD_DIM)
    goto fail;
  if (!ws_layout(n_contexts, n_heads, head_dim, div_up(max_tokens, chunk_tokens), &acc_bytes,
                 &total))
    goto fail;
  *out = total;
  return AKV_OK;
fail:
  return st;
}

/* The geometry both variants share, checked once. */
typedef struct ref_geom {
  uint32_t n_heads, kv_heads, group, head_dim;
  float scale_log2;
  const uint16_t *q;
  float *out;
  float *acc; /* workspace acc region */
  float *ml;  /* workspace ml region */
  uint32_t max_chunks;
} ref_geom;

static akv_status geom_check(akv_dtype dtype, uint32_t n_heads, uint32_t kv_heads,
                             uint32_t head_dim, uint64_t row_bytes, const void *q,
                             const float *out) {
  if (q == NULL || out == NULL) return AKV_ERR_INVALID_ARGUMENT;
  if (n_heads == 0 || kv_heads == 0 || n_heads % kv_heads != 0) return AKV_ERR_INVALID_ARGUMENT;
  if (head_dim == 0 || head_dim > AKV_ATTENTION_MAX_HEAD_DIM) return AKV_ERR_INVALID_ARGUMENT;
  if (row_bytes < (uint64_t)kv_heads * head_dim * 2u) return AKV_ERR_INVALID_ARGUMENT;
  if (dtype != AKV_DTYPE_BF16) return AKV_ERR_NOT_SUPPORTED;
  return AKV_OK;
}

/* Binds the workspace; fails when it is too small for max_chunks. */
static akv_status geom_bind(ref_geom *g, uint32_t n_contexts, void *workspace,
                            size_t workspace_bytes) {
  size_t acc_bytes, total;
  if (!ws_layout(n_contexts, g->n_heads, g->head_dim, g->max_chunks, &acc_bytes, &total))
    return AKV_ERR_INVALID_ARGUMENT;
  if (workspace_bytes < total || (total != 0 && workspace == NULL))
    return AKV_ERR_INVALID_ARGUMENT;
  g->acc = (float *)workspace;
  g->ml = (float *)((char *)workspace + acc_bytes);
  return AKV_OK;
}

static float dot_row(const float *qf, const uint16_t *k, uint32_t d) {
  float s = 0.0f;
  for (uint32_t j = 0; j < d; ++j) s += qf[j] * bf16_to_f32(k[j]);
  return s;
}

/*
 * Stage 1 for one (context, kv head, chunk): n rows starting at k_rows/v_rows
 * (already offset to the kv head), row_bytes apart. Writes the partials of
 * every query head of the group into slot `chunk` of the context.
 */
static void chunk_partial(const ref_geom *g, uint32_t ctx, uint32_t kvh, uint32_t chunk,
                          const char *k_rows, const char *v_rows, uint64_t row_bytes,
                          uint32_t n) {
  const uint32_t d = g->head_dim;
  float qf[AKV_ATTENTION_MAX_HEAD_DIM];
  for (uint32_t hg = 0; hg < g->group; ++hg) {
    const uint32_t h = kvh * g->group + hg;
    const uint16_t *qh = g->q + ((size_t)ctx * g->n_heads + h) * d;
    const size_t slot = ((size_t)ctx * g->n_heads + h) * g->max_chunks + chunk;
    float *acc = g->acc + slot * d;
    float m = -INFINITY, l = 0.0f;
    for (uint32_t j = 0; j < d; ++j) {
      qf[j] = bf16_to_f32(qh[j]);
      acc[j] = 0.0f;
    }
    /* Pass 1: the exact maximum of the chunk's scores. */
    for (uint32_t t = 0; t < n; ++t) {
      const float s = dot_row(qf, (const uint16_t *)(k_rows + t * row_bytes), d) * g->scale_log2;
      m = fmaxf(m, s);
    }
    /* Pass 2: exponentials, their sum and the weighted V rows, in row order. */
    const float m_use = (m == -INFINITY) ? 0.0f : m;
    for (uint32_t t = 0; t < n; ++t) {
      const float s = dot_row(qf, (const uint16_t *)(k_rows + t * row_bytes), d) * g->scale_log2;
      const float p = exp2f(s - m_use);
      const uint16_t *v = (const uint16_t *)(v_rows + t * row_bytes);
      l += p;
      for (uint32_t j = 0; j < d; ++j) acc[j] += p * bf16_to_f32(v[j]);
    }
    g->ml[slot * 2 + 0] = m;
    g->ml[slot * 2 + 1] = l;
  }
}

/* Stage 2 for one context: combines chunks [0, n_chunks) in chunk order. */
static void combine(const ref_geom *g, uint32_t ctx, uint32_t n_chunks) {
  const uint32_t d = g->head_dim;
  float o[AKV_ATTENTION_MAX_HEAD_DIM];
  for (uint32_t h = 0; h < g->n_heads; ++h) {
    const size_t slot0 = ((size_t)ctx * g->n_heads + h) * g->max_chunks;
    float *out = g->out + ((size_t)ctx * g->n_heads + h) * d;
    float big = -INFINITY, l = 0.0f;
    for (uint32_t c = 0; c < n_chunks; ++c) big = fmaxf(big, g->ml[(slot0 + c) * 2]);
    const float big_use = (big == -INFINITY) ? 0.0f : big;
    for (uint32_t j = 0; j < d; ++j) o[j] = 0.0f;
    for (uint32_t c = 0; c < n_chunks; ++c) {
      const float w = exp2f(g->ml[(slot0 + c) * 2] - big_use);
      const float *acc = g->acc + (slot0 + c) * d;
      l += w * g->ml[(slot0 + c) * 2 + 1];
      for (uint32_t j = 0; j < d; ++j) o[j] += w * acc[j];
    }
    for (uint32_t j = 0; j < d; ++j) out[j] = (l > 0.0f) ? o[j] / l : 0.0f;
  }
}

akv_status akv_attention_ref_bf16(const akv_attention_args *a) {
  akv_status st = AKV_ERR_INVALID_ARGUMENT;
  ref_geom g;
  uint32_t max_len = 0;
  if (a == NULL) goto fail;
  st = geom_check(a->dtype, a->n_heads, a->kv_heads, a->head_dim, a->row_bytes, a->q, a->out);
  if (st != AKV_OK) goto fail;
  st = AKV_ERR_INVALID_ARGUMENT;
  if (a->n_contexts == 0 || a->chunk_tokens == 0 || a->len == NULL || a->k_base == NULL ||
      a->v_base == NULL)
    goto fail;
  if (a->page_map != NULL && (a->page_map_stride == 0 || a->k_pages == NULL || a->v_pages == NULL))
    goto fail;
  for (uint32_t i = 0; i < a->n_contexts; ++i)
    if (a->len[i] > max_len) max_len = a->len[i];

  g.n_heads = a->n_heads;
  g.kv_heads = a->kv_heads;
  g.group = a->n_heads / a->kv_heads;
  g.head_dim = a->head_dim;
  g.scale_log2 = a->scale * AKV_LOG2E_F;
  g.q = (const uint16_t *)a->q;
  g.out = a->out;
  g.max_chunks = div_up(max_len, a->chunk_tokens);
  st = geom_bind(&g, a->n_contexts, a->workspace, a->workspace_bytes);
  if (st != AKV_OK) goto fail;

  for (uint32_t i = 0; i < a->n_contexts; ++i) {
    const uint32_t n_chunks = div_up(a->len[i], a->chunk_tokens);
    const char *kc = (const char *)a->k_base + (size_t)i * a->context_stride;
    const char *vc = (const char *)a->v_base + (size_t)i * a->context_stride;
    for (uint32_t c = 0; c < n_chunks; ++c) {
      const uint32_t first = c * a->chunk_tokens;
      const uint32_t rem = a->len[i] - first;
      const uint32_t n = rem < a->chunk_tokens ? rem : a->chunk_tokens;
      const char *kp = kc + (size_t)first * a->row_bytes;
      const char *vp = vc + (size_t)first * a->row_bytes;
      if (a->page_map != NULL && c < a->page_map_stride) {
        const uint32_t page = a->page_map[(size_t)i * a->page_map_stride + c];
        if (page != AKV_PAGE_STAGED) {
          kp = (const char *)a->k_pages + (size_t)page * a->page_stride;
          vp = (const char *)a->v_pages + (size_t)page * a->page_stride;
        }
      }
      for (uint32_t kvh = 0; kvh < a->kv_heads; ++kvh) {
        const size_t head_off = (size_t)kvh * a->head_dim * 2u;
        chunk_partial(&g, i, kvh, c, kp + head_off, vp + head_off, a->row_bytes, n);
      }
    }
    combine(&g, i, n_chunks);
  }
  return AKV_OK;
fail:
  return st;
}

akv_status akv_attention_args_from_view(const akv_view *v, akv_attention_args *a) {
  if (v == NULL || a == NULL) return AKV_ERR_INVALID_ARGUMENT;
  a->dtype = v->dtype;
  a->n_contexts = v->n_contexts;
  a->kv_heads = v->kv_heads;
  a->head_dim = v->head_dim;
  a->k_base = v->base;
  a->v_base = (const char *)v->base + v->v_offset;
  a->context_stride = v->context_stride;
  a->row_bytes = v->row_stride;
  a->page_map = NULL;
  a->page_map_stride = 0;
  a->k_pages = a->v_pages = NULL;
  a->page_stride = 0;
  if (v->page_map != NULL) {
    a->chunk_tokens = v->page_tokens;
    a->page_map = v->page_map;
    a->page_map_stride = v->page_map_stride;
    a->k_pages = v->pages;
    a->v_pages = (const char *)v->pages + v->v_offset;
    a->page_stride = v->page_stride;
  }
  return AKV_OK;
}

akv_status akv_attention_paged_ref_bf16(const akv_attention_paged_args *a, akv_page_table t) {
  akv_status st = AKV_ERR_INVALID_ARGUMENT;
  ref_geom g;
  if (a == NULL) goto fail;
  st = geom_check(a->dtype, a->n_heads, a->kv_heads, a->head_dim, t.row_bytes, a->q, a->out);
  if (st != AKV_OK) goto fail;
  st = AKV_ERR_INVALID_ARGUMENT;
  if (t.batch == 0 || t.page_tokens == 0 || t.indptr == NULL || t.last_page_len == NULL ||
      t.k_pages == NULL || t.v_pages == NULL)
    goto fail;
  /* The table is checked whole before anything is written. */
  if (t.indptr[0] != 0) goto fail;
  for (uint32_t i = 0; i < t.batch; ++i) {
    if (t.indptr[i + 1] < t.indptr[i]) goto fail;
    const uint32_t np = t.indptr[i + 1] - t.indptr[i];
    if (np > t.max_pages) goto fail;
    if (np > 0 && (t.last_page_len[i] == 0 || t.last_page_len[i] > t.page_tokens)) goto fail;
  }
  if (t.indptr[t.batch] > 0 && t.indices == NULL) goto fail;

  g.n_heads = a->n_heads;
  g.kv_heads = a->kv_heads;
  g.group = a->n_heads / a->kv_heads;
  g.head_dim = a->head_dim;
  g.scale_log2 = a->scale * AKV_LOG2E_F;
  g.q = (const uint16_t *)a->q;
  g.out = a->out;
  g.max_chunks = t.max_pages;
  st = geom_bind(&g, t.batch, a->workspace, a->workspace_bytes);
  if (st != AKV_OK) goto fail;

  for (uint32_t i = 0; i < t.batch; ++i) {
    const uint32_t np = t.indptr[i + 1] - t.indptr[i];
    for (uint32_t c = 0; c < np; ++c) {
      const uint32_t page = t.indices[t.indptr[i] + c];
      const uint32_t n = (c + 1 == np) ? t.last_page_len[i] : t.page_tokens;
      const size_t off = (size_t)page * t.page_stride;
      for (uint32_t kvh = 0; kvh < a->kv_heads; ++kvh) {
        const size_t head_off = (size_t)kvh * a->head_dim * 2u;
        chunk_partial(&g, i, kvh, c, (const char *)t.k_pages + off + head_off,
                      (const char *)t.v_pages + off + head_off, t.row_bytes, n);
      }
    }
    combine(&g, i, np);
  }
  return AKV_OK;
fail:
  return st;
}
