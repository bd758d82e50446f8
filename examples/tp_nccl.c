/*
 * tp_nccl.c - the activekv CLI's NCCL communicators for --tp on the CUDA
 * backend (tp_nccl.h says what each is for).
 */
#define _POSIX_C_SOURCE 200809L

#include "tp_nccl.h"

#include <cuda_runtime.h>
#include <nccl.h>
#include <stdio.h>
#include <stdlib.h>

#include "akv_nccl.h"

typedef struct tp_nccl_rank {
  ncclComm_t group_comm; /* lent to the rank's akv_group */
  ncclComm_t model_comm; /* the model's all-reduces */
  int group_comm_gone;   /* the group aborted it: never touch it again */
  int model_failed;      /* an all-reduce was refused: abort, never destroy */
} tp_nccl_rank;

struct tp_nccl {
  uint32_t n;
  tp_nccl_rank rank[]; /* [n] */
};

/*
 * Frees one clique (one communicator per rank, comm[k] of rank k; gone[k]:
 * already aborted by its owner). NCCL's teardown is an intra-node collective:
 * one thread finalizing several ranks of a clique groups the
 * ncclCommFinalize calls (ncclGroupStart/End), after which ncclCommDestroy
 * is local. A clique with an aborted or failed member, or a failed run,
 * is aborted instead (abort does not wait for a peer's collective).
 */
static void tp_nccl_free_clique(uint32_t n, ncclComm_t *comm, const int *gone, int clean) {
  for (uint32_t k = 0; k < n; ++k) clean &= !gone[k];
  if (clean) {
    ncclGroupStart();
    for (uint32_t k = 0; k < n; ++k) ncclCommFinalize(comm[k]);
    if (ncclGroupEnd() != ncclSuccess) clean = 0;
  }
  for (uint32_t k = 0; k < n; ++k) {
    if (gone[k]) continue;
    if (clean) ncclCommDestroy(comm[k]);
    else ncclCommAbort(comm[k]);
  }
}

int tp_nccl_create(uint32_t n, tp_nccl **out, char *err, size_t cap) {
  /*
   * Determinism: --check compares each staged step's logits with the
   * resident step's bit for bit, and both sum the ranks' partial outputs
   * through this all-reduce, so its summation order must be the same for
   * every call of the run. NCCL picks its algorithm and protocol per call
   * from the message size and its tuning; a ring with the Simple protocol
   * is pinned here so that the order can never change between the two
   * runs (or between ranks: the ring's all-gather hands every rank the same
   * reduced bits). NVLink SHARP (multicast) stays off, as in the GPU pass.
   * A value the user exported is kept (setenv does not overwrite). NCCL
   * reads these once, at its first call in the process: the one below.
   */
  setenv("NCCL_ALGO", "Ring", 0);
  setenv("NCCL_PROTO", "Simple", 0);
  setenv("NCCL_NVLS_ENABLE", "0", 0);

  tp_nccl *t = calloc(1, sizeof *t + (size_t)n * sizeof t->rank[0]);
  int *devs = malloc((size_t)n * sizeof *devs);
  ncclComm_t *comms = malloc((size_t)2 * n * sizeof *comms);
  ncclResult_t r = ncclSuccess;
  int made = 0; /* cliques made */
  if (t == NULL || devs == NULL || comms == NULL || n == 0 || n > TP_NCCL_MAX) {
    snprintf(err, cap, "tp_nccl_create: out of host memory, or not 1..%d ranks", TP_NCCL_MAX);
    goto fail;
  }
  t->n = n;
  for (uint32_t k = 0; k < n; ++k) devs[k] = (int)k; /* rank k on device k */
  r = ncclCommInitAll(comms, (int)n, devs);
  if (r != ncclSuccess) goto nccl_fail;
  made = 1;
  r = ncclCommInitAll(comms + n, (int)n, devs);
  if (r != ncclSuccess) goto nccl_fail;
  for (uint32_t k = 0; k < n; ++k) {
    t->rank[k].group_comm = comms[k];
    t->rank[k].model_comm = comms[n + k];
  }
  free(comms);
  free(devs);
  *out = t;
  return 0;

nccl_fail:
  snprintf(err, cap, "ncclCommInitAll over GPUs 0..%u: %s (%s)", n - 1, ncclGetErrorString(r),
           ncclGetLastError(NULL));
  if (made) { /* the first clique: never used, aborted */
    int gone[TP_NCCL_MAX] = {0};
    tp_nccl_free_clique(n, comms, gone, 0);
  }
fail:
  free(comms);
  free(devs);
  free(t);
  return -1;
}

akv_status tp_nccl_group_create(tp_nccl *t, uint32_t rank, const akv_engine_config *shard,
                                const akv_group_config *config, akv_group **out) {
  tp_nccl_rank *k = &t->rank[rank];
  akv_status st = akv_nccl_group_create(shard, config, k->group_comm, out);
  /* akv_nccl.h: after a timeout or a communicator error the group aborted it */
  if (st == AKV_ERR_TIMEOUT || st == AKV_ERR_COMM) k->group_comm_gone = 1;
  return st;
}

akv_status tp_nccl_group_destroy(tp_nccl *t, uint32_t rank, akv_group *group) {
  akv_group_info info;
  if (akv_group_info_get(group, &info) == AKV_OK && info.stopped &&
      (info.reason == AKV_GROUP_TIMEOUT || info.reason == AKV_GROUP_COMM_FAILED))
    t->rank[rank].group_comm_gone = 1;
  return akv_group_destroy(group);
}

void *tp_nccl_user(tp_nccl *t, uint32_t rank) { return &t->rank[rank]; }

int tp_nccl_allreduce(void *user, float *v, uint64_t n, void *stream) {
  tp_nccl_rank *k = user;
  /* In place, on the model's stream: the model reads v after it there. */
  ncclResult_t r = ncclAllReduce(v, v, (size_t)n, ncclFloat, ncclSum, k->model_comm,
                                 (cudaStream_t)stream);
  if (r != ncclSuccess) {
    k->model_failed = 1;
    return -1;
  }
  return 0;
}

void tp_nccl_destroy(tp_nccl *t, int ok) {
  if (t == NULL) return;
  ncclComm_t comm[2][TP_NCCL_MAX];
  int gone[2][TP_NCCL_MAX];
  for (uint32_t k = 0; k < t->n; ++k) {
    comm[0][k] = t->rank[k].model_comm;
    gone[0][k] = 0;
    comm[1][k] = t->rank[k].group_comm;
    gone[1][k] = t->rank[k].group_comm_gone;
  }
  int model_clean = ok;
  for (uint32_t k = 0; k < t->n; ++k) model_clean &= !t->rank[k].model_failed;
  tp_nccl_free_clique(t->n, comm[0], gone[0], model_clean);
  tp_nccl_free_clique(t->n, comm[1], gone[1], ok);
  free(t);
}
