/*
 * test_audit_s27_attn.c - a hostile caller's audit of the attention API
 * (akv_attention.h; the CUDA launchers' host-side checks where built) and of
 * the engine config's bound that ties a page to an attention chunk.
 *
 *  - Overlap (akv_attention.h, "Overlap"): what a call writes (out, the
 *    workspace bytes it uses) against every array and row range it reads
 *    and against each other, for the contiguous call (page overrides
 *    included) and the paged one: every pair is refused with
 *    AKV_ERR_INVALID_ARGUMENT when one byte is shared (at either end), and
 *    nothing anywhere is written; exactly adjacent buffers, and an output
 *    in the bytes between two rows, are taken and give the same bytes as
 *    separate buffers.
 *  - Extents: an output, query or page map whose shape passes the end of the
 *    address space is refused, not written or read.
 *  - Config: page_tokens above AKV_ATTENTION_MAX_CHUNK_TOKENS is refused by
 *    akv_fit and akv_engine_create alike (AKV_ERR_CONFIG); the bound itself
 *    is taken.
 *
 * Every buffer of a call lives in one arena at a fixed place, so that a
 * refused call can be checked byte for byte over the whole arena, and the
 * written buffers can be moved onto, or right next to, each read one.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "akv.h"
#include "akv_attention.h"
#ifdef AKV_WITH_CUDA
#include "akv_cuda.h"
#endif

/* ------------------------------------------------------------------------ */
/* The arena and the geometry                                                */
/* ------------------------------------------------------------------------ */

/* One slot per buffer; a read buffer starts in the middle of its slot, so
 * that a written buffer fits before and after it without reaching another. */
#define SLOT ((size_t)65536)
#define N_SLOTS 12u
#define ARENA (SLOT * N_SLOTS)
#define AT(k) (SLOT * (size_t)(k) + SLOT / 2)

#define N_CTX 2u
#define N_HEADS 4u
#define KV_HEADS 2u
#define HEAD_DIM 64u
#define CHUNK 2u
#define EXTENT ((uint64_t)KV_HEADS * HEAD_DIM * 2u) /* 256 B of bf16 per row */
#define ROW ((uint64_t)EXTENT + 2048u)              /* 2 KiB between rows: room for out */
#define CSTRIDE (4u * ROW)
#define PSTRIDE (2u * ROW)
#define OUT_BYTES ((size_t)N_CTX * N_HEADS * HEAD_DIM * 4u)

/* Read buffers of the contiguous call, by slot. */
enum { C_Q, C_K, C_V, C_LEN, C_KS, C_VS, C_MAP, C_KP, C_VP, C_OUT, C_WS, C_N };
/* Read buffers of the paged call, by slot. */
enum { P_Q, P_KS, P_VS, P_INDPTR, P_LAST, P_INDICES, P_KP, P_VP, P_OUT, P_WS, P_N };

static const char *const c_names[] = {"q", "K rows", "V rows", "len", "k_scale", "v_scale",
                                      "page_map", "K pages", "V pages"};
static const char *const p_names[] = {"q", "k_scale", "v_scale", "indptr", "last_page_len",
                                      "indices", "K pages", "V pages"};

typedef struct span {
  size_t lo, hi; /* arena offsets: the first byte read and one past the last */
} span;

static unsigned char *arena_new(void) {
  unsigned char *p = (unsigned char *)aligned_alloc(256, ARENA);
  assert_non_null(p);
  uint32_t s = 12345u;
  /* Small bf16 values everywhere (q, rows, pages and the bytes between). */
  for (size_t i = 0; i < ARENA; i += 2) {
    s = s * 1664525u + 1013904223u;
    const float f = (float)((int)((s >> 8) % 64u) - 32) / 32.0f;
    uint32_t b;
    memcpy(&b, &f, sizeof b);
    const uint16_t h = (uint16_t)(b >> 16);
    memcpy(p + i, &h, 2);
  }
  return p;
}

static void put_u32s(unsigned char *arena, size_t off, const uint32_t *v, size_t n) {
  memcpy(arena + off, v, n * 4u);
}

static void put_floats(unsigned char *arena, size_t off, const float *v, size_t n) {
  memcpy(arena + off, v, n * 4u);
}

/* The contiguous call: 2 contexts of 3 and 4 rows in chunks of 2, rows
 * 2 KiB apart; chunk 1 of context 0 and chunk 0 of context 1 are read from
 * pages 1 and 0. */
static void contig_fill(unsigned char *arena, span *rd) {
  static const uint32_t len[N_CTX] = {3, 4};
  static const float ks[KV_HEADS] = {0.5f, 2.0f}, vs[KV_HEADS] = {1.5f, 0.75f};
  static const uint32_t map[N_CTX * 2] = {AKV_PAGE_STAGED, 1, 0, AKV_PAGE_STAGED};
  put_u32s(arena, AT(C_LEN), len, N_CTX);
  put_floats(arena, AT(C_KS), ks, KV_HEADS);
  put_floats(arena, AT(C_VS), vs, KV_HEADS);
  put_u32s(arena, AT(C_MAP), map, N_CTX * 2);
  rd[C_Q] = (span){AT(C_Q), AT(C_Q) + (size_t)N_CTX * N_HEADS * HEAD_DIM * 2u};
  /* Rows: context 0 rows 0..2 at 0, context 1 rows 0..3 at CSTRIDE. */
  rd[C_K] = (span){AT(C_K), AT(C_K) + CSTRIDE + 3u * ROW + EXTENT};
  rd[C_V] = (span){AT(C_V), AT(C_V) + CSTRIDE + 3u * ROW + EXTENT};
  rd[C_LEN] = (span){AT(C_LEN), AT(C_LEN) + N_CTX * 4u};
  rd[C_KS] = (span){AT(C_KS), AT(C_KS) + KV_HEADS * 4u};
  rd[C_VS] = (span){AT(C_VS), AT(C_VS) + KV_HEADS * 4u};
  rd[C_MAP] = (span){AT(C_MAP), AT(C_MAP) + N_CTX * 2u * 4u};
  /* Pages: page 0 rows 0..1, page 1 row 0. */
  rd[C_KP] = (span){AT(C_KP), AT(C_KP) + PSTRIDE + EXTENT};
  rd[C_VP] = (span){AT(C_VP), AT(C_VP) + PSTRIDE + EXTENT};
}

