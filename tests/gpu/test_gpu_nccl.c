/*
 * test_gpu_nccl.c - tensor parallel groups on NCCL, one process driving every
 * visible GPU (one thread per rank, communicators from ncclCommInitAll).
 *
 *  - every rank's engine (CUDA backend, its KV-head shard on its own GPU)
 *    agrees its opens and step boundaries through NCCL and ends each step
 *    with the same plan digest as every other rank, although the ranks were
 *    configured with different pools and targets;
 *  - with two GPUs or more: a rank that never arrives makes the others time
 *    out within the timeout, abort the communicator and quarantine.
 * Runs with one GPU too (a group of one through NCCL). Exits 77 (skipped)
 * without a GPU. NCCL_NVLS_ENABLE=0 is set before NCCL starts.
 */
#define _POSIX_C_SOURCE 200809L
#include <cuda_runtime.h>
#include <nccl.h>
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
#include "akv_cuda.h"
#include "akv_group.h"
#include "akv_nccl.h"
#include "plan.h"

#define MAX_RANKS 8
#define STEPS 6
#define LAYERS 4
#define KV_HEADS_TOTAL 8
#define HEAD_DIM 128
#define PAGE_TOKENS 256

static int g_ranks;

typedef struct rank_run {
  int rank;
  ncclComm_t comm;
  int missing; /* this rank does not come to the second step */
  uint32_t timeout_ms;
  akv_status create, opens[3], steps[STEPS];
  uint64_t digests[STEPS];
  uint32_t n_steps;
  akv_status last, after, destroy;
  double last_wait_s;
  int device_moved; /* a group call changed the thread's current device */
  akv_group_info info;
  akv_engine_info einfo;
  char error[256];
} rank_run;

