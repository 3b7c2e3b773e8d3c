"""Random full-size weights: the MLX layout the loader expects, sane values, same bytes."""

from __future__ import annotations

import math

import pytest
import torch

from lily.bench.conditioned import DEFAULT, plan
from lily.bench.measure import cost_model, decode_bytes, prefill_flops
from lily.bench.random_model import (
    fingerprint,
    hot_experts,
    model_config,
    mute_head_rows,
    params_nbytes,
    random_params,
    save_mlx_checkpoint,
    skew_router,
    text_config,
)
from lily.config import ModelConfig
from lily.quant import QuantWeight, dequantize
from lily.runtime.runner import Runner
from lily.runtime.state import SessionState
from lily.weights import canonical_shapes, expected_tensors, load_params

ST_BYTES = {"U32": 4}


def test_full_config_matches_the_mlx_checkpoint_layout_without_allocating():
    cfg = model_config("full")
    params = random_params(cfg, "meta")
    groups = expected_tensors(cfg, "mlx")  # the loader's table of an MLX 4-bit checkpoint
    names = list(canonical_shapes(cfg))
    assert set(params) == set(names)
    total = 0
    for name, group in zip(names, groups, strict=True):
        w = params[name]
        if len(group) == 3:  # packed: weight (U32), scales, biases
            assert isinstance(w, QuantWeight), name
            (_, wshape, kind), (_, sshape, _), (_, bshape, _) = group
            assert kind == "U32" and tuple(w.qweight.shape) == tuple(wshape), name
            assert tuple(w.scales.shape) == tuple(sshape) == tuple(w.biases.shape), name
            assert w.qweight.dtype == torch.int32 and w.scales.dtype == torch.bfloat16
            assert w.group_size == 64
            router = name.endswith(("moe.router", "moe.shared_expert_gate"))
            assert w.bits == (8 if router else 4), name
            total += math.prod(wshape) * 4 + 2 * math.prod(sshape) * 2
        else:
            assert isinstance(w, torch.Tensor), name
            want = group[0][1]
            shape = tuple(want[:-1]) if name.endswith("conv1d") else tuple(want)  # (C, K, 1)
            assert tuple(w.shape) == shape, name
            assert w.dtype == (torch.float32 if name.endswith("A_log") else torch.bfloat16)
            total += math.prod(want) * w.element_size()
    assert params_nbytes(params) == total
    assert 19.4e9 < total < 19.6e9  # shared/MODEL.md: 19.5 GB on disk


def test_full_config_cost_model_matches_model_md():
    cfg = model_config("full")
    cost = cost_model(cfg, random_params(cfg, "meta"), act_bytes=2)
    # MODEL.md: experts+shared+routers ~660 MB, DeltaNet ~569 MB, attention ~154 MB,
    # lm_head ~286 MB: about 1.67 GB per decode step.
    assert 1.60e9 < cost["weight_bytes_per_token"] < 1.72e9
    assert cost["kv_bytes_per_context_token"] == 20 * 1024  # 20 KiB per token of context
    recurrent = 30 * 32 * 128 * 128 * 4  # 60 MiB, read and written
    assert 2 * recurrent < cost["state_bytes_per_token"] < 2 * recurrent * 1.05
    assert decode_bytes(cost, 4096) - decode_bytes(cost, 0) == 80 * 2**20  # 80 MiB at 4K
    flops = prefill_flops(cost, 1) - 2 * cost["lm_head_params"]
    assert 4.5e9 < flops < 5.3e9  # about 4.9 GFLOP per token at short prompts


