/*
 * akv.h - the public C API of libactivekv.
 *
 * ActiveKV keeps the K/V history of LLM decode contexts in pinned host memory
 * and stages it onto the device one dense layer at a time, just in time for the
 * caller's attention kernel, then writes the step's new rows back.
 *
 * Conventions (stated once, repeated per function where they differ):
 *  - Every fallible call returns an akv_status; outputs go through pointers and
 *    are left untouched when the call fails. The one exception is
 *    akv_engine_quarantine's report, filled also on AKV_ERR_UNCERTAIN_FENCE
 *    to name the fence that was uncertain.
 *  - A failing call changes nothing, except where it says it marks the
 *    transport failed (AKV_ERR_BACKEND): from then on the engine accepts only
 *    diagnostics, akv_stream_destroy, akv_engine_quarantine and
 *    akv_engine_destroy.
 *  - Last error: a call refused on a live engine writes what went wrong, in
 *    words naming the call, to that engine's last error
 *    (akv_engine_last_error), diagnostics included (a NULL output, a cap
 *    or count of 0, a context not open on the engine). It is left alone
 *    only where there is no engine of the caller's to write to or the
 *    refusal must change nothing of it: AKV_ERR_BAD_HANDLE and
 *    AKV_ERR_IN_USE from the handle check and the claim (Thread safety),
 *    a change refused from the log callback (akv_log_fn),
 *    AKV_ERR_NOT_READY (akv_lease_try_retire), and akv_lease_attend's
 *    AKV_ERR_BAD_HANDLE after a hook that ended its lease.
 *  - Thread safety: an engine and everything made from it (contexts, leases,
 *    streams) are used from one thread at a time, and the engine enforces
 *    it. Every call that takes an engine, or a context or lease of one,
 *    claims that engine once the handle is checked and lets go of it when
 *    it returns (one compare-exchange and one store on the engine, and the
 *    thread's cancel state set and restored, per call; calls made from
 *    inside another call only count their depth). While
 *    one thread is inside a call on an engine, a call from any other thread
 *    on that engine, on a context or lease of it, or on a stream through it
 *    (akv_engine_destroy and akv_engine_quarantine included) returns
 *    AKV_ERR_IN_USE at once, never waits, and changes nothing: no output,
 *    no counter, no log line, and the engine's last error stays the one the
 *    call in progress writes (akv_engine_last_error from another thread
 *    then returns the static string "engine in use by another thread").
 *    Every call on an engine or its handles may return it so, whether or
 *    not the list of statuses under its declaration names it (most do).
 *    Retry it once that call returned; between calls an engine may move
 *    from thread to thread. Another thread's destroy is thereby never run
 *    under a call in progress. The thread inside a call may call the engine
 *    again from the
 *    code the call runs: the attention hook of akv_lease_attend (every
 *    call, destroy included) and the log callback (the rules of
 *    akv_log_fn). A function enqueued with akv_stream_launch_host runs on
 *    another thread (a worker, or a CUDA runtime thread): its calls on the
 *    engine are refused with AKV_ERR_IN_USE while a call is in progress,
 *    among them the akv_stream_synchronize waiting for it (no deadlock:
 *    the claim never waits); on the CUDA backend they are refused always
 *    (no CUDA call is permitted on that thread). The library calls the log callback only on
 *    the thread of the call that logs, never on a worker. An engine call
 *    is no cancellation point: cancellation is disabled from the outermost
 *    claim to its release (a pending pthread_cancel acts after the call
 *    returned). Limits: the claim tells threads apart, not callers (code
 *    that runs on the thread inside a call, a hook or a callback, nests in
 *    that call instead of being refused); it guards the library's state,
 *    not the caller's memory a call reads or writes (row buffers, outputs),
 *    nor a cudaStream_t; and a handle is checked by its magic words as
 *    before, so a pointer that is no handle at all is still undefined
 *    behaviour. A context of another engine passed to a call
 *    (akv_step_begin, akv_lease_write_back, akv_admission_explain) is
 *    refused having read only its handle words (magics, engine, open
 *    flag, all atomic), so that engine may meanwhile be in use by another
 *    thread, even reopening that very record. Functions that take no engine
 *    (akv_status_string, akv_version_*, akv_fit, akv_engine_config_init,
 *    akv_engine_create, the attention functions of akv_attention.h and
 *    akv_cuda.h) are safe from any thread.
 *  - fork: a child forked while other threads are inside calls may create
 *    and use engines of its own (the process-wide record pools are never
 *    left locked in it). Engines of the parent, and everything made from
 *    them, are the parent's: their queue threads are not in the child, so
 *    every call the child makes on them (on their contexts, leases and
 *    streams too, akv_engine_destroy included) returns AKV_ERR_BAD_HANDLE
 *    at once and changes nothing (so does, in the child, an akv_lease_attend
 *    whose attention hook forked, once the hook returns); the child's copy
 *    of their memory goes with the child. An akv_engine_create whose log
 *    callback forks makes, in the child, an engine of the child's own when
 *    the fork came before the engine started its queues (the fit and
 *    config lines), and otherwise (from its backend's start on: the
 *    headroom line, "engine ready") one of the parent's: it returns
 *    AKV_ERR_BAD_HANDLE there, *out untouched.
 *  - Streams: enqueueing calls return when their work has been enqueued, not
 *    when it has run. The engine owns two copy queues (host->device and
 *    device->host) and one materialisation queue (device->device). The compute
 *    stream is always the caller's. Ordering between queues is on the device,
 *    through events.
 *  - Blocking. These calls can block the calling thread, and on nothing else:
 *     - akv_lease_retire: until every event of the lease completed (copies,
 *       attention, write-back);
 *     - akv_engine_quarantine: until the H2D, D2H and D2D queues and the
 *       device are idle (host backend: each gives up after its sync timeout);
 *     - akv_stream_synchronize: until the stream's work ran;
 *     - akv_stream_destroy: host backend, until the stream's work ran and its
 *       worker thread was joined (unless a function detached it:
 *       akv_stream_launch_host); CUDA, as cudaStreamDestroy;
 *     - akv_engine_create: allocation and queue creation (host backend: one
 *       worker thread per queue; paged route with poison_holes: one H2D copy
 *       waited for); akv_engine_destroy: joins the engine's own idle
 *       queue threads (host backend) and unmaps its memory; it
 *       waits on nothing of the caller's and never for queued work
 *       (AKV_ERR_BUSY instead); see akv_engine_destroy for the one
 *       exception (no host memory pools);
 *     - every call that enqueues (akv_step_begin, akv_lease_begin,
 *       akv_lease_wait_ready, akv_lease_mark_consumed, akv_lease_attend,
 *       akv_lease_write_back, akv_stream_launch_host): host backend, while
 *       the target queue's ring is full, until its worker frees a slot (at
 *       most the sync timeout, then AKV_ERR_BACKEND; not at all from a
 *       function akv_stream_launch_host runs that the full queue waits for:
 *       that worker's own, or one whose work the queue waits for through
 *       the engine's queues; akv_stream_launch_host then answers
 *       AKV_ERR_IN_USE with nothing enqueued, the other calls
 *       AKV_ERR_BACKEND at once, the transport failed); CUDA, where the
 *       runtime itself blocks an enqueue (a full launch queue);
 *     - akv_engine_create, akv_engine_destroy, akv_context_open,
 *       akv_context_close: a process-wide mutex over the handle record pools,
 *       held for a few instructions (other threads' creates, destroys, opens
 *       and closes);
 *     - any call that logs: for as long as the caller's log callback runs;
 *     - headroom (CUDA): akv_headroom_take, its device allocations
 *       (cudaMalloc); akv_headroom_release outside a step, akv_step_end
 *       with a release pending and a quarantine that frees one, the
 *       cudaFree of each chunk, which may wait for the device to go idle
 *       (the runtime's rule). Host backend: a mapping or an unmapping.
 *    No other call blocks. akv_lease_try_retire is the non-blocking retire.
 *  - ABI: within one soname (libactivekv.so.MAJOR; before 1.0 every minor
 *    version may change the ABI and has its own, libactivekv.so.0.MINOR),
 *    functions are only added, enum values only appended, and config structs
 *    only grow at their end; each config carries its size and version so an
 *    older caller keeps working against a newer library: the fields its
 *    smaller struct holds entirely are taken, every later field gets its
 *    _INIT default, and any version from 1 to AKV_CONFIG_VERSION is
 *    accepted. (A field appended later always grows the struct's size.)
 *    Structs the library fills in the caller's memory without being told
 *    their size are written at the library's own size: akv_engine_info,
 *    akv_headroom_info, akv_fit_report, akv_quarantine_report, akv_receipt,
 *    akv_view, akv_fence, akv_adm_decision (arrays of them), and
 *    akv_engine_config as akv_engine_config_init writes it (likewise
 *    akv_attention_args and akv_group_info in their headers). Their sizes
 *    never change within a soname, so a caller built against any header of
 *    its soname has room for every one of them. A binding that loads the
 *    library by path rather than by soname gives each of them room to spare.
 */
#ifndef AKV_H
#define AKV_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define AKV_API
#elif defined(AKV_BUILDING_LIBRARY)
#define AKV_API __attribute__((visibility("default")))
#else
#define AKV_API
#endif

