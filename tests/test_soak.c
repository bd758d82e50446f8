/*
 * test_soak.c - a long run of random traffic on the host backend.
 *
 * 100,000 decode steps over a tiny geometry (2 dense layers, 1 KV head,
 * head_dim 32, 64 tokens, pages of 4 tokens) on the arena route with a 1 GiB
 * device pool. Contexts arrive with random prefill lengths, targets (zero,
 * small, fair share, or half the pool, so admission both revokes idle
 * targets and refuses) and bursts; they grow by random appends between
 * steps, take part in random subsets of the steps, and depart at random or
 * when full. The attention hook is null-ish: it writes each context's new
 * row and checks the staged history against the reference, nothing else.
 *
 * The test keeps a reference copy of every context's rows and checks:
 *  - every staged history the hook sees equals the reference, byte for byte;
 *  - every context's rows equal the reference at its departure and at the
 *    end (akv_context_read, all layers, K and V);
 *  - admission counters balance against the traffic: ADMIT = admissions +
 *    re-admissions of revoked targets, REFUSE = refused opens, RELEASE =
 *    closes; at the end every admission was released and no page is held;
 *  - no leak: the engine is destroyed cleanly (the ASan build checks the
 *    rest).
 *
 * The pool of a 1 GiB arena is about a million pages here, so the reclaim
 * and shrink rules (which need a full pool) cannot fire in this geometry;
 * test_admission covers them on the allocator directly.
 *
 * AKVT_SOAK_STEPS=n sets the number of steps (default 100000; sanitizer
 * builds run fewer), AKVT_SOAK_SEED=s the traffic seed (default 1).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "internal.h"
#include "testutil.h"

#define LAYERS 2
#define ROW_ELEMS 32 /* 1 KV head x head_dim 32, bf16 */
#define ROW_BYTES (ROW_ELEMS * 2)
#define MAXTOK 64
#define PAGE_TOKENS 4
#define NCTX 8

/* ------------------------------------------------------------------ rng */

static uint64_t rng_state;

static uint64_t rnd(void) {
  uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

static uint32_t below(uint32_t n) { return (uint32_t)(rnd() % n); }
static int chance(uint32_t per_mille) { return below(1000) < per_mille; }

/* A decode row: a function of (context uid, layer, token, K/V). */
static void decode_row(uint8_t *row, uint32_t uid, uint32_t layer, uint32_t token, int kv) {
  uint64_t h = ((uint64_t)uid << 32) ^ ((uint64_t)layer << 24) ^ ((uint64_t)token << 8) ^ (uint64_t)kv;
  for (uint32_t j = 0; j < ROW_BYTES; j += 8) {
    uint64_t z = h + (uint64_t)j * 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 31)) * 0xbf58476d1ce4e5b9ull;
    z ^= z >> 29;
    memcpy(row + j, &z, 8);
  }
}

/* ------------------------------------------------------------ the model */

typedef struct model {
  akv_context *c; /* NULL: no context in this model slot */
  uint32_t uid;
  uint32_t len;
  int revoked;    /* admission revoked its target (explain says so) */
  uint8_t rows[LAYERS][2][MAXTOK][ROW_BYTES];
} model;

typedef struct job {
  struct soak *sk;
  akv_view view; /* its arrays stay valid until the lease retires */
  uint32_t n, layer;
  uint32_t len[NCTX];
  model *m[NCTX];
} job;

typedef struct soak {
  akv_engine *e;
  akv_stream s;
  model m[NCTX];
  model *step_m[NCTX];
  job jobs[LAYERS];
  atomic_ulong staged_bad;
  atomic_ulong rows_in_place; /* paged route: rows read from retained pages */
  uint32_t next_uid;
  uint32_t n_pages;
  /* traffic */
  uint64_t steps, opens, refused_admission, refused_queue, closes, appends, readmits, revokes;
  uint64_t rows_compared;
  uint64_t counters[AKV_ADM_RULE_COUNT];
} soak;

