/*
 * test_audit_s28_core.c - the core against hostile call sequences an outside
 * tester writes: callbacks that never return to the library, and whatever
 * else this audit found. Each test names the promise of akv.h it checks; a
 * refused call returns its exact status and changes nothing.
 */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "akv.h"
#include "testutil.h"

#define LAYERS 3 /* akvt_small_config */

static void sleep_ms(unsigned ms) {
  struct timespec ts = {(time_t)(ms / 1000u), (long)(ms % 1000u) * 1000000L};
  nanosleep(&ts, NULL);
}

/* ------------------------------- a hook that leaves by longjmp, not return */

static jmp_buf leave_hook;

static int longjmp_hook(void *user, const akv_view *view, akv_stream stream) {
  (void)user;
  (void)view;
  (void)stream;
  longjmp(leave_hook, 1);
}

typedef struct creator {
  atomic_int done;
  akv_status st;
} creator;

/* Creates and destroys engines until every engine record there was has
 * been handed out again (the reuse bound is AKV_ENGINE_HANDLE_REUSE_MIN). */
static void *create_many(void *arg) {
  creator *c = arg;
  c->st = AKV_OK;
  for (int i = 0; i < 3 * AKV_ENGINE_HANDLE_REUSE_MIN && c->st == AKV_OK; i++) {
    const akv_engine_config ec = akvt_small_config(AKV_ROUTE_STAGE, 0);
    akv_engine *e = NULL;
    c->st = akv_engine_create(&ec, &e);
    if (c->st == AKV_OK) c->st = akv_engine_destroy(e);
  }
  atomic_store(&c->done, 1);
  return NULL;
}

/* akv.h, akv_attention_fn / Thread safety: a hook that never returns to
 * akv_lease_attend (longjmp out of it) leaves its engine claimed by its
 * thread, which may still quarantine and destroy the engine (its calls
 * nest). The destroyed engine's record went back to the pool still claimed,
 * and the create on another thread that was handed it later waited for that
 * claim for ever (akv_engine_create hung). A record is handed out again
 * only once its last claim is released. */
static void test_hook_that_longjmps_then_destroy(void **state) {
  akvt_fx f;
  akv_lease *ls = NULL;
  akv_fence attn = {0};
  akv_quarantine_report rep;
  pthread_t th;
  creator c;
  (void)state;
  akvt_fx_open(&f, AKV_ROUTE_STAGE, 0, 2, 4);
  assert_int_equal(akv_step_begin(f.e, f.c, 2), AKV_OK);
  assert_int_equal(akv_lease_begin(f.e, 0, &ls), AKV_OK);
  if (setjmp(leave_hook) == 0) {
    akv_lease_attend(ls, f.s, longjmp_hook, NULL, &attn);
    fail_msg("the hook returned");
  }
  /* Still this thread's: the engine is quarantined and destroyed from it. */
  assert_int_equal(akv_engine_quarantine(f.e, &rep), AKV_OK);
  assert_int_equal(akv_stream_destroy(f.e, f.s), AKV_OK);
  assert_int_equal(akv_engine_destroy(f.e), AKV_OK);
  assert_int_equal(akv_engine_destroy(f.e), AKV_ERR_BAD_HANDLE);
  /* Another thread creates engines until the record would come back. */
  memset(&c, 0, sizeof c);
  assert_int_equal(pthread_create(&th, NULL, create_many, &c), 0);
  for (int waited = 0; !atomic_load(&c.done) && waited < 60000; waited += 10) sleep_ms(10);
  if (!atomic_load(&c.done)) {
    fprintf(stderr, "akv_engine_create hung on the record of an engine still claimed\n");
    fflush(stderr);
    _exit(1); /* the creator spins for ever: no join possible */
  }
  pthread_join(th, NULL);
  assert_int_equal(c.st, AKV_OK);
}

static int destroying_hook(void *user, const akv_view *view, akv_stream stream) {
  akvt_fx *f = user;
  (void)view;
  if (akv_engine_quarantine(f->e, NULL) != AKV_OK) return 1;
  if (akv_stream_destroy(f->e, stream) != AKV_OK) return 1;
  return akv_engine_destroy(f->e) == AKV_OK ? 0 : 1;
}

/* The same record, given back by the attend the hook returned to: a hook
 * that destroys its engine (akv.h: allowed) leaves the record out of the
 * pool only until its attend returns, then later creates hand it out again
 * after the reuse bound ("Handle lifetimes"), not before. */
