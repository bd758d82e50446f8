/*
 * test_teeth.c - proves the perturbation harness has teeth. This test links
 * the library built with AKV_TEST_DROP_PRIOR_READER_WAITS: a new lease no
 * longer waits for the previous readers of its staging buffer. Under random
 * per-queue delays the harness must then see corrupted attention outputs or
 * host rows in a clear majority of seeds.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include <cmocka.h>

#include "testutil.h"

static void test_dropped_waits_are_detected(void **state) {
  uint32_t seeds = getenv("AKVT_TEETH_SEEDS") ? (uint32_t)atoi(getenv("AKVT_TEETH_SEEDS")) : 200;
  uint32_t detected = 0;
  (void)state;
  for (uint32_t s = 1; s <= seeds; s++) {
    akvt_cfg c = akvt_default_cfg();
    akvt_result r;
    c.layers = 6;
    c.steps = 3;
    c.delay_seed = s;
    c.delay_max_us = 200;
    akvt_run(&c, &r);
    assert_int_equal(r.status, AKV_OK);
    if (r.outputs_mismatched > 0 || r.rows_mismatched > 0) detected++;
  }
  printf("teeth: prior-reader waits dropped; corruption detected in %u of %u seeds\n", detected,
         seeds);
  /* a clear majority */
  assert_true(detected * 10 >= seeds * 6);
}

int main(void) {
  const struct CMUnitTest tests[] = {cmocka_unit_test(test_dropped_waits_are_detected)};
  return cmocka_run_group_tests(tests, NULL, NULL);
}
