/*
 * backend_host.c - the host backend (DESIGN §8): worker threads as queues,
 * host memory as device memory.
 *
 * It is the backend the engine's correctness proofs run on (DESIGN §9:
 * schedule perturbation, the teeth test, fault injection), so it models CUDA
 * streams and events faithfully rather than conveniently:
 *
 *  - Queue. One worker thread per queue runs the queue's operations in
 *    enqueue order. Enqueueing writes a fixed-size slot into a ring allocated
 *    at queue_create (AKV_HOST_RING_SLOTS) and returns; the operation runs
 *    later, on the worker. When the ring is full the caller blocks until the
 *    worker frees space. Positions are counted in slots since creation:
 *    `tail` (slots enqueued) and `head` (slots whose operation has finished).
 *    Everything enqueued before position p has run exactly when head >= p.
 *
 *  - Event. A capture is a (queue, position) pair: event_record enqueues a
 *    marker slot on q and the event's current capture becomes (q, position
 *    after that marker). The capture has completed when q's head passed the
 *    marker, i.e. when everything enqueued on q before the record has run.
 *    A later record replaces the capture (CUDA semantics), also when it is on
 *    another queue. queue_wait copies the capture current at the time of the
 *    call into a wait slot, so a later re-record neither extends nor shortens
 *    it; the wait slot does not point at the event, so destroying an event
 *    with waits still pending is safe (as in CUDA). Waiting on an event never
 *    recorded enqueues nothing.
 *
 *  - Lifetimes. A queue structure is reference counted: its owner, every
 *    event whose current capture names it and every pending wait slot that
 *    names it hold a reference. queue_destroy drains the queue, joins its
 *    last worker (unless a host function detached it: see
 *    akv_host_reap_self), frees the ring and drops the owner's
 *    reference; the structure
 *    itself (counters, mutex, condition variable) lives until the last
 *    reference goes, because a drained queue still answers "has position p
 *    completed?" (always yes). The backend context is counted the same way by
 *    its live queues, events and allocations: shutdown frees it at once when
 *    nothing is left, otherwise the last of them does, so a late free or
 *    destroy never touches freed memory and shutdown never joins or frees
 *    anything still referenced.
 *
 *  - Deadlock freedom. A wait captures only records already enqueued, so
 *    waits can never form a cycle; a queue can block forever only behind a
 *    host function that never returns. The synchronize calls give up after
 *    the sync timeout and return AKV_ERR_BACKEND ("completion could not be
 *    established"); enqueueing onto a full ring gives up after the same
 *    timeout, and at once (AKV_ERR_IN_USE) when the full ring waits for the
 *    enqueuer itself: a queue's own worker enqueueing onto its own ring, or
 *    a host function on another queue whose current operation the full
 *    queue waits for through a chain of cross-queue waits
 *    (akv_host_waits_for).
 *
 *  - Delay injection (akv_backend_params.delay_seed != 0). Before each
 *    operation (a whole batch counts as one) the worker draws from its own
 *    splitmix64 stream, seeded with delay_seed ^ queue_index (queue_index =
 *    creation order within the context, from 0), and then does nothing
 *    (6/16), yields (4/16), spins for min(d, 20) us (5/16) or sleeps d us
 *    (1/16), where d is uniform in [0, delay_max_us]. Typical delays stay
 *    tiny so tests can afford thousands of schedules.
 *
 *  - Memory. host_alloc and device_alloc both return host memory aligned to
 *    at least AKV_HOST_ALIGN bytes: anonymous private mappings (lazily
 *    committed, never touched here, so a 1 GiB pool costs nothing until
 *    written) from AKV_HOST_MMAP_MIN bytes on (device blocks always), aligned_alloc below. A small
 *    header right before the returned pointer says how to free it.
 *    mem_info describes device_alloc memory as a device exactly as large as
 *    what is allocated on it: free = 0, total = bytes allocated now, peak =
 *    the peak of bytes allocated, so total - free is the memory in use, as
 *    on CUDA. With a fake capacity (akv_engine_config.host_fake_free_bytes,
 *    a testing aid for headroom) the device holds that many bytes: free =
 *    capacity - bytes allocated, total = capacity, and a device_alloc past
 *    it fails with AKV_ERR_OUT_OF_MEMORY. Device blocks are always mappings,
 *    whatever their size: they sit close together in the address space, as
 *    cudaMalloc's do (the paged route's page grid relies on it, headroom.c),
 *    and a read after their free faults instead of returning stale rows.
 *    device_free_async and host_free_async free a block on a
 *    queue's worker once everything enqueued before them has run, as
 *    cudaFreeAsync does; the plain frees free at once. Neither waits for
 *    anything: host memory needs no device synchronisation.
 *
 *  - Sync timeout. 30 s, overridable at init by the environment variable
 *    AKV_HOST_SYNC_TIMEOUT_MS (a positive integer; a testing aid).
 *
 * Thread safety: every entry may be called from any thread, including from a
 * host function running on a worker (a host function may enqueue on any
 * queue). Host functions must not synchronize (a worker would wait for
 * itself until the timeout) and must not create or destroy queues (those wait
 * for a running device_synchronize, which may be waiting for that very host
 * function); queue_destroy must never be called from q's own worker. A host
 * function that ends its worker's thread (pthread_exit, cancellation) ends
 * only itself: its end counts as its return and a successor thread runs the
 * rest of the ring (akv_host_fn_ended).
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* MAP_ANONYMOUS, MAP_NORESERVE, pthread_getattr_np */
#endif
#ifndef _POSIX_C_SOURCE
#define _POSIX_C_SOURCE 200809L
#endif

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "backend.h"

/** Slots in each queue's ring; a batch of n copies takes n + 1 slots. */
#define AKV_HOST_RING_SLOTS 4096u
/** Minimum alignment of every allocation (bytes). */
#define AKV_HOST_ALIGN 256u
/** Allocations of at least this many bytes are anonymous mappings. */
#define AKV_HOST_MMAP_MIN ((size_t)1 << 20)
/** Default synchronize timeout (milliseconds). */
#define AKV_HOST_SYNC_TIMEOUT_MS_DEFAULT 30000u
/** Longest injected busy spin (microseconds). */
#define AKV_HOST_SPIN_MAX_US 20u

#define AKV_HOST_MAGIC_CTX 0x43484b41u   /* "AKHC" */
#define AKV_HOST_MAGIC_QUEUE 0x51484b41u /* "AKHQ" */
#define AKV_HOST_MAGIC_EVENT 0x45484b41u /* "AKHE" */
#define AKV_HOST_MAGIC_BLOCK 0x42484b4141564b41ull
#define AKV_HOST_MAGIC_DEAD 0xdeadbeefu

/** The one checking macro of this file: sets `st` and jumps to `fail`. */
#define AKV_HOST_CHECK(cond, status) \
  do {                               \
    if (!(cond)) {                   \
      st = (status);                 \
      goto fail;                     \
    }                                \
  } while (0)

/** What a ring slot asks the worker to do. */
typedef enum akv_host_op_kind {
  AKV_HOST_OP_COPY = 0,   /**< one memcpy */
  AKV_HOST_OP_BATCH = 1,  /**< header: the next `slots - 1` slots are its copies */
  AKV_HOST_OP_RECORD = 2, /**< event marker: nothing to run, completion is the point */
  AKV_HOST_OP_WAIT = 3,   /**< block until wait.queue's head reaches wait.position */
  AKV_HOST_OP_HOSTFN = 4, /**< call host.fn(host.arg) */
  AKV_HOST_OP_FREE = 5    /**< stream-ordered free of free.ptr (device_free_async, ...) */
} akv_host_op_kind;

/** One ring slot. Written by an enqueuer under the queue mutex, read by the worker. */
typedef struct akv_host_op {
  akv_host_op_kind kind;
  uint32_t slots; /**< slots this operation occupies (1, or 1 + copies for a batch) */
  union {
    struct {
      void *dst;
      const void *src;
      size_t bytes;
    } copy;
    struct {
      akv_bqueue *queue; /**< the captured queue; this slot holds a reference */
      uint64_t position; /**< the captured position in it */
    } wait;
    struct {
      void (*fn)(void *);
      void *arg;
    } host;
    struct {
      void *ptr;  /**< a block of this queue's context */
      int device; /**< 1 = device_alloc block, 0 = host_alloc block */
    } free;
  } u;
} akv_host_op;

