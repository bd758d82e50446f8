/*
 * test_reentry.c - the public API called back from inside the library's own
 * callbacks: the attention hook of akv_lease_attend (on its own lease, its
 * own engine and another engine) and the log callback, and handles of one
 * engine whose records a callback let another engine take. akv.h states what
 * each call answers there; a refused call must change nothing. Also engines
 * driven side by side from several threads (each thread its own engine; the
 * record pools and serial counters are shared).
 */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "internal.h"
#include "testutil.h"

#define LAYERS 3 /* akvt_small_config */
#define ROW_ELEMS 16

typedef akvt_fx fx; /* a small stage-route host engine, one stream, n contexts */
static void fx_open(fx *f, uint32_t n, uint32_t len) { akvt_fx_open(f, AKV_ROUTE_STAGE, 0, n, len); }

static void fx_close(fx *f) {
  for (uint32_t i = 0; i < f->n; i++) assert_int_equal(akv_context_close(f->c[i]), AKV_OK);
  assert_int_equal(akv_stream_destroy(f->e, f->s), AKV_OK);
  assert_int_equal(akv_engine_destroy(f->e), AKV_OK);
}

/* Layers from `from` on through the whole cycle, then the step's end. */
static void finish_step(akv_engine *e, akv_stream s, uint32_t from, uint32_t layers) {
  assert_int_equal(akvt_null_layers_from(e, s, from, layers), AKV_OK);
}

/* Up to 32 steps of contexts cs on engine e, every layer's lease begun and
 * taken through, until a begin is handed the record `want`: that lease is
 * returned, left begun (its step open). NULL when none was. */
static akv_lease *steps_until_record(akv_engine *e, akv_stream s, akv_context *const *cs,
                                     uint32_t n, uint32_t layers, const akv_lease *want) {
  for (uint32_t step = 0; step < 32; step++) {
    assert_int_equal(akv_step_begin(e, cs, n), AKV_OK);
    for (uint32_t l = 0; l < layers; l++) {
      akv_lease *ls = NULL;
      assert_int_equal(akv_lease_begin(e, l, &ls), AKV_OK);
      if (ls == want) return ls;
      assert_int_equal(akvt_lease_through(ls, s), AKV_OK);
    }
    assert_int_equal(akv_step_end(e), AKV_OK);
  }
  return NULL;
}

/* ----------------------------------------- the hook calls its own engine */

typedef struct mutator {
  fx *f;
  akv_lease *self;
  akv_status open, close, append, append_layer, step_begin, step_end, lease_begin, stream_destroy,
      stream_create, stream_destroy_new, headroom_take, headroom_release, destroy, attend_self,
      wait_self, seal_self, retire_self, write_back_self, mark_other_stream, read_in_step;
  akv_stream other;
} mutator;

static int mutator_hook(void *user, const akv_view *view, akv_stream stream) {
  mutator *m = user;
  fx *f = m->f;
  static uint16_t zero[ROW_ELEMS];
  const void *rows[LAYERS] = {zero, zero, zero};
  akv_context *c = NULL;
  akv_lease *next = NULL;
  akv_view v2;
  akv_fence fz = {0}, ft;
  uint16_t k[ROW_ELEMS], v[ROW_ELEMS];
  (void)view;
  m->open = akv_context_open(f->e, NULL, &c);
  m->close = akv_context_close(f->c[0]);
  m->append = akv_context_append(f->c[0], 1, rows, rows);
  m->append_layer = akv_context_append_layer(f->c[0], 0, 1, zero, zero);
  m->read_in_step = akv_context_read(f->c[0], 0, 0, 1, k, v);
  m->step_begin = akv_step_begin(f->e, f->c, f->n);
  m->step_end = akv_step_end(f->e);
  m->lease_begin = akv_lease_begin(f->e, 1, &next);
  m->stream_destroy = akv_stream_destroy(f->e, stream);
  m->stream_create = akv_stream_create(f->e, &m->other);
  m->stream_destroy_new = m->stream_create == AKV_OK ? akv_stream_destroy(f->e, m->other) : AKV_OK;
  m->headroom_take = akv_headroom_take(f->e, 1, NULL);
  m->headroom_release = akv_headroom_release(f->e, 1, NULL, NULL);
  m->destroy = akv_engine_destroy(f->e);
  m->attend_self = akv_lease_attend(m->self, stream, akvt_noop_hook, NULL, &ft);
  m->wait_self = akv_lease_wait_ready(m->self, stream, &v2);
  m->write_back_self = akv_lease_write_back(m->self, NULL, 0, &ft);
  m->seal_self = akv_lease_seal(m->self, fz, fz);
  m->retire_self = akv_lease_retire(m->self, NULL);
  assert_null(c);
  assert_null(next);
  return 0;
}

/* Inside the hook the lease is ready and the step open: every call that would
 * change the engine answers the status akv.h gives for that state and
 * changes nothing; attend then completes as if nothing had been called. */
