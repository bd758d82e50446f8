/*
 * test_audit_s27_core.c - the core and the group layer against hostile call
 * sequences an outside tester writes: fork() while another thread is inside
 * group and world calls (the group layer's own locks), an attention hook
 * that takes its own lease on, and whatever else this audit found. Each test
 * names the promise of akv.h or akv_group.h it checks; a refused call returns
 * its exact status and changes nothing.
 */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "akv.h"
#include "akv_group.h"
#include "testutil.h"

#define LAYERS 3 /* akvt_small_config */

#if defined(__SANITIZE_THREAD__)
#define AKVT_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define AKVT_TSAN 1
#endif
#endif

static uint64_t now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

static void sleep_ms(unsigned ms) {
  struct timespec ts = {0, (long)ms * 1000000L};
  nanosleep(&ts, NULL);
}

#ifndef AKVT_TSAN /* the group helpers serve the fork test only */
static akv_engine_config shard_config(void) {
  akv_engine_config c = akvt_small_config(AKV_ROUTE_STAGE, 0);
  c.max_contexts = 2;
  return c;
}

/* A one-rank group on a world of its own (the rank agrees with itself). */
static akv_status one_rank_group(akv_group_world **w, akv_group **g) {
  akv_engine_config ec = shard_config();
  akv_group_config gc = AKV_GROUP_CONFIG_INIT;
  akv_status st;
  gc.timeout_ms = 5000;
  if ((st = akv_group_world_create(1, 2, w)) != AKV_OK) return st;
  if ((st = akv_group_create_inproc(&ec, &gc, *w, g)) != AKV_OK) akv_group_world_destroy(*w);
  return st;
}

/* ------------------------------------------------ fork under group churn */

typedef struct gchurn {
  atomic_int stop;
  atomic_int ready;
  akv_group *mine; /* the churning thread's own group, claimed by it often */
  uint64_t rounds;
  akv_status st;
} gchurn;

/* Group calls (each claim checks the handle against the group records under
 * their pool's mutex) and world calls on a pointer that is no world (the
 * world mutex and the world records' mutex), none of which allocates: a
 * sanitizer's allocator keeps locks of its own that fork does not take, and
 * a child forked inside its malloc may hang there, which is no part of
 * this. */
static void *gchurn_main(void *arg) {
  gchurn *ch = arg;
  akv_group_world *w = NULL;
  uint64_t junk[8] = {0};
  ch->st = one_rank_group(&w, &ch->mine);
  atomic_store(&ch->ready, 1);
  while (ch->st == AKV_OK && !atomic_load(&ch->stop)) {
    akv_group_info info;
    if ((ch->st = akv_group_info_get(ch->mine, &info)) != AKV_OK) break;
    if (akv_group_world_abort((akv_group_world *)junk) != AKV_ERR_INVALID_ARGUMENT) {
      ch->st = (akv_status)999;
      break;
    }
    if (ch->rounds % 64 == 0 && (ch->st = akv_group_check(ch->mine)) != AKV_OK) break;
    ch->rounds++;
  }
  if (ch->mine != NULL && akv_group_destroy(ch->mine) != AKV_OK) ch->st = (akv_status)999;
  if (w != NULL && akv_group_world_destroy(w) != AKV_OK) ch->st = (akv_status)999;
  return NULL;
}

/* The child: a world and a group of its own work (a create, an agreement
 * that opens and closes a context, destroy), and the parent's groups and
 * worlds are refused at once with nothing written. */
static int group_child_work(akv_group *parent_g, akv_group *churn_g, akv_group_world *parent_w) {
  akv_group_world *w = NULL;
  akv_group *g = NULL, *g3 = NULL;
  akv_context *c = NULL;
  akv_engine *e = (akv_engine *)(uintptr_t)0x1;
  akv_group_info info, before;
  akv_engine_config ec = shard_config();
  akv_group_config gc = AKV_GROUP_CONFIG_INIT;
  if (one_rank_group(&w, &g) != AKV_OK) return 10;
  if (akv_group_context_open(g, NULL, &c) != AKV_OK || akv_group_context_close(g, c) != AKV_OK)
    return 11;
  if (akv_group_destroy(g) != AKV_OK || akv_group_world_destroy(w) != AKV_OK) return 12;
  c = NULL;
  memset(&info, 0xA5, sizeof info);
  memcpy(&before, &info, sizeof info);
  akv_group *const theirs[2] = {parent_g, churn_g};
  for (int i = 0; i < 2; i++) {
    akv_group *pg = theirs[i];
    if (akv_group_info_get(pg, &info) != AKV_ERR_BAD_HANDLE ||
        memcmp(&info, &before, sizeof info) != 0)
      return 20 + i;
    if (akv_group_check(pg) != AKV_ERR_BAD_HANDLE) return 22 + i;
    if (akv_group_context_open(pg, NULL, &c) != AKV_ERR_BAD_HANDLE || c != NULL) return 24 + i;
    if (akv_group_engine(pg, &e) != AKV_ERR_BAD_HANDLE || e != (akv_engine *)(uintptr_t)0x1)
      return 26 + i;
    if (strcmp(akv_group_last_error(pg), "bad group handle") != 0) return 28 + i;
    if (akv_group_destroy(pg) != AKV_ERR_BAD_HANDLE) return 30 + i;
  }
  gc.timeout_ms = 200;
  if (akv_group_create_inproc(&ec, &gc, parent_w, &g3) != AKV_ERR_INVALID_ARGUMENT || g3 != NULL)
    return 40;
  if (akv_group_world_abort(parent_w) != AKV_ERR_INVALID_ARGUMENT) return 41;
  if (akv_group_world_destroy(parent_w) != AKV_ERR_INVALID_ARGUMENT) return 42;
  return 0;
}
#endif

