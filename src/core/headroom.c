/*
 * headroom.c - revocable headroom (DESIGN §6): device memory nobody uses,
 * borrowed for history and given back on demand.
 *
 * At create, after every other allocation of the engine, the backend's memory
 * query says how much device memory is free (the profile); the engine takes
 * min(headroom_gib, free - headroom_reserve_gib) in chunks of chunk_pages
 * pages (one device allocation each, the unit a release frees) and hands the
 * pages to admission after the pool's (admission.c: physical pages
 * [n_pages, n_pages + pages present)). Headroom never decides an admission and
 * never holds the only copy of a row: every page is filled from, and only
 * ever read in place of, the authoritative host rows.
 *
 * Addresses. page_ptr[phys] is K row 0 of layer 0 of every physical page,
 * pool or headroom. On the paged route attention reads a page at
 * page_base + entry * page_bytes (akv_view.pages, page_map entries), so pages
 * of separate allocations must sit on one grid: page_base lies k whole pages
 * below the pool (without a pool, below the first staging buffer), and each
 * headroom chunk is allocated with one page of slack so that its first page
 * can start on that grid. A chunk whose entries would not fit the grid (below
 * page_base, or past AKV_PAGE_STAGED) is freed at once and not used. Without
 * headroom k = 0 and page_base is the pool itself, as before. Either way
 * page_base is set at create whenever the paged route has a page map, even
 * before any page exists: a view's pages is then a usable origin (the
 * attention's page arguments are never NULL) that no entry names.
 *
 * Release. Invariant (DESIGN §7: logical cancellation revokes publication,
 * physical reuse waits for every fence): a chunk leaves admission and its
 * memory is freed only at a point where no lease is live, so no copy,
 * materialisation or attention in flight can read it: at once outside a
 * step, at akv_step_end inside one (every lease of the step retired, and the
 * step's page fills were proven by those retires on the same H2D queue), or
 * by a quarantine that established completion.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

static void akv_hr_format(uint64_t bytes, char *buf, size_t cap) {
  snprintf(buf, cap, "%.2f GiB", (double)bytes / (double)AKV_GIB);
}

/* The paged grid: page_base lies k whole pages below `anchor` (k at most
 * AKV_PAGE_GRID_OFFSET_MAX and never below address page_bytes), so
 * allocations made later below the anchor stay reachable with non-negative
 * entries. The anchor's own pages get entries k, k+1, ...: below
 * AKV_PAGE_STAGED for every pool page, as akv_budget_compute bounded the
 * pool by AKV_PAGED_HEADROOM_MAX_POOL_PAGES. */
static void akv_hr_anchor(akv_engine *e, void *anchor) {
  const uint64_t below = (uint64_t)((uintptr_t)anchor / e->page_bytes);
  const uint64_t k = below > AKV_PAGE_GRID_OFFSET_MAX ? AKV_PAGE_GRID_OFFSET_MAX
                                                      : (below ? below - 1 : 0);
  e->page_base_k = k;
  e->page_base = (uint8_t *)((uintptr_t)anchor - (uintptr_t)(k * e->page_bytes));
}

/* Places chunk c's pages: page_ptr and, on the paged route, page_entry.
 * Returns false when the chunk's pages cannot be put on the paged grid. */
static bool akv_hr_place(akv_engine *e, uint32_t c) {
  const uint32_t first = e->n_pages + c * e->hr_chunk_pages;
  uint8_t *a = e->hr_chunk[c];
  if (e->cfg.route != AKV_ROUTE_PAGED) {
    for (uint32_t j = 0; j < e->hr_chunk_pages; j++)
      e->page_ptr[first + j] = a + (uint64_t)j * e->page_bytes;
    return true;
  }
  const uintptr_t base = (uintptr_t)e->page_base, at = (uintptr_t)a;
  if (at < base) return false;
  const uint64_t off = ((uint64_t)(at - base) + e->page_bytes - 1) / e->page_bytes;
  if (off + e->hr_chunk_pages >= AKV_PAGE_STAGED) return false;
  for (uint32_t j = 0; j < e->hr_chunk_pages; j++) {
    e->page_entry[first + j] = (uint32_t)(off + j);
    /* Inside the allocation: the slack page absorbs the rounding up. */
    e->page_ptr[first + j] = a + (uint64_t)(off * e->page_bytes - (at - base)) +
                             (uint64_t)j * e->page_bytes;
  }
  return true;
}

