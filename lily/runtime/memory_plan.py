"""What the engine will hold in device memory, by part, and the context that fits.

One owner for the byte arithmetic: the engine picks its context window from it (``lily
serve`` without ``--max-context`` takes the largest the free memory allows), the
architecture report prints it, and the server's per-request guard (lily/server/limits.py)
asks it what one request needs. The parts, for the full model at 128K (docs/notes/memory.md):

- weights: the parameters as loaded (packed 4-bit, routers 8-bit, dense norms);
- KV cache: 2 (K, V) x KV heads x head dim x element size per attention layer and
  position, at the capacity the context reaches (lily/runtime/state.py: steps of KV_STEP),
  plus one layer's K (or V) buffer held beside its new copy while the cache grows;
- DeltaNet states: conv and fp32 recurrent state per DeltaNet layer, twice (the working
  state and the copy a graph capture or snapshot takes);
- scratch: one prefill chunk's temporaries at the largest layer, and the last logits and
  the sampler's vocabulary-sized buffers;
- graphs: the CUDA-graph decode steps' memory pool (kernel path);
- batched steps: with up to ``max_running`` requests decoded together (``lily serve
  --max-running``), each batch size's logits buffer (its graphs share it), the largest
  step's temporaries (the rows' activations, attention partials, the batched MoE's h and
  partials, logits and draws) and the rows sampler's per-row tables;
- prefix cache: its device budget (``--prefix-cache-gb``), all of which it may fill;
- margin: the allocator's rounding, cuBLAS workspaces, grammar masks.

Scratch figures are upper bounds read off the kernels' launchers (what each allocates per
token of a chunk); lily/bench/gpu/e2e/memory_128k.py measures them on the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lily.config import MAX_RUNNING, ModelConfig
from lily.quant import QuantWeight
from lily.runtime.state import INITIAL_CAPACITY, KV_STEP, kv_capacity

MiB = 1 << 20
GiB = 1 << 30
MARGIN = 256 * MiB  # allocator rounding, cuBLAS workspaces, grammar and sampler buffers
GRAPH_POOL = 64 * MiB  # the decode graphs' shared pool: one step's temporaries, each graph's logits
PART_BYTES = 128 * MiB  # attention prefill's split partials cap (lily/ops/attention_prefill.py)
SCORE_ELEMS = 1 << 26  # the reference attention's score block (lily/model/attention.py)
SNAPSHOTS = 8  # turn-start snapshots one request is assumed to save (the server's guard)
# A batched step's draw temporaries per logit of a row (lily/runtime/rows_sampling.py:
# penalized and warped fp32 copies, the sort's values and int64 order, the random stream's
# int64 hash and fp64 uniforms and their Gumbel transform (lily/runtime/draws.py); counted
# from the ops, an upper bound).
DRAW_BYTES = 64


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """K and V of every attention layer for one position."""
    es = _size(dtype)
    return 2 * cfg.num_key_value_heads * cfg.head_dim * es * len(cfg.attn_layers)


def state_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """One session's DeltaNet conv and recurrent (fp32) states."""
    conv = (cfg.linear_conv_kernel_dim - 1) * cfg.conv_dim * _size(dtype)
    rec = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
    return (conv + rec) * len(cfg.linear_layers)


