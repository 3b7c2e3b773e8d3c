"""Requests run together, up to ``--max-running`` at once: a bounded FIFO queue and one
engine worker thread that admits queued requests and steps the engine's batch
(lily/runtime/batch.py: one step advances every running request by one token).

All torch compute runs in the worker thread; the asyncio side receives each step through an
``asyncio.Queue`` fed with ``loop.call_soon_threadsafe``. A request is cancelled by setting
its event, which the batch checks before every token (``cancelled`` callable), so a client
going away frees its place within one step. A queued request is admitted when a place is
free and, beside others, when the memory its context will need is there (``admit``).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import threading
import time
import traceback
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from lily.server.metrics import Metrics

log = logging.getLogger("lily.server")


def log_error(what: str, exc: BaseException, detail: bool) -> None:
    """Log a fault. With ``detail`` (--log-requests) the whole traceback; without, the
    exception's type and where it was raised but not its message, which may quote the
    request: prompts stay out of the logs unless asked for."""
    if detail:
        log.error(what, exc_info=exc)
        return
    frames = traceback.extract_tb(exc.__traceback__)[-6:]
    where = " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in frames[::-1])
    log.error("%s: %s at %s", what, type(exc).__name__, where or "?")


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
    first: float | None = None  # when its first token went out
    last: float | None = None  # when its latest token went out
    # NOTE: set once, under the scheduler's lock: each job is counted in exactly one of
    # the success, failure and cancelled counters.
    outcome: str | None = None
    seq: Any = None  # its lily.runtime.sequence.Seq while it runs

    def post(self, kind: str, value: Any = None) -> None:
        """Hand an event to the request's coroutine (from any thread)."""
        assert self.loop is not None
        try:
            self.loop.call_soon_threadsafe(self.out.put_nowait, (kind, value))
        except RuntimeError:  # the event loop is gone (shutdown): nobody is listening
            self.cancel.set()


