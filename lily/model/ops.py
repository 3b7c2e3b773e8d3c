"""The model's ops: each one function that runs its Triton kernels or its reference maths.

``k`` is the dispatch: None runs the plain-PyTorch reference (lily/model/*.py, the maths
written once); a ``Kernels`` runs the kernels of lily/ops. A ``Kernels`` with ``step`` set
is a decode step (one row, captured in a CUDA graph): norms ride in the prologue of the
GEMV or MoE that reads them, launches use programmatic dependent launch (``pdl``) and the
4-bit GEMVs the tensor cores (``mma``). Without ``step`` (a prefill chunk) a norm rides in
the epilogue of the op that produces its input: add+norm after a GEMM, the next layer's
input norm in the MoE's last launch. Either way an op's result is the same maths.

NOTE: the prefill of a reused turn enqueues ~800 launches barely ahead of the GPU; keep
the per-call host work here to attribute reads and one branch or two.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lily.config import MAX_RUNNING, ModelConfig
from lily.model.attention import attention_mixer
from lily.model.bundles import AttentionWeights, DeltaNetWeights, Fused, MoEWeights
from lily.model.deltanet import deltanet_mixer
from lily.model.linear import embedding
from lily.model.linear import linear as ref_linear
from lily.model.moe import sparse_moe
from lily.model.norm import rms_norm
from lily.quant import QuantWeight, Weight

Tensor = torch.Tensor

# Triton is Linux-only: elsewhere the model runs its reference ops alone.
HAS_KERNELS = importlib.util.find_spec("triton") is not None
if HAS_KERNELS:
    from lily.ops.attention_decode import attention_decode, attention_decode_rows
    from lily.ops.attention_prefill import attention_prefill
    from lily.ops.deltanet_decode import (
        DeltaNetDecodeWorkspace,
        deltanet_decode,
        deltanet_decode_rows,
    )
    from lily.ops.deltanet_prefill import deltanet_prefill
    from lily.ops.embedding import DTYPES as EMBED_DTYPES
    from lily.ops.embedding import embedding_rows
    from lily.ops.mma_rows import rows_prep
    from lily.ops.moe_decode import moe_decode
    from lily.ops.moe_decode_config import MoeDecodeConfig
    from lily.ops.moe_decode_rows import moe_decode_rows, rows_fit
    from lily.ops.moe_prefill import moe_prefill
    from lily.ops.norm_rope import rope_inv_freq
    from lily.ops.qgemm import qgemm
    from lily.ops.qgemv import MAX_ROWS as QGEMV_ROWS  # the most rows the GEMV takes
    from lily.ops.qgemv import qgemv
    from lily.ops.qgemv_mma import mma_supports, qgemv_mma
    from lily.ops.qgemv_mma_rows import MAX_ROWS as MMA_ROWS
    from lily.ops.qgemv_mma_rows import qgemv_mma_rows
    from lily.ops.rmsnorm import add_rmsnorm, rmsnorm


MAX_ROWS = MAX_RUNNING  # sequences one batched decode step may hold (the DeltaNet scratch's rows)

# bf16 rows at or below this run through the FMA GEMV (qgemv), more through the GEMM. On the
# H200 the 8192 x 2048 projection took 15 us on qgemv at 2 rows against 22 on qgemm, but 38
# against 22 at 4 and 94 against 22-29 at 8 (bench/results/linear_kernels_h200_run4_stream
# .json): a batched step of 3-8 rows on qgemv spent about 4x a projection's time. Other
# dtypes keep qgemv up to its 8 rows (qgemm rounds x to bf16).
GEMV_ROWS_BF16 = 2


# A batched step's bf16 rows on the tensor-core GEMV with the rows as the MMA's columns
# (qgemv_mma_rows: the weight tile read once for all rows) instead of the GEMM past
# GEMV_ROWS_BF16. On the H200 (docs/notes/batching.md, fifth session) the full model's
# batched step took 2.51/3.40/5.08 ms at 2/4/8 rows on it against 2.76/4.80/6.57 on
# qgemv/qgemm (its projections 1.17 ms a step against 2.36 at 8 rows), and each row's
# logits came out bitwise equal to the one-row step's.
ROWS_MMA = True


# A batched step's normed projections with their rows prepared once (rows_prep: normed, in
# the MMA's K order, one launch) instead of normed by every program of the GEMV.
# Compile-only (sm_90, docs/notes/batching.md, eighth session) a DeltaNet projection
# program's instructions fall 2,994 -> 1,532 a thread at 8 rows, but the preparation is one
# more launch on the chain: measured (H100, ninth session, rows_timeline at 4K) the step
# went 3.214 -> 3.176 ms at 4 rows and 4.881 -> 4.976 at 8, and with the operand on pow2(B)
# rows (OPERAND_POW2) the GEMV gets most of the saving without the launch. Off.
ROWS_PREP = False

# The lm_head of a batched step on prepared rows: there the preparation replaces the
# rmsnorm launch the head had anyway, and each of its ~7,800 programs only loads the
# operand. Measured (H100, ninth session, kernels.gemv_rows, 2 rows): 169 us with the
# rmsnorm launch (220 with the norm in every program) -> 120.
ROWS_PREP_HEAD = True


def rows_mma(x: Tensor, w: Weight, k: Kernels) -> bool:
    """Whether a batched step's rows ``x`` take qgemv_mma_rows for the packed ``w``."""
    return (ROWS_MMA and k.step and k.mma and 2 <= x.shape[0] <= MMA_ROWS
            and x.dtype == torch.bfloat16 and isinstance(w, QuantWeight)
            and mma_supports(w))  # fmt: skip