static size_t ws_bytes_needed(void) {
  size_t n = 0;
  assert_int_equal(akv_attention_workspace_bytes(N_CTX, N_HEADS, HEAD_DIM, 4, CHUNK, &n), AKV_OK);
  return n;
}

static akv_attention_args contig_args(unsigned char *arena, size_t out_off, size_t ws_off) {
  akv_attention_args a;
  memset(&a, 0, sizeof a);
  a.dtype = AKV_DTYPE_BF16;
  a.n_contexts = N_CTX;
  a.n_heads = N_HEADS;
  a.kv_heads = KV_HEADS;
  a.head_dim = HEAD_DIM;
  a.chunk_tokens = CHUNK;
  a.scale = 0.125f;
  a.q = arena + AT(C_Q);
  a.k_base = arena + AT(C_K);
  a.v_base = arena + AT(C_V);
  a.context_stride = CSTRIDE;
  a.row_bytes = ROW;
  a.len = (const uint32_t *)(const void *)(arena + AT(C_LEN));
  a.out = (float *)(void *)(arena + out_off);
  a.workspace = arena + ws_off;
  a.workspace_bytes = ws_bytes_needed();
  a.page_map = (const uint32_t *)(const void *)(arena + AT(C_MAP));
  a.page_map_stride = 2;
  a.k_pages = arena + AT(C_KP);
  a.v_pages = arena + AT(C_VP);
  a.page_stride = PSTRIDE;
  a.k_scale = (const float *)(const void *)(arena + AT(C_KS));
  a.v_scale = (const float *)(const void *)(arena + AT(C_VS));
  return a;
}

/* The paged call: context 0 on pages 3, 1 (3 rows), context 1 on pages 0, 2
 * (4 rows), pages of 2 rows 2 KiB apart. */
static void paged_fill(unsigned char *arena, span *rd) {
  static const uint32_t indptr[N_CTX + 1] = {0, 2, 4}, indices[4] = {3, 1, 0, 2},
                        last[N_CTX] = {1, 2};
  static const float ks[KV_HEADS] = {0.5f, 2.0f}, vs[KV_HEADS] = {1.5f, 0.75f};
  put_u32s(arena, AT(P_INDPTR), indptr, N_CTX + 1);
  put_u32s(arena, AT(P_INDICES), indices, 4);
  put_u32s(arena, AT(P_LAST), last, N_CTX);
  put_floats(arena, AT(P_KS), ks, KV_HEADS);
  put_floats(arena, AT(P_VS), vs, KV_HEADS);
  rd[P_Q] = (span){AT(P_Q), AT(P_Q) + (size_t)N_CTX * N_HEADS * HEAD_DIM * 2u};
  rd[P_KS] = (span){AT(P_KS), AT(P_KS) + KV_HEADS * 4u};
  rd[P_VS] = (span){AT(P_VS), AT(P_VS) + KV_HEADS * 4u};
  rd[P_INDPTR] = (span){AT(P_INDPTR), AT(P_INDPTR) + (N_CTX + 1u) * 4u};
  rd[P_INDICES] = (span){AT(P_INDICES), AT(P_INDICES) + 4u * 4u};
  rd[P_LAST] = (span){AT(P_LAST), AT(P_LAST) + N_CTX * 4u};
  /* Page 0 row 0 first, page 3 row 1 last. */
  rd[P_KP] = (span){AT(P_KP), AT(P_KP) + 3u * PSTRIDE + ROW + EXTENT};
  rd[P_VP] = (span){AT(P_VP), AT(P_VP) + 3u * PSTRIDE + ROW + EXTENT};
}

typedef struct paged_call {
  akv_attention_paged_args a;
  akv_page_table t;
} paged_call;

static paged_call paged_args(unsigned char *arena, size_t out_off, size_t ws_off) {
  paged_call c;
  memset(&c, 0, sizeof c);
  c.a.dtype = AKV_DTYPE_BF16;
  c.a.n_heads = N_HEADS;
  c.a.kv_heads = KV_HEADS;
  c.a.head_dim = HEAD_DIM;
  c.a.scale = 0.125f;
  c.a.q = arena + AT(P_Q);
  c.a.out = (float *)(void *)(arena + out_off);
  c.a.workspace = arena + ws_off;
  c.a.workspace_bytes = ws_bytes_needed();
  c.a.k_scale = (const float *)(const void *)(arena + AT(P_KS));
  c.a.v_scale = (const float *)(const void *)(arena + AT(P_VS));
  c.t.batch = N_CTX;
  c.t.page_tokens = CHUNK;
  c.t.max_pages = 2;
  c.t.indptr = (const uint32_t *)(const void *)(arena + AT(P_INDPTR));
  c.t.indices = (const uint32_t *)(const void *)(arena + AT(P_INDICES));
  c.t.last_page_len = (const uint32_t *)(const void *)(arena + AT(P_LAST));
  c.t.k_pages = arena + AT(P_KP);
  c.t.v_pages = arena + AT(P_VP);
  c.t.page_stride = PSTRIDE;
  c.t.row_bytes = ROW;
  return c;
}

