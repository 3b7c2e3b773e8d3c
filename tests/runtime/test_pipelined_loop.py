"""The pipelined decode loop (device sampling, the host one step behind) on the CPU.

The runner's eager hook over the reference ops drives it: the same StepOutput stream as the
plain loop, tokens as the model called directly gives them, and after every kind of stop a session
state that names exactly what the model consumed (a later turn resumed from it gives a
cold prefill's logits).
"""

from __future__ import annotations

import math

import pytest
import torch

from lily.config import EngineConfig
from lily.runtime.device_sampling import DeviceSampler
from lily.runtime.engine import Engine
from lily.runtime.generate import Usage, decode_loop
from lily.runtime.runner import Runner
from lily.runtime.sampling import NO_TOKEN, SamplingParams
from lily.runtime.state import SessionState

CFG = EngineConfig(prefill_chunk=5, max_context=256)
PROMPT = [3, 50, 7, 120, 9]


@pytest.fixture(scope="module")
def engines(hf_tiny_dir) -> tuple[Engine, Engine, Engine]:
    """(pipelined, plain, cold): the first two reuse prefixes, the cold one never does."""
    piped = Engine.load(hf_tiny_dir, CFG, progress=False)
    piped.runner = Runner(piped.model, CFG.prefill_chunk, sample_on_device=True)
    plain = Engine.load(hf_tiny_dir, CFG, progress=False)
    cold_cfg = EngineConfig(prefill_chunk=5, max_context=256, prefix_cache_gb=0)
    return piped, plain, Engine.load(hf_tiny_dir, cold_cfg, progress=False)


def run(engine: Engine, prompt: list[int], cancel_after: int | None = None, **kw):
    calls = []

    def cancelled() -> bool:
        calls.append(1)
        return cancel_after is not None and len(calls) > cancel_after

    steps = list(engine.generate(prompt, SamplingParams(**kw), cancelled=cancelled))
    return [s.token_id for s in steps if s.token_id is not None], steps


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def assert_resumable(piped: Engine, cold: Engine, consumed: list[int]) -> None:
    """The state names exactly what the model consumed: a next turn resumes from all of it
    and gets a cold prefill's logits."""
    st = piped.state
    assert not st.busy and st.length == len(st.tokens)
    assert st.tokens == consumed
    nxt = consumed + [11, 260, 42]
    usage = Usage()
    warm = piped.prefill(nxt, usage)
    assert usage.cached_tokens == len(consumed)
    assert rel(warm, cold.prefill(nxt)) <= 1e-5


def test_greedy_stream_equals_plain_loop_and_model(engines, monkeypatch, greedy_reference):
    piped, plain, _ = engines

    def host_decode(*args):
        raise AssertionError("the pipelined loop must not take the host-sampled step")

    monkeypatch.setattr(piped.runner, "decode", host_decode)
    kw = dict(temperature=0.0, max_tokens=12, ignore_eos=True)
    ids, steps = run(piped, PROMPT, **kw)
    assert ids == greedy_reference(piped, PROMPT, 12)
    assert steps == run(plain, PROMPT, **kw)[1]
    assert "".join(s.text for s in steps) == piped.tokenizer.decode(ids)
    assert piped.last_usage.completion_tokens == 12


# name -> (generate keywords, cancel_after, expected finish, tokens emitted)
REF = 10


