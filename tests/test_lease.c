/*
 * test_lease.c - the lease state machine (DESIGN §5): every legal transition,
 * and every illegal one returns its specific status and changes nothing
 * (no backend operation is issued, the lease state is unchanged, and the
 * legal sequence still completes afterwards).
 *
 * akv_lease_try_retire: before the lease's fences pass (attention held at a
 * gate on the compute stream, the host backend injecting random delays) it
 * answers AKV_ERR_NOT_READY and changes nothing; once they pass it retires
 * with the receipt akv_lease_retire gives for the same lease.
 */
#if !defined(_GNU_SOURCE) && !defined(_DEFAULT_SOURCE)
#define _DEFAULT_SOURCE
#endif
#ifndef _POSIX_C_SOURCE
#define _POSIX_C_SOURCE 200809L
#endif
#include <setjmp.h>
#include <stdarg.h>
#include <time.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include "internal.h"
#include "testutil.h"

typedef struct fx {
  akv_engine *e;
  akv_stream s;
  akv_context *c[3];
} fx;

static int failing_hook(void *user, const akv_view *view, akv_stream stream) {
  (void)user;
  (void)view;
  (void)stream;
  return 1;
}

static uint64_t ops_total(akv_engine *e) {
  akv_engine_info info;
  uint64_t n = 0;
  assert_int_equal(akv_engine_info_get(e, &info), AKV_OK);
  for (int k = 0; k < AKV_OP_KIND_COUNT; k++) n += info.backend_ops[k];
  return n;
}

/* Asserts that `call` returns `want`, issues no backend op and leaves the
 * lease (if any) in the same state. */
#define ASSERT_REFUSED(e, ls, call, want)                                  \
  do {                                                                     \
    uint64_t ops_ = ops_total(e);                                          \
    akv_lease_state st_ = (ls) != NULL ? (ls)->body->state : AKV_LEASE_IDLE;     \
    assert_int_equal((call), (want));                                      \
    assert_int_equal(ops_total(e), ops_);                                  \
    if ((ls) != NULL) assert_int_equal((ls)->body->state, st_);                  \
  } while (0)

static int setup(void **state) {
  static fx f;
  const void *rows[3];
  static uint16_t zero[64 * 16];
  memset(&f, 0, sizeof(f));
  f.e = akvt_small_engine(AKV_ROUTE_STAGE, 0);
  assert_non_null(f.e);
  assert_int_equal(akv_stream_create(f.e, &f.s), AKV_OK);
  for (int i = 0; i < 3; i++) {
    assert_int_equal(akv_context_open(f.e, NULL, &f.c[i]), AKV_OK);
    for (int l = 0; l < 3; l++) rows[l] = zero;
    assert_int_equal(akv_context_append(f.c[i], (uint32_t)(5 + i), rows, rows), AKV_OK);
  }
  *state = &f;
  return 0;
}

static int teardown(void **state) {
  fx *f = *state;
  assert_int_equal(akv_stream_destroy(f->e, f->s), AKV_OK);
  assert_int_equal(akv_engine_destroy(f->e), AKV_OK);
  return 0;
}

/* One whole legal layer: begin, attend, write back, seal. */
static akv_lease *layer_to_sealed(fx *f, uint32_t layer) {
  akv_lease *ls = NULL;
  akv_fence attn, tail;
  assert_int_equal(akv_lease_begin(f->e, layer, &ls), AKV_OK);
  assert_int_equal(ls->body->state, AKV_LEASE_BEGUN);
  assert_int_equal(akv_lease_attend(ls, f->s, akvt_noop_hook, NULL, &attn), AKV_OK);
  assert_int_equal(ls->body->state, AKV_LEASE_CONSUMED);
  assert_int_equal(akv_lease_write_back(ls, NULL, 0, &tail), AKV_OK);
  assert_int_equal(akv_lease_seal(ls, tail, attn), AKV_OK);
  assert_int_equal(ls->body->state, AKV_LEASE_SEALED);
  return ls;
}

static void test_legal_sequence_with_receipts(void **state) {
  fx *f = *state;
  akv_lease *ls[3];
  akv_receipt r;
  assert_int_equal(akv_step_begin(f->e, f->c, 2), AKV_OK);
  ls[0] = layer_to_sealed(f, 0);
  ls[1] = layer_to_sealed(f, 1);
  assert_int_equal(akv_lease_retire(ls[0], &r), AKV_OK);
  assert_int_equal(ls[0]->body->state, AKV_LEASE_RETIRED);
  assert_int_equal(r.layer, 0);
  assert_int_equal(r.tickets, 4); /* one H2D and one D2H ticket per context */
  assert_int_equal(r.readers, 2);
  assert_int_equal(r.bytes_h2d, (5 + 6) * 2 * 32); /* rows x K/V x row_bytes */
  assert_int_equal(r.bytes_d2h, 2 * 2 * 32);
  ls[2] = layer_to_sealed(f, 2);
  assert_int_equal(akv_lease_retire(ls[1], NULL), AKV_OK);
  assert_int_equal(akv_lease_retire(ls[2], NULL), AKV_OK);
  assert_int_equal(akv_step_end(f->e), AKV_OK);
  {
    uint32_t len;
    assert_int_equal(akv_context_length(f->c[0], &len), AKV_OK);
    assert_int_equal(len, 6);
    assert_int_equal(akv_context_length(f->c[2], &len), AKV_OK);
    assert_int_equal(len, 7); /* not in the step */
  }
}

