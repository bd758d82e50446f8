/*
 * attention_ref.c - the CPU reference of GQA decode attention (akv_attention.h).
 *
 * The structure is the one the CUDA kernels follow (attention_cuda.cu):
 * stage 1 computes one partial (m, l, acc[head_dim]) per (context, query head,
 * piece of a chunk; attention_pieces.h) into the workspace; stage 2 combines
 * a context's partials. Within a piece the reference works in two passes
 * (exact maximum first, then the exponentials and sums in row order), which
 * the GPU replaces by tiles with a running maximum; the two agree to rounding.
 *
 * Contiguous and paged calls share chunk_partials() and combine(): with
 * page_tokens == chunk_tokens each chunk sees the same rows in the same order,
 * so the two give the same bits.
 *
 * FP8 rows are decoded code by code into fp32 (exact: every E4M3 and E5M2
 * value is an fp32 value), the K scale is folded into the score factor and
 * the V scale applied once to the combined output (akv_attention.h).
 *
 * No allocation: per-call scratch lives on the stack (head_dim is bounded by
 * AKV_ATTENTION_MAX_HEAD_DIM), partials in the caller's workspace.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "akv_attention.h"
#include "attention_pieces.h"

/* log2(e) as a float: scores are kept in the base-2 domain (exp2). */

/* Workspace regions start on this alignment (matches attention_cuda.cu). */
#define AKV_WS_ALIGN ((size_t)256)

static float bf16_to_f32(uint16_t h) {
  uint32_t bits = (uint32_t)h << 16;
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}

/* OCP FP8 E4M3 ("fn" variant): bias 7, no infinity, S.1111.111 is NaN. */
static float e4m3_to_f32(uint8_t c) {
  const uint32_t sign = (uint32_t)(c & 0x80u) << 24;
  const uint32_t e = (c >> 3) & 0xFu, m = c & 7u;
  float f;
  if (e == 0) {
    f = (float)m * 0x1p-9f; /* subnormal: m/8 * 2^-6, exact */
    return sign ? -f : f;
  }
  if (e == 15 && m == 7) return NAN;
  const uint32_t bits = sign | ((e - 7u + 127u) << 23) | (m << 20);
  memcpy(&f, &bits, sizeof f);
  return f;
}

/* OCP FP8 E5M2: the top byte of an IEEE binary16 (bias 15, infinities, NaN). */
static float e5m2_to_f32(uint8_t c) {
  const uint32_t sign = (uint32_t)(c & 0x80u) << 24;
  const uint32_t e = (c >> 2) & 0x1Fu, m = c & 3u;
  float f;
  uint32_t bits;
  if (e == 0) {
    f = (float)m * 0x1p-16f; /* subnormal: m/4 * 2^-14, exact */
    return sign ? -f : f;
  }
  if (e == 31) bits = sign | 0x7F800000u | (m << 21); /* inf (m 0) or NaN */
  else bits = sign | ((e - 15u + 127u) << 23) | (m << 21);
  memcpy(&f, &bits, sizeof f);
  return f;
}

/* The d elements of one head row at p, decoded to fp32. */
static void decode_row(akv_dtype dtype, const char *p, float *dst, uint32_t d) {
  switch (dtype) {
  case AKV_DTYPE_FP8_E4M3:
    for (uint32_t j = 0; j < d; ++j) dst[j] = e4m3_to_f32((uint8_t)p[j]);
    break;
  case AKV_DTYPE_FP8_E5M2:
    for (uint32_t j = 0; j < d; ++j) dst[j] = e5m2_to_f32((uint8_t)p[j]);
    break;
  default: { /* bf16, the only other dtype geom_check lets through */
    uint16_t h;
    for (uint32_t j = 0; j < d; ++j) {
      memcpy(&h, p + 2u * j, sizeof h);
      dst[j] = bf16_to_f32(h);
    }
  }
  }
}

static size_t align_up(size_t x) { return (x + AKV_WS_ALIGN - 1) & ~(AKV_WS_ALIGN - 1); }

/* Multiplies with an overflow check; returns 0 on overflow. */
static int mul_ok(size_t a, size_t b, size_t *out) {
  if (a != 0 && b > SIZE_MAX / a) return 0;
  *out = a * b;
  return 1;
}

