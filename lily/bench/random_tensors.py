"""Random tensors for the benchmark and test models, one generator per tensor (seed, name):
the plain init (about normal(0, 0.02)) or the well-conditioned one (lily/bench/conditioned.py),
in the MLX layout's bits. Below both the checkpoint writer (lily/checkpoint.py) and the
in-memory builder (lily/bench/random_model.py), which share it."""

from __future__ import annotations

import math
import zlib

import torch

from lily.bench import conditioned
from lily.bench.conditioned import Recipe
from lily.config import ModelConfig
from lily.quant import QuantWeight, Weight
from lily.weights import canonical_shapes

GROUP = 64
ROUTERS = ("moe.router", "moe.shared_expert_gate")  # 8-bit in MLX checkpoints
LAYOUT_BITS = {"mlx4": 4, "mlx8": 8}
_STD = 0.02  # weight standard deviation: keeps 40 layers of activations finite


def packing(cfg: ModelConfig, layout: str = "mlx4") -> dict[str, int | None]:
    """Bits of each canonical parameter in an MLX checkpoint (None: stored dense).

    mlx_lm.convert packs every linear and embedding whose input dim is a multiple of the
    group size; routers at 8 bits. Norms, conv, A_log and dt_bias stay dense.
    """
    if layout not in LAYOUT_BITS:
        raise ValueError(f"layout must be one of {sorted(LAYOUT_BITS)}, got {layout!r}")
    out: dict[str, int | None] = {}
    for name, shape in canonical_shapes(cfg).items():
        leaf = name.rsplit(".", 1)[-1]
        dense = len(shape) < 2 or leaf == "conv1d" or shape[-1] % GROUP
        out[name] = None if dense else 8 if name.endswith(ROUTERS) else LAYOUT_BITS[layout]
    return out


def _generator(device: torch.device, seed: int, name: str) -> torch.Generator | None:
    if device.type == "meta":
        return None
    g = torch.Generator(device=device)
    # NOTE: seeded per tensor, so the bytes do not depend on build order or process.
    g.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (1 << 62))
    return g


def _random_quant(
    shape: tuple[int, ...], bits: int, device: torch.device, g: torch.Generator | None
) -> QuantWeight:
    *lead, n, k = shape
    words = torch.empty((*lead, n, k * bits // 32), dtype=torch.int32, device=device)
    gshape = (*lead, n, k // GROUP)
    if device.type == "meta":  # shapes only
        meta = torch.empty(gshape, dtype=torch.bfloat16, device=device)
        return QuantWeight(words, meta, meta.clone(), bits, GROUP)
    words.random_(-(2**31), 2**31, generator=g)
    levels = 1 << bits
    # uniform codes on 0..levels-1 have standard deviation sqrt((levels^2 - 1) / 12)
    step = _STD / math.sqrt((levels * levels - 1) / 12)
    scales = torch.empty(gshape, device=device).uniform_(0.8 * step, 1.2 * step, generator=g)
    noise = torch.empty(gshape, device=device).normal_(0.0, 0.1 * step, generator=g)
    biases = -scales * (levels - 1) / 2 + noise
    return QuantWeight(words, scales.to(torch.bfloat16), biases.to(torch.bfloat16), bits, GROUP)


def _random_dense(name: str, shape: tuple[int, ...], dtype: torch.dtype, device, g) -> torch.Tensor:
    leaf = name.rsplit(".", 1)[-1]
    t = torch.empty(shape, dtype=torch.float32, device=device)
    if t.device.type == "meta":  # shapes only
        return t if leaf == "A_log" else t.to(dtype)
    if leaf == "A_log":
        return t.uniform_(1.0, 16.0, generator=g).log_()  # kept fp32, as the loader does
    if leaf == "dt_bias":
        t.normal_(1.0, 0.1, generator=g)
    elif leaf == "conv1d":
        t.uniform_(-0.5, 0.5, generator=g)
    elif len(shape) == 1:  # RMSNorm multipliers
        t.normal_(1.0, 0.05, generator=g)
    else:
        t.normal_(0.0, _STD, generator=g)
    return t.to(dtype)


def random_tensor(
    cfg: ModelConfig,
    name: str,
    shape: tuple[int, ...],
    bits: int | None,
    device: torch.device,
    seed: int,
    dtype: torch.dtype,
    recipe: Recipe | None,
    embed: QuantWeight | None = None,
    key: str | None = None,
) -> Weight:
    """One canonical parameter, from its own generator (seed, name): the same bytes
    whichever order or process builds it. ``bits`` None: dense (in ``dtype``; A_log fp32).
    ``recipe`` None: the plain init (every weight ~normal(0, 0.02)); else the conditioned
    model (lily/bench/conditioned.py). Its lm_head needs the embedding (rebuilt if not
    given). ``key`` seeds the generator instead of ``name`` (same draws, other layer)."""
    g = _generator(device, seed, key or name)
    if recipe is None or device.type == "meta":
        if bits is None:
            return _random_dense(name, shape, dtype, device, g)
        return _random_quant(shape, bits, device, g)
    if bits is None:
        t = conditioned.dense(cfg, recipe, name, shape, device, g)
        return t if name.endswith("A_log") else t.to(dtype)
    if name == "embed_tokens":
        return conditioned.embedding(cfg, recipe, bits, device, g)
    if name == "lm_head":
        if embed is None:
            embed = conditioned.embedding(cfg, recipe, bits, device,
                                          _generator(device, seed, "embed_tokens"))  # fmt: skip
        return conditioned.lm_head(cfg, recipe, bits, device, g, embed)
    return conditioned.layer_quant(cfg, recipe, name, shape, bits, device, g)
