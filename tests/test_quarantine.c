/*
 * test_quarantine.c - failure, quarantine and shutdown (DESIGN §7).
 *
 *  - after a failed backend operation every call answers
 *    AKV_ERR_QUARANTINED except diagnostics, quarantine and destroy, and
 *    the refused calls issue no backend operation;
 *  - destroy never waits: with live work it returns AKV_ERR_BUSY at once,
 *    frees nothing, and the engine goes on working; when it frees, it waits
 *    on no caller stream (another engine's stream held at a gate keeps
 *    running while this one is destroyed) and its cost is measured;
 *  - quarantine synchronises every queue (it blocks until in-flight work has
 *    really run) and only then releases leases, tickets and host page leases;
 *  - when completion cannot be established everything stays retained.
 *
 * One test is named after each of the four invariants of §7 and drives the
 * code where the invariant is enforced: context.c (source authority),
 * step.c (physical reuse waits for every fence: no live lease at a
 * boundary), engine.c and lease.c
 * (partial submissions; nothing recycled on an uncertain fence).
 *
 * In-flight work is made observable with a gate: a host function on the
 * compute stream that blocks until the test opens it (at most 10 s, so a
 * broken engine fails the test instead of hanging it).
 */
#if !defined(_GNU_SOURCE) && !defined(_DEFAULT_SOURCE)
#define _DEFAULT_SOURCE
#endif
#ifndef _POSIX_C_SOURCE
#define _POSIX_C_SOURCE 200809L
#endif
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cmocka.h>

#include "internal.h"
#include "testutil.h"

#define LAYERS 3
#define ROW_ELEMS 16 /* kv_heads 2 x head_dim 8, bf16: 32-byte rows */
#define MAXTOK 64

/* ----------------------------------------------------------------- time */

static double now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

static void sleep_ms(unsigned ms) {
  struct timespec ts = {(time_t)(ms / 1000u), (long)(ms % 1000u) * 1000000L};
  nanosleep(&ts, NULL);
}

/* ----------------------------------------------------------------- gate */

typedef struct gate {
  atomic_int open;
  atomic_int entered;
} gate;

static void gate_wait(gate *g) {
  double end = now_ms() + 10000.0;
  atomic_store(&g->entered, 1);
  while (!atomic_load(&g->open) && now_ms() < end) sleep_ms(1);
}

typedef struct opener {
  gate *g;
  unsigned after_ms;
  pthread_t thread;
} opener;

static void *opener_main(void *arg) {
  opener *o = arg;
  sleep_ms(o->after_ms);
  atomic_store(&o->g->open, 1);
  return NULL;
}

static void open_later(opener *o, gate *g, unsigned ms) {
  o->g = g;
  o->after_ms = ms;
  assert_int_equal(pthread_create(&o->thread, NULL, opener_main, o), 0);
}

/* ------------------------------------------------------------- contents */

/* Row contents: byte pattern of (context tag, layer, token, K/V). */
static void fill_row(uint8_t *row, uint32_t tag, uint32_t layer, uint32_t token, int kv) {
  for (uint32_t j = 0; j < ROW_ELEMS * 2; j++)
    row[j] = (uint8_t)(tag * 131u + layer * 31u + token * 7u + (uint32_t)kv * 3u + j);
}

static void prefill(akv_context *c, uint32_t tag, uint32_t n) {
  static uint8_t k[LAYERS][MAXTOK][ROW_ELEMS * 2], v[LAYERS][MAXTOK][ROW_ELEMS * 2];
  const void *kp[LAYERS], *vp[LAYERS];
  for (uint32_t l = 0; l < LAYERS; l++) {
    for (uint32_t t = 0; t < n; t++) {
      fill_row(k[l][t], tag, l, t, 0);
      fill_row(v[l][t], tag, l, t, 1);
    }
    kp[l] = k[l];
    vp[l] = v[l];
  }
  assert_int_equal(akv_context_append(c, n, kp, vp), AKV_OK);
}

/* Rows [0, n) of every layer hold the pattern of `tag`. */
static void expect_rows(akv_context *c, uint32_t tag, uint32_t n) {
  uint8_t k[MAXTOK][ROW_ELEMS * 2], v[MAXTOK][ROW_ELEMS * 2], want[ROW_ELEMS * 2];
  uint32_t len = 0;
  assert_int_equal(akv_context_length(c, &len), AKV_OK);
  assert_int_equal(len, n);
  for (uint32_t l = 0; l < LAYERS; l++) {
    assert_int_equal(akv_context_read(c, l, 0, n, k, v), AKV_OK);
    for (uint32_t t = 0; t < n; t++) {
      fill_row(want, tag, l, t, 0);
      assert_memory_equal(k[t], want, sizeof(want));
      fill_row(want, tag, l, t, 1);
      assert_memory_equal(v[t], want, sizeof(want));
    }
  }
}

/* -------------------------------------------------------- attention job */

/* What the hook enqueues on the compute stream: optionally wait at a gate,
 * check the staged history against the pattern, then write each context's
 * new row (the pattern of its tag at index len) into the staged view. */
typedef struct job {
  gate *g;
  uint8_t *base;
  uint64_t stride, v_offset, row_stride;
  uint32_t n, layer;
  uint32_t len[8];
  uint32_t tag[8];
  atomic_uint bad_rows;
  atomic_int ran;
} job;

typedef struct hookctx {
  akv_engine *e;
  job jobs[LAYERS];
  gate *gate_layer[LAYERS]; /* gate for a layer's job, or NULL */
  int fail_layer;           /* the hook returns nonzero for this layer; -1: never */
  uint32_t tags[8];         /* tag of the step's context i */
} hookctx;

