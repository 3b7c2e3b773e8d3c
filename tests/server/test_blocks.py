"""Engine steps to ordered blocks (blocks.Turn), without a server: order, well-formed
operations, any split of the same text, stop sequences."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest

from lily.runtime.generate import StepOutput
from lily.runtime.sampling import SamplingParams
from lily.server.blocks import Turn
from lily.server.handlers import Prepared
from lily.server.serving import Job

EOS = 0
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {
                "type": "object",
                "properties": {"x": {"type": "integer"}, "s": {"type": "string"}},
            },
        },
    }
]


class PieceTokenizer:
    """Token i is the text pieces[i]; id 0 is EOS (decodes to nothing)."""

    eos_token_ids = (EOS,)

    def __init__(self) -> None:
        self.pieces = [""]

    def add(self, text: str) -> int:
        self.pieces.append(text)
        return len(self.pieces) - 1

    def decode(self, ids, skip_special_tokens=False) -> str:
        return "".join(self.pieces[i] for i in ids)


def make_turn(tok, mode="reasoning", stop=(), tools=TOOLS) -> Turn:
    params = SamplingParams(stop=tuple(stop), max_tokens=100)
    p = Prepared(
        kind="chat",
        job=Job([1, 2, 3], params),
        stream=True,
        include_usage=False,
        reasoning_mode=mode,
        tools=tools,
    )
    return Turn(p, SimpleNamespace(engine=SimpleNamespace(tokenizer=tok)))


def run(pieces: list[str], end="eos", **kw):
    """Feed ``pieces`` as one token each, then EOS (or a cut by the length limit)."""
    tok = PieceTokenizer()
    turn = make_turn(tok, **kw)
    ops = []
    for i, piece in enumerate(pieces):
        last = end == "length" and i == len(pieces) - 1
        step = StepOutput(tok.add(piece), piece, finish_reason="length" if last else None)
        ops += turn.push(step)
    if end == "eos":
        ops += turn.push(StepOutput(EOS, "", finish_reason="stop"))
    usage = SimpleNamespace(prompt_tokens=3, cached_tokens=0, completion_tokens=len(pieces))
    ops += turn.finish(usage)
    return turn, ops


def check_ops(turn: Turn, ops) -> None:
    """Each block opens once, gets its deltas, closes once, in order; deltas join to it."""
    state, text = {}, {}
    current = None
    for op, i, piece in ops:
        if op == "open":
            assert i not in state and current is None and i == len(state)
            state[i], text[i], current = "open", "", i
        elif op == "delta":
            assert state[i] == "open" and i == current
            text[i] += piece
        else:
            assert state[i] == "open" and i == current
            state[i], current = "closed", None
    assert set(state) == set(range(len(turn.blocks))) and all(s == "closed" for s in state.values())
    assert [text[i] for i in range(len(turn.blocks))] == [b.text for b in turn.blocks]


ANSWER = (
    "thinking hard</think>\n\nLet me look.\n\n<tool_call>\n<function=f>\n"
    "<parameter=x>\n42\n</parameter>\n<parameter=s>\nhi there\n</parameter>\n"
    "</function>\n</tool_call>\n<tool_call>\n<function=f>\n</function>\n</tool_call>"
)


def test_reasoning_text_and_calls_in_order():
    turn, ops = run([ANSWER])
    check_ops(turn, ops)
    kinds = [(b.kind, b.name) for b in turn.blocks]
    assert kinds == [("reasoning", ""), ("text", ""), ("tool", "f"), ("tool", "f")]
    assert turn.blocks[0].text == "thinking hard"
    assert turn.blocks[1].text == "Let me look.\n\n"
    assert json.loads(turn.blocks[2].text) == {"x": 42, "s": "hi there"}
    assert json.loads(turn.blocks[3].text) == {}
    ids = [b.call_id for b in turn.blocks[2:]]
    assert all(i.startswith("call_") for i in ids) and ids[0] != ids[1]
    assert turn.finish_reason == "tool_calls" and turn.stop_sequence is None


@pytest.mark.parametrize("seed", range(6))
def test_any_split_gives_the_same_blocks(seed):
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(ANSWER)), rng.randint(1, 60)))
    pieces = [ANSWER[a:b] for a, b in zip([0, *cuts], [*cuts, len(ANSWER)], strict=True)]
    whole, _ = run([ANSWER])
    turn, ops = run(pieces)
    check_ops(turn, ops)
    strip = [(b.kind, b.text, b.name) for b in turn.blocks]
    assert strip == [(b.kind, b.text, b.name) for b in whole.blocks]


def test_blank_text_between_blocks_is_not_a_block():
    turn, ops = run(
        [
            "why",
            "</think>",
            "\n\n",
            "  \n",
            "<tool_call>\n<function=f>\n",
            "</function>\n</tool_call>",
        ]
    )
    check_ops(turn, ops)
    assert [b.kind for b in turn.blocks] == ["reasoning", "tool"]


def test_text_only_with_thinking_off():
    turn, ops = run(["Hello", " world"], mode="content", tools=None)
    check_ops(turn, ops)
    assert [(b.kind, b.text) for b in turn.blocks] == [("text", "Hello world")]
    assert turn.finish_reason == "stop"


def test_cut_by_length_marks_the_last_block():
    turn, ops = run(
        ["a", "</think>", "b", "<tool_call>\n<function=f>\n<parameter=s>\nab"], end="length"
    )
    check_ops(turn, ops)
    assert [b.kind for b in turn.blocks] == ["reasoning", "text", "tool"]
    assert turn.finish_reason == "length"
    assert [turn.cut_off(i) for i in range(3)] == [False, False, True]


def test_stop_sequence_found_in_the_tokens():
    # The engine emits the text before the stop string; the last token holds it.
    tok = PieceTokenizer()
    turn = make_turn(tok, mode="content", stop=("END", "STOP"), tools=None)
    turn.push(StepOutput(tok.add("abc "), "abc "))
    turn.push(StepOutput(tok.add("xSTOPyz"), "x", finish_reason="stop"))
    turn.finish(SimpleNamespace(prompt_tokens=3, cached_tokens=0, completion_tokens=2))
    assert turn.stop_sequence == "STOP" and turn.blocks[0].text == "abc x"


def test_eos_is_not_a_stop_sequence():
    turn, _ = run(["the end"], mode="content", stop=("END",), tools=None)
    assert turn.stop_sequence is None and turn.finish_reason == "stop"
