"""The MoE prefill's sm_90 grouped GEMMs (lily/ops/moe_gemm_sm90.py: weights and h by TMA
descriptors) against the portable kernels and the plain reference.

Under the Triton interpreter without CUDA (tensor descriptors included); on an sm_90 GPU
compiled (elsewhere the GPU cases skip: TMA is Hopper's). Shapes as test_moe_ops.py: E=5
or 12 experts, I=64, shared Is=128 or 64, D=192, 13 to 70 tokens, odd tiles. The sm90 path
must give the portable path's result (the same dequantization and products; on the
interpreter the same bits) and the reference's within bf16 bounds (2e-2).
"""

from __future__ import annotations

import pytest
import torch

from lily.ops import moe_prefill as mp
from lily.ops.moe_prefill import MoePrefillConfig, moe_prefill
from lily.ops.qgemm import GemmConfig
from lily.quant import QuantWeight, quantize
from tests.ops.common import rel_err
from tests.ops.test_moe_ops import make_moe, moe_err

CUDA = torch.cuda.is_available()
SM90 = CUDA and torch.cuda.get_device_capability() == (9, 0)
DEVICE = "cuda" if CUDA else "cpu"
pytestmark = pytest.mark.skipif(CUDA and not SM90, reason="the sm90 kernels need Hopper")
D = 192


def fused_views(w: dict) -> dict:
    """gate and up as the two halves of one (E, 2I, ...) tensor (strided views), as a
    checkpoint's fused gate_up loads."""
    g, u = w["gate"], w["up"]
    parts = [torch.cat([getattr(g, n), getattr(u, n)], dim=1) for n in ("qweight", "scales",
                                                                         "biases")]  # fmt: skip
    i = g.shape[1]
    half = lambda lo: QuantWeight(*(p[:, lo : lo + i] for p in parts), g.bits, g.group_size)  # noqa: E731
    return {**w, "gate": half(0), "up": half(i)}


@pytest.mark.parametrize(
    "e,k,bits,gs,shared,i_s,block_m,gate_up,down,t,fused",
    [
        (5, 2, 4, 64, True, 128, 16, (32, 64), (64, 64), 13, False),  # Is > I: K mask
        (5, 2, 4, 64, True, 64, 32, (64, 128), (32, 64), 37, True),  # Is = I, strided views
        (12, 8, 4, 32, True, 128, 16, (32, 64), (64, 32), 29, False),  # top-8, group 32
        (5, 3, 8, 64, False, 128, 16, (32, 64), (64, 64), 13, False),  # 8-bit, no shared
    ],
    ids=["4b-Is128", "4b-Is64-fused", "top8-g32", "8b-noshared"],
)
def test_sm90_gemms_match_portable_and_reference(poison, e, k, bits, gs, shared, i_s, block_m,
                                                 gate_up, down, t, fused):  # fmt: skip
    w = make_moe(e, bits, gs, shared, seed=31 + e + bits, device=DEVICE, i_s=i_s)
    if fused:
        w = fused_views(w)
        assert not w["gate"].qweight.is_contiguous()
    g = torch.Generator().manual_seed(t)
    x = torch.randn(t, D, generator=g).bfloat16().to(DEVICE)
    res = torch.randn(t, D, generator=g).bfloat16().to(DEVICE)
    cfg = MoePrefillConfig(block_m, GemmConfig(block_m, *gate_up), GemmConfig(block_m, *down))
    got = moe_prefill(x, *w.values(), k, res, config=cfg, gemm="sm90")
    want = moe_prefill(x, *w.values(), k, res, config=cfg, gemm="portable")
    assert got.shape == (t, D) and got.dtype == torch.bfloat16
    if not CUDA:  # the same products in the same order
        assert torch.equal(got, want)
    assert rel_err(got.float() - res.float(), want.float() - res.float()) < 5e-3
    assert moe_err(got, w, x, k, res) < 2e-2


def test_sm90_skewed_routing_and_the_next_norm(poison):
    """Every token on experts 0 and 1 (70 rows each: five 16-row tiles, one partial; the
    others empty) with the next layer's norm in the last launch: the sm90 GEMMs give the
    portable path's output and norm."""
    w = make_moe(5, 4, 64, True, seed=41, device=DEVICE)
    g = torch.Generator().manual_seed(5)
    u = torch.randn(D, generator=g)
    router = torch.randn(5, D, generator=g) * 0.02
    router[0] += u
    router[1] += 0.9 * u
    w["router"] = quantize(router, 8, 64).to(DEVICE)
    x = (torch.randn(70, D, generator=g) * 0.2 + 1.5 * u).bfloat16().to(DEVICE)
    nw = (1.0 + 0.3 * torch.randn(D, generator=g)).bfloat16().to(DEVICE)
    cfg = MoePrefillConfig(16, GemmConfig(16, 32, 64), GemmConfig(16, 64, 64))
    got = moe_prefill(x, *w.values(), 2, x, config=cfg, norm_weight=nw, gemm="sm90")
    want = moe_prefill(x, *w.values(), 2, x, config=cfg, norm_weight=nw, gemm="portable")
    for a, b in zip(got, want, strict=True):
        if not CUDA:
            assert torch.equal(a, b)
        assert rel_err(a.float(), b.float()) < 5e-3


def test_gemm_choice():
    """The "auto" choice takes the sm90 kernels only on an sm_90 GPU; a bad name or an impossible
    request ("sm90" with the atomic down) is a clear error."""
    w = make_moe(5, 4, 64, True, seed=3, device=DEVICE)
    x = torch.randn(4, D).bfloat16().to(DEVICE)
    cfg = MoePrefillConfig(16, GemmConfig(16, 32, 64), GemmConfig(16, 64, 64))
    weights = (w["gate"], w["up"], w["down"], w["shared_gate"], w["shared_up"], w["shared_down"])
    assert mp._sm90("auto", x, weights, cfg, False) == SM90
    assert not mp._sm90("portable", x, weights, cfg, False)
    with pytest.raises(ValueError, match="gemm must be"):
        moe_prefill(x, *w.values(), 2, gemm="tma")
    with pytest.raises(ValueError, match="no atomic down"):
        moe_prefill(x, *w.values(), 2, atomic=True, config=cfg, gemm="sm90")
