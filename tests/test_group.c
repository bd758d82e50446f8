/*
 * test_group.c - tensor parallel agreement (src/dist) on the host backend,
 * threads as ranks over the in-process collective.
 *
 * Each rank runs in its own thread and records what it saw; the checks run
 * on the main thread after every rank joined.
 *  - ranks with different local pools, concurrency and requested targets
 *    end with identical plans (digests and admission logs at every step),
 *    while the same engines without agreement diverge (the check has teeth);
 *  - one rank's injected transport fault quarantines every rank at the same
 *    agreement point;
 *  - a rank that never arrives times out cleanly on every rank, and the late
 *    rank is refused at once;
 *  - a communicator failure, a digest mismatch, different calls, different
 *    inputs and a local argument error each end the same way on every rank.
 */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <sched.h>
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
#include "testutil.h"
#include "coll_inproc.h"
#include "group.h"
#include "plan.h"

#define MAX_RANKS 4
#define MAX_STEPS 12
#define LOG_CAP 256

/* Geometry: 8 layers of 2 x 8 bf16 (64 B per K+V pair), 64 Ki tokens per
 * context: 32 MiB of history, so a 1 GiB host pool fits 32 contexts and a
 * 2 GiB one 64. Pages of 1024 tokens (512 KiB), 2048 per device GiB. */
#define LAYERS 8
#define KV_HEADS 2
#define HEAD_DIM 8
#define MAX_TOKENS 65536
#define PAGE_TOKENS 1024

static void quiet(void *user, akv_log_level level, const char *message) {
  (void)user;
  (void)level;
  (void)message;
}

/* Two ranks on their own threads: fn(a) and fn(b), both joined before it
 * returns (the tests with a rank record of their own type). */
static void run_two_ranks(void *(*fn)(void *), void *a, void *b) {
  assert_int_equal(akvt_run_threads(fn, a, (size_t)((char *)b - (char *)a), 2), 0);
}

/* Zeroes the two rank records of `r` and names their world and rank. */
#define INIT_TWO_RANKS(r, world_)                  \
  for (uint32_t i_ = 0; i_ < 2; i_++) {            \
    memset(&(r)[i_], 0, sizeof((r)[i_]));          \
    (r)[i_].world = (world_);                      \
    (r)[i_].rank = i_;                             \
  }

static akv_engine_config shard_config(uint32_t host_gib, uint32_t dev_gib, uint32_t max_contexts) {
  akv_engine_config c = AKV_ENGINE_CONFIG_INIT;
  c.backend = AKV_BACKEND_HOST;
  c.n_dense_layers = LAYERS;
  c.kv_heads = KV_HEADS;
  c.head_dim = HEAD_DIM;
  c.max_tokens = MAX_TOKENS;
  c.page_tokens = PAGE_TOKENS;
  c.host_pool_gib = host_gib;
  c.device_pool_gib = dev_gib;
  c.max_contexts = max_contexts;
  c.fit_mode = AKV_FIT_SHRINK;
  c.route = AKV_ROUTE_ARENA;
  c.log_fn = quiet;
  return c;
}

/* ------------------------------------------------------------ one rank */

typedef enum scenario {
  SC_PRESSURE = 0, /* different local inputs, identical plans */
  SC_FAULT,        /* rank `special` fails a copy mid-run */
  SC_MISSING,      /* rank `special` stops arriving after step `special_step` */
  SC_ABORT,        /* the world is aborted while ranks wait */
  SC_DIGEST,       /* rank `special` opens a context behind the group's back */
  SC_DIVERGED,     /* rank `special` makes a different call */
  SC_DISAGREE,     /* different step inputs, then a local argument error */
  SC_GEOMETRY      /* rank `special` has a different kv_heads */
} scenario;

typedef struct world_run world_run;

typedef struct rank_run {
  world_run *w;
  uint32_t rank;
  /* what the rank saw */
  akv_status create;
  akv_status opens[40];
  uint32_t n_opens;
  akv_status steps[MAX_STEPS];
  uint64_t digests[MAX_STEPS];
  uint32_t n_steps;
  akv_adm_decision log[LOG_CAP];
  size_t n_log;
  akv_status last;         /* the status that ended the run */
  akv_status after;        /* a group call after the end */
  double last_wait_s;      /* wall time of the call that ended the run */
  akv_group_info info;
  akv_engine_info einfo;
  akv_status destroy;
  akv_status extra[4];     /* scenario-specific */
} rank_run;

struct world_run {
  scenario sc;
  uint32_t size;
  uint32_t special;
  uint32_t special_step;
  uint32_t timeout_ms;
  akv_inproc_world *world;
  rank_run ranks[MAX_RANKS];
};

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* One decode step's leases on this rank's engine (after the group's
 * step_begin). Returns the first failing status. */
static akv_status run_layers(akv_engine *e, akv_stream s) {
  return akvt_null_layers(e, s, LAYERS);
}

/* Prefill `n` rows of zeros into every layer. */
static akv_status prefill(akv_context *c, uint32_t n) {
  static const uint8_t zeros[4096 * 2 * KV_HEADS * HEAD_DIM];
  const void *rows[LAYERS];
  akv_status st = AKV_OK;
  for (uint32_t l = 0; l < LAYERS; l++) rows[l] = zeros;
  while (n > 0 && st == AKV_OK) {
    uint32_t k = n < 4096 ? n : 4096;
    st = akv_context_append(c, k, rows, rows);
    n -= k;
  }
  return st;
}

/* Each rank's own idea of a context's target and burst: they differ, the
 * group uses the MIN (target 3, burst 1). */
static akv_context_config local_context_config(uint32_t rank) {
  akv_context_config cc = AKV_CONTEXT_CONFIG_INIT;
  cc.target_pages = rank == 0 ? AKV_TARGET_FAIR_SHARE : 2 + rank;
  cc.burst_pages = 1 + rank;
  return cc;
}

static void *rank_main(void *arg) {
  rank_run *r = arg;
  world_run *w = r->w;
  akv_group_config gc = AKV_GROUP_CONFIG_INIT;
  akv_engine_config ec = shard_config(1 + r->rank, 1 + r->rank, 34 + r->rank);
  akv_coll *coll = NULL;
  akv_group *g = NULL;
  akv_engine *e = NULL;
  akv_stream s = NULL;
  akv_context *ctx[40];
  uint32_t n_ctx = 0;
  akv_status st;
  double t0;

  gc.rank = r->rank;
  gc.size = w->size;
  gc.timeout_ms = w->timeout_ms;
  gc.digest = AKV_GROUP_DIGEST_ON;
  if (w->sc == SC_FAULT && r->rank == w->special) {
    ec.fault_fail_nth = 30; /* a copy of step 3 or so */
    ec.fault_kind = AKV_OP_COPY;
  }
  if (w->sc == SC_GEOMETRY && r->rank == w->special) ec.kv_heads = 2 * KV_HEADS;
  r->last = AKV_OK;
  if (akv_inproc_coll_create(w->world, r->rank, &coll) != AKV_OK) {
    r->create = AKV_ERR_OUT_OF_MEMORY;
    return NULL;
  }
  r->create = akv_group_create_with(&ec, &gc, coll, &g);
  if (r->create != AKV_OK) {
    coll->ops->destroy(coll);
    return NULL;
  }
  akv_group_engine(g, &e);
  akv_stream_create(e, &s);

  /* Opens: up to the agreed concurrency (32: the smallest host pool) and
   * one past it. */
  {
    const uint32_t n_open = w->sc == SC_PRESSURE ? 33 : 3;
    for (uint32_t i = 0; i < n_open; i++) {
      akv_context_config cc = local_context_config(r->rank);
      akv_context *c = NULL;
      st = akv_group_context_open(g, &cc, &c);
      r->opens[r->n_opens++] = st;
      if (st == AKV_OK) ctx[n_ctx++] = c;
    }
  }
  /* Prefill the first three: 3, 2 and 5 full pages plus a partial one. */
  for (uint32_t i = 0; i < 3 && i < n_ctx; i++) prefill(ctx[i], (i == 1 ? 2 : 3 + 2 * (i == 2)) * PAGE_TOKENS + 7);

  if (w->sc == SC_DIGEST && r->rank == w->special) {
    akv_context *sneak;
    r->extra[0] = akv_context_open(e, NULL, &sneak); /* behind the group's back */
  }
  if (w->sc == SC_DISAGREE) {
    /* Different contexts on rank `special`: DISAGREE everywhere, nothing
     * changes; then a NULL list on rank `special`: INVALID_ARGUMENT
     * everywhere; the digests stay what they were. */
    uint64_t before = akv_engine_plan_digest(e);
    r->extra[0] = akv_group_step_begin(g, ctx, r->rank == w->special ? 2 : 3);
    r->extra[1] = akv_group_step_begin(g, r->rank == w->special ? NULL : ctx, 3);
    r->extra[2] = akv_engine_plan_digest(e) == before ? AKV_OK : AKV_ERR_DISAGREE;
  }

  for (uint32_t step = 0; step < MAX_STEPS; step++) {
    /* The later steps leave context 1 out: its pages become idle. */
    const uint32_t n = step < 6 ? 3 : 2;
    akv_context *list[3] = {ctx[0], step < 6 ? ctx[1] : ctx[2], ctx[2]};
    if (w->sc == SC_MISSING && r->rank == w->special && step == w->special_step) {
      /* This rank stops arriving; it comes back only after the others gave
       * up, and must be refused at once. */
      struct timespec ts = {0, (long)w->timeout_ms * 3 * 1000000L};
      while (ts.tv_nsec >= 1000000000L) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000L;
      }
      nanosleep(&ts, NULL);
    }
    if (w->sc == SC_ABORT && r->rank == w->special && step == w->special_step) {
      struct timespec ts = {0, 50 * 1000000L};
      nanosleep(&ts, NULL);
      akv_inproc_world_abort(w->world, "asynchronous error injected by the test");
    }
    t0 = now_s();
    if (w->sc == SC_DIVERGED && r->rank == w->special && step == w->special_step)
      st = akv_group_check(g);
    else
      st = akv_group_step_begin(g, list, n);
    r->last_wait_s = now_s() - t0;
    r->steps[r->n_steps] = st;
    r->digests[r->n_steps] = akv_engine_plan_digest(e);
    r->n_steps++;
    if (st != AKV_OK) {
      r->last = st;
      break;
    }
    st = run_layers(e, s);
    /* A failed step leaves this rank's transport failed; the next
     * agreement point tells every rank. */
    (void)st;
  }
  r->n_log = 0;
  akv_admission_log(e, r->log, LOG_CAP, &r->n_log);
  r->after = akv_group_check(g);
  akv_group_info_get(g, &r->info);
  akv_engine_info_get(e, &r->einfo);
  /* Without a quarantine the engine still holds contexts: close them
   * through the group where it is healthy, then destroy. */
  if (!r->info.stopped) {
    for (uint32_t i = 0; i < n_ctx; i++) akv_group_context_close(g, ctx[i]);
  }
  akv_stream_destroy(e, s);
  r->destroy = akv_group_destroy(g);
  return NULL;
}

