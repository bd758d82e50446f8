/*
 * coll_nccl.c - the collective interface (src/dist/collective.h) on the
 * caller's NCCL communicator, and akv_nccl_group_create (akv_nccl.h).
 *
 * One all-reduce per agreement point: the vector is copied to a device
 * buffer on the group's own stream, reduced with ncclAllReduce(ncclMin) and
 * copied back, then the host polls the stream's event, the communicator's
 * asynchronous error and the deadline. A timeout or an error aborts the
 * communicator (ncclCommAbort), which ends the collective on every rank, so
 * no rank hangs on one that never arrives.
 *
 * NCCL is loaded at run time, never linked: the communicator belongs to the
 * caller's NCCL (a framework's own copy, such as the one a torch wheel
 * bundles, or the toolkit's), so the calls must reach that very library.
 * dlopen("libnccl.so.2") with RTLD_NOLOAD returns the copy the process
 * already loaded under that soname; only when none is loaded yet is one
 * loaded here. libactivekv.so therefore carries no NCCL dependency, and
 * importing it before or after a framework changes nothing.
 */
#define _POSIX_C_SOURCE 200809L
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <nccl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "akv_nccl.h"
#include "collective.h"
#include "config.h"
#include "cuda_device.h"
#include "group.h"


/* The NCCL entry points used here, resolved once from the caller's NCCL. */
typedef struct akv_nccl_api {
  ncclResult_t (*all_reduce)(const void *, void *, size_t, ncclDataType_t, ncclRedOp_t,
                             ncclComm_t, cudaStream_t);
  ncclResult_t (*comm_abort)(ncclComm_t);
  ncclResult_t (*comm_count)(const ncclComm_t, int *);
  ncclResult_t (*comm_user_rank)(const ncclComm_t, int *);
  ncclResult_t (*get_async_error)(ncclComm_t, ncclResult_t *);
  const char *(*error_string)(ncclResult_t);
} akv_nccl_api;

static akv_nccl_api akv_nccl;
static int akv_nccl_loaded; /* 1: every entry point resolved */
static pthread_once_t akv_nccl_once = PTHREAD_ONCE_INIT;

static void akv_nccl_load(void) {
  static const char *const names[] = {"libnccl.so.2", "libnccl.so"};
  void *h = NULL;
  for (size_t i = 0; h == NULL && i < 2; i++) h = dlopen(names[i], RTLD_NOW | RTLD_NOLOAD);
  for (size_t i = 0; h == NULL && i < 2; i++) h = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
  if (h == NULL) return;
  /* POSIX: a data pointer from dlsym converts to a function pointer. */
  *(void **)&akv_nccl.all_reduce = dlsym(h, "ncclAllReduce");
  *(void **)&akv_nccl.comm_abort = dlsym(h, "ncclCommAbort");
  *(void **)&akv_nccl.comm_count = dlsym(h, "ncclCommCount");
  *(void **)&akv_nccl.comm_user_rank = dlsym(h, "ncclCommUserRank");
  *(void **)&akv_nccl.get_async_error = dlsym(h, "ncclCommGetAsyncError");
  *(void **)&akv_nccl.error_string = dlsym(h, "ncclGetErrorString");
  akv_nccl_loaded = akv_nccl.all_reduce && akv_nccl.comm_abort && akv_nccl.comm_count &&
                    akv_nccl.comm_user_rank && akv_nccl.get_async_error && akv_nccl.error_string;
}

typedef struct akv_nccl_coll {
  akv_coll base; /* first: an akv_coll * is an akv_nccl_coll * */
  ncclComm_t comm;
  int device;
  cudaStream_t stream;
  cudaEvent_t done;
  uint64_t *dev;  /* [max_n] device */
  uint64_t *host; /* [max_n] pinned */
} akv_nccl_coll;

