"""Gated GQA attention with partial RoPE over a growing KV cache (the reference maths)."""

from __future__ import annotations

import torch

from lily.model.norm import rms_norm
from lily.model.rope import apply_rope, rope_cos_sin

# Bound the (heads x queries x keys) score block so long contexts never allocate
# scores for the whole chunk at once (the runtime's memory estimate counts it).
SCORE_ELEMS = 1 << 26


def attention_core(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float
) -> torch.Tensor:
    """Causal GQA attention in fp32.

    q: (T, H, Dh) at positions [start, start+T); k, v: (Hkv, L, Dh) with L = start + T.
    Returns (T, H, Dh) in q's dtype.
    """
    t_len, h, dh = q.shape
    hkv, kv_len, _ = k.shape
    g = h // hkv
    kf, vf = k.float(), v.float()
    qh = q.float().transpose(0, 1).reshape(hkv, g, t_len, dh)
    out = torch.empty(hkv, g, t_len, dh, dtype=torch.float32, device=q.device)
    block = max(1, SCORE_ELEMS // max(1, h * kv_len))
    keys = torch.arange(kv_len, device=q.device)
    for t0 in range(0, t_len, block):
        t1 = min(t_len, t0 + block)
        s = torch.einsum("hgtd,hld->hgtl", qh[:, :, t0:t1], kf) * scale
        qpos = start + torch.arange(t0, t1, device=q.device)
        s = s.masked_fill(keys[None, :] > qpos[:, None], float("-inf"))
        out[:, :, t0:t1] = torch.einsum("hgtl,hld->hgtd", torch.softmax(s, dim=-1), vf)
    return out.reshape(h, t_len, dh).transpose(0, 1).to(q.dtype)


def attention_mixer(
    qg: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_norm: torch.Tensor,
    k_norm: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    start: int,
    rotary_dim: int,
    theta: float,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Gated attention of T new tokens at positions [start, start+T) (MODEL.md).

    qg (T, H*2*Dh): per head Dh query then Dh gate; k, v (T, Hkv*Dh) the projections;
    q_norm, k_norm (Dh,); k_cache, v_cache (Hkv, T_max, Dh) hold positions [0, start) and
    get rows [start, start+T) written here (in their dtype; the attention reads them back).
    Returns (T, H*Dh) in qg's dtype, before o_proj.
    """
    t_len = qg.shape[0]
    hkv, _, dh = k_cache.shape
    h = qg.shape[1] // (2 * dh)
    qg = qg.reshape(t_len, h, 2 * dh)
    q, gate = qg[..., :dh], qg[..., dh:].reshape(t_len, h * dh)
    q = rms_norm(q, q_norm, eps)
    k = rms_norm(k.reshape(t_len, hkv, dh), k_norm, eps)
    pos = torch.arange(start, start + t_len, device=qg.device)
    cos, sin = rope_cos_sin(pos, rotary_dim, theta)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    end = start + t_len
    k_cache[:, start:end] = k.transpose(0, 1).to(k_cache.dtype)
    v_cache[:, start:end] = v.reshape(t_len, hkv, dh).transpose(0, 1).to(v_cache.dtype)
    o = attention_core(q, k_cache[:, :end], v_cache[:, :end], start, dh**-0.5)
    return o.reshape(t_len, h * dh) * torch.sigmoid(gate.float()).to(o.dtype)