/* Workspace layout shared by every variant (max_chunks counts piece slots:
 * chunks times akv_attn_pieces):
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

/* Piece slots per (context, head) for histories of up to max_tokens rows;
 * 0 when the count does not fit 32 bits. */
static int slots_for(uint32_t max_tokens, uint32_t chunk_tokens, uint32_t *out) {
  const uint64_t s = (uint64_t)div_up(max_tokens, chunk_tokens) * akv_attn_pieces(chunk_tokens);
  if (s > UINT32_MAX) return 0;
  *out = (uint32_t)s;
  return 1;
}

akv_status akv_attention_workspace_bytes(uint32_t n_contexts, uint32_t n_heads,
                                         uint32_t head_dim, uint32_t max_tokens,
                                         uint32_t chunk_tokens, size_t *out) {
  akv_status st = AKV_ERR_INVALID_ARGUMENT;
  size_t acc_bytes, total;
  uint32_t slots;
  if (out == NULL || !akv_attn_aligned_to(out, _Alignof(size_t)) || n_contexts == 0 ||
      n_heads == 0 || head_dim == 0 ||
      !akv_attn_chunk_ok(chunk_tokens) || head_dim > AKV_ATTENTION_MAX_HEAD_DIM)
    goto fail;
  if (!slots_for(max_tokens, chunk_tokens, &slots) ||
      !ws_layout(n_contexts, n_heads, head_dim, slots, &acc_bytes, &total))
    goto fail;
  *out = total;
  return AKV_OK;
fail:
  return st;
}

/* The geometry both variants share, checked once. */
typedef struct ref_geom {
  uint32_t n_heads, kv_heads, group, head_dim;
  akv_dtype dtype;
  uint32_t esize;    /* bytes per K/V element */
  float scale_log2;  /* scale * log2(e) */
  const float *k_scale, *v_scale; /* [kv_heads] or NULL (1) */
  const uint16_t *q;
  float *out;
  float *acc; /* workspace acc region */
  float *ml;  /* workspace ml region */
  uint32_t max_chunks; /* piece slots per (context, head) */
  size_t ws_used;      /* workspace bytes the call writes (akv_attention_workspace_bytes) */
} ref_geom;

static akv_status geom_check(akv_dtype dtype, uint32_t n_heads, uint32_t kv_heads,
                             uint32_t head_dim, uint64_t row_bytes, float scale, const void *q,
                             const float *out, const void *workspace, const float *k_scale,
                             const float *v_scale) {
  const akv_status st = akv_attn_args_check(dtype, n_heads, kv_heads, head_dim, row_bytes, scale,
                                            q, out, k_scale, v_scale);
  if (st != AKV_OK) return st;
  /* q is read as bf16, out and the workspace are written as fp32. */
  if ((uintptr_t)q % _Alignof(uint16_t) != 0 || (uintptr_t)out % _Alignof(float) != 0 ||
      (uintptr_t)workspace % _Alignof(float) != 0)
    return AKV_ERR_INVALID_ARGUMENT;
  return AKV_OK;
}

static void geom_fill(ref_geom *g, akv_dtype dtype, uint32_t n_heads, uint32_t kv_heads,
                      uint32_t head_dim, float scale, const void *q, float *out,
                      const float *k_scale, const float *v_scale) {
  g->n_heads = n_heads;
  g->kv_heads = kv_heads;
  g->group = n_heads / kv_heads;
  g->head_dim = head_dim;
  g->dtype = dtype;
  g->esize = akv_attn_elem_bytes(dtype);
  g->scale_log2 = scale * AKV_ATTN_LOG2E_F;
  g->k_scale = k_scale;
  g->v_scale = v_scale;
  g->q = (const uint16_t *)q;
  g->out = out;
}

/* Binds the workspace; fails when it is too small for max_chunks. */
static akv_status geom_bind(ref_geom *g, uint32_t n_contexts, void *workspace,
                            size_t workspace_bytes) {
  size_t acc_bytes, total;
  if (!ws_layout(n_contexts, g->n_heads, g->head_dim, g->max_chunks, &acc_bytes, &total))
    return AKV_ERR_INVALID_ARGUMENT;
  if (workspace_bytes < total || (total != 0 && workspace == NULL))
    return AKV_ERR_INVALID_ARGUMENT;
  /* A workspace of 0 bytes (NULL included) serves calls whose lengths are
   * all 0: nothing is then read or written through it, and no offset is
   * formed from a NULL workspace (pointer arithmetic on NULL is undefined). */
  g->ws_used = total;
  g->acc = (float *)workspace;
  g->ml = total == 0 ? (float *)workspace : (float *)((char *)workspace + acc_bytes);
  return AKV_OK;
}

