#!/bin/sh
# Fails if the layering of src/ is broken: the core (src/core) never includes a
# CUDA header, and no layer includes a file of a layer above it (backends and
# kernels never include the core's headers; the core, backends and kernels
# never include the tensor parallel layers src/dist and src/nccl, nor their
# public headers akv_group.h and akv_nccl.h). src/dist is pure C: no CUDA or
# NCCL header. Checked on every include line.
#   tests/layering.sh <repository root>
set -eu
root=$1
fail=0
# Every include of a CUDA header: cuda*.h, cuda_runtime*, cu*.h of the toolkit,
# and nccl.h; also CUDA-only source files in the core.
bad=$(grep -nE '^[[:space:]]*#[[:space:]]*include[[:space:]]*[<"](cuda|cuda_runtime|cuda_runtime_api|driver_types|cuda_fp16|cuda_bf16|cuda_fp8|nccl|cub/|thrust/)' \
  "$root"/src/core/* 2>/dev/null || true)
if [ -n "$bad" ]; then
  echo "src/core includes a CUDA header:"; echo "$bad"; fail=1
fi
cu=$(ls "$root"/src/core/*.cu "$root"/src/core/*.cuh 2>/dev/null || true)
if [ -n "$cu" ]; then
  echo "CUDA sources in src/core:"; echo "$cu"; fail=1
fi
# An arrow between folders only points down: core -> backends -> (nothing);
# kernels include only the public headers.
for h in "$root"/src/core/*.h; do
  name=$(basename "$h")
  up=$(grep -nE "^[[:space:]]*#[[:space:]]*include[[:space:]]*\"$name\"" \
    "$root"/src/backends/* "$root"/src/kernels/* 2>/dev/null || true)
  if [ -n "$up" ]; then
    echo "a lower layer includes the core header $name:"; echo "$up"; fail=1
  fi
done
# The tensor parallel layers sit above the core: nothing below includes them.
for h in "$root"/src/dist/*.h "$root"/src/nccl/*.h "$root"/include/akv_group.h "$root"/include/akv_nccl.h; do
  [ -e "$h" ] || continue
  name=$(basename "$h")
  up=$(grep -nE "^[[:space:]]*#[[:space:]]*include[[:space:]]*[<\"]$name[>\"]" \
    "$root"/src/core/* "$root"/src/backends/* "$root"/src/kernels/* 2>/dev/null || true)
  if [ -n "$up" ]; then
    echo "a lower layer includes the tensor parallel header $name:"; echo "$up"; fail=1
  fi
done
# src/dist is pure C: the agreement runs on any collective, CUDA or not.
bad=$(grep -nE '^[[:space:]]*#[[:space:]]*include[[:space:]]*[<"](cuda|cuda_runtime|cuda_runtime_api|driver_types|nccl|akv_nccl|akv_cuda)' \
  "$root"/src/dist/* 2>/dev/null || true)
if [ -n "$bad" ]; then
  echo "src/dist includes a CUDA or NCCL header:"; echo "$bad"; fail=1
fi
cu=$(ls "$root"/src/dist/*.cu "$root"/src/dist/*.cuh 2>/dev/null || true)
if [ -n "$cu" ]; then
  echo "CUDA sources in src/dist:"; echo "$cu"; fail=1
fi
[ "$fail" = 0 ] && echo "layering: src/core includes no CUDA header; src/dist none of CUDA or NCCL; no arrow points up"
exit "$fail"
