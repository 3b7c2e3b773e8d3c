"""Tensor-core GEMV for a batched decode step: ``x @ w.T`` for B = 1..16 rows of x against
MLX-packed 4-bit weights, the weight tile read once for all the rows.

qgemv_mma broadcasts its one row over the MMA's 8 columns; here column r holds row r
(``mma_rows``: BR = 8 columns for B <= 8, 16 above; rows past B enter as zeros and are not
stored), so B rows cost about what one row costs while the weights dominate the bytes. The
weights' side is qgemv_mma's as it is (``mma_tile``: loads, ``mma_codes``: one LOP3 a pair
of codes); per group ``D = sum_k (128 + q_k) x_k`` on the tensor cores and
``s * D + (b - 128 s) * sum_k x_k`` in fp32, one scale and bias a (group, row).

Grid: one program per BLOCK_N rows of w, whole K a program (its W warps split the K groups,
as in qgemv_mma); each program re-reads the B rows of x (from L2), which the tile table
keeps below its weight tile's bytes where the grid stays at least a wave. PDL as in
qgemv_mma: the weights are loaded before ``pdl_wait``, x, the norm statistics and the
residual after it. The norm prologue (``norm_weight``) rounds the normed rows to bf16 as the
unfused ``rms_norm`` returns them.

Only bf16 x (a row's values enter the MMA as one bf16 term) and 4-bit weights on 16-byte
rows (``mma_supports``); everything else is qgemv's or qgemm's.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from lily.ops.launch import cdiv, check_weight, check_x, launched, pdl_launch, pow2, use_pdl
from lily.ops.mma_rows import (
    RowsOperand,
    rows_dot,
    rows_operand,
    rows_prepped,
    rows_x,
    to_columns,
)
from lily.ops.qgemv import pdl_wait
from lily.ops.qgemv_mma import PAIR_MASK, MmaGemvConfig, mma_gemv_config, mma_supports, mma_tile
from lily.ops.rmsnorm import cast_to, check_norm
from lily.quant import QuantWeight

Tensor = torch.Tensor

MAX_ROWS = 16  # rows one call takes (the MMA's columns: 8 or 16)
# The operand built on pow2(B) rows by default (else on all the MMA's columns, as through
# the seventh session). Compile-only (sm_90) a program's instructions fall 2,994 -> 1,710 at
# 2 rows; measured (H100, ninth session, bench/results/gemv_rows_h100_s9.json, us): attention
# q|k|v 12.6 -> 6.8 at 2 rows and 12.5 -> 9.8 at 4, the DeltaNet projection 13.6 -> 11.7 at
# 4, o_proj 5.8 -> 4.5 at 2; at 5 rows and more pow2(B) is the 8 columns (no change).
OPERAND_POW2 = True
_SMS = 132  # H200; only the tile table uses it
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@launched
@triton.jit(do_not_specialize=["B"])
def _qgemv_mma_rows_kernel(
    p_x, p_qw, p_s, p_b, p_nw, p_res, p_out, p_op, p_sum, B, N, stride_xt, stride_rt,
    stride_ot, stride_qn, stride_sn, pair_mask, eps,
    BR: tl.constexpr, XR: tl.constexpr, GROUP: tl.constexpr, NG: tl.constexpr,
    G: tl.constexpr, BLOCK_N: tl.constexpr, W: tl.constexpr, HAS_NORM: tl.constexpr,
    HAS_RES: tl.constexpr, PREP: tl.constexpr, EVEN_N: tl.constexpr, ON_CPU: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    i_n = tl.program_id(0)
    row0 = i_n * BLOCK_N
    b_w, b_s, b_b = mma_tile(p_qw, p_s, p_b, p_qw, row0, N, stride_qn, stride_sn, 0, 0,
                             GROUP, NG, G, BLOCK_N, W, 0, EVEN_N, NG == G)  # fmt: skip
    # Everything above reads only constants; x and the residual may be the previous kernel's.
    pdl_wait(PDL)
    if PREP:
        b_xb, b_xs = rows_prepped(p_op, p_sum, G, GROUP, XR, W, BR, ON_CPU)
    else:
        b_x = rows_x(p_x, stride_xt, p_nw, eps, tl.arange(0, XR) < B, XR, NG, G, GROUP,
                     HAS_NORM, ON_CPU)  # fmt: skip
        b_xb, b_xs = rows_operand(b_x, G, GROUP, W, ON_CPU)
        b_xb, b_xs = to_columns(b_xb, b_xs, BR)
    acc = rows_dot(b_w, b_s, b_b, b_xb, b_xs, pair_mask, G, BLOCK_N, ON_CPU)  # (BLOCK_N, BR)
    o_r = tl.arange(0, BR)
    o_n = row0 + tl.arange(0, BLOCK_N)
    m_o = (o_n < N)[:, None] & (o_r < B)[None, :]  # (column c < B holds row c)
    if HAS_RES:
        acc += tl.load(p_res + o_r[None, :] * stride_rt + o_n[:, None], mask=m_o,
                       other=0.0).to(tl.float32)  # fmt: skip
    tl.store(p_out + o_r[None, :] * stride_ot + o_n[:, None],
             cast_to(acc, p_out.dtype.element_ty, ON_CPU), mask=m_o)  # fmt: skip


# Measured tiles, ahead of the rule in mma_rows_config: (N, K, group size) -> {B: tile},
# the entry of the largest B key <= B (none: the rule). A measured change is one entry;
# `lily bench --run kernels.gemv_rows -- --variants` prints each shape's and B's fastest
# tile as one. Measured on the H200 on 2026-12-02 (bench/results/gemv_rows_sweep_h200_s6.json,
# us at B = 2 / 8 / 16, the rule's tile in brackets): o_proj 5.65 / 5.81 / 7.89 (6.84 /
# 7.12 / 11.04); attention q|k|v 12.7 / 13.3 (15.6 / 15.6), the rule's n64 w8 kept at 16;
# DeltaNet qkv|z|b|a 13.3 / 13.9 (17.0 / 16.5), likewise; lm_head 168 / 173 / 270 (266 /
# 238 / 428). Fewer warps a tile won at every shape: the B columns already give each warp
# its MMA's N. From 9 rows (16 columns) the compile matrix finds n32 w4 spilling 1.2 KB a
# thread where the input norm is fused (lm_head's 270 us at 16 rows ran on the H200, whose
# own check let it through), so those shapes keep the rule's n64 w8 from 9 rows.
MEASURED_TILES: dict[tuple[int, int, int], dict[int, MmaGemvConfig]] = {
    (2048, 4096, 64): {2: MmaGemvConfig(16, 8)},
    (9216, 2048, 64): {2: MmaGemvConfig(32, 4), 9: MmaGemvConfig(64, 8)},
    (12352, 2048, 64): {2: MmaGemvConfig(32, 4), 9: MmaGemvConfig(64, 8)},
    (248320, 2048, 64): {2: MmaGemvConfig(32, 4), 9: MmaGemvConfig(64, 8)},
}  # fmt: skip


@functools.lru_cache(maxsize=1024)  # tiles are pure functions of the shape
def mma_rows_config(n: int, k: int, group_size: int, b: int) -> MmaGemvConfig:
    """Tile for B rows of a shape: MEASURED_TILES' where it has the shape, else the rule
    below, NOT YET MEASURED: a first guess for the H200 to check
    (lily/bench/gpu/kernels/gemv_rows.py times it).

    qgemv_mma's tile (``mma_gemv_config``: BLOCK_N and warps), without its register cap (the
    rows' operand takes registers the one-row cap of 80 does not leave), and BLOCK_N doubled
    (up to 64) while a program's re-read of the B rows of x from L2 (B * K * 2 bytes) is not
    below its weight tile's (BLOCK_N * K / 2 bytes of codes, i.e. while BLOCK_N <= 4 B),
    as long as the grid keeps at least one program an SM.

    Compiled for sm_90 (ptxas, K = 2048, norm, PDL; not timed): 8 columns, 64 rows 208
    registers (4.7 SASS instructions a code), 32 rows 176 (6.6); 16 columns, 64 rows 255
    and 136 bytes spilled (7.8), 32 rows 232 (11.2), 16 rows 204 (18.9): the rows' operand
    (BR x K fp32 before its bf16 permute) takes most of the registers, one program an SM."""
    measured = MEASURED_TILES.get((n, k, group_size), {})
    keys = [r for r in measured if r <= b]
    if keys:
        return measured[max(keys)]
    base = mma_gemv_config(n, k, group_size)
    bn = base.block_n
    while bn < 64 and bn <= 4 * b and cdiv(n, 2 * bn) >= _SMS:
        bn *= 2
    return MmaGemvConfig(bn, base.num_warps)


def qgemv_mma_rows(
    x: Tensor | RowsOperand,
    w: QuantWeight,
    residual: Tensor | None = None,
    *,
    out_dtype: torch.dtype | None = None,
    norm_weight: Tensor | None = None,
    eps: float = 1e-6,
    config: MmaGemvConfig | None = None,
    pdl: bool = False,
    operand_rows: int | None = None,
) -> Tensor:
    """``residual + x' @ dequantize(w).T`` for B decode rows on the tensor cores, one launch.

    x: (B, K) bf16, 1 <= B <= MAX_ROWS, or the rows already prepared (``rows_prep``: normed
    there; no ``norm_weight`` here); w: 4-bit QuantWeight (N, K), groups of 32, 64 or 128,
    rows on 16-byte boundaries (``mma_supports``); ``x' = rmsnorm(x) * norm_weight`` per row
    (rounded to bf16, as ``rms_norm`` returns it) when ``norm_weight`` (K,) is given, else
    x; ``residual`` (B, N) added in fp32 before the rounding; output (B, N) in ``out_dtype``
    (default bf16; fp32 for the lm_head). ``config``: the tile (default ``mma_rows_config``).
    ``pdl``: programmatic dependent launch (Hopper; ignored elsewhere). ``operand_rows``:
    the rows each program builds the operand for (a power of two from B to the MMA's
    columns; default pow2(B) with OPERAND_POW2, else the columns). Each row's result is
    qgemv_mma's of that row alone up to fp32 rounding.
    """
    name = "qgemv_mma_rows"
    check_weight(w, f"{name}: w", 2)
    if w.bits != 4:
        raise ValueError(f"{name}: {w.bits}-bit weights are not supported (4 bits; use qgemv)")
    n, k = w.shape
    prep = isinstance(x, RowsOperand)
    if prep:
        if (x.k, x.group) != (k, w.group_size) or x.device != w.device:
            raise ValueError(f"{name}: the prepared rows (K {x.k}, groups of {x.group}, on "
                             f"{x.device}) do not fit w (K {k}, groups of {w.group_size}, on "
                             f"{w.device})")  # fmt: skip
        if norm_weight is not None:
            raise ValueError(f"{name}: prepared rows are normed by rows_prep, not here")
        b = x.rows
    else:
        check_x(x, k, name, w.device)
        if x.dtype != torch.bfloat16:
            raise TypeError(f"{name}: x must be bf16, got {x.dtype} (other dtypes: qgemv)")
        if x.dim() != 2:
            raise ValueError(f"{name}: x must be (B, K) with 1 <= B <= {MAX_ROWS}, "
                             f"got {tuple(x.shape)}")  # fmt: skip
        b = x.shape[0]
        x = x if x.stride(1) == 1 else x.contiguous()
    if not 1 <= b <= MAX_ROWS:
        raise ValueError(f"{name}: x must be (B, K) with 1 <= B <= {MAX_ROWS}, got {b} rows")
    if not mma_supports(w):
        raise ValueError(f"{name}: qweight rows must start on 16-byte boundaries")
    columns = 8 if b <= 8 else 16
    if prep:
        xr = x.op.shape[2]  # (rows_prep's pow2(B))
    else:
        xr = operand_rows if operand_rows is not None else (pow2(b) if OPERAND_POW2 else columns)
        if xr < b or xr > columns or xr & (xr - 1):
            raise ValueError(f"{name}: operand_rows must be a power of two from {b} to "
                             f"{columns}, got {operand_rows}")  # fmt: skip
    dev = w.device
    if norm_weight is not None:
        norm_weight = check_norm(norm_weight, k, name, dev)
    if residual is not None:
        if tuple(residual.shape) != (b, n) or residual.device != dev:
            raise ValueError(
                f"{name}: residual {tuple(residual.shape)} on {residual.device} does not "
                f"match the output {(b, n)} on {dev}"
            )
        if residual.dtype not in _OUT_DTYPES:
            raise TypeError(f"{name}: residual dtype {residual.dtype} is not bf16/fp16/fp32")
        residual = residual if residual.stride(1) == 1 else residual.contiguous()
    out_dtype = out_dtype or torch.bfloat16
    if out_dtype not in _OUT_DTYPES:
        raise TypeError(f"{name}: out_dtype {out_dtype} is not bf16, fp16 or fp32")
    if config is not None and not isinstance(config, MmaGemvConfig):
        raise TypeError(f"{name}: config must be an MmaGemvConfig, got {type(config).__name__}")
    cfg = config or mma_rows_config(n, k, w.group_size, b)
    n_groups = k // w.group_size
    groups = pow2(n_groups)
    warps = min(cfg.num_warps, groups)
    out = torch.empty((b, n), dtype=out_dtype, device=dev)
    res = residual if residual is not None else out
    xt = x.op if prep else x  # (a tensor for the unused pointer)
    pdl = use_pdl(pdl, dev)
    _qgemv_mma_rows_kernel[(cdiv(n, cfg.block_n),)](
        xt, w.qweight, w.scales, w.biases, norm_weight if norm_weight is not None else xt,
        res, out, xt, x.sums if prep else out, b, n, 0 if prep else x.stride(0),
        res.stride(0), out.stride(0), w.qweight.stride(0), w.scales.stride(0), PAIR_MASK,
        float(eps),
        BR=columns, XR=xr, GROUP=w.group_size, NG=n_groups, G=groups,
        BLOCK_N=cfg.block_n, W=warps, HAS_NORM=norm_weight is not None,
        HAS_RES=residual is not None, PREP=prep, EVEN_N=n % cfg.block_n == 0,
        ON_CPU=dev.type == "cpu", PDL=pdl, num_warps=warps, **pdl_launch(pdl),
    )  # fmt: skip
    return out
