"""MoE block for T prefill tokens: routing and grouped GEMMs on the GPU, no host sync.

Launches, all sized from T alone (the worst case), so nothing waits on the host:

1. router logits: ``qgemm`` with the weight split into two bf16 terms (fp32-grade logits,
   so the top-k does not flip on rounding);
2. ``_moe_route_kernel``: softmax in fp32, top-k, renormalise, the shared expert's sigmoid
   gate, and the histogram: an atomic add per (token, slot) gives its rank inside the
   expert (the position inside a group changes no row's result, so output stays
   deterministic);
3. ``_moe_plan_kernel``: prefix sums into group offsets and tile offsets (recomputed by
   every program, E is small), the scatter of (token, slot) pairs into expert order, and
   the block map: (expert, first row, rows) per BLOCK_M-row tile; the shared expert is
   expert E with all T rows. Grid and map hold ``cdiv(T*k, BM) + E + cdiv(T, BM)`` tiles,
   the most there can be; tiles past the real count are marked -1 and exit at once;
4. ``_moe_gate_up_kernel``: grouped GEMM over the map, both projections with dequant fused,
   ``silu(gate) * up`` in the epilogue, h (rows, I) bf16 in expert order;
5. ``_moe_down_kernel``: grouped GEMM, times the routing weight in the epilogue, each row
   written to its (token, slot) place: y (T, k+1, D) bf16;
6. ``_moe_combine_kernel``: ``residual + sum over slots`` in fp32, in slot order.

The token tile BLOCK_M is picked from the mean rows per expert, T*k/E, known on the host.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from lily.ops.arch import DEFAULT, Arch, current_arch
from lily.ops.launch import cdiv, launched, mask_lo, pow2
from lily.ops.moe_checks import check_moe
from lily.ops.moe_decode_parts import topk_rows
from lily.ops.moe_prefill_cols import (
    cols_supported,
    down_weights,
    gate_up_weights,
    moe_gemms_cols,
    tile_rows,
)
from lily.ops.qgemm import (
    GemmConfig,
    block_m_for,
    launch_qgemm,
    load_dequant,
    mma,
)
from lily.ops.rmsnorm import cast_to, rms_row, to_bf16
from lily.quant import QuantWeight

Tensor = torch.Tensor


@launched
@triton.jit
def _moe_route_kernel(
    p_logits, p_x, p_sgw, p_sgs, p_sgb, p_ids, p_wts, p_counts, p_rank,
    T, E, D, stride_lt, stride_xt, mask_lo_sg,
    TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
    HAS_SHARED: tl.constexpr, SG_BITS: tl.constexpr, SG_GROUP: tl.constexpr,
    SG_BLOCK_K: tl.constexpr, SG_STEPS: tl.constexpr,
):  # fmt: skip
    i_t = tl.program_id(0)
    o_t = i_t * BLOCK_T + tl.arange(0, BLOCK_T)
    m_t = o_t < T
    o_e = tl.arange(0, BLOCK_E)
    o_k = tl.arange(0, BLOCK_K)
    m_tk = m_t[:, None] & (o_k < TOP_K)[None, :]
    p_l = p_logits + o_t[:, None] * stride_lt + o_e[None, :]
    b_l = tl.load(p_l, mask=m_t[:, None] & (o_e < E)[None, :], other=0.0)
    # NOTE: top-k on integer keys: any logit, NaN or inf included, yields k distinct experts
    # in 0..E-1 (a NaN token gets NaN weights, never an out-of-range id; see topk_rows).
    ids, wts = topk_rows(b_l, E, TOP_K, BLOCK_K)
    p_tk = o_t[:, None] * TOP_K + o_k[None, :]
    tl.store(p_ids + p_tk, ids, mask=m_tk)
    # Slot k of the weights holds the shared expert's gate.
    tl.store(p_wts + o_t[:, None] * (TOP_K + 1) + o_k[None, :], wts, mask=m_tk)
    rank = tl.atomic_add(p_counts + ids, 1, mask=m_tk, sem="relaxed")
    tl.store(p_rank + p_tk, rank, mask=m_tk)
    if HAS_SHARED:
        # sigmoid(x . shared_expert_gate) per token, the gate row dequantized in fp32.
        o_n = tl.arange(0, 2)
        o_c = tl.arange(0, SG_BLOCK_K)
        b_g = tl.zeros((BLOCK_T,), tl.float32)
        for i_k in range(SG_STEPS):
            SG_BG: tl.constexpr = SG_BLOCK_K // SG_GROUP
            b_w = load_dequant(p_sgw, p_sgs, p_sgb, 0, 0, o_n, o_n < 1, i_k * SG_BG,
                               D // SG_GROUP, mask_lo_sg, SG_BITS, SG_GROUP, SG_BG)  # fmt: skip
            o_d = i_k * SG_BLOCK_K + o_c
            p_xb = p_x + o_t[:, None] * stride_xt + o_d[None, :]
            b_x = tl.load(p_xb, mask=m_t[:, None] & (o_d < D)[None, :], other=0.0)
            b_g += tl.sum(b_x.to(tl.float32) * tl.sum(b_w, axis=0)[None, :], axis=1)
        tl.store(p_wts + o_t * (TOP_K + 1) + TOP_K, 1.0 / (1.0 + tl.exp(-b_g)), mask=m_t)


@launched
@triton.jit
def _moe_plan_kernel(
    p_counts, p_ids, p_rank, p_pairs, p_tile_e, p_tile_row, p_tile_n, T, E, max_tiles,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_B: tl.constexpr,
    BLOCK_R: tl.constexpr, HAS_SHARED: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    o_e = tl.arange(0, BLOCK_E)
    cnt = tl.load(p_counts + o_e, mask=o_e < E, other=0)
    n_groups = E
    if HAS_SHARED:
        cnt = tl.where(o_e == E, T, cnt)
        n_groups = E + 1
    start = tl.cumsum(cnt, axis=0) - cnt
    tiles = (cnt + BLOCK_M - 1) // BLOCK_M
    tile_end = tl.cumsum(tiles, axis=0)
    tile_start = tile_end - tiles

    # Block map: tile b belongs to the group whose tile range holds it.
    o_b = pid * BLOCK_B + tl.arange(0, BLOCK_B)
    g_b = tl.sum((tile_end[None, :] <= o_b[:, None]).to(tl.int32), axis=1)
    valid = g_b < n_groups
    g_c = tl.minimum(g_b, BLOCK_E - 1)
    j = o_b - tl.gather(tile_start, g_c, 0)
    row0 = tl.gather(start, g_c, 0) + j * BLOCK_M
    rows = tl.minimum(tl.gather(cnt, g_c, 0) - j * BLOCK_M, BLOCK_M)
    m_b = o_b < max_tiles
    tl.store(p_tile_e + o_b, tl.where(valid, g_b, -1), mask=m_b)
    tl.store(p_tile_row + o_b, tl.where(valid, row0, 0), mask=m_b)
    tl.store(p_tile_n + o_b, tl.where(valid, rows, 0), mask=m_b)

    # Scatter: (token, slot) pair -> its row in expert order.
    o_r = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    m_r = o_r < T * TOP_K
    e_r = tl.load(p_ids + o_r, mask=m_r, other=0)
    pos = tl.gather(start, e_r, 0) + tl.load(p_rank + o_r, mask=m_r, other=0)
    pair = (o_r // TOP_K) * (TOP_K + 1) + o_r % TOP_K
    tl.store(p_pairs + pos, pair, mask=m_r)
    if HAS_SHARED:
        m_s = o_r < T
        tl.store(p_pairs + T * TOP_K + o_r, o_r * (TOP_K + 1) + TOP_K, mask=m_s)


@launched
@triton.jit
def _moe_gate_up_kernel(
    p_x, p_pairs, p_tile_e, p_tile_row, p_tile_n, p_h,
    p_gw, p_gs, p_gb, p_uw, p_us, p_ub, stride_we, stride_se, stride_qn, stride_sn,
    p_sgw, p_sgs, p_sgb, p_suw, p_sus, p_sub, stride_sqn, stride_ssn,
    E, I_E, I_S, D, stride_xt, stride_h, mask_lo,
    TOP_K: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_STEPS: tl.constexpr,
    N_BLOCKS: tl.constexpr, ON_CPU: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    b = pid // N_BLOCKS
    i_n = pid % N_BLOCKS
    e, row0, m_m, pairs = tile_rows(p_tile_e, p_tile_row, p_tile_n, p_pairs, b, BLOCK_M)
    is_shared = e == E
    n_rows = tl.where(is_shared, I_S, I_E)
    if (e >= 0) & (i_n * BLOCK_N < n_rows):
        if is_shared:
            gw, gs, gb, uw, us, ub = p_sgw, p_sgs, p_sgb, p_suw, p_sus, p_sub
            sqn = stride_sqn
            ssn = stride_ssn
        else:
            e64 = e.to(tl.int64)
            gw = p_gw + e64 * stride_we
            gs = p_gs + e64 * stride_se
            gb = p_gb + e64 * stride_se
            uw = p_uw + e64 * stride_we
            us = p_us + e64 * stride_se
            ub = p_ub + e64 * stride_se
            sqn = stride_qn
            ssn = stride_sn
        BG: tl.constexpr = BLOCK_K // GROUP
        o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_n = o_n < n_rows
        o_k = tl.arange(0, BLOCK_K)
        tok = (pairs // (TOP_K + 1)).to(tl.int64)
        acc_g = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
        acc_u = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
        for i_k in range(K_STEPS):
            g0 = i_k * BG
            b_g = load_dequant(gw, gs, gb, sqn, ssn, o_n, m_n, g0, D // GROUP, mask_lo,
                               BITS, GROUP, BG)  # fmt: skip
            b_u = load_dequant(uw, us, ub, sqn, ssn, o_n, m_n, g0, D // GROUP, mask_lo,
                               BITS, GROUP, BG)  # fmt: skip
            k0 = i_k * BLOCK_K
            p_xt = p_x + tok[None, :] * stride_xt + (k0 + o_k)[:, None]
            b_xt = tl.load(p_xt, mask=m_m[None, :] & ((k0 + o_k) < D)[:, None], other=0.0)
            b_xt = to_bf16(b_xt, ON_CPU)
            acc_g = mma(to_bf16(b_g, ON_CPU), b_xt, acc_g, ON_CPU)
            acc_u = mma(to_bf16(b_u, ON_CPU), b_xt, acc_u, ON_CPU)
        b_h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
        p_hb = p_h + (row0 + tl.arange(0, BLOCK_M)).to(tl.int64)[None, :] * stride_h + o_n[:, None]
        b_h = cast_to(b_h, p_h.dtype.element_ty, ON_CPU)
        tl.store(p_hb, b_h, mask=m_n[:, None] & m_m[None, :])


@launched
@triton.jit
def _moe_down_kernel(
    p_h, p_pairs, p_tile_e, p_tile_row, p_tile_n, p_wts, p_y,
    p_dw, p_ds, p_db, stride_we, stride_se, stride_qn, stride_sn,
    p_sdw, p_sds, p_sdb, stride_sqn, stride_ssn,
    E, D, I_E, I_S, stride_h, stride_y, mask_lo,
    TOP_K: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_STEPS: tl.constexpr,
    N_BLOCKS: tl.constexpr, ATOMIC: tl.constexpr, ON_CPU: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    b = pid // N_BLOCKS
    i_n = pid % N_BLOCKS
    e, row0, m_m, pairs = tile_rows(p_tile_e, p_tile_row, p_tile_n, p_pairs, b, BLOCK_M)
    if e >= 0:
        is_shared = e == E
        if is_shared:
            dw, ds, db = p_sdw, p_sds, p_sdb
            sqn = stride_sqn
            ssn = stride_ssn
            k_len = I_S
        else:
            e64 = e.to(tl.int64)
            dw = p_dw + e64 * stride_we
            ds = p_ds + e64 * stride_se
            db = p_db + e64 * stride_se
            sqn = stride_qn
            ssn = stride_sn
            k_len = I_E
        BG: tl.constexpr = BLOCK_K // GROUP
        o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_n = o_n < D
        o_k = tl.arange(0, BLOCK_K)
        o_rows = (row0 + tl.arange(0, BLOCK_M)).to(tl.int64)
        acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
        for i_k in range(K_STEPS):
            b_w = load_dequant(dw, ds, db, sqn, ssn, o_n, m_n, i_k * BG, k_len // GROUP,
                               mask_lo, BITS, GROUP, BG)  # fmt: skip
            k0 = i_k * BLOCK_K
            p_ht = p_h + o_rows[None, :] * stride_h + (k0 + o_k)[:, None]
            b_ht = tl.load(p_ht, mask=m_m[None, :] & ((k0 + o_k) < k_len)[:, None], other=0.0)
            acc = mma(to_bf16(b_w, ON_CPU), to_bf16(b_ht, ON_CPU), acc, ON_CPU)
        b_r = tl.load(p_wts + pairs, mask=m_m, other=0.0)
        acc = acc * b_r[None, :]
        m_out = m_n[:, None] & m_m[None, :]
        if ATOMIC:
            tok = (pairs // (TOP_K + 1)).to(tl.int64)
            p_o = p_y + tok[None, :] * stride_y + o_n[:, None]
            tl.atomic_add(p_o, acc, mask=m_out, sem="relaxed")
        else:
            p_o = p_y + pairs.to(tl.int64)[None, :] * stride_y + o_n[:, None]
            tl.store(p_o, cast_to(acc, p_y.dtype.element_ty, ON_CPU), mask=m_out)


@launched
@triton.jit
def _moe_combine_kernel(
    p_y, p_res, p_out, p_nw, p_h, T, D, stride_y, stride_rt, stride_ot, stride_h, eps,
    N_SLOTS: tl.constexpr, PAIR_STRIDE: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_RES: tl.constexpr, NORM: tl.constexpr, ON_CPU: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    o_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    m_d = o_d < D
    acc = tl.zeros((BLOCK_D,), tl.float32)
    if HAS_RES:
        acc += tl.load(p_res + t * stride_rt + o_d, mask=m_d, other=0.0).to(tl.float32)
    for s in tl.static_range(N_SLOTS):
        p_ys = p_y + (t * PAIR_STRIDE + s).to(tl.int64) * stride_y + o_d
        acc += tl.load(p_ys, mask=m_d, other=0.0).to(tl.float32)
    b_x = cast_to(acc, p_out.dtype.element_ty, ON_CPU)
    tl.store(p_out + t * stride_ot + o_d, b_x, mask=m_d)
    if NORM:  # the next layer's input norm of the rounded row (one program holds all of it)
        b_w = tl.load(p_nw + o_d, mask=m_d, other=0.0).to(tl.float32)
        b_h = cast_to(rms_row(b_x.to(tl.float32), b_w, D, eps), p_h.dtype.element_ty, ON_CPU)
        tl.store(p_h + t * stride_h + o_d, b_h, mask=m_d)


@dataclass(frozen=True)
class MoePrefillConfig:
    """Token tile of the block map and the tiles of the two grouped GEMMs (their block_m
    is ignored: every GEMM tile is ``block_m`` rows of one expert)."""

    block_m: int
    gate_up: GemmConfig
    down: GemmConfig


@functools.lru_cache(maxsize=1024)  # tiles are pure functions of the shape
def moe_prefill_config(
    t: int, top_k: int, n_experts: int, arch: Arch = DEFAULT
) -> MoePrefillConfig:
    """Tiles from the mean rows per expert, measured on the H200 at the real shapes
    (lily/bench/gpu/kernels/tile_sweep.py, bench/results/tile_sweep_h200_run1.json): the
    gate/up tile of 64 x 64 (4 warps, 4 stages) at 52 rows per expert took 561 us a layer
    against 619 for 128 x 64 with 8 warps; 128 x 128 x 128 at 128 rows took 1,147 us against
    1,609. From 24 rows per expert the 64-row tile beats the 32-row one, which dequantizes
    most experts' weights twice: 0.50-0.53 ms a layer against 0.72-0.84 at T = 768-1,400
    (lily/bench/gpu/kernels/moe_tile.py, bench/results/moe_tile_h200.json)."""
    rows = t * top_k / n_experts
    bm = 64 if 24 <= rows <= 96 else block_m_for(rows)
    if bm <= 32:
        return MoePrefillConfig(bm, GemmConfig(bm, 64, 128, 4, 4), GemmConfig(bm, 64, 128, 4, 4))
    if bm == 64:
        return MoePrefillConfig(bm, GemmConfig(bm, 64, 64, 4, 4), GemmConfig(bm, 128, 64, 8, 3))
    if not arch.wgmma:
        # Without warpgroup MMA the gate/up tile's two 128 x 128 fp32 accumulators spill
        # (about 2 KB a thread, sm_80 to sm_120) and it takes 128 KiB of shared memory: half
        # the rows and half the K step fit in 48 KiB with no spills (compile matrix).
        return MoePrefillConfig(bm, GemmConfig(bm, 64, 64, 8, 3), GemmConfig(bm, 128, 64, 8, 3))
    return MoePrefillConfig(bm, GemmConfig(bm, 128, 128, 8, 3), GemmConfig(bm, 128, 64, 8, 3))


@functools.lru_cache(maxsize=1024)  # tiles are pure functions of the shape
def router_gemm_config(t: int, group_size: int, arch: Arch = DEFAULT) -> GemmConfig:
    """Tile of the router GEMM (E = 256 rows): 64 rows and at most 64 tokens a program, so
    short prompts still spread over 32-64 programs (the dense table's 128 x 128 tile gave 4
    programs at T = 256, each dequantizing half the router twice on one SM)."""
    return GemmConfig(min(64, block_m_for(t)), 64, max(64, group_size), num_warps=4, num_stages=3)


# moe_prefill_cols' GEMMs where the token tile is at most this many rows (0: never; 16:
# chunks under 768 tokens, the table's 16-row tile). Off until measured on a GPU
# (docs/notes/linear_kernels.md, "Fifteenth session"); its tile spills at 64 rows.
COLS_MAX_BLOCK_M = 0

# tokens per routing program: 8 against 16 took moe_prefill from 516.8 to 506.3 us a layer at
# 1,128 tokens, 557 to 541 at 512, 723 to 717 at 2,048 (bench/results/route_tile_h200.json)
ROUTE_BLOCK_T = 8
_BLOCK_B = 32  # block-map tiles per planning program
_BLOCK_R = 256  # (token, slot) pairs per planning program


def moe_prefill(
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
    atomic: bool = False,
    config: MoePrefillConfig | None = None,
    norm_weight: Tensor | None = None,
    eps: float = 1e-6,
) -> Tensor | tuple[Tensor, Tensor]:
    """``residual + moe(x)`` for x (T, D) -> (T, D) in x's dtype, no host sync inside.

    Weights as in ``moe_decode``. ``atomic``: the down projection adds its rows into an
    fp32 (T, D) buffer with atomics instead of writing y (T, k+1, D) for a sum pass; less
    traffic, but the order of the fp32 adds (and so the last bits) varies run to run.
    With ``norm_weight`` (D,) returns ``(out, rmsnorm(out, norm_weight, eps))``: the next
    layer's input norm rides in the last launch (one launch a layer less; each cost the
    host of a reused turn 40-90 us).
    """
    name = "moe_prefill"
    w = (router, gate, up, down, shared_gate, shared_up, shared_down, shared_expert_gate)
    e, i, d, i_s, norm_weight = check_moe(name, x, w, top_k, residual, norm_weight, 2, "(T, D)")
    t = x.shape[0]
    if t == 0:
        out = torch.empty_like(x)
        return out if norm_weight is None else (out, torch.empty_like(x))
    x = x.contiguous()
    residual = residual.contiguous() if residual is not None else None
    arch = current_arch(x.device)
    cfg = config or moe_prefill_config(t, top_k, e, arch)
    bm = cfg.block_m
    for c in (cfg.gate_up, cfg.down):
        if c.block_k % gate.group_size:
            raise ValueError(f"{name}: block_k {c.block_k} is not a multiple of the group size")
    dev = x.device
    on_cpu = dev.type == "cpu"
    has_shared = i_s > 0
    seg = shared_expert_gate if has_shared else router
    ks = top_k + 1  # pair stride: slot k is the shared expert

    # 1-2. router logits, top-k, weights, ranks inside each expert.
    logits = torch.empty((t, e), dtype=torch.float32, device=dev)
    launch_qgemm(x, router, logits, router_gemm_config(t, router.group_size, arch), split_w=True)
    ids = torch.empty((t, top_k), dtype=torch.int32, device=dev)
    rank = torch.empty((t, top_k), dtype=torch.int32, device=dev)
    wts = torch.empty((t, ks), dtype=torch.float32, device=dev)
    counts = torch.zeros(e, dtype=torch.int32, device=dev)
    sg_bk = max(256, seg.group_size)
    _moe_route_kernel[(cdiv(t, ROUTE_BLOCK_T),)](
        logits, x, seg.qweight, seg.scales, seg.biases, ids, wts, counts, rank,
        t, e, d, logits.stride(0), x.stride(0), mask_lo(seg.bits),
        TOP_K=top_k, BLOCK_K=pow2(top_k), BLOCK_T=ROUTE_BLOCK_T,
        BLOCK_E=pow2(e), HAS_SHARED=has_shared, SG_BITS=seg.bits,
        SG_GROUP=seg.group_size, SG_BLOCK_K=sg_bk, SG_STEPS=cdiv(d, sg_bk),
        num_warps=4,
    )  # fmt: skip

    # 3. offsets, scatter into expert order, block map (worst-case sized).
    rows_total = t * top_k + (t if has_shared else 0)
    max_tiles = cdiv(t * top_k, bm) + e + (cdiv(t, bm) if has_shared else 0)
    pairs = torch.empty(rows_total, dtype=torch.int32, device=dev)
    tile_e = torch.empty(max_tiles, dtype=torch.int32, device=dev)
    tile_row = torch.empty(max_tiles, dtype=torch.int32, device=dev)
    tile_n = torch.empty(max_tiles, dtype=torch.int32, device=dev)
    n_plan = max(cdiv(max_tiles, _BLOCK_B), cdiv(t * top_k, _BLOCK_R))
    _moe_plan_kernel[(n_plan,)](
        counts, ids, rank, pairs, tile_e, tile_row, tile_n, t, e, max_tiles,
        TOP_K=top_k, BLOCK_M=bm, BLOCK_E=pow2(e + 1), BLOCK_B=_BLOCK_B,
        BLOCK_R=_BLOCK_R, HAS_SHARED=has_shared, num_warps=4,
    )  # fmt: skip

    # 4. gate/up grouped GEMM with SiLU * up.
    i_max = max(i, i_s)
    h = torch.empty((rows_total, i_max), dtype=torch.bfloat16, device=dev)
    sg, su, sd = (shared_gate, shared_up, shared_down) if has_shared else (gate[0], up[0], down[0])
    experts = (gate, up, down, sg, su, sd)
    if not atomic and bm <= COLS_MAX_BLOCK_M and cols_supported(x, experts, i, i_s or i):
        # 4-5. both GEMMs with the tile's tokens as the MMA's columns (moe_prefill_cols.py)
        y = torch.empty((t * ks, d), dtype=torch.bfloat16, device=dev)
        moe_gemms_cols(x, pairs, tile_e, tile_row, tile_n, wts, h, y, gate, up, down, sg, su,
                       sd, e, i, d, top_k, bm)  # fmt: skip
        return _combine(y, residual, norm_weight, t, d, top_k, has_shared, False, eps, x.dtype)
    gu = cfg.gate_up
    nb = cdiv(i_max, gu.block_n)
    _moe_gate_up_kernel[(max_tiles * nb,)](
        x, pairs, tile_e, tile_row, tile_n, h, *gate_up_weights(gate, up, sg, su),
        e, i, i_s, d, x.stride(0), h.stride(0), mask_lo(gate.bits),
        TOP_K=top_k, BITS=gate.bits, GROUP=gate.group_size, BLOCK_M=bm, BLOCK_N=gu.block_n,
        BLOCK_K=gu.block_k, K_STEPS=cdiv(d, gu.block_k), N_BLOCKS=nb, ON_CPU=on_cpu,
        num_warps=gu.num_warps, num_stages=gu.num_stages,
    )  # fmt: skip

    # 5. down grouped GEMM, routing weight in the epilogue.
    dn = cfg.down
    nb = cdiv(d, dn.block_n)
    if atomic:
        y = residual.float() if residual is not None else torch.zeros(t, d, device=dev)
        y = y.contiguous()
    else:
        y = torch.empty((t * ks, d), dtype=torch.bfloat16, device=dev)
    _moe_down_kernel[(max_tiles * nb,)](
        h, pairs, tile_e, tile_row, tile_n, wts, y, *down_weights(down, sd),
        e, d, i, i_s, h.stride(0), y.stride(0), mask_lo(down.bits),
        TOP_K=top_k, BITS=down.bits, GROUP=down.group_size, BLOCK_M=bm, BLOCK_N=dn.block_n,
        BLOCK_K=dn.block_k, K_STEPS=cdiv(i_max, dn.block_k), N_BLOCKS=nb,
        ATOMIC=atomic, ON_CPU=on_cpu, num_warps=dn.num_warps, num_stages=dn.num_stages,
    )  # fmt: skip

    return _combine(y, residual, norm_weight, t, d, top_k, has_shared, atomic, eps, x.dtype)


def _combine(y: Tensor, residual: Tensor | None, norm_weight: Tensor | None, t: int, d: int,
             top_k: int, has_shared: bool, atomic: bool, eps: float,
             dtype: torch.dtype) -> Tensor | tuple[Tensor, Tensor]:  # fmt: skip
    """Launch 6: residual + sum over slots (or the fp32 buffer's rounding, with atomics),
    with the next layer's input norm when ``norm_weight`` is given."""
    dev, ks, on_cpu = y.device, top_k + 1, y.device.type == "cpu"
    out = torch.empty((t, d), dtype=dtype, device=dev)
    norm = norm_weight is not None
    h_next = torch.empty((t, d), dtype=dtype, device=dev) if norm else out
    block_d = pow2(d) if norm else min(1024, pow2(d))  # the norm needs whole rows
    if atomic:
        n_slots, stride, res = 1, 1, None
    else:
        n_slots, stride, res = top_k + int(has_shared), ks, residual
    _moe_combine_kernel[(t, cdiv(d, block_d))](
        y, res if res is not None else out, out, norm_weight if norm else out, h_next, t, d,
        y.stride(0), res.stride(0) if res is not None else 0, out.stride(0), h_next.stride(0),
        float(eps), N_SLOTS=n_slots, PAIR_STRIDE=stride, BLOCK_D=block_d,
        HAS_RES=res is not None, NORM=norm, ON_CPU=on_cpu,
        num_warps=4 if block_d <= 4096 else 8,
    )  # fmt: skip
    return (out, h_next) if norm else out
