"""qgemv_mma's tensor-core tile for several rows of x: the MMA's columns hold one row each
(where the one-row GEMV broadcasts its row over all 8), so a weight tile read once serves up
to 16 rows. The weights' side is qgemv_mma's as it is (``mma_tile``, ``mma_codes``); what
is here builds the rows' operand and applies the groups' scales and biases per row. The
batched MoE decode (lily/ops/moe_decode_rows.py) multiplies with it.

Rows hold bf16-exact values (bf16 activations, or h rounded to bf16): one bf16 term a row.
"""

from __future__ import annotations

import triton
import triton.language as tl

from lily.ops.norm_rope import sigmoid
from lily.ops.qgemv_mma import as_term, mma_codes, mma_tile
from lily.ops.rmsnorm import norm_x


@triton.jit
def _first(a, b):
    return a


@triton.jit
def rows_x(p_x, stride_xt, p_nw, eps, m_r, BR: tl.constexpr, NG: tl.constexpr,
           G: tl.constexpr, GROUP: tl.constexpr, HAS_NORM: tl.constexpr,
           ON_CPU: tl.constexpr):  # fmt: skip
    """Rows of x (BR, G * GROUP) fp32 in memory order: the rows in ``m_r`` (the others 0),
    NG groups padded with zeros, each rmsnorm'ed (rounded to x's dtype, as ``rms_norm``
    returns it) with ``HAS_NORM``."""
    o_r = tl.arange(0, BR)
    o_k = tl.arange(0, G * GROUP)
    m_k = o_k < NG * GROUP
    b_x = tl.load(p_x + o_r[:, None] * stride_xt + o_k[None, :],
                  mask=m_r[:, None] & m_k[None, :], other=0.0)  # fmt: skip
    if HAS_NORM:
        b_nw = tl.load(p_nw + o_k, mask=m_k, other=0.0)
        b_xf = b_x.to(tl.float32)
        rstd = 1.0 / tl.sqrt_rn(tl.sum(b_xf * b_xf, axis=1) / (NG * GROUP) + eps)
        return norm_x(b_x, b_nw[None, :], rstd[:, None], True, ON_CPU)
    return b_x.to(tl.float32)


@triton.jit
def rows_operand(b_x, G: tl.constexpr, GROUP: tl.constexpr, W: tl.constexpr,
                 ON_CPU: tl.constexpr):  # fmt: skip
    """Rows (BR, G * GROUP) fp32 of bf16-exact values in memory order -> (the MMA's B
    operand (G, GROUP, BR): row r in column r, batches and K order as ``mma_x`` gives one
    row; the per-group sums (G, BR))."""
    BR: tl.constexpr = b_x.shape[0]
    WPL: tl.constexpr = GROUP // 32
    GH: tl.constexpr = G // W
    # group gw * GH + gh is batch gh * W + gw; inside a group the codes' K order (mma_x)
    b = tl.reshape(tl.permute(tl.reshape(b_x, (BR, W, GH, GROUP)), (0, 2, 1, 3)),
                   (BR * G, GROUP))  # fmt: skip
    b_xs = tl.reshape(tl.sum(b, axis=1), (BR, G))
    b = as_term(b, ON_CPU)  # (exact: the values are bf16's) half the registers to permute
    b = tl.reshape(tl.permute(tl.reshape(b, (BR * G, 4, WPL, 2, 2, 2)), (0, 2, 4, 1, 5, 3)),
                   (BR, G, GROUP))  # fmt: skip
    return tl.permute(b, (1, 2, 0)), tl.permute(b_xs, (1, 0))


@triton.jit
def rows_dot(b_w, b_s, b_b, b_xb, b_xs, pair_mask, G: tl.constexpr, BLOCK_N: tl.constexpr,
             ON_CPU: tl.constexpr):  # fmt: skip
    """fp32 (BLOCK_N, BR): the tile's rows (``mma_tile``) times each row of x
    (``rows_operand``): qgemv_mma's ``mma_dot`` with a row of x in each column."""
    GROUP: tl.constexpr = b_xb.shape[1]
    b_a = mma_codes(b_w, pair_mask, G, BLOCK_N, GROUP, ON_CPU)
    b_d = tl.dot(b_a, b_xb, input_precision="ieee")  # (G, BLOCK_N, BR) fp32
    # One scale and bias a (group, row): the load's lane axis c holds copies.
    b_s = tl.reduce(tl.reshape(tl.permute(b_s, (4, 2, 3, 1, 0)), (G, BLOCK_N, 4)), 2, _first)
    b_b = tl.reduce(tl.reshape(tl.permute(b_b, (4, 2, 3, 1, 0)), (G, BLOCK_N, 4)), 2, _first)
    b_s = b_s.to(tl.float32)
    b_b = b_b.to(tl.float32)
    b_t = b_s[:, :, None] * b_d + (b_b - 128.0 * b_s)[:, :, None] * b_xs[:, None, :]
    return tl.sum(b_t, axis=0)


@triton.jit
def gate_up_rows(p_gw, p_gs, p_gb, p_uw, p_us, p_ub, b_xb, b_xs, row0, N, stride_qn,
                 stride_sn, pair_mask, GROUP: tl.constexpr, NG: tl.constexpr, G: tl.constexpr,
                 BLOCK_N: tl.constexpr, W: tl.constexpr, EVEN_N: tl.constexpr,
                 ON_CPU: tl.constexpr):  # fmt: skip
    """``silu(x @ gate.T) * (x @ up.T)`` fp32 (BLOCK_N, BR) of rows row0.. of one expert."""
    g_w, g_s, g_b = mma_tile(p_gw, p_gs, p_gb, p_gw, row0, N, stride_qn, stride_sn, 0, 0,
                             GROUP, NG, G, BLOCK_N, W, 0, EVEN_N, NG == G)  # fmt: skip
    u_w, u_s, u_b = mma_tile(p_uw, p_us, p_ub, p_uw, row0, N, stride_qn, stride_sn, 0, 0,
                             GROUP, NG, G, BLOCK_N, W, 0, EVEN_N, NG == G)  # fmt: skip
    b_g = rows_dot(g_w, g_s, g_b, b_xb, b_xs, pair_mask, G, BLOCK_N, ON_CPU)
    b_u = rows_dot(u_w, u_s, u_b, b_xb, b_xs, pair_mask, G, BLOCK_N, ON_CPU)
    return b_g * sigmoid(b_g) * b_u
