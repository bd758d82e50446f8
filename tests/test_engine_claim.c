/*
 * test_engine_claim.c - the engine's claim (akv.h, Thread safety): while one
 * thread is inside a call on an engine, every call another thread makes on
 * that engine, or on a context, lease or stream of it, returns
 * AKV_ERR_IN_USE at once and changes nothing (no counter, no length, no
 * last error, no log line); the thread inside may call again from its
 * attention hook and its log callback; once its call returned, the other
 * thread's calls succeed.
 *
 * Thread A is parked deterministically inside a call (an attention hook or
 * the log callback that waits on a condition variable); thread B makes its
 * refused calls, then lets A go. Results are recorded by the threads and
 * asserted on the test's own thread (cmocka asserts only there).
 */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <sched.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "akv.h"
#include "testutil.h"

#define LAYERS 3 /* akvt_small_config */
#define ROW_ELEMS 16
#define LEN 5
#define MAX_CALLS 32

/* ------------------------------------------------------------ the rig */

/* What the parked thread saw of its engine (diagnostics, nested calls). */
typedef struct snapshot {
  akv_engine_info info;
  akv_headroom_info hr;
  uint64_t adm[AKV_ADM_RULE_COUNT];
  size_t adm_log;
  uint32_t len[2];
  char last_error[256];
  akv_status st[6];
} snapshot;

typedef enum park_at { PARK_HOOK, PARK_LOG } park_at;

typedef enum kind {
  KIND_ENGINE,
  KIND_CONTEXT,
  KIND_LEASE,
  KIND_STREAM,
  KIND_DIAGNOSTICS,
  KIND_DESTROY,
  KIND_QUARANTINE
} kind;

typedef struct rig {
  park_at at;
  kind kind;
  akv_engine *e;
  akv_stream s;
  akv_context *c[2];
  akv_lease *ls;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int parked, released, done;
  atomic_int armed;       /* the log callback parks on its next line */
  atomic_ulong lines;     /* log lines, every thread */
  /* thread A */
  akv_status a_status;    /* its parking call */
  akv_fence attn;         /* attend's attention fence (PARK_HOOK) */
  snapshot before, after; /* inside the call, before B and after B */
  akv_status nested[4];   /* calls the parked thread made afterwards */
  uint32_t nested_len;
  /* thread B */
  akv_status refused[MAX_CALLS];
  size_t n_refused;
  unsigned long lines_before, lines_after;
  int outputs_untouched;
  const char *other_last_error;
  akv_status later[16];   /* after A returned */
  size_t n_later;
} rig;

typedef struct role {
  rig *r;
  int id; /* 0: A, 1: B */
} role;

static rig *the_rig; /* the log callback's */

static void count_log(void *user, akv_log_level level, const char *message);

static void wait_flag(rig *r, const int *flag) {
  pthread_mutex_lock(&r->mu);
  while (!*flag) pthread_cond_wait(&r->cv, &r->mu);
  pthread_mutex_unlock(&r->mu);
}

static void set_flag(rig *r, int *flag) {
  pthread_mutex_lock(&r->mu);
  *flag = 1;
  pthread_cond_broadcast(&r->cv);
  pthread_mutex_unlock(&r->mu);
}

/* Diagnostics, called by the parked thread from inside its call. */
static void snap(rig *r, snapshot *s) {
  size_t n = 0;
  memset(s, 0, sizeof(*s));
  s->st[0] = akv_engine_info_get(r->e, &s->info);
  s->st[1] = akv_headroom_get(r->e, &s->hr);
  s->st[2] = akv_admission_counters(r->e, s->adm, AKV_ADM_RULE_COUNT);
  s->st[3] = akv_admission_log(r->e, NULL, 0, &n);
  s->adm_log = n;
  s->st[4] = akv_context_length(r->c[0], &s->len[0]);
  s->st[5] = akv_context_length(r->c[1], &s->len[1]);
  snprintf(s->last_error, sizeof(s->last_error), "%s", akv_engine_last_error(r->e));
}