/* ------------------------------------------------------------------------ */
/* The overlap sweep                                                         */
/* ------------------------------------------------------------------------ */

/* Which implementation a sweep drives. */
typedef enum impl { REF, CUDA } impl;

#ifdef AKV_WITH_CUDA
static int have_device(void) {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}
#endif

/* Whether the calls a sweep expects taken are made (see expect_taken). */
static int takes_run(impl how) {
#ifdef AKV_WITH_CUDA
  if (how == CUDA) return !have_device();
#endif
  (void)how;
  return 1;
}

typedef struct sweep {
  impl how;
  int paged;
  unsigned char *arena, *pristine;
  span rd[C_N];
  size_t n_read;        /* read buffers the implementation checks */
  size_t home_out, home_ws;
  size_t ws_bytes;
  unsigned char want[OUT_BYTES]; /* the bytes of out with every buffer apart */
  unsigned refused, taken;       /* cases run */
} sweep;

static akv_status run_call(sweep *s, size_t out_off, size_t ws_off) {
  if (!s->paged) {
    const akv_attention_args a = contig_args(s->arena, out_off, ws_off);
#ifdef AKV_WITH_CUDA
    if (s->how == CUDA) return akv_attention_decode_cuda(&a, 0);
#endif
    return akv_attention_ref_bf16(&a);
  }
  const paged_call c = paged_args(s->arena, out_off, ws_off);
#ifdef AKV_WITH_CUDA
  if (s->how == CUDA) return akv_attention_paged_cuda(&c.a, c.t, 0);
#endif
  return akv_attention_paged_ref_bf16(&c.a, c.t);
}

/* Refused with nothing written anywhere in the arena. */
static void expect_refused(sweep *s, size_t out_off, size_t ws_off, const char *what) {
  const akv_status st = run_call(s, out_off, ws_off);
  if (st != AKV_ERR_INVALID_ARGUMENT)
    fail_msg("%s %s: %s overlapping: status %d, want AKV_ERR_INVALID_ARGUMENT",
             s->how == REF ? "reference" : "CUDA", s->paged ? "paged" : "contiguous", what,
             (int)st);
  if (memcmp(s->arena, s->pristine, ARENA) != 0)
    fail_msg("%s: a refused call wrote into the arena", what);
  s->refused++;
}

/* Taken: the reference gives the bytes of the call with every buffer apart;
 * CUDA without a device passes every check and fails at the launch
 * (AKV_ERR_BACKEND). With a device the CUDA calls are not made (host
 * memory: the GPU test file checks the same placements on the device). */
static void expect_taken(sweep *s, size_t out_off, size_t ws_off, const char *what) {
#ifdef AKV_WITH_CUDA
  if (s->how == CUDA) {
    if (have_device()) return;
    const akv_status st = run_call(s, out_off, ws_off);
    if (st != AKV_ERR_BACKEND)
      fail_msg("CUDA %s: %s adjacent: status %d, want AKV_ERR_BACKEND (no device)",
               s->paged ? "paged" : "contiguous", what, (int)st);
    s->taken++;
    return;
  }
#endif
  const akv_status st = run_call(s, out_off, ws_off);
  if (st != AKV_OK)
    fail_msg("reference %s: %s adjacent: status %d, want AKV_OK", s->paged ? "paged" : "contiguous",
             what, (int)st);
  if (memcmp(s->arena + out_off, s->want, OUT_BYTES) != 0)
    fail_msg("%s adjacent: other bytes than with the buffers apart", what);
  memcpy(s->arena, s->pristine, ARENA);
  s->taken++;
}

static size_t down(size_t x, size_t a) { return x / a * a; }
static size_t up(size_t x, size_t a) { return (x + a - 1) / a * a; }

/* Written buffer w (0 out, 1 workspace) of `bytes` bytes, aligned to `al`,
 * against span r: sharing r's last byte, sharing its first byte, right
 * after it and right before it (where the alignment allows). */
static void sweep_pair(sweep *s, int w, span r, size_t bytes, size_t al, const char *name) {
  char what[96];
  snprintf(what, sizeof what, "%s and %s", w == 0 ? "out" : "workspace", name);
  const size_t other = w == 0 ? s->home_ws : s->home_out;
#define CALL_AT(fn, off) (w == 0 ? fn(s, (off), other, what) : fn(s, other, (off), what))
  CALL_AT(expect_refused, down(r.hi - 1u, al));
  CALL_AT(expect_refused, up(r.lo + 1u, al) - bytes);
  if (r.hi % al == 0) CALL_AT(expect_taken, r.hi);
  if ((r.lo - bytes) % al == 0) CALL_AT(expect_taken, r.lo - bytes);
#undef CALL_AT
}

