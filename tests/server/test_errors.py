"""Every row of the error table, API keys, request ids, CORS, and a flood of malformed requests
that must never give a 5xx nor kill the server."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.conftest import KEYS, MAX_CONTEXT

MSGS = [{"role": "user", "content": "hi"}]


def assert_error(r: httpx.Response, status: int, param: str | None = "any") -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param != "any":
        assert err["param"] == param
    return err


def test_bad_json_is_400(http):
    r = http.post("/v1/chat/completions", content=b'{"messages": [',
                  headers={"Content-Type": "application/json"})  # fmt: skip
    assert "JSON" in assert_error(r, 400)["message"]


@pytest.mark.parametrize(
    "body,param",
    [
        ({}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        ({"messages": MSGS, "temperature": -1}, "temperature"),
        ({"messages": MSGS, "top_p": 2}, "top_p"),
        ({"messages": MSGS, "max_tokens": 0}, "max_tokens"),
        ({"messages": MSGS, "n": 2}, "n"),
        ({"messages": MSGS, "top_logprobs": 3}, "top_logprobs"),
        ({"messages": MSGS, "tool_choice": "auto"}, "tool_choice"),
        ({"messages": MSGS, "tools": [{"type": "function", "function": {"name": "f"}}],
          "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
        ({"messages": MSGS, "response_format": {"type": "json_schema"}}, "response_format"),
        ({"messages": MSGS, "response_format": {"type": "json_schema",
          "json_schema": {"name": "x", "schema": {"type": "bogus"}}}}, "response_format"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
        ({"messages": [{"role": "assistant", "content": "",
          "tool_calls": [{"type": "function", "id": "c",
                          "function": {"name": "f", "arguments": "{not json"}}]}]}, "messages"),
    ],
)  # fmt: skip
def test_invalid_chat_requests_are_400_with_param(http, body, param):
    assert_error(http.post("/v1/chat/completions", json=body), 400, param)


@pytest.mark.parametrize(
    "body,param",
    [
        ({"prompt": "x", "n": 3}, "n"),
        ({"prompt": [], "max_tokens": 1}, "prompt"),
        ({"prompt": [10**9], "max_tokens": 1}, "prompt"),
        ({"prompt": ["a", "b"], "max_tokens": 1}, "prompt"),
        ({"prompt": "x", "logprobs": 50}, "logprobs"),
        ({"prompt": "x", "best_of": 2}, "best_of"),
    ],
)
def test_invalid_completion_requests_are_400(http, body, param):
    assert_error(http.post("/v1/completions", json=body), 400, param)


def test_context_length_exceeded(http):
    r = http.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": MAX_CONTEXT})
    err = assert_error(r, 400)
    assert err["code"] == "context_length_exceeded"
    assert err["message"].startswith(f"This model's maximum context length is {MAX_CONTEXT} tokens")
    r = http.post("/v1/completions", json={"prompt": [5] * (MAX_CONTEXT + 1)})
    assert assert_error(r, 400)["code"] == "context_length_exceeded"


def test_unknown_model_is_404(http):
    r = http.post("/v1/chat/completions", json={"model": "gpt-9", "messages": MSGS})
    assert assert_error(r, 404)["code"] == "model_not_found"


def test_unknown_route_is_openai_shaped_404(http):
    assert_error(http.get("/v1/nothing-here"), 404)


def test_api_keys(server):
    url = server.url
    body = {"messages": MSGS, "max_tokens": 1}
    assert_error(httpx.post(url + "/v1/chat/completions", json=body), 401)
    bad = {"Authorization": "Bearer key-three"}
    assert_error(httpx.get(url + "/v1/models", headers=bad), 401)
    almost = {"Authorization": "Bearer " + KEYS[0][:-1]}
    assert_error(httpx.get(url + "/v1/models", headers=almost), 401)
    for k in KEYS:  # several keys are accepted
        assert httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {k}"}).is_success
    assert httpx.get(url + "/health").status_code == 200  # open without a key


def test_request_id_is_echoed(http):
    r = http.get("/v1/models", headers={"X-Request-Id": "abc-123"})
    assert r.headers["x-request-id"] == "abc-123"
    assert len(http.get("/v1/models").headers["x-request-id"]) >= 16  # made up when absent


def test_cors_for_configured_origin_only(server):
    pre = {"Access-Control-Request-Method": "POST"}
    ok = httpx.options(server.url + "/v1/chat/completions",
                       headers={**pre, "Origin": "http://allowed.test"})  # fmt: skip
    assert ok.headers["access-control-allow-origin"] == "http://allowed.test"
    no = httpx.options(server.url + "/v1/chat/completions",
                       headers={**pre, "Origin": "http://evil.test"})  # fmt: skip
    assert "access-control-allow-origin" not in no.headers


# ---- a flood of malformed requests
_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70),
    st.floats(), st.text(max_size=20),
)  # fmt: skip
_json = st.recursive(
    _scalars,
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3),
    max_leaves=8,
)
_FIELDS = ["model", "messages", "prompt", "temperature", "top_p", "top_k", "min_p", "stop",
           "seed", "n", "logprobs", "top_logprobs", "tools", "tool_choice", "response_format",
           "stream", "stream_options", "chat_template_kwargs", "stop_token_ids", "echo",
           "presence_penalty", "repetition_penalty", "ignore_eos"]  # fmt: skip
_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "tool", "x"]),
     "content": st.one_of(st.text(max_size=20), _json)},
    optional={"tool_calls": _json, "reasoning": _json, "name": _json},
)  # fmt: skip
_bodies = st.dictionaries(
    st.sampled_from(_FIELDS) | st.text(max_size=6),
    _json | st.lists(_message, min_size=1, max_size=2),
    max_size=6,
)


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck),
          derandomize=True)  # fmt: skip
@given(body=_bodies, path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
def test_malformed_flood_never_5xx(server, body, path):
    # NOTE: capped generation keeps the accepted ones cheap; everything else is fuzzed.
    body = {**body, "max_tokens": 1, "max_completion_tokens": 1}
    # Python's encoder writes Infinity/NaN, which strict JSON parsers reject: fine here.
    r = httpx.post(server.url + path, content=json.dumps(body).encode(), timeout=60,
                   headers={"Authorization": f"Bearer {KEYS[0]}",
                            "Content-Type": "application/json"})  # fmt: skip
    assert r.status_code < 500, (body, r.text)
    if r.status_code >= 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_server_alive_after_flood(server, http):
    assert server.alive() and http.get("/health").status_code == 200
    r = http.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 1})
    assert r.status_code == 200
