/*
 * test_teeth_headroom.c - proves that the headroom tests have teeth. This
 * test links the library built with AKV_TEST_RELEASE_HEADROOM_EARLY: a
 * release inside a step frees the headroom at once, while the step's copies
 * and attention may still read it, instead of waiting for step_end. The same
 * runs test_headroom passes (mid-step release, random per-queue delays) must
 * then go wrong in most seeds: attention outputs or host rows differ from
 * resident, or the process faults on the freed memory (the host backend
 * unmaps freed device blocks). Each seed runs in a child process so that a
 * fault is counted, not fatal.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "testutil.h"

/* 0: bit-identical; 1: corruption seen; 2: the run itself failed. */
static int one_seed(uint32_t s) {
  akvt_cfg c = akvt_default_cfg();
  akvt_result r;
  c.route = (s & 1) ? AKV_ROUTE_PAGED : AKV_ROUTE_ARENA;
  c.device_pool_gib = 0;
  c.target_pages = 0;
  c.headroom_pages = 24;
  c.layers = 6;
  c.steps = 3;
  c.delay_seed = s;
  c.delay_max_us = 200;
  c.release_step = 2;
  c.release_mid_step = 1;
  c.release_layer = 0;
  c.release_bytes = UINT64_MAX;
  akvt_run(&c, &r);
  if (r.status != AKV_OK) return 2;
  return r.outputs_mismatched > 0 || r.rows_mismatched > 0;
}

static void test_early_release_is_detected(void **state) {
  uint32_t seeds = getenv("AKVT_TEETH_SEEDS") ? (uint32_t)atoi(getenv("AKVT_TEETH_SEEDS")) : 40;
  uint32_t corrupt = 0, faulted = 0, failed = 0;
  (void)state;
  for (uint32_t s = 1; s <= seeds; s++) {
    fflush(stdout);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
      /* cmocka catches faults in the test process; the child must die of them. */
      signal(SIGSEGV, SIG_DFL);
      signal(SIGBUS, SIG_DFL);
      signal(SIGILL, SIG_DFL);
      signal(SIGFPE, SIG_DFL);
      signal(SIGABRT, SIG_DFL);
      _exit(one_seed(s));
    }
    int wst = 0;
    assert_int_equal(waitpid(pid, &wst, 0), pid);
    if (WIFSIGNALED(wst)) faulted++;
    else if (WIFEXITED(wst) && WEXITSTATUS(wst) == 1) corrupt++;
    else if (WIFEXITED(wst) && WEXITSTATUS(wst) == 2) failed++;
  }
  printf("teeth (headroom): release frees mid-step; %u of %u seeds corrupted, %u faulted on freed "
         "memory, %u failed a call\n",
         corrupt, seeds, faulted, failed);
  /* a clear majority goes wrong */
  assert_true((corrupt + faulted) * 10 >= seeds * 6);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_early_release_is_detected),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
