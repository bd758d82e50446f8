/*
 * test_audit_s32.c - an audit of akv.h's promises under hostile call
 * sequences: a stream function that detaches its worker thread,
 * diagnostics (engine and group) that refused without a last error, and a
 * context of another engine read unclaimed while its engine's thread
 * reopens it (fails under TSan). Each test names the promise it checks and
 * fails while the library breaks it.
 *
 * This binary is linked with -Wl,--wrap=pthread_join and
 * -Wl,--wrap=pthread_create (tests/CMakeLists.txt): every pthread_join of
 * the library's objects comes through __wrap_pthread_join below, which
 * refuses (and counts) a join of a thread a stream function detached,
 * instead of running it (undefined behaviour), and counts the joins it
 * runs; every thread the library creates first takes its own id off the
 * detached list (a new thread may reuse a detached one's id).
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <errno.h>
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
#include <unistd.h>

#include <cmocka.h>

#include "akv.h"
#include "akv_group.h"
#include "testutil.h"

/* ------------------------------------------------- joins of detached threads */

#define MAX_DETACHED 16
static pthread_mutex_t detached_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_t detached[MAX_DETACHED];
static size_t n_detached;
static _Atomic int joins_of_detached;
static _Atomic int joins_run;

int __real_pthread_join(pthread_t thread, void **ret);
int __wrap_pthread_join(pthread_t thread, void **ret);
int __real_pthread_create(pthread_t *t, const pthread_attr_t *attr, void *(*fn)(void *),
                          void *arg);
int __wrap_pthread_create(pthread_t *t, const pthread_attr_t *attr, void *(*fn)(void *),
                          void *arg);

/* Takes the calling thread's id off the detached list: it is a new thread,
 * whatever an ended one with the same id did. */
static void undetach_self(void) {
  pthread_mutex_lock(&detached_mu);
  for (size_t i = 0; i < n_detached; i++)
    if (pthread_equal(detached[i], pthread_self())) detached[i--] = detached[--n_detached];
  pthread_mutex_unlock(&detached_mu);
}

typedef struct start {
  void *(*fn)(void *);
  void *arg;
} start;

static void *start_tramp(void *p) {
  start st = *(start *)p;
  free(p);
  undetach_self(); /* before anything can detach this thread */
  return st.fn(st.arg);
}

int __wrap_pthread_create(pthread_t *t, const pthread_attr_t *attr, void *(*fn)(void *),
                          void *arg) {
  start *st = malloc(sizeof *st);
  if (st == NULL) return EAGAIN;
  st->fn = fn;
  st->arg = arg;
  const int rc = __real_pthread_create(t, attr, start_tramp, st);
  if (rc != 0) free(st);
  return rc;
}

int __wrap_pthread_join(pthread_t thread, void **ret) {
  int hit = 0;
  pthread_mutex_lock(&detached_mu);
  for (size_t i = 0; i < n_detached && !hit; i++) hit = pthread_equal(detached[i], thread);
  pthread_mutex_unlock(&detached_mu);
  if (hit) {
    atomic_fetch_add(&joins_of_detached, 1);
    return EINVAL; /* what glibc answers while the thread lives; never run */
  }
  atomic_fetch_add(&joins_run, 1);
  return __real_pthread_join(thread, ret);
}

/* Forgets the detached threads: their ids may name later threads. */
static void detached_reset(void) {
  pthread_mutex_lock(&detached_mu);
  n_detached = 0;
  pthread_mutex_unlock(&detached_mu);
  atomic_store(&joins_of_detached, 0);
  atomic_store(&joins_run, 0);
}

static _Atomic int ran_after;

static void count_fn(void *arg) {
  (void)arg;
  atomic_fetch_add(&ran_after, 1);
}

/* Detaches the worker it runs on (whatever pthread_detach answers, the
 * thread is detached afterwards) and records it. */