/* Promise (akv_group.h, fork): a child forked while another thread is
 * inside group and world calls may make and use worlds and groups of its
 * own, and every call it makes on the parent's groups and worlds is refused
 * (AKV_ERR_BAD_HANDLE; world calls AKV_ERR_INVALID_ARGUMENT) and changes
 * nothing. Before the group layer had fork handlers a child could start
 * with the group records' mutex or akv_world_mu held by the churning thread
 * and hang in its first create, and the parent's groups answered the child
 * (info, an agreement on a one-rank world, even destroy). */
static void test_fork_under_group_churn(void **state) {
  (void)state;
#ifdef AKVT_TSAN
  skip(); /* TSan does not support threads in a child forked from threads */
#else
  akv_group_world *w = NULL;
  akv_group *g = NULL;
  akv_group_info before, after;
  gchurn ch;
  pthread_t th;
  assert_int_equal(one_rank_group(&w, &g), AKV_OK);
  assert_int_equal(akv_group_info_get(g, &before), AKV_OK);
  memset(&ch, 0, sizeof ch);
  assert_int_equal(pthread_create(&th, NULL, gchurn_main, &ch), 0);
  while (!atomic_load(&ch.ready)) sleep_ms(1);
  /* The engines' queue threads have started (a sanitizer's thread start
   * allocates, under its allocator's locks, which fork does not take). */
  sleep_ms(300);
  int bad = 0, hung = 0;
  for (int i = 0; i < 192 && hung == 0 && bad == 0; i++) {
    const pid_t pid = fork();
    if (pid == 0) {
      alarm(20); /* a child that hangs dies, and the parent sees it */
      _exit(group_child_work(g, ch.mine, w));
    }
    assert_true(pid > 0);
    int ws = 0;
    if (!akvt_wait_child(pid, 25000, &ws)) {
      hung++;
    } else if (!WIFEXITED(ws) || WEXITSTATUS(ws) != 0) {
      fprintf(stderr, "fork child %d: %s %d\n", i, WIFEXITED(ws) ? "exit" : "signal",
              WIFEXITED(ws) ? WEXITSTATUS(ws) : WTERMSIG(ws));
      bad++;
    }
  }
  atomic_store(&ch.stop, 1);
  pthread_join(th, NULL);
  assert_int_equal(hung, 0);
  assert_int_equal(bad, 0);
  assert_int_equal(ch.st, AKV_OK);
  /* The parent's group is untouched by its children, and goes on. */
  assert_int_equal(akv_group_info_get(g, &after), AKV_OK);
  assert_memory_equal(&after, &before, sizeof after);
  {
    akv_context *c = NULL;
    assert_int_equal(akv_group_context_open(g, NULL, &c), AKV_OK);
    assert_int_equal(akv_group_context_close(g, c), AKV_OK);
  }
  assert_int_equal(akv_group_destroy(g), AKV_OK);
  assert_int_equal(akv_group_world_destroy(w), AKV_OK);
#endif
}

/* -------------------------------------- a hook that advances its own lease */

typedef struct advancer {
  akv_lease *self;
  int how; /* 1: mark consumed; 2: and write back and seal; 3: mark, then return 1 */
  akv_fence attn, tail;
  akv_status mark, wb, seal;
} advancer;

static int advancer_hook(void *user, const akv_view *view, akv_stream stream) {
  advancer *a = user;
  (void)view;
  a->mark = akv_lease_mark_consumed(a->self, stream, &a->attn);
  if (a->how == 2) {
    a->wb = akv_lease_write_back(a->self, NULL, 0, &a->tail);
    a->seal = akv_lease_seal(a->self, a->tail, a->attn);
  }
  return a->how == 3;
}

static void count_log(void *user, akv_log_level level, const char *message) {
  (void)level;
  (void)message;
  (*(int *)user)++;
}

