#!/usr/bin/env bash
# Builds the libFuzzer target of the public API with clang (ASan + UBSan,
# coverage on the library itself) in its own build directory, then runs it
# for a bounded time from the seed corpus and prints the execution count.
#   scripts/fuzz.sh            # 60 s
#   scripts/fuzz.sh 600        # 10 minutes
#   FUZZ_JOBS=2 scripts/fuzz.sh 300   # two fuzzing processes
# New inputs go to build-fuzz/corpus (FUZZ_BUILD_DIR overrides the
# directory; fuzz/corpus, the seeds, is not
# written); a crash leaves build-fuzz/crash-* and a nonzero exit status.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-60}
jobs=${FUZZ_JOBS:-1}
dir=${FUZZ_BUILD_DIR:-build-fuzz}
cc=${CC_FUZZ:-clang}

cmake -S fuzz -B "$dir" -DCMAKE_C_COMPILER="$cc" -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build "$dir" -j "$(nproc 2>/dev/null || echo 2)" >/dev/null
mkdir -p "$dir/corpus"
log="$dir/fuzz.log"
echo "== fuzz_api: ${seconds} s, ${jobs} job(s), seeds fuzz/corpus =="
set +e
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  "$dir/fuzz_api" -max_total_time="$seconds" -timeout=60 -rss_limit_mb=4096 \
  -jobs="$jobs" -workers="$jobs" -artifact_prefix="$dir/" -print_final_stats=1 \
  "$dir/corpus" fuzz/corpus >"$log" 2>&1
rc=$?
set -e
[ "$jobs" -gt 1 ] && cat fuzz-*.log >>"$log" 2>/dev/null && rm -f fuzz-*.log
grep -E "^(stat::number_of_executed_units|stat::average_exec_per_sec|stat::new_units_added)|ERROR|fuzz_api:|SUMMARY" "$log" || true
execs=$(grep -E "^stat::number_of_executed_units" "$log" | awk '{s+=$2} END {print s+0}')
echo "fuzz_api: ${execs} executions in ${seconds} s, exit status ${rc} (log: $log)"
exit "$rc"
