/*
 * config.c - config structs of any size an older caller may pass (config.h).
 */
#include "config.h"

#include <stdio.h>
#include <string.h>

#define AKV_FIELD_END(type, field) (offsetof(type, field) + sizeof(((type *)0)->field))

/* One line per field, in declaration order. */
static const size_t akv_engine_config_ends[] = {
    AKV_FIELD_END(akv_engine_config, struct_size),
    AKV_FIELD_END(akv_engine_config, version),
    AKV_FIELD_END(akv_engine_config, backend),
    AKV_FIELD_END(akv_engine_config, device_ordinal),
    AKV_FIELD_END(akv_engine_config, n_dense_layers),
    AKV_FIELD_END(akv_engine_config, kv_heads),
    AKV_FIELD_END(akv_engine_config, head_dim),
    AKV_FIELD_END(akv_engine_config, dtype),
    AKV_FIELD_END(akv_engine_config, max_tokens),
    AKV_FIELD_END(akv_engine_config, page_tokens),
    AKV_FIELD_END(akv_engine_config, host_pool_gib),
    AKV_FIELD_END(akv_engine_config, device_pool_gib),
    AKV_FIELD_END(akv_engine_config, max_contexts),
    AKV_FIELD_END(akv_engine_config, fit_mode),
    AKV_FIELD_END(akv_engine_config, route),
    AKV_FIELD_END(akv_engine_config, log_fn),
    AKV_FIELD_END(akv_engine_config, log_user),
    AKV_FIELD_END(akv_engine_config, log_level),
    AKV_FIELD_END(akv_engine_config, host_delay_seed),
    AKV_FIELD_END(akv_engine_config, host_delay_max_us),
    AKV_FIELD_END(akv_engine_config, fault_fail_nth),
    AKV_FIELD_END(akv_engine_config, fault_kind),
    AKV_FIELD_END(akv_engine_config, poison_holes),
    AKV_FIELD_END(akv_engine_config, headroom_gib),
    AKV_FIELD_END(akv_engine_config, headroom_reserve_gib),
    AKV_FIELD_END(akv_engine_config, host_fake_free_bytes),
    AKV_FIELD_END(akv_engine_config, headroom_chunk_pages),
};

static const size_t akv_context_config_ends[] = {
    AKV_FIELD_END(akv_context_config, struct_size),
    AKV_FIELD_END(akv_context_config, version),
    AKV_FIELD_END(akv_context_config, target_pages),
    AKV_FIELD_END(akv_context_config, burst_pages),
};

/* The engine config's geometry and memory settings (through `route`) are
 * the smallest struct accepted: akv_fit reads them from the caller's struct
 * itself. A context config needs only its header (struct_size, version). */
const akv_config_layout akv_engine_config_layout = {
    "akv_engine_config", sizeof(akv_engine_config), AKV_FIELD_END(akv_engine_config, route),
    akv_engine_config_ends, sizeof(akv_engine_config_ends) / sizeof(akv_engine_config_ends[0])};
const akv_config_layout akv_context_config_layout = {
    "akv_context_config", sizeof(akv_context_config), AKV_FIELD_END(akv_context_config, version),
    akv_context_config_ends, sizeof(akv_context_config_ends) / sizeof(akv_context_config_ends[0])};

akv_status akv_config_merge(const akv_config_layout *layout, void *local, const void *caller,
                            char *why, size_t why_cap) {
  uint32_t struct_size;
  size_t take = 0;
  /* Every struct starts with uint32_t struct_size: always present. */
  memcpy(&struct_size, caller, sizeof struct_size);
  if (struct_size < layout->min_size) {
    if (why != NULL && why_cap > 0)
      snprintf(why, why_cap,
               "%s struct_size=%u is smaller than the %zu bytes of its oldest layout; initialise "
               "it with its _INIT macro",
               layout->name, (unsigned)struct_size, layout->min_size);
    return AKV_ERR_CONFIG;
  }
  for (size_t i = 0; i < layout->n_ends && layout->ends[i] <= struct_size; i++)
    take = layout->ends[i];
  memcpy(local, caller, take);
  memcpy(local, &struct_size, sizeof struct_size);
  return AKV_OK;
}