static float dot_row(const float *qf, const float *kf, uint32_t d) {
  float s = 0.0f;
  for (uint32_t j = 0; j < d; ++j) s += qf[j] * kf[j];
  return s;
}

/*
 * Stage 1 for one (context, kv head, piece): n rows starting at k_rows/v_rows
 * (already offset to the kv head), row_bytes apart. Writes the partials of
 * every query head of the group into piece slot `chunk` of the context.
 */
static void chunk_partial(const ref_geom *g, uint32_t ctx, uint32_t kvh, uint32_t chunk,
                          const char *k_rows, const char *v_rows, uint64_t row_bytes,
                          uint32_t n) {
  const uint32_t d = g->head_dim;
  float qf[AKV_ATTENTION_MAX_HEAD_DIM], kf[AKV_ATTENTION_MAX_HEAD_DIM],
      vf[AKV_ATTENTION_MAX_HEAD_DIM];
  /* The K scale folds into the score factor, once per kv head. */
  const float c = g->k_scale ? g->scale_log2 * g->k_scale[kvh] : g->scale_log2;
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
      decode_row(g->dtype, k_rows + t * row_bytes, kf, d);
      const float s = dot_row(qf, kf, d) * c;
      m = fmaxf(m, s);
    }
    /* Pass 2: exponentials, their sum and the weighted V rows, in row order. */
    const float m_use = (m == -INFINITY) ? 0.0f : m;
    for (uint32_t t = 0; t < n; ++t) {
      decode_row(g->dtype, k_rows + t * row_bytes, kf, d);
      const float s = dot_row(qf, kf, d) * c;
      const float p = exp2f(s - m_use);
      decode_row(g->dtype, v_rows + t * row_bytes, vf, d);
      l += p;
      for (uint32_t j = 0; j < d; ++j) acc[j] += p * vf[j];
    }
    g->ml[slot * 2 + 0] = m;
    g->ml[slot * 2 + 1] = l;
  }
}

/*
 * Stage 1 for one chunk of n rows (1..chunk_tokens) at k_chunk/v_chunk:
 * every kv head of every piece, the pieces into slots chunk * pieces + j.
 * j * prow never wraps: pieces * prow fits 32 bits for every chunk size the
 * calls take (akv_attn_chunk_ok).
 */
static void chunk_partials(const ref_geom *g, uint32_t ctx, uint32_t chunk, uint32_t chunk_tokens,
                           const char *k_chunk, const char *v_chunk, uint64_t row_bytes,
                           uint32_t n) {
  const uint32_t pieces = akv_attn_pieces(chunk_tokens), prow = akv_attn_piece_rows(chunk_tokens);
  for (uint32_t j = 0; j < pieces && j * prow < n; ++j) {
    const uint32_t first = j * prow;
    const uint32_t rows = n - first < prow ? n - first : prow;
    for (uint32_t kvh = 0; kvh < g->kv_heads; ++kvh) {
      const size_t off = (size_t)first * row_bytes + (size_t)kvh * g->head_dim * g->esize;
      chunk_partial(g, ctx, kvh, chunk * pieces + j, k_chunk + off, v_chunk + off, row_bytes,
                    rows);
    }
  }
}

/* Stage 2 for one context: combines piece slots [0, n_chunks) in order and
 * applies the V scale. */
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
    const float vs = g->v_scale ? g->v_scale[h / g->group] : 1.0f;
    /* Zeros only where l == 0: no rows, or every score -inf (akv_attention.h,
     * "Algorithm"). A NaN l (a NaN score: NaN q or K, an FP8 NaN code, a
     * score that overflowed) gives NaN, never a plausible 0. */
    for (uint32_t j = 0; j < d; ++j) out[j] = ((l != 0.0f) ? o[j] / l : 0.0f) * vs;
  }
}

