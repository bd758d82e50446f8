#!/bin/sh
# cli_audit_s34.sh ACTIVEKV CLI_EXPECT
# An outside audit of the CLI: each section says what happened before.
# Each case runs through CLI_EXPECT (tests/cli_expect.sh) or checks the
# output itself; the first that fails ends the test.
set -u
cli=$1
expect=$2
tmp=${TMPDIR:-/tmp}/cli_audit_s34.$$
mkdir -p "$tmp" || exit 1
trap 'rm -rf "$tmp"' EXIT
fail() {
  echo "cli_audit_s34: $*" >&2
  exit 1
}
# expect_not STATUS REGEX COMMAND...: exit STATUS and no line matching REGEX.
expect_not() {
  want=$1
  regex=$2
  shift 2
  out=$("$@" 2>&1)
  got=$?
  printf '%s\n' "$out"
  [ "$got" = "$want" ] || fail "exit status $got, expected $want: $*"
  if printf '%s\n' "$out" | grep -Eq -e "$regex"; then
    fail "output matches $regex: $*"
  fi
  return 0
}
tiny="--backend host --preset tiny --contexts 2 --tokens 20 --page-tokens 8 --steps 2 --warmup 0 --no-progress"

# An engine create failed by --fail-nth was answered with advice for a real
# failure: "lower --host-pool-gib or --device-pool-gib" (an injected
# allocation fault) or "check --page-tokens, --tokens, --kv-heads,
# --head-dim" (any other), flags that have nothing to do with it. The
# message now says the fault was the injected one, and suggests no flag;
# with --tp every rank says so (its own line quotes the group's words).
for n in 1 6 7 10; do
  sh "$expect" 1 "^activekv: akv_engine_create: .*: the fault --fail-nth $n injected while the engine was created\$" \
    "$cli" decode $tiny --route arena --device-pool-gib 1 --fail-nth $n || exit 1
  expect_not 1 "lower --host-pool-gib|check --page-tokens" \
    "$cli" decode $tiny --route arena --device-pool-gib 1 --fail-nth $n || exit 1
done
out=$("$cli" decode $tiny --tp 2 --fail-nth 3 2>&1)
[ $? = 1 ] || fail "--tp 2 --fail-nth 3: expected exit 1"
printf '%s\n' "$out"
for r in 0 1; do
  printf '%s\n' "$out" | grep -Eq "^activekv: akv_engine_create: .*group rank $r/2: create.*: the fault --fail-nth 3 injected" ||
    fail "--tp 2 --fail-nth 3: rank $r does not say the fault was injected"
done
printf '%s\n' "$out" | grep -q "check --page-tokens" && fail "--tp 2 --fail-nth 3: a flag is suggested"

# --json printed a value that is not finite as printf does, "nan" or "inf",
# which is no JSON: a --logits-ref holding a NaN logit (a run whose logits
# went bad) gave "max_abs_diff":nan, and the object did not parse. A value
# that is not finite is now null; the report still says nan.
"$cli" decode $tiny --logits-out "$tmp/ref.logits" >/dev/null || fail "--logits-out run failed"
cp "$tmp/ref.logits" "$tmp/nan.logits" || exit 1
# The first logit of step 1 (after the 32-byte header): a quiet NaN.
printf '\377\377\377\377' | dd of="$tmp/nan.logits" bs=1 seek=40 conv=notrunc 2>/dev/null || exit 1
sh "$expect" 0 '"vs_ref":\{"steps":2,"max_abs_diff":null,"top1_agree":[0-9]+,' \
  "$cli" decode $tiny --json --logits-ref "$tmp/nan.logits" || exit 1
sh "$expect" 0 'max \|logit diff\| nan' \
  "$cli" decode $tiny --logits-ref "$tmp/nan.logits" || exit 1
json_ok() { # the one line of stdout parses (python3 where there is one)
  out=$("$@" 2>/dev/null) || fail "exit status $?: $*"
  if printf '%s\n' "$out" | grep -Eq '[:,\[](-?nan|-?inf)[],}]'; then fail "not JSON: $out"; fi
  if command -v python3 >/dev/null 2>&1; then
    printf '%s\n' "$out" | python3 -m json.tool >/dev/null || fail "not JSON: $out"
  fi
}
json_ok "$cli" decode $tiny --json --logits-ref "$tmp/nan.logits"

# Flags taken where nothing acts on them, the run ending as if they had not
# been given (exit 0): the engine's knobs on --route resident (no engine),
# --host-delay-seed without --host-delay-us, the host backend's testing
# aids on --backend cuda, and fit given a run's knobs. Each is now a usage
# error naming the flag; where they act they are still taken.
for f in "--fail-nth 3" "--host-delay-us 5" "--host-device-mib 64" "--host-pool-gib 2" \
  "--fit-mode shrink"; do
  sh "$expect" 2 "^activekv: ${f% [0-9]*}: --route resident runs no engine" \
    "$cli" decode $tiny --route resident $f || exit 1