static void test_two_call_form(void **state) {
  fx *f = *state;
  akv_lease *ls;
  akv_view view;
  akv_fence attn, tail;
  assert_int_equal(akv_step_begin(f->e, f->c, 1), AKV_OK);
  for (uint32_t l = 0; l < 3; l++) {
    assert_int_equal(akv_lease_begin(f->e, l, &ls), AKV_OK);
    assert_int_equal(akv_lease_wait_ready(ls, f->s, &view), AKV_OK);
    assert_int_equal(view.layer, l);
    assert_int_equal(view.n_contexts, 1);
    assert_int_equal(view.len[0], 5);
    assert_int_equal(view.row_stride, 64); /* K and V rows of 32 B side by side */
    assert_int_equal(view.v_offset, 32);
    assert_null(view.page_map);
    assert_ptr_equal(view.contexts[0], f->c[0]);
    assert_int_equal(akv_lease_mark_consumed(ls, f->s, &attn), AKV_OK);
    assert_int_equal(akv_lease_write_back(ls, &f->c[0], 1, &tail), AKV_OK);
    assert_int_equal(akv_lease_seal(ls, tail, attn), AKV_OK);
    assert_int_equal(akv_lease_retire(ls, NULL), AKV_OK);
  }
  assert_int_equal(akv_step_end(f->e), AKV_OK);
}

static void test_begin_refusals(void **state) {
  fx *f = *state;
  akv_lease *ls = NULL, *ls1 = NULL;
  akv_view view;
  akv_fence attn, tail;
  ASSERT_REFUSED(f->e, (akv_lease *)NULL, akv_lease_begin(f->e, 0, &ls), AKV_ERR_STEP_STATE);
  assert_int_equal(akv_step_begin(f->e, f->c, 2), AKV_OK);
  ASSERT_REFUSED(f->e, (akv_lease *)NULL, akv_lease_begin(f->e, 3, &ls), AKV_ERR_INVALID_ARGUMENT);
  ASSERT_REFUSED(f->e, (akv_lease *)NULL, akv_lease_begin(f->e, 1, &ls), AKV_ERR_INVALID_ARGUMENT);
  ASSERT_REFUSED(f->e, (akv_lease *)NULL, akv_lease_begin(f->e, 0, NULL), AKV_ERR_INVALID_ARGUMENT);
  ASSERT_REFUSED(f->e, (akv_lease *)NULL, akv_lease_begin(NULL, 0, &ls), AKV_ERR_BAD_HANDLE);
  assert_int_equal(akv_lease_begin(f->e, 0, &ls), AKV_OK);
  /* previous lease begun, ready, consumed, written: never sealed -> order */
  ASSERT_REFUSED(f->e, ls, akv_lease_begin(f->e, 1, &ls1), AKV_ERR_LEASE_ORDER);
  assert_int_equal(akv_lease_wait_ready(ls, f->s, &view), AKV_OK);
  ASSERT_REFUSED(f->e, ls, akv_lease_begin(f->e, 1, &ls1), AKV_ERR_LEASE_ORDER);
  assert_int_equal(akv_lease_mark_consumed(ls, f->s, &attn), AKV_OK);
  ASSERT_REFUSED(f->e, ls, akv_lease_begin(f->e, 1, &ls1), AKV_ERR_LEASE_ORDER);
  assert_int_equal(akv_lease_write_back(ls, NULL, 0, &tail), AKV_OK);
  ASSERT_REFUSED(f->e, ls, akv_lease_begin(f->e, 1, &ls1), AKV_ERR_LEASE_ORDER);
  assert_null(ls1);
  assert_int_equal(akv_lease_seal(ls, tail, attn), AKV_OK);
  /* sealed, not retired: begin is allowed */
  assert_int_equal(akv_lease_begin(f->e, 1, &ls1), AKV_OK);
  ASSERT_REFUSED(f->e, (akv_lease *)NULL, akv_step_end(f->e), AKV_ERR_STEP_STATE);
  ASSERT_REFUSED(f->e, (akv_lease *)NULL, akv_step_begin(f->e, f->c, 1), AKV_ERR_STEP_STATE);
  ASSERT_REFUSED(f->e, (akv_lease *)NULL, akv_engine_destroy(f->e), AKV_ERR_BUSY);
  assert_int_equal(akv_lease_attend(ls1, f->s, akvt_noop_hook, NULL, &attn), AKV_OK);
  assert_int_equal(akv_lease_write_back(ls1, NULL, 0, &tail), AKV_OK);
  assert_int_equal(akv_lease_seal(ls1, tail, attn), AKV_OK);
  assert_int_equal(akv_lease_retire(ls, NULL), AKV_OK);
  assert_int_equal(akv_lease_retire(ls1, NULL), AKV_OK);
  ls = layer_to_sealed(f, 2);
  assert_int_equal(akv_lease_retire(ls, NULL), AKV_OK);
  assert_int_equal(akv_step_end(f->e), AKV_OK);
}

static void test_prior_readers_listed(void **state) {
  fx *f = *state;
  akv_lease *l0, *l1, *l2;
  assert_int_equal(akv_step_begin(f->e, f->c, 3), AKV_OK);
  l0 = layer_to_sealed(f, 0);
  l1 = layer_to_sealed(f, 1);
  /* layer 1 lists layer 0's attention and tail events (buffer 0) */
  assert_int_equal(l1->body->n_prior, 2);
  assert_ptr_equal(l1->body->prior[0].event, l0->body->ev_attn);
  assert_ptr_equal(l1->body->prior[1].event, l0->body->ev_tail);
  assert_int_equal(l1->body->prior[0].buffer, 0);
  l2 = layer_to_sealed(f, 2);
  /* layer 2 (buffer 0 again) lists layer 1's readers and carries layer 0's */
  assert_int_equal(l2->body->buffer, 0);
  assert_int_equal(l2->body->n_prior, 4);
  assert_ptr_equal(l2->body->prior[0].event, l1->body->ev_attn);
  assert_ptr_equal(l2->body->prior[1].event, l1->body->ev_tail);
  assert_ptr_equal(l2->body->prior[2].event, l0->body->ev_attn);
  assert_ptr_equal(l2->body->prior[3].event, l0->body->ev_tail);
  assert_int_equal(akv_lease_retire(l0, NULL), AKV_OK);
  assert_int_equal(akv_lease_retire(l1, NULL), AKV_OK);
  assert_int_equal(akv_lease_retire(l2, NULL), AKV_OK);
  assert_int_equal(akv_step_end(f->e), AKV_OK);
  /* next step: layer 0's predecessor is retired, so nothing is listed */
  assert_int_equal(akv_step_begin(f->e, f->c, 1), AKV_OK);
  l0 = layer_to_sealed(f, 0);
  assert_int_equal(l0->body->n_prior, 0);
  /* retired readers are not carried: layer 1 lists only layer 0's own */
  assert_int_equal(akv_lease_retire(l0, NULL), AKV_OK);
  l1 = layer_to_sealed(f, 1);
  assert_int_equal(l1->body->n_prior, 0);
  assert_int_equal(akv_lease_retire(l1, NULL), AKV_OK);
  l2 = layer_to_sealed(f, 2);
  assert_int_equal(akv_lease_retire(l2, NULL), AKV_OK);
  assert_int_equal(akv_step_end(f->e), AKV_OK);
}