static void test_hook_calls_every_mutator_on_its_engine(void **state) {
  fx f;
  mutator m;
  akv_lease *ls = NULL;
  akv_fence attn = {0}, tail;
  uint32_t len = 0;
  (void)state;
  fx_open(&f, 2, 3);
  assert_int_equal(akv_step_begin(f.e, f.c, 2), AKV_OK);
  assert_int_equal(akv_lease_begin(f.e, 0, &ls), AKV_OK);
  memset(&m, 0, sizeof m);
  m.f = &f;
  m.self = ls;
  assert_int_equal(akv_lease_attend(ls, f.s, mutator_hook, &m, &attn), AKV_OK);
  assert_int_not_equal(attn.serial, 0);
  assert_int_equal(m.open, AKV_ERR_STEP_STATE);
  assert_int_equal(m.close, AKV_ERR_IN_USE);
  assert_int_equal(m.append, AKV_ERR_IN_USE);
  assert_int_equal(m.append_layer, AKV_ERR_IN_USE);
  assert_int_equal(m.read_in_step, AKV_ERR_IN_USE);
  assert_int_equal(m.step_begin, AKV_ERR_STEP_STATE);
  assert_int_equal(m.step_end, AKV_ERR_STEP_STATE);
  assert_int_equal(m.lease_begin, AKV_ERR_LEASE_ORDER);
  assert_int_equal(m.stream_destroy, AKV_ERR_IN_USE);
  assert_int_equal(m.stream_create, AKV_OK);
  assert_int_equal(m.stream_destroy_new, AKV_OK);
  assert_int_equal(m.headroom_take, AKV_ERR_NOT_SUPPORTED);
  assert_int_equal(m.headroom_release, AKV_ERR_NOT_SUPPORTED);
  assert_int_equal(m.destroy, AKV_ERR_BUSY);
  assert_int_equal(m.attend_self, AKV_ERR_LEASE_STATE);
  assert_int_equal(m.wait_self, AKV_ERR_LEASE_STATE);
  assert_int_equal(m.write_back_self, AKV_ERR_LEASE_STATE);
  assert_int_equal(m.seal_self, AKV_ERR_LEASE_STATE);
  assert_int_equal(m.retire_self, AKV_ERR_LEASE_STATE);
  assert_int_equal(akv_lease_write_back(ls, NULL, 0, &tail), AKV_OK);
  assert_int_equal(akv_lease_seal(ls, tail, attn), AKV_OK);
  assert_int_equal(akv_lease_retire(ls, NULL), AKV_OK);
  finish_step(f.e, f.s, 1, LAYERS);
  assert_int_equal(akv_context_length(f.c[0], &len), AKV_OK);
  assert_int_equal(len, 4);
  fx_close(&f);
}

/* ------------------------------- the hook completes and retires its lease */

typedef struct completer {
  akv_lease *self;
  akv_fence attn, tail;
  akv_status mark, wb, seal, retire;
} completer;

static int completer_hook(void *user, const akv_view *view, akv_stream stream) {
  completer *c = user;
  (void)view;
  c->mark = akv_lease_mark_consumed(c->self, stream, &c->attn);
  c->wb = akv_lease_write_back(c->self, NULL, 0, &c->tail);
  c->seal = akv_lease_seal(c->self, c->tail, c->attn);
  c->retire = akv_lease_retire(c->self, NULL);
  return 0;
}

/* A hook that runs its lease to the end itself ends it: attend answers
 * AKV_ERR_BAD_HANDLE and leaves *attention alone; the step goes on. */
static void test_hook_retires_its_own_lease(void **state) {
  fx f;
  completer c;
  akv_lease *ls = NULL;
  akv_fence attn = {55};
  akv_engine_info info;
  (void)state;
  fx_open(&f, 1, 2);
  assert_int_equal(akv_step_begin(f.e, f.c, 1), AKV_OK);
  assert_int_equal(akv_lease_begin(f.e, 0, &ls), AKV_OK);
  memset(&c, 0, sizeof c);
  c.self = ls;
  assert_int_equal(akv_lease_attend(ls, f.s, completer_hook, &c, &attn), AKV_ERR_BAD_HANDLE);
  assert_int_equal(c.mark, AKV_OK);
  assert_int_equal(c.wb, AKV_OK);
  assert_int_equal(c.seal, AKV_OK);
  assert_int_equal(c.retire, AKV_OK);
  assert_int_equal(attn.serial, 55);
  assert_int_equal(akv_engine_info_get(f.e, &info), AKV_OK);
  assert_int_equal(info.transport_failed, 0);
  finish_step(f.e, f.s, 1, LAYERS);
  fx_close(&f);
}

/* ------------------- a lease record reused by another engine in the hook */

/* The hook quarantines and destroys its engine (ending its lease), then
 * creates engines until the dead lease's handle record is handed out again,
 * as a live lease of a newer engine. attend must not take the record for
 * its own lease: it answers AKV_ERR_BAD_HANDLE and touches the newer
 * engine not at all (no transport failure there from the hook's nonzero
 * return, no state change of its lease). */
typedef struct reuser {
  fx *f;
  akv_lease *dead;
  int rc;
  akv_engine *other;
  akv_stream other_s;
  akv_context *other_c;
  akv_lease *other_lease;
  uint32_t other_layers;
  int found;
} reuser;

