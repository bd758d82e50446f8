/*
 * testutil.h - shared helpers of the CPU suite: deterministic row contents,
 * a small C attention, and a decode harness that stages through the library
 * on the host backend and compares every attention output byte for byte
 * against the same attention over a fully resident (recomputed) history.
 */
#ifndef AKV_TESTUTIL_H
#define AKV_TESTUTIL_H

#include <stddef.h>
#include <stdint.h>

#include "akv.h"

/* Row element j of (context, layer, token, kv): a bf16 bit pattern in [-1, 1). */
uint16_t akvt_elem(uint32_t ctx, uint32_t layer, uint32_t token, int kv, uint32_t j);
void akvt_fill_row(uint16_t *row, uint32_t n, uint32_t ctx, uint32_t layer, uint32_t token, int kv);
float akvt_bf16_to_f32(uint16_t b);

/* Runs fn on n threads (n <= 16), thread i on (char *)recs + i * stride,
 * and joins them all: a test's ranks or racing callers. Returns 0, or -1
 * (nothing started) when n is above 16 or a thread could not start (those
 * started are joined first). */
int akvt_run_threads(void *(*fn)(void *), void *recs, size_t stride, size_t n);
/* Waits up to timeout_ms for the forked child pid; one still running then is
 * killed (SIGKILL) and reaped. *ws gets its wait status. Returns 1 when the
 * child ended on its own, 0 when it hung and was killed. */
int akvt_wait_child(int pid, unsigned timeout_ms, int *ws);

/* GQA decode attention over `len` rows (fp32 math, fixed order); q is
 * [q_heads][head_dim] floats, out [q_heads][head_dim]. */
void akvt_attention(const float *q, const uint16_t *k, const uint16_t *v, uint32_t len,
                    uint32_t q_heads, uint32_t kv_heads, uint32_t head_dim, size_t row_elems,
                    float *out);

typedef struct akvt_cfg {
  uint32_t layers, kv_heads, head_dim, q_heads;
  uint32_t max_tokens, page_tokens;
  uint32_t n_ctx;
  uint32_t prefill[16];   /* per context */
  uint32_t steps;
  akv_route route;
  uint32_t device_pool_gib;
  uint32_t target_pages;  /* AKV_TARGET_FAIR_SHARE for the default */
  uint32_t burst_pages;
  uint64_t delay_seed;
  uint32_t delay_max_us;
  uint32_t fault_fail_nth;
  int32_t fault_kind;
  int two_call;           /* use wait_ready/mark_consumed instead of the hook */
  uint32_t poison_holes;  /* engine config poison_holes (paged route) */
  int ignore_page_map;    /* a wrong hook: reads every row at view.base */
  /* Optional; zero leaves them off (the defaults above keep them zero). */
  akv_log_fn log_fn;      /* engine log sink; NULL: akvt_silent_log */
  void *log_user;
  /* Called once after the first failing call, before the harness
   * quarantines (e.g. to inspect live tickets or arm a fault inside
   * quarantine's own synchronise calls). */
  void (*before_quarantine)(akv_engine *engine, void *user);
  /* Called right after the first quarantine returned, before anything else. */
  void (*after_quarantine)(akv_engine *engine, akv_status status,
                           const akv_quarantine_report *report, void *user);
  void *user;
  /* When the first quarantine reports AKV_ERR_UNCERTAIN_FENCE: record what
   * destroy says then (it must refuse), quarantine once more and go on with
   * the row check and destroy only if that second drain established
   * completion. */
  int retry_uncertain;
  /* Headroom (zero: off). headroom_pages > 0 gives the engine headroom_gib 1
   * and a modelled device (host_fake_free_bytes) with room for exactly
   * headroom_pages pages after its own allocations, in chunks of
   * headroom_chunk_pages pages (0: one chunk). */
  uint32_t headroom_pages;
  uint32_t headroom_chunk_pages;
  /* Release `release_bytes` (UINT64_MAX: all) of headroom at step
   * release_step (1-based; 0 = never): before akv_step_begin, or with
   * release_mid_step after layer release_layer's lease began and before
   * anything of it ran (leases in flight). take_step (1-based; 0 = never):
   * akv_headroom_take(UINT64_MAX) before that step begins. */
  uint32_t release_step;
  int release_mid_step;
  uint32_t release_layer;
  uint64_t release_bytes;
  uint32_t take_step;
  /* Retire with akv_lease_try_retire: in the layer loop every lease up to
   * l-2 whose fences passed (oldest first, stopping at the first not ready),
   * then after the last layer each lease left, polled until it retires.
   * Every lease then retires through one successful try_retire (at least
   * three event queries each), so a run issues at least 3 x layers x steps
   * queries whatever the timing. */
  int try_retire;
} akvt_cfg;