static void test_attention_refusals(void **state) {
  fx *f = *state;
  akv_lease *ls;
  akv_view view;
  akv_fence attn, tail;
  akv_stream other;
  assert_int_equal(akv_stream_create(f->e, &other), AKV_OK);
  assert_int_equal(akv_step_begin(f->e, f->c, 2), AKV_OK);
  assert_int_equal(akv_lease_begin(f->e, 0, &ls), AKV_OK);
  ASSERT_REFUSED(f->e, ls, akv_lease_mark_consumed(ls, f->s, &attn), AKV_ERR_LEASE_STATE);
  ASSERT_REFUSED(f->e, ls, akv_lease_write_back(ls, NULL, 0, &tail), AKV_ERR_LEASE_STATE);
  ASSERT_REFUSED(f->e, ls, akv_lease_seal(ls, tail, attn), AKV_ERR_LEASE_STATE);
  ASSERT_REFUSED(f->e, ls, akv_lease_retire(ls, NULL), AKV_ERR_LEASE_STATE);
  ASSERT_REFUSED(f->e, ls, akv_lease_wait_ready(ls, (akv_stream)&view, &view),
                 AKV_ERR_INVALID_ARGUMENT);
  ASSERT_REFUSED(f->e, ls, akv_lease_wait_ready(ls, f->s, NULL), AKV_ERR_INVALID_ARGUMENT);
  ASSERT_REFUSED(f->e, ls, akv_lease_attend(ls, f->s, NULL, NULL, &attn), AKV_ERR_INVALID_ARGUMENT);
  ASSERT_REFUSED(f->e, ls, akv_lease_wait_ready(NULL, f->s, &view), AKV_ERR_BAD_HANDLE);
  assert_int_equal(akv_lease_wait_ready(ls, f->s, &view), AKV_OK);
  ASSERT_REFUSED(f->e, ls, akv_lease_wait_ready(ls, f->s, &view), AKV_ERR_LEASE_STATE);
  ASSERT_REFUSED(f->e, ls, akv_lease_attend(ls, f->s, akvt_noop_hook, NULL, &attn), AKV_ERR_LEASE_STATE);
  ASSERT_REFUSED(f->e, ls, akv_lease_mark_consumed(ls, other, &attn), AKV_ERR_INVALID_ARGUMENT);
  ASSERT_REFUSED(f->e, ls, akv_lease_mark_consumed(ls, f->s, NULL), AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_lease_mark_consumed(ls, f->s, &attn), AKV_OK);
  ASSERT_REFUSED(f->e, ls, akv_lease_mark_consumed(ls, f->s, &attn), AKV_ERR_LEASE_STATE);
  assert_int_equal(akv_lease_write_back(ls, NULL, 0, &tail), AKV_OK);
  assert_int_equal(akv_lease_seal(ls, tail, attn), AKV_OK);
  assert_int_equal(akv_lease_retire(ls, NULL), AKV_OK);
  for (uint32_t l = 1; l < 3; l++) assert_int_equal(akv_lease_retire(layer_to_sealed(f, l), NULL), AKV_OK);
  assert_int_equal(akv_step_end(f->e), AKV_OK);
  assert_int_equal(akv_stream_destroy(f->e, other), AKV_OK);
}

static void test_write_back_owner_rules(void **state) {
  fx *f = *state;
  akv_lease *ls;
  akv_fence attn, tail, tail2;
  akv_context *both[2];
  assert_int_equal(akv_step_begin(f->e, f->c, 2), AKV_OK);
  assert_int_equal(akv_lease_begin(f->e, 0, &ls), AKV_OK);
  assert_int_equal(akv_lease_attend(ls, f->s, akvt_noop_hook, NULL, &attn), AKV_OK);
  /* c[2] is not part of the step: a different host owner */
  ASSERT_REFUSED(f->e, ls, akv_lease_write_back(ls, &f->c[2], 1, &tail), AKV_ERR_OWNER_MISMATCH);
  both[0] = f->c[0];
  both[1] = f->c[2];
  ASSERT_REFUSED(f->e, ls, akv_lease_write_back(ls, both, 2, &tail), AKV_ERR_OWNER_MISMATCH);
  assert_int_equal(ls->body->n_written, 0); /* the valid first owner was not written either */
  both[1] = f->c[0];
  ASSERT_REFUSED(f->e, ls, akv_lease_write_back(ls, both, 2, &tail), AKV_ERR_INVALID_ARGUMENT);
  ASSERT_REFUSED(f->e, ls, akv_lease_write_back(ls, both, 0, &tail), AKV_ERR_INVALID_ARGUMENT);
  ASSERT_REFUSED(f->e, ls, akv_lease_write_back(ls, NULL, 0, NULL), AKV_ERR_INVALID_ARGUMENT);
  {
    akv_context *bogus = (akv_context *)&attn;
    ASSERT_REFUSED(f->e, ls, akv_lease_write_back(ls, &bogus, 1, &tail), AKV_ERR_BAD_HANDLE);
  }
  assert_int_equal(akv_lease_write_back(ls, &f->c[0], 1, &tail), AKV_OK);
  ASSERT_REFUSED(f->e, ls, akv_lease_write_back(ls, &f->c[0], 1, &tail2), AKV_ERR_LEASE_STATE);
  ASSERT_REFUSED(f->e, ls, akv_lease_write_back(ls, NULL, 0, &tail2), AKV_ERR_LEASE_STATE);
  /* seal before every owner is written back */
  ASSERT_REFUSED(f->e, ls, akv_lease_seal(ls, tail, attn), AKV_ERR_LEASE_STATE);
  assert_int_equal(akv_lease_write_back(ls, &f->c[1], 1, &tail2), AKV_OK);
  /* the tail moved: the earlier tail is no longer current */
  ASSERT_REFUSED(f->e, ls, akv_lease_seal(ls, tail, attn), AKV_ERR_FENCE_MISMATCH);
  assert_int_equal(akv_lease_seal(ls, tail2, attn), AKV_OK);
  assert_int_equal(akv_lease_retire(ls, NULL), AKV_OK);
  for (uint32_t l = 1; l < 3; l++) assert_int_equal(akv_lease_retire(layer_to_sealed(f, l), NULL), AKV_OK);
  assert_int_equal(akv_step_end(f->e), AKV_OK);
}

