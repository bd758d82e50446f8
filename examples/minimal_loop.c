/*
 * minimal_loop.c - the smallest complete decode loop over libactivekv, on
 * the host backend (no GPU needed), every status checked.
 *
 * Two contexts, four dense layers, bf16 rows of 2 KV heads x 16 dims. Each
 * step stages every layer's history, runs a CPU attention over it through
 * the attention hook (on the engine's compute queue), writes the step's new
 * K/V rows back to the host pool and retires the layer two behind. At the
 * end it reads the host pool back and checks that every row written during
 * decode landed where it belongs.
 *
 * On CUDA the same loop launches GPU kernels on a cudaStream_t in the hook
 * (see examples/activekv.c); this one reads the staged rows on the host, so
 * it asks for the host backend.
 *
 * Build: cc minimal_loop.c $(pkg-config --cflags --libs activekv)
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <akv.h>
#include <akv_attention.h>

#define LAYERS 4
#define CTX 2
#define KV_HEADS 2
#define HEAD_DIM 16
#define Q_HEADS 4
#define ROW (KV_HEADS * HEAD_DIM) /* bf16 values per K (or V) row */
#define PREFILL 300
#define STEPS 8

/* A deterministic bf16 value for (context, layer, K/V, token, index). */
static uint16_t value(uint32_t c, uint32_t l, uint32_t kv, uint32_t t, uint32_t j) {
  uint32_t h = c * 0x9E3779B1u ^ l * 0x85EBCA77u ^ kv * 0xC2B2AE3Du ^ t * 0x27D4EB2Fu ^ j;
  h ^= h >> 15;
  h *= 0x2C1B3C6Du;
  h ^= h >> 12;
  return (uint16_t)(0x3C00u | (h & 0x00FFu) | ((h >> 8) & 0x8000u)); /* +-[2^-7, 2^-6) */
}

static void fill_row(uint16_t *row, uint32_t c, uint32_t l, uint32_t kv, uint32_t t) {
  for (uint32_t j = 0; j < ROW; ++j) row[j] = value(c, l, kv, t, j);
}

/* One layer's attention job: what the hook hands to the compute queue. */
typedef struct job {
  akv_view view;
  uint32_t len1[CTX]; /* rows attended: history + the new row */
  uint16_t q[CTX][Q_HEADS][HEAD_DIM];
  float out[CTX][Q_HEADS][HEAD_DIM];
  void *workspace;
  size_t workspace_bytes;
  int failed;
} job;

typedef struct app {
  akv_engine *engine;
  job jobs[LAYERS]; /* one per layer: consecutive layers overlap */
  uint32_t step;
} app;

/* Runs on the compute queue: write the new rows, then attend. */
static void run_attention(void *arg) {
  job *j = arg;
  const akv_view *v = &j->view;
  for (uint32_t i = 0; i < v->n_contexts; ++i) {
    uint8_t *k = (uint8_t *)v->base + i * v->context_stride + (uint64_t)v->len[i] * v->row_stride;
    fill_row((uint16_t *)k, i, v->layer, 0, v->len[i]);
    fill_row((uint16_t *)(k + v->v_offset), i, v->layer, 1, v->len[i]);
    j->len1[i] = v->len[i] + 1;
  }
  akv_attention_args a;
  memset(&a, 0, sizeof a);
  a.chunk_tokens = 64;
  if (akv_attention_args_from_view(v, &a) != AKV_OK) {
    j->failed = 1;
    return;
  }
  a.n_heads = Q_HEADS;
  a.scale = 1.0f / sqrtf((float)HEAD_DIM);
  a.q = j->q;
  a.len = j->len1;
  a.out = &j->out[0][0][0];
  a.workspace = j->workspace;
  a.workspace_bytes = j->workspace_bytes;
  if (akv_attention_ref_bf16(&a) != AKV_OK) j->failed = 1;
}

/* The akv_attention_fn: copy what the queue needs, enqueue the work. */
static int hook(void *user, const akv_view *view, akv_stream stream) {
  app *a = user;
  job *j = &a->jobs[view->layer];
  j->view = *view;
  j->failed = 0;
  for (uint32_t i = 0; i < view->n_contexts; ++i)
    for (uint32_t h = 0; h < Q_HEADS; ++h)
      for (uint32_t d = 0; d < HEAD_DIM; ++d) j->q[i][h][d] = value(i, view->layer, 2, a->step, d);
  return akv_stream_launch_host(a->engine, stream, run_attention, j) == AKV_OK ? 0 : 1;
}

#define CHECK(call)                                                                    \
  do {                                                                                 \
    akv_status st_ = (call);                                                           \
    if (st_ != AKV_OK) {                                                               \
      fprintf(stderr, "minimal_loop: %s: %s (%s)\n", #call, akv_status_string(st_),    \
              engine ? akv_engine_last_error(engine) : "no engine");                   \
      return 1;                                                                        \
    }                                                                                  \
  } while (0)

