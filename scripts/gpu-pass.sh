#!/usr/bin/env bash
# gpu-pass.sh - the GPU pass of ActiveKV, run on the GPU machine.
#
# Run from the repository root with $OUT set (an empty folder whose files come
# back) and cmocka's Debian packages in .gpu-deps/ (fetched on the CPU machine
# by shared/tools/gpu-deps.sh and carried with the run). It:
#   1. unpacks cmocka into /tmp/deps,
#   2. configures and builds the project (CUDA on, sm_90) in /tmp/akv-build,
#      and, in parallel, the attention benchmark variants with nvcc,
#   3. runs `ctest -L gpu --output-on-failure`,
#   4. runs every GPU test binary under compute-sanitizer memcheck, racecheck
#      and synccheck,
#   5. runs the benchmarks (the attention kernel for bf16 and FP8 K/V, 1 and 4
#      contexts, and the kernel variants),
#   6. fp8: the FP8 targets of the decode (llama3-8b, 4 x 31,744): stage and
#      resident for both dtypes, paged FP8 at two pools, every staged run
#      --check; then the distance of FP8 logits from bf16 over 64 steps,
#   7. prints a short table (also written to $OUT/summary.txt).
# A failing step is recorded and the next one still runs. If the CMake build
# does not produce the GPU tests (the rest of the project may not build yet),
# they are built directly with nvcc from their sources.
#
# Files written under $OUT:
#   build.log  ctest-gpu.log  sanitizer.log  bench.log  bench.jsonl
#   fp8.log  fp8-distance.json  decode.log  decode.jsonl  summary.txt
#   (and hostcost.log, cli.log, LastTest.log)
# Back on the CPU machine, merge them into the one current result file of
# each benchmark (no pass files; git keeps the history):
#   scripts/collect-results.py "$OUT" "$(git rev-parse --short HEAD)" "<the command>"
# updates bench/results/decode.jsonl, attention_bw.json, host_cost.json and
# gpu_pass.json, each record with its date, machine, commit and command; then
# `python3 bench/plot.py` redraws docs/decode_<preset>.png from decode.jsonl.
#
# Knobs (environment):
#   AKV_STEPS     steps to run, default "build hostcost ctest sanitizer cli
#                 bench fp8 decode tp headroom python" (cli: the CLI's ctest label and a hybrid
#                 decode under memcheck, in cli.log; hostcost: the cudart call costs and the engine's
#                 host cost, three runs, on the idle machine right after the
#                 build; written to hostcost.log)
#                 tp: tensor parallel groups through NCCL on every visible
#                 GPU (tests/gpu/test_gpu_nccl.c), in tp.log, then the CLI's
#                 --tp 2 --check against the plain run (llama3-8b, 4 x 31744,
#                 stage) with two GPUs or more, --tp 1 --check (one rank
#                 through NCCL) against the plain run with one, in
#                 tp-cli.log; scripts/tp-pass.sh runs build and tp only)
#                 headroom: issue 13's headroom sweep and mid-run release
#                 (llama3-8b; headroom.log, headroom.jsonl), in the default
#                 list; AKV_STEPS="build ctest headroom" measures it alone
#   AKV_HF_ARGS   extra arguments of examples/hf_compare.py (e.g. "--layers 8
#                 --rows resident,all,resident2 --profile $OUT/prof": a profile,
#                 not the benchmark)
#   AKV_BENCH_PROGRAMS  which of the build's bench programs the bench step runs
#                 (e.g. "akv_cudart_cost"); unset: all of them
#   AKV_JOBS      parallel build jobs, default 16
#   AKV_COMMIT    the commit the reports name (hf_compare's --commit); unset:
#                 git's HEAD here, which may be stale in a copied tree (the
#                 collect script stamps its own COMMIT argument anyway)
#   AKV_BENCH_VARIANTS  "label:WARPS:LOADS[:STAGES[:PDL[:PIECE[:KERNEL[:MINB[:COMBINE[:EXTRA]]]]]]] ...",
#                 default "k3s8:8:8:0:0:256:3:1:16 k3w1l8:1:8:0:0:0:3:8:16
#                  w8l4:8:4:0:0:0:1:0:16"
#                 (k3s8 is the library's: KERNEL 3, the tensor-core chunk
#                 kernel, 8 warps per block each streaming a piece of its own
#                 (K3_SPAN defaults to the warps), LOADS 8 (two 16-row blocks
#                 of bf16 or four of FP8 in flight per warp), MINB 1 block
#                 per SM, PIECE 256 (chunks of 512 rows or more cut into
#                 pieces of 256); k3w1l8 the same kernel with one warp per block (the
#                 library before); w8l4 KERNEL 1, the tiled CUDA-core kernel
#                 the library used before that; KERNEL 2 is the
#                 warp-streaming CUDA-core kernel;
#                 STAGES 0: register pipeline, >= 2: cp.async ring (kernels 1
#                 and 2); PIECE cuts chunks into pieces of that many rows;
#                 COMBINE the combine kernel's warps, default 16; EXTRA
#                 further knobs as NAME=VALUE,... for -DAKV_ATTN_NAME=VALUE,
#                 e.g. K3_SPAN=1; BENCH_CHUNK_ONLY=1 is the diagnostic that
#                 times the chunk kernel alone: its check fails by design;
#                 BENCH_TRACE=1 the diagnostic that prints one launch's
#                 timeline from kernel 3's warps, lines "trace ...")
#   AKV_FP8_POOLS  device pools (GiB) of the FP8 paged runs, default "4 8"
#   AKV_FP8_DISTANCE_STEPS  steps of the logits-distance runs, default 64
#   AKV_BENCH_CHUNKS    chunk sizes for the library variant, default "256 64 1024"
#   AKV_SAN_TIMEOUT     seconds per sanitizer run, default 300
#   AKV_SAN_BINS        which GPU test binaries the sanitizers run (names,
#                       e.g. "test_gpu_attention"); unset: all of them
#   AKV_CMAKE_ARGS      extra arguments for the configure step
#   ncu (step, not in the default list): Nsight Compute on the library
#                 variant's attention kernels (needs the bench step's build);
#                 AKV_NCU_LABELS (bench variants, default the library's),
#                 AKV_NCU_DTYPES (default "fp8 bf16"), AKV_NCU_CONTEXTS (1)
set -u