static int reuser_hook(void *user, const akv_view *view, akv_stream stream) {
  reuser *r = user;
  akv_engine *e[4] = {NULL, NULL, NULL, NULL};
  (void)view;
  assert_int_equal(akv_engine_quarantine(r->f->e, NULL), AKV_OK);
  assert_int_equal(akv_stream_destroy(r->f->e, stream), AKV_OK);
  assert_int_equal(akv_engine_destroy(r->f->e), AKV_OK);
  /* Engines of 256 dense layers take 16 x 256 = 4096 lease records each at
   * create: the dead record lies among the second one's. */
  akv_engine_config ec = akvt_small_config(AKV_ROUTE_STAGE, 0);
  ec.n_dense_layers = 256;
  ec.max_contexts = 1;
  r->other_layers = ec.n_dense_layers;
  for (int i = 0; i < 4 && r->other == NULL; i++) {
    assert_int_equal(akv_engine_create(&ec, &e[i]), AKV_OK);
    for (uint32_t k = 0; k < e[i]->n_lease_recs; k++)
      if (e[i]->lease_recs[k] == r->dead) r->other = e[i];
  }
  for (int i = 0; i < 4; i++)
    if (e[i] != NULL && e[i] != r->other) assert_int_equal(akv_engine_destroy(e[i]), AKV_OK);
  assert_non_null(r->other);
  assert_int_equal(akv_stream_create(r->other, &r->other_s), AKV_OK);
  assert_int_equal(akv_context_open(r->other, NULL, &r->other_c), AKV_OK);
  /* Begin leases of the newer engine until one is handed the dead record
   * (that lease stays begun). */
  r->other_lease = steps_until_record(r->other, r->other_s, &r->other_c, 1, r->other_layers, r->dead);
  r->found = r->other_lease != NULL;
  return r->rc;
}

static void hook_lets_another_engine_take_the_record(int rc) {
  fx f;
  reuser r;
  akv_lease *ls = NULL;
  akv_fence attn = {99};
  akv_engine_info info;
  fx_open(&f, 1, 2);
  assert_int_equal(akv_step_begin(f.e, f.c, 1), AKV_OK);
  assert_int_equal(akv_lease_begin(f.e, 0, &ls), AKV_OK);
  memset(&r, 0, sizeof r);
  r.f = &f;
  r.dead = ls;
  r.rc = rc;
  assert_int_equal(akv_lease_attend(ls, f.s, reuser_hook, &r, &attn), AKV_ERR_BAD_HANDLE);
  assert_int_equal(r.found, 1);
  assert_int_equal(attn.serial, 99);
  /* The newer engine is untouched: healthy, its lease still just begun. */
  assert_int_equal(akv_engine_info_get(r.other, &info), AKV_OK);
  assert_int_equal(info.transport_failed, 0);
  assert_int_equal(r.other_lease->body->state, AKV_LEASE_BEGUN);
  {
    const uint32_t layer = r.other_lease->body->layer;
    assert_int_equal(akvt_lease_through(r.other_lease, r.other_s), AKV_OK);
    finish_step(r.other, r.other_s, layer + 1, r.other_layers);
  }
  assert_int_equal(akv_context_close(r.other_c), AKV_OK);
  assert_int_equal(akv_stream_destroy(r.other, r.other_s), AKV_OK);
  assert_int_equal(akv_engine_destroy(r.other), AKV_OK);
}

static void test_hook_record_reused_by_another_engine_fails(void **state) {
  (void)state;
  hook_lets_another_engine_take_the_record(1);
}

static void test_hook_record_reused_by_another_engine_succeeds(void **state) {
  (void)state;
  hook_lets_another_engine_take_the_record(0);
}

/* The same on one engine: the hook retires its own lease, ends the step and
 * runs steps until the dead handle's record is handed to a later begin of
 * this engine (after (AKV_LEASE_HANDLES_PER_LAYER - 1) x layers begins).
 * attend answers AKV_ERR_BAD_HANDLE and leaves that later lease begun. */
typedef struct cycler {
  fx *f;
  akv_lease *self;
  akv_lease *later;
  int rc;
} cycler;

static int cycler_hook(void *user, const akv_view *view, akv_stream stream) {
  cycler *c = user;
  akv_fence a, t;
  (void)view;
  assert_int_equal(akv_lease_mark_consumed(c->self, stream, &a), AKV_OK);
  assert_int_equal(akv_lease_write_back(c->self, NULL, 0, &t), AKV_OK);
  assert_int_equal(akv_lease_seal(c->self, t, a), AKV_OK);
  assert_int_equal(akv_lease_retire(c->self, NULL), AKV_OK);
  finish_step(c->f->e, stream, 1, LAYERS);
  /* The later lease stays begun. */
  c->later = steps_until_record(c->f->e, stream, c->f->c, c->f->n, LAYERS, c->self);
  return c->rc;
}

static void hook_lets_a_later_begin_take_the_record(int rc) {
  fx f;
  cycler c;
  akv_lease *ls = NULL;
  akv_fence attn = {88};
  akv_engine_info info;
  fx_open(&f, 1, 1);
  assert_int_equal(akv_step_begin(f.e, f.c, 1), AKV_OK);
  assert_int_equal(akv_lease_begin(f.e, 0, &ls), AKV_OK);
  memset(&c, 0, sizeof c);
  c.f = &f;
  c.self = ls;
  c.rc = rc;
  assert_int_equal(akv_lease_attend(ls, f.s, cycler_hook, &c, &attn), AKV_ERR_BAD_HANDLE);
  assert_ptr_equal(c.later, ls);
  assert_int_equal(attn.serial, 88);
  assert_int_equal(akv_engine_info_get(f.e, &info), AKV_OK);
  assert_int_equal(info.transport_failed, 0);
  assert_int_equal(c.later->body->state, AKV_LEASE_BEGUN);
  {
    const uint32_t layer = c.later->body->layer;
    assert_int_equal(akvt_lease_through(c.later, f.s), AKV_OK);
    finish_step(f.e, f.s, layer + 1, LAYERS);
  }
  fx_close(&f);
}

static void test_hook_record_reused_by_a_later_begin_fails(void **state) {
  (void)state;
  hook_lets_a_later_begin_take_the_record(1);
}

