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
#include <stdatomic.h>
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

/* Zeroes the two rank records of `r` and names their pair and rank. */
#define INIT_PAIR_RANKS(r, pp)                \
  for (uint32_t i_ = 0; i_ < 2; i_++) {       \
    memset(&(r)[i_], 0, sizeof((r)[i_]));     \
    (r)[i_].p = (pp);                         \
    (r)[i_].rank = i_;                        \
  }

/* fn on one thread per record of the array `r`, all joined. */
#define RUN_RANKS(fn, r, n) assert_int_equal(akvt_run_threads((fn), (r), sizeof((r)[0]), (n)), 0)

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
  pair_rank r[2];
  memset(p, 0, sizeof(*p));
  p->timeout_ms = timeout_ms;
  p->digest = digest;
  assert_int_equal(akv_group_world_create(2, 4, &p->world), AKV_OK);
  INIT_PAIR_RANKS(r, p);
  RUN_RANKS(pair_create_main, r, 2);
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

static void run_calls(call *calls, uint32_t n) { RUN_RANKS(call_main, calls, n); }

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
  {
    akv_engine_info einfo;
    assert_int_equal(akv_engine_info_get(e, &einfo), AKV_OK);
    assert_true(einfo.quarantined); /* a timeout quarantines the ranks that waited */
  }
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
    RUN_RANKS(arr_rank_main, r, 2);
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

/* ------------------------------------------- engine calls behind the back */

typedef struct behind_rank {
  pair *p;
  uint32_t rank;
  akv_status open, close_direct, close_group, after;
  uint32_t id;
  int stopped;
  akv_group_reason reason;
  akv_context *c;
} behind_rank;

static void *behind_rank_main(void *arg) {
  behind_rank *r = arg;
  akv_group *g = r->p->g[r->rank];
  akv_engine *e = NULL;
  akv_context *direct = NULL, *c = NULL;
  akv_group_info info;
  akv_group_engine(g, &e);
  /* Rank 0 opens a context on its engine directly (akv_group_engine says
   * not to): its engine's next id is no longer the others'. */
  if (r->rank == 0) assert_int_equal(akv_context_open(e, NULL, &direct), AKV_OK);
  r->open = akv_group_context_open(g, NULL, &c);
  if (r->open == AKV_OK) akv_context_id(c, &r->id);
  r->c = c;
  akv_group_info_get(g, &info);
  r->stopped = info.stopped;
  r->reason = info.reason;
  if (direct != NULL) akv_context_close(direct);
  if (c != NULL) akv_context_close(c);
  return NULL;
}

/* Promise (akv_group_context_open): "the context gets the same id on every
 * rank". With digests not compared (AKV_GROUP_DIGEST_DEFAULT in a release
 * build) a context opened directly on one rank's engine made the group's
 * next open hand out different ids on the ranks, every rank answering
 * AKV_OK; the ids are part of the open's outcome now: the ranks either get
 * the same id or every rank stops (DIVERGED, or DIGEST_MISMATCH where
 * digests are compared). */
static void test_open_ids_agree_or_stop(void **state) {
  (void)state;
  akv_group_digest modes[2] = {AKV_GROUP_DIGEST_DEFAULT, AKV_GROUP_DIGEST_ON};
  for (int m = 0; m < 2; m++) {
    pair p;
    behind_rank r[2];
    pair_create(&p, 3000, modes[m]);
    INIT_PAIR_RANKS(r, &p);
    RUN_RANKS(behind_rank_main, r, 2);
    assert_int_equal(r[0].open, r[1].open);
    if (r[0].open == AKV_OK) {
      assert_int_equal(r[0].id, r[1].id);
    } else {
      assert_int_equal(r[0].open, AKV_ERR_QUARANTINED);
      for (uint32_t i = 0; i < 2; i++) {
        assert_true(r[i].stopped);
        assert_true(r[i].reason == AKV_GROUP_DIVERGED ||
                    r[i].reason == AKV_GROUP_DIGEST_MISMATCH);
      }
    }
    pair_destroy(&p);
  }
}

typedef struct close_behind_rank {
  pair *p;
  uint32_t rank;
  akv_status open, direct, group_close, step;
  uint32_t len;
  akv_status len_st;
  int stopped;
} close_behind_rank;

