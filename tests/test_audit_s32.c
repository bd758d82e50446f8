/*
 * test_audit_s32.c - an audit of akv.h's promises under hostile call
 * sequences: a stream function that detaches its worker thread. Each test names the promise it
 * checks and fails while the library breaks it.
 *
 * This binary is linked with -Wl,--wrap=pthread_join (tests/CMakeLists.txt):
 * every pthread_join of the library's objects comes through
 * __wrap_pthread_join below, which refuses (and counts) a join of a thread
 * a stream function detached, instead of running it (undefined behaviour).
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
#include "testutil.h"

/* ------------------------------------------------- joins of detached threads */

#define MAX_DETACHED 16
static pthread_mutex_t detached_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_t detached[MAX_DETACHED];
static size_t n_detached;
static _Atomic int joins_of_detached;

int __real_pthread_join(pthread_t thread, void **ret);
int __wrap_pthread_join(pthread_t thread, void **ret);

int __wrap_pthread_join(pthread_t thread, void **ret) {
  int hit = 0;
  pthread_mutex_lock(&detached_mu);
  for (size_t i = 0; i < n_detached && !hit; i++) hit = pthread_equal(detached[i], thread);
  pthread_mutex_unlock(&detached_mu);
  if (hit) {
    atomic_fetch_add(&joins_of_detached, 1);
    return EINVAL; /* what glibc answers while the thread lives; never run */
  }
  return __real_pthread_join(thread, ret);
}

/* Forgets the detached threads: their ids may name later threads. */
static void detached_reset(void) {
  pthread_mutex_lock(&detached_mu);
  n_detached = 0;
  pthread_mutex_unlock(&detached_mu);
  atomic_store(&joins_of_detached, 0);
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
 * workers are detached threads the backend never joins: it waits on each
 * worker's own exit signal, and the function's detach changes nothing. */
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

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_stream_fn_detaches_its_worker),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
