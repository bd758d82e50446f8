/*
 * coll_inproc.c - the in-process collective (see coll_inproc.h): a barrier
 * with a MIN reduction under one mutex, a deadline on every wait, and an
 * abort that wakes every waiter.
 */
#define _POSIX_C_SOURCE 200809L
#include "coll_inproc.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

struct akv_inproc_world {
  pthread_mutex_t mu;
  pthread_cond_t cv; /* CLOCK_MONOTONIC */
  uint32_t size;
  size_t max_n;
  uint32_t arrived;      /* ranks in the current round */
  uint64_t generation;   /* rounds completed */
  size_t round_n;        /* the current round's vector length */
  uint64_t *accum;       /* [max_n]: MIN of the current round so far */
  uint64_t *result;      /* [max_n]: the last completed round */
  uint8_t *taken;        /* [size]: 1 while rank r's akv_coll lives */
  uint32_t live;         /* akv_colls alive on this world */
  int aborted;
  akv_status abort_status; /* what every later call returns */
  char why[200];
};

typedef struct akv_inproc_coll {
  akv_coll base; /* first: an akv_coll * is an akv_inproc_coll * */
  akv_inproc_world *w;
} akv_inproc_coll;

akv_status akv_inproc_world_create(uint32_t size, size_t max_n, akv_inproc_world **out) {
  akv_inproc_world *w;
  pthread_condattr_t ca;
  if (out == NULL || size == 0 || max_n == 0) return AKV_ERR_INVALID_ARGUMENT;
  w = calloc(1, sizeof(*w));
  if (w == NULL) return AKV_ERR_OUT_OF_MEMORY;
  w->accum = calloc(max_n, sizeof(uint64_t));
  w->result = calloc(max_n, sizeof(uint64_t));
  w->taken = calloc(size, 1);
  if (w->accum == NULL || w->result == NULL || w->taken == NULL) {
    free(w->accum);
    free(w->result);
    free(w->taken);
    free(w);
    return AKV_ERR_OUT_OF_MEMORY;
  }
  w->size = size;
  w->max_n = max_n;
  pthread_mutex_init(&w->mu, NULL);
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&w->cv, &ca);
  pthread_condattr_destroy(&ca);
  *out = w;
  return AKV_OK;
}

akv_status akv_inproc_world_destroy(akv_inproc_world *w) {
  uint32_t live;
  if (w == NULL) return AKV_ERR_INVALID_ARGUMENT;
  pthread_mutex_lock(&w->mu);
  live = w->live;
  pthread_mutex_unlock(&w->mu);
  if (live != 0) return AKV_ERR_BUSY; /* a rank's collective still uses it */
  pthread_cond_destroy(&w->cv);
  pthread_mutex_destroy(&w->mu);
  free(w->accum);
  free(w->result);
  free(w->taken);
  free(w);
  return AKV_OK;
}

/* Caller holds w->mu. The first abort wins: its status and reason stay. */
static void akv_inproc_abort_locked(akv_inproc_world *w, akv_status st, const char *why) {
  if (!w->aborted) {
    w->aborted = 1;
    w->abort_status = st;
    snprintf(w->why, sizeof(w->why), "%s", why);
  }
  pthread_cond_broadcast(&w->cv);
}

void akv_inproc_world_abort(akv_inproc_world *w, const char *why) {
  if (w == NULL) return;
  pthread_mutex_lock(&w->mu);
  akv_inproc_abort_locked(w, AKV_ERR_COMM, why != NULL ? why : "aborted");
  pthread_mutex_unlock(&w->mu);
}

