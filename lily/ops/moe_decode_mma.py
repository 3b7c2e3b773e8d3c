"""Launches 2 and 3 of ``moe_decode`` with the routed experts on the tensor cores.

Both use qgemv_mma's tile (codes unpacked straight into MMA operands, see
lily/ops/qgemv_mma.py): ``_moe_gate_up_mma_kernel`` takes the top-k like the FMA kernel and
multiplies its slot's gate and up rows; ``_moe_down_mma_kernel`` takes the k chosen experts'
rows as one K of k * I (slot j = expert ids[j]). With ``MoeDecodeConfig.route_once`` the
gate/up programs read their expert and a prepared x' that the router launch wrote instead.
The FMA kernels in moe_decode.py spent
about 1.7x the instructions a code (compile-only sm_90 counts, docs/notes/decode_step.md)
and stay for 8-bit experts and unaligned rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lily.ops.launch import cdiv, launched, mask_lo, pdl_launch, pow2
from lily.ops.mma_rows import k_order, row_operand, row_prepped
from lily.ops.moe_decode_parts import (
    down_early,
    down_finish,
    row_pairs,
    row_ptrs,
    slot_expert,
)
from lily.ops.norm_rope import sigmoid
from lily.ops.qgemv import pdl_wait
from lily.ops.qgemv_mma import PAIR_MASK, X_TERMS, mma_dot, mma_tile, mma_x, mma_x_row
from lily.ops.rmsnorm import to_bf16
from lily.quant import QuantWeight


@triton.jit
def gate_up_tiles(
    p_gw, p_gs, p_gb, p_uw, p_us, p_ub, p_ids, e64, row0, N, stride_we, stride_se, stride_qn,
    stride_sn, GROUP: tl.constexpr, NG: tl.constexpr, G: tl.constexpr, BLOCK_N: tl.constexpr,
    W: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
):  # fmt: skip
    """Expert e64's gate and up tiles, rows row0.. of N (without EVEN_N, N = 0 masks every
    load: no bytes), as mma_tile loads them."""
    # NOTE: experts start on 16 bytes (checked by the launcher), so the words' vector loads
    # stay (see mma_tile)
    o_we = tl.multiple_of(e64 * stride_we, 4)
    o_se = e64 * stride_se
    g_w, g_s, g_b = mma_tile(
        p_gw + o_we, p_gs + o_se, p_gb + o_se, p_ids, row0, N, stride_qn, stride_sn, 0, 0,
        GROUP, NG, G, BLOCK_N, W, 0, EVEN_N, EVEN_K,
    )  # fmt: skip
    u_w, u_s, u_b = mma_tile(
        p_uw + o_we, p_us + o_se, p_ub + o_se, p_ids, row0, N, stride_qn, stride_sn, 0, 0,
        GROUP, NG, G, BLOCK_N, W, 0, EVEN_N, EVEN_K,
    )  # fmt: skip
    return g_w, g_s, g_b, u_w, u_s, u_b


@triton.jit
def store_h_op(p_hop, b_h, w, r, slot, o_n, I_E, HG: tl.constexpr, GROUP: tl.constexpr,
               ON_CPU: tl.constexpr):  # fmt: skip
    """down_operand: a gate/up tile's h (rows o_n of slot ``slot``'s expert, row r) times
    its routing weight w, rounded to bf16 (as moe_prefill stores it), into the down
    launch's operand: K = the k slots' I, in the codes' K order a group (prep_store's
    layout; the slots start on whole groups)."""
    b_h = to_bf16(b_h * w, ON_CPU)
    o_k = slot * I_E + o_n
    p_o = p_hop + r * (HG * GROUP) + (o_k // GROUP) * GROUP
    tl.store(p_o + k_order(o_k % GROUP, GROUP // 32), b_h, mask=o_n < I_E)


@launched
@triton.jit
def _moe_gate_up_mma_kernel(
    p_x, p_nw, p_logits, p_ids, p_wts, p_h, p_op, p_sum, p_hop, stride_xt, stride_lt,
    stride_hb, p_gw, p_gs, p_gb, p_uw, p_us, p_ub, stride_we, stride_se, stride_qn, stride_sn,
    E, I_E, stride_h, pair_mask, eps,
    TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr, GROUP: tl.constexpr,
    NG: tl.constexpr, G: tl.constexpr, BLOCK_N: tl.constexpr, W: tl.constexpr,
    N_BLOCKS: tl.constexpr, TERMS: tl.constexpr, HAS_NORM: tl.constexpr, ROUTED: tl.constexpr,
    H_OP: tl.constexpr, HG: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
    ON_CPU: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    # moe_decode._moe_gate_up_kernel on the tensor cores (qgemv_mma's tile): same routing
    # and output.
    pid = tl.program_id(0)
    slot = pid // N_BLOCKS
    row0 = (pid % N_BLOCKS) * BLOCK_N
    p_x, p_logits, p_h = row_ptrs(p_x, p_logits, p_h, stride_xt, stride_lt, stride_hb)
    p_ids, p_wts = row_pairs(p_ids, p_wts, TOP_K)
    if ROUTED:
        # route_once: the router launch wrote this row's experts and prepared x'
        pdl_wait(PDL)
        e64 = tl.load(p_ids + slot).to(tl.int64)
        r = tl.program_id(1)
        b_xb, b_xs = row_prepped(p_op + r * (G * GROUP), p_sum + r * G, G, GROUP, W, ON_CPU)
    else:
        # x and its MMA operand before the wait (x was written before the router kernel
        # ran: see moe_decode._moe_gate_up_kernel's note); the weights must wait for the
        # expert id.
        b_xn = mma_x_row(p_x, p_nw, eps, NG, G, GROUP, HAS_NORM, EVEN_K, ON_CPU)
        b_xb, b_xs = mma_x(b_xn, G, GROUP, W, TERMS, ON_CPU)
        pdl_wait(PDL)
        e64 = slot_expert(p_logits, p_ids, p_wts, E, slot, pid, TOP_K, BLOCK_K, BLOCK_E)
    g_w, g_s, g_b, u_w, u_s, u_b = gate_up_tiles(
        p_gw, p_gs, p_gb, p_uw, p_us, p_ub, p_ids, e64, row0, I_E, stride_we, stride_se,
        stride_qn, stride_sn, GROUP, NG, G, BLOCK_N, W, EVEN_N, EVEN_K,
    )  # fmt: skip
    b_g = mma_dot(g_w, g_s, g_b, b_xb, b_xs, pair_mask, G, BLOCK_N, W, TERMS, ON_CPU)
    b_u = mma_dot(u_w, u_s, u_b, b_xb, b_xs, pair_mask, G, BLOCK_N, W, TERMS, ON_CPU)
    o_n = row0 + tl.arange(0, BLOCK_N)
    b_h = b_g * sigmoid(b_g) * b_u
    if H_OP:
        store_h_op(p_hop, b_h, tl.load(p_wts + slot), tl.program_id(1), slot, o_n, I_E, HG,
                   GROUP, ON_CPU)  # fmt: skip
    else:
        tl.store(p_h + slot * stride_h + o_n, b_h, mask=o_n < I_E)


@launched
@triton.jit
def _moe_down_mma_kernel(
    p_h, p_ids, p_wts, p_logits, p_res, p_out, p_hop, stride_xt, stride_lt, stride_hb,
    p_dw, p_ds, p_db, stride_we, stride_se, stride_qn, stride_sn,
    p_sdw, p_sds, p_sdb, stride_sqn, stride_ssn,
    E, D, I_S, stride_h, pair_mask, mask_lo,
    TOP_K: tl.constexpr, GROUP: tl.constexpr, SG: tl.constexpr, G: tl.constexpr,
    W: tl.constexpr, BITS: tl.constexpr, S_BG: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_SHARED: tl.constexpr, HAS_RES: tl.constexpr, H_OP: tl.constexpr,
    EARLY_W: tl.constexpr, EVEN_N: tl.constexpr, ON_CPU: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    # moe_decode._moe_down_kernel with the routed experts on the tensor cores: the k chosen
    # experts' rows are one K of k * I (slot j = expert ids[j]; with 8 warps and k = 8 a
    # warp takes a slot), x is the slots' h rows times their routing weights. The shared
    # expert (loaded before the wait, as there) stays on the FMA path: its I_S may not fill
    # the warps.
    NG: tl.constexpr = TOP_K * SG
    i_n = tl.program_id(0)
    p_res, p_logits, p_h = row_ptrs(p_res, p_logits, p_h, stride_xt, stride_lt, stride_hb)
    p_out += tl.program_id(1) * stride_xt
    p_ids, p_wts = row_pairs(p_ids, p_wts, TOP_K)
    row0 = i_n * BLOCK_N
    o_n = row0 + tl.arange(0, BLOCK_N)
    m_n = o_n < D
    b_sw, b_ss, b_sb, b_hs, b_c, b_res = down_early(
        p_sdw, p_sds, p_sdb, stride_sqn, stride_ssn, p_h, stride_h, p_logits, p_res, o_n, m_n,
        E, I_S, TOP_K, BITS, GROUP, S_BG, HAS_SHARED, HAS_RES,
    )  # fmt: skip
    if EARLY_W:
        # down_early: the ids are the router launch's (two launches back, complete before
        # the gate/up launch let this one start), so the experts' tiles stream before the
        # wait, while gate/up's last programs run
        b_w, b_s, b_b = mma_tile(p_dw, p_ds, p_db, p_ids, row0, D, stride_qn, stride_sn,
                                 stride_we, stride_se, GROUP, NG, G, BLOCK_N, W, SG, EVEN_N,
                                 NG == G)  # fmt: skip
    pdl_wait(PDL)
    if not EARLY_W:
        b_w, b_s, b_b = mma_tile(p_dw, p_ds, p_db, p_ids, row0, D, stride_qn, stride_sn,
                                 stride_we, stride_se, GROUP, NG, G, BLOCK_N, W, SG, EVEN_N,
                                 NG == G)  # fmt: skip
    if H_OP:
        # down_operand: the gate/up launch wrote h, weighted and bf16, as this operand
        b_xb, b_xs = row_operand(p_hop + tl.program_id(1) * (G * GROUP), G, GROUP, NG, W,
                                 ON_CPU)  # fmt: skip
        acc = mma_dot(b_w, b_s, b_b, b_xb, b_xs, pair_mask, G, BLOCK_N, W, 1, ON_CPU)
    else:
        o_x = tl.arange(0, G * GROUP)
        m_x = o_x < NG * GROUP
        x_slot = o_x // (SG * GROUP)
        b_hx = tl.load(p_h + x_slot * stride_h + o_x % (SG * GROUP), mask=m_x, other=0.0)
        b_hx *= tl.load(p_wts + x_slot, mask=m_x, other=0.0)
        b_xb, b_xs = mma_x(b_hx, G, GROUP, W, 3, ON_CPU)  # h is fp32: three bf16 terms, exact
        acc = mma_dot(b_w, b_s, b_b, b_xb, b_xs, pair_mask, G, BLOCK_N, W, 3, ON_CPU)
    down_finish(acc, b_sw, b_ss, b_sb, b_hs, b_c, b_res, p_out, o_n, m_n, mask_lo, BITS, S_BG,
                 HAS_SHARED, HAS_RES, ON_CPU)  # fmt: skip


def mma_fits(w: QuantWeight) -> bool:
    """Experts (E, N, K) the tensor-core tile takes: 4 bits, rows on 16-byte boundaries and
    experts on whole groups of them (the words load four at a time straight into the MMA's
    registers; the kernels' alignment hints rely on both)."""
    q = w.qweight
    return (w.bits == 4 and q.stride(0) % max(4, w.group_size // 8) == 0
            and q.stride(1) % 4 == 0 and q.stride(2) == 1 and q.data_ptr() % 16 == 0)  # fmt: skip


def moe_mma_experts(
    x, nw, logits, ids, wts, h, res, out, gate, up, down, sd, e, d, i, i_s, top_k, eps, cfg,
    has_norm, has_shared, has_res, on_cpu, pdl, prepared=None,
) -> None:  # fmt: skip
    """Launches 2 and 3 of ``moe_decode`` on the tensor cores (arguments as checked there;
    x, logits, ids, wts, h, res and out with a leading row axis, grid axis 1). ``prepared``:
    route_once's (operand (B, G, GROUP) bf16, sums (B, G) fp32), ids and wts written by the
    router launch; None: the gate/up programs route and prepare x themselves. With it and
    ``cfg.down_operand`` the gate/up launch writes the down launch's operand."""
    gs = gate.group_size
    b = x.shape[0]
    rows = (x.stride(0), logits.stride(0), h.stride(0))
    bn = cfg.mma_rows
    # gate/up: K = D; one program a (slot, bn rows of I)
    ng = d // gs
    g = pow2(ng)
    w = min(cfg.mma_warps, g)
    nb = cdiv(i, bn)
    op, sums = prepared if prepared is not None else (h, h)  # (unused pointers)
    sg = i // gs
    hg = pow2(top_k * sg)  # the down launch's groups (K = the k slots' I)
    h_op = prepared is not None and cfg.down_operand
    # (B, HG groups, GROUP) bf16; groups past k * SG are never written (read as zeros)
    hop = torch.empty((b, hg, gs), dtype=torch.bfloat16, device=x.device) if h_op else h
    _moe_gate_up_mma_kernel[(top_k * nb, b)](
        x, nw, logits, ids, wts, h, op, sums, hop, *rows,
        gate.qweight, gate.scales, gate.biases, up.qweight, up.scales, up.biases,
        gate.qweight.stride(0), gate.scales.stride(0), gate.qweight.stride(1),
        gate.scales.stride(1), e, i, h.stride(1), PAIR_MASK, float(eps),
        TOP_K=top_k, BLOCK_K=pow2(top_k), BLOCK_E=pow2(e), GROUP=gs, NG=ng, G=g,
        BLOCK_N=bn, W=w, N_BLOCKS=nb, TERMS=X_TERMS[x.dtype], HAS_NORM=has_norm,
        ROUTED=prepared is not None, H_OP=h_op, HG=hg, EVEN_N=i % bn == 0,
        EVEN_K=g == ng, ON_CPU=on_cpu, PDL=pdl, num_warps=w, **pdl_launch(pdl),
    )  # fmt: skip
    # down: K = the k slots' I; one program a bn rows of D (its own tile where given)
    bn, w = cfg.mma_down_rows or bn, cfg.mma_down_warps or cfg.mma_warps
    w = min(w, hg)
    _moe_down_mma_kernel[(cdiv(d, bn), b)](
        h, ids, wts, logits, res, out, hop, *rows,
        down.qweight, down.scales, down.biases, down.qweight.stride(0), down.scales.stride(0),
        down.qweight.stride(1), down.scales.stride(1),
        sd.qweight, sd.scales, sd.biases, sd.qweight.stride(0), sd.scales.stride(0),
        e, d, i_s, h.stride(1), PAIR_MASK, mask_lo(down.bits),
        TOP_K=top_k, GROUP=gs, SG=sg, G=hg, W=w, BITS=down.bits,
        S_BG=pow2(max(i_s, gs) // gs), BLOCK_N=bn, HAS_SHARED=has_shared, HAS_RES=has_res,
        H_OP=h_op, EARLY_W=h_op and cfg.down_early, EVEN_N=d % bn == 0, ON_CPU=on_cpu,
        PDL=pdl, num_warps=w, **pdl_launch(pdl),
    )  # fmt: skip
