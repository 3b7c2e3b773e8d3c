"""The request's logits processor on the test tokenizer: the reasoning guard and budget, the
one-call stop, logit_bias, and how a request's controls become one processor."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lily.server.constraints import (
    RESERVE_CAP,
    DecodeSpec,
    build_processor,
    parse_logit_bias,
    reasoning_limit,
)
from lily.server.grammar import GrammarCompiler
from lily.server.protocol import ApiError
from lily.tokenizer import Tokenizer
from lily.tokenizer_files import write_test_tokenizer

V = 512
NEG = float("-inf")
TOOL = {"type": "function", "function": {"name": "ping", "parameters": {
    "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}}  # fmt: skip


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    write_test_tokenizer(d, V)
    return Tokenizer.from_dir(d)


def ctx(tok, budget=None):
    settings = SimpleNamespace(thinking_budget=budget)
    return SimpleNamespace(engine=SimpleNamespace(tokenizer=tok), vocab_size=V,
                           grammars=GrammarCompiler(tok), settings=settings)  # fmt: skip


def allowed(proc, generated):
    return set(torch.isfinite(proc(list(generated), torch.zeros(V))).nonzero().flatten().tolist())


def test_nothing_to_control_means_no_processor(tok):
    assert build_processor(ctx(tok), DecodeSpec(), after_think=True, max_new=100) is None
    spec = DecodeSpec(tools=[TOOL], tool_choice="auto")
    assert build_processor(ctx(tok), spec, after_think=True, max_new=100) is None


def test_required_call_masks_end_of_sequence_while_thinking(tok):
    """Inside the reasoning EOS and the stop ids are masked; the model may close </think>;
    after it the grammar rules (and EOS is still out until the call is complete)."""
    spec = DecodeSpec(tools=[TOOL], tool_choice="required")
    proc = build_processor(ctx(tok), spec, after_think=True, max_new=10_000, stop_ids=[7])
    thinking = tok.encode("let me think")
    ok = allowed(proc, thinking)
    assert not ok & {*tok.eos_token_ids, 7}
    assert tok.think_end_id in ok and len(ok) == V - len({*tok.eos_token_ids, 7})
    after = allowed(proc, [*thinking, tok.think_end_id])
    assert after and not after & set(tok.eos_token_ids)
    texts = {tok.decode([t]) for t in after}
    assert all(t.startswith("\n") or "<tool_call>".startswith(t) for t in texts), texts


def test_free_request_may_end_while_thinking(tok):
    spec = DecodeSpec(thinking_budget=50)
    proc = build_processor(ctx(tok), spec, after_think=True, max_new=100)
    assert set(tok.eos_token_ids) <= allowed(proc, tok.encode("hmm"))


def forced_run(proc, generated, steps):
    """Follow the processor's single allowed token while it forces one."""
    out = list(generated)
    for _ in range(steps):
        ok = allowed(proc, out)
        if len(ok) != 1:
            break
        out.append(ok.pop())
    return out[len(generated) :]


@pytest.mark.parametrize("last", ["think", "think\n"])
def test_budget_forces_the_close_of_the_reasoning(tok, last):
    """At the budget: a newline unless the reasoning ended with one, </think>, the blank
    line the template writes after it; then generation is free again."""
    proc = build_processor(ctx(tok), DecodeSpec(thinking_budget=3), after_think=True,
                           max_new=100)  # fmt: skip
    reasoning = tok.encode(last)
    reasoning = (tok.encode("ab") + reasoning)[-3:]
    assert len(allowed(proc, reasoning[:2])) == V  # under budget: free
    forced = forced_run(proc, reasoning, 10)
    want = ("" if tok.decode(reasoning).endswith("\n") else "\n") + "</think>\n\n"
    assert tok.decode(forced) == want
    assert len(allowed(proc, reasoning + forced)) == V


