"""Gated full attention, prefill: a chunk of T queries at positions [start, start+T).

Kernels:
1. ``_prep_kernel``: per token and head, q/k RMSNorm and partial RoPE; the queries go to a
   (T, H, Dh) buffer in the cache dtype, K and V of the chunk into the cache rows
   [start, start+T).
2. ``_flash_kernel``: causal flash attention with GQA packing: a program takes BM rows made
   of BM/G consecutive tokens times the G query heads of one KV head (adjacent in memory),
   so each K/V tile serves all G heads. Online softmax in base 2, fp32 accumulators,
   tensor-core products in the cache dtype; the causal mask is applied only on the tiles
   that cross the diagonal. The output is multiplied by sigmoid(gate) and written (T, H*Dh).
3. Split keys (``split`` > 1, chosen by ``flash_split``): a short chunk after a long history
   has few programs, each walking all the keys, so the GPU's last wave runs nearly empty;
   then each program takes one share of the key tiles and writes a normalised fp32 partial
   and its log-sum-exp, and ``_flash_combine_kernel`` merges the shares and applies the gate.
``start`` may be a Python int or a one-element device tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from lily.ops.arch import DEFAULT, Arch, current_arch
from lily.ops.launch import cdiv, check, launched, pow2
from lily.ops.norm_rope import rms_rope_rows, sigmoid

Tensor = torch.Tensor

LOG2E = 1.4426950408889634


@launched
@triton.jit
def _prep_kernel(
    qg, k, v, q_norm, k_norm, inv_freq, p_start, q_buf, k_cache, v_cache, T, T_MAX, stride_qg,
    stride_k, stride_v, eps, H: tl.constexpr, HKV: tl.constexpr, DH: tl.constexpr,
    R: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, START_PTR: tl.constexpr,
):  # fmt: skip
    i_t, i_g = tl.program_id(0), tl.program_id(1)
    if START_PTR:  # a device position (graph-safe); else the host's int
        start = tl.load(p_start).to(tl.int32)
    else:
        start = p_start
    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < T
    o_d = tl.arange(0, BD)
    # NOTE: rows past the cache (a device start too large: a caller's bug) are not written
    m_td = (m_t & (start + o_t < T_MAX))[:, None] & (o_d < DH)[None, :]
    if i_g < H:  # a query head
        b_q = rms_rope_rows(
            qg,
            o_t * stride_qg + i_g * 2 * DH,
            m_t,
            q_norm,
            inv_freq,
            start + o_t,
            eps,
            DH,
            R,
            BD,
        )
        tl.store(
            q_buf + (o_t[:, None] * H + i_g) * DH + o_d[None, :],
            b_q.to(q_buf.dtype.element_ty),
            mask=m_td,
        )
    else:  # a KV head: K normed and rotated, V as is, both into the cache
        i_h = i_g - H
        b_k = rms_rope_rows(
            k, o_t * stride_k + i_h * DH, m_t, k_norm, inv_freq, start + o_t, eps, DH, R, BD
        )
        b_v = tl.load(v + o_t[:, None] * stride_v + i_h * DH + o_d[None, :], mask=m_td, other=0.0)
        p_row = i_h * T_MAX * DH + (start + o_t)[:, None] * DH + o_d[None, :]
        tl.store(k_cache + p_row, b_k.to(k_cache.dtype.element_ty), mask=m_td)
        tl.store(v_cache + p_row, b_v.to(v_cache.dtype.element_ty), mask=m_td)


@launched
@triton.jit
def _flash_kernel(
    qg, q_buf, k_cache, v_cache, p_start, out, o_part, lse_part, T, T_MAX, stride_qg, sm_scale,
    n_split, H: tl.constexpr, HKV: tl.constexpr, DH: tl.constexpr, BM: tl.constexpr,
    BN: tl.constexpr, BD: tl.constexpr, IS_SPLIT: tl.constexpr, START_PTR: tl.constexpr,
):  # fmt: skip
    i_m, i_kvh, i_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    G: tl.constexpr = H // HKV
    BMT: tl.constexpr = BM // G  # tokens per program
    if START_PTR:
        start = tl.load(p_start).to(tl.int32)
    else:
        start = p_start
    o_r = tl.arange(0, BM)
    o_t = i_m * BMT + o_r // G  # token of each row (within the chunk)
    head = i_kvh * G + o_r % G
    m_t = o_t < T
    o_d = tl.arange(0, BD)
    m_d = o_d < DH
    m_rd = m_t[:, None] & m_d[None, :]
    b_q = tl.load(
        q_buf + (o_t[:, None] * H + head[:, None]) * DH + o_d[None, :], mask=m_rd, other=0.0
    )
    b_q = (b_q.to(tl.float32) * sm_scale).to(k_cache.dtype.element_ty)  # includes log2(e)
    q_pos = start + o_t
    p_kc = k_cache + i_kvh * T_MAX * DH
    p_vc = v_cache + i_kvh * T_MAX * DH

    b_m = tl.full([BM], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BM], dtype=tl.float32)
    b_acc = tl.zeros([BM, BD], dtype=tl.float32)
    first_pos = start + i_m * BMT  # keys below it are visible to every row of the program
    last_pos = tl.minimum(first_pos + BMT, start + T)  # one past the last key any row sees
    last_pos = tl.minimum(last_pos, T_MAX)  # never read past the cache (see _prep_kernel)
    n_full = tl.minimum((first_pos // BN) * BN, T_MAX // BN * BN)
    n_lo = 0
    n_hi = n_full
    d_lo = n_full
    if IS_SPLIT:  # this program's share of the full tiles; the last one takes the diagonal
        per = tl.cdiv(n_full // BN, n_split) * BN
        n_lo = tl.minimum(i_s * per, n_full)
        n_hi = tl.minimum(n_lo + per, n_full)
        d_lo = tl.where(i_s == n_split - 1, n_full, last_pos)
    for n0 in range(n_lo, n_hi, BN):  # tiles fully below the diagonal: no mask
        o_n = n0 + tl.arange(0, BN)
        b_k = tl.load(p_kc + o_n[:, None] * DH + o_d[None, :], mask=m_d[None, :], other=0.0)
        b_v = tl.load(p_vc + o_n[:, None] * DH + o_d[None, :], mask=m_d[None, :], other=0.0)
        b_s = tl.dot(b_q, tl.trans(b_k))
        b_mn = tl.maximum(b_m, tl.max(b_s, 1))
        b_p = tl.exp2(b_s - b_mn[:, None])
        b_alpha = tl.exp2(b_m - b_mn)
        b_l = b_l * b_alpha + tl.sum(b_p, 1)
        b_acc = b_acc * b_alpha[:, None] + tl.dot(b_p.to(b_v.dtype), b_v)
        b_m = b_mn
    for n0 in range(d_lo, last_pos, BN):  # tiles crossing the diagonal
        o_n = n0 + tl.arange(0, BN)
        m_n = o_n < last_pos
        b_k = tl.load(
            p_kc + o_n[:, None] * DH + o_d[None, :], mask=m_n[:, None] & m_d[None, :], other=0.0
        )
        b_v = tl.load(
            p_vc + o_n[:, None] * DH + o_d[None, :], mask=m_n[:, None] & m_d[None, :], other=0.0
        )
        b_s = tl.dot(b_q, tl.trans(b_k))
        b_s = tl.where(o_n[None, :] <= q_pos[:, None], b_s, float("-inf"))
        b_mn = tl.maximum(b_m, tl.max(b_s, 1))
        b_p = tl.exp2(b_s - b_mn[:, None])
        b_alpha = tl.exp2(b_m - b_mn)
        b_l = b_l * b_alpha + tl.sum(b_p, 1)
        b_acc = b_acc * b_alpha[:, None] + tl.dot(b_p.to(b_v.dtype), b_v)
        b_m = b_mn
    if IS_SPLIT:
        # Normalised partial and its log-sum-exp (base 2); a share with no keys (l = 0)
        # writes 0 and -inf, which the combine weighs by exp2(-inf) = 0.
        row = o_t * H + head
        b_o = b_acc / tl.where(b_l > 0, b_l, 1.0)[:, None]
        p_o = o_part + (i_s * T + o_t[:, None]) * (H * DH) + head[:, None] * DH + o_d[None, :]
        tl.store(p_o, b_o, mask=m_rd)
        tl.store(lse_part + i_s * T * H + row, b_m + tl.log2(b_l), mask=m_t)
    else:
        # padded rows (token >= T) saw only masked keys: keep them finite, not stored
        b_l = tl.where(m_t, b_l, 1.0)
        p_g = qg + o_t[:, None] * stride_qg + head[:, None] * (2 * DH) + DH + o_d[None, :]
        b_gate = tl.load(p_g, mask=m_rd, other=0.0).to(tl.float32)
        b_o = b_acc / b_l[:, None] * sigmoid(b_gate)
        tl.store(
            out + o_t[:, None] * (H * DH) + head[:, None] * DH + o_d[None, :],
            b_o.to(out.dtype.element_ty),
            mask=m_rd,
        )


@launched
@triton.jit
def _flash_combine_kernel(
    qg, o_part, lse_part, out, R, stride_qg, n_split, H: tl.constexpr, DH: tl.constexpr,
    BR: tl.constexpr, BD: tl.constexpr,
):  # fmt: skip
    """Rows (token, head) of the split-KV partials merged in split order, then the gate."""
    o_r = tl.program_id(0) * BR + tl.arange(0, BR)
    m_r = o_r < R
    o_d = tl.arange(0, BD)
    m_rd = m_r[:, None] & (o_d < DH)[None, :]
    p_g = qg + (o_r // H)[:, None] * stride_qg + (o_r % H)[:, None] * (2 * DH) + DH
    b_gate = tl.load(p_g + o_d[None, :], mask=m_rd, other=0.0).to(tl.float32)
    b_m = tl.full([BR], float("-inf"), dtype=tl.float32)
    b_w = tl.zeros([BR], dtype=tl.float32)
    b_acc = tl.zeros([BR, BD], dtype=tl.float32)
    for s in range(n_split):
        # the diagonal share (the last) always holds a key, so the final max is finite
        b_lse = tl.load(lse_part + s * R + o_r, mask=m_r, other=float("-inf"))
        b_o = tl.load(o_part + (s * R + o_r)[:, None] * DH + o_d[None, :], mask=m_rd, other=0.0)
        b_mn = tl.maximum(b_m, b_lse)
        b_mn = tl.where(b_mn == float("-inf"), 0.0, b_mn)  # nothing yet: keep exp2 finite
        b_alpha = tl.exp2(b_m - b_mn)
        b_e = tl.exp2(b_lse - b_mn)
        b_acc = b_acc * b_alpha[:, None] + b_e[:, None] * b_o
        b_w = b_w * b_alpha + b_e
        b_m = b_mn
    b_o = b_acc / tl.where(m_r, b_w, 1.0)[:, None] * sigmoid(b_gate)
    p_out = out + o_r[:, None] * DH + o_d[None, :]
    tl.store(p_out, b_o.to(out.dtype.element_ty), mask=m_rd)


@dataclass(frozen=True)
class FlashTile:
    """One flash program: ``block_m`` query rows (tokens times the G heads of a KV head),
    ``block_n`` keys a step, its warps and pipeline stages."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def flash_tile(arch: Arch, elem_bytes: int = 2) -> FlashTile:
    """The flash tile of an architecture and KV-cache element size (the compile matrix
    checks each fits).

    H200: 128 query rows x 64 keys on 8 warps (two warpgroups), 2 stages: faster than
    64 x 32 on 4 warps at every chunk and history measured, 3-8% (H200,
    bench/results/attn_tiles_all_h200.json); at Dh 256 it takes 192 KiB of shared memory
    on sm_90 and 144 KiB with MMAv2, so sm_80 (163 KiB) keeps it. With 99 KiB a block
    (sm_86, sm_89, sm_120) 64 x 32 on 4 warps, 2 stages: 68 KiB, at most 24 bytes of
    spills (64 x 64 took 104 KiB, 128 x 32 104 KiB, 128 x 64 on one stage 112 KiB).
    An fp32 cache (``--dtype float32``) doubles every K/V tile: 128 x 64 took 384 KiB on
    sm_90 (it could not launch on the H200 either); 32 x 32 on 4 warps takes 100 KiB and
    32 x 16 66 KiB, neither spills."""
    if elem_bytes > 2:
        return FlashTile(32, 32, 4, 2) if arch.big_smem else FlashTile(32, 16, 4, 2)
    if arch.big_smem:
        return FlashTile(128, 64, 8, 2)
    return FlashTile(64, 32, 4, 2)