class Scheduler:
    """Admits jobs in arrival order, up to ``max_running`` at once, and steps them together
    on a single worker thread. ``admit(job, running)``: whether ``job`` may start beside the
    ``running`` jobs (memory); a job always starts when none runs."""

    def __init__(self, engine: Any, metrics: Metrics, queue_size: int, max_running: int = 1,
                 admit: Callable[[Job, list[Job]], bool] | None = None) -> None:  # fmt: skip
        if max_running < 1:
            raise ValueError(f"max_running: must be >= 1, got {max_running}")
        self.engine = engine
        self.metrics = metrics
        self.queue_size = queue_size
        self.max_running = max_running
        self.admit = admit
        self._waiting: collections.deque[Job] = collections.deque()
        self._cond = threading.Condition()
        self._running: list[Job] = []
        self._stop = False
        self._thread = threading.Thread(target=self._work, name="lily-engine", daemon=True)
        metrics.queue = self._queue_state

    # ---- event-loop side
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """End the worker: queued jobs are dropped (their clients get a 503), running ones
        are cancelled at their next step or prefill chunk."""
        with self._cond:
            self._stop = True
            while self._waiting:
                self._drop(self._waiting.popleft())
            for job in self._running:
                job.cancel.set()
            self._cond.notify_all()

    def close(self, timeout: float) -> bool:
        """Stop (as ``stop``) and wait up to ``timeout`` s for the worker thread to end, so
        no engine work runs while the interpreter shuts down; True when it ended."""
        self.stop()
        if self._thread.ident is not None:
            self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def busy(self) -> tuple[int, int]:
        """(running, waiting) requests."""
        return self._queue_state()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _queue_state(self) -> tuple[int, int]:
        with self._cond:
            return len(self._running), len(self._waiting)

    @property
    def n_waiting(self) -> int:
        return len(self._waiting)

    def submit(self, job: Job) -> None:
        """Queue ``job``; raises QueueFull when ``queue_size`` jobs already wait beyond the
        places free to run."""
        job.loop = asyncio.get_running_loop()
        with self._cond:
            free = max(0, self.max_running - len(self._running))
            if len(self._waiting) >= self.queue_size + free:
                raise QueueFull
            self._waiting.append(job)
            self._cond.notify()

    def cancel(self, job: Job) -> None:
        """Cancel ``job``: drop it from the queue, or stop it at its next step.

        A no-op for a finished job (handlers call it on every exit path)."""
        job.cancel.set()
        with self._cond:
            try:
                self._waiting.remove(job)
            except ValueError:
                return
            self._drop(job)

    def _finish(self, job: Job, outcome: str) -> None:
        # NOTE: called with the lock held.
        if job.outcome is None:
            job.outcome = outcome
            self.metrics.add("request_" + outcome)

    def _drop(self, job: Job) -> None:
        """End a job that never ran. NOTE: called with the lock held."""
        job.cancel.set()
        self._finish(job, "cancelled")
        # Its coroutine may still be waiting for events (a non-streaming request whose
        # client left): without a final event it would wait forever, a leaked task.
        job.post("cancelled")

    # ---- worker thread
    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._running and not self._stop:
                    self._cond.wait()
                if self._stop and not self._running:
                    return
                new = self._admit()
            for job in new:
                self._start(job)
            if not self._running:
                continue
            try:
                # The server never needs autograd; inference mode also lets the engine update
                # its cached tensors in place (they were made in inference mode).
                with torch.inference_mode():
                    # (the decode's tokens go out before a prefill chunk's launches)
                    outs = self.engine.batch.step(self._deliver_now)
            except Exception as e:  # a fault outside any one request: all of them fail
                log_error("engine step failed", e, log.isEnabledFor(logging.DEBUG))
                outs = [(job.seq, e) for job in list(self._running) if job.seq is not None]
                for job in list(self._running):
                    if job.seq is not None:
                        self.engine.batch.abort(job.seq)
            self._deliver(outs)

    def _admit(self) -> list[Job]:
        """Queued jobs that start now. NOTE: called with the lock held."""
        new = []
        while self._waiting and len(self._running) < self.max_running and not self._stop:
            job = self._waiting[0]
            if self._running and self.admit is not None and not self.admit(job, self._running):
                break  # in order: the next one waits for memory, the rest behind it
            self._waiting.popleft()
            self._running.append(job)
            new.append(job)
        return new

    def _start(self, job: Job) -> None:
        job.started = time.monotonic()
        job.seq = None
        if job.cancel.is_set():
            self._end(job, ("cancelled", None), "cancelled")
            return
        try:
            job.seq = self.engine.batch.add(job.prompt_ids, job.params,
                                            cancelled=job.cancel.is_set,
                                            processor=job.processor, tag=job)  # fmt: skip
        except Exception as e:  # noqa: BLE001 - a request the engine refuses fails alone
            self._end(job, ("error", e), "failure")

    def _deliver_now(self, outs: list) -> None:
        """``_deliver``, then wait (FLUSH_S at most) until the event loop has run the
        requests' coroutines on them: the batch calls it before a prefill chunk, whose
        launches hold the GIL for 30-50 ms with releases too short for the loop to take it
        (each launch gives it up for microseconds, which resets the switch interval's
        count), so what was posted would wait for the whole chunk (docs/notes/batching.md,
        "Fourteenth session")."""
        self._deliver(outs)
        loops = {id(s.tag.loop): s.tag.loop for s, _ in outs if s.tag.loop is not None}
        for loop in loops.values():
            flush(loop, FLUSH_S)

    def _deliver(self, outs: list) -> None:
        """Hand each output to its request; end the requests that finished."""
        m = self.metrics
        for seq, out in outs:
            job: Job = seq.tag
            if isinstance(out, Exception):
                if isinstance(out, torch.OutOfMemoryError):
                    # The failed request's tensors are garbage now; give their memory back.
                    torch.cuda.empty_cache()
                # NOTE: no traceback text with locals or prompts reaches the log, only the
                # type and message (prompts stay out of logs unless --log-requests).
                log.error("request %s: engine error: %s: %s", job.request_id, type(out).__name__,
                          str(out)[:500], exc_info=log.isEnabledFor(logging.DEBUG))  # fmt: skip
                self._end(job, ("error", out), "failure")
                continue
            now = time.monotonic()
            if out.token_id is not None:
                if job.first is None:
                    job.first = now
                    m.observe("time_to_first_token_seconds", now - job.arrived)
                else:
                    m.observe("inter_token_latency_seconds", now - job.last)
                job.last = now
            job.post("step", out)
            if out.finish_reason is None:
                continue
            usage = seq.usage
            m.add("prompt_tokens", usage.prompt_tokens)
            m.add("generation_tokens", usage.completion_tokens)
            m.add("prefix_cache_queries", usage.prompt_tokens)
            m.add("prefix_cache_hits", usage.cached_tokens)
            if out.finish_reason == "cancelled":
                self._end(job, ("done", usage), "cancelled")
            else:
                m.observe("e2e_request_latency_seconds", now - job.arrived)
                self._end(job, ("done", usage), "success")

    def _end(self, job: Job, final: tuple[str, Any], outcome: str) -> None:
        with self._cond:
            if job in self._running:
                self._running.remove(job)
            self._finish(job, outcome)
        # NOTE: posted after leaving `_running`, so a client that sees its answer also sees
        # the engine free in /metrics.
        job.post(*final)


# The longest the engine waits for the event loop to hand out a step's tokens before a
# prefill chunk (the loop's turn takes about a millisecond; a stuck loop costs this much).
FLUSH_S = 0.01


def flush(loop: asyncio.AbstractEventLoop, timeout: float) -> bool:
    """From another thread: wait until ``loop`` has run what was scheduled on it before
    this call, and the tasks that woke (one turn more), at most ``timeout`` s; whether it
    did."""
    done = threading.Event()
    try:
        # run after what is queued now; the inner call_soon after the tasks that it wakes
        loop.call_soon_threadsafe(loop.call_soon, done.set)
    except RuntimeError:  # the loop is closed: nothing to wait for
        return True
    return done.wait(timeout)


async def events(job: Job, keepalive: float | None) -> AsyncIterator[tuple[str, Any]]:
    """The job's events; ("keepalive", None) when nothing came for ``keepalive`` seconds."""
    # NOTE: one pending get() is kept across timeouts; cancelling it on every timeout (as
    # asyncio.wait_for does) could drop an event that arrives at that very moment.
    getter: asyncio.Future | None = None
    try:
        while True:
            if getter is None:
                getter = asyncio.ensure_future(job.out.get())
            done, _ = await asyncio.wait({getter}, timeout=keepalive)
            if not done:
                yield "keepalive", None
                continue
            kind, value = getter.result()
            getter = None
            yield kind, value
            if kind in ("done", "error", "cancelled"):
                return
    finally:
        if getter is not None and not getter.done():
            getter.cancel()