static void run_world(world_run *w) {
  pthread_t th[MAX_RANKS];
  assert_int_equal(akv_inproc_world_create(w->size, akv_group_vector_len(64), &w->world), AKV_OK);
  for (uint32_t r = 0; r < w->size; r++) {
    w->ranks[r].w = w;
    w->ranks[r].rank = r;
    assert_int_equal(pthread_create(&th[r], NULL, rank_main, &w->ranks[r]), 0);
  }
  for (uint32_t r = 0; r < w->size; r++) pthread_join(th[r], NULL);
  akv_inproc_world_destroy(w->world);
}

static world_run *new_world(scenario sc, uint32_t size) {
  static world_run the_world; /* one test at a time */
  world_run *w = &the_world;
  memset(w, 0, sizeof(*w));
  w->sc = sc;
  w->size = size;
  w->special = size - 1;
  w->special_step = 2;
  w->timeout_ms = 20000;
  return w;
}

/* ------------------------------------------------------------ tests */

/* Same opens and steps on engines created from each rank's local config,
 * without a group: the plans differ (the agreement is what makes them
 * equal, not the workload). Returns the digest after `steps` steps. */
static uint64_t ungrouped_digest(uint32_t rank, uint32_t steps, akv_status *open33) {
  akv_engine_config ec = shard_config(1 + rank, 1 + rank, 34 + rank);
  akv_engine *e;
  akv_stream s;
  akv_context *ctx[40];
  uint32_t n = 0;
  uint64_t d;
  assert_int_equal(akv_engine_create(&ec, &e), AKV_OK);
  assert_int_equal(akv_stream_create(e, &s), AKV_OK);
  for (uint32_t i = 0; i < 33; i++) {
    akv_context_config cc = local_context_config(rank);
    akv_status st = akv_context_open(e, &cc, &ctx[n]);
    if (st == AKV_OK) n++;
    if (i == 32) *open33 = st;
  }
  for (uint32_t i = 0; i < 3; i++) prefill(ctx[i], (i == 1 ? 2 : 3 + 2 * (i == 2)) * PAGE_TOKENS + 7);
  for (uint32_t step = 0; step < steps; step++) {
    akv_context *list[3] = {ctx[0], step < 6 ? ctx[1] : ctx[2], ctx[2]};
    assert_int_equal(akv_step_begin(e, list, step < 6 ? 3 : 2), AKV_OK);
    assert_int_equal(run_layers(e, s), AKV_OK);
  }
  d = akv_engine_plan_digest(e);
  akv_stream_destroy(e, s);
  for (uint32_t i = 0; i < n; i++) akv_context_close(ctx[i]);
  assert_int_equal(akv_engine_destroy(e), AKV_OK);
  return d;
}

static void test_pressure_identical_plans(void **state) {
  (void)state;
  world_run *w = new_world(SC_PRESSURE, 3);
  run_world(w);
  for (uint32_t r = 0; r < w->size; r++) {
    rank_run *rr = &w->ranks[r];
    assert_int_equal(rr->create, AKV_OK);
    /* Host fit in a group uses the smallest rank's pool: 32 contexts. */
    assert_int_equal(rr->n_opens, 33);
    for (uint32_t i = 0; i < 32; i++) assert_int_equal(rr->opens[i], AKV_OK);
    assert_int_equal(rr->opens[32], AKV_ERR_REFUSED_QUEUE);
    assert_int_equal(rr->info.host_pool_gib, 1);
    assert_int_equal(rr->info.device_pool_gib, 1);
    assert_int_equal(rr->info.max_contexts, 34);
    assert_int_equal(rr->info.local_host_pool_gib, 1 + r);
    assert_int_equal(rr->n_steps, MAX_STEPS);
    for (uint32_t s = 0; s < MAX_STEPS; s++) assert_int_equal(rr->steps[s], AKV_OK);
    assert_int_equal(rr->after, AKV_OK);
    assert_false(rr->info.stopped);
    assert_true(rr->info.digest_checked);
    assert_int_equal(rr->destroy, AKV_OK);
  }
  /* Identical plans: the digest after every step and the whole decision log. */
  for (uint32_t r = 1; r < w->size; r++) {
    for (uint32_t s = 0; s < MAX_STEPS; s++)
      assert_int_equal(w->ranks[r].digests[s], w->ranks[0].digests[s]);
    assert_int_equal(w->ranks[r].n_log, w->ranks[0].n_log);
    assert_memory_equal(w->ranks[r].log, w->ranks[0].log, w->ranks[0].n_log * sizeof(akv_adm_decision));
  }
  /* The plans moved pages (the comparison is about something). */
  assert_true(w->ranks[0].n_log > 33);
  /* Teeth: without the agreement, the same workload gives different plans
   * and a different host fit on each rank. */
  {
    akv_status open33[3];
    uint64_t d0 = ungrouped_digest(0, MAX_STEPS, &open33[0]);
    uint64_t d1 = ungrouped_digest(1, MAX_STEPS, &open33[1]);
    uint64_t d2 = ungrouped_digest(2, MAX_STEPS, &open33[2]);
    assert_true(d0 != d1 && d1 != d2 && d0 != d2);
    assert_int_equal(open33[0], AKV_ERR_REFUSED_QUEUE);
    assert_int_equal(open33[1], AKV_OK);
  }
}

static void test_fault_quarantines_all(void **state) {
  (void)state;
  world_run *w = new_world(SC_FAULT, 3);
  run_world(w);
  for (uint32_t r = 0; r < w->size; r++) {
    rank_run *rr = &w->ranks[r];
    assert_int_equal(rr->create, AKV_OK);
    /* Every rank stops at the same agreement point with the same status. */
    assert_true(rr->n_steps < MAX_STEPS);
    assert_int_equal(rr->n_steps, w->ranks[0].n_steps);
    assert_int_equal(rr->last, AKV_ERR_QUARANTINED);
    assert_int_equal(rr->after, AKV_ERR_QUARANTINED);
    assert_true(rr->info.stopped);
    assert_int_equal(rr->info.reason, AKV_GROUP_PEER_FAILED);
    assert_int_equal(rr->info.failed_rank, w->special);
    assert_true(rr->einfo.quarantined);
    assert_int_equal(rr->destroy, AKV_OK);
  }
}

static void test_missing_rank_times_out(void **state) {
  (void)state;
  world_run *w = new_world(SC_MISSING, 3);
  w->timeout_ms = 300;
  run_world(w);
  for (uint32_t r = 0; r < w->size; r++) {
    rank_run *rr = &w->ranks[r];
    assert_int_equal(rr->create, AKV_OK);
    assert_int_equal(rr->n_steps, w->special_step + 1);
    assert_int_equal(rr->last, AKV_ERR_TIMEOUT);
    assert_true(rr->info.stopped);
    assert_int_equal(rr->info.reason, AKV_GROUP_TIMEOUT);
    assert_true(rr->einfo.quarantined);
    assert_int_equal(rr->after, AKV_ERR_QUARANTINED);
    assert_int_equal(rr->destroy, AKV_OK);
    if (r == w->special) {
      /* The late rank is refused at once: the communicator was aborted. */
      assert_true(rr->last_wait_s < 0.2);
    } else {
      /* The others gave up after the timeout, not much later. */
      assert_true(rr->last_wait_s >= 0.25);
      assert_true(rr->last_wait_s < 5.0);
    }
  }
}

static void test_comm_abort(void **state) {
  (void)state;
  world_run *w = new_world(SC_ABORT, 3);
  run_world(w);
  for (uint32_t r = 0; r < w->size; r++) {
    rank_run *rr = &w->ranks[r];
    assert_int_equal(rr->last, AKV_ERR_COMM);
    assert_int_equal(rr->info.reason, AKV_GROUP_COMM_FAILED);
    assert_true(rr->einfo.quarantined);
    assert_int_equal(rr->after, AKV_ERR_QUARANTINED);
    assert_int_equal(rr->destroy, AKV_OK);
  }
}

static void test_digest_mismatch(void **state) {
  (void)state;
  world_run *w = new_world(SC_DIGEST, 2);
  run_world(w);
  assert_int_equal(w->ranks[1].extra[0], AKV_OK);
  for (uint32_t r = 0; r < w->size; r++) {
    rank_run *rr = &w->ranks[r];
    assert_int_equal(rr->n_steps, 1);
    assert_int_equal(rr->last, AKV_ERR_QUARANTINED);
    assert_int_equal(rr->info.reason, AKV_GROUP_DIGEST_MISMATCH);
    assert_true(rr->einfo.quarantined);
    assert_int_equal(rr->destroy, AKV_OK);
  }
}

