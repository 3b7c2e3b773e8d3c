"""Gated DeltaNet decode: one fused kernel per layer per token.

One launch does the conv update + SiLU, the per-head L2 norm of q and k, the gates, the
gated delta rule on the fp32 state (read once, written once, in place) and the gated
RMSNorm, writing the (Hv*Vd,) output in the compute dtype.

Grid: (Vd blocks, value heads); each program owns a (K, BV) column block of one head's
state, so the 2 MiB of state per layer streams through many SMs at once. Two things need
data from other programs of the same launch; one "last arrival" counter per key head (an
atomic, reset by the program that completes the count) handles both instead of a second
launch:
- the q/k conv channels of a key head are read by all G*NV programs that use that head, so
  only the last of them may shift the conv state of those channels;
- the gated RMSNorm needs whole Vd rows: when a head is split over programs (NV > 1) they
  park their fp32 slices in a small buffer and the last program of the key head
  normalises its G heads' rows.
Every load is issued at the start: the step is a chain of dependent memory latencies.
With programmatic dependent launch (``pdl``) the states and weights load while the input
projection still runs, and the output projection after it launches while this one runs
(lily/bench/gpu/diagnostics/decode_timeline.py: the step at 4K 1.596 -> 1.522 ms on the H200).
No host synchronisation: the step can be captured in a CUDA graph (pass a persistent
``workspace``, see ``DeltaNetDecodeWorkspace``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from lily.ops.launch import cdiv, check, launched, pdl_launch, pow2, use_pdl
from lily.ops.norm_rope import gated_rmsnorm_rows, sigmoid, silu
from lily.ops.qgemv import pdl_wait
from lily.transfer import table_address

Tensor = torch.Tensor


@triton.jit
def conv_load(conv_w, conv_state, ch, m_c, C: tl.constexpr, W: tl.constexpr, WP: tl.constexpr):
    """The state-side operands of one conv step over channels ``ch``: old rows (WP, BC) in
    the state's dtype and the taps for them (WP, BC) and for x (BC,) in fp32 (the new x is
    loaded apart: with PDL it comes after the wait)."""
    o_w = tl.arange(0, WP)
    m_ws = (o_w < W - 1)[:, None] & m_c[None, :]
    b_s = tl.load(conv_state + o_w[:, None] * C + ch[None, :], mask=m_ws, other=0.0)
    b_wt = tl.load(conv_w + ch[None, :] * W + o_w[:, None], mask=m_ws, other=0.0).to(tl.float32)
    b_wl = tl.load(conv_w + ch * W + (W - 1), mask=m_c, other=0.0).to(tl.float32)
    return b_s, b_wt, b_wl


@triton.jit
def conv_silu(b_s, b_wt, b_wl, b_x):
    """silu(conv) of one step from ``conv_load``'s operands, fp32 (BC,)."""
    return silu(tl.sum(b_s.to(tl.float32) * b_wt, 0) + b_x.to(tl.float32) * b_wl)


@triton.jit
def conv_shift_store(
    conv_state, ch, m_c, b_s, b_x, C: tl.constexpr, W: tl.constexpr, WP: tl.constexpr
):
    """New conv state of channels ``ch``: old rows 1..W-2 move up one, x becomes the last row.

    NOTE: callers put a barrier before this: other threads may still be reading the rows.
    """
    o_w = tl.arange(0, WP)
    dt = conv_state.dtype.element_ty
    m_up = ((o_w >= 1) & (o_w < W - 1))[:, None] & m_c[None, :]
    tl.store(conv_state + (o_w[:, None] - 1) * C + ch[None, :], b_s.to(dt), mask=m_up)
    tl.store(conv_state + (W - 2) * C + ch, b_x.to(dt), mask=m_c)


@triton.jit
def deltanet_gates(b_b, b_a, b_alog, b_dtb):
    """beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias), from loaded values."""
    b_x = b_a.to(tl.float32) + b_dtb.to(tl.float32)
    b_sp = tl.where(b_x > 20.0, b_x, tl.log(1.0 + tl.exp(tl.minimum(b_x, 20.0))))
    return -tl.exp(b_alog.to(tl.float32)) * b_sp, sigmoid(b_b.to(tl.float32))


