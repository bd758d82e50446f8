/*
 * fit.c - host-fit arithmetic and engine-config validation (DESIGN §3).
 *
 * Every product is checked for overflow before it is formed; a config whose
 * arithmetic does not fit 64 bits (or size_t, for the pool allocations) is a
 * config error, never a silently wrapped size.
 */
#include "fit.h"

#include "akv_attention.h"

#include "budget.h"
#include "config.h"
#include "internal.h"

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#define AKV_GIB ((uint64_t)1 << 30)

/* The config fields this file reads end with `route`: an older, smaller
 * struct must still contain them. */
#define AKV_FIT_MIN_STRUCT_SIZE (offsetof(akv_engine_config, route) + sizeof(akv_route))

uint32_t akv_fit_dtype_size(akv_dtype dtype) {
  switch (dtype) {
  case AKV_DTYPE_BF16:
  case AKV_DTYPE_F16:
    return 2;
  case AKV_DTYPE_F32:
    return 4;
  case AKV_DTYPE_FP8_E4M3:
  case AKV_DTYPE_FP8_E5M2:
    return 1;
  }
  return 0;
}

static const char *akv_fit_dtype_name(akv_dtype dtype) {
  switch (dtype) {
  case AKV_DTYPE_BF16:
    return "bf16";
  case AKV_DTYPE_F16:
    return "f16";
  case AKV_DTYPE_F32:
    return "f32";
  case AKV_DTYPE_FP8_E4M3:
    return "fp8-e4m3";
  case AKV_DTYPE_FP8_E5M2:
    return "fp8-e5m2";
  }
  return "?";
}

/* *out = a * b; returns 0 when the product does not fit 64 bits (or size_t). */
static int akv_fit_mul(uint64_t a, uint64_t b, uint64_t *out) {
  if (a != 0 && b > UINT64_MAX / a) return 0;
  if (a * b > (uint64_t)SIZE_MAX) return 0;
  *out = a * b;
  return 1;
}

/* Writes a printf-formatted message into why (if any). */
static void akv_fit_say(char *why, size_t cap, const char *fmt, ...) {
  va_list ap;
  if (why == NULL || cap == 0) return;
  va_start(ap, fmt);
  vsnprintf(why, cap, fmt, ap);
  va_end(ap);
}

/* A byte count in the largest binary unit it reaches: "4 GiB", "3.875 GiB",
 * "2 MiB", "96 B"; at most three decimals, trailing zeros trimmed. */
void akv_fit_format_bytes(uint64_t bytes, char *buf, size_t cap) {
  static const char *const units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  unsigned u = 0;
  uint64_t scale = 1;
  while (u + 1 < sizeof units / sizeof units[0] && bytes / scale >= 1024) {
    scale <<= 10;
    u++;
  }
  if (bytes % scale == 0) {
    snprintf(buf, cap, "%llu %s", (unsigned long long)(bytes / scale), units[u]);
    return;
  }
  /* Thousandths, rounded half up, in integers: bring the scale down to 2^40
   * at most so that rem x 1000 cannot overflow. */
  uint64_t whole = bytes / scale;
  uint64_t rem = bytes % scale;
  while (scale > ((uint64_t)1 << 40)) {
    scale >>= 10;
    rem >>= 10;
  }
  uint64_t milli = (rem * 1000u + scale / 2u) / scale;
  if (milli >= 1000) {
    whole++;
    milli -= 1000;
  }
  if (milli == 0) {
    snprintf(buf, cap, "%llu %s", (unsigned long long)whole, units[u]);
    return;
  }
  char frac[8];
  snprintf(frac, sizeof frac, "%03u", (unsigned)milli);
  for (int i = 2; i > 0 && frac[i] == '0'; i--) frac[i] = '\0';
  snprintf(buf, cap, "%llu.%s %s", (unsigned long long)whole, frac, units[u]);
}

