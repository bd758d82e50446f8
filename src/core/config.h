/*
 * config.h - config structs of any size an older caller may pass (akv.h,
 * ABI): the fields its struct holds come from it, the rest from the
 * struct's _INIT defaults.
 */
#ifndef AKV_CONFIG_H
#define AKV_CONFIG_H

#include <stddef.h>
#include <stdint.h>

#include "akv.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Where each field of a config struct ends, in declaration order: the sizes
 * an older (shorter) struct may have. Appending a field to a config struct
 * is one more AKV_FIELD_END line in its table (config.c). */
typedef struct akv_config_layout {
  const char *name;    /* "akv_engine_config" */
  size_t size;         /* sizeof the struct in this library */
  size_t min_size;     /* the smallest struct_size accepted */
  const size_t *ends;  /* [n_ends], increasing */
  size_t n_ends;
} akv_config_layout;

extern const akv_config_layout akv_engine_config_layout;
extern const akv_config_layout akv_context_config_layout;

/*
 * Merges a caller's config into `local`, which holds the struct's _INIT
 * defaults: copies bytes [0, take) of `caller`, where take is the end of the
 * last field the caller's struct holds entirely (never past its
 * struct_size, never half a field); every later field keeps its default.
 * local's struct_size becomes the caller's (so a later check sees what the
 * caller passed). A struct_size beyond this library's struct takes every
 * field this library knows.
 * Returns AKV_OK, or AKV_ERR_CONFIG (struct_size below layout->min_size;
 * `local` untouched, `why` says so). Borrows everything for the call;
 * thread-safe.
 */
akv_status akv_config_merge(const akv_config_layout *layout, void *local, const void *caller,
                            char *why, size_t why_cap);

#ifdef __cplusplus
}
#endif

#endif /* AKV_CONFIG_H */
