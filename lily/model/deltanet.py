"""Gated DeltaNet: causal depthwise conv, then the gated delta-rule recurrence (the
reference maths, token by token)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from lily.model.norm import gated_rms_norm, l2_norm


def causal_conv(x: torch.Tensor, conv_state: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv + SiLU over x (T, C) with the carried last inputs.

    ``conv_state`` (Kc-1, C) is updated in place to the last Kc-1 inputs. Returns (T, C) in
    x's dtype (fp32 sums).
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
    cuts: Sequence[int] = (),
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Token-by-token gated delta rule in fp32, updating ``state`` (Hv, K, Vd) in place.

    q, k: (T, Hk, K) already normalised (q scaled), value head j reads key head
    j // (Hv // Hk); v: (T, Hv, Vd); g, beta: (T, Hv). Returns o (T, Hv, Vd) fp32 and copies
    of the state after the first ``c`` tokens for each ``c`` in ``cuts``.
    """
    rep = v.shape[1] // k.shape[1]
    qf = q.float().repeat_interleave(rep, dim=1)
    kf = k.float().repeat_interleave(rep, dim=1)
    vf, s = v.float(), state
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    decay = g.float().exp()
    beta = beta.float()
    taken, at = [], set(cuts)
    for t in range(v.shape[0]):
        s.mul_(decay[t, :, None, None])
        kv_mem = torch.einsum("hkv,hk->hv", s, kf[t])
        delta = (vf[t] - kv_mem) * beta[t, :, None]
        s.add_(kf[t][:, :, None] * delta[:, None, :])
        out[t] = torch.einsum("hkv,hk->hv", s, qf[t])
        if t + 1 in at:
            taken.append(s.clone())
    return out, taken


def deltanet_mixer(
    mixed_qkv: torch.Tensor,
    z: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_state: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    state: torch.Tensor,
    eps: float = 1e-6,
    cuts: Sequence[int] = (),
    snaps: list | None = None,
) -> torch.Tensor:
    """One Gated DeltaNet mixer over T tokens (MODEL.md), between the projections.

    mixed_qkv (T, C) the in_proj_qkv output q|k|v (C = 2*Hk*K + Hv*Vd); z (T, Hv*Vd); b, a
    (T, Hv); conv_weight (C, W); conv_state (W-1, C) and state (Hv, K, Vd) fp32, both
    updated in place. Returns (T, Hv*Vd) in mixed_qkv's dtype. ``cuts``: increasing offsets
    in (0, T); the states after the first ``c`` tokens go to ``snaps`` as (conv_state,
    state) copies, as the kernel does.
    """
    hv, dk, dv = state.shape
    t_len, c = mixed_qkv.shape
    hk = (c - hv * dv) // (2 * dk)
    kc = conv_weight.shape[-1]
    xin = torch.cat([conv_state.to(mixed_qkv.dtype), mixed_qkv], dim=0)
    convs = [xin[cut : cut + kc - 1].to(conv_state.dtype) for cut in cuts]
    qkv = causal_conv(mixed_qkv, conv_state, conv_weight)
    q, k, v = torch.split(qkv, [hk * dk, hk * dk, hv * dv], dim=-1)
    q = l2_norm(q.reshape(t_len, hk, dk)) * dk**-0.5
    k = l2_norm(k.reshape(t_len, hk, dk))
    beta = torch.sigmoid(b.float())
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    o, states = gated_delta_scan(q, k, v.reshape(t_len, hv, dv), g, beta, state, cuts)
    if snaps is not None:
        snaps.extend(zip(convs, states, strict=True))
    o = gated_rms_norm(o.to(mixed_qkv.dtype), z.reshape(t_len, hv, dv), norm_weight, eps)
    return o.reshape(t_len, hv * dv)
