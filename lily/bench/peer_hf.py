"""The ``transformers`` peer: Qwen3.5-MoE on the same weights, dequantized to dense.

An unquantized Hugging Face directory loads through transformers' own path
(``from_pretrained``). A random model or an MLX directory is built as canonical parameters
first (the bytes our engine runs), dequantized and copied into transformers' modules, so
both engines compute with the same weight values.
"""

from __future__ import annotations

import importlib.metadata
import inspect

import torch

from lily.bench.source import DTYPES, canonical_params, is_hf_dir
from lily.bench.sweep import BenchAdapter
from lily.quant import QuantWeight, Weight, dequantize

# Canonical name (after "layers.i.") -> transformers parameter (after "model.layers.i.").
_LAYER_NAMES = {
    "input_norm": "input_layernorm.weight",
    "post_norm": "post_attention_layernorm.weight",
    "moe.router": "mlp.gate.weight",
    "moe.shared_expert_gate": "mlp.shared_expert_gate.weight",
    "moe.shared_gate_proj": "mlp.shared_expert.gate_proj.weight",
    "moe.shared_up_proj": "mlp.shared_expert.up_proj.weight",
    "moe.shared_down_proj": "mlp.shared_expert.down_proj.weight",
}
# transformers keeps these RMSNorm weights as offsets from 1 (the gated DeltaNet norm is
# a plain multiplier); canonical weights are the multiplier.
_OFFSET = ("input_norm", "post_norm", "attn.q_norm", "attn.k_norm")


