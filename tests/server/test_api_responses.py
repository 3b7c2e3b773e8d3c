"""The OpenAI Responses API on a live server, driven by the official ``openai`` client,
raw httpx checked against the SDK's own typed models, and openai-agents' default model.

The tiny model is random: the tests check the wire (event order, shapes, counts, equalities
between the streamed and the full answer, constraints) rather than what the text says.
Thinking is off where the random model's noise would decide the outcome.
"""

from __future__ import annotations

import json
from typing import Annotated, Literal

import httpx
import jsonschema
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel, Field, TypeAdapter

from tests.server.conftest import ENV_KEYS, GUARD_FAULT_SEED, KEYS
from tests.server.helpers import WEATHER_SCHEMA, answer_header_len, assert_openai_error
from tests.server.test_api import prompt_len

EVENTS = TypeAdapter(ResponseStreamEvent)
NO_THINK = {"reasoning": {"effort": "none"}}
PARAMS = {**WEATHER_SCHEMA, "additionalProperties": False}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Forecast",
    "parameters": PARAMS,
    "strict": True,
}
PING = {
    "type": "function",
    "name": "ping",
    "parameters": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
}


def post(http: httpx.Client, body: dict) -> dict:
    r = http.post("/v1/responses", json={"model": "tiny", **body})
    assert r.status_code == 200, r.text
    Response.model_validate(r.json())  # the SDK's own type
    return r.json()