/* Allocates chunks [hr_chunks, hr_chunks + want) one by one while the device
 * has room above the reserve; returns how many were taken. Not a hot path. */
static uint32_t akv_hr_alloc_chunks(akv_engine *e, uint32_t want, const char *why) {
  uint32_t got = 0;
  while (got < want && e->hr_chunks < e->hr_max_chunks) {
    const uint32_t c = e->hr_chunks;
    void *p = NULL;
    akv_status st = akv_bk_device_alloc(&e->bk, e->hr_alloc_bytes, &p);
    if (st != AKV_OK) {
      akv_log(e, AKV_LOG_WARN, "headroom (%s): chunk %u of %llu B could not be allocated: %s",
              why, c, (unsigned long long)e->hr_alloc_bytes, e->bk.error);
      break;
    }
    e->hr_chunk[c] = p;
    if (!akv_hr_place(e, c)) {
      akv_log(e, AKV_LOG_WARN,
              "headroom (%s): chunk %u at %p is out of reach of the paged route's page grid "
              "(base %p, %llu B pages); freed, headroom stops here",
              why, c, p, (void *)e->page_base, (unsigned long long)e->page_bytes);
      akv_bk_device_free(&e->bk, p);
      e->hr_chunk[c] = NULL;
      break;
    }
    e->hr_chunks++;
    e->device_allocated += e->hr_alloc_bytes;
    got++;
  }
  return got;
}

/* Frees chunks [from, hr_chunks): only where no reader can be in flight
 * (see the invariant at the top). `given_back` counts them in
 * bytes_released; a take that undoes its own allocations does not. */
static void akv_hr_free_from(akv_engine *e, uint32_t from, bool given_back) {
  while (e->hr_chunks > from) {
    const uint32_t c = --e->hr_chunks;
    akv_bk_device_free(&e->bk, e->hr_chunk[c]);
    e->hr_chunk[c] = NULL;
    e->device_allocated -= e->hr_alloc_bytes;
    if (given_back) e->hr_bytes_released += e->hr_alloc_bytes;
  }
}

akv_status akv_headroom_setup(akv_engine *e) {
  const akv_engine_config *c = &e->cfg;
  const uint32_t slack = c->route == AKV_ROUTE_PAGED ? 1 : 0;
  char fr[32], cap[32], res[32], got[32];
  uint64_t free_b = 0, total = 0, peak = 0;

  e->hr_cap_bytes = (uint64_t)c->headroom_gib * AKV_GIB;
  e->hr_reserve_bytes = (uint64_t)c->headroom_reserve_gib * AKV_GIB;
  if (c->route == AKV_ROUTE_PAGED && e->n_pages > 0) e->page_base = e->dev_pool;
  if (c->headroom_gib == 0) return AKV_OK;
  if (c->route == AKV_ROUTE_STAGE) {
    akv_log(e, AKV_LOG_INFO, "route stage retains nothing: headroom_gib=%u is not taken",
            c->headroom_gib);
    return AKV_OK;
  }
  e->hr_enabled = true;
  /* The grid is anchored now, before any chunk exists (see the top). */
  if (c->route == AKV_ROUTE_PAGED)
    akv_hr_anchor(e, e->n_pages > 0 ? (void *)e->dev_pool : e->staging[0]);
  if (akv_bk_mem_info(&e->bk, &free_b, &total, &peak) != AKV_OK) free_b = 0;
  e->hr_profile_free = free_b;
  const uint64_t avail = free_b > e->hr_reserve_bytes ? free_b - e->hr_reserve_bytes : 0;
  const uint64_t want = avail < e->hr_cap_bytes ? avail : e->hr_cap_bytes;
  /* Chunk: chunk_pages pages (+ slack) per allocation; never more pages than
   * the headroom itself holds, never so many that admission's page numbers
   * (n_pages + headroom < UINT32_MAX) or the paged grid could overflow. */
  uint64_t chunk = c->headroom_chunk_pages ? c->headroom_chunk_pages : AKV_GIB / e->page_bytes;
  if (chunk == 0) chunk = 1;
  const uint64_t fit_pages = want / e->page_bytes > slack ? want / e->page_bytes - slack : 0;
  if (chunk > fit_pages) chunk = fit_pages;
  uint64_t n_chunks = chunk ? want / ((chunk + slack) * e->page_bytes) : 0;
  const uint64_t page_room =
      e->n_pages < UINT32_MAX / 2 ? (uint64_t)(UINT32_MAX / 2) - e->n_pages : 0;
  if (n_chunks * chunk > page_room) n_chunks = chunk ? page_room / chunk : 0;
  /* Invariant (akv.h, akv_fit: bookkeeping bounded): the chunk table below
   * holds at most the chunks akv_budget_compute counted (budget.hr_chunks),
   * so a config fit accepted never allocates more bookkeeping than it
   * weighed. The arithmetic above already stays within it; kept as a bound. */
  if (n_chunks > e->budget.hr_chunks) n_chunks = e->budget.hr_chunks;
  e->hr_chunk_pages = (uint32_t)chunk;
  e->hr_max_chunks = (uint32_t)n_chunks;
  e->hr_max_pages = (uint32_t)(n_chunks * chunk);
  e->hr_alloc_bytes = (chunk + slack) * e->page_bytes;
  akv_hr_format(free_b, fr, sizeof fr);
  akv_hr_format(e->hr_cap_bytes, cap, sizeof cap);
  akv_hr_format(e->hr_reserve_bytes, res, sizeof res);
  akv_hr_format(want, got, sizeof got);
  akv_log(e, AKV_LOG_INFO,
          "headroom = min(headroom_gib %s, free after the engine's allocations %s - "
          "headroom_reserve_gib %s) = %s -> %u pages of %llu B in %u chunks of %u pages "
          "(%llu B per allocation%s)",
          cap, fr, res, got, e->hr_max_pages, (unsigned long long)e->page_bytes,
          e->hr_max_chunks, e->hr_chunk_pages, (unsigned long long)e->hr_alloc_bytes,
          slack ? ", one page of slack for the paged grid" : "");
  if (e->hr_max_pages == 0) return AKV_OK;
  e->hr_chunk = calloc(e->hr_max_chunks, sizeof(*e->hr_chunk));
  if (e->hr_chunk == NULL) return akv_fail(e, AKV_ERR_OUT_OF_MEMORY, "headroom bookkeeping");
  return AKV_OK;
}

