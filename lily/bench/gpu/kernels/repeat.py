"""Repeat each prefill GEMM on fixed inputs and count runs that differ from the first.

A deterministic kernel gives the same bits every run; a run that differs (or holds a
non-finite value from finite inputs) points at a race inside the kernel or its compiled
pipeline. Shapes: the full model's dense projections of a 4,096-token chunk (and of a
1,664-token piece), with the table tile and with other pipeline depths.
"""

from __future__ import annotations

import argparse
import json
from functools import partial

import torch

from lily.bench.gpu.full_model import write_json
from lily.bench.gpu.kernels.common import TOP_K, D, bench_ms, moe_weights
from lily.ops.moe_prefill import MoePrefillConfig, moe_prefill, moe_prefill_config
from lily.ops.qgemm import GemmConfig, gemm_config, qgemm
from lily.quant import quantize

# (name, N, K) of the dense prefill projections (MODEL.md)
SHAPES = [("dn.qkv", 8192, 2048), ("dn.z", 4096, 2048), ("dn.b", 32, 2048),
          ("attn.q", 8192, 2048), ("attn.kv", 512, 2048), ("o_proj", 2048, 4096)]  # fmt: skip


def repeat(fn, reps: int) -> dict:
    ref = fn().clone()
    diff = nonfinite = 0
    worst = 0.0
    for _ in range(reps):
        y = fn()
        if not torch.equal(y, ref):
            diff += 1
            worst = max(worst, float((y.float() - ref.float()).abs().nan_to_num(1e30).max()))
        if not bool(torch.isfinite(y).all()):
            nonfinite += 1
    return {"reps": reps, "differ": diff, "nonfinite": nonfinite, "ref_finite":
            bool(torch.isfinite(ref).all()), "worst_abs_diff": worst}  # fmt: skip


def stages(cfg: GemmConfig, n: int) -> GemmConfig:
    return GemmConfig(cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_warps, n, cfg.group_n)


def moe_rows(args, g) -> list[dict]:
    """moe_prefill on fixed inputs with the table tiles and with both GEMMs at each depth."""
    rows = []
    w = list(moe_weights(g).values())
    for t in [int(s) for s in args.tokens.split(",")]:
        x = torch.randn(t, D, generator=g, device="cuda").bfloat16()
        res = torch.randn(t, D, generator=g, device="cuda").bfloat16()
        table = moe_prefill_config(t, TOP_K, 256)
        cfgs = {"table": table}
        for n in args.moe_stages:
            cfgs[f"stages{n}"] = MoePrefillConfig(
                table.block_m, stages(table.gate_up, n), stages(table.down, n)
            )
        for label, cfg in cfgs.items():

            def fn(x=x, res=res, cfg=cfg):
                return moe_prefill(x, *w, TOP_K, res, config=cfg)

            r = repeat(fn, args.reps)
            r.update(tokens=t, shape="moe_prefill", config=label, tile=str(cfg),
                     ms=bench_ms(fn))  # fmt: skip
            print(json.dumps(r), flush=True)
            rows.append(r)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--tokens", default="4096,1664")
    ap.add_argument("--shapes", default=",".join(s[0] for s in SHAPES))
    ap.add_argument("--stages", default="1,2,3,4")
    ap.add_argument("--moe", action="store_true", help="moe_prefill instead of the GEMMs")
    ap.add_argument("--moe-stages", default="2")
    ap.add_argument("--out")
    args = ap.parse_args()
    args.moe_stages = [int(s) for s in args.moe_stages.split(",") if s]
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = moe_rows(args, g) if args.moe else []
    for t in [] if args.moe else [int(s) for s in args.tokens.split(",")]:
        for name, n, k in SHAPES:
            if name not in args.shapes.split(","):
                continue
            w = quantize((torch.randn(n, k, device="cuda", generator=g) / k**0.5).bfloat16(), 4, 64)
            x = torch.randn(t, k, device="cuda", generator=g).bfloat16()
            table = gemm_config(t, n, k, 64)
            cfgs = {f"stages{n}": stages(table, int(n)) for n in args.stages.split(",")}
            for label, cfg in cfgs.items():
                fn = partial(qgemm, x, w, config=cfg)
                r = repeat(fn, args.reps)
                r.update(tokens=t, shape=name, config=label, tile=str(cfg), ms=bench_ms(fn),
                         table=cfg == table)  # fmt: skip
                print(json.dumps(r), flush=True)
                rows.append(r)
    write_json(args.out, args, rows=rows)


if __name__ == "__main__":
    main()
