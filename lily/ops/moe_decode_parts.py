"""Triton pieces the MoE decode kernels share, in their FMA and tensor-core forms (and the
prefill's routing): the top-k of the router logits and a gate/up program's routing (or the
router launch's, once a row), and the down launch's early loads and epilogue (the gated
shared expert and the residual)."""

from __future__ import annotations

import triton
import triton.language as tl

from lily.ops.mma_rows import prep_store
from lily.ops.norm_rope import sigmoid
from lily.ops.qgemv import gemv_tile, load_words, load_x
from lily.ops.qgemv_mma import mma_x_row
from lily.ops.rmsnorm import cast_to


@triton.jit
def _flip(u):
    # fp32 bits <-> an int32 of the same order (negative floats: magnitude bits reversed).
    return u ^ ((u >> 31) & 0x7FFFFFFF)


@triton.jit
def topk_rows(b_l, E, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """Top-k of each row of fp32 logits (R, BLOCK_E), columns >= E ignored.

    Returns (ids (R, BLOCK_K) int32, weights (R, BLOCK_K) fp32): the k largest in descending
    order (ties: lowest index first) and their renormalised softmax weights
    ``exp(l_j - l_max) / sum_top-k exp(l_i - l_max)`` (the full softmax's denominator
    cancels in the renormalisation); entries k..BLOCK_K-1 are 0.
    NOTE: the keys are 64-bit integers, (order-preserving logit bits + 2^31) << 16 |
    (BLOCK_E - 1 - index): distinct, >= 0 for every real logit, NaN included, and negative
    for padding, so every pick is a real, distinct column < E whatever the values. The
    selection is Triton's bitonic top-k (5 barriers at BLOCK_E = 256 on 4 warps, where k
    rounds of argmax took 29).
    """
    BLOCK_E: tl.constexpr = b_l.shape[1]
    o_e = tl.arange(0, BLOCK_E)
    o_k = tl.arange(0, BLOCK_K)
    # NOTE: -2**31 is an int32 literal (2**31 would be typed uint32).
    u = _flip(b_l.to(tl.int32, bitcast=True)).to(tl.int64) - (-2147483648)
    key = (u << 16) | (o_e ^ (BLOCK_E - 1)).to(tl.int64)[None, :]  # BLOCK_E - 1 - o_e
    key = tl.where((o_e < E)[None, :], key, -1)
    top = tl.topk(key, BLOCK_K, dim=1)  # (R, BLOCK_K), descending
    ids = ((top & 0xFFFF) ^ (BLOCK_E - 1)).to(tl.int32)
    vals = _flip(((top >> 16) + (-2147483648)).to(tl.int32)).to(tl.float32, bitcast=True)
    m_k = (o_k < TOP_K)[None, :]
    b_max = tl.max(tl.where(m_k, vals, float("-inf")), axis=1)
    b_p = tl.where(m_k, tl.exp(vals - b_max[:, None]), 0.0)
    return tl.where(m_k, ids, 0), b_p / tl.sum(b_p, axis=1)[:, None]


@triton.jit
def row_ptrs(p_x, p_logits, p_h, stride_xt, stride_lt, stride_hb):
    """Row ``program_id(1)``'s x (or residual), logits and h: over B rows, each launch of
    moe_decode runs its one-row grid once a row (grid axis 1; axis 1 is 0 for one row)."""
    r = tl.program_id(1)
    return p_x + r * stride_xt, p_logits + r * stride_lt, p_h + r * stride_hb


@triton.jit
def row_pairs(p_ids, p_wts, TOP_K: tl.constexpr):
    """Row ``program_id(1)``'s k (expert, weight) pairs."""
    r = tl.program_id(1)
    return p_ids + r * TOP_K, p_wts + r * TOP_K


@triton.jit
def slot_expert(p_logits, p_ids, p_wts, E, slot, pid, TOP_K: tl.constexpr,
                BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr):  # fmt: skip
    """A gate/up program's routing, after its PDL wait: the top-k of the E logits, written
    to p_ids / p_wts by program 0 for the down launch; returns this slot's expert (int64)."""
    o_k = tl.arange(0, BLOCK_K)
    ids, wts = row_topk(p_logits, E, TOP_K, BLOCK_K, BLOCK_E, "")
    if pid == 0:
        write_pairs(p_ids, p_wts, ids, wts, TOP_K, BLOCK_K)
    return tl.sum(tl.sum(tl.where(o_k[None, :] == slot, ids, 0), axis=1), axis=0).to(tl.int64)


@triton.jit
def row_topk(p_logits, E, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
             CACHE: tl.constexpr):  # fmt: skip
    """The top-k (ids, weights, each (1, BLOCK_K)) of one row's E logits, loaded with
    cache modifier CACHE."""
    o_e = tl.arange(0, BLOCK_E)
    b_l = tl.load(p_logits + o_e, mask=o_e < E, other=0.0, cache_modifier=CACHE)
    return topk_rows(b_l[None, :], E, TOP_K, BLOCK_K)


@triton.jit
def write_pairs(p_ids, p_wts, ids, wts, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """A row's k (expert, weight) pairs (``row_topk``'s) for the down launch."""
    o_k = tl.arange(0, BLOCK_K)
    tl.store(p_ids + o_k[None, :], ids, mask=(o_k < TOP_K)[None, :])
    tl.store(p_wts + o_k[None, :], wts, mask=(o_k < TOP_K)[None, :])


@triton.jit
def prep_row(p_x, p_nw, eps, p_op, p_sum, GROUP: tl.constexpr, NG: tl.constexpr,
             G: tl.constexpr, HAS_NORM: tl.constexpr, ON_CPU: tl.constexpr):  # fmt: skip
    """x' of one row as a prepared one-row operand (``prep_store``: bf16 in the codes' K
    order and the group sums), normed as ``mma_x_row`` makes it."""
    b_xn = mma_x_row(p_x, p_nw, eps, NG, G, GROUP, HAS_NORM, NG == G, ON_CPU)
    prep_store(b_xn, p_op, p_sum, 0, 1, GROUP, G)


@triton.jit
def route_once(
    p_x, p_nw, eps, p_logits, p_ids, p_wts, p_op, p_sum, p_ticket, E, PROGS: tl.constexpr,
    TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr, GROUP: tl.constexpr,
    NG: tl.constexpr, G: tl.constexpr, HAS_NORM: tl.constexpr, PREP: tl.constexpr,
    ON_CPU: tl.constexpr,
):  # fmt: skip
    """A router program's part in routing its row once (``MoeDecodeConfig.route_once``),
    after it stored its logits: the row's last of the PROGS router programs to finish (a
    ticket it leaves at zero) takes the top-k and writes the (expert, weight) pairs, and
    with ``PREP`` x' as a prepared operand (``prep_row``; else another program of the
    launch makes it off the ticket's tail), so no gate/up program sorts the logits or
    norms and permutes x itself."""
    # NOTE: the ticket is one thread's atomic: its release covers only that thread's
    # stores, so every thread's logits must be issued first (as in qgemv's split-K).
    tl.debug_barrier()
    ticket = tl.atomic_add(p_ticket, 1, sem="acq_rel")
    if ticket == PROGS - 1:
        # .cg: past L1, the other programs' logits were written by other SMs
        ids, wts = row_topk(p_logits, E, TOP_K, BLOCK_K, BLOCK_E, ".cg")
        write_pairs(p_ids, p_wts, ids, wts, TOP_K, BLOCK_K)
        tl.atomic_xchg(p_ticket, 0)  # left at zero for the next call
        if PREP:
            prep_row(p_x, p_nw, eps, p_op, p_sum, GROUP, NG, G, HAS_NORM, ON_CPU)


@triton.jit
def down_early(
    p_sdw, p_sds, p_sdb, stride_sqn, stride_ssn, p_h, stride_h, p_logits, p_res, o_n, m_n,
    E, I_S, TOP_K: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, S_BG: tl.constexpr,
    HAS_SHARED: tl.constexpr, HAS_RES: tl.constexpr,
):  # fmt: skip
    """What a down launch reads before pdl_wait (see the note in moe_decode's gate/up
    kernel): the shared expert's down tile (constant), its h row and gate logit (router
    kernel, two launches back), the residual."""
    b_sw, b_ss, b_sb, b_hs, b_c, b_res = 0.0, 0.0, 0.0, 0.0, 0.0, 0.0  # unused placeholders
    if HAS_SHARED:
        b_sw, b_ss, b_sb = load_words(p_sdw, p_sds, p_sdb, stride_sqn, stride_ssn, o_n, m_n, 0,
                                      I_S // GROUP, BITS, GROUP, S_BG)  # fmt: skip
        b_hs, _ = load_x(p_h + TOP_K * stride_h, p_h, 0, I_S // GROUP, True, False, BITS, GROUP,
                         S_BG)  # fmt: skip
        b_c = tl.load(p_logits + E)
    if HAS_RES:
        b_res = tl.load(p_res + o_n, mask=m_n, other=0.0).to(tl.float32)
    return b_sw, b_ss, b_sb, b_hs, b_c, b_res


@triton.jit
def down_finish(
    acc, b_sw, b_ss, b_sb, b_hs, b_c, b_res, p_out, o_n, m_n, mask_lo, BITS: tl.constexpr,
    S_BG: tl.constexpr, HAS_SHARED: tl.constexpr, HAS_RES: tl.constexpr, ON_CPU: tl.constexpr,
):  # fmt: skip
    """The routed experts' sum plus the gated shared expert and the residual, written once."""
    if HAS_SHARED:
        acc += gemv_tile(b_sw, b_ss, b_sb, b_hs, mask_lo, BITS, S_BG) * sigmoid(b_c)
    if HAS_RES:
        acc += b_res
    tl.store(p_out + o_n, cast_to(acc, p_out.dtype.element_ty, ON_CPU), mask=m_n)
