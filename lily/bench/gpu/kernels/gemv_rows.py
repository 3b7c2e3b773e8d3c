"""The batched decode step's dense projections at B = 1-16 rows: qgemv_mma_rows against the
GEMVs and the GEMM the step runs today.

Run on the GPU (a few minutes, most of it compiling):

    lily bench --run kernels.gemv_rows -- --out $OUT/gemv_rows.json [--variants]

Shapes (the model's decode projections, 4-bit, groups of 64; ``--shapes`` picks some by
the first word of their names: dn, attn, o_proj, lm_head): the DeltaNet fused projection
qkv|z|b|a with its input norm, attention q|k|v with its norm, o_proj with the residual, the
lm_head with the final norm and fp32 logits. Per shape and B, paths:
- ``qgemv_mma_rows``: the new op (B rows as the MMA's columns), the norm in its prologue,
  PDL, on its table's tile (lily/ops/qgemv_mma_rows.py mma_rows_config: MEASURED_TILES,
  else its rule); ``rmsnorm+qgemv_mma_rows``: the norm as its own launch (the lm_head's
  many programs each redo it in the prologue);
- ``qgemv`` (B <= 8): what the batched step ran for 2-8 rows before ROWS_MMA (FMA GEMV,
  PDL); ``qgemm``: what it ran above 8 rows (rmsnorm launch, GEMM, the residual after);
- ``qgemv_mma x B``: B one-row tensor-core GEMVs in a row (B = 1: the single-sequence step);
- ``qgemv_mma_rows pow2`` (B <= 4): the operand built on pow2(B) rows and broadcast over
  the 8 columns (the default with OPERAND_POW2, lily/ops/qgemv_mma_rows.py);
  ``rows_prep+qgemv_mma_rows``: the rows prepared by their own launch (normed, K order,
  sums), each program only loading them; ``qgemv_mma_rows prepared``: the same GEMV with
  the preparation made once outside the timing (its bound).
``--variants``: qgemv_mma_rows also on the tiles of SWEEP (BLOCK_N 16/32/64 x warps
4/8/16; the lm_head's as rmsnorm+qgemv_mma_rows, as the batched step runs it), a tile the
compile matrix would reject on this GPU (lily/ops/matrix.py: registers, spills past its
limit) skipped with the reason (``skipped``); per shape and B the fastest tile is printed
beside the table's, with its MEASURED_TILES entry (``best``). ``--sweep-only``: the swept
op's lines alone (the table's tile and SWEEP).
Each path is first checked against the fp32 reference (lily.model.ref, each row's relative
error, the worst reported), then timed as in kernels.linear: a CUDA graph of back-to-back
calls over enough weight copies to stream from HBM, CUDA events, median (``graph_ms``);
the floor is the bytes one call must move (weights, x, output, residual) at the measured
copy rate. The JSON is rewritten after every line and ``--max-seconds`` starts no line past
that time, so a run stopped early keeps what it measured. The sweep (shapes in the order
given; about 3 minutes, most of it compiling; what --max-seconds cut, ``skipped`` names):

    lily bench --run kernels.gemv_rows -- --variants --sweep-only \\
        --shapes o_proj,attn,dn,lm_head --rows 2,4,8,16 --max-seconds 210 \\
        --out $OUT/gemv_rows_sweep.json
"""

from __future__ import annotations

import argparse
import json
import time
from functools import partial

import torch

import lily.model.ops as model_ops
from lily.bench.gpu.kernels.common import (
    BF16,
    DEV,
    EPS,
    against_table,
    cfg_str,
    compile_problems,
    graph_ms,
    rel,
    sweep_args,
    sweep_start,
    table,
    than_table,
    weight_copies,
    write_json,
)
from lily.bench.measure import attempt
from lily.model.norm import rms_norm
from lily.model.ref import ref_qlinear
from lily.ops.launch import pow2
from lily.ops.mma_rows import rows_prep
from lily.ops.qgemm import qgemm
from lily.ops.qgemv import qgemv
from lily.ops.qgemv_mma import MmaGemvConfig, qgemv_mma
from lily.ops.qgemv_mma_rows import mma_rows_config, qgemv_mma_rows
from lily.ops.rmsnorm import rmsnorm