/* Promise (akv.h, akv_attention_fn): a hook that takes its own lease on
 * without ending it (its own mark_consumed; or that, write-back and seal)
 * makes akv_lease_attend return AKV_OK with *attention the fence its
 * mark_consumed gave; the lease is where the hook left it, the step goes on,
 * no warning is logged and the last error is not touched. attend's own
 * mark_consumed used to be refused (AKV_ERR_LEASE_STATE, a warning) for a
 * lease that had advanced. A nonzero return still fails it. */
static void attend_with_advancing_hook(int how) {
  akvt_fx f;
  advancer a;
  akv_lease *ls = NULL;
  akv_fence attn = {77}, tail = {0};
  akv_engine_info info;
  int lines = 0;
  akv_engine_config cfg = akvt_small_config(AKV_ROUTE_STAGE, 0);
  cfg.log_fn = count_log;
  cfg.log_user = &lines;
  cfg.log_level = AKV_LOG_WARN;
  memset(&f, 0, sizeof f);
  assert_int_equal(akv_engine_create(&cfg, &f.e), AKV_OK);
  assert_int_equal(akv_stream_create(f.e, &f.s), AKV_OK);
  assert_int_equal(akv_context_open(f.e, NULL, &f.c[0]), AKV_OK);
  f.n = 1;
  assert_int_equal(akv_step_begin(f.e, f.c, 1), AKV_OK);
  assert_int_equal(akv_lease_begin(f.e, 0, &ls), AKV_OK);
  memset(&a, 0, sizeof a);
  a.self = ls;
  a.how = how;
  const char *err0 = akv_engine_last_error(f.e);
  char err_before[256];
  snprintf(err_before, sizeof err_before, "%s", err0);
  lines = 0;
  const akv_status st = akv_lease_attend(ls, f.s, advancer_hook, &a, &attn);
  assert_int_equal(a.mark, AKV_OK);
  assert_int_not_equal(a.attn.serial, 0);
  assert_int_equal(akv_engine_info_get(f.e, &info), AKV_OK);
  if (how == 3) {
    assert_int_equal(st, AKV_ERR_BACKEND);
    assert_int_equal(info.transport_failed, 1);
    assert_int_equal(attn.serial, 77);
    assert_int_equal(akv_engine_quarantine(f.e, NULL), AKV_OK);
    assert_int_equal(akv_stream_destroy(f.e, f.s), AKV_OK);
    assert_int_equal(akv_engine_destroy(f.e), AKV_OK);
    return;
  }
  assert_int_equal(st, AKV_OK);
  assert_int_equal(attn.serial, a.attn.serial);
  assert_int_equal(info.transport_failed, 0);
  assert_int_equal(lines, 0);
  assert_string_equal(akv_engine_last_error(f.e), err_before);
  if (how == 1) {
    assert_int_equal(akv_lease_write_back(ls, NULL, 0, &tail), AKV_OK);
    assert_int_equal(akv_lease_seal(ls, tail, attn), AKV_OK);
  } else {
    assert_int_equal(a.wb, AKV_OK);
    assert_int_equal(a.seal, AKV_OK);
  }
  assert_int_equal(akv_lease_retire(ls, NULL), AKV_OK);
  assert_int_equal(akvt_null_layers_from(f.e, f.s, 1, LAYERS), AKV_OK);
  {
    uint32_t len = 0;
    assert_int_equal(akv_context_length(f.c[0], &len), AKV_OK);
    assert_int_equal(len, 1);
  }
  assert_int_equal(akv_context_close(f.c[0]), AKV_OK);
  assert_int_equal(akv_stream_destroy(f.e, f.s), AKV_OK);
  assert_int_equal(akv_engine_destroy(f.e), AKV_OK);
}

static void test_hook_marks_its_own_lease_consumed(void **state) {
  (void)state;
  attend_with_advancing_hook(1);
}

static void test_hook_seals_its_own_lease(void **state) {
  (void)state;
  attend_with_advancing_hook(2);
}

static void test_hook_marks_its_own_lease_and_fails(void **state) {
  (void)state;
  attend_with_advancing_hook(3);
}

/* The hook marks its lease consumed and writes back; the write-back's copy
 * fails (an injected fault). */
typedef struct failing_wb {
  akv_lease *self;
  akv_engine *e;
  uint64_t copies_before; /* copy ops issued before the hook's write-back */
  akv_fence attn, tail;
  akv_status mark, wb;
} failing_wb;

static int failing_wb_hook(void *user, const akv_view *view, akv_stream stream) {
  failing_wb *w = user;
  akv_engine_info info;
  (void)view;
  w->mark = akv_lease_mark_consumed(w->self, stream, &w->attn);
  if (akv_engine_info_get(w->e, &info) == AKV_OK) w->copies_before = info.backend_ops[AKV_OP_COPY];
  w->wb = akv_lease_write_back(w->self, NULL, 0, &w->tail);
  return 0;
}