#define AKV_VERSION_MAJOR 0
#define AKV_VERSION_MINOR 3
#define AKV_VERSION_PATCH 0
#define AKV_VERSION_NUMBER \
  (AKV_VERSION_MAJOR * 10000 + AKV_VERSION_MINOR * 100 + AKV_VERSION_PATCH)

/** Version of the library actually loaded (compare with AKV_VERSION_NUMBER). */
AKV_API unsigned akv_version_number(void);
/** "MAJOR.MINOR.PATCH" of the loaded library; static storage. */
AKV_API const char *akv_version_string(void);

/* ------------------------------------------------------------------------ */
/* Status codes                                                              */
/* ------------------------------------------------------------------------ */

typedef enum akv_status {
  AKV_OK = 0,
  /** A required pointer was NULL or a numeric argument was out of range. */
  AKV_ERR_INVALID_ARGUMENT = 1,
  /** A handle failed its check: NULL, dead (engine destroyed, context closed,
   *  lease retired; see "Handle lifetimes"), or not a handle of this type. */
  AKV_ERR_BAD_HANDLE = 2,
  /** Config struct with a wrong size/version, or inconsistent geometry. */
  AKV_ERR_CONFIG = 3,
  /** refuse mode: the configured concurrency does not fit the host pool
   *  (shrink mode: not one history fits it). */
  AKV_ERR_NO_FIT = 4,
  /** shrink mode: every host slot is taken; queue the request and retry later. */
  AKV_ERR_REFUSED_QUEUE = 5,
  /** The device page pool cannot admit the context's target (see explain). */
  AKV_ERR_ADMISSION_REFUSED = 6,
  /** A host or device allocation failed at create time. */
  AKV_ERR_OUT_OF_MEMORY = 7,
  /** A context has no room left (max_tokens reached). */
  AKV_ERR_CAPACITY = 8,
  /** Step misuse: begin inside a step, end with unretired leases, ... */
  AKV_ERR_STEP_STATE = 9,
  /** Lease begin while the previous lease is neither sealed nor retired. */
  AKV_ERR_LEASE_ORDER = 10,
  /** The lease is not in a state that allows this call. */
  AKV_ERR_LEASE_STATE = 11,
  /** Write-back named a host owner the lease did not begin with. */
  AKV_ERR_OWNER_MISMATCH = 12,
  /** Seal was given a fence other than the one the engine recorded. */
  AKV_ERR_FENCE_MISMATCH = 13,
  /** A backend operation failed; the transport is now marked failed. */
  AKV_ERR_BACKEND = 14,
  /** The transport failed earlier; only diagnostics, quarantine, destroy. */
  AKV_ERR_QUARANTINED = 15,
  /** Destroy/close with live work; nothing was freed. */
  AKV_ERR_BUSY = 16,
  /** Quarantine could not establish completion; everything stays retained. */
  AKV_ERR_UNCERTAIN_FENCE = 17,
  /** The feature or backend is not available in this build or on this machine. */
  AKV_ERR_NOT_SUPPORTED = 18,
  /** The object is in use by the current step (close a context mid-step, ...),
   *  the call came from the engine's own log callback (see akv_log_fn), or
   *  another thread is inside a call on the engine (Thread safety, at the
   *  top); nothing changed. */
  AKV_ERR_IN_USE = 19,
  /** step_begin: a context's dense layers hold different row counts (filled
   *  unevenly through akv_context_append_layer); nothing changed. */
  AKV_ERR_UNEVEN_LAYERS = 20,
  /** Group (akv_group.h): a rank did not arrive at an agreement point within
   *  the group's timeout; the communicator was aborted and this rank's engine
   *  quarantined. */
  AKV_ERR_TIMEOUT = 21,
  /** Group: the communicator failed (an error or asynchronous error of the
   *  collective, or an abort); the communicator was aborted and this rank's
   *  engine quarantined. */
  AKV_ERR_COMM = 22,
  /** Group: ranks gave different inputs at an agreement point (contexts,
   *  lengths, geometry); every rank returns it and nothing changed on any. */
  AKV_ERR_DISAGREE = 23,
  /** Not yet: a fence has not passed (akv_lease_try_retire); nothing changed, try again. */
  AKV_ERR_NOT_READY = 24,
  AKV_STATUS_COUNT_ = 25
} akv_status;

/** A short English description of a status; never NULL, static storage.
 *  Thread-safe. Unknown values give "unknown status". */
AKV_API const char *akv_status_string(akv_status status);

/* ------------------------------------------------------------------------ */
/* Handles                                                                   */
/* ------------------------------------------------------------------------ */

typedef struct akv_engine akv_engine;   /**< one engine: pools, queues, admission */
typedef struct akv_context akv_context; /**< one request's history */
typedef struct akv_lease akv_lease;     /**< one staged layer, begin..retire */

/*
 * Handle lifetimes. Engine, context and lease handles are records the library
 * takes from process-wide pools and never frees: a handle that died (engine
 * destroyed, context closed or freed with its engine, lease retired or
 * released by quarantine) stays readable and answers AKV_ERR_BAD_HANDLE,
 * changing nothing. Free records are handed out again in FIFO order, so a
 * dead handle could only come back to life (naming a newer object) after the
 * number of later hand-outs below; do not keep dead handles.
 *  - engine: at least AKV_ENGINE_HANDLE_REUSE_MIN later successful
 *    akv_engine_create calls in the process;
 *  - context: at least AKV_CONTEXT_HANDLE_REUSE_MIN later successful
 *    akv_context_open calls in the process (on any engine), whatever stays
 *    open meanwhile; a context freed by akv_engine_destroy likewise;
 *  - lease: at least (AKV_LEASE_HANDLES_PER_LAYER - 1) x n_dense_layers later
 *    akv_lease_begin calls on its engine (15 whole steps); once its engine is
 *    destroyed, at least AKV_LEASE_HANDLE_REUSE_MIN lease handle records
 *    handed to later engines (each takes AKV_LEASE_HANDLES_PER_LAYER per dense
 *    layer at create);
 *  - stream (host backend, from akv_stream_create): at least
 *    AKV_STREAM_HANDLE_REUSE_MIN later successful akv_stream_create calls
 *    in the process (on any engine); until then every call that takes a
 *    stream refuses it (AKV_ERR_INVALID_ARGUMENT). On CUDA a stream is the
 *    caller's cudaStream_t and these rules are the caller's.
 * Pointers that were never handles (other objects, freed memory of the
 * caller's) cannot be told apart reliably: pass only handles or NULL.
 */
#define AKV_ENGINE_HANDLE_REUSE_MIN 32
#define AKV_CONTEXT_HANDLE_REUSE_MIN 1024
#define AKV_LEASE_HANDLES_PER_LAYER 16
#define AKV_LEASE_HANDLE_REUSE_MIN 4096
#define AKV_STREAM_HANDLE_REUSE_MIN 64
/**
 * A queue of the engine's backend, as the caller's compute stream.
 * CUDA backend: a cudaStream_t cast to akv_stream (see akv_cuda.h); a
 * handle this library gave out (a host engine's stream, an engine, a
 * context, a lease, a group or a group world of akv_group.h) is refused where a stream is expected, with
 * AKV_ERR_INVALID_ARGUMENT and nothing changed. Any other value is taken as
 * the caller's stream.
 * Host backend: a handle from akv_stream_create naming a worker-thread queue.
 */
typedef struct akv_stream_opaque *akv_stream;

/**
 * A fence: names one event the engine recorded (attention consumed, tail
 * write-back). A value, unique per recording in the process (one counter
 * serves every engine); the engine compares serials, so a fence from another
 * lease, step or engine never matches.
 */
typedef struct akv_fence {
  uint64_t serial;
} akv_fence;

/* ------------------------------------------------------------------------ */
/* Configuration                                                             */
/* ------------------------------------------------------------------------ */

typedef enum akv_backend_kind {
  AKV_BACKEND_AUTO = 0, /**< CUDA when built in and a device is present, else host */
  AKV_BACKEND_HOST = 1, /**< worker threads as queues; device memory is host memory */
  AKV_BACKEND_CUDA = 2
} akv_backend_kind;

/**
 * Element type of the K/V rows. The engine moves bytes and never interprets
 * them: a row is kv_heads * head_dim elements of this type, so everything
 * sized in bytes (fit, pages, copies, receipts) follows the element size
 * (bf16 and f16: 2 bytes, f32: 4, FP8: 1). FP8 rows hold the codes of a
 * quantised history; their scales belong to the caller's attention
 * (akv_attention_args.k_scale / v_scale), the engine never sees them.
 */
typedef enum akv_dtype {
  AKV_DTYPE_BF16 = 0,
  AKV_DTYPE_F16 = 1,
  AKV_DTYPE_F32 = 2,
  AKV_DTYPE_FP8_E4M3 = 3, /**< OCP FP8 E4M3 ("fn": no infinity, 0x7F/0xFF NaN, max 448) */
  AKV_DTYPE_FP8_E5M2 = 4  /**< OCP FP8 E5M2 (the top byte of an IEEE f16) */
} akv_dtype;

typedef enum akv_fit_mode {
  AKV_FIT_REFUSE = 0, /**< creation fails when max_contexts does not fit */
  AKV_FIT_SHRINK = 1  /**< concurrency is lowered to what fits */
} akv_fit_mode;