def stop_cases(ref: list[int], full: str) -> dict:
    first = lambda t: ref.index(t) + 1  # noqa: E731 (tokens up to the first occurrence)
    return {
        "eos": (dict(max_tokens=REF), None, "stop", first(ref[3])),
        "stop_token_ids": (dict(max_tokens=REF, stop_token_ids=(ref[4],)), None, "stop",
                           first(ref[4])),
        "stop_at_first_token": (dict(max_tokens=REF, stop_token_ids=(ref[0],)), None, "stop", 1),
        "stop_string": (dict(max_tokens=REF, stop=(full[3:6],), ignore_eos=True), None, "stop",
                        None),
        "max_tokens": (dict(max_tokens=6, ignore_eos=True), None, "length", 6),
        "max_tokens_1": (dict(max_tokens=1, ignore_eos=True), None, "length", 1),
        "stop_on_the_last_token": (dict(max_tokens=5, stop_token_ids=(ref[4],)), None,
                                   "stop" if first(ref[4]) <= 5 else "length", None),
        "cancel": (dict(max_tokens=REF, ignore_eos=True), 3, "cancelled", 3),
        "cancel_before_any": (dict(max_tokens=REF, ignore_eos=True), 0, "cancelled", 0),
    }  # fmt: skip


@pytest.mark.parametrize("case", list(stop_cases(list(range(REF)), "x" * 20)))
def test_stops_match_plain_loop_and_leave_a_consistent_state(
    engines, monkeypatch, case, greedy_reference
):
    piped, plain, cold = engines
    ref = greedy_reference(piped, PROMPT, REF)
    full = piped.tokenizer.decode(ref)
    kw, cancel_after, finish, n = stop_cases(ref, full)[case]
    if case == "eos":
        for e in (piped, plain):
            monkeypatch.setattr(e.tokenizer, "eos_token_ids", (ref[3],))
    piped.reset()
    ids, steps = run(piped, PROMPT, cancel_after, temperature=0.0, **kw)
    assert steps == run(plain, PROMPT, cancel_after, temperature=0.0, **kw)[1]
    assert steps[-1].finish_reason == finish
    assert ids == ref[: len(ids)]
    if n is not None:
        assert len(ids) == n
    if case == "stop_string":
        assert "".join(s.text for s in steps) == full[: full.index(full[3:6])]
    assert piped.last_usage.completion_tokens == len(ids)
    # A stop by token or text was seen one step late: the model consumed that token too,
    # except the first token, which goes out before its step is launched. Never past
    # max_tokens: the last allowed token is not consumed.
    consumed = ids if 1 < len(ids) < kw["max_tokens"] else ids[:-1]
    assert_resumable(piped, cold, PROMPT + consumed)


def test_sampled_stream_equals_a_sequential_replay(engines):
    """The pipelined order feeds each draw to the next step and numbers the draws as a
    plain one-at-a-time loop with the same device sampler does."""
    piped, _, _ = engines
    params = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, repetition_penalty=1.3,
                            frequency_penalty=0.5, seed=21, max_tokens=14,
                            ignore_eos=True)  # fmt: skip
    ids, _ = run(piped, PROMPT, **params.__dict__)
    assert ids == run(piped, PROMPT, **params.__dict__)[0]
    assert ids != run(piped, PROMPT, **{**params.__dict__, "seed": 22})[0]
    s = DeviceSampler(piped.cfg.vocab_size, "cpu")
    s.load(params, PROMPT)
    state = SessionState.new(piped.cfg, "cpu", torch.float32, 256, initial_capacity=256)
    logits, _ = piped.model.forward(torch.tensor(PROMPT), state, 0)
    want, out = [], torch.zeros(1, dtype=torch.long)
    for i in range(14):
        s.sample_into(logits, out)
        want.append(int(out))
        logits, _ = piped.model.forward(out.clone(), state, len(PROMPT) + i)
    assert ids == want
    assert len(set(ids)) > 3  # really sampled


