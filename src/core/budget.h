/*
 * budget.h - what an engine allocates besides its pools and staging buffers:
 * the bookkeeping and the scratch arrays, each sized from its own worst case,
 * all in checked 64-bit arithmetic, and the bound that keeps them small next
 * to the host pool (docs/admission.md, "What an engine costs besides its pools").
 *
 * Pure arithmetic on a config and an effective concurrency: no allocation, no
 * device, no global state. akv_fit_compute checks the bound (so akv_fit and
 * akv_engine_create agree); the engine sizes its allocations from the same
 * numbers.
 */
#ifndef AKV_BUDGET_H
#define AKV_BUDGET_H

#include <stddef.h>
#include <stdint.h>

#include "akv.h"

#ifdef __cplusplus
extern "C" {
#endif

/* An engine's bookkeeping may take at most 1/AKV_BOOKKEEPING_SHARE of its
 * host pool's size plus 1/AKV_PAGE_BOOKKEEPING_SHARE of the device pool it
 * uses (the admission allocator keeps about 28 B per device page: pages of
 * at least 112 B stay within the device share). */
#define AKV_BOOKKEEPING_SHARE 64u
#define AKV_PAGE_BOOKKEEPING_SHARE 4u
/* Page-fill copies per batch at a step boundary: fills are chunked into
 * batches of at most this many copies (a fill of n_dense_layers copies may
 * span several). */
#define AKV_FILL_BATCH 4096u
/* Paged route with headroom: attention finds a page at page_base + entry x
 * page_bytes, and page_base lies up to AKV_PAGE_GRID_OFFSET_MAX whole pages
 * below the pool so that headroom allocated later below it stays reachable
 * (headroom.c); pool page p has entry offset + p. Entries are 32 bits and
 * AKV_PAGE_STAGED is reserved, so such a pool holds at most
 * AKV_PAGED_HEADROOM_MAX_POOL_PAGES pages (akv.h, device_pool_gib). */
#define AKV_PAGE_GRID_OFFSET_MAX ((uint64_t)1 << 30)
#define AKV_PAGED_HEADROOM_MAX_POOL_PAGES ((uint64_t)AKV_PAGE_STAGED - AKV_PAGE_GRID_OFFSET_MAX)
/* Admission decision log entries (akv_admission_log). */
#define AKV_ADM_LOG_ENTRIES 256u

typedef struct akv_budget {
  uint32_t concurrency;       /* effective concurrency the sizes are for */
  uint32_t n_pages;           /* device pages the route uses (0: stage route or no pool) */
  uint32_t max_logical_pages; /* ceil(max_tokens / page_tokens), formed in 64 bits */
  /* Logical pages per slot the admission map tracks: max_logical_pages when
   * there are device pages, else 1 (nothing is ever resident). */
  uint32_t tracked_pages;
  /* Scratch entries (dst, src, bytes triples), one owner each:
   *  stage: a lease's host->device runs. Per context at most one run more
   *         than its resident pages; resident pages of all contexts are
   *         distinct physical pages: concurrency + min(n_pages,
   *         concurrency x tracked_pages).
   *  mat:   a lease's device->device copies (arena: one per resident page;
   *         paged with poison_holes: one poison copy per page read in
   *         place): min(n_pages, concurrency x tracked_pages).
   *  wb:    a write-back: one new row per owner: concurrency.
   *  fill:  the page fills of a boundary, min(worst case, AKV_FILL_BATCH);
   *         the worst case is min(n_pages, concurrency x tracked_pages)
   *         fills of n_dense_layers copies each. */
  uint64_t sc_stage, sc_mat, sc_wb, sc_fill;
  /* Bytes, by owner. */
  uint64_t adm_bytes;      /* admission allocator (akv_adm_bytes) */
  uint64_t adm_page_bytes; /* of which per physical page (device pool and headroom) */
  uint32_t hr_pages;       /* headroom pages at most (headroom_gib of them, capped as
                              akv_headroom_setup caps them) */
  uint32_t hr_chunks;      /* headroom chunks at most (akv_headroom_setup never takes more:
                              one device allocation and one table entry each) */
  uint64_t page_table_bytes; /* page_ptr and page_entry per physical page, and the
                                headroom's chunk table (one pointer per chunk) */
  uint64_t records_bytes;  /* context records and per-slot arrays */
  uint64_t lease_bytes;    /* per-layer lease records and their per-context arrays */
  uint64_t page_map_bytes; /* paged route: one copy of the page map (pinned and device each) */
  uint64_t scratch_bytes;
  uint64_t total_bytes;    /* all of the above, the page map twice; at most limit_bytes */
  uint64_t limit_bytes;    /* host pool / AKV_BOOKKEEPING_SHARE + (device pool + headroom_gib)
                              / AKV_PAGE_BOOKKEEPING_SHARE */
} akv_budget;

/*
 * Computes *b for `cfg` (validated by akv_fit_compute: nonzero geometry,
 * page_tokens <= max_tokens) run at `concurrency` contexts with
 * `page_tokens` tokens per page (cfg->page_tokens, or another value when
 * looking for one that fits). Returns AKV_OK, or AKV_ERR_CONFIG when a size
 * does not fit 64 bits / size_t (why names the setting) or total_bytes
 * exceeds limit_bytes (why names the setting to change and, where one
 * exists, the page_tokens that would fit). Borrows its arguments for the
 * call; thread-safe; no streams.
 */
akv_status akv_budget_compute(const akv_engine_config *cfg, uint32_t concurrency,
                              uint32_t page_tokens, akv_budget *b, char *why, size_t why_cap);

/* AKV_ERR_CONFIG (why says so) when a paged-route pool of `pages` pages of
 * `page_tokens` with headroom exceeds AKV_PAGED_HEADROOM_MAX_POOL_PAGES,
 * else AKV_OK. akv_budget_compute and akv_fit_compute both ask it: a config
 * error whatever the host fit says. */
akv_status akv_budget_paged_headroom_pages(const akv_engine_config *cfg, uint64_t pages,
                                           uint32_t page_tokens, char *why, size_t why_cap);

#ifdef __cplusplus
}
#endif

#endif /* AKV_BUDGET_H */
