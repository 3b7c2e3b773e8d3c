"""moe_prefill's two grouped GEMMs with a tile's tokens as the MMA's columns (launches 4 and
5 of lily/ops/moe_prefill.py; its routing, plan and combine are unchanged).

Why: moe_prefill's GEMMs dequantize every code in fp32 (an FFMA and half an F2FP each) and
pass the bf16 weights through shared memory into the warpgroup MMA: about 6 instructions a
4-bit code in their K loop (compile-only sm_90 counts, docs/notes/linear_kernels.md,
"Fifteenth session"). A short chunk has few tokens an expert (8 at 256 tokens), so that
dequantization, not the MMA, is the work. Here the weights take qgemv_mma's tile
(``mma_tile``, ``mma_codes``: one LOP3 a pair of codes, straight into the MMA's A registers)
and each group's product is scaled in fp32 after the MMA (``rows_products``: the batched
decode's rows tile, with the tile's tokens as its columns), over a loop on K of GK groups a
step (one a warp). The products are exact: the codes are exact in bf16, the tokens' values
are bf16 (x, and h as moe_prefill stores it), the scales apply in fp32; moe_prefill's GEMMs
round each weight to bf16 first, so the two differ by that rounding.

Off by default (``COLS_MAX_BLOCK_M`` in lily/ops/moe_prefill.py): not yet measured on a GPU.
Only bf16 x, 4-bit experts whose rows start on 16 bytes (``mma_supports``), the shared
expert as wide as the routed ones.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lily.ops.launch import cdiv, launched
from lily.ops.mma_rows import rows_operand
from lily.ops.norm_rope import sigmoid
from lily.ops.qgemv_mma import PAIR_MASK, mma_codes, mma_supports, mma_tile
from lily.ops.rmsnorm import cast_to


@triton.jit
def tile_rows(p_tile_e, p_tile_row, p_tile_n, p_pairs, b, BLOCK_M: tl.constexpr):
    """(expert, first row, rows mask, pairs) of tile b of moe_prefill's block map."""
    e = tl.load(p_tile_e + b)
    row0 = tl.load(p_tile_row + b)
    m_m = tl.arange(0, BLOCK_M) < tl.load(p_tile_n + b)
    pairs = tl.load(p_pairs + row0 + tl.arange(0, BLOCK_M), mask=m_m, other=0)
    return e, row0, m_m, pairs


@triton.jit
def _first(a, b):
    return a


@triton.jit
def rows_products(b_w, b_s, b_b, b_xb, pair_mask, G: tl.constexpr, BLOCK_N: tl.constexpr,
                  ON_CPU: tl.constexpr):  # fmt: skip
    """Each group's product before its scale: (D (G, BLOCK_N, BR), scale s (G, BLOCK_N),
    c = bias - 128 s (G, BLOCK_N)), fp32; the tile's rows times x are the sum over groups of
    ``s D + c (the group's sum of x)``.

    NOTE: the first half of lily/ops/mma_rows.py's ``rows_dot``, kept apart: built on it, the
    batched decode's kernels compiled to other registers (1-27 a thread, compile matrix),
    and they stay as the H200 measured them until it has timed both forms."""
    GROUP: tl.constexpr = b_xb.shape[1]
    b_a = mma_codes(b_w, pair_mask, G, BLOCK_N, GROUP, ON_CPU)
    b_d = tl.dot(b_a, b_xb, input_precision="ieee")  # (G, BLOCK_N, BR) fp32
    # One scale and bias a (group, row): the load's lane axis c holds copies.
    b_s = tl.reduce(tl.reshape(tl.permute(b_s, (4, 2, 3, 1, 0)), (G, BLOCK_N, 4)), 2, _first)
    b_b = tl.reduce(tl.reshape(tl.permute(b_b, (4, 2, 3, 1, 0)), (G, BLOCK_N, 4)), 2, _first)
    b_s = b_s.to(tl.float32)
    return b_d, b_s, b_b.to(tl.float32) - 128.0 * b_s


