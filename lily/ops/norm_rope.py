"""Fused per-head norm and rotary helpers shared by the mixer kernels.

Triton helpers (called from other kernels): ``rms_rope_rows`` (RMSNorm of head rows, then
rotate-half RoPE on the first R dims; also split as ``rms_rope_load`` + ``rms_rope_apply``),
``gated_rmsnorm_rows`` (DeltaNet's output norm) and small activations. One standalone
kernel, ``gated_rmsnorm``, for the prefill paths that cannot fuse the norm into the scan.
``rope_inv_freq`` builds the frequency table the kernels take.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lily.ops.launch import cdiv, launched, pow2

Tensor = torch.Tensor


def rope_inv_freq(
    rotary_dim: int, theta: float, device: torch.device | str | None = None
) -> Tensor:
    """``theta^(-2i/R)`` for i < R/2, fp32 (R/2,), computed as the model's rotary embedding does."""
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(
            f"rope_inv_freq: rotary_dim must be a positive even number, got {rotary_dim}"
        )
    exps = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    return (1.0 / (theta**exps)).to(device=device, dtype=torch.float32)


@triton.jit
def sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def silu(x):
    return x / (1.0 + tl.exp(-x))


@triton.jit
def rope_cos_sin(pos, freq):
    """cos and sin of ``pos * freq`` (fp32 product, like the reference) with exact range reduction.

    NOTE: angles reach 2.6e5 rad at long contexts. Reducing them in fp64 first keeps the
    result independent of how a backend's fp32 sin/cos treat large arguments (approximate
    hardware instructions are only accurate near [-pi, pi]; libdevice, which Triton's CUDA
    backend calls, takes a slow exact path there).
    """
    ang = pos.to(tl.float32) * freq
    a64 = ang.to(tl.float64)
    n = tl.floor(a64 * 0.15915494309189535 + 0.5)
    # 2*pi = float32(2*pi) + remainder: n * hi is exact in fp64 (n < 2^17, hi has 24 bits).
    r = ((a64 - n * 6.2831854820251465) - n * -1.7484556025237907e-07).to(tl.float32)
    return tl.cos(r), tl.sin(r)


@triton.jit
def rms_rope_load(
    p_x, row_off, row_mask, p_w, p_f, D: tl.constexpr, R: tl.constexpr, BD: tl.constexpr,
):  # fmt: skip
    """The operands of ``rms_rope_apply`` for rows at ``p_x + row_off[i]`` (D contiguous
    values): x, the weight, x and weight at each column's rotate-half partner (loaded again
    rather than shuffled in registers) and the frequencies. Loading is split from the maths
    so that callers can issue all their loads before the first reduction's barrier."""
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    b_x = tl.load(
        p_x + row_off[:, None] + o_d[None, :], mask=row_mask[:, None] & m_d[None, :], other=0.0
    )
    b_w = tl.load(p_w + o_d, mask=m_d, other=0.0)
    if R > 0:
        HALF: tl.constexpr = R // 2
        m_rot = o_d < R
        o_p = tl.where(o_d < HALF, o_d + HALF, o_d - HALF)
        b_xp = tl.load(
            p_x + row_off[:, None] + o_p[None, :],
            mask=row_mask[:, None] & m_rot[None, :],
            other=0.0,
        )
        b_wp = tl.load(p_w + o_p, mask=m_rot, other=0.0)
        b_f = tl.load(p_f + o_d % HALF, mask=m_rot, other=0.0)
        return b_x, b_w, b_xp, b_wp, b_f
    else:
        return b_x, b_w, b_x, b_w, b_w  # no rotation: placeholders