static void *close_behind_main(void *arg) {
  close_behind_rank *r = arg;
  akv_group *g = r->p->g[r->rank];
  akv_context *c = NULL;
  akv_group_info info;
  r->open = akv_group_context_open(g, NULL, &c);
  if (r->open != AKV_OK) return NULL;
  if (r->rank == 0) r->direct = akv_context_close(c); /* behind the group's back */
  r->group_close = akv_group_context_close(g, c);
  r->step = akv_group_step_begin(g, &c, 1);
  r->len_st = akv_context_length(c, &r->len);
  akv_group_info_get(g, &info);
  r->stopped = info.stopped;
  if (r->rank == 1) akv_context_close(c);
  return NULL;
}

/* A context closed directly on one rank: the group's close and step of it
 * are refused on every rank (AKV_ERR_BAD_HANDLE, a local state error), and
 * the other rank's context stays open (nothing changed). */
static void test_context_closed_behind_the_group(void **state) {
  (void)state;
  pair p;
  close_behind_rank r[2];
  pair_create(&p, 3000, AKV_GROUP_DIGEST_DEFAULT);
  INIT_PAIR_RANKS(r, &p);
  RUN_RANKS(close_behind_main, r, 2);
  assert_int_equal(r[0].direct, AKV_OK);
  for (uint32_t i = 0; i < 2; i++) {
    assert_int_equal(r[i].open, AKV_OK);
    assert_int_equal(r[i].group_close, AKV_ERR_BAD_HANDLE);
    assert_int_equal(r[i].step, AKV_ERR_BAD_HANDLE);
    assert_false(r[i].stopped);
  }
  assert_int_equal(r[0].len_st, AKV_ERR_BAD_HANDLE);
  assert_int_equal(r[1].len_st, AKV_OK); /* still open on rank 1 */
  pair_destroy(&p);
}

/* --------------------------------------------- world teardown mid-call */

/* Promises (akv_group_world_destroy, akv_group_world_abort): destroy is
 * AKV_ERR_BUSY while a group lives, even one waiting at an agreement
 * point, and frees nothing; abort wakes the waiting rank at once with
 * AKV_ERR_COMM (well before its timeout), and every later agreement of
 * every rank is AKV_ERR_COMM, then AKV_ERR_QUARANTINED without waiting. */
static void test_world_teardown_mid_agreement(void **state) {
  (void)state;
  pair p;
  call waiting;
  pthread_t th;
  akv_group_info info;
  double t0;
  pair_create(&p, 2000, AKV_GROUP_DIGEST_ON);
  memset(&waiting, 0, sizeof(waiting));
  waiting.g = p.g[0];
  assert_int_equal(pthread_create(&th, NULL, call_main, &waiting), 0);
  sleep_ms(100);
  assert_int_equal(akv_group_world_destroy(p.world), AKV_ERR_BUSY);
  assert_int_equal(akv_group_world_abort(p.world), AKV_OK);
  pthread_join(th, NULL);
  assert_int_equal(waiting.st, AKV_ERR_COMM);
  assert_true(waiting.took_s < 1.0);
  assert_int_equal(akv_group_world_abort(p.world), AKV_OK); /* again: no change */
  t0 = now_s();
  assert_int_equal(akv_group_check(p.g[1]), AKV_ERR_COMM);
  assert_int_equal(akv_group_check(p.g[1]), AKV_ERR_QUARANTINED);
  assert_int_equal(akv_group_check(p.g[0]), AKV_ERR_QUARANTINED);
  assert_true(now_s() - t0 < 0.5);
  for (uint32_t i = 0; i < 2; i++) {
    assert_int_equal(akv_group_info_get(p.g[i], &info), AKV_OK);
    assert_true(info.stopped);
    assert_int_equal(info.reason, AKV_GROUP_COMM_FAILED);
    assert_int_equal(info.failed_rank, UINT32_MAX);
    assert_true(strlen(akv_group_last_error(p.g[i])) > 0);
  }
  assert_int_equal(akv_group_world_destroy(p.world), AKV_ERR_BUSY);
  pair_destroy(&p);
}

