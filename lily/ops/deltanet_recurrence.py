"""The gated delta rule over a chunk's prepared tokens (stage 2 of deltanet_prefill.py):
the token-by-token scan and the two chunked (matrix) forms, with their launcher.

Inputs come from the prep kernel: y (T, C) = q|k|v after the conv, L2-normed q and k, the
gates g and beta (T, Hv) fp32. The state (Hv, K, Vd) fp32 is updated in place; outputs go
to o_buf (normed when one program covers a whole head). See deltanet_prefill.py for the
maths of each form. The "chunk" form can also store the state after the first ``cut`` tokens
(a prefix-cache snapshot) from the same two launches, by shifting its chunk grid so that a
chunk ends at the cut.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lily.ops.launch import cdiv, launched, pow2
from lily.ops.norm_rope import gated_rmsnorm_rows


@launched
@triton.jit
def _scan_kernel(
    y, g, beta, state, z, norm_w, o_buf, T, stride_z, eps, HK: tl.constexpr, HV: tl.constexpr,
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
            b_z = tl.load(z + t * stride_z + i_h * VD + o_v, mask=m_v, other=0.0).to(tl.float32)
            b_r = tl.rsqrt(tl.sum(b_o * b_o, 0) / VD + eps)
            b_o = b_o * b_r * b_nw * b_z / (1.0 + tl.exp(-b_z))
        tl.store(o_buf + off, b_o.to(o_buf.dtype.element_ty), mask=m_v)
    tl.store(p_s, b_S, mask=m_s)


# NOTE: T is never specialized in the chunked kernels. Triton makes an int argument equal to
# 1 a constant; compiled so for sm_90 by Triton 3.6, these kernels (tensor-core products over
# chunks padded past T) made illegal memory accesses on the H200 (a one-token piece: the
# chunk "4 tokens, snapshot cuts at 1 and 2" of every fresh chat prompt of 4 tokens, and
# a 1-token chunk; the same launches with T not specialized are correct). The token scan
# was fine. tests/ops/test_deltanet_ops.py::test_prefill_one_token_pieces_cuda.
_NO_T = ["T"]


@launched
@triton.jit(do_not_specialize=[*_NO_T, "shift"])
def _chunk_wy_kernel(
    y, g, beta, w, u, T, shift, HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
    VD: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BVD: tl.constexpr, NSQ: tl.constexpr,
    HAS_CUT: tl.constexpr,
):  # fmt: skip
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    C: tl.constexpr = 2 * HK * K + HV * VD
    i_kh = i_h // (HV // HK)
    o_i = tl.arange(0, BT)
    o_t = i_c * BT + o_i
    if HAS_CUT:  # the grid starts ``shift`` rows before the first token (see recurrence)
        o_t -= shift
        m_t = (o_t >= 0) & (o_t < T)
    else:
        m_t = o_t < T
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_v = tl.arange(0, BVD)
    m_v = o_v < VD
    # padded rows (after the last token, or before the first with a shift) get g = 0,
    # beta = 0 and k = v = 0: their rows and columns of A are 0, so are their w and u, and
    # the real rows' cumulative gates are those of a chunk starting at the first real row
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
@triton.jit(do_not_specialize=[*_NO_T, "shift", "cut_chunk"])
def _chunk_scan_kernel(
    y, g, w, u, state, snap, z, norm_w, o_buf, T, shift, cut_chunk, stride_z, eps,
    HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, VD: tl.constexpr, BT: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, FUSE_NORM: tl.constexpr, HAS_CUT: tl.constexpr,
):  # fmt: skip
    """HAS_CUT: chunk i_c covers rows i_c*BT - shift ..., so chunk ``cut_chunk`` ends at the
    cut, and the state after it goes to ``snap`` (fp32, the layout of ``state``); the rows
    before the first token are padding, as those after the last (see _chunk_wy_kernel)."""
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
    if HAS_CUT:
        n_c = tl.cdiv(T + shift, BT)
    else:
        n_c = tl.cdiv(T, BT)
    for i_c in range(n_c):
        o_t = i_c * BT + o_i
        if HAS_CUT:
            o_t -= shift
            m_t = (o_t >= 0) & (o_t < T)
        else:
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
            p_z = z + o_t[:, None] * stride_z + i_h * VD + o_v[None, :]
            b_z = tl.load(p_z, mask=m_tv, other=0.0).to(tl.float32)
            b_r = tl.rsqrt(tl.sum(b_o * b_o, 1) / VD + eps)
            b_o = b_o * b_r[:, None] * b_nw[None, :] * b_z / (1.0 + tl.exp(-b_z))
        tl.store(o_buf + off, b_o.to(o_buf.dtype.element_ty), mask=m_tv)
        b_vd = (b_vn * tl.exp(b_gl - b_gc)[:, None]).to(dt)
        b_S = b_S * tl.exp(b_gl) + tl.dot(tl.trans(b_k), b_vd)
        if HAS_CUT:
            # the state after the first ``cut`` tokens; its pointers are built here, not kept
            # from p_s: holding them across the loop cost registers (mixer_kernels.md)
            if i_c == cut_chunk:
                tl.store(snap + i_h * K * VD + o_k[:, None] * VD + o_v[None, :], b_S, mask=m_s)
    tl.store(p_s, b_S, mask=m_s)


@launched
@triton.jit(do_not_specialize=_NO_T)
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
@triton.jit(do_not_specialize=_NO_T)
def _chunk_out_kernel(
    y, g, h, vn, z, norm_w, out, T, stride_z, eps, HK: tl.constexpr, HV: tl.constexpr,
    K: tl.constexpr, VD: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BVD: tl.constexpr,
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
    p_z = z + o_t[:, None] * stride_z + i_h * VD + o_v[None, :]
    b_z = tl.load(p_z, mask=m_tv, other=0.0).to(tl.float32)
    b_nw = tl.load(norm_w + o_v, mask=m_v, other=0.0).to(tl.float32)
    causal = o_i[:, None] >= o_i[None, :]
    b_qk = tl.dot(b_q, tl.trans(b_k))
    b_qk = tl.where(
        causal, b_qk * tl.exp(tl.where(causal, b_gc[:, None] - b_gc[None, :], 0.0)), 0.0
    )
    b_o = tl.dot(b_q, b_h) * tl.exp(b_gc)[:, None] + tl.dot(b_qk.to(b_vn.dtype), b_vn)
    b_y = gated_rmsnorm_rows(b_o, b_z, b_nw, eps, VD)
    tl.store(out + p_tv, b_y.to(out.dtype.element_ty), mask=m_tv)


def recurrence(y, g, beta, z, norm_weight, state, o_buf, w, u, eps, method, chunk_size, bv,
                nv, fuse, num_warps, dims, cut=0, snap=None) -> None:  # fmt: skip
    """The state walk over T prepared tokens (one piece of a chunk), writing o_buf. With
    ``snap`` (an fp32 tensor shaped like ``state``; method "chunk" only), the state after the
    first ``cut`` tokens (0 < cut < T) is stored there by the same launches."""
    t, hv = g.shape
    bk, bvd, kd = dims["BK"], pow2(dims["VD"]), dims["K"]
    has_cut = snap is not None
    if has_cut and not (method == "chunk" and 0 < cut < t and snap.shape == state.shape
                        and snap.dtype == torch.float32 and snap.is_contiguous()):  # fmt: skip
        raise ValueError(
            f"recurrence: an in-kernel cut needs method 'chunk', 0 < cut < {t} and a "
            f"contiguous fp32 snap shaped like the state, got {method!r}, cut {cut}"
        )
    if method == "scan":
        _scan_kernel[(nv, hv)](
            y, g, beta, state, z, norm_weight, o_buf, t, z.stride(0), eps, BV=bv, FUSE_NORM=fuse,
            num_warps=num_warps or 4, **dims,
        )  # fmt: skip
        return
    # One wy and one scan launch even with a cut: the chunk grid starts ``shift`` padding rows
    # before the first token so that a chunk ends on the cut (the chunked form is exact, only
    # its boundaries move). Splitting the walk there cost two more launches and a state copy
    # per layer, and the host, not the GPU, paced a reused turn. shift and cut_chunk are
    # runtime ints (not specialized): a new cut needs no compile.
    shift = (-cut) % chunk_size if has_cut else 0
    nt = cdiv(t + shift, chunk_size)
    nsq = max(0, (chunk_size // 16).bit_length() - 2)  # squarings until M^(BT/16) = 0
    _chunk_wy_kernel[(nt, hv)](
        y, g, beta, w, u, t, shift, BT=chunk_size, BVD=bvd, NSQ=nsq, HAS_CUT=has_cut,
        num_warps=4, **dims,
    )  # fmt: skip
    if method == "chunk":
        cut_chunk = (cut + shift) // chunk_size - 1 if has_cut else -1
        _chunk_scan_kernel[(nv, hv)](
            y, g, w, u, state, snap if has_cut else state, z, norm_weight, o_buf, t, shift,
            cut_chunk, z.stride(0), eps, BT=chunk_size, BV=bv, FUSE_NORM=fuse, HAS_CUT=has_cut,
            num_warps=num_warps or (8 if bv * bk >= 128 * 128 else 4),
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
        y, g, h, vn, z, norm_weight, o_buf, t, z.stride(0), eps, BT=chunk_size, BVD=bvd,
        num_warps=8, **dims,
    )  # fmt: skip