/* After admission exists: page tables of the pool, then the first take. */
akv_status akv_headroom_start(akv_engine *e) {
  const uint32_t n_phys = e->n_pages + e->hr_max_pages;
  if (n_phys == 0) return AKV_OK;
  e->page_ptr = calloc(n_phys, sizeof(*e->page_ptr));
  e->page_entry = calloc(n_phys, sizeof(*e->page_entry));
  if (e->page_ptr == NULL || e->page_entry == NULL)
    return akv_fail(e, AKV_ERR_OUT_OF_MEMORY, "page address tables");
  /* Invariant (akv.h, device_pool_gib): page_base_k + p < AKV_PAGE_STAGED
   * for every pool page (akv_budget_compute refused a larger pool); checked
   * again here, so a map entry never wraps nor reads as staged. */
  if (e->n_pages > 0 && e->page_base_k + e->n_pages > AKV_PAGE_STAGED)
    return akv_fail(e, AKV_ERR_CONFIG,
                    "page map entries of %u pool pages at grid offset %llu reach %u",
                    e->n_pages, (unsigned long long)e->page_base_k, (unsigned)AKV_PAGE_STAGED);
  for (uint32_t p = 0; p < e->n_pages; p++) {
    e->page_ptr[p] = e->dev_pool + (uint64_t)p * e->page_bytes;
    e->page_entry[p] = (uint32_t)(e->page_base_k + p); /* k = 0 without headroom */
  }
  if (e->hr_max_chunks > 0) {
    uint32_t n = akv_hr_alloc_chunks(e, e->hr_max_chunks, "create");
    if (n > 0) akv_adm_headroom_add(e->adm, e->step, n * e->hr_chunk_pages);
    if (n < e->hr_max_chunks)
      akv_log(e, AKV_LOG_WARN, "headroom: %u of %u chunks taken at create", n, e->hr_max_chunks);
  }
  return AKV_OK;
}

void akv_headroom_free_all(akv_engine *e) {
  /* Destroy only: every lease retired, so the chunks go back in the H2D
   * queue's order and nothing of the caller's is waited on. */
  if (e->hr_chunk != NULL)
    for (uint32_t c = 0; c < e->hr_max_chunks; c++)
      akv_bk_device_free_async(&e->bk, e->hr_chunk[c], e->q_h2d);
  free(e->hr_chunk);
  free(e->page_ptr);
  free(e->page_entry);
  e->hr_chunk = NULL;
  e->page_ptr = NULL;
  e->page_entry = NULL;
}

