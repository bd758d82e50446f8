/*
 * budget.c - the engine's bookkeeping and scratch sizes (see budget.h).
 *
 * Every size is formed in 64 bits and checked before use; a size that does
 * not fit is a config error naming the setting, never a wrapped value.
 */
#include "budget.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "admission.h"
#include "fit.h"
#include "internal.h"

/* *acc = a * b (b may be 0); returns 0 when it does not fit 64 bits or size_t. */
static int akv_budget_mul(uint64_t a, uint64_t b, uint64_t *out) {
  if (a != 0 && b > UINT64_MAX / a) return 0;
  if (a * b > (uint64_t)SIZE_MAX) return 0;
  *out = a * b;
  return 1;
}

/* *acc += v; returns 0 when the sum does not fit 64 bits or size_t. */
static int akv_budget_add(uint64_t *acc, uint64_t v) {
  if (v > UINT64_MAX - *acc || *acc + v > (uint64_t)SIZE_MAX) return 0;
  *acc += v;
  return 1;
}

static uint64_t akv_budget_min(uint64_t a, uint64_t b) { return a < b ? a : b; }

static void akv_budget_say(char *why, size_t cap, const char *fmt, ...) {
  va_list ap;
  if (why == NULL || cap == 0) return;
  va_start(ap, fmt);
  vsnprintf(why, cap, fmt, ap);
  va_end(ap);
}

/* Invariant (akv.h, device_pool_gib): every page map entry, the paged
 * grid's offset plus a pool page number, fits its 32 bits below
 * AKV_PAGE_STAGED. The offset is known only at create (the pool's address,
 * headroom.c), so the pool is bounded by its largest value before anything
 * is allocated; without headroom it is 0 and the bound of 2^32 - 1 pages
 * (numbered below AKV_PAGE_STAGED) holds. */
akv_status akv_budget_paged_headroom_pages(const akv_engine_config *cfg, uint64_t pages,
                                           uint32_t page_tokens, char *why, size_t why_cap) {
  if (cfg->route != AKV_ROUTE_PAGED || cfg->headroom_gib == 0 ||
      pages <= AKV_PAGED_HEADROOM_MAX_POOL_PAGES)
    return AKV_OK;
  akv_budget_say(why, why_cap,
                 "device_pool_gib=%u holds %llu pages of page_tokens=%u; with headroom_gib "
                 "on the paged route a page map entry (a grid offset of up to %llu pages "
                 "plus the page number) must stay below %llu, so at most %llu pages: raise "
                 "page_tokens, lower device_pool_gib or set headroom_gib=0",
                 (unsigned)cfg->device_pool_gib, (unsigned long long)pages, (unsigned)page_tokens,
                 (unsigned long long)AKV_PAGE_GRID_OFFSET_MAX, (unsigned long long)AKV_PAGE_STAGED,
                 (unsigned long long)AKV_PAGED_HEADROOM_MAX_POOL_PAGES);
  return AKV_ERR_CONFIG;
}

/* The smallest page_tokens in (cfg->page_tokens, max_tokens] whose
 * bookkeeping fits, or 0 if none does. Bookkeeping only shrinks as pages
 * grow (fewer logical and physical pages), up to the largest page the device
 * pool still holds one of. */
static uint32_t akv_budget_page_tokens_that_fit(const akv_engine_config *cfg,
                                                uint32_t concurrency) {
  akv_budget probe;
  uint64_t lo = (uint64_t)cfg->page_tokens + 1, hi = cfg->max_tokens;
  if (cfg->route != AKV_ROUTE_STAGE && cfg->device_pool_gib > 0) {
    uint64_t per_token = (uint64_t)cfg->n_dense_layers * cfg->kv_heads * cfg->head_dim *
                         akv_fit_dtype_size(cfg->dtype) * 2; /* < 2^55: validated ranges */
    uint64_t largest = ((uint64_t)cfg->device_pool_gib << 30) / per_token;
    if (largest < hi) hi = largest;
  }
  if (lo > hi || akv_budget_compute(cfg, concurrency, (uint32_t)hi, &probe, NULL, 0) != AKV_OK)
    return 0;
  while (lo < hi) {
    uint64_t mid = lo + (hi - lo) / 2;
    if (akv_budget_compute(cfg, concurrency, (uint32_t)mid, &probe, NULL, 0) == AKV_OK)
      hi = mid;
    else
      lo = mid + 1;
  }
  return (uint32_t)lo;
}

