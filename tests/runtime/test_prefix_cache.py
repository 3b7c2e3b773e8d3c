"""Multi-turn reuse gives the same results as a cold prefill (reference path, fp32)."""

from __future__ import annotations

import pytest
import torch

from lily.config import EngineConfig
from lily.runtime.engine import Engine
from lily.runtime.prefix_cache import Entry, PrefixCache, common_prefix
from lily.runtime.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def engines(hf_tiny_dir):
    warm = Engine.load(hf_tiny_dir, EngineConfig(prefill_chunk=16, max_context=4096),
                       progress=False)  # fmt: skip
    cold = Engine.load(hf_tiny_dir, EngineConfig(prefill_chunk=16, max_context=4096,
                                                 prefix_cache_gb=0), progress=False)  # fmt: skip
    return warm, cold


def run(engine: Engine, ids: list[int]):
    """Greedy tokens, text, the first step's logits, and the tokens reused."""
    first = []

    def capture(generated, logits):
        if not generated:
            first.append(logits.clone())
        return logits

    steps = list(engine.generate(ids, GREEDY, logits_processor=capture))
    toks = [s.token_id for s in steps if s.token_id is not None]
    return toks, "".join(s.text for s in steps), first[0], engine.last_usage.cached_tokens


def rel(a, b):
    return float((a - b).norm() / b.norm())


def assert_same(warm, cold, ids):
    wt, wtext, wl, cached = run(warm, ids)
    ct, _, cl, cold_cached = run(cold, ids)
    assert cold_cached == 0
    assert rel(wl, cl) <= 1e-5
    assert wt == ct
    return wtext, cached


@pytest.mark.parametrize("think", [True, False], ids=["thinking", "no-thinking"])
def test_multi_turn_reuse_equals_cold(engines, think):
    warm, cold = engines
    warm.reset()
    tok = warm.tokenizer
    msgs = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name a colour."}]  # fmt: skip
    prev_ids: list[int] = []
    prev_len = 0
    for turn in range(4):
        ids = warm.encode_chat(msgs, enable_thinking=think)
        text, cached = assert_same(warm, cold, ids)
        if turn == 0:
            assert cached == 0
        else:
            # Resumed at least at the start of the last assistant header of the last prompt.
            last_header = max(i for i in range(prev_len) if prev_ids[i] == tok.im_start_id)
            assert cached >= last_header
            assert cached < len(ids)
        reasoning, sep, content = text.partition("</think>")
        msg = {"role": "assistant", "content": content if sep else text}
        if sep:
            msg["reasoning_content"] = reasoning
        msgs += [msg, {"role": "user", "content": f"And another one, number {turn}?"}]
        prev_ids, prev_len = ids, len(ids)


def test_divergence_inside_an_old_turn(engines):
    warm, cold = engines
    warm.reset()
    base = [{"role": "user", "content": "first question about the weather today"},
            {"role": "assistant", "content": "sunny"},
            {"role": "user", "content": "second question"}]  # fmt: skip
    assert_same(warm, cold, warm.encode_chat(base))
    edited = [dict(m) for m in base]
    edited[0]["content"] = "first question about the ocean"
    ids = warm.encode_chat(edited)
    _, cached = assert_same(warm, cold, ids)
    old = warm.encode_chat(base)
    diverge = next(i for i, (a, b) in enumerate(zip(ids, old, strict=False)) if a != b)
    assert cached <= diverge


def test_two_conversations_alternating(engines):
    warm, cold = engines
    warm.reset()
    a = [{"role": "user", "content": "conversation A starts here"}]
    b = [{"role": "user", "content": "a completely different conversation B"}]
    assert_same(warm, cold, warm.encode_chat(a))
    assert_same(warm, cold, warm.encode_chat(b))
    a2 = a + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "more A"}]
    _, cached = assert_same(warm, cold, warm.encode_chat(a2))
    assert cached > 0  # restored from the stored copy of A
    assert warm.prefix_cache.hits >= cached


