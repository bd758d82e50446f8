/*
 * coll_inproc.h - the in-process collective: threads of one process as the
 * ranks of a group. Used by the CPU tests (the agreement protocol on the
 * host backend) and by any caller that drives several engines from one
 * process without NCCL.
 *
 * A world is shared by its ranks; each rank makes its own akv_coll from it.
 * Thread safety: the world is thread-safe; each akv_coll is used by its own
 * rank's thread.
 */
#ifndef AKV_COLL_INPROC_H
#define AKV_COLL_INPROC_H

#include "collective.h"

typedef struct akv_inproc_world akv_inproc_world;

/* A world of `size` ranks whose vectors hold at most max_n values.
 * Returns AKV_OK, AKV_ERR_INVALID_ARGUMENT, AKV_ERR_OUT_OF_MEMORY. */
akv_status akv_inproc_world_create(uint32_t size, size_t max_n, akv_inproc_world **out);
/* Frees the world. Returns AKV_OK, AKV_ERR_INVALID_ARGUMENT (NULL),
 * AKV_ERR_BUSY (a rank's akv_coll still lives; nothing freed). */
akv_status akv_inproc_world_destroy(akv_inproc_world *w);
/* Rank `rank`'s collective. Returns AKV_OK, AKV_ERR_INVALID_ARGUMENT,
 * AKV_ERR_IN_USE (rank `rank` already has a live collective on this world),
 * AKV_ERR_OUT_OF_MEMORY. The world must outlive it. */
akv_status akv_inproc_coll_create(akv_inproc_world *w, uint32_t rank, akv_coll **out);
/* Aborts the world as an asynchronous communicator error would: ranks
 * waiting in allreduce_min wake with AKV_ERR_COMM, later calls fail at once.
 * Thread-safe. (Fault injection for tests.) */
void akv_inproc_world_abort(akv_inproc_world *w, const char *why);

#endif /* AKV_COLL_INPROC_H */
