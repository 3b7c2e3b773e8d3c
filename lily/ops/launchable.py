"""The registry of launchable kernel configs: every launch the engine can make, per model
variant and GPU architecture, as the compile matrix compiles them (lily/ops/matrix.py).

The launches are not restated here: the engine's runner (lily/runtime/runner.py) runs the
model on the kernels (lily/model/ops.py's dispatch: prefill chunks, decode steps of one
sequence, batched decode steps of 2 to ``MAX_ROWS`` sequences) on meta tensors under
``record_launches`` (nothing is allocated or run), so every op, flag and constexpr is the
one the engine passes. What this module owns is the inputs that reach every entry of every
tile table: the prefill lengths (``prefill_lengths``: the tables scanned over all chunk
lengths, the first length of each choice kept), the decode context lengths
(``decode_lengths``: the attention launch plan scanned over all context lengths), the batch
sizes, the prefix-cache cut inside a chunk, the switched-off forms the benchmarks measure
(moe_prefill's column tile, the batched step's ROWS switches), and the launches a meta run
cannot reach (the flash attention's key split, picked from the SM count of a real GPU).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from lily.config import EngineConfig, ModelConfig
from lily.ops.arch import Arch, force_arch, forced_arch
from lily.ops.launch import record_launches
from lily.ops.matrix import Launch, freeze

# Prefill chunks the tables are scanned over (at most the model's context): twice the
# engine's default chunk (8,192); for the full model every table is constant past 3,073
# rows (tests/ops/test_compile_matrix.py checks it up to the 262,144-token context).
SCAN_ROWS = 16384
# Decode context lengths scanned: at most the full model's context.
MAX_CONTEXT = 262144


@dataclass(frozen=True)
class Variant:
    """A model the engine runs: its shapes (``full`` Qwen3.6-35B-A3B or the ``tiny`` test
    model), weight layout (mlx4: 4-bit with 8-bit routers; mlx8) and compute dtype."""

    model: str
    layout: str = "mlx4"
    dtype: str = "bfloat16"

    @property
    def name(self) -> str:
        return f"{self.model}-{self.layout}-{self.dtype}"


# The default GPU run (bf16 over the 4-bit checkpoint), the 8-bit checkpoint, fp32
# activations (``--dtype float32``), and the tiny test model, whose smaller shapes pick
# other tiles.
VARIANTS = (
    Variant("full", "mlx4"),
    Variant("tiny", "mlx4"),
    Variant("full", "mlx8"),
    Variant("tiny", "mlx8"),
    Variant("full", "mlx4", "float32"),
)


def model_config(v: Variant) -> ModelConfig:
    """The variant's config cut to two layers, one of each kind (every launch a 40-layer
    forward makes, the last layer's included, with 20 times fewer repeats)."""
    from lily.bench.random_model import model_config as named

    cfg = named(v.model, v.layout)
    return dataclasses.replace(cfg, num_hidden_layers=2,
                               layer_types=("linear_attention", "full_attention"))  # fmt: skip


def first_of_each(table: Callable[[int], object], rows: Iterable[int]) -> list[int]:
    """The first row count of ``rows`` at which ``table`` returns each of its outputs."""
    seen: dict = {}
    for t in rows:
        seen.setdefault(table(t), t)
    return sorted(seen.values())


@functools.lru_cache(maxsize=64)
def prefill_lengths(cfg: ModelConfig, arch: Arch, x_bytes: int = 2) -> list[int]:
    """Chunk lengths that reach every entry of the prefill tables for this model and arch:
    1..8 (the decode kernels and the GEMV path), the first length of each distinct choice
    of the tables (``table_choices``, the warm-up's; up to SCAN_ROWS or the model's
    context), and the engine's default chunk."""
    from lily.runtime.warmup import table_choices

    rows = range(2, min(SCAN_ROWS, cfg.max_position_embeddings) + 1)
    out = set(range(1, 9)) | {min(EngineConfig.prefill_chunk, rows[-1])}
    out |= set(first_of_each(lambda t: table_choices(cfg, t, arch, x_bytes), rows))
    return sorted(out)


