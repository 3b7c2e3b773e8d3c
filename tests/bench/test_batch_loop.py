"""diagnostics/batch_loop.py's loop on the tiny model on the CPU: every timed step gives each
of the B requests one token, and the requests leave the batch afterwards (the figures it
prints divide by those counts)."""

from __future__ import annotations

import threading
import time

import torch

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


def _spins(seconds: float) -> int:
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        n += 1
    return n


def test_the_busy_thread_holds_the_gil_about_its_share():
    # (a main loop alone spins far more often than beside a thread holding the GIL for
    # 0.6 ms of every ms; only the direction is asserted, each side's best of three runs
    # taken in turn, so that a loaded machine slowing one run does not decide it: on the
    # GPU machine, beside the suite's other workers, one run alone was seen slower)
    busy, alone = [], []
    for _ in range(3):
        stop = threading.Event()
        th = busy_thread(600, stop)
        busy.append(_spins(0.1))
        stop.set()
        th.join(2)
        assert not th.is_alive()
        alone.append(_spins(0.1))
    assert max(busy) < max(alone), (busy, alone)