static akv_status run_failing_wb(uint32_t fail_nth, failing_wb *w, akv_fence *attn) {
  akvt_fx f;
  akv_lease *ls = NULL;
  akv_status st;
  akv_engine_config cfg = akvt_small_config(AKV_ROUTE_STAGE, 0);
  const uint16_t row[16] = {1, 2, 3};
  const void *rows[LAYERS] = {row, row, row};
  cfg.fault_kind = AKV_OP_COPY;
  cfg.fault_fail_nth = fail_nth;
  memset(&f, 0, sizeof f);
  assert_int_equal(akv_engine_create(&cfg, &f.e), AKV_OK);
  assert_int_equal(akv_stream_create(f.e, &f.s), AKV_OK);
  assert_int_equal(akv_context_open(f.e, NULL, &f.c[0]), AKV_OK);
  assert_int_equal(akv_context_append(f.c[0], 1, rows, rows), AKV_OK);
  assert_int_equal(akv_step_begin(f.e, f.c, 1), AKV_OK);
  assert_int_equal(akv_lease_begin(f.e, 0, &ls), AKV_OK);
  memset(w, 0, sizeof *w);
  w->self = ls;
  w->e = f.e;
  st = akv_lease_attend(ls, f.s, failing_wb_hook, w, attn);
  assert_int_equal(akv_engine_quarantine(f.e, NULL), AKV_OK);
  assert_int_equal(akv_stream_destroy(f.e, f.s), AKV_OK);
  assert_int_equal(akv_engine_destroy(f.e), AKV_OK);
  return st;
}

/* Promise (akv.h, akv_attention_fn; Thread safety of a failed engine): a
 * hook that takes its lease on and whose write-back then fails leaves an
 * engine whose transport failed; attend answers as every call then does,
 * AKV_ERR_QUARANTINED, and writes no fence (not AKV_OK for a lease on a
 * failed engine). */
static void test_hook_advances_its_lease_then_the_engine_fails(void **state) {
  failing_wb w;
  akv_fence attn = {88};
  (void)state;
  assert_int_equal(run_failing_wb(0, &w, &attn), AKV_OK); /* no fault: counts the copies */
  assert_int_equal(w.wb, AKV_OK);
  assert_int_equal(attn.serial, w.attn.serial);
  const uint32_t nth = (uint32_t)w.copies_before + 1;
  attn.serial = 88;
  assert_int_equal(run_failing_wb(nth, &w, &attn), AKV_ERR_QUARANTINED);
  assert_int_equal(w.mark, AKV_OK);
  assert_int_equal(w.wb, AKV_ERR_BACKEND);
  assert_int_equal(attn.serial, 88);
}

/* ------------------------------------- a log callback that forks in a group call */

#ifndef AKVT_TSAN
static pid_t forked_pid = -1;

static void forking_log(void *user, akv_log_level level, const char *message) {
  (void)user;
  (void)level;
  if (forked_pid < 0 && strstr(message, "raised to") != NULL) forked_pid = fork();
}
#endif

/* Promise (akv_group.h, fork: a call in the child on a parent's group
 * returns AKV_ERR_BAD_HANDLE and changes nothing): the engine's log
 * callback forks while akv_group_context_open decides (the engine logs the
 * raised target between the agreement's two collectives). In the child the
 * group call went on into the parent's in-process world (whose mutex a rank
 * thread of the parent may hold for good, whose other ranks are not there)
 * and, on a one-rank world, returned AKV_OK. It enters no collective there
 * now and returns AKV_ERR_BAD_HANDLE; the parent's call completes. */
static void test_log_callback_forks_during_a_group_call(void **state) {
  (void)state;
#ifdef AKVT_TSAN
  skip(); /* TSan does not support threads in a child forked from threads */
#else
  akv_group_world *w = NULL;
  akv_group *g = NULL;
  akv_context *c = NULL;
  akv_engine_config ec = akvt_small_config(AKV_ROUTE_ARENA, 1);
  akv_group_config gc = AKV_GROUP_CONFIG_INIT;
  akv_context_config cc = AKV_CONTEXT_CONFIG_INIT;
  ec.max_contexts = 2;
  ec.log_fn = forking_log;
  ec.log_level = AKV_LOG_INFO;
  gc.timeout_ms = 2000;
  cc.target_pages = 1; /* raised to the floor: a line while the engine decides */
  assert_int_equal(akv_group_world_create(1, 2, &w), AKV_OK);
  assert_int_equal(akv_group_create_inproc(&ec, &gc, w, &g), AKV_OK);
  forked_pid = -1;
  const akv_status st = akv_group_context_open(g, &cc, &c);
  if (forked_pid == 0) {
    alarm(20);
    _exit(st == AKV_ERR_BAD_HANDLE ? 0 : 10 + (int)st);
  }
  assert_true(forked_pid > 0);
  int ws = 0;
  assert_true(akvt_wait_child(forked_pid, 25000, &ws));
  assert_true(WIFEXITED(ws));
  assert_int_equal(WEXITSTATUS(ws), 0);
  assert_int_equal(st, AKV_OK);
  assert_int_equal(akv_group_context_close(g, c), AKV_OK);
  assert_int_equal(akv_group_destroy(g), AKV_OK);
  assert_int_equal(akv_group_world_destroy(w), AKV_OK);
#endif
}