static void test_hook_record_reused_by_a_later_begin_succeeds(void **state) {
  (void)state;
  hook_lets_a_later_begin_take_the_record(0);
}

/* The hook quarantines and destroys its engine, then calls everything on
 * every handle it just killed (engine, contexts, its lease, the stream):
 * each answers AKV_ERR_BAD_HANDLE (the stream calls, which take the engine
 * first, too) and reads no freed memory. */
typedef struct after_death {
  fx *f;
  akv_lease *self;
  int bad; /* calls that did not answer AKV_ERR_BAD_HANDLE */
} after_death;

static int after_death_hook(void *user, const akv_view *view, akv_stream stream) {
  after_death *d = user;
  fx *f = d->f;
  static uint16_t zero[ROW_ELEMS];
  const void *rows[LAYERS] = {zero, zero, zero};
  akv_engine_info info;
  akv_headroom_info hi;
  akv_view v;
  akv_fence fz = {0};
  akv_lease *ls = NULL;
  akv_context *c = NULL;
  akv_stream s = NULL;
  uint64_t ctr[AKV_ADM_RULE_COUNT];
  size_t n = 0;
  uint32_t u = 0;
  char buf[32];
  uint16_t k[ROW_ELEMS], vv[ROW_ELEMS];
  (void)view;
  assert_int_equal(akv_engine_quarantine(f->e, NULL), AKV_OK);
  assert_int_equal(akv_stream_destroy(f->e, stream), AKV_OK);
  /* after the quarantine, only diagnostics and destroy (which frees the
   * contexts) */
  assert_int_equal(akv_context_close(f->c[0]), AKV_ERR_QUARANTINED);
  assert_int_equal(akv_engine_destroy(f->e), AKV_OK);
  const akv_status got[] = {
      akv_engine_destroy(f->e), akv_engine_quarantine(f->e, NULL),
      akv_engine_info_get(f->e, &info), akv_headroom_get(f->e, &hi),
      akv_headroom_release(f->e, 1, NULL, NULL), akv_headroom_take(f->e, 1, NULL),
      akv_admission_counters(f->e, ctr, AKV_ADM_RULE_COUNT),
      akv_admission_log(f->e, NULL, 0, &n), akv_admission_explain(f->e, NULL, buf, sizeof buf),
      akv_stream_create(f->e, &s), akv_stream_destroy(f->e, stream),
      akv_stream_synchronize(f->e, stream), akv_stream_launch_host(f->e, stream, NULL, NULL),
      akv_context_open(f->e, NULL, &c), akv_context_close(f->c[0]),
      akv_context_append(f->c[0], 1, rows, rows),
      akv_context_append_layer(f->c[0], 0, 1, zero, zero),
      akv_context_read(f->c[0], 0, 0, 1, k, vv), akv_context_length(f->c[0], &u),
      akv_context_id(f->c[0], &u), akv_step_begin(f->e, f->c, f->n), akv_step_end(f->e),
      akv_lease_begin(f->e, 1, &ls), akv_lease_wait_ready(d->self, stream, &v),
      akv_lease_mark_consumed(d->self, stream, &fz),
      akv_lease_attend(d->self, stream, akvt_noop_hook, NULL, &fz),
      akv_lease_write_back(d->self, NULL, 0, &fz), akv_lease_seal(d->self, fz, fz),
      akv_lease_retire(d->self, NULL), akv_lease_try_retire(d->self, NULL)};
  for (size_t i = 0; i < sizeof got / sizeof got[0]; i++) {
    if (got[i] != AKV_ERR_BAD_HANDLE) fprintf(stderr, "call %zu: %d\n", i, (int)got[i]);
    d->bad += got[i] != AKV_ERR_BAD_HANDLE;
  }
  d->bad += strcmp(akv_engine_last_error(f->e), "bad engine handle") != 0;
  d->bad += ls != NULL || c != NULL || s != NULL || fz.serial != 0 || n != 0 || u != 0;
  return 0;
}

static void test_hook_calls_everything_on_the_handles_it_killed(void **state) {
  fx f;
  after_death d;
  akv_lease *ls = NULL;
  akv_fence attn = {66};
  (void)state;
  fx_open(&f, 2, 2);
  assert_int_equal(akv_step_begin(f.e, f.c, 2), AKV_OK);
  assert_int_equal(akv_lease_begin(f.e, 0, &ls), AKV_OK);
  memset(&d, 0, sizeof d);
  d.f = &f;
  d.self = ls;
  assert_int_equal(akv_lease_attend(ls, f.s, after_death_hook, &d, &attn), AKV_ERR_BAD_HANDLE);
  assert_int_equal(d.bad, 0);
  assert_int_equal(attn.serial, 66);
}

/* ---------------------- hooks and log callbacks across two engines */

typedef struct cross {
  fx *a, *b;
  akv_lease *lb;
  akv_status inner_attend, a_close_from_b, b_quarantine;
  akv_fence fb;
} cross;

static int inner_hook(void *user, const akv_view *view, akv_stream stream) {
  cross *x = user;
  (void)view;
  (void)stream;
  /* Engine A's lease is mid-attend: its context is in the step. */
  x->a_close_from_b = akv_context_close(x->a->c[0]);
  return 0;
}

static int outer_hook(void *user, const akv_view *view, akv_stream stream) {
  cross *x = user;
  (void)view;
  (void)stream;
  x->inner_attend = akv_lease_attend(x->lb, x->b->s, inner_hook, x, &x->fb);
  return 0;
}

