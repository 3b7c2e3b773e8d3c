"""The MoE sections of lily.bench.gpu.kernels.linear (not a script): moe_decode (table and
tile variants, the fused norm, a captured graph replayed on a new token, the decode chain of
a layer's linear part) and moe_prefill (uniform and skewed routing, the token tile swept,
the stress row of chunks with NaN tokens), each row checked against lily.model.ref."""

from __future__ import annotations

import time
from functools import partial

import torch

import lily.ops.moe_prefill as mp
from lily.bench.gpu.kernels.common import (
    BF16,
    DEV,
    EPS,
    GEMV_GRAPH_CALLS,
    I_E,
    I_S,
    PREFILL_T,
    TOP_K,
    D,
    E,
    Sweeps,
    bench_ms,
    cfg_str,
    expert_bytes,
    fixed_bytes,
    graph_ms,
    norm_weight,
    rand_qweight,
    rel,
)
from lily.bench.measure import attempt, capture_graph, kernel_times
from lily.model.norm import rms_norm
from lily.model.ref import ref_moe, ref_qlinear, ref_route
from lily.ops.moe_decode import moe_decode
from lily.ops.moe_decode_config import MoeDecodeConfig
from lily.ops.moe_prefill import MoePrefillConfig, moe_prefill, moe_prefill_config
from lily.ops.moe_prefill_cols import COLS_TILE
from lily.ops.qgemv import qgemv
from lily.quant import QuantWeight, quantize

CHECK_T = 512  # prefill lengths checked against the reference on every config
CHAIN_LAYERS = 8
CHAIN_PROJ, CHAIN_O = 12352, 4096  # fused DeltaNet projection rows, mixer output width
STRESS_T = (4096, 4096, 1000)  # prefill chunks in a row for the stress row


def decode_point(calls: list, check, ref, nbytes: float, floor_us: float) -> dict:
    err = rel(check(), ref)
    us = graph_ms(calls) * 1e3
    return {"rel_err": err, "us": us, "GBps": nbytes / us / 1e3, "of_copy": floor_us / us,
            "floor_us": floor_us, "kernels_us": kernel_times(calls[0], key_width=48)}  # fmt: skip


def decode_replay(args, xs, rs, nw) -> dict:
    """Captured once (with PDL), replayed on a new token written into the captured input."""
    x, r = xs[1].clone(), rs[1].clone()
    graph, out = capture_graph(lambda: moe_decode(x, *args, TOP_K, r, norm_weight=nw, pdl=True))
    x.copy_(xs[2])
    r.copy_(rs[2])
    graph.replay()
    torch.cuda.synchronize()
    return {"rel_err": rel(out, ref_moe(rms_norm(xs[2], nw, EPS), *args, TOP_K, rs[2]))}


def moe_decode_rows(ceil: dict, w: dict, gen: torch.Generator, sweeps: Sweeps) -> list[dict]:
    """moe_decode on one token (graph of GEMV_GRAPH_CALLS tokens): the table and
    ``sweeps.decode``'s variants, the fused norm against rms_norm first, a graph replay."""
    rows: list[dict] = []
    xs = [torch.randn(D, generator=gen, device=DEV).to(BF16) for _ in range(GEMV_GRAPH_CALLS)]
    rs = [torch.randn(D, generator=gen, device=DEV).to(BF16) for _ in xs]
    nw = norm_weight(gen)
    args = list(w.values())
    ref = ref_moe(xs[0], *args, TOP_K, rs[0])
    # Every token touches the router, the shared expert and TOP_K distinct experts.
    nbytes = fixed_bytes(w) + TOP_K * expert_bytes(w) + 6 * D
    floor_us = nbytes / ceil["copy_GBps"] / 1e3
    shape = "E256 I512 top8 +shared"
    for cfg in sweeps.decode:
        base = {"op": "moe_decode", "shape": shape, "T": 1,
                "config": "table " * (cfg is None) + cfg_str(cfg or MoeDecodeConfig())}  # fmt: skip
        calls = [partial(moe_decode, x, *args, TOP_K, r, config=cfg)
                 for x, r in zip(xs, rs, strict=True)]  # fmt: skip
        check = partial(moe_decode, xs[0], *args, TOP_K, rs[0], config=cfg)
        attempt(rows, base, partial(decode_point, calls, check, ref, nbytes, floor_us))
    # The layer's post-attention norm: fused into the MoE launches, or torch's 7 ops first.
    ref_n = ref_moe(rms_norm(xs[0], nw, EPS), *args, TOP_K, xs[0])
    variants = {
        "fused norm": lambda x: moe_decode(x, *args, TOP_K, x, norm_weight=nw, eps=EPS),
        "fused norm pdl": lambda x: moe_decode(
            x, *args, TOP_K, x, norm_weight=nw, eps=EPS, pdl=True
        ),
        "rms_norm + moe_decode": lambda x: moe_decode(rms_norm(x, nw, EPS), *args, TOP_K, x),
    }
    for label, fn in variants.items():
        base = {"op": "moe_decode+norm", "shape": shape, "T": 1, "config": label}
        calls = [partial(fn, x) for x in xs]
        attempt(rows, base, partial(decode_point, calls, partial(fn, xs[0]), ref_n, nbytes,
                                    floor_us))  # fmt: skip
    base = {"op": "moe_decode", "shape": "graph replay, new token", "T": 1,
            "config": "table, norm, pdl"}  # fmt: skip
    attempt(rows, base, partial(decode_replay, args, xs, rs, nw))
    return rows