static void job_run(void *arg) {
  job *j = arg;
  uint8_t want[ROW_ELEMS * 2];
  if (j->g != NULL) gate_wait(j->g);
  for (uint32_t i = 0; i < j->n; i++) {
    uint8_t *k = j->base + i * j->stride, *v = k + j->v_offset;
    for (uint32_t t = 0; t < j->len[i]; t++) {
      fill_row(want, j->tag[i], j->layer, t, 0);
      if (memcmp(k + (size_t)t * j->row_stride, want, sizeof(want)) != 0) atomic_fetch_add(&j->bad_rows, 1);
      fill_row(want, j->tag[i], j->layer, t, 1);
      if (memcmp(v + (size_t)t * j->row_stride, want, sizeof(want)) != 0) atomic_fetch_add(&j->bad_rows, 1);
    }
    fill_row(k + (size_t)j->len[i] * j->row_stride, j->tag[i], j->layer, j->len[i], 0);
    fill_row(v + (size_t)j->len[i] * j->row_stride, j->tag[i], j->layer, j->len[i], 1);
  }
  atomic_store(&j->ran, 1);
}

static int hook(void *user, const akv_view *view, akv_stream stream) {
  hookctx *h = user;
  job *j = &h->jobs[view->layer];
  if ((int)view->layer == h->fail_layer) return 1;
  j->g = h->gate_layer[view->layer];
  j->base = view->base;
  j->stride = view->context_stride;
  j->v_offset = view->v_offset;
  j->row_stride = view->row_stride;
  j->n = view->n_contexts;
  j->layer = view->layer;
  for (uint32_t i = 0; i < view->n_contexts; i++) {
    j->len[i] = view->len[i];
    j->tag[i] = h->tags[i];
  }
  atomic_store(&j->bad_rows, 0);
  atomic_store(&j->ran, 0);
  return akv_stream_launch_host(h->e, stream, job_run, j) == AKV_OK ? 0 : 1;
}

/* --------------------------------------------------------------- engine */

typedef struct fx {
  akv_engine *e;
  akv_stream s;
  hookctx h;
  uint64_t invariant_lines;
} fx;

static void count_log(void *user, akv_log_level level, const char *message) {
  fx *f = user;
  if (strstr(message, "invariant violated") != NULL) f->invariant_lines++;
  akvt_silent_log(NULL, level, message);
}

static void fx_init(fx *f, akv_route route, uint32_t fail_nth, int32_t fail_kind) {
  akv_engine_config ec = AKV_ENGINE_CONFIG_INIT;
  memset(f, 0, sizeof(*f));
  ec.backend = AKV_BACKEND_HOST;
  ec.n_dense_layers = LAYERS;
  ec.kv_heads = 2;
  ec.head_dim = 8;
  ec.max_tokens = MAXTOK;
  ec.page_tokens = 8;
  ec.max_contexts = 4;
  ec.host_pool_gib = 1;
  ec.device_pool_gib = route == AKV_ROUTE_ARENA ? 1 : 0;
  ec.route = route;
  ec.log_fn = count_log;
  ec.log_user = f;
  ec.fault_fail_nth = fail_nth;
  ec.fault_kind = fail_kind;
  assert_int_equal(akv_engine_create(&ec, &f->e), AKV_OK);
  assert_int_equal(akv_stream_create(f->e, &f->s), AKV_OK);
  f->h.e = f->e;
  f->h.fail_layer = -1;
}

static void fx_done(fx *f) {
  assert_int_equal(akv_stream_destroy(f->e, f->s), AKV_OK);
  assert_int_equal(akv_engine_destroy(f->e), AKV_OK);
  assert_int_equal(f->invariant_lines, 0);
}

static uint64_t ops_total(const akv_engine *e) {
  akv_engine_info info;
  uint64_t n = 0;
  assert_int_equal(akv_engine_info_get(e, &info), AKV_OK);
  for (int k = 0; k < AKV_OP_KIND_COUNT; k++) n += info.backend_ops[k];
  return n;
}

static akv_lease *layer_sealed(fx *f, uint32_t l) {
  akv_lease *ls = NULL;
  akv_fence attn, tail;
  assert_int_equal(akv_lease_begin(f->e, l, &ls), AKV_OK);
  assert_int_equal(akv_lease_attend(ls, f->s, hook, &f->h, &attn), AKV_OK);
  assert_int_equal(akv_lease_write_back(ls, NULL, 0, &tail), AKV_OK);
  assert_int_equal(akv_lease_seal(ls, tail, attn), AKV_OK);
  return ls;
}

/* One whole step over ctx[0..n), with the recommended retire order. */
static void whole_step(fx *f, akv_context **ctx, uint32_t n) {
  akv_lease *ls[LAYERS];
  assert_int_equal(akv_step_begin(f->e, ctx, n), AKV_OK);
  for (uint32_t l = 0; l < LAYERS; l++) {
    ls[l] = layer_sealed(f, l);
    if (l >= 1) assert_int_equal(akv_lease_retire(ls[l - 1], NULL), AKV_OK);
  }
  assert_int_equal(akv_lease_retire(ls[LAYERS - 1], NULL), AKV_OK);
  assert_int_equal(akv_step_end(f->e), AKV_OK);
  for (uint32_t l = 0; l < LAYERS; l++) assert_int_equal(atomic_load(&f->h.jobs[l].bad_rows), 0);
}

/* ---------------------------------------------------- retained-state view */

typedef struct held {
  uint32_t leases_live, tickets, host_leases, fill_leases;
  int step_open;
  akv_lease_state state[LAYERS];
} held;

static held held_now(const akv_engine *e) {
  held h;
  memset(&h, 0, sizeof(h));
  h.leases_live = e->leases_live;
  h.step_open = e->step_open;
  for (uint32_t l = 0; l < LAYERS; l++) {
    h.state[l] = e->leases[l].state;
    if (h.state[l] != AKV_LEASE_IDLE && h.state[l] != AKV_LEASE_RETIRED) h.tickets += e->leases[l].n_tickets;
  }
  for (uint32_t i = 0; i < e->concurrency; i++) {
    if (e->slot_owner[i] == NULL) continue;
    h.host_leases += e->slot_owner[i]->host_leases;
    h.fill_leases += e->slot_owner[i]->fill_leases;
  }
  return h;
}

static void assert_held_equal(const held *a, const held *b) {
  assert_int_equal(a->leases_live, b->leases_live);
  assert_int_equal(a->tickets, b->tickets);
  assert_int_equal(a->host_leases, b->host_leases);
  assert_int_equal(a->fill_leases, b->fill_leases);
  assert_int_equal(a->step_open, b->step_open);
  assert_memory_equal(a->state, b->state, sizeof(a->state));
}

