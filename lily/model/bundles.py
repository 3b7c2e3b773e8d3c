"""Typed weight bundles: the canonical parameters (docs/CONTRACTS.md) grouped per layer kind.

Built once from the flat dict ``lily.weights`` produces. The input projections that read
the same normed input are fused here, at load, into one weight whose output rows are theirs
in order (one GEMV in decode, one GEMM in prefill); ``params()`` gives the canonical names
back, the fused projections as row views of the fused weight.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lily.config import ModelConfig
from lily.quant import QuantWeight, Weight

Tensor = torch.Tensor

# Canonical names of the projections each mixer fuses (output rows in this order).
ATTENTION_PROJ = ("q_proj", "k_proj", "v_proj")
DELTANET_PROJ = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
MOE_NAMES = ("router", "gate_proj", "up_proj", "down_proj", "shared_gate_proj",
             "shared_up_proj", "shared_down_proj", "shared_expert_gate")  # fmt: skip


@dataclass(frozen=True, slots=True)
class Fused:
    """Linear layers over one input as one weight: ``weight`` (sum(sizes), K), whose output
    splits into pieces of ``sizes`` columns."""

    weight: Weight
    sizes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class AttentionWeights:
    """Gated full attention. ``proj`` yields q with its gate (H*2*Dh), k and v (Hkv*Dh)."""

    proj: tuple[Fused, ...]
    q_norm: Tensor
    k_norm: Tensor
    out_proj: Weight  # o_proj (D, H*Dh)


@dataclass(frozen=True, slots=True)
class DeltaNetWeights:
    """Gated DeltaNet. ``proj`` yields mixed q|k|v (C), z (Hv*Vd), b and a (Hv)."""

    proj: tuple[Fused, ...]
    conv1d: Tensor  # (C, kernel)
    A_log: Tensor  # (Hv,) fp32
    dt_bias: Tensor  # (Hv,)
    norm: Tensor  # (Vd,)
    out_proj: Weight  # (D, Hv*Vd)


@dataclass(frozen=True, slots=True)
class MoEWeights:
    """Routed experts and the gated shared expert (fields in the MoE kernels' order)."""

    router: Weight  # (E, D)
    gate_proj: Weight  # (E, I, D)
    up_proj: Weight  # (E, I, D)
    down_proj: Weight  # (E, D, I)
    shared_gate_proj: Weight  # (Is, D)
    shared_up_proj: Weight  # (Is, D)
    shared_down_proj: Weight  # (D, Is)
    shared_expert_gate: Weight  # (1, D)


@dataclass(frozen=True, slots=True)
class LayerWeights:
    """One decoder layer: input norm, mixer, post norm, MoE."""

    input_norm: Tensor
    mixer: AttentionWeights | DeltaNetWeights
    post_norm: Tensor
    moe: MoEWeights


@dataclass(frozen=True, slots=True)
class ModelWeights:
    """The whole model; ``extra`` holds parameters the decoder does not use (``mtp.*``)."""

    embed_tokens: Weight
    layers: tuple[LayerWeights, ...]
    norm: Tensor
    lm_head: Weight  # the same object as embed_tokens when tied
    extra: dict[str, Weight] = field(default_factory=dict)

    @classmethod
    def from_params(cls, cfg: ModelConfig, params: dict[str, Weight]) -> ModelWeights:
        """Bundle the canonical ``params`` (fusing the input projections); a missing name
        raises KeyError naming it."""
        p = dict(params)
        layers = []
        for i, kind in enumerate(cfg.layer_types):
            pre = f"layers.{i}."
            if kind == "linear_attention":
                d = pre + "dn."
                mixer = DeltaNetWeights(
                    fuse([p.pop(d + n) for n in DELTANET_PROJ]), p.pop(d + "conv1d"),
                    p.pop(d + "A_log"), p.pop(d + "dt_bias"), p.pop(d + "norm"),
                    p.pop(d + "out_proj"),
                )  # fmt: skip
            else:
                a = pre + "attn."
                mixer = AttentionWeights(
                    fuse([p.pop(a + n) for n in ATTENTION_PROJ]), p.pop(a + "q_norm"),
                    p.pop(a + "k_norm"), p.pop(a + "o_proj"),
                )  # fmt: skip
            moe = MoEWeights(*[p.pop(pre + "moe." + n) for n in MOE_NAMES])
            layers.append(LayerWeights(p.pop(pre + "input_norm"), mixer, p.pop(pre + "post_norm"),
                                       moe))  # fmt: skip
        embed, norm, head = p.pop("embed_tokens"), p.pop("norm"), p.pop("lm_head")
        return cls(embed, tuple(layers), norm, head, p)

    def params(self) -> dict[str, Weight]:
        """The canonical flat names (fused projections as views of their rows)."""
        out: dict[str, Weight] = {"embed_tokens": self.embed_tokens}
        for i, lw in enumerate(self.layers):
            pre = f"layers.{i}."
            out[pre + "input_norm"] = lw.input_norm
            out[pre + "post_norm"] = lw.post_norm
            m = lw.mixer
            if isinstance(m, DeltaNetWeights):
                d = pre + "dn."
                out.update(zip([d + n for n in DELTANET_PROJ], unfuse(m.proj), strict=True))
                out.update({d + "conv1d": m.conv1d, d + "A_log": m.A_log,
                            d + "dt_bias": m.dt_bias, d + "norm": m.norm,
                            d + "out_proj": m.out_proj})  # fmt: skip
            else:
                a = pre + "attn."
                out.update(zip([a + n for n in ATTENTION_PROJ], unfuse(m.proj), strict=True))
                out.update({a + "q_norm": m.q_norm, a + "k_norm": m.k_norm,
                            a + "o_proj": m.out_proj})  # fmt: skip
            for n in MOE_NAMES:
                out[pre + "moe." + n] = getattr(lw.moe, n)
        out["norm"] = self.norm
        out["lm_head"] = self.lm_head
        out.update(self.extra)
        return out


def _kind(w: Weight) -> tuple:
    if isinstance(w, QuantWeight):
        return ("q", w.bits, w.group_size, w.scales.dtype, w.qweight.shape[-1])
    return ("dense", w.dtype, w.shape[-1])


def fuse(ws: list[Weight]) -> tuple[Fused, ...]:
    """Consecutive weights of one kind (same packing, or dense of one dtype) as one weight
    each: one group for every checkpoint whose projections share their packing."""
    groups: list[list[Weight]] = []
    for w in ws:
        if groups and _kind(groups[-1][0]) == _kind(w):
            groups[-1].append(w)
        else:
            groups.append([w])
    return tuple(Fused(_cat(g), tuple(w.shape[-2] for w in g)) for g in groups)


def _cat(ws: list[Weight]) -> Weight:
    if len(ws) == 1:
        return ws[0]
    if isinstance(ws[0], QuantWeight):
        return QuantWeight(
            torch.cat([w.qweight for w in ws]),
            torch.cat([w.scales for w in ws]),
            torch.cat([w.biases for w in ws]),
            ws[0].bits,
            ws[0].group_size,
        )
    return torch.cat(ws)


def unfuse(proj: tuple[Fused, ...]) -> list[Weight]:
    """The separate weights of ``proj`` (row views of the fused ones)."""
    out = []
    for f in proj:
        start = 0
        for n in f.sizes:
            out.append(f.weight[start : start + n])
            start += n
    return out
