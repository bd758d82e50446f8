/*
 * test_promises.c - promises of the public headers that no other test file
 * pins, each checked so that it fails when the promise is broken: the ABI
 * rule a caller built against one header relies on when it runs against
 * the library of the same soname (the structs the library fills keep their
 * size); "a failing call changes nothing" (akv.h, conventions) for every
 * call outside the lease state machine (test_reentry.c sweeps the lease
 * calls), refused in every engine state; the admission diagnostics writing
 * only within the room the caller gave; names of values outside their enum.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "akv.h"
#include "akv_attention.h"
#include "akv_group.h"
#include "internal.h"
#include "records.h"
#include "testutil.h"

/* ------------------------------------------------ structs the library fills */

/* The structs the library writes into the caller's memory without being
 * told their size (no struct_size field, or, for akv_engine_config, the one
 * call that fills it: akv_engine_config_init). A library writes its own
 * sizeof, so a caller built against a header of the same soname must have
 * the same size, or the library writes past the caller's struct (akv.h,
 * "ABI"). Sizes per soname, as released; a struct absent from a release is
 * 0 there. A size that changes needs a new soname (before 1.0: a new minor
 * version) and a new row here. */
typedef struct filled_sizes {
  unsigned major, minor;
  size_t engine_config, fit_report, engine_info, quarantine_report, view, receipt, adm_decision,
      headroom_info, fence, attention_args, group_info;
} filled_sizes;

static const filled_sizes released[] = {
    /* 0.2.0 (libactivekv.so.0.2), x86-64 */
    {0, 2, 112, 576, 200, 156, 120, 64, 24, 0, 8, 144, 0},
    /* 0.3 (libactivekv.so.0.3), x86-64 */
    {0, 3, 136, 576, 224, 156, 120, 72, 24, 88, 8, 160, 64},
};

static void test_filled_structs_keep_their_size_within_the_soname(void **state) {
  const filled_sizes now = {AKV_VERSION_MAJOR,
                            AKV_VERSION_MINOR,
                            sizeof(akv_engine_config),
                            sizeof(akv_fit_report),
                            sizeof(akv_engine_info),
                            sizeof(akv_quarantine_report),
                            sizeof(akv_view),
                            sizeof(akv_receipt),
                            sizeof(akv_adm_decision),
                            sizeof(akv_headroom_info),
                            sizeof(akv_fence),
                            sizeof(akv_attention_args),
                            sizeof(akv_group_info)};
  const filled_sizes *row = NULL;
  (void)state;
  if (sizeof(void *) != 8) skip(); /* the table is for LP64 */
  for (size_t i = 0; i < sizeof released / sizeof released[0]; i++)
    if (released[i].major == now.major && released[i].minor == now.minor) row = &released[i];
  if (row == NULL) {
    fprintf(stderr, "no sizes recorded for soname %u.%u: add a row to `released`\n", now.major,
            now.minor);
    fail();
  }
  /* Field by field, so that a failure names the struct. */
  assert_int_equal(now.engine_config, row->engine_config);
  assert_int_equal(now.fit_report, row->fit_report);
  assert_int_equal(now.engine_info, row->engine_info);
  assert_int_equal(now.quarantine_report, row->quarantine_report);
  assert_int_equal(now.view, row->view);
  assert_int_equal(now.receipt, row->receipt);
  assert_int_equal(now.adm_decision, row->adm_decision);
  assert_int_equal(now.headroom_info, row->headroom_info);
  assert_int_equal(now.fence, row->fence);
  assert_int_equal(now.attention_args, row->attention_args);
  assert_int_equal(now.group_info, row->group_info);
}


/* ------------------------------------------- refused calls change nothing */

#define LAYERS 3 /* akvt_small_config */
#define ROW_ELEMS 16

/* Everything of an engine a caller (or the engine's own bookkeeping) could
 * see change, except the last error, which a refusal sets. */
