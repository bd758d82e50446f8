/*
 * akv_cuda.h - CUDA-typed entry points of libactivekv.
 *
 * Include this instead of (or after) akv.h in code that already uses the CUDA
 * runtime. It adds:
 *  - conversions between cudaStream_t and akv_stream (the engine's compute
 *    stream type on the CUDA backend is the caller's cudaStream_t);
 *  - the CUDA launchers of the reference decode attention (akv_attention.h
 *    describes the layouts, the algorithm and the equality guarantees).
 *
 * Streams: the launchers only enqueue. They return when the call's work is
 * enqueued on the caller's `stream` (two kernels, chunk partials then the
 * combine; or, where the chunk grid fits on the device at once, one
 * cooperative kernel doing both, with the same bits), never wait on the host
 * and never enqueue anything anywhere else. They allocate nothing: the
 * partials go to the caller's workspace. A captured call may be a
 * cooperative kernel node; replay a graph on a device like the one it was
 * captured on.
 * Device: the current device of the calling thread; every pointer must be
 * valid on it.
 * Thread safety: reentrant; concurrent launches must not share an output or a
 * workspace unless ordered on one stream.
 */
#ifndef AKV_CUDA_H
#define AKV_CUDA_H

#include <cuda_runtime.h>

#include "akv.h"
#include "akv_attention.h"

#ifdef __cplusplus
extern "C" {
#endif

/** The cudaStream_t as the engine's compute stream (no ownership change). */
static inline akv_stream akv_stream_from_cuda(cudaStream_t stream) {
  return (akv_stream)stream;
}

/** The akv_stream of a CUDA engine as a cudaStream_t (no ownership change). */
static inline cudaStream_t akv_stream_to_cuda(akv_stream stream) {
  return (cudaStream_t)stream;
}

/**
 * Enqueues contiguous decode attention on `stream` (akv_attention.h has the
 * layout). q, k_base, v_base, out and workspace are device pointers; len and
 * the scales (k_scale, v_scale) are HOST arrays, read during the call only
 * (their values travel in the kernel parameters), so the caller may reuse
 * them as soon as the call returns. dtype: bf16, FP8 E4M3 or FP8 E5M2 K/V
 * (bf16 queries always); FP8 needs both scale arrays (akv_attention.h).
 * head_dim must be 64, 128 or 256. q, k_base, v_base, workspace, row_bytes
 * and context_stride must be multiples of 16 bytes; out, len and the scales
 * multiples of 4. Page overrides (the paged route;
 * akv_attention_args_from_view fills them from a view): the page map is a
 * device array read by the kernel, 4-byte aligned, and k_pages, v_pages and
 * page_stride must be multiples of 16 bytes. The workspace is
 * overwritten; it and out must not be read or written by other work until
 * the enqueued kernels have run.
 * Bits: identical on every run for identical inputs; identical to
 * akv_attention_paged_cuda over the same rows with page_tokens == chunk_tokens;
 * within a relative L2 error of 1e-5 of akv_attention_ref_bf16 (bf16 and FP8).
 * Grid limits: kv_heads * ceil(n_heads / kv_heads / 8) (query heads go to
 * blocks in subgroups of up to 8) must not exceed 65535, and that figure
 * times the piece slots (the longest history's chunks times the pieces per
 * chunk, akv_attention.h "Algorithm"; paged: max_pages times the pieces per
 * page) must not exceed 2^31 - 1; a call beyond either is refused as bad
 * geometry.
 * Returns AKV_OK, AKV_ERR_INVALID_ARGUMENT (NULL, args misaligned for its
 * type, bad geometry, chunk_tokens
 * of 0 or above AKV_ATTENTION_MAX_CHUNK_TOKENS, misaligned pointer or
 * stride, workspace too small, out or the workspace overlapping each other
 * or what the call reads as far as the host knows it (akv_attention.h,
 * "Overlap"), page overrides incomplete, scales
 * missing for FP8, only one scale array, a scale not finite and positive,
 * scales with more than AKV_ATTENTION_MAX_SCALE_HEADS kv_heads, a softmax
 * scale that is not finite or whose score factor (scale * log2(e), times a
 * K scale) overflows fp32, a contiguous row offset outside ptrdiff_t:
 * akv_attention.h, "Addressing"),
 * AKV_ERR_NOT_SUPPORTED (dtype other than bf16, FP8 E4M3 and FP8 E5M2;
 * head_dim other than 64/128/256), AKV_ERR_BACKEND (a launch failed;
 * cudaGetLastError() names the cause). Every refusal above is decided
 * before anything is enqueued, so out and the workspace are untouched by
 * it; AKV_ERR_BACKEND is not: a batch of more than 256 contexts is
 * enqueued as one launch per 256 (their lengths travel in the kernel
 * parameters), and a launch that fails after earlier ones were enqueued
 * leaves those to write their contexts' rows of out (treat out as
 * undefined after AKV_ERR_BACKEND).
 */
AKV_API akv_status akv_attention_decode_cuda(const akv_attention_args *args, cudaStream_t stream);

/**
 * Enqueues paged decode attention on `stream`. The page table is passed by
 * value; its arrays and pages must be readable by the device until the
 * kernels have run (the host never dereferences them). args->q, args->out,
 * args->workspace, table.k_pages and table.v_pages are device pointers;
 * k_pages, v_pages, page_stride and row_bytes must be multiples of 16 bytes,
 * indptr, indices and last_page_len multiples of 4.
 * The workspace must hold akv_attention_workspace_bytes(table.batch, n_heads,
 * head_dim, table.max_pages * table.page_tokens, table.page_tokens) bytes.
 * The table's contents cannot be checked from the host: a context with more
 * than max_pages pages, or a decreasing indptr, gets NaN in every element of
 * its output; a last_page_len above page_tokens is clamped to page_tokens,
 * and one of 0 leaves the last page out (the context attends over the rows
 * of its other pages). Page ids are not range-checked. indices may be NULL
 * (akv_attention.h, "Empty arrays"): no page is then read, every empty
 * context gets zeros and every context with pages NaN; indptr and
 * last_page_len must be set. page_tokens is bounded as chunk_tokens is.
 * Same statuses as akv_attention_decode_cuda.
 */
AKV_API akv_status akv_attention_paged_cuda(const akv_attention_paged_args *args,
                                            akv_page_table table, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif /* AKV_CUDA_H */