SHAPES = [  # (name, N, K, norm, residual, out dtype)
    ("dn qkv|z|b|a", 8192 + 4096 + 64, 2048, True, False, BF16),
    ("attn q|k|v", 8192 + 512 + 512, 2048, True, False, BF16),
    ("o_proj", 2048, 4096, False, True, BF16),
    ("lm_head", 248320, 2048, True, False, torch.float32),
]  # fmt: skip
SWEEP = [MmaGemvConfig(n, w) for n in (16, 32, 64) for w in (4, 8, 16)]
# Shapes whose norm the batched step runs as a launch of its own (lily/model/ops.py head):
# their sweep is of rmsnorm+qgemv_mma_rows, the GEMV without the norm prologue.
NORM_APART = {"lm_head"}
ERR_BOUND = 1e-2  # a tile counts within the kernel tests' bf16 bound (test_qgemv_mma_rows_ops)


def shape_key(name: str) -> str:
    """A shape's name for ``--shapes``: the first word of its name."""
    return name.split()[0]


def pick_shapes(spec: str | None) -> list[tuple]:
    """SHAPES named in ``spec`` (comma-separated ``shape_key``s; None: all), in its order."""
    if not spec:
        return list(SHAPES)
    by_key = {shape_key(s[0]): s for s in SHAPES}
    keys = [k.strip() for k in spec.split(",") if k.strip()]
    unknown = [k for k in keys if k not in by_key]
    if unknown:
        raise ValueError(f"--shapes: unknown {unknown}; the shapes are {sorted(by_key)}")
    return [by_key[k] for k in keys]


def swept(name: str, norm: bool = False) -> str:
    """The op the sweep times for a shape: qgemv_mma_rows as the batched step runs it (a
    normed shape's rows prepared by rows_prep with ROWS_PREP, lily/model/ops.py)."""
    if norm and model_ops.ROWS_PREP:
        return "rows_prep+qgemv_mma_rows"
    return "rmsnorm+qgemv_mma_rows" if name in NORM_APART else "qgemv_mma_rows"


