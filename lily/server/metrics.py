"""Prometheus text exposition with vLLM's metric names under the ``lily:`` prefix.

Existing vLLM dashboards need only a prefix rename. Written by hand (no client library):
a few counters, two gauges and three histograms, updated from the event loop and the
engine thread under one lock. Each accepted request ends in exactly one of the success,
failure and cancelled counters; refused ones count as rejected.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable

PREFIX = "lily:"

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
                0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0)  # fmt: skip
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip


def _fmt(v: float) -> str:
    return repr(float(v)) if v != float("inf") else "+Inf"


class Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.total = 0.0
        self.n = 0

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, v)] += 1
        self.total += v
        self.n += 1


class Metrics:
    """The server's metrics; ``render()`` gives the /metrics body."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self._lock = threading.Lock()
        self.counters = {
            "prompt_tokens": 0,
            "generation_tokens": 0,
            "prefix_cache_queries": 0,
            "prefix_cache_hits": 0,
            "request_success": 0,
            "request_failure": 0,
            "request_cancelled": 0,
            "request_rejected": 0,
        }
        self.histograms = {
            "time_to_first_token_seconds": Histogram(_LATENCY_BUCKETS),
            "inter_token_latency_seconds": Histogram(_ITL_BUCKETS),
            "e2e_request_latency_seconds": Histogram(_E2E_BUCKETS),
        }
        # (running, waiting), read together so a scrape never sees a request in both
        self.queue: Callable[[], tuple[int, int]] = lambda: (0, 0)

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    def observe(self, name: str, v: float) -> None:
        with self._lock:
            self.histograms[name].observe(v)

    def render(self) -> str:
        name = self.model_name.replace("\\", "\\\\").replace('"', '\\"')
        lab = f'model_name="{name}"'
        label = "{" + lab + "}"
        out = []

        def head(name: str, kind: str, text: str) -> None:
            out.append(f"# HELP {PREFIX}{name} {text}")
            out.append(f"# TYPE {PREFIX}{name} {kind}")

        running, waiting = self.queue()
        head("num_requests_running", "gauge", "Requests being computed (up to --max-running).")
        out.append(f"{PREFIX}num_requests_running{label} {_fmt(running)}")
        head("num_requests_waiting", "gauge", "Requests waiting in the queue.")
        out.append(f"{PREFIX}num_requests_waiting{label} {_fmt(waiting)}")
        helps = {
            "prompt_tokens": "Prefill tokens processed (including cached).",
            "generation_tokens": "Generated tokens.",
            "prefix_cache_queries": "Prompt tokens looked up in the prefix cache.",
            "prefix_cache_hits": "Prompt tokens found in the prefix cache.",
            "request_success": "Requests finished without an error.",
            "request_failure": "Requests that ended with an engine error.",
            "request_cancelled": "Requests whose client went away before the end.",
            "request_rejected": "Requests refused before queueing (queue full, shutting down).",
        }
        with self._lock:
            for name, value in self.counters.items():
                head(f"{name}_total", "counter", helps[name])
                out.append(f"{PREFIX}{name}_total{label} {_fmt(value)}")
            for name, h in self.histograms.items():
                head(name, "histogram", name.replace("_", " ").capitalize() + ".")
                cum = 0
                for le, c in zip((*h.buckets, float("inf")), h.counts, strict=True):
                    cum += c
                    out.append(f'{PREFIX}{name}_bucket{{{lab},le="{_fmt(le)}"}} {_fmt(cum)}')
                out.append(f"{PREFIX}{name}_sum{label} {_fmt(h.total)}")
                out.append(f"{PREFIX}{name}_count{label} {_fmt(h.n)}")
        return "\n".join(out) + "\n"
