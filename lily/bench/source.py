"""Where a benchmarked model comes from, as a small picklable dict shared with workers.

``{"kind": "random", "name": "full"|"tiny", "seed", "layout", "skew"}`` is built on the
device by ``random_params`` (every process gets the same bytes from the same seed);
``{"kind": "dir", "path"}`` is a checkpoint directory. Both carry ``device``, ``dtype``
(float32 or bfloat16), ``prefill_chunk`` and ``use_kernels``.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

from lily.bench.sweep import LilyAdapter
from lily.config import EngineConfig, ModelConfig
from lily.quant import Weight

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def random_source(name: str, seed: int = 0, layout: str = "mlx4", skew: float = 0.0, **kw):
    return {"kind": "random", "name": name, "seed": seed, "layout": layout, "skew": skew, **kw}


def dir_source(path: str | Path, **kw) -> dict:
    return {"kind": "dir", "path": str(path), **kw}


def describe(source: dict) -> str:
    if source["kind"] == "dir":
        return source["path"]
    skew = f", router skew {source['skew']}" if source.get("skew") else ""
    return f"random {source['name']} ({source['layout']}, seed {source['seed']}{skew})"


def engine_config(source: dict) -> EngineConfig:
    return EngineConfig(
        device=source.get("device", "cpu"),
        dtype=source.get("dtype", "float32"),
        prefill_chunk=source.get("prefill_chunk", EngineConfig.prefill_chunk),
        use_kernels=bool(source.get("use_kernels", False)),
        max_context=source.get("max_context", 262144),
        gpu_arch=source.get("gpu_arch"),
    )


def is_hf_dir(path: str | Path) -> bool:
    """An unquantized Hugging Face checkpoint (transformers can read it as is)."""
    p = Path(path) / "config.json"
    if not p.is_file():
        raise FileNotFoundError(f"{p}: no config.json in the model directory")
    raw = json.loads(p.read_text())
    return not (raw.get("quantization") or raw.get("quantization_config"))


def canonical_params(source: dict) -> tuple[ModelConfig, dict[str, Weight], dict]:
    """(config, canonical parameters on the source's device, text config dict)."""
    device, dtype = source.get("device", "cpu"), DTYPES[source.get("dtype", "float32")]
    if source["kind"] == "random":
        from lily.bench.random_model import model_config, random_params, text_config

        cfg = model_config(source["name"], source.get("layout", "mlx4"))
        params = random_params(
            cfg, device, source.get("layout", "mlx4"), source.get("seed", 0),
            source.get("skew", 0.0), dtype,
        )  # fmt: skip
        return cfg, params, text_config(source["name"])
    from lily.weights import load_params

    cfg = ModelConfig.from_dir(source["path"])
    params = load_params(source["path"], cfg, device=device, dtype=dtype, progress=False)
    raw = cfg.raw.get("text_config", cfg.raw)
    return cfg, params, dict(raw)


def lily_engine(source: dict):
    """Our engine over the source's weights."""
    from lily.runtime.engine import Engine

    ecfg = engine_config(source)
    if source["kind"] == "dir":
        return Engine.load(source["path"], ecfg, progress=False)
    cfg, params, _ = canonical_params(source)
    return engine_from_params(cfg, params, ecfg, name=describe(source))


_TOKENIZER_DIRS: dict[int, Path] = {}


def engine_from_params(
    cfg: ModelConfig,
    params: dict[str, Weight],
    engine_cfg: EngineConfig,
    name: str = "random",
    text_only: bool = False,
):
    """An ``Engine`` over in-memory parameters (with a small test tokenizer).

    ``text_only``: the lm_head rows past the tokenizer's ids are muted
    (``random_model.mute_head_rows``), so greedy decoding emits text a stream can time.
    """
    from lily.bench.random_model import mute_head_rows
    from lily.runtime.engine import Engine
    from lily.tokenizer import Tokenizer
    from lily.tokenizer_files import write_test_tokenizer

    d = _TOKENIZER_DIRS.get(cfg.vocab_size)
    if d is None:
        d = Path(tempfile.mkdtemp(prefix="lily-bench-tok-"))
        write_test_tokenizer(d, cfg.vocab_size)
        _TOKENIZER_DIRS[cfg.vocab_size] = d
    tok = Tokenizer.from_dir(d)
    if text_only:
        params = mute_head_rows(params, tok.id_count)
    return Engine(cfg, params, tok, engine_cfg, model_name=name)


class LilyPeerAdapter(LilyAdapter):
    """Our engine as a peer (in a worker, or as ``compare --reference lily``)."""

    def __init__(self, source: dict):
        super().__init__(lily_engine(source), name="lily")
