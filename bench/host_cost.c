/*
 * host_cost.c - the library's own host cost per layer per step: a null
 * attention hook over a tiny history, in the recommended loop (begin l,
 * retire l-2, attend, write back, seal). Figures per layer:
 *  - enqueue: the calling thread's time in begin + attend + write-back + seal
 *    (the engine's bookkeeping plus the backend's enqueue calls); this is the
 *    library's host cost on the hot path, target < 10 us;
 *  - retire: the calling thread's time in the retire calls inside the layer
 *    loop. Mode `retire`: akv_lease_retire of layer l-2, which blocks until
 *    the device finished that layer's copy/attention/write-back chain.
 *    Mode `try` (default): akv_lease_try_retire of every earlier layer up to
 *    l-2, oldest first, stopping at the first not ready; never blocks. The
 *    leases it leaves are retired (blocking) after the last layer;
 *  - host: enqueue + retire, the thread's time per layer in the loop;
 *  - drain: the blocking retires after the last layer, per layer;
 *  - wall: the whole step, per layer.
 * Prints a line per figure and one JSON line.
 *
 * With a history (argv 4, rows per context before the first step; default
 * 16) and a device pool (argv 5, GiB; default 0: route stage), the same loop
 * runs at a real geometry: the begin then plans every retained page and the
 * arena gathers them, so the figures include the library's per-page work.
 * The begin and write-back calls are also timed alone (begin_us,
 * write_back_us per layer).
 *
 * With argv 6 (MiB, default 0) the loop walks a buffer of that size before
 * each begin and each write-back, outside every timed region: the CPU caches
 * then hold little of the engine's or the driver's state when the calls run,
 * as in a process whose model code runs between them (the transformers
 * adapter), so the figures show what that costs the library's calls.
 *
 * usage: akv_host_cost [backend: auto|host|cuda] [steps] [mode: try|retire]
 *                      [history rows] [device pool GiB] [thrash MiB]
 */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "akv.h"

