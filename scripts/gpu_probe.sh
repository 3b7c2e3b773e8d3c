#!/usr/bin/env bash
# The measurements waiting for a GPU, in one device call (600 s at most), most wanted first,
# each cut so that the call ends in time (docs/notes/pending_branches.md says why each):
#   LILY_GIT_COMMIT=<git rev-parse HEAD here> bash scripts/gpu_probe.sh [seconds]
# (carry .whl: bash scripts/gpu_wheels.sh fills it; the device's copy has no .git)
# 1. the prefill chunk's host time, 1,024 tokens, the device asleep: tensors passed to the
#    direct launch (the default) against their int addresses (LILY_INT_POINTERS=1);
# 2. the whole suite's GPU half (tests/ops, tests/model, tests/runtime);
# 3. moe_prefill's GEMMs on the column tile against the table's (kernels.linear, --quick);
# 4. the streams' longest gap beside a new 4K prompt with the serve changes (quick form);
# 5. the per-program trace of the 8-row MoE launches, and its kernels' own test.
# Everything lands in $OUT (logs, JSON, the suite's report).
set -uo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    > /dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
# the results' commit: the full 40-character hash (tests/bench/test_bench_cli.py checks it)
export LILY_GIT_COMMIT=${LILY_GIT_COMMIT:-$(git rev-parse HEAD 2> /dev/null)}
[[ ${#LILY_GIT_COMMIT} == 40 ]] || echo "LILY_GIT_COMMIT is not a full hash: '$LILY_GIT_COMMIT'"
out=${OUT:-/tmp}
budget=${1:-570}
t0=$(date +%s)
now() { echo $(($(date +%s) - t0)); }
left() { echo $((budget - $(now))); }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader

host_time() {  # $1: name, rest: environment
    local name=$1
    shift
    env "$@" timeout 100 python3 -m lily.bench.gpu.diagnostics.host_time --tokens 1024 \
        --cuts "" --out "$out/host_$name.json" > "$out/host_$name.log" 2>&1
    echo "host_time $name: rc=$? at $(now) s"
    head -16 "$out/host_$name.log"
}
host_time tensors LILY_INT_POINTERS=0
host_time ints LILY_INT_POINTERS=1

bash scripts/gpu_suite.sh a 200 2>&1 | tail -12
echo "suite a: done at $(now) s"

if (($(left) > 200)); then  # moe_prefill's column tile beside the table's (off by default)
    timeout 150 python3 -m lily.bench.gpu.kernels.linear --only moe_prefill --quick \
        --out "$out/moe_prefill_cols.json" > "$out/moe_prefill_cols.log" 2>&1
    echo "moe_prefill cols: rc=$? at $(now) s"
    grep -E "moe_prefill" "$out/moe_prefill_cols.log" | head -24
fi

if (($(left) > 150)); then
    timeout $(($(left) - 90)) python3 -m lily.bench.gpu.e2e.concurrency --concurrency 1 \
        --max-tokens 64 --no-server-warmup --out "$out/gap.json" --md "$out/gap.md" \
        > "$out/gap.log" 2>&1
    echo "gap: rc=$? at $(now) s"
    tail -24 "$out/gap.md" 2> /dev/null || tail -20 "$out/gap.log"
fi

if (($(left) > 60)); then
    timeout 40 python3 -m pytest -q tests/bench/test_diagnostic_kernels.py 2>&1 | tail -2
    timeout $(($(left) - 5)) python3 -m lily.bench.gpu.diagnostics.moe_trace --rows 8 \
        --out "$out/moe_trace.json" > "$out/moe_trace.log" 2>&1
    echo "moe_trace: rc=$? at $(now) s"
    tail -30 "$out/moe_trace.log"
fi
