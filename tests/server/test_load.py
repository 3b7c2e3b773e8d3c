"""Load: 16 concurrent clients send 500 mixed requests to one live server.

The mix: chat and completions, streamed and not, short and ~600-token prompts, thinking on
and off, forced tool calls (tool_choice required), stop strings, and requests that make the
engine fault (tests/server/launch.py --fault-seed). Every request must end, within its own
timeout, either complete and well-formed or with a clean OpenAI error; /metrics must
account for exactly what the clients saw; the server's resident memory must come back to
its warmed-up baseline.
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from tests.server.conftest import ROOT, Server
from tests.server.helpers import metrics, sse_events, wait_for

N_REQUESTS = int(os.environ.get("LILY_LOAD_REQUESTS", "500"))
CLIENTS = 16
MAX_RUNNING = 8
FAULT_SEED = 666
TIMEOUT = 120.0  # per request: 15 others may be ahead of it on a busy 2-core host
# Memory tolerance (see test_memory_returns_to_baseline): allocator arenas and caches that
# grow once under concurrency, not per request.
RSS_SLACK = 64 << 20
RSS_SLACK_SECOND_HALF = 24 << 20

WORDS = ("the quick brown fox jumps over lazy dog weather engine reads weights once per "
         "token tool call paris city alarm hour day").split()  # fmt: skip
LONG_SYSTEM = " ".join(WORDS[i % len(WORDS)] for i in range(180))  # ~580 tokens
PING = {"type": "function", "function": {"name": "ping", "description": "Check a host",
        "parameters": {"type": "object", "properties": {"ok": {"type": "boolean"}},
                       "required": ["ok"]}}}  # fmt: skip
NO_THINK = {"enable_thinking": False}


@dataclass
class Outcome:
    kind: str
    stream: bool
    status: int = 0
    ok: bool = False  # a complete, well-formed answer
    fault: bool = False  # a clean engine-error answer
    usage: dict[str, Any] = field(default_factory=dict)
    finish: str | None = None
    problem: str = ""


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def make_request(rng: random.Random) -> tuple[str, str, dict[str, Any]]:
    """(kind, path, body) of one request of the mix."""
    kind = rng.choices(["short", "long", "tool", "completion", "fault"], [44, 16, 8, 24, 8])[0]
    stream = rng.random() < 0.5
    body: dict[str, Any] = {"stream": stream, "seed": rng.randrange(FAULT_SEED)}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if kind == "completion":
        body.update(prompt=_text(rng, rng.randint(3, 40)), max_tokens=rng.randint(1, 4))
        return kind, "/v1/completions", body
    user = {"role": "user", "content": _text(rng, rng.randint(2, 30))}
    body["messages"] = [user]
    body["max_tokens"] = rng.randint(1, 4)
    body["chat_template_kwargs"] = {"enable_thinking": rng.random() < 0.5}
    if kind == "long":
        body["messages"] = [{"role": "system", "content": LONG_SYSTEM}, user]
    elif kind == "tool":
        body.update(tools=[PING], tool_choice="required", max_tokens=64,
                    chat_template_kwargs=NO_THINK)  # fmt: skip
    elif kind == "fault":
        body.update(seed=FAULT_SEED, max_tokens=8, ignore_eos=True)
    if kind in ("short", "long") and rng.random() < 0.2:
        body["stop"] = [rng.choice(WORDS), "\n\n"]
    return kind, "/v1/chat/completions", body


def _check_choice(kind: str, choice: dict[str, Any], usage: dict[str, Any], body: dict) -> str:
    fr = choice.get("finish_reason")
    if kind == "tool":
        # The grammar forces one call and allows more; a random model may chain calls
        # until max_tokens cuts it: then finish_reason is "length" with every token used,
        # and the last call's arguments are as far as generated (not JSON).
        calls = (choice.get("message") or {}).get("tool_calls") or []
        cut = fr == "length" and usage.get("completion_tokens") == body["max_tokens"]
        if not cut and (fr != "tool_calls" or not calls):
            return f"forced tool call missing: finish_reason={fr}"
        for c in calls[:-1] if cut else calls:
            if c["function"]["name"] != "ping" or not isinstance(
                json.loads(c["function"]["arguments"]).get("ok"), bool
            ):
                return f"bad tool call {c}"
    elif fr not in ("stop", "length"):
        return f"finish_reason {fr!r}"
    return ""


def _check_usage(usage: dict[str, Any], body: dict[str, Any]) -> str:
    if not usage or usage["completion_tokens"] > body["max_tokens"]:
        return f"usage {usage} for max_tokens {body['max_tokens']}"
    if usage["total_tokens"] != usage["prompt_tokens"] + usage["completion_tokens"]:
        return f"usage totals {usage}"
    return ""


def run_one(http: httpx.Client, kind: str, path: str, body: dict[str, Any]) -> Outcome:
    out = Outcome(kind, body["stream"])
    try:
        return _run_one(http, out, path, body)
    except (KeyError, IndexError, TypeError, ValueError) as e:  # a malformed answer
        out.ok, out.problem = False, f"malformed answer: {type(e).__name__}: {e}"
        return out


def _run_one(http: httpx.Client, out: Outcome, path: str, body: dict[str, Any]) -> Outcome:
    kind = out.kind
    try:
        if body["stream"]:
            with http.stream("POST", path, json=body) as r:
                out.status = r.status_code
                text = r.read().decode()
        else:
            r = http.post(path, json=body)
            out.status, text = r.status_code, r.text
    except httpx.HTTPError as e:  # a timeout here is a hung request
        out.problem = f"{type(e).__name__}: {e}"
        return out
    if out.status != 200:
        err = json.loads(text).get("error", {})
        out.fault = (kind == "fault" and out.status == 500 and "injected" in err["message"]
                     and set(err) == {"message", "type", "param", "code"})  # fmt: skip
        out.problem = "" if out.fault else f"status {out.status}: {text[:300]}"
        return out
    if not body["stream"]:
        obj = json.loads(text)
        out.usage = obj["usage"]
        out.finish = obj["choices"][0]["finish_reason"]
        out.problem = _check_choice(kind, obj["choices"][0], out.usage, body) or _check_usage(
            out.usage, body
        )
        out.ok = not out.problem
        return out
    events = sse_events(text)
    if events[-1] != "[DONE]":
        out.problem = "stream did not end with [DONE]"
        return out
    if kind == "fault":
        out.fault = "error" in events[-2] and "injected" in events[-2]["error"]["message"]
        out.problem = "" if out.fault else f"fault stream: {events[-3:]}"
        return out
    chunks = events[:-1]
    if any("choices" not in c for c in chunks):
        out.problem = f"error in stream: {[c for c in chunks if 'choices' not in c][:1]}"
        return out
    finals = [c for c in chunks if c["choices"] and c["choices"][0].get("finish_reason")]
    if len(finals) != 1 or chunks[-1]["choices"] or "usage" not in chunks[-1]:
        out.problem = f"stream shape: {len(finals)} finish chunks, last {chunks[-1]}"
        return out
    out.usage = chunks[-1]["usage"]
    choice = dict(finals[0]["choices"][0])
    out.finish = choice["finish_reason"]
    if kind == "tool":  # join the streamed calls as a client does
        calls: dict[int, dict[str, str]] = {}
        for c in chunks:
            for tc in (
                (c["choices"][0].get("delta", {}).get("tool_calls") or []) if c["choices"] else []
            ):
                d = calls.setdefault(tc["index"], {"name": "", "arguments": ""})
                d["name"] += tc.get("function", {}).get("name") or ""
                d["arguments"] += tc.get("function", {}).get("arguments") or ""
        choice["message"] = {"tool_calls": [{"function": v} for v in calls.values()]}
    out.problem = _check_choice(kind, choice, out.usage, body) or _check_usage(out.usage, body)
    out.ok = not out.problem
    return out


def run_batch(url: str, requests: list[tuple[str, str, dict[str, Any]]]) -> list[Outcome]:
    """Send ``requests`` from CLIENTS threads, each with its own keep-alive connection."""
    todo = list(reversed(requests))
    lock = threading.Lock()
    results: list[Outcome] = []

    def client() -> None:
        with httpx.Client(base_url=url, timeout=TIMEOUT) as http:
            while True:
                with lock:
                    if not todo:
                        return
                    kind, path, body = todo.pop()
                o = run_one(http, kind, path, body)
                with lock:
                    results.append(o)

    with ThreadPoolExecutor(CLIENTS) as pool:
        for f in [pool.submit(client) for _ in range(CLIENTS)]:
            f.result()
    return results


class Monitor(threading.Thread):
    """Samples the queue gauges while the load runs."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.samples: list[tuple[float, float]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=30) as c:
            while not self.stop.is_set():
                m = metrics(c)
                self.samples.append((m["num_requests_running"], m["num_requests_waiting"]))
                time.sleep(0.1)


