"""Linear layers and embeddings over dense or packed weights (reference path)."""

from __future__ import annotations

import torch

from lily.quant import Weight, dequantize

# Dequantize big matrices (the lm_head is 248320 rows) in row blocks so the dense copy
# never exists whole.
_ROW_BLOCK = 16384


def linear(x: torch.Tensor, w: Weight) -> torch.Tensor:
    """``x @ w.T`` for x (..., K) and w (N, K), in x's dtype."""
    if isinstance(w, torch.Tensor):
        return x @ w.to(x.dtype).T
    n = w.shape[-2]
    if n <= _ROW_BLOCK:
        return x @ dequantize(w, x.dtype).T
    parts = [x @ dequantize(w[i : i + _ROW_BLOCK], x.dtype).T for i in range(0, n, _ROW_BLOCK)]
    return torch.cat(parts, dim=-1)


def embedding(ids: torch.Tensor, w: Weight, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``ids`` of the (V, D) table, dequantizing only those rows."""
    if isinstance(w, torch.Tensor):
        return w[ids].to(dtype)
    return dequantize(w[ids], dtype)
