"""Random checkpoints for tests and ``lily init``.

``write_random_checkpoint`` writes a complete model directory (config.json,
generation_config.json, safetensors, tokenizer) in the MLX 4-bit or 8-bit layout that
``mlx_lm.convert`` produces or in the official Hugging Face layout. Tensor names come from
``lily.weights.expected_tensors``, so the loader stays the one place that knows them.
Safetensors files are written by a small streaming writer: one tensor is generated, written
and dropped at a time, so the full 19.5 GB model needs little memory. Quantized weights
are generated as codes, scales and biases directly instead of quantizing a dense matrix.
Two inits: "plain" (every weight about normal(0, 0.02)) and, in the MLX layouts,
"conditioned": the benchmark model of lily/bench/conditioned.py, the same bytes
``random_params(cfg, "cpu", layout, seed)`` builds.
"""

from __future__ import annotations

import copy
import json
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from lily.config import ModelConfig
from lily.weights import expected_tensors

_LAYERS = ["linear_attention"] * 3 + ["full_attention"]

# The tiny model of the tests and of the built-in tiny engine. Every input dim is a
# multiple of 64, so MLX group-64 quantization applies to every linear.
TINY_TEXT_CONFIG: dict[str, Any] = {
    "model_type": "qwen3_5_moe_text",
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "layer_types": list(_LAYERS),
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [3, 3, 2],  # sums to rotary_dim / 2 = 8, as [11, 11, 10] to 32
        "mrope_interleaved": True,
    },
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 32,
    "linear_num_value_heads": 4,
    "linear_value_head_dim": 32,
    "linear_conv_kernel_dim": 4,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "vocab_size": 512,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "attention_bias": False,
}

# The shapes of Qwen3.6-35B-A3B (docs: shared/MODEL.md), for ``lily init``.
FULL_TEXT_CONFIG: dict[str, Any] = {
    **TINY_TEXT_CONFIG,
    "hidden_size": 2048,
    "num_hidden_layers": 40,
    "layer_types": _LAYERS * 10,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "rope_parameters": {
        **TINY_TEXT_CONFIG["rope_parameters"],
        "mrope_section": [11, 11, 10],
    },
    "linear_num_key_heads": 16,
    "linear_key_head_dim": 128,
    "linear_num_value_heads": 32,
    "linear_value_head_dim": 128,
    "num_experts": 256,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "vocab_size": 248320,
    "max_position_embeddings": 262144,
}

Layout = Literal["mlx4", "mlx8", "hf"]
_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
_ST_DTYPES = {
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float32: "F32",
    torch.int32: "U32",
}
_GROUP = 64


def complete_text_config(text_config: dict[str, Any]) -> dict[str, Any]:
    """``text_config`` with every missing field taken from the full model, as ModelConfig's
    defaults are (an empty dict is Qwen3.6-35B-A3B); ``layer_types`` follows the layer count
    and ``full_attention_interval`` when not given."""
    tc = {**copy.deepcopy(FULL_TEXT_CONFIG), **copy.deepcopy(text_config)}
    if "layer_types" not in text_config:
        every = int(tc.pop("full_attention_interval", 4))
        tc["layer_types"] = [
            "full_attention" if (i + 1) % every == 0 else "linear_attention"
            for i in range(int(tc["num_hidden_layers"]))
        ]
    return tc


def make_config(text_config: dict[str, Any], layout: Layout, dtype: torch.dtype) -> dict:
    """The config.json of a checkpoint: the official nesting, plus for MLX layouts the
    ``quantization`` block exactly as mlx_lm.convert writes it (routers at 8 bits)."""
    tc = {**copy.deepcopy(text_config), "dtype": _DTYPE_NAMES[dtype]}
    tc.setdefault("model_type", "qwen3_5_moe_text")
    top: dict[str, Any] = {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "text_config": tc,
        "tie_word_embeddings": bool(tc.get("tie_word_embeddings", False)),
    }
    if layout != "hf":
        bits = {"mlx4": 4, "mlx8": 8}[layout]
        q: dict[str, Any] = {"group_size": _GROUP, "bits": bits, "mode": "affine"}
        for i in range(int(tc["num_hidden_layers"])):
            for m in ("mlp.gate", "mlp.shared_expert_gate"):
                q[f"language_model.model.layers.{i}.{m}"] = {"group_size": _GROUP, "bits": 8}
        top["quantization"] = q
        top["quantization_config"] = copy.deepcopy(q)
    return dict(sorted(top.items()))