static void test_different_calls_diverge(void **state) {
  (void)state;
  world_run *w = new_world(SC_DIVERGED, 2);
  run_world(w);
  for (uint32_t r = 0; r < w->size; r++) {
    rank_run *rr = &w->ranks[r];
    assert_int_equal(rr->n_steps, w->special_step + 1);
    assert_int_equal(rr->last, AKV_ERR_QUARANTINED);
    assert_int_equal(rr->info.reason, AKV_GROUP_DIVERGED);
    assert_true(rr->einfo.quarantined);
    assert_int_equal(rr->destroy, AKV_OK);
  }
}

static void test_disagreement_changes_nothing(void **state) {
  (void)state;
  world_run *w = new_world(SC_DISAGREE, 2);
  run_world(w);
  for (uint32_t r = 0; r < w->size; r++) {
    rank_run *rr = &w->ranks[r];
    assert_int_equal(rr->extra[0], AKV_ERR_DISAGREE);
    assert_int_equal(rr->extra[1], AKV_ERR_INVALID_ARGUMENT);
    assert_int_equal(rr->extra[2], AKV_OK); /* the plan did not move */
    /* and the group goes on afterwards */
    assert_int_equal(rr->n_steps, MAX_STEPS);
    assert_int_equal(rr->last, AKV_OK);
    assert_false(rr->info.stopped);
    assert_int_equal(rr->destroy, AKV_OK);
  }
  for (uint32_t s = 0; s < MAX_STEPS; s++)
    assert_int_equal(w->ranks[1].digests[s], w->ranks[0].digests[s]);
}

static void test_geometry_disagrees(void **state) {
  (void)state;
  world_run *w = new_world(SC_GEOMETRY, 2);
  run_world(w);
  for (uint32_t r = 0; r < w->size; r++) assert_int_equal(w->ranks[r].create, AKV_ERR_DISAGREE);
}

/* Illegal calls on a one-rank group: a specific status, nothing changed. */
static void test_illegal_calls(void **state) {
  (void)state;
  akv_inproc_world *world;
  akv_coll *coll;
  akv_group *g;
  akv_group_config gc = AKV_GROUP_CONFIG_INIT;
  akv_engine_config ec = shard_config(1, 1, 4);
  akv_engine *e;
  akv_context *c = NULL;
  akv_group_info info;
  uint64_t d;
  assert_int_equal(akv_inproc_world_create(1, akv_group_vector_len(4), &world), AKV_OK);
  assert_int_equal(akv_inproc_coll_create(world, 0, &coll), AKV_OK);
  gc.size = 2; /* not the collective's size */
  assert_int_equal(akv_group_create_with(&ec, &gc, coll, &g), AKV_ERR_CONFIG);
  gc.size = 1;
  assert_int_equal(akv_group_create_with(NULL, &gc, coll, &g), AKV_ERR_INVALID_ARGUMENT);
  ec.headroom_gib = 1; /* not agreed yet: refused */
  assert_int_equal(akv_group_create_with(&ec, &gc, coll, &g), AKV_ERR_NOT_SUPPORTED);
  ec.headroom_gib = 0;
  assert_int_equal(akv_group_create_with(&ec, &gc, coll, &g), AKV_OK);
  assert_int_equal(akv_group_engine(g, &e), AKV_OK);
  d = akv_engine_plan_digest(e);
  assert_int_equal(akv_group_context_open(g, NULL, NULL), AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_group_step_begin(g, NULL, 1), AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_group_context_close(g, NULL), AKV_ERR_BAD_HANDLE);
  assert_int_equal(akv_engine_plan_digest(e), d);
  assert_int_equal(akv_group_context_open(g, NULL, &c), AKV_OK);
  assert_int_equal(akv_group_step_begin(g, &c, 1), AKV_OK);
  assert_int_equal(akv_group_step_begin(g, &c, 1), AKV_ERR_STEP_STATE);
  assert_int_equal(akv_group_context_open(g, NULL, &c), AKV_ERR_STEP_STATE);
  assert_int_equal(akv_group_destroy(g), AKV_ERR_BUSY); /* open step: nothing freed */
  assert_int_equal(akv_group_info_get(g, &info), AKV_OK);
  assert_false(info.stopped);
  assert_int_equal(akv_group_check(g), AKV_OK);
  assert_int_equal(akv_group_info_get(NULL, &info), AKV_ERR_BAD_HANDLE);
  assert_int_equal(akv_group_info_get(g, NULL), AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_engine_quarantine(e, NULL), AKV_OK);
  assert_int_equal(akv_group_check(g), AKV_ERR_QUARANTINED);
  assert_int_equal(akv_group_info_get(g, &info), AKV_OK);
  assert_int_equal(info.reason, AKV_GROUP_PEER_FAILED);
  assert_int_equal(info.failed_rank, 0);
  assert_int_equal(akv_group_destroy(g), AKV_OK);
  assert_int_equal(akv_group_destroy(NULL), AKV_ERR_BAD_HANDLE);
  akv_inproc_world_destroy(world);
}

/* ------------------------------------------------ the public world API */

typedef struct dup_rank {
  akv_group_world *world;
  akv_group *g;
  akv_status st;
} dup_rank;

static void *dup_rank_main(void *arg) {
  dup_rank *d = arg;
  akv_engine_config ec = shard_config(1, 1, 4);
  akv_group_config gc = AKV_GROUP_CONFIG_INIT;
  gc.rank = 0; /* both threads claim rank 0 of a two-rank world */
  gc.size = 2;
  gc.timeout_ms = 300;
  d->g = NULL;
  d->st = akv_group_create_inproc(&ec, &gc, d->world, &d->g);
  return NULL;
}

/* Two threads claiming the same rank: the second claim is refused at once
 * (AKV_ERR_CONFIG, this rank only) and the first times out waiting for
 * rank 1, instead of the two completing a "two-rank" agreement as rank 0. */
static void test_world_duplicate_rank(void **state) {
  (void)state;
  akv_group_world *world;
  dup_rank d[2];
  assert_int_equal(akv_group_world_create(2, 4, &world), AKV_OK);
  d[0].world = d[1].world = world;
  run_two_ranks(dup_rank_main, &d[0], &d[1]);
  assert_true((d[0].st == AKV_ERR_CONFIG && d[1].st == AKV_ERR_TIMEOUT) ||
              (d[0].st == AKV_ERR_TIMEOUT && d[1].st == AKV_ERR_CONFIG));
  for (int i = 0; i < 2; i++) assert_null(d[i].g);
  assert_int_equal(akv_group_world_destroy(world), AKV_OK);
}

/* Destroyed, double-destroyed and busy worlds and groups: a status, never a
 * read of freed memory. */
static void test_world_and_group_lifetime(void **state) {
  (void)state;
  akv_group_world *world, *w2;
  akv_group *g = NULL, *g2 = NULL;
  akv_group_config gc = AKV_GROUP_CONFIG_INIT;
  akv_engine_config ec = shard_config(1, 1, 4);
  akv_group_info info;
  akv_engine *e;
  assert_int_equal(akv_group_world_create(0, 4, &world), AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_group_world_create(1, 0, &world), AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_group_world_create(1, 4, NULL), AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_group_world_abort(NULL), AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_group_world_destroy(NULL), AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_group_world_create(1, 4, &world), AKV_OK);
  gc.timeout_ms = UINT32_MAX; /* the largest wait: a deadline, not an overflow */
  ec.max_contexts = 5;        /* more than the world takes */
  assert_int_equal(akv_group_create_inproc(&ec, &gc, world, &g), AKV_ERR_CONFIG);
  ec.max_contexts = 4;
  gc.rank = 1;
  assert_int_equal(akv_group_create_inproc(&ec, &gc, world, &g), AKV_ERR_CONFIG);
  gc.rank = 0;
  assert_int_equal(akv_group_create_inproc(&ec, &gc, world, &g), AKV_OK);
  assert_int_equal(akv_group_check(g), AKV_OK);
  /* The rank is taken while its group lives. */
  assert_int_equal(akv_group_create_inproc(&ec, &gc, world, &g2), AKV_ERR_CONFIG);
  assert_null(g2);
  /* A world with a live group is busy: nothing freed, the group goes on. */
  assert_int_equal(akv_group_world_destroy(world), AKV_ERR_BUSY);
  assert_int_equal(akv_group_check(g), AKV_OK);
  assert_int_equal(akv_group_destroy(g), AKV_OK);
  /* A destroyed group: every call refuses it, destroy included. */
  assert_int_equal(akv_group_destroy(g), AKV_ERR_BAD_HANDLE);
  assert_int_equal(akv_group_check(g), AKV_ERR_BAD_HANDLE);
  assert_int_equal(akv_group_info_get(g, &info), AKV_ERR_BAD_HANDLE);
  assert_int_equal(akv_group_engine(g, &e), AKV_ERR_BAD_HANDLE);
  assert_int_equal(akv_group_step_begin(g, NULL, 0), AKV_ERR_BAD_HANDLE);
  assert_string_equal(akv_group_last_error(g), "bad group handle");
  /* The rank is free again once its group is gone. */
  assert_int_equal(akv_group_create_inproc(&ec, &gc, world, &g2), AKV_OK);
  assert_int_equal(akv_group_destroy(g2), AKV_OK);
  assert_int_equal(akv_group_world_destroy(world), AKV_OK);
  /* A destroyed world: refused, never read. */
  assert_int_equal(akv_group_world_destroy(world), AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_group_world_abort(world), AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_group_create_inproc(&ec, &gc, world, &g), AKV_ERR_INVALID_ARGUMENT);
  /* An aborted world refuses every later agreement. */
  assert_int_equal(akv_group_world_create(1, 4, &w2), AKV_OK);
  assert_int_equal(akv_group_create_inproc(&ec, &gc, w2, &g), AKV_OK);
  assert_int_equal(akv_group_world_abort(w2), AKV_OK);
  assert_int_equal(akv_group_check(g), AKV_ERR_COMM);
  assert_int_equal(akv_group_check(g), AKV_ERR_QUARANTINED);
  assert_int_equal(akv_group_destroy(g), AKV_OK);
  assert_int_equal(akv_group_world_destroy(w2), AKV_OK);
}

