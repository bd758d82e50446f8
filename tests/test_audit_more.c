/*
 * test_audit_more.c - call sequences an outside tester writes against the
 * public C API, for the holes the other suites leave: headroom taken and
 * given back around steps, leases in flight, quarantine and closes (arena
 * and paged routes, extreme byte counts); appends and reads at the edges of
 * max_tokens on one-byte (FP8) and two-byte engines; configs whose sizes
 * overflow 64 bits or name no enum value, and the bookkeeping bound with
 * one-page headroom chunks. Every attention in these tests
 * checks, on the compute queue, that each history row it is handed holds
 * the bytes appended or written back for it, so a page that went stale or
 * was freed under a view fails here (or under ASan).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "akv.h"
#include "internal.h"
#include "testutil.h"

/* ---------------------------------------------------------------- rows */

/* Byte j of the K (kv 0) or V (kv 1) row `token` of layer `layer` of the
 * context with tag `tag`: never 0, so an unwritten row never matches. */
static uint8_t row_byte(uint32_t tag, uint32_t layer, uint32_t token, int kv, uint32_t j) {
  uint32_t h = tag * 2654435761u ^ (layer + 1) * 40503u ^ (token + 7) * 2246822519u ^
               (uint32_t)kv * 3266489917u ^ j * 668265263u;
  h ^= h >> 15;
  h *= 2246822519u;
  h ^= h >> 13;
  return (uint8_t)(h % 255u + 1u);
}

static void fill_rows(uint8_t *k, uint8_t *v, uint64_t row_bytes, uint32_t tag, uint32_t layer,
                      uint32_t first, uint32_t n) {
  for (uint32_t t = 0; t < n; t++)
    for (uint64_t j = 0; j < row_bytes; j++) {
      k[t * row_bytes + j] = row_byte(tag, layer, first + t, 0, (uint32_t)j);
      v[t * row_bytes + j] = row_byte(tag, layer, first + t, 1, (uint32_t)j);
    }
}

/* Appends rows [first, first + n) of every layer of a context tagged `tag`. */
static akv_status append_tagged(akv_context *c, uint32_t layers, uint64_t row_bytes,
                                uint32_t tag, uint32_t first, uint32_t n) {
  static uint8_t k[8][4096], v[8][4096];
  const void *kr[8], *vr[8];
  assert_true(layers <= 8 && n * row_bytes <= sizeof k[0]);
  for (uint32_t l = 0; l < layers; l++) {
    fill_rows(k[l], v[l], row_bytes, tag, l, first, n);
    kr[l] = k[l];
    vr[l] = v[l];
  }
  return akv_context_append(c, n, kr, vr);
}

/* Every row [0, len) of every layer of c, read back, is the tagged one. */
static void expect_rows(akv_context *c, uint32_t layers, uint64_t row_bytes, uint32_t tag,
                        uint32_t len) {
  static uint8_t k[4096], v[4096], ek[4096], ev[4096];
  uint32_t got = 0;
  assert_int_equal(akv_context_length(c, &got), AKV_OK);
  assert_int_equal(got, len);
  for (uint32_t l = 0; l < layers; l++)
    for (uint32_t t = 0; t < len; t++) {
      assert_int_equal(akv_context_read(c, l, t, 1, k, v), AKV_OK);
      fill_rows(ek, ev, row_bytes, tag, l, t, 1);
      if (memcmp(k, ek, row_bytes) != 0 || memcmp(v, ev, row_bytes) != 0)
        fail_msg("layer %u row %u of the context tagged %u differs", l, t, tag);
    }
}

/* ------------------------------------------------------ checking attention */

/* What the checking hook needs: the tag of each context, by its id. */
typedef struct checker {
  uint64_t row_bytes;
  uint32_t tags[8];     /* by step position */
  uint32_t rows_checked;
  uint32_t rows_bad;
} checker;

typedef struct check_job {
  checker *ck;
  akv_view view;
  uint32_t len[8];
} check_job;

static check_job jobs[64];
static uint32_t n_jobs;

/* On the compute queue: every history row the view names holds its tagged
 * bytes; then the step's new row (index len) is written, tagged too. */
static void check_job_run(void *arg) {
  check_job *j = arg;
  const akv_view *v = &j->view;
  for (uint32_t i = 0; i < v->n_contexts; i++) {
    const uint32_t tag = j->ck->tags[i];
    for (uint32_t t = 0; t < j->len[i]; t++) {
      const uint8_t *k = akvt_view_row(v, i, t);
      for (uint64_t b = 0; b < j->ck->row_bytes; b++)
        if (k[b] != row_byte(tag, v->layer, t, 0, (uint32_t)b) ||
            k[v->v_offset + b] != row_byte(tag, v->layer, t, 1, (uint32_t)b)) {
          j->ck->rows_bad++;
          break;
        }
      j->ck->rows_checked++;
    }
    uint8_t *nk = (uint8_t *)v->base + (size_t)i * v->context_stride +
                  (size_t)j->len[i] * v->row_stride;
    for (uint64_t b = 0; b < j->ck->row_bytes; b++) {
      nk[b] = row_byte(tag, v->layer, j->len[i], 0, (uint32_t)b);
      nk[v->v_offset + b] = row_byte(tag, v->layer, j->len[i], 1, (uint32_t)b);
    }
  }
}

static akv_engine *hook_engine;

