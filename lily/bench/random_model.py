"""Random weights in the exact MLX 4-bit layout, built directly on the device.

Speed does not depend on weight values, so benchmarks run a random model of the real shape
(docs: shared/BENCH.md). ``random_params`` fills the canonical parameters
(docs/CONTRACTS.md) on the device in seconds, routers at 8 bits, group 64: by default the
well-conditioned model of lily/bench/conditioned.py (bf16 agrees with fp32 through the
40 layers, so full-size consistency checks mean something), or with ``recipe=None`` the
plain init (random codes, every weight about normal(0, 0.02): rounding-chaotic at full
size, docs/notes/fidelity.md). Each tensor has its own generator seeded from (seed,
name), so a worker process on the same device builds the same bytes.
``save_mlx_checkpoint`` writes those bytes to disk for MLX-LM and for timing a load;
tensor names come from ``lily.weights.expected_tensors``.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import torch

from lily.bench import conditioned
from lily.bench.conditioned import Recipe
from lily.bench.random_tensors import packing, random_tensor
from lily.config import ModelConfig
from lily.quant import QuantWeight, Weight
from lily.weights import canonical_shapes, expected_tensors


def text_config(name: str) -> dict[str, Any]:
    """The text config of the ``tiny`` test model or of the ``full`` Qwen3.6-35B-A3B."""
    from lily.checkpoint import FULL_TEXT_CONFIG, TINY_TEXT_CONFIG

    configs = {"tiny": TINY_TEXT_CONFIG, "full": FULL_TEXT_CONFIG}
    if name not in configs:
        raise ValueError(f"unknown random model {name!r} (expected 'tiny' or 'full')")
    return dict(configs[name])


def model_config(name: str, layout: str = "mlx4") -> ModelConfig:
    """ModelConfig of a named random model as the loader would read it from disk."""
    from lily.checkpoint import make_config

    return ModelConfig.from_dict(make_config(text_config(name), layout, torch.bfloat16))


def hot_experts(num_experts: int, seed: int) -> list[int]:
    """The experts a skewed router favours: 1 in 32 (8 of 256), chosen by ``seed``."""
    g = torch.Generator().manual_seed(seed + 7)
    return sorted(torch.randperm(num_experts, generator=g)[: max(1, num_experts // 32)].tolist())


def skew_router(w: Weight, skew: float, hot: list[int]) -> Weight:
    """A copy of router ``w`` (E, D) whose ``hot`` rows are scaled by ``1 + skew``.

    A larger row norm widens that expert's logit distribution, so it lands in the top-k
    far more often (with skew 2, about 5x its even share with the plain init's router,
    about 2x with the conditioned model's): uneven groups as real routing.
    """
    f = 1.0 + skew
    if isinstance(w, QuantWeight):
        scales, biases = w.scales.clone(), w.biases.clone()
        scales[hot] *= f
        biases[hot] *= f
        return QuantWeight(w.qweight, scales, biases, w.bits, w.group_size)
    out = w.clone()
    out[hot] *= f
    return out


def skewed_params(
    params: dict[str, Weight], num_experts: int, skew: float, seed: int = 0
) -> dict[str, Weight]:
    """``params`` with every expert router skewed (other tensors shared, not copied)."""
    hot = hot_experts(num_experts, seed)
    return {k: skew_router(w, skew, hot) if k.endswith("moe.router") else w
            for k, w in params.items()}  # fmt: skip


def random_params(
    cfg: ModelConfig,
    device: str | torch.device,
    layout: str = "mlx4",
    seed: int = 0,
    router_skew: float = 0.0,
    dtype: torch.dtype = torch.bfloat16,
    recipe: Recipe | None = conditioned.DEFAULT,
) -> dict[str, Weight]:
    """Canonical parameters of a random model in MLX layout, generated on ``device``.

    ``dtype`` is that of dense tensors (norms, conv, dt_bias; A_log stays fp32), as
    ``load_params`` gives them; scales and biases are bf16 as MLX stores them.
    ``recipe``: the conditioned model's statistics (default), or None for the plain init
    (uniform random weights: rounding-chaotic at full size, docs/notes/fidelity.md).
    ``router_skew`` > 0 makes ``hot_experts`` favoured (see ``skew_router``). On the
    ``meta`` device nothing is allocated: shapes and dtypes only.
    """
    device = torch.device(device)
    if router_skew < 0:
        raise ValueError(f"router_skew must be >= 0, got {router_skew}")
    hot = hot_experts(cfg.num_experts, seed)
    bits = packing(cfg, layout)
    params: dict[str, Weight] = {}
    for name, shape in canonical_shapes(cfg).items():
        embed = params.get("embed_tokens") if name == "lm_head" else None
        params[name] = random_tensor(cfg, name, shape, bits[name], device, seed, dtype,
                                     recipe, embed)  # fmt: skip
        if router_skew and name.endswith("moe.router"):
            params[name] = skew_router(params[name], router_skew, hot)
    if cfg.tie_word_embeddings:
        params["lm_head"] = params["embed_tokens"]
    return params


def mute_head_rows(params: dict[str, Weight], first: int) -> dict[str, Weight]:
    """``params`` with an lm_head whose rows from ``first`` on give logit 0 exactly.

    A random model's logits are near-uniform over the whole vocabulary, but the bench's
    tokenizer (lily/tokenizer_files.py) names only its first ids: the rest decode to
    nothing, so a stream would carry no text to time. Zero scales and biases mute those
    rows without changing what a step reads or computes (the same bytes, the same GEMV).
    An lm_head tied to the embedding is left as it is (muting it would change the input).
    """
    head = params["lm_head"]
    if head is params.get("embed_tokens"):
        return params
    if isinstance(head, QuantWeight):
        scales, biases = head.scales.clone(), head.biases.clone()
        scales[first:] = 0
        biases[first:] = 0
        muted: Weight = QuantWeight(head.qweight, scales, biases, head.bits, head.group_size)
    else:
        muted = head.clone()
        muted[first:] = 0
    return params | {"lm_head": muted}


def params_nbytes(params: dict[str, Weight]) -> int:
    seen, n = set(), 0
    for w in params.values():
        if id(w) not in seen:
            seen.add(id(w))
            n += w.nbytes() if isinstance(w, QuantWeight) else w.numel() * w.element_size()
    return n


def fingerprint(params: dict[str, Weight], sample: int = 4096) -> str:
    """A short hash of a strided sample of every tensor: equal bytes, equal fingerprint."""
    h = hashlib.sha256()
    for name in sorted(params):
        w = params[name]
        parts = (w.qweight, w.scales, w.biases) if isinstance(w, QuantWeight) else (w,)
        for t in parts:
            flat = t.reshape(-1)
            stride = max(1, flat.numel() // sample)
            s = flat[::stride][:sample].contiguous().cpu()
            h.update(name.encode())
            h.update(s.view(torch.uint8).numpy().tobytes() if s.numel() else b"")
    return h.hexdigest()[:16]


def _stored(name: str, w: Weight) -> list[torch.Tensor]:
    """A canonical parameter as the tensors an MLX checkpoint stores for it."""
    if isinstance(w, QuantWeight):
        return [w.qweight.view(torch.uint32), w.scales, w.biases]
    if name.endswith("conv1d"):
        return [w.unsqueeze(-1)]  # MLX keeps conv weights as (C, K, 1)
    return [w]


def save_mlx_checkpoint(
    params: dict[str, Weight],
    cfg: ModelConfig,
    text_cfg: dict[str, Any],
    out_dir: str | Path,
    layout: str = "mlx4",
    shard_bytes: int = 5 << 30,
    progress: bool = True,
) -> Path:
    """Write ``params`` as an MLX checkpoint directory (config, safetensors, tokenizer).

    The bytes are exactly those in ``params``, so an engine loading the directory runs on
    the same weights as one holding ``params``.
    """
    from safetensors.torch import save_file

    from lily.checkpoint import make_config
    from lily.tokenizer_files import write_test_tokenizer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_test_tokenizer(out, cfg.vocab_size)
    config = make_config(text_cfg, layout, torch.bfloat16)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    names = list(canonical_shapes(cfg))
    groups = expected_tensors(ModelConfig.from_dict(config), "mlx")
    if len(groups) != len(names):
        raise AssertionError("expected_tensors no longer has one group per parameter")
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = total = 0
    bar = None
    if progress and params_nbytes(params) > (1 << 30):
        from tqdm import tqdm

        bar = tqdm(total=params_nbytes(params), unit="B", unit_scale=True, desc="writing",
                   file=sys.stderr)  # fmt: skip
    files = []

    def flush() -> None:
        nonlocal size
        name = f"model-{len(files) + 1:05d}.safetensors"
        save_file(shards[-1], str(out / name), metadata={"format": "mlx"})
        files.append((name, list(shards[-1])))
        shards.append({})
        size = 0

    for name, group in zip(names, groups, strict=True):
        for (key, shape, _), t in zip(group, _stored(name, params[name]), strict=True):
            if tuple(t.shape) != tuple(shape):
                raise AssertionError(f"{name}: shape {tuple(t.shape)} != {shape} for {key}")
            n = t.numel() * t.element_size()
            if shards[-1] and size + n > shard_bytes:
                flush()
            shards[-1][key] = t.detach().contiguous().cpu()
            size += n
            total += n
            if bar is not None:
                bar.update(n)
    flush()
    if bar is not None:
        bar.close()
    if len(files) == 1:
        (out / files[0][0]).rename(out / "model.safetensors")
    else:
        wmap = {k: f for f, keys in files for k in keys}
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(wmap.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return out
