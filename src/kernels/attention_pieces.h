/*
 * attention_pieces.h - how the reference attention cuts a chunk into pieces
 * and decodes one-byte elements; shared by attention_ref.c and
 * attention_cuda.cu (host side) so that both lay out the same partials in
 * the same workspace (akv_attention.h, "Algorithm").
 *
 * A piece is the rows one CUDA block streams. Chunk c of a context (the
 * caller's chunk_tokens rows, its page on the paged routes) is cut into
 * akv_attn_pieces(chunk_tokens) pieces of akv_attn_piece_rows(chunk_tokens)
 * rows, the last piece of the last chunk possibly shorter and pieces past
 * the end of the history absent. The cut depends on chunk_tokens alone:
 * never on lengths, contexts, the device or timing, so every route and
 * every run that attends over the same rows with the same chunk computes the
 * same partials in the same order.
 *
 * Internal header (src/kernels/); nothing here is part of the public API.
 */
#ifndef AKV_ATTENTION_PIECES_H
#define AKV_ATTENTION_PIECES_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "akv_attention.h"

/* Rows per piece the cut aims at: a chunk of chunk_tokens rows is cut into
 * floor(chunk_tokens / AKV_ATTN_PIECE_TOKENS) pieces (at least one); 0 keeps
 * every chunk whole. The library cuts at 256 rows: a chunk of up to 511 rows
 * stays whole, larger chunks (pages of 1,024 tokens) become pieces of 256
 * rows or more, the stream one warp of chunk kernel 3 takes, so that a
 * context of few large chunks still spreads over as many warps as one of
 * 256-token chunks (docs/benchmarks.md, attention kernel: one context in
 * chunks of 1,024, 77 us whole against 40 us in chunks of 256, bf16).
 * Pieces of 128 rows under chunks of 256 were slower with kernel 1 (one
 * context 71 us against 60 us): more blocks cost more than they spread.
 * bench/attention_bw.cu builds variants with other values
 * (-DAKV_ATTN_PIECE_TOKENS=128, =0, ...); they must be applied to both
 * attention_ref.c and attention_cuda.cu, which share the workspace size. */
#ifndef AKV_ATTN_PIECE_TOKENS
#define AKV_ATTN_PIECE_TOKENS 256
#endif

/* Rows of every piece but possibly the last of a context: ceil(chunk / s)
 * with s = max(1, floor(chunk / AKV_ATTN_PIECE_TOKENS)) the pieces the cut
 * aims at; >= 1 (chunk_tokens >= 1). */
static inline uint32_t akv_attn_piece_rows(uint32_t chunk_tokens) {
  uint32_t s = AKV_ATTN_PIECE_TOKENS > 0 ? chunk_tokens / (uint32_t)AKV_ATTN_PIECE_TOKENS : 1u;
  if (s == 0) s = 1u;
  return chunk_tokens / s + (chunk_tokens % s != 0);
}

/* Pieces per chunk, >= 1: ceil(chunk / piece_rows), the pieces that hold
 * rows. Invariant: (pieces - 1) * piece_rows < chunk_tokens <= pieces *
 * piece_rows, so every piece of a full chunk has rows and every piece slot
 * the combine counts (akv_attn_context_slots) is one stage 1 writes. The
 * aimed-at s pieces can leave the last ones empty (chunk 66,049: s = 258
 * pieces of 257 rows, 257 of which hold every row): counted as pieces,
 * their slots were never written and the combine read the workspace's old
 * bytes as partials. */
static inline uint32_t akv_attn_pieces(uint32_t chunk_tokens) {
  const uint32_t r = akv_attn_piece_rows(chunk_tokens);
  if (r == 0) return 1u; /* chunk_tokens 0: refused by every caller (akv_attn_chunk_ok) */
  return chunk_tokens / r + (chunk_tokens % r != 0);
}

/* Whether a uint32_t or float array of the arguments may be read through
 * its type: the same rule in the reference and on CUDA (NULL is aligned;
 * the callers check NULL apart). */
static inline int akv_attn_aligned4(const void *p) { return ((uintptr_t)p & 3u) == 0; }