static uint64_t akv_now_us(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

static void akv_nccl_sleep_us(long us) {
  struct timespec ts = {0, us * 1000L};
  nanosleep(&ts, NULL);
}

/* A group never changes its caller's current device, which a framework on
 * another GPU of the process reads as its own (an agreement point inside a
 * step must not move the caller's next allocation or launch to the group's
 * GPU): its calls make the group's device current and restore the caller's
 * (cuda_device.h). */

/* Aborts the communicator: the only way to end a collective whose peer never
 * arrives. Afterwards every call on this rank fails at once. */
static akv_status akv_nccl_abort(akv_nccl_coll *nc, akv_status st, const char *why) {
  if (!nc->base.aborted) {
    nc->base.aborted = 1;
    akv_nccl.comm_abort(nc->comm);
  }
  snprintf(nc->base.error, sizeof(nc->base.error), "%s; communicator aborted", why);
  return st;
}

/* Waits while NCCL reports ncclInProgress (non-blocking communicators). */
static ncclResult_t akv_nccl_settle(akv_nccl_coll *nc, ncclResult_t r, uint64_t deadline_us) {
  while (r == ncclInProgress) {
    if (akv_now_us() > deadline_us) return ncclInProgress;
    akv_nccl_sleep_us(20);
    if (akv_nccl.get_async_error(nc->comm, &r) != ncclSuccess) return ncclInternalError;
  }
  return r;
}

static akv_status akv_nccl_allreduce_on(akv_nccl_coll *nc, uint64_t *v, size_t n,
                                        uint32_t timeout_ms);

static akv_status akv_nccl_allreduce(akv_coll *c, uint64_t *v, size_t n, uint32_t timeout_ms) {
  akv_nccl_coll *nc = (akv_nccl_coll *)c;
  int prev = -1;
  akv_status st;
  if (v == NULL || n == 0 || n > c->max_n) return AKV_ERR_INVALID_ARGUMENT;
  if (c->aborted) return AKV_ERR_COMM;
  if (akv_cuda_device_enter(nc->device, &prev) != cudaSuccess) {
    (void)cudaGetLastError(); /* this call's failure, not the caller's */
    akv_cuda_device_leave(nc->device, prev);
    return akv_nccl_abort(nc, AKV_ERR_COMM, "cudaSetDevice failed");
  }
  st = akv_nccl_allreduce_on(nc, v, n, timeout_ms);
  akv_cuda_device_leave(nc->device, prev);
  return st;
}

/* The all-reduce itself, with the group's device current. */
static akv_status akv_nccl_allreduce_on(akv_nccl_coll *nc, uint64_t *v, size_t n,
                                        uint32_t timeout_ms) {
  akv_coll *c = &nc->base;
  const uint64_t deadline = akv_now_us() + (uint64_t)timeout_ms * 1000u;
  ncclResult_t r, async;
  char why[200];
  memcpy(nc->host, v, n * sizeof(uint64_t));
  if (cudaMemcpyAsync(nc->dev, nc->host, n * sizeof(uint64_t), cudaMemcpyHostToDevice,
                      nc->stream) != cudaSuccess)
    return akv_nccl_abort(nc, AKV_ERR_COMM, "copy of the agreement vector failed");
  r = akv_nccl.all_reduce(nc->dev, nc->dev, n, ncclUint64, ncclMin, nc->comm, nc->stream);
  r = akv_nccl_settle(nc, r, deadline);
  if (r == ncclInProgress) {
    snprintf(why, sizeof(why), "rank %u: ncclAllReduce not enqueued after %u ms", c->rank,
             timeout_ms);
    return akv_nccl_abort(nc, AKV_ERR_TIMEOUT, why);
  }
  if (r != ncclSuccess) {
    snprintf(why, sizeof(why), "ncclAllReduce: %s", akv_nccl.error_string(r));
    return akv_nccl_abort(nc, AKV_ERR_COMM, why);
  }
  if (cudaMemcpyAsync(nc->host, nc->dev, n * sizeof(uint64_t), cudaMemcpyDeviceToHost,
                      nc->stream) != cudaSuccess ||
      cudaEventRecord(nc->done, nc->stream) != cudaSuccess)
    return akv_nccl_abort(nc, AKV_ERR_COMM, "copy back of the agreement vector failed");
  for (;;) {
    cudaError_t q = cudaEventQuery(nc->done);
    if (q == cudaSuccess) break;
    if (q != cudaErrorNotReady) {
      snprintf(why, sizeof(why), "agreement stream: %s", cudaGetErrorString(q));
      return akv_nccl_abort(nc, AKV_ERR_COMM, why);
    }
    /* An NCCL asynchronous error is handled with an abort of the
     * communicator, never by waiting on. */
    if (akv_nccl.get_async_error(nc->comm, &async) != ncclSuccess ||
        (async != ncclSuccess && async != ncclInProgress)) {
      snprintf(why, sizeof(why), "NCCL asynchronous error: %s", akv_nccl.error_string(async));
      return akv_nccl_abort(nc, AKV_ERR_COMM, why);
    }
    /* A rank that never arrives: abort after the timeout. */
    if (akv_now_us() > deadline) {
      snprintf(why, sizeof(why), "rank %u waited %u ms for the other ranks", c->rank, timeout_ms);
      return akv_nccl_abort(nc, AKV_ERR_TIMEOUT, why);
    }
    akv_nccl_sleep_us(10);
  }
  memcpy(v, nc->host, n * sizeof(uint64_t));
  return AKV_OK;
}

static void akv_nccl_destroy(akv_coll *c) {
  akv_nccl_coll *nc = (akv_nccl_coll *)c;
  int prev = -1;
  if (nc == NULL) return;
  (void)akv_cuda_device_enter(nc->device, &prev);
  /* After an abort the stream's work was ended by NCCL; freeing waits for
   * nothing of the caller's. */
  if (nc->done != NULL) cudaEventDestroy(nc->done);
  if (nc->stream != NULL) cudaStreamDestroy(nc->stream);
  if (nc->dev != NULL) cudaFree(nc->dev);
  if (nc->host != NULL) cudaFreeHost(nc->host);
  akv_cuda_device_leave(nc->device, prev);
  free(nc);
}

static const akv_coll_ops akv_nccl_ops = {"nccl", akv_nccl_allreduce, akv_nccl_destroy};

AKV_API akv_status akv_nccl_group_create(const akv_engine_config *shard,
                                         const akv_group_config *config, ncclComm_t comm,
                                         akv_group **out) {
  akv_nccl_coll *nc;
  int count = 0, rank = -1;
  akv_status st;
  akv_engine_config sh = AKV_ENGINE_CONFIG_INIT;
  /* Without comm this rank cannot meet the others; a NULL shard, config or
   * out meets them and is refused on every rank (akv_group_create_with). */
  if (comm == NULL) return AKV_ERR_INVALID_ARGUMENT;
  /* The caller's config is read only up to its struct_size (an older,
   * smaller struct keeps the defaults for the rest); one below its oldest
   * layout leaves the defaults, and akv_group_create_with refuses it with
   * AKV_ERR_CONFIG after meeting the other ranks. */
  if (shard != NULL) (void)akv_config_merge(&akv_engine_config_layout, &sh, shard, NULL, 0);
  pthread_once(&akv_nccl_once, akv_nccl_load);
  if (!akv_nccl_loaded) return AKV_ERR_NOT_SUPPORTED; /* no libnccl.so.2 in this process */
  if (akv_nccl.comm_count(comm, &count) != ncclSuccess ||
      akv_nccl.comm_user_rank(comm, &rank) != ncclSuccess)
    return AKV_ERR_COMM;
  nc = calloc(1, sizeof(*nc));
  if (nc == NULL) return AKV_ERR_OUT_OF_MEMORY;
  nc->base.ops = &akv_nccl_ops;
  nc->base.rank = (uint32_t)rank;
  nc->base.size = (uint32_t)count;
  nc->base.max_n = akv_group_vector_len(sh.max_contexts);
  nc->comm = comm;
  nc->device = sh.device_ordinal;
  {
    int prev = -1;
    const int made =
        akv_cuda_device_enter(nc->device, &prev) == cudaSuccess &&
        cudaStreamCreateWithFlags(&nc->stream, cudaStreamNonBlocking) == cudaSuccess &&
        cudaEventCreateWithFlags(&nc->done, cudaEventDisableTiming) == cudaSuccess &&
        cudaMalloc((void **)&nc->dev, nc->base.max_n * sizeof(uint64_t)) == cudaSuccess &&
        cudaMallocHost((void **)&nc->host, nc->base.max_n * sizeof(uint64_t)) == cudaSuccess;
    akv_cuda_device_leave(nc->device, prev);
    if (!made) {
      (void)cudaGetLastError(); /* this call's failure, not the caller's */
      akv_nccl_destroy(&nc->base);
      return AKV_ERR_BACKEND;
    }
  }
  /* A mismatch of config->rank/size with comm is refused inside the
   * agreement (every rank meets the others and returns AKV_ERR_CONFIG). */
  st = akv_group_create_with(shard, config, &nc->base, out);
  if (st != AKV_OK) akv_nccl_destroy(&nc->base);
  return st;
}
