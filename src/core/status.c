/*
 * status.c - status strings and version numbers.
 */
#include "akv.h"

#define AKV_STR2(x) #x
#define AKV_STR(x) AKV_STR2(x)

AKV_API unsigned akv_version_number(void) { return AKV_VERSION_NUMBER; }

AKV_API const char *akv_version_string(void) {
  return AKV_STR(AKV_VERSION_MAJOR) "." AKV_STR(AKV_VERSION_MINOR) "." AKV_STR(AKV_VERSION_PATCH);
}

AKV_API const char *akv_status_string(akv_status status) {
  switch (status) {
    case AKV_OK: return "success";
    case AKV_ERR_INVALID_ARGUMENT: return "invalid argument";
    case AKV_ERR_BAD_HANDLE: return "bad handle (NULL, freed, or of another type)";
    case AKV_ERR_CONFIG: return "invalid configuration";
    case AKV_ERR_NO_FIT: return "configured concurrency does not fit the host pool";
    case AKV_ERR_REFUSED_QUEUE: return "refused: no host slot free, queue the request";
    case AKV_ERR_ADMISSION_REFUSED: return "refused by device page admission";
    case AKV_ERR_OUT_OF_MEMORY: return "out of memory";
    case AKV_ERR_CAPACITY: return "context capacity (max_tokens) reached";
    case AKV_ERR_STEP_STATE: return "call not allowed in the current step state";
    case AKV_ERR_LEASE_ORDER: return "previous lease is neither sealed nor retired";
    case AKV_ERR_LEASE_STATE: return "call not allowed in the lease's current state";
    case AKV_ERR_OWNER_MISMATCH: return "write-back to a host owner the lease did not begin with";
    case AKV_ERR_FENCE_MISMATCH: return "fence does not match the one the engine recorded";
    case AKV_ERR_BACKEND: return "backend operation failed; transport marked failed";
    case AKV_ERR_QUARANTINED: return "transport failed earlier; only diagnostics, quarantine, destroy";
    case AKV_ERR_BUSY: return "busy: live work, nothing was freed";
    case AKV_ERR_UNCERTAIN_FENCE: return "completion could not be established; resources retained";
    case AKV_ERR_NOT_SUPPORTED: return "not supported by this build or machine";
    case AKV_ERR_IN_USE: return "in use by the open step or a live ticket";
    case AKV_ERR_UNEVEN_LAYERS: return "a context's dense layers hold different row counts";
    case AKV_ERR_TIMEOUT: return "a rank did not reach the agreement point in time; communicator aborted";
    case AKV_ERR_COMM: return "the group's communicator failed; communicator aborted";
    case AKV_ERR_DISAGREE: return "ranks gave different inputs; nothing changed on any rank";
    case AKV_ERR_NOT_READY: return "not yet: fences pending, nothing changed";
    case AKV_STATUS_COUNT_: break;
  }
  return "unknown status";
}
