"""A flood of odd Responses and Messages requests: never a 5xx, always the API's error shape."""

from __future__ import annotations

import json

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.conftest import KEYS

_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**40), 2**40), st.text(max_size=12))
_json = st.recursive(
    _scalars,
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
    max_leaves=6,
)
_text = st.one_of(st.text(max_size=12), st.sampled_from(["<tool_call>", "</think>", "{{ x }}"]))


def _obj(kinds: list[str], fields: dict[str, st.SearchStrategy]) -> st.SearchStrategy:
    """Objects of one of ``kinds`` with any of ``fields`` (or junk in them)."""
    return st.fixed_dictionaries(
        {"type": st.sampled_from(kinds) | _text},
        optional={k: v | _json for k, v in fields.items()},
    )


_part = _obj(["input_text", "output_text", "input_image", "refusal"], {"text": _text})
_item = st.one_of(
    _obj(
        ["message"],
        {
            "role": st.sampled_from(["user", "assistant", "system", "developer", "tool"]),
            "content": _text | st.lists(_part, max_size=2),
        },
    ),
    _obj(["function_call"], {"call_id": _text, "name": _text, "arguments": _text}),
    _obj(["function_call_output"], {"call_id": _text, "output": _text | st.lists(_part)}),
    _obj(["reasoning"], {"summary": st.lists(_part, max_size=2), "content": st.lists(_part)}),
)
_tool = _obj(["function", "web_search"], {"name": _text, "parameters": _json})
_responses = st.fixed_dictionaries(
    {"input": _text | st.lists(_item, max_size=3)},
    optional={
        "instructions": _text | _json,
        "tools": st.lists(_tool, max_size=2) | _json,
        "tool_choice": st.sampled_from(["auto", "required", "none"]) | _json,
        "text": _json,
        "reasoning": _json,
        "previous_response_id": _text,
        "store": _json,
        "temperature": _json,
    },
)

_block = st.one_of(
    _obj(["text"], {"text": _text}),
    _obj(["thinking"], {"thinking": _text, "signature": _text}),
    _obj(["tool_use"], {"id": _text, "name": _text, "input": _json}),
    _obj(
        ["tool_result"],
        {"tool_use_id": _text, "content": _text | st.lists(_json), "is_error": _json},
    ),
    _obj(["image", "document", "redacted_thinking"], {"source": _json}),
)
_message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "assistant", "system"]),
        "content": _text | st.lists(_block, max_size=3),
    },
)
_messages = st.fixed_dictionaries(
    {"messages": st.lists(_message, max_size=3)},
    optional={
        "system": _text | st.lists(_block, max_size=2),
        "tools": st.lists(
            st.fixed_dictionaries({"name": _text, "input_schema": _json}, optional={"type": _text}),
            max_size=2,
        ),
        "tool_choice": _json | st.sampled_from([{"type": "any"}, {"type": "auto"}]),
        "thinking": _json | st.sampled_from([{"type": "enabled", "budget_tokens": 2}]),
        "stop_sequences": _json,
        "top_k": _json,
    },
)


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(
        server.url + path,
        content=json.dumps(body).encode(),
        timeout=60,
        headers={"x-api-key": KEYS[0], "Content-Type": "application/json"},
    )


_FLOOD = settings(
    max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True
)


@_FLOOD
@given(body=_responses, stream=st.booleans())
def test_responses_flood_never_5xx(server, body, stream):
    r = _post(
        server, "/v1/responses", {**body, "model": "tiny", "max_output_tokens": 1, "stream": stream}
    )
    assert r.status_code < 500, (body, r.text)
    if r.status_code >= 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


@_FLOOD
@given(body=_messages, path=st.sampled_from(["/v1/messages", "/v1/messages/count_tokens"]))
def test_messages_flood_never_5xx(server, body, path):
    r = _post(server, path, {**body, "model": "tiny", "max_tokens": 3})
    assert r.status_code < 500, (body, r.text)
    if r.status_code >= 400:
        err = r.json()
        assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
        assert isinstance(err["error"]["message"], str) and err["error"]["message"]
