/*
 * test_model_window.c - the CLI model's sliding-window layers (hybrid
 * geometries), on the CPU model.
 *
 * What the hybrid decode of the CLI rests on:
 *  - layer bookkeeping: which layers are dense, their engine index, and the
 *    way back, for the presets' patterns;
 *  - a window wider than the history gives the same logits, bit for bit, as
 *    the same geometry with every layer dense over the same rows (the
 *    sliding rows are where the dense ones would be, the new row lands in
 *    its place and attention covers the same rows);
 *  - once the window wraps, only the last window - 1 tokens matter: a lane
 *    prefilled with the whole history and a lane prefilled with just those
 *    tokens decode identically for several steps, and a token that has left
 *    the window can be changed freely;
 *  - teeth: changing one row still inside the window changes the logits;
 *  - misuse is refused with an error: no window rows, a lane not reserved,
 *    a dense geometry, rows past the model's size.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "model.h"

#define NCTX 2
#define MAXTOK 96

static model_geometry tiny_geometry(uint32_t window, uint32_t dense_every) {
  model_geometry g = {4, 4, 2, 16, 64, 128, 256, 10000.0f, 1e-5f, window, dense_every};
  return g;
}

static model *make(const model_geometry *g) {
  model_options o;
  memset(&o, 0, sizeof o);
  o.seed = 5;
  o.max_batch = NCTX;
  o.chunk_tokens = 16;
  o.max_tokens = MAXTOK;
  char err[256] = "";
  model *m = NULL;
  int rc = model_cpu_create(g, &o, &m, err, sizeof err);
  if (rc != 0) fail_msg("model_cpu_create: %s", err);
  return m;
}

/* Rows of the synthetic history, K and V, for `count` model layers. */
typedef struct rows {
  uint16_t *buf;
  const void *k[8], *v[8];
} rows;

static void rows_make(rows *r, const model_geometry *g, uint32_t ctx, uint32_t first, uint32_t n,
                      const uint32_t *layers, uint32_t count) {
  const uint32_t kv = g->kv_heads * g->head_dim;
  r->buf = calloc((size_t)2 * count * (n ? n : 1) * kv, sizeof(uint16_t));
  assert_non_null(r->buf);
  for (uint32_t j = 0; j < count; ++j) {
    uint16_t *k = r->buf + (size_t)(2 * j) * n * kv, *v = k + (size_t)n * kv;
    for (uint32_t t = 0; t < n; ++t) {
      model_history_row(7, ctx, layers[j], 0, first + t, k + (size_t)t * kv, kv);
      model_history_row(7, ctx, layers[j], 1, first + t, v + (size_t)t * kv, kv);
    }
    r->k[j] = k;
    r->v[j] = v;
  }
}

/* Lists the model layers that are dense (want_dense) or sliding. */
static uint32_t layers_of(const model_geometry *g, int want_dense, uint32_t *out) {
  uint32_t n = 0;
  for (uint32_t l = 0; l < g->n_layers; ++l)
    if (model_layer_dense(g, l) == want_dense) out[n++] = l;
  return n;
}

/* Prefills the resident store (dense layers) of every context with `len` rows. */
static void fill_resident(model *m, uint32_t len) {
  uint32_t dl[8];
  uint32_t nd = layers_of(&m->g, 1, dl);
  assert_int_equal(model_resident_reserve(m, NCTX, MAXTOK), 0);
  for (uint32_t c = 0; c < NCTX; ++c) {
    rows r;
    rows_make(&r, &m->g, c, 0, len, dl, nd);
    assert_int_equal(model_resident_append(m, c, 0, len, r.k, r.v), 0);
    free(r.buf);
  }
}

/* Writes tokens [first, first+n) of every sliding layer of context c into lane. */
static void fill_window(model *m, uint32_t lane, uint32_t c, uint32_t first, uint32_t n) {
  uint32_t sl[8];
  uint32_t ns = layers_of(&m->g, 0, sl);
  rows r;
  rows_make(&r, &m->g, c, first, n, sl, ns);
  assert_int_equal(model_window_append(m, lane, c, first, n, r.k, r.v), 0);
  free(r.buf);
}

/* The dense layers attend over the resident store; lens advance per step. */
typedef struct res_state {
  uint32_t len[NCTX];
} res_state;

static int attend_resident(void *user, model *m, uint32_t layer) {
  res_state *s = user;
  model_kv_view v;
  if (model_resident_view(m, layer, s->len, NCTX, &v) != 0) return -1;
  return model_attend(m, layer, &v);
}