typedef enum akv_route {
  AKV_ROUTE_STAGE = 0, /**< every row crosses PCIe each step */
  AKV_ROUTE_ARENA = 1, /**< retained full pages copied device->device, the rest staged */
  AKV_ROUTE_PAGED = 2  /**< retained full pages read in place (akv_view.page_map), the rest
                            staged; no device->device copy */
} akv_route;

typedef enum akv_log_level {
  AKV_LOG_ERROR = 0,
  AKV_LOG_WARN = 1,
  AKV_LOG_INFO = 2,
  AKV_LOG_DEBUG = 3
} akv_log_level;

/** Log sink. `message` is one line without newline, valid during the call.
 *  The callback may call the library back on the engine that is logging, but
 *  only for diagnostics (akv_engine_last_error, akv_engine_info_get, the
 *  akv_admission_* calls, akv_headroom_get, akv_context_length / _id /
 *  _read): every call that changes the engine (destroy, quarantine, opens,
 *  closes, appends, steps, leases, streams, headroom) returns AKV_ERR_IN_USE
 *  there and changes nothing, logging nothing and leaving the last error
 *  alone (akv_engine_last_error still reads the error being logged, there
 *  and after the logging call returns). Nothing at all is logged to
 *  the callback from inside it: a diagnostic called there that fails
 *  returns its status and records its last error without a log line, and
 *  lines that would reach the same callback (the same log_fn and log_user)
 *  while it runs on the thread, from akv_engine_create, from calls on
 *  another engine (allowed there) or from a group's calls (akv_group.h),
 *  are dropped: the callback never runs nested in itself. It runs on the
 *  thread of the call that logs, which holds the engine (Thread safety):
 *  a diagnostic it calls on that engine answers as above, while any other
 *  thread's call on the engine gets AKV_ERR_IN_USE until the logging call
 *  returned. The library never logs from its worker threads. The callback
 *  returns to the library: one that leaves by longjmp (or ends its thread)
 *  leaves the logging call in progress for good, the engine claimed by that
 *  thread and refusing as from inside the callback. */
typedef void (*akv_log_fn)(void *user, akv_log_level level, const char *message);

/** Backend operation kinds, for fault injection and counters. */
typedef enum akv_op_kind {
  AKV_OP_ALLOC = 0,     /**< host/device allocation, queue and event creation */
  AKV_OP_COPY = 1,      /**< one copy or one batch of copies submitted */
  AKV_OP_RECORD = 2,    /**< event record */
  AKV_OP_WAIT = 3,      /**< queue waits on event */
  AKV_OP_QUERY = 4,     /**< event query */
  AKV_OP_SYNC = 5,      /**< event/queue/device synchronise */
  AKV_OP_HOSTFN = 6,    /**< host function enqueued on a queue */
  AKV_OP_KIND_COUNT = 7
} akv_op_kind;

#define AKV_CONFIG_VERSION 1u

/** The largest host_delay_max_us accepted (1 s): a larger bound would let
 *  the testing aid stall every operation for up to an hour. */
#define AKV_HOST_DELAY_MAX_US 1000000u

typedef struct akv_engine_config {
  uint32_t struct_size; /**< sizeof(akv_engine_config) */
  uint32_t version;     /**< AKV_CONFIG_VERSION */

  akv_backend_kind backend;
  /** CUDA device; ignored by the host backend. The engine never changes the
   *  calling thread's current device: calls that need its device make it
   *  current and restore the caller's before they return, so an engine may be
   *  driven from any thread whatever device that thread has current. */
  int device_ordinal;

  /* Geometry of the dense layers. row_bytes = kv_heads * head_dim * dtype size. */
  uint32_t n_dense_layers;
  uint32_t kv_heads;
  uint32_t head_dim;
  akv_dtype dtype;
  uint32_t max_tokens;  /**< per context, including the tokens decode adds */
  uint32_t page_tokens; /**< tokens per device page and attention chunk; 1..max_tokens and
                             at most AKV_ATTENTION_MAX_CHUNK_TOKENS (akv_attention.h: the
                             largest chunk the library's attention takes; a larger page is
                             refused with AKV_ERR_CONFIG by akv_fit and akv_engine_create
                             alike, whichever attention the caller runs) */

  /* Memory, explicit whole GiB, never sized from free memory. */
  uint32_t host_pool_gib;   /**< pinned host pool */
  uint32_t device_pool_gib; /**< device page pool; 0 = pure staging. Arena and paged
                                 routes: it must hold at least one page and at most
                                 2^32 - 1 pages (akv_fit_report.device_pages), else
                                 AKV_ERR_CONFIG. Paged route with headroom_gib > 0:
                                 at most 2^32 - 1 - 2^30 = 3221225471 pages (a page
                                 map entry is a grid offset of up to 2^30 pages plus
                                 the page number, 32 bits below AKV_PAGE_STAGED),
                                 else AKV_ERR_CONFIG. The stage route never
                                 allocates it: any value up to the accepted range is
                                 taken there and not checked against the page */
  uint32_t max_contexts;    /**< requested concurrency */
  akv_fit_mode fit_mode;
  akv_route route;

  /* Logging (default: stderr, level INFO). */
  akv_log_fn log_fn;
  void *log_user;
  akv_log_level log_level; /**< a value outside akv_log_level: AKV_ERR_CONFIG */

  /* Testing aids; leave zero in production. */
  uint64_t host_delay_seed;     /**< host backend: seed of injected per-op delays; 0 = none */
  uint32_t host_delay_max_us;   /**< host backend: upper bound of one injected delay, at
                                     most AKV_HOST_DELAY_MAX_US (else AKV_ERR_CONFIG) */
  uint32_t fault_fail_nth;      /**< fail the N-th (1-based) counted backend op; 0 = never */
  int32_t fault_kind;           /**< count only ops of this akv_op_kind; -1 = all kinds;
                                     any other value: AKV_ERR_CONFIG */
  /** Paged route: before each layer's copy, fill the staging rows of every
   *  page read in place with 0xFF bytes (NaN in every akv_dtype), so that
   *  attention which ignores view.page_map reads NaN instead of stale rows
   *  that may look plausible. Costs a device copy of every retained byte per
   *  layer (not counted in bytes_d2d): for testing a hook, not for serving. */
  uint32_t poison_holes;

  /* Revocable headroom (DESIGN §6). Opt-in: at create, after
   * its own allocations, the engine asks the device how much memory is free
   * and takes min(headroom_gib GiB, free - headroom_reserve_gib GiB) as
   * headroom pages, logging one line with every term. Headroom retains more
   * of each context's history than its pool pages (sink kept, newest first),
   * is taken back first under admission pressure, never holds the only copy
   * of a row (the host stays authoritative), and can be given back to the
   * caller (akv_headroom_release) and taken again (akv_headroom_take).
   * Arena and paged routes only (ignored, and logged, on stage). On the
   * paged route it bounds the device pool's pages (see device_pool_gib). */
  uint32_t headroom_gib;         /**< cap in whole GiB; 0 = off */
  uint32_t headroom_reserve_gib; /**< device memory left free, whole GiB */
  /* Testing aids for headroom; leave zero in production. */
  uint64_t host_fake_free_bytes; /**< host backend: model a device of this many bytes
                                      (free = this - bytes allocated; allocations past it
                                      fail); 0 = report no free memory */
  uint32_t headroom_chunk_pages; /**< pages per headroom allocation (the unit a release
                                      frees); 0 = as many as fit in 1 GiB */
} akv_engine_config;

#define AKV_ENGINE_CONFIG_INIT                                                  \
  {                                                                            \
    sizeof(akv_engine_config), AKV_CONFIG_VERSION, AKV_BACKEND_AUTO, 0, 0, 0, 0, \
        AKV_DTYPE_BF16, 0, 256, 0, 0, 1, AKV_FIT_REFUSE, AKV_ROUTE_STAGE, NULL,  \
        NULL, AKV_LOG_INFO, 0, 0, 0, -1, 0, 0, 0, 0, 0                           \
  }

/** Sets *config to AKV_ENGINE_CONFIG_INIT. Thread-safe. Returns AKV_OK or
 *  AKV_ERR_INVALID_ARGUMENT (NULL). */
AKV_API akv_status akv_engine_config_init(akv_engine_config *config);

/* ------------------------------------------------------------------------ */
/* Host fit (DESIGN §3), available without an engine                         */
/* ------------------------------------------------------------------------ */

typedef struct akv_fit_report {
  uint64_t row_bytes;      /**< kv_heads * head_dim * dtype size */
  uint64_t history_bytes;  /**< n_dense_layers * max_tokens * row_bytes * 2 */
  uint64_t host_pool_bytes;
  uint64_t fits;           /**< floor(host_pool_bytes / history_bytes) */
  uint32_t effective_concurrency; /**< min(max_contexts, fits) */
  uint32_t ok;             /**< 1 when max_contexts fits */
  uint32_t host_pool_gib_needed;  /**< smallest host_pool_gib that fits max_contexts */
  uint64_t page_bytes;     /**< page_tokens * n_dense_layers * row_bytes * 2 */
  uint64_t device_pages;   /**< floor(device_pool_bytes / page_bytes) (the stage route
                                allocates none of them: engine info says 0 there) */
  char line[512];          /**< the formula with every term, as logged */
} akv_fit_report;

