/*
 * host_cost.c - the library's own host cost per layer per step: a null
 * attention hook over a tiny history, so what is timed is the engine's work
 * on the calling thread (begin, attend, write-back, seal, retire) plus the
 * backend's enqueue cost. Prints one JSON line.
 *
 * usage: akv_host_cost [backend: auto|host|cuda] [steps]
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
  static unsigned char rows[16 * 2048];
  const void *rp[32];
  double *per_step = calloc(steps, sizeof(double));
  cfg.backend = AKV_BACKEND_AUTO;
  if (argc > 1 && strcmp(argv[1], "host") == 0) cfg.backend = AKV_BACKEND_HOST;
  if (argc > 1 && strcmp(argv[1], "cuda") == 0) cfg.backend = AKV_BACKEND_CUDA;
  cfg.n_dense_layers = layers;
  cfg.kv_heads = 8;
  cfg.head_dim = 128;
  cfg.max_tokens = steps + 64;
  cfg.page_tokens = 256;
  cfg.max_contexts = n_ctx;
  cfg.host_pool_gib = 4;
  cfg.log_level = AKV_LOG_WARN;
  TRY(akv_engine_create(&cfg, &e));
  TRY(akv_engine_info_get(e, &info));
  TRY(akv_stream_create(e, &s));
  for (uint32_t l = 0; l < layers; l++) rp[l] = rows;
  for (uint32_t i = 0; i < n_ctx; i++) {
    TRY(akv_context_open(e, NULL, &ctx[i]));
    TRY(akv_context_append(ctx[i], 16, rp, rp));
  }
  for (uint32_t st = 0; st < steps; st++) {
    akv_lease *lease[32];
    double t0 = now_s();
    TRY(akv_step_begin(e, ctx, n_ctx));
    for (uint32_t l = 0; l < layers; l++) {
      akv_fence attn, tail;
      TRY(akv_lease_begin(e, l, &lease[l]));
      if (l >= 2) TRY(akv_lease_retire(lease[l - 2], NULL));
      TRY(akv_lease_attend(lease[l], s, null_hook, NULL, &attn));
      TRY(akv_lease_write_back(lease[l], NULL, 0, &tail));
      TRY(akv_lease_seal(lease[l], tail, attn));
    }
    TRY(akv_lease_retire(lease[layers - 2], NULL));
    TRY(akv_lease_retire(lease[layers - 1], NULL));
    TRY(akv_step_end(e));
    per_step[st] = now_s() - t0;
  }
  qsort(per_step, steps, sizeof(double), cmp_double);
  {
    double med = per_step[steps / 2] / layers * 1e6;
    double p90 = per_step[steps * 9 / 10] / layers * 1e6;
    printf("host cost per layer per step: median %.2f us, p90 %.2f us (target 10 us) over %u steps"
           " x %u layers, %u contexts, backend %s; ratio target/median %.2f\n",
           med, p90, steps, layers, n_ctx, info.backend == AKV_BACKEND_CUDA ? "cuda" : "host",
           10.0 / med);
    printf("{\"bench\":\"host_cost\",\"backend\":\"%s\",\"layers\":%u,\"contexts\":%u,\"steps\":%u,"
           "\"us_per_layer_median\":%.3f,\"us_per_layer_p90\":%.3f,\"target_us\":10}\n",
           info.backend == AKV_BACKEND_CUDA ? "cuda" : "host", layers, n_ctx, steps, med, p90);
  }
  for (uint32_t i = 0; i < n_ctx; i++) TRY(akv_context_close(ctx[i]));
  TRY(akv_stream_destroy(e, s));
  TRY(akv_engine_destroy(e));
  free(per_step);
  return 0;
}
