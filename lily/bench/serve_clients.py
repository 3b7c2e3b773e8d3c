"""The client side of lily/bench/serve_load.py: streams with the official ``openai`` client,
each in a client process of its own, as a user's agents are separate processes (clients
parsing chunks in the server's process would take the GIL from the server and its engine).

``Load`` keeps a pool of client processes (spawned as needed, reused across rounds, so
openai is imported once per process); ``Load.together`` starts one stream per prompt at
once, each in its own process, and returns a ``Batch``, whose ``wait`` gives each stream's
``Stream`` record (sent time, chunk times, tokens, error, the client's process id). A client
process that dies, or that has no result within ``timeout``, is killed and its stream
recorded as an error.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import time
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import Any

MODEL = "bench"


@dataclass
class Stream:
    """One streamed completion: when it was sent, when each chunk came, its usage."""

    sent: float = 0.0
    chunks: list[float] = field(default_factory=list)
    tokens: int = 0
    error: str = ""
    pid: int = 0  # the client process that streamed it

    @property
    def ttft(self) -> float | None:
        return self.chunks[0] - self.sent if self.chunks else None

    def rate_in(self, t0: float, t1: float) -> float:
        """Tokens per second between t0 and t1 (chunks scaled to tokens)."""
        n = sum(t0 < t <= t1 for t in self.chunks)
        scale = self.tokens / len(self.chunks) if self.chunks and self.tokens else 1.0
        return n * scale / (t1 - t0) if t1 > t0 else 0.0

    def max_gap(self, t0: float, t1: float) -> float:
        """Longest wait between chunks within [t0, t1] (the edges count as chunks)."""
        a, b = self.longest_gap(t0, t1)
        return b - a

    def longest_gap(self, t0: float, t1: float) -> tuple[float, float]:
        """Where ``max_gap``'s wait is: its start and end (t0, t0 when t1 <= t0)."""
        if t1 <= t0:
            return t0, t0
        ts = [t0] + [t for t in self.chunks if t0 < t < t1] + [t1]
        return max(zip(ts, ts[1:], strict=False), key=lambda g: g[1] - g[0])


# NOTE: the clients' times are compared with each other and with the benchmark's own:
# time.perf_counter is CLOCK_MONOTONIC on Linux, one clock for the whole machine (not per
# process), so a time taken in a client process means the same instant in this one.
# Worker processes check this when they start (see _Worker).
_clock = time.perf_counter


def _stream(client, ids: list[int], max_tokens: int, sampled: bool, stop, conn) -> Stream:
    """One completion streamed with the official client (runs in a client process); the
    first text chunk's time goes to ``conn`` at once; stops early once ``stop`` is set."""
    out = Stream(pid=os.getpid())
    extra: dict[str, Any] = {"ignore_eos": True}
    kw: dict[str, Any] = {}
    if sampled:  # what agents send: Qwen3's recommended thinking-mode sampling
        kw |= {"temperature": 0.6, "top_p": 0.95}
        extra["top_k"] = 20
    else:
        kw["temperature"] = 0.0
    try:
        out.sent = _clock()
        resp = client.completions.create(
            model=MODEL, prompt=ids, max_tokens=max_tokens, stream=True,
            stream_options={"include_usage": True}, extra_body=extra, **kw,
        )  # fmt: skip
        with resp:
            for chunk in resp:
                now = _clock()
                if chunk.choices and chunk.choices[0].text:
                    if not out.chunks:
                        conn.send(("first", out.sent, now))
                    out.chunks.append(now)
                if chunk.usage is not None:
                    out.tokens = chunk.usage.completion_tokens
                if stop is not None and stop.is_set():
                    break
    except Exception as e:  # noqa: BLE001 - reported in the results
        out.error = f"{type(e).__name__}: {e}"
    return out


def _client_main(conn, stop, url: str, timeout: float) -> None:
    """A client process: one client (openai imported once), then one stream per task
    (ids, max_tokens, sampled, stoppable) until it gets None or the benchmark goes away."""
    try:
        from openai import OpenAI

        # (the benchmark enforces ``timeout`` on the whole stream; this is only a backstop)
        client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0,
                        timeout=timeout + 10)  # fmt: skip
        conn.send(("ready", os.getpid(), _clock()))
        while (task := conn.recv()) is not None:
            ids, max_tokens, sampled, stoppable = task
            s = _stream(client, ids, max_tokens, sampled, stop if stoppable else None, conn)
            conn.send(("done", s))
    except (EOFError, KeyboardInterrupt, BrokenPipeError):
        pass


class _Worker:
    """One client process, its end of the pipe and its own stop event (its own, so that a
    process killed while it held the event's lock takes nothing the others need)."""

    def __init__(self, ctx, url: str, timeout: float):
        self.conn, child = ctx.Pipe()
        self.stop = ctx.Event()
        self.started, self.pid = _clock(), 0
        self.proc = ctx.Process(target=_client_main, args=(child, self.stop, url, timeout),
                                name="lily-bench-client", daemon=True)  # fmt: skip
        self.proc.start()
        child.close()

    def ready(self, deadline: float) -> str:
        """Wait for the process's hello; '' when ready, else why not."""
        if not self.conn.poll(max(deadline - _clock(), 0)):
            return "the client process did not start in time"
        try:
            _, self.pid, t = self.conn.recv()
        except EOFError:
            return f"the client process died starting (exit code {self.proc.exitcode})"
        if not self.started <= t <= _clock():
            raise RuntimeError("a client process's perf_counter is not this process's clock")
        return ""

    def kill(self) -> None:
        self.proc.kill()  # SIGKILL: a stopped or hung process ends too
        self.proc.join(10)
        self.conn.close()


