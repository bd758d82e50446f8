/*
 * test_decode.c - decode loops on the host backend over several contexts and
 * layers: every attention output must be byte-identical to the same
 * attention over the fully resident history, and every host row must hold
 * exactly what was prefilled or written back. Also under random per-queue
 * delays, many seeds, and on the arena and paged routes with several pool
 * shapes.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include <cmocka.h>

#include "testutil.h"

static void expect_clean(const akvt_cfg *c, const char *what) {
  akvt_result r;
  akvt_run(c, &r);
  if (r.status != AKV_OK)
    fail_msg("%s: %s returned %s", what, r.failed_call, akv_status_string(r.status));
  assert_int_equal(r.outputs_compared, (uint64_t)c->steps * c->layers * c->n_ctx);
  if (r.outputs_mismatched != 0)
    fail_msg("%s: %llu of %llu outputs differ from resident", what,
             (unsigned long long)r.outputs_mismatched, (unsigned long long)r.outputs_compared);
  assert_true(r.rows_checked > 0);
  assert_int_equal(r.rows_mismatched, 0);
  assert_true(r.destroyed);
}

static void test_stage_hook_form(void **state) {
  akvt_cfg c = akvt_default_cfg();
  (void)state;
  expect_clean(&c, "stage/hook");
}

static void test_stage_two_call_form(void **state) {
  akvt_cfg c = akvt_default_cfg();
  (void)state;
  c.two_call = 1;
  expect_clean(&c, "stage/two-call");
}

static void pool_shapes(akv_route route) {
  /* prefill lengths around page boundaries (page_tokens 8) */
  const uint32_t lens[][4] = {{1, 7, 8, 9}, {16, 23, 33, 47}, {64, 1, 15, 80}};
  for (size_t k = 0; k < sizeof(lens) / sizeof(lens[0]); k++) {
    for (uint32_t tgt = 0; tgt < 4; tgt++) {
      akvt_cfg c = akvt_default_cfg();
      char what[64];
      c.route = route;
      c.device_pool_gib = 1;
      c.n_ctx = 4;
      c.steps = 10; /* crosses page boundaries while decoding */
      for (int i = 0; i < 4; i++) c.prefill[i] = lens[k][i];
      /* tight (2-3 pages each) through roomy (fair share of a 1 GiB pool) */
      c.target_pages = tgt == 3 ? AKV_TARGET_FAIR_SHARE : 2 + tgt;
      c.burst_pages = tgt == 1 ? 2 : 0;
      snprintf(what, sizeof(what), "%s lens#%zu target#%u",
               route == AKV_ROUTE_ARENA ? "arena" : "paged", k, tgt);
      expect_clean(&c, what);
    }
  }
}

static void test_arena_pool_shapes(void **state) {
  (void)state;
  pool_shapes(AKV_ROUTE_ARENA);
}

static void test_paged_pool_shapes(void **state) {
  (void)state;
  pool_shapes(AKV_ROUTE_PAGED);
}

static void test_arena_retains_pages(void **state) {
  akvt_cfg c = akvt_default_cfg();
  akvt_result r;
  (void)state;
  c.route = AKV_ROUTE_ARENA;
  c.device_pool_gib = 1;
  c.prefill[0] = 40;
  c.prefill[1] = 41;
  c.prefill[2] = 63;
  c.steps = 3;
  akvt_run(&c, &r);
  assert_int_equal(r.status, AKV_OK);
  assert_int_equal(r.outputs_mismatched, 0);
  /* retained pages are materialised device->device: less crosses PCIe */
  assert_true(r.info.bytes_d2d > 0);
  assert_int_equal(r.info.bytes_in_place, 0);
  assert_true(r.adm_counters[AKV_ADM_FREE] > 0);
}

static void test_paged_reads_in_place(void **state) {
  akvt_cfg c = akvt_default_cfg();
  akvt_result r, stage;
  (void)state;
  c.prefill[0] = 40;
  c.prefill[1] = 41;
  c.prefill[2] = 63;
  c.steps = 3;
  akvt_run(&c, &stage);
  assert_int_equal(stage.status, AKV_OK);
  c.route = AKV_ROUTE_PAGED;
  c.device_pool_gib = 1;
  akvt_run(&c, &r);
  assert_int_equal(r.status, AKV_OK);
  assert_int_equal(r.outputs_mismatched, 0);
  /* retained pages are neither staged nor copied device->device */
  assert_int_equal(r.info.bytes_d2d, 0);
  assert_true(r.info.bytes_in_place > 0);
  assert_int_equal(stage.info.bytes_in_place, 0);
  assert_true(r.adm_counters[AKV_ADM_FREE] > 0);
  assert_true(r.info.bytes_h2d < stage.info.bytes_h2d);
}

/* A hook that ignores the page map reads the staging buffer's holes. With
 * poison_holes those read NaN, so the misuse shows in every comparison;
 * the same poison leaves a correct hook bit-identical. */
static void test_paged_poison_exposes_a_hook_ignoring_the_map(void **state) {
  akvt_cfg c = akvt_default_cfg();
  akvt_result good, bad;
  (void)state;
  c.route = AKV_ROUTE_PAGED;
  c.device_pool_gib = 1;
  c.prefill[0] = 40;
  c.prefill[1] = 41;
  c.prefill[2] = 63;
  c.steps = 3;
  c.poison_holes = 1;
  expect_clean(&c, "paged, poisoned holes, hook reading the map");
  akvt_run(&c, &good);
  assert_true(good.info.bytes_in_place > 0);
  assert_int_equal(good.info.bytes_d2d, 0); /* the poison copies are not traffic */
  c.ignore_page_map = 1;
  akvt_run(&c, &bad);
  assert_int_equal(bad.status, AKV_OK);
  /* every context has a retained page, so every output of every layer is off */
  assert_int_equal(bad.outputs_mismatched, bad.outputs_compared);
  assert_int_equal(bad.rows_mismatched, 0); /* the host rows are still right */
}

static void test_delays_many_seeds(void **state) {
  uint32_t seeds = getenv("AKVT_SEEDS") ? (uint32_t)atoi(getenv("AKVT_SEEDS")) : 200;
  (void)state;
  for (uint32_t s = 1; s <= seeds; s++) {
    akvt_cfg c = akvt_default_cfg();
    char what[64];
    c.delay_seed = s;
    c.delay_max_us = 50;
    c.route = s % 3 == 1 ? AKV_ROUTE_ARENA : s % 3 == 2 ? AKV_ROUTE_PAGED : AKV_ROUTE_STAGE;
    c.device_pool_gib = c.route != AKV_ROUTE_STAGE;
    c.two_call = (s & 2) != 0;
    snprintf(what, sizeof(what), "seed %u", s);
    expect_clean(&c, what);
  }
  printf("delays: %u seeded schedules, all bit-identical\n", seeds);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_stage_hook_form),
      cmocka_unit_test(test_stage_two_call_form),
      cmocka_unit_test(test_arena_pool_shapes),
      cmocka_unit_test(test_arena_retains_pages),
      cmocka_unit_test(test_paged_pool_shapes),
      cmocka_unit_test(test_paged_reads_in_place),
      cmocka_unit_test(test_paged_poison_exposes_a_hook_ignoring_the_map),
      cmocka_unit_test(test_delays_many_seeds),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
