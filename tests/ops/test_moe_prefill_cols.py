"""moe_prefill's GEMMs on the column tile (lily/ops/moe_prefill_cols.py: the tile's tokens as
the MMA's columns, qgemv_mma's weight tile, a loop over K), against the fp32 reference MoE
and moe_prefill's own GEMMs, at odd small shapes (one to four groups a K step, masked rows,
tiles past the real count) under the interpreter; on the GPU at the same shapes."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import lily.ops.moe_prefill as mp  # noqa: E402
from lily.ops.moe_prefill import MoePrefillConfig, moe_prefill  # noqa: E402
from lily.ops.moe_prefill_cols import cols_steps  # noqa: E402
from lily.ops.qgemm import GemmConfig  # noqa: E402
from tests.ops.common import rel_err  # noqa: E402
from tests.ops.test_moe_ops import make_moe, moe_err  # noqa: E402

DEVICES = ["cuda"] if torch.cuda.is_available() else ["cpu"]


@pytest.fixture
def cols(monkeypatch):
    """The column tile switched on for tiles of up to 32 rows; the list of its calls."""
    calls: list = []
    real = mp.moe_gemms_cols

    def counted(*a, **k):
        calls.append(a[-1])  # the tile's rows
        return real(*a, **k)

    monkeypatch.setattr(mp, "COLS_MAX_BLOCK_M", 32)
    monkeypatch.setattr(mp, "moe_gemms_cols", counted)
    return calls


def _inputs(t: int, d: int, seed: int, device: str):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, d, generator=g).bfloat16().to(device)
    res = torch.randn(t, d, generator=g).bfloat16().to(device)
    return x, res


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "d,i,gs,shared,block_m,t",
    [
        (192, 64, 64, True, 16, 13),  # 3 groups: one a step; I one group
        (128, 64, 32, True, 16, 11),  # 4 groups a step; I two
        (256, 96, 32, False, 32, 9),  # 8 groups: 2 steps of 4; I three groups, rows masked
    ],
    ids=["d192-g64-shared-m16", "d128-g32-shared-m16", "d256-i96-g32-m32"],
)
def test_cols_gemms_match_the_reference(poison, device, cols, d, i, gs, shared, block_m, t):
    """Through moe_prefill (its routing, plan and combine): the output within bf16 rounding
    of the fp32 reference and at least as close as moe_prefill's own GEMMs (which round
    each weight to bf16 first; the column tile multiplies the exact codes), and the column
    tile was the one that ran."""
    w = make_moe(5, 4, gs, shared, seed=d + i, device=device, d=d, i_e=i, i_s=i)
    x, res = _inputs(t, d, 3, device)
    cfg = MoePrefillConfig(block_m, GemmConfig(block_m, 32, 64), GemmConfig(block_m, 64, 64))
    y = moe_prefill(x, *w.values(), 2, res, config=cfg)
    assert cols == [block_m]
    assert y.shape == (t, d) and y.dtype == torch.bfloat16
    err = moe_err(y, w, x, 2, res)
    mp.COLS_MAX_BLOCK_M = 0
    base = moe_prefill(x, *w.values(), 2, res, config=cfg)
    assert cols == [block_m]  # (the second call took moe_prefill's own GEMMs)
    assert err < 1e-2 and err <= moe_err(base, w, x, 2, res)
    assert rel_err(y.float(), base.float()) < 1e-2


@pytest.mark.parametrize("device", DEVICES)
def test_cols_with_the_next_norm_and_many_tokens_an_expert(poison, device, cols):
    """Skewed routing (most tokens on one expert: several tiles of it, one partly filled),
    and the next layer's norm in the combine: the same output as without the norm."""
    d, i = 128, 64
    w = make_moe(4, 4, 64, True, seed=5, device=device, d=d, i_e=i, i_s=i)
    w["router"].biases[0] += 4.0  # expert 0 first for nearly every token
    x, res = _inputs(37, d, 4, device)
    nw = torch.ones(d, dtype=torch.bfloat16, device=device)
    cfg = MoePrefillConfig(16, GemmConfig(16, 32, 64), GemmConfig(16, 64, 64))
    y, h = moe_prefill(x, *w.values(), 2, res, config=cfg, norm_weight=nw)
    plain = moe_prefill(x, *w.values(), 2, res, config=cfg)
    assert cols == [16, 16]
    assert torch.equal(y, plain)
    assert moe_err(y, w, x, 2, res) < 1e-2
    assert torch.isfinite(h.float()).all()


@pytest.mark.parametrize("device", DEVICES)
def test_what_the_cols_tile_does_not_take_falls_back(poison, device, cols):
    """8-bit experts, fp32 x, a shared expert of another width, the atomic down and tiles
    over the limit take moe_prefill's GEMMs, with the right answer."""
    d = 128
    cfg = MoePrefillConfig(16, GemmConfig(16, 32, 64), GemmConfig(16, 64, 64))
    x, res = _inputs(7, d, 6, device)
    w8 = make_moe(5, 8, 64, True, seed=1, device=device, d=d, i_e=64, i_s=64)
    assert moe_err(moe_prefill(x, *w8.values(), 2, res, config=cfg), w8, x, 2, res) < 1e-2
    w = make_moe(5, 4, 64, True, seed=2, device=device, d=d, i_e=64, i_s=128)
    assert moe_err(moe_prefill(x, *w.values(), 2, res, config=cfg), w, x, 2, res) < 1e-2
    w = make_moe(5, 4, 64, True, seed=3, device=device, d=d, i_e=64, i_s=64)
    y = moe_prefill(x.float(), *w.values(), 2, res.float(), config=cfg)
    assert moe_err(y, w, x.float(), 2, res.float()) < 1e-2
    moe_prefill(x, *w.values(), 2, res, config=cfg, atomic=True)
    wide = MoePrefillConfig(128, GemmConfig(128, 32, 64), GemmConfig(128, 64, 64))
    moe_prefill(x, *w.values(), 2, res, config=wide)
    assert cols == []


def test_cols_steps_split_k_in_whole_groups():
    assert cols_steps(32) == (4, 8)  # the full model's D = 2,048 in groups of 64
    assert cols_steps(8) == (4, 2)  # its I = 512
    assert cols_steps(6) == (2, 3)
    assert cols_steps(3) == (1, 3)
    assert cols_steps(1) == (1, 1)
