"""Hostile input on a live server: every one is a 4xx with an OpenAI-shaped error, never a
5xx, a hang or a crash, and the server serves the next request.

Hand-written nasties first (bodies that are not JSON or not strict JSON, oversized, deeply
nested, NaN temperatures, a million stop strings, images), then a fuzz of bodies generated
from the server's own OpenAPI schema (schema_fuzz.py), mostly valid, so they get past the
schema into the handlers and the engine.
"""

from __future__ import annotations

import json
import os
import socket

import httpx
import pytest
from hypothesis import HealthCheck, given, settings

from tests.server.conftest import GUARD_BODY_LIMIT, GUARD_PROMPT_LIMIT, KEYS
from tests.server.helpers import assert_openai_error, metrics, sse_events
from tests.server.schema_fuzz import request_bodies

MSGS = [{"role": "user", "content": "hi"}]
CHAT = "/v1/chat/completions"
# CI runs a fixed 100 per route; set more for a deeper, randomized run.
FUZZ_EXAMPLES = int(os.environ.get("LILY_FUZZ_EXAMPLES", "100"))


def post_raw(c: httpx.Client, body: bytes, path: str = CHAT, **headers: str) -> httpx.Response:
    return c.post(path, content=body, headers={"Content-Type": "application/json", **headers})


@pytest.mark.parametrize(
    "raw,says",
    [
        (b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', "UTF-8"),
        (b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "surrogate"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', "NaN"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": Infinity}',
         "Infinity"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "top_p": -Infinity}', "Infinity"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": 1e999}', "range"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "seed": ' + b"9" * 5000 + b"}",
         "JSON"),
        (b"", "JSON"),
        (b"[]", ""),
        (b'"messages"', ""),
        (b"null", ""),
        (b'{"messages": [{"role": "user", "content": "hi"}]', "JSON"),
        (b'{"messages": ' + b"[" * 100 + b"]" * 100 + b"}", "nested"),
        (b"[" * 30000 + b"]" * 30000, "nested"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": '
         + b'{"a":' * 80 + b"1" + b"}" * 80 + b"}", "nested"),
    ],
)  # fmt: skip
def test_bodies_that_are_not_strict_json_are_400(guarded, raw, says):
    err = assert_openai_error(post_raw(guarded, raw), 400)
    assert says in err["message"], err


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 10**30}, "max_tokens"),
        ({"max_tokens": 2**63}, "max_tokens"),
        ({"max_tokens": "5x"}, "max_tokens"),
        ({"max_tokens": 5.5}, "max_tokens"),
        ({"max_completion_tokens": -(2**40)}, "max_completion_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": 1e300}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"stop": ["x"] * 17}, "stop"),
        ({"stop": "y" * 5000}, "stop"),
        ({"stop_token_ids": list(range(1000))}, "stop_token_ids"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": [10**9]}, "stop_token_ids"),
        ({"top_k": -5}, "top_k"),
        ({"repetition_penalty": 2.3e-116}, "repetition_penalty"),  # found by the fuzz
        ({"seed": 2**80}, "seed"),
        ({"logprobs": True, "top_logprobs": 10**6}, "top_logprobs"),
        ({"messages": []}, "messages"),
        ({"messages": None}, "messages"),
        ({"messages": [{}]}, "messages.0.role"),
        ({"messages": [{"role": "root", "content": "x"}]}, "messages.0.role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, None),
    ],
)  # fmt: skip
def test_out_of_range_and_malformed_fields_are_400(guarded, extra, param):
    r = guarded.post(CHAT, json={"messages": MSGS, **extra})
    err = assert_openai_error(r, 400)
    if param is not None:
        assert err["param"] == param or (err["param"] or "").startswith(param), err


@pytest.mark.parametrize(
    "part",
    [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
        {"type": "image_url", "image_url": {"url": "file:///etc/passwd"}},
        {"type": "input_image", "image_url": "https://example.com/cat.png"},
        {"type": "image", "source": {"type": "base64", "data": "AAAA"}},
    ],
)
def test_image_parts_are_a_clear_400(guarded, part):
    msgs = [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, part]}]
    err = assert_openai_error(guarded.post(CHAT, json={"messages": msgs}), 400)
    assert "image" in err["message"] and "not supported" in err["message"]
    assert err["param"] == "messages" and err["code"] == "unsupported_content"


def test_other_non_text_parts_are_400(guarded):
    msgs = [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]
    err = assert_openai_error(guarded.post(CHAT, json={"messages": msgs}), 400)
    assert "input_audio" in err["message"]


