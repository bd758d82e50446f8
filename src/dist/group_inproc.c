/*
 * group_inproc.c - groups whose ranks are threads of one process, on the
 * in-process collective (coll_inproc.c): akv_group_world_* and
 * akv_group_create_inproc (akv_group.h).
 */
#include <stddef.h>
#include <stdlib.h>

#include "coll_inproc.h"
#include "group.h"

struct akv_group_world {
  akv_inproc_world *w;
  uint32_t size;
  uint32_t max_contexts;
};

akv_status akv_group_world_create(uint32_t size, uint32_t max_contexts, akv_group_world **out) {
  if (out == NULL || size == 0 || max_contexts == 0) return AKV_ERR_INVALID_ARGUMENT;
  akv_group_world *gw = calloc(1, sizeof *gw);
  if (gw == NULL) return AKV_ERR_OUT_OF_MEMORY;
  akv_status st = akv_inproc_world_create(size, akv_group_vector_len(max_contexts), &gw->w);
  if (st != AKV_OK) {
    free(gw);
    return st;
  }
  gw->size = size;
  gw->max_contexts = max_contexts;
  *out = gw;
  return AKV_OK;
}

akv_status akv_group_world_abort(akv_group_world *world) {
  if (world == NULL) return AKV_ERR_INVALID_ARGUMENT;
  akv_inproc_world_abort(world->w, "the caller aborted the world");
  return AKV_OK;
}

akv_status akv_group_world_destroy(akv_group_world *world) {
  if (world == NULL) return AKV_ERR_INVALID_ARGUMENT;
  akv_inproc_world_destroy(world->w);
  free(world);
  return AKV_OK;
}

akv_status akv_group_create_inproc(const akv_engine_config *shard, const akv_group_config *config,
                                   akv_group_world *world, akv_group **out) {
  if (shard == NULL || config == NULL || world == NULL || out == NULL)
    return AKV_ERR_INVALID_ARGUMENT;
  /* Fields read only where the caller's structs hold them (struct_size);
   * akv_group_create_with refuses sizes it does not take on every rank. */
  if (config->struct_size < offsetof(akv_group_config, size) + sizeof(config->size) ||
      config->size != world->size || config->rank >= world->size ||
      (shard->struct_size >= offsetof(akv_engine_config, max_contexts) + sizeof(uint32_t) &&
       shard->max_contexts > world->max_contexts))
    return AKV_ERR_CONFIG;
  akv_coll *coll = NULL;
  akv_status st = akv_inproc_coll_create(world->w, config->rank, &coll);
  if (st != AKV_OK) return st;
  st = akv_group_create_with(shard, config, coll, out);
  if (st != AKV_OK) coll->ops->destroy(coll); /* on failure the caller keeps it */
  return st;
}
