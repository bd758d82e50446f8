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
 * Build: scripts/fuzz.sh (clang, -fsanitize=fuzzer,address,undefined).
 */
#if !defined(_GNU_SOURCE) && !defined(_DEFAULT_SOURCE)
#define _DEFAULT_SOURCE
#endif
#include <dirent.h>
#include <stddef.h>
#include <unistd.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "akv.h"

#define MAX_LAYERS 3
#define ROW_BYTES 2048 /* 8 kv_heads x 128 head_dim x bf16: few, large pages */
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

/* ------------------------------------------------------------ the state */

typedef struct state {
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
  int hook_mode;                /* 0: enqueue the new rows, 1: do nothing, 2: fail */
  uint64_t bogus[512];          /* an object of no handle type */
} state;

static uint8_t g_rows[MAX_LAYERS][MAX_TOKENS][ROW_BYTES];

static void fuzz_log(void *user, akv_log_level level, const char *message) {
  (void)user;
  (void)level;
  (void)message;
}

/* ------------------------------------------------------- status checks */

#define S(x) (1u << (x))
#define OKS S(AKV_OK)
#define BH S(AKV_ERR_BAD_HANDLE)
#define IA S(AKV_ERR_INVALID_ARGUMENT)
#define QU S(AKV_ERR_QUARANTINED)
#define BE S(AKV_ERR_BACKEND)

static int g_trace = -1; /* FUZZ_TRACE=1 prints every call (to reproduce a crash) */

static void expect(const char *fn, akv_status st, uint32_t allowed) {
  if (g_trace < 0) g_trace = getenv("FUZZ_TRACE") != NULL;
  if (g_trace) fprintf(stderr, "  %s -> %s\n", fn, akv_status_string(st));
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
      return;
    }
  for (int i = 0; i < N_CTX; i++)
    if (s->ctx[i] == NULL) {
      s->ctx[i] = c;
      s->dead[i] = 0;
      return;
    }
  s->ctx[(uintptr_t)c % N_CTX] = c;
  s->dead[(uintptr_t)c % N_CTX] = 0;
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
  uint8_t *base;
  uint64_t stride, v_offset;
  uint32_t n;
  uint32_t len[N_CTX];
} job;

static job g_jobs[MAX_LAYERS];

static void job_run(void *arg) {
  job *j = arg;
  for (uint32_t i = 0; i < j->n; i++) {
    uint8_t *k = j->base + i * j->stride;
    memset(k + (size_t)j->len[i] * ROW_BYTES, (int)i + 1, ROW_BYTES);
    memset(k + j->v_offset + (size_t)j->len[i] * ROW_BYTES, (int)i + 2, ROW_BYTES);
  }
}

static void noop_fn(void *arg) { (void)arg; }