static void detach_fn(void *arg) {
  (void)arg;
  (void)pthread_detach(pthread_self());
  pthread_mutex_lock(&detached_mu);
  if (n_detached < MAX_DETACHED) detached[n_detached++] = pthread_self();
  pthread_mutex_unlock(&detached_mu);
}

/* Ends its worker's thread without detaching it. */
static void exit_fn(void *arg) {
  (void)arg;
  pthread_exit(NULL);
}

/* Detaches its worker, then ends it. */
static void detach_exit_fn(void *arg) {
  detach_fn(arg);
  pthread_exit(NULL);
}

/* Promise (akv.h, akv_stream_launch_host: a function on the host backend
 * may end its thread and the stream goes on; Blocking: akv_stream_destroy
 * blocks until the stream's work ran and its worker left; nothing in the
 * library is undefined behaviour for a function that only touches its own
 * thread): a function that detaches the worker it runs on
 * (pthread_detach(pthread_self())). The backend joined its workers: the
 * successor of a worker whose function ended it joined that thread, and
 * akv_stream_destroy joined the last one; a join of a detached thread is
 * undefined (glibc: EINVAL while it lives; once it ended its id may name a
 * newer thread, whose end the join then awaits, or unmapped memory). Now
 * each worker reports, as it leaves, whether it is still joinable, and is
 * joined only then; the function's detach changes nothing else. */
static void test_stream_fn_detaches_its_worker(void **state) {
  (void)state;
  void (*const detachers[2])(void *) = {detach_fn, detach_exit_fn};
  for (int k = 0; k < 2; k++) {
    akvt_fx f;
    detached_reset();
    akvt_fx_open(&f, AKV_ROUTE_ARENA, 1, 2, 20);
    atomic_store(&ran_after, 0);
    for (int round = 0; round < 2; round++) {
      assert_int_equal(akv_stream_launch_host(f.e, f.s, detachers[k], NULL), AKV_OK);
      assert_int_equal(akv_stream_launch_host(f.e, f.s, count_fn, NULL), AKV_OK);
      assert_int_equal(akv_step_begin(f.e, f.c, 2), AKV_OK);
      assert_int_equal(akvt_null_layers(f.e, f.s, 3), AKV_OK);
      assert_int_equal(akv_stream_synchronize(f.e, f.s), AKV_OK);
      assert_int_equal(atomic_load(&ran_after), round + 1);
    }
    /* Destroy drains the stream, work after a detaching function too. */
    assert_int_equal(akv_stream_launch_host(f.e, f.s, detachers[k], NULL), AKV_OK);
    assert_int_equal(akv_stream_launch_host(f.e, f.s, count_fn, NULL), AKV_OK);
    assert_int_equal(akv_stream_destroy(f.e, f.s), AKV_OK);
    assert_int_equal(atomic_load(&ran_after), 3);
    for (uint32_t i = 0; i < f.n; i++) assert_int_equal(akv_context_close(f.c[i]), AKV_OK);
    assert_int_equal(akv_engine_destroy(f.e), AKV_OK);
    if (atomic_load(&joins_of_detached) != 0)
      fail_msg("the host backend joined %d thread(s) a stream function had detached (%s)",
               atomic_load(&joins_of_detached), k == 0 ? "returned" : "ended its thread");
  }
  detached_reset();
}

/* Promise (akv.h, Blocking: akv_stream_destroy returns once the stream's
 * worker thread was joined; akv_engine_destroy joins the engine's own
 * queue threads): a worker nobody detached is joined, so no thread runs
 * library code once destroy returned (an unload of the library may
 * follow). A worker that only signalled its exit could still be on its way
 * out through the library's code. Stream destroy joins one thread, its
 * worker; one whose function ended its thread joins two (the successor
 * joins the ended one); engine destroy joins the engine's three. */