def gemv_rows(x: Tensor) -> int:
    """The most rows of ``x`` a packed linear layer takes on the GEMV (more: the GEMM)."""
    return GEMV_ROWS_BF16 if x.dtype == torch.bfloat16 else QGEMV_ROWS


# The MoE of a batched decode step: moe_decode with each launch's grid once a row (every
# row reads its own k experts), or with ROWS_MOE moe_decode_rows (each chosen expert read
# once for all the rows that chose it). On the H200 (bench/results/moe_rows_h200.json, us
# a layer) moe_decode_rows lost to B one-row moe_decode calls in a row at every B up to 8
# (2: 53 against 32; 8: 132 against 121) and to rmsnorm + moe_prefill at 16 (390 against
# 189): it is latency-bound (41 us at one row against moe_decode's 17.5), not byte-bound.
# The row grid runs those B calls' programs side by side; docs/notes/batching.md.
ROWS_MOE = False

# moe_decode's tile in a batched decode step of B rows: the entry of the largest key <= B
# (keys 2 to MAX_ROWS; none: MoeDecodeConfig's defaults, tuned for one row, where the grid
# must be wide to fill the SMs). `lily bench --run kernels.moe_rows -- --variants` prints
# each B's fastest tile as an entry of this table. Measured on the H200 on 2026-12-02
# (bench/results/moe_rows_sweep_h200_s6.json, us a layer against the one-row defaults):
# 2 rows 24.8 (27.0), 4 rows 42.0 (47.4), 8 rows 75.1 (88.0), 16 rows 137.9 (168.3); the
# byte floor at 8 rows is 24.4. The compile matrix (lily/ops/launchable.py) and the
# warm-up run every batch size through this dispatch, so an entry is compiled and checked
# there.
# NOTE: MoeDecodeConfig needs Triton; without it the table stays empty (reference ops).
# At 4 and 8 rows each row is routed once in the router launch and the down launch's
# operand is written by gate/up (route_once, down_operand: each frees registers, so gate/up
# takes 8 warps). Measured on the H100 (tenth session; the H200 was not lent): a layer 43.2
# (45.6 with MOE_ROWS_EVERY's entry) us at 4 rows and 73.1 (78.6) at 8
# (bench/results/moe_rows_route_h100_s10.json), the step 2.900 (3.078) and 4.593 (4.874) ms
# (rows_timeline_table_h100_s10.json). Their h is rounded to bf16 before down (as
# moe_prefill rounds it), so the batched step is no longer bitwise the one-row step's: on
# the plain tiny model, rounding-chaotic, that showed as 10% at one row where the one-row
# step itself was 10% off fp32 and the batched one 1.5%; on the conditioned model 0.3-0.4%
# (eleventh session, bench/results/route_debug_h100_s11.txt; docs/notes/batching.md).
# down_early (the down launch's expert tiles loaded before its PDL wait): the step 4.556 /
# 4.572 -> 4.409 ms at 8 rows and 2.874 / 2.889 -> 2.770 at 4 rows (H100, 4K, twelfth
# session, bench/results/rows_timeline_down_forms_h100_s12.json). The down launch split
# in K (more programs an SM) was measured there too and not kept (docs/notes/batching.md).
MOE_ROWS_CONFIGS: dict[int, MoeDecodeConfig] = {} if not HAS_KERNELS else {
    2: MoeDecodeConfig(shared_rows=4, mma_rows=32, mma_warps=4, mma_down_rows=32,
                       mma_down_warps=8),
    4: MoeDecodeConfig(router_rows=8, mma_rows=32, mma_down_rows=16, mma_down_warps=4,
                       route_once=True, down_operand=True, down_early=True),
    8: MoeDecodeConfig(router_rows=8, mma_rows=32, mma_down_rows=16, mma_down_warps=4,
                       route_once=True, down_operand=True, down_early=True),
}  # fmt: skip
# The earlier entries at 4 and 8 rows (every gate/up program routes its row; h exact into
# down), kept for rows_timeline's ``every_table`` variant.
MOE_ROWS_EVERY: dict[int, MoeDecodeConfig] = {} if not HAS_KERNELS else {
    **MOE_ROWS_CONFIGS,
    4: MoeDecodeConfig(router_rows=8, mma_rows=32, mma_warps=4, mma_down_rows=32,
                       mma_down_warps=8),
    8: MoeDecodeConfig(router_rows=8, mma_rows=32, mma_warps=4, mma_down_rows=16,
                       mma_down_warps=4),
}  # fmt: skip