/* World calls racing akv_group_world_destroy: abort and create_inproc from
 * other threads while the world is destroyed. Each call either finds the
 * world alive (and is done with it before the destroy frees anything) or
 * dead (AKV_ERR_INVALID_ARGUMENT); a collective made between destroy's busy
 * check and its free would run on freed memory. ASan or TSan builds catch
 * the unguarded interleavings. */
typedef struct world_racer {
  akv_group_world *world;
  int creates;           /* 1: create_inproc and destroy groups; 0: abort */
  akv_status bad;        /* the first status outside the allowed set */
} world_racer;

static void *world_racer_main(void *arg) {
  world_racer *r = arg;
  akv_engine_config ec = shard_config(1, 1, 4);
  akv_group_config gc = AKV_GROUP_CONFIG_INIT;
  gc.timeout_ms = 60000; /* a hang detector only: one rank never waits */
  r->bad = AKV_OK;
  for (;;) {
    akv_status st;
    if (r->creates) {
      akv_group *g = NULL;
      st = akv_group_create_inproc(&ec, &gc, r->world, &g);
      if (st == AKV_OK) {
        if (akv_group_destroy(g) != AKV_OK) r->bad = AKV_ERR_BUSY;
      } else if (st != AKV_ERR_COMM && st != AKV_ERR_INVALID_ARGUMENT && st != AKV_ERR_CONFIG) {
        r->bad = st; /* COMM: aborted first; CONFIG: never (one creating thread) */
      }
    } else {
      st = akv_group_world_abort(r->world);
      if (st != AKV_OK && st != AKV_ERR_INVALID_ARGUMENT) r->bad = st;
    }
    if (st == AKV_ERR_INVALID_ARGUMENT || r->bad != AKV_OK) return NULL;
  }
}

static void test_world_destroy_races_calls(void **state) {
  (void)state;
  for (int it = 0; it < 64; it++) {
    akv_group_world *world;
    world_racer r[2];
    pthread_t th[2];
    akv_status st;
    assert_int_equal(akv_group_world_create(1, 4, &world), AKV_OK);
    for (int i = 0; i < 2; i++) {
      r[i].world = world;
      r[i].creates = i;
      assert_int_equal(pthread_create(&th[i], NULL, world_racer_main, &r[i]), 0);
    }
    /* BUSY while the creating thread's group lives; it is destroyed by
     * that thread, so the loop ends. */
    while ((st = akv_group_world_destroy(world)) == AKV_ERR_BUSY) sched_yield();
    assert_int_equal(st, AKV_OK);
    for (int i = 0; i < 2; i++) pthread_join(th[i], NULL);
    for (int i = 0; i < 2; i++) assert_int_equal(r[i].bad, AKV_OK);
    assert_int_equal(akv_group_world_abort(world), AKV_ERR_INVALID_ARGUMENT);
  }
}

/* An engine destroyed behind the group's back (akv_engine_destroy on
 * akv_group_engine's engine, which the group owns): agreement calls stop the
 * group, and akv_group_destroy still frees the group and gives its rank back,
 * so the world can be destroyed. Before, the group answered every destroy
 * with AKV_ERR_BAD_HANDLE and kept the world busy forever. */
static void test_engine_destroyed_behind_group(void **state) {
  (void)state;
  akv_group_world *world;
  akv_group *g = NULL, *g2 = NULL;
  akv_group_config gc = AKV_GROUP_CONFIG_INIT;
  akv_engine_config ec = shard_config(1, 1, 4);
  akv_group_info info;
  akv_engine *e;
  assert_int_equal(akv_group_world_create(1, 4, &world), AKV_OK);
  assert_int_equal(akv_group_create_inproc(&ec, &gc, world, &g), AKV_OK);
  assert_int_equal(akv_group_engine(g, &e), AKV_OK);
  assert_int_equal(akv_engine_destroy(e), AKV_OK);
  assert_int_equal(akv_group_check(g), AKV_ERR_QUARANTINED);
  assert_int_equal(akv_group_info_get(g, &info), AKV_OK);
  assert_true(info.stopped);
  assert_int_equal(info.reason, AKV_GROUP_PEER_FAILED);
  assert_int_equal(akv_group_destroy(g), AKV_OK);
  assert_int_equal(akv_group_destroy(g), AKV_ERR_BAD_HANDLE);
  /* The rank was given back: a new group takes it, and the world frees. */
  assert_int_equal(akv_group_create_inproc(&ec, &gc, world, &g2), AKV_OK);
  assert_int_equal(akv_group_destroy(g2), AKV_OK);
  assert_int_equal(akv_group_world_destroy(world), AKV_OK);
}

/* ---------------------------------------- ranks of a public-API world */

/* Runs `fn` as every rank of a fresh `size`-rank world (max_contexts 4),
 * each on its own thread with its own group, then destroys the groups and
 * the world. fn returns its statuses through `out` (indexed by rank). */
typedef struct api_rank {
  akv_group_world *world;
  uint32_t rank, size;
  void (*fn)(struct api_rank *r, akv_group *g);
  akv_status create, destroy;
  akv_status out[8];
  uint64_t digest;
  akv_group_info info;
} api_rank;

static void *api_rank_main(void *arg) {
  api_rank *r = arg;
  akv_engine_config ec = shard_config(1, 1, 4);
  akv_group_config gc = AKV_GROUP_CONFIG_INIT;
  akv_group *g = NULL;
  gc.rank = r->rank;
  gc.size = r->size;
  gc.timeout_ms = 60000; /* a hang detector only */
  gc.digest = AKV_GROUP_DIGEST_ON;
  r->create = akv_group_create_inproc(&ec, &gc, r->world, &g);
  if (r->create != AKV_OK) return NULL;
  r->fn(r, g);
  akv_group_info_get(g, &r->info);
  r->destroy = akv_group_destroy(g);
  return NULL;
}

static void run_api_ranks(api_rank *ranks, uint32_t size, void (*fn)(api_rank *, akv_group *)) {
  akv_group_world *world;
  pthread_t th[MAX_RANKS];
  assert_true(size <= MAX_RANKS);
  assert_int_equal(akv_group_world_create(size, 4, &world), AKV_OK);
  for (uint32_t r = 0; r < size; r++) {
    memset(&ranks[r], 0, sizeof(ranks[r]));
    ranks[r].world = world;
    ranks[r].rank = r;
    ranks[r].size = size;
    ranks[r].fn = fn;
    assert_int_equal(pthread_create(&th[r], NULL, api_rank_main, &ranks[r]), 0);
  }
  for (uint32_t r = 0; r < size; r++) pthread_join(th[r], NULL);
  for (uint32_t r = 0; r < size; r++) {
    assert_int_equal(ranks[r].create, AKV_OK);
    assert_int_equal(ranks[r].destroy, AKV_OK);
  }
  assert_int_equal(akv_group_world_destroy(world), AKV_OK);
}

/* Rank 1 fills one layer of the context further than the others (its
 * akv_step_begin alone would refuse the context with UNEVEN_LAYERS); the
 * lengths the ranks agree on (the minimum over layers) are equal. A local
 * state error: every rank returns AKV_ERR_UNEVEN_LAYERS, nothing changes,
 * and the group goes on once rank 1 evens its layers out. Before, rank 0
 * began its step, the outcomes differed, and every rank was quarantined. */
static void uneven_rank_fn(api_rank *r, akv_group *g) {
  static const uint8_t row[2 * KV_HEADS * HEAD_DIM];
  akv_context *c = NULL;
  akv_engine *e;
  const void *rows[LAYERS];
  uint64_t before;
  for (uint32_t l = 0; l < LAYERS; l++) rows[l] = row;
  akv_group_engine(g, &e);
  r->out[0] = akv_group_context_open(g, NULL, &c);
  if (r->out[0] != AKV_OK) return;
  r->out[1] = akv_context_append(c, 1, rows, rows);
  if (r->rank == 1) r->out[1] |= akv_context_append_layer(c, 0, 1, row, row);
  before = akv_engine_plan_digest(e);
  r->out[2] = akv_group_step_begin(g, &c, 1);
  r->out[3] = akv_engine_plan_digest(e) == before ? AKV_OK : AKV_ERR_DISAGREE;
  /* The other layers catch up on rank 1; the others append the same row. */
  for (uint32_t l = r->rank == 1 ? 1 : 0; l < LAYERS; l++)
    r->out[4] |= akv_context_append_layer(c, l, 1, row, row);
  r->out[5] = akv_group_step_begin(g, &c, 1);
  if (r->out[5] == AKV_OK) {
    akv_stream s;
    akv_stream_create(e, &s);
    r->out[6] = run_layers(e, s);
    akv_stream_destroy(e, s);
  }
  r->digest = akv_engine_plan_digest(e);
  r->out[7] = akv_group_context_close(g, c);
}

static void test_uneven_layers_on_one_rank(void **state) {
  (void)state;
  api_rank ranks[2];
  run_api_ranks(ranks, 2, uneven_rank_fn);
  for (uint32_t r = 0; r < 2; r++) {
    assert_int_equal(ranks[r].out[0], AKV_OK);
    assert_int_equal(ranks[r].out[1], AKV_OK);
    assert_int_equal(ranks[r].out[2], AKV_ERR_UNEVEN_LAYERS);
    assert_int_equal(ranks[r].out[3], AKV_OK); /* nothing changed */
    assert_int_equal(ranks[r].out[4], AKV_OK);
    assert_int_equal(ranks[r].out[5], AKV_OK); /* and the group goes on */
    assert_int_equal(ranks[r].out[6], AKV_OK);
    assert_int_equal(ranks[r].out[7], AKV_OK);
    assert_false(ranks[r].info.stopped);
  }
  assert_int_equal(ranks[1].digest, ranks[0].digest);
}