def test_body_over_the_limit_is_413(guarded, guarded_server):
    big = {"messages": [{"role": "user", "content": "x" * GUARD_BODY_LIMIT}]}
    err = assert_openai_error(guarded.post(CHAT, json=big), 413)
    assert err["code"] == "request_too_large" and str(GUARD_BODY_LIMIT) in err["message"]

    def chunks():  # no Content-Length: the limit holds for a chunked body too
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(GUARD_BODY_LIMIT // 1000 + 1):
            yield b"y" * 1000
        yield b'"}]}'

    r = guarded.post(CHAT, content=chunks(), headers={"Content-Type": "application/json"})
    assert assert_openai_error(r, 413)["code"] == "request_too_large"


def test_declared_huge_body_is_refused_before_it_is_sent(guarded_server):
    # A client announcing 10 GB gets its 413 at once: the server does not wait to read it.
    port = guarded_server.port
    head = (f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer env-key-1\r\n"
            "Content-Type: application/json\r\nContent-Length: 10000000000\r\n\r\n")  # fmt: skip
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(head.encode() + b'{"messages"')
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            chunk = s.recv(65536)
            if not chunk:
                break
            reply += chunk
    status = reply.split(b"\r\n", 1)[0]
    assert b" 413 " in status, reply[:200]
    body = json.loads(reply.split(b"\r\n\r\n", 1)[1])
    assert body["error"]["code"] == "request_too_large"


def test_a_million_stop_strings_are_400_not_a_stall(http):
    # The main server keeps the default 32 MiB body limit: the list arrives whole.
    body = {"messages": MSGS, "max_tokens": 1, "stop": ["a"] * 10**6}
    err = assert_openai_error(http.post(CHAT, json=body, timeout=60), 400)
    assert err["param"] == "stop" and "16" in err["message"]


def test_a_16m_character_message_is_400_at_once_and_health_answers(server, http):
    """Issue 19: the 400 came after 32 s at 3.4 GB, /health unanswered meanwhile. The
    prompt cannot fit the 1024-token window whatever it tokenizes to (no token covers more
    than the vocabulary's longest), so it is refused without tokenizing it, and nothing
    the request does holds the event loop for long."""
    import threading
    import time

    body = json.dumps({"messages": [{"role": "user", "content": "agent " * 2_666_666}]})
    assert len(body) > 16_000_000
    slowest, done = [0.0], threading.Event()

    def poll() -> None:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            while not done.is_set():
                t0 = time.monotonic()
                assert c.get("/health").status_code == 200
                slowest[0] = max(slowest[0], time.monotonic() - t0)
                time.sleep(0.02)

    t = threading.Thread(target=poll)
    t.start()
    try:
        t0 = time.monotonic()
        r = post_raw(http, body.encode())
        took = time.monotonic() - t0
    finally:
        done.set()
        t.join()
    err = assert_openai_error(r, 400)
    assert err["code"] == "context_length_exceeded" and err["param"] == "messages", err
    assert "at least" in err["message"], err
    assert took < 10, took
    assert slowest[0] < 1.5, slowest


def test_prompt_over_max_prompt_tokens_is_400(guarded):
    text = " ".join(["weather"] * 400)
    r = guarded.post(CHAT, json={"messages": [{"role": "user", "content": text}]})
    err = assert_openai_error(r, 400)
    assert err["code"] == "context_length_exceeded" and err["param"] == "messages"
    assert f"maximum prompt length is {GUARD_PROMPT_LIMIT} tokens" in err["message"]
    r = guarded.post("/v1/completions", json={"prompt": [11] * (GUARD_PROMPT_LIMIT + 1)})
    assert assert_openai_error(r, 400)["param"] == "prompt"
    ok = guarded.post("/v1/completions", json={"prompt": [11] * GUARD_PROMPT_LIMIT,
                                               "max_tokens": 1})  # fmt: skip
    assert ok.status_code == 200, ok.text


def test_odd_but_valid_input_is_served(guarded):
    weird = "nul\x00 bidi\u202e emoji \U0001f600 zero-width\u200b ' \" </think><tool_call>"
    for content in (weird, "", " "):
        r = guarded.post(CHAT, json={"messages": [{"role": "user", "content": content}],
                                     "max_tokens": 2, "user": "u", "store": True,
                                     "metadata": {"k": "v"}})  # fmt: skip
        assert r.status_code == 200, r.text


def test_wrong_method_and_unknown_routes_are_openai_shaped(guarded):
    assert_openai_error(guarded.get(CHAT), 405)
    assert_openai_error(guarded.get("/v1/../../etc/passwd"), 404)
    assert_openai_error(guarded.get("/docs"), 404)  # no docs page pulling CDN scripts


def test_server_survived(guarded_server, guarded):
    assert guarded_server.alive() and guarded.get("/health").status_code == 200
    r = guarded.post(CHAT, json={"messages": MSGS, "max_tokens": 1})
    assert r.status_code == 200
    assert metrics(guarded)["num_requests_running"] == 0


# ---- a fuzz from the OpenAPI schema
@pytest.fixture(scope="module")
def openapi(server):
    return httpx.get(server.url + "/openapi.json").json()


def _check_ok(path: str, body: dict, r: httpx.Response) -> None:
    if body.get("stream"):
        events = sse_events(r.text)
        assert events and events[-1] == "[DONE]", r.text[-300:]
        return
    obj = r.json()
    assert obj["object"] in ("chat.completion", "text_completion")
    choice = obj["choices"][0]
    assert choice["finish_reason"] in ("stop", "length", "tool_calls")
    assert obj["usage"]["completion_tokens"] <= 2


@pytest.mark.parametrize("path", [CHAT, "/v1/completions"])
def test_schema_fuzz_never_5xx(server, openapi, path):
    name = "ChatCompletionRequest" if path == CHAT else "CompletionRequest"
    seen = {"ok": 0, "4xx": 0}

    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=FUZZ_EXAMPLES == 100,
              database=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(body=request_bodies(openapi, name))
    def run(body):
        # Short generations keep the accepted ones cheap; the rest is as generated.
        body = {**body, "max_tokens": 2, "max_completion_tokens": 2}
        body.pop("model", None)
        r = httpx.post(server.url + path, json=body, timeout=120,
                       headers={"Authorization": f"Bearer {KEYS[0]}"})  # fmt: skip
        assert r.status_code < 500, (body, r.text[:500])
        if r.status_code == 200:
            _check_ok(path, body, r)
            seen["ok"] += 1
        else:
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
            seen["4xx"] += 1

    run()
    # Mostly valid bodies: the fuzz reached the engine, not only the validator. Completions
    # bodies are valid less often (a random prompt union: ids out of the vocabulary, several
    # prompts, stop_token_ids out of the vocabulary): measured 5 to 27 in 100 as the schema
    # and draws change.
    assert seen["ok"] >= (15 if path == CHAT else 3), seen
    assert server.alive()
