#!/usr/bin/env bash
# Builds the libFuzzer target of the public API with clang (ASan + UBSan,
# coverage on the library itself) in its own build directory, then runs it
# for a bounded time from the seed corpus and prints the execution count.
#   scripts/fuzz.sh                    # 60 s
#   scripts/fuzz.sh 600                # 10 minutes
#   FUZZ_JOBS=2 scripts/fuzz.sh 300    # two fuzzing processes
#   FUZZ_BUILD_DIR=/tmp/f scripts/fuzz.sh   # another build directory
# Everything it writes stays in the build directory (default build-fuzz):
# the grown corpus (corpus/), the log (fuzz.log), crash-* reproducers. The
# seeds in fuzz/corpus are read, never written. A crash exits nonzero;
# rerun one input with FUZZ_TRACE=1 build-fuzz/fuzz_api build-fuzz/crash-...
# (each traced call with the milliseconds since the first: where a slow
# input spends its time).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
seconds=${1:-60}
jobs=${FUZZ_JOBS:-1}
dir=${FUZZ_BUILD_DIR:-build-fuzz}
cc=${CC_FUZZ:-clang}

cmake -S fuzz -B "$dir" -DCMAKE_C_COMPILER="$cc" -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build "$dir" -j "$(nproc 2>/dev/null || echo 2)" >/dev/null
dir=$(cd "$dir" && pwd)
mkdir -p "$dir/corpus"
rm -f "$dir"/fuzz-*.log
log="$dir/fuzz.log"
par=()
[ "$jobs" -gt 1 ] && par=(-jobs="$jobs" -workers="$jobs")
echo "== fuzz_api: ${seconds} s, ${jobs} process(es), seeds fuzz/corpus =="
set +e
# -jobs writes fuzz-N.log into the working directory: run from the build dir.
(cd "$dir" && ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 \
  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  ./fuzz_api -max_total_time="$seconds" -timeout=60 -rss_limit_mb=4096 -print_final_stats=1 \
  -artifact_prefix="$dir/" "${par[@]}" corpus "$root/fuzz/corpus") >"$log" 2>&1
rc=$?
set -e
# each process's own log (with -jobs the main log repeats a crashed job's)
logs=("$log")
[ "$jobs" -gt 1 ] && logs=("$dir"/fuzz-*.log)
grep -hE "^stat::(number_of_executed_units|average_exec_per_sec|new_units_added)|ERROR|fuzz_api:|SUMMARY" "${logs[@]}" || true
execs=$(cat "${logs[@]}" | grep -E "^stat::number_of_executed_units" | awk '{s+=$2} END {print s+0}')
echo "fuzz_api: ${execs} executions in ${seconds} s, exit status ${rc} (log: $log)"
exit "$rc"
