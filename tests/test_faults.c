/*
 * test_faults.c - exhaustive fault injection (DESIGN §7, §9).
 *
 * A multi-layer, multi-context decode (akvt_run) is first run clean to count
 * its fallible backend operations: N over every kind (engine creation's
 * allocations, queue and event creation included), and N_k per kind. Then
 * every one of them is failed in turn, once per run: fault_fail_nth = 1..N
 * with fault_kind -1, and 1..N_k with fault_kind = k, on the stage route
 * (hook form) and on the arena route (two-call form, tight targets so pages
 * are filled and reused while decoding).
 *
 * Every run must
 *  - return a failure: engine creation its own status (out of memory or
 *    backend) with nothing leaked (no worker thread left, no pool mapping
 *    left), or a later call AKV_ERR_BACKEND;
 *  - quarantine successfully, releasing exactly the leases and tickets that
 *    were live at the failure;
 *  - keep every host row that was authoritative before the failing step:
 *    same length, same bytes (rows_checked == rows_expected, no mismatch);
 *  - never let a host slot's generation move under a live ticket (checked
 *    on every live ticket at the failure, and by the library's own
 *    "invariant violated" log line, which must never appear).
 *
 * Then, for every failure point, each of quarantine's four synchronise calls
 * (H2D queue, D2H queue, D2D queue, device) is failed as well: quarantine
 * must report AKV_ERR_UNCERTAIN_FENCE naming that fence, every lease, ticket
 * and host page lease must stay exactly as it was, and destroy must refuse
 * with AKV_ERR_BUSY, freeing nothing. How that retained memory is accounted
 * for: the injected fault is one-shot and the host backend's queues really
 * are drained, so the test quarantines a second time through the public API;
 * that drain establishes completion, releases everything and destroy then
 * frees it. Nothing is leaked on purpose and no sanitizer suppression is
 * needed; the retained state is asserted before it is released.
 *
 * Event queries (akv_lease_try_retire) are failed in turn on the stage
 * workload retired without blocking; their count depends on timing, so only
 * the queries every such run issues are failed (sweep_queries).
 *
 * AKVT_FAULT_STRIDE=k fails only every k-th operation (default 1: all of
 * them), for slow builds such as valgrind.
 */
#if !defined(_GNU_SOURCE) && !defined(_DEFAULT_SOURCE)
#define _DEFAULT_SOURCE
#endif
#include <dirent.h>
#include <unistd.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "internal.h"
#include "testutil.h"

/* ------------------------------------------------------------------ leaks */

/* Threads of this process (the host backend runs one per queue). */
static uint32_t threads_now(void) {
  uint32_t n = 0;
  DIR *d = opendir("/proc/self/task");
  struct dirent *de;
  if (d == NULL) return 0;
  while ((de = readdir(d)) != NULL)
    if (de->d_name[0] != '.') n++;
  closedir(d);
  return n;
}

/* Virtual size of this process in MiB: a leaked 1 GiB pool mapping shows. */
static uint64_t vm_mib(void) {
  unsigned long long pages = 0;
  FILE *f = fopen("/proc/self/statm", "r");
  if (f == NULL) return 0;
  if (fscanf(f, "%llu", &pages) != 1) pages = 0;
  fclose(f);
  return (uint64_t)pages * 4096u >> 20;
}

/* ------------------------------------------------------- what a run saw */

typedef struct obs {
  int arm_sync;            /* 1..4: fail quarantine's n-th synchronise; 0: none */
  int called;              /* before_quarantine ran */
  uint64_t injected;       /* faults the dispatcher injected before quarantine */
  uint32_t live_leases;    /* at the failure */
  uint32_t live_tickets;   /* every ticket of a live lease (D2D included) */
  uint32_t host_tickets;   /* of which hold a host page lease (H2D, D2H) */
  uint32_t fill_leases;    /* page fills holding host page leases */
  uint32_t gen_moved;      /* tickets whose slot generation moved */
  uint32_t unaccounted;    /* host page leases not matched by tickets and fills */
  uint32_t lease_state[64];
  int step_open;
  /* after an uncertain quarantine */
  int retained_checked;
  uint32_t retained_mismatch; /* anything released or changed */
  uint64_t invariant_lines;   /* "invariant violated" log lines */
} obs;

