"""Conversations against the prefix cache, property-based: several conversations that
interleave, branch (an earlier user turn edited), regenerate, and get cancelled in the
middle of a prefill or of the decode, under budgets from tiny (every request evicts) to
ample, with and without the host tier. Every request must succeed, and every answer
(greedy tokens and log-probabilities) must equal the same request on an engine without
a prefix cache, whatever the cache kept, trimmed or dropped before.

A hypothesis state machine drives the engine in-process on the tiny fp32 model; runs are
bounded (``MAX_EXAMPLES`` x ``STEPS``) to about a minute on a shared 2-core host. Set
LILY_STRESS_EXAMPLES for a longer run, LILY_STRESS_SHRINK=1 to shrink a failure.
"""

from __future__ import annotations

import collections
import os

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from lily.config import EngineConfig
from lily.runtime.engine import Engine
from lily.runtime.sampling import SamplingParams

MAX_EXAMPLES = int(os.environ.get("LILY_STRESS_EXAMPLES", "3"))  # per budget
STEPS = 20
CHUNK = 16  # small prefill chunks: a cancellation can land between them
GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=2)
LOGPROB_TOL = 1e-4  # fp32, different chunk splits
MAX_PROMPT = 1200  # a conversation this long starts over
# Derandomized, so a failure reproduces; shrinking it took minutes, so it is asked for.
PHASES = [Phase.explicit, Phase.reuse, Phase.generate] + (
    [Phase.shrink] if os.environ.get("LILY_STRESS_SHRINK") else []
)

# (device budget, host budget) in GB. Tiny: less than one stored conversation, so nearly
# every request evicts or trims; small: a few; ample: everything.
BUDGETS = {
    "tiny": (0.0001, 0.0),
    "tiny+host": (0.0001, 0.0003),
    "small": (0.0005, 0.0),
    "small+host": (0.0003, 0.0004),
    "ample": (1.0, 0.0),
}
WORDS = ["alpha", "beta", "tool", "file", "read", "plan", "agent", "42", "é", "<|im_end|>",
         "the", "of", "λ", "code", "\n"]  # fmt: skip
SYSTEMS = ["You are a careful agent with many tools. " * 4, "Answer tersely.", None]

text = st.lists(st.sampled_from(WORDS), min_size=1, max_size=10).map(" ".join)


@pytest.fixture(scope="module")
def engines(hf_tiny_dir):
    def make(gb: float, host: float) -> Engine:
        cfg = EngineConfig(prefill_chunk=CHUNK, max_context=2048, prefix_cache_gb=gb,
                           prefix_cache_host_gb=host)  # fmt: skip
        return Engine.load(hf_tiny_dir, cfg, progress=False)

    cold = make(0.0, 0.0)
    return cold, {name: make(*b) for name, b in BUDGETS.items()}


def answer(engine: Engine, ids: list[int], cancel_after: int | None = None):
    """(token ids, [(logprob, top ids)], finish) of a greedy request; with
    ``cancel_after``, the request is cancelled at that check of ``cancelled``."""
    calls = [0]

    def cancelled() -> bool:
        calls[0] += 1
        return cancel_after is not None and calls[0] > cancel_after

    toks, lps, finish = [], [], None
    for step in engine.generate(ids, GREEDY, cancelled=cancelled):
        if step.token_id is not None:
            toks.append(step.token_id)
            lps.append((step.logprob, [i for i, _ in step.top_logprobs]))
        finish = step.finish_reason or finish
    return toks, lps, finish