typedef struct snapshot {
  akv_engine_info info;
  uint64_t counters[AKV_ADM_RULE_COUNT];
  akv_adm_decision log[AKV_ADM_LOG_ENTRIES];
  size_t n_log;
  akv_headroom_info headroom;
  char explain[1024];
  char explain_ctx[4][1024];
  uint32_t len[4], id[4], layer_len[4][LAYERS], host_leases[4];
  bool in_step[4];
  uint64_t generation[4];
  bool step_open, transport_failed, quarantined, retained;
  uint64_t step;
  uint32_t next_layer, leases_live, lease_head, lease_free, open_contexts, next_context_id,
      streams_live, hr_pending, step_n;
  uint32_t lease_state[LAYERS];
  size_t free_engines, free_contexts, free_leases, free_streams;
} snapshot;

static void take_snapshot(akv_engine *e, akv_context *const *c, uint32_t n, snapshot *s) {
  memset(s, 0, sizeof *s);
  assert_int_equal(akv_engine_info_get(e, &s->info), AKV_OK);
  assert_int_equal(akv_admission_counters(e, s->counters, AKV_ADM_RULE_COUNT), AKV_OK);
  assert_int_equal(akv_admission_log(e, s->log, AKV_ADM_LOG_ENTRIES, &s->n_log), AKV_OK);
  assert_int_equal(akv_headroom_get(e, &s->headroom), AKV_OK);
  assert_int_equal(akv_admission_explain(e, NULL, s->explain, sizeof s->explain), AKV_OK);
  for (uint32_t i = 0; i < n; i++) {
    assert_int_equal(akv_context_length(c[i], &s->len[i]), AKV_OK);
    assert_int_equal(akv_context_id(c[i], &s->id[i]), AKV_OK);
    assert_int_equal(akv_admission_explain(e, c[i], s->explain_ctx[i], sizeof s->explain_ctx[i]),
                     AKV_OK);
    memcpy(s->layer_len[i], c[i]->layer_len, sizeof s->layer_len[i]);
    s->host_leases[i] = c[i]->host_leases;
    s->in_step[i] = c[i]->in_step;
    s->generation[i] = c[i]->generation;
  }
  s->step_open = e->step_open;
  s->transport_failed = e->transport_failed;
  s->quarantined = e->quarantined;
  s->retained = e->retained;
  s->step = e->step;
  s->step_n = e->step_n;
  s->next_layer = e->next_layer;
  s->leases_live = e->leases_live;
  s->lease_head = e->lease_head;
  s->lease_free = e->lease_free;
  s->open_contexts = e->open_contexts;
  s->next_context_id = e->next_context_id;
  s->hr_pending = e->hr_pending_chunks;
  for (size_t i = 0; i < sizeof e->streams / sizeof e->streams[0]; i++)
    s->streams_live += e->streams[i].live;
  for (uint32_t l = 0; l < LAYERS; l++) s->lease_state[l] = e->leases[l].state;
  s->free_engines = akv_rec_free_count(&akv_engine_records);
  s->free_contexts = akv_rec_free_count(&akv_context_records);
  s->free_leases = akv_rec_free_count(&akv_lease_records);
  s->free_streams = akv_rec_free_count(&akv_stream_records);
}

typedef enum state_kind {
  ST_IDLE,       /* contexts open, no step */
  ST_STEP,       /* a step over c[0] open, no lease begun */
  ST_BEGUN,      /* layer 0's lease begun */
  ST_SEALED,     /* layer 0's lease sealed, not retired */
  ST_FAILED,     /* a copy of layer 0's begin failed: transport failed */
  ST_QUARANTINED /* ST_FAILED, then quarantined */
} state_kind;

static const char *const state_names[] = {"idle", "step", "begun", "sealed", "failed",
                                          "quarantined"};

typedef struct machine {
  akv_engine *e;
  akv_stream s;
  akv_context *c[2];
  akv_lease *lease;
} machine;

/* The engines of the sweep: the arena route without headroom, and the paged
 * route with two headroom chunks of 2 pages on a modelled device (release
 * and take are then refused only where akv.h says). */
typedef enum engine_kind { EK_ARENA, EK_PAGED_HEADROOM } engine_kind;

