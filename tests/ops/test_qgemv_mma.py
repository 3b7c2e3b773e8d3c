"""qgemv_mma (tensor-core decode GEMV) against the plain-PyTorch reference.

Without CUDA the kernel runs under the Triton interpreter through its ON_CPU path (codes as
fp32 bit patterns, fp32 dot) with the same tiling, masking, K order and scale algebra as
the GPU path. Odd shapes: N not a multiple of the row tile, K of 5 groups (padded to 8).
Bounds as for qgemv: fp32 outputs 2e-5 relative L2 (fp32 arithmetic, exact products),
bf16 outputs 1e-2; with the norm prologue and bf16 x 5e-4 (a last-ulp difference of rstd
may flip one rounding of the normed x).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from lily.model.norm import rms_norm  # noqa: E402
from lily.model.ref import ref_qlinear  # noqa: E402
from lily.ops.qgemv import qgemv  # noqa: E402
from lily.ops.qgemv_mma import MmaGemvConfig, mma_gemv_config, qgemv_mma  # noqa: E402
from lily.quant import QuantWeight, quantize  # noqa: E402
from tests.ops.common import rel_err  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _weight(n: int, k: int, gs: int, gen: torch.Generator, bits: int = 4) -> QuantWeight:
    return quantize(torch.randn(n, k, generator=gen) / k**0.5, bits, gs).to(DEVICE)


@pytest.mark.parametrize(
    "n,k,gs,cfg",
    [
        (100, 128, 64, None),
        (129, 320, 64, MmaGemvConfig(32, 4)),
        (257, 320, 32, MmaGemvConfig(16, 8)),
        (72, 256, 128, MmaGemvConfig(64, 2)),
        (40, 512, 64, MmaGemvConfig(16, 16)),
    ],
    ids=[
        "n100-k128-table",
        "n129-k320-b32w4",
        "n257-k320-g32-b16w8",
        "n72-g128-b64w2",
        "n40-k512-b16w16",
    ],  # fmt: skip
)
def test_qgemv_mma_matches_reference(poison, n, k, gs, cfg):
    """bf16 x, bf16 and fp32 outputs, a residual; row tiles that overhang N, K groups that
    overhang the warps (5 groups on 4 or 8 warps), groups of 32, 64 and 128."""
    gen = torch.Generator().manual_seed(n + k + gs)
    w = _weight(n, k, gs, gen)
    x = torch.randn(k, generator=gen).bfloat16().to(DEVICE)
    res = torch.randn(n, generator=gen).bfloat16().to(DEVICE)
    y = qgemv_mma(x, w, residual=res, config=cfg)
    assert y.shape == (n,) and y.dtype == torch.bfloat16
    assert rel_err(y, ref_qlinear(x, w, res)) < 1e-2
    y32 = qgemv_mma(x, w, out_dtype=torch.float32, config=cfg)
    assert y32.dtype == torch.float32
    assert rel_err(y32, ref_qlinear(x, w)) < 2e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_qgemv_mma_wide_inputs(poison, dtype):
    """fp32 and fp16 x go to the tensor cores as three or two bf16 terms: the products stay
    exact, so fp32 accuracy holds (one bf16 term would give ~2e-3)."""
    gen = torch.Generator().manual_seed(3)
    w = _weight(96, 320, 64, gen)
    x = (3.0 * torch.randn(320, generator=gen)).to(DEVICE, dtype)
    res = torch.randn(96, generator=gen).to(DEVICE, dtype)
    y = qgemv_mma(x, w, residual=res, out_dtype=torch.float32)
    assert rel_err(y, ref_qlinear(x, w, res)) < 2e-5
    assert qgemv_mma(x, w).dtype == dtype


@pytest.mark.parametrize(
    "dtype,gs,cfg",
    [(torch.bfloat16, 64, None), (torch.float32, 32, MmaGemvConfig(32, 2)),
     (torch.bfloat16, 64, MmaGemvConfig(64, 8))],
    ids=["bf16-table", "fp32-g32-w2", "bf16-b64w8"],
)  # fmt: skip
def test_qgemv_mma_norm_prologue(poison, dtype, gs, cfg):
    """``norm_weight``: the GEMV of rms_norm(x) * w_norm (the unfused model norm as the
    reference), with a residual and fp32 output; the statistics cover the real K only (5
    groups padded to 8)."""
    gen = torch.Generator().manual_seed(40)
    w = _weight(70, 320, gs, gen)
    x = (3.0 * torch.randn(1, 320, generator=gen) + 0.5).to(DEVICE, dtype)
    nw = (1.0 + 0.2 * torch.randn(320, generator=gen)).to(DEVICE, torch.bfloat16)
    res = torch.randn(1, 70, generator=gen).to(DEVICE, dtype)
    eps = 1e-5
    h = rms_norm(x, nw, eps)
    y = qgemv_mma(x, w, norm_weight=nw, eps=eps, residual=res, out_dtype=torch.float32, config=cfg)
    assert y.shape == (1, 70)
    assert rel_err(y, ref_qlinear(h, w, res)) < (2e-5 if dtype == torch.float32 else 5e-4)
    y_plain = qgemv_mma(x, w, residual=res, out_dtype=torch.float32, config=cfg)
    assert rel_err(y_plain, ref_qlinear(h, w, res)) > 1e-2, "the norm must change the result"


def test_qgemv_mma_pdl_and_qgemv_agree(poison):
    """``pdl=True`` (a no-op off Hopper) gives the same bits; qgemv_mma and qgemv agree to
    fp32 rounding (both against the reference)."""
    gen = torch.Generator().manual_seed(5)
    w = _weight(130, 256, 64, gen)
    x = torch.randn(256, generator=gen).bfloat16().to(DEVICE)
    nw = (1.0 + 0.2 * torch.randn(256, generator=gen)).to(DEVICE, torch.bfloat16)
    y = qgemv_mma(x, w, norm_weight=nw, out_dtype=torch.float32)
    assert torch.equal(y, qgemv_mma(x, w, norm_weight=nw, out_dtype=torch.float32, pdl=True))
    y_fma = qgemv(x, w, norm_weight=nw, out_dtype=torch.float32)
    assert rel_err(y, y_fma) < 2e-5


def test_qgemv_mma_rejects_what_it_does_not_run():
    gen = torch.Generator().manual_seed(9)
    w = _weight(32, 128, 64, gen)
    x = torch.randn(128, generator=gen).bfloat16().to(DEVICE)
    with pytest.raises(ValueError, match="8-bit"):
        qgemv_mma(x, _weight(32, 128, 64, gen, bits=8))
    with pytest.raises(ValueError, match="several rows"):
        qgemv_mma(x.reshape(1, 128).expand(2, 128), w)
    with pytest.raises(ValueError, match="inputs"):
        qgemv_mma(x[:64], w)
    with pytest.raises(ValueError, match="residual"):
        qgemv_mma(x, w, residual=torch.zeros(33, device=DEVICE))
    with pytest.raises(TypeError, match="QuantWeight"):
        qgemv_mma(x, torch.zeros(32, 128, device=DEVICE))
    shifted = torch.zeros(32 * 16 + 1, dtype=torch.int32, device=DEVICE)[1:].view(32, 16)
    with pytest.raises(ValueError, match="16-byte"):
        qgemv_mma(x, QuantWeight(shifted, w.scales, w.biases, 4, 64))
    with pytest.raises(ValueError, match="block_n"):
        MmaGemvConfig(8, 4)
    with pytest.raises(ValueError, match="num_warps"):
        MmaGemvConfig(16, 3)


def test_mma_gemv_config_shapes():
    """The table's tiles for the model's shapes: K = 2048 on 8 warps (4 groups of 64 a
    warp), K = 4096 on 16, and at least 128 programs down to 2048 rows."""
    for n, k in [(8192, 2048), (12352, 2048), (9216, 2048), (4096, 2048), (2048, 4096),
                 (248320, 2048), (512, 2048)]:  # fmt: skip
        cfg = mma_gemv_config(n, k, 64)
        assert cfg.num_warps == (16 if k == 4096 else 8), (n, k, cfg)
        assert -(-n // cfg.block_n) >= min(128, n // 16), (n, k, cfg)
