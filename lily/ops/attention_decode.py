"""Gated full attention, decode: one query token against the KV cache.

The prep (q/k RMSNorm, partial RoPE at ``pos``, the K/V cache write) is fused into the
attention kernels themselves: every program prepares its own 8 query heads (a few KiB read,
against the KV rows it streams), and the one program whose cache range holds ``pos`` writes
the new K/V row before reading it back. That saves a launch and a round trip per layer.

GQA packing: one program serves all G query heads of a KV head (padded to 16 rows for the
tensor cores), so each KV row is read once. Two variants:
- plain: grid (Hkv,), each program walks the whole cache;
- split: grid (Hkv, blocks): fixed blocks of ``split`` rows in parallel, each leaving a
  normalised partial output and its log-sum-exp; ``_attn_combine_kernel`` merges them and
  applies the output gate.
The position is read from a device tensor, so a step can be captured in a CUDA graph; only
``max_len`` (a host bound on pos+1 that sizes the split grid) must stay fixed per graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lily.ops.arch import DEFAULT, Arch, current_arch
from lily.ops.launch import cdiv, check, launched, pow2
from lily.ops.norm_rope import rms_rope_apply, rms_rope_load, sigmoid
from lily.transfer import table_address

Tensor = torch.Tensor

LOG2E = 1.4426950408889634


@launched
@triton.jit
def _attn_decode_kernel(
    qg, k, v, q_norm, k_norm, inv_freq, k_cache, v_cache, p_pos, out, o_part, lse_part, eps,
    sm_scale, T_MAX, NB, split, kv_tab, s_qg, s_k, s_v, H: tl.constexpr, HKV: tl.constexpr,
    DH: tl.constexpr, R: tl.constexpr, GP: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr,
    IS_SPLIT: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    i_kvh, i_s = tl.program_id(0), tl.program_id(1)
    G: tl.constexpr = H // HKV
    if ROWS:  # row i_b of a batch: its inputs, position and outputs, and its own cache
        i_b = tl.program_id(2)
        qg += i_b * s_qg
        k += i_b * s_k
        v += i_b * s_v
        p_pos += i_b
        out += i_b * (H * DH)
        o_part += i_b * (HKV * NB * G * DH)
        lse_part += i_b * (HKV * NB * G)
        # (16-byte aligned, as Triton assumes of a pointer argument: vectorized loads)
        k_cache = tl.multiple_of(tl.load(kv_tab + 3 * i_b).to(k_cache.dtype), 16)
        v_cache = tl.multiple_of(tl.load(kv_tab + 3 * i_b + 1).to(v_cache.dtype), 16)
        T_MAX = tl.load(kv_tab + 3 * i_b + 2).to(tl.int32)
    # NOTE: a position past the cache (a caller's bug) must not write out of bounds: clamp
    pos = tl.minimum(tl.load(p_pos).to(tl.int32), T_MAX - 1)
    L = pos + 1
    if IS_SPLIT:
        n_lo = i_s * split
        n_hi = tl.minimum(n_lo + split, L)
    else:
        n_lo = 0
        n_hi = L
    if n_lo < L:
        o_r = tl.arange(0, GP)
        m_r = o_r < G
        o_d = tl.arange(0, BD)
        m_d = o_d < DH
        # NOTE: all prep loads first (the new K row and V row too, in every program: 1 KiB),
        # then the maths: each reduction's barrier would otherwise wait on the next load
        q_x, q_w, q_xp, q_wp, q_f = rms_rope_load(
            qg, (i_kvh * G + o_r) * (2 * DH), m_r, q_norm, inv_freq, DH, R, BD
        )
        o_1 = tl.arange(0, 1)
        k_x, k_w, k_xp, k_wp, k_f = rms_rope_load(
            k, i_kvh * DH + o_1, o_1 < 1, k_norm, inv_freq, DH, R, BD
        )
        b_vr = tl.load(v + i_kvh * DH + o_d[None, :], mask=m_d[None, :], other=0.0)
        b_q = rms_rope_apply(q_x, q_w, q_xp, q_wp, q_f, tl.zeros([GP], dtype=tl.int32) + pos,
                             eps, DH, R, BD)  # fmt: skip
        b_q = (b_q * sm_scale).to(k_cache.dtype.element_ty)  # sm_scale includes log2(e)
        p_kc = k_cache + i_kvh * T_MAX * DH
        p_vc = v_cache + i_kvh * T_MAX * DH
        if n_hi == L:  # this program's range holds pos: write the new row first
            b_k = rms_rope_apply(k_x, k_w, k_xp, k_wp, k_f, tl.zeros([1], dtype=tl.int32) + pos,
                                 eps, DH, R, BD)  # fmt: skip
            p_row = pos * DH + o_d[None, :]
            tl.store(p_kc + p_row, b_k.to(k_cache.dtype.element_ty), mask=m_d[None, :])
            tl.store(p_vc + p_row, b_vr.to(v_cache.dtype.element_ty), mask=m_d[None, :])
            tl.debug_barrier()  # the row is read back below, possibly by other threads
        b_m = tl.full([GP], float("-inf"), dtype=tl.float32)
        b_l = tl.zeros([GP], dtype=tl.float32)
        b_acc = tl.zeros([GP, BD], dtype=tl.float32)
        for n0 in range(n_lo, n_hi, BN):
            o_n = n0 + tl.arange(0, BN)
            m_n = o_n < n_hi
            m_nd = m_n[:, None] & m_d[None, :]
            b_k = tl.load(p_kc + o_n[:, None] * DH + o_d[None, :], mask=m_nd, other=0.0)
            b_v = tl.load(p_vc + o_n[:, None] * DH + o_d[None, :], mask=m_nd, other=0.0)
            b_s = tl.dot(b_q, tl.trans(b_k))
            b_s = tl.where(m_n[None, :], b_s, float("-inf"))
            b_mn = tl.maximum(b_m, tl.max(b_s, 1))
            b_p = tl.exp2(b_s - b_mn[:, None])
            b_alpha = tl.exp2(b_m - b_mn)
            b_l = b_l * b_alpha + tl.sum(b_p, 1)
            b_acc = b_acc * b_alpha[:, None] + tl.dot(b_p.to(b_v.dtype), b_v)
            b_m = b_mn
        b_o = b_acc / b_l[:, None]
        m_rd = m_r[:, None] & m_d[None, :]
        if IS_SPLIT:
            i_p = (i_kvh * NB + i_s) * G + o_r
            tl.store(o_part + i_p[:, None] * DH + o_d[None, :], b_o, mask=m_rd)
            tl.store(lse_part + i_p, b_m + tl.log2(b_l), mask=m_r)
        else:
            head = i_kvh * G + o_r
            b_gate = tl.load(
                qg + head[:, None] * (2 * DH) + DH + o_d[None, :], mask=m_rd, other=0.0
            ).to(tl.float32)
            tl.store(
                out + head[:, None] * DH + o_d[None, :],
                (b_o * sigmoid(b_gate)).to(out.dtype.element_ty),
                mask=m_rd,
            )


@launched
@triton.jit
def _attn_combine_kernel(
    qg, p_pos, o_part, lse_part, out, NB, split, s_qg, H: tl.constexpr, HKV: tl.constexpr,
    DH: tl.constexpr, BB: tl.constexpr, BDC: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    # Grid (heads, Dh / BDC[, rows]): each program merges BB blocks a step for BDC dims of a
    # head, so at long contexts (hundreds of blocks) the merge is a few wide steps in many
    # programs, not a long chain of dependent loads in a few.
    i_h, i_c = tl.program_id(0), tl.program_id(1)
    G: tl.constexpr = H // HKV
    if ROWS:
        i_b = tl.program_id(2)
        qg += i_b * s_qg
        p_pos += i_b
        out += i_b * (H * DH)
        o_part += i_b * (HKV * NB * G * DH)
        lse_part += i_b * (HKV * NB * G)
    i_kvh, i_g = i_h // G, i_h % G
    # Capped at the blocks the main kernel had (a position past max_len must not send
    # the combine into another head's partials).
    n_blocks = tl.minimum(tl.cdiv(tl.load(p_pos).to(tl.int32) + 1, split), NB)
    o_d = i_c * BDC + tl.arange(0, BDC)
    m_d = o_d < DH
    b_gate = tl.load(qg + i_h * (2 * DH) + DH + o_d, mask=m_d, other=0.0).to(tl.float32)
    # running max over the blocks' log-sum-exps (base 2); the first block is always valid
    b_m = tl.full([1], float("-inf"), dtype=tl.float32)
    b_s = tl.zeros([1], dtype=tl.float32)
    b_acc = tl.zeros([BDC], dtype=tl.float32)
    for b0 in range(0, n_blocks, BB):
        o_b = b0 + tl.arange(0, BB)
        m_b = o_b < n_blocks
        i_p = (i_kvh * NB + o_b) * G + i_g
        b_lse = tl.load(lse_part + i_p, mask=m_b, other=float("-inf"))
        b_o = tl.load(
            o_part + i_p[:, None] * DH + o_d[None, :], mask=m_b[:, None] & m_d[None, :], other=0.0
        )
        b_mn = tl.maximum(b_m, tl.max(b_lse, 0))
        b_w = tl.exp2(b_lse - b_mn)
        b_alpha = tl.exp2(b_m - b_mn)
        b_acc = b_acc * b_alpha + tl.sum(b_w[:, None] * b_o, 0)
        b_s = b_s * b_alpha + tl.sum(b_w, 0)
        b_m = b_mn
    tl.store(
        out + i_h * DH + o_d, (b_acc / b_s * sigmoid(b_gate)).to(out.dtype.element_ty), mask=m_d
    )


def _check(cond: bool, msg) -> None:
    check(cond, "attention_decode", msg)


def default_split(max_len: int) -> int:
    """Rows per split block for a graph built for ``max_len`` rows (the runner's context
    bucket: the length runs from half of it to all of it). From the H200 sweeps (10 layers
    per CUDA graph; bench/results/attn_bucket_h200_run1.json): bucket 8K 128 (13.7-14.8
    us a layer against 17.6-18.6 at 256), 32K 256, 64K 512 (31.1-43.2 us against 43.8-48.2
    at 1024), beyond 1024 (bucket 128K: 512 wins by 1.4 us at 66K rows, loses by 11 at
    131K; 85% of copy there); 64 up to 4K (run 1)."""
    if max_len <= 4096:
        return 64
    if max_len <= 16384:
        return 128
    if max_len <= 32768:
        return 256
    return 512 if max_len <= 65536 else 1024


def decode_block_n(arch: Arch, elem_bytes: int = 2) -> int:
    """Keys a step of the decode kernel: 64 (74 KiB of shared memory at Dh 256 in bf16, on
    every arch); with an fp32 cache 148 KiB, more than 99 KiB GPUs have: 32 there (82)."""
    return 32 if elem_bytes > 2 and not arch.big_smem else 64


def decode_plan(
    max_len: int,
    arch: Arch = DEFAULT,
    split_threshold: int = 256,
    split: int | None = None,
    block_n: int | None = None,
    elem_bytes: int = 2,
) -> tuple[int, int, int]:
    """(rows per split block, 0 for the plain variant; key tile; split blocks) of a graph
    built for ``max_len`` rows. The compile matrix scans it over every context length."""
    block_n = block_n or decode_block_n(arch, elem_bytes)
    if split is None:
        split = default_split(max_len) if max_len >= split_threshold else 0
    if 16 <= split < block_n:
        block_n = split  # small blocks (tests) take a smaller tile
    return split, block_n, cdiv(max_len, split) if split else 1


def attention_decode(
    qg: Tensor,
    k: Tensor,
    v: Tensor,
    q_norm: Tensor,
    k_norm: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    pos: Tensor,
    inv_freq: Tensor,
    eps: float = 1e-6,
    *,
    max_len: int | None = None,
    split_threshold: int = 256,
    split: int | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
) -> Tensor:
    """Gated attention of one token at position ``pos`` (MODEL.md); writes K/V at ``pos``.

    qg (H*2*Dh,): per head Dh query then Dh gate; k, v (Hkv*Dh,); q_norm, k_norm (Dh,)
    (multipliers); k_cache, v_cache (Hkv, T_max, Dh), rows [0, pos) already filled; pos a
    one-element int device tensor; inv_freq (R/2,) fp32 from ``rope_inv_freq``. A leading
    batch dim of 1 is allowed on qg, k, v. ``max_len`` bounds pos+1 (default T_max; keep it
    fixed within a captured graph): at or above ``split_threshold`` the split-KV variant runs
    with blocks of ``split`` rows (default ``default_split(max_len)``; 0 forces the plain
    variant, which was slower than split-KV from 256 context on in the H200 sweep); keys a
    step ``block_n`` (default ``decode_block_n`` of the arch and cache dtype). Returns
    (H*Dh,) in qg's dtype.

    NOTE: no programmatic dependent launch here: with it (the kernels and the output
    projection after them launched early) the decode step was slower at every context
    (H200: 4K 1.467 -> 1.487 ms, 32K 1.641 -> 1.703, 128K 2.074 -> 2.171;
    bench/results/decode_timeline_h200_run2.json): the next kernel's early programs take
    the SM slots this kernel's many split blocks need.
    """
    _check(
        k_cache.dim() == 3
        and k_cache.shape == v_cache.shape
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and k_cache.dtype == v_cache.dtype,
        f"k_cache and v_cache must be contiguous (Hkv, T_max, Dh) of one dtype, got "
        f"{tuple(k_cache.shape)} {k_cache.dtype} and {tuple(v_cache.shape)} {v_cache.dtype}",
    )
    hkv, t_max, dh = k_cache.shape
    lead = qg.shape[:-1]
    _check(lead in ((), (1,)), f"one token expected, qg has shape {tuple(qg.shape)}")
    _check(
        qg.shape[-1] % (2 * dh) == 0 and qg.is_contiguous(),
        f"qg must be contiguous (H*2*{dh},), got {tuple(qg.shape)}",
    )
    h = qg.shape[-1] // (2 * dh)
    _check(h % hkv == 0, f"{h} query heads do not group over {hkv} KV heads")
    for name, x in (("k", k), ("v", v)):
        _check(
            x.numel() == hkv * dh and x.is_contiguous(),
            f"{name} must be contiguous ({hkv * dh},), got {tuple(x.shape)}",
        )
    for name, x in (("q_norm", q_norm), ("k_norm", k_norm)):
        _check(x.shape == (dh,), f"{name} must be ({dh},), got {tuple(x.shape)}")
    _check(
        pos.numel() == 1 and not pos.dtype.is_floating_point,
        f"pos must be a one-element integer tensor, got {tuple(pos.shape)} {pos.dtype}",
    )
    _check(
        inv_freq.dim() == 1 and inv_freq.dtype == torch.float32 and 2 * inv_freq.numel() <= dh,
        f"inv_freq must be fp32 (R/2,) with R <= {dh}, got {tuple(inv_freq.shape)}",
    )
    tensors = (qg, k, v, q_norm, k_norm, k_cache, v_cache, pos, inv_freq)
    _check(all(x.device == k_cache.device for x in tensors), "all tensors must be on one device")
    max_len = t_max if max_len is None else min(max_len, t_max)
    split, block_n, nb = decode_plan(max_len, current_arch(qg.device), split_threshold, split,
                                     block_n, k_cache.element_size())  # fmt: skip
    _check(
        split == 0 or split % block_n == 0,
        f"split must be 0 or a multiple of block_n={block_n}, got {split}",
    )

    out = torch.empty(*lead, h * dh, dtype=qg.dtype, device=qg.device)
    g = h // hkv
    gp = max(16, pow2(g))
    sm_scale = dh**-0.5 * LOG2E
    if split:
        o_part = torch.empty(hkv, nb, g, dh, dtype=torch.float32, device=qg.device)
        lse_part = torch.empty(hkv, nb, g, dtype=torch.float32, device=qg.device)
    else:
        o_part = lse_part = out  # unused
    _attn_decode_kernel[(hkv, nb)](
        qg,
        k,
        v,
        q_norm,
        k_norm,
        inv_freq,
        k_cache,
        v_cache,
        pos,
        out,
        o_part,
        lse_part,
        eps,
        sm_scale,
        t_max,
        nb,
        split,
        pos,  # (kv_tab: unused)
        0,
        0,
        0,
        H=h,
        HKV=hkv,
        DH=dh,
        R=2 * inv_freq.numel(),
        GP=gp,
        BD=pow2(dh),
        BN=block_n,
        IS_SPLIT=split > 0,
        ROWS=False,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if split:
        bdc = min(64, pow2(dh))
        _attn_combine_kernel[(h, cdiv(dh, bdc))](
            qg,
            pos,
            o_part,
            lse_part,
            out,
            nb,
            split,
            0,
            H=h,
            HKV=hkv,
            DH=dh,
            BB=min(64, pow2(nb)),
            BDC=bdc,
            ROWS=False,
            num_warps=4,
        )
    return out


def kv_table(caches: list[tuple[Tensor, Tensor]], device: torch.device | str) -> Tensor:
    """The (B, 3) int64 table ``attention_decode_rows`` reads: per row its K cache's and V
    cache's addresses and their capacity (rows of (Hkv, capacity, Dh))."""
    rows = [[table_address(kc, "kv_table"), table_address(vc, "kv_table"), kc.shape[1]]
            for kc, vc in caches]  # fmt: skip
    return torch.tensor(rows, dtype=torch.int64, device=device)