/* Parks the calling thread (A) inside its call until B lets it go. */
static void park(rig *r) {
  snap(r, &r->before);
  set_flag(r, &r->parked);
  wait_flag(r, &r->released);
  snap(r, &r->after);
}

static int park_hook(void *user, const akv_view *view, akv_stream stream) {
  rig *r = user;
  static uint16_t row[ROW_ELEMS];
  akv_fence f = {0};
  (void)view;
  (void)stream;
  park(r);
  /* Same-thread nesting from the hook: a change of the engine (an append
   * to the context outside the step) and a state check of its own lease. */
  r->nested[0] = akv_context_append_layer(r->c[1], 0, 1, row, row);
  r->nested[1] = akv_context_length(r->c[1], &r->nested_len);
  r->nested[2] = akv_lease_seal(r->ls, f, f); /* not consumed yet */
  r->nested[3] = akv_context_append_layer(r->c[1], 0, 1, NULL, NULL); /* invalid */
  return 0;
}

static void count_log(void *user, akv_log_level level, const char *message) {
  rig *r = the_rig;
  (void)user;
  (void)level;
  (void)message;
  atomic_fetch_add(&r->lines, 1);
  if (atomic_exchange(&r->armed, 0)) {
    uint32_t u = 0;
    park(r);
    /* Same-thread nesting from the log callback: diagnostics answer, a
     * change is refused by the log rule (akv_log_fn), not by the claim. */
    r->nested[0] = akv_context_id(r->c[1], &u);
    r->nested[1] = akv_context_length(r->c[1], &r->nested_len);
    r->nested[2] = akv_context_close(r->c[1]);
    r->nested[3] = akv_engine_info_get(r->e, &(akv_engine_info){0});
  }
}

static void rig_open(rig *r, park_at at, kind k) {
  static uint16_t zero[LEN * ROW_ELEMS];
  const void *rows[LAYERS] = {zero, zero, zero};
  akv_engine_config ec = akvt_small_config(AKV_ROUTE_ARENA, 1);
  memset(r, 0, sizeof(*r));
  the_rig = r;
  r->at = at;
  r->kind = k;
  pthread_mutex_init(&r->mu, NULL);
  pthread_cond_init(&r->cv, NULL);
  ec.log_fn = count_log;
  ec.log_level = AKV_LOG_DEBUG; /* every refusal the engine records logs a line */
  assert_int_equal(akv_engine_create(&ec, &r->e), AKV_OK);
  assert_int_equal(akv_stream_create(r->e, &r->s), AKV_OK);
  for (int i = 0; i < 2; i++) {
    assert_int_equal(akv_context_open(r->e, NULL, &r->c[i]), AKV_OK);
    assert_int_equal(akv_context_append(r->c[i], LEN, rows, rows), AKV_OK);
  }
  /* A step over c[0] with the lease of layer 0 begun: c[1] stays outside. */
  assert_int_equal(akv_step_begin(r->e, r->c, 1), AKV_OK);
  assert_int_equal(akv_lease_begin(r->e, 0, &r->ls), AKV_OK);
}

static void rig_close(rig *r) {
  if (r->kind != KIND_DESTROY && r->kind != KIND_QUARANTINE) {
    assert_int_equal(akv_stream_destroy(r->e, r->s), AKV_OK);
    assert_int_equal(akv_engine_destroy(r->e), AKV_OK);
  }
  assert_int_equal(akv_engine_destroy(r->e), AKV_ERR_BAD_HANDLE);
  pthread_mutex_destroy(&r->mu);
  pthread_cond_destroy(&r->cv);
  the_rig = NULL;
}

static void host_fn(void *arg) { (void)arg; }