static void test_seal_substituted_fences(void **state) {
  fx *f = *state;
  akv_lease *l0, *l1;
  akv_fence attn0, tail0, attn1, tail1, forged = {12345};
  assert_int_equal(akv_step_begin(f->e, f->c, 1), AKV_OK);
  assert_int_equal(akv_lease_begin(f->e, 0, &l0), AKV_OK);
  assert_int_equal(akv_lease_attend(l0, f->s, akvt_noop_hook, NULL, &attn0), AKV_OK);
  assert_int_equal(akv_lease_write_back(l0, NULL, 0, &tail0), AKV_OK);
  ASSERT_REFUSED(f->e, l0, akv_lease_seal(l0, attn0, tail0), AKV_ERR_FENCE_MISMATCH); /* swapped */
  ASSERT_REFUSED(f->e, l0, akv_lease_seal(l0, tail0, forged), AKV_ERR_FENCE_MISMATCH);
  ASSERT_REFUSED(f->e, l0, akv_lease_seal(l0, forged, attn0), AKV_ERR_FENCE_MISMATCH);
  assert_int_equal(akv_lease_seal(l0, tail0, attn0), AKV_OK);
  ASSERT_REFUSED(f->e, l0, akv_lease_seal(l0, tail0, attn0), AKV_ERR_LEASE_STATE);
  assert_int_equal(akv_lease_begin(f->e, 1, &l1), AKV_OK);
  assert_int_equal(akv_lease_attend(l1, f->s, akvt_noop_hook, NULL, &attn1), AKV_OK);
  assert_int_equal(akv_lease_write_back(l1, NULL, 0, &tail1), AKV_OK);
  /* another lease's fences are substitutes */
  ASSERT_REFUSED(f->e, l1, akv_lease_seal(l1, tail0, attn1), AKV_ERR_FENCE_MISMATCH);
  ASSERT_REFUSED(f->e, l1, akv_lease_seal(l1, tail1, attn0), AKV_ERR_FENCE_MISMATCH);
  assert_int_equal(akv_lease_seal(l1, tail1, attn1), AKV_OK);
  assert_int_equal(akv_lease_retire(l0, NULL), AKV_OK);
  /* double retire: the handle died at the first */
  ASSERT_REFUSED(f->e, l0, akv_lease_retire(l0, NULL), AKV_ERR_BAD_HANDLE);
  assert_int_equal(akv_lease_retire(l1, NULL), AKV_OK);
  assert_int_equal(akv_lease_retire(layer_to_sealed(f, 2), NULL), AKV_OK);
  assert_int_equal(akv_step_end(f->e), AKV_OK);
}

static void test_context_rules_in_step(void **state) {
  fx *f = *state;
  uint16_t buf[16 * 8];
  const void *rows[3] = {buf, buf, buf};
  akv_context *c3, *dup[2];
  memset(buf, 0, sizeof(buf));
  dup[0] = dup[1] = f->c[0];
  ASSERT_REFUSED(f->e, (akv_lease *)NULL, akv_step_begin(f->e, dup, 2), AKV_ERR_INVALID_ARGUMENT);
  ASSERT_REFUSED(f->e, (akv_lease *)NULL, akv_step_begin(f->e, f->c, 0), AKV_ERR_INVALID_ARGUMENT);
  ASSERT_REFUSED(f->e, (akv_lease *)NULL, akv_step_begin(f->e, f->c, 5), AKV_ERR_INVALID_ARGUMENT);
  ASSERT_REFUSED(f->e, (akv_lease *)NULL, akv_step_begin(f->e, NULL, 1), AKV_ERR_INVALID_ARGUMENT);
  ASSERT_REFUSED(f->e, (akv_lease *)NULL, akv_step_end(f->e), AKV_ERR_STEP_STATE);
  assert_int_equal(akv_step_begin(f->e, f->c, 1), AKV_OK);
  ASSERT_REFUSED(f->e, (akv_lease *)NULL, akv_context_close(f->c[0]), AKV_ERR_IN_USE);
  ASSERT_REFUSED(f->e, (akv_lease *)NULL, akv_context_append(f->c[0], 1, rows, rows), AKV_ERR_IN_USE);
  ASSERT_REFUSED(f->e, (akv_lease *)NULL, akv_context_read(f->c[0], 0, 0, 1, buf, buf), AKV_ERR_IN_USE);
  ASSERT_REFUSED(f->e, (akv_lease *)NULL, akv_context_open(f->e, NULL, &c3), AKV_ERR_STEP_STATE);
  /* a context outside the step stays usable */
  assert_int_equal(akv_context_read(f->c[1], 0, 0, 1, buf, buf), AKV_OK);
  for (uint32_t l = 0; l < 3; l++) assert_int_equal(akv_lease_retire(layer_to_sealed(f, l), NULL), AKV_OK);
  assert_int_equal(akv_step_end(f->e), AKV_OK);
  ASSERT_REFUSED(f->e, (akv_lease *)NULL, akv_context_append(f->c[0], 64, rows, rows), AKV_ERR_CAPACITY);
  ASSERT_REFUSED(f->e, (akv_lease *)NULL, akv_context_read(f->c[0], 3, 0, 1, buf, buf), AKV_ERR_INVALID_ARGUMENT);
  ASSERT_REFUSED(f->e, (akv_lease *)NULL, akv_context_read(f->c[0], 0, 0, 99, buf, buf), AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_context_open(f->e, NULL, &c3), AKV_OK);
  /* all four host slots taken: refused, queue it */
  {
    akv_context *c4;
    ASSERT_REFUSED(f->e, (akv_lease *)NULL, akv_context_open(f->e, NULL, &c4), AKV_ERR_REFUSED_QUEUE);
  }
  assert_int_equal(akv_context_close(c3), AKV_OK);
  ASSERT_REFUSED(f->e, (akv_lease *)NULL, akv_context_close(c3), AKV_ERR_BAD_HANDLE);
}

