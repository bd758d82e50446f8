#!/usr/bin/env bash
# Builds the library and the activekv CLI, then runs its demo: CUDA when a GPU
# is present, the host backend otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo -DAKV_BUILD_TESTS=OFF >/dev/null
cmake --build build -j "$(nproc 2>/dev/null || echo 2)" --target activekv_cli >/dev/null
exec ./build/examples/activekv demo "$@"
