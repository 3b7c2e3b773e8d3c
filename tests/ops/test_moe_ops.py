"""MoE decode and prefill kernels against the plain-PyTorch reference (docs MODEL.md maths).

Under the Triton interpreter when there is no CUDA (see test_qlinear_ops.py). Small odd
shapes: E=5 experts (also 12 with top-8), I=64, shared Is=128, D=192, T=13 and 37 tokens.
Bounds (relative L2 of the MoE output, residual removed): fp32 decode 1e-4 (fp32 all
through); bf16 in or out, or prefill (bf16 tensor-core operands, h and y stored in bf16)
2e-2, where ~5e-3 is seen.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Kernels are built at import; tests/conftest.py normally sets this first.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from lily.ops.moe_decode import MoeDecodeConfig, moe_decode  # noqa: E402
from lily.ops.moe_prefill import MoePrefillConfig, moe_prefill, moe_prefill_config  # noqa: E402
from lily.ops.qgemm import GemmConfig  # noqa: E402
from lily.ops.qgemv import GemvConfig  # noqa: E402
from lily.ops.ref_linear import ref_moe, ref_qlinear, ref_route  # noqa: E402
from lily.quant import quantize  # noqa: E402

DEVICES = ["cuda"] if torch.cuda.is_available() else ["cpu"]
D, I_E, I_S = 192, 64, 128


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    assert torch.isfinite(a).all(), "output has NaN/inf (unwritten or bad values)"
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture
def poison(monkeypatch):
    """torch.empty returns NaN-filled floats and -1-filled ints while the test runs."""
    real = torch.empty

    def empty(*args, **kwargs):
        t = real(*args, **kwargs)
        return t.fill_(float("nan") if t.is_floating_point() else -1)

    monkeypatch.setattr(torch, "empty", empty)


def make_moe(e: int, bits: int, gs: int, shared: bool, seed: int, device: str) -> dict:
    g = torch.Generator().manual_seed(seed)

    def q(shape, b=bits):
        return quantize(torch.randn(shape, generator=g) / shape[-1] ** 0.5, b, gs).to(device)

    w = {
        # Logits of order 1: a soft softmax, so every routing weight matters.
        "router": quantize(torch.randn(e, D, generator=g) / D**0.5, 8, gs).to(device),
        "gate": q((e, I_E, D)),
        "up": q((e, I_E, D)),
        "down": q((e, D, I_E)),
        "shared_gate": None,
        "shared_up": None,
        "shared_down": None,
        "shared_expert_gate": None,
    }
    if shared:
        w |= {
            "shared_gate": q((I_S, D)),
            "shared_up": q((I_S, D)),
            "shared_down": q((D, I_S)),
            "shared_expert_gate": q((1, D), 8),
        }
    return w


def moe_err(y: torch.Tensor, w: dict, x: torch.Tensor, k: int, res: torch.Tensor) -> float:
    ref = ref_moe(x, *w.values(), k, res)
    return rel_err(y.float() - res.float(), ref - res.float())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "e,k,bits,gs,shared,dtype,bound",
    [
        (5, 2, 4, 64, True, torch.float32, 1e-4),
        (5, 3, 8, 32, False, torch.float32, 1e-4),
        (12, 8, 4, 32, True, torch.bfloat16, 2e-2),
    ],
    ids=["4b-g64-shared-fp32", "8b-g32-k3-fp32", "4b-g32-e12-k8-bf16"],
)
def test_moe_decode_matches_reference(poison, device, e, k, bits, gs, shared, dtype, bound):
    w = make_moe(e, bits, gs, shared, seed=e * k + bits, device=device)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(D, generator=g).to(device, dtype)
    res = torch.randn(D, generator=g).to(device, dtype)
    # Wider tiles for the 9-slot case keep the interpreter quick; others use the defaults.
    cfg = MoeDecodeConfig(GemvConfig(32, 4), GemvConfig(32, 2, 1, 2)) if k == 8 else None
    y = moe_decode(x, *w.values(), k, res, config=cfg)
    assert y.shape == (D,) and y.dtype == dtype
    assert moe_err(y, w, x, k, res) < bound


@pytest.mark.parametrize("device", DEVICES)
def test_moe_decode_replays_on_new_tokens(device):
    """Two tokens through one captured call (a CUDA graph on the GPU, as the decode step
    runs; two eager calls on the CPU): nothing may leak from one call into the next."""
    w = make_moe(8, 4, 64, True, seed=21, device=device)
    g = torch.Generator().manual_seed(9)
    xs = [torch.randn(D, generator=g).bfloat16().to(device) for _ in range(3)]
    rs = [torch.randn(D, generator=g).bfloat16().to(device) for _ in range(3)]
    x, r = xs[0].clone(), rs[0].clone()
    if device == "cuda":
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            moe_decode(x, *w.values(), 2, r)  # compile outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = moe_decode(x, *w.values(), 2, r)
    for i in (1, 2):
        x.copy_(xs[i])
        r.copy_(rs[i])
        if device == "cuda":
            graph.replay()
            torch.cuda.synchronize()
        else:
            out = moe_decode(x, *w.values(), 2, r)
        assert moe_err(out, w, xs[i], 2, rs[i]) < 2e-2


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "bits,gs,shared,block_m,atomic",
    [
        (4, 64, True, 16, False),
        (4, 32, True, 32, True),
        (8, 64, False, 16, False),
    ],
    ids=["4b-g64-shared-m16", "4b-g32-shared-m32-atomic", "8b-g64-m16"],
)
def test_moe_prefill_matches_reference(poison, device, bits, gs, shared, block_m, atomic):
    w = make_moe(5, bits, gs, shared, seed=bits + gs, device=device)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(13, D, generator=g).bfloat16().to(device)
    res = torch.randn(13, D, generator=g).bfloat16().to(device)
    bk = max(64, gs)
    cfg = MoePrefillConfig(block_m, GemmConfig(block_m, 32, bk), GemmConfig(block_m, 64, bk))
    y = moe_prefill(x, *w.values(), 2, res, atomic=atomic, config=cfg)
    assert y.shape == (13, D) and y.dtype == torch.bfloat16
    assert moe_err(y, w, x, 2, res) < 2e-2


@pytest.mark.parametrize("device", DEVICES)
def test_moe_prefill_skewed_routing_and_empty_experts(poison, device):
    """Every token picks experts 0 and 1: 37 rows each (three 16-row tiles, one partial),
    experts 2..4 get no rows, and most of the worst-case block map stays empty."""
    w = make_moe(5, 4, 64, True, seed=11, device=device)
    g = torch.Generator().manual_seed(3)
    u = torch.randn(D, generator=g)
    router = torch.randn(5, D, generator=g) * 0.05
    router[0] += u
    router[1] += 0.8 * u
    w["router"] = quantize(router, 8, 64).to(device)
    x = (torch.randn(37, D, generator=g) * 0.3 + u).bfloat16().to(device)
    _, ids = ref_route(ref_qlinear(x, w["router"]), 2)
    assert set(ids.flatten().tolist()) == {0, 1}, "the test router must be skewed"
    cfg = MoePrefillConfig(16, GemmConfig(16, 32, 64), GemmConfig(16, 64, 64))
    y = moe_prefill(x, *w.values(), 2, None, config=cfg)
    assert rel_err(y, ref_moe(x, *w.values(), 2)) < 2e-2


@pytest.mark.parametrize("device", DEVICES)
def test_moe_prefill_fp32_input_no_shared_top3(poison, device):
    """fp32 activations in and out, no shared expert, an odd top-k, the default tile table."""
    w = make_moe(5, 4, 64, False, seed=5, device=device)
    x = torch.randn(13, D, generator=torch.Generator().manual_seed(4)).to(device)
    y = moe_prefill(x, *w.values(), 3)
    assert y.dtype == torch.float32
    assert rel_err(y, ref_moe(x, *w.values(), 3)) < 2e-2


def test_prefill_tile_table_follows_rows_per_expert():
    """BLOCK_M grows with the mean rows per expert (T*k/E): 16 rows at 512 tokens, 64 at 2K."""
    assert moe_prefill_config(512, 8, 256).block_m == 16
    assert moe_prefill_config(2048, 8, 256).block_m == 64
    assert moe_prefill_config(8192, 8, 256).block_m == 128
    for t in (1, 100, 512, 1000, 2048, 8192, 65536):
        cfg = moe_prefill_config(t, 8, 256)
        assert cfg.gate_up.block_k % 64 == 0 and cfg.down.block_k % 64 == 0


def test_moe_bad_inputs_give_clear_errors():
    w = make_moe(5, 4, 64, True, seed=6, device="cpu")
    x = torch.randn(D).bfloat16()
    args = list(w.values())
    with pytest.raises(ValueError, match="top_k"):
        moe_decode(x, *args, 6)
    with pytest.raises(ValueError, match="one token"):
        moe_decode(x[None], *args, 2)
    with pytest.raises(ValueError, match="all of shared"):
        moe_decode(x, *args[:4], None, *args[5:], 2)
    with pytest.raises(ValueError, match="expert shapes"):
        moe_prefill(x[None], args[0], args[1], args[2], args[1], *args[4:], 2)
    with pytest.raises(ValueError, match="residual"):
        moe_prefill(x[None], *args, 2, torch.zeros(2, D))
    with pytest.raises(ValueError, match="inputs"):
        moe_prefill(torch.randn(3, D + 1), *args, 2)
