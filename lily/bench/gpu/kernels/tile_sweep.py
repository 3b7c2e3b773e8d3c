"""Tile sweep for the kernels that carry most of the time (one GPU call, about 4 minutes).

lily/bench/gpu/diagnostics/kernel_profile.py shows where prefill and decode spend their
time: the MoE grouped GEMMs (half of prefill), the dense qgemm, and in decode the projection
GEMVs and moe_decode. This tries tiles beyond each table's choice at the shapes the runner
uses and prints the best per shape, every configuration checked against the fp32 reference
first. Decode kernels are timed in CUDA graphs over enough weight copies to stream from HBM;
prefill kernels with ``do_bench`` (L2 flushed). Writes JSON to --out.
"""

from __future__ import annotations

import argparse
import json
from functools import partial

import torch

from lily.bench.gpu.kernels.common import (
    BF16,
    DEV,
    EPS,
    TOP_K,
    D,
    bench_ms,
    ceilings,
    cfg_str,
    expert_bytes,
    fixed_bytes,
    gemv_point,
    moe_weights,
    norm_weight,
    rand_qweight,
    rel,
    weight_copies,
)  # fmt: skip
from lily.bench.measure import attempt
from lily.model.norm import rms_norm
from lily.model.ref import ref_moe, ref_qlinear
from lily.ops.moe_decode import moe_decode
from lily.ops.moe_decode_config import MoeDecodeConfig
from lily.ops.moe_prefill import (
    MoePrefillConfig,
    moe_prefill,
    moe_prefill_config,
    router_gemm_config,
)
from lily.ops.qgemm import GemmConfig, gemm_config, qgemm
from lily.ops.qgemv import GemvConfig, gemv_config, qgemv

G = GemmConfig
GATE_UP = [G(16, 64, 64, 4, 3), G(16, 128, 64, 8, 3), G(16, 64, 128, 4, 4), G(16, 128, 128, 8, 3),
           G(16, 64, 64, 4, 4), G(16, 128, 64, 4, 4), G(16, 256, 64, 8, 3), G(16, 64, 64, 8, 3)]  # fmt: skip  # noqa: E501
DOWN = [G(16, 64, 128, 4, 4), G(16, 128, 64, 8, 3), G(16, 64, 64, 4, 3), G(16, 128, 128, 8, 3),
        G(16, 256, 64, 8, 3), G(16, 128, 64, 4, 4)]  # fmt: skip
MOE_T = (256, 1664, 4096)
DENSE = [("dn qkv|z|b|a", 12352, 2048), ("attn q|k|v", 9216, 2048), ("out/o_proj", 2048, 4096)]
DENSE_T = (256, 1664)
DENSE_CFGS = [G(64, 64, 64, 4, 3), G(64, 128, 64, 4, 4), G(128, 128, 64, 8, 3),
              G(64, 256, 64, 8, 3), G(128, 64, 64, 4, 4), G(32, 128, 64, 4, 4),
              G(128, 256, 64, 8, 3), G(128, 128, 64, 8, 2), G(64, 128, 64, 8, 3),
              G(64, 64, 64, 4, 4), G(128, 64, 64, 4, 3)]  # fmt: skip
GEMV = [("dn qkv|z|b|a +norm", 12352, 2048, True), ("attn q|k|v +norm", 9216, 2048, True),
        ("out/o_proj +res", 2048, 4096, False)]  # fmt: skip
GEMV_CFGS = [GemvConfig(n, g, s, w) for n, g, s, w in (
    (16, 32, 1, 4), (8, 32, 1, 4), (4, 32, 1, 4), (8, 32, 1, 2), (4, 32, 1, 2), (16, 16, 2, 4),
    (8, 16, 2, 4), (8, 16, 2, 2), (32, 16, 1, 8), (4, 64, 1, 4), (2, 64, 1, 2), (8, 64, 1, 8),
)]  # fmt: skip
MOE_DECODE = [MoeDecodeConfig(), MoeDecodeConfig(gate_up_rows=4), MoeDecodeConfig(gate_up_rows=2),
              MoeDecodeConfig(down_rows=4), MoeDecodeConfig(down_rows=2, down_warps=2),
              MoeDecodeConfig(gate_up_rows=4, down_rows=4, num_warps=2, down_warps=2),
              MoeDecodeConfig(gate_up_rows=2, down_rows=2, num_warps=2, down_warps=2),
              MoeDecodeConfig(router_rows=2, shared_rows=4, gate_up_rows=4, down_rows=4)]  # fmt: skip  # noqa: E501


