"""The packed weight layout shared by the reference path and the GPU kernels.

It is MLX's affine layout, so MLX checkpoints load without repacking: along the input
dimension, ``32 // bits`` values per uint32 word, lowest bits first; one ``scale`` and
one ``bias`` per group of ``group_size`` inputs; ``w = scale * q + bias``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class QuantWeight:
    """A quantized linear weight of logical shape (..., N, K) (N outputs, K inputs).

    ``qweight``: uint32 (stored as int32 by torch), shape (..., N, K * bits // 32);
    ``scales`` and ``biases``: shape (..., N, K // group_size), bf16 (or fp32).
    """

    qweight: torch.Tensor
    scales: torch.Tensor
    biases: torch.Tensor
    bits: int
    group_size: int

    @property
    def shape(self) -> tuple[int, ...]:
        *lead, n, words = self.qweight.shape
        return (*lead, n, words * 32 // self.bits)

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    def to(self, device: torch.device | str) -> QuantWeight:
        return QuantWeight(
            self.qweight.to(device),
            self.scales.to(device),
            self.biases.to(device),
            self.bits,
            self.group_size,
        )

    def __getitem__(self, idx) -> QuantWeight:
        """Index the leading (expert or vocabulary-row) axes."""
        return QuantWeight(
            self.qweight[idx], self.scales[idx], self.biases[idx], self.bits, self.group_size
        )

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.biases))


Weight = torch.Tensor | QuantWeight


def unpack(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """uint32 words (..., W) -> integer codes (..., W * 32 // bits) as int32."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, device=qweight.device, dtype=torch.int32)
    codes = (qweight.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return codes.reshape(*qweight.shape[:-1], qweight.shape[-1] * per)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Integer codes (..., K) in [0, 2**bits) -> words (..., K * bits // 32) as int32 bits."""
    per = 32 // bits
    c = codes.to(torch.int64).reshape(*codes.shape[:-1], codes.shape[-1] // per, per)
    shifts = torch.arange(0, 32, bits, device=codes.device, dtype=torch.int64)
    words = (c << shifts).sum(-1)
    # NOTE: reinterpret the unsigned 32-bit value as int32 (torch has no full uint32 math).
    return (words - ((words >> 31) << 32)).to(torch.int32)


def dequantize(w: QuantWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Reference dequantization to a dense (..., N, K) tensor."""
    codes = unpack(w.qweight, w.bits).to(dtype)
    *lead, n, k = codes.shape
    g = codes.reshape(*lead, n, k // w.group_size, w.group_size)
    out = g * w.scales.to(dtype).unsqueeze(-1) + w.biases.to(dtype).unsqueeze(-1)
    return out.reshape(*lead, n, k)


def quantize(w: torch.Tensor, bits: int = 4, group_size: int = 64) -> QuantWeight:
    """Affine quantization with the same arithmetic as ``mlx.core.quantize``.

    Per group: the end of larger magnitude is kept exact (it becomes a code times the
    scale), the scale spans max - min over 2**bits - 1 steps. Codes are computed in fp32
    against the unrounded scale and bias, which are then stored in ``w``'s dtype, so the
    bytes equal what ``mlx_lm.convert`` writes for the same input.
    """
    if w.shape[-1] % group_size:
        raise ValueError(f"input dim {w.shape[-1]} is not a multiple of group size {group_size}")
    out_dtype = w.dtype
    *lead, n, k = w.shape
    wf = w.to(torch.float32).reshape(*lead, n, k // group_size, group_size)
    n_bins = float((1 << bits) - 1)
    eps = 1e-7
    w_max = wf.amax(-1, keepdim=True)
    w_min = wf.amin(-1, keepdim=True)
    mask = w_min.abs() > w_max.abs()
    scales = torch.clamp((w_max - w_min) / n_bins, min=eps)
    scales = torch.where(mask, scales, -scales)
    edge = torch.where(mask, w_min, w_max)
    q0 = torch.round(edge / scales)
    scales = torch.where(q0 != 0, edge / q0, scales)
    biases = torch.where(q0 == 0, torch.zeros_like(q0), edge)
    # NOTE: codes use the fp32 scale and bias; only the stored copies are rounded.
    codes = torch.clamp(torch.round((wf - biases) / scales), 0, n_bins).to(torch.int32)
    return QuantWeight(
        qweight=pack(codes.reshape(*lead, n, k), bits),
        scales=scales.squeeze(-1).to(out_dtype),
        biases=biases.squeeze(-1).to(out_dtype),
        bits=bits,
        group_size=group_size,
    )
