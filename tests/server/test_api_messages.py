"""The Anthropic Messages API on a live server, driven by the official ``anthropic`` client
(its messages, streaming helper and tool runner) and raw httpx checked against the SDK's
own typed models.

The tiny model is random: the tests check the wire, not what the text says. Thinking is
off where the random model's noise would decide the outcome.
"""

from __future__ import annotations

import json
from typing import Literal

import anthropic
import httpx
import jsonschema
import pytest
from anthropic.types import Message, RawMessageStreamEvent
from pydantic import TypeAdapter

from tests.server.conftest import ENV_KEYS, GUARD_FAULT_SEED, KEYS
from tests.server.helpers import WEATHER_SCHEMA, answer_header_len
from tests.server.test_api import prompt_len

EVENTS = TypeAdapter(RawMessageStreamEvent)
MSGS = [{"role": "user", "content": "Say something."}]
OFF = {"type": "disabled"}
SCHEMA = WEATHER_SCHEMA
WEATHER = {"name": "get_weather", "description": "Forecast", "input_schema": SCHEMA}
PING = {
    "name": "ping",
    "input_schema": {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
    },
}


@pytest.fixture
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEYS[0], max_retries=0, timeout=120)


@pytest.fixture
def raw(server):
    headers = {"x-api-key": KEYS[1], "anthropic-version": "2023-06-01"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=120) as c:
        yield c


def stream(c: httpx.Client, body: dict) -> list[tuple[str, dict]]:
    """(event name, data) of a streamed message; each data checked against the SDK's types."""
    out = []
    with c.stream("POST", "/v1/messages", json={"model": "tiny", **body, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for block in r.read().decode().split("\n\n"):
            lines = dict(ln.split(": ", 1) for ln in block.splitlines())
            if lines:
                data = json.loads(lines["data"])
                assert lines["event"] == data["type"]
                if data["type"] not in ("ping", "error"):
                    EVENTS.validate_python(data)
                out.append((lines["event"], data))
    return out


def check_order(events: list[tuple[str, dict]]) -> None:
    """message_start, blocks started, filled and stopped one at a time, message_delta,
    message_stop (pings anywhere after the start)."""
    names = [n for n, _ in events if n != "ping"]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    open_index, next_index = None, 0
    for name, data in events[1:-2]:
        if name == "content_block_start":
            assert open_index is None and data["index"] == next_index
            open_index, next_index = data["index"], next_index + 1
        elif name == "content_block_delta":
            assert data["index"] == open_index
        elif name == "content_block_stop":
            assert data["index"] == open_index
            open_index = None
    assert open_index is None


def test_non_stream_message_shape(raw, model_dir):
    body = {
        "model": "tiny",
        "max_tokens": 6,
        "system": "Be kind.",
        "messages": MSGS,
        "ignore_eos": True,
        "metadata": {"user_id": "u1"},
    }
    r = raw.post("/v1/messages", json=body)
    assert r.status_code == 200, r.text
    m = Message.model_validate(r.json())
    assert m.id.startswith("msg_") and m.role == "assistant" and m.model == "tiny"
    assert m.stop_reason == "max_tokens" and m.stop_sequence is None
    u = m.usage
    n = prompt_len(model_dir, [{"role": "system", "content": "Be kind."}, *MSGS])
    assert u.input_tokens + u.cache_read_input_tokens == n and u.output_tokens == 6
    # Thinking is the server's default when the request is silent; the random model never
    # closes it, so everything is one thinking block.
    [block] = m.content
    assert block.type == "thinking" and block.thinking
    assert u.output_tokens_details.thinking_tokens == 6


def test_stream_equals_non_stream(claude, raw):
    kw = dict(
        model="tiny",
        max_tokens=8,
        messages=MSGS,
        thinking=OFF,
        extra_body={"seed": 5, "ignore_eos": True},
    )
    full = claude.messages.create(**kw)
    with claude.messages.stream(**kw) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert full.content[0].type == "text" and text == full.content[0].text
    assert final.model_dump(exclude={"id", "usage"}) == full.model_dump(exclude={"id", "usage"})
    assert final.usage.output_tokens == full.usage.output_tokens == 8
    total = [m.usage.input_tokens + m.usage.cache_read_input_tokens for m in (full, final)]
    assert total[0] == total[1] and final.usage.cache_read_input_tokens > 0
    events = stream(
        raw, {"max_tokens": 8, "messages": MSGS, "thinking": OFF, "seed": 5, "ignore_eos": True}
    )
    check_order(events)
    names = [n for n, _ in events]
    assert names[:4] == ["message_start", "ping", "content_block_start", "content_block_delta"]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert events[-2][1]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}


def test_thinking_enabled_streams_thinking_deltas(raw):
    events = stream(
        raw,
        {
            "max_tokens": 6,
            "messages": MSGS,
            "seed": 2,
            "ignore_eos": True,
            "thinking": {"type": "enabled", "budget_tokens": 4},
        },
    )
    check_order(events)
    starts = [d["content_block"] for n, d in events if n == "content_block_start"]
    assert starts[0] == {"type": "thinking", "thinking": "", "signature": ""}
    deltas = [d["delta"]["type"] for n, d in events if n == "content_block_delta"]
    assert deltas[0] == "thinking_delta"


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
def test_forced_tool_use_streamed(claude, choice):
    with claude.messages.stream(
        model="tiny",
        max_tokens=150,
        messages=MSGS,
        thinking=OFF,
        tools=[WEATHER, PING],
        tool_choice=choice,
        extra_body={"seed": 1},
    ) as s:
        partial = {}
        for e in s:
            if e.type == "content_block_delta" and e.delta.type == "input_json_delta":
                partial[e.index] = partial.get(e.index, "") + e.delta.partial_json
        m = s.get_final_message()
    assert m.stop_reason == "tool_use" and m.content
    for i, block in enumerate(m.content):
        assert block.type == "tool_use" and block.id.startswith("toolu_")
        assert json.loads(partial[i]) == block.input
        jsonschema.validate(
            block.input, {"get_weather": SCHEMA, "ping": PING["input_schema"]}[block.name]
        )
    if choice["type"] == "tool":
        assert [b.name for b in m.content] == ["get_weather"]


def test_stop_sequences(claude):
    kw = dict(
        model="tiny",
        max_tokens=12,
        messages=MSGS,
        thinking=OFF,
        extra_body={"seed": 11, "ignore_eos": True},
    )
    text = claude.messages.create(**kw).content[0].text
    stop = text[4:6]
    cut = claude.messages.create(**kw, stop_sequences=["never there", stop])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[: text.find(stop)]
    with claude.messages.stream(**kw, stop_sequences=[stop]) as s:
        final = s.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)


