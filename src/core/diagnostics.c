/*
 * diagnostics.c - admission counters, decision log and explanations through
 * the public API. Allowed at any time, also after a transport failure.
 */
#include <stdio.h>
#include <string.h>

#include "internal.h"

static akv_status akv_admission_counters_claimed(const akv_engine *e, uint64_t *out, size_t n) {
  uint64_t all[AKV_ADM_RULE_COUNT];
  if (out == NULL || n == 0)
    return akv_fail((akv_engine *)e, AKV_ERR_INVALID_ARGUMENT,
                    "admission_counters: out is NULL or n is 0");
  akv_adm_counters(e->adm, all);
  memcpy(out, all, (n < AKV_ADM_RULE_COUNT ? n : AKV_ADM_RULE_COUNT) * sizeof(uint64_t));
  return AKV_OK;
}

AKV_API akv_status akv_admission_counters(const akv_engine *e, uint64_t *out, size_t n) {
  akv_status st = akv_engine_claim(e);
  if (st != AKV_OK) return st;
  st = akv_admission_counters_claimed(e, out, n);
  akv_engine_release(e);
  return st;
}

static akv_status akv_admission_log_claimed(const akv_engine *e, akv_adm_decision *out, size_t cap,
                                            size_t *n_out) {
  if (n_out == NULL || (out == NULL && cap > 0))
    return akv_fail((akv_engine *)e, AKV_ERR_INVALID_ARGUMENT,
                    "admission_log: n_out is NULL, or out is NULL with cap %zu", cap);
  *n_out = akv_adm_log_read(e->adm, out, cap);
  return AKV_OK;
}

AKV_API akv_status akv_admission_log(const akv_engine *e, akv_adm_decision *out, size_t cap,
                                     size_t *n_out) {
  akv_status st = akv_engine_claim(e);
  if (st != AKV_OK) return st;
  st = akv_admission_log_claimed(e, out, cap, n_out);
  akv_engine_release(e);
  return st;
}

static akv_status akv_admission_explain_claimed(const akv_engine *e, const akv_context *c,
                                                char *buf, size_t cap) {
  if (buf == NULL || cap == 0)
    return akv_fail((akv_engine *)e, AKV_ERR_INVALID_ARGUMENT,
                    "admission_explain: buf is NULL or cap is 0");
  /* A context of another engine: its atomic handle words only (step.c). */
  if (c != NULL && (!akv_context_ok(c) || AKV_LOAD(c->engine) != e))
    return akv_fail((akv_engine *)e, AKV_ERR_BAD_HANDLE,
                    "admission_explain: the context is not open on this engine");
  /* Invariant (akv.h): context NULL explains the last refused open, whichever
   * refusal it was: no host slot (AKV_ERR_REFUSED_QUEUE) here, a device
   * target that did not fit (AKV_ERR_ADMISSION_REFUSED) from admission. */
  if (c == NULL && e->refused_queue) {
    /* The host slots are the effective concurrency (akv_fit_report:
     * min(max_contexts, histories the host pool holds)): each figure once,
     * max_contexts only where the host fit lowered it. */
    if (e->concurrency < e->cfg.max_contexts)
      snprintf(buf, cap,
               "an open was refused at step %llu: all %u host slots were taken (the effective "
               "concurrency: max_contexts=%u lowered to the histories the %u GiB host pool "
               "holds); queue the request and retry after a close.",
               (unsigned long long)e->refused_queue_step, (unsigned)e->concurrency,
               (unsigned)e->cfg.max_contexts, (unsigned)e->cfg.host_pool_gib);
    else
      snprintf(buf, cap,
               "an open was refused at step %llu: all %u host slots were taken (the effective "
               "concurrency, max_contexts); queue the request and retry after a close.",
               (unsigned long long)e->refused_queue_step, (unsigned)e->concurrency);
    return AKV_OK;
  }
  size_t n = akv_adm_explain(e->adm, c != NULL ? c->slot : AKV_ADM_NONE, buf, cap);
  /* The admission floor, where it raised what the caller asked for. */
  uint32_t asked_t = c != NULL ? c->asked_target : e->refused_asked_target;
  /* Invariant (akv.h, akv_admission_explain): the floor sentence states
   * what the open asked for and what it was raised to, burst included, for
   * a refused open as for an open context (the refusal's own sentence names
   * the burst admission saw). */
  uint32_t asked_b = c != NULL ? c->asked_burst : e->refused_asked_burst;
  uint32_t got_t = c != NULL ? c->target : e->refused_target;
  uint32_t got_b = c != NULL ? c->burst : e->refused_burst;
  if ((asked_t != got_t || asked_b != got_b) && n < cap)
    snprintf(buf + n, cap - n,
             " It asked for a target of %u page%s (+%u burst), raised to %u (+%u burst): the "
             "floor of %u pages, the sink and the newest page, for a context that retains "
             "anything.",
             (unsigned)asked_t, asked_t == 1 ? "" : "s", (unsigned)asked_b, (unsigned)got_t,
             (unsigned)got_b, (unsigned)akv_admission_floor(e));
  return AKV_OK;
}

AKV_API akv_status akv_admission_explain(const akv_engine *e, const akv_context *c, char *buf,
                                         size_t cap) {
  akv_status st = akv_engine_claim(e);
  if (st != AKV_OK) return st;
  st = akv_admission_explain_claimed(e, c, buf, cap);
  akv_engine_release(e);
  return st;
}