def _random_float(key: str, shape: tuple[int, ...], layout: Layout, g: torch.Generator):
    """Values that keep a random model's activations sane (fp32)."""
    t = torch.empty(shape, dtype=torch.float32)
    if key.endswith("A_log"):
        return t.uniform_(1.0, 16.0, generator=g).log_()
    if key.endswith("dt_bias"):
        return t.normal_(1.0, 0.1, generator=g)
    if "conv1d" in key:
        return t.uniform_(-0.5, 0.5, generator=g)
    if len(shape) == 1:  # RMSNorm weights: HF stores offsets from 1, except linear_attn.norm
        offset = layout == "hf" and not key.endswith("linear_attn.norm.weight")
        return t.normal_(0.0 if offset else 1.0, 0.05, generator=g)
    return t.normal_(0.0, 0.02, generator=g)


def _random_quant(
    shapes: list[tuple[int, ...]], dtype: torch.dtype, g: torch.Generator, rng: np.random.Generator
):
    """Random codes with scales and biases so that w = s*q + b is about normal(0, 0.02)."""
    wshape, sshape = shapes[0], shapes[1]
    bits = wshape[-1] * 32 // (sshape[-1] * _GROUP)
    # numpy draws uint32 words about twice as fast as torch's random_
    words = torch.from_numpy(rng.integers(0, 2**32, size=wshape, dtype=np.uint32).view(np.int32))
    levels = 2**bits
    # uniform codes on 0..levels-1 have standard deviation sqrt((levels^2 - 1) / 12)
    step = 0.02 / math.sqrt((levels * levels - 1) / 12)
    scales = torch.empty(sshape).uniform_(0.8 * step, 1.2 * step, generator=g)
    biases = -scales * (levels - 1) / 2 + torch.empty(sshape).normal_(0, 0.002, generator=g)
    return [words, scales.to(dtype), biases.to(dtype)]


def _tensors(
    cfg: ModelConfig, layout: Layout, dtype: torch.dtype, seed: int, init: str = "plain"
) -> tuple[list[tuple[str, str, tuple[int, ...]]], Iterator[list[torch.Tensor]]]:
    """(key, safetensors dtype, shape) of every tensor, and a generator of their values
    group by group in the same order."""
    groups = expected_tensors(cfg, "hf" if layout == "hf" else "mlx")

    def st_dtype(key: str, kind: str) -> str:
        if kind == "U32":
            return "U32"
        return "F32" if key.endswith("A_log") else _ST_DTYPES[dtype]  # as the official

    specs = [(k, st_dtype(k, kind), tuple(s)) for grp in groups for k, s, kind in grp]

    def values() -> Iterator[list[torch.Tensor]]:
        g, rng = torch.Generator().manual_seed(seed), np.random.default_rng(seed)
        for grp in groups:
            if grp[0][2] == "U32":
                yield _random_quant([s for _, s, _ in grp], dtype, g, rng)
            else:
                yield [
                    _random_float(k, s, layout, g).to(
                        torch.float32 if k.endswith("A_log") else dtype
                    )
                    for k, s, _ in grp
                ]

    if init == "conditioned":
        return specs, _conditioned_values(cfg, layout, dtype, seed)
    return specs, values()


def _conditioned_values(cfg: ModelConfig, layout: Layout, dtype: torch.dtype, seed: int
                        ) -> Iterator[list[torch.Tensor]]:  # fmt: skip
    """The well-conditioned model's tensors (lily/bench/conditioned.py), group by group as
    ``expected_tensors(cfg, "mlx")`` lists them: the bytes ``random_params(cfg, "cpu",
    layout, seed)`` builds, one parameter at a time."""
    from lily.bench.conditioned import DEFAULT
    from lily.bench.random_tensors import packing, random_tensor
    from lily.quant import QuantWeight
    from lily.weights import canonical_shapes

    bits = packing(cfg, layout)
    cpu = torch.device("cpu")
    for name, shape in canonical_shapes(cfg).items():
        w = random_tensor(cfg, name, shape, bits[name], cpu, seed, dtype, DEFAULT)
        if isinstance(w, QuantWeight):
            yield [w.qweight, w.scales.to(dtype), w.biases.to(dtype)]
        else:
            yield [w.unsqueeze(-1) if name.endswith("conv1d") else w]  # MLX conv: (C, K, 1)


