#!/usr/bin/env bash
# Builds the library and the activekv CLI, then runs its demo: CUDA when a GPU
# is present, the host backend otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
log=$(mktemp)
if ! { cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo &&
       cmake --build build -j "$(nproc 2>/dev/null || echo 2)" --target activekv_cli; } >"$log" 2>&1; then
  cat "$log"; rm -f "$log"; exit 1
fi
rm -f "$log"
exec ./build/examples/activekv demo "$@"