/* Takes chunks [hr_chunks - n, hr_chunks) out of admission and frees them.
 * Only at a point where no lease is live (see the invariant at the top). */
static akv_status akv_hr_give_back(akv_engine *e, uint32_t n) {
  if (n == 0) return AKV_OK;
  /* Physical reuse waits for every fence: the rule that protects these pages
   * is "no live lease" (every lease that read them retired, and retire
   * waited on each of its events). Checked here, where the memory is freed;
   * the teeth build frees mid-step on purpose and skips it. */
#ifndef AKV_TEST_RELEASE_HEADROOM_EARLY
  if (e->leases_live > 0 || e->step_open)
    return akv_fail(e, AKV_ERR_IN_USE,
                    "headroom release: %u leases live in the open step; memory kept",
                    e->leases_live);
#endif
  akv_status st = akv_adm_headroom_remove(e->adm, e->step, n * e->hr_chunk_pages);
  if (st != AKV_OK) return akv_fail(e, st, "headroom release: admission refused the removal");
  akv_hr_free_from(e, e->hr_chunks - n, true);
  return AKV_OK;
}

akv_status akv_headroom_apply_pending(akv_engine *e) {
  const uint32_t n = e->hr_pending_chunks;
  if (n == 0) return AKV_OK;
  /* The chunks stop being pending only once given back: a refused give-back
   * keeps them pending (akv_headroom_info.pages_pending) and present. Not
   * reachable from the public API: both callers (step_end, a quarantine
   * that proved completion) run it with no step open and no lease live, and
   * admission holds the pages of every present chunk. */
  akv_status st = akv_hr_give_back(e, n);
  if (st == AKV_OK) e->hr_pending_chunks = 0;
  return st;
}

static akv_status akv_headroom_release_claimed(akv_engine *e, uint64_t bytes, uint64_t *freed_now,
                                               uint64_t *pending) {
  akv_status st = akv_engine_enter(e, "headroom_release");
  if (st != AKV_OK) return st;
  if (!e->hr_enabled)
    return akv_fail(e, AKV_ERR_NOT_SUPPORTED,
                    "headroom_release: headroom is not enabled (headroom_gib on the arena or "
                    "paged route)");
  /* A chunk gives back its whole allocation (on the paged route its pages
   * and one page of slack): the fewest whole chunks whose allocations cover
   * `bytes`, as *freed_now / *pending report them (no overflow for bytes
   * near UINT64_MAX). */
  const uint64_t chunk_bytes = e->hr_alloc_bytes;
  const uint32_t avail = e->hr_chunks - e->hr_pending_chunks;
  uint64_t n64 = chunk_bytes ? bytes / chunk_bytes + (bytes % chunk_bytes != 0) : 0;
  const uint32_t n = n64 > avail ? avail : (uint32_t)n64;
  /* The outputs are written on success only: a refused give-back leaves
   * them, like everything else, as they were. */
  uint64_t now = 0, later = 0;
  if (n > 0 && e->step_open) {
#ifdef AKV_TEST_RELEASE_HEADROOM_EARLY
    /* Teeth switch (tests only): frees while the step's leases may still read
     * the pages. The CPU suite must detect it. */
    st = akv_hr_give_back(e, n);
    now = (uint64_t)n * e->hr_alloc_bytes;
#else
    /* Leases of the open step may be reading these pages (copies queued,
     * attention on the caller's stream): the free waits for step_end. */
    e->hr_pending_chunks += n;
    later = (uint64_t)n * e->hr_alloc_bytes;
#endif
  } else if (n > 0) {
    /* Outside a step every lease has retired: every fence is proven. */
    st = akv_hr_give_back(e, n);
    now = (uint64_t)n * e->hr_alloc_bytes;
  }
  if (st != AKV_OK) return st;
  /* Invariant (akv.h, akv_headroom_info.releases): one count per call that
   * gave back at least one chunk, counted here, by the call: chunks marked
   * inside a step are freed later, several calls' chunks by one step end
   * (or quarantine), which must not merge their counts. */
  if (n > 0) e->hr_releases++;
  if (freed_now) *freed_now = now;
  if (pending) *pending = later;
  return AKV_OK;
}