@triton.jit
def cols_acc(acc, p_qw, p_s, p_b, stride_qn, stride_sn, row0, N, b_x, step, pair_mask,
             GK: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, W: tl.constexpr,
             EVEN_N: tl.constexpr, ON_CPU: tl.constexpr):  # fmt: skip
    """``acc`` (GK, BLOCK_N, BLOCK_M) fp32 plus K step ``step`` (groups step * GK..) of rows
    row0.. (BLOCK_N of N) times the columns b_x (BLOCK_M, GK * GROUP) fp32 of bf16 values,
    a group's product a batch (summed over the batches once, after the loop)."""
    WPG: tl.constexpr = GROUP // 8  # words a group
    # NOTE: the step's first word is a multiple of WPG words from a row's start (rows start
    # on 16 bytes): mma_tile's vector loads stay.
    b_w, b_s, b_b = mma_tile(p_qw + step * (GK * WPG), p_s + step * GK, p_b + step * GK, p_qw,
                             row0, N, stride_qn, stride_sn, 0, 0, GROUP, GK, GK, BLOCK_N, W, 0,
                             EVEN_N, True)  # fmt: skip
    b_xb, b_xs = rows_operand(b_x, GK, GROUP, W, ON_CPU)
    b_d, b_s, b_c = rows_products(b_w, b_s, b_b, b_xb, pair_mask, GK, BLOCK_N, ON_CPU)
    # two FFMAs an element (acc + s D + c xs as one expression took an FMUL, FFMA and FADD)
    acc = acc + b_s[:, :, None] * b_d
    return acc + b_c[:, :, None] * b_xs[:, None, :]


@triton.jit
def _cols(p_x, rows, m_m, stride, k0, GK: tl.constexpr, GROUP: tl.constexpr):
    """Rows ``rows`` (BLOCK_M,) int64 of p_x (the masked ones 0), columns k0.. of a K step:
    fp32 (BLOCK_M, GK * GROUP)."""
    o_k = k0 + tl.arange(0, GK * GROUP)
    b_x = tl.load(p_x + rows[:, None] * stride + o_k[None, :], mask=m_m[:, None], other=0.0)
    return b_x.to(tl.float32)