/* step_end is not an agreement point: rank 0 ended its step, rank 1 has
 * not, and both close the step's context. Rank 1's close would refuse it
 * (AKV_ERR_IN_USE): a local state error, so every rank returns IN_USE and
 * the context stays open everywhere; so does an open (AKV_ERR_STEP_STATE);
 * once rank 1 ends its step the close goes through. Before, the ranks'
 * digests (which cover the open step) differed and every rank was
 * quarantined, and without digest checking rank 0 closed the context. */
static void close_in_step_fn(api_rank *r, akv_group *g) {
  akv_context *c = NULL;
  akv_engine *e;
  akv_stream s;
  uint32_t len;
  akv_group_engine(g, &e);
  akv_stream_create(e, &s);
  r->out[0] = akv_group_context_open(g, NULL, &c);
  if (r->out[0] == AKV_OK) {
    r->out[1] = akv_group_step_begin(g, &c, 1);
    if (r->rank == 0) r->out[2] = run_layers(e, s); /* rank 1 keeps its step open */
    r->out[3] = akv_group_context_close(g, c);
    {
      akv_context *c2 = NULL;
      r->out[6] = akv_group_context_open(g, NULL, &c2); /* a step open on rank 1 */
    }
    r->out[4] = akv_context_length(c, &len); /* still open */
    if (r->rank == 1) r->out[2] = run_layers(e, s);
    r->out[5] = akv_group_context_close(g, c);
  }
  akv_stream_destroy(e, s);
}

static void test_close_while_one_rank_in_step(void **state) {
  (void)state;
  api_rank ranks[2];
  run_api_ranks(ranks, 2, close_in_step_fn);
  for (uint32_t r = 0; r < 2; r++) {
    assert_int_equal(ranks[r].out[0], AKV_OK);
    assert_int_equal(ranks[r].out[1], AKV_OK);
    assert_int_equal(ranks[r].out[2], AKV_OK);
    assert_int_equal(ranks[r].out[3], AKV_ERR_IN_USE);
    assert_int_equal(ranks[r].out[4], AKV_OK);
    assert_int_equal(ranks[r].out[5], AKV_OK);
    assert_int_equal(ranks[r].out[6], AKV_ERR_STEP_STATE);
    assert_false(ranks[r].info.stopped);
  }
}

/* A log callback that makes a group call on its own group: on a stopped
 * group every agreement call logs a warning, so the nested call logs again,
 * whose callback calls again, without end (a stack overflow). A group call
 * made from inside the group's own log callback returns its status and logs
 * nothing. */
typedef struct reentrant_log {
  akv_group *g;
  uint32_t calls, nested;
  akv_status nested_st;
} reentrant_log;

static void reentrant_log_fn(void *user, akv_log_level level, const char *message) {
  reentrant_log *rl = user;
  rl->calls++;
  /* The group's own warnings (the engine's go to the same callback). */
  if (rl->g == NULL || level != AKV_LOG_WARN || strncmp(message, "group rank", 10) != 0 ||
      rl->nested > 100)
    return;
  rl->nested++;
  rl->nested_st = akv_group_check(rl->g);
  (void)akv_group_last_error(rl->g);
}

static void test_log_callback_reentry(void **state) {
  (void)state;
  akv_group_world *world;
  akv_group *g = NULL;
  akv_group_config gc = AKV_GROUP_CONFIG_INIT;
  akv_engine_config ec = shard_config(1, 1, 4);
  reentrant_log rl;
  memset(&rl, 0, sizeof(rl));
  ec.log_fn = reentrant_log_fn;
  ec.log_user = &rl;
  ec.log_level = AKV_LOG_WARN;
  assert_int_equal(akv_group_world_create(1, 4, &world), AKV_OK);
  assert_int_equal(akv_group_create_inproc(&ec, &gc, world, &g), AKV_OK);
  rl.g = g;
  assert_int_equal(akv_group_world_abort(world), AKV_OK);
  assert_int_equal(akv_group_check(g), AKV_ERR_COMM);
  /* The stop's warning called back once; the nested check was refused
   * without a collective and without logging. */
  assert_int_equal(rl.nested, 1);
  assert_int_equal(rl.nested_st, AKV_ERR_QUARANTINED);
  rl.nested = 0;
  assert_int_equal(akv_group_check(g), AKV_ERR_QUARANTINED);
  assert_int_equal(rl.nested, 1);
  assert_int_equal(rl.nested_st, AKV_ERR_QUARANTINED);
  rl.g = NULL;
  assert_int_equal(akv_group_destroy(g), AKV_OK);
  assert_int_equal(akv_group_world_destroy(world), AKV_OK);
}

/* A group call made from the ENGINE's log callback while an agreement of
 * the same group is in progress on this rank (the engine logs its refusal
 * inside akv_context_open, between the open's two collectives). Rank 0's
 * callback calls akv_group_check; rank 1's does not. Before, rank 0's
 * nested check entered a collective of its own: it met rank 1's outcome
 * round, every rank stopped as diverged, rank 0's engine could not be
 * quarantined from inside its own callback, and rank 0's outer open then
 * entered a second collective on its stopped group and waited out the
 * timeout alone. A nested agreement call returns AKV_ERR_IN_USE and enters
 * no collective; the outer call and the group go on. */
typedef struct nested_rank {
  akv_group_world *world;
  uint32_t rank;
  akv_group *g;
  int nest;                 /* 1: this rank's callback calls back */
  int armed;                /* 1 during the refused open */
  uint32_t nested;
  akv_status nested_st, nested_destroy, opens[6], check;
  double open_s;            /* wall time of the refused open */
  akv_group_info info;
  akv_status destroy;
} nested_rank;

static void nested_log_fn(void *user, akv_log_level level, const char *message) {
  nested_rank *r = user;
  (void)level;
  /* The engine's lines only (the group's start with "group rank"). */
  if (!r->nest || !r->armed || strncmp(message, "group rank", 10) == 0 || r->nested > 0)
    return;
  r->nested++;
  r->nested_st = akv_group_check(r->g);
  r->nested_destroy = akv_group_destroy(r->g);
}

static void *nested_rank_main(void *arg) {
  nested_rank *r = arg;
  akv_engine_config ec = shard_config(1, 1, 4);
  akv_group_config gc = AKV_GROUP_CONFIG_INIT;
  akv_context *c[6];
  ec.log_fn = nested_log_fn;
  ec.log_user = r;
  ec.log_level = AKV_LOG_DEBUG; /* the engine logs a refusal at DEBUG */
  gc.rank = r->rank;
  gc.size = 2;
  gc.timeout_ms = 3000;
  if (akv_group_create_inproc(&ec, &gc, r->world, &r->g) != AKV_OK) return NULL;
  /* Four fit (concurrency 4); the fifth is refused on every rank, and the
   * engine logs the refusal from inside akv_context_open. */
  for (int i = 0; i < 5; i++) {
    double t0 = now_s();
    r->armed = i == 4;
    r->opens[i] = akv_group_context_open(r->g, NULL, &c[i]);
    r->armed = 0;
    r->open_s = now_s() - t0;
  }
  r->check = akv_group_check(r->g);
  akv_group_info_get(r->g, &r->info);
  r->nest = 0;
  for (int i = 0; i < 4; i++)
    if (r->opens[i] == AKV_OK) akv_group_context_close(r->g, c[i]);
  r->destroy = akv_group_destroy(r->g);
  return NULL;
}

static void test_nested_agreement_from_engine_log(void **state) {
  (void)state;
  akv_group_world *world;
  nested_rank r[2];
  assert_int_equal(akv_group_world_create(2, 4, &world), AKV_OK);
  INIT_TWO_RANKS(r, world);
  r[0].nest = 1;
  run_two_ranks(nested_rank_main, &r[0], &r[1]);
  assert_int_equal(r[0].nested, 1);
  assert_int_equal(r[0].nested_st, AKV_ERR_IN_USE);      /* no collective */
  assert_int_equal(r[0].nested_destroy, AKV_ERR_IN_USE); /* nothing freed */
  for (uint32_t i = 0; i < 2; i++) {
    for (int k = 0; k < 4; k++) assert_int_equal(r[i].opens[k], AKV_OK);
    assert_int_equal(r[i].opens[4], r[1].opens[4]);
    assert_true(r[i].opens[4] == AKV_ERR_REFUSED_QUEUE || r[i].opens[4] == AKV_ERR_CAPACITY);
    assert_true(r[i].open_s < 2.0); /* nobody waited out the timeout */
    assert_int_equal(r[i].check, AKV_OK);
    assert_false(r[i].info.stopped);
    assert_int_equal(r[i].destroy, AKV_OK);
  }
  assert_int_equal(akv_group_world_destroy(world), AKV_OK);
}

/* An agreement call made from the ENGINE's log callback outside any
 * agreement (the engine logs a refusal of a direct engine call, here
 * akv_step_end with no step open), on one rank only; the other rank makes
 * the same agreement call from its own code. The engine refuses every call
 * that changes it from inside its callback (akv_log_fn: AKV_ERR_IN_USE), so
 * that rank's decision could never be taken. Before, the rank entered the
 * agreement with no local refusal, its decision failed with AKV_ERR_IN_USE
 * where the others opened (or stepped, or closed), every rank stopped as
 * diverged, and the calling rank's engine could not even be quarantined
 * (again from inside its callback). It is a local state refusal: every rank
 * returns AKV_ERR_IN_USE, nothing changed on any rank, the group goes on. */
