"""Scheduling on a live server whose engine steps are slowed to 0.15 s (tests/server/launch.py):
loading, cancellation on disconnect, the bounded queue, keep-alives, engine faults."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.server.conftest import SLOW_CONTEXT

MSGS = [{"role": "user", "content": "hi"}]
DELAY = 0.15


def metric(client: httpx.Client, name: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("lily:" + name + "{") or line.startswith("lily:" + name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def wait_for(pred, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


@pytest.fixture
def slow(slow_server):
    with httpx.Client(base_url=slow_server.url, timeout=60) as c:
        wait_for(lambda: metric(c, "num_requests_running") == 0)
        yield c


def test_health_is_503_while_loading(slow_server):
    assert slow_server.seen_while_loading[0] == 503 and slow_server.seen_while_loading[-1] == 200


def test_disconnect_frees_the_engine_within_a_step(slow):
    gen0 = metric(slow, "generation_tokens_total")
    body = {"messages": MSGS, "max_tokens": 60, "ignore_eos": True, "stream": True}
    with slow.stream("POST", "/v1/chat/completions", json=body) as r:
        n = 0
        for line in r.iter_lines():
            if line.startswith("data: "):
                n += 1
            if n == 4:
                break  # leave after the role chunk and three tokens
    t0 = time.monotonic()
    wait_for(lambda: metric(slow, "num_requests_running") == 0, timeout=10)
    freed = time.monotonic() - t0
    assert freed < 1.0 + 2 * DELAY
    # The next request is served at once, and the first stopped far short of 60 tokens.
    r = slow.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 1})
    assert r.status_code == 200
    assert metric(slow, "generation_tokens_total") - gen0 < 15


def test_non_stream_client_leaving_cancels(slow):
    gen0 = metric(slow, "generation_tokens_total")
    body = {"messages": MSGS, "max_tokens": 60, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        slow.post("/v1/chat/completions", json=body, timeout=1.0)
    wait_for(lambda: metric(slow, "num_requests_running") == 0, timeout=1.0 + 2 * DELAY)
    assert metric(slow, "generation_tokens_total") - gen0 < 20


def test_full_queue_gives_429_with_retry_after(slow):
    # Long enough to still run when the third request comes; closed (so cancelled) after.
    body = {"messages": MSGS, "max_tokens": 70, "ignore_eos": True, "stream": True}
    results = {}

    def waiter() -> None:
        r = httpx.post(slow.base_url.join("/v1/chat/completions"), timeout=60,
                       json={"messages": MSGS, "max_tokens": 1})  # fmt: skip
        results["waiter"] = r.status_code

    with slow.stream("POST", "/v1/chat/completions", json=body) as running:
        lines = running.iter_lines()
        assert next(lines).startswith("data: ")  # running now
        t = threading.Thread(target=waiter)
        t.start()
        wait_for(lambda: metric(slow, "num_requests_waiting") == 1)
        r = slow.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 1})
        assert r.status_code == 429
        assert int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["code"] == "queue_full"
    t.join(timeout=60)
    assert results["waiter"] == 200  # the queued request ran once the stream went away


def test_keepalive_comments_while_queued(slow):
    body = {"messages": MSGS, "max_tokens": 30, "ignore_eos": True, "stream": True}
    first = slow.send(slow.build_request("POST", "/v1/chat/completions", json=body), stream=True)
    try:
        # NOTE: keep the iterator: a dropped one closes the connection, which (rightly)
        # cancels the first request, and the second would no longer wait.
        lines = first.iter_lines()
        next(lines)
        with slow.stream("POST", "/v1/chat/completions", json={**body, "max_tokens": 1}) as r:
            raw = r.read().decode()
    finally:
        first.close()
    before_data = raw.split("data: ")[1:3]  # after the role chunk, before the first token
    assert ": keep-alive" in before_data[0], raw
    assert raw.rstrip().endswith("data: [DONE]")


def test_engine_fault_is_500_and_server_keeps_serving(slow):
    r = slow.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 8, "seed": 666})
    assert r.status_code == 500
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and "injected" in err["message"]
    # Streaming: headers are out, so the error comes as an event, then [DONE].
    body = {"messages": MSGS, "max_tokens": 8, "seed": 666, "stream": True}
    with slow.stream("POST", "/v1/chat/completions", json=body) as s:
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and "error" in json.loads(events[-2])
    ok = slow.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 2})
    assert ok.status_code == 200 and slow.get("/health").status_code == 200


def test_unset_max_tokens_means_rest_of_context(slow):
    ids = list(range(10, 10 + SLOW_CONTEXT - 3))
    r = slow.post("/v1/completions", json={"prompt": ids, "ignore_eos": True})
    assert r.status_code == 200
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] == SLOW_CONTEXT - 3
    assert usage["completion_tokens"] == 3
    assert r.json()["choices"][0]["finish_reason"] == "length"


def test_server_default_template_kwargs_and_request_override(slow):
    body = {"messages": MSGS, "max_tokens": 3, "ignore_eos": True, "seed": 1}
    off = slow.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert off["content"] and "reasoning_content" not in off  # server default: no thinking
    on = {**body, "chat_template_kwargs": {"enable_thinking": True}}
    msg = slow.post("/v1/chat/completions", json=on).json()["choices"][0]["message"]
    assert msg["content"] is None and msg["reasoning_content"] == msg["reasoning"] != ""


def test_cors_is_off_without_origins(slow):
    r = slow.options("/v1/models", headers={"Origin": "http://a.test",
                                            "Access-Control-Request-Method": "GET"})  # fmt: skip
    assert "access-control-allow-origin" not in r.headers
