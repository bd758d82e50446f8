/*
 * group.c - the agreement protocol (akv_group.h, docs/distributed.md).
 *
 * Every agreement point is one MIN all-reduce of a fixed-length vector on the
 * group's collective (collective.h). The vector opens with a header every
 * point shares:
 *   op         same   the kind of point (create, open, close, step, check,
 *                     outcome): ranks at different kinds of point diverged
 *   seq        same   agreement points passed: ranks out of step diverged
 *   failed     min    this rank if its transport failed, else UINT64_MAX
 *   digest     same   the plan digest (0 when digests are not checked)
 *   local      max    the status of this rank's argument and state checks
 * then the point's own inputs. "same" fields travel as (v, ~v) and are equal
 * on every rank exactly when min == ~min(~v). The length is fixed for the
 * group's life (every rank passes the same n to the collective, whatever it
 * was asked), so a disagreement is data, never a mismatched collective.
 *
 * A decision is then taken locally from agreed inputs (the allocator is
 * deterministic) and its outcome (status and new digest) is compared in a
 * second collective. Any disagreement about the plan, or any failed rank,
 * quarantines every rank at the same point: each rank reads the same reduced
 * vector, so each takes the same branch.
 */
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config.h"
#include "dist_fork.h"
#include "fit.h"
#include "group.h"
#include "internal.h"
#include "plan.h"
#include "records.h"

#define AKV_MAGIC_GROUP 0x474b5641u /* "AVKG" */
#define AKV_MAGIC_GROUP_DEAD 0xdeadbeefu
#define AKV_GROUP_HEADER_LEN 8u  /* slots of the shared header */
#define AKV_GROUP_FIXED_LEN 32u  /* header + the largest fixed payload (create) */

typedef enum akv_point {
  AKV_POINT_CREATE = 1,
  AKV_POINT_OPEN = 2,
  AKV_POINT_CLOSE = 3,
  AKV_POINT_STEP = 4,
  AKV_POINT_CHECK = 5,
  AKV_POINT_OUTCOME = 6
} akv_point;

struct akv_group {
  uint32_t magic;
  uint32_t fork_gen;        /* akv_fork_generation at create (records.h); atomic */
  akv_engine *engine;       /* as created; reached only through akv_group_own */
  uint64_t engine_serial;   /* akv_engine_serial of it at create */
  akv_coll *coll;
  akv_group_config cfg;
  akv_engine_config local;  /* as this rank configured it */
  akv_engine_config agreed; /* what the engine was created with */
  uint32_t concurrency;
  size_t vec_len;           /* every collective of this group passes this n */
  uint64_t *vec;            /* [coll->max_n] */
  size_t at;                /* cursor while writing or reading vec */
  uint64_t seq;
  uint64_t agreements;
  uint64_t digest;
  int check_digest;
  int stopped;
  int in_log;               /* 1 while the log callback runs (see akv_group_log) */
  int deciding;             /* 1 while the engine decides between two collectives */
  int quarantine_due;       /* 1: stopped from the engine's log callback (akv_group_settle) */
  akv_group_reason reason;
  uint32_t failed_rank;
  char last_error[512];
  _Atomic(const void *) owner; /* the thread inside a call on this group, or NULL */
  uint32_t depth;              /* the owner's calls in progress (nested from callbacks) */
  int cancel_state;            /* the owner's cancelability before its outermost call */
  uint32_t magic_end;
};

/* Groups are records never freed (records.h): a destroyed group stays
 * readable and answers AKV_ERR_BAD_HANDLE instead of being read after free. */
akv_recpool akv_group_records = AKV_RECPOOL_INIT(struct akv_group, 32, 32); /* dist_fork.h */

static int akv_group_ok(const akv_group *g) {
  return g != NULL && g->magic == AKV_MAGIC_GROUP && g->magic_end == AKV_MAGIC_GROUP;
}

/* The magic read before the group is claimed, so atomically: a destroy on
 * the thread that holds the group may be poisoning it (akv_group_poison).
 * Only a record that reads as a group has its owner word written (a
 * pointer into the middle of a record is refused before: akv_group_claim). */
static int akv_group_looks_ok(const akv_group *g) {
  return __atomic_load_n(&g->magic, __ATOMIC_RELAXED) == AKV_MAGIC_GROUP &&
         __atomic_load_n(&g->magic_end, __ATOMIC_RELAXED) == AKV_MAGIC_GROUP;
}

static void akv_group_poison(akv_group *g) {
  __atomic_store_n(&g->magic, AKV_MAGIC_GROUP_DEAD, __ATOMIC_RELAXED);
  __atomic_store_n(&g->magic_end, AKV_MAGIC_GROUP_DEAD, __ATOMIC_RELAXED);
}

static void akv_group_release(const akv_group *cg);

/* Invariant: at most one thread is inside the calls of a group (akv_group.h,
 * Thread safety). Every public group call claims the group first and
 * releases it on return; the thread already inside may claim again (a call
 * made from a log callback during one of its calls: those rules are the
 * Logging ones), any other thread is refused with AKV_ERR_IN_USE, having
 * read only the record's magic and written nothing of the group. Without this a second thread
 * of a rank met the other ranks as one more rank (two threads of rank 0
 * completed a round of a two-rank group between them), and a destroy from
 * another thread freed the vector and the collective under a call waiting
 * at an agreement point. The pointer is checked to be a group record,
 * and the record to read as a live group, before its owner word is
 * written (records are never freed), and the magic again once claimed: a
 * destroy poisons it before it releases the group. */