typedef struct akvt_result {
  akv_status status;        /* first failing library status, AKV_OK if none */
  const char *failed_call;  /* which call failed */
  uint64_t outputs_compared;
  uint64_t outputs_mismatched;
  uint64_t rows_checked;    /* host rows compared after the run */
  uint64_t rows_mismatched;
  akv_engine_info info;
  uint64_t adm_counters[AKV_ADM_RULE_COUNT];
  int quarantined;
  akv_quarantine_report quarantine;
  int destroyed;            /* engine destroyed cleanly at the end */
  /* Rows the harness knows to be authoritative (prefilled, plus one per
   * layer for every step that ended): sum of lengths x layers x 2 (K and V).
   * After a failure these are exactly the rows authoritative before the
   * failing step; rows_checked equals it when every context was readable.
   * A context whose library length differs from the harness's counts its
   * missing or extra rows as mismatched. */
  uint64_t rows_expected;
  uint32_t failed_step;     /* step (0-based) the failing call belonged to; UINT32_MAX if none */
  akv_status quarantine_status;   /* what the first quarantine returned */
  akv_status destroy_uncertain;   /* destroy right after an uncertain quarantine */
  int requarantined;              /* a second quarantine ran (retry_uncertain) */
  akv_status requarantine_status;
  akv_quarantine_report requarantine;
  /* Headroom: figures after create, the release's outputs, figures at the end. */
  akv_headroom_info headroom_start, headroom_end;
  uint64_t released_now, released_pending;
  akv_status release_status, take_status;
  uint64_t taken;
  uint64_t headroom_bytes_after_release_call; /* still allocated right after a mid-step release */
} akvt_result;

/* K row t of context i in a view (its V row is at + view->v_offset): the
 * staged rows at base, or, on the paged route, the retained page the host
 * copy of the page map names. Host pointers: host backend only. */
static inline uint8_t *akvt_view_row(const akv_view *v, uint32_t i, uint32_t t) {
  if (v->page_map_host != NULL && v->page_tokens > 0 && t / v->page_tokens < v->page_map_stride) {
    const uint32_t e = v->page_map_host[(size_t)i * v->page_map_stride + t / v->page_tokens];
    if (e != AKV_PAGE_STAGED)
      return (uint8_t *)v->pages + (size_t)e * v->page_stride +
             (size_t)(t % v->page_tokens) * v->row_stride;
  }
  return (uint8_t *)v->base + (size_t)i * v->context_stride + (size_t)t * v->row_stride;
}

akvt_cfg akvt_default_cfg(void);
/* Runs the decode; on a library failure, quarantines and reports. */
void akvt_run(const akvt_cfg *cfg, akvt_result *out);

/* Creates a host engine with a small geometry (for state-machine tests). */
/* The config of akvt_small_engine (host backend, 3 dense layers, 2 kv heads
 * x 8 dims, 64 tokens, pages of 8, 4 contexts, silent log), for tests that
 * change a field or two before creating it. */
akv_engine_config akvt_small_config(akv_route route, uint32_t device_pool_gib);
akv_engine *akvt_small_engine(akv_route route, uint32_t device_pool_gib);
void akvt_silent_log(void *user, akv_log_level level, const char *message);
/* The rest of an open step with an attention hook that enqueues nothing:
 * every layer begun, attended, written back, sealed and retired in order,
 * then akv_step_end. Returns AKV_OK or the first failing status. */
akv_status akvt_null_layers(akv_engine *e, akv_stream s, uint32_t layers);
/* A begun lease through attend (akvt_noop_hook), write-back, seal and
 * retire on stream s. Returns AKV_OK or the first failing status. */
akv_status akvt_lease_through(akv_lease *ls, akv_stream s);
/* The same from layer `from` on (the layers before it already retired). */
akv_status akvt_null_layers_from(akv_engine *e, akv_stream s, uint32_t from, uint32_t layers);
/* An attention hook that enqueues nothing and returns 0. */
int akvt_noop_hook(void *user, const akv_view *view, akv_stream stream);
/* A fixture for call-sequence tests: akvt_small_engine(route, pool_gib), one
 * stream, n <= 4 contexts of `len` (<= 64) zero rows each. */
typedef struct akvt_fx {
  akv_engine *e;
  akv_stream s;
  akv_context *c[4];
  uint32_t n;
} akvt_fx;
void akvt_fx_open(akvt_fx *f, akv_route route, uint32_t pool_gib, uint32_t n, uint32_t len);

#endif
