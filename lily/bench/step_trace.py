"""Where a stream's gap went: the engine's work and the garbage collector's passes, on the
clients' clock, while a serve benchmark runs (lily/bench/serve_load.py's ``busy_ttft``).

A stream's longest gap beside a new prefill stayed between 68 and 103 ms on the H200 from
a decode_prefill_chunk of 512 to 1,024, while a 1,024-token chunk takes about 30 ms on the
device. The trace named what held the streams (docs/notes/batching.md, "Fourteenth
session": the chunk's 30-52 ms of host launches before the step's tokens went out): every
call of the traced engine methods (the batch's step, a prefill
chunk, a working state taken, the host waiting for a batched step's draws) and every
collection, each with its start and end on ``time.perf_counter`` (CLOCK_MONOTONIC: the
client processes' clock, lily/bench/serve_clients.py) and the CPU time its thread spent
(wall time far above it is a wait: on the device, or on the GIL).

Only a benchmark installs it, for the span it measures; the engine carries nothing.
"""

from __future__ import annotations

import functools
import gc
import threading
import time
from typing import Any

_clock = time.perf_counter


def _traced(engine: Any) -> list[tuple[Any, str]]:
    """(object, attribute) of each engine method the trace wraps, those ``engine`` has."""
    batch, runner = getattr(engine, "batch", None), getattr(engine, "runner", None)
    want = [(batch, "step"), (engine, "prefill_chunk"), (engine, "take_state"),
            (runner, "recv_rows"), (runner, "launch_rows"),
            (runner, "launch_rows_ahead")]  # fmt: skip
    return [(o, a) for o, a in want if o is not None and callable(getattr(o, a, None))]


class StepTrace:
    """Records the engine's calls and the collector's passes until ``close``.

    ``events``: dicts of ``what``, ``start``, ``end`` (seconds on the clients' clock),
    ``cpu`` (the thread's CPU seconds in it; None for a collection) and ``thread``.
    """

    def __init__(self, engine: Any):
        self.events: list[dict] = []
        self._lock = threading.Lock()
        self._put: list[tuple[Any, str, Any]] = []
        for obj, attr in _traced(engine):
            self._wrap(obj, attr)
        self._gc_start: dict[int, float] = {}
        gc.callbacks.append(self._gc)

    def _wrap(self, obj: Any, attr: str) -> None:
        inner = getattr(obj, attr)
        label = f"{type(obj).__name__}.{attr}"

        @functools.wraps(inner)
        def call(*a, **k):
            t0, c0 = _clock(), time.thread_time()
            try:
                return inner(*a, **k)
            finally:
                self._add(label, t0, _clock(), time.thread_time() - c0)

        had = attr in vars(obj)
        self._put.append((obj, attr, inner if had else None))
        setattr(obj, attr, call)

    def _add(self, what: str, start: float, end: float, cpu: float | None) -> None:
        ev = {"what": what, "start": start, "end": end, "cpu": cpu,
              "thread": threading.current_thread().name}  # fmt: skip
        with self._lock:
            self.events.append(ev)

    def _gc(self, phase: str, info: dict) -> None:
        tid = threading.get_ident()
        if phase == "start":
            self._gc_start[tid] = _clock()
        elif tid in self._gc_start:
            self._add(f"gc generation {info.get('generation')}", self._gc_start.pop(tid),
                      _clock(), None)  # fmt: skip

    def close(self) -> None:
        """Put the engine's methods back and stop recording."""
        if self._gc in gc.callbacks:
            gc.callbacks.remove(self._gc)
        for obj, attr, had in reversed(self._put):
            if had is None:
                delattr(obj, attr)
            else:
                setattr(obj, attr, had)
        self._put = []

    def __enter__(self) -> StepTrace:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def during(self, t0: float, t1: float, origin: float | None = None) -> list[dict]:
        """The events overlapping [t0, t1], in start order, times in milliseconds from
        ``origin`` (default t0)."""
        o = t0 if origin is None else origin
        with self._lock:
            hit = [e for e in self.events if e["end"] >= t0 and e["start"] <= t1]

        def ms(x: float | None) -> float | None:
            return None if x is None else round(1000 * x, 3)

        return [{"what": e["what"], "thread": e["thread"], "start_ms": ms(e["start"] - o),
                 "ms": ms(e["end"] - e["start"]), "cpu_ms": ms(e["cpu"])}
                for e in sorted(hit, key=lambda e: e["start"])]  # fmt: skip