typedef struct cb_rank {
  akv_group_world *world;
  uint32_t rank;
  akv_group *g;
  int from_cb;            /* 1: this rank makes its calls from the callback */
  int armed;              /* 0: none, 1: open, 2: step, 3: close */
  akv_context *ctx;
  akv_status open_st, step_st, close_st, check, destroy;
  uint64_t digest_before, digest_after, steps_after;
  double wait_s;
  akv_group_info info;
} cb_rank;

static void cb_rank_call(cb_rank *r, int which) {
  akv_context *c = NULL;
  if (which == 1) {
    r->open_st = akv_group_context_open(r->g, NULL, &c);
    if (r->open_st == AKV_OK) akv_group_context_close(r->g, c); /* never on a fixed group */
  } else if (which == 2) {
    r->step_st = akv_group_step_begin(r->g, &r->ctx, 1);
  } else {
    r->close_st = akv_group_context_close(r->g, r->ctx);
  }
}

static void cb_log_fn(void *user, akv_log_level level, const char *message) {
  cb_rank *r = user;
  int which = r->armed;
  (void)level;
  if (which == 0 || strncmp(message, "group rank", 10) == 0) return;
  r->armed = 0;
  cb_rank_call(r, which);
}

static void *cb_rank_main(void *arg) {
  cb_rank *r = arg;
  akv_engine_config ec = shard_config(1, 1, 4);
  akv_group_config gc = AKV_GROUP_CONFIG_INIT;
  akv_engine *e = NULL;
  akv_engine_info ei;
  double t0 = now_s();
  ec.log_fn = cb_log_fn;
  ec.log_user = r;
  ec.log_level = AKV_LOG_DEBUG; /* the engine logs a refusal at DEBUG */
  gc.rank = r->rank;
  gc.size = 2;
  gc.timeout_ms = 3000;
  if (akv_group_create_inproc(&ec, &gc, r->world, &r->g) != AKV_OK) return NULL;
  akv_group_engine(r->g, &e);
  if (akv_group_context_open(r->g, NULL, &r->ctx) != AKV_OK) return NULL;
  prefill(r->ctx, 3);
  r->digest_before = akv_engine_plan_digest(e);
  for (int which = 1; which <= 3; which++) {
    if (r->from_cb) {
      r->armed = which;
      akv_step_end(e); /* refused (no step open): the engine logs */
      r->armed = 0;
    } else {
      cb_rank_call(r, which);
    }
  }
  akv_engine_info_get(e, &ei);
  r->steps_after = ei.steps;
  r->digest_after = akv_engine_plan_digest(e);
  r->check = akv_group_check(r->g);
  akv_group_info_get(r->g, &r->info);
  akv_group_context_close(r->g, r->ctx);
  r->destroy = akv_group_destroy(r->g);
  r->wait_s = now_s() - t0;
  return NULL;
}

static void test_agreement_from_engine_log_one_rank(void **state) {
  (void)state;
  akv_group_world *world;
  cb_rank r[2];
  assert_int_equal(akv_group_world_create(2, 4, &world), AKV_OK);
  INIT_TWO_RANKS(r, world);
  r[0].from_cb = 1;
  run_two_ranks(cb_rank_main, &r[0], &r[1]);
  for (uint32_t i = 0; i < 2; i++) {
    assert_int_equal(r[i].open_st, AKV_ERR_IN_USE);
    assert_int_equal(r[i].step_st, AKV_ERR_IN_USE);
    assert_int_equal(r[i].close_st, AKV_ERR_IN_USE);
    assert_int_equal(r[i].digest_after, r[i].digest_before); /* nothing changed */
    assert_int_equal(r[i].steps_after, 0);
    assert_int_equal(r[i].check, AKV_OK);
    assert_false(r[i].info.stopped);
    assert_int_equal(r[i].destroy, AKV_OK);
    assert_true(r[i].wait_s < 2.5); /* nobody waited out the timeout */
  }
  assert_int_equal(akv_group_world_destroy(world), AKV_OK);
}

/* A group stopped by an agreement call made from the engine's log callback:
 * rank 1's transport failed in a lease, then rank 1 learns it at an
 * akv_group_check made from its engine's callback (on the line of a refused
 * akv_step_end), rank 0 at a plain akv_group_check. The group stops on both
 * ranks as PEER_FAILED and every rank must quarantine its engine, but the
 * engine refuses a quarantine from inside its callback (akv_log_fn). Before,
 * rank 1's group stopped with its engine never quarantined and no way for
 * the group to do it later: akv_group_destroy answered AKV_ERR_BUSY
 * ("transport failed: quarantine first") for ever, and the world could not
 * be destroyed. The quarantine is deferred to the rank's next agreement call
 * made outside the callback. */
typedef struct late_q_rank {
  akv_group_world *world;
  uint32_t rank;
  akv_group *g;
  int armed;
  akv_status first, nested, second, destroy;
  int quarantined_in_cb, quarantined_after;
  akv_group_info info;
} late_q_rank;

static void late_q_log_fn(void *user, akv_log_level level, const char *message) {
  late_q_rank *r = user;
  (void)level;
  if (!r->armed || strncmp(message, "group rank", 10) == 0) return;
  r->armed = 0;
  r->nested = akv_group_check(r->g);
}

static void *late_q_rank_main(void *arg) {
  late_q_rank *r = arg;
  akv_engine_config ec = shard_config(1, 0, 4);
  akv_group_config gc = AKV_GROUP_CONFIG_INIT;
  akv_engine *e = NULL;
  akv_stream s = NULL;
  akv_context *c = NULL;
  akv_engine_info ei;
  ec.route = AKV_ROUTE_STAGE;
  ec.log_fn = late_q_log_fn;
  ec.log_user = r;
  ec.log_level = AKV_LOG_DEBUG; /* the engine logs a refusal at DEBUG */
  if (r->rank == 1) {
    ec.fault_fail_nth = 1; /* the first copy: layer 0's lease of the step */
    ec.fault_kind = AKV_OP_COPY;
  }
  gc.rank = r->rank;
  gc.size = 2;
  gc.timeout_ms = 3000;
  if (akv_group_create_inproc(&ec, &gc, r->world, &r->g) != AKV_OK) return NULL;
  akv_group_engine(r->g, &e);
  akv_stream_create(e, &s);
  if (akv_group_context_open(r->g, NULL, &c) != AKV_OK) return NULL;
  prefill(c, 5);
  r->first = akv_group_step_begin(r->g, &c, 1);
  (void)run_layers(e, s); /* fails on rank 1: its transport failed */
  if (r->rank == 1) {
    r->armed = 1;
    akv_step_end(e); /* refused (transport failed): the engine logs */
    r->armed = 0;
    akv_engine_info_get(e, &ei);
    r->quarantined_in_cb = ei.quarantined;
  } else {
    r->nested = akv_group_check(r->g);
  }
  r->second = akv_group_check(r->g);
  akv_engine_info_get(e, &ei);
  r->quarantined_after = ei.quarantined;
  akv_group_info_get(r->g, &r->info);
  akv_stream_destroy(e, s);
  r->destroy = akv_group_destroy(r->g);
  return NULL;
}

static void test_stop_from_engine_log_quarantines_later(void **state) {
  (void)state;
  akv_group_world *world;
  late_q_rank r[2];
  assert_int_equal(akv_group_world_create(2, 4, &world), AKV_OK);
  INIT_TWO_RANKS(r, world);
  run_two_ranks(late_q_rank_main, &r[0], &r[1]);
  assert_int_equal(r[1].quarantined_in_cb, 0); /* refused there: the premise */
  for (uint32_t i = 0; i < 2; i++) {
    assert_int_equal(r[i].first, AKV_OK);
    assert_int_equal(r[i].nested, AKV_ERR_QUARANTINED);
    assert_int_equal(r[i].second, AKV_ERR_QUARANTINED);
    assert_int_equal(r[i].quarantined_after, 1);
    assert_true(r[i].info.stopped);
    assert_int_equal(r[i].info.reason, AKV_GROUP_PEER_FAILED);
    assert_int_equal(r[i].info.failed_rank, 1);
    assert_int_equal(r[i].destroy, AKV_OK);
  }
  assert_int_equal(akv_group_world_destroy(world), AKV_OK);
}

/* A NULL shard or out on one rank at create. Before, that rank returned
 * AKV_ERR_INVALID_ARGUMENT at once, without meeting the others: they waited
 * out their timeout, returned AKV_ERR_TIMEOUT, and the timeout aborted the
 * world for good (no group could be made in it again), though akv_group.h
 * promises the same create status on every rank (akv_nccl.h: "on every rank
 * alike ... AKV_ERR_INVALID_ARGUMENT (NULL)"). The argument is a local
 * refusal that meets the others: every rank returns
 * AKV_ERR_INVALID_ARGUMENT at once and the world lives on. */
typedef struct null_rank {
  akv_group_world *world;
  uint32_t rank;
  int null_what;   /* on rank 1: 1 = out NULL, 2 = shard NULL, 0 = none */
  akv_status st;
  double wait_s;
} null_rank;

static void *null_rank_main(void *arg) {
  null_rank *r = arg;
  akv_engine_config ec = shard_config(1, 1, 4);
  akv_group_config gc = AKV_GROUP_CONFIG_INIT;
  akv_group *g = NULL;
  const int what = r->rank == 1 ? r->null_what : 0;
  double t0 = now_s();
  gc.rank = r->rank;
  gc.size = 2;
  gc.timeout_ms = 2000;
  r->st = akv_group_create_inproc(what == 2 ? NULL : &ec, &gc, r->world, what == 1 ? NULL : &g);
  r->wait_s = now_s() - t0;
  if (r->st == AKV_OK && g != NULL) akv_group_destroy(g);
  return NULL;
}

static void run_null_ranks(akv_group_world *world, int null_what, null_rank r[2]) {
  INIT_TWO_RANKS(r, world);
  r[0].null_what = r[1].null_what = null_what;
  run_two_ranks(null_rank_main, &r[0], &r[1]);
}

