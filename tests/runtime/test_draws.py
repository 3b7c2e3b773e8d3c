"""The one random stream (lily/runtime/draws.py): the hash against a pure-Python splitmix64,
the Gumbel perturbation against plain maths, and every sampler drawing the same tokens
from it: a seeded host ``Sampler`` (log-probs and logits processors draw there), the
``DeviceSampler`` and a row of the ``RowsSampler`` give the same ids from the same logits,
draw after draw, whatever the sampling parameters."""

from __future__ import annotations

import math
import random

import pytest
import torch

from lily.runtime.device_sampling import DeviceSampler
from lily.runtime.draws import mix64, perturbed, to_unit, token_lanes, uniforms
from lily.runtime.rows_sampling import RowsSampler
from lily.runtime.sampling import Sampler, SamplingParams

M64 = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15


def splitmix_ref(z: int) -> int:
    """splitmix64's finalizer on Python ints (unsigned 64-bit)."""
    z &= M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def signed(u: int) -> int:
    return u - (1 << 64) if u >= 1 << 63 else u


def uniform_ref(seed: int, step: int, i: int) -> float:
    """Token ``i``'s uniform of draw ``step`` (see draws.uniforms), in Python ints."""
    base = splitmix_ref(seed + (step + 1) * GAMMA)
    return ((splitmix_ref(base + (i + 1) * GAMMA) >> 12) + 0.5) / 2**52


# ---- the hash
def test_mix64_is_splitmix64_bit_for_bit() -> None:
    rng = random.Random(0)
    xs = [0, 1, M64, 1 << 63, (1 << 63) - 1] + [rng.getrandbits(64) for _ in range(200)]
    got = mix64(torch.tensor([signed(x) for x in xs], dtype=torch.long)).tolist()
    assert got == [signed(splitmix_ref(x)) for x in xs]


def test_uniforms_match_the_reference_and_stay_inside_0_1() -> None:
    lanes = token_lanes(64, "cpu")
    assert lanes.tolist() == [signed((i * GAMMA) & M64) for i in range(1, 65)]
    for seed, step in [(0, 0), (7, 3), (signed(M64), 1000), (-(2**63), 5)]:
        u = uniforms(torch.tensor([seed]), torch.tensor([step]), lanes).tolist()
        assert u == [uniform_ref(seed, step, i) for i in range(64)]
    # One row per (seed, step) pair: (B, 1) columns give (B, V).
    u = uniforms(torch.tensor([[7], [9]]), torch.tensor([[3], [0]]), lanes)
    assert u.tolist() == [[uniform_ref(s, t, i) for i in range(64)] for s, t in [(7, 3), (9, 0)]]
    # The extreme bit patterns land strictly inside (0, 1).
    lo, hi = to_unit(torch.tensor([0, -1])).tolist()
    assert 0.0 < lo < 1e-15 and 1.0 - 1e-15 < hi < 1.0
    v = uniforms(torch.tensor([3]), torch.tensor([0]), token_lanes(200_000, "cpu"))
    assert 0.0 < float(v.min()) and float(v.max()) < 1.0
    hist = torch.histc(v, bins=10, min=0.0, max=1.0) / v.numel()
    assert float((hist - 0.1).abs().max()) < 0.005  # ~7 standard deviations of a bin


def test_perturbed_adds_the_gumbel_of_each_tokens_uniform() -> None:
    x = torch.randn(50, generator=torch.Generator().manual_seed(1))
    x[4] = -math.inf  # an excluded token stays excluded
    got = perturbed(x, torch.tensor([11]), torch.tensor([2]), token_lanes(50, "cpu"))
    assert got.dtype == torch.float32
    want = [xi - math.log(-math.log(uniform_ref(11, 2, i))) for i, xi in enumerate(x.tolist())]
    assert got[4] == -math.inf
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float32))


