"""Quantized GEMM for prefill: ``x @ w.T`` for T rows against MLX-packed weights.

Dequantization happens inside the tile loop: each K step loads the packed words of a
(BLOCK_N, BLOCK_K) weight tile, expands them to bf16 in registers, and feeds the tensor
cores (fp32 accumulate); the bf16 weight never exists in memory. The product is computed
transposed, ``out.T = w @ x.T``: weight rows are the MMA's M side (64 or more, what a Hopper
warpgroup MMA wants, with A from registers) and tokens its N side, which may be as small as
16, so few-row calls (MoE expert groups, short prompts) waste no tensor-core work.

Unpacking (shared with the GEMV, see qgemv.py): a code OR'd into the mantissa of 1.0 at bit
p is ``f = 1 + q * 2**(p - 23)``; ``w = s * q + b = S * f + (b - S)`` with
``S = s * 2**(23 - p)``: one LOP3, half a shift and one FMA per code, no int->float convert.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from lily.ops.arch import DEFAULT, Arch, current_arch
from lily.ops.launch import cdiv, check_weight, check_x, launched, mask_lo
from lily.ops.qgemv import as_f as _as_f
from lily.ops.rmsnorm import cast_to, to_bf16
from lily.quant import QuantWeight

Tensor = torch.Tensor


@triton.jit
def dequant_tile(b_w, b_s, b_b, mask_lo, BITS: tl.constexpr):
    """Words (BN, BG, WPG) int32, scales and biases (BN, BG) fp32 -> (BN, BG*WPG*PER) fp32."""
    BN: tl.constexpr = b_w.shape[0]
    BG: tl.constexpr = b_w.shape[1]
    WPG: tl.constexpr = b_w.shape[2]
    PER: tl.constexpr = 32 // BITS
    if BITS == 4:
        mask_hi = mask_lo << 4
        # Even codes sit at mantissa bit 19 (S = 16 s), odd ones at bit 15 (S = 256 s).
        s_e = (b_s * 16.0)[:, :, None]
        s_o = (b_s * 256.0)[:, :, None]
        c_e = b_b[:, :, None] - s_e
        c_o = b_b[:, :, None] - s_o
        w11 = b_w << 11
        w3 = b_w << 3
        r5 = b_w >> 5
        v0 = _as_f(b_w << 19, mask_hi) * s_e + c_e
        v1 = _as_f(w11, mask_lo) * s_o + c_o
        v2 = _as_f(w11, mask_hi) * s_e + c_e
        v3 = _as_f(w3, mask_lo) * s_o + c_o
        v4 = _as_f(w3, mask_hi) * s_e + c_e
        v5 = _as_f(r5, mask_lo) * s_o + c_o
        v6 = _as_f(r5, mask_hi) * s_e + c_e
        v7 = _as_f(b_w >> 13, mask_lo) * s_o + c_o
        # join puts the new axis inside the thread; this tree leaves codes in K order.
        t = tl.join(
            tl.join(tl.join(v0, v4), tl.join(v2, v6)), tl.join(tl.join(v1, v5), tl.join(v3, v7))
        )
    else:
        s8 = (b_s * 256.0)[:, :, None]  # codes at bit 15
        c8 = b_b[:, :, None] - s8
        v0 = _as_f(b_w << 15, mask_lo) * s8 + c8
        v1 = _as_f(b_w << 7, mask_lo) * s8 + c8
        v2 = _as_f(b_w >> 1, mask_lo) * s8 + c8
        v3 = _as_f(b_w >> 9, mask_lo) * s8 + c8
        t = tl.join(tl.join(v0, v2), tl.join(v1, v3))
    return tl.reshape(t, (BN, BG * WPG * PER))


@triton.jit
def mma(a, b, acc, ON_CPU: tl.constexpr):
    """``acc + a @ b`` with bf16 operands on tensor cores.

    NOTE: Triton 3.6's interpreter multiplies bf16 operands as their raw uint16 bit
    patterns; on the CPU (interpreter only) the operands go through fp32, which gives the
    same products (bf16 x bf16 is exact in fp32) and fp32 accumulation.
    """
    if ON_CPU:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    return tl.dot(a, b, acc)


@triton.jit
def load_dequant(p_qw, p_s, p_b, stride_qn, stride_sn, o_n, m_n, g0, n_groups, mask_lo,
                 BITS: tl.constexpr, GROUP: tl.constexpr, BG: tl.constexpr):  # fmt: skip
    """fp32 (BN, BG*GROUP) tile of w[o_n, groups g0:g0+BG] (groups past n_groups are 0)."""
    PER: tl.constexpr = 32 // BITS
    WPG: tl.constexpr = GROUP // PER
    o_g = g0 + tl.arange(0, BG)
    o_w = tl.arange(0, WPG)
    m_g = o_g < n_groups
    p_w = p_qw + o_n[:, None, None] * stride_qn + (o_g * WPG)[None, :, None] + o_w[None, None, :]
    b_w = tl.load(p_w, mask=m_n[:, None, None] & m_g[None, :, None], other=0)
    p_sb = o_n[:, None] * stride_sn + o_g[None, :]
    m_sb = m_n[:, None] & m_g[None, :]
    b_s = tl.load(p_s + p_sb, mask=m_sb, other=0.0).to(tl.float32)
    b_b = tl.load(p_b + p_sb, mask=m_sb, other=0.0).to(tl.float32)
    return dequant_tile(b_w, b_s, b_b, mask_lo, BITS)


@launched
@triton.jit
def _qgemm_kernel(
    p_x, p_qw, p_s, p_b, p_out, T, N, K, stride_xt, stride_qn, stride_sn, stride_ot, mask_lo,
    BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, K_STEPS: tl.constexpr, GROUP_N: tl.constexpr, SPLIT_W: tl.constexpr,
    ON_CPU: tl.constexpr,
):  # fmt: skip
    # Grouped order: GROUP_N weight-row blocks sweep all token blocks together, so a band of
    # weights stays in L2 while the x tiles stream.
    pid = tl.program_id(0)
    n_blocks = tl.cdiv(N, BLOCK_N)
    m_blocks = tl.cdiv(T, BLOCK_M)
    per_band = GROUP_N * m_blocks
    band = pid // per_band
    first_n = band * GROUP_N
    band_n = tl.minimum(n_blocks - first_n, GROUP_N)
    i_n = first_n + (pid % per_band) % band_n
    i_m = (pid % per_band) // band_n

    BG: tl.constexpr = BLOCK_K // GROUP
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_m = o_m < T
    o_m64 = o_m.to(tl.int64)  # T x N passes 2**31 for the lm_head at long prompts
    o_k = tl.arange(0, BLOCK_K)
    n_groups = K // GROUP
    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    for i_k in range(K_STEPS):
        b_wf = load_dequant(
            p_qw, p_s, p_b, stride_qn, stride_sn, o_n, m_n, i_k * BG, n_groups, mask_lo,
            BITS, GROUP, BG,
        )  # fmt: skip
        k0 = i_k * BLOCK_K
        p_xt = p_x + o_m64[None, :] * stride_xt + (k0 + o_k)[:, None]
        b_xt = tl.load(p_xt, mask=m_m[None, :] & ((k0 + o_k) < K)[:, None], other=0.0)
        b_xt = to_bf16(b_xt, ON_CPU)
        b_wd = to_bf16(b_wf, ON_CPU)
        acc = mma(b_wd, b_xt, acc, ON_CPU)
        if SPLIT_W:
            # Second bf16 term w - bf16(w): ~16 mantissa bits of weight, for router logits
            # whose top-k must not flip on rounding.
            acc = mma(to_bf16(b_wf - b_wd.to(tl.float32), ON_CPU), b_xt, acc, ON_CPU)
    p_o = p_out + o_m64[None, :] * stride_ot + o_n[:, None]
    b_o = cast_to(acc, p_out.dtype.element_ty, ON_CPU)
    tl.store(p_o, b_o, mask=m_n[:, None] & m_m[None, :])


@dataclass(frozen=True)
class GemmConfig:
    """One program's tile: BLOCK_M tokens x BLOCK_N weight rows x BLOCK_K inputs a step."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    group_n: int = 8

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k", "num_warps"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"GemmConfig.{name} must be a power of two, got {v}")
        if self.block_m < 16 or self.block_n < 16 or self.block_k < 16:
            raise ValueError("GemmConfig: tensor-core tiles need every block >= 16")