/* Runs on the compute stream: checks the staged history, writes the new row. */
static void job_run(void *arg) {
  job *j = arg;
  struct soak *sk = j->sk;
  for (uint32_t i = 0; i < j->n; i++) {
    const model *m = j->m[i];
    uint8_t *k;
    for (uint32_t t = 0; t < j->len[i]; t++) {
      k = akvt_view_row(&j->view, i, t);
      if (k != (uint8_t *)j->view.base + i * j->view.context_stride + t * j->view.row_stride)
        atomic_fetch_add(&sk->rows_in_place, 1);
      if (memcmp(k, m->rows[j->layer][0][t], ROW_BYTES) != 0 ||
          memcmp(k + j->view.v_offset, m->rows[j->layer][1][t], ROW_BYTES) != 0) {
        atomic_fetch_add(&sk->staged_bad, 1);
        break;
      }
    }
    k = akvt_view_row(&j->view, i, j->len[i]);
    decode_row(k, m->uid, j->layer, j->len[i], 0);
    decode_row(k + j->view.v_offset, m->uid, j->layer, j->len[i], 1);
  }
}

static int hook(void *user, const akv_view *view, akv_stream stream) {
  soak *sk = user;
  job *j = &sk->jobs[view->layer];
  j->sk = sk;
  j->view = *view;
  j->n = view->n_contexts;
  j->layer = view->layer;
  for (uint32_t i = 0; i < view->n_contexts; i++) {
    j->len[i] = view->len[i];
    j->m[i] = sk->step_m[i];
    if (view->contexts[i] != sk->step_m[i]->c) return 1;
  }
  return akv_stream_launch_host(sk->e, stream, job_run, j) == AKV_OK ? 0 : 1;
}

/* ------------------------------------------------------------- checks */

static void read_counters(soak *sk, uint64_t *out) {
  assert_int_equal(akv_admission_counters(sk->e, out, AKV_ADM_RULE_COUNT), AKV_OK);
}

/* Only these rules may have moved, by exactly these amounts. */
static void expect_delta(const uint64_t *before, const uint64_t *after, akv_adm_rule rule,
                         uint64_t n, const char *what) {
  for (int r = 0; r < AKV_ADM_RULE_COUNT; r++) {
    uint64_t want = before[r] + (r == (int)rule ? n : 0);
    if (after[r] != want)
      fail_msg("%s: counter %s went %llu -> %llu (expected %llu)", what,
               akv_adm_rule_string((akv_adm_rule)r), (unsigned long long)before[r],
               (unsigned long long)after[r], (unsigned long long)want);
  }
}

static int is_revoked(soak *sk, const model *m) {
  char buf[1024];
  assert_int_equal(akv_admission_explain(sk->e, m->c, buf, sizeof(buf)), AKV_OK);
  return strstr(buf, "its target was revoked") != NULL;
}

static void compare_rows(soak *sk, model *m) {
  static uint8_t k[MAXTOK * ROW_BYTES], v[MAXTOK * ROW_BYTES];
  uint32_t len = 0;
  assert_int_equal(akv_context_length(m->c, &len), AKV_OK);
  if (len != m->len) fail_msg("context uid %u: library length %u, reference %u", m->uid, len, m->len);
  for (uint32_t l = 0; l < LAYERS; l++) {
    assert_int_equal(akv_context_read(m->c, l, 0, len, k, v), AKV_OK);
    if (memcmp(k, m->rows[l][0], (size_t)len * ROW_BYTES) != 0 ||
        memcmp(v, m->rows[l][1], (size_t)len * ROW_BYTES) != 0)
      fail_msg("context uid %u layer %u: host rows differ from the reference (%u rows)", m->uid, l, len);
    sk->rows_compared += 2ull * len;
  }
}

/* ------------------------------------------------------------- traffic */

static void append_rows(soak *sk, model *m, uint32_t n) {
  static uint8_t k[LAYERS][MAXTOK][ROW_BYTES], v[LAYERS][MAXTOK][ROW_BYTES];
  const void *kp[LAYERS], *vp[LAYERS];
  for (uint32_t l = 0; l < LAYERS; l++) {
    for (uint32_t t = 0; t < n; t++)
      for (uint32_t j = 0; j < ROW_BYTES; j++) {
        k[l][t][j] = (uint8_t)rnd();
        v[l][t][j] = (uint8_t)rnd();
      }
    kp[l] = k[l];
    vp[l] = v[l];
  }
  assert_int_equal(akv_context_append(m->c, n, kp, vp), AKV_OK);
  for (uint32_t l = 0; l < LAYERS; l++) {
    memcpy(m->rows[l][0][m->len], k[l], (size_t)n * ROW_BYTES);
    memcpy(m->rows[l][1][m->len], v[l], (size_t)n * ROW_BYTES);
  }
  m->len += n;
}

