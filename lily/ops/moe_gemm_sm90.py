"""The MoE prefill's grouped fused-dequant GEMMs for Hopper (sm_90): weights by TMA.

Same work, block map and results as ``_moe_gate_up_kernel`` / ``_moe_down_kernel`` in
lily/ops/moe_prefill.py (launches 4 and 5); what changes is how the operands arrive:

- the packed expert weights (the byte stream: 0.56 bytes a weight) come as (BLOCK_N,
  BLOCK_K/8) int32 tiles through tensor descriptors: the TMA engine copies them into
  shared memory ``num_stages`` steps ahead (an mbarrier pipeline the compiler builds), so
  no thread spends address arithmetic or registers on the stream, and each step's
  dequantization reads a tile already on chip;
- the down projection's activations h (rows in expert order, contiguous) come as (BLOCK_M,
  BLOCK_K) tiles by TMA too; gate/up's tokens are gathered (scattered rows: Hopper's TMA
  has no gather) by cp.async as before;
- scales and biases (2-4 bytes a row a step: below TMA's 16-byte box) stay pointer loads.

Dequantization and the tensor-core products are those of the portable kernels (``dequant_tile``
to bf16, ``out.T = w @ x.T`` with the weights on the MMA's M side), so the two paths give
the same result up to the MMA's summation order. NOTE (Triton 3.6): ``tl.range(...,
warp_specialize=True)`` compiles to the same code as without it on sm_90 (the automatic
partitioning is Blackwell-only there; checked on the PTX), so these kernels pipeline
without dedicated producer warps.

Host-side descriptors (``TensorDescriptor``, encoded at each launch): device-side ones need
a global scratch allocator per thread, which the server's worker thread would lack.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from lily.ops.launch import cdiv, launched, mask_lo
from lily.ops.moe_decode_parts import gate_up_step, tile_rows
from lily.ops.qgemm import GemmConfig, dequant_tile, mma
from lily.ops.rmsnorm import cast_to, to_bf16
from lily.quant import QuantWeight

try:  # Triton >= 3.3
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover
    TensorDescriptor = None

Tensor = torch.Tensor


@triton.jit
def _scales(p_s, p_b, ssn, o_n, m_n, g0, n_groups, BG: tl.constexpr):
    """fp32 scales and biases (BN, BG) of groups g0.. (groups past n_groups: 0)."""
    o_g = g0 + tl.arange(0, BG)
    p_sb = o_n[:, None] * ssn + o_g[None, :]
    m_sb = m_n[:, None] & (o_g < n_groups)[None, :]
    b_s = tl.load(p_s + p_sb, mask=m_sb, other=0.0).to(tl.float32)
    b_b = tl.load(p_b + p_sb, mask=m_sb, other=0.0).to(tl.float32)
    return b_s, b_b


@triton.jit
def _words(d_w, i_e, n0, i_k, BN: tl.constexpr, BG: tl.constexpr, WPG: tl.constexpr):
    """Packed words (BN, BG, WPG) of expert i_e's rows n0.. at step i_k, by TMA (rows and
    words past the weight come back 0)."""
    return tl.reshape(d_w.load([i_e, n0, i_k * BG * WPG]), (BN, BG, WPG))


@triton.jit
def _gate_up_loop(d_g, d_u, i_e, p_gs, p_gb, p_us, p_ub, ssn, o_n, m_n, n0, n_groups, p_x,
                  tok, m_m, stride_xt, D, mask_lo, BITS: tl.constexpr, GROUP: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  K_STEPS: tl.constexpr, ON_CPU: tl.constexpr):  # fmt: skip
    """Gate and up accumulators (BLOCK_N, BLOCK_M) of one tile over the whole K."""
    BG: tl.constexpr = BLOCK_K // GROUP
    WPG: tl.constexpr = GROUP * BITS // 32
    acc_g = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    for i_k in range(K_STEPS):
        b_gs, b_gb = _scales(p_gs, p_gb, ssn, o_n, m_n, i_k * BG, n_groups, BG)
        b_g = dequant_tile(_words(d_g, i_e, n0, i_k, BLOCK_N, BG, WPG), b_gs, b_gb, mask_lo, BITS)
        b_us, b_ub = _scales(p_us, p_ub, ssn, o_n, m_n, i_k * BG, n_groups, BG)
        b_u = dequant_tile(_words(d_u, i_e, n0, i_k, BLOCK_N, BG, WPG), b_us, b_ub, mask_lo, BITS)
        acc_g, acc_u = gate_up_step(p_x, tok, m_m, stride_xt, i_k * BLOCK_K, D, b_g, b_u,
                                    acc_g, acc_u, ON_CPU)  # fmt: skip
    return acc_g, acc_u


@triton.jit
def _tile(p_pairs, p_tile_e, p_tile_row, p_tile_n, pid, E, T, stride_se, TOP_K: tl.constexpr,
          BLOCK_M: tl.constexpr, N_BLOCKS: tl.constexpr, SHARED: tl.constexpr):  # fmt: skip
    """A program's tile: (expert, its scales' offset, first row in expert order, rows mask,
    (token, slot) pairs, whether there is one). SHARED: the shared expert's tiles, whose
    group follows the T k routed rows (slot k of every token); else the block map's routed
    tiles (its shared group and unused entries skipped)."""
    b = pid // N_BLOCKS
    # NOTE: one return (the compiler checks every return's types, even in a constexpr
    # branch that is not taken)
    if SHARED:
        o_m = b * BLOCK_M + tl.arange(0, BLOCK_M)
        row0 = T * TOP_K + b * BLOCK_M
        e, off, m_m, pairs, go = 0, 0, o_m < T, o_m * (TOP_K + 1) + TOP_K, row0 >= 0
    else:
        e, row0, m_m, pairs = tile_rows(p_tile_e, p_tile_row, p_tile_n, p_pairs, b, BLOCK_M)
        off, go = e.to(tl.int64) * stride_se, (e >= 0) & (e < E)
    return e, off, row0, m_m, pairs, go


@launched
@triton.jit
def _gate_up_tma_kernel(
    p_x, p_pairs, p_tile_e, p_tile_row, p_tile_n, p_h, d_gw, d_uw, p_gs, p_gb, p_us, p_ub,
    stride_se, stride_sn, E, T, N_E, D, stride_xt, stride_h, mask_lo,
    TOP_K: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_STEPS: tl.constexpr,
    N_BLOCKS: tl.constexpr, SHARED: tl.constexpr, ON_CPU: tl.constexpr,
):  # fmt: skip
    """SHARED: the shared expert's tiles (one launch of its own: two pipelined loops in one
    kernel took twice the shared memory, 256 KB at the 128-row tiles); else the routed
    experts' tiles of the block map (the shared group's skipped). N_E: the rows (I) of the
    weights given."""
    pid = tl.program_id(0)
    n0 = (pid % N_BLOCKS) * BLOCK_N
    o_n = n0 + tl.arange(0, BLOCK_N)
    m_n = o_n < N_E
    e, off, row0, m_m, pairs, go = _tile(p_pairs, p_tile_e, p_tile_row, p_tile_n, pid, E, T,
                                         stride_se, TOP_K, BLOCK_M, N_BLOCKS, SHARED)  # fmt: skip
    if go & (n0 < N_E):
        tok = (pairs // (TOP_K + 1)).to(tl.int64)
        acc_g, acc_u = _gate_up_loop(
            d_gw, d_uw, e, p_gs + off, p_gb + off, p_us + off, p_ub + off, stride_sn, o_n, m_n,
            n0, D // GROUP, p_x, tok, m_m, stride_xt, D, mask_lo, BITS, GROUP, BLOCK_M, BLOCK_N,
            BLOCK_K, K_STEPS, ON_CPU,
        )  # fmt: skip
        b_h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
        p_hb = p_h + (row0 + tl.arange(0, BLOCK_M)).to(tl.int64)[None, :] * stride_h + o_n[:, None]
        tl.store(p_hb, cast_to(b_h, p_h.dtype.element_ty, ON_CPU), mask=m_n[:, None] & m_m[None, :])


@triton.jit
def _down_loop(d_w, i_e, p_s, p_b, ssn, o_n, m_n, n0, k_len, d_h, row0, mask_lo,
               BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_STEPS: tl.constexpr,
               K_MASK: tl.constexpr, ON_CPU: tl.constexpr):  # fmt: skip
    """The down accumulator (BLOCK_N, BLOCK_M) of one tile over its expert's K = k_len."""
    BG: tl.constexpr = BLOCK_K // GROUP
    WPG: tl.constexpr = GROUP * BITS // 32
    o_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    for i_k in range(K_STEPS):
        b_s, b_b = _scales(p_s, p_b, ssn, o_n, m_n, i_k * BG, k_len // GROUP, BG)
        b_w = dequant_tile(_words(d_w, i_e, n0, i_k, BLOCK_N, BG, WPG), b_s, b_b, mask_lo, BITS)
        k0 = i_k * BLOCK_K
        b_h = d_h.load([row0, k0])  # (BLOCK_M, BLOCK_K): rows past the tile's are masked out
        if K_MASK:
            # columns past this expert's K (routed and shared experts of different widths)
            # may hold anything: their weights are 0, but 0 * NaN is not
            b_h = tl.where(((k0 + o_k) < k_len)[None, :], b_h, 0.0)
        acc = mma(to_bf16(b_w, ON_CPU), to_bf16(tl.trans(b_h), ON_CPU), acc, ON_CPU)
    return acc


@launched
@triton.jit
def _down_tma_kernel(
    d_h, p_pairs, p_tile_e, p_tile_row, p_tile_n, p_wts, p_y, d_dw, p_ds, p_db, stride_se,
    stride_sn, E, T, D, K_E, stride_y, mask_lo,
    TOP_K: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_STEPS: tl.constexpr,
    N_BLOCKS: tl.constexpr, K_MASK: tl.constexpr, SHARED: tl.constexpr, ON_CPU: tl.constexpr,
):  # fmt: skip
    """SHARED as in _gate_up_tma_kernel; K_E: the inputs (I) of the weights given."""
    pid = tl.program_id(0)
    n0 = (pid % N_BLOCKS) * BLOCK_N
    o_n = n0 + tl.arange(0, BLOCK_N)
    m_n = o_n < D
    e, off, row0, m_m, pairs, go = _tile(p_pairs, p_tile_e, p_tile_row, p_tile_n, pid, E, T,
                                         stride_se, TOP_K, BLOCK_M, N_BLOCKS, SHARED)  # fmt: skip
    if go:
        acc = _down_loop(d_dw, e, p_ds + off, p_db + off, stride_sn, o_n, m_n, n0, K_E, d_h,
                         row0, mask_lo, BITS, GROUP, BLOCK_M, BLOCK_N, BLOCK_K, K_STEPS, K_MASK,
                         ON_CPU)  # fmt: skip
        acc = acc * tl.load(p_wts + pairs, mask=m_m, other=0.0)[None, :]
        p_o = p_y + pairs.to(tl.int64)[None, :] * stride_y + o_n[:, None]
        tl.store(p_o, cast_to(acc, p_y.dtype.element_ty, ON_CPU), mask=m_n[:, None] & m_m[None, :])


# ---------------------------------------------------------------- host side


def _descriptor(t: Tensor, block: list[int]):
    """A host-side TMA descriptor of ``t`` with box ``block`` (built per call: a few
    microseconds, and none in a captured graph; a cache would keep dead weights alive)."""
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block)