def block_m_for(rows: float) -> int:
    """Token tile for an expected number of rows (per expert, or T for a dense GEMM)."""
    for bm in (16, 32, 64):
        if rows <= 1.5 * bm:
            return bm
    return 128


@functools.lru_cache(maxsize=1024)  # tiles are pure functions of the shape
def gemm_config(
    t: int, n: int, k: int, group_size: int, arch: Arch = DEFAULT, x_bytes: int = 2
) -> GemmConfig:
    """Tile for a shape (stand-in for a measured table; see docs/notes/linear_kernels.md),
    the architecture and the size of x's elements (the compile matrix checks each fits)."""
    bm = block_m_for(t)
    bk = max(64, group_size)
    if bm >= 128:
        # Fill the 132 SMs: at T = 256 the 2048 x 4096 o_proj gets 32 programs from 128 x 128
        # tiles and 128 from 64 x 64 (73 against 40 us, bench/results/tile_sweep_h200_run1.json).
        tiles = cdiv(t, 128) * cdiv(n, 128)
        if 132 <= tiles < 176:
            # One wave and a second under a third full (o_proj at T = 1,128: 144 tiles):
            # 128 x 64 at 4 warps took 79 us against 92 (tile_sweep_h200_run2_t1128.json;
            # at 208 tiles, T = 1,664, the 128 x 128 tile still won: 98 against 121).
            return GemmConfig(128, 64, bk, num_warps=4, num_stages=3)
        if tiles >= 132:
            # NOTE: two stages, not three: with 8 warps and 3 or 4 stages this tile's
            # compiled pipeline (Triton 3.6, sm_90) returned garbage (up to 3e38, at times
            # inf) in about 1 run of 300 at T = 4096, N = 8192, K = 2048, and 0 of 3,000
            # with two stages, 4% slower (bench/results/kernel_repeat_h200.json). It was
            # the multi-turn runs' random non-finite logits.
            return GemmConfig(128, 128, bk, num_warps=8, num_stages=2)
        if cdiv(t, 128) * cdiv(n, 64) >= 132:
            # fp32 x (``--dtype float32``) on 99 KiB GPUs: 110 KiB on four stages, three fit
            deep = x_bytes <= 2 or arch.big_smem
            return GemmConfig(128, 64, bk, num_warps=4, num_stages=4 if deep else 3)
        return GemmConfig(64, 64, bk, num_warps=4, num_stages=3)
    if bm == 64:
        return GemmConfig(64, 128, bk, num_warps=8, num_stages=3)
    return GemmConfig(bm, 64, bk, num_warps=4, num_stages=3)


