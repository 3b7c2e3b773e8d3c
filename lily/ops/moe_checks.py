"""The checks every MoE launcher makes before it launches (moe_decode, moe_decode_rows,
moe_prefill): the experts', the router's and the shared expert's shapes, bits and strides,
x, top_k, the residual and the norm weight, each failure a ValueError naming the launcher
and the problem."""

from __future__ import annotations

import torch

from lily.ops.launch import check_weight, check_x
from lily.ops.rmsnorm import check_norm
from lily.quant import QuantWeight

Tensor = torch.Tensor


def check_moe_weights(
    gate: QuantWeight, up: QuantWeight, down: QuantWeight, name: str
) -> tuple[int, int, int]:
    check_weight(gate, f"{name}: gate", 3)
    check_weight(up, f"{name}: up", 3)
    check_weight(down, f"{name}: down", 3)
    e, i, d = gate.shape
    if tuple(up.shape) != (e, i, d) or tuple(down.shape) != (e, d, i):
        raise ValueError(
            f"{name}: expert shapes gate {gate.shape}, up {up.shape}, down {down.shape} do not "
            f"form (E, I, D), (E, I, D), (E, D, I)"
        )
    for w in (up, down):
        if (w.bits, w.group_size) != (gate.bits, gate.group_size):
            raise ValueError(f"{name}: gate, up and down must share bits and group size")
    if gate.qweight.stride() != up.qweight.stride() or gate.scales.stride() != up.scales.stride():
        raise ValueError(f"{name}: gate and up must share strides")
    return e, i, d


def check_shared(
    sg: QuantWeight | None, su: QuantWeight | None, sd: QuantWeight | None,
    seg: QuantWeight | None, gate: QuantWeight, d: int, name: str,
) -> int:  # fmt: skip
    """Validates the shared expert (all four or none); returns its intermediate size."""
    parts = (sg, su, sd, seg)
    if all(p is None for p in parts):
        return 0
    if any(p is None for p in parts):
        raise ValueError(f"{name}: give all of shared gate/up/down and shared_expert_gate, or none")
    for p, nm in ((sg, "shared_gate"), (su, "shared_up"), (sd, "shared_down")):
        check_weight(p, f"{name}: {nm}", 2)
        if (p.bits, p.group_size) != (gate.bits, gate.group_size):
            raise ValueError(f"{name}: {nm} must have the experts' bits and group size")
    check_weight(seg, f"{name}: shared_expert_gate", 2)
    i_s = sg.shape[0]
    if tuple(sg.shape) != (i_s, d) or tuple(su.shape) != (i_s, d) or tuple(sd.shape) != (d, i_s):
        raise ValueError(
            f"{name}: shared expert shapes {sg.shape}, {su.shape}, {sd.shape} do not form "
            f"(Is, D), (Is, D), (D, Is)"
        )
    if sg.qweight.stride() != su.qweight.stride() or sg.scales.stride() != su.scales.stride():
        raise ValueError(f"{name}: shared gate and up must share strides")
    if tuple(seg.shape) != (1, d):
        raise ValueError(f"{name}: shared_expert_gate must be (1, {d}), got {seg.shape}")
    return i_s


def check_moe(name: str, x: Tensor, weights: tuple, top_k: int, residual: Tensor | None,
              norm_weight: Tensor | None, dims: int | tuple[int, ...],
              what: str) -> tuple:  # fmt: skip
    """The checks every MoE launcher makes, with clear errors: the experts' (``weights``:
    router, gate, up, down, shared gate, up, down, shared_expert_gate), the router's and
    the shared expert's shapes, x (``dims`` dims, or one of them; ``what`` names the
    form), top_k, the residual (x's shape) and the norm weight. Returns (E, I, D, I_s, the
    norm weight)."""
    router, gate, up, down, *shared = weights
    e, i, d = check_moe_weights(gate, up, down, name)
    check_weight(router, f"{name}: router", 2)
    if tuple(router.shape) != (e, d):
        raise ValueError(f"{name}: router {router.shape} must be (E, D) = ({e}, {d})")
    i_s = check_shared(*shared, gate, d, name)
    check_x(x, d, name, gate.device)
    if x.dim() not in ((dims,) if isinstance(dims, int) else dims):
        raise ValueError(f"{name}: x must be {what}, got {tuple(x.shape)}")
    if not 1 <= top_k <= e:
        raise ValueError(f"{name}: top_k {top_k} must be in 1..{e}")
    if residual is not None and (residual.shape != x.shape or residual.device != x.device):
        raise ValueError(f"{name}: residual must be {tuple(x.shape)} on {x.device}")
    if norm_weight is not None:
        norm_weight = check_norm(norm_weight, d, name, x.device)
    return e, i, d, i_s, norm_weight
