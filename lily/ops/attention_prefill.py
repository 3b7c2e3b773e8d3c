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
``start`` may be a Python int or a one-element device tensor. With a ``table`` the caches'
addresses and capacity are read on the device too (a captured graph then serves any state).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lily.ops.launch import cdiv, check, launched, pow2, table_pointer
from lily.ops.norm_rope import rms_rope_rows, sigmoid

Tensor = torch.Tensor

LOG2E = 1.4426950408889634


@triton.jit
def _table_caches(p_tab, k_cache, v_cache):
    """The caches' addresses and capacity from a table (int64: K, V, T_max)."""
    k_cache = table_pointer(p_tab, 0, k_cache)
    v_cache = table_pointer(p_tab, 1, v_cache)
    return k_cache, v_cache, tl.load(p_tab + 2).to(tl.int32)


@launched
@triton.jit
def _prep_kernel(
    qg, k, v, q_norm, k_norm, inv_freq, p_start, q_buf, k_cache, v_cache, T, T_MAX, stride_qg,
    stride_k, stride_v, eps, p_tab, H: tl.constexpr, HKV: tl.constexpr, DH: tl.constexpr,
    R: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, START_PTR: tl.constexpr,
    TAB: tl.constexpr,
):  # fmt: skip
    i_t, i_g = tl.program_id(0), tl.program_id(1)
    if TAB:
        k_cache, v_cache, T_MAX = _table_caches(p_tab, k_cache, v_cache)
    if START_PTR:  # a device position (graph-safe); else the host's int
        start = tl.load(p_start).to(tl.int32)
    else:
        start = p_start
    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < T
    o_d = tl.arange(0, BD)
    # NOTE: rows past the cache (padding of a graph's chunk, or a device start too large: a
    # caller's bug) write no K/V; their queries are written all the same, so that such rows
    # stay finite (a padding row's value reaches the next DeltaNet layer, whose products
    # multiply it by 0: a NaN there would spread to the token rows)
    m_tq = m_t[:, None] & (o_d < DH)[None, :]
    m_td = m_tq & (start + o_t < T_MAX)[:, None]
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
            mask=m_tq,
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
    n_split, p_tab, H: tl.constexpr, HKV: tl.constexpr, DH: tl.constexpr, BM: tl.constexpr,
    BN: tl.constexpr, BD: tl.constexpr, IS_SPLIT: tl.constexpr, START_PTR: tl.constexpr,
    TAB: tl.constexpr,
):  # fmt: skip
    i_m, i_kvh, i_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if TAB:
        k_cache, v_cache, T_MAX = _table_caches(p_tab, k_cache, v_cache)
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


SMEM_PER_SM = 227 * 1024  # usable shared memory of an SM (H100/H200)


