/*
 * fuzz_api.c - a libFuzzer target for the public API (host backend).
 *
 * The input is a program: its first bytes configure a small engine (route,
 * layers, concurrency, and sometimes an injected backend fault), the rest is
 * a sequence of API calls with arguments drawn from the input: valid and
 * stale handles, NULLs, pointers to objects of another type, out-of-range
 * layers, fences from other leases or made up, double retires (blocking and
 * akv_lease_try_retire), calls after a forced failure and after quarantine,
 * destroy with live work, and a whole legal step now and then so deep states
 * are reached. One engine lives
 * across the calls of an input; at the end the input's streams are destroyed
 * and the engine is destroyed (quarantined first when destroy says busy).
 *
 * After every call the returned status must be one the header documents for
 * that function (abort otherwise); a call that is not a diagnostic must never
 * succeed once the transport has failed; quarantine must leave the engine
 * quarantined when it succeeds; and teardown must free everything (no worker
 * thread may outlive its engine; LeakSanitizer checks memory).
 *
 * Dead handles must be refused with AKV_ERR_BAD_HANDLE within the reuse
 * bounds akv.h states ("Handle lifetimes"): a closed context, a retired (or
 * quarantine-released) lease, an engine after a successful destroy, and the
 * contexts and leases of that engine. Destroyed streams are given to every
 * call that takes a stream, and a stream an unretired lease used must not be
 * destroyable (AKV_ERR_IN_USE); ASan sees any read of freed memory.
 *
 * Beyond the engine calls (all 54 functions of akv.h, akv_attention.h and
 * akv_group.h are driven):
 *  - engines of every dtype (FP8 rows are 1 byte an element), the paged
 *    route with poison_holes, DEBUG logging and a log callback that calls the
 *    engine back (diagnostics, failing ones included, and calls that must be
 *    refused with AKV_ERR_IN_USE); nothing may be logged from inside it;
 *  - read-back: the harness keeps a shadow of every row it appended (from
 *    misaligned source pointers) and of the rows its own legal steps wrote;
 *    akv_context_read must return them, a refused read or append must write
 *    nothing, and the attention hook checks every staged row of the view
 *    (page_map included) against the shadow, then runs the reference
 *    attention over the view (akv_attention_args_from_view);
 *  - the reference attention alone: clean calls must succeed and repeat bit
 *    for bit, with page overrides (the overridden rows poisoned) and through
 *    the paged variant; one hostile argument (misaligned q/out/workspace, a
 *    short workspace or row, bad FP8 scales, offsets past ptrdiff_t, a bad
 *    page table, an unsupported dtype) must be refused with out untouched;
 *  - tensor parallel groups on the in-process world (1 or 2 rank threads,
 *    disagreeing arguments on rank 1): every rank must answer an agreement
 *    point alike (but for a rank refused alone and a timeout, whose late
 *    rank may answer AKV_ERR_COMM) and open contexts with the same ids; dead
 *    worlds and groups are refused;
 *  - stream enqueue: a host function enqueued with AKV_OK has run when
 *    synchronize or destroy returns; headroom take/release refused change
 *    nothing akv_headroom_get shows; explain stays within its cap.
 *
 * Build: scripts/fuzz.sh (clang, -fsanitize=fuzzer,address,undefined).
 */
#if !defined(_GNU_SOURCE) && !defined(_DEFAULT_SOURCE)
#define _DEFAULT_SOURCE
#endif
#include <dirent.h>
#include <math.h>
#include <pthread.h>
#include <stddef.h>
#include <unistd.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "akv.h"
#include "akv_attention.h"
#include "akv_group.h"

#define MAX_LAYERS 3
#define ROW_MAX 4096 /* 8 kv_heads x 128 head_dim x f32: the largest K row */
#define ROW_PAD 8    /* spare rows after each layer's source rows */
#define MAX_TOKENS 64
#define N_CTX 8
#define N_LEASE 8
#define N_FENCE 16
#define N_STREAM 10

/* ----------------------------------------------------------- the input */

typedef struct input {
  const uint8_t *p;
  size_t n;
} input;

static uint8_t byte(input *in) {
  if (in->n == 0) return 0;
  in->n--;
  return *in->p++;
}

static uint32_t u32(input *in) {
  uint32_t v = byte(in);
  v |= (uint32_t)byte(in) << 8;
  v |= (uint32_t)byte(in) << 16;
  return v | (uint32_t)byte(in) << 24;
}

/* Whether all n bytes at p are c. One memcmp of the buffer against itself
 * shifted by a byte, not a loop over bytes: a per-byte loop in the harness
 * costs a coverage callback per byte (hundreds of thousands per input). */
static int all_bytes(const uint8_t *p, size_t n, uint8_t c) {
  return n == 0 || (p[0] == c && memcmp(p, p + 1, n - 1) == 0);
}

/* p[i] = (i * mul + add) & mask for i < n. The pattern repeats every 256
 * bytes, so the first 256 are computed and then copied in doubling runs. */
static void fill_pattern(uint8_t *p, size_t n, uint8_t mul, uint8_t add, uint8_t mask) {
  size_t done = n < 256 ? n : 256;
  for (size_t i = 0; i < done; i++) p[i] = (uint8_t)((i * mul + add) & mask);
  while (done < n) {
    size_t k = n - done < done ? n - done : done;
    memcpy(p + done, p, k);
    done += k;
  }
}

/* ------------------------------------------------------------ the state */

typedef struct state state;
struct state {
  akv_engine *e;
  uint32_t layers, max_ctx;
  akv_stream streams[N_STREAM]; /* created this input; NULL once destroyed */
  akv_stream stale[N_STREAM];   /* destroyed ones (never dereferenced by the library's lease calls) */
  int n_stale;
  akv_context *ctx[N_CTX];      /* handles seen: open, closed, or reopened slots */
  unsigned char dead[N_CTX];    /* ctx[i] was closed and open has not returned it since */
  akv_lease *lease[N_LEASE];    /* handles seen: any state */
  unsigned char lease_dead[N_LEASE]; /* lease[i] retired or released ... */
  uint32_t lease_dead_at[N_LEASE];   /* ... when `begins` had this value */
  uint32_t begins;              /* successful akv_lease_begin calls on this engine */
  /* The engine destroyed last in this input, its contexts and lease handles:
   * dead, refused while fewer creates than the bound followed. */
  akv_engine *old_e;
  uint32_t creates_since;       /* successful creates since old_e's destroy */
  akv_context *old_ctx[N_CTX];
  akv_lease *old_lease[N_LEASE];
  akv_fence fence[N_FENCE];
  int n_fence;
  int n_group;                  /* group runs this input (each spawns threads) */
  int hook_mode;                /* 0: enqueue the new rows, 1: do nothing, 2: fail */
  akv_dtype dtype;              /* the engine's element type */
  uint32_t row;                 /* the engine's K (or V) row bytes */
  /* Streams: host functions enqueued (AKV_OK) and run, per stream slot. */
  uint32_t launched[N_STREAM];
  uint32_t ran[N_STREAM];
  uint64_t bogus[512];          /* an object of no handle type */
  int log_reenter;              /* the log callback calls the library back */
};

/* Source rows of appends: a pattern, read from any byte offset (misaligned
 * row pointers into a valid buffer). */
static uint8_t g_rows[MAX_LAYERS][(MAX_TOKENS + ROW_PAD) * ROW_MAX];

/* What each context slot's layers hold, as the harness wrote it: row t of
 * layer l is K g_shadow[c][l][t][0], V g_shadow[c][l][t][1] (first `row`
 * bytes). Valid while g_known[c]: only appends and the harness's own legal
 * steps (whose hook writes known rows) touched the context. Read-back and
 * the staged view must match it. */
static uint8_t g_shadow[N_CTX][MAX_LAYERS][MAX_TOKENS][2][ROW_MAX];
static uint32_t g_shadow_n[N_CTX][MAX_LAYERS];
static unsigned char g_known[N_CTX];

static int ctx_slot(const state *s, const akv_context *c) {
  for (int i = 0; i < N_CTX; i++)
    if (c != NULL && s->ctx[i] == c && !s->dead[i]) return i;
  return -1;
}

static void shadow_reset(int slot) {
  memset(g_shadow_n[slot], 0, sizeof(g_shadow_n[slot]));
  g_known[slot] = 1;
}

static void shadow_taint(const state *s, const akv_context *c) {
  int slot = ctx_slot(s, c);
  if (slot >= 0) g_known[slot] = 0;
}

/* Appended rows: remember them, and read them straight back. */
static void shadow_append(const state *s, akv_context *c, uint32_t layer, uint32_t n,
                          const uint8_t *k, const uint8_t *v) {
  static uint8_t kb[(MAX_TOKENS + ROW_PAD) * ROW_MAX], vb[(MAX_TOKENS + ROW_PAD) * ROW_MAX];
  int slot = ctx_slot(s, c);
  uint32_t at;
  akv_status st;
  if (slot < 0 || n == 0) return;
  at = g_shadow_n[slot][layer];
  if ((uint64_t)at + n > MAX_TOKENS) {
    fprintf(stderr, "fuzz_api: append took %u rows onto %u of a layer of %u\n", n, at, MAX_TOKENS);
    abort();
  }
  for (uint32_t t = 0; t < n; t++) {
    memcpy(g_shadow[slot][layer][at + t][0], k + (size_t)t * s->row, s->row);
    memcpy(g_shadow[slot][layer][at + t][1], v + (size_t)t * s->row, s->row);
  }
  g_shadow_n[slot][layer] = at + n;
  st = akv_context_read(c, layer, at, n, kb, vb);
  if (st != AKV_OK) {
    fprintf(stderr, "fuzz_api: reading back %u appended rows: %s\n", n, akv_status_string(st));
    abort();
  }
  if (memcmp(kb, k, (size_t)n * s->row) != 0 || memcmp(vb, v, (size_t)n * s->row) != 0) {
    fprintf(stderr, "fuzz_api: appended rows read back differently (layer %u, rows %u..%u)\n",
            layer, at, at + n);
    abort();
  }
}

static void fuzz_log(void *user, akv_log_level level, const char *message);

/* ------------------------------------------------------- status checks */

#define S(x) (1u << (x))
#define OKS S(AKV_OK)
#define BH S(AKV_ERR_BAD_HANDLE)
#define IA S(AKV_ERR_INVALID_ARGUMENT)
#define QU S(AKV_ERR_QUARANTINED)
#define BE S(AKV_ERR_BACKEND)

static int g_trace = -1; /* FUZZ_TRACE=1 prints every call (to reproduce a crash) */

/* Milliseconds since the first call of this process, for FUZZ_TRACE lines
 * (a slow input shows where its time goes). */
static double trace_ms(void) {
  static struct timespec t0;
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  if (t0.tv_sec == 0 && t0.tv_nsec == 0) t0 = t;
  return (double)(t.tv_sec - t0.tv_sec) * 1e3 + (double)(t.tv_nsec - t0.tv_nsec) / 1e6;
}

static void expect(const char *fn, akv_status st, uint32_t allowed) {
  if (g_trace < 0) g_trace = getenv("FUZZ_TRACE") != NULL;
  if (g_trace) fprintf(stderr, "  %9.3f ms  %s -> %s\n", trace_ms(), fn, akv_status_string(st));
  if ((unsigned)st < 32u && (allowed & S(st)) != 0) return;
  fprintf(stderr, "fuzz_api: %s returned %d (%s), which its declaration does not list\n", fn,
          (int)st, akv_status_string(st));
  abort();
}

/* Calls that are not diagnostics must never succeed after a failure. */
static int transport_failed(const state *s) {
  akv_engine_info info;
  if (akv_engine_info_get(s->e, &info) != AKV_OK) abort();
  return info.transport_failed;
}

static void expect_mut(const state *s, int failed_before, const char *fn, akv_status st,
                       uint32_t allowed) {
  (void)s;
  expect(fn, st, allowed);
  if (failed_before && st == AKV_OK) {
    fprintf(stderr, "fuzz_api: %s succeeded after the transport failed\n", fn);
    abort();
  }
}

/* The log callback may call diagnostics on the engine that logs (akv.h);
 * calls that change the engine are refused there with AKV_ERR_IN_USE. With
 * log_reenter set it makes both kinds, failing ones included, and checks
 * that nothing is logged from inside it (that would recurse). */