def launch_qgemm(
    x: Tensor, w: QuantWeight, out: Tensor, cfg: GemmConfig, split_w: bool = False
) -> None:
    t, k = x.shape
    n = w.shape[0]
    if cfg.block_k % w.group_size:
        raise ValueError(f"qgemm: block_k {cfg.block_k} must be a multiple of the group size")
    grid = (cdiv(n, cfg.block_n) * cdiv(t, cfg.block_m),)
    _qgemm_kernel[grid](
        x, w.qweight, w.scales, w.biases, out, t, n, k, x.stride(0), w.qweight.stride(0),
        w.scales.stride(0), out.stride(0), mask_lo(w.bits),
        BITS=w.bits, GROUP=w.group_size, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, K_STEPS=cdiv(k, cfg.block_k), GROUP_N=cfg.group_n,
        SPLIT_W=split_w, ON_CPU=x.device.type == "cpu",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip


def qgemm(
    x: Tensor,
    w: QuantWeight,
    *,
    out_dtype: torch.dtype | None = None,
    precise: bool = False,
    config: GemmConfig | None = None,
) -> Tensor:
    """``x @ dequantize(w).T`` on tensor cores: x (T, K) bf16/fp16/fp32 (fed as bf16),
    w QuantWeight (N, K) of 4 or 8 bits -> (T, N) in ``out_dtype`` (default bf16),
    accumulated in fp32. ``precise``: the weight enters as two bf16 terms (twice the MMA
    work), so only x's bf16 rounding remains (router logits)."""
    check_weight(w, "qgemm: w", 2)
    n, k = w.shape
    check_x(x, k, "qgemm", w.device)
    if x.dim() != 2:
        raise ValueError(f"qgemm: x must be (T, K), got {tuple(x.shape)}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty((x.shape[0], n), dtype=out_dtype or torch.bfloat16, device=x.device)
    if x.shape[0] == 0:
        return out
    cfg = config or gemm_config(x.shape[0], n, k, w.group_size, current_arch(x.device),
                                x.element_size())  # fmt: skip
    launch_qgemm(x, w, out, cfg, precise)
    return out
