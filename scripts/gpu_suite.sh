#!/usr/bin/env bash
# The whole test suite on the lent GPU machine, in two halves that each fit one device call
# (600 s at most): `a` is tests/ops, tests/model and tests/runtime, `b` the rest and the
# compile matrix (it compiles every config again where the machine's Triton build or ptxas
# differs from the stored results' (the H200 machine: about 1,000 CPU-s an arch), so it
# runs beside b's server tests, three compile processes an arch).
#   bash scripts/gpu_suite.sh a [seconds] ; bash scripts/gpu_suite.sh b [seconds]
# Writes $OUT/suite_<half>.txt (-v, so a test that never returns shows: pytest-timeout cannot
# interrupt a thread blocked in a CUDA synchronisation) and $OUT/suite_<half>.xml, then prints
# the failures, errors and any test started but not reported.
set -uo pipefail
half=${1:?a or b}
limit=${2:-560}
out=${OUT:-/tmp}
case $half in
    a) paths=(tests/ops tests/model tests/runtime --ignore=tests/ops/test_compile_matrix.py) ;;
    # (named one by one: an --ignore'd folder drops a file named under it too)
    b) mapfile -t paths < <(ls -d tests/*/ tests/test_*.py 2>/dev/null \
                            | grep -vE "^tests/(ops|model|runtime|__pycache__)/")
       paths+=(tests/ops/test_compile_matrix.py) ;;
    *) echo "half must be a or b, got $half" >&2; exit 2 ;;
esac
# the carried wheels import and the official clients start (else every server test errors)
python3 -c "import openai, anthropic, fastapi, uvicorn, llguidance, jsonschema
openai.OpenAI(api_key='x', base_url='http://127.0.0.1:1'); anthropic.Anthropic(api_key='x')" \
    || { echo "the carried wheels are incomplete: run scripts/gpu_wheels.sh" >&2; exit 3; }
export LILY_COMPILE_WORKERS=${LILY_COMPILE_WORKERS:-3}
# this machine's compile-matrix results, by arch, to commit as
# tests/ops/compile_matrix_results_gpu_machine.json (python3 scripts/matrix_merge.py)
export LILY_COMPILE_MATRIX_SAVE=${LILY_COMPILE_MATRIX_SAVE:-$out/matrix}
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