/** The backend context returned by init. */
typedef struct akv_host_ctx {
  uint32_t magic;
  pthread_mutex_t mu;     /**< guards everything below */
  akv_bqueue *queues;     /**< live queues (created, not destroyed), a list */
  uint32_t next_index;    /**< creation index of the next queue */
  uint64_t live_objects;  /**< queues, events and allocations not yet released */
  bool shut;              /**< shutdown was called; the last release frees */
  uint64_t device_bytes;  /**< device_alloc bytes allocated now */
  uint64_t device_peak;   /**< peak of device_bytes */
  uint64_t host_bytes;    /**< host_alloc bytes allocated now */
  /* Immutable after init. */
  uint64_t delay_seed;
  uint32_t delay_max_us;
  uint64_t fake_capacity;  /**< testing: device bytes the modelled device holds; 0 = none */
  uint64_t sync_timeout_ns;
  pthread_mutex_t sync_mu; /**< held by device_synchronize's walk of `queues` and by
                                every change of the list; taken before mu */
  uint32_t magic_end;
} akv_host_ctx;

/** A queue: a worker thread and its ring. */
struct akv_bqueue {
  uint32_t magic;
  akv_host_ctx *ctx;
  atomic_uint refs;          /**< owner + events + pending waits naming it */
  pthread_mutex_t mu;        /**< guards ring contents, head, tail, stop */
  pthread_cond_t work;       /**< worker: an operation was enqueued or stop was set */
  pthread_cond_t progress;   /**< head advanced (space, synchronize, cross-queue waits) */
  akv_host_op *ring;         /**< [cap] */
  uint32_t cap;
  uint64_t head;             /**< slots finished */
  uint64_t tail;             /**< slots enqueued */
  bool stop;                 /**< queue_destroy: drain then exit */
  bool exited;               /**< the worker left its loop (stopped and drained), or
                                  its successor could not start: queue_destroy waits
                                  for it, then joins `thread` if `joinable` */
  pthread_t thread;          /**< the current worker (guarded by mu) */
  bool joinable;             /**< with exited: `thread` is still joinable (a host
                                  function may have detached it) */
  pthread_t ended;           /**< a worker whose host function ended it: its
                                  successor joins it if `ended_joinable` */
  bool ended_joinable;
  uint32_t index;            /**< creation index within the context */
  uint64_t prng;             /**< delay stream; touched only by the worker */
  uint64_t delay_seed;
  uint32_t delay_max_us;
  uint64_t sync_timeout_ns;
  akv_bqueue *next, *prev;   /**< the context's live-queue list (guarded by ctx->mu) */
  uint32_t magic_end;
};

/** An event: its current capture, or none. */
struct akv_bevent {
  uint32_t magic;
  akv_host_ctx *ctx;
  pthread_mutex_t mu;  /**< guards queue and position */
  akv_bqueue *queue;   /**< queue of the current capture (a reference); NULL = never recorded */
  uint64_t position;   /**< the capture is complete once queue->head >= position */
  uint32_t magic_end;
};

/** The header placed right before every pointer host_alloc/device_alloc return. */
typedef struct akv_host_block {
  uint64_t magic;   /**< AKV_HOST_MAGIC_BLOCK while allocated */
  void *base;       /**< what free/munmap takes */
  size_t map_bytes; /**< length of the mapping; 0 = aligned_alloc block */
  size_t bytes;     /**< bytes the caller asked for */
  int device;       /**< 1 = device_alloc, 0 = host_alloc */
} akv_host_block;

/* ------------------------------------------------------------------------ */
/* Small helpers                                                             */
/* ------------------------------------------------------------------------ */