/**
 * Host-fit arithmetic of DESIGN §3 for a config, without creating anything.
 * Thread-safe. Returns AKV_OK (see report->ok for the verdict),
 * AKV_ERR_INVALID_ARGUMENT (NULL) or AKV_ERR_CONFIG (bad geometry, an enum
 * field outside its enum, a size that does not fit 64 bits, a device pool of no page or of more pages than
 * device_pool_gib allows on a route that allocates it (not the stage
 * route), or, for a config an engine would be created
 * from, bookkeeping beyond 1/64 of the host pool plus 1/4 of the device pool
 * in use: docs/admission.md). akv_engine_create refuses exactly the configs
 * this refuses, with the same AKV_ERR_CONFIG. The reason of an
 * AKV_ERR_CONFIG goes to config->log_fn (AKV_LOG_ERROR, the line
 * akv_engine_create logs for that config) when one is set (without one
 * nothing is printed); report is left untouched by every refusal.
 */
AKV_API akv_status akv_fit(const akv_engine_config *config, akv_fit_report *report);

/* ------------------------------------------------------------------------ */
/* Engine                                                                    */
/* ------------------------------------------------------------------------ */

/**
 * Creates an engine: allocates the pinned host pool, the device page pool, the
 * staging buffers, the engine's queues and every event it will use. Nothing is
 * allocated after this call but the headroom akv_headroom_take takes again.
 * Logs the host-fit line.
 * Returns AKV_OK, AKV_ERR_INVALID_ARGUMENT (config or out NULL),
 * AKV_ERR_CONFIG (what akv_fit refuses, or a struct_size below the oldest
 * layout; the message names the setting), AKV_ERR_NO_FIT (refuse mode, or
 * shrink mode where not one history fits the host pool; the message names
 * the setting to change), AKV_ERR_OUT_OF_MEMORY (the pools and
 * staging buffers are allocated first, so a geometry larger than the machine
 * fails there), AKV_ERR_NOT_SUPPORTED (CUDA requested but unavailable),
 * AKV_ERR_BACKEND, AKV_ERR_BAD_HANDLE (only in a child its log callback
 * forked once the engine's queues had started: see fork, at the top).
 * Diagnostics of a failed create are passed to the log callback.
 */
AKV_API akv_status akv_engine_create(const akv_engine_config *config, akv_engine **out);

/**
 * Frees the engine and every context still open. Never waits, submits or
 * drains: with an open step, an unretired lease, a live stream from
 * akv_stream_create, a failed transport not quarantined, or resources
 * retained by an uncertain quarantine, returns AKV_ERR_BUSY and frees
 * nothing. Afterwards the engine handle, its contexts' handles and its lease
 * handles are dead: every call with them returns AKV_ERR_BAD_HANDLE (see
 * "Handle lifetimes" for how long that holds); a second destroy too.
 *
 * Waits on nothing of the caller's: when it frees, every lease is retired
 * (or a quarantine proved completion), so the engine's queues are idle and
 * its memory is handed back in the order of its own H2D queue, without
 * synchronising the device. CUDA: device memory and the pinned host pool go
 * back with cudaFreeAsync on the engine's stream, streams and events are
 * destroyed without waiting; it returns while the caller's kernels on the
 * device still run (never cudaFree / cudaFreeHost, which wait for the whole
 * device). Its own host cost is the unmapping, about 9 ms per GiB of device
 * memory (H200). Exception: where host memory pools are not available (CUDA
 * runtime < 13 or cudaDevAttrHostMemoryPoolsSupported = 0), or the host pool
 * refused the block (out of memory there; the engine then tries
 * cudaHostAlloc), the pinned pool comes from cudaHostAlloc and its
 * cudaFreeHost waits until the device is idle, the caller's work included;
 * the engine logs it (warn) at create.
 * Host backend: it joins the engine's own three queue threads, which are
 * idle; no caller stream is waited on (docs/api.md gives the measured
 * cost).
 * From another thread while a call on the engine is in progress it returns
 * AKV_ERR_IN_USE and frees nothing (Thread safety); from that call's
 * attention hook it frees (the call then answers AKV_ERR_BAD_HANDLE).
 * Returns AKV_OK, AKV_ERR_BAD_HANDLE, AKV_ERR_BUSY, AKV_ERR_IN_USE.
 */
AKV_API akv_status akv_engine_destroy(akv_engine *engine);

/**
 * Last error of this engine in words ("" before any); never NULL; the string
 * belongs to the engine and stays valid until the next call on it. A bad
 * handle gives a static "bad engine handle", a call from another thread
 * while one is in progress on the engine the static "engine in use by
 * another thread" (Thread safety). Allowed at any time.
 */
AKV_API const char *akv_engine_last_error(const akv_engine *engine);

typedef struct akv_engine_info {
  akv_backend_kind backend; /**< the backend actually in use */
  akv_route route;
  uint32_t effective_concurrency;
  uint64_t row_bytes;
  uint64_t history_bytes;
  uint64_t page_bytes;
  uint32_t device_pages;
  uint64_t staging_bytes;   /**< both staging buffers together */
  uint64_t device_bytes_allocated; /**< everything the engine allocated on the device */
  uint64_t device_peak_bytes;      /**< process peak as the device reports it (0 if unknown) */
  uint64_t bytes_h2d, bytes_d2h, bytes_d2d; /**< bytes submitted so far (H2D: staged rows,
                                                 page fills and, on the paged route, each
                                                 step's page map; poison_holes copies are
                                                 counted nowhere) */
  uint64_t copies_h2d, copies_d2h, copies_d2d; /**< copy calls submitted (a batch counts
                                                    once); a submission that failed counts
                                                    here and in bytes_* nowhere */
  uint64_t steps, leases_retired;
  uint64_t backend_ops[AKV_OP_KIND_COUNT]; /**< fallible backend ops issued, per kind */
  int transport_failed; /**< 1 after any failed backend op of the data path
                             (copies, events, queues, kernels, host functions,
                             synchronisation), and after any
                             akv_engine_quarantine (which closes the engine to
                             all but diagnostics and destroy, failure or not).
                             A headroom chunk the device could not allocate is
                             not one: headroom takes what is free and says so
                             (akv_headroom_get, the log) */
  int quarantined;      /**< 1 after akv_engine_quarantine established completion */
  uint64_t bytes_in_place; /**< paged route: retained bytes handed to attention in place
                                (neither staged nor copied), so far; counted when
                                akv_lease_begin succeeds (a begin that failed, its
                                submissions partial, counts nowhere) */
  /* Headroom (see akv_headroom_get for the full picture). */
  uint32_t headroom_pages;       /**< headroom pages present now */
  uint64_t headroom_bytes;       /**< device bytes they occupy (allocations, slack included) */
} akv_engine_info;

/**
 * Fills *out with the engine's geometry, memory and counters. Enqueues
 * nothing and does not wait for queued work (the device peak comes from the
 * backend's memory query, cudaMemGetInfo on CUDA).
 * Allowed at any time, also after a transport failure.
 * Returns AKV_OK, AKV_ERR_BAD_HANDLE, AKV_ERR_INVALID_ARGUMENT (out NULL),
 * AKV_ERR_IN_USE (another thread's call in progress).
 */
AKV_API akv_status akv_engine_info_get(const akv_engine *engine, akv_engine_info *out);

typedef struct akv_quarantine_report {
  int h2d_ok, d2h_ok, d2d_ok, device_ok; /**< 1 where completion was established */
  uint32_t leases_released;
  uint32_t tickets_released;
  uint32_t retained_leases; /**< left retained on an uncertain fence */
  char uncertain[128];      /**< which fence was uncertain, in words ("" if none) */
} akv_quarantine_report;

/**
 * Synchronises the H2D queue, the D2H queue, the materialisation queue, then
 * the device. Only when all four establish completion are leases, tickets and
 * host page leases released; otherwise everything stays retained and the
 * report names the uncertain fence. Blocks. Allowed in any state; afterwards
 * the engine accepts only diagnostics, akv_stream_destroy and destroy. report may be NULL (the
 * same quarantine, nothing reported).
 * Another thread's quarantine while a call is in progress (Thread safety)
 * returns AKV_ERR_IN_USE, marks nothing and leaves *report alone; so does a
 * quarantine from a function running on one of the engine's streams
 * (akv_stream_launch_host), whose synchronisation would wait for it.
 * Returns AKV_OK, AKV_ERR_BAD_HANDLE, AKV_ERR_UNCERTAIN_FENCE, AKV_ERR_IN_USE.
 */
AKV_API akv_status akv_engine_quarantine(akv_engine *engine, akv_quarantine_report *report);

/* ------------------------------------------------------------------------ */
/* Compute streams                                                           */
/* ------------------------------------------------------------------------ */

/**
 * Creates a compute queue of the engine's backend for callers that have none:
 * a worker thread on the host backend, a non-blocking stream on CUDA. The
 * caller owns it and must destroy it before the engine (destroy refuses with
 * AKV_ERR_BUSY while one is live). At most 8 per engine.
 * Returns AKV_OK, AKV_ERR_BAD_HANDLE, AKV_ERR_INVALID_ARGUMENT (out NULL),
 * AKV_ERR_OUT_OF_MEMORY (8 live already), AKV_ERR_BACKEND, AKV_ERR_QUARANTINED,
 * AKV_ERR_IN_USE.
 */
