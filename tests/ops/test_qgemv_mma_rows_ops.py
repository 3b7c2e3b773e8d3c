"""qgemv_mma_rows (the tensor-core GEMV for B decode rows, a row per MMA column) against the
plain-PyTorch reference row by row, and against qgemv_mma of each row alone.

Without CUDA the kernel runs under the Triton interpreter through its ON_CPU path (codes as
fp32 bit patterns, fp32 dot) with the same tiling, masking, K order and scale algebra as the
GPU path. Odd shapes: N not a multiple of the row tile, K of 3 or 5 groups (padded to 4 or
8), groups of 32, 64 and 128, B = 1, 3, 8 (8 columns), 9 and 16 (16 columns), x and the
residual as strided views. Fresh buffers are NaN (``poison``), so an unwritten output fails.
Bounds: against the reference 1e-2 relative L2 for bf16 outputs, 5e-4 for fp32 (bf16
operands; a last-ulp difference of rstd may flip one rounding of the normed x, as in
test_qgemv_mma); against qgemv_mma of the row alone at most one bf16 ulp an element (bf16
out) or 1e-5 relative (fp32 out): the same products, summed in another order.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from lily.model.norm import rms_norm  # noqa: E402
from lily.model.ref import ref_qlinear  # noqa: E402
from lily.ops.mma_rows import rows_prep  # noqa: E402
from lily.ops.qgemv_mma import MmaGemvConfig, mma_gemv_config, qgemv_mma  # noqa: E402
from lily.ops.qgemv_mma_rows import MAX_ROWS, mma_rows_config, qgemv_mma_rows  # noqa: E402
from lily.quant import QuantWeight, quantize  # noqa: E402
from tests.ops.common import rel_err  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-5
F32, BF16 = torch.float32, torch.bfloat16


def _weight(n: int, k: int, gs: int, gen: torch.Generator, bits: int = 4) -> QuantWeight:
    return quantize(torch.randn(n, k, generator=gen) / k**0.5, bits, gs).to(DEV)


CASES = {
    # id: (n, k, gs, b, norm, residual, out_dtype, config)
    "b1-n40-k5g64-norm-res-fp32": (40, 320, 64, 1, True, True, F32, None),
    "b3-n70-k3g32-res-bf16": (70, 96, 32, 3, False, True, BF16, None),
    "b8-n100-k3g128-norm-fp32": (100, 384, 128, 8, True, False, F32, MmaGemvConfig(32, 2)),
    "b9-n50-k5g64-norm-res-bf16": (50, 320, 64, 9, True, True, BF16, None),
    "b16-n33-k5g32-fp32-rows64": (33, 160, 32, 16, False, False, F32, MmaGemvConfig(64, 4)),
    "b16-n72-k5g64-norm-res-fp32": (72, 320, 64, 16, True, True, F32, MmaGemvConfig(16, 8)),
}  # fmt: skip


@pytest.mark.parametrize(("case", "how"), [
    (c, how) for c in CASES for how in ("default", "pow2", "prepared")])  # fmt: skip
def test_rows_match_reference_and_each_row_alone(poison, case, how):
    """Each row against the reference and against qgemv_mma of that row alone: the rows
    normed in each program on the default operand (``default``), on pow2(B) rows broadcast
    over the columns (``pow2``), or prepared once by rows_prep (``prepared``)."""
    n, k, gs, b, norm, has_res, out_dtype, cfg = CASES[case]
    gen = torch.Generator().manual_seed(n + k + b)
    w = _weight(n, k, gs, gen)
    # Strided views (a row stride past K and N): the kernel must use the strides.
    x = (2.0 * torch.randn(b, k + 8, generator=gen) + 0.3).bfloat16().to(DEV)[:, :k]
    nw = (1.0 + 0.2 * torch.randn(k, generator=gen)).bfloat16().to(DEV) if norm else None
    res = torch.randn(b, n + 3, generator=gen).bfloat16().to(DEV)[:, :n] if has_res else None
    if how == "prepared":
        xp = rows_prep(x, gs, nw, EPS)
        y = qgemv_mma_rows(xp, w, res, out_dtype=out_dtype, config=cfg)
    else:
        rows = (1 << max(0, b - 1).bit_length()) if how == "pow2" else None
        y = qgemv_mma_rows(x, w, res, out_dtype=out_dtype, norm_weight=nw, eps=EPS, config=cfg,
                           operand_rows=rows)  # fmt: skip
    assert y.shape == (b, n) and y.dtype == out_dtype
    h = rms_norm(x, nw, EPS) if norm else x
    bound = 1e-2 if out_dtype == BF16 else 5e-4
    for r in range(b):
        res_r = res[r] if has_res else None
        assert rel_err(y[r], ref_qlinear(h[r], w, res_r)) < bound, r
        one = qgemv_mma(x[r], w, norm_weight=nw, eps=EPS, residual=res_r, out_dtype=out_dtype)
        if out_dtype == BF16:  # at most one bf16 ulp apart
            assert ((y[r].float() - one.float()).abs() <= one.float().abs() * 2**-7).all(), r
        else:
            assert rel_err(y[r], one) < 1e-5, r
    if norm:  # the norm must matter (the rows are far from unit RMS)
        assert rel_err(y[0], ref_qlinear(x[0], w, res[0] if has_res else None)) > 1e-2


def test_rows_do_not_mix(poison):
    """A row's output depends on that row only: changing row 1 leaves rows 0 and 2 as they
    were (same bits), and rows equal in x give equal outputs."""
    gen = torch.Generator().manual_seed(7)
    w = _weight(48, 192, 64, gen)
    x = torch.randn(3, 192, generator=gen).bfloat16().to(DEV)
    x[2] = x[0]
    y = qgemv_mma_rows(x, w, out_dtype=F32)
    assert torch.equal(y[0], y[2])
    x2 = x.clone()
    x2[1] = 10.0 * torch.randn(192, generator=gen).bfloat16().to(DEV)
    y2 = qgemv_mma_rows(x2, w, out_dtype=F32)
    assert torch.equal(y2[0], y[0]) and torch.equal(y2[2], y[2])
    assert not torch.equal(y2[1], y[1])


def test_rows_reject_what_they_do_not_run():
    gen = torch.Generator().manual_seed(9)
    w = _weight(32, 128, 64, gen)
    x = torch.randn(2, 128, generator=gen).bfloat16().to(DEV)
    with pytest.raises(TypeError, match="bf16"):
        qgemv_mma_rows(x.float(), w)
    with pytest.raises(ValueError, match="1 <= B <= 16"):
        qgemv_mma_rows(torch.zeros(MAX_ROWS + 1, 128, dtype=BF16, device=DEV), w)
    with pytest.raises(ValueError, match="1 <= B <= 16"):
        qgemv_mma_rows(torch.zeros(0, 128, dtype=BF16, device=DEV), w)
    with pytest.raises(ValueError, match="1 <= B <= 16"):
        qgemv_mma_rows(x[0], w)
    with pytest.raises(ValueError, match="inputs"):
        qgemv_mma_rows(x[:, :64], w)
    with pytest.raises(ValueError, match="8-bit"):
        qgemv_mma_rows(x, _weight(32, 128, 64, gen, bits=8))
    with pytest.raises(TypeError, match="QuantWeight"):
        qgemv_mma_rows(x, torch.zeros(32, 128, device=DEV))
    shifted = torch.zeros(32 * 16 + 1, dtype=torch.int32, device=DEV)[1:].view(32, 16)
    with pytest.raises(ValueError, match="16-byte"):
        qgemv_mma_rows(x, QuantWeight(shifted, w.scales, w.biases, 4, 64))
    with pytest.raises(ValueError, match="residual"):
        qgemv_mma_rows(x, w, torch.zeros(2, 33, device=DEV))
    with pytest.raises(ValueError, match="norm_weight"):
        qgemv_mma_rows(x, w, norm_weight=torch.ones(64, device=DEV))
    with pytest.raises(TypeError, match="out_dtype"):
        qgemv_mma_rows(x, w, out_dtype=torch.int32)
    with pytest.raises(TypeError, match="MmaGemvConfig"):
        qgemv_mma_rows(x, w, config=(16, 4))
    for rows in (1, 3, 16):  # below B, not a power of two, past the 8 columns
        with pytest.raises(ValueError, match="operand_rows"):
            qgemv_mma_rows(x, w, operand_rows=rows)
    xp = rows_prep(x, 64)
    with pytest.raises(ValueError, match="normed by rows_prep"):
        qgemv_mma_rows(xp, w, norm_weight=torch.ones(128, device=DEV))
    with pytest.raises(ValueError, match="do not fit"):
        qgemv_mma_rows(rows_prep(x, 32), w)
    with pytest.raises(ValueError, match="do not fit"):
        qgemv_mma_rows(xp, _weight(32, 256, 64, gen))
    with pytest.raises(ValueError, match="whole groups"):
        rows_prep(x[:, :100], 64)
    with pytest.raises(ValueError, match="bf16"):
        rows_prep(x.float(), 64)
    with pytest.raises(ValueError, match="1 to 16 rows"):
        rows_prep(torch.zeros(MAX_ROWS + 1, 128, dtype=BF16, device=DEV), 64)


def test_prepared_rows_are_the_normed_rows():
    """rows_prep's operand holds each normed row's values (a permutation within each
    group, rows past B zero) and its sums are the groups' sums of the normed row. (To a bf16
    rounding: the kernel's sum of squares runs in another order than torch's, so on the GPU
    a value can land one bf16 step away.)"""
    gen = torch.Generator().manual_seed(11)
    b, k, gs = 3, 320, 64  # 5 groups, padded to 8
    x = (2.0 * torch.randn(b, k, generator=gen)).bfloat16().to(DEV)
    nw = (1.0 + 0.2 * torch.randn(k, generator=gen)).bfloat16().to(DEV)
    p = rows_prep(x, gs, nw, EPS)
    assert tuple(p.op.shape) == (8, gs, 4) and tuple(p.sums.shape) == (8, 4)
    h = rms_norm(x, nw, EPS).float().cpu().view(b, 5, gs)
    op = p.op.float().cpu()
    for r in range(b):
        got = op[:5, :, r]
        torch.testing.assert_close(
            got.sort(dim=1).values, h[r].sort(dim=1).values, rtol=2**-7, atol=2**-8, msg=f"row {r}"
        )
        assert not torch.equal(got, h[r])  # the K order is not memory order
        torch.testing.assert_close(p.sums[:5, r].cpu(), got.sum(dim=1), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(p.sums[:5, r].cpu(), h[r].sum(dim=1), rtol=1e-2, atol=1e-2)
    assert not op[5:].any() and not op[:, :, b:].any() and not p.sums.cpu()[5:].any()


@pytest.fixture
def tiles(monkeypatch):
    """MEASURED_TILES emptied for the test (the table's cache cleared around it)."""
    import lily.ops.qgemv_mma_rows as mod

    monkeypatch.setattr(mod, "MEASURED_TILES", {})
    mma_rows_config.cache_clear()
    yield mod.MEASURED_TILES
    mma_rows_config.cache_clear()


def test_rows_config_table(tiles):
    """The (unmeasured) rule: qgemv_mma's warps, BLOCK_N only grown (up to 64) where the
    grid keeps a program an SM; the model's wide shapes get 64 rows a program at 16 rows of
    x, the narrow o_proj keeps qgemv_mma's tile."""
    shapes = [(12352, 2048), (9216, 2048), (2048, 4096), (248320, 2048), (8192, 2048)]
    for n, k in shapes:
        base = mma_gemv_config(n, k, 64)
        for b in (1, 2, 4, 8, 16):
            cfg = mma_rows_config(n, k, 64, b)
            assert cfg.num_warps == base.num_warps and cfg.maxnreg is None
            assert base.block_n <= cfg.block_n <= 64
            assert cfg.block_n == base.block_n or -(-n // cfg.block_n) >= 132, (n, k, b, cfg)
    assert mma_rows_config(248320, 2048, 64, 16).block_n == 64
    assert mma_rows_config(2048, 4096, 64, 16) == MmaGemvConfig(16, 16)


def test_measured_tiles_come_first(tiles):
    """A MEASURED_TILES entry of a shape serves B from its key up (the largest key <= B),
    the rule below the smallest key and for other shapes and group sizes."""
    rule = {b: mma_rows_config(2048, 4096, 64, b) for b in (1, 2, 5, 16)}
    mma_rows_config.cache_clear()
    tiles[(2048, 4096, 64)] = {2: MmaGemvConfig(16, 8), 9: MmaGemvConfig(32, 8)}
    assert mma_rows_config(2048, 4096, 64, 1) == rule[1]
    assert mma_rows_config(2048, 4096, 64, 2) == mma_rows_config(2048, 4096, 64, 8) == (
        MmaGemvConfig(16, 8))  # fmt: skip
    assert mma_rows_config(2048, 4096, 64, 16) == MmaGemvConfig(32, 8)
    assert mma_rows_config(2048, 4096, 32, 5) != MmaGemvConfig(16, 8)  # another group size
    assert mma_rows_config(8192, 2048, 64, 5) == mma_gemv_config(8192, 2048, 64)


def test_measured_tiles_are_tiles():
    """Every entry in the table as shipped: a tile for 1..MAX_ROWS rows of a 4-bit shape."""
    from lily.ops.qgemv_mma_rows import MEASURED_TILES

    for (n, k, gs), by_rows in MEASURED_TILES.items():
        assert n > 0 and k % gs == 0 and gs in (32, 64, 128)
        assert all(1 <= b <= MAX_ROWS and isinstance(c, MmaGemvConfig) for b, c in by_rows.items())