/* ------------------------------------------------------ handles */

/* Promise (akv_group_destroy, akv_group_world_destroy): a destroyed handle
 * is refused by every call, and is not handed out again by the next 32
 * creates; handles of another type are refused as bad handles, never read
 * as groups or worlds. */
static void test_dead_and_foreign_handles(void **state) {
  (void)state;
  akv_group_world *world, *dead_world;
  akv_group *g = NULL, *dead = NULL;
  akv_engine_config ec = shard_config(4);
  akv_group_config gc = AKV_GROUP_CONFIG_INIT;
  akv_engine *e = NULL, *lone = NULL;
  akv_context *c = NULL, *lc = NULL;
  akv_group_info info;
  assert_int_equal(akv_group_world_create(1, 4, &dead_world), AKV_OK);
  assert_int_equal(akv_group_world_destroy(dead_world), AKV_OK);
  assert_int_equal(akv_group_world_create(1, 4, &world), AKV_OK);
  assert_int_equal(akv_group_create_inproc(&ec, &gc, world, &dead), AKV_OK);
  assert_int_equal(akv_group_destroy(dead), AKV_OK);
  for (int i = 0; i < 32; i++) {
    assert_int_equal(akv_group_create_inproc(&ec, &gc, world, &g), AKV_OK);
    assert_ptr_not_equal(g, dead);
    assert_int_equal(akv_group_check(dead), AKV_ERR_BAD_HANDLE);
    assert_int_equal(akv_group_destroy(dead), AKV_ERR_BAD_HANDLE);
    assert_int_equal(akv_group_destroy(g), AKV_OK);
  }
  assert_int_equal(akv_group_context_open(dead, NULL, &c), AKV_ERR_BAD_HANDLE);
  assert_null(c);
  assert_int_equal(akv_group_context_close(dead, NULL), AKV_ERR_BAD_HANDLE);
  assert_int_equal(akv_group_step_begin(dead, &c, 1), AKV_ERR_BAD_HANDLE);
  assert_int_equal(akv_group_info_get(dead, &info), AKV_ERR_BAD_HANDLE);
  assert_int_equal(akv_group_engine(dead, &e), AKV_ERR_BAD_HANDLE);
  assert_string_equal(akv_group_last_error(dead), "bad group handle");
  /* Foreign handles: a world, an engine, a context as a group; a group as
   * a world. */
  assert_int_equal(akv_group_create_inproc(&ec, &gc, world, &g), AKV_OK);
  assert_int_equal(akv_engine_create(&ec, &lone), AKV_OK);
  assert_int_equal(akv_context_open(lone, NULL, &lc), AKV_OK);
  {
    akv_group *fakes[3] = {(akv_group *)world, (akv_group *)lone, (akv_group *)lc};
    for (int i = 0; i < 3; i++) {
      assert_int_equal(akv_group_check(fakes[i]), AKV_ERR_BAD_HANDLE);
      assert_int_equal(akv_group_context_open(fakes[i], NULL, &c), AKV_ERR_BAD_HANDLE);
      assert_int_equal(akv_group_info_get(fakes[i], &info), AKV_ERR_BAD_HANDLE);
      assert_int_equal(akv_group_engine(fakes[i], &e), AKV_ERR_BAD_HANDLE);
      assert_string_equal(akv_group_last_error(fakes[i]), "bad group handle");
      assert_int_equal(akv_group_destroy(fakes[i]), AKV_ERR_BAD_HANDLE);
    }
  }
  /* A pointer into the middle of a live group: refused, and nothing of the
   * group written through it. */
  {
    akv_group *mid = (akv_group *)((char *)g + 8);
    assert_int_equal(akv_group_check(mid), AKV_ERR_BAD_HANDLE);
    assert_int_equal(akv_group_destroy(mid), AKV_ERR_BAD_HANDLE);
    assert_string_equal(akv_group_last_error(mid), "bad group handle");
  }
  assert_int_equal(akv_group_world_abort((akv_group_world *)g), AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_group_world_destroy((akv_group_world *)g), AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_group_world_destroy((akv_group_world *)lone), AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_group_create_inproc(&ec, &gc, (akv_group_world *)g, &dead),
                   AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_group_create_inproc(&ec, &gc, dead_world, &dead),
                   AKV_ERR_INVALID_ARGUMENT);
  /* Never-created handles: memory that reads as a group or a world (their
   * magic in every word) but was never handed out. Refused, never read as
   * one (its "engine" and "world" pointers are the magic's bytes). */
  {
    static uint32_t forged[512];
    for (size_t i = 0; i < 512; i++) forged[i] = i & 1 ? 0x57564b41u : 0x474b5641u;
    for (size_t off = 0; off < 2; off++) {
      akv_group *fg = (akv_group *)&forged[off];
      akv_group_world *fw = (akv_group_world *)&forged[off];
      assert_int_equal(akv_group_check(fg), AKV_ERR_BAD_HANDLE);
      assert_int_equal(akv_group_info_get(fg, &info), AKV_ERR_BAD_HANDLE);
      assert_int_equal(akv_group_destroy(fg), AKV_ERR_BAD_HANDLE);
      assert_int_equal(akv_group_world_abort(fw), AKV_ERR_INVALID_ARGUMENT);
      assert_int_equal(akv_group_world_destroy(fw), AKV_ERR_INVALID_ARGUMENT);
      assert_int_equal(akv_group_create_inproc(&ec, &gc, fw, &dead), AKV_ERR_INVALID_ARGUMENT);
    }
    for (size_t i = 0; i < 512; i++) forged[i] = 0x474b5641u; /* both magics of a group */
    assert_int_equal(akv_group_check((akv_group *)forged), AKV_ERR_BAD_HANDLE);
    assert_int_equal(akv_group_destroy((akv_group *)forged), AKV_ERR_BAD_HANDLE);
  }
  /* A destroyed world is not handed out again by the next 32 creates. */
  for (int i = 0; i < 32; i++) {
    akv_group_world *w;
    assert_int_equal(akv_group_world_create(1, 4, &w), AKV_OK);
    assert_ptr_not_equal(w, dead_world);
    assert_int_equal(akv_group_world_abort(dead_world), AKV_ERR_INVALID_ARGUMENT);
    assert_int_equal(akv_group_world_destroy(w), AKV_OK);
  }
  /* Another engine's context, closed or open, to the group. */
  assert_int_equal(akv_group_context_close(g, lc), AKV_ERR_BAD_HANDLE);
  assert_int_equal(akv_group_step_begin(g, &lc, 1), AKV_ERR_BAD_HANDLE);
  assert_int_equal(akv_context_close(lc), AKV_OK);
  assert_int_equal(akv_engine_destroy(lone), AKV_OK);
  assert_int_equal(akv_group_check(g), AKV_OK);
  assert_int_equal(akv_group_info_get(g, &info), AKV_OK);
  assert_false(info.stopped);
  assert_int_equal(akv_group_destroy(g), AKV_OK);
  assert_int_equal(akv_group_world_destroy(world), AKV_OK);
}

