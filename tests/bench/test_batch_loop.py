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


def test_the_busy_thread_holds_the_gil_about_its_share():
    stop = threading.Event()
    th = busy_thread(600, stop)
    t0, spins = time.perf_counter(), 0
    while time.perf_counter() - t0 < 0.2:
        spins += 1
    stop.set()
    th.join(2)
    assert not th.is_alive()
    # (a main loop alone for 0.2 s spins far more often than beside a thread holding the
    # GIL for 0.6 ms of every ms; only the direction is asserted)
    t0, alone = time.perf_counter(), 0
    while time.perf_counter() - t0 < 0.2:
        alone += 1
    assert spins < alone