/* ------------------------------------------------- a hook that forks */

#ifndef AKVT_TSAN
typedef struct forker {
  pid_t pid;  /* the child's, in the parent; 0 in the child */
  int forked;
} forker;

static int forking_hook(void *user, const akv_view *view, akv_stream stream) {
  forker *k = user;
  (void)view;
  (void)stream;
  k->pid = fork();
  k->forked = k->pid >= 0;
  return 0;
}
#endif

/* Promise (akv.h, fork: every call a child makes on the parent's engines
 * returns AKV_ERR_BAD_HANDLE at once and changes nothing): an attention
 * hook that forks returns twice, and in the child the attend that ran it is
 * a call on the parent's engine. It went on there (marked the lease
 * consumed on a queue whose worker thread stayed in the parent, whose
 * mutex that thread may hold for good) and returned AKV_OK; now it returns
 * AKV_ERR_BAD_HANDLE, writes no fence and touches nothing after the hook.
 * The parent's attend completes as usual. */
static void test_hook_that_forks(void **state) {
  (void)state;
#ifdef AKVT_TSAN
  skip(); /* TSan does not support threads in a child forked from threads */
#else
  akvt_fx f;
  forker k;
  akv_lease *ls = NULL;
  akv_fence attn = {99}, tail;
  akvt_fx_open(&f, AKV_ROUTE_STAGE, 0, 1, 2);
  assert_int_equal(akv_step_begin(f.e, f.c, 1), AKV_OK);
  assert_int_equal(akv_lease_begin(f.e, 0, &ls), AKV_OK);
  memset(&k, 0, sizeof k);
  const akv_status st = akv_lease_attend(ls, f.s, forking_hook, &k, &attn);
  if (k.forked && k.pid == 0) {
    alarm(20);
    akv_fence t = {0};
    /* The child: attend refused, nothing written; later calls refused. */
    _exit(st != AKV_ERR_BAD_HANDLE ? 10 + (int)st
          : attn.serial != 99      ? 40
          : akv_lease_write_back(ls, NULL, 0, &t) != AKV_ERR_BAD_HANDLE ? 41
                                                                        : 0);
  }
  assert_true(k.forked);
  int ws = 0;
  assert_true(akvt_wait_child(k.pid, 25000, &ws));
  assert_true(WIFEXITED(ws));
  assert_int_equal(WEXITSTATUS(ws), 0);
  assert_int_equal(st, AKV_OK);
  assert_int_not_equal(attn.serial, 99);
  assert_int_equal(akv_lease_write_back(ls, NULL, 0, &tail), AKV_OK);
  assert_int_equal(akv_lease_seal(ls, tail, attn), AKV_OK);
  assert_int_equal(akv_lease_retire(ls, NULL), AKV_OK);
  assert_int_equal(akvt_null_layers_from(f.e, f.s, 1, LAYERS), AKV_OK);
  assert_int_equal(akv_context_close(f.c[0]), AKV_OK);
  assert_int_equal(akv_stream_destroy(f.e, f.s), AKV_OK);
  assert_int_equal(akv_engine_destroy(f.e), AKV_OK);
#endif
}

/* --------------------------- blocking calls from a function on a stream */

/* A function enqueued with akv_stream_launch_host that calls back. It
 * waits (up to 10 s) until the caller's launch returned and the caller
 * says go, so that no call of the caller is in progress when it calls (one
 * would refuse it as another thread's), and stores its statuses. */
typedef struct stream_fn {
  akv_engine *e;
  akv_lease *lease;
  atomic_int go, done;
  akv_status quarantine, retire;
  akv_quarantine_report rep;
  akv_receipt receipt;
  uint64_t ms; /* how long its call took */
} stream_fn;

static void wait_flag_ms(atomic_int *f, unsigned max_ms) {
  const uint64_t t0 = now_ms();
  while (!atomic_load(f) && now_ms() - t0 < max_ms) sleep_ms(1);
}

static void fn_quarantines(void *arg) {
  stream_fn *sf = arg;
  wait_flag_ms(&sf->go, 10000);
  const uint64_t t0 = now_ms();
  sf->quarantine = akv_engine_quarantine(sf->e, &sf->rep);
  sf->ms = now_ms() - t0;
  atomic_store(&sf->done, 1);
}

