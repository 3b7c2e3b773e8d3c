"""Model and engine configuration.

ModelConfig comes only from a checkpoint's ``config.json``; EngineConfig only from the
command line or keyword arguments. Both are frozen: configuration flows one way.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")
# Requests one batched decode step may hold (lily/model/ops.py MAX_ROWS: the DeltaNet
# step's scratch rows; the runner's rows sampler): ``lily serve --max-running`` at most.
MAX_RUNNING = 16


class ConfigError(ValueError):
    """A config.json the engine cannot run; the message names the field."""


@dataclass(frozen=True)
class QuantSpec:
    """How one linear is packed: affine ``bits`` per weight, one scale and bias per group."""

    bits: int
    group_size: int


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 248320
    hidden_size: int = 2048
    num_hidden_layers: int = 40
    layer_types: tuple[str, ...] = ()
    num_attention_heads: int = 16
    num_key_value_heads: int = 2
    head_dim: int = 256
    rope_theta: float = 1e7
    partial_rotary_factor: float = 0.25
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    num_experts: int = 256
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    norm_topk_prob: bool = True
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 262144
    tie_word_embeddings: bool = False
    eos_token_id: tuple[int, ...] = ()
    # Checkpoint-wide quantization (None: unquantized) and per-path overrides, keyed by
    # the checkpoint's module path (e.g. "language_model.model.layers.0.mlp.gate").
    quantization: QuantSpec | None = None
    quant_overrides: tuple[tuple[str, QuantSpec | None], ...] = ()
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    # ---- derived shapes (fixed letters: D hidden, H heads, K/V head dims, E experts)
    @property
    def attn_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "full_attention")

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def key_dim(self) -> int:  # DeltaNet q or k width
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:  # DeltaNet v (and z) width
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    def quant_for(self, path: str) -> QuantSpec | None:
        """Packing of the linear at checkpoint module path ``path`` (MLX naming)."""
        for p, spec in self.quant_overrides:
            if p == path:
                return spec
        return self.quantization

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        top = d
        mt = top.get("model_type")
        if mt not in MODEL_TYPES:
            raise ConfigError(
                f"config.json: model_type {mt!r} is not supported (expected one of {MODEL_TYPES})"
            )
        text = top.get("text_config")
        if mt == "qwen3_5_moe" and isinstance(text, dict):
            tmt = text.get("model_type", "qwen3_5_moe_text")
            if tmt not in MODEL_TYPES:
                raise ConfigError(f"config.json: text_config.model_type {tmt!r} is not supported")
        else:
            text = top
        prefix = "text_config." if text is not top else ""

        def get(name: str, default: Any) -> Any:
            return text.get(name, default)

        rope = get("rope_parameters", None) or get("rope_scaling", None) or {}
        rope_theta = float(rope.get("rope_theta", get("rope_theta", 1e7)))
        prf = float(rope.get("partial_rotary_factor", get("partial_rotary_factor", 0.25)))
        n_layers = int(get("num_hidden_layers", 40))
        layer_types = get("layer_types", None)
        if layer_types is None:
            interval = int(get("full_attention_interval", 4))
            layer_types = [
                "full_attention" if (i + 1) % interval == 0 else "linear_attention"
                for i in range(n_layers)
            ]
        eos = top.get("eos_token_id", get("eos_token_id", None))
        eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)

        quant, overrides = _parse_quant(top.get("quantization") or top.get("quantization_config"))
        hidden = int(get("hidden_size", 2048))
        heads = int(get("num_attention_heads", 16))
        cfg = cls(
            vocab_size=int(get("vocab_size", 248320)),
            hidden_size=hidden,
            num_hidden_layers=n_layers,
            layer_types=tuple(layer_types),
            num_attention_heads=heads,
            num_key_value_heads=int(get("num_key_value_heads", 2)),
            head_dim=int(get("head_dim", 256)),
            rope_theta=rope_theta,
            partial_rotary_factor=prf,
            linear_num_key_heads=int(get("linear_num_key_heads", 16)),
            linear_num_value_heads=int(get("linear_num_value_heads", 32)),
            linear_key_head_dim=int(get("linear_key_head_dim", 128)),
            linear_value_head_dim=int(get("linear_value_head_dim", 128)),
            linear_conv_kernel_dim=int(get("linear_conv_kernel_dim", 4)),
            num_experts=int(get("num_experts", 256)),
            num_experts_per_tok=int(get("num_experts_per_tok", 8)),
            moe_intermediate_size=int(get("moe_intermediate_size", 512)),
            shared_expert_intermediate_size=int(get("shared_expert_intermediate_size", 512)),
            norm_topk_prob=bool(get("norm_topk_prob", True)),
            rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(get("max_position_embeddings", 262144)),
            tie_word_embeddings=bool(
                get("tie_word_embeddings", top.get("tie_word_embeddings", False))
            ),
            eos_token_id=eos,
            quantization=quant,
            quant_overrides=overrides,
            raw=top,
        )
        cfg._validate(prefix)
        return cfg

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        p = Path(path) / "config.json"
        if not p.is_file():
            raise ConfigError(f"{p}: no config.json in the model directory")
        try:
            d = json.loads(p.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{p}: not valid JSON ({e})") from None
        if not isinstance(d, dict):
            raise ConfigError(f"{p}: expected a JSON object")
        return cls.from_dict(d)

    def _validate(self, prefix: str) -> None:
        def need(ok: bool, name: str, why: str) -> None:
            if not ok:
                raise ConfigError(f"config.json: {prefix}{name} {why}")

        for name in (
            "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "linear_num_key_heads", "linear_num_value_heads",
            "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim",
            "num_experts", "num_experts_per_tok", "moe_intermediate_size",
        ):  # fmt: skip
            need(getattr(self, name) > 0, name, f"must be positive, got {getattr(self, name)}")
        need(
            len(self.layer_types) == self.num_hidden_layers,
            "layer_types",
            f"has {len(self.layer_types)} entries for {self.num_hidden_layers} layers",
        )
        bad = sorted(set(self.layer_types) - {"full_attention", "linear_attention"})
        need(not bad, "layer_types", f"has unknown layer kinds {bad}")
        need(
            self.num_attention_heads % self.num_key_value_heads == 0,
            "num_key_value_heads",
            f"({self.num_key_value_heads}) must divide num_attention_heads "
            f"({self.num_attention_heads})",
        )
        need(
            self.linear_num_value_heads % self.linear_num_key_heads == 0,
            "linear_num_value_heads",
            f"({self.linear_num_value_heads}) must be a multiple of linear_num_key_heads "
            f"({self.linear_num_key_heads})",
        )
        need(
            self.num_experts_per_tok <= self.num_experts,
            "num_experts_per_tok",
            f"({self.num_experts_per_tok}) exceeds num_experts ({self.num_experts})",
        )
        rd = self.head_dim * self.partial_rotary_factor
        need(
            rd == int(rd) and int(rd) % 2 == 0 and 0 < rd <= self.head_dim,
            "partial_rotary_factor",
            f"gives a rotary width {rd} that is not an even number of dims <= head_dim",
        )
        need(self.shared_expert_intermediate_size >= 0, "shared_expert_intermediate_size",
             "must not be negative")  # fmt: skip


def _parse_quant(q: Any) -> tuple[QuantSpec | None, tuple[tuple[str, QuantSpec | None], ...]]:
    if not q:
        return None, ()
    if not isinstance(q, dict):
        raise ConfigError("config.json: quantization must be an object")

    def spec(d: dict[str, Any], where: str) -> QuantSpec:
        bits, gs = d.get("bits"), d.get("group_size")
        if bits not in (4, 8):
            raise ConfigError(f"config.json: {where}.bits {bits!r} is not supported (4 or 8)")
        if gs not in (32, 64, 128):
            raise ConfigError(
                f"config.json: {where}.group_size {gs!r} is not supported (32, 64 or 128)"
            )
        if q.get("mode", "affine") != "affine":
            raise ConfigError(f"config.json: quantization.mode {q.get('mode')!r} is not affine")
        return QuantSpec(int(bits), int(gs))

    base = spec(q, "quantization")
    overrides = []
    for k, v in q.items():
        if isinstance(v, dict):
            overrides.append((k, spec({**v}, f"quantization[{k!r}]")))
        elif v is False:
            overrides.append((k, None))
    return base, tuple(overrides)


@dataclass(frozen=True)
class EngineConfig:
    """Runtime choices; set from the command line or keyword arguments only."""

    device: str = "cpu"
    dtype: str = "float32"  # compute dtype for activations: float32 or bfloat16
    prefill_chunk: int = 8192
    # Prefill tokens per step while other requests decode: their streams wait for each
    # such chunk (lily/runtime/batch.py). On the H200, a 4K prompt beside 7 decoding
    # streams: 512 took its first token 2.60x as long as idle, 2048 held the streams 129 ms
    # (the bars: 2x, 100 ms); 1024 took 1.31x and 78 ms (bench/results/concurrency_h200_s5_*).
    decode_prefill_chunk: int = 1024
    max_context: int | None = 262144  # None: the largest the free memory allows
    load_mtp: bool = False
    quantize_on_load: bool = False  # bf16 HF checkpoints: pack to MLX 4-bit at load
    use_kernels: bool = False  # Triton paths (GPU); the reference path otherwise
    prefix_cache_gb: float = 1.0  # saved session states on the device (0 disables reuse)
    prefix_cache_host_gb: float = 0.0  # where they spill to when the device budget is full
    # Kernel tables and switches of another GPU architecture ("sm_89": its small-shared-
    # memory tiles, no PDL, no warpgroup MMA), to measure a fallback on an H200; None: the
    # device's own (lily/ops/arch.py).
    gpu_arch: str | None = None
    # Requests decoded together at most (``lily serve --max-running``): the memory plan
    # reserves the batched steps' buffers and the warm-up compiles them up to it.
    max_running: int = 1
