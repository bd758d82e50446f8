/*
 * testutil.c - see testutil.h.
 */
#ifndef _POSIX_C_SOURCE
#define _POSIX_C_SOURCE 200809L
#endif
#include "testutil.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>

static uint64_t akvt_mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

static float akvt_unit(uint64_t h) { return (float)((h >> 40) & 0xffffff) / 8388608.0f - 1.0f; }

float akvt_bf16_to_f32(uint16_t b) {
  uint32_t u = (uint32_t)b << 16;
  float f;
  memcpy(&f, &u, sizeof(f));
  return f;
}

static uint16_t akvt_f32_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof(u));
  return (uint16_t)(u >> 16);
}

uint16_t akvt_elem(uint32_t ctx, uint32_t layer, uint32_t token, int kv, uint32_t j) {
  uint64_t h = akvt_mix(((uint64_t)ctx << 48) ^ ((uint64_t)layer << 36) ^
                        ((uint64_t)token << 12) ^ ((uint64_t)kv << 11) ^ j);
  return akvt_f32_to_bf16(akvt_unit(h));
}

void akvt_fill_row(uint16_t *row, uint32_t n, uint32_t ctx, uint32_t layer, uint32_t token,
                   int kv) {
  for (uint32_t j = 0; j < n; j++) row[j] = akvt_elem(ctx, layer, token, kv, j);
}

void akvt_attention(const float *q, const uint16_t *k, const uint16_t *v, uint32_t len,
                    uint32_t q_heads, uint32_t kv_heads, uint32_t head_dim, size_t row_elems,
                    float *out) {
  uint32_t group = q_heads / kv_heads;
  float scale = 1.0f / sqrtf((float)head_dim);
  for (uint32_t h = 0; h < q_heads; h++) {
    uint32_t kh = h / group;
    float m = -INFINITY, s = 0.0f;
    float *o = out + (size_t)h * head_dim;
    for (uint32_t d = 0; d < head_dim; d++) o[d] = 0.0f;
    for (uint32_t t = 0; t < len; t++) {
      const uint16_t *kr = k + t * row_elems + (size_t)kh * head_dim;
      const uint16_t *vr = v + t * row_elems + (size_t)kh * head_dim;
      float dot = 0.0f, mn, corr, p;
      for (uint32_t d = 0; d < head_dim; d++) dot += q[(size_t)h * head_dim + d] * akvt_bf16_to_f32(kr[d]);
      dot *= scale;
      mn = dot > m ? dot : m;
      corr = expf(m - mn);
      p = expf(dot - mn);
      s = s * corr + p;
      for (uint32_t d = 0; d < head_dim; d++) o[d] = o[d] * corr + p * akvt_bf16_to_f32(vr[d]);
      m = mn;
    }
    for (uint32_t d = 0; d < head_dim; d++) o[d] /= s;
  }
}

static void akvt_query(float *q, const akvt_cfg *c, uint32_t ctx, uint32_t layer, uint32_t pos) {
  for (uint32_t i = 0; i < c->q_heads * c->head_dim; i++)
    q[i] = akvt_unit(akvt_mix(0x51ull ^ ((uint64_t)ctx << 40) ^ ((uint64_t)layer << 28) ^
                              ((uint64_t)pos << 12) ^ i));
}

void akvt_silent_log(void *user, akv_log_level level, const char *message) {
  (void)user;
  if (getenv("AKVT_VERBOSE") != NULL) fprintf(stderr, "[log %d] %s\n", (int)level, message);
}

akvt_cfg akvt_default_cfg(void) {
  akvt_cfg c;
  memset(&c, 0, sizeof(c));
  c.layers = 3;
  c.kv_heads = 2;
  c.head_dim = 8;
  c.q_heads = 4;
  c.max_tokens = 96;
  c.page_tokens = 8;
  c.n_ctx = 3;
  c.prefill[0] = 1;
  c.prefill[1] = 17;
  c.prefill[2] = 40;
  c.steps = 4;
  c.route = AKV_ROUTE_STAGE;
  c.target_pages = AKV_TARGET_FAIR_SHARE;
  c.fault_kind = -1;
  return c;
}

