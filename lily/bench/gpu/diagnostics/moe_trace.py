"""Where the batched step's MoE launches spend their time: per-program timestamps.

The routed gate/up and the down launch of the batched decode step's MoE (route_once,
down_operand and down_early: the 4- and 8-row entries of MOE_ROWS_CONFIGS), their kernel
bodies made of the same jit helpers as lily/ops/moe_decode_mma.py's, with ``%globaltimer``
read at five points of every program (diagnostics/gemv_trace.py's method): entry, past the
PDL wait, its weight tiles landed and its MMAs done (in the fine pass only: each after a
block-wide reduction of what it waits for, whose barrier costs time of its own), and after its
store; plus the SM it ran on. A CUDA graph of ``--layers`` layers (each its own full-size
random experts and random routing, gate/up then down under PDL, the router launch left
out: its outputs are given) is replayed; for each launch kind this reports, as medians over
the layers: the launch's span and its exposed time after the launch before, a program's time
from entry, past its wait, loading and multiplying, how many programs an SM ran at once,
and how many SMs ran any. What it is for: whether a program's time at 8 rows is its loads,
its arithmetic or its wait, and whether the SM's programs overlap their loads
(docs/notes/batching.md, "Thirteenth session").

    python3 -m lily.bench.gpu.diagnostics.moe_trace --rows 8 --out $OUT/moe_trace.json
"""

from __future__ import annotations

import argparse
import statistics

import torch
import triton
import triton.language as tl

from lily.bench.gpu.diagnostics.gemv_trace import smid, stamp
from lily.bench.measure import capture_graph, replay_ms
from lily.ops.launch import cdiv, mask_lo, pdl_launch, pow2
from lily.ops.mma_rows import row_operand, row_prepped
from lily.ops.moe_decode_config import MoeDecodeConfig
from lily.ops.moe_decode_mma import gate_up_tiles, store_h_op
from lily.ops.moe_decode_parts import down_early, down_finish
from lily.ops.norm_rope import sigmoid
from lily.ops.qgemv import pdl_wait
from lily.ops.qgemv_mma import PAIR_MASK, mma_dot, mma_tile

# entry, past the wait, (FINE: tiles landed, dot done), stored; then the SM
STAMPS = 5


@triton.jit
def _landed(t):
    # an int32 that needs every element of int32 ``t`` (a stamp after it waits for them;
    # a max, which cannot overflow)
    return tl.max(tl.reshape(t, [t.numel]), axis=0)


@triton.jit
def _done(t):
    # the same for fp32 ``t`` (its sum's bits)
    return tl.sum(tl.reshape(t, [t.numel]), axis=0).to(tl.int32, bitcast=True)