static void fn_retires(void *arg) {
  stream_fn *sf = arg;
  wait_flag_ms(&sf->go, 10000);
  const uint64_t t0 = now_ms();
  sf->retire = akv_lease_retire(sf->lease, &sf->receipt);
  sf->ms = now_ms() - t0;
  atomic_store(&sf->done, 1);
}

/* An engine whose host queues give up after 3 s (AKV_HOST_SYNC_TIMEOUT_MS,
 * read at create), so that a call that waits for itself ends in this test. */
static void short_timeout_fx(akvt_fx *f, uint32_t n) {
  setenv("AKV_HOST_SYNC_TIMEOUT_MS", "3000", 1);
  akvt_fx_open(f, AKV_ROUTE_STAGE, 0, n, 2);
  unsetenv("AKV_HOST_SYNC_TIMEOUT_MS");
}

/* Promise (akv.h, akv_engine_quarantine; akv_stream_launch_host): a
 * function running on one of the engine's streams that quarantines the
 * engine is refused at once with AKV_ERR_IN_USE, marks nothing and leaves
 * *report alone. Quarantine synchronises the device, every stream of the
 * engine among them, and so the stream whose worker runs the function: it
 * waited for itself until the sync timeout, returned
 * AKV_ERR_UNCERTAIN_FENCE and left the engine closed with everything
 * retained. Also from a second stream of the same engine. */
static void quarantine_from_stream_fn(int other_stream) {
  akvt_fx f;
  stream_fn sf;
  akv_stream s2 = NULL, on;
  akv_engine_info info;
  short_timeout_fx(&f, 1);
  memset(&sf, 0, sizeof sf);
  memset(&sf.rep, 0x5A, sizeof sf.rep);
  const akv_quarantine_report rep0 = sf.rep;
  sf.e = f.e;
  sf.quarantine = AKV_STATUS_COUNT_;
  on = f.s;
  if (other_stream) {
    assert_int_equal(akv_stream_create(f.e, &s2), AKV_OK);
    on = s2;
  }
  assert_int_equal(akv_stream_launch_host(f.e, on, fn_quarantines, &sf), AKV_OK);
  atomic_store(&sf.go, 1);
  wait_flag_ms(&sf.done, 20000);
  assert_true(atomic_load(&sf.done));
  assert_int_equal(sf.quarantine, AKV_ERR_IN_USE);
  assert_true(sf.ms < 2000);
  assert_memory_equal(&sf.rep, &rep0, sizeof rep0);
  assert_int_equal(akv_engine_info_get(f.e, &info), AKV_OK);
  assert_int_equal(info.transport_failed, 0);
  assert_int_equal(info.quarantined, 0);
  /* Nothing changed: the engine steps on. */
  assert_int_equal(akv_step_begin(f.e, f.c, 1), AKV_OK);
  assert_int_equal(akvt_null_layers(f.e, f.s, LAYERS), AKV_OK);
  if (s2 != NULL) assert_int_equal(akv_stream_destroy(f.e, s2), AKV_OK);
  assert_int_equal(akv_context_close(f.c[0]), AKV_OK);
  assert_int_equal(akv_stream_destroy(f.e, f.s), AKV_OK);
  assert_int_equal(akv_engine_destroy(f.e), AKV_OK);
}

static void test_stream_fn_quarantines_its_engine(void **state) {
  (void)state;
  quarantine_from_stream_fn(0);
}

static void test_stream_fn_quarantines_from_another_stream(void **state) {
  (void)state;
  quarantine_from_stream_fn(1);
}

/* Promise (akv.h, akv_lease_retire; akv_stream_launch_host): a function
 * running on a stream of the engine that retires a lease whose events have
 * not all passed is refused at once with AKV_ERR_IN_USE and changes nothing
 * (the lease stays sealed; the caller retires it). The function was
 * enqueued before the lease's mark_consumed on the same stream, so the
 * attention event is behind it: retire waited for the function itself
 * until the sync timeout, failed the transport and returned
 * AKV_ERR_BACKEND. */