static void assert_nothing_held(const akv_engine *e) {
  held h = held_now(e);
  assert_int_equal(h.leases_live, 0);
  assert_int_equal(h.host_leases, 0);
  assert_int_equal(h.fill_leases, 0);
  assert_int_equal(h.step_open, 0);
}

/* ------------------------------------------------ every call, quarantined */

/* Every non-diagnostic call returns AKV_ERR_QUARANTINED and issues no
 * backend operation; once quarantine released the leases (`released`),
 * their handles are dead and answer AKV_ERR_BAD_HANDLE instead. */
static void assert_all_quarantined(fx *f, akv_context **ctx, akv_lease *sealed, akv_lease *begun,
                                   int released) {
  akv_engine *e = f->e;
  const akv_status lease_st = released ? AKV_ERR_BAD_HANDLE : AKV_ERR_QUARANTINED;
  uint64_t ops = ops_total(e);
  akv_context *c = NULL;
  akv_lease *ls = NULL;
  akv_stream s2 = NULL;
  akv_view view;
  akv_fence fence = {0}, fence2 = {0};
  uint8_t row[ROW_ELEMS * 2] = {0};
  const void *rows[LAYERS] = {row, row, row};
  assert_int_equal(akv_stream_create(e, &s2), AKV_ERR_QUARANTINED);
  assert_null(s2);
  assert_int_equal(akv_stream_synchronize(e, f->s), AKV_ERR_QUARANTINED);
  assert_int_equal(akv_stream_launch_host(e, f->s, job_run, &f->h.jobs[0]), AKV_ERR_QUARANTINED);
  assert_int_equal(akv_context_open(e, NULL, &c), AKV_ERR_QUARANTINED);
  assert_null(c);
  assert_int_equal(akv_context_close(ctx[0]), AKV_ERR_QUARANTINED);
  assert_int_equal(akv_context_close(ctx[2]), AKV_ERR_QUARANTINED);
  assert_int_equal(akv_context_append(ctx[2], 1, rows, rows), AKV_ERR_QUARANTINED);
  assert_int_equal(akv_step_begin(e, ctx, 1), AKV_ERR_QUARANTINED);
  assert_int_equal(akv_step_end(e), AKV_ERR_QUARANTINED);
  assert_int_equal(akv_lease_begin(e, 2, &ls), AKV_ERR_QUARANTINED);
  assert_null(ls);
  assert_int_equal(akv_lease_wait_ready(begun, f->s, &view), lease_st);
  assert_int_equal(akv_lease_mark_consumed(begun, f->s, &fence), lease_st);
  assert_int_equal(akv_lease_attend(begun, f->s, hook, &f->h, &fence), lease_st);
  assert_int_equal(akv_lease_write_back(begun, NULL, 0, &fence2), lease_st);
  assert_int_equal(akv_lease_seal(sealed, fence, fence2), lease_st);
  assert_int_equal(akv_lease_retire(sealed, NULL), lease_st);
  assert_int_equal(akv_lease_retire(begun, NULL), lease_st);
  assert_int_equal(ops_total(e), ops);
}

/* Diagnostics keep answering. */
static void assert_diagnostics_work(fx *f, akv_context **ctx, int quarantined) {
  akv_engine_info info;
  uint64_t counters[AKV_ADM_RULE_COUNT];
  akv_adm_decision log[8];
  size_t n_log = 0;
  char buf[512];
  uint32_t len = 0, id = 0;
  uint8_t k[ROW_ELEMS * 2], v[ROW_ELEMS * 2];
  assert_int_equal(akv_engine_info_get(f->e, &info), AKV_OK);
  assert_int_equal(info.transport_failed, 1);
  assert_int_equal(info.quarantined, quarantined);
  assert_string_not_equal(akv_engine_last_error(f->e), "");
  assert_int_equal(akv_context_length(ctx[0], &len), AKV_OK);
  assert_int_equal(akv_context_id(ctx[0], &id), AKV_OK);
  assert_int_equal(akv_admission_counters(f->e, counters, AKV_ADM_RULE_COUNT), AKV_OK);
  assert_int_equal(akv_admission_log(f->e, log, 8, &n_log), AKV_OK);
  assert_int_equal(akv_admission_explain(f->e, ctx[0], buf, sizeof(buf)), AKV_OK);
  assert_int_equal(akv_admission_explain(f->e, NULL, buf, sizeof(buf)), AKV_OK);
  /* a context outside the step stays readable */
  assert_int_equal(akv_context_read(ctx[2], 1, 0, 1, k, v), AKV_OK);
  /* one inside it is readable only once quarantine released it */
  assert_int_equal(akv_context_read(ctx[0], 1, 0, 1, k, v), quarantined ? AKV_OK : AKV_ERR_IN_USE);
}

static void open_three(fx *f, akv_context **ctx, uint32_t n0) {
  for (uint32_t i = 0; i < 3; i++) {
    assert_int_equal(akv_context_open(f->e, NULL, &ctx[i]), AKV_OK);
    prefill(ctx[i], 10 + i, n0 + i);
    f->h.tags[i] = 10 + i;
  }
}

