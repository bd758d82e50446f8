/*
 * dist_fork.c - fork() handlers for the group layer's process-wide locks
 * (dist_fork.h).
 */
#include "dist_fork.h"

/* Invariant: fork() never leaves a lock of the group layer held in the
 * child. A thread inside akv_group_world_create, _abort or _destroy,
 * akv_group_create_inproc, a group create or destroy, or any group call
 * (its claim checks the handle against the group records) when another
 * thread forked held akv_world_mu or a record pool's mutex in the child for
 * good (its holder is not there), so the child's own first world or group
 * create blocked forever. fork waits for each of them (prepare) and parent
 * and child let go of them after it.
 * Lock order: akv_world_mu before the world records' mutex (akv_world_ok
 * checks a record under akv_world_mu); the group records' mutex is never
 * held with either. The group layer may reach the core's pools while it
 * holds a lock of its own and the core never calls up, so these are taken
 * before the core's pools: registered after the core's handlers
 * (akv_rec_fork_register), whose prepare pthread_atfork runs last.
 * The parent's groups and worlds are refused in the child (their
 * akv_fork_generation, records.h): their ranks' threads and in-process
 * worlds' waiters stayed in the parent, and a world's own mutex may be held
 * there. */
static void akv_dist_prefork(void) {
  pthread_mutex_lock(&akv_world_mu);
  pthread_mutex_lock(&akv_world_records.mu);
  pthread_mutex_lock(&akv_group_records.mu);
}

static void akv_dist_postfork(void) {
  pthread_mutex_unlock(&akv_group_records.mu);
  pthread_mutex_unlock(&akv_world_records.mu);
  pthread_mutex_unlock(&akv_world_mu);
}

static pthread_once_t akv_dist_once = PTHREAD_ONCE_INIT;

static void akv_dist_register(void) {
  akv_rec_fork_register();
  /* Groups and worlds are handles too: a CUDA engine refuses one passed
   * as its compute stream (akv_stream_queue). Registered here, before
   * either pool's first take (every create calls akv_dist_fork_register
   * first). */
  akv_rec_register_handles(&akv_group_records);
  akv_rec_register_handles(&akv_world_records);
  pthread_atfork(akv_dist_prefork, akv_dist_postfork, akv_dist_postfork);
}

void akv_dist_fork_register(void) { pthread_once(&akv_dist_once, akv_dist_register); }