/* B's calls of one kind while A is parked; each must be refused. */
static void refused_calls(rig *r) {
  static uint16_t row[LEN * ROW_ELEMS];
  const void *rows[LAYERS] = {row, row, row};
  akv_engine *e = r->e;
  akv_context *c0 = r->c[0], *c1 = r->c[1];
  akv_context *sentinel_c = (akv_context *)(uintptr_t)0x1234;
  akv_lease *sentinel_l = (akv_lease *)(uintptr_t)0x5678;
  akv_stream sentinel_s = (akv_stream)(uintptr_t)0x9abc;
  akv_context *co = sentinel_c;
  akv_lease *lo = sentinel_l;
  akv_stream so = sentinel_s;
  akv_fence fence = {4242}, fz = {0};
  akv_view view;
  akv_receipt receipt;
  akv_quarantine_report rep;
  akv_engine_info info;
  akv_headroom_info hr;
  uint64_t adm[AKV_ADM_RULE_COUNT], fr = 4242, pend = 4242, taken = 4242;
  size_t n_log = 4242;
  uint32_t u = 4242, v = 4242;
  char buf[64] = "untouched";
  uint16_t k_out[ROW_ELEMS] = {0x77}, v_out[ROW_ELEMS] = {0x77};
  size_t n = 0;
  int untouched = 1;
  memset(&view, 0xab, sizeof view);
  memset(&receipt, 0xab, sizeof receipt);
  memset(&rep, 0xab, sizeof rep);
  memset(&info, 0xab, sizeof info);
  memset(&hr, 0xab, sizeof hr);
  memset(adm, 0xab, sizeof adm);
#define REFUSED(call) r->refused[n++] = (call)
  switch (r->kind) {
    case KIND_ENGINE:
      REFUSED(akv_context_open(e, NULL, &co));
      REFUSED(akv_step_begin(e, &c1, 1));
      REFUSED(akv_step_end(e));
      REFUSED(akv_lease_begin(e, 1, &lo));
      REFUSED(akv_headroom_release(e, UINT64_MAX, &fr, &pend));
      REFUSED(akv_headroom_take(e, UINT64_MAX, &taken));
      untouched = co == sentinel_c && lo == sentinel_l && fr == 4242 && pend == 4242 &&
                  taken == 4242;
      break;
    case KIND_CONTEXT:
      REFUSED(akv_context_close(c1));
      REFUSED(akv_context_append(c1, 1, rows, rows));
      REFUSED(akv_context_append_layer(c1, 0, 1, row, row));
      REFUSED(akv_context_read(c1, 0, 0, 1, k_out, v_out));
      REFUSED(akv_context_length(c0, &u));
      REFUSED(akv_context_id(c1, &v));
      REFUSED(akv_context_close(c0));
      untouched = u == 4242 && v == 4242 && k_out[0] == 0x77 && v_out[0] == 0x77;
      break;
    case KIND_LEASE:
      REFUSED(akv_lease_wait_ready(r->ls, r->s, &view));
      REFUSED(akv_lease_mark_consumed(r->ls, r->s, &fence));
      REFUSED(akv_lease_attend(r->ls, r->s, akvt_noop_hook, NULL, &fence));
      REFUSED(akv_lease_write_back(r->ls, NULL, 0, &fence));
      REFUSED(akv_lease_seal(r->ls, fz, fz));
      REFUSED(akv_lease_retire(r->ls, &receipt));
      REFUSED(akv_lease_try_retire(r->ls, &receipt));
      {
        akv_view v0;
        akv_receipt r0;
        memset(&v0, 0xab, sizeof v0);
        memset(&r0, 0xab, sizeof r0);
        untouched = fence.serial == 4242 && memcmp(&v0, &view, sizeof v0) == 0 &&
                    memcmp(&r0, &receipt, sizeof r0) == 0;
      }
      break;
    case KIND_STREAM:
      REFUSED(akv_stream_create(e, &so));
      REFUSED(akv_stream_synchronize(e, r->s));
      REFUSED(akv_stream_launch_host(e, r->s, host_fn, NULL));
      REFUSED(akv_stream_destroy(e, r->s));
      untouched = so == sentinel_s;
      break;
    case KIND_DIAGNOSTICS:
      REFUSED(akv_engine_info_get(e, &info));
      REFUSED(akv_headroom_get(e, &hr));
      REFUSED(akv_admission_counters(e, adm, AKV_ADM_RULE_COUNT));
      REFUSED(akv_admission_log(e, NULL, 0, &n_log));
      REFUSED(akv_admission_explain(e, NULL, buf, sizeof buf));
      REFUSED(akv_admission_explain(e, c0, buf, sizeof buf));
      {
        uint64_t a0[AKV_ADM_RULE_COUNT];
        akv_engine_info i0;
        akv_headroom_info h0;
        memset(a0, 0xab, sizeof a0);
        memset(&i0, 0xab, sizeof i0);
        memset(&h0, 0xab, sizeof h0);
        untouched = n_log == 4242 && strcmp(buf, "untouched") == 0 &&
                    memcmp(a0, adm, sizeof a0) == 0 && memcmp(&i0, &info, sizeof i0) == 0 &&
                    memcmp(&h0, &hr, sizeof h0) == 0;
      }
      break;
    case KIND_DESTROY:
      REFUSED(akv_engine_destroy(e));
      break;
    case KIND_QUARANTINE:
      REFUSED(akv_engine_quarantine(e, &rep));
      {
        akv_quarantine_report q0;
        memset(&q0, 0xab, sizeof q0);
        untouched = memcmp(&q0, &rep, sizeof q0) == 0;
      }
      break;
  }
#undef REFUSED
  /* Every kind: the last error is the parked call's to write; another
   * thread reads a static string instead. */
  r->other_last_error = akv_engine_last_error(e);
  r->n_refused = n;
  r->outputs_untouched = untouched;
}