def stream(http: httpx.Client, body: dict) -> list[dict]:
    """Raw events of a streamed response, each checked against the SDK's event types and
    against its SSE event name; sequence numbers count from 0."""
    out = []
    with http.stream("POST", "/v1/responses", json={"model": "tiny", **body, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for block in r.read().decode().split("\n\n"):
            lines = dict(ln.split(": ", 1) for ln in block.splitlines() if not ln.startswith(":"))
            if not lines:
                continue
            data = json.loads(lines["data"])
            assert lines["event"] == data["type"]
            EVENTS.validate_python(data)
            out.append(data)
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    return out


def check_event_order(events: list[dict]) -> dict:
    """created, in_progress, then each item added -> its events -> done, then one terminal
    event; returns the final response."""
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert (
        sum(
            k.startswith("response.") and k.split(".")[1] in ("completed", "incomplete", "failed")
            for k in kinds
        )
        == 1
    )
    final = events[-1]["response"]
    open_item = None
    for e in events[2:-1]:
        if e["type"] == "response.output_item.added":
            assert open_item is None
            open_item = e
        elif e["type"] == "response.output_item.done":
            assert open_item["output_index"] == e["output_index"]
            assert e["item"] == final["output"][e["output_index"]]
            open_item = None
        else:
            assert open_item is not None and e["item_id"] == open_item["item"]["id"]
    added = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
    assert added == list(range(len(final["output"]))) and open_item is None
    return final


def without_ids(output: list[dict]) -> list[dict]:
    return [{k: v for k, v in it.items() if k not in ("id", "call_id")} for it in output]


def test_non_stream_shape_and_usage(http, model_dir):
    r = post(
        http,
        {
            "input": "Say something.",
            "instructions": "Be kind.",
            "max_output_tokens": 6,
            "ignore_eos": True,
        },
    )
    msgs = [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "Say something."},
    ]
    assert r["object"] == "response" and r["id"].startswith("resp_")
    assert r["status"] == "incomplete" and r["incomplete_details"] == {
        "reason": "max_output_tokens"
    }
    u = r["usage"]
    assert u["input_tokens"] == prompt_len(model_dir, msgs)
    assert u["output_tokens"] == 6 and u["total_tokens"] == u["input_tokens"] + 6
    # Thinking is on by default and the random model never closes it: all reasoning.
    assert u["output_tokens_details"]["reasoning_tokens"] == 6
    [item] = r["output"]
    assert item["type"] == "reasoning" and item["status"] == "incomplete"
    assert item["summary"] == [] and item["content"][0]["type"] == "reasoning_text"
    assert item["content"][0]["text"]


def test_sdk_stream_equals_non_stream_when_cut(client):
    kw = dict(
        model="tiny",
        input="Say something.",
        max_output_tokens=8,
        **NO_THINK,
        extra_body={"seed": 7, "temperature": 1.0, "ignore_eos": True},
    )
    full = client.responses.create(**kw)
    events = list(client.responses.create(**kw, stream=True))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    final = events[-1].response
    assert events[-1].type == "response.incomplete" and final.status == "incomplete"
    assert full.output_text and "".join(deltas) == full.output_text == final.output_text
    assert without_ids(final.model_dump()["output"]) == without_ids(full.model_dump()["output"])
    assert final.usage.output_tokens == full.usage.output_tokens == 8
    assert final.usage.output_tokens_details.reasoning_tokens == 0
    assert full.output[0].type == "message" and full.output[0].status == "incomplete"


def test_raw_stream_events_in_order(http):
    events = stream(
        http,
        {
            "input": "Say something.",
            "max_output_tokens": 8,
            "seed": 3,
            "ignore_eos": True,
            **NO_THINK,
        },
    )
    final = check_event_order(events)
    kinds = [e["type"] for e in events]
    assert kinds[2:5] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    done = next(e for e in events if e["type"] == "response.output_text.done")
    assert text == done["text"] == final["output"][0]["content"][0]["text"]


@pytest.mark.parametrize("summary", [None, "auto"])
def test_thinking_as_reasoning_text_or_summary(http, summary):
    body = {"input": "Say something.", "max_output_tokens": 5, "seed": 1, "ignore_eos": True}
    if summary:
        body["reasoning"] = {"summary": summary}
    events = stream(http, body)
    final = check_event_order(events)
    kind = "reasoning_summary_text" if summary else "reasoning_text"
    deltas = "".join(e["delta"] for e in events if e["type"] == f"response.{kind}.delta")
    assert deltas and not any(e["type"] == "response.output_text.delta" for e in events)
    [item] = final["output"]
    got = item["summary"][0]["text"] if summary else item["content"][0]["text"]
    assert got == deltas and (item["summary"] == [] if not summary else "content" not in item)


@pytest.mark.parametrize("stream_it", [False, True])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_weather"}])
def test_forced_function_calls(http, choice, stream_it):
    body = {
        "input": "Weather in Paris for 3 days?",
        "tools": [WEATHER, PING],
        "tool_choice": choice,
        "max_output_tokens": 150,
        "seed": 5,
        **NO_THINK,
    }
    if stream_it:
        events = stream(http, body)
        r = check_event_order(events)
        for item in r["output"]:
            frags = [
                e["delta"]
                for e in events
                if e.get("item_id") == item["id"]
                and e["type"] == "response.function_call_arguments.delta"
            ]
            done = [
                e
                for e in events
                if e.get("item_id") == item["id"]
                and e["type"] == "response.function_call_arguments.done"
            ]
            assert "".join(frags) == done[0]["arguments"] == item["arguments"]
    else:
        r = post(http, body)
    assert r["status"] == "completed" and r["output"]
    for item in r["output"]:
        assert item["type"] == "function_call" and item["status"] == "completed"
        assert item["call_id"].startswith("call_") and item["id"].startswith("fc_")
        tool = {"get_weather": WEATHER, "ping": PING}[item["name"]]
        jsonschema.validate(json.loads(item["arguments"]), tool["parameters"])
    if isinstance(choice, dict):
        assert [it["name"] for it in r["output"]] == ["get_weather"]


def test_text_format_json_schema_with_the_sdk_stream_helper(client):
    schema = {
        "type": "object",
        "properties": {
            "pet": {"enum": ["cat", "dog"]},
            "n": {"type": "integer", "minimum": 0, "maximum": 9},
        },
        "required": ["pet", "n"],
        "additionalProperties": False,
    }
    kw = dict(
        model="tiny",
        input="A pet?",
        max_output_tokens=40,
        **NO_THINK,
        extra_body={"seed": 2},
        text={"format": {"type": "json_schema", "name": "pet", "schema": schema, "strict": True}},
    )
    full = client.responses.create(**kw)
    jsonschema.validate(json.loads(full.output_text), schema)
    assert full.status == "completed" and full.text.format.type == "json_schema"
    # The SDK's helper accumulates the events into a response and checks they fit together.
    with client.responses.stream(**kw) as s:
        deltas = [e.delta for e in s if e.type == "response.output_text.delta"]
        final = s.get_final_response()
    assert "".join(deltas) == final.output_text == full.output_text
    assert [(o.type, o.status) for o in final.output] == [("message", "completed")]


def test_previous_response_id_continues_through_the_prefix_cache(http, model_dir):
    first = post(
        http,
        {
            "input": "Weather in Paris?",
            "tools": [WEATHER],
            "seed": 4,
            "tool_choice": "required",
            "max_output_tokens": 120,
            **NO_THINK,
        },
    )
    calls = [it for it in first["output"] if it["type"] == "function_call"]
    outputs = [
        {"type": "function_call_output", "call_id": c["call_id"], "output": "sunny"} for c in calls
    ]
    second = post(
        http,
        {
            "previous_response_id": first["id"],
            "input": outputs,
            "tools": [WEATHER],
            "max_output_tokens": 2,
            **NO_THINK,
        },
    )
    # The earlier prompt and output are rendered again: the prompt extends the earlier one,
    # so the engine resumes from its saved state at least at the start of the earlier
    # answer's turn (the generated tokens may tokenize differently when rendered again).
    cached = second["usage"]["input_tokens_details"]["cached_tokens"]
    assert cached >= first["usage"]["input_tokens"] - answer_header_len(model_dir) > 0
    talk = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": c["name"], "arguments": json.loads(c["arguments"])},
                }
                for c in calls
            ],
        },
        *({"role": "tool", "content": "sunny"} for _ in calls),
    ]
    chat_tool = {
        "type": "function",
        "function": {k: WEATHER[k] for k in ("name", "description", "parameters", "strict")},
    }
    n = prompt_len(model_dir, talk, enable_thinking=False, tools=[chat_tool])
    assert second["usage"]["input_tokens"] == n
    assert second["previous_response_id"] == first["id"]
    got = http.get(f"/v1/responses/{first['id']}")
    assert got.status_code == 200 and got.json() == first


