"""Reasoning split: modes, held-back partial tags, any split of the stream."""

import random

import pytest

from lily.server.reasoning import ReasoningParser, prompt_opens_thinking


def run(mode: str, pieces: list[str]) -> tuple[str, str]:
    p = ReasoningParser(mode)
    r = c = ""
    for piece in pieces:
        a, b = p.feed(piece)
        r, c = r + a, c + b
    a, b = p.finish()
    return r + a, c + b


CASES = [
    ("reasoning", "I think so.\n</think>\n\nThe answer.", "I think so.\n", "The answer."),
    ("reasoning", "<think>\nnested open\n</think>\n\nok", "\nnested open\n", "ok"),
    ("reasoning", "cut off by max_tokens </thi", "cut off by max_tokens </thi", ""),
    ("content", "</think>no split <think>", "", "</think>no split <think>"),
    ("detect", "<think>hm</think>\n\nyes", "hm", "yes"),
    ("detect", "plain answer", "", "plain answer"),
    ("detect", "  <thin", "", "  <thin"),
]


@pytest.mark.parametrize("mode,text,reasoning,content", CASES)
def test_whole(mode, text, reasoning, content):
    assert run(mode, [text]) == (reasoning, content)


@pytest.mark.parametrize("mode,text,reasoning,content", CASES)
def test_char_by_char_and_random_splits(mode, text, reasoning, content):
    assert run(mode, list(text)) == (reasoning, content)
    rng = random.Random(len(text))
    for _ in range(10):
        cuts = sorted(rng.sample(range(1, len(text)), min(4, len(text) - 1)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert run(mode, pieces) == (reasoning, content)


def test_partial_close_tag_is_held_back():
    p = ReasoningParser("reasoning")
    assert p.feed("abc</th") == ("abc", "")
    assert p.feed("ink>\n\nX") == ("", "X")


def test_prompt_opens_thinking():
    assert prompt_opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n")
