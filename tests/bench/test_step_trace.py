"""The gap trace (lily/bench/step_trace.py) against hand-made engines and streams."""

from __future__ import annotations

import gc
import threading
import time

import pytest

from lily.bench.serve_clients import Stream
from lily.bench.serve_load import gap_trace, markdown
from lily.bench.step_trace import StepTrace


class _Batch:
    def __init__(self):
        self.calls = 0

    def step(self):
        self.calls += 1
        time.sleep(0.02)  # waiting, not computing: CPU time well under wall time
        return ["out"]


class _Runner:
    def recv_rows(self, sent):
        return [sent]


class _Engine:
    def __init__(self):
        self.batch, self.runner = _Batch(), _Runner()

    def prefill_chunk(self, state, prompt, pos, end, cuts):
        return end - pos


def test_the_trace_records_each_call_with_its_wall_and_cpu_time_then_lets_go():
    e = _Engine()
    with StepTrace(e) as tr:
        t0 = time.perf_counter()
        assert e.batch.step() == ["out"]  # the wrapped call returns what the method does
        assert e.prefill_chunk(None, [1] * 9, 2, 7, []) == 5
        assert e.runner.recv_rows(3) == [3]
        t1 = time.perf_counter()
    assert [x["what"] for x in tr.events] == ["_Batch.step", "_Engine.prefill_chunk",
                                              "_Runner.recv_rows"]  # fmt: skip
    step = tr.events[0]
    assert t0 <= step["start"] < step["end"] <= t1
    assert step["end"] - step["start"] >= 0.02 and step["cpu"] < 0.015
    assert step["thread"] == threading.current_thread().name
    # closed: the methods are the classes' own again, nothing more is recorded
    assert "step" not in vars(e.batch) and "prefill_chunk" not in vars(e)
    e.batch.step()
    assert len(tr.events) == 3 and e.batch.calls == 2


def test_the_trace_records_a_collection_and_stops_with_close():
    tr = StepTrace(_Engine())
    gc.collect()
    tr.close()
    # (a young collection may also fall in the window; the full one is ours)
    full = [x for x in tr.events if x["what"] == "gc generation 2"]
    assert len(full) == 1 and full[0]["cpu"] is None and full[0]["end"] >= full[0]["start"]
    gc.collect()
    assert len([x for x in tr.events if x["what"] == "gc generation 2"]) == 1


def test_during_keeps_the_overlapping_events_in_milliseconds_from_the_origin():
    tr = StepTrace(_Engine())
    tr.close()
    tr._add("a", 10.0, 10.5, 0.1)
    tr._add("b", 9.0, 10.01, 0.0)  # ends inside the span
    tr._add("c", 11.2, 11.3, 0.0)  # after it
    tr._add("d", 8.0, 8.5, None)  # before it
    got = tr.during(10.0, 11.0, origin=9.5)
    assert [x["what"] for x in got] == ["b", "a"]
    assert got[1] == {"what": "a", "thread": threading.current_thread().name,
                      "start_ms": 500.0, "ms": 500.0, "cpu_ms": 100.0}  # fmt: skip
    assert got[0]["start_ms"] == pytest.approx(-500.0)


def test_gap_trace_places_the_longest_gap_of_any_stream():
    tr = StepTrace(_Engine())
    tr.close()
    tr._add("Batch.step", 1.05, 1.16, 0.002)
    a = Stream(sent=0.0, chunks=[1.01, 1.02, 1.03, 1.2, 1.21])  # 170 ms from 1.03
    b = Stream(sent=0.0, chunks=[1.01, 1.1, 1.19])
    assert a.longest_gap(1.0, 1.25) == pytest.approx((1.03, 1.2))
    assert a.longest_gap(1.0, 1.0) == (1.0, 1.0) and a.max_gap(1.0, 1.0) == 0.0
    g = gap_trace(tr, [b, a], 1.0, 1.25)
    assert g["gap_start_ms"] == pytest.approx(30.0) and g["gap_ms"] == pytest.approx(170.0)
    assert g["first_token_ms"] == pytest.approx(250.0)
    assert [x["what"] for x in g["events"]] == ["Batch.step"]
    assert g["events"][0]["start_ms"] == pytest.approx(50.0)
    # the Markdown names the event inside the gap
    res = {"rounds": [], "ttft": {"prompt_tokens": 64, "busy_streams": 2, "idle_ttft_median_s": 0.1,
                                  "busy_ttft_s": 0.25, "ratio": 2.5,
                                  "max_gap_during_prefill_s": 0.17,
                                  "busy_rate_during_prefill_tok_s": 12.0, "errors": [],
                                  "gap_trace": g}}  # fmt: skip
    md = markdown(res, {})
    assert "The longest gap: 170.0 ms from 30.0 ms" in md
    assert "| Batch.step | " in md and "| 50.0 | 110.0 | 2.0 |" in md
