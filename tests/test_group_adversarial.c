/*
 * test_group_adversarial.c - the group API (akv_group.h) against a hostile or
 * careless caller: bad and foreign handles, bad argument arrays, calls on the
 * group's engine behind its back, several threads of one rank on one group,
 * world teardown mid-agreement. Each test names the promise it checks; a
 * refused call must change nothing and leave the group usable.
 *
 * Ranks are threads over the in-process world; waits that are expected to
 * time out use a few hundred ms.
 */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
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
#include "akv_group.h"
#include "plan.h"
#include "testutil.h"

#define LAYERS 8
#define KV_HEADS 2
#define HEAD_DIM 8

static void quiet(void *user, akv_log_level level, const char *message) {
  (void)user;
  (void)level;
  (void)message;
}

static akv_engine_config shard_config(uint32_t max_contexts) {
  akv_engine_config c = AKV_ENGINE_CONFIG_INIT;
  c.backend = AKV_BACKEND_HOST;
  c.n_dense_layers = LAYERS;
  c.kv_heads = KV_HEADS;
  c.head_dim = HEAD_DIM;
  c.max_tokens = 65536;
  c.page_tokens = 1024;
  c.host_pool_gib = 1;
  c.device_pool_gib = 1;
  c.max_contexts = max_contexts;
  c.fit_mode = AKV_FIT_SHRINK;
  c.route = AKV_ROUTE_ARENA;
  c.log_fn = quiet;
  return c;
}