/* B's calls once A's call returned: the step A's lease belongs to is
 * finished from B's thread (an engine may move between threads), then
 * calls of the kind B was refused go through. */
static void later_calls(rig *r) {
  static uint16_t row[ROW_ELEMS];
  size_t n = 0;
  akv_engine *e = r->e;
#define LATER(call) r->later[n++] = (call)
  if (r->at == PARK_LOG) {
    LATER(akvt_lease_through(r->ls, r->s));
  } else {
    akv_fence tail = {0};
    LATER(akv_lease_write_back(r->ls, NULL, 0, &tail));
    LATER(akv_lease_seal(r->ls, tail, r->attn));
    LATER(akv_lease_retire(r->ls, NULL));
    /* the hook appended one row to layer 0 of c[1]: even it out */
    LATER(akv_context_append_layer(r->c[1], 1, 1, row, row));
    LATER(akv_context_append_layer(r->c[1], 2, 1, row, row));
  }
  LATER(akvt_null_layers_from(e, r->s, 1, LAYERS));
  switch (r->kind) {
    case KIND_ENGINE: {
      akv_context *c = NULL;
      LATER(akv_context_open(e, NULL, &c));
      LATER(akv_context_close(c));
      LATER(akv_step_begin(e, &r->c[1], 1));
      LATER(akvt_null_layers(e, r->s, LAYERS));
      break;
    }
    case KIND_CONTEXT: {
      uint32_t u = 0;
      uint16_t k[ROW_ELEMS], v[ROW_ELEMS];
      LATER(akv_context_read(r->c[1], 0, 0, 1, k, v));
      LATER(akv_context_length(r->c[1], &u));
      LATER(akv_context_id(r->c[1], &u));
      LATER(akv_context_close(r->c[1]));
      break;
    }
    case KIND_LEASE:
      LATER(akv_step_begin(e, r->c, 2));
      LATER(akvt_null_layers(e, r->s, LAYERS));
      break;
    case KIND_STREAM: {
      akv_stream s2 = NULL;
      LATER(akv_stream_create(e, &s2));
      LATER(akv_stream_launch_host(e, s2, host_fn, NULL));
      LATER(akv_stream_synchronize(e, s2));
      LATER(akv_stream_destroy(e, s2));
      break;
    }
    case KIND_DIAGNOSTICS: {
      akv_engine_info info;
      akv_headroom_info hr;
      uint64_t adm[AKV_ADM_RULE_COUNT];
      size_t nl = 0;
      char buf[64];
      LATER(akv_engine_info_get(e, &info));
      LATER(akv_headroom_get(e, &hr));
      LATER(akv_admission_counters(e, adm, AKV_ADM_RULE_COUNT));
      LATER(akv_admission_log(e, NULL, 0, &nl));
      LATER(akv_admission_explain(e, r->c[0], buf, sizeof buf));
      break;
    }
    case KIND_DESTROY:
      LATER(akv_stream_destroy(e, r->s));
      LATER(akv_engine_destroy(e));
      break;
    case KIND_QUARANTINE:
      LATER(akv_engine_quarantine(e, NULL));
      LATER(akv_stream_destroy(e, r->s));
      LATER(akv_engine_destroy(e));
      break;
  }
#undef LATER
  r->n_later = n;
}