def flash_per_sm(block_m: int, block_n: int, dh: int, warps: int, stages: int, cache) -> int:
    """Flash programs resident on one SM: shared memory holds the Q tile and ``stages``
    K and V tiles; the kernel takes nearly all 255 registers a thread, so 8 warps an SM
    by registers. At Dh 256 (sm_90, compiled): 64 x 32 at 4 warps 96 KB (2 an SM), 128 x 32
    at 8 warps 128 KB (1 an SM)."""
    e = cache.element_size()
    smem = block_m * dh * e + stages * 2 * block_n * dh * e
    return max(1, min(SMEM_PER_SM // smem, 8 // warps))


PART_BYTES = 128 * 2**20  # cap on the split partials of one call (fp32, all shares)
# a captured graph's call (table mode) keeps its partials in the graph pool for good: a
# tighter cap (the splits that chunks of 384-1,024 tokens choose fit it)
TABLE_PART_BYTES = 32 * 2**20


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
    # 128 query rows x 64 keys on 8 warps (two warpgroups): faster than 64 x 32 on 4 warps
    # at every chunk and history measured, 3-8% (H200, bench/results/attn_tiles_all_h200.json)
    block_m: int = 128,
    block_n: int = 64,
    num_warps: int = 8,
    num_stages: int = 2,
    split: int | None = None,
    context: int | None = None,
    table: Tensor | None = None,
) -> Tensor:
    """Gated causal attention of T tokens at positions [start, start+T) (MODEL.md).

    qg (T, H*2*Dh): per head Dh query then Dh gate; k, v (T, Hkv*Dh); q_norm, k_norm (Dh,)
    (multipliers); k_cache, v_cache (Hkv, T_max, Dh) with rows [0, start) filled, rows
    [start, start+T) written here; start an int or one-element int device tensor (rows past
    T_max are then not written); inv_freq (R/2,) fp32 from ``rope_inv_freq``.
    Returns (T, H*Dh) in qg's dtype. ``split``: key splits (partials merged by a second
    kernel); by default ``flash_split`` picks them when start is an int, or, with a device
    start, for ``context // 2`` keys when ``context`` (the most keys a row may see: a
    graph's bound) is given, else 1.

    ``table``: a (3,) int64 device tensor holding K's and V's addresses and their T_max,
    read by the kernels instead of the caches' (a graph captured once serves any state);
    k_cache and v_cache then give only the dtype, Hkv and Dh (any T_max, any strides).
    NOTE: the caches the table names must be contiguous (Hkv, T_max, Dh) of that dtype.
    """
    _check(
        k_cache.dim() == 3
        and k_cache.shape == v_cache.shape
        and (table is not None or (k_cache.is_contiguous() and v_cache.is_contiguous()))
        and k_cache.dtype == v_cache.dtype,
        lambda: (
            f"k_cache and v_cache must be contiguous (Hkv, T_max, Dh) of one dtype, got "
            f"{tuple(k_cache.shape)} {k_cache.dtype} and {tuple(v_cache.shape)} {v_cache.dtype}"
        ),
    )
    if table is not None:
        _check(
            table.shape == (3,) and table.dtype == torch.int64 and table.device == k_cache.device,
            lambda: (
                f"table must be a (3,) int64 tensor on {k_cache.device}, got "
                f"{tuple(table.shape)} {table.dtype} on {table.device}"
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
    keys = None  # the keys the split is chosen for
    if isinstance(start, int):
        _check(
            0 <= start and (table is not None or start + t <= t_max),
            lambda: f"positions [{start}, {start + t}) do not fit a cache of {t_max}",
        )
        keys = start + t
        # NOTE: an int start goes to the kernels as an argument: a device copy of it cost
        # each attention layer a host tensor, a pinned copy and a transfer.
        start_ptr = False
    else:
        _check(
            start.numel() == 1 and not start.dtype.is_floating_point,
            lambda: f"start must be an int or a one-element integer tensor, got {start.dtype}",
        )
        start_ptr = True
        if context is not None:
            keys = max(t, context // 2)
    if split is None and keys is not None and qg.is_cuda:
        n_sm = torch.cuda.get_device_properties(qg.device).multi_processor_count
        per_sm = flash_per_sm(block_m, block_n, dh, num_warps, num_stages, k_cache)
        cap = max(1, (PART_BYTES if table is None else TABLE_PART_BYTES) // (t * h * dh * 4))
        split = flash_split(q_blocks * hkv, keys, n_sm * per_sm, block_n, min(16, cap))
    split = split or 1
    _check(split >= 1, lambda: f"split must be >= 1, got {split}")
    tensors = [qg, k, v, q_norm, k_norm, k_cache, v_cache, inv_freq] + [start] * start_ptr
    _check(all(x.device == k_cache.device for x in tensors), "all tensors must be on one device")
    tab = table if table is not None else k_cache  # (the kernels ignore it without TAB)

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
        tab,
        H=h,
        HKV=hkv,
        DH=dh,
        R=2 * inv_freq.numel(),
        BT=bt,
        BD=bd,
        START_PTR=start_ptr,
        TAB=table is not None,
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
        dh**-0.5 * LOG2E, split, tab, H=h, HKV=hkv, DH=dh, BM=block_m, BN=block_n, BD=bd,
        IS_SPLIT=split > 1, START_PTR=start_ptr, TAB=table is not None, num_warps=num_warps,
        num_stages=num_stages,
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