static int hook(void *user, const akv_view *view, akv_stream stream) {
  state *s = user;
  job *j;
  if (s->hook_mode == 2) return 1;
  if (s->hook_mode == 1) return 0;
  if (view == NULL || view->layer >= MAX_LAYERS || view->n_contexts > N_CTX) abort();
  j = &g_jobs[view->layer];
  j->base = view->base;
  j->stride = view->context_stride;
  j->v_offset = view->v_offset;
  j->n = view->n_contexts;
  for (uint32_t i = 0; i < view->n_contexts; i++) {
    if (view->len[i] >= MAX_TOKENS) abort();
    j->len[i] = view->len[i];
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
    /* Revocable headroom on a modelled device of 3 GiB: about 1 GiB of
     * headroom after the 1 GiB pool and the 1 GiB reserve, in a few chunks. */
    ec.headroom_gib = 1;
    ec.headroom_reserve_gib = 1;
    ec.host_fake_free_bytes = (uint64_t)3 << 30;
    ec.headroom_chunk_pages = 1024;
  }
  if ((b >> 5) == 7) { /* an injected fault somewhere in this engine's life */
    ec.fault_fail_nth = 1 + byte(in);
    ec.fault_kind = (int32_t)(byte(in) % (AKV_OP_KIND_COUNT + 1)) - 1;
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
  akv_context *c = pick_ctx(s, in);
  for (int l = 0; l < MAX_LAYERS; l++) {
    k[l] = g_rows[l];
    v[l] = g_rows[l];
  }
  if (b == 1) k[s->layers - 1] = NULL;
  if (b & 0x10) {
    /* One layer only (layer may be out of range; b & 0x20 a NULL row
     * array): the context's length is the minimum over its layers, so a
     * per-layer append never lowers it and a refused one never moves it. */
    uint32_t layer = byte(in) % (MAX_LAYERS + 2), before = 0, after = 0;
    int had = akv_context_length(c, &before) == AKV_OK;
    akv_status st = akv_context_append_layer(c, layer, n, b & 0x20 ? NULL : g_rows[layer % MAX_LAYERS],
                                             g_rows[layer % MAX_LAYERS]);
    expect_mut(s, failed, "akv_context_append_layer", st,
               OKS | BH | IA | S(AKV_ERR_CAPACITY) | S(AKV_ERR_IN_USE) | QU);
    expect_dead_refused(s, "akv_context_append_layer", c, st);
    if (had && (akv_context_length(c, &after) != AKV_OK || after < before ||
                (st != AKV_OK && after != before) || after > before + n)) {
      fprintf(stderr, "fuzz_api: akv_context_append_layer (%s) moved the length %u -> %u\n",
              akv_status_string(st), before, after);
      abort();
    }
    return;
  }
  akv_status st = akv_context_append(c, n, b == 2 ? NULL : k, b == 3 ? NULL : v);
  expect_mut(s, failed, "akv_context_append", st,
             OKS | BH | IA | S(AKV_ERR_CAPACITY) | S(AKV_ERR_IN_USE) | QU);
  expect_dead_refused(s, "akv_context_append", c, st);
}

static void op_read(state *s, input *in) {
  static uint8_t k[MAX_TOKENS * ROW_BYTES], v[MAX_TOKENS * ROW_BYTES];
  akv_context *c = pick_ctx(s, in);
  uint32_t layer = byte(in) % (MAX_LAYERS + 2);
  uint32_t first = byte(in) % 80, n = byte(in) % 80;
  uint8_t b = byte(in);
  if (b == 0xff) n = UINT32_MAX; /* first + n overflows 32 bits */
  if (b == 0xfe) first = UINT32_MAX;
  akv_status st = akv_context_read(c, layer, first, n, b == 1 ? NULL : k, b == 2 ? NULL : v);
  expect("akv_context_read", st, OKS | BH | IA | S(AKV_ERR_IN_USE));
  expect_dead_refused(s, "akv_context_read", c, st);
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
  for (uint32_t i = 0; i < n; i++) list[i] = pick_ctx(s, in);
  expect_mut(s, failed, "akv_step_begin", akv_step_begin(s->e, b == 7 ? NULL : list, n),
             OKS | BH | IA | S(AKV_ERR_STEP_STATE) | S(AKV_ERR_CAPACITY) |
                 S(AKV_ERR_UNEVEN_LAYERS) | BE | QU);
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
  akv_context *owners[4];
  akv_fence f;
  akv_lease *ls = pick_lease(s, in);
  uint8_t b = byte(in);
  uint32_t n = b % 5;
  akv_status r;
  for (uint32_t i = 0; i < n; i++) owners[i] = pick_ctx(s, in);
  r = akv_lease_write_back(ls, (b & 0x80) ? NULL : owners, (b & 0x80) ? (b & 0x40 ? 1 : 0) : n,
                           b == 0x20 ? NULL : &f);
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
         akv_admission_counters(s->e, b == 2 ? NULL : counters, byte(in) % (AKV_ADM_RULE_COUNT + 2)),
         OKS | IA);
  expect("akv_admission_log", akv_admission_log(s->e, b == 3 ? NULL : log, cap, b == 4 ? NULL : &n),
         OKS | IA);
  if (n > cap) abort();
  expect("akv_admission_explain",
         akv_admission_explain(s->e, (b & 8) ? NULL : pick_ctx(s, in), b == 5 ? NULL : buf,
                               byte(in) % sizeof(buf)),
         OKS | BH | IA);
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
      if (st == AKV_OK && have && akv_headroom_get(s->e, &b) == AKV_OK) {
        /* Mid-step: memory still allocated; outside: freed at once. */
        if (pend_b > 0 && b.bytes != a.bytes) abort();
        if (now_b > 0 && b.bytes + now_b != a.bytes) abort();
        if (pend_b > 0 && now_b > 0) abort();
      }
      break;
    }
    case 1:
      expect_mut(s, failed, "akv_headroom_take", akv_headroom_take(e, bytes, &taken),
                 OKS | BH | S(AKV_ERR_NOT_SUPPORTED) | S(AKV_ERR_STEP_STATE) | QU);
      break;
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
    case 4:
      expect_mut(s, failed, "akv_stream_launch_host",
                 akv_stream_launch_host(s->e, pick_stream(s, in), byte(in) & 1 ? NULL : noop_fn,
                                        NULL),
                 OKS | BH | IA | BE | QU);
      break;
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
    if (st != AKV_OK) return;
    keep_lease(s, ls[l]);
    st = akv_lease_attend(ls[l], s->streams[0], hook, s, &attn);
    expect("akv_lease_attend", st, OKS | BE);
    if (st != AKV_OK) return;
    st = akv_lease_write_back(ls[l], NULL, 0, &tail);
    expect("akv_lease_write_back", st, OKS | BE);
    if (st != AKV_OK) return;
    keep_fence(s, tail);
    keep_fence(s, attn);
    expect("akv_lease_seal", akv_lease_seal(ls[l], tail, attn), OKS);
    if (l >= 1) {
      st = akv_lease_retire(ls[l - 1], NULL);
      expect("akv_lease_retire", st, OKS | BE);
      if (st != AKV_OK) return;
      mark_lease_dead(s, ls[l - 1]);
    }
  }
  st = akv_lease_retire(ls[s->layers - 1], NULL);
  expect("akv_lease_retire", st, OKS | BE);
  if (st != AKV_OK) return;
  mark_lease_dead(s, ls[s->layers - 1]);
  expect("akv_step_end", akv_step_end(s->e), OKS);
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
  if (threads0 == 0) threads0 = threads_now();
  memset(&s, 0, sizeof(s));
  for (size_t i = 0; i < sizeof(s.bogus); i++) ((uint8_t *)s.bogus)[i] = (uint8_t)(i * 37u + 11u);
  engine_new(&s, &in);
  if (s.e == NULL) return 0;
  while (in.n > 0 && steps++ < 200 && s.e != NULL) {
    int failed = transport_failed(&s);
    switch (byte(&in) % 22) {
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
      default: op_legal_step(&s, failed); break;
    }
  }
  teardown(&s);
  for (int i = 0; i < 2000 && threads_now() > threads0; i++) usleep(1000);
  if (threads_now() != threads0) {
    fprintf(stderr, "fuzz_api: %u threads alive after teardown, %u before\n", threads_now(), threads0);
    abort();
  }
  return 0;
}
