"""The rows sampler (a batched step's device draws) against each row's own DeviceSampler
(itself tested against independent references in test_device_sampling.py): rows asking
for different ops drawn together in one union of ops, over several steps, give the draws
their own samplers give on the same logits."""

from __future__ import annotations

import math

import torch

from lily.runtime.device_sampling import DeviceSampler
from lily.runtime.rows_sampling import RowsSampler
from lily.runtime.sampling import SamplingParams

V = 300
PROMPT = [3, 7, 7, 150, 299]
ROWS = [
    SamplingParams(temperature=0.0, repetition_penalty=1.4, seed=1),  # greedy, penalties
    SamplingParams(temperature=0.8, top_k=12, seed=2),
    SamplingParams(temperature=1.3, top_p=0.7, seed=3),
    SamplingParams(temperature=0.9, min_p=0.05, frequency_penalty=0.7, seed=4),
    SamplingParams(temperature=1.0, top_k=40, top_p=0.9, presence_penalty=1.0, seed=5),
    SamplingParams(temperature=0.0, seed=6),  # plain greedy
]


def test_rows_draw_as_their_own_samplers_do():
    g = torch.Generator().manual_seed(0)
    rs = RowsSampler(8, V, "cpu")
    own = []
    earlier = [[5, 6], [], [9], [], [1, 2, 3], []]  # drawn before (elsewhere)
    for r, (p, gen) in enumerate(zip(ROWS, earlier, strict=True)):
        rs.load(r, ("req", r, len(gen)), p, PROMPT, gen)
        s = DeviceSampler(V, "cpu")
        s.load(p, PROMPT, gen)
        own.append(s)
    n = len(ROWS)
    seen = []
    for _ in range(6):
        logits = torch.randn(n, V, generator=g) * 3
        logits[:, 7] += 4.0  # a prompt token on top: the penalties matter
        out = torch.full((n,), 12345, dtype=torch.long)
        with torch.inference_mode():
            rs.sample_into(logits, out, rs.structure(n))
        want = torch.zeros(1, dtype=torch.long)
        for r in range(n):
            with torch.inference_mode():
                own[r].sample_into(logits[r], want)
            assert int(out[r]) == int(want), r
        seen.append(out.tolist())
    assert len({tuple(x) for x in zip(*seen, strict=True)}) > 2  # rows really differ


def test_a_row_with_nothing_finite_draws_minus_one_alone():
    rs = RowsSampler(4, V, "cpu")
    for r in range(2):
        rs.load(r, r, SamplingParams(temperature=0.7, seed=r), PROMPT, ())
    logits = torch.randn(2, V)
    logits[1] = -math.inf
    out = torch.zeros(2, dtype=torch.long)
    with torch.inference_mode():
        rs.sample_into(logits, out, rs.structure(2))
    assert int(out[0]) >= 0 and int(out[1]) == -1


def test_loading_the_same_owner_again_changes_nothing():
    rs = RowsSampler(2, V, "cpu")
    p = SamplingParams(temperature=0.7, repetition_penalty=1.2, seed=9)
    rs.load(0, ("a", 0), p, PROMPT, ())
    out = torch.zeros(1, dtype=torch.long)
    with torch.inference_mode():
        rs.sample_into(torch.randn(1, V), out, rs.structure(1))
    rs.drawn(0, ("a", 1))
    step = int(rs.step[0])
    rs.load(0, ("a", 1), p, PROMPT, [int(out[0])])  # the same request, one draw on
    assert int(rs.step[0]) == step == 1