static void test_failed_hook_quarantines(void **state) {
  akv_engine *e = akvt_small_engine(AKV_ROUTE_STAGE, 0);
  akv_stream s;
  akv_context *c;
  akv_lease *ls;
  akv_fence attn;
  akv_quarantine_report q;
  uint16_t buf[64];
  const void *rows[3] = {buf, buf, buf};
  (void)state;
  memset(buf, 0, sizeof(buf));
  assert_non_null(e);
  assert_int_equal(akv_stream_create(e, &s), AKV_OK);
  assert_int_equal(akv_context_open(e, NULL, &c), AKV_OK);
  assert_int_equal(akv_context_append(c, 2, rows, rows), AKV_OK);
  assert_int_equal(akv_step_begin(e, &c, 1), AKV_OK);
  assert_int_equal(akv_lease_begin(e, 0, &ls), AKV_OK);
  assert_int_equal(akv_lease_attend(ls, s, failing_hook, NULL, &attn), AKV_ERR_BACKEND);
  /* from now on: only diagnostics, quarantine and destroy */
  assert_int_equal(akv_lease_retire(ls, NULL), AKV_ERR_QUARANTINED);
  assert_int_equal(akv_step_end(e), AKV_ERR_QUARANTINED);
  assert_int_equal(akv_context_open(e, NULL, &c), AKV_ERR_QUARANTINED);
  assert_int_equal(akv_engine_destroy(e), AKV_ERR_BUSY);
  assert_string_not_equal(akv_engine_last_error(e), "");
  assert_int_equal(akv_engine_quarantine(e, &q), AKV_OK);
  assert_true(q.h2d_ok && q.d2h_ok && q.d2d_ok && q.device_ok);
  assert_int_equal(q.leases_released, 1);
  assert_int_equal(akv_context_read(c, 0, 0, 2, buf, buf + 16), AKV_OK);
  assert_int_equal(akv_stream_destroy(e, s), AKV_OK);
  assert_int_equal(akv_engine_destroy(e), AKV_OK);
}

/* FP8 rows: one byte per element through the whole lease. The engine never
 * reads an element, so only sizes change: row_bytes, the staged bytes the
 * hook sees, the receipts and the host rows read back all follow. */
typedef struct fp8_job {
  akv_view view;
  uint32_t len[2];
  int ok;
} fp8_job;

static uint8_t fp8_byte(uint32_t ctx, uint32_t layer, uint32_t t, int kv, uint32_t j) {
  return (uint8_t)(ctx * 71u + layer * 29u + t * 13u + (uint32_t)kv * 7u + j * 3u);
}

static void fp8_check_rows(void *arg) { /* runs on the compute queue */
  fp8_job *j = arg;
  const akv_view *v = &j->view;
  j->ok = v->dtype == AKV_DTYPE_FP8_E4M3 && v->v_offset == 16 && v->row_stride == 32;
  for (uint32_t i = 0; i < v->n_contexts; i++) {
    const uint32_t ctx = (uint32_t)i;
    for (uint32_t t = 0; t <= j->len[i]; t++)
      for (int kv = 0; kv < 2; kv++) {
        uint8_t *row = (uint8_t *)v->base + i * v->context_stride + (uint64_t)t * v->row_stride +
                       (kv ? v->v_offset : 0);
        for (uint32_t e = 0; e < 16; e++) {
          if (t == j->len[i]) row[e] = fp8_byte(ctx, v->layer, t, kv, e); /* the new row */
          else if (row[e] != fp8_byte(ctx, v->layer, t, kv, e)) j->ok = 0;
        }
      }
  }
}

static fp8_job fp8_jobs[3];
static akv_engine *fp8_engine;

static int fp8_hook(void *user, const akv_view *view, akv_stream stream) {
  fp8_job *j = &fp8_jobs[view->layer];
  (void)user;
  j->view = *view;
  for (uint32_t i = 0; i < view->n_contexts; i++) j->len[i] = view->len[i];
  j->view.len = j->len;
  return akv_stream_launch_host(fp8_engine, stream, fp8_check_rows, j) == AKV_OK ? 0 : 1;
}

