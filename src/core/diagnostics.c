/*
 * diagnostics.c - admission counters, decision log and explanations through
 * the public API. Allowed at any time, also after a transport failure.
 */
#include <string.h>

#include "internal.h"

AKV_API akv_status akv_admission_counters(const akv_engine *e, uint64_t *out, size_t n) {
  uint64_t all[AKV_ADM_RULE_COUNT];
  if (!akv_engine_ok(e)) return AKV_ERR_BAD_HANDLE;
  if (out == NULL || n == 0) return AKV_ERR_INVALID_ARGUMENT;
  akv_adm_counters(e->adm, all);
  memcpy(out, all, (n < AKV_ADM_RULE_COUNT ? n : AKV_ADM_RULE_COUNT) * sizeof(uint64_t));
  return AKV_OK;
}

AKV_API akv_status akv_admission_log(const akv_engine *e, akv_adm_decision *out, size_t cap,
                                     size_t *n_out) {
  if (!akv_engine_ok(e)) return AKV_ERR_BAD_HANDLE;
  if (n_out == NULL || (out == NULL && cap > 0)) return AKV_ERR_INVALID_ARGUMENT;
  *n_out = akv_adm_log_read(e->adm, out, cap);
  return AKV_OK;
}

AKV_API akv_status akv_admission_explain(const akv_engine *e, const akv_context *c, char *buf,
                                         size_t cap) {
  if (!akv_engine_ok(e)) return AKV_ERR_BAD_HANDLE;
  if (buf == NULL || cap == 0) return AKV_ERR_INVALID_ARGUMENT;
  if (c != NULL && (!akv_context_ok(c) || c->engine != e)) return AKV_ERR_BAD_HANDLE;
  akv_adm_explain(e->adm, c != NULL ? c->slot : AKV_ADM_NONE, buf, cap);
  return AKV_OK;
}