/* One forward on `lane` at positions len (the resident lens are not
 * advanced: two forwards at the same position see the same dense rows). */
static void forward(model *m, uint32_t lane, const uint32_t *len, const int32_t *tok,
                    float *logits) {
  res_state s;
  memcpy(s.len, len, sizeof s.len);
  if (model_forward(m, lane, NCTX, tok, len, attend_resident, &s, logits) != 0)
    fail_msg("forward: %s", model_error(m));
}

/* ------------------------------------------------------------------ tests */

static void test_layer_bookkeeping(void **state) {
  (void)state;
  model_geometry dense = tiny_geometry(0, 0), hy = tiny_geometry(8, 2);
  model_geometry gemma = {48, 16, 8, 256, 3840, 15360, 262208, 1e6f, 1e-6f, 1024, 6};
  assert_int_equal(model_dense_layers(&dense), 4);
  assert_int_equal(model_window_layers(&dense), 0);
  assert_int_equal(model_dense_layers(&hy), 2);
  assert_false(model_layer_dense(&hy, 0));
  assert_true(model_layer_dense(&hy, 1));
  assert_true(model_layer_dense(&hy, 3));
  assert_int_equal(model_dense_layers(&gemma), 8);
  assert_int_equal(model_window_layers(&gemma), 40);
  for (uint32_t d = 0; d < model_dense_layers(&gemma); ++d) {
    uint32_t l = model_dense_layer(&gemma, d);
    assert_true(model_layer_dense(&gemma, l));
    assert_int_equal(model_dense_before(&gemma, l), d);
  }
  uint32_t seen = 0;
  for (uint32_t l = 0; l < gemma.n_layers; ++l) seen += model_layer_dense(&gemma, l);
  assert_int_equal(seen, 8);
  /* window 1 slides over the new token alone; dense_every 1 means all dense */
  model_geometry one = tiny_geometry(8, 1);
  assert_false(model_hybrid(&one));
  char err[256];
  assert_int_not_equal(model_hybrid_check(&one, err, sizeof err), 0);
  model_geometry wide = tiny_geometry(8, 5); /* no dense layer in 4 */
  assert_int_not_equal(model_hybrid_check(&wide, err, sizeof err), 0);
  assert_non_null(strstr(err, "--dense-every"));
}

/* A window wider than every position: sliding == dense, bit for bit. */
static void test_wide_window_equals_dense(void **state) {
  (void)state;
  const uint32_t len0 = 37, steps = 4;
  model_geometry gh = tiny_geometry(MAXTOK, 2), gd = tiny_geometry(0, 0);
  model *mh = make(&gh), *md = make(&gd);
  fill_resident(mh, len0);
  fill_resident(md, len0);
  assert_int_equal(model_window_reserve(mh, 1, NCTX), 0);
  for (uint32_t c = 0; c < NCTX; ++c) fill_window(mh, 0, c, 0, len0);

  const uint32_t V = gh.vocab;
  float *a = malloc(sizeof(float) * NCTX * V), *b = malloc(sizeof(float) * NCTX * V);
  uint32_t len[NCTX] = {len0, len0};
  int32_t tok[NCTX] = {3, 200};
  for (uint32_t s = 0; s < steps; ++s) {
    forward(mh, 0, len, tok, a);
    forward(md, 0, len, tok, b);
    assert_memory_equal(a, b, sizeof(float) * NCTX * V);
    for (uint32_t c = 0; c < NCTX; ++c) {
      len[c]++;
      tok[c] = (int32_t)((tok[c] * 31 + 7) % (int32_t)V);
    }
  }
  free(a);
  free(b);
  model_destroy(mh);
  model_destroy(md);
}

