"""Checkpoint loading (lily.weights) against the bytes transformers and mlx_lm.convert wrote.

References are independent of the loader: the in-memory transformers model, the raw arrays
``mx.load`` reads, and this file's own name tables.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from lily.checkpoint import (
    FULL_TEXT_CONFIG,
    TINY_TEXT_CONFIG,
    complete_text_config,
    write_random_checkpoint,
)
from lily.config import ConfigError, ModelConfig
from lily.quant import QuantWeight, dequantize
from lily.weights import CheckpointError, canonical_shapes, load_params


def _load(d: Path, **kw) -> dict:
    return load_params(d, ModelConfig.from_dir(d), progress=False, **kw)


def _hf_reference(model) -> dict[str, torch.Tensor]:
    """Canonical parameters from the transformers model's own state dict."""
    sd = {k: v.detach().float() for k, v in model.state_dict().items()}
    cfg = model.config
    inter = cfg.moe_intermediate_size
    out = {"embed_tokens": sd["model.embed_tokens.weight"], "lm_head": sd["lm_head.weight"]}
    out["norm"] = sd["model.norm.weight"] + 1
    for i, kind in enumerate(cfg.layer_types):
        p, c = f"model.layers.{i}.", f"layers.{i}."
        out[c + "input_norm"] = sd[p + "input_layernorm.weight"] + 1
        out[c + "post_norm"] = sd[p + "post_attention_layernorm.weight"] + 1
        if kind == "full_attention":
            for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
                out[c + "attn." + n] = sd[p + f"self_attn.{n}.weight"]
            for n in ("q_norm", "k_norm"):
                out[c + "attn." + n] = sd[p + f"self_attn.{n}.weight"] + 1
        else:
            for n in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj", "norm"):
                out[c + "dn." + n] = sd[p + f"linear_attn.{n}.weight"]
            out[c + "dn.conv1d"] = sd[p + "linear_attn.conv1d.weight"][:, 0, :]
            out[c + "dn.A_log"] = sd[p + "linear_attn.A_log"]
            out[c + "dn.dt_bias"] = sd[p + "linear_attn.dt_bias"]
        gate_up = sd[p + "mlp.experts.gate_up_proj"]
        out[c + "moe.gate_proj"], out[c + "moe.up_proj"] = gate_up[:, :inter], gate_up[:, inter:]
        out[c + "moe.down_proj"] = sd[p + "mlp.experts.down_proj"]
        out[c + "moe.router"] = sd[p + "mlp.gate.weight"]
        out[c + "moe.shared_expert_gate"] = sd[p + "mlp.shared_expert_gate.weight"]
        for n in ("gate_proj", "up_proj", "down_proj"):
            out[c + "moe.shared_" + n] = sd[p + f"mlp.shared_expert.{n}.weight"]
    return out


def _mlx_key(name: str) -> str:
    """Canonical name -> module path in an mlx_lm.convert checkpoint."""
    if name == "lm_head":
        return "language_model.lm_head"
    if not name.startswith("layers."):
        return "language_model.model." + name
    _, i, rest = name.split(".", 2)
    table = {
        "input_norm": "input_layernorm", "post_norm": "post_attention_layernorm",
        "attn.": "self_attn.", "dn.": "linear_attn.", "moe.router": "mlp.gate",
        "moe.shared_expert_gate": "mlp.shared_expert_gate",
        "moe.shared_gate_proj": "mlp.shared_expert.gate_proj",
        "moe.shared_up_proj": "mlp.shared_expert.up_proj",
        "moe.shared_down_proj": "mlp.shared_expert.down_proj", "moe.": "mlp.switch_mlp.",
    }  # fmt: skip
    for a, b in table.items():
        if rest.startswith(a):
            rest = b + rest[len(a) :]
            break
    return f"language_model.model.layers.{i}.{rest}"


def _mx_raw(d: Path) -> dict[str, torch.Tensor]:
    """Raw checkpoint arrays as mlx reads them, as torch tensors (uint32 as int32)."""
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        for k, a in mx.load(str(f)).items():
            if a.dtype == mx.uint32:
                out[k] = torch.from_numpy(np.array(a).view(np.int32))
            else:
                out[k] = torch.from_numpy(np.array(a.astype(mx.float32)))
    return out


