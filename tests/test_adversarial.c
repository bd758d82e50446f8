/*
 * test_adversarial.c - hostile call sequences against the newest entry
 * points on the host backend: headroom release/take/get in every state,
 * uneven per-layer appends, try_retire, older config structs, FP8 dtypes
 * and akv_fit on hostile configs. Every illegal call returns its documented
 * status and changes nothing.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "akv_group.h"
#include "internal.h"
#include "testutil.h"

static akv_engine_config base_cfg(akv_route route, akv_dtype dtype) {
  akv_engine_config ec = AKV_ENGINE_CONFIG_INIT;
  ec.backend = AKV_BACKEND_HOST;
  ec.n_dense_layers = 3;
  ec.kv_heads = 2;
  ec.head_dim = 8;
  ec.dtype = dtype;
  ec.max_tokens = 96;
  ec.page_tokens = 8;
  ec.max_contexts = 2;
  ec.host_pool_gib = 1;
  ec.route = route;
  ec.log_fn = akvt_silent_log;
  return ec;
}

/* An engine with `pages` headroom pages in chunks of chunk pages. */
static akv_engine *hr_engine(akv_route route, uint32_t pages, uint32_t chunk, uint32_t fail_nth,
                             int32_t fault_kind) {
  akv_engine_config ec = base_cfg(route, AKV_DTYPE_BF16);
  akv_engine *e = NULL;
  akv_engine_info info;
  ec.headroom_gib = 1;
  ec.headroom_chunk_pages = chunk;
  assert_int_equal(akv_engine_create(&ec, &e), AKV_OK);
  assert_int_equal(akv_engine_info_get(e, &info), AKV_OK);
  assert_int_equal(akv_engine_destroy(e), AKV_OK);
  ec.host_fake_free_bytes = info.device_bytes_allocated + (uint64_t)pages * info.page_bytes +
                            (route == AKV_ROUTE_PAGED ? 2 * info.page_bytes : 0);
  ec.fault_fail_nth = fail_nth;
  ec.fault_kind = fault_kind;
  assert_int_equal(akv_engine_create(&ec, &e), AKV_OK);
  return e;
}

static void fill(akv_context *c, uint32_t layers, uint32_t n, uint32_t row_bytes) {
  uint8_t *k = malloc((size_t)n * row_bytes), *v = malloc((size_t)n * row_bytes);
  for (uint32_t i = 0; i < n * row_bytes; i++) {
    k[i] = (uint8_t)(i * 7u + 1u);
    v[i] = (uint8_t)(i * 13u + 3u);
  }
  for (uint32_t l = 0; l < layers; l++)
    assert_int_equal(akv_context_append_layer(c, l, n, k, v), AKV_OK);
  free(k);
  free(v);
}

/* One whole step of every layer, leases retired. */
static void run_step(akv_engine *e, akv_stream s, akv_context *const *c, uint32_t n,
                     uint32_t layers) {
  assert_int_equal(akv_step_begin(e, c, n), AKV_OK);
  assert_int_equal(akvt_null_layers(e, s, layers), AKV_OK);
}

/** Release twice, take beyond the profile, take after release, bytes 0 / 1 / UINT64_MAX. */
static void test_headroom_release_take_repeated(void **state) {
  (void)state;
  akv_engine *e = hr_engine(AKV_ROUTE_ARENA, 8, 2, 0, -1);
  akv_headroom_info a, b;
  uint64_t freed = 77, pend = 77, taken = 77;
  assert_int_equal(akv_headroom_get(e, &a), AKV_OK);
  assert_int_equal(a.pages, 8);
  assert_int_equal(akv_headroom_release(e, 0, &freed, &pend), AKV_OK);
  assert_int_equal(freed, 0);
  assert_int_equal(pend, 0);
  assert_int_equal(akv_headroom_get(e, &b), AKV_OK);
  assert_memory_equal(&a, &b, sizeof a);
  assert_int_equal(akv_headroom_release(e, 1, &freed, NULL), AKV_OK);
  assert_true(freed > 0);
  assert_int_equal(akv_headroom_get(e, &b), AKV_OK);
  assert_int_equal(b.pages, 6);
  assert_int_equal(b.releases, 1);
  assert_int_equal(akv_headroom_release(e, UINT64_MAX, &freed, &pend), AKV_OK);
  assert_int_equal(akv_headroom_get(e, &b), AKV_OK);
  assert_int_equal(b.pages, 0);
  assert_int_equal(b.bytes, 0);
  assert_int_equal(b.releases, 2);
  /* Twice: nothing left, nothing counted. */
  assert_int_equal(akv_headroom_release(e, UINT64_MAX, &freed, &pend), AKV_OK);
  assert_int_equal(freed, 0);
  assert_int_equal(akv_headroom_get(e, &a), AKV_OK);
  assert_memory_equal(&a, &b, sizeof a);
  /* Take beyond the profile: never past max_pages. */
  assert_int_equal(akv_headroom_take(e, UINT64_MAX, &taken), AKV_OK);
  assert_int_equal(akv_headroom_get(e, &b), AKV_OK);
  assert_int_equal(b.pages, 8);
  assert_int_equal(b.takes, 1);
  assert_int_equal(akv_headroom_take(e, UINT64_MAX, &taken), AKV_OK);
  assert_int_equal(taken, 0);
  assert_int_equal(akv_headroom_get(e, &a), AKV_OK);
  assert_memory_equal(&a, &b, sizeof a);
  assert_int_equal(akv_headroom_take(e, 0, NULL), AKV_OK);
  assert_int_equal(akv_engine_destroy(e), AKV_OK);
  /* Dead engine. */
  assert_int_equal(akv_headroom_get(e, &a), AKV_ERR_BAD_HANDLE);
  assert_int_equal(akv_headroom_release(e, 1, NULL, NULL), AKV_ERR_BAD_HANDLE);
  assert_int_equal(akv_headroom_take(e, 1, NULL), AKV_ERR_BAD_HANDLE);
  assert_int_equal(akv_headroom_get(NULL, &a), AKV_ERR_BAD_HANDLE);
  assert_int_equal(akv_headroom_release(NULL, 1, NULL, NULL), AKV_ERR_BAD_HANDLE);
  assert_int_equal(akv_headroom_take(NULL, 1, NULL), AKV_ERR_BAD_HANDLE);
}

