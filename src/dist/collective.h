/*
 * collective.h - the collective interface the agreement protocol runs on.
 *
 * One operation is enough for agreement: an in-place MIN all-reduce of a
 * vector of uint64 over every rank of the group. A MAX rides on it as the
 * MIN of complements (~v), and "the same on every rank" as the pair
 * (v, ~v): after the reduce the pair holds (min, ~max), equal exactly when
 * every rank gave the same value. Every rank must pass the same n.
 *
 * Implementations: coll_inproc.c (threads of one process as ranks: CI and the
 * host backend) and src/nccl/coll_nccl.c (the caller's NCCL communicator).
 * This header is pure C and names no CUDA or NCCL type; the core never
 * includes it.
 *
 * Thread safety: one akv_coll belongs to one rank and is used from one
 * thread at a time; the ranks of a group call concurrently.
 */
#ifndef AKV_COLLECTIVE_H
#define AKV_COLLECTIVE_H

#include <stddef.h>
#include <stdint.h>

#include "akv.h"

typedef struct akv_coll akv_coll;

typedef struct akv_coll_ops {
  const char *name;
  /*
   * In-place MIN all-reduce of v[0..n) (n <= c->max_n) over the group.
   * Blocks the calling thread until every rank contributed, `timeout_ms`
   * passed, or the communicator failed; it never waits longer than
   * timeout_ms (plus one poll interval). On a timeout or a failure the
   * implementation aborts the communicator: every later call on any rank of
   * it fails at once (in-process) or within its own timeout (NCCL), so no
   * rank hangs. v is unspecified after a failure.
   * Returns AKV_OK, AKV_ERR_TIMEOUT (a rank did not arrive; communicator
   * aborted), AKV_ERR_COMM (the communicator failed or was aborted earlier),
   * AKV_ERR_INVALID_ARGUMENT (n > max_n; nothing entered).
   */
  akv_status (*allreduce_min)(akv_coll *c, uint64_t *v, size_t n, uint32_t timeout_ms);
  /* Frees the rank's resources. Never waits on peers; does not destroy the
   * caller's communicator (NCCL) beyond what a failed call aborted. */
  void (*destroy)(akv_coll *c);
} akv_coll_ops;

struct akv_coll {
  const akv_coll_ops *ops;
  uint32_t rank, size; /* this rank, ranks in the group */
  size_t max_n;        /* largest vector allreduce_min takes */
  int aborted;         /* 1 once this rank's communicator was aborted */
  char error[256];     /* the last failure in words */
};

#endif /* AKV_COLLECTIVE_H */