@pytest.fixture(scope="module")
def load_server(model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "load.log"
    argv = [str(ROOT / "tests/server/launch.py"), "--fault-seed", str(FAULT_SEED),
            "--prefix-cache-mb", "16", "serve", "--model", str(model_dir),
            "--max-context", "1024", "--queue-size", "64", "--keepalive", "2",
            "--max-running", str(MAX_RUNNING)]  # fmt: skip
    s = Server(argv, log)
    try:
        s.health_history()
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def load_run(load_server):
    """Warm up, then run the load in two halves, recording metrics and RSS around them."""
    url = load_server.url
    rng = random.Random(20240611)
    run_batch(url, [make_request(rng) for _ in range(64)])  # every path, under concurrency
    with httpx.Client(base_url=url, timeout=30) as c:
        wait_for(lambda: metrics(c)["num_requests_running"] == 0)
        before = metrics(c)
    rss = {"baseline": load_server.rss()}
    requests = [make_request(rng) for _ in range(N_REQUESTS)]
    monitor = Monitor(url)
    monitor.start()
    t0 = time.monotonic()
    half = N_REQUESTS // 2
    results = run_batch(url, requests[:half])
    rss["half"] = load_server.rss()
    results += run_batch(url, requests[half:])
    elapsed = time.monotonic() - t0
    monitor.stop.set()
    monitor.join()
    rss["end"] = load_server.rss()
    with httpx.Client(base_url=url, timeout=30) as c:
        after = metrics(c)
    print(f"\nload: {len(results)} requests in {elapsed:.1f}s; "
          f"kinds {Counter(o.kind for o in results)}; RSS MiB "
          f"{ {k: round(v / 2**20, 1) for k, v in rss.items()} }")  # fmt: skip
    return {"results": results, "before": before, "after": after, "rss": rss,
            "samples": monitor.samples, "server": load_server}  # fmt: skip


def test_every_request_is_answered_completely_or_cleanly(load_run):
    results = load_run["results"]
    assert len(results) == N_REQUESTS
    problems = [(o.kind, o.stream, o.problem) for o in results if o.problem]
    assert not problems, problems[:10]
    faults = [o for o in results if o.kind == "fault"]
    assert faults and all(o.fault for o in faults)  # each fault failed alone, cleanly
    assert all(o.ok for o in results if o.kind != "fault")
    tool = [o for o in results if o.kind == "tool"]
    assert sum(o.finish == "tool_calls" for o in tool) >= len(tool) // 2  # mostly finished
    kinds = Counter((o.kind, o.stream) for o in results)
    assert all(kinds[(k, s)] > 0 for k in ("short", "long", "tool", "completion", "fault")
               for s in (False, True)), kinds  # fmt: skip
    assert load_run["server"].alive()


def test_metrics_match_what_the_clients_saw(load_run):
    results, b, a = load_run["results"], load_run["before"], load_run["after"]

    def delta(name: str) -> float:
        return a[name] - b[name]

    ok = [o for o in results if o.ok]
    n_fault = sum(o.fault for o in results)
    assert delta("request_success_total") == len(ok)
    assert delta("request_failure_total") == n_fault
    assert delta("request_cancelled_total") == 0 and delta("request_rejected_total") == 0
    assert delta("prompt_tokens_total") == sum(o.usage["prompt_tokens"] for o in ok)
    assert delta("generation_tokens_total") == sum(o.usage["completion_tokens"] for o in ok)
    cached = sum(o.usage["prompt_tokens_details"]["cached_tokens"] for o in ok)
    assert delta("prefix_cache_hits_total") == cached > 0
    assert delta("e2e_request_latency_seconds_count") == len(ok)
    # Every request, faulted ones included, produced a first token before it ended.
    assert delta("time_to_first_token_seconds_count") == len(ok) + n_fault
    assert a["num_requests_running"] == 0 and a["num_requests_waiting"] == 0


def test_queue_gauges_stay_within_bounds(load_run):
    samples = load_run["samples"]
    assert len(samples) > 10
    assert all(0 <= r <= MAX_RUNNING for r, _ in samples)  # up to --max-running compute
    assert max(r for r, _ in samples) >= 2  # together
    # The others wait (at most all of them, in the instant between two requests).
    assert all(0 <= w and r + w <= CLIENTS for r, w in samples), max(samples, key=sum)
    assert max(w for _, w in samples) >= 2  # the load did queue


def test_memory_returns_to_baseline(load_run):
    # Baseline is taken after two warm-up rounds of the same mix, so one-off growth
    # (torch and llguidance caches, glibc arenas for 16 connection threads, the prefix
    # cache filling its 16 MiB budget) is already in it. What is left to see is growth
    # per request: 500 requests leaking even 128 KiB each would add 62 MiB. The slack
    # covers allocator fragmentation; the second half, run on a warm heap, gets less.
    rss = load_run["rss"]
    assert rss["end"] - rss["baseline"] <= RSS_SLACK, rss
    assert rss["end"] - rss["half"] <= RSS_SLACK_SECOND_HALF, rss