static void sweep_run(impl how, int paged) {
  sweep *s = (sweep *)calloc(1, sizeof *s);
  assert_non_null(s);
  s->how = how;
  s->paged = paged;
  s->arena = arena_new();
  s->pristine = (unsigned char *)malloc(ARENA);
  assert_non_null(s->pristine);
  const char *const *names;
  if (!paged) {
    contig_fill(s->arena, s->rd);
    s->home_out = AT(C_OUT);
    s->home_ws = AT(C_WS);
    /* CUDA does not know the pages a device page map names. */
    s->n_read = how == CUDA ? C_MAP + 1 : C_VP + 1;
    names = c_names;
  } else {
    paged_fill(s->arena, s->rd);
    s->home_out = AT(P_OUT);
    s->home_ws = AT(P_WS);
    /* CUDA knows neither the indices (indptr is device memory) nor pages. */
    s->n_read = how == CUDA ? P_LAST + 1 : P_VP + 1;
    names = p_names;
  }
  s->ws_bytes = ws_bytes_needed();
  memcpy(s->pristine, s->arena, ARENA);
  /* The baseline: every buffer apart (the reference's bytes serve both). */
  if (how == REF) {
    assert_int_equal(run_call(s, s->home_out, s->home_ws), AKV_OK);
    memcpy(s->want, s->arena + s->home_out, OUT_BYTES);
    for (size_t i = 0; i < OUT_BYTES / 4; ++i) {
      float f;
      memcpy(&f, s->want + 4 * i, 4);
      assert_true(isfinite(f));
    }
    memcpy(s->arena, s->pristine, ARENA);
  }
  const size_t out_al = 4, ws_al = how == CUDA ? 16 : 4;
  for (size_t k = 0; k < s->n_read; ++k) {
    sweep_pair(s, 0, s->rd[k], OUT_BYTES, out_al, names[k]);
    sweep_pair(s, 1, s->rd[k], s->ws_bytes, ws_al, names[k]);
  }
  /* out against the workspace (at home). */
  sweep_pair(s, 0, (span){s->home_ws, s->home_ws + s->ws_bytes}, OUT_BYTES, out_al,
             "the workspace");
  if (!paged) {
    /* The 2 KiB between K rows 0 and 1 of context 0 are not read: an
     * output there is taken; four bytes later it meets row 1. */
    expect_taken(s, AT(C_K) + EXTENT, s->home_ws, "out between two K rows and K rows");
    expect_refused(s, AT(C_K) + EXTENT + 4u, s->home_ws, "out and K row 1");
    /* A page the map does not name (page 1 row 1) is not read. */
    if (how == REF) expect_taken(s, AT(C_KP) + PSTRIDE + ROW, s->home_ws, "out and K page 1 row 1");
  }
  /* Each read buffer: two refusals per written buffer; adjacency where the
   * alignment allows it, at least one per read buffer and written one. */
  assert_true(s->refused >= 4u * s->n_read + 2u);
  if (takes_run(how)) assert_true(s->taken >= 2u * s->n_read);
  free(s->pristine);
  free(s->arena);
  free(s);
}

static void test_overlap_contig_ref(void **state) {
  (void)state;
  sweep_run(REF, 0);
}

static void test_overlap_paged_ref(void **state) {
  (void)state;
  sweep_run(REF, 1);
}

#ifdef AKV_WITH_CUDA
static void test_overlap_contig_cuda(void **state) {
  (void)state;
  sweep_run(CUDA, 0);
}

static void test_overlap_paged_cuda(void **state) {
  (void)state;
  sweep_run(CUDA, 1);
}
#endif

/* A property over random strides and placements against a byte map of
 * what the call reads: the reference refuses exactly when out meets a byte
 * of a K row (rows of random padding, contexts at random strides, pages of
 * a table at a random stride), and a call it takes gives the bytes of out
 * kept apart. Small geometry: 2 contexts, 2 heads over 1 kv head of 8 dims
 * (16-byte rows), chunks of 2 rows. */
#define PR_HEADS 2u
#define PR_DIM 8u
#define PR_EXT 16u
#define PR_OUT ((size_t)N_CTX * PR_HEADS * PR_DIM * 4u)

