/*
 * records.c - process-wide FIFO pools of handle records, never freed
 * (records.h states the reuse bound they enforce).
 */
#include "records.h"

#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

akv_recpool akv_engine_records =
    AKV_RECPOOL_INIT(struct akv_engine, AKV_ENGINE_HANDLE_REUSE_MIN, AKV_ENGINE_HANDLE_REUSE_MIN);
akv_recpool akv_context_records =
    AKV_RECPOOL_INIT(struct akv_context, AKV_CONTEXT_HANDLE_REUSE_MIN, 256);
akv_recpool akv_lease_records =
    AKV_RECPOOL_INIT(struct akv_lease, AKV_LEASE_HANDLE_REUSE_MIN, 256);
akv_recpool akv_stream_records =
    AKV_RECPOOL_INIT(struct akv_stream_handle, AKV_STREAM_HANDLE_REUSE_MIN, 64);

/* Invariant: fork() never leaves a pool's mutex held in the child. A thread
 * inside akv_engine_create or _destroy, akv_context_open or _close, or
 * akv_stream_create when another thread forks held the mutex in the child
 * for good (its holder is not there), so the child's own first create
 * blocked forever. fork waits for every pool (prepare, in a fixed order;
 * no code holds two pools at once), and parent and child let go of them
 * after it. Registered once, before any pool is first used. */
static akv_recpool *const akv_pools[] = {&akv_engine_records, &akv_context_records,
                                         &akv_lease_records, &akv_stream_records};
#define AKV_N_POOLS (sizeof(akv_pools) / sizeof(akv_pools[0]))

static void akv_rec_prefork(void) {
  for (size_t i = 0; i < AKV_N_POOLS; i++) pthread_mutex_lock(&akv_pools[i]->mu);
}

static void akv_rec_postfork(void) {
  for (size_t i = AKV_N_POOLS; i-- > 0;) pthread_mutex_unlock(&akv_pools[i]->mu);
}

_Atomic uint32_t akv_fork_generation;

/* In the child, the engines made before the fork become the parent's
 * (akv_engine_claim refuses them): their queue threads did not come along. */
static void akv_rec_postfork_child(void) {
  akv_rec_postfork();
  atomic_fetch_add_explicit(&akv_fork_generation, 1, memory_order_relaxed);
}

static pthread_once_t akv_rec_once = PTHREAD_ONCE_INIT;

static void akv_rec_register_fork(void) {
  pthread_atfork(akv_rec_prefork, akv_rec_postfork, akv_rec_postfork_child);
}

void akv_rec_fork_register(void) { pthread_once(&akv_rec_once, akv_rec_register_fork); }

/* Appends a zeroed chunk of records to the tail. Called with p->mu held. */
static int akv_rec_grow(akv_recpool *p) {
  /* The ring holds every record there will be (all may be free at once). */
  size_t need = (p->n_chunks + 1) * p->chunk;
  unsigned char *chunk;
  if (p->n_chunks == p->chunks_cap) {
    size_t n = p->chunks_cap ? 2 * p->chunks_cap : 8;
    void **c = realloc(p->chunks, n * sizeof(*c));
    if (c == NULL) return 0;
    p->chunks = c;
    p->chunks_cap = n;
  }
  if (need > p->cap) {
    /* Unroll the ring into a larger one (handles never point into it). */
    size_t n = p->cap ? 2 * p->cap : p->chunk;
    void **r;
    while (n < need) n *= 2;
    r = malloc(n * sizeof(*r));
    if (r == NULL) return 0;
    for (size_t i = 0; i < p->count; i++) r[i] = p->ring[(p->head + i) % p->cap];
    free(p->ring);
    p->ring = r;
    p->cap = n;
    p->head = 0;
  }
  chunk = calloc(p->chunk, p->rec_size);
  if (chunk == NULL) return 0;
  p->chunks[p->n_chunks++] = chunk;
  for (size_t i = 0; i < p->chunk; i++)
    p->ring[(p->head + p->count++) % p->cap] = chunk + i * p->rec_size;
  return 1;
}

void *akv_rec_take(akv_recpool *p) {
  void *rec = NULL;
  akv_rec_fork_register();
  pthread_mutex_lock(&p->mu);
  /* The reuse bound: at least min_free records stay free after this take,
   * so a record given back later has at least min_free records ahead. */
  while (p->count <= p->min_free)
    if (!akv_rec_grow(p)) goto out;
  rec = p->ring[p->head];
  p->head = (p->head + 1) % p->cap;
  p->count--;
out:
  pthread_mutex_unlock(&p->mu);
  return rec;
}

void akv_rec_untake(akv_recpool *p, void *rec) {
  pthread_mutex_lock(&p->mu);
  /* The slot the take emptied is free: count < cap. */
  p->head = (p->head + p->cap - 1) % p->cap;
  p->ring[p->head] = rec;
  p->count++;
  pthread_mutex_unlock(&p->mu);
}

