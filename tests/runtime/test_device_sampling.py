"""The device sampler against independent references: argmax by plain Python, kept sets by
`Sampler.warp` (itself tested against float64 maths in tests/test_sampling.py), draw
frequencies by a chi-square that a wrong temperature fails. Its random stream is tested in
test_draws.py."""

from __future__ import annotations

import math
import random

import pytest
import torch

from lily.runtime.device_sampling import DeviceSampler, Structure
from lily.runtime.sampling import Sampler, SamplingParams


def draw(sampler: DeviceSampler, logits: torch.Tensor) -> int:
    out = torch.full((1,), 12345, dtype=torch.long)
    with torch.inference_mode():
        sampler.sample_into(logits, out)
    return int(out)


def force(sampler: DeviceSampler, vocab: int, ids: list[int]) -> None:
    """Make the sampler record ``ids`` as generated, by draws that can only pick them."""
    for i in ids:
        logits = torch.full((vocab,), -math.inf)
        logits[i] = 0.0
        assert draw(sampler, logits) == i


def host_sampler(params: SamplingParams, vocab: int, prompt: list[int], out: list[int]):
    s = Sampler(params, vocab, "cpu")
    s.observe_prompt(prompt)
    for t in out:
        s.observe(t)
    return s


def test_same_seed_and_step_same_draw_otherwise_different() -> None:
    logits = torch.zeros(1000)
    params = SamplingParams(seed=123, top_p=0.9, top_k=500)

    def run(p: SamplingParams, n: int = 30) -> list[int]:
        s = DeviceSampler(1000, "cpu")
        s.load(p, [])
        return [draw(s, logits) for _ in range(n)]

    a = run(params)
    assert a == run(params)
    assert len(set(a)) > 20  # different steps draw different tokens
    assert a != run(SamplingParams(seed=124, top_p=0.9, top_k=500))
    assert run(SamplingParams(seed=None)) != run(SamplingParams(seed=None))
    assert run(SamplingParams(seed=2**64 - 1)) == run(SamplingParams(seed=2**64 - 1))
    # A reload starts the request's stream again (the step counter is per request).
    s = DeviceSampler(1000, "cpu")
    s.load(params, [])
    first = [draw(s, logits) for _ in range(5)]
    s.load(params, [])
    assert [draw(s, logits) for _ in range(5)] == first == a[:5]


# ---- greedy
@pytest.mark.parametrize("penalties", [False, True], ids=["plain", "penalties"])
def test_greedy_is_the_first_argmax_after_penalties(penalties: bool) -> None:
    v = 1000
    gen = torch.Generator().manual_seed(2)
    rep, freq, pres = (1.3, 0.4, 0.7) if penalties else (1.0, 0.0, 0.0)
    params = SamplingParams(temperature=0.0, repetition_penalty=rep, frequency_penalty=freq,
                            presence_penalty=pres)  # fmt: skip
    s = DeviceSampler(v, "cpu")
    prompt = [1, 2, 3, 3, 40]
    s.load(params, prompt)
    output = [3, 5, 5, 7]
    force(s, v, output)
    for trial in range(30):
        logits = (torch.randn(v, generator=gen) * 3).float()
        if trial % 2:  # all negative: the repetition penalty multiplies instead
            logits -= float(logits.max()) + 2.0
        logits[torch.randint(0, v, (50,), generator=gen)] = -math.inf
        top = float(logits.max())
        a, b = sorted(random.Random(trial).sample(range(v), 2))
        logits[a] = logits[b] = top + 1.0  # a tie: the lower index wins
        for i in (1, 3, 5, 7):  # penalized tokens near the top
            logits[i] = top + 0.9 + (0.1 * trial) % 0.3
        vals = []
        for i, x in enumerate(logits.tolist()):
            if i in prompt or i in output:
                x = x / rep if x > 0 else x * rep
            n = output.count(i)
            vals.append(x - freq * n - pres * (1 if n else 0))
        best = max(vals)
        assert draw(s, logits) == vals.index(best)
        output.append(vals.index(best))  # the draw is recorded for the next one
    assert Structure.of(params, v).greedy


def test_greedy_ignores_temperature_below_threshold_and_takes_bf16() -> None:
    s = DeviceSampler(300, "cpu")
    s.load(SamplingParams(temperature=1e-6, top_k=3, top_p=0.5), [])
    assert s.structure == Structure(True, False, False, False, False)
    x = torch.randn(300, generator=torch.Generator().manual_seed(4)).bfloat16()
    assert draw(s, x) == int(x.float().argmax())


def test_repetition_penalty_divides_positive_and_multiplies_negative() -> None:
    s = DeviceSampler(4, "cpu")
    s.load(SamplingParams(temperature=0, repetition_penalty=1.2), [0])
    assert draw(s, torch.tensor([2.0, 1.9, -1.0, -3.0])) == 1  # 2.0 / 1.2 < 1.9
    s.load(SamplingParams(temperature=0, repetition_penalty=1.2), [0])
    assert draw(s, torch.tensor([-1.0, -1.1, -5.0, -5.0])) == 1  # -1.0 * 1.2 < -1.1


