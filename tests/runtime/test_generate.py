"""The generation loop on a tiny checkpoint written by transformers."""

from __future__ import annotations

import pytest

from lily.config import EngineConfig
from lily.runtime.engine import ContextLengthError, Engine
from lily.runtime.sampling import SamplingParams


@pytest.fixture(scope="module")
def engine(hf_tiny_dir) -> Engine:
    return Engine.load(hf_tiny_dir, EngineConfig(prefill_chunk=5, max_context=256), progress=False)


def collect(engine, prompt, **kw):
    steps = list(engine.generate(prompt, SamplingParams(**kw)))
    return [s.token_id for s in steps if s.token_id is not None], steps


def test_greedy_matches_direct_argmax_and_max_tokens(engine, greedy_reference):
    prompt = [3, 50, 7, 120, 9, 11, 300]
    ids, steps = collect(engine, prompt, temperature=0.0, max_tokens=12, ignore_eos=True)
    assert ids == greedy_reference(engine, prompt, 12)
    assert steps[-1].finish_reason == "length"
    assert engine.last_usage.prompt_tokens == 7 and engine.last_usage.completion_tokens == 12


def test_text_is_the_detokenized_ids(engine):
    ids, steps = collect(engine, [1, 2, 3], temperature=0.0, max_tokens=10, ignore_eos=True)
    assert "".join(s.text for s in steps) == engine.tokenizer.decode(ids)


def test_stop_token_ids_end_generation(engine, greedy_reference):
    prompt = [3, 50, 7, 120]
    ref = greedy_reference(engine, prompt, 6)
    ids, steps = collect(engine, prompt, temperature=0.0, max_tokens=6, stop_token_ids=(ref[2],))
    assert ids == ref[: ref.index(ref[2]) + 1]
    assert steps[-1].finish_reason == "stop"


def test_stop_string_cuts_text(engine, greedy_reference):
    prompt = [3, 50, 7, 120]
    full = engine.tokenizer.decode(greedy_reference(engine, prompt, 10))
    cut = full[3:6]
    _, steps = collect(engine, prompt, temperature=0.0, max_tokens=10, stop=(cut,),
                       ignore_eos=True)  # fmt: skip
    text = "".join(s.text for s in steps)
    assert steps[-1].finish_reason == "stop"
    assert text == full[: full.index(cut)]


def test_same_seed_same_output_different_seed_differs(engine):
    kw = dict(temperature=1.5, max_tokens=16, ignore_eos=True)
    a, _ = collect(engine, [4, 5, 6], seed=7, **kw)
    b, _ = collect(engine, [4, 5, 6], seed=7, **kw)
    c, _ = collect(engine, [4, 5, 6], seed=8, **kw)
    assert a == b
    assert a != c


def test_cancel_stops_within_one_step(engine):
    calls = []

    def cancelled() -> bool:
        calls.append(1)
        return len(calls) > 3

    steps = list(engine.generate([1, 2], SamplingParams(max_tokens=50, ignore_eos=True),
                                 cancelled=cancelled))  # fmt: skip
    assert steps[-1].finish_reason == "cancelled"
    assert sum(s.token_id is not None for s in steps) == 3


def test_prompt_over_the_window_is_refused(engine):
    with pytest.raises(ContextLengthError, match="maximum context length is 256 tokens"):
        list(engine.generate(list(range(250)), SamplingParams(max_tokens=10)))


def test_cancel_during_prefill_stops_between_chunks(engine, greedy_reference):
    chunks = []
    orig = engine.runner.prefill_snapshots

    def counting(ids, state, points):
        chunks.append(len(ids))
        return orig(ids, state, points)

    engine.runner.prefill_snapshots = counting
    try:
        steps = list(engine.generate(list(range(3, 43)), SamplingParams(max_tokens=5),
                                     cancelled=lambda: len(chunks) >= 2))  # fmt: skip
    finally:
        engine.runner.prefill_snapshots = orig
    assert [s.finish_reason for s in steps] == ["cancelled"]
    assert chunks == [5, 5]  # 40 prompt tokens in chunks of 5: stopped after the second
    ids, _ = collect(engine, [3, 50, 7], temperature=0.0, max_tokens=4, ignore_eos=True)
    assert ids == greedy_reference(engine, [3, 50, 7], 4)
