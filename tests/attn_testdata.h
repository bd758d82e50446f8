/*
 * attn_testdata.h - the random bf16 and FP8 data of the attention tests
 * (CPU and GPU): a seeded xorshift generator, bf16 conversions, FP8 codes and
 * their float64 values (decoded here with ldexp, independently of the
 * library's bit-level decoders), and the host-side builder of a shuffled
 * paged copy of a contiguous history. Define ATTN_TEST_SEED before including
 * to pick the sequence. C, and C++ for nvcc.
 */
#ifndef AKV_ATTN_TESTDATA_H
#define AKV_ATTN_TESTDATA_H

#include <math.h>
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
/* Bytes of one K/V element of the dtypes the attention takes. */
static inline uint32_t attn_elem_bytes(akv_dtype dt) { return dt == AKV_DTYPE_BF16 ? 2u : 1u; }
/* NaN in every element of `bytes` bytes: bf16 NaN for bf16, 0xFF (NaN in
 * E4M3 and in E5M2) for FP8. */
static inline void fill_nan_dt(void *p, size_t bytes, akv_dtype dt) {
  if (dt == AKV_DTYPE_BF16) fill_nan16(p, bytes);
  else memset(p, 0xFF, bytes);
}
/* The float64 value of an FP8 code (OCP E4M3 "fn" or E5M2); NaN codes give NaN. */
static inline double fp8_to_f64(uint8_t c, akv_dtype dt) {
  const int sign = (c & 0x80) ? -1 : 1;
  if (dt == AKV_DTYPE_FP8_E4M3) {
    const int e = (c >> 3) & 15, m = c & 7;
    if (e == 15 && m == 7) return NAN;
    return sign * (e == 0 ? ldexp((double)m / 8.0, -6) : ldexp(1.0 + m / 8.0, e - 7));
  }
  const int e = (c >> 2) & 31, m = c & 3;
  if (e == 31) return m ? NAN : sign * INFINITY;
  return sign * (e == 0 ? ldexp((double)m / 4.0, -14) : ldexp(1.0 + m / 4.0, e - 15));
}
/* n random FP8 codes: random sign and mantissa, exponent field drawn from
 * the range whose values lie in about [2^-7, 8) plus one code in 16 from the
 * subnormals (zero included); never a NaN or an infinity. */
static inline void fill_random_fp8(uint8_t *p, size_t n, akv_dtype dt) {
  for (size_t i = 0; i < n; ++i) {
    const uint64_t r = rng_next();
    const uint8_t sign = (uint8_t)((r >> 20) & 0x80u);
    const int sub = (r & 15u) == 0;
    if (dt == AKV_DTYPE_FP8_E4M3) { /* e 0..9: 2^-6..2^2 * 1.875 */
      const uint8_t e = sub ? 0 : (uint8_t)(1 + (r >> 8) % 9u), m = (uint8_t)((r >> 4) & 7u);
      p[i] = (uint8_t)(sign | (e << 3) | m);
    } else { /* e 0..17: 2^-7..2^2 * 1.75 */
      const uint8_t e = sub ? 0 : (uint8_t)(8 + (r >> 8) % 10u), m = (uint8_t)((r >> 4) & 3u);
      p[i] = (uint8_t)(sign | (e << 2) | m);
    }
  }
}
/* n random elements of dtype dt at p: bf16 of amplitude amp, or FP8 codes. */
static inline void fill_random_dt(void *p, size_t n, akv_dtype dt, float amp) {
  if (dt == AKV_DTYPE_BF16) fill_random16((uint16_t *)p, n, amp);
  else fill_random_fp8((uint8_t *)p, n, dt);
}
/* The float64 value of element j of a row of dtype dt (before any scale). */
static inline double elem_to_f64(const char *row, size_t j, akv_dtype dt) {
  if (dt == AKV_DTYPE_BF16) {
    uint16_t h;
    memcpy(&h, row + 2 * j, sizeof h);
    return bf16_to_f64(h);
  }
  return fp8_to_f64((uint8_t)row[j], dt);
}

