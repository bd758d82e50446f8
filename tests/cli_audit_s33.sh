#!/bin/sh
# cli_audit_s33.sh ACTIVEKV CLI_EXPECT
# Flags the CLI took and then ignored, or acted on other than asked; each
# section says what happened before. Each case runs through CLI_EXPECT
# (tests/cli_expect.sh) or checks the JSON itself; the first that fails
# ends the test.
set -u
cli=$1
expect=$2
tmp=${TMPDIR:-/tmp}/cli_audit_s33.$$
mkdir -p "$tmp" || exit 1
trap 'rm -rf "$tmp"' EXIT

# decode --tp N --logits-ref FILE fed the reference's argmax as the next
# tokens on rank 0 only; the other ranks took their own argmax, so once the
# two differed the ranks' shards decoded different tokens and the summed
# logits were neither run's (top-1 agreement 7 of 12 against 10 at --tp 1,
# distance 0.71 against 0.11). Now every rank follows the reference. It is a
# run of another history length (the header allows it), so its argmax
# differs from the run's own at some step; --tp 1 (one rank) and --tp 2
# then see the same tokens and their logits differ by rounding only.
run="decode --backend host --preset tiny --contexts 2 --page-tokens 8 --steps 6 --warmup 0 --no-progress"
"$cli" $run --tokens 48 --logits-out "$tmp/ref.logits" >/dev/null || exit 1
vs_ref() {
  "$cli" $run --tokens 40 --json --logits-ref "$tmp/ref.logits" "$@" |
    sed -n 's/.*"vs_ref":{"steps":6,"max_abs_diff":\([^,]*\),"top1_agree":\([0-9]*\),.*/\1 \2/p'
}
one=$(vs_ref --tp 1) || exit 1
two=$(vs_ref --tp 2) || exit 1
echo "--tp 1 vs_ref: $one; --tp 2 vs_ref: $two"
if [ -z "$one" ] || [ -z "$two" ]; then
  echo "cli_audit_s33: no vs_ref in the JSON" >&2
  exit 1
fi
echo "$one $two" | awk '{ d = $1 - $3; if (d < 0) d = -d;
  if ($2 != $4 || d > 1e-2 * $1) exit 1 }' || {
  echo "cli_audit_s33: --tp 2 did not follow the reference's tokens on every rank" >&2
  exit 1
}

# fit took the decode flags --check, --tp, --logits-out, --logits-ref and
# --release-headroom-at and did nothing with them (exit 0; with --tp the
# fit of the whole model, not of a rank's shard): now a usage error.
sh "$expect" 2 "^activekv: fit: --check is a decode flag" \
  "$cli" fit --preset tiny --check || exit 1
sh "$expect" 2 "^activekv: fit: --tp 2 is a decode flag" \
  "$cli" fit --preset tiny --tp 2 || exit 1
sh "$expect" 2 "^activekv: fit: --logits-out is a decode flag" \
  "$cli" fit --preset tiny --logits-out "$tmp/fit.logits" || exit 1
sh "$expect" 2 "^activekv: fit: --logits-ref is a decode flag" \
  "$cli" fit --preset tiny --logits-ref "$tmp/ref.logits" || exit 1
sh "$expect" 2 "^activekv: fit: --release-headroom-at is a decode flag" \
  "$cli" fit --preset tiny --release-headroom-at 1 || exit 1

# --tokens with more values than --contexts dropped the extra values without
# a word (the list is taken in turn: they are never taken). At most one
# value per context, in either order of the flags.
sh "$expect" 2 "^activekv: --tokens: 3 values for --contexts 2" \
  "$cli" fit --preset tiny --contexts 2 --tokens 10,20,30 --page-tokens 8 || exit 1
sh "$expect" 2 "^activekv: --tokens: 2 values for --contexts 1" \
  "$cli" fit --preset tiny --tokens 10,20 --contexts 1 --page-tokens 8 || exit 1