static int check_hook(void *user, const akv_view *view, akv_stream stream) {
  check_job *j = &jobs[n_jobs++ % 64];
  j->ck = user;
  j->view = *view;
  for (uint32_t i = 0; i < view->n_contexts; i++) j->len[i] = view->len[i];
  j->view.len = j->len;
  return akv_stream_launch_host(hook_engine, stream, check_job_run, j) == AKV_OK ? 0 : 1;
}

/* Layer `layer` of the open step through attention, write-back, seal and
 * retire with the checking hook. */
static void layer_through(akv_engine *e, akv_stream s, checker *ck, akv_lease *ls) {
  akv_fence attn, tail;
  hook_engine = e;
  assert_int_equal(akv_lease_attend(ls, s, check_hook, ck, &attn), AKV_OK);
  assert_int_equal(akv_lease_write_back(ls, NULL, 0, &tail), AKV_OK);
  assert_int_equal(akv_lease_seal(ls, tail, attn), AKV_OK);
  assert_int_equal(akv_lease_retire(ls, NULL), AKV_OK);
}

/* A whole step over ctx[0..n) with the checking hook. */
static void checked_step(akv_engine *e, akv_stream s, checker *ck, akv_context *const *ctx,
                         uint32_t n, uint32_t layers) {
  assert_int_equal(akv_step_begin(e, ctx, n), AKV_OK);
  for (uint32_t l = 0; l < layers; l++) {
    akv_lease *ls = NULL;
    assert_int_equal(akv_lease_begin(e, l, &ls), AKV_OK);
    layer_through(e, s, ck, ls);
  }
  assert_int_equal(akv_step_end(e), AKV_OK);
}

/* ---------------------------------------------------------------- headroom */

#define HR_LAYERS 3
#define HR_ROW_BYTES 32 /* 2 kv heads x 8 dims x bf16 */

/* A host engine with `pages` pages of headroom in chunks of `chunk` pages
 * on a modelled device with room for exactly those (no device pool). */
static akv_engine *hr_engine(akv_route route, uint32_t pool_gib, uint32_t pages, uint32_t chunk) {
  akv_engine_config ec = akvt_small_config(route, pool_gib);
  akv_engine *e = NULL;
  akv_engine_info info;
  ec.max_tokens = 96;
  ec.headroom_gib = 1;
  ec.headroom_chunk_pages = chunk;
  assert_int_equal(akv_engine_create(&ec, &e), AKV_OK);
  assert_int_equal(akv_engine_info_get(e, &info), AKV_OK);
  assert_int_equal(akv_engine_destroy(e), AKV_OK);
  const uint64_t slack = route == AKV_ROUTE_PAGED ? 1 : 0;
  ec.host_fake_free_bytes = info.device_bytes_allocated +
                            (uint64_t)(pages + slack * (pages / chunk)) * info.page_bytes;
  assert_int_equal(akv_engine_create(&ec, &e), AKV_OK);
  akv_headroom_info hi;
  assert_int_equal(akv_headroom_get(e, &hi), AKV_OK);
  assert_int_equal(hi.pages, pages);
  assert_int_equal(hi.chunk_pages, chunk);
  return e;
}

/** Headroom given back with leases in flight, asked again while the release
 *  is pending, taken back with 0, less than a chunk and UINT64_MAX bytes:
 *  every attention still sees its history, on both retaining routes. */
