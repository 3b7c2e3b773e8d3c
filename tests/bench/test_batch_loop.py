"""diagnostics/batch_loop.py's loop on the tiny model on the CPU: every timed step gives each
of the B requests one token, and the requests leave the batch afterwards (the figures it
prints divide by those counts)."""

from __future__ import annotations

import threading

import torch

from lily.bench.gpu.diagnostics import batch_loop
from lily.bench.gpu.diagnostics.batch_loop import busy_thread, loop
from lily.bench.random_model import model_config, random_params
from lily.bench.source import engine_from_params
from lily.config import EngineConfig


def test_the_loop_counts_one_token_a_row_a_step_and_leaves_the_batch_empty():
    cfg = model_config("tiny")
    engine = engine_from_params(cfg, random_params(cfg, "cpu", dtype=torch.float32),
                                EngineConfig(device="cpu", max_context=512, max_running=3),
                                name="random tiny", text_only=True)  # fmt: skip
    for b in (1, 3):
        r = loop(engine, b, context=12, steps=5, seed=b)
        assert r["tokens"] == 5 * b, r
        assert r["rows"] == b and r["tok_s"] > 0
        assert len(engine.batch) == 0
    assert r["replay_ms"] is None  # (no graphs on the CPU)


class _Clock:
    """time as busy_thread sees it: every perf_counter read advances 10 us, sleep advances
    by what it is asked and records it; ``stop`` is set after ``cycles`` sleeps."""

    def __init__(self, stop: threading.Event, cycles: int) -> None:
        self.t, self.reads, self.sleeps = 0.0, 0, []
        self.stop, self.cycles = stop, cycles

    def perf_counter(self) -> float:
        self.reads += 1
        self.t += 1e-5
        return self.t

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.t += s
        if len(self.sleeps) >= self.cycles:
            self.stop.set()


def test_the_busy_thread_holds_the_gil_its_share_of_every_millisecond(monkeypatch):
    # On a simulated clock (a timed check flaked beside the suite's workers): each cycle
    # spins in Python until 600 us have passed, then sleeps the rest of the millisecond,
    # and the thread ends once asked.
    stop = threading.Event()
    clock = _Clock(stop, cycles=5)
    monkeypatch.setattr(batch_loop, "time", clock)
    th = busy_thread(600, stop)
    th.join(5)
    assert not th.is_alive()
    assert len(clock.sleeps) == 5
    assert all(abs(s - 4e-4) < 1e-12 for s in clock.sleeps), clock.sleeps
    # each cycle: one read sets the deadline, 60 more reach it (10 us each; one more where
    # the float sum lands just short of it)
    assert 5 * 61 <= clock.reads <= 5 * 62, clock.reads