static void sleep_ms(long ms) {
  struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* ------------------------------------------------ two groups of a world */

typedef struct pair {
  akv_group_world *world;
  akv_group *g[2];
  uint32_t timeout_ms;
  akv_group_digest digest;
} pair;

typedef struct pair_rank {
  pair *p;
  uint32_t rank;
  akv_status st;
} pair_rank;

static void *pair_create_main(void *arg) {
  pair_rank *r = arg;
  akv_engine_config ec = shard_config(4);
  akv_group_config gc = AKV_GROUP_CONFIG_INIT;
  gc.rank = r->rank;
  gc.size = 2;
  gc.timeout_ms = r->p->timeout_ms;
  gc.digest = r->p->digest;
  r->st = akv_group_create_inproc(&ec, &gc, r->p->world, &r->p->g[r->rank]);
  return NULL;
}

/* A two-rank world and both ranks' groups, made from two threads. */
static void pair_create(pair *p, uint32_t timeout_ms, akv_group_digest digest) {
  pthread_t th[2];
  pair_rank r[2];
  memset(p, 0, sizeof(*p));
  p->timeout_ms = timeout_ms;
  p->digest = digest;
  assert_int_equal(akv_group_world_create(2, 4, &p->world), AKV_OK);
  for (uint32_t i = 0; i < 2; i++) {
    r[i].p = p;
    r[i].rank = i;
    assert_int_equal(pthread_create(&th[i], NULL, pair_create_main, &r[i]), 0);
  }
  for (uint32_t i = 0; i < 2; i++) pthread_join(th[i], NULL);
  for (uint32_t i = 0; i < 2; i++) assert_int_equal(r[i].st, AKV_OK);
}

static void pair_destroy(pair *p) {
  for (uint32_t i = 0; i < 2; i++) assert_int_equal(akv_group_destroy(p->g[i]), AKV_OK);
  assert_int_equal(akv_group_world_destroy(p->world), AKV_OK);
}

/* One call on one group from its own thread. */
typedef enum call_kind { CALL_CHECK, CALL_DESTROY, CALL_OPEN } call_kind;

typedef struct call {
  akv_group *g;
  call_kind kind;
  long delay_ms; /* before the call */
  akv_status st;
  akv_context *c;
  double took_s;
} call;

static void *call_main(void *arg) {
  call *c = arg;
  double t0;
  if (c->delay_ms > 0) sleep_ms(c->delay_ms);
  t0 = now_s();
  switch (c->kind) {
    case CALL_CHECK: c->st = akv_group_check(c->g); break;
    case CALL_DESTROY: c->st = akv_group_destroy(c->g); break;
    case CALL_OPEN: c->st = akv_group_context_open(c->g, NULL, &c->c); break;
  }
  c->took_s = now_s() - t0;
  return NULL;
}

static void run_calls(call *calls, uint32_t n) {
  pthread_t th[8];
  assert_true(n <= 8);
  for (uint32_t i = 0; i < n; i++)
    assert_int_equal(pthread_create(&th[i], NULL, call_main, &calls[i]), 0);
  for (uint32_t i = 0; i < n; i++) pthread_join(th[i], NULL);
}

/* ------------------------------------------------------------- threads */

/* Promise (akv_group.h, Thread safety): a group is used from one thread at
 * a time. A second thread of the same rank that calls anyway must not be
 * taken for another rank: two threads of rank 0 completed an agreement
 * round between them (as if they were ranks 0 and 1) and rank 1 then waited
 * out its timeout alone and stopped every rank. A call made while another
 * thread is inside a call on the same group returns AKV_ERR_IN_USE at once,
 * enters no collective and changes nothing; the other call goes on. */
static void test_second_thread_of_a_rank_refused(void **state) {
  (void)state;
  pair p;
  call calls[3];
  akv_group_info info;
  pair_create(&p, 400, AKV_GROUP_DIGEST_ON);
  memset(calls, 0, sizeof(calls));
  calls[0].g = p.g[0]; /* two threads of rank 0 */
  calls[1].g = p.g[0];
  calls[1].delay_ms = 30;
  calls[2].g = p.g[1]; /* rank 1, once both of rank 0's are in */
  calls[2].delay_ms = 120;
  run_calls(calls, 3);
  assert_int_equal(calls[0].st, AKV_OK);
  assert_int_equal(calls[1].st, AKV_ERR_IN_USE);
  assert_true(calls[1].took_s < 0.1); /* at once: no collective */
  assert_int_equal(calls[2].st, AKV_OK);
  for (uint32_t i = 0; i < 2; i++) {
    assert_int_equal(akv_group_info_get(p.g[i], &info), AKV_OK);
    assert_false(info.stopped);
    assert_int_equal(info.agreements, 3); /* create's two and the check */
  }
  /* The group goes on. */
  memset(calls, 0, sizeof(calls));
  calls[0].g = p.g[0];
  calls[1].g = p.g[1];
  run_calls(calls, 2);
  assert_int_equal(calls[0].st, AKV_OK);
  assert_int_equal(calls[1].st, AKV_OK);
  pair_destroy(&p);
}

/* Promise (akv_group_destroy): nothing is freed while it is in use. A
 * destroy from another thread of the rank while a call of the group waits
 * at an agreement point freed the group's vector and collective under the
 * waiting call (a use after free when it woke). It returns AKV_ERR_IN_USE
 * and frees nothing; the waiting call ends as it would have (here rank 1
 * never comes: AKV_ERR_TIMEOUT); destroy then succeeds. The same holds for
 * the reads (info, engine, last error): they are refused, not raced. */
static void test_destroy_while_another_thread_waits(void **state) {
  (void)state;
  pair p;
  call calls[2];
  akv_group_info info;
  akv_engine *e = NULL;
  pair_create(&p, 400, AKV_GROUP_DIGEST_ON);
  memset(calls, 0, sizeof(calls));
  calls[0].g = p.g[0];
  calls[0].kind = CALL_CHECK;
  calls[1].g = p.g[0];
  calls[1].kind = CALL_DESTROY;
  calls[1].delay_ms = 100; /* while the check waits for rank 1 */
  run_calls(calls, 2);
  assert_int_equal(calls[1].st, AKV_ERR_IN_USE);
  assert_int_equal(calls[0].st, AKV_ERR_TIMEOUT);
  assert_int_equal(akv_group_info_get(p.g[0], &info), AKV_OK);
  assert_true(info.stopped);
  assert_int_equal(info.reason, AKV_GROUP_TIMEOUT);
  assert_int_equal(akv_group_engine(p.g[0], &e), AKV_OK);
  assert_non_null(e);
  /* Rank 1, late: the world was aborted by the timeout. */
  assert_int_equal(akv_group_check(p.g[1]), AKV_ERR_TIMEOUT);
  pair_destroy(&p);
}

/* Reads from another thread while a call waits: refused with
 * AKV_ERR_IN_USE (info, engine) or a fixed string (last error), never a
 * read of what the call is changing. */
typedef struct reader {
  akv_group *g;
  akv_status info, engine;
  char last[64];
} reader;

static void *reader_main(void *arg) {
  reader *r = arg;
  akv_group_info info;
  akv_engine *e = NULL;
  sleep_ms(100);
  r->info = akv_group_info_get(r->g, &info);
  r->engine = akv_group_engine(r->g, &e);
  snprintf(r->last, sizeof(r->last), "%s", akv_group_last_error(r->g));
  return NULL;
}

static void test_reads_while_another_thread_waits(void **state) {
  (void)state;
  pair p;
  call waiting;
  reader rd;
  pthread_t th[2];
  pair_create(&p, 400, AKV_GROUP_DIGEST_ON);
  memset(&waiting, 0, sizeof(waiting));
  memset(&rd, 0, sizeof(rd));
  waiting.g = rd.g = p.g[0];
  assert_int_equal(pthread_create(&th[0], NULL, call_main, &waiting), 0);
  assert_int_equal(pthread_create(&th[1], NULL, reader_main, &rd), 0);
  pthread_join(th[0], NULL);
  pthread_join(th[1], NULL);
  assert_int_equal(waiting.st, AKV_ERR_TIMEOUT);
  assert_int_equal(rd.info, AKV_ERR_IN_USE);
  assert_int_equal(rd.engine, AKV_ERR_IN_USE);
  assert_string_equal(rd.last, "group in use by another thread");
  assert_int_equal(akv_group_check(p.g[1]), AKV_ERR_TIMEOUT);
  pair_destroy(&p);
}

/* --------------------------------------------------- bad argument arrays */

typedef struct arr_rank arr_rank;
struct arr_rank {
  akv_group *g, *other; /* other: a group of another world on this thread */
  uint32_t rank;
  arr_rank *peer;
  akv_context *foreign; /* the other rank's context (threads share memory) */
  akv_context *mine[2];
  akv_status st[12];
  int changed[12];
  int stopped;
  pthread_barrier_t *bar;
};

static void *arr_rank_main(void *arg) {
  arr_rank *r = arg;
  akv_engine *e = NULL;
  akv_context *list[4], *closed = NULL, *other_ctx = NULL;
  akv_group_info info;
  uint64_t d;
  int k = 0;
  akv_group_engine(r->g, &e);
  assert_int_equal(akv_group_context_open(r->g, NULL, &r->mine[0]), AKV_OK);
  assert_int_equal(akv_group_context_open(r->g, NULL, &r->mine[1]), AKV_OK);
  assert_int_equal(akv_group_context_open(r->g, NULL, &closed), AKV_OK);
  assert_int_equal(akv_group_context_close(r->g, closed), AKV_OK);
  assert_int_equal(akv_group_context_open(r->other, NULL, &other_ctx), AKV_OK);
  pthread_barrier_wait(r->bar); /* both ranks' contexts exist */
  r->foreign = r->peer->mine[0];
#define STEP(list_, n_)                                  \
  do {                                                   \
    d = akv_engine_plan_digest(e);                       \
    r->st[k] = akv_group_step_begin(r->g, (list_), (n_)); \
    r->changed[k] = akv_engine_plan_digest(e) != d;      \
    k++;                                                 \
  } while (0)
  /* 0: n = 0 */
  STEP(r->mine, 0);
  /* 1: NULL array */
  STEP(NULL, 1);
  /* 2: huge n */
  STEP(r->mine, UINT32_MAX);
  /* 3: a NULL entry on rank 1 only */
  list[0] = r->mine[0];
  list[1] = r->rank == 1 ? NULL : r->mine[1];
  STEP(list, 2);
  /* 4: the same context twice, on every rank */
  list[0] = list[1] = r->mine[0];
  STEP(list, 2);
  /* 5: rank 0 names rank 1's context (another engine of the group) */
  list[0] = r->rank == 0 ? r->foreign : r->mine[0];
  STEP(list, 1);
  /* 6: a context of another group's engine on this thread */
  list[0] = r->rank == 0 ? other_ctx : r->mine[0];
  STEP(list, 1);
  /* 7: a closed context */
  list[0] = closed;
  STEP(list, 1);
  /* 8: handles of another type in place of a context */
  list[0] = r->rank == 1 ? (akv_context *)r->g : r->mine[0];
  STEP(list, 1);
  /* 9: close: another engine's context, a group handle, NULL */
  d = akv_engine_plan_digest(e);
  r->st[k] = akv_group_context_close(r->g, r->rank == 0 ? r->foreign : (akv_context *)e);
  r->changed[k++] = akv_engine_plan_digest(e) != d;
  /* 10: and the group goes on: a good step. */
  list[0] = r->mine[0];
  list[1] = r->mine[1];
  r->st[k++] = akv_group_step_begin(r->g, list, 2);
  if (r->st[k - 1] == AKV_OK) {
    akv_stream s;
    assert_int_equal(akv_stream_create(e, &s), AKV_OK);
    assert_int_equal(akvt_null_layers(e, s, LAYERS), AKV_OK);
    akv_stream_destroy(e, s);
  }
  /* 11 */
  r->st[k++] = akv_group_check(r->g);
#undef STEP
  akv_group_info_get(r->g, &info);
  r->stopped = info.stopped;
  akv_group_context_close(r->g, r->mine[0]);
  akv_group_context_close(r->g, r->mine[1]);
  akv_group_context_close(r->other, other_ctx);
  return NULL;
}

/* Promise (akv_group.h, "What every rank sees"): a local argument error on
 * any rank gives every rank the same status and changes nothing; foreign
 * and dead handles are AKV_ERR_BAD_HANDLE, never read as contexts. */
static void test_step_begin_bad_arrays(void **state) {
  (void)state;
  pair p;
  akv_group_world *w1;
  akv_group *lone[2] = {NULL, NULL};
  akv_engine_config ec = shard_config(4);
  akv_group_config gc = AKV_GROUP_CONFIG_INIT;
  arr_rank r[2];
  pthread_t th[2];
  pthread_barrier_t bar;
  static const akv_status want[12] = {
      AKV_ERR_INVALID_ARGUMENT, AKV_ERR_INVALID_ARGUMENT, AKV_ERR_INVALID_ARGUMENT,
      AKV_ERR_BAD_HANDLE,       AKV_ERR_INVALID_ARGUMENT, AKV_ERR_BAD_HANDLE,
      AKV_ERR_BAD_HANDLE,       AKV_ERR_BAD_HANDLE,       AKV_ERR_BAD_HANDLE,
      AKV_ERR_BAD_HANDLE,       AKV_OK,                   AKV_OK};
  pair_create(&p, 3000, AKV_GROUP_DIGEST_ON);
  /* A one-rank world for each rank's "other" group. */
  assert_int_equal(akv_group_world_create(1, 4, &w1), AKV_OK);
  assert_int_equal(akv_group_create_inproc(&ec, &gc, w1, &lone[0]), AKV_OK);
  pthread_barrier_init(&bar, NULL, 2);
  memset(r, 0, sizeof(r));
  for (uint32_t i = 0; i < 2; i++) {
    r[i].g = p.g[i];
    r[i].other = lone[0];
    r[i].rank = i;
    r[i].bar = &bar;
    r[i].peer = &r[1 - i];
  }
  /* Each rank's thread has a one-rank group of its own besides. */
  {
    akv_group_world *w2;
    assert_int_equal(akv_group_world_create(1, 4, &w2), AKV_OK);
    assert_int_equal(akv_group_create_inproc(&ec, &gc, w2, &lone[1]), AKV_OK);
    r[1].other = lone[1];
    for (uint32_t i = 0; i < 2; i++)
      assert_int_equal(pthread_create(&th[i], NULL, arr_rank_main, &r[i]), 0);
    for (uint32_t i = 0; i < 2; i++) pthread_join(th[i], NULL);
    assert_int_equal(akv_group_destroy(lone[1]), AKV_OK);
    assert_int_equal(akv_group_world_destroy(w2), AKV_OK);
  }
  for (uint32_t i = 0; i < 2; i++) {
    for (uint32_t k = 0; k < 12; k++) {
      if (r[i].st[k] != want[k]) fprintf(stderr, "rank %u call %u: %d, want %d\n", i, k, r[i].st[k], want[k]);
      assert_int_equal(r[i].st[k], want[k]);
      if (k < 10) assert_false(r[i].changed[k]);
    }
    assert_false(r[i].stopped);
  }
  pthread_barrier_destroy(&bar);
  assert_int_equal(akv_group_destroy(lone[0]), AKV_OK);
  assert_int_equal(akv_group_world_destroy(w1), AKV_OK);
  pair_destroy(&p);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_second_thread_of_a_rank_refused),
      cmocka_unit_test(test_destroy_while_another_thread_waits),
      cmocka_unit_test(test_reads_while_another_thread_waits),
      cmocka_unit_test(test_step_begin_bad_arrays),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