static void test_headroom_release_take_around_steps(void **state) {
  (void)state;
  const akv_route routes[2] = {AKV_ROUTE_ARENA, AKV_ROUTE_PAGED};
  for (int r = 0; r < 2; r++) {
    akv_engine *e = hr_engine(routes[r], 0, 16, 8);
    akv_stream s = NULL;
    akv_context *c[2];
    checker ck = {HR_ROW_BYTES, {11, 12}, 0, 0};
    akv_headroom_info hi;
    uint64_t now = 7, later = 7, taken = 7;
    akv_context_config cc = AKV_CONTEXT_CONFIG_INIT;
    cc.target_pages = 0; /* pure staging by right: history lives in headroom */
    assert_int_equal(akv_stream_create(e, &s), AKV_OK);
    for (int i = 0; i < 2; i++) {
      assert_int_equal(akv_context_open(e, &cc, &c[i]), AKV_OK);
      assert_int_equal(append_tagged(c[i], HR_LAYERS, HR_ROW_BYTES, ck.tags[i], 0, 40), AKV_OK);
    }
    checked_step(e, s, &ck, c, 2, HR_LAYERS);
    checked_step(e, s, &ck, c, 2, HR_LAYERS);
    assert_int_equal(akv_headroom_get(e, &hi), AKV_OK);
    assert_true(hi.pages_held > 0);

    /* Mid-step, layer 0's lease in flight: everything is marked, once. */
    assert_int_equal(akv_step_begin(e, c, 2), AKV_OK);
    akv_lease *ls = NULL;
    assert_int_equal(akv_lease_begin(e, 0, &ls), AKV_OK);
    assert_int_equal(akv_headroom_release(e, UINT64_MAX, &now, &later), AKV_OK);
    assert_int_equal(now, 0);
    assert_int_equal(later, hi.bytes);
    assert_int_equal(akv_headroom_release(e, UINT64_MAX, &now, &later), AKV_OK);
    assert_int_equal(now, 0);
    assert_int_equal(later, 0);
    assert_int_equal(akv_headroom_take(e, UINT64_MAX, &taken), AKV_ERR_STEP_STATE);
    assert_int_equal(taken, 7);
    layer_through(e, s, &ck, ls);
    for (uint32_t l = 1; l < HR_LAYERS; l++) {
      assert_int_equal(akv_lease_begin(e, l, &ls), AKV_OK);
      layer_through(e, s, &ck, ls);
    }
    /* Still pending (not freed) until the step ends. */
    assert_int_equal(akv_headroom_take(e, UINT64_MAX, &taken), AKV_ERR_STEP_STATE);
    assert_int_equal(akv_step_end(e), AKV_OK);
    assert_int_equal(akv_headroom_get(e, &hi), AKV_OK);
    assert_int_equal(hi.pages, 0);
    assert_int_equal(hi.pages_pending, 0);
    assert_int_equal(hi.bytes, 0);
    assert_int_equal(hi.releases, 1);
    checked_step(e, s, &ck, c, 2, HR_LAYERS); /* from the host alone */

    /* Takes: 0 bytes and less than one chunk take nothing and count nothing. */
    assert_int_equal(akv_headroom_take(e, 0, &taken), AKV_OK);
    assert_int_equal(taken, 0);
    assert_int_equal(akv_headroom_take(e, 1, &taken), AKV_OK);
    assert_int_equal(taken, 0);
    assert_int_equal(akv_headroom_get(e, &hi), AKV_OK);
    assert_int_equal(hi.takes, 0);
    assert_int_equal(akv_headroom_take(e, UINT64_MAX, &taken), AKV_OK);
    assert_true(taken > 0);
    assert_int_equal(akv_headroom_get(e, &hi), AKV_OK);
    assert_int_equal(hi.pages, 16);
    assert_int_equal(hi.takes, 1);
    checked_step(e, s, &ck, c, 2, HR_LAYERS);
    checked_step(e, s, &ck, c, 2, HR_LAYERS);
    /* Outside a step: one byte gives back one whole chunk at once. */
    assert_int_equal(akv_headroom_release(e, 1, &now, &later), AKV_OK);
    assert_int_equal(now, hi.bytes / 2);
    assert_int_equal(later, 0);
    checked_step(e, s, &ck, c, 2, HR_LAYERS);

    assert_int_equal(ck.rows_bad, 0);
    assert_true(ck.rows_checked > 0);
    for (int i = 0; i < 2; i++) {
      expect_rows(c[i], HR_LAYERS, HR_ROW_BYTES, ck.tags[i], 40 + 7);
      assert_int_equal(akv_context_close(c[i]), AKV_OK);
    }
    assert_int_equal(akv_stream_destroy(e, s), AKV_OK);
    assert_int_equal(akv_engine_destroy(e), AKV_OK);
  }
}

/** A release pending when a lease fails: the quarantine that proves
 *  completion frees it; afterwards release and take are refused, get still
 *  answers, destroy succeeds and the dead handle answers BAD_HANDLE. */
static void test_headroom_pending_then_quarantine(void **state) {
  (void)state;
  const akv_route routes[2] = {AKV_ROUTE_ARENA, AKV_ROUTE_PAGED};
  for (int r = 0; r < 2; r++) {
    akv_engine *e = hr_engine(routes[r], 0, 8, 4);
    akv_stream s = NULL;
    akv_context *c = NULL;
    checker ck = {HR_ROW_BYTES, {5}, 0, 0};
    akv_headroom_info hi;
    uint64_t now = 0, later = 0, taken = 3;
    assert_int_equal(akv_stream_create(e, &s), AKV_OK);
    assert_int_equal(akv_context_open(e, NULL, &c), AKV_OK);
    assert_int_equal(append_tagged(c, HR_LAYERS, HR_ROW_BYTES, 5, 0, 33), AKV_OK);
    checked_step(e, s, &ck, &c, 1, HR_LAYERS);
    assert_int_equal(akv_step_begin(e, &c, 1), AKV_OK);
    akv_lease *ls = NULL;
    assert_int_equal(akv_lease_begin(e, 0, &ls), AKV_OK);
    assert_int_equal(akv_headroom_release(e, 1, &now, &later), AKV_OK);
    assert_true(later > 0);
    assert_int_equal(akv_engine_quarantine(e, NULL), AKV_OK);
    assert_int_equal(akv_headroom_get(e, &hi), AKV_OK);
    assert_int_equal(hi.pages_pending, 0);
    assert_int_equal(hi.pages, 4);
    assert_int_equal(akv_headroom_release(e, 1, &now, &later), AKV_ERR_QUARANTINED);
    assert_int_equal(akv_headroom_take(e, UINT64_MAX, &taken), AKV_ERR_QUARANTINED);
    assert_int_equal(taken, 3);
    expect_rows(c, HR_LAYERS, HR_ROW_BYTES, 5, 34);
    assert_int_equal(akv_stream_destroy(e, s), AKV_OK);
    assert_int_equal(akv_engine_destroy(e), AKV_OK);
    assert_int_equal(akv_headroom_get(e, &hi), AKV_ERR_BAD_HANDLE);
    assert_int_equal(akv_headroom_release(e, 1, &now, &later), AKV_ERR_BAD_HANDLE);
    assert_int_equal(akv_headroom_take(e, 1, &taken), AKV_ERR_BAD_HANDLE);
    assert_int_equal(ck.rows_bad, 0);
  }
}

/** A context closed while its history sits in headroom, a release outside
 *  the step, another context opened into the freed pages: the new context
 *  never sees the closed one's rows. */
