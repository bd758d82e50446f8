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

/* Pieces per chunk, >= 1 (chunk_tokens >= 1). */
static inline uint32_t akv_attn_pieces(uint32_t chunk_tokens) {
  const uint32_t s = AKV_ATTN_PIECE_TOKENS > 0 ? chunk_tokens / (uint32_t)AKV_ATTN_PIECE_TOKENS : 1u;
  return s > 0 ? s : 1u;
}

/* Rows of every piece but possibly the last of a context: ceil(chunk / pieces). */
static inline uint32_t akv_attn_piece_rows(uint32_t chunk_tokens) {
  const uint32_t s = akv_attn_pieces(chunk_tokens);
  return chunk_tokens / s + (chunk_tokens % s != 0);
}

/* Whether a uint32_t or float array of the arguments may be read through
 * its type: the same rule in the reference and on CUDA (NULL is aligned;
 * the callers check NULL apart). */
static inline int akv_attn_aligned4(const void *p) { return ((uintptr_t)p & 3u) == 0; }

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

#endif /* AKV_ATTENTION_PIECES_H */
