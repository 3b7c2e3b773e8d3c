"""qgemv / qgemm against the plain-PyTorch reference (dequantize in fp32, matmul in fp32).

On a machine without CUDA the kernels run under the Triton interpreter (TRITON_INTERPRET=1,
set before lily.ops is imported); with CUDA they run on the GPU. Shapes are small and odd
(N=96, K=192, T=13) so the interpreter stays fast. Bounds: bf16 outputs 1e-2 relative L2
(bf16 rounding of weights, x and output is ~2e-3); fp32 outputs 2e-5 for the GEMV (fp32
arithmetic throughout, ~2e-6 seen) and 1e-2 for the GEMM (bf16 weights on tensor cores).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Kernels are built at import; tests/conftest.py normally sets this first.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from lily.model.norm import rms_norm  # noqa: E402
from lily.model.ref import ref_qlinear  # noqa: E402
from lily.ops.qgemm import GemmConfig, gemm_config, qgemm  # noqa: E402
from lily.ops.qgemv import GemvConfig, gemv_config, qgemv  # noqa: E402
from lily.quant import QuantWeight, quantize  # noqa: E402
from tests.ops.common import rel_err, replayed  # noqa: E402

DEVICES = ["cuda"] if torch.cuda.is_available() else ["cpu"]


def _weight(n: int, k: int, bits: int, gs: int, device: str, gen: torch.Generator) -> QuantWeight:
    return quantize(torch.randn(n, k, generator=gen) / k**0.5, bits, gs).to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "bits,gs,rows",
    [(4, 64, 0), (4, 32, 0), (8, 64, 0), (8, 32, 0), (4, 64, 3), (8, 32, 2)],
    ids=["4b-g64", "4b-g32", "8b-g64", "8b-g32", "4b-g64-rows3", "8b-g32-rows2"],
)
def test_qgemv_matches_reference(poison, device, bits, gs, rows):
    gen = torch.Generator().manual_seed(100 * bits + gs + rows)
    w = _weight(96, 192, bits, gs, device, gen)
    shape = (192,) if rows == 0 else (rows, 192)
    x = torch.randn(shape, generator=gen).bfloat16().to(device)
    res = torch.randn((96,) if rows == 0 else (rows, 96), generator=gen).bfloat16().to(device)
    y = qgemv(x, w, residual=res)
    assert y.shape == res.shape and y.dtype == torch.bfloat16
    assert rel_err(y, ref_qlinear(x, w, res)) < 1e-2
    y32 = qgemv(x, w, out_dtype=torch.float32)
    assert y32.dtype == torch.float32
    assert rel_err(y32, ref_qlinear(x, w)) < 2e-5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "cfg",
    [GemvConfig(8, 2, 3, 4), GemvConfig(16, 4, 2, 2), GemvConfig(32, 4, 1, 4)],
    ids=["split3", "split2", "nosplit"],
)
def test_qgemv_tiles_and_split_k(poison, device, cfg):
    """Split-K (fp32 partials summed by the last program) and tiles that do not divide N
    or K (10 groups: uneven splits and masked steps)."""
    gen = torch.Generator().manual_seed(7)
    w = _weight(40, 320, 4, 32, device, gen)
    x = torch.randn(2, 320, generator=gen).to(device)  # fp32 input, fp32 output
    res = torch.randn(2, 40, generator=gen).to(device)
    y = qgemv(x, w, residual=res, config=cfg)
    assert rel_err(y, ref_qlinear(x, w, res)) < 2e-5


@pytest.mark.parametrize("device", DEVICES)
def test_qgemv_split_k_replays(device):
    """Split-K tickets must be clean on every call: a CUDA graph replayed on new inputs on
    the GPU (as the decode step runs), repeated eager calls on the CPU. The graph chains two
    GEMVs with programmatic dependent launch: the second (split-K, norm prologue) reads the
    first's output, so a read before the wait for the first kernel would show."""
    gen = torch.Generator().manual_seed(8)
    w1 = _weight(256, 256, 4, 64, device, gen)
    w = _weight(24, 256, 4, 64, device, gen)
    nw = (1.0 + 0.2 * torch.randn(256, generator=gen)).bfloat16().to(device)
    xs = [torch.randn(256, generator=gen).bfloat16().to(device) for _ in range(3)]
    cfg = GemvConfig(8, 1, 4, 4)
    x = xs[0].clone()

    def chain():
        h = qgemv(x, w1, pdl=True)
        return qgemv(h, w, norm_weight=nw, config=cfg, out_dtype=torch.float32, pdl=True)

    for xi, y in replayed(chain, x, xs):
        h = ref_qlinear(xi, w1).bfloat16()
        # bf16 h: a last-ulp rounding difference may pass through the norm (1e-3); a stale h
        # would be off by O(1).
        assert rel_err(y, ref_qlinear(rms_norm(h, nw, 1e-6), w)) < 1e-3


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "rows,dtype,cfg",
    [
        (0, torch.bfloat16, None),
        (0, torch.bfloat16, GemvConfig(8, 16, 1, 4)),
        (0, torch.float32, GemvConfig(8, 2, 3, 4)),
        (0, torch.bfloat16, GemvConfig(16, 2, 1, 2)),
        (3, torch.bfloat16, None),
        (2, torch.float32, GemvConfig(8, 4, 2, 4)),
    ],
    ids=[
        "bf16-table",
        "bf16-whole-row",
        "fp32-split3",
        "bf16-k-loop",
        "bf16-rows3",
        "fp32-rows2-split2",
    ],  # fmt: skip
)
def test_qgemv_norm_prologue(poison, device, rows, dtype, cfg):
    """``norm_weight``: the GEMV of rmsnorm(x) * w_norm (the model's norm, unfused, as the
    reference): statistics from the loaded row (one step covers K), from a separate pass
    (split-K: every program computes them; a K loop of 5 steps), several rows, a residual."""
    gen = torch.Generator().manual_seed(40 + rows)
    w = _weight(40, 320, 4, 32, device, gen)
    shape = (320,) if rows == 0 else (rows, 320)
    x = (3.0 * torch.randn(shape, generator=gen) + 0.5).to(device, dtype)
    nw = (1.0 + 0.2 * torch.randn(320, generator=gen)).to(device, torch.bfloat16)
    res = torch.randn((40,) if rows == 0 else (rows, 40), generator=gen).to(device, dtype)
    eps = 1e-5
    h = rms_norm(x, nw, eps)
    y = qgemv(x, w, norm_weight=nw, eps=eps, residual=res, out_dtype=torch.float32, config=cfg)
    # fp32 all through: only summation order differs (bf16 x: the normed x is rounded to
    # bf16 as rms_norm rounds it; a last-ulp difference of rstd may flip one rounding).
    assert rel_err(y, ref_qlinear(h, w, res)) < (2e-5 if dtype == torch.float32 else 5e-4)
    y_plain = qgemv(x, w, residual=res, out_dtype=torch.float32, config=cfg)
    assert rel_err(y_plain, ref_qlinear(h, w, res)) > 1e-2, "the norm must change the result"
    assert qgemv(x, w, norm_weight=nw, config=cfg).dtype == dtype