/** Mid-step: release pending, release again, take refused, step_end frees. */
static void test_headroom_mid_step(void **state) {
  (void)state;
  for (int route = AKV_ROUTE_ARENA; route <= AKV_ROUTE_PAGED; route++) {
    akv_engine *e = hr_engine((akv_route)route, 8, 2, 0, -1);
    akv_stream s;
    akv_context *c[2];
    akv_headroom_info a, b;
    uint64_t freed = 5, pend = 5, taken = 5;
    assert_int_equal(akv_stream_create(e, &s), AKV_OK);
    for (int i = 0; i < 2; i++) {
      assert_int_equal(akv_context_open(e, NULL, &c[i]), AKV_OK);
      fill(c[i], 3, 40, e->row_bytes);
    }
    run_step(e, s, c, 2, 3);
    assert_int_equal(akv_step_begin(e, c, 2), AKV_OK);
    assert_int_equal(akv_headroom_release(e, 1, &freed, &pend), AKV_OK);
    assert_int_equal(freed, 0);
    assert_true(pend > 0);
    assert_int_equal(akv_headroom_release(e, UINT64_MAX, &freed, &pend), AKV_OK);
    assert_int_equal(akv_headroom_get(e, &a), AKV_OK);
    assert_true(a.max_pages >= 4);
    assert_int_equal(a.pages_pending, a.max_pages);
    assert_int_equal(a.pages, a.max_pages);
    /* Take refused, *taken untouched, nothing changed. */
    assert_int_equal(akv_headroom_take(e, UINT64_MAX, &taken), AKV_ERR_STEP_STATE);
    assert_int_equal(taken, 5);
    assert_int_equal(akv_headroom_get(e, &b), AKV_OK);
    assert_memory_equal(&a, &b, sizeof a);
    /* Once more: nothing more to mark. */
    assert_int_equal(akv_headroom_release(e, UINT64_MAX, &freed, &pend), AKV_OK);
    assert_int_equal(pend, 0);
    for (uint32_t l = 0; l < 3; l++) {
      akv_lease *ls = NULL;
      akv_fence attn, tail;
      akv_receipt r;
      assert_int_equal(akv_lease_begin(e, l, &ls), AKV_OK);
      assert_int_equal(akv_lease_try_retire(ls, &r), AKV_ERR_LEASE_STATE);
      assert_int_equal(akv_lease_attend(ls, s, akvt_noop_hook, NULL, &attn), AKV_OK);
      assert_int_equal(akv_lease_write_back(ls, NULL, 0, &tail), AKV_OK);
      assert_int_equal(akv_headroom_take(e, 1, NULL), AKV_ERR_STEP_STATE);
      assert_int_equal(akv_lease_seal(ls, tail, attn), AKV_OK);
      akv_status st;
      while ((st = akv_lease_try_retire(ls, &r)) == AKV_ERR_NOT_READY) {
      }
      assert_int_equal(st, AKV_OK);
      assert_int_equal(akv_lease_try_retire(ls, &r), AKV_ERR_BAD_HANDLE);
      assert_int_equal(akv_lease_retire(ls, &r), AKV_ERR_BAD_HANDLE);
    }
    assert_int_equal(akv_step_end(e), AKV_OK);
    assert_int_equal(akv_headroom_get(e, &b), AKV_OK);
    assert_int_equal(b.pages, 0);
    assert_int_equal(b.pages_pending, 0);
    assert_int_equal(b.bytes, 0);
    run_step(e, s, c, 2, 3);
    assert_int_equal(akv_headroom_take(e, UINT64_MAX, &taken), AKV_OK);
    assert_int_equal(akv_headroom_get(e, &b), AKV_OK);
    assert_int_equal(b.pages, a.max_pages);
    run_step(e, s, c, 2, 3);
    assert_int_equal(akv_stream_destroy(e, s), AKV_OK);
    assert_int_equal(akv_engine_destroy(e), AKV_OK);
  }
}