AKV_API akv_status akv_stream_create(akv_engine *engine, akv_stream *out);
/**
 * Destroys a stream from akv_stream_create after the work enqueued on it ran
 * (the host backend drains it and joins its worker; this blocks). A
 * stream
 * outlives every lease that used it: while an unretired lease of the engine
 * was given it (akv_lease_wait_ready or akv_lease_attend), destroy returns
 * AKV_ERR_IN_USE and changes nothing; retire the lease first (a quarantine
 * that released the lease counts). Every call that takes a stream refuses a
 * destroyed one with AKV_ERR_INVALID_ARGUMENT on the host backend, also
 * after later streams were created ("Handle lifetimes"). (On CUDA, the same
 * rule is the caller's for a cudaStream_t it destroys itself.)
 * Allowed also after a transport failure. Returns AKV_OK,
 * AKV_ERR_BAD_HANDLE, AKV_ERR_INVALID_ARGUMENT (not a live stream of this
 * engine), AKV_ERR_IN_USE (also: another thread's call in progress, or,
 * host backend, a call from a function akv_stream_launch_host runs on this
 * very stream, whose worker cannot drain and wait for itself, or on another
 * stream of this engine while this one has work not yet run, which may
 * wait for that function through the engine's queues, as a history-ready
 * wait left by an akv_lease_wait_ready that failed half-way does; nothing
 * changes, the stream stays live).
 */
AKV_API akv_status akv_stream_destroy(akv_engine *engine, akv_stream stream);
/**
 * Blocks until everything enqueued on `stream` ran. On the host backend the
 * stream must be a live one from akv_stream_create. Returns AKV_OK,
 * AKV_ERR_BAD_HANDLE, AKV_ERR_INVALID_ARGUMENT, AKV_ERR_BACKEND (completion not
 * established: transport marked failed), AKV_ERR_QUARANTINED, AKV_ERR_IN_USE
 * (another thread's call in progress, or, host backend, a call from a
 * function akv_stream_launch_host runs on a stream of this engine: this
 * very stream would wait for itself, another may wait for it through the
 * engine's queues; nothing changes).
 */
AKV_API akv_status akv_stream_synchronize(akv_engine *engine, akv_stream stream);
/**
 * Enqueues fn(arg) on `stream`: it runs on the queue's thread (host backend)
 * or a runtime thread (cudaLaunchHostFunc) after all earlier work of the stream.
 * This is how a CPU attention hook runs on the host backend. fn must not
 * synchronise, and should not call the library: it runs on another thread
 * than the caller's, so its calls on this engine are refused with
 * AKV_ERR_IN_USE whenever a call on the engine is in progress, among them
 * an akv_stream_synchronize waiting for fn (Thread safety). On the CUDA
 * backend fn runs where no CUDA call is permitted, so every call it makes
 * on an engine of the CUDA backend (any engine, destroy included) is
 * refused with AKV_ERR_IN_USE and changes nothing; the attention functions
 * of akv_cuda.h make CUDA calls too and must not be called from fn. A call from fn
 * that would wait for fn itself is refused with AKV_ERR_IN_USE and changes
 * nothing: akv_stream_destroy of fn's own stream or of another stream of
 * its engine with work not yet run, akv_stream_synchronize of
 * any stream of its engine (one may wait for fn through the engine's
 * queues), akv_stream_launch_host onto a stream of its engine whose ring is
 * full while that stream waits for fn (fn's own stream, or one waiting on
 * a history-ready event behind work of fn's stream; host backend),
 * akv_engine_quarantine of its engine, and akv_lease_retire of a lease
 * with an event not passed yet. (The engine's other enqueueing calls from
 * fn onto such a full queue fail at once, as any enqueue that fails:
 * AKV_ERR_BACKEND, the transport failed; see Blocking.) fn returns to its
 * queue. Host backend: one that ends its thread instead (pthread_exit, or
 * a cancellation acting inside it) ends only itself: its end counts as its
 * return and a new worker thread runs the stream's later work, so leases,
 * synchronisation and destroy go on as if it had returned (an engine call
 * it was inside then, through a log callback, stays in progress for good:
 * akv_log_fn). A cancellation of a worker thread (pthread_cancel of a
 * pthread_self() a function handed out) acts only inside a function, at
 * its cancellation points, ending only that function; while the worker
 * waits between functions it stays pending, and each function starts with
 * deferred cancellation whatever the one before it set. fn may detach its
 * thread (pthread_detach(pthread_self())): each worker tells, as it
 * leaves, whether it is still joinable, and the library joins only those
 * that are, so the stream, its leases and its destroy go on (a detached
 * worker is then not waited for beyond its signal that it left the
 * queue; it may still be returning through the library's code when
 * destroy returns). fn must not join its thread. CUDA: the runtime's
 * thread is not the library's; ending or detaching it is undefined
 * there. Returns AKV_OK,
 * AKV_ERR_BAD_HANDLE, AKV_ERR_INVALID_ARGUMENT (fn NULL, or on the host
 * backend not a live stream of this engine), AKV_ERR_BACKEND,
 * AKV_ERR_QUARANTINED, AKV_ERR_IN_USE.
 */
AKV_API akv_status akv_stream_launch_host(akv_engine *engine, akv_stream stream,
                                          void (*fn)(void *arg), void *arg);

/* ------------------------------------------------------------------------ */
/* Contexts                                                                  */
/* ------------------------------------------------------------------------ */

#define AKV_TARGET_FAIR_SHARE UINT32_MAX

typedef struct akv_context_config {
  uint32_t struct_size; /**< sizeof(akv_context_config) */
  uint32_t version;     /**< AKV_CONFIG_VERSION */
  uint32_t target_pages; /**< device pages by right; AKV_TARGET_FAIR_SHARE = pool / concurrency;
                              1 is raised to the floor of 2 (sink + newest page; where a
                              context has one page only, max_tokens <= page_tokens, the
                              floor is 1 and nothing is raised) */
  uint32_t burst_pages;  /**< pages it may borrow while free; with target 0, 1 is raised to the
                              floor (2, or 1 as above) */
} akv_context_config;

#define AKV_CONTEXT_CONFIG_INIT \
  { sizeof(akv_context_config), AKV_CONFIG_VERSION, AKV_TARGET_FAIR_SHARE, 0 }

/**
 * Opens a context: takes a host slot and admits its device target, and
 * takes a handle record (reserved at akv_engine_create: nothing is
 * allocated). Not allowed inside a step (AKV_ERR_STEP_STATE). `config` may
 * be NULL for defaults; an older, smaller struct (struct_size at least 8:
 * struct_size and version) gives its fields and the rest keep
 * AKV_CONTEXT_CONFIG_INIT's. A context that retains anything holds at least
 * its sink and its newest page: a target of 1, or with target 0 a burst of 1,
 * is raised to 2 (logged at INFO, stated by akv_admission_explain; where a
 * context has one page only, max_tokens <= page_tokens, that page is its
 * sink and newest page at once: the floor is 1 and nothing is raised);
 * target 0 with no burst stays pure staging. The explanation of an open
 * refused by admission names the largest target an open would admit then,
 * the floor taken into account. Returns AKV_OK, AKV_ERR_BAD_HANDLE,
 * AKV_ERR_INVALID_ARGUMENT, AKV_ERR_CONFIG (struct_size below 8, version
 * outside 1..AKV_CONFIG_VERSION), AKV_ERR_REFUSED_QUEUE (no host slot: queue
 * it), AKV_ERR_ADMISSION_REFUSED (device targets do not fit),
 * AKV_ERR_STEP_STATE, AKV_ERR_QUARANTINED, AKV_ERR_IN_USE (another thread's
 * call in progress).
 */
AKV_API akv_status akv_context_open(akv_engine *engine, const akv_context_config *config,
                                    akv_context **out);

/**
 * Closes a context and releases its host slot and device pages. The slot's
 * generation moves only when no ticket holds it. The handle is dead from
 * then on: every call with it returns AKV_ERR_BAD_HANDLE and changes
 * nothing, also after other contexts take its host slot, for at least
 * AKV_CONTEXT_HANDLE_REUSE_MIN later opens in the process, whatever else
 * stays open ("Handle lifetimes"; do not keep one). Returns AKV_OK,
 * AKV_ERR_BAD_HANDLE, AKV_ERR_IN_USE (part of the open step, or another
 * thread's call in progress), AKV_ERR_QUARANTINED.
 */
AKV_API akv_status akv_context_close(akv_context *context);

/**
 * Appends `n_tokens` prefilled rows to every dense layer (synchronous host
 * copy into the pinned pool). k_rows[l] and v_rows[l] point to n_tokens rows of
 * layer l (token-major, row_bytes each). The two arrays (one pointer per
 * dense layer) are required even when n_tokens == 0 (NULL arrays:
 * AKV_ERR_INVALID_ARGUMENT); their entries may be NULL then, as the rows of
 * akv_context_append_layer may. Each layer's rows go after the rows
 * that layer holds (the same place on every layer unless akv_context_append_layer
 * filled them unevenly; capacity is checked against the layer holding the most).
 * Not allowed while the context is part of an open step. Returns AKV_OK,
 * AKV_ERR_BAD_HANDLE, AKV_ERR_INVALID_ARGUMENT (an array NULL, or a row
 * pointer NULL with n_tokens > 0), AKV_ERR_CAPACITY (nothing appended),
 * AKV_ERR_IN_USE, AKV_ERR_QUARANTINED.
 */