static void test_headroom_close_release_reopen(void **state) {
  (void)state;
  const akv_route routes[2] = {AKV_ROUTE_ARENA, AKV_ROUTE_PAGED};
  for (int r = 0; r < 2; r++) {
    akv_engine *e = hr_engine(routes[r], 1, 8, 4);
    akv_stream s = NULL;
    akv_context *c[2];
    checker ck = {HR_ROW_BYTES, {21, 22}, 0, 0};
    uint64_t now = 0;
    assert_int_equal(akv_stream_create(e, &s), AKV_OK);
    for (int i = 0; i < 2; i++) {
      assert_int_equal(akv_context_open(e, NULL, &c[i]), AKV_OK);
      assert_int_equal(append_tagged(c[i], HR_LAYERS, HR_ROW_BYTES, ck.tags[i], 0, 60), AKV_OK);
    }
    checked_step(e, s, &ck, c, 2, HR_LAYERS);
    /* Close the second mid-step (it is not part of the step). */
    assert_int_equal(akv_step_begin(e, c, 1), AKV_OK);
    assert_int_equal(akv_context_close(c[1]), AKV_OK);
    assert_int_equal(akvt_null_layers(e, s, HR_LAYERS), AKV_OK);
    /* the null hook wrote nothing at row 61 of c[0]: start c[0] over */
    assert_int_equal(akv_context_close(c[0]), AKV_OK);
    assert_int_equal(akv_headroom_release(e, 1, &now, NULL), AKV_OK);
    assert_true(now > 0);
    ck.tags[0] = 31;
    ck.tags[1] = 32;
    for (int i = 0; i < 2; i++) {
      assert_int_equal(akv_context_open(e, NULL, &c[i]), AKV_OK);
      assert_int_equal(append_tagged(c[i], HR_LAYERS, HR_ROW_BYTES, ck.tags[i], 0, 60), AKV_OK);
    }
    checked_step(e, s, &ck, c, 2, HR_LAYERS);
    checked_step(e, s, &ck, c, 2, HR_LAYERS);
    assert_int_equal(ck.rows_bad, 0);
    for (int i = 0; i < 2; i++) assert_int_equal(akv_context_close(c[i]), AKV_OK);
    assert_int_equal(akv_stream_destroy(e, s), AKV_OK);
    assert_int_equal(akv_engine_destroy(e), AKV_OK);
  }
}

/* A small deterministic generator (xorshift64*). */
static uint64_t rng_next(uint64_t *s) {
  *s ^= *s >> 12;
  *s ^= *s << 25;
  *s ^= *s >> 27;
  return *s * 2685821657736338717ull;
}
static uint32_t rng_below(uint64_t *s, uint32_t n) { return (uint32_t)(rng_next(s) % n); }

typedef struct model_ctx {
  akv_context *c; /* NULL: slot free in the model */
  uint32_t tag;
  uint32_t layer_len[HR_LAYERS];
} model_ctx;

static uint32_t model_len(const model_ctx *m) {
  uint32_t min = m->layer_len[0];
  for (uint32_t l = 1; l < HR_LAYERS; l++)
    if (m->layer_len[l] < min) min = m->layer_len[l];
  return min;
}

static bool model_even(const model_ctx *m) {
  for (uint32_t l = 1; l < HR_LAYERS; l++)
    if (m->layer_len[l] != m->layer_len[0]) return false;
  return true;
}

/* Appends n tagged rows to one layer of a modelled context. */
static void model_append_layer(model_ctx *m, uint32_t l, uint32_t n) {
  static uint8_t k[96 * HR_ROW_BYTES], v[96 * HR_ROW_BYTES];
  fill_rows(k, v, HR_ROW_BYTES, m->tag, l, m->layer_len[l], n);
  assert_int_equal(akv_context_append_layer(m->c, l, n, k, v), AKV_OK);
  m->layer_len[l] += n;
}

/* Appends n tagged rows to every layer (the context must be even). */
static void model_append(model_ctx *m, uint32_t n) {
  static uint8_t k[HR_LAYERS][96 * HR_ROW_BYTES], v[HR_LAYERS][96 * HR_ROW_BYTES];
  const void *kr[HR_LAYERS], *vr[HR_LAYERS];
  for (uint32_t l = 0; l < HR_LAYERS; l++) {
    fill_rows(k[l], v[l], HR_ROW_BYTES, m->tag, l, m->layer_len[l], n);
    kr[l] = k[l];
    vr[l] = v[l];
  }
  assert_int_equal(akv_context_append(m->c, n, kr, vr), AKV_OK);
  for (uint32_t l = 0; l < HR_LAYERS; l++) m->layer_len[l] += n;
}

static void model_check(const model_ctx *m) {
  static uint8_t k[96 * HR_ROW_BYTES], v[96 * HR_ROW_BYTES], ek[96 * HR_ROW_BYTES],
      ev[96 * HR_ROW_BYTES];
  uint32_t len = 0;
  assert_int_equal(akv_context_length(m->c, &len), AKV_OK);
  assert_int_equal(len, model_len(m));
  for (uint32_t l = 0; l < HR_LAYERS; l++) {
    const uint32_t n = m->layer_len[l];
    assert_int_equal(akv_context_read(m->c, l, 0, n, k, v), AKV_OK);
    fill_rows(ek, ev, HR_ROW_BYTES, m->tag, l, 0, n);
    if (memcmp(k, ek, (size_t)n * HR_ROW_BYTES) != 0 ||
        memcmp(v, ev, (size_t)n * HR_ROW_BYTES) != 0)
      fail_msg("context tagged %u, layer %u: rows differ", m->tag, l);
  }
}