def at_rows(table: dict, b: int, default=None):
    """The entry of a batched step's table for ``b`` rows: that of the largest key <= b
    (``default`` where there is none)."""
    keys = [n for n in table if n <= b]
    return table[max(keys)] if keys else default


def moe_rows_config(b: int) -> MoeDecodeConfig | None:
    """moe_decode's tile for a batched decode step of ``b`` rows (MOE_ROWS_CONFIGS), or
    None: the defaults."""
    return at_rows(MOE_ROWS_CONFIGS, b)


# The DeltaNet step's tile in a batched decode step of B rows (deltanet_decode_rows, grid
# (Vd / block_v, Hv, B)): (block_v, num_warps), the entry of the largest key <= B (keys 2
# to MAX_ROWS; none: DELTANET_ROWS_DEFAULT, the one-row launcher's defaults). Measured on
# the H200 (`lily bench --run kernels.deltanet_rows -- --variants`, sixth session,
# bench/results/deltanet_rows_sweep_h200_s6.json; us a layer against the default tile): 2
# rows 5.89 (6.74), 4 rows 8.00 (10.58), 8 rows 14.32 (16.82), 16 rows 25.74 (29.82). As
# for the MoE's table, the compile matrix and the warm-up run every batch size through it.
DELTANET_ROWS_CONFIGS: dict[int, tuple[int, int]] = {2: (64, 4), 16: (32, 2)}
DELTANET_ROWS_DEFAULT = (16, 4)  # deltanet_decode_rows' own block_v and num_warps


