"""Full (gated, GQA) attention layer with partial RoPE over a growing KV cache."""

from __future__ import annotations

import torch

from lily.config import ModelConfig
from lily.model.linear import linear
from lily.model.norm import rms_norm
from lily.model.rope import apply_rope, rope_cos_sin
from lily.quant import Weight

# Bound the (heads x queries x keys) score block so long contexts never allocate
# scores for the whole chunk at once.
_SCORE_ELEMS = 1 << 26


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
    block = max(1, _SCORE_ELEMS // max(1, h * kv_len))
    keys = torch.arange(kv_len, device=q.device)
    for t0 in range(0, t_len, block):
        t1 = min(t_len, t0 + block)
        s = torch.einsum("hgtd,hld->hgtl", qh[:, :, t0:t1], kf) * scale
        qpos = start + torch.arange(t0, t1, device=q.device)
        s = s.masked_fill(keys[None, :] > qpos[:, None], float("-inf"))
        out[:, :, t0:t1] = torch.einsum("hgtl,hld->hgtd", torch.softmax(s, dim=-1), vf)
    return out.reshape(h, t_len, dh).transpose(0, 1).to(q.dtype)


def attention_layer(
    p: dict[str, Weight], pre: str, x: torch.Tensor, cache, start: int, cfg: ModelConfig
) -> torch.Tensor:
    """One attention mixer for x (T, D) at positions [start, start+T); writes K, V to cache."""
    t_len = x.shape[0]
    h, hkv, dh = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    qg = linear(x, p[pre + "q_proj"]).view(t_len, h, 2 * dh)
    q, gate = qg[..., :dh], qg[..., dh:].reshape(t_len, h * dh)
    k = linear(x, p[pre + "k_proj"]).view(t_len, hkv, dh)
    v = linear(x, p[pre + "v_proj"]).view(t_len, hkv, dh)
    q = rms_norm(q, p[pre + "q_norm"], cfg.rms_norm_eps)
    k = rms_norm(k, p[pre + "k_norm"], cfg.rms_norm_eps)
    pos = torch.arange(start, start + t_len, device=x.device)
    cos, sin = rope_cos_sin(pos, cfg.rotary_dim, cfg.rope_theta)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    end = start + t_len
    cache.ensure(end)
    cache.k[:, start:end] = k.transpose(0, 1).to(cache.k.dtype)
    cache.v[:, start:end] = v.transpose(0, 1).to(cache.v.dtype)
    o = attention_core(q, cache.k[:, :end], cache.v[:, :end], start, dh**-0.5)
    o = o.reshape(t_len, h * dh) * torch.sigmoid(gate.float()).to(o.dtype)
    return linear(o, p[pre + "o_proj"])
