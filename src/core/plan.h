/*
 * plan.h - what a layer above the core needs to agree on an engine's plans:
 * a digest of the admission state (DESIGN §4) after each decision, and the
 * engine's serial to know the engine it keeps.
 *
 * The allocator is deterministic: engines fed the same inputs (pool pages,
 * concurrency, and the same sequence of opens, closes and step boundaries
 * with the same contexts and lengths) hold the same plan, so their digests
 * are equal. Distributed callers (src/dist) compare digests across ranks.
 * Pure C, no device dependency; the core never includes the layers above it.
 */
#ifndef AKV_PLAN_H
#define AKV_PLAN_H

#include <stdint.h>

#include "akv.h"

/*
 * 64-bit FNV-1a digest of the engine's plan: the step counter, the next
 * context id, every host slot (owner id, length, target, burst, pages held,
 * and the physical page of every logical page) and the admission counters.
 * Everything it covers is a logical decision; nothing about device addresses
 * or timing enters it, so two ranks with equal plans give equal digests.
 * Reads only; enqueues nothing; O(concurrency x logical pages per context).
 * Not thread-safe with calls on the same engine. Returns 0 for a bad handle
 * (a digest of a live engine is never 0: it always covers the geometry).
 */
uint64_t akv_engine_plan_digest(const akv_engine *engine);

/* The engine's serial: unique in the process and never 0 for a live
 * engine, 0 for a bad handle (NULL, destroyed). An engine handle is a record
 * that a later akv_engine_create hands out again (akv.h "Handle lifetimes"),
 * so a layer that keeps a handle records the serial when the engine is
 * created and acts on the handle only while the serial is the same: a
 * different one means its engine was destroyed, whatever the handle names
 * now. Reads only. */
uint64_t akv_engine_serial(const akv_engine *engine);

/* 1 while a step is open on the engine (akv_step_begin .. akv_step_end);
 * 0 otherwise or for a bad handle. Reads only. */
int akv_engine_step_open(const akv_engine *engine);

/* 1 while the engine's log callback runs (on the thread inside a call on
 * the engine: the claim, akv_engine_claim), when every call that changes
 * the engine is refused with AKV_ERR_IN_USE (akv_log_fn); 0 otherwise, for
 * a bad handle, or while another thread is inside a call on the engine
 * (the caller's next call on it is then refused). Reads only. */
int akv_engine_in_log(const akv_engine *engine);

/* 1 when `context` is an open context of `engine`; 0 otherwise (bad or
 * closed handles, another engine's context). Reads only. */
int akv_engine_owns_context(const akv_engine *engine, const akv_context *context);

/* 1 when `context` is an open context of `engine` whose dense layers hold
 * different row counts (akv_step_begin refuses it with
 * AKV_ERR_UNEVEN_LAYERS); 0 otherwise. Reads only. Per rank: the length a
 * group agrees on is the minimum over layers, so this is a local state. */
int akv_engine_context_uneven(const akv_engine *engine, const akv_context *context);

/* 1 when `context` is an open context of `engine` that akv_context_close
 * refuses with AKV_ERR_IN_USE (in the open step, or host page leases of it
 * still held); 0 otherwise. Reads only. Per rank: akv_step_end is not an
 * agreement point, so one rank may still be in the step another ended. */
int akv_engine_context_in_use(const akv_engine *engine, const akv_context *context);

#endif /* AKV_PLAN_H */