static void fuzz_log(void *user, akv_log_level level, const char *message) {
  static int depth;
  struct state *s = user;
  (void)level;
  (void)message;
  if (s == NULL || s->e == NULL || !s->log_reenter) return;
  if (depth > 0) {
    fprintf(stderr, "fuzz_api: the engine logged from inside its own log callback\n");
    abort();
  }
  depth++;
  {
    akv_engine_info info;
    akv_headroom_info hr;
    akv_context *c = NULL;
    akv_stream st = NULL;
    char buf[48];
    uint8_t row[2 * ROW_MAX];
    size_t n = 0;
    expect("akv_engine_info_get (log)", akv_engine_info_get(s->e, &info), OKS | BH);
    expect("akv_headroom_get (log)", akv_headroom_get(s->e, &hr), OKS | BH);
    expect("akv_admission_log (log)", akv_admission_log(s->e, NULL, 0, &n), OKS | BH);
    expect("akv_admission_explain (log)",
           akv_admission_explain(s->e, (const akv_context *)s->bogus, buf, sizeof(buf)), BH);
    expect("akv_context_read (log)", akv_context_read(s->ctx[0], 99, 0, 1, row, row + ROW_MAX),
           BH | IA);
    expect("akv_context_open (log)", akv_context_open(s->e, NULL, &c), S(AKV_ERR_IN_USE) | BH);
    expect("akv_step_end (log)", akv_step_end(s->e), S(AKV_ERR_IN_USE) | BH);
    expect("akv_headroom_release (log)", akv_headroom_release(s->e, 1, NULL, NULL),
           S(AKV_ERR_IN_USE) | BH);
    expect("akv_stream_create (log)", akv_stream_create(s->e, &st), S(AKV_ERR_IN_USE) | BH);
    if (c != NULL || st != NULL) abort();
  }
  depth--;
}

/* ------------------------------------------------------------- choices */

static akv_context *pick_ctx(state *s, input *in) {
  uint8_t b = byte(in) % 14;
  if (b < N_CTX) return s->ctx[b];
  switch (b) {
    case 8: return NULL;
    case 9: return (akv_context *)s->e;            /* an engine */
    case 10: return (akv_context *)s->lease[0];    /* a lease, or NULL */
    case 11: return (akv_context *)s->bogus;       /* no handle at all */
    case 12: return (akv_context *)&s->fence[0];   /* a small object */
    default: return s->ctx[byte(in) % N_CTX];
  }
}

static akv_lease *pick_lease(state *s, input *in) {
  uint8_t b = byte(in) % 12;
  if (b < N_LEASE) return s->lease[b];
  switch (b) {
    case 8: return NULL;
    case 9: return (akv_lease *)s->e;
    case 10: return (akv_lease *)s->ctx[0];
    default: return (akv_lease *)s->bogus;
  }
}

/* For every call that takes a stream: live streams, destroyed ones, and
 * non-streams. */
static akv_stream pick_stream(state *s, input *in) {
  uint8_t b = byte(in) % 16;
  if (b < N_STREAM) return s->streams[b % N_STREAM] != NULL ? s->streams[b % N_STREAM] : s->streams[0];
  switch (b) {
    case 10: return NULL;
    case 11: return (akv_stream)s->bogus;
    case 12: return s->n_stale > 0 ? s->stale[byte(in) % s->n_stale] : NULL;
    case 13: return (akv_stream)s->e;
    default: return s->streams[0];
  }
}

static akv_fence pick_fence(state *s, input *in) {
  akv_fence f;
  uint8_t b = byte(in);
  if (s->n_fence > 0 && b < 200) return s->fence[b % s->n_fence];
  f.serial = b < 230 ? (uint64_t)byte(in) : (uint64_t)u32(in) << 8;
  return f;
}

static void keep_fence(state *s, akv_fence f) {
  s->fence[s->n_fence < N_FENCE ? s->n_fence++ : (int)(f.serial % N_FENCE)] = f;
}

/* A handle begin just returned: alive (again, if its record came back). */
static void keep_lease(state *s, akv_lease *ls) {
  int at = -1;
  s->begins++;
  for (int i = 0; i < N_LEASE && at < 0; i++)
    if (s->lease[i] == ls) at = i;
  for (int i = 0; i < N_LEASE && at < 0; i++)
    if (s->lease[i] == NULL) at = i;
  if (at < 0) at = (int)((uintptr_t)ls % N_LEASE);
  s->lease[at] = ls;
  s->lease_dead[at] = 0;
}

static void mark_lease_dead(state *s, const akv_lease *ls) {
  for (int i = 0; i < N_LEASE; i++)
    if (s->lease[i] == ls && ls != NULL && !s->lease_dead[i]) {
      s->lease_dead[i] = 1;
      s->lease_dead_at[i] = s->begins;
    }
}

/* Quarantine released every lease not yet retired. */
static void mark_all_leases_dead(state *s) {
  for (int i = 0; i < N_LEASE; i++) mark_lease_dead(s, s->lease[i]);
}

/* A dead lease handle is refused while fewer than (handles per layer - 1) x
 * layers begins followed its death (akv.h). */
static void expect_dead_lease_refused(const state *s, const char *fn, const akv_lease *ls,
                                      akv_status st) {
  for (int i = 0; i < N_LEASE; i++)
    if (s->lease[i] == ls && ls != NULL && s->lease_dead[i] &&
        s->begins - s->lease_dead_at[i] < (AKV_LEASE_HANDLES_PER_LAYER - 1) * s->layers &&
        st != AKV_ERR_BAD_HANDLE) {
      fprintf(stderr, "fuzz_api: %s on a dead lease handle returned %s, not BAD_HANDLE\n", fn,
              akv_status_string(st));
      abort();
    }
}

/* A handle open just returned: alive (again, if its record came back). */
static void keep_ctx(state *s, akv_context *c) {
  for (int i = 0; i < N_CTX; i++)
    if (s->ctx[i] == c) {
      s->dead[i] = 0;
      shadow_reset(i);
      return;
    }
  for (int i = 0; i < N_CTX; i++)
    if (s->ctx[i] == NULL) {
      s->ctx[i] = c;
      s->dead[i] = 0;
      shadow_reset(i);
      return;
    }
  s->ctx[(uintptr_t)c % N_CTX] = c;
  s->dead[(uintptr_t)c % N_CTX] = 0;
  shadow_reset((int)((uintptr_t)c % N_CTX));
}

static void mark_closed(state *s, akv_context *c) {
  for (int i = 0; i < N_CTX; i++)
    if (s->ctx[i] == c && c != NULL) s->dead[i] = 1;
}

/* A closed handle stays dead: every call with it is AKV_ERR_BAD_HANDLE,
 * whoever took its host slot since (until open hands its record out again). */
static void expect_dead_refused(const state *s, const char *fn, const akv_context *c,
                                akv_status st) {
  for (int i = 0; i < N_CTX; i++)
    if (s->ctx[i] == c && c != NULL && s->dead[i] && st != AKV_ERR_BAD_HANDLE) {
      fprintf(stderr, "fuzz_api: %s on a closed context handle returned %s, not BAD_HANDLE\n",
              fn, akv_status_string(st));
      abort();
    }
}

/* ------------------------------------------------------------ the hook */

typedef struct job {
  akv_view view;                 /* copied; its arrays live until the lease retires */
  uint32_t len[N_CTX];           /* rows staged; the new row goes at len[i] */
  uint32_t alen[N_CTX];          /* rows attended: len[i] + 1 */
  int slot[N_CTX];               /* shadow slot to compare the staged rows with, or -1 */
  uint32_t row;
  akv_attention_args args;       /* attention over the view (from akv_attention_args_from_view) */
  int attend;                    /* 1: run the reference over the view */
  void *ws;
} job;

static job g_jobs[MAX_LAYERS];
static uint16_t g_q[N_CTX * 16 * 128];
static float g_out[N_CTX * 16 * 128];
static const float g_scales[8] = {1.0f, 0.5f, 2.0f, 0.25f, 1.5f, 3.0f, 1.0f, 0.125f};

/* Where row t of context i of a view lives (K; V is v_offset further). */
static const uint8_t *view_row(const akv_view *v, uint32_t i, uint32_t t) {
  if (v->page_map_host != NULL && v->page_tokens > 0 && t / v->page_tokens < v->page_map_stride) {
    uint32_t e = v->page_map_host[(size_t)i * v->page_map_stride + t / v->page_tokens];
    if (e != AKV_PAGE_STAGED)
      return (const uint8_t *)v->pages + (uint64_t)e * v->page_stride +
             (uint64_t)(t % v->page_tokens) * v->row_stride;
  }
  return (const uint8_t *)v->base + i * v->context_stride + (uint64_t)t * v->row_stride;
}

static void job_run(void *arg) {
  job *j = arg;
  const akv_view *v = &j->view;
  for (uint32_t i = 0; i < v->n_contexts; i++) {
    uint8_t *k = (uint8_t *)v->base + i * v->context_stride + (uint64_t)j->len[i] * v->row_stride;
    /* The staged history of a context whose rows the harness knows. */
    if (j->slot[i] >= 0)
      for (uint32_t t = 0; t < j->len[i]; t++) {
        const uint8_t *r = view_row(v, i, t);
        if (memcmp(r, g_shadow[j->slot[i]][v->layer][t][0], j->row) != 0 ||
            memcmp(r + v->v_offset, g_shadow[j->slot[i]][v->layer][t][1], j->row) != 0) {
          fprintf(stderr, "fuzz_api: staged row %u of context %u (layer %u) is not the host's\n",
                  t, i, v->layer);
          abort();
        }
      }
    memset(k, (int)i + 1, j->row);
    memset(k + v->v_offset, (int)i + 2, j->row);
  }
  if (j->attend) {
    akv_status st = akv_attention_ref_bf16(&j->args);
    akv_status want = j->args.dtype == AKV_DTYPE_F16 || j->args.dtype == AKV_DTYPE_F32
                          ? AKV_ERR_NOT_SUPPORTED
                          : AKV_OK;
    if (st != want) {
      fprintf(stderr, "fuzz_api: reference attention over an engine's view: %s\n",
              akv_status_string(st));
      abort();
    }
  }
  free(j->ws);
  j->ws = NULL;
}

static void noop_fn(void *arg) { (void)arg; }

static uint32_t g_ran_other;
static void count_fn(void *arg) { __atomic_add_fetch((uint32_t *)arg, 1, __ATOMIC_ACQ_REL); }

static int hook(void *user, const akv_view *view, akv_stream stream) {
  state *s = user;
  job *j;
  size_t ws = 0;
  uint32_t maxlen = 0;
  if (s->hook_mode == 2) return 1;
  if (s->hook_mode == 1) return 0;
  if (view == NULL || view->layer >= MAX_LAYERS || view->n_contexts > N_CTX) abort();
  j = &g_jobs[view->layer];
  free(j->ws); /* a job enqueued but never run (its stream failed) */
  memset(j, 0, sizeof(*j));
  j->view = *view;
  j->row = s->row;
  if (view->dtype != s->dtype || view->v_offset != s->row || view->row_stride != 2 * (uint64_t)s->row) {
    fprintf(stderr, "fuzz_api: view geometry: dtype %d, v_offset %llu, row_stride %llu\n",
            (int)view->dtype, (unsigned long long)view->v_offset,
            (unsigned long long)view->row_stride);
    abort();
  }
  for (uint32_t i = 0; i < view->n_contexts; i++) {
    int slot = ctx_slot(s, view->contexts[i]);
    if (view->len[i] >= MAX_TOKENS) abort();
    j->len[i] = view->len[i];
    j->slot[i] = slot >= 0 && g_known[slot] ? slot : -1;
    if (j->slot[i] >= 0 && g_shadow_n[slot][view->layer] != view->len[i]) {
      fprintf(stderr, "fuzz_api: view len %u, the context holds %u rows\n", view->len[i],
              g_shadow_n[slot][view->layer]);
      abort();
    }
    j->len[i] = view->len[i];
    if (view->len[i] + 1 > maxlen) maxlen = view->len[i] + 1;
  }
  /* Reference attention over the view, as a host-backend caller runs it. */
  memset(&j->args, 0, sizeof(j->args));
  j->args.chunk_tokens = 16; /* the page size; from_view sets it on the paged route */
  if (akv_attention_args_from_view(view, &j->args) != AKV_OK) abort();
  if ((view->page_map == NULL) != (j->args.page_map == NULL)) abort();
  j->args.n_heads = 2 * view->kv_heads;
  j->args.scale = 0.088f;
  j->args.q = g_q;
  j->args.len = j->alen;
  j->args.out = g_out;
  if (view->dtype == AKV_DTYPE_FP8_E4M3 || view->dtype == AKV_DTYPE_FP8_E5M2) {
    j->args.k_scale = g_scales;
    j->args.v_scale = g_scales;
  }
  for (uint32_t i = 0; i < view->n_contexts; i++) j->alen[i] = view->len[i] + 1;
  if (view->n_contexts > 0 && view->kv_heads == 8 && view->head_dim == 128 &&
      akv_attention_workspace_bytes(view->n_contexts, j->args.n_heads, view->head_dim, maxlen,
                                    j->args.chunk_tokens, &ws) == AKV_OK) {
    j->ws = malloc(ws > 0 ? ws : 1);
    j->args.workspace = j->ws;
    j->args.workspace_bytes = ws;
    j->attend = j->ws != NULL;
  }
  return akv_stream_launch_host(s->e, stream, job_run, j) == AKV_OK ? 0 : 1;
}