AKV_API akv_status akv_context_append(akv_context *context, uint32_t n_tokens,
                                      const void *const *k_rows, const void *const *v_rows);

/**
 * Appends `n_tokens` prefilled rows to ONE dense layer, `layer`, after the
 * rows that layer already holds (synchronous host copy into the pinned pool;
 * enqueues nothing, does not block on any queue). For callers that receive a
 * prompt's K/V one layer at a time (a framework's per-layer cache update).
 * k_rows and v_rows point to n_tokens rows of that layer (token-major,
 * row_bytes each); they may be NULL when n_tokens == 0. The caller keeps
 * ownership of both; they are read during the call only.
 *
 * Layers may be filled in any order and by different amounts. The context's
 * length (akv_context_length) is the MINIMUM over its dense layers of the
 * rows each holds: it advances by n once every dense layer holds n more
 * rows. Rows a layer holds beyond that minimum are kept and readable through
 * akv_context_read on that layer. A context whose layers are uneven cannot
 * join a step: akv_step_begin refuses it with AKV_ERR_UNEVEN_LAYERS and
 * changes nothing; once the layers are even again it may. akv_context_append
 * on an uneven context appends to every layer after that layer's own rows.
 *
 * Capacity is per layer: the layer's rows plus n_tokens must not exceed
 * max_tokens (checked in 64 bits). Not allowed while the context is part of
 * an open step. A failing call appends nothing on any layer.
 * Thread safety: as every context call (see the top of this header).
 * Returns AKV_OK, AKV_ERR_BAD_HANDLE, AKV_ERR_INVALID_ARGUMENT (layer out of
 * range, or rows NULL with n_tokens > 0), AKV_ERR_CAPACITY (nothing
 * appended), AKV_ERR_IN_USE, AKV_ERR_QUARANTINED.
 */
AKV_API akv_status akv_context_append_layer(akv_context *context, uint32_t layer,
                                            uint32_t n_tokens, const void *k_rows,
                                            const void *v_rows);

/**
 * Copies rows [first, first+n) of one layer out of the authoritative host pool;
 * the rows that layer holds bound the range (akv_context_append_layer may have
 * given it more than akv_context_length reports). Allowed while no lease of an open step can write them (outside a step, or
 * for a context not in the step). Also allowed after a transport failure.
 * n == 0 reads nothing (k_out and v_out may then be NULL).
 * Returns AKV_OK, AKV_ERR_BAD_HANDLE, AKV_ERR_INVALID_ARGUMENT (layer out of
 * range, [first, first+n) not within the rows the layer holds, or k_out or
 * v_out NULL with n > 0), AKV_ERR_IN_USE (the context is part of the open
 * step, or another thread's call in progress); on any error nothing is
 * written to k_out or v_out.
 */
AKV_API akv_status akv_context_read(const akv_context *context, uint32_t layer, uint32_t first,
                                    uint32_t n, void *k_out, void *v_out);

/**
 * Rows held per dense layer (prefill plus one per finished step); after
 * uneven akv_context_append_layer calls, the minimum over the layers. Allowed at
 * any time, also after a transport failure. Returns AKV_OK,
 * AKV_ERR_BAD_HANDLE, AKV_ERR_INVALID_ARGUMENT (out NULL), AKV_ERR_IN_USE
 * (another thread's call in progress).
 */
AKV_API akv_status akv_context_length(const akv_context *context, uint32_t *out);

/* ------------------------------------------------------------------------ */
/* Steps                                                                     */
/* ------------------------------------------------------------------------ */

/**
 * Opens a decode step over `n` contexts: the step boundary. Residency changes
 * here and nowhere else (admission, page fills enqueued on the H2D queue behind
 * the fences of the pages' last readers). Every context gains exactly one row
 * per dense layer in this step. Returns AKV_OK, AKV_ERR_BAD_HANDLE,
 * AKV_ERR_INVALID_ARGUMENT (n == 0, n > concurrency, duplicates),
 * AKV_ERR_STEP_STATE (a step is open), AKV_ERR_CAPACITY (a context is full),
 * AKV_ERR_UNEVEN_LAYERS (a context's layers hold different row counts; see
 * akv_context_append_layer), AKV_ERR_BACKEND, AKV_ERR_QUARANTINED,
 * AKV_ERR_IN_USE (another thread's call in progress).
 */
AKV_API akv_status akv_step_begin(akv_engine *engine, akv_context *const *contexts, uint32_t n);

/**
 * Closes the step: requires every dense layer's lease retired (the next
 * boundary may then reuse any device page); each context's length grows by
 * one and the page fills' host page leases are released. Headroom asked back
 * during the step (akv_headroom_release) is then taken out of admission and
 * freed here; on CUDA that free is cudaFree, which may wait for the device to
 * go idle (the runtime's rule), so a step end with a release pending can
 * block where one without does not. Returns AKV_OK,
 * AKV_ERR_BAD_HANDLE, AKV_ERR_STEP_STATE (a layer not leased or a lease not
 * retired; nothing changes), AKV_ERR_BACKEND (a page fill's host slot changed
 * generation under it: nothing released or published, transport marked
 * failed), AKV_ERR_QUARANTINED, AKV_ERR_IN_USE.
 */
AKV_API akv_status akv_step_end(akv_engine *engine);

/* ------------------------------------------------------------------------ */
/* Leases (DESIGN §5)                                                        */
/* ------------------------------------------------------------------------ */

/**
 * What the attention kernel sees of one staged layer. For context i of the
 * step, row t has its K at base + i*context_stride + t*row_stride and its V
 * at that address + v_offset; a K (or V) row is kv_heads * head_dim elements
 * of dtype. The engine keeps a token's K and V rows side by side
 * (v_offset = K row size, row_stride = twice that), which the attention
 * functions of akv_attention.h take as is (row_bytes = row_stride). Rows
 * [0, len[i]) are the staged history; the caller writes the step's new row at
 * index len[i] before attending over len[i]+1 rows. Pointers are device
 * pointers (host memory on the host backend). The memory they point to
 * (staged rows, len, contexts, page_map) stays valid until the lease
 * retires; the akv_view struct itself is the caller's (akv_lease_wait_ready)
 * or, for the attention hook, the engine's and valid only during the hook.
 *
 * Paged route (AKV_ROUTE_PAGED): full pages of history the device pool
 * retains are not staged; page_map says where they are. For context i and
 * page p (rows [p*page_tokens, (p+1)*page_tokens)), entry
 * page_map[i*page_map_stride + p] is AKV_PAGE_STAGED (the rows are at base as
 * above) or a physical page: row t of the page then has its K at
 * pages + entry*page_stride + (t - p*page_tokens)*row_stride and its V at
 * that address + v_offset. Pages past page_map_stride are staged. Passing
 * the view to akv_attention_args_from_view (akv_attention.h) fills all of
 * this in. page_map is a device array (host memory on the host backend) and
 * page_map_host its host copy; both are NULL on the other routes.
 */
typedef struct akv_view {
  uint64_t step;
  uint32_t layer;
  uint32_t n_contexts;
  uint32_t kv_heads;
  uint32_t head_dim;
  akv_dtype dtype;
  uint64_t row_stride;            /**< bytes from one row to the next */
  void *base;
  uint64_t context_stride;
  uint64_t v_offset;              /**< V row = K row + v_offset */
  const uint32_t *len;            /**< [n_contexts], host array */
  akv_context *const *contexts;   /**< [n_contexts], in step order */
  /* Paged route only (NULL / 0 otherwise). */
  uint32_t page_tokens;           /**< rows per page: the attention chunk */
  uint32_t page_map_stride;       /**< entries per context in page_map */
  const uint32_t *page_map;       /**< [n_contexts][page_map_stride], device */
  const uint32_t *page_map_host;  /**< the same entries in host memory */
  const void *pages;              /**< K row 0 of physical page 0, this layer */
  uint64_t page_stride;           /**< bytes between physical pages */
} akv_view;

/** page_map entry of a page that is staged, not read in place. */
#define AKV_PAGE_STAGED 0xFFFFFFFFu

