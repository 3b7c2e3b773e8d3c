"""Checkpoint loading: the one place that knows checkpoint tensor names.

``load_params`` reads an MLX (``mlx_lm.convert``) or Hugging Face checkpoint and returns
the canonical parameters of docs/CONTRACTS.md. Every safetensors header is parsed and
checked first (lily/safetensors_files.py), so a truncated or mislabelled file gives a
CheckpointError naming the tensor and file instead of a crash, and a bad checkpoint fails
before gigabytes are read. Tensors are then read one at a time (memory-mapped), moved to
the device and dropped, so the load never holds the model twice.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from safetensors import safe_open

from lily.config import ModelConfig
from lily.quant import QuantWeight, Weight, quantize
from lily.safetensors_files import CheckpointError, Entry, index_checkpoint

_FLOATS = ("F32", "F16", "BF16")
PROGRESS_MIN_BYTES = 1 << 30
_SKIP_PREFIXES = ("model.visual.", "visual.", "vision_tower", "model.vision_tower")
# HF stores these RMSNorm weights as offsets from 1 (linear_attn.norm is a plain multiplier).
_OFFSET_NORMS = ("input_norm", "post_norm", "q_norm", "k_norm")
_GROUP = 64  # quantize_on_load group size, as mlx_lm.convert


@dataclass
class _Plan:
    """Checkpoint keys with their expected (shape, dtype kind), and how to build names."""

    parts: list[tuple[str, tuple[int, ...], str]]
    build: Callable[[list[torch.Tensor]], dict[str, Weight]]


def canonical_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Logical shape of every canonical parameter, in load order."""
    D, V, E = cfg.hidden_size, cfg.vocab_size, cfg.num_experts
    Dh, H, Hkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    Hv, Vd = cfg.linear_num_value_heads, cfg.linear_value_head_dim
    # Ie: expert intermediate (I in CONTRACTS.md; ruff forbids the name I), Is: shared
    Ie, Is = cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    s: dict[str, tuple[int, ...]] = {"embed_tokens": (V, D)}
    for i, kind in enumerate(cfg.layer_types):
        p = f"layers.{i}."
        s[p + "input_norm"] = s[p + "post_norm"] = (D,)
        if kind == "full_attention":
            s |= {p + "attn.q_proj": (H * 2 * Dh, D), p + "attn.k_proj": (Hkv * Dh, D)}
            s |= {p + "attn.v_proj": (Hkv * Dh, D), p + "attn.o_proj": (D, H * Dh)}
            s |= {p + "attn.q_norm": (Dh,), p + "attn.k_norm": (Dh,)}
        else:
            s |= {p + "dn.in_proj_qkv": (cfg.conv_dim, D), p + "dn.in_proj_z": (Hv * Vd, D)}
            s |= {p + "dn.in_proj_b": (Hv, D), p + "dn.in_proj_a": (Hv, D)}
            s |= {p + "dn.conv1d": (cfg.conv_dim, cfg.linear_conv_kernel_dim)}
            s |= {p + "dn.A_log": (Hv,), p + "dn.dt_bias": (Hv,), p + "dn.norm": (Vd,)}
            s |= {p + "dn.out_proj": (D, Hv * Vd)}
        s |= {p + "moe.router": (E, D), p + "moe.gate_proj": (E, Ie, D)}
        s |= {p + "moe.up_proj": (E, Ie, D), p + "moe.down_proj": (E, D, Ie)}
        if Is:
            s |= {p + "moe.shared_gate_proj": (Is, D), p + "moe.shared_up_proj": (Is, D)}
            s |= {p + "moe.shared_down_proj": (D, Is), p + "moe.shared_expert_gate": (1, D)}
    s["norm"] = (D,)
    if not cfg.tie_word_embeddings:
        s["lm_head"] = (V, D)
    return s


# canonical name (after "layers.i.") -> checkpoint module path (after "layers.i.")
_MODULES = {
    "input_norm": "input_layernorm", "post_norm": "post_attention_layernorm",
    "attn.": "self_attn.", "dn.": "linear_attn.", "moe.router": "mlp.gate",
    "moe.shared_expert_gate": "mlp.shared_expert_gate", "moe.shared_": "mlp.shared_expert.",
    "moe.": "mlp.switch_mlp.",
}  # fmt: skip


def _module_path(name: str) -> str:
    if not name.startswith("layers."):
        return name
    _, i, rest = name.split(".", 2)
    for a, b in _MODULES.items():
        if rest.startswith(a):
            return f"layers.{i}.{b}{rest[len(a) :]}"
    raise AssertionError(name)


def _detect_layout(keys: list[str]) -> tuple[str, str, str]:
    """(kind "mlx" or "hf", module prefix, lm_head prefix) from the key names."""
    body = [k for k in keys if not k.startswith(_SKIP_PREFIXES) and not k.startswith("mtp.")]
    for kind, prefix, head in (
        ("mlx", "language_model.model.", "language_model.lm_head"),
        ("hf", "model.language_model.", "lm_head"),
        ("hf", "model.", "lm_head"),
    ):
        if any(k.startswith(prefix + "layers.") for k in body):
            return kind, prefix, head
    raise CheckpointError(
        f"no decoder layers found among {len(keys)} tensors (expected keys like "
        "'language_model.model.layers.0...' or 'model.language_model.layers.0...')"
    )


