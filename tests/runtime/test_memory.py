"""The runtime's memory estimate replays the session state's own K/V growth."""

from __future__ import annotations

import torch

from lily.runtime.memory import kv_growth
from lily.runtime.state import KVCache, SessionState


def test_kv_growth_replays_the_policy_of_the_state(monkeypatch):
    """With the state's doubling the capacity is 1024 for 300 prompt tokens decoded to 1000;
    with another growth rule put in its place the replay follows that rule (nothing of the
    policy is copied into the estimate)."""
    assert kv_growth(300, 1000, 128, 4096) == (1024, 512)
    assert kv_growth(300, 300, 128, 4096) == (512, 256)
    assert kv_growth(100, 100, 128, 4096) == (256, 0)  # the initial capacity: no growth
    assert kv_growth(100, 5000, 128, 4096)[0] == 4096  # capped at the limit

    def to_hundreds(self: KVCache, n: int) -> None:
        if n > self.capacity:
            cap = -(-n // 100) * 100
            self.k = self.k.new_zeros(self.k.shape[0], cap, self.k.shape[2])
            self.v = self.v.new_zeros(self.k.shape)

    monkeypatch.setattr(KVCache, "ensure", to_hundreds)
    assert kv_growth(300, 1000, 128, 4096) == (1000, 900)


def test_kv_growth_matches_a_state_grown_as_the_runner_does():
    """Chunk ends then one position at a time, on a real (CPU) state."""
    from lily.checkpoint import TINY_TEXT_CONFIG
    from lily.config import ModelConfig

    cfg = ModelConfig.from_dict(TINY_TEXT_CONFIG)
    for n_prompt, n_total, chunk in ((300, 700, 64), (40, 41, 2048), (1000, 1500, 333)):
        st = SessionState.new(cfg, "cpu", torch.float32, 2048)
        ends = [*range(chunk, n_prompt, chunk), n_prompt]
        for n in [*ends, *range(n_prompt + 1, n_total + 1)]:
            for c in st.kv.values():
                c.ensure(n)
        caps = {c.capacity for c in st.kv.values()}
        assert caps == {kv_growth(n_prompt, n_total, chunk, 2048)[0]}