static void test_fp8_rows(void **state) {
  (void)state;
  akv_engine_config ec = AKV_ENGINE_CONFIG_INIT;
  ec.backend = AKV_BACKEND_HOST;
  ec.n_dense_layers = 3;
  ec.kv_heads = 2;
  ec.head_dim = 8;
  ec.dtype = AKV_DTYPE_FP8_E4M3;
  ec.max_tokens = 64;
  ec.page_tokens = 8;
  ec.max_contexts = 2;
  ec.host_pool_gib = 1;
  ec.log_fn = akvt_silent_log;
  akv_engine *e = NULL;
  assert_int_equal(akv_engine_create(&ec, &e), AKV_OK);
  fp8_engine = e;
  akv_engine_info info;
  assert_int_equal(akv_engine_info_get(e, &info), AKV_OK);
  assert_int_equal(info.row_bytes, 16); /* 2 kv heads x 8 dims x 1 byte */
  akv_stream s;
  assert_int_equal(akv_stream_create(e, &s), AKV_OK);
  akv_context *c[2];
  static uint8_t k[3][6 * 16], v[3][6 * 16];
  for (uint32_t i = 0; i < 2; i++) {
    const void *kp[3], *vp[3];
    const uint32_t n = 5 + i;
    for (uint32_t l = 0; l < 3; l++) {
      for (uint32_t t = 0; t < n; t++)
        for (uint32_t x = 0; x < 16; x++) {
          k[l][t * 16 + x] = fp8_byte(i, l, t, 0, x);
          v[l][t * 16 + x] = fp8_byte(i, l, t, 1, x);
        }
      kp[l] = k[l];
      vp[l] = v[l];
    }
    assert_int_equal(akv_context_open(e, NULL, &c[i]), AKV_OK);
    assert_int_equal(akv_context_append(c[i], n, kp, vp), AKV_OK);
  }
  assert_int_equal(akv_step_begin(e, c, 2), AKV_OK);
  for (uint32_t l = 0; l < 3; l++) {
    akv_lease *ls;
    akv_fence attn, tail;
    akv_receipt r;
    assert_int_equal(akv_lease_begin(e, l, &ls), AKV_OK);
    assert_int_equal(akv_lease_attend(ls, s, fp8_hook, NULL, &attn), AKV_OK);
    assert_int_equal(akv_lease_write_back(ls, NULL, 0, &tail), AKV_OK);
    assert_int_equal(akv_lease_seal(ls, tail, attn), AKV_OK);
    assert_int_equal(akv_lease_retire(ls, &r), AKV_OK);
    assert_int_equal(r.bytes_h2d, (5 + 6) * 2 * 16); /* rows x K/V x 16 B */
    assert_int_equal(r.bytes_d2h, 2 * 2 * 16);
    assert_true(fp8_jobs[l].ok);
  }
  assert_int_equal(akv_step_end(e), AKV_OK);
  /* The host rows: the prefill and the written-back row, byte for byte. */
  for (uint32_t i = 0; i < 2; i++) {
    uint8_t hk[7 * 16], hv[7 * 16];
    uint32_t n = 0;
    assert_int_equal(akv_context_length(c[i], &n), AKV_OK);
    assert_int_equal(n, 6 + i);
    for (uint32_t l = 0; l < 3; l++) {
      assert_int_equal(akv_context_read(c[i], l, 0, n, hk, hv), AKV_OK);
      for (uint32_t t = 0; t < n; t++)
        for (uint32_t x = 0; x < 16; x++) {
          assert_int_equal(hk[t * 16 + x], fp8_byte(i, l, t, 0, x));
          assert_int_equal(hv[t * 16 + x], fp8_byte(i, l, t, 1, x));
        }
    }
    assert_int_equal(akv_context_close(c[i]), AKV_OK);
  }
  assert_int_equal(akv_stream_destroy(e, s), AKV_OK);
  assert_int_equal(akv_engine_destroy(e), AKV_OK);
}

/* ------------------------------------------------------------ try_retire */

typedef struct tr_gate {
  akv_engine *e;
  atomic_int open;
  atomic_int passed;
} tr_gate;

static double tr_now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

/* Runs on the compute stream: blocks until the test opens the gate (at most
 * 10 s, so a broken engine fails the test instead of hanging it). */
static void tr_gate_fn(void *arg) {
  tr_gate *g = arg;
  struct timespec ms = {0, 1000000L};
  double end = tr_now_ms() + 10000.0;
  while (!atomic_load(&g->open) && tr_now_ms() < end) nanosleep(&ms, NULL);
  atomic_store(&g->passed, 1);
}

/* Attention hook: holds the compute stream at the gate, if any. */
static int tr_gate_hook(void *user, const akv_view *view, akv_stream stream) {
  tr_gate *g = user;
  (void)view;
  if (g == NULL) return 0;
  return akv_stream_launch_host(g->e, stream, tr_gate_fn, g) == AKV_OK ? 0 : 1;
}

/* A host engine of the small geometry, with injected delays on its queues. */
static akv_engine *tr_engine(void) {
  akv_engine_config ec = AKV_ENGINE_CONFIG_INIT;
  akv_engine *e = NULL;
  ec.backend = AKV_BACKEND_HOST;
  ec.n_dense_layers = 3;
  ec.kv_heads = 2;
  ec.head_dim = 8;
  ec.max_tokens = 64;
  ec.page_tokens = 8;
  ec.max_contexts = 4;
  ec.host_pool_gib = 1;
  ec.log_fn = akvt_silent_log;
  ec.host_delay_seed = 0x5eed;
  ec.host_delay_max_us = 200;
  assert_int_equal(akv_engine_create(&ec, &e), AKV_OK);
  return e;
}

typedef struct tr_fx {
  akv_engine *e;
  akv_stream s;
  akv_context *c[2];
} tr_fx;

static void tr_open(tr_fx *f) {
  static uint16_t rows[64 * 16];
  const void *rp[3] = {rows, rows, rows};
  for (uint32_t i = 0; i < 64 * 16; i++) rows[i] = (uint16_t)(i * 7u);
  f->e = tr_engine();
  assert_int_equal(akv_stream_create(f->e, &f->s), AKV_OK);
  for (int i = 0; i < 2; i++) {
    assert_int_equal(akv_context_open(f->e, NULL, &f->c[i]), AKV_OK);
    assert_int_equal(akv_context_append(f->c[i], (uint32_t)(9 + i), rp, rp), AKV_OK);
  }
  assert_int_equal(akv_step_begin(f->e, f->c, 2), AKV_OK);
}

static akv_lease *tr_layer(tr_fx *f, uint32_t layer, tr_gate *g) {
  akv_lease *ls = NULL;
  akv_fence attn, tail;
  assert_int_equal(akv_lease_begin(f->e, layer, &ls), AKV_OK);
  assert_int_equal(akv_lease_attend(ls, f->s, tr_gate_hook, g, &attn), AKV_OK);
  assert_int_equal(akv_lease_write_back(ls, NULL, 0, &tail), AKV_OK);
  assert_int_equal(akv_lease_seal(ls, tail, attn), AKV_OK);
  return ls;
}

static void tr_close(tr_fx *f) {
  for (int i = 0; i < 2; i++) assert_int_equal(akv_context_close(f->c[i]), AKV_OK);
  assert_int_equal(akv_stream_destroy(f->e, f->s), AKV_OK);
  assert_int_equal(akv_engine_destroy(f->e), AKV_OK);
}