/* Whether p may be read or written as an object of alignment `align` (a
 * power of two): the argument structs, the view and the size_t the calls
 * take by pointer are checked before any access through them. */
static inline int akv_attn_aligned_to(const void *p, size_t align) {
  return ((uintptr_t)p & (uintptr_t)(align - 1u)) == 0;
}

/* Whether a chunk of chunk_tokens rows is one the calls take (akv_attention.h,
 * AKV_ATTENTION_MAX_CHUNK_TOKENS): 1..AKV_ATTENTION_MAX_CHUNK_TOKENS rows,
 * and the row after its last piece, pieces * piece_rows, fits 32 bits, so
 * that the first row of every piece (piece * piece_rows, a uint32_t in
 * attention_ref.c's chunk_partials() and in the chunk kernels) and the
 * loops that step past the last piece never wrap. With the library's
 * AKV_ATTN_PIECE_TOKENS the bound implies the second test (pieces end before
 * c + c / 256 <= 0xFFFF0000); it stays for the benchmark's variants (128:
 * the pieces of chunks above about 4.26e9 rows end past 2^32). Checked on
 * the host by every call and by akv_attention_workspace_bytes, before
 * anything is read. */
static inline int akv_attn_chunk_ok(uint32_t chunk_tokens) {
  if (chunk_tokens == 0 || chunk_tokens > AKV_ATTENTION_MAX_CHUNK_TOKENS) return 0;
  return (uint64_t)akv_attn_pieces(chunk_tokens) * akv_attn_piece_rows(chunk_tokens) <=
         UINT32_MAX;
}

/* Partials of a context whose history is n_chunks chunks, the last holding
 * last_rows rows (1..chunk_tokens): every piece of the full chunks, then the
 * non-empty pieces of the last one. 0 for an empty history. */
static inline uint64_t akv_attn_context_slots(uint32_t n_chunks, uint32_t last_rows,
                                              uint32_t chunk_tokens) {
  if (n_chunks == 0) return 0;
  const uint32_t p = akv_attn_piece_rows(chunk_tokens);
  return (uint64_t)(n_chunks - 1) * akv_attn_pieces(chunk_tokens) + last_rows / p +
         (last_rows % p != 0);
}

/* Whether rows 0..last_row of slot `index` at base + index*stride +
 * r*row_bytes, each `extent` bytes, are addressable: every byte offset from
 * base fits ptrdiff_t (no 64-bit product or sum wraps) and the address of the
 * last byte does not wrap the address space. The calls check it for every
 * row they read before anything is written, so hostile strides, lengths or
 * page ids are refused instead of landing, wrapped, on other rows. */
static inline int akv_attn_rows_addressable(const void *base, uint64_t index, uint64_t stride,
                                            uint64_t last_row, uint64_t row_bytes,
                                            uint64_t extent) {
  const uint64_t lim = (uint64_t)PTRDIFF_MAX;
  if (stride != 0 && index > lim / stride) return 0;
  if (row_bytes != 0 && last_row > lim / row_bytes) return 0;
  const uint64_t a = index * stride, b = last_row * row_bytes;
  if (a > lim - b || extent > lim - (a + b)) return 0;
  return a + b + extent <= (uint64_t)(UINTPTR_MAX - (uintptr_t)base);
}

/* ------------------------------------------------------------------------
 * Overlap (akv_attention.h, "Overlap"): the bytes a call writes (out and the
 * part of the workspace it uses) may not be bytes it reads or other bytes it
 * writes. Checked on the host with pointer comparisons over extents formed
 * without wrapping, before anything is written.
 */

/* The bytes [lo, hi) of the address space; lo == hi: none. */
typedef struct akv_attn_span {
  uintptr_t lo, hi;
} akv_attn_span;

/* Whether a * b * c * d fits 64 bits (*out: the product). */
static inline int akv_attn_mul4(uint64_t a, uint64_t b, uint64_t c, uint64_t d, uint64_t *out) {
  uint64_t x = a;
  if (b != 0 && x > UINT64_MAX / b) return 0;
  x *= b;
  if (c != 0 && x > UINT64_MAX / c) return 0;
  x *= c;
  if (d != 0 && x > UINT64_MAX / d) return 0;
  *out = x * d;
  return 1;
}