@triton.jit
def _traced_gate_up_kernel(
    p_ids, p_wts, p_op, p_sum, p_hop, p_t, p_gw, p_gs, p_gb, p_uw, p_us, p_ub, stride_we,
    stride_se, stride_qn, stride_sn, I_E, pair_mask,
    TOP_K: tl.constexpr, GROUP: tl.constexpr, NG: tl.constexpr, G: tl.constexpr,
    BLOCK_N: tl.constexpr, W: tl.constexpr, N_BLOCKS: tl.constexpr, HG: tl.constexpr,
    EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, ON_CPU: tl.constexpr, PDL: tl.constexpr,
    FINE: tl.constexpr,
):  # fmt: skip
    # _moe_gate_up_mma_kernel's ROUTED + H_OP form with the stamps.
    pid = tl.program_id(0)
    r = tl.program_id(1)
    p_row = p_t + (r * tl.num_programs(0) + pid) * (STAMPS + 1)
    tl.store(p_row, stamp(pid, ON_CPU))
    slot = pid // N_BLOCKS
    row0 = (pid % N_BLOCKS) * BLOCK_N
    pdl_wait(PDL)
    tl.store(p_row + 1, stamp(pid, ON_CPU))
    e64 = tl.load(p_ids + r * TOP_K + slot).to(tl.int64)
    b_xb, b_xs = row_prepped(p_op + r * (G * GROUP), p_sum + r * G, G, GROUP, W, ON_CPU)
    g_w, g_s, g_b, u_w, u_s, u_b = gate_up_tiles(
        p_gw, p_gs, p_gb, p_uw, p_us, p_ub, p_ids, e64, row0, I_E, stride_we, stride_se,
        stride_qn, stride_sn, GROUP, NG, G, BLOCK_N, W, EVEN_N, EVEN_K,
    )  # fmt: skip
    if FINE:
        tl.store(p_row + 2, stamp(_landed(g_w) + _landed(u_w), ON_CPU))
    b_g = mma_dot(g_w, g_s, g_b, b_xb, b_xs, pair_mask, G, BLOCK_N, W, 1, ON_CPU)
    b_u = mma_dot(u_w, u_s, u_b, b_xb, b_xs, pair_mask, G, BLOCK_N, W, 1, ON_CPU)
    if FINE:
        tl.store(p_row + 3, stamp(_done(b_g) + _done(b_u), ON_CPU))
    o_n = row0 + tl.arange(0, BLOCK_N)
    b_h = b_g * sigmoid(b_g) * b_u
    store_h_op(p_hop, b_h, tl.load(p_wts + r * TOP_K + slot), r, slot, o_n, I_E, HG, GROUP,
               ON_CPU)  # fmt: skip
    tl.store(p_row + 4, stamp(_done(b_h), ON_CPU))
    tl.store(p_row + 5, smid(pid, ON_CPU).to(tl.int64))


@triton.jit
def _traced_down_kernel(
    p_h, p_ids, p_logits, p_res, p_out, p_hop, p_t, stride_xt, stride_lt, stride_hb,
    p_dw, p_ds, p_db, stride_we, stride_se, stride_qn, stride_sn,
    p_sdw, p_sds, p_sdb, stride_sqn, stride_ssn, E, D, I_S, stride_h, pair_mask, mask_lo,
    TOP_K: tl.constexpr, GROUP: tl.constexpr, SG: tl.constexpr, G: tl.constexpr,
    W: tl.constexpr, BITS: tl.constexpr, S_BG: tl.constexpr, BLOCK_N: tl.constexpr,
    EVEN_N: tl.constexpr, ON_CPU: tl.constexpr, PDL: tl.constexpr, FINE: tl.constexpr,
):  # fmt: skip
    # _moe_down_mma_kernel's H_OP + EARLY_W form (with the shared expert and the residual)
    # with the stamps.
    NG: tl.constexpr = TOP_K * SG
    i_n = tl.program_id(0)
    r = tl.program_id(1)
    p_row = p_t + (r * tl.num_programs(0) + i_n) * (STAMPS + 1)
    tl.store(p_row, stamp(i_n, ON_CPU))
    p_res += r * stride_xt
    p_out += r * stride_xt
    p_logits += r * stride_lt
    p_h += r * stride_hb
    row0 = i_n * BLOCK_N
    o_n = row0 + tl.arange(0, BLOCK_N)
    m_n = o_n < D
    b_sw, b_ss, b_sb, b_hs, b_c, b_res = down_early(
        p_sdw, p_sds, p_sdb, stride_sqn, stride_ssn, p_h, stride_h, p_logits, p_res, o_n, m_n,
        E, I_S, TOP_K, BITS, GROUP, S_BG, True, True,
    )  # fmt: skip
    b_w, b_s, b_b = mma_tile(p_dw, p_ds, p_db, p_ids + r * TOP_K, row0, D, stride_qn, stride_sn,
                             stride_we, stride_se, GROUP, NG, G, BLOCK_N, W, SG, EVEN_N,
                             NG == G)  # fmt: skip
    pdl_wait(PDL)
    tl.store(p_row + 1, stamp(i_n, ON_CPU))
    if FINE:
        tl.store(p_row + 2, stamp(_landed(b_w), ON_CPU))
    b_xb, b_xs = row_operand(p_hop + r * (G * GROUP), G, GROUP, NG, W, ON_CPU)
    acc = mma_dot(b_w, b_s, b_b, b_xb, b_xs, pair_mask, G, BLOCK_N, W, 1, ON_CPU)
    if FINE:
        tl.store(p_row + 3, stamp(_done(acc), ON_CPU))
    down_finish(acc, b_sw, b_ss, b_sb, b_hs, b_c, b_res, p_out, o_n, m_n, mask_lo, BITS, S_BG,
                True, True, ON_CPU)  # fmt: skip
    tl.store(p_row + 4, stamp(_done(acc), ON_CPU))
    tl.store(p_row + 5, smid(i_n, ON_CPU).to(tl.int64))


