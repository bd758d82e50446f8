/*
 * test_group_audit.c - the group API (akv_group.h) against hostile call
 * sequences an outside tester writes: pointers into the middle of live
 * group and world records whose bytes the caller chose, stale handles
 * racing the reuse of their records, arguments that differ per rank, the
 * extreme timeouts, and calls after a stop. Each test names the promise it
 * checks; a refused call returns its exact status and changes nothing.
 *
 * Ranks are threads over the in-process world; every wait is bounded by a
 * group timeout of at most a few hundred ms where a rank is expected to be
 * missing.
 */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <sched.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
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

#define LAYERS 8
#define KV_HEADS 2
#define HEAD_DIM 8

/* The magic words of a live group and a live world record (group.c,
 * group_inproc.c): values a caller may put in its own config fields. */
#define GROUP_MAGIC 0x474b5641u
#define WORLD_MAGIC 0x57564b41u

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

/* A shard whose harmless fields hold a group record's magic: a delay seed
 * with no delay (host_delay_max_us 0), a fault on an operation no test
 * reaches, a log_user the callback ignores. A group keeps its shard config
 * in its record, so these words lie inside the record. */
static akv_engine_config magic_shard(void) {
  akv_engine_config c = shard_config(4);
  c.host_delay_seed = ((uint64_t)GROUP_MAGIC << 32) | GROUP_MAGIC;
  c.host_delay_max_us = 0;
  c.fault_fail_nth = GROUP_MAGIC;
  c.log_user = (void *)(uintptr_t)(((uint64_t)GROUP_MAGIC << 32) | GROUP_MAGIC);
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

/* ------------------------------------------------ interior pointers */

/* Every pointer g + off, 0 < off < span, that is not one of the `n` live
 * handles in `live`, is refused by every group call without reading or
 * writing the records around it. */
static void assert_interior_refused(akv_group *g, size_t span, akv_group *const *live, size_t n) {
  for (size_t off = 1; off < span; off++) {
    akv_group *p = (akv_group *)((char *)g + off);
    akv_group_info info;
    akv_engine *e = NULL;
    int is_live = 0;
    for (size_t i = 0; i < n; i++) is_live |= p == live[i];
    if (is_live) continue;
    memset(&info, 0x5a, sizeof(info));
    assert_int_equal(akv_group_info_get(p, &info), AKV_ERR_BAD_HANDLE);
    assert_int_equal(info.rank, 0x5a5a5a5au); /* untouched */
    assert_int_equal(akv_group_engine(p, &e), AKV_ERR_BAD_HANDLE);
    assert_null(e);
    assert_string_equal(akv_group_last_error(p), "bad group handle");
  }
}

/* Promise (akv_group.h, Handles): a pointer that was never a group handle,
 * whatever its bytes, is refused (AKV_ERR_BAD_HANDLE) and never read as
 * one. A pointer into the middle of a live group record was taken for a
 * group when the words where its two magics would lie held the magic: a
 * group keeps its caller's shard config in its record, so a caller's
 * fields (a delay seed, a fault index, log_user) put them there. The claim
 * then wrote its owner word into the next group's record (over that
 * group's log callback) and the call read the bytes around as a group's
 * vector and collective; on the last record of a pool chunk the second
 * magic was read past the chunk (ASan: heap-buffer-overflow). Every group
 * here must also be intact afterwards. Runs first, on a fresh pool, so
 * its groups lie next to each other. */
static void test_interior_pointers_of_groups_refused(void **state) {
  (void)state;
  enum { N = 8 };
  akv_group_world *worlds[N];
  akv_group *groups[N];
  akv_engine_config ec = magic_shard();
  akv_group_config gc = AKV_GROUP_CONFIG_INIT;
  gc.timeout_ms = GROUP_MAGIC; /* a valid timeout, and a magic word in the record */
  for (int i = 0; i < N; i++) {
    assert_int_equal(akv_group_world_create(1, 4, &worlds[i]), AKV_OK);
    assert_int_equal(akv_group_create_inproc(&ec, &gc, worlds[i], &groups[i]), AKV_OK);
  }
  for (int i = 0; i < N; i++) assert_interior_refused(groups[i], 2048, groups, N);
  for (int i = 0; i < N; i++) {
    akv_group_info info;
    akv_context *c = NULL;
    assert_int_equal(akv_group_check(groups[i]), AKV_OK);
    assert_int_equal(akv_group_context_open(groups[i], NULL, &c), AKV_OK);
    assert_int_equal(akv_group_context_close(groups[i], c), AKV_OK);
    assert_int_equal(akv_group_info_get(groups[i], &info), AKV_OK);
    assert_false(info.stopped);
    assert_int_equal(info.size, 1);
    assert_int_equal(info.local_max_contexts, 4);
    assert_int_equal(info.agreements, 2 + 1 + 2 + 2);
  }
  for (int i = 0; i < N; i++) {
    assert_int_equal(akv_group_destroy(groups[i]), AKV_OK);
    assert_int_equal(akv_group_world_destroy(worlds[i]), AKV_OK);
  }
  /* Every record of the pool in turn (the last of a chunk among them):
   * one group at a time, its interior scanned. */
  {
    akv_group_world *w;
    assert_int_equal(akv_group_world_create(1, 4, &w), AKV_OK);
    for (int i = 0; i < 80; i++) {
      akv_group *g;
      assert_int_equal(akv_group_create_inproc(&ec, &gc, w, &g), AKV_OK);
      assert_interior_refused(g, 1024, &g, 1);
      assert_int_equal(akv_group_check(g), AKV_OK);
      assert_int_equal(akv_group_destroy(g), AKV_OK);
    }
    assert_int_equal(akv_group_world_destroy(w), AKV_OK);
  }
}

/* Promise (akv_group.h, Handles; world calls): a pointer that was never a
 * world handle is refused with AKV_ERR_INVALID_ARGUMENT, never read as one.
 * A world record holds the caller's max_contexts; one equal to the world
 * magic made the pointer to that field read as a live world, whose
 * "in-process world" was the next record's bytes: akv_group_world_abort
 * answered AKV_OK (or aborted through a garbage pointer) and
 * akv_group_world_destroy freed one. */
static void test_interior_pointers_of_worlds_refused(void **state) {
  (void)state;
  enum { N = 4 };
  akv_group_world *worlds[N];
  akv_engine_config ec = shard_config(4);
  akv_group_config gc = AKV_GROUP_CONFIG_INIT;
  for (int i = 0; i < N; i++)
    assert_int_equal(akv_group_world_create(1, WORLD_MAGIC, &worlds[i]), AKV_OK);
  for (int i = 0; i < N; i++) {
    for (size_t off = 1; off < 64; off++) {
      akv_group_world *p = (akv_group_world *)((char *)worlds[i] + off);
      akv_group *g = NULL;
      int is_live = 0;
      for (int k = 0; k < N; k++) is_live |= p == worlds[k];
      if (is_live) continue;
      assert_int_equal(akv_group_world_abort(p), AKV_ERR_INVALID_ARGUMENT);
      assert_int_equal(akv_group_create_inproc(&ec, &gc, p, &g), AKV_ERR_INVALID_ARGUMENT);
      assert_null(g);
      assert_int_equal(akv_group_world_destroy(p), AKV_ERR_INVALID_ARGUMENT);
    }
  }
  /* Nothing of the worlds changed: none aborted, each takes its group. */
  for (int i = 0; i < N; i++) {
    akv_group *g = NULL;
    assert_int_equal(akv_group_create_inproc(&ec, &gc, worlds[i], &g), AKV_OK);
    assert_int_equal(akv_group_check(g), AKV_OK);
    assert_int_equal(akv_group_destroy(g), AKV_OK);
    assert_int_equal(akv_group_world_destroy(worlds[i]), AKV_OK);
  }
}

/* ------------------------------------------------ stale handles */

typedef struct stale {
  akv_group *dead[8];
  uint32_t n_dead;
  atomic_int done;
  uint32_t bad; /* statuses outside the allowed sets */
  uint32_t calls;
} stale;

/* Calls on handles destroyed before the churn began. Until 32 later creates
 * they answer AKV_ERR_BAD_HANDLE; after that a record may name a new group
 * of the other thread (akv_group.h: "at least 32 later group creates"), so
 * AKV_OK and AKV_ERR_IN_USE are allowed too. Never anything else. */
static void *stale_caller_main(void *arg) {
  stale *s = arg;
  while (!atomic_load(&s->done)) {
    for (uint32_t i = 0; i < s->n_dead; i++) {
      akv_group_info info;
      akv_engine *e = NULL;
      akv_status a = akv_group_info_get(s->dead[i], &info);
      akv_status b = akv_group_engine(s->dead[i], &e);
      const char *m = akv_group_last_error(s->dead[i]);
      if ((a != AKV_OK && a != AKV_ERR_BAD_HANDLE && a != AKV_ERR_IN_USE) ||
          (b != AKV_OK && b != AKV_ERR_BAD_HANDLE && b != AKV_ERR_IN_USE) || m == NULL)
        s->bad++;
      s->calls++;
    }
  }
  return NULL;
}

/* Promise (akv_group_destroy; akv_group.h, Handles and Thread safety): a
 * destroyed handle stays readable and is refused; a thread that keeps
 * calling on it while its record is handed out again by later creates
 * reads and writes nothing of the record that races the create building
 * the new group in it (TSan), and sees either a dead record or a whole
 * live group. */
static void test_stale_handles_racing_record_reuse(void **state) {
  (void)state;
  stale s;
  pthread_t th;
  akv_group_world *w;
  akv_engine_config ec = shard_config(4);
  akv_group_config gc = AKV_GROUP_CONFIG_INIT;
  memset(&s, 0, sizeof(s));
  assert_int_equal(akv_group_world_create(1, 4, &w), AKV_OK);
  for (uint32_t i = 0; i < 8; i++) {
    assert_int_equal(akv_group_create_inproc(&ec, &gc, w, &s.dead[i]), AKV_OK);
    assert_int_equal(akv_group_destroy(s.dead[i]), AKV_OK);
  }
  s.n_dead = 8;
  atomic_store(&s.done, 0);
  assert_int_equal(pthread_create(&th, NULL, stale_caller_main, &s), 0);
  for (int i = 0; i < 150; i++) {
    akv_group *g = NULL;
    akv_status st;
    assert_int_equal(akv_group_create_inproc(&ec, &gc, w, &g), AKV_OK);
    while ((st = akv_group_check(g)) == AKV_ERR_IN_USE) sched_yield();
    assert_int_equal(st, AKV_OK);
    while ((st = akv_group_destroy(g)) == AKV_ERR_IN_USE) sched_yield();
    assert_int_equal(st, AKV_OK);
  }
  atomic_store(&s.done, 1);
  pthread_join(th, NULL);
  assert_int_equal(s.bad, 0);
  assert_true(s.calls > 0);
  assert_int_equal(akv_group_world_destroy(w), AKV_OK);
}

/* ------------------------------------------------ timeouts per rank */

typedef struct trank {
  akv_group_world *world;
  uint32_t rank, size, timeout_ms;
  int absent;      /* 1: this rank makes no call after create (a missing rank) */
  long delay_ms;   /* before the check */
  akv_status create, check, later;
  double check_s;
  akv_group_info info;
} trank;

static void *trank_main(void *arg) {
  trank *r = arg;
  akv_engine_config ec = shard_config(4);
  akv_group_config gc = AKV_GROUP_CONFIG_INIT;
  akv_group *g = NULL;
  double t0;
  gc.rank = r->rank;
  gc.size = r->size;
  gc.timeout_ms = r->timeout_ms;
  r->create = akv_group_create_inproc(&ec, &gc, r->world, &g);
  if (r->create != AKV_OK) return NULL;
  if (!r->absent) {
    if (r->delay_ms > 0) sleep_ms(r->delay_ms);
    t0 = now_s();
    r->check = akv_group_check(g);
    r->check_s = now_s() - t0;
    r->later = akv_group_check(g);
  }
  akv_group_info_get(g, &r->info);
  if (akv_group_destroy(g) != AKV_OK) r->create = AKV_ERR_BUSY; /* seen by the test */
  return NULL;
}

static void init_tranks(akv_group_world *world, trank *r, uint32_t n, const uint32_t *timeout_ms) {
  for (uint32_t i = 0; i < n; i++) {
    memset(&r[i], 0, sizeof(r[i]));
    r[i].world = world;
    r[i].rank = i;
    r[i].size = n;
    r[i].timeout_ms = timeout_ms[i];
  }
}

/* Promise (akv_group_config.timeout_ms, >= 1; a missing rank times out):
 * a timeout of 0 on one rank is refused on every rank (AKV_ERR_CONFIG)
 * without waiting out anyone's timeout and without aborting the world;
 * the largest timeout (UINT32_MAX ms, 49 days) on one rank is a deadline,
 * not an overflow: it waits for a late peer, and when a peer never comes
 * the rank with the huge timeout is woken by another waiting rank's short
 * timeout (which aborts the world) instead of hanging. The ranks' timeouts
 * need not agree. */
static void test_per_rank_timeouts_zero_and_huge(void **state) {
  (void)state;
  akv_group_world *world;
  trank r[3];
  assert_int_equal(akv_group_world_create(2, 4, &world), AKV_OK);
  {
    const uint32_t t[2] = {0, 60000};
    double t0 = now_s();
    init_tranks(world, r, 2, t);
    RUN_RANKS(trank_main, r, 2);
    assert_int_equal(r[0].create, AKV_ERR_CONFIG);
    assert_int_equal(r[1].create, AKV_ERR_CONFIG);
    assert_true(now_s() - t0 < 5.0);
  }
  {
    /* The same world (not aborted): rank 1 waits with the huge timeout for
     * rank 0, 100 ms late. */
    const uint32_t t[2] = {300, UINT32_MAX};
    init_tranks(world, r, 2, t);
    r[0].delay_ms = 100;
    RUN_RANKS(trank_main, r, 2);
    for (uint32_t i = 0; i < 2; i++) {
      assert_int_equal(r[i].create, AKV_OK);
      assert_int_equal(r[i].check, AKV_OK);
      assert_int_equal(r[i].later, AKV_OK);
      assert_false(r[i].info.stopped);
    }
    assert_true(r[1].check_s >= 0.05);
  }
  assert_int_equal(akv_group_world_destroy(world), AKV_OK);
  assert_int_equal(akv_group_world_create(3, 4, &world), AKV_OK);
  {
    /* Rank 1 never comes to the check; rank 0 (150 ms) and rank 2 (the
     * huge timeout) wait for it. */
    const uint32_t t[3] = {150, 60000, UINT32_MAX};
    init_tranks(world, r, 3, t);
    r[1].absent = 1;
    RUN_RANKS(trank_main, r, 3);
    for (uint32_t i = 0; i < 3; i++) assert_int_equal(r[i].create, AKV_OK);
    for (uint32_t i = 0; i < 3; i += 2) {
      assert_int_equal(r[i].check, AKV_ERR_TIMEOUT);
      assert_true(r[i].check_s < 5.0);
      assert_int_equal(r[i].later, AKV_ERR_QUARANTINED); /* no collective after a stop */
      assert_true(r[i].info.stopped);
      assert_int_equal(r[i].info.reason, AKV_GROUP_TIMEOUT);
    }
    assert_false(r[1].info.stopped); /* it made no call: it learns at its next */
  }
  assert_int_equal(akv_group_world_destroy(world), AKV_OK);
}

/* ------------------------------------------------ pairs of ranks */

typedef struct prank {
  akv_group_world *world;
  uint32_t rank;
  akv_engine_config ec;
  uint32_t timeout_ms;
  akv_group *g;
  akv_status st;
} prank;

static void *prank_create_main(void *arg) {
  prank *r = arg;
  akv_group_config gc = AKV_GROUP_CONFIG_INIT;
  gc.rank = r->rank;
  gc.size = 2;
  gc.timeout_ms = r->timeout_ms;
  gc.digest = AKV_GROUP_DIGEST_ON;
  r->g = NULL;
  r->st = akv_group_create_inproc(&r->ec, &gc, r->world, &r->g);
  return NULL;
}

static void init_pranks(prank *r, akv_group_world *world, uint32_t timeout_ms) {
  for (uint32_t i = 0; i < 2; i++) {
    memset(&r[i], 0, sizeof(r[i]));
    r[i].world = world;
    r[i].rank = i;
    r[i].ec = shard_config(4);
    r[i].timeout_ms = timeout_ms;
  }
}

/* One agreement call per rank, each from its own thread. */
typedef enum pcall_kind { P_CHECK, P_OPEN, P_CLOSE, P_STEP } pcall_kind;

typedef struct pcall {
  akv_group *g;
  pcall_kind kind;
  akv_context *c;       /* P_CLOSE: the context; P_OPEN: the one opened */
  akv_context *cs[2];   /* P_STEP */
  uint32_t n;
  akv_status st;
  double took_s;
} pcall;

static void *pcall_main(void *arg) {
  pcall *c = arg;
  double t0 = now_s();
  switch (c->kind) {
    case P_CHECK: c->st = akv_group_check(c->g); break;
    case P_OPEN: c->st = akv_group_context_open(c->g, NULL, &c->c); break;
    case P_CLOSE: c->st = akv_group_context_close(c->g, c->c); break;
    case P_STEP: c->st = akv_group_step_begin(c->g, c->cs, c->n); break;
  }
  c->took_s = now_s() - t0;
  return NULL;
}

static void run_pcalls(akv_group *g0, akv_group *g1, pcall_kind kind, pcall *c) {
  memset(c, 0, 2 * sizeof(*c));
  c[0].g = g0;
  c[1].g = g1;
  c[0].kind = c[1].kind = kind;
  RUN_RANKS(pcall_main, c, 2);
}

/* Promise (akv_group.h: after a stop every group call returns
 * AKV_ERR_QUARANTINED without a collective; info, engine and destroy
 * remain; headroom is not a group feature): the group's engine refuses a
 * headroom change (AKV_ERR_NOT_SUPPORTED) and the plan stays agreed; a
 * context opened behind the group's back on one rank stops both ranks at
 * the next check (digest mismatch); from then on every agreement call on
 * either rank answers AKV_ERR_QUARANTINED at once, whatever its
 * arguments (NULL, another rank's context, a bad count), completes no
 * collective and changes nothing; destroy frees the group with its
 * contexts still open (ASan: no leak) and the world is then free. */
static void test_stopped_group_refuses_everything(void **state) {
  (void)state;
  akv_group_world *world;
  prank r[2];
  pcall c[2];
  akv_context *ctx[2], *behind = NULL;
  akv_group_info info[2];
  assert_int_equal(akv_group_world_create(2, 4, &world), AKV_OK);
  init_pranks(r, world, 2000);
  RUN_RANKS(prank_create_main, r, 2);
  for (uint32_t i = 0; i < 2; i++) assert_int_equal(r[i].st, AKV_OK);
  run_pcalls(r[0].g, r[1].g, P_OPEN, c);
  for (uint32_t i = 0; i < 2; i++) {
    akv_engine *e = NULL;
    uint64_t bytes = 77;
    assert_int_equal(c[i].st, AKV_OK);
    ctx[i] = c[i].c;
    assert_int_equal(akv_group_engine(r[i].g, &e), AKV_OK);
    assert_int_equal(akv_headroom_release(e, 1u << 20, &bytes, NULL), AKV_ERR_NOT_SUPPORTED);
    assert_int_equal(akv_headroom_take(e, 1u << 20, &bytes), AKV_ERR_NOT_SUPPORTED);
    assert_int_equal(bytes, 77);
  }
  run_pcalls(r[0].g, r[1].g, P_CHECK, c);
  for (uint32_t i = 0; i < 2; i++) assert_int_equal(c[i].st, AKV_OK);
  {
    akv_engine *e0 = NULL;
    assert_int_equal(akv_group_engine(r[0].g, &e0), AKV_OK);
    assert_int_equal(akv_context_open(e0, NULL, &behind), AKV_OK);
  }
  run_pcalls(r[0].g, r[1].g, P_CHECK, c);
  for (uint32_t i = 0; i < 2; i++) {
    assert_int_equal(c[i].st, AKV_ERR_QUARANTINED);
    assert_int_equal(akv_group_info_get(r[i].g, &info[i]), AKV_OK);
    assert_true(info[i].stopped);
    assert_int_equal(info[i].reason, AKV_GROUP_DIGEST_MISMATCH);
  }
  /* Every agreement call, on one rank alone (no peer waits), at once. */
  for (uint32_t i = 0; i < 2; i++) {
    akv_group *g = r[i].g;
    akv_context *out = (akv_context *)0x1, *mixed[2] = {ctx[0], ctx[1]};
    akv_group_info now;
    akv_engine *e = NULL;
    akv_engine_info einfo;
    double t0 = now_s();
    assert_int_equal(akv_group_check(g), AKV_ERR_QUARANTINED);
    assert_int_equal(akv_group_context_open(g, NULL, &out), AKV_ERR_QUARANTINED);
    assert_ptr_equal(out, (akv_context *)0x1);
    assert_int_equal(akv_group_context_open(g, NULL, NULL), AKV_ERR_QUARANTINED);
    assert_int_equal(akv_group_context_close(g, ctx[i]), AKV_ERR_QUARANTINED);
    assert_int_equal(akv_group_context_close(g, ctx[1 - i]), AKV_ERR_QUARANTINED);
    assert_int_equal(akv_group_context_close(g, NULL), AKV_ERR_QUARANTINED);
    assert_int_equal(akv_group_step_begin(g, &ctx[i], 1), AKV_ERR_QUARANTINED);
    assert_int_equal(akv_group_step_begin(g, mixed, 2), AKV_ERR_QUARANTINED);
    assert_int_equal(akv_group_step_begin(g, NULL, UINT32_MAX), AKV_ERR_QUARANTINED);
    assert_true(now_s() - t0 < 1.0); /* no collective: the timeout is 2 s */
    assert_int_equal(akv_group_info_get(g, &now), AKV_OK);
    assert_int_equal(now.agreements, info[i].agreements);
    assert_int_equal(now.reason, AKV_GROUP_DIGEST_MISMATCH);
    assert_true(strlen(akv_group_last_error(g)) > 0);
    assert_int_equal(akv_group_engine(g, &e), AKV_OK);
    assert_non_null(e);
    assert_int_equal(akv_engine_info_get(e, &einfo), AKV_OK);
    assert_true(einfo.quarantined);
  }
  /* The world is busy until both groups are gone; destroy frees the
   * engines with their contexts still open (the one behind the group's
   * back among them). */
  assert_int_equal(akv_group_world_destroy(world), AKV_ERR_BUSY);
  assert_int_equal(akv_group_destroy(r[0].g), AKV_OK);
  assert_int_equal(akv_group_world_destroy(world), AKV_ERR_BUSY);
  assert_int_equal(akv_group_destroy(r[1].g), AKV_OK);
  assert_int_equal(akv_group_destroy(r[1].g), AKV_ERR_BAD_HANDLE);
  assert_int_equal(akv_group_world_destroy(world), AKV_OK);
}

/* Promise (create: the same status on every rank; nothing of a failed
 * create survives): an engine config that only one rank's engine refuses
 * (log_level outside akv_log_level is not part of the agreed geometry)
 * fails every rank's create with that rank's status, AKV_ERR_CONFIG; the
 * other rank's engine, already made, is destroyed (ASan: no leak), its
 * rank is free again and the world was not aborted: the same ranks then
 * make a group in it. Likewise a shard that asks for more contexts than
 * the world takes is this rank's error alone, refused before it meets the
 * others, which time out (bounded) and abort the world. */
static void test_create_fails_on_one_rank_only(void **state) {
  (void)state;
  akv_group_world *world;
  prank r[2];
  for (int round = 0; round < 3; round++) {
    assert_int_equal(akv_group_world_create(2, 4, &world), AKV_OK);
    init_pranks(r, world, 2000);
    r[round & 1].ec.log_level = (akv_log_level)99;
    RUN_RANKS(prank_create_main, r, 2);
    for (uint32_t i = 0; i < 2; i++) {
      assert_int_equal(r[i].st, AKV_ERR_CONFIG);
      assert_null(r[i].g);
    }
    init_pranks(r, world, 2000);
    RUN_RANKS(prank_create_main, r, 2);
    for (uint32_t i = 0; i < 2; i++) assert_int_equal(r[i].st, AKV_OK);
    for (uint32_t i = 0; i < 2; i++) assert_int_equal(akv_group_destroy(r[i].g), AKV_OK);
    assert_int_equal(akv_group_world_destroy(world), AKV_OK);
  }
  assert_int_equal(akv_group_world_create(2, 4, &world), AKV_OK);
  init_pranks(r, world, 200);
  r[1].ec.max_contexts = 5; /* the world takes 4 */
  {
    double t0 = now_s();
    RUN_RANKS(prank_create_main, r, 2);
    assert_int_equal(r[1].st, AKV_ERR_CONFIG);
    assert_int_equal(r[0].st, AKV_ERR_TIMEOUT);
    assert_true(now_s() - t0 < 5.0);
  }
  for (uint32_t i = 0; i < 2; i++) assert_null(r[i].g);
  /* Aborted by the timeout: a later create fails at once, leaving nothing. */
  init_pranks(r, world, 60000);
  {
    double t0 = now_s();
    RUN_RANKS(prank_create_main, r, 2);
    for (uint32_t i = 0; i < 2; i++) assert_int_equal(r[i].st, AKV_ERR_TIMEOUT);
    assert_true(now_s() - t0 < 5.0);
  }
  assert_int_equal(akv_group_world_destroy(world), AKV_OK);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_interior_pointers_of_groups_refused),
      cmocka_unit_test(test_interior_pointers_of_worlds_refused),
      cmocka_unit_test(test_stale_handles_racing_record_reuse),
      cmocka_unit_test(test_per_rank_timeouts_zero_and_huge),
      cmocka_unit_test(test_stopped_group_refuses_everything),
      cmocka_unit_test(test_create_fails_on_one_rank_only),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