/* ----------------------------------------------- destroy from a callback */

typedef struct cb_destroy {
  akv_group *g;
  int armed;
  akv_status destroy, info;
} cb_destroy;

static void cb_destroy_log(void *user, akv_log_level level, const char *message) {
  cb_destroy *d = user;
  akv_group_info info;
  (void)level;
  if (!d->armed || strncmp(message, "group rank", 10) != 0) return;
  d->armed = 0;
  d->destroy = akv_group_destroy(d->g);
  d->info = akv_group_info_get(d->g, &info);
}

/* Promise (akv_group_destroy): nothing is freed while a call of the group
 * is in progress. From the group's own log callback, inside a group call
 * (the warning of a stop), a destroy freed the group under the call that
 * logged; it is AKV_ERR_IN_USE, and the group stays readable. */
static void test_destroy_from_group_log_in_a_call(void **state) {
  (void)state;
  akv_group_world *world;
  akv_group *g = NULL;
  akv_engine_config ec = shard_config(4);
  akv_group_config gc = AKV_GROUP_CONFIG_INIT;
  cb_destroy d;
  memset(&d, 0, sizeof(d));
  ec.log_fn = cb_destroy_log;
  ec.log_user = &d;
  ec.log_level = AKV_LOG_WARN;
  assert_int_equal(akv_group_world_create(1, 4, &world), AKV_OK);
  assert_int_equal(akv_group_create_inproc(&ec, &gc, world, &g), AKV_OK);
  d.g = g;
  assert_int_equal(akv_group_world_abort(world), AKV_OK);
  d.armed = 1;
  assert_int_equal(akv_group_check(g), AKV_ERR_COMM);
  assert_int_equal(d.destroy, AKV_ERR_IN_USE);
  assert_int_equal(d.info, AKV_OK); /* the same thread reads */
  assert_int_equal(akv_group_destroy(g), AKV_OK);
  assert_int_equal(akv_group_world_destroy(world), AKV_OK);
}

