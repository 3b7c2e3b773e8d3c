"""The prefix cache under continuous batching: a request that continues any cached
conversation, or shares a running one's system prompt, starts from its snapshot while
others run, and its output equals a cold engine's (reference path)."""

from __future__ import annotations

from lily.config import EngineConfig
from lily.runtime.engine import Engine
from lily.runtime.sampling import SamplingParams

CFG = dict(prefill_chunk=16, decode_prefill_chunk=8, max_context=4096)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
SYSTEM = {"role": "system", "content": "You are a careful agent with many tools. " * 6}


def engines(hf_tiny_dir) -> tuple[Engine, Engine]:
    warm = Engine.load(hf_tiny_dir, EngineConfig(**CFG), progress=False)
    cold = Engine.load(hf_tiny_dir, EngineConfig(**CFG, prefix_cache_gb=0), progress=False)
    return warm, cold


def tokens(engine: Engine, prompt, params=GREEDY) -> list[int]:
    return [s.token_id for s in engine.generate(prompt, params) if s.token_id is not None]


def finish(engine: Engine, *seqs) -> None:
    while any(not s.done for s in seqs):
        engine.batch.step()


def chat(engine: Engine, *user: str, answers: tuple[list[int], ...] = ()) -> list[int]:
    msgs = [SYSTEM]
    for i, u in enumerate(user):
        msgs.append({"role": "user", "content": u})
        if i < len(answers):
            msgs.append({"role": "assistant", "content": engine.tokenizer.decode(answers[i])})
    return engine.encode_chat(msgs)


def test_conversations_continue_from_their_parked_states_while_others_run(hf_tiny_dir):
    warm, cold = engines(hf_tiny_dir)
    b = warm.batch
    a1 = chat(warm, "first task")
    c1 = chat(warm, "a different conversation")
    # two conversations run at once, so two working states hold them afterwards
    sa, sc = b.add(a1, GREEDY), b.add(c1, GREEDY)
    finish(warm, sa, sc)
    assert len(warm.pool) == 2
    assert sa.generated == tokens(cold, a1) and sc.generated == tokens(cold, c1)
    # a third conversation runs long; meanwhile both earlier ones continue
    other = b.add(chat(warm, "something else, long"), LONG)
    while not other.decoding:
        b.step()
    a2 = chat(warm, "first task", "and now the second step", answers=(sa.generated,))
    c2 = chat(warm, "a different conversation", "go on", answers=(sc.generated,))
    ta, tc = b.add(a2, GREEDY), b.add(c2, GREEDY)
    finish(warm, ta, tc)
    assert not other.done  # they ran beside it
    assert ta.generated == tokens(cold, a2) and tc.generated == tokens(cold, c2)
    # each resumed inside its own earlier turn (past the shared system prompt)
    system_end = next(i for i in range(1, len(a1)) if a1[i] == warm.tokenizer.im_start_id)
    assert ta.usage.cached_tokens > system_end and tc.usage.cached_tokens > system_end
    finish(warm, other)
    assert other.generated == tokens(cold, chat(warm, "something else, long"), LONG)


def test_a_new_request_starts_from_a_running_requests_system_prompt(hf_tiny_dir):
    """The snapshot at a running conversation's system-prompt end is copied (KV prefix and
    DeltaNet state) into another working state; the running one is not disturbed."""
    warm, cold = engines(hf_tiny_dir)
    b = warm.batch
    first = chat(warm, "first task")
    r1 = b.add(first, LONG)
    while not r1.decoding:
        b.step()
    second = chat(warm, "another task entirely")
    r2 = b.add(second, GREEDY)
    finish(warm, r2)
    assert r2.state is not r1.state and not r1.done
    system_end = next(i for i in range(1, len(second)) if second[i] == warm.tokenizer.im_start_id)
    assert r2.usage.cached_tokens == system_end
    assert r2.generated == tokens(cold, second)
    finish(warm, r1)
    assert r1.generated == tokens(cold, first, LONG)


def test_pool_grows_only_while_requests_overlap(hf_tiny_dir):
    """One request at a time keeps one working state, as before batching (each new
    conversation resumes it at the shared system prompt's end)."""
    warm, cold = engines(hf_tiny_dir)
    for u in ("one", "two", "three"):
        p = chat(warm, u)
        assert tokens(warm, p) == tokens(cold, p)
        assert len(warm.pool) == 1
    system_end = next(i for i in range(1, len(p)) if p[i] == warm.tokenizer.im_start_id)
    assert warm.last_usage.cached_tokens == system_end