def chain_point(w: dict, gen: torch.Generator, pdl: bool) -> dict:
    """A decode layer's linear part over CHAIN_LAYERS layers of distinct projection weights:
    fused-norm qkv|z|b|a GEMV, out_proj GEMV with the residual (its input a stand-in slice
    for the mixer's output), fused-norm MoE. One graph; the mixers are not included. Checked
    against the same chain through the references (fp32)."""
    proj = [rand_qweight((CHAIN_PROJ, D), 4, gen) for _ in range(CHAIN_LAYERS)]
    outp = [rand_qweight((D, CHAIN_O), 4, gen) for _ in range(CHAIN_LAYERS)]
    nw = norm_weight(gen)
    args = list(w.values())
    x0 = torch.randn(D, generator=gen, device=DEV).to(BF16)

    def layers(x, n: int = CHAIN_LAYERS):
        for p, o in zip(proj[:n], outp[:n], strict=True):
            y = qgemv(x, p, norm_weight=nw, eps=EPS, pdl=pdl)
            x = qgemv(y[-CHAIN_O:], o, residual=x, pdl=pdl)
            x = moe_decode(x, *args, TOP_K, x, norm_weight=nw, eps=EPS, pdl=pdl)
        return x

    def reference(x, n: int):
        for p, o in zip(proj[:n], outp[:n], strict=True):
            y = ref_qlinear(rms_norm(x, nw, EPS), p).to(BF16)
            x = ref_qlinear(y[-CHAIN_O:], o, x).to(BF16)
            x = ref_moe(rms_norm(x, nw, EPS), *args, TOP_K, x).to(BF16)
        return x

    # Two layers only: bf16 rounding and router near-ties make longer chains drift apart.
    err = rel(layers(x0, 2), reference(x0, 2))
    us = graph_ms([partial(layers, x0)]) * 1e3 / CHAIN_LAYERS
    nbytes = proj[0].nbytes() + outp[0].nbytes() + fixed_bytes(w) + TOP_K * expert_bytes(w)
    return {"rel_err": err, "us": us, "launches": 5, "GBps": nbytes / us / 1e3,
            "kernels_us": kernel_times(partial(layers, x0))}  # fmt: skip


def skewed_router(gen: torch.Generator, hot: int = 4) -> tuple[QuantWeight, torch.Tensor]:
    """A router whose ``hot`` experts every token prefers, and the direction that does it."""
    u = torch.randn(D, generator=gen, device=DEV)
    u = u / u.norm()
    r = torch.randn(E, D, generator=gen, device=DEV) / D**0.5
    r[:hot] += 3.0 * u
    return quantize(r, 8, 64), u


def prefill_point(cfg, atomic, x, a, res, ref, t, flop, floor_us, extra: bool,
                  cols: bool = False) -> dict:  # fmt: skip
    """One moe_prefill line; ``cols``: its GEMMs on moe_prefill_cols' column tile (16-row
    token tiles; off in the engine until measured)."""
    saved, mp.COLS_MAX_BLOCK_M = mp.COLS_MAX_BLOCK_M, COLS_TILE if cols else 0
    try:
        return _prefill_point(cfg, atomic, x, a, res, ref, t, flop, floor_us, extra)
    finally:
        mp.COLS_MAX_BLOCK_M = saved


def _prefill_point(cfg, atomic, x, a, res, ref, t, flop, floor_us, extra: bool) -> dict:
    fn = partial(moe_prefill, x, *a, TOP_K, res, atomic=atomic, config=cfg)
    err = rel(fn(), ref) if ref is not None else None
    us = bench_ms(fn) * 1e3
    row = {"rel_err": err, "us": us, "TFLOPs": flop / us / 1e6, "floor_us": floor_us,
           "of_floor": floor_us / us, "tok_per_s_layer": t / us * 1e6}  # fmt: skip
    if extra:  # GPU time without the host (graph) and the device time of each launch
        row["graph_us"] = graph_ms([fn]) * 1e3
        row["kernels_us"] = kernel_times(fn)
    return row


