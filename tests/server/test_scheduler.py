"""The server's scheduler (lily/server/serving.py) over a stand-in batch: up to max_running
jobs computed together, admission in arrival order and by the admit check, the queue bound
counted beyond the free places, cancellation of a running job."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from lily.runtime.generate import StepOutput, Usage
from lily.runtime.sampling import SamplingParams
from lily.server.metrics import Metrics
from lily.server.serving import Job, QueueFull, Scheduler, events


class FakeSeq:
    def __init__(self, n: int, cancelled, tag):
        self.n, self.cancelled, self.tag = n, cancelled, tag
        self.i = 0
        self.usage = Usage(prompt_tokens=n)


class FakeBatch:
    """One token per running sequence per step; a sequence of prompt length n gives n."""

    def __init__(self) -> None:
        self.seqs: list[FakeSeq] = []
        self.widest = 0
        self.gate = threading.Event()
        self.gate.set()
        self.delay = 0.0

    def add(self, prompt, params, cancelled, processor, tag):
        s = FakeSeq(len(prompt), cancelled, tag)
        self.seqs.append(s)
        return s

    def step(self, deliver=None):  # (all outputs returned: deliver is the batch's choice)
        self.gate.wait()
        time.sleep(self.delay)
        self.widest = max(self.widest, len(self.seqs))
        outs = []
        for s in list(self.seqs):
            if s.cancelled():
                outs.append((s, StepOutput(None, "", finish_reason="cancelled")))
                self.seqs.remove(s)
                continue
            s.i += 1
            s.usage.completion_tokens = s.i
            done = s.i == s.n
            outs.append((s, StepOutput(s.i, "x", finish_reason="length" if done else None)))
            if done:
                self.seqs.remove(s)
        return outs


def job(n: int) -> Job:
    return Job(list(range(n)), SamplingParams(max_tokens=n))


async def collect(j: Job) -> list:
    return [(k, v) async for k, v in events(j, None)]


def run(coro):
    return asyncio.run(coro)


@pytest.fixture
def make():
    made = []

    def _make(max_running: int, queue_size: int = 8, admit=None):
        engine = type("E", (), {"batch": FakeBatch()})()
        s = Scheduler(engine, Metrics("t"), queue_size, max_running, admit)
        s.start()
        made.append(s)
        return s, engine.batch

    yield _make
    for s in made:
        s.close(5)


def test_up_to_max_running_jobs_step_together(make):
    sched, batch = make(max_running=3)

    async def main():
        jobs = [job(n) for n in (4, 6, 2, 5, 3)]
        batch.gate.clear()  # all five are queued before the first step
        for j in jobs:
            sched.submit(j)
        batch.gate.set()
        return jobs, await asyncio.gather(*(collect(j) for j in jobs))

    jobs, results = run(main())
    assert batch.widest == 3
    for j, res in zip(jobs, results, strict=True):
        steps = [v for k, v in res if k == "step"]
        assert [s.token_id for s in steps] == list(range(1, len(j.prompt_ids) + 1))
        assert res[-1][0] == "done" and res[-1][1].completion_tokens == len(j.prompt_ids)
        assert j.outcome == "success"


def test_admit_holds_the_queue_in_order(make):
    """A job the admit check refuses waits (and the one behind it too) until the running
    jobs are gone; alone, it always starts."""

    def admit(j, running):
        return len(j.prompt_ids) < 5

    sched, batch = make(max_running=4, admit=admit)

    async def main():
        a, big, c = job(6), job(9), job(2)
        batch.gate.clear()
        for j in (a, big, c):
            sched.submit(j)
        batch.gate.set()
        await asyncio.gather(*(collect(j) for j in (a, big, c)))
        return a, big, c

    a, big, c = run(main())
    started = sorted((a, big, c), key=lambda j: j.started)
    # big waited for a to end; c waited behind big (arrival order)
    assert started == [a, big, c] and big.started >= a.last  # after a's last token
    assert all(j.outcome == "success" for j in (a, big, c))


def test_queue_bound_counts_beyond_free_places(make):
    sched, batch = make(max_running=2, queue_size=1)

    async def main():
        batch.gate.clear()
        jobs = [job(3) for _ in range(3)]
        for j in jobs:  # two places free and one queue slot
            sched.submit(j)
        with pytest.raises(QueueFull):
            sched.submit(job(3))
        batch.gate.set()
        await asyncio.gather(*(collect(j) for j in jobs))

    run(main())


def test_cancelling_a_running_job_ends_it_alone(make):
    sched, batch = make(max_running=2)
    batch.delay = 0.01  # a's 40 steps outlast b's 6 by far

    async def main():
        a, b = job(40), job(6)
        sched.submit(a)
        sched.submit(b)
        ta = asyncio.ensure_future(collect(a))
        res_b = await collect(b)
        sched.cancel(a)
        return a, b, await ta, res_b

    a, b, res_a, res_b = run(main())
    assert a.outcome == "cancelled" and b.outcome == "success"
    assert res_a[-2][1].finish_reason == "cancelled" and len(res_a) < 40
    assert sched.busy == (0, 0)


def test_flush_waits_for_what_was_posted_and_the_tasks_it_woke():
    """``flush``: back only once the loop has run what was posted before it and the tasks
    that woke (a handler taking 50 ms included); a stuck loop costs its timeout."""
    from lily.server.serving import flush

    loop = asyncio.new_event_loop()
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    try:
        seen: list = []
        q: asyncio.Queue = asyncio.Queue()
        started = threading.Event()

        async def handler():
            started.set()
            while True:
                x = await q.get()
                time.sleep(0.05)  # (a handler's work, the loop held)
                seen.append(x)

        task = asyncio.run_coroutine_threadsafe(handler(), loop)
        assert started.wait(5)
        time.sleep(0.05)  # the handler waits on the queue
        loop.call_soon_threadsafe(q.put_nowait, 1)  # as Job.post does
        assert flush(loop, 5.0)
        assert seen == [1]  # the woken handler ran before flush returned
        loop.call_soon_threadsafe(time.sleep, 0.5)  # a loop stuck for 0.5 s
        t0 = time.perf_counter()
        assert not flush(loop, 0.02)
        assert time.perf_counter() - t0 < 0.3
        task.cancel()
        time.sleep(0.6)  # (the stuck turn over, the handler's cancellation runs)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        t.join(5)
        loop.close()
    assert flush(loop, 0.02)  # a closed loop: nothing to wait for


def test_the_early_delivery_flushes_the_requests_loops(monkeypatch):
    """The batch's early delivery (before a prefill chunk) posts each output and then waits
    for each of the requests' event loops, once a loop; the end-of-step delivery does not
    wait."""
    from lily.server import serving

    calls = []
    monkeypatch.setattr(serving, "flush", lambda loop, timeout: calls.append((loop, timeout)))
    loop = asyncio.new_event_loop()
    try:
        engine = type("E", (), {"batch": FakeBatch()})()
        sched = Scheduler(engine, Metrics("t"), 8, 4)
        jobs = [job(3), job(3)]
        for j in jobs:
            j.loop = loop
        outs = [(FakeSeq(3, lambda: False, j), StepOutput(7, "x")) for j in jobs]
        sched._deliver_now(outs)
        assert calls == [(loop, serving.FLUSH_S)]
        loop.run_until_complete(asyncio.sleep(0))  # the posts run on the loop
        assert [j.out.get_nowait()[0] for j in jobs] == ["step", "step"]
        calls.clear()
        sched._deliver(outs)
        assert calls == []
    finally:
        loop.close()