def test_gemv_config_shapes():
    """The tile table gives valid tiles and enough programs for the model's shapes (the
    fused decode projections included: DeltaNet qkv|z|b|a, attention q|k|v)."""
    for n, k in [(8192, 2048), (4096, 2048), (32, 2048), (2048, 4096), (512, 2048),
                 (248320, 2048), (256, 2048), (96, 192), (12352, 2048), (9216, 2048)]:  # fmt: skip
        cfg = gemv_config(n, k, 1, 4, 64)
        programs = -(-n // cfg.block_n) * cfg.split_k
        assert programs >= min(256, n // 8), (n, k, cfg)
        words = cfg.block_n * cfg.block_g * 8
        assert words <= 4096, (n, k, cfg)  # 32 words a thread at most
        # No split-K (a ticket round trip) where rows alone give >= 384 programs.
        assert cfg.split_k == 1 or n < 1536, (n, k, cfg)


@pytest.mark.parametrize("t", range(1, 9))
def test_gemv_config_every_row_count(t):
    """Every row count the GEMV takes (1-8: decode, and prefill chunks of a few tokens)
    gets a valid tile at the model's K (T = 3 gave 10 groups a step, not a power of two: a
    3-token chunk of the full model failed)."""
    for n, k in [(12352, 2048), (9216, 2048), (2048, 4096), (2048, 512), (248320, 2048)]:
        for bits, gs in [(4, 64), (4, 32), (8, 64)]:
            cfg = gemv_config(n, k, t, bits, gs)
            assert cfg.block_g & (cfg.block_g - 1) == 0, (n, k, t, cfg)
            # Several rows (a batched decode step's head too) take the few-row tile: at
            # most 2,048 codes a row per step over 8 weight rows (the one-row lm_head
            # tile, 64 rows x 8 groups, spilled 464-1,376 B a thread: compile matrix).
            if t > 1:
                assert cfg.block_n * cfg.block_g * gs * t <= 8 * 2048, (n, k, t, cfg)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows", [3, 5, 6])
def test_qgemv_few_rows_at_model_k(poison, device, rows):
    """A few rows at the model's K (32 groups of 64): the table's tile for T = 3, 5, 6."""
    gen = torch.Generator().manual_seed(rows)
    w = _weight(24, 2048, 4, 64, device, gen)
    x = torch.randn(rows, 2048, generator=gen).bfloat16().to(device)
    y = qgemv(x, w, out_dtype=torch.float32)
    assert rel_err(y, ref_qlinear(x, w)) < 1e-3


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits,gs", [(4, 64), (4, 32), (8, 64)], ids=lambda v: str(v))
@pytest.mark.parametrize(
    "cfg",
    [None, GemmConfig(16, 32, 64), GemmConfig(32, 64, 128, 4, 2)],
    ids=["table", "m16n32k64", "m32n64k128"],
)
def test_qgemm_matches_reference(poison, device, bits, gs, cfg):
    gen = torch.Generator().manual_seed(bits * gs)
    w = _weight(96, 192, bits, gs, device, gen)
    x = torch.randn(13, 192, generator=gen).bfloat16().to(device)
    y = qgemm(x, w, config=cfg)
    assert y.shape == (13, 96) and y.dtype == torch.bfloat16
    assert rel_err(y, ref_qlinear(x, w)) < 1e-2


@pytest.mark.parametrize("device", DEVICES)
def test_group_128(poison, device):
    """Group size 128 (16 words a group) through both kernels."""
    gen = torch.Generator().manual_seed(12)
    w = _weight(48, 256, 4, 128, device, gen)
    x = torch.randn(5, 256, generator=gen).bfloat16().to(device)
    assert rel_err(qgemv(x[0], w, out_dtype=torch.float32), ref_qlinear(x[0], w)) < 2e-5
    assert rel_err(qgemm(x, w), ref_qlinear(x, w)) < 1e-2


@pytest.mark.parametrize("device", DEVICES)
def test_qgemm_precise_and_fp32_out(poison, device):
    """``precise`` feeds the weight as two bf16 terms: only x's rounding is left."""
    gen = torch.Generator().manual_seed(3)
    w = _weight(40, 256, 8, 64, device, gen)
    x = torch.randn(21, 256, generator=gen).bfloat16().to(device)
    ref = ref_qlinear(x, w)
    plain = rel_err(qgemm(x, w, out_dtype=torch.float32), ref)
    precise = rel_err(qgemm(x, w, out_dtype=torch.float32, precise=True), ref)
    assert precise < 1e-4 < plain < 1e-2


@pytest.mark.parametrize("device", DEVICES)
def test_qgemm_empty_and_table(device):
    gen = torch.Generator().manual_seed(4)
    w = _weight(32, 64, 4, 64, device, gen)
    assert qgemm(torch.zeros(0, 64, device=device), w).shape == (0, 32)
    for t in (1, 16, 40, 100, 2048):
        cfg = gemm_config(t, 8192, 2048, 64)
        assert cfg.block_k % 64 == 0 and cfg.block_m >= 16


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a compiled-pipeline race: GPU only")
def test_qgemm_table_tiles_repeat_exactly():
    """The table's tiles at the prefill chunk's largest shapes give the same bits on every
    run. With three pipeline stages the 128 x 128 (8 warps) tile returned garbage in about
    1 run of 300 here on the H200 (lily/bench/gpu/kernels/repeat.py); 2,000 runs would catch
    that rate all but surely."""
    gen = torch.Generator().manual_seed(6)
    w = _weight(8192, 2048, 4, 64, "cuda", gen)
    x = torch.randn(4096, 2048, generator=gen).bfloat16().cuda()
    ref = qgemm(x, w)
    assert rel_err(ref[:64], ref_qlinear(x[:64], w)) < 1e-2
    bad = sum(not torch.equal(qgemm(x, w), ref) for _ in range(2000))
    assert bad == 0


def test_bad_inputs_give_clear_errors():
    gen = torch.Generator().manual_seed(5)
    w = _weight(32, 64, 4, 32, "cpu", gen)
    with pytest.raises(ValueError, match="inputs"):
        qgemv(torch.randn(65).bfloat16(), w)
    with pytest.raises(ValueError, match="rows"):
        qgemv(torch.randn(9, 64).bfloat16(), w)
    with pytest.raises(TypeError, match="dtype"):
        qgemv(torch.randn(64).to(torch.float64), w)
    with pytest.raises(ValueError, match="residual"):
        qgemv(torch.randn(64).bfloat16(), w, residual=torch.zeros(31))
    with pytest.raises(TypeError, match="QuantWeight"):
        qgemm(torch.randn(4, 64), torch.randn(32, 64))
    bad = QuantWeight(w.qweight, w.scales[:, :1], w.biases, 4, 32)
    with pytest.raises(ValueError, match="scales shape"):
        qgemm(torch.randn(4, 64), bad)
    with pytest.raises(ValueError, match="3-bit"):
        qgemv(torch.randn(64), QuantWeight(w.qweight, w.scales, w.biases, 3, 32))
    with pytest.raises(ValueError, match="norm_weight"):
        qgemv(torch.randn(64).bfloat16(), w, norm_weight=torch.ones(63))
    with pytest.raises(TypeError, match="norm_weight"):
        qgemv(torch.randn(64).bfloat16(), w, norm_weight=torch.ones(64, dtype=torch.int32))
    with pytest.raises(ValueError, match="power of two"):
        GemvConfig(12, 1)
    with pytest.raises(ValueError, match=">= 16"):
        GemmConfig(8, 64, 64)