/* The n bytes at p as a span (NULL or n == 0: none); 0 when they would pass
 * the end of the address space (no buffer of the argument's shape can lie
 * there). */
static inline int akv_attn_span_at(const void *p, uint64_t n, akv_attn_span *s) {
  const uintptr_t a = (uintptr_t)p;
  s->lo = s->hi = a;
  if (p == NULL || n == 0) return 1;
  if (n > (uint64_t)(UINTPTR_MAX - a)) return 0;
  s->hi = a + (uintptr_t)n;
  return 1;
}

/* Whether the n elements of `esize` bytes at p (NULL: none) end within the
 * address space. Invariant: a call checks this for every host array it
 * reads (len, the scales, the page table's indptr, last_page_len and
 * indices) before its first read of it, so that one whose shape runs past
 * the end of the address space is refused (akv_attention.h, "Overlap")
 * instead of read: no buffer of that shape can lie there, and its first
 * element (in the last bytes of the address space) faulted. */
static inline int akv_attn_array_fits(const void *p, uint64_t n, uint64_t esize) {
  akv_attn_span s;
  uint64_t bytes;
  return akv_attn_mul4(n, esize, 1, 1, &bytes) && akv_attn_span_at(p, bytes, &s);
}

/* Whether two spans share a byte (adjacent spans do not). */
static inline int akv_attn_spans_meet(akv_attn_span a, akv_attn_span b) {
  return a.lo < a.hi && b.lo < b.hi && a.lo < b.hi && b.lo < a.hi;
}

/* What a call writes: out and the workspace bytes it uses. */
typedef struct akv_attn_writes {
  akv_attn_span out, ws;
} akv_attn_writes;

/* Whether span r (bytes the call reads) shares a byte with what it writes. */
static inline int akv_attn_writes_meet(const akv_attn_writes *w, akv_attn_span r) {
  return akv_attn_spans_meet(w->out, r) || akv_attn_spans_meet(w->ws, r);
}

/* Whether the n elements of `esize` bytes at p (a read array) are clear of
 * what the call writes; 0 also when they would pass the end of the address
 * space. */
static inline int akv_attn_array_clear(const akv_attn_writes *w, const void *p, uint64_t n,
                                       uint64_t esize) {
  akv_attn_span s;
  uint64_t bytes;
  return akv_attn_mul4(n, esize, 1, 1, &bytes) && akv_attn_span_at(p, bytes, &s) &&
         !akv_attn_writes_meet(w, s);
}

/* Whether span w shares a byte with one of rows 0..last_row at first +
 * t*row_bytes, each `extent` bytes (the bytes between rows are not read, so
 * a span that lies between them does not meet them). The rows are
 * addressable (akv_attn_rows_addressable): nothing below wraps. */
static inline int akv_attn_rows_meet(akv_attn_span w, uintptr_t first, uint64_t last_row,
                                     uint64_t row_bytes, uint64_t extent) {
  if (w.lo >= w.hi || extent == 0) return 0;
  const uintptr_t end = first + (uintptr_t)(last_row * row_bytes + extent);
  if (w.hi <= first || w.lo >= end) return 0;
  /* The first row that ends past w.lo; rows start in order, so w meets a
   * row exactly when that one starts before w.hi. */
  uint64_t t = 0;
  if (w.lo > first && (uint64_t)(w.lo - first) >= extent) {
    if (row_bytes == 0) return 0;
    t = ((uint64_t)(w.lo - first) - extent) / row_bytes + 1u;
  }
  return t <= last_row && first + (uintptr_t)(t * row_bytes) < w.hi;
}

/* Whether rows 0..last_row of slot `index` at base + index*stride +
 * r*row_bytes, each `extent` bytes (akv_attn_rows_addressable, which the
 * caller has checked for them), are clear of what the call writes. */
