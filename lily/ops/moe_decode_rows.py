"""MoE block for one decode token of each of B sequences (a batched decode step): norm,
router, top-k, experts, shared expert and residual on the GPU, no host sync, every shape
fixed by B (one CUDA graph per batch size).

Each chosen expert's weights are read once for all the rows that chose it. The rows are
the columns of qgemv_mma's tensor-core tile (codes unpacked straight into MMA operands):
where the one-row kernels (moe_decode_mma.py) broadcast one row over the MMA's 8 columns,
here column r holds row r (BR = 8 or 16 columns). Four launches:

1. ``_rows_router_kernel``, grid (E / router_rows + 1, B): moe_decode's router programs for
   row r, the router logits and the shared expert's gate logit (logits (B, E + 1); the
   0.5 MB router comes from HBM once, then from L2);
2. ``_rows_route_kernel``: program 0 takes every row's top-k and writes the slot plan: the
   U distinct experts in increasing order (slots 0..U-1; slots past U name slot U-1's
   expert again, an L2 hit, with nothing to multiply), U, and each slot's routing weight
   for every row (0 where the row did not choose it); programs 1.. make the shared
   expert's ``sigmoid(gate logit) * silu(gate) * up`` for every row (it needs no routing);
3. ``_rows_gate_up_kernel``, grid (S x I blocks), S = min(E, B * k) slots at most: a program
   past U exits; else its expert's gate and up rows times the rows that chose it (the
   others enter as zeros), ``w * silu(gate) * up`` per row into h (S, BR, I) bf16;
4. ``_rows_down_kernel``, grid (D blocks, chunks + 1): a program takes SC slots' experts as
   one K (moe_decode_mma's down with a chunk of slots in place of the k chosen experts),
   the last one the shared expert; each writes an fp32 partial (BR, BN), and the last
   program of a D block to finish (an atomic ticket, as qgemv's split-K) adds them in a
   fixed order with the residual and writes the rows once: deterministic.

Every program that reads x makes the rmsnorm of its rows itself (``norm_weight``: 2,048
values a row; rounded as the unfused ``rms_norm``), so the layer's post-attention norm
costs no launch; as in moe_decode the next layer's input norm rides in its projection's
GEMV. PDL as in moe_decode: constants (and x, see its note) before the wait, what an
earlier launch of this op wrote after it. Routing is NaN-proof (``topk_rows``): a NaN row
gets NaN outputs, the other rows keep theirs (an MMA column does not mix with another).

Takes bf16 activations and 4-bit experts on 16-byte rows (the model's case, ``rows_fit``):
a row's values enter the MMA as they are, and h (times the routing weight) is rounded to
bf16 on its way into the down MMA, as moe_prefill stores it. Other dtypes and layouts take
moe_prefill (lily/model/ops.py).
"""

from __future__ import annotations

from dataclasses import dataclass

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
from lily.ops.mma_rows import gate_up_rows, rows_dot, rows_operand, rows_x
from lily.ops.moe_checks import check_moe
from lily.ops.moe_decode_config import MoeDecodeConfig
from lily.ops.moe_decode_mma import mma_fits
from lily.ops.moe_decode_parts import topk_rows
from lily.ops.norm_rope import sigmoid
from lily.ops.qgemv import gemv_block, pdl_wait
from lily.ops.qgemv_mma import PAIR_MASK, mma_supports, mma_tile
from lily.ops.rmsnorm import cast_to, norm_meta, to_bf16
from lily.quant import QuantWeight

Tensor = torch.Tensor

MAX_ROWS = 16  # rows (MMA columns) one call takes
_COLUMNS_K = 64  # slots x columns of one down program: its h operand stays at 64 KiB (bf16)


# ---------------------------------------------------------------- the four launches