OUT=${OUT:-/tmp/akv-out}
mkdir -p "$OUT"
BUILD=/tmp/akv-build
SOLO=/tmp/akv-standalone
DEPS=/tmp/deps
PASS_STEPS=${AKV_STEPS:-"build hostcost ctest sanitizer cli bench fp8 decode tp headroom python"}
# NVLink SHARP (multicast) stays off in every run that may start NCCL.
export NCCL_NVLS_ENABLE=0
JOBS=${AKV_JOBS:-16}
VARIANTS=${AKV_BENCH_VARIANTS:-"k3s8:8:8:0:0:256:3:1:16 k3w1l8:1:8:0:0:0:3:8:16 w8l4:8:4:0:0:0:1:0:16"}
LIB_LABEL=k3s8 # the variant built with the library's knobs
FP8_POOLS=${AKV_FP8_POOLS-"4 8"} # empty: no paged FP8 runs
FP8_DIST_STEPS=${AKV_FP8_DISTANCE_STEPS:-64}
CHUNKS=${AKV_BENCH_CHUNKS:-"256 64 1024"}
SAN_TIMEOUT=${AKV_SAN_TIMEOUT:-300}

BUILD_LOG=$OUT/build.log
CTEST_LOG=$OUT/ctest-gpu.log
BENCH_LOG=$OUT/bench.log
BENCH_JSON=$OUT/bench.jsonl
SUMMARY=$OUT/summary.txt
ROWS=/tmp/akv-gpu-pass-rows.txt # table rows, gathered outside $OUT
: >"$BUILD_LOG"
: >"$ROWS"