def deltanet_rows_config(b: int) -> tuple[int, int]:
    """(block_v, num_warps) of deltanet_decode_rows for a batched decode step of ``b`` rows
    (DELTANET_ROWS_CONFIGS; DELTANET_ROWS_DEFAULT without an entry at or below ``b``)."""
    return at_rows(DELTANET_ROWS_CONFIGS, b, DELTANET_ROWS_DEFAULT)


@dataclass(frozen=True, slots=True)
class Kernels:
    """How the kernels run (see the module docstring) and what they share: the DeltaNet
    step's workspaces (one sequence, and a batched step's rows), the RoPE frequencies and
    the MoE decode's route_once tickets (zeros, one a row, left at zero by every call)."""

    step: bool
    pdl: bool
    mma: bool
    workspace: DeltaNetDecodeWorkspace
    inv_freq: Tensor
    rows_workspace: DeltaNetDecodeWorkspace
    moe_tickets: Tensor

    @classmethod
    def new(cls, cfg: ModelConfig, device: torch.device, step: bool, pdl: bool,
            mma: bool) -> Kernels:  # fmt: skip
        """A dispatch with new shared buffers (one per model: the layers run in turn)."""
        if not HAS_KERNELS:
            raise ValueError("the kernel path needs Triton, which is not installed here")
        heads = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_value_head_dim)
        workspace = DeltaNetDecodeWorkspace.new(*heads, device)
        rows = DeltaNetDecodeWorkspace.new(*heads, device, rows=MAX_ROWS)
        inv_freq = rope_inv_freq(cfg.rotary_dim, cfg.rope_theta, device)
        tickets = torch.zeros(MAX_ROWS, dtype=torch.int32, device=device)
        return cls(step, pdl, mma, workspace, inv_freq, rows, tickets)


# ---------------------------------------------------------------- linear layers


def embed(ids: Tensor, w: Weight, dtype: torch.dtype, k: Kernels | None) -> Tensor:
    """Rows ``ids`` (T,) of the embedding table as (T, D): one gather-and-dequantize launch
    for a packed table (the reference's were ten), bit-equal to the reference."""
    if k is not None and isinstance(w, QuantWeight) and dtype in EMBED_DTYPES:
        return embedding_rows(ids, w, dtype)
    return embedding(ids, w, dtype)


def linear(x: Tensor, w: Weight, k: Kernels | None, residual: Tensor | None = None,
           out_dtype: torch.dtype | None = None, prep: bool | None = None,
           **prologue) -> Tensor:  # fmt: skip
    """``residual + x @ w.T`` for x (T, K), in ``out_dtype`` (default x's). Kernels: the
    GEMV for a few rows of a packed weight (on the tensor cores with ``mma``; ``prologue``
    keywords ``norm_weight``, ``eps`` put an RMSNorm of x in its prologue, or with ``prep``
    (None: ROWS_PREP) a batched step's rows prepared by rows_prep), the fused-dequant GEMM
    for more, cuBLAS for a dense weight."""
    if k is None:
        y = ref_linear(rms_norm(x, prologue["norm_weight"], prologue["eps"]) if prologue else x, w)
        if out_dtype is not None:
            y = y.to(out_dtype)
        return y if residual is None else y + residual
    if isinstance(w, QuantWeight):
        if rows_mma(x, w, k):
            if prologue and (ROWS_PREP if prep is None else prep):
                x = rows_prep(x, w.group_size, prologue["norm_weight"], prologue["eps"],
                              pdl=k.pdl)  # fmt: skip
                prologue = {}
            return qgemv_mma_rows(x, w, residual=residual, out_dtype=out_dtype, pdl=k.pdl,
                                  **prologue)  # fmt: skip
        if x.shape[0] <= gemv_rows(x):
            # (the tensor-core GEMV takes one row; a few rows take qgemv)
            gemv = qgemv_mma if k.mma and x.shape[0] == 1 and mma_supports(w) else qgemv
            return gemv(x, w, residual=residual, out_dtype=out_dtype, pdl=k.pdl, **prologue)
        if prologue:  # (a batched decode step of more rows than the GEMV takes)
            x = rmsnorm(x, prologue["norm_weight"], prologue["eps"])
        y = qgemm(x, w, out_dtype=out_dtype)
    else:
        if prologue:
            x = rmsnorm(x, prologue["norm_weight"], prologue["eps"])
        y = torch.nn.functional.linear(x, w.to(x.dtype))
        if out_dtype is not None:
            y = y.to(out_dtype)
    return y if residual is None else y + residual


