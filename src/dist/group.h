/*
 * group.h - the agreement protocol over any collective (src/dist). Internal:
 * the public entry points are akv_group.h and akv_nccl.h.
 */
#ifndef AKV_DIST_GROUP_H
#define AKV_DIST_GROUP_H

#include "akv_group.h"
#include "collective.h"

/* Vector length every agreement point of a group uses, for a group whose
 * engines have `max_contexts` slots (the collective's max_n must be at least
 * this for the largest max_contexts of any rank). A max_contexts above the
 * engine's limit (AKV_FIT_MAX_CONTEXTS, src/core/fit.h) counts as the limit. */
size_t akv_group_vector_len(uint32_t max_contexts);

/*
 * Creates this rank's group: agrees the engine inputs with the other ranks
 * (geometry identical; host_pool_gib, device_pool_gib and max_contexts the
 * MIN over ranks), creates the engine from the agreed config, and compares
 * the outcome. On AKV_OK the group owns `coll`; otherwise the caller keeps
 * it. Every rank returns the same status. Blocks until every rank arrived.
 * Returns AKV_OK, AKV_ERR_INVALID_ARGUMENT, AKV_ERR_CONFIG, AKV_ERR_DISAGREE
 * (geometry differs), AKV_ERR_NOT_SUPPORTED (headroom_gib != 0 on any rank), AKV_ERR_NO_FIT, AKV_ERR_OUT_OF_MEMORY,
 * AKV_ERR_NOT_SUPPORTED, AKV_ERR_BACKEND (as akv_engine_create, the largest
 * over ranks), AKV_ERR_TIMEOUT, AKV_ERR_COMM.
 */
akv_status akv_group_create_with(const akv_engine_config *shard, const akv_group_config *config,
                                 akv_coll *coll, akv_group **out);

#endif /* AKV_DIST_GROUP_H */
