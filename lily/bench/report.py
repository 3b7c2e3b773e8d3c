"""Bench results: derived figures, summary over lengths, Markdown table and PNG plot.

``python -m lily.bench.report results.json`` re-renders the Markdown and the PNG from a
JSON file (e.g. on a machine with matplotlib, when the GPU machine has none).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from lily.bench.measure import decode_bytes, prefill_flops

SCHEMA = "lily.bench/1"


def enrich(point: dict, cost: dict | None, ceilings: dict | None) -> dict:
    """Add TFLOP/s (prefill) and GB/s (decode) with fractions of the measured ceilings.

    Bytes and FLOPs are those the 4-bit model must cost, whatever the engine: for a peer
    holding dense weights they are a yardstick, not what it moved.
    """
    if point.get("status") != "ok" or not cost:
        return point
    length = point["length"]
    if point.get("prefill_s"):  # None where decode ran on a directly filled context
        tflops = prefill_flops(cost, length) / point["prefill_s"] / 1e12
        point["prefill_TFLOPs"] = tflops
        if ceilings:
            point["prefill_frac_matmul"] = tflops / ceilings["matmul_TFLOPs"]
    if point.get("decode_tokens"):
        n = point["decode_tokens"]
        per_token = decode_bytes(cost, length + (n + 1) / 2)  # mean context over the steps
        point["decode_bytes_per_token"] = per_token
        point["decode_GBps"] = per_token * point["decode_tok_s"] / 1e9
        if ceilings:
            point["decode_frac_copy"] = point["decode_GBps"] / ceilings["copy_GBps"]
    return point


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def summarize(
    points: list[dict], engines: list[str], peers: list[str] | None = None, reference="lily"
) -> dict:
    """Per engine and length: means over rounds; averages over lengths; ``reference``'s
    ratio to each of ``peers`` (default: every other engine)."""
    out: dict = {"engines": {}, "ratios": {}}
    for e in engines:
        per: dict[str, dict] = {}
        for key in ("prefill_tok_s", "decode_tok_s", "peak_mem_bytes", "decode_GBps",
                    "prefill_TFLOPs"):  # fmt: skip
            by_len: dict[int, list[float]] = {}
            for p in points:
                if p["engine"] == e and p.get("status") == "ok" and p.get(key) is not None:
                    by_len.setdefault(p["length"], []).append(p[key])
            agg = max if key == "peak_mem_bytes" else _mean
            per[key] = {str(k): agg(v) for k, v in sorted(by_len.items())}
        out["engines"][e] = {
            **per,
            "avg_prefill_tok_s": _mean(list(per["prefill_tok_s"].values())),
            "avg_decode_tok_s": _mean(list(per["decode_tok_s"].values())),
            "lengths": [int(k) for k in per["prefill_tok_s"]],
        }
    ours = out["engines"].get(reference)
    for e in engines if peers is None else peers:
        if e == reference or ours is None or e not in out["engines"]:
            continue
        theirs = out["engines"][e]
        r = {}
        for kind in ("prefill_tok_s", "decode_tok_s"):
            common = [k for k in ours[kind] if k in theirs[kind] and theirs[kind][k]]
            ratios = {k: ours[kind][k] / theirs[kind][k] for k in common}
            r[kind.removesuffix("_tok_s")] = {
                "per_length": ratios,
                "mean_ratio": _mean(list(ratios.values())),
                "lengths": [int(k) for k in common],
            }
        out["ratios"][f"{reference}/{e}"] = r
    return out


def _k(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def _fmt(x, digits: int = 0) -> str:
    if x is None:
        return "-"
    return f"{x:,.{digits}f}"


def markdown(result: dict) -> str:
    env, cfg, summ = result["env"], result["config"], result["summary"]
    lengths = cfg["lengths"]
    ceil = result.get("ceilings") or {}
    lines = [
        f"# lily bench: {cfg['model']}",
        "",
        f"{env.get('gpu')} (driver {env.get('driver')}), torch {env.get('torch')}, "
        f"commit {str(env.get('git_commit'))[:10]}{' (dirty)' if env.get('git_dirty') else ''}"
        f", {env.get('date')}. Batch 1, {cfg['rounds']} round(s); prefill: first prompt token "
        f"to first output token; decode: {cfg['decode_tokens']} greedy tokens after each "
        "prompt, timed after one untimed step (graph capture). Each engine warmed up first.",
        "",
    ]
    if any(p.get("fill_s") is not None for p in result["points"]):
        lines[-2] += (
            " Where an engine's prefill did not fit the time budget, its decode was timed "
            "after a cache filled directly to that depth (see the notes)."
        )
    if result.get("arch"):
        from lily.runtime.arch_report import format_report

        lines += ["```", *format_report(result["arch"]), "```", ""]
    if ceil:
        lines += [
            f"Ceilings measured at start: copy {ceil['copy_GBps']:,.0f} GB/s, "
            f"{ceil['matmul_dtype']} matmul {ceil['matmul_TFLOPs']:,.1f} TFLOP/s.",
            "",
        ]
    head = "| tokens | " + " | ".join(_k(n) for n in lengths) + " | average |"
    lines += [head, "|" + " --- |" * (len(lengths) + 2)]
    for e, s in summ["engines"].items():
        rows = [("prefill tok/s", "prefill_tok_s", 0, "avg_prefill_tok_s"),
                ("decode tok/s", "decode_tok_s", 1, "avg_decode_tok_s")]  # fmt: skip
        if e.startswith("lily"):
            rows += [("prefill TFLOP/s", "prefill_TFLOPs", 2, None),
                     ("decode GB/s", "decode_GBps", 0, None)]  # fmt: skip
        rows.append(("peak memory GB", "peak_mem_bytes", 1, None))
        for label, key, digits, avg in rows:
            vals = s.get(key, {})
            scale = 1e-9 if key == "peak_mem_bytes" else 1.0
            cells = [_fmt(vals.get(str(n)) * scale if vals.get(str(n)) is not None else None,
                          digits) for n in lengths]  # fmt: skip
            if not any(c != "-" for c in cells):
                continue
            lines.append(f"| {e}: {label} | " + " | ".join(cells)
                         + f" | {_fmt(s.get(avg), digits) if avg else ''} |")  # fmt: skip
    for name, r in summ.get("ratios", {}).items():
        for kind in ("prefill", "decode"):
            per = r[kind]["per_length"]
            cells = [_fmt(per.get(str(n)), 2) for n in lengths]
            lines.append(f"| {name}: {kind} | " + " | ".join(cells)
                         + f" | {_fmt(r[kind]['mean_ratio'], 2)} |")  # fmt: skip
    notes = sorted({f"{p['engine']} at {_k(p['length'])}: {p['note']}"
                    for p in result["points"] if p.get("note")})  # fmt: skip
    cuts = sorted({f"{p['engine']} at {_k(p['length'])}: decode {p['decode_cut']}"
                   for p in result["points"] if p.get("decode_cut")})  # fmt: skip
    if notes or cuts or result.get("notes"):
        lines += ["", "Notes:", ""] + [f"- {n}" for n in result.get("notes", []) + notes + cuts]
    load = result.get("expert_load") or {}
    for label, el in load.items():
        q = el["quantiles"]
        lines += [
            "",
            f"Expert load ({label}, prefill of {el['tokens']} tokens): mean "
            f"{el['mean_rows_per_expert']:.1f} rows per expert; quantiles min {q['min']:.0f}, "
            f"p10 {q['p10']:.0f}, median {q['p50']:.0f}, p90 {q['p90']:.0f}, p99 {q['p99']:.0f},"
            f" max {q['max']:.0f} ({el['max_over_mean']:.1f}x mean); "
            f"idle experts {100 * el['idle_expert_fraction']:.1f}%.",
        ]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: str | Path) -> bool:
    """Throughput against prompt length (log x), prefill and decode panels; False when
    matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    lengths = result["config"]["lengths"]
    for ax, key, title in ((axes[0], "prefill_tok_s", "prefill"), (axes[1], "decode_tok_s",
                                                                  "decode (batch 1)")):  # fmt: skip
        for e, s in result["summary"]["engines"].items():
            xs = [n for n in lengths if s[key].get(str(n)) is not None]
            if xs:
                ax.plot(xs, [s[key][str(n)] for n in xs], marker="o", label=e)
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [_k(n) for n in lengths])
        ax.set_xlabel("prompt tokens" if key == "prefill_tok_s" else "context (prompt) tokens")
        ax.set_ylabel("tokens / s")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(f"lily bench: {result['config']['model']} on {result['env'].get('gpu')}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_outputs(result: dict, out_dir: str | Path, stem: str = "bench") -> dict[str, str]:
    """Write ``stem``.json, .md and .png under ``out_dir``; returns the paths written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": str(out / f"{stem}.json"), "md": str(out / f"{stem}.md")}
    Path(paths["json"]).write_text(json.dumps(result, indent=1))
    Path(paths["md"]).write_text(markdown(result))
    if plot(result, out / f"{stem}.png"):
        paths["png"] = str(out / f"{stem}.png")
    return paths


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lily.bench.report", description=__doc__)
    ap.add_argument("json", help="a lily bench JSON file")
    ap.add_argument("--out", help="output folder (default: beside the JSON)")
    args = ap.parse_args(argv)
    try:
        result = json.loads(Path(args.json).read_text())
    except (OSError, json.JSONDecodeError) as e:
        print(f"lily.bench.report: cannot read {args.json}: {e}", file=sys.stderr)
        return 2
    if result.get("schema") != SCHEMA:
        print(f"lily.bench.report: {args.json} is not a {SCHEMA} file", file=sys.stderr)
        return 2
    path = Path(args.json)
    paths = write_outputs(result, args.out or path.parent, path.stem)
    print("\n".join(paths.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
