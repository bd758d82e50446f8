/*
 * attn_testdata.h - the random bf16 data of the attention tests (CPU and
 * GPU): a seeded xorshift generator and bf16 conversions. Define
 * ATTN_TEST_SEED before including to pick the sequence.
 */
#ifndef AKV_ATTN_TESTDATA_H
#define AKV_ATTN_TESTDATA_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

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

#endif