@launched
@triton.jit
def _moe_gate_up_cols_kernel(
    p_x, p_pairs, p_tile_e, p_tile_row, p_tile_n, p_h,
    p_gw, p_gs, p_gb, p_uw, p_us, p_ub, stride_we, stride_se, stride_qn, stride_sn,
    p_sgw, p_sgs, p_sgb, p_suw, p_sus, p_sub, stride_sqn, stride_ssn,
    E, I_E, I_S, stride_xt, stride_h, pair_mask,
    TOP_K: tl.constexpr, GROUP: tl.constexpr, GK: tl.constexpr, K_STEPS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, W: tl.constexpr, N_BLOCKS: tl.constexpr,
    EVEN_N: tl.constexpr, ON_CPU: tl.constexpr,
):  # fmt: skip
    # moe_prefill._moe_gate_up_kernel's grid and output: h (rows, I) bf16 in expert order
    pid = tl.program_id(0)
    b = pid // N_BLOCKS
    row0 = (pid % N_BLOCKS) * BLOCK_N
    e, t_row, m_m, pairs = tile_rows(p_tile_e, p_tile_row, p_tile_n, p_pairs, b, BLOCK_M)
    is_shared = e == E
    n_rows = tl.where(is_shared, I_S, I_E)
    if (e >= 0) & (row0 < n_rows):
        if is_shared:
            gw, gs, gb, uw, us, ub = p_sgw, p_sgs, p_sgb, p_suw, p_sus, p_sub
            sqn = stride_sqn
            ssn = stride_ssn
        else:
            e64 = e.to(tl.int64)
            # NOTE: experts start on 16 bytes (checked by the launcher)
            o_we = tl.multiple_of(e64 * stride_we, 4)
            gw = p_gw + o_we
            gs = p_gs + e64 * stride_se
            gb = p_gb + e64 * stride_se
            uw = p_uw + o_we
            us = p_us + e64 * stride_se
            ub = p_ub + e64 * stride_se
            sqn = stride_qn
            ssn = stride_sn
        tok = (pairs // (TOP_K + 1)).to(tl.int64)
        acc_g = tl.zeros((GK, BLOCK_N, BLOCK_M), tl.float32)
        acc_u = tl.zeros((GK, BLOCK_N, BLOCK_M), tl.float32)
        for step in range(K_STEPS):
            b_x = _cols(p_x, tok, m_m, stride_xt, step * (GK * GROUP), GK, GROUP)
            acc_g = cols_acc(acc_g, gw, gs, gb, sqn, ssn, row0, n_rows, b_x, step, pair_mask,
                             GK, GROUP, BLOCK_N, W, EVEN_N, ON_CPU)  # fmt: skip
            acc_u = cols_acc(acc_u, uw, us, ub, sqn, ssn, row0, n_rows, b_x, step, pair_mask,
                             GK, GROUP, BLOCK_N, W, EVEN_N, ON_CPU)  # fmt: skip
        b_g = tl.sum(acc_g, axis=0)
        b_u = tl.sum(acc_u, axis=0)
        b_h = b_g * sigmoid(b_g) * b_u  # (BLOCK_N, BLOCK_M)
        o_n = row0 + tl.arange(0, BLOCK_N)
        o_r = (t_row + tl.arange(0, BLOCK_M)).to(tl.int64)
        p_hb = p_h + o_r[None, :] * stride_h + o_n[:, None]
        b_h = cast_to(b_h, p_h.dtype.element_ty, ON_CPU)  # (rounded as on the GPU)
        tl.store(p_hb, b_h, mask=(o_n < n_rows)[:, None] & m_m[None, :])


@launched
@triton.jit
def _moe_down_cols_kernel(
    p_h, p_pairs, p_tile_e, p_tile_row, p_tile_n, p_wts, p_y,
    p_dw, p_ds, p_db, stride_we, stride_se, stride_qn, stride_sn,
    p_sdw, p_sds, p_sdb, stride_sqn, stride_ssn,
    E, D, stride_h, stride_y, pair_mask,
    GROUP: tl.constexpr, GK: tl.constexpr, K_STEPS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, W: tl.constexpr, N_BLOCKS: tl.constexpr, EVEN_N: tl.constexpr,
    ON_CPU: tl.constexpr,
):  # fmt: skip
    # moe_prefill._moe_down_kernel's grid and output (not its atomic form): each row times
    # its routing weight, written to its (token, slot) place of y (T * (k+1), D) bf16
    pid = tl.program_id(0)
    b = pid // N_BLOCKS
    row0 = (pid % N_BLOCKS) * BLOCK_N
    e, t_row, m_m, pairs = tile_rows(p_tile_e, p_tile_row, p_tile_n, p_pairs, b, BLOCK_M)
    if e >= 0:
        if e == E:
            dw, ds, db = p_sdw, p_sds, p_sdb
            sqn = stride_sqn
            ssn = stride_ssn
        else:
            e64 = e.to(tl.int64)
            dw = p_dw + tl.multiple_of(e64 * stride_we, 4)
            ds = p_ds + e64 * stride_se
            db = p_db + e64 * stride_se
            sqn = stride_qn
            ssn = stride_sn
        o_r = (t_row + tl.arange(0, BLOCK_M)).to(tl.int64)
        acc = tl.zeros((GK, BLOCK_N, BLOCK_M), tl.float32)
        for step in range(K_STEPS):
            b_x = _cols(p_h, o_r, m_m, stride_h, step * (GK * GROUP), GK, GROUP)
            acc = cols_acc(acc, dw, ds, db, sqn, ssn, row0, D, b_x, step, pair_mask, GK, GROUP,
                           BLOCK_N, W, EVEN_N, ON_CPU)  # fmt: skip
        b_r = tl.load(p_wts + pairs, mask=m_m, other=0.0)
        b_o = tl.sum(acc, axis=0) * b_r[None, :]
        o_n = row0 + tl.arange(0, BLOCK_N)
        p_o = p_y + pairs.to(tl.int64)[None, :] * stride_y + o_n[:, None]
        b_o = cast_to(b_o, p_y.dtype.element_ty, ON_CPU)
        tl.store(p_o, b_o, mask=(o_n < D)[:, None] & m_m[None, :])


def cols_steps(groups: int) -> tuple[int, int]:
    """(GK groups a K step, one a warp; the steps) for a K of ``groups`` groups: the largest
    power of two up to 4 that divides it (mma_tile's warps split a step's groups)."""
    gk = 4
    while groups % gk:
        gk //= 2
    return gk, groups // gk


def gate_up_weights(gate, up, sg, su) -> tuple:
    """The gate/up launches' weight arguments (moe_prefill's and this tile's): the routed
    experts' words, scales and biases with their expert and row strides, then the shared
    expert's (or any one expert's where there is none) with its row strides."""
    return (gate.qweight, gate.scales, gate.biases, up.qweight, up.scales, up.biases,
            gate.qweight.stride(0), gate.scales.stride(0), gate.qweight.stride(1),
            gate.scales.stride(1), sg.qweight, sg.scales, sg.biases, su.qweight, su.scales,
            su.biases, sg.qweight.stride(0), sg.scales.stride(0))  # fmt: skip


def down_weights(down, sd) -> tuple:
    """The down launches' weight arguments, as ``gate_up_weights``."""
    return (down.qweight, down.scales, down.biases, down.qweight.stride(0),
            down.scales.stride(0), down.qweight.stride(1), down.scales.stride(1), sd.qweight,
            sd.scales, sd.biases, sd.qweight.stride(0), sd.scales.stride(0))  # fmt: skip


# The token tile this form is for: moe_prefill's table gives 16 rows under 768 tokens, and
# at 64 rows this tile spills (see moe_gemms_cols); COLS_MAX_BLOCK_M switched on is this.
COLS_TILE = 16


def moe_gemms_cols(x, pairs, tile_e, tile_row, tile_n, wts, h, y, gate, up, down, sg, su, sd,
                   e: int, i: int, d: int, top_k: int, block_m: int,
                   block_n: int = 64) -> None:  # fmt: skip
    """Launches 4 and 5 of moe_prefill (gate/up into h, down into y) on the column tile,
    with moe_prefill's block map (``block_m`` tokens a tile) and buffers; the checks are
    the caller's (``cols_supported``).

    ``block_n`` weight rows a program: compile-only sm_90 counts at the full model's shapes
    and 16-token tiles, instructions a 4-bit code in the K loop, gate/up / down: 64 rows
    3.35 / 4.2 (247 / 168 registers, no spills), 32 rows 4.26 / 5.7; moe_prefill's GEMMs
    6.0 / 7.0. A 64-token tile spills (560-8,600 bytes): 16 tokens is what this tile is for."""
    group = gate.group_size
    on_cpu = x.device.type == "cpu"
    max_tiles = tile_e.shape[0]
    gk, steps = cols_steps(d // group)
    nb = cdiv(i, block_n)
    _moe_gate_up_cols_kernel[(max_tiles * nb,)](
        x, pairs, tile_e, tile_row, tile_n, h, *gate_up_weights(gate, up, sg, su),
        e, i, i, x.stride(0), h.stride(0), PAIR_MASK,
        TOP_K=top_k, GROUP=group, GK=gk, K_STEPS=steps, BLOCK_M=block_m, BLOCK_N=block_n,
        W=gk, N_BLOCKS=nb, EVEN_N=i % block_n == 0, ON_CPU=on_cpu, num_warps=gk,
    )  # fmt: skip
    gk, steps = cols_steps(i // group)
    nb = cdiv(d, block_n)
    _moe_down_cols_kernel[(max_tiles * nb,)](
        h, pairs, tile_e, tile_row, tile_n, wts, y, *down_weights(down, sd),
        e, d, h.stride(0), y.stride(0), PAIR_MASK,
        GROUP=group, GK=gk, K_STEPS=steps, BLOCK_M=block_m, BLOCK_N=block_n, W=gk,
        N_BLOCKS=nb, EVEN_N=d % block_n == 0, ON_CPU=on_cpu, num_warps=gk,
    )  # fmt: skip


def cols_supported(x, experts: tuple, i: int, i_s: int) -> bool:
    """Whether the column tile takes this MoE: bf16 x (one bf16 term a column), 4-bit
    experts (and shared expert, as wide as a routed one) whose rows start on 16 bytes."""
    fits = (w.bits == 4 and w.group_size >= 32 and mma_supports(w) for w in experts)
    return x.dtype == torch.bfloat16 and i_s == i and all(fits)