sh "$expect" 0 '"contexts":3,"tokens":30,' \
  "$cli" fit --preset tiny --contexts 3 --tokens 10,20,30 --page-tokens 8 --json || exit 1

# --release-headroom-at past the run's last step never released anything and
# exited 0. It must be within --warmup + --steps (3 here).
hr="decode --backend host --preset tiny --contexts 2 --tokens 20 --page-tokens 8 --steps 2 --warmup 1 --no-progress --route paged --headroom-gib 1 --host-device-mib 64"
sh "$expect" 2 "^activekv: --release-headroom-at 4: the run has 3 steps" \
  "$cli" $hr --release-headroom-at 4 || exit 1
sh "$expect" 0 '"headroom_release":\{"step":3,' \
  "$cli" $hr --release-headroom-at 3 --json || exit 1

# --verbose=1, --help=x and --version=x were "unknown option --verbose":
# switches handled before the others take no value either, and say so.
sh "$expect" 2 "^activekv: --verbose takes no value, got '--verbose=1'" \
  "$cli" fit --preset tiny --verbose=1 || exit 1
sh "$expect" 2 "^activekv: --help takes no value, got '--help=x'" \
  "$cli" fit --help=x || exit 1
sh "$expect" 2 "^activekv: --version takes no value, got '--version=x'" \
  "$cli" --version=x || exit 1

# fit took the route combinations decode refuses: --route stage (or resident)
# with --device-pool-gib reported a device pool of pages (fit's engine
# config made it arena), and --headroom-gib on those routes and a paged
# --chunk-tokens other than --page-tokens passed. fit now refuses what decode
# refuses, with the same words.
sh "$expect" 2 "^activekv: --device-pool-gib 1: only --route arena or paged retains pages" \
  "$cli" fit --preset tiny --route stage --device-pool-gib 1 || exit 1
sh "$expect" 2 "^activekv: --device-pool-gib 1: only --route arena or paged retains pages" \
  "$cli" fit --preset tiny --route resident --device-pool-gib 1 --json || exit 1
sh "$expect" 2 "^activekv: --headroom-gib / --release-headroom-at: only --route arena or paged" \
  "$cli" fit --preset tiny --route stage --headroom-gib 1 || exit 1
sh "$expect" 2 "^activekv: --chunk-tokens 16: the paged route reads whole pages in place" \
  "$cli" fit --preset tiny --route paged --page-tokens 8 --chunk-tokens 16 || exit 1
sh "$expect" 0 '"device_pages":8192' \
  "$cli" fit --preset tiny --route arena --device-pool-gib 1 --json || exit 1
# Messages quote what was typed: a --tokens value of more than 255
# characters (a legal list: leading zeros are allowed, 010 is ten) was
# refused as "at most 16 values", and an option name of 64 characters or
# more was cut to 63 in "unknown option".
zeros=0000000000000000000000000000000000000000000000000000000000000000
zeros=$zeros$zeros$zeros$zeros$zeros
sh "$expect" 0 '"contexts":1,"tokens":64,' \
  "$cli" fit --preset tiny --contexts 1 --tokens "${zeros}64" --page-tokens 8 --json || exit 1
a16=aaaaaaaaaaaaaaaa
sh "$expect" 2 "^activekv: unknown option --$a16$a16$a16$a16$a16 \\(see activekv --help\\)\$" \
  "$cli" fit "--$a16$a16$a16$a16$a16=1" || exit 1
# --tp: each rank's error quotes its own library message. The last message
# was one buffer for the process: a rank wrote it from the log callback
# (under a mutex) while another rank read it, unlocked, into its error (a
# data race, reported by ThreadSanitizer), and a rank could quote another
# rank's line; and an error was written in three pieces, which the ranks
# interleaved ("activekv: activekv: akv_engine_create: ..."). Here both
# ranks' engines fail at create (--fail-nth), each logs its own "group rank
# R/2" line, and each error, one whole line, quotes its own.
out=$("$cli" decode --backend host --preset tiny --contexts 2 --tokens 20 --page-tokens 8 \
  --steps 2 --warmup 0 --no-progress --tp 2 --fail-nth 3 2>&1)
