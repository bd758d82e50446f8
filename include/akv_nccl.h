/*
 * akv_nccl.h - tensor parallel groups on the caller's NCCL communicator.
 *
 * Installed when libactivekv was built with NCCL (CMake found nccl.h and
 * libnccl). Everything a group
 * does after creation is in akv_group.h; this header only binds one rank's
 * engine to a communicator.
 *
 * One rank per GPU: each rank's engine holds its KV-head shard on its own
 * device (engine config device_ordinal) and stages it over its own PCIe
 * link. Ranks may be processes (one per GPU, as with torchrun, also across
 * machines: NCCL carries the agreement over the network) or threads of one
 * process (one per GPU, communicators from ncclCommInitAll).
 */
#ifndef AKV_NCCL_H
#define AKV_NCCL_H

#include <nccl.h>

#include "akv.h"
#include "akv_group.h"

#ifdef __cplusplus
extern "C" {
#endif

/**
 * Creates this rank's group on `comm` (the caller's communicator; the group
 * borrows it and never destroys it). `shard` is this rank's engine config:
 * its kv_heads is the rank's KV-head shard, device_ordinal its GPU; every
 * rank must give the same geometry. host_pool_gib, device_pool_gib and
 * max_contexts may differ: the group uses the MIN over ranks (host fit uses
 * the smallest rank's pool). config->rank and config->size must equal the
 * communicator's rank and count.
 *
 * A collective: every rank of comm calls it. Blocks until every rank
 * arrived, config->timeout_ms at most (plus connection setup, see below).
 * Stream behaviour: the group creates its own non-blocking stream on
 * shard->device_ordinal and runs its all-reduces there (a few hundred bytes
 * each, at agreement points only); it never touches the caller's streams,
 * and never changes the calling thread's current device (the group's is
 * made current for its own calls and the caller's restored).
 * Timeouts: the group waits on its collective by polling the stream and
 * ncclCommGetAsyncError; on a timeout or an asynchronous error it calls
 * ncclCommAbort(comm), which ends the communicator for every rank. A
 * communicator made non-blocking (ncclConfig_t.blocking = 0) lets the
 * timeout cover NCCL's connection setup too; with a blocking one, the first
 * collective may block inside NCCL while it connects.
 * Ownership: on AKV_OK the group is the caller's; free it with
 * akv_group_destroy. After AKV_ERR_TIMEOUT or AKV_ERR_COMM (here or from any
 * group call) comm was aborted: do not use or destroy it again.
 * NCCL: libactivekv does not link NCCL; the first call resolves NCCL's
 * entry points from the libnccl.so.2 the process already loaded (the one
 * that made comm: a framework's bundled copy or the toolkit's), else loads
 * libnccl.so.2 from the library path.
 * Returns, on every rank alike: AKV_OK, AKV_ERR_INVALID_ARGUMENT (a NULL
 * shard, config or out on any rank),
 * AKV_ERR_CONFIG (rank or size differ from comm's, a size above
 * AKV_GROUP_MAX_RANKS, timeout_ms 0, a digest
 * outside akv_group_digest, bad struct sizes: a
 * group config shorter than akv_group_config, a shard engine config below
 * its oldest layout; an older engine config is taken as akv_engine_create
 * takes it),
 * AKV_ERR_DISAGREE (geometry differs), AKV_ERR_NOT_SUPPORTED (headroom_gib
 * set on any rank: headroom is not agreed yet), the statuses of akv_engine_create
 * (the largest over ranks), AKV_ERR_QUARANTINED (ranks at different
 * agreement points: this create met a call another rank made on its
 * earlier group of the same ranks, which stops as diverged; nothing of the
 * new group is left), AKV_ERR_TIMEOUT, AKV_ERR_COMM; AKV_ERR_NOT_SUPPORTED
 * (this rank only: no libnccl.so.2 could be loaded); AKV_ERR_INVALID_ARGUMENT
 * (this rank only: comm NULL; the others time out); AKV_ERR_BACKEND (this rank only: the
 * group's stream or buffers could not be made; the others time out).
 */
AKV_API akv_status akv_nccl_group_create(const akv_engine_config *shard,
                                         const akv_group_config *config, ncclComm_t comm,
                                         akv_group **out);

#ifdef __cplusplus
}
#endif

#endif /* AKV_NCCL_H */