/* ------------------------------------------------ a peer that leaves */

typedef struct leaver {
  pair *p;
  uint32_t rank;
  akv_status check, destroy, recreate, open;
  akv_context *c;
  double check_s;
} leaver;

static void *leaver_main(void *arg) {
  leaver *r = arg;
  akv_engine_config ec = shard_config(4);
  akv_group_config gc = AKV_GROUP_CONFIG_INIT;
  akv_group *g2 = NULL;
  double t0;
  if (r->rank == 1) {
    /* Destroys its group instead of making the agreement call, then
     * comes back with a new one. */
    r->destroy = akv_group_destroy(r->p->g[1]);
    r->p->g[1] = NULL;
    sleep_ms(400);
    gc.rank = 1;
    gc.size = 2;
    gc.timeout_ms = 200;
    r->recreate = akv_group_create_inproc(&ec, &gc, r->p->world, &g2);
    if (r->recreate == AKV_OK) akv_group_destroy(g2);
    return NULL;
  }
  t0 = now_s();
  r->c = (akv_context *)&r->c; /* not NULL: a refused open leaves it */
  r->open = akv_group_context_open(r->p->g[0], NULL, &r->c);
  r->check_s = now_s() - t0;
  r->check = akv_group_check(r->p->g[0]);
  return NULL;
}

/* A rank that destroys its group (not a collective) while the other makes
 * an agreement call: the waiting rank returns AKV_ERR_TIMEOUT within its
 * timeout (plus a poll interval) with *out untouched, then
 * AKV_ERR_QUARANTINED at once; the leaver's new group in the aborted world
 * is refused with the abort's status; the world frees once every group is
 * gone. */
static void test_peer_destroys_instead_of_calling(void **state) {
  (void)state;
  pair p;
  leaver r[2];
  akv_group_info info;
  pair_create(&p, 200, AKV_GROUP_DIGEST_ON);
  INIT_PAIR_RANKS(r, &p);
  RUN_RANKS(leaver_main, r, 2);
  assert_int_equal(r[1].destroy, AKV_OK);
  assert_int_equal(r[0].open, AKV_ERR_TIMEOUT);
  assert_ptr_equal(r[0].c, (akv_context *)&r[0].c);
  assert_true(r[0].check_s < 1.0);
  assert_int_equal(r[0].check, AKV_ERR_QUARANTINED);
  assert_int_equal(r[1].recreate, AKV_ERR_TIMEOUT);
  assert_int_equal(akv_group_info_get(p.g[0], &info), AKV_OK);
  assert_true(info.stopped);
  assert_int_equal(info.reason, AKV_GROUP_TIMEOUT);
  assert_int_equal(info.failed_rank, UINT32_MAX);
  /* The last error is the later refusal's, which says the group stopped. */
  assert_non_null(strstr(akv_group_last_error(p.g[0]), "stopped"));
  assert_int_equal(akv_group_world_destroy(p.world), AKV_ERR_BUSY); /* rank 0's group */
  assert_int_equal(akv_group_destroy(p.g[0]), AKV_OK);
  assert_int_equal(akv_group_world_destroy(p.world), AKV_OK);
}

/* ------------------------------------------------ contention */

typedef struct hammer {
  akv_group *g;
  uint32_t ok, in_use, other;
} hammer;

