"""RMSNorm on the GPU: a standalone kernel for (T, D) rows, and the pieces the GEMV and MoE
kernels fuse into their prologues.

Maths (docs MODEL.md): ``x * rsqrt(mean(x^2) + eps) * w`` with fp32 statistics, ``w`` the
multiplier; the result is rounded to x's dtype, as ``lily.model.norm.rms_norm`` returns it,
so a fused norm changes no bits against the unfused path. ``add_rmsnorm`` also adds a
residual first (rounded to x's dtype, as a torch add would) and returns both the sum and
its norm: the prefill layer's ``x = x + out_proj(o); h = rmsnorm(x)`` in one launch.

Also here because every kernel module needs them and this one imports nothing else from
lily.ops: ``to_bf16`` / ``cast_to``, bf16 rounding that also holds under the interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lily.ops.launch import launched

Tensor = torch.Tensor

_NORM_BLOCK = 4096  # x values per step of the norm statistics


@triton.jit
def to_bf16(x, ON_CPU: tl.constexpr):
    """x as bf16, rounded to nearest even.

    NOTE: Triton 3.6's interpreter truncates on fp32 -> bf16 (and its round-to-nearest mode
    loses the carry into the exponent), so on the CPU the rounding is done in integers
    first; on the GPU the conversion instruction rounds and this is a plain cast.
    """
    if ON_CPU:
        if x.dtype != tl.bfloat16:
            u = x.to(tl.float32).to(tl.int32, bitcast=True)
            u = (u + 0x7FFF + ((u >> 16) & 1)) & -65536
            x = u.to(tl.float32, bitcast=True)
    return x.to(tl.bfloat16)


@triton.jit
def cast_to(x, dtype: tl.constexpr, ON_CPU: tl.constexpr):
    """x cast to an output dtype, bf16 rounded as on the GPU (see to_bf16)."""
    if dtype == tl.bfloat16:
        return to_bf16(x, ON_CPU)
    return x.to(dtype)


@triton.jit
def norm_x(b_x, b_nw, rstd, HAS_NORM: tl.constexpr, ON_CPU: tl.constexpr):
    """fp32 ``x * rstd * w_norm`` rounded to x's dtype, as the unfused rms_norm returns it
    (so fusing changes no bits); x itself in fp32 without a norm."""
    if HAS_NORM:
        y = b_x.to(tl.float32) * rstd * b_nw.to(tl.float32)
        return cast_to(y, b_x.dtype, ON_CPU).to(tl.float32)
    return b_x.to(tl.float32)


@triton.jit
def row_rstd(p_x, stride_xt, T, K, eps, BT: tl.constexpr, NORM_BLOCK: tl.constexpr,
             NORM_STEPS: tl.constexpr):  # fmt: skip
    """fp32 ``1 / sqrt(mean(x^2) + eps)`` of rows 0..BT-1 (rows past T give finite junk)."""
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, NORM_BLOCK)
    b_ss = tl.zeros((BT,), tl.float32)
    for i in range(NORM_STEPS):
        k = i * NORM_BLOCK + o_k
        p = p_x + o_t[:, None] * stride_xt + k[None, :]
        b_x = tl.load(p, mask=(o_t < T)[:, None] & (k < K)[None, :], other=0.0).to(tl.float32)
        b_ss += tl.sum(b_x * b_x, axis=1)
    return 1.0 / tl.sqrt_rn(b_ss / K + eps)


@triton.jit
def rms_row(b_xf, b_w, D, eps):
    """fp32 ``x * rsqrt(mean(x^2) + eps) * w`` of one whole row held by the program (padding
    zeros add nothing to the sum)."""
    rstd = 1.0 / tl.sqrt_rn(tl.sum(b_xf * b_xf, axis=0) / D + eps)
    return b_xf * rstd * b_w


@launched
@triton.jit
def _rmsnorm_kernel(
    p_x, p_r, p_w, p_sum, p_out, D, stride_x, stride_r, stride_s, stride_o, eps,
    BLOCK_D: tl.constexpr, HAS_RES: tl.constexpr, ON_CPU: tl.constexpr,
):  # fmt: skip
    # One row per program: D (2048) values in registers, read once, written once (or twice).
    t = tl.program_id(0).to(tl.int64)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    b_x = tl.load(p_x + t * stride_x + o_d, mask=m_d, other=0.0)
    b_w = tl.load(p_w + o_d, mask=m_d, other=0.0).to(tl.float32)
    if HAS_RES:
        b_r = tl.load(p_r + t * stride_r + o_d, mask=m_d, other=0.0)
        b_x = cast_to(b_x.to(tl.float32) + b_r.to(tl.float32), p_x.dtype.element_ty, ON_CPU)
        tl.store(p_sum + t * stride_s + o_d, b_x, mask=m_d)
    b_h = rms_row(b_x.to(tl.float32), b_w, D, eps)
    tl.store(p_out + t * stride_o + o_d, cast_to(b_h, p_out.dtype.element_ty, ON_CPU), mask=m_d)


def check_norm(norm_weight: Tensor | None, k: int, name: str, device: torch.device) -> Tensor:
    """The RMSNorm multiplier (K,) as a contiguous float tensor (clear errors otherwise)."""
    if not isinstance(norm_weight, Tensor):
        raise TypeError(f"{name}: norm_weight must be a tensor, got {type(norm_weight).__name__}")
    if tuple(norm_weight.shape) != (k,):
        raise ValueError(f"{name}: norm_weight {tuple(norm_weight.shape)} must be ({k},)")
    if not norm_weight.is_floating_point() or norm_weight.dtype == torch.float64:
        raise TypeError(f"{name}: norm_weight dtype {norm_weight.dtype} is not bf16/fp16/fp32")
    if norm_weight.device != device:
        raise ValueError(f"{name}: norm_weight is on {norm_weight.device}, x on {device}")
    return norm_weight.contiguous()


def norm_meta(k: int) -> tuple[int, int]:
    """(NORM_BLOCK, NORM_STEPS) for the statistics of a K-wide row."""
    block = min(_NORM_BLOCK, 1 << max(0, k - 1).bit_length())
    return block, -(-k // block)


def _rows(x: Tensor, name: str) -> Tensor:
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"{name}: x dtype {x.dtype} is not bf16, fp16 or fp32")
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"{name}: x must have a non-empty last dim, got {tuple(x.shape)}")
    if x.shape[-1] > 65536:
        raise ValueError(f"{name}: rows of {x.shape[-1]} values; at most 65536 per row")
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _launch(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float, name: str):
    d = x.shape[-1]
    x2 = _rows(x, name)
    weight = check_norm(weight, d, name, x.device)
    r2 = s2 = None
    if residual is not None:
        if residual.shape != x.shape or residual.device != x.device:
            raise ValueError(
                f"{name}: residual {tuple(residual.shape)} on {residual.device} does not match "
                f"x {tuple(x.shape)} on {x.device}"
            )
        r2 = _rows(residual, name)
        s2 = torch.empty_like(x2)
    out = torch.empty_like(x2)
    if x2.shape[0]:
        block = 1 << max(0, d - 1).bit_length()
        _rmsnorm_kernel[(x2.shape[0],)](
            x2, r2 if r2 is not None else x2, weight, s2 if s2 is not None else out, out, d,
            x2.stride(0), r2.stride(0) if r2 is not None else 0,
            s2.stride(0) if s2 is not None else 0, out.stride(0), float(eps),
            BLOCK_D=block, HAS_RES=r2 is not None, ON_CPU=x.device.type == "cpu",
            num_warps=4 if block <= 4096 else 8,
        )  # fmt: skip
    return out.reshape(x.shape), (s2.reshape(x.shape) if s2 is not None else None)


def rmsnorm(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    """``x * rsqrt(mean(x^2) + eps) * weight`` over the last dim of x (..., D), fp32
    statistics, result in x's dtype (``weight`` (D,) is the multiplier). One launch."""
    return _launch(x, None, weight, eps, "rmsnorm")[0]


def add_rmsnorm(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float = 1e-6
) -> tuple[Tensor, Tensor]:
    """``s = x + residual`` (rounded to x's dtype) and ``rmsnorm(s) * weight``, one launch:
    returns (s, normed)."""
    out, s = _launch(x, residual, weight, eps, "add_rmsnorm")
    return s, out