static void test_hook_destroys_its_engine_record_comes_back(void **state) {
  akvt_fx f;
  akv_lease *ls = NULL;
  akv_fence attn = {0};
  akv_engine *old, *seen = NULL;
  int at = -1;
  (void)state;
  akvt_fx_open(&f, AKV_ROUTE_STAGE, 0, 2, 4);
  old = f.e;
  assert_int_equal(akv_step_begin(f.e, f.c, 2), AKV_OK);
  assert_int_equal(akv_lease_begin(f.e, 0, &ls), AKV_OK);
  assert_int_equal(akv_lease_attend(ls, f.s, destroying_hook, &f, &attn), AKV_ERR_BAD_HANDLE);
  assert_int_equal(akv_engine_destroy(old), AKV_ERR_BAD_HANDLE);
  for (int i = 0; i < 3 * AKV_ENGINE_HANDLE_REUSE_MIN && seen != old; i++) {
    const akv_engine_config ec = akvt_small_config(AKV_ROUTE_STAGE, 0);
    akv_engine *e = NULL;
    assert_int_equal(akv_engine_create(&ec, &e), AKV_OK);
    seen = e;
    if (e == old) at = i;
    assert_int_equal(akv_engine_destroy(e), AKV_OK);
  }
  assert_ptr_equal(seen, old);
  assert_true(at >= AKV_ENGINE_HANDLE_REUSE_MIN);
}


/* A hook whose thread ends inside it (pthread_exit) leaves its attend in
 * progress for good, the engine claimed by a thread that no longer exists
 * (akv.h). A thread's name in the claim was the address of a thread-local,
 * which the C library hands to the next thread it starts (the dead
 * thread's cached stack and TLS block): that thread was taken for the
 * owner, its calls nested into the dead thread's half-done attend. Every
 * later thread is refused (AKV_ERR_IN_USE) now: a thread's name is never
 * reused. */
typedef struct exiting {
  akvt_fx *f;
  const void *tls; /* the address of a thread-local of the thread */
} exiting;

static _Thread_local char s28_tls_probe;

static int exiting_hook(void *user, const akv_view *view, akv_stream stream) {
  (void)user;
  (void)view;
  (void)stream;
  pthread_exit(NULL);
  return 1;
}

static void *exit_in_hook(void *arg) {
  exiting *x = arg;
  akv_lease *ls = NULL;
  akv_fence attn = {0};
  x->tls = &s28_tls_probe;
  if (akv_step_begin(x->f->e, x->f->c, 2) != AKV_OK) return NULL;
  if (akv_lease_begin(x->f->e, 0, &ls) != AKV_OK) return NULL;
  akv_lease_attend(ls, x->f->s, exiting_hook, NULL, &attn);
  return NULL; /* not reached: the hook ends the thread */
}

typedef struct later {
  akvt_fx *f;
  const void *tls;
  akv_status st;
} later;

static void *call_later(void *arg) {
  later *l = arg;
  l->tls = &s28_tls_probe;
  l->st = akv_step_end(l->f->e);
  return NULL;
}

static void test_hook_thread_that_exits_is_not_succeeded(void **state) {
  akvt_fx f;
  exiting x = {&f, NULL};
  pthread_t th;
  int reused = 0;
  (void)state;
  akvt_fx_open(&f, AKV_ROUTE_STAGE, 0, 2, 4);
  assert_int_equal(pthread_create(&th, NULL, exit_in_hook, &x), 0);
  assert_int_equal(pthread_join(th, NULL), 0);
  assert_non_null(x.tls); /* it reached the hook's attend */
  for (int i = 0; i < 16; i++) {
    later l = {&f, NULL, AKV_OK};
    assert_int_equal(pthread_create(&th, NULL, call_later, &l), 0);
    assert_int_equal(pthread_join(th, NULL), 0);
    reused += l.tls == x.tls;
    assert_int_equal(l.st, AKV_ERR_IN_USE);
  }
  /* The engine stays claimed by the dead thread (akv.h): not destroyed. */
  if (!reused) fprintf(stderr, "note: no later thread got the exited thread's TLS address\n");
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_hook_that_longjmps_then_destroy),
      cmocka_unit_test(test_hook_destroys_its_engine_record_comes_back),
      cmocka_unit_test(test_hook_thread_that_exits_is_not_succeeded),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
