"""Fixtures shared by the generation-loop tests."""

from __future__ import annotations

import pytest
import torch

from lily.runtime.engine import Engine
from lily.runtime.state import SessionState


def _greedy(engine: Engine, prompt: list[int], n: int) -> list[int]:
    """Argmax continuation by calling the model directly, one token at a time."""
    state = SessionState.new(engine.cfg, "cpu", torch.float32, 256, initial_capacity=256)
    logits, _ = engine.model.forward(torch.tensor(prompt), state, 0)
    out = []
    for _ in range(n):
        out.append(int(logits.argmax()))
        logits, _ = engine.model.forward(torch.tensor(out[-1:]), state, len(prompt) + len(out) - 1)
    return out


@pytest.fixture(scope="session")
def greedy_reference():
    """``greedy_reference(engine, prompt, n)``: the reference greedy continuation."""
    return _greedy