/** One step of splitmix64 on *state. */
static uint64_t akv_host_splitmix(uint64_t *state) {
  uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

/** CLOCK_MONOTONIC now, in nanoseconds. */
static uint64_t akv_host_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/** The CLOCK_MONOTONIC deadline `ns` from now, for pthread_cond_timedwait. */
static struct timespec akv_host_deadline(uint64_t ns) {
  uint64_t t = akv_host_now_ns() + ns;
  struct timespec ts;
  ts.tv_sec = (time_t)(t / 1000000000ull);
  ts.tv_nsec = (long)(t % 1000000000ull);
  return ts;
}

/** Initialises a condition variable that times out on CLOCK_MONOTONIC. */
static int akv_host_cond_init(pthread_cond_t *cv) {
  pthread_condattr_t attr;
  int rc = pthread_condattr_init(&attr);
  if (rc != 0) return rc;
  rc = pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
  if (rc == 0) rc = pthread_cond_init(cv, &attr);
  pthread_condattr_destroy(&attr);
  return rc;
}

/** True when `c` is a live context of this backend. */
static bool akv_host_ctx_ok(const akv_host_ctx *c) {
  return c != NULL && c->magic == AKV_HOST_MAGIC_CTX && c->magic_end == AKV_HOST_MAGIC_CTX;
}

/** True when `q` is a live (not destroyed) queue. */
static bool akv_host_queue_ok(const akv_bqueue *q) {
  return q != NULL && q->magic == AKV_HOST_MAGIC_QUEUE && q->magic_end == AKV_HOST_MAGIC_QUEUE;
}

/** True when `e` is a live event. */
static bool akv_host_event_ok(const akv_bevent *e) {
  return e != NULL && e->magic == AKV_HOST_MAGIC_EVENT && e->magic_end == AKV_HOST_MAGIC_EVENT;
}

/** Frees the context's own resources. Only when nothing refers to it. */
static void akv_host_ctx_free(akv_host_ctx *c) {
  c->magic = c->magic_end = AKV_HOST_MAGIC_DEAD;
  pthread_mutex_destroy(&c->sync_mu);
  pthread_mutex_destroy(&c->mu);
  free(c);
}

/** Drops one live object of the context; frees it when shut down and empty. */
static void akv_host_ctx_put(akv_host_ctx *c) {
  pthread_mutex_lock(&c->mu);
  c->live_objects--;
  bool free_now = c->shut && c->live_objects == 0;
  pthread_mutex_unlock(&c->mu);
  if (free_now) akv_host_ctx_free(c);
}

/** Adds one live object to the context. */
static void akv_host_ctx_get(akv_host_ctx *c) {
  pthread_mutex_lock(&c->mu);
  c->live_objects++;
  pthread_mutex_unlock(&c->mu);
}

/** Takes a reference on a queue structure. */
static void akv_host_queue_ref(akv_bqueue *q) {
  atomic_fetch_add_explicit(&q->refs, 1u, memory_order_relaxed);
}

/** Drops a reference; the last one frees the structure (the ring is already gone). */
static void akv_host_queue_unref(akv_bqueue *q) {
  if (atomic_fetch_sub_explicit(&q->refs, 1u, memory_order_acq_rel) != 1u) return;
  pthread_cond_destroy(&q->progress);
  pthread_cond_destroy(&q->work);
  pthread_mutex_destroy(&q->mu);
  free(q->ring);
  free(q);
}

/**
 * Blocks until q->head >= position or the deadline passes. Called with q->mu
 * held; returns with it held. Returns AKV_OK or AKV_ERR_BACKEND (timed out).
 */
static akv_status akv_host_wait_position(akv_bqueue *q, uint64_t position,
                                         const struct timespec *deadline) {
  while (q->head < position) {
    int rc = pthread_cond_timedwait(&q->progress, &q->mu, deadline);
    if (rc == ETIMEDOUT && q->head < position) return AKV_ERR_BACKEND;
  }
  return AKV_OK;
}

/* ------------------------------------------------------------------------ */
/* The worker                                                                */
/* ------------------------------------------------------------------------ */

/** Busy-waits `us` microseconds. */
static void akv_host_spin(uint64_t us) {
  uint64_t end = akv_host_now_ns() + us * 1000u;
  while (akv_host_now_ns() < end) {
  }
}

/** The injected delay before one operation (see the file comment). */
static void akv_host_delay(akv_bqueue *q) {
  if (q->delay_seed == 0) return;
  uint64_t r = akv_host_splitmix(&q->prng);
  unsigned cls = (unsigned)(r & 15u);
  uint64_t us = (r >> 8) % ((uint64_t)q->delay_max_us + 1u);
  if (cls < 6u) return;
  if (cls < 10u) {
    sched_yield();
  } else if (cls < 15u) {
    akv_host_spin(us < AKV_HOST_SPIN_MAX_US ? us : AKV_HOST_SPIN_MAX_US);
  } else if (us > 0) {
    struct timespec ts = {(time_t)(us / 1000000u), (long)(us % 1000000u) * 1000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
  }
}

static void akv_host_block_free(void *ctx, void *ptr, int device);

/**
 * Runs one operation whose first slot is at `first`. Slots [first, first +
 * op->slots) stay untouched by enqueuers until head moves past them, so the
 * worker reads them without the lock.
 */
static void akv_host_run(akv_bqueue *q, const akv_host_op *op, uint64_t first) {
  switch (op->kind) {
    case AKV_HOST_OP_COPY:
      if (op->u.copy.bytes > 0) memcpy(op->u.copy.dst, op->u.copy.src, op->u.copy.bytes);
      break;
    case AKV_HOST_OP_BATCH:
      for (uint32_t i = 1; i < op->slots; i++) {
        const akv_host_op *c = &q->ring[(first + i) % q->cap];
        if (c->u.copy.bytes > 0) memcpy(c->u.copy.dst, c->u.copy.src, c->u.copy.bytes);
      }
      break;
    case AKV_HOST_OP_RECORD:
      /* Completion is the point: the capture ends when head passes this slot. */
      break;
    case AKV_HOST_OP_WAIT: {
      /* No timeout: like a device, a queue waits as long as it takes. A wait
       * on this very queue is already satisfied (head == first >= position). */
      akv_bqueue *src = op->u.wait.queue;
      pthread_mutex_lock(&src->mu);
      while (src->head < op->u.wait.position) pthread_cond_wait(&src->progress, &src->mu);
      pthread_mutex_unlock(&src->mu);
      /* The slot's reference on src is dropped by the worker once head
       * moved past the slot (akv_host_worker): see akv_host_waits_for. */
      break;
    }
    case AKV_HOST_OP_HOSTFN:
      op->u.host.fn(op->u.host.arg);
      break;
    case AKV_HOST_OP_FREE:
      /* Everything enqueued on q before the free has run: nothing of q's
       * still uses the block. */
      akv_host_block_free(q->ctx, op->u.free.ptr, op->u.free.device);
      break;
  }
}

/* The queue whose worker is the calling thread (NULL on other threads): a
 * host function running there that enqueues (akv_host_reserve). */
static _Thread_local akv_bqueue *akv_host_self;

static void *akv_host_worker(void *arg);

/*
 * Whether the calling worker is still joinable, asked by the worker itself
 * as it leaves, once no host function can run on it any more. Invariant:
 * the backend joins a worker only if it was still joinable when it left.
 * Workers start joinable, and joining them is what tells queue_destroy (and
 * a successor, akv_host_fn_ended) that the thread is gone, not merely about
 * to return through library code (which an unload of the library right
 * after destroy would cut short). But a host function may detach the
 * thread it runs on (pthread_detach(pthread_self()), or another thread may,
 * with an id a function handed out), and joining a detached thread is
 * undefined behaviour: glibc answers EINVAL while it lives, but once it
 * ended its id may name a newer thread (the join then waits for that one)
 * or unmapped memory. Only the thread itself can ask safely (it is alive),
 * so each worker reports its own state under q->mu with its exit signal. A
 * thread that cannot tell (pthread_getattr_np failed) detaches itself, so
 * the answer "not joinable" is true either way.
 */
static bool akv_host_reap_self(void) {
  pthread_attr_t a;
  int state = PTHREAD_CREATE_DETACHED;
  if (pthread_getattr_np(pthread_self(), &a) == 0) {
    if (pthread_attr_getdetachstate(&a, &state) != 0) state = -1;
    pthread_attr_destroy(&a);
  } else {
    state = -1;
  }
  if (state == PTHREAD_CREATE_JOINABLE) return true;
  if (state != PTHREAD_CREATE_DETACHED) (void)pthread_detach(pthread_self());
  return false;
}

/* A successor worker: joins the one whose host function ended its thread
 * (if it is joinable: akv_host_reap_self), then runs the ring on. Both were
 * written under q->mu before this thread was created. */
static void *akv_host_worker_next(void *arg) {
  akv_bqueue *q = arg;
  pthread_mutex_lock(&q->mu);
  const pthread_t ended = q->ended;
  const bool joinable = q->ended_joinable;
  pthread_mutex_unlock(&q->mu);
  if (joinable) pthread_join(ended, NULL);
  return akv_host_worker(q);
}

/** What akv_host_fn_ended needs of the host function that was running. */
typedef struct akv_host_fn_frame {
  akv_bqueue *q;
  uint64_t first; /**< its slot */
  uint32_t slots;
} akv_host_fn_frame;

/*
 * Runs when a host function ends the worker's thread instead of returning
 * (pthread_exit, or a cancellation acting inside it): the thread's cleanup
 * handler. Invariant: a queue's ring always has a worker until
 * queue_destroy saw the last one leave. The function's end counts as its
 * return (head moves past its slot), and a successor thread runs the rest
 * of the ring; without it every later operation of the queue, every wait
 * on it and every drain of it waited for good, so leases never retired and
 * no quarantine could establish completion. The successor joins the ended
 * thread unless the function detached it (akv_host_reap_self). If the
 * successor cannot start, the queue is left as the function left it (its
 * later work never runs) and counts as exited: queue_destroy joins the
 * ended thread (if joinable) instead of waiting.
 */
static void akv_host_fn_ended(void *arg) {
  const akv_host_fn_frame *f = arg;
  akv_bqueue *q = f->q;
  pthread_t next;
  const bool joinable = akv_host_reap_self(); /* no host function runs here any more */
  pthread_mutex_lock(&q->mu);
  q->head = f->first + f->slots;
  pthread_cond_broadcast(&q->progress);
  q->ended = pthread_self();
  q->ended_joinable = joinable;
  if (pthread_create(&next, NULL, akv_host_worker_next, q) == 0) {
    q->thread = next;
  } else {
    /* q->thread stays this thread: queue_destroy joins it if joinable. */
    q->joinable = joinable;
    q->exited = true;
    pthread_cond_broadcast(&q->progress);
  }
  /* The last touch of q by this thread: after the unlock, q may be freed. */
  pthread_mutex_unlock(&q->mu);
}

/** The worker thread: runs the ring in order; on stop, drains and exits. */
static void *akv_host_worker(void *arg) {
  akv_bqueue *q = arg;
  int cancel = 0;
  akv_host_self = q;
  /* Invariant: a worker is cancelled, if ever, only inside a host function.
   * A cancellation of this thread (a host function may have handed out
   * pthread_self()) acting in the worker's own waits would end it holding
   * q->mu (pthread_cond_wait takes it back first), and every later enqueue
   * on q would block on that mutex for good. Cancellation is enabled only
   * while a host function runs, where akv_host_fn_ended hands the ring on,
   * and always deferred there: it acts at the function's cancellation points. */
  pthread_setcancelstate(PTHREAD_CANCEL_DISABLE, &cancel);
  pthread_setcanceltype(PTHREAD_CANCEL_DEFERRED, &cancel);
  pthread_mutex_lock(&q->mu);
  for (;;) {
    while (q->head == q->tail && !q->stop) pthread_cond_wait(&q->work, &q->mu);
    if (q->head == q->tail) break; /* stopped and drained */
    uint64_t first = q->head;
    akv_host_op op = q->ring[first % q->cap];
    pthread_mutex_unlock(&q->mu);
    akv_host_delay(q);
    if (op.kind == AKV_HOST_OP_HOSTFN) {
      akv_host_fn_frame frame = {q, first, op.slots};
      pthread_cleanup_push(akv_host_fn_ended, &frame);
      pthread_setcancelstate(PTHREAD_CANCEL_ENABLE, &cancel);
      akv_host_run(q, &op, first);
      pthread_setcancelstate(PTHREAD_CANCEL_DISABLE, &cancel);
      /* A function that left asynchronous cancellation would have the next
       * enable act on a pending cancel before that function ran, its slot
       * counted done, the function skipped: deferred again. */
      pthread_setcanceltype(PTHREAD_CANCEL_DEFERRED, &cancel);
      pthread_cleanup_pop(0);
    } else {
      akv_host_run(q, &op, first);
    }
    pthread_mutex_lock(&q->mu);
    q->head = first + op.slots;
    pthread_cond_broadcast(&q->progress);
    /* Invariant: while a wait is the operation at q's head, its slot's
     * reference on the queue it waits for is held, so a reader of q's head
     * under q->mu may take a reference of its own (akv_host_waits_for). It
     * goes only once head moved past the slot, under the same mutex. */
    if (op.kind == AKV_HOST_OP_WAIT) akv_host_queue_unref(op.u.wait.queue);
  }
  /* No host function runs on this thread any more: whether it is still
   * joinable is final. The last touch of q by this thread: after the
   * unlock, q may be freed. */
  pthread_mutex_unlock(&q->mu);
  const bool joinable = akv_host_reap_self();
  pthread_mutex_lock(&q->mu);
  q->joinable = joinable;
  q->exited = true;
  pthread_cond_broadcast(&q->progress);
  pthread_mutex_unlock(&q->mu);
  return NULL;
}

/* ------------------------------------------------------------------------ */
/* Enqueueing                                                                */
/* ------------------------------------------------------------------------ */

/* Longest chain of cross-queue waits followed (a context's queues are the
 * engine's three and its streams: far fewer). */
#define AKV_HOST_WAIT_CHAIN_MAX 64u
/* How often a worker waiting for room looks at the chain again (10 ms). */
#define AKV_HOST_RECHECK_NS 10000000ull

/**
 * Whether q's worker waits, through a chain of cross-queue waits (each
 * queue's head operation a wait on the next one's position, not reached
 * yet), for the operation `me`'s worker, the calling thread, is running:
 * a host function that enqueues on q. Then q cannot make room before that
 * function returns. Sound on a snapshot: every queue of such a chain stays
 * where it is until the function returns. Called with no queue mutex held;
 * holds one at a time, and a reference on the queue it reads.
 */
static bool akv_host_waits_for(akv_bqueue *q, akv_bqueue *me) {
  akv_bqueue *x = q;
  uint64_t need = 0;
  bool stuck = false;
  akv_host_queue_ref(x); /* the caller's queue argument: live */
  for (uint32_t hop = 0; x != NULL && hop < AKV_HOST_WAIT_CHAIN_MAX; hop++) {
    akv_bqueue *next = NULL;
    pthread_mutex_lock(&x->mu);
    if (x == me) {
      /* me's head is the caller's own operation until it returns */
      stuck = hop > 0 && x->head < need;
      pthread_mutex_unlock(&x->mu);
      break;
    }
    if ((hop == 0 || x->head < need) && x->ring != NULL && x->head < x->tail) {
      const akv_host_op *op = &x->ring[x->head % x->cap];
      if (op->kind == AKV_HOST_OP_WAIT) {
        next = op->u.wait.queue;
        need = op->u.wait.position;
        akv_host_queue_ref(next); /* held by the slot meanwhile (akv_host_worker) */
      }
    }
    pthread_mutex_unlock(&x->mu);
    akv_host_queue_unref(x);
    x = next;
  }
  if (x != NULL) akv_host_queue_unref(x);
  return stuck;
}

/**
 * Reserves `n` consecutive slots of q (n <= q->cap), blocking while the ring
 * is full. On AKV_OK returns with q->mu held and *first the position of the
 * first slot; the caller fills the slots and calls akv_host_commit. On error
 * the mutex is not held. Returns AKV_OK, AKV_ERR_BAD_HANDLE (queue being
 * destroyed), AKV_ERR_BACKEND (no space within the sync timeout) or
 * AKV_ERR_IN_USE (the queue's own worker enqueueing onto its full ring, or
 * a worker of another queue of the context that q waits for:
 * akv_host_waits_for).
 */
static akv_status akv_host_reserve(akv_bqueue *q, uint32_t n, uint64_t *first) {
  akv_status st = AKV_OK;
  bool locked = false;
  struct timespec deadline;
  bool have_deadline = false;
  pthread_mutex_lock(&q->mu);
  locked = true;
  AKV_HOST_CHECK(!q->stop, AKV_ERR_BAD_HANDLE);
  while (q->tail - q->head + n > q->cap) {
    /* The queue's own worker (a host function enqueueing on its queue)
     * would wait for itself: AKV_ERR_IN_USE, nothing reserved. */
    AKV_HOST_CHECK(akv_host_self != q, AKV_ERR_IN_USE);
    /* Invariant: a worker never waits for its own operation. A host
     * function on another queue of this context whose wait for room q
     * cannot end before the function returns (q's worker waits, through
     * cross-queue waits, for work behind it: a stream blocked on a history
     * event behind an attention event recorded after the function) waited
     * out the sync timeout and then failed: AKV_ERR_IN_USE at once,
     * nothing reserved. */
    const bool worker = akv_host_self != NULL && akv_host_self->ctx == q->ctx;
    if (worker) {
      pthread_mutex_unlock(&q->mu);
      locked = false;
      const bool stuck = akv_host_waits_for(q, akv_host_self);
      pthread_mutex_lock(&q->mu);
      locked = true;
      AKV_HOST_CHECK(!stuck, AKV_ERR_IN_USE);
      AKV_HOST_CHECK(!q->stop, AKV_ERR_BAD_HANDLE);
      if (q->tail - q->head + n <= q->cap) break;
    }
    if (!have_deadline) {
      deadline = akv_host_deadline(q->sync_timeout_ns);
      have_deadline = true;
    }
    /* A worker looks again every AKV_HOST_RECHECK_NS: the chain of waits
     * may close after its look (another queue reaching its wait), which
     * wakes nobody waiting on q. */
    const uint64_t end_ns =
        (uint64_t)deadline.tv_sec * 1000000000ull + (uint64_t)deadline.tv_nsec;
    const uint64_t now_ns = akv_host_now_ns();
    const bool slice = worker && now_ns + AKV_HOST_RECHECK_NS < end_ns;
    const struct timespec until = slice ? akv_host_deadline(AKV_HOST_RECHECK_NS) : deadline;
    int rc = pthread_cond_timedwait(&q->progress, &q->mu, &until);
    AKV_HOST_CHECK(rc != ETIMEDOUT || slice || q->tail - q->head + n <= q->cap,
                   AKV_ERR_BACKEND);
    AKV_HOST_CHECK(!q->stop, AKV_ERR_BAD_HANDLE);
  }
  *first = q->tail;
  return AKV_OK;
fail:
  if (locked) pthread_mutex_unlock(&q->mu);
  return st;
}

/** Publishes `n` reserved slots to the worker and releases q->mu. */
static void akv_host_commit(akv_bqueue *q, uint32_t n) {
  q->tail += n;
  pthread_cond_signal(&q->work);
  pthread_mutex_unlock(&q->mu);
}

/** Enqueues one single-slot operation; *end (may be NULL) gets the position after it. */
static akv_status akv_host_enqueue(akv_bqueue *q, const akv_host_op *op, uint64_t *end) {
  uint64_t first = 0;
  akv_status st = akv_host_reserve(q, 1, &first);
  if (st != AKV_OK) return st;
  q->ring[first % q->cap] = *op;
  q->ring[first % q->cap].slots = 1;
  if (end != NULL) *end = first + 1;
  akv_host_commit(q, 1);
  return AKV_OK;
}

/* ------------------------------------------------------------------------ */
/* Lifetime                                                                  */
/* ------------------------------------------------------------------------ */

/** probe: the host backend runs everywhere. Returns AKV_OK. */
static akv_status akv_host_probe(const akv_backend_params *params) {
  (void)params;
  return AKV_OK;
}

/**
 * init: creates a context. `params` may be NULL (no delays). Reads
 * AKV_HOST_SYNC_TIMEOUT_MS. Returns AKV_OK, AKV_ERR_INVALID_ARGUMENT (out
 * NULL), AKV_ERR_OUT_OF_MEMORY, AKV_ERR_BACKEND (mutex creation failed).
 */
static akv_status akv_host_init(const akv_backend_params *params, void **out) {
  akv_status st = AKV_OK;
  akv_host_ctx *c = NULL;
  bool mu = false;
  AKV_HOST_CHECK(out != NULL, AKV_ERR_INVALID_ARGUMENT);
  c = calloc(1, sizeof(*c));
  AKV_HOST_CHECK(c != NULL, AKV_ERR_OUT_OF_MEMORY);
  AKV_HOST_CHECK(pthread_mutex_init(&c->mu, NULL) == 0, AKV_ERR_BACKEND);
  mu = true;
  AKV_HOST_CHECK(pthread_mutex_init(&c->sync_mu, NULL) == 0, AKV_ERR_BACKEND);
  if (params != NULL) {
    c->delay_seed = params->delay_seed;
    c->delay_max_us = params->delay_max_us;
    c->fake_capacity = params->fake_free_bytes;
  }
  c->sync_timeout_ns = (uint64_t)AKV_HOST_SYNC_TIMEOUT_MS_DEFAULT * 1000000u;
  const char *env = getenv("AKV_HOST_SYNC_TIMEOUT_MS");
  if (env != NULL) {
    char *end = NULL;
    unsigned long long ms = strtoull(env, &end, 10);
    if (end != env && *end == '\0' && ms > 0 && ms < 86400000ull)
      c->sync_timeout_ns = (uint64_t)ms * 1000000u;
  }
  c->magic = c->magic_end = AKV_HOST_MAGIC_CTX;
  *out = c;
  return AKV_OK;
fail:
  if (mu) pthread_mutex_destroy(&c->mu);
  free(c);
  return st;
}

/**
 * shutdown: frees the context now when no queue, event or allocation of it is
 * left; otherwise marks it shut and the last release frees it. Joins nothing.
 */
static void akv_host_shutdown(void *ctx) {
  akv_host_ctx *c = ctx;
  if (!akv_host_ctx_ok(c)) return;
  pthread_mutex_lock(&c->mu);
  c->shut = true;
  bool free_now = c->live_objects == 0;
  pthread_mutex_unlock(&c->mu);
  if (free_now) akv_host_ctx_free(c);
}

/* ------------------------------------------------------------------------ */
/* Memory                                                                    */
/* ------------------------------------------------------------------------ */

/**
 * Allocates `bytes` (> 0) aligned to AKV_HOST_ALIGN, with a header right
 * before the returned pointer. Large blocks are lazily committed mappings.
 * Returns AKV_OK, AKV_ERR_INVALID_ARGUMENT, AKV_ERR_BAD_HANDLE,
 * AKV_ERR_OUT_OF_MEMORY.
 */
static akv_status akv_host_block_alloc(void *ctx, size_t bytes, int device, void **out) {
  akv_status st = AKV_OK;
  akv_host_ctx *c = ctx;
  void *base = NULL;
  size_t map_bytes = 0;
  char *user = NULL;
  AKV_HOST_CHECK(akv_host_ctx_ok(c), AKV_ERR_BAD_HANDLE);
  AKV_HOST_CHECK(out != NULL && bytes > 0, AKV_ERR_INVALID_ARGUMENT);
  if (bytes >= AKV_HOST_MMAP_MIN || device) {
    long page = sysconf(_SC_PAGESIZE);
    size_t prefix = page >= (long)AKV_HOST_ALIGN ? (size_t)page : AKV_HOST_ALIGN;
    AKV_HOST_CHECK(bytes <= SIZE_MAX - 2 * prefix, AKV_ERR_OUT_OF_MEMORY);
    map_bytes = prefix + (bytes + prefix - 1) / prefix * prefix;
    base = mmap(NULL, map_bytes, PROT_READ | PROT_WRITE,
                MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    AKV_HOST_CHECK(base != MAP_FAILED, AKV_ERR_OUT_OF_MEMORY);
    user = (char *)base + prefix;
  } else {
    size_t total = AKV_HOST_ALIGN + (bytes + AKV_HOST_ALIGN - 1) / AKV_HOST_ALIGN * AKV_HOST_ALIGN;
    base = aligned_alloc(AKV_HOST_ALIGN, total);
    AKV_HOST_CHECK(base != NULL, AKV_ERR_OUT_OF_MEMORY);
    user = (char *)base + AKV_HOST_ALIGN;
  }
  if (device && c->fake_capacity > 0) {
    /* A modelled device of fake_capacity bytes: an allocation past it fails,
     * as cudaMalloc does on a full card. */
    pthread_mutex_lock(&c->mu);
    bool full = c->device_bytes + bytes > c->fake_capacity;
    pthread_mutex_unlock(&c->mu);
    if (full) {
      if (map_bytes != 0)
        munmap(base, map_bytes);
      else
        free(base);
      st = AKV_ERR_OUT_OF_MEMORY;
      goto fail;
    }
  }
  akv_host_block *h = (akv_host_block *)(void *)(user - sizeof(akv_host_block));
  h->magic = AKV_HOST_MAGIC_BLOCK;
  h->base = base;
  h->map_bytes = map_bytes;
  h->bytes = bytes;
  h->device = device;
  pthread_mutex_lock(&c->mu);
  c->live_objects++;
  if (device) {
    c->device_bytes += bytes;
    if (c->device_bytes > c->device_peak) c->device_peak = c->device_bytes;
  } else {
    c->host_bytes += bytes;
  }
  pthread_mutex_unlock(&c->mu);
  *out = user;
  return AKV_OK;
fail:
  return st;
}

/**
 * Frees a block of the given kind. NULL is ignored, and so is a block of the
 * other allocator (host_free on device memory or the reverse: the header
 * says which); any other pointer must be one this context returned and has
 * not freed yet.
 */
static void akv_host_block_free(void *ctx, void *ptr, int device) {
  akv_host_ctx *c = ctx;
  if (ptr == NULL || !akv_host_ctx_ok(c)) return;
  akv_host_block *h = (akv_host_block *)(void *)((char *)ptr - sizeof(akv_host_block));
  if (h->magic != AKV_HOST_MAGIC_BLOCK || h->device != device) return;
  size_t bytes = h->bytes;
  void *base = h->base;
  size_t map_bytes = h->map_bytes;
  h->magic = AKV_HOST_MAGIC_DEAD;
  if (map_bytes != 0)
    munmap(base, map_bytes);
  else
    free(base);
  pthread_mutex_lock(&c->mu);
  if (device)
    c->device_bytes -= bytes;
  else
    c->host_bytes -= bytes;
  pthread_mutex_unlock(&c->mu);
  akv_host_ctx_put(c);
}

/** host_alloc: "pinned" host memory (see akv_host_block_alloc for statuses). */
static akv_status akv_host_host_alloc(void *ctx, size_t bytes, void **out) {
  return akv_host_block_alloc(ctx, bytes, 0, out);
}

/** host_free: frees a host_alloc block; anything else is ignored. */
static void akv_host_host_free(void *ctx, void *ptr) { akv_host_block_free(ctx, ptr, 0); }

/** device_alloc: "device" memory, which is host memory (see akv_host_block_alloc). */
static akv_status akv_host_device_alloc(void *ctx, size_t bytes, void **out) {
  return akv_host_block_alloc(ctx, bytes, 1, out);
}

/** device_free: frees a device_alloc block; anything else is ignored. */
static void akv_host_device_free(void *ctx, void *ptr) { akv_host_block_free(ctx, ptr, 1); }

/**
 * Stream-ordered free: the worker of q frees the block once everything
 * enqueued on q before it has run (CUDA's cudaFreeAsync). Never blocks the
 * caller except on a full ring (then up to the sync timeout); if the free
 * cannot be enqueued (q being destroyed, ring full too long) the block is
 * freed at once, which the caller's promise (nothing uses it any more once
 * q gets there) allows. The queue holds a reference on the context, so the
 * worker may free after the owner shut the context down.
 */
static void akv_host_free_async(void *ctx, void *ptr, akv_bqueue *q, int device) {
  akv_host_ctx *c = ctx;
  if (ptr == NULL || !akv_host_ctx_ok(c)) return;
  if (akv_host_queue_ok(q) && q->ctx == c) {
    akv_host_op op = {.kind = AKV_HOST_OP_FREE};
    op.u.free.ptr = ptr;
    op.u.free.device = device;
    if (akv_host_enqueue(q, &op, NULL) == AKV_OK) return;
  }
  akv_host_block_free(c, ptr, device);
}

/** device_free_async: a device_alloc block, freed in q's order. */
static void akv_host_device_free_async(void *ctx, void *ptr, akv_bqueue *q) {
  akv_host_free_async(ctx, ptr, q, 1);
}

/** host_free_async: a host_alloc block, freed in q's order. */
static void akv_host_host_free_async(void *ctx, void *ptr, akv_bqueue *q) {
  akv_host_free_async(ctx, ptr, q, 0);
}

/**
 * mem_info: free = 0, total = device bytes allocated now, peak = their peak;
 * with a fake capacity, free = capacity - allocated and total = capacity.
 * Returns AKV_OK, AKV_ERR_BAD_HANDLE, AKV_ERR_INVALID_ARGUMENT.
 */
static akv_status akv_host_mem_info(void *ctx, uint64_t *free_bytes, uint64_t *total_bytes,
                                    uint64_t *peak_used_bytes) {
  akv_status st = AKV_OK;
  akv_host_ctx *c = ctx;
  AKV_HOST_CHECK(akv_host_ctx_ok(c), AKV_ERR_BAD_HANDLE);
  AKV_HOST_CHECK(free_bytes != NULL && total_bytes != NULL && peak_used_bytes != NULL,
                 AKV_ERR_INVALID_ARGUMENT);
  pthread_mutex_lock(&c->mu);
  if (c->fake_capacity > 0) {
    *free_bytes = c->fake_capacity > c->device_bytes ? c->fake_capacity - c->device_bytes : 0;
    *total_bytes = c->fake_capacity;
  } else {
    *free_bytes = 0;
    *total_bytes = c->device_bytes;
  }
  *peak_used_bytes = c->device_peak;
  pthread_mutex_unlock(&c->mu);
  return AKV_OK;
fail:
  return st;
}

/* ------------------------------------------------------------------------ */
/* Queues                                                                    */
/* ------------------------------------------------------------------------ */

/**
 * queue_create: allocates the ring and starts the worker. Returns AKV_OK,
 * AKV_ERR_BAD_HANDLE, AKV_ERR_INVALID_ARGUMENT, AKV_ERR_OUT_OF_MEMORY,
 * AKV_ERR_BACKEND (thread or mutex creation failed).
 */
static akv_status akv_host_queue_create(void *ctx, akv_bqueue **out) {
  akv_status st = AKV_OK;
  akv_host_ctx *c = ctx;
  akv_bqueue *q = NULL;
  int made = 0; /* 1 mutex, 2 work, 3 progress */
  AKV_HOST_CHECK(akv_host_ctx_ok(c), AKV_ERR_BAD_HANDLE);
  AKV_HOST_CHECK(out != NULL, AKV_ERR_INVALID_ARGUMENT);
  q = calloc(1, sizeof(*q));
  AKV_HOST_CHECK(q != NULL, AKV_ERR_OUT_OF_MEMORY);
  q->cap = AKV_HOST_RING_SLOTS;
  q->ring = calloc(q->cap, sizeof(*q->ring));
  AKV_HOST_CHECK(q->ring != NULL, AKV_ERR_OUT_OF_MEMORY);
  AKV_HOST_CHECK(pthread_mutex_init(&q->mu, NULL) == 0, AKV_ERR_BACKEND);
  made = 1;
  AKV_HOST_CHECK(pthread_cond_init(&q->work, NULL) == 0, AKV_ERR_BACKEND);
  made = 2;
  AKV_HOST_CHECK(akv_host_cond_init(&q->progress) == 0, AKV_ERR_BACKEND);
  made = 3;
  atomic_init(&q->refs, 1u);
  q->ctx = c;
  q->delay_seed = c->delay_seed;
  q->delay_max_us = c->delay_max_us;
  q->sync_timeout_ns = c->sync_timeout_ns;
  q->magic = q->magic_end = AKV_HOST_MAGIC_QUEUE;

  pthread_mutex_lock(&c->sync_mu); /* the list changes: not under device_synchronize */
  pthread_mutex_lock(&c->mu);
  q->index = c->next_index;
  q->prng = c->delay_seed ^ (uint64_t)q->index;
  /* The worker reads q->thread only under q->mu; holding it across
   * pthread_create publishes the id before the worker can look. */
  pthread_mutex_lock(&q->mu);
  int rc = pthread_create(&q->thread, NULL, akv_host_worker, q);
  pthread_mutex_unlock(&q->mu);
  if (rc == 0) {
    c->next_index++;
    c->live_objects++;
    q->next = c->queues;
    if (c->queues != NULL) c->queues->prev = q;
    c->queues = q;
  }
  pthread_mutex_unlock(&c->mu);
  pthread_mutex_unlock(&c->sync_mu);
  AKV_HOST_CHECK(rc == 0, AKV_ERR_BACKEND);
  *out = q;
  return AKV_OK;
fail:
  if (q != NULL) {
    if (made >= 3) pthread_cond_destroy(&q->progress);
    if (made >= 2) pthread_cond_destroy(&q->work);
    if (made >= 1) pthread_mutex_destroy(&q->mu);
    free(q->ring);
    free(q);
  }
  return st;
}

/**
 * queue_destroy: lets every enqueued operation run, joins the last worker
 * (unless a host function detached it: akv_host_reap_self), frees the ring.
 * Must not be called from a host function on `q` itself.
 */
static void akv_host_queue_destroy(void *ctx, akv_bqueue *q) {
  akv_host_ctx *c = ctx;
  if (!akv_host_ctx_ok(c) || !akv_host_queue_ok(q) || q->ctx != c) return;
  pthread_mutex_lock(&c->sync_mu); /* not while device_synchronize walks the list */
  pthread_mutex_lock(&c->mu);
  if (q->prev != NULL) q->prev->next = q->next;
  else c->queues = q->next;
  if (q->next != NULL) q->next->prev = q->prev;
  q->next = q->prev = NULL;
  pthread_mutex_unlock(&c->mu);
  pthread_mutex_unlock(&c->sync_mu);

  pthread_mutex_lock(&q->mu);
  q->stop = true;
  pthread_cond_signal(&q->work);
  pthread_cond_broadcast(&q->progress); /* enqueuers blocked on a full ring give up */
  /* The worker may change while it drains (a host function that ends its
   * thread hands the ring to a successor, which joins it): join the one
   * that left the loop, the last, unless a function detached it. */
  while (!q->exited) pthread_cond_wait(&q->progress, &q->mu);
  const pthread_t last = q->thread;
  const bool joinable = q->joinable;
  pthread_mutex_unlock(&q->mu);
  if (joinable) pthread_join(last, NULL);

  q->magic = q->magic_end = AKV_HOST_MAGIC_DEAD;
  pthread_mutex_lock(&q->mu);
  free(q->ring);
  q->ring = NULL;
  pthread_mutex_unlock(&q->mu);
  akv_host_queue_unref(q);
  akv_host_ctx_put(c);
}

/**
 * queue_is_current: true on q's own worker (a host function on q calling
 * back), where queue_destroy would wait for the thread it runs on.
 */
static bool akv_host_queue_is_current(void *ctx, akv_bqueue *q) {
  /* Each worker, a successor too (akv_host_fn_ended), names its queue in
   * akv_host_self: no lock, and right while the ring changes hands. */
  return akv_host_ctx_ok(ctx) && akv_host_queue_ok(q) && q->ctx == ctx && akv_host_self == q;
}

/**
 * queue_pending: true while an operation enqueued on q has not finished
 * (head behind tail), so that queue_destroy's drain would wait for it.
 */
static bool akv_host_queue_pending(void *ctx, akv_bqueue *q) {
  if (!akv_host_ctx_ok(ctx) || !akv_host_queue_ok(q) || q->ctx != ctx) return false;
  pthread_mutex_lock(&q->mu);
  const bool pending = q->head < q->tail;
  pthread_mutex_unlock(&q->mu);
  return pending;
}

/**
 * Blocks until everything enqueued on q so far has run, or the deadline
 * passes. Returns AKV_OK or AKV_ERR_BACKEND.
 */
static akv_status akv_host_queue_drain(akv_bqueue *q, const struct timespec *deadline) {
  pthread_mutex_lock(&q->mu);
  akv_status st = akv_host_wait_position(q, q->tail, deadline);
  pthread_mutex_unlock(&q->mu);
  return st;
}

/**
 * queue_synchronize: blocks until everything enqueued on q so far has run.
 * Returns AKV_OK, AKV_ERR_BAD_HANDLE, AKV_ERR_BACKEND (completion could not
 * be established within the sync timeout).
 */
static akv_status akv_host_queue_synchronize(void *ctx, akv_bqueue *q) {
  akv_status st = AKV_OK;
  AKV_HOST_CHECK(akv_host_ctx_ok(ctx) && akv_host_queue_ok(q) && q->ctx == ctx,
                 AKV_ERR_BAD_HANDLE);
  struct timespec deadline = akv_host_deadline(q->sync_timeout_ns);
  st = akv_host_queue_drain(q, &deadline);
  AKV_HOST_CHECK(st == AKV_OK, st);
  return AKV_OK;
fail:
  return st;
}

/**
 * device_synchronize: synchronizes every live queue of the context, all
 * within one sync timeout. Returns AKV_OK, AKV_ERR_BAD_HANDLE,
 * AKV_ERR_BACKEND (completion could not be established).
 */
static akv_status akv_host_device_synchronize(void *ctx) {
  akv_status st = AKV_OK;
  akv_host_ctx *c = ctx;
  AKV_HOST_CHECK(akv_host_ctx_ok(c), AKV_ERR_BAD_HANDLE);
  struct timespec deadline = akv_host_deadline(c->sync_timeout_ns);
  /* sync_mu keeps the list stable while we block without holding c->mu, so
   * allocations and event creation go on meanwhile. */
  pthread_mutex_lock(&c->sync_mu);
  for (akv_bqueue *q = c->queues; q != NULL && st == AKV_OK; q = q->next)
    st = akv_host_queue_drain(q, &deadline);
  pthread_mutex_unlock(&c->sync_mu);
  AKV_HOST_CHECK(st == AKV_OK, st);
  return AKV_OK;
fail:
  return st;
}

/* ------------------------------------------------------------------------ */
/* Events                                                                    */
/* ------------------------------------------------------------------------ */

/**
 * event_create: a never-recorded event. Returns AKV_OK, AKV_ERR_BAD_HANDLE,
 * AKV_ERR_INVALID_ARGUMENT, AKV_ERR_OUT_OF_MEMORY, AKV_ERR_BACKEND.
 */
static akv_status akv_host_event_create(void *ctx, akv_bevent **out) {
  akv_status st = AKV_OK;
  akv_host_ctx *c = ctx;
  akv_bevent *e = NULL;
  AKV_HOST_CHECK(akv_host_ctx_ok(c), AKV_ERR_BAD_HANDLE);
  AKV_HOST_CHECK(out != NULL, AKV_ERR_INVALID_ARGUMENT);
  e = calloc(1, sizeof(*e));
  AKV_HOST_CHECK(e != NULL, AKV_ERR_OUT_OF_MEMORY);
  AKV_HOST_CHECK(pthread_mutex_init(&e->mu, NULL) == 0, AKV_ERR_BACKEND);
  e->ctx = c;
  e->magic = e->magic_end = AKV_HOST_MAGIC_EVENT;
  akv_host_ctx_get(c);
  *out = e;
  return AKV_OK;
fail:
  free(e);
  return st;
}

/** event_destroy: frees the event; waits already enqueued on it stay valid. */
static void akv_host_event_destroy(void *ctx, akv_bevent *e) {
  akv_host_ctx *c = ctx;
  if (!akv_host_ctx_ok(c) || !akv_host_event_ok(e) || e->ctx != c) return;
  pthread_mutex_lock(&e->mu);
  akv_bqueue *q = e->queue;
  e->queue = NULL;
  e->magic = e->magic_end = AKV_HOST_MAGIC_DEAD;
  pthread_mutex_unlock(&e->mu);
  if (q != NULL) akv_host_queue_unref(q);
  pthread_mutex_destroy(&e->mu);
  free(e);
  akv_host_ctx_put(c);
}

/**
 * event_record: enqueues a marker on q; the event's capture becomes
 * "everything enqueued on q up to here", replacing any earlier capture.
 * Returns AKV_OK, AKV_ERR_BAD_HANDLE, AKV_ERR_BACKEND (ring full too long).
 */
static akv_status akv_host_event_record(void *ctx, akv_bevent *e, akv_bqueue *q) {
  akv_status st = AKV_OK;
  uint64_t end = 0;
  AKV_HOST_CHECK(akv_host_ctx_ok(ctx) && akv_host_event_ok(e) && akv_host_queue_ok(q) &&
                     e->ctx == ctx && q->ctx == ctx,
                 AKV_ERR_BAD_HANDLE);
  akv_host_op op = {.kind = AKV_HOST_OP_RECORD};
  st = akv_host_enqueue(q, &op, &end);
  AKV_HOST_CHECK(st == AKV_OK, st);
  akv_host_queue_ref(q);
  pthread_mutex_lock(&e->mu);
  akv_bqueue *old = e->queue;
  e->queue = q;
  e->position = end;
  pthread_mutex_unlock(&e->mu);
  if (old != NULL) akv_host_queue_unref(old);
  return AKV_OK;
fail:
  return st;
}

/**
 * queue_wait: later work on q waits until the capture of e current now has
 * completed. No-op for a never-recorded event. Returns AKV_OK,
 * AKV_ERR_BAD_HANDLE, AKV_ERR_BACKEND (ring full too long).
 */
static akv_status akv_host_queue_wait(void *ctx, akv_bqueue *q, akv_bevent *e) {
  akv_status st = AKV_OK;
  akv_bqueue *src = NULL;
  AKV_HOST_CHECK(akv_host_ctx_ok(ctx) && akv_host_event_ok(e) && akv_host_queue_ok(q) &&
                     e->ctx == ctx && q->ctx == ctx,
                 AKV_ERR_BAD_HANDLE);
  akv_host_op op = {.kind = AKV_HOST_OP_WAIT};
  pthread_mutex_lock(&e->mu);
  src = e->queue;
  op.u.wait.queue = src;
  op.u.wait.position = e->position;
  if (src != NULL) akv_host_queue_ref(src); /* the wait slot's reference */
  pthread_mutex_unlock(&e->mu);
  if (src == NULL) return AKV_OK;
  st = akv_host_enqueue(q, &op, NULL);
  AKV_HOST_CHECK(st == AKV_OK, st);
  return AKV_OK;
fail:
  if (src != NULL) akv_host_queue_unref(src);
  return st;
}

/**
 * Copies e's current capture, with a reference on its queue (NULL: never
 * recorded, nothing to wait for).
 */
static akv_bqueue *akv_host_event_capture(akv_bevent *e, uint64_t *position) {
  pthread_mutex_lock(&e->mu);
  akv_bqueue *q = e->queue;
  *position = e->position;
  if (q != NULL) akv_host_queue_ref(q);
  pthread_mutex_unlock(&e->mu);
  return q;
}

/**
 * event_query: *done = the current capture has completed (true for a
 * never-recorded event). Returns AKV_OK, AKV_ERR_BAD_HANDLE,
 * AKV_ERR_INVALID_ARGUMENT.
 */
static akv_status akv_host_event_query(void *ctx, akv_bevent *e, bool *done) {
  akv_status st = AKV_OK;
  uint64_t position = 0;
  AKV_HOST_CHECK(akv_host_ctx_ok(ctx) && akv_host_event_ok(e) && e->ctx == ctx,
                 AKV_ERR_BAD_HANDLE);
  AKV_HOST_CHECK(done != NULL, AKV_ERR_INVALID_ARGUMENT);
  akv_bqueue *q = akv_host_event_capture(e, &position);
  bool complete = true;
  if (q != NULL) {
    pthread_mutex_lock(&q->mu);
    complete = q->head >= position;
    pthread_mutex_unlock(&q->mu);
    akv_host_queue_unref(q);
  }
  *done = complete;
  return AKV_OK;
fail:
  return st;
}

/**
 * event_synchronize: blocks until the current capture of e has completed
 * (at once for a never-recorded event). Returns AKV_OK, AKV_ERR_BAD_HANDLE,
 * AKV_ERR_BACKEND (completion could not be established within the sync
 * timeout).
 */
static akv_status akv_host_event_synchronize(void *ctx, akv_bevent *e) {
  akv_status st = AKV_OK;
  uint64_t position = 0;
  AKV_HOST_CHECK(akv_host_ctx_ok(ctx) && akv_host_event_ok(e) && e->ctx == ctx,
                 AKV_ERR_BAD_HANDLE);
  akv_host_ctx *c = ctx;
  akv_bqueue *q = akv_host_event_capture(e, &position);
  if (q != NULL) {
    struct timespec deadline = akv_host_deadline(c->sync_timeout_ns);
    pthread_mutex_lock(&q->mu);
    st = akv_host_wait_position(q, position, &deadline);
    pthread_mutex_unlock(&q->mu);
    akv_host_queue_unref(q);
  }
  AKV_HOST_CHECK(st == AKV_OK, st);
  return AKV_OK;
fail:
  return st;
}

/* ------------------------------------------------------------------------ */
/* Copies and host functions                                                 */
/* ------------------------------------------------------------------------ */

/**
 * copy: enqueues one memcpy on q (`dir` is checked, otherwise informational).
 * Returns AKV_OK, AKV_ERR_BAD_HANDLE, AKV_ERR_INVALID_ARGUMENT (NULL pointer
 * with bytes > 0, bad dir), AKV_ERR_BACKEND (ring full too long).
 */
static akv_status akv_host_copy(void *ctx, akv_bqueue *q, akv_copy_dir dir, void *dst,
                                const void *src, size_t bytes) {
  akv_status st = AKV_OK;
  AKV_HOST_CHECK(akv_host_ctx_ok(ctx) && akv_host_queue_ok(q) && q->ctx == ctx,
                 AKV_ERR_BAD_HANDLE);
  AKV_HOST_CHECK(dir == AKV_COPY_H2D || dir == AKV_COPY_D2H || dir == AKV_COPY_D2D,
                 AKV_ERR_INVALID_ARGUMENT);
  AKV_HOST_CHECK(bytes == 0 || (dst != NULL && src != NULL), AKV_ERR_INVALID_ARGUMENT);
  akv_host_op op = {.kind = AKV_HOST_OP_COPY};
  op.u.copy.dst = dst;
  op.u.copy.src = src;
  op.u.copy.bytes = bytes;
  st = akv_host_enqueue(q, &op, NULL);
  AKV_HOST_CHECK(st == AKV_OK, st);
  return AKV_OK;
fail:
  return st;
}

/**
 * copy_batch: enqueues `count` copies as one operation. The arrays are read
 * during the call and may be reused as soon as it returns. A batch longer
 * than the ring holds is split into consecutive operations (same order).
 * Everything is validated before anything is enqueued. Returns AKV_OK,
 * AKV_ERR_BAD_HANDLE, AKV_ERR_INVALID_ARGUMENT, AKV_ERR_BACKEND (ring full
 * too long; part of the batch may have been enqueued).
 */
static akv_status akv_host_copy_batch(void *ctx, akv_bqueue *q, akv_copy_dir dir, size_t count,
                                      void *const *dst, const void *const *src,
                                      const size_t *bytes) {
  akv_status st = AKV_OK;
  AKV_HOST_CHECK(akv_host_ctx_ok(ctx) && akv_host_queue_ok(q) && q->ctx == ctx,
                 AKV_ERR_BAD_HANDLE);
  AKV_HOST_CHECK(dir == AKV_COPY_H2D || dir == AKV_COPY_D2H || dir == AKV_COPY_D2D,
                 AKV_ERR_INVALID_ARGUMENT);
  AKV_HOST_CHECK(count >= 1 && dst != NULL && src != NULL && bytes != NULL,
                 AKV_ERR_INVALID_ARGUMENT);
  for (size_t i = 0; i < count; i++)
    AKV_HOST_CHECK(bytes[i] == 0 || (dst[i] != NULL && src[i] != NULL),
                   AKV_ERR_INVALID_ARGUMENT);
  size_t done = 0;
  while (done < count) {
    size_t left = count - done;
    uint32_t n = left < (size_t)(q->cap - 1) ? (uint32_t)left : q->cap - 1;
    uint64_t first = 0;
    st = akv_host_reserve(q, n + 1, &first);
    AKV_HOST_CHECK(st == AKV_OK, st);
    akv_host_op *h = &q->ring[first % q->cap];
    h->kind = AKV_HOST_OP_BATCH;
    h->slots = n + 1;
    for (uint32_t i = 0; i < n; i++) {
      akv_host_op *s = &q->ring[(first + 1 + i) % q->cap];
      s->kind = AKV_HOST_OP_COPY;
      s->slots = 1;
      s->u.copy.dst = dst[done + i];
      s->u.copy.src = src[done + i];
      s->u.copy.bytes = bytes[done + i];
    }
    akv_host_commit(q, n + 1);
    done += n;
  }
  return AKV_OK;
fail:
  return st;
}

/**
 * host_fn: enqueues fn(arg), run on q's worker thread. Returns AKV_OK,
 * AKV_ERR_BAD_HANDLE, AKV_ERR_INVALID_ARGUMENT (fn NULL), AKV_ERR_BACKEND
 * (ring full too long), AKV_ERR_IN_USE (ring full while it waits for the
 * enqueuer: from q's own worker, or akv_host_waits_for; nothing enqueued).
 */
static akv_status akv_host_host_fn(void *ctx, akv_bqueue *q, void (*fn)(void *), void *arg) {
  akv_status st = AKV_OK;
  AKV_HOST_CHECK(akv_host_ctx_ok(ctx) && akv_host_queue_ok(q) && q->ctx == ctx,
                 AKV_ERR_BAD_HANDLE);
  AKV_HOST_CHECK(fn != NULL, AKV_ERR_INVALID_ARGUMENT);
  akv_host_op op = {.kind = AKV_HOST_OP_HOSTFN};
  op.u.host.fn = fn;
  op.u.host.arg = arg;
  st = akv_host_enqueue(q, &op, NULL);
  AKV_HOST_CHECK(st == AKV_OK, st);
  return AKV_OK;
fail:
  return st;
}

/* ------------------------------------------------------------------------ */
/* The table                                                                 */
/* ------------------------------------------------------------------------ */

/** The host backend's operations table (see backend.h for the contract). */
const akv_backend_ops akv_backend_host_ops = {
    .name = "host",
    .kind = AKV_BACKEND_HOST,
    .probe = akv_host_probe,
    .init = akv_host_init,
    .shutdown = akv_host_shutdown,
    .host_alloc = akv_host_host_alloc,
    .host_free = akv_host_host_free,
    .device_alloc = akv_host_device_alloc,
    .device_free = akv_host_device_free,
    .queue_create = akv_host_queue_create,
    .queue_destroy = akv_host_queue_destroy,
    .event_create = akv_host_event_create,
    .event_destroy = akv_host_event_destroy,
    .event_record = akv_host_event_record,
    .queue_wait = akv_host_queue_wait,
    .event_query = akv_host_event_query,
    .event_synchronize = akv_host_event_synchronize,
    .queue_synchronize = akv_host_queue_synchronize,
    .device_synchronize = akv_host_device_synchronize,
    .copy = akv_host_copy,
    .copy_batch = akv_host_copy_batch,
    .host_fn = akv_host_host_fn,
    .mem_info = akv_host_mem_info,
    .device_free_async = akv_host_device_free_async,
    .host_free_async = akv_host_host_free_async,
    .queue_is_current = akv_host_queue_is_current,
    .queue_pending = akv_host_queue_pending,
};