done
sh "$expect" 0 "" "$cli" decode $tiny --route resident --kv-dtype fp8 --chunk-tokens 4 || exit 1
sh "$expect" 2 "^activekv: --host-delay-seed 7: it seeds the delays of --host-delay-us, which is 0" \
  "$cli" decode $tiny --host-delay-seed 7 || exit 1
sh "$expect" 0 "" "$cli" decode $tiny --host-delay-seed 7 --host-delay-us 20 || exit 1
sh "$expect" 2 "^activekv: --host-delay-us: a testing aid of the host backend" \
  "$cli" decode --backend cuda --preset tiny --head-dim 64 --host-delay-us 5 || exit 1
sh "$expect" 2 "^activekv: --host-device-mib: a testing aid of the host backend" \
  "$cli" fit --backend cuda --preset tiny --host-device-mib 64 || exit 1
for f in "--fail-nth 3" "--host-delay-us 5" "--host-device-mib 64" "--seed 3" \
  "--pcie-gbps 3" "--target-pages 2" "--burst-pages 1"; do
  sh "$expect" 2 "^activekv: fit: ${f% *} is a decode flag" \
    "$cli" fit --preset tiny --route arena --device-pool-gib 1 $f || exit 1
done
# A --fail-nth past the run's last backend operation injected nothing and
# the run passed without a word (a fault test "passed" with no fault). It
# is said now, with the count: N at the count still fails the run, one past
# it is said.
out=$("$cli" decode $tiny --steps 1 --fail-nth 1000000 2>&1 >/dev/null) || fail "--fail-nth 1000000: exit $?"
ops=$(printf '%s\n' "$out" | sed -n 's/^activekv: note: --fail-nth 1000000 injected no fault: the engine made \([0-9]*\) backend operations in this run (choose N in 1\.\.\([0-9]*\))$/\1 \2/p')
echo "--fail-nth 1000000: $out"
set -- $ops
[ $# = 2 ] && [ "$1" = "$2" ] && [ "$1" -gt 0 ] || fail "--fail-nth 1000000: no note of the operations"
# The count varies by an operation or two from run to run (the retire's
# event queries are polled while not ready), so the checks below stay clear
# of its end: half of it is always reached and injects there, twice it plus
# 100 never is and gets the note.
half=$(($1 / 2))
sh "$expect" 1 "injected fault: .*\\(operation $half\\)" \
  "$cli" decode $tiny --steps 1 --fail-nth "$half" || exit 1
far=$(($1 * 2 + 100))
sh "$expect" 0 "^activekv: note: --fail-nth $far injected no fault: the engine made [0-9]+ backend operations" \
  "$cli" decode $tiny --steps 1 --fail-nth $far || exit 1
expect_not 0 "injected no fault" "$cli" decode $tiny --steps 1 || exit 1

# A decode whose histories cannot fit this machine's memory ran on: the
# fit line warned (not at all under --json), the host backend's pool is
# committed as the prefill writes it, and the run grew until the system
# killed it (--tokens 1073741824 on tiny: 512 GiB a context; 32 TiB for
# 64, more than any machine here). It is refused before anything is
# allocated (exit 1, a limit of the machine); fit still only warns.
sh "$expect" 1 "^activekv: the 64 contexts' histories \(.*\) need 32\.00 TiB of host memory, more than this machine's" \
  "$cli" decode --backend host --preset tiny --contexts 64 --tokens 1073741824 --steps 1 --warmup 0 --no-progress --json || exit 1
sh "$expect" 0 "fit: warning: the 32769 GiB host pool it needs is more than this machine's" \
  "$cli" fit --preset tiny --contexts 64 --tokens 1073741824 --steps 1 --warmup 0 || exit 1

# A device pool the (modelled) device cannot hold was answered "lower
# --host-pool-gib or --device-pool-gib", a flag never given whose pool was
# fine; the message names the device pool and the flags that size it.
sh "$expect" 1 "^activekv: akv_engine_create: out of memory for a 1 GiB device pool .*; lower --device-pool-gib or raise --host-device-mib" \
  "$cli" decode $tiny --route arena --device-pool-gib 1 --host-device-mib 64 || exit 1
expect_not 1 "lower --host-pool-gib" \
  "$cli" decode $tiny --route arena --device-pool-gib 1 --host-device-mib 64 || exit 1

# The host backend's modelled device is host memory, and headroom takes
# (and writes) up to all of it: --host-device-mib beyond this machine's
# memory with a large --headroom-gib took GiB after GiB until the system
# killed the run. It is refused, naming the machine's memory.
sh "$expect" 2 "^activekv: --host-device-mib 1073741824: the modelled device is host memory, and this machine has [0-9]+ MiB" \
  "$cli" decode $tiny --route paged --headroom-gib 1048576 --host-device-mib 1073741824 || exit 1

# A device pool of more pages than a page number holds was refused as
# "akv_fit: invalid configuration ... (check --layers, --kv-heads,
# --head-dim, --tokens, --page-tokens)": every flag but the one at fault.
sh "$expect" 2 "^activekv: --device-pool-gib 1048576: akv_fit: .*would hold 274877906944 pages.*; lower --device-pool-gib or raise --page-tokens" \
  "$cli" fit --preset tiny --contexts 1 --tokens 20 --page-tokens 8 --route paged --device-pool-gib 1048576 || exit 1
sh "$expect" 2 "^activekv: --device-pool-gib 1048576: akv_fit: " \
  "$cli" decode $tiny --route arena --device-pool-gib 1048576 --json || exit 1

# The same usage errors exited 1 under --json (found only by the run) and
# 2 in the report: now 2 in both.
sh "$expect" 2 "^activekv: --page-tokens 8 is longer than a context can get" \
  "$cli" decode --backend host --preset tiny --contexts 2 --tokens 4 --page-tokens 8 --steps 1 --warmup 0 --json || exit 1
sh "$expect" 2 "^activekv: --page-tokens 8 is longer than a context can get" \
  "$cli" decode --backend host --preset tiny --contexts 2 --tokens 4 --page-tokens 8 --steps 1 --warmup 0 --json --tp 2 || exit 1

# A --logits-ref that is a directory, or a file that is no --logits-out
# file, was found only after the prefill ran (and a directory was called
# "not a --logits-out file"). Both are said before anything runs now: the
# run prints no step (no "prefill" line, no step report).
mkdir -p "$tmp/refdir" || exit 1
sh "$expect" 1 "^activekv: --logits-ref $tmp/refdir: is a directory, not a --logits-out file" \
  "$cli" decode $tiny --route stage --logits-ref "$tmp/refdir" || exit 1
printf 'not logits at all, longer than a header of 32 bytes....\n' > "$tmp/junk.logits"
for f in "$tmp/refdir" "$tmp/junk.logits"; do
  out=$("$cli" decode $tiny --route stage --json --logits-ref "$f" 2>&1)
  [ $? = 1 ] || fail "--logits-ref $f: expected exit 1"
  [ -z "$(printf '%s\n' "$out" | grep -v '^activekv: ')" ] || fail "--logits-ref $f: the run went on: $out"
done
sh "$expect" 1 "^activekv: --logits-ref $tmp/junk.logits: not a --logits-out file" \
  "$cli" decode $tiny --route stage --logits-ref "$tmp/junk.logits" || exit 1

# A --logits-ref cut short was found at the step where it ended, after the
# steps before it had run, and one with bytes past its last step was taken
# as a whole reference. Its size is checked against its header before the
# first step now.
cp "$tmp/ref.logits" "$tmp/long.logits" && printf 'xxxx' >> "$tmp/long.logits" || exit 1
size=$(wc -c < "$tmp/ref.logits")
head -c $((size - 4)) "$tmp/ref.logits" > "$tmp/short.logits" || exit 1
for f in long short; do
  sh "$expect" 1 "^activekv: --logits-ref $tmp/$f.logits: holds [0-9]+ bytes, but its header's 2 steps of 2 contexts and vocab [0-9]+ take $size\$" \
    "$cli" decode $tiny --logits-ref "$tmp/$f.logits" || exit 1
done
sh "$expect" 0 "" "$cli" decode $tiny --logits-ref "$tmp/ref.logits" || exit 1
# A reference that is no regular file (a fifo) has no size to check: it
# is still found short at the step where it ends.
if mkfifo "$tmp/ref.fifo" 2>/dev/null; then
  # The writer never outlives the check (if the run did not open the fifo,
  # it would wait in its open for good): bounded, and stopped after the run.
  timeout 30 sh -c 'cat "$1" > "$2"' sh "$tmp/short.logits" "$tmp/ref.fifo" </dev/null >/dev/null 2>&1 &
  writer=$!
  sh "$expect" 1 "^activekv: --logits-ref $tmp/ref.fifo: ends before step 2" \
    "$cli" decode $tiny --logits-ref "$tmp/ref.fifo"
  got=$?
  kill "$writer" 2>/dev/null
  wait "$writer" 2>/dev/null
  [ "$got" = 0 ] || exit 1
else
  echo "cli_audit_s34: SKIP the fifo case: mkfifo failed"
fi

exit 0