static void test_quarantined_status_for_every_call_after_a_failure(void **state) {
  fx f;
  akv_context *ctx[3];
  akv_lease *l0, *l1 = NULL;
  akv_fence attn;
  akv_quarantine_report q;
  (void)state;
  fx_init(&f, AKV_ROUTE_STAGE, 0, -1);
  open_three(&f, ctx, 5);
  assert_int_equal(akv_step_begin(f.e, ctx, 2), AKV_OK);
  l0 = layer_sealed(&f, 0);
  assert_int_equal(akv_lease_begin(f.e, 1, &l1), AKV_OK);
  f.h.fail_layer = 1;
  assert_int_equal(akv_lease_attend(l1, f.s, hook, &f.h, &attn), AKV_ERR_BACKEND);

  assert_all_quarantined(&f, ctx, l0, l1, 0);
  assert_diagnostics_work(&f, ctx, 0);
  /* destroy: busy (failed transport, not quarantined), frees nothing */
  assert_int_equal(akv_engine_destroy(f.e), AKV_ERR_BUSY);
  assert_int_equal(f.e->leases_live, 2);

  assert_int_equal(akv_engine_quarantine(f.e, &q), AKV_OK);
  assert_true(q.h2d_ok && q.d2h_ok && q.d2d_ok && q.device_ok);
  assert_int_equal(q.leases_released, 2);
  assert_int_equal(q.tickets_released, 2 * 2 + 2); /* l0: H2D+D2H x 2 contexts; l1: H2D x 2 */
  assert_int_equal(q.retained_leases, 0);
  assert_string_equal(q.uncertain, "");
  assert_nothing_held(f.e);
  /* still only diagnostics, quarantine and destroy; the released leases'
   * handles are dead */
  assert_all_quarantined(&f, ctx, l0, l1, 1);
  assert_diagnostics_work(&f, ctx, 1);
  /* a second quarantine is allowed and finds nothing left */
  assert_int_equal(akv_engine_quarantine(f.e, &q), AKV_OK);
  assert_int_equal(q.leases_released, 0);
  /* the rows authoritative before the failing step are all there */
  expect_rows(ctx[0], 10, 5);
  expect_rows(ctx[1], 11, 6);
  expect_rows(ctx[2], 12, 7);
  assert_int_equal(akv_engine_quarantine(NULL, &q), AKV_ERR_BAD_HANDLE);
  fx_done(&f);
}

static void test_destroy_never_waits(void **state) {
  fx f;
  akv_context *ctx[3];
  akv_lease *l0, *l1, *l2;
  gate g;
  double t0, dt;
  held before;
  (void)state;
  memset(&g, 0, sizeof(g));
  assert_int_equal(akv_engine_destroy(NULL), AKV_ERR_BAD_HANDLE);
  fx_init(&f, AKV_ROUTE_STAGE, 0, -1);
  open_three(&f, ctx, 9);

  /* attention of layer 0 is held at a gate: the step's work is in flight */
  f.h.gate_layer[0] = &g;
  assert_int_equal(akv_step_begin(f.e, ctx, 3), AKV_OK);
  l0 = layer_sealed(&f, 0);
  before = held_now(f.e);
  t0 = now_ms();
  assert_int_equal(akv_engine_destroy(f.e), AKV_ERR_BUSY);
  dt = now_ms() - t0;
  /* it returned while the gate was still closed: it did not wait */
  assert_int_equal(atomic_load(&g.open), 0);
  assert_int_equal(atomic_load(&f.h.jobs[0].ran), 0);
  assert_true(dt < 1000.0);
  {
    held after = held_now(f.e);
    assert_held_equal(&before, &after);
  }
  assert_string_not_equal(akv_engine_last_error(f.e), "");
  atomic_store(&g.open, 1);
  /* the engine goes on: the same step completes */
  l1 = layer_sealed(&f, 1);
  assert_int_equal(akv_lease_retire(l0, NULL), AKV_OK);
  l2 = layer_sealed(&f, 2);
  assert_int_equal(akv_lease_retire(l1, NULL), AKV_OK);
  /* every lease sealed, one unretired: busy */
  assert_int_equal(akv_engine_destroy(f.e), AKV_ERR_BUSY);
  assert_int_equal(akv_lease_retire(l2, NULL), AKV_OK);
  /* open step without live leases: busy */
  assert_int_equal(akv_engine_destroy(f.e), AKV_ERR_BUSY);
  assert_int_equal(akv_step_end(f.e), AKV_OK);
  for (uint32_t l = 0; l < LAYERS; l++) assert_int_equal(atomic_load(&f.h.jobs[l].bad_rows), 0);
  f.h.gate_layer[0] = NULL;
  whole_step(&f, ctx, 3);
  expect_rows(ctx[0], 10, 11);
  /* a live stream from akv_stream_create: busy */
  assert_int_equal(akv_engine_destroy(f.e), AKV_ERR_BUSY);
  {
    akv_engine_info info;
    assert_int_equal(akv_engine_info_get(f.e, &info), AKV_OK);
    assert_int_equal(info.steps, 2);
    assert_int_equal(info.transport_failed, 0);
  }
  /* open contexts are not live work: destroy frees them */
  fx_done(&f);
}

/* Destroy waits on nothing of the caller's: engine A's caller stream is held
 * at a gate (unrelated work in flight, A's step open); engine B, after a whole
 * step of its own, is destroyed and returns at once with A's gate still
 * closed. Then the cost of destroy itself is measured over repeated
 * create/step/destroy cycles while A's stream stays busy (printed; the
 * figure docs/api.md quotes). ASan and valgrind check that nothing leaks. */
static void test_destroy_waits_on_no_caller_stream(void **state) {
  fx a, b;
  akv_context *ca[3], *cb[3];
  akv_lease *l0;
  static gate g; /* static: a failed assertion must not leave A's job on a dead frame */
  double dt, worst = 0.0, total = 0.0;
  const int rounds = 20;
  (void)state;
  memset(&g, 0, sizeof(g));
  fx_init(&a, AKV_ROUTE_STAGE, 0, -1);
  open_three(&a, ca, 9);
  a.h.gate_layer[0] = &g;
  assert_int_equal(akv_step_begin(a.e, ca, 3), AKV_OK);
  l0 = layer_sealed(&a, 0);
  for (int r = 0; r < rounds; r++) {
    fx_init(&b, r % 2 == 0 ? AKV_ROUTE_STAGE : AKV_ROUTE_ARENA, 0, -1);
    open_three(&b, cb, 9);
    whole_step(&b, cb, 3);
    assert_int_equal(akv_stream_destroy(b.e, b.s), AKV_OK);
    {
      double t0 = now_ms();
      assert_int_equal(akv_engine_destroy(b.e), AKV_OK);
      dt = now_ms() - t0;
    }
    /* it returned while A's unrelated work was still held at the gate */
    assert_int_equal(atomic_load(&g.open), 0);
    assert_int_equal(atomic_load(&a.h.jobs[0].ran), 0);
    assert_true(dt < 1000.0);
    total += dt;
    if (dt > worst) worst = dt;
    assert_int_equal(b.invariant_lines, 0);
  }
  print_message("akv_engine_destroy (host backend, 3 contexts, stage/arena): mean %.3f ms, "
                "worst %.3f ms over %d, another engine's stream busy throughout\n",
                total / rounds, worst, rounds);
  atomic_store(&g.open, 1);
  {
    akv_lease *l1 = layer_sealed(&a, 1), *l2;
    assert_int_equal(akv_lease_retire(l0, NULL), AKV_OK);
    l2 = layer_sealed(&a, 2);
    assert_int_equal(akv_lease_retire(l1, NULL), AKV_OK);
    assert_int_equal(akv_lease_retire(l2, NULL), AKV_OK);
  }
  assert_int_equal(akv_step_end(a.e), AKV_OK);
  for (uint32_t l = 0; l < LAYERS; l++) assert_int_equal(atomic_load(&a.h.jobs[l].bad_rows), 0);
  fx_done(&a);
}