/* ---------------------------------------------------------- the engine */

static akv_engine_config base_config(uint32_t layers, uint32_t max_ctx, akv_route route) {
  akv_engine_config ec = AKV_ENGINE_CONFIG_INIT;
  ec.backend = AKV_BACKEND_HOST;
  ec.n_dense_layers = layers;
  ec.kv_heads = 8;
  ec.head_dim = 128;
  ec.max_tokens = MAX_TOKENS;
  ec.page_tokens = 16;
  ec.host_pool_gib = 1;
  ec.device_pool_gib = route != AKV_ROUTE_STAGE ? 1 : 0;
  ec.max_contexts = max_ctx;
  ec.route = route;
  ec.log_fn = fuzz_log;
  return ec;
}

static void engine_new(state *s, input *in) {
  uint8_t b = byte(in);
  akv_engine_config ec;
  akv_status st;
  s->layers = 1 + b % MAX_LAYERS;
  s->max_ctx = 1 + (b >> 2) % 4;
  ec = base_config(s->layers, s->max_ctx,
                   !((b >> 4) & 1)  ? AKV_ROUTE_STAGE
                   : (b >> 5) & 1   ? AKV_ROUTE_PAGED
                                    : AKV_ROUTE_ARENA);
  if ((b >> 6) & 1 && ec.route != AKV_ROUTE_STAGE) {
    /* Revocable headroom on a modelled device of 2 GiB + 64 MiB: under
     * 64 MiB of headroom after the 1 GiB pool, the staging buffers and the
     * 1 GiB reserve, in chunks of 64 pages (2 to 31 of them, by dtype and
     * layers). The contexts here use at most 16 pages; a larger headroom
     * only makes each create and akv_headroom_get walk more pages. */
    ec.headroom_gib = 1;
    ec.headroom_reserve_gib = 1;
    ec.host_fake_free_bytes = ((uint64_t)2 << 30) + ((uint64_t)64 << 20);
    ec.headroom_chunk_pages = 64;
  }
  if ((b >> 5) == 7) { /* an injected fault somewhere in this engine's life */
    ec.fault_fail_nth = 1 + byte(in);
    ec.fault_kind = (int32_t)(byte(in) % (AKV_OP_KIND_COUNT + 1)) - 1;
  }
  {
    /* The element type: bf16 mostly, FP8 (1-byte rows), f16, f32. */
    static const akv_dtype dts[8] = {AKV_DTYPE_BF16, AKV_DTYPE_BF16, AKV_DTYPE_BF16,
                                     AKV_DTYPE_FP8_E4M3, AKV_DTYPE_FP8_E5M2, AKV_DTYPE_F16,
                                     AKV_DTYPE_F32, AKV_DTYPE_FP8_E4M3};
    uint8_t d = byte(in);
    ec.dtype = dts[d % 8];
    if (ec.route == AKV_ROUTE_PAGED && (d & 0x80)) ec.poison_holes = 1;
    if (d & 0x40) ec.log_level = AKV_LOG_DEBUG;
    s->log_reenter = (d >> 5) & 1;
    ec.log_user = s;
    s->dtype = ec.dtype;
    s->row = 8u * 128u * (ec.dtype == AKV_DTYPE_F32 ? 4u : ec.dtype >= AKV_DTYPE_FP8_E4M3 ? 1u : 2u);
  }
  st = akv_engine_create(&ec, &s->e);
  expect("akv_engine_create", st,
         OKS | IA | S(AKV_ERR_CONFIG) | S(AKV_ERR_NO_FIT) | S(AKV_ERR_OUT_OF_MEMORY) |
             S(AKV_ERR_NOT_SUPPORTED) | BE);
  if (st != AKV_OK) {
    s->e = NULL;
    return;
  }
  s->creates_since++;
  st = akv_stream_create(s->e, &s->streams[0]);
  expect("akv_stream_create", st, OKS | BE);
  if (st != AKV_OK) s->streams[0] = NULL;
}

/* Forgets every handle of the engine (after it was destroyed), keeping
 * them as the dead handles of the last destroyed engine. */
static void forget_engine(state *s) {
  s->old_e = s->e;
  s->creates_since = 0;
  memcpy(s->old_ctx, s->ctx, sizeof(s->ctx));
  memcpy(s->old_lease, s->lease, sizeof(s->lease));
  memset(s->lease_dead, 0, sizeof(s->lease_dead));
  s->begins = 0;
  s->e = NULL;
  memset(s->streams, 0, sizeof(s->streams));
  memset(s->stale, 0, sizeof(s->stale));
  s->n_stale = 0;
  memset(s->ctx, 0, sizeof(s->ctx));
  memset(s->lease, 0, sizeof(s->lease));
  s->n_fence = 0;
}

/* Destroys every stream no unretired lease used (those answer IN_USE and
 * stay); with `all`, every one must go (nothing unretired is left). */
static void streams_destroy_all(state *s, int all) {
  for (int i = 0; i < N_STREAM; i++)
    if (s->streams[i] != NULL) {
      akv_status st = akv_stream_destroy(s->e, s->streams[i]);
      expect("akv_stream_destroy", st, all ? OKS : OKS | S(AKV_ERR_IN_USE));
      if (st != AKV_OK) continue;
      if (s->n_stale < N_STREAM) s->stale[s->n_stale++] = s->streams[i];
      s->streams[i] = NULL;
    }
}

/* Destroy, quarantining first when destroy says busy; must free it all. */
static void teardown(state *s) {
  akv_status st;
  akv_quarantine_report q;
  if (s->e == NULL) return;
  streams_destroy_all(s, 0);
  st = akv_engine_destroy(s->e);
  expect("akv_engine_destroy", st, OKS | S(AKV_ERR_BUSY));
  if (st == AKV_ERR_BUSY) {
    st = akv_engine_quarantine(s->e, &q);
    expect("akv_engine_quarantine", st, OKS | S(AKV_ERR_UNCERTAIN_FENCE));
    /* an uncertain fence here can only be an injected one-shot fault: the
     * queues are drained, and a second quarantine must prove it */
    if (st != AKV_OK) st = akv_engine_quarantine(s->e, &q);
    if (st != AKV_OK) {
      fprintf(stderr, "fuzz_api: quarantine could not establish completion twice: %s\n",
              q.uncertain);
      abort();
    }
    streams_destroy_all(s, 1); /* quarantine released every lease */
    st = akv_engine_destroy(s->e);
    if (st != AKV_OK) {
      fprintf(stderr, "fuzz_api: destroy after quarantine returned %s: %s\n",
              akv_status_string(st), akv_engine_last_error(s->e));
      abort();
    }
  }
  forget_engine(s);
}

/* ------------------------------------------------------------ the calls */

static void op_open(state *s, input *in, int failed) {
  akv_context_config cc = AKV_CONTEXT_CONFIG_INIT;
  akv_context *c = NULL;
  uint8_t b = byte(in);
  akv_status st;
  cc.target_pages = b & 1 ? AKV_TARGET_FAIR_SHARE : byte(in) % 8;
  cc.burst_pages = byte(in) % 4;
  if (b == 0xfe) cc.target_pages = u32(in); /* possibly far beyond the pool */
  if (b == 0xfd) cc.struct_size = 4;
  if (b == 0xfc) cc.version = 99;
  if (b == 0xfa) cc.struct_size = 8 + byte(in) % 8;     /* an older caller's, shorter */
  if (b == 0xf8) cc.struct_size = sizeof(cc) + byte(in); /* a newer caller's: not read past ours */
  st = akv_context_open(s->e, (b & 6) == 6 ? NULL : &cc, b == 0xfb ? NULL : &c);
  expect_mut(s, failed, "akv_context_open", st,
             OKS | BH | IA | S(AKV_ERR_CONFIG) | S(AKV_ERR_REFUSED_QUEUE) |
                 S(AKV_ERR_ADMISSION_REFUSED) | S(AKV_ERR_STEP_STATE) | QU);
  if (st == AKV_OK) keep_ctx(s, c);
}

static void op_append(state *s, input *in, int failed) {
  const void *k[MAX_LAYERS], *v[MAX_LAYERS];
  uint8_t b = byte(in);
  uint32_t n = byte(in) % 70;
  uint32_t off = byte(in) % ROW_PAD; /* any byte alignment: rows are bytes */
  akv_context *c = pick_ctx(s, in);
  uint32_t held[MAX_LAYERS], after[MAX_LAYERS];
  int slot = ctx_slot(s, c);
  if (byte(in) == 0xee) n = UINT32_MAX - byte(in); /* wraps a 32-bit capacity check */
  for (int l = 0; l < MAX_LAYERS; l++) {
    k[l] = g_rows[l] + off;
    v[l] = g_rows[(l + 1) % MAX_LAYERS] + off + 3;
  }
  if (b == 1) k[s->layers - 1] = NULL;
  if (b & 0x10) {
    /* One layer only (layer may be out of range; b & 0x20 a NULL row
     * array): the context's length is the minimum over its layers, so a
     * per-layer append never lowers it and a refused one never moves it. */
    uint32_t layer = byte(in) % (MAX_LAYERS + 2), before = 0, after_len = 0;
    int hadlen = akv_context_length(c, &before) == AKV_OK;
    const uint8_t *kr = b & 0x20 ? NULL : g_rows[layer % MAX_LAYERS] + off;
    const uint8_t *vr = g_rows[(layer + 2) % MAX_LAYERS] + off + 1;
    akv_status st = akv_context_append_layer(c, layer, n, kr, vr);
    expect_mut(s, failed, "akv_context_append_layer", st,
               OKS | BH | IA | S(AKV_ERR_CAPACITY) | S(AKV_ERR_IN_USE) | QU);
    expect_dead_refused(s, "akv_context_append_layer", c, st);
    if (hadlen && (akv_context_length(c, &after_len) != AKV_OK || after_len < before ||
                   (st != AKV_OK && after_len != before) || after_len > before + n)) {
      fprintf(stderr, "fuzz_api: akv_context_append_layer (%s) moved the length %u -> %u\n",
              akv_status_string(st), before, after_len);
      abort();
    }
    if (st == AKV_OK && slot >= 0) {
      if (layer >= s->layers) abort();
      if (g_known[slot]) {
        uint32_t mn = UINT32_MAX;
        shadow_append(s, c, layer, n, kr, vr);
        for (uint32_t l = 0; l < s->layers; l++)
          if (g_shadow_n[slot][l] < mn) mn = g_shadow_n[slot][l];
        if (mn != after_len) {
          fprintf(stderr, "fuzz_api: length %u, the layers' minimum is %u\n", after_len, mn);
          abort();
        }
      }
    }
    return;
  }
  if (slot >= 0)
    for (uint32_t l = 0; l < s->layers; l++) held[l] = g_shadow_n[slot][l];
  akv_status st = akv_context_append(c, n, b == 2 ? NULL : k, b == 3 ? NULL : v);
  expect_mut(s, failed, "akv_context_append", st,
             OKS | BH | IA | S(AKV_ERR_CAPACITY) | S(AKV_ERR_IN_USE) | QU);
  expect_dead_refused(s, "akv_context_append", c, st);
  if (slot >= 0 && g_known[slot]) {
    if (st == AKV_OK) {
      for (uint32_t l = 0; l < s->layers; l++) shadow_append(s, c, l, n, k[l], v[l]);
    } else {
      /* A refused append appends nothing on any layer: the row after the
       * last held one of every layer is still out of range. */
      for (uint32_t l = 0; l < s->layers; l++) {
        after[l] = held[l];
        static uint8_t kb[ROW_MAX], vb[ROW_MAX];
        if (akv_context_read(c, l, held[l], 1, kb, vb) == AKV_OK) after[l]++;
        if (after[l] != held[l]) {
          fprintf(stderr, "fuzz_api: a refused append (%s) left rows on layer %u\n",
                  akv_status_string(st), l);
          abort();
        }
      }
    }
  }
}

