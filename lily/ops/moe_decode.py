"""MoE block for one decode token, on the GPU from (norm and) router to residual, no host sync.

Three launches, all shapes fixed (CUDA-graph capturable); every program issues all of its
weight loads at once (whole K per program), before any reduction:

1. ``_moe_router_kernel``: the router logits (E rows, fp32), the shared expert's gate logit
   (row E of the logits) and the shared expert's gate/up with ``silu(gate) * up`` (h row k):
   the shared expert does not depend on the routing, so it rides in the router's launch;
2. ``_moe_gate_up_kernel``, grid (k slots x I blocks): every program reads the E logits and
   takes the top-k itself (bitonic, under a microsecond; no ticket, no extra launch), then
   both projections of its slot's expert, ``silu(gate) * up`` into h (k+1, I) fp32 (stays
   in L2); program 0 also writes the k (expert, weight) pairs for launch 3;
3. ``_moe_down_kernel``, grid (D blocks,): a program owns its output rows across all slots,
   loading the k experts' tiles as one (k, rows, words) block; routing weights, the shared
   gate ``sigmoid(logit)`` and the residual are applied in registers, the row written once.

Launches 2 and 3 run on the tensor cores where the experts allow it (4-bit, 16-byte rows:
the model's case; ``MoeDecodeConfig.mma``): lily/ops/moe_decode_mma.py. The FMA kernels
here stay for 8-bit experts and unaligned rows.

With ``norm_weight`` every program of launches 1 and 2 computes ``rmsnorm(x) * norm_weight``
itself (x is 2048 values), so the layer's post-attention norm costs no launch. ``pdl``:
programmatic dependent launch (see lily.ops.qgemv), constants loaded before the wait.
Routing is NaN-proof: top-k runs on 64-bit integer keys (order-preserving bits of the logit,
then the index), so a NaN or infinite logit still yields k distinct experts in range and a
NaN output for that token, never an out-of-range expert id (an address).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lily.ops.launch import (
    cdiv,
    launched,
    mask_lo,
    pdl_launch,
    pow2,
    use_pdl,
)
from lily.ops.moe_checks import check_moe
from lily.ops.moe_decode_config import MoeDecodeConfig
from lily.ops.moe_decode_mma import mma_fits, moe_mma_experts
from lily.ops.moe_decode_parts import (
    down_early,
    down_finish,
    prep_row,
    route_once,
    row_pairs,
    row_ptrs,
    slot_expert,
)
from lily.ops.norm_rope import sigmoid
from lily.ops.qgemv import as_f as _as_f
from lily.ops.qgemv import gemv_block, gemv_tile, load_words, load_x, pdl_wait
from lily.ops.rmsnorm import norm_meta, norm_x
from lily.quant import QuantWeight

Tensor = torch.Tensor


@triton.jit
def _gate_up_words(gw, gs, gb, uw, us, ub, sqn, ssn, o_n, m_n, D,
                   BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr):  # fmt: skip
    """Gate and up tiles of rows o_n, whole K (words, scales, biases of each)."""
    b_gw, b_gs, b_gb = load_words(gw, gs, gb, sqn, ssn, o_n, m_n, 0, D // GROUP, BITS, GROUP,
                                  BLOCK_G)  # fmt: skip
    b_uw, b_us, b_ub = load_words(uw, us, ub, sqn, ssn, o_n, m_n, 0, D // GROUP, BITS, GROUP,
                                  BLOCK_G)  # fmt: skip
    return b_gw, b_gs, b_gb, b_uw, b_us, b_ub


@triton.jit
def _gate_up(
    b_gw, b_gs, b_gb, b_uw, b_us, b_ub, b_x, b_nw, eps, D, mask_lo,
    BITS: tl.constexpr, BLOCK_G: tl.constexpr, HAS_NORM: tl.constexpr, ON_CPU: tl.constexpr,
):  # fmt: skip
    """``silu(x' @ gate.T) * (x' @ up.T)`` fp32 (BN,) from loaded tiles and the whole row x
    (BW, PER) with its norm weight: x' is prepared once for both."""
    rstd = 1.0
    if HAS_NORM:
        b_xf = b_x.to(tl.float32)
        rstd = 1.0 / tl.sqrt_rn(tl.sum(tl.sum(b_xf * b_xf, axis=1), axis=0) / D + eps)
    b_xn = norm_x(b_x, b_nw, rstd, HAS_NORM, ON_CPU)
    b_g = gemv_tile(b_gw, b_gs, b_gb, b_xn, mask_lo, BITS, BLOCK_G)
    b_u = gemv_tile(b_uw, b_us, b_ub, b_xn, mask_lo, BITS, BLOCK_G)
    return b_g * sigmoid(b_g) * b_u