static void property_run(int paged, uint32_t seed) {
  unsigned char *arena = arena_new();
  unsigned char *pristine = (unsigned char *)malloc(ARENA);
  unsigned char *rd = (unsigned char *)calloc(ARENA, 1); /* 1: a byte the call reads */
  assert_non_null(pristine);
  assert_non_null(rd);
  memcpy(pristine, arena, ARENA);
  uint32_t s = seed;
#define RND(n) ((s = s * 1664525u + 1013904223u), (s >> 8) % (uint32_t)(n))
  unsigned refused = 0, taken = 0;
  for (int iter = 0; iter < 200; ++iter) {
    const uint64_t row = PR_EXT + 4u * RND(12); /* 16..60 */
    uint32_t len[N_CTX] = {1 + RND(4), RND(5)};
    uint32_t indptr[N_CTX + 1] = {0}, indices[6], last[N_CTX] = {0};
    const uint64_t cstride = row * (4u + RND(3)) + 4u * RND(8);
    const uint64_t pstride = row * 2u + 4u * RND(8);
    memset(rd, 0, ARENA);
    const size_t kbase = AT(C_K); /* K rows or pages; V far away in its own slot */
    if (!paged) {
      for (uint32_t i = 0; i < N_CTX; ++i)
        for (uint32_t t = 0; t < len[i]; ++t)
          memset(rd + kbase + i * cstride + t * row, 1, PR_EXT);
    } else {
      for (uint32_t i = 0; i < N_CTX; ++i) {
        const uint32_t np = (len[i] + CHUNK - 1) / CHUNK;
        for (uint32_t p = 0; p < np; ++p) {
          indices[indptr[i] + p] = RND(6); /* pages may repeat: reads only */
          const uint32_t n = p + 1 == np ? len[i] - p * CHUNK : CHUNK;
          for (uint32_t t = 0; t < n; ++t)
            memset(rd + kbase + indices[indptr[i] + p] * pstride + t * row, 1, PR_EXT);
        }
        indptr[i + 1] = indptr[i] + np;
        last[i] = np ? len[i] - (np - 1) * CHUNK : 0;
      }
    }
    size_t wsb = 0;
    assert_int_equal(akv_attention_workspace_bytes(N_CTX, PR_HEADS, PR_DIM, 4, CHUNK, &wsb),
                     AKV_OK);
    akv_attention_args a;
    memset(&a, 0, sizeof a);
    a.dtype = AKV_DTYPE_BF16;
    a.n_contexts = N_CTX;
    a.n_heads = PR_HEADS;
    a.kv_heads = 1;
    a.head_dim = PR_DIM;
    a.chunk_tokens = CHUNK;
    a.scale = 0.25f;
    a.q = arena + AT(C_Q);
    a.k_base = arena + kbase;
    a.v_base = arena + AT(C_V);
    a.context_stride = cstride;
    a.row_bytes = row;
    a.len = len;
    a.workspace = arena + AT(C_WS);
    a.workspace_bytes = wsb;
    akv_attention_paged_args pa;
    memset(&pa, 0, sizeof pa);
    pa.dtype = AKV_DTYPE_BF16;
    pa.n_heads = PR_HEADS;
    pa.kv_heads = 1;
    pa.head_dim = PR_DIM;
    pa.scale = 0.25f;
    pa.q = a.q;
    pa.workspace = a.workspace;
    pa.workspace_bytes = wsb;
    akv_page_table t;
    memset(&t, 0, sizeof t);
    t.batch = N_CTX;
    t.page_tokens = CHUNK;
    t.max_pages = 2;
    t.indptr = indptr;
    t.indices = indices;
    t.last_page_len = last;
    t.k_pages = arena + kbase;
    t.v_pages = arena + AT(C_V);
    t.page_stride = pstride;
    t.row_bytes = row;
    /* The bytes of out kept apart. */
    unsigned char want[PR_OUT];
    a.out = (float *)(void *)(arena + AT(C_OUT));
    pa.out = a.out;
    assert_int_equal(paged ? akv_attention_paged_ref_bf16(&pa, t) : akv_attention_ref_bf16(&a),
                     AKV_OK);
    memcpy(want, arena + AT(C_OUT), PR_OUT);
    memcpy(arena, pristine, ARENA);
    /* out somewhere from 160 bytes before the first row to past the last. */
    const size_t at = kbase - 160u + 4u * RND((6u * pstride + cstride * 2u + 320u) / 4u);
    int meets = 0;
    for (size_t b = at; b < at + PR_OUT; ++b) meets |= rd[b];
    a.out = (float *)(void *)(arena + at);
    pa.out = a.out;
    const akv_status st =
        paged ? akv_attention_paged_ref_bf16(&pa, t) : akv_attention_ref_bf16(&a);
    if (meets) {
      if (st != AKV_ERR_INVALID_ARGUMENT)
        fail_msg("%s iter %d: out at +%td meets a K row read, status %d", paged ? "paged" : "contig",
                 iter, (ptrdiff_t)at - (ptrdiff_t)kbase, (int)st);
      assert_memory_equal(arena, pristine, ARENA);
      refused++;
    } else {
      if (st != AKV_OK)
        fail_msg("%s iter %d: out at +%td between the rows, status %d", paged ? "paged" : "contig",
                 iter, (ptrdiff_t)at - (ptrdiff_t)kbase, (int)st);
      assert_memory_equal(arena + at, want, PR_OUT);
      memcpy(arena, pristine, ARENA);
      taken++;
    }
  }
#undef RND
  assert_true(refused >= 20 && taken >= 20); /* both sides of the rule ran */
  free(rd);
  free(pristine);
  free(arena);
}

static void test_overlap_property(void **state) {
  (void)state;
  property_run(0, 0xC0FFEEu);
  property_run(1, 0xBEEFu);
}

/* ------------------------------------------------------------------------ */
/* Extents past the end of the address space                                 */
/* ------------------------------------------------------------------------ */

/* The last bytes of the address space, aligned for every argument: no
 * buffer of the shapes below can lie there. */
#define TOP(back) ((void *)(uintptr_t)((UINTPTR_MAX - (uintptr_t)(back)) & ~(uintptr_t)255))

static void test_extents_past_the_address_space(void **state) {
  (void)state;
  unsigned char *arena = arena_new();
  span rd[C_N];
  contig_fill(arena, rd);
  unsigned char *keep = (unsigned char *)malloc(ARENA);
  assert_non_null(keep);
  memcpy(keep, arena, ARENA);
  const akv_attention_args base = contig_args(arena, AT(C_OUT), AT(C_WS));
  akv_attention_args a = base;
  assert_int_equal(akv_attention_ref_bf16(&a), AKV_OK);
  memcpy(arena, keep, ARENA);
  /* out: 2 KiB from 256 bytes before the end (the call writes it all). */
  a.out = (float *)TOP(0);
  assert_int_equal(akv_attention_ref_bf16(&a), AKV_ERR_INVALID_ARGUMENT);
  /* q: 1 KiB read from there. */
  a = base;
  a.q = TOP(0);
  assert_int_equal(akv_attention_ref_bf16(&a), AKV_ERR_INVALID_ARGUMENT);
  assert_memory_equal(arena, keep, ARENA);
  /* A page map of shape [2][2^31] uint32 at the top: its entries' addresses
   * would wrap. */
  a = base;
  a.page_map = (const uint32_t *)TOP(0);
  a.page_map_stride = 0x80000000u;
  assert_int_equal(akv_attention_ref_bf16(&a), AKV_ERR_INVALID_ARGUMENT);
  assert_memory_equal(arena, keep, ARENA);
  /* Paged: out past the end. */
  paged_fill(arena, rd);
  memcpy(keep, arena, ARENA);
  paged_call c = paged_args(arena, AT(P_OUT), AT(P_WS));
  c.a.out = (float *)TOP(0);
  assert_int_equal(akv_attention_paged_ref_bf16(&c.a, c.t), AKV_ERR_INVALID_ARGUMENT);
  assert_memory_equal(arena, keep, ARENA);
#ifdef AKV_WITH_CUDA
  a = base;
  a.out = (float *)TOP(0);
  assert_int_equal(akv_attention_decode_cuda(&a, 0), AKV_ERR_INVALID_ARGUMENT);
  a = base;
  a.page_map = (const uint32_t *)TOP(0);
  a.page_map_stride = 0x80000000u;
  assert_int_equal(akv_attention_decode_cuda(&a, 0), AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_attention_paged_cuda(&c.a, c.t, 0), AKV_ERR_INVALID_ARGUMENT);
#endif
  free(keep);
  free(arena);
}