/** Random call sequences over headroom engines (both retaining routes, with
 *  and without a pool): opens with random targets, appends whole and per
 *  layer, closes in and out of steps, releases and takes of random sizes in
 *  and out of steps (with leases in flight). Every attention checks every
 *  history row it is handed, and the host rows are checked at the end. */
static void test_headroom_random_sequences(void **state) {
  (void)state;
  uint32_t seeds = 24, steps_total = 0;
  for (uint32_t seed = 1; seed <= seeds; seed++) {
    uint64_t rs = 0x9E3779B97F4A7C15ull * seed;
    const akv_route route = (seed & 1) ? AKV_ROUTE_PAGED : AKV_ROUTE_ARENA;
    const uint32_t pool = (seed & 2) ? 1 : 0;
    const uint32_t chunk = 1 + rng_below(&rs, 4);
    akv_engine *e = hr_engine(route, pool, chunk * (1 + rng_below(&rs, 4)), chunk);
    akv_stream s = NULL;
    model_ctx m[4];
    uint32_t next_tag = 100 * seed;
    checker ck = {HR_ROW_BYTES, {0}, 0, 0};
    memset(m, 0, sizeof m);
    hook_engine = e;
    assert_int_equal(akv_stream_create(e, &s), AKV_OK);
    for (uint32_t op = 0; op < 60; op++) {
      const uint32_t what = rng_below(&rs, 8);
      model_ctx *x = &m[rng_below(&rs, 4)];
      uint64_t now = 0, later = 0, taken = 0;
      if (what == 0 && x->c == NULL) {
        akv_context_config cc = AKV_CONTEXT_CONFIG_INIT;
        const uint32_t pick = rng_below(&rs, 4);
        cc.target_pages = pick == 0 ? 0 : pick == 1 ? 2 : AKV_TARGET_FAIR_SHARE;
        cc.burst_pages = rng_below(&rs, 3);
        akv_status st = akv_context_open(e, &cc, &x->c);
        if (st != AKV_OK) {
          x->c = NULL;
          continue;
        }
        x->tag = next_tag++;
        memset(x->layer_len, 0, sizeof x->layer_len);
        model_append(x, rng_below(&rs, 40));
      } else if (what == 1 && x->c != NULL) {
        model_check(x);
        assert_int_equal(akv_context_close(x->c), AKV_OK);
        x->c = NULL;
      } else if (what == 2 && x->c != NULL) {
        if (model_even(x) && model_len(x) + 8 < 80) model_append(x, rng_below(&rs, 8));
        else
          for (uint32_t l = 0; l < HR_LAYERS; l++) /* even it out */
            if (x->layer_len[l] < 90) model_append_layer(x, l, 90 - x->layer_len[l]);
      } else if (what == 3 && x->c != NULL) {
        const uint32_t l = rng_below(&rs, HR_LAYERS);
        if (x->layer_len[l] + 4 <= 90) model_append_layer(x, l, rng_below(&rs, 5));
      } else if (what == 4) {
        const uint64_t b = rng_below(&rs, 3) == 0 ? UINT64_MAX : rng_below(&rs, 40000);
        assert_int_equal(akv_headroom_release(e, b, &now, &later), AKV_OK);
        assert_int_equal(later, 0);
      } else if (what == 5) {
        const uint64_t b = rng_below(&rs, 2) == 0 ? UINT64_MAX : rng_below(&rs, 40000);
        assert_int_equal(akv_headroom_take(e, b, &taken), AKV_OK);
      } else {
        /* A step over the even contexts with room for one more row. */
        akv_context *sc[4];
        model_ctx *sm[4];
        uint32_t n = 0;
        for (int i = 0; i < 4; i++)
          if (m[i].c != NULL && model_even(&m[i]) && model_len(&m[i]) < 96 &&
              rng_below(&rs, 4) != 0) {
            sm[n] = &m[i];
            ck.tags[n] = m[i].tag;
            sc[n++] = m[i].c;
          }
        if (n == 0) continue;
        const uint32_t rel_layer = rng_below(&rs, HR_LAYERS + 2);
        assert_int_equal(akv_step_begin(e, sc, n), AKV_OK);
        for (uint32_t l = 0; l < HR_LAYERS; l++) {
          akv_lease *ls = NULL;
          assert_int_equal(akv_lease_begin(e, l, &ls), AKV_OK);
          if (l == rel_layer) {
            const uint64_t b = rng_below(&rs, 2) == 0 ? UINT64_MAX : rng_below(&rs, 40000);
            assert_int_equal(akv_headroom_release(e, b, &now, &later), AKV_OK);
            assert_int_equal(now, 0);
            /* a context outside the step may be closed or appended to */
            for (int i = 0; i < 4; i++) {
              bool in = false;
              for (uint32_t j = 0; j < n; j++) in = in || sm[j] == &m[i];
              if (m[i].c == NULL || in) continue;
              if (rng_below(&rs, 2) == 0) {
                model_check(&m[i]);
                assert_int_equal(akv_context_close(m[i].c), AKV_OK);
                m[i].c = NULL;
              } else if (model_even(&m[i]) && model_len(&m[i]) + 3 < 90) {
                model_append(&m[i], 3);
              }
            }
          }
          layer_through(e, s, &ck, ls);
        }
        assert_int_equal(akv_step_end(e), AKV_OK);
        for (uint32_t j = 0; j < n; j++)
          for (uint32_t l = 0; l < HR_LAYERS; l++) sm[j]->layer_len[l]++;
        steps_total++;
        if (ck.rows_bad != 0) fail_msg("seed %u op %u: %u stale rows", seed, op, ck.rows_bad);
      }
    }
    for (int i = 0; i < 4; i++)
      if (m[i].c != NULL) {
        model_check(&m[i]);
        assert_int_equal(akv_context_close(m[i].c), AKV_OK);
      }
    assert_int_equal(akv_stream_destroy(e, s), AKV_OK);
    assert_int_equal(akv_engine_destroy(e), AKV_OK);
  }
  assert_true(steps_total > 100);
}

