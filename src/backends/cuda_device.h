/*
 * cuda_device.h - the calling thread's current device, switched for a call
 * and restored after it (the CUDA backend and the NCCL group: neither ever
 * changes its caller's current device, akv.h device_ordinal).
 */
#ifndef AKV_CUDA_DEVICE_H
#define AKV_CUDA_DEVICE_H

#include <cuda_runtime.h>

/* Makes `device` current; *prev receives the caller's device (-1 when it
 * could not be read, and then nothing was switched). */
static inline cudaError_t akv_cuda_device_enter(int device, int *prev) {
  cudaError_t err = cudaGetDevice(prev);
  if (err != cudaSuccess) {
    *prev = -1;
    return err;
  }
  return *prev == device ? cudaSuccess : cudaSetDevice(device);
}

/* Restores the caller's device read by akv_cuda_device_enter. Restoring can
 * only fail if that device went away; nothing useful can be done then. */
static inline void akv_cuda_device_leave(int device, int prev) {
  if (prev >= 0 && prev != device) (void)cudaSetDevice(prev);
}

#endif /* AKV_CUDA_DEVICE_H */
