"""Where a decode GEMV's time goes in a chain of PDL launches: per-program timestamps.

qgemv_mma's kernel body (the same jit helpers, the same tile table) with ``%globaltimer``
read at four points of every program: entry, its weight loads issued, past the PDL wait,
and after its store; plus the SM it ran on. A CUDA graph of back-to-back calls over distinct
weights (as lily/bench/gpu/kernels/linear.py's floors) is replayed, and for each call against the
one before it this reports: how many of its programs started before the previous call's
last program ended (the ones whose weight loads could overlap it), how long after that end
its wait returned (the link), how long its programs ran past their wait, and the period.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import triton
import triton.language as tl

from lily.bench.measure import capture_graph, replay_ms
from lily.ops.launch import cdiv, pdl_launch, pow2
from lily.ops.qgemv import pdl_wait
from lily.ops.qgemv_mma import (
    PAIR_MASK,
    X_TERMS,
    mma_dot,
    mma_gemv_config,
    mma_tile,
    mma_x,
    mma_x_row,
)
from lily.ops.rmsnorm import cast_to

# entry, loads issued, past the wait, (FINE: x ready, MMA operand ready, dot done), stored
STAMPS = 7
SHAPES = [  # name, N, K, with the norm prologue, with a residual
    ("dn qkv|z|b|a +norm", 12352, 2048, True, False),
    ("in_proj_qkv/q_proj", 8192, 2048, False, False),
    ("o_proj/out_proj +res", 2048, 4096, False, True),
]


@triton.jit
def stamp(dep, ON_CPU: tl.constexpr):
    # %globaltimer (ns); ``dep`` only orders the read after the value it names (0 on the CPU).
    if ON_CPU:
        return dep.to(tl.int64) * 0
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [dep],
                                     dtype=tl.int64, is_pure=False, pack=1)  # fmt: skip


@triton.jit
def smid(dep, ON_CPU: tl.constexpr):
    if ON_CPU:
        return dep.to(tl.int32) * 0
    return tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [dep], dtype=tl.int32,
                                     is_pure=False, pack=1)  # fmt: skip


@triton.jit
def _traced_gemv_kernel(
    p_x, p_qw, p_s, p_b, p_nw, p_res, p_out, p_t, N, stride_qn, stride_sn, pair_mask, eps,
    GROUP: tl.constexpr, NG: tl.constexpr, G: tl.constexpr, BLOCK_N: tl.constexpr,
    W: tl.constexpr, TERMS: tl.constexpr, HAS_NORM: tl.constexpr, HAS_RES: tl.constexpr,
    EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, ON_CPU: tl.constexpr, PDL: tl.constexpr,
    FINE: tl.constexpr, X_FIRST: tl.constexpr,
):  # fmt: skip
    # lily.ops.qgemv_mma._qgemv_mma_kernel with the stamps. FINE adds three inside the part
    # after the wait, each after a block-wide sum of what it waits for (their barriers cost
    # time of their own): x ready, the MMA operand ready, the dot done. X_FIRST loads x (and
    # norms it) before the weights and the wait: wrong in a real chain (x is the previous
    # kernel's output), right in this harness (x is constant); the bound of an x load that
    # does not queue behind the weights'.
    i_n = tl.program_id(0)
    p_row = p_t + i_n * 8  # the stamps, then the SM
    tl.store(p_row, stamp(i_n, ON_CPU))
    if X_FIRST:
        b_xn = mma_x_row(p_x, p_nw, eps, NG, G, GROUP, HAS_NORM, EVEN_K, ON_CPU)
    b_w, b_s, b_b = mma_tile(p_qw, p_s, p_b, p_qw, i_n * BLOCK_N, N, stride_qn, stride_sn, 0, 0,
                             GROUP, NG, G, BLOCK_N, W, 0, EVEN_N, EVEN_K)  # fmt: skip
    tl.store(p_row + 1, stamp(i_n, ON_CPU))
    pdl_wait(PDL)
    tl.store(p_row + 2, stamp(i_n, ON_CPU))
    if not X_FIRST:
        b_xn = mma_x_row(p_x, p_nw, eps, NG, G, GROUP, HAS_NORM, EVEN_K, ON_CPU)
    if FINE:
        tl.store(p_row + 3, stamp(tl.sum(b_xn, axis=0).to(tl.int32, bitcast=True), ON_CPU))
    b_xb, b_xs = mma_x(b_xn, G, GROUP, W, TERMS, ON_CPU)
    if FINE:
        tl.store(p_row + 4, stamp(tl.sum(b_xs, axis=0).to(tl.int32, bitcast=True), ON_CPU))
    acc = mma_dot(b_w, b_s, b_b, b_xb, b_xs, pair_mask, G, BLOCK_N, W, TERMS, ON_CPU)
    if FINE:
        tl.store(p_row + 5, stamp(tl.sum(acc, axis=0).to(tl.int32, bitcast=True), ON_CPU))
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    if HAS_RES:
        acc += tl.load(p_res + o_n, mask=m_n, other=0.0).to(tl.float32)
    tl.store(p_out + o_n, cast_to(acc, p_out.dtype.element_ty, ON_CPU), mask=m_n)
    tl.store(p_row + 6, stamp(tl.sum(acc, axis=0).to(tl.int32, bitcast=True), ON_CPU))
    tl.store(p_row + 7, smid(i_n, ON_CPU).to(tl.int64))


def traced_gemv(x, w, trace, *, norm_weight=None, residual=None, eps=1e-6, pdl=False,
                fine=False, x_first=False):  # fmt: skip
    """``qgemv_mma`` (one row, table tile) writing (programs, STAMPS + 1) int64 into
    ``trace``: the stamps (the three FINE ones stay as they were unless ``fine``), then the
    SM id; ``x_first``: x loaded before the weights and the wait (only where x is constant).
    Returns the output (N,)."""
    n, k = w.shape
    cfg = mma_gemv_config(n, k, w.group_size)
    ng = k // w.group_size
    g = pow2(ng)
    warps = min(cfg.num_warps, g)
    grid = cdiv(n, cfg.block_n)
    assert trace.shape == (grid, STAMPS + 1), (tuple(trace.shape), grid)
    out = torch.empty(n, dtype=x.dtype, device=x.device)
    on_cpu = x.device.type == "cpu"
    pdl = pdl and not on_cpu
    regs = {"maxnreg": cfg.maxnreg} if cfg.maxnreg and not on_cpu else {}
    _traced_gemv_kernel[(grid,)](
        x, w.qweight, w.scales, w.biases, norm_weight if norm_weight is not None else x,
        residual if residual is not None else out, out, trace, n, w.qweight.stride(0),
        w.scales.stride(0), PAIR_MASK, float(eps),
        GROUP=w.group_size, NG=ng, G=g, BLOCK_N=cfg.block_n, W=warps, TERMS=X_TERMS[x.dtype],
        HAS_NORM=norm_weight is not None, HAS_RES=residual is not None,
        EVEN_N=n % cfg.block_n == 0, EVEN_K=g == ng, ON_CPU=on_cpu, PDL=pdl, FINE=fine,
        X_FIRST=x_first,
        num_warps=warps,
        **pdl_launch(pdl), **regs,
    )  # fmt: skip
    return out


def programs(n: int, k: int) -> int:
    return cdiv(n, mma_gemv_config(n, k, 64).block_n)


def analyse(traces: list[torch.Tensor], fine: bool) -> dict:
    """Per call against the one before (us): the medians over the chain; with ``fine``, the
    median program's time in each part after its wait."""
    ts = [t.cpu() for t in traces]
    rows: dict[str, list[float]] = {}

    def add(key: str, v: float) -> None:
        rows.setdefault(key, []).append(v)

    for prev, cur in zip(ts, ts[1:], strict=False):
        prev_end = int(prev[:, 6].max())
        start, waited, end = cur[:, 0], cur[:, 2], cur[:, 6]
        add("period", (int(end.max()) - prev_end) / 1e3)
        add("started_before_prev_end", float((start < prev_end).float().mean()))
        add("first_start_after_prev_end", (int(start.min()) - prev_end) / 1e3)
        add("wait_after_prev_end", (int(waited.min()) - prev_end) / 1e3)
        add("wait_spread", (int(waited.max()) - int(waited.min())) / 1e3)
        post = (end - waited).double() / 1e3
        add("post_wait_median", float(post.median()))
        add("post_wait_max", float(post.max()))
        if fine:
            for key, lo, hi in (("x_ready", 2, 3), ("operand_ready", 3, 4), ("dot", 4, 5),
                                ("store", 5, 6)):  # fmt: skip
                add(key + "_median", float(((cur[:, hi] - cur[:, lo]).double() / 1e3).median()))
    out = {k: round(statistics.median(v), 3) for k, v in rows.items()}
    cols = [0, 1, 2, 6] + ([3, 4, 5] if fine else [])
    steps = torch.cat([t[:, cols].reshape(-1) for t in ts]).unique().diff()
    out["timer_step_ns"] = int(steps[steps > 0].min()) if (steps > 0).any() else 0
    out["sms_used"] = int(ts[-1][:, 7].unique().numel())
    return out