/**
 * Attention hook: enqueue the attention kernel (and the write of each new row
 * at index len[i]) on `stream`; do not block. The rows the view points to
 * are ready for work enqueued on `stream`, not yet while the hook runs (the
 * staging copies may still be running): on the host backend a CPU attention
 * reads and writes them from a function enqueued with akv_stream_launch_host,
 * never from the hook itself (docs/api.md shows it). Return 0 on success;
 * nonzero makes akv_lease_attend return AKV_ERR_BACKEND and marks the
 * transport failed.
 * `view` points to a struct on akv_lease_attend's stack: it lives only
 * during the hook. Copy the struct (not the pointer) if work enqueued by the
 * hook needs it later; the arrays and device memory it points to stay valid
 * until the lease retires. The hook returns to akv_lease_attend: one that
 * leaves otherwise (longjmp, or its thread ends) leaves the attend in
 * progress for good, so the engine stays claimed by that thread (other
 * threads get AKV_ERR_IN_USE; that thread's later calls on it nest, and may
 * quarantine and destroy it); an engine so destroyed never hands its record
 * ("Handle lifetimes") to a later akv_engine_create. A hook that ends its
 * own lease (akv_engine_quarantine releases it, a destroy may follow; or it
 * runs the lease to its retire itself) makes akv_lease_attend return AKV_ERR_BAD_HANDLE, touching neither
 * the lease nor its engine afterwards, also when the hook went on until the
 * handle's record was handed out again ("Handle lifetimes") to a later lease
 * of this engine or of a newer one: that lease and its engine are left as
 * they were (not marked consumed, not failed by a nonzero return).
 * A hook that takes its own lease on without ending it (its own
 * akv_lease_mark_consumed, perhaps akv_lease_write_back and akv_lease_seal
 * after it) makes akv_lease_attend return AKV_OK, with *attention the fence
 * that mark_consumed gave, and leaves the lease where the hook left it
 * (a nonzero return still fails it: AKV_ERR_BACKEND; an engine that failed
 * during the hook answers AKV_ERR_QUARANTINED, no fence written). The
 * attention event is then the one the hook recorded: work the hook enqueued
 * after its mark_consumed is not ordered before the write-back.
 */
typedef int (*akv_attention_fn)(void *user, const akv_view *view, akv_stream stream);

/**
 * Begins the lease of dense layer `layer` of the open step. Allowed only when
 * the previous lease of the step is sealed or retired. Lists the previous
 * stage's readers (attention and tail fences) among its prior readers; its
 * copy queues wait on every prior reader of its staging buffer before any copy
 * into it. Enqueues on the H2D queue (history rows not retained on device) and
 * the materialisation queue (retained pages, arena route); records the
 * history-ready events. Layers must be leased in order 0..n_dense_layers-1.
 * Returns AKV_OK, AKV_ERR_BAD_HANDLE, AKV_ERR_INVALID_ARGUMENT (out NULL, or
 * layer out of range or out of order), AKV_ERR_STEP_STATE (no open step),
 * AKV_ERR_LEASE_ORDER, AKV_ERR_BACKEND, AKV_ERR_QUARANTINED, AKV_ERR_IN_USE
 * (another thread's call in progress).
 * *out is a new handle for this begin only: it never names a lease of an
 * earlier or later step of the layer ("Handle lifetimes").
 */
AKV_API akv_status akv_lease_begin(akv_engine *engine, uint32_t layer, akv_lease **out);

/**
 * Two-call form, part 1: makes `stream` wait (on the device) for the staged
 * history and fills *view. From here until the lease retires, `stream`
 * cannot be destroyed (akv_stream_destroy answers AKV_ERR_IN_USE).
 * Returns AKV_OK, AKV_ERR_BAD_HANDLE, AKV_ERR_INVALID_ARGUMENT (view NULL,
 * or stream not a live stream of this engine), AKV_ERR_LEASE_STATE (not just
 * begun), AKV_ERR_BACKEND, AKV_ERR_QUARANTINED, AKV_ERR_IN_USE.
 */
AKV_API akv_status akv_lease_wait_ready(akv_lease *lease, akv_stream stream, akv_view *view);

/**
 * Two-call form, part 2: records the attention-consumed event on `stream`
 * (the same stream given to wait_ready) and returns its fence.
 * Returns AKV_OK, AKV_ERR_BAD_HANDLE, AKV_ERR_INVALID_ARGUMENT (attention
 * NULL, or stream not the one given to wait_ready), AKV_ERR_LEASE_STATE (not
 * ready), AKV_ERR_BACKEND, AKV_ERR_QUARANTINED, AKV_ERR_IN_USE.
 */
AKV_API akv_status akv_lease_mark_consumed(akv_lease *lease, akv_stream stream,
                                           akv_fence *attention);

/** Hook form: wait_ready, hook(user, view, stream), mark_consumed. Same statuses
 *  (AKV_ERR_INVALID_ARGUMENT also for hook or attention NULL; AKV_ERR_LEASE_STATE
 *  when the lease is not just begun).
 *  The hook runs on the calling thread, inside the call: it may call the
 *  engine again (every call, destroy included), while other threads' calls
 *  on the engine are refused with AKV_ERR_IN_USE until attend returned
 *  (Thread safety). A hook that destroyed the engine makes attend return
 *  AKV_ERR_BAD_HANDLE having read nothing of the lease handle after the
 *  hook but the engine's atomic handle words: the hook may have created
 *  newer engines meanwhile, one of which may hold that lease record and be
 *  in use by another thread. */
AKV_API akv_status akv_lease_attend(akv_lease *lease, akv_stream stream, akv_attention_fn hook,
                                    void *user, akv_fence *attention);

/**
 * Enqueues on the D2H queue, behind the attention-consumed event, the copy of
 * each owner's new row (index len[i], K and V) to its authoritative host rows,
 * and records the tail event. `owners` lists contexts of this lease (NULL with
 * n_owners == 0 means all of them); each owner at most once per lease.
 * Returns AKV_OK, AKV_ERR_BAD_HANDLE (also: an owner that is not an open
 * context), AKV_ERR_INVALID_ARGUMENT (tail NULL; owners NULL with
 * n_owners > 0, or not NULL with n_owners == 0; n_owners above the lease's
 * contexts; an owner listed twice), AKV_ERR_LEASE_STATE (attention not
 * consumed, or owner already written; owners NULL once some were written),
 * AKV_ERR_OWNER_MISMATCH (an owner the lease did not begin with; nothing
 * enqueued), AKV_ERR_BACKEND, AKV_ERR_QUARANTINED, AKV_ERR_IN_USE.
 */
AKV_API akv_status akv_lease_write_back(akv_lease *lease, akv_context *const *owners,
                                        uint32_t n_owners, akv_fence *tail);

/**
 * Seals the lease with its current tail fence and its attention fence. Every
 * owner must have been written back. Returns AKV_OK, AKV_ERR_BAD_HANDLE,
 * AKV_ERR_LEASE_STATE, AKV_ERR_FENCE_MISMATCH (a substituted or stale fence),
 * AKV_ERR_QUARANTINED, AKV_ERR_IN_USE.
 */
AKV_API akv_status akv_lease_seal(akv_lease *lease, akv_fence tail, akv_fence attention);

typedef struct akv_receipt {
  uint64_t step;
  uint32_t layer;
  uint32_t tickets;        /**< copy tickets proven complete */
  uint32_t readers;        /**< consumer events proven complete */
  uint64_t bytes_h2d, bytes_d2d, bytes_d2h;
  akv_fence attention, tail;
  uint64_t bytes_in_place; /**< paged route: retained bytes read in place */
} akv_receipt;

/**
 * Retires a sealed lease: waits (blocking, error-returning) until every
 * consumer event and every copy ticket passed (one wait, on the tail
 * write-back: the lease's events form one chain on the device, each
 * recorded behind a queue wait on the one before, so the tail passes
 * last), fills *receipt (receipt may be NULL: the same
 * retire, no receipt), and only then releases the tickets, their host page
 * leases and the layer. The lease handle is dead
 * afterwards: every call with it, a second retire included, returns
 * AKV_ERR_BAD_HANDLE and changes nothing, also while a later step's lease of
 * the same layer is live ("Handle lifetimes"). A successful
 * akv_engine_quarantine kills the handles of the leases it released the same
 * way. Returns AKV_OK, AKV_ERR_BAD_HANDLE, AKV_ERR_LEASE_STATE,
 * AKV_ERR_BACKEND (a wait failed, or a ticket's host slot changed generation
 * under it: nothing released, transport failed),
 * AKV_ERR_QUARANTINED, AKV_ERR_IN_USE (another thread's call in progress;
 * or, from a function running on a stream of this engine, an event not
 * passed yet, which may be behind that function: nothing changed, no wait).
 */
AKV_API akv_status akv_lease_retire(akv_lease *lease, akv_receipt *receipt);

/**
 * Non-blocking retire: queries (never waits on) every event retire waits on,
 * the tail write-back first. When all have passed, retires exactly as
 * akv_lease_retire does (same receipt, tickets and layer released, the handle
 * invalid afterwards; receipt may be NULL) and returns AKV_OK. When one has not passed yet,
 * returns AKV_ERR_NOT_READY and changes nothing (the lease stays sealed,
 * *receipt untouched, the engine's last error untouched, nothing logged):
 * call it again later, or akv_lease_retire to block. Cost: one event query
 * (the tail, which passes last: see akv_lease_retire), ready or not; no
 * allocation, no lock held across calls. Enqueues nothing. One
 * thread at a time, as every engine call (Thread safety, above).
 * Returns AKV_OK, AKV_ERR_NOT_READY, AKV_ERR_BAD_HANDLE, AKV_ERR_LEASE_STATE
 * (not sealed), AKV_ERR_BACKEND (a query failed: nothing released, transport
 * failed), AKV_ERR_QUARANTINED, AKV_ERR_IN_USE.
 */
AKV_API akv_status akv_lease_try_retire(akv_lease *lease, akv_receipt *receipt);

/* ------------------------------------------------------------------------ */
/* Admission diagnostics (DESIGN §4)                                         */
/* ------------------------------------------------------------------------ */