# ---- warps: the drawable set and the frequencies
V = 12
PROMPT = [0, 4, 9]
OUTPUT = [4, 4, 6, 11]
WARPS = {
    "temperature": SamplingParams(temperature=0.6),
    "top_k_ties": SamplingParams(temperature=0.9, top_k=3),
    "top_p": SamplingParams(temperature=1.2, top_p=0.6),
    "top_p_keeps_top": SamplingParams(temperature=0.8, top_p=1e-3),
    "min_p": SamplingParams(temperature=1.1, min_p=0.2),
    "repetition": SamplingParams(repetition_penalty=1.8),
    "frequency": SamplingParams(frequency_penalty=1.5),
    "presence": SamplingParams(presence_penalty=-1.2),
    "all": SamplingParams(temperature=0.7, top_k=6, top_p=0.9, min_p=0.05,
                          repetition_penalty=1.3, frequency_penalty=0.3, presence_penalty=0.2),
}  # fmt: skip


def warp_logits() -> torch.Tensor:
    logits = torch.randn(V, generator=torch.Generator().manual_seed(7)) * 1.5
    logits[2] = logits[8] = logits.topk(3).values[-1]  # ties at the third value
    logits[10] = -math.inf
    return logits


def frozen_draws(s: DeviceSampler, logits: torch.Tensor, n: int) -> list[int]:
    """``n`` draws (each at its own step) with the penalty counts held where they are."""
    seen, counts = s.seen.clone(), s.counts.clone()
    out = []
    for _ in range(n):
        out.append(draw(s, logits))
        s.seen.copy_(seen)
        s.counts.copy_(counts)
    return out


def loaded(params: SamplingParams, seed: int) -> DeviceSampler:
    s = DeviceSampler(V, "cpu")
    s.load(SamplingParams(**{**params.__dict__, "seed": seed}), PROMPT)
    force(s, V, OUTPUT)
    return s


def target(params: SamplingParams) -> list[float]:
    """Probabilities of the warped logits of `Sampler` (float64 softmax)."""
    ref = host_sampler(params, V, PROMPT, OUTPUT)
    x = ref.warp(ref.penalized(warp_logits())).double()
    return torch.softmax(x, 0).tolist()


@pytest.mark.parametrize("name", list(WARPS))
def test_drawn_set_is_the_support_of_the_warped_logits(name: str) -> None:
    params = WARPS[name]
    probs = target(params)
    support = {i for i, p in enumerate(probs) if p > 0}
    drawn = set(frozen_draws(loaded(params, seed=5), warp_logits(), 600))
    assert drawn <= support
    assert drawn >= {i for i, p in enumerate(probs) if p > 0.02}  # missed w.p. < 1e-5
    if name == "top_k_ties":
        assert len(support) == 4  # three kept by k, plus the tie with the third
    if name == "top_p_keeps_top":
        assert support == {max(range(V), key=probs.__getitem__)}


def test_top_p_after_top_k_sees_the_renormalized_mass() -> None:
    """Top-k keeps 0.3, 0.25, 0.2 (renormalized 0.4, 0.33, 0.27): top-p 0.6 then drops the
    third, which the mass before top-k (0.55 < 0.6) would have kept."""
    logits = torch.tensor([0.3, 0.25, 0.2, 0.1, 0.1, 0.05]).log()
    params = SamplingParams(top_k=3, top_p=0.6, seed=3)
    s = DeviceSampler(6, "cpu")
    s.load(params, [])
    assert set(frozen_draws(s, logits, 300)) == {0, 1}
    ref = host_sampler(params, 6, [], [])
    assert torch.isfinite(ref.warp(ref.penalized(logits))).tolist() == [True, True] + [False] * 4


def chi2(counts: list[int], probs: list[float]) -> float:
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs, strict=True) if p > 0)


# Temperatures the counts must reject: the penalties and truncations of "all" flatten the
# distribution, so there only a factor 2 is far enough to show at this sample size.
WRONG = {"temperature": (0.8, 1.25), "all": (0.5, 2.0)}


@pytest.mark.parametrize("name", list(WRONG))
def test_draw_frequencies_follow_the_warped_softmax(name: str) -> None:
    params = WARPS[name]
    n = 6000
    counts = [0] * V
    for t in frozen_draws(loaded(params, seed=9), warp_logits(), n):
        counts[t] += 1
    probs = target(params)
    dof = sum(p > 0 for p in probs) - 1
    # chi2 with <= 11 degrees of freedom exceeds 40 with probability below 1e-4.
    assert chi2(counts, probs) < 40, (counts, [round(n * p) for p in probs], dof)
    # ... while the same counts against a wrong temperature fail by far.
    for f in WRONG[name]:
        t = params.temperature * f
        assert chi2(counts, target(SamplingParams(**{**params.__dict__, "temperature": t}))) > 150


# ---- bad input
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_non_finite_winner_writes_minus_one_and_records_nothing(temperature: float) -> None:
    params = SamplingParams(temperature=temperature, repetition_penalty=1.2, seed=1)
    s = DeviceSampler(4, "cpu")
    s.load(params, [])
    assert draw(s, torch.tensor([0.0, math.nan, 0.0, 0.0])) == -1
    assert draw(s, torch.full((4,), -math.inf)) == -1
    assert not s.seen.any() and not s.counts.any()
    # masked logits (a grammar) are respected
    assert draw(s, torch.tensor([-math.inf, -math.inf, 0.0, -math.inf])) == 2
    assert s.seen.tolist() == [False, False, True, False]


def test_bad_shapes_and_ids_are_refused() -> None:
    s = DeviceSampler(4, "cpu")
    s.load(SamplingParams(repetition_penalty=1.1), [])
    with pytest.raises(ValueError, match="shape"):
        draw(s, torch.zeros(1, 4))
    with pytest.raises(ValueError, match="outside"):
        s.load(SamplingParams(repetition_penalty=1.1), [0, 4])
    with pytest.raises(ValueError, match="^top_p: "):
        s.load(SamplingParams(top_p=0.0), [])
