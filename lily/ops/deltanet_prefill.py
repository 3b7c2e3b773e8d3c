"""Gated DeltaNet prefill: a chunk of T tokens with carried conv and recurrent state.

Three stages, each a kernel:
1. ``_prep_kernel``: causal depthwise conv over the chunk (the carried conv state supplies
   the first W-1 taps) + SiLU, L2 norm of q and k per head (q also scaled by 1/sqrt(K)), the
   gates g and beta; writes y (T, C) = q|k|v in the compute dtype, the new conv state and
   the conv state at the last snapshot cut, if any.
2. the gated delta rule over the T tokens (deltanet_recurrence.py), in one of these forms
   with the same result:
   - ``method="scan"``: token by token; each program keeps a (K, BV) column block of one
     head's state in registers for the whole chunk and writes it once at the end;
   - ``method="chunk"``: the matrix form of the Gated DeltaNet paper. Within chunks of BT
     tokens the rule is a unit lower-triangular system (the UT/WY transform):
     ``_chunk_wy_kernel`` (parallel over chunks) solves it, giving w = T (beta*exp(gc)*k)
     and u = T (beta*v); ``_chunk_scan_kernel`` then walks the chunks in order with the
     state on chip: v' = u - w S, o = (q*exp(gc)) S + tril(q k^T * decay) v',
     S = exp(g_last) S + (k*exp(g_last-gc))^T v'.
   - ``method="chunk_par"``: the same maths split as in flash-linear-attention:
     ``_chunk_state_kernel`` walks the chunks keeping only v' and the state update on the
     sequential path (storing each chunk's starting state, bf16), and ``_chunk_out_kernel``
     computes every chunk's outputs in parallel, gated norm fused.
3. the gated RMSNorm, fused into the scan when one program covers a whole head (BV >= Vd),
   else a separate small kernel.
The state (Hv, K, Vd) fp32 and the conv state (W-1, C) are updated in place. Snapshot cuts
(prefix cache): "chunk" stores the state at the last cut from inside its two recurrence
kernels (deltanet_recurrence.py); other cuts split the recurrence into pieces.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from lily.ops.arch import Arch, current_arch
from lily.ops.deltanet_decode import deltanet_gates
from lily.ops.deltanet_recurrence import recurrence
from lily.ops.launch import cdiv, check, launched, pow2
from lily.ops.norm_rope import gated_rmsnorm, silu

Tensor = torch.Tensor


@triton.jit
def _conv_state_after(x, conv_state, n, stride_x, ch, m_c, C: tl.constexpr, W: tl.constexpr,
                      WP: tl.constexpr):  # fmt: skip
    """The conv state after the first ``n`` tokens: rows n .. n+W-2 of cat(old state, x)."""
    o_w = tl.arange(0, WP)
    src = n + o_w
    m_w = o_w < W - 1
    m_nx = (m_w & (src >= W - 1))[:, None] & m_c[None, :]
    m_ns = (m_w & (src < W - 1))[:, None] & m_c[None, :]
    p_n = x + (src - (W - 1))[:, None] * stride_x + ch[None, :]
    b_n = tl.load(p_n, mask=m_nx, other=0.0).to(tl.float32)
    b_n += tl.load(conv_state + src[:, None] * C + ch[None, :], mask=m_ns, other=0.0).to(tl.float32)
    return b_n


@launched
@triton.jit(do_not_specialize=["cut"])
def _prep_kernel(
    x, conv_w, conv_state, conv_snap, b, a, A_log, dt_bias, y, g, beta, T, cut, stride_x,
    stride_b, stride_a, q_scale, HK: tl.constexpr,
    HV: tl.constexpr, K: tl.constexpr, VD: tl.constexpr, W: tl.constexpr, BT: tl.constexpr,
    BC: tl.constexpr, WP: tl.constexpr, HAS_CUT: tl.constexpr,
):  # fmt: skip
    i_t, i_g = tl.program_id(0), tl.program_id(1)
    C: tl.constexpr = 2 * HK * K + HV * VD
    # program roles: i_g < HK a q head, < 2*HK a k head, else a v head (width VD)
    is_v = i_g >= 2 * HK
    width = tl.where(is_v, VD, K)
    base = tl.where(is_v, 2 * HK * K + (i_g - 2 * HK) * VD, i_g * K)
    o_c = tl.arange(0, BC)
    m_c = o_c < width
    ch = base + o_c
    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < T

    b_y = tl.zeros([BT, BC], dtype=tl.float32)
    for j in tl.static_range(W):
        r = o_t - (W - 1) + j  # input row of tap j; rows < 0 come from the carried state
        m_x = (m_t & (r >= 0))[:, None] & m_c[None, :]
        m_s = (m_t & (r < 0))[:, None] & m_c[None, :]
        b_x = tl.load(x + r[:, None] * stride_x + ch[None, :], mask=m_x, other=0.0).to(tl.float32)
        b_x += tl.load(conv_state + (r + W - 1)[:, None] * C + ch[None, :], mask=m_s, other=0.0).to(
            tl.float32
        )
        b_w = tl.load(conv_w + ch * W + j, mask=m_c, other=0.0).to(tl.float32)
        b_y += b_x * b_w[None, :]
    b_y = silu(b_y)
    if i_g < 2 * HK:
        b_y = b_y * tl.rsqrt(tl.sum(b_y * b_y, 1) + 1e-6)[:, None]
        b_y = b_y * tl.where(i_g < HK, q_scale, 1.0)
    tl.store(
        y + o_t[:, None] * C + ch[None, :],
        b_y.to(y.dtype.element_ty),
        mask=m_t[:, None] & m_c[None, :],
    )
    if i_g >= 2 * HK:
        i_h = i_g - 2 * HK
        b_g, b_beta = deltanet_gates(
            tl.load(b + o_t * stride_b + i_h, mask=m_t, other=0.0),
            tl.load(a + o_t * stride_a + i_h, mask=m_t, other=0.0),
            tl.load(A_log + i_h),
            tl.load(dt_bias + i_h),
        )
        tl.store(g + o_t * HV + i_h, b_g, mask=m_t)
        tl.store(beta + o_t * HV + i_h, b_beta, mask=m_t)

    if i_t == 0:
        # NOTE: only this program reads the old conv state of these channels (BT >= W-1),
        # so it alone may overwrite it, once all its threads are done reading.
        o_w = tl.arange(0, WP)
        p_w = o_w[:, None] * C + ch[None, :]
        m_wc = (o_w < W - 1)[:, None] & m_c[None, :]
        b_n = _conv_state_after(x, conv_state, T, stride_x, ch, m_c, C, W, WP)
        if HAS_CUT:  # the snapshot at the cut, from this launch (no copy kernel of its own)
            b_s = _conv_state_after(x, conv_state, cut, stride_x, ch, m_c, C, W, WP)
            tl.store(conv_snap + p_w, b_s.to(conv_snap.dtype.element_ty), mask=m_wc)
        tl.debug_barrier()
        tl.store(conv_state + p_w, b_n.to(conv_state.dtype.element_ty), mask=m_wc)


def chunk_tile(arch: Arch, elem_bytes: int = 2) -> tuple[int, int | None]:
    """(value columns a program, warps; None: the recurrence's own choice) of the "chunk"
    recurrence: 32 columns, no spills at K = Vd = 128 in bf16 (mixer_kernels.md). fp32
    inputs (a 2-8 token chunk with ``--dtype float32``) spilled 576-648 B a thread without
    warpgroup MMA (sm_80 to sm_120): 16 columns on 8 warps there, 84 KiB and at most
    112 B. The columns of the state are independent: the same maths either way."""
    if elem_bytes > 2 and not arch.wgmma:
        return 16, 8
    return 32, None


def _check(cond: bool, msg) -> None:
    check(cond, "deltanet_prefill", msg)


def deltanet_prefill(
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
    method: str = "chunk",
    chunk_size: int = 64,
    block_v: int | None = None,
    num_warps: int | None = None,
    cuts: Sequence[int] = (),
    snaps: list | None = None,
) -> Tensor:
    """Gated DeltaNet mixer over T tokens (MODEL.md), updating ``conv_state`` and ``state``.

    mixed_qkv (T, C) the in_proj_qkv output q|k|v (C = 2*Hk*K + Hv*Vd); z (T, Hv*Vd); b, a
    (T, Hv); conv_weight (C, W); conv_state (W-1, C); A_log, dt_bias (Hv,); norm_weight
    (Vd,); state (Hv, K, Vd) fp32. ``method``: "chunk" (matrix form over chunks of
    ``chunk_size``, outputs computed on the sequential walk), "chunk_par" (the same, with only
    the states on the sequential walk and the outputs in a parallel kernel) or "scan" (token
    by token). Returns (T, Hv*Vd) in mixed_qkv's dtype.

    ``cuts``: increasing offsets in (0, T); the states after the first ``cut`` tokens are
    appended to ``snaps`` as (conv_state, state) copies (prefix-cache snapshots). The conv,
    the gates and the norm still run once. "chunk" stores the state at the last cut from
    inside its kernels (one recurrence launch pair with one cut); any earlier cut, and
    every cut of the other methods, splits the recurrence into pieces there.
    """
    _check(
        method in ("chunk", "chunk_par", "scan"),
        lambda: f"method must be 'chunk', 'chunk_par' or 'scan', got {method!r}",
    )
    _check(
        state.dim() == 3 and state.dtype == torch.float32 and state.is_contiguous(),
        lambda: (
            f"state must be a contiguous fp32 (Hv, K, Vd) tensor, got {tuple(state.shape)} "
            f"{state.dtype}"
        ),
    )
    hv, kd, vd = state.shape
    _check(
        mixed_qkv.dim() == 2 and mixed_qkv.stride(1) == 1,
        lambda: (
            f"mixed_qkv must be a (T, C) tensor with contiguous rows, got {tuple(mixed_qkv.shape)}"
        ),
    )
    t, c = mixed_qkv.shape
    hk = (c - hv * vd) // (2 * kd)
    _check(t > 0, "empty chunk (T = 0)")
    _check(
        hk > 0 and 2 * hk * kd + hv * vd == c and hv % hk == 0,
        lambda: f"conv width C={c} is not 2*Hk*K + Hv*Vd with K={kd}, Hv={hv}, Vd={vd}",
    )
    _check(
        conv_state.dim() == 2 and conv_state.shape[1] == c and conv_state.is_contiguous(),
        lambda: f"conv_state must be contiguous (W-1, {c}), got {tuple(conv_state.shape)}",
    )
    width = conv_state.shape[0] + 1
    _check(
        conv_weight.shape == (c, width) and conv_weight.is_contiguous(),
        lambda: f"conv_weight must be contiguous ({c}, {width}), got {tuple(conv_weight.shape)}",
    )
    # z, b and a may be column slices of one wider projection output (rows contiguous)
    for name, x, shape in (("z", z, (t, hv * vd)), ("b", b, (t, hv)), ("a", a, (t, hv))):
        _check(
            x.shape == shape and x.stride(1) == 1,
            lambda name=name, x=x, shape=shape: (
                f"{name} must be {shape} with contiguous rows, got {tuple(x.shape)} "
                f"strides {x.stride()}"
            ),
        )
    for name, x, shape in (
        ("A_log", A_log, (hv,)),
        ("dt_bias", dt_bias, (hv,)),
        ("norm_weight", norm_weight, (vd,)),
    ):
        _check(
            x.shape == shape and x.is_contiguous(),
            lambda name=name, x=x, shape=shape: (
                f"{name} must be contiguous {shape}, got {tuple(x.shape)}"
            ),
        )
    tensors = (mixed_qkv, z, b, a, conv_weight, conv_state, A_log, dt_bias, norm_weight, state)
    _check(all(x.device == state.device for x in tensors), "all tensors must be on one device")
    _check(
        chunk_size in (16, 32, 64, 128),
        lambda: f"chunk_size must be 16, 32, 64 or 128, got {chunk_size}",
    )
    _check(
        method == "scan" or min(kd, vd) >= 16,
        lambda: f"the chunked form needs K, Vd >= 16 (tensor-core tiles), got K={kd}, Vd={vd}",
    )
    dev, bk, bvd = state.device, pow2(kd), pow2(vd)

    _check(
        list(cuts) == sorted(set(cuts)) and all(0 < c < t for c in cuts) and
        (snaps is not None or not cuts),
        lambda: f"cuts must be increasing offsets in (0, {t}) with a snaps list, got {list(cuts)}",
    )  # fmt: skip
    # The conv state at each cut, before the prep kernel overwrites the old one: the last
    # W-1 inputs before the cut, from the old state where the cut is that close to the start.
    # The prep kernel writes the last cut's (the usual single cut: no copy launch of its own).
    conv_cuts = [torch.cat([conv_state[c:], mixed_qkv[max(0, c - conv_state.shape[0]) : c]])
                 for c in cuts[:-1]]  # fmt: skip
    if cuts:
        conv_cuts.append(torch.empty(conv_state.shape, dtype=conv_state.dtype, device=dev))

    # 1. conv + norms + gates
    bt_prep = 32
    _check(width - 1 <= bt_prep, lambda: f"conv kernel {width} too wide")
    y = torch.empty(t, c, dtype=mixed_qkv.dtype, device=dev)
    g, beta = (torch.empty(t, hv, dtype=torch.float32, device=dev) for _ in range(2))
    wp = pow2(max(width - 1, 1))
    _prep_kernel[(cdiv(t, bt_prep), 2 * hk + hv)](
        mixed_qkv, conv_weight, conv_state, conv_cuts[-1] if cuts else conv_state, b, a, A_log,
        dt_bias, y, g, beta, t, cuts[-1] if cuts else 0, mixed_qkv.stride(0), b.stride(0),
        a.stride(0), kd**-0.5, HK=hk, HV=hv, K=kd, VD=vd, W=width, BT=bt_prep, BC=max(bk, bvd),
        WP=wp, HAS_CUT=bool(cuts), num_warps=4,
    )  # fmt: skip
    dims = {"HK": hk, "HV": hv, "K": kd, "VD": vd, "BK": bk}

    # 2. the recurrence (+ the norm where a program sees whole heads)
    if method == "chunk":
        tile_v, tile_warps = chunk_tile(current_arch(dev), mixed_qkv.element_size())
        block_v = block_v or tile_v
        num_warps = num_warps or tile_warps
    if block_v is None:
        # no register spills at the real shapes (K = Vd = 128, sm_90): see mixer_kernels.md
        block_v = 16 if method == "scan" else 32
    # tl.dot needs 16 columns at least (chunk forms); the token scan takes any block
    bv = min(max(pow2(block_v), 1 if method == "scan" else 16), bvd)
    nv = cdiv(vd, bv)
    fuse = nv == 1 and method != "chunk_par"
    out_dtype = mixed_qkv.dtype
    if fuse or method == "chunk_par":
        o_buf = torch.empty(t, hv * vd, dtype=out_dtype, device=dev)
    else:
        o_buf = torch.empty(t, hv, vd, dtype=torch.float32, device=dev)
    w = u = None
    if method != "scan":
        w = torch.empty(t, hv, kd, dtype=out_dtype, device=dev)
        u = torch.empty(t, hv, vd, dtype=out_dtype, device=dev)
    # "chunk" stores the state at the last cut from inside its kernels (the usual single cut
    # of a reused turn costs no extra launch); the pieces split at the other cuts.
    inner = list(cuts[-1:]) if method == "chunk" else []
    bounds = [0, *cuts[: len(cuts) - len(inner)], t]
    for i, (lo, hi) in enumerate(zip(bounds, bounds[1:], strict=False)):
        if i:  # the state after the first ``lo`` tokens
            snaps.append((conv_cuts[i - 1], state.clone()))
        rows = slice(lo, hi)
        snap, cut = None, 0
        if inner and hi == t:  # a fresh tensor: the snapshot outlives this call
            snap, cut = torch.empty(state.shape, dtype=torch.float32, device=dev), inner[0] - lo
        recurrence(
            y[rows], g[rows], beta[rows], z[rows], norm_weight, state, o_buf[rows],
            None if w is None else w[rows], None if u is None else u[rows], eps, method,
            chunk_size, bv, nv, fuse, num_warps, dims, cut=cut, snap=snap,
        )  # fmt: skip
        if snap is not None:
            snaps.append((conv_cuts[-1], snap))
    return (
        o_buf
        if fuse or method == "chunk_par"
        else gated_rmsnorm(o_buf, z, norm_weight, eps, out_dtype)
    )