typedef enum akv_adm_rule {
  AKV_ADM_OWN_REUSE = 0,        /**< fill 1: own page that left the window */
  AKV_ADM_FREE = 1,             /**< fill 2: free page */
  AKV_ADM_RECLAIM_BORROWED = 2, /**< fill 3 / reclaim 1 */
  AKV_ADM_RECLAIM_ABOVE_TARGET = 3, /**< fill 3 / reclaim 2 */
  AKV_ADM_RECLAIM_IDLE = 4,     /**< fill 3 / reclaim 3 */
  AKV_ADM_SHRINK = 5,           /**< fill 4: window shrinks from its oldest page */
  AKV_ADM_REFUSE = 6,           /**< admission refused */
  AKV_ADM_ADMIT = 7,
  AKV_ADM_RELEASE = 8,
  /** fill 3 / reclaim 0: pages another context held beyond its target + burst
   *  (its headroom extension), taken back before borrowed pages */
  AKV_ADM_RECLAIM_HEADROOM = 9,
  /** a window position past target + burst filled while headroom is present */
  AKV_ADM_HEADROOM = 10,
  /** headroom pages given back to the caller (counter: pages; a log row per
   *  context that lost pages, victim = that context, and one summary row) */
  AKV_ADM_HEADROOM_RELEASE = 11,
  /** headroom pages taken (at create and by akv_headroom_take; counter: pages) */
  AKV_ADM_HEADROOM_TAKE = 12,
  AKV_ADM_RULE_COUNT = 13
} akv_adm_rule;

typedef struct akv_adm_decision {
  uint64_t step;
  uint32_t context; /**< context id (akv_context_id); UINT32_MAX for the engine's own
                         headroom rows */
  akv_adm_rule rule;
  uint32_t victim;  /**< context id of the victim, UINT32_MAX if none */
  uint32_t pages;
} akv_adm_decision;

/** A short name of an admission rule ("own-reuse", "free", ...; the admission
 *  log's words); never NULL, static storage. Thread-safe. A value outside
 *  akv_adm_rule gives "unknown". */
AKV_API const char *akv_adm_rule_string(akv_adm_rule rule);
/**
 * A context's id as admission decisions and explanations name it. Every open
 * that reaches admission, admitted or refused (AKV_ERR_ADMISSION_REFUSED),
 * takes the next id; an open refused before it (AKV_ERR_REFUSED_QUEUE,
 * AKV_ERR_STEP_STATE, AKV_ERR_CONFIG, ...) takes none. Ids run 1, 2, ... up to
 * UINT32_MAX - 1, then 1 again, so an id is not reused before 2^32 - 2
 * further attempts; 0 and UINT32_MAX are never issued, and an id stays
 * unique among the engine's open contexts (one an open context holds is
 * skipped). Returns AKV_OK, AKV_ERR_BAD_HANDLE, AKV_ERR_INVALID_ARGUMENT
 * (out NULL), AKV_ERR_IN_USE (another thread's call in progress).
 */
AKV_API akv_status akv_context_id(const akv_context *context, uint32_t *out);
/**
 * Per-rule counters since create, indexed by akv_adm_rule: pages moved for the
 * fill and reclaim rules, events for refuse/admit/release. Copies the first
 * min(n, AKV_ADM_RULE_COUNT). Allowed at any time. Returns AKV_OK,
 * AKV_ERR_BAD_HANDLE, AKV_ERR_INVALID_ARGUMENT (out NULL or n == 0),
 * AKV_ERR_IN_USE (another thread's call in progress).
 */
AKV_API akv_status akv_admission_counters(const akv_engine *engine, uint64_t *out, size_t n);
/**
 * Copies up to `cap` of the newest decisions (oldest first) into out and
 * their number into *n_out. The log is bounded (256 entries); older entries
 * are dropped. Allowed at any time. Returns AKV_OK, AKV_ERR_BAD_HANDLE,
 * AKV_ERR_INVALID_ARGUMENT (n_out NULL, or out NULL with cap > 0), AKV_ERR_IN_USE.
 */
AKV_API akv_status akv_admission_log(const akv_engine *engine, akv_adm_decision *out,
                                     size_t cap, size_t *n_out);
/**
 * Writes one readable paragraph explaining the context's admission: target,
 * burst, pages held, and why it waited or was refused. NUL-terminated,
 * truncated to `cap`. Pass context NULL to explain the last refused open:
 * one refused for want of a host slot (AKV_ERR_REFUSED_QUEUE) or by
 * admission (AKV_ERR_ADMISSION_REFUSED), whichever came last; opens refused
 * for other reasons (inside a step, a bad config) are not recorded.
 * Allowed at any time. Returns AKV_OK, AKV_ERR_BAD_HANDLE (engine, or a
 * context not open on this engine), AKV_ERR_INVALID_ARGUMENT (buf NULL or
 * cap == 0), AKV_ERR_IN_USE.
 */
AKV_API akv_status akv_admission_explain(const akv_engine *engine, const akv_context *context,
                                         char *buf, size_t cap);

/* ------------------------------------------------------------------------ */
/* Revocable headroom (DESIGN §6)                                            */
/* ------------------------------------------------------------------------ */

typedef struct akv_headroom_info {
  uint32_t enabled;          /**< 1 when the config asked for headroom on a retaining route */
  uint64_t profile_free_bytes; /**< free device memory measured at create, after the
                                    engine's own allocations */
  uint64_t cap_bytes;        /**< headroom_gib in bytes */
  uint64_t reserve_bytes;    /**< headroom_reserve_gib in bytes */
  uint32_t max_pages;        /**< pages measured at create: the most ever present */
  uint32_t chunk_pages;      /**< pages per allocation: the unit of release and take */
  uint32_t pages;            /**< present now (free or retaining history) */
  uint32_t pages_held;       /**< of those, retaining history */
  uint32_t pages_pending;    /**< asked back during the open step; freed at its end */
  uint64_t bytes;            /**< device bytes allocated for headroom now */
  uint64_t bytes_released;   /**< given back to the caller since create */
  uint64_t releases;         /**< akv_headroom_release calls that gave back at least one
                                  chunk, counted when the call returns (inside a step: the
                                  chunks it marked, freed later) */
  uint64_t takes;            /**< akv_headroom_take calls that took at least one chunk */
} akv_headroom_info;

/**
 * Fills *out with the engine's headroom figures. Enqueues nothing, never
 * blocks; allowed at any time, also after a transport failure.
 * Returns AKV_OK, AKV_ERR_BAD_HANDLE, AKV_ERR_INVALID_ARGUMENT (out NULL),
 * AKV_ERR_IN_USE.
 */
AKV_API akv_status akv_headroom_get(const akv_engine *engine, akv_headroom_info *out);

/**
 * Gives at least `bytes` of headroom back to the caller's allocator (whole
 * chunks, newest first: the fewest whose allocations cover `bytes`, each
 * chunk_pages pages plus, on the paged route, one page of slack; all of it
 * when bytes exceeds what is present; bytes == 0 gives nothing back).
 * Residency changes at step boundaries only:
 *  - Outside a step: the chunks leave admission and their device memory is
 *    freed before the call returns; *freed_now says how many bytes. Every
 *    lease of the last step has retired, so nothing can still read them. On
 *    CUDA the free is cudaFree, which may wait for the device to go idle
 *    (the runtime's rule): call it where that is acceptable.
 *  - Inside a step: nothing is freed and this call does not block; the
 *    chunks are marked and *pending says how many bytes. No fence is
 *    returned: akv_step_end, after every lease of the step has retired (so
 *    no copy or attention in flight still reads them), takes them out of
 *    admission and frees them; a quarantine that establishes completion
 *    frees them too; an uncertain one keeps them.
 * When the call (or the step end) has freed the memory, a device allocation of
 * that size by the caller can succeed. Decode goes on bit-identically: the
 * rows come from the authoritative host copy again. Counted in the admission
 * counters (headroom-release) and log. One thread at a time (engine rule).
 * freed_now and pending are optional (NULL), written on AKV_OK only (0 when
 * nothing was released). Returns AKV_OK, AKV_ERR_BAD_HANDLE,
 * AKV_ERR_NOT_SUPPORTED (headroom not enabled), AKV_ERR_QUARANTINED (also
 * after a transport failure: quarantine first), AKV_ERR_IN_USE; on any error nothing is
 * released and the outputs are left as they were.
 */
AKV_API akv_status akv_headroom_release(akv_engine *engine, uint64_t bytes, uint64_t *freed_now,
                                        uint64_t *pending);

/**
 * Takes headroom again, up to `bytes` (whole chunks) and never past the pages
 * measured at create nor past free - reserve as the device reports it now.
 * Only outside a step (allocates device memory: blocking, not for the hot
 * path). The pages are free and fill from the next step boundary on.
 * *taken (optional) receives the bytes of headroom taken.
 * Returns AKV_OK (also when nothing could be taken: *taken = 0),
 * AKV_ERR_BAD_HANDLE, AKV_ERR_NOT_SUPPORTED (headroom not enabled),
 * AKV_ERR_STEP_STATE (a step is open, or a release is pending),
 * AKV_ERR_QUARANTINED, AKV_ERR_IN_USE.
 */
AKV_API akv_status akv_headroom_take(akv_engine *engine, uint64_t bytes, uint64_t *taken);

#ifdef __cplusplus
}
#endif

#endif /* AKV_H */
