/*
 * group_inproc.c - groups whose ranks are threads of one process, on the
 * in-process collective (coll_inproc.c): akv_group_world_* and
 * akv_group_create_inproc (akv_group.h).
 */
#include <pthread.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "coll_inproc.h"
#include "dist_fork.h"
#include "group.h"
#include "records.h"

#define AKV_MAGIC_WORLD 0x57564b41u /* "AKVW" */
#define AKV_MAGIC_WORLD_DEAD 0xdeadbeefu

struct akv_group_world {
  uint32_t magic;
  uint32_t fork_gen; /* akv_fork_generation at create (records.h) */
  akv_inproc_world *w;
  uint32_t size;
  uint32_t max_contexts;
};

/* Worlds are records never freed (records.h), so a destroyed world stays
 * readable and is refused rather than read after free. */
akv_recpool akv_world_records = AKV_RECPOOL_INIT(struct akv_group_world, 32, 32);

/* Guards every world record's magic and w: a world call checks the magic and
 * uses w under it, so a concurrent akv_group_world_destroy either runs
 * before (the call sees a dead world) or after (the call is done with w);
 * never in between. Held for a few instructions, never across an agreement
 * (order: this mutex, then the in-process world's). */
pthread_mutex_t akv_world_mu = PTHREAD_MUTEX_INITIALIZER; /* dist_fork.h */

/* Caller holds akv_world_mu. Invariant: a world is read only through a
 * pointer to the first byte of a world record (so never through a pointer
 * that was never a world handle, whatever its bytes say: inside a record,
 * the caller's max_contexts may read as the magic) whose magic is live. */
static int akv_world_ok(const akv_group_world *gw) {
  /* Invariant: a forked child never uses a world of its parent (akv_group.h,
   * fork): its ranks' threads are in the parent, and its in-process
   * world's mutex may be held there for good. Refused as a destroyed one. */
  return gw != NULL && akv_rec_holds(&akv_world_records, gw) && gw->magic == AKV_MAGIC_WORLD &&
         !akv_rec_forked(&gw->fork_gen);
}

akv_status akv_group_world_create(uint32_t size, uint32_t max_contexts, akv_group_world **out) {
  if (out == NULL || size == 0 || max_contexts == 0) return AKV_ERR_INVALID_ARGUMENT;
  /* Invariant: a world has at most AKV_GROUP_MAX_RANKS ranks (akv_group.h
   * says why), so its table of ranks is a few KiB: the size is checked
   * before anything is taken or allocated. Like size 0 an argument, not a
   * config struct's field: AKV_ERR_INVALID_ARGUMENT. */
  if (size > AKV_GROUP_MAX_RANKS) return AKV_ERR_INVALID_ARGUMENT;
  akv_dist_fork_register();
  akv_group_world *gw = akv_rec_take(&akv_world_records);
  if (gw == NULL) return AKV_ERR_OUT_OF_MEMORY;
  pthread_mutex_lock(&akv_world_mu); /* a stale handle's call may read it */
  memset(gw, 0, sizeof *gw);
  pthread_mutex_unlock(&akv_world_mu);
  akv_status st = akv_inproc_world_create(size, akv_group_vector_len(max_contexts), &gw->w);
  if (st != AKV_OK) {
    gw->magic = AKV_MAGIC_WORLD_DEAD;
    akv_rec_untake(&akv_world_records, gw);
    return st;
  }
  gw->size = size;
  gw->max_contexts = max_contexts;
  pthread_mutex_lock(&akv_world_mu);
  akv_rec_fork_stamp(&gw->fork_gen);
  gw->magic = AKV_MAGIC_WORLD;
  pthread_mutex_unlock(&akv_world_mu);
  *out = gw;
  return AKV_OK;
}

akv_status akv_group_world_abort(akv_group_world *world) {
  akv_status st = AKV_ERR_INVALID_ARGUMENT;
  akv_dist_fork_register();
  pthread_mutex_lock(&akv_world_mu);
  if (akv_world_ok(world)) {
    akv_inproc_world_abort(world->w, "the caller aborted the world");
    st = AKV_OK;
  }
  pthread_mutex_unlock(&akv_world_mu);
  return st;
}

akv_status akv_group_world_destroy(akv_group_world *world) {
  akv_status st;
  akv_dist_fork_register();
  pthread_mutex_lock(&akv_world_mu);
  if (!akv_world_ok(world)) {
    pthread_mutex_unlock(&akv_world_mu);
    return AKV_ERR_INVALID_ARGUMENT;
  }
  /* AKV_ERR_BUSY while a rank's group (its collective) still uses it. A
   * collective is only made under akv_world_mu, so none appears between
   * this check and the free. */
  st = akv_inproc_world_destroy(world->w);
  if (st == AKV_OK) {
    world->w = NULL;
    world->magic = AKV_MAGIC_WORLD_DEAD;
  }
  pthread_mutex_unlock(&akv_world_mu);
  if (st == AKV_OK) akv_rec_give(&akv_world_records, world);
  return st;
}

akv_status akv_group_create_inproc(const akv_engine_config *shard, const akv_group_config *config,
                                   akv_group_world *world, akv_group **out) {
  akv_coll *coll = NULL;
  akv_status st;
  /* Without a config (its rank) or a world this rank cannot meet the
   * others; a NULL shard or out meets them (akv_group_create_with). */
  if (config == NULL || world == NULL) return AKV_ERR_INVALID_ARGUMENT;
  akv_dist_fork_register();
  pthread_mutex_lock(&akv_world_mu);
  if (!akv_world_ok(world)) {
    pthread_mutex_unlock(&akv_world_mu);
    return AKV_ERR_INVALID_ARGUMENT;
  }
  /* Fields read only where the caller's structs hold them (struct_size);
   * akv_group_create_with refuses sizes it does not take on every rank. */
  if (config->struct_size < offsetof(akv_group_config, size) + sizeof(config->size) ||
      config->size != world->size || config->rank >= world->size ||
      (shard != NULL && shard->struct_size >= offsetof(akv_engine_config, max_contexts) + sizeof(uint32_t) &&
       shard->max_contexts > world->max_contexts)) {
    pthread_mutex_unlock(&akv_world_mu);
    return AKV_ERR_CONFIG;
  }
  /* Once the collective lives, the world is busy: destroy refuses it, so w
   * stays valid for the agreement below without the mutex. */
  st = akv_inproc_coll_create(world->w, config->rank, &coll);
  pthread_mutex_unlock(&akv_world_mu);
  if (st == AKV_ERR_IN_USE) return AKV_ERR_CONFIG; /* the rank is taken: a rank the world does not take */
  if (st != AKV_OK) return st;
  st = akv_group_create_with(shard, config, coll, out);
  if (st != AKV_OK) coll->ops->destroy(coll); /* on failure the caller keeps it */
  return st;
}