/* After the window wraps only the last window - 1 tokens count. */
static void test_window_keeps_only_recent(void **state) {
  (void)state;
  const uint32_t W = 8, len0 = 50, steps = 12;
  model_geometry g = tiny_geometry(W, 4); /* layers 0..2 slide, layer 3 is dense */
  model *m = make(&g);
  fill_resident(m, len0);
  assert_int_equal(model_window_reserve(m, 4, NCTX), 0);
  for (uint32_t c = 0; c < NCTX; ++c) {
    fill_window(m, 0, c, 0, len0);                  /* lane 0: the whole history */
    fill_window(m, 1, c, len0 - (W - 1), W - 1);    /* lane 1: the window's part */
    fill_window(m, 2, c, len0 - (W - 1), W - 1);    /* lane 2: one in-window row changed */
    fill_window(m, 3, c, 0, len0);                  /* lane 3: a left token changed */
  }
  /* lane 2: token len0 - 3 of context 1 becomes token len0 - 20's row */
  {
    uint32_t sl[8];
    uint32_t ns = layers_of(&g, 0, sl);
    rows r;
    rows_make(&r, &g, 1, len0 - 20, 1, sl, ns);
    assert_int_equal(model_window_append(m, 2, 1, len0 - 3, 1, r.k, r.v), 0);
    /* lane 3: token len0 - W (outside the window of the first step) */
    assert_int_equal(model_window_append(m, 3, 1, len0 - W, 1, r.k, r.v), 0);
    free(r.buf);
  }

  const uint32_t V = g.vocab;
  const size_t lb = sizeof(float) * NCTX * V;
  float *l0 = malloc(lb), *l1 = malloc(lb), *l2 = malloc(lb), *l3 = malloc(lb);
  uint32_t len[NCTX] = {len0, len0};
  int32_t tok[NCTX] = {11, 97};
  int differed = 0;
  for (uint32_t s = 0; s < steps; ++s) {
    forward(m, 0, len, tok, l0);
    forward(m, 1, len, tok, l1);
    forward(m, 3, len, tok, l3);
    /* The lanes share the dense layer's resident rows, and each forward
     * writes its new dense row at len before attending; lane 2 runs last, so
     * the next step's lanes all read the same dense rows again. */
    forward(m, 2, len, tok, l2);
    assert_memory_equal(l0, l1, lb);
    assert_memory_equal(l0, l3, lb);
    /* context 0 is untouched in lane 2 */
    assert_memory_equal(l0, l2, sizeof(float) * V);
    if (memcmp(l0 + V, l2 + V, sizeof(float) * V) != 0) differed = 1;
    /* the changed row is read at the first step (later steps also carry
     * lane 2's own different outputs, so only the first is asserted) */
    if (s == 0) assert_true(differed);
    for (uint32_t c = 0; c < NCTX; ++c) {
      len[c]++;
      tok[c] = (int32_t)((tok[c] * 17 + 5) % (int32_t)V);
    }
  }
  free(l0);
  free(l1);
  free(l2);
  free(l3);
  model_destroy(m);
}

static void test_misuse_refused(void **state) {
  (void)state;
  model_geometry gd = tiny_geometry(0, 0), gh = tiny_geometry(8, 2);
  model *md = make(&gd), *mh = make(&gh);
  /* a dense geometry has no window rows */
  assert_int_not_equal(model_window_reserve(md, 1, NCTX), 0);
  /* a sliding layer with no rows reserved fails the forward with a message */
  fill_resident(mh, 4);
  float *lg = malloc(sizeof(float) * NCTX * gh.vocab);
  uint32_t len[NCTX] = {4, 4};
  int32_t tok[NCTX] = {1, 2};
  res_state s;
  memcpy(s.len, len, sizeof s.len);
  assert_int_not_equal(model_forward(mh, 0, NCTX, tok, len, attend_resident, &s, lg), 0);
  assert_non_null(strstr(model_error(mh), "model_window_reserve"));
  assert_int_equal(model_window_reserve(mh, 1, NCTX), 0);
  assert_int_not_equal(model_window_reserve(mh, 1, NCTX), 0); /* once */
  /* lane 1 was not reserved */
  assert_int_not_equal(model_forward(mh, 1, NCTX, tok, len, attend_resident, &s, lg), 0);
  /* rows past the model's size, a context or lane out of range */
  uint32_t sl[8];
  uint32_t ns = layers_of(&gh, 0, sl);
  rows r;
  rows_make(&r, &gh, 0, 0, 2, sl, ns);
  assert_int_not_equal(model_window_append(mh, 0, 0, MAXTOK - 1, 2, r.k, r.v), 0);
  assert_int_not_equal(model_window_append(mh, 0, NCTX, 0, 2, r.k, r.v), 0);
  assert_int_not_equal(model_window_append(mh, 1, 0, 0, 2, r.k, r.v), 0);
  assert_int_equal(model_window_append(mh, 0, 0, 0, 2, r.k, r.v), 0);
  free(r.buf);
  /* the resident store serves dense layers only */
  model_kv_view v;
  assert_int_not_equal(model_resident_view(mh, 0, len, NCTX, &v), 0);
  assert_int_equal(model_resident_view(mh, 1, len, NCTX, &v), 0);
  free(lg);
  model_destroy(md);
  model_destroy(mh);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_layer_bookkeeping),
      cmocka_unit_test(test_wide_window_equals_dense),
      cmocka_unit_test(test_window_keeps_only_recent),
      cmocka_unit_test(test_misuse_refused),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