static akv_engine_config machine_config(engine_kind ek) {
  akv_engine_config ec = akvt_small_config(ek == EK_ARENA ? AKV_ROUTE_ARENA : AKV_ROUTE_PAGED, 1);
  if (ek == EK_PAGED_HEADROOM) {
    akv_engine *probe = NULL;
    akv_engine_info pi;
    ec.headroom_gib = 1;
    ec.headroom_chunk_pages = 2;
    assert_int_equal(akv_engine_create(&ec, &probe), AKV_OK); /* no free memory: none taken */
    assert_int_equal(akv_engine_info_get(probe, &pi), AKV_OK);
    assert_int_equal(akv_engine_destroy(probe), AKV_OK);
    ec.host_fake_free_bytes = pi.device_bytes_allocated + 2 * (2 + 1) * pi.page_bytes;
  }
  return ec;
}

static void machine_open(machine *m, engine_kind ek, state_kind k) {
  static uint16_t rows[20 * ROW_ELEMS];
  const void *r[LAYERS] = {rows, rows, rows};
  akv_engine_config ec = machine_config(ek);
  memset(m, 0, sizeof *m);
  if (k == ST_FAILED || k == ST_QUARANTINED) {
    /* the step's copies come first: its page fills (and page map, paged) */
    ec.fault_kind = AKV_OP_COPY;
    ec.fault_fail_nth = ek == EK_ARENA ? 2 : 3;
  }
  assert_int_equal(akv_engine_create(&ec, &m->e), AKV_OK);
  if (ek == EK_PAGED_HEADROOM) {
    akv_headroom_info hi;
    assert_int_equal(akv_headroom_get(m->e, &hi), AKV_OK);
    assert_int_equal(hi.pages, 4); /* both chunks taken at create */
  }
  assert_int_equal(akv_stream_create(m->e, &m->s), AKV_OK);
  for (int i = 0; i < 2; i++) {
    assert_int_equal(akv_context_open(m->e, NULL, &m->c[i]), AKV_OK);
    assert_int_equal(akv_context_append(m->c[i], 20, r, r), AKV_OK);
  }
  if (k == ST_IDLE) return;
  assert_int_equal(akv_step_begin(m->e, m->c, 1), AKV_OK);
  if (k == ST_STEP) return;
  if (k == ST_FAILED || k == ST_QUARANTINED) {
    assert_int_equal(akv_lease_begin(m->e, 0, &m->lease), AKV_ERR_BACKEND);
    if (k == ST_QUARANTINED) assert_int_equal(akv_engine_quarantine(m->e, NULL), AKV_OK);
    return;
  }
  assert_int_equal(akv_lease_begin(m->e, 0, &m->lease), AKV_OK);
  if (k == ST_BEGUN) return;
  akv_fence attn, tail;
  assert_int_equal(akv_lease_attend(m->lease, m->s, akvt_noop_hook, NULL, &attn), AKV_OK);
  assert_int_equal(akv_lease_write_back(m->lease, NULL, 0, &tail), AKV_OK);
  assert_int_equal(akv_lease_seal(m->lease, tail, attn), AKV_OK);
}

static void machine_close(machine *m, state_kind k) {
  if (k == ST_BEGUN || k == ST_SEALED) {
    if (k == ST_BEGUN) assert_int_equal(akvt_lease_through(m->lease, m->s), AKV_OK);
    else assert_int_equal(akv_lease_retire(m->lease, NULL), AKV_OK);
    assert_int_equal(akvt_null_layers_from(m->e, m->s, 1, LAYERS), AKV_OK);
  } else if (k == ST_STEP) {
    assert_int_equal(akvt_null_layers(m->e, m->s, LAYERS), AKV_OK);
  } else if (k == ST_FAILED) {
    assert_int_equal(akv_engine_quarantine(m->e, NULL), AKV_OK);
  }
  assert_int_equal(akv_stream_destroy(m->e, m->s), AKV_OK);
  assert_int_equal(akv_engine_destroy(m->e), AKV_OK);
}

static void noop_fn(void *arg) { (void)arg; }

/* One refused call: its status is not AKV_OK, and nothing the snapshot sees
 * moved. */