static void *run_role(void *arg) {
  role *me = arg;
  rig *r = me->r;
  if (me->id == 0) {
    if (r->at == PARK_HOOK) {
      r->a_status = akv_lease_attend(r->ls, r->s, park_hook, r, &r->attn);
    } else {
      atomic_store(&r->armed, 1);
      /* a refusal that logs (last error set, then the line) */
      r->a_status = akv_context_append_layer(r->c[1], 0, 1, NULL, NULL);
    }
    set_flag(r, &r->done);
  } else {
    wait_flag(r, &r->parked);
    r->lines_before = atomic_load(&r->lines);
    refused_calls(r);
    r->lines_after = atomic_load(&r->lines);
    set_flag(r, &r->released);
    wait_flag(r, &r->done);
    later_calls(r);
  }
  return NULL;
}

static void assert_same(const snapshot *a, const snapshot *b) {
  for (int i = 0; i < 6; i++) assert_int_equal(a->st[i], AKV_OK);
  for (int i = 0; i < 6; i++) assert_int_equal(b->st[i], AKV_OK);
  assert_memory_equal(&a->info, &b->info, sizeof a->info);
  assert_memory_equal(&a->hr, &b->hr, sizeof a->hr);
  assert_memory_equal(a->adm, b->adm, sizeof a->adm);
  assert_int_equal(a->adm_log, b->adm_log);
  assert_int_equal(a->len[0], b->len[0]);
  assert_int_equal(a->len[1], b->len[1]);
  assert_string_equal(a->last_error, b->last_error);
}

static void run_parked(park_at at, kind k) {
  rig r;
  role roles[2] = {{&r, 0}, {&r, 1}};
  rig_open(&r, at, k);
  assert_int_equal(akvt_run_threads(run_role, roles, sizeof roles[0], 2), 0);
  /* B: every call refused at once, with nothing written or logged */
  assert_true(r.n_refused > 0);
  for (size_t i = 0; i < r.n_refused; i++) {
    if (r.refused[i] != AKV_ERR_IN_USE) fprintf(stderr, "refused call %zu: %d\n", i, r.refused[i]);
    assert_int_equal(r.refused[i], AKV_ERR_IN_USE);
  }
  assert_true(r.outputs_untouched);
  assert_int_equal(r.lines_before, r.lines_after);
  assert_string_equal(r.other_last_error, "engine in use by another thread");
  /* A: the engine as it saw it before and after B's calls is the same */
  assert_same(&r.before, &r.after);
  if (at == PARK_LOG) {
    assert_string_not_equal(r.before.last_error, "");
    assert_int_equal(r.a_status, AKV_ERR_INVALID_ARGUMENT);
    assert_int_equal(r.nested[0], AKV_OK);
    assert_int_equal(r.nested[1], AKV_OK);
    assert_int_equal(r.nested_len, LEN);
    assert_int_equal(r.nested[2], AKV_ERR_IN_USE); /* the log rule */
    assert_int_equal(r.nested[3], AKV_OK);
  } else {
    assert_int_equal(r.a_status, AKV_OK);
    assert_int_equal(r.nested[0], AKV_OK); /* a change, from the hook */
    assert_int_equal(r.nested[1], AKV_OK);
    assert_int_equal(r.nested_len, LEN); /* one layer more is not a longer context */
    assert_int_equal(r.nested[2], AKV_ERR_LEASE_STATE);
    assert_int_equal(r.nested[3], AKV_ERR_INVALID_ARGUMENT);
  }
  /* After A returned: B's calls went through. */
  assert_true(r.n_later > 0);
  for (size_t i = 0; i < r.n_later; i++) {
    if (r.later[i] != AKV_OK)
      for (size_t j = 0; j < r.n_later; j++) fprintf(stderr, "later call %zu: %d\n", j, r.later[j]);
    assert_int_equal(r.later[i], AKV_OK);
  }
  if (k != KIND_DESTROY && k != KIND_QUARANTINE) {
    akv_engine_info info;
    uint32_t u = 0;
    assert_int_equal(akv_engine_info_get(r.e, &info), AKV_OK);
    assert_int_equal(info.transport_failed, 0);
    assert_int_equal(info.steps, k == KIND_ENGINE || k == KIND_LEASE ? 2 : 1);
    assert_int_equal(akv_context_length(r.c[0], &u), AKV_OK);
    assert_int_equal(u, LEN + (k == KIND_LEASE ? 2 : 1));
  }
  rig_close(&r);
}