static inline int akv_attn_rows_clear(const akv_attn_writes *w, const void *base, uint64_t index,
                                      uint64_t stride, uint64_t last_row, uint64_t row_bytes,
                                      uint64_t extent) {
  const uintptr_t first = (uintptr_t)base + (uintptr_t)(index * stride);
  return !akv_attn_rows_meet(w->out, first, last_row, row_bytes, extent) &&
         !akv_attn_rows_meet(w->ws, first, last_row, row_bytes, extent);
}

/* The spans both variants share: out ([n_contexts][n_heads][head_dim] fp32)
 * and the ws_used bytes of the workspace into *w, then the checks that they
 * fit the address space, that out and the workspace do not meet, and that
 * neither meets q ([n_contexts][n_heads][head_dim] bf16) or the scales
 * ([kv_heads] floats each, where set). */
static inline int akv_attn_dense_clear(uint32_t n_contexts, uint32_t n_heads, uint32_t head_dim,
                                       uint32_t kv_heads, const void *q, const float *out,
                                       const void *workspace, uint64_t ws_used,
                                       const float *k_scale, const float *v_scale,
                                       akv_attn_writes *w) {
  uint64_t out_bytes;
  if (!akv_attn_mul4(n_contexts, n_heads, head_dim, 4u, &out_bytes) ||
      !akv_attn_span_at(out, out_bytes, &w->out) || !akv_attn_span_at(workspace, ws_used, &w->ws))
    return 0;
  if (akv_attn_spans_meet(w->out, w->ws)) return 0;
  if (!akv_attn_array_clear(w, q, (uint64_t)n_contexts * n_heads, (uint64_t)head_dim * 2u))
    return 0;
  if (k_scale != NULL &&
      (!akv_attn_array_clear(w, k_scale, kv_heads, 4u) ||
       !akv_attn_array_clear(w, v_scale, kv_heads, 4u)))
    return 0;
  return 1;
}

/* Bytes of one element of a dtype the reference attention reads, 0 for a
 * dtype it does not take (f16, f32, values outside akv_dtype). */
static inline uint32_t akv_attn_elem_bytes(akv_dtype dtype) {
  switch (dtype) {
  case AKV_DTYPE_BF16: return 2;
  case AKV_DTYPE_FP8_E4M3:
  case AKV_DTYPE_FP8_E5M2: return 1;
  default: return 0;
  }
}

/* log2(e) in fp32: the score factor's base change, the same constant in the
 * reference and the CUDA launcher (c_g = (scale * log2(e)) * k_scale[g]). */
#define AKV_ATTN_LOG2E_F 1.44269504088896340736f

/* The argument checks the reference (attention_ref.c) and the CUDA
 * launcher (attention_cuda.cu) share, in one order, so that both return the
 * same status for the same call; each adds its own alignment and shape
 * rules after it. The scales are read here, on the host, once, after
 * their arrays are known to end within the address space. A non-finite
 * softmax scale makes every score infinite or NaN, and so does a finite one
 * whose score factor overflows: the check forms the very products the
 * kernels use (scale * log2(e), times k_scale[g]), so every factor a call
 * computes is finite. */
