"""Layer-local consistency (``lily compare --layerwise``) and compares after a context."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from optional_deps import mlx_missing

from lily.bench.cli import add_compare_args, run_compare
from lily.bench.consistency import layer_local, make_paths, parse_contexts, upcast
from lily.bench.layerwise import LayerCheck, copy_layer_state
from lily.bench.measure import pseudo_text_ids
from lily.bench.random_model import model_config, random_params
from lily.model.model import Model
from lily.quant import QuantWeight
from lily.runtime.state import SessionState


@pytest.fixture(scope="module")
def tiny():
    cfg = model_config("tiny")
    return cfg, random_params(cfg, "cpu", seed=4)


def _scaled(params: dict, name: str, f: float) -> dict:
    """``params`` with packed weight ``name`` scaled by ``f`` (scales and biases)."""
    w = params[name]
    s = QuantWeight(w.qweight, (w.scales.float() * f).to(w.scales.dtype),
                    (w.biases.float() * f).to(w.biases.dtype), w.bits, w.group_size)  # fmt: skip
    return {**params, name: s}


def test_an_exact_path_has_zero_error_and_a_broken_layer_shows_only_there(tiny):
    """The fp32 path on the judge's inputs reproduces every layer exactly; scaling one
    layer's weight shows up in that layer alone (errors never compound)."""
    cfg, params = tiny
    judge, _ = make_paths(cfg, params, kernels=False)
    p32 = upcast(params, torch.float32)
    paths = {
        "same": Model(cfg, p32, torch.float32),
        "broken": Model(cfg, _scaled(p32, "layers.2.dn.out_proj", 1.05), torch.float32),
    }
    ids = pseudo_text_ids(48, cfg.vocab_size, seed=1)
    rep = layer_local(judge, paths, ids, context=32, chunk=12, steps=4)
    for phase in ("prefill", "decode"):
        same, broken = rep[phase]["same"], rep[phase]["broken"]
        assert same["max_rel_out"] == 0.0
        errs = [r["rel_delta"] for r in broken["layers"]]
        assert errs[2] > 5e-3, errs  # the layer's mixer output is 5% larger
        assert all(e == 0.0 for i, e in enumerate(errs) if i != 2), errs
        assert broken["worst"]["layer"] == 2


def test_bf16_reference_is_close_everywhere_and_a_mutation_stands_out(tiny):
    cfg, params = tiny
    judge, paths = make_paths(cfg, params, kernels=False)
    paths["bf16_broken"] = Model(cfg, _scaled(params, "layers.3.attn.o_proj", 1.2),
                                 torch.bfloat16)  # fmt: skip
    ids = pseudo_text_ids(80, cfg.vocab_size, seed=2)
    rep = layer_local(judge, paths, ids, context=64, chunk=12, steps=4)
    for phase in ("prefill", "decode"):
        ok = rep[phase]["bf16_reference"]
        assert ok["max_rel_out"] < 1e-2 and ok["max_rel_delta"] < 5e-2, ok
        bad = rep[phase]["bf16_broken"]["layers"]
        assert bad[3]["rel_delta"] > 3 * ok["max_rel_delta"]
        assert max(r["rel_delta"] for r in bad[:3]) < 5e-2
        assert set(ok["kinds"]) == {"deltanet", "attention"}


def test_copy_layer_state_converts_dtypes(tiny):
    cfg, _ = tiny
    src = SessionState.new(cfg, "cpu", torch.float32, 64)
    dst = SessionState.new(cfg, "cpu", torch.bfloat16, 64)
    g = torch.Generator().manual_seed(0)
    for c in src.kv.values():
        c.ensure(40)
        c.k.normal_(generator=g), c.v.normal_(generator=g)
    for s in src.deltanet.values():
        s.conv.normal_(generator=g), s.recurrent.normal_(generator=g)
    for i in range(cfg.num_hidden_layers):
        copy_layer_state(src, dst, i, 40, 48)
    a = cfg.attn_layers[0]
    assert dst.kv[a].capacity >= 48
    assert torch.equal(dst.kv[a].k[:, :40], src.kv[a].k[:, :40].bfloat16())
    d = cfg.linear_layers[0]
    assert torch.equal(dst.deltanet[d].recurrent, src.deltanet[d].recurrent)  # stays fp32
    assert torch.equal(dst.deltanet[d].conv, src.deltanet[d].conv.bfloat16())


