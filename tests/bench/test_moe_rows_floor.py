"""The batched MoE benchmark's floor (lily/bench/gpu/kernels/moe_rows.py): the distinct
experts B rows choose under uniform random routing against a simulation, and the bytes a
layer must read against MODEL.md's per-weight costs (4-bit group 64: 0.5625 B a weight,
8-bit routers 1.0625)."""

from __future__ import annotations

import pytest
import torch

from lily.bench.gpu.kernels.moe_rows import expected_distinct, layer_bytes


@pytest.mark.parametrize("b", [1, 2, 4, 8, 16])
def test_expected_distinct_experts_match_a_simulation(b):
    g = torch.Generator().manual_seed(b)
    trials = 4000
    picks = torch.rand(trials, b, 256, generator=g).topk(8, dim=-1).indices  # k-subsets
    seen = torch.zeros(trials, 256, dtype=torch.bool)
    seen.scatter_(1, picks.reshape(trials, -1), True)
    sim = seen.sum(1).double().mean().item()
    assert abs(expected_distinct(b) - sim) < 0.3, (b, sim)


def test_layer_bytes_at_the_model_shapes():
    d, i, e = 2048, 512, 256
    expert = 3 * i * d * 0.5625
    fixed = e * d * 1.0625 + 3 * i * d * 0.5625 + d * 1.0625  # router, shared, its gate
    assert (expert, fixed) == (1_769_472, 2_328_704)
    assert round(expected_distinct(8), 1) == 57.4 and round(expected_distinct(16), 1) == 102.0
    # B = 8: about 104 MB a layer, 24.7 us at the H200's 4.2 TB/s copy rate
    nbytes = layer_bytes(8, expected_distinct(8), int(fixed), int(expert))
    assert 103.9e6 < nbytes < 104.0e6
