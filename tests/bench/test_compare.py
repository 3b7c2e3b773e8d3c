"""``lily compare``: the metrics against plain maths, and our engine against references."""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch

from lily.bench.cli import add_compare_args, run_compare
from lily.bench.compare import metrics
from lily.bench.peers import PEERS, PeerSpec


def compare(argv: list[str], tmp_path) -> dict:
    p = argparse.ArgumentParser()
    add_compare_args(p)
    out = tmp_path / "cmp.json"
    assert run_compare(p.parse_args([*argv, "--device", "cpu", "--out", str(out)])) == 0
    res = json.loads(out.read_text())
    assert res["schema"] == "lily.compare/1"
    assert res["original_engine"] == {"reference": "MLX-LM", "top1_agreement_pct": 96.35,
                                      "perplexity_delta_pct": 0.04}  # fmt: skip
    for key in ("top1_agreement_pct", "rel_l2", "max_abs_diff", "mean_kl", "positions", "env"):
        assert key in res
    return res


def test_metrics_against_plain_maths():
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(6, 10, generator=g, dtype=torch.float64)
    ids = [3, 1, 4, 1, 5, 9, 2]
    same = metrics(ref + 5.0, ref, ids)  # a constant shift leaves softmax unchanged
    assert same["top1_agreement_pct"] == 100.0
    assert same["perplexity"]["ratio"] == pytest.approx(1.0, abs=1e-12)
    assert same["rel_l2"] == pytest.approx(5.0 * math.sqrt(60) / ref.double().norm().item())
    assert same["mean_kl"] == pytest.approx(0.0, abs=1e-12)

    ours = ref.clone()
    ours[2] = -ours[2]  # the top-1 at position 2 moves
    m = metrics(ours, ref, ids)
    assert m["top1_agreement_pct"] == pytest.approx(100 * 5 / 6)
    lp = lambda x: torch.log_softmax(x.double(), -1)  # noqa: E731
    t = torch.tensor(ids[1:])
    nll = lambda x: -lp(x).gather(1, t[:, None]).mean().item()  # noqa: E731
    assert m["perplexity"]["ratio"] == pytest.approx(math.exp(nll(ours) - nll(ref)))
    assert m["perplexity"]["delta_pct"] == pytest.approx(100 * (m["perplexity"]["ratio"] - 1))
    with pytest.raises(ValueError, match="shapes differ"):
        metrics(ref[:5], ref, ids)


def test_against_itself_is_exact(tmp_path, mlx4_dir):
    res = compare(["--model", str(mlx4_dir), "--reference", "lily", "--positions", "40"],
                  tmp_path)  # fmt: skip
    assert res["positions"] == 40
    assert res["top1_agreement_pct"] == 100.0
    assert res["perplexity"]["ratio"] == 1.0 and res["rel_l2"] == 0.0


def test_against_transformers_on_its_own_checkpoint(tmp_path, hf_tiny_dir):
    res = compare(["--model", str(hf_tiny_dir), "--reference", "transformers",
                   "--positions", "48", "--seed", "3"], tmp_path)  # fmt: skip
    assert res["reference_info"]["weights"] == "from_pretrained"
    assert res["top1_agreement_pct"] == 100.0
    assert res["rel_l2"] < 1e-4
    assert res["perplexity"]["ratio"] == pytest.approx(1.0, abs=1e-4)


def test_against_mlx_lm_on_the_same_4bit_bytes(tmp_path, mlx4_dir):
    res = compare(["--model", str(mlx4_dir), "--reference", "mlx-lm", "--positions", "48"],
                  tmp_path)  # fmt: skip
    assert res["reference_info"]["dtype"] == "float32"
    assert res["rel_l2"] < 1e-3  # shared/MODEL.md: about 1e-3 in fp32 on the same bytes
    assert res["top1_agreement_pct"] >= 97.0
    assert res["perplexity"]["ratio"] == pytest.approx(1.0, abs=1e-3)


def test_text_input_and_a_missing_reference(tmp_path, mlx4_dir, monkeypatch, capsys):
    res = compare(["--model", str(mlx4_dir), "--reference", "lily", "--text",
                   "The quick brown fox jumps over the lazy dog. " * 4], tmp_path)  # fmt: skip
    assert res["ids"] == "text" and 10 < res["positions"] < 192
    monkeypatch.setitem(PEERS, "mlx-lm", PeerSpec("mlx-lm", ("lily_no_such_module",), "x:Y"))
    p = argparse.ArgumentParser()
    add_compare_args(p)
    args = p.parse_args(["--model", str(mlx4_dir), "--reference", "mlx-lm", "--device", "cpu"])
    assert run_compare(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("lily compare: error: reference mlx-lm: PeerUnavailable: peer mlx-lm: "
                       "skipped (Python package 'lily_no_such_module' not installed)")  # fmt: skip


def test_scoring_equals_teacher_forced_decode(mlx4_dir):
    """The adapter scores through engine.score (prefill chunks: the generation path); the
    runner's teacher-forced decode steps give the same logits."""
    from lily.bench.measure import pseudo_text_ids
    from lily.bench.source import dir_source, lily_engine
    from lily.bench.sweep import LilyAdapter

    engine = lily_engine(dir_source(mlx4_dir, device="cpu", dtype="float32"))
    ids = pseudo_text_ids(24, engine.cfg.vocab_size, seed=5)
    scored = LilyAdapter(engine).score(ids)
    runner, state = engine.runner, engine.new_state()
    steps = [runner.prefill(ids[:1], state)] + [runner.decode(t, state) for t in ids[1:]]
    by_steps = torch.stack(steps).float().cpu()
    assert by_steps.shape == scored.shape == (24, engine.cfg.vocab_size)
    m = metrics(by_steps[:-1], scored[:-1], ids)
    assert m["top1_agreement_pct"] == 100.0 and m["rel_l2"] < 1e-5