def norm(x: Tensor, w: Tensor, eps: float, k: Kernels | None) -> Tensor:
    """RMSNorm of x (T, D) by the multiplier ``w``, in x's dtype."""
    return rms_norm(x, w, eps) if k is None else rmsnorm(x, w, eps)


def project(x: Tensor, h: Tensor | None, norm_w: Tensor, proj: tuple[Fused, ...], eps: float,
            k: Kernels | None) -> tuple[Tensor, ...]:  # fmt: skip
    """A mixer's input projections of ``h = rmsnorm(x) * norm_w`` (``h`` when given: the
    norm already made by the op before), split into column views of the fused outputs.
    In a decode step the norm rides in the GEMV's prologue."""
    if k is not None and k.step and len(proj) == 1 and isinstance(proj[0].weight, QuantWeight):
        f = proj[0]
        return linear(x, f.weight, k, norm_weight=norm_w, eps=eps).split(f.sizes, dim=-1)
    if h is None:
        h = norm(x, norm_w, eps, k)
    if len(proj) == 1:
        f = proj[0]
        return linear(h, f.weight, k).split(f.sizes, dim=-1)
    return tuple(y for f in proj for y in linear(h, f.weight, k).split(f.sizes, dim=-1))


def out_norm(o: Tensor, w: Weight, x: Tensor, norm_w: Tensor, eps: float,
             k: Kernels | None) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    """``x + o @ w.T`` (the mixer's output projection and the residual) and its RMSNorm by
    ``norm_w``; None for the norm in a decode step (the MoE's prologue makes it). The GEMV
    adds the residual before its one rounding; after a GEMM the add and the norm share
    one launch."""
    if k is None:
        x = x + ref_linear(o, w)
        return x, rms_norm(x, norm_w, eps)
    if k.step:
        return linear(o, w, k, residual=x), None
    if isinstance(w, QuantWeight) and o.shape[0] > gemv_rows(o):
        return add_rmsnorm(linear(o, w, k), x, norm_w, eps)
    x = linear(o, w, k, residual=x)
    return x, rmsnorm(x, norm_w, eps)


def head(x: Tensor, norm_w: Tensor, w: Weight, eps: float, k: Kernels | None) -> Tensor:
    """fp32 logits (T, V) of the final RMSNorm of x (T, D)."""
    if k is None:
        return ref_linear(rms_norm(x, norm_w, eps), w).float()
    one_mma = k.mma and x.shape[0] == 1 and isinstance(w, QuantWeight) and mma_supports(w)
    rows = rows_mma(x, w, k)
    # The norm rides with the GEMV off the tensor cores, and with ROWS_PREP_HEAD in the
    # rows' preparation.
    if k.step and isinstance(w, QuantWeight) and (rows and ROWS_PREP_HEAD
                                                  or not (one_mma or rows)):  # fmt: skip
        return linear(x, w, k, out_dtype=torch.float32, prep=ROWS_PREP_HEAD, norm_weight=norm_w,
                      eps=eps)  # fmt: skip
    # On the tensor cores the norm gets its own launch: in the GEMV's prologue each of
    # ~7,800 programs redid it (95 against 89 us), and the rows' GEMV would redo B rows.
    return linear(rmsnorm(x, norm_w, eps), w, k, out_dtype=torch.float32)


# ---------------------------------------------------------------- mixers and MoE