/* A log callback that reads every diagnostic of the engine in `diag_engine`
 * on every line it is given (akv_log_fn allows them there). */
static akv_engine *diag_engine;
static akv_context *diag_ctx[4];
static uint64_t diag_lines;

static void diag_log(void *user, akv_log_level level, const char *message) {
  (void)user;
  (void)level;
  (void)message;
  akv_engine *e = diag_engine;
  if (e == NULL) return;
  akv_engine_info info;
  akv_headroom_info hi;
  uint64_t counters[AKV_ADM_RULE_COUNT];
  akv_adm_decision log[8];
  size_t n_log = 0;
  char buf[256];
  uint8_t k[HR_ROW_BYTES], v[HR_ROW_BYTES];
  uint32_t u = 0;
  diag_lines++;
  (void)akv_engine_info_get(e, &info);
  (void)akv_headroom_get(e, &hi);
  (void)akv_admission_counters(e, counters, AKV_ADM_RULE_COUNT);
  (void)akv_admission_log(e, log, 8, &n_log);
  (void)akv_admission_explain(e, NULL, buf, sizeof buf);
  (void)akv_engine_last_error(e);
  for (int i = 0; i < 4; i++) {
    if (diag_ctx[i] == NULL) continue;
    (void)akv_admission_explain(e, diag_ctx[i], buf, sizeof buf);
    (void)akv_context_length(diag_ctx[i], &u);
    (void)akv_context_id(diag_ctx[i], &u);
    (void)akv_context_read(diag_ctx[i], 0, 0, 1, k, v);
    /* a call that changes the engine is refused there */
    assert_int_equal(akv_context_append_layer(diag_ctx[i], 0, 0, NULL, NULL), AKV_ERR_IN_USE);
  }
  assert_int_equal(akv_headroom_take(e, UINT64_MAX, NULL), AKV_ERR_IN_USE);
  assert_int_equal(akv_headroom_release(e, UINT64_MAX, NULL, NULL), AKV_ERR_IN_USE);
}

/** Faults injected at every allocation and copy of a headroom engine's
 *  life (create, take, steps), with a log callback that reads every
 *  diagnostic on each line: whatever fails, the diagnostics read a
 *  consistent engine, a quarantine ends it and destroy frees it. */
static void test_headroom_faults_with_diagnostics_in_the_log(void **state) {
  (void)state;
  const int32_t kinds[2] = {AKV_OP_ALLOC, AKV_OP_COPY};
  for (int r = 0; r < 2; r++)
    for (int ki = 0; ki < 2; ki++)
      for (uint32_t nth = 1; nth <= 40; nth++) {
        akv_engine_config ec = akvt_small_config(r ? AKV_ROUTE_PAGED : AKV_ROUTE_ARENA, 0);
        akv_engine *e = NULL;
        akv_engine_info info;
        ec.max_tokens = 96;
        ec.headroom_gib = 1;
        ec.headroom_chunk_pages = 2;
        assert_int_equal(akv_engine_create(&ec, &e), AKV_OK);
        assert_int_equal(akv_engine_info_get(e, &info), AKV_OK);
        assert_int_equal(akv_engine_destroy(e), AKV_OK);
        ec.host_fake_free_bytes = info.device_bytes_allocated + 12 * info.page_bytes;
        ec.fault_kind = kinds[ki];
        ec.fault_fail_nth = nth;
        ec.log_fn = diag_log;
        ec.log_level = AKV_LOG_DEBUG;
        memset(diag_ctx, 0, sizeof diag_ctx);
        diag_engine = NULL;
        e = NULL;
        if (akv_engine_create(&ec, &e) != AKV_OK) continue;
        diag_engine = e;
        akv_stream s = NULL;
        uint64_t now = 0, later = 0, taken = 0;
        bool failed = akv_stream_create(e, &s) != AKV_OK;
        for (int i = 0; i < 2 && !failed; i++) {
          failed = akv_context_open(e, NULL, &diag_ctx[i]) != AKV_OK ||
                   append_tagged(diag_ctx[i], HR_LAYERS, HR_ROW_BYTES, 60 + i, 0, 33) != AKV_OK;
        }
        for (int step = 0; step < 4 && !failed; step++) {
          if (step == 1) failed = akv_headroom_release(e, UINT64_MAX, &now, &later) != AKV_OK;
          if (step == 2) failed = akv_headroom_take(e, UINT64_MAX, &taken) != AKV_OK;
          if (failed || akv_step_begin(e, diag_ctx, 2) != AKV_OK) {
            failed = true;
            break;
          }
          for (uint32_t l = 0; l < HR_LAYERS && !failed; l++) {
            akv_lease *ls = NULL;
            failed = akv_lease_begin(e, l, &ls) != AKV_OK;
            if (!failed && step == 3 && l == 1)
              failed = akv_headroom_release(e, 1, &now, &later) != AKV_OK;
            if (!failed) failed = akvt_lease_through(ls, s) != AKV_OK;
          }
          if (!failed) failed = akv_step_end(e) != AKV_OK;
        }
        akv_quarantine_report qr;
        if (failed) assert_int_equal(akv_engine_quarantine(e, &qr), AKV_OK);
        akv_headroom_info hi;
        assert_int_equal(akv_headroom_get(e, &hi), AKV_OK);
        assert_int_equal(hi.pages_pending, 0);
        if (s != NULL) assert_int_equal(akv_stream_destroy(e, s), AKV_OK);
        diag_engine = NULL;
        assert_int_equal(akv_engine_destroy(e), AKV_OK);
      }
  assert_true(diag_lines > 0);
}