static void test_try_retire(void **state) {
  tr_fx f, twin;
  tr_gate g;
  akv_lease *ls[3], *tw[3];
  akv_receipt r, want, poison;
  akv_engine_info before, after;
  uint32_t hl0, live0, n_tickets0;
  char err0[sizeof(((akv_engine *)0)->last_error)];
  (void)state;
  memset(&g, 0, sizeof(g));
  memset(&poison, 0xAB, sizeof(poison));

  /* The twin runs the same step with the blocking retire: the reference
   * receipts (fence serials aside: they are unique in the process, so
   * each engine's receipts name its own fences). */
  tr_open(&twin);
  tw[0] = tr_layer(&twin, 0, NULL);
  tw[1] = tr_layer(&twin, 1, NULL);
  tw[2] = tr_layer(&twin, 2, NULL);

  tr_open(&f);
  g.e = f.e;
  ls[0] = tr_layer(&f, 0, &g); /* attention of layer 0 held at the gate */

  /* Refusals: a bad handle, a lease that is not sealed. */
  assert_int_equal(akv_lease_try_retire(NULL, &r), AKV_ERR_BAD_HANDLE);
  {
    akv_lease *open_ls = NULL;
    akv_fence attn;
    assert_int_equal(akv_lease_begin(f.e, 1, &open_ls), AKV_OK);
    ASSERT_REFUSED(f.e, open_ls, akv_lease_try_retire(open_ls, &r), AKV_ERR_LEASE_STATE);
    assert_int_equal(akv_lease_attend(open_ls, f.s, tr_gate_hook, NULL, &attn), AKV_OK);
    ASSERT_REFUSED(f.e, open_ls, akv_lease_try_retire(open_ls, &r), AKV_ERR_LEASE_STATE);
    {
      akv_fence tail;
      assert_int_equal(akv_lease_write_back(open_ls, NULL, 0, &tail), AKV_OK);
      assert_int_equal(akv_lease_seal(open_ls, tail, attn), AKV_OK);
    }
    ls[1] = open_ls;
  }

  /* Before the fences pass: not ready, and nothing changed. */
  assert_int_equal(akv_engine_info_get(f.e, &before), AKV_OK);
  hl0 = f.c[0]->host_leases;
  live0 = f.e->leases_live;
  n_tickets0 = ls[0]->body->n_tickets;
  memcpy(err0, f.e->last_error, sizeof(err0));
  for (int k = 0; k < 50; k++) {
    r = poison;
    assert_int_equal(akv_lease_try_retire(ls[0], &r), AKV_ERR_NOT_READY);
    assert_memory_equal(&r, &poison, sizeof(r));
    assert_int_equal(akv_lease_try_retire(ls[1], &r), AKV_ERR_NOT_READY); /* behind ls[0] */
  }
  assert_int_equal(atomic_load(&g.passed), 0); /* the gate really was closed */
  assert_int_equal(ls[0]->body->state, AKV_LEASE_SEALED);
  assert_int_equal(ls[1]->body->state, AKV_LEASE_SEALED);
  assert_int_equal(ls[0]->body->n_tickets, n_tickets0);
  assert_int_equal(f.c[0]->host_leases, hl0);
  assert_int_equal(f.e->leases_live, live0);
  assert_memory_equal(f.e->last_error, err0, sizeof(err0));
  assert_int_equal(akv_engine_info_get(f.e, &after), AKV_OK);
  assert_int_equal(after.leases_retired, before.leases_retired);
  assert_int_equal(after.transport_failed, 0);
  /* Queries only: nothing enqueued, waited on or synchronised. */
  for (int k = 0; k < AKV_OP_KIND_COUNT; k++)
    if (k != AKV_OP_QUERY) assert_int_equal(after.backend_ops[k], before.backend_ops[k]);
  assert_true(after.backend_ops[AKV_OP_QUERY] > before.backend_ops[AKV_OP_QUERY]);
  assert_true(after.backend_ops[AKV_OP_QUERY] - before.backend_ops[AKV_OP_QUERY] <= 100);
  /* A live lease: the step cannot end yet, the layer goes on normally. */
  ASSERT_REFUSED(f.e, ls[0], akv_step_end(f.e), AKV_ERR_STEP_STATE);
  ls[2] = tr_layer(&f, 2, NULL);

  /* Open the gate: every fence passes; try_retire then retires. */
  akv_lease_body *body[3] = {ls[0]->body, ls[1]->body, ls[2]->body};
  atomic_store(&g.open, 1);
  for (uint32_t l = 0; l < 3; l++) {
    akv_status st;
    double end = tr_now_ms() + 10000.0;
    r = poison;
    while ((st = akv_lease_try_retire(ls[l], &r)) == AKV_ERR_NOT_READY && tr_now_ms() < end) {
      struct timespec us = {0, 100000L};
      assert_memory_equal(&r, &poison, sizeof(r));
      nanosleep(&us, NULL);
    }
    assert_int_equal(st, AKV_OK);
    assert_int_equal(body[l]->state, AKV_LEASE_RETIRED);
    assert_int_equal(akv_lease_retire(tw[l], &want), AKV_OK);
    /* the receipt retire gives, naming this lease's own fences */
    assert_int_equal(r.attention.serial, body[l]->fence_attn);
    assert_int_equal(r.tail.serial, body[l]->fence_tail);
    want.attention = r.attention;
    want.tail = r.tail;
    assert_memory_equal(&r, &want, sizeof(r));
    /* Retired: the handle is dead, a second try is refused like a double
     * retire and issues nothing. */
    ASSERT_REFUSED(f.e, (akv_lease *)NULL, akv_lease_try_retire(ls[l], &r), AKV_ERR_BAD_HANDLE);
  }
  assert_int_equal(f.c[0]->host_leases, 0);
  assert_int_equal(f.e->leases_live, 0);
  assert_int_equal(akv_step_end(f.e), AKV_OK);
  assert_int_equal(akv_step_end(twin.e), AKV_OK);
  {
    uint8_t k1[64], v1[64], k2[64], v2[64];
    for (uint32_t l = 0; l < 3; l++) {
      assert_int_equal(akv_context_read(f.c[1], l, 0, 2, k1, v1), AKV_OK);
      assert_int_equal(akv_context_read(twin.c[1], l, 0, 2, k2, v2), AKV_OK);
      assert_memory_equal(k1, k2, sizeof(k1));
      assert_memory_equal(v1, v2, sizeof(v1));
    }
  }
  tr_close(&f);
  tr_close(&twin);
}

