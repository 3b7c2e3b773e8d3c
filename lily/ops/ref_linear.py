"""Plain-PyTorch references of the quantized linear and MoE kernels (qgemv, qgemm, moe_*).

Everything here dequantizes with ``lily.quant.dequantize`` and computes in fp32 (or the
dtype asked for), written for clarity, not speed: the kernels' tests compare against these.
The MoE maths follows docs MODEL.md: softmax over all experts in fp32, top-k, renormalise,
``down(silu(gate(x)) * up(x))`` per chosen expert weighted and summed, plus the shared
expert times ``sigmoid(shared_expert_gate(x))``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lily.quant import QuantWeight, dequantize

Tensor = torch.Tensor


def ref_qlinear(
    x: Tensor, w: QuantWeight, residual: Tensor | None = None, dtype: torch.dtype = torch.float32
) -> Tensor:
    """``residual + x @ dequantize(w).T`` in ``dtype`` for x (..., K) and w (N, K)."""
    y = x.to(dtype) @ dequantize(w, dtype).T
    return y if residual is None else y + residual.to(dtype)


def ref_route(logits: Tensor, top_k: int, renorm: bool = True) -> tuple[Tensor, Tensor]:
    """Router logits (T, E) -> (weights fp32 (T, k), expert ids int64 (T, k))."""
    probs = torch.softmax(logits.float(), dim=-1)
    w, ids = probs.topk(top_k, dim=-1)
    if renorm:
        w = w / w.sum(-1, keepdim=True)
    return w, ids


def ref_mlp(x: Tensor, gate: QuantWeight, up: QuantWeight, down: QuantWeight) -> Tensor:
    """``down(silu(gate(x)) * up(x))`` in fp32."""
    return ref_qlinear(F.silu(ref_qlinear(x, gate)) * ref_qlinear(x, up), down)


def ref_moe(
    x: Tensor,
    router: QuantWeight,
    gate: QuantWeight,
    up: QuantWeight,
    down: QuantWeight,
    shared_gate: QuantWeight | None,
    shared_up: QuantWeight | None,
    shared_down: QuantWeight | None,
    shared_expert_gate: QuantWeight | None,
    top_k: int,
    residual: Tensor | None = None,
    ids: Tensor | None = None,
) -> Tensor:
    """fp32 ``residual + moe(x)`` for x (T, D) or (D,).

    ``ids`` (T, k), when given, replaces the router's choice (the routing weights are still
    the renormalised softmax at those experts): tests use it to force skewed routing.
    """
    squeeze = x.dim() == 1
    x2 = x.reshape(1, -1).float() if squeeze else x.float()
    logits = ref_qlinear(x2, router)
    if ids is None:
        wts, ids = ref_route(logits, top_k)
    else:
        probs = torch.softmax(logits, dim=-1)
        wts = probs.gather(1, ids.long())
        wts = wts / wts.sum(-1, keepdim=True)
    out = torch.zeros_like(x2)
    for e in torch.unique(ids).tolist():
        rows, slots = torch.where(ids == e)
        y = ref_mlp(x2[rows], gate[e], up[e], down[e])
        out.index_add_(0, rows, y * wts[rows, slots, None])
    if shared_gate is not None:
        g = torch.sigmoid(ref_qlinear(x2, shared_expert_gate))
        out = out + g * ref_mlp(x2, shared_gate, shared_up, shared_down)
    if residual is not None:
        out = out + residual.reshape(out.shape).float()
    return out.reshape(x.shape) if squeeze else out
