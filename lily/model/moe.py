"""Sparse MoE block: softmax router, top-k experts, plus a sigmoid-gated shared expert
(the reference maths)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lily.model.linear import linear
from lily.quant import Weight


def route(
    logits: torch.Tensor, top_k: int, renorm: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits (T, E) -> softmax over experts in fp32, top-k, renormalised:
    (weights fp32 (T, k), expert ids int64 (T, k))."""
    probs = torch.softmax(logits.float(), dim=-1)
    w, ids = probs.topk(top_k, dim=-1)
    if renorm:
        w = w / w.sum(-1, keepdim=True)
    return w, ids


def mlp(x: torch.Tensor, gate: Weight, up: Weight, down: Weight) -> torch.Tensor:
    """``down(silu(gate(x)) * up(x))`` in x's dtype."""
    return linear(F.silu(linear(x, gate)) * linear(x, up), down)


def sparse_moe(
    x: torch.Tensor,
    router: Weight,
    gate: Weight,
    up: Weight,
    down: Weight,
    shared_gate: Weight | None,
    shared_up: Weight | None,
    shared_down: Weight | None,
    shared_expert_gate: Weight | None,
    top_k: int,
    renorm: bool = True,
    ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """``moe(x)`` for x (T, D) -> (T, D) in x's dtype, summed in fp32 (MODEL.md).

    Weights as in the MoE kernels: router (E, D); gate, up (E, I, D); down (E, D, I); the
    shared expert (Is, D), (Is, D), (D, Is) and its gate (1, D), or all four None. ``ids``
    (T, k), when given, replaces the router's choice (the weights are still the
    renormalised softmax at those experts): tests use it to force skewed routing.
    """
    logits = linear(x, router)
    if ids is None:
        w, ids = route(logits, top_k, renorm)
    else:
        w = torch.softmax(logits.float(), dim=-1).gather(1, ids.long())
        w = w / w.sum(-1, keepdim=True)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in torch.unique(ids).tolist():
        rows, slots = torch.where(ids == e)
        y = mlp(x[rows], gate[e], up[e], down[e])
        out.index_add_(0, rows, y.float() * w[rows, slots, None])
    if shared_gate is not None:
        shared = mlp(x, shared_gate, shared_up, shared_down).float()
        out += shared * torch.sigmoid(linear(x, shared_expert_gate).float())
    return out.to(x.dtype)
