/*
 * akv_group.h - tensor parallel groups: one engine per rank, every admission
 * decision and every quarantine agreed across the ranks (DESIGN §8,
 * docs/distributed.md).
 *
 * Each rank's engine holds its KV-head shard (engine config kv_heads = the
 * rank's heads) and stages it over its own link. What must never differ
 * between ranks is the plan: which contexts are admitted, which pages each
 * keeps resident, and whether the group is still healthy. A group makes the
 * calls that decide those (context open and close, the step boundary) into
 * agreement points: the ranks exchange their inputs through one collective
 * on the group's communicator before deciding and compare the outcome (its
 * status and, with digest checking, the plan's digest) after. The allocator
 * is deterministic, so agreed inputs give identical plans.
 *
 * Groups are made by akv_nccl_group_create (akv_nccl.h), on the caller's
 * NCCL communicator, when the library is built with NCCL, or by
 * akv_group_create_inproc below, with threads of one process as the ranks.
 *
 * What every rank sees (the same status on every rank unless stated):
 *  - Agreed inputs differ (contexts, lengths): AKV_ERR_DISAGREE; nothing
 *    changed on any rank.
 *  - A local argument or state error on any rank (NULL out, a step already
 *    open, a context still in a step or with uneven layers, ...): every rank
 *    returns the largest such status; nothing changed. It is returned before
 *    plan digests are compared (akv_step_end is not an agreement point, so
 *    a rank may still be in a step another ended; the digest covers that).
 *  - Any rank's transport failed (a backend error since the last agreement
 *    point), the outcome differs between ranks, or the plan digests differ:
 *    every rank quarantines its engine (akv_engine_quarantine) and returns
 *    AKV_ERR_QUARANTINED; akv_group_info_get says why and which rank failed.
 *    (A rank whose call came from its engine's log callback, where the
 *    engine refuses a quarantine, quarantines it at its next agreement
 *    call made outside the callback; until then akv_group_destroy, which
 *    never waits, answers AKV_ERR_BUSY if this rank's transport failed.)
 *  - A rank does not arrive within timeout_ms: the ranks that did arrive
 *    abort the communicator, quarantine their engines and return
 *    AKV_ERR_TIMEOUT within timeout_ms (plus a poll interval); the late rank
 *    returns AKV_ERR_TIMEOUT (NCCL: within its own timeout) or AKV_ERR_COMM.
 *  - The communicator fails (an NCCL error or asynchronous error): the rank
 *    aborts it, quarantines and returns AKV_ERR_COMM.
 *  - After any of the last three, every group call returns
 *    AKV_ERR_QUARANTINED without a collective; only akv_group_info_get,
 *    akv_group_engine (diagnostics, reads) and akv_group_destroy remain.
 *
 * Thread safety: a group and its engine are used from one thread at a time;
 * the ranks of a group call concurrently, each from its own thread or
 * process. A group call made while another thread is inside a call on the
 * same group (an agreement waiting for the other ranks, say) is refused:
 * it returns AKV_ERR_IN_USE at once (akv_group_last_error: a fixed
 * "group in use by another thread"), enters no collective, reads and
 * changes nothing; the call in progress goes on. So a second thread of a
 * rank is never counted as another rank, and akv_group_destroy never frees
 * what a call of another thread still uses. The engine's own calls claim
 * the engine the same way (akv.h, Thread safety), and an agreement call
 * (context open or close, step begin, check) holds its rank's engine from
 * its start to its return: a call on akv_group_engine's handle from
 * another thread meanwhile returns AKV_ERR_IN_USE, and an agreement call
 * made while another thread is inside a call on the engine returns
 * AKV_ERR_IN_USE on this rank only, at once (akv_group_last_error says
 * so), entering no collective and changing nothing: it is not one of the
 * rank's sequence, the other ranks wait for it as for a late rank, and
 * the rank calls again once the other thread is out. Other group calls
 * that meet another thread inside the engine get that status from it.
 * No group call, create included, is a cancellation point: cancellation
 * (pthread_cancel) is disabled inside each, and a cancel that arrives
 * while one waits acts at the thread's next cancellation point after the
 * call returned, so no rank is left blocked on a lock a cancelled thread
 * held. Every agreement point is a collective: each rank must make the
 * same sequence of agreement calls (a rank that makes a different call
 * meets the others at a point of another kind, which quarantines all).
 * fork: a child forked while other threads are inside group or world calls
 * may create worlds and groups of its own (the group layer's process-wide
 * locks are never left held in it). The parent's groups and worlds are the
 * parent's, as its engines are (akv.h, fork): every call the child makes on
 * a parent's group (akv_group_destroy included) returns AKV_ERR_BAD_HANDLE
 * at once and changes nothing, and every world call on a parent's world
 * refuses it as a destroyed world (AKV_ERR_INVALID_ARGUMENT). A group call
 * (create included) in progress on the thread that forked (from a log
 * callback) enters no collective in the child: it returns
 * AKV_ERR_BAD_HANDLE at its next agreement point.
 * Blocking: agreement calls block the calling thread until every rank
 * arrived or the timeout passed; nothing else in a group blocks.
 * Logging: a group logs through its engine config's log_fn. A group call
 * made from inside that callback on the same group returns its status but
 * logs nothing (so a callback that calls back cannot recurse without end);
 * an agreement call made there is still one of the rank's sequence. The
 * engine's own log callback (the same log_fn) may run while an agreement
 * call decides, between its two collectives: a group call made there on the
 * same group that is an agreement point, or akv_group_destroy, returns
 * AKV_ERR_IN_USE and enters no collective (it is not one of the rank's
 * sequence); the agreement in progress goes on. Outside an agreement, an
 * agreement point that decides (context open or close, step begin) called
 * from the engine's log callback is one of the rank's sequence, but the
 * engine refuses every change from inside its callback (akv_log_fn): it is
 * a local state error, and every rank returns AKV_ERR_IN_USE with nothing
 * changed (akv_group_check goes on as usual).
 * Handles: a group or world handle is checked to be the start of one of
 * the library's group (world) records before anything of it is read, so a
 * pointer that was never such a handle (another library handle, the
 * caller's memory, a pointer into a record, whatever its bytes) is refused
 * like a destroyed one
 * (AKV_ERR_BAD_HANDLE; world calls AKV_ERR_INVALID_ARGUMENT) and never
 * read as one.
 * Streams: the collectives run on the group's own queue (NCCL: a stream the
 * group created on the engine's device); the caller's compute stream is
 * never touched.
 */