def paths(b: int, norm: bool, out_dtype, variants: list | tuple = (), sweep_only: bool = False,
          op: str = "qgemv_mma_rows") -> list[tuple]:  # fmt: skip
    """(op, config label, call (x, w, nw, res) -> (B, N), qgemv_mma_rows' tile: None for
    its table's) of each path for B rows; ``op`` (qgemv_mma_rows, or with the norm apart
    rmsnorm+qgemv_mma_rows) on the tiles ``variants`` too; ``sweep_only``: ``op`` alone."""
    pro = {"eps": EPS}

    def rows(x, w, nw, res, cfg=None):
        return qgemv_mma_rows(x, w, res, out_dtype=out_dtype, norm_weight=nw, eps=EPS,
                              config=cfg, pdl=True)  # fmt: skip

    def rows_split(x, w, nw, res, cfg=None):
        return qgemv_mma_rows(rmsnorm(x, nw, EPS), w, res, out_dtype=out_dtype, config=cfg,
                              pdl=True)  # fmt: skip

    def gemv(x, w, nw, res):
        return qgemv(x, w, norm_weight=nw, residual=res, out_dtype=out_dtype, pdl=True, **pro)

    def gemm(x, w, nw, res):
        y = qgemm(rmsnorm(x, nw, EPS) if nw is not None else x, w, out_dtype=out_dtype)
        return y if res is None else y + res

    def one_by_one(x, w, nw, res):
        return torch.stack([qgemv_mma(x[r], w, norm_weight=nw, residual=None if res is None
                                      else res[r], out_dtype=out_dtype, pdl=True, **pro)
                            for r in range(len(x))])  # fmt: skip

    def rows_pow2(x, w, nw, res):
        return qgemv_mma_rows(x, w, res, out_dtype=out_dtype, norm_weight=nw, eps=EPS,
                              pdl=True, operand_rows=pow2(len(x)))  # fmt: skip

    def prep(x, w, nw, res, cfg=None):
        return qgemv_mma_rows(rows_prep(x, w.group_size, nw, EPS, pdl=True), w, res,
                              out_dtype=out_dtype, config=cfg, pdl=True)  # fmt: skip

    made = {}

    def prepared(x, w, nw, res):  # the operand made once, outside the timed graph
        key = (x.data_ptr(), None if nw is None else nw.data_ptr())
        if key not in made:
            made[key] = rows_prep(x, w.group_size, nw, EPS)
        return qgemv_mma_rows(made[key], w, res, out_dtype=out_dtype, pdl=True)

    calls = {"qgemv_mma_rows": rows, "rmsnorm+qgemv_mma_rows": rows_split,
             "rows_prep+qgemv_mma_rows": prep}  # fmt: skip
    out = [("qgemv_mma_rows", "table", rows, None)]
    if norm:
        out.append(("rmsnorm+qgemv_mma_rows", "table", rows_split, None))
        out.append(("rows_prep+qgemv_mma_rows", "table", prep, None))
    if not sweep_only:
        if b <= 4:  # (from 5 rows pow2(B) is the 8 columns)
            out.append(("qgemv_mma_rows pow2", "table", rows_pow2, None))
        out.append(("qgemv_mma_rows prepared", "table", prepared, None))
    out += [(op, cfg_str(cfg), partial(calls[op], cfg=cfg), cfg) for cfg in variants]
    if sweep_only:
        return [p for p in out if p[0] == op]
    if b <= 8:
        out.append(("qgemv", "table", gemv, None))
    out.append(("qgemm", "table", gemm, None))
    out.append(("qgemv_mma x B", "table", one_by_one, None))
    return out


def point(fn, x, ws, nw, res, ref: torch.Tensor, floor_us: float, nbytes: float) -> dict:
    """Check ``fn`` row by row against ``ref`` (the worst row), then time one call."""
    y = fn(x, ws[0], nw, res)
    torch.cuda.synchronize()
    err = max(rel(y[r], ref[r]) for r in range(len(x)))
    us = graph_ms([partial(fn, x, w, nw, res) for w in ws]) * 1e3
    return {"rel_err": err, "us": us, "floor_us": floor_us, "of_floor": floor_us / us,
            "GBps": nbytes / us / 1e3}  # fmt: skip


def fastest(lines: list[dict], n: int, k: int, group: int, b: int,
            op: str = "qgemv_mma_rows") -> dict | None:  # fmt: skip
    """The fastest ``op`` line within ERR_BOUND of one shape and B, against the table's
    line, with its MEASURED_TILES entry."""
    ok = [r for r in lines if r["op"] == op and "us" in r and r["rel_err"] < ERR_BOUND
          and "tile" in r]  # fmt: skip
    if not ok:
        return None
    table_line = next((r for r in ok if r["config"].startswith("table")), None)
    top, vs = against_table(ok, "us", table_line)
    bn, warps = top["tile"]
    return {"shape": top["shape"], "B": b, "config": top["config"], "us": top["us"],
            "entry": f"({n}, {k}, {group}): {{{b}: MmaGemvConfig({bn}, {warps})}}",
            **vs}  # fmt: skip