akv_status akv_budget_compute(const akv_engine_config *cfg, uint32_t concurrency,
                              uint32_t page_tokens, akv_budget *b, char *why, size_t why_cap) {
  akv_budget r;
  const uint64_t layers = cfg->n_dense_layers;
  const uint64_t conc = concurrency;
  uint64_t pair = 0, page_bytes = 0, t = 0, slots_pages = 0;
  memset(&r, 0, sizeof r);
  r.concurrency = concurrency;

  /* Validated by akv_fit_compute: kv_heads, head_dim < 2^17, dtype <= 4 B,
   * layers <= 2^16, 1 <= page_tokens <= max_tokens; checked all the same. */
  if (page_tokens == 0 || page_tokens > cfg->max_tokens ||
      !akv_budget_mul((uint64_t)cfg->kv_heads * cfg->head_dim, akv_fit_dtype_size(cfg->dtype),
                      &t) ||
      !akv_budget_mul(t, 2, &pair) || !akv_budget_mul(page_tokens, layers, &t) ||
      !akv_budget_mul(t, pair, &page_bytes) || page_bytes == 0) {
    akv_budget_say(why, why_cap, "page_bytes = page_tokens %u x %u layers x row pair overflows",
                   (unsigned)page_tokens, (unsigned)layers);
    return AKV_ERR_CONFIG;
  }
  if (cfg->route != AKV_ROUTE_STAGE) {
    uint64_t pages = ((uint64_t)cfg->device_pool_gib << 30) / page_bytes;
    if (pages > UINT32_MAX || (cfg->device_pool_gib > 0 && pages == 0)) {
      akv_budget_say(why, why_cap, "device_pool_gib=%u holds %llu pages of page_tokens=%u",
                     (unsigned)cfg->device_pool_gib, (unsigned long long)pages,
                     (unsigned)page_tokens);
      return AKV_ERR_CONFIG;
    }
    if (akv_budget_paged_headroom_pages(cfg, pages, page_tokens, why, why_cap) != AKV_OK)
      return AKV_ERR_CONFIG;
    r.n_pages = (uint32_t)pages;
  }
  /* ceil(max_tokens / page_tokens) without forming max_tokens + page_tokens - 1,
   * which wraps in 32 bits near UINT32_MAX. */
  r.max_logical_pages = cfg->max_tokens / page_tokens + (cfg->max_tokens % page_tokens != 0);
  /* Headroom (headroom.c) may retain pages beyond the pool's on a retaining
   * route; how many is known only at create (free memory), so everything
   * sized by retained pages takes its worst case: every logical page. */
  const bool headroom = cfg->route != AKV_ROUTE_STAGE && cfg->headroom_gib > 0;
  const bool retains = r.n_pages > 0 || headroom;
  r.tracked_pages = retains ? r.max_logical_pages : 1;

  /* Scratch, each from its own worst case (budget.h). */
  {
    uint64_t resident = 0, fills = 0, per_entry = 2 * sizeof(void *) + sizeof(size_t), all = 0;
    if (!akv_budget_mul(conc, r.tracked_pages, &slots_pages)) goto overflow;
    resident = headroom ? slots_pages : akv_budget_min(r.n_pages, slots_pages);
    r.sc_stage = conc + resident;
    r.sc_mat = cfg->route == AKV_ROUTE_STAGE ? 0 : resident;
    r.sc_wb = conc;
    if (!akv_budget_mul(resident, layers, &fills)) goto overflow;
    r.sc_fill = akv_budget_min(fills, AKV_FILL_BATCH);
    all = r.sc_stage;
    if (!akv_budget_add(&all, r.sc_mat) || !akv_budget_add(&all, r.sc_wb) ||
        !akv_budget_add(&all, r.sc_fill) || !akv_budget_mul(all, per_entry, &r.scratch_bytes))
      goto overflow;
  }
  /* Admission allocator. */
  {
    /* Headroom pages: at most headroom_gib of them (the profile at create
     * can only take fewer). */
    uint64_t hr_pages = headroom ? ((uint64_t)cfg->headroom_gib << 30) / page_bytes : 0;
    /* The cap akv_headroom_setup applies: n_pages + headroom < UINT32_MAX / 2. */
    const uint64_t hr_room = r.n_pages < UINT32_MAX / 2 ? UINT32_MAX / 2 - r.n_pages : 0;
    if (hr_pages > hr_room) hr_pages = hr_room;
    r.hr_pages = (uint32_t)hr_pages;
    akv_adm_config ac = {r.n_pages, concurrency, r.tracked_pages, AKV_ADM_LOG_ENTRIES,
                         (uint32_t)hr_pages};
    akv_adm_config no_pages = {0, concurrency, r.tracked_pages, AKV_ADM_LOG_ENTRIES, 0};
    uint64_t without = 0;
    if (!akv_adm_bytes(&ac, &r.adm_bytes) || !akv_adm_bytes(&no_pages, &without)) goto overflow;
    r.adm_page_bytes = r.adm_bytes - without;
    /* Headroom chunks: chunk_pages pages each (headroom_chunk_pages, else
     * as many as fit in 1 GiB, at least 1), so at most hr_pages / chunk of
     * them; one when akv_headroom_setup lowers the chunk to the pages that
     * fit (a chunk is then all the headroom there is). */
    if (hr_pages > 0) {
      uint64_t chunk = cfg->headroom_chunk_pages ? cfg->headroom_chunk_pages
                                                 : ((uint64_t)1 << 30) / page_bytes;
      if (chunk == 0) chunk = 1;
      r.hr_chunks = (uint32_t)(hr_pages / chunk > 0 ? hr_pages / chunk : 1);
    }
    /* Page address tables (akv_headroom_start): page_ptr and page_entry per
     * physical page, the pool's and the headroom's; and the headroom's chunk
     * table (akv_headroom_setup), one pointer per chunk. */
    uint64_t chunk_table = 0;
    if (!akv_budget_mul((uint64_t)r.n_pages + hr_pages, sizeof(uint8_t *) + sizeof(uint32_t),
                        &r.page_table_bytes) ||
        !akv_budget_mul(r.hr_chunks, sizeof(void *), &chunk_table) ||
        !akv_budget_add(&r.page_table_bytes, chunk_table))
      goto overflow;
  }
  /* Context handle records (concurrency of them reserved in the
   * process-wide pool, records.h), lease handle records
   * (AKV_LEASE_HANDLES_PER_LAYER per dense layer) and per-slot arrays
   * (owner, step list, generation, admission request, rows per layer). */
  {
    uint64_t recs = 0, lease_recs = 0, slot_arrays = 0, layer_len = 0;
    if (!akv_budget_mul(conc, sizeof(struct akv_context), &recs) ||
        !akv_budget_mul(layers, (uint64_t)AKV_LEASE_HANDLES_PER_LAYER *
                                    (sizeof(struct akv_lease) + 2 * sizeof(void *)),
                        &lease_recs) ||
        !akv_budget_mul(conc,
                        sizeof(struct akv_context *) * 2 + sizeof(uint64_t) +
                            sizeof(akv_adm_request),
                        &slot_arrays) ||
        !akv_budget_mul(conc, layers, &layer_len) ||
        !akv_budget_mul(layer_len, sizeof(uint32_t), &layer_len))
      goto overflow;
    r.records_bytes = recs;
    if (!akv_budget_add(&r.records_bytes, lease_recs) ||
        !akv_budget_add(&r.records_bytes, slot_arrays) ||
        !akv_budget_add(&r.records_bytes, layer_len))
      goto overflow;
  }
  /* Leases: one record per dense layer, each with per-context arrays
   * (contexts, len, generation, written, 3 tickets). */
  {
    uint64_t per_ctx = sizeof(struct akv_context *) + sizeof(uint32_t) + sizeof(uint64_t) +
                       sizeof(uint8_t) + 3 * sizeof(akv_ticket);
    uint64_t per_lease = 0;
    if (!akv_budget_mul(conc, per_ctx, &per_lease) ||
        !akv_budget_add(&per_lease, sizeof(akv_lease_body)) ||
        !akv_budget_mul(layers, per_lease, &r.lease_bytes))
      goto overflow;
  }
  /* Paged route: the page map, [concurrency][max_logical_pages] entries. */
  if (cfg->route == AKV_ROUTE_PAGED && retains) {
    if (!akv_budget_mul(conc, r.max_logical_pages, &t) ||
        !akv_budget_mul(t, sizeof(uint32_t), &r.page_map_bytes))
      goto overflow;
  }
  r.total_bytes = r.adm_bytes;
  if (!akv_budget_add(&r.total_bytes, r.page_table_bytes) ||
      !akv_budget_add(&r.total_bytes, r.records_bytes) ||
      !akv_budget_add(&r.total_bytes, r.lease_bytes) ||
      !akv_budget_add(&r.total_bytes, r.page_map_bytes) ||
      !akv_budget_add(&r.total_bytes, r.page_map_bytes) ||
      !akv_budget_add(&r.total_bytes, r.scratch_bytes))
    goto overflow;
  r.limit_bytes = ((uint64_t)cfg->host_pool_gib << 30) / AKV_BOOKKEEPING_SHARE;
  if (r.n_pages > 0) r.limit_bytes += ((uint64_t)cfg->device_pool_gib << 30) / AKV_PAGE_BOOKKEEPING_SHARE;
  /* Headroom: the pages it can hold (r.hr_pages, capped), not headroom_gib
   * itself, which may ask for more than the page numbers allow. */
  if (headroom) r.limit_bytes += (uint64_t)r.hr_pages * page_bytes / AKV_PAGE_BOOKKEEPING_SHARE;

  if (r.total_bytes > r.limit_bytes) {
    if (why != NULL && why_cap > 0) {
      char total[32], limit[32], adm[32], map[32], leases[32], recs[32], scratch[32], tables[32];
      char fix[200];
      uint32_t pt_fit = akv_budget_page_tokens_that_fit(cfg, concurrency);
      akv_fit_format_bytes(r.total_bytes, total, sizeof total);
      akv_fit_format_bytes(r.limit_bytes, limit, sizeof limit);
      akv_fit_format_bytes(r.adm_bytes, adm, sizeof adm);
      akv_fit_format_bytes(2 * r.page_map_bytes, map, sizeof map);
      akv_fit_format_bytes(r.lease_bytes, leases, sizeof leases);
      akv_fit_format_bytes(r.records_bytes, recs, sizeof recs);
      akv_fit_format_bytes(r.scratch_bytes, scratch, sizeof scratch);
      akv_fit_format_bytes(r.page_table_bytes, tables, sizeof tables);
      if (pt_fit != 0)
        snprintf(fix, sizeof fix, "raise page_tokens to %u (or more)", (unsigned)pt_fit);
      else
        snprintf(fix, sizeof fix,
                 "no page_tokens fits: lower max_contexts or n_dense_layers, or raise "
                 "host_pool_gib");
      akv_budget_say(why, why_cap,
                     "engine bookkeeping of %s exceeds 1/%u of the %u GiB host pool plus 1/%u of the "
                     "device pool and headroom in use (%s): "
                     "admission %s (%u contexts x %u logical pages of page_tokens=%u, %u device pages, %u headroom pages), page tables %s, page map %s, lease records %s (%u layers x %u contexts), context "
                     "records %s, scratch %s; %s",
                     total, (unsigned)AKV_BOOKKEEPING_SHARE, (unsigned)cfg->host_pool_gib,
                     (unsigned)AKV_PAGE_BOOKKEEPING_SHARE, limit,
                     adm, (unsigned)concurrency, (unsigned)r.tracked_pages, (unsigned)page_tokens,
                     (unsigned)r.n_pages, (unsigned)r.hr_pages, tables, map, leases,
                     (unsigned)layers, (unsigned)concurrency, recs, scratch, fix);
    }
    return AKV_ERR_CONFIG;
  }
  *b = r;
  return AKV_OK;
overflow:
  akv_budget_say(why, why_cap,
                 "engine bookkeeping for max_contexts=%u x max_tokens=%u / page_tokens=%u x "
                 "n_dense_layers=%u overflows 64 bits; raise page_tokens or lower max_tokens",
                 (unsigned)concurrency, (unsigned)cfg->max_tokens, (unsigned)page_tokens,
                 (unsigned)cfg->n_dense_layers);
  return AKV_ERR_CONFIG;
}
