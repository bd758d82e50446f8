#!/usr/bin/env bash
# Builds everything (CUDA sources included when nvcc is present) and runs the
# whole CPU test suite, then the same suite under ASan+UBSan and under TSan.
# GPU tests report themselves skipped on a machine without a GPU.
#   scripts/test.sh            # everything
#   scripts/test.sh --quick    # the main build only
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=$(nproc 2>/dev/null || echo 2)
quick=0
[ "${1:-}" = "--quick" ] && quick=1

echo "== main build (RelWithDebInfo) =="
cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build -j "$jobs"
ctest --test-dir build --output-on-failure -j "$jobs"
[ "$quick" = 1 ] && exit 0

echo "== ASan + UBSan build (host backend) =="
cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug -DAKV_WITH_CUDA=OFF -DAKV_SANITIZE=address >/dev/null
cmake --build build-asan -j "$jobs"
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  ctest --test-dir build-asan --output-on-failure -j "$jobs" -L cpu -E install_consumer

echo "== TSan build (host backend) =="
cmake -S . -B build-tsan -DCMAKE_BUILD_TYPE=Debug -DAKV_WITH_CUDA=OFF -DAKV_SANITIZE=thread >/dev/null
cmake --build build-tsan -j "$jobs"
TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1 AKVT_SEEDS=40 \
  ctest --test-dir build-tsan --output-on-failure -j "$jobs" -L cpu -E 'install_consumer|exports_only_akv'
echo "== all suites passed =="
