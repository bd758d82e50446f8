/*
 * akv_attention.h - reference GQA decode attention (DESIGN §8), C API.
 *
 * One query token per context attends over that context's K/V history. The
 * same chunked algorithm runs on the CPU (this header, usable without CUDA)
 * and on the GPU (akv_cuda.h), so that a CPU engine, a test, or the bundled
 * CLI can check one against the other.
 *
 * Layouts:
 *  - q:   [n_contexts][n_heads][head_dim] bf16, dense (every dtype).
 *  - K/V: token-major rows. Row t of context i holds [kv_heads][head_dim]
 *         elements of `dtype` for K at k_base + i*context_stride + t*row_bytes
 *         and for V at v_base + i*context_stride + t*row_bytes. This is
 *         akv_view: pass k_base = view.base and v_base = view.base +
 *         view.v_offset.
 *  - out: [n_contexts][n_heads][head_dim] fp32, dense.
 * Query head h reads KV head h / (n_heads / kv_heads) (grouped-query attention).
 *
 * Element types (dtype): AKV_DTYPE_BF16, AKV_DTYPE_FP8_E4M3 and
 * AKV_DTYPE_FP8_E5M2 (one byte per element). FP8 rows hold codes; the value
 * of an element of KV head g is its decoded code times k_scale[g] (K) or
 * v_scale[g] (V): one scale per (layer, KV head) for K and one for V, owned
 * by the caller and passed with each call (the caller passes the layer's
 * scales; the engine moves bytes and never sees a scale). Decoding a code is
 * exact in fp32, so in the reference the scales are the only difference
 * between an FP8 call and a bf16 call over the decoded values (the CUDA
 * kernels take FP8 through f16 tensor-core products and bf16 through bf16
 * ones, so there the two agree within the bound below, not bit for bit).
 * Scales are optional for bf16
 * (NULL means 1) and required for FP8.
 *
 * Algorithm (fixed; both implementations follow it):
 *  1. The history of each context is cut into chunks of chunk_tokens rows
 *     (the caller passes its page size), and each chunk into pieces of
 *     R = ceil(chunk_tokens / max(1, floor(chunk_tokens / T))) rows, P =
 *     ceil(chunk_tokens / R) of them, T being a build constant
 *     (AKV_ATTN_PIECE_TOKENS; the library is built with T = 256: chunks of
 *     up to 511 rows stay whole, larger ones are cut into pieces of 256 rows
 *     or more). The last piece of a context may be shorter; empty pieces do
 *     not exist (P counts only pieces that hold rows: a chunk of 66,049 rows
 *     is 257 pieces of 257 rows, not 258). For each (context, query head,
 *     piece) a partial is computed in
 *     fp32 over the piece's rows k_t, v_t (decoded codes for FP8):
 *     scores s_t = (q . k_t) * c_g with c_g = (scale * log2(e)) * k_scale[g]
 *     (scale * log2(e) without K scales), m = max_t s_t,
 *     l = sum_t 2^(s_t - m), acc = sum_t 2^(s_t - m) * v_t.
 *  2. The partials of a context are combined in a fixed order:
 *     M = max_c m_c, w_c = 2^(m_c - M),
 *     out = (sum_c w_c acc_c) / (sum_c w_c l_c) * v_scale[g] (no factor
 *     without V scales). The CUDA kernel first merges each span of 8
 *     consecutive pieces the same way (m, l and acc of the span, pieces in
 *     order, no division) and combines the spans; the reference combines
 *     the pieces directly.
 *  The cut depends on chunk_tokens alone, never on lengths, the number of
 *  contexts, the device or timing. Reductions have a fixed order and use no
 *  atomics: identical inputs give identical bits on every run. A context of
 *  length 0 gets an output of zeros.
 *  Values are not checked: a NaN or infinite q, K or V element, an FP8 NaN
 *  code, or a score s_t that overflows fp32 makes that context's output
 *  meaningless, with status AKV_OK. Both implementations write zeros only
 *  where the denominator sum_c w_c l_c is exactly 0 (no rows, or every
 *  score -inf); a NaN denominator (a NaN score: NaN q or K element, FP8 NaN
 *  code, a score that overflowed) gives NaN in the heads it reaches, never a
 *  plausible 0. The scale arguments are checked (see the fields).
 *
 * Equality guarantees:
 *  - Contiguous arguments with page overrides (the paged route of an engine,
 *    akv_attention_args.page_map) give the same bits as the contiguous call
 *    over the same rows: only where a chunk's rows are read from changes.
 *  - The paged variant with page_tokens == chunk_tokens over the same rows
 *    gives the SAME BITS as the contiguous variant, on the CPU and on the GPU
 *    (chunk boundaries fall on page boundaries, and each chunk is computed by
 *    the same code).
 *  - CPU and GPU results are not bit-identical (exp2 implementations, FMA
 *    contraction, reduction trees, tensor-core accumulation); they agree to
 *    a relative L2 error below 1e-5, for bf16 and FP8 alike, on inputs of
 *    the usual magnitudes (tests/gpu/test_gpu_attention.cu states and
 *    checks the bound; what larger scores cost is in the next bullet, and
 *    applies to each of the two). The GPU
 *    kernel forms q . k and the products with v on tensor cores: bf16 and
 *    f16 products are exact and accumulate in fp32, the probabilities enter
 *    the v products as two terms (22 significant bits); for FP8 the query of
 *    each head is scaled by a power of two and rounded to f16, which keeps
 *    every component within a factor 2^31 of the head's largest exactly.
 *  - Against exact arithmetic over the same (decoded, scaled) values, the
 *    reference's fp32 result is within a relative L2 error of 1e-5 on
 *    inputs of the usual magnitudes (tests/test_attention_ref.c checks it
 *    against a double-precision attention, bf16 and FP8, with elements of
 *    magnitude up to a few units and scale 1/sqrt(head_dim)). That bound is
 *    not unconditional, and no fp32 implementation of this algorithm can
 *    make it so: every score is formed and kept in fp32, an absolute error
 *    of up to about (head_dim + 2) * 2^-24 * S_t, S_t = |c_g| * sum_j
 *    |q_j k_tj|, that the exponential turns into a relative error of the
 *    row's weight. So the error grows with the largest S_t of a context
 *    (two rows whose scores are near 94,548 and differ by 1.4 are weighted
 *    with an error near 6e-4); the relative L2 error stays below 1e-5 +
 *    (head_dim + 2) * 2^-24 * max_t S_t for an output whose V terms do not
 *    cancel, while one that cancels (sum_t p_t v_t small against sum_t
 *    p_t |v_t|) has its error relative to sum_t p_t |v_t|; and a partial
 *    sum that leaves the fp32 range (V elements near 3.4e38, dot products
 *    whose terms overflow) gives inf or NaN even where the exact result
 *    is finite (tests/test_audit_s28_ga.c, accuracy).
 *
 * Workspace: the per-chunk partials live in a caller-owned workspace sized by
 * akv_attention_workspace_bytes (host memory for the reference, device memory
 * for CUDA). The functions here never allocate.
 *
 * Addressing: every row a call reads lies at a byte offset from its base
 * pointer (i*context_stride + t*row_bytes from k_base/v_base for rows 0..len-1
 * of context i, overridden or not; entry*page_stride + r*row_bytes from
 * k_pages/v_pages for a page). Such an offset plus the row's
 * kv_heads*head_dim elements must fit ptrdiff_t and the address must not wrap;
 * a call that would form another offset is refused with
 * AKV_ERR_INVALID_ARGUMENT before anything is written. The reference checks
 * every row it reads; CUDA checks the contiguous rows only (page maps and
 * page tables are device memory there). Whether the memory behind a valid
 * offset belongs to the caller's buffers is the caller's business.
 *
 * Overlap: the bytes a call writes, out and the first
 * akv_attention_workspace_bytes(...) bytes of the workspace (the figure for
 * the call's own geometry: its longest len, or max_pages * page_tokens),
 * must not be bytes it reads, nor each other's. Read are q, len, k_scale,
 * v_scale, the rows of "Addressing" (rows 0..len-1 of every context at
 * k_base and v_base, overridden or not, each its kv_heads*head_dim
 * elements; the rows of every overriding page; the rows of every page of a
 * page table), the page map entries the call looks up (chunks 0..
 * min(chunks, page_map_stride)-1 of every context that has rows) and the
 * page table's indptr, last_page_len and indices[0..indptr[batch]). Bytes
 * between rows (row_bytes beyond a row's elements, context_stride beyond a
 * context's rows) are not read: an output there is taken. A call whose
 * written bytes meet any of these, or one of whose arrays (q, out, len,
 * the scales, the page map's [n_contexts][page_map_stride], the page
 * table's arrays) would run past the end of the address space, is refused with
 * AKV_ERR_INVALID_ARGUMENT before anything is written; exactly adjacent
 * buffers are taken. CUDA checks what the host knows: everything above but
 * the pages a page map names (the map is device memory) and, for a page
 * table, its indices and pages (indptr is device memory); overlap there
 * is the caller's error, with undefined results. The argument structs
 * themselves (akv_attention_args, akv_attention_paged_args) are read once,
 * on entry: they may lie anywhere, in out or the workspace included.
 *
 * Alignment (reference): q is 2-byte aligned, out and workspace 4-byte
 * aligned, and so are the uint32 and float arrays (len, page_map, the page
 * table's indptr, indices and last_page_len, k_scale, v_scale); K/V rows,
 * strides and pages take any alignment. CUDA asks for more (akv_cuda.h).
 * Every function here also refuses, with AKV_ERR_INVALID_ARGUMENT and before
 * any access through it, a struct or size_t pointer (args, view, the
 * workspace size's out) not aligned for its type.
 *
 * Thread safety: every function is reentrant; concurrent calls are safe as
 * long as they do not share an output or a workspace.
 *
 * ABI: the argument structs below follow the library's promise (akv.h): within
 * one major version their fields are never reordered or removed.
 */
