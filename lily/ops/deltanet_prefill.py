"""Gated DeltaNet prefill: a chunk of T tokens with carried conv and recurrent state.

Three stages, each a kernel:
1. ``_prep_kernel``: causal depthwise conv over the chunk (the carried conv state supplies
   the first W-1 taps) + SiLU, L2 norm of q and k per head (q also scaled by 1/sqrt(K)), the
   gates g and beta; writes y (T, C) = q|k|v in the compute dtype and the new conv state.
2. the gated delta rule over the T tokens, in one of two forms with the same result:
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
The state (Hv, K, Vd) fp32 and the conv state (W-1, C) are updated in place.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from lily.ops.deltanet_decode import deltanet_gates
from lily.ops.launch import cdiv, launched, pow2
from lily.ops.norm_rope import gated_rmsnorm, gated_rmsnorm_rows, silu

Tensor = torch.Tensor


@launched
@triton.jit
def _prep_kernel(
    x, conv_w, conv_state, b, a, A_log, dt_bias, y, g, beta, T, q_scale, HK: tl.constexpr,
    HV: tl.constexpr, K: tl.constexpr, VD: tl.constexpr, W: tl.constexpr, BT: tl.constexpr,
    BC: tl.constexpr, WP: tl.constexpr,
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
        b_x = tl.load(x + r[:, None] * C + ch[None, :], mask=m_x, other=0.0).to(tl.float32)
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
            tl.load(b + o_t * HV + i_h, mask=m_t, other=0.0),
            tl.load(a + o_t * HV + i_h, mask=m_t, other=0.0),
            tl.load(A_log + i_h),
            tl.load(dt_bias + i_h),
        )
        tl.store(g + o_t * HV + i_h, b_g, mask=m_t)
        tl.store(beta + o_t * HV + i_h, b_beta, mask=m_t)

    if i_t == 0:
        # NOTE: only this program reads the old conv state of these channels (BT >= W-1),
        # so it alone may overwrite it, once all its threads are done reading.
        o_w = tl.arange(0, WP)
        src = T + o_w  # row of cat(old state, x) that becomes new row o_w
        m_w = o_w < W - 1
        m_nx = (m_w & (src >= W - 1))[:, None] & m_c[None, :]
        m_ns = (m_w & (src < W - 1))[:, None] & m_c[None, :]
        b_n = tl.load(x + (src - (W - 1))[:, None] * C + ch[None, :], mask=m_nx, other=0.0).to(
            tl.float32
        )
        b_n += tl.load(conv_state + src[:, None] * C + ch[None, :], mask=m_ns, other=0.0).to(
            tl.float32
        )
        tl.debug_barrier()
        tl.store(
            conv_state + o_w[:, None] * C + ch[None, :],
            b_n.to(conv_state.dtype.element_ty),
            mask=m_w[:, None] & m_c[None, :],
        )


@launched
@triton.jit
def _scan_kernel(
    y, g, beta, state, z, norm_w, o_buf, T, eps, HK: tl.constexpr, HV: tl.constexpr,
    K: tl.constexpr, VD: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, FUSE_NORM: tl.constexpr,
):  # fmt: skip
    i_v, i_h = tl.program_id(0), tl.program_id(1)
    C: tl.constexpr = 2 * HK * K + HV * VD
    i_kh = i_h // (HV // HK)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < VD
    p_s = state + i_h * K * VD + o_k[:, None] * VD + o_v[None, :]
    m_s = m_k[:, None] & m_v[None, :]
    b_S = tl.load(p_s, mask=m_s, other=0.0)
    p_q = y + i_kh * K + o_k
    p_k = y + HK * K + i_kh * K + o_k
    p_v = y + 2 * HK * K + i_h * VD + o_v
    if FUSE_NORM:
        b_nw = tl.load(norm_w + o_v, mask=m_v, other=0.0).to(tl.float32)
    # NOTE: no jit helper calls inside the loops: each costs milliseconds in the interpreter
    for t in range(T):
        b_q = tl.load(p_q + t * C, mask=m_k, other=0.0).to(tl.float32)
        b_k = tl.load(p_k + t * C, mask=m_k, other=0.0).to(tl.float32)
        b_v = tl.load(p_v + t * C, mask=m_v, other=0.0).to(tl.float32)
        b_g = tl.load(g + t * HV + i_h)
        b_b = tl.load(beta + t * HV + i_h)
        b_S = b_S * tl.exp(b_g)
        b_d = b_b * (b_v - tl.sum(b_S * b_k[:, None], 0))
        b_S = b_S + b_k[:, None] * b_d[None, :]
        b_o = tl.sum(b_S * b_q[:, None], 0)
        off = t * (HV * VD) + i_h * VD + o_v
        if FUSE_NORM:  # gated RMSNorm: rmsnorm(o) * w * silu(z)
            b_z = tl.load(z + off, mask=m_v, other=0.0).to(tl.float32)
            b_r = tl.rsqrt(tl.sum(b_o * b_o, 0) / VD + eps)
            b_o = b_o * b_r * b_nw * b_z / (1.0 + tl.exp(-b_z))
        tl.store(o_buf + off, b_o.to(o_buf.dtype.element_ty), mask=m_v)
    tl.store(p_s, b_S, mask=m_s)


@launched
@triton.jit
def _chunk_wy_kernel(
    y, g, beta, w, u, T, HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, VD: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BVD: tl.constexpr, NSQ: tl.constexpr,
):  # fmt: skip
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    C: tl.constexpr = 2 * HK * K + HV * VD
    i_kh = i_h // (HV // HK)
    o_i = tl.arange(0, BT)
    o_t = i_c * BT + o_i
    m_t = o_t < T
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_v = tl.arange(0, BVD)
    m_v = o_v < VD
    # padded rows get g = 0 and beta = 0: they change nothing
    b_gc = tl.cumsum(tl.load(g + o_t * HV + i_h, mask=m_t, other=0.0), 0)
    b_b = tl.load(beta + o_t * HV + i_h, mask=m_t, other=0.0)
    b_k = tl.load(
        y + o_t[:, None] * C + HK * K + i_kh * K + o_k[None, :],
        mask=m_t[:, None] & m_k[None, :],
        other=0.0,
    )
    # A[i, j] = beta_i (k_i . k_j) exp(gc_i - gc_j) for j < i; T = (I + A)^-1, in two steps:
    # 1. X_D, the inverse of the 16x16 diagonal blocks, by forward substitution: step r
    #    does row r of every block at once (their coefficients sit in disjoint columns).
    #    The loop reads A transposed (At[j, i] = A[i, j]; k k^T is symmetric), so a row of A
    #    comes out of an in-warp reduction already laid out along the rows of X.
    # 2. with A_O the blocks below the diagonal and M = X_D A_O (nilpotent),
    #    T = (I + M)^-1 X_D = (I - M)(I + M^2)(I + M^4)... X_D, a few products.
    o_b = o_i // 16
    same = o_b[:, None] == o_b[None, :]
    eye = o_i[:, None] == o_i[None, :]
    b_kk = tl.dot(b_k, tl.trans(b_k))
    up = same & (o_i[None, :] > o_i[:, None])
    b_At = tl.where(
        up, b_kk * b_b[None, :] * tl.exp(tl.where(up, b_gc[None, :] - b_gc[:, None], 0.0)), 0.0
    )
    b_Ti = tl.where(eye, 1.0, 0.0)
    for r in range(1, 16):
        b_a = tl.sum(tl.where((o_i % 16 == r)[None, :], b_At, 0.0), 1)
        b_r = tl.sum(b_a[:, None] * b_Ti, 0)
        b_Ti = tl.where(
            (o_i % 16 == r)[:, None] & same, tl.where(eye, 1.0, 0.0) - b_r[None, :], b_Ti
        )
    if BT > 16:
        lo = o_b[:, None] > o_b[None, :]
        b_Ao = tl.where(
            lo, b_kk * b_b[:, None] * tl.exp(tl.where(lo, b_gc[:, None] - b_gc[None, :], 0.0)), 0.0
        )
        b_M = tl.dot(b_Ti, b_Ao)
        b_Ti = b_Ti - tl.dot(b_M, b_Ti)
        for _ in tl.static_range(NSQ):
            b_M = tl.dot(b_M, b_M)
            b_Ti = b_Ti + tl.dot(b_M, b_Ti)
    # w = T diag(beta exp(gc)) k and u = T diag(beta) v: the diagonals scale T's columns.
    # NOTE: fp32 operands (tf32 on tensor cores): T rounded to bf16 doubled the state error;
    # this kernel is parallel over chunks, off the sequential path, so the cost is small.
    b_w = tl.dot((b_Ti * (b_b * tl.exp(b_gc))[None, :]), b_k.to(tl.float32))
    b_v = tl.load(
        y + o_t[:, None] * C + 2 * HK * K + i_h * VD + o_v[None, :],
        mask=m_t[:, None] & m_v[None, :],
        other=0.0,
    )
    b_u = tl.dot((b_Ti * b_b[None, :]), b_v.to(tl.float32))
    tl.store(
        w + (o_t[:, None] * HV + i_h) * K + o_k[None, :],
        b_w.to(w.dtype.element_ty),
        mask=m_t[:, None] & m_k[None, :],
    )
    tl.store(
        u + (o_t[:, None] * HV + i_h) * VD + o_v[None, :],
        b_u.to(u.dtype.element_ty),
        mask=m_t[:, None] & m_v[None, :],
    )


@launched
@triton.jit
def _chunk_scan_kernel(
    y, g, w, u, state, z, norm_w, o_buf, T, eps, HK: tl.constexpr, HV: tl.constexpr,
    K: tl.constexpr, VD: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    FUSE_NORM: tl.constexpr,
):  # fmt: skip
    i_v, i_h = tl.program_id(0), tl.program_id(1)
    C: tl.constexpr = 2 * HK * K + HV * VD
    i_kh = i_h // (HV // HK)
    o_i = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < VD
    p_s = state + i_h * K * VD + o_k[:, None] * VD + o_v[None, :]
    m_s = m_k[:, None] & m_v[None, :]
    b_S = tl.load(p_s, mask=m_s, other=0.0)
    causal = o_i[:, None] >= o_i[None, :]
    dt = y.dtype.element_ty
    if FUSE_NORM:
        b_nw = tl.load(norm_w + o_v, mask=m_v, other=0.0).to(tl.float32)
    for i_c in range(tl.cdiv(T, BT)):
        o_t = i_c * BT + o_i
        m_t = o_t < T
        m_tk = m_t[:, None] & m_k[None, :]
        b_gc = tl.cumsum(tl.load(g + o_t * HV + i_h, mask=m_t, other=0.0), 0)
        b_gl = tl.sum(tl.where(o_i == BT - 1, b_gc, 0.0))  # padded rows add 0: the last real
        b_q = tl.load(y + o_t[:, None] * C + i_kh * K + o_k[None, :], mask=m_tk, other=0.0)
        b_k = tl.load(y + o_t[:, None] * C + HK * K + i_kh * K + o_k[None, :], mask=m_tk, other=0.0)
        b_w = tl.load(w + (o_t[:, None] * HV + i_h) * K + o_k[None, :], mask=m_tk, other=0.0)
        b_u = tl.load(
            u + (o_t[:, None] * HV + i_h) * VD + o_v[None, :],
            mask=m_t[:, None] & m_v[None, :],
            other=0.0,
        ).to(tl.float32)
        # products on the tensor cores in the input dtype (S rounded to it, as is common);
        # the decays scale rows of the small results rather than copies of q and k
        b_Sd = b_S.to(dt)
        # what the state at the chunk start already predicts is removed: the delta rule
        b_vn = b_u - tl.dot(b_w, b_Sd)
        b_qk = tl.dot(b_q, tl.trans(b_k))
        b_qk = tl.where(
            causal, b_qk * tl.exp(tl.where(causal, b_gc[:, None] - b_gc[None, :], 0.0)), 0.0
        )
        b_o = tl.dot(b_q, b_Sd) * tl.exp(b_gc)[:, None] + tl.dot(b_qk.to(dt), b_vn.to(dt))
        m_tv = m_t[:, None] & m_v[None, :]
        off = o_t[:, None] * (HV * VD) + i_h * VD + o_v[None, :]
        if FUSE_NORM:  # gated RMSNorm, inline (see the NOTE in _scan_kernel)
            b_z = tl.load(z + off, mask=m_tv, other=0.0).to(tl.float32)
            b_r = tl.rsqrt(tl.sum(b_o * b_o, 1) / VD + eps)
            b_o = b_o * b_r[:, None] * b_nw[None, :] * b_z / (1.0 + tl.exp(-b_z))
        tl.store(o_buf + off, b_o.to(o_buf.dtype.element_ty), mask=m_tv)
        b_vd = (b_vn * tl.exp(b_gl - b_gc)[:, None]).to(dt)
        b_S = b_S * tl.exp(b_gl) + tl.dot(tl.trans(b_k), b_vd)
    tl.store(p_s, b_S, mask=m_s)


@launched
@triton.jit
def _chunk_state_kernel(
    y, g, w, u, state, h, vn, T, HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
    VD: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    """The sequential part alone ("chunk_par"): per chunk, the state at its start -> h and
    v' = u - w S -> vn, then the state update. Two dependent products per step."""
    i_v, i_h = tl.program_id(0), tl.program_id(1)
    C: tl.constexpr = 2 * HK * K + HV * VD
    i_kh = i_h // (HV // HK)
    o_i = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < VD
    m_s = m_k[:, None] & m_v[None, :]
    p_s = state + i_h * K * VD + o_k[:, None] * VD + o_v[None, :]
    b_S = tl.load(p_s, mask=m_s, other=0.0)
    dt = y.dtype.element_ty
    for i_c in range(tl.cdiv(T, BT)):
        o_t = i_c * BT + o_i
        m_t = o_t < T
        m_tk = m_t[:, None] & m_k[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        b_gc = tl.cumsum(tl.load(g + o_t * HV + i_h, mask=m_t, other=0.0), 0)
        b_gl = tl.sum(tl.where(o_i == BT - 1, b_gc, 0.0))
        b_k = tl.load(y + o_t[:, None] * C + HK * K + i_kh * K + o_k[None, :], mask=m_tk, other=0.0)
        b_w = tl.load(w + (o_t[:, None] * HV + i_h) * K + o_k[None, :], mask=m_tk, other=0.0)
        p_tv = (o_t[:, None] * HV + i_h) * VD + o_v[None, :]
        b_u = tl.load(u + p_tv, mask=m_tv, other=0.0).to(tl.float32)
        b_Sd = b_S.to(dt)
        tl.store(h + ((i_c * HV + i_h) * K + o_k[:, None]) * VD + o_v[None, :], b_Sd, mask=m_s)
        b_vn = b_u - tl.dot(b_w, b_Sd)
        tl.store(vn + p_tv, b_vn.to(dt), mask=m_tv)
        b_vd = (b_vn * tl.exp(b_gl - b_gc)[:, None]).to(dt)
        b_S = b_S * tl.exp(b_gl) + tl.dot(tl.trans(b_k), b_vd)
    tl.store(p_s, b_S, mask=m_s)


@launched
@triton.jit
def _chunk_out_kernel(
    y, g, h, vn, z, norm_w, out, T, eps, HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
    VD: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BVD: tl.constexpr,
):  # fmt: skip
    """The outputs of one chunk and head, in parallel over chunks ("chunk_par"):
    o = diag(e^gc) q h + tril(q k^T * decay) v', then the gated RMSNorm (whole heads)."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    C: tl.constexpr = 2 * HK * K + HV * VD
    i_kh = i_h // (HV // HK)
    o_i = tl.arange(0, BT)
    o_t = i_c * BT + o_i
    m_t = o_t < T
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_v = tl.arange(0, BVD)
    m_v = o_v < VD
    m_tk = m_t[:, None] & m_k[None, :]
    m_tv = m_t[:, None] & m_v[None, :]
    b_gc = tl.cumsum(tl.load(g + o_t * HV + i_h, mask=m_t, other=0.0), 0)
    b_q = tl.load(y + o_t[:, None] * C + i_kh * K + o_k[None, :], mask=m_tk, other=0.0)
    b_k = tl.load(y + o_t[:, None] * C + HK * K + i_kh * K + o_k[None, :], mask=m_tk, other=0.0)
    p_h = h + ((i_c * HV + i_h) * K + o_k[:, None]) * VD + o_v[None, :]
    b_h = tl.load(p_h, mask=m_k[:, None] & m_v[None, :], other=0.0)
    p_tv = (o_t[:, None] * HV + i_h) * VD + o_v[None, :]
    b_vn = tl.load(vn + p_tv, mask=m_tv, other=0.0)
    b_z = tl.load(z + p_tv, mask=m_tv, other=0.0).to(tl.float32)
    b_nw = tl.load(norm_w + o_v, mask=m_v, other=0.0).to(tl.float32)
    causal = o_i[:, None] >= o_i[None, :]
    b_qk = tl.dot(b_q, tl.trans(b_k))
    b_qk = tl.where(
        causal, b_qk * tl.exp(tl.where(causal, b_gc[:, None] - b_gc[None, :], 0.0)), 0.0
    )
    b_o = tl.dot(b_q, b_h) * tl.exp(b_gc)[:, None] + tl.dot(b_qk.to(b_vn.dtype), b_vn)
    b_y = gated_rmsnorm_rows(b_o, b_z, b_nw, eps, VD)
    tl.store(out + p_tv, b_y.to(out.dtype.element_ty), mask=m_tv)


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(f"deltanet_prefill: {msg}")


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
    appended to ``snaps`` as (conv_state, state) copies (prefix-cache snapshots). Only the
    recurrence runs piece by piece; the conv, the gates and the norm still run once.
    """
    _check(
        method in ("chunk", "chunk_par", "scan"),
        f"method must be 'chunk', 'chunk_par' or 'scan', got {method!r}",
    )
    _check(
        state.dim() == 3 and state.dtype == torch.float32 and state.is_contiguous(),
        f"state must be a contiguous fp32 (Hv, K, Vd) tensor, got {tuple(state.shape)} "
        f"{state.dtype}",
    )
    hv, kd, vd = state.shape
    _check(
        mixed_qkv.dim() == 2 and mixed_qkv.is_contiguous(),
        f"mixed_qkv must be a contiguous (T, C) tensor, got {tuple(mixed_qkv.shape)}",
    )
    t, c = mixed_qkv.shape
    hk = (c - hv * vd) // (2 * kd)
    _check(t > 0, "empty chunk (T = 0)")
    _check(
        hk > 0 and 2 * hk * kd + hv * vd == c and hv % hk == 0,
        f"conv width C={c} is not 2*Hk*K + Hv*Vd with K={kd}, Hv={hv}, Vd={vd}",
    )
    _check(
        conv_state.dim() == 2 and conv_state.shape[1] == c and conv_state.is_contiguous(),
        f"conv_state must be contiguous (W-1, {c}), got {tuple(conv_state.shape)}",
    )
    width = conv_state.shape[0] + 1
    _check(
        conv_weight.shape == (c, width) and conv_weight.is_contiguous(),
        f"conv_weight must be contiguous ({c}, {width}), got {tuple(conv_weight.shape)}",
    )
    for name, x, shape in (
        ("z", z, (t, hv * vd)),
        ("b", b, (t, hv)),
        ("a", a, (t, hv)),
        ("A_log", A_log, (hv,)),
        ("dt_bias", dt_bias, (hv,)),
        ("norm_weight", norm_weight, (vd,)),
    ):
        _check(
            x.shape == shape and x.is_contiguous(),
            f"{name} must be contiguous {shape}, got {tuple(x.shape)}",
        )
    tensors = (mixed_qkv, z, b, a, conv_weight, conv_state, A_log, dt_bias, norm_weight, state)
    _check(all(x.device == state.device for x in tensors), "all tensors must be on one device")
    _check(
        chunk_size in (16, 32, 64, 128), f"chunk_size must be 16, 32, 64 or 128, got {chunk_size}"
    )
    _check(
        method == "scan" or min(kd, vd) >= 16,
        f"the chunked form needs K, Vd >= 16 (tensor-core tiles), got K={kd}, Vd={vd}",
    )
    dev, bk, bvd = state.device, pow2(kd), pow2(vd)

    _check(
        list(cuts) == sorted(set(cuts)) and all(0 < c < t for c in cuts) and
        (snaps is not None or not cuts),
        f"cuts must be increasing offsets in (0, {t}) with a snaps list, got {list(cuts)}",
    )  # fmt: skip
    # The conv state at each cut, before the prep kernel overwrites the old one: the last
    # W-1 inputs before the cut, from the old state where the cut is that close to the start.
    conv_cuts = [torch.cat([conv_state[c:], mixed_qkv[max(0, c - conv_state.shape[0]) : c]])
                 for c in cuts]  # fmt: skip

    # 1. conv + norms + gates
    bt_prep = 32
    _check(width - 1 <= bt_prep, f"conv kernel {width} too wide")
    y = torch.empty(t, c, dtype=mixed_qkv.dtype, device=dev)
    g, beta = (torch.empty(t, hv, dtype=torch.float32, device=dev) for _ in range(2))
    wp = pow2(max(width - 1, 1))
    _prep_kernel[(cdiv(t, bt_prep), 2 * hk + hv)](
        mixed_qkv, conv_weight, conv_state, b, a, A_log, dt_bias, y, g, beta, t, kd**-0.5,
        HK=hk, HV=hv, K=kd, VD=vd, W=width, BT=bt_prep, BC=max(bk, bvd), WP=wp, num_warps=4,
    )  # fmt: skip
    dims = {"HK": hk, "HV": hv, "K": kd, "VD": vd, "BK": bk}

    # 2. the recurrence (+ the norm where a program sees whole heads)
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
    bounds = [0, *cuts, t]
    for i, (lo, hi) in enumerate(zip(bounds, bounds[1:], strict=False)):
        if i:  # the state after the first ``lo`` tokens
            snaps.append((conv_cuts[i - 1], state.clone()))
        rows = slice(lo, hi)
        _recurrence(
            y[rows], g[rows], beta[rows], z[rows], norm_weight, state, o_buf[rows],
            None if w is None else w[rows], None if u is None else u[rows], eps, method,
            chunk_size, bv, nv, fuse, num_warps, dims,
        )  # fmt: skip
    return (
        o_buf
        if fuse or method == "chunk_par"
        else gated_rmsnorm(o_buf, z, norm_weight, eps, out_dtype)
    )


def _recurrence(y, g, beta, z, norm_weight, state, o_buf, w, u, eps, method, chunk_size, bv,
                nv, fuse, num_warps, dims) -> None:  # fmt: skip
    """The state walk over T prepared tokens (one piece of a chunk), writing o_buf."""
    t, hv = g.shape
    bk, bvd, kd = dims["BK"], pow2(dims["VD"]), dims["K"]
    if method == "scan":
        _scan_kernel[(nv, hv)](
            y, g, beta, state, z, norm_weight, o_buf, t, eps, BV=bv, FUSE_NORM=fuse,
            num_warps=num_warps or 4, **dims,
        )  # fmt: skip
        return
    nt = cdiv(t, chunk_size)
    nsq = max(0, (chunk_size // 16).bit_length() - 2)  # squarings until M^(BT/16) = 0
    _chunk_wy_kernel[(nt, hv)](
        y, g, beta, w, u, t, BT=chunk_size, BVD=bvd, NSQ=nsq, num_warps=4, **dims
    )  # fmt: skip
    if method == "chunk":
        _chunk_scan_kernel[(nv, hv)](
            y, g, w, u, state, z, norm_weight, o_buf, t, eps, BT=chunk_size, BV=bv,
            FUSE_NORM=fuse, num_warps=num_warps or (8 if bv * bk >= 128 * 128 else 4),
            num_stages=2, **dims,  # 2 stages prefetch the next chunk; 3 only cost memory
        )  # fmt: skip
        return
    # "chunk_par": states per chunk start, then all outputs in parallel (norm fused)
    h = torch.empty(nt, hv, kd, dims["VD"], dtype=w.dtype, device=w.device)
    vn = torch.empty(t, hv, dims["VD"], dtype=w.dtype, device=w.device)
    _chunk_state_kernel[(nv, hv)](
        y, g, w, u, state, h, vn, t, BT=chunk_size, BV=bv, num_warps=num_warps or 4,
        num_stages=2, **dims,
    )  # fmt: skip
    _chunk_out_kernel[(nt, hv)](
        y, g, h, vn, z, norm_weight, o_buf, t, eps, BT=chunk_size, BVD=bvd, num_warps=8, **dims
    )  # fmt: skip
