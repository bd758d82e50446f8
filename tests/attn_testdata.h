/*
 * attn_testdata.h - the random bf16 data of the attention tests (CPU and
 * GPU): a seeded xorshift generator, bf16 conversions, and the host-side
 * builder of a shuffled paged copy of a contiguous history. Define
 * ATTN_TEST_SEED before including to pick the sequence. C, and C++ for nvcc.
 */
#ifndef AKV_ATTN_TESTDATA_H
#define AKV_ATTN_TESTDATA_H

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "akv_attention.h"

#ifndef ATTN_TEST_SEED
#define ATTN_TEST_SEED 0x9E3779B97F4A7C15ull
#endif
#define BF16_NAN 0x7FC1u

static uint64_t rng_state = ATTN_TEST_SEED;

static inline uint64_t rng_next(void) {
  uint64_t x = rng_state;
  x ^= x << 13;
  x ^= x >> 7;
  x ^= x << 17;
  rng_state = x;
  return x;
}

/* Uniform in [-1, 1). */
static inline float rng_unit(void) {
  return (float)((double)(rng_next() >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}

static inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  u += 0x7FFFu + ((u >> 16) & 1u); /* round to nearest even; inputs are finite */
  return (uint16_t)(u >> 16);
}

static inline double bf16_to_f64(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return (double)f;
}

static inline void fill_nan16(void *p, size_t bytes) {
  uint16_t *h = (uint16_t *)p;
  for (size_t i = 0; i < bytes / 2; ++i) h[i] = BF16_NAN;
}

static inline void fill_random16(uint16_t *h, size_t n, float amp) {
  for (size_t i = 0; i < n; ++i) h[i] = f32_to_bf16(amp * rng_unit());
}

/* A paged copy, in host memory, of a contiguous history: pages scattered in
 * a pool in a shuffled order, with their own row padding and page padding.
 * Every byte no row fills (row and page padding, rows past the last, pages
 * nobody owns) is bf16 NaN. t points at the members below. */
typedef struct attn_paged {
  akv_page_table t;      /* host pointers */
  uint32_t *indptr;      /* [n_ctx + 1] */
  uint32_t *indices;     /* [total + 1] */
  uint32_t *last;        /* [n_ctx] */
  char *k_pool, *v_pool; /* pool_bytes each */
  uint32_t total;        /* pages owned: indptr[n_ctx] */
  uint32_t pool_pages;   /* total + the spare pages */
  size_t pool_bytes;     /* pool_pages * page_stride */
} attn_paged;

static inline void attn_paged_free(attn_paged *pg) {
  free(pg->indptr);
  free(pg->indices);
  free(pg->last);
  free(pg->k_pool);
  free(pg->v_pool);
  memset(pg, 0, sizeof *pg);
}

/* Builds pg from n_ctx contexts of len[i] bf16 rows of kv_heads * head_dim
 * elements: K row t of context i at base + i * context_stride + t * row_bytes,
 * its V row v_offset further. Pages hold page_tokens rows; the pool has
 * spare_pages pages nobody owns. Draws pool_pages - 1 numbers from rng_next
 * (the shuffle). Returns 0, or -1 (pg zeroed) when memory runs out. */
static inline int attn_paged_build(attn_paged *pg, uint32_t n_ctx, const uint32_t *len,
                                   uint32_t kv_heads, uint32_t head_dim, const char *base,
                                   uint64_t context_stride, uint64_t row_bytes, uint64_t v_offset,
                                   uint32_t page_tokens, uint32_t spare_pages) {
  memset(pg, 0, sizeof *pg);
  const uint32_t pt = page_tokens;
  const size_t payload = (size_t)kv_heads * head_dim * 2u;
  const uint64_t page_row = (uint64_t)payload + 16u;
  const uint64_t page_stride = pt * page_row + 48u;
  pg->indptr = (uint32_t *)malloc(((size_t)n_ctx + 1) * sizeof(uint32_t));
  pg->last = (uint32_t *)malloc(((size_t)n_ctx + 1) * sizeof(uint32_t));
  if (!pg->indptr || !pg->last) {
    attn_paged_free(pg);
    return -1;
  }
  uint32_t max_pages = 0;
  pg->indptr[0] = 0;
  for (uint32_t i = 0; i < n_ctx; ++i) {
    const uint32_t np = (len[i] + pt - 1) / pt;
    pg->indptr[i + 1] = pg->indptr[i] + np;
    pg->last[i] = np ? len[i] - (np - 1) * pt : 0;
    if (np > max_pages) max_pages = np;
  }
  pg->total = pg->indptr[n_ctx];
  pg->pool_pages = pg->total + spare_pages;
  pg->pool_bytes = (size_t)pg->pool_pages * page_stride;
  pg->indices = (uint32_t *)malloc(((size_t)pg->total + 1) * sizeof(uint32_t));
  pg->k_pool = (char *)malloc(pg->pool_bytes ? pg->pool_bytes : 1);
  pg->v_pool = (char *)malloc(pg->pool_bytes ? pg->pool_bytes : 1);
  uint32_t *perm = (uint32_t *)malloc(((size_t)pg->pool_pages + 1) * sizeof(uint32_t));
  if (!pg->indices || !pg->k_pool || !pg->v_pool || !perm) {
    free(perm);
    attn_paged_free(pg);
    return -1;
  }
  for (uint32_t i = 0; i < pg->pool_pages; ++i) perm[i] = i;
  for (uint32_t i = pg->pool_pages; i > 1;) { /* Fisher-Yates, i = pool_pages - 1 .. 1 */
    --i;
    const uint32_t j = (uint32_t)(rng_next() % (i + 1));
    const uint32_t tmp = perm[i];
    perm[i] = perm[j];
    perm[j] = tmp;
  }
  fill_nan16(pg->k_pool, pg->pool_bytes);
  fill_nan16(pg->v_pool, pg->pool_bytes);
  for (uint32_t i = 0; i < n_ctx; ++i)
    for (uint32_t c = 0; c < pg->indptr[i + 1] - pg->indptr[i]; ++c) {
      const uint32_t phys = perm[pg->indptr[i] + c];
      pg->indices[pg->indptr[i] + c] = phys;
      for (uint32_t r = 0; r < pt && c * pt + r < len[i]; ++r) {
        const char *src = base + i * context_stride + (size_t)(c * pt + r) * row_bytes;
        memcpy(pg->k_pool + phys * page_stride + r * page_row, src, payload);
        memcpy(pg->v_pool + phys * page_stride + r * page_row, src + v_offset, payload);
      }
    }
  free(perm);
  pg->t.batch = n_ctx;
  pg->t.page_tokens = pt;
  pg->t.max_pages = max_pages;
  pg->t.indptr = pg->indptr;
  pg->t.indices = pg->indices;
  pg->t.last_page_len = pg->last;
  pg->t.k_pages = pg->k_pool;
  pg->t.v_pages = pg->v_pool;
  pg->t.page_stride = page_stride;
  pg->t.row_bytes = page_row;
  return 0;
}

#endif
