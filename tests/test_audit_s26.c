/*
 * test_audit_s26.c - hostile call sequences against the public C API that
 * the other audit suites leave out: a host function that destroys or
 * synchronises its own stream; handles of another engine, of a destroyed
 * engine and of retired leases in every lease call; write-backs with
 * partial, duplicate and foreign owner lists and seals with fences of
 * another lease or engine; contexts appended, read and closed across a step;
 * the attention hook and the log callback calling back into the engine;
 * explanations into one- and two-byte buffers; argument values at UINT32_MAX
 * and SIZE_MAX; FP8 rows through a whole step; and every call after a
 * quarantine. Each test checks the exact status and that nothing changed:
 * lengths, rows read back, and the counters of akv_engine_info.
 */
#define _POSIX_C_SOURCE 200809L /* nanosleep */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include <cmocka.h>

#include "akv.h"
#include "testutil.h"

#define LAYERS 3
#define ROW_BYTES 32 /* akvt_small_config: 2 kv heads x 8 dims x bf16 */

/* ---------------------------------------------------------------- helpers */

static uint8_t pat(uint32_t tag, uint32_t layer, uint32_t token, int kv, uint32_t j) {
  uint32_t h = (tag + 1) * 2654435761u ^ (layer + 3) * 40503u ^ (token + 11) * 2246822519u ^
               (uint32_t)(kv + 1) * 3266489917u ^ (j + 5) * 668265263u;
  h ^= h >> 15;
  h *= 2246822519u;
  h ^= h >> 13;
  return (uint8_t)(h % 255u + 1u);
}

/* Appends rows [first, first + n) (n <= 64) of every layer, tagged `tag`. */
static akv_status append_tag(akv_context *c, uint64_t row_bytes, uint32_t tag, uint32_t first,
                             uint32_t n) {
  static uint8_t k[LAYERS][64 * 64], v[LAYERS][64 * 64];
  const void *kr[LAYERS], *vr[LAYERS];
  assert_true(n * row_bytes <= sizeof k[0]);
  for (uint32_t l = 0; l < LAYERS; l++) {
    for (uint32_t t = 0; t < n; t++)
      for (uint32_t j = 0; j < row_bytes; j++) {
        k[l][t * row_bytes + j] = pat(tag, l, first + t, 0, j);
        v[l][t * row_bytes + j] = pat(tag, l, first + t, 1, j);
      }
    kr[l] = k[l];
    vr[l] = v[l];
  }
  return akv_context_append(c, n, kr, vr);
}

/* Rows [0, len) of every layer read back are the tagged ones. */
static void expect_tag(akv_context *c, uint64_t row_bytes, uint32_t tag, uint32_t len) {
  uint8_t k[64], v[64];
  uint32_t got = UINT32_MAX;
  assert_int_equal(akv_context_length(c, &got), AKV_OK);
  assert_int_equal(got, len);
  for (uint32_t l = 0; l < LAYERS; l++)
    for (uint32_t t = 0; t < len; t++) {
      assert_int_equal(akv_context_read(c, l, t, 1, k, v), AKV_OK);
      for (uint32_t j = 0; j < row_bytes; j++)
        if (k[j] != pat(tag, l, t, 0, j) || v[j] != pat(tag, l, t, 1, j))
          fail_msg("layer %u row %u byte %u of tag %u differs", l, t, j, tag);
    }
}

static akv_engine_info info_of(akv_engine *e) {
  akv_engine_info i;
  assert_int_equal(akv_engine_info_get(e, &i), AKV_OK);
  return i;
}

/* The counters a refused call must leave alone. */
static void expect_same_counters(const akv_engine_info *a, const akv_engine_info *b) {
  assert_int_equal(a->steps, b->steps);
  assert_int_equal(a->leases_retired, b->leases_retired);
  assert_int_equal(a->bytes_h2d, b->bytes_h2d);
  assert_int_equal(a->bytes_d2h, b->bytes_d2h);
  assert_int_equal(a->bytes_d2d, b->bytes_d2d);
  assert_int_equal(a->copies_h2d, b->copies_h2d);
  assert_int_equal(a->copies_d2h, b->copies_d2h);
  assert_int_equal(a->transport_failed, b->transport_failed);
  assert_int_equal(a->quarantined, b->quarantined);
  assert_memory_equal(a->backend_ops, b->backend_ops, sizeof a->backend_ops);
}