T0=$(date +%s)
# record STEP STATUS DETAIL: one row of the final table.
record() { printf '%-28s %-8s %s\n' "$1" "$2" "$3" >>"$ROWS"; }
has_step() { case " $PASS_STEPS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
log() { echo "[$(($(date +%s) - T0))s] $*"; }

{
  echo "== machine"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv 2>&1
  nvcc --version 2>&1 | tail -2
  cmake --version 2>&1 | head -1
  command -v compute-sanitizer || echo "compute-sanitizer not on PATH"
  echo "git: $(git rev-parse --short HEAD 2>/dev/null || echo none) $(git status --short 2>/dev/null | wc -l) changed files${AKV_COMMIT:+ (AKV_COMMIT=$AKV_COMMIT)}"
} >>"$BUILD_LOG" 2>&1

# ------------------------------------------------------------------ deps
log "unpacking cmocka"
mkdir -p "$DEPS"
n_deb=0
for f in .gpu-deps/*.deb; do
  [ -e "$f" ] || continue
  dpkg -x "$f" "$DEPS" && n_deb=$((n_deb + 1))
done
export LD_LIBRARY_PATH=$DEPS/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
if [ -f "$DEPS/usr/include/cmocka.h" ]; then
  record "cmocka" "ok" "$n_deb packages unpacked"
else
  record "cmocka" "FAIL" "no cmocka.h in .gpu-deps (run shared/tools/gpu-deps.sh, carry .gpu-deps)"
fi

# ------------------------------------------------------------------ build
bench_build() { # label warps loads [stages [pdl [piece [kernel [minb [combine [extra]]]]]]]
  local out=$SOLO/attention_bw_$1 d defs=""
  # extra: further knobs, NAME=VALUE[,NAME=VALUE...] -> -DAKV_ATTN_NAME=VALUE
  for d in ${10//,/ }; do defs="$defs -DAKV_ATTN_$d"; done
  # shellcheck disable=SC2086 # $defs is zero or more options
  nvcc $defs -O3 -arch=sm_90 -std=c++17 -Iinclude -DAKV_ATTN_WARPS="$2" -DAKV_ATTN_LOADS="$3" \
    -DAKV_ATTN_STAGES="${4:-0}" -DAKV_ATTN_PDL="${5:-0}" -DAKV_ATTN_PIECE_TOKENS="${6:-256}" \
    -DAKV_ATTN_KERNEL="${7:-1}" -DAKV_ATTN_MINB="${8:-0}" -DAKV_ATTN_COMBINE_WARPS="${9:-16}" \
    -Xptxas -v bench/attention_bw.cu src/kernels/attention_cuda.cu src/kernels/attention_ref.c -o "$out" \
    >"$SOLO/bench_$1.log" 2>&1
}

if has_step build; then
  mkdir -p "$SOLO"
  # The benchmark variants compile with nvcc alongside the CMake build.
  bench_pids=""
  if has_step bench && [ -f bench/attention_bw.cu ]; then
    for v in $VARIANTS; do
      IFS=: read -r label warps loads stages pdl piece kernel minb comb extra <<<"$v"
      bench_build "$label" "$warps" "$loads" "$stages" "$pdl" "$piece" "$kernel" "$minb" "$comb" "$extra" &
      bench_pids="$bench_pids $!:$label"
    done
  fi

  log "configuring"
  extra=""
  [ -f examples/CMakeLists.txt ] || extra="-DAKV_BUILD_EXAMPLES=OFF"
  {
    echo "== cmake configure"
    cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DAKV_WITH_CUDA=ON ${AKV_CMAKE_ARGS:-} \
      -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_PREFIX_PATH="$DEPS/usr" $extra
  } >>"$BUILD_LOG" 2>&1
  rc=$?
  record "cmake configure" "$([ $rc = 0 ] && echo ok || echo FAIL)" "rc=$rc"
  if [ $rc = 0 ]; then
    log "building"
    { echo "== cmake build"; cmake --build "$BUILD" -j"$JOBS" -- -k; } >>"$BUILD_LOG" 2>&1
    rc=$?
    record "cmake build" "$([ $rc = 0 ] && echo ok || echo FAIL)" "rc=$rc (see build.log)"
  fi

  # GPU tests: from the CMake build, else standalone from their sources.
  for t in gpu_attention gpu_backend; do
    [ -f tests/gpu/test_$t.cu ] || continue
    [ -x "$BUILD/tests/test_$t" ] && continue
    log "standalone build of test_$t"
    case $t in
      gpu_attention) srcs="src/kernels/attention_cuda.cu src/kernels/attention_ref.c" ;;
      gpu_backend) srcs="src/backends/backend_cuda.cu" ;;
    esac
    {
      echo "== standalone nvcc build of test_$t (CMake did not produce it)"
      # shellcheck disable=SC2086 # $srcs is a list of files
      nvcc -O2 -g -lineinfo -arch=sm_90 -std=c++17 -DAKV_WITH_CUDA -Iinclude -Isrc/core -Isrc/backends -Isrc/kernels \
        -I"$DEPS/usr/include" tests/gpu/test_$t.cu $srcs -L"$DEPS/usr/lib/x86_64-linux-gnu" \
        -lcmocka -o "$SOLO/test_$t"
    } >>"$BUILD_LOG" 2>&1
    rc=$?
    record "standalone test_$t" "$([ $rc = 0 ] && echo ok || echo FAIL)" "rc=$rc"
  done

  for p in $bench_pids; do
    pid=${p%%:*}
    label=${p#*:}
    wait "$pid"
    rc=$?
    { echo "== nvcc attention_bw_$label (rc=$rc)"; cat "$SOLO/bench_$label.log"; } >>"$BUILD_LOG"
    # Registers (and spilled bytes) of the llama-geometry kernels (head_dim
    # 128, 4 heads per block; element kind 0 = bf16, 1 = FP8 E4M3; chunk
    # kernel 1 or 2).
    regs=""
    for ek in 0 1; do
      r=$(awk -v pat="chunk_kernel[23]?ILi128ELi4ELi${ek}ENS_9ContigLoc" \
        '/Compiling entry/ {f = match($0, pat) > 0}
        f && /spill stores/{sp=$5}
        f && /Used [0-9]+ registers/{print $5 "/" (sp == "" ? "?" : sp) "B"; exit}' \
        "$SOLO/bench_$label.log")
      regs="$regs D128/GT4/E$ek: ${r:-?} regs/spill"
    done
    record "nvcc attention_bw_$label" "$([ $rc = 0 ] && echo ok || echo FAIL)" "rc=$rc ${regs:-}"
  done
fi

# Which GPU test binaries exist now.
gpu_bins=""
for t in gpu_attention gpu_backend gpu_cells gpu_faults; do
  if [ -x "$BUILD/tests/test_$t" ]; then
    gpu_bins="$gpu_bins $BUILD/tests/test_$t"
  elif [ -x "$SOLO/test_$t" ]; then
    gpu_bins="$gpu_bins $SOLO/test_$t"
  fi
done

# ------------------------------------------------------------------ hostcost
# Before anything else loads the machine: the cudart calls the enqueue path is
# made of, then the engine's host cost per layer (three runs, to show the
# spread), in one log.
# Driver calls ring the GPU's doorbell over PCIe: from a core on the GPU's
# own NUMA node they cost less than from a remote one, so the runs are
# repeated pinned to the GPU's local CPUs (sysfs local_cpulist) when known.
if has_step hostcost; then
  : >"$OUT/hostcost.log"
  bus=$(nvidia-smi --query-gpu=pci.bus_id --format=csv,noheader -i 0 2>/dev/null | head -1 |
    tr 'A-F' 'a-f' | sed 's/^0000\(....:\)/\1/')
  cpus=""
  [ -n "$bus" ] && cpus=$(cat "/sys/bus/pci/devices/$bus/local_cpulist" 2>/dev/null)
  echo "== GPU $bus local CPUs: ${cpus:-unknown}" >>"$OUT/hostcost.log"
  for pin in none local; do
    pre=""
    if [ "$pin" = local ]; then
      if [ -z "$cpus" ] || ! command -v taskset >/dev/null 2>&1; then
        record "hostcost pinned" "SKIP" "GPU-local CPUs unknown or no taskset"
        break
      fi
      if [ "$cpus" = "$(cat /sys/devices/system/cpu/online 2>/dev/null)" ]; then
        record "hostcost pinned" "SKIP" "every CPU is local to the GPU (one NUMA node)"
        break
      fi
      pre="taskset -c $cpus"
    fi
    for b in akv_cudart_cost akv_host_cost akv_host_cost akv_host_cost; do
      if [ -x "$BUILD/bench/$b" ]; then
        log "hostcost ($pin): $b"
        echo "== ${pre:+$pre }$BUILD/bench/$b" >>"$OUT/hostcost.log"
        # shellcheck disable=SC2086 # $pre is empty or a command prefix
        timeout 300 $pre "$BUILD/bench/$b" >>"$OUT/hostcost.log" 2>&1
        rc=$?
        record "hostcost $b ($pin)" "$([ $rc = 0 ] && echo ok || echo FAIL)" \
          "rc=$rc $(grep -o 'median [0-9.]* us, p90 [0-9.]* us' "$OUT/hostcost.log" | tail -1)"
      else
        record "hostcost $b" "SKIP" "not built"
      fi
    done
  done
fi

# ------------------------------------------------------------------ ctest
if has_step ctest; then
  if [ -f "$BUILD/CTestTestfile.cmake" ] && ls "$BUILD"/tests/test_gpu_* >/dev/null 2>&1; then
    log "ctest -L gpu"
    (cd "$BUILD" && ctest -L gpu --output-on-failure --timeout 1800) >"$CTEST_LOG" 2>&1
    rc=$? # ctest's, before anything else runs
    # The tests' own output (one line per bitwise cell) is in ctest's full log.
    cp "$BUILD/Testing/Temporary/LastTest.log" "$OUT/LastTest.log" 2>/dev/null || true
    line=$(grep -E 'tests passed|tests failed' "$CTEST_LOG" | tail -1)
    skipped=$(grep -c '\*\*\*Skipped' "$CTEST_LOG")
    st=ok
    [ "$skipped" = 0 ] || st=SKIPPED # a GPU test that skips here found no device
    [ $rc = 0 ] || st=FAIL
    record "ctest -L gpu" "$st" "rc=$rc ${line:-}; $skipped skipped"
  else
    log "ctest unavailable; running the GPU test binaries directly"
    : >"$CTEST_LOG"
    for b in $gpu_bins; do
      echo "== $b" >>"$CTEST_LOG"
      "$b" >>"$CTEST_LOG" 2>&1
      rc=$?
      record "run $(basename "$b")" "$([ $rc = 0 ] && echo ok || echo FAIL)" "rc=$rc (no ctest)"
    done
  fi
fi

# ------------------------------------------------------------------ sanitizer
if has_step sanitizer; then
  if ! command -v compute-sanitizer >/dev/null 2>&1; then
    record "compute-sanitizer" "SKIP" "not on PATH"
  else
    : >"$OUT/sanitizer.log"
    for tool in memcheck racecheck synccheck; do
      slog=$OUT/sanitizer.log
      for b in $gpu_bins; do
        if [ -n "${AKV_SAN_BINS:-}" ]; then # only these test binaries (names)
          case " $AKV_SAN_BINS " in *" $(basename "$b") "*) ;; *) continue ;; esac
        fi
        log "compute-sanitizer --tool $tool $(basename "$b")"
        echo "== compute-sanitizer --tool $tool $b" >>"$slog"
        # Intentional API failures (a refused 4 PiB allocation, a not-ready
        # event) are the tests' own checks: the sanitizer's API-error report
        # is off, device-side errors are what this pass looks for.
        extra=""
        [ "$tool" = memcheck ] && extra="--leak-check full"
        # shellcheck disable=SC2086 # $extra is zero or more options
        AKV_CELLS_QUICK=1 timeout "$SAN_TIMEOUT" compute-sanitizer --tool "$tool" --report-api-errors no \
          --error-exitcode 99 $extra "$b" >>"$slog" 2>&1
        rc=$?
        summary=$(awk -v h="== compute-sanitizer --tool $tool $b" '$0 == h { f = 1 } f' "$slog" |
          grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' | tail -1 | sed 's/^=* *//')
        st=ok
        [ $rc = 0 ] || st=FAIL
        [ $rc = 124 ] && st=TIMEOUT
        record "$tool $(basename "$b")" "$st" "rc=$rc ${summary:-no summary line}"
      done
    done
  fi
fi

# ------------------------------------------------------------------ cli
# The CLI on this machine: its ctest label (the demo picks CUDA here), then
# a small hybrid decode on CUDA (sliding-window layers in the model's own
# rows, dense layers staged and read in place) under compute-sanitizer
# memcheck, checked bit for bit against resident.
if has_step cli; then
  cli=$BUILD/examples/activekv
  : >"$OUT/cli.log"
  if [ -f "$BUILD/CTestTestfile.cmake" ] && [ -x "$cli" ]; then
    log "ctest -L cli"
    (cd "$BUILD" && ctest -L cli --output-on-failure --timeout 600) >>"$OUT/cli.log" 2>&1
    rc=$?
    record "ctest -L cli" "$([ $rc = 0 ] && echo ok || echo FAIL)" \
      "rc=$rc $(grep -E 'tests passed|tests failed' "$OUT/cli.log" | tail -1)"
    if command -v compute-sanitizer >/dev/null 2>&1; then
      log "memcheck: hybrid decode on CUDA"
      echo "== compute-sanitizer memcheck activekv decode (hybrid, paged)" >>"$OUT/cli.log"
      timeout "$SAN_TIMEOUT" compute-sanitizer --tool memcheck --error-exitcode 99 "$cli" decode \
        --backend cuda --preset llama3.2-1b --layers 6 --hidden 512 --ffn 1024 --vocab 4096 \
        --window 64 --dense-every 3 --contexts 3 --tokens 300,97,40 --page-tokens 64 \
        --route paged --device-pool-gib 1 --target-pages 2 --steps 4 --warmup 1 --check \
        --no-progress >>"$OUT/cli.log" 2>&1
      rc=$?
      record "memcheck hybrid decode" "$([ $rc = 0 ] && echo ok || echo FAIL)" \
        "rc=$rc $(grep -E 'ERROR SUMMARY' "$OUT/cli.log" | tail -1 | sed 's/^=* *//'); $(grep -E '^  bitwise' "$OUT/cli.log" | tail -1 | sed 's/^ *//')"
    fi
  else
    record "ctest -L cli" "SKIP" "no build"
  fi
fi

# ------------------------------------------------------------------ bench
if has_step bench; then
  : >"$BENCH_LOG"
  for v in $VARIANTS; do
    IFS=: read -r label warps loads _ _ _ <<<"$v"
    bin=$SOLO/attention_bw_$label
    [ -x "$bin" ] || continue
    chunks=256
    [ "$label" = "$LIB_LABEL" ] && chunks=$CHUNKS
    for c in $chunks; do
      log "attention_bw $label chunk $c"
      echo "== attention_bw $label chunk $c" >>"$BENCH_LOG"
      # Both dtypes (bf16, FP8 E4M3 counted at one byte per element), 1 and 4 contexts.
      timeout 300 "$bin" --chunk "$c" --dtype bf16,fp8 --label "$label" --json "$BENCH_JSON" \
        >>"$BENCH_LOG" 2>&1
      rc=$?
      if [ $rc = 0 ]; then
        best=$(grep -E '^(contig|paged) ' "$BENCH_LOG" | tail -8 |
          awk '{printf "%s/%s/%sctx %.0fus %s; ", $1, $2, $3, $7, $11}')
      else
        best=$(tail -1 "$BENCH_LOG")
      fi
      record "bench $label chunk $c" "$([ $rc = 0 ] && echo ok || echo FAIL)" "rc=$rc $best"
    done
  done
  # Other benchmark programs the project builds.
  for b in "$BUILD"/bench/*; do
    if [ ! -f "$b" ] || [ ! -x "$b" ]; then continue; fi
    case $(basename "$b") in
      akv_host_cost | akv_cudart_cost) has_step hostcost && continue ;;
    esac
    if [ -n "${AKV_BENCH_PROGRAMS+x}" ]; then # only these (names, space separated)
      case " $AKV_BENCH_PROGRAMS " in *" $(basename "$b") "*) ;; *) continue ;; esac
    fi
    log "bench $(basename "$b")"
    echo "== $b" >>"$BENCH_LOG"
    # The host cost depends on the machine's cudart call costs (akv_cudart_cost
    # measures them next to it): three runs show the spread.
    reps=1
    [ "$(basename "$b")" = akv_host_cost ] && reps=3
    rc=0
    for _ in $(seq "$reps"); do
      timeout 300 "$b" >>"$BENCH_LOG" 2>&1 || rc=$?
    done
    record "bench $(basename "$b")" "$([ $rc = 0 ] && echo ok || echo FAIL)" "rc=$rc"
  done
fi

# ------------------------------------------------------------------ fp8
# The FP8 targets (llama3-8b, 4 x 31,744, one process): stage and resident
# for both dtypes and paged FP8 at $FP8_POOLS GiB, every staged run --check,
# lines appended to decode.jsonl (the plot draws both dtypes); then the
# distance of FP8 logits from bf16: a resident bf16 run writes every step's
# logits, a resident FP8 run follows its tokens and reports the max |logit
# difference| and the top-1 agreement (fp8-distance.json). Resident is
# bit-identical to every staged route (--check), so it stands for them.
if has_step fp8; then
  cli=$BUILD/examples/activekv
  if [ -x "$cli" ]; then
    log "fp8 decode targets"
    {
      OUT=$OUT PRESETS=llama3-8b KV_DTYPES="bf16 fp8" ROUTES="${AKV_FP8_ROUTES:-resident stage}" STEPS=8 WARMUP=2 \
        timeout 600 bash bench/run_decode_bench.sh "$cli"
      echo "rc=$?"
      if [ -n "$FP8_POOLS" ]; then
        OUT=$OUT PRESETS=llama3-8b KV_DTYPES=fp8 ROUTES=paged POOLS="$FP8_POOLS" STEPS=8 WARMUP=2 \
          timeout 600 bash bench/run_decode_bench.sh "$cli"
        echo "rc=$?"
      fi
    } >"$OUT/fp8.log" 2>&1
    rc=$(grep -c '^rc=[1-9]' "$OUT/fp8.log")
    stage_tps() { # dtype -> median tokens/s and bitwise of the stage run
      grep '"route":"stage"' "$OUT/decode.jsonl" 2>/dev/null | grep "\"kv_dtype\":\"$1\"" |
        grep '"preset":"llama3-8b"' | tail -1 |
        sed -n 's/.*"tokens_per_s":\([0-9.e+]*\).*"pcie_ratio":\([0-9.e+]*\).*"bitwise":\([a-z]*\).*/\1 tok\/s, pcie ratio \2, bitwise \3/p'
    }
    record "fp8 decode targets" "$([ "$rc" = 0 ] && echo ok || echo FAIL)" \
      "bf16 stage: $(stage_tps bf16); fp8 stage: $(stage_tps fp8)"
    log "fp8 logits distance"
    dist=/tmp/akv-bf16-logits.bin
    common="--preset llama3-8b --contexts 4 --tokens 31744 --route resident --steps $FP8_DIST_STEPS --warmup 0 --no-progress"
    # shellcheck disable=SC2086 # $common is a list of flags
    {
      timeout 600 "$cli" decode $common --kv-dtype bf16 --logits-out "$dist" >/dev/null &&
        timeout 600 "$cli" decode $common --kv-dtype fp8 --logits-ref "$dist" --json
    } >"$OUT/fp8-distance.json" 2>>"$OUT/fp8.log"
    rc=$?
    rm -f "$dist"
    record "fp8 logits distance" "$([ $rc = 0 ] && echo ok || echo FAIL)" \
      "rc=$rc $(grep -o '"vs_ref":{[^}]*}' "$OUT/fp8-distance.json")"
  else
    record "fp8 decode targets" "SKIP" "no CLI binary"
  fi