def deltanet(parts: Sequence[Tensor], w: DeltaNetWeights, conv_state: Tensor, state: Tensor,
             eps: float, k: Kernels | None, cuts: Sequence[int] = (),
             snaps: list | None = None) -> Tensor:  # fmt: skip
    """The DeltaNet mixer over the projections ``parts`` = (qkv, z, b, a), each (T, N),
    updating the conv and recurrent states in place; (T, Hv*Vd). ``cuts``/``snaps``: the
    states after the first ``c`` tokens, as in ``deltanet_mixer``."""
    qkv, z, b, a = parts
    if k is None:
        return deltanet_mixer(qkv, z, b, a, w.conv1d, conv_state, w.A_log, w.dt_bias, w.norm,
                              state, eps, cuts, snaps)  # fmt: skip
    if qkv.shape[0] == 1:
        return deltanet_decode(qkv, z, b, a, w.conv1d, conv_state, w.A_log, w.dt_bias, w.norm,
                               state, eps, workspace=k.workspace, pdl=k.pdl)  # fmt: skip
    return deltanet_prefill(qkv, z, b, a, w.conv1d, conv_state, w.A_log, w.dt_bias, w.norm,
                            state, eps, cuts=cuts, snaps=snaps)  # fmt: skip


def deltanet_rows(parts: Sequence[Tensor], w: DeltaNetWeights, conv_states: Sequence[Tensor],
                  states: Sequence[Tensor], eps: float, k: Kernels | None,
                  table: Tensor | None = None) -> Tensor:  # fmt: skip
    """The DeltaNet mixer for one token of each of B sequences: row r of ``parts`` with
    ``conv_states[r]`` and ``states[r]`` (each updated in place); (B, Hv*Vd). The maths of
    ``deltanet`` for one token, per row. Kernels with ``table`` (``state_table`` of those
    states, a device tensor a graph may keep): every row in one launch, on the tile of
    DELTANET_ROWS_CONFIGS at B."""
    if k is not None and table is not None and len(states) <= MAX_ROWS:
        qkv, z, b, a = parts
        block_v, warps = deltanet_rows_config(len(states))
        return deltanet_decode_rows(qkv, z, b, a, w.conv1d, table, conv_states[0], states[0],
                                    w.A_log, w.dt_bias, w.norm, eps,
                                    workspace=k.rows_workspace, block_v=block_v,
                                    num_warps=warps, pdl=k.pdl)  # fmt: skip
    rows = [tuple(p[r : r + 1] for p in parts) for r in range(len(states))]
    return torch.cat([deltanet(p, w, c, s, eps, k)
                      for p, c, s in zip(rows, conv_states, states, strict=True)])  # fmt: skip


def attention_rows(parts: Sequence[Tensor], w: AttentionWeights,
                   caches: Sequence[tuple[Tensor, Tensor]], starts: Sequence[int] | Tensor,
                   max_len: int, cfg: ModelConfig, k: Kernels | None,
                   table: Tensor | None = None) -> Tensor:  # fmt: skip
    """Gated attention for one token of each of B sequences: row r of ``parts`` at position
    ``starts[r]`` (ints, or a (B,) int32 device tensor in a decode step) over its own caches
    ``caches[r]`` (K, V); (B, H*Dh). ``max_len`` bounds every row's context (a graph's).
    Kernels with ``table`` (``kv_table`` of those caches): every row in one launch."""
    if k is not None and table is not None:
        qg, kk, v = parts
        return attention_decode_rows(qg, kk, v, w.q_norm, w.k_norm, table, caches[0][0], starts,
                                     k.inv_freq, cfg.rms_norm_eps, max_len=max_len)  # fmt: skip
    out = []
    for r, (kc, vc) in enumerate(caches):
        p = tuple(x[r : r + 1] for x in parts)
        pos = starts[r : r + 1] if isinstance(starts, Tensor) else starts[r]
        out.append(attention(p, w, kc, vc, pos, max_len, cfg, k))
    return torch.cat(out)