static void *hammer_main(void *arg) {
  hammer *h = arg;
  akv_group_info info;
  for (int i = 0; i < 2000; i++) {
    akv_status st = (i & 3) == 3 ? akv_group_info_get(h->g, &info) : akv_group_check(h->g);
    if (st == AKV_OK && (i & 3) != 3)
      h->ok++;
    else if (st == AKV_ERR_IN_USE)
      h->in_use++;
    else if (st != AKV_OK)
      h->other++;
  }
  return NULL;
}

/* Threads hammering one group of a one-rank world (each check completes at
 * once): every call either runs alone or is refused with AKV_ERR_IN_USE;
 * no agreement is lost or doubled (the count of agreements is the count of
 * checks that passed) and the group never stops. Under TSan this is the
 * claim's race test. */
static void test_threads_hammer_one_group(void **state) {
  (void)state;
  akv_group_world *world;
  akv_group *g = NULL;
  akv_engine_config ec = shard_config(4);
  akv_group_config gc = AKV_GROUP_CONFIG_INIT;
  akv_group_info info;
  hammer h[3];
  uint64_t before;
  assert_int_equal(akv_group_world_create(1, 4, &world), AKV_OK);
  assert_int_equal(akv_group_create_inproc(&ec, &gc, world, &g), AKV_OK);
  assert_int_equal(akv_group_info_get(g, &info), AKV_OK);
  before = info.agreements;
  memset(h, 0, sizeof(h));
  for (int i = 0; i < 3; i++) h[i].g = g;
  RUN_RANKS(hammer_main, h, 3);
  assert_int_equal(akv_group_info_get(g, &info), AKV_OK);
  assert_false(info.stopped);
  assert_int_equal(info.agreements - before, h[0].ok + h[1].ok + h[2].ok);
  for (int i = 0; i < 3; i++) assert_int_equal(h[i].other, 0);
  assert_int_equal(akv_group_destroy(g), AKV_OK);
  assert_int_equal(akv_group_world_destroy(world), AKV_OK);
}

/* ------------------------------------------ an agreement from the callback */

typedef struct cb_check {
  akv_group *g;
  int armed;
  akv_status nested;
} cb_check;

static void cb_check_log(void *user, akv_log_level level, const char *message) {
  cb_check *d = user;
  (void)level;
  if (!d->armed || strncmp(message, "group rank", 10) != 0) return;
  d->armed = 0;
  d->nested = akv_group_check(d->g);
}

/* Promise (akv_group.h, Logging): an agreement call made from the group's
 * own log callback is one of the rank's sequence; the claim of the thread
 * already inside (akv_group_claim) lets it through: it runs its
 * collective and passes. */
static void test_agreement_from_group_log_still_runs(void **state) {
  (void)state;
  akv_group_world *world;
  akv_group *g = NULL;
  akv_engine_config ec = shard_config(4);
  akv_group_config gc = AKV_GROUP_CONFIG_INIT;
  akv_group_info info;
  uint64_t before;
  cb_check d;
  memset(&d, 0, sizeof(d));
  ec.log_fn = cb_check_log;
  ec.log_user = &d;
  ec.log_level = AKV_LOG_WARN;
  assert_int_equal(akv_group_world_create(1, 4, &world), AKV_OK);
  assert_int_equal(akv_group_create_inproc(&ec, &gc, world, &g), AKV_OK);
  d.g = g;
  assert_int_equal(akv_group_info_get(g, &info), AKV_OK);
  before = info.agreements;
  d.armed = 1;
  assert_int_equal(akv_group_step_begin(g, NULL, 1), AKV_ERR_INVALID_ARGUMENT); /* warns */
  assert_int_equal(d.nested, AKV_OK);
  assert_int_equal(akv_group_info_get(g, &info), AKV_OK);
  assert_int_equal(info.agreements, before + 2);
  assert_false(info.stopped);
  assert_int_equal(akv_group_destroy(g), AKV_OK);
  assert_int_equal(akv_group_world_destroy(world), AKV_OK);
}

/* ------------------------------------------------ different calls */

typedef enum kind { K_OPEN, K_CLOSE, K_STEP, K_CHECK, K_CLOSE_NULL } kind;

typedef struct mixed_rank {
  pair *p;
  uint32_t rank;
  kind k;
  akv_status st;
  double took_s;
  akv_group_info info;
  akv_engine_info einfo;
} mixed_rank;