static void count_log(void *user, akv_log_level level, const char *message) {
  obs *o = user;
  if (strstr(message, "invariant violated") != NULL) o->invariant_lines++;
  akvt_silent_log(NULL, level, message);
}

/* Walks every live lease and its tickets, every fill lease and every slot's
 * host page leases: they must account for each other, and no ticket may see
 * its slot at another generation. */
static void snapshot(const akv_engine *e, obs *o) {
  uint32_t host_leases = 0;
  o->live_leases = o->live_tickets = o->host_tickets = o->fill_leases = o->unaccounted = 0;
  for (uint32_t l = 0; l < e->cfg.n_dense_layers; l++) {
    const akv_lease_body *ls = &e->leases[l];
    o->lease_state[l] = ls->state;
    if (ls->state == AKV_LEASE_IDLE || ls->state == AKV_LEASE_RETIRED) continue;
    o->live_leases++;
    for (uint32_t t = 0; t < ls->n_tickets; t++) {
      const akv_ticket *tk = &ls->tickets[t];
      o->live_tickets++;
      if (tk->dir == AKV_COPY_D2D) continue;
      o->host_tickets++;
      if (e->slot_owner[tk->slot] == NULL || e->slot_owner[tk->slot]->generation != tk->generation)
        o->gen_moved++;
    }
  }
  for (uint32_t i = 0; i < e->concurrency; i++) {
    if (e->slot_owner[i] == NULL) continue;
    o->fill_leases += e->slot_owner[i]->fill_leases;
    host_leases += e->slot_owner[i]->host_leases;
  }
  o->step_open = e->step_open;
  /* host page leases are exactly the tickets and fills that hold them */
  if (host_leases != o->host_tickets + o->fill_leases)
    o->unaccounted++;
}

static void before_q(akv_engine *e, void *user) {
  obs *o = user;
  o->called = 1;
  o->injected = e->bk.injected;
  snapshot(e, o);
  if (o->arm_sync > 0) {
    /* The next synchronise calls are quarantine's: H2D, D2H, D2D, device. */
    e->bk.fail_kind = AKV_OP_SYNC;
    e->bk.fail_nth = (uint32_t)(e->bk.counted + (uint64_t)o->arm_sync);
  }
}

static void after_q(akv_engine *e, akv_status st, const akv_quarantine_report *r, void *user) {
  obs *o = user;
  obs now;
  if (st != AKV_ERR_UNCERTAIN_FENCE) return;
  /* Nothing is recycled on an uncertain fence: same leases in the same
   * states, same tickets, same host page leases. */
  memset(&now, 0, sizeof(now));
  snapshot(e, &now);
  o->retained_checked = 1;
  if (now.live_leases != o->live_leases || now.live_tickets != o->live_tickets ||
      now.host_tickets != o->host_tickets || now.fill_leases != o->fill_leases ||
      now.step_open != o->step_open || now.gen_moved != 0 ||
      now.unaccounted != 0 ||
      memcmp(now.lease_state, o->lease_state, sizeof(now.lease_state)) != 0 ||
      r->retained_leases != o->live_leases || r->leases_released != 0 || r->tickets_released != 0)
    o->retained_mismatch++;
  /* contexts held by tickets cannot be closed; those of the step stay
   * unreadable (a write-back may still run), the others are readable (a
   * page fill of a boundary that failed only reads their rows: akv.h,
   * akv_context_read) */
  for (uint32_t i = 0; i < e->concurrency; i++) {
    akv_context *c = e->slot_owner[i];
    uint8_t buf[64];
    if (c == NULL || !c->open) continue;
    if (akv_context_close(c) != AKV_ERR_QUARANTINED) o->retained_mismatch++;
    if (akv_context_read(c, 0, 0, 0, buf, buf) != (c->in_step ? AKV_ERR_IN_USE : AKV_OK))
      o->retained_mismatch++;
  }
}

/* ---------------------------------------------------------------- sweeps */

typedef struct totals {
  uint64_t failed_ops;      /* runs with one injected backend fault */
  uint64_t failed_quarantine_syncs;
  uint64_t create_failures;
  uint64_t step_failures;
  uint64_t rows_checked;
} totals;

static uint32_t g_threads0;
static uint64_t g_vm0;