#ifndef AKV_GROUP_H
#define AKV_GROUP_H

#include "akv.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct akv_group akv_group; /**< one rank of a tensor parallel group */

/** Digest checking: each plan's digest compared across ranks. */
typedef enum akv_group_digest {
  AKV_GROUP_DIGEST_DEFAULT = 0, /**< on in debug builds (NDEBUG unset), off in release */
  AKV_GROUP_DIGEST_ON = 1,      /**< always on (if any rank asks, every rank checks) */
} akv_group_digest;

/**
 * The most ranks a group (and an in-process world) has. Tensor parallel
 * groups span one NVLink domain (8 GPUs in a host, 72 in the largest rack
 * today) or a few of them, and an in-process world runs one thread and one
 * engine (with its own queue threads) per rank: 4096 is far beyond either,
 * while it keeps what is sized by the rank count small (an in-process
 * world's table of ranks: UINT32_MAX ranks asked for 4 GiB). A larger size
 * is refused: AKV_ERR_INVALID_ARGUMENT by akv_group_world_create,
 * AKV_ERR_CONFIG at group create (a group config's size).
 */
#define AKV_GROUP_MAX_RANKS 4096u

typedef struct akv_group_config {
  uint32_t struct_size; /**< sizeof(akv_group_config) */
  uint32_t version;     /**< AKV_CONFIG_VERSION */
  uint32_t rank;        /**< this rank, 0..size-1 */
  uint32_t size;        /**< ranks in the group, 1..AKV_GROUP_MAX_RANKS */
  uint32_t timeout_ms;  /**< longest wait at an agreement point, >= 1 */
  akv_group_digest digest; /**< outside akv_group_digest: AKV_ERR_CONFIG at create */
} akv_group_config;

