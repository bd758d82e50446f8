/*
 * internal.h - the engine's private state: engine, context and lease bodies.
 *
 * Handles carry magic values at both ends, checked on entry and poisoned when
 * the object is freed or closed. Everything here is sized at engine creation;
 * nothing is allocated afterwards.
 */
#ifndef AKV_INTERNAL_H
#define AKV_INTERNAL_H

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "admission.h"
#include "akv.h"
#include "budget.h"
#include "dispatch.h"

#define AKV_MAGIC_ENGINE 0x454b5641u  /* "AVKE" */
#define AKV_MAGIC_CONTEXT 0x434b5641u /* "AVKC" */
#define AKV_MAGIC_LEASE 0x4c4b5641u   /* "AVKL" */
#define AKV_MAGIC_STREAM 0x534b5641u  /* "AVKS" */
#define AKV_MAGIC_DEAD 0xdeadbeefu

#define AKV_GIB ((uint64_t)1 << 30)
#define AKV_N_BUFFERS 2 /* double-buffered staging */
#define AKV_MAX_PRIOR 8 /* prior readers a lease can list */

/* A ticket: one submitted copy (or batch) on behalf of one host owner. It
 * holds the pinned pool (the owner of the memory DMA reads or writes) and a
 * host page lease on the owner's slot at a generation: the slot cannot change
 * generation while the ticket lives. */
typedef struct akv_ticket {
  akv_copy_dir dir;
  uint32_t slot;
  uint64_t generation;
  uint64_t bytes;
} akv_ticket;

/* A reader of a staging buffer whose completion a later writer must wait for. */
typedef struct akv_reader {
  akv_bevent *event;
  uint32_t buffer;
  struct akv_lease_body *lease; /* the lease the event belongs to */
  uint64_t lease_serial;   /* that lease's serial when the reader was listed */
} akv_reader;

typedef enum akv_lease_state {
  AKV_LEASE_IDLE = 0,   /* never begun in this slot */
  AKV_LEASE_BEGUN,      /* copies submitted, history-ready events recorded */
  AKV_LEASE_READY,      /* compute stream waits on history-ready */
  AKV_LEASE_CONSUMED,   /* attention-consumed event recorded; write-back open */
  AKV_LEASE_SEALED,     /* tail and attention fences confirmed */
  AKV_LEASE_RETIRED     /* every fence proven; tickets released */
} akv_lease_state;

/* A lease handle (the public akv_lease): a record from the process-wide
 * pool (records.h), one per begin. It is live from its begin until its
 * lease retires (or quarantine releases it); then its magic is poisoned and
 * it queues behind the engine's other handle records, so a retired handle
 * answers AKV_ERR_BAD_HANDLE instead of naming a later lease of its layer. */
struct akv_lease {
  uint32_t magic;
  /* The engine that holds this record, from its create to its destroy
   * (records are taken at create, akv_engine_allocate): what a lease call
   * claims (akv_lease_claim) before it reads the body, which the engine
   * allocated and its destroy frees. Read and written atomically. */
  struct akv_engine *engine;
  struct akv_lease_body *body; /* the layer's lease; read only while magic is live */
  uint64_t serial;             /* body->serial at begin */
  uint32_t magic_end;
};

/* One dense layer's lease: the state machine of DESIGN §5 (lease.c). */
typedef struct akv_lease_body {
  struct akv_lease *handle; /* the live handle of the current begin, or NULL */
  struct akv_engine *engine;
  uint32_t layer;
  uint32_t buffer;
  uint64_t serial; /* unique per begin */
  uint64_t step;
  akv_lease_state state;
  akv_stream stream; /* the compute stream given to wait_ready */

  akv_bevent *ev_h2d, *ev_d2d, *ev_attn, *ev_tail;
  bool used_d2d;
  uint64_t fence_attn, fence_tail;

  akv_reader prior[AKV_MAX_PRIOR];
  uint32_t n_prior;

  uint32_t n_contexts;
  struct akv_context **contexts; /* [concurrency] */
  uint32_t *len;                 /* [concurrency] */
  uint64_t *generation;          /* [concurrency] owner generation at begin */
  uint8_t *written;              /* [concurrency] write-back done */
  uint32_t n_written;

  akv_ticket *tickets; /* [3 * concurrency] */
  uint32_t n_tickets;
  uint64_t bytes_h2d, bytes_d2d, bytes_d2h;
  uint64_t bytes_in_place; /* paged route: retained pages attention reads in place */
} akv_lease_body;

/* A context handle: a record from the process-wide pool (records.h), taken
 * at open and given back at close (or at its engine's destroy), poisoned. */