def test_the_check_needs_enough_room(tiny):
    cfg, params = tiny
    judge, paths = make_paths(cfg, params, kernels=False)
    with pytest.raises(ValueError, match="exceeds"):
        LayerCheck(judge, paths, SessionState.new(cfg, "cpu", torch.float32, 8)).run(
            list(range(9)), "prefill"
        )
    assert parse_contexts("0,4K, 32k") == [0, 4096, 32768]
    with pytest.raises(ValueError, match="token count"):
        parse_contexts("4Q")


def _compare(argv: list[str], tmp_path) -> dict:
    p = argparse.ArgumentParser()
    add_compare_args(p)
    out = tmp_path / "cmp.json"
    assert run_compare(p.parse_args([*argv, "--device", "cpu", "--out", str(out)])) == 0
    return json.loads(out.read_text())


def test_compare_layerwise_cli(tmp_path, mlx4_dir):
    res = _compare(["--model", str(mlx4_dir), "--layerwise", "--context", "0,40", "--chunk",
                    "8", "--decode-steps", "2"], tmp_path)  # fmt: skip
    assert res["schema"] == "lily.compare.layerwise/1"
    assert list(res["paths"]) == ["bf16_reference"]  # no kernels without CUDA
    assert [r["context"] for r in res["contexts"]] == [0, 40]
    for r in res["contexts"]:
        for phase in ("prefill", "decode"):
            rep = r[phase]["bf16_reference"]
            assert len(rep["layers"]) == 4 and 0 < rep["max_rel_out"] < 0.1  # any checkpoint


def test_compare_after_a_context(tmp_path, mlx4_dir):
    """The bf16 reference against the fp32 one (lily's default reference dtype) on the
    positions after 40 and 0 tokens of context; and MLX-LM on the same bytes."""
    res = _compare(["--model", str(mlx4_dir), "--reference", "lily", "--dtype", "bfloat16",
                    "--context", "0,40", "--positions", "24"], tmp_path)  # fmt: skip
    assert [r["context"] for r in res["contexts"]] == [0, 40]
    assert res["reference_info"]["dtype"] == "float32" and res["ours"]["dtype"] == "bfloat16"
    for r in res["contexts"]:
        assert r["positions"] == 24 and 0 < r["rel_l2"] < 5e-2
    res = _compare(["--model", str(mlx4_dir), "--reference", "mlx-lm", "--context", "40",
                    "--positions", "16"], tmp_path)  # fmt: skip
    assert res["rel_l2"] < 1e-3 and res["context"] == 40  # fp32 on the same bytes


def test_compare_random_model_against_itself_in_fp32(tmp_path):
    res = _compare(["--random", "tiny", "--reference", "lily", "--positions", "16",
                    "--context", "16"], tmp_path)  # fmt: skip
    assert res["model"] == "random tiny (conditioned)"
    assert res["rel_l2"] == 0.0 and res["top1_agreement_pct"] == 100.0


@pytest.mark.skipif(mlx_missing() is not None, reason=mlx_missing() or "")
def test_mlx_lm_reads_the_conditioned_bytes_as_we_do(tmp_path):
    """The conditioned model written for MLX-LM (zero groups, power-of-two router scales)
    gives its fp32 logits within MLX's own rounding of ours, after a context."""
    res = _compare(["--random", "tiny", "--reference", "mlx-lm", "--dtype", "float32",
                    "--context", "24", "--positions", "16", "--disk-dir",
                    str(tmp_path / "ckpt")], tmp_path)  # fmt: skip
    assert (tmp_path / "ckpt" / "config.json").exists()
    assert res["rel_l2"] < 1e-3 and res["top1_agreement_pct"] == 100.0