static void test_quarantine_synchronises_then_releases(void **state) {
  fx f;
  akv_context *ctx[3];
  akv_lease *l0, *l1 = NULL;
  akv_fence attn;
  akv_quarantine_report q;
  gate g;
  opener op;
  double t0, dt;
  held before;
  (void)state;
  memset(&g, 0, sizeof(g));
  fx_init(&f, AKV_ROUTE_STAGE, 0, -1);
  open_three(&f, ctx, 4);
  f.h.gate_layer[0] = &g;
  assert_int_equal(akv_step_begin(f.e, ctx, 3), AKV_OK);
  l0 = layer_sealed(&f, 0); /* attention and its write-back wait at the gate */
  assert_int_equal(l0->body->state, AKV_LEASE_SEALED);
  assert_int_equal(akv_lease_begin(f.e, 1, &l1), AKV_OK);
  f.h.fail_layer = 1;
  assert_int_equal(akv_lease_attend(l1, f.s, hook, &f.h, &attn), AKV_ERR_BACKEND);
  before = held_now(f.e);
  assert_int_equal(before.leases_live, 2);
  assert_true(before.host_leases > 0);

  open_later(&op, &g, 150);
  t0 = now_ms();
  assert_int_equal(akv_engine_quarantine(f.e, &q), AKV_OK);
  dt = now_ms() - t0;
  assert_int_equal(pthread_join(op.thread, NULL), 0);
  /* it blocked until the gated work really ran, write-back included */
  assert_true(dt >= 100.0);
  assert_int_equal(atomic_load(&f.h.jobs[0].ran), 1);
  assert_int_equal(atomic_load(&f.h.jobs[0].bad_rows), 0);
  for (uint32_t i = 0; i < 3; i++) {
    uint8_t want[ROW_ELEMS * 2];
    const uint8_t *k = akv_host_layer(f.e, ctx[i], 0) + (uint64_t)(4 + i) * 2 * sizeof(want);
    fill_row(want, 10 + i, 0, 4 + i, 0);
    assert_memory_equal(k, want, sizeof(want)); /* the landed write-back row */
  }
  assert_true(q.h2d_ok && q.d2h_ok && q.d2d_ok && q.device_ok);
  assert_int_equal(q.leases_released, 2);
  assert_int_equal(q.tickets_released, before.tickets);
  assert_nothing_held(f.e);
  {
    akv_engine_info info;
    assert_int_equal(akv_engine_info_get(f.e, &info), AKV_OK);
    assert_int_equal(info.quarantined, 1);
  }
  /* the new rows were never published: lengths and old rows unchanged */
  expect_rows(ctx[0], 10, 4);
  expect_rows(ctx[1], 11, 5);
  expect_rows(ctx[2], 12, 6);
  fx_done(&f);
}

static void test_uncertain_fence_keeps_everything_retained(void **state) {
  (void)state;
  /* each of quarantine's four synchronise calls fails in turn (injected) */
  for (int j = 1; j <= 4; j++) {
    fx f;
    akv_context *ctx[3];
    akv_lease *l0, *l1 = NULL;
    akv_fence attn;
    akv_quarantine_report q;
    held before, after;
    static const char *const names[4] = {"h2d-queue", "d2h-queue", "d2d-queue", "device"};
    fx_init(&f, AKV_ROUTE_ARENA, 0, -1);
    open_three(&f, ctx, 20);
    assert_int_equal(akv_step_begin(f.e, ctx, 3), AKV_OK);
    l0 = layer_sealed(&f, 0);
    assert_int_equal(akv_lease_begin(f.e, 1, &l1), AKV_OK);
    f.h.fail_layer = 1;
    assert_int_equal(akv_lease_attend(l1, f.s, hook, &f.h, &attn), AKV_ERR_BACKEND);
    assert_int_equal(akv_lease_retire(l0, NULL), AKV_ERR_QUARANTINED);
    before = held_now(f.e);
    f.e->bk.fail_kind = AKV_OP_SYNC;
    f.e->bk.fail_nth = (uint32_t)(f.e->bk.counted + (uint64_t)j);
    assert_int_equal(akv_engine_quarantine(f.e, &q), AKV_ERR_UNCERTAIN_FENCE);
    assert_int_equal(q.h2d_ok, j != 1);
    assert_int_equal(q.d2h_ok, j != 2);
    assert_int_equal(q.d2d_ok, j != 3);
    assert_int_equal(q.device_ok, j != 4);
    assert_non_null(strstr(q.uncertain, names[j - 1]));
    assert_int_equal(q.retained_leases, 2);
    assert_int_equal(q.leases_released, 0);
    assert_int_equal(q.tickets_released, 0);
    after = held_now(f.e);
    assert_held_equal(&before, &after);
    assert_int_equal(akv_engine_destroy(f.e), AKV_ERR_BUSY);
    after = held_now(f.e);
    assert_held_equal(&before, &after);
    {
      uint8_t k[ROW_ELEMS * 2], v[ROW_ELEMS * 2];
      assert_int_equal(akv_context_read(ctx[0], 0, 0, 1, k, v), AKV_ERR_IN_USE);
    }
    {
      akv_engine_info info;
      assert_int_equal(akv_engine_info_get(f.e, &info), AKV_OK);
      assert_int_equal(info.quarantined, 0);
    }
    /* the queues are in fact drained: a later quarantine establishes it */
    assert_int_equal(akv_engine_quarantine(f.e, &q), AKV_OK);
    assert_int_equal(q.leases_released, 2);
    assert_int_equal(q.tickets_released, before.tickets);
    assert_nothing_held(f.e);
    expect_rows(ctx[0], 10, 20);
    fx_done(&f);
  }
}