fi

# ------------------------------------------------------------------ decode
# The CLI's decode benchmark (bench/run_decode_bench.sh), knobs through its
# own environment (PRESETS, ROUTES, POOLS, STEPS, ...).
if has_step decode; then
  cli=$BUILD/examples/activekv
  if [ -x "$cli" ]; then
    log "decode benchmark"
    OUT=$OUT timeout "${AKV_DECODE_TIMEOUT:-400}" bash bench/run_decode_bench.sh "$cli" >"$OUT/decode.log" 2>&1
    rc=$?
    record "decode bench" "$([ $rc = 0 ] && echo ok || echo FAIL)" "rc=$rc $(grep -c . "$OUT/decode.jsonl" 2>/dev/null) runs"
  else
    record "decode bench" "SKIP" "no CLI binary"
  fi
fi

# ------------------------------------------------------------------ tp
# Tensor parallel groups through NCCL: one process driving every visible GPU
# (one rank per GPU). One GPU: a group of one through NCCL; two or more: also
# a rank that never arrives (the others time out and abort).
if has_step tp; then
  t=$BUILD/tests/test_gpu_nccl
  if [ -x "$t" ]; then
    log "tensor parallel groups through NCCL"
    {
      echo "== NCCL_NVLS_ENABLE=$NCCL_NVLS_ENABLE, $(nvidia-smi -L 2>/dev/null | wc -l) GPU(s)"
      grep -E 'ActiveKV: NCCL' "$BUILD_LOG" | tail -1
      timeout 600 "$t"
    } >"$OUT/tp.log" 2>&1
    rc=$?
    record "tp groups (NCCL)" "$([ $rc = 0 ] && echo ok || echo FAIL)" \
      "rc=$rc $(grep -E 'rank\(s\) through NCCL|SKIPPED' "$OUT/tp.log" | tr '\n' ' ' | sed 's/^ *//')"
  else
    record "tp groups (NCCL)" "SKIP" "no test_gpu_nccl (NCCL not found at configure? see build.log)"
  fi
  # The CLI's --tp on the CUDA backend (one process, rank r on GPU r, NCCL):
  # llama3-8b, 4 x 31,744, stage. Two GPUs or more: TP=2 checked bit for bit
  # against the TP=2 resident run, then the plain TP=1 run; TP=1 against TP=2
  # tokens/s. One GPU: TP=1 through NCCL (a group of one, the model's
  # all-reduce over one rank) checked bit for bit against its resident run,
  # then the plain run, which it should match in tokens/s. Each run's output
  # goes to tp-cli.log after a "== " line naming it.
  cli=$BUILD/examples/activekv
  ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
  if [ -n "${CUDA_VISIBLE_DEVICES+x}" ]; then # the GPUs this process sees
    ngpu=$(printf '%s' "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | grep -c .)
  fi
  if [ -x "$cli" ] && [ "$ngpu" -ge 1 ]; then
    tpargs="decode --preset llama3-8b --contexts 4 --tokens 31744 --route stage --no-progress --json"
    if [ "$ngpu" -ge 2 ]; then ntp=2; else ntp=1; fi
    log "CLI --tp $ntp --check against the plain run (llama3-8b, 4 x 31744, stage; $ngpu GPU(s))"
    : >"$OUT/tp-cli.log"
    tp_cli() { # label args...: one run, its JSON line to /tmp/akv-tp-<label>.json
      local label=$1
      shift
      echo "== $label: activekv $*" >>"$OUT/tp-cli.log"
      timeout 900 "$cli" "$@" >/tmp/akv-tp-"$label".out 2>&1
      local rc=$?
      cat /tmp/akv-tp-"$label".out >>"$OUT/tp-cli.log"
      echo "rc=$rc" >>"$OUT/tp-cli.log"
      grep '^{' /tmp/akv-tp-"$label".out | tail -1 >/tmp/akv-tp-"$label".json
      return $rc
    }
    field() { sed -n "s/.*\"$2\":\([0-9.e+a-z]*\).*/\1/p" /tmp/akv-tp-"$1".json; }
    # shellcheck disable=SC2086 # $tpargs is a list of flags
    tp_cli tpn $tpargs --tp $ntp --check
    rc_n=$?
    # shellcheck disable=SC2086
    tp_cli plain $tpargs
    rc_p=$?
    tn=$(field tpn tokens_per_s) tp1=$(field plain tokens_per_s) bw=$(field tpn bitwise)
    ratio=$(awk -v a="${tn:-0}" -v b="${tp1:-0}" 'BEGIN { if (b > 0) printf "%.2f", a / b; else print "n/a" }')
    ok=$([ "$rc_n" = 0 ] && [ "$rc_p" = 0 ] && [ "$bw" = true ] && echo ok || echo FAIL)
    if [ "$ntp" = 2 ]; then
      record "tp CLI (TP=2 vs TP=1)" "$ok" \
        "TP=1 ${tp1:-none} tok/s, TP=2 ${tn:-none} tok/s (x$ratio), TP=2 bitwise ${bw:-none}; see tp-cli.log"
      echo "TP=1 ${tp1:-none} tokens/s, TP=2 ${tn:-none} tokens/s (TP=2 / TP=1 = $ratio), TP=2 bitwise vs TP=2 resident: ${bw:-none}"
    else
      record "tp CLI (TP=1 NCCL, 1 GPU)" "$ok" \
        "one GPU: --tp 1 through NCCL ${tn:-none} tok/s (bitwise ${bw:-none}) vs plain ${tp1:-none} tok/s (x$ratio); TP=2 needs two GPUs; see tp-cli.log"
      echo "one GPU: --tp 1 through NCCL ${tn:-none} tokens/s, bitwise vs its resident run: ${bw:-none}; plain run ${tp1:-none} tokens/s (x$ratio)"
    fi
  elif [ -x "$cli" ]; then
    record "tp CLI" "SKIP" "no GPU visible (nvidia-smi -L)"
  else
    record "tp CLI" "SKIP" "no CLI binary"
  fi
fi

# ------------------------------------------------------------------ headroom
# Issue 13's measurements (DESIGN §6 headroom), llama3-8b, 4 x 31,744:
# resident, stage, pool 0 + headroom swept up to the whole history (arena and
# paged), and a mid-run release of all headroom (step_ms and the time from
# request to reusable memory in the JSON). Results: headroom.jsonl, headroom.log.
if has_step headroom; then
  cli=$BUILD/examples/activekv
  if [ -x "$cli" ]; then
    log "headroom benchmark"
    mkdir -p /tmp/akv-headroom
    rm -f /tmp/akv-headroom/decode.jsonl
    OUT=/tmp/akv-headroom PRESETS=${AKV_HR_PRESETS:-llama3-8b} \
      ROUTES=${AKV_HR_ROUTES:-"resident stage headroom release"} \
      timeout "${AKV_HR_TIMEOUT:-500}" bash bench/run_decode_bench.sh "$cli" >"$OUT/headroom.log" 2>&1
    rc=$?
    cp /tmp/akv-headroom/decode.jsonl "$OUT/headroom.jsonl" 2>/dev/null
    record "headroom bench" "$([ $rc = 0 ] && echo ok || echo FAIL)" \
      "rc=$rc $(grep -c . "$OUT/headroom.jsonl" 2>/dev/null) runs"
  else
    record "headroom bench" "SKIP" "no CLI binary"
  fi
fi

# ------------------------------------------------------------------ python
# Issue 12's proof: the Python package against the library just built
# (ACTIVEKV_LIBRARY, no second build), its CUDA, ABI, transformers-adapter and audit
# tests (the adapter's need torch, which only this machine has), then
# examples/hf_compare.py per preset: resident DynamicCache, the offloaded
# DynamicCache, ActiveKVCache at pool 0 / half / all of the history, resident
# again; every row's logits compared with resident bit for bit.
# Results: python.log, hf_<preset>.json, hf_<preset>.log.
if has_step python; then
  lib=$BUILD/libactivekv.so
  if [ -f "$lib" ]; then
    log "python package tests (CUDA)"
    (PYTHONPATH=$PWD/python ACTIVEKV_LIBRARY=$lib timeout 300 python3 -m pytest -q -ra \
      python/tests/test_cuda.py python/tests/test_abi.py python/tests/test_transformers.py \
      python/tests/test_audit_py.py python/tests/test_audit_py2.py \
      python/tests/test_audit_py3.py \
      $(ls python/tests/test_audit_py[4-9].py 2>/dev/null)) \
      >"$OUT/python.log" 2>&1
    rc=$?
    record "pytest (CUDA, ABI, adapter, audit)" "$([ $rc = 0 ] && echo ok || echo FAIL)" \
      "rc=$rc $(grep -E 'passed|failed' "$OUT/python.log" | tail -1)"
    for preset in ${AKV_HF_PRESETS:-llama3.1-8b llama3.2-1b}; do
      log "hf_compare $preset"
      PYTHONPATH=$PWD/python ACTIVEKV_LIBRARY=$lib PYTHONUNBUFFERED=1 \
        CUBLAS_WORKSPACE_CONFIG=:4096:8 timeout "${AKV_HF_TIMEOUT:-400}" \
        python3 examples/hf_compare.py --preset "$preset" --steps "${AKV_HF_STEPS:-32}" \
        --commit "${AKV_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}" \
        ${AKV_HF_ARGS:-} --json "$OUT/hf_$preset.json" >"$OUT/hf_$preset.log" 2>&1
      rc=$?
      record "hf_compare $preset" "$([ $rc = 0 ] && echo ok || echo FAIL)" \
        "rc=$rc $(grep -E 'bit-identical|MISS' "$OUT/hf_$preset.log" | tr '\n' ' ')"
    done
  else
    record "python" "SKIP" "no $lib (build step?)"
  fi
fi

# ------------------------------------------------------------------ ncu
# Nsight Compute on the attention kernels of bench variants (one context,
# each dtype in AKV_NCU_DTYPES, default "fp8 bf16"): speed of light, pipe
# utilisation, warp stalls, instruction mix; the details in ncu.log, the raw
# metrics of each kernel in ncu-<dtype>.csv. Not a benchmark (clocks left
# alone, caches flushed between kernels): it says where the time goes.
if has_step ncu; then
  if ! command -v ncu >/dev/null 2>&1; then
    record "ncu" "SKIP" "no ncu on PATH"
  else
    : >"$OUT/ncu.log"
    for label in ${AKV_NCU_LABELS:-$LIB_LABEL}; do
      bin=$SOLO/attention_bw_$label
      if [ ! -x "$bin" ]; then
        record "ncu $label" "SKIP" "no $bin (the bench step builds it)"
        continue
      fi
      for dt in ${AKV_NCU_DTYPES:-fp8 bf16}; do
        log "ncu $label $dt"
        rep=/tmp/akv-ncu-$label-$dt
        echo "== ncu $label $dt" >>"$OUT/ncu.log"
        timeout 300 ncu --clock-control none -k regex:akv_attn --launch-skip 4 -c 2 \
          --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats \
          --section InstructionStats --section Occupancy --section SchedulerStats \
          --section MemoryWorkloadAnalysis --section SourceCounters -f -o "$rep" \
          "$bin" --contexts "${AKV_NCU_CONTEXTS:-1}" --dtype "$dt" --iters 4 --warmup 2 --no-check \
          >>"$OUT/ncu.log" 2>&1
        rc=$?
        ncu -i "$rep.ncu-rep" --page details --print-details all >>"$OUT/ncu.log" 2>&1
        ncu -i "$rep.ncu-rep" --page raw --csv >"$OUT/ncu-$label-$dt.csv" 2>&1
        record "ncu $label $dt" "$([ $rc = 0 ] && echo ok || echo FAIL)" "rc=$rc"
      done
      # The machine code of every kernel of the variant, for instruction counts.
      if command -v cuobjdump >/dev/null 2>&1; then
        cuobjdump -sass "$bin" | gzip >"$OUT/sass-$label.txt.gz"
      fi
    done
  fi
fi

# ------------------------------------------------------------------ summary
{
  echo "ActiveKV GPU pass, $(date -u +%Y-%m-%dT%H:%M:%SZ), $(($(date +%s) - T0)) s"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null
  printf '%-28s %-8s %s\n' "step" "status" "detail"
  cat "$ROWS"
} >"$SUMMARY"
echo
cat "$SUMMARY"
if grep -qE ' (FAIL|TIMEOUT|SKIPPED) ' "$SUMMARY"; then exit 1; fi
exit 0