/** Transport failure mid-step with a release pending, then quarantine. */
static void test_headroom_after_failure_and_quarantine(void **state) {
  (void)state;
  for (uint32_t nth = 1; nth <= 40; nth += 3) {
    akv_engine *e = hr_engine(AKV_ROUTE_ARENA, 8, 2, 0, -1);
    akv_stream s;
    akv_context *c[2];
    akv_headroom_info a, b;
    uint64_t freed = 5, pend = 5, taken = 5;
    assert_int_equal(akv_stream_create(e, &s), AKV_OK);
    for (int i = 0; i < 2; i++) {
      assert_int_equal(akv_context_open(e, NULL, &c[i]), AKV_OK);
      fill(c[i], 3, 40, e->row_bytes);
    }
    run_step(e, s, c, 2, 3);
    assert_int_equal(akv_step_begin(e, c, 2), AKV_OK);
    assert_int_equal(akv_headroom_release(e, 4 * e->page_bytes, &freed, &pend), AKV_OK);
    /* Arm a fault: the nth counted op from here fails. */
    e->bk.fail_nth = (uint32_t)e->bk.counted + nth;
    akv_status st = AKV_OK;
    for (uint32_t l = 0; l < 3 && st == AKV_OK; l++) {
      akv_lease *ls = NULL;
      akv_fence attn, tail;
      if ((st = akv_lease_begin(e, l, &ls)) != AKV_OK) break;
      if ((st = akv_lease_attend(ls, s, akvt_noop_hook, NULL, &attn)) != AKV_OK) break;
      if ((st = akv_lease_write_back(ls, NULL, 0, &tail)) != AKV_OK) break;
      if ((st = akv_lease_seal(ls, tail, attn)) != AKV_OK) break;
      while ((st = akv_lease_try_retire(ls, NULL)) == AKV_ERR_NOT_READY) {
      }
    }
    if (st == AKV_OK) st = akv_step_end(e);
    e->bk.fail_nth = 0;
    if (st == AKV_OK) {
      assert_int_equal(akv_stream_destroy(e, s), AKV_OK);
      assert_int_equal(akv_engine_destroy(e), AKV_OK);
      continue;
    }
    assert_int_equal(st, AKV_ERR_BACKEND);
    assert_int_equal(akv_headroom_get(e, &a), AKV_OK);
    assert_int_equal(akv_headroom_release(e, 1, &freed, &pend), AKV_ERR_QUARANTINED);
    assert_int_equal(akv_headroom_take(e, 1, &taken), AKV_ERR_QUARANTINED);
    assert_int_equal(taken, 5);
    assert_int_equal(akv_headroom_get(e, &b), AKV_OK);
    assert_memory_equal(&a, &b, sizeof a);
    akv_quarantine_report qr;
    assert_int_equal(akv_engine_quarantine(e, &qr), AKV_OK);
    assert_int_equal(akv_headroom_get(e, &b), AKV_OK);
    assert_int_equal(b.pages_pending, 0);
    assert_int_equal(b.pages, 4);
    assert_int_equal(akv_headroom_release(e, 1, NULL, NULL), AKV_ERR_QUARANTINED);
    assert_int_equal(akv_headroom_take(e, 1, NULL), AKV_ERR_QUARANTINED);
    uint32_t len = 0;
    assert_int_equal(akv_context_length(c[0], &len), AKV_OK);
    uint8_t kr[64], vr[64];
    assert_int_equal(akv_context_read(c[0], 0, 0, 1, kr, vr), AKV_OK);
    assert_int_equal(akv_stream_destroy(e, s), AKV_OK);
    assert_int_equal(akv_engine_destroy(e), AKV_OK);
  }
}