static void op_read(state *s, input *in) {
  static uint8_t k[(MAX_TOKENS + 1) * ROW_MAX], v[(MAX_TOKENS + 1) * ROW_MAX];
  akv_context *c = pick_ctx(s, in);
  uint32_t layer = byte(in) % (MAX_LAYERS + 2);
  uint32_t first = byte(in) % 80, n = byte(in) % 80;
  uint8_t b = byte(in);
  uint32_t off = b & 0x40 ? 1 : 0; /* a misaligned output pointer: rows are bytes */
  int slot = ctx_slot(s, c);
  if (b == 0xff) n = UINT32_MAX; /* first + n overflows 32 bits */
  if (b == 0xfe) first = UINT32_MAX;
  if (b == 0xfd) n = UINT32_MAX - first + 1; /* first + n wraps to 0 */
  memset(k, 0xa5, sizeof(k));
  memset(v, 0x5a, sizeof(v));
  akv_status st = akv_context_read(c, layer, first, n, b == 1 ? NULL : k + off, b == 2 ? NULL : v + off);
  expect("akv_context_read", st, OKS | BH | IA | S(AKV_ERR_IN_USE));
  expect_dead_refused(s, "akv_context_read", c, st);
  if (st == AKV_OK && slot >= 0 && g_known[slot]) {
    /* What comes back is what was written, within the rows the layer holds. */
    if (layer >= s->layers || (uint64_t)first + n > g_shadow_n[slot][layer]) {
      fprintf(stderr, "fuzz_api: read of rows %u+%u of layer %u succeeded; it holds %u\n", first,
              n, layer, layer < MAX_LAYERS ? g_shadow_n[slot][layer] : 0);
      abort();
    }
    for (uint32_t t = 0; t < n; t++)
      if ((b != 1 && memcmp(k + off + (size_t)t * s->row, g_shadow[slot][layer][first + t][0], s->row) != 0) ||
          (b != 2 && memcmp(v + off + (size_t)t * s->row, g_shadow[slot][layer][first + t][1], s->row) != 0)) {
        fprintf(stderr, "fuzz_api: row %u of layer %u read back differently\n", first + t, layer);
        abort();
      }
  }
  if (st == AKV_OK && b != 1 && n < MAX_TOKENS && k[off + (size_t)n * s->row] != 0xa5) {
    fprintf(stderr, "fuzz_api: read wrote past %u rows\n", n);
    abort();
  }
  if (st != AKV_OK) {
    /* A refused read writes nothing. */
    if (!all_bytes(k, sizeof(k), 0xa5) || !all_bytes(v, sizeof(v), 0x5a)) {
      fprintf(stderr, "fuzz_api: a refused read (%s) wrote its output\n", akv_status_string(st));
      abort();
    }
  }
}

static void op_small_diag(state *s, input *in) {
  akv_context *c = pick_ctx(s, in);
  uint32_t out;
  uint8_t b = byte(in);
  akv_status st = akv_context_length(c, b & 1 ? NULL : &out);
  expect("akv_context_length", st, OKS | BH | IA);
  expect_dead_refused(s, "akv_context_length", c, st);
  st = akv_context_id(c, b & 2 ? NULL : &out);
  expect("akv_context_id", st, OKS | BH | IA);
  expect_dead_refused(s, "akv_context_id", c, st);
}

static void op_step_begin(state *s, input *in, int failed) {
  akv_context *list[6];
  uint32_t n = byte(in) % 6;
  uint8_t b = byte(in);
  akv_engine_info i0, i1;
  akv_status st;
  for (uint32_t i = 0; i < n; i++) list[i] = pick_ctx(s, in);
  if (akv_engine_info_get(s->e, &i0) != AKV_OK) abort();
  if (b == 0x66) {
    for (uint32_t i = n; i < 6; i++) list[i] = s->ctx[i % N_CTX];
    n = UINT32_MAX - byte(in); /* past concurrency: refused before the list is read */
  }
  st = akv_step_begin(s->e, b == 7 ? NULL : list, n);
  if (b == 0x66 && st == AKV_OK) abort();
  expect_mut(s, failed, "akv_step_begin", st,
             OKS | BH | IA | S(AKV_ERR_STEP_STATE) | S(AKV_ERR_CAPACITY) |
                 S(AKV_ERR_UNEVEN_LAYERS) | BE | QU);
  /* The rows these contexts gain in a step the fuzzer drives are unknown. */
  if (st == AKV_OK)
    for (uint32_t i = 0; i < n; i++) shadow_taint(s, list[i]);
  if (akv_engine_info_get(s->e, &i1) != AKV_OK) abort();
  /* A refused boundary enqueues and copies nothing (a backend failure aside). */
  if (st != AKV_OK && st != AKV_ERR_BACKEND &&
      (i1.bytes_h2d != i0.bytes_h2d || i1.copies_h2d != i0.copies_h2d || i1.steps != i0.steps ||
       i1.bytes_d2d != i0.bytes_d2d)) {
    fprintf(stderr, "fuzz_api: a refused step_begin (%s) moved the engine's counters\n",
            akv_status_string(st));
    abort();
  }
}

static void op_lease_begin(state *s, input *in, int failed) {
  akv_lease *ls = NULL;
  uint8_t b = byte(in);
  uint32_t layer = b & 0x80 ? u32(in) : b % (MAX_LAYERS + 1);
  akv_status st = akv_lease_begin(b == 0x7f ? (akv_engine *)s->bogus : s->e, layer,
                                  b == 0x7e ? NULL : &ls);
  expect_mut(s, failed, "akv_lease_begin", st,
             OKS | BH | IA | S(AKV_ERR_STEP_STATE) | S(AKV_ERR_LEASE_ORDER) | BE | QU);
  if (st == AKV_OK) keep_lease(s, ls);
}

static void op_wait_ready(state *s, input *in, int failed) {
  akv_view view;
  akv_lease *ls = pick_lease(s, in);
  akv_stream st = pick_stream(s, in);
  uint8_t b = byte(in);
  akv_status r = akv_lease_wait_ready(ls, st, b == 1 ? NULL : &view);
  expect_mut(s, failed, "akv_lease_wait_ready", r, OKS | BH | IA | S(AKV_ERR_LEASE_STATE) | BE | QU);
  expect_dead_lease_refused(s, "akv_lease_wait_ready", ls, r);
}

static void op_mark_consumed(state *s, input *in, int failed) {
  akv_fence f;
  akv_lease *ls = pick_lease(s, in);
  akv_stream st = pick_stream(s, in);
  uint8_t b = byte(in);
  akv_status r = akv_lease_mark_consumed(ls, st, b == 1 ? NULL : &f);
  expect_mut(s, failed, "akv_lease_mark_consumed", r,
             OKS | BH | IA | S(AKV_ERR_LEASE_STATE) | BE | QU);
  expect_dead_lease_refused(s, "akv_lease_mark_consumed", ls, r);
  if (r == AKV_OK) keep_fence(s, f);
}

static void op_attend(state *s, input *in, int failed) {
  akv_fence f;
  akv_lease *ls = pick_lease(s, in);
  akv_stream st = pick_stream(s, in);
  uint8_t b = byte(in);
  akv_status r;
  s->hook_mode = b < 200 ? 0 : b < 240 ? 1 : 2;
  r = akv_lease_attend(ls, st, b == 1 ? NULL : hook, s, b == 2 ? NULL : &f);
  expect_mut(s, failed, "akv_lease_attend", r, OKS | BH | IA | S(AKV_ERR_LEASE_STATE) | BE | QU);
  expect_dead_lease_refused(s, "akv_lease_attend", ls, r);
  if (r == AKV_OK) keep_fence(s, f);
}

static void op_write_back(state *s, input *in, int failed) {
  akv_context *owners[8];
  akv_fence f;
  akv_lease *ls = pick_lease(s, in);
  uint8_t b = byte(in);
  uint32_t n = b % 5;
  akv_status r;
  for (uint32_t i = 0; i < n; i++) owners[i] = pick_ctx(s, in);
  if (b == 0x44) {
    /* a count far past the array: refused from the lease's own size */
    for (uint32_t i = 0; i < 8; i++) owners[i] = s->ctx[i % N_CTX];
    n = UINT32_MAX - (b & 1);
  }
  r = akv_lease_write_back(ls, (b & 0x80) ? NULL : owners, (b & 0x80) ? (b & 0x40 ? 1 : 0) : n,
                           b == 0x20 ? NULL : &f);
  if (b == 0x44 && r == AKV_OK) abort();
  expect_mut(s, failed, "akv_lease_write_back", r,
             OKS | BH | IA | S(AKV_ERR_LEASE_STATE) | S(AKV_ERR_OWNER_MISMATCH) | BE | QU);
  expect_dead_lease_refused(s, "akv_lease_write_back", ls, r);
  if (r == AKV_OK) keep_fence(s, f);
}

static void op_seal(state *s, input *in, int failed) {
  akv_lease *ls = pick_lease(s, in);
  akv_fence tail = pick_fence(s, in), attn = pick_fence(s, in);
  akv_status r = akv_lease_seal(ls, tail, attn);
  expect_mut(s, failed, "akv_lease_seal", r,
             OKS | BH | S(AKV_ERR_LEASE_STATE) | S(AKV_ERR_FENCE_MISMATCH) | QU);
  expect_dead_lease_refused(s, "akv_lease_seal", ls, r);
}

static void op_retire(state *s, input *in, int failed) {
  akv_receipt r;
  akv_lease *ls = pick_lease(s, in);
  uint8_t b = byte(in);
  if (b & 2) {
    /* The non-blocking form: also "not yet", which changes nothing. */
    akv_status ts = akv_lease_try_retire(ls, b & 1 ? NULL : &r);
    expect_mut(s, failed, "akv_lease_try_retire", ts,
               OKS | BH | S(AKV_ERR_LEASE_STATE) | S(AKV_ERR_NOT_READY) | BE | QU);
    expect_dead_lease_refused(s, "akv_lease_try_retire", ls, ts);
    if (ts == AKV_OK) mark_lease_dead(s, ls);
    return;
  }
  akv_status st = akv_lease_retire(ls, b & 1 ? NULL : &r);
  expect_mut(s, failed, "akv_lease_retire", st, OKS | BH | S(AKV_ERR_LEASE_STATE) | BE | QU);
  expect_dead_lease_refused(s, "akv_lease_retire", ls, st);
  if (st == AKV_OK) mark_lease_dead(s, ls);
}

static void op_quarantine(state *s, input *in) {
  akv_quarantine_report q;
  uint8_t b = byte(in);
  akv_status st = akv_engine_quarantine(b == 9 ? (akv_engine *)s->bogus : s->e, b & 1 ? NULL : &q);
  expect("akv_engine_quarantine", st, OKS | BH | S(AKV_ERR_UNCERTAIN_FENCE));
  if (st == AKV_OK && b != 9) mark_all_leases_dead(s); /* released: dead handles */
  if (st == AKV_OK && b != 9) {
    akv_engine_info info;
    expect("akv_engine_info_get", akv_engine_info_get(s->e, &info), OKS);
    if (!info.quarantined || !info.transport_failed) {
      fprintf(stderr, "fuzz_api: quarantine succeeded but the engine is not quarantined\n");
      abort();
    }
  }
}

static void op_destroy(state *s, input *in) {
  uint8_t b = byte(in);
  akv_status st;
  if (b == 3) {
    expect("akv_engine_destroy", akv_engine_destroy(NULL), BH);
    expect("akv_engine_destroy", akv_engine_destroy((akv_engine *)s->bogus), BH);
    expect("akv_engine_destroy", akv_engine_destroy((akv_engine *)s->ctx[0]), BH);
    return;
  }
  if (b & 1) streams_destroy_all(s, 0);
  st = akv_engine_destroy(s->e);
  expect("akv_engine_destroy", st, OKS | S(AKV_ERR_BUSY));
  if (st == AKV_OK) {
    forget_engine(s);
    engine_new(s, in);
  }
}

static void op_diagnostics(state *s, input *in) {
  akv_engine_info info;
  uint64_t counters[AKV_ADM_RULE_COUNT + 2];
  akv_adm_decision log[16];
  char buf[300];
  size_t n = 0;
  uint8_t b = byte(in);
  uint32_t cap = byte(in) % 17;
  expect("akv_engine_info_get", akv_engine_info_get(s->e, b == 1 ? NULL : &info), OKS | IA);
  if (akv_engine_last_error(s->e) == NULL || akv_engine_last_error(NULL) == NULL) abort();
  expect("akv_admission_counters",
         akv_admission_counters(s->e, b == 2 ? NULL : counters,
                                b == 6 ? SIZE_MAX : byte(in) % (AKV_ADM_RULE_COUNT + 2)),
         OKS | IA);
  expect("akv_admission_log", akv_admission_log(s->e, b == 3 ? NULL : log, cap, b == 4 ? NULL : &n),
         OKS | IA);
  if (n > cap) abort();
  {
    size_t cap2 = byte(in) % sizeof(buf);
    akv_status st;
    memset(buf, 0x77, sizeof(buf));
    st = akv_admission_explain(s->e, (b & 8) ? NULL : pick_ctx(s, in), b == 5 ? NULL : buf, cap2);
    expect("akv_admission_explain", st, OKS | BH | IA);
    /* NUL-terminated within cap, nothing written past it */
    if (st == AKV_OK && (memchr(buf, 0, cap2) == NULL || (cap2 < sizeof(buf) && buf[cap2] != 0x77))) {
      fprintf(stderr, "fuzz_api: akv_admission_explain overran or did not terminate (cap %zu)\n", cap2);
      abort();
    }
    if (st == AKV_OK && cap2 == 0) abort();
  }
  if (akv_version_string() == NULL || akv_version_number() == 0) abort();
  expect("akv_engine_info_get", akv_engine_info_get((akv_engine *)s->bogus, &info), BH);
  if (akv_status_string((akv_status)byte(in)) == NULL) abort();
  if (akv_adm_rule_string((akv_adm_rule)byte(in)) == NULL) abort();
}

