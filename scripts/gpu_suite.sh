#!/usr/bin/env bash
# The whole test suite on the lent GPU machine, in two halves that each fit one device call
# (600 s at most): `a` is tests/ops, tests/model and tests/runtime, `b` the rest.
#   bash scripts/gpu_suite.sh a [seconds] ; bash scripts/gpu_suite.sh b [seconds]
# Writes $OUT/suite_<half>.txt (-v, so a test that never returns shows: pytest-timeout cannot
# interrupt a thread blocked in a CUDA synchronisation) and $OUT/suite_<half>.xml, then prints
# the failures, errors and any test started but not reported.
set -uo pipefail
half=${1:?a or b}
limit=${2:-560}
out=${OUT:-/tmp}
case $half in
    a) paths=(tests/ops tests/model tests/runtime) ;;
    b) paths=(tests --ignore=tests/ops --ignore=tests/model --ignore=tests/runtime) ;;
    *) echo "half must be a or b, got $half" >&2; exit 2 ;;
esac
t0=$(date +%s)
timeout "$limit" python3 -m pytest -v -n 12 -ra --timeout 300 -p no:cacheprovider \
    --junitxml="$out/suite_$half.xml" "${paths[@]}" > "$out/suite_$half.txt" 2>&1
rc=$?
echo "suite $half: rc=$rc in $(( $(date +%s) - t0 )) s"
grep -E "^(FAILED|ERROR) " "$out/suite_$half.txt" | cut -c1-200
tail -n 1 "$out/suite_$half.txt"
grep -oE "(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) tests/\S+" "$out/suite_$half.txt" \
    | awk '{print $2}' | sort -u > /tmp/suite_done.txt
grep -oE "^tests/\S+" "$out/suite_$half.txt" | sort -u > /tmp/suite_started.txt
comm -23 /tmp/suite_started.txt /tmp/suite_done.txt | sed 's/^/started, not reported: /'
exit $rc
