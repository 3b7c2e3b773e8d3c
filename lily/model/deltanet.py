"""Gated DeltaNet layer: causal depthwise conv, then the gated delta-rule recurrence."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lily.config import ModelConfig
from lily.model.linear import linear
from lily.model.norm import gated_rms_norm, l2_norm
from lily.quant import Weight


def causal_conv(x: torch.Tensor, conv_state: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv + SiLU over x (T, C) with the carried last inputs.

    ``conv_state`` (Kc-1, C) is updated in place to the last Kc-1 inputs.
    """
    kc = w.shape[-1]
    xin = torch.cat([conv_state.to(x.dtype), x], dim=0)  # (Kc-1+T, C)
    conv_state.copy_(xin[-(kc - 1) :])
    windows = xin.unfold(0, kc, 1)  # (T, C, Kc)
    out = (windows.float() * w.float()).sum(-1)
    return F.silu(out).to(x.dtype)


def gated_delta_scan(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> torch.Tensor:
    """Token-by-token gated delta rule in fp32, updating ``state`` (Hv, K, Vd) in place.

    q, k: (T, Hv, K) (already normalised and repeated per value head); v: (T, Hv, Vd);
    g, beta: (T, Hv). Returns o (T, Hv, Vd) fp32.
    """
    s = state
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    qf, kf, vf = q.float(), k.float(), v.float()
    decay = g.float().exp()
    for t in range(v.shape[0]):
        s.mul_(decay[t, :, None, None])
        kv_mem = torch.einsum("hkv,hk->hv", s, kf[t])
        delta = (vf[t] - kv_mem) * beta[t, :, None]
        s.add_(kf[t][:, :, None] * delta[:, None, :])
        out[t] = torch.einsum("hkv,hk->hv", s, qf[t])
    return out


def deltanet_layer(
    p: dict[str, Weight], pre: str, x: torch.Tensor, st, cfg: ModelConfig
) -> torch.Tensor:
    """One Gated DeltaNet mixer for x (T, D); advances ``st`` (conv and recurrent state)."""
    t_len = x.shape[0]
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    qkv = causal_conv(linear(x, p[pre + "in_proj_qkv"]), st.conv, p[pre + "conv1d"])
    z = linear(x, p[pre + "in_proj_z"]).view(t_len, hv, dv)
    b = linear(x, p[pre + "in_proj_b"]).float()
    a = linear(x, p[pre + "in_proj_a"]).float()

    q, k, v = torch.split(qkv, [hk * dk, hk * dk, hv * dv], dim=-1)
    rep = hv // hk  # value head j reads key head j // rep
    q = (l2_norm(q.view(t_len, hk, dk)) * dk**-0.5).repeat_interleave(rep, dim=1)
    k = l2_norm(k.view(t_len, hk, dk)).repeat_interleave(rep, dim=1)
    beta = torch.sigmoid(b)
    g = -p[pre + "A_log"].float().exp() * F.softplus(a + p[pre + "dt_bias"].float())
    o = gated_delta_scan(q, k, v.reshape(t_len, hv, dv), g, beta, st.recurrent)
    o = gated_rms_norm(o.to(x.dtype), z, p[pre + "norm"], cfg.rms_norm_eps)
    return linear(o.reshape(t_len, hv * dv), p[pre + "out_proj"])