#define PARKED_TESTS(name, k)                                          \
  static void test_##name##_refused_while_parked_in_hook(void **state) { \
    (void)state;                                                       \
    run_parked(PARK_HOOK, k);                                          \
  }                                                                    \
  static void test_##name##_refused_while_parked_in_log(void **state) {  \
    (void)state;                                                       \
    run_parked(PARK_LOG, k);                                           \
  }
PARKED_TESTS(engine, KIND_ENGINE)
PARKED_TESTS(context, KIND_CONTEXT)
PARKED_TESTS(lease, KIND_LEASE)
PARKED_TESTS(stream, KIND_STREAM)
PARKED_TESTS(diagnostics, KIND_DIAGNOSTICS)
PARKED_TESTS(destroy, KIND_DESTROY)
PARKED_TESTS(quarantine, KIND_QUARANTINE)

/* ----------------------------------------- the caller's code on a worker */

/* A function from akv_stream_launch_host runs on the stream's worker
 * thread: called there while the thread that enqueued it is inside a call
 * (here akv_stream_synchronize, waiting for that very function, from an
 * attention hook), its calls on the engine are refused at once, never wait
 * for the claim: no deadlock. */
typedef struct worker_rec {
  akv_engine *e;
  akv_context *c;
  akv_stream s;
  akv_status in_fn[2];
  akv_status launch, sync;
  atomic_int go; /* fn calls the engine once this is set */
  atomic_int ran;
} worker_rec;

static void worker_fn(void *arg) {
  worker_rec *w = arg;
  akv_engine_info info;
  uint32_t u = 0;
  while (!atomic_load(&w->go)) sched_yield();
  w->in_fn[0] = akv_engine_info_get(w->e, &info);
  w->in_fn[1] = akv_context_length(w->c, &u);
  atomic_store(&w->ran, 1);
}

static int launching_hook(void *user, const akv_view *view, akv_stream stream) {
  worker_rec *w = user;
  (void)view;
  (void)stream;
  w->launch = akv_stream_launch_host(w->e, w->s, worker_fn, w);
  w->sync = akv_stream_synchronize(w->e, w->s);
  return 0;
}

