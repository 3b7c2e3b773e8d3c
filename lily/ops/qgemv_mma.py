"""Tensor-core GEMV for decode: ``x @ w.T`` for one row against MLX-packed 4-bit weights.

The FMA GEMV (qgemv.py) spends ~3.7 instructions a code, most of the SM's issue budget at
full bandwidth. Here the tensor cores take the products and the unpacking is one LOP3 per
two codes (see docs/notes/linear_kernels.md, "Tensor-core GEMV"):

* no int -> float conversion: ``((word >> 4m) & 0x000F000F) | 0x43004300`` is a pair of bf16
  values ``128 + q`` (exact, 128..143) for codes m and m + 4 of the word, already packed the
  way an MMA operand register holds two bf16 values (the split into two bf16 is a register
  view, no instruction);
* per group of 64, ``D = sum_k (128 + q_k) x_k`` on the tensor cores (mma.sync m16n8k16,
  A = the unpacked codes from registers, B = x in the 8 columns, fp32 accumulation); then
  ``sum_k w_k x_k = s * D + (b - 128 s) * sum_k x_k`` in fp32;
* the order of codes along K inside a group is whatever lets every lane's words feed its
  MMA fragment directly (a lane holds whole words); x is loaded in the same order.

Grid: one program per BLOCK_N rows; its W warps split the K groups (a batched dot, one batch
per group, warps on the batch axis), each warp unpacks and multiplies its groups, and the W
partial rows are summed at the end. One shot: all weight loads are issued before any
arithmetic. x (rmsnorm'ed when ``norm_weight`` is given) is prepared once per program and
reaches the warps' MMA fragments through shared memory. fp16/fp32 x are split into 2 or 3
bf16 terms (in the B columns), so the products stay exact for every input dtype.

Only T = 1, 4-bit weights (groups of 32, 64 or 128); everything else is qgemv's.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from lily.ops.launch import cdiv, check_weight, check_x, launched, pdl_launch, pow2, use_pdl
from lily.ops.qgemv import pdl_wait
from lily.ops.rmsnorm import cast_to, check_norm, norm_x, to_bf16
from lily.quant import QuantWeight

Tensor = torch.Tensor

PAIR_MASK = 0x000F000F  # code m of both 16-bit halves; a run-time argument (one LOP3)
X_TERMS = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3}  # bf16 terms that hold x
_SMS = 132  # H200; only the tile table uses it


@triton.jit
def _bf16_pairs(p, ON_CPU: tl.constexpr):
    """int32 (...) holding two bf16 bit patterns -> (..., 2): [low half, high half].

    GPU: bf16 through an inline-asm copy of the word that Triton packs as two 16-bit
    elements (pack=2; the second input, the same word, is unused), so the MMA operand is the
    LOP3's register itself. Splitting it into two 16-bit halves instead (``mov.b32 {$0, $1}``)
    cost ~80 register moves a thread: ptxas did not place the halves straight into the
    MMA's operand registers. CPU: fp32 (the interpreter has no inline asm and multiplies
    bf16 dot operands as integers)."""
    if ON_CPU:
        lo = (p << 16).to(tl.float32, bitcast=True)
        return tl.join(lo, (p & -65536).to(tl.float32, bitcast=True))
    return tl.inline_asm_elementwise(
        "mov.b32 $0, $1;",
        "=r,r,r",
        [tl.join(p, p)],
        dtype=tl.bfloat16,
        is_pure=True,
        pack=2,
    )


@triton.jit
def _first(a, b):
    return a


@triton.jit
def _as_term(t, ON_CPU: tl.constexpr):
    # A bf16-exact fp32 value as the MMA's B element type (fp32 on the CPU, see _bf16_pairs).
    if ON_CPU:
        return t
    return t.to(tl.bfloat16)


as_term = _as_term  # its public name for other modules' kernels


@triton.jit
def mma_tile(
    p_qw, p_s, p_b, p_ids, row0, N, stride_qn, stride_sn, stride_we, stride_se,
    GROUP: tl.constexpr, NG: tl.constexpr, G: tl.constexpr, BLOCK_N: tl.constexpr,
    W: tl.constexpr, SG: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
):  # fmt: skip
    """Loads one program's weights, rows row0.. (BLOCK_N of N) x the G groups of K, for
    ``mma_dot``: (words (G, BLOCK_N, 4, WPL), scales, biases (raw, in the load's layout)).

    ``SG > 0``: K is slots of SG groups, slot j's rows are those of expert ``p_ids[j]`` (a
    stride_we / stride_se apart): the MoE's down projection over its chosen experts as one
    K (NG = slots * SG). Groups past NG read a real group again; their scales and biases
    are 0."""
    WPL: tl.constexpr = GROUP // 32  # words a lane holds of a row and group
    GH: tl.constexpr = G // W  # groups a warp takes
    NH: tl.constexpr = BLOCK_N // 8
    WPG: tl.constexpr = GROUP // 8  # words a group
    # MMA batch b = gh * W + gw runs in warp gw and holds group gw * GH + gh (a warp's groups
    # are contiguous). A lane (c = lane % 4, lo = lane // 4) of a row block of 16 holds rows
    # lo and lo + 8 and words WPL*c.. of each group. Loaded as dims (c, lo, gw, hi, gh, v):
    # Triton's coalescer orders dims of equal contiguity by index, which gives lanes to
    # (c, lo), warps to gw and registers to (hi, gh, v) -- the MMA operand layout, so the
    # unpacked codes feed the tensor cores without a shuffle (SASS-checked).
    o_c = tl.arange(0, 4)[:, None, None, None, None, None]
    o_lo = tl.arange(0, 8)[None, :, None, None, None, None]
    o_gw = tl.arange(0, W)[None, None, :, None, None, None]
    o_hi = tl.arange(0, NH)[None, None, None, :, None, None]
    o_gh = tl.arange(0, GH)[None, None, None, None, :, None]
    o_v = tl.arange(0, WPL)[None, None, None, None, None, :]
    r = row0 + o_hi * 8 + o_lo
    if SG > 0:
        # NOTE: the expert's offset is a multiple of WPG words (stride_we is whole groups);
        # the hint keeps the words' vector loads (see below).
        g = tl.minimum(o_gw * GH + o_gh, NG - 1)
        e = tl.load(p_ids + g // SG).to(tl.int64)
        o_g = tl.multiple_of(e * stride_we + (g % SG) * WPG, (WPG, WPG, WPG, WPG, WPG, WPG))
    else:
        o_g = (o_gw * GH + o_gh) * WPG
        if not EVEN_K:
            # Groups past NG (K padded to G groups) read group NG - 1 again (cache hits;
            # their scales and biases are 0). A mask along groups, or the clamp without the
            # alignment hint, costs the vector loads and with them the operand layout (A
            # then went through 128 KB of shared memory).
            o_g = tl.multiple_of(tl.minimum(o_g, (NG - 1) * WPG),
                                 (WPG, WPG, WPG, WPG, WPG, WPG))  # fmt: skip
    if WPL == 1:
        # one word a lane: c would be contiguous and get vectorized into one thread
        o_c = (o_c * 2) // 2
    o_w = o_g + WPL * o_c + o_v
    # NOTE: rows start on 16 bytes (checked by the launcher); Triton knows it only when the
    # stride is a multiple of 16, and without it the words are not vector-loaded.
    o_r = tl.multiple_of(r * stride_qn, (4, 4, 4, 4, 4, 4))
    if EVEN_N:
        b_w = tl.load(p_qw + o_r + o_w)
    else:
        b_w = tl.load(p_qw + o_r + o_w, mask=r < N, other=0)
    b_w = tl.reshape(tl.permute(b_w, (4, 2, 3, 1, 0, 5)), (G, BLOCK_N, 4, WPL))
    # Scales and biases in the layout of the MMA result (G, BLOCK_N, 4): the c axis is a
    # broadcast (the four lanes of a row hold the same D); gh is contiguous (vector loads).
    q_c = tl.arange(0, 4)[:, None, None, None, None] * 0
    q_lo = tl.arange(0, 8)[None, :, None, None, None]
    q_gw = tl.arange(0, W)[None, None, :, None, None]
    q_hi = tl.arange(0, NH)[None, None, None, :, None]
    q_gh = tl.arange(0, GH)[None, None, None, None, :]
    r_sb = row0 + q_hi * 8 + q_lo + q_c
    g_sb = q_gw * GH + q_gh
    if SG > 0:
        e_sb = tl.load(p_ids + tl.minimum(g_sb, NG - 1) // SG).to(tl.int64)
        p_sb = e_sb * stride_se + r_sb * stride_sn + g_sb % SG
    else:
        p_sb = r_sb * stride_sn + g_sb
    if EVEN_N and EVEN_K:
        b_s = tl.load(p_s + p_sb)
        b_b = tl.load(p_b + p_sb)
    else:
        m_sb = (r_sb < N) & (g_sb < NG)
        b_s = tl.load(p_s + p_sb, mask=m_sb, other=0.0)
        b_b = tl.load(p_b + p_sb, mask=m_sb, other=0.0)
    return b_w, b_s, b_b


@triton.jit
def mma_x_row(p_x, p_nw, eps, NG: tl.constexpr, G: tl.constexpr, GROUP: tl.constexpr,
              HAS_NORM: tl.constexpr, EVEN_K: tl.constexpr, ON_CPU: tl.constexpr):  # fmt: skip
    """The row x (NG groups, padded to G with zeros) as fp32 in memory order, rmsnorm'ed
    (rounded to x's dtype, as ``rms_norm`` returns it) with ``HAS_NORM``."""
    o_k = tl.arange(0, G * GROUP)
    m_k = o_k < NG * GROUP
    if EVEN_K:
        b_x = tl.load(p_x + o_k)
    else:
        b_x = tl.load(p_x + o_k, mask=m_k, other=0.0)
    if HAS_NORM:
        b_nw = tl.load(p_nw + o_k, mask=m_k, other=0.0)
        b_xf = b_x.to(tl.float32)
        rstd = 1.0 / tl.sqrt_rn(tl.sum(b_xf * b_xf, axis=0) / (NG * GROUP) + eps)
        return norm_x(b_x, b_nw, rstd, True, ON_CPU)
    return b_x.to(tl.float32)


@triton.jit
def mma_x(b_xn, G: tl.constexpr, GROUP: tl.constexpr, W: tl.constexpr, TERMS: tl.constexpr,
          ON_CPU: tl.constexpr):  # fmt: skip
    """fp32 x (G * GROUP,) in memory order -> (the MMA's B operand (G, GROUP, 8) in the
    codes' K order, the per-group sums (G,)): x's values held exactly in TERMS bf16 terms."""
    WPL: tl.constexpr = GROUP // 32
    GH: tl.constexpr = G // W
    # (groups in memory order) -> (batches): group gw * GH + gh is batch gh * W + gw.
    b_xn = tl.reshape(tl.permute(tl.reshape(b_xn, (W, GH, GROUP)), (1, 0, 2)), (G, GROUP))
    b_xs = tl.sum(b_xn, axis=1)
    # Inside a group, code 8 (WPL c + v) + 4 e + 2 m1 + m0 is the MMA's k = 16 (2 v + m1) +
    # 4 c + 2 m0 + e: the lane with c holds words WPL c.., each 32-bit operand register is
    # the pair (m, m + 4) of one word.
    b_xn = tl.reshape(tl.permute(tl.reshape(b_xn, (G, 4, WPL, 2, 2, 2)), (0, 2, 4, 1, 5, 3)),
                      (G, GROUP))  # fmt: skip
    if TERMS == 1:
        b_xb = tl.broadcast_to(_as_term(b_xn, ON_CPU)[:, :, None], (G, GROUP, 8))
    else:
        x_hi = to_bf16(b_xn, ON_CPU).to(tl.float32)
        x_r = b_xn - x_hi  # exact
        if TERMS == 2:  # fp16 x: 11 bits in two bf16 terms; columns (hi, lo) x 4
            b_t = tl.join(_as_term(x_hi, ON_CPU), _as_term(x_r, ON_CPU))
            b_xb = tl.reshape(tl.broadcast_to(b_t[:, :, None, :], (G, GROUP, 4, 2)),
                              (G, GROUP, 8))  # fmt: skip
        else:  # fp32 x: 24 bits in three terms; columns (hi, mid, lo, 0) x 2
            x_mid = to_bf16(x_r, ON_CPU).to(tl.float32)
            x_lo = x_r - x_mid
            b_t = tl.join(
                tl.join(_as_term(x_hi, ON_CPU), _as_term(x_mid, ON_CPU)),
                tl.join(_as_term(x_lo, ON_CPU), _as_term(x_lo * 0.0, ON_CPU)),
            )
            b_t = tl.reshape(b_t, (G, GROUP, 4))
            b_xb = tl.reshape(tl.broadcast_to(b_t[:, :, None, :], (G, GROUP, 2, 4)),
                              (G, GROUP, 8))  # fmt: skip
    return b_xb, b_xs


@triton.jit
def mma_codes(b_w, pair_mask, G: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr,
              ON_CPU: tl.constexpr):  # fmt: skip
    """``mma_tile``'s words -> the MMA's A operand (G, BLOCK_N, GROUP): bf16 ``128 + q`` of
    every code, in the K order ``mma_x`` gives x (one LOP3 a pair of codes)."""
    # Pair m of a word holds codes m (low half) and m + 4 (high half).
    e0 = _bf16_pairs((b_w & pair_mask) | 0x43004300, ON_CPU)
    e1 = _bf16_pairs(((b_w >> 4) & pair_mask) | 0x43004300, ON_CPU)
    e2 = _bf16_pairs(((b_w >> 8) & pair_mask) | 0x43004300, ON_CPU)
    e3 = _bf16_pairs(((b_w >> 12) & pair_mask) | 0x43004300, ON_CPU)
    b_a = tl.join(tl.join(e0, e1), tl.join(e2, e3))
    # (G, BN, c, v, e, m0, m1) -> (G, BN, v, m1, c, m0, e): K order as in mma_x
    return tl.reshape(tl.permute(b_a, (0, 1, 3, 6, 2, 5, 4)), (G, BLOCK_N, GROUP))


@triton.jit
def mma_dot(b_w, b_s, b_b, b_xb, b_xs, pair_mask, G: tl.constexpr, BLOCK_N: tl.constexpr,
            W: tl.constexpr, TERMS: tl.constexpr, ON_CPU: tl.constexpr):  # fmt: skip
    """fp32 (BLOCK_N,) = the tile's rows times x, from ``mma_tile``'s and ``mma_x``'s
    results."""
    GROUP: tl.constexpr = b_xb.shape[1]
    GH: tl.constexpr = G // W
    b_a = mma_codes(b_w, pair_mask, G, BLOCK_N, GROUP, ON_CPU)
    b_d = tl.dot(b_a, b_xb, input_precision="ieee")  # (G, BLOCK_N, 8) fp32

    # Lane c holds columns 2c, 2c + 1: the same D in every lane (one term), (hi, lo) (two),
    # (hi, mid) or (lo, 0) (three: the four lanes sum to 2 D).
    d_e, d_o = tl.split(tl.reshape(b_d, (G, BLOCK_N, 4, 2)))
    b_dd = d_e if TERMS == 1 else d_e + d_o
    b_s = tl.reshape(tl.permute(b_s, (4, 2, 3, 1, 0)), (G, BLOCK_N, 4)).to(tl.float32)
    b_b = tl.reshape(tl.permute(b_b, (4, 2, 3, 1, 0)), (G, BLOCK_N, 4)).to(tl.float32)
    XS: tl.constexpr = 0.5 if TERMS == 3 else 1.0
    b_xs3 = (b_xs * XS)[:, None, None]
    b_t = b_s * b_dd + (b_b - 128.0 * b_s) * b_xs3
    b_t = tl.sum(tl.reshape(b_t, (GH, W, BLOCK_N, 4)), axis=0)  # a lane's groups
    if TERMS == 3:
        b_t = tl.sum(b_t, axis=2) * 0.5
    else:
        b_t = tl.reduce(b_t, 2, _first)  # the four lanes agree: no shuffles
    return tl.sum(b_t, axis=0)  # the warps' shares of K


@launched
@triton.jit
def _qgemv_mma_kernel(
    p_x, p_qw, p_s, p_b, p_nw, p_res, p_out, N, stride_qn, stride_sn, pair_mask, eps,
    GROUP: tl.constexpr, NG: tl.constexpr, G: tl.constexpr, BLOCK_N: tl.constexpr,
    W: tl.constexpr, TERMS: tl.constexpr, HAS_NORM: tl.constexpr, HAS_RES: tl.constexpr,
    EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, ON_CPU: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    i_n = tl.program_id(0)
    b_w, b_s, b_b = mma_tile(p_qw, p_s, p_b, p_qw, i_n * BLOCK_N, N, stride_qn, stride_sn, 0, 0,
                             GROUP, NG, G, BLOCK_N, W, 0, EVEN_N, EVEN_K)  # fmt: skip
    # Everything above reads only constants; x and the residual may be the previous kernel's.
    pdl_wait(PDL)
    b_xn = mma_x_row(p_x, p_nw, eps, NG, G, GROUP, HAS_NORM, EVEN_K, ON_CPU)
    b_xb, b_xs = mma_x(b_xn, G, GROUP, W, TERMS, ON_CPU)
    acc = mma_dot(b_w, b_s, b_b, b_xb, b_xs, pair_mask, G, BLOCK_N, W, TERMS, ON_CPU)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    if HAS_RES:
        acc += tl.load(p_res + o_n, mask=m_n, other=0.0).to(tl.float32)
    tl.store(p_out + o_n, cast_to(acc, p_out.dtype.element_ty, ON_CPU), mask=m_n)


@dataclass(frozen=True)
class MmaGemvConfig:
    """One program: BLOCK_N rows (16, 32 or 64: one to four MMA row tiles a warp), its warps
    (they split the K groups between them) and a register cap (``maxnreg``, None: ptxas's
    choice) that decides how many programs share an SM."""

    block_n: int
    num_warps: int
    maxnreg: int | None = None

    def __post_init__(self) -> None:
        if self.block_n not in (16, 32, 64):
            raise ValueError(f"MmaGemvConfig.block_n must be 16, 32 or 64, got {self.block_n}")
        w = self.num_warps
        if w < 1 or w > 16 or w & (w - 1):
            raise ValueError(f"MmaGemvConfig.num_warps must be a power of two <= 16, got {w}")


@functools.lru_cache(maxsize=1024)  # tiles are pure functions of the shape
def mma_gemv_config(n: int, k: int, group_size: int) -> MmaGemvConfig:
    """Tile for a shape (a stand-in for a measured table; see the notes).

    A warp takes 32 words a lane (for groups of 64: 4 groups of two 16-row tiles), so
    K = 2048 is 8 warps and K = 4096 16; 32 rows a program where that gives 1.5 programs an
    SM or more (132 SMs), else 16. Past two programs an SM (264 at 256 threads) the program
    is capped at 80 registers so that three share an SM: 12,352 rows (386 programs) then run
    in one wave (ptxas takes 89 with the norm prologue: two an SM, 1.46 waves)."""
    groups = pow2(k // group_size)
    warps = min(16, max(1, groups * (group_size // 32) // 8), groups)
    block_n = 32 if -(-n // 32) >= 192 else 16
    cap = warps == 8 and -(-n // block_n) > 2 * _SMS
    return MmaGemvConfig(block_n, warps, 80 if cap else None)


def mma_supports(w: QuantWeight) -> bool:
    """Whether ``qgemv_mma`` takes this weight: 4 bits, rows on 16-byte boundaries (the
    words load straight into the MMA's registers, four at a time)."""
    return w.bits == 4 and w.qweight.stride(0) % 4 == 0 and w.qweight.data_ptr() % 16 == 0


def qgemv_mma(
    x: Tensor,
    w: QuantWeight,
    *,
    norm_weight: Tensor | None = None,
    eps: float = 1e-6,
    residual: Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    pdl: bool = False,
    config: MmaGemvConfig | None = None,
) -> Tensor:
    """``residual + x' @ dequantize(w).T`` for one decode row, on the tensor cores.

    Same contract as ``qgemv`` for one row: x (K,) or (1, K), bf16/fp16/fp32; w: 4-bit
    QuantWeight (N, K), groups of 32, 64 or 128; ``x' = rmsnorm(x) * norm_weight`` (rounded
    to x's dtype, as ``rms_norm`` returns it) when ``norm_weight`` (K,) is given, else x;
    output (N,) or (1, N) in ``out_dtype`` (default x's dtype), fp32 accumulation, with
    ``residual`` (the output's shape) added before the rounding; ``pdl``: programmatic
    dependent launch (Hopper; ignored elsewhere).
    """
    check_weight(w, "qgemv_mma: w", 2)
    if w.bits != 4:
        raise ValueError(f"qgemv_mma: {w.bits}-bit weights are not supported (4 bits; use qgemv)")
    n, k = w.shape
    check_x(x, k, "qgemv_mma", w.device)
    if x.dim() not in (1, 2) or (x.dim() == 2 and x.shape[0] != 1):
        raise ValueError(
            f"qgemv_mma: x must be (K,) or (1, K), got {tuple(x.shape)} (several rows: qgemv)"
        )
    if not mma_supports(w):
        raise ValueError("qgemv_mma: qweight rows must start on 16-byte boundaries")
    x1 = x.reshape(k)
    x1 = x1 if x1.stride(0) == 1 else x1.contiguous()
    if norm_weight is not None:
        norm_weight = check_norm(norm_weight, k, "qgemv_mma", x.device)
    out_shape = (n,) if x.dim() == 1 else (1, n)
    if residual is not None:
        if tuple(residual.shape) != out_shape or residual.device != x.device:
            raise ValueError(
                f"qgemv_mma: residual {tuple(residual.shape)} on {residual.device} does not "
                f"match the output {out_shape} on {x.device}"
            )
        residual = residual.reshape(n)
        residual = residual if residual.stride(0) == 1 else residual.contiguous()
    cfg = config or mma_gemv_config(n, k, w.group_size)
    n_groups = k // w.group_size
    groups = pow2(n_groups)
    warps = min(cfg.num_warps, groups)
    out = torch.empty(n, dtype=out_dtype or x.dtype, device=x.device)
    pdl = use_pdl(pdl, x.device)
    regs = {"maxnreg": cfg.maxnreg} if cfg.maxnreg else {}
    _qgemv_mma_kernel[(cdiv(n, cfg.block_n),)](
        x1, w.qweight, w.scales, w.biases, norm_weight if norm_weight is not None else x1,
        residual if residual is not None else out, out, n, w.qweight.stride(0),
        w.scales.stride(0), PAIR_MASK, float(eps),
        GROUP=w.group_size, NG=n_groups, G=groups, BLOCK_N=cfg.block_n, W=warps,
        TERMS=X_TERMS[x.dtype], HAS_NORM=norm_weight is not None, HAS_RES=residual is not None,
        EVEN_N=n % cfg.block_n == 0, EVEN_K=groups == n_groups, ON_CPU=x.device.type == "cpu",
        PDL=pdl, num_warps=warps, **pdl_launch(pdl), **regs,
    )  # fmt: skip
    return out.reshape(out_shape)