static void test_stream_fn_retires_a_lease_behind_it(void **state) {
  akvt_fx f;
  stream_fn sf;
  akv_lease *ls = NULL;
  akv_view view;
  akv_fence attn, tail;
  akv_engine_info info;
  (void)state;
  short_timeout_fx(&f, 1);
  memset(&sf, 0, sizeof sf);
  sf.e = f.e;
  sf.retire = AKV_STATUS_COUNT_;
  memset(&sf.receipt, 0x5A, sizeof sf.receipt);
  const akv_receipt receipt0 = sf.receipt;
  assert_int_equal(akv_step_begin(f.e, f.c, 1), AKV_OK);
  assert_int_equal(akv_lease_begin(f.e, 0, &ls), AKV_OK);
  sf.lease = ls;
  assert_int_equal(akv_lease_wait_ready(ls, f.s, &view), AKV_OK);
  assert_int_equal(akv_stream_launch_host(f.e, f.s, fn_retires, &sf), AKV_OK);
  assert_int_equal(akv_lease_mark_consumed(ls, f.s, &attn), AKV_OK);
  assert_int_equal(akv_lease_write_back(ls, NULL, 0, &tail), AKV_OK);
  assert_int_equal(akv_lease_seal(ls, tail, attn), AKV_OK);
  atomic_store(&sf.go, 1);
  wait_flag_ms(&sf.done, 20000);
  assert_true(atomic_load(&sf.done));
  assert_int_equal(sf.retire, AKV_ERR_IN_USE);
  assert_true(sf.ms < 2000);
  assert_memory_equal(&sf.receipt, &receipt0, sizeof receipt0);
  assert_int_equal(akv_engine_info_get(f.e, &info), AKV_OK);
  assert_int_equal(info.transport_failed, 0);
  assert_int_equal(info.leases_retired, 0);
  /* The lease is still sealed: the caller retires it. */
  assert_int_equal(akv_lease_retire(ls, NULL), AKV_OK);
  assert_int_equal(akvt_null_layers_from(f.e, f.s, 1, LAYERS), AKV_OK);
  assert_int_equal(akv_context_close(f.c[0]), AKV_OK);
  assert_int_equal(akv_stream_destroy(f.e, f.s), AKV_OK);
  assert_int_equal(akv_engine_destroy(f.e), AKV_OK);
}

typedef struct syncer {
  akv_engine *e;
  akv_stream other;
  atomic_int go, done;
  akv_status sync;
  uint64_t ms;
} syncer;

static void fn_syncs_other(void *arg) {
  syncer *y = arg;
  wait_flag_ms(&y->go, 10000);
  const uint64_t t0 = now_ms();
  y->sync = akv_stream_synchronize(y->e, y->other);
  y->ms = now_ms() - t0;
  atomic_store(&y->done, 1);
}

/* Promise (akv.h, akv_stream_launch_host: a call from fn that would wait
 * for fn itself is refused): a function on stream S that synchronises the
 * engine's other stream S2 while S2 waits, through the engine's queues, for
 * work behind the function on S (layer 2's history waits for layer 0's
 * write-back, which waits for layer 0's attention event, recorded on S
 * after the function) waited for itself until the sync timeout and failed
 * the transport. Every stream of the engine counts, not only the
 * function's own: refused with AKV_ERR_IN_USE at once, nothing changed,
 * and the step then completes. */
static void test_stream_fn_synchronizes_another_stream(void **state) {
  akvt_fx f;
  syncer y;
  akv_stream s2 = NULL;
  akv_lease *l0 = NULL, *l1 = NULL, *l2 = NULL;
  akv_view v;
  akv_fence a0, t0, a1, t1, a2, t2;
  akv_engine_info info;
  (void)state;
  short_timeout_fx(&f, 1);
  assert_int_equal(akv_stream_create(f.e, &s2), AKV_OK);
  memset(&y, 0, sizeof y);
  y.e = f.e;
  y.other = s2;
  y.sync = AKV_STATUS_COUNT_;
  assert_int_equal(akv_step_begin(f.e, f.c, 1), AKV_OK);
  assert_int_equal(akv_lease_begin(f.e, 0, &l0), AKV_OK);
  assert_int_equal(akv_lease_wait_ready(l0, f.s, &v), AKV_OK);
  assert_int_equal(akv_stream_launch_host(f.e, f.s, fn_syncs_other, &y), AKV_OK);
  assert_int_equal(akv_lease_mark_consumed(l0, f.s, &a0), AKV_OK);
  assert_int_equal(akv_lease_write_back(l0, NULL, 0, &t0), AKV_OK);
  assert_int_equal(akv_lease_seal(l0, t0, a0), AKV_OK);
  assert_int_equal(akv_lease_begin(f.e, 1, &l1), AKV_OK);
  assert_int_equal(akv_lease_attend(l1, s2, akvt_noop_hook, NULL, &a1), AKV_OK);
  assert_int_equal(akv_lease_write_back(l1, NULL, 0, &t1), AKV_OK);
  assert_int_equal(akv_lease_seal(l1, t1, a1), AKV_OK);
  assert_int_equal(akv_lease_begin(f.e, 2, &l2), AKV_OK);
  assert_int_equal(akv_lease_wait_ready(l2, s2, &v), AKV_OK);
  atomic_store(&y.go, 1);
  wait_flag_ms(&y.done, 20000);
  assert_true(atomic_load(&y.done));
  assert_int_equal(y.sync, AKV_ERR_IN_USE);
  assert_true(y.ms < 2000);
  assert_int_equal(akv_engine_info_get(f.e, &info), AKV_OK);
  assert_int_equal(info.transport_failed, 0);
  assert_int_equal(akv_lease_mark_consumed(l2, s2, &a2), AKV_OK);
  assert_int_equal(akv_lease_write_back(l2, NULL, 0, &t2), AKV_OK);
  assert_int_equal(akv_lease_seal(l2, t2, a2), AKV_OK);
  assert_int_equal(akv_lease_retire(l0, NULL), AKV_OK);
  assert_int_equal(akv_lease_retire(l1, NULL), AKV_OK);
  assert_int_equal(akv_lease_retire(l2, NULL), AKV_OK);
  assert_int_equal(akv_step_end(f.e), AKV_OK);
  assert_int_equal(akv_stream_synchronize(f.e, s2), AKV_OK);
  assert_int_equal(akv_stream_destroy(f.e, s2), AKV_OK);
  assert_int_equal(akv_context_close(f.c[0]), AKV_OK);
  assert_int_equal(akv_stream_destroy(f.e, f.s), AKV_OK);
  assert_int_equal(akv_engine_destroy(f.e), AKV_OK);
}