static void arrive(soak *sk, model *m) {
  akv_context_config cc = AKV_CONTEXT_CONFIG_INIT;
  uint64_t before[AKV_ADM_RULE_COUNT], after[AKV_ADM_RULE_COUNT];
  uint32_t pick = below(100);
  akv_status st;
  if (pick < 20) cc.target_pages = 0;
  else if (pick < 65) cc.target_pages = 1 + below(4);
  else if (pick < 88) cc.target_pages = AKV_TARGET_FAIR_SHARE;
  else cc.target_pages = sk->n_pages / 2 + below(8); /* admission must revoke or refuse */
  cc.burst_pages = chance(300) ? 1 + below(4) : 0;
  read_counters(sk, before);
  st = akv_context_open(sk->e, &cc, &m->c);
  read_counters(sk, after);
  if (st == AKV_ERR_ADMISSION_REFUSED) {
    char buf[1024];
    m->c = NULL;
    sk->refused_admission++;
    expect_delta(before, after, AKV_ADM_REFUSE, 1, "refused open");
    assert_int_equal(akv_admission_explain(sk->e, NULL, buf, sizeof(buf)), AKV_OK);
    assert_non_null(strstr(buf, "refused"));
    return;
  }
  if (st != AKV_OK) fail_msg("open: %s", akv_status_string(st));
  expect_delta(before, after, AKV_ADM_ADMIT, 1, "open");
  sk->opens++;
  m->uid = ++sk->next_uid;
  m->len = 0;
  m->revoked = 0;
  {
    uint32_t n = chance(500) ? below(17) : below(MAXTOK);
    if (n > 0) append_rows(sk, m, n);
  }
  /* an admission may have revoked idle targets */
  if (cc.target_pages > 0)
    for (int i = 0; i < NCTX; i++)
      if (sk->m[i].c != NULL && &sk->m[i] != m) {
        int r = is_revoked(sk, &sk->m[i]);
        if (r && !sk->m[i].revoked) sk->revokes++;
        if (!r && sk->m[i].revoked) fail_msg("an open restored a revoked target");
        sk->m[i].revoked = r;
      }
}

static void depart(soak *sk, model *m) {
  uint64_t before[AKV_ADM_RULE_COUNT], after[AKV_ADM_RULE_COUNT];
  compare_rows(sk, m);
  read_counters(sk, before);
  assert_int_equal(akv_context_close(m->c), AKV_OK);
  read_counters(sk, after);
  expect_delta(before, after, AKV_ADM_RELEASE, 1, "close");
  sk->closes++;
  m->c = NULL;
}

static void run_step(soak *sk, uint32_t n) {
  akv_context *ctx[NCTX];
  akv_lease *ls[LAYERS];
  uint64_t before[AKV_ADM_RULE_COUNT], after[AKV_ADM_RULE_COUNT];
  uint32_t revoked_in_step = 0, restored = 0;
  for (uint32_t i = 0; i < n; i++) {
    ctx[i] = sk->step_m[i]->c;
    revoked_in_step += (uint32_t)sk->step_m[i]->revoked;
  }
  read_counters(sk, before);
  assert_int_equal(akv_step_begin(sk->e, ctx, n), AKV_OK);
  read_counters(sk, after);
  /* boundaries move pages (and may re-admit revoked targets), nothing else */
  if (after[AKV_ADM_REFUSE] != before[AKV_ADM_REFUSE] ||
      after[AKV_ADM_RELEASE] != before[AKV_ADM_RELEASE])
    fail_msg("step_begin changed refuse/release counters");
  if (revoked_in_step > 0 || after[AKV_ADM_ADMIT] != before[AKV_ADM_ADMIT]) {
    for (int i = 0; i < NCTX; i++) {
      model *m = &sk->m[i];
      int r;
      if (m->c == NULL) continue;
      r = is_revoked(sk, m);
      if (m->revoked && !r) restored++;
      if (!m->revoked && r) sk->revokes++;
      m->revoked = r;
    }
    if (after[AKV_ADM_ADMIT] - before[AKV_ADM_ADMIT] != restored)
      fail_msg("step_begin: ADMIT moved by %llu, %u targets restored",
               (unsigned long long)(after[AKV_ADM_ADMIT] - before[AKV_ADM_ADMIT]), restored);
    sk->readmits += restored;
  }
  for (uint32_t i = 0; i < n; i++) {
    uint32_t full = sk->step_m[i]->len / PAGE_TOKENS;
    if (akv_adm_pages_held(sk->e->adm, ctx[i]->slot) > full)
      fail_msg("context uid %u holds %u pages with %u full", sk->step_m[i]->uid,
               akv_adm_pages_held(sk->e->adm, ctx[i]->slot), full);
  }
  for (uint32_t l = 0; l < LAYERS; l++) {
    akv_fence attn, tail;
    assert_int_equal(akv_lease_begin(sk->e, l, &ls[l]), AKV_OK);
    assert_int_equal(akv_lease_attend(ls[l], sk->s, hook, sk, &attn), AKV_OK);
    assert_int_equal(akv_lease_write_back(ls[l], NULL, 0, &tail), AKV_OK);
    assert_int_equal(akv_lease_seal(ls[l], tail, attn), AKV_OK);
  }
  for (uint32_t l = 0; l < LAYERS; l++) assert_int_equal(akv_lease_retire(ls[l], NULL), AKV_OK);
  assert_int_equal(akv_step_end(sk->e), AKV_OK);
  for (uint32_t i = 0; i < n; i++) {
    model *m = sk->step_m[i];
    for (uint32_t l = 0; l < LAYERS; l++) {
      decode_row(m->rows[l][0][m->len], m->uid, l, m->len, 0);
      decode_row(m->rows[l][1][m->len], m->uid, l, m->len, 1);
    }
    m->len++;
  }
  sk->steps++;
}