/* ------------------------------------------------------------------------ */
/* The argument struct in memory the call writes                             */
/* ------------------------------------------------------------------------ */

/* akv_attention_args and akv_attention_paged_args are read once, on entry:
 * a caller that keeps the struct at the start of the workspace or of out
 * (memory it hands the call to write) gets the bytes of the same call with
 * the struct apart, not a call that reads its own partials back as
 * pointers and counts. */
static void test_args_struct_in_written_memory(void **state) {
  (void)state;
  unsigned char *arena = arena_new();
  span rd[C_N];
  contig_fill(arena, rd);
  const akv_attention_args base = contig_args(arena, AT(C_OUT), AT(C_WS));
  akv_attention_args a = base;
  assert_int_equal(akv_attention_ref_bf16(&a), AKV_OK);
  unsigned char want[OUT_BYTES];
  memcpy(want, arena + AT(C_OUT), OUT_BYTES);
  memset(arena + AT(C_OUT), 0, OUT_BYTES);
  /* In the workspace. */
  assert_true(sizeof base <= base.workspace_bytes);
  memcpy(arena + AT(C_WS), &base, sizeof base);
  assert_int_equal(akv_attention_ref_bf16((const akv_attention_args *)(void *)(arena + AT(C_WS))),
                   AKV_OK);
  assert_memory_equal(arena + AT(C_OUT), want, OUT_BYTES);
  /* In out. */
  memset(arena + AT(C_OUT), 0, OUT_BYTES);
  assert_true(sizeof base <= OUT_BYTES);
  memcpy(arena + AT(C_OUT), &base, sizeof base);
  assert_int_equal(akv_attention_ref_bf16((const akv_attention_args *)(void *)(arena + AT(C_OUT))),
                   AKV_OK);
  assert_memory_equal(arena + AT(C_OUT), want, OUT_BYTES);

  /* Paged: the same for akv_attention_paged_args. */
  paged_fill(arena, rd);
  paged_call c = paged_args(arena, AT(P_OUT), AT(P_WS));
  assert_int_equal(akv_attention_paged_ref_bf16(&c.a, c.t), AKV_OK);
  memcpy(want, arena + AT(P_OUT), OUT_BYTES);
  memset(arena + AT(P_OUT), 0, OUT_BYTES);
  memcpy(arena + AT(P_WS), &c.a, sizeof c.a);
  assert_int_equal(akv_attention_paged_ref_bf16(
                       (const akv_attention_paged_args *)(void *)(arena + AT(P_WS)), c.t),
                   AKV_OK);
  assert_memory_equal(arena + AT(P_OUT), want, OUT_BYTES);
  memset(arena + AT(P_OUT), 0, OUT_BYTES);
  memcpy(arena + AT(P_OUT), &c.a, sizeof c.a);
  assert_int_equal(akv_attention_paged_ref_bf16(
                       (const akv_attention_paged_args *)(void *)(arena + AT(P_OUT)), c.t),
                   AKV_OK);
  assert_memory_equal(arena + AT(P_OUT), want, OUT_BYTES);
  free(arena);
}

/* akv_attention_args_from_view with *args over *view (one buffer holding
 * both): every field it fills is the view's, as with the two apart; the view
 * is read whole before *args is written. */