/* Headroom calls: release (any size, mid-step included), take, get. A
 * release inside a step frees nothing until the step ends; outside a step
 * nothing is left pending. */
static void op_headroom(state *s, input *in, int failed) {
  akv_headroom_info a, b;
  uint64_t now_b = 0, pend_b = 0, taken = 0;
  uint8_t k = byte(in);
  uint64_t bytes = (k & 4) ? UINT64_MAX : (uint64_t)u32(in) << (byte(in) % 24);
  akv_engine *e = (k & 0xF0) == 0xF0 ? (akv_engine *)s->bogus : s->e;
  int have = akv_headroom_get(s->e, &a) == AKV_OK;
  switch (k % 3) {
    case 0: {
      akv_status st = akv_headroom_release(e, bytes, (k & 8) ? NULL : &now_b, &pend_b);
      expect_mut(s, failed, "akv_headroom_release", st,
                 OKS | BH | S(AKV_ERR_NOT_SUPPORTED) | QU);
      if (st != AKV_OK && have && akv_headroom_get(s->e, &b) == AKV_OK &&
          memcmp(&a, &b, sizeof(a)) != 0) {
        fprintf(stderr, "fuzz_api: a refused akv_headroom_release (%s) changed the headroom\n",
                akv_status_string(st));
        abort();
      }
      if (st == AKV_OK && have && akv_headroom_get(s->e, &b) == AKV_OK) {
        /* Mid-step: memory still allocated; outside: freed at once. */
        if (pend_b > 0 && b.bytes != a.bytes) abort();
        if (now_b > 0 && b.bytes + now_b != a.bytes) abort();
        if (pend_b > 0 && now_b > 0) abort();
      }
      break;
    }
    case 1: {
      akv_status st = akv_headroom_take(e, bytes, (k & 8) ? NULL : &taken);
      expect_mut(s, failed, "akv_headroom_take", st,
                 OKS | BH | S(AKV_ERR_NOT_SUPPORTED) | S(AKV_ERR_STEP_STATE) | QU);
      if (have && akv_headroom_get(s->e, &b) == AKV_OK) {
        if (st != AKV_OK && memcmp(&a, &b, sizeof(a)) != 0) {
          fprintf(stderr, "fuzz_api: a refused akv_headroom_take (%s) changed the headroom\n",
                  akv_status_string(st));
          abort();
        }
        if (st == AKV_OK && !(k & 8) && (b.bytes != a.bytes + taken || b.pages < a.pages ||
                                          b.pages > b.max_pages)) {
          fprintf(stderr, "fuzz_api: akv_headroom_take said %llu bytes, the headroom moved %llu -> %llu\n",
                  (unsigned long long)taken, (unsigned long long)a.bytes, (unsigned long long)b.bytes);
          abort();
        }
      }
      break;
    }
    default:
      expect("akv_headroom_get", akv_headroom_get(e, (k & 8) ? NULL : &b), OKS | BH | IA);
      break;
  }
}

static void op_streams(state *s, input *in, int failed) {
  uint8_t b = byte(in) % 6;
  akv_stream st = NULL;
  akv_status r;
  switch (b) {
    case 0: {
      int slot = -1;
      for (int i = 0; i < N_STREAM; i++)
        if (s->streams[i] == NULL) slot = i;
      r = akv_stream_create(s->e, byte(in) == 1 ? NULL : &st);
      expect_mut(s, failed, "akv_stream_create", r, OKS | BH | IA | S(AKV_ERR_OUT_OF_MEMORY) | BE | QU);
      if (r == AKV_OK) {
        if (slot < 0) abort(); /* the engine hands out at most 8; we keep 10 */
        s->streams[slot] = st;
        s->launched[slot] = 0;
        __atomic_store_n(&s->ran[slot], 0, __ATOMIC_RELEASE);
      }
      break;
    }
    case 1: {
      int i = byte(in) % N_STREAM;
      if (s->streams[i] == NULL || i == 0) break; /* keep streams[0] for the legal steps */
      r = akv_stream_destroy(s->e, s->streams[i]);
      /* a stream an unretired lease used stays (AKV_ERR_IN_USE) */
      expect("akv_stream_destroy", r, OKS | S(AKV_ERR_IN_USE));
      if (r != AKV_OK) break;
      if (!failed && __atomic_load_n(&s->ran[i], __ATOMIC_ACQUIRE) != s->launched[i]) {
        fprintf(stderr, "fuzz_api: stream destroyed with %u of %u host functions run\n",
                __atomic_load_n(&s->ran[i], __ATOMIC_ACQUIRE), s->launched[i]);
        abort();
      }
      if (s->n_stale < N_STREAM) s->stale[s->n_stale++] = s->streams[i];
      s->streams[i] = NULL;
      break;
    }
    case 2:
      expect("akv_stream_destroy",
             akv_stream_destroy(s->e, byte(in) & 1 ? NULL : (akv_stream)s->bogus), IA | BH);
      break;
    case 3:
      expect_mut(s, failed, "akv_stream_synchronize", akv_stream_synchronize(s->e, pick_stream(s, in)),
                 OKS | BH | IA | BE | QU);
      break;
    case 4: {
      /* What was enqueued runs, once, before synchronize or destroy returns. */
      int i = byte(in) % N_STREAM;
      akv_stream target = (byte(in) & 3) == 0 ? pick_stream(s, in) : s->streams[i];
      int mine = target != NULL && target == s->streams[i];
      uint8_t k = byte(in);
      r = akv_stream_launch_host(s->e, target, k & 1 ? NULL : count_fn,
                                 mine ? &s->ran[i] : &g_ran_other);
      expect_mut(s, failed, "akv_stream_launch_host", r, OKS | BH | IA | BE | QU);
      if (r == AKV_OK && (k & 1)) abort();
      if (r == AKV_OK && mine) s->launched[i]++;
      if (mine && (k & 2)) {
        r = akv_stream_synchronize(s->e, target);
        expect_mut(s, failed, "akv_stream_synchronize", r, OKS | BE | QU);
        if (r == AKV_OK && __atomic_load_n(&s->ran[i], __ATOMIC_ACQUIRE) != s->launched[i]) {
          fprintf(stderr, "fuzz_api: synchronize returned with %u of %u host functions run\n",
                  __atomic_load_n(&s->ran[i], __ATOMIC_ACQUIRE), s->launched[i]);
          abort();
        }
      }
      break;
    }
    default:
      expect_mut(s, failed, "akv_stream_synchronize", akv_stream_synchronize(s->e, NULL),
                 BH | IA | QU);
      break;
  }
}

static void op_config(state *s, input *in) {
  akv_engine_config ec = base_config(1 + byte(in) % 4, 1 + byte(in) % 8, byte(in) & 1);
  akv_fit_report rep;
  akv_engine *e2 = NULL;
  akv_status st;
  uint8_t b = byte(in);
  switch (b % 12) {
    case 0: ec.struct_size = byte(in); break;
    case 1: ec.version = byte(in); break;
    case 2: ec.n_dense_layers = 0; break;
    case 3: ec.kv_heads = u32(in); ec.head_dim = u32(in); break;
    case 4: ec.max_tokens = u32(in); break;
    case 5: ec.page_tokens = byte(in) & 1 ? 0 : u32(in); break;
    case 6: ec.host_pool_gib = byte(in) % 2; ec.max_contexts = u32(in); break;
    case 7: ec.backend = (akv_backend_kind)(byte(in) % 4); break;
    case 8: ec.dtype = (akv_dtype)(byte(in) % 6); break; /* 5: not an akv_dtype */
    case 9: ec.fit_mode = (akv_fit_mode)(byte(in) % 3); ec.host_pool_gib = 0; break;
    case 10: ec.route = (akv_route)(byte(in) % 3); break;
    default: ec.device_pool_gib = byte(in) % 3; ec.page_tokens = 16 + byte(in) % 64; break;
  }
  expect("akv_fit", akv_fit(b & 0x80 ? NULL : &ec, b & 0x40 ? NULL : &rep),
         OKS | IA | S(AKV_ERR_CONFIG));
  expect("akv_engine_config_init", akv_engine_config_init(NULL), IA);
  if (b % 12 == 0 && (b & 0x10)) {
    /* an older caller's shorter config: it ends at a field boundary (a
     * config only grows at its end), and only struct_size bytes exist */
#define END(f) (offsetof(akv_engine_config, f) + sizeof(((akv_engine_config *)0)->f))
    static const size_t ends[] = {END(version), END(backend), END(device_ordinal),
                                  END(n_dense_layers), END(kv_heads), END(head_dim), END(dtype),
                                  END(max_tokens), END(page_tokens), END(host_pool_gib),
                                  END(device_pool_gib), END(max_contexts), END(fit_mode),
                                  END(route), END(log_fn), END(log_user), END(log_level),
                                  END(host_delay_seed), END(host_delay_max_us),
                                  END(fault_fail_nth)};
#undef END
    akv_engine_config *shorter;
    ec.struct_size = (uint32_t)ends[byte(in) % (sizeof(ends) / sizeof(ends[0]))];
    shorter = malloc(ec.struct_size);
    if (shorter == NULL) abort();
    memcpy(shorter, &ec, ec.struct_size);
    expect("akv_fit", akv_fit(shorter, &rep), OKS | S(AKV_ERR_CONFIG));
    st = akv_engine_create(shorter, &e2);
    free(shorter);
    expect("akv_engine_create", st,
           OKS | IA | S(AKV_ERR_CONFIG) | S(AKV_ERR_NO_FIT) | S(AKV_ERR_OUT_OF_MEMORY) |
               S(AKV_ERR_NOT_SUPPORTED) | BE);
    if (st == AKV_OK) s->creates_since++;
    if (st == AKV_OK) expect("akv_engine_destroy", akv_engine_destroy(e2), OKS);
    return;
  }
  /* creation only where the sizes stay small: geometry as given above, or
   * the cases that must be refused before anything is allocated */
  if (b % 12 == 3 || b % 12 == 4 || b % 12 == 6 || b % 12 == 11) return;
  st = akv_engine_create(&ec, b & 0x20 ? NULL : &e2);
  expect("akv_engine_create", st,
         OKS | IA | S(AKV_ERR_CONFIG) | S(AKV_ERR_NO_FIT) | S(AKV_ERR_OUT_OF_MEMORY) |
             S(AKV_ERR_NOT_SUPPORTED) | BE);
  if (st == AKV_OK) s->creates_since++;
  if (st == AKV_OK) expect("akv_engine_destroy", akv_engine_destroy(e2), OKS);
}