class Conversations(RuleBasedStateMachine):
    COLD: Engine
    WARM: dict[str, Engine]
    BUDGET: str
    SEEN: collections.Counter  # what the run went through, checked at the end

    def __init__(self) -> None:
        super().__init__()
        self.convs: list[list[dict]] = []
        self.reference: dict[tuple[int, ...], tuple] = {}
        self.engine = self.WARM[self.BUDGET]
        self.budget = self.BUDGET

    @initialize()
    def fresh_engine(self) -> None:
        self.engine.reset()
        cache = self.engine.prefix_cache
        shrink = cache._shrink

        def counted(e, over) -> None:  # how often the budget cut entries back or dropped them
            n = len(e.tokens)
            shrink(e, over)
            self.SEEN["dropped" if e not in cache.stored else "trimmed"] += len(e.tokens) < n or 1

        cache._shrink = counted

    # ---- helpers
    def _cold(self, ids: list[int]) -> tuple:
        key = tuple(ids)
        if key not in self.reference:
            self.reference[key] = answer(self.COLD, ids)
        return self.reference[key]

    def _ask(self, msgs: list[dict], cancel_after: int | None = None) -> list[int]:
        ids = self.engine.encode_chat(msgs)
        toks, lps, finish = answer(self.engine, ids, cancel_after)
        cached = self.engine.last_usage.cached_tokens
        self.SEEN.update({f"{self.budget} requests": 1, f"{self.budget} reused": cached > 0,
                          "cancelled in prefill": finish == "cancelled" and not toks,
                          "cancelled in decode": finish == "cancelled" and bool(toks),
                          "spilled": self.engine.prefix_cache.host_nbytes() > 0})  # fmt: skip
        ref_toks, ref_lps, _ = self._cold(ids)
        if finish == "cancelled":  # what came out before the cancel is the reference's
            assert toks == ref_toks[: len(toks)]
        else:
            assert finish == "length"
            assert toks == ref_toks, (toks, ref_toks, self.engine.last_usage)
        for (lp, top), (ref_lp, ref_top) in zip(lps, ref_lps, strict=False):
            assert abs(lp - ref_lp) <= LOGPROB_TOL and top == ref_top
        return toks

    def _reply(self, toks: list[int]) -> dict:
        text = self.engine.tokenizer.decode(toks)
        reasoning, sep, content = text.partition("</think>")
        if sep:
            return {"role": "assistant", "content": content, "reasoning_content": reasoning}
        return {"role": "assistant", "content": text}

    # ---- rules
    @rule(system=st.sampled_from(SYSTEMS), first=text)
    def start(self, system: str | None, first: str) -> None:
        msgs = [{"role": "system", "content": system}] if system else []
        self.convs.append([*msgs, {"role": "user", "content": first}])

    @precondition(lambda self: self.convs)
    @rule(data=st.data(), follow_up=text)
    def turn(self, data: st.DataObject, follow_up: str) -> None:
        """The next turn of one conversation (any of them: they interleave)."""
        i = data.draw(st.integers(0, len(self.convs) - 1), label="conversation")
        conv = self.convs[i]
        toks = self._ask(conv)
        grown = [*conv, self._reply(toks), {"role": "user", "content": follow_up}]
        if len(self.engine.encode_chat(grown)) > MAX_PROMPT:
            grown = [m for m in conv if m["role"] == "system"] + grown[-1:]
        self.convs[i] = grown

    @precondition(lambda self: self.convs)
    @rule(data=st.data())
    def regenerate(self, data: st.DataObject) -> None:
        """The same request again (a client retrying, or asking for another answer)."""
        conv = self.convs[data.draw(st.integers(0, len(self.convs) - 1), label="conversation")]
        self._ask(conv)
        self._ask(conv)

    @precondition(lambda self: self.convs)
    @rule(data=st.data(), edit=text)
    def branch(self, data: st.DataObject, edit: str) -> None:
        """A user turn edited (an earlier one, or the last, resent): a new conversation
        sharing the start of the old."""
        conv = self.convs[data.draw(st.integers(0, len(self.convs) - 1), label="conversation")]
        users = [k for k, m in enumerate(conv) if m["role"] == "user"]
        k = data.draw(st.sampled_from(users), label="turn")
        branch = [*conv[:k], {"role": "user", "content": edit}]
        self.SEEN["branches"] += 1
        self._ask(branch)
        self.convs.append(branch)

    @precondition(lambda self: self.convs)
    @rule(data=st.data(), after=st.integers(0, 12))
    def cancel(self, data: st.DataObject, after: int) -> None:
        """A request cancelled after ``after`` checks: between prefill chunks for small
        values, between decode steps for larger ones."""
        conv = self.convs[data.draw(st.integers(0, len(self.convs) - 1), label="conversation")]
        self._ask(conv, cancel_after=after)

    # ---- what must hold after every step
    @invariant()
    def cache_is_consistent(self) -> None:
        state, cache = self.engine.state, self.engine.prefix_cache
        assert state.length == len(state.tokens) and not state.busy
        assert cache.host_nbytes() <= cache.host_budget
        for e in cache.stored:
            assert all(k.shape[1] == len(e.tokens) for k, _ in e.kv.values())
            assert all(0 < p < len(e.tokens) for p in e.snaps)
        if cache.live is not None:
            assert all(p <= state.length for p in cache.live.snaps)


@pytest.mark.parametrize("budget", list(BUDGETS))
def test_conversations_equal_a_cold_engine(engines, budget: str):
    cold, warm = engines

    class Machine(Conversations):
        COLD, WARM, BUDGET, SEEN = cold, warm, budget, collections.Counter()

    run_state_machine_as_test(
        Machine,
        settings=settings(max_examples=MAX_EXAMPLES, stateful_step_count=STEPS, deadline=None,
                          suppress_health_check=list(HealthCheck), derandomize=True,
                          phases=PHASES),
    )  # fmt: skip
    seen = Machine.SEEN
    # The run went where it should: reuse, both cancellations, branches; under the small
    # budgets entries cut back or dropped, with a host tier some spilled.
    want = ["reused", "cancelled in prefill", "cancelled in decode", "branches"]
    want += ["dropped"] if budget != "ample" else []
    want += ["spilled"] if budget.endswith("+host") else []
    for what in want:
        assert seen[f"{budget} {what}"] + seen[what] > 0, (what, seen)
