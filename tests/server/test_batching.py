"""Requests computed together on a live server (--max-running 8): a stress run of 16
clients with prompts of mixed lengths, seeded sampling and greedy decoding, clients that
go away mid-stream and conversations continued turn after turn. No 5xx, every answer
equal to the same request run alone (the engine's single-sequence path, in this process),
the gauges back to zero and the server's memory back to its baseline.
"""

from __future__ import annotations

import random
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.server.conftest import KEYS, MAX_CONTEXT, main_server
from tests.server.helpers import metrics, sse_events, wait_for

CLIENTS = 16
MAX_RUNNING = 8
CONTEXT = MAX_CONTEXT
AUTH = {"Authorization": f"Bearer {KEYS[0]}"}
ROUNDS = 3  # requests per client (a conversation's turns, or independent ones)
RSS_SLACK = 48 << 20


@pytest.fixture(scope="module")
def batch_server(model_dir, tmp_path_factory):
    """The main server's settings, requests together (and prompts interleaved in chunks
    of 32 tokens)."""
    log = tmp_path_factory.mktemp("logs") / "batching.log"
    yield from main_server(model_dir, log, "--device", "cpu", "--max-running", str(MAX_RUNNING),
                           "--decode-prefill-chunk", "32", "--queue-size", "64")  # fmt: skip


@pytest.fixture(scope="module")
def alone(model_dir):
    """The same requests run alone: ``alone(ids, **sampling)`` -> text."""
    from lily.config import EngineConfig
    from lily.runtime.engine import Engine
    from lily.runtime.sampling import SamplingParams

    engine = Engine.load(model_dir, EngineConfig(max_context=CONTEXT, prefix_cache_gb=0),
                         progress=False)  # fmt: skip
    lock = threading.Lock()

    # What the server fills in from generation_config.json where a request says nothing.
    named = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
    defaults = {k: v for k, v in engine.generation_defaults.items() if k in named}

    def run(ids: list[int], **kw) -> tuple[str, list[int]]:
        kw = {**defaults, **kw}
        with lock:
            steps = list(engine.generate(ids, SamplingParams(**kw)))
        return "".join(s.text for s in steps), [s.token_id for s in steps if s.token_id is not None]

    return run


def body(ids: list[int], rng: random.Random) -> dict:
    kw = {"max_tokens": rng.choice([4, 12, 30]), "ignore_eos": True}
    if rng.random() < 0.5:
        kw |= {"temperature": 0.0}
    else:
        kw |= {"temperature": 0.8, "top_p": 0.9, "seed": rng.randrange(1000)}
    return {"prompt": ids, **kw}


def stream_text(c: httpx.Client, b: dict, leave_after: int | None = None) -> tuple[int, str]:
    """Stream a completion; with ``leave_after`` chunks, go away then (a cancel)."""
    text, n = "", 0
    with c.stream("POST", "/v1/completions", json={**b, "stream": True}) as r:
        if r.status_code != 200:
            return r.status_code, r.read().decode()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = sse_events(line + "\n\n")[0]
            assert "error" not in ev, ev
            text += ev["choices"][0]["text"]
            n += 1
            if leave_after is not None and n >= leave_after:
                return 200, text
    return 200, text


def client_plan(seed: int, alone, rounds: int = ROUNDS) -> list[tuple]:
    """One client's requests and what each must answer (the same request run alone), made
    before any is sent: the references run one at a time in this process, and made between
    a client's requests they throttled how many reached the server at once."""
    rng = random.Random(seed)
    ids = [rng.randrange(3, 500) for _ in range(rng.choice([3, 20, 150, 400]))]
    plan = []
    for turn in range(rounds):
        b = body(ids, rng)
        sampling = {k: v for k, v in b.items() if k != "prompt"}
        want, toks = alone(ids, **sampling)
        kind = rng.random()
        plan.append((turn, b, want, kind))
        if kind < 0.2:  # a client that goes away mid-stream: the next request repeats it
            continue
        # the next turn continues this conversation: its answer and a new message
        ids = ids + toks + [rng.randrange(3, 500) for _ in range(rng.choice([2, 30]))]
    return plan


def client_run(url: str, plan: list[tuple]) -> list[str]:
    """One client's requests (``client_plan``); the problems seen (empty: all good)."""
    problems = []
    with httpx.Client(base_url=url, timeout=120, headers=AUTH) as c:
        continued = False  # this request continues the previous answer
        for turn, b, want, kind in plan:
            if kind < 0.2:  # a client that goes away mid-stream
                status, text = stream_text(c, b, leave_after=2)
                if status != 200 or not want.startswith(text):
                    problems.append(f"cancelled stream {status}: {text!r} vs {want!r}")
                continued = False  # the next request repeats this prompt
                continue
            if kind < 0.6:
                status, text = stream_text(c, b)
            else:
                r = c.post("/v1/completions", json=b)
                status = r.status_code
                text = r.json()["choices"][0]["text"] if status == 200 else r.text
                usage = r.json()["usage"] if status == 200 else {}
                if continued and usage.get("prompt_tokens_details", {}).get("cached_tokens") == 0:
                    problems.append("a continued conversation reused nothing")
            if status != 200 or text != want:
                problems.append(f"turn {turn}: {status}: {text!r} != {want!r}")
            continued = True
    return problems


def run_clients(url: str, alone, base_seed: int, rounds: int = ROUNDS) -> list[str]:
    plans = [client_plan(base_seed + i, alone, rounds) for i in range(CLIENTS)]
    with ThreadPoolExecutor(CLIENTS) as pool:
        futures = [pool.submit(client_run, url, plan) for plan in plans]
        return [p for f in futures for p in f.result()]


def test_sixteen_clients_mixed_cancelled_and_continued(batch_server, alone):
    url = batch_server.url
    running = []
    stop = threading.Event()

    def watch() -> None:
        with httpx.Client(base_url=url, timeout=30, headers=AUTH) as c:
            while not stop.is_set():
                running.append(metrics(c)["num_requests_running"])

    # warm-up: every path, under concurrency (allocator arenas, the working states)
    assert run_clients(url, alone, 100, rounds=1) == []
    with httpx.Client(base_url=url, timeout=30, headers=AUTH) as c:
        wait_for(lambda: metrics(c)["num_requests_running"] == 0, what="idle")
        before = metrics(c)
    baseline = batch_server.rss()
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        problems = run_clients(url, alone, 200)
    finally:
        stop.set()
        watcher.join()
    assert problems == []
    with httpx.Client(base_url=url, timeout=30, headers=AUTH) as c:
        wait_for(lambda: metrics(c)["num_requests_running"] == 0, what="idle")
        after = metrics(c)
    assert after["num_requests_waiting"] == 0
    assert after["request_failure_total"] == before["request_failure_total"]
    assert max(running) >= 4 and max(running) <= MAX_RUNNING  # really together, within bound
    done = sum(after[k] - before[k] for k in ("request_success_total", "request_cancelled_total"))
    assert done == CLIENTS * ROUNDS
    assert batch_server.rss() - baseline <= RSS_SLACK
    assert batch_server.alive()
