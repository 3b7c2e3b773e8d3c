"""Partial rotary position embedding, rotate-half style, on the first rotary dims."""

from __future__ import annotations

import torch


def rope_cos_sin(
    positions: torch.Tensor, rotary_dim: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape (T, rotary_dim) in fp32 for integer ``positions`` (T,)."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=positions.device)
                  / rotary_dim)
    )  # fmt: skip
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``cos.shape[-1]`` dims of x (T, H, Dh); the rest pass through."""
    rd = cos.shape[-1]
    xr, xp = x[..., :rd].float(), x[..., rd:]
    half = rd // 2
    rot = torch.cat([-xr[..., half:], xr[..., :half]], dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    out = xr * c + rot * s
    return torch.cat([out.to(x.dtype), xp], dim=-1)