/* Checks one geometry value against (0, max]. */
static akv_status akv_fit_check_range(const char *name, uint64_t value, uint64_t max, char *why,
                                      size_t cap) {
  if (value == 0) {
    akv_fit_say(why, cap, "%s is 0; it must be at least 1", name);
    return AKV_ERR_CONFIG;
  }
  if (value > max) {
    akv_fit_say(why, cap, "%s=%llu is out of range; at most %llu is accepted", name,
                (unsigned long long)value, (unsigned long long)max);
    return AKV_ERR_CONFIG;
  }
  return AKV_OK;
}

/* Validates everything but the products. */
static akv_status akv_fit_validate(const akv_engine_config *cfg, char *why, size_t cap) {
  akv_status st = AKV_OK;
  if (cfg->struct_size < AKV_FIT_MIN_STRUCT_SIZE) {
    akv_fit_say(why, cap,
                "config struct_size=%u is smaller than the %zu bytes that hold its geometry; "
                "initialise it with AKV_ENGINE_CONFIG_INIT",
                (unsigned)cfg->struct_size, (size_t)AKV_FIT_MIN_STRUCT_SIZE);
    st = AKV_ERR_CONFIG;
    goto fail;
  }
  if (cfg->version == 0 || cfg->version > AKV_CONFIG_VERSION) {
    akv_fit_say(why, cap, "config version=%u is not between 1 and %u (AKV_CONFIG_VERSION)",
                (unsigned)cfg->version, (unsigned)AKV_CONFIG_VERSION);
    st = AKV_ERR_CONFIG;
    goto fail;
  }
  if ((unsigned)cfg->backend > (unsigned)AKV_BACKEND_CUDA) {
    akv_fit_say(why, cap, "backend=%d is not an akv_backend_kind (auto 0, host 1, cuda 2)",
                (int)cfg->backend);
    st = AKV_ERR_CONFIG;
    goto fail;
  }
  if (akv_fit_dtype_size(cfg->dtype) == 0) {
    akv_fit_say(why, cap, "dtype=%d is not an akv_dtype (bf16 0, f16 1, f32 2, fp8-e4m3 3, fp8-e5m2 4)", (int)cfg->dtype);
    st = AKV_ERR_CONFIG;
    goto fail;
  }
  if ((unsigned)cfg->fit_mode > (unsigned)AKV_FIT_SHRINK) {
    akv_fit_say(why, cap, "fit_mode=%d is not an akv_fit_mode (refuse 0, shrink 1)",
                (int)cfg->fit_mode);
    st = AKV_ERR_CONFIG;
    goto fail;
  }
  if ((unsigned)cfg->route > (unsigned)AKV_ROUTE_PAGED) {
    akv_fit_say(why, cap, "route=%d is not an akv_route (stage 0, arena 1, paged 2)",
                (int)cfg->route);
    st = AKV_ERR_CONFIG;
    goto fail;
  }
  st = akv_fit_check_range("n_dense_layers", cfg->n_dense_layers, AKV_FIT_MAX_LAYERS, why, cap);
  if (st != AKV_OK) goto fail;
  st = akv_fit_check_range("kv_heads", cfg->kv_heads, AKV_FIT_MAX_KV_HEADS, why, cap);
  if (st != AKV_OK) goto fail;
  st = akv_fit_check_range("head_dim", cfg->head_dim, AKV_FIT_MAX_HEAD_DIM, why, cap);
  if (st != AKV_OK) goto fail;
  st = akv_fit_check_range("max_tokens", cfg->max_tokens, UINT32_MAX, why, cap);
  if (st != AKV_OK) goto fail;
  st = akv_fit_check_range("page_tokens", cfg->page_tokens, UINT32_MAX, why, cap);
  if (st != AKV_OK) goto fail;
  /* page_tokens is the attention chunk (akv.h): a page is what
   * akv_attention_args_from_view hands the library's attention as
   * chunk_tokens, and those take at most AKV_ATTENTION_MAX_CHUNK_TOKENS
   * rows. The engine cannot tell whose attention the caller runs, so a page
   * no built-in attention could attend over is refused for every engine,
   * here, where akv_fit and akv_engine_create both check it. */
  if (cfg->page_tokens > AKV_ATTENTION_MAX_CHUNK_TOKENS) {
    akv_fit_say(why, cap,
                "page_tokens=%u exceeds %u (AKV_ATTENTION_MAX_CHUNK_TOKENS), the largest chunk "
                "the library's attention takes; a page is an attention chunk",
                (unsigned)cfg->page_tokens, (unsigned)AKV_ATTENTION_MAX_CHUNK_TOKENS);
    st = AKV_ERR_CONFIG;
    goto fail;
  }
  st = akv_fit_check_range("max_contexts", cfg->max_contexts, AKV_FIT_MAX_CONTEXTS, why, cap);
  if (st != AKV_OK) goto fail;
  if (cfg->host_pool_gib == 0) {
    akv_fit_say(why, cap, "host_pool_gib is 0: the pinned host pool would hold no history; "
                          "give it at least 1 GiB");
    st = AKV_ERR_CONFIG;
    goto fail;
  }
  st = akv_fit_check_range("host_pool_gib", cfg->host_pool_gib, AKV_FIT_MAX_POOL_GIB, why, cap);
  if (st != AKV_OK) goto fail;
  if (cfg->device_pool_gib > AKV_FIT_MAX_POOL_GIB) {
    akv_fit_say(why, cap, "device_pool_gib=%u is out of range; at most %u is accepted",
                (unsigned)cfg->device_pool_gib, (unsigned)AKV_FIT_MAX_POOL_GIB);
    st = AKV_ERR_CONFIG;
    goto fail;
  }
  if (cfg->host_delay_max_us > AKV_HOST_DELAY_MAX_US) {
    akv_fit_say(why, cap, "host_delay_max_us=%u is out of range; at most %u (1 s) is accepted",
                (unsigned)cfg->host_delay_max_us, (unsigned)AKV_HOST_DELAY_MAX_US);
    st = AKV_ERR_CONFIG;
    goto fail;
  }
  /* Invariant (akv.h, akv_engine_config): every enum field holds a value of
   * its enum, as route, fit_mode, backend and dtype above: a log_level past
   * AKV_LOG_DEBUG would log everything and a fault_kind outside akv_op_kind
   * (other than -1, all kinds) would never fire, both silently. */
  if ((unsigned)cfg->log_level > (unsigned)AKV_LOG_DEBUG) {
    akv_fit_say(why, cap, "log_level=%d is not an akv_log_level (error 0, warn 1, info 2, debug 3)",
                (int)cfg->log_level);
    st = AKV_ERR_CONFIG;
    goto fail;
  }
  if (cfg->fault_kind < -1 || cfg->fault_kind >= (int32_t)AKV_OP_KIND_COUNT) {
    akv_fit_say(why, cap,
                "fault_kind=%d is neither an akv_op_kind (0 to %d) nor -1 (every kind)",
                (int)cfg->fault_kind, (int)AKV_OP_KIND_COUNT - 1);
    st = AKV_ERR_CONFIG;
    goto fail;
  }
  if (cfg->page_tokens > cfg->max_tokens) {
    akv_fit_say(why, cap, "page_tokens=%u exceeds max_tokens=%u; a page cannot be longer than "
                          "a context",
                (unsigned)cfg->page_tokens, (unsigned)cfg->max_tokens);
    st = AKV_ERR_CONFIG;
    goto fail;
  }
  return AKV_OK;
fail:
  return st;
}

