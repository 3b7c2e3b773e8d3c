"""Plain-PyTorch references of the mixer ops (Gated DeltaNet and full attention).

Written from MODEL.md in float32, token by token where the maths is a recurrence, with no
attempt at speed: the Triton kernels in this package are checked against these. Every
function is functional (it returns new states instead of updating its arguments).

Shape letters: T tokens, C conv channels (2*Hk*K + Hv*Vd), Hk/Hv DeltaNet key/value heads,
K/Vd their head dims, H query heads, Hkv KV heads, Dh attention head dim, R rotary dims.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

Tensor = torch.Tensor


def _f32(x: Tensor) -> Tensor:
    return x.detach().to(torch.float32)


def ref_rmsnorm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``x * rsqrt(mean(x^2) + eps) * weight`` over the last dim (weight is the multiplier)."""
    x = _f32(x)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * _f32(weight)


def ref_rope(x: Tensor, positions: Tensor, rotary_dim: int, theta: float) -> Tensor:
    """Rotate-half (non-interleaved) RoPE on the first ``rotary_dim`` dims of ``x`` (..., T, Dh).

    ``positions`` (T,) are absolute token positions; the angle is computed in fp32 as
    ``pos * theta^(-2i/R)`` like the model's own rotary embedding.
    """
    x = _f32(x)
    half = rotary_dim // 2
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim)
    )
    ang = positions.to(torch.float32)[:, None] * inv_freq.to(x.device)[None, :]  # (T, R/2)
    cos, sin = ang.cos(), ang.sin()
    x1, x2, rest = x[..., :half], x[..., half:rotary_dim], x[..., rotary_dim:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)


# ----------------------------------------------------------------------------- DeltaNet