static akv_status akv_group_claim(const akv_group *cg) {
  akv_group *g = (akv_group *)cg; /* a record: only the owner word is written */
  const void *me = akv_rec_thread(), *none = NULL; /* never another thread's */
  /* Invariant: a handle is the first byte of a group record. A pointer
   * into the middle of one would read the caller's own config words (kept
   * in the record) as the magics, and past the pool's chunk for the last
   * record; it is refused before anything of it is read. */
  akv_dist_fork_register();
  if (cg == NULL || !akv_rec_holds(&akv_group_records, cg) || !akv_group_looks_ok(cg))
    return AKV_ERR_BAD_HANDLE;
  /* Invariant: a forked child never runs a call on a group of its parent
   * (akv_group.h, fork), as for engines (akv_engine_claim): the other
   * ranks, the group's engine's queue threads and a thread that may own the
   * group are in the parent, and an in-process world's mutex may be held
   * there for good. Checked before the owner word, which a parent's thread
   * may hold for ever in the child. */
  if (akv_rec_forked(&g->fork_gen)) return AKV_ERR_BAD_HANDLE;
  if (!atomic_compare_exchange_strong(&g->owner, &none, me) && none != me) return AKV_ERR_IN_USE;
  /* Invariant: a group call is not a cancellation point. A thread
   * cancelled inside one (pthread_cancel while it waits at an agreement
   * point) died holding the in-process world's mutex, and every other rank
   * and world call then blocked on it for good (no timeout frees a mutex),
   * while this group stayed claimed by a dead thread. Cancellation is off
   * from the outermost claim to its release; a pending cancel acts at the
   * caller's next cancellation point after the call returned. */
  if (g->depth++ == 0) pthread_setcancelstate(PTHREAD_CANCEL_DISABLE, &g->cancel_state);
  if (!akv_group_ok(g)) {
    akv_group_release(g);
    return AKV_ERR_BAD_HANDLE;
  }
  return AKV_OK;
}

static void akv_group_release(const akv_group *cg) {
  akv_group *g = (akv_group *)cg;
  if (--g->depth == 0) {
    const int cancel = g->cancel_state;
    atomic_store(&g->owner, NULL);
    pthread_setcancelstate(cancel, NULL);
  }
}

/* Invariant: a record is built only while its builder holds its claim
 * words, and made live (its magic) before they are released. A stale
 * handle's call (a destroyed group's, "at least 32 later group creates")
 * may claim the record or read its magic meanwhile: it is refused
 * (AKV_ERR_IN_USE, or a dead magic) until the create is done, and its
 * claim, which then acquires what the release published, sees a whole
 * group. Without this, the create's memset and magic stores raced the
 * stale call's reads of the magic and its claim words. A thread that
 * claimed the dead record lets go at once (akv_group_claim), so the wait
 * is short. Cancellation is already off (akv_group_create_with). */
static void akv_group_claim_record(akv_group *g) {
  akv_rec_owner_wait(&g->owner, akv_rec_thread());
  if (g->depth++ == 0) g->cancel_state = PTHREAD_CANCEL_DISABLE;
}

/* The group's engine, or NULL before create made it and once the caller
 * destroyed it directly (akv_engine_destroy on akv_group_engine's handle).
 * Invariant: every group call reaches the engine through this, so a group
 * never acts on an engine it did not create. The handle alone cannot say:
 * it is a record that later akv_engine_create calls hand out again (akv.h
 * "Handle lifetimes"), naming a newer engine; the serial recorded at create
 * names this engine only (plan.h), however many engines were created
 * since. */
static akv_engine *akv_group_own(const akv_group *g) {
  if (g->engine == NULL || akv_engine_serial(g->engine) != g->engine_serial) return NULL;
  return g->engine;
}

/* Invariant: an agreement call holds its engine's claim (akv_engine_claim,
 * which the thread inside may take again) from its first read of the
 * engine to its return, or it enters no collective. Without it, another
 * thread inside a call on the engine (a caller that took akv_group_engine's
 * handle to another thread) made every read of the group answer as for a
 * dead engine: the rank sent a zero digest and a failed transport, so every
 * rank of the group quarantined (reason PEER_FAILED, a transport failure
 * that never happened), and this rank's own quarantine was refused
 * (AKV_ERR_IN_USE) while the group said it was done. Such a call now
 * returns AKV_ERR_IN_USE on this rank only, as akv_group.h (Thread safety)
 * says, having entered no collective; the claim held, no other thread's
 * call reaches the engine until the agreement is over. *held: the engine
 * to release on return, NULL when there is none to hold (not the group's
 * any more: akv_group_own says so to the rest of the call). */
static akv_status akv_group_hold_engine(akv_group *g, akv_engine **held) {
  akv_engine *e = akv_group_own(g);
  akv_status st;
  *held = NULL;
  if (e == NULL) return AKV_OK;
  st = akv_engine_claim(e);
  if (st == AKV_ERR_IN_USE) {
    snprintf(g->last_error, sizeof(g->last_error),
             "this rank's engine is in use by another thread: refused, no collective");
    return AKV_ERR_IN_USE;
  }
  if (st != AKV_OK) return AKV_OK; /* destroyed or a parent's: the call sees that */
  if (akv_engine_serial(e) != g->engine_serial) { /* destroyed before the claim */
    akv_engine_release(e);
    return AKV_OK;
  }
  *held = e;
  return AKV_OK;
}

/* A public agreement call's entry: the group's claim, then its engine's
 * (akv_group_hold_engine); on a refusal nothing is held. */
static akv_status akv_group_call_begin(akv_group *g, akv_engine **held) {
  akv_status st = akv_group_claim(g);
  *held = NULL;
  if (st != AKV_OK) return st;
  st = akv_group_hold_engine(g, held);
  if (st != AKV_OK) akv_group_release(g);
  return st;
}

/* Its return: the engine, then the group. */
static void akv_group_call_end(akv_group *g, akv_engine *held) {
  if (held != NULL) akv_engine_release(held);
  akv_group_release(g);
}

/* 1 once the engine the group created is gone (destroyed directly). */
static int akv_group_engine_lost(const akv_group *g) {
  return g->engine != NULL && akv_group_own(g) == NULL;
}

size_t akv_group_vector_len(uint32_t max_contexts) {
  /* Invariant: no agreed concurrency exceeds AKV_FIT_MAX_CONTEXTS
   * (akv_engine_create refuses a larger max_contexts, and the agreed
   * concurrency is at most the engine's), so a vector sized for that many
   * holds every step. A caller's larger number (a world "of any size", a
   * shard the engine will refuse) sizes no buffer beyond it, so such a
   * shard reaches the agreement and is refused there on every rank. */
  const uint32_t m = max_contexts < AKV_FIT_MAX_CONTEXTS ? max_contexts : AKV_FIT_MAX_CONTEXTS;
  /* step: n (2) + ids (2 per context) + lengths (2 per context) */
  size_t step = AKV_GROUP_HEADER_LEN + 2u + 4u * (size_t)m;
  return step > AKV_GROUP_FIXED_LEN ? step : AKV_GROUP_FIXED_LEN;
}

