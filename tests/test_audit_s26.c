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
#include <stdlib.h>
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
  static uint8_t k[LAYERS][64 * 320], v[LAYERS][64 * 320];
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
  int go; /* set once akv_stream_launch_host returned (wait_go) */
} self_call;

/* Waits (up to 10 s) for a worker to store its status, without a library
 * call: one in progress would refuse the worker's as another thread's. */
static void poll_status(volatile akv_status *st) {
  for (int i = 0; i < 100000 && __atomic_load_n(st, __ATOMIC_ACQUIRE) == AKV_STATUS_COUNT_; i++) {
    struct timespec ts = {0, 100000};
    nanosleep(&ts, NULL);
  }
}

/* The worker may run the function before akv_stream_launch_host has let go
 * of the engine, and a call then would be refused as another thread's: the
 * function waits (up to 10 s) until the caller says the launch returned. */
static void wait_go(self_call *sc) {
  for (int i = 0; i < 100000 && !__atomic_load_n(&sc->go, __ATOMIC_ACQUIRE); i++) {
    struct timespec ts = {0, 100000};
    nanosleep(&ts, NULL);
  }
}

static void launch_and_go(self_call *sc, void (*fn)(void *)) {
  __atomic_store_n(&sc->go, 0, __ATOMIC_RELEASE);
  assert_int_equal(akv_stream_launch_host(sc->e, sc->s, fn, sc), AKV_OK);
  __atomic_store_n(&sc->go, 1, __ATOMIC_RELEASE);
}

static void destroy_own_stream(void *arg) {
  self_call *sc = arg;
  wait_go(sc);
  __atomic_store_n(&sc->destroy, akv_stream_destroy(sc->e, sc->s), __ATOMIC_RELEASE);
}

static void sync_own_stream(void *arg) {
  self_call *sc = arg;
  wait_go(sc);
  __atomic_store_n(&sc->sync, akv_stream_synchronize(sc->e, sc->s), __ATOMIC_RELEASE);
}

static void create_from_worker(void *arg) {
  self_call *sc = arg;
  akv_stream made = NULL;
  wait_go(sc);
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
  launch_and_go(&sc, destroy_own_stream);
  /* Not synchronised through the library (that call would hold the claim
   * and the function would be refused as another thread's): poll. */
  poll_status(&sc.destroy);
  assert_int_equal(sc.destroy, AKV_ERR_IN_USE);
  const akv_engine_info after = info_of(e);
  assert_int_equal(after.transport_failed, 0);
  /* Still live and usable. */
  assert_int_equal(akv_stream_synchronize(e, s), AKV_OK);
  /* A function that synchronises its own stream would wait for itself
   * until the sync timeout and fail the transport: refused at once. */
  sc.sync = AKV_STATUS_COUNT_;
  launch_and_go(&sc, sync_own_stream);
  poll_status(&sc.sync);
  assert_int_equal(sc.sync, AKV_ERR_IN_USE);
  assert_int_equal(info_of(e).transport_failed, 0);
  assert_int_equal(akv_stream_synchronize(e, s), AKV_OK);
  sc.create = AKV_STATUS_COUNT_;
  launch_and_go(&sc, create_from_worker);
  poll_status(&sc.create);
  assert_int_equal(sc.create, AKV_OK);
  assert_int_equal(akv_stream_destroy(e, sc.created), AKV_OK);
  assert_int_equal(akv_stream_destroy(e, s), AKV_OK);
  assert_int_equal(akv_stream_destroy(e, s), AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_engine_destroy(e), AKV_OK);
}

/* ------------------------------------------ owners, fences, stale handles */

static int noop_hook(void *user, const akv_view *view, akv_stream stream) {
  (void)user, (void)view, (void)stream;
  return 0;
}

/** Write-backs with owner lists that are foreign (another engine's
 *  context), NULL, duplicated, too long or inconsistent; seals before every
 *  owner was written, with a superseded tail, with another engine's fences;
 *  then every lease call with the retired handle. Each refusal leaves the
 *  lease and the engine's counters as they were. */