#define AKV_GROUP_CONFIG_INIT \
  { sizeof(akv_group_config), AKV_CONFIG_VERSION, 0, 1, 60000, AKV_GROUP_DIGEST_DEFAULT }

/** Why a group stopped. */
typedef enum akv_group_reason {
  AKV_GROUP_HEALTHY = 0,
  AKV_GROUP_PEER_FAILED = 1,     /**< a rank's transport failed (failed_rank names the first) */
  AKV_GROUP_DIGEST_MISMATCH = 2, /**< the ranks' plan digests differ */
  AKV_GROUP_DIVERGED = 3,        /**< the ranks' outcomes or agreement points differ */
  AKV_GROUP_TIMEOUT = 4,         /**< a rank did not arrive; communicator aborted */
  AKV_GROUP_COMM_FAILED = 5      /**< the communicator failed; communicator aborted */
} akv_group_reason;

typedef struct akv_group_info {
  uint32_t rank, size;
  uint64_t agreements;     /**< collectives this rank completed */
  uint64_t digest;         /**< digests compared: the plan digest at the last agreement
                                point; else the engine's plan digest now (0 once the
                                caller destroyed the engine itself) */
  int digest_checked;      /**< 1 when digests are compared */
  int stopped;             /**< 1 once the group quarantined or its communicator failed */
  akv_group_reason reason;
  uint32_t failed_rank;    /**< PEER_FAILED: the lowest failed rank; else UINT32_MAX */
  /* The agreed inputs of the engines (the MIN over ranks of each). */
  uint32_t host_pool_gib, device_pool_gib, max_contexts;
  uint32_t local_host_pool_gib, local_device_pool_gib, local_max_contexts; /**< as configured here */
} akv_group_info;

/**
 * In-process groups: the ranks are threads of one process (one engine per
 * thread), agreeing through a world they share instead of a communicator.
 * Used by callers that drive every rank from one process without NCCL (the
 * activekv CLI's --tp on the host backend, tests). Everything after creation
 * is as for NCCL groups.
 */
typedef struct akv_group_world akv_group_world;

/**
 * A world of `size` ranks whose engines have at most max_contexts contexts
 * each. Its buffers are sized for at most the engine's own limit (2^20
 * contexts: akv_engine_create refuses more with AKV_ERR_CONFIG), so a larger
 * max_contexts (UINT32_MAX for "any") costs no more than that, and a shard
 * beyond the limit is refused by the engine at create, on every rank alike.
 * Thread-safe once made. Returns AKV_OK, AKV_ERR_INVALID_ARGUMENT (NULL,
 * size or max_contexts 0, size above AKV_GROUP_MAX_RANKS; nothing
 * allocated), AKV_ERR_OUT_OF_MEMORY.
 */
AKV_API akv_status akv_group_world_create(uint32_t size, uint32_t max_contexts,
                                          akv_group_world **out);

/**
 * Creates rank config->rank's group in `world` (config->size must be the
 * world's size, shard->max_contexts at most the world's). Otherwise as
 * akv_nccl_group_create (a collective: every rank calls it from its own
 * thread; the same statuses on every rank), with AKV_ERR_CONFIG (this rank
 * only, without entering the agreement) for a group config too short to hold
 * rank and size, a rank, size or max_contexts the world does not take, or a
 * rank that already has a live group in this world
 * (a rank is taken from the create until its group's akv_group_destroy), and
 * AKV_ERR_INVALID_ARGUMENT (this rank only, without entering the agreement)
 * for a NULL config or world or a destroyed world. A NULL shard or out
 * meets the others: AKV_ERR_INVALID_ARGUMENT on every rank (like any
 * create, it waits for them: a rank calling alone gets AKV_ERR_TIMEOUT
 * and the world is aborted).
 */
AKV_API akv_status akv_group_create_inproc(const akv_engine_config *shard,
                                           const akv_group_config *config,
                                           akv_group_world *world, akv_group **out);

