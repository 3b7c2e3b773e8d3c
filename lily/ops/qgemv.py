"""Quantized GEMV for decode: ``x @ w.T`` for one row (or up to 8) against MLX-packed weights.

Decode is bound by the bytes of the packed weight, so the kernel reads each word once, with
16-byte loads, and spends about 3.5 instructions per 4-bit code in its inner loop (budget
at full bandwidth on an H200: about 4.5). The trick that makes that possible (see
docs/notes/linear_kernels.md):

* a code is never converted int -> float. Masked into the mantissa of 1.0 at bit ``p`` it
  *is* the float ``f = 1 + q * 2**(p - 23)``; for 4 bits, even codes land at bit 19 and odd
  codes at bit 15, so one shift serves two codes (5 shifts, 8 masks per word); 8-bit codes
  land at bit 15;
* with ``x'_k = x_k * 2**(23 - p_k)`` (exact, a power of two): ``f_k x'_k = x'_k + q_k x_k``,
  hence per group ``sum_k w_k x_k = s * (sum f x' - sum x') + b * sum x``: one FMA per code;
  the x-side sums are shared by all rows of the program.

Grid: (row blocks, SPLIT_K). With SPLIT_K > 1 every program writes an fp32 partial and the
last program of a row block (an atomic ticket) adds them in a fixed order, so no extra launch
and deterministic results.

Optional RMSNorm prologue (``norm_weight``): the GEMV consumes ``rmsnorm(x) * w_norm``. x is
a few KB, so every program computes the row statistics itself (fp32) instead of a separate
norm launch; it issues its weight loads first so the statistics hide under their latency.

Optional programmatic dependent launch (``pdl=True``, Hopper): the kernel may start while the
previous one in the stream finishes; it issues its weight loads (constants), then waits for
the previous kernel (``griddepcontrol.wait``) before reading x, the residual or anything
else a kernel wrote. In a chain of decode kernels this hides each launch and the first
weight round trip behind the previous kernel's tail.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from lily.ops.launch import (
    cdiv,
    check_weight,
    check_x,
    launched,
    mask_lo,
    pdl_launch,
    pow2,
    use_pdl,
)
from lily.ops.rmsnorm import (
    cast_to,
    check_norm,
    norm_meta,
    norm_x,
    row_rstd,
)
from lily.quant import QuantWeight

Tensor = torch.Tensor

MAX_ROWS = 8  # the batched variant handles up to this many rows of x


@triton.jit
def _as_f(t, mask):
    # The code's bits (already at their mantissa position) OR'd into 1.0.
    return ((t & mask) | 0x3F800000).to(tl.float32, bitcast=True)


as_f = _as_f  # its public name for the kernels of other modules (their bodies call _as_f)


@triton.jit
def x_prep(b_x, BITS: tl.constexpr, BLOCK_G: tl.constexpr):
    """x block (BW, PER) fp32 -> (x' (BW, PER), sum x (BG,), sum x' (BG,)).

    ``x'`` is x times 2**(23 - p) for the mantissa bit ``p`` its code is unpacked to.
    """
    BW: tl.constexpr = b_x.shape[0]
    PER: tl.constexpr = b_x.shape[1]
    o_j = tl.arange(0, PER)
    if BITS == 4:
        b_scale = tl.where(o_j % 2 == 1, 256.0, 16.0)
    else:
        b_scale = tl.full((PER,), 256.0, tl.float32)
    b_xp = b_x * b_scale[None, :]
    b_xs = tl.sum(tl.reshape(tl.sum(b_x, axis=1), (BLOCK_G, BW // BLOCK_G)), axis=1)
    b_xps = tl.sum(tl.reshape(tl.sum(b_xp, axis=1), (BLOCK_G, BW // BLOCK_G)), axis=1)
    return b_xp, b_xs, b_xps


@triton.jit
def dot_words(b_w, b_xp, mask_lo, BITS: tl.constexpr):
    """sum_j f_j(words) * x'_j for words (BN, BW) and x' (BW, PER) -> (BN, BW)."""
    BW: tl.constexpr = b_xp.shape[0]
    if BITS == 4:
        mask_hi = mask_lo << 4
        # (BW, 8) -> eight (BW,) slices; each split peels one bit of j, lowest first.
        x_even, x_odd = tl.split(tl.reshape(b_xp, (BW, 2, 2, 2)))
        x04, x26 = tl.split(x_even)
        x15, x37 = tl.split(x_odd)
        x0, x4 = tl.split(x04)
        x2, x6 = tl.split(x26)
        x1, x5 = tl.split(x15)
        x3, x7 = tl.split(x37)
        # Code j sits at bit 4j; one shift brings codes 2i-1 and 2i to bits 15 and 19.
        w11 = b_w << 11
        w3 = b_w << 3
        r5 = b_w >> 5
        b_d = _as_f(b_w << 19, mask_hi) * x0[None, :]
        b_d += _as_f(w11, mask_lo) * x1[None, :]
        b_d += _as_f(w11, mask_hi) * x2[None, :]
        b_d += _as_f(w3, mask_lo) * x3[None, :]
        b_d += _as_f(w3, mask_hi) * x4[None, :]
        b_d += _as_f(r5, mask_lo) * x5[None, :]
        b_d += _as_f(r5, mask_hi) * x6[None, :]
        b_d += _as_f(b_w >> 13, mask_lo) * x7[None, :]
    else:
        x_even, x_odd = tl.split(tl.reshape(b_xp, (BW, 2, 2)))
        x0, x2 = tl.split(x_even)
        x1, x3 = tl.split(x_odd)
        b_d = _as_f(b_w << 15, mask_lo) * x0[None, :]
        b_d += _as_f(b_w << 7, mask_lo) * x1[None, :]
        b_d += _as_f(b_w >> 1, mask_lo) * x2[None, :]
        b_d += _as_f(b_w >> 9, mask_lo) * x3[None, :]
    return b_d


@triton.jit
def gemv_tile(b_w, b_s, b_b, b_x, mask_lo, BITS: tl.constexpr, BLOCK_G: tl.constexpr):
    """fp32 (BN,) = x slice @ w[rows, slice].T for words (BN, BW), fp32 scales and biases
    (BN, BG) and the x slice (BW, PER) fp32."""
    BW: tl.constexpr = b_w.shape[1]
    BN: tl.constexpr = b_w.shape[0]
    b_xp, b_xs, b_xps = x_prep(b_x, BITS, BLOCK_G)
    b_d = dot_words(b_w, b_xp, mask_lo, BITS)
    b_d = tl.sum(tl.reshape(b_d, (BN, BLOCK_G, BW // BLOCK_G)), axis=2)
    return tl.sum(b_s * (b_d - b_xps[None, :]) + b_b * b_xs[None, :], axis=1)


@triton.jit
def load_words(p_qw, p_s, p_b, stride_qn, stride_sn, o_n, m_n, g0, g_end,
               BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr):  # fmt: skip
    """Words (BN, BW) int32 and fp32 scales, biases (BN, BG) of rows o_n, groups g0.. (groups
    at or past g_end and rows outside m_n read as 0: f = 1 against a zero scale and x)."""
    WPG: tl.constexpr = GROUP * BITS // 32
    BW: tl.constexpr = BLOCK_G * WPG
    o_g = g0 + tl.arange(0, BLOCK_G)
    o_w = g0 * WPG + tl.arange(0, BW)
    m_w = o_w < g_end * WPG
    b_w = tl.load(p_qw + o_n[:, None] * stride_qn + o_w[None, :],
                  mask=m_n[:, None] & m_w[None, :], other=0)  # fmt: skip
    m_sb = m_n[:, None] & (o_g < g_end)[None, :]
    p_sb = o_n[:, None] * stride_sn + o_g[None, :]
    b_s = tl.load(p_s + p_sb, mask=m_sb, other=0.0).to(tl.float32)
    b_b = tl.load(p_b + p_sb, mask=m_sb, other=0.0).to(tl.float32)
    return b_w, b_s, b_b


@triton.jit
def load_x(p_x, p_nw, g0, g_end, m_row, HAS_NORM: tl.constexpr,
           BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr):  # fmt: skip
    """x slice (BW, PER) of groups g0.. (0 past g_end or when not m_row), and the norm
    weight's slice (ones without a norm), both as loaded."""
    PER: tl.constexpr = 32 // BITS
    BW: tl.constexpr = BLOCK_G * GROUP // PER
    o_x = g0 * GROUP + tl.arange(0, BW)[:, None] * PER + tl.arange(0, PER)[None, :]
    m_x = (o_x < g_end * GROUP) & m_row
    b_x = tl.load(p_x + o_x, mask=m_x, other=0.0)
    if HAS_NORM:
        b_nw = tl.load(p_nw + o_x, mask=m_x, other=0.0)
    else:
        b_nw = tl.full((BW, PER), 1.0, tl.float32)
    return b_x, b_nw


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """With programmatic dependent launch: wait until the previous kernel has finished and its
    writes are visible (everything before this may only read constants), then let the next
    kernel launch. Every program of a PDL-launched kernel must pass here, so the kernel can
    only finish after its predecessor (transitively: after all earlier kernels)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def _pick(v, o_t, t):
    # Element t of a small vector, as a scalar.
    return tl.sum(tl.where(o_t == t, v, 0.0), axis=0)


@triton.jit
def gemv_block(
    p_x, stride_xt, T, K, p_nw, eps,
    p_qw, p_s, p_b, stride_qn, stride_sn, o_n, m_n, g_start, g_end, mask_lo,
    BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, STEPS: tl.constexpr,
    BT: tl.constexpr, HAS_NORM: tl.constexpr, NORM_FROM_X: tl.constexpr,
    NORM_BLOCK: tl.constexpr, NORM_STEPS: tl.constexpr, ON_CPU: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """fp32 (BT, BN) = x'[:T, groups g_start:g_end] @ w[o_n, same groups].T (dequantized),
    with x' = rmsnorm(x) * w_norm when HAS_NORM, else x.

    Runs STEPS steps of BLOCK_G groups from g_start; groups at or past g_end are masked.
    The first step's loads (weights, x, norm weight) are issued before the norm statistics'
    reductions, whose barriers would otherwise hold the weight loads back. NORM_FROM_X: the
    one step's x slice is the whole row (one row, no split-K), so the statistics use it
    instead of loading the row again. PDL: wait for the previous kernel after issuing the
    first step's weight loads (see pdl_wait).
    NOTE: loop bounds are constexpr because the Triton interpreter (numpy >= 2) cannot take
    a run-time scalar as a ``range`` bound.
    """
    BN: tl.constexpr = o_n.shape[0]
    o_t = tl.arange(0, BT)
    acc = tl.zeros((BT, BN), tl.float32)
    b_w, b_s, b_b = load_words(p_qw, p_s, p_b, stride_qn, stride_sn, o_n, m_n, g_start, g_end,
                               BITS, GROUP, BLOCK_G)  # fmt: skip
    pdl_wait(PDL)
    if BT == 1:
        b_x, b_nw = load_x(p_x, p_nw, g_start, g_end, T > 0, HAS_NORM, BITS, GROUP, BLOCK_G)
    if HAS_NORM:
        if NORM_FROM_X:
            b_xf = b_x.to(tl.float32)
            ms = tl.sum(tl.sum(b_xf * b_xf, axis=1), axis=0) / K
            rstd = tl.full((BT,), 1.0, tl.float32) / tl.sqrt_rn(ms + eps)
        else:
            rstd = row_rstd(p_x, stride_xt, T, K, eps, BT, NORM_BLOCK, NORM_STEPS)
    else:
        rstd = tl.full((BT,), 1.0, tl.float32)
    for i_s in tl.static_range(STEPS):
        g0 = g_start + i_s * BLOCK_G
        if i_s > 0:
            b_w, b_s, b_b = load_words(p_qw, p_s, p_b, stride_qn, stride_sn, o_n, m_n, g0,
                                       g_end, BITS, GROUP, BLOCK_G)  # fmt: skip
        if BT == 1:
            if i_s > 0:
                b_x, b_nw = load_x(p_x, p_nw, g0, g_end, T > 0, HAS_NORM, BITS, GROUP, BLOCK_G)
            b_xn = norm_x(b_x, b_nw, tl.sum(rstd, axis=0), HAS_NORM, ON_CPU)
            acc += gemv_tile(b_w, b_s, b_b, b_xn, mask_lo, BITS, BLOCK_G)[None, :]
        else:
            # A row at a time: the unpacked codes are common subexpressions across rows.
            for t in tl.static_range(BT):
                b_x, b_nw = load_x(p_x + t * stride_xt, p_nw, g0, g_end, t < T, HAS_NORM,
                                   BITS, GROUP, BLOCK_G)  # fmt: skip
                b_xn = norm_x(b_x, b_nw, _pick(rstd, o_t, t), HAS_NORM, ON_CPU)
                c = gemv_tile(b_w, b_s, b_b, b_xn, mask_lo, BITS, BLOCK_G)
                acc += tl.where(o_t[:, None] == t, c[None, :], 0.0)
    return acc


@launched
@triton.jit
def _qgemv_kernel(
    p_x, p_qw, p_s, p_b, p_nw, p_res, p_out, p_part, p_ticket,
    T, N, K, stride_xt, stride_qn, stride_sn, stride_rt, stride_ot, mask_lo, eps,
    BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_G: tl.constexpr, SPLIT_K: tl.constexpr, HAS_RES: tl.constexpr,
    HAS_NORM: tl.constexpr, NORM_FROM_X: tl.constexpr, NORM_BLOCK: tl.constexpr,
    NORM_STEPS: tl.constexpr, groups_per_split: tl.constexpr, ON_CPU: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    i_n = tl.program_id(0)
    i_k = tl.program_id(1)
    o_t = tl.arange(0, BLOCK_T)
    m_t = o_t < T
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    g_start = i_k * groups_per_split
    g_end = tl.minimum(g_start + groups_per_split, K // GROUP)
    acc = gemv_block(
        p_x, stride_xt, T, K, p_nw, eps,
        p_qw, p_s, p_b, stride_qn, stride_sn, o_n, m_n, g_start, g_end, mask_lo,
        BITS, GROUP, BLOCK_G, triton.cdiv(groups_per_split, BLOCK_G), BLOCK_T, HAS_NORM,
        NORM_FROM_X, NORM_BLOCK, NORM_STEPS, ON_CPU, PDL,
    )  # fmt: skip
    m_tn = m_t[:, None] & m_n[None, :]
    if SPLIT_K > 1:
        # Partials (SPLIT_K, BLOCK_T, N); the last program of this row block sums them.
        p_pb = p_part + o_t[:, None] * N + o_n[None, :]
        tl.store(p_pb + i_k * BLOCK_T * N, acc, mask=m_tn)
        # The ticket is one thread's atomic: its release covers only that thread's stores,
        # so every thread's partials must be issued first (as deltanet_decode does).
        tl.debug_barrier()
        ticket = tl.atomic_add(p_ticket + i_n, 1, sem="acq_rel")
        if ticket == SPLIT_K - 1:
            acc = tl.zeros((BLOCK_T, BLOCK_N), tl.float32)
            for s in range(SPLIT_K):
                # .cg: bypass L1, the partials were written by other SMs.
                acc += tl.load(p_pb + s * BLOCK_T * N, mask=m_tn, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(p_ticket + i_n, 0)  # leave the counter zeroed for the next call
            if HAS_RES:
                p_r = p_res + o_t[:, None] * stride_rt + o_n[None, :]
                acc += tl.load(p_r, mask=m_tn, other=0.0).to(tl.float32)
            p_o = p_out + o_t[:, None] * stride_ot + o_n[None, :]
            tl.store(p_o, cast_to(acc, p_out.dtype.element_ty, ON_CPU), mask=m_tn)
    else:
        if HAS_RES:
            p_r = p_res + o_t[:, None] * stride_rt + o_n[None, :]
            acc += tl.load(p_r, mask=m_tn, other=0.0).to(tl.float32)
        p_o = p_out + o_t[:, None] * stride_ot + o_n[None, :]
        tl.store(p_o, cast_to(acc, p_out.dtype.element_ty, ON_CPU), mask=m_tn)


@dataclass(frozen=True)
class GemvConfig:
    """Tile of one GEMV program: BLOCK_N rows, BLOCK_G groups per K step, SPLIT_K programs
    along K, and the warps per program."""

    block_n: int
    block_g: int
    split_k: int = 1
    num_warps: int = 4

    def __post_init__(self) -> None:
        for name in ("block_n", "block_g", "num_warps"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"GemvConfig.{name} must be a power of two, got {v}")
        if self.split_k < 1:
            raise ValueError(f"GemvConfig.split_k must be >= 1, got {self.split_k}")


_STEP_WORDS = 4096  # packed words one program loads per K step (16 KB, 32 a thread)


@functools.lru_cache(maxsize=1024)  # tiles are pure functions of the shape
def gemv_config(n: int, k: int, t: int, bits: int, group_size: int) -> GemvConfig:
    """Tile for a shape (a stand-in for a measured table; see docs/notes/linear_kernels.md).

    Aim: about 512 programs, each issuing its whole K slice at once (16 KB of words), no
    split-K where the rows allow it (its ticket and partials add a dependent round trip:
    2048x4096 measured 7.0 us split in two against 4.5 us for 4096x2048 unsplit). Few rows
    (routers, the lone k/v projections): split K so that more SMs take part.
    """
    n_groups = k // group_size
    if n >= 65536 and t == 1:  # lm_head: many row blocks, loop over K with a big tile
        # NOTE: one row only: with 2-8 (a batched decode step's head) its codes times the
        # rows spilled 464-1,376 B a thread on every arch (compile matrix); the few-row
        # tile below fits.
        return GemvConfig(64, min(pow2(n_groups), max(1, 512 // group_size)))
    if t == 1:
        block_n = 16 if n >= 8192 else 8 if n >= 4096 else 4
        wpg = group_size * bits // 32
        per_step = max(1, _STEP_WORDS // (block_n * wpg))
    else:
        # Registers hold T rows of x-side values: 2048 codes a row per step over T, rounded
        # down to a power of two (T = 3, 5, 6 gave 10, 6, 5 groups: not a tile).
        block_n = 8
        per_step = max(1, 2048 // group_size // t)
        per_step = 1 << (per_step.bit_length() - 1)
    per_step = min(pow2(n_groups), per_step)
    row_blocks = cdiv(n, block_n)
    split = 1
    if row_blocks < 256:
        split = min(max(1, 512 // row_blocks), max(1, n_groups // 2), 16)
    block_g = min(per_step, pow2(cdiv(n_groups, split)))
    return GemvConfig(block_n, block_g, split, 4)


def _launch_qgemv(
    x: Tensor,
    w: QuantWeight,
    residual: Tensor | None,
    out: Tensor,
    cfg: GemvConfig,
    norm_weight: Tensor | None = None,
    eps: float = 1e-6,
    pdl: bool = False,
) -> None:
    t, k = x.shape
    n = w.shape[0]
    n_groups = k // w.group_size
    per_split = cdiv(n_groups, cfg.split_k)
    split = cdiv(n_groups, per_split)  # no empty K slices
    block_t = pow2(t)
    row_blocks = cdiv(n, cfg.block_n)
    if split > 1:
        part = torch.empty((split, block_t, n), dtype=torch.float32, device=x.device)
        # NOTE: every launch leaves its tickets at zero again; a fresh zeroed buffer per call
        # keeps concurrent streams (and graph branches) from sharing counters.
        ticket = torch.zeros(row_blocks, dtype=torch.int32, device=x.device)
    else:
        part = ticket = out
    res = residual if residual is not None else out
    nw = norm_weight if norm_weight is not None else x
    norm_block, norm_steps = norm_meta(k)
    # One row whose one K step covers all of K: the statistics reuse the loaded x.
    from_x = t == 1 and split == 1 and cfg.block_g >= n_groups
    _qgemv_kernel[(row_blocks, split)](
        x, w.qweight, w.scales, w.biases, nw, res, out, part, ticket,
        t, n, k, x.stride(0), w.qweight.stride(0), w.scales.stride(0), res.stride(0),
        out.stride(0), mask_lo(w.bits), float(eps),
        BITS=w.bits, GROUP=w.group_size, BLOCK_T=block_t, BLOCK_N=cfg.block_n,
        BLOCK_G=cfg.block_g, SPLIT_K=split, HAS_RES=residual is not None,
        HAS_NORM=norm_weight is not None, NORM_FROM_X=from_x, NORM_BLOCK=norm_block,
        NORM_STEPS=norm_steps, groups_per_split=per_split, ON_CPU=x.device.type == "cpu",
        PDL=pdl, num_warps=cfg.num_warps, **pdl_launch(pdl),
    )  # fmt: skip


def qgemv(
    x: Tensor,
    w: QuantWeight,
    *,
    norm_weight: Tensor | None = None,
    eps: float = 1e-6,
    residual: Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    config: GemvConfig | None = None,
    pdl: bool = False,
) -> Tensor:
    """``residual + x' @ dequantize(w).T`` for a decode row.

    x: (K,) or (T, K) with T <= 8, bf16/fp16/fp32; w: QuantWeight (N, K), 4 or 8 bits.
    ``x' = rmsnorm(x) * norm_weight`` (``x * rsqrt(mean(x^2) + eps) * norm_weight``, fp32
    statistics, rounded to x's dtype as the unfused ``rms_norm`` returns it) when
    ``norm_weight`` (K,) is given, else x. Returns (N,) or (T, N) in ``out_dtype`` (default
    x's dtype), accumulated in fp32; ``residual`` (same shape as the output) is added
    before the final rounding. ``pdl``: launch with programmatic dependent launch (Hopper
    and newer; ignored elsewhere): safe whatever ran before, faster after another PDL-aware
    kernel (see the module docstring).
    """
    check_weight(w, "qgemv: w", 2)
    n, k = w.shape
    check_x(x, k, "qgemv", w.device)
    if x.dim() not in (1, 2):
        raise ValueError(f"qgemv: x must be (K,) or (T, K), got {tuple(x.shape)}")
    x2 = x.reshape(1, k) if x.dim() == 1 else x
    if x2.shape[0] > MAX_ROWS or x2.shape[0] < 1:
        raise ValueError(f"qgemv: {x2.shape[0]} rows; the GEMV takes 1..{MAX_ROWS} (use qgemm)")
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    if norm_weight is not None:
        norm_weight = check_norm(norm_weight, k, "qgemv", x.device)
    out_shape = (n,) if x.dim() == 1 else (x2.shape[0], n)
    out = torch.empty((x2.shape[0], n), dtype=out_dtype or x.dtype, device=x.device)
    res2 = None
    if residual is not None:
        if tuple(residual.shape) != out_shape or residual.device != x.device:
            raise ValueError(
                f"qgemv: residual {tuple(residual.shape)} on {residual.device} does not match "
                f"the output {out_shape} on {x.device}"
            )
        res2 = residual.reshape(x2.shape[0], n)
        res2 = res2 if res2.stride(-1) == 1 else res2.contiguous()
    cfg = config or gemv_config(n, k, x2.shape[0], w.bits, w.group_size)
    _launch_qgemv(x2, w, res2, out, cfg, norm_weight, eps, use_pdl(pdl, x.device))
    return out.reshape(out_shape)