class Batch:
    """Streams started together, one per client process (``Load.together``)."""

    def __init__(self, load: Load, workers: list, timeout: float):
        self.load, self.streams = load, [Stream(error=w) if isinstance(w, str) else Stream()
                                         for w in workers]  # fmt: skip
        self._pending = {i: w for i, w in enumerate(workers) if not isinstance(w, str)}
        self._deadline = _clock() + timeout

    def _finish(self, i: int, record: Stream | None, error: str = "") -> None:
        w = self._pending.pop(i)
        if record is None:
            w.kill()
            self.load._all.remove(w)
            self.streams[i].error, self.streams[i].pid = error, w.pid
        else:
            self.streams[i] = record
            self.load._idle.append(w)

    def pump(self, timeout: float) -> None:
        """Take the client processes' messages for up to ``timeout`` s; record a process
        that died, or that is still streaming past the stream's time limit, as an error."""
        if not self._pending:
            return
        ws = list(self._pending.items())
        wait([w.conn for _, w in ws] + [w.proc.sentinel for _, w in ws], timeout)
        for i, w in ws:
            try:
                while i in self._pending and w.conn.poll():
                    msg = w.conn.recv()
                    if msg[0] == "first":
                        self.streams[i].sent, self.streams[i].chunks = msg[1], [msg[2]]
                    else:
                        self._finish(i, msg[1])
            except (EOFError, OSError):
                pass
            if i in self._pending and not w.proc.is_alive():
                self._finish(i, None, f"the client process died (exit code {w.proc.exitcode})")
            elif i in self._pending and _clock() > self._deadline:
                self._finish(i, None, f"the client process gave no result in "
                                      f"{self.load.timeout:.0f} s: killed")  # fmt: skip

    def started(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for every stream to have its first token (or to end)."""
        deadline = _clock() + timeout
        while any(not self.streams[i].chunks for i in self._pending) and _clock() < deadline:
            self.pump(min(0.05, max(deadline - _clock(), 0)))
        return all(s.chunks or s.error or i not in self._pending
                   for i, s in enumerate(self.streams))  # fmt: skip

    def stop(self) -> None:
        """Ask the running streams to stop (they finish at their next chunk)."""
        for w in self._pending.values():
            w.stop.set()

    def wait(self) -> list[Stream]:
        """Every stream's record, once each has ended (or failed)."""
        while self._pending:
            self.pump(1.0)
        return self.streams


class Load:
    """Streams against ``url`` with the official client, each in a client process of its
    own (a pool started as needed and reused; ``close`` ends it); ``vocab`` for the prompt
    ids; ``timeout``: the most seconds one stream may take."""

    def __init__(self, url: str, vocab: int, sampled: bool = False, timeout: float = 600.0):
        # spawn: a fresh interpreter (no copy of CUDA or the server's threads), openai only
        self._ctx = multiprocessing.get_context("spawn")
        self.url, self.vocab, self.sampled, self.timeout = url, vocab, sampled, timeout
        self._seed = 1000
        self._idle: list[_Worker] = []
        self._all: list[_Worker] = []

    def prompt(self, n: int) -> list[int]:
        from lily.bench.measure import pseudo_text_ids  # (torch: not in the client processes)

        self._seed += 1
        return pseudo_text_ids(n, self.vocab, seed=self._seed)

    def _workers(self, n: int) -> list:
        """``n`` ready client processes (more started as needed), or why one is not."""
        for w in [w for w in self._idle if not w.proc.is_alive()]:  # (died while idle)
            w.kill()
            self._idle.remove(w)
            self._all.remove(w)
        new = [_Worker(self._ctx, self.url, self.timeout) for _ in range(n - len(self._idle))]
        self._all += new
        deadline = _clock() + 120  # (importing openai on a loaded machine)
        got: list = []
        for w in new:
            if why := w.ready(deadline):
                w.kill()
                self._all.remove(w)
            got.append(why or w)
        got += [self._idle.pop() for _ in range(n - len(got))]
        return got

    def together(self, prompts: list[list[int]], max_tokens: int,
                 stoppable: bool = False) -> Batch:  # fmt: skip
        """Start one stream per prompt at once, each in its own client process;
        ``stoppable``: ``Batch.stop`` ends them early."""
        workers = self._workers(len(prompts))
        for w, ids in zip(workers, prompts, strict=True):
            if not isinstance(w, str):
                w.stop.clear()
                with contextlib.suppress(OSError):  # (a process gone: Batch records it)
                    w.conn.send((ids, max_tokens, self.sampled, stoppable))
        return Batch(self, workers, self.timeout)

    def run(self, ids: list[int], max_tokens: int) -> Stream:
        """Stream one completion (in a client process, like every stream) to its end."""
        return self.together([ids], max_tokens).wait()[0]

    def close(self) -> None:
        """End the client processes."""
        for w in self._idle:
            with contextlib.suppress(OSError):
                w.conn.send(None)
        for w in self._all:
            w.proc.join(5 if w in self._idle else 0)
            if w.proc.is_alive():
                w.kill()
        self._idle, self._all = [], []

    def __enter__(self) -> Load:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