# ---------------------------------------------------------------- Hugging Face layouts


def test_hf_per_expert_matches_transformers(hf_tiny_dir, tiny_hf_model):
    params = _load(hf_tiny_dir)
    ref = _hf_reference(tiny_hf_model)
    cfg = ModelConfig.from_dir(hf_tiny_dir)
    assert list(params) == list(canonical_shapes(cfg))
    assert set(params) == set(ref)
    for name, want in ref.items():
        got = params[name]
        assert got.dtype == torch.float32, name
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=name)


def test_hf_fused_equals_per_expert(hf_fused_dir, hf_tiny_dir):
    fused, per_expert = _load(hf_fused_dir), _load(hf_tiny_dir)
    assert set(fused) == set(per_expert)
    for name in per_expert:  # the fixture made every value bf16-exact
        assert torch.equal(fused[name], per_expert[name]), name


def test_dtype_applies_to_dense_but_not_a_log(hf_fused_dir):
    params = _load(hf_fused_dir, dtype=torch.bfloat16)
    assert params["layers.0.dn.A_log"].dtype == torch.float32
    for name in (
        "embed_tokens",
        "layers.0.dn.conv1d",
        "layers.0.input_norm",
        "layers.3.attn.q_proj",
    ):
        assert params[name].dtype == torch.bfloat16, name


def test_sharded_index_load(tmp_path, tiny_hf_model, hf_tiny_dir):
    d = tmp_path / "sharded"
    tiny_hf_model.save_pretrained(d, max_shard_size="200KB")
    assert (d / "model.safetensors.index.json").is_file()
    assert len(list(d.glob("*.safetensors"))) > 2
    sharded, single = _load(d), _load(hf_tiny_dir)
    assert set(sharded) == set(single)
    assert all(torch.equal(sharded[n], single[n]) for n in single)


def test_vision_skipped_and_mtp_only_on_request(hf_fused_dir):
    raw = load_file(hf_fused_dir / "model.safetensors")
    assert any(k.startswith("model.visual.") for k in raw) and "mtp.fc.weight" in raw
    plain = _load(hf_fused_dir)
    assert not any("mtp" in n or "visual" in n for n in plain)
    with_mtp = _load(hf_fused_dir, load_mtp=True)
    assert set(with_mtp) - set(plain) == {"mtp.fc.weight", "mtp.norm.weight"}
    assert torch.equal(with_mtp["mtp.fc.weight"], raw["mtp.fc.weight"].float())


# ---------------------------------------------------------------- MLX layout


@pytest.mark.parametrize("bits", [4, 8])
def test_mlx_loads_canonical_names_from_converter_bytes(bits, mlx4_dir, mlx8_dir):
    d = mlx4_dir if bits == 4 else mlx8_dir
    cfg = ModelConfig.from_dir(d)
    params, raw = _load(d), _mx_raw(d)
    assert list(params) == list(canonical_shapes(cfg))
    for name, shape in canonical_shapes(cfg).items():
        w, key = params[name], _mlx_key(name)
        assert tuple(w.shape) == shape, name
        if isinstance(w, QuantWeight):
            router = name.endswith(("moe.router", "shared_expert_gate"))
            assert (w.bits, w.group_size) == (8 if router else bits, 64), name
            assert torch.equal(w.qweight, raw[key + ".weight"]), name
            assert torch.equal(w.scales.float(), raw[key + ".scales"]), name
            assert torch.equal(w.biases.float(), raw[key + ".biases"]), name
        else:
            stored = raw[key if name.endswith(("A_log", "dt_bias")) else key + ".weight"]
            assert torch.equal(w, stored.reshape(w.shape)), name
    # every linear is packed (the tiny config keeps all input dims multiples of 64)
    dense = {n for n, w in params.items() if not isinstance(w, QuantWeight)}
    assert all(n.endswith(("norm", "conv1d", "A_log", "dt_bias")) for n in dense), dense