def attention_decode_rows(
    qg: Tensor,
    k: Tensor,
    v: Tensor,
    q_norm: Tensor,
    k_norm: Tensor,
    kv_tab: Tensor,
    cache_like: Tensor,
    pos: Tensor,
    inv_freq: Tensor,
    eps: float = 1e-6,
    *,
    max_len: int,
    split_threshold: int = 256,
    split: int | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
) -> Tensor:
    """``attention_decode`` for one token of each of B sequences in one launch: row b of qg
    (B, H*2*Dh), k, v (B, Hkv*Dh) (rows may be strided, columns contiguous: views of a
    fused projection) at position ``pos[b]`` over its own caches, named by ``kv_tab``
    (``kv_table``: the caches may differ in capacity and live anywhere); ``cache_like`` a
    tensor of the caches' dtype with their (Hkv, *, Dh) shape. ``max_len`` bounds every
    row's pos+1 (the split grid: keep it fixed within a captured graph). Returns (B, H*Dh).
    """
    _check(cache_like.dim() == 3, f"cache_like must be (Hkv, *, Dh), got {tuple(cache_like.shape)}")
    hkv, _, dh = cache_like.shape
    _check(qg.dim() == 2 and qg.stride(1) == 1, f"qg must be (B, H*2*{dh}) with contiguous "
           f"rows, got {tuple(qg.shape)} strides {qg.stride()}")  # fmt: skip
    nrows = qg.shape[0]
    _check(qg.shape[1] % (2 * dh) == 0, f"qg rows must be H*2*{dh} wide, got {qg.shape[1]}")
    h = qg.shape[1] // (2 * dh)
    _check(h % hkv == 0, f"{h} query heads do not group over {hkv} KV heads")
    for name, x in (("k", k), ("v", v)):
        _check(
            x.shape == (nrows, hkv * dh) and x.stride(1) == 1,
            f"{name} must be ({nrows}, {hkv * dh}) with contiguous rows, got {tuple(x.shape)}",
        )
    for name, x in (("q_norm", q_norm), ("k_norm", k_norm)):
        _check(x.shape == (dh,), f"{name} must be ({dh},), got {tuple(x.shape)}")
    _check(
        kv_tab.shape == (nrows, 3) and kv_tab.dtype == torch.int64 and kv_tab.is_contiguous(),
        f"kv_tab must be a contiguous ({nrows}, 3) int64 table, got {tuple(kv_tab.shape)} "
        f"{kv_tab.dtype}",
    )
    _check(
        pos.shape == (nrows,) and not pos.dtype.is_floating_point and pos.is_contiguous(),
        f"pos must be ({nrows},) integers, got {tuple(pos.shape)} {pos.dtype}",
    )
    _check(
        inv_freq.dim() == 1 and inv_freq.dtype == torch.float32 and 2 * inv_freq.numel() <= dh,
        f"inv_freq must be fp32 (R/2,) with R <= {dh}, got {tuple(inv_freq.shape)}",
    )
    tensors = (qg, k, v, q_norm, k_norm, kv_tab, pos, inv_freq)
    _check(all(x.device == qg.device for x in tensors), "all tensors must be on one device")
    _check(max_len >= 1, f"max_len must be >= 1, got {max_len}")
    # (the key tile as one sequence's: by the arch and the caches' element size)
    split, block_n, nb = decode_plan(max_len, current_arch(qg.device), split_threshold, split,
                                     block_n, cache_like.element_size())  # fmt: skip
    _check(
        split == 0 or split % block_n == 0,
        f"split must be 0 or a multiple of block_n={block_n}, got {split}",
    )
    out = torch.empty(nrows, h * dh, dtype=qg.dtype, device=qg.device)
    g = h // hkv
    if split:
        o_part = torch.empty(nrows, hkv, nb, g, dh, dtype=torch.float32, device=qg.device)
        lse_part = torch.empty(nrows, hkv, nb, g, dtype=torch.float32, device=qg.device)
    else:
        o_part = lse_part = out  # unused
    _attn_decode_kernel[(hkv, nb, nrows)](
        qg, k, v, q_norm, k_norm, inv_freq, cache_like, cache_like, pos, out, o_part, lse_part,
        eps, dh**-0.5 * LOG2E, max_len, nb, split, kv_tab, qg.stride(0), k.stride(0),
        v.stride(0), H=h, HKV=hkv, DH=dh, R=2 * inv_freq.numel(), GP=max(16, pow2(g)),
        BD=pow2(dh), BN=block_n, IS_SPLIT=split > 0, ROWS=True, num_warps=num_warps,
        num_stages=num_stages,
    )  # fmt: skip
    if split:
        bdc = min(64, pow2(dh))
        _attn_combine_kernel[(h, cdiv(dh, bdc), nrows)](
            qg, pos, o_part, lse_part, out, nb, split, qg.stride(0), H=h, HKV=hkv, DH=dh,
            BB=min(64, pow2(nb)), BDC=bdc, ROWS=True, num_warps=4,
        )  # fmt: skip
    return out