def scratch_bytes(cfg: ModelConfig, dtype: torch.dtype, chunk: int, kernels: bool,
                  context: int) -> int:  # fmt: skip
    """Temporaries of one prefill chunk of ``chunk`` tokens at its largest layer, plus the
    last logits and the sampler's buffers. ``context`` matters to the reference path only
    (its attention materializes a score block up to SCORE_ELEMS)."""
    t, d, v = chunk, cfg.hidden_size, cfg.vocab_size
    # the fp32 logits, then a draw's temporaries (fp32 copies, the random stream's int64 hash
    # and fp64 uniforms: lily/runtime/draws.py); what a sampler holds (its lanes, penalty
    # tables) is in MARGIN's sampler buffers
    tail = 2 * v * 4 + 4 * v * 8
    if not kernels:
        widths = (
            4 * d  # residual, normed input, mixer and MoE outputs
            + 2 * cfg.conv_dim  # DeltaNet projections before and after the conv
            + 2 * cfg.num_attention_heads * cfg.head_dim  # gated queries
            + 3 * cfg.num_experts_per_tok * cfg.moe_intermediate_size  # routed gate/up/act
        )
        score = 2 * min(SCORE_ELEMS, cfg.num_attention_heads * t * context) * 4
        return t * widths * 4 + score + tail
    return t * token_bytes(cfg, dtype, PART_BYTES // t) + tail


def token_bytes(cfg: ModelConfig, dtype: torch.dtype, attention_extra: int = 0) -> int:
    """Kernel-path temporaries per token of a chunk at its largest layer (the residual
    stream and the largest of DeltaNet, attention plus ``attention_extra``, and the MoE)."""
    es, d = _size(dtype), cfg.hidden_size
    hv, kd, vd = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    k, e = cfg.num_experts_per_tok, cfg.num_experts
    i = max(cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size)
    h, hkv, dh = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    # Bytes per token of the chunk while each mixer or the MoE runs (lily/ops launchers).
    deltanet = (
        (cfg.conv_dim + cfg.value_dim + 2 * hv) * es  # fused in_proj output (qkv | z | b | a)
        + cfg.conv_dim * es  # conv output
        + 2 * hv * 4  # gates g and beta
        + hv * vd * 4  # fp32 recurrence output before the gated norm
        + hv * (kd + vd) * es  # the chunked form's w and u
        + cfg.value_dim * es  # gated norm output
    )
    attention = (2 * h * dh + 2 * hkv * dh) * es + 2 * h * dh * es  # q|gate|k|v, q, out
    moe = (
        e * 4  # router logits
        + 4 * (k + 1) * 4  # ids, ranks, weights, pairs
        + (k + 1) * i * 2  # gate/up activations (bf16)
        + (k + 1) * d * 2  # down projection rows before the sum (bf16)
        + 2 * d * es  # output and the next layer's normed input
    )
    residual = 2 * d * es  # the residual stream and its norm, live through every layer
    return residual + max(deltanet, moe, attention + attention_extra)


def batch_bytes(cfg: ModelConfig, dtype: torch.dtype, max_running: int, context: int) -> int:
    """Device memory of batched decode steps of 2 to ``max_running`` rows at contexts up to
    ``context``, beyond the single-sequence path (0 for one request at a time): each batch
    size's logits buffer, the largest step's temporaries and the rows sampler's tables."""
    n = min(max_running, MAX_RUNNING)
    if n < 2:
        return 0
    v = cfg.vocab_size
    logits = sum(range(2, n + 1)) * v * 4  # one (b, V) fp32 buffer per batch size b
    # The largest step: per row its layer temporaries (as a token of a prefill chunk), its
    # fp32 logits and draw temporaries, and the batched attention's split partials (at
    # most 64 blocks a row up to 64K positions, then 1,024 positions a block:
    # lily/ops/attention_decode.py default_split), fp32 with one log-sum-exp per head.
    blocks = max(64, -(-context // 1024))
    partials = cfg.num_attention_heads * blocks * (cfg.head_dim + 1) * 4
    step = n * (token_bytes(cfg, dtype) + v * (4 + DRAW_BYTES) + partials)
    sampler = MAX_RUNNING * v * (1 + 4)  # the rows sampler's seen (bool) and counts (fp32)
    return logits + step + moe_rows_bytes(cfg, n) + sampler


def moe_rows_bytes(cfg: ModelConfig, n: int) -> int:
    """The batched MoE decode's scratch for a step of ``n`` rows (lily/ops/moe_decode_rows.py),
    bounded as if every step had 16 columns and 4 slots a down chunk (its largest form): h
    of each slot's rows (bf16), the down launch's fp32 partials, the logits, the slot plan
    and the tickets."""
    e, k, d = cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size
    i, i_s, cols = cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size, 16
    slots = min(e, n * k)
    padded = slots + 8  # the plan's slot list, whole chunks of up to 8
    h = slots * cols * i * 2 + cols * max(i_s, 1) * 2
    partials = (-(-slots // 4) + 1) * cols * d * 4
    plan = n * (e + 1) * 4 + padded * (cols + 1) * 4 + 4 + d * 4  # (tickets: d / 16 at most)
    return h + partials + plan


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes by part for a context of ``max_context`` tokens; ``free`` what the device had
    after the weights (None where unknown)."""

    device: str
    weights: int
    kv_per_token: int
    max_context: int
    kv: int
    kv_growth: int
    states: int
    scratch: int
    graphs: int
    prefix_cache: int
    margin: int
    chunk: int
    free: int | None = None
    auto: bool = False  # max_context chosen from the free memory
    batch: int = 0  # batched decode steps (``batch_bytes``)
    max_running: int = 1

    @property
    def total(self) -> int:
        return self.weights + self.beyond_weights

    @property
    def beyond_weights(self) -> int:
        return (self.kv + self.kv_growth + self.states + self.scratch + self.graphs
                + self.batch + self.prefix_cache + self.margin)  # fmt: skip

    @property
    def fits(self) -> bool:
        return self.free is None or self.beyond_weights <= self.free

    def parts(self) -> dict[str, int]:
        """Every part in bytes (for JSON and the report)."""
        return {
            "weights": self.weights,
            "kv_cache": self.kv,
            "kv_growth": self.kv_growth,
            "deltanet_states": self.states,
            "scratch": self.scratch,
            "graphs": self.graphs,
            "batched_steps": self.batch,
            "prefix_cache": self.prefix_cache,
            "margin": self.margin,
            "total": self.total,
        }


def plan(cfg: ModelConfig, dtype: torch.dtype, *, weights: int, max_context: int, chunk: int,
         kernels: bool, graphs: bool, prefix_cache_bytes: int, device: str = "cpu",
         free: int | None = None, auto: bool = False,
         max_running: int = 1) -> MemoryPlan:  # fmt: skip
    """The plan for a context of ``max_context`` tokens (a full cache holds exactly that:
    growth stops at the limit), with up to ``max_running`` requests decoded together."""
    per_token = kv_bytes_per_token(cfg, dtype)
    one_buffer = per_token // max(1, 2 * len(cfg.attn_layers))
    return MemoryPlan(
        device=device,
        weights=weights,
        kv_per_token=per_token,
        max_context=max_context,
        kv=per_token * max_context,
        kv_growth=one_buffer * max_context,
        states=2 * state_bytes(cfg, dtype),
        scratch=scratch_bytes(cfg, dtype, chunk, kernels, max_context),
        graphs=GRAPH_POOL if kernels and graphs else 0,
        prefix_cache=prefix_cache_bytes,
        margin=MARGIN,
        chunk=chunk,
        free=free,
        auto=auto,
        batch=batch_bytes(cfg, dtype, max_running, max_context) if kernels and graphs else 0,
        max_running=max_running,
    )


class ContextDoesNotFit(ValueError):
    """Not even one KV step fits beside the weights and the plan's reserves."""


def largest_context(cfg: ModelConfig, dtype: torch.dtype, free: int, cap: int, **kw) -> int:
    """The largest context (a multiple of KV_STEP, at most ``cap``) whose plan fits in
    ``free`` bytes beyond the weights; ``kw`` as ``plan`` (less weights and max_context).
    Raises ContextDoesNotFit when not even one step fits."""

    def fits(n: int) -> bool:
        return plan(cfg, dtype, weights=0, max_context=n, **kw).beyond_weights <= free

    if fits(cap):
        return cap
    lo, hi = 0, cap // KV_STEP  # in steps; the plan grows with the context: bisect
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid * KV_STEP):
            lo = mid
        else:
            hi = mid - 1
    if lo == 0:
        need = plan(cfg, dtype, weights=0, max_context=min(cap, KV_STEP), **kw).beyond_weights
        raise ContextDoesNotFit(
            f"the model's weights leave {free / GiB:.2f} GiB free, less than the "
            f"{need / GiB:.2f} GiB a {min(cap, KV_STEP)}-token context needs beside them "
            f"(KV cache, states, a {kw.get('chunk')}-token prefill chunk, the prefix cache's "
            f"{kw.get('prefix_cache_bytes', 0) / GiB:.2f} GiB): lower --prefix-cache-gb or "
            "--prefill-chunk, or use a GPU with more memory"
        )
    return lo * KV_STEP


def free_bytes(device: str) -> int | None:
    """Memory this process may still take on ``device``: on a GPU the driver's free memory
    plus what PyTorch holds cached but unused (after returning that cache to the driver);
    on the CPU MemAvailable. None where it cannot be read."""
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            return None
        torch.cuda.empty_cache()  # what loading left cached (e.g. weights fused into views)
        free, _ = torch.cuda.mem_get_info(dev)
        return free + torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
    if dev.type == "cpu":
        return meminfo_available()
    return None


def meminfo_available() -> int | None:
    """MemAvailable from /proc/meminfo in bytes (None where it cannot be read)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def weight_bytes(params: dict) -> int:
    """Bytes of the parameters, each storage counted once (fused weights' views share one)."""
    seen: set[tuple] = set()
    n = 0
    for w in params.values():
        parts = (w.qweight, w.scales, w.biases) if isinstance(w, QuantWeight) else (w,)
        for t in parts:
            if not isinstance(t, torch.Tensor):
                continue
            key = (t.device.type, t.device.index, t.untyped_storage().data_ptr())
            if key in seen:
                continue
            seen.add(key)
            n += t.untyped_storage().nbytes()
    return n


def engine_plan(cfg: ModelConfig, engine_cfg, dtype: torch.dtype, params: dict,
                graphs: bool, free: int | None = None) -> MemoryPlan:  # fmt: skip
    """The engine's plan after its weights are loaded: the context ``engine_cfg.max_context``
    (None: the largest ``free`` allows, read from the device when not given), capped at the
    model's max_position_embeddings."""
    cap = cfg.max_position_embeddings
    want = engine_cfg.max_context
    if free is None:
        free = free_bytes(str(engine_cfg.device))
    kw = dict(
        chunk=max(1, engine_cfg.prefill_chunk),
        kernels=bool(engine_cfg.use_kernels),
        graphs=graphs,
        prefix_cache_bytes=int(engine_cfg.prefix_cache_gb * GiB),
        max_running=getattr(engine_cfg, "max_running", 1),
    )
    if want is None:
        n = cap if free is None else largest_context(cfg, dtype, free, cap, **kw)
    else:
        n = min(int(want), cap)
    return plan(cfg, dtype, weights=weight_bytes(params), max_context=n,
                device=str(engine_cfg.device), free=free, auto=want is None, **kw)  # fmt: skip


@dataclass(frozen=True)
class RequestEstimate:
    """Bytes one request needs beyond the weights, by part."""

    kv: int  # K/V caches at their final capacity
    kv_growth: int  # one old buffer held while a layer's cache grows
    recurrent: int  # DeltaNet conv and recurrent states
    workspace: int  # activations of one prefill chunk

    @property
    def total(self) -> int:
        return self.kv + self.kv_growth + self.recurrent + self.workspace


def request_kv_capacity(n_prompt: int, n_total: int, limit: int) -> int:
    """The K/V capacity a fresh state reaches for a prompt of ``n_prompt`` tokens growing to
    ``n_total`` (the engine reserves the prompt and one decode position at once, then the
    cache grows in steps)."""
    return kv_capacity(max(n_prompt + 1, n_total), limit, min(INITIAL_CAPACITY, limit))


def request_estimate(cfg: ModelConfig, dtype: torch.dtype, n_prompt: int, n_total: int,
                     chunk: int, limit: int, kernels: bool) -> RequestEstimate:  # fmt: skip
    """What a request of ``n_prompt`` prompt tokens growing to ``n_total`` needs."""
    cap = request_kv_capacity(n_prompt, n_total, limit)
    per_token = kv_bytes_per_token(cfg, dtype)
    one_buffer = per_token // max(1, 2 * len(cfg.attn_layers))
    # NOTE: growth holds the old buffer of one K (or V) beside its new copy; the old
    # capacity is at most the new one.
    return RequestEstimate(
        kv=per_token * cap,
        kv_growth=one_buffer * cap,
        recurrent=state_bytes(cfg, dtype),
        workspace=scratch_bytes(cfg, dtype, min(chunk, n_prompt), kernels, n_total),
    )


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
