#!/bin/sh
# cli_expect.sh STATUS REGEX COMMAND [ARGS...]
# Runs COMMAND and passes only if it exits with STATUS and its output
# (stdout and stderr together) matches the extended regular expression
# REGEX. ctest's PASS_REGULAR_EXPRESSION ignores the exit status; the CLI
# tests that pin a usage error (exit 2) or a verdict (exit 3) need both.
set -u
want=$1
regex=$2
shift 2
out=$("$@" 2>&1)
got=$?
printf '%s\n' "$out"
if [ "$got" != "$want" ]; then
  echo "cli_expect: exit status $got, expected $want" >&2
  exit 1
fi
if ! printf '%s\n' "$out" | grep -Eq -e "$regex"; then
  echo "cli_expect: output does not match: $regex" >&2
  exit 1
fi
exit 0