static void akv_group_log(akv_group *g, const akv_engine_config *cfg, akv_log_level level,
                          const char *fmt, ...) __attribute__((format(printf, 4, 5)));
/* A group call the callback makes on this group logs nothing: every refused
 * call logs a warning, so a callback that calls back would recurse without
 * end. */
static void akv_group_log(akv_group *g, const akv_engine_config *cfg, akv_log_level level,
                          const char *fmt, ...) {
  char line[512];
  va_list ap;
  int n;
  if (cfg == NULL || level > cfg->log_level || g->in_log) return;
  n = snprintf(line, sizeof(line), "group rank %u/%u: ", g->cfg.rank, g->cfg.size);
  va_start(ap, fmt);
  vsnprintf(line + n, sizeof(line) - (size_t)n, fmt, ap);
  va_end(ap);
  if (cfg->log_fn != NULL) {
    g->in_log = 1;
    /* Through the engine's sink (log.c), which keeps the invariant of akv.h
     * (akv_log_fn) for group lines too: a line for a callback already
     * running on this thread (an engine's line, or another group's, that
     * called this group) is dropped, never nested in it. */
    akv_log_cfg(cfg, level, "%s", line);
    g->in_log = 0;
  } else
    fprintf(stderr, "activekv: %s\n", line);
}