akv_status akv_attention_ref_bf16(const akv_attention_args *args) {
  akv_status st = AKV_ERR_INVALID_ARGUMENT;
  ref_geom g;
  uint32_t max_len = 0;
  /* *args is read once, here: the caller's struct may lie in out or the
   * workspace, which the call writes (akv_attention.h, "Overlap"). */
  akv_attention_args local;
  const akv_attention_args *a = &local;
  if (args == NULL || !akv_attn_aligned_to(args, _Alignof(akv_attention_args))) goto fail;
  local = *args;
  st = geom_check(a->dtype, a->n_heads, a->kv_heads, a->head_dim, a->row_bytes, a->scale, a->q,
                  a->out, a->workspace, a->k_scale, a->v_scale);
  if (st != AKV_OK) goto fail;
  st = AKV_ERR_INVALID_ARGUMENT;
  /* The chunk bound keeps every piece's first row within 32 bits
   * (chunk_partials; attention_pieces.h), whatever the lengths. */
  if (a->n_contexts == 0 || !akv_attn_chunk_ok(a->chunk_tokens) || a->len == NULL ||
      a->k_base == NULL || a->v_base == NULL)
    goto fail;
  if (a->page_map != NULL && (a->page_map_stride == 0 || a->k_pages == NULL || a->v_pages == NULL))
    goto fail;
  if (!akv_attn_aligned4(a->len) || !akv_attn_aligned4(a->page_map)) goto fail;
  if (!akv_attn_array_fits(a->len, a->n_contexts, 4u)) goto fail; /* before len is read */
  /* The page map's shape, [n_contexts][page_map_stride] uint32, fits the
   * address space: every entry's address is formed without wrapping. */
  if (a->page_map != NULL) {
    akv_attn_span map;
    uint64_t map_bytes;
    if (!akv_attn_mul4(a->n_contexts, a->page_map_stride, 4u, 1u, &map_bytes) ||
        !akv_attn_span_at(a->page_map, map_bytes, &map))
      goto fail;
  }
  {
    /* Every row offset the call forms fits ptrdiff_t: rows 0..len-1 of every
     * context at k_base/v_base (also those a page override redirects) here,
     * the rows of every overriding page below. */
    const uint64_t extent = (uint64_t)a->kv_heads * a->head_dim * akv_attn_elem_bytes(a->dtype);
    for (uint32_t i = 0; i < a->n_contexts; ++i) {
      const uint32_t len = a->len[i];
      if (len > max_len) max_len = len;
      if (len == 0) continue;
      if (!akv_attn_rows_addressable(a->k_base, i, a->context_stride, len - 1u, a->row_bytes,
                                     extent) ||
          !akv_attn_rows_addressable(a->v_base, i, a->context_stride, len - 1u, a->row_bytes,
                                     extent))
        goto fail;
    }
  }

  /* The workspace is checked before the page map is read: a call whose
   * lengths ask for more than the workspace holds is refused without
   * reading the entries those lengths would look up. */
  geom_fill(&g, a->dtype, a->n_heads, a->kv_heads, a->head_dim, a->scale, a->q, a->out,
            a->k_scale, a->v_scale);
  if (!slots_for(max_len, a->chunk_tokens, &g.max_chunks)) goto fail;
  st = geom_bind(&g, a->n_contexts, a->workspace, a->workspace_bytes);
  if (st != AKV_OK) goto fail;
  st = AKV_ERR_INVALID_ARGUMENT;

  if (a->page_map != NULL) {
    const uint64_t extent = (uint64_t)a->kv_heads * a->head_dim * akv_attn_elem_bytes(a->dtype);
    for (uint32_t i = 0; i < a->n_contexts; ++i) {
      const uint32_t len = a->len[i];
      if (len == 0) continue;
      const uint32_t n_chunks = div_up(len, a->chunk_tokens);
      for (uint32_t c = 0; c < n_chunks && c < a->page_map_stride; ++c) {
        const uint32_t page = a->page_map[(size_t)i * a->page_map_stride + c];
        const uint32_t rem = len - c * a->chunk_tokens;
        const uint32_t n = rem < a->chunk_tokens ? rem : a->chunk_tokens;
        if (page != AKV_PAGE_STAGED &&
            (!akv_attn_rows_addressable(a->k_pages, page, a->page_stride, n - 1u, a->row_bytes,
                                        extent) ||
             !akv_attn_rows_addressable(a->v_pages, page, a->page_stride, n - 1u, a->row_bytes,
                                        extent)))
          goto fail;
      }
    }
  }
  if (!akv_attn_contig_clear(a, g.ws_used, 1)) goto fail;

  for (uint32_t i = 0; i < a->n_contexts; ++i) {
    const uint32_t n_chunks = div_up(a->len[i], a->chunk_tokens);
    for (uint32_t c = 0; c < n_chunks; ++c) {
      const uint32_t first = c * a->chunk_tokens;
      const uint32_t rem = a->len[i] - first;
      const uint32_t n = rem < a->chunk_tokens ? rem : a->chunk_tokens;
      /* Offsets checked above: they fit ptrdiff_t. */
      size_t off = (size_t)i * a->context_stride + (size_t)first * a->row_bytes;
      const char *kb = (const char *)a->k_base, *vb = (const char *)a->v_base;
      if (a->page_map != NULL && c < a->page_map_stride) {
        const uint32_t page = a->page_map[(size_t)i * a->page_map_stride + c];
        if (page != AKV_PAGE_STAGED) {
          off = (size_t)page * a->page_stride;
          kb = (const char *)a->k_pages;
          vb = (const char *)a->v_pages;
        }
      }
      const char *kp = kb + off, *vp = vb + off;
      chunk_partials(&g, i, c, a->chunk_tokens, kp, vp, a->row_bytes, n);
    }
    combine(&g, i,
            (uint32_t)akv_attn_context_slots(n_chunks,
                                             a->len[i] - (n_chunks ? (n_chunks - 1) : 0) *
                                                             a->chunk_tokens,
                                             a->chunk_tokens));
  }
  return AKV_OK;
fail:
  return st;
}

