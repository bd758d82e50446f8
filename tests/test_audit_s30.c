/*
 * test_audit_s30.c - an audit of akv.h's promises under hostile call
 * sequences: a fork from the log callback while an engine is created, and
 * a function on a stream that enqueues onto a queue waiting for it. Each
 * test names the promise it checks and fails while the library breaks it.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "akv.h"
#include "testutil.h"

#if defined(__SANITIZE_THREAD__)
#define AKVT_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define AKVT_TSAN 1
#endif
#endif

static void sleep_ms(unsigned ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

/* ------------------------------------- a log callback that forks in create */

#ifndef AKVT_TSAN
/* Waits up to 25 s for the child; kills it if it hangs. Returns its exit
 * code, or -1 (killed, or ended by a signal). */
static int child_status(pid_t pid) {
  int ws = 0;
  if (!akvt_wait_child(pid, 25000, &ws)) return -1;
  return WIFEXITED(ws) ? WEXITSTATUS(ws) : -1;
}

static pid_t forked_pid = -1;
static const char *fork_on; /* a part of the line to fork on */

static void forking_log(void *user, akv_log_level level, const char *message) {
  (void)user;
  (void)level;
  if (forked_pid < 0 && fork_on != NULL && strstr(message, fork_on) != NULL) forked_pid = fork();
}

/* In the child: 0 when create answered as akv.h says (own: an engine that
 * works, destroy included; else AKV_ERR_BAD_HANDLE with *out untouched). */
static int child_check(akv_status st, akv_engine *e, int own) {
  akv_context *c = NULL;
  if (!own) return st == AKV_ERR_BAD_HANDLE && e == (akv_engine *)(uintptr_t)0x1234 ? 0 : 10;
  if (st != AKV_OK) return 20 + (int)st;
  if (akv_context_open(e, NULL, &c) != AKV_OK) return 50;
  if (akv_context_close(c) != AKV_OK) return 51;
  if (akv_engine_destroy(e) != AKV_OK) return 52;
  return 0;
}

static void fork_in_create(akv_engine_config ec, const char *line, int child_owns) {
  akv_engine *e = (akv_engine *)(uintptr_t)0x1234;
  ec.log_fn = forking_log;
  ec.log_level = AKV_LOG_DEBUG;
  fork_on = line;
  forked_pid = -1;
  const akv_status st = akv_engine_create(&ec, &e);
  if (forked_pid == 0) {
    alarm(20);
    _exit(child_check(st, e, child_owns));
  }
  fork_on = NULL;
  assert_true(forked_pid > 0);
  const int code = child_status(forked_pid);
  if (code != 0) fail_msg("fork on the line \"%s\": the child's create gave %d", line, code);
  /* The parent's create is untouched by the fork. */
  assert_int_equal(st, AKV_OK);
  assert_int_equal(akv_engine_destroy(e), AKV_OK);
}
#endif

/* Promise (akv.h, fork: an engine of the parent answers every call of the
 * child with AKV_ERR_BAD_HANDLE; a child may create and use engines of its
 * own): a log callback that forks while akv_engine_create runs. The create
 * went on in the child and returned AKV_OK with an engine stamped as the
 * parent's, so every call on it, destroy included, answered
 * AKV_ERR_BAD_HANDLE: forked before the engine started its queues, the
 * child's own worker threads ran on for good; forked after, the child was
 * handed an engine whose queues are in the parent. Now a fork before the
 * queues start leaves the child an engine of its own, and one after gives
 * AKV_ERR_BAD_HANDLE there with *out untouched. */
static void test_log_callback_forks_in_create(void **state) {
  (void)state;
#ifdef AKVT_TSAN
  skip(); /* TSan does not support threads in a child forked from threads */
#else
  /* The fit line comes before the record is taken: the child's own. */
  fork_in_create(akvt_small_config(AKV_ROUTE_ARENA, 1), "host fit", 1);
  /* A line after the record was taken, before the queues start. */
  fork_in_create(akvt_small_config(AKV_ROUTE_STAGE, 1), "retains nothing", 1);
  /* Lines after the queues started: the headroom profile, engine ready. */
  akv_engine_config hr = akvt_small_config(AKV_ROUTE_ARENA, 1);
  hr.headroom_gib = 1;
  fork_in_create(hr, "headroom = min", 0);
  fork_in_create(akvt_small_config(AKV_ROUTE_PAGED, 1), "engine ready", 0);
#endif
}

/* ------------------------ a stream function fills a ring that waits for it */

typedef struct flooder {
  akv_engine *e;
  akv_stream target;
  _Atomic int go, done;
  akv_status status; /* of the last launch */
  uint32_t launched;
  uint64_t ms;
} flooder;