@launched
@triton.jit
def _deltanet_decode_kernel(
    x, z, b, a, conv_w, conv_state, A_log, dt_bias, norm_w, state, out, o_buf, counters, q_scale,
    eps, st_tab, s_x, s_z, s_b, s_a, HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
    VD: tl.constexpr, W: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BVD: tl.constexpr,
    WP: tl.constexpr, NV: tl.constexpr, GP: tl.constexpr, PDL: tl.constexpr,
    ROWS: tl.constexpr,
):  # fmt: skip
    i_v, i_h = tl.program_id(0), tl.program_id(1)
    G: tl.constexpr = HV // HK
    if ROWS:  # row i_r of a batch: its inputs and outputs, its own states and scratch
        i_r = tl.program_id(2)
        x += i_r * s_x
        z += i_r * s_z
        b += i_r * s_b
        a += i_r * s_a
        out += i_r * (HV * VD)
        o_buf += i_r * (HV * VD)
        counters += i_r * HK
        # (16-byte aligned, as Triton assumes of a pointer argument: vectorized loads)
        conv_state = tl.multiple_of(tl.load(st_tab + 2 * i_r).to(conv_state.dtype), 16)
        state = tl.multiple_of(tl.load(st_tab + 2 * i_r + 1).to(state.dtype), 16)
    C: tl.constexpr = 2 * HK * K + HV * VD
    i_kh = i_h // G
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < VD
    # NOTE: every load this program may need is issued here, before the first use, so that
    # one memory latency covers them all: the step is a chain of dependent latencies.
    # With PDL, the recurrent and conv states (this layer's, written a step ago: complete,
    # since the kernel before this one waits before it lets this one launch) and the
    # weights are loaded before the wait, while the input projection still runs; only the
    # projections' outputs (x, z, b, a) come after it.
    p_s = state + i_h * K * VD + o_k[:, None] * VD + o_v[None, :]
    m_s = m_k[:, None] & m_v[None, :]
    b_S = tl.load(p_s, mask=m_s, other=0.0)
    b_alog, b_dtb = tl.load(A_log + i_h), tl.load(dt_bias + i_h)
    # conv + SiLU of this program's channels: its key head's q and k, its slice of v (all
    # operands loaded before any arithmetic: reductions put barriers between loads)
    c_q = i_kh * K + o_k
    c_k = HK * K + i_kh * K + o_k
    c_v = 2 * HK * K + i_h * VD + o_v
    s_q, wt_q, wl_q = conv_load(conv_w, conv_state, c_q, m_k, C, W, WP)
    s_k, wt_k, wl_k = conv_load(conv_w, conv_state, c_k, m_k, C, W, WP)
    s_v, wt_v, wl_v = conv_load(conv_w, conv_state, c_v, m_v, C, W, WP)
    o_g = tl.arange(0, GP)
    o_a = tl.arange(0, BVD)
    m_ga = (o_g < G)[:, None] & (o_a < VD)[None, :]
    if NV == 1:
        b_nw = tl.load(norm_w + o_v, mask=m_v, other=0.0).to(tl.float32)
    else:
        b_nwa = tl.load(norm_w + o_a, mask=o_a < VD, other=0.0).to(tl.float32)
    pdl_wait(PDL)
    b_gb, b_ga = tl.load(b + i_h), tl.load(a + i_h)
    x_q = tl.load(x + c_q, mask=m_k, other=0.0)
    x_k = tl.load(x + c_k, mask=m_k, other=0.0)
    x_v = tl.load(x + c_v, mask=m_v, other=0.0)
    # last: their layout conversions put a barrier right after the load
    if NV == 1:  # z of this head
        b_z = tl.load(z + i_h * VD + o_v, mask=m_v, other=0.0).to(tl.float32)
    else:  # z of all G heads of the key head, in case this program normalises them
        p_za = z + (i_kh * G + o_g)[:, None] * VD + o_a[None, :]
        b_za = tl.load(p_za, mask=m_ga, other=0.0).to(tl.float32)

    b_q = conv_silu(s_q, wt_q, wl_q, x_q)
    b_k = conv_silu(s_k, wt_k, wl_k, x_k)
    b_v = conv_silu(s_v, wt_v, wl_v, x_v)
    b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q, 0) + 1e-6) * q_scale
    b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k, 0) + 1e-6)
    b_g, b_beta = deltanet_gates(b_gb, b_ga, b_alog, b_dtb)

    # the recurrence: decay, delta-rule write, read out
    b_S = b_S * tl.exp(b_g)
    b_d = b_beta * (b_v - tl.sum(b_S * b_k[:, None], 0))
    b_S = b_S + b_k[:, None] * b_d[None, :]
    b_o = tl.sum(b_S * b_q[:, None], 0)
    tl.store(p_s, b_S, mask=m_s)

    if NV == 1:  # the whole head row is here: gated RMSNorm at once
        b_y = gated_rmsnorm_rows(b_o[None, :], b_z[None, :], b_nw, eps, VD)
        tl.store(out + i_h * VD + o_v[None, :], b_y.to(out.dtype.element_ty), mask=m_v[None, :])
    else:  # park the slice for the last program of the key head
        tl.store(o_buf + i_h * VD + o_v, b_o, mask=m_v)
    # conv state: the v slice is ours alone; the q/k channels are read by all G*NV programs
    # of the key head, so the last of them to arrive shifts them (and, when the heads are
    # split over programs, normalises the G heads' rows): one atomic for both
    tl.debug_barrier()
    conv_shift_store(conv_state, c_v, m_v, s_v, x_v, C, W, WP)
    if G * NV == 1:
        conv_shift_store(conv_state, c_q, m_k, s_q, x_q, C, W, WP)
        conv_shift_store(conv_state, c_k, m_k, s_k, x_k, C, W, WP)
    else:
        n_kh = tl.atomic_add(counters + i_kh, 1, sem="acq_rel")
        if n_kh == G * NV - 1:
            conv_shift_store(conv_state, c_q, m_k, s_q, x_q, C, W, WP)
            conv_shift_store(conv_state, c_k, m_k, s_k, x_k, C, W, WP)
            if NV > 1:
                p_oa = (i_kh * G + o_g)[:, None] * VD + o_a[None, :]
                b_oa = tl.load(o_buf + p_oa, mask=m_ga, other=0.0, cache_modifier=".cg")
                b_y = gated_rmsnorm_rows(b_oa, b_za, b_nwa, eps, VD)
                tl.store(out + p_oa, b_y.to(out.dtype.element_ty), mask=m_ga)
            tl.atomic_xchg(counters + i_kh, 0)