def expected_tensors(
    cfg: ModelConfig, layout: Literal["mlx", "hf"]
) -> list[list[tuple[str, tuple[int, ...], str]]]:
    """The tensors a checkpoint in ``layout`` must hold for ``cfg``: (key, shape, dtype
    kind "float" or "U32"), grouped per canonical parameter (one group per packed linear).
    "hf" is the official layout (``model.language_model.``, fused experts)."""
    if layout == "mlx":
        plans = _layout_plans(cfg, "mlx", "language_model.model.", "language_model.lm_head", False)
    else:
        plans = _layout_plans(cfg, "hf", "model.language_model.", "lm_head", True)
    return [p.parts for p in plans]


def _plans(cfg: ModelConfig, keys: set[str]) -> list[_Plan]:
    kind, prefix, head = _detect_layout(sorted(keys))
    if kind == "hf" and cfg.quantization is not None:
        raise CheckpointError(
            "config.json: quantization is set but the tensors use the Hugging Face layout; "
            "only MLX-layout (mlx_lm.convert) checkpoints are read quantized"
        )
    fused = any(".mlp.experts.gate_up_proj" in k for k in keys)
    return _layout_plans(cfg, kind, prefix, head, fused)


def _layout_plans(cfg: ModelConfig, kind: str, prefix: str, head: str, fused: bool) -> list[_Plan]:
    plans = []
    shapes = canonical_shapes(cfg)
    for name, shape in shapes.items():
        if name == "lm_head":
            path = head
        else:
            path = prefix + _module_path(name)
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ("A_log", "dt_bias"):
            plans.append(_Plan([(path, shape, "float")], lambda t, n=name: {n: t[0]}))
        elif leaf == "conv1d":
            # MLX: (C, K, 1); HF: (C, 1, K)
            sh = (*shape, 1) if kind == "mlx" else (shape[0], 1, shape[1])
            plans.append(_Plan([(path + ".weight", sh, "float")], _conv_builder(name, kind)))
        elif leaf in ("input_norm", "post_norm", "q_norm", "k_norm", "norm"):
            offset = kind == "hf" and (leaf in _OFFSET_NORMS or name == "norm")
            plans.append(_Plan([(path + ".weight", shape, "float")], _norm_builder(name, offset)))
        elif leaf in ("gate_proj", "up_proj", "down_proj") and kind == "hf":
            plans.extend(_hf_expert_plans(cfg, name, shape, path, fused))
        else:
            plans.append(_linear_plan(cfg, name, shape, path, kind))
    return plans


def _conv_builder(name: str, kind: str) -> Callable:
    if kind == "mlx":
        return lambda t: {name: t[0][..., 0].contiguous()}
    return lambda t: {name: t[0][:, 0, :].contiguous()}


def _norm_builder(name: str, offset: bool) -> Callable:
    # NOTE: the +1 is done in fp32 so a bf16 offset does not lose precision.
    if offset:
        return lambda t: {name: t[0].float() + 1.0}
    return lambda t: {name: t[0]}