static inline akv_status akv_attn_args_check(akv_dtype dtype, uint32_t n_heads,
                                             uint32_t kv_heads, uint32_t head_dim,
                                             uint64_t row_bytes, float scale, const void *q,
                                             const float *out, const float *k_scale,
                                             const float *v_scale) {
  if (q == NULL || out == NULL) return AKV_ERR_INVALID_ARGUMENT;
  if (n_heads == 0 || kv_heads == 0 || n_heads % kv_heads != 0) return AKV_ERR_INVALID_ARGUMENT;
  if (head_dim == 0 || head_dim > AKV_ATTENTION_MAX_HEAD_DIM) return AKV_ERR_INVALID_ARGUMENT;
  const uint32_t esize = akv_attn_elem_bytes(dtype);
  if (esize == 0) return AKV_ERR_NOT_SUPPORTED;
  if (row_bytes < (uint64_t)kv_heads * head_dim * esize) return AKV_ERR_INVALID_ARGUMENT;
  /* Scales: both or neither, required for FP8 (codes mean nothing without
   * them), finite and positive, few enough to travel in kernel parameters. */
  if ((k_scale == NULL) != (v_scale == NULL)) return AKV_ERR_INVALID_ARGUMENT;
  if (esize == 1 && k_scale == NULL) return AKV_ERR_INVALID_ARGUMENT;
  if (k_scale != NULL) {
    if (kv_heads > AKV_ATTENTION_MAX_SCALE_HEADS) return AKV_ERR_INVALID_ARGUMENT;
    if (!akv_attn_aligned4(k_scale) || !akv_attn_aligned4(v_scale))
      return AKV_ERR_INVALID_ARGUMENT;
    if (!akv_attn_array_fits(k_scale, kv_heads, 4u) || !akv_attn_array_fits(v_scale, kv_heads, 4u))
      return AKV_ERR_INVALID_ARGUMENT; /* before the reads below */
    for (uint32_t g = 0; g < kv_heads; ++g)
      if (!(isfinite(k_scale[g]) && k_scale[g] > 0.0f && isfinite(v_scale[g]) &&
            v_scale[g] > 0.0f))
        return AKV_ERR_INVALID_ARGUMENT;
  }
  if (!isfinite(scale)) return AKV_ERR_INVALID_ARGUMENT;
  const float scale_log2 = scale * AKV_ATTN_LOG2E_F;
  if (!isfinite(scale_log2)) return AKV_ERR_INVALID_ARGUMENT;
  if (k_scale != NULL)
    for (uint32_t g = 0; g < kv_heads; ++g)
      if (!isfinite(scale_log2 * k_scale[g])) return AKV_ERR_INVALID_ARGUMENT;
  return AKV_OK;
}

/* Whether what a contiguous call writes (out, the ws_used workspace bytes)
 * is clear of what it reads and of each other (akv_attention.h, "Overlap"):
 * q, the scales, len, the rows of every context and the page map entries it
 * reads; with `pages_visible` (the reference, whose pages are host memory)
 * also the rows of every page the map names. The CUDA launcher cannot see
 * device pages and passes 0. Runs after the addressing checks (every row
 * addressable, the chunk positive), before anything is written. */
static inline int akv_attn_contig_clear(const akv_attention_args *a, uint64_t ws_used,
                                        int pages_visible) {
  akv_attn_writes w;
  if (!akv_attn_dense_clear(a->n_contexts, a->n_heads, a->head_dim, a->kv_heads, a->q, a->out,
                            a->workspace, ws_used, a->k_scale, a->v_scale, &w) ||
      !akv_attn_array_clear(&w, a->len, a->n_contexts, 4u))
    return 0;
  const uint64_t extent = (uint64_t)a->kv_heads * a->head_dim * akv_attn_elem_bytes(a->dtype);
  for (uint32_t i = 0; i < a->n_contexts; ++i) {
    const uint32_t len = a->len[i];
    if (len == 0) continue;
    if (!akv_attn_rows_clear(&w, a->k_base, i, a->context_stride, len - 1u, a->row_bytes,
                             extent) ||
        !akv_attn_rows_clear(&w, a->v_base, i, a->context_stride, len - 1u, a->row_bytes, extent))
      return 0;
    if (a->page_map == NULL) continue;
    const uint32_t n_chunks = len / a->chunk_tokens + (len % a->chunk_tokens != 0);
    const uint32_t n_map = n_chunks < a->page_map_stride ? n_chunks : a->page_map_stride;
    const uint32_t *map = a->page_map + (size_t)i * a->page_map_stride;
    if (!akv_attn_array_clear(&w, map, n_map, 4u)) return 0;
    for (uint32_t c = 0; pages_visible && c < n_map; ++c) {
      const uint32_t rem = len - c * a->chunk_tokens;
      const uint32_t n = rem < a->chunk_tokens ? rem : a->chunk_tokens;
      if (map[c] != AKV_PAGE_STAGED &&
          (!akv_attn_rows_clear(&w, a->k_pages, map[c], a->page_stride, n - 1u, a->row_bytes,
                                extent) ||
           !akv_attn_rows_clear(&w, a->v_pages, map[c], a->page_stride, n - 1u, a->row_bytes,
                                extent)))
        return 0;
    }
  }
  return 1;
}

#endif /* AKV_ATTENTION_PIECES_H */