def _as3(t: Tensor) -> Tensor:
    """An expert tensor as (E, N, ...): a shared expert's 2D one as one expert."""
    return t if t.dim() == 3 else t.unsqueeze(0)


def _words3(w: QuantWeight) -> Tensor:
    return _as3(w.qweight)


def _tma_ok(t: Tensor) -> bool:
    """What a TMA box load needs of a tensor: a 16-byte aligned base, 16-byte aligned
    strides (all but the last, which is 1)."""
    e = t.element_size()
    return (t.data_ptr() % 16 == 0 and t.stride(-1) == 1
            and all(s * e % 16 == 0 for s in t.stride()[:-1]))  # fmt: skip


@functools.lru_cache(maxsize=8)
def _is_sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index) == (9, 0)


def sm90_applies(x: Tensor, weights: tuple, cfg_gate_up: GemmConfig, cfg_down: GemmConfig) -> bool:
    """Whether these kernels can run these weights with these tiles (where the device is an
    sm_90 GPU, or the interpreter on the CPU): descriptors in Triton, TMA-aligned packed
    words, boxes of at least 16 bytes a row."""
    if TensorDescriptor is None:
        return False
    if x.is_cuda and not _is_sm90(x.device.index or 0):
        return False
    w0 = weights[0]
    per = 32 // w0.bits
    if min(cfg_gate_up.block_k, cfg_down.block_k) // per * 4 < 16:
        return False
    return all(_tma_ok(_words3(w)) for w in weights if w is not None)


