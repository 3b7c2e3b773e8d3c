"""qgemv_mma's tensor-core tile for several rows of x: the MMA's columns hold one row each
(where the one-row GEMV broadcasts its row over all 8), so a weight tile read once serves up
to 16 rows. The weights' side is qgemv_mma's as it is (``mma_tile``, ``mma_codes``); what
is here builds the rows' operand and applies the groups' scales and biases per row. The
batched MoE decode (lily/ops/moe_decode_rows.py) multiplies with it.

Rows hold bf16-exact values (bf16 activations, or h rounded to bf16): one bf16 term a row.

Fewer rows than columns (B = 2 or 4 of 8): the operand can be built for pow2(B) rows and
broadcast over the columns (``to_columns``), as the one-row GEMV broadcasts its row; the
work before the MMA then scales with the rows, not the columns. A prepared operand
(``rows_prep``, its own launch) holds the rows normed, rounded and in the codes' K order
with their group sums, so each program of the GEMV only loads it (``rows_prepped``) where it
would otherwise norm and permute every row itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from lily.ops.launch import launched, pdl_launch, pow2, use_pdl
from lily.ops.norm_rope import sigmoid
from lily.ops.qgemv import pdl_wait
from lily.ops.qgemv_mma import as_term, mma_codes, mma_tile, mma_x_row
from lily.ops.rmsnorm import check_norm, norm_x

Tensor = torch.Tensor


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
def to_columns(b_xb, b_xs, NC: tl.constexpr):
    """``rows_operand``'s (G, GROUP, XR) operand and (G, XR) sums over NC >= XR columns:
    column c holds row c % XR (the rows repeated, as qgemv_mma repeats its one row)."""
    G: tl.constexpr = b_xb.shape[0]
    GROUP: tl.constexpr = b_xb.shape[1]
    XR: tl.constexpr = b_xb.shape[2]
    if XR == NC:
        return b_xb, b_xs
    b_xb = tl.reshape(tl.broadcast_to(b_xb[:, :, None, :], (G, GROUP, NC // XR, XR)),
                      (G, GROUP, NC))  # fmt: skip
    b_xs = tl.reshape(tl.broadcast_to(b_xs[:, None, :], (G, NC // XR, XR)), (G, NC))
    return b_xb, b_xs


@triton.jit
def k_order(j, WPL: tl.constexpr):
    """A code's place in the MMA's K order (``mma_x``) from its place j in its group's
    memory order: code 8 (WPL c + v) + 4 e + 2 m1 + m0 is k = 16 (2 v + m1) + 4 c + 2 m0 + e."""
    c = j // (8 * WPL)
    v = (j // 8) % WPL
    return 32 * v + 16 * ((j // 2) % 2) + 4 * c + 2 * (j % 2) + (j // 4) % 2


@triton.jit
def batch_groups(G: tl.constexpr, W: tl.constexpr):
    """The group each MMA batch holds (G,): batch gh * W + gw holds group gw * GH + gh (a
    warp's groups are contiguous; ``mma_tile``)."""
    o_b = tl.arange(0, G)
    return (o_b % W) * (G // W) + o_b // W


@triton.jit
def rows_prepped(p_op, p_sum, G: tl.constexpr, GROUP: tl.constexpr, XR: tl.constexpr,
                 W: tl.constexpr, NC: tl.constexpr, ON_CPU: tl.constexpr):  # fmt: skip
    """A prepared operand (``_rows_prep_kernel``: (G, GROUP, XR) bf16 in the codes' K order
    a group, sums (G, XR) fp32) as ``rows_operand`` and ``to_columns`` give it: batch
    gh * W + gw holds group gw * GH + gh."""
    g = batch_groups(G, W)
    o_f = tl.arange(0, GROUP * XR)
    b_xb = tl.reshape(tl.load(p_op + g[:, None] * (GROUP * XR) + o_f[None, :]), (G, GROUP, XR))
    if ON_CPU:
        b_xb = b_xb.to(tl.float32)  # (the interpreter's dot multiplies bf16 as integers)
    b_xs = tl.load(p_sum + g[:, None] * XR + tl.arange(0, XR)[None, :])
    return to_columns(b_xb, b_xs, NC)


@triton.jit
def row_prepped(p_op, p_sum, G: tl.constexpr, GROUP: tl.constexpr, W: tl.constexpr,
                ON_CPU: tl.constexpr):  # fmt: skip
    """One prepared row (XR = 1) as qgemv_mma's ``mma_x`` gives one bf16 row: the operand
    over the MMA's 8 columns (G, GROUP, 8) and the group sums (G,)."""
    b_xb, b_xs = rows_prepped(p_op, p_sum, G, GROUP, 1, W, 1, ON_CPU)
    return tl.broadcast_to(b_xb, (G, GROUP, 8)), tl.reshape(b_xs, (G,))


@triton.jit
def row_operand(p_op, G: tl.constexpr, GROUP: tl.constexpr, NG, W: tl.constexpr,
                ON_CPU: tl.constexpr):  # fmt: skip
    """One row stored by ``prep_store``'s layout without its sums (G, GROUP) bf16, groups
    past NG read as zeros, as ``mma_x`` gives one bf16 row: the operand over the MMA's 8
    columns (G, GROUP, 8) and the group sums (G,), summed here."""
    g = batch_groups(G, W)
    o_f = tl.arange(0, GROUP)
    b_x = tl.load(p_op + g[:, None] * GROUP + o_f[None, :], mask=(g < NG)[:, None], other=0.0)
    b_xs = tl.sum(b_x.to(tl.float32), axis=1)
    if ON_CPU:
        b_x = b_x.to(tl.float32)  # (the interpreter's dot multiplies bf16 as integers)
    return tl.broadcast_to(b_x[:, :, None], (G, GROUP, 8)), b_xs


@triton.jit
def prep_store(b_xn, p_op, p_sum, r, XR: tl.constexpr, GROUP: tl.constexpr, G: tl.constexpr):
    """Row r of a prepared operand of XR rows from the row (G * GROUP,) fp32 of bf16-exact
    values in memory order: its group sums, its values scattered into the K order."""
    o_k = tl.arange(0, G * GROUP)
    o_g = tl.arange(0, G)
    tl.store(p_sum + o_g * XR + r, tl.sum(tl.reshape(b_xn, (G, GROUP)), axis=1))
    kk = k_order(o_k % GROUP, GROUP // 32)
    tl.store(p_op + ((o_k // GROUP) * GROUP + kk) * XR + r, b_xn.to(p_op.dtype.element_ty))


@launched
@triton.jit(do_not_specialize=["B"])
def _rows_prep_kernel(p_x, p_nw, p_op, p_sum, B, stride_xt, eps, XR: tl.constexpr,
                      GROUP: tl.constexpr, NG: tl.constexpr, G: tl.constexpr,
                      HAS_NORM: tl.constexpr, ON_CPU: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    # Program r: row r normed and rounded as rows_x makes it, its group sums, its values
    # scattered into the K order (rows past B and groups past NG: zeros).
    r = tl.program_id(0)
    pdl_wait(PDL)
    # (a padding row reads row B - 1 and is zeroed: no NaN of a real row reaches it)
    b_xn = mma_x_row(p_x + tl.minimum(r, B - 1) * stride_xt, p_nw, eps, NG, G, GROUP,
                     HAS_NORM, NG == G, ON_CPU)  # fmt: skip
    b_xn = tl.where(r < B, b_xn, 0.0)
    prep_store(b_xn, p_op, p_sum, r, XR, GROUP, G)


@dataclass(frozen=True)
class RowsOperand:
    """B rows of x prepared for the rows GEMV (``rows_prep``): ``op`` (G, GROUP, XR) bf16
    in the codes' K order, ``sums`` (G, XR) fp32, for K = ``k`` (G groups, pow2 of K's)."""

    op: Tensor
    sums: Tensor
    rows: int
    k: int

    @property
    def group(self) -> int:
        return self.op.shape[1]

    @property
    def device(self) -> torch.device:
        return self.op.device

    def __len__(self) -> int:  # the rows, as len() of the (B, K) rows it was made from
        return self.rows


def rows_prep(x: Tensor, group: int, norm_weight: Tensor | None = None, eps: float = 1e-6,
              pdl: bool = False) -> RowsOperand:  # fmt: skip
    """x (B, K) bf16 (normed by ``norm_weight`` (K,) per row when given, rounded to bf16 as
    ``rms_norm`` returns it) as a RowsOperand for groups of ``group``: one launch of pow2(B)
    programs."""
    name = "rows_prep"
    if x.dtype != torch.bfloat16 or x.dim() != 2:
        raise ValueError(f"{name}: x must be (B, K) bf16, got {tuple(x.shape)} {x.dtype}")
    b, k = x.shape
    if not 1 <= b <= 16:
        raise ValueError(f"{name}: x must have 1 to 16 rows (the MMA's columns), got {b}")
    if group not in (32, 64, 128) or k % group:
        raise ValueError(f"{name}: K = {k} is not whole groups of 32, 64 or 128 (got {group})")
    x = x if x.stride(1) == 1 else x.contiguous()
    if norm_weight is not None:
        norm_weight = check_norm(norm_weight, k, name, x.device)
    ng = k // group
    g = pow2(ng)
    xr = pow2(b)
    op = torch.empty((g, group, xr), dtype=torch.bfloat16, device=x.device)
    sums = torch.empty((g, xr), dtype=torch.float32, device=x.device)
    pdl = use_pdl(pdl, x.device)
    _rows_prep_kernel[(xr,)](
        x, norm_weight if norm_weight is not None else x, op, sums, b, x.stride(0), float(eps),
        XR=xr, GROUP=group, NG=ng, G=g, HAS_NORM=norm_weight is not None,
        ON_CPU=x.device.type == "cpu", PDL=pdl, num_warps=4, **pdl_launch(pdl),
    )  # fmt: skip
    return RowsOperand(op, sums, b, k)


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