akv_engine_config akvt_small_config(akv_route route, uint32_t device_pool_gib) {
  akv_engine_config ec = AKV_ENGINE_CONFIG_INIT;
  ec.backend = AKV_BACKEND_HOST;
  ec.n_dense_layers = 3;
  ec.kv_heads = 2;
  ec.head_dim = 8;
  ec.max_tokens = 64;
  ec.page_tokens = 8;
  ec.max_contexts = 4;
  ec.host_pool_gib = 1;
  ec.device_pool_gib = device_pool_gib;
  ec.route = route;
  ec.log_fn = akvt_silent_log;
  return ec;
}

akv_engine *akvt_small_engine(akv_route route, uint32_t device_pool_gib) {
  const akv_engine_config ec = akvt_small_config(route, device_pool_gib);
  akv_engine *e = NULL;
  if (akv_engine_create(&ec, &e) != AKV_OK) return NULL;
  return e;
}

/* ------------------------------------------------------------------ harness */

typedef struct akvt_job {
  const akvt_cfg *cfg;
  akv_view view; /* its arrays stay valid until the lease retires */
  uint32_t n;
  uint32_t len[16];
  uint32_t layer;
  float *out; /* [n_ctx][q_heads*head_dim] of this layer */
} akvt_job;

typedef struct akvt_run_state {
  const akvt_cfg *cfg;
  akv_engine *engine;
  akv_stream stream;
  akvt_job *jobs; /* [layers] */
  float *out;     /* [layers][n_ctx][q_heads*head_dim] */
} akvt_run_state;

/* Runs on the compute queue: writes each context's new row at index len,
 * then attends over len + 1 rows of the staged view. */
static void akvt_job_run(void *arg) {
  akvt_job *j = arg;
  const akvt_cfg *c = j->cfg;
  const uint32_t row_elems = c->kv_heads * c->head_dim;
  const size_t row = (size_t)row_elems * 2;
  float q[1024];
  /* The history gathered row by row through the view (staged rows and, on
   * the paged route, retained pages read in place). */
  uint16_t *k = malloc((size_t)c->max_tokens * row), *v = malloc((size_t)c->max_tokens * row);
  if (k == NULL || v == NULL) abort();
  for (uint32_t i = 0; i < j->n; i++) {
    uint8_t *nk = akvt_view_row(&j->view, i, j->len[i]);
    akvt_fill_row((uint16_t *)nk, row_elems, i, j->layer, j->len[i], 0);
    akvt_fill_row((uint16_t *)(nk + j->view.v_offset), row_elems, i, j->layer, j->len[i], 1);
    for (uint32_t t = 0; t <= j->len[i]; t++) {
      const uint8_t *r = akvt_view_row(&j->view, i, t);
      memcpy((uint8_t *)k + t * row, r, row);
      memcpy((uint8_t *)v + t * row, r + j->view.v_offset, row);
    }
    akvt_query(q, c, i, j->layer, j->len[i]);
    akvt_attention(q, k, v, j->len[i] + 1, c->q_heads, c->kv_heads, c->head_dim, row_elems,
                   j->out + (size_t)i * c->q_heads * c->head_dim);
  }
  free(k);
  free(v);
}

static void akvt_job_prepare(akvt_run_state *rs, const akv_view *view) {
  akvt_job *j = &rs->jobs[view->layer];
  j->cfg = rs->cfg;
  j->view = *view;
  if (rs->cfg->ignore_page_map) j->view.page_map_host = NULL; /* the misuse under test */
  j->n = view->n_contexts;
  j->layer = view->layer;
  for (uint32_t i = 0; i < view->n_contexts; i++) j->len[i] = view->len[i];
  j->out = rs->out + (size_t)view->layer * rs->cfg->n_ctx * rs->cfg->q_heads * rs->cfg->head_dim;
}

static int akvt_hook(void *user, const akv_view *view, akv_stream stream) {
  akvt_run_state *rs = user;
  akvt_job_prepare(rs, view);
  return akv_stream_launch_host(rs->engine, stream, akvt_job_run, &rs->jobs[view->layer]) ==
                 AKV_OK
             ? 0
             : 1;
}

#define AKVT_TRY(call)                   \
  do {                                   \
    akv_status s_ = (call);              \
    if (s_ != AKV_OK) {                  \
      out->status = s_;                  \
      out->failed_call = #call;          \
      goto failed;                       \
    }                                    \
  } while (0)

