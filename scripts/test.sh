#!/usr/bin/env bash
# Builds everything (CUDA sources included when nvcc is present) and runs the
# whole CPU test suite, the Python package's tests (scripts/test_python.sh),
# then the C suite under ASan+UBSan and under TSan.
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

echo "== Python package: pip install . and pytest =="
scripts/test_python.sh

echo "== ASan + UBSan build (host backend) =="
cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug -DAKV_WITH_CUDA=OFF -DAKV_SANITIZE=address >/dev/null
cmake --build build-asan -j "$jobs"
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  AKVT_SCHEDULES=2000 AKVT_SOAK_STEPS=50000 \
  ctest --test-dir build-asan --output-on-failure -j "$jobs" -L cpu -E install_consumer

echo "== TSan build (host backend) =="
cmake -S . -B build-tsan -DCMAKE_BUILD_TYPE=Debug -DAKV_WITH_CUDA=OFF -DAKV_SANITIZE=thread >/dev/null
cmake --build build-tsan -j "$jobs"
# test_teeth is left out here on purpose: it links the build that drops the
# prior-reader waits, so its races are real and TSan reports them.
TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1 AKVT_SEEDS=40 \
  AKVT_SCHEDULES=300 AKVT_SOAK_STEPS=20000 AKVT_FAULT_STRIDE=6 \
  ctest --test-dir build-tsan --output-on-failure -j "$jobs" -L cpu -E 'install_consumer|exports_only_akv|test_teeth'

echo "== valgrind: fault injection (every 3rd operation) =="
AKVT_FAULT_STRIDE=3 valgrind --quiet --error-exitcode=99 --leak-check=full \
  --errors-for-leak-kinds=definite,indirect --show-leak-kinds=definite,indirect \
  build/tests/test_faults

echo "== libFuzzer: the public API for ${AKV_FUZZ_SECONDS:-60} s =="
scripts/fuzz.sh "${AKV_FUZZ_SECONDS:-60}"
echo "== all suites passed =="