static void test_owners_fences_and_stale_lease(void **state) {
  (void)state;
  fx a, b;
  fx_open(&a, AKV_ROUTE_STAGE, 0, 2, 5);
  fx_open(&b, AKV_ROUTE_STAGE, 0, 1, 3);
  akv_lease *la = NULL, *lb = NULL;
  akv_fence attn, tail1, tail2, battn, btail, f = {0};
  akv_view view;
  assert_int_equal(akv_step_begin(a.e, a.c, 2), AKV_OK);
  assert_int_equal(akv_step_begin(b.e, b.c, 1), AKV_OK);
  assert_int_equal(akv_lease_begin(b.e, 0, &lb), AKV_OK);
  assert_int_equal(akv_lease_attend(lb, b.s, noop_hook, NULL, &battn), AKV_OK);
  assert_int_equal(akv_lease_write_back(lb, NULL, 0, &btail), AKV_OK);
  assert_int_equal(akv_lease_begin(a.e, 0, &la), AKV_OK);
  /* Another engine's stream and lease. */
  assert_int_equal(akv_lease_wait_ready(la, b.s, &view), AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_lease_attend(la, b.s, noop_hook, NULL, &attn), AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_lease_write_back(la, NULL, 0, &f), AKV_ERR_LEASE_STATE);
  assert_int_equal(akv_lease_seal(la, btail, battn), AKV_ERR_LEASE_STATE);
  assert_int_equal(akv_lease_attend(la, a.s, noop_hook, NULL, &attn), AKV_OK);
  assert_int_equal(akv_lease_mark_consumed(la, a.s, &f), AKV_ERR_LEASE_STATE);
  const akv_engine_info before = info_of(a.e);
  akv_context *foreign[1] = {b.c[0]};
  akv_context *null_owner[1] = {NULL};
  akv_context *dup[2] = {a.c[1], a.c[1]};
  akv_context *three[3] = {a.c[0], a.c[1], a.c[0]};
  f.serial = 77;
  assert_int_equal(akv_lease_write_back(la, foreign, 1, &f), AKV_ERR_OWNER_MISMATCH);
  assert_int_equal(akv_lease_write_back(la, null_owner, 1, &f), AKV_ERR_BAD_HANDLE);
  assert_int_equal(akv_lease_write_back(la, dup, 2, &f), AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_lease_write_back(la, three, 3, &f), AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_lease_write_back(la, a.c, 0, &f), AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_lease_write_back(la, NULL, 1, &f), AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_lease_write_back(la, a.c, 1, NULL), AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(f.serial, 77);
  akv_engine_info now = info_of(a.e);
  expect_same_counters(&before, &now);
  /* One owner, then the seal and the all-owners form refuse. */
  akv_context *first[1] = {a.c[0]}, *second[1] = {a.c[1]};
  assert_int_equal(akv_lease_write_back(la, first, 1, &tail1), AKV_OK);
  assert_int_equal(akv_lease_seal(la, tail1, attn), AKV_ERR_LEASE_STATE);
  assert_int_equal(akv_lease_write_back(la, NULL, 0, &f), AKV_ERR_LEASE_STATE);
  assert_int_equal(akv_lease_write_back(la, first, 1, &f), AKV_ERR_LEASE_STATE);
  assert_int_equal(akv_lease_write_back(la, a.c, 2, &f), AKV_ERR_LEASE_STATE);
  assert_int_equal(f.serial, 77);
  assert_int_equal(akv_lease_write_back(la, second, 1, &tail2), AKV_OK);
  assert_true(tail2.serial != tail1.serial);
  /* Superseded tail, the other lease's fences, swapped fences. */
  assert_int_equal(akv_lease_seal(la, tail1, attn), AKV_ERR_FENCE_MISMATCH);
  assert_int_equal(akv_lease_seal(la, btail, battn), AKV_ERR_FENCE_MISMATCH);
  assert_int_equal(akv_lease_seal(la, attn, tail2), AKV_ERR_FENCE_MISMATCH);
  assert_int_equal(akv_lease_seal(lb, tail2, attn), AKV_ERR_FENCE_MISMATCH);
  assert_int_equal(akv_lease_retire(la, NULL), AKV_ERR_LEASE_STATE);
  assert_int_equal(akv_lease_try_retire(la, NULL), AKV_ERR_LEASE_STATE);
  assert_int_equal(akv_lease_seal(la, tail2, attn), AKV_OK);
  assert_int_equal(akv_lease_seal(la, tail2, attn), AKV_ERR_LEASE_STATE);
  assert_int_equal(akv_lease_write_back(la, NULL, 0, &f), AKV_ERR_LEASE_STATE);
  akv_receipt r, r2;
  memset(&r, 0, sizeof r);
  assert_int_equal(akv_lease_retire(la, &r), AKV_OK);
  assert_int_equal(r.layer, 0);
  assert_int_equal(r.tail.serial, tail2.serial);
  assert_int_equal(r.attention.serial, attn.serial);
  assert_int_equal(r.bytes_d2h, 2 * 2 * ROW_BYTES);
  /* The dead handle, in every lease call. */
  memset(&r2, 0xA5, sizeof r2);
  const akv_engine_info retired = info_of(a.e);
  assert_int_equal(akv_lease_retire(la, &r2), AKV_ERR_BAD_HANDLE);
  assert_int_equal(akv_lease_try_retire(la, &r2), AKV_ERR_BAD_HANDLE);
  assert_int_equal(akv_lease_seal(la, tail2, attn), AKV_ERR_BAD_HANDLE);
  assert_int_equal(akv_lease_write_back(la, NULL, 0, &f), AKV_ERR_BAD_HANDLE);
  assert_int_equal(akv_lease_wait_ready(la, a.s, &view), AKV_ERR_BAD_HANDLE);
  assert_int_equal(akv_lease_mark_consumed(la, a.s, &f), AKV_ERR_BAD_HANDLE);
  assert_int_equal(akv_lease_attend(la, a.s, noop_hook, NULL, &f), AKV_ERR_BAD_HANDLE);
  assert_int_equal(r2.layer, 0xA5A5A5A5u);
  now = info_of(a.e);
  expect_same_counters(&retired, &now);
  /* The next layer's lease is a new handle; the dead one stays dead. */
  akv_lease *la1 = NULL;
  assert_int_equal(akv_lease_begin(a.e, 1, &la1), AKV_OK);
  assert_ptr_not_equal(la1, la);
  assert_int_equal(akv_lease_retire(la, NULL), AKV_ERR_BAD_HANDLE);
  assert_int_equal(akvt_lease_through(la1, a.s), AKV_OK);
  assert_int_equal(akvt_null_layers_from(a.e, a.s, 2, LAYERS), AKV_OK);
  assert_int_equal(akv_lease_seal(lb, btail, battn), AKV_OK);
  assert_int_equal(akv_lease_try_retire(la, NULL), AKV_ERR_BAD_HANDLE);
  assert_int_equal(akv_lease_retire(lb, NULL), AKV_OK);
  assert_int_equal(akvt_null_layers_from(b.e, b.s, 1, LAYERS), AKV_OK);
  uint32_t len = 0;
  assert_int_equal(akv_context_length(a.c[0], &len), AKV_OK);
  assert_int_equal(len, 6);
  assert_int_equal(akv_context_length(b.c[0], &len), AKV_OK);
  assert_int_equal(len, 4);
  fx_close(&a);
  fx_close(&b);
}

/* --------------------------------------------------- contexts across a step */

/** During a step, a context of the step refuses appends, reads and its
 *  close (AKV_ERR_IN_USE) and keeps its rows; a context outside the step is
 *  appended, read and closed; opens refuse. After the step both hold what
 *  they should. */
static void test_contexts_across_a_step(void **state) {
  (void)state;
  fx a;
  fx_open(&a, AKV_ROUTE_ARENA, 1, 3, 9);
  uint8_t k[ROW_BYTES], v[ROW_BYTES];
  akv_context *in[1] = {a.c[0]};
  akv_context *extra = NULL;
  assert_int_equal(akv_step_begin(a.e, in, 1), AKV_OK);
  const akv_engine_info before = info_of(a.e);
  assert_int_equal(append_tag(a.c[0], ROW_BYTES, 0, 9, 1), AKV_ERR_IN_USE);
  assert_int_equal(akv_context_append_layer(a.c[0], 1, 1, k, v), AKV_ERR_IN_USE);
  assert_int_equal(akv_context_read(a.c[0], 0, 0, 1, k, v), AKV_ERR_IN_USE);
  assert_int_equal(akv_context_close(a.c[0]), AKV_ERR_IN_USE);
  assert_int_equal(akv_context_open(a.e, NULL, &extra), AKV_ERR_STEP_STATE);
  assert_null(extra);
  /* The step's contexts listed again, and a context twice. */
  akv_context *twice[2] = {a.c[1], a.c[1]};
  assert_int_equal(akv_step_begin(a.e, twice, 2), AKV_ERR_STEP_STATE);
  akv_engine_info now = info_of(a.e);
  expect_same_counters(&before, &now);
  /* Outside the step: appended, read, closed. */
  assert_int_equal(append_tag(a.c[1], ROW_BYTES, 1, 9, 2), AKV_OK);
  expect_tag(a.c[1], ROW_BYTES, 1, 11);
  assert_int_equal(akv_context_close(a.c[2]), AKV_OK);
  assert_int_equal(akv_context_close(a.c[2]), AKV_ERR_BAD_HANDLE);
  akv_lease *ls = NULL;
  assert_int_equal(akv_lease_begin(a.e, 0, &ls), AKV_OK);
  /* With a lease holding tickets on it. */
  assert_int_equal(akv_context_close(a.c[0]), AKV_ERR_IN_USE);
  assert_int_equal(akv_context_read(a.c[0], 2, 8, 1, k, v), AKV_ERR_IN_USE);
  assert_int_equal(akv_context_append(a.c[1], 1, NULL, NULL), AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akvt_lease_through(ls, a.s), AKV_OK);
  assert_int_equal(akv_context_close(a.c[0]), AKV_ERR_IN_USE);
  assert_int_equal(akvt_null_layers_from(a.e, a.s, 1, LAYERS), AKV_OK);
  uint32_t len = 0;
  assert_int_equal(akv_context_length(a.c[0], &len), AKV_OK);
  assert_int_equal(len, 10);
  /* The rows before the step's own are still the prefilled ones. */
  for (uint32_t l = 0; l < LAYERS; l++)
    for (uint32_t t = 0; t < 9; t++) {
      assert_int_equal(akv_context_read(a.c[0], l, t, 1, k, v), AKV_OK);
      for (uint32_t j = 0; j < ROW_BYTES; j++)
        assert_true(k[j] == pat(0, l, t, 0, j) && v[j] == pat(0, l, t, 1, j));
    }
  expect_tag(a.c[1], ROW_BYTES, 1, 11);
  assert_int_equal(akv_context_close(a.c[0]), AKV_OK);
  assert_int_equal(akv_context_close(a.c[1]), AKV_OK);
  fx_close(&a);
}

/* ------------------------------------------------------ the attention hook */

typedef struct reentry {
  fx *f;
  akv_lease *self;
  uint32_t layer;
  int finish_all; /* run the lease and the step to their end and destroy */
  akv_status st[16];
} reentry;

static int reentering_hook(void *user, const akv_view *view, akv_stream stream) {
  reentry *r = user;
  akv_fence f = {0}, t = {0};
  akv_lease *next = NULL;
  akv_context *extra = NULL;
  uint64_t taken = 0;
  akv_view v2;
  fx *x = r->f;
  if (!r->finish_all) {
    r->st[0] = akv_stream_destroy(x->e, stream);
    r->st[1] = akv_context_close(view->contexts[0]);
    r->st[2] = akv_engine_destroy(x->e);
    r->st[3] = akv_lease_begin(x->e, r->layer + 1, &next);
    r->st[4] = akv_lease_attend(r->self, stream, noop_hook, NULL, &f);
    r->st[5] = akv_step_end(x->e);
    r->st[6] = akv_step_begin(x->e, x->c, 1);
    r->st[7] = akv_context_open(x->e, NULL, &extra);
    r->st[8] = akv_headroom_take(x->e, 1, &taken);
    r->st[9] = akv_lease_wait_ready(r->self, stream, &v2);
    r->st[10] = akv_lease_seal(r->self, f, f);
    r->st[11] = akv_context_append(view->contexts[0], 0, (const void *const *)&view->base,
                                   (const void *const *)&view->base);
    return next != NULL || extra != NULL || taken != 0;
  }
  /* The whole rest of the lease, the step, the stream and the engine. */
  r->st[0] = akv_lease_mark_consumed(r->self, stream, &f);
  r->st[1] = akv_lease_write_back(r->self, NULL, 0, &t);
  r->st[2] = akv_lease_seal(r->self, t, f);
  r->st[3] = akv_lease_retire(r->self, NULL);
  r->st[4] = akv_step_end(x->e);
  r->st[5] = akv_stream_destroy(x->e, stream);
  r->st[6] = akv_context_close(x->c[0]);
  r->st[7] = akv_engine_destroy(x->e);
  return 1; /* nonzero: must not fail anything, the lease is gone */
}

/** The hook calls back every call that must refuse while its lease is
 *  being attended (exact statuses, nothing changed), then, on the last
 *  layer, runs its lease and the step to the end and destroys the stream
 *  and the engine: attend answers AKV_ERR_BAD_HANDLE and touches nothing
 *  (ASan: no use after free, no leak). */
static void test_hook_reenters_and_destroys(void **state) {
  (void)state;
  fx a;
  fx_open(&a, AKV_ROUTE_STAGE, 0, 1, 4);
  reentry r;
  memset(&r, 0, sizeof r);
  r.f = &a;
  akv_fence attn;
  assert_int_equal(akv_step_begin(a.e, a.c, 1), AKV_OK);
  for (uint32_t l = 0; l + 1 < LAYERS; l++) {
    akv_lease *ls = NULL;
    assert_int_equal(akv_lease_begin(a.e, l, &ls), AKV_OK);
    r.self = ls;
    r.layer = l;
    const akv_engine_info before = info_of(a.e);
    assert_int_equal(akv_lease_attend(ls, a.s, reentering_hook, &r, &attn), AKV_OK);
    assert_int_equal(r.st[0], AKV_ERR_IN_USE);
    assert_int_equal(r.st[1], AKV_ERR_IN_USE);
    assert_int_equal(r.st[2], AKV_ERR_BUSY);
    assert_int_equal(r.st[3], AKV_ERR_LEASE_ORDER);
    assert_int_equal(r.st[4], AKV_ERR_LEASE_STATE);
    assert_int_equal(r.st[5], AKV_ERR_STEP_STATE);
    assert_int_equal(r.st[6], AKV_ERR_STEP_STATE);
    assert_int_equal(r.st[7], AKV_ERR_STEP_STATE);
    assert_int_equal(r.st[8], AKV_ERR_NOT_SUPPORTED);
    assert_int_equal(r.st[9], AKV_ERR_LEASE_STATE);
    assert_int_equal(r.st[10], AKV_ERR_LEASE_STATE);
    assert_int_equal(r.st[11], AKV_ERR_IN_USE);
    const akv_engine_info after = info_of(a.e);
    assert_int_equal(after.transport_failed, 0);
    assert_int_equal(after.leases_retired, before.leases_retired);
    akv_fence tail;
    assert_int_equal(akv_lease_write_back(ls, NULL, 0, &tail), AKV_OK);
    assert_int_equal(akv_lease_seal(ls, tail, attn), AKV_OK);
    assert_int_equal(akv_lease_retire(ls, NULL), AKV_OK);
  }
  akv_lease *last = NULL;
  assert_int_equal(akv_lease_begin(a.e, LAYERS - 1, &last), AKV_OK);
  memset(&r.st, 0xff, sizeof r.st);
  r.self = last;
  r.finish_all = 1;
  attn.serial = 99;
  assert_int_equal(akv_lease_attend(last, a.s, reentering_hook, &r, &attn), AKV_ERR_BAD_HANDLE);
  assert_int_equal(attn.serial, 99);
  for (int i = 0; i < 8; i++) assert_int_equal(r.st[i], AKV_OK);
  assert_int_equal(akv_lease_retire(last, NULL), AKV_ERR_BAD_HANDLE);
  assert_int_equal(akv_context_close(a.c[0]), AKV_ERR_BAD_HANDLE);
  assert_int_equal(akv_engine_destroy(a.e), AKV_ERR_BAD_HANDLE);
  assert_int_equal(akv_stream_destroy(a.e, a.s), AKV_ERR_BAD_HANDLE);
  assert_string_equal(akv_engine_last_error(a.e), "bad engine handle");
}

/* ------------------------------------------------------- the log callback */

typedef struct log_probe {
  akv_engine *e;
  akv_context *c;
  akv_stream s;
  int armed, calls;
  akv_status st[12];
  char last_error[256];
  uint32_t len;
} log_probe;

static void probing_log(void *user, akv_log_level level, const char *message) {
  log_probe *p = user;
  (void)level, (void)message;
  if (!p->armed) return;
  p->armed = 0;
  p->calls++;
  uint8_t k[ROW_BYTES], v[ROW_BYTES];
  const void *rows[LAYERS] = {k, k, k};
  akv_stream s2 = NULL;
  akv_context *c2 = NULL;
  memset(k, 1, sizeof k);
  memset(v, 1, sizeof v);
  p->st[0] = akv_context_append(p->c, 1, rows, rows);
  p->st[1] = akv_context_append_layer(p->c, 0, 1, k, v);
  p->st[2] = akv_context_close(p->c);
  p->st[3] = akv_step_begin(p->e, &p->c, 1);
  p->st[4] = akv_stream_create(p->e, &s2);
  p->st[5] = akv_stream_destroy(p->e, p->s);
  p->st[6] = akv_engine_destroy(p->e);
  p->st[7] = akv_engine_quarantine(p->e, NULL);
  p->st[8] = akv_context_open(p->e, NULL, &c2);
  p->st[9] = akv_context_read(p->c, 0, 0, 1, k, v);
  p->st[10] = akv_context_length(p->c, &p->len);
  p->st[11] = akv_stream_launch_host(p->e, p->s, (void (*)(void *))abort, NULL);
  snprintf(p->last_error, sizeof p->last_error, "%s", akv_engine_last_error(p->e));
}

/** A failing call logs (DEBUG); its log callback calls every changing call
 *  back (each AKV_ERR_IN_USE, nothing changed) and the diagnostics (they
 *  answer). The last error stays the logged one. */
static void test_log_callback_reentry(void **state) {
  (void)state;
  log_probe p;
  memset(&p, 0, sizeof p);
  akv_engine_config ec = akvt_small_config(AKV_ROUTE_STAGE, 0);
  ec.log_fn = probing_log;
  ec.log_user = &p;
  ec.log_level = AKV_LOG_DEBUG;
  assert_int_equal(akv_engine_create(&ec, &p.e), AKV_OK);
  assert_int_equal(akv_stream_create(p.e, &p.s), AKV_OK);
  assert_int_equal(akv_context_open(p.e, NULL, &p.c), AKV_OK);
  assert_int_equal(append_tag(p.c, ROW_BYTES, 7, 0, 3), AKV_OK);
  const akv_engine_info before = info_of(p.e);
  uint8_t k[ROW_BYTES], v[ROW_BYTES];
  p.armed = 1;
  assert_int_equal(akv_context_read(p.c, LAYERS, 0, 1, k, v), AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(p.calls, 1);
  for (int i = 0; i < 9; i++) assert_int_equal(p.st[i], AKV_ERR_IN_USE);
  assert_int_equal(p.st[9], AKV_OK);
  assert_int_equal(p.st[10], AKV_OK);
  assert_int_equal(p.st[11], AKV_ERR_IN_USE);
  assert_int_equal(p.len, 3);
  assert_non_null(strstr(p.last_error, "context_read"));
  assert_non_null(strstr(akv_engine_last_error(p.e), "context_read"));
  const akv_engine_info after = info_of(p.e);
  expect_same_counters(&before, &after);
  expect_tag(p.c, ROW_BYTES, 7, 3);
  /* Everything still works afterwards. */
  assert_int_equal(akv_step_begin(p.e, &p.c, 1), AKV_OK);
  assert_int_equal(akvt_null_layers(p.e, p.s, LAYERS), AKV_OK);
  assert_int_equal(akv_stream_destroy(p.e, p.s), AKV_OK);
  assert_int_equal(akv_engine_destroy(p.e), AKV_OK);
}

/* ------------------------------------------------------- small buffers */

/** akv_admission_explain into buffers of 1, 2 and 7 bytes, for a context
 *  whose target the floor raised (the explanation's suffix), for the last
 *  refused open of either kind and for no refusal: always NUL-terminated
 *  within cap, never a byte past it. */
static void test_explain_small_buffers(void **state) {
  (void)state;
  akv_engine_config ec = akvt_small_config(AKV_ROUTE_ARENA, 1);
  ec.max_contexts = 2;
  akv_engine *e = NULL;
  akv_context *c[3] = {NULL, NULL, NULL};
  akv_context_config cc = AKV_CONTEXT_CONFIG_INIT;
  assert_int_equal(akv_engine_create(&ec, &e), AKV_OK);
  cc.target_pages = 1; /* raised to 2 */
  assert_int_equal(akv_context_open(e, &cc, &c[0]), AKV_OK);
  const size_t caps[] = {1, 2, 7, 64};
  for (int who = 0; who < 3; who++) {
    if (who == 1) {
      assert_int_equal(akv_context_open(e, NULL, &c[1]), AKV_OK);
      assert_int_equal(akv_context_open(e, NULL, &c[2]), AKV_ERR_REFUSED_QUEUE);
      assert_null(c[2]);
    }
    for (size_t i = 0; i < sizeof caps / sizeof caps[0]; i++) {
      char buf[80];
      memset(buf, 'Z', sizeof buf);
      const akv_context *ctx = who == 0 ? c[0] : NULL;
      assert_int_equal(akv_admission_explain(e, ctx, buf, caps[i]), AKV_OK);
      assert_true(strlen(buf) < caps[i]);
      for (size_t j = caps[i]; j < sizeof buf; j++) assert_int_equal(buf[j], 'Z');
    }
  }
  char one = 'Q';
  assert_int_equal(akv_admission_explain(e, NULL, &one, 0), AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(one, 'Q');
  assert_int_equal(akv_admission_explain(e, NULL, NULL, 5), AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_context_close(c[0]), AKV_OK);
  char buf[16];
  assert_int_equal(akv_admission_explain(e, c[0], buf, sizeof buf), AKV_ERR_BAD_HANDLE);
  assert_int_equal(akv_context_close(c[1]), AKV_OK);
  assert_int_equal(akv_engine_destroy(e), AKV_OK);
}

/* ------------------------------------------------------------ extremes */

/** Counts and indices at UINT32_MAX, SIZE_MAX and one past every bound:
 *  exact statuses, outputs untouched, rows and lengths unchanged. */
static void test_extreme_arguments(void **state) {
  (void)state;
  fx a;
  fx_open(&a, AKV_ROUTE_STAGE, 0, 2, 6);
  uint8_t k[ROW_BYTES], v[ROW_BYTES];
  const void *rows[LAYERS] = {k, k, k};
  akv_lease *ls = (akv_lease *)&k; /* must stay as it is */
  akv_lease *const keep = ls;
  memset(k, 0x5A, sizeof k);
  memset(v, 0x5A, sizeof v);
  const akv_engine_info before = info_of(a.e);
  assert_int_equal(akv_context_read(a.c[0], 0, UINT32_MAX, 1, k, v), AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_context_read(a.c[0], 0, 1, UINT32_MAX, k, v), AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_context_read(a.c[0], 0, 6, 1, k, v), AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_context_read(a.c[0], UINT32_MAX, 0, 1, k, v), AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_context_read(a.c[0], 0, 5, 1, NULL, v), AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_context_read(a.c[0], 0, 6, 0, NULL, NULL), AKV_OK);
  for (size_t j = 0; j < ROW_BYTES; j++) assert_true(k[j] == 0x5A && v[j] == 0x5A);
  assert_int_equal(akv_context_append(a.c[0], UINT32_MAX, rows, rows), AKV_ERR_CAPACITY);
  assert_int_equal(akv_context_append(a.c[0], 64 - 6 + 1, rows, rows), AKV_ERR_CAPACITY);
  assert_int_equal(akv_context_append_layer(a.c[0], UINT32_MAX, 1, k, v),
                   AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_context_append_layer(a.c[0], LAYERS, 0, NULL, NULL),
                   AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_context_append_layer(a.c[0], 2, UINT32_MAX, k, v), AKV_ERR_CAPACITY);
  assert_int_equal(akv_context_append_layer(a.c[0], 2, 1, NULL, v), AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_step_begin(a.e, a.c, UINT32_MAX), AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_step_begin(a.e, a.c, 0), AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_step_begin(a.e, NULL, 1), AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_lease_begin(a.e, UINT32_MAX, &ls), AKV_ERR_STEP_STATE);
  assert_int_equal(akv_step_end(a.e), AKV_ERR_STEP_STATE);
  uint64_t counters[AKV_ADM_RULE_COUNT + 1];
  counters[AKV_ADM_RULE_COUNT] = 0x1234;
  assert_int_equal(akv_admission_counters(a.e, counters, SIZE_MAX), AKV_OK);
  assert_int_equal(counters[AKV_ADM_RULE_COUNT], 0x1234);
  assert_int_equal(akv_admission_counters(a.e, counters, 0), AKV_ERR_INVALID_ARGUMENT);
  static akv_adm_decision log[256];
  size_t n_log = 12345;
  assert_int_equal(akv_admission_log(a.e, NULL, 1, &n_log), AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(n_log, 12345);
  assert_int_equal(akv_admission_log(a.e, NULL, 0, &n_log), AKV_OK);
  assert_int_equal(n_log, 0);
  assert_int_equal(akv_admission_log(a.e, log, SIZE_MAX, &n_log), AKV_OK);
  assert_true(n_log <= 256);
  uint64_t freed = 7, pending = 8, taken = 9;
  assert_int_equal(akv_headroom_release(a.e, UINT64_MAX, &freed, &pending),
                   AKV_ERR_NOT_SUPPORTED);
  assert_int_equal(akv_headroom_take(a.e, UINT64_MAX, &taken), AKV_ERR_NOT_SUPPORTED);
  assert_true(freed == 7 && pending == 8 && taken == 9);
  /* Inside a step: one past the layers, a layer out of order. */
  assert_int_equal(akv_step_begin(a.e, a.c, 2), AKV_OK);
  assert_int_equal(akv_lease_begin(a.e, UINT32_MAX, &ls), AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_lease_begin(a.e, LAYERS, &ls), AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_lease_begin(a.e, 1, &ls), AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_lease_begin(a.e, 0, NULL), AKV_ERR_INVALID_ARGUMENT);
  assert_ptr_equal(ls, keep);
  assert_int_equal(akvt_null_layers(a.e, a.s, LAYERS), AKV_OK);
  const akv_engine_info after = info_of(a.e);
  assert_int_equal(after.steps, before.steps + 1);
  assert_int_equal(after.leases_retired, before.leases_retired + LAYERS);
  uint32_t len = 0;
  assert_int_equal(akv_context_length(a.c[1], &len), AKV_OK);
  assert_int_equal(len, 7);
  for (uint32_t l = 0; l < LAYERS; l++)
    for (uint32_t t = 0; t < 6; t++) {
      assert_int_equal(akv_context_read(a.c[1], l, t, 1, k, v), AKV_OK);
      for (uint32_t j = 0; j < ROW_BYTES; j++)
        assert_true(k[j] == pat(1, l, t, 0, j) && v[j] == pat(1, l, t, 1, j));
    }
  fx_close(&a);
}

/* ------------------------------------------------- after a quarantine */

/** A quarantine in the middle of a lease, then every call: the changing
 *  ones answer AKV_ERR_QUARANTINED (or AKV_ERR_BAD_HANDLE for the released
 *  lease), the diagnostics and reads answer, rows are intact, and the
 *  stream and the engine can be destroyed. */
static void test_quarantine_then_everything(void **state) {
  (void)state;
  fx a;
  fx_open(&a, AKV_ROUTE_PAGED, 1, 2, 20);
  akv_lease *l0 = NULL, *l1 = NULL;
  akv_fence attn, tail;
  akv_quarantine_report rep;
  assert_int_equal(akv_step_begin(a.e, a.c, 2), AKV_OK);
  assert_int_equal(akv_lease_begin(a.e, 0, &l0), AKV_OK);
  assert_int_equal(akvt_lease_through(l0, a.s), AKV_OK);
  assert_int_equal(akv_lease_begin(a.e, 1, &l1), AKV_OK);
  assert_int_equal(akv_lease_attend(l1, a.s, noop_hook, NULL, &attn), AKV_OK);
  assert_int_equal(akv_engine_destroy(a.e), AKV_ERR_BUSY);
  assert_int_equal(akv_stream_destroy(a.e, a.s), AKV_ERR_IN_USE);
  assert_int_equal(akv_engine_quarantine(a.e, &rep), AKV_OK);
  assert_int_equal(rep.leases_released, 1);
  const akv_engine_info q = info_of(a.e);
  assert_int_equal(q.quarantined, 1);
  uint8_t k[ROW_BYTES], v[ROW_BYTES];
  const void *rows[LAYERS] = {k, k, k};
  akv_context *c2 = NULL;
  akv_stream s2 = NULL;
  akv_lease *l2 = NULL;
  uint64_t taken = 0;
  assert_int_equal(akv_lease_write_back(l1, NULL, 0, &tail), AKV_ERR_BAD_HANDLE);
  assert_int_equal(akv_lease_retire(l1, NULL), AKV_ERR_BAD_HANDLE);
  assert_int_equal(akv_lease_retire(l0, NULL), AKV_ERR_BAD_HANDLE);
  assert_int_equal(akv_lease_begin(a.e, 2, &l2), AKV_ERR_QUARANTINED);
  assert_int_equal(akv_step_end(a.e), AKV_ERR_QUARANTINED);
  assert_int_equal(akv_step_begin(a.e, a.c, 1), AKV_ERR_QUARANTINED);
  assert_int_equal(akv_context_append(a.c[0], 1, rows, rows), AKV_ERR_QUARANTINED);
  assert_int_equal(akv_context_append_layer(a.c[0], 0, 1, k, v), AKV_ERR_QUARANTINED);
  assert_int_equal(akv_context_open(a.e, NULL, &c2), AKV_ERR_QUARANTINED);
  assert_int_equal(akv_context_close(a.c[1]), AKV_ERR_QUARANTINED);
  assert_int_equal(akv_stream_create(a.e, &s2), AKV_ERR_QUARANTINED);
  assert_int_equal(akv_stream_synchronize(a.e, a.s), AKV_ERR_QUARANTINED);
  assert_int_equal(akv_stream_launch_host(a.e, a.s, (void (*)(void *))abort, NULL),
                   AKV_ERR_QUARANTINED);
  assert_int_equal(akv_headroom_take(a.e, 1, &taken), AKV_ERR_QUARANTINED);
  assert_true(c2 == NULL && s2 == NULL && l2 == NULL);
  const akv_engine_info q2 = info_of(a.e);
  expect_same_counters(&q, &q2);
  expect_tag(a.c[0], ROW_BYTES, 0, 20);
  expect_tag(a.c[1], ROW_BYTES, 1, 20);
  char buf[256];
  assert_int_equal(akv_admission_explain(a.e, a.c[0], buf, sizeof buf), AKV_OK);
  assert_int_equal(akv_engine_quarantine(a.e, &rep), AKV_OK);
  assert_int_equal(rep.leases_released, 0);
  assert_int_equal(akv_stream_destroy(a.e, a.s), AKV_OK);
  assert_int_equal(akv_engine_destroy(a.e), AKV_OK);
  assert_int_equal(akv_context_read(a.c[0], 0, 0, 1, k, v), AKV_ERR_BAD_HANDLE);
}

/* ------------------------------------------ handles of destroyed engines */

/** Context and lease handles of a destroyed engine, while later engines
 *  are created, opened and stepped: every call answers AKV_ERR_BAD_HANDLE
 *  and the new engine's state is untouched. */
static void test_destroyed_engine_handles(void **state) {
  (void)state;
  fx a;
  fx_open(&a, AKV_ROUTE_ARENA, 1, 1, 10);
  akv_lease *dead_lease = NULL;
  akv_fence f = {0};
  akv_context *dead_ctx = a.c[0];
  akv_engine *dead_e = a.e;
  assert_int_equal(akv_step_begin(a.e, a.c, 1), AKV_OK);
  assert_int_equal(akv_lease_begin(a.e, 0, &dead_lease), AKV_OK);
  assert_int_equal(akvt_lease_through(dead_lease, a.s), AKV_OK);
  assert_int_equal(akvt_null_layers_from(a.e, a.s, 1, LAYERS), AKV_OK);
  fx_close(&a); /* the context is freed with its engine */
  for (int round = 0; round < 3; round++) {
    fx b;
    fx_open(&b, AKV_ROUTE_ARENA, 1, 1, 4);
    const akv_engine_info before = info_of(b.e);
    uint8_t k[ROW_BYTES], v[ROW_BYTES];
    uint32_t n = 0;
    char buf[32];
    akv_context *mixed[2] = {b.c[0], dead_ctx};
    assert_int_equal(akv_context_read(dead_ctx, 0, 0, 1, k, v), AKV_ERR_BAD_HANDLE);
    assert_int_equal(akv_context_length(dead_ctx, &n), AKV_ERR_BAD_HANDLE);
    assert_int_equal(akv_context_close(dead_ctx), AKV_ERR_BAD_HANDLE);
    assert_int_equal(akv_admission_explain(b.e, dead_ctx, buf, sizeof buf), AKV_ERR_BAD_HANDLE);
    assert_int_equal(akv_step_begin(b.e, mixed, 2), AKV_ERR_BAD_HANDLE);
    assert_int_equal(akv_lease_retire(dead_lease, NULL), AKV_ERR_BAD_HANDLE);
    assert_int_equal(akv_lease_seal(dead_lease, f, f), AKV_ERR_BAD_HANDLE);
    assert_int_equal(akv_stream_destroy(dead_e, b.s), AKV_ERR_BAD_HANDLE);
    assert_int_equal(akv_stream_destroy(b.e, a.s), AKV_ERR_INVALID_ARGUMENT);
    assert_int_equal(akv_engine_destroy(dead_e), AKV_ERR_BAD_HANDLE);
    const akv_engine_info after = info_of(b.e);
    expect_same_counters(&before, &after);
    assert_int_equal(akv_step_begin(b.e, b.c, 1), AKV_OK);
    akv_context *dead_owner[1] = {dead_ctx};
    akv_lease *ls = NULL;
    akv_fence attn, tail;
    assert_int_equal(akv_lease_begin(b.e, 0, &ls), AKV_OK);
    assert_int_equal(akv_lease_attend(ls, b.s, noop_hook, NULL, &attn), AKV_OK);
    assert_int_equal(akv_lease_write_back(ls, dead_owner, 1, &tail), AKV_ERR_BAD_HANDLE);
    assert_int_equal(akv_lease_write_back(ls, NULL, 0, &tail), AKV_OK);
    assert_int_equal(akv_lease_seal(ls, tail, attn), AKV_OK);
    assert_int_equal(akv_lease_retire(ls, NULL), AKV_OK);
    assert_int_equal(akvt_null_layers_from(b.e, b.s, 1, LAYERS), AKV_OK);
    assert_int_equal(akv_context_length(b.c[0], &n), AKV_OK);
    assert_int_equal(n, 5);
    for (uint32_t l = 0; l < LAYERS; l++)
      for (uint32_t t = 0; t < 4; t++) { /* row 4 is the step's own */
        assert_int_equal(akv_context_read(b.c[0], l, t, 1, k, v), AKV_OK);
        for (uint32_t j = 0; j < ROW_BYTES; j++)
          assert_true(k[j] == pat(0, l, t, 0, j) && v[j] == pat(0, l, t, 1, j));
      }
    fx_close(&b);
  }
}

/* ------------------------------------------------------------- FP8 rows */

typedef struct fp8_job {
  akv_view view;
  uint32_t len[2];
  uint64_t row_bytes;
  uint32_t bad;
} fp8_job;

static fp8_job fp8_jobs[LAYERS];

/* On the compute queue: the staged history is the tagged rows, then the
 * step's new row (index len) is written, tagged. */
static void fp8_run(void *arg) {
  fp8_job *j = arg;
  const akv_view *v = &j->view;
  for (uint32_t i = 0; i < v->n_contexts; i++) {
    for (uint32_t t = 0; t < j->len[i]; t++) {
      const uint8_t *k = akvt_view_row(v, i, t);
      for (uint32_t b = 0; b < j->row_bytes; b++)
        j->bad += k[b] != pat(i, v->layer, t, 0, b) ||
                  k[v->v_offset + b] != pat(i, v->layer, t, 1, b);
    }
    uint8_t *nk = (uint8_t *)v->base + (size_t)i * v->context_stride +
                  (size_t)j->len[i] * v->row_stride;
    for (uint32_t b = 0; b < j->row_bytes; b++) {
      nk[b] = pat(i, v->layer, j->len[i], 0, b);
      nk[v->v_offset + b] = pat(i, v->layer, j->len[i], 1, b);
    }
  }
}

static akv_engine *fp8_engine;

static int fp8_hook(void *user, const akv_view *view, akv_stream stream) {
  fp8_job *j = &fp8_jobs[view->layer];
  j->view = *view;
  j->row_bytes = *(const uint64_t *)user;
  for (uint32_t i = 0; i < view->n_contexts; i++) j->len[i] = view->len[i];
  j->view.len = j->len;
  return akv_stream_launch_host(fp8_engine, stream, fp8_run, j) != AKV_OK;
}

/** One-byte rows (both FP8 types) of an odd size (kv_heads 37 x head_dim
 *  7: 259 bytes) on the paged and arena routes, across page boundaries and
 *  up to max_tokens: every staged row is the appended one, every written
 *  back row reads back, and the step past max_tokens refuses. */
static void test_fp8_odd_rows_to_capacity(void **state) {
  (void)state;
  const akv_dtype types[2] = {AKV_DTYPE_FP8_E4M3, AKV_DTYPE_FP8_E5M2};
  const akv_route routes[2] = {AKV_ROUTE_PAGED, AKV_ROUTE_ARENA};
  for (int d = 0; d < 2; d++)
    for (int r = 0; r < 2; r++) {
      akv_engine_config ec = akvt_small_config(routes[r], 1);
      ec.dtype = types[d];
      ec.kv_heads = 37;
      ec.head_dim = 7;
      ec.max_tokens = 20;
      ec.page_tokens = 3;
      akv_engine *e = NULL;
      akv_stream s = NULL;
      akv_context *c[2] = {NULL, NULL};
      uint64_t row_bytes = 259;
      assert_int_equal(akv_engine_create(&ec, &e), AKV_OK);
      assert_int_equal(info_of(e).row_bytes, 259);
      assert_int_equal(akv_stream_create(e, &s), AKV_OK);
      for (int i = 0; i < 2; i++) {
        assert_int_equal(akv_context_open(e, NULL, &c[i]), AKV_OK);
        assert_int_equal(append_tag(c[i], row_bytes, (uint32_t)i, 0, 16 + (uint32_t)i), AKV_OK);
      }
      /* c[1] reaches max_tokens after 3 steps, c[0] after 4. */
      fp8_engine = e;
      for (int step = 0; step < 4; step++) {
        const uint32_t n = step < 3 ? 2 : 1;
        assert_int_equal(akv_step_begin(e, c, n), AKV_OK);
        for (uint32_t l = 0; l < LAYERS; l++) {
          akv_lease *ls = NULL;
          akv_fence attn, tail;
          fp8_jobs[l].bad = 0;
          assert_int_equal(akv_lease_begin(e, l, &ls), AKV_OK);
          assert_int_equal(akv_lease_attend(ls, s, fp8_hook, &row_bytes, &attn), AKV_OK);
          assert_int_equal(akv_lease_write_back(ls, NULL, 0, &tail), AKV_OK);
          assert_int_equal(akv_lease_seal(ls, tail, attn), AKV_OK);
          assert_int_equal(akv_lease_retire(ls, NULL), AKV_OK);
          assert_int_equal(fp8_jobs[l].bad, 0);
        }
        assert_int_equal(akv_step_end(e), AKV_OK);
      }
      const akv_engine_info before = info_of(e);
      assert_int_equal(akv_step_begin(e, c, 2), AKV_ERR_CAPACITY);
      assert_int_equal(akv_step_begin(e, c, 1), AKV_ERR_CAPACITY);
      const akv_engine_info after = info_of(e);
      expect_same_counters(&before, &after);
      uint8_t k[259], v[259];
      for (int i = 0; i < 2; i++) {
        uint32_t len = 0;
        assert_int_equal(akv_context_length(c[i], &len), AKV_OK);
        assert_int_equal(len, 20);
        for (uint32_t l = 0; l < LAYERS; l++)
          for (uint32_t t = 0; t < 20; t++) {
            assert_int_equal(akv_context_read(c[i], l, t, 1, k, v), AKV_OK);
            for (uint32_t j = 0; j < 259; j++)
              assert_true(k[j] == pat((uint32_t)i, l, t, 0, j) &&
                          v[j] == pat((uint32_t)i, l, t, 1, j));
          }
        assert_int_equal(akv_context_read(c[i], 0, 20, 1, k, v), AKV_ERR_INVALID_ARGUMENT);
        assert_int_equal(append_tag(c[i], row_bytes, 9, 20, 1), AKV_ERR_CAPACITY);
      }
      assert_int_equal(akv_stream_destroy(e, s), AKV_OK);
      assert_int_equal(akv_engine_destroy(e), AKV_OK);
    }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_host_fn_destroys_its_own_stream),
      cmocka_unit_test(test_owners_fences_and_stale_lease),
      cmocka_unit_test(test_contexts_across_a_step),
      cmocka_unit_test(test_hook_reenters_and_destroys),
      cmocka_unit_test(test_log_callback_reentry),
      cmocka_unit_test(test_explain_small_buffers),
      cmocka_unit_test(test_extreme_arguments),
      cmocka_unit_test(test_quarantine_then_everything),
      cmocka_unit_test(test_destroyed_engine_handles),
      cmocka_unit_test(test_fp8_odd_rows_to_capacity),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