def attention(parts: Sequence[Tensor], w: AttentionWeights, k_cache: Tensor, v_cache: Tensor,
              start: int | Tensor, max_len: int, cfg: ModelConfig,
              k: Kernels | None) -> Tensor:  # fmt: skip
    """Gated attention of the projections ``parts`` = (qg, k, v) at positions from
    ``start`` (an int, or a one-element device tensor in a decode step), writing K/V into
    the caches; (T, H*Dh). ``max_len`` bounds the context of a decode step's graph."""
    qg, kk, v = parts
    if k is None:
        return attention_mixer(qg, kk, v, w.q_norm, w.k_norm, k_cache, v_cache, int(start),
                               cfg.rotary_dim, cfg.rope_theta, cfg.rms_norm_eps)  # fmt: skip
    if qg.shape[0] == 1:
        return attention_decode(qg, kk, v, w.q_norm, w.k_norm, k_cache, v_cache, start,
                                k.inv_freq, cfg.rms_norm_eps, max_len=max_len)  # fmt: skip
    return attention_prefill(qg, kk, v, w.q_norm, w.k_norm, k_cache, v_cache, start, k.inv_freq,
                             cfg.rms_norm_eps)  # fmt: skip


def moe(x: Tensor, h: Tensor | None, norm_w: Tensor, m: MoEWeights, next_norm: Tensor | None,
        cfg: ModelConfig, k: Kernels | None) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    """``x + moe(h)`` with ``h = rmsnorm(x) * norm_w`` (``h`` when given), and with
    ``next_norm`` also its RMSNorm by that weight (the next layer's input) where the kernel
    makes it in its last launch (a prefill chunk), else None. Three launches for one row
    (the norm in the first one's prologue when ``h`` is None), the same three for the rows
    of a batched decode step (their grids once a row; ROWS_MOE: moe_decode_rows), routing
    on the GPU. The MoE kernels take packed
    experts; dense ones (an unquantized checkpoint) take the reference (not
    graph-capturable: ``Model.capturable``)."""
    eps, top_k = cfg.rms_norm_eps, cfg.num_experts_per_tok
    w = (m.router, m.gate_proj, m.up_proj, m.down_proj, m.shared_gate_proj, m.shared_up_proj,
         m.shared_down_proj, m.shared_expert_gate)  # fmt: skip
    if k is None or not isinstance(m.gate_proj, QuantWeight):
        if h is None:
            h = rms_norm(x, norm_w, eps)
        x = x + sparse_moe(h, *w, top_k, cfg.norm_topk_prob)
        return x, None if next_norm is None else rms_norm(x, next_norm, eps)
    if k.step and ROWS_MOE and rows_fit(x, m.gate_proj, m.up_proj, m.down_proj, w[4:7]):
        # A batched decode step: each chosen expert read once for the rows that chose it.
        if h is None:
            y = moe_decode_rows(x, *w, top_k=top_k, residual=x, norm_weight=norm_w, eps=eps,
                                pdl=k.pdl)  # fmt: skip
        else:
            y = moe_decode_rows(h, *w, top_k=top_k, residual=x, pdl=k.pdl)
        return y, None
    if k.step or x.shape[0] == 1:
        # One row, or a batched decode step's rows (each launch's grid once a row; its tile
        # from MOE_ROWS_CONFIGS).
        tile = moe_rows_config(x.shape[0]) if k.step else None
        if h is None:
            y = moe_decode(x, *w, top_k=top_k, residual=x, norm_weight=norm_w, eps=eps,
                           config=tile, pdl=k.pdl, tickets=k.moe_tickets)  # fmt: skip
        else:
            y = moe_decode(h, *w, top_k=top_k, residual=x, config=tile, tickets=k.moe_tickets)
        return y, None
    if h is None:  # no op before made the norm
        h = rmsnorm(x, norm_w, eps)
    if next_norm is None:
        return moe_prefill(h, *w, top_k=top_k, residual=x), None
    return moe_prefill(h, *w, top_k=top_k, residual=x, norm_weight=next_norm, eps=eps)