static void test_undetached_workers_are_joined(void **state) {
  (void)state;
  akvt_fx f;
  detached_reset();
  akvt_fx_open(&f, AKV_ROUTE_ARENA, 1, 2, 20);
  atomic_store(&ran_after, 0);
  assert_int_equal(akv_stream_launch_host(f.e, f.s, count_fn, NULL), AKV_OK);
  assert_int_equal(akv_stream_synchronize(f.e, f.s), AKV_OK);
  assert_int_equal(atomic_load(&joins_run), 0);
  assert_int_equal(akv_stream_destroy(f.e, f.s), AKV_OK);
  assert_int_equal(atomic_load(&joins_run), 1);
  akv_stream s2 = NULL;
  assert_int_equal(akv_stream_create(f.e, &s2), AKV_OK);
  assert_int_equal(akv_stream_launch_host(f.e, s2, exit_fn, NULL), AKV_OK);
  assert_int_equal(akv_stream_launch_host(f.e, s2, count_fn, NULL), AKV_OK);
  assert_int_equal(akv_stream_destroy(f.e, s2), AKV_OK);
  assert_int_equal(atomic_load(&ran_after), 2);
  assert_int_equal(atomic_load(&joins_run), 3);
  for (uint32_t i = 0; i < f.n; i++) assert_int_equal(akv_context_close(f.c[i]), AKV_OK);
  assert_int_equal(akv_engine_destroy(f.e), AKV_OK);
  assert_int_equal(atomic_load(&joins_run), 6);
  assert_int_equal(atomic_load(&joins_of_detached), 0);
  detached_reset();
}

/* ------------------------------------------ refusals that name no reason */

/* The last error says what went wrong: it is no longer `before`, and names
 * the call. */
static void assert_last_error_names(const akv_engine *e, const char *before, const char *call) {
  const char *now = akv_engine_last_error(e);
  if (strcmp(now, before) == 0 || strstr(now, call) == NULL)
    fail_msg("%s refused without its own last error (last error: \"%s\")", call, now);
}

/* Sets the engine's last error to a known refusal of another call. */
static const char *mark(akv_engine *e) {
  assert_int_equal(akv_lease_begin(e, 0, NULL), AKV_ERR_INVALID_ARGUMENT);
  return "lease_begin: out is NULL";
}

/* Promise (akv.h, Conventions: a refusal on an engine records what went
 * wrong in the engine's last error; STYLE rule 3): the diagnostics'
 * argument refusals returned their status and left the last error as an
 * earlier call wrote it, so akv_engine_last_error named another call's
 * failure: akv_context_length and akv_context_id (out NULL),
 * akv_admission_counters, akv_admission_log, akv_admission_explain (a NULL
 * output, cap 0, n 0, and a context not open on the engine, whose
 * AKV_ERR_BAD_HANDLE is the engine's to explain), akv_engine_info_get and
 * akv_headroom_get (out NULL). Each now writes its own. */
