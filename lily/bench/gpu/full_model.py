"""What the GPU scripts share: the full-size random model on the GPU, engines over it with
the kernels, and their JSON output (environment, arguments, results)."""

from __future__ import annotations

import json

from lily.bench.measure import env_info
from lily.bench.random_model import model_config, random_params
from lily.bench.source import engine_from_params
from lily.config import EngineConfig, ModelConfig

FULL = model_config("full")


def full_params() -> dict:
    """The full-size random model's parameters (MLX 4-bit layout, seed 0) on the GPU."""
    return random_params(FULL, "cuda")


def kernel_engine(params: dict, chunk: int = 4096, max_context: int = 65536,
                  prefix_cache_gb: float = 0.0, cfg: ModelConfig = FULL,
                  max_running: int = 1):  # fmt: skip
    """An engine over ``params`` (of ``cfg``) with the model on the Triton kernels in bf16."""
    ecfg = EngineConfig(device="cuda", dtype="bfloat16", prefill_chunk=chunk,
                        max_context=max_context, use_kernels=True,
                        prefix_cache_gb=prefix_cache_gb, max_running=max_running)  # fmt: skip
    return engine_from_params(cfg, params, ecfg)


def write_json(path: str | None, args, **parts) -> None:
    """``{"env", "args", **parts}`` to ``path`` (nothing when None)."""
    if path:
        with open(path, "w") as f:
            json.dump({"env": env_info("cuda"), "args": vars(args), **parts}, f, indent=1)