@functools.lru_cache(maxsize=16)
def decode_lengths(arch: Arch, max_context: int = MAX_CONTEXT) -> list[int]:
    """Context lengths up to ``max_context`` (the decode graph's ``max_len``: a bucket, or
    the KV cache's capacity below it, any length) that reach every attention decode
    variant: the first length of each (split or not, key tile, combine block)."""
    from lily.ops.attention_decode import decode_plan

    def key(n: int) -> tuple:
        split, block_n, nb = decode_plan(n, arch)
        return split > 0, block_n, min(64, 1 << max(0, nb - 1).bit_length())

    return first_of_each(key, range(1, max_context + 1))


def _engine(v: Variant):
    from lily.bench.random_model import random_params
    from lily.model.model import Model
    from lily.runtime.runner import Runner

    cfg = model_config(v)
    dtype = getattr(torch, v.dtype)
    # the kernels with the engine's defaults (PDL and tensor-core GEMVs in decode steps)
    params = random_params(cfg, "meta", v.layout, dtype=dtype)
    model = Model(cfg, params, dtype, kernels=True)
    # one chunk per prefill; decode steps eager (a captured step launches the same kernels
    # with the same arguments: the position is a device tensor either way), host sampling
    runner = Runner(model, SCAN_ROWS, use_graphs=False, sample_on_device=False)
    return cfg, dtype, runner


def _state(cfg: ModelConfig, dtype: torch.dtype, capacity: int = 256):
    from lily.runtime.state import SessionState

    return SessionState.new(cfg, "meta", dtype, MAX_CONTEXT, initial_capacity=capacity)


def _flash_split(cfg: ModelConfig, dtype: torch.dtype) -> None:
    """The flash attention's split-key form: attention_prefill picks it from the GPU's SM
    count, so a meta run never does; any split > 1 launches the same kernels."""
    from lily.ops.attention_prefill import attention_prefill
    from lily.ops.norm_rope import rope_inv_freq

    h, hkv, dh, t = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, 200
    meta = {"device": "meta", "dtype": dtype}
    qkv = torch.empty(t, (2 * h + 2 * hkv) * dh, **meta)
    qg, k, v = qkv.split([2 * h * dh, hkv * dh, hkv * dh], dim=1)
    cache = [torch.empty(hkv, 4096, dh, **meta) for _ in range(2)]
    norms = [torch.empty(dh, **meta) for _ in range(2)]
    inv = rope_inv_freq(cfg.rotary_dim, cfg.rope_theta, "meta")
    attention_prefill(qg, k, v, *norms, *cache, 3000, inv, split=2)


def _rows(cfg: ModelConfig, dtype: torch.dtype, runner, arch: Arch, note) -> None:
    """Batched decode steps (``Runner.decode_rows``, continuous batching): two rows at every
    decode context length (the attention launch plan is the bound's, the longest row's),
    then every batch size up to ``MAX_ROWS`` (the GEMVs, the MoE and the head take the
    rows at once; their tiles depend on the row count, not the context)."""
    from lily.model.ops import MAX_ROWS

    def states(b: int, n: int) -> list:
        out = []
        for r in range(b):  # row 0 at context n, the others shorter (capacity n each)
            s = _state(cfg, dtype, capacity=n)
            s.length = (n - 1) * (b - r) // b
            out.append(s)
        return out

    lengths = decode_lengths(arch, min(MAX_CONTEXT, cfg.max_position_embeddings))
    for n in lengths:
        with record_launches() as rec:
            runner.decode_rows([0, 0], states(2, n))
        note(f"decode rows B=2 context {n}", rec)

    def passed(bs, label: str = "") -> None:
        for b in bs:
            with record_launches() as rec:
                runner.decode_rows([0] * b, states(b, lengths[-1]))
            note(f"decode rows B={b} context {lengths[-1]}" + (f", {label}" if label else ""),
                 rec)  # fmt: skip

    passed(range(3, MAX_ROWS + 1))
    # The batched kernels behind the engine's switches (lily/model/ops.py: ROWS_MOE, the
    # MoE's; ROWS_MMA, the projections' and the head's; ROWS_PREP, their normed rows
    # prepared; lily/ops/qgemv_mma_rows.py OPERAND_POW2, the others' operand on pow2(B),
    # on by default: the switched pass builds it on all the MMA's columns).
    import lily.model.ops as model_ops
    import lily.ops.qgemv_mma_rows as rows_mod

    on = ((model_ops, "ROWS_MOE", True), (model_ops, "ROWS_MMA", True),
          (model_ops, "ROWS_PREP", True), (rows_mod, "OPERAND_POW2", False))  # fmt: skip
    with _switched(on):
        passed(range(2, MAX_ROWS + 1), "ROWS_PREP operand8 ROWS_MOE")