@launched
@triton.jit
def _moe_router_kernel(
    p_x, p_nw, p_logits, p_h, stride_xt, stride_lt, stride_hb,
    p_ids, p_wts, p_op, p_sum, p_ticket,
    p_rw, p_rs, p_rb, stride_rqn, stride_rsn,
    p_cw, p_cs, p_cb,
    p_sgw, p_sgs, p_sgb, p_suw, p_sus, p_sub, stride_sqn, stride_ssn,
    E, D, I_S, stride_h, mask_lo_r, mask_lo_c, mask_lo, eps,
    TOP_K: tl.constexpr, R_PROGS: tl.constexpr, R_BN: tl.constexpr, R_BITS: tl.constexpr,
    R_GROUP: tl.constexpr, R_BG: tl.constexpr, C_BITS: tl.constexpr, C_GROUP: tl.constexpr,
    C_BG: tl.constexpr, S_BN: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
    S_BG: tl.constexpr, HAS_NORM: tl.constexpr, NORM_BLOCK: tl.constexpr,
    NORM_STEPS: tl.constexpr, HAS_SHARED: tl.constexpr, ROUTED: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr, NG: tl.constexpr, G: tl.constexpr, ON_CPU: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    # Weights first; with PDL, x (the previous kernel's output) only after pdl_wait.
    pid = tl.program_id(0)
    r = tl.program_id(1)
    p_x, p_logits, p_h = row_ptrs(p_x, p_logits, p_h, stride_xt, stride_lt, stride_hb)
    # NOTE: each branch names its own tensors: the compiler (unlike the interpreter) wants a
    # variable assigned in two run-time branches to have one type.
    if pid < R_PROGS:
        # Router rows -> logits[0:E] (fp32).
        o_r = pid * R_BN + tl.arange(0, R_BN)
        b_r = gemv_block(
            p_x, 0, 1, D, p_nw, eps, p_rw, p_rs, p_rb, stride_rqn, stride_rsn, o_r, o_r < E,
            0, D // R_GROUP, mask_lo_r, R_BITS, R_GROUP, R_BG, 1, 1, HAS_NORM, True, NORM_BLOCK,
            NORM_STEPS, ON_CPU, PDL,
        )  # fmt: skip
        tl.store(p_logits + o_r[None, :], b_r, mask=(o_r < E)[None, :])
        if ROUTED:
            p_ids, p_wts = row_pairs(p_ids, p_wts, TOP_K)
            route_once(p_x, p_nw, eps, p_logits, p_ids, p_wts, p_op + r * (G * GROUP),
                       p_sum + r * G, p_ticket + r, E, R_PROGS, TOP_K, BLOCK_K, BLOCK_E, GROUP,
                       NG, G, HAS_NORM, not HAS_SHARED, ON_CPU)  # fmt: skip
    elif pid == R_PROGS:
        # The shared expert's gate (one row) -> logits[E].
        o_c = tl.arange(0, 2)
        b_c = gemv_block(
            p_x, 0, 1, D, p_nw, eps, p_cw, p_cs, p_cb, 0, 0, o_c, o_c < 1, 0, D // C_GROUP,
            mask_lo_c, C_BITS, C_GROUP, C_BG, 1, 1, HAS_NORM, True, NORM_BLOCK, NORM_STEPS,
            ON_CPU, PDL,
        )  # fmt: skip
        tl.store(p_logits + E + o_c[None, :], b_c, mask=(o_c < 1)[None, :])
        if ROUTED:
            # route_once's x', here beside the ticket rather than on its tail (measured on
            # the H100: the router launch took 9.2 -> 12 us with both on the tail, 8 rows)
            prep_row(p_x, p_nw, eps, p_op + r * (G * GROUP), p_sum + r * G, GROUP, NG, G,
                     HAS_NORM, ON_CPU)  # fmt: skip
    else:
        # Shared expert gate/up rows -> h[TOP_K].
        o_s = (pid - R_PROGS - 1) * S_BN + tl.arange(0, S_BN)
        m_s = o_s < I_S
        b_gw, b_gs, b_gb, b_uw, b_us, b_ub = _gate_up_words(
            p_sgw, p_sgs, p_sgb, p_suw, p_sus, p_sub, stride_sqn, stride_ssn, o_s, m_s, D, BITS,
            GROUP, S_BG,
        )  # fmt: skip
        pdl_wait(PDL)
        b_xs, b_nws = load_x(p_x, p_nw, 0, D // GROUP, True, HAS_NORM, BITS, GROUP, S_BG)
        b_h = _gate_up(b_gw, b_gs, b_gb, b_uw, b_us, b_ub, b_xs, b_nws, eps, D, mask_lo, BITS,
                       S_BG, HAS_NORM, ON_CPU)  # fmt: skip
        tl.store(p_h + TOP_K * stride_h + o_s, b_h, mask=m_s)


@launched
@triton.jit
def _moe_gate_up_kernel(
    p_x, p_nw, p_logits, p_ids, p_wts, p_h, stride_xt, stride_lt, stride_hb,
    p_gw, p_gs, p_gb, p_uw, p_us, p_ub, stride_we, stride_se, stride_qn, stride_sn,
    E, D, I_E, stride_h, mask_lo, eps,
    TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr, BITS: tl.constexpr,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, N_BLOCKS: tl.constexpr,
    HAS_NORM: tl.constexpr, ON_CPU: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    slot = pid // N_BLOCKS
    i_n = pid % N_BLOCKS
    p_x, p_logits, p_h = row_ptrs(p_x, p_logits, p_h, stride_xt, stride_lt, stride_hb)
    p_ids, p_wts = row_pairs(p_ids, p_wts, TOP_K)
    # x first: its loads fly while the top-k runs (the weights must wait for the expert id).
    # NOTE: with PDL, x may be read before pdl_wait: it was written before the router kernel
    # ran, and this kernel starts only once every router program has passed its own wait.
    b_x, b_nw = load_x(p_x, p_nw, 0, D // GROUP, True, HAS_NORM, BITS, GROUP, BLOCK_G)
    pdl_wait(PDL)
    e64 = slot_expert(p_logits, p_ids, p_wts, E, slot, pid, TOP_K, BLOCK_K, BLOCK_E)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < I_E
    b_gw, b_gs, b_gb, b_uw, b_us, b_ub = _gate_up_words(
        p_gw + e64 * stride_we, p_gs + e64 * stride_se, p_gb + e64 * stride_se,
        p_uw + e64 * stride_we, p_us + e64 * stride_se, p_ub + e64 * stride_se, stride_qn,
        stride_sn, o_n, m_n, D, BITS, GROUP, BLOCK_G,
    )  # fmt: skip
    b_h = _gate_up(b_gw, b_gs, b_gb, b_uw, b_us, b_ub, b_x, b_nw, eps, D, mask_lo, BITS,
                   BLOCK_G, HAS_NORM, ON_CPU)  # fmt: skip
    tl.store(p_h + slot * stride_h + o_n, b_h, mask=m_n)


@triton.jit
def _gemv_tile3(b_w, b_s, b_b, b_x, mask_lo, BITS: tl.constexpr, BLOCK_G: tl.constexpr):
    """Per slot: fp32 (S, BN) = x[s] @ w[s].T for words (S, BN, BW), fp32 scales and biases
    (S, BN, BG) and x (S, BW, PER) fp32 (qgemv's gemv_tile with a slot axis in front)."""
    S: tl.constexpr = b_w.shape[0]
    BN: tl.constexpr = b_w.shape[1]
    BW: tl.constexpr = b_w.shape[2]
    PER: tl.constexpr = b_x.shape[2]
    o_j = tl.arange(0, PER)
    if BITS == 4:
        b_scale = tl.where(o_j % 2 == 1, 256.0, 16.0)
    else:
        b_scale = tl.full((PER,), 256.0, tl.float32)
    b_xp = b_x * b_scale[None, None, :]
    b_xs = tl.sum(tl.reshape(tl.sum(b_x, axis=2), (S, BLOCK_G, BW // BLOCK_G)), axis=2)
    b_xps = tl.sum(tl.reshape(tl.sum(b_xp, axis=2), (S, BLOCK_G, BW // BLOCK_G)), axis=2)
    if BITS == 4:
        mask_hi = mask_lo << 4
        x_even, x_odd = tl.split(tl.reshape(b_xp, (S, BW, 2, 2, 2)))
        x04, x26 = tl.split(x_even)
        x15, x37 = tl.split(x_odd)
        x0, x4 = tl.split(x04)
        x2, x6 = tl.split(x26)
        x1, x5 = tl.split(x15)
        x3, x7 = tl.split(x37)
        w11 = b_w << 11
        w3 = b_w << 3
        r5 = b_w >> 5
        b_d = _as_f(b_w << 19, mask_hi) * x0[:, None, :]
        b_d += _as_f(w11, mask_lo) * x1[:, None, :]
        b_d += _as_f(w11, mask_hi) * x2[:, None, :]
        b_d += _as_f(w3, mask_lo) * x3[:, None, :]
        b_d += _as_f(w3, mask_hi) * x4[:, None, :]
        b_d += _as_f(r5, mask_lo) * x5[:, None, :]
        b_d += _as_f(r5, mask_hi) * x6[:, None, :]
        b_d += _as_f(b_w >> 13, mask_lo) * x7[:, None, :]
    else:
        x_even, x_odd = tl.split(tl.reshape(b_xp, (S, BW, 2, 2)))
        x0, x2 = tl.split(x_even)
        x1, x3 = tl.split(x_odd)
        b_d = _as_f(b_w << 15, mask_lo) * x0[:, None, :]
        b_d += _as_f(b_w << 7, mask_lo) * x1[:, None, :]
        b_d += _as_f(b_w >> 1, mask_lo) * x2[:, None, :]
        b_d += _as_f(b_w >> 9, mask_lo) * x3[:, None, :]
    b_d = tl.sum(tl.reshape(b_d, (S, BN, BLOCK_G, BW // BLOCK_G)), axis=3)
    return tl.sum(b_s * (b_d - b_xps[:, None, :]) + b_b * b_xs[:, None, :], axis=2)


@launched
@triton.jit
def _moe_down_kernel(
    p_h, p_ids, p_wts, p_logits, p_res, p_out, stride_xt, stride_lt, stride_hb,
    p_dw, p_ds, p_db, stride_we, stride_se, stride_qn, stride_sn,
    p_sdw, p_sds, p_sdb, stride_sqn, stride_ssn,
    E, D, I_E, I_S, stride_h, mask_lo,
    TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr, S_BG: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_SHARED: tl.constexpr, HAS_RES: tl.constexpr, ON_CPU: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    PER: tl.constexpr = 32 // BITS
    WPG: tl.constexpr = GROUP // PER
    BW: tl.constexpr = BLOCK_G * WPG
    i_n = tl.program_id(0)
    p_res, p_logits, p_h = row_ptrs(p_res, p_logits, p_h, stride_xt, stride_lt, stride_hb)
    p_out += tl.program_id(1) * stride_xt
    p_ids, p_wts = row_pairs(p_ids, p_wts, TOP_K)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < D
    o_k = tl.arange(0, BLOCK_K)
    m_k = o_k < TOP_K
    b_sw, b_ss, b_sb, b_hs, b_c, b_res = down_early(
        p_sdw, p_sds, p_sdb, stride_sqn, stride_ssn, p_h, stride_h, p_logits, p_res, o_n, m_n,
        E, I_S, TOP_K, BITS, GROUP, S_BG, HAS_SHARED, HAS_RES,
    )  # fmt: skip
    pdl_wait(PDL)
    e64 = tl.load(p_ids + o_k, mask=m_k, other=0).to(tl.int64)
    b_r = tl.load(p_wts + o_k, mask=m_k, other=0.0)
    # The k experts' (rows, I) tiles as one block, so every load is in flight at once.
    n_groups = I_E // GROUP
    o_w = tl.arange(0, BW)
    o_g = tl.arange(0, BLOCK_G)
    m_kn = m_k[:, None, None] & m_n[None, :, None]
    p_w = p_dw + e64[:, None, None] * stride_we + o_n[None, :, None] * stride_qn
    b_w = tl.load(p_w + o_w[None, None, :], mask=m_kn & (o_w < n_groups * WPG)[None, None, :],
                  other=0)  # fmt: skip
    p_sb = e64[:, None, None] * stride_se + o_n[None, :, None] * stride_sn + o_g[None, None, :]
    m_sb = m_kn & (o_g < n_groups)[None, None, :]
    b_s = tl.load(p_ds + p_sb, mask=m_sb, other=0.0).to(tl.float32)
    b_b = tl.load(p_db + p_sb, mask=m_sb, other=0.0).to(tl.float32)
    o_x = tl.arange(0, BW)[:, None] * PER + tl.arange(0, PER)[None, :]
    m_x = m_k[:, None, None] & (o_x < I_E)[None, :, :]
    b_h = tl.load(p_h + o_k[:, None, None] * stride_h + o_x[None, :, :], mask=m_x, other=0.0)

    acc = tl.sum(_gemv_tile3(b_w, b_s, b_b, b_h, mask_lo, BITS, BLOCK_G) * b_r[:, None], axis=0)
    down_finish(acc, b_sw, b_ss, b_sb, b_hs, b_c, b_res, p_out, o_n, m_n, mask_lo, BITS, S_BG,
                 HAS_SHARED, HAS_RES, ON_CPU)  # fmt: skip


def _whole(k: int, group_size: int) -> int:
    return pow2(k // group_size)  # BLOCK_G covering all of K in one step


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
    norm_weight: Tensor | None = None,
    eps: float = 1e-6,
    config: MoeDecodeConfig | None = None,
    pdl: bool = False,
    tickets: Tensor | None = None,
) -> Tensor:
    """``residual + moe(x')`` for one token x (D,) -> (D,) in x's dtype, three launches;
    or for one token of each of B sequences, x (B, D) -> (B, D): the same three launches,
    each with its one-row grid once a row (a batched decode step; every row reads its own
    k experts, its programs run beside the other rows').

    ``x' = rmsnorm(x) * norm_weight`` (fp32 statistics, rounded to x's dtype like the
    unfused norm) when ``norm_weight`` (D,) is given, else x; ``residual`` is added as given
    (pass the un-normed x for a decoder layer). router (E, D); gate, up (E, I, D); down
    (E, D, I); the shared expert (Is, D), (Is, D), (D, Is) and its gate (1, D), all
    QuantWeight (or all four shared parts None). ``pdl``: launch the three kernels with
    programmatic dependent launch (Hopper and newer; ignored elsewhere; see lily.ops.qgemv).
    ``tickets``: int32 zeros, one a row at least, for ``config.route_once`` (each call
    leaves them at zero; one buffer serves every layer of a model, whose calls run in turn
    on one stream); None: new ones a call.
    """
    w = (router, gate, up, down, shared_gate, shared_up, shared_down, shared_expert_gate)
    e, i, d, i_s, norm_weight = check_moe("moe_decode", x, w, top_k, residual, norm_weight,
                                          (1, 2), "one token (D,) or one a row (B, D)")  # fmt: skip
    one = x.dim() == 1
    # (B, D) rows; x, the residual and the output share the row stride D
    x = x.reshape(-1, x.shape[-1]).contiguous()
    residual = residual.reshape(x.shape).contiguous() if residual is not None else None
    b = x.shape[0]
    cfg = config or MoeDecodeConfig()
    dev = x.device
    on_cpu = dev.type == "cpu"
    has_shared = i_s > 0
    has_norm = norm_weight is not None
    nw = norm_weight if has_norm else x
    norm_block, norm_steps = norm_meta(d)
    gs = gate.group_size
    block_k = pow2(top_k)
    pdl = use_pdl(pdl, dev)
    mma = cfg.mma and all(mma_fits(w) for w in (gate, up, down))
    # route_once: the router launch routes each row once and prepares its x' for the
    # tensor-core gate/up (one bf16 term a value: bf16 x only)
    routed = cfg.route_once and mma and x.dtype == torch.bfloat16
    ng = d // gs
    g = pow2(ng)
    ids = torch.empty((b, top_k), dtype=torch.int32, device=dev)
    wts = torch.empty((b, top_k), dtype=torch.float32, device=dev)
    if routed:
        op = torch.empty((b, g, gs), dtype=torch.bfloat16, device=dev)
        sums = torch.empty((b, g), dtype=torch.float32, device=dev)
        if tickets is None:
            tickets = torch.zeros(b, dtype=torch.int32, device=dev)
        elif (tickets.dtype != torch.int32 or tickets.numel() < b or tickets.device != dev
              or not tickets.is_contiguous()):  # fmt: skip
            raise ValueError(f"moe_decode: tickets must be contiguous int32 on {dev} with at "
                             f"least {b} entries, got {tickets.dtype} "
                             f"{tuple(tickets.shape)} on {tickets.device}")  # fmt: skip
    else:
        op, sums, tickets = ids, wts, ids  # (unused pointers)

    # 1. router logits, the shared gate's logit (slot E), the shared expert's h (row k);
    # with route_once each row's (expert, weight) pairs and prepared x'.
    # (a row's logits start on 64 bytes, so one row and B rows compile alike)
    logits = torch.empty((b, cdiv(e + 1, 16) * 16), dtype=torch.float32, device=dev)
    h = torch.empty((b, top_k + 1, max(i, i_s)), dtype=torch.float32, device=dev)
    rows = (x.stride(0), logits.stride(0), h.stride(0))
    r_progs = cdiv(e, cfg.router_rows)
    seg = shared_expert_gate if has_shared else router
    sg, su, sd = (shared_gate, shared_up, shared_down) if has_shared else (gate[0], up[0], down[0])
    s_progs = 1 + cdiv(i_s, cfg.shared_rows) if has_shared else 0
    _moe_router_kernel[(r_progs + s_progs, b)](
        x, nw, logits, h, *rows, ids, wts, op, sums, tickets,
        router.qweight, router.scales, router.biases, router.qweight.stride(0),
        router.scales.stride(0),
        seg.qweight, seg.scales, seg.biases,
        sg.qweight, sg.scales, sg.biases, su.qweight, su.scales, su.biases,
        sg.qweight.stride(0), sg.scales.stride(0),
        e, d, i_s, h.stride(1), mask_lo(router.bits), mask_lo(seg.bits), mask_lo(gate.bits),
        float(eps),
        TOP_K=top_k, R_PROGS=r_progs, R_BN=cfg.router_rows, R_BITS=router.bits,
        R_GROUP=router.group_size, R_BG=_whole(d, router.group_size), C_BITS=seg.bits,
        C_GROUP=seg.group_size, C_BG=_whole(d, seg.group_size), S_BN=cfg.shared_rows,
        BITS=gate.bits, GROUP=gs, S_BG=_whole(d, gs), HAS_NORM=has_norm,
        NORM_BLOCK=norm_block, NORM_STEPS=norm_steps, HAS_SHARED=has_shared, ROUTED=routed,
        BLOCK_K=block_k,
        BLOCK_E=pow2(e), NG=ng, G=g, ON_CPU=on_cpu, PDL=pdl, num_warps=cfg.num_warps,
        **pdl_launch(pdl),
    )  # fmt: skip

    # 2. routed gate/up, the top-k in every program (program 0 writes the (expert, weight)
    # pairs) or, with route_once, read.
    out = torch.empty((b, d), dtype=x.dtype, device=dev)
    res = residual if residual is not None else out
    if mma:
        moe_mma_experts(x, nw, logits, ids, wts, h, res, out, gate, up, down, sd, e, d, i, i_s,
                        top_k, eps, cfg, has_norm, has_shared, residual is not None, on_cpu,
                        pdl, (op, sums) if routed else None)  # fmt: skip
        return out[0] if one else out
    nb = cdiv(i, cfg.gate_up_rows)
    _moe_gate_up_kernel[(top_k * nb, b)](
        x, nw, logits, ids, wts, h, *rows,
        gate.qweight, gate.scales, gate.biases, up.qweight, up.scales, up.biases,
        gate.qweight.stride(0), gate.scales.stride(0), gate.qweight.stride(1),
        gate.scales.stride(1),
        e, d, i, h.stride(1), mask_lo(gate.bits), float(eps),
        TOP_K=top_k, BLOCK_K=block_k, BLOCK_E=pow2(e), BITS=gate.bits,
        GROUP=gs, BLOCK_G=_whole(d, gs), BLOCK_N=cfg.gate_up_rows, N_BLOCKS=nb,
        HAS_NORM=has_norm, ON_CPU=on_cpu, PDL=pdl, num_warps=cfg.num_warps, **pdl_launch(pdl),
    )  # fmt: skip

    # 3. down for all slots, weighted sum, shared gate, residual.
    _moe_down_kernel[(cdiv(d, cfg.down_rows), b)](
        h, ids, wts, logits, res, out, *rows,
        down.qweight, down.scales, down.biases, down.qweight.stride(0), down.scales.stride(0),
        down.qweight.stride(1), down.scales.stride(1),
        sd.qweight, sd.scales, sd.biases, sd.qweight.stride(0), sd.scales.stride(0),
        e, d, i, i_s, h.stride(1), mask_lo(down.bits),
        TOP_K=top_k, BLOCK_K=block_k, BITS=down.bits, GROUP=down.group_size,
        BLOCK_G=_whole(i, down.group_size), S_BG=_whole(max(i_s, down.group_size), gs),
        BLOCK_N=cfg.down_rows, HAS_SHARED=has_shared, HAS_RES=residual is not None,
        ON_CPU=on_cpu, PDL=pdl, num_warps=cfg.down_warps, **pdl_launch(pdl),
    )  # fmt: skip
    return out[0] if one else out
