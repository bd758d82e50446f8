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

exit 0
