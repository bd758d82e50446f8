#!/bin/sh
# Fails if the layering of src/ is broken: the core (src/core) never includes a
# CUDA header, and no layer includes a file of a layer above it (backends and
# kernels never include the core's headers). Checked on every include line.
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
[ "$fail" = 0 ] && echo "layering: src/core includes no CUDA header; no arrow points up"
exit "$fail"
