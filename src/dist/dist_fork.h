/*
 * dist_fork.h - the group layer's process-wide locks and fork() (src/dist).
 *
 * The group layer keeps its own process-wide state: the pools of group and
 * world records (records.h) and akv_world_mu, which guards every world
 * record. dist_fork.c registers fork handlers for them, as records.c does
 * for the core's pools, so a child forked while another thread is inside a
 * group or world call never starts with one of them held.
 */
#ifndef AKV_DIST_FORK_H
#define AKV_DIST_FORK_H

#include <pthread.h>

#include "records.h"

extern akv_recpool akv_group_records; /* group.c */
extern akv_recpool akv_world_records; /* group_inproc.c */
extern pthread_mutex_t akv_world_mu;  /* group_inproc.c */

/* Registers the group layer's fork handlers once (after the core's). Every
 * group and world entry point that takes one of the locks above calls it
 * first; it costs one pthread_once check. */
void akv_dist_fork_register(void);

#endif /* AKV_DIST_FORK_H */