static uint64_t total_ops(const akv_engine_info *info) {
  uint64_t n = 0;
  for (int k = 0; k < AKV_OP_KIND_COUNT; k++) n += info->backend_ops[k];
  return n;
}

/* The thread count once the threads just joined have left /proc: a joined
 * thread can stay listed for a moment, so the count is sampled every 1 ms
 * until 50 samples in a row show no fewer (2 s at most). */
static uint32_t threads_settled(void) {
  uint32_t best = threads_now();
  for (int same = 0, i = 0; same < 50 && i < 2000; i++) {
    usleep(1000);
    const uint32_t n = threads_now();
    if (n < best) {
      best = n;
      same = 0;
    } else {
      same++;
    }
  }
  return best;
}

static void check_no_leak(const char *what) {
  uint32_t th = threads_now();
  /* a joined thread can stay listed in /proc for a moment after the join */
  for (int i = 0; i < 2000 && th > g_threads0; i++) {
    usleep(1000);
    th = threads_now();
  }
  uint64_t vm = vm_mib();
  /* Fewer threads than the baseline is no leak (a thread of the process
   * outside the engines ended): the baseline follows it down, so a queue
   * thread leaked later still shows as one more. */
  if (th < g_threads0) g_threads0 = th;
  if (th != g_threads0) fail_msg("%s: %u threads alive, %u before (a queue leaked)", what, th, g_threads0);
  /* a leaked host pool is 1 GiB of mapping */
  if (vm > g_vm0 + 768) fail_msg("%s: virtual size grew from %llu to %llu MiB (a pool leaked)", what,
                                 (unsigned long long)g_vm0, (unsigned long long)vm);
}

static void run_one(const akvt_cfg *base, uint32_t nth, int32_t kind, int arm_sync, totals *t,
                    const char *cfg_name) {
  akvt_cfg c = *base;
  akvt_result r;
  obs o;
  char what[160];
  memset(&o, 0, sizeof(o));
  o.arm_sync = arm_sync;
  c.fault_fail_nth = nth;
  c.fault_kind = kind;
  c.log_fn = count_log;
  c.log_user = &o;
  c.before_quarantine = before_q;
  c.after_quarantine = after_q;
  c.user = &o;
  c.retry_uncertain = 1;
  if (arm_sync > 0)
    snprintf(what, sizeof(what), "%s: fail op %u of kind %d, then quarantine's synchronise %d",
             cfg_name, nth, kind, arm_sync);
  else
    snprintf(what, sizeof(what), "%s: fail op %u of kind %d", cfg_name, nth, kind);
  akvt_run(&c, &r);

  if (r.status == AKV_OK) fail_msg("%s: the injected fault did not surface (run returned OK)", what);
  if (r.failed_call != NULL && strcmp(r.failed_call, "akv_engine_create") == 0) {
    /* creation fails with its own status and leaves nothing behind */
    if (r.status != AKV_ERR_OUT_OF_MEMORY && r.status != AKV_ERR_BACKEND)
      fail_msg("%s: engine create returned %s", what, akv_status_string(r.status));
    assert_false(r.quarantined);
    check_no_leak(what);
    if (arm_sync == 0) {
      t->failed_ops++;
      t->create_failures++;
    }
    return;
  }
  if (r.status != AKV_ERR_BACKEND)
    fail_msg("%s: %s returned %s, not AKV_ERR_BACKEND", what, r.failed_call,
             akv_status_string(r.status));
  assert_true(r.quarantined);
  assert_true(o.called);
  if (o.injected != 1) fail_msg("%s: %llu faults injected before quarantine", what, (unsigned long long)o.injected);
  if (o.gen_moved != 0) fail_msg("%s: %u tickets saw their slot's generation move", what, o.gen_moved);
  if (o.unaccounted != 0)
    fail_msg("%s: host page leases do not match the live tickets and fills", what);
  if (arm_sync == 0) {
    if (r.quarantine_status != AKV_OK)
      fail_msg("%s: quarantine returned %s (%s)", what, akv_status_string(r.quarantine_status),
               r.quarantine.uncertain);
    assert_true(r.quarantine.h2d_ok && r.quarantine.d2h_ok && r.quarantine.d2d_ok &&
                r.quarantine.device_ok);
    assert_int_equal(r.quarantine.leases_released, o.live_leases);
    assert_int_equal(r.quarantine.tickets_released, o.live_tickets);
    assert_int_equal(r.quarantine.retained_leases, 0);
    assert_false(r.requarantined);
    t->failed_ops++;
    t->step_failures++;
  } else {
    const int ok[4] = {r.quarantine.h2d_ok, r.quarantine.d2h_ok, r.quarantine.d2d_ok,
                       r.quarantine.device_ok};
    static const char *const names[4] = {"h2d-queue", "d2h-queue", "d2d-queue", "device"};
    if (r.quarantine_status != AKV_ERR_UNCERTAIN_FENCE)
      fail_msg("%s: quarantine returned %s, not AKV_ERR_UNCERTAIN_FENCE", what,
               akv_status_string(r.quarantine_status));
    for (int j = 0; j < 4; j++) assert_int_equal(ok[j], j != arm_sync - 1);
    if (strstr(r.quarantine.uncertain, names[arm_sync - 1]) == NULL)
      fail_msg("%s: report names '%s'", what, r.quarantine.uncertain);
    assert_true(o.retained_checked);
    if (o.retained_mismatch != 0) fail_msg("%s: something was released or changed on an uncertain fence", what);
    if (r.destroy_uncertain != AKV_ERR_BUSY)
      fail_msg("%s: destroy after an uncertain quarantine returned %s", what,
               akv_status_string(r.destroy_uncertain));
    /* the second drain proves completion and releases what was retained */
    assert_true(r.requarantined);
    assert_int_equal(r.requarantine_status, AKV_OK);
    assert_int_equal(r.requarantine.leases_released, o.live_leases);
    assert_int_equal(r.requarantine.tickets_released, o.live_tickets);
    t->failed_quarantine_syncs++;
  }
  if (o.invariant_lines != 0) fail_msg("%s: the library logged an invariant violation", what);
  if (r.outputs_mismatched != 0) fail_msg("%s: %llu outputs of completed steps differ", what, (unsigned long long)r.outputs_mismatched);
  if (r.rows_mismatched != 0)
    fail_msg("%s: %llu host rows lost or changed (failing step %u)", what,
             (unsigned long long)r.rows_mismatched, r.failed_step);
  if (r.rows_checked != r.rows_expected)
    fail_msg("%s: %llu rows checked, %llu authoritative", what, (unsigned long long)r.rows_checked,
             (unsigned long long)r.rows_expected);
  if (!r.destroyed) fail_msg("%s: destroy after quarantine failed", what);
  check_no_leak(what);
  t->rows_checked += r.rows_checked;
}