AKV_API akv_status akv_headroom_release(akv_engine *e, uint64_t bytes, uint64_t *freed_now,
                                        uint64_t *pending) {
  akv_status st = akv_engine_claim(e);
  if (st != AKV_OK) return st;
  st = akv_headroom_release_claimed(e, bytes, freed_now, pending);
  akv_engine_release(e);
  return st;
}

static akv_status akv_headroom_take_claimed(akv_engine *e, uint64_t bytes, uint64_t *taken) {
  akv_status st = akv_engine_enter(e, "headroom_take");
  uint64_t free_b = 0, total = 0, peak = 0;
  if (st != AKV_OK) return st;
  if (!e->hr_enabled)
    return akv_fail(e, AKV_ERR_NOT_SUPPORTED, "headroom_take: headroom is not enabled");
  if (e->step_open || e->hr_pending_chunks > 0)
    return akv_fail(e, AKV_ERR_STEP_STATE,
                    "headroom_take: only outside a step, with no release pending");
  uint32_t n = 0;
  if (e->hr_alloc_bytes > 0) {
    if (akv_bk_mem_info(&e->bk, &free_b, &total, &peak) != AKV_OK) free_b = 0;
    const uint64_t avail = free_b > e->hr_reserve_bytes ? free_b - e->hr_reserve_bytes : 0;
    const uint64_t limit = bytes < avail ? bytes : avail;
    const uint64_t want = limit / e->hr_alloc_bytes;
    const uint32_t room = e->hr_max_chunks - e->hr_chunks;
    const uint32_t from = e->hr_chunks;
    n = akv_hr_alloc_chunks(e, want > room ? room : (uint32_t)want, "take");
    /* Admission refuses only more pages than its headroom range has room
     * for; n chunks fit the room left, since the chunks present and
     * admission's headroom pages move together (chunk_pages per chunk, at
     * create, take and give-back). Not reachable from the public API, then;
     * should it refuse, the chunks just allocated are freed again, counted
     * nowhere, and the call changes nothing. */
    if (n > 0 && (st = akv_adm_headroom_add(e->adm, e->step, n * e->hr_chunk_pages)) != AKV_OK) {
      akv_hr_free_from(e, from, false);
      return akv_fail(e, st, "headroom_take: admission refused the pages");
    }
    if (n > 0) e->hr_takes++;
  }
  /* akv.h: outputs are written on success only, *taken = 0 included. */
  if (taken) *taken = (uint64_t)n * e->hr_alloc_bytes;
  return AKV_OK;
}

AKV_API akv_status akv_headroom_take(akv_engine *e, uint64_t bytes, uint64_t *taken) {
  akv_status st = akv_engine_claim(e);
  if (st != AKV_OK) return st;
  st = akv_headroom_take_claimed(e, bytes, taken);
  akv_engine_release(e);
  return st;
}

static akv_status akv_headroom_get_claimed(const akv_engine *e, akv_headroom_info *out) {
  if (out == NULL)
    return akv_fail((akv_engine *)e, AKV_ERR_INVALID_ARGUMENT, "headroom_get: out is NULL");
  memset(out, 0, sizeof(*out));
  out->enabled = e->hr_enabled;
  out->profile_free_bytes = e->hr_profile_free;
  out->cap_bytes = e->hr_cap_bytes;
  out->reserve_bytes = e->hr_reserve_bytes;
  out->max_pages = e->hr_max_pages;
  out->chunk_pages = e->hr_chunk_pages;
  out->pages = akv_adm_headroom_pages(e->adm);
  for (uint32_t p = e->n_pages; p < e->n_pages + out->pages; p++)
    out->pages_held += akv_adm_page_owner(e->adm, p) != AKV_ADM_NONE;
  out->pages_pending = e->hr_pending_chunks * e->hr_chunk_pages;
  out->bytes = (uint64_t)e->hr_chunks * e->hr_alloc_bytes;
  out->bytes_released = e->hr_bytes_released;
  out->releases = e->hr_releases;
  out->takes = e->hr_takes;
  return AKV_OK;
}

AKV_API akv_status akv_headroom_get(const akv_engine *e, akv_headroom_info *out) {
  akv_status st = akv_engine_claim(e);
  if (st != AKV_OK) return st;
  st = akv_headroom_get_claimed(e, out);
  akv_engine_release(e);
  return st;
}