/* Compares one step's outputs against attention over the recomputed
 * resident history. */
static void akvt_check_step(const akvt_cfg *c, const float *outv, const uint32_t *lens,
                            akvt_result *out) {
  uint32_t row_elems = c->kv_heads * c->head_dim;
  size_t per = (size_t)c->q_heads * c->head_dim;
  uint16_t *k = malloc((size_t)c->max_tokens * row_elems * 2);
  uint16_t *v = malloc((size_t)c->max_tokens * row_elems * 2);
  float *ref = malloc(per * sizeof(float));
  float q[1024];
  for (uint32_t l = 0; l < c->layers; l++) {
    for (uint32_t i = 0; i < c->n_ctx; i++) {
      for (uint32_t t = 0; t <= lens[i]; t++) {
        akvt_fill_row(k + (size_t)t * row_elems, row_elems, i, l, t, 0);
        akvt_fill_row(v + (size_t)t * row_elems, row_elems, i, l, t, 1);
      }
      akvt_query(q, c, i, l, lens[i]);
      akvt_attention(q, k, v, lens[i] + 1, c->q_heads, c->kv_heads, c->head_dim, row_elems, ref);
      out->outputs_compared++;
      if (memcmp(ref, outv + ((size_t)l * c->n_ctx + i) * per, per * sizeof(float)) != 0)
        out->outputs_mismatched++;
    }
  }
  free(k);
  free(v);
  free(ref);
}

/* Compares rows [0, auth_len[i]) of every layer of every context with what
 * was prefilled or written back: exactly the rows the harness knows to be
 * authoritative. A library length other than auth_len[i] counts the missing
 * or extra rows as mismatched; an unreadable context counts all its rows. */
static void akvt_check_rows(const akvt_cfg *c, akv_context *const *ctx, const uint32_t *auth_len,
                            akvt_result *out) {
  uint32_t row_elems = c->kv_heads * c->head_dim;
  uint16_t *k = malloc((size_t)c->max_tokens * row_elems * 2);
  uint16_t *v = malloc((size_t)c->max_tokens * row_elems * 2);
  uint16_t *want = malloc((size_t)row_elems * 2);
  for (uint32_t i = 0; i < c->n_ctx; i++) {
    uint32_t len = 0, want_len = auth_len[i];
    if (ctx[i] == NULL) continue;
    out->rows_expected += (uint64_t)want_len * c->layers * 2;
    if (akv_context_length(ctx[i], &len) != AKV_OK) {
      out->rows_mismatched += (uint64_t)want_len * c->layers * 2;
      continue;
    }
    if (len != want_len) {
      uint32_t diff = len > want_len ? len - want_len : want_len - len;
      out->rows_mismatched += (uint64_t)diff * c->layers * 2;
      if (len > want_len) len = want_len;
    }
    for (uint32_t l = 0; l < c->layers; l++) {
      if (akv_context_read(ctx[i], l, 0, len, k, v) != AKV_OK) {
        out->rows_mismatched += (uint64_t)len * 2;
        continue;
      }
      for (uint32_t t = 0; t < len; t++) {
        for (int kv = 0; kv < 2; kv++) {
          akvt_fill_row(want, row_elems, i, l, t, kv);
          out->rows_checked++;
          if (memcmp(want, (kv ? v : k) + (size_t)t * row_elems, row_elems * 2) != 0)
            out->rows_mismatched++;
        }
      }
    }
  }
  free(k);
  free(v);
  free(want);
}