/* ------------------------------------------------------------ invariants */

/* context.c: a ticket holds a host page lease on its slot; close refuses
 * while one is held, so the slot's generation moves only when a closed slot
 * is reopened. The authoritative rows survive a failing step: the step's new
 * row is published (the length grows) only at step_end, after every
 * write-back was proven. */
static void test_invariant_source_authority_survives_until_replacement_valid(void **state) {
  fx f;
  akv_context *ctx[3], *again = NULL;
  akv_lease *l0, *l1 = NULL;
  akv_fence attn;
  akv_quarantine_report q;
  uint64_t gen;
  uint32_t slot;
  uint8_t k[ROW_ELEMS * 2], v[ROW_ELEMS * 2];
  (void)state;
  fx_init(&f, AKV_ROUTE_STAGE, 0, -1);
  open_three(&f, ctx, 6);

  /* a ticket (here: a page fill's host page lease) holds ctx[2]'s slot
   * outside any step: the slot cannot be closed; its rows stay readable
   * (a fill only reads them, and no lease of a step can write them:
   * akv.h, akv_context_read) */
  gen = akv_ticket_take(f.e, ctx[2]);
  assert_int_equal(gen, ctx[2]->generation);
  assert_int_equal(akv_context_close(ctx[2]), AKV_ERR_IN_USE);
  assert_int_equal(akv_context_read(ctx[2], 0, 0, 1, k, v), AKV_OK);
  assert_int_equal(ctx[2]->generation, gen);
  assert_true(akv_ticket_valid(f.e, ctx[2]->slot, gen));
  akv_ticket_release(f.e, ctx[2]->slot);
  assert_int_equal(ctx[2]->host_leases, 0);
  /* released: the source may now be replaced, and only now its generation moves */
  slot = ctx[2]->slot;
  assert_int_equal(akv_context_close(ctx[2]), AKV_OK);
  assert_int_equal(akv_context_open(f.e, NULL, &again), AKV_OK);
  assert_int_equal(again->slot, slot);
  assert_int_equal(again->generation, gen + 1);
  /* a ticket of the old generation is no longer valid on the reopened slot */
  assert_false(akv_ticket_valid(f.e, slot, gen));
  ctx[2] = again;
  prefill(ctx[2], 12, 8);
  f.h.tags[2] = 12;

  /* mid-step: tickets of the step's leases hold the owners */
  assert_int_equal(akv_step_begin(f.e, ctx, 2), AKV_OK);
  l0 = layer_sealed(&f, 0); /* layer 0's new rows written back to host row len */
  gen = ctx[0]->generation;
  assert_int_equal(akv_context_close(ctx[0]), AKV_ERR_IN_USE);
  assert_int_equal(ctx[0]->generation, gen);
  assert_true(ctx[0]->host_leases > 0);
  /* the step fails before its replacement rows are valid everywhere */
  assert_int_equal(akv_lease_begin(f.e, 1, &l1), AKV_OK);
  f.h.fail_layer = 1;
  assert_int_equal(akv_lease_attend(l1, f.s, hook, &f.h, &attn), AKV_ERR_BACKEND);
  assert_int_equal(akv_lease_retire(l0, NULL), AKV_ERR_QUARANTINED);
  assert_int_equal(akv_engine_quarantine(f.e, &q), AKV_OK);
  assert_int_equal(ctx[0]->generation, gen);
  /* the authoritative rows are intact and the half-written step is not
   * published: lengths did not grow */
  expect_rows(ctx[0], 10, 6);
  expect_rows(ctx[1], 11, 7);
  expect_rows(ctx[2], 12, 8);
  assert_int_equal(f.invariant_lines, 0);
  fx_done(&f);
}

/* The tripwire behind source authority (context.c, akv_ticket_valid): a
 * ticket whose slot changed generation under it (what a close that ignored
 * the host page lease would do) is not released. Retire then fails with
 * AKV_ERR_BACKEND, releases nothing and marks the transport failed; the
 * same holds for a page fill's ticket at step_end. */
