/*
 * test_audit_s30.c - an audit of akv.h's promises under hostile call
 * sequences: forks from the log callback, reentrant calls and odd states.
 * Each test names the promise it checks and fails while the library breaks
 * it.
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
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "akv.h"
#include "testutil.h"

static void sleep_ms(unsigned ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

/* Waits up to 25 s for the child; kills it if it hangs. Returns its exit
 * code, or -1 (killed, or ended by a signal). */
static int child_status(pid_t pid) {
  int ws = 0;
  pid_t r = 0;
  for (int i = 0; i < 25000 && (r = waitpid(pid, &ws, WNOHANG)) == 0; i++) sleep_ms(1);
  if (r == 0) {
    kill(pid, SIGKILL);
    waitpid(pid, &ws, 0);
    return -1;
  }
  return WIFEXITED(ws) ? WEXITSTATUS(ws) : -1;
}

/* ------------------------------------- a log callback that forks in create */

#ifndef AKVT_TSAN
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

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_log_callback_forks_in_create),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