akv_status akv_attention_args_from_view(const akv_view *view, akv_attention_args *a) {
  if (view == NULL || a == NULL || !akv_attn_aligned_to(view, _Alignof(akv_view)) ||
      !akv_attn_aligned_to(a, _Alignof(akv_attention_args)))
    return AKV_ERR_INVALID_ARGUMENT;
  /* The view is read whole before *a is written: the two may share memory. */
  const akv_view copy = *view, *v = &copy;
  /* A view an engine made has its rows, and on the paged route its pages
   * and page size; V sits v_offset past each without wrapping. Anything
   * else is refused before *a is written. */
  if (v->base == NULL || v->v_offset > UINTPTR_MAX - (uintptr_t)v->base)
    return AKV_ERR_INVALID_ARGUMENT;
  if (v->page_map != NULL &&
      (v->pages == NULL || v->page_tokens == 0 || v->page_map_stride == 0 ||
       v->v_offset > UINTPTR_MAX - (uintptr_t)v->pages))
    return AKV_ERR_INVALID_ARGUMENT;
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

/* Whether what a paged call writes is clear of everything it reads and of
 * each other (akv_attention.h, "Overlap"): q, the scales, the table's three
 * arrays (indices: its indptr[batch] entries) and the rows of every page.
 * Runs after the table and addressing checks, before anything is written. */
static int paged_clear(const akv_attention_paged_args *a, const akv_page_table *t,
                       const ref_geom *g) {
  akv_attn_writes w;
  if (!akv_attn_dense_clear(t->batch, a->n_heads, a->head_dim, a->kv_heads, a->q, a->out,
                            a->workspace, g->ws_used, a->k_scale, a->v_scale, &w) ||
      !akv_attn_array_clear(&w, t->indptr, (uint64_t)t->batch + 1u, 4u) ||
      !akv_attn_array_clear(&w, t->last_page_len, t->batch, 4u) ||
      !akv_attn_array_clear(&w, t->indices, t->indptr[t->batch], 4u))
    return 0;
  const uint64_t extent = (uint64_t)a->kv_heads * a->head_dim * g->esize;
  for (uint32_t i = 0; i < t->batch; ++i)
    for (uint32_t p = t->indptr[i]; p < t->indptr[i + 1]; ++p) {
      const uint32_t n = (p + 1 == t->indptr[i + 1]) ? t->last_page_len[i] : t->page_tokens;
      if (!akv_attn_rows_clear(&w, t->k_pages, t->indices[p], t->page_stride, n - 1u,
                               t->row_bytes, extent) ||
          !akv_attn_rows_clear(&w, t->v_pages, t->indices[p], t->page_stride, n - 1u,
                               t->row_bytes, extent))
        return 0;
    }
  return 1;
}

akv_status akv_attention_paged_ref_bf16(const akv_attention_paged_args *args,
                                        akv_page_table t) {
  akv_status st = AKV_ERR_INVALID_ARGUMENT;
  ref_geom g;
  /* Read once, as akv_attention_ref_bf16 reads its struct. */
  akv_attention_paged_args local;
  const akv_attention_paged_args *a = &local;
  if (args == NULL || !akv_attn_aligned_to(args, _Alignof(akv_attention_paged_args))) goto fail;
  local = *args;
  st = geom_check(a->dtype, a->n_heads, a->kv_heads, a->head_dim, t.row_bytes, a->scale, a->q,
                  a->out, a->workspace, a->k_scale, a->v_scale);
  if (st != AKV_OK) goto fail;
  st = AKV_ERR_INVALID_ARGUMENT;
  /* indices may be NULL for a table without pages (akv_attention.h, "Empty
   * arrays"): checked below, once indptr[batch] is known. */
  if (t.batch == 0 || !akv_attn_chunk_ok(t.page_tokens) || t.indptr == NULL ||
      t.last_page_len == NULL || t.k_pages == NULL || t.v_pages == NULL)
    goto fail;
  if (!akv_attn_aligned4(t.indptr) || !akv_attn_aligned4(t.indices) ||
      !akv_attn_aligned4(t.last_page_len))
    goto fail;
  /* Their shapes fit the address space before they are read. */
  if (!akv_attn_array_fits(t.indptr, (uint64_t)t.batch + 1u, 4u) ||
      !akv_attn_array_fits(t.last_page_len, t.batch, 4u))
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
  if (!akv_attn_array_fits(t.indices, t.indptr[t.batch], 4u)) goto fail; /* before it is read */
  /* The workspace is checked before indices is read: a table whose
   * max_pages asks for more than the workspace holds is refused without
   * reading the page ids its indptr names. */
  geom_fill(&g, a->dtype, a->n_heads, a->kv_heads, a->head_dim, a->scale, a->q, a->out,
            a->k_scale, a->v_scale);
  {
    const uint64_t slots = (uint64_t)t.max_pages * akv_attn_pieces(t.page_tokens);
    if (slots > UINT32_MAX) goto fail;
    g.max_chunks = (uint32_t)slots;
  }
  st = geom_bind(&g, t.batch, a->workspace, a->workspace_bytes);
  if (st != AKV_OK) goto fail;
  st = AKV_ERR_INVALID_ARGUMENT;
  {
    /* Page ids are not range-checked (the table does not know the pool),
     * but every row offset the call forms fits ptrdiff_t. */
    const uint64_t extent = (uint64_t)a->kv_heads * a->head_dim * akv_attn_elem_bytes(a->dtype);
    for (uint32_t i = 0; i < t.batch; ++i)
      for (uint32_t p = t.indptr[i]; p < t.indptr[i + 1]; ++p) {
        const uint32_t n = (p + 1 == t.indptr[i + 1]) ? t.last_page_len[i] : t.page_tokens;
        if (!akv_attn_rows_addressable(t.k_pages, t.indices[p], t.page_stride, n - 1u,
                                       t.row_bytes, extent) ||
            !akv_attn_rows_addressable(t.v_pages, t.indices[p], t.page_stride, n - 1u,
                                       t.row_bytes, extent))
          goto fail;
      }
  }
  if (!paged_clear(a, &t, &g)) goto fail;

  for (uint32_t i = 0; i < t.batch; ++i) {
    const uint32_t np = t.indptr[i + 1] - t.indptr[i];
    for (uint32_t c = 0; c < np; ++c) {
      const uint32_t page = t.indices[t.indptr[i] + c];
      const uint32_t n = (c + 1 == np) ? t.last_page_len[i] : t.page_tokens;
      const size_t off = (size_t)page * t.page_stride;
      chunk_partials(&g, i, c, t.page_tokens, (const char *)t.k_pages + off,
                     (const char *)t.v_pages + off, t.row_bytes, n);
    }
    combine(&g, i,
            (uint32_t)akv_attn_context_slots(np, np ? t.last_page_len[i] : 0, t.page_tokens));
  }
  return AKV_OK;
fail:
  return st;
}
