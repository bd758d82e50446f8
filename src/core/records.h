/*
 * records.h - process-wide pools of handle records (engines, contexts,
 * lease handles, host compute streams).
 *
 * A handle the library gives out is a pointer to a record from one of these
 * pools (streams: on the host backend only). Records are never freed: a chunk of them, once allocated, stays
 * mapped (and reachable from the pool) for the life of the process, so a
 * stale handle is always readable memory whose magic says "dead", never
 * freed memory. Free records wait in a FIFO: a record given back goes to the
 * tail and is handed out again only after every record ahead of it.
 *
 * Reuse bound (the promise akv.h states per handle type): a take never
 * leaves fewer than `min_free` records free (the pool grows by a chunk
 * first), so a record given back has at least min_free records ahead of it
 * and is handed out again by exactly the (ahead + 1)-th later take, never
 * sooner. akv_rec_untake (a create that failed after its take) puts the
 * record back at the head, so a failed create does not advance the queue.
 *
 * Thread safety: every function locks the pool's mutex; pools are shared by
 * all engines of the process.
 */
#ifndef AKV_RECORDS_H
#define AKV_RECORDS_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "akv.h"

typedef struct akv_recpool {
  pthread_mutex_t mu;
  size_t rec_size;  /* bytes per record */
  size_t min_free;  /* free records left after every take */
  size_t chunk;     /* records per chunk */
  void **ring;      /* [cap] FIFO of free records */
  size_t cap, head, count;
  size_t reserved;  /* takes promised to live engines (akv_rec_reserve) */
  void **chunks;    /* every chunk ever allocated: records are never freed */
  size_t n_chunks, chunks_cap;
} akv_recpool;

#define AKV_RECPOOL_INIT(type, min_free, chunk) \
  { PTHREAD_MUTEX_INITIALIZER, sizeof(type), (min_free), (chunk), NULL, 0, 0, 0, 0, NULL, 0, 0 }

/* The head of the FIFO (zeroed when never used before, else as given back),
 * or NULL when the pool could not grow (out of memory). */
void *akv_rec_take(akv_recpool *p);
/* Back to the head: undoes the last take of this record. */
void akv_rec_untake(akv_recpool *p, void *rec);
/* Back to the tail. The caller has poisoned the record's magic first. */
void akv_rec_give(akv_recpool *p, void *rec);
/* Grows the pool now so that n more records can be in use at once
 * without any take allocating (an engine reserves its concurrency at
 * create, so akv_context_open never allocates). AKV_OK or
 * AKV_ERR_OUT_OF_MEMORY (nothing reserved). */
akv_status akv_rec_reserve(akv_recpool *p, size_t n);
void akv_rec_unreserve(akv_recpool *p, size_t n);
/* 1 when ptr points into one of the pool's records, live or given back
 * (its chunks' address ranges; ptr is never dereferenced), else 0. */
int akv_rec_owns(akv_recpool *p, const void *ptr);
/* 1 when ptr is the first byte of one of the pool's records, live or given
 * back (ptr is never dereferenced), else 0: a pointer into the middle of a
 * record is not one. */
int akv_rec_holds(akv_recpool *p, const void *ptr);
/* Another layer's pool of handle records (the group layer's groups and
 * worlds), registered before its first record is handed out so that
 * akv_rec_any_handle knows it. Idempotent; at most AKV_REC_MAX_FOREIGN
 * pools (a further one is ignored, an internal limit no caller meets). */
#define AKV_REC_MAX_FOREIGN 4
void akv_rec_register_handles(akv_recpool *p);
/* 1 when ptr points into a record of any pool of handles this library gives
 * out (engines, contexts, leases, host streams, and the registered pools),
 * live or given back; ptr is never dereferenced. */
int akv_rec_any_handle(const void *ptr);
/* Free records now (for tests of the reuse bound). */
size_t akv_rec_free_count(akv_recpool *p);

/* The pools (records.c). */
/* The calling thread's name in owner words (engine and group claims): a
 * value no other thread of the process ever has, also after this thread
 * ended, never NULL, never dereferenced. */
const void *akv_rec_thread(void);

/* Takes a record's claim word for `me`, waiting (yielding) while another
 * thread holds it; returns at once when `me` holds it already. For a create
 * that builds the record it just took while a stale handle's call may hold
 * the word a moment (akv_engine_claim_record, akv_group_claim_record). */
void akv_rec_owner_wait(_Atomic(const void *) *owner, const void *me);

/* Forks this process went through, counted in the child (records.c): an
 * engine remembers the count at its create, and a call on an engine of
 * another count is a call on the parent's engine (akv_engine_claim). */
extern _Atomic uint32_t akv_fork_generation;

/* An object's fork count (an engine's, a group's, a world's): stamped at
 * its create, and a record's word a stale handle's call may read meanwhile,
 * so stored and read atomically. akv_rec_forked: the object was made before
 * a fork of this process, in the parent (its threads are not here). */
static inline void akv_rec_fork_stamp(uint32_t *gen) {
  __atomic_store_n(gen, atomic_load_explicit(&akv_fork_generation, memory_order_relaxed),
                   __ATOMIC_RELAXED);
}
static inline bool akv_rec_forked(const uint32_t *gen) {
  return __atomic_load_n(gen, __ATOMIC_RELAXED) !=
         atomic_load_explicit(&akv_fork_generation, memory_order_relaxed);
}

/* Registers the pools' fork handlers now, if not yet (every take and
 * reserve does it too). A layer above that registers fork handlers of its
 * own calls this first: pthread_atfork runs prepare handlers in the reverse
 * order of registration, so the upper layer's locks are taken before the
 * pools' at a fork, the order its calls take them in (an upper layer may
 * reach the pools while it holds its own locks; the pools never call up). */
void akv_rec_fork_register(void);

extern akv_recpool akv_engine_records;
extern akv_recpool akv_context_records;
extern akv_recpool akv_lease_records;
extern akv_recpool akv_stream_records; /* host backend compute streams */

#endif