/* The chain invariant (lease.c, above akv_lease_finish): a lease's tail
 * passes last, so try_retire proves a lease with one query of it and retire
 * with one wait on it, ready or not (akv.h). Each try below issues exactly
 * one query and nothing else; the retire exactly one synchronise; and the
 * gated lease answers not ready through that one query while its attention
 * (and so its tail) is held. */
static void test_retire_proves_by_the_tail(void **state) {
  tr_fx f;
  tr_gate g;
  akv_lease *ls[3];
  akv_engine_info a, b;
  akv_status st;
  (void)state;
  memset(&g, 0, sizeof(g));
  tr_open(&f);
  g.e = f.e;
  ls[0] = tr_layer(&f, 0, &g); /* attention held: neither it nor the tail can pass */
  ls[1] = tr_layer(&f, 1, NULL);
  ls[2] = tr_layer(&f, 2, NULL);
  for (int k = 0; k < 20; k++) {
    assert_int_equal(akv_engine_info_get(f.e, &a), AKV_OK);
    assert_int_equal(akv_lease_try_retire(ls[0], NULL), AKV_ERR_NOT_READY);
    assert_int_equal(akv_engine_info_get(f.e, &b), AKV_OK);
    for (int op = 0; op < AKV_OP_KIND_COUNT; op++)
      assert_int_equal(b.backend_ops[op] - a.backend_ops[op], op == AKV_OP_QUERY ? 1 : 0);
  }
  assert_int_equal(atomic_load(&g.passed), 0);
  atomic_store(&g.open, 1);
  {
    double end = tr_now_ms() + 10000.0;
    do {
      assert_int_equal(akv_engine_info_get(f.e, &a), AKV_OK);
      st = akv_lease_try_retire(ls[0], NULL);
      assert_int_equal(akv_engine_info_get(f.e, &b), AKV_OK);
      for (int op = 0; op < AKV_OP_KIND_COUNT; op++)
        assert_int_equal(b.backend_ops[op] - a.backend_ops[op], op == AKV_OP_QUERY ? 1 : 0);
    } while (st == AKV_ERR_NOT_READY && tr_now_ms() < end);
  }
  assert_int_equal(st, AKV_OK);
  assert_int_equal(atomic_load(&g.passed), 1); /* retired only after the attention ran */
  assert_int_equal(akv_engine_info_get(f.e, &a), AKV_OK);
  assert_int_equal(akv_lease_retire(ls[1], NULL), AKV_OK);
  assert_int_equal(akv_engine_info_get(f.e, &b), AKV_OK);
  for (int op = 0; op < AKV_OP_KIND_COUNT; op++)
    assert_int_equal(b.backend_ops[op] - a.backend_ops[op], op == AKV_OP_SYNC ? 1 : 0);
  assert_int_equal(akv_lease_retire(ls[2], NULL), AKV_OK);
  assert_int_equal(akv_step_end(f.e), AKV_OK);
  tr_close(&f);
}

/* After a transport failure (and the quarantine that releases its leases)
 * try_retire refuses the lease as a dead handle, like retire. */
static void test_try_retire_after_failure(void **state) {
  akv_engine *e = akvt_small_engine(AKV_ROUTE_STAGE, 0);
  akv_stream s;
  akv_context *c;
  akv_lease *ls;
  akv_fence attn, tail;
  akv_quarantine_report q;
  uint16_t buf[64];
  const void *rows[3] = {buf, buf, buf};
  (void)state;
  memset(buf, 0, sizeof(buf));
  assert_non_null(e);
  assert_int_equal(akv_stream_create(e, &s), AKV_OK);
  assert_int_equal(akv_context_open(e, NULL, &c), AKV_OK);
  assert_int_equal(akv_context_append(c, 2, rows, rows), AKV_OK);
  assert_int_equal(akv_step_begin(e, &c, 1), AKV_OK);
  assert_int_equal(akv_lease_begin(e, 0, &ls), AKV_OK);
  assert_int_equal(akv_lease_attend(ls, s, akvt_noop_hook, NULL, &attn), AKV_OK);
  assert_int_equal(akv_lease_write_back(ls, NULL, 0, &tail), AKV_OK);
  assert_int_equal(akv_lease_seal(ls, tail, attn), AKV_OK);
  assert_int_equal(akv_engine_quarantine(e, &q), AKV_OK);
  /* quarantine released the lease: its handle is dead, like a retired one */
  assert_int_equal(akv_lease_try_retire(ls, NULL), AKV_ERR_BAD_HANDLE);
  assert_int_equal(akv_stream_destroy(e, s), AKV_OK);
  assert_int_equal(akv_engine_destroy(e), AKV_OK);
}


int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup_teardown(test_legal_sequence_with_receipts, setup, teardown),
      cmocka_unit_test(test_fp8_rows),
      cmocka_unit_test_setup_teardown(test_two_call_form, setup, teardown),
      cmocka_unit_test_setup_teardown(test_begin_refusals, setup, teardown),
      cmocka_unit_test_setup_teardown(test_prior_readers_listed, setup, teardown),
      cmocka_unit_test_setup_teardown(test_attention_refusals, setup, teardown),
      cmocka_unit_test_setup_teardown(test_write_back_owner_rules, setup, teardown),
      cmocka_unit_test_setup_teardown(test_seal_substituted_fences, setup, teardown),
      cmocka_unit_test_setup_teardown(test_context_rules_in_step, setup, teardown),
      cmocka_unit_test(test_failed_hook_quarantines),
      cmocka_unit_test(test_try_retire),
      cmocka_unit_test(test_try_retire_after_failure),
      cmocka_unit_test(test_retire_proves_by_the_tail),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
