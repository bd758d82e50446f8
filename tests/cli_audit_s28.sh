#!/bin/sh
# cli_audit_s28.sh ACTIVEKV CLI_EXPECT
# Headroom flags the library would refuse once the run is under way are
# usage errors, said before anything runs, and a headroom release leaves
# nothing behind:
#  - --release-headroom-at without --headroom-gib: the release was refused
#    (AKV_ERR_NOT_SUPPORTED) in the middle of that step, after the warm-up,
#    and the engine quarantined: exit 1 after a partial run;
#  - --tp with --headroom-gib: a group refuses headroom, and the CLI
#    reported "the host backend is not available here ... use --backend
#    host" on a host run;
#  - a run that releases headroom kept its per-step times allocated (found
#    by LeakSanitizer: under an ASan build the run exited 1 at its end).
# Each case runs through CLI_EXPECT (tests/cli_expect.sh); the first that
# fails ends the test.
set -u
cli=$1
expect=$2
run="decode --backend host --preset tiny --contexts 2 --tokens 20 --page-tokens 8 --steps 2 --warmup 1 --no-progress"

sh "$expect" 2 "^activekv: --release-headroom-at 2: there is no headroom to give back; pass --headroom-gib N too\$" \
  "$cli" $run --route arena --device-pool-gib 1 --release-headroom-at 2 || exit 1
sh "$expect" 2 "^activekv: --tp 2: --headroom-gib and --release-headroom-at are not supported with tensor parallel ranks" \
  "$cli" $run --tp 2 --route arena --headroom-gib 1 --host-device-mib 64 || exit 1
sh "$expect" 2 "^activekv: --tp 2: --headroom-gib and --release-headroom-at are not supported with tensor parallel ranks" \
  "$cli" $run --tp 2 --route paged --headroom-gib 1 --host-device-mib 64 --release-headroom-at 2 || exit 1
# A release mid-step, reported and checked bit for bit; exit 0 also under
# LeakSanitizer.
sh "$expect" 0 '"headroom_release":\{"step":2,.*"step_ms":\[[^]]*,[^]]*,[^]]*\].*"bitwise":true' \
  "$cli" $run --route paged --headroom-gib 1 --host-device-mib 64 --release-headroom-at 2 --check --json || exit 1
sh "$expect" 0 "bitwise +identical: 3 of 3 steps" \
  "$cli" $run --route arena --headroom-gib 1 --host-device-mib 64 --release-headroom-at 2 --check || exit 1
exit 0
