/*
 * admission.h - the device page pool allocator (DESIGN §4).
 *
 * Plain deterministic C with no device dependency: the engine feeds it the
 * step boundary's demands and applies the mapping it returns. All memory is
 * allocated in akv_adm_create; no call allocates afterwards.
 *
 * Vocabulary: a context occupies a slot (0..max_contexts-1). Its history is
 * cut into logical pages of page_tokens tokens; logical page 0 is the sink.
 * Only full pages (immutable history) can be resident. A physical page
 * (0..n_pages-1) holds one logical page of one slot across all dense layers.
 */
#ifndef AKV_ADMISSION_H
#define AKV_ADMISSION_H

#include <stddef.h>
#include <stdint.h>

#include "akv.h"

#ifdef __cplusplus
extern "C" {
#endif

#define AKV_ADM_NONE UINT32_MAX

typedef struct akv_adm akv_adm;

typedef struct akv_adm_config {
  uint32_t n_pages;          /* physical pages in the device pool (may be 0) */
  uint32_t max_contexts;     /* slots */
  uint32_t max_logical_pages;/* per slot: ceil(max_tokens / page_tokens) */
  uint32_t log_capacity;     /* bounded decision log entries (>= 1) */
  uint32_t n_headroom_pages; /* most headroom pages ever present (0 = no headroom); physical
                                pages n_pages.. n_pages + n_headroom_pages - 1, absent until
                                akv_adm_headroom_add */
} akv_adm_config;

/* One context's demand at a step boundary. */
typedef struct akv_adm_request {
  uint32_t slot;
  uint32_t full_pages; /* logical pages [0, full_pages) are full and may be resident */
} akv_adm_request;

/* A physical page newly mapped at this boundary: its content must be filled
 * from the host rows of (slot, logical) before anyone reads it, and the fill
 * must wait on `fence` (the last readers of the page's previous content;
 * 0 = none). */
typedef struct akv_adm_fill {
  uint32_t slot;
  uint32_t logical;
  uint32_t physical;
  uint64_t fence;
} akv_adm_fill;

akv_status akv_adm_create(const akv_adm_config *config, akv_adm **out);
void akv_adm_destroy(akv_adm *adm);

/* Admits a slot with a target (pages by right) and burst (pages it may borrow
 * while free). `id` is the context id that decisions and explain name (slots
 * are reused, ids are not). Requires the sum of admitted targets to fit n_pages after
 * reclaiming whole idle contexts' targets; otherwise AKV_ERR_ADMISSION_REFUSED
 * and nothing changes. A target of 0 is always admitted (pure staging).
 * `step` stamps the decision log. Admission itself moves no page. */
akv_status akv_adm_admit(akv_adm *adm, uint64_t step, uint32_t slot, uint32_t id,
                         uint32_t target, uint32_t burst);

/* Releases a slot: its pages return to the free list carrying their fences.
 * Only called at a step boundary (the engine forbids closing mid-step). */
akv_status akv_adm_release(akv_adm *adm, uint64_t step, uint32_t slot);

/* The step boundary: requests for the active slots (others are idle). Computes
 * each active slot's wanted set (sink + newest full pages, up to
 * target + burst) and fills it in the order of DESIGN §4. Afterwards
 * akv_adm_page_of and akv_adm_fills describe the new residency. */
akv_status akv_adm_step(akv_adm *adm, uint64_t step, const akv_adm_request *requests,
                        uint32_t n_requests);

/* Physical page of (slot, logical page), or AKV_ADM_NONE. */
uint32_t akv_adm_page_of(const akv_adm *adm, uint32_t slot, uint32_t logical);
/* Pages a slot holds now. */
uint32_t akv_adm_pages_held(const akv_adm *adm, uint32_t slot);
/* The fills produced by the last akv_adm_step; valid until the next call. */
size_t akv_adm_fills(const akv_adm *adm, const akv_adm_fill **out);

/* The engine records the fence of the last readers of a physical page
 * (monotonic serial); it travels with the page when the page is freed. */
void akv_adm_page_set_fence(akv_adm *adm, uint32_t physical, uint64_t fence);

/* Headroom (DESIGN §6): revocable pages after the pool's. Both calls run at a
 * step boundary only (the engine enforces it) and clear the fills.
 * add: the next `count` headroom pages become present and free (counter and
 * log: headroom-take). remove: the newest `count` present headroom pages
 * leave; a slot holding one loses it (its rows are staged from the
 * authoritative host copy again); *fence_out is the newest fence of their last
 * readers, which the caller must see proven before it frees their memory.
 * Counter and log: headroom-release. Both return AKV_OK or
 * AKV_ERR_INVALID_ARGUMENT (count out of range) and change nothing then. */
akv_status akv_adm_headroom_add(akv_adm *adm, uint64_t step, uint32_t count);
akv_status akv_adm_headroom_remove(akv_adm *adm, uint64_t step, uint32_t count,
                                   uint64_t *fence_out);
/* The slot a physical page is mapped to, or AKV_ADM_NONE. */
uint32_t akv_adm_page_owner(const akv_adm *adm, uint32_t physical);
/* Headroom pages present now. */
uint32_t akv_adm_headroom_pages(const akv_adm *adm);
/* Pages a slot holds beyond target + burst (its headroom extension). */
uint32_t akv_adm_headroom_held(const akv_adm *adm, uint32_t slot);

/* Diagnostics. */
void akv_adm_counters(const akv_adm *adm, uint64_t out[AKV_ADM_RULE_COUNT]);
size_t akv_adm_log_read(const akv_adm *adm, akv_adm_decision *out, size_t cap);
/* One readable paragraph about a slot (or, slot == AKV_ADM_NONE, the last
 * refusal). Returns the number of characters that would have been written. */
size_t akv_adm_explain(const akv_adm *adm, uint32_t slot, char *buf, size_t cap);

#ifdef __cplusplus
}
#endif

#endif /* AKV_ADMISSION_H */
