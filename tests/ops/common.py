"""Helpers the kernel tests share."""

from __future__ import annotations

import torch


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``|a - b| / |b|`` in fp64 on the CPU; a non-finite ``a`` fails (an unwritten or bad
    output element)."""
    a, b = a.double().cpu(), b.double().cpu()
    assert torch.isfinite(a).all(), "output has NaN/inf (unwritten or bad values)"
    return ((a - b).norm() / b.norm()).item()
