/*
 * fit.h - host-fit arithmetic and engine-config validation (DESIGN §3).
 *
 * Pure arithmetic on an akv_engine_config: no allocation, no device, no global
 * state. The public entry point is akv_fit() in akv.h; the engine calls
 * akv_fit_compute() at create time to validate its config, size its pools and
 * obtain the log line and the refusal message.
 */
#ifndef AKV_FIT_H
#define AKV_FIT_H

#include <stddef.h>
#include <stdint.h>

#include "akv.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Upper bounds beyond which a config value is rejected as absurd
 * (AKV_ERR_CONFIG) before any arithmetic is done with it. */
#define AKV_FIT_MAX_LAYERS 65536u
#define AKV_FIT_MAX_KV_HEADS 65536u
#define AKV_FIT_MAX_HEAD_DIM 65536u
#define AKV_FIT_MAX_POOL_GIB (1u << 20)
#define AKV_FIT_MAX_CONTEXTS (1u << 20)

/* A byte count in the largest binary unit it reaches ("4 GiB", "3.875 GiB",
 * "96 B"), NUL-terminated, truncated to cap. */
void akv_fit_format_bytes(uint64_t bytes, char *buf, size_t cap);

/* Bytes of one element of `dtype`, or 0 for a value outside akv_dtype. */
uint32_t akv_fit_dtype_size(akv_dtype dtype);

/*
 * Validates `cfg` and computes the host fit (DESIGN §3) into *r:
 *   row_bytes      = kv_heads x head_dim x dtype size
 *   history_bytes  = n_dense_layers x max_tokens x row_bytes x 2
 *   fits           = floor(host_pool_gib GiB / history_bytes)
 *   effective_concurrency = min(max_contexts, fits); ok = fits >= max_contexts
 *   host_pool_gib_needed  = ceil(max_contexts x history_bytes / 1 GiB)
 *                           (UINT32_MAX when that does not fit 32 bits)
 *   page_bytes     = page_tokens x n_dense_layers x row_bytes x 2
 *   device_pages   = floor(device_pool_gib GiB / page_bytes)
 * and r->line, the formula with every term's value and unit.
 *
 * `why` (optional: NULL or why_cap 0 writes nothing) receives, NUL-terminated
 * and truncated to why_cap: on AKV_ERR_CONFIG the offending setting and the
 * limit it broke; on AKV_OK with r->ok == 0 the settings to change and the
 * values that would fit (host_pool_gib for max_contexts, max_contexts for the
 * pool, max_tokens for both); on AKV_OK with r->ok == 1 an empty string.
 *
 * Ownership: borrows cfg, r and why for the call only. Thread safety: safe
 * from any thread (no shared state). No streams.
 * Returns AKV_OK, AKV_ERR_INVALID_ARGUMENT (cfg or r NULL) or AKV_ERR_CONFIG
 * (struct_size/version mismatch, zero or absurd geometry, unknown enum value,
 * page_tokens > max_tokens, host_pool_gib 0, a product overflowing 64 bits or
 * size_t, a nonzero device pool that holds no page or more than UINT32_MAX
 * pages, or, for a config an engine would be created from, bookkeeping
 * beyond 1/AKV_BOOKKEEPING_SHARE of the host pool: budget.h). On failure *r
 * is left untouched.
 */
akv_status akv_fit_compute(const akv_engine_config *cfg, akv_fit_report *r, char *why,
                           size_t why_cap);

#ifdef __cplusplus
}
#endif

#endif /* AKV_FIT_H */
