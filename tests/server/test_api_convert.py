"""Responses and Messages requests to chat requests, the response store, the Anthropic error
shape: without a server (the wire is tested in test_api_responses.py / test_api_messages.py)."""

from __future__ import annotations

import asyncio
import json

import pytest

from lily.server import api_messages, api_responses
from lily.server.api_messages_events import AnthropicErrors
from lily.server.blocks import REASONING_BUDGET_FIELD
from lily.server.protocol import ApiError
from lily.server.response_store import ResponseStore

# ---- Responses input items


def test_items_group_into_assistant_turns():
    items = [
        {"role": "user", "content": "hi"},
        {
            "type": "reasoning",
            "id": "rs_1",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": "think"}],
        },
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Let me", "annotations": []}],
        },
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"a": 1}'},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": ""},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {
            "type": "function_call_output",
            "call_id": "c2",
            "output": [{"type": "input_text", "text": "two"}],
        },
        {"type": "reasoning", "id": "rs_2", "summary": [{"type": "summary_text", "text": "S"}]},
        {"type": "message", "role": "assistant", "content": "done"},
        {
            "type": "message",
            "role": "developer",
            "content": [{"type": "input_text", "text": "be brief"}],
        },
        {"type": "message", "role": "assistant", "content": "again"},
    ]
    assert api_responses.input_messages(items) == [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": "Let me",
            "reasoning_content": "think",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "f", "arguments": '{"a": 1}'},
                },
                {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"},
        {"role": "assistant", "content": "done", "reasoning_content": "S"},
        {"role": "system", "content": "be brief"},
        {"role": "assistant", "content": "again"},
    ]


@pytest.mark.parametrize(
    "item, what",
    [
        ({"type": "web_search_call", "id": "x"}, "web_search_call"),
        ({"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}, "input_image"),
        ({"role": "tool", "content": "x"}, "role"),
        ({"type": "function_call", "name": "f", "arguments": {"a": 1}}, "function_call"),
        (
            {"type": "reasoning", "content": [{"type": "reasoning_text", "text": 5}]},
            "input[0].content[0].text: must be a string",
        ),
        ({"type": "reasoning", "summary": {"text": "x"}}, "input[0].summary: must be"),
    ],
)
def test_unsupported_items_are_400s_naming_input(item, what):
    with pytest.raises(ApiError) as e:
        api_responses.input_messages([item])
    assert e.value.status == 400 and e.value.param == "input" and what in e.value.message


def _responses(**body) -> api_responses.ResponsesRequest:
    return api_responses.ResponsesRequest.model_validate(body)


def test_responses_request_maps_to_chat():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    req = _responses(
        model="m",
        input="q",
        instructions="sys",
        max_output_tokens=7,
        temperature=0.5,
        tools=[{"type": "function", "name": "f", "parameters": schema, "strict": True}],
        tool_choice={"type": "function", "name": "f"},
        parallel_tool_calls=False,
        text={"format": {"type": "json_schema", "name": "o", "schema": schema}},
        reasoning={"effort": "none"},
        top_k=5,
        seed=3,
        store=False,
        metadata={"k": "v"},
    )
    history = ({"role": "user", "content": "before"}, {"role": "assistant", "content": "ok"})
    body, talk = api_responses.chat_body(req, history)
    assert talk == [*history, {"role": "user", "content": "q"}]
    assert body == {
        "model": "m",
        "messages": [{"role": "system", "content": "sys"}, *talk],
        "tools": [
            {"type": "function", "function": {"name": "f", "parameters": schema, "strict": True}}
        ],
        "tool_choice": {"type": "function", "function": {"name": "f"}},
        "parallel_tool_calls": False,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "o", "schema": schema, "strict": None},
        },
        "max_completion_tokens": 7,
        "temperature": 0.5,
        "chat_template_kwargs": {"enable_thinking": False},
        "top_k": 5,
        "seed": 3,
    }


def test_leading_instructions_and_developer_items_are_one_system_message():
    items = [
        {"role": "developer", "content": "d1"},
        {"role": "system", "content": [{"type": "input_text", "text": "s2"}]},
        {"role": "user", "content": "u"},
        {"role": "developer", "content": "later"},
    ]
    body, talk = api_responses.chat_body(_responses(input=items, instructions="i0"), ())
    assert body["messages"] == [
        {"role": "system", "content": "i0\n\nd1\n\ns2"},
        {"role": "user", "content": "u"},
        {"role": "system", "content": "later"},
    ]
    assert talk[0] == {"role": "system", "content": "d1"}  # stored without the instructions


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
        ({"input": "x", "tool_choice": "required"}, "tool_choice"),
        ({"input": "x", "background": True}, "background"),
        ({"input": ""}, "input"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}}, "text.format"),
    ],
)
def test_bad_responses_requests(body, param):
    with pytest.raises(ApiError) as e:
        api_responses.chat_body(_responses(**body), ())
    assert e.value.status == 400 and e.value.param == param


# ---- Anthropic Messages


def _messages(**body) -> api_messages.MessagesRequest:
    return api_messages.MessagesRequest.model_validate({"model": "m", "max_tokens": 50, **body})