/* A function that launches functions on its own stream until one is
 * refused (at most 8192: the ring holds fewer). */
typedef struct relauncher {
  akv_engine *e;
  akv_stream s;
  atomic_int go, done, ran;
  uint32_t launched;
  akv_status last;
} relauncher;

static void count_run(void *arg) { atomic_fetch_add(&((relauncher *)arg)->ran, 1); }

static void fn_relaunches(void *arg) {
  relauncher *r = arg;
  wait_flag_ms(&r->go, 10000);
  r->last = AKV_OK;
  while (r->launched < 8192 &&
         (r->last = akv_stream_launch_host(r->e, r->s, count_run, r)) == AKV_OK)
    r->launched++;
  atomic_store(&r->done, 1);
}

/* Promise (akv.h, akv_stream_launch_host): a call from a stream function
 * that would wait for that function is refused with AKV_ERR_IN_USE and
 * changes nothing. A function that enqueues functions on its own stream
 * fills the ring behind itself; the launch that finds it full cannot wait
 * for the worker that runs it. It returned AKV_ERR_BACKEND and failed the
 * transport (the engine closed to all but quarantine and destroy) over a
 * refusal that enqueued nothing; now AKV_ERR_IN_USE, the engine healthy,
 * and every function that was enqueued runs. */
static void test_stream_fn_fills_its_own_ring(void **state) {
  akvt_fx f;
  relauncher r;
  akv_engine_info info;
  (void)state;
  akvt_fx_open(&f, AKV_ROUTE_STAGE, 0, 1, 2);
  memset(&r, 0, sizeof r);
  r.e = f.e;
  r.s = f.s;
  assert_int_equal(akv_stream_launch_host(f.e, f.s, fn_relaunches, &r), AKV_OK);
  atomic_store(&r.go, 1);
  wait_flag_ms(&r.done, 20000);
  assert_true(atomic_load(&r.done));
  assert_int_equal(r.last, AKV_ERR_IN_USE);
  assert_true(r.launched > 0 && r.launched < 8192);
  assert_int_equal(akv_stream_synchronize(f.e, f.s), AKV_OK);
  assert_int_equal(atomic_load(&r.ran), (int)r.launched);
  assert_int_equal(akv_engine_info_get(f.e, &info), AKV_OK);
  assert_int_equal(info.transport_failed, 0);
  assert_int_equal(akv_step_begin(f.e, f.c, 1), AKV_OK);
  assert_int_equal(akvt_null_layers(f.e, f.s, LAYERS), AKV_OK);
  assert_int_equal(akv_context_close(f.c[0]), AKV_OK);
  assert_int_equal(akv_stream_destroy(f.e, f.s), AKV_OK);
  assert_int_equal(akv_engine_destroy(f.e), AKV_OK);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_fork_under_group_churn),
      cmocka_unit_test(test_hook_marks_its_own_lease_consumed),
      cmocka_unit_test(test_hook_seals_its_own_lease),
      cmocka_unit_test(test_hook_marks_its_own_lease_and_fails),
      cmocka_unit_test(test_hook_advances_its_lease_then_the_engine_fails),
      cmocka_unit_test(test_hook_that_forks),
      cmocka_unit_test(test_log_callback_forks_during_a_group_call),
      cmocka_unit_test(test_stream_fn_quarantines_its_engine),
      cmocka_unit_test(test_stream_fn_quarantines_from_another_stream),
      cmocka_unit_test(test_stream_fn_retires_a_lease_behind_it),
      cmocka_unit_test(test_stream_fn_fills_its_own_ring),
      cmocka_unit_test(test_stream_fn_synchronizes_another_stream),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