/* ---------------------------------------------------------------- contexts */

static akv_engine *dtype_engine(akv_dtype dt, akv_route route, uint32_t max_tokens) {
  akv_engine_config ec = akvt_small_config(route, route == AKV_ROUTE_STAGE ? 0 : 1);
  akv_engine *e = NULL;
  ec.dtype = dt;
  ec.max_tokens = max_tokens;
  assert_int_equal(akv_engine_create(&ec, &e), AKV_OK);
  return e;
}

/** max_tokens exactly: an append that fills the context is taken, one more
 *  row is refused on every path and changes nothing; a full context cannot
 *  join a step; max_tokens - 1 rows take exactly one step. FP8 (one byte per
 *  element) and bf16. */
static void test_max_tokens_edges(void **state) {
  (void)state;
  const akv_dtype dts[2] = {AKV_DTYPE_FP8_E4M3, AKV_DTYPE_BF16};
  for (int d = 0; d < 2; d++) {
    const uint64_t rb = 16u * (dts[d] == AKV_DTYPE_BF16 ? 2 : 1);
    akv_engine *e = dtype_engine(dts[d], AKV_ROUTE_ARENA, 24);
    akv_engine_info info;
    akv_stream s = NULL;
    akv_context *full = NULL, *almost = NULL;
    static uint8_t k[64], v[64];
    checker ck = {rb, {41}, 0, 0};
    assert_int_equal(akv_engine_info_get(e, &info), AKV_OK);
    assert_int_equal(info.row_bytes, rb);
    assert_int_equal(akv_stream_create(e, &s), AKV_OK);
    assert_int_equal(akv_context_open(e, NULL, &full), AKV_OK);
    assert_int_equal(akv_context_open(e, NULL, &almost), AKV_OK);
    assert_int_equal(append_tagged(full, HR_LAYERS, rb, 40, 0, 24), AKV_OK);
    assert_int_equal(append_tagged(full, HR_LAYERS, rb, 40, 24, 1), AKV_ERR_CAPACITY);
    assert_int_equal(append_tagged(full, HR_LAYERS, rb, 40, 24, 0), AKV_OK);
    for (uint32_t l = 0; l < HR_LAYERS; l++) {
      assert_int_equal(akv_context_append_layer(full, l, 1, k, v), AKV_ERR_CAPACITY);
      assert_int_equal(akv_context_append_layer(full, l, UINT32_MAX, k, v), AKV_ERR_CAPACITY);
      assert_int_equal(akv_context_append_layer(full, l, 0, NULL, NULL), AKV_OK);
      /* reads: the last row, then one past it, then a wrapped range */
      assert_int_equal(akv_context_read(full, l, 23, 1, k, v), AKV_OK);
      assert_int_equal(akv_context_read(full, l, 24, 1, k, v), AKV_ERR_INVALID_ARGUMENT);
      assert_int_equal(akv_context_read(full, l, 23, 2, k, v), AKV_ERR_INVALID_ARGUMENT);
      assert_int_equal(akv_context_read(full, l, 1, UINT32_MAX, k, v),
                       AKV_ERR_INVALID_ARGUMENT);
      assert_int_equal(akv_context_read(full, l, 24, 0, NULL, NULL), AKV_OK);
      assert_int_equal(akv_context_read(full, l, 25, 0, NULL, NULL), AKV_ERR_INVALID_ARGUMENT);
    }
    expect_rows(full, HR_LAYERS, rb, 40, 24);
    assert_int_equal(akv_step_begin(e, &full, 1), AKV_ERR_CAPACITY);
    akv_context *both[2] = {almost, full};
    assert_int_equal(append_tagged(almost, HR_LAYERS, rb, 41, 0, 23), AKV_OK);
    assert_int_equal(akv_step_begin(e, both, 2), AKV_ERR_CAPACITY);
    checked_step(e, s, &ck, &almost, 1, HR_LAYERS);
    assert_int_equal(akv_step_begin(e, &almost, 1), AKV_ERR_CAPACITY);
    expect_rows(almost, HR_LAYERS, rb, 41, 24);
    assert_int_equal(ck.rows_bad, 0);
    assert_int_equal(akv_context_close(full), AKV_OK);
    assert_int_equal(akv_context_close(almost), AKV_OK);
    assert_int_equal(akv_stream_destroy(e, s), AKV_OK);
    assert_int_equal(akv_engine_destroy(e), AKV_OK);
  }
}

/* ------------------------------------------------------------------ config */

/** Configs whose products overflow 64 bits, or whose enums hold no value of
 *  their enum: akv_fit and akv_engine_create refuse them alike with
 *  AKV_ERR_CONFIG, writing nothing. */