/**
 * Aborts the world as a failed communicator: ranks waiting at an agreement
 * point return AKV_ERR_COMM at once (their groups stop), and so does every
 * later agreement. For a caller whose rank failed outside the group, so that
 * the others need not wait for their timeout. A world is aborted once: one
 * that a timeout already aborted keeps answering AKV_ERR_TIMEOUT (the first
 * abort's status and reason stay). Thread-safe. Returns AKV_OK,
 * AKV_ERR_INVALID_ARGUMENT (NULL or a destroyed world).
 */
AKV_API akv_status akv_group_world_abort(akv_group_world *world);

/** Frees the world, after every rank's group was destroyed. Returns AKV_OK,
 *  AKV_ERR_INVALID_ARGUMENT (NULL or a destroyed world), AKV_ERR_BUSY (a
 *  group of this world still lives; nothing freed). Worlds, like groups, are
 *  records never freed (akv.h "Handle lifetimes"): a destroyed world is
 *  refused by every world call, never read after free, until at least 32
 *  later akv_group_world_create calls in the process. Thread-safe: a world
 *  call racing the destroy either finds the world alive and is done with it
 *  first, or refuses it. */
AKV_API akv_status akv_group_world_destroy(akv_group_world *world);

/**
 * This rank's engine, for everything that is not an agreement point (leases,
 * step_end, appends, reads, diagnostics). Do not call akv_context_open,
 * akv_context_close or akv_step_begin on it directly: the plan would diverge
 * from the other ranks' (digest checking catches it at the next agreement
 * point and quarantines every rank). The group owns the engine: destroy it
 * with akv_group_destroy. An engine destroyed directly stops the group at
 * its next agreement point (AKV_ERR_QUARANTINED, reason PEER_FAILED, on
 * every rank), and akv_group_destroy then frees the rest of the group. The
 * group knows its engine by a serial the engine got at create, not by the
 * handle (a record that later engine creates hand out again, akv.h "Handle
 * lifetimes"): however many engines were created since, no group call acts
 * on an engine the dead handle may name now (none quarantines, destroys or
 * opens, closes or steps contexts on it), and this call then sets *out to
 * NULL. Allowed at any time (in any state, from the thread using the
 * group). Returns AKV_OK, AKV_ERR_BAD_HANDLE, AKV_ERR_INVALID_ARGUMENT (out
 * NULL), AKV_ERR_IN_USE (another thread is inside a call on this group;
 * *out untouched).
 */
AKV_API akv_status akv_group_engine(const akv_group *group, akv_engine **out);

/**
 * Agreement point: opens a context on every rank. The target and burst are
 * the MIN over ranks of the ones given (config may differ per rank; NULL is
 * AKV_CONTEXT_CONFIG_INIT). Every rank opens or refuses alike; the context
 * gets the same id on every rank: the ids are compared with the outcome,
 * and ranks whose engines would number it differently (a context opened
 * on one rank's engine directly, whether digests are checked or not) all
 * stop (AKV_ERR_QUARANTINED, reason DIVERGED or DIGEST_MISMATCH). Blocks until every rank arrived.
 * Returns, on every rank: AKV_OK, AKV_ERR_INVALID_ARGUMENT, AKV_ERR_CONFIG,
 * AKV_ERR_STEP_STATE, AKV_ERR_REFUSED_QUEUE, AKV_ERR_ADMISSION_REFUSED (as
 * akv_context_open), AKV_ERR_IN_USE (called from the engine's log callback
 * on any rank, outside an agreement; nothing changed on any rank),
 * AKV_ERR_QUARANTINED, AKV_ERR_TIMEOUT, AKV_ERR_COMM;
 * AKV_ERR_BAD_HANDLE (this rank only, without entering the agreement);
 * AKV_ERR_IN_USE (this rank only, without entering the agreement: called
 * from the engine's log callback while an agreement of this group decides,
 * see Logging at the top, or while another thread is inside a call on this
 * rank's engine, see Thread safety).
 */
AKV_API akv_status akv_group_context_open(akv_group *group, const akv_context_config *config,
                                          akv_context **out);