static void *mixed_main(void *arg) {
  mixed_rank *r = arg;
  akv_group *g = r->p->g[r->rank];
  akv_context *c = NULL, *c2 = NULL;
  akv_engine *e = NULL;
  double t0;
  akv_group_engine(g, &e);
  assert_int_equal(akv_group_context_open(g, NULL, &c), AKV_OK);
  t0 = now_s();
  switch (r->k) {
    case K_OPEN: r->st = akv_group_context_open(g, NULL, &c2); break;
    case K_CLOSE: r->st = akv_group_context_close(g, c); break;
    case K_STEP: r->st = akv_group_step_begin(g, &c, 1); break;
    case K_CHECK: r->st = akv_group_check(g); break;
    case K_CLOSE_NULL: r->st = akv_group_context_close(g, NULL); break;
  }
  r->took_s = now_s() - t0;
  akv_group_info_get(g, &r->info);
  akv_engine_info_get(e, &r->einfo);
  return NULL;
}

/* Promise (akv_group.h, Thread safety): a rank that makes a different call
 * meets the others at a point of another kind, which quarantines all: every
 * pair of different calls (a local argument error on one side included)
 * ends with AKV_ERR_QUARANTINED, reason DIVERGED, on both ranks, at once
 * (no timeout), both engines quarantined. */
static void test_different_calls_every_pair(void **state) {
  (void)state;
  static const kind pairs[][2] = {{K_OPEN, K_CLOSE}, {K_STEP, K_CHECK}, {K_CLOSE, K_STEP},
                                  {K_OPEN, K_CHECK}, {K_CLOSE_NULL, K_CHECK}};
  for (size_t i = 0; i < sizeof(pairs) / sizeof(pairs[0]); i++) {
    pair p;
    mixed_rank r[2];
    pair_create(&p, 2000, AKV_GROUP_DIGEST_DEFAULT);
    INIT_PAIR_RANKS(r, &p);
    r[0].k = pairs[i][0];
    r[1].k = pairs[i][1];
    RUN_RANKS(mixed_main, r, 2);
    for (uint32_t k = 0; k < 2; k++) {
      assert_int_equal(r[k].st, AKV_ERR_QUARANTINED);
      assert_true(r[k].took_s < 1.0);
      assert_true(r[k].info.stopped);
      assert_int_equal(r[k].info.reason, AKV_GROUP_DIVERGED);
      assert_true(r[k].einfo.quarantined);
    }
    pair_destroy(&p);
  }
}

/* ------------------------------------------------ cancellation */

typedef struct cancelled {
  akv_group *g;
  volatile akv_status st;
  volatile int returned;
} cancelled;

static void *cancelled_main(void *arg) {
  cancelled *c = arg;
  c->st = akv_group_check(c->g);
  c->returned = 1;
  pthread_testcancel(); /* the pending cancel acts here */
  c->returned = 2;
  return NULL;
}

/* Promise (akv_group.h, Thread safety): group calls are not cancellation
 * points. A rank thread cancelled while it waited at an agreement point
 * died inside pthread_cond_timedwait holding the in-process world's mutex:
 * the other rank's next call then blocked on that mutex for good (no
 * timeout frees it) and the group stayed claimed by the dead thread. The
 * call now runs to its end (here AKV_ERR_TIMEOUT: rank 1 did not come in
 * time), the cancel acts at the caller's next cancellation point, the late
 * rank gets the timeout at once and both groups are destroyed. */
static void test_cancelled_thread_in_agreement(void **state) {
  (void)state;
  pair p;
  cancelled c;
  pthread_t th;
  void *ret = NULL;
  double t0;
  pair_create(&p, 300, AKV_GROUP_DIGEST_ON);
  memset(&c, 0, sizeof(c));
  c.g = p.g[0];
  assert_int_equal(pthread_create(&th, NULL, cancelled_main, &c), 0);
  sleep_ms(100);
  assert_int_equal(pthread_cancel(th), 0);
  assert_int_equal(pthread_join(th, &ret), 0);
  assert_ptr_equal(ret, PTHREAD_CANCELED);
  assert_int_equal(c.returned, 1);
  assert_int_equal(c.st, AKV_ERR_TIMEOUT);
  t0 = now_s();
  assert_int_equal(akv_group_check(p.g[1]), AKV_ERR_TIMEOUT);
  assert_true(now_s() - t0 < 0.2);
  pair_destroy(&p);
}

