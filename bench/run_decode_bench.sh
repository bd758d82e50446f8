#!/usr/bin/env bash
# Decode benchmark of the activekv CLI, for the GPU machine.
#
# For each geometry (llama3-8b, llama3.2-1b and the hybrid gemma3-12b, whose
# sliding-window layers stay with the model), 4 contexts x 31,744 tokens:
#   - route resident (every row on the device: the reference line),
#   - route stage (device pool 0: every row crosses PCIe each step),
#   - routes arena and paged with a device pool swept from 0 GiB to the whole
#     history;
#   - route "headroom": arena and paged with a 0 GiB pool and revocable headroom
#     swept like the pool (HEADROOM_GIB, default the pool sweep's points), so
#     the plot shows headroom next to the pool;
#   - route "release": paged and arena, 0 GiB pool, headroom for the whole
#     history, all of it given back in the middle of step RELEASE_AT
#     (--release-headroom-at); the JSON line carries step_ms (every step) and
#     headroom_release.request_to_reusable_ms.
# Every run is `activekv decode --json` (with --check by default, so each line
# carries its bitwise verdict against resident) and appends one JSON line to
# $OUT/decode.jsonl (a scratch file: bench/results/decode.jsonl is the current
# result, merged from it with metadata by scripts/collect-results.py).
# Plot with: python3 bench/plot.py $OUT/decode.jsonl
#
# usage: bench/run_decode_bench.sh [path/to/activekv]
# environment (defaults in brackets):
#   OUT        where decode.jsonl goes                [${TMPDIR:-/tmp}/akv-decode]
#   PRESETS    geometries                  ["llama3-8b llama3.2-1b gemma3-12b"]
#   ROUTES     which routes to run                    ["resident stage arena paged"]
#   CONTEXTS   contexts decoded together              [4]
#   TOKENS     prefilled rows per context             [31744]
#   STEPS      measured steps                         [16]
#   WARMUP     warm-up steps                          [2]
#   POOLS      arena/paged pool sizes in GiB; empty = 0..history in POOL_POINTS steps
#   POOLS_<preset>  the same for one preset, '-' and '.' of its name as '_'
#              (POOLS_llama3_8b="4 8 12 16"); wins over POOLS
#   POOL_POINTS  points of the automatic sweep        [8]
#   KV_DTYPES  K/V dtypes, each a sweep of its own (--kv-dtype)   [bf16]
#   CHECK      1 = --check every staged run           [1]
#   HEADROOM_GIB  headroom caps of route "headroom"; empty = the pool sweep
#   RELEASE_AT    1-based step (warm-up included) of route "release"  [WARMUP + STEPS/2]
#   HEADROOM_ROUTES, RELEASE_ROUTES  routes of "headroom" and "release"  [arena paged], [paged arena]
#   EXTRA      more flags for every run               []
# Exit status: nonzero if any run failed or any --check found a mismatch
# (the sweep still runs to the end).
set -u

here=$(cd "$(dirname "$0")" && pwd)
bin=${1:-}
if [ -z "$bin" ]; then
  for c in "$here/../build/examples/activekv" "$here/../build/activekv" "$(command -v activekv || true)"; do
    if [ -n "$c" ] && [ -x "$c" ]; then bin=$c; break; fi
  done
fi
if [ -z "$bin" ] || [ ! -x "$bin" ]; then
  echo "run_decode_bench: no activekv binary; build it (cmake --build build) or pass its path" >&2
  exit 2
fi

OUT=${OUT:-${TMPDIR:-/tmp}/akv-decode}
PRESETS=${PRESETS:-"llama3-8b llama3.2-1b gemma3-12b"}
ROUTES=${ROUTES:-"resident stage arena paged"}
CONTEXTS=${CONTEXTS:-4}
TOKENS=${TOKENS:-31744}
STEPS=${STEPS:-16}
WARMUP=${WARMUP:-2}
POOLS=${POOLS:-}
POOL_POINTS=${POOL_POINTS:-8}
CHECK=${CHECK:-1}
KV_DTYPES=${KV_DTYPES:-bf16}
EXTRA=${EXTRA:-}
HEADROOM_GIB=${HEADROOM_GIB:-}
RELEASE_AT=${RELEASE_AT:-$((WARMUP + STEPS / 2))}
mkdir -p "$OUT"
jsonl="$OUT/decode.jsonl"
failed=0