def gate_up_sm90(x: Tensor, plan: tuple, h: Tensor, gate: QuantWeight, up: QuantWeight,
                 sg: QuantWeight | None, su: QuantWeight | None, e: int, top_k: int,
                 cfg: GemmConfig, block_m: int) -> None:  # fmt: skip
    """Launch 4 of moe_prefill on these kernels: h (rows, I) = silu(x W_g^T) * (x W_u^T)
    per tile of the block map ``plan`` = (pairs, tile_e, tile_row, tile_n); the shared
    expert (``sg``, ``su``; None: none) in a second launch."""
    t, d = x.shape
    routed = cdiv(t * top_k, block_m) + e  # the most routed tiles the map can hold
    for shared, (g, u), tiles in ((False, (gate, up), routed),
                                  (True, (sg, su), cdiv(t, block_m))):  # fmt: skip
        if g is None:
            continue
        per, n = 32 // g.bits, g.shape[-2]
        nb = cdiv(n, cfg.block_n)
        box = [1, cfg.block_n, cfg.block_k // per]
        dg, du = _descriptor(_words3(g), box), _descriptor(_words3(u), box)
        gs, gb, us, ub = (_as3(p) for p in (g.scales, g.biases, u.scales, u.biases))
        _gate_up_tma_kernel[(tiles * nb,)](
            x, *plan, h, dg, du, gs, gb, us, ub, gs.stride(0), gs.stride(1), e, t, n, d,
            x.stride(0), h.stride(0), mask_lo(g.bits), TOP_K=top_k, BITS=g.bits,
            GROUP=g.group_size, BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            K_STEPS=cdiv(d, cfg.block_k), N_BLOCKS=nb, SHARED=shared,
            ON_CPU=x.device.type == "cpu", num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip


def down_sm90(h: Tensor, plan: tuple, wts: Tensor, y: Tensor, down: QuantWeight,
              sd: QuantWeight | None, e: int, t: int, top_k: int, cfg: GemmConfig,
              block_m: int) -> None:  # fmt: skip
    """Launch 5 of moe_prefill on these kernels: y rows (pair places) = routing weight x
    h W_d^T per tile of the block map; the shared expert (``sd``) in a second launch."""
    d = down.shape[-2]
    nb = cdiv(d, cfg.block_n)
    dh = _descriptor(h, [block_m, cfg.block_k])
    routed = cdiv(t * top_k, block_m) + e
    for shared, w, tiles in ((False, down, routed), (True, sd, cdiv(t, block_m))):
        if w is None:
            continue
        per, k_e = 32 // w.bits, w.shape[-1]
        dw = _descriptor(_words3(w), [1, cfg.block_n, cfg.block_k // per])
        ws, wb = _as3(w.scales), _as3(w.biases)
        _down_tma_kernel[(tiles * nb,)](
            dh, *plan, wts, y, dw, ws, wb, ws.stride(0), ws.stride(1), e, t, d, k_e,
            y.stride(0), mask_lo(w.bits), TOP_K=top_k, BITS=w.bits, GROUP=w.group_size,
            BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            K_STEPS=cdiv(k_e, cfg.block_k), N_BLOCKS=nb, K_MASK=k_e != h.shape[1],
            SHARED=shared, ON_CPU=h.device.type == "cpu", num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )  # fmt: skip