# ---- every sampler, one stream
V = 997
PROMPT = [3, 7, 7, 150, 640, 996]
CASES = {
    "greedy": SamplingParams(temperature=0.0, seed=1),
    "temperature": SamplingParams(temperature=0.8, seed=2),
    "top_k": SamplingParams(temperature=1.1, top_k=17, seed=3),
    "top_p": SamplingParams(temperature=0.9, top_p=0.8, seed=4),
    "min_p": SamplingParams(temperature=1.2, min_p=0.05, seed=5),
    "penalties": SamplingParams(temperature=0.7, repetition_penalty=1.3,
                                frequency_penalty=0.4, presence_penalty=0.3, seed=6),
    "all": SamplingParams(temperature=0.9, top_k=40, top_p=0.95, min_p=0.02,
                          repetition_penalty=1.2, frequency_penalty=0.5, seed=2**64 - 1),
}  # fmt: skip
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (run on the H200)"))]  # fmt: skip


def step_logits(gen: torch.Generator, rows: int = 1) -> torch.Tensor:
    """Logits near a flat draw (many tokens can win), prompt tokens on top (the penalties
    matter)."""
    x = torch.randn(rows, V, generator=gen) * 1.5
    x[:, [7, 150]] += 3.0
    return x


def host(params: SamplingParams, device: str) -> Sampler:
    s = Sampler(params, V, device)
    s.observe_prompt(PROMPT)
    return s


def host_draw(s: Sampler, logits: torch.Tensor) -> int:
    tok = s.sample(logits)
    s.observe(tok)
    return tok


def device_draw(s: DeviceSampler, logits: torch.Tensor) -> int:
    out = torch.full((1,), 12345, dtype=torch.long, device=logits.device)
    with torch.inference_mode():
        s.sample_into(logits, out)
    return int(out)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(CASES))
def test_host_and_device_samplers_draw_the_same_tokens(name: str, device: str) -> None:
    params = CASES[name]
    a = host(params, device)
    b = DeviceSampler(V, device)
    b.load(params, PROMPT, ())
    gen = torch.Generator().manual_seed(0)
    got, want = [], []
    for _ in range(20):
        logits = step_logits(gen)[0].to(device)
        got.append(host_draw(a, logits))
        want.append(device_draw(b, logits))
    assert got == want
    if not params.greedy:
        assert len(set(got)) > 5  # really drawn, not the argmax every time


@pytest.mark.parametrize("name", ["temperature", "all"])
def test_a_request_continues_its_stream_in_another_sampler(name: str) -> None:
    """Draws 0..7 on the host, then a DeviceSampler loaded with those as generated draws
    8.. as the host sampler would have: the draw number is the count of earlier draws."""
    params = CASES[name]
    a = host(params, "cpu")
    gen = torch.Generator().manual_seed(3)
    logits = [step_logits(gen)[0] for _ in range(16)]
    first = [host_draw(a, x) for x in logits[:8]]
    b = DeviceSampler(V, "cpu")
    b.load(params, PROMPT, first)
    assert [device_draw(b, x) for x in logits[8:]] == [host_draw(a, x) for x in logits[8:]]


@pytest.mark.parametrize("device", DEVICES)
def test_each_row_draws_as_the_host_sampler_of_its_request(device: str) -> None:
    names = list(CASES)
    n = len(names)
    rows = RowsSampler(8, V, device)
    hosts = []
    for r, name in enumerate(names):
        rows.load(r, (name, 0), CASES[name], PROMPT, ())
        hosts.append(host(CASES[name], device))
    gen = torch.Generator().manual_seed(1)
    seen = []
    for _ in range(20):
        logits = step_logits(gen, n).to(device)
        out = torch.full((n,), 12345, dtype=torch.long, device=device)
        with torch.inference_mode():
            rows.sample_into(logits, out, rows.structure(n))
        assert out.tolist() == [host_draw(s, logits[r]) for r, s in enumerate(hosts)]
        seen.append(out.tolist())
    assert all(len(set(col)) > 5 for col in list(zip(*seen, strict=True))[1:])  # sampled rows