def _cols(cfg: ModelConfig, dtype: torch.dtype, runner, arch: Arch, note) -> None:
    """A prefill chunk with moe_prefill's GEMMs on the column tile (lily/ops/moe_prefill.py
    COLS_MAX_BLOCK_M, off by default): the longest chunk whose token tile it takes."""
    import lily.ops.moe_prefill as mp
    from lily.ops.moe_prefill import moe_prefill_config
    from lily.ops.moe_prefill_cols import COLS_TILE as cap

    top_k, e = cfg.num_experts_per_tok, cfg.num_experts
    fits = [t for t in prefill_lengths(cfg, arch, dtype.itemsize)
            if t > 8 and moe_prefill_config(t, top_k, e, arch).block_m <= cap]  # fmt: skip
    with _switched(((mp, "COLS_MAX_BLOCK_M", cap),)):
        for t in fits[-1:]:
            with record_launches() as rec:
                runner.prefill(list(range(t)), _state(cfg, dtype))
            note(f"prefill T={t}, moe_prefill_cols", rec)


@contextlib.contextmanager
def _switched(switches):
    """Module attributes set to the given values while recording, put back afterwards:
    (module, name, value) each."""
    old = [(m, n, getattr(m, n)) for m, n, _ in switches]
    for m, n, v in switches:
        setattr(m, n, v)
    try:
        yield
    finally:
        for m, n, v in old:
            setattr(m, n, v)


@functools.lru_cache(maxsize=32)
def launches(v: Variant, arch: Arch) -> dict[Launch, list[str]]:
    """Every launch the engine makes for ``v`` on ``arch``, with where it came from
    (cached: callers must not change it)."""
    outer = forced_arch()
    force_arch(arch.name)
    try:
        cfg, dtype, runner = _engine(v)
        found: dict[Launch, list[str]] = {}

        def note(where: str, records: list) -> None:
            for r in records:
                found.setdefault(freeze(r), []).append(where)

        for t in prefill_lengths(cfg, arch, dtype.itemsize):
            ids = list(range(t))
            # from position 0, then after a first chunk (start > 0), with a prefix-cache
            # cut inside the second one (the in-kernel snapshot of the DeltaNet state)
            state = _state(cfg, dtype)
            with record_launches() as rec:
                runner.prefill(ids, state)
                cuts = [state.length + t // 2] if t > 1 else []
                runner.prefill_snapshots(ids, state, cuts)
            note(f"prefill T={t}", rec)
        _cols(cfg, dtype, runner, arch, note)
        for n in decode_lengths(arch, min(MAX_CONTEXT, cfg.max_position_embeddings)):
            state = _state(cfg, dtype, capacity=n)
            state.length = n - 1
            with record_launches() as rec:
                runner.decode(0, state)
            note(f"decode context {n}", rec)
        _rows(cfg, dtype, runner, arch, note)
        with record_launches() as rec:
            _flash_split(cfg, dtype)
        note("prefill, split keys", rec)
        return found
    finally:
        force_arch(outer.name if outer is not None else None)


def config_key(launch: Launch) -> tuple:
    """What makes a kernel config: the kernel, its constexprs and launch options, and its
    tensors' dtypes. Launches differing only in the alignment of a pointer or the
    divisibility of an integer (Triton specializes on both) are compiled once, at the
    first one met: the hints change how wide a load is, not the tiles."""
    dtypes = tuple(a[1] for a in launch.args if isinstance(a, tuple) and a[:1] == ("tensor",))
    return launch.module, launch.name, launch.kwargs, dtypes


def configs(variants: Iterable[Variant], arch: Arch) -> dict[tuple, tuple[Launch, list[str]]]:
    """Every distinct config (``config_key``) the engine launches on ``arch`` for
    ``variants``: one launch that compiles it and every place it is launched."""
    out: dict[tuple, tuple[Launch, list[str]]] = {}
    for v in variants:
        for launch, where in launches(v, arch).items():
            entry = out.setdefault(config_key(launch), (launch, []))
            entry[1].extend(f"{v.name} {w}" for w in where)
    return out