static void test_diagnostics_refusals_set_last_error(void **state) {
  (void)state;
  akvt_fx f, g;
  uint64_t counters[AKV_ADM_RULE_COUNT];
  akv_adm_decision log[4];
  size_t n = 0;
  char buf[64];
  akvt_fx_open(&f, AKV_ROUTE_ARENA, 1, 2, 20);
  akvt_fx_open(&g, AKV_ROUTE_ARENA, 1, 1, 20);

  /* Each refusal comes right after another call's (mark): its own last
   * error must replace that one. */
#define REFUSED(call, status, name)                   \
  do {                                                \
    const char *before = mark(f.e);                   \
    assert_int_equal((call), (status));               \
    assert_last_error_names(f.e, before, (name));     \
  } while (0)
  REFUSED(akv_context_length(f.c[0], NULL), AKV_ERR_INVALID_ARGUMENT, "context_length");
  REFUSED(akv_context_id(f.c[0], NULL), AKV_ERR_INVALID_ARGUMENT, "context_id");
  REFUSED(akv_admission_counters(f.e, NULL, 1), AKV_ERR_INVALID_ARGUMENT, "admission_counters");
  REFUSED(akv_admission_counters(f.e, counters, 0), AKV_ERR_INVALID_ARGUMENT,
          "admission_counters");
  REFUSED(akv_admission_log(f.e, log, 4, NULL), AKV_ERR_INVALID_ARGUMENT, "admission_log");
  REFUSED(akv_admission_log(f.e, NULL, 4, &n), AKV_ERR_INVALID_ARGUMENT, "admission_log");
  REFUSED(akv_admission_explain(f.e, NULL, NULL, 8), AKV_ERR_INVALID_ARGUMENT,
          "admission_explain");
  REFUSED(akv_admission_explain(f.e, f.c[0], buf, 0), AKV_ERR_INVALID_ARGUMENT,
          "admission_explain");
  /* A context of another engine, then a closed one. */
  REFUSED(akv_admission_explain(f.e, g.c[0], buf, sizeof buf), AKV_ERR_BAD_HANDLE,
          "admission_explain");
  assert_int_equal(akv_context_close(f.c[1]), AKV_OK);
  REFUSED(akv_admission_explain(f.e, f.c[1], buf, sizeof buf), AKV_ERR_BAD_HANDLE,
          "admission_explain");
  REFUSED(akv_engine_info_get(f.e, NULL), AKV_ERR_INVALID_ARGUMENT, "engine_info_get");
  REFUSED(akv_headroom_get(f.e, NULL), AKV_ERR_INVALID_ARGUMENT, "headroom_get");
#undef REFUSED

  /* The other engine's last error was never touched by any of it. */
  assert_string_equal(akv_engine_last_error(g.e), "");

  assert_int_equal(akv_stream_destroy(f.e, f.s), AKV_OK);
  assert_int_equal(akv_context_close(f.c[0]), AKV_OK);
  assert_int_equal(akv_engine_destroy(f.e), AKV_OK);
  assert_int_equal(akv_stream_destroy(g.e, g.s), AKV_OK);
  assert_int_equal(akv_context_close(g.c[0]), AKV_OK);
  assert_int_equal(akv_engine_destroy(g.e), AKV_OK);
}

/* Promise (akv_group.h, akv_group_last_error: the last error of this rank's
 * group in words): akv_group_engine and akv_group_info_get refused a NULL
 * output with AKV_ERR_INVALID_ARGUMENT and left the group's last error as
 * it was. */
static void test_group_diagnostics_refusals_set_last_error(void **state) {
  (void)state;
  akv_group_world *w = NULL;
  akv_group *g = NULL;
  akv_engine_config ec = akvt_small_config(AKV_ROUTE_ARENA, 1);
  akv_group_config gc = AKV_GROUP_CONFIG_INIT;
  assert_int_equal(akv_group_world_create(1, 4, &w), AKV_OK);
  assert_int_equal(akv_group_create_inproc(&ec, &gc, w, &g), AKV_OK);
  assert_string_equal(akv_group_last_error(g), "");
  assert_int_equal(akv_group_engine(g, NULL), AKV_ERR_INVALID_ARGUMENT);
  assert_non_null(strstr(akv_group_last_error(g), "engine: out is NULL"));
  assert_int_equal(akv_group_info_get(g, NULL), AKV_ERR_INVALID_ARGUMENT);
  assert_non_null(strstr(akv_group_last_error(g), "info_get: out is NULL"));
  assert_int_equal(akv_group_destroy(g), AKV_OK);
  assert_int_equal(akv_group_world_destroy(w), AKV_OK);
}

/* ------------------------------ a context of another engine, read unclaimed */

