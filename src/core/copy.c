/*
 * copy.c - the one door through which the core submits the copies that
 * akv_engine_info counts (copies_h2d/d2h/d2d and bytes_h2d/d2h/d2d).
 */
#include "internal.h"

akv_status akv_copy_submit(akv_engine *e, akv_bqueue *q, akv_copy_dir dir, size_t n,
                           void *const *dst, const void *const *src, const size_t *bytes) {
  akv_status st = akv_bk_copy_batch(&e->bk, q, dir, n, dst, src, bytes);
  if (st != AKV_OK || n == 0) return st;
  /* Invariant (akv.h, akv_engine_info): a copy call is counted once, with
   * the bytes of every copy in it, exactly when the backend accepted it, and
   * here only. A submission that failed counts nowhere; one that was
   * accepted counts even when a later operation of the same call fails (the
   * copy is on its queue: its bytes cross). */
  uint64_t sum = 0;
  for (size_t i = 0; i < n; i++) sum += bytes[i];
  if (dir == AKV_COPY_H2D) {
    e->copies_h2d++;
    e->bytes_h2d += sum;
  } else if (dir == AKV_COPY_D2H) {
    e->copies_d2h++;
    e->bytes_d2h += sum;
  } else {
    e->copies_d2d++;
    e->bytes_d2d += sum;
  }
  return AKV_OK;
}