/** Headroom not enabled: NOT_SUPPORTED, outputs untouched. */
static void test_headroom_not_enabled(void **state) {
  (void)state;
  for (int route = AKV_ROUTE_STAGE; route <= AKV_ROUTE_PAGED; route++) {
    akv_engine_config ec = base_cfg((akv_route)route, AKV_DTYPE_BF16);
    akv_engine *e = NULL;
    akv_headroom_info hi;
    uint64_t f = 3, p = 3, t = 3;
    ec.device_pool_gib = route == AKV_ROUTE_STAGE ? 0 : 1;
    if (route == AKV_ROUTE_STAGE) ec.headroom_gib = 1;
    assert_int_equal(akv_engine_create(&ec, &e), AKV_OK);
    assert_int_equal(akv_headroom_get(e, NULL), AKV_ERR_INVALID_ARGUMENT);
    assert_int_equal(akv_headroom_get(e, &hi), AKV_OK);
    assert_int_equal(hi.enabled, 0);
    assert_int_equal(akv_headroom_release(e, UINT64_MAX, &f, &p), AKV_ERR_NOT_SUPPORTED);
    assert_int_equal(akv_headroom_take(e, UINT64_MAX, &t), AKV_ERR_NOT_SUPPORTED);
    assert_int_equal(f + p + t, 9);
    assert_int_equal(akv_engine_destroy(e), AKV_OK);
  }
}

/** Uneven layers: step refused, append/read/close, then even again. */
static void test_uneven_layers(void **state) {
  (void)state;
  for (int dt = AKV_DTYPE_BF16; dt <= AKV_DTYPE_FP8_E5M2; dt++) {
    akv_engine_config ec = base_cfg(AKV_ROUTE_ARENA, (akv_dtype)dt);
    akv_engine *e = NULL;
    akv_context *c = NULL, *c2 = NULL;
    akv_stream s;
    uint32_t len = 9;
    ec.device_pool_gib = 1;
    assert_int_equal(akv_engine_create(&ec, &e), AKV_OK);
    assert_int_equal(akv_stream_create(e, &s), AKV_OK);
    const uint32_t rb = (uint32_t)e->row_bytes;
    assert_int_equal(rb, 16u * (dt == AKV_DTYPE_F32 ? 4 : dt >= AKV_DTYPE_FP8_E4M3 ? 1 : 2));
    uint8_t *k = calloc(97, rb), *v = calloc(97, rb), *ko = calloc(97, rb), *vo = calloc(97, rb);
    for (uint32_t i = 0; i < 97 * rb; i++) {
      k[i] = (uint8_t)i;
      v[i] = (uint8_t)(255 - i);
    }
    assert_int_equal(akv_context_open(e, NULL, &c), AKV_OK);
    assert_int_equal(akv_context_open(e, NULL, &c2), AKV_OK);
    assert_int_equal(akv_context_append_layer(c, 3, 1, k, v), AKV_ERR_INVALID_ARGUMENT);
    assert_int_equal(akv_context_append_layer(c, UINT32_MAX, 1, k, v), AKV_ERR_INVALID_ARGUMENT);
    assert_int_equal(akv_context_append_layer(c, 0, 1, NULL, v), AKV_ERR_INVALID_ARGUMENT);
    assert_int_equal(akv_context_append_layer(c, 0, 0, NULL, NULL), AKV_OK);
    assert_int_equal(akv_context_append_layer(c, 0, UINT32_MAX, k, v), AKV_ERR_CAPACITY);
    assert_int_equal(akv_context_append_layer(c, 0, 97, k, v), AKV_ERR_CAPACITY);
    assert_int_equal(akv_context_append_layer(NULL, 0, 1, k, v), AKV_ERR_BAD_HANDLE);
    assert_int_equal(akv_context_append_layer(c, 1, 10, k, v), AKV_OK);
    assert_int_equal(akv_context_length(c, &len), AKV_OK);
    assert_int_equal(len, 0);
    /* Read layer 1 beyond the length; layer 0 holds nothing. */
    assert_int_equal(akv_context_read(c, 1, 0, 10, ko, vo), AKV_OK);
    assert_memory_equal(ko, k, 10 * rb);
    assert_memory_equal(vo, v, 10 * rb);
    assert_int_equal(akv_context_read(c, 1, 9, 2, ko, vo), AKV_ERR_INVALID_ARGUMENT);
    assert_int_equal(akv_context_read(c, 1, UINT32_MAX, 2, ko, vo), AKV_ERR_INVALID_ARGUMENT);
    assert_int_equal(akv_context_read(c, 0, 0, 1, ko, vo), AKV_ERR_INVALID_ARGUMENT);
    assert_int_equal(akv_context_read(c, 0, 0, 0, NULL, NULL), AKV_OK);
    assert_int_equal(akv_context_read(c, 3, 0, 0, NULL, NULL), AKV_ERR_INVALID_ARGUMENT);
    /* Step refused for the uneven context, nothing changed. */
    akv_context *both[2] = {c2, c};
    const uint64_t step = e->step;
    assert_int_equal(akv_step_begin(e, both, 2), AKV_ERR_UNEVEN_LAYERS);
    assert_int_equal(e->step, step);
    assert_false(e->step_open);
    assert_false(c2->in_step);
    /* Whole-context append goes after each layer's own rows. */
    const void *kr[3] = {k, k, k}, *vr[3] = {v, v, v};
    assert_int_equal(akv_context_append(c, 87, kr, vr), AKV_ERR_CAPACITY);
    assert_int_equal(akv_context_append(c, 86, kr, vr), AKV_OK);
    assert_int_equal(akv_context_length(c, &len), AKV_OK);
    assert_int_equal(len, 86);
    assert_int_equal(akv_context_append_layer(c, 0, 10, k, v), AKV_OK);
    assert_int_equal(akv_context_append_layer(c, 2, 10, k + 5 * rb, v + 5 * rb), AKV_OK);
    assert_int_equal(akv_context_length(c, &len), AKV_OK);
    assert_int_equal(len, 96);
    assert_int_equal(akv_context_read(c, 2, 86, 10, ko, vo), AKV_OK);
    assert_memory_equal(ko, k + 5 * rb, 10 * rb);
    /* Full: step refused with CAPACITY. */
    assert_int_equal(akv_step_begin(e, both, 2), AKV_ERR_CAPACITY);
    assert_int_equal(akv_context_close(c), AKV_OK);
    assert_int_equal(akv_context_append_layer(c, 0, 1, k, v), AKV_ERR_BAD_HANDLE);
    assert_int_equal(akv_context_read(c, 0, 0, 1, ko, vo), AKV_ERR_BAD_HANDLE);
    assert_int_equal(akv_context_length(c, &len), AKV_ERR_BAD_HANDLE);
    /* Reopen on the same slot: every layer empty. */
    assert_int_equal(akv_context_open(e, NULL, &c), AKV_OK);
    assert_int_equal(akv_context_read(c, 1, 0, 1, ko, vo), AKV_ERR_INVALID_ARGUMENT);
    fill(c, 3, 12, rb);
    fill(c2, 3, 12, rb);
    both[1] = c;
    run_step(e, s, both, 2, 3);
    assert_int_equal(akv_step_begin(e, both, 2), AKV_OK);
    assert_int_equal(akv_context_append_layer(c, 0, 1, k, v), AKV_ERR_IN_USE);
    assert_int_equal(akv_context_read(c, 0, 0, 1, ko, vo), AKV_ERR_IN_USE);
    assert_int_equal(akv_context_length(c, &len), AKV_OK);
    assert_int_equal(len, 13);
    for (uint32_t l = 0; l < 3; l++) {
      akv_lease *ls = NULL;
      akv_fence attn, tail;
      assert_int_equal(akv_lease_begin(e, l, &ls), AKV_OK);
      assert_int_equal(akv_lease_attend(ls, s, akvt_noop_hook, NULL, &attn), AKV_OK);
      assert_int_equal(akv_lease_write_back(ls, NULL, 0, &tail), AKV_OK);
      assert_int_equal(akv_lease_seal(ls, tail, attn), AKV_OK);
      assert_int_equal(akv_lease_retire(ls, NULL), AKV_OK);
    }
    assert_int_equal(akv_step_end(e), AKV_OK);
    assert_int_equal(akv_context_length(c, &len), AKV_OK);
    assert_int_equal(len, 14);
    assert_int_equal(akv_context_read(c, 2, 0, 12, ko, vo), AKV_OK);
    assert_int_equal(akv_stream_destroy(e, s), AKV_OK);
    assert_int_equal(akv_engine_destroy(e), AKV_OK);
    assert_int_equal(akv_context_read(c, 0, 0, 1, ko, vo), AKV_ERR_BAD_HANDLE);
    assert_int_equal(akv_context_append_layer(c2, 0, 1, k, v), AKV_ERR_BAD_HANDLE);
    free(k);
    free(v);
    free(ko);
    free(vo);
  }
}