static akv_status akv_inproc_allreduce(akv_coll *c, uint64_t *v, size_t n, uint32_t timeout_ms) {
  akv_inproc_coll *ic = (akv_inproc_coll *)c;
  akv_inproc_world *w = ic->w;
  akv_status st = AKV_OK;
  struct timespec deadline;
  if (v == NULL || n == 0 || n > c->max_n) return AKV_ERR_INVALID_ARGUMENT;
  clock_gettime(CLOCK_MONOTONIC, &deadline);
  deadline.tv_sec += timeout_ms / 1000;
  deadline.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
  if (deadline.tv_nsec >= 1000000000L) {
    deadline.tv_sec++;
    deadline.tv_nsec -= 1000000000L;
  }
  pthread_mutex_lock(&w->mu);
  if (w->aborted) goto aborted;
  if (w->arrived == 0) {
    w->round_n = n;
    memcpy(w->accum, v, n * sizeof(uint64_t));
  } else if (n != w->round_n) {
    /* NCCL would hang or corrupt here; in process it is caught. */
    akv_inproc_abort_locked(w, AKV_ERR_COMM, "ranks passed vectors of different lengths");
    goto aborted;
  } else {
    for (size_t i = 0; i < n; i++)
      if (v[i] < w->accum[i]) w->accum[i] = v[i];
  }
  w->arrived++;
  if (w->arrived == w->size) {
    /* The result of round g stays readable until round g+1 completes, which
     * needs every rank, including those still copying round g out. */
    memcpy(w->result, w->accum, n * sizeof(uint64_t));
    w->arrived = 0;
    w->generation++;
    pthread_cond_broadcast(&w->cv);
    memcpy(v, w->result, n * sizeof(uint64_t));
    pthread_mutex_unlock(&w->mu);
    return AKV_OK;
  }
  {
    const uint64_t mine = w->generation;
    while (w->generation == mine && !w->aborted) {
      int rc = pthread_cond_timedwait(&w->cv, &w->mu, &deadline);
      if (rc == ETIMEDOUT && w->generation == mine && !w->aborted) {
        char why[200];
        snprintf(why, sizeof(why), "rank %u waited %u ms; %u of %u ranks arrived", c->rank,
                 timeout_ms, w->arrived, w->size);
        /* A rank that never arrives is handled with an abort of the
         * communicator, so no other rank hangs on it. */
        akv_inproc_abort_locked(w, AKV_ERR_TIMEOUT, why);
      }
    }
    if (w->generation != mine) {
      memcpy(v, w->result, n * sizeof(uint64_t));
      pthread_mutex_unlock(&w->mu);
      return AKV_OK;
    }
  }
aborted:
  st = w->abort_status;
  snprintf(c->error, sizeof(c->error), "in-process communicator aborted: %s", w->why);
  c->aborted = 1;
  pthread_mutex_unlock(&w->mu);
  return st;
}

static void akv_inproc_destroy(akv_coll *c) {
  akv_inproc_coll *ic = (akv_inproc_coll *)c;
  pthread_mutex_lock(&ic->w->mu);
  ic->w->taken[c->rank] = 0;
  ic->w->live--;
  pthread_mutex_unlock(&ic->w->mu);
  free(c);
}

static const akv_coll_ops akv_inproc_ops = {"in-process", akv_inproc_allreduce, akv_inproc_destroy};

akv_status akv_inproc_coll_create(akv_inproc_world *w, uint32_t rank, akv_coll **out) {
  akv_inproc_coll *ic;
  if (w == NULL || out == NULL || rank >= w->size) return AKV_ERR_INVALID_ARGUMENT;
  ic = calloc(1, sizeof(*ic));
  if (ic == NULL) return AKV_ERR_OUT_OF_MEMORY;
  ic->base.ops = &akv_inproc_ops;
  ic->base.rank = rank;
  ic->base.size = w->size;
  ic->base.max_n = w->max_n;
  ic->w = w;
  pthread_mutex_lock(&w->mu);
  if (w->taken[rank]) {
    /* Two live collectives of one rank would complete a round between them
     * as if they were two ranks. */
    pthread_mutex_unlock(&w->mu);
    free(ic);
    return AKV_ERR_IN_USE;
  }
  w->taken[rank] = 1;
  w->live++;
  pthread_mutex_unlock(&w->mu);
  *out = &ic->base;
  return AKV_OK;
}