def ref_causal_conv(x: Tensor, conv_state: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    """Depthwise causal conv1d + SiLU over time.

    x (T, C), conv_state (W-1, C) the last W-1 inputs before x, weight (C, W).
    Returns y (T, C) fp32 and the new conv state (W-1, C) (the last W-1 inputs, fp32).
    """
    w = _f32(weight)
    width = w.shape[1]
    xx = torch.cat([_f32(conv_state), _f32(x)], dim=0)  # (W-1+T, C)
    t = x.shape[0]
    y = torch.zeros(t, x.shape[1], dtype=torch.float32, device=x.device)
    for j in range(width):
        y += xx[j : j + t] * w[:, j]
    return F.silu(y), xx[t:].clone()


def ref_deltanet_gates(
    b: Tensor, a: Tensor, A_log: Tensor, dt_bias: Tensor
) -> tuple[Tensor, Tensor]:
    """beta = sigmoid(b); g = -exp(A_log) * softplus(a + dt_bias); all (T, Hv) fp32."""
    beta = torch.sigmoid(_f32(b))
    g = -torch.exp(_f32(A_log)) * F.softplus(_f32(a) + _f32(dt_bias))
    return g, beta


def ref_gated_delta_rule(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor
) -> tuple[Tensor, Tensor]:
    """The gated delta rule, one token at a time.

    q, k (T, Hk, K) already normalised and scaled; v (T, Hv, Vd); g, beta (T, Hv); state
    (Hv, K, Vd). Value head j reads key head j // (Hv // Hk). Returns o (T, Hv, Vd) and the
    final state, fp32.
    """
    hv, hk = v.shape[1], k.shape[1]
    rep = hv // hk
    q = _f32(q).repeat_interleave(rep, dim=1)
    k = _f32(k).repeat_interleave(rep, dim=1)
    v, g, beta, s = _f32(v), _f32(g), _f32(beta), _f32(state).clone()
    out = torch.empty_like(v)
    for t in range(v.shape[0]):
        s = s * torch.exp(g[t])[:, None, None]
        kv = torch.einsum("hkv,hk->hv", s, k[t])
        delta = beta[t][:, None] * (v[t] - kv)
        s = s + k[t][:, :, None] * delta[:, None, :]
        out[t] = torch.einsum("hkv,hk->hv", s, q[t])
    return out, s


def ref_gated_rmsnorm(o: Tensor, z: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Per head ``rmsnorm(o) * weight * silu(z)``; o, z (..., Vd) fp32 result."""
    return ref_rmsnorm(o, weight, eps) * F.silu(_f32(z))


def ref_deltanet(
    mixed_qkv: Tensor,
    z: Tensor,
    b: Tensor,
    a: Tensor,
    conv_weight: Tensor,
    conv_state: Tensor,
    A_log: Tensor,
    dt_bias: Tensor,
    norm_weight: Tensor,
    state: Tensor,
    eps: float = 1e-6,
) -> tuple[Tensor, Tensor, Tensor]:
    """One Gated DeltaNet mixer over T tokens with carried state (MODEL.md), without projections.

    mixed_qkv (T, C) is the in_proj_qkv output (q | k | v), z (T, Hv*Vd), b and a (T, Hv),
    conv_weight (C, W), conv_state (W-1, C), A_log and dt_bias (Hv,), norm_weight (Vd,),
    state (Hv, K, Vd). Returns (out (T, Hv*Vd), new conv state, new state), all fp32.
    """
    hv, kd, vd = state.shape
    t, c = mixed_qkv.shape
    hk = (c - hv * vd) // (2 * kd)
    y, new_conv = ref_causal_conv(mixed_qkv, conv_state, conv_weight)
    q = y[:, : hk * kd].reshape(t, hk, kd)
    k = y[:, hk * kd : 2 * hk * kd].reshape(t, hk, kd)
    v = y[:, 2 * hk * kd :].reshape(t, hv, vd)
    # L2 norm per head: x * rsqrt(sum(x^2) + 1e-6); q also scaled by 1/sqrt(K).
    q = q * torch.rsqrt(q.pow(2).sum(-1, keepdim=True) + 1e-6) * kd**-0.5
    k = k * torch.rsqrt(k.pow(2).sum(-1, keepdim=True) + 1e-6)
    g, beta = ref_deltanet_gates(b, a, A_log, dt_bias)
    o, new_state = ref_gated_delta_rule(q, k, v, g, beta, state)
    out = ref_gated_rmsnorm(o, _f32(z).reshape(t, hv, vd), norm_weight, eps)
    return out.reshape(t, hv * vd), new_conv, new_state


# ----------------------------------------------------------------------------- attention


def ref_attention(
    qg: Tensor,
    k: Tensor,
    v: Tensor,
    q_norm: Tensor,
    k_norm: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    start: int,
    rotary_dim: int,
    theta: float,
    eps: float = 1e-6,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gated full attention of T new tokens at positions [start, start+T) (MODEL.md).

    qg (T, H*2*Dh): per head Dh query then Dh gate; k, v (T, Hkv*Dh) the projections;
    q_norm, k_norm (Dh,); k_cache, v_cache (Hkv, T_max, Dh) hold positions [0, start).
    Returns (out (T, H*Dh) fp32, new k cache, new v cache); the caches keep their dtype,
    while this chunk's own keys and values enter the attention unrounded (fp32).
    """
    hkv, _, dh = k_cache.shape
    t = qg.shape[0]
    h = qg.shape[1] // (2 * dh)
    qg = _f32(qg).reshape(t, h, 2 * dh)
    q, gate = qg[..., :dh], qg[..., dh:]
    pos = torch.arange(start, start + t, device=qg.device)
    q = ref_rope(ref_rmsnorm(q, q_norm, eps).transpose(0, 1), pos, rotary_dim, theta)  # (H,T,Dh)
    kk = ref_rope(
        ref_rmsnorm(_f32(k).reshape(t, hkv, dh), k_norm, eps).transpose(0, 1),
        pos,
        rotary_dim,
        theta,
    )  # (Hkv, T, Dh)
    vv = _f32(v).reshape(t, hkv, dh).transpose(0, 1)
    new_k, new_v = k_cache.clone(), v_cache.clone()
    new_k[:, start : start + t] = kk.to(k_cache.dtype)
    new_v[:, start : start + t] = vv.to(v_cache.dtype)
    keys = torch.cat([_f32(k_cache[:, :start]), kk], dim=1)  # (Hkv, start+T, Dh)
    vals = torch.cat([_f32(v_cache[:, :start]), vv], dim=1)
    rep = h // hkv
    keys = keys.repeat_interleave(rep, dim=0)
    vals = vals.repeat_interleave(rep, dim=0)
    scores = (q @ keys.transpose(1, 2)) * dh**-0.5  # (H, T, start+T)
    kpos = torch.arange(start + t, device=qg.device)
    scores = scores.masked_fill(kpos[None, None, :] > pos[None, :, None], float("-inf"))
    o = torch.softmax(scores, dim=-1) @ vals  # (H, T, Dh)
    out = o.transpose(0, 1) * torch.sigmoid(gate)
    return out.reshape(t, h * dh), new_k, new_v