def moe_rows(ceil, w, gen, moe_t=MOE_T) -> list[dict]:
    rows: list[dict] = []
    args = list(w.values())
    for t in moe_t:
        x = torch.randn(t, D, generator=gen, device=DEV).to(BF16)
        res = torch.randn(t, D, generator=gen, device=DEV).to(BF16)
        ref = ref_moe(x[:64], *args, TOP_K, res[:64])
        flop = 2 * t * (TOP_K + 1) * 3 * D * 512
        table = moe_prefill_config(t, TOP_K, 256)
        bms = sorted({table.block_m, max(16, table.block_m // 2), min(128, table.block_m * 2)})

        def point(cfg):
            fn = partial(moe_prefill, x, *args, TOP_K, res, config=cfg)  # noqa: B023
            err = rel(fn()[:64], ref)  # noqa: B023
            us = bench_ms(fn) * 1e3
            return {"rel_err": err, "us": us, "TFLOPs": flop / us / 1e6}  # noqa: B023

        attempt(rows, {"op": "moe_prefill", "T": t, "config": "table " + cfg_str(table)},
                partial(point, None))  # fmt: skip
        for bm in bms:
            for gu in GATE_UP:
                cfg = MoePrefillConfig(bm, G(bm, gu.block_n, gu.block_k, gu.num_warps,
                                             gu.num_stages), table.down)  # fmt: skip
                attempt(rows, {"op": "moe_prefill gate_up", "T": t, "config": cfg_str(cfg)},
                        partial(point, cfg))  # fmt: skip
            for dn in DOWN:
                cfg = MoePrefillConfig(bm, table.gate_up, G(bm, dn.block_n, dn.block_k,
                                                            dn.num_warps, dn.num_stages))  # fmt: skip  # noqa: E501
                attempt(rows, {"op": "moe_prefill down", "T": t, "config": cfg_str(cfg)},
                        partial(point, cfg))  # fmt: skip
        print(f"moe_prefill T={t} done", flush=True)
    return rows


def route_rows(ceil, w, gen, moe_t=MOE_T) -> list[dict]:
    """The whole moe_prefill at the table's tiles with 4-32 tokens per routing program (the
    route kernel, 21 us a layer at 16 tokens, ran 71 programs for T = 1,128)."""
    import lily.ops.moe_prefill as mp

    rows: list[dict] = []
    args = list(w.values())
    keep = mp.ROUTE_BLOCK_T
    for t in moe_t:
        x = torch.randn(t, D, generator=gen, device=DEV).to(BF16)
        res = torch.randn(t, D, generator=gen, device=DEV).to(BF16)
        ref = ref_moe(x[:64], *args, TOP_K, res[:64])
        for bt in (4, 8, 16, 32):

            def point():
                fn = partial(moe_prefill, x, *args, TOP_K, res)  # noqa: B023
                err = rel(fn()[:64], ref)  # noqa: B023
                return {"rel_err": err, "us": bench_ms(fn) * 1e3}

            mp.ROUTE_BLOCK_T = bt
            try:
                attempt(rows, {"op": "moe_prefill route", "T": t, "config": f"block_t {bt}"},
                        point)  # fmt: skip
            finally:
                mp.ROUTE_BLOCK_T = keep
    return rows


def dense_rows(ceil, gen, dense_t=DENSE_T) -> list[dict]:
    rows: list[dict] = []
    for name, n, k in DENSE:
        w = rand_qweight((n, k), 4, gen)
        for t in dense_t:
            x = torch.randn(t, k, generator=gen, device=DEV).to(BF16)
            ref = ref_qlinear(x[:32], w)
            flop = 2 * t * n * k

            def point(cfg, x=x, w=w, ref=ref, flop=flop):
                fn = partial(qgemm, x, w, config=cfg)
                err = rel(fn()[:32], ref)
                us = bench_ms(fn) * 1e3
                return {"rel_err": err, "us": us, "TFLOPs": flop / us / 1e6}

            table = gemm_config(t, n, k, 64)
            attempt(rows, {"op": "qgemm", "shape": name, "T": t,
                           "config": "table " + cfg_str(table)}, partial(point, None))  # fmt: skip
            for cfg in DENSE_CFGS:
                attempt(rows, {"op": "qgemm", "shape": name, "T": t, "config": cfg_str(cfg)},
                        partial(point, cfg))  # fmt: skip
    return rows


ROUTER_CFGS = [G(16, 64, 64, 4, 3), G(32, 64, 64, 4, 3), G(16, 64, 128, 4, 3),
               G(32, 64, 128, 4, 3), G(16, 128, 64, 8, 3)]  # fmt: skip


def router_rows(ceil, w, gen, ts) -> list[dict]:
    """The router GEMM (256 x 2048, 8 bits, split-bf16 weight) at prefill token counts: the
    table's tile against smaller token tiles (more programs for a latency-bound GEMM)."""
    rows: list[dict] = []
    for t in ts:
        x = torch.randn(t, D, generator=gen, device=DEV).to(BF16)
        ref = ref_qlinear(x[:32].float(), w["router"]).float()
        flop = 2 * 2 * t * 256 * D

        def point(cfg, x=x, ref=ref, flop=flop):
            fn = partial(qgemm, x, w["router"], out_dtype=torch.float32, precise=True, config=cfg)
            err = rel(fn()[:32], ref)
            us = bench_ms(fn) * 1e3
            return {"rel_err": err, "us": us, "TFLOPs": flop / us / 1e6}

        table = router_gemm_config(t, 64)
        attempt(rows, {"op": "router", "T": t, "config": "table " + cfg_str(table)},
                partial(point, table))  # fmt: skip
        for cfg in ROUTER_CFGS:
            attempt(rows, {"op": "router", "T": t, "config": cfg_str(cfg)}, partial(point, cfg))
    return rows


def gemv_rows(ceil, gen) -> list[dict]:
    rows: list[dict] = []
    nw = norm_weight(gen)
    for name, n, k, norm in GEMV:
        ws = weight_copies(n, k, 4, gen)
        xs = [(2 * torch.randn(k, generator=gen, device=DEV)).to(BF16) for _ in ws]
        rs = [torch.randn(n, generator=gen, device=DEV).to(BF16) for _ in ws]
        if norm:
            ref = ref_qlinear(rms_norm(xs[0], nw, EPS), ws[0])
        else:
            ref = ref_qlinear(xs[0], ws[0]) + rs[0].float()
        nbytes = ws[0].nbytes() + 2 * k + 2 * n
        floor_us = nbytes / ceil["copy_GBps"] / 1e3

        def call(x, w, r, cfg):
            if norm:  # noqa: B023
                return qgemv(x, w, norm_weight=nw, eps=EPS, config=cfg)
            return qgemv(x, w, residual=r, config=cfg)

        for cfg in [None, *GEMV_CFGS]:
            used = cfg or gemv_config(n, k, 1, 4, 64)
            base = {"op": "qgemv", "shape": name, "N": n, "K": k,
                    "config": "table " * (cfg is None) + cfg_str(used)}  # fmt: skip
            calls = [partial(call, x, w, r, cfg) for x, w, r in zip(xs, ws, rs, strict=True)]
            attempt(rows, base, partial(gemv_point, calls, calls[0], ref, nbytes, floor_us))
    return rows


def moe_decode_rows(ceil, w, gen) -> list[dict]:
    rows: list[dict] = []
    xs = [torch.randn(D, generator=gen, device=DEV).to(BF16) for _ in range(32)]
    rs = [torch.randn(D, generator=gen, device=DEV).to(BF16) for _ in xs]
    args = list(w.values())
    ref = ref_moe(xs[0], *args, TOP_K, rs[0])
    nbytes = fixed_bytes(w) + TOP_K * expert_bytes(w) + 6 * D
    floor_us = nbytes / ceil["copy_GBps"] / 1e3
    for cfg in MOE_DECODE:
        base = {"op": "moe_decode", "config": cfg_str(cfg)}
        calls = [partial(moe_decode, x, *args, TOP_K, r, config=cfg)
                 for x, r in zip(xs, rs, strict=True)]  # fmt: skip
        attempt(rows, base, partial(gemv_point, calls, calls[0], ref, nbytes, floor_us))
    return rows


def best(rows: list[dict], keys: tuple[str, ...]) -> list[dict]:
    out: dict = {}
    for r in rows:
        if "us" not in r:
            continue
        k = tuple(r.get(x) for x in keys)
        if k not in out or r["us"] < out[k]["us"]:
            out[k] = r
    return list(out.values())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="gemv,moe_decode,moe,dense")
    ap.add_argument("--out")
    ap.add_argument("--moe-t", default=",".join(map(str, MOE_T)), help="token counts (MoE)")
    ap.add_argument("--dense-t", default=",".join(map(str, DENSE_T)), help="token counts (qgemm)")
    args = ap.parse_args()
    moe_t = tuple(int(x) for x in args.moe_t.split(","))
    dense_t = tuple(int(x) for x in args.dense_t.split(","))
    gen = torch.Generator(device=DEV).manual_seed(0)
    ceil = ceilings()
    res: dict = {"ceilings": ceil}
    w = moe_weights(gen)
    parts = {"gemv": lambda: gemv_rows(ceil, gen), "moe_decode": lambda: moe_decode_rows(ceil, w, gen),  # noqa: E501
             "moe": lambda: moe_rows(ceil, w, gen, moe_t),
             "router": lambda: router_rows(ceil, w, gen, moe_t),
             "route": lambda: route_rows(ceil, w, gen, moe_t),
             "dense": lambda: dense_rows(ceil, gen, dense_t)}  # fmt: skip  # noqa: E501
    for name in args.only.split(","):
        res[name] = parts[name]()
        for r in res[name]:
            print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v)
                              for k, v in r.items()}), flush=True)  # fmt: skip
        if args.out:
            with open(args.out, "w") as f:
                json.dump(res, f, indent=1)
    print("BEST", flush=True)
    for name, keys in (("gemv", ("shape",)), ("moe_decode", ("op",)), ("moe", ("op", "T")),
                       ("dense", ("shape", "T")), ("router", ("op", "T")),
                       ("route", ("op", "T"))):  # fmt: skip
        for r in best(res.get(name, []), keys):
            print(name, {k: r.get(k) for k in ("shape", "op", "T", "config", "us", "of_copy",
                                               "TFLOPs", "rel_err")})  # fmt: skip


if __name__ == "__main__":
    main()