@launched
@triton.jit
def _rows_router_kernel(
    p_x, p_nw, p_logits, stride_xt, stride_lt,
    p_rw, p_rs, p_rb, stride_rqn, stride_rsn, p_cw, p_cs, p_cb,
    E, D, mask_lo_r, mask_lo_c, eps,
    R_PROGS: tl.constexpr, R_BN: tl.constexpr, R_BITS: tl.constexpr, R_GROUP: tl.constexpr,
    R_BG: tl.constexpr, C_BITS: tl.constexpr, C_GROUP: tl.constexpr, C_BG: tl.constexpr,
    HAS_NORM: tl.constexpr, NORM_BLOCK: tl.constexpr, NORM_STEPS: tl.constexpr,
    ON_CPU: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    # moe_decode's router and shared-gate programs, for row program_id(1).
    pid = tl.program_id(0)
    r = tl.program_id(1)
    p_xr = p_x + r * stride_xt
    p_lr = p_logits + r * stride_lt
    if pid < R_PROGS:
        o_r = pid * R_BN + tl.arange(0, R_BN)
        b_r = gemv_block(
            p_xr, 0, 1, D, p_nw, eps, p_rw, p_rs, p_rb, stride_rqn, stride_rsn, o_r, o_r < E,
            0, D // R_GROUP, mask_lo_r, R_BITS, R_GROUP, R_BG, 1, 1, HAS_NORM, True, NORM_BLOCK,
            NORM_STEPS, ON_CPU, PDL,
        )  # fmt: skip
        tl.store(p_lr + o_r[None, :], b_r, mask=(o_r < E)[None, :])
    else:
        o_c = tl.arange(0, 2)
        b_c = gemv_block(
            p_xr, 0, 1, D, p_nw, eps, p_cw, p_cs, p_cb, 0, 0, o_c, o_c < 1, 0, D // C_GROUP,
            mask_lo_c, C_BITS, C_GROUP, C_BG, 1, 1, HAS_NORM, True, NORM_BLOCK, NORM_STEPS,
            ON_CPU, PDL,
        )  # fmt: skip
        tl.store(p_lr + E + o_c[None, :], b_c, mask=(o_c < 1)[None, :])


@triton.jit
def _route(p_logits, p_slots, p_wslot, p_count, p_ticket, B, E, N_PAD, N_TICKETS, stride_lt,
           TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
           BR: tl.constexpr, BS: tl.constexpr, TICKETS: tl.constexpr):  # fmt: skip
    """The slot plan from the rows' logits (see the module docstring, launch 2)."""
    o_r = tl.arange(0, BR)
    o_e = tl.arange(0, BLOCK_E)
    o_k = tl.arange(0, BLOCK_K)
    o_s = tl.arange(0, BS)
    b_l = tl.load(p_logits + o_r[:, None] * stride_lt + o_e[None, :],
                  mask=(o_r < B)[:, None] & (o_e < E)[None, :], other=0.0)  # fmt: skip
    ids, wts = topk_rows(b_l, E, TOP_K, BLOCK_K)  # (BR, BLOCK_K)
    # The experts any row chose (a row at a time: (k, E) compares, not (B, k, E); a loop,
    # not unrolled: 16 unrolled rows took 140 CPU-s to compile for sm_90).
    chosen = tl.zeros((BLOCK_E,), tl.int32)
    for r in range(BR):
        ids_r = tl.sum(tl.where(o_r[:, None] == r, ids, 0), axis=0)
        hit = (ids_r[:, None] == o_e[None, :]) & ((o_k < TOP_K) & (r < B))[:, None]
        chosen = chosen | tl.max(hit.to(tl.int32), axis=0)
    rank = tl.cumsum(chosen, axis=0) - chosen  # a chosen expert's slot: experts in order
    u = tl.sum(chosen, axis=0)
    last = tl.max(tl.where(chosen > 0, o_e, 0), axis=0)  # slot u - 1's expert
    tl.store(p_slots + rank, o_e, mask=chosen > 0)
    tl.store(p_slots + o_s, tl.zeros((BS,), tl.int32) + last, mask=(o_s >= u) & (o_s < N_PAD))
    tl.store(p_count, u)
    # Each row's routing weight of each slot (0: not chosen; a row's k experts are distinct).
    for r in range(BR):
        sel = o_r[:, None] == r
        ids_r = tl.sum(tl.where(sel, ids, 0), axis=0)
        wts_r = tl.sum(tl.where(sel, wts, 0.0), axis=0)
        slot_r = tl.gather(rank, ids_r, 0)
        hit = (slot_r[None, :] == o_s[:, None]) & ((o_k < TOP_K) & (r < B))[None, :]
        tl.store(p_wslot + o_s * BR + r, tl.sum(tl.where(hit, wts_r[None, :], 0.0), axis=1),
                 mask=o_s < N_PAD)  # fmt: skip
    o_t = tl.arange(0, TICKETS)
    tl.store(p_ticket + o_t, tl.zeros((TICKETS,), tl.int32), mask=o_t < N_TICKETS)


@launched
@triton.jit(do_not_specialize=["B", "N_PAD"])
def _rows_route_kernel(
    p_x, p_nw, p_logits, p_slots, p_wslot, p_count, p_ticket, p_hs,
    p_sgw, p_sgs, p_sgb, p_suw, p_sus, p_sub, stride_sqn, stride_ssn,
    B, E, I_S, N_PAD, N_TICKETS, stride_xt, stride_lt, stride_hs, pair_mask, eps,
    TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr, BR: tl.constexpr,
    BS: tl.constexpr, TICKETS: tl.constexpr, GROUP: tl.constexpr, NG: tl.constexpr,
    G: tl.constexpr, BLOCK_N: tl.constexpr, W: tl.constexpr, HAS_NORM: tl.constexpr,
    HAS_SHARED: tl.constexpr, EVEN_N: tl.constexpr, ON_CPU: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    if pid == 0:
        pdl_wait(PDL)
        _route(p_logits, p_slots, p_wslot, p_count, p_ticket, B, E, N_PAD, N_TICKETS,
               stride_lt, TOP_K, BLOCK_K, BLOCK_E, BR, BS, TICKETS)  # fmt: skip
    elif HAS_SHARED:
        # The shared expert for every row. x may be read before the wait (see the note in
        # moe_decode's gate/up kernel); the gate logits are launch 1's.
        row0 = (pid - 1) * BLOCK_N
        o_r = tl.arange(0, BR)
        b_x = rows_x(p_x, stride_xt, p_nw, eps, o_r < B, BR, NG, G, GROUP, HAS_NORM, ON_CPU)
        b_xb, b_xs = rows_operand(b_x, G, GROUP, W, ON_CPU)
        b_h = gate_up_rows(p_sgw, p_sgs, p_sgb, p_suw, p_sus, p_sub, b_xb, b_xs, row0, I_S,
                           stride_sqn, stride_ssn, pair_mask, GROUP, NG, G, BLOCK_N, W, EVEN_N,
                           ON_CPU)  # fmt: skip
        pdl_wait(PDL)
        b_c = tl.load(p_logits + o_r * stride_lt + E, mask=o_r < B, other=0.0)
        o_n = row0 + tl.arange(0, BLOCK_N)
        b_h = to_bf16(b_h * sigmoid(b_c)[None, :], ON_CPU)
        tl.store(p_hs + o_r[None, :] * stride_hs + o_n[:, None], b_h, mask=(o_n < I_S)[:, None])


@launched
@triton.jit(do_not_specialize=["B"])
def _rows_gate_up_kernel(
    p_x, p_nw, p_slots, p_wslot, p_count, p_h,
    p_gw, p_gs, p_gb, p_uw, p_us, p_ub, stride_we, stride_se, stride_qn, stride_sn,
    B, I_E, stride_xt, stride_hs, stride_hr, pair_mask, eps,
    BR: tl.constexpr, GROUP: tl.constexpr, NG: tl.constexpr, G: tl.constexpr,
    BLOCK_N: tl.constexpr, W: tl.constexpr, N_BLOCKS: tl.constexpr, HAS_NORM: tl.constexpr,
    EVEN_N: tl.constexpr, ON_CPU: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    slot = pid // N_BLOCKS
    row0 = (pid % N_BLOCKS) * BLOCK_N
    o_r = tl.arange(0, BR)
    pdl_wait(PDL)
    e64 = tl.load(p_slots + slot).to(tl.int64)
    b_wr = tl.load(p_wslot + slot * BR + o_r)
    if slot < tl.load(p_count):
        # NOTE: experts start on 16 bytes (mma_fits), so the words' vector loads stay.
        o_we = tl.multiple_of(e64 * stride_we, 4)
        o_se = e64 * stride_se
        # Rows that did not choose this expert enter as zeros (their h is 0: w = 0).
        b_x = rows_x(p_x, stride_xt, p_nw, eps, (b_wr != 0.0) & (o_r < B), BR, NG, G, GROUP,
                     HAS_NORM, ON_CPU)  # fmt: skip
        b_xb, b_xs = rows_operand(b_x, G, GROUP, W, ON_CPU)
        b_h = gate_up_rows(p_gw + o_we, p_gs + o_se, p_gb + o_se, p_uw + o_we, p_us + o_se,
                           p_ub + o_se, b_xb, b_xs, row0, I_E, stride_qn, stride_sn, pair_mask,
                           GROUP, NG, G, BLOCK_N, W, EVEN_N, ON_CPU)  # fmt: skip
        o_n = row0 + tl.arange(0, BLOCK_N)
        tl.store(p_h + slot * stride_hs + o_r[None, :] * stride_hr + o_n[:, None],
                 to_bf16(b_h * b_wr[None, :], ON_CPU), mask=(o_n < I_E)[:, None])  # fmt: skip


@triton.jit
def _down_shared(p_hs, p_sdw, p_sds, p_sdb, stride_sqn, stride_ssn, stride_hsr, p_pb, row0, D,
                 m_n, pair_mask, BR: tl.constexpr, GROUP: tl.constexpr, S_NG: tl.constexpr,
                 S_G: tl.constexpr, W: tl.constexpr, BLOCK_N: tl.constexpr,
                 EVEN_N: tl.constexpr, ON_CPU: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """The shared expert's partial: its rows are constants (loaded before the wait), its
    gated h launch 2's."""
    b_w, b_s, b_b = mma_tile(p_sdw, p_sds, p_sdb, p_sdw, row0, D, stride_sqn, stride_ssn, 0, 0,
                             GROUP, S_NG, S_G, BLOCK_N, W, 0, EVEN_N, S_NG == S_G)  # fmt: skip
    pdl_wait(PDL)
    o_r = tl.arange(0, BR)
    o_x = tl.arange(0, S_G * GROUP)
    b_hx = tl.load(p_hs + o_r[:, None] * stride_hsr + o_x[None, :],
                   mask=(o_x < S_NG * GROUP)[None, :], other=0.0)  # fmt: skip
    b_xb, b_xs = rows_operand(b_hx.to(tl.float32), S_G, GROUP, W, ON_CPU)
    acc = rows_dot(b_w, b_s, b_b, b_xb, b_xs, pair_mask, S_G, BLOCK_N, ON_CPU)
    tl.store(p_pb, acc, mask=m_n[:, None])


@triton.jit
def _down_routed(p_h, p_slots, p_count, p_dw, p_ds, p_db, stride_we, stride_se, stride_qn,
                 stride_sn, stride_hs, stride_hr, p_pb, sp, row0, D, m_n, pair_mask,
                 BR: tl.constexpr, SC: tl.constexpr, GROUP: tl.constexpr, SG: tl.constexpr,
                 G: tl.constexpr, W: tl.constexpr, BLOCK_N: tl.constexpr,
                 EVEN_N: tl.constexpr, ON_CPU: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """Chunk ``sp``'s partial: SC slots of routed experts as one K (slot j of the chunk is
    expert slots[s0 + j]; h already holds the routing weights); zeros past U."""
    NG: tl.constexpr = SC * SG
    pdl_wait(PDL)
    s0 = sp * SC
    u = tl.load(p_count)
    if s0 < u:
        b_w, b_s, b_b = mma_tile(p_dw, p_ds, p_db, p_slots + s0, row0, D, stride_qn, stride_sn,
                                 stride_we, stride_se, GROUP, NG, G, BLOCK_N, W, SG, EVEN_N,
                                 NG == G)  # fmt: skip
        o_r = tl.arange(0, BR)
        o_x = tl.arange(0, G * GROUP)
        slot = s0 + o_x // (SG * GROUP)
        m_x = (o_x < NG * GROUP) & (slot < u)  # (slots past U were never written)
        p_hx = p_h + slot.to(tl.int64)[None, :] * stride_hs + o_r[:, None] * stride_hr
        b_hx = tl.load(p_hx + (o_x % (SG * GROUP))[None, :], mask=m_x[None, :], other=0.0)
        b_xb, b_xs = rows_operand(b_hx.to(tl.float32), G, GROUP, W, ON_CPU)
        acc = rows_dot(b_w, b_s, b_b, b_xb, b_xs, pair_mask, G, BLOCK_N, ON_CPU)
        tl.store(p_pb, acc, mask=m_n[:, None])
    else:
        tl.store(p_pb, tl.zeros((BLOCK_N, BR), tl.float32), mask=m_n[:, None])


@launched
@triton.jit(do_not_specialize=["B", "N_SPLITS"])
def _rows_down_kernel(
    p_h, p_slots, p_count, p_hs, p_res, p_out, p_part, p_ticket,
    p_dw, p_ds, p_db, stride_we, stride_se, stride_qn, stride_sn,
    p_sdw, p_sds, p_sdb, stride_sqn, stride_ssn,
    B, D, N_SPLITS, stride_hs, stride_hr, stride_hsr, stride_rt, stride_ot, pair_mask,
    BR: tl.constexpr, SC: tl.constexpr, GROUP: tl.constexpr, SG: tl.constexpr,
    G: tl.constexpr, S_NG: tl.constexpr, S_G: tl.constexpr, W: tl.constexpr,
    BLOCK_N: tl.constexpr, MAX_SPLITS: tl.constexpr, HAS_SHARED: tl.constexpr,
    HAS_RES: tl.constexpr, EVEN_N: tl.constexpr, ON_CPU: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    i_n = tl.program_id(0)
    sp = tl.program_id(1)
    row0 = i_n * BLOCK_N
    o_n = row0 + tl.arange(0, BLOCK_N)
    m_n = o_n < D
    o_r = tl.arange(0, BR)
    p_pb = p_part + (sp * BR + o_r[None, :]) * D + o_n[:, None]  # this program's (BN, BR)
    if HAS_SHARED:
        if sp == N_SPLITS - 1:
            _down_shared(p_hs, p_sdw, p_sds, p_sdb, stride_sqn, stride_ssn, stride_hsr, p_pb,
                         row0, D, m_n, pair_mask, BR, GROUP, S_NG, S_G, W, BLOCK_N, EVEN_N,
                         ON_CPU, PDL)  # fmt: skip
        else:
            _down_routed(p_h, p_slots, p_count, p_dw, p_ds, p_db, stride_we, stride_se,
                         stride_qn, stride_sn, stride_hs, stride_hr, p_pb, sp, row0, D, m_n,
                         pair_mask, BR, SC, GROUP, SG, G, W, BLOCK_N, EVEN_N, ON_CPU,
                         PDL)  # fmt: skip
    else:
        _down_routed(p_h, p_slots, p_count, p_dw, p_ds, p_db, stride_we, stride_se, stride_qn,
                     stride_sn, stride_hs, stride_hr, p_pb, sp, row0, D, m_n, pair_mask, BR,
                     SC, GROUP, SG, G, W, BLOCK_N, EVEN_N, ON_CPU, PDL)  # fmt: skip
    # The last program of this D block adds the partials in split order, and the residual.
    # NOTE: the ticket is one thread's atomic: its release covers only that thread's
    # stores, so every thread's partials must be issued first (as in qgemv).
    tl.debug_barrier()
    ticket = tl.atomic_add(p_ticket + i_n, 1, sem="acq_rel")
    if ticket == N_SPLITS - 1:
        m_o = m_n[:, None] & (o_r < B)[None, :]
        acc = tl.zeros((BLOCK_N, BR), tl.float32)
        for s in tl.static_range(MAX_SPLITS):
            if s < N_SPLITS:
                # .cg: past L1, the partials were written by other SMs
                acc += tl.load(p_part + (s * BR + o_r[None, :]) * D + o_n[:, None], mask=m_o,
                               other=0.0, cache_modifier=".cg")  # fmt: skip
        if HAS_RES:
            acc += tl.load(p_res + o_r[None, :] * stride_rt + o_n[:, None], mask=m_o,
                           other=0.0).to(tl.float32)  # fmt: skip
        p_o = p_out + o_r[None, :] * stride_ot + o_n[:, None]
        tl.store(p_o, cast_to(acc, p_out.dtype.element_ty, ON_CPU), mask=m_o)


# ---------------------------------------------------------------- host side


@dataclass(frozen=True)
class RowsPlan:
    """A call's sizes, fixed by B and the shapes (pure Python): BR columns (rows padded to
    8 or 16), S slots at most, SC slots a down program, chunks of them, the slot list
    padded to whole chunks, and the constexpr bounds of the route and the combine."""

    rows: int
    columns: int
    slots: int
    chunk: int
    chunks: int
    padded: int
    max_padded: int
    max_chunks: int

    @classmethod
    def new(cls, b: int, e: int, top_k: int) -> RowsPlan:
        """The plan of ``b`` rows over ``e`` experts, top ``top_k``."""
        br = max(8, pow2(b))
        sc = _COLUMNS_K // br
        s = min(e, b * top_k)
        most = min(e, br * top_k)  # any b with this br
        return cls(b, br, s, sc, cdiv(s, sc), cdiv(s, sc) * sc, cdiv(most, sc) * sc,
                   cdiv(most, sc))  # fmt: skip


def rows_fit(x: Tensor, gate: QuantWeight, up: QuantWeight, down: QuantWeight,
             shared: tuple[QuantWeight | None, ...]) -> bool:  # fmt: skip
    """Whether ``moe_decode_rows`` takes these rows and experts: bf16 x (B, D) of 2 to
    MAX_ROWS rows, experts 4-bit on 16-byte rows (``mma_fits``), and the shared expert's
    gate/up/down (or None) likewise."""
    return (x.dtype == torch.bfloat16 and x.dim() == 2 and 2 <= x.shape[0] <= MAX_ROWS
            and all(isinstance(w, QuantWeight) and mma_fits(w) for w in (gate, up, down))
            and all(w is None or (isinstance(w, QuantWeight) and mma_supports(w))
                    for w in shared))  # fmt: skip


def moe_decode_rows(
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
) -> Tensor:
    """``residual + moe(x')`` for one token of each of B sequences: x (B, D) -> (B, D) in
    x's dtype, four launches, no host sync.

    As ``moe_decode`` row by row: ``x' = rmsnorm(x) * norm_weight`` when ``norm_weight``
    (D,) is given, else x; ``residual`` (B, D) is added as given (the un-normed x for a
    decoder layer); weights as there. x must be bf16 with 1 to MAX_ROWS rows, the experts
    (and the shared expert's gate/up/down) 4-bit on 16-byte rows (``rows_fit``; else use
    moe_prefill). ``config``: MoeDecodeConfig's router_rows and num_warps (launch 1),
    mma_rows and mma_warps (the tensor-core tiles). ``pdl``: programmatic dependent launch
    (Hopper and newer; ignored elsewhere).
    """
    name = "moe_decode_rows"
    w = (router, gate, up, down, shared_gate, shared_up, shared_down, shared_expert_gate)
    what = f"(B, D) with 1 <= B <= {MAX_ROWS}"
    e, i, d, i_s, norm_weight = check_moe(name, x, w, top_k, residual, norm_weight, 2, what)
    if not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"{name}: x must be {what}, got {tuple(x.shape)}")
    if x.dtype != torch.bfloat16:
        raise TypeError(f"{name}: x must be bf16 (got {x.dtype}; other dtypes: moe_prefill)")
    if not all(mma_fits(w) for w in (gate, up, down)):
        raise ValueError(f"{name}: the experts must be 4-bit on 16-byte rows (else: moe_prefill)")
    if i_s and not all(mma_supports(w) for w in (shared_gate, shared_up, shared_down)):
        raise ValueError(f"{name}: the shared expert must be 4-bit on 16-byte rows")
    b = x.shape[0]
    x = x.contiguous()
    residual = residual.contiguous() if residual is not None else None
    cfg = config or MoeDecodeConfig()
    dev = x.device
    on_cpu = dev.type == "cpu"
    has_shared = i_s > 0
    has_norm = norm_weight is not None
    nw = norm_weight if has_norm else x
    pdl = use_pdl(pdl, dev)
    plan = RowsPlan.new(b, e, top_k)
    br = plan.columns
    gs = gate.group_size
    bn = cfg.mma_rows
    sg, su, sd = (shared_gate, shared_up, shared_down) if has_shared else (gate[0], up[0], down[0])
    seg = shared_expert_gate if has_shared else router

    # 1. router and shared-gate logits of every row.
    logits = torch.empty((b, e + 1), dtype=torch.float32, device=dev)
    norm_block, norm_steps = norm_meta(d)
    r_progs = cdiv(e, cfg.router_rows)
    _rows_router_kernel[(r_progs + int(has_shared), b)](
        x, nw, logits, x.stride(0), logits.stride(0),
        router.qweight, router.scales, router.biases, router.qweight.stride(0),
        router.scales.stride(0), seg.qweight, seg.scales, seg.biases,
        e, d, mask_lo(router.bits), mask_lo(seg.bits), float(eps),
        R_PROGS=r_progs, R_BN=cfg.router_rows, R_BITS=router.bits, R_GROUP=router.group_size,
        R_BG=pow2(d // router.group_size), C_BITS=seg.bits, C_GROUP=seg.group_size,
        C_BG=pow2(d // seg.group_size), HAS_NORM=has_norm, NORM_BLOCK=norm_block,
        NORM_STEPS=norm_steps, ON_CPU=on_cpu, PDL=pdl, num_warps=cfg.num_warps,
        **pdl_launch(pdl),
    )  # fmt: skip

    # 2. the slot plan; the shared expert's gated h for every row.
    ng = d // gs
    g = pow2(ng)
    w = min(cfg.mma_warps, g)
    nb_d = cdiv(d, bn)
    slots = torch.empty(plan.padded, dtype=torch.int32, device=dev)
    wslot = torch.empty((plan.padded, br), dtype=torch.float32, device=dev)
    count = torch.empty(1, dtype=torch.int32, device=dev)
    ticket = torch.empty(nb_d, dtype=torch.int32, device=dev)
    hs = torch.empty((br, max(i_s, 1)), dtype=torch.bfloat16, device=dev)
    _rows_route_kernel[(1 + (cdiv(i_s, bn) if has_shared else 0),)](
        x, nw, logits, slots, wslot, count, ticket, hs,
        sg.qweight, sg.scales, sg.biases, su.qweight, su.scales, su.biases,
        sg.qweight.stride(0), sg.scales.stride(0),
        b, e, i_s, plan.padded, nb_d, x.stride(0), logits.stride(0), hs.stride(0), PAIR_MASK,
        float(eps),
        TOP_K=top_k, BLOCK_K=pow2(top_k), BLOCK_E=pow2(e), BR=br, BS=pow2(plan.max_padded),
        TICKETS=pow2(nb_d), GROUP=gs, NG=ng, G=g, BLOCK_N=bn, W=w, HAS_NORM=has_norm,
        HAS_SHARED=has_shared, EVEN_N=i_s % bn == 0, ON_CPU=on_cpu, PDL=pdl, num_warps=w,
        **pdl_launch(pdl),
    )  # fmt: skip

    # 3. each chosen expert's gate/up for the rows that chose it.
    nb = cdiv(i, bn)
    h = torch.empty((plan.slots, br, i), dtype=torch.bfloat16, device=dev)
    _rows_gate_up_kernel[(plan.slots * nb,)](
        x, nw, slots, wslot, count, h,
        gate.qweight, gate.scales, gate.biases, up.qweight, up.scales, up.biases,
        gate.qweight.stride(0), gate.scales.stride(0), gate.qweight.stride(1),
        gate.scales.stride(1),
        b, i, x.stride(0), h.stride(0), h.stride(1), PAIR_MASK, float(eps),
        BR=br, GROUP=gs, NG=ng, G=g, BLOCK_N=bn, W=w, N_BLOCKS=nb, HAS_NORM=has_norm,
        EVEN_N=i % bn == 0, ON_CPU=on_cpu, PDL=pdl, num_warps=w, **pdl_launch(pdl),
    )  # fmt: skip

    # 4. down over chunks of slots and the shared expert, partials added by the last.
    sgr = i // gs  # groups a slot
    g = pow2(plan.chunk * sgr)
    s_ng = max(i_s, gs) // gs
    s_g = pow2(s_ng)
    w = min(cfg.mma_warps, g, s_g if has_shared else g)
    splits = plan.chunks + int(has_shared)
    part = torch.empty((splits, br, d), dtype=torch.float32, device=dev)
    out = torch.empty((b, d), dtype=x.dtype, device=dev)
    res = residual if residual is not None else out
    _rows_down_kernel[(nb_d, splits)](
        h, slots, count, hs, res, out, part, ticket,
        down.qweight, down.scales, down.biases, down.qweight.stride(0), down.scales.stride(0),
        down.qweight.stride(1), down.scales.stride(1),
        sd.qweight, sd.scales, sd.biases, sd.qweight.stride(0), sd.scales.stride(0),
        b, d, splits, h.stride(0), h.stride(1), hs.stride(0), res.stride(0), out.stride(0),
        PAIR_MASK,
        BR=br, SC=plan.chunk, GROUP=gs, SG=sgr, G=g, S_NG=s_ng, S_G=s_g, W=w, BLOCK_N=bn,
        MAX_SPLITS=plan.max_chunks + int(has_shared), HAS_SHARED=has_shared,
        HAS_RES=residual is not None, EVEN_N=d % bn == 0, ON_CPU=on_cpu, PDL=pdl,
        num_warps=w, **pdl_launch(pdl),
    )  # fmt: skip
    return out