@pytest.mark.parametrize("bits", [4, 8])
def test_mlx_dequantized_matches_hf_source(bits, mlx4_dir, mlx8_dir, tiny_hf_model):
    params = _load(mlx4_dir if bits == 4 else mlx8_dir)
    ref = _hf_reference(tiny_hf_model)
    for name, w in params.items():
        if not isinstance(w, QuantWeight):
            continue
        deq, want = dequantize(w, torch.float32), ref[name]
        g = w.group_size
        s = w.scales.float().unsqueeze(-1).abs()  # mlx scales are negative for some groups
        b = w.biases.float().unsqueeze(-1).abs()
        # mlx makes the larger-magnitude end exact by shrinking the scale, so the other end
        # may be off by up to a step; plus the bf16 rounding of the stored scale and bias
        bound = s * (1.1 + (2**w.bits) / 512) + b / 256 + 1e-7
        err = (deq - want).abs().reshape(*want.shape[:-1], -1, g)
        assert (err <= bound).all(), f"{name}: max error {err.max():.3g}"


def test_norm_offset_vs_multiplier(mlx4_dir, hf_fused_dir):
    mlx, hf = _load(mlx4_dir), _load(hf_fused_dir)
    norms = [n for n in hf if n.endswith("norm")]
    assert "layers.0.dn.norm" in norms and "layers.3.attn.q_norm" in norms
    for n in norms:
        # mlx_lm adds the 1 in bf16; lily adds it in fp32: equal up to bf16 rounding
        torch.testing.assert_close(mlx[n], hf[n], rtol=2**-8, atol=0, msg=n)
        assert (hf[n] - 1).abs().max() < 0.7, n  # multipliers near 1: no offset left or doubled


# ---------------------------------------------------------------- error paths


def _copy(src: Path, dst: Path, keep_index: bool = False) -> Path:
    shutil.copytree(src, dst)
    if not keep_index:
        (dst / "model.safetensors.index.json").unlink(missing_ok=True)
    return dst


def _edit(d: Path, fn) -> None:
    f = d / "model.safetensors"
    tensors = load_file(f)
    fn(tensors)
    save_file(tensors, f, metadata={"format": "mlx"})


def _raises(d: Path, *needles: str, cfg: ModelConfig | None = None, exc=CheckpointError):
    with pytest.raises(exc) as info:
        load_params(d, cfg or ModelConfig.from_dir(d), progress=False)
    for needle in needles:
        assert needle in str(info.value), (needle, str(info.value))


Q_NORM = "language_model.model.layers.3.self_attn.q_norm.weight"


def test_missing_tensor(tmp_path, mlx4_dir):
    d = _copy(mlx4_dir, tmp_path / "c")
    _edit(d, lambda t: t.pop(Q_NORM))
    _raises(d, "missing tensor", Q_NORM, "[64]")


def test_extra_tensor(tmp_path, mlx4_dir):
    d = _copy(mlx4_dir, tmp_path / "c")
    _edit(
        d, lambda t: t.update({"language_model.model.layers.3.self_attn.bias": t[Q_NORM].clone()})
    )
    _raises(d, "unexpected tensor", "layers.3.self_attn.bias", "model.safetensors")


def test_wrong_shape_and_dtype(tmp_path, mlx4_dir):
    d = _copy(mlx4_dir, tmp_path / "shape")
    _edit(d, lambda t: t.update({Q_NORM: t[Q_NORM][:32].clone()}))
    _raises(d, Q_NORM, "model.safetensors", "[32]", "expected [64]")
    d = _copy(mlx4_dir, tmp_path / "dtype")
    key = "language_model.lm_head.weight"
    _edit(d, lambda t: t.update({key: t[key].view(torch.int32)}))
    _raises(d, key, "I32", "U32")


def test_truncated_file(tmp_path, mlx4_dir):
    d = _copy(mlx4_dir, tmp_path / "c")
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    _raises(d, "truncated", "model.safetensors")
    f.write_bytes(b"\x01\x02")
    _raises(d, "too small")