def test_store_false_get_delete_and_unknown_ids(http):
    r = post(http, {"input": "hi", "max_output_tokens": 1, "store": False})
    assert_openai_error(http.get(f"/v1/responses/{r['id']}"), 404)
    err = assert_openai_error(
        http.post("/v1/responses", json={"input": "hi", "previous_response_id": r["id"]}), 400
    )
    assert err["param"] == "previous_response_id"
    kept = post(http, {"input": "hi", "max_output_tokens": 1})
    d = http.delete(f"/v1/responses/{kept['id']}")
    assert d.json() == {"id": kept["id"], "object": "response.deleted", "deleted": True}
    assert_openai_error(http.get(f"/v1/responses/{kept['id']}"), 404)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": [{"type": "computer_call", "id": "x"}]}, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input"),
        ({"input": "x", "tools": [{"type": "file_search"}]}, "tools"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "temperature": -1}, "temperature"),
        ({"input": "x", "max_output_tokens": 5000}, "max_output_tokens"),
    ],
)
def test_bad_requests_are_400_in_the_error_shape(http, body, param):
    assert assert_openai_error(http.post("/v1/responses", json=body), 400)["param"] == param


def test_auth_and_unknown_model(server):
    r = httpx.post(server.url + "/v1/responses", json={"input": "x"}, timeout=30)
    assert assert_openai_error(r, 401)["type"] == "authentication_error"
    r = httpx.post(
        server.url + "/v1/responses",
        json={"model": "nope", "input": "x"},
        headers={"Authorization": f"Bearer {KEYS[0]}"},
        timeout=30,
    )
    assert assert_openai_error(r, 404)["param"] == "model"


def test_engine_fault_mid_stream_is_response_failed(guarded_server):
    with httpx.Client(
        base_url=guarded_server.url, timeout=60, headers={"Authorization": f"Bearer {ENV_KEYS[0]}"}
    ) as c:
        events = stream(
            c,
            {
                "model": None,
                "input": "hi",
                "seed": GUARD_FAULT_SEED,
                "max_output_tokens": 20,
                "ignore_eos": True,
            },
        )
    assert events[-1]["type"] == "response.failed"
    err = events[-1]["response"]["error"]
    assert err["code"] == "server_error" and "injected engine fault" in err["message"]


class Verdict(BaseModel):
    answer: Literal["yes", "no"]


@pytest.mark.parametrize("streamed", [False, True])
def test_openai_agents_tool_loop(server, streamed):
    """openai-agents' default model class speaks the Responses API: a forced tool call, the
    tool's output sent back, then a final structured answer."""
    import asyncio

    pytest.importorskip("agents", reason="openai-agents is not installed here")
    from agents import (
        Agent,
        ModelSettings,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI
    from openai.types.shared import Reasoning

    calls = []

    @function_tool
    def get_weather(city: Literal["Paris", "Rome"], days: Annotated[int, Field(ge=1, le=7)]) -> str:
        """The weather forecast for a city."""
        calls.append((city, days))
        return f"sunny in {city} for {days} days"

    async def main():
        set_tracing_disabled(True)
        client = AsyncOpenAI(base_url=server.url + "/v1", api_key=KEYS[0], max_retries=0)
        settings = ModelSettings(
            tool_choice="required",
            max_tokens=150,
            extra_body={"seed": 3},
            reasoning=Reasoning(effort="none"),
        )
        agent = Agent(
            name="forecaster",
            instructions="Use the tool, then answer.",
            model=OpenAIResponsesModel("tiny", client),
            tools=[get_weather],
            output_type=Verdict,
            model_settings=settings,
        )
        question = "Weather in Paris for 3 days?"
        if not streamed:
            return await Runner.run(agent, question, max_turns=4)
        run = Runner.run_streamed(agent, question, max_turns=4)
        async for _ in run.stream_events():
            pass
        return run

    result = asyncio.run(main())
    assert calls and all(c in ("Paris", "Rome") and 1 <= d <= 7 for c, d in calls)
    kinds = [type(i).__name__ for i in result.new_items]
    assert kinds[0] == "ToolCallItem" and "ToolCallOutputItem" in kinds
    assert kinds[-1] == "MessageOutputItem" and isinstance(result.final_output, Verdict)