static int null_hook(void *user, const akv_view *view, akv_stream stream) {
  (void)user;
  (void)view;
  (void)stream;
  return 0;
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

#define TRY(call)                                                          \
  do {                                                                     \
    akv_status s_ = (call);                                                \
    if (s_ != AKV_OK) {                                                    \
      fprintf(stderr, "%s: %s (%s)\n", #call, akv_status_string(s_),       \
              e ? akv_engine_last_error(e) : "");                          \
      return 1;                                                            \
    }                                                                      \
  } while (0)

int main(int argc, char **argv) {
  const uint32_t layers = 32, n_ctx = 4;
  uint32_t steps = argc > 2 ? (uint32_t)atoi(argv[2]) : 2000;
  akv_engine_config cfg = AKV_ENGINE_CONFIG_INIT;
  akv_engine *e = NULL;
  akv_stream s = NULL;
  akv_context *ctx[4];
  akv_engine_info info;
  static unsigned char rows[16 * 4096]; /* 16 rows of K (or V) of 8 x 128 bf16 */
  const void *rp[32];
  const uint32_t history = argc > 4 ? (uint32_t)atoi(argv[4]) : 16;
  const uint32_t pool_gib = argc > 5 ? (uint32_t)atoi(argv[5]) : 0;
  const size_t thrash_bytes = (size_t)(argc > 6 ? (uint32_t)atoi(argv[6]) : 0) << 20;
  volatile unsigned char *thrash = thrash_bytes ? calloc(thrash_bytes, 1) : NULL;
  double *begin_step = calloc(steps, sizeof(double));
  double *wb_step = calloc(steps, sizeof(double));
  const int try_mode = !(argc > 3 && strcmp(argv[3], "retire") == 0);
  double *per_step = calloc(steps, sizeof(double));
  double *enq_step = calloc(steps, sizeof(double));
  double *ret_step = calloc(steps, sizeof(double));
  double *host_step = calloc(steps, sizeof(double));
  double *drain_step = calloc(steps, sizeof(double));
  cfg.backend = AKV_BACKEND_AUTO;
  if (argc > 1 && strcmp(argv[1], "host") == 0) cfg.backend = AKV_BACKEND_HOST;
  if (argc > 1 && strcmp(argv[1], "cuda") == 0) cfg.backend = AKV_BACKEND_CUDA;
  cfg.n_dense_layers = layers;
  cfg.kv_heads = 8;
  cfg.head_dim = 128;
  cfg.max_tokens = history + steps + 64;
  cfg.page_tokens = 256;
  cfg.max_contexts = n_ctx;
  /* K and V rows of 2 KiB each per layer and token: the pool holds them all. */
  cfg.host_pool_gib =
      (uint32_t)(((uint64_t)cfg.max_tokens * layers * n_ctx * 4096u >> 30) + 4u);
  if (pool_gib > 0) {
    cfg.route = AKV_ROUTE_ARENA;
    cfg.device_pool_gib = pool_gib;
  }
  cfg.log_level = AKV_LOG_WARN;
  TRY(akv_engine_create(&cfg, &e));
  TRY(akv_engine_info_get(e, &info));
  TRY(akv_stream_create(e, &s));
  for (uint32_t l = 0; l < layers; l++) rp[l] = rows;
  for (uint32_t i = 0; i < n_ctx; i++) {
    TRY(akv_context_open(e, NULL, &ctx[i]));
    for (uint32_t r = 0; r < history; r += 16)
      TRY(akv_context_append(ctx[i], history - r < 16 ? history - r : 16, rp, rp));
  }
  for (uint32_t st = 0; st < steps; st++) {
    akv_lease *lease[32];
    uint32_t retired = 0; /* leases [0, retired) are retired */
    double t0 = now_s(), enq = 0.0, ret = 0.0, d0, bg = 0.0, wb = 0.0;
    TRY(akv_step_begin(e, ctx, n_ctx));
    for (uint32_t l = 0; l < layers; l++) {
      akv_fence attn, tail;
      double a, b;
      for (size_t k = 0; thrash != NULL && k < thrash_bytes; k += 64) thrash[k]++; /* volatile: every line is touched */
      a = now_s();
      TRY(akv_lease_begin(e, l, &lease[l]));
      b = now_s();
      bg += b - a;
      if (l >= 2 && !try_mode) {
        TRY(akv_lease_retire(lease[l - 2], NULL));
        retired = l - 1;
      }
      while (try_mode && l >= 2 && retired <= l - 2) {
        akv_status s_ = akv_lease_try_retire(lease[retired], NULL);
        if (s_ == AKV_ERR_NOT_READY) break;
        TRY(s_);
        retired++;
      }
      ret += now_s() - b;
      a += now_s() - b; /* the retire is not enqueue work */
      TRY(akv_lease_attend(lease[l], s, null_hook, NULL, &attn));
      {
        double w = now_s();
        if (thrash != NULL) {
          for (size_t k = 0; k < thrash_bytes; k += 64) thrash[k]++; /* volatile: every line is touched */
          a += now_s() - w; /* the walk is not enqueue work */
          w = now_s();
        }
        TRY(akv_lease_write_back(lease[l], NULL, 0, &tail));
        wb += now_s() - w;
      }
      TRY(akv_lease_seal(lease[l], tail, attn));
      enq += now_s() - a;
    }
    d0 = now_s();
    for (; retired < layers; retired++) TRY(akv_lease_retire(lease[retired], NULL));
    drain_step[st] = now_s() - d0;
    TRY(akv_step_end(e));
    per_step[st] = now_s() - t0;
    enq_step[st] = enq;
    ret_step[st] = ret;
    host_step[st] = enq + ret;
    begin_step[st] = bg;
    wb_step[st] = wb;
  }
  qsort(begin_step, steps, sizeof(double), cmp_double);
  qsort(wb_step, steps, sizeof(double), cmp_double);
  qsort(per_step, steps, sizeof(double), cmp_double);
  qsort(enq_step, steps, sizeof(double), cmp_double);
  qsort(ret_step, steps, sizeof(double), cmp_double);
  qsort(host_step, steps, sizeof(double), cmp_double);
  qsort(drain_step, steps, sizeof(double), cmp_double);
  {
    const char *bk = info.backend == AKV_BACKEND_CUDA ? "cuda" : "host";
    const char *mode = try_mode ? "try" : "retire";
    double med = enq_step[steps / 2] / layers * 1e6, p90 = enq_step[steps * 9 / 10] / layers * 1e6;
    double rmed = ret_step[steps / 2] / layers * 1e6, rp90 = ret_step[steps * 9 / 10] / layers * 1e6;
    double hmed = host_step[steps / 2] / layers * 1e6, hp90 = host_step[steps * 9 / 10] / layers * 1e6;
    double dmed = drain_step[steps / 2] / layers * 1e6;
    double wall = per_step[steps / 2] / layers * 1e6;
    double bmed = begin_step[steps / 2] / layers * 1e6, wmed = wb_step[steps / 2] / layers * 1e6;
    printf("host cost per layer per step (enqueue path): median %.2f us, p90 %.2f us; bound 10 us;"
           " ratio median/bound %.2f (%u steps x %u layers, %u contexts, backend %s)\n",
           med, p90, med / 10.0, steps, layers, n_ctx, bk);
    printf("retire calls in the layer loop (mode %s): median %.2f us, p90 %.2f us per layer\n",
           mode, rmed, rp90);
    printf("host time per layer in the loop (enqueue + retire): median %.2f us, p90 %.2f us\n",
           hmed, hp90);
    printf("blocking retires after the last layer: median %.2f us per layer\n", dmed);
    printf("wall per layer including retire waits on the device chain: median %.2f us\n", wall);
    printf("of the enqueue path: akv_lease_begin median %.2f us, akv_lease_write_back %.2f us per "
           "layer (history %u rows per context, device pool %u GiB, route %s)\n",
           bmed, wmed, history, pool_gib, pool_gib > 0 ? "arena" : "stage");
    printf("{\"bench\":\"host_cost\",\"backend\":\"%s\",\"mode\":\"%s\",\"layers\":%u,"
           "\"contexts\":%u,\"steps\":%u,"
           "\"enqueue_us_per_layer_median\":%.3f,\"enqueue_us_per_layer_p90\":%.3f,"
           "\"retire_us_per_layer_median\":%.3f,\"retire_us_per_layer_p90\":%.3f,"
           "\"host_us_per_layer_median\":%.3f,\"host_us_per_layer_p90\":%.3f,"
           "\"drain_us_per_layer_median\":%.3f,"
           "\"wall_us_per_layer_median\":%.3f,\"bound_us\":10,"
           "\"begin_us_per_layer_median\":%.3f,\"write_back_us_per_layer_median\":%.3f,"
           "\"history\":%u,\"device_pool_gib\":%u,\"thrash_mib\":%u}\n",
           bk, mode, layers, n_ctx, steps, med, p90, rmed, rp90, hmed, hp90, dmed, wall, bmed,
           wmed, history, pool_gib, (unsigned)(thrash_bytes >> 20));
  }
  for (uint32_t i = 0; i < n_ctx; i++) TRY(akv_context_close(ctx[i]));
  TRY(akv_stream_destroy(e, s));
  TRY(akv_engine_destroy(e));
  free(per_step);
  free(enq_step);
  free(ret_step);
  free(host_step);
  free(drain_step);
  free(begin_step);
  free(wb_step);
  free((void *)thrash);
  return 0;
}