/** Every struct_size 0..sizeof+64 and versions 0, 1, 2, big. */
static void test_config_struct_sizes(void **state) {
  (void)state;
  struct {
    akv_engine_config c;
    uint8_t tail[64];
  } big;
  akv_fit_report rep, rep0;
  for (uint32_t sz = 0; sz <= sizeof(akv_engine_config) + 64; sz++) {
    const uint32_t versions[] = {0, 1, 2, UINT32_MAX};
    for (int vi = 0; vi < 4; vi++) {
      memset(&big, 0xA5, sizeof big);
      big.c = base_cfg(AKV_ROUTE_ARENA, AKV_DTYPE_FP8_E4M3);
      big.c.device_pool_gib = 1;
      big.c.page_tokens = 96; /* few pages: creates stay fast */
      big.c.struct_size = sz;
      big.c.version = versions[vi];
      /* A smaller struct: the caller's object ends at sz (a heap copy). */
      size_t n = sz < sizeof big ? (sz < 4 ? 4 : sz) : sizeof big;
      void *heap = malloc(n);
      memcpy(heap, &big, n);
      memset(&rep, 0x5A, sizeof rep);
      rep0 = rep;
      akv_status st = akv_fit(heap, &rep);
      const int ok = sz >= offsetof(akv_engine_config, route) + sizeof(akv_route) &&
                     versions[vi] == 1;
      if (!ok) {
        assert_int_equal(st, AKV_ERR_CONFIG);
        assert_memory_equal(&rep, &rep0, sizeof rep);
      } else {
        assert_int_equal(st, AKV_OK);
        assert_int_equal(rep.row_bytes, 16);
      }
      akv_engine *e = (akv_engine *)(uintptr_t)0x1;
      st = akv_engine_create(heap, &e);
      if (!ok) {
        assert_int_equal(st, AKV_ERR_CONFIG);
        assert_ptr_equal(e, (akv_engine *)(uintptr_t)0x1);
      } else {
        assert_int_equal(st, AKV_OK);
        /* Context configs of every size, on the oldest and the newest engine
         * config layouts. */
        const int all_cs = sz == offsetof(akv_engine_config, route) + sizeof(akv_route) ||
                           sz == sizeof(akv_engine_config);
        for (uint32_t cs = 0; all_cs && cs <= sizeof(akv_context_config) + 64; cs += 1) {
          struct {
            akv_context_config c;
            uint8_t tail[64];
          } cb;
          memset(&cb, 0xA5, sizeof cb);
          cb.c.struct_size = cs;
          cb.c.version = versions[vi];
          cb.c.target_pages = 2;
          cb.c.burst_pages = 0;
          size_t cn = cs < sizeof cb ? (cs < 4 ? 4 : cs) : sizeof cb;
          void *ch = malloc(cn);
          memcpy(ch, &cb, cn);
          akv_context *ctx = (akv_context *)(uintptr_t)0x1;
          st = akv_context_open(e, ch, &ctx);
          if (cs < 8) {
            assert_int_equal(st, AKV_ERR_CONFIG);
            assert_ptr_equal(ctx, (akv_context *)(uintptr_t)0x1);
          } else {
            assert_int_equal(st, AKV_OK);
            assert_int_equal(ctx->target, cs >= 12 ? 2 : e->n_pages / e->concurrency);
            assert_int_equal(akv_context_close(ctx), AKV_OK);
          }
          free(ch);
        }
        assert_int_equal(akv_engine_destroy(e), AKV_OK);
      }
      free(heap);
    }
  }
}

