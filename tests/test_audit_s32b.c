/*
 * test_audit_s32b.c - an audit of akv.h's promises under hostile call
 * sequences. Each test names the promise it checks and fails while the
 * library breaks it.
 *  - An attention hook that destroys its own engine and creates newer
 *    engines until one of them holds its lease's handle record, which
 *    another thread then uses while the hook's akv_lease_attend finishes.
 *    The library's answers were right before the fix (AKV_ERR_BAD_HANDLE,
 *    nothing changed): what was wrong was a plain read of a record another
 *    thread was writing, a data race that only ThreadSanitizer reports, so
 *    this test fails only in the TSan build (-DAKV_SANITIZE=thread).
 *  - A group's engine destroyed directly, and its record handed to a newer
 *    engine, between a group call's check of its engine (by serial) and its
 *    use of it. The window is a few instructions wide; this binary is linked
 *    with -Wl,--wrap=akv_engine_serial (tests/CMakeLists.txt), and the wrapper
 *    below runs that other thread's part (destroy, creates) inside it, once
 *    armed. These fail in every build.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include <cmocka.h>

#include "akv.h"
#include "akv_group.h"
#include "internal.h" /* the lease record's engine word, to find the newer engine */
#include "testutil.h"

static void sleep_ms(unsigned ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

/* ------------------------------ attend after its hook gave the record away */

typedef struct user_of_x {
  akv_engine *x;        /* the newer engine holding the lease's record */
  const akv_lease *rec; /* that record */
  akv_stream s;
  akv_context *c;
  akv_lease *ls; /* the lease of x that took the record, left begun */
  uint32_t layer;
  akv_status st;
  /* Relaxed only: the hook polls it, and no happens-before may come back
   * from this thread to the attend (or no race could be seen). */
  _Atomic int parked;
} user_of_x;

/* Another thread uses x: leases begin (each takes the next record of x's
 * ring) until one takes the record of the destroyed engine's lease, which
 * stays begun (its record live). */
static void *use_x(void *arg) {
  user_of_x *u = arg;
  static uint16_t zero[5 * 16];
  const void *rows[3] = {zero, zero, zero};
  u->st = akv_stream_create(u->x, &u->s);
  if (u->st == AKV_OK) u->st = akv_context_open(u->x, NULL, &u->c);
  if (u->st == AKV_OK) u->st = akv_context_append(u->c, 5, rows, rows);
  for (uint32_t step = 0; u->st == AKV_OK && step <= AKV_LEASE_HANDLES_PER_LAYER; step++) {
    if ((u->st = akv_step_begin(u->x, &u->c, 1)) != AKV_OK) break;
    for (uint32_t l = 0; u->st == AKV_OK && l < 3; l++) {
      akv_lease *ls = NULL;
      if ((u->st = akv_lease_begin(u->x, l, &ls)) != AKV_OK) break;
      if (ls == u->rec) {
        u->ls = ls;
        u->layer = l;
        atomic_store_explicit(&u->parked, 1, memory_order_relaxed);
        return NULL; /* the step stays open, this lease begun */
      }
      u->st = akvt_lease_through(ls, u->s);
    }
    if (u->st == AKV_OK) u->st = akv_step_end(u->x);
  }
  atomic_store_explicit(&u->parked, 2, memory_order_relaxed); /* not found */
  return NULL;
}

typedef struct destroy_and_create {
  akvt_fx a;
  const akv_lease *rec; /* a's lease handle, whose record goes back at a's destroy */
  int engines_made;
  int hook_ok;
  pthread_t t;
  int started;
  user_of_x u;
} destroy_and_create;

/* The hook: destroys its engine (akv.h: allowed from a hook), then creates
 * engines until one holds the record of the lease being attended (handed
 * out again after AKV_LEASE_HANDLE_REUSE_MIN records: "Handle lifetimes"),
 * hands that engine to another thread and returns once that thread's lease
 * holds the record. */
static int destroy_then_create_hook(void *user, const akv_view *view, akv_stream stream) {
  destroy_and_create *d = user;
  (void)view;
  if (akv_engine_quarantine(d->a.e, NULL) != AKV_OK) return 1;
  if (akv_stream_destroy(d->a.e, stream) != AKV_OK) return 1;
  if (akv_engine_destroy(d->a.e) != AKV_OK) return 1;
  for (int i = 0; i < 4 * AKV_LEASE_HANDLE_REUSE_MIN / AKV_LEASE_HANDLES_PER_LAYER; i++) {
    akv_engine *x = akvt_small_engine(AKV_ROUTE_STAGE, 0);
    if (x == NULL) return 1;
    d->engines_made++;
    if (AKV_LOAD(d->rec->engine) == x) {
      d->u.x = x;
      break;
    }
    if (akv_engine_destroy(x) != AKV_OK) return 1;
  }
  if (d->u.x == NULL) return 1;
  d->u.rec = d->rec;
  if (pthread_create(&d->t, NULL, use_x, &d->u) != 0) return 1;
  d->started = 1;
  for (int waited = 0; atomic_load_explicit(&d->u.parked, memory_order_relaxed) == 0 &&
                       waited < 60000;
       waited++)
    sleep_ms(1);
  d->hook_ok = atomic_load_explicit(&d->u.parked, memory_order_relaxed) == 1;
  return 0;
}

/* Promise (akv.h, akv_attention_fn and Handle lifetimes: a hook may destroy
 * its engine, and attend then returns AKV_ERR_BAD_HANDLE having touched
 * nothing of it; Thread safety: a call reads nothing of an engine another
 * thread may be inside): after the hook returned, attend resolved its
 * lease handle with plain loads of the record (its body word and serial)
 * and of the body the record then named. The hook had destroyed the
 * engine and created newer ones, one of which now held the record and was
 * in use by another thread, whose begin had just written that record and
 * its own lease body: data races (undefined behaviour; ThreadSanitizer
 * reports them, so this test fails in the TSan build). Now attend first
 * asks its engine, by the engine record's atomic magic (a record this
 * attend keeps claimed, so never another engine's meanwhile), whether it
 * still lives, and reads the lease record only if so: a record of a live
 * engine is that engine's, and this thread holds its claim. */
static void test_attend_after_hook_gave_record_to_newer_engine(void **state) {
  (void)state;
  static destroy_and_create d;
  akv_lease *l = NULL;
  akv_fence fa = {0};
  memset(&d, 0, sizeof d);
  akvt_fx_open(&d.a, AKV_ROUTE_STAGE, 0, 1, 5);
  assert_int_equal(akv_step_begin(d.a.e, d.a.c, 1), AKV_OK);
  assert_int_equal(akv_lease_begin(d.a.e, 0, &l), AKV_OK);
  d.rec = l;
  assert_int_equal(akv_lease_attend(l, d.a.s, destroy_then_create_hook, &d, &fa),
                   AKV_ERR_BAD_HANDLE);
  assert_int_equal(fa.serial, 0); /* nothing written */
  if (d.started) assert_int_equal(pthread_join(d.t, NULL), 0);
  assert_true(d.hook_ok);
  assert_int_equal(d.u.st, AKV_OK);
  assert_true(d.engines_made > 1);

  /* The newer engine's lease on the record goes on as if nothing happened,
   * and its engine ends cleanly. */
  assert_int_equal(akvt_lease_through(d.u.ls, d.u.s), AKV_OK);
  assert_int_equal(akvt_null_layers_from(d.u.x, d.u.s, d.u.layer + 1, 3), AKV_OK);
  assert_int_equal(akv_stream_destroy(d.u.x, d.u.s), AKV_OK);
  assert_int_equal(akv_context_close(d.u.c), AKV_OK);
  assert_int_equal(akv_engine_destroy(d.u.x), AKV_OK);
  /* The old handle stays dead. */
  assert_int_equal(akv_lease_attend(l, d.a.s, akvt_noop_hook, NULL, &fa), AKV_ERR_BAD_HANDLE);
}

/* ------------------- a group's engine replaced between its check and its use */

uint64_t __real_akv_engine_serial(const akv_engine *e);
uint64_t __wrap_akv_engine_serial(const akv_engine *e);

/* Armed: the next check of the group's engine (akv_group_own's serial)
 * reads it live, and then, before the group call goes on, "another thread"
 * destroys that engine directly (allowed: akv_group_engine) and creates
 * engines until one holds its record (AKV_ENGINE_HANDLE_REUSE_MIN later:
 * akv.h, Handle lifetimes), which stays alive as `newer`. */
static struct {
  const akv_engine *target;
  akv_engine *newer;
  int fired;
  akv_status st;
} swap;

uint64_t __wrap_akv_engine_serial(const akv_engine *e) {
  const uint64_t s = __real_akv_engine_serial(e);
  if (swap.target == NULL || e != swap.target) return s;
  swap.target = NULL; /* once */
  swap.fired = 1;
  swap.st = akv_engine_destroy((akv_engine *)e);
  for (int i = 0; swap.st == AKV_OK && i < 4 * AKV_ENGINE_HANDLE_REUSE_MIN; i++) {
    akv_engine *x = akvt_small_engine(AKV_ROUTE_STAGE, 0);
    if (x == NULL) {
      swap.st = AKV_ERR_OUT_OF_MEMORY;
      break;
    }
    if (x == e) {
      swap.newer = x;
      break;
    }
    swap.st = akv_engine_destroy(x);
  }
  return s;
}

static akv_group *one_rank_group(akv_group_world **w, akv_group_digest digest) {
  akv_engine_config ec = akvt_small_config(AKV_ROUTE_STAGE, 0);
  akv_group_config gc = AKV_GROUP_CONFIG_INIT;
  akv_group *g = NULL;
  gc.digest = digest;
  assert_int_equal(akv_group_world_create(1, 4, w), AKV_OK);
  assert_int_equal(akv_group_create_inproc(&ec, &gc, *w, &g), AKV_OK);
  return g;
}

/* Promise (akv_group.h, akv_group_engine and akv_group_destroy: the group
 * knows its engine by its serial, "no group call acts on an engine the
 * dead handle may name now (none quarantines, destroys ...)"; Thread
 * safety: another thread may be inside a call on the engine meanwhile):
 * akv_group_destroy checked its engine by serial and then destroyed the
 * handle's engine without holding it in between. An engine destroyed
 * directly there by another thread, and its record handed to a newer
 * engine, had the group destroy that newer engine, one the caller had made
 * and was using. Now the group holds its engine (its claim) before the
 * serial check that decides, as its agreement calls do, so the engine it
 * checked is the engine it destroys: a newer engine on the record is left
 * alone, and the group is freed as for an engine destroyed directly. */
static void test_group_destroy_never_destroys_a_newer_engine(void **state) {
  (void)state;
  akv_group_world *w = NULL;
  akv_group *g = one_rank_group(&w, AKV_GROUP_DIGEST_DEFAULT);
  akv_engine *e = NULL;
  akv_engine_info info;
  assert_int_equal(akv_group_engine(g, &e), AKV_OK);
  memset(&swap, 0, sizeof swap);
  swap.target = e;
  assert_int_equal(akv_group_destroy(g), AKV_OK);
  assert_true(swap.fired);
  assert_int_equal(swap.st, AKV_OK);
  assert_ptr_equal(swap.newer, e); /* the record came back, to the caller's engine */
  /* The newer engine is the caller's, alive and whole. */
  assert_int_equal(akv_engine_info_get(swap.newer, &info), AKV_OK);
  assert_int_equal(akv_engine_destroy(swap.newer), AKV_OK);
  assert_int_equal(akv_group_world_destroy(w), AKV_OK);
}

/* Promise (akv_group.h, akv_group_info: without digest checks the digest is
 * the engine's plan digest now, 0 once the caller destroyed the engine
 * itself): akv_group_info_get checked its engine by serial, then claimed
 * the handle's engine and read its plan digest without checking again. An
 * engine destroyed directly in between, its record handed to a newer
 * engine, gave the newer engine's digest, a plan of no group. Now the
 * serial is checked again once claimed, and such an engine gives 0. */
static void test_group_info_never_reads_a_newer_engine(void **state) {
  (void)state;
  akv_group_world *w = NULL;
  akv_group *g = one_rank_group(&w, AKV_GROUP_DIGEST_DEFAULT);
  akv_engine *e = NULL, *now = (akv_engine *)&now;
  akv_group_info info;
  assert_int_equal(akv_group_info_get(g, &info), AKV_OK);
  if (info.digest_checked) {
    /* Debug builds compare digests (AKV_GROUP_DIGEST_DEFAULT): info_get then
     * reads no engine, and there is nothing to check. */
    assert_int_equal(akv_group_destroy(g), AKV_OK);
    assert_int_equal(akv_group_world_destroy(w), AKV_OK);
    skip();
  }
  assert_int_not_equal(info.digest, 0);
  assert_int_equal(akv_group_engine(g, &e), AKV_OK);
  memset(&swap, 0, sizeof swap);
  swap.target = e;
  memset(&info, 0x5a, sizeof info);
  assert_int_equal(akv_group_info_get(g, &info), AKV_OK);
  assert_true(swap.fired);
  assert_int_equal(swap.st, AKV_OK);
  assert_ptr_equal(swap.newer, e);
  assert_int_equal(info.digest, 0); /* the group's engine is gone */
  /* And the group knows it: no engine, and destroy leaves the newer one. */
  assert_int_equal(akv_group_engine(g, &now), AKV_OK);
  assert_null(now);
  assert_int_equal(akv_group_destroy(g), AKV_OK);
  assert_int_equal(akv_engine_destroy(swap.newer), AKV_OK);
  assert_int_equal(akv_group_world_destroy(w), AKV_OK);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_attend_after_hook_gave_record_to_newer_engine),
      cmocka_unit_test(test_group_destroy_never_destroys_a_newer_engine),
      cmocka_unit_test(test_group_info_never_reads_a_newer_engine),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