/* Naive float64 softmax attention of one context: n rows of K at k (V at
 * v), row_bytes apart, elements of dt (FP8 values times the head's scale,
 * in float64; scales NULL: 1), bf16 queries q[n_heads][d]; the result goes
 * to ref[n_heads][d] (zeros for n == 0). */
static inline void attn_naive_f64(akv_dtype dt, uint32_t n_heads, uint32_t kv_heads, uint32_t d,
                                  double scale, const uint16_t *q, const char *k, const char *v,
                                  uint64_t row_bytes, uint32_t n, const float *k_scale,
                                  const float *v_scale, double *ref) {
  const uint32_t group = n_heads / kv_heads;
  double *s = (double *)malloc((n ? n : 1) * sizeof(double));
  for (uint32_t h = 0; h < n_heads; ++h) {
    const uint32_t g = h / group;
    const size_t off = (size_t)g * d * attn_elem_bytes(dt);
    const double ks = k_scale ? (double)k_scale[g] : 1.0, vs = v_scale ? (double)v_scale[g] : 1.0;
    double m = -INFINITY, l = 0.0;
    for (uint32_t t = 0; t < n; ++t) {
      double dot = 0.0;
      for (uint32_t j = 0; j < d; ++j)
        dot += bf16_to_f64(q[(size_t)h * d + j]) * (elem_to_f64(k + t * row_bytes + off, j, dt) * ks);
      s[t] = dot * scale;
      if (s[t] > m) m = s[t];
    }
    for (uint32_t j = 0; j < d; ++j) ref[(size_t)h * d + j] = 0.0;
    for (uint32_t t = 0; t < n; ++t) {
      const double w = exp(s[t] - m);
      l += w;
      for (uint32_t j = 0; j < d; ++j)
        ref[(size_t)h * d + j] += w * (elem_to_f64(v + t * row_bytes + off, j, dt) * vs);
    }
    for (uint32_t j = 0; j < d; ++j) ref[(size_t)h * d + j] = n ? ref[(size_t)h * d + j] / l : 0.0;
  }
  free(s);
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

/* Builds pg from n_ctx contexts of len[i] rows of kv_heads * head_dim
 * elements of dtype dt: K row t of context i at base + i * context_stride +
 * t * row_bytes, its V row v_offset further. Pages hold page_tokens rows; the
 * pool has spare_pages pages nobody owns. Draws pool_pages - 1 numbers from
 * rng_next (the shuffle). Returns 0, or -1 (pg zeroed) when memory runs out. */
static inline int attn_paged_build_dt(attn_paged *pg, akv_dtype dt, uint32_t n_ctx,
                                      const uint32_t *len, uint32_t kv_heads, uint32_t head_dim,
                                      const char *base, uint64_t context_stride,
                                      uint64_t row_bytes, uint64_t v_offset, uint32_t page_tokens,
                                      uint32_t spare_pages) {
  memset(pg, 0, sizeof *pg);
  const uint32_t pt = page_tokens;
  const size_t payload = (size_t)kv_heads * head_dim * attn_elem_bytes(dt);
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
  fill_nan_dt(pg->k_pool, pg->pool_bytes, dt);
  fill_nan_dt(pg->v_pool, pg->pool_bytes, dt);
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
/* attn_paged_build_dt for bf16 rows. */
static inline int attn_paged_build(attn_paged *pg, uint32_t n_ctx, const uint32_t *len,
                                   uint32_t kv_heads, uint32_t head_dim, const char *base,
                                   uint64_t context_stride, uint64_t row_bytes, uint64_t v_offset,
                                   uint32_t page_tokens, uint32_t spare_pages) {
  return attn_paged_build_dt(pg, AKV_DTYPE_BF16, n_ctx, len, kv_heads, head_dim, base,
                             context_stride, row_bytes, v_offset, page_tokens, spare_pages);
}

#endif