#ifndef AKV_ATTENTION_H
#define AKV_ATTENTION_H

#include <stddef.h>
#include <stdint.h>

#include "akv.h"

#ifdef __cplusplus
extern "C" {
#endif

/** Largest head_dim the reference accepts (the CUDA kernels take 64, 128, 256). */
#define AKV_ATTENTION_MAX_HEAD_DIM 256u

/** Largest kv_heads of a call that passes scales (the CUDA launchers carry
 *  the scales in the kernel parameters). */
#define AKV_ATTENTION_MAX_SCALE_HEADS 256u

/** Largest chunk_tokens (paged: page_tokens) the calls and
 *  akv_attention_workspace_bytes accept: 255 * 2^24 rows. The first row of
 *  every piece of a chunk and the end of its last piece (see "Algorithm")
 *  are 32-bit row numbers in both implementations; up to this size they fit
 *  (the pieces of a chunk of c rows end before row c + c / 256). A larger
 *  chunk is refused with AKV_ERR_INVALID_ARGUMENT by the reference and by
 *  CUDA alike, whatever the lengths, before anything is read. */
#define AKV_ATTENTION_MAX_CHUNK_TOKENS 0xFF000000u

/**
 * Contiguous decode attention over n_contexts histories (see the layout above).
 * Plain arguments, owning nothing; every pointer is borrowed for the call
 * (CPU) or until the enqueued work has run (CUDA).
 */
typedef struct akv_attention_args {
  akv_dtype dtype;        /**< AKV_DTYPE_BF16, AKV_DTYPE_FP8_E4M3 or AKV_DTYPE_FP8_E5M2 */
  uint32_t n_contexts;    /**< >= 1 */
  uint32_t n_heads;       /**< query heads, a multiple of kv_heads */
  uint32_t kv_heads;      /**< >= 1 */
  uint32_t head_dim;      /**< 1..AKV_ATTENTION_MAX_HEAD_DIM (CUDA: 64, 128 or 256) */
  uint32_t chunk_tokens;  /**< rows per chunk, 1..AKV_ATTENTION_MAX_CHUNK_TOKENS: pass the
                               page size */
  float scale;            /**< softmax scale, usually 1/sqrt(head_dim); finite (0 and
                               negative values are taken), and so is every score
                               factor it makes: scale * log2(e) in fp32, times
                               k_scale[g] where scales are set */
  const void *q;          /**< [n_contexts][n_heads][head_dim] bf16 */
  const void *k_base;     /**< K row 0 of context 0 */
  const void *v_base;     /**< V row 0 of context 0 */
  uint64_t context_stride; /**< bytes from one context's rows to the next's */
  uint64_t row_bytes;     /**< bytes between rows; >= kv_heads*head_dim*element size */
  const uint32_t *len;    /**< [n_contexts] rows to attend, HOST array (both variants) */
  float *out;             /**< [n_contexts][n_heads][head_dim] fp32 */
  void *workspace;        /**< partials; >= akv_attention_workspace_bytes(...) bytes */
  size_t workspace_bytes; /**< size of workspace */
  /* Optional page overrides (the paged route's view; leave zero/NULL
   * otherwise). With page_map set, chunk c of context i (c < page_map_stride)
   * whose entry page_map[i*page_map_stride + c] is not AKV_PAGE_STAGED is
   * read from that physical page instead: its row r has its K at
   * k_pages + entry*page_stride + r*row_bytes and its V at
   * v_pages + entry*page_stride + r*row_bytes. A page holds chunk_tokens
   * rows. page_map is device memory for CUDA, host memory for the reference.
   * The chunking is unchanged, so the result has the same bits as the
   * contiguous call over the same rows. */
  const uint32_t *page_map;  /**< [n_contexts][page_map_stride] or NULL */
  uint32_t page_map_stride;  /**< entries per context */
  const void *k_pages;       /**< K row 0 of physical page 0 */
  const void *v_pages;       /**< V row 0 of physical page 0 */
  uint64_t page_stride;      /**< bytes between physical pages */
  /* Dequantisation scales of this layer (see "Element types"): HOST arrays
   * of kv_heads finite positive floats, read during the call only (CUDA: their
   * values travel in the kernel parameters), so the caller may reuse them as
   * soon as the call returns. Both NULL or both set; required for FP8,
   * optional for bf16 (NULL: 1). At most AKV_ATTENTION_MAX_SCALE_HEADS
   * kv_heads when set. Appended after page_stride; zero-initialised
   * arguments mean "no scales". */
  const float *k_scale;      /**< [kv_heads] K scales, or NULL */
  const float *v_scale;      /**< [kv_heads] V scales, or NULL */
} akv_attention_args;

/**
 * Fills the fields of *args an engine's view determines: dtype, n_contexts,
 * kv_heads, head_dim, k_base, v_base, context_stride, row_bytes and, for a
 * view of the paged route, chunk_tokens (the page size) and the page
 * overrides (cleared otherwise). Leaves n_heads, scale, q, len, out,
 * workspace, workspace_bytes, k_scale, v_scale and, off the paged route,
 * chunk_tokens as they are: set those yourself (len usually holds
 * view->len[i] + 1, the new row included; FP8: the layer's scales). The page map passed on is view->page_map (device memory on
 * CUDA, host memory on the host backend), so the result suits the CUDA
 * launcher on CUDA and the reference on the host backend. Thread-safe.
 * Returns AKV_OK or AKV_ERR_INVALID_ARGUMENT (NULL or misaligned view or
 * args, or a view no
 * engine makes: base NULL; page_map set without pages, page_tokens or
 * page_map_stride; v_offset moving base or pages past the end of the address
 * space). On failure *args is untouched. *view is read whole before *args
 * is written, so the two may share memory.
 */
AKV_API akv_status akv_attention_args_from_view(const akv_view *view, akv_attention_args *args);

/**
 * A paged history in the FlashInfer manner: a plain struct passed by value,
 * owning nothing. For context i (0 <= i < batch) its pages are
 * indices[indptr[i] .. indptr[i+1]); all of them hold page_tokens rows except
 * the last, which holds last_page_len[i] rows. Row t of physical page p has
 * its K at k_pages + p*page_stride + t*row_bytes and its V at
 * v_pages + p*page_stride + t*row_bytes, laid out [kv_heads][head_dim]
 * elements of the call's dtype.
 * Context i attends over (pages - 1)*page_tokens + last_page_len[i] rows
 * (0 rows when it has no page).
 *
 * Memory: for the reference every pointer is a host pointer; for CUDA every
 * pointer (arrays included) must be readable by the device (device memory or
 * mapped pinned memory).
 *
 * Empty arrays: indptr and last_page_len always have elements (batch >= 1)
 * and must be set; indices has indptr[batch] elements and may be NULL when
 * that is 0 (every context empty; max_pages may still be above 0, and the
 * workspace is sized from it as for any call). Both implementations take such
 * a table and write zeros for every context. A NULL indices with pages is
 * the caller's error: the reference refuses it (it reads the table); CUDA
 * cannot see indptr from the host and gives every context that has pages NaN
 * (akv_cuda.h), reading no page.
 */
typedef struct akv_page_table {
  uint32_t batch;               /**< contexts, >= 1 */
  uint32_t page_tokens;         /**< rows per page, 1..AKV_ATTENTION_MAX_CHUNK_TOKENS; the
                                     chunk size */
  uint32_t max_pages;           /**< bound on indptr[i+1]-indptr[i]: sizes grid and workspace */
  const uint32_t *indptr;       /**< [batch + 1], non-decreasing, indptr[0] = 0 */
  const uint32_t *indices;      /**< [indptr[batch]] physical page ids; NULL is taken
                                     for a table without pages (indptr[batch] == 0: every
                                     context empty), like any array of 0 elements */
  const uint32_t *last_page_len; /**< [batch], in 1..page_tokens where the context has pages */
  const void *k_pages;          /**< K of physical page 0 */
  const void *v_pages;          /**< V of physical page 0 */
  uint64_t page_stride;         /**< bytes between consecutive physical pages */
  uint64_t row_bytes;           /**< bytes between rows of a page; >= kv_heads*head_dim*element size */
} akv_page_table;

/** What the paged variant needs besides its page table. */
typedef struct akv_attention_paged_args {
  akv_dtype dtype;        /**< as for akv_attention_args */
  uint32_t n_heads;       /**< query heads, a multiple of kv_heads */
  uint32_t kv_heads;      /**< >= 1 */
  uint32_t head_dim;      /**< as for akv_attention_args */
  float scale;            /**< softmax scale, finite with finite score factors: as for
                               akv_attention_args */
  const void *q;          /**< [batch][n_heads][head_dim] bf16 */
  float *out;             /**< [batch][n_heads][head_dim] fp32 */
  void *workspace;        /**< partials; >= akv_attention_workspace_bytes(batch, n_heads,
                               head_dim, max_pages*page_tokens, page_tokens) bytes */
  size_t workspace_bytes; /**< size of workspace */
  const float *k_scale;   /**< [kv_heads] K scales, or NULL: as for akv_attention_args */
  const float *v_scale;   /**< [kv_heads] V scales, or NULL: as for akv_attention_args */
} akv_attention_paged_args;

/**
 * Bytes of workspace one call needs: the per-piece partials of n_contexts
 * contexts whose longest history has max_tokens rows, cut into chunks of
 * chunk_tokens (and those into pieces, see "Algorithm"). The figure is the
 * same for every dtype and serves the reference and CUDA, contiguous and
 * paged (paged: max_tokens = max_pages * page_tokens). It never shrinks as
 * n_contexts or max_tokens grow. max_tokens 0 is valid (0 bytes: a workspace
 * of 0 bytes, NULL included, serves calls whose lengths are all 0). A paged
 * caller whose max_pages * page_tokens does not fit 32 bits cannot size its
 * workspace here. Thread-safe, pure.
 * Returns AKV_OK, AKV_ERR_INVALID_ARGUMENT (NULL or misaligned out,
 * n_contexts, n_heads,
 * head_dim or chunk_tokens of 0, head_dim above AKV_ATTENTION_MAX_HEAD_DIM,
 * chunk_tokens above AKV_ATTENTION_MAX_CHUNK_TOKENS, or a size that
 * overflows size_t; *out is untouched then).
 */
AKV_API akv_status akv_attention_workspace_bytes(uint32_t n_contexts, uint32_t n_heads,
                                                 uint32_t head_dim, uint32_t max_tokens,
                                                 uint32_t chunk_tokens, size_t *out);

/**
 * Contiguous decode attention on the CPU (host pointers; the reference): bf16
 * queries over bf16 or FP8 K/V (the name predates FP8). Runs
 * synchronously on the calling thread; writes args->out and args->workspace
 * and nothing else; reads everything else. On failure args->out is untouched.
 * Returns AKV_OK, AKV_ERR_INVALID_ARGUMENT (NULL pointer, args misaligned,
 * bad geometry, chunk
 * of 0 or above AKV_ATTENTION_MAX_CHUNK_TOKENS, row_bytes too small,
 * workspace too small, out or the workspace overlapping each other or
 * anything the call reads (see "Overlap"), FP8 without both scales, only
 * one scale array, a
 * scale that is not finite and positive (subnormal scales are taken), scales
 * with more than AKV_ATTENTION_MAX_SCALE_HEADS kv_heads, a softmax scale
 * that is not finite or whose score factor
 * (scale * log2(e), times a K scale) overflows fp32, q, out, workspace or
 * one of the arrays misaligned (see "Alignment"), a row offset outside
 * ptrdiff_t (see "Addressing")),
 * AKV_ERR_NOT_SUPPORTED (dtype other than bf16, FP8 E4M3 and FP8 E5M2).
 */
AKV_API akv_status akv_attention_ref_bf16(const akv_attention_args *args);

/**
 * Paged decode attention on the CPU. Same contract as akv_attention_ref_bf16;
 * additionally checks the page table: AKV_ERR_INVALID_ARGUMENT when indptr is
 * not non-decreasing from 0, a context has more than max_pages pages, a
 * last_page_len is outside 1..page_tokens, or indices is NULL while
 * indptr[batch] > 0 (NULL is taken for a table without pages: see
 * "Empty arrays" at akv_page_table). Page ids are not range-checked
 * (the table does not know the pool's size), but the byte offsets of their
 * rows must fit ptrdiff_t (see "Addressing").
 */
AKV_API akv_status akv_attention_paged_ref_bf16(const akv_attention_paged_args *args,
                                                akv_page_table table);

#ifdef __cplusplus
}
#endif

#endif /* AKV_ATTENTION_H */