/* One whole legal step over the open contexts that have room. */
static void op_legal_step(state *s, int failed) {
  akv_context *list[N_CTX];
  akv_lease *ls[MAX_LAYERS] = {0};
  uint32_t n = 0, len;
  akv_status st;
  for (int i = 0; i < N_CTX && n < s->max_ctx; i++) {
    int dup = 0;
    if (s->ctx[i] == NULL || akv_context_length(s->ctx[i], &len) != AKV_OK || len + 1 >= MAX_TOKENS)
      continue;
    for (uint32_t j = 0; j < n; j++) dup |= list[j] == s->ctx[i];
    if (!dup) list[n++] = s->ctx[i];
  }
  if (n == 0 || s->streams[0] == NULL) return;
  for (uint32_t i = 0; i < n; i++) {
    int slot = ctx_slot(s, list[i]);
    if (slot >= 0 && g_known[slot])
      for (uint32_t l = 0; l < s->layers; l++)
        if (g_shadow_n[slot][l] != g_shadow_n[slot][0]) return; /* uneven: refused */
  }
  st = akv_step_begin(s->e, list, n);
  expect_mut(s, failed, "akv_step_begin", st,
             OKS | BH | IA | S(AKV_ERR_STEP_STATE) | S(AKV_ERR_CAPACITY) |
                 S(AKV_ERR_UNEVEN_LAYERS) | BE | QU);
  if (st != AKV_OK) return;
  s->hook_mode = 0;
  for (uint32_t l = 0; l < s->layers; l++) {
    akv_fence attn, tail;
    st = akv_lease_begin(s->e, l, &ls[l]);
    expect("akv_lease_begin", st, OKS | BE);
    if (st != AKV_OK) goto bail;
    keep_lease(s, ls[l]);
    st = akv_lease_attend(ls[l], s->streams[0], hook, s, &attn);
    expect("akv_lease_attend", st, OKS | BE);
    if (st != AKV_OK) goto bail;
    st = akv_lease_write_back(ls[l], NULL, 0, &tail);
    expect("akv_lease_write_back", st, OKS | BE);
    if (st != AKV_OK) goto bail;
    keep_fence(s, tail);
    keep_fence(s, attn);
    expect("akv_lease_seal", akv_lease_seal(ls[l], tail, attn), OKS);
    if (l >= 1) {
      st = akv_lease_retire(ls[l - 1], NULL);
      expect("akv_lease_retire", st, OKS | BE);
      if (st != AKV_OK) goto bail;
      mark_lease_dead(s, ls[l - 1]);
    }
  }
  st = akv_lease_retire(ls[s->layers - 1], NULL);
  expect("akv_lease_retire", st, OKS | BE);
  if (st != AKV_OK) goto bail;
  mark_lease_dead(s, ls[s->layers - 1]);
  expect("akv_step_end", akv_step_end(s->e), OKS);
  /* Each context gained the row the hook wrote: K bytes i+1, V bytes i+2. */
  for (uint32_t i = 0; i < n; i++) {
    int slot = ctx_slot(s, list[i]);
    if (slot < 0 || !g_known[slot]) continue;
    for (uint32_t l = 0; l < s->layers; l++) {
      uint32_t t = g_shadow_n[slot][l]++;
      memset(g_shadow[slot][l][t][0], (int)i + 1, s->row);
      memset(g_shadow[slot][l][t][1], (int)i + 2, s->row);
    }
  }
  return;
bail:
  /* A failure leaves the step to the fuzzer: these rows are not known. */
  for (uint32_t i = 0; i < n; i++) shadow_taint(s, list[i]);
}

/* The handles of the engine destroyed last: every call with them answers
 * AKV_ERR_BAD_HANDLE, changing nothing, while fewer creates than
 * AKV_ENGINE_HANDLE_REUSE_MIN followed (its contexts and leases died with
 * it; within one input their own bounds are never reached: an input makes
 * at most 200 calls). */
static void op_dead_engine(state *s, input *in) {
  akv_engine_info info;
  akv_context *c = s->old_ctx[byte(in) % N_CTX], *list[1];
  akv_lease *ls = s->old_lease[byte(in) % N_LEASE];
  akv_lease *out = NULL;
  akv_context *co = NULL;
  akv_stream st = s->streams[0];
  akv_fence f = {0};
  uint32_t v = 0;
  size_t n = 0;
  char buf[32];
  if (s->old_e == NULL || s->creates_since >= AKV_ENGINE_HANDLE_REUSE_MIN) return;
  list[0] = c;
  expect("akv_engine_info_get", akv_engine_info_get(s->old_e, &info), BH);
  expect("akv_engine_destroy", akv_engine_destroy(s->old_e), BH);
  expect("akv_engine_quarantine", akv_engine_quarantine(s->old_e, NULL), BH);
  expect("akv_context_open", akv_context_open(s->old_e, NULL, &co), BH);
  expect("akv_step_begin", akv_step_begin(s->old_e, list, 1), BH);
  expect("akv_step_end", akv_step_end(s->old_e), BH);
  expect("akv_lease_begin", akv_lease_begin(s->old_e, 0, &out), BH);
  expect("akv_stream_create", akv_stream_create(s->old_e, &st), BH);
  expect("akv_stream_destroy", akv_stream_destroy(s->old_e, st), BH);
  expect("akv_stream_synchronize", akv_stream_synchronize(s->old_e, st), BH);
  expect("akv_stream_launch_host", akv_stream_launch_host(s->old_e, st, noop_fn, NULL), BH);
  expect("akv_admission_log", akv_admission_log(s->old_e, NULL, 0, &n), BH);
  expect("akv_admission_explain", akv_admission_explain(s->old_e, NULL, buf, sizeof(buf)), BH);
  if (strcmp(akv_engine_last_error(s->old_e), "bad engine handle") != 0) abort();
  if (co != NULL || out != NULL || st != s->streams[0]) abort(); /* outputs untouched */
  if (c != NULL) {
    expect("akv_context_length", akv_context_length(c, &v), BH);
    expect("akv_context_id", akv_context_id(c, &v), BH);
    expect("akv_context_close", akv_context_close(c), BH);
    expect("akv_context_read", akv_context_read(c, 0, 0, 0, NULL, NULL), BH);
    expect("akv_context_append", akv_context_append(c, 0, NULL, NULL), BH);
    if (s->e != NULL)
      expect("akv_admission_explain", akv_admission_explain(s->e, c, buf, sizeof(buf)), BH);
  }
  if (ls != NULL) {
    expect("akv_lease_retire", akv_lease_retire(ls, NULL), BH);
    expect("akv_lease_seal", akv_lease_seal(ls, f, f), BH);
    expect("akv_lease_attend", akv_lease_attend(ls, st, hook, s, &f), BH);
    expect("akv_lease_write_back", akv_lease_write_back(ls, NULL, 0, &f), BH);
  }
}

/* ------------------------------------------------- reference attention */

static void *xmalloc(size_t n) {
  void *p = malloc(n > 0 ? n : 1);
  if (p == NULL) abort();
  return p;
}

static float pick_scale(input *in) {
  static const float v[8] = {1.0f, 0.5f, 2.0f, 1e-40f, 3e38f, 0.125f, 7.0f, 1e-3f};
  return v[byte(in) % 8];
}

/* The reference entry points over buffers the harness sized: a clean call
 * must succeed and give the same bits again, with page overrides (the
 * overridden rows poisoned with NaN at their old place) and through the
 * paged variant with page_tokens == chunk_tokens; a call with one hostile
 * argument (misaligned q/out/workspace, short workspace or row, bad scales,
 * row offsets past ptrdiff_t, bad page tables) must be refused and leave
 * out untouched. */
