/*
 * tp_nccl.h - the activekv CLI's NCCL communicators for `decode --tp N` on
 * the CUDA backend. Built only when CMake found NCCL (ACTIVEKV_NCCL); the
 * CLI links the toolkit's libnccl for these, libactivekv does not.
 *
 * One process drives N GPUs, rank r on device r, one thread per rank (the
 * rank threads of the host path). ncclCommInitAll makes two cliques of N
 * communicators over devices 0..N-1, so every rank has two:
 *  - the group's, lent to akv_nccl_group_create for the agreement points;
 *    the group may abort it (a timeout or an NCCL error), after which it is
 *    gone;
 *  - the model's, for the tensor parallel all-reduce of the partial outputs
 *    (model_options.allreduce_dev: ncclAllReduce, sum, float, in place, on
 *    the model's compute stream).
 * Two, so that nothing the group does to its communicator reaches the
 * model's collectives, and each communicator runs on one stream only. Their
 * operations never overlap on a device: a group agreement completes (the
 * group polls it) before the rank's next forward enqueues an all-reduce,
 * and a forward synchronises its stream before the rank's next agreement.
 *
 * Not thread-safe except where stated: create and destroy from one thread
 * (the CLI's main thread), with no rank thread running; the per-rank calls
 * from that rank's thread only.
 */
#ifndef ACTIVEKV_EXAMPLE_TP_NCCL_H
#define ACTIVEKV_EXAMPLE_TP_NCCL_H

#include <stddef.h>
#include <stdint.h>

#include "akv.h"
#include "akv_group.h"

typedef struct tp_nccl tp_nccl;

#define TP_NCCL_MAX 16 /* most ranks */

/*
 * Sets NCCL's determinism settings (NCCL_ALGO=Ring, NCCL_PROTO=Simple and
 * NCCL_NVLS_ENABLE=0, each only if not set already), then makes both
 * cliques of n communicators on devices 0..n-1 (n must not exceed the
 * visible GPUs; the caller checks). 0, or -1 with the reason in err.
 */
int tp_nccl_create(uint32_t n, tp_nccl **out, char *err, size_t cap);

/* Rank `rank`'s group on its group communicator (akv_nccl_group_create; a
 * collective over the n rank threads). Records when the group aborted the
 * communicator (AKV_ERR_TIMEOUT, AKV_ERR_COMM), so that it is not destroyed
 * again. Rank thread only. */
akv_status tp_nccl_group_create(tp_nccl *t, uint32_t rank, const akv_engine_config *shard,
                                const akv_group_config *config, akv_group **out);

/* akv_group_destroy of rank `rank`'s group, first recording whether the
 * group aborted its communicator (a timeout or an NCCL error). Rank thread
 * only. */
akv_status tp_nccl_group_destroy(tp_nccl *t, uint32_t rank, akv_group *group);

/* The `user` of tp_nccl_allreduce for rank `rank` (model_options.allreduce_user). */
void *tp_nccl_user(tp_nccl *t, uint32_t rank);

/* model_options.allreduce_dev: enqueues the in-place sum over the ranks of
 * v[0..n) (device floats on the rank's GPU) on `stream` (the model's
 * cudaStream_t) through the rank's model communicator. Returns once
 * enqueued: 0, or -1 (the communicator failed). Rank thread only. */
int tp_nccl_allreduce(void *user, float *v, uint64_t n, void *stream);

/*
 * Frees every communicator not already gone: after a clean run (ok != 0)
 * each clique's ncclCommFinalize calls grouped (one thread finalizes every
 * rank), then ncclCommDestroy; after a failed one, or a clique with a
 * member the group aborted, ncclCommAbort (which does not wait for a
 * peer's collective). Only after every rank's group was destroyed and
 * every rank thread ended. NULL is a no-op.
 */
void tp_nccl_destroy(tp_nccl *t, int ok);

#endif /* ACTIVEKV_EXAMPLE_TP_NCCL_H */