static void sleep_ms(unsigned ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

typedef struct reopener {
  akv_engine *e;       /* engine B, used by this thread only from its start */
  akv_context *victim; /* B's context, closed and opened again until its record returns */
  int found;
  akv_status st;
} reopener;

static void *reopen_thread(void *arg) {
  reopener *r = arg;
  /* No synchronisation with the other thread from here on: a sleep, so
   * that its calls above came first. */
  sleep_ms(500);
  r->st = akv_context_close(r->victim);
  for (int i = 0; r->st == AKV_OK && !r->found && i < 64 * AKV_CONTEXT_HANDLE_REUSE_MIN; i++) {
    akv_context *c = NULL;
    r->st = akv_context_open(r->e, NULL, &c);
    if (r->st != AKV_OK) break;
    if (c == r->victim)
      r->found = 1; /* open on B again, as it was */
    else
      r->st = akv_context_close(c);
  }
  return NULL;
}

/* Promise (akv.h, Thread safety: a call reads nothing of an engine another
 * thread may be inside; akv_step_begin, akv_lease_write_back and
 * akv_admission_explain refuse a context of another engine with a status,
 * changing nothing): engine A's thread passes engine B's context to those
 * three calls, while B's thread uses B (closes the context and opens
 * contexts until the record comes back). The calls read the foreign
 * record's plain fields without B's claim: its engine word (step_begin and
 * explain, written atomically by B's opens) and its id (write_back's
 * message, written by B's open): data races with B's thread (undefined
 * behaviour; ThreadSanitizer reports them, so this test fails in the TSan
 * build). Now a context is told foreign by its atomic handle words alone
 * (magics, engine, open flag), as the group's checks do, and nothing else
 * of it is read. */
static void test_foreign_context_read_by_handle_words_only(void **state) {
  (void)state;
  akvt_fx a, b;
  akv_lease *l = NULL;
  akv_fence fa, ft;
  char buf[128];
  pthread_t t;
  akvt_fx_open(&a, AKV_ROUTE_STAGE, 0, 1, 5);
  akvt_fx_open(&b, AKV_ROUTE_STAGE, 0, 1, 5);
  /* B's stream goes now: from here on only the reopener uses B. */
  assert_int_equal(akv_stream_destroy(b.e, b.s), AKV_OK);
  reopener r = {b.e, b.c[0], 0, AKV_OK};
  assert_int_equal(pthread_create(&t, NULL, reopen_thread, &r), 0);

  assert_int_equal(akv_admission_explain(a.e, r.victim, buf, sizeof buf), AKV_ERR_BAD_HANDLE);
  assert_int_equal(akv_step_begin(a.e, &r.victim, 1), AKV_ERR_BAD_HANDLE);
  assert_int_equal(akv_step_begin(a.e, a.c, 1), AKV_OK);
  assert_int_equal(akv_lease_begin(a.e, 0, &l), AKV_OK);
  assert_int_equal(akv_lease_attend(l, a.s, akvt_noop_hook, NULL, &fa), AKV_OK);
  assert_int_equal(akv_lease_write_back(l, &r.victim, 1, &ft), AKV_ERR_OWNER_MISMATCH);

  assert_int_equal(pthread_join(t, NULL), 0);
  assert_int_equal(r.st, AKV_OK);
  assert_true(r.found);
  /* Nothing changed on A: the lease goes on as if the refusals never were. */
  assert_int_equal(akv_lease_write_back(l, NULL, 0, &ft), AKV_OK);
  assert_int_equal(akv_lease_seal(l, ft, fa), AKV_OK);
  assert_int_equal(akv_lease_retire(l, NULL), AKV_OK);
  assert_int_equal(akvt_null_layers_from(a.e, a.s, 1, 3), AKV_OK);
  assert_int_equal(akv_stream_destroy(a.e, a.s), AKV_OK);
  assert_int_equal(akv_context_close(a.c[0]), AKV_OK);
  assert_int_equal(akv_engine_destroy(a.e), AKV_OK);
  assert_int_equal(akv_context_close(r.victim), AKV_OK);
  assert_int_equal(akv_engine_destroy(b.e), AKV_OK);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_stream_fn_detaches_its_worker),
    cmocka_unit_test(test_undetached_workers_are_joined),
      cmocka_unit_test(test_diagnostics_refusals_set_last_error),
      cmocka_unit_test(test_group_diagnostics_refusals_set_last_error),
      cmocka_unit_test(test_foreign_context_read_by_handle_words_only),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