/** akv_fit on hostile geometry: sizes whose products overflow. */
static void test_fit_hostile(void **state) {
  (void)state;
  akv_fit_report rep;
  akv_engine_config ec = base_cfg(AKV_ROUTE_PAGED, AKV_DTYPE_FP8_E5M2);
  assert_int_equal(akv_fit(NULL, &rep), AKV_ERR_INVALID_ARGUMENT);
  assert_int_equal(akv_fit(&ec, NULL), AKV_ERR_INVALID_ARGUMENT);
  const uint32_t vals[] = {0, 1, 2, 255, 65535, 65536, UINT32_MAX / 2, UINT32_MAX - 1, UINT32_MAX};
  for (size_t a = 0; a < 9; a++)
    for (size_t b = 0; b < 9; b++) {
      ec = base_cfg(a % 3, (akv_dtype)(b % 6));
      ec.n_dense_layers = vals[a];
      ec.kv_heads = vals[b];
      ec.head_dim = vals[(a + b) % 9];
      ec.max_tokens = vals[(a * 3 + b) % 9];
      ec.page_tokens = vals[(a + 2 * b) % 9];
      ec.max_contexts = vals[(2 * a + b) % 9];
      ec.host_pool_gib = vals[(a * b) % 9];
      ec.device_pool_gib = vals[(a + b + 1) % 9];
      ec.headroom_gib = vals[(a + 5) % 9];
      ec.headroom_chunk_pages = vals[b];
      ec.fit_mode = (akv_fit_mode)(b & 1);
      akv_status st = akv_fit(&ec, &rep);
      assert_true(st == AKV_OK || st == AKV_ERR_CONFIG);
    }
}

/** Headroom on tiny pages: its bookkeeping (admission arrays and page
 * tables per headroom page) counts against the bound, so akv_fit and
 * akv_engine_create refuse what would take gigabytes of host memory per GiB
 * of headroom; the same config with big enough pages is accepted. */