static void test_args_from_view_aliased(void **state) {
  (void)state;
  static const uint32_t len[2] = {3, 4}, map[4] = {AKV_PAGE_STAGED, 1, 0, AKV_PAGE_STAGED};
  static _Alignas(256) unsigned char rows[4096], pages[4096];
  akv_view v;
  memset(&v, 0, sizeof v);
  v.step = 0x1111111111111111ull;
  v.layer = 3;
  v.n_contexts = 2;
  v.kv_heads = KV_HEADS;
  v.head_dim = HEAD_DIM;
  v.dtype = AKV_DTYPE_FP8_E5M2;
  v.row_stride = 2 * EXTENT;
  v.base = rows;
  v.context_stride = 4 * 2 * EXTENT;
  v.v_offset = EXTENT;
  v.len = len;
  v.page_tokens = CHUNK;
  v.page_map_stride = 2;
  v.page_map = map;
  v.page_map_host = map;
  v.pages = pages;
  v.page_stride = 2 * 2 * EXTENT;
  akv_attention_args want;
  memset(&want, 0, sizeof want);
  assert_int_equal(akv_attention_args_from_view(&v, &want), AKV_OK);
  union {
    akv_view v;
    akv_attention_args a;
  } u;
  memset(&u, 0, sizeof u);
  u.v = v;
  assert_int_equal(akv_attention_args_from_view(&u.v, &u.a), AKV_OK);
  assert_int_equal(u.a.dtype, want.dtype);
  assert_int_equal(u.a.n_contexts, want.n_contexts);
  assert_int_equal(u.a.kv_heads, want.kv_heads);
  assert_int_equal(u.a.head_dim, want.head_dim);
  assert_int_equal(u.a.chunk_tokens, want.chunk_tokens);
  assert_ptr_equal(u.a.k_base, want.k_base);
  assert_ptr_equal(u.a.v_base, want.v_base);
  assert_int_equal(u.a.context_stride, want.context_stride);
  assert_int_equal(u.a.row_bytes, want.row_bytes);
  assert_ptr_equal(u.a.page_map, want.page_map);
  assert_int_equal(u.a.page_map_stride, want.page_map_stride);
  assert_ptr_equal(u.a.k_pages, want.k_pages);
  assert_ptr_equal(u.a.v_pages, want.v_pages);
  assert_int_equal(u.a.page_stride, want.page_stride);
}

/* A workspace too small for what the scalars and len promise is refused
 * before the page map or the page table's indices are read: a call that
 * names 2^30 chunks of one row, a page map or indices of 4 entries (heap
 * arrays of exactly that size: the sanitizer build reports a read past
 * them) and a workspace of 1 KiB is AKV_ERR_INVALID_ARGUMENT, not a read of
 * 2^30 entries. */
static void test_workspace_refused_before_arrays_read(void **state) {
  (void)state;
  unsigned char *arena = arena_new();
  span rd[C_N];
  contig_fill(arena, rd);
  uint32_t *four = (uint32_t *)malloc(4 * sizeof(uint32_t));
  assert_non_null(four);
  for (uint32_t i = 0; i < 4; ++i) four[i] = i;
  static const uint32_t len[1] = {0x40000000u};
  akv_attention_args a = contig_args(arena, AT(C_OUT), AT(C_WS));
  a.n_contexts = 1;
  a.chunk_tokens = 1;
  a.len = len;
  a.context_stride = 0;
  a.page_map = four;
  a.page_map_stride = 0x40000000u;
  a.workspace_bytes = 1024;
  assert_int_equal(akv_attention_ref_bf16(&a), AKV_ERR_INVALID_ARGUMENT);

  paged_fill(arena, rd);
  paged_call c = paged_args(arena, AT(P_OUT), AT(P_WS));
  static const uint32_t indptr[2] = {0, 0x40000000u}, last[1] = {1};
  c.t.batch = 1;
  c.t.page_tokens = 1;
  c.t.max_pages = 0x40000000u;
  c.t.indptr = indptr;
  c.t.indices = four;
  c.t.last_page_len = last;
  c.t.page_stride = 0;
  c.a.workspace_bytes = 1024;
  assert_int_equal(akv_attention_paged_ref_bf16(&c.a, c.t), AKV_ERR_INVALID_ARGUMENT);
  free(four);
  free(arena);
}

/* The structs and the size_t the calls take by pointer, misaligned for
 * their types: AKV_ERR_INVALID_ARGUMENT with nothing read through them or
 * written, not a misaligned access (which the sanitizer build aborts on). */
static void test_misaligned_struct_pointers(void **state) {
  (void)state;
  unsigned char *arena = arena_new();
  span rd[C_N];
  contig_fill(arena, rd);
  static _Alignas(64) unsigned char buf[512];
  unsigned char *odd = buf + 4; /* 4-byte aligned: not for 8-byte members */
  const akv_attention_args a = contig_args(arena, AT(C_OUT), AT(C_WS));
  memcpy(odd, &a, sizeof a);
  const unsigned char *keep_out = arena + AT(C_OUT);
  unsigned char before[OUT_BYTES];
  memcpy(before, keep_out, OUT_BYTES);
  assert_int_equal(akv_attention_ref_bf16((const akv_attention_args *)(void *)odd),
                   AKV_ERR_INVALID_ARGUMENT);
  assert_memory_equal(keep_out, before, OUT_BYTES);
#ifdef AKV_WITH_CUDA
  assert_int_equal(akv_attention_decode_cuda((const akv_attention_args *)(void *)odd, 0),
                   AKV_ERR_INVALID_ARGUMENT);
#endif
  paged_fill(arena, rd);
  paged_call c = paged_args(arena, AT(P_OUT), AT(P_WS));
  memcpy(odd, &c.a, sizeof c.a);
  assert_int_equal(
      akv_attention_paged_ref_bf16((const akv_attention_paged_args *)(void *)odd, c.t),
      AKV_ERR_INVALID_ARGUMENT);
#ifdef AKV_WITH_CUDA
  assert_int_equal(
      akv_attention_paged_cuda((const akv_attention_paged_args *)(void *)odd, c.t, 0),
      AKV_ERR_INVALID_ARGUMENT);
#endif
  /* akv_attention_workspace_bytes: *out left as it was. */
  memset(buf, 0x5A, sizeof buf);
  assert_int_equal(akv_attention_workspace_bytes(1, 1, 64, 16, 16, (size_t *)(void *)odd),
                   AKV_ERR_INVALID_ARGUMENT);
  for (size_t i = 0; i < sizeof buf; ++i) assert_int_equal(buf[i], 0x5A);
  /* akv_attention_args_from_view: a misaligned view, a misaligned *args. */
  static _Alignas(256) unsigned char rows[256];
  akv_view v;
  memset(&v, 0, sizeof v);
  v.n_contexts = 1;
  v.kv_heads = 1;
  v.head_dim = 64;
  v.row_stride = 256;
  v.base = rows;
  v.v_offset = 128;
  memcpy(odd, &v, sizeof v);
  akv_attention_args out;
  memset(&out, 0x5A, sizeof out);
  const akv_attention_args out_keep = out;
  assert_int_equal(akv_attention_args_from_view((const akv_view *)(void *)odd, &out),
                   AKV_ERR_INVALID_ARGUMENT);
  assert_memory_equal(&out, &out_keep, sizeof out);
  memset(buf, 0x5A, sizeof buf);
  assert_int_equal(akv_attention_args_from_view(&v, (akv_attention_args *)(void *)odd),
                   AKV_ERR_INVALID_ARGUMENT);
  for (size_t i = 0; i < sizeof buf; ++i) assert_int_equal(buf[i], 0x5A);
  /* The same calls aligned are taken. */
  assert_int_equal(akv_attention_args_from_view(&v, &out), AKV_OK);
  free(arena);
}