def main() -> None:
    from lily.bench.gpu.full_model import write_json
    from lily.bench.gpu.kernels.common import norm_weight, weight_copies

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="JSON results path")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    nw = norm_weight(gen)
    results = []
    for name, n, k, has_norm, has_res in SHAPES:
        ws = weight_copies(n, k, 4, gen)
        xs = [torch.randn(k, generator=gen, device="cuda").to(torch.bfloat16) for _ in ws]
        rs = [torch.randn(n, generator=gen, device="cuda").to(torch.bfloat16) for _ in ws]
        trs = [torch.zeros(programs(n, k), STAMPS + 1, dtype=torch.int64, device="cuda")
               for _ in ws]  # fmt: skip
        kw = {"norm_weight": nw} if has_norm else {}

        for fine, one, x_first in ((False, False, False), (True, False, False),
                                   (False, True, False), (False, False, True),
                                   (True, False, True)):  # fmt: skip
            over = [ws[0]] * len(ws) if one else ws  # one weight: from L2

            def calls(ws=over, xs=xs, rs=rs, trs=trs, kw=kw, has_res=has_res, fine=fine,
                      x_first=x_first):  # fmt: skip
                for w, x, r, t in zip(ws, xs, rs, trs, strict=True):
                    traced_gemv(x, w, t, residual=r if has_res else None, pdl=True, fine=fine,
                                x_first=x_first, **kw)  # fmt: skip

            graph, _ = capture_graph(calls)
            for _ in range(5):
                graph.replay()
            torch.cuda.synchronize()
            row = {"shape": name, "stamps": "fine" if fine else "coarse",
                   "weights": "one (L2)" if one else "distinct (HBM)",
                   "x": "before the wait (harness only)" if x_first else "after the wait",
                   "calls": len(ws),
                   "programs": programs(n, k), **analyse(trs, fine)}  # fmt: skip
            us = replay_ms(graph, n=20) * 1e3
            row["graph_us_per_call"] = round(us / len(ws), 3)
            results.append(row)
            print(row, flush=True)
        del ws
    write_json(args.out, args, results=results)


if __name__ == "__main__":
    main()