static void test_fit_headroom_bookkeeping(void **state) {
  (void)state;
  akv_fit_report rep, rep0;
  akv_engine_config ec = base_cfg(AKV_ROUTE_ARENA, AKV_DTYPE_FP8_E4M3);
  ec.n_dense_layers = 1;
  ec.kv_heads = 1;
  ec.head_dim = 1;
  ec.max_tokens = 1;
  ec.page_tokens = 1; /* 2-byte pages: 2^29 of them per GiB */
  ec.max_contexts = 1;
  /* The same pages from a device pool are refused already. */
  ec.device_pool_gib = 1;
  assert_int_equal(akv_fit(&ec, &rep), AKV_ERR_CONFIG);
  ec.device_pool_gib = 0;
  for (int route = AKV_ROUTE_ARENA; route <= AKV_ROUTE_PAGED; route++) {
    const uint32_t gibs[] = {1, 100, UINT32_MAX};
    ec.route = (akv_route)route;
    for (int g = 0; g < 3; g++) {
      akv_engine *e = (akv_engine *)(uintptr_t)0x1;
      ec.headroom_gib = gibs[g];
      memset(&rep, 0x5A, sizeof rep);
      rep0 = rep;
      assert_int_equal(akv_fit(&ec, &rep), AKV_ERR_CONFIG);
      assert_memory_equal(&rep, &rep0, sizeof rep);
      ec.host_fake_free_bytes = 2ull << 30;
      assert_int_equal(akv_engine_create(&ec, &e), AKV_ERR_CONFIG);
      assert_ptr_equal(e, (akv_engine *)(uintptr_t)0x1);
      ec.host_fake_free_bytes = 0;
    }
  }
  /* Stage takes no headroom: nothing to count. */
  ec.route = AKV_ROUTE_STAGE;
  ec.headroom_gib = 100;
  assert_int_equal(akv_fit(&ec, &rep), AKV_OK);
  /* Pages of a realistic size fit. */
  ec = base_cfg(AKV_ROUTE_PAGED, AKV_DTYPE_FP8_E5M2);
  ec.headroom_gib = 64;
  assert_int_equal(akv_fit(&ec, &rep), AKV_OK);
}

/* A heap copy of exactly `size` bytes of `src` (at least 4: struct_size). */
static void *older(const void *src, size_t size) {
  void *p = malloc(size < 4 ? 4 : size);
  memcpy(p, src, size < 4 ? 4 : size);
  return p;
}

/** In-process groups read the caller's structs only up to struct_size: an
 *  older engine config is taken (the rest at its defaults), smaller ones and
 *  a short group config are refused with AKV_ERR_CONFIG. */
static void test_group_older_structs(void **state) {
  (void)state;
  akv_engine_config ec = base_cfg(AKV_ROUTE_STAGE, AKV_DTYPE_FP8_E4M3);
  akv_group_config gc = AKV_GROUP_CONFIG_INIT;
  akv_group_world *w = NULL;
  akv_group *g = NULL;
  assert_int_equal(akv_group_world_create(1, 4, &w), AKV_OK);
  gc.timeout_ms = 2000;
  const uint32_t sizes[] = {4, 8, 16, (uint32_t)offsetof(akv_engine_config, route),
                            (uint32_t)(offsetof(akv_engine_config, route) + sizeof(akv_route)),
                            (uint32_t)offsetof(akv_engine_config, headroom_gib),
                            (uint32_t)offsetof(akv_engine_config, headroom_chunk_pages)};
  for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
    ec.struct_size = sizes[i];
    void *shard = older(&ec, sizes[i]);
    g = (akv_group *)(uintptr_t)0x1;
    akv_status st = akv_group_create_inproc(shard, &gc, w, &g);
    if (sizes[i] < offsetof(akv_engine_config, route) + sizeof(akv_route)) {
      assert_int_equal(st, AKV_ERR_CONFIG);
    } else {
      akv_engine *e = NULL;
      akv_context *c = NULL;
      akv_context_config cc = AKV_CONTEXT_CONFIG_INIT;
      assert_int_equal(st, AKV_OK);
      assert_int_equal(akv_group_engine(g, &e), AKV_OK);
      assert_int_equal(e->cfg.dtype, AKV_DTYPE_FP8_E4M3);
      assert_int_equal(e->row_bytes, 16);
      for (uint32_t cs = 0; cs <= sizeof cc; cs += 4) {
        cc.struct_size = cs;
        void *ccp = older(&cc, cs);
        c = NULL;
        st = akv_group_context_open(g, ccp, &c);
        free(ccp);
        if (cs < 8) {
          assert_int_equal(st, AKV_ERR_CONFIG);
          assert_null(c);
        } else {
          assert_int_equal(st, AKV_OK);
          assert_int_equal(akv_group_context_close(g, c), AKV_OK);
        }
      }
      assert_int_equal(akv_group_destroy(g), AKV_OK);
    }
    free(shard);
  }
  /* A group config shorter than its layout. */
  ec.struct_size = sizeof ec;
  for (uint32_t gs = 4; gs < sizeof gc; gs += 4) {
    akv_group_config short_gc = gc;
    short_gc.struct_size = gs;
    void *gp = older(&short_gc, gs);
    g = NULL;
    assert_int_equal(akv_group_create_inproc(&ec, gp, w, &g), AKV_ERR_CONFIG);
    free(gp);
  }
  assert_int_equal(akv_group_world_destroy(w), AKV_OK);
}