@dataclass
class DeltaNetDecodeWorkspace:
    """Scratch for the decode kernel: counters (Hk,) int32, one per key head, zero between
    launches (the kernel resets them), and the fp32 row buffer (Hv*Vd,). One per device and
    stream; all layers may share it since they run one after another."""

    counters: Tensor
    o_buf: Tensor

    @classmethod
    def new(
        cls,
        num_k_heads: int,
        num_v_heads: int,
        v_dim: int,
        device: torch.device | str,
        rows: int = 1,
    ) -> DeltaNetDecodeWorkspace:
        """Scratch for ``rows`` sequences at once (``deltanet_decode_rows``)."""
        return cls(
            torch.zeros(rows * num_k_heads, dtype=torch.int32, device=device),
            torch.empty(rows * num_v_heads * v_dim, dtype=torch.float32, device=device),
        )


def _check(cond: bool, msg) -> None:
    check(cond, "deltanet_decode", msg)


def _layer_shapes(conv_state: Tensor, state: Tensor) -> tuple[int, int, int, int, int, int]:
    """(Hv, K, Vd, C, W, Hk) of a layer's conv and recurrent states, checked."""
    _check(
        state.dim() == 3 and state.dtype == torch.float32 and state.is_contiguous(),
        f"state must be a contiguous fp32 (Hv, K, Vd) tensor, got {tuple(state.shape)} "
        f"{state.dtype}",
    )
    hv, kd, vd = state.shape
    _check(
        conv_state.dim() == 2 and conv_state.is_contiguous(),
        f"conv_state must be a contiguous (W-1, C) tensor, got {tuple(conv_state.shape)}",
    )
    c = conv_state.shape[1]
    width = conv_state.shape[0] + 1
    hk = (c - hv * vd) // (2 * kd)
    _check(
        hk > 0 and 2 * hk * kd + hv * vd == c and hv % hk == 0,
        f"conv width C={c} is not 2*Hk*K + Hv*Vd with K={kd}, Hv={hv}, Vd={vd}",
    )
    return hv, kd, vd, c, width, hk