int main(void) {
  static app a;
  static uint16_t k[LAYERS][PREFILL][ROW], v[LAYERS][PREFILL][ROW];
  const void *kp[LAYERS], *vp[LAYERS];
  akv_engine *engine = NULL;
  akv_context *ctx[CTX];
  akv_stream stream;

  akv_engine_config cfg = AKV_ENGINE_CONFIG_INIT;
  cfg.backend = AKV_BACKEND_HOST; /* the hook reads the staged rows on the CPU */
  cfg.n_dense_layers = LAYERS;
  cfg.kv_heads = KV_HEADS;
  cfg.head_dim = HEAD_DIM;
  cfg.max_tokens = PREFILL + STEPS;
  cfg.page_tokens = 64;
  cfg.max_contexts = CTX;
  cfg.host_pool_gib = 1;
  cfg.route = AKV_ROUTE_PAGED; /* retained pages are read in place */
  cfg.device_pool_gib = 1;
  CHECK(akv_engine_create(&cfg, &engine)); /* logs the host fit line at info level */
  a.engine = engine;
  CHECK(akv_stream_create(engine, &stream));
  for (int l = 0; l < LAYERS; ++l) {
    CHECK(akv_attention_workspace_bytes(CTX, Q_HEADS, HEAD_DIM, cfg.max_tokens, 64,
                                        &a.jobs[l].workspace_bytes));
    a.jobs[l].workspace = malloc(a.jobs[l].workspace_bytes ? a.jobs[l].workspace_bytes : 1);
    if (a.jobs[l].workspace == NULL) return 1;
    kp[l] = k[l];
    vp[l] = v[l];
  }

  /* Prefill: each context's history, every layer at once. */
  for (uint32_t c = 0; c < CTX; ++c) {
    CHECK(akv_context_open(engine, NULL, &ctx[c]));
    for (uint32_t l = 0; l < LAYERS; ++l)
      for (uint32_t t = 0; t < PREFILL; ++t) {
        fill_row(k[l][t], c, l, 0, t);
        fill_row(v[l][t], c, l, 1, t);
      }
    CHECK(akv_context_append(ctx[c], PREFILL, kp, vp));
  }

  /* Decode: one lease per layer, the layer two behind retired in the loop. */
  for (a.step = 0; a.step < STEPS; ++a.step) {
    akv_lease *lease[LAYERS];
    akv_fence attn, tail;
    CHECK(akv_step_begin(engine, ctx, CTX)); /* residency changes here only */
    for (uint32_t l = 0; l < LAYERS; ++l) {
      CHECK(akv_lease_begin(engine, l, &lease[l]));
      if (l >= 2) CHECK(akv_lease_retire(lease[l - 2], NULL));
      CHECK(akv_lease_attend(lease[l], stream, hook, &a, &attn));
      CHECK(akv_lease_write_back(lease[l], NULL, 0, &tail)); /* the new rows, to the host */
      CHECK(akv_lease_seal(lease[l], tail, attn));
    }
    CHECK(akv_lease_retire(lease[LAYERS - 2], NULL));
    CHECK(akv_lease_retire(lease[LAYERS - 1], NULL));
    CHECK(akv_step_end(engine)); /* every context grew by one row */
    for (uint32_t l = 0; l < LAYERS; ++l)
      if (a.jobs[l].failed) {
        fprintf(stderr, "minimal_loop: attention of layer %u failed\n", l);
        return 1;
      }
  }

  /* The rows written during decode are in the authoritative host pool. */
  int bad = 0;
  for (uint32_t c = 0; c < CTX; ++c) {
    uint32_t len = 0;
    CHECK(akv_context_length(ctx[c], &len));
    bad |= len != PREFILL + STEPS;
    for (uint32_t l = 0; l < LAYERS; ++l) {
      uint16_t got_k[STEPS][ROW], got_v[STEPS][ROW], want[ROW];
      CHECK(akv_context_read(ctx[c], l, PREFILL, STEPS, got_k, got_v));
      for (uint32_t t = 0; t < STEPS; ++t) {
        fill_row(want, c, l, 0, PREFILL + t);
        bad |= memcmp(got_k[t], want, sizeof want) != 0;
        fill_row(want, c, l, 1, PREFILL + t);
        bad |= memcmp(got_v[t], want, sizeof want) != 0;
      }
    }
  }
  akv_engine_info info;
  CHECK(akv_engine_info_get(engine, &info));
  printf("minimal_loop: %u steps x %u layers x %u contexts on the %s backend; %llu B staged, "
         "%llu B read in place, %llu B written back; out[0][0][0] = %.6f; host rows %s\n",
         STEPS, LAYERS, CTX, info.backend == AKV_BACKEND_HOST ? "host" : "cuda",
         (unsigned long long)info.bytes_h2d, (unsigned long long)info.bytes_in_place,
         (unsigned long long)info.bytes_d2h, a.jobs[0].out[0][0][0], bad ? "WRONG" : "exact");

  for (uint32_t c = 0; c < CTX; ++c) CHECK(akv_context_close(ctx[c]));
  CHECK(akv_stream_destroy(engine, stream));
  CHECK(akv_engine_destroy(engine));
  for (int l = 0; l < LAYERS; ++l) free(a.jobs[l].workspace);
  return bad ? 1 : 0;
}
