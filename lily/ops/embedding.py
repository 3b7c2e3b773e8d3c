"""Token embedding from the packed table: gather and dequantize the rows in one launch.

The reference (``lily.model.linear.embedding``) indexes the words, scales and biases and
dequantizes with about ten torch ops: on the GPU that was ten launches and ~0.4 ms of host
time before a prefill's first layer (lily/bench/gpu/diagnostics/timeline.py), and ten
kernels in every decode step. Here one program writes BLOCK_D values of one token's row with
the reference's arithmetic and roundings: ``round(round(q * scale) + bias)`` in the output
dtype, so the two agree bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lily.ops.launch import cdiv, check_weight, launched, pow2
from lily.ops.rmsnorm import cast_to
from lily.quant import QuantWeight

Tensor = torch.Tensor

# output dtypes whose reference arithmetic the kernel reproduces (fp32 would need the
# multiply and add kept apart from an FMA contraction)
DTYPES = (torch.bfloat16, torch.float16)


@launched
@triton.jit
def _embedding_kernel(
    ids, qw, scales, biases, out, D, stride_qw, stride_s, stride_o, BITS: tl.constexpr,
    GROUP: tl.constexpr, BLOCK_D: tl.constexpr, ON_CPU: tl.constexpr,
):  # fmt: skip
    t, i_d = tl.program_id(0), tl.program_id(1)
    PER: tl.constexpr = 32 // BITS  # codes per word
    row = tl.load(ids + t).to(tl.int64)
    o_w = i_d * (BLOCK_D // PER) + tl.arange(0, BLOCK_D // PER)
    b_w = tl.load(qw + row * stride_qw + o_w, mask=o_w < D // PER, other=0)
    shifts = tl.arange(0, PER) * BITS
    codes = (b_w[:, None] >> shifts[None, :]) & ((1 << BITS) - 1)
    codes = tl.reshape(codes, (BLOCK_D,))  # word-major, lowest bits first: the row order
    o_d = i_d * BLOCK_D + tl.arange(0, BLOCK_D)
    m_d = o_d < D
    dt = out.dtype.element_ty
    # scales and biases first rounded to the output dtype, as the reference casts them
    b_s = tl.load(scales + row * stride_s + o_d // GROUP, mask=m_d, other=0.0)
    b_s = cast_to(b_s.to(tl.float32), dt, ON_CPU).to(tl.float32)
    b_b = tl.load(biases + row * stride_s + o_d // GROUP, mask=m_d, other=0.0)
    b_b = cast_to(b_b.to(tl.float32), dt, ON_CPU).to(tl.float32)
    b_m = cast_to(codes.to(tl.float32) * b_s, dt, ON_CPU).to(tl.float32)  # torch's q * scale
    b_o = cast_to(b_m + b_b, dt, ON_CPU)  # then + bias, each rounded to the dtype
    tl.store(out + t * stride_o + o_d, b_o, mask=m_d)


def embedding_rows(ids: Tensor, w: QuantWeight, dtype: torch.dtype) -> Tensor:
    """Rows ``ids`` (T,) of the packed (V, D) table as (T, D) in ``dtype`` (bf16 or fp16),
    equal to ``dequantize(w[ids], dtype)``. Ids must lie in [0, V): the kernel does not
    check them (the engine validates prompts against the vocabulary)."""
    check_weight(w, "embedding", 2)
    if dtype not in DTYPES:
        raise ValueError(f"embedding_rows: dtype must be one of {DTYPES}, got {dtype}")
    if ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"embedding_rows: ids must be a 1-D integer tensor, got {tuple(ids.shape)} {ids.dtype}"
        )
    if ids.device != w.device:
        raise ValueError(f"embedding_rows: ids on {ids.device}, table on {w.device}")
    v, d = w.shape
    t = ids.shape[0]
    out = torch.empty(t, d, dtype=dtype, device=ids.device)
    if t == 0:
        return out
    block_d = min(1024, pow2(d))
    _embedding_kernel[(t, cdiv(d, block_d))](
        ids, w.qweight, w.scales, w.biases, out, d, w.qweight.stride(0), w.scales.stride(0),
        out.stride(0), BITS=w.bits, GROUP=w.group_size, BLOCK_D=block_d,
        ON_CPU=ids.device.type == "cpu", num_warps=4,
    )  # fmt: skip
    return out