void akvt_run(const akvt_cfg *c, akvt_result *out) {
  akv_engine_config ec = AKV_ENGINE_CONFIG_INIT;
  akvt_run_state rs;
  akv_context *ctx[16] = {0};
  akv_lease *leases[64] = {0};
  uint32_t lens[16];
  uint32_t auth_len[16] = {0}; /* rows known authoritative, per context */
  uint32_t row_elems = c->kv_heads * c->head_dim;
  size_t out_elems = (size_t)c->layers * c->n_ctx * c->q_heads * c->head_dim;

  memset(out, 0, sizeof(*out));
  out->failed_step = UINT32_MAX;
  memset(&rs, 0, sizeof(rs));
  rs.cfg = c;
  rs.jobs = calloc(c->layers, sizeof(*rs.jobs));
  rs.out = calloc(out_elems, sizeof(float));

  ec.backend = AKV_BACKEND_HOST;
  ec.n_dense_layers = c->layers;
  ec.kv_heads = c->kv_heads;
  ec.head_dim = c->head_dim;
  ec.max_tokens = c->max_tokens;
  ec.page_tokens = c->page_tokens;
  ec.max_contexts = c->n_ctx;
  ec.host_pool_gib = 1;
  ec.device_pool_gib = c->device_pool_gib;
  ec.route = c->route;
  ec.log_fn = c->log_fn != NULL ? c->log_fn : akvt_silent_log;
  ec.log_user = c->log_user;
  ec.host_delay_seed = c->delay_seed;
  ec.host_delay_max_us = c->delay_max_us;
  ec.fault_fail_nth = c->fault_fail_nth;
  ec.fault_kind = c->fault_kind;
  ec.poison_holes = c->poison_holes;
  if (c->headroom_pages > 0) {
    /* Measure the engine's own allocations (headroom on, no free memory),
     * then model a device with room for exactly the pages asked for. */
    akv_engine *probe = NULL;
    akv_engine_info pi;
    const uint32_t chunk = c->headroom_chunk_pages ? c->headroom_chunk_pages : c->headroom_pages;
    const uint32_t slack = c->route == AKV_ROUTE_PAGED ? 1 : 0;
    ec.headroom_gib = 1;
    ec.headroom_chunk_pages = chunk;
    ec.host_fake_free_bytes = 0;
    ec.fault_fail_nth = 0;
    if (akv_engine_create(&ec, &probe) != AKV_OK) {
      out->status = AKV_ERR_CONFIG;
      out->failed_call = "headroom probe";
      goto done;
    }
    akv_engine_info_get(probe, &pi);
    akv_engine_destroy(probe);
    ec.host_fake_free_bytes = pi.device_bytes_allocated +
                              (uint64_t)(c->headroom_pages / chunk) * (chunk + slack) * pi.page_bytes;
    ec.fault_fail_nth = c->fault_fail_nth;
  }
  {
    akv_status s = akv_engine_create(&ec, &rs.engine);
    if (s != AKV_OK) {
      out->status = s;
      out->failed_call = "akv_engine_create";
      goto done;
    }
  }
  akv_headroom_get(rs.engine, &out->headroom_start);
  AKVT_TRY(akv_stream_create(rs.engine, &rs.stream));
  for (uint32_t i = 0; i < c->n_ctx; i++) {
    akv_context_config cc = AKV_CONTEXT_CONFIG_INIT;
    uint32_t n = c->prefill[i];
    const void *kp[64], *vp[64];
    uint16_t *buf = malloc((size_t)c->layers * 2 * (n ? n : 1) * row_elems * 2);
    cc.target_pages = c->target_pages;
    cc.burst_pages = c->burst_pages;
    for (uint32_t l = 0; l < c->layers; l++) {
      uint16_t *kb = buf + ((size_t)l * 2) * (n ? n : 1) * row_elems;
      uint16_t *vb = kb + (size_t)(n ? n : 1) * row_elems;
      for (uint32_t t = 0; t < n; t++) {
        akvt_fill_row(kb + (size_t)t * row_elems, row_elems, i, l, t, 0);
        akvt_fill_row(vb + (size_t)t * row_elems, row_elems, i, l, t, 1);
      }
      kp[l] = kb;
      vp[l] = vb;
    }
    {
      akv_status s = akv_context_open(rs.engine, &cc, &ctx[i]);
      if (s == AKV_OK) s = akv_context_append(ctx[i], n, kp, vp);
      free(buf);
      if (s != AKV_OK) {
        out->status = s;
        out->failed_call = "akv_context_open/append";
        goto failed;
      }
      auth_len[i] = n;
    }
  }

  for (uint32_t s = 0; s < c->steps; s++) {
    out->failed_step = s; /* reset to UINT32_MAX below when the run ends cleanly */
    for (uint32_t i = 0; i < c->n_ctx; i++) AKVT_TRY(akv_context_length(ctx[i], &lens[i]));
    if (c->take_step == s + 1) {
      out->take_status = akv_headroom_take(rs.engine, UINT64_MAX, &out->taken);
      AKVT_TRY(out->take_status);
    }
    if (c->release_step == s + 1 && !c->release_mid_step) {
      out->release_status = akv_headroom_release(rs.engine, c->release_bytes,
                                                 &out->released_now, &out->released_pending);
      AKVT_TRY(out->release_status);
    }
    uint32_t retired = 0; /* leases [0, retired) of this step are retired */
    AKVT_TRY(akv_step_begin(rs.engine, ctx, c->n_ctx));
    for (uint32_t l = 0; l < c->layers; l++) {
      akv_fence attn, tail;
      AKVT_TRY(akv_lease_begin(rs.engine, l, &leases[l]));
      if (c->release_step == s + 1 && c->release_mid_step && c->release_layer == l) {
        /* Leases in flight: this lease's copies are queued, earlier layers'
         * attention may still run, and attention of this and later layers
         * reads the retained pages. */
        akv_headroom_info mid;
        out->release_status = akv_headroom_release(rs.engine, c->release_bytes,
                                                   &out->released_now, &out->released_pending);
        AKVT_TRY(out->release_status);
        akv_headroom_get(rs.engine, &mid);
        out->headroom_bytes_after_release_call = mid.bytes;
      }
      if (l >= 2 && !c->try_retire) {
        AKVT_TRY(akv_lease_retire(leases[l - 2], NULL));
        retired = l - 1;
      }
      while (c->try_retire && l >= 2 && retired <= l - 2) {
        akv_status ts = akv_lease_try_retire(leases[retired], NULL);
        if (ts == AKV_ERR_NOT_READY) break;
        if (ts != AKV_OK) {
          out->status = ts;
          out->failed_call = "akv_lease_try_retire(leases[retired], NULL)";
          goto failed;
        }
        retired++;
      }
      if (c->two_call) {
        akv_view view;
        AKVT_TRY(akv_lease_wait_ready(leases[l], rs.stream, &view));
        if (akvt_hook(&rs, &view, rs.stream) != 0) {
          out->status = AKV_ERR_BACKEND;
          out->failed_call = "hook";
          goto failed;
        }
        AKVT_TRY(akv_lease_mark_consumed(leases[l], rs.stream, &attn));
      } else {
        AKVT_TRY(akv_lease_attend(leases[l], rs.stream, akvt_hook, &rs, &attn));
      }
      AKVT_TRY(akv_lease_write_back(leases[l], NULL, 0, &tail));
      AKVT_TRY(akv_lease_seal(leases[l], tail, attn));
    }
    for (; retired < c->layers; retired++) {
      if (c->try_retire) {
        /* polled until it retires: at most 10 s, then the blocking retire */
        akv_status ts;
        for (int k = 0; k < 200000; k++) {
          if ((ts = akv_lease_try_retire(leases[retired], NULL)) != AKV_ERR_NOT_READY) break;
          struct timespec us50 = {0, 50000L};
          nanosleep(&us50, NULL);
        }
        if (ts == AKV_ERR_NOT_READY) ts = akv_lease_retire(leases[retired], NULL);
        if (ts != AKV_OK) {
          out->status = ts;
          out->failed_call = "akv_lease_try_retire(leases[retired], NULL)";
          goto failed;
        }
      } else {
        AKVT_TRY(akv_lease_retire(leases[retired], NULL));
      }
    }
    AKVT_TRY(akv_step_end(rs.engine));
    for (uint32_t i = 0; i < c->n_ctx; i++) auth_len[i]++;
    akvt_check_step(c, rs.out, lens, out);
  }
  out->failed_step = UINT32_MAX;
  goto finish;

failed:
  out->quarantined = 1;
  if (c->before_quarantine != NULL) c->before_quarantine(rs.engine, c->user);
  out->quarantine_status = akv_engine_quarantine(rs.engine, &out->quarantine);
  if (c->after_quarantine != NULL)
    c->after_quarantine(rs.engine, out->quarantine_status, &out->quarantine, c->user);
  if (out->quarantine_status == AKV_ERR_UNCERTAIN_FENCE && c->retry_uncertain) {
    /* Everything must still be retained: destroy refuses and frees nothing.
     * A second drain that establishes completion releases it. */
    out->destroy_uncertain = akv_engine_destroy(rs.engine);
    out->requarantined = 1;
    out->requarantine_status = akv_engine_quarantine(rs.engine, &out->requarantine);
  }
finish:
  akvt_check_rows(c, ctx, auth_len, out);
  akv_engine_info_get(rs.engine, &out->info);
  akv_headroom_get(rs.engine, &out->headroom_end);
  akv_admission_counters(rs.engine, out->adm_counters, AKV_ADM_RULE_COUNT);
  if (rs.stream != NULL) akv_stream_destroy(rs.engine, rs.stream);
  out->destroyed = akv_engine_destroy(rs.engine) == AKV_OK;
done:
  free(rs.jobs);
  free(rs.out);
}