static void soak_run(akv_route route) {
  static soak sk;
  akv_engine_config ec = AKV_ENGINE_CONFIG_INIT;
  akv_engine_info info;
  const char *env_steps = getenv("AKVT_SOAK_STEPS"), *env_seed = getenv("AKVT_SOAK_SEED");
  uint64_t target_steps = env_steps != NULL ? strtoull(env_steps, NULL, 10) : 100000;
  uint64_t seed = env_seed != NULL ? strtoull(env_seed, NULL, 10) : 1;
  memset(&sk, 0, sizeof(sk));
  rng_state = seed;
  ec.backend = AKV_BACKEND_HOST;
  ec.n_dense_layers = LAYERS;
  ec.kv_heads = 1;
  ec.head_dim = ROW_ELEMS;
  ec.max_tokens = MAXTOK;
  ec.page_tokens = PAGE_TOKENS;
  ec.host_pool_gib = 1;
  ec.device_pool_gib = 1;
  ec.max_contexts = NCTX;
  ec.route = route;
  ec.log_fn = akvt_silent_log;
  assert_int_equal(akv_engine_create(&ec, &sk.e), AKV_OK);
  assert_int_equal(akv_stream_create(sk.e, &sk.s), AKV_OK);
  assert_int_equal(akv_engine_info_get(sk.e, &info), AKV_OK);
  sk.n_pages = info.device_pages;
  assert_true(sk.n_pages > 0);

  while (sk.steps < target_steps) {
    uint32_t n = 0, n_open = 0;
    /* departures: at random, or when full */
    for (int i = 0; i < NCTX; i++) {
      model *m = &sk.m[i];
      if (m->c != NULL && (m->len == MAXTOK || chance(30))) depart(&sk, m);
    }
    /* arrivals */
    for (int i = 0; i < NCTX; i++)
      if (sk.m[i].c == NULL && chance(250)) arrive(&sk, &sk.m[i]);
    for (int i = 0; i < NCTX; i++) n_open += sk.m[i].c != NULL;
    if (n_open == NCTX && chance(20)) {
      /* every host slot is taken: refused, queue it; nothing admitted */
      akv_context *extra = NULL;
      uint64_t before[AKV_ADM_RULE_COUNT], after[AKV_ADM_RULE_COUNT];
      read_counters(&sk, before);
      assert_int_equal(akv_context_open(sk.e, NULL, &extra), AKV_ERR_REFUSED_QUEUE);
      read_counters(&sk, after);
      expect_delta(before, after, AKV_ADM_ADMIT, 0, "queued open");
      sk.refused_queue++;
    }
    /* lengths also grow between steps */
    for (int i = 0; i < NCTX; i++) {
      model *m = &sk.m[i];
      if (m->c != NULL && m->len + 1 < MAXTOK && chance(15)) {
        append_rows(&sk, m, 1 + below(MAXTOK - 1 - m->len));
        sk.appends++;
      }
    }
    /* a random subset of the contexts that have room decodes one step */
    for (int i = 0; i < NCTX; i++) {
      model *m = &sk.m[i];
      if (m->c != NULL && m->len < MAXTOK && chance(700)) sk.step_m[n++] = m;
    }
    if (n == 0) continue;
    run_step(&sk, n);
    if (atomic_load(&sk.staged_bad) != 0)
      fail_msg("step %llu: %lu staged histories differ from the reference",
               (unsigned long long)sk.steps, atomic_load(&sk.staged_bad));
  }

  /* the end: every history equals the reference, then everything departs */
  for (int i = 0; i < NCTX; i++)
    if (sk.m[i].c != NULL) depart(&sk, &sk.m[i]);
  read_counters(&sk, sk.counters);
  assert_int_equal(sk.counters[AKV_ADM_ADMIT], sk.opens + sk.readmits);
  assert_int_equal(sk.counters[AKV_ADM_REFUSE], sk.refused_admission);
  assert_int_equal(sk.counters[AKV_ADM_RELEASE], sk.closes);
  assert_int_equal(sk.opens, sk.closes);
  for (uint32_t slot = 0; slot < NCTX; slot++) assert_int_equal(akv_adm_pages_held(sk.e->adm, slot), 0);
  /* the traffic exercised the allocator */
  assert_true(sk.counters[AKV_ADM_FREE] > 0);
  assert_true(sk.counters[AKV_ADM_OWN_REUSE] > 0);
  if (target_steps >= 20000) {
    assert_true(sk.refused_admission > 0);
    assert_true(sk.revokes > 0);
  }
  assert_int_equal(akv_engine_info_get(sk.e, &info), AKV_OK);
  assert_int_equal(info.steps, sk.steps);
  assert_int_equal(info.leases_retired, sk.steps * LAYERS);
  if (route == AKV_ROUTE_ARENA) assert_true(info.bytes_d2d > 0);
  else assert_int_equal(info.bytes_d2d, 0); /* paged: retained pages read in place */
  if (route == AKV_ROUTE_PAGED) assert_true(atomic_load(&sk.rows_in_place) > 0);
  else assert_int_equal(atomic_load(&sk.rows_in_place), 0);
  assert_int_equal(akv_stream_destroy(sk.e, sk.s), AKV_OK);
  assert_int_equal(akv_engine_destroy(sk.e), AKV_OK);
  printf("soak (%s): %llu steps (seed %llu), %llu contexts admitted (%llu refused admission, %llu "
         "queued, %llu targets revoked, %llu re-admitted), %llu departed, %llu appends; %llu host "
         "rows compared with the reference at departures and at the end, 0 differ; admission "
         "counters: admit %llu, refuse %llu, release %llu, free %llu, own-reuse %llu, shrink %llu\n",
         route == AKV_ROUTE_ARENA ? "arena" : "paged", (unsigned long long)sk.steps,
         (unsigned long long)seed, (unsigned long long)sk.opens,
         (unsigned long long)sk.refused_admission, (unsigned long long)sk.refused_queue,
         (unsigned long long)sk.revokes, (unsigned long long)sk.readmits,
         (unsigned long long)sk.closes, (unsigned long long)sk.appends,
         (unsigned long long)sk.rows_compared, (unsigned long long)sk.counters[AKV_ADM_ADMIT],
         (unsigned long long)sk.counters[AKV_ADM_REFUSE],
         (unsigned long long)sk.counters[AKV_ADM_RELEASE],
         (unsigned long long)sk.counters[AKV_ADM_FREE],
         (unsigned long long)sk.counters[AKV_ADM_OWN_REUSE],
         (unsigned long long)sk.counters[AKV_ADM_SHRINK]);
}

static void test_soak_random_traffic(void **state) {
  (void)state;
  soak_run(AKV_ROUTE_ARENA);
}

/* The same traffic on the paged route: attention reads retained pages in
 * place through the page map, so a stale map or a page reused under a
 * reader shows up as a staged history that differs from the reference. */
static void test_soak_random_traffic_paged(void **state) {
  (void)state;
  soak_run(AKV_ROUTE_PAGED);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_soak_random_traffic),
      cmocka_unit_test(test_soak_random_traffic_paged),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
