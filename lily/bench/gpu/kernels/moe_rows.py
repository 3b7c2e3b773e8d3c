"""The batched step's MoE (moe_decode over B rows; moe_decode_rows) against the byte floor.

B = 1, 2, 4, 8, 16 rows (one token each) at the model's shapes.

Run on the GPU (about 2 minutes, most of it compiling and making 4 layers of weights):

    lily bench --run kernels.moe_rows -- --out $OUT/moe_rows.json

Per B, each path is a CUDA graph of one MoE per layer over ``--layers`` layers of distinct
random weights (1.8 GB at 4: each call streams its experts from HBM, as a decode step
does, not from L2), replayed back to back and timed with CUDA events; the figure is the
time a layer. Paths:
- ``moe_decode_rows``: the batched kernel, the post-attention norm fused, PDL (the batched
  step's MoE); also with the table's tile variants (``--variants``);
- ``rmsnorm+moe_prefill``: what the batched step ran before: an rmsnorm launch, then the
  prefill MoE with the next layer's norm in its last launch;
- ``moe_decode``: the one-row kernel (B = 1: the single-sequence step), ``moe_decode
  x B``: B one-row calls in a row (no expert shared between rows), and ``moe_decode rows``:
  one call over the B rows, each launch's grid once a row (the batched step's default,
  lily/model/ops.py).
The floor is the bytes a layer must read (router, shared expert and its gate, each distinct
expert chosen by the rows once, the rows in and out) at the copy rate measured here;
``distinct`` the experts the rows actually chose (the reference router, the mean over the
layers), ``expected`` the mean under uniform random routing, E (1 - (1 - k/E)^B).
Every path is checked against the reference MoE of each row (``rel_err``, the worst row).
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
    E,
    ceilings,
    cfg_str,
    expert_bytes,
    fixed_bytes,
    moe_weights,
    norm_weight,
    rel,
)
from lily.bench.measure import attempt, capture_graph, kernel_times, replay_ms
from lily.model.norm import rms_norm
from lily.model.ref import ref_moe, ref_qlinear, ref_route
from lily.ops.moe_decode import MoeDecodeConfig, moe_decode
from lily.ops.moe_decode_rows import moe_decode_rows
from lily.ops.moe_prefill import moe_prefill
from lily.ops.rmsnorm import rmsnorm

VARIANTS = [MoeDecodeConfig(mma_rows=32), MoeDecodeConfig(mma_warps=4),
            MoeDecodeConfig(router_rows=8)]  # fmt: skip


def expected_distinct(b: int, e: int = E, k: int = TOP_K) -> float:
    """Mean number of distinct experts B rows choose when each row's k experts are a
    uniform random k-subset of E: each expert is missed by a row with probability 1 - k/E."""
    return e * (1.0 - (1.0 - k / e) ** b)


def layer_bytes(b: int, distinct: float, fixed: int, expert: int) -> float:
    """Bytes one MoE layer of B rows must read or write: the router, the shared expert and
    its gate (``fixed``), each distinct expert once (``expert`` bytes), x in and out."""
    return fixed + distinct * expert + 2 * b * D * 2


def distinct_experts(x: torch.Tensor, w: dict, nw: torch.Tensor) -> int:
    """The experts the reference router picks for the rows of x (after the norm)."""
    _, ids = ref_route(ref_qlinear(rms_norm(x, nw, EPS), w["router"]), TOP_K)
    return len(set(ids.flatten().tolist()))


def worst_row(out: torch.Tensor, x: torch.Tensor, w: dict, nw: torch.Tensor) -> float:
    """The largest relative error of a row's MoE output (the residual x taken off) against
    the reference MoE of that row alone."""
    h, xf = rms_norm(x, nw, EPS), x.float()
    return max(rel(out[r].float() - xf[r], ref_moe(h[r], *w.values(), TOP_K, x[r]) - xf[r])
               for r in range(len(x)))  # fmt: skip


def paths(b: int, variants: bool) -> list[tuple]:
    """(op, config label, one layer's call (x, w, nw, next_nw) -> out) of each path."""
    rows = partial(moe_decode_rows, eps=EPS, pdl=True)
    out = [("moe_decode_rows", "table",
            lambda x, w, nw, nn: rows(x, *w.values(), TOP_K, x, norm_weight=nw))]  # fmt: skip
    for cfg in VARIANTS if variants else []:
        out.append(("moe_decode_rows", cfg_str(cfg),
                    lambda x, w, nw, nn, cfg=cfg: rows(x, *w.values(), TOP_K, x,
                                                       norm_weight=nw, config=cfg)))  # fmt: skip
    if b > 1:
        out.append(("rmsnorm+moe_prefill", "table",
                    lambda x, w, nw, nn: moe_prefill(rmsnorm(x, nw, EPS), *w.values(),
                                                     top_k=TOP_K, residual=x, norm_weight=nn,
                                                     eps=EPS)[0]))  # fmt: skip

    def one_by_one(x, w, nw, nn):
        return torch.stack([moe_decode(x[r], *w.values(), TOP_K, x[r], norm_weight=nw,
                                       eps=EPS, pdl=True) for r in range(len(x))])  # fmt: skip

    out.append(("moe_decode" if b == 1 else "moe_decode x B", "table, pdl", one_by_one))
    if b > 1:  # the batched step's default: the B calls' programs in one grid a launch
        out.append(("moe_decode rows", "table, pdl",
                    lambda x, w, nw, nn: moe_decode(x, *w.values(), TOP_K, x, norm_weight=nw,
                                                    eps=EPS, pdl=True)))  # fmt: skip
    return out


def point(fn, layers: list[dict], xs: list, nws: list, b: int, floor_us: float,
          nbytes: float) -> dict:  # fmt: skip
    """One path over every layer in one graph: time a layer, the worst row's error."""
    n = len(layers)

    def step():
        return [fn(xs[j], layers[j], nws[j], nws[(j + 1) % n]) for j in range(n)]

    graph, outs = capture_graph(step)
    graph.replay()
    torch.cuda.synchronize()
    err = worst_row(outs[0], xs[0], layers[0], nws[0])
    us = replay_ms(graph) * 1e3 / n
    return {"rel_err": err, "time_us": us, "floor_us": floor_us,
            "fraction_of_floor": floor_us / us, "GBps": nbytes / us / 1e3,
            "kernels_us": kernel_times(partial(fn, xs[0], layers[0], nws[0], nws[1]),
                                       key_width=48)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,4,8,16", help="batch sizes B")
    ap.add_argument("--layers", type=int, default=4, help="layers of distinct weights")
    ap.add_argument("--variants", action="store_true", help="also the tile variants")
    ap.add_argument("--out")
    args = ap.parse_args()
    gen = torch.Generator(device=DEV).manual_seed(0)
    ceil = ceilings()
    print(json.dumps(ceil), flush=True)
    layers = [moe_weights(gen) for _ in range(args.layers)]
    fixed, expert = fixed_bytes(layers[0]), expert_bytes(layers[0])
    results = []
    for b in [int(s) for s in args.rows.split(",")]:
        xs = [(2.0 * torch.randn(b, D, generator=gen, device=DEV)).to(BF16) for _ in layers]
        nws = [norm_weight(gen) for _ in layers]
        got = [distinct_experts(x, w, nw) for x, w, nw in zip(xs, layers, nws, strict=True)]
        distinct = sum(got) / len(got)
        nbytes = layer_bytes(b, distinct, fixed, expert)
        floor_us = nbytes / ceil["copy_GBps"] / 1e3
        before = len(results)
        for op, label, fn in paths(b, args.variants):
            base = {"op": op, "B": b, "config": label, "distinct": distinct,
                    "expected": round(expected_distinct(b), 1), "bytes": nbytes}  # fmt: skip
            attempt(results, base, partial(point, fn, layers, xs, nws, b, floor_us, nbytes))
            print(json.dumps({k: v for k, v in results[-1].items() if k != "kernels_us"}),
                  flush=True)  # fmt: skip
        # against what the engine ran before: moe_prefill for several rows, moe_decode for one
        old = ("rmsnorm+moe_prefill", "moe_decode")
        base_us = next((r.get("time_us") for r in results[before:] if r["op"] in old), None)
        for r in results[before:]:
            if base_us and r.get("time_us"):
                r["speedup_vs_previous"] = base_us / r["time_us"]
    print(f"\n{'op':20} {'config':24} {'B':>3} {'distinct':>8} {'us/layer':>9} {'floor':>7} "
          f"{'of floor':>8} {'vs prev':>7} {'rel_err':>8}")  # fmt: skip
    for r in results:
        if "error" in r:
            print(f"{r['op']:20} {r['config']:24} {r['B']:>3} error: {r['error']}")
            continue
        print(f"{r['op']:20} {r['config']:24} {r['B']:>3} {r['distinct']:>8.1f} "
              f"{r['time_us']:>9.1f} {r['floor_us']:>7.1f} {r['fraction_of_floor']:>8.0%} "
              f"{r.get('speedup_vs_previous', 0):>7.2f} {r['rel_err']:>8.1e}")  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"ceilings": ceil, "moe_rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