def test_server_default_budget_and_request_override(tok):
    c = ctx(tok, budget=2)
    proc = build_processor(c, DecodeSpec(), after_think=True, max_new=100)
    assert len(allowed(proc, tok.encode("a"))) == V
    assert tok.decode(forced_run(proc, [65, 66], 10)) == "\n</think>\n\n"
    proc = build_processor(c, DecodeSpec(thinking_budget=5), after_think=True, max_new=100)
    assert len(allowed(proc, [65, 66])) == V
    # Thinking off (the prompt opened no <think>): no budget to apply.
    assert build_processor(c, DecodeSpec(), after_think=False, max_new=100) is None


def test_required_constraint_reserves_room_for_the_answer(tok):
    assert reasoning_limit(None, False, 400) is None
    assert reasoning_limit(None, True, 400) == 200
    assert reasoning_limit(50, True, 400) == 50
    assert reasoning_limit(None, True, 60) == 30
    assert reasoning_limit(None, True, 100_000) == 100_000 - RESERVE_CAP
    spec = DecodeSpec(json_schema={"type": "object"})
    proc = build_processor(ctx(tok), spec, after_think=True, max_new=8)
    out = forced_run(proc, [65, 66, 67, 68], 10)
    assert tok.decode(out[:2]) == "\n</think>"  # closed at 8 - 4 = 4 reasoning tokens


def test_budget_close_then_grammar(tok):
    """After a forced close the grammar takes over: a forced call follows."""
    spec = DecodeSpec(tools=[TOOL], tool_name="ping", thinking_budget=2)
    proc = build_processor(ctx(tok), spec, after_think=True, max_new=1000)
    gen = [65, 66]
    gen += forced_run(proc, gen, 4)
    assert tok.decode(gen[2:]) == "\n</think>\n\n"
    ok = {tok.decode([t]) for t in allowed(proc, gen)}
    assert ok and all("<tool_call>\n".startswith(t) for t in ok), ok


def test_not_parallel_ends_after_the_first_call_in_free_generation(tok):
    spec = DecodeSpec(tools=[TOOL], tool_choice="auto", parallel_tool_calls=False)
    proc = build_processor(ctx(tok), spec, after_think=True, max_new=1000)
    end = tok.tool_call_end_id
    # Inside the reasoning a </tool_call> does not count.
    gen = [65, end, 66]
    assert len(allowed(proc, gen)) == V
    gen += [tok.think_end_id, *tok.encode("\n\n<tool_call>\n<function=ping>\n")]
    assert len(allowed(proc, gen)) == V
    assert allowed(proc, [*gen, end]) == set(tok.eos_token_ids)
    # With ignore_eos the stop cannot work; the parser keeps one call instead.
    assert build_processor(ctx(tok), spec, after_think=False, max_new=9, ignore_eos=True) is None


def test_logit_bias_is_added(tok):
    spec = DecodeSpec(logit_bias={5: 100.0, 9: -100.0})
    proc = build_processor(ctx(tok), spec, after_think=False, max_new=10)
    logits = torch.randn(V)
    out = proc([], logits.clone())
    want = logits.clone()
    want[5] += 100.0
    want[9] -= 100.0
    assert torch.equal(out, want)


@pytest.mark.parametrize(
    "raw,msg",
    [({"abc": 1}, "not a token id"), ({"512": 1}, "not a token id"),
     ({"-1": 1}, "not a token id"), ({"5": 101}, "[-100, 100]"),
     ({"5": float("nan")}, "[-100, 100]"), ({"5": True}, "[-100, 100]"),
     ({"5": "1"}, "[-100, 100]")],
)  # fmt: skip
def test_logit_bias_is_checked(raw, msg):
    with pytest.raises(ApiError) as e:
        parse_logit_bias(raw, V)
    assert e.value.status == 400 and e.value.param == "logit_bias" and msg in e.value.message
    assert parse_logit_bias({" 7": -5, "511": 100}, V) == {7: -5.0, 511: 100.0}