def _dense(w: Weight, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(w, QuantWeight):
        return dequantize(w, torch.float32).to(dtype)
    return w.to(dtype)


def hf_tensors(name: str, w: Weight, params: dict, dtype: torch.dtype, fused: bool = True):
    """(transformers parameter name, value) pairs for canonical parameter ``name``.

    ``fused``: experts as ``gate_up_proj`` / ``down_proj`` stacks (transformers 5), else
    one module per expert."""
    if name in ("embed_tokens", "norm"):
        t = _dense(w, dtype)
        return [(f"model.{name}.weight", t - 1 if name == "norm" else t)]
    if name == "lm_head":
        return [("lm_head.weight", _dense(w, dtype))]
    _, i, rest = name.split(".", 2)
    pre = f"model.layers.{i}."
    if rest == "moe.up_proj":
        return []  # fused with gate_proj
    if rest == "moe.gate_proj":
        gate, up = _dense(w, dtype), _dense(params[f"layers.{i}.moe.up_proj"], dtype)
        if fused:
            return [(pre + "mlp.experts.gate_up_proj", torch.cat([gate, up], dim=1))]
        return [
            (f"{pre}mlp.experts.{e}.{leaf}_proj.weight", t[e])
            for leaf, t in (("gate", gate), ("up", up))
            for e in range(t.shape[0])
        ]
    if rest == "moe.down_proj":
        t = _dense(w, dtype)
        if fused:
            return [(pre + "mlp.experts.down_proj", t)]
        return [(f"{pre}mlp.experts.{e}.down_proj.weight", t[e]) for e in range(len(t))]
    t = _dense(w, torch.float32 if rest.endswith("A_log") else dtype)
    if rest in _OFFSET:
        t = t - 1
    if rest in _LAYER_NAMES:
        return [(pre + _LAYER_NAMES[rest], t)]
    module, leaf = rest.split(".", 1)
    module = {"attn": "self_attn", "dn": "linear_attn"}[module]
    if leaf == "conv1d":
        return [(f"{pre}{module}.conv1d.weight", t.unsqueeze(1))]  # (C, 1, K)
    suffix = "" if leaf in ("A_log", "dt_bias") else ".weight"
    return [(f"{pre}{module}.{leaf}{suffix}", t)]


def build_from_params(text_cfg: dict, params: dict, device, dtype: torch.dtype):
    """A transformers ``Qwen3_5MoeForCausalLM`` holding ``params`` (dequantized)."""
    from transformers import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeForCausalLM

    keep = {k: v for k, v in text_cfg.items() if k not in ("dtype", "torch_dtype")}
    hf_cfg = Qwen3_5MoeTextConfig(**keep)
    with torch.device(device):
        model = Qwen3_5MoeForCausalLM._from_config(hf_cfg, dtype=dtype)
    targets = dict(model.named_parameters())
    fused = any(k.endswith("mlp.experts.gate_up_proj") for k in targets)
    filled = set()
    with torch.no_grad():
        for name, w in params.items():
            if name.startswith("mtp."):
                continue
            for key, value in hf_tensors(name, w, params, dtype, fused):
                if key in targets:
                    targets[key].copy_(value)
                    filled.add(key)
    missing = sorted(set(targets) - filled)
    if missing:
        raise RuntimeError(f"transformers parameters not filled: {missing[:4]} ({len(missing)})")
    return model.eval()


class TransformersAdapter(BenchAdapter):
    """transformers' forward with its own cache, prefilling in chunks like ours."""

    name = "transformers"

    def __init__(self, source: dict):
        self.device = source.get("device", "cpu")
        self.dtype = DTYPES[source.get("dtype", "float32")]
        self.chunk = int(source.get("prefill_chunk", 2048))
        self.cuda = torch.device(self.device).type == "cuda"
        self.fingerprint = None
        if source["kind"] == "dir" and is_hf_dir(source["path"]):
            from transformers import AutoModelForCausalLM

            self.how = "from_pretrained"
            self.model = AutoModelForCausalLM.from_pretrained(source["path"], dtype=self.dtype)
            self.model = self.model.to(self.device).eval()
        else:
            from lily.bench.random_model import fingerprint

            self.how = "dequantized canonical parameters"
            cfg, params, text_cfg = canonical_params(source)
            self.fingerprint = fingerprint(params)
            self.model = build_from_params(text_cfg, params, self.device, self.dtype)
            del params
            if self.cuda:
                torch.cuda.empty_cache()
        self.cache = None
        # NOTE: newer transformers name the cache argument ``cache`` (``past_key_values``
        # is deprecated there); the H200's older release knows only ``past_key_values``.
        sig = inspect.signature(self.model.forward).parameters
        self.cache_arg = "cache" if "cache" in sig else "past_key_values"

    def _forward(self, ids: list[int], keep: int | None = 1):
        t = torch.tensor([ids], dtype=torch.long, device=self.device)
        kw = {"logits_to_keep": keep} if keep else {}
        kw[self.cache_arg] = self.cache
        with torch.inference_mode():
            out = self.model(input_ids=t, use_cache=True, **kw)
        cache = getattr(out, "cache", None)
        self.cache = cache if cache is not None else out.past_key_values
        return out.logits[0]

    def prefill(self, ids: list[int]) -> int:
        self.cache = None
        for i in range(0, len(ids), self.chunk):
            logits = self._forward(ids[i : i + self.chunk])
        return int(logits[-1].argmax())

    def decode(self, token: int) -> int:
        return int(self._forward([token])[-1].argmax())

    def score(self, ids: list[int]) -> torch.Tensor:
        self.cache = None
        out = [self._forward(ids[i : i + self.chunk], keep=None).float().cpu()
               for i in range(0, len(ids), self.chunk)]  # fmt: skip
        self.cache = None
        return torch.cat(out)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def release(self) -> None:
        self.cache = None
        if self.cuda:
            torch.cuda.empty_cache()

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak_memory(self) -> int | None:
        return torch.cuda.max_memory_allocated(self.device) if self.cuda else None

    def info(self) -> dict:
        return {
            "device": self.device,
            "dtype": str(self.dtype).removeprefix("torch."),
            "weights": self.how,
            "transformers": importlib.metadata.version("transformers"),
            "attn_implementation": getattr(self.model.config, "_attn_implementation", None),
            "fingerprint": self.fingerprint,
        }