@triton.jit
def rms_rope_apply(
    b_x, b_w, b_xp, b_wp, b_f, pos, eps, D: tl.constexpr, R: tl.constexpr, BD: tl.constexpr,
):  # fmt: skip
    """RMSNorm (weight = multiplier) then RoPE on the first R dims, rows at positions
    ``pos`` (BR,); operands from ``rms_rope_load``; returns the (BR, BD) fp32 block."""
    o_d = tl.arange(0, BD)
    b_x = b_x.to(tl.float32)
    b_r = tl.rsqrt(tl.sum(b_x * b_x, 1) / D + eps)
    b_y = b_x * b_r[:, None] * b_w.to(tl.float32)[None, :]
    if R > 0:
        HALF: tl.constexpr = R // 2
        b_yp = b_xp.to(tl.float32) * b_r[:, None] * b_wp.to(tl.float32)[None, :]
        b_cos, b_sin = rope_cos_sin(pos[:, None], b_f[None, :])
        b_sign = tl.where(o_d < HALF, -1.0, 1.0)
        b_y = tl.where((o_d < R)[None, :], b_y * b_cos + b_sign[None, :] * b_yp * b_sin, b_y)
    return b_y


@triton.jit
def rms_rope_rows(
    p_x, row_off, row_mask, p_w, p_f, pos, eps, D: tl.constexpr, R: tl.constexpr, BD: tl.constexpr,
):  # fmt: skip
    """RMSNorm then RoPE of rows at ``p_x + row_off[i]``: ``rms_rope_load`` then
    ``rms_rope_apply``; returns the (BR, BD) fp32 block."""
    b_x, b_w, b_xp, b_wp, b_f = rms_rope_load(p_x, row_off, row_mask, p_w, p_f, D, R, BD)
    return rms_rope_apply(b_x, b_w, b_xp, b_wp, b_f, pos, eps, D, R, BD)


@triton.jit
def gated_rmsnorm_rows(b_o, b_z, b_w, eps, VD: tl.constexpr):
    """``rmsnorm(o) * w * silu(z)`` per row of a (rows, BV) fp32 block (padding must be 0)."""
    b_r = tl.rsqrt(tl.sum(b_o * b_o, 1) / VD + eps)
    return b_o * b_r[:, None] * b_w[None, :] * silu(b_z)


@launched
@triton.jit
def _gated_rmsnorm_kernel(
    o, z, w, out, n_rows, hv, stride_z, eps, VD: tl.constexpr, BR: tl.constexpr,
    BV: tl.constexpr,
):  # fmt: skip
    i_r = tl.program_id(0)
    o_r = i_r * BR + tl.arange(0, BR)  # row = token * hv + head
    o_v = tl.arange(0, BV)
    m = (o_r < n_rows)[:, None] & (o_v < VD)[None, :]
    off = o_r[:, None] * VD + o_v[None, :]
    b_o = tl.load(o + off, mask=m, other=0.0).to(tl.float32)
    p_z = z + (o_r // hv * stride_z + o_r % hv * VD)[:, None] + o_v[None, :]
    b_z = tl.load(p_z, mask=m, other=0.0).to(tl.float32)
    b_w = tl.load(w + o_v, mask=o_v < VD, other=0.0).to(tl.float32)
    b_y = gated_rmsnorm_rows(b_o, b_z, b_w, eps, VD)
    tl.store(out + off, b_y.to(out.dtype.element_ty), mask=m)


def gated_rmsnorm(
    o: Tensor, z: Tensor, weight: Tensor, eps: float, out_dtype: torch.dtype
) -> Tensor:
    """``rmsnorm(o) * weight * silu(z)`` per head: o (T, Hv, Vd), z (T, Hv*Vd) -> (T, Hv*Vd).
    z may be a column slice of a wider tensor (contiguous rows)."""
    t, hv, vd = o.shape
    if z.shape != (t, hv * vd) or weight.shape != (vd,):
        raise ValueError(
            f"gated_rmsnorm: z must be ({t}, {hv * vd}) and weight ({vd},), "
            f"got {tuple(z.shape)} and {tuple(weight.shape)}"
        )
    if not (o.is_contiguous() and z.stride(1) == 1 and weight.is_contiguous()):
        raise ValueError("gated_rmsnorm: o and weight must be contiguous, z's rows contiguous")
    out = torch.empty(t, hv * vd, dtype=out_dtype, device=o.device)
    n_rows = t * hv
    bv = pow2(vd)
    br = max(1, min(16, 4096 // bv))
    _gated_rmsnorm_kernel[(cdiv(n_rows, br),)](
        o, z, weight, out, n_rows, hv, z.stride(0), eps, VD=vd, BR=br, BV=bv, num_warps=4
    )
    return out