static uint64_t now_ms(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (uint64_t)t.tv_sec * 1000u + (uint64_t)t.tv_nsec / 1000000u;
}

static void noop_fn(void *arg) { (void)arg; }

/* Launches onto fl->target until a launch fails (at most twice a ring). */
static void flood_fn(void *arg) {
  flooder *fl = arg;
  while (!atomic_load(&fl->go)) sleep_ms(1);
  const uint64_t t0 = now_ms();
  akv_status st = AKV_OK;
  uint32_t i = 0;
  for (; i < 8192 && st == AKV_OK; i++) st = akv_stream_launch_host(fl->e, fl->target, noop_fn, NULL);
  fl->status = st;
  fl->launched = i;
  fl->ms = now_ms() - t0;
  atomic_store(&fl->done, 1);
}

/* Promise (akv.h, akv_stream_launch_host: a call from fn that would wait
 * for fn itself is refused with AKV_ERR_IN_USE and changes nothing; the
 * Blocking list): a function on stream A launches onto stream B while B
 * waits, on the device, for a history-ready event that is behind an
 * attention event recorded on A after the function (B: wait_ready of layer
 * 2, whose copies wait for layer 0's write-back, which waits for layer 0's
 * attention on A). Once B's ring was full the launch waited for itself
 * until the sync timeout, then failed the transport (AKV_ERR_BACKEND): the
 * engine closed over a launch that never happened. Now it is refused at
 * once with AKV_ERR_IN_USE, nothing enqueued, and the step completes. */
static void test_stream_fn_fills_a_ring_that_waits_for_it(void **state) {
  (void)state;
  /* A short sync timeout, so that the broken behaviour fails in seconds. */
  setenv("AKV_HOST_SYNC_TIMEOUT_MS", "3000", 1);
  akvt_fx f;
  akvt_fx_open(&f, AKV_ROUTE_STAGE, 0, 2, 5);
  unsetenv("AKV_HOST_SYNC_TIMEOUT_MS");
  static flooder fl;
  memset(&fl, 0, sizeof fl);
  fl.e = f.e;
  assert_int_equal(akv_stream_create(f.e, &fl.target), AKV_OK);
  assert_int_equal(akv_stream_launch_host(f.e, f.s, flood_fn, &fl), AKV_OK);
  assert_int_equal(akv_step_begin(f.e, f.c, 2), AKV_OK);
  akv_lease *l[3];
  akv_fence fa[3], ft[3];
  akv_view v;
  for (uint32_t i = 0; i < 2; i++) {
    assert_int_equal(akv_lease_begin(f.e, i, &l[i]), AKV_OK);
    assert_int_equal(akv_lease_attend(l[i], f.s, akvt_noop_hook, NULL, &fa[i]), AKV_OK);
    assert_int_equal(akv_lease_write_back(l[i], NULL, 0, &ft[i]), AKV_OK);
    assert_int_equal(akv_lease_seal(l[i], ft[i], fa[i]), AKV_OK);
  }
  assert_int_equal(akv_lease_begin(f.e, 2, &l[2]), AKV_OK);
  assert_int_equal(akv_lease_wait_ready(l[2], fl.target, &v), AKV_OK);
  atomic_store(&fl.go, 1);
  while (!atomic_load(&fl.done)) sleep_ms(1);
  assert_int_equal(fl.status, AKV_ERR_IN_USE);
  assert_true(fl.launched > 1000); /* B's ring filled first */
  assert_true(fl.ms < 2000);       /* refused at once, not after the sync timeout */
  akv_engine_info info;
  assert_int_equal(akv_engine_info_get(f.e, &info), AKV_OK);
  assert_int_equal(info.transport_failed, 0);
  /* The step completes; B's functions run once its wait passed. */
  assert_int_equal(akv_lease_mark_consumed(l[2], fl.target, &fa[2]), AKV_OK);
  assert_int_equal(akv_lease_write_back(l[2], NULL, 0, &ft[2]), AKV_OK);
  assert_int_equal(akv_lease_seal(l[2], ft[2], fa[2]), AKV_OK);
  for (uint32_t i = 0; i < 3; i++) assert_int_equal(akv_lease_retire(l[i], NULL), AKV_OK);
  assert_int_equal(akv_step_end(f.e), AKV_OK);
  assert_int_equal(akv_stream_destroy(f.e, fl.target), AKV_OK);
  assert_int_equal(akv_stream_destroy(f.e, f.s), AKV_OK);
  for (uint32_t i = 0; i < f.n; i++) assert_int_equal(akv_context_close(f.c[i]), AKV_OK);
  assert_int_equal(akv_engine_destroy(f.e), AKV_OK);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_log_callback_forks_in_create),
      cmocka_unit_test(test_stream_fn_fills_a_ring_that_waits_for_it),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