def flash_per_sm(block_m: int, block_n: int, dh: int, warps: int, stages: int, cache,
                 smem: int = DEFAULT.smem) -> int:  # fmt: skip
    """Flash programs resident on one SM with ``smem`` bytes of shared memory: it holds the
    Q tile and ``stages`` K and V tiles; the kernel takes nearly all 255 registers a
    thread, so 8 warps an SM by registers. At Dh 256 (sm_90, compiled): 64 x 32 at 4 warps
    96 KB (2 an SM), 128 x 32 at 8 warps 128 KB (1 an SM)."""
    e = cache.element_size()
    tile = block_m * dh * e + stages * 2 * block_n * dh * e
    return max(1, min(smem // tile, 8 // warps))


PART_BYTES = 128 * 2**20  # cap on the split partials of one call (fp32, all shares)


def flash_split(programs: int, keys: int, slots: int, block_n: int, max_split: int = 16) -> int:
    """Key splits for a chunk whose programs leave the GPU's last wave mostly idle.

    Every program of a chunk walks the whole history, so at 1-2K tokens after a long one
    (a reused multi-turn prompt: 282 programs at 1,128 tokens) the last partial wave costs
    as much as a full one. Splitting the keys S ways turns the wave tail into S times finer
    pieces, for the price of the fp32 partials (8 bytes per element, written and read):
    cost(S) = ceil(P S / slots) / S + S * 200 / keys, the second term from the partials'
    bytes against the key tiles' FLOPs at the measured rates; each share keeps at least 8
    key tiles, at most ``max_split`` shares (the partials' memory), and a split must save
    5% of the modelled time."""
    best, best_cost = 1, float(cdiv(programs, slots))
    plain = best_cost
    for s in range(2, max_split + 1):
        if keys < 8 * block_n * s:
            break
        cost = cdiv(programs * s, slots) / s + s * 200 / keys
        if cost < best_cost:
            best, best_cost = s, cost
    return best if best_cost < 0.95 * plain else 1


def _check(cond: bool, msg) -> None:
    check(cond, "attention_prefill", msg)


def attention_prefill(
    qg: Tensor,
    k: Tensor,
    v: Tensor,
    q_norm: Tensor,
    k_norm: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    start: int | Tensor,
    inv_freq: Tensor,
    eps: float = 1e-6,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    split: int | None = None,
) -> Tensor:
    """Gated causal attention of T tokens at positions [start, start+T) (MODEL.md).

    qg (T, H*2*Dh): per head Dh query then Dh gate; k, v (T, Hkv*Dh); q_norm, k_norm (Dh,)
    (multipliers); k_cache, v_cache (Hkv, T_max, Dh) with rows [0, start) filled, rows
    [start, start+T) written here; start an int or one-element int device tensor (then the
    caller guarantees start + T <= T_max); inv_freq (R/2,) fp32 from ``rope_inv_freq``.
    Returns (T, H*Dh) in qg's dtype. ``split``: key splits (partials merged by a second
    kernel); by default ``flash_split`` picks them when start is an int, else 1. The tile
    (``block_m`` ... ``num_stages``) is ``flash_tile`` of the architecture unless given.
    """
    _check(
        k_cache.dim() == 3
        and k_cache.shape == v_cache.shape
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and k_cache.dtype == v_cache.dtype,
        lambda: (
            f"k_cache and v_cache must be contiguous (Hkv, T_max, Dh) of one dtype, got "
            f"{tuple(k_cache.shape)} {k_cache.dtype} and {tuple(v_cache.shape)} {v_cache.dtype}"
        ),
    )
    hkv, t_max, dh = k_cache.shape
    _check(
        qg.dim() == 2 and qg.shape[1] % (2 * dh) == 0 and qg.stride(1) == 1,
        lambda: f"qg must be (T, H*2*{dh}) with contiguous rows, got {tuple(qg.shape)}",
    )
    t, h = qg.shape[0], qg.shape[1] // (2 * dh)
    _check(t > 0, "empty chunk (T = 0)")
    _check(h % hkv == 0, lambda: f"{h} query heads do not group over {hkv} KV heads")
    g = h // hkv
    arch = current_arch(qg.device)
    tile = flash_tile(arch, k_cache.element_size())
    block_m = block_m or tile.block_m
    block_n = block_n or tile.block_n
    num_warps = num_warps or tile.num_warps
    num_stages = num_stages or tile.num_stages
    # qg, k and v may be column slices of one fused projection output (rows contiguous)
    for name, x in (("k", k), ("v", v)):
        _check(
            x.shape == (t, hkv * dh) and x.stride(1) == 1,
            lambda name=name, x=x: (
                f"{name} must be ({t}, {hkv * dh}) with contiguous rows, got {tuple(x.shape)}"
            ),
        )
    for name, x in (("q_norm", q_norm), ("k_norm", k_norm)):
        _check(
            x.shape == (dh,), lambda name=name, x=x: f"{name} must be ({dh},), got {tuple(x.shape)}"
        )
    _check(
        inv_freq.dim() == 1 and inv_freq.dtype == torch.float32 and 2 * inv_freq.numel() <= dh,
        lambda: f"inv_freq must be fp32 (R/2,) with R <= {dh}, got {tuple(inv_freq.shape)}",
    )
    _check(
        block_m > 0 and block_m % g == 0,
        lambda: f"block_m={block_m} must be a multiple of the group size {g} (and positive)",
    )
    q_blocks = cdiv(t, block_m // g)  # programs along the tokens, per KV head
    if isinstance(start, int):
        _check(
            0 <= start and start + t <= t_max,
            lambda: f"positions [{start}, {start + t}) do not fit a cache of {t_max}",
        )
        if split is None and qg.is_cuda:
            n_sm = torch.cuda.get_device_properties(qg.device).multi_processor_count
            per_sm = flash_per_sm(block_m, block_n, dh, num_warps, num_stages, k_cache,
                                  arch.smem)  # fmt: skip
            cap = max(1, PART_BYTES // (t * h * dh * 4))
            split = flash_split(q_blocks * hkv, start + t, n_sm * per_sm, block_n, min(16, cap))
        # NOTE: an int start goes to the kernels as an argument: a device copy of it cost
        # each attention layer a host tensor, a pinned copy and a transfer.
        start_ptr = False
    else:
        _check(
            start.numel() == 1 and not start.dtype.is_floating_point,
            lambda: f"start must be an int or a one-element integer tensor, got {start.dtype}",
        )
        start_ptr = True
    split = split or 1
    _check(split >= 1, lambda: f"split must be >= 1, got {split}")
    tensors = [qg, k, v, q_norm, k_norm, k_cache, v_cache, inv_freq] + [start] * start_ptr
    _check(all(x.device == k_cache.device for x in tensors), "all tensors must be on one device")

    bd = pow2(dh)
    q_buf = torch.empty(t, h, dh, dtype=k_cache.dtype, device=qg.device)
    bt = 8  # 16 rows of 256 spill registers at 4 warps (sm_90)
    _prep_kernel[(cdiv(t, bt), h + hkv)](
        qg,
        k,
        v,
        q_norm,
        k_norm,
        inv_freq,
        start,
        q_buf,
        k_cache,
        v_cache,
        t,
        t_max,
        qg.stride(0),
        k.stride(0),
        v.stride(0),
        eps,
        H=h,
        HKV=hkv,
        DH=dh,
        R=2 * inv_freq.numel(),
        BT=bt,
        BD=bd,
        START_PTR=start_ptr,
        num_warps=4,
    )
    out = torch.empty(t, h * dh, dtype=qg.dtype, device=qg.device)
    if split > 1:
        o_part = torch.empty(split, t * h, dh, dtype=torch.float32, device=qg.device)
        lse_part = torch.empty(split, t * h, dtype=torch.float32, device=qg.device)
    else:
        o_part = lse_part = out
    _flash_kernel[(q_blocks, hkv, split)](
        qg, q_buf, k_cache, v_cache, start, out, o_part, lse_part, t, t_max, qg.stride(0),
        dh**-0.5 * LOG2E, split, H=h, HKV=hkv, DH=dh, BM=block_m, BN=block_n, BD=bd,
        IS_SPLIT=split > 1, START_PTR=start_ptr, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if split > 1:
        br = 16
        _flash_combine_kernel[(cdiv(t * h, br),)](
            qg,
            o_part,
            lse_part,
            out,
            t * h,
            qg.stride(0),
            split,
            H=h,
            DH=dh,
            BR=br,
            BD=bd,
            num_warps=4,
        )
    return out
