"""Sampling against plain-maths references: penalties by their formulas, kept sets of
top-k/top-p/min-p by sorting probabilities in float64, draw frequencies by binomial bounds."""

import math
import random
import warnings

import pytest
import torch

from lily.runtime.sampling import Sampler, SamplingParams


def _softmax(xs: list[float]) -> list[float]:
    m = max(xs)
    e = [math.exp(x - m) if x != -math.inf else 0.0 for x in xs]
    s = sum(e)
    return [v / s for v in e]


def _penalized_ref(
    logits: list[float], prompt: list[int], output: list[int], rep: float, freq: float, pres: float
) -> list[float]:
    out = []
    for i, x in enumerate(logits):
        if i in prompt or i in output:
            x = x / rep if x > 0 else x * rep
        n = output.count(i)
        out.append(x - freq * n - pres * (1 if n else 0))
    return out


def _kept(sampler: Sampler, logits: torch.Tensor) -> set[int]:
    x = sampler.warp(sampler.penalized(logits))
    return {i for i, v in enumerate(x.tolist()) if v != -math.inf}


def _draw_counts(params: SamplingParams, logits: torch.Tensor, n: int) -> list[int]:
    sampler = Sampler(params, logits.shape[0], "cpu")
    counts = [0] * logits.shape[0]
    for _ in range(n):
        counts[sampler.sample(logits)] += 1
    return counts


def _assert_frequencies(counts: list[int], probs: list[float]) -> None:
    n = sum(counts)
    for c, p in zip(counts, probs, strict=True):
        if p == 0.0:
            assert c == 0
        else:  # 5 binomial standard deviations, plus slack for tiny p
            assert abs(c / n - p) <= 5 * math.sqrt(p * (1 - p) / n) + 1e-3, (counts, probs)


def test_greedy_is_argmax() -> None:
    gen = torch.Generator().manual_seed(0)
    for temperature in (0.0, 1e-6):
        sampler = Sampler(SamplingParams(temperature=temperature), 1000, "cpu")
        for _ in range(20):
            logits = torch.randn(1000, generator=gen)
            assert sampler.sample(logits) == int(logits.argmax())
    bf16 = torch.randn(1000, generator=gen).bfloat16()
    assert Sampler(SamplingParams(temperature=0), 1000, "cpu").sample(bf16) == int(bf16.argmax())


def test_penalties_match_formulas() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(50, generator=gen) * 3
    prompt, output = [1, 2, 3, 3, 40], [3, 5, 5, 5, 7, 1]
    params = SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.7)
    sampler = Sampler(params, 50, "cpu")
    sampler.observe_prompt(prompt)
    for t in output:
        sampler.observe(t)
    ref = _penalized_ref(logits.tolist(), prompt, output, 1.3, 0.4, 0.7)
    torch.testing.assert_close(sampler.penalized(logits), torch.tensor(ref), rtol=1e-6, atol=1e-6)


def test_repetition_penalty_changes_greedy_choice() -> None:
    logits = torch.tensor([2.0, 1.9, -1.0, -3.0])
    sampler = Sampler(SamplingParams(temperature=0, repetition_penalty=1.2), 4, "cpu")
    assert sampler.sample(logits) == 0
    sampler.observe_prompt([0])  # 2.0 / 1.2 < 1.9
    assert sampler.sample(logits) == 1
    # a negative logit is multiplied, pushing it further down
    logits = torch.tensor([-1.0, -1.1])
    sampler = Sampler(SamplingParams(temperature=0, repetition_penalty=1.2), 2, "cpu")
    sampler.observe(0)
    assert sampler.sample(logits) == 1


def test_temperature_frequencies() -> None:
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -2.0])
    for t in (0.5, 1.0, 2.0):
        counts = _draw_counts(SamplingParams(temperature=t, seed=3), logits, 4000)
        _assert_frequencies(counts, _softmax([x / t for x in logits.tolist()]))


def _ref_top_k(probs: list[float], k: int) -> set[int]:
    return set(sorted(range(len(probs)), key=lambda i: -probs[i])[:k])