/**
 * Agreement point: closes the context with the same id on every rank.
 * Returns, on every rank: AKV_OK, AKV_ERR_BAD_HANDLE (a context not open on
 * this rank's engine), AKV_ERR_DISAGREE (different contexts), AKV_ERR_IN_USE
 * (the context is in an open step, or has host page leases, on any rank:
 * akv_step_end is not an agreement point; or the call came from the
 * engine's log callback on any rank; nothing changed on any rank),
 * AKV_ERR_QUARANTINED, AKV_ERR_TIMEOUT, AKV_ERR_COMM; AKV_ERR_IN_USE (this
 * rank only, as for akv_group_context_open).
 */
AKV_API akv_status akv_group_context_close(akv_group *group, akv_context *context);

/**
 * Agreement point: the step boundary. The ranks agree that they step the
 * same contexts (ids, in order) at the same lengths, then each runs
 * akv_step_begin; the outcomes and plan digests are compared.
 * Returns, on every rank: AKV_OK, AKV_ERR_INVALID_ARGUMENT, AKV_ERR_BAD_HANDLE
 * (a context not open here), AKV_ERR_STEP_STATE, AKV_ERR_CAPACITY (as
 * akv_step_begin), AKV_ERR_UNEVEN_LAYERS (a context's layers hold different
 * row counts on any rank; nothing changed on any rank), AKV_ERR_IN_USE
 * (called from the engine's log callback on any rank, outside an
 * agreement; nothing changed on any rank), AKV_ERR_DISAGREE,
 * AKV_ERR_QUARANTINED, AKV_ERR_TIMEOUT, AKV_ERR_COMM; AKV_ERR_IN_USE (this
 * rank only, as for akv_group_context_open).
 */
AKV_API akv_status akv_group_step_begin(akv_group *group, akv_context *const *contexts,
                                        uint32_t n);

/**
 * Agreement point without a decision: the ranks compare their health and
 * (with digest checking) their plans, e.g. after akv_step_end, to learn of a
 * peer's failure before the next boundary. Returns, on every rank: AKV_OK,
 * AKV_ERR_QUARANTINED, AKV_ERR_TIMEOUT, AKV_ERR_COMM; AKV_ERR_IN_USE (this
 * rank only, as for akv_group_context_open).
 */
AKV_API akv_status akv_group_check(akv_group *group);

/** Fills *out. Allowed at any time (in any state, from the thread using
 *  the group). Returns AKV_OK, AKV_ERR_BAD_HANDLE, AKV_ERR_INVALID_ARGUMENT
 *  (out NULL), AKV_ERR_IN_USE (another thread is inside a call on this
 *  group, or, where digests are not compared, on its engine, whose plan
 *  digest it would read; *out untouched). */
AKV_API akv_status akv_group_info_get(const akv_group *group, akv_group_info *out);

/** The last error of this rank's group in words ("" before any); owned by
 *  the group. A bad handle gives a static "bad group handle", a group
 *  another thread is inside a call on a static "group in use by another
 *  thread". */
AKV_API const char *akv_group_last_error(const akv_group *group);

/**
 * Destroys this rank's engine (akv_engine_destroy: never waits; AKV_ERR_BUSY
 * with live work, and then nothing is freed; an engine already destroyed
 * directly is skipped, see akv_group_engine) and the group's resources. Not
 * a collective: it never waits on peers. The caller's communicator is not
 * destroyed (after AKV_ERR_TIMEOUT or AKV_ERR_COMM it was aborted, which
 * freed it: do not use it again). Returns AKV_OK, AKV_ERR_BAD_HANDLE,
 * AKV_ERR_BUSY, AKV_ERR_IN_USE (called from the engine's log callback, or
 * from a log callback during a call on this group, or while another thread
 * is inside a call on this group or on its engine; nothing freed). The
 * engine is held (its claim) from the check that it is still the group's
 * to its destroy, so an engine another thread destroyed directly meanwhile
 * is never confused with a newer engine on its record. A group handle is a record never freed (akv.h "Handle
 * lifetimes"): once destroyed, every group call answers AKV_ERR_BAD_HANDLE
 * until at least 32 later group creates in the process.
 */
AKV_API akv_status akv_group_destroy(akv_group *group);

#ifdef __cplusplus
}
#endif

#endif /* AKV_GROUP_H */
