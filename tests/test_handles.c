/*
 * test_handles.c - the reuse bound of handle records (akv.h, "Handle
 * lifetimes"; records.h), checked exactly: a dead handle is refused for
 * every hand-out the FIFO puts ahead of it, at least the stated minimum, and
 * comes back on exactly the next one (the bound is tight, not a guess).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "akv_group.h"
#include "internal.h"
#include "records.h"
#include "testutil.h"

static akv_engine *engine(void) {
  akv_engine *e = akvt_small_engine(AKV_ROUTE_STAGE, 0);
  assert_non_null(e);
  return e;
}

/* Engines: a destroyed handle is refused by the next `ahead` creates (the
 * free records queued before it, at least AKV_ENGINE_HANDLE_REUSE_MIN) and
 * is handed out again by the one after. A failed create does not count. */
static void test_engine_record_reuse_is_exactly_fifo(void **state) {
  akv_engine *old = engine(), *e;
  akv_engine_info info;
  akv_engine_config bad = AKV_ENGINE_CONFIG_INIT;
  size_t ahead;
  (void)state;
  ahead = akv_rec_free_count(&akv_engine_records);
  assert_int_equal(akv_engine_destroy(old), AKV_OK);
  assert_true(ahead >= AKV_ENGINE_HANDLE_REUSE_MIN);
  for (size_t k = 0; k < ahead; k++) {
    e = engine();
    assert_ptr_not_equal(e, old);
    assert_int_equal(akv_engine_info_get(old, &info), AKV_ERR_BAD_HANDLE);
    assert_int_equal(akv_engine_destroy(e), AKV_OK);
    /* a create that fails after its record was taken (an injected fault
     * at its first backend allocation) takes no turn */
    bad.backend = AKV_BACKEND_HOST;
    bad.n_dense_layers = 1;
    bad.kv_heads = 1;
    bad.head_dim = 1;
    bad.max_tokens = 1;
    bad.page_tokens = 1;
    bad.host_pool_gib = 1;
    bad.log_fn = akvt_silent_log;
    bad.fault_fail_nth = 1;
    bad.fault_kind = AKV_OP_ALLOC;
    e = NULL;
    assert_int_not_equal(akv_engine_create(&bad, &e), AKV_OK);
    assert_null(e);
  }
  e = engine();
  assert_ptr_equal(e, old); /* the record came back: the bound is exact */
  assert_int_equal(akv_engine_info_get(old, &info), AKV_OK);
  assert_int_equal(akv_engine_destroy(e), AKV_OK);
}

/* Contexts: the same over the process-wide pool, whatever stays open. */
static void test_context_record_reuse_is_exactly_fifo(void **state) {
  akv_engine *e = engine();
  akv_context *keep[3], *old = NULL, *c = NULL;
  uint32_t len;
  size_t ahead;
  (void)state;
  assert_int_equal(akv_context_open(e, NULL, &old), AKV_OK);
  for (int i = 0; i < 3; i++) assert_int_equal(akv_context_open(e, NULL, &keep[i]), AKV_OK);
  ahead = akv_rec_free_count(&akv_context_records);
  assert_int_equal(akv_context_close(old), AKV_OK);
  assert_true(ahead >= AKV_CONTEXT_HANDLE_REUSE_MIN);
  for (size_t k = 0; k < ahead; k++) {
    assert_int_equal(akv_context_open(e, NULL, &c), AKV_OK);
    assert_ptr_not_equal(c, old);
    assert_int_equal(akv_context_length(old, &len), AKV_ERR_BAD_HANDLE);
    assert_int_equal(akv_context_close(c), AKV_OK);
  }
  assert_int_equal(akv_context_open(e, NULL, &c), AKV_OK);
  assert_ptr_equal(c, old);
  assert_int_equal(akv_context_close(c), AKV_OK);
  for (int i = 0; i < 3; i++) assert_int_equal(akv_context_close(keep[i]), AKV_OK);
  assert_int_equal(akv_engine_destroy(e), AKV_OK);
}