struct akv_context {
  uint32_t magic;
  struct akv_engine *engine;
  uint32_t slot;
  uint32_t id;
  bool open;
  uint32_t len;          /* rows of every dense layer: min over layer_len */
  uint32_t *layer_len;   /* [n_dense_layers]: rows each layer holds (its slot's
                            row of engine.slot_layer_len); >= len, and == len
                            on every layer of a context in a step */
  uint32_t target, burst;
  uint64_t generation;   /* host slot generation */
  uint32_t host_leases;  /* tickets holding the slot */
  uint32_t fill_leases;  /* of which: page fills of the open step */
  uint64_t fill_generation; /* the generation the fill tickets were taken at */
  uint32_t asked_target; /* target the caller asked for, before the floor */
  uint32_t asked_burst;
  bool in_step;
  uint8_t *host;         /* slot base in the pinned pool */
  uint32_t magic_end;
};

/* A batch of copies being built: cap entries of (dst, src, bytes). */
typedef struct akv_scratch {
  size_t cap;
  void **dst;
  const void **src;
  size_t *bytes;
} akv_scratch;

/* A compute stream of the host backend as the caller holds it (the public
 * akv_stream there): a record from the process-wide pool (records.h), taken
 * at akv_stream_create and poisoned and given back at akv_stream_destroy, so
 * a destroyed stream's value never names a later stream (the backend's
 * queue memory is reused at once). On CUDA the akv_stream is the
 * cudaStream_t itself, which the caller launches on: no record. */
struct akv_stream_handle {
  uint32_t magic;
  struct akv_engine *engine;
  akv_bqueue *queue;
  uint32_t magic_end;
};

struct akv_stream_rec {
  akv_bqueue *queue;
  akv_stream handle; /* what the caller was given: the record (host) or the queue */
  bool live;
};

/* An engine: a record from the process-wide pool (records.h). Destroy frees
 * everything the engine allocated, poisons the record and gives it back; the
 * record itself is never freed, so a destroyed handle reads as dead. */
struct akv_engine {
  uint32_t magic;
  /* The claim (akv_engine_claim): the header of the record, which create
   * leaves as it finds it (only the fields after it are zeroed) and
   * destroy never clears. */
  _Atomic(const void *) owner; /* the thread inside a call on this engine, or NULL */
  uint32_t depth;              /* the owner's calls in progress (nested from callbacks) */
  int cancel_state;            /* the owner's cancelability before its outermost call */
  /* Destroyed by a nested call (a hook's akv_engine_destroy): the record goes
   * back to its pool at the outermost release, not before (akv_engine_give). */
  bool give_on_release;
  /* akv_fork_generation at create (records.h), stored and read atomically:
   * a stale handle's claim reads it while a create on the record sets it. */
  uint32_t fork_gen;
  /* Unique in the process, never 0, given at create (akv_engine_serial,
   * plan.h) and set to 0 at destroy: by it a layer that keeps an engine
   * handle (a group) tells whether the record still holds its engine or
   * was handed to a newer one (records.h). */
  uint64_t serial;
  akv_engine_config cfg;
  akv_fit_report fit;
  akv_backend_kind backend;
  uint32_t concurrency;
  /* Layout (host pool, staging buffers, device pages alike): the K row and
   * the V row of a token sit side by side, [K row][V row], pair_bytes apart
   * from the next token's, so one token range of one layer is one
   * contiguous byte range and one copy. */
  uint64_t row_bytes;    /* one K (or V) row: kv_heads * head_dim * dtype size */
  uint64_t pair_bytes;   /* 2 * row_bytes: the row stride */
  uint64_t seg_bytes;    /* max_tokens * pair_bytes: one layer of one context */
  uint64_t page_bytes;
  uint64_t page_seg_bytes; /* page_tokens * pair_bytes: one layer of one page */
  uint32_t max_logical_pages;
  akv_budget budget; /* bookkeeping and scratch sizes (budget.h) */

  akv_bk bk;
  akv_bqueue *q_h2d, *q_d2h, *q_d2d;
  akv_bevent *ev_fill;

  uint8_t *host_pool;
  uint64_t host_pool_bytes;
  uint8_t *dev_pool;
  uint64_t dev_pool_bytes;
  uint32_t n_pages;
  uint32_t *page_map_host; /* paged route: [concurrency][max_logical_pages], pinned */
  uint32_t *page_map_dev;  /* its device copy, read by attention */
  uint64_t page_map_bytes;
  uint8_t *poison;         /* poison_holes: one page-layer of 0xFF bytes, device */
  uint8_t *staging[AKV_N_BUFFERS];
  uint64_t staging_bytes; /* each buffer */
  uint64_t device_allocated;