def test_count_tokens_matches_the_prompt(claude, model_dir):
    msgs = [*MSGS, {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "More"}]
    got = claude.messages.count_tokens(model="tiny", messages=msgs, system="S", tools=[WEATHER])
    chat_tool = {
        "type": "function",
        "function": {"name": "get_weather", "description": "Forecast", "parameters": SCHEMA},
    }
    want = prompt_len(model_dir, [{"role": "system", "content": "S"}, *msgs], tools=[chat_tool])
    assert got.input_tokens == want
    off = claude.messages.count_tokens(model="tiny", messages=MSGS, thinking=OFF)
    assert off.input_tokens == prompt_len(model_dir, MSGS, enable_thinking=False)


def test_keys_and_error_shapes(server):
    body = {"model": "tiny", "max_tokens": 1, "messages": MSGS}
    url = server.url + "/v1/messages"
    ok = httpx.post(url, json=body, headers={"Authorization": f"Bearer {KEYS[0]}"}, timeout=60)
    assert ok.status_code == 200
    cases = [
        ({"x-api-key": "wrong"}, body, 401, "authentication_error"),
        ({}, body, 401, "authentication_error"),
        ({"x-api-key": KEYS[0]}, {**body, "model": "nope"}, 404, "not_found_error"),
        ({"x-api-key": KEYS[0]}, {"model": "tiny", "messages": MSGS}, 400, "invalid_request_error"),
        (
            {"x-api-key": KEYS[0]},
            {
                **body,
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image", "source": {"type": "base64", "data": ""}}],
                    }
                ],
            },
            400,
            "invalid_request_error",
        ),
    ]
    for headers, b, status, kind in cases:
        r = httpx.post(url, json=b, headers=headers, timeout=60)
        assert r.status_code == status, r.text
        err = r.json()
        assert err["type"] == "error" and err["error"]["type"] == kind and err["error"]["message"]
    r = httpx.post(url + "/count_tokens", json={"model": "tiny"}, headers={"x-api-key": KEYS[0]})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            **body
        )
    bearer = anthropic.Anthropic(base_url=server.url, auth_token=KEYS[1], max_retries=0)
    assert bearer.messages.create(**body).type == "message"


def test_engine_fault_mid_stream_is_an_error_event(guarded_server):
    c = anthropic.Anthropic(base_url=guarded_server.url, api_key=ENV_KEYS[0], max_retries=0)
    name = httpx.get(
        guarded_server.url + "/v1/models", timeout=30, headers={"x-api-key": ENV_KEYS[0]}
    ).json()["data"][0]["id"]
    with pytest.raises(anthropic.APIStatusError) as e:
        with c.messages.stream(
            model=name,
            max_tokens=20,
            messages=MSGS,
            extra_body={"seed": GUARD_FAULT_SEED, "ignore_eos": True},
        ) as s:
            for _ in s:
                pass
    assert e.value.body["error"]["type"] == "api_error"
    assert "injected engine fault" in e.value.body["error"]["message"]


def test_tool_runner_loop(claude, model_dir):
    """The SDK's tool runner: a tool_use streamed, the tool_result sent back, a final message."""
    calls = []

    @anthropic.beta_tool
    def get_weather(city: Literal["Paris", "Rome"], days: int) -> str:
        """The weather forecast for a city.

        Args:
            city: the city
            days: how many days
        """
        calls.append((city, days))
        return f"sunny in {city} for {days} days"

    runner = claude.beta.messages.tool_runner(
        model="tiny",
        max_tokens=60,
        messages=[{"role": "user", "content": "Paris, 3 days?"}],
        tools=[get_weather],
        tool_choice={"type": "tool", "name": "get_weather"},
        thinking=OFF,
        stream=True,
        thread=False,
        max_iterations=3,
    )
    finals = []
    for s in runner:
        kinds = {e.type for e in s}
        finals.append(s.get_final_message())
        if len(finals) == 1:
            assert "input_json" in kinds  # the tool call's arguments were streamed
            runner.set_messages_params(lambda p: {**p, "tool_choice": {"type": "none"}})
    first, last = finals[0], finals[-1]
    assert len(finals) == 2 and first.stop_reason == "tool_use"
    assert calls and calls[0][0] in ("Paris", "Rome") and isinstance(calls[0][1], int)
    assert last.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in last.content] in ([], ["text"])
    # The second turn resent the first: its prompt extends it, so the engine resumes at
    # least from the start of the first answer's turn.
    n_first = first.usage.input_tokens + first.usage.cache_read_input_tokens
    assert last.usage.cache_read_input_tokens >= n_first - answer_header_len(model_dir) > 0