def test_corrupt_header(tmp_path, mlx4_dir):
    d = _copy(mlx4_dir, tmp_path / "c")
    f = d / "model.safetensors"
    data = bytearray(f.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    data[8 : 8 + 16] = b"\xff" * 16  # not JSON any more
    f.write_bytes(bytes(data))
    _raises(d, "not valid JSON", "model.safetensors")
    f.write_bytes(struct.pack("<Q", 10**12) + bytes(data[8:]))  # header length past the end
    _raises(d, "header length", "runs past the end")
    header = json.loads(bytes(data_ok := (mlx4_dir / "model.safetensors").read_bytes())[8 : 8 + n])
    header[Q_NORM]["data_offsets"][1] += 2  # size no longer matches dtype and shape
    raw = json.dumps(header).encode()
    f.write_bytes(struct.pack("<Q", len(raw)) + raw + data_ok[8 + n :])
    _raises(d, Q_NORM, "bytes for BF16 shape [64]")


def test_missing_shard(tmp_path, mlx4_dir):
    d = _copy(mlx4_dir, tmp_path / "c", keep_index=True)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    index["weight_map"][Q_NORM] = "model-00002-of-00002.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    _raises(d, "model-00002-of-00002.safetensors", "does not exist")


def test_no_safetensors(tmp_path, mlx4_dir):
    d = tmp_path / "empty"
    d.mkdir()
    shutil.copy(mlx4_dir / "config.json", d)
    _raises(d, "no *.safetensors")


def test_unsupported_or_mismatched_config(tmp_path, mlx4_dir, hf_fused_dir):
    cfg = json.loads((mlx4_dir / "config.json").read_text())
    d = tmp_path / "bits3"
    d.mkdir()
    (d / "config.json").write_text(
        json.dumps({**cfg, "quantization": {**cfg["quantization"], "bits": 3}})
    )
    with pytest.raises(ConfigError, match="quantization.bits"):
        ModelConfig.from_dir(d)
    # a config that disagrees with the tensors: 8 bits declared, 4 stored
    eight = ModelConfig.from_dict({**cfg, "quantization": {**cfg["quantization"], "bits": 8}})
    _raises(mlx4_dir, "embed_tokens.weight", "expected [512, 32]", cfg=eight)
    # one layer fewer than the checkpoint has
    tc = {**cfg["text_config"], "num_hidden_layers": 3, "layer_types": ["linear_attention"] * 3}
    _raises(
        mlx4_dir,
        "unexpected tensor",
        "layers.3",
        cfg=ModelConfig.from_dict({**cfg, "text_config": tc}),
    )
    # a quantization block on a Hugging Face layout checkpoint
    hf = json.loads((hf_fused_dir / "config.json").read_text())
    _raises(
        hf_fused_dir,
        "quantization",
        cfg=ModelConfig.from_dict({**hf, "quantization": cfg["quantization"]}),
    )
    with pytest.raises(ValueError, match="quantize_on_load"):
        load_params(mlx4_dir, ModelConfig.from_dir(mlx4_dir), quantize_on_load=3)


def test_progress_bar_to_stderr(mlx4_dir, capsys):
    load_params(mlx4_dir, ModelConfig.from_dir(mlx4_dir), progress=True)
    assert "loading" not in capsys.readouterr().err  # small load: no bar
    load_params(mlx4_dir, ModelConfig.from_dir(mlx4_dir), progress="always")
    assert "loading" in capsys.readouterr().err


# ---------------------------------------------------------------- write_random_checkpoint


@pytest.fixture(scope="module")
def random_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("random")
    return {
        lay: write_random_checkpoint(root / lay, TINY_TEXT_CONFIG, lay)
        for lay in ("mlx4", "mlx8", "hf")
    }


@pytest.mark.parametrize("layout", ["mlx4", "mlx8", "hf"])
def test_random_checkpoint_loads_back(layout, random_dirs):
    d = random_dirs[layout]
    cfg = ModelConfig.from_dir(d)
    params = _load(d)
    shapes = canonical_shapes(cfg)
    assert list(params) == list(shapes)
    assert all(tuple(params[n].shape) == s for n, s in shapes.items())
    for name, w in params.items():
        if layout == "hf":
            assert isinstance(w, torch.Tensor) and torch.isfinite(w).all(), name
            continue
        if isinstance(w, QuantWeight):
            router = name.endswith(("moe.router", "shared_expert_gate"))
            assert w.bits == (8 if router else int(layout[-1])), name
            std = dequantize(w).std().item()
            assert 0.01 < std < 0.04, (name, std)  # about normal(0, 0.02)
    for n in ("norm", "layers.0.dn.norm", "layers.3.attn.q_norm"):  # multipliers near 1
        assert (params[n] - 1).abs().max() < 0.5, n
    a_log = params["layers.0.dn.A_log"]
    assert a_log.dtype == torch.float32 and (a_log >= 0).all() and (a_log <= np.log(16)).all()


@pytest.mark.parametrize("layout", ["mlx4", "mlx8"])
def test_random_quantization_block_equals_converter(layout, random_dirs, mlx4_dir, mlx8_dir):
    ours = json.loads((random_dirs[layout] / "config.json").read_text())
    theirs = json.loads(((mlx4_dir if layout == "mlx4" else mlx8_dir) / "config.json").read_text())
    for key in ("quantization", "quantization_config"):
        assert list(ours[key].items()) == list(theirs[key].items()), key
    assert ours["model_type"] == theirs["model_type"] == "qwen3_5_moe"


def test_random_mlx4_runs_in_mlx_lm(random_dirs):
    import mlx_lm

    model, _ = mlx_lm.load(str(random_dirs["mlx4"]))
    logits = np.array(model(mx.array([[3, 70, 150, 9, 300, 41, 5, 260]])).astype(mx.float32))
    assert logits.shape == (1, 8, 512) and np.isfinite(logits).all()
    assert len(set(logits[0].argmax(-1).tolist())) > 2  # varied tokens, not a constant


def test_random_hf_loads_strictly_in_transformers(random_dirs):
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    d = random_dirs["hf"]
    text = json.loads((d / "config.json").read_text())["text_config"]
    model, info = Qwen3_5MoeForCausalLM.from_pretrained(
        d, config=Qwen3_5MoeTextConfig(**text), dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert not info["mismatched_keys"]
    with torch.no_grad():
        logits = model(torch.tensor([[3, 70, 150, 9, 300, 41, 5, 260]])).logits
    assert torch.isfinite(logits).all() and len(set(logits[0].argmax(-1).tolist())) > 2


def test_random_sharded_and_tied(tmp_path, random_dirs):
    d = write_random_checkpoint(tmp_path / "sh", TINY_TEXT_CONFIG, "mlx4", shard_bytes=300_000)
    assert len(list(d.glob("model-*-of-*.safetensors"))) > 1
    assert (d / "model.safetensors.index.json").is_file()
    sharded, single = _load(d), _load(random_dirs["mlx4"])  # same seed: same values
    for n, w in single.items():
        v = sharded[n]
        if isinstance(w, QuantWeight):
            assert torch.equal(w.qweight, v.qweight) and torch.equal(w.scales, v.scales), n
        else:
            assert torch.equal(w, v), n
    tied = write_random_checkpoint(
        tmp_path / "tied", {**TINY_TEXT_CONFIG, "tie_word_embeddings": True}, "mlx4"
    )
    params = _load(tied)
    assert params["lm_head"] is params["embed_tokens"]
    with pytest.raises(ValueError, match="layout"):
        write_random_checkpoint(tmp_path / "bad", TINY_TEXT_CONFIG, "fp8")


def test_missing_text_config_fields_default_to_the_full_model():
    full = complete_text_config({})
    assert full == FULL_TEXT_CONFIG
    cfg = ModelConfig.from_dict({"model_type": "qwen3_5_moe", "text_config": full})
    assert (cfg.hidden_size, cfg.num_experts, cfg.vocab_size) == (2048, 256, 248320)
    assert cfg.attn_layers == tuple(range(3, 40, 4))
    small = complete_text_config({"num_hidden_layers": 8, "full_attention_interval": 2})
    assert small["layer_types"] == ["linear_attention", "full_attention"] * 4