static akv_status akv_group_fail(akv_group *g, akv_status st, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static akv_status akv_group_fail(akv_group *g, akv_status st, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(g->last_error, sizeof(g->last_error), fmt, ap);
  va_end(ap);
  akv_group_log(g, &g->local, AKV_LOG_WARN, "%s", g->last_error);
  return st;
}

/* Stops the group: every rank reaches this at the same agreement point (or,
 * for a timeout or a communicator failure, at its own), quarantines its
 * engine, and from then on refuses every agreement call without entering a
 * collective. Returns the status the caller returns. */
static akv_status akv_group_stop(akv_group *g, akv_group_reason reason, uint32_t failed_rank,
                                 akv_status st, const char *why) {
  akv_engine *e = akv_group_own(g);
  g->stopped = 1;
  g->reason = reason;
  g->failed_rank = failed_rank;
  if (e != NULL && akv_engine_in_log(e)) {
    /* The engine refuses a quarantine from inside its log callback: owed,
     * see akv_group_settle. */
    g->quarantine_due = 1;
    return akv_group_fail(g, st, "%s; engine quarantine deferred to this rank's next agreement "
                          "call outside the engine's log callback", why);
  }
  if (e != NULL) {
    akv_quarantine_report rep;
    akv_status q = akv_engine_quarantine(e, &rep);
    return akv_group_fail(g, st, "%s; engine quarantined (%s)", why, akv_status_string(q));
  }
  if (akv_group_engine_lost(g))
    return akv_group_fail(g, st, "%s; this rank's engine was destroyed directly", why);
  return akv_group_fail(g, st, "%s", why);
}

/* Invariant: every rank whose group stopped quarantines its engine
 * (akv_group.h). A stop reached by an agreement call made from the engine's
 * own log callback cannot (the engine refuses it there: akv_log_fn), so it
 * is owed and made here, at the rank's next agreement call outside the
 * callback (which blocks anyway), before the group refuses that call. */
static void akv_group_settle(akv_group *g) {
  akv_engine *e;
  if (!g->quarantine_due) return;
  e = akv_group_own(g);
  if (e == NULL) {
    g->quarantine_due = 0; /* destroyed directly: nothing left to quarantine */
  } else if (!akv_engine_in_log(e)) {
    akv_quarantine_report rep;
    akv_status q = akv_engine_quarantine(e, &rep);
    g->quarantine_due = 0;
    snprintf(g->last_error, sizeof(g->last_error), "deferred engine quarantine: %s",
             akv_status_string(q));
  }
}

/* ---------------------------------------------------------------- vector */

static void akv_put_same(akv_group *g, uint64_t x) {
  g->vec[g->at++] = x;
  g->vec[g->at++] = ~x;
}
static void akv_put_min(akv_group *g, uint64_t x) { g->vec[g->at++] = x; }
static void akv_put_max(akv_group *g, uint64_t x) { g->vec[g->at++] = ~x; }
static int akv_get_same(akv_group *g, uint64_t *x) {
  const uint64_t mn = g->vec[g->at], mx = ~g->vec[g->at + 1];
  g->at += 2;
  if (x != NULL) *x = mn;
  return mn == mx;
}
static uint64_t akv_get_min(akv_group *g) { return g->vec[g->at++]; }
static uint64_t akv_get_max(akv_group *g) { return ~g->vec[g->at++]; }

/* This rank's transport failed, or its engine was destroyed directly (a
 * failed rank to every rank: the group stops at this agreement point). */
static int akv_group_engine_failed(const akv_group *g) {
  akv_engine_info info;
  akv_engine *e = akv_group_own(g);
  if (g->engine == NULL) return 0; /* create, before the engine exists */
  if (e == NULL || akv_engine_info_get(e, &info) != AKV_OK) return 1;
  return info.transport_failed;
}

static void akv_group_put_header(akv_group *g, akv_point op, akv_status local) {
  memset(g->vec, 0, g->vec_len * sizeof(uint64_t));
  g->at = 0;
  akv_put_same(g, op);
  akv_put_same(g, g->seq);
  akv_put_min(g, akv_group_engine_failed(g) ? g->cfg.rank : UINT64_MAX);
  akv_put_same(g, g->check_digest ? akv_engine_plan_digest(akv_group_own(g)) : 0);
  akv_put_max(g, (uint64_t)local);
}

/* The collective. A timeout or a communicator failure stops the group (the
 * collective already aborted the communicator, so no rank hangs). */
static akv_status akv_group_exchange(akv_group *g) {
  akv_status st;
  /* Invariant: no collective in a child on a group of its parent
   * (akv_group.h, fork). A callback that forks during a group call (the
   * engine's log callback while an agreement decides) returns twice, and
   * in the child the call went on into the parent's collective: the other
   * ranks are not there, and a rank thread of the parent may hold an
   * in-process world's mutex there for good. The call ends here. */
  if (akv_rec_forked(&g->fork_gen)) return AKV_ERR_BAD_HANDLE;
  /* Invariant: no collective on a stopped group (the other ranks stopped at
   * the same point and will not arrive). */
  if (g->stopped) return AKV_ERR_QUARANTINED;
  st = g->coll->ops->allreduce_min(g->coll, g->vec, g->vec_len, g->cfg.timeout_ms);
  g->seq++;
  if (st == AKV_OK) {
    g->agreements++;
    return AKV_OK;
  }
  if (st == AKV_ERR_TIMEOUT)
    return akv_group_stop(g, AKV_GROUP_TIMEOUT, UINT32_MAX, AKV_ERR_TIMEOUT, g->coll->error);
  return akv_group_stop(g, AKV_GROUP_COMM_FAILED, UINT32_MAX, AKV_ERR_COMM,
                        g->coll->error[0] ? g->coll->error : akv_status_string(st));
}

/* Reads the header of the reduced vector. Returns AKV_OK to go on (and the
 * agreed local status in *local), or the status every rank returns. The
 * order of the checks is the same on every rank, so every rank takes the
 * same branch. */
static akv_status akv_group_read_header(akv_group *g, akv_status *local) {
  uint64_t digest;
  int same_op, same_seq, same_digest;
  uint64_t failed;
  char why[160];
  g->at = 0;
  same_op = akv_get_same(g, NULL);
  same_seq = akv_get_same(g, NULL);
  failed = akv_get_min(g);
  same_digest = akv_get_same(g, &digest);
  *local = (akv_status)akv_get_max(g);
  if (!same_op || !same_seq)
    return akv_group_stop(g, AKV_GROUP_DIVERGED, UINT32_MAX, AKV_ERR_QUARANTINED,
                          "ranks met at different agreement points (a rank made a different "
                          "call)");
  /* Agreed failure: any rank's transport failure quarantines every rank at
   * the next agreement point. */
  if (failed != UINT64_MAX) {
    snprintf(why, sizeof(why), "rank %llu's transport failed", (unsigned long long)failed);
    return akv_group_stop(g, AKV_GROUP_PEER_FAILED, (uint32_t)failed, AKV_ERR_QUARANTINED, why);
  }
  /* A local refusal on any rank decides nothing at this point, so it is
   * returned before the digests are compared: the digest covers whether a
   * step is open, and akv_step_end is not an agreement point, so a rank
   * still in a step another rank ended differs in exactly the state its
   * local checks refuse (AKV_ERR_STEP_STATE, AKV_ERR_IN_USE). A real plan
   * mismatch persists and is caught at the next point without a refusal. */
  if (*local != AKV_OK) return AKV_OK;
  /* A digest mismatch quarantines every rank: it never hangs one. */
  if (g->check_digest && !same_digest)
    return akv_group_stop(g, AKV_GROUP_DIGEST_MISMATCH, UINT32_MAX, AKV_ERR_QUARANTINED,
                          "the ranks' plan digests differ");
  g->digest = digest;
  return AKV_OK;
}

/* The outcome of a decision taken locally from agreed inputs: every rank
 * must have reached the same status, the same `made` (what the decision
 * handed out: an opened context's id) and (when checked) the same
 * digest. */
static akv_status akv_group_outcome(akv_group *g, akv_status st, uint64_t made) {
  akv_status local, rc;
  akv_group_put_header(g, AKV_POINT_OUTCOME, AKV_OK);
  akv_put_same(g, (uint64_t)st);
  akv_put_same(g, made);
  if ((rc = akv_group_exchange(g)) != AKV_OK) return rc;
  if ((rc = akv_group_read_header(g, &local)) != AKV_OK) return rc;
  if (!akv_get_same(g, NULL) | !akv_get_same(g, NULL))
    return akv_group_stop(g, AKV_GROUP_DIVERGED, UINT32_MAX, AKV_ERR_QUARANTINED,
                          "the ranks decided differently from agreed inputs");
  if (st != AKV_OK)
    return akv_group_fail(g, st, "every rank: %s (%s)", akv_status_string(st),
                          akv_engine_last_error(akv_group_own(g)));
  return AKV_OK;
}

/* Called by the claimed agreement calls only: the claim checked the handle
 * (akv_group_claim). */
static akv_status akv_group_enter(akv_group *g) {
  akv_group_settle(g);
  if (g->stopped)
    return akv_group_fail(g, AKV_ERR_QUARANTINED, "the group stopped earlier; only info, "
                          "engine diagnostics and destroy remain");
  /* Invariant: one agreement at a time per rank. While the engine decides
   * (between an agreement's input and outcome collectives) its log callback
   * may call back; a nested agreement call there would enter a collective
   * of its own that the other ranks are not making (they are at the
   * outcome), so it is refused without a collective and without a log line
   * (the engine's callback is running: akv_log_fn). */
  if (g->deciding) {
    snprintf(g->last_error, sizeof(g->last_error),
             "an agreement call from the engine's log callback during an agreement of this "
             "group: refused, no collective");
    return AKV_ERR_IN_USE;
  }
  /* Invariant: a rank whose engine's log callback is running (an agreement
   * call from that callback outside any agreement of this group, e.g. on a
   * line of a direct engine call) refuses the point's decision as a local
   * state error, AKV_ERR_IN_USE through the header's local status: the
   * engine refuses every change from inside its callback (akv_log_fn), so
   * its decision would fail on this rank alone, the outcomes would differ
   * and every rank would stop. Refused in the agreement instead, every rank
   * returns AKV_ERR_IN_USE and nothing changes on any of them (checked by
   * each decision point with akv_engine_in_log). akv_group_check decides
   * nothing and goes on. */
  return AKV_OK;
}

/* The engine's decision inside an agreement (see akv_group_enter). */
static akv_status akv_group_decide_open(akv_group *g, const akv_context_config *cc,
                                        akv_context **c) {
  akv_status st;
  g->deciding = 1;
  st = akv_context_open(akv_group_own(g), cc, c); /* NULL: AKV_ERR_BAD_HANDLE */
  g->deciding = 0;
  return st;
}
static akv_status akv_group_decide_close(akv_group *g, akv_context *c) {
  akv_status st;
  g->deciding = 1;
  /* The context is the engine's (checked at entry) while the engine is. */
  st = akv_group_own(g) != NULL ? akv_context_close(c) : AKV_ERR_BAD_HANDLE;
  g->deciding = 0;
  return st;
}
static akv_status akv_group_decide_step(akv_group *g, akv_context *const *cs, uint32_t n) {
  akv_status st;
  g->deciding = 1;
  st = akv_step_begin(akv_group_own(g), cs, n); /* NULL: AKV_ERR_BAD_HANDLE */
  g->deciding = 0;
  return st;
}

/* ---------------------------------------------------------------- create */

static akv_status akv_group_create_body(const akv_engine_config *shard,
                                        const akv_group_config *config, akv_coll *coll,
                                        akv_group **out) {
  akv_group *g = NULL;
  akv_status local = AKV_OK, st, agreed_local;
  uint64_t v;
  int same = 1;
  /* Without a collective this rank cannot meet the others. */
  if (coll == NULL || coll->ops == NULL) return AKV_ERR_INVALID_ARGUMENT;
  if (coll->max_n < AKV_GROUP_FIXED_LEN) return AKV_ERR_INVALID_ARGUMENT;
  /* Invariant: every create status but a missing collective is every
   * rank's (akv_group.h). A NULL shard, config or out is this rank's
   * argument error like any other: it meets the others (defaults in place
   * of what is missing, rank and size the collective's) and every rank
   * returns AKV_ERR_INVALID_ARGUMENT, instead of the others waiting out
   * their timeout, which aborts the communicator for good. */
  const int args_ok = shard != NULL && config != NULL && out != NULL;
  /* The caller's structs are read only up to their struct_size: an older,
   * smaller engine config gives its fields and the rest keep their
   * defaults (akv.h, ABI); a group config smaller than this library's (it
   * has not grown since it was introduced) or an engine config below its
   * oldest layout is refused with AKV_ERR_CONFIG, after meeting the other
   * ranks with the defaults in their place. */
  akv_engine_config sh = AKV_ENGINE_CONFIG_INIT;
  akv_group_config gc = AKV_GROUP_CONFIG_INIT;
  const int merged =
      shard != NULL && akv_config_merge(&akv_engine_config_layout, &sh, shard, NULL, 0) == AKV_OK;
  const int sizes_ok = args_ok && merged && config->struct_size >= sizeof(akv_group_config);
  if (config != NULL && config->struct_size >= sizeof(akv_group_config)) gc = *config;
  if (shard == NULL) sh.log_level = AKV_LOG_ERROR; /* no caller's sink: no stderr warning */
  shard = &sh;
  config = &gc;
  akv_dist_fork_register();
  g = akv_rec_take(&akv_group_records);
  if (g == NULL) return AKV_ERR_OUT_OF_MEMORY;
  /* Zeroed between the magic and the claim words, which are the record's
   * (akv_group_claim_record). */
  akv_group_claim_record(g);
  memset((char *)g + offsetof(akv_group, engine), 0,
         offsetof(akv_group, owner) - offsetof(akv_group, engine));
  /* This process's group (akv_group_claim, akv_group_exchange). */
  akv_rec_fork_stamp(&g->fork_gen);
  g->vec = calloc(coll->max_n, sizeof(uint64_t));
  if (g->vec == NULL) {
    akv_group_release(g);
    akv_rec_untake(&akv_group_records, g);
    return AKV_ERR_OUT_OF_MEMORY;
  }
  g->coll = coll;
  g->failed_rank = UINT32_MAX;
  g->local = *shard;
  g->cfg = *config;
  g->vec_len = AKV_GROUP_FIXED_LEN;
  /* Local checks travel as the header's status: a rank that refuses its own
   * arguments still meets the others, so none of them waits for it. */
  if (!args_ok)
    local = AKV_ERR_INVALID_ARGUMENT;
  else if (!sizes_ok || config->version != AKV_CONFIG_VERSION ||
           shard->version != AKV_CONFIG_VERSION)
    local = AKV_ERR_CONFIG;
  else if (config->size != coll->size || config->rank != coll->rank || config->timeout_ms == 0)
    local = AKV_ERR_CONFIG;
  else if (config->size > AKV_GROUP_MAX_RANKS)
    /* Invariant: a group has at most AKV_GROUP_MAX_RANKS ranks, on every
     * transport (an in-process world is bounded at its create; an NCCL
     * communicator may be larger). The size is the collective's on every
     * rank, so every rank refuses alike, in the agreement; rank < size. */
    local = AKV_ERR_CONFIG;
  else if ((unsigned)config->digest > (unsigned)AKV_GROUP_DIGEST_ON)
    /* Enum fields are checked as the engine config's are (akv_fit): a value
     * outside akv_group_digest is refused, not read as one of them. */
    local = AKV_ERR_CONFIG;
  else if (shard->headroom_gib != 0)
    /* Headroom is profiled per device, so it differs between ranks; until a
     * headroom change is an agreement point (headroom pages the MIN over
     * ranks), a group refuses it rather than quarantine at the first step. */
    local = AKV_ERR_NOT_SUPPORTED;
  if (local != AKV_OK) {
    g->cfg.rank = coll->rank;
    g->cfg.size = coll->size;
    if (g->cfg.timeout_ms == 0) g->cfg.timeout_ms = 60000; /* the default: meet the others */
  }
  akv_group_put_header(g, AKV_POINT_CREATE, local);
  /* Geometry: identical on every rank (each holds an equal KV-head shard). */
  akv_put_same(g, shard->n_dense_layers);
  akv_put_same(g, shard->kv_heads);
  akv_put_same(g, shard->head_dim);
  akv_put_same(g, (uint64_t)shard->dtype);
  akv_put_same(g, shard->max_tokens);
  akv_put_same(g, shard->page_tokens);
  akv_put_same(g, (uint64_t)shard->route);
  akv_put_same(g, (uint64_t)shard->fit_mode);
  akv_put_same(g, coll->size);
  /* Pools and concurrency: the MIN over ranks, so host fit and the device
   * pool of every rank are the smallest rank's. */
  akv_put_min(g, shard->host_pool_gib);
  akv_put_min(g, shard->device_pool_gib);
  akv_put_min(g, shard->max_contexts);
#ifndef NDEBUG
  akv_put_max(g, 1); /* debug builds always compare digests */
#else
  akv_put_max(g, config->digest == AKV_GROUP_DIGEST_ON);
#endif
  if ((st = akv_group_exchange(g)) != AKV_OK) goto fail;
  if ((st = akv_group_read_header(g, &agreed_local)) != AKV_OK) goto fail;
  if (agreed_local != AKV_OK) {
    st = akv_group_fail(g, agreed_local, "create: a rank refused its arguments (%s)",
                        akv_status_string(agreed_local));
    goto fail;
  }
  for (int i = 0; i < 9; i++) same &= akv_get_same(g, NULL);
  if (!same) {
    st = akv_group_fail(g, AKV_ERR_DISAGREE,
                        "create: the ranks' shard geometry differs (layers, kv_heads, head_dim, "
                        "dtype, max_tokens, page_tokens, route, fit mode or group size)");
    goto fail;
  }
  g->agreed = *shard;
  g->agreed.host_pool_gib = (uint32_t)akv_get_min(g);
  g->agreed.device_pool_gib = (uint32_t)akv_get_min(g);
  g->agreed.max_contexts = (uint32_t)akv_get_min(g);
  g->check_digest = akv_get_max(g) != 0;
  akv_group_log(g, shard, AKV_LOG_INFO,
                "agreed over %u ranks: host_pool_gib = %u (here %u), device_pool_gib = %u (here "
                "%u), max_contexts = %u (here %u), digests %s",
                g->cfg.size, g->agreed.host_pool_gib, shard->host_pool_gib,
                g->agreed.device_pool_gib, shard->device_pool_gib, g->agreed.max_contexts,
                shard->max_contexts, g->check_digest ? "compared" : "not compared");
  st = akv_engine_create(&g->agreed, &g->engine);
  if (st != AKV_OK) g->engine = NULL;
  g->engine_serial = akv_engine_serial(g->engine); /* the engine's name from now on */
  /* The outcome: every rank created its engine, with the same concurrency. */
  {
    akv_engine_info info;
    memset(&info, 0, sizeof(info));
    if (akv_group_own(g) != NULL) akv_engine_info_get(g->engine, &info);
    akv_group_put_header(g, AKV_POINT_OUTCOME, st);
    akv_put_same(g, info.effective_concurrency);
    akv_put_same(g, info.device_pages);
    if ((st = akv_group_exchange(g)) != AKV_OK) goto fail;
    if ((st = akv_group_read_header(g, &agreed_local)) != AKV_OK) goto fail;
    if (agreed_local != AKV_OK) {
      st = akv_group_fail(g, agreed_local, "create: a rank's engine create failed (%s)",
                          akv_status_string(agreed_local));
      goto fail;
    }
    same = akv_get_same(g, &v);
    same &= akv_get_same(g, NULL);
    if (!same) {
      st = akv_group_fail(g, AKV_ERR_DISAGREE,
                          "create: the ranks' engines differ in concurrency or device pages");
      goto fail;
    }
    g->concurrency = (uint32_t)v;
  }
  g->vec_len = akv_group_vector_len(g->concurrency);
  /* Every rank computes the same length from the agreed concurrency; each
   * collective was sized for its own max_contexts >= the agreed one. */
  if (g->vec_len > coll->max_n) {
    st = akv_group_fail(g, AKV_ERR_CONFIG, "create: the collective takes %zu values, %zu needed",
                        coll->max_n, g->vec_len);
    goto fail;
  }
  __atomic_store_n(&g->magic, AKV_MAGIC_GROUP, __ATOMIC_RELAXED);
  __atomic_store_n(&g->magic_end, AKV_MAGIC_GROUP, __ATOMIC_RELAXED);
  akv_group_release(g); /* publishes the group to the next claim */
  *out = g;
  return AKV_OK;
fail:
  /* Nothing of the group survives a failed create; the caller keeps coll. */
  if (akv_group_own(g) != NULL) {
    if (akv_engine_destroy(g->engine) != AKV_OK) {
      akv_engine_quarantine(g->engine, NULL);
      akv_engine_destroy(g->engine);
    }
  }
  free(g->vec);
  akv_group_poison(g);
  akv_group_release(g);
  akv_rec_untake(&akv_group_records, g);
  return st;
}

/* A create is not a cancellation point either (see akv_group_claim): it
 * waits at two agreement points. */
akv_status akv_group_create_with(const akv_engine_config *shard, const akv_group_config *config,
                                 akv_coll *coll, akv_group **out) {
  int cancel;
  akv_status st;
  pthread_setcancelstate(PTHREAD_CANCEL_DISABLE, &cancel);
  st = akv_group_create_body(shard, config, coll, out);
  pthread_setcancelstate(cancel, NULL);
  return st;
}

/* ---------------------------------------------------------------- points */

static akv_status akv_group_context_open_claimed(akv_group *g, const akv_context_config *config,
                                                  akv_context **out) {
  akv_context_config cc = AKV_CONTEXT_CONFIG_INIT;
  akv_context *c = NULL;
  uint32_t id = 0;
  akv_status st = akv_group_enter(g), local = AKV_OK, agreed_local;
  if (st != AKV_OK) return st;
  if (out == NULL)
    local = AKV_ERR_INVALID_ARGUMENT;
  /* An older, smaller struct gives its fields, the rest keep
   * AKV_CONTEXT_CONFIG_INIT's (as akv_context_open); nothing is read past
   * its struct_size. */
  else if (config != NULL &&
           (akv_config_merge(&akv_context_config_layout, &cc, config, NULL, 0) != AKV_OK ||
            cc.version == 0 || cc.version > AKV_CONFIG_VERSION))
    local = AKV_ERR_CONFIG;
  else if (akv_engine_in_log(akv_group_own(g)))
    local = AKV_ERR_IN_USE; /* see akv_group_enter */
  else if (akv_engine_step_open(akv_group_own(g)))
    local = AKV_ERR_STEP_STATE;
  akv_group_put_header(g, AKV_POINT_OPEN, local);
  /* Target and burst: the MIN over ranks (AKV_TARGET_FAIR_SHARE is the
   * largest value, so an explicit target on any rank wins). */
  akv_put_min(g, cc.target_pages);
  akv_put_min(g, cc.burst_pages);
  if ((st = akv_group_exchange(g)) != AKV_OK) return st;
  if ((st = akv_group_read_header(g, &agreed_local)) != AKV_OK) return st;
  if (agreed_local != AKV_OK)
    return akv_group_fail(g, agreed_local, "context_open: refused on every rank (%s)",
                          akv_status_string(agreed_local));
  cc.target_pages = (uint32_t)akv_get_min(g);
  cc.burst_pages = (uint32_t)akv_get_min(g);
  st = akv_group_decide_open(g, &cc, &c);
  /* Invariant: an opened context has the same id on every rank
   * (akv_group_context_open), or every rank stops here. The engine numbers
   * its contexts itself, so a context opened on one rank's engine directly
   * shifts that rank's ids; without digest checking nothing else would
   * tell, and a later close or step would name different contexts. */
  if (st == AKV_OK) akv_context_id(c, &id);
  if ((st = akv_group_outcome(g, st, id)) != AKV_OK) return st;
  *out = c;
  return AKV_OK;
}

static akv_status akv_group_context_close_claimed(akv_group *g, akv_context *context) {
  uint32_t id = 0;
  akv_status st = akv_group_enter(g), local = AKV_OK, agreed_local;
  akv_engine *e;
  if (st != AKV_OK) return st;
  e = akv_group_own(g); /* NULL (engine destroyed directly): owns nothing */
  if (!akv_engine_owns_context(e, context) || akv_context_id(context, &id) != AKV_OK)
    local = AKV_ERR_BAD_HANDLE;
  else if (akv_engine_in_log(e))
    local = AKV_ERR_IN_USE; /* see akv_group_enter */
  else if (akv_engine_context_in_use(e, context))
    /* This rank's state (step_end is not an agreement point): refused on
     * every rank before any of them closes, so the outcomes never differ
     * over it. */
    local = AKV_ERR_IN_USE;
  akv_group_put_header(g, AKV_POINT_CLOSE, local);
  akv_put_same(g, id);
  if ((st = akv_group_exchange(g)) != AKV_OK) return st;
  if ((st = akv_group_read_header(g, &agreed_local)) != AKV_OK) return st;
  if (agreed_local != AKV_OK)
    return akv_group_fail(g, agreed_local, "context_close: refused on every rank (%s)",
                          akv_status_string(agreed_local));
  if (!akv_get_same(g, NULL))
    return akv_group_fail(g, AKV_ERR_DISAGREE,
                          "context_close: the ranks named different contexts; nothing changed");
  return akv_group_outcome(g, akv_group_decide_close(g, context), 0);
}

static akv_status akv_group_step_begin_claimed(akv_group *g, akv_context *const *contexts, uint32_t n) {
  akv_status st = akv_group_enter(g), local = AKV_OK, agreed_local;
  akv_engine *e;
  int same = 1;
  if (st != AKV_OK) return st;
  e = akv_group_own(g); /* NULL (engine destroyed directly): owns nothing */
  if (contexts == NULL || n == 0 || n > g->concurrency) {
    local = AKV_ERR_INVALID_ARGUMENT;
  } else {
    for (uint32_t i = 0; i < n && local == AKV_OK; i++)
      if (!akv_engine_owns_context(e, contexts[i])) local = AKV_ERR_BAD_HANDLE;
    /* Uneven layers are this rank's state (the agreed length is the minimum
     * over layers): refused on every rank before any of them begins, so the
     * outcomes never differ over it. */
    for (uint32_t i = 0; i < n && local == AKV_OK; i++)
      if (akv_engine_context_uneven(e, contexts[i])) local = AKV_ERR_UNEVEN_LAYERS;
    if (local == AKV_OK && akv_engine_in_log(e)) local = AKV_ERR_IN_USE; /* see akv_group_enter */
    if (local == AKV_OK && akv_engine_step_open(e)) local = AKV_ERR_STEP_STATE;
  }
  akv_group_put_header(g, AKV_POINT_STEP, local);
  /* The step's contexts and lengths: the same on every rank, in order. The
   * slots past n (and all of them after a local refusal) hold 0 on every
   * rank, so they agree. */
  akv_put_same(g, local == AKV_OK ? n : 0);
  for (uint32_t i = 0; i < g->concurrency; i++) {
    uint32_t id = 0, len = 0;
    if (local == AKV_OK && i < n) {
      akv_context_id(contexts[i], &id);
      akv_context_length(contexts[i], &len);
      akv_put_same(g, id);
      akv_put_same(g, len);
    } else {
      akv_put_same(g, 0);
      akv_put_same(g, 0);
    }
  }
  if ((st = akv_group_exchange(g)) != AKV_OK) return st;
  if ((st = akv_group_read_header(g, &agreed_local)) != AKV_OK) return st;
  if (agreed_local != AKV_OK)
    return akv_group_fail(g, agreed_local, "step_begin: refused on every rank (%s)",
                          akv_status_string(agreed_local));
  for (uint32_t i = 0; i < 1 + 2 * g->concurrency; i++) same &= akv_get_same(g, NULL);
  if (!same)
    return akv_group_fail(g, AKV_ERR_DISAGREE,
                          "step_begin: the ranks step different contexts or lengths; nothing "
                          "changed");
  return akv_group_outcome(g, akv_group_decide_step(g, contexts, n), 0);
}

static akv_status akv_group_check_claimed(akv_group *g) {
  akv_status st = akv_group_enter(g), local;
  if (st != AKV_OK) return st;
  akv_group_put_header(g, AKV_POINT_CHECK, AKV_OK);
  if ((st = akv_group_exchange(g)) != AKV_OK) return st;
  return akv_group_read_header(g, &local);
}

/* ---------------------------------------------------------------- others */

static akv_status akv_group_engine_claimed(const akv_group *g, akv_engine **out) {
  if (out == NULL)
    return akv_group_fail((akv_group *)g, AKV_ERR_INVALID_ARGUMENT, "engine: out is NULL");
  /* NULL once the engine was destroyed directly: the handle may name a
   * newer engine, never the group's. */
  *out = akv_group_own(g);
  return AKV_OK;
}

static akv_status akv_group_info_get_claimed(const akv_group *g, akv_group_info *out) {
  uint64_t digest = g->digest;
  if (out == NULL)
    return akv_group_fail((akv_group *)g, AKV_ERR_INVALID_ARGUMENT, "info_get: out is NULL");
  if (!g->check_digest) {
    /* Invariant (akv_group.h, akv_group_info_get): without digest checks
     * the digest is the engine's now, read under the engine's claim; with
     * another thread inside the engine the call is refused with *out
     * untouched (it gave 0, a digest no plan has, with AKV_OK). 0 only
     * once the caller destroyed the engine itself. */
    akv_engine *e = akv_group_own(g);
    digest = 0;
    if (e != NULL) {
      const akv_status st = akv_engine_claim(e);
      if (st == AKV_ERR_IN_USE)
        return akv_group_fail((akv_group *)g, st,
                              "info_get: this rank's engine is in use by another thread");
      if (st == AKV_OK) {
        /* Invariant (akv_group_own): the serial is checked again once
         * claimed. Checked before only, the engine could be destroyed
         * directly by another thread in between and its record handed to
         * a newer engine, whose digest this read under its claim. */
        if (akv_engine_serial(e) == g->engine_serial)
          digest = akv_engine_plan_digest(e); /* nested: this thread holds it */
        akv_engine_release(e);
      }
    }
  }
  memset(out, 0, sizeof(*out));
  out->rank = g->cfg.rank;
  out->size = g->cfg.size;
  out->agreements = g->agreements;
  out->digest = digest;
  out->digest_checked = g->check_digest;
  out->stopped = g->stopped;
  out->reason = g->reason;
  out->failed_rank = g->failed_rank;
  out->host_pool_gib = g->agreed.host_pool_gib;
  out->device_pool_gib = g->agreed.device_pool_gib;
  out->max_contexts = g->agreed.max_contexts;
  out->local_host_pool_gib = g->local.host_pool_gib;
  out->local_device_pool_gib = g->local.device_pool_gib;
  out->local_max_contexts = g->local.max_contexts;
  return AKV_OK;
}

AKV_API const char *akv_group_last_error(const akv_group *g) {
  const char *msg;
  akv_status st = akv_group_claim(g);
  if (st == AKV_ERR_IN_USE) return "group in use by another thread";
  if (st != AKV_OK) return "bad group handle";
  msg = g->last_error;
  akv_group_release(g);
  return msg;
}

AKV_API akv_status akv_group_destroy(akv_group *g) {
  akv_status st = akv_group_claim(g);
  if (st != AKV_OK) return st;
  /* From a log callback during a call on this group (the engine's while an
   * agreement decides, or the group's own): the call still uses the vector
   * and the collective (see akv_group_enter). */
  if (g->depth > 1 || g->deciding) {
    akv_group_release(g);
    return AKV_ERR_IN_USE;
  }
  /* No akv_group_settle here: a quarantine waits on the engine's queues,
   * and destroy never waits. An owed one leaves an engine whose transport
   * failed busy (akv_group.h says what to do). */
  /* The engine's destroy never waits; with live work it frees nothing and
   * neither does the group. An engine the caller already destroyed (it is
   * the group's, but akv_group_engine hands it out) is not destroyed again,
   * nor is a newer engine its handle may name now (akv_group_own): the
   * rest of the group is freed all the same, so its rank and collective are
   * given back. */
  /* Invariant (akv_group_own): the engine destroyed is the engine checked.
   * It is held (its claim, akv_group_hold_engine) before the serial check
   * that decides, so no other thread can destroy it in between and have
   * its record handed to a newer engine, which this destroyed in its
   * stead. The destroy below nests in that claim; the record goes back to
   * its pool at the release. */
  {
    akv_engine *held = NULL;
    if (akv_group_hold_engine(g, &held) != AKV_OK) {
      st = akv_group_fail(g, AKV_ERR_IN_USE,
                          "destroy: this rank's engine is in use by another thread; nothing "
                          "freed");
      akv_group_release(g);
      return st;
    }
    if (held != NULL) {
      st = akv_engine_destroy(held);
      akv_engine_release(held);
      if (st != AKV_OK) {
        st = akv_group_fail(g, st, "destroy: the engine is busy; nothing freed");
        akv_group_release(g);
        return st;
      }
    }
  }
  g->coll->ops->destroy(g->coll);
  free(g->vec);
  g->vec = NULL;
  g->engine = NULL;
  g->coll = NULL;
  akv_group_poison(g);
  /* Poisoned before it is released: a thread that claims it next sees a
   * dead group (akv_group_claim). */
  akv_group_release(g);
  akv_rec_give(&akv_group_records, g);
  return AKV_OK;
}

AKV_API akv_status akv_group_context_open(akv_group *g, const akv_context_config *config,
                                          akv_context **out) {
  akv_engine *held;
  akv_status st = akv_group_call_begin(g, &held);
  if (st != AKV_OK) return st;
  st = akv_group_context_open_claimed(g, config, out);
  akv_group_call_end(g, held);
  return st;
}

AKV_API akv_status akv_group_context_close(akv_group *g, akv_context *context) {
  akv_engine *held;
  akv_status st = akv_group_call_begin(g, &held);
  if (st != AKV_OK) return st;
  st = akv_group_context_close_claimed(g, context);
  akv_group_call_end(g, held);
  return st;
}

AKV_API akv_status akv_group_step_begin(akv_group *g, akv_context *const *contexts, uint32_t n) {
  akv_engine *held;
  akv_status st = akv_group_call_begin(g, &held);
  if (st != AKV_OK) return st;
  st = akv_group_step_begin_claimed(g, contexts, n);
  akv_group_call_end(g, held);
  return st;
}

AKV_API akv_status akv_group_check(akv_group *g) {
  akv_engine *held;
  akv_status st = akv_group_call_begin(g, &held);
  if (st != AKV_OK) return st;
  st = akv_group_check_claimed(g);
  akv_group_call_end(g, held);
  return st;
}

AKV_API akv_status akv_group_engine(const akv_group *g, akv_engine **out) {
  akv_status st = akv_group_claim(g);
  if (st != AKV_OK) return st;
  st = akv_group_engine_claimed(g, out);
  akv_group_release(g);
  return st;
}

AKV_API akv_status akv_group_info_get(const akv_group *g, akv_group_info *out) {
  akv_status st = akv_group_claim(g);
  if (st != AKV_OK) return st;
  st = akv_group_info_get_claimed(g, out);
  akv_group_release(g);
  return st;
}