/* A log callback that calls the library back on the engine that is logging.
 * The logging call is midway through its own change (context_open has
 * picked a slot, a failing call is recording its error): calls that change
 * the engine refuse with AKV_ERR_IN_USE and change nothing; diagnostics
 * answer. */
typedef struct reent_state {
  akv_engine *e;
  akv_context *c0;
  akv_stream s;
  int armed; /* 1: nested open and close; 2: destroy, quarantine, stream, step */
  akv_status open_st, close_st, destroy_st, quarantine_st, stream_st, step_st, info_st;
  akv_context *nested;
} reent_state;

static void reent_log(void *user, akv_log_level level, const char *message) {
  reent_state *r = user;
  akv_engine_info info;
  (void)level;
  (void)message;
  if (r->armed == 1) {
    r->armed = 0;
    r->open_st = akv_context_open(r->e, NULL, &r->nested);
    r->close_st = akv_context_close(r->c0);
  } else if (r->armed == 2) {
    r->armed = 0;
    r->destroy_st = akv_engine_destroy(r->e);
    r->quarantine_st = akv_engine_quarantine(r->e, NULL);
    r->stream_st = akv_stream_destroy(r->e, r->s);
    r->step_st = akv_step_begin(r->e, &r->c0, 1);
    r->info_st = akv_engine_info_get(r->e, &info);
  }
}

static void test_log_callback_reentry(void **state) {
  (void)state;
  akv_engine_config ec = base_cfg(AKV_ROUTE_ARENA, AKV_DTYPE_BF16);
  akv_context_config cc = AKV_CONTEXT_CONFIG_INIT;
  reent_state r;
  akv_context *c1 = NULL;
  uint32_t len = 0;
  memset(&r, 0, sizeof r);
  ec.device_pool_gib = 1;
  ec.log_fn = reent_log;
  ec.log_user = &r;
  ec.log_level = AKV_LOG_DEBUG;
  assert_int_equal(akv_engine_create(&ec, &r.e), AKV_OK);
  assert_int_equal(akv_context_open(r.e, NULL, &r.c0), AKV_OK);
  assert_int_equal(akv_stream_create(r.e, &r.s), AKV_OK);

  /* Target 1 is raised to the floor, logged at INFO after the slot is
   * chosen and before it is admitted. */
  cc.target_pages = 1;
  r.armed = 1;
  assert_int_equal(akv_context_open(r.e, &cc, &c1), AKV_OK);
  assert_int_equal(r.armed, 0);
  assert_int_equal(r.open_st, AKV_ERR_IN_USE);
  assert_null(r.nested);
  assert_int_equal(r.close_st, AKV_ERR_IN_USE);
  assert_int_equal(akv_context_length(r.c0, &len), AKV_OK); /* still open */
  assert_ptr_not_equal(c1, r.c0);
  assert_ptr_equal(r.e->slot_owner[0], r.c0);
  assert_ptr_equal(r.e->slot_owner[1], c1);

  /* A failing call logs its error at DEBUG. */
  r.armed = 2;
  assert_int_equal(akv_step_end(r.e), AKV_ERR_STEP_STATE);
  assert_int_equal(r.armed, 0);
  assert_int_equal(r.destroy_st, AKV_ERR_IN_USE);
  assert_int_equal(r.quarantine_st, AKV_ERR_IN_USE);
  assert_int_equal(r.stream_st, AKV_ERR_IN_USE);
  assert_int_equal(r.step_st, AKV_ERR_IN_USE);
  assert_int_equal(r.info_st, AKV_OK);

  /* Nothing changed: the engine works on. */
  run_step(r.e, r.s, (akv_context *const[]){r.c0, c1}, 2, ec.n_dense_layers);
  assert_int_equal(akv_context_length(c1, &len), AKV_OK);
  assert_int_equal(len, 1);
  assert_int_equal(akv_context_close(r.c0), AKV_OK);
  assert_int_equal(akv_context_close(c1), AKV_OK);
  assert_int_equal(akv_stream_destroy(r.e, r.s), AKV_OK);
  assert_int_equal(akv_engine_destroy(r.e), AKV_OK);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_headroom_release_take_repeated),
      cmocka_unit_test(test_headroom_mid_step),
      cmocka_unit_test(test_headroom_after_failure_and_quarantine),
      cmocka_unit_test(test_headroom_not_enabled),
      cmocka_unit_test(test_uneven_layers),
      cmocka_unit_test(test_config_struct_sizes),
      cmocka_unit_test(test_fit_hostile),
      cmocka_unit_test(test_fit_headroom_bookkeeping),
      cmocka_unit_test(test_group_older_structs),
      cmocka_unit_test(test_log_callback_reentry),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