def best_line(r: dict) -> str:
    """One shape's and B's fastest tile against the table's, and its MEASURED_TILES entry."""
    than = than_table(r, 2, r.get("table", ""))
    return f"fastest {r['shape']} B={r['B']}: {r['config']} {r['us']:.2f} us{than}; {r['entry']}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,4,8,16", help="batch sizes B")
    ap.add_argument("--shapes", help="shapes by the first word of their names: "
                    + ",".join(shape_key(s[0]) for s in SHAPES) + " (default: all)")  # fmt: skip
    ap.add_argument("--variants", action="store_true", help="also the qgemv_mma_rows tiles")
    sweep_args(ap, "qgemv_mma_rows")
    ap.add_argument("--out")
    args = ap.parse_args()
    try:
        shapes = pick_shapes(args.shapes)
    except ValueError as e:
        ap.error(str(e))
    t0, gen, ceil = sweep_start("gemv_rows")
    results, skipped, best = [], [], []
    report = {"ceilings": ceil, "gemv_rows": results, "skipped": skipped, "best": best}

    def over() -> bool:
        return bool(args.max_seconds) and time.perf_counter() - t0 > args.max_seconds

    for name, n, k, norm, has_res, out_dtype in shapes:
        if over():  # (no weights made for a shape nothing will be measured on)
            skipped.append({"shape": name, "reason": "past --max-seconds"})
            continue
        ws = weight_copies(n, k, 4, gen)
        gs = ws[0].group_size
        nw = (1.0 + 0.05 * torch.randn(k, generator=gen, device=DEV)).to(BF16) if norm else None
        for b in [int(s) for s in args.rows.split(",")]:
            x = (2.0 * torch.randn(b, k, generator=gen, device=DEV)).to(BF16)
            res = torch.randn(b, n, generator=gen, device=DEV).to(BF16) if has_res else None
            ref = ref_qlinear(rms_norm(x, nw, EPS) if norm else x, ws[0], res)
            out_bytes = torch.empty((), dtype=out_dtype).element_size()
            nbytes = ws[0].nbytes() + b * k * 2 + b * n * (out_bytes + 2 * has_res)
            floor_us = nbytes / ceil["copy_GBps"] / 1e3
            table_cfg = mma_rows_config(n, k, gs, b)
            sweep = [c for c in SWEEP if c != table_cfg] if args.variants else []
            before = len(results)
            ops = paths(b, norm, out_dtype, sweep, args.sweep_only, swept(name, norm))
            for op, label, fn, cfg in ops:
                base = {"shape": name, "N": n, "K": k, "B": b, "op": op, "config": label}
                if over():
                    skipped.append({**base, "reason": "past --max-seconds"})
                    continue
                if op.endswith("qgemv_mma_rows"):
                    tile = cfg or table_cfg
                    if args.variants:  # (what ``fastest`` reads)
                        base["tile"] = (tile.block_n, tile.num_warps)
                    if cfg is None:
                        base["config"] = f"table ({cfg_str(table_cfg)})"
                    elif bad := compile_problems(partial(fn, x, ws[0], nw, res)):
                        skipped.append({**base, "reason": "; ".join(bad)})
                        print(f"  skipped {name} B={b} {label}: {'; '.join(bad)}", flush=True)
                        continue
                attempt(results, base, partial(point, fn, x, ws, nw, res, ref, floor_us, nbytes))
                print(json.dumps(results[-1]), flush=True)
                write_json(args.out, report)
            # against what the step ran before ROWS_MMA: qgemv_mma (B = 1), qgemv, qgemm
            now = "qgemv_mma x B" if b == 1 else ("qgemv" if b <= 8 else "qgemm")
            now_us = next((r.get("us") for r in results[before:] if r["op"] == now), None)
            for r in results[before:]:
                if now_us and r.get("us"):
                    r["speedup_vs_now"] = now_us / r["us"]
            if sweep and (top := fastest(results[before:], n, k, gs, b, swept(name, norm))):
                best.append(top)
                print(best_line(top), flush=True)
            write_json(args.out, report)
        del ws
        torch.cuda.empty_cache()
    cols = ["shape", "B", "op", "config", "us", "floor_us", "of_floor", "speedup_vs_now",
            "rel_err"]  # fmt: skip
    print("\n" + table(results, cols))
    for r in best:
        print(best_line(r))
    write_json(args.out, report)


if __name__ == "__main__":
    main()