int akvt_noop_hook(void *user, const akv_view *view, akv_stream stream) {
  (void)user;
  (void)view;
  (void)stream;
  return 0;
}

akv_status akvt_null_layers(akv_engine *e, akv_stream s, uint32_t layers) {
  return akvt_null_layers_from(e, s, 0, layers);
}

akv_status akvt_lease_through(akv_lease *ls, akv_stream s) {
  akv_status st;
  akv_fence attn, tail;
  if ((st = akv_lease_attend(ls, s, akvt_noop_hook, NULL, &attn)) != AKV_OK) return st;
  if ((st = akv_lease_write_back(ls, NULL, 0, &tail)) != AKV_OK) return st;
  if ((st = akv_lease_seal(ls, tail, attn)) != AKV_OK) return st;
  return akv_lease_retire(ls, NULL);
}

akv_status akvt_null_layers_from(akv_engine *e, akv_stream s, uint32_t from, uint32_t layers) {
  akv_status st;
  for (uint32_t l = from; l < layers; l++) {
    akv_lease *ls = NULL;
    if ((st = akv_lease_begin(e, l, &ls)) != AKV_OK) return st;
    if ((st = akvt_lease_through(ls, s)) != AKV_OK) return st;
  }
  return akv_step_end(e);
}

void akvt_fx_open(akvt_fx *f, akv_route route, uint32_t pool_gib, uint32_t n, uint32_t len) {
  /* 3 layers of rows of 2 kv heads x 8 dims (akvt_small_config). */
  static uint16_t zero[64 * 16];
  const void *rows[3] = {zero, zero, zero};
  memset(f, 0, sizeof(*f));
  f->e = akvt_small_engine(route, pool_gib);
  int ok = f->e != NULL && n <= 4 && len <= 64 && akv_stream_create(f->e, &f->s) == AKV_OK;
  f->n = n;
  for (uint32_t i = 0; ok && i < n; i++)
    ok = akv_context_open(f->e, NULL, &f->c[i]) == AKV_OK &&
         akv_context_append(f->c[i], len, rows, rows) == AKV_OK;
  if (!ok) { /* a fixture that cannot be set up fails the test binary */
    fprintf(stderr, "akvt_fx_open: setting up the fixture failed\n");
    abort();
  }
}

int akvt_run_threads(void *(*fn)(void *), void *recs, size_t stride, size_t n) {
  pthread_t th[16];
  size_t started = 0;
  if (n > 16) return -1;
  while (started < n &&
         pthread_create(&th[started], NULL, fn, (char *)recs + started * stride) == 0)
    started++;
  for (size_t i = 0; i < started; i++) pthread_join(th[i], NULL);
  return started == n ? 0 : -1;
}

int akvt_wait_child(int pid, unsigned timeout_ms, int *ws) {
  const struct timespec ms = {0, 1000000L};
  *ws = 0;
  for (unsigned i = 0; i < timeout_ms; i++) {
    const pid_t r = waitpid((pid_t)pid, ws, WNOHANG);
    if (r != 0) return 1; /* ended (or not our child: waitpid failed) */
    nanosleep(&ms, NULL);
  }
  if (waitpid((pid_t)pid, ws, WNOHANG) != 0) return 1;
  kill((pid_t)pid, SIGKILL);
  waitpid((pid_t)pid, ws, 0);
  return 0;
}
