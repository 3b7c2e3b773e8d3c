"""The command line on checkpoints written by `lily init` and by transformers."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from lily.cli import main


def test_init_then_generate_and_score(tmp_path, capsys):
    out = tmp_path / "tiny"
    assert main(["init", str(out), "--config", "tiny", "--layout", "mlx4"]) == 0
    assert (out / "config.json").exists() and (out / "tokenizer.json").exists()
    assert main(["generate", "--model", str(out), "--max-tokens", "8", "--temperature", "0",
                 "hello there"]) == 0  # fmt: skip
    err = capsys.readouterr().err
    assert "tok/s" in err
    assert main(["score", "--model", str(out), "--text", "the cat sat on the mat",
                 "--out", str(tmp_path / "s.json")]) == 0  # fmt: skip
    res = json.loads((tmp_path / "s.json").read_text())
    assert len(res["logprobs"]) == res["num_tokens"] - 1
    assert math.isclose(res["perplexity"], math.exp(-sum(res["logprobs"]) / len(res["logprobs"])),
                        rel_tol=1e-9)  # fmt: skip


# The fp32 reference path everywhere; with a GPU also the default there (bf16 kernels,
# whose log-probs differ from the fp32 model by ~3e-3 on this model: bf16 rounding).
SCORE_RUNS = [(["--device", "cpu", "--dtype", "float32"], 1e-4)]
if torch.cuda.is_available():
    SCORE_RUNS.append(([], 2e-2))


@pytest.mark.parametrize("flags,atol", SCORE_RUNS, ids=[f"atol{a:g}" for _, a in SCORE_RUNS])
def test_score_matches_transformers(hf_tiny_dir, tiny_hf_model, tmp_path, flags, atol):
    ids = [5, 9, 100, 3, 77, 12, 400, 2, 8, 60, 61, 62]
    (tmp_path / "ids.txt").write_text(" ".join(map(str, ids)))
    logits_path = tmp_path / "l.npy"
    assert main(["score", "--model", str(hf_tiny_dir), "--ids-file", str(tmp_path / "ids.txt"),
                 "--save-logits", str(logits_path), "--out", str(tmp_path / "s.json"),
                 "--prefill-chunk", "5", *flags]) == 0  # fmt: skip
    res = json.loads((tmp_path / "s.json").read_text())
    with torch.no_grad():
        ref = tiny_hf_model(torch.tensor([ids])).logits[0].double()
    ref_lp = torch.log_softmax(ref[:-1], -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert np.allclose(res["logprobs"], ref_lp.numpy(), atol=atol)
    if atol <= 1e-4:  # bf16 may flip a near tie
        assert res["top1"] == ref[:-1].argmax(-1).tolist()
    saved = np.load(logits_path)
    assert saved.dtype == np.float32 and saved.shape == (len(ids), ref.shape[-1])


def test_bad_input_is_a_clear_error_not_a_traceback(tmp_path):
    (tmp_path / "bad.txt").write_text("1 2 x")
    r = subprocess.run([sys.executable, "-m", "lily.cli", "score", "--model", str(tmp_path),
                        "--ids-file", str(tmp_path / "bad.txt")],
                       capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 2
    assert "Traceback" not in r.stderr and "config.json" in r.stderr


def test_chat_multi_turn_reuses_the_conversation(hf_tiny_dir):
    import io

    from lily.config import EngineConfig
    from lily.runtime.chat import chat_loop
    from lily.runtime.engine import Engine
    from lily.runtime.sampling import SamplingParams

    engine = Engine.load(hf_tiny_dir, EngineConfig(max_context=2048), progress=False)
    out = io.StringIO()
    inp = io.StringIO("hello there\nand a second question\n/exit\n")
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    assert chat_loop(engine, params, inp=inp, out=out) == 0
    lines = [ln for ln in out.getvalue().splitlines() if ln.startswith("[")]
    assert len(lines) == 2, out.getvalue()
    assert "reused 0]" in lines[0]
    reused = int(lines[1].rsplit("reused ", 1)[1].rstrip("]"))
    # The second turn resumes at least where the first reply's header began (the template
    # drops the reply's reasoning, so the old tokens match only up to there).
    first = engine.encode_chat([{"role": "user", "content": "hello there"}])
    header = max(i for i, t in enumerate(first) if t == engine.tokenizer.im_start_id)
    assert header > 0 and reused >= header
