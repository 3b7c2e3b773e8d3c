"""The GPU diagnostics' own kernels against plain arithmetic and the reference GEMV (the
Triton interpreter without a GPU): lily/bench/gpu/diagnostics/launch_floor.py's chain link
and grid barrier, lily/bench/gpu/diagnostics/gemv_trace.py's stamped GEMV and
moe_trace.py's stamped MoE launches."""

from __future__ import annotations

import pytest
import torch

from lily.bench.gpu.diagnostics import gemv_trace as trace
from lily.bench.gpu.diagnostics import launch_floor as floor
from lily.bench.gpu.diagnostics import moe_trace
from lily.model.ref import ref_qlinear
from lily.quant import quantize
from tests.ops.common import rel_err

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_link_writes_half_the_sum_plus_its_program_id():
    x = torch.randn(floor.BLOCK, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    out = torch.full((5,), float("nan"), device=DEVICE)
    floor._link_kernel[(5,)](x, out, PDL=False, EARLY=False, BLOCK=floor.BLOCK)
    want = float(x.double().sum()) * 0.5 + torch.arange(5, dtype=torch.float64)
    torch.testing.assert_close(out.cpu().double(), want, rtol=1e-5, atol=1e-4)


def test_flag_link_waits_for_its_count_and_counts_itself():
    x = torch.randn(floor.BLOCK, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    out = torch.full((3,), float("nan"), device=DEVICE)
    counts = torch.tensor([3, 0], dtype=torch.int32, device=DEVICE)  # the previous: done
    floor._flag_link_kernel[(3,)](x, out, counts[0], counts[1], 3, FIRST=False,
                                  BLOCK=floor.BLOCK, ON_CPU=DEVICE == "cpu")  # fmt: skip
    want = float(x.double().sum()) * 0.5 + torch.arange(3, dtype=torch.float64)
    torch.testing.assert_close(out.cpu().double(), want, rtol=1e-5, atol=1e-4)
    assert counts.tolist() == [3, 3]


def test_barrier_rounds_in_one_program():
    # One program: every round reads the half the last round wrote and passes its own
    # barrier at once; the count must end at the number of rounds.
    b = floor.BLOCK
    buf = torch.randn(2 * b, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    want = buf.double().cpu().clone()
    for r in range(3):
        want[((r + 1) % 2) * b] = float(want[(r % 2) * b : (r % 2 + 1) * b].sum()) * 0.5
    for poll in (False, True):
        got = buf.clone()
        count = torch.zeros(1, dtype=torch.int32, device=DEVICE)
        floor._barrier_kernel[(1,)](count, got, ROUNDS=3, BLOCK=b, POLL_LOAD=poll)
        assert int(count.item()) == 3
        torch.testing.assert_close(got.cpu().double(), want, rtol=1e-5, atol=1e-4)


def test_traced_gemv_matches_the_reference_and_fills_its_trace():
    # odd N (a partial row block), K of 3 groups padded to 4; with the norm and a residual
    g = torch.Generator().manual_seed(1)
    w = quantize(torch.randn(70, 192, generator=g) / 8, 4, 64).to(DEVICE)
    x = torch.randn(192, generator=g).bfloat16().to(DEVICE)
    res = torch.randn(70, generator=g).bfloat16().to(DEVICE)
    nw = (1.0 + 0.2 * torch.randn(192, generator=g)).bfloat16().to(DEVICE)
    t = torch.full((trace.programs(70, 192), trace.STAMPS + 1), -1, dtype=torch.int64,
                   device=DEVICE)  # fmt: skip
    y = trace.traced_gemv(x, w, t, norm_weight=nw, residual=res, fine=True)
    y_first = trace.traced_gemv(x, w, t.clone(), norm_weight=nw, residual=res, x_first=True)
    assert torch.equal(y, y_first), "where x is loaded must not change the result"
    h = torch.nn.functional.rms_norm(x.float(), (192,), nw.float(), 1e-6).bfloat16()
    assert rel_err(y, ref_qlinear(h, w, res)) < 5e-3
    assert (t >= 0).all(), "every program writes its row"
    if DEVICE == "cuda":  # stamps in order within each program
        assert (t[:, :7].diff(dim=1) >= 0).all()


def test_traced_moe_equals_the_engine_launches_and_fills_its_traces():
    """moe_trace's gate/up and down (route_once, down_operand, down_early) against
    moe_decode_mma's own launches on the same router outputs, bit for bit; every program
    writes its trace row. Odd shapes: 9 experts, top 3, D 192 (3 groups padded to 4), I 96
    (3 blocks of 32: a down K of 9 groups padded to 16), the shared expert's I 64, 3 rows."""
    from lily.ops.moe_decode_config import MoeDecodeConfig
    from lily.ops.moe_decode_mma import moe_mma_experts
    from tests.ops.test_moe_ops import make_moe

    w = {**make_moe(9, 4, 32, True, seed=5, device=DEVICE, d=192, i_e=96, i_s=64), "top_k": 3}
    cfg = MoeDecodeConfig(router_rows=2, mma_rows=32, route_once=True, down_operand=True,
                          down_early=True)  # fmt: skip
    b = 3
    ins = moe_trace.layer_inputs(w, b, torch.Generator().manual_seed(2), DEVICE)
    (gu, _), (dn, _) = moe_trace.grids(w, b, cfg)
    t_gu = torch.full((gu * b, moe_trace.STAMPS + 1), -1, dtype=torch.int64, device=DEVICE)
    t_dn = torch.full((dn * b, moe_trace.STAMPS + 1), -1, dtype=torch.int64, device=DEVICE)
    for fine in (False, True):
        y = moe_trace.traced_moe(w, ins, cfg, t_gu, t_dn, fine=fine)
        want = torch.empty_like(y)
        x = ins["res"]
        moe_mma_experts(x, x, ins["logits"], ins["ids"], ins["wts"], ins["h"], x, want,
                        w["gate"], w["up"], w["down"], w["shared_down"], 9, 192, 96, 64, 3,
                        1e-6, cfg, False, True, True, DEVICE == "cpu", False,
                        (ins["op"], ins["sums"]))  # fmt: skip
        assert torch.equal(y, want), fine
        assert y.abs().sum() > 0
    for t in (t_gu, t_dn):
        assert (t >= 0).all(), "every program writes its row"
        if DEVICE == "cuda":  # stamps in order within each program (all five with fine)
            assert (t[:, :5].diff(dim=1) >= 0).all()
    # a different routing gives a different output: the traced launches read the ids
    other = {**ins, "ids": ins["ids"].roll(1, dims=1).flip(0).contiguous()}
    assert not torch.equal(moe_trace.traced_moe(w, other, cfg, t_gu, t_dn), y)


def test_moe_trace_analysis_on_known_stamps():
    """analyse and resident on hand-made stamps (ns): programs overlapping on one SM are
    counted at once, one after another are not; the exposed time runs from the launch
    before's last store."""

    def rows(*progs):  # (entry, wait, landed, dot, store, sm)
        return torch.tensor(progs, dtype=torch.int64)

    prev = rows((0, 0, 0, 0, 5000, 0))
    # SM 0: two programs at once, then a third after both; SM 1: one
    cur = rows((1000, 2000, 3000, 4000, 7000, 0), (1500, 2000, 3500, 4500, 8000, 0),
               (8000, 8500, 9000, 9500, 10000, 0), (1000, 3000, 4000, 6000, 9000, 1))  # fmt: skip
    assert moe_trace.resident(cur) == 1.5  # SM 0: 2, SM 1: 1
    got = moe_trace.analyse([prev], [cur], fine=True)
    assert got["span"] == 9.0 and got["exposed"] == 5.0 and got["sms"] == 2.0
    # medians (torch's: the lower middle) of 6.0, 6.5, 2.0, 8.0; 1.0, 0.5, 0.5, 2.0; ...
    assert got["program"] == 6.0 and got["entry_to_wait"] == 0.5 and got["past_wait"] == 5.0
    assert got["loading"] == 1.0 and got["multiplying"] == 1.0
    assert "loading" not in moe_trace.analyse([prev], [cur], fine=False)


def test_moe_trace_names_the_batch_sizes_it_traces(monkeypatch):
    from lily.model.ops import MOE_ROWS_CONFIGS

    two = MOE_ROWS_CONFIGS[2]
    assert not two.down_early  # the 2-row entry is another form
    monkeypatch.setattr("sys.argv", ["moe_trace", "--rows", "8,2"])
    with pytest.raises(SystemExit, match=r"--rows 2: .* has it at \[4, 8\]"):
        moe_trace.main()