def _ref_top_p(probs: list[float], p: float) -> set[int] | None:
    """Smallest most-likely set with mass >= p; None when p sits on a float boundary."""
    kept, mass = set(), 0.0
    for i in sorted(range(len(probs)), key=lambda i: -probs[i]):
        if abs(mass - p) < 1e-4:
            return None
        if mass >= p:
            break
        kept.add(i)
        mass += probs[i]
    return kept


@pytest.mark.parametrize("trial", range(30))
def test_top_k_top_p_min_p_kept_sets(trial: int) -> None:
    rng = random.Random(trial)
    v = rng.choice([7, 64, 300])
    logits = torch.randn(v, generator=torch.Generator().manual_seed(trial)) * rng.uniform(0.5, 4)
    t = rng.uniform(0.3, 1.5)
    k = rng.choice([0, 1, 5, v - 1, v])
    p = rng.choice([1.0, rng.uniform(0.05, 0.98)])
    min_p = rng.choice([0.0, rng.uniform(0.01, 0.5)])
    probs = _softmax([x / t for x in logits.double().tolist()])
    kept = set(range(v)) if k in (0, v) else _ref_top_k(probs, k)
    renorm = [pr / sum(probs[i] for i in kept) if i in kept else 0.0 for i, pr in enumerate(probs)]
    if p < 1.0:
        while (top_p := _ref_top_p(renorm, p)) is None:
            p += 3e-4  # step off a float boundary where fp32 and fp64 may disagree
        kept = top_p
    sampler = Sampler(SamplingParams(temperature=t, top_k=k, top_p=p, min_p=min_p), v, "cpu")
    if min_p > 0.0:
        kept = {i for i in kept if probs[i] >= min_p * max(probs)}
    assert _kept(sampler, logits) == kept


def test_top_p_exact_small_case() -> None:
    probs = [0.05, 0.5, 0.15, 0.3]
    logits = torch.tensor([math.log(q) for q in probs])
    for p, kept in [(0.45, {1}), (0.79, {1, 3}), (0.81, {1, 3, 2}), (0.99, {0, 1, 2, 3})]:
        assert _kept(Sampler(SamplingParams(top_p=p), 4, "cpu"), logits) == kept


def test_top_k_top_p_draw_frequencies() -> None:
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -1.0])
    params = SamplingParams(temperature=0.8, top_k=4, top_p=0.9, seed=11)
    probs = _softmax([x / 0.8 for x in logits.tolist()])
    kept = _ref_top_p([q / sum(probs[:4]) for q in probs[:4]], 0.9)
    assert kept is not None
    total = sum(probs[i] for i in kept)
    expected = [probs[i] / total if i in kept else 0.0 for i in range(6)]
    _assert_frequencies(_draw_counts(params, logits, 4000), expected)


def test_seed_determinism() -> None:
    logits = torch.zeros(1000)

    def run(seed: int | None) -> list[int]:
        sampler = Sampler(SamplingParams(seed=seed, top_p=0.9, top_k=500), 1000, "cpu")
        return [sampler.sample(logits) for _ in range(30)]

    assert run(123) == run(123)
    assert run(123) != run(124)
    assert run(None) != run(None)
    # a seed outside int64 (OpenAI clients may send up to 2**64 - 1) works too
    assert run(2**64 - 1) == run(2**64 - 1)


def test_logprobs_match_log_softmax() -> None:
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(100, generator=gen) * 2
    sampler = Sampler(SamplingParams(temperature=0.5, frequency_penalty=0.5), 100, "cpu")
    sampler.observe(7)
    sampler.observe(7)
    ref = _penalized_ref(logits.tolist(), [], [7, 7], 1.0, 0.5, 0.0)
    m = max(ref)
    log_z = m + math.log(sum(math.exp(x - m) for x in ref))
    ref_lp = [x - log_z for x in ref]
    chosen, top = sampler.logprobs(logits, 7, 5)
    assert chosen == pytest.approx(ref_lp[7], abs=1e-5)
    ref_top = sorted(range(100), key=lambda i: -ref_lp[i])[:5]
    assert [i for i, _ in top] == ref_top
    assert [lp for _, lp in top] == pytest.approx([ref_lp[i] for i in ref_top], abs=1e-5)
    assert sampler.logprobs(logits, 3, 0) == (pytest.approx(ref_lp[3], abs=1e-5), [])


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", float("nan")),
        ("temperature", -0.1),
        ("temperature", float("inf")),
        ("top_k", -2),
        ("top_k", 2.5),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_p", float("nan")),
        ("min_p", -0.1),
        ("min_p", 1.5),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", float("nan")),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3.0),
        ("seed", 1.5),
        ("seed", 2**64),
        ("max_tokens", 0),
        ("stop", ("",)),
        ("stop", (1,)),
        ("stop_token_ids", (-1,)),
        ("ignore_eos", "yes"),
        ("logprobs", -1),
    ],
)
def test_validation_names_the_field(field: str, value: object) -> None:
    params = SamplingParams(**{field: value})
    with pytest.raises(ValueError, match=f"^{field}: "):
        params.validate()
    with pytest.raises(ValueError, match=f"^{field}: "):
        Sampler(params, 10, "cpu")


