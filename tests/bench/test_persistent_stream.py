"""The persistent-step protocol benchmark (lily/bench/gpu/persistent_stream.py).

CPU: the tables the kernel reads, walked block by block as the kernel walks them, give the
final value the host's closed form (``expected_final``) predicts. GPU (skips without CUDA:
a persistent kernel whose blocks wait on each other cannot run under an interpreter that
runs programs one after another): the kernel's values over several steps, every mode.
"""

from __future__ import annotations

import pytest
import torch

from lily.bench.gpu import persistent_stream as ps
from lily.ops.step_plan import Phase

M32 = 1 << 32


def phases() -> list[Phase]:
    # A zero-byte phase, a "router", two routed phases (one with fixed bytes too), a tail.
    return [
        Phase("in", 0, "a", 4096 + 48, -1),
        Phase("link", 0, "b", 0, 0),
        Phase("router", 0, "router", 1024 * 16, 1),
        Phase("gu", 0, "experts", 0, 2, routed_bytes=3 * 160, slots=3, fetch_after=2),
        Phase("down", 0, "experts", 32, 3, routed_bytes=3 * 160, slots=3, fetch_after=2),
        Phase("head", -1, "head", 2000 * 16, 4),
    ]


def walk_tables(st: ps.Stream, epoch: int) -> int:
    """What the kernel computes, from its tables: block by block, chunk by chunk."""
    t = {k: v.cpu().tolist() for k, v in st.tables.items()}
    words = st.arena.cpu().view(torch.int32).to(torch.int64) % M32
    a: list[int] = []
    for p in range(len(st.phases)):
        inp = a[t["after"][p]] if t["after"][p] >= 0 else epoch
        route = a[t["fetch"][p]] if t["fetch"][p] >= 0 else 0
        total = 0
        for b in range(st.blocks):
            s = 0
            for i in range(t["first"][b][p], t["first"][b][p + 1]):
                lo, hi, n, slot = t["chunks"][i]
                off = (hi << 32) | (lo % M32)
                if slot < 0:
                    base = t["fixed_base"][p] + off
                else:
                    e = (route + 37 * slot) % M32 % st.n_experts
                    base = t["routed_base"][p] + e * t["routed_stride"][p] + off
                assert base % 16 == 0 and n % 16 == 0 and base + n <= st.arena.numel()
                s += int(words[base // 4 : (base + n) // 4].sum())
            total += (s + inp) % M32
        a.append(total % M32)
    return a[-1]


@pytest.mark.parametrize("blocks,chunk", [(1, 64), (5, 64), (3, 1024)])
def test_tables_walked_as_the_kernel_walks_them_give_the_host_value(blocks, chunk):
    st = ps.build(phases(), blocks, chunk, n_experts=7, device="cpu", seed=blocks)
    for epoch in (1, 2, 5):
        assert walk_tables(st, epoch) == ps.expected_final(st, epoch)
    # the value depends on the routed bytes: another arena gives another value
    other = ps.build(phases(), blocks, chunk, n_experts=7, device="cpu", seed=99)
    assert ps.expected_final(other, 1) != ps.expected_final(st, 1)


def test_chunks_do_not_span_an_expert():
    st = ps.build(phases(), 4, 64, n_experts=7, device="cpu")
    for lo, _, n, slot in st.tables["chunks"].tolist():
        if slot >= 0:
            assert lo + n <= 160


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
@pytest.mark.parametrize("mode", [1, 2])
@pytest.mark.parametrize("mma", [False, True])
def test_kernel_matches_the_host_every_step(mode, mma):
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    blocks = min(8, sms)
    st = ps.build(phases(), blocks, 64, n_experts=7)
    r = ps.runner(st, mode, stages=3, warps=8, mma=mma)
    for _ in range(4):
        r.launch()
    torch.cuda.synchronize()
    assert not r.aborted
    assert r.results() == [ps.expected_final(st, e) for e in range(1, 5)]


@cuda
def test_kernel_on_the_full_sm_count_with_a_deep_ring():
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    st = ps.build(phases(), sms, 16384, n_experts=7)
    r = ps.runner(st, 1, stages=12, warps=4)
    for _ in range(3):
        r.launch()
    torch.cuda.synchronize()
    assert not r.aborted
    assert r.results() == [ps.expected_final(st, e) for e in range(1, 4)]