static void noop(void *arg) { (void)arg; }
static int hook(void *user, const akv_view *view, akv_stream s) {
  (void)view;
  return akv_stream_launch_host((akv_engine *)user, s, noop, NULL) == AKV_OK ? 0 : 1;
}

static akv_status seal(akv_engine *e, akv_stream s, akv_lease *ls) {
  akv_fence attn, tail;
  akv_status st = akv_lease_attend(ls, s, hook, e, &attn);
  if (st == AKV_OK) st = akv_lease_write_back(ls, NULL, 0, &tail);
  if (st == AKV_OK) st = akv_lease_seal(ls, tail, attn);
  return st;
}

/* Leases, in the worst case the header states: every layer's lease is
 * unretired when the first one retires, so its handle has
 * (AKV_LEASE_HANDLES_PER_LAYER - 1) x layers free records ahead: refused by
 * that many later begins, handed out again by the next. */
static void test_lease_record_reuse_is_exactly_fifo(void **state) {
  akv_engine *e = engine();
  akv_context *c = NULL;
  akv_stream s = NULL;
  akv_lease *ls[3], *old;
  akv_receipt r;
  const uint32_t layers = 3;
  uint32_t begins = 0, back_at = 0;
  const uint32_t ahead = (AKV_LEASE_HANDLES_PER_LAYER - 1) * layers;
  (void)state;
  assert_int_equal(akv_stream_create(e, &s), AKV_OK);
  assert_int_equal(akv_context_open(e, NULL, &c), AKV_OK);
  assert_int_equal(akv_step_begin(e, &c, 1), AKV_OK);
  for (uint32_t l = 0; l < layers; l++) {
    assert_int_equal(akv_lease_begin(e, l, &ls[l]), AKV_OK);
    assert_int_equal(seal(e, s, ls[l]), AKV_OK);
  }
  old = ls[0];
  assert_int_equal(e->lease_free, AKV_LEASE_HANDLES_PER_LAYER * layers - layers);
  for (uint32_t l = 0; l < layers; l++) assert_int_equal(akv_lease_retire(ls[l], NULL), AKV_OK);
  assert_int_equal(akv_step_end(e), AKV_OK);
  for (;;) {
    akv_lease *now = NULL;
    assert_int_equal(akv_step_begin(e, &c, 1), AKV_OK);
    for (uint32_t l = 0; l < layers; l++) {
      assert_int_equal(akv_lease_begin(e, l, &now), AKV_OK);
      begins++;
      if (begins <= ahead) {
        assert_ptr_not_equal(now, old);
        assert_int_equal(akv_lease_retire(old, &r), AKV_ERR_BAD_HANDLE);
      } else if (begins == ahead + 1) {
        assert_ptr_equal(now, old); /* begin ahead + 1: back, as a new lease */
        back_at = begins;
      }
      assert_int_equal(seal(e, s, now), AKV_OK);
      assert_int_equal(akv_lease_retire(now, NULL), AKV_OK);
    }
    assert_int_equal(akv_step_end(e), AKV_OK);
    if (begins > ahead) break;
  }
  assert_int_equal(back_at, ahead + 1); /* layer 0 of the 17th step: 3 x 15 + 1 */
  assert_int_equal(akv_context_close(c), AKV_OK);
  assert_int_equal(akv_stream_destroy(e, s), AKV_OK);
  assert_int_equal(akv_engine_destroy(e), AKV_OK);
}

/* A destroyed engine's lease handles go back to the process-wide pool, at
 * its tail: dead for at least AKV_LEASE_HANDLE_REUSE_MIN records handed to
 * later engines. */
