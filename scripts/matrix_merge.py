"""Merge the per-arch compile-matrix results a machine saved (scripts/gpu_suite.sh writes
them under $OUT/matrix) into one file to commit beside the stored results, keeping what that
file already holds (a run saves only what it compiled, and the device may not return
every file):

    python3 scripts/matrix_merge.py DIR tests/ops/compile_matrix_results_gpu_machine.json

The matrix test reads every tests/ops/compile_matrix_results_*.json (keys are Triton's
cache keys: a machine's own Triton build and ptxas give its own keys).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    src, dst = Path(argv[0]), Path(argv[1])
    files = sorted(src.glob("compile_matrix_results_*.json"))
    if not files:
        print(f"no compile_matrix_results_*.json under {src}", file=sys.stderr)
        return 1
    rows, version = {}, None
    if dst.exists():
        old = json.loads(dst.read_text())
        version = old["triton"]
        rows = {e["key"]: e for e in old["results"]}
    for f in files:
        data = json.loads(f.read_text())
        version = data["triton"]
        rows |= {e["key"]: e for e in data["results"]}
    body = ",\n".join(json.dumps(rows[k], sort_keys=True) for k in sorted(rows))
    dst.write_text(f'{{"triton": "{version}", "results": [\n{body}\n]}}\n')
    print(f"{len(rows)} results from {len(files)} files written to {dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