common=(--contexts "$CONTEXTS" --tokens "$TOKENS" --steps "$STEPS" --warmup "$WARMUP" --json --no-progress)
check=()
[ "$CHECK" = 1 ] && check=(--check)

# run LABEL ARGS...: one decode, its JSON line appended; failures are counted.
run() {
  local label=$1; shift
  local line rc
  echo "run_decode_bench: $label" >&2
  # shellcheck disable=SC2086
  line=$("$bin" decode "${common[@]}" "$@" $EXTRA)
  rc=$?
  if [ -n "$line" ]; then echo "$line" >> "$jsonl"; fi
  case $rc in
    0) ;;
    4) echo "run_decode_bench: $label: MISMATCH against resident" >&2; failed=1 ;;
    *) echo "run_decode_bench: $label: failed (exit $rc)" >&2; failed=1 ;;
  esac
}

for kvd in $KV_DTYPES; do
for preset in $PRESETS; do
  # The whole history of all contexts, from the fit report (bytes -> GiB, rounded up).
  fit=$("$bin" fit --preset "$preset" --contexts "$CONTEXTS" --tokens "$TOKENS" \
        --steps "$STEPS" --warmup "$WARMUP" --kv-dtype "$kvd" --json) || true
  hist=$(printf '%s' "$fit" | sed -n 's/.*"history_bytes":\([0-9]*\).*/\1/p')
  if [ -z "$hist" ]; then
    echo "run_decode_bench: $preset: activekv fit gave no history size" >&2
    failed=1
    continue
  fi
  total=$((hist * CONTEXTS))
  gib=$(( (total + (1 << 30) - 1) >> 30 ))
  var="POOLS_$(printf '%s' "$preset" | tr -- '-.' '__')"
  pools=${!var:-$POOLS}
  if [ -z "$pools" ]; then
    stepg=$(( (gib + POOL_POINTS - 1) / POOL_POINTS ))
    [ "$stepg" -lt 1 ] && stepg=1
    pools=""
    for ((p = 0; p < gib; p += stepg)); do pools="$pools $p"; done
    pools="$pools $gib"
  fi
    echo "run_decode_bench: $preset: history $total bytes ($gib GiB); pools:$pools" >&2

  for route in $ROUTES; do
    case $route in
      resident) run "$preset $kvd resident" --preset "$preset" --kv-dtype "$kvd" --route resident ;;
      stage) run "$preset $kvd stage" --preset "$preset" --kv-dtype "$kvd" --route stage "${check[@]}" ;;
      arena | paged)
        for p in $pools; do
          run "$preset $kvd $route ${p} GiB" --preset "$preset" --kv-dtype "$kvd" --route "$route" \
            --device-pool-gib "$p" "${check[@]}"
        done ;;
      headroom)
        for r2 in ${HEADROOM_ROUTES:-arena paged}; do
          for g in ${HEADROOM_GIB:-$pools}; do
            [ "$g" = 0 ] && continue
            run "$preset $r2 pool 0 + headroom ${g} GiB" --preset "$preset" --route "$r2" \
              --device-pool-gib 0 --headroom-gib "$g" "${check[@]}"
          done
        done ;;
      release)
        for r2 in ${RELEASE_ROUTES:-paged arena}; do
          run "$preset $r2 headroom ${gib} GiB released at step $RELEASE_AT" --preset "$preset" \
            --route "$r2" --device-pool-gib 0 --headroom-gib "$gib" \
            --release-headroom-at "$RELEASE_AT" "${check[@]}"
        done ;;
      *) echo "run_decode_bench: unknown route '$route'" >&2; failed=1 ;;
    esac
  done
done
done
echo "run_decode_bench: results in $jsonl" >&2
exit $failed