/* ------------------------------------------------ stale handles, racing */

typedef struct churn {
  akv_group_world *world;
  _Atomic(akv_group *) latest;
  atomic_int done;
  uint32_t bad; /* statuses outside the allowed sets */
  uint32_t calls_ok, refused;
} churn;

static void *churn_caller_main(void *arg) {
  churn *c = arg;
  akv_group_info info;
  while (!atomic_load(&c->done)) {
    akv_group *g = atomic_load(&c->latest);
    akv_status a = akv_group_check(g), b = akv_group_info_get(g, &info);
    const char *m = akv_group_last_error(g);
    if (a == AKV_OK) c->calls_ok++;
    if (a == AKV_ERR_BAD_HANDLE || a == AKV_ERR_IN_USE) c->refused++;
    if ((a != AKV_OK && a != AKV_ERR_BAD_HANDLE && a != AKV_ERR_IN_USE) ||
        (b != AKV_OK && b != AKV_ERR_BAD_HANDLE && b != AKV_ERR_IN_USE) || m == NULL)
      c->bad++;
  }
  return NULL;
}

/* A thread that keeps calling on whatever group handle it last saw while
 * another creates and destroys groups (a careless caller: calls on a group
 * being destroyed, on one destroyed, and on its record handed out again):
 * every call answers OK, AKV_ERR_BAD_HANDLE or AKV_ERR_IN_USE, never reads
 * freed memory (ASan) or races (TSan); a destroy refused because the other
 * thread is inside a call succeeds when retried. */
static void test_calls_racing_create_and_destroy(void **state) {
  (void)state;
  churn c;
  pthread_t th;
  akv_engine_config ec = shard_config(4);
  akv_group_config gc = AKV_GROUP_CONFIG_INIT;
  uint32_t destroy_retries = 0;
  memset(&c, 0, sizeof(c));
  assert_int_equal(akv_group_world_create(1, 4, &c.world), AKV_OK);
  atomic_store(&c.latest, NULL);
  assert_int_equal(pthread_create(&th, NULL, churn_caller_main, &c), 0);
  for (int i = 0; i < 150; i++) {
    akv_group *g = NULL;
    akv_status st = akv_group_create_inproc(&ec, &gc, c.world, &g);
    assert_int_equal(st, AKV_OK);
    atomic_store(&c.latest, g);
    for (int k = 0; k < 3; k++) {
      st = akv_group_check(g);
      assert_true(st == AKV_OK || st == AKV_ERR_IN_USE);
    }
    while ((st = akv_group_destroy(g)) == AKV_ERR_IN_USE) destroy_retries++;
    assert_int_equal(st, AKV_OK);
  }
  atomic_store(&c.done, 1);
  pthread_join(th, NULL);
  assert_int_equal(c.bad, 0);
  assert_int_equal(akv_group_world_destroy(c.world), AKV_OK);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_second_thread_of_a_rank_refused),
      cmocka_unit_test(test_destroy_while_another_thread_waits),
      cmocka_unit_test(test_reads_while_another_thread_waits),
      cmocka_unit_test(test_step_begin_bad_arrays),
      cmocka_unit_test(test_open_ids_agree_or_stop),
      cmocka_unit_test(test_context_closed_behind_the_group),
      cmocka_unit_test(test_world_teardown_mid_agreement),
      cmocka_unit_test(test_dead_and_foreign_handles),
      cmocka_unit_test(test_destroy_from_group_log_in_a_call),
      cmocka_unit_test(test_peer_destroys_instead_of_calling),
      cmocka_unit_test(test_threads_hammer_one_group),
      cmocka_unit_test(test_agreement_from_group_log_still_runs),
      cmocka_unit_test(test_different_calls_every_pair),
      cmocka_unit_test(test_cancelled_thread_in_agreement),
      cmocka_unit_test(test_calls_racing_create_and_destroy),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