static void test_overflowing_configs(void **state) {
  (void)state;
  akv_engine_config base = akvt_small_config(AKV_ROUTE_PAGED, 1);
  akv_engine_config cfgs[16];
  size_t n = 0;
  akv_engine_config c;
  /* history = layers x max_tokens x row pair overflows */
  c = base; c.n_dense_layers = 65536; c.kv_heads = 65536; c.head_dim = 65536;
  c.dtype = AKV_DTYPE_F32; c.max_tokens = UINT32_MAX; cfgs[n++] = c;
  /* page_bytes overflows (with the largest page taken: a page is an
   * attention chunk, AKV_ATTENTION_MAX_CHUNK_TOKENS = 0xFF000000 rows) */
  c = base; c.n_dense_layers = 65536; c.kv_heads = 65536; c.head_dim = 65536;
  c.max_tokens = UINT32_MAX; c.page_tokens = 0xFF000000u; cfgs[n++] = c;
  /* enums out of range */
  c = base; c.dtype = (akv_dtype)5; cfgs[n++] = c;
  c = base; c.dtype = (akv_dtype)-1; cfgs[n++] = c;
  c = base; c.route = (akv_route)3; cfgs[n++] = c;
  c = base; c.fit_mode = (akv_fit_mode)2; cfgs[n++] = c;
  c = base; c.backend = (akv_backend_kind)-1; cfgs[n++] = c;
  /* huge concurrency and pools */
  c = base; c.max_contexts = UINT32_MAX; cfgs[n++] = c;
  c = base; c.host_pool_gib = UINT32_MAX; cfgs[n++] = c;
  c = base; c.device_pool_gib = UINT32_MAX; cfgs[n++] = c;
  /* FP8 rows of one byte, one token pages, a device pool of more pages
   * than 32 bits count */
  c = base; c.dtype = AKV_DTYPE_FP8_E5M2; c.n_dense_layers = 1; c.kv_heads = 1; c.head_dim = 1;
  c.page_tokens = 1; c.device_pool_gib = 1u << 20; cfgs[n++] = c;
  for (size_t i = 0; i < n; i++) {
    akv_fit_report rep;
    akv_engine *e = (akv_engine *)&rep;
    memset(&rep, 0x5A, sizeof rep);
    akv_status fs = akv_fit(&cfgs[i], &rep);
    akv_status cs = akv_engine_create(&cfgs[i], &e);
    if (fs != AKV_ERR_CONFIG || cs != AKV_ERR_CONFIG)
      fail_msg("config %zu: akv_fit %s, akv_engine_create %s", i, akv_status_string(fs),
               akv_status_string(cs));
    assert_ptr_equal(e, (akv_engine *)&rep);
    assert_int_equal(rep.row_bytes, 0x5A5A5A5A5A5A5A5Aull);
  }
}

/** Bookkeeping bound (akv.h, akv_fit): the headroom's chunk table, one
 *  pointer per chunk, is bookkeeping too. One-page chunks of 160 B pages
 *  (one FP8 element per row, 80 rows per page) make 6.7 million chunks in
 *  1 GiB of headroom: a 51 MiB table on top of 256 MiB of other bookkeeping,
 *  past the 272 MiB bound. akv_fit and akv_engine_create refuse it alike;
 *  chunks of 1 GiB (headroom_chunk_pages 0) fit. An engine never holds more
 *  chunks than its budget counted. */
static void test_headroom_chunk_table_counted(void **state) {
  (void)state;
  akv_engine_config c = AKV_ENGINE_CONFIG_INIT;
  akv_fit_report rep;
  akv_engine *e = NULL;
  c.backend = AKV_BACKEND_HOST;
  c.n_dense_layers = 1;
  c.kv_heads = 1;
  c.head_dim = 1;
  c.dtype = AKV_DTYPE_FP8_E4M3;
  c.max_tokens = 4096;
  c.page_tokens = 80;
  c.host_pool_gib = 1;
  c.max_contexts = 1;
  c.route = AKV_ROUTE_ARENA;
  c.headroom_gib = 1;
  c.log_fn = akvt_silent_log;
  assert_int_equal(akv_fit(&c, &rep), AKV_OK); /* chunks of 1 GiB */
  c.headroom_chunk_pages = 1;
  assert_int_equal(akv_fit(&c, &rep), AKV_ERR_CONFIG);
  assert_int_equal(akv_engine_create(&c, &e), AKV_ERR_CONFIG);
  assert_null(e);

  /* A small engine with one-page chunks on a modelled device. */
  e = hr_engine(AKV_ROUTE_PAGED, 0, 6, 1);
  assert_int_equal(e->hr_max_chunks, 6);
  assert_true(e->hr_max_chunks <= e->budget.hr_chunks);
  assert_true(e->budget.page_table_bytes >=
              ((uint64_t)e->n_pages + e->hr_max_pages) * (sizeof(uint8_t *) + sizeof(uint32_t)) +
                  (uint64_t)e->hr_max_chunks * sizeof(void *));
  assert_int_equal(akv_engine_destroy(e), AKV_OK);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_headroom_release_take_around_steps),
      cmocka_unit_test(test_headroom_pending_then_quarantine),
      cmocka_unit_test(test_headroom_close_release_reopen),
      cmocka_unit_test(test_headroom_random_sequences),
      cmocka_unit_test(test_headroom_faults_with_diagnostics_in_the_log),
      cmocka_unit_test(test_max_tokens_edges),
      cmocka_unit_test(test_overflowing_configs),
      cmocka_unit_test(test_headroom_chunk_table_counted),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
