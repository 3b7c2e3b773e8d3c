"""MoE block for one decode token, on the GPU from router to residual, with no host sync.

Four launches, all shapes fixed (CUDA-graph capturable):

1. router GEMV (qgemv kernel, fp32 logits);
2. ``_moe_route_kernel`` (one program): softmax over E in fp32, top-k, renormalise, and the
   shared expert's gate ``sigmoid(shared_expert_gate . x)``; writes k+1 (expert, weight)
   slots, the shared expert riding along as slot k (expert id E);
3. ``_moe_gate_up_kernel``, grid (slots, I blocks): both projections of the slot's expert
   and ``silu(gate) * up`` fused; h (slots, I) fp32 never leaves L2;
4. ``_moe_down_kernel``, grid (D blocks,): each program owns its output rows across all
   slots, so the weighted sum and the residual add happen in registers (no atomics) and the
   result is written once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from lily.ops.qgemv import (
    GemvConfig,
    _launch_qgemv,
    cast_to,
    check_weight,
    check_x,
    gemv_block,
    gemv_config,
    mask_lo,
)
from lily.quant import QuantWeight

Tensor = torch.Tensor


@triton.jit
def _moe_route_kernel(
    p_logits, p_x, p_sgw, p_sgs, p_sgb, p_ids, p_wts, E, D, mask_lo_sg,
    TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr, HAS_SHARED: tl.constexpr,
    SG_BITS: tl.constexpr, SG_GROUP: tl.constexpr, SG_BLOCK_G: tl.constexpr,
    SG_STEPS: tl.constexpr,
):  # fmt: skip
    o_e = tl.arange(0, BLOCK_E)
    m_e = o_e < E
    b_l = tl.load(p_logits + o_e, mask=m_e, other=float("-inf")).to(tl.float32)
    b_p = tl.exp(b_l - tl.max(b_l, axis=0))
    b_p = b_p / tl.sum(b_p, axis=0)
    # Top-k by repeated argmax (ties: lowest index), then renormalise the k weights.
    o_k = tl.arange(0, BLOCK_K)
    ids = tl.zeros((BLOCK_K,), tl.int32)
    wts = tl.zeros((BLOCK_K,), tl.float32)
    for i in tl.static_range(TOP_K):
        b_max = tl.max(b_p, axis=0)
        i_max = tl.min(tl.where(b_p == b_max, o_e, BLOCK_E), axis=0)
        ids = tl.where(o_k == i, i_max, ids)
        wts = tl.where(o_k == i, b_max, wts)
        b_p = tl.where(o_e == i_max, -1.0, b_p)
    wts = wts / tl.sum(wts, axis=0)
    tl.store(p_ids + o_k, ids, mask=o_k < TOP_K)
    tl.store(p_wts + o_k, wts, mask=o_k < TOP_K)
    if HAS_SHARED:
        o_n = tl.arange(0, 2)
        b_g = gemv_block(
            p_x, 0, 1, p_sgw, p_sgs, p_sgb, 0, 0, o_n, o_n < 1, 0, D // SG_GROUP, mask_lo_sg,
            SG_BITS, SG_GROUP, SG_BLOCK_G, SG_STEPS, 1,
        )  # fmt: skip
        b_g = tl.sum(tl.sum(b_g, axis=1), axis=0)  # only row 0 is live
        tl.store(p_ids + TOP_K, E)
        tl.store(p_wts + TOP_K, 1.0 / (1.0 + tl.exp(-b_g)))


@triton.jit
def _moe_gate_up_kernel(
    p_x, p_ids, p_h,
    p_gw, p_gs, p_gb, p_uw, p_us, p_ub, stride_we, stride_se, stride_qn, stride_sn,
    p_sgw, p_sgs, p_sgb, p_suw, p_sus, p_sub, stride_sqn, stride_ssn,
    I_E, I_S, D, stride_h, mask_lo,
    TOP_K: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_G: tl.constexpr, STEPS: tl.constexpr,
):  # fmt: skip
    slot = tl.program_id(0)
    i_n = tl.program_id(1)
    e = tl.load(p_ids + slot)
    is_shared = slot == TOP_K
    n_rows = tl.where(is_shared, I_S, I_E)
    sqn = tl.where(is_shared, stride_sqn, stride_qn)
    ssn = tl.where(is_shared, stride_ssn, stride_sn)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < n_rows
    if i_n * BLOCK_N < n_rows:  # the shared expert may be wider than the routed ones
        # The slot's weights: expert e of the stacks, or the shared expert in the last slot.
        if is_shared:
            gw, gs, gb, uw, us, ub = p_sgw, p_sgs, p_sgb, p_suw, p_sus, p_sub
        else:
            e64 = e.to(tl.int64)
            gw = p_gw + e64 * stride_we
            gs = p_gs + e64 * stride_se
            gb = p_gb + e64 * stride_se
            uw = p_uw + e64 * stride_we
            us = p_us + e64 * stride_se
            ub = p_ub + e64 * stride_se
        n_groups = D // GROUP
        b_g = gemv_block(p_x, 0, 1, gw, gs, gb, sqn, ssn, o_n, m_n, 0, n_groups, mask_lo,
                         BITS, GROUP, BLOCK_G, STEPS, 1)  # fmt: skip
        b_u = gemv_block(p_x, 0, 1, uw, us, ub, sqn, ssn, o_n, m_n, 0, n_groups, mask_lo,
                         BITS, GROUP, BLOCK_G, STEPS, 1)  # fmt: skip
        b_h = b_g / (1.0 + tl.exp(-b_g)) * b_u
        tl.store(p_h + slot * stride_h + o_n[None, :], b_h, mask=m_n[None, :])


@triton.jit
def _moe_down_kernel(
    p_h, p_ids, p_wts, p_res, p_out,
    p_dw, p_ds, p_db, stride_we, stride_se, stride_qn, stride_sn,
    p_sdw, p_sds, p_sdb, stride_sqn, stride_ssn,
    D, I_E, I_S, stride_h, mask_lo,
    TOP_K: tl.constexpr, N_SLOTS: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, STEPS: tl.constexpr,
    STEPS_S: tl.constexpr, HAS_RES: tl.constexpr, ON_CPU: tl.constexpr,
):  # fmt: skip
    i_n = tl.program_id(0)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < D
    acc = tl.zeros((1, BLOCK_N), tl.float32)
    for slot in tl.static_range(N_SLOTS):
        e = tl.load(p_ids + slot)
        w_r = tl.load(p_wts + slot)
        if slot == TOP_K:
            c = gemv_block(p_h + slot * stride_h, 0, 1, p_sdw, p_sds, p_sdb, stride_sqn,
                           stride_ssn, o_n, m_n, 0, I_S // GROUP, mask_lo, BITS, GROUP,
                           BLOCK_G, STEPS_S, 1)  # fmt: skip
        else:
            e64 = e.to(tl.int64)
            c = gemv_block(p_h + slot * stride_h, 0, 1, p_dw + e64 * stride_we,
                           p_ds + e64 * stride_se, p_db + e64 * stride_se, stride_qn, stride_sn,
                           o_n, m_n, 0, I_E // GROUP, mask_lo, BITS, GROUP, BLOCK_G, STEPS,
                           1)  # fmt: skip
        acc += w_r * c
    if HAS_RES:
        acc += tl.load(p_res + o_n[None, :], mask=m_n[None, :], other=0.0).to(tl.float32)
    b_o = cast_to(acc, p_out.dtype.element_ty, ON_CPU)
    tl.store(p_out + o_n[None, :], b_o, mask=m_n[None, :])


@dataclass(frozen=True)
class MoeDecodeConfig:
    """Rows per program of the gate/up and down kernels, and their warps."""

    gate_up: GemvConfig = GemvConfig(16, 32, 1, 4)
    down: GemvConfig = GemvConfig(8, 8, 1, 4)


def _check_moe_weights(
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


def _check_shared(
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


def _steps(k: int, group_size: int, block_g: int) -> int:
    return triton.cdiv(k // group_size, block_g)


def moe_decode(
    x: Tensor,
    router: QuantWeight,
    gate: QuantWeight,
    up: QuantWeight,
    down: QuantWeight,
    shared_gate: QuantWeight | None,
    shared_up: QuantWeight | None,
    shared_down: QuantWeight | None,
    shared_expert_gate: QuantWeight | None,
    top_k: int,
    residual: Tensor | None = None,
    *,
    config: MoeDecodeConfig | None = None,
) -> Tensor:
    """``residual + moe(x)`` for one token x (D,) -> (D,) in x's dtype.

    router (E, D); gate, up (E, I, D); down (E, D, I); the shared expert (Is, D), (Is, D),
    (D, Is) and its gate (1, D), all QuantWeight (or all four shared parts None).
    """
    name = "moe_decode"
    e, i, d = _check_moe_weights(gate, up, down, name)
    check_weight(router, f"{name}: router", 2)
    if tuple(router.shape) != (e, d):
        raise ValueError(f"{name}: router {router.shape} must be (E, D) = ({e}, {d})")
    i_s = _check_shared(shared_gate, shared_up, shared_down, shared_expert_gate, gate, d, name)
    check_x(x, d, name, gate.device)
    if x.dim() != 1:
        raise ValueError(f"{name}: x must be one token (D,), got {tuple(x.shape)}")
    if not 1 <= top_k <= e:
        raise ValueError(f"{name}: top_k {top_k} must be in 1..{e}")
    if residual is not None and (tuple(residual.shape) != (d,) or residual.device != x.device):
        raise ValueError(f"{name}: residual must be ({d},) on {x.device}")
    x = x.contiguous()
    cfg = config or MoeDecodeConfig()
    dev = x.device
    has_shared = i_s > 0
    n_slots = top_k + int(has_shared)

    logits = torch.empty((1, e), dtype=torch.float32, device=dev)
    _launch_qgemv(
        x.reshape(1, d), router, None, logits, gemv_config(e, d, 1, router.bits, router.group_size)
    )
    ids = torch.empty(n_slots, dtype=torch.int32, device=dev)
    wts = torch.empty(n_slots, dtype=torch.float32, device=dev)
    seg = shared_expert_gate if has_shared else router
    sg_block_g = min(8, triton.next_power_of_2(d // seg.group_size))
    _moe_route_kernel[(1,)](
        logits, x, seg.qweight, seg.scales, seg.biases, ids, wts, e, d, mask_lo(seg.bits),
        TOP_K=top_k, BLOCK_K=triton.next_power_of_2(top_k), BLOCK_E=triton.next_power_of_2(e),
        HAS_SHARED=has_shared,
        SG_BITS=seg.bits, SG_GROUP=seg.group_size, SG_BLOCK_G=sg_block_g,
        SG_STEPS=_steps(d, seg.group_size, sg_block_g),
        num_warps=1,  # one warp: the 2k+2 reductions are shuffles, no barriers (latency)
    )  # fmt: skip

    i_max = max(i, i_s)
    h = torch.empty((n_slots, i_max), dtype=torch.float32, device=dev)
    gu = cfg.gate_up
    gu_bg = min(gu.block_g, triton.next_power_of_2(d // gate.group_size))
    sg, su, sd = (shared_gate, shared_up, shared_down) if has_shared else (gate[0], up[0], down[0])
    _moe_gate_up_kernel[(n_slots, triton.cdiv(i_max, gu.block_n))](
        x, ids, h,
        gate.qweight, gate.scales, gate.biases, up.qweight, up.scales, up.biases,
        gate.qweight.stride(0), gate.scales.stride(0), gate.qweight.stride(1),
        gate.scales.stride(1),
        sg.qweight, sg.scales, sg.biases, su.qweight, su.scales, su.biases,
        sg.qweight.stride(0), sg.scales.stride(0),
        i, i_s, d, h.stride(0), mask_lo(gate.bits),
        TOP_K=top_k, BITS=gate.bits, GROUP=gate.group_size, BLOCK_N=gu.block_n,
        BLOCK_G=gu_bg, STEPS=_steps(d, gate.group_size, gu_bg),
        num_warps=gu.num_warps,
    )  # fmt: skip

    out = torch.empty(d, dtype=x.dtype, device=dev)
    dn = cfg.down
    block_g = min(dn.block_g, triton.next_power_of_2(max(i, i_s) // down.group_size))
    _moe_down_kernel[(triton.cdiv(d, dn.block_n),)](
        h, ids, wts, residual if residual is not None else out, out,
        down.qweight, down.scales, down.biases, down.qweight.stride(0), down.scales.stride(0),
        down.qweight.stride(1), down.scales.stride(1),
        sd.qweight, sd.scales, sd.biases, sd.qweight.stride(0), sd.scales.stride(0),
        d, i, i_s, h.stride(0), mask_lo(down.bits),
        TOP_K=top_k, N_SLOTS=n_slots, BITS=down.bits, GROUP=down.group_size,
        BLOCK_N=dn.block_n, BLOCK_G=block_g, STEPS=_steps(i, down.group_size, block_g),
        STEPS_S=_steps(max(i_s, down.group_size), down.group_size, block_g),
        HAS_RES=residual is not None, ON_CPU=dev.type == "cpu", num_warps=dn.num_warps,
    )  # fmt: skip
    return out
