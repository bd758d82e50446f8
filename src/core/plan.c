/*
 * plan.c - the digest of an engine's admission plan (see plan.h).
 */
#include "plan.h"

#include "internal.h"

#define AKV_FNV_OFFSET 0xcbf29ce484222325ull
#define AKV_FNV_PRIME 0x100000001b3ull

static uint64_t akv_fnv_u64(uint64_t h, uint64_t v) {
  for (int i = 0; i < 8; i++) {
    h ^= (v >> (8 * i)) & 0xffu;
    h *= AKV_FNV_PRIME;
  }
  return h;
}

/* The group's reads of its engine (plan.h) claim it as every public call
 * does (akv_engine_claim): with another thread inside a call on the engine
 * (a caller that took it from akv_group_engine to another thread) they
 * answer as for a dead engine, and the group's next call on the engine is
 * refused with AKV_ERR_IN_USE. */
static uint64_t akv_engine_plan_digest_claimed(const akv_engine *e) {
  uint64_t h = AKV_FNV_OFFSET;
  uint64_t counters[AKV_ADM_RULE_COUNT] = {0};
  h = akv_fnv_u64(h, e->concurrency);
  h = akv_fnv_u64(h, e->n_pages);
  h = akv_fnv_u64(h, e->max_logical_pages);
  h = akv_fnv_u64(h, e->step);
  h = akv_fnv_u64(h, e->next_context_id);
  h = akv_fnv_u64(h, e->open_contexts);
  h = akv_fnv_u64(h, e->step_open);
  for (uint32_t s = 0; s < e->concurrency; s++) {
    const akv_context *c = e->slot_owner[s];
    if (c == NULL) {
      h = akv_fnv_u64(h, UINT64_MAX);
      continue;
    }
    h = akv_fnv_u64(h, c->id);
    h = akv_fnv_u64(h, c->len);
    h = akv_fnv_u64(h, c->target);
    h = akv_fnv_u64(h, c->burst);
    h = akv_fnv_u64(h, c->in_step);
    if (e->n_pages == 0) continue; /* no residency to describe */
    h = akv_fnv_u64(h, akv_adm_pages_held(e->adm, s));
    for (uint32_t p = 0; p < e->max_logical_pages; p++)
      h = akv_fnv_u64(h, akv_adm_page_of(e->adm, s, p));
  }
  akv_adm_counters(e->adm, counters);
  for (uint32_t r = 0; r < AKV_ADM_RULE_COUNT; r++) h = akv_fnv_u64(h, counters[r]);
  return h == 0 ? 1 : h;
}

uint64_t akv_engine_plan_digest(const akv_engine *e) {
  uint64_t h;
  if (akv_engine_claim(e) != AKV_OK) return 0;
  h = akv_engine_plan_digest_claimed(e);
  akv_engine_release(e);
  return h;
}

int akv_engine_step_open(const akv_engine *e) {
  int open;
  if (akv_engine_claim(e) != AKV_OK) return 0;
  open = e->step_open;
  akv_engine_release(e);
  return open;
}

int akv_engine_in_log(const akv_engine *e) {
  int in_log;
  if (akv_engine_claim(e) != AKV_OK) return 0;
  in_log = e->log_depth > 0;
  akv_engine_release(e);
  return in_log;
}

/* The context's checks, with its engine claimed. */
static int akv_engine_context_test(const akv_engine *e, const akv_context *c, int what) {
  int r;
  if (akv_engine_claim(e) != AKV_OK) return 0;
  r = akv_context_ok(c) && AKV_LOAD(c->engine) == e;
  if (r && what == 1) r = akv_context_uneven(e, c);
  if (r && what == 2) r = akv_context_in_use(c);
  akv_engine_release(e);
  return r;
}

int akv_engine_owns_context(const akv_engine *e, const akv_context *c) {
  return akv_engine_context_test(e, c, 0);
}

int akv_engine_context_uneven(const akv_engine *e, const akv_context *c) {
  return akv_engine_context_test(e, c, 1);
}

int akv_engine_context_in_use(const akv_engine *e, const akv_context *c) {
  return akv_engine_context_test(e, c, 2);
}
