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

exit 0
