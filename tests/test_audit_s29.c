/*
 * test_audit_s29.c - a promise audit of akv.h for the headroom route, the
 * paged route, FP8 rows and quarantine. Each test names the promise it
 * checks and fails while the library breaks it.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "akv.h"
#include "testutil.h"

/* Byte j of the K (kv 0) or V (kv 1) row `token` of layer `layer` of the
 * context tagged `tag`: never 0, so an unwritten row never matches. */
static uint8_t row_byte(uint32_t tag, uint32_t layer, uint32_t token, int kv, uint32_t j) {
  uint32_t h = tag * 2654435761u ^ (layer + 1) * 40503u ^ (token + 7) * 2246822519u ^
               (uint32_t)kv * 3266489917u ^ j * 668265263u;
  h ^= h >> 15;
  h *= 2246822519u;
  h ^= h >> 13;
  return (uint8_t)(h % 255u + 1u);
}

#define MAX_LAYERS 4
#define MAX_ROWS 64
#define MAX_ROW_BYTES 64

/* Appends rows [0, n) of every layer of a context tagged `tag`. */
static akv_status append_tagged(akv_context *c, uint32_t layers, uint64_t row_bytes, uint32_t tag,
                                uint32_t n) {
  static uint8_t k[MAX_LAYERS][MAX_ROWS * MAX_ROW_BYTES], v[MAX_LAYERS][MAX_ROWS * MAX_ROW_BYTES];
  const void *kr[MAX_LAYERS], *vr[MAX_LAYERS];
  assert_true(layers <= MAX_LAYERS && n <= MAX_ROWS && row_bytes <= MAX_ROW_BYTES);
  for (uint32_t l = 0; l < layers; l++) {
    for (uint32_t t = 0; t < n; t++)
      for (uint64_t j = 0; j < row_bytes; j++) {
        k[l][t * row_bytes + j] = row_byte(tag, l, t, 0, (uint32_t)j);
        v[l][t * row_bytes + j] = row_byte(tag, l, t, 1, (uint32_t)j);
      }
    kr[l] = k[l];
    vr[l] = v[l];
  }
  return akv_context_append(c, n, kr, vr);
}

/* Reads rows [0, n) of every layer and compares them with the tagged ones;
 * returns the status of the first read that failed, else AKV_OK. */
static akv_status read_tagged(const akv_context *c, uint32_t layers, uint64_t row_bytes,
                              uint32_t tag, uint32_t n) {
  static uint8_t k[MAX_ROWS * MAX_ROW_BYTES], v[MAX_ROWS * MAX_ROW_BYTES];
  for (uint32_t l = 0; l < layers; l++) {
    akv_status st = akv_context_read(c, l, 0, n, k, v);
    if (st != AKV_OK) return st;
    for (uint32_t t = 0; t < n; t++)
      for (uint64_t j = 0; j < row_bytes; j++)
        if (k[t * row_bytes + j] != row_byte(tag, l, t, 0, (uint32_t)j) ||
            v[t * row_bytes + j] != row_byte(tag, l, t, 1, (uint32_t)j))
          fail_msg("layer %u row %u of the context tagged %u differs", l, t, tag);
  }
  return AKV_OK;
}

/* ------------------------------------ context_read after a failed boundary */

/* akv.h, akv_context_read: "Allowed while no lease of an open step can write
 * them (outside a step, or for a context not in the step). Also allowed
 * after a transport failure." A step_begin whose page fills (or, on the
 * paged route, whose page map) could not be submitted opens no step and
 * begins no lease: the fills only read the host rows. The read was refused
 * with AKV_ERR_IN_USE ("part of the open step", with no step open) until a
 * quarantine, and for good after an uncertain one, because the fills' host
 * page leases were taken for writers. */
static void failed_boundary_case(akv_route route, akv_dtype dtype, uint32_t fail_nth) {
  akv_engine_config ec = akvt_small_config(route, 1);
  akv_engine *e = NULL;
  akv_engine_info info;
  akv_context *c[2] = {NULL, NULL};
  const uint32_t tags[2] = {71, 72}, rows = 20; /* two full pages of 8 */
  ec.dtype = dtype;
  ec.fault_kind = AKV_OP_COPY;
  ec.fault_fail_nth = fail_nth;
  assert_int_equal(akv_engine_create(&ec, &e), AKV_OK);
  assert_int_equal(akv_engine_info_get(e, &info), AKV_OK);
  for (int i = 0; i < 2; i++) {
    assert_int_equal(akv_context_open(e, NULL, &c[i]), AKV_OK);
    assert_int_equal(append_tagged(c[i], 3, info.row_bytes, tags[i], rows), AKV_OK);
  }
  /* The boundary's fills (copy 1) or its page map (copy 2) fail. */
  assert_int_equal(akv_step_begin(e, c, 2), AKV_ERR_BACKEND);
  assert_int_equal(akv_engine_info_get(e, &info), AKV_OK);
  assert_int_equal(info.transport_failed, 1);
  /* No step is open and no lease can write the rows: the reads are taken. */
  for (int i = 0; i < 2; i++)
    assert_int_equal(read_tagged(c[i], 3, info.row_bytes, tags[i], rows), AKV_OK);
  assert_int_equal(akv_engine_quarantine(e, NULL), AKV_OK);
  for (int i = 0; i < 2; i++)
    assert_int_equal(read_tagged(c[i], 3, info.row_bytes, tags[i], rows), AKV_OK);
  assert_int_equal(akv_engine_destroy(e), AKV_OK);
}

static void test_read_after_a_boundary_that_failed(void **state) {
  (void)state;
  failed_boundary_case(AKV_ROUTE_ARENA, AKV_DTYPE_BF16, 1);
  failed_boundary_case(AKV_ROUTE_ARENA, AKV_DTYPE_FP8_E4M3, 1);
  failed_boundary_case(AKV_ROUTE_PAGED, AKV_DTYPE_FP8_E5M2, 1); /* the fills */
  failed_boundary_case(AKV_ROUTE_PAGED, AKV_DTYPE_BF16, 2);     /* the page map */
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_read_after_a_boundary_that_failed),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
