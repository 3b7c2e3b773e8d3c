"""The GPU diagnostics' own kernels against plain arithmetic and the reference GEMV (the
Triton interpreter without a GPU): lily/bench/gpu/diagnostics/launch_floor.py's chain link
and grid barrier, lily/bench/gpu/diagnostics/gemv_trace.py's stamped GEMV."""

from __future__ import annotations

import torch

from lily.bench.gpu.diagnostics import gemv_trace as trace
from lily.bench.gpu.diagnostics import launch_floor as floor
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