static void test_generation_moved_under_a_ticket_fails_the_release(void **state) {
  fx f;
  akv_context_config cc = AKV_CONTEXT_CONFIG_INIT;
  akv_context *ctx[1];
  akv_lease *ls[LAYERS];
  akv_quarantine_report q;
  uint32_t leases_before;
  (void)state;

  /* a lease's tickets, at retire */
  fx_init(&f, AKV_ROUTE_STAGE, 0, -1);
  assert_int_equal(akv_context_open(f.e, NULL, &ctx[0]), AKV_OK);
  prefill(ctx[0], 10, 6);
  f.h.tags[0] = 10;
  assert_int_equal(akv_step_begin(f.e, ctx, 1), AKV_OK);
  ls[0] = layer_sealed(&f, 0);
  leases_before = ctx[0]->host_leases;
  assert_true(leases_before > 0);
  f.e->slot_generation[ctx[0]->slot]++; /* forged: the slot moved under the ticket */
  ctx[0]->generation++;
  assert_int_equal(akv_lease_retire(ls[0], NULL), AKV_ERR_BACKEND);
  assert_non_null(strstr(akv_engine_last_error(f.e), "invariant violated"));
  assert_int_equal(ctx[0]->host_leases, leases_before); /* nothing released */
  assert_int_equal(f.e->leases[0].state, AKV_LEASE_SEALED);
  assert_int_equal(akv_step_end(f.e), AKV_ERR_QUARANTINED);
  f.e->slot_generation[ctx[0]->slot]--;
  ctx[0]->generation--;
  assert_int_equal(akv_engine_quarantine(f.e, &q), AKV_OK);
  assert_int_equal(ctx[0]->host_leases, 0);
  f.invariant_lines = 0;
  fx_done(&f);

  /* a page fill's ticket, at step_end (arena route: the fills of the
   * context's full pages hold its slot until the step ends) */
  fx_init(&f, AKV_ROUTE_ARENA, 0, -1);
  cc.target_pages = 4;
  assert_int_equal(akv_context_open(f.e, &cc, &ctx[0]), AKV_OK);
  prefill(ctx[0], 10, 20);
  f.h.tags[0] = 10;
  assert_int_equal(akv_step_begin(f.e, ctx, 1), AKV_OK);
  assert_true(ctx[0]->fill_leases > 0);
  for (uint32_t l = 0; l < LAYERS; l++) ls[l] = layer_sealed(&f, l);
  for (uint32_t l = 0; l < LAYERS; l++) assert_int_equal(akv_lease_retire(ls[l], NULL), AKV_OK);
  leases_before = ctx[0]->host_leases;
  assert_int_equal(leases_before, ctx[0]->fill_leases);
  f.e->slot_generation[ctx[0]->slot]++;
  ctx[0]->generation++;
  assert_int_equal(akv_step_end(f.e), AKV_ERR_BACKEND);
  assert_non_null(strstr(akv_engine_last_error(f.e), "invariant violated"));
  assert_int_equal(ctx[0]->host_leases, leases_before);
  f.e->slot_generation[ctx[0]->slot]--;
  ctx[0]->generation--;
  assert_int_equal(akv_engine_quarantine(f.e, &q), AKV_OK);
  expect_rows(ctx[0], 10, 20); /* the step was not published */
  f.invariant_lines = 0;
  fx_done(&f);
}

/* step.c: at a boundary a page that left a window (logical cancellation) is
 * refilled for another logical page (physical reuse) with no wait: every
 * reader of every page belongs to a lease of an earlier step, and the
 * boundary is reached only with no live lease, each having waited on its
 * events at retire. Enforced by akv_step_end: with a lease sealed but not
 * retired (its device->device reads of the pages may still be running) the
 * step does not end, nothing changes, and no boundary can be opened. */
static void test_invariant_logical_cancellation_physical_reuse_waits_for_fences(void **state) {
  fx f;
  akv_context *ctx[1];
  akv_context_config cc = AKV_CONTEXT_CONFIG_INIT;
  const akv_adm_fill *fills = NULL;
  size_t n_fills;
  uint32_t reused = 0;
  (void)state;
  fx_init(&f, AKV_ROUTE_ARENA, 0, -1);
  /* target 2, no burst: the window is the sink and the newest full page */
  cc.target_pages = 2;
  cc.burst_pages = 0;
  assert_int_equal(akv_context_open(f.e, &cc, &ctx[0]), AKV_OK);
  prefill(ctx[0], 20, 23); /* 2 full pages of 8 */
  f.h.tags[0] = 20;
  /* decode across two page boundaries (24 and 32 rows): each time the page
   * that leaves the window is physically reused (own reuse) for the new
   * newest page, after materialisations of earlier steps read it */
  for (uint32_t s = 0; s < 12; s++) {
    uint32_t full = (23 + s) / 8; /* full pages at this step's boundary */
    uint32_t leaving = full >= 2 ? akv_adm_page_of(f.e->adm, ctx[0]->slot, full - 2) : AKV_ADM_NONE;
    whole_step(&f, ctx, 1);
    n_fills = akv_adm_fills(f.e->adm, &fills);
    for (size_t i = 0; i < n_fills; i++)
      if (fills[i].physical == leaving && fills[i].logical == full - 1) reused++;
    for (uint32_t l = 0; l < LAYERS; l++) assert_int_equal(atomic_load(&f.h.jobs[l].bad_rows), 0);
  }
  assert_int_equal(reused, 2);
  expect_rows(ctx[0], 20, 35);

  /* enforcement: decode to 39 rows, so that the next boundary (40 rows)
   * reuses a page the step's materialisations read; keep the last lease
   * sealed, not retired */
  for (uint32_t s = 0; s < 4; s++) whole_step(&f, ctx, 1); /* 39 rows */
  {
    akv_lease *ls[LAYERS];
    uint64_t ops;
    assert_int_equal(akv_step_begin(f.e, ctx, 1), AKV_OK);
    for (uint32_t l = 0; l < LAYERS; l++) {
      ls[l] = layer_sealed(&f, l);
      if (l + 1 < LAYERS) assert_int_equal(akv_lease_retire(ls[l], NULL), AKV_OK);
    }
    ops = ops_total(f.e);
    assert_int_equal(akv_step_end(f.e), AKV_ERR_STEP_STATE);
    assert_int_equal(akv_step_begin(f.e, ctx, 1), AKV_ERR_STEP_STATE);
    assert_int_equal(ops_total(f.e), ops); /* nothing submitted */
    assert_int_equal(f.e->leases_live, 1);
    assert_true(f.e->step_open);
    assert_int_equal(ctx[0]->len, 39); /* not published */
    assert_int_equal(akv_lease_retire(ls[LAYERS - 1], NULL), AKV_OK);
    assert_int_equal(akv_step_end(f.e), AKV_OK);
  }
  whole_step(&f, ctx, 1); /* the boundary at 40 rows reuses the page */
  n_fills = akv_adm_fills(f.e->adm, &fills);
  assert_true(n_fills > 0);
  for (uint32_t l = 0; l < LAYERS; l++) assert_int_equal(atomic_load(&f.h.jobs[l].bad_rows), 0);
  expect_rows(ctx[0], 20, 41);
  fx_done(&f);
}

/* lease.c / engine.c: once begun, a lease owns every copy it submitted
 * (tickets with host page leases), also when a later submission fails; the
 * engine then refuses everything but quarantine, and quarantine releases
 * those submissions only after draining every queue proves them complete. */