static uint32_t stride(void) {
  const char *s = getenv("AKVT_FAULT_STRIDE");
  int v = s != NULL ? atoi(s) : 1;
  return v > 0 ? (uint32_t)v : 1;
}

static akvt_cfg cfg_stage(void) {
  akvt_cfg c = akvt_default_cfg();
  c.steps = 3;
  return c;
}

static akvt_cfg cfg_arena(void) {
  akvt_cfg c = akvt_default_cfg();
  c.steps = 3;
  c.route = AKV_ROUTE_ARENA;
  c.device_pool_gib = 1;
  c.two_call = 1;
  /* pages fill up while decoding and the windows move: fills, own reuse */
  c.prefill[0] = 7;
  c.prefill[1] = 23;
  c.prefill[2] = 39;
  c.target_pages = 2;
  c.burst_pages = 1;
  return c;
}

/* The arena workload on the paged route, hook form: adds the page map's
 * copy at every step boundary to the operations that fail in turn. */
static akvt_cfg cfg_paged(void) {
  akvt_cfg c = cfg_arena();
  c.route = AKV_ROUTE_PAGED;
  c.two_call = 0;
  return c;
}

/* The stage workload retired with akv_lease_try_retire: event queries are
 * counted operations here. Their number depends on timing (a query answered
 * "not yet" is polled again), so this workload is not in the sweeps over
 * every operation; it fails each of the queries every run is sure to issue
 * (one per lease: the query of the try that retires it), through
 * sweep_queries. */
static akvt_cfg cfg_try_retire(void) {
  akvt_cfg c = cfg_stage();
  c.try_retire = 1;
  return c;
}