static void test_worker_function_refused_inside_a_call(void **state) {
  akvt_fx f;
  worker_rec w;
  akv_lease *ls = NULL;
  akv_fence attn = {0}, tail = {0};
  (void)state;
  akvt_fx_open(&f, AKV_ROUTE_ARENA, 1, 2, LEN);
  memset(&w, 0, sizeof w);
  atomic_init(&w.ran, 0);
  atomic_init(&w.go, 1);
  w.e = f.e;
  w.c = f.c[1];
  w.s = f.s;
  assert_int_equal(akv_step_begin(f.e, f.c, 1), AKV_OK);
  assert_int_equal(akv_lease_begin(f.e, 0, &ls), AKV_OK);
  assert_int_equal(akv_lease_attend(ls, f.s, launching_hook, &w, &attn), AKV_OK);
  assert_int_equal(w.launch, AKV_OK);
  assert_int_equal(w.sync, AKV_OK);
  assert_true(atomic_load(&w.ran));
  assert_int_equal(w.in_fn[0], AKV_ERR_IN_USE);
  assert_int_equal(w.in_fn[1], AKV_ERR_IN_USE);
  /* Outside any call, the worker's calls go through. */
  memset(w.in_fn, 0xff, sizeof w.in_fn);
  atomic_store(&w.ran, 0);
  atomic_store(&w.go, 0); /* fn may start before launch_host returned */
  assert_int_equal(akv_stream_launch_host(f.e, f.s, worker_fn, &w), AKV_OK);
  atomic_store(&w.go, 1);
  while (!atomic_load(&w.ran)) sched_yield(); /* no call in progress meanwhile */
  assert_int_equal(akv_stream_synchronize(f.e, f.s), AKV_OK);
  assert_int_equal(w.in_fn[0], AKV_OK);
  assert_int_equal(w.in_fn[1], AKV_OK);
  assert_int_equal(akv_lease_write_back(ls, NULL, 0, &tail), AKV_OK);
  assert_int_equal(akv_lease_seal(ls, tail, attn), AKV_OK);
  assert_int_equal(akv_lease_retire(ls, NULL), AKV_OK);
  assert_int_equal(akvt_null_layers_from(f.e, f.s, 1, LAYERS), AKV_OK);
  assert_int_equal(akv_stream_destroy(f.e, f.s), AKV_OK);
  assert_int_equal(akv_engine_destroy(f.e), AKV_OK);
}

/* ------------------------------------------------ two threads, no parking */

/* Thread 0 runs steps, retrying each call the other thread's claim refused;
 * thread 1 reads diagnostics and tries changes as fast as it can. Every call
 * either goes through or is refused with AKV_ERR_IN_USE, and what the
 * steps did is exact at the end (TSan: no race). */
#define HAMMER_STEPS 40

typedef struct hammer {
  akv_engine *e;
  akv_stream s;
  akv_context *c[2];
  atomic_int stop;
  struct {
    int id;
    struct hammer *h;
    uint64_t ok, in_use, other;
  } t[2];
} hammer;

#define RETRY(st, call)                                        \
  do {                                                         \
    while (((st) = (call)) == AKV_ERR_IN_USE) sched_yield();   \
  } while (0)

static akv_status hammer_step(hammer *h) {
  akv_status st;
  RETRY(st, akv_step_begin(h->e, h->c, 1));
  if (st != AKV_OK) return st;
  for (uint32_t l = 0; l < LAYERS; l++) {
    akv_lease *ls = NULL;
    akv_fence attn = {0}, tail = {0};
    RETRY(st, akv_lease_begin(h->e, l, &ls));
    if (st != AKV_OK) return st;
    RETRY(st, akv_lease_attend(ls, h->s, akvt_noop_hook, NULL, &attn));
    if (st != AKV_OK) return st;
    RETRY(st, akv_lease_write_back(ls, NULL, 0, &tail));
    if (st != AKV_OK) return st;
    RETRY(st, akv_lease_seal(ls, tail, attn));
    if (st != AKV_OK) return st;
    RETRY(st, akv_lease_retire(ls, NULL));
    if (st != AKV_OK) return st;
  }
  RETRY(st, akv_step_end(h->e));
  return st;
}

