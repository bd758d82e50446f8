/*
 * test_perturb.c - schedule perturbation (DESIGN §9).
 *
 * Thousands of seeded schedules: for each seed the host backend draws a
 * random delay before every operation of every queue (H2D, D2H, D2D and the
 * compute stream each have their own stream of draws; see backend_host.c),
 * which reorders how copies, attention and write-backs interleave. Each
 * schedule is a short multi-layer, multi-context decode on the stage or the
 * arena route; every attention output must be byte-identical to attention
 * over the fully resident history and every host row must hold exactly what
 * was prefilled or written back. The schedules are kept tiny (delays of at
 * most a few microseconds, two steps) so that ten thousand of them fit the
 * CPU suite's time.
 *
 * The same harness with the prior-reader waits dropped (test_teeth, and the
 * figures in docs/reliability.md) sees corruption in most schedules: a
 * schedule that passes here is evidence, not luck.
 *
 * AKVT_SCHEDULES=n runs n schedules (default 10000); AKVT_SEED0=s starts the
 * seed range at s (default 1).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include <cmocka.h>

#include "testutil.h"

static uint64_t env_u64(const char *name, uint64_t dflt) {
  const char *s = getenv(name);
  if (s == NULL || *s == '\0') return dflt;
  return strtoull(s, NULL, 10);
}

/* The schedule of one seed: everything but the delays is a function of the
 * seed too, so a failing seed reruns alone with AKVT_SEED0=seed
 * AKVT_SCHEDULES=1. */
static akvt_cfg schedule_cfg(uint64_t seed) {
  akvt_cfg c = akvt_default_cfg();
  c.delay_seed = seed;
  c.delay_max_us = 1 + (uint32_t)(seed % 8); /* 1..8 us */
  c.layers = 3 + (uint32_t)((seed >> 1) % 2); /* 3 or 4: both staging buffers reused */
  c.steps = 2;
  c.two_call = (seed >> 2) & 1;
  if (seed & 1) {
    /* Odd seeds retain pages: arena and paged in turn. */
    c.route = ((seed >> 4) & 1) ? AKV_ROUTE_PAGED : AKV_ROUTE_ARENA;
    c.device_pool_gib = 1;
    c.page_tokens = 16; /* 17 and 40 rows: one and two retained pages */
    c.target_pages = ((seed >> 3) & 1) ? AKV_TARGET_FAIR_SHARE : 1;
    c.burst_pages = ((seed >> 3) & 1) ? 0 : 1;
  }
  return c;
}

static void test_seeded_schedules_bit_identical(void **state) {
  uint64_t n = env_u64("AKVT_SCHEDULES", 10000);
  uint64_t seed0 = env_u64("AKVT_SEED0", 1);
  uint64_t outputs = 0, rows = 0, arena = 0, paged = 0, d2d_runs = 0;
  (void)state;
  assert_true(n > 0);
  for (uint64_t seed = seed0; seed < seed0 + n; seed++) {
    akvt_cfg c = schedule_cfg(seed);
    akvt_result r;
    akvt_run(&c, &r);
    if (r.status != AKV_OK)
      fail_msg("seed %llu: %s returned %s", (unsigned long long)seed, r.failed_call,
               akv_status_string(r.status));
    if (r.outputs_compared != (uint64_t)c.steps * c.layers * c.n_ctx)
      fail_msg("seed %llu: %llu outputs compared", (unsigned long long)seed,
               (unsigned long long)r.outputs_compared);
    if (r.outputs_mismatched != 0 || r.rows_mismatched != 0)
      fail_msg("seed %llu (%s, %u layers, delays <= %u us): %llu of %llu outputs and %llu of "
               "%llu host rows differ from resident",
               (unsigned long long)seed,
               c.route == AKV_ROUTE_ARENA   ? "arena"
               : c.route == AKV_ROUTE_PAGED ? "paged"
                                            : "stage",
               c.layers,
               c.delay_max_us, (unsigned long long)r.outputs_mismatched,
               (unsigned long long)r.outputs_compared, (unsigned long long)r.rows_mismatched,
               (unsigned long long)r.rows_checked);
    if (r.rows_checked != r.rows_expected || r.rows_checked == 0)
      fail_msg("seed %llu: %llu rows checked of %llu", (unsigned long long)seed,
               (unsigned long long)r.rows_checked, (unsigned long long)r.rows_expected);
    if (!r.destroyed) fail_msg("seed %llu: destroy failed", (unsigned long long)seed);
    outputs += r.outputs_compared;
    rows += r.rows_checked;
    if (c.route == AKV_ROUTE_ARENA) {
      arena++;
      if (r.info.bytes_d2d > 0) d2d_runs++;
    }
    if (c.route == AKV_ROUTE_PAGED) {
      paged++;
      if (r.info.bytes_d2d != 0)
        fail_msg("seed %llu: the paged route copied device to device", (unsigned long long)seed);
    }
  }
  /* the arena schedules really overlap device-to-device materialisation */
  assert_int_equal(d2d_runs, arena);
  if (n >= 32) assert_true(paged > 0);
  printf("perturb: %llu seeded schedules (seeds %llu..%llu; %llu stage, %llu arena, %llu paged; "
         "delays <= "
         "1..8 us per queue op), all bit-identical: %llu attention outputs and %llu host rows "
         "compared, 0 differ\n",
         (unsigned long long)n, (unsigned long long)seed0, (unsigned long long)(seed0 + n - 1),
         (unsigned long long)(n - arena - paged), (unsigned long long)arena,
         (unsigned long long)paged, (unsigned long long)outputs,
         (unsigned long long)rows);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_seeded_schedules_bit_identical),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
