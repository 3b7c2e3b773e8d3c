"""``lily bench --run kernels`` (or ``python -m lily.bench.kernels``): run the kernel
benchmark scripts, merge their tables.

Each script (the modules ``lily.bench.gpu.kernels.linear`` and ``...mixer``, or a ``.py``
file given by path) is run with ``--out FILE`` and writes JSON: a list of rows, or an object
whose list-valued entries are sections of rows (``{"dn_decode": [...], "attn_decode": [...],
"ceilings": {...}}``). A row names its kernel (``op``, ``kernel`` or ``name``; else the
section), gives its fraction of the floor (``fraction_of_floor`` or any ``frac_*`` such as
``frac_copy``/``frac_matmul``, else ``floor_us / time_us``) and its time (``time_us``,
``us_per_layer``, ``us`` or ``ms``); its other plain fields describe the case. A row with
``error`` is kept with its message. The merged table is sorted by fraction of floor, so the
kernel furthest from its floor shows first. A missing or failing script is reported in one
line and the others still run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
from pathlib import Path

SCRIPTS = ("lily.bench.gpu.kernels.linear", "lily.bench.gpu.kernels.mixer")
_NAME_KEYS = ("op", "kernel", "name")
_TIME_US_KEYS = ("time_us", "us_per_layer", "us", "median_us")
_TIME_MS_KEYS = ("time_ms", "ms", "median_ms")
# measurements, not part of a case's description
_METRICS = ("GBps", "TFLOPs", "tok_per_s", "rel_err", "error", "floor_us", "floor_ms")


def _fraction(row: dict) -> float | None:
    for k in ("fraction_of_floor", "frac_floor", "floor_fraction"):
        if isinstance(row.get(k), (int, float)):
            return float(row[k])
    fracs = [v for k, v in row.items() if k.startswith("frac") and isinstance(v, (int, float))]
    return float(fracs[0]) if fracs else None


def _time_us(row: dict) -> float | None:
    for k in _TIME_US_KEYS:
        if isinstance(row.get(k), (int, float)):
            return float(row[k])
    for k in _TIME_MS_KEYS:
        if isinstance(row.get(k), (int, float)):
            return 1000.0 * float(row[k])
    return None


def _is_metric(key: str) -> bool:
    return (key in _METRICS or key in _TIME_US_KEYS or key in _TIME_MS_KEYS
            or key.startswith("frac") or key.startswith("ms_"))  # fmt: skip


def _sections(data, script: str) -> list[tuple[str, list]]:
    if isinstance(data, list):
        return [(Path(script).stem, data)]
    if isinstance(data, dict):
        found = [(k, v) for k, v in data.items()
                 if isinstance(v, list) and v and all(isinstance(r, dict) for r in v)]  # fmt: skip
        if found:
            return found
    raise ValueError(f"{script}: no list of result rows in its JSON")


def normalize(data, script: str) -> list[dict]:
    """Rows of one script's JSON in the merged form (kernel, case, time, fraction)."""
    out = []
    for section, rows in _sections(data, script):
        for row in rows:
            if not isinstance(row, dict):
                raise ValueError(f"{script}: row {row!r} of {section} is not an object")
            name = next((row[k] for k in _NAME_KEYS if row.get(k) is not None), section)
            t, frac = _time_us(row), _fraction(row)
            floor = row.get("floor_us")
            if floor is None and isinstance(row.get("floor_ms"), (int, float)):
                floor = 1000.0 * row["floor_ms"]
            if frac is None and t and floor:
                frac = floor / t
            case = ", ".join(
                f"{k}={v}" for k, v in row.items()
                if k not in _NAME_KEYS and not _is_metric(k) and isinstance(v, (int, float, str))
            )  # fmt: skip
            out.append({
                "script": script,
                "kernel": str(name),
                "case": case,
                "time_us": t,
                "floor_us": floor,
                "fraction_of_floor": frac,
                "error": row.get("error"),
                "row": row,
            })  # fmt: skip
    return out


def run_script(script: str, extra: list[str], timeout: float) -> tuple[list[dict], str | None]:
    """(records, None) or ([], one line saying why the script gave nothing). ``script``: a
    module name (run with ``python -m``) or the path of a ``.py`` file."""
    if script.endswith(".py"):
        found, how = Path(script).is_file(), [script]
    else:
        found, how = _module_exists(script), ["-m", script]
    if not found:
        return [], f"{script}: not found (skipped)"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        try:
            cmd = [sys.executable, *how, "--out", str(out), *extra]
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
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


def _module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a missing parent package
        return False


def merge(records: list[dict]) -> list[dict]:
    """Sorted by fraction of floor, lowest (furthest from its floor) first; unknown last."""
    return sorted(records, key=lambda r: (r["fraction_of_floor"] is None,
                                          r["fraction_of_floor"] or 0.0))  # fmt: skip


def markdown(records: list[dict], problems: list[str]) -> str:
    lines = ["| kernel | case | time us | % of floor | script |",
             "| --- | --- | --- | --- | --- |"]  # fmt: skip

    def f(x, d=1):
        return "-" if x is None else f"{x:,.{d}f}"

    for r in records:
        pct = None if r["fraction_of_floor"] is None else 100 * r["fraction_of_floor"]
        pct_text = f"error: {str(r['error'])[:60]}" if r["error"] else f(pct)
        lines.append(f"| {r['kernel']} | {r['case']} | {f(r['time_us'])} | {pct_text} | "
                     f"{Path(r['script']).name} |")  # fmt: skip
    if problems:
        lines += [""] + [f"- {p}" for p in problems]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lily.bench.kernels", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--out", help="write the merged JSON here")
    ap.add_argument("--scripts", default=",".join(SCRIPTS),
                    help="comma-separated modules (or .py files)")  # fmt: skip
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