static void quiet(void *user, akv_log_level level, const char *message) {
  (void)user;
  if (level <= AKV_LOG_WARN) fprintf(stderr, "  log: %s\n", message);
  (void)message;
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int noop_hook(void *user, const akv_view *view, akv_stream stream) {
  (void)user;
  (void)view;
  (void)stream;
  return 0;
}

static void *rank_main(void *arg) {
  rank_run *r = arg;
  akv_engine_config ec = AKV_ENGINE_CONFIG_INIT;
  akv_group_config gc = AKV_GROUP_CONFIG_INIT;
  akv_group *g = NULL;
  akv_engine *e = NULL;
  akv_context *ctx[3];
  cudaStream_t stream;
  /* The longest append below (1200 rows) of the widest shard (one rank: every
   * KV head), read as one block per layer. */
  static const uint16_t zeros[1200 * KV_HEADS_TOTAL * HEAD_DIM];
  const void *rows[LAYERS];

  cudaSetDevice(r->rank);
  cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  /* The thread drives its rank's group with another GPU current (where there
   * is one), as a runtime whose own work is on another device would: no
   * group or engine call may change it. */
  const int other = (r->rank + 1) % g_ranks;
  int cur = -1;
  cudaSetDevice(other);
#define AKV_DEVICE_KEPT() \
  (void)(cudaGetDevice(&cur) == cudaSuccess && cur == other ? 0 : (r->device_moved = 1))
  ec.backend = AKV_BACKEND_CUDA;
  ec.device_ordinal = r->rank;
  ec.n_dense_layers = LAYERS;
  ec.kv_heads = KV_HEADS_TOTAL / (uint32_t)g_ranks; /* this rank's shard */
  ec.head_dim = HEAD_DIM;
  ec.max_tokens = 4096;
  ec.page_tokens = PAGE_TOKENS;
  ec.host_pool_gib = 1;
  ec.device_pool_gib = 1 + (uint32_t)r->rank; /* different on purpose: MIN is used */
  ec.max_contexts = 4 + (uint32_t)r->rank;
  ec.route = AKV_ROUTE_ARENA;
  ec.log_fn = quiet;
  gc.rank = (uint32_t)r->rank;
  gc.size = (uint32_t)g_ranks;
  gc.timeout_ms = r->timeout_ms;
  gc.digest = AKV_GROUP_DIGEST_ON;
  r->create = akv_nccl_group_create(&ec, &gc, r->comm, &g);
  AKV_DEVICE_KEPT();
  if (r->create != AKV_OK) {
    snprintf(r->error, sizeof(r->error), "create: %s", akv_status_string(r->create));
    return NULL;
  }
  akv_group_engine(g, &e);
  for (int i = 0; i < 3; i++) {
    akv_context_config cc = AKV_CONTEXT_CONFIG_INIT;
    cc.target_pages = 2 + (uint32_t)r->rank; /* MIN: 2 */
    cc.burst_pages = 1;
    r->opens[i] = akv_group_context_open(g, &cc, &ctx[i]);
    if (r->opens[i] != AKV_OK) goto out;
  }
  for (int l = 0; l < LAYERS; l++) rows[l] = zeros;
  for (int i = 0; i < 3; i++) {
    akv_status ap = akv_context_append(ctx[i], 600 + 300 * (uint32_t)i, rows, rows);
    if (ap != AKV_OK) {
      snprintf(r->error, sizeof(r->error), "append: %s", akv_status_string(ap));
      r->last = ap;
      goto out;
    }
  }
  for (int s = 0; s < STEPS; s++) {
    double t0;
    if (r->missing && s == 1) break; /* never arrives at the second boundary */
    t0 = now_s();
    r->steps[s] = akv_group_step_begin(g, ctx, 3);
    r->last_wait_s = now_s() - t0;
    AKV_DEVICE_KEPT();
    r->digests[s] = akv_engine_plan_digest(e);
    r->n_steps++;
    r->last = r->steps[s];
    if (r->steps[s] != AKV_OK) break;
    for (uint32_t l = 0; l < LAYERS; l++) {
      akv_lease *ls;
      akv_fence attn, tail;
      if (akv_lease_begin(e, l, &ls) != AKV_OK ||
          akv_lease_attend(ls, akv_stream_from_cuda(stream), noop_hook, NULL, &attn) != AKV_OK ||
          akv_lease_write_back(ls, NULL, 0, &tail) != AKV_OK || akv_lease_seal(ls, tail, attn) != AKV_OK ||
          akv_lease_retire(ls, NULL) != AKV_OK)
        break;
    }
    akv_step_end(e);
    AKV_DEVICE_KEPT();
  }
out:
  if (!r->missing) r->after = akv_group_check(g);
  akv_group_info_get(g, &r->info);
  akv_engine_info_get(e, &r->einfo);
  snprintf(r->error, sizeof(r->error), "%s", akv_group_last_error(g));
  if (!r->info.stopped && !r->missing)
    for (int i = 0; i < 3; i++) akv_group_context_close(g, ctx[i]);
  if (r->missing) akv_engine_quarantine(e, NULL); /* contexts still open: drop them all */
  r->destroy = akv_group_destroy(g);
  AKV_DEVICE_KEPT();
#undef AKV_DEVICE_KEPT
  cudaStreamDestroy(stream);
  return NULL;
}

static void run(rank_run *runs, int missing_rank, uint32_t timeout_ms) {
  ncclComm_t comms[MAX_RANKS];
  int devs[MAX_RANKS];
  pthread_t th[MAX_RANKS];
  for (int i = 0; i < g_ranks; i++) devs[i] = i;
  assert_int_equal(ncclCommInitAll(comms, g_ranks, devs), ncclSuccess);
  for (int i = 0; i < g_ranks; i++) {
    memset(&runs[i], 0, sizeof(runs[i]));
    runs[i].rank = i;
    runs[i].comm = comms[i];
    runs[i].missing = i == missing_rank;
    runs[i].timeout_ms = timeout_ms;
    assert_int_equal(pthread_create(&th[i], NULL, rank_main, &runs[i]), 0);
  }
  for (int i = 0; i < g_ranks; i++) pthread_join(th[i], NULL);
  for (int i = 0; i < g_ranks; i++) {
    printf("  rank %d: create %s, %u steps, last %s, %s\n", i, akv_status_string(runs[i].create),
           runs[i].n_steps, akv_status_string(runs[i].last), runs[i].error);
    /* A communicator the group aborted is gone; the others are ours. */
    if (!runs[i].info.stopped && runs[i].create == AKV_OK) ncclCommDestroy(comms[i]);
  }
}

static void test_agreed_plans(void **state) {
  (void)state;
  rank_run runs[MAX_RANKS];
  run(runs, -1, 60000);
  for (int i = 0; i < g_ranks; i++) {
    assert_int_equal(runs[i].create, AKV_OK);
    for (int c = 0; c < 3; c++) assert_int_equal(runs[i].opens[c], AKV_OK);
    assert_int_equal(runs[i].n_steps, STEPS);
    for (int s = 0; s < STEPS; s++) {
      assert_int_equal(runs[i].steps[s], AKV_OK);
      assert_int_equal(runs[i].digests[s], runs[0].digests[s]);
    }
    assert_int_equal(runs[i].after, AKV_OK);
    assert_int_equal(runs[i].info.device_pool_gib, 1);
    assert_int_equal(runs[i].info.max_contexts, 4);
    assert_false(runs[i].info.stopped);
    assert_int_equal(runs[i].destroy, AKV_OK);
    assert_int_equal(runs[i].device_moved, 0);
  }
  printf("  %d rank(s) through NCCL: %d steps, identical plan digests (last %016llx)\n", g_ranks,
         STEPS, (unsigned long long)runs[0].digests[STEPS - 1]);
}

static void test_missing_rank(void **state) {
  (void)state;
  rank_run runs[MAX_RANKS];
  if (g_ranks < 2) {
    printf("  SKIPPED: a missing rank needs two GPUs (%d visible)\n", g_ranks);
    skip();
  }
  run(runs, g_ranks - 1, 2000);
  for (int i = 0; i < g_ranks - 1; i++) {
    assert_int_equal(runs[i].create, AKV_OK);
    assert_int_equal(runs[i].last, AKV_ERR_TIMEOUT);
    assert_int_equal(runs[i].info.reason, AKV_GROUP_TIMEOUT);
    assert_true(runs[i].einfo.quarantined);
    assert_true(runs[i].last_wait_s >= 1.9 && runs[i].last_wait_s < 10.0);
    assert_int_equal(runs[i].after, AKV_ERR_QUARANTINED);
    assert_int_equal(runs[i].destroy, AKV_OK);
  }
}

int main(void) {
  int n = 0;
  setenv("NCCL_NVLS_ENABLE", "0", 1);
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    printf("no CUDA device: skipped\n");
    return 77;
  }
  g_ranks = n > MAX_RANKS ? MAX_RANKS : n;
  while (KV_HEADS_TOTAL % g_ranks != 0) g_ranks--;
  printf("test_gpu_nccl: %d GPU(s), %d rank(s), NCCL %d\n", n, g_ranks, NCCL_VERSION_CODE);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_agreed_plans),
      cmocka_unit_test(test_missing_rank),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