#define REFUSE(call)                                                                   \
  do {                                                                                 \
    snapshot before_, after_;                                                          \
    take_snapshot(m.e, m.c, 2, &before_);                                              \
    akv_status st_ = (call);                                                           \
    take_snapshot(m.e, m.c, 2, &after_);                                               \
    if (st_ == AKV_OK || memcmp(&before_, &after_, sizeof before_) != 0) {             \
      fprintf(stderr, "engine %d, state %s: %s returned %s%s\n", (int)ek, state_names[k],     \
              #call, akv_status_string(st_), st_ == AKV_OK ? "" : " and changed the engine"); \
      fail();                                                                          \
    }                                                                                  \
  } while (0)

static void refused_calls_in_every_state(engine_kind ek) {
  static uint16_t rows[64 * ROW_ELEMS], out_k[64 * ROW_ELEMS], out_v[64 * ROW_ELEMS];
  const void *r[LAYERS] = {rows, rows, rows};
  const void *r_null[LAYERS] = {rows, NULL, rows};
  for (state_kind k = ST_IDLE; k <= ST_QUARANTINED; k++) {
    machine m, other;
    akv_context *c = NULL, *dup[2], *foreign[2];
    akv_lease *l = NULL;
    akv_context_config bad_version = AKV_CONTEXT_CONFIG_INIT, small = AKV_CONTEXT_CONFIG_INIT;
    uint64_t u64 = 0, counters[AKV_ADM_RULE_COUNT];
    size_t n_log = 0;
    char buf[16];
    int junk = 0;
    bad_version.version = AKV_CONFIG_VERSION + 1;
    small.struct_size = 7;
    machine_open(&m, ek, k);
    machine_open(&other, EK_ARENA, ST_IDLE);
    dup[0] = dup[1] = m.c[0];
    foreign[0] = m.c[0];
    foreign[1] = other.c[0];
    /* contexts */
    REFUSE(akv_context_open(m.e, NULL, NULL));
    REFUSE(akv_context_open(m.e, &bad_version, &c));
    REFUSE(akv_context_open(m.e, &small, &c));
    REFUSE(akv_context_append(m.c[0], 1, NULL, r));
    REFUSE(akv_context_append(m.c[0], 1, r, r_null));
    REFUSE(akv_context_append(m.c[0], 64, r, r));
    REFUSE(akv_context_append(m.c[1], UINT32_MAX, r, r));
    REFUSE(akv_context_append_layer(m.c[1], LAYERS, 0, NULL, NULL));
    REFUSE(akv_context_append_layer(m.c[1], UINT32_MAX, 1, rows, rows));
    REFUSE(akv_context_append_layer(m.c[1], 0, 1, NULL, rows));
    REFUSE(akv_context_append_layer(m.c[1], 2, 45, rows, rows));
    REFUSE(akv_context_append_layer(m.c[0], 0, UINT32_MAX, rows, rows));
    REFUSE(akv_context_read(m.c[1], 0, UINT32_MAX, 2, out_k, out_v));
    REFUSE(akv_context_read(m.c[1], LAYERS, 0, 0, NULL, NULL));
    REFUSE(akv_context_read(m.c[1], 0, 0, 1, NULL, out_v));
    REFUSE(akv_context_read(m.c[1], 0, 20, 1, out_k, out_v));
    REFUSE(akv_context_length(m.c[0], NULL));
    REFUSE(akv_context_id(m.c[0], NULL));
    /* steps and leases */
    REFUSE(akv_step_begin(m.e, NULL, 1));
    REFUSE(akv_step_begin(m.e, m.c, 0));
    REFUSE(akv_step_begin(m.e, m.c, UINT32_MAX));
    REFUSE(akv_step_begin(m.e, dup, 2));
    REFUSE(akv_step_begin(m.e, foreign, 2));
    REFUSE(akv_lease_begin(m.e, 0, NULL));
    REFUSE(akv_lease_begin(m.e, LAYERS, &l));
    REFUSE(akv_lease_begin(m.e, UINT32_MAX, &l));
    if (k != ST_IDLE) REFUSE(akv_context_close(m.c[0]));
    if (k != ST_IDLE && k != ST_QUARANTINED) REFUSE(akv_step_end(m.e));
    if (ek == EK_ARENA) { /* headroom is not enabled */
      REFUSE(akv_headroom_release(m.e, 1, &u64, &u64));
      REFUSE(akv_headroom_take(m.e, UINT64_MAX, &u64));
    } else {
      if (k != ST_IDLE) REFUSE(akv_headroom_take(m.e, UINT64_MAX, &u64)); /* a step is open */
      if (k == ST_FAILED || k == ST_QUARANTINED)
        REFUSE(akv_headroom_release(m.e, UINT64_MAX, &u64, &u64));
    }
    /* streams */
    REFUSE(akv_stream_create(m.e, NULL));
    REFUSE(akv_stream_destroy(m.e, NULL));
    REFUSE(akv_stream_destroy(m.e, (akv_stream)&junk));
    REFUSE(akv_stream_destroy(m.e, other.s));
    REFUSE(akv_stream_synchronize(m.e, other.s));
    REFUSE(akv_stream_launch_host(m.e, m.s, NULL, NULL));
    REFUSE(akv_stream_launch_host(m.e, other.s, noop_fn, NULL));
    if (k == ST_SEALED) REFUSE(akv_stream_destroy(m.e, m.s)); /* its lease used it */
    for (int i = 0; i < 8 && k != ST_FAILED && k != ST_QUARANTINED; i++) {
      akv_stream more = NULL;
      if (akv_stream_create(m.e, &more) != AKV_OK) break;
      assert_int_equal(akv_stream_destroy(m.e, more), AKV_OK);
    }
    /* diagnostics */
    REFUSE(akv_admission_counters(m.e, NULL, 1));
    REFUSE(akv_admission_counters(m.e, counters, 0));
    REFUSE(akv_admission_log(m.e, NULL, 1, &n_log));
    REFUSE(akv_admission_log(m.e, NULL, 0, NULL));
    REFUSE(akv_admission_explain(m.e, NULL, NULL, 8));
    REFUSE(akv_admission_explain(m.e, NULL, buf, 0));
    REFUSE(akv_admission_explain(m.e, other.c[0], buf, sizeof buf));
    REFUSE(akv_engine_info_get(m.e, NULL));
    REFUSE(akv_headroom_get(m.e, NULL));
    /* teardown with live work */
    if (k != ST_IDLE && k != ST_QUARANTINED) REFUSE(akv_engine_destroy(m.e));
    machine_close(&other, ST_IDLE);
    machine_close(&m, k);
  }
}

static void test_refused_calls_change_nothing_in_any_state(void **state) {
  (void)state;
  refused_calls_in_every_state(EK_ARENA);
  refused_calls_in_every_state(EK_PAGED_HEADROOM);
}

/* ------------------------------------- diagnostics within the caller's room */

/* akv_admission_counters copies min(n, AKV_ADM_RULE_COUNT) counters,
 * akv_admission_log at most cap decisions (the newest, oldest first) and
 * akv_admission_explain at most cap bytes, NUL included: nothing past the
 * room the caller gave, whatever the engine has to say. */
static void test_diagnostics_write_within_the_callers_room(void **state) {
  akv_engine *e = akvt_small_engine(AKV_ROUTE_ARENA, 1);
  akv_context *c = NULL, *held[4];
  akv_context_config big = AKV_CONTEXT_CONFIG_INIT;
  enum { CANARY = 0x5a };
  (void)state;
  assert_non_null(e);
  /* Many decisions (more than the log holds), a refusal and a raised floor,
   * so that every text is long. */
  for (int i = 0; i < 200; i++) {
    assert_int_equal(akv_context_open(e, NULL, &c), AKV_OK);
    assert_int_equal(akv_context_close(c), AKV_OK);
  }
  big.target_pages = 1; /* raised to the floor of 2 */
  assert_int_equal(akv_context_open(e, &big, &held[0]), AKV_OK);
  big.target_pages = UINT32_MAX - 1;
  assert_int_equal(akv_context_open(e, &big, &held[1]), AKV_ERR_ADMISSION_REFUSED);

  uint64_t all[AKV_ADM_RULE_COUNT];
  assert_int_equal(akv_admission_counters(e, all, AKV_ADM_RULE_COUNT), AKV_OK);
  for (size_t n = 1; n <= AKV_ADM_RULE_COUNT + 2; n++) {
    uint64_t out[AKV_ADM_RULE_COUNT + 3];
    memset(out, CANARY, sizeof out);
    assert_int_equal(akv_admission_counters(e, out, n), AKV_OK);
    const size_t copied = n < AKV_ADM_RULE_COUNT ? n : AKV_ADM_RULE_COUNT;
    assert_memory_equal(out, all, copied * sizeof(uint64_t));
    for (size_t i = copied; i < AKV_ADM_RULE_COUNT + 3; i++)
      assert_int_equal(out[i], 0x5a5a5a5a5a5a5a5aull);
  }

  akv_adm_decision newest[AKV_ADM_LOG_ENTRIES];
  size_t n_newest = 0;
  assert_int_equal(akv_admission_log(e, newest, AKV_ADM_LOG_ENTRIES, &n_newest), AKV_OK);
  assert_int_equal(n_newest, AKV_ADM_LOG_ENTRIES); /* bounded: older ones dropped */
  for (size_t cap = 0; cap <= 5; cap++) {
    akv_adm_decision out[8];
    size_t n = 99;
    memset(out, CANARY, sizeof out);
    assert_int_equal(akv_admission_log(e, cap ? out : NULL, cap, &n), AKV_OK);
    assert_int_equal(n, cap);
    /* the newest `cap`, oldest first */
    if (cap > 0)
      assert_memory_equal(out, newest + AKV_ADM_LOG_ENTRIES - cap, cap * sizeof out[0]);
    for (const unsigned char *b = (const unsigned char *)(out + cap);
         b < (const unsigned char *)(out + 8); b++)
      assert_int_equal(*b, CANARY);
  }

  const akv_context *subjects[2] = {NULL, held[0]};
  for (int s = 0; s < 2; s++) {
    char full[2048];
    assert_int_equal(akv_admission_explain(e, subjects[s], full, sizeof full), AKV_OK);
    const size_t len = strlen(full);
    assert_true(len > 100 && len + 1 < sizeof full);
    for (size_t cap = 1; cap <= len + 2; cap++) {
      char out[2048 + 8];
      memset(out, CANARY, sizeof out);
      assert_int_equal(akv_admission_explain(e, subjects[s], out, cap), AKV_OK);
      size_t got = 0;
      while (got < cap && out[got] != '\0') got++;
      assert_true(got < cap); /* NUL-terminated within cap */
      assert_int_equal(got, cap - 1 < len ? cap - 1 : len);
      assert_memory_equal(out, full, got); /* a prefix of the whole text */
      for (size_t i = cap; i < sizeof out; i++) assert_int_equal((unsigned char)out[i], CANARY);
    }
  }
  assert_int_equal(akv_context_close(held[0]), AKV_OK);
  assert_int_equal(akv_engine_destroy(e), AKV_OK);
}

/* ------------------------------------------------------ names of values */

/* akv_status_string and akv_adm_rule_string never give NULL: a value
 * outside the enum (negative, the count, far past it) gives "unknown ..." */
static void test_names_of_values_outside_their_enum(void **state) {
  const int outside[] = {-1, INT32_MIN, AKV_STATUS_COUNT_, AKV_ADM_RULE_COUNT, 1000, INT32_MAX};
  (void)state;
  for (size_t i = 0; i < sizeof outside / sizeof outside[0]; i++) {
    const char *rule = akv_adm_rule_string((akv_adm_rule)outside[i]);
    assert_non_null(rule);
    if (outside[i] < 0 || outside[i] >= AKV_ADM_RULE_COUNT) assert_string_equal(rule, "unknown");
    const char *status = akv_status_string((akv_status)outside[i]);
    assert_non_null(status);
    if (outside[i] < 0 || outside[i] >= AKV_STATUS_COUNT_)
      assert_string_equal(status, "unknown status");
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_filled_structs_keep_their_size_within_the_soname),
      cmocka_unit_test(test_refused_calls_change_nothing_in_any_state),
      cmocka_unit_test(test_diagnostics_write_within_the_callers_room),
      cmocka_unit_test(test_names_of_values_outside_their_enum),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