/* A hook attends another engine's lease, whose hook calls back into the
 * first engine: each engine keeps its own rules. */
static void test_hooks_nested_across_engines(void **state) {
  fx a, b;
  cross x;
  akv_lease *la = NULL;
  akv_fence fa, ta, tb;
  (void)state;
  fx_open(&a, 1, 2);
  fx_open(&b, 1, 2);
  memset(&x, 0, sizeof x);
  x.a = &a;
  x.b = &b;
  assert_int_equal(akv_step_begin(a.e, a.c, 1), AKV_OK);
  assert_int_equal(akv_step_begin(b.e, b.c, 1), AKV_OK);
  assert_int_equal(akv_lease_begin(a.e, 0, &la), AKV_OK);
  assert_int_equal(akv_lease_begin(b.e, 0, &x.lb), AKV_OK);
  assert_int_equal(akv_lease_attend(la, a.s, outer_hook, &x, &fa), AKV_OK);
  assert_int_equal(x.inner_attend, AKV_OK);
  assert_int_equal(x.a_close_from_b, AKV_ERR_IN_USE);
  assert_int_equal(akv_lease_write_back(la, NULL, 0, &ta), AKV_OK);
  assert_int_equal(akv_lease_write_back(x.lb, NULL, 0, &tb), AKV_OK);
  /* Each lease's fences are its own. */
  assert_int_equal(akv_lease_seal(la, tb, x.fb), AKV_ERR_FENCE_MISMATCH);
  assert_int_equal(akv_lease_seal(la, ta, fa), AKV_OK);
  assert_int_equal(akv_lease_seal(x.lb, tb, x.fb), AKV_OK);
  assert_int_equal(akv_lease_retire(la, NULL), AKV_OK);
  assert_int_equal(akv_lease_retire(x.lb, NULL), AKV_OK);
  finish_step(a.e, a.s, 1, LAYERS);
  finish_step(b.e, b.s, 1, LAYERS);
  fx_close(&a);
  fx_close(&b);
}

/* ------------------------------- every lease call in every lease state */

typedef struct lease_snap {
  akv_lease_state state;
  uint32_t n_written, n_tickets, next_layer, leases_live;
  uint64_t fence_attn, fence_tail, copies_h2d, copies_d2h, bytes_d2h;
  akv_stream stream;
  int transport_failed;
} lease_snap;

static lease_snap snap(akv_engine *e, const akv_lease_body *b) {
  lease_snap x;
  memset(&x, 0, sizeof x);
  x.state = b->state;
  x.n_written = b->n_written;
  x.n_tickets = b->n_tickets;
  x.fence_attn = b->fence_attn;
  x.fence_tail = b->fence_tail;
  x.stream = b->stream;
  x.next_layer = e->next_layer;
  x.leases_live = e->leases_live;
  x.copies_h2d = e->copies_h2d;
  x.copies_d2h = e->copies_d2h;
  x.bytes_d2h = e->bytes_d2h;
  x.transport_failed = e->transport_failed;
  return x;
}

/* Every call the lease's state does not allow: the status akv.h gives, and
 * nothing changed (lease, engine counters, outputs). */
static void refused_in_state(fx *f, akv_lease *ls, akv_stream other, akv_fence attn,
                             akv_fence tail, akv_status want_seal) {
  akv_lease_body *b = ls->body;
  const lease_snap before = snap(f->e, b);
  akv_view v;
  akv_fence out = {12345};
  akv_lease *next = NULL;
  akv_receipt rc;
  memset(&v, 0x5a, sizeof v);
  memset(&rc, 0x5a, sizeof rc);
  const akv_view v0 = v;
  const akv_receipt rc0 = rc;
  const akv_lease_state st = b->state;
  if (st != AKV_LEASE_BEGUN) {
    assert_int_equal(akv_lease_wait_ready(ls, f->s, &v), AKV_ERR_LEASE_STATE);
    assert_int_equal(akv_lease_attend(ls, f->s, akvt_noop_hook, NULL, &out), AKV_ERR_LEASE_STATE);
  }
  if (st != AKV_LEASE_READY)
    assert_int_equal(akv_lease_mark_consumed(ls, f->s, &out), AKV_ERR_LEASE_STATE);
  else
    assert_int_equal(akv_lease_mark_consumed(ls, other, &out), AKV_ERR_INVALID_ARGUMENT);
  if (st != AKV_LEASE_CONSUMED) {
    assert_int_equal(akv_lease_write_back(ls, NULL, 0, &out), AKV_ERR_LEASE_STATE);
    assert_int_equal(akv_lease_write_back(ls, f->c, 1, &out), AKV_ERR_LEASE_STATE);
  } else {
    /* c[0] is written already, so is "all of them" no longer. */
    assert_int_equal(akv_lease_write_back(ls, NULL, 0, &out), AKV_ERR_LEASE_STATE);
    assert_int_equal(akv_lease_write_back(ls, f->c, 1, &out), AKV_ERR_LEASE_STATE);
    assert_int_equal(akv_lease_write_back(ls, (akv_context *const[]){f->c[1], f->c[1]}, 2, &out),
                     AKV_ERR_INVALID_ARGUMENT);
  }
  assert_int_equal(akv_lease_seal(ls, tail, attn), want_seal);
  if (st != AKV_LEASE_SEALED) {
    assert_int_equal(akv_lease_retire(ls, &rc), AKV_ERR_LEASE_STATE);
    assert_int_equal(akv_lease_try_retire(ls, &rc), AKV_ERR_LEASE_STATE);
    assert_int_equal(akv_lease_begin(f->e, b->layer + 1, &next), AKV_ERR_LEASE_ORDER);
    assert_null(next);
  }
  assert_int_equal(akv_step_end(f->e), AKV_ERR_STEP_STATE);
  assert_int_equal(akv_stream_destroy(f->e, f->s),
                   st == AKV_LEASE_BEGUN ? AKV_OK : AKV_ERR_IN_USE);
  if (st == AKV_LEASE_BEGUN) assert_int_equal(akv_stream_create(f->e, &f->s), AKV_OK);
  assert_int_equal(out.serial, 12345);
  assert_memory_equal(&v, &v0, sizeof v);
  assert_memory_equal(&rc, &rc0, sizeof rc);
  const lease_snap after = snap(f->e, b);
  if (st == AKV_LEASE_BEGUN) {
    /* the stream was destroyed and made again: compare all but it */
    assert_int_equal(after.state, before.state);
    assert_int_equal(after.n_written, before.n_written);
  } else {
    assert_memory_equal(&after, &before, sizeof after);
  }
}

