"""The reference forward (the model on its reference ops) against the independent
references, on checkpoints they wrote."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from optional_deps import mlx_missing

from lily.config import ModelConfig
from lily.model.model import Model
from lily.runtime.runner import Runner
from lily.runtime.state import SessionState
from lily.weights import load_params

# The same reference tests run on the GPU when there is one.
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def make_model(path, device: str = "cpu") -> Model:
    cfg = ModelConfig.from_dir(path)
    params = load_params(path, cfg, device=device, dtype=torch.float32, progress=False)
    return Model(cfg, params, torch.float32, kernels=False)


def run(model: Model, ids: torch.Tensor, chunks: list[int] | None = None) -> torch.Tensor:
    """All-position logits (on the CPU), prefilling in the given chunk sizes."""
    state = SessionState.new(model.cfg, model.device, torch.float32, 4096, initial_capacity=8)
    ids = ids.to(model.device)
    chunks = chunks or [len(ids)]
    out, i = [], 0
    for c in chunks:
        out.append(Runner(model, c).score(ids[i : i + c].tolist(), state))
        i += c
    assert i == len(ids)
    return torch.cat(out).cpu()


@pytest.fixture(scope="module", params=DEVICES)
def hf_model(hf_tiny_dir, request) -> Model:
    return make_model(hf_tiny_dir, request.param)


def test_unquantized_matches_transformers(hf_model, tiny_hf_model):
    torch.manual_seed(1)
    ids = torch.randint(0, hf_model.cfg.vocab_size, (70,))
    with torch.no_grad():
        ref = tiny_hf_model(ids[None]).logits[0].float()
    assert rel_l2(run(hf_model, ids), ref) <= 1e-4


def test_chunked_prefill_equals_one_shot(hf_model):
    torch.manual_seed(2)
    ids = torch.randint(0, hf_model.cfg.vocab_size, (53,))
    one = run(hf_model, ids)
    for chunks in ([1] * 53, [7] * 7 + [4], [16, 16, 16, 5], [52, 1]):
        assert rel_l2(run(hf_model, ids, chunks), one) <= 1e-5, chunks


def test_prefill_then_decode_equals_forward_of_n_plus_one(hf_model):
    torch.manual_seed(3)
    ids = torch.randint(0, hf_model.cfg.vocab_size, (31,))
    full = run(hf_model, ids)[-1]
    state = SessionState.new(hf_model.cfg, hf_model.device, torch.float32, 4096)
    runner = Runner(hf_model, 64)
    runner.prefill(ids[:30].tolist(), state)
    step = runner.decode(int(ids[30]), state).cpu()
    assert state.length == 31
    assert rel_l2(step, full) <= 1e-5


# NOTE: decided at collection, before the mlx4_dir fixture would call mlx_lm.convert.
needs_mlx = pytest.mark.skipif(mlx_missing() is not None, reason=mlx_missing() or "")


def _mlx_model_fp32(path):
    import mlx.core as mx
    from mlx.utils import tree_map
    from mlx_lm import load

    model, _ = load(str(path))
    # Quantized codes stay uint32; every float tensor (scales and biases too) goes to fp32,
    # which is exact for bf16 values.
    model.update(
        tree_map(
            lambda a: a.astype(mx.float32) if a.dtype == mx.bfloat16 else a, model.parameters()
        )  # fmt: skip
    )
    return mx, model


@needs_mlx
def test_4bit_matches_mlx_lm_on_same_bytes(mlx4_dir):
    mx, ref = _mlx_model_fp32(mlx4_dir)
    model = make_model(mlx4_dir)
    torch.manual_seed(4)
    ids = torch.randint(0, model.cfg.vocab_size, (48,))
    theirs = torch.from_numpy(np.array(ref(mx.array(ids.numpy())[None]).astype(mx.float32))[0])
    assert rel_l2(run(model, ids), theirs) <= 1e-3


@needs_mlx
def test_4bit_greedy_continuation_matches_mlx_lm(mlx4_dir):
    mx, ref = _mlx_model_fp32(mlx4_dir)
    from mlx_lm.models.cache import make_prompt_cache

    model = make_model(mlx4_dir)
    prompt = [5, 17, 200, 3, 99, 41, 250, 8]
    cache = make_prompt_cache(ref)
    logits = ref(mx.array(prompt)[None], cache=cache)
    theirs = []
    for _ in range(32):
        tok = int(mx.argmax(logits[0, -1]).item())
        theirs.append(tok)
        logits = ref(mx.array([[tok]]), cache=cache)

    state = SessionState.new(model.cfg, "cpu", torch.float32, 4096)
    runner = Runner(model, 64)
    lg = runner.prefill(prompt, state)
    ours = []
    for _ in range(32):
        tok = int(lg.argmax())
        ours.append(tok)
        lg = runner.decode(tok, state)
    assert len(set(ours)) > 1, "a degenerate continuation would prove little"
    assert ours == theirs


def test_without_mlx_the_mlx_lm_tests_skip(tmp_path):
    """Where mlx cannot be imported (the H200 host), the two tests above skip, naming why,
    instead of erroring in the fixture that runs mlx_lm.convert."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    (tmp_path / "sitecustomize.py").write_text(
        "import sys\nsys.modules['mlx'] = None\nsys.modules['mlx_lm'] = None\n"
    )
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(root)])}
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
         "tests/model/test_reference.py", "-k", "matches_mlx_lm"],
        cwd=root, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert "2 skipped" in r.stdout, r.stdout[-2000:]
    assert "peer mlx-lm: skipped (Python package 'mlx.core' not installed)" in r.stdout