static void op_attention(input *in) {
  static const uint32_t hds[8] = {1, 2, 3, 8, 16, 64, 128, 256};
  static const akv_dtype dts[8] = {AKV_DTYPE_BF16, AKV_DTYPE_BF16, AKV_DTYPE_FP8_E4M3,
                                   AKV_DTYPE_FP8_E5M2, AKV_DTYPE_BF16, AKV_DTYPE_F16,
                                   AKV_DTYPE_F32, (akv_dtype)7};
  akv_attention_args a;
  uint8_t b0 = byte(in), b1 = byte(in), b2 = byte(in), hostile = byte(in);
  akv_dtype dt = dts[b0 % 8];
  int supported = dt == AKV_DTYPE_BF16 || dt == AKV_DTYPE_FP8_E4M3 || dt == AKV_DTYPE_FP8_E5M2;
  uint32_t es = dt == AKV_DTYPE_F32 ? 4 : (dt == AKV_DTYPE_FP8_E4M3 || dt == AKV_DTYPE_FP8_E5M2) ? 1 : 2;
  uint32_t nc = 1 + (b0 >> 3) % 3, kv = 1 + (b0 >> 5) % 3, grp = 1 + b1 % 2;
  uint32_t hd = hds[(b1 >> 1) % 8];
  uint32_t chunk = 1 + byte(in) % 20, maxlen = 0, len[4] = {0}, need_len = 0;
  uint32_t nh = kv * grp;
  uint64_t rmin, rb, cs;
  size_t ws = 0, qn, on;
  uint8_t *kbuf, *vbuf, *qbuf, *obuf, *o2, *wbuf;
  float ks[3], vs[3];
  akv_status st;
  int hide = hostile % 24; /* >= 16: clean */
  if (b2 & 0x80 && hd <= 8) chunk = 256 + byte(in) % 400; /* pieces within a chunk */
  for (uint32_t i = 0; i < nc; i++) {
    len[i] = byte(in) % (chunk > 64 ? 700 : 48);
    if (len[i] > maxlen) maxlen = len[i];
  }
  rmin = (uint64_t)kv * hd * es;
  rb = rmin + (b2 & 7);
  cs = rb * maxlen + ((b2 >> 3) & 3);
  if (akv_attention_workspace_bytes(nc, nh, hd, maxlen, chunk, &ws) != AKV_OK) abort();
  {
    /* the workspace never shrinks as contexts or rows grow */
    size_t w2 = 0, w3 = 0;
    if (akv_attention_workspace_bytes(nc + 1, nh, hd, maxlen, chunk, &w2) != AKV_OK ||
        akv_attention_workspace_bytes(nc, nh, hd, maxlen + 1, chunk, &w3) != AKV_OK || w2 < ws ||
        w3 < ws)
      abort();
  }
  kbuf = xmalloc(cs * nc + 1);
  vbuf = xmalloc(cs * nc + 1);
  /* FP8: codes masked to 0x3f keep away from NaN mostly */
  fill_pattern(kbuf, cs * nc + 1, 7, b0, es == 1 ? 0x3f : 0xff);
  fill_pattern(vbuf, cs * nc + 1, 13, b1, es == 1 ? 0x3f : 0xff);
  qn = (size_t)nc * nh * hd * 2;
  on = (size_t)nc * nh * hd * 4;
  qbuf = xmalloc(qn + 2);
  for (size_t i = 0; i < qn + 2; i++) qbuf[i] = (uint8_t)(i % 2 ? 0x3f - (i % 3) : byte(in));
  obuf = xmalloc(on + 4);
  o2 = xmalloc(on + 4);
  wbuf = xmalloc(ws + 4);
  memset(obuf, 0x7b, on + 4);
  for (uint32_t g = 0; g < 3; g++) {
    ks[g] = pick_scale(in);
    vs[g] = pick_scale(in);
  }
  memset(&a, 0, sizeof(a));
  a.dtype = dt;
  a.n_contexts = nc;
  a.n_heads = nh;
  a.kv_heads = kv;
  a.head_dim = hd;
  a.chunk_tokens = chunk;
  a.scale = 1.0f / sqrtf((float)hd);
  a.q = qbuf;
  a.k_base = kbuf + (b2 & 0x40 ? 1 : 0); /* rows take any alignment */
  a.v_base = vbuf;
  a.context_stride = cs;
  a.row_bytes = rb;
  a.len = len;
  a.out = (float *)obuf;
  a.workspace = wbuf;
  a.workspace_bytes = ws + (b2 >> 5 & 1);
  if (es == 1 || (b1 & 0x40)) {
    a.k_scale = ks;
    a.v_scale = vs;
  }
  switch (hide) {
    case 0: a.q = qbuf + 1; break;
    case 1: a.out = (float *)(obuf + 2); break;
    case 2: a.workspace = wbuf + 2; break;
    case 3: if (ws > 0) a.workspace_bytes = ws - 1; else hide = 99; break;
    case 4: a.row_bytes = rmin - 1; break;
    case 5: a.scale = byte(in) & 1 ? NAN : -INFINITY; break;
    case 6: a.k_scale = byte(in) & 1 ? NULL : ks; a.v_scale = a.k_scale ? NULL : vs;
            if (a.k_scale == NULL && a.v_scale == NULL && es != 1) hide = 99;
            break;
    case 7: a.k_scale = ks; a.v_scale = vs;
            (byte(in) & 1 ? ks : vs)[byte(in) % kv] = (float[]){0.0f, -1.0f, NAN, INFINITY}[byte(in) % 4];
            break;
    case 8: /* row offsets of context 1 past ptrdiff_t */
      if (nc < 2) { hide = 99; break; }
      a.context_stride = (uint64_t)INT64_MAX + 1 + (byte(in) % 4);
      if (len[1] == 0) len[1] = 1;
      break;
    case 9: if (kv >= 2) a.n_heads = nh + 1; else a.n_heads = 0; break;
    case 10: a.head_dim = byte(in) & 1 ? 0 : AKV_ATTENTION_MAX_HEAD_DIM + 1; break;
    case 11: a.chunk_tokens = 0; break;
    case 12: a.n_contexts = 0; break;
    case 13: if (byte(in) & 1) a.len = NULL; else a.k_base = NULL; break;
    case 14: /* a page override past ptrdiff_t */
      if (len[0] == 0) { hide = 99; break; }
      {
        static uint32_t pm[4] = {0xFFFFFFF0u, 0xFFFFFFF0u, 0xFFFFFFF0u, 0xFFFFFFF0u};
        a.page_map = pm;
        a.page_map_stride = 1;
        a.k_pages = kbuf;
        a.v_pages = vbuf;
        a.page_stride = (uint64_t)1 << 40;
      }
      break;
    case 15: a.workspace_bytes = 0; a.workspace = NULL; if (ws == 0) hide = 99; break;
    default: hide = 99; break;
  }
  /* A clean call whose score factor (scale * log2(e) * k_scale[g]) overflows
   * fp32 is hostile too (pick_scale's 3e38 with head_dim 1). */
  if (hide == 99 && a.k_scale != NULL)
    for (uint32_t g = 0; g < kv; g++)
      if (!isfinite(a.scale * 1.44269504088896340736f * a.k_scale[g])) hide = 16;
  if (!supported && hide == 99) hide = 98;
  for (uint32_t i = 0; i < nc; i++) need_len = len[i] > need_len ? len[i] : need_len;
  st = akv_attention_ref_bf16(&a);
  if (hide < 98 || hide == 98) {
    if (st == AKV_OK) {
      fprintf(stderr, "fuzz_api: akv_attention_ref_bf16 took a hostile argument (%d)\n", hide);
      abort();
    }
    if (hide == 98 && st != AKV_ERR_NOT_SUPPORTED) abort();
    if (!all_bytes(obuf, on + 4, 0x7b)) {
      fprintf(stderr, "fuzz_api: a refused akv_attention_ref_bf16 wrote out\n");
      abort();
    }
    goto done;
  }
  if (st != AKV_OK) {
    fprintf(stderr, "fuzz_api: akv_attention_ref_bf16 refused a clean call: %s\n",
            akv_status_string(st));
    abort();
  }
  if (!all_bytes(obuf + on, 4, 0x7b)) abort(); /* wrote past out */
  /* the same bits again */
  a.out = (float *)o2;
  if (akv_attention_ref_bf16(&a) != AKV_OK || memcmp(o2, obuf, on) != 0) {
    fprintf(stderr, "fuzz_api: akv_attention_ref_bf16 is not deterministic\n");
    abort();
  }
  {
    /* Every chunk moved to a page of its own, in a shuffled order. */
    uint32_t nch[4], total = 0, pt = chunk, maxp = 0;
    uint64_t ps = (uint64_t)pt * rb + (b1 >> 7);
    uint32_t *perm, *pm, indptr[5], lastl[4];
    uint8_t *kp, *vp;
    akv_attention_paged_args pa;
    akv_page_table t;
    size_t pws = 0;
    uint8_t *pw, *o3;
    for (uint32_t i = 0; i < nc; i++) {
      nch[i] = len[i] / pt + (len[i] % pt != 0);
      total += nch[i];
      if (nch[i] > maxp) maxp = nch[i];
    }
    perm = xmalloc(sizeof(uint32_t) * (total + 1));
    pm = xmalloc(sizeof(uint32_t) * nc * (maxp + 1));
    for (uint32_t p = 0; p < total; p++) perm[p] = p;
    for (uint32_t p = total; p > 1; p--) {
      uint32_t r = byte(in) % p, x = perm[p - 1];
      perm[p - 1] = perm[r];
      perm[r] = x;
    }
    kp = xmalloc(ps * total + 1);
    vp = xmalloc(ps * total + 1);
    memset(kp, 0xff, ps * total + 1);
    memset(vp, 0xff, ps * total + 1);
    indptr[0] = 0;
    for (uint32_t i = 0, p = 0; i < nc; i++) {
      for (uint32_t c = 0; c < nch[i]; c++, p++) {
        uint32_t n = len[i] - c * pt < pt ? len[i] - c * pt : pt;
        for (uint32_t r = 0; r < n; r++) {
          memcpy(kp + perm[p] * ps + r * rb, (const uint8_t *)a.k_base + i * cs + (uint64_t)(c * pt + r) * rb, rmin);
          memcpy(vp + perm[p] * ps + r * rb, (const uint8_t *)a.v_base + i * cs + (uint64_t)(c * pt + r) * rb, rmin);
        }
      }
      indptr[i + 1] = indptr[i] + nch[i];
      lastl[i] = nch[i] ? len[i] - (nch[i] - 1) * pt : 0;
    }
    /* The paged variant over the same rows: the same bits. */
    memset(&pa, 0, sizeof(pa));
    pa.dtype = dt;
    pa.n_heads = nh;
    pa.kv_heads = kv;
    pa.head_dim = hd;
    pa.scale = a.scale;
    pa.q = a.q;
    pa.k_scale = a.k_scale;
    pa.v_scale = a.v_scale;
    memset(&t, 0, sizeof(t));
    t.batch = nc;
    t.page_tokens = pt;
    t.max_pages = maxp + (b2 >> 6 & 1);
    t.indptr = indptr;
    t.indices = perm;
    t.last_page_len = lastl;
    t.k_pages = kp;
    t.v_pages = vp;
    t.page_stride = ps;
    t.row_bytes = rb;
    if ((uint64_t)t.max_pages * pt <= UINT32_MAX &&
        akv_attention_workspace_bytes(nc, nh, hd, t.max_pages * pt, pt, &pws) == AKV_OK) {
      int bad = byte(in) % 8;
      uint32_t save_ip = indptr[0], save_l = lastl[0], save_mp = t.max_pages;
      pw = xmalloc(pws + 4);
      o3 = xmalloc(on);
      memset(o3, 0x7b, on);
      pa.workspace = pw;
      pa.workspace_bytes = pws;
      pa.out = (float *)o3;
      /* one hostile table field, or none */
      if (bad == 0) indptr[0] = 1;
      else if (bad == 1 && nch[0] > 0) lastl[0] = pt + 1;
      else if (bad == 2 && nch[0] > 0) lastl[0] = 0;
      else if (bad == 3 && maxp > 0) t.max_pages = maxp - 1;
      else bad = 99;
      st = akv_attention_paged_ref_bf16(&pa, t);
      if (bad != 99) {
        if (st == AKV_OK) {
          fprintf(stderr, "fuzz_api: akv_attention_paged_ref_bf16 took a bad table (%d)\n", bad);
          abort();
        }
        if (!all_bytes(o3, on, 0x7b)) abort();
      } else if (st != AKV_OK || memcmp(o3, obuf, on) != 0) {
        fprintf(stderr, "fuzz_api: paged reference (%s) differs from the contiguous one\n",
                akv_status_string(st));
        abort();
      }
      indptr[0] = save_ip;
      lastl[0] = save_l;
      t.max_pages = save_mp;
      free(pw);
      free(o3);
    }
    /* Page overrides: a chosen subset of chunks read from the pages, their
     * contiguous rows poisoned (NaN); the same bits. */
    if (maxp > 0) {
      uint32_t stride = maxp + (b1 >> 6 & 1);
      for (uint32_t i = 0, p = 0; i < nc; i++)
        for (uint32_t c = 0; c < stride; c++) {
          uint32_t *e = &pm[i * stride + c];
          *e = AKV_PAGE_STAGED;
          if (c < nch[i]) {
            if (byte(in) & 1) {
              uint32_t n = len[i] - c * pt < pt ? len[i] - c * pt : pt;
              *e = perm[p];
              for (uint32_t r = 0; r < n; r++) {
                memset((uint8_t *)a.k_base + i * cs + (uint64_t)(c * pt + r) * rb, 0xff, rmin);
                memset((uint8_t *)a.v_base + i * cs + (uint64_t)(c * pt + r) * rb, 0xff, rmin);
              }
            }
            p++;
          }
        }
      a.page_map = pm;
      a.page_map_stride = stride;
      a.k_pages = kp;
      a.v_pages = vp;
      a.page_stride = ps;
      memset(o2, 0x7b, on);
      st = akv_attention_ref_bf16(&a);
      if (st != AKV_OK || memcmp(o2, obuf, on) != 0) {
        fprintf(stderr, "fuzz_api: page overrides (%s) changed the result\n", akv_status_string(st));
        abort();
      }
    }
    free(perm);
    free(pm);
    free(kp);
    free(vp);
  }
done:
  (void)need_len;
  free(kbuf);
  free(vbuf);
  free(qbuf);
  free(obuf);
  free(o2);
  free(wbuf);
  {
    /* Hostile workspace sizes: refused or a size, never a wrap. */
    size_t w = 12345;
    uint32_t n = u32(in), h = u32(in), d = byte(in), m = u32(in), c = u32(in);
    st = akv_attention_workspace_bytes(n, h, d, m, c, byte(in) == 3 ? NULL : &w);
    expect("akv_attention_workspace_bytes", st, OKS | IA);
    if (st != AKV_OK && w != 12345) abort();
  }
  {
    /* Views no engine makes are refused, args untouched. */
    akv_view v;
    akv_attention_args x, y;
    uint8_t k = byte(in);
    memset(&v, 0, sizeof(v));
    v.base = (k & 1) ? NULL : (void *)&x;
    v.v_offset = (k & 2) ? UINT64_MAX - 3 : 64;
    if (k & 4) {
      v.page_map = (const uint32_t *)&y;
      v.pages = (k & 8) ? NULL : (const void *)&y;
      v.page_tokens = (k & 16) ? 0 : 16;
      v.page_map_stride = (k & 32) ? 0 : 2;
    }
    memset(&x, 0x3c, sizeof(x));
    y = x;
    st = akv_attention_args_from_view((k & 64) ? NULL : &v, (k & 128) ? NULL : &x);
    expect("akv_attention_args_from_view", st, OKS | IA);
    if (st != AKV_OK && memcmp(&x, &y, sizeof(x)) != 0) abort();
    if (st == AKV_OK && ((k & 0x43) || (k & 128) ||
                         ((k & 4) && ((k & 8) || (k & 16) || (k & 32))))) {
      fprintf(stderr, "fuzz_api: akv_attention_args_from_view took a view no engine makes\n");
      abort();
    }
  }
}

/* ------------------------------------------------------------- groups */

#define G_OPS 10
typedef struct grank {
  akv_group_world *w;
  akv_group *g;
  uint32_t rank, size;
  akv_engine_config shard;
  akv_group_config gc;
  uint8_t op[G_OPS], arg[G_OPS][4];
  int n_ops;
  akv_status create_st;
  akv_status st[G_OPS];     /* agreement statuses, compared across ranks */
  int agreed[G_OPS];        /* 1: an agreement point */
  akv_context *ctx[4];
  uint32_t id[G_OPS];       /* context ids of successful opens */
} grank;

static int g_hook_quiet(void *user, const akv_view *view, akv_stream stream) {
  (void)user;
  (void)view;
  (void)stream;
  return 0;
}

static void *grank_run(void *arg) {
  grank *r = arg;
  akv_engine *e = NULL;
  akv_stream stream = NULL;
  r->create_st = akv_group_create_inproc(&r->shard, &r->gc, r->w, &r->g);
  if (r->create_st != AKV_OK) return NULL;
  if (akv_group_engine(r->g, &e) != AKV_OK || e == NULL) abort();
  if (akv_stream_create(e, &stream) != AKV_OK) stream = NULL;
  for (int i = 0; i < r->n_ops; i++) {
    const uint8_t *a = r->arg[i];
    /* a[3] & 1 on rank 1: this rank's argument differs (a disagreement) */
    int differ = r->rank == 1 && (a[3] & 1);
    r->agreed[i] = 1;
    switch (r->op[i] % 6) {
      case 0: {
        akv_context_config cc = AKV_CONTEXT_CONFIG_INIT;
        akv_context *c = NULL;
        cc.target_pages = a[0] % 4 + (differ ? 1 : 0);
        cc.burst_pages = a[1] % 3;
        if (a[2] == 7) cc.version = 42;
        r->st[i] = akv_group_context_open(r->g, a[2] == 9 ? NULL : &cc, a[2] == 8 ? NULL : &c);
        if (r->st[i] == AKV_OK) {
          uint32_t id = 0;
          if (c == NULL || akv_context_id(c, &id) != AKV_OK) abort();
          r->ctx[a[0] % 4] = c;
          r->id[i] = id; /* the same id on every rank */
        }
        break;
      }
      case 1:
        r->st[i] = akv_group_context_close(r->g, r->ctx[(a[0] + differ) % 4]);
        if (r->st[i] == AKV_OK) r->ctx[(a[0] + differ) % 4] = NULL;
        break;
      case 2: {
        /* local: rows onto a context (a difference makes later steps disagree) */
        akv_context *c = r->ctx[a[0] % 4];
        uint32_t n = a[1] % 3 + (differ ? 1 : 0);
        const void *k[1] = {g_rows[0]};
        r->agreed[i] = 0;
        r->st[i] = akv_context_append(c, n, k, k);
        break;
      }
      case 3: {
        akv_context *list[4];
        uint32_t n = 0;
        for (uint32_t j = 0; j < 4; j++)
          if (r->ctx[(j + (differ ? 1 : 0)) % 4] != NULL && (a[1] >> j & 1))
            list[n++] = r->ctx[(j + (differ ? 1 : 0)) % 4];
        if (a[2] == 6) /* past concurrency: refused on every rank, list not read past it */
          for (uint32_t j = n; j < 4; j++) list[j] = r->ctx[j];
        r->st[i] = akv_group_step_begin(r->g, list, a[2] == 5 ? 0 : a[2] == 6 ? UINT32_MAX : n);
        if (r->st[i] == AKV_OK && stream != NULL) {
          /* every layer, the two-call form, then the step's end (local) */
          akv_lease *ls = NULL;
          akv_fence at, tail;
          if (akv_lease_begin(e, 0, &ls) == AKV_OK &&
              akv_lease_attend(ls, stream, g_hook_quiet, NULL, &at) == AKV_OK &&
              akv_lease_write_back(ls, NULL, 0, &tail) == AKV_OK &&
              akv_lease_seal(ls, tail, at) == AKV_OK && akv_lease_retire(ls, NULL) == AKV_OK)
            (void)akv_step_end(e);
        }
        break;
      }
      case 4:
        r->st[i] = akv_group_check(r->g);
        break;
      default: {
        akv_group_info info;
        r->agreed[i] = 0;
        r->st[i] = akv_group_info_get(r->g, a[0] == 1 ? NULL : &info);
        if (akv_group_last_error(r->g) == NULL) abort();
        if (r->st[i] == AKV_OK && (info.rank != r->rank || info.size != r->size)) abort();
        break;
      }
    }
    if (g_trace > 0)
      fprintf(stderr, "  %9.3f ms  rank %u group op %d (%u) -> %s\n", trace_ms(), r->rank, i,
              r->op[i] % 6u, akv_status_string(r->st[i]));
  }
  if (stream != NULL) {
    if (akv_stream_destroy(e, stream) != AKV_OK) {
      akv_quarantine_report q;
      (void)akv_engine_quarantine(e, &q);
      if (akv_stream_destroy(e, stream) != AKV_OK) abort();
    }
  }
  return NULL;
}