/* ------------------------------------------------------------------------ */
/* Config: a page is an attention chunk                                      */
/* ------------------------------------------------------------------------ */

static void silent_log(void *user, akv_log_level level, const char *message) {
  (void)user, (void)level, (void)message;
}

/* A config whose page is page_tokens rows of a history of 2^32 - 1 rows of
 * 1-byte rows: akv_fit answers a verdict (AKV_OK) unless a field is out of
 * range. */
static akv_engine_config big_page_cfg(uint32_t page_tokens) {
  akv_engine_config c;
  assert_int_equal(akv_engine_config_init(&c), AKV_OK);
  c.backend = AKV_BACKEND_HOST;
  c.n_dense_layers = 1;
  c.kv_heads = 1;
  c.head_dim = 1;
  c.dtype = AKV_DTYPE_FP8_E4M3;
  c.max_tokens = UINT32_MAX;
  c.page_tokens = page_tokens;
  c.host_pool_gib = 1;
  c.max_contexts = 1;
  c.log_fn = silent_log;
  return c;
}

static void test_config_page_beyond_attention_chunk(void **state) {
  (void)state;
  akv_fit_report r, keep;
  /* One row past the bound: refused by both, nothing written. */
  akv_engine_config c = big_page_cfg(AKV_ATTENTION_MAX_CHUNK_TOKENS + 1u);
  memset(&r, 0x5A, sizeof r);
  memcpy(&keep, &r, sizeof r);
  assert_int_equal(akv_fit(&c, &r), AKV_ERR_CONFIG);
  assert_memory_equal(&r, &keep, sizeof r);
  akv_engine *e = (akv_engine *)(uintptr_t)0x1234;
  assert_int_equal(akv_engine_create(&c, &e), AKV_ERR_CONFIG);
  assert_true(e == (akv_engine *)(uintptr_t)0x1234);
  c.page_tokens = UINT32_MAX;
  assert_int_equal(akv_fit(&c, &r), AKV_ERR_CONFIG);
  assert_int_equal(akv_engine_create(&c, &e), AKV_ERR_CONFIG);
  /* Every route (the engine cannot tell whose attention runs), with a device
   * pool that holds a page: the bound is taken, one row past it is not. */
  const akv_route routes[2] = {AKV_ROUTE_ARENA, AKV_ROUTE_PAGED};
  for (int i = 0; i < 2; ++i) {
    c = big_page_cfg(AKV_ATTENTION_MAX_CHUNK_TOKENS);
    c.route = routes[i];
    c.device_pool_gib = 9; /* one page of 2 * 0xFF000000 B */
    assert_int_equal(akv_fit(&c, &r), AKV_OK);
    c.page_tokens = AKV_ATTENTION_MAX_CHUNK_TOKENS + 1u;
    assert_int_equal(akv_fit(&c, &r), AKV_ERR_CONFIG);
  }
  /* The bound itself: a verdict (this pool holds no such history). */
  c = big_page_cfg(AKV_ATTENTION_MAX_CHUNK_TOKENS);
  assert_int_equal(akv_fit(&c, &r), AKV_OK);
  assert_int_equal(r.ok, 0);
  assert_int_equal(akv_engine_create(&c, &e), AKV_ERR_NO_FIT);
  assert_true(e == (akv_engine *)(uintptr_t)0x1234);
  /* And the chunk the bound names is one the attention takes. */
  size_t ws = 0;
  assert_int_equal(akv_attention_workspace_bytes(1, 1, 64, AKV_ATTENTION_MAX_CHUNK_TOKENS,
                                                 AKV_ATTENTION_MAX_CHUNK_TOKENS, &ws),
                   AKV_OK);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_overlap_contig_ref),
      cmocka_unit_test(test_overlap_paged_ref),
#ifdef AKV_WITH_CUDA
      cmocka_unit_test(test_overlap_contig_cuda),
      cmocka_unit_test(test_overlap_paged_cuda),
#endif
      cmocka_unit_test(test_overlap_property),
      cmocka_unit_test(test_extents_past_the_address_space),
      cmocka_unit_test(test_args_struct_in_written_memory),
      cmocka_unit_test(test_args_from_view_aliased),
      cmocka_unit_test(test_workspace_refused_before_arrays_read),
      cmocka_unit_test(test_misaligned_struct_pointers),
      cmocka_unit_test(test_config_page_beyond_attention_chunk),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