status=$?
printf '%s\n' "$out"
if [ "$status" != 1 ]; then
  echo "cli_audit_s33: --tp 2 --fail-nth 3: exit status $status, expected 1" >&2
  exit 1
fi
for r in 0 1; do
  printf '%s\n' "$out" | grep -Eq "^activekv: akv_engine_create: .*\(group rank $r/2: create" || {
    echo "cli_audit_s33: no rank's error quotes rank $r's own line" >&2
    exit 1
  }
done
# A layer whose lease call failed once its attention was enqueued returned
# at once, and the CPU model's forward reset its layer state while the
# hook's job still ran on the stream's thread, reading it (a data race that
# ThreadSanitizer reports here in a -DAKV_SANITIZE=thread build, exit 66;
# the job could also refuse the layer and overwrite the model's error). The
# layer now drains the stream (or quarantines) before it returns. The
# 40th backend operation is the first step's write back; the delays keep
# the job in flight.
sh "$expect" 1 "^activekv: step 1: akv_lease_write_back: .*injected fault" \
  "$cli" decode --backend host --preset tiny --contexts 3 --tokens 40,17,9 --page-tokens 8 \
  --steps 3 --warmup 1 --no-progress --fail-nth 40 --host-delay-us 2000 || exit 1
# Flags that changed nothing in the run asked for were taken and ignored
# (exit 0): a headroom reserve without headroom, a context's device pages on
# a route that retains none, a GPU for the host backend. Now each is a
# usage error (exit 2) naming the flag.
tiny="--backend host --preset tiny --contexts 2 --tokens 20 --page-tokens 8 --steps 1 --warmup 0 --no-progress"
sh "$expect" 2 "^activekv: --headroom-reserve-gib 1: .*no headroom" \
  "$cli" decode $tiny --route arena --device-pool-gib 1 --headroom-reserve-gib 1 || exit 1
sh "$expect" 2 "^activekv: --target-pages: only --route arena or paged" \
  "$cli" decode $tiny --route stage --target-pages 2 || exit 1
sh "$expect" 2 "^activekv: --burst-pages: only --route arena or paged" \
  "$cli" fit $tiny --route stage --burst-pages 1 || exit 1
sh "$expect" 2 "^activekv: --device 1 selects a GPU; --backend host" \
  "$cli" decode $tiny --route stage --device 1 || exit 1
# The logits files were opened after the prefill: a --logits-out that
# cannot be written (or a --logits-ref that cannot be read) ran the prefill
# first and said only "cannot write". Now it is refused before anything
# runs, with the reason (a run error, exit 1, as before).
sh "$expect" 1 "^activekv: --logits-out $tmp/no/such/dir/x.logits: cannot write \(No such file" \
  "$cli" decode $tiny --route stage --logits-out "$tmp/no/such/dir/x.logits" || exit 1
sh "$expect" 1 "^activekv: --logits-ref $tmp/missing.logits: cannot read \(No such file" \
  "$cli" decode $tiny --route stage --logits-ref "$tmp/missing.logits" || exit 1
# The same flags where they do act are still taken.
sh "$expect" 0 "" "$cli" decode $tiny --route arena --device-pool-gib 1 --target-pages 2 \
  --burst-pages 1 --logits-out "$tmp/ok.logits" || exit 1
# --window alone on a model of fewer than 6 layers was refused naming
# "--dense-every 6", a flag the user never typed; the message now says it is
# what --window implies.
sh "$expect" 2 "^activekv: --dense-every 6 leaves no dense layer in 4 layers.*\(--window without --dense-every takes --dense-every 6" \
  "$cli" decode --backend host --preset tiny --window 8 --steps 1 --warmup 0 --no-progress || exit 1
exit 0