static void *hammer_role(void *arg) {
  __typeof__(((hammer *)0)->t[0]) *me = arg;
  hammer *h = me->h;
  if (me->id == 0) {
    for (int i = 0; i < HAMMER_STEPS; i++)
      if (hammer_step(h) != AKV_OK) me->other++;
      else me->ok++;
    atomic_store(&h->stop, 1);
    return NULL;
  }
  static uint16_t row[ROW_ELEMS];
  while (!atomic_load(&h->stop)) {
    akv_engine_info info;
    uint32_t u;
    uint64_t adm[AKV_ADM_RULE_COUNT];
    akv_status st[4];
    st[0] = akv_engine_info_get(h->e, &info);
    st[1] = akv_context_length(h->c[0], &u);
    st[2] = akv_admission_counters(h->e, adm, AKV_ADM_RULE_COUNT);
    /* c[1] is never in a step: an append there goes through or is refused */
    st[3] = akv_context_append_layer(h->c[1], 0, 0, row, row);
    for (int i = 0; i < 4; i++) {
      if (st[i] == AKV_OK) me->ok++;
      else if (st[i] == AKV_ERR_IN_USE) me->in_use++;
      else me->other++;
    }
  }
  return NULL;
}

static void test_two_threads_race_on_one_engine(void **state) {
  akvt_fx f;
  hammer h;
  akv_engine_info info;
  uint32_t u = 0;
  (void)state;
  akvt_fx_open(&f, AKV_ROUTE_ARENA, 1, 2, LEN);
  memset(&h, 0, sizeof h);
  h.e = f.e;
  h.s = f.s;
  h.c[0] = f.c[0];
  h.c[1] = f.c[1];
  for (int i = 0; i < 2; i++) {
    h.t[i].id = i;
    h.t[i].h = &h;
  }
  assert_int_equal(akvt_run_threads(hammer_role, h.t, sizeof h.t[0], 2), 0);
  assert_int_equal(h.t[0].ok, HAMMER_STEPS);
  assert_int_equal(h.t[0].other, 0);
  assert_int_equal(h.t[1].other, 0);
  assert_true(h.t[1].ok + h.t[1].in_use > 0);
  assert_int_equal(akv_engine_info_get(f.e, &info), AKV_OK);
  assert_int_equal(info.steps, HAMMER_STEPS);
  assert_int_equal(info.leases_retired, (uint64_t)HAMMER_STEPS * LAYERS);
  assert_int_equal(info.transport_failed, 0);
  assert_int_equal(akv_context_length(f.c[0], &u), AKV_OK);
  assert_int_equal(u, LEN + HAMMER_STEPS);
  assert_int_equal(akv_context_length(f.c[1], &u), AKV_OK);
  assert_int_equal(u, LEN);
  assert_int_equal(akv_stream_destroy(f.e, f.s), AKV_OK);
  assert_int_equal(akv_engine_destroy(f.e), AKV_OK);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_engine_refused_while_parked_in_hook),
      cmocka_unit_test(test_engine_refused_while_parked_in_log),
      cmocka_unit_test(test_context_refused_while_parked_in_hook),
      cmocka_unit_test(test_context_refused_while_parked_in_log),
      cmocka_unit_test(test_lease_refused_while_parked_in_hook),
      cmocka_unit_test(test_lease_refused_while_parked_in_log),
      cmocka_unit_test(test_stream_refused_while_parked_in_hook),
      cmocka_unit_test(test_stream_refused_while_parked_in_log),
      cmocka_unit_test(test_diagnostics_refused_while_parked_in_hook),
      cmocka_unit_test(test_diagnostics_refused_while_parked_in_log),
      cmocka_unit_test(test_destroy_refused_while_parked_in_hook),
      cmocka_unit_test(test_destroy_refused_while_parked_in_log),
      cmocka_unit_test(test_quarantine_refused_while_parked_in_hook),
      cmocka_unit_test(test_quarantine_refused_while_parked_in_log),
      cmocka_unit_test(test_worker_function_refused_inside_a_call),
      cmocka_unit_test(test_two_threads_race_on_one_engine),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