def _linear_plan(cfg: ModelConfig, name: str, shape: tuple, path: str, kind: str) -> _Plan:
    spec = cfg.quant_for(path) if kind == "mlx" else None
    *lead, n, k = shape
    # mlx_lm.convert leaves a linear dense when its input dim is not a multiple of the group.
    if spec is None or k % spec.group_size:
        return _Plan([(path + ".weight", shape, "float")], lambda t: {name: t[0]})
    bits, gs = spec.bits, spec.group_size
    parts = [
        (path + ".weight", (*lead, n, k * bits // 32), "U32"),
        (path + ".scales", (*lead, n, k // gs), "float"),
        (path + ".biases", (*lead, n, k // gs), "float"),
    ]
    return _Plan(parts, lambda t: {name: QuantWeight(t[0].view(torch.int32), t[1], t[2], bits, gs)})


def _hf_expert_plans(cfg: ModelConfig, name: str, shape: tuple, path: str, fused: bool):
    E, Ie = cfg.num_experts, cfg.moe_intermediate_size
    base = path.replace(".switch_mlp.", ".experts.").rsplit(".", 1)[0]  # "...mlp.experts"
    leaf = name.rsplit(".", 1)[-1]
    if not fused:
        parts = [(f"{base}.{e}.{leaf}.weight", shape[1:], "float") for e in range(E)]
        return [_Plan(parts, lambda t: {name: torch.stack(t)})]
    if leaf == "down_proj":
        return [_Plan([(base + ".down_proj", shape, "float")], lambda t: {name: t[0]})]
    if leaf == "up_proj":
        return []  # built together with gate_proj from the fused tensor
    up = name.replace("gate_proj", "up_proj")
    return [
        _Plan(
            [(base + ".gate_up_proj", (E, 2 * Ie, shape[-1]), "float")],
            lambda t: {name: t[0][:, :Ie].contiguous(), up: t[0][:, Ie:].contiguous()},
        )
    ]


def _check(plans: list[_Plan], entries: dict[str, Entry], model_dir: Path) -> None:
    for plan in plans:
        for key, shape, kind in plan.parts:
            e = entries.get(key)
            if e is None:
                raise CheckpointError(
                    f"{model_dir}: missing tensor {key!r} (expected shape {list(shape)})"
                )
            if tuple(e.shape) != tuple(shape):
                raise CheckpointError(
                    f"{e.file}: tensor {key!r} has shape {list(e.shape)}, expected {list(shape)}"
                )
            want = _FLOATS if kind == "float" else (kind,)
            if e.dtype not in want:
                raise CheckpointError(
                    f"{e.file}: tensor {key!r} has dtype {e.dtype}, expected {' or '.join(want)}"
                )


def _finish(
    name: str, w: Weight, dtype: torch.dtype, device: str | torch.device, qbits: int | None
) -> Weight:
    """Move to the device, then quantize or cast (quantizing the stored values, as mlx)."""
    if isinstance(w, QuantWeight):
        return w.to(device)
    w = w.to(device)
    if name.endswith("A_log"):
        return w.float()
    # Norms, A_log and dt_bias are 1-D; the conv is depthwise: none of them is a linear.
    if qbits and w.ndim >= 2 and not name.endswith("conv1d") and w.shape[-1] % _GROUP == 0:
        router = name.endswith(("moe.router", "shared_expert_gate"))
        return quantize(w, bits=8 if router else qbits, group_size=_GROUP)
    return w.to(dtype)


def load_params(
    model_dir: str | Path,
    cfg: ModelConfig,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    load_mtp: bool = False,
    quantize_on_load: int | None = None,
    progress: bool | Literal["always"] = True,
) -> dict[str, Weight]:
    """Load a checkpoint into canonical parameters (docs/CONTRACTS.md).

    ``dtype`` applies to dense float parameters (A_log stays fp32, packed scales and biases
    stay as stored). ``quantize_on_load`` (4 or 8) packs dense linears into the MLX layout
    with mlx_lm.convert's rules: group 64, routers at 8 bits, embeddings and lm_head too.
    ``progress``: a byte progress bar on stderr for loads over 1 GB, or "always".
    ``mtp.*`` tensors (kept only with ``load_mtp``) are returned as stored, under their
    checkpoint names, with float tensors cast to ``dtype``.
    NOTE: on CPU, tensors already in their final dtype stay memory-mapped from the file
    (no second copy); rewriting a checkpoint file in place under a live process corrupts it.
    """
    if quantize_on_load not in (None, 4, 8):
        raise ValueError(f"quantize_on_load must be None, 4 or 8, got {quantize_on_load!r}")
    model_dir = Path(model_dir)
    entries = index_checkpoint(model_dir)
    plans = _plans(cfg, set(entries))
    _check(plans, entries, model_dir)
    used = {key for plan in plans for key, _, _ in plan.parts}
    mtp, extra = {}, []
    for key in entries:
        if key in used or key.startswith(_SKIP_PREFIXES):
            continue
        rest = key.removeprefix("language_model.")
        if rest.startswith("mtp."):
            if load_mtp:
                mtp[rest] = key
        elif not (cfg.tie_word_embeddings and rest in ("lm_head.weight", "lm_head")):
            extra.append(key)
    if extra:
        raise CheckpointError(
            f"{entries[extra[0]].file}: unexpected tensor {extra[0]!r} that the model "
            f"configuration has no place for ({len(extra)} unexpected in all: {extra[:4]})"
        )
    total = sum(entries[k].nbytes for k in used | set(mtp.values()))
    show = progress == "always" or (progress is True and total > PROGRESS_MIN_BYTES)
    bar = None
    if show:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="B", unit_scale=True, desc="loading", file=sys.stderr)
    params: dict[str, Weight] = {}
    with contextlib.ExitStack() as stack:
        handles: dict[Path, object] = {}

        def read(key: str) -> torch.Tensor:
            e = entries[key]
            try:
                if e.file not in handles:
                    handles[e.file] = stack.enter_context(safe_open(str(e.file), framework="pt"))
                t = handles[e.file].get_tensor(key)
            except Exception as err:  # safetensors raises its own error types
                raise CheckpointError(f"{e.file}: cannot read tensor {key!r} ({err})") from None
            if bar is not None:
                bar.update(e.nbytes)
            return t

        for plan in plans:
            built = plan.build([read(key) for key, _, _ in plan.parts])
            for name, w in built.items():
                params[name] = _finish(name, w, dtype, device, quantize_on_load)
            del built
        for name, key in sorted(mtp.items()):
            t = read(key).to(device)
            params[name] = t.to(dtype) if t.is_floating_point() else t
    if bar is not None:
        bar.close()
    if cfg.tie_word_embeddings:
        params["lm_head"] = params["embed_tokens"]
    return params