def test_nan_logits_raise_the_samplers_error_and_the_state_is_dropped(
    engines, monkeypatch, greedy_reference
):
    piped, plain, _ = engines
    want = greedy_reference(piped, PROMPT, 3)
    messages = []
    for e in (piped, plain):
        forward = e.model.forward
        decodes = []

        def poisoned(ids, state, *a, forward=forward, decodes=decodes, **k):
            out, snaps = forward(ids, state, *a, **k)
            if ids.shape[0] == 1:
                decodes.append(1)
                if len(decodes) == 3:  # the third decode step's logits
                    return torch.full_like(out, math.nan), snaps
            return out, snaps

        monkeypatch.setattr(e.model, "forward", poisoned)
        steps = []
        with pytest.raises(ValueError) as err:
            for s in e.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=10,
                                                       ignore_eos=True)):  # fmt: skip
                steps.append(s)
        assert [s.token_id for s in steps] == want
        messages.append(str(err.value))
        monkeypatch.undo()
    assert messages == [NO_TOKEN, NO_TOKEN]
    # The pipelined loop had fed a placeholder for the bad draw: the engine forgot that state.
    assert piped.state.length == len(piped.state.tokens) == 0
    ids, _ = run(piped, PROMPT, temperature=0.0, max_tokens=4, ignore_eos=True)
    assert ids == greedy_reference(piped, PROMPT, 4)


def test_failed_draw_reaches_the_host_but_feeds_a_valid_id(engines):
    dd = engines[0].runner.device_decode
    v = engines[0].cfg.vocab_size
    dd.start(SamplingParams(temperature=0.0), PROMPT, torch.full((v,), math.nan))
    assert int(dd.tok) == 0  # what the step already queued behind it embeds
    with pytest.raises(ValueError, match=f"^{NO_TOKEN}$"):
        dd.recv(0)


def test_kernel_runner_hook_without_graphs(hf_tiny_dir):
    """The runner's decode_sampled over a kernel model (graphs off) with a stand-in forward
    whose argmax is a known function of the token and the device position: the loop's
    stream and bookkeeping."""
    engine = Engine.load(hf_tiny_dir, CFG, progress=False)
    v = engine.cfg.vocab_size
    seen_pos = []

    class StandIn:  # the kernel model's interface, as the runner sees it
        cfg, device, kernels, capturable = engine.cfg, torch.device("cpu"), True, False

        def forward(self, ids, state, pos, max_len, step=False, cuts=()):
            assert step and isinstance(pos, torch.Tensor)  # a step reads its position there
            seen_pos.append(int(pos))
            target = (ids * 37 + pos.long() * 11 + 5) % v
            return torch.zeros(v).scatter(0, target, 1.0), {}

    runner = Runner(StandIn(), 16, use_graphs=False)
    assert runner.device_decode.tok is runner.tok  # draws write the graph's own input
    state = SessionState.new(engine.cfg, "cpu", torch.float32, 256)
    state.length, state.tokens = len(PROMPT), list(PROMPT)
    first = torch.zeros(v)
    first[77] = 1.0
    params = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)
    steps = list(decode_loop(runner, engine.tokenizer, state, first, PROMPT, params, 9,
                             lambda: False, None, Usage()))  # fmt: skip
    want = [77]
    for j in range(1, 9):
        want.append((want[-1] * 37 + (len(PROMPT) + j - 1) * 11 + 5) % v)
    assert [s.token_id for s in steps] == want
    assert steps[-1].finish_reason == "length"
    assert seen_pos == list(range(len(PROMPT), len(PROMPT) + 8))  # never past max_tokens
    assert state.tokens == PROMPT + want[:-1] and state.length == len(state.tokens)
    assert not state.busy


def test_first_token_goes_out_before_any_step_is_launched(engines, monkeypatch):
    """Launching a step may first capture a graph (tens of milliseconds on a new context
    bucket): the first token must not wait for it; from the second token on, the step
    that consumes a token is launched before the host reads that token."""
    piped, _, _ = engines
    piped.reset()
    launched: list[int] = []
    inner = piped.runner.decode_sampled

    def counting(state):
        launched.append(state.length)
        inner(state)

    monkeypatch.setattr(piped.runner, "decode_sampled", counting)
    gen = piped.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    next(gen)
    assert launched == []
    next(gen)  # token 1: steps for tokens 0 and 1 are both out before it is read
    assert launched == [len(PROMPT), len(PROMPT) + 1]
    list(gen)
    assert launched == [len(PROMPT), len(PROMPT) + 1, len(PROMPT) + 2]  # none past max_tokens