def _check_weights(conv_weight: Tensor, A_log: Tensor, dt_bias: Tensor, norm_weight: Tensor,
                   c: int, width: int, hv: int, vd: int) -> None:  # fmt: skip
    _check(
        conv_weight.shape == (c, width) and conv_weight.is_contiguous(),
        f"conv_weight must be contiguous ({c}, {width}), got {tuple(conv_weight.shape)}",
    )
    for name, t, n in (("A_log", A_log, hv), ("dt_bias", dt_bias, hv),
                       ("norm_weight", norm_weight, vd)):  # fmt: skip
        _check(t.shape == (n,), f"{name} must be ({n},), got {tuple(t.shape)}")


def deltanet_decode(
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
    *,
    workspace: DeltaNetDecodeWorkspace | None = None,
    block_v: int = 16,
    num_warps: int = 4,
    pdl: bool = False,
) -> Tensor:
    """One Gated DeltaNet step for one token (MODEL.md), updating ``conv_state`` and ``state``.

    mixed_qkv (C,) the in_proj_qkv output q|k|v with C = 2*Hk*K + Hv*Vd; z (Hv*Vd,); b, a
    (Hv,); conv_weight (C, W); conv_state (W-1, C) in place; A_log, dt_bias (Hv,);
    norm_weight (Vd,); state (Hv, K, Vd) fp32 in place. A leading batch dim of 1 is allowed
    on mixed_qkv, z, b, a. Returns (Hv*Vd,) (or (1, Hv*Vd)) in mixed_qkv's dtype. ``pdl``:
    programmatic dependent launch (Hopper; ignored elsewhere): the states and weights load
    while the previous kernel (the input projection) finishes; the previous kernel must
    wait for its own predecessor before it lets this one launch (every PDL kernel here does).
    """
    hv, kd, vd, c, width, hk = _layer_shapes(conv_state, state)
    lead = mixed_qkv.shape[:-1]
    _check(lead in ((), (1,)), f"one token expected, mixed_qkv has shape {tuple(mixed_qkv.shape)}")
    for name, t, n in (("mixed_qkv", mixed_qkv, c), ("z", z, hv * vd), ("b", b, hv), ("a", a, hv)):
        _check(
            t.shape[-1] == n and t.numel() == n and t.is_contiguous(),
            f"{name} must be contiguous with {n} values, got {tuple(t.shape)}",
        )
    _check_weights(conv_weight, A_log, dt_bias, norm_weight, c, width, hv, vd)
    tensors = (mixed_qkv, z, b, a, conv_weight, conv_state, A_log, dt_bias, norm_weight, state)
    _check(all(t.device == state.device for t in tensors), "all tensors must be on one device")

    bv = min(pow2(block_v), pow2(vd))
    nv = cdiv(vd, bv)
    if workspace is None:
        workspace = DeltaNetDecodeWorkspace.new(hk, hv, vd, state.device)
    _check(
        workspace.counters.numel() >= hk and workspace.o_buf.numel() >= hv * vd,
        "workspace too small for these shapes",
    )
    out = torch.empty(*lead, hv * vd, dtype=mixed_qkv.dtype, device=state.device)
    pdl = use_pdl(pdl, state.device)
    _deltanet_decode_kernel[(nv, hv)](
        mixed_qkv,
        z,
        b,
        a,
        conv_weight,
        conv_state,
        A_log,
        dt_bias,
        norm_weight,
        state,
        out,
        workspace.o_buf,
        workspace.counters,
        kd**-0.5,
        eps,
        state,  # (st_tab and the row strides: unused)
        0,
        0,
        0,
        0,
        HK=hk,
        HV=hv,
        K=kd,
        VD=vd,
        W=width,
        BK=pow2(kd),
        BV=bv,
        BVD=pow2(vd),
        WP=pow2(max(width - 1, 1)),
        NV=nv,
        GP=pow2(hv // hk),
        PDL=pdl,
        ROWS=False,
        num_warps=num_warps,
        **pdl_launch(pdl),
    )
    return out


def state_table(states: list[tuple[Tensor, Tensor]], device: torch.device | str) -> Tensor:
    """The (B, 2) int64 table ``deltanet_decode_rows`` reads: per row its conv state's and
    recurrent state's addresses."""
    rows = [[table_address(c, "state_table"), table_address(s, "state_table")]
            for c, s in states]  # fmt: skip
    return torch.tensor(rows, dtype=torch.int64, device=device)


def deltanet_decode_rows(
    mixed_qkv: Tensor,
    z: Tensor,
    b: Tensor,
    a: Tensor,
    conv_weight: Tensor,
    st_tab: Tensor,
    conv_like: Tensor,
    state_like: Tensor,
    A_log: Tensor,
    dt_bias: Tensor,
    norm_weight: Tensor,
    eps: float = 1e-6,
    *,
    workspace: DeltaNetDecodeWorkspace | None = None,
    block_v: int = 16,
    num_warps: int = 4,
    pdl: bool = False,
) -> Tensor:
    """``deltanet_decode`` for one token of each of B sequences in one launch: row r of
    mixed_qkv (B, C), z (B, Hv*Vd), b, a (B, Hv) (rows may be strided, columns contiguous:
    views of a fused projection) with its own conv and recurrent states, named by
    ``st_tab`` (``state_table``), each updated in place; ``conv_like`` and ``state_like``
    tensors of their dtypes and shapes. ``workspace`` must hold B rows. Returns
    (B, Hv*Vd)."""
    hv, kd, vd, c, width, hk = _layer_shapes(conv_like, state_like)
    nrows = mixed_qkv.shape[0]
    for name, t, n in (("mixed_qkv", mixed_qkv, c), ("z", z, hv * vd), ("b", b, hv), ("a", a, hv)):
        _check(
            t.shape == (nrows, n) and t.stride(1) == 1,
            f"{name} must be ({nrows}, {n}) with contiguous rows, got {tuple(t.shape)}",
        )
    _check(
        st_tab.shape == (nrows, 2) and st_tab.dtype == torch.int64 and st_tab.is_contiguous(),
        f"st_tab must be a contiguous ({nrows}, 2) int64 table, got {tuple(st_tab.shape)}",
    )
    _check_weights(conv_weight, A_log, dt_bias, norm_weight, c, width, hv, vd)
    dev = mixed_qkv.device
    tensors = (mixed_qkv, z, b, a, conv_weight, st_tab, A_log, dt_bias, norm_weight)
    _check(all(t.device == dev for t in tensors), "all tensors must be on one device")
    bv = min(pow2(block_v), pow2(vd))
    nv = cdiv(vd, bv)
    if workspace is None:
        workspace = DeltaNetDecodeWorkspace.new(hk, hv, vd, dev, rows=nrows)
    _check(
        workspace.counters.numel() >= nrows * hk and workspace.o_buf.numel() >= nrows * hv * vd,
        f"workspace too small for {nrows} rows",
    )
    out = torch.empty(nrows, hv * vd, dtype=mixed_qkv.dtype, device=dev)
    pdl = use_pdl(pdl, dev)
    _deltanet_decode_kernel[(nv, hv, nrows)](
        mixed_qkv, z, b, a, conv_weight, conv_like, A_log, dt_bias, norm_weight, state_like,
        out, workspace.o_buf, workspace.counters, kd**-0.5, eps, st_tab, mixed_qkv.stride(0),
        z.stride(0), b.stride(0), a.stride(0), HK=hk, HV=hv, K=kd, VD=vd, W=width,
        BK=pow2(kd), BV=bv, BVD=pow2(vd), WP=pow2(max(width - 1, 1)), NV=nv,
        GP=pow2(hv // hk), PDL=pdl, ROWS=True, num_warps=num_warps, **pdl_launch(pdl),
    )  # fmt: skip
    return out