static void test_lease_records_of_a_destroyed_engine_queue_behind_the_pool(void **state) {
  akv_engine *e = engine();
  akv_context *c = NULL;
  akv_stream s = NULL;
  akv_lease *ls = NULL;
  size_t ahead;
  (void)state;
  assert_int_equal(akv_stream_create(e, &s), AKV_OK);
  assert_int_equal(akv_context_open(e, NULL, &c), AKV_OK);
  assert_int_equal(akv_step_begin(e, &c, 1), AKV_OK);
  for (uint32_t l = 0; l < 3; l++) {
    assert_int_equal(akv_lease_begin(e, l, &ls), AKV_OK);
    assert_int_equal(seal(e, s, ls), AKV_OK);
    assert_int_equal(akv_lease_retire(ls, NULL), AKV_OK);
  }
  assert_int_equal(akv_step_end(e), AKV_OK);
  assert_int_equal(akv_stream_destroy(e, s), AKV_OK);
  ahead = akv_rec_free_count(&akv_lease_records);
  assert_true(ahead >= AKV_LEASE_HANDLE_REUSE_MIN);
  assert_int_equal(akv_engine_destroy(e), AKV_OK);
  assert_ptr_equal(akv_lease_resolve(ls), NULL);
  for (size_t k = 0; k < ahead; k++) {
    void *rec = akv_rec_take(&akv_lease_records);
    assert_ptr_not_equal(rec, ls);
    akv_rec_give(&akv_lease_records, rec);
  }
  assert_int_equal(akv_lease_seal(ls, (akv_fence){0}, (akv_fence){0}), AKV_ERR_BAD_HANDLE);
}

/* A CUDA engine refuses any handle of this library passed as its compute
 * stream (akv.h, akv_stream; the check is akv_stream_queue's, by
 * akv_rec_any_handle). Groups and worlds live in the group layer's pools,
 * which the core knows only once registered: every one of them must be
 * known as a handle from its create on (also a destroyed one, whose record
 * stays), and memory that is no record must not be. */
static void test_group_handles_are_library_handles(void **state) {
  (void)state;
  akv_engine_config shard = AKV_ENGINE_CONFIG_INIT;
  akv_group_config gc = AKV_GROUP_CONFIG_INIT;
  akv_group_world *world = NULL;
  akv_group *group = NULL;
  int local = 0;
  void *heap = malloc(64);
  assert_non_null(heap);
  shard.n_dense_layers = 2;
  shard.kv_heads = 2;
  shard.head_dim = 64;
  shard.max_tokens = 512;
  shard.page_tokens = 256;
  shard.max_contexts = 1;
  shard.host_pool_gib = 1;
  shard.route = AKV_ROUTE_STAGE;
  shard.log_level = AKV_LOG_ERROR;
  assert_int_equal(akv_group_world_create(1, 1, &world), AKV_OK);
  assert_true(akv_rec_any_handle(world));
  assert_int_equal(akv_group_create_inproc(&shard, &gc, world, &group), AKV_OK);
  assert_true(akv_rec_any_handle(group));
  assert_true(akv_rec_any_handle((const char *)group + 8)); /* inside the record */
  akv_engine *eng = NULL;
  assert_int_equal(akv_group_engine(group, &eng), AKV_OK);
  assert_true(akv_rec_any_handle(eng));
  assert_false(akv_rec_any_handle(heap));
  assert_false(akv_rec_any_handle(&local));
  assert_false(akv_rec_any_handle(NULL));
  assert_int_equal(akv_group_destroy(group), AKV_OK);
  assert_int_equal(akv_group_world_destroy(world), AKV_OK);
  assert_true(akv_rec_any_handle(group)); /* dead, still never a stream */
  assert_true(akv_rec_any_handle(world));
  free(heap);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_engine_record_reuse_is_exactly_fifo),
      cmocka_unit_test(test_context_record_reuse_is_exactly_fifo),
      cmocka_unit_test(test_lease_record_reuse_is_exactly_fifo),
      cmocka_unit_test(test_lease_records_of_a_destroyed_engine_queue_behind_the_pool),
      cmocka_unit_test(test_group_handles_are_library_handles),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