/* The message for a config whose max_contexts does not fit its host pool. */
static void akv_fit_explain_no_fit(const akv_engine_config *cfg, const akv_fit_report *r,
                                   uint64_t pair_bytes, char *why, size_t cap) {
  char hist[32];
  char tail[256];
  akv_fit_format_bytes(r->history_bytes, hist, sizeof hist);

  /* Largest max_tokens for which max_contexts histories fit the pool. */
  uint64_t per_token = 0; /* max_contexts x layers x row pair */
  uint64_t tokens_fit = 0;
  if (akv_fit_mul((uint64_t)cfg->max_contexts, (uint64_t)cfg->n_dense_layers, &per_token) &&
      akv_fit_mul(per_token, pair_bytes, &per_token))
    tokens_fit = r->host_pool_bytes / per_token;

  int n = 0;
  if (r->fits > 0)
    n = snprintf(tail, sizeof tail, "; to keep host_pool_gib=%u set max_contexts=%llu (or fewer)",
                 (unsigned)cfg->host_pool_gib, (unsigned long long)r->fits);
  else
    n = snprintf(tail, sizeof tail, "; host_pool_gib=%u holds no history at all",
                 (unsigned)cfg->host_pool_gib);
  if (n < 0) n = 0;
  if (tokens_fit >= cfg->page_tokens && (size_t)n < sizeof tail)
    n += snprintf(tail + n, sizeof tail - (size_t)n, "%s max_tokens=%llu (or fewer)",
                  r->fits > 0 ? ", or" : "; or set", (unsigned long long)tokens_fit);
  if (cfg->fit_mode == AKV_FIT_SHRINK && (size_t)n < sizeof tail)
    snprintf(tail + n, sizeof tail - (size_t)n, "; shrink mode runs %u context%s",
             (unsigned)r->effective_concurrency, r->effective_concurrency == 1 ? "" : "s");
  else if (r->fits > 0 && (size_t)n < sizeof tail)
    snprintf(tail + n, sizeof tail - (size_t)n, "; or set fit_mode=shrink to run %u context%s",
             (unsigned)r->effective_concurrency, r->effective_concurrency == 1 ? "" : "s");

  char needed[128];
  if (r->host_pool_gib_needed <= AKV_FIT_MAX_POOL_GIB)
    snprintf(needed, sizeof needed, "set host_pool_gib=%u (or more) to keep max_contexts=%u",
             (unsigned)r->host_pool_gib_needed, (unsigned)cfg->max_contexts);
  else if (r->host_pool_gib_needed != UINT32_MAX)
    snprintf(needed, sizeof needed,
             "max_contexts=%u would need host_pool_gib=%u, beyond the %u accepted",
             (unsigned)cfg->max_contexts, (unsigned)r->host_pool_gib_needed,
             (unsigned)AKV_FIT_MAX_POOL_GIB);
  else
    snprintf(needed, sizeof needed, "max_contexts=%u would need more than %u GiB of host pool",
             (unsigned)cfg->max_contexts, (unsigned)(UINT32_MAX - 1));
  akv_fit_say(why, cap,
              "max_contexts=%u does not fit the host pool: floor(%u GiB / %s per history) = %llu; "
              "%s%s",
              (unsigned)cfg->max_contexts, (unsigned)cfg->host_pool_gib, hist,
              (unsigned long long)r->fits, needed, tail);
}