def test_tiny_budget_evicts_but_stays_correct(hf_tiny_dir, engines):
    _, cold = engines
    cfg = EngineConfig(prefill_chunk=16, max_context=4096, prefix_cache_gb=1e-9)
    small = Engine.load(hf_tiny_dir, cfg, progress=False)
    a = [{"role": "user", "content": "conversation A"}]
    b = [{"role": "user", "content": "conversation B"}]
    assert_same(small, cold, small.encode_chat(a))
    assert_same(small, cold, small.encode_chat(b))
    assert small.prefix_cache.stored == []
    assert_same(
        small,
        cold,
        small.encode_chat(
            a + [{"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}]
        ),
    )


def test_cached_state_is_a_real_saving(engines):
    """The resumed request prefills only the new tokens."""
    warm, _ = engines
    warm.reset()
    calls = []
    orig = warm.runner.prefill_snapshots

    def counting(ids, state, points):
        calls.append(len(ids))
        return orig(ids, state, points)

    warm.runner.prefill_snapshots = counting
    try:
        msgs = [{"role": "user", "content": "hello " * 30}]
        ids = warm.encode_chat(msgs)
        run(warm, ids)
        calls.clear()
        ids2 = warm.encode_chat(msgs + [{"role": "assistant", "content": "hi"},
                                        {"role": "user", "content": "bye"}])  # fmt: skip
        _, _, _, cached = run(warm, ids2)
        assert sum(calls) == len(ids2) - cached
        assert sum(calls) < len(ids2) - len(ids) + 20
    finally:
        warm.runner.prefill_snapshots = orig


@pytest.mark.parametrize("diverge", [0, 1, 511, 512, 513, 1023, 1024, 1500, None])
def test_common_prefix_at_block_edges(diverge):
    """The block-wise comparison against the definition: the first index where the lists
    differ (or the shorter length), at and around the 512-token block edges."""
    a = [(i * 7919) % 13 for i in range(1500)]
    b = list(a) + [5, 6]
    if diverge is not None:
        b[diverge] = 99
    want = next((i for i in range(min(len(a), len(b))) if a[i] != b[i]), min(len(a), len(b)))
    assert common_prefix(a, b) == common_prefix(b, a) == want
    assert common_prefix(a[:diverge], b) == len(a[:diverge])


def test_snapshot_points_last_turn_start_and_system_end():
    """Before the last boundary token after ``start``; from scratch also before the first
    (none at or before ``start``)."""
    b = {7}
    assert PrefixCache.snapshot_points([7, 1, 7, 2, 7, 2, 7, 3], 0, b) == [2, 6]
    assert PrefixCache.snapshot_points([7, 1, 7, 2, 7, 2, 7, 3], 1, b) == [6]
    assert PrefixCache.snapshot_points([7, 1, 7, 2, 2, 7, 3], 5, b) == []
    assert PrefixCache.snapshot_points([7, 1, 7, 2, 2, 3], 0, b) == [2]
    assert PrefixCache.snapshot_points([7, 1, 2], 0, b) == []


def test_new_conversation_reuses_the_shared_system_prompt(engines):
    """Two conversations with one system prompt: the second resumes after it."""
    warm, cold = engines
    warm.reset()
    system = {"role": "system", "content": "You are a careful agent with many tools. " * 8}
    first = warm.encode_chat([system, {"role": "user", "content": "first task"}])
    assert_same(warm, cold, first)
    second = warm.encode_chat([system, {"role": "user", "content": "another task entirely"}])
    _, cached = assert_same(warm, cold, second)
    system_end = next(i for i in range(1, len(second)) if second[i] == warm.tokenizer.im_start_id)
    assert cached == system_end


@pytest.mark.parametrize("host_gb", [0.0, 1.0], ids=["dropped", "spilled"])
def test_conversations_with_the_same_tokens_are_told_apart(host_gb):
    """Agents sharing a system prompt leave stored conversations with the same tokens
    (each cut back to that prompt's end). Evicting the older of two such twins found it by
    comparing entries, which compared their tensors and failed the request with "Boolean
    value of Tensor with more than one value is ambiguous" (seen under tests/server/
    test_load.py); the least recently used one must go and the other stay, whole."""

    def entry(stamp: int) -> Entry:
        kv = {0: (torch.ones(2, 8, 4), torch.ones(2, 8, 4))}
        return Entry(tokens=list(range(8)), kv=kv, deltanet={}, snaps={}, stamp=stamp)

    newer, older = entry(5), entry(3)
    pc = PrefixCache(budget_bytes=newer.nbytes(), host_budget_bytes=int(host_gb * newer.nbytes()))
    pc.stored = [newer, older]
    pc.evict()
    assert [e is newer for e in pc.stored] == [True, False][: len(pc.stored)]
    if host_gb:  # the older one spilled to the host budget instead
        assert len(pc.stored) == 2 and pc.stored[1] is older and older.spilled
    else:
        assert len(pc.stored) == 1
    assert newer.kv is not None and len(newer.tokens) == 8 and not newer.spilled


def _words(rng, n: int) -> str:
    vocab = ["alpha", "beta", "gamma", "delta", "tool", "file", "read", "write", "agent", "plan"]
    return " ".join(rng.choice(vocab) for _ in range(n))


@pytest.mark.parametrize("host_gb", [0.0, 0.0004], ids=["no-spill", "spill"])
def test_interleaved_conversation_under_a_tiny_budget(hf_tiny_dir, engines, host_gb):
    """Issue 19's CPU reproduction: an agent conversation (80-word system prompt, 20 words a
    turn) with an unrelated request between its turns, in a budget of 0.0008 GB (a few
    hundred tokens of this model's fp32 KV). Resuming the agent used to evict the very
    entry being resumed (``list.remove(x): x not in list``). Every turn must equal a cold
    engine's, and from the second on reuse at least the agent's system prompt."""
    import random

    _, cold = engines
    cfg = EngineConfig(prefill_chunk=16, max_context=4096, prefix_cache_gb=0.0008,
                       prefix_cache_host_gb=host_gb)  # fmt: skip
    small = Engine.load(hf_tiny_dir, cfg, progress=False)
    cache = small.prefix_cache
    rng = random.Random(0)
    agent = [{"role": "system", "content": _words(rng, 80)}]
    spilled = 0
    for turn in range(5):
        agent.append({"role": "user", "content": _words(rng, 20)})
        text, cached = assert_same(small, cold, small.encode_chat(agent))
        system_end = len(small.encode_chat(agent[:1], add_generation_prompt=False))
        assert turn == 0 or cached >= system_end, (turn, cached)
        assert cache.nbytes() <= cache.budget and cache.host_nbytes() <= cache.host_budget
        spilled = max(spilled, cache.host_nbytes())
        agent.append({"role": "assistant", "content": text})
        other = [{"role": "system", "content": _words(rng, 80)},
                 {"role": "user", "content": _words(rng, 20 * (turn + 1))}]  # fmt: skip
        assert_same(small, cold, small.encode_chat(other))
    assert (spilled > 0) == (host_gb > 0)
