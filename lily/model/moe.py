"""Sparse MoE block: softmax router, top-k experts, plus a sigmoid-gated shared expert."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lily.config import ModelConfig
from lily.model.linear import linear
from lily.quant import Weight


def route(logits: torch.Tensor, top_k: int, renorm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts in fp32, top-k, renormalised: (weights, ids), both (T, k)."""
    probs = torch.softmax(logits.float(), dim=-1)
    w, ids = probs.topk(top_k, dim=-1)
    if renorm:
        w = w / w.sum(-1, keepdim=True)
    return w, ids


def mlp(x: torch.Tensor, gate: Weight, up: Weight, down: Weight) -> torch.Tensor:
    return linear(F.silu(linear(x, gate)) * linear(x, up), down)


def moe_layer(p: dict[str, Weight], pre: str, x: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """MoE for x (T, D) -> (T, D)."""
    w, ids = route(linear(x, p[pre + "router"]), cfg.num_experts_per_tok, cfg.norm_topk_prob)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    gate, up, down = p[pre + "gate_proj"], p[pre + "up_proj"], p[pre + "down_proj"]
    for e in torch.unique(ids).tolist():
        rows, slots = torch.where(ids == e)
        y = mlp(x[rows], gate[e], up[e], down[e])
        out.index_add_(0, rows, y.float() * w[rows, slots, None])
    shared = mlp(x, p[pre + "shared_gate_proj"], p[pre + "shared_up_proj"],
                 p[pre + "shared_down_proj"])  # fmt: skip
    shared = shared.float() * torch.sigmoid(linear(x, p[pre + "shared_expert_gate"]).float())
    return (out + shared).to(x.dtype)