/* An engine of the small geometry with one stream and n contexts of `len`
 * tagged rows (tag = index). */
typedef struct fx {
  akv_engine *e;
  akv_stream s;
  akv_context *c[4];
  uint32_t n;
} fx;

static void fx_open(fx *f, akv_route route, uint32_t pool_gib, uint32_t n, uint32_t len) {
  memset(f, 0, sizeof(*f));
  f->e = akvt_small_engine(route, pool_gib);
  assert_non_null(f->e);
  assert_int_equal(akv_stream_create(f->e, &f->s), AKV_OK);
  f->n = n;
  for (uint32_t i = 0; i < n; i++) {
    assert_int_equal(akv_context_open(f->e, NULL, &f->c[i]), AKV_OK);
    assert_int_equal(append_tag(f->c[i], ROW_BYTES, i, 0, len), AKV_OK);
  }
}

static void fx_close(fx *f) {
  assert_int_equal(akv_stream_destroy(f->e, f->s), AKV_OK);
  assert_int_equal(akv_engine_destroy(f->e), AKV_OK);
}

/* ------------------------------------------- a host function on its stream */

typedef struct self_call {
  akv_engine *e;
  akv_stream s;
  akv_status destroy, sync, create;
  akv_stream created;
} self_call;

/* Waits (up to 10 s) for a worker to store its status, without a library
 * call: one in progress would refuse the worker's as another thread's. */
static void poll_status(volatile akv_status *st) {
  for (int i = 0; i < 100000 && __atomic_load_n(st, __ATOMIC_ACQUIRE) == AKV_STATUS_COUNT_; i++) {
    struct timespec ts = {0, 100000};
    nanosleep(&ts, NULL);
  }
}

static void destroy_own_stream(void *arg) {
  self_call *sc = arg;
  __atomic_store_n(&sc->destroy, akv_stream_destroy(sc->e, sc->s), __ATOMIC_RELEASE);
}

static void create_from_worker(void *arg) {
  self_call *sc = arg;
  akv_stream made = NULL;
  const akv_status st = akv_stream_create(sc->e, &made);
  sc->created = made;
  __atomic_store_n(&sc->create, st, __ATOMIC_RELEASE);
}

/** A function enqueued on a stream that destroys that very stream (no call
 *  in progress on the engine, so it is not refused as another thread's):
 *  the stream's worker cannot drain and join itself. The destroy is refused
 *  with AKV_ERR_IN_USE and changes nothing: the stream stays live and
 *  usable, and the caller destroys it afterwards. */
static void test_host_fn_destroys_its_own_stream(void **state) {
  (void)state;
  akv_engine *e = akvt_small_engine(AKV_ROUTE_STAGE, 0);
  akv_stream s = NULL;
  self_call sc = {0};
  assert_non_null(e);
  assert_int_equal(akv_stream_create(e, &s), AKV_OK);
  sc.e = e;
  sc.s = s;
  sc.destroy = AKV_STATUS_COUNT_;
  assert_int_equal(akv_stream_launch_host(e, s, destroy_own_stream, &sc), AKV_OK);
  /* Not synchronised through the library (that call would hold the claim
   * and the function would be refused as another thread's): poll. */
  poll_status(&sc.destroy);
  assert_int_equal(sc.destroy, AKV_ERR_IN_USE);
  const akv_engine_info after = info_of(e);
  assert_int_equal(after.transport_failed, 0);
  /* Still live and usable. */
  assert_int_equal(akv_stream_synchronize(e, s), AKV_OK);
  sc.create = AKV_STATUS_COUNT_;
  assert_int_equal(akv_stream_launch_host(e, s, create_from_worker, &sc), AKV_OK);
  poll_status(&sc.create);
  assert_int_equal(sc.create, AKV_OK);
  assert_int_equal(akv_stream_destroy(e, sc.created), AKV_OK);
  assert_int_equal(akv_stream_destroy(e, s), AKV_OK);
  assert_int_equal(akv_stream_destroy(e, s), AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_engine_destroy(e), AKV_OK);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_host_fn_destroys_its_own_stream),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
