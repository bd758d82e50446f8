/*
 * test_promises.c - promises of the public headers that no other test file
 * pins, each checked so that it fails when the promise is broken: the ABI
 * rules a caller built against one header relies on when it runs against
 * the library of the same soname.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "akv.h"
#include "akv_attention.h"
#include "akv_group.h"
#include "testutil.h"

/* ------------------------------------------------ structs the library fills */

/* The structs the library writes into the caller's memory without being
 * told their size (no struct_size field, or, for akv_engine_config, the one
 * call that fills it: akv_engine_config_init). A library writes its own
 * sizeof, so a caller built against a header of the same soname must have
 * the same size, or the library writes past the caller's struct (akv.h,
 * "ABI"). Sizes per soname, as released; a struct absent from a release is
 * 0 there. A size that changes needs a new soname (before 1.0: a new minor
 * version) and a new row here. */
typedef struct filled_sizes {
  unsigned major, minor;
  size_t engine_config, fit_report, engine_info, quarantine_report, view, receipt, adm_decision,
      headroom_info, fence, attention_args, group_info;
} filled_sizes;

static const filled_sizes released[] = {
    /* 0.2.0 (libactivekv.so.0.2), x86-64 */
    {0, 2, 112, 576, 200, 156, 120, 64, 24, 0, 8, 144, 0},
    /* 0.3 (libactivekv.so.0.3), x86-64 */
    {0, 3, 136, 576, 224, 156, 120, 72, 24, 88, 8, 160, 64},
};

static void test_filled_structs_keep_their_size_within_the_soname(void **state) {
  const filled_sizes now = {AKV_VERSION_MAJOR,
                            AKV_VERSION_MINOR,
                            sizeof(akv_engine_config),
                            sizeof(akv_fit_report),
                            sizeof(akv_engine_info),
                            sizeof(akv_quarantine_report),
                            sizeof(akv_view),
                            sizeof(akv_receipt),
                            sizeof(akv_adm_decision),
                            sizeof(akv_headroom_info),
                            sizeof(akv_fence),
                            sizeof(akv_attention_args),
                            sizeof(akv_group_info)};
  const filled_sizes *row = NULL;
  (void)state;
  if (sizeof(void *) != 8) skip(); /* the table is for LP64 */
  for (size_t i = 0; i < sizeof released / sizeof released[0]; i++)
    if (released[i].major == now.major && released[i].minor == now.minor) row = &released[i];
  if (row == NULL) {
    fprintf(stderr, "no sizes recorded for soname %u.%u: add a row to `released`\n", now.major,
            now.minor);
    fail();
  }
  /* Field by field, so that a failure names the struct. */
  assert_int_equal(now.engine_config, row->engine_config);
  assert_int_equal(now.fit_report, row->fit_report);
  assert_int_equal(now.engine_info, row->engine_info);
  assert_int_equal(now.quarantine_report, row->quarantine_report);
  assert_int_equal(now.view, row->view);
  assert_int_equal(now.receipt, row->receipt);
  assert_int_equal(now.adm_decision, row->adm_decision);
  assert_int_equal(now.headroom_info, row->headroom_info);
  assert_int_equal(now.fence, row->fence);
  assert_int_equal(now.attention_args, row->attention_args);
  assert_int_equal(now.group_info, row->group_info);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_filled_structs_keep_their_size_within_the_soname),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