/* Statuses a rank may see alone: a bad handle refused before the agreement
 * (the others then time out), and the timeout and abort themselves. */
static int lone(akv_status st) {
  return st == AKV_ERR_BAD_HANDLE || st == AKV_ERR_TIMEOUT || st == AKV_ERR_COMM;
}

/* What a rank answers when an agreement point timed out. */
static int timed_out(akv_status st) { return st == AKV_ERR_TIMEOUT || st == AKV_ERR_COMM; }

static void op_group(input *in) {
  grank r[2];
  pthread_t th[2];
  akv_group_world *w = NULL, *dead_w;
  uint8_t b = byte(in);
  uint32_t size = 1 + b % 2, wmax = b >> 1 & 3;
  akv_status st, wst;
  akv_group *dead[2] = {0};
  st = akv_group_world_create(size, wmax, (b & 0x80) ? NULL : &w);
  expect("akv_group_world_create", st, OKS | IA | S(AKV_ERR_OUT_OF_MEMORY));
  if ((wmax == 0 || (b & 0x80)) && st == AKV_OK) abort();
  if (st != AKV_OK) return;
  memset(r, 0, sizeof(r));
  {
    uint8_t nops = byte(in) % (G_OPS + 1);
    uint8_t ops[G_OPS], args[G_OPS][4], shard_max = byte(in);
    for (int i = 0; i < nops; i++) {
      ops[i] = byte(in);
      for (int j = 0; j < 4; j++) args[i][j] = byte(in);
    }
    for (uint32_t k = 0; k < size; k++) {
      r[k].w = w;
      r[k].rank = k;
      r[k].size = size;
      r[k].shard = base_config(1, 1 + shard_max % wmax, (b >> 3) & 1 ? AKV_ROUTE_ARENA : AKV_ROUTE_STAGE);
      r[k].shard.kv_heads = 8 / size;
      r[k].gc = (akv_group_config)AKV_GROUP_CONFIG_INIT;
      r[k].gc.rank = k;
      r[k].gc.size = size;
      /* The ranks of this process meet within a few ms (about 4 at most
       * under ASan, replaying a corpus on a loaded machine); a rank that
       * waits alone (a lone refusal, the lone akv_group_check below) waits
       * the whole timeout, so it is short. A slow schedule can still time
       * an agreement out (a create included): that gives statuses lone()
       * and timed_out() accept, and no world or group is left behind. */
      r[k].gc.timeout_ms = 20;
      r[k].gc.digest = (b >> 4) & 1 ? AKV_GROUP_DIGEST_ON : AKV_GROUP_DIGEST_DEFAULT;
      r[k].n_ops = nops;
      memcpy(r[k].op, ops, sizeof(ops));
      memcpy(r[k].arg, args, sizeof(args));
    }
  }
  {
    /* Configs the world does not take: refused on this rank alone, at once.
     * (A NULL shard or out is not among them: it meets the other ranks and
     * is refused on every rank, so one rank alone would wait out the
     * timeout and abort the world; test_group covers it with every rank.) */
    akv_group_config bad = r[0].gc;
    akv_group *g = NULL;
    uint8_t k = byte(in) % 5;
    if (k == 0) bad.rank = size + byte(in);
    else if (k == 1) bad.size = size + 1;
    else if (k == 2) bad.struct_size = 8;
    if (k < 3) {
      st = akv_group_create_inproc(&r[0].shard, &bad, w, &g);
      expect("akv_group_create_inproc", st, S(AKV_ERR_CONFIG) | IA);
      if (g != NULL) abort();
    } else if (k == 3) {
      expect("akv_group_create_inproc", akv_group_create_inproc(&r[0].shard, &r[0].gc, NULL, &g), IA);
      expect("akv_group_create_inproc", akv_group_create_inproc(&r[0].shard, NULL, w, &g), IA);
      if (g != NULL) abort();
    }
  }
  for (uint32_t k = 0; k < size; k++)
    if (pthread_create(&th[k], NULL, grank_run, &r[k]) != 0) abort();
  for (uint32_t k = 0; k < size; k++) pthread_join(th[k], NULL);
  /* Every rank answers an agreement point alike. */
  for (uint32_t k = 1; k < size; k++) {
    /* A create that timed out: the late rank may answer AKV_ERR_COMM
     * instead of AKV_ERR_TIMEOUT (akv_group.h). */
    if (r[k].create_st != r[0].create_st &&
        !(timed_out(r[k].create_st) && timed_out(r[0].create_st))) {
      fprintf(stderr, "fuzz_api: group create: rank 0 %s, rank %u %s\n",
              akv_status_string(r[0].create_st), k, akv_status_string(r[k].create_st));
      abort();
    }
    for (int i = 0; i < r[0].n_ops && r[0].create_st == AKV_OK; i++)
      if (r[0].agreed[i] &&
          ((r[k].st[i] != r[0].st[i] && !lone(r[0].st[i]) && !lone(r[k].st[i])) ||
           (r[0].st[i] == AKV_OK && r[0].op[i] % 6 == 0 && r[k].id[i] != r[0].id[i]))) {
        fprintf(stderr, "fuzz_api: group op %d (%u): rank 0 %s, rank %u %s\n", i,
                r[0].op[i] % 6, akv_status_string(r[0].st[i]), k, akv_status_string(r[k].st[i]));
        abort();
      }
  }
  if (byte(in) & 1) expect("akv_group_world_abort", akv_group_world_abort(w), OKS);
  /* With no group created the world goes now; otherwise after the groups. */
  wst = akv_group_world_destroy(w);
  expect("akv_group_world_destroy", wst, r[0].create_st == AKV_OK ? S(AKV_ERR_BUSY) : OKS);
  for (uint32_t k = 0; k < size; k++) {
    if (r[k].g == NULL) continue;
    if (r[0].create_st == AKV_OK && (byte(in) & 3) == 0) {
      /* after the world aborted (or not), a check never hangs */
      st = akv_group_check(r[k].g);
      expect("akv_group_check", st,
             OKS | QU | S(AKV_ERR_COMM) | S(AKV_ERR_TIMEOUT));
    }
    st = akv_group_destroy(r[k].g);
    if (st == AKV_ERR_BUSY) {
      akv_engine *e = NULL;
      if (akv_group_engine(r[k].g, &e) != AKV_OK) abort();
      (void)akv_engine_quarantine(e, NULL);
      st = akv_group_destroy(r[k].g);
    }
    expect("akv_group_destroy", st, OKS);
    dead[k] = r[k].g;
  }
  if (wst == AKV_ERR_BUSY) expect("akv_group_world_destroy", akv_group_world_destroy(w), OKS);
  dead_w = w;
  /* Dead handles: refused, changing nothing. */
  expect("akv_group_world_destroy", akv_group_world_destroy(dead_w), IA);
  expect("akv_group_world_abort", akv_group_world_abort(dead_w), IA);
  if (dead[0] != NULL) {
    akv_group_info info;
    akv_engine *e = NULL;
    expect("akv_group_info_get", akv_group_info_get(dead[0], &info), BH);
    expect("akv_group_engine", akv_group_engine(dead[0], &e), BH);
    expect("akv_group_destroy", akv_group_destroy(dead[0]), BH);
    expect("akv_group_check", akv_group_check(dead[0]), BH);
    if (e != NULL) abort();
  }
}

/* ------------------------------------------------------------ the entry */

/* Threads of this process. A joined thread may stay listed in /proc for a
 * moment after pthread_join returned (the kernel reaps it just after it
 * woke the joiner), so callers poll for a while before concluding. */
static uint32_t threads_now(void) {
  uint32_t n = 0;
  DIR *d = opendir("/proc/self/task");
  struct dirent *de;
  if (d == NULL) return 0;
  while ((de = readdir(d)) != NULL)
    if (de->d_name[0] != '.') n++;
  closedir(d);
  return n;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  static uint32_t threads0;
  static state s;
  input in = {data, size};
  int steps = 0;
  if (threads0 == 0) {
    threads0 = threads_now();
    for (size_t l = 0; l < MAX_LAYERS; l++)
      for (size_t i = 0; i < sizeof(g_rows[l]); i++) g_rows[l][i] = (uint8_t)(i * 131u + l * 17u + (i >> 9));
    for (size_t i = 0; i < sizeof(g_q) / sizeof(g_q[0]); i++) g_q[i] = (uint16_t)(0x3c00u + (i * 37u) % 0x300u);
  }
  memset(&s, 0, sizeof(s));
  fill_pattern((uint8_t *)s.bogus, sizeof(s.bogus), 37, 11, 0xff);
  engine_new(&s, &in);
  if (s.e == NULL) return 0;
  while (in.n > 0 && steps++ < 200 && s.e != NULL) {
    int failed = transport_failed(&s);
    switch (byte(&in) % 25) {
      case 0: op_open(&s, &in, failed); break;
      case 1: {
        akv_context *c = pick_ctx(&s, &in);
        akv_status st = akv_context_close(c);
        expect_mut(&s, failed, "akv_context_close", st, OKS | BH | S(AKV_ERR_IN_USE) | QU);
        expect_dead_refused(&s, "akv_context_close", c, st);
        if (st == AKV_OK) mark_closed(&s, c);
        break;
      }
      case 2: op_append(&s, &in, failed); break;
      case 3: op_read(&s, &in); break;
      case 4: op_small_diag(&s, &in); break;
      case 5: op_step_begin(&s, &in, failed); break;
      case 6:
        expect_mut(&s, failed, "akv_step_end", akv_step_end(byte(&in) == 1 ? NULL : s.e),
                   OKS | BH | S(AKV_ERR_STEP_STATE) | QU);
        break;
      case 7: op_lease_begin(&s, &in, failed); break;
      case 8: op_wait_ready(&s, &in, failed); break;
      case 9: op_mark_consumed(&s, &in, failed); break;
      case 10: op_attend(&s, &in, failed); break;
      case 11: op_write_back(&s, &in, failed); break;
      case 12: op_seal(&s, &in, failed); break;
      case 13: op_retire(&s, &in, failed); break;
      case 14: op_quarantine(&s, &in); break;
      case 15: op_destroy(&s, &in); break;
      case 16: op_diagnostics(&s, &in); break;
      case 17: op_streams(&s, &in, failed); break;
      case 18: op_config(&s, &in); break;
      case 19: op_headroom(&s, &in, failed); break;
      case 20: op_dead_engine(&s, &in); break;
      case 22: op_attention(&in); break;
      case 23: if (s.n_group++ < 3) op_group(&in); break;
      default: op_legal_step(&s, failed); break;
    }
  }
  teardown(&s);
  for (int l = 0; l < MAX_LAYERS; l++) {
    free(g_jobs[l].ws); /* enqueued on a stream that failed: never ran */
    g_jobs[l].ws = NULL;
  }
  for (int i = 0; i < 2000 && threads_now() > threads0; i++) usleep(1000);
  if (threads_now() != threads0) {
    fprintf(stderr, "fuzz_api: %u threads alive after teardown, %u before\n", threads_now(), threads0);
    abort();
  }
  return 0;
}