static void test_invariant_partial_submissions_quarantine_until_drain(void **state) {
  fx f;
  akv_context *ctx[3];
  akv_lease *l0, *l1 = NULL;
  akv_quarantine_report q;
  gate g;
  opener op;
  double t0, dt;
  held before;
  (void)state;
  memset(&g, 0, sizeof(g));
  /* records of a stage step: layer 0 history-ready (1), attention (2),
   * tail (3); layer 1 history-ready (4) fails after its H2D copy went out */
  fx_init(&f, AKV_ROUTE_STAGE, 4, AKV_OP_RECORD);
  open_three(&f, ctx, 7);
  f.h.gate_layer[0] = &g;
  assert_int_equal(akv_step_begin(f.e, ctx, 3), AKV_OK);
  l0 = layer_sealed(&f, 0); /* its attention and write-back wait at the gate */
  assert_int_equal(akv_lease_begin(f.e, 1, &l1), AKV_ERR_BACKEND);
  assert_null(l1);
  /* the partial submission stays with its lease: live, tickets held */
  assert_int_equal(f.e->leases[1].state, AKV_LEASE_BEGUN);
  assert_int_equal(f.e->leases[1].n_tickets, 3);
  before = held_now(f.e);
  assert_int_equal(before.leases_live, 2);
  assert_int_equal(before.host_leases, 3 * 2 + 3); /* l0 H2D+D2H, l1 H2D */
  assert_int_equal(akv_engine_destroy(f.e), AKV_ERR_BUSY);
  assert_int_equal(akv_lease_retire(l0, NULL), AKV_ERR_QUARANTINED);
  {
    held after = held_now(f.e);
    assert_held_equal(&before, &after);
  }
  open_later(&op, &g, 150);
  t0 = now_ms();
  assert_int_equal(akv_engine_quarantine(f.e, &q), AKV_OK);
  dt = now_ms() - t0;
  assert_int_equal(pthread_join(op.thread, NULL), 0);
  assert_true(dt >= 100.0); /* the drain waited for the gated work */
  assert_int_equal(atomic_load(&f.h.jobs[0].ran), 1);
  assert_int_equal(q.leases_released, 2);
  assert_int_equal(q.tickets_released, before.tickets);
  assert_nothing_held(f.e);
  expect_rows(ctx[0], 10, 7);
  fx_done(&f);
}

/* engine.c: when a queue cannot be proven drained, quarantine releases
 * nothing: leases keep their state, tickets and host page leases stay, the
 * step stays open, destroy refuses. Here the fence is really uncertain: the
 * compute stream is blocked past the synchronise timeout. */
static void test_invariant_nothing_recycled_on_uncertain_fence(void **state) {
  fx f;
  akv_context *ctx[3];
  akv_lease *l0, *l1 = NULL;
  akv_fence attn;
  akv_quarantine_report q;
  gate g;
  held before, after;
  (void)state;
  memset(&g, 0, sizeof(g));
  setenv("AKV_HOST_SYNC_TIMEOUT_MS", "150", 1);
  fx_init(&f, AKV_ROUTE_STAGE, 0, -1);
  unsetenv("AKV_HOST_SYNC_TIMEOUT_MS");
  open_three(&f, ctx, 5);
  f.h.gate_layer[0] = &g;
  assert_int_equal(akv_step_begin(f.e, ctx, 3), AKV_OK);
  l0 = layer_sealed(&f, 0);
  assert_int_equal(akv_lease_begin(f.e, 1, &l1), AKV_OK);
  f.h.fail_layer = 1;
  assert_int_equal(akv_lease_attend(l1, f.s, hook, &f.h, &attn), AKV_ERR_BACKEND);
  before = held_now(f.e);

  /* the D2H queue waits on layer 0's attention, which waits at the gate */
  assert_int_equal(akv_engine_quarantine(f.e, &q), AKV_ERR_UNCERTAIN_FENCE);
  assert_true(q.h2d_ok);
  assert_false(q.d2h_ok);
  assert_false(q.device_ok);
  assert_non_null(strstr(q.uncertain, "d2h-queue"));
  assert_non_null(strstr(q.uncertain, "device"));
  assert_int_equal(q.retained_leases, 2);
  assert_int_equal(q.leases_released, 0);
  after = held_now(f.e);
  assert_held_equal(&before, &after);
  assert_int_equal(l0->body->state, AKV_LEASE_SEALED);
  assert_int_equal(akv_engine_destroy(f.e), AKV_ERR_BUSY);
  {
    uint8_t k[ROW_ELEMS * 2], v[ROW_ELEMS * 2];
    assert_int_equal(akv_context_read(ctx[0], 0, 0, 1, k, v), AKV_ERR_IN_USE);
  }
  /* still uncertain: still nothing recycled */
  assert_int_equal(akv_engine_quarantine(f.e, &q), AKV_ERR_UNCERTAIN_FENCE);
  after = held_now(f.e);
  assert_held_equal(&before, &after);
  assert_int_equal(atomic_load(&f.h.jobs[0].ran), 0);

  /* the work completes; now a drain can prove it */
  atomic_store(&g.open, 1);
  assert_int_equal(akv_engine_quarantine(f.e, &q), AKV_OK);
  assert_int_equal(atomic_load(&f.h.jobs[0].ran), 1);
  assert_int_equal(q.leases_released, 2);
  assert_nothing_held(f.e);
  expect_rows(ctx[0], 10, 5);
  fx_done(&f);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_quarantined_status_for_every_call_after_a_failure),
      cmocka_unit_test(test_destroy_never_waits),
      cmocka_unit_test(test_destroy_waits_on_no_caller_stream),
      cmocka_unit_test(test_quarantine_synchronises_then_releases),
      cmocka_unit_test(test_uncertain_fence_keeps_everything_retained),
      cmocka_unit_test(test_invariant_source_authority_survives_until_replacement_valid),
      cmocka_unit_test(test_generation_moved_under_a_ticket_fails_the_release),
      cmocka_unit_test(test_invariant_logical_cancellation_physical_reuse_waits_for_fences),
      cmocka_unit_test(test_invariant_partial_submissions_quarantine_until_drain),
      cmocka_unit_test(test_invariant_nothing_recycled_on_uncertain_fence),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