def _deep_tiny() -> ModelConfig:
    """The tiny widths with the real depth: 40 layers, every 4th attention."""
    from lily.checkpoint import make_config

    tc = text_config("tiny") | {"num_hidden_layers": 40,
                                "layer_types": text_config("full")["layer_types"]}  # fmt: skip
    return ModelConfig.from_dict(make_config(tc, "mlx4", torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_activations_stay_finite_through_40_layers(dtype):
    from lily.model.model import Model

    cfg = _deep_tiny()
    model = Model(cfg, random_params(cfg, "cpu", seed=5, dtype=dtype), dtype)
    state = SessionState.new(cfg, "cpu", dtype, 256)
    ids = torch.randint(0, cfg.vocab_size, (48,), generator=torch.Generator().manual_seed(0))
    logits = Runner(model, 64).score(ids.tolist(), state)
    assert logits.isfinite().all()
    assert 0.05 < logits.std().item() < 20  # neither collapsed nor blown up
    assert len(set(logits.argmax(-1).tolist())) > 3  # predictions vary with the input


def test_muted_head_rows_give_zero_logits_and_never_win():
    from lily.model.model import Model

    cfg = model_config("tiny")
    params = random_params(cfg, "cpu", seed=3, dtype=torch.float32)
    muted = mute_head_rows(params, 100)
    head, old = dequantize(muted["lm_head"]), dequantize(params["lm_head"])
    assert head[100:].abs().max() == 0 and torch.equal(head[:100], old[:100])
    assert params["lm_head"].scales[100:].abs().max() > 0  # the caller's tensors untouched
    ids = torch.randint(0, cfg.vocab_size, (24,), generator=torch.Generator().manual_seed(1))
    logits = Runner(Model(cfg, muted, torch.float32), 64).score(
        ids.tolist(), SessionState.new(cfg, "cpu", torch.float32, 64)
    )
    assert torch.equal(logits[:, 100:], torch.zeros_like(logits[:, 100:]))
    assert (logits.argmax(-1) < 100).all()  # greedy emits only ids the tokenizer names


def test_same_seed_same_bytes_other_seed_other_bytes():
    cfg = model_config("tiny")
    a = random_params(cfg, "cpu", seed=1)
    b = random_params(cfg, "cpu", seed=1)
    c = random_params(cfg, "cpu", seed=2)
    assert fingerprint(a) == fingerprint(b) != fingerprint(c)
    assert torch.equal(a["layers.0.moe.gate_proj"].qweight, b["layers.0.moe.gate_proj"].qweight)
    # the conditioned model: an input projection's std is 1/|h| (unit pre-activations)
    w = dequantize(a["layers.0.moe.gate_proj"])
    want = 1.0 / plan(cfg, DEFAULT)[0].h_moe
    assert abs(w.mean().item()) < 0.05 * want and 0.85 * want < w.std().item() < 1.15 * want
    plain = random_params(cfg, "cpu", seed=1, recipe=None)
    w = dequantize(plain["layers.0.moe.gate_proj"])
    assert abs(w.mean().item()) < 0.002 and 0.015 < w.std().item() < 0.025  # ~ normal(0, 0.02)


def test_router_skew_scales_only_the_hot_rows():
    cfg = model_config("tiny")
    hot = hot_experts(cfg.num_experts, 0)
    base = random_params(cfg, "cpu", seed=0, recipe=None)  # the plain init's router
    skewed = random_params(cfg, "cpu", seed=0, router_skew=2.0, recipe=None)
    for i in range(cfg.num_hidden_layers):
        w0 = dequantize(base[f"layers.{i}.moe.router"])
        w1 = dequantize(skewed[f"layers.{i}.moe.router"])
        cold = [e for e in range(cfg.num_experts) if e not in hot]
        assert torch.equal(w0[cold], w1[cold])
        r0, r1 = base[f"layers.{i}.moe.router"], skewed[f"layers.{i}.moe.router"]
        assert torch.equal(r1.qweight, r0.qweight)
        assert torch.equal(r1.scales[hot], (3.0 * r0.scales[hot].float()).to(torch.bfloat16))
        # scale and bias are each rounded to bf16 (2^-9 relative): up to ~7e-4 here
        torch.testing.assert_close(w1[hot], 3.0 * w0[hot], rtol=0, atol=1e-3)
    r = base["layers.0.moe.router"]
    assert torch.equal(skew_router(r, 0.0, hot).scales, r.scales)


def test_saved_checkpoint_loads_to_the_same_bytes(tmp_path):
    cfg = model_config("tiny")
    params = random_params(cfg, "cpu", seed=3)
    d = save_mlx_checkpoint(params, cfg, text_config("tiny"), tmp_path / "ckpt", progress=False)
    loaded_cfg = ModelConfig.from_dir(d)
    loaded = load_params(d, loaded_cfg, dtype=torch.bfloat16, progress=False)
    assert fingerprint(loaded) == fingerprint(params)
    for name, w in params.items():
        v = loaded[name]
        if isinstance(w, QuantWeight):
            assert torch.equal(v.qweight, w.qweight) and torch.equal(v.scales, w.scales), name
        else:
            assert torch.equal(v.to(w.dtype), w), name
