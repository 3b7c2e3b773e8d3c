"""Kernel warm-up: every kernel variant a request can launch is compiled (or loaded from
Triton's on-disk cache) before ``lily serve`` reports ready.

Triton compiles a kernel the first time it is launched with a new specialization: its
constexprs, and each int argument's equality to 1 and divisibility by 16 (see
lily/ops/launch.py). A prompt's chunk lengths pick tiles from the tables, and its start
positions and snapshot cuts give ints of either class, so the first request of each shape
paid for its compiles: 20.9 s for the first 4K prompt on a fresh H200, 0.25 s on a second
start of the server (issue 19). Warm-up runs throwaway work that covers those classes:

- prefills of a representative length from every class of chunk lengths (the tile tables'
  intervals, each with its ints in both divisibility classes), from position 0 with
  snapshot cuts, after a chunk of history at an aligned and at an odd position (attention
  splits its keys there), and short ones after a long history (up to 16 splits);
- one-token chunks at positions that cover attention decode's block counts;
- decode steps on the working state at its context buckets (this captures their CUDA
  graphs), unsampled and with the device sampler for greedy and the model's defaults;
- with ``max_running`` above one (``lily serve --max-running``), batched decode steps of
  every batch size from 2 up to it, each at every context bound class (rows all short, one
  row at each bucket of the warm context, and one on a cache whose split blocks are not a
  multiple of 16), unsampled and with each sampler structure:
  their kernels (batched attention and DeltaNet steps, few-row GEMVs and MoE tiles) compile
  and their graphs are captured before the first batch.

Prefills and batched steps run on scratch states; the decode steps leave the working state
as they found it (DeltaNet states, length, tokens); the prefix cache is not touched. A
no-op on the reference path, which compiles nothing.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, fields, replace

import torch

from lily.config import MAX_RUNNING, ModelConfig
from lily.ops.arch import DEFAULT, Arch, current_arch
from lily.ops.qgemv import MAX_ROWS as GEMV_ROWS  # chunks this short take the GEMV
from lily.runtime.runner import MIN_BUCKET, context_bucket
from lily.runtime.sampling import SamplingParams
from lily.runtime.state import INITIAL_CAPACITY, SessionState, kv_capacity

WARM_CONTEXT = 8192  # the working state's capacity after warm-up (its graphs are captured)
LONG_HISTORY = 16384  # enough keys for attention prefill's largest split (16 x 8 x 64)
SPLIT_CHUNK = 512  # chunks up to this long may split their keys (partials fit PART_BYTES)
ODD = 7  # an offset that makes a position odd (not divisible by 16)
# attention decode's key blocks: 64 positions a block up to 4K, 128 up to 16K; positions
# where its block count (hence its tile, BB = min(64, pow2(count))) changes class
ONE_TOKEN_ENDS = (100, 256, 320, 576, 1024, 1088, 2048, 2112, 4096, 4224, 6144)
_SAMPLING_KNOBS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                   "presence_penalty", "frequency_penalty")  # fmt: skip


@dataclass(frozen=True)
class Probe:
    """A throwaway prefill: ``tokens`` tokens from position ``start``, with DeltaNet
    snapshots at offsets ``cuts`` inside the chunk."""

    tokens: int
    start: int
    cuts: tuple[int, ...] = ()


@dataclass(frozen=True)
class BatchProbe:
    """A throwaway batched decode step of ``rows`` sequences: row 0 at position ``start``
    of a state of ``capacity`` positions, the others short (on caches of their first
    capacity); ``start`` None: every row short."""

    rows: int
    start: int | None = None
    capacity: int = 0


# A capacity whose batched attention plan has split blocks not a multiple of 16 (Triton
# specializes on it): what a cache of 36K or 80K positions replays; 33 blocks of 128 here.
ODD_CAPACITY = MIN_BUCKET + 128


def batch_probes(max_running: int, capacity: int, limit: int | None = None) -> list[BatchProbe]:
    """The batched steps to warm: every batch size from 2 to ``max_running`` (at most
    MAX_RUNNING), each with every row short (context bound INITIAL_CAPACITY), with one row
    at each context bucket of a state of ``capacity`` positions (its last start), and one
    at the end of ODD_CAPACITY positions (where the context ``limit`` allows)."""
    last: dict[int, int] = {}
    for s in decode_starts(capacity):
        last[context_bucket(s, capacity)] = s
    rows0 = [BatchProbe(0)] + [BatchProbe(0, s, capacity) for s in sorted(last.values())]
    if ODD_CAPACITY <= (limit or capacity) and ODD_CAPACITY != capacity:
        rows0.append(BatchProbe(0, ODD_CAPACITY - 1, ODD_CAPACITY))
    return [BatchProbe(b, p.start, p.capacity)
            for b in range(2, min(max_running, MAX_RUNNING) + 1) for p in rows0]  # fmt: skip


def gemm_shapes(cfg: ModelConfig) -> list[tuple[int, int]]:
    """(N, K) of the packed GEMMs a prefill chunk runs outside the MoE: the fused DeltaNet
    and attention input projections and the two output projections."""
    attn_in = (
        2 * cfg.num_attention_heads * cfg.head_dim + 2 * cfg.num_key_value_heads * cfg.head_dim
    )
    dn_in = cfg.conv_dim + cfg.value_dim + 2 * cfg.linear_num_value_heads
    d = cfg.hidden_size
    return [
        (dn_in, d),
        (attn_in, d),
        (d, cfg.value_dim),
        (d, cfg.num_attention_heads * cfg.head_dim),
    ]


def table_choices(cfg: ModelConfig, t: int, arch: Arch = DEFAULT, x_bytes: int = 2) -> tuple:
    """What the prefill's tile tables pick for a chunk of ``t`` tokens on ``arch`` (x's
    elements of ``x_bytes``): each dense GEMM's tile, the MoE's tiles and the router's.
    Unwrapped from the tables' caches, so a scan over lengths evicts none of the engine's."""
    from lily.ops.moe_prefill import moe_prefill_config, router_gemm_config
    from lily.ops.qgemm import gemm_config

    gs = cfg.quantization.group_size if cfg.quantization else 64
    gemms = tuple(gemm_config.__wrapped__(t, n, kk, gs, arch, x_bytes)
                  for n, kk in gemm_shapes(cfg))  # fmt: skip
    moe = moe_prefill_config.__wrapped__(t, cfg.num_experts_per_tok, cfg.num_experts, arch)
    return gemms, moe, router_gemm_config.__wrapped__(t, gs, arch)


def chunk_lengths(cfg: ModelConfig, chunk: int, arch: Arch = DEFAULT,
                  x_bytes: int = 2) -> list[int]:  # fmt: skip
    """Representative chunk lengths in 2..chunk: every GEMV row count, and from each run of
    lengths that the tile tables of ``arch`` treat alike (``table_choices``), one length
    for each divisibility class of its ints (the length, the MoE's block-map size, T x H)
    and the run's longest."""
    from lily.ops.launch import cdiv
    from lily.ops.moe_prefill import moe_prefill_config

    k, e = cfg.num_experts_per_tok, cfg.num_experts
    shared = cfg.shared_expert_intermediate_size > 0

    def classes(t: int) -> tuple[bool, bool, bool]:
        bm = moe_prefill_config(t, k, e, arch).block_m
        tiles = cdiv(t * k, bm) + e + (cdiv(t, bm) if shared else 0)  # as moe_prefill sizes it
        rows = t * cfg.num_attention_heads  # attention's split combine takes T x H rows
        return t % 16 == 0, tiles % 16 == 0, rows % 16 == 0

    out = set(range(2, min(GEMV_ROWS, chunk) + 1))
    runs: list[list[int]] = []
    prev = None
    for t in range(GEMV_ROWS + 1, chunk + 1):
        sig = table_choices(cfg, t, arch, x_bytes)
        if sig != prev:
            runs.append([])
            prev = sig
        runs[-1].append(t)
    for run in runs:
        seen: dict[tuple[bool, ...], int] = {}
        for t in run:
            seen.setdefault(classes(t), t)
        out |= set(seen.values()) | {run[-1]}
    return sorted(out)


def _cuts(t: int, how: str) -> tuple[int, ...]:
    if how == "two" and t >= 3:  # a fresh chat prompt: system prompt end, last turn start
        c1 = max(1, t // 3) | 1
        return (c1, t - 2) if t - 2 > c1 else (c1,)
    if how == "one" and t >= 2:  # a resumed prompt: its last turn start
        return (max(1, t - 5),)
    return ()


def prefill_probes(cfg: ModelConfig, chunk: int, max_context: int, arch: Arch = DEFAULT,
                   x_bytes: int = 2) -> list[Probe]:  # fmt: skip
    """The throwaway prefills (chunks that do not fit ``max_context`` are left out), over
    the tables of ``arch``."""
    probes = []
    for t in chunk_lengths(cfg, chunk, arch, x_bytes):
        probes += [
            Probe(t, 0, _cuts(t, "two")),
            Probe(t, chunk),
            Probe(t, chunk + ODD, _cuts(t, "one")),
        ]
        if t <= SPLIT_CHUNK:
            probes += [Probe(t, LONG_HISTORY), Probe(t, LONG_HISTORY + ODD, _cuts(t, "one"))]
    probes += [Probe(1, end - 1) for end in ONE_TOKEN_ENDS]
    # NOTE: one position is kept free: a request's first decode step follows its prompt.
    return [p for p in probes if p.start + p.tokens < max_context]


def decode_starts(capacity: int) -> list[int]:
    """Positions whose decode steps cover every context bucket of a state of ``capacity``
    positions (the runner's buckets are powers of two from 4,096, capped at the capacity;
    a start per power of two covers them whatever the smallest is)."""
    out, b = {capacity - 1}, 256
    while b < capacity:
        out.add(b - 1)
        b *= 2
    return sorted(out)


def sampling_variants(generation_defaults: dict) -> list[SamplingParams]:
    """The device sampler's structures to capture: greedy, and the model's defaults (what a
    request that sets nothing gets)."""
    known = {f.name for f in fields(SamplingParams)}
    kw = {n: generation_defaults[n] for n in _SAMPLING_KNOBS
          if n in known and generation_defaults.get(n) is not None}  # fmt: skip
    out = [SamplingParams(temperature=0.0)]
    try:
        default = SamplingParams(**kw)
        default.validate()
    except (TypeError, ValueError):  # a bad generation_config: requests will say so
        return out
    return out + [default]


def kernel_variants() -> dict[str, int]:
    """Compiled variants per kernel launched through lily.ops.launch.launched (GPU only)."""
    from lily.ops.launch import Launched

    out = {}
    for name, mod in list(sys.modules.items()):
        if not name.startswith("lily.ops.") or mod is None:
            continue
        for attr, v in vars(mod).items():
            if isinstance(v, Launched) and v.cache:
                out[f"{name.removeprefix('lily.ops.')}.{attr}"] = len(v.cache)
    return out


def warm_up(engine, *, progress: bool = True, force: bool = False,
            probes: list[Probe] | None = None, context: int = WARM_CONTEXT,
            log: Callable[[str], None] | None = None,
            max_running: int | None = None) -> dict:  # fmt: skip
    """Run the warm-up (see the module docstring) and return what it did: runs, seconds,
    kernel variants compiled or loaded. ``force`` runs it on the reference path too
    (tests); ``probes`` replaces the prefill probes; ``context`` is the working state's
    capacity whose decode buckets are captured; ``max_running`` the largest batch to warm
    (default the engine's ``max_running``)."""
    runner = engine.runner
    if not engine.model.kernels and not force:
        return {"skipped": "the reference path compiles nothing"}
    if probes is None:
        arch = current_arch(torch.device(engine.engine_cfg.device))
        x_bytes = engine.dtype.itemsize
        probes = prefill_probes(engine.cfg, engine.engine_cfg.prefill_chunk, engine.max_context,
                                arch, x_bytes)  # fmt: skip
    state = engine.state
    context = min(context, engine.max_context)
    cap = max(context, *(c.capacity for c in state.kv.values()))
    starts = [s for s in decode_starts(cap) if s >= state.length]
    variants = sampling_variants(engine.generation_defaults) if runner.device_decode else []
    if max_running is None:
        max_running = getattr(engine.engine_cfg, "max_running", 1)
    batches = batch_probes(max_running, kv_capacity(context, engine.max_context),
                           engine.max_context)  # fmt: skip
    row_variants = sampling_variants(engine.generation_defaults) if runner.rows_sampler else []
    before = kernel_variants()
    n_batch = len(batches) * (1 + len(row_variants))
    bar = _bar(len(probes) + len(starts) * (1 + len(variants)) + n_batch, progress)
    cuda = torch.device(engine.engine_cfg.device).type == "cuda"
    t0 = time.perf_counter()
    with torch.inference_mode():
        scratch = SessionState.new(engine.cfg, engine.engine_cfg.device, engine.dtype,
                                   engine.max_context)  # fmt: skip
        for p in probes:
            run_probe(runner, scratch, p, engine.cfg.vocab_size, cuda)
            bar.update(1)
        del scratch
        _decode_steps(engine, starts, variants, context, bar, cuda)
        _batch_steps(engine, batches, row_variants, bar, cuda)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()  # the scratch state and its chunks' temporaries
    bar.close()
    after = kernel_variants()
    report = {
        "seconds": time.perf_counter() - t0,
        "prefill_runs": len(probes),
        "decode_runs": len(starts) * (1 + len(variants)),
        "batch_runs": n_batch,
        "kernel_variants": sum(after.values()),
        "new_variants": sum(after.values()) - sum(before.values()),
    }
    (log or _stderr)(
        f"kernels ready in {report['seconds']:.1f} s: {report['prefill_runs']} prefill, "
        f"{report['decode_runs']} decode and {report['batch_runs']} batched decode warm-up "
        f"runs, {report['new_variants']} kernel variants compiled or loaded from Triton's "
        "cache"
    )
    return report


def run_probe(runner, scratch: SessionState, p: Probe, vocab: int, sync: bool) -> None:
    """One probe on the scratch state (its contents do not matter, only its shapes);
    ``sync``: wait for the device after it."""
    for s in scratch.deltanet.values():  # keep the scratch recurrence bounded
        s.conv.zero_()
        s.recurrent.zero_()
    scratch.length = p.start
    scratch.tokens.clear()
    scratch.reserve(p.start + p.tokens + 1)
    ids = [(7 * i + 11) % vocab for i in range(p.tokens)]
    try:
        runner.prefill_snapshots(ids, scratch, [p.start + c for c in p.cuts])
        if sync:
            # NOTE: a fault is reported at the next synchronisation; waiting here names the
            # probe that caused it (the warm-up is bound by compiles, not by this wait).
            torch.cuda.synchronize()
    except Exception as e:
        raise RuntimeError(f"warm-up: a {p.tokens}-token chunk at position {p.start} (cuts "
                           f"{list(p.cuts)}) failed: {type(e).__name__}: {e}") from e  # fmt: skip


def _decode_steps(engine, starts: list[int], variants: list[SamplingParams], context: int,
                  bar, cuda: bool) -> None:  # fmt: skip
    """Decode steps on the working state at ``starts`` (capturing the graphs a request will
    replay), each unsampled and with each sampler structure; the state is put back."""
    state, runner = engine.state, engine.runner
    if not starts:
        return
    length, tokens, snap = state.length, list(state.tokens), state.snapshot_recurrent()
    state.reserve(context)
    tok = min(11, engine.cfg.vocab_size - 1)
    logits = torch.zeros(engine.cfg.vocab_size, dtype=torch.float32, device=engine.model.device)
    try:
        for s in starts:
            for params in [None, *variants]:
                state.length = s
                if params is None:
                    runner.decode(tok, state)
                else:
                    runner.device_decode.start(params, [tok], logits)
                    runner.decode_sampled(state)
                if cuda:  # as in run_probe: a fault names its step
                    try:
                        torch.cuda.synchronize()
                    except Exception as e:
                        raise RuntimeError(
                            f"warm-up: a decode step at position {s} "
                            f"({params or 'unsampled'}) failed: {e}"
                        ) from e
                state.restore(snap, length)
                bar.update(1)
    finally:
        state.restore(snap, length)
        state.tokens[:] = tokens  # in place: the prefix cache's live entry shares the list
        state.busy = False


SHORT = 100  # a short row's position (its caches of INITIAL_CAPACITY positions)


def _batch_steps(engine, probes: list[BatchProbe], variants: list[SamplingParams], bar,
                 cuda: bool) -> None:  # fmt: skip
    """The batched steps of ``probes`` on scratch states, unsampled and with each sampler
    structure (every row drawn on the device with it); the runner forgets the states."""
    if not probes:
        return
    runner, cfg = engine.runner, engine.cfg
    dev, dtype, limit = engine.engine_cfg.device, engine.dtype, engine.max_context
    n = max(p.rows for p in probes)
    short = [SessionState.new(cfg, dev, dtype, limit, initial_capacity=INITIAL_CAPACITY)
             for _ in range(n)]  # fmt: skip
    short_cap = min(INITIAL_CAPACITY, limit)
    longs = {p.capacity: SessionState.new(cfg, dev, dtype, limit, initial_capacity=p.capacity)
             for p in probes if p.start is not None}  # fmt: skip
    tok = min(11, cfg.vocab_size - 1)
    try:
        for i, p in enumerate(probes):
            rows = short[: p.rows] if p.start is None else [longs[p.capacity], *short[1 : p.rows]]
            starts = [min(SHORT + r, short_cap - 1) for r in range(p.rows)]
            if p.start is not None:
                starts[0] = p.start
            for j, params in enumerate([None, *variants]):
                for st, start in zip(rows, starts, strict=True):  # the same every time
                    st.length = start
                tokens = [tok] * p.rows
                if params is None:
                    runner.decode_rows(tokens, rows)
                else:  # (an owner of its own: each row loads this structure; a seed, as
                    # a request's Seq fixes one)
                    seeded = replace(params, seed=0 if params.seed is None else params.seed)
                    loads = [((("warm-up", i, j, r), 0), seeded, [tok], []) for r in range(p.rows)]
                    runner.decode_rows_drawn(tokens, rows, loads)
                if cuda:  # as in run_probe: a fault names its step
                    try:
                        torch.cuda.synchronize()
                    except Exception as e:
                        raise RuntimeError(f"warm-up: a batched decode step of {p.rows} rows "
                                           f"(row 0 at {p.start}, {params or 'unsampled'}) "
                                           f"failed: {e}") from e  # fmt: skip
                bar.update(1)
    finally:
        runner.forget_rows()  # (the scratch states go; no row keeps a warm-up owner)


def _bar(total: int, progress: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc="warm-up", unit="run", file=sys.stderr, disable=not progress,
                leave=False)  # fmt: skip


def _stderr(msg: str) -> None:
    print(f"lily: {msg}", file=sys.stderr, flush=True)