def test_messages_map_to_chat():
    req = _messages(
        system=[{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
        messages=[
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hmm", "signature": "sig"},
                    {"type": "text", "text": "Let me."},
                    {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"a": 1}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "one"},
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_2",
                        "is_error": True,
                        "content": [{"type": "text", "text": "bad"}],
                    },
                    {"type": "text", "text": "and now?"},
                ],
            },
        ],
        tools=[{"name": "f", "input_schema": {"type": "object"}, "cache_control": {}}],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        thinking={"type": "enabled", "budget_tokens": 20},
        stop_sequences=["X"],
        top_k=4,
        metadata={"user_id": "u"},
        min_p=0.1,
    )
    body = api_messages.chat_body(req)
    assert body == {
        "model": "m",
        "messages": [
            {"role": "system", "content": "a\n\nb"},
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "content": "Let me.",
                "reasoning_content": "hmm",
                "tool_calls": [
                    {
                        "id": "toolu_1",
                        "type": "function",
                        "function": {"name": "f", "arguments": {"a": 1}},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "toolu_1", "content": "one"},
            {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: bad"},
            {"role": "user", "content": "and now?"},
        ],
        "tools": [
            {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
        ],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "chat_template_kwargs": {"enable_thinking": True},
        "max_tokens": 50,
        "stop": ["X"],
        "top_k": 4,
        "min_p": 0.1,
        REASONING_BUDGET_FIELD: 20,
    }


@pytest.mark.parametrize(
    "choice, expected",
    [
        ({"type": "auto"}, "auto"),
        ({"type": "none"}, "none"),
        ({"type": "tool", "name": "f"}, {"type": "function", "function": {"name": "f"}}),
    ],
)
def test_tool_choice_maps(choice, expected):
    req = _messages(
        messages=[{"role": "user", "content": "x"}],
        tool_choice=choice,
        tools=[{"name": "f", "input_schema": {"type": "object"}}],
    )
    assert api_messages.chat_body(req)["tool_choice"] == expected


def test_thinking_disabled_and_absent():
    msgs = [{"role": "user", "content": "x"}]
    off = api_messages.chat_body(_messages(messages=msgs, thinking={"type": "disabled"}))
    assert off["chat_template_kwargs"] == {"enable_thinking": False}
    assert REASONING_BUDGET_FIELD not in off
    # Silent: the server's default, as for a chat completion.
    assert api_messages.chat_body(_messages(messages=msgs))["chat_template_kwargs"] == {}


@pytest.mark.parametrize(
    "body, param",
    [
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "messages",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "{"}]},
            "messages",
        ),
        (
            {
                "messages": [{"role": "user", "content": "x"}],
                "thinking": {"type": "enabled", "budget_tokens": 50},
            },
            "thinking.budget_tokens",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "thinking": {"type": "enabled"}},
            "thinking.budget_tokens",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "any"}},
            "tool_choice",
        ),
        (
            {
                "messages": [{"role": "user", "content": "x"}],
                "tools": [{"name": "web", "type": "web_search_20250305", "input_schema": {}}],
            },
            "tools",
        ),
    ],
)
def test_bad_messages_requests(body, param):
    with pytest.raises(ApiError) as e:
        api_messages.chat_body(_messages(**body))
    assert e.value.status == 400 and e.value.param == param


# ---- the response store


def _resp(i: int, pad: int = 0) -> dict:
    return {"id": f"resp_{i}", "pad": "x" * pad}


def test_store_evicts_least_recently_used_by_count():
    s = ResponseStore(max_items=3, max_bytes=1 << 20)
    for i in range(3):
        s.put(_resp(i), [{"role": "user", "content": str(i)}])
    assert s.get("resp_0").messages == ({"role": "user", "content": "0"},)  # now the newest
    s.put(_resp(3), [])
    assert s.get("resp_1") is None and len(s) == 3
    assert all(s.get(f"resp_{i}") is not None for i in (0, 2, 3))


def test_store_bounds_bytes():
    size = len(json.dumps(_resp(0, 1000))) + len(json.dumps([]))
    s = ResponseStore(max_items=100, max_bytes=3 * size)
    for i in range(5):
        s.put(_resp(i, 1000), [])
    assert len(s) == 3 and s.nbytes == 3 * size and s.get("resp_1") is None
    s.put(_resp(9, 5000), [])  # larger than the whole bound: not kept, nothing evicted
    assert s.get("resp_9") is None and len(s) == 3
    assert s.delete("resp_4") and not s.delete("resp_4") and s.nbytes == 2 * size


# ---- Anthropic error shape


def _app(status: int, body: bytes, content_type: bytes = b"application/json"):
    async def app(scope, receive, send):
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", content_type),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})

    return app


def _call(app, path: str) -> tuple[int, dict, bytes]:
    sent = []

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.disconnect"}

    scope = {"type": "http", "path": path, "method": "POST", "headers": []}
    asyncio.run(AnthropicErrors(app)(scope, receive, send))
    headers = dict(sent[0]["headers"])
    return sent[0]["status"], headers, b"".join(m.get("body", b"") for m in sent[1:])


@pytest.mark.parametrize(
    "status, kind",
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (404, "not_found_error"),
        (413, "request_too_large"),
        (429, "rate_limit_error"),
        (500, "api_error"),
        (503, "overloaded_error"),
    ],
)
def test_errors_under_messages_take_the_anthropic_shape(status, kind):
    body = json.dumps({"error": {"message": "why", "type": "x", "param": None, "code": None}})
    got, headers, out = _call(_app(status, body.encode()), "/v1/messages/count_tokens")
    assert got == status and int(headers[b"content-length"]) == len(out)
    assert json.loads(out) == {"type": "error", "error": {"type": kind, "message": "why"}}


def test_other_paths_and_successes_pass_untouched():
    body = json.dumps({"error": {"message": "why"}}).encode()
    assert _call(_app(400, body), "/v1/chat/completions")[2] == body
    assert _call(_app(200, b'{"ok": 1}'), "/v1/messages")[2] == b'{"ok": 1}'
