"""``python -m lily.bench.kernels``: run the kernel benchmark scripts, merge their tables.

Each script (``bench/gpu_linear_kernels.py``, ``bench/gpu_mixer_kernels.py``) is run with
``--out FILE`` and writes JSON: a list of records, or an object holding one under
``results``/``kernels``/``rows``. A record names the kernel (``kernel`` or ``name``), its
case (``shape``) and gives ``time_us`` and ``floor_us`` (or ``fraction_of_floor`` =
floor / time directly). The merged table is sorted by fraction of floor, so the kernel
furthest from its floor shows first. A missing or failing script is reported in one line
and the others still run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ("bench/gpu_linear_kernels.py", "bench/gpu_mixer_kernels.py")
_LIST_KEYS = ("results", "kernels", "rows", "points")
_NAME_KEYS = ("kernel", "name", "op")
_SHAPE_KEYS = ("shape", "shapes", "case")
_FRACTION_KEYS = ("fraction_of_floor", "frac_floor", "floor_fraction", "of_floor")


def _first(rec: dict, keys: tuple[str, ...]):
    for k in keys:
        if rec.get(k) is not None:
            return rec[k]
    return None


def _time_us(rec: dict, prefix: str) -> float | None:
    """``{prefix}_us`` or ``{prefix}_ms`` (x 1000) in microseconds; prefix "" -> us / ms."""
    us = rec.get(f"{prefix}_us" if prefix else "us")
    if us is None:
        ms = rec.get(f"{prefix}_ms" if prefix else "ms")
        us = None if ms is None else 1000.0 * float(ms)
    return None if us is None else float(us)


def normalize(data, script: str) -> list[dict]:
    """Records of one script's JSON in the merged form (kernel, shape, times, fraction)."""
    rows = data
    if isinstance(data, dict):
        rows = next((data[k] for k in _LIST_KEYS if isinstance(data.get(k), list)), None)
    if not isinstance(rows, list):
        raise ValueError(f"{script}: expected a list of records (or one under {_LIST_KEYS})")
    out = []
    for rec in rows:
        if not isinstance(rec, dict):
            raise ValueError(f"{script}: record {rec!r} is not an object")
        t = _time_us(rec, "time") or _time_us(rec, "")
        floor = _time_us(rec, "floor")
        frac = _first(rec, _FRACTION_KEYS)
        if frac is None and t and floor:
            frac = floor / t
        shape = _first(rec, _SHAPE_KEYS)
        out.append({
            "script": script,
            "kernel": str(_first(rec, _NAME_KEYS) or "?"),
            "shape": shape if isinstance(shape, str) or shape is None else json.dumps(shape),
            "time_us": t,
            "floor_us": floor,
            "fraction_of_floor": None if frac is None else float(frac),
            "extra": {k: v for k, v in rec.items() if isinstance(v, (int, float, str))
                      and k not in _NAME_KEYS + _SHAPE_KEYS + _FRACTION_KEYS},
        })  # fmt: skip
    return out


def run_script(script: str, extra: list[str], timeout: float) -> tuple[list[dict], str | None]:
    """(records, None) or ([], one line saying why the script gave nothing)."""
    path = ROOT / script
    if not path.is_file():
        return [], f"{script}: not found (skipped)"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        try:
            r = subprocess.run([sys.executable, str(path), "--out", str(out), *extra], cwd=ROOT,
                               capture_output=True, text=True, timeout=timeout)  # fmt: skip
        except subprocess.TimeoutExpired:
            return [], f"{script}: ran over {timeout:.0f} s (stopped)"
        if r.returncode != 0:
            tail = (r.stderr or r.stdout).strip().splitlines()
            return [], f"{script}: exit code {r.returncode}: {tail[-1] if tail else ''}"[:400]
        if not out.is_file():
            return [], f"{script}: wrote no {out.name} (does it accept --out?)"
        try:
            return normalize(json.loads(out.read_text()), script), None
        except (json.JSONDecodeError, ValueError) as e:
            return [], f"{script}: unreadable output: {e}"[:400]


def merge(records: list[dict]) -> list[dict]:
    """Sorted by fraction of floor, lowest (furthest from its floor) first; unknown last."""
    return sorted(records, key=lambda r: (r["fraction_of_floor"] is None,
                                          r["fraction_of_floor"] or 0.0))  # fmt: skip


def markdown(records: list[dict], problems: list[str]) -> str:
    lines = ["| kernel | shape | time us | floor us | % of floor | script |",
             "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip

    def f(x, d=1):
        return "-" if x is None else f"{x:,.{d}f}"

    for r in records:
        pct = None if r["fraction_of_floor"] is None else 100 * r["fraction_of_floor"]
        lines.append(f"| {r['kernel']} | {r['shape'] or ''} | {f(r['time_us'])} | "
                     f"{f(r['floor_us'])} | {f(pct)} | {Path(r['script']).name} |")  # fmt: skip
    if problems:
        lines += [""] + [f"- {p}" for p in problems]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lily.bench.kernels", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--out", help="write the merged JSON here")
    ap.add_argument("--scripts", default=",".join(SCRIPTS),
                    help="comma-separated scripts, relative to the repository root")  # fmt: skip
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per script")
    ap.add_argument("extra", nargs="*", help="arguments passed on to every script (after --)")
    args = ap.parse_args(argv)
    records, problems = [], []
    for script in [s.strip() for s in args.scripts.split(",") if s.strip()]:
        print(f"running {script} ...", file=sys.stderr, flush=True)
        recs, problem = run_script(script, args.extra, args.timeout)
        records += recs
        if problem:
            problems.append(problem)
            print(problem, file=sys.stderr)
    records = merge(records)
    if args.out:
        Path(args.out).write_text(json.dumps({"kernels": records, "problems": problems},
                                             indent=1))  # fmt: skip
    sys.stdout.write(markdown(records, problems))
    return 0 if records or not problems else 1


if __name__ == "__main__":
    sys.exit(main())
