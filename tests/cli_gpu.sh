#!/bin/sh
# cli_gpu.sh SKIP_REGEX PASS_REGEX COMMAND [ARGS...]
# A CLI run that needs GPUs (ctest label gpu). Runs COMMAND; when it exits 2
# (usage) with output matching the extended regular expression SKIP_REGEX
# (the CLI's own words for "not enough GPUs visible"), prints the reason and
# exits 77, which ctest reports as skipped (SKIP_RETURN_CODE 77). Otherwise
# passes only if COMMAND exits 0 and its output (stdout and stderr together)
# matches PASS_REGEX.
set -u
skip=$1
regex=$2
shift 2
out=$("$@" 2>&1)
got=$?
printf '%s\n' "$out"
if [ "$got" = 2 ] && printf '%s\n' "$out" | grep -Eq -e "$skip"; then
  echo "SKIP: not enough GPUs visible for this run (the CLI refused it with exit 2, above)"
  exit 77
fi
if [ "$got" != 0 ]; then
  echo "cli_gpu: exit status $got, expected 0" >&2
  exit 1
fi
if ! printf '%s\n' "$out" | grep -Eq -e "$regex"; then
  echo "cli_gpu: output does not match: $regex" >&2
  exit 1
fi
exit 0