static void test_every_lease_call_in_every_state(void **state) {
  fx f;
  akv_lease *ls = NULL;
  akv_stream other = NULL;
  akv_fence attn = {0}, tail = {0}, t1;
  akv_view v;
  (void)state;
  fx_open(&f, 2, 3);
  assert_int_equal(akv_stream_create(f.e, &other), AKV_OK);
  assert_int_equal(akv_step_begin(f.e, f.c, 2), AKV_OK);
  assert_int_equal(akv_lease_begin(f.e, 0, &ls), AKV_OK);
  refused_in_state(&f, ls, other, attn, tail, AKV_ERR_LEASE_STATE);
  assert_int_equal(akv_lease_wait_ready(ls, f.s, &v), AKV_OK);
  refused_in_state(&f, ls, other, attn, tail, AKV_ERR_LEASE_STATE);
  assert_int_equal(akv_lease_mark_consumed(ls, f.s, &attn), AKV_OK);
  assert_int_equal(akv_lease_write_back(ls, f.c, 1, &t1), AKV_OK);
  refused_in_state(&f, ls, other, attn, t1, AKV_ERR_LEASE_STATE);
  assert_int_equal(akv_lease_write_back(ls, &f.c[1], 1, &tail), AKV_OK);
  assert_int_equal(akv_lease_seal(ls, t1, attn), AKV_ERR_FENCE_MISMATCH); /* not the current tail */
  assert_int_equal(akv_lease_seal(ls, tail, attn), AKV_OK);
  refused_in_state(&f, ls, other, attn, tail, AKV_ERR_LEASE_STATE);
  assert_int_equal(akv_lease_retire(ls, NULL), AKV_OK);
  {
    akv_fence z = {0};
    assert_int_equal(akv_lease_wait_ready(ls, f.s, &v), AKV_ERR_BAD_HANDLE);
    assert_int_equal(akv_lease_mark_consumed(ls, f.s, &z), AKV_ERR_BAD_HANDLE);
    assert_int_equal(akv_lease_attend(ls, f.s, akvt_noop_hook, NULL, &z), AKV_ERR_BAD_HANDLE);
    assert_int_equal(akv_lease_write_back(ls, NULL, 0, &z), AKV_ERR_BAD_HANDLE);
    assert_int_equal(akv_lease_seal(ls, tail, attn), AKV_ERR_BAD_HANDLE);
    assert_int_equal(akv_lease_retire(ls, NULL), AKV_ERR_BAD_HANDLE);
    assert_int_equal(akv_lease_try_retire(ls, NULL), AKV_ERR_BAD_HANDLE);
    assert_int_equal(z.serial, 0);
  }
  finish_step(f.e, f.s, 1, LAYERS);
  assert_int_equal(akv_stream_destroy(f.e, other), AKV_OK);
  fx_close(&f);
}

/* ---------------------------------------- handles given to another engine */

/* Contexts, leases, streams and fences of engine A given to engine B's calls
 * (and B's to A's lease): each refused with akv.h's status, neither engine
 * changed; both then run their steps as if nothing had been called. */