def grids(w: dict, b: int, cfg: MoeDecodeConfig) -> tuple[tuple[int, int], tuple[int, int]]:
    """The gate/up and down launches' grids for ``b`` rows (moe_mma_experts' tiles)."""
    i, d = w["gate"].qweight.shape[1], w["down"].qweight.shape[1]
    bn = cfg.mma_rows
    return (w["top_k"] * cdiv(i, bn), b), (cdiv(d, cfg.mma_down_rows or bn), b)


def traced_moe(w: dict, ins: dict, cfg: MoeDecodeConfig, t_gu: torch.Tensor,
               t_dn: torch.Tensor, pdl: bool = False,
               fine: bool = False) -> torch.Tensor:  # fmt: skip
    """The gate/up and down launches of ``moe_decode`` (shared expert, residual; route_once,
    down_operand, down_early) on the router launch's outputs ``ins`` (ids, wts (B, k); op
    (B, G, GROUP) bf16 and sums (B, G): x' prepared; logits (B, >= E + 1) fp32; h (B, k + 1,
    >= I_S) fp32, row k the shared expert's; res (B, D)), writing (programs, STAMPS + 1)
    int64 into ``t_gu`` and ``t_dn``. ``w``: moe_decode's weights by name and its top_k.
    Returns the output (B, D)."""
    gate, up, down, sd = w["gate"], w["up"], w["down"], w["shared_down"]
    e, i, d = gate.qweight.shape[0], gate.qweight.shape[1], down.qweight.shape[1]
    i_s, top_k, gs = sd.qweight.shape[1] * 32 // sd.bits, w["top_k"], gate.group_size
    res, h, logits = ins["res"], ins["h"], ins["logits"]
    b = res.shape[0]
    on_cpu = res.device.type == "cpu"
    pdl = pdl and not on_cpu
    ng = d // gs
    g = pow2(ng)
    sg = i // gs
    hg = pow2(top_k * sg)
    (gu_grid, dn_grid) = grids(w, b, cfg)
    assert t_gu.shape == (gu_grid[0] * b, STAMPS + 1), (tuple(t_gu.shape), gu_grid)
    assert t_dn.shape == (dn_grid[0] * b, STAMPS + 1), (tuple(t_dn.shape), dn_grid)
    hop = torch.zeros((b, hg, gs), dtype=torch.bfloat16, device=res.device)
    bn, w_gu = cfg.mma_rows, min(cfg.mma_warps, g)
    _traced_gate_up_kernel[gu_grid](
        ins["ids"], ins["wts"], ins["op"], ins["sums"], hop, t_gu, gate.qweight, gate.scales,
        gate.biases, up.qweight, up.scales, up.biases, gate.qweight.stride(0),
        gate.scales.stride(0), gate.qweight.stride(1), gate.scales.stride(1), i, PAIR_MASK,
        TOP_K=top_k, GROUP=gs, NG=ng, G=g, BLOCK_N=bn, W=w_gu, N_BLOCKS=cdiv(i, bn), HG=hg,
        EVEN_N=i % bn == 0, EVEN_K=g == ng, ON_CPU=on_cpu, PDL=pdl, FINE=fine, num_warps=w_gu,
        **pdl_launch(pdl),
    )  # fmt: skip
    out = torch.empty_like(res)
    bn = cfg.mma_down_rows or cfg.mma_rows
    w_dn = min(cfg.mma_down_warps or cfg.mma_warps, hg)
    _traced_down_kernel[dn_grid](
        h, ins["ids"], logits, res, out, hop, t_dn, res.stride(0), logits.stride(0),
        h.stride(0), down.qweight, down.scales, down.biases, down.qweight.stride(0),
        down.scales.stride(0), down.qweight.stride(1), down.scales.stride(1),
        sd.qweight, sd.scales, sd.biases, sd.qweight.stride(0), sd.scales.stride(0),
        e, d, i_s, h.stride(1), PAIR_MASK, mask_lo(down.bits),
        TOP_K=top_k, GROUP=gs, SG=sg, G=hg, W=w_dn, BITS=down.bits,
        S_BG=pow2(max(i_s, gs) // gs), BLOCK_N=bn, EVEN_N=d % bn == 0, ON_CPU=on_cpu, PDL=pdl,
        FINE=fine, num_warps=w_dn, **pdl_launch(pdl),
    )  # fmt: skip
    return out


def resident(t: torch.Tensor) -> float:
    """The median over SMs of the most programs an SM ran at once (entry to store)."""
    most = []
    for sm in t[:, STAMPS].unique():
        rows = t[t[:, STAMPS] == sm]
        # +1 at an entry, -1 at a store; a store before an entry at the same time first
        events = sorted([(int(s), 1) for s in rows[:, 0]] + [(int(e), -1) for e in rows[:, 4]])
        run = top = 0
        for _, step in events:
            run += step
            top = max(top, run)
        most.append(top)
    return float(statistics.median(most))


def analyse(prevs: list[torch.Tensor], curs: list[torch.Tensor], fine: bool) -> dict:
    """Per launch ``curs[j]`` against the launch before it, ``prevs[j]`` (us), medians: its
    span (first entry to last store), its exposed time (its last store after the launch
    before's), a program's time from entry to store, from entry to past its wait, past its
    wait to store, and with ``fine`` loading (past its wait to its tiles landed) and
    multiplying (landed to dot done); programs an SM ran at once; SMs used."""
    rows: dict[str, list[float]] = {}

    def add(key: str, v: float) -> None:
        rows.setdefault(key, []).append(v)

    def us(a: torch.Tensor) -> float:
        return float((a.double() / 1e3).median())

    for prev, cur in zip(prevs, curs, strict=True):
        prev, cur = prev.cpu(), cur.cpu()
        add("span", (int(cur[:, 4].max()) - int(cur[:, 0].min())) / 1e3)
        add("exposed", (int(cur[:, 4].max()) - int(prev[:, 4].max())) / 1e3)
        add("program", us(cur[:, 4] - cur[:, 0]))
        add("entry_to_wait", us(cur[:, 1] - cur[:, 0]))
        add("past_wait", us(cur[:, 4] - cur[:, 1]))
        if fine:
            add("loading", us(cur[:, 2] - cur[:, 1]))
            add("multiplying", us(cur[:, 3] - cur[:, 2]))
        add("resident", resident(cur))
        add("sms", float(cur[:, STAMPS].unique().numel()))
    return {k: round(statistics.median(v), 3) for k, v in rows.items()}


def layer_inputs(w: dict, b: int, gen: torch.Generator, device: str) -> dict:
    """The router launch's outputs for ``b`` rows, at random: k distinct experts a row and
    positive weights, x' (op, sums), logits, the shared expert's h, the residual."""
    e, i, d = w["gate"].qweight.shape[0], w["gate"].qweight.shape[1], w["down"].qweight.shape[1]
    gs, top_k = w["gate"].group_size, w["top_k"]
    i_s = w["shared_down"].qweight.shape[1] * 32 // w["shared_down"].bits
    g = pow2(d // gs)
    ids = torch.stack([torch.randperm(e, generator=gen)[:top_k] for _ in range(b)])
    wts = torch.rand(b, top_k, generator=gen) + 0.05
    x = torch.randn(b, g * gs, generator=gen)
    x[:, d:] = 0
    op = x.to(torch.bfloat16).reshape(b, g, gs)
    return {
        "ids": ids.to(torch.int32).to(device),
        "wts": (wts / wts.sum(1, keepdim=True)).to(device),
        "op": op.to(device),
        # (the group sums as row_prepped reads them: of x' as rounded)
        "sums": op.float().sum(2).to(device),
        "logits": torch.randn(b, cdiv(e + 1, 16) * 16, generator=gen).to(device),
        "h": torch.randn(b, top_k + 1, max(i, i_s), generator=gen).to(device),
        "res": torch.randn(b, d, generator=gen).to(torch.bfloat16).to(device),
    }


def main() -> None:
    from lily.bench.gpu.full_model import write_json
    from lily.bench.gpu.kernels.common import TOP_K, moe_weights
    from lily.model.ops import MOE_ROWS_CONFIGS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="8", help="batch sizes (entries of MOE_ROWS_CONFIGS)")
    ap.add_argument("--layers", type=int, default=8, help="layers in the chain")
    ap.add_argument("--out", help="JSON results path")
    args = ap.parse_args()
    traced = sorted(k for k, c in MOE_ROWS_CONFIGS.items() if c.down_early)
    for b in [int(v) for v in args.rows.split(",")]:
        if b not in traced:
            raise SystemExit(
                f"--rows {b}: the traced launches are the route_once, down_operand"
                f" and down_early form; MOE_ROWS_CONFIGS has it at {traced}"
            )
    gen = torch.Generator(device="cuda").manual_seed(0)
    cpu_gen = torch.Generator().manual_seed(0)
    ws = [{**moe_weights(gen), "top_k": TOP_K} for _ in range(args.layers)]
    results = []
    for b in [int(v) for v in args.rows.split(",")]:
        cfg = MOE_ROWS_CONFIGS[b]
        ins = [layer_inputs(w, b, cpu_gen, "cuda") for w in ws]
        gu_grid, dn_grid = grids(ws[0], b, cfg)
        t_gu = [torch.zeros(gu_grid[0] * b, STAMPS + 1, dtype=torch.int64, device="cuda")
                for _ in ws]  # fmt: skip
        t_dn = [torch.zeros(dn_grid[0] * b, STAMPS + 1, dtype=torch.int64, device="cuda")
                for _ in ws]  # fmt: skip
        for fine in (False, True):

            def chain(fine=fine, ins=ins, cfg=cfg, t_gu=t_gu, t_dn=t_dn):
                for w, x, tg, td in zip(ws, ins, t_gu, t_dn, strict=True):
                    traced_moe(w, x, cfg, tg, td, pdl=True, fine=fine)

            graph, _ = capture_graph(chain)
            for _ in range(5):
                graph.replay()
            torch.cuda.synchronize()
            # gate/up against the down before it (the layer before's), down against its
            # gate/up
            row = {"rows": b, "config": repr(cfg), "stamps": "fine" if fine else "coarse",
                   "layers": len(ws), "gate_up_programs": gu_grid[0] * b,
                   "down_programs": dn_grid[0] * b,
                   "gate_up": analyse(t_dn[:-1], t_gu[1:], fine),
                   "down": analyse(t_gu[1:], t_dn[1:], fine),
                   "graph_us_per_layer": round(replay_ms(graph, n=20) * 1e3 / len(ws),
                                               3)}  # fmt: skip
            results.append(row)
            print(row, flush=True)
    write_json(args.out, args, results=results)


if __name__ == "__main__":
    main()