def _nbytes(st: str, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * (4 if st in ("F32", "U32") else 2)


def _write_shards(out: Path, specs, values, shard_bytes: int, progress: bool) -> None:
    """Stream tensors into safetensors shards (an index is written when there are several)."""
    shards: list[list[tuple[str, str, tuple[int, ...]]]] = [[]]
    size = 0
    for spec in specs:
        n = _nbytes(spec[1], spec[2])
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += n
    total = sum(_nbytes(s, sh) for _, s, sh in specs)
    bar = None
    if progress and total > (1 << 30):
        from tqdm import tqdm

        bar = tqdm(total=total, unit="B", unit_scale=True, desc="writing", file=sys.stderr)
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    pending: list[torch.Tensor] = []
    weight_map = {}
    for name, shard in zip(names, shards, strict=True):
        header: dict[str, Any] = {"__metadata__": {"format": "mlx"}}
        offset = 0
        for key, st, shape in shard:
            n = _nbytes(st, shape)
            header[key] = {"dtype": st, "shape": list(shape), "data_offsets": [offset, offset + n]}
            offset += n
            weight_map[key] = name
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # safetensors pads the header to 8 bytes
        with (out / name).open("wb") as f:
            f.write(len(raw).to_bytes(8, "little"))
            f.write(raw)
            for key, st, shape in shard:
                if not pending:
                    pending = list(next(values))
                t = pending.pop(0)
                assert tuple(t.shape) == shape and _ST_DTYPES[t.dtype] == st, key
                f.write(memoryview(t.contiguous().view(torch.uint8).numpy()))
                if bar is not None:
                    bar.update(t.numel() * t.element_size())
    if bar is not None:
        bar.close()
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _special_ids(out: Path) -> dict[str, int]:
    tok = json.loads((out / "tokenizer.json").read_text())
    return {t["content"]: t["id"] for t in tok.get("added_tokens", [])}


def write_random_checkpoint(
    out_dir: str | Path,
    text_config: dict[str, Any],
    layout: Layout,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    *,
    shard_bytes: int = 5 << 30,
    progress: bool = True,
    init: Literal["plain", "conditioned"] = "plain",
) -> Path:
    """Write a random model directory for ``text_config`` and return its path.

    ``layout``: "mlx4" / "mlx8" (what ``mlx_lm.convert -q`` writes, routers at 8 bits) or
    "hf" (official: ``model.language_model.`` keys, fused experts, norm offsets). ``dtype``
    is the dense and scale dtype. Files over ``shard_bytes`` are split with an index.
    Fields missing from ``text_config`` take the full model's values. ``init``: "plain"
    (every weight about normal(0, 0.02): rounding-chaotic at full size) or "conditioned"
    (lily/bench/conditioned.py; MLX layouts only), the benchmark model.
    Old safetensors files are unlinked, not overwritten, so a process that has them
    memory-mapped keeps valid data.
    """
    if layout not in ("mlx4", "mlx8", "hf"):
        raise ValueError(f"layout must be 'mlx4', 'mlx8' or 'hf', got {layout!r}")
    if init not in ("plain", "conditioned"):
        raise ValueError(f"init must be 'plain' or 'conditioned', got {init!r}")
    if init == "conditioned" and layout == "hf":
        raise ValueError("the conditioned init is written in the MLX layouts (mlx4, mlx8)")
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"dtype must be bfloat16, float16 or float32, got {dtype}")
    text_config = complete_text_config(text_config)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    from lily.tokenizer_files import write_test_tokenizer  # lazy: a heavier import

    write_test_tokenizer(out, int(text_config["vocab_size"]))
    ids = _special_ids(out)
    eos = [ids[t] for t in ("<|im_end|>", "<|endoftext|>") if t in ids]
    tc = {**text_config}
    if "<|endoftext|>" in ids:
        tc["eos_token_id"] = ids["<|endoftext|>"]
    config = make_config(tc, layout, dtype)
    cfg = ModelConfig.from_dict(config)  # validates the config as the loader will see it
    (out / "config.json").write_text(json.dumps(config, indent=4))
    # the model card's defaults for the (default) thinking mode
    gen = {"do_sample": True, "eos_token_id": eos, "temperature": 1.0, "top_k": 20, "top_p": 0.95}
    if "<|endoftext|>" in ids:
        gen["pad_token_id"] = ids["<|endoftext|>"]
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    for old in [*out.glob("*.safetensors"), out / "model.safetensors.index.json"]:
        old.unlink(missing_ok=True)
    specs, values = _tensors(cfg, layout, dtype, seed, init)
    _write_shards(out, specs, values, shard_bytes, progress)
    return out