static void test_create_null_argument_on_one_rank(void **state) {
  (void)state;
  akv_group_world *world;
  null_rank r[2];
  assert_int_equal(akv_group_world_create(2, 4, &world), AKV_OK);
  for (int what = 1; what <= 2; what++) {
    run_null_ranks(world, what, r);
    for (uint32_t i = 0; i < 2; i++) {
      assert_int_equal(r[i].st, AKV_ERR_INVALID_ARGUMENT);
      assert_true(r[i].wait_s < 1.5); /* nobody waited out the timeout */
    }
  }
  /* The world was not aborted: a group is still made in it. */
  run_null_ranks(world, 0, r);
  for (uint32_t i = 0; i < 2; i++) assert_int_equal(r[i].st, AKV_OK);
  assert_int_equal(akv_group_world_destroy(world), AKV_OK);
}

/* Calls out of order across ranks: rank 1 destroys its group and creates a
 * new one in the same world while rank 0 makes its next call (a check) on
 * the first. The create meets the check: the ranks are at different kinds
 * of agreement point, so both stop as diverged. The create answers
 * AKV_ERR_QUARANTINED, like the check, and leaves nothing behind (the rank
 * is free again); akv_group.h listed no such status for a create. */
typedef struct reborn_rank {
  akv_group_world *world;
  uint32_t rank;
  akv_status create, second, check, destroy;
  akv_group_info info;
} reborn_rank;

static void *reborn_rank_main(void *arg) {
  reborn_rank *r = arg;
  akv_engine_config ec = shard_config(1, 1, 4);
  akv_group_config gc = AKV_GROUP_CONFIG_INIT;
  akv_group *g = NULL, *g2 = NULL;
  gc.rank = r->rank;
  gc.size = 2;
  gc.timeout_ms = 3000;
  r->create = akv_group_create_inproc(&ec, &gc, r->world, &g);
  if (r->create != AKV_OK) return NULL;
  if (r->rank == 1) {
    r->destroy = akv_group_destroy(g);
    r->second = akv_group_create_inproc(&ec, &gc, r->world, &g2);
    if (r->second == AKV_OK) akv_group_destroy(g2);
  } else {
    r->check = akv_group_check(g);
    akv_group_info_get(g, &r->info);
    r->destroy = akv_group_destroy(g);
  }
  return NULL;
}

static void test_create_meets_another_call(void **state) {
  (void)state;
  akv_group_world *world;
  reborn_rank r[2];
  assert_int_equal(akv_group_world_create(2, 4, &world), AKV_OK);
  INIT_TWO_RANKS(r, world);
  run_two_ranks(reborn_rank_main, &r[0], &r[1]);
  for (uint32_t i = 0; i < 2; i++) {
    assert_int_equal(r[i].create, AKV_OK);
    assert_int_equal(r[i].destroy, AKV_OK);
  }
  assert_int_equal(r[0].check, AKV_ERR_QUARANTINED);
  assert_true(r[0].info.stopped);
  assert_int_equal(r[0].info.reason, AKV_GROUP_DIVERGED);
  assert_int_equal(r[1].second, AKV_ERR_QUARANTINED);
  assert_int_equal(akv_group_world_destroy(world), AKV_OK); /* nothing left behind */
}

/* A world (and an NCCL group's buffers, src/nccl/coll_nccl.c) is sized from
 * max_contexts, a caller's number: a world of UINT32_MAX contexts asked for
 * two vectors of 2^34 uint64 (and every group another), and failed with
 * AKV_ERR_OUT_OF_MEMORY, though no engine takes more than 2^20 contexts
 * (akv_engine_create refuses more with AKV_ERR_CONFIG). On NCCL the same
 * shard failed this rank alone with AKV_ERR_BACKEND (device buffers) while
 * the others waited out their timeout, where every rank should return the
 * engine's AKV_ERR_CONFIG. The vector length is bounded by the engine's
 * limit: such a world is made, and a shard beyond the limit on every rank
 * is refused by the engine, on every rank alike. */
typedef struct huge_rank {
  akv_group_world *world;
  uint32_t rank;
  akv_status create;
} huge_rank;

static void *huge_rank_main(void *arg) {
  huge_rank *r = arg;
  akv_engine_config ec = shard_config(1, 1, UINT32_MAX);
  akv_group_config gc = AKV_GROUP_CONFIG_INIT;
  akv_group *g = NULL;
  gc.rank = r->rank;
  gc.size = 2;
  gc.timeout_ms = 60000; /* a hang detector only */
  r->create = akv_group_create_inproc(&ec, &gc, r->world, &g);
  if (r->create == AKV_OK) akv_group_destroy(g);
  return NULL;
}

static void test_world_of_unbounded_contexts(void **state) {
  (void)state;
  akv_group_world *world;
  huge_rank r[2];
  /* The bound: lengths stop growing at the engine's limit. */
  assert_int_equal(akv_group_vector_len(UINT32_MAX), akv_group_vector_len(1u << 20));
  assert_true(akv_group_vector_len(1u << 20) > akv_group_vector_len((1u << 20) - 1));
  assert_int_equal(akv_group_world_create(2, UINT32_MAX, &world), AKV_OK);
  INIT_TWO_RANKS(r, world);
  run_two_ranks(huge_rank_main, &r[0], &r[1]);
  for (uint32_t i = 0; i < 2; i++) assert_int_equal(r[i].create, AKV_ERR_CONFIG);
  assert_int_equal(akv_group_world_destroy(world), AKV_OK);
}

/* The group config's enum field is checked as the engine config's are: a
 * `digest` outside akv_group_digest was taken silently (as DEFAULT in a
 * release build, as ON in a debug one); it is AKV_ERR_CONFIG, on every
 * rank (the refusal travels in the create agreement), and nothing is made. */
static void test_group_config_digest_enum(void **state) {
  (void)state;
  akv_group_world *world;
  akv_group *g = NULL;
  akv_group_config gc = AKV_GROUP_CONFIG_INIT;
  akv_engine_config ec = shard_config(1, 1, 4);
  assert_int_equal(akv_group_world_create(1, 4, &world), AKV_OK);
  gc.digest = (akv_group_digest)2;
  assert_int_equal(akv_group_create_inproc(&ec, &gc, world, &g), AKV_ERR_CONFIG);
  assert_null(g);
  gc.digest = (akv_group_digest)-1;
  assert_int_equal(akv_group_create_inproc(&ec, &gc, world, &g), AKV_ERR_CONFIG);
  assert_null(g);
  gc.digest = AKV_GROUP_DIGEST_ON; /* the rank was given back */
  assert_int_equal(akv_group_create_inproc(&ec, &gc, world, &g), AKV_OK);
  assert_int_equal(akv_group_destroy(g), AKV_OK);
  assert_int_equal(akv_group_world_destroy(world), AKV_OK);
}

/* A world is aborted once (akv_group_world_abort): a timeout that aborted
 * it first keeps its status, so a later caller's abort does not turn the
 * answer into AKV_ERR_COMM. */
static void test_world_abort_after_timeout(void **state) {
  (void)state;
  akv_group_world *world;
  akv_group *g = NULL;
  akv_group_config gc = AKV_GROUP_CONFIG_INIT;
  akv_engine_config ec = shard_config(1, 1, 4);
  assert_int_equal(akv_group_world_create(2, 4, &world), AKV_OK);
  gc.size = 2;
  gc.timeout_ms = 50; /* rank 1 never comes */
  assert_int_equal(akv_group_create_inproc(&ec, &gc, world, &g), AKV_ERR_TIMEOUT);
  assert_null(g);
  assert_int_equal(akv_group_world_abort(world), AKV_OK);
  assert_int_equal(akv_group_create_inproc(&ec, &gc, world, &g), AKV_ERR_TIMEOUT);
  gc.rank = 1; /* the late rank: at once */
  assert_int_equal(akv_group_create_inproc(&ec, &gc, world, &g), AKV_ERR_TIMEOUT);
  assert_null(g);
  assert_int_equal(akv_group_world_destroy(world), AKV_OK);
}

/* A world's and a group's rank count is bounded (AKV_GROUP_MAX_RANKS):
 * akv_group_world_create sized its rank table by `size` unbounded, so a
 * world of UINT32_MAX ranks asked for 4 GiB (and took it where memory is
 * overcommitted). Beyond the bound it is AKV_ERR_INVALID_ARGUMENT (an
 * argument, as size 0) and nothing is made; the bound itself is taken. */
static void test_world_size_bounded(void **state) {
  (void)state;
  akv_group_world *world = NULL;
  akv_group *g = NULL;
  akv_group_config gc = AKV_GROUP_CONFIG_INIT;
  akv_engine_config ec = shard_config(1, 1, 4);
  assert_int_equal(akv_group_world_create(AKV_GROUP_MAX_RANKS + 1, 4, &world),
                   AKV_ERR_INVALID_ARGUMENT);
  assert_null(world);
  assert_int_equal(akv_group_world_create(UINT32_MAX, 4, &world), AKV_ERR_INVALID_ARGUMENT);
  assert_null(world);
  assert_int_equal(akv_group_world_create(AKV_GROUP_MAX_RANKS, 4, &world), AKV_OK);
  gc.rank = AKV_GROUP_MAX_RANKS - 1;
  gc.size = AKV_GROUP_MAX_RANKS + 1; /* not the world's size: refused as before */
  assert_int_equal(akv_group_create_inproc(&ec, &gc, world, &g), AKV_ERR_CONFIG);
  assert_null(g);
  assert_int_equal(akv_group_world_destroy(world), AKV_OK);
}

/* A collective that stands for any transport's (an NCCL communicator can
 * have more ranks than the bound): every rank gave the same vector. */
static akv_status echo_allreduce(akv_coll *c, uint64_t *v, size_t n, uint32_t timeout_ms) {
  (void)c;
  (void)v;
  (void)n;
  (void)timeout_ms;
  return AKV_OK;
}
static void echo_destroy(akv_coll *c) { (void)c; }
static const akv_coll_ops echo_ops = {"echo", echo_allreduce, echo_destroy};

