"""The batched decode step's dense projections at B = 1-16 rows: qgemv_mma_rows against the
GEMVs and the GEMM the step runs today.

Run on the GPU (a few minutes, most of it compiling):

    lily bench --run kernels.gemv_rows -- --out $OUT/gemv_rows.json [--variants]

Shapes (the model's decode projections, 4-bit, groups of 64): the DeltaNet fused
projection qkv|z|b|a with its input norm, attention q|k|v with its norm, o_proj with the
residual, the lm_head with the final norm and fp32 logits. Per shape and B, paths:
- ``qgemv_mma_rows``: the new op (B rows as the MMA's columns), the norm in its prologue,
  PDL; ``rmsnorm+qgemv_mma_rows``: the norm as its own launch (the lm_head's many programs
  each redo it in the prologue); ``--variants``: other tiles than its (unmeasured) table;
- ``qgemv`` (B <= 8): what the batched step runs now for 2-8 rows (FMA GEMV, PDL);
- ``qgemm``: what it runs above 8 rows (rmsnorm launch, GEMM, the residual added after);
- ``qgemv_mma x B``: B one-row tensor-core GEMVs in a row (B = 1: the single-sequence step).
Each path is first checked against the fp32 reference (lily.model.ref, each row's relative
error, the worst reported), then timed as in kernels.linear: a CUDA graph of back-to-back
calls over enough weight copies to stream from HBM, CUDA events, median (``graph_ms``);
the floor is the bytes one call must move (weights, x, output, residual) at the measured
copy rate.
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial

import torch

from lily.bench.gpu.kernels.common import (
    BF16,
    DEV,
    EPS,
    ceilings,
    cfg_str,
    graph_ms,
    rel,
    table,
    weight_copies,
)
from lily.bench.measure import attempt
from lily.model.norm import rms_norm
from lily.model.ref import ref_qlinear
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
VARIANTS = [MmaGemvConfig(16, 8), MmaGemvConfig(32, 8), MmaGemvConfig(64, 8),
            MmaGemvConfig(32, 4), MmaGemvConfig(64, 16)]  # fmt: skip


def paths(b: int, norm: bool, out_dtype, variants: bool) -> list[tuple]:
    """(op, config label, call (x, w, nw, res) -> (B, N)) of each path for B rows."""
    pro = {"eps": EPS}

    def rows(x, w, nw, res, cfg=None):
        return qgemv_mma_rows(x, w, res, out_dtype=out_dtype, norm_weight=nw, eps=EPS,
                              config=cfg, pdl=True)  # fmt: skip

    def rows_split(x, w, nw, res):
        return qgemv_mma_rows(rmsnorm(x, nw, EPS), w, res, out_dtype=out_dtype, pdl=True)

    def gemv(x, w, nw, res):
        return qgemv(x, w, norm_weight=nw, residual=res, out_dtype=out_dtype, pdl=True, **pro)

    def gemm(x, w, nw, res):
        y = qgemm(rmsnorm(x, nw, EPS) if nw is not None else x, w, out_dtype=out_dtype)
        return y if res is None else y + res

    def one_by_one(x, w, nw, res):
        return torch.stack([qgemv_mma(x[r], w, norm_weight=nw, residual=None if res is None
                                      else res[r], out_dtype=out_dtype, pdl=True, **pro)
                            for r in range(len(x))])  # fmt: skip

    out = [("qgemv_mma_rows", "table", rows)]
    if norm:
        out.append(("rmsnorm+qgemv_mma_rows", "table", rows_split))
    for cfg in VARIANTS if variants else []:
        out.append(("qgemv_mma_rows", cfg_str(cfg), partial(rows, cfg=cfg)))
    if b <= 8:
        out.append(("qgemv", "table", gemv))
    out.append(("qgemm", "table", gemm))
    out.append(("qgemv_mma x B", "table", one_by_one))
    return out


def point(fn, x, ws, nw, res, ref: torch.Tensor, floor_us: float, nbytes: float) -> dict:
    """Check ``fn`` row by row against ``ref`` (the worst row), then time one call."""
    y = fn(x, ws[0], nw, res)
    torch.cuda.synchronize()
    err = max(rel(y[r], ref[r]) for r in range(len(x)))
    us = graph_ms([partial(fn, x, w, nw, res) for w in ws]) * 1e3
    return {"rel_err": err, "us": us, "floor_us": floor_us, "of_floor": floor_us / us,
            "GBps": nbytes / us / 1e3}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,4,8,16", help="batch sizes B")
    ap.add_argument("--variants", action="store_true", help="also other qgemv_mma_rows tiles")
    ap.add_argument("--out")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("lily/bench/gpu/kernels/gemv_rows.py needs a CUDA GPU")
    gen = torch.Generator(device=DEV).manual_seed(0)
    ceil = ceilings(read=False)
    print(json.dumps(ceil), flush=True)
    results = []
    for name, n, k, norm, has_res, out_dtype in SHAPES:
        ws = weight_copies(n, k, 4, gen)
        nw = (1.0 + 0.05 * torch.randn(k, generator=gen, device=DEV)).to(BF16) if norm else None
        for b in [int(s) for s in args.rows.split(",")]:
            x = (2.0 * torch.randn(b, k, generator=gen, device=DEV)).to(BF16)
            res = torch.randn(b, n, generator=gen, device=DEV).to(BF16) if has_res else None
            ref = ref_qlinear(rms_norm(x, nw, EPS) if norm else x, ws[0], res)
            out_bytes = torch.empty((), dtype=out_dtype).element_size()
            nbytes = ws[0].nbytes() + b * k * 2 + b * n * (out_bytes + 2 * has_res)
            floor_us = nbytes / ceil["copy_GBps"] / 1e3
            table_cfg = cfg_str(mma_rows_config(n, k, ws[0].group_size, b))
            before = len(results)
            for op, label, fn in paths(b, norm, out_dtype, args.variants):
                if op.endswith("qgemv_mma_rows") and label == "table":
                    label = f"table ({table_cfg})"
                base = {"shape": name, "N": n, "K": k, "B": b, "op": op, "config": label}
                attempt(results, base, partial(point, fn, x, ws, nw, res, ref, floor_us, nbytes))
                print(json.dumps(results[-1]), flush=True)
            # against what the step runs today: qgemv_mma (B = 1), qgemv (2-8), qgemm (9-16)
            now = "qgemv_mma x B" if b == 1 else ("qgemv" if b <= 8 else "qgemm")
            now_us = next((r.get("us") for r in results[before:] if r["op"] == now), None)
            for r in results[before:]:
                if now_us and r.get("us"):
                    r["speedup_vs_now"] = now_us / r["us"]
        del ws
        torch.cuda.empty_cache()
    cols = ["shape", "B", "op", "config", "us", "floor_us", "of_floor", "speedup_vs_now",
            "rel_err"]  # fmt: skip
    print("\n" + table(results, cols))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"ceilings": ceil, "gemv_rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