def test_defaults_valid_and_stop_normalized() -> None:
    SamplingParams().validate()
    SamplingParams(top_k=-1, temperature=0, seed=-5, logprobs=0).validate()
    assert SamplingParams(stop="END").stop == ("END",)
    assert SamplingParams(stop=["a", "b"], stop_token_ids=[3]).stop_token_ids == (3,)


def test_bad_logits_and_ids() -> None:
    sampler = Sampler(SamplingParams(), 4, "cpu")
    with pytest.raises(ValueError, match="no token to sample"):
        sampler.sample(torch.full((4,), -math.inf))
    with pytest.raises(ValueError, match="no token to sample"):
        Sampler(SamplingParams(temperature=0), 4, "cpu").sample(torch.tensor([0.0, math.nan, 0, 0]))
    with pytest.raises(ValueError, match="shape"):
        sampler.sample(torch.zeros(1, 4))
    with pytest.raises(ValueError, match="outside"):
        sampler.observe(4)
    # masked logits (a grammar) are respected
    assert sampler.sample(torch.tensor([-math.inf, -math.inf, 0.0, -math.inf])) == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_one_sync_per_sample() -> None:
    """GPU only (run with the lead's GPU batch): same seed -> same tokens, one sync each."""
    logits = torch.randn(248320, device="cuda")
    params = SamplingParams(
        temperature=0.7, top_k=20, top_p=0.95, min_p=0.05, repetition_penalty=1.1, seed=9
    )
    a, b = Sampler(params, 248320, "cuda"), Sampler(params, 248320, "cuda")
    a.observe_prompt(list(range(100)))
    b.observe_prompt(list(range(100)))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ta = [a.sample(logits) for _ in range(10)]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(caught) == 10
    assert ta == [b.sample(logits) for _ in range(10)]


# Ops that make the host wait for the device: a value read back (`.item()`, indexing by a
# 0-dim device tensor), or an output whose size depends on the data.
_HOST_READS = {
    "aten._local_scalar_dense", "aten.is_nonzero", "aten.equal", "aten.nonzero",
    "aten.masked_select", "aten.multinomial", "aten.unique", "aten._unique2",
}  # fmt: skip


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0),
        SamplingParams(
            temperature=0.7,
            top_k=20,
            top_p=0.95,
            min_p=0.05,
            seed=9,
            repetition_penalty=1.1,
            presence_penalty=0.5,
        ),
    ],
    ids=["greedy", "all-warpers"],
)
def test_sample_reads_the_device_once(params) -> None:
    """The CPU stand-in for test_cuda_one_sync_per_sample (which saw three syncs a draw on
    the H200): every aten op of a draw is logged; exactly one reads a value back to the
    host, and no Python scalar is copied into a tensor element (on CUDA a blocking
    host-to-device copy)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Log(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.reads: list[str] = []
            self.scalar_writes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func).rsplit(".", 1)[0]
            if name in _HOST_READS:
                self.reads.append(name)
            if name == "aten.copy_" and args[1].dim() == 0:
                self.scalar_writes += 1
            return func(*args, **(kwargs or {}))

    sampler = Sampler(params, 1000, "cpu")
    sampler.observe_prompt(list(range(100)))
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    with Log() as log:
        for _ in range(3):
            sampler.sample(logits)
    assert log.reads == ["aten._local_scalar_dense"] * 3
    assert log.scalar_writes == 0