/* Group create checks the group config's size against the same bound, on
 * every transport: a collective of AKV_GROUP_MAX_RANKS + 1 ranks was taken
 * (the group made its engine); it is AKV_ERR_CONFIG, in the agreement (so
 * every rank refuses alike), and nothing is made. */
static void test_group_size_bounded(void **state) {
  (void)state;
  akv_coll coll;
  akv_group *g = NULL;
  akv_group_config gc = AKV_GROUP_CONFIG_INIT;
  akv_engine_config ec = shard_config(1, 1, 4);
  memset(&coll, 0, sizeof(coll));
  coll.ops = &echo_ops;
  coll.max_n = akv_group_vector_len(4);
  coll.rank = gc.rank = 0;
  coll.size = gc.size = AKV_GROUP_MAX_RANKS + 1;
  assert_int_equal(akv_group_create_with(&ec, &gc, &coll, &g), AKV_ERR_CONFIG);
  assert_null(g);
  coll.rank = gc.rank = AKV_GROUP_MAX_RANKS; /* a rank past the bound as well */
  assert_int_equal(akv_group_create_with(&ec, &gc, &coll, &g), AKV_ERR_CONFIG);
  assert_null(g);
  coll.rank = gc.rank = AKV_GROUP_MAX_RANKS - 1; /* the bound itself is taken */
  coll.size = gc.size = AKV_GROUP_MAX_RANKS;
  assert_int_equal(akv_group_create_with(&ec, &gc, &coll, &g), AKV_OK);
  assert_int_equal(akv_group_check(g), AKV_OK);
  assert_int_equal(akv_group_destroy(g), AKV_OK);
}

/* An engine destroyed behind the group's back whose handle record was handed
 * out again: the group told its engine apart by the handle alone, so after
 * AKV_ENGINE_HANDLE_REUSE_MIN later creates the dead handle named a newer
 * engine and the group acted on it (its agreement calls opened contexts on
 * it and passed, akv_group_destroy destroyed it). The group now knows its
 * engine by the engine's serial: it stops at the next agreement point as
 * for any engine destroyed directly and never touches the newer engine. */
static void test_engine_destroyed_record_reused(void **state) {
  (void)state;
  akv_group_world *world;
  akv_group *g = NULL;
  akv_group_config gc = AKV_GROUP_CONFIG_INIT;
  akv_engine_config ec = shard_config(1, 1, 4);
  akv_group_info info;
  akv_engine_info einfo;
  akv_engine *e, *newer = NULL, *got;
  akv_context *mine = NULL, *c = NULL;
  uint64_t digest;
  uint32_t creates = 0, len = 0, id = 0;
  assert_int_equal(akv_group_world_create(1, 4, &world), AKV_OK);
  assert_int_equal(akv_group_create_inproc(&ec, &gc, world, &g), AKV_OK);
  assert_int_equal(akv_group_engine(g, &e), AKV_OK);
  assert_int_equal(akv_engine_destroy(e), AKV_OK);
  /* Later engines, each destroyed at once (back to the tail of the FIFO),
   * until one takes the dead engine's record. */
  while (newer == NULL && creates < 4096) {
    akv_engine *x;
    assert_int_equal(akv_engine_create(&ec, &x), AKV_OK);
    creates++;
    if (x == e)
      newer = x;
    else
      assert_int_equal(akv_engine_destroy(x), AKV_OK);
  }
  assert_ptr_equal(newer, e);
  assert_true(creates > AKV_ENGINE_HANDLE_REUSE_MIN);
  assert_int_equal(akv_context_open(newer, NULL, &mine), AKV_OK);
  assert_int_equal(akv_context_id(mine, &id), AKV_OK);
  digest = akv_engine_plan_digest(newer);
  /* The group hands out no engine: its own is gone. */
  got = newer;
  assert_int_equal(akv_group_engine(g, &got), AKV_OK);
  assert_null(got);
  /* The next agreement point stops the group, as for any engine destroyed
   * directly; no context is opened on the newer engine. */
  assert_int_equal(akv_group_context_open(g, NULL, &c), AKV_ERR_QUARANTINED);
  assert_null(c);
  assert_int_equal(akv_group_info_get(g, &info), AKV_OK);
  assert_true(info.stopped);
  assert_int_equal(info.reason, AKV_GROUP_PEER_FAILED);
  assert_int_equal(info.failed_rank, 0);
  assert_int_equal(akv_group_check(g), AKV_ERR_QUARANTINED);
  assert_int_equal(akv_group_step_begin(g, &mine, 1), AKV_ERR_QUARANTINED);
  assert_int_equal(akv_group_context_close(g, mine), AKV_ERR_QUARANTINED);
  /* Destroy frees the group and leaves the newer engine alone. */
  assert_int_equal(akv_group_destroy(g), AKV_OK);
  assert_int_equal(akv_group_destroy(g), AKV_ERR_BAD_HANDLE);
  assert_int_equal(akv_engine_info_get(newer, &einfo), AKV_OK);
  assert_false(einfo.quarantined);
  assert_false(einfo.transport_failed);
  assert_int_equal(akv_engine_plan_digest(newer), digest);
  assert_int_equal(akv_context_length(mine, &len), AKV_OK);
  assert_int_equal(akv_context_close(mine), AKV_OK);
  assert_int_equal(akv_engine_destroy(newer), AKV_OK);
  assert_int_equal(akv_group_world_destroy(world), AKV_OK);
}

/* Two groups whose engines share one log callback. A line of group 1's
 * engine runs the callback, which checks group 2 (its world aborted: the
 * check logs a warning to the same callback). akv.h (akv_log_fn): nothing
 * is logged to a callback from inside it, group lines included; before,
 * group 2's warning ran the callback nested in itself. */
typedef struct shared_log {
  akv_group *other;
  uint32_t depth, max_depth, lines;
  int armed;
  akv_status nested_check;
} shared_log;

static void shared_log_fn(void *user, akv_log_level level, const char *message) {
  shared_log *s = user;
  (void)level;
  (void)message;
  s->lines++;
  if (!s->armed) return;
  if (++s->depth > s->max_depth) s->max_depth = s->depth;
  if (s->depth < 4) s->nested_check = akv_group_check(s->other);
  s->depth--;
}

static void test_group_lines_never_nest_in_the_callback(void **state) {
  (void)state;
  akv_group_world *w1, *w2;
  akv_group *g1 = NULL, *g2 = NULL;
  akv_group_config gc = AKV_GROUP_CONFIG_INIT;
  akv_engine_config ec = shard_config(1, 1, 4);
  akv_engine *e1 = NULL;
  shared_log sl;
  memset(&sl, 0, sizeof sl);
  ec.log_fn = shared_log_fn;
  ec.log_user = &sl;
  ec.log_level = AKV_LOG_DEBUG;
  assert_int_equal(akv_group_world_create(1, 4, &w1), AKV_OK);
  assert_int_equal(akv_group_world_create(1, 4, &w2), AKV_OK);
  assert_int_equal(akv_group_create_inproc(&ec, &gc, w1, &g1), AKV_OK);
  assert_int_equal(akv_group_create_inproc(&ec, &gc, w2, &g2), AKV_OK);
  assert_int_equal(akv_group_world_abort(w2), AKV_OK);
  assert_int_equal(akv_group_engine(g1, &e1), AKV_OK);
  sl.other = g2;
  sl.armed = 1;
  sl.lines = 0;
  assert_int_equal(akv_step_end(e1), AKV_ERR_STEP_STATE); /* logged at DEBUG */
  sl.armed = 0;
  assert_true(sl.lines > 0);
  assert_int_equal(sl.max_depth, 1);
  assert_int_equal(sl.nested_check, AKV_ERR_COMM);
  assert_int_equal(akv_group_destroy(g1), AKV_OK);
  assert_int_equal(akv_group_destroy(g2), AKV_OK);
  assert_int_equal(akv_group_world_destroy(w1), AKV_OK);
  assert_int_equal(akv_group_world_destroy(w2), AKV_OK);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_pressure_identical_plans),
      cmocka_unit_test(test_fault_quarantines_all),
      cmocka_unit_test(test_missing_rank_times_out),
      cmocka_unit_test(test_comm_abort),
      cmocka_unit_test(test_digest_mismatch),
      cmocka_unit_test(test_different_calls_diverge),
      cmocka_unit_test(test_disagreement_changes_nothing),
      cmocka_unit_test(test_geometry_disagrees),
      cmocka_unit_test(test_illegal_calls),
      cmocka_unit_test(test_world_duplicate_rank),
      cmocka_unit_test(test_world_and_group_lifetime),
      cmocka_unit_test(test_world_destroy_races_calls),
      cmocka_unit_test(test_engine_destroyed_behind_group),
      cmocka_unit_test(test_uneven_layers_on_one_rank),
      cmocka_unit_test(test_close_while_one_rank_in_step),
      cmocka_unit_test(test_log_callback_reentry),
      cmocka_unit_test(test_group_lines_never_nest_in_the_callback),
      cmocka_unit_test(test_nested_agreement_from_engine_log),
      cmocka_unit_test(test_agreement_from_engine_log_one_rank),
      cmocka_unit_test(test_stop_from_engine_log_quarantines_later),
      cmocka_unit_test(test_create_null_argument_on_one_rank),
      cmocka_unit_test(test_create_meets_another_call),
      cmocka_unit_test(test_world_of_unbounded_contexts),
      cmocka_unit_test(test_group_config_digest_enum),
      cmocka_unit_test(test_world_abort_after_timeout),
      cmocka_unit_test(test_world_size_bounded),
      cmocka_unit_test(test_group_size_bounded),
      cmocka_unit_test(test_engine_destroyed_record_reused),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
