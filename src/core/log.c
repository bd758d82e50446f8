/*
 * log.c - the engine never prints by itself: lines go to the caller's log
 * callback, or to stderr when none is set.
 */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "internal.h"

/* The caller's log callbacks running on this thread, innermost last, as
 * (log_fn, log_user) pairs. Invariant (akv.h, akv_log_fn): nothing is logged
 * to a callback from inside it. A line for a callback already running on
 * this thread is dropped, whichever engine (or engine-less create) logs it:
 * a callback that creates an engine of its own config, or calls another
 * engine of the same callback, cannot recurse into itself, let alone without
 * end. Callbacks run on the calling thread only (workers never log: the
 * host backend's queue threads, CUDA host functions and the caller's
 * functions from akv_stream_launch_host run no library code that logs), so a
 * per-thread record sees every nesting. Deeper than the record holds, lines
 * are dropped too. */
#define AKV_LOG_NEST_MAX 16
static _Thread_local struct {
  akv_log_fn fn;
  void *user;
} akv_log_running[AKV_LOG_NEST_MAX];
static _Thread_local uint32_t akv_log_nest;

static void akv_log_emit(const akv_engine_config *cfg, akv_log_level level, const char *fmt,
                         va_list ap) {
  char line[768];
  if (cfg != NULL && level > cfg->log_level) return;
  if (cfg != NULL && cfg->log_fn != NULL) {
    const uint32_t nest = akv_log_nest;
    for (uint32_t i = 0; i < nest; i++)
      if (akv_log_running[i].fn == cfg->log_fn && akv_log_running[i].user == cfg->log_user) return;
    if (nest == AKV_LOG_NEST_MAX) return;
    vsnprintf(line, sizeof(line), fmt, ap);
    akv_log_running[nest].fn = cfg->log_fn;
    akv_log_running[nest].user = cfg->log_user;
    akv_log_nest = nest + 1;
    cfg->log_fn(cfg->log_user, level, line);
    akv_log_nest = nest;
  } else {
    vsnprintf(line, sizeof(line), fmt, ap);
    static const char *const names[] = {"error", "warn", "info", "debug"};
    fprintf(stderr, "activekv %s: %s\n", names[level <= AKV_LOG_DEBUG ? level : AKV_LOG_DEBUG],
            line);
  }
}

void akv_log_cfg(const akv_engine_config *cfg, akv_log_level level, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  akv_log_emit(cfg, level, fmt, ap);
  va_end(ap);
}

/* The callback may call the library back: log_depth counts the callbacks
 * running on this engine so that calls changing it refuse meanwhile
 * (akv_engine_reentered). Engines are never const objects; only this
 * counter is written through the const handle. */
void akv_log(const akv_engine *e, akv_log_level level, const char *fmt, ...) {
  va_list ap;
  akv_engine *m = (akv_engine *)e;
  /* Invariant: no line reaches an engine's callback while that callback is
   * running on the engine. A call the callback makes (a diagnostic, or one
   * refused with AKV_ERR_IN_USE) returns its status and logs nothing, so a
   * callback whose call fails cannot recurse without end. Every call that
   * logs holds the engine's claim (akv_engine_claim), so only one thread is
   * ever here for an engine, and workers never log: log_depth > 0 here
   * means "called from inside the callback". */
  if (m != NULL && m->log_depth > 0) return;
  va_start(ap, fmt);
  if (m != NULL) m->log_depth++;
  akv_log_emit(e != NULL ? &e->cfg : NULL, level, fmt, ap);
  if (m != NULL) m->log_depth--;
  va_end(ap);
}

akv_status akv_fail(akv_engine *e, akv_status st, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(e->last_error, sizeof(e->last_error), fmt, ap);
  va_end(ap);
  akv_log(e, AKV_LOG_DEBUG, "%s: %s", akv_status_string(st), e->last_error);
  return st;
}