static void test_handles_of_another_engine(void **state) {
  fx a, b;
  akv_lease *la = NULL, *lb = NULL, *none = NULL;
  akv_fence fa, ta, fb, tb, out = {321};
  akv_view v;
  char buf[64];
  akv_engine_info ia, ib;
  (void)state;
  fx_open(&a, 2, 2);
  fx_open(&b, 2, 2);
  assert_int_equal(akv_step_begin(b.e, a.c, 2), AKV_ERR_BAD_HANDLE);
  assert_int_equal(akv_step_begin(b.e, (akv_context *const[]){b.c[0], a.c[1]}, 2),
                   AKV_ERR_BAD_HANDLE);
  assert_false(b.e->step_open);
  assert_false(a.c[1]->in_step);
  assert_false(b.c[0]->in_step);
  assert_int_equal(akv_admission_explain(b.e, a.c[0], buf, sizeof buf), AKV_ERR_BAD_HANDLE);
  assert_int_equal(akv_stream_destroy(b.e, a.s), AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_stream_synchronize(b.e, a.s), AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_stream_launch_host(b.e, a.s, NULL, NULL), AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_step_begin(a.e, a.c, 2), AKV_OK);
  assert_int_equal(akv_step_begin(b.e, b.c, 2), AKV_OK);
  assert_int_equal(akv_lease_begin(a.e, 0, &la), AKV_OK);
  assert_int_equal(akv_lease_begin(b.e, 0, &lb), AKV_OK);
  /* A's lease with B's stream, B's contexts as owners, B's fences. */
  assert_int_equal(akv_lease_wait_ready(la, b.s, &v), AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_lease_attend(la, b.s, akvt_noop_hook, NULL, &out), AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(la->body->state, AKV_LEASE_BEGUN);
  assert_int_equal(akv_lease_attend(la, a.s, akvt_noop_hook, NULL, &fa), AKV_OK);
  assert_int_equal(akv_lease_attend(lb, b.s, akvt_noop_hook, NULL, &fb), AKV_OK);
  assert_int_equal(akv_lease_mark_consumed(la, b.s, &out), AKV_ERR_LEASE_STATE);
  assert_int_equal(akv_lease_write_back(la, b.c, 2, &out), AKV_ERR_OWNER_MISMATCH);
  assert_int_equal(akv_lease_write_back(la, (akv_context *const[]){a.c[0], b.c[1]}, 2, &out),
                   AKV_ERR_OWNER_MISMATCH);
  assert_int_equal(la->body->n_written, 0);
  assert_int_equal(out.serial, 321);
  assert_int_equal(akv_lease_write_back(la, NULL, 0, &ta), AKV_OK);
  assert_int_equal(akv_lease_write_back(lb, NULL, 0, &tb), AKV_OK);
  assert_int_equal(akv_lease_seal(la, tb, fb), AKV_ERR_FENCE_MISMATCH);
  assert_int_equal(akv_lease_seal(la, ta, fb), AKV_ERR_FENCE_MISMATCH);
  /* B's lease handle does not begin A's next layer, nor is B's step A's. */
  assert_int_equal(akv_lease_begin(a.e, 1, &none), AKV_ERR_LEASE_ORDER);
  assert_int_equal(akv_lease_seal(la, ta, fa), AKV_OK);
  assert_int_equal(akv_lease_seal(lb, tb, fb), AKV_OK);
  assert_int_equal(akv_lease_retire(la, NULL), AKV_OK);
  assert_int_equal(akv_lease_retire(lb, NULL), AKV_OK);
  finish_step(a.e, a.s, 1, LAYERS);
  finish_step(b.e, b.s, 1, LAYERS);
  assert_int_equal(akv_engine_info_get(a.e, &ia), AKV_OK);
  assert_int_equal(akv_engine_info_get(b.e, &ib), AKV_OK);
  assert_int_equal(ia.transport_failed, 0);
  assert_int_equal(ib.transport_failed, 0);
  assert_int_equal(ia.steps, 1);
  assert_int_equal(ib.steps, 1);
  fx_close(&a);
  fx_close(&b);
}

/* ------------------------------------ log callbacks that create engines */

/* A log callback that creates (and destroys) an engine of its own config on
 * every line it gets, and opens a context on a second engine of the same
 * callback that has no host slot left (a refusal, logged). akv_log_fn: nothing
 * at all is logged to the callback from inside it, so it never runs nested
 * in itself (before, each nested create logged its fit line to the callback
 * again, without end but for the depth bound here). */
typedef struct creator {
  akv_engine_config cfg;
  akv_engine *full;  /* every host slot taken */
  uint32_t depth, max_depth, lines;
  akv_status create, destroy, open;
  int armed;
  akv_engine *made; /* the engine a callback created (a field, not a local of
                       the callback: its address is handed to the library) */
} creator;

static void creator_log(void *user, akv_log_level level, const char *message) {
  creator *c = user;
  akv_context *x = NULL;
  (void)level;
  (void)message;
  c->lines++;
  if (!c->armed) return;
  if (++c->depth > c->max_depth) c->max_depth = c->depth;
  if (c->depth < 8) {
    c->made = NULL;
    c->create = akv_engine_create(&c->cfg, &c->made);
    if (c->create == AKV_OK) c->destroy = akv_engine_destroy(c->made);
    c->open = akv_context_open(c->full, NULL, &x);
  }
  c->depth--;
}

static void test_log_callback_creates_engines(void **state) {
  creator c;
  akv_engine *e = NULL;
  akv_context *full[4];
  (void)state;
  memset(&c, 0, sizeof c);
  c.cfg = akvt_small_config(AKV_ROUTE_STAGE, 0);
  c.cfg.log_fn = creator_log;
  c.cfg.log_user = &c;
  c.cfg.log_level = AKV_LOG_DEBUG;
  c.cfg.max_contexts = 1;
  assert_int_equal(akv_engine_create(&c.cfg, &c.full), AKV_OK);
  assert_int_equal(akv_context_open(c.full, NULL, &full[0]), AKV_OK);
  c.armed = 1;
  c.lines = 0;
  assert_int_equal(akv_engine_create(&c.cfg, &e), AKV_OK);
  c.armed = 0;
  assert_true(c.lines > 0);
  assert_int_equal(c.max_depth, 1);
  assert_int_equal(c.create, AKV_OK);
  assert_int_equal(c.destroy, AKV_OK);
  assert_int_equal(c.open, AKV_ERR_REFUSED_QUEUE);
  /* Lines outside any callback reach it as before. */
  c.lines = 0;
  assert_int_equal(akv_step_end(e), AKV_ERR_STEP_STATE);
  assert_true(c.lines > 0);
  assert_int_equal(akv_engine_destroy(e), AKV_OK);
  assert_int_equal(akv_context_close(full[0]), AKV_OK);
  assert_int_equal(akv_engine_destroy(c.full), AKV_OK);
}

/* ------------------------------------------ engines side by side, threads */

typedef struct runner {
  int failures;
  akv_stream dead_stream; /* destroyed by this thread: others must refuse it */
  akv_fence fences[LAYERS];
  akv_stream *peer_dead; /* another thread's destroyed stream, once published */
  pthread_mutex_t *mu;
} runner;

static int count_hook(void *user, const akv_view *view, akv_stream stream) {
  (void)view;
  (void)stream;
  (*(int *)user)++;
  return 0;
}

static void *runner_thread(void *arg) {
  runner *r = arg;
  static const uint16_t zero[8 * ROW_ELEMS];
  const void *rows[LAYERS] = {zero, zero, zero};
  for (int it = 0; it < 6; it++) {
    akv_engine *e = akvt_small_engine(it % 2 ? AKV_ROUTE_ARENA : AKV_ROUTE_PAGED, 1);
    akv_stream s = NULL, s2 = NULL;
    akv_context *c[2] = {NULL, NULL};
    int hooks = 0;
    if (e == NULL) {
      r->failures++;
      continue;
    }
    r->failures += akv_stream_create(e, &s) != AKV_OK;
    r->failures += akv_stream_create(e, &s2) != AKV_OK;
    for (int i = 0; i < 2; i++) {
      r->failures += akv_context_open(e, NULL, &c[i]) != AKV_OK;
      r->failures += akv_context_append(c[i], 8, rows, rows) != AKV_OK;
    }
    for (int step = 0; step < 8; step++) {
      r->failures += akv_step_begin(e, c, 2) != AKV_OK;
      for (uint32_t l = 0; l < LAYERS; l++) {
        akv_lease *ls = NULL;
        akv_fence a, t;
        r->failures += akv_lease_begin(e, l, &ls) != AKV_OK;
        r->failures += akv_lease_attend(ls, step % 2 ? s : s2, count_hook, &hooks, &a) != AKV_OK;
        r->failures += akv_lease_write_back(ls, NULL, 0, &t) != AKV_OK;
        /* The previous step's fences of this layer are stale: never a match. */
        r->failures += akv_lease_seal(ls, r->fences[l], r->fences[l]) != AKV_ERR_FENCE_MISMATCH;
        r->failures += akv_lease_seal(ls, t, a) != AKV_OK;
        r->failures += akv_lease_retire(ls, NULL) != AKV_OK;
        r->fences[l] = a;
      }
      r->failures += akv_step_end(e) != AKV_OK;
    }
    r->failures += hooks != 8 * LAYERS;
    /* A stream another thread destroyed is no stream of this engine. */
    pthread_mutex_lock(r->mu);
    if (*r->peer_dead != NULL) {
      r->failures += akv_stream_synchronize(e, *r->peer_dead) != AKV_ERR_INVALID_ARGUMENT;
      r->failures += akv_stream_destroy(e, *r->peer_dead) != AKV_ERR_INVALID_ARGUMENT;
    }
    pthread_mutex_unlock(r->mu);
    r->failures += akv_stream_destroy(e, s2) != AKV_OK;
    pthread_mutex_lock(r->mu);
    r->dead_stream = s2;
    pthread_mutex_unlock(r->mu);
    for (int i = 0; i < 2; i++) r->failures += akv_context_close(c[i]) != AKV_OK;
    r->failures += akv_stream_destroy(e, s) != AKV_OK;
    r->failures += akv_engine_destroy(e) != AKV_OK;
  }
  return NULL;
}

/* Several threads, each driving its own engine through whole steps (hooks,
 * write-backs, seals, retires), creating and destroying streams and
 * contexts: every call succeeds, a stale fence never seals, and a stream
 * destroyed on one thread is refused by the others' engines. Under
 * -DAKV_SANITIZE=thread it checks the shared pools and counters. */
static void test_threads_engines_side_by_side(void **state) {
  enum { N = 3 };
  pthread_t t[N];
  runner r[N];
  pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
  (void)state;
  memset(r, 0, sizeof r);
  for (int i = 0; i < N; i++) {
    r[i].mu = &mu;
    r[i].peer_dead = &r[(i + 1) % N].dead_stream;
  }
  for (int i = 0; i < N; i++)
    assert_int_equal(pthread_create(&t[i], NULL, runner_thread, &r[i]), 0);
  for (int i = 0; i < N; i++) assert_int_equal(pthread_join(t[i], NULL), 0);
  for (int i = 0; i < N; i++) assert_int_equal(r[i].failures, 0);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_hook_calls_every_mutator_on_its_engine),
      cmocka_unit_test(test_hook_retires_its_own_lease),
      cmocka_unit_test(test_hook_record_reused_by_another_engine_fails),
      cmocka_unit_test(test_hook_record_reused_by_another_engine_succeeds),
      cmocka_unit_test(test_hook_record_reused_by_a_later_begin_fails),
      cmocka_unit_test(test_hook_record_reused_by_a_later_begin_succeeds),
      cmocka_unit_test(test_hook_calls_everything_on_the_handles_it_killed),
      cmocka_unit_test(test_hooks_nested_across_engines),
      cmocka_unit_test(test_every_lease_call_in_every_state),
      cmocka_unit_test(test_handles_of_another_engine),
      cmocka_unit_test(test_log_callback_creates_engines),
      cmocka_unit_test(test_threads_engines_side_by_side),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
