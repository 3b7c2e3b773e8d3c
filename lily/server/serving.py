"""One request computes at a time: a bounded FIFO queue and one engine worker thread.

All torch compute runs in the worker thread; the asyncio side receives each step through an
``asyncio.Queue`` fed with ``loop.call_soon_threadsafe``. A request is cancelled by setting
its event, which the engine checks before every decode step (``cancelled`` callable), so
the next request starts within one step of a client going away.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from lily.server.metrics import Metrics

log = logging.getLogger("lily.server")


class QueueFull(Exception):
    """The waiting queue is at its limit."""


@dataclass
class Job:
    """One request's work and the channel its results come back on."""

    prompt_ids: list[int]
    params: Any  # lily.runtime.sampling.SamplingParams
    processor: Callable | None = None
    request_id: str = ""
    cancel: threading.Event = field(default_factory=threading.Event)
    out: asyncio.Queue = field(default_factory=asyncio.Queue)
    loop: asyncio.AbstractEventLoop | None = None
    arrived: float = field(default_factory=time.monotonic)
    started: float | None = None

    def post(self, kind: str, value: Any = None) -> None:
        """Hand an event to the request's coroutine (from any thread)."""
        assert self.loop is not None
        try:
            self.loop.call_soon_threadsafe(self.out.put_nowait, (kind, value))
        except RuntimeError:  # the event loop is gone (shutdown): nobody is listening
            self.cancel.set()


class Scheduler:
    """Runs jobs one at a time, in arrival order, on a single worker thread."""

    def __init__(self, engine: Any, metrics: Metrics, queue_size: int) -> None:
        self.engine = engine
        self.metrics = metrics
        self.queue_size = queue_size
        self._waiting: collections.deque[Job] = collections.deque()
        self._cond = threading.Condition()
        self._running: Job | None = None
        self._stop = False
        self._thread = threading.Thread(target=self._work, name="lily-engine", daemon=True)
        metrics.running = lambda: int(self._running is not None)
        metrics.waiting = lambda: len(self._waiting)

    # ---- event-loop side
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            for job in self._waiting:
                job.cancel.set()
            if self._running is not None:
                self._running.cancel.set()
            self._cond.notify_all()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def n_waiting(self) -> int:
        return len(self._waiting)

    def submit(self, job: Job) -> None:
        """Queue ``job``; raises QueueFull when ``queue_size`` jobs already wait."""
        job.loop = asyncio.get_running_loop()
        with self._cond:
            idle = self._running is None and not self._waiting
            if len(self._waiting) >= self.queue_size and not idle:
                raise QueueFull
            self._waiting.append(job)
            self._cond.notify()

    def cancel(self, job: Job) -> None:
        """Cancel ``job``: drop it from the queue, or stop it at the next decode step."""
        job.cancel.set()
        with self._cond:
            try:
                self._waiting.remove(job)
            except ValueError:
                pass

    # ---- worker thread
    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._stop:
                    self._cond.wait()
                if self._stop:
                    return
                job = self._waiting.popleft()
                self._running = job
            final: tuple[str, Any] | None = None
            try:
                if not job.cancel.is_set():
                    final = self._run(job)
            finally:
                with self._cond:
                    self._running = None
            # NOTE: posted after clearing `_running`, so a client that sees its answer
            # also sees the engine idle in /metrics.
            if final is not None:
                job.post(*final)

    def _run(self, job: Job) -> tuple[str, Any]:
        """Stream the job's steps; return its final event (done or error)."""
        engine, m = self.engine, self.metrics
        job.started = time.monotonic()
        first = last = None
        try:
            # The server never needs autograd; inference mode also lets the engine update
            # its cached tensors in place (they were made in inference mode).
            with torch.inference_mode():
                steps = engine.generate(
                    job.prompt_ids,
                    job.params,
                    cancelled=job.cancel.is_set,
                    logits_processor=job.processor,
                )
                for step in steps:
                    now = time.monotonic()
                    if step.token_id is not None:
                        if first is None:
                            first = now
                            m.observe("time_to_first_token_seconds", now - job.arrived)
                        else:
                            m.observe("inter_token_latency_seconds", now - last)
                        last = now
                    job.post("step", step)
        except Exception as e:  # an engine fault fails this request only
            log.exception("request %s: engine error", job.request_id)
            m.add("request_failure")
            return "error", e
        usage = engine.last_usage
        m.add("prompt_tokens", usage.prompt_tokens)
        m.add("generation_tokens", usage.completion_tokens)
        m.add("prefix_cache_queries", usage.prompt_tokens)
        m.add("prefix_cache_hits", usage.cached_tokens)
        m.add("request_success")
        m.observe("e2e_request_latency_seconds", time.monotonic() - job.arrived)
        return "done", usage