  akv_adm *adm;
  /* Physical pages (pool, then headroom; headroom.c): K row 0 of layer 0 of
   * each, and on the paged route its page_map entry, the page sitting at
   * page_base + entry * page_bytes. [n_pages + hr_max_pages] each. */
  uint8_t **page_ptr;
  uint32_t *page_entry;
  uint8_t *page_base;   /* paged route: the grid's origin (akv_view.pages of layer 0) */
  uint64_t page_base_k; /* pool page p has entry page_base_k + p */

  /* Revocable headroom (headroom.c). Chunks [0, hr_chunks) are allocated;
   * the newest hr_pending_chunks of them are asked back during the open step
   * and freed at its end. */
  bool hr_enabled;
  uint32_t hr_max_pages, hr_chunk_pages, hr_max_chunks;
  uint32_t hr_chunks, hr_pending_chunks;
  uint8_t **hr_chunk;        /* [hr_max_chunks] */
  uint64_t hr_alloc_bytes;   /* one chunk's allocation (slack page included on paged) */
  uint64_t hr_cap_bytes, hr_reserve_bytes, hr_profile_free;
  uint64_t hr_bytes_released, hr_releases, hr_takes;

  /* Context handles are records of the process-wide pool (records.h),
   * taken at open: concurrency of them are reserved at create, so open
   * never allocates. */
  bool contexts_reserved;
  struct akv_context **slot_owner;  /* [concurrency]: the open record on a host slot, or NULL */
  uint64_t *slot_generation;        /* [concurrency]: moves at each open of the slot */
  uint32_t *slot_layer_len;         /* [concurrency][n_dense_layers]: rows per layer */
  uint32_t next_context_id;
  uint32_t open_contexts;

  /* step */
  bool step_open;
  uint64_t step;
  uint32_t step_n;
  struct akv_context **step_ctx; /* [concurrency] */
  akv_adm_request *adm_req;      /* [concurrency] */
  uint32_t next_layer;
  uint32_t leases_live;
  akv_lease_body *leases; /* [n_dense_layers] */
  akv_lease_body *last_begun;
  /* Lease handle records, AKV_LEASE_HANDLES_PER_LAYER per dense layer, taken
   * from the process-wide pool at create and handed out in FIFO order: a
   * retired handle queues behind every free one. */
  struct akv_lease **lease_recs;  /* [n_lease_recs]: every record this engine holds */
  struct akv_lease **lease_ring;  /* [n_lease_recs]: FIFO of the free ones */
  uint32_t n_lease_recs, lease_head, lease_free;
  uint64_t lease_serial;

  /* Scratch for batched copies: one buffer, one owner, each sized at create
   * from its own worst case (budget.h). */
  akv_scratch sc_stage; /* lease_begin: host->device runs */
  akv_scratch sc_mat;   /* lease_begin: device->device copies */
  akv_scratch sc_wb;    /* lease_write_back: one row pair per owner */
  akv_scratch sc_fill;  /* step_begin: page fills, in batches of at most its cap */

  /* last refused open: the target and burst it asked for and what the floor
   * raised them to (admission refusals; akv_admission_explain(NULL) states
   * both); refused_queue when the last one found no host slot
   * (AKV_ERR_REFUSED_QUEUE), at step refused_queue_step */
  uint32_t refused_asked_target, refused_target;
  uint32_t refused_asked_burst, refused_burst;
  bool refused_queue;
  uint64_t refused_queue_step;

  /* compute streams handed out by akv_stream_create */
  struct akv_stream_rec streams[8];

  /* state */
  bool transport_failed;
  bool quarantined;
  bool retained; /* quarantine could not establish completion */
  /* Calls of the caller's log callback now running on this engine (akv_log).
   * While nonzero, every call that changes the engine refuses with
   * AKV_ERR_IN_USE (akv_engine_reentered): the logging call is midway
   * through its own change and continues after the callback returns. */
  uint32_t log_depth;
  char last_error[1024];

  /* statistics */
  uint64_t bytes_h2d, bytes_d2h, bytes_d2d;
  uint64_t bytes_in_place;
  uint64_t copies_h2d, copies_d2h, copies_d2d;
  uint64_t steps_done, leases_retired;
  uint32_t magic_end;
};

