/*
 * test_audit_s31.c - an audit of akv.h's promises under hostile call
 * sequences: a function on a stream that destroys another stream waiting
 * for it, a function that ends its worker thread, a worker cancelled while
 * idle, and a function that leaves asynchronous cancellation. Each test names the promise it checks and fails while the
 * library breaks it. A hang is bounded: a test gives up waiting after
 * HANG_MS, or runs in a forked child that akvt_wait_child kills.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
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
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "akv.h"
#include "testutil.h"

/* How long a test waits for a function on a stream before calling it hung. */
#define HANG_MS 20000u

static void sleep_ms(unsigned ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

/* Polls *flag for up to HANG_MS; 1 when it was set. */
static int wait_flag(_Atomic int *flag) {
  for (unsigned i = 0; i < HANG_MS; i++) {
    if (atomic_load(flag)) return 1;
    sleep_ms(1);
  }
  return atomic_load(flag);
}

/* --------------------------- a stream function destroys a stream waiting for it */

typedef struct destroyer {
  akv_engine *e;
  akv_stream victim;
  _Atomic int go, done;
  akv_status status;
} destroyer;

static void destroy_fn(void *arg) {
  destroyer *d = arg;
  while (!atomic_load(&d->go)) sleep_ms(1);
  d->status = akv_stream_destroy(d->e, d->victim);
  atomic_store(&d->done, 1);
}

/* Arena route, 2 contexts of 40 rows (full pages retained, so a lease's
 * wait_ready waits on two events: H2D and D2D). */
static akv_engine *arena_engine(uint32_t fail_wait_nth, akv_context **c) {
  static uint16_t zero[64 * 16];
  const void *rows[3] = {zero, zero, zero};
  akv_engine_config ec = akvt_small_config(AKV_ROUTE_ARENA, 1);
  akv_engine *e = NULL;
  if (fail_wait_nth != 0) {
    ec.fault_kind = AKV_OP_WAIT;
    ec.fault_fail_nth = fail_wait_nth;
  }
  assert_int_equal(akv_engine_create(&ec, &e), AKV_OK);
  for (int i = 0; i < 2; i++) {
    assert_int_equal(akv_context_open(e, NULL, &c[i]), AKV_OK);
    assert_int_equal(akv_context_append(c[i], 40, rows, rows), AKV_OK);
  }
  return e;
}

/* Layers 0 and 1 through attend (on stream a), write-back and seal, then
 * layer 2 begun: its copies wait for layer 0's readers, among them layer
 * 0's attention event, recorded on a behind whatever a holds first. */
static void two_layers_then_begin(akv_engine *e, akv_context **c, akv_stream a, akv_lease **l) {
  akv_fence fa, ft;
  assert_int_equal(akv_step_begin(e, c, 2), AKV_OK);
  for (uint32_t i = 0; i < 2; i++) {
    assert_int_equal(akv_lease_begin(e, i, &l[i]), AKV_OK);
    assert_int_equal(akv_lease_attend(l[i], a, akvt_noop_hook, NULL, &fa), AKV_OK);
    assert_int_equal(akv_lease_write_back(l[i], NULL, 0, &ft), AKV_OK);
    assert_int_equal(akv_lease_seal(l[i], ft, fa), AKV_OK);
  }
  assert_int_equal(akv_lease_begin(e, 2, &l[2]), AKV_OK);
}

/* Promise (akv.h Blocking: akv_stream_destroy blocks until the stream's work
 * ran; akv_stream_launch_host: a call from fn that would wait for fn itself
 * is refused with AKV_ERR_IN_USE and changes nothing): a function on stream
 * A destroys stream B while B waits, through the engine's queues, for work
 * behind that function. B got its wait from an akv_lease_wait_ready whose
 * second wait (D2D) failed: the lease stayed begun, so no lease names B and
 * destroy's "a lease used this stream" check passes. The destroy drained B,
 * whose H2D wait needs layer 0's attention on A, behind the function: it
 * joined B's worker for good, the engine claimed by A's worker, and nothing
 * (quarantine, destroy) could ever free the engine. Now it is refused at
 * once with AKV_ERR_IN_USE, B stays live, and after a quarantine both
 * streams and the engine go. */
static void test_stream_fn_destroys_a_stream_waiting_for_it(void **state) {
  (void)state;
  akv_context *c[2];
  akv_stream a, b;
  akv_lease *l[3];
  akv_view v;
  akv_engine_info info;

  /* A run without fault counts the waits before layer 2's wait_ready. */
  akv_engine *e = arena_engine(0, c);
  assert_int_equal(akv_stream_create(e, &a), AKV_OK);
  assert_int_equal(akv_stream_create(e, &b), AKV_OK);
  two_layers_then_begin(e, c, a, l);
  assert_int_equal(akv_engine_info_get(e, &info), AKV_OK);
  const uint64_t waits_before = info.backend_ops[AKV_OP_WAIT];
  assert_int_equal(akv_lease_wait_ready(l[2], b, &v), AKV_OK);
  assert_int_equal(akv_engine_info_get(e, &info), AKV_OK);
  assert_int_equal(info.backend_ops[AKV_OP_WAIT] - waits_before, 2); /* H2D and D2D */
  akv_fence fa, ft;
  assert_int_equal(akv_lease_mark_consumed(l[2], b, &fa), AKV_OK);
  assert_int_equal(akv_lease_write_back(l[2], NULL, 0, &ft), AKV_OK);
  assert_int_equal(akv_lease_seal(l[2], ft, fa), AKV_OK);
  for (uint32_t i = 0; i < 3; i++) assert_int_equal(akv_lease_retire(l[i], NULL), AKV_OK);
  assert_int_equal(akv_step_end(e), AKV_OK);
  assert_int_equal(akv_stream_destroy(e, b), AKV_OK);
  assert_int_equal(akv_stream_destroy(e, a), AKV_OK);
  assert_int_equal(akv_engine_destroy(e), AKV_OK);

  /* The same with layer 2's second wait failed, a function parked on A
   * first (so that layer 0's attention on A is behind it). */
  static destroyer d;
  memset(&d, 0, sizeof d);
  e = arena_engine((uint32_t)waits_before + 2, c);
  assert_int_equal(akv_stream_create(e, &a), AKV_OK);
  assert_int_equal(akv_stream_create(e, &b), AKV_OK);
  d.e = e;
  d.victim = b;
  assert_int_equal(akv_stream_launch_host(e, a, destroy_fn, &d), AKV_OK);
  two_layers_then_begin(e, c, a, l);
  assert_int_equal(akv_lease_wait_ready(l[2], b, &v), AKV_ERR_BACKEND);
  atomic_store(&d.go, 1);
  if (!wait_flag(&d.done))
    fail_msg("akv_stream_destroy from a function on A hung on a stream waiting for A");
  assert_int_equal(d.status, AKV_ERR_IN_USE);
  /* Nothing changed: B is still live (a dead stream would answer
   * AKV_ERR_INVALID_ARGUMENT below), and once a quarantine drained every
   * queue both streams and the engine go. */
  akv_quarantine_report rep;
  assert_int_equal(akv_engine_quarantine(e, &rep), AKV_OK);
  assert_int_equal(akv_stream_destroy(e, b), AKV_OK);
  assert_int_equal(akv_stream_destroy(e, a), AKV_OK);
  assert_int_equal(akv_engine_destroy(e), AKV_OK);
}

/* ----------------------------------------- a stream function ends its thread */

static _Atomic int ran_after;

static void exit_fn(void *arg) {
  (void)arg;
  pthread_exit(NULL);
}

static void cancel_fn(void *arg) {
  (void)arg;
  pthread_cancel(pthread_self());
  pthread_testcancel();
}

static void count_fn(void *arg) {
  (void)arg;
  atomic_fetch_add(&ran_after, 1);
}

/* Promise (akv.h, akv_stream_launch_host: a function that ends its thread
 * ends only itself; the stream's later work runs): a function on a stream
 * that ends its worker thread (pthread_exit, or a cancellation acting
 * inside it). The stream's ring was left without a worker: work after the
 * function never ran, the step's leases never retired (AKV_ERR_BACKEND
 * after the sync timeout), quarantine could not establish completion and
 * kept everything retained, so the engine could never be destroyed; and
 * akv_stream_destroy returned AKV_OK with the work after the function never
 * run. Now a successor worker runs the rest of the stream; the step
 * completes, destroy drains it all, and the engine goes. Twice per stream,
 * so that a successor's function ending its thread is covered too. */
static void test_stream_fn_ends_its_thread(void **state) {
  (void)state;
  void (*const enders[2])(void *) = {exit_fn, cancel_fn};
  for (int k = 0; k < 2; k++) {
    /* A short sync timeout, so that the broken behaviour fails in seconds. */
    setenv("AKV_HOST_SYNC_TIMEOUT_MS", "2000", 1);
    akvt_fx f;
    akvt_fx_open(&f, AKV_ROUTE_ARENA, 1, 2, 20);
    unsetenv("AKV_HOST_SYNC_TIMEOUT_MS");
    atomic_store(&ran_after, 0);
    for (int round = 0; round < 2; round++) {
      assert_int_equal(akv_stream_launch_host(f.e, f.s, enders[k], NULL), AKV_OK);
      assert_int_equal(akv_stream_launch_host(f.e, f.s, count_fn, NULL), AKV_OK);
      assert_int_equal(akv_step_begin(f.e, f.c, 2), AKV_OK);
      assert_int_equal(akvt_null_layers(f.e, f.s, 3), AKV_OK);
      assert_int_equal(akv_stream_synchronize(f.e, f.s), AKV_OK);
      assert_int_equal(atomic_load(&ran_after), round + 1);
    }
    akv_engine_info info;
    assert_int_equal(akv_engine_info_get(f.e, &info), AKV_OK);
    assert_int_equal(info.transport_failed, 0);
    /* Destroy drains the stream: the work after an ending function runs
     * too (it was dropped: destroy joined the ended thread, ring unrun). */
    assert_int_equal(akv_stream_launch_host(f.e, f.s, enders[k], NULL), AKV_OK);
    assert_int_equal(akv_stream_launch_host(f.e, f.s, count_fn, NULL), AKV_OK);
    assert_int_equal(akv_stream_destroy(f.e, f.s), AKV_OK);
    assert_int_equal(atomic_load(&ran_after), 3);
    for (uint32_t i = 0; i < f.n; i++) assert_int_equal(akv_context_close(f.c[i]), AKV_OK);
    assert_int_equal(akv_engine_destroy(f.e), AKV_OK);
  }
}

/* ------------------------------------- a worker cancelled while it is idle */

static pthread_t worker_tid;

static void tid_fn(void *arg) {
  (void)arg;
  worker_tid = pthread_self();
}

static void testcancel_fn(void *arg) {
  (void)arg;
  pthread_testcancel();
}

/* In the child: the engine and stream made there, the stream's worker
 * cancelled while idle, then used. 0 when everything answered as akv.h
 * says. */
static int cancelled_idle_worker(void) {
  akvt_fx f;
  akvt_fx_open(&f, AKV_ROUTE_STAGE, 0, 1, 5);
  atomic_store(&ran_after, 0);
  if (akv_stream_launch_host(f.e, f.s, tid_fn, NULL) != AKV_OK) return 10;
  if (akv_stream_synchronize(f.e, f.s) != AKV_OK) return 11;
  /* The worker is idle (or about to be): the cancel is pending there. */
  if (pthread_cancel(worker_tid) != 0) return 12;
  /* The cancel acts in the next function at its cancellation point, ending
   * only that function; the stream runs on. */
  if (akv_stream_launch_host(f.e, f.s, testcancel_fn, NULL) != AKV_OK) return 13;
  if (akv_stream_launch_host(f.e, f.s, count_fn, NULL) != AKV_OK) return 14;
  if (akv_stream_synchronize(f.e, f.s) != AKV_OK) return 15;
  if (atomic_load(&ran_after) != 1) return 16;
  if (akv_step_begin(f.e, f.c, 1) != AKV_OK) return 17;
  if (akvt_null_layers(f.e, f.s, 3) != AKV_OK) return 18;
  if (akv_stream_destroy(f.e, f.s) != AKV_OK) return 19;
  if (akv_context_close(f.c[0]) != AKV_OK) return 20;
  if (akv_engine_destroy(f.e) != AKV_OK) return 21;
  return 0;
}

/* Promise (akv.h, akv_stream_launch_host: a function that ends its thread,
 * a cancellation acting inside it included, ends only itself): a worker
 * thread cancelled while idle (a function handed out pthread_self()). The
 * cancel acted in the worker's own wait for work, which ended the thread
 * holding the queue's mutex: the next akv_stream_launch_host on the stream
 * blocked on that mutex for good (the child hung and was killed). Now the
 * worker keeps cancellation disabled outside functions: the cancel acts in
 * the next function that reaches a cancellation point, ending only it, and
 * the stream, the step and destroy go on. In a forked child, so that a
 * hang is bounded (25 s, then the child is killed). */
static void test_stream_worker_cancelled_while_idle(void **state) {
  (void)state;
  fflush(NULL);
  const pid_t pid = fork();
  assert_true(pid >= 0);
  if (pid == 0) {
    alarm(60);
    _exit(cancelled_idle_worker());
  }
  int ws = 0;
  if (!akvt_wait_child(pid, 25000, &ws)) fail_msg("the child hung (killed)");
  if (!WIFEXITED(ws)) fail_msg("the child ended by signal %d", WIFSIGNALED(ws) ? WTERMSIG(ws) : -1);
  if (WEXITSTATUS(ws) != 0) fail_msg("the child's check %d failed", WEXITSTATUS(ws));
}

/* ------------------------------- a function leaves asynchronous cancellation */

static void async_fn(void *arg) {
  int old = 0;
  (void)arg;
  worker_tid = pthread_self();
  pthread_setcanceltype(PTHREAD_CANCEL_ASYNCHRONOUS, &old);
}

/* Promise (akv.h, akv_stream_launch_host: a cancellation of a worker acts
 * only inside a function, at its cancellation points, ending only that
 * function): a function that switched its worker to asynchronous
 * cancellation and returned, then a cancel of the worker while idle. The
 * next function was skipped unrun: the worker enabled cancellation to run
 * it, the pending cancel acted there at once, and the function's slot
 * counted as done (synchronize said AKV_OK, the function never ran). Now
 * the worker sets deferred cancellation back after each function: the
 * next one runs (it reaches no cancellation point), and the stream, a step
 * and destroy go on. */
static void test_stream_fn_leaves_async_cancel(void **state) {
  (void)state;
  akvt_fx f;
  akvt_fx_open(&f, AKV_ROUTE_STAGE, 0, 1, 5);
  atomic_store(&ran_after, 0);
  assert_int_equal(akv_stream_launch_host(f.e, f.s, async_fn, NULL), AKV_OK);
  assert_int_equal(akv_stream_synchronize(f.e, f.s), AKV_OK);
  assert_int_equal(pthread_cancel(worker_tid), 0);
  assert_int_equal(akv_stream_launch_host(f.e, f.s, count_fn, NULL), AKV_OK);
  assert_int_equal(akv_stream_synchronize(f.e, f.s), AKV_OK);
  assert_int_equal(atomic_load(&ran_after), 1);
  assert_int_equal(akv_step_begin(f.e, f.c, 1), AKV_OK);
  assert_int_equal(akvt_null_layers(f.e, f.s, 3), AKV_OK);
  assert_int_equal(akv_stream_destroy(f.e, f.s), AKV_OK);
  assert_int_equal(akv_context_close(f.c[0]), AKV_OK);
  assert_int_equal(akv_engine_destroy(f.e), AKV_OK);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_stream_fn_destroys_a_stream_waiting_for_it),
      cmocka_unit_test(test_stream_fn_ends_its_thread),
      cmocka_unit_test(test_stream_worker_cancelled_while_idle),
      cmocka_unit_test(test_stream_fn_leaves_async_cancel),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
