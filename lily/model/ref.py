"""The reference ops as the kernel checks call them: fp32 on copies of the inputs, new
states returned instead of updated. Each calls the model's own reference (the maths is
written once, in the modules beside this one)."""

from __future__ import annotations

import torch

from lily.model.attention import attention_mixer
from lily.model.deltanet import deltanet_mixer
from lily.model.linear import linear
from lily.model.moe import route as ref_route
from lily.model.moe import sparse_moe
from lily.quant import Weight

Tensor = torch.Tensor

__all__ = ["ref_attention", "ref_deltanet", "ref_moe", "ref_qlinear", "ref_route"]


def _f32(x: Tensor) -> Tensor:
    return x.detach().to(torch.float32)


def ref_qlinear(x: Tensor, w: Weight, residual: Tensor | None = None) -> Tensor:
    """fp32 ``residual + x @ w.T`` for x (..., K) and w (N, K)."""
    y = linear(_f32(x), w)
    return y if residual is None else y + _f32(residual)


def ref_moe(x: Tensor, router: Weight, gate: Weight, up: Weight, down: Weight,
            shared_gate: Weight | None, shared_up: Weight | None, shared_down: Weight | None,
            shared_expert_gate: Weight | None, top_k: int, residual: Tensor | None = None,
            ids: Tensor | None = None) -> Tensor:  # fmt: skip
    """fp32 ``residual + moe(x)`` for x (T, D) or (D,) (``sparse_moe``; ``ids`` forces the
    routing)."""
    x2 = _f32(x).reshape(-1, x.shape[-1])
    out = sparse_moe(x2, router, gate, up, down, shared_gate, shared_up, shared_down,
                     shared_expert_gate, top_k, ids=ids)  # fmt: skip
    if residual is not None:
        out = out + _f32(residual).reshape(out.shape)
    return out.reshape(x.shape)


def ref_deltanet(mixed_qkv: Tensor, z: Tensor, b: Tensor, a: Tensor, conv_weight: Tensor,
                 conv_state: Tensor, A_log: Tensor, dt_bias: Tensor, norm_weight: Tensor,
                 state: Tensor, eps: float = 1e-6) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """``deltanet_mixer`` in fp32: (out (T, Hv*Vd), new conv state, new state)."""
    conv, st = _f32(conv_state).clone(), _f32(state).clone()
    out = deltanet_mixer(_f32(mixed_qkv), _f32(z), _f32(b), _f32(a), conv_weight, conv,
                         A_log, dt_bias, norm_weight, st, eps)  # fmt: skip
    return out, conv, st


def ref_attention(qg: Tensor, k: Tensor, v: Tensor, q_norm: Tensor, k_norm: Tensor,
                  k_cache: Tensor, v_cache: Tensor, start: int, rotary_dim: int, theta: float,
                  eps: float = 1e-6) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """``attention_mixer`` in fp32: (out (T, H*Dh), new k cache, new v cache). The caches
    come back in their dtype; this chunk's own keys and values enter the attention
    unrounded (fp32)."""
    kc, vc = _f32(k_cache).clone(), _f32(v_cache).clone()
    out = attention_mixer(_f32(qg), _f32(k), _f32(v), q_norm, k_norm, kc, vc, start,
                          rotary_dim, theta, eps)  # fmt: skip
    return out, kc.to(k_cache.dtype), vc.to(v_cache.dtype)