def moe_prefill_rows(ceil: dict, w: dict, gen: torch.Generator, sweeps: Sweeps) -> list[dict]:
    """moe_prefill at PREFILL_T, uniform and skewed routing: the table's tile (with and
    without the atomic combine), ``sweeps.prefill_bm``'s token tiles, then the stress row."""
    rows: list[dict] = []
    args = list(w.values())
    skew_router, u = skewed_router(gen)
    for t in PREFILL_T:
        for routing in ("uniform", "skewed"):
            x = torch.randn(t, D, generator=gen, device=DEV)
            a = list(args)
            if routing == "skewed":
                x = x + 2.0 * u
                a[0] = skew_router
            x = x.to(BF16)
            res = torch.randn(t, D, generator=gen, device=DEV).to(BF16)
            _, ids = ref_route(ref_qlinear(x, a[0]), TOP_K)
            counts = torch.bincount(ids.flatten(), minlength=E)
            load = {"max": int(counts.max()), "median": float(counts.float().median()),
                    "empty": int((counts == 0).sum()), "mean": t * TOP_K / E}  # fmt: skip
            flop = 2 * t * (E * D + TOP_K * 3 * D * I_E + 3 * D * I_S)
            nbytes = fixed_bytes(w) + int((counts > 0).sum()) * expert_bytes(w) + 6 * t * D
            floor_us = max(flop / ceil["bf16_matmul_TFLOPs"] / 1e6,
                           nbytes / ceil["copy_GBps"] / 1e3)  # fmt: skip
            ref = ref_moe(x, *a, TOP_K, res) if t == CHECK_T or routing == "skewed" else None
            # The table's tile (with and without the atomic combine; on moe_prefill_cols'
            # column tile where the table's token tile is 16 rows), then each token tile.
            points = [(None, False, False), (None, True, False)]
            points += [(None, False, True)] * (moe_prefill_config(t, TOP_K, E).block_m <= COLS_TILE)
            points += [(bm, False, False) for bm in sweeps.prefill_bm if routing == "uniform"]
            for bm, atomic, cols in points:
                cfg = moe_prefill_config(t, TOP_K, E)
                if bm is not None:
                    tiles = moe_prefill_config(bm * E // TOP_K, TOP_K, E)
                    cfg = MoePrefillConfig(bm, tiles.gate_up, tiles.down)
                name = ("table " if bm is None else "") + ("atomic " if atomic else "")
                name += "cols " if cols else ""
                base = {"op": "moe_prefill", "shape": routing, "T": t, "load": load,
                        "config": name + cfg_str(cfg)}  # fmt: skip
                extra = bm is None and not atomic and routing == "uniform" and t <= 512
                point = partial(prefill_point, cfg, atomic, x, a, res, ref, t, flop, floor_us,
                                extra, cols)  # fmt: skip
                attempt(rows, base, point)
    base = {"op": "moe_prefill", "shape": f"chunks {STRESS_T}, NaN tokens, skewed",
            "T": STRESS_T[0], "config": "table"}  # fmt: skip
    attempt(rows, base, partial(prefill_stress, w, gen))
    return rows


def prefill_stress(w: dict, gen: torch.Generator) -> dict:
    """Chunks in a row as a long prefill runs them, skewed routing, a few NaN/inf tokens:
    no error, NaN rows NaN, the other rows finite and (on a sample) equal to the reference."""
    a = list(w.values())
    a[0], u = skewed_router(gen, hot=2)
    t0 = time.time()
    worst = 0.0
    for t in STRESS_T:
        x = (torch.randn(t, D, generator=gen, device=DEV) + 2.0 * u).to(BF16)
        bad = torch.tensor([0, t // 2 - 1, t // 2, t - 1], device=DEV)
        x[bad[:3]] = float("nan")
        x[bad[3], 7] = float("inf")
        y = moe_prefill(x, *a, TOP_K, x)
        torch.cuda.synchronize()
        good = torch.ones(t, dtype=torch.bool, device=DEV)
        good[bad] = False
        if not torch.isfinite(y[good]).all() or not torch.isnan(y[bad[:3]]).all():
            raise RuntimeError(f"T={t}: NaN rows leaked into other tokens or vanished")
        sample = good.nonzero()[:64, 0]
        worst = max(worst, rel(y[sample], ref_moe(x[sample], *a, TOP_K, x[sample])))
    return {"rel_err": worst, "us": (time.time() - t0) * 1e6}