void akv_rec_give(akv_recpool *p, void *rec) {
  pthread_mutex_lock(&p->mu);
  /* Every record was in the ring once and cap holds them all: count < cap. */
  p->ring[(p->head + p->count++) % p->cap] = rec;
  pthread_mutex_unlock(&p->mu);
}

akv_status akv_rec_reserve(akv_recpool *p, size_t n) {
  akv_status st = AKV_OK;
  akv_rec_fork_register();
  pthread_mutex_lock(&p->mu);
  /* Enough free records that the reserved takes never grow the pool: a
   * take then always finds more than min_free free records. */
  p->reserved += n;
  while (p->count <= p->min_free + p->reserved)
    if (!akv_rec_grow(p)) {
      p->reserved -= n;
      st = AKV_ERR_OUT_OF_MEMORY;
      break;
    }
  pthread_mutex_unlock(&p->mu);
  return st;
}

void akv_rec_unreserve(akv_recpool *p, size_t n) {
  pthread_mutex_lock(&p->mu);
  p->reserved -= n;
  pthread_mutex_unlock(&p->mu);
}

/* Invariant: a thread's name is never given to another thread. It was
 * the address of a thread-local, which the C library hands to the next
 * thread it starts once the first ended (its cached stack and TLS block):
 * a thread that ended inside a call (an attention hook or log callback that
 * called pthread_exit) left its engine claimed under a name the next thread
 * then had, and that thread's calls nested into the dead one's half-done
 * call. Names are odd numbers from one process-wide counter (2^63 threads
 * before it wraps), taken at a thread's first claim; a forked child's
 * thread keeps its name, and its parent's other threads are not in it. */
static _Atomic uintptr_t akv_rec_next_thread = 1;
static _Thread_local uintptr_t akv_rec_my_thread;

const void *akv_rec_thread(void) {
  uintptr_t me = akv_rec_my_thread;
  if (me == 0) {
    me = atomic_fetch_add_explicit(&akv_rec_next_thread, 2, memory_order_relaxed);
    akv_rec_my_thread = me;
  }
  return (const void *)me;
}

void akv_rec_owner_wait(_Atomic(const void *) *owner, const void *me) {
  for (;;) {
    const void *none = NULL;
    if (atomic_compare_exchange_strong(owner, &none, me) || none == me) return;
    sched_yield();
  }
}

/* Whether ptr lies in one of p's chunks, and with `start` also at the first
 * byte of a record there. */
static int akv_rec_in(akv_recpool *p, const void *ptr, int start) {
  const uintptr_t x = (uintptr_t)ptr;
  int in = 0;
  akv_rec_fork_register(); /* a check may come before any take */
  pthread_mutex_lock(&p->mu);
  for (size_t i = 0; i < p->n_chunks && !in; i++) {
    const uintptr_t lo = (uintptr_t)p->chunks[i];
    in = x >= lo && x - lo < p->chunk * p->rec_size && (!start || (x - lo) % p->rec_size == 0);
  }
  pthread_mutex_unlock(&p->mu);
  return in;
}

int akv_rec_owns(akv_recpool *p, const void *ptr) { return akv_rec_in(p, ptr, 0); }

int akv_rec_holds(akv_recpool *p, const void *ptr) { return akv_rec_in(p, ptr, 1); }

/* The registered pools: slots filled once, in order, by compare-and-swap
 * (no lock a fork could leave held), never emptied; a reader sees a slot
 * only after its pool pointer is stored (release / acquire), and a pool is
 * registered before its first take, so a handle from it is never checked
 * against an unregistered pool. */
static _Atomic(akv_recpool *) akv_foreign[AKV_REC_MAX_FOREIGN];

void akv_rec_register_handles(akv_recpool *p) {
  for (size_t i = 0; i < AKV_REC_MAX_FOREIGN; i++) {
    akv_recpool *q = NULL;
    if (atomic_compare_exchange_strong_explicit(&akv_foreign[i], &q, p, memory_order_release,
                                                memory_order_acquire) ||
        q == p)
      return;
  }
}

int akv_rec_any_handle(const void *ptr) {
  if (akv_rec_owns(&akv_stream_records, ptr) || akv_rec_owns(&akv_engine_records, ptr) ||
      akv_rec_owns(&akv_context_records, ptr) || akv_rec_owns(&akv_lease_records, ptr))
    return 1;
  for (size_t i = 0; i < AKV_REC_MAX_FOREIGN; i++) {
    akv_recpool *q = atomic_load_explicit(&akv_foreign[i], memory_order_acquire);
    if (q == NULL) break;
    if (akv_rec_owns(q, ptr)) return 1;
  }
  return 0;
}

size_t akv_rec_free_count(akv_recpool *p) {
  size_t n;
  pthread_mutex_lock(&p->mu);
  n = p->count;
  pthread_mutex_unlock(&p->mu);
  return n;
}