static void clean_run(const akvt_cfg *c, akvt_result *r, const char *name) {
  akvt_run(c, r);
  if (r->status != AKV_OK) fail_msg("%s: clean run: %s returned %s", name, r->failed_call, akv_status_string(r->status));
  assert_int_equal(r->outputs_mismatched, 0);
  assert_int_equal(r->rows_mismatched, 0);
  assert_int_equal(r->rows_checked, r->rows_expected);
  assert_true(r->destroyed);
}

static void sweep(const akvt_cfg *c, const char *name, totals *t) {
  akvt_result clean;
  uint64_t n_all;
  uint32_t k_stride = stride();
  totals before = *t;
  clean_run(c, &clean, name);
  if (g_threads0 == 0) {
    g_threads0 = threads_settled(); /* the clean run's queue threads were just joined */
    g_vm0 = vm_mib();
  }
  n_all = total_ops(&clean.info);
  assert_true(n_all > 0);
  /* the arena route must really exercise fills and device-to-device copies */
  if (c->route == AKV_ROUTE_ARENA) {
    assert_true(clean.info.bytes_d2d > 0);
    assert_true(clean.adm_counters[AKV_ADM_OWN_REUSE] > 0);
  }
  if (c->route == AKV_ROUTE_PAGED) {
    assert_int_equal(clean.info.bytes_d2d, 0);
    assert_true(clean.adm_counters[AKV_ADM_OWN_REUSE] > 0);
  }
  /* every operation, counted over all kinds */
  for (uint32_t n = 1; n <= n_all; n += k_stride) run_one(c, n, -1, 0, t, name);
  /* every operation, counted per kind */
  for (int k = 0; k < AKV_OP_KIND_COUNT; k++)
    for (uint32_t n = 1; n <= clean.info.backend_ops[k]; n += k_stride) run_one(c, n, k, 0, t, name);
  /* every failure point, then each of quarantine's own synchronise calls */
  for (uint32_t n = 1; n <= n_all; n += k_stride)
    for (int j = 1; j <= 4; j++) run_one(c, n, -1, j, t, name);
  /* one past the last operation: nothing fails, the run is clean */
  {
    akvt_cfg past = *c;
    akvt_result r;
    past.fault_fail_nth = (uint32_t)n_all + 1;
    akvt_run(&past, &r);
    assert_int_equal(r.status, AKV_OK);
    assert_true(r.destroyed);
  }
  printf("faults %s: %llu ops per clean run (alloc %llu, copy %llu, record %llu, wait %llu, "
         "query %llu, sync %llu, hostfn %llu); failed %llu ops in turn (%llu at create, %llu "
         "later) and %llu quarantine synchronise calls\n",
         name, (unsigned long long)n_all, (unsigned long long)clean.info.backend_ops[0],
         (unsigned long long)clean.info.backend_ops[1], (unsigned long long)clean.info.backend_ops[2],
         (unsigned long long)clean.info.backend_ops[3], (unsigned long long)clean.info.backend_ops[4],
         (unsigned long long)clean.info.backend_ops[5], (unsigned long long)clean.info.backend_ops[6],
         (unsigned long long)(t->failed_ops - before.failed_ops),
         (unsigned long long)(t->create_failures - before.create_failures),
         (unsigned long long)(t->step_failures - before.step_failures),
         (unsigned long long)(t->failed_quarantine_syncs - before.failed_quarantine_syncs));
}

static void sweep_queries(const akvt_cfg *c, const char *name, totals *t) {
  akvt_result clean;
  const uint32_t sure = c->layers * c->steps; /* one query per lease retired */
  uint64_t before = t->failed_ops;
  clean_run(c, &clean, name);
  assert_true(clean.info.backend_ops[AKV_OP_QUERY] >= sure);
  for (uint32_t n = 1; n <= sure; n += stride()) run_one(c, n, AKV_OP_QUERY, 0, t, name);
  printf("faults %s: %llu event queries in the clean run; failed each of the first %u in turn "
         "(%llu runs)\n",
         name, (unsigned long long)clean.info.backend_ops[AKV_OP_QUERY], sure,
         (unsigned long long)(t->failed_ops - before));
}