akv_status akv_fit_compute(const akv_engine_config *cfg, akv_fit_report *r, char *why,
                           size_t why_cap) {
  akv_status st = AKV_OK;
  akv_fit_report rep;
  uint64_t pair_bytes = 0;

  if (why != NULL && why_cap > 0) why[0] = '\0';
  if (cfg == NULL || r == NULL) {
    akv_fit_say(why, why_cap, "%s is NULL", cfg == NULL ? "config" : "report");
    st = AKV_ERR_INVALID_ARGUMENT;
    goto fail;
  }
  st = akv_fit_validate(cfg, why, why_cap);
  if (st != AKV_OK) goto fail;

  memset(&rep, 0, sizeof rep);
  uint32_t dsize = akv_fit_dtype_size(cfg->dtype);
  uint64_t t = 0;
  st = AKV_ERR_CONFIG;
  /* row_bytes = kv_heads x head_dim x dtype size */
  if (!akv_fit_mul(cfg->kv_heads, cfg->head_dim, &t) || !akv_fit_mul(t, dsize, &rep.row_bytes)) {
    akv_fit_say(why, why_cap, "row_bytes = kv_heads %u x head_dim %u x %u B overflows",
                (unsigned)cfg->kv_heads, (unsigned)cfg->head_dim, (unsigned)dsize);
    goto fail;
  }
  if (!akv_fit_mul(rep.row_bytes, 2, &pair_bytes)) {
    akv_fit_say(why, why_cap, "row pair = 2 x %llu B overflows", (unsigned long long)rep.row_bytes);
    goto fail;
  }
  /* history_bytes = n_dense_layers x max_tokens x row_bytes x 2 */
  if (!akv_fit_mul(cfg->n_dense_layers, cfg->max_tokens, &t) ||
      !akv_fit_mul(t, pair_bytes, &rep.history_bytes)) {
    akv_fit_say(why, why_cap,
                "history_bytes = %u layers x %u tokens x %llu B per row pair overflows 64 bits; "
                "lower max_tokens or n_dense_layers",
                (unsigned)cfg->n_dense_layers, (unsigned)cfg->max_tokens,
                (unsigned long long)pair_bytes);
    goto fail;
  }
  /* page_bytes = page_tokens x n_dense_layers x row_bytes x 2 */
  if (!akv_fit_mul(cfg->page_tokens, cfg->n_dense_layers, &t) ||
      !akv_fit_mul(t, pair_bytes, &rep.page_bytes)) {
    akv_fit_say(why, why_cap, "page_bytes = %u tokens x %u layers x %llu B overflows",
                (unsigned)cfg->page_tokens, (unsigned)cfg->n_dense_layers,
                (unsigned long long)pair_bytes);
    goto fail;
  }
  if (!akv_fit_mul(cfg->host_pool_gib, AKV_GIB, &rep.host_pool_bytes)) {
    akv_fit_say(why, why_cap, "host_pool_gib=%u does not fit size_t", (unsigned)cfg->host_pool_gib);
    goto fail;
  }
  uint64_t device_pool_bytes = 0;
  if (!akv_fit_mul(cfg->device_pool_gib, AKV_GIB, &device_pool_bytes)) {
    akv_fit_say(why, why_cap, "device_pool_gib=%u does not fit size_t",
                (unsigned)cfg->device_pool_gib);
    goto fail;
  }
  rep.device_pages = device_pool_bytes / rep.page_bytes;
  /* Invariant (akv.h, akv_fit): the pool is checked against the page only
   * on a route that allocates it. The stage route never does (engine.c), so
   * a device_pool_gib that holds no page, or too many, is no error there. */
  const bool uses_pool = cfg->route != AKV_ROUTE_STAGE;
  if (uses_pool && cfg->device_pool_gib > 0 && rep.device_pages == 0) {
    char page[32];
    akv_fit_format_bytes(rep.page_bytes, page, sizeof page);
    akv_fit_say(why, why_cap,
                "device_pool_gib=%u holds no page of %s (page_tokens=%u); lower page_tokens, "
                "raise device_pool_gib, or set it to 0 for pure staging",
                (unsigned)cfg->device_pool_gib, page, (unsigned)cfg->page_tokens);
    goto fail;
  }
  if (uses_pool && rep.device_pages > UINT32_MAX) {
    akv_fit_say(why, why_cap,
                "device_pool_gib=%u would hold %llu pages, more than %u; raise page_tokens",
                (unsigned)cfg->device_pool_gib, (unsigned long long)rep.device_pages,
                (unsigned)UINT32_MAX);
    goto fail;
  }
  /* The paged headroom bound is a config error whatever the host fit says
   * (the bookkeeping check below runs only for a config that fits). */
  if (akv_budget_paged_headroom_pages(cfg, rep.device_pages, cfg->page_tokens, why, why_cap) !=
      AKV_OK)
    goto fail; /* st is AKV_ERR_CONFIG */
  st = AKV_OK;

  rep.fits = rep.host_pool_bytes / rep.history_bytes;
  rep.effective_concurrency =
      rep.fits < cfg->max_contexts ? (uint32_t)rep.fits : cfg->max_contexts;
  rep.ok = rep.fits >= cfg->max_contexts ? 1u : 0u;

  /* host_pool_gib_needed = ceil(max_contexts x history / GiB), formed without
   * the full product: history = q GiB + rem. */
  {
    uint64_t q = rep.history_bytes / AKV_GIB;
    uint64_t rem = rep.history_bytes % AKV_GIB;
    uint64_t whole = 0;
    uint64_t part = (uint64_t)cfg->max_contexts * rem; /* < 2^20 x 2^30 */
    uint64_t needed = 0;
    if (akv_fit_mul(q, cfg->max_contexts, &whole)) {
      needed = whole + part / AKV_GIB + (part % AKV_GIB != 0 ? 1u : 0u);
      rep.host_pool_gib_needed = needed >= UINT32_MAX ? UINT32_MAX : (uint32_t)needed;
    } else {
      rep.host_pool_gib_needed = UINT32_MAX;
    }
  }

  {
    char hist[32];
    akv_fit_format_bytes(rep.history_bytes, hist, sizeof hist);
    snprintf(rep.line, sizeof rep.line,
             "host fit: effective_concurrency = min(max_contexts=%u, floor(%u GiB host pool / "
             "%s per history)) = min(%u, %llu) = %u; history = %u dense layers x %u tokens x "
             "%llu B per row pair (K+V, %u kv_heads x %u head_dim x %u B %s) = %llu B",
             (unsigned)cfg->max_contexts, (unsigned)cfg->host_pool_gib, hist,
             (unsigned)cfg->max_contexts, (unsigned long long)rep.fits,
             (unsigned)rep.effective_concurrency, (unsigned)cfg->n_dense_layers,
             (unsigned)cfg->max_tokens, (unsigned long long)pair_bytes, (unsigned)cfg->kv_heads,
             (unsigned)cfg->head_dim, (unsigned)dsize, akv_fit_dtype_name(cfg->dtype),
             (unsigned long long)rep.history_bytes);
  }
  if (!rep.ok) akv_fit_explain_no_fit(cfg, &rep, pair_bytes, why, why_cap);

  /* The engine's bookkeeping, at the concurrency it would run (nothing to
   * check where create refuses for the host fit). */
  if (rep.ok || (cfg->fit_mode == AKV_FIT_SHRINK && rep.effective_concurrency > 0)) {
    akv_budget budget;
    st = akv_budget_compute(cfg, rep.effective_concurrency, cfg->page_tokens, &budget, why,
                            why_cap);
    if (st != AKV_OK) goto fail;
  }

  *r = rep;
  return AKV_OK;
fail:
  return st;
}

AKV_API akv_status akv_fit(const akv_engine_config *config, akv_fit_report *report) {
  /* An older caller's smaller struct: its fields, then the defaults, as
   * akv_engine_create takes it (the arithmetic never reads past its end). */
  akv_engine_config full = AKV_ENGINE_CONFIG_INIT;
  char why[1024] = "";
  if (config == NULL || report == NULL) return AKV_ERR_INVALID_ARGUMENT;
  akv_status st = akv_config_merge(&akv_engine_config_layout, &full, config, why, sizeof why);
  if (st == AKV_OK) st = akv_fit_compute(&full, report, why, sizeof why);
  /* The reason of a refusal goes to the config's log callback, in the words
   * akv_engine_create logs for the same config; without a callback a fit
   * (a query) stays silent rather than take create's stderr default. The
   * report stays untouched (akv_fit_compute writes it only on AKV_OK). */
  if (st != AKV_OK && full.log_fn != NULL)
    akv_log_cfg(&full, AKV_LOG_ERROR, "engine config rejected: %s", why);
  return st;
}