/* log.c */
void akv_log(const akv_engine *e, akv_log_level level, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
void akv_log_cfg(const akv_engine_config *cfg, akv_log_level level, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* Records the engine's last error (and logs it at WARN); returns st. */
akv_status akv_fail(akv_engine *e, akv_status st, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* engine.c */
bool akv_engine_ok(const akv_engine *e);
const char *akv_route_name(akv_route r);
/* Marks the transport failed after a failed backend op; returns AKV_ERR_BACKEND. */
akv_status akv_transport_failed(akv_engine *e, akv_status st, const char *where);
/* Common entry check of a claimed engine: not failed, not called from
 * its log callback for a change. `call` names the public call (akv.h: a
 * refusal's last error names it). */
akv_status akv_engine_enter(akv_engine *e, const char *call);
/* The claim (engine.c): AKV_OK with the engine claimed by this thread,
 * AKV_ERR_BAD_HANDLE (not a live engine) or AKV_ERR_IN_USE (another
 * thread is inside a call on it), both with nothing written. Every public
 * call that takes an engine, or a handle of one, claims it and releases
 * it on every return. */
akv_status akv_engine_claim(const akv_engine *e);
void akv_engine_release(const akv_engine *e);
/* The handles' own claims: the engine the handle belongs to, claimed, in
 * *out (AKV_OK), or the claim's refusal with nothing claimed. */
akv_status akv_context_claim(const akv_context *c, akv_engine **out);
akv_status akv_lease_claim(const akv_lease *h, akv_engine **out);
/* Handle words read before the engine is claimed (magics, a handle's
 * engine, a context's open flag): atomic on both sides. */
#define AKV_LOAD(field) __atomic_load_n(&(field), __ATOMIC_ACQUIRE)
#define AKV_STORE(field, v) __atomic_store_n(&(field), (v), __ATOMIC_RELEASE)
/* AKV_ERR_IN_USE (last error set, nothing logged) when called from the
 * engine's own log callback, else AKV_OK; the engine handle is live. */
akv_status akv_engine_reentered(akv_engine *e);
/* true when e (a record: never freed, so always readable) was created
 * before this process forked: an engine of the parent (akv_engine_claim). */
bool akv_engine_forked(const akv_engine *e);

/* context.c */
bool akv_context_ok(const akv_context *c);
/* 1 when some dense layer holds more rows than the context length. */
bool akv_context_uneven(const akv_engine *e, const akv_context *c);
bool akv_context_in_use(const akv_context *c);
/* Row 0 of `layer` of the context's authoritative host history (K at +0,
 * V at +row_bytes, pair_bytes per token). */
uint8_t *akv_host_layer(const akv_engine *e, const akv_context *c, uint32_t layer);
/* A ticket takes a host page lease on the context's slot (close and read
 * refuse while one is held); returns the slot generation it holds. */
uint64_t akv_ticket_take(akv_engine *e, akv_context *c);
/* True when a ticket taken on `slot` at `generation` may be released: the
 * slot is still held by a context of that generation with a lease to give
 * back. */
bool akv_ticket_valid(const akv_engine *e, uint32_t slot, uint64_t generation);
/* Releases a valid ticket (akv_ticket_valid); the caller checked it. */
void akv_ticket_release(akv_engine *e, uint32_t slot);

/* The admission floor: pages a context that retains anything holds at
 * least (sink + newest page; fewer only when a context has fewer pages). */
uint32_t akv_admission_floor(const akv_engine *e);

/* copy.c */
/* Submits n copies on q as one batch (akv_bk_copy_batch) and counts it in
 * the engine's copies_* and bytes_* of `dir` once the backend accepted it:
 * the only place those counters move. Copies that akv_engine_info counts
 * nowhere (poison_holes fills) go to akv_bk_copy_batch directly. */
akv_status akv_copy_submit(akv_engine *e, akv_bqueue *q, akv_copy_dir dir, size_t n,
                           void *const *dst, const void *const *src, const size_t *bytes);

/* stream.c */
/* The backend queue of a stream the caller passed, or NULL: where the
 * backend makes it possible (host backend), only a live stream this engine
 * handed out; on CUDA any non-NULL cudaStream_t. */
akv_bqueue *akv_stream_queue(const akv_engine *e, akv_stream s);
/* true when the calling thread runs a function enqueued on one of e's live
 * streams (akv_stream_launch_host; host backend), which calls back: a wait
 * there may be a wait for that very function (stream.c). */
bool akv_engine_on_own_stream(const akv_engine *e);

/* headroom.c */
/* Create, after every other device allocation: profile, log line, sizes. */
akv_status akv_headroom_setup(akv_engine *e);
/* Create, once admission exists: page address tables and the first take. */
akv_status akv_headroom_start(akv_engine *e);
/* At a point where no lease is live (step_end, proven quarantine): frees the
 * chunks asked back during the step. */
akv_status akv_headroom_apply_pending(akv_engine *e);
void akv_headroom_free_all(akv_engine *e);

/* lease.c */
void akv_leases_release_all(akv_engine *e); /* quarantine, after completion is proven */
/* The lease a live handle names, or NULL (NULL, foreign, retired, or of a
 * destroyed engine). Never reads past the handle record unless it is live. */
akv_lease_body *akv_lease_resolve(const akv_lease *handle);

#define AKV_CHECK(expr)                \
  do {                                 \
    st = (expr);                       \
    if (st != AKV_OK) goto fail;       \
  } while (0)

#endif /* AKV_INTERNAL_H */