static void test_every_backend_operation_fails_in_turn(void **state) {
  totals t;
  akvt_cfg stage = cfg_stage(), arena = cfg_arena(), paged = cfg_paged();
  (void)state;
  memset(&t, 0, sizeof(t));
  sweep(&stage, "stage/hook", &t);
  sweep(&arena, "arena/two-call", &t);
  sweep(&paged, "paged/hook", &t);
  {
    akvt_cfg tr = cfg_try_retire();
    sweep_queries(&tr, "stage/try_retire", &t);
  }
  printf("faults: %llu backend operations failed one at a time (stride %u) plus %llu quarantine "
         "synchronise calls; every run quarantined, 0 of %llu authoritative host rows lost or "
         "changed, no generation moved under a live ticket, nothing leaked\n",
         (unsigned long long)t.failed_ops, stride(), (unsigned long long)t.failed_quarantine_syncs,
         (unsigned long long)t.rows_checked);
}

/* The engine's copy counters (akv_engine_info copies_* and bytes_*) count a
 * copy call once the backend accepted it, even when a later operation of the
 * same call fails, and a copy call that failed nowhere. With every record and
 * every copy failed in turn (arena and paged workloads, no poison fills), the
 * counted calls are exactly the copy operations the backend accepted. */
static void test_copies_counted_when_submitted(void **state) {
  const akvt_cfg cfgs[2] = {cfg_arena(), cfg_paged()};
  const int32_t kinds[2] = {AKV_OP_RECORD, AKV_OP_COPY};
  (void)state;
  for (int c = 0; c < 2; c++) {
    akvt_result clean;
    clean_run(&cfgs[c], &clean, "copies counted");
    for (int k = 0; k < 2; k++)
      for (uint32_t n = 1; n <= clean.info.backend_ops[kinds[k]]; n++) {
        akvt_cfg f = cfgs[c];
        akvt_result r;
        f.fault_fail_nth = n;
        f.fault_kind = kinds[k];
        akvt_run(&f, &r);
        assert_int_equal(r.status, AKV_ERR_BACKEND);
        const uint64_t accepted = r.info.backend_ops[AKV_OP_COPY] - (kinds[k] == AKV_OP_COPY);
        const uint64_t counted = r.info.copies_h2d + r.info.copies_d2h + r.info.copies_d2d;
        if (counted != accepted)
          fail_msg("route %d, %s %u failed in %s: %llu copy calls counted, %llu accepted",
                   (int)cfgs[c].route, kinds[k] == AKV_OP_COPY ? "copy" : "record", n,
                   r.failed_call, (unsigned long long)counted, (unsigned long long)accepted);
      }
  }
}

/* A step_begin that fails (its page fills, their record, or the paged
 * route's page map could not be submitted) leaves the engine's step counter
 * where it was: only a boundary that opened counts. */
static void test_failed_step_begin_keeps_step(void **state) {
  static const struct {
    akv_route route;
    uint32_t len; /* rows per context: 15 gives a page fill at each of two steps, 4 none */
    int32_t kind;
  } cases[] = {{AKV_ROUTE_ARENA, 15, AKV_OP_COPY},
               {AKV_ROUTE_ARENA, 15, AKV_OP_RECORD},
               {AKV_ROUTE_PAGED, 4, AKV_OP_COPY}};
  (void)state;
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    akvt_fx f;
    akvt_fx_open(&f, cases[i].route, 1, 2, cases[i].len);
    /* One whole step first: the counter stands at 1. */
    assert_int_equal(akv_step_begin(f.e, f.c, f.n), AKV_OK);
    assert_int_equal(akvt_null_layers(f.e, f.s, 3), AKV_OK);
    const uint64_t step = f.e->step;
    f.e->bk.fail_kind = cases[i].kind;
    f.e->bk.fail_nth = (uint32_t)(f.e->bk.counted + 1);
    assert_int_equal(akv_step_begin(f.e, f.c, f.n), AKV_ERR_BACKEND);
    assert_int_equal(f.e->bk.injected, 1);
    if (f.e->step != step)
      fail_msg("case %zu: step_begin failed and the step counter moved from %llu to %llu", i,
               (unsigned long long)step, (unsigned long long)f.e->step);
    assert_int_equal(akv_engine_quarantine(f.e, NULL), AKV_OK);
    assert_int_equal(akv_stream_destroy(f.e, f.s), AKV_OK);
    assert_int_equal(akv_engine_destroy(f.e), AKV_OK);
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_copies_counted_when_submitted),
      cmocka_unit_test(test_failed_step_begin_keeps_step),
      cmocka_unit_test(test_every_backend_operation_fails_in_turn),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
