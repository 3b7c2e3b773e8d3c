"""The OpenAI API on a live server, driven by the official ``openai`` client and raw httpx.

The tiny model is random, so the tests check the wire (shapes, counts, equalities between
paths, constraints) rather than what the text says.
"""

from __future__ import annotations

import json

import jinja2
import jsonschema
import pytest
from tokenizers import Tokenizer as HFTokenizer

from tests.server.conftest import MAX_CONTEXT

MSGS = [{"role": "user", "content": "Say something."}]
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}


def prompt_text(model_dir, messages, enable_thinking=True, tools=None,
                add_generation_prompt=True) -> str:  # fmt: skip
    """The prompt rendered independently: plain jinja2."""
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda v, **k: json.dumps(v, ensure_ascii=False)
    return env.from_string((model_dir / "chat_template.jinja").read_text()).render(
        messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
        enable_thinking=enable_thinking,
    )  # fmt: skip


def prompt_len(model_dir, messages, enable_thinking=True, tools=None) -> int:
    """Prompt tokens counted independently: plain jinja2 render, `tokenizers` encode."""
    text = prompt_text(model_dir, messages, enable_thinking, tools)
    tok = HFTokenizer.from_file(str(model_dir / "tokenizer.json"))
    return len(tok.encode(text, add_special_tokens=False).ids)


def test_models_lists_names_with_context(client):
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny", "tiny-alias"]
    assert all(m.model_extra["max_model_len"] == MAX_CONTEXT for m in models)


def test_chat_non_stream_usage_and_shape(client, model_dir):
    r = client.chat.completions.create(
        model="tiny", messages=MSGS, max_tokens=6, seed=1, extra_body={"ignore_eos": True},
        logprobs=True, top_logprobs=2,
    )  # fmt: skip
    c = r.choices[0]
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert c.finish_reason == "length"
    assert r.usage.prompt_tokens == prompt_len(model_dir, MSGS)
    assert r.usage.completion_tokens == 6 == len(c.logprobs.content)
    assert r.usage.total_tokens == r.usage.prompt_tokens + 6
    assert all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in c.logprobs.content)
    # Thinking is on by default and the random model never closes it: all reasoning.
    msg = c.message.model_dump()
    assert msg["content"] is None and "tool_calls" not in r.choices[0].message.model_extra
    assert msg["reasoning_content"] == msg["reasoning"] and len(msg["reasoning"]) > 0
    assert r.usage.completion_tokens_details.reasoning_tokens == 6


def test_stream_equals_non_stream(client):
    kw = dict(model="tiny", messages=MSGS, max_tokens=8, seed=7, temperature=1.0,
              logprobs=True, top_logprobs=1,
              extra_body={"ignore_eos": True, **NO_THINK})  # fmt: skip
    full = client.chat.completions.create(**kw)
    chunks = list(
        client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == full.choices[0].message.content and text
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    assert finishes[-1] == "length" and finishes.count("length") == 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    streamed_lp = [e for ch in chunks if ch.choices and ch.choices[0].logprobs
                   for e in ch.choices[0].logprobs.content]  # fmt: skip
    assert [e.model_dump() for e in streamed_lp] == [
        e.model_dump() for e in full.choices[0].logprobs.content
    ]
    assert len(streamed_lp) == 8
    # Thinking off: no reasoning at all.
    assert "reasoning_content" not in full.choices[0].message.model_extra


def test_greedy_logprobs_pick_the_top_token(client):
    r = client.chat.completions.create(
        model="tiny", messages=MSGS, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    for e in r.choices[0].logprobs.content:
        assert e.logprob == pytest.approx(e.top_logprobs[0].logprob, abs=1e-5)
        assert [t.logprob for t in e.top_logprobs] == sorted(
            (t.logprob for t in e.top_logprobs), reverse=True
        )


def test_completions_stream_non_stream_stop_and_echo(client):
    kw = dict(model="tiny-alias", prompt="The quick brown fox", max_tokens=10, seed=3,
              extra_body={"ignore_eos": True})  # fmt: skip
    full = client.completions.create(**kw, logprobs=2)
    assert full.object == "text_completion" and full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 10
    lp = full.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 10
    assert lp.text_offset == sorted(lp.text_offset)
    # Keyed by token text, so two tokens that decode alike (partial UTF-8) share a key.
    assert all(1 <= len(t) <= 2 for t in lp.top_logprobs)
    text = full.choices[0].text
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(**kw, stream=True))
    assert streamed == text
    # A stop string taken from the middle of the output ends it just before.
    stop = text[3:5]
    cut = client.completions.create(**{**kw, "stop": [stop]})
    assert cut.choices[0].text == text[: text.find(stop)]
    assert cut.choices[0].finish_reason == "stop"
    echo = client.completions.create(**kw, echo=True)
    assert echo.choices[0].text == "The quick brown fox" + text


def test_max_completion_tokens_wins(client):
    r = client.chat.completions.create(
        model="tiny", messages=MSGS, max_tokens=5, max_completion_tokens=2,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert r.usage.completion_tokens == 2


def test_generation_config_defaults_apply_when_silent(client, model_dir):
    gen = json.loads((model_dir / "generation_config.json").read_text())
    kw = dict(model="tiny", messages=MSGS, max_tokens=8, seed=11)
    eos = {"ignore_eos": True}
    silent = client.chat.completions.create(**kw, extra_body=eos).choices[0].message
    explicit = client.chat.completions.create(
        **kw, temperature=gen["temperature"], top_p=gen["top_p"],
        extra_body={**eos, "top_k": gen["top_k"]},
    ).choices[0].message  # fmt: skip
    other = (
        client.chat.completions.create(
            **kw, temperature=1.0, top_p=1.0, extra_body={**eos, "top_k": 0}
        )
        .choices[0]
        .message
    )
    assert silent.model_dump() == explicit.model_dump() != other.model_dump()


def test_assistant_reasoning_under_both_names(client, model_dir):
    base = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    with_r = [base[0], {**base[1], "reasoning_content": "alpha beta gamma"}]
    alias = [base[0], {**base[1], "reasoning": "alpha beta gamma"}]
    counts = []
    for msgs in (base, with_r, alias):
        r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=1)
        counts.append(r.usage.prompt_tokens)
    assert counts[1] == counts[2] == prompt_len(model_dir, with_r) > counts[0]


TOOL = {
    "type": "function",
    "function": {
        "name": "set_alarm",
        "description": "Set an alarm",
        "parameters": {
            "type": "object",
            "properties": {
                "hour": {"type": "integer", "minimum": 0, "maximum": 23},
                "loud": {"type": "boolean"},
                "day": {"type": "string", "enum": ["mon", "tue"]},
            },
            "required": ["hour", "loud", "day"],
        },
    },
}
PING = {"type": "function", "function": {"name": "ping", "parameters": {"type": "object",
        "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}}}  # fmt: skip


def test_tool_choice_required_non_stream(client):
    # One call: the grammar then ends the reply. (With parallel calls the random model may
    # go on calling until max_tokens, as a seed of the random stream decides.)
    r = client.chat.completions.create(
        model="tiny", messages=MSGS, tools=[TOOL, PING], tool_choice="required", max_tokens=120,
        seed=5, parallel_tool_calls=False, extra_body=NO_THINK,
    )  # fmt: skip
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    assert len(c.message.tool_calls) == 1 and c.message.tool_calls[0].id.startswith("call_")
    for call in c.message.tool_calls:
        tool = {"set_alarm": TOOL, "ping": PING}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_named_tool_choice_streamed(client):
    stream = client.chat.completions.create(
        model="tiny", messages=MSGS, tools=[TOOL, PING], max_tokens=120, seed=9, stream=True,
        tool_choice={"type": "function", "function": {"name": "set_alarm"}}, extra_body=NO_THINK,
    )  # fmt: skip
    chunks = list(stream)
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    assert "".join(d.content or "" for d in deltas) == ""  # no tag text leaks
    pieces = [tc for d in deltas for tc in d.tool_calls or []]
    first = pieces[0]
    assert first.index == 0 and first.id.startswith("call_") and first.type == "function"
    assert first.function.name == "set_alarm" and first.function.arguments == ""
    assert all(p.index == 0 and p.id is None for p in pieces[1:]) and len(pieces) > 1
    args = json.loads("".join(p.function.arguments for p in pieces))
    jsonschema.validate(args, TOOL["function"]["parameters"])
    assert [ch.choices[0].finish_reason for ch in chunks][-1] == "tool_calls"


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 5},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "pet": {"enum": ["cat", "dog"]},
    },
    "required": ["name", "n", "pet"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_output_validates(client, stream):
    kw = dict(model="tiny", messages=MSGS, max_tokens=60, seed=2, extra_body=NO_THINK,
              response_format={"type": "json_schema",
                               "json_schema": {"name": "x", "schema": SCHEMA}})  # fmt: skip
    if stream:
        chunks = list(client.chat.completions.create(**kw, stream=True))
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    else:
        text = client.chat.completions.create(**kw).choices[0].message.content
    jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_output_starts_an_object(client):
    r = client.chat.completions.create(
        model="tiny", messages=MSGS, max_tokens=3, seed=2, extra_body=NO_THINK,
        response_format={"type": "json_object"},
    )  # fmt: skip
    assert r.choices[0].message.content.startswith("{")


def test_unknown_fields_are_ignored(http):
    body = {"model": "tiny", "messages": MSGS, "max_tokens": 1, "user": "u", "store": False,
            "metadata": {"a": "b"}, "some_future_field": [1, 2]}  # fmt: skip
    assert http.post("/v1/chat/completions", json=body).status_code == 200


def test_metrics_count_requests(http, client):
    def scrape() -> dict[str, float]:
        out = {}
        for line in http.get("/metrics").text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name.split("{")[0] if "le=" not in name else name] = float(value)
        return out

    before = scrape()
    r = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=3)
    again = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=3)
    after = scrape()

    def delta(name: str) -> float:
        return after["lily:" + name] - before["lily:" + name]

    assert delta("prompt_tokens_total") == r.usage.prompt_tokens + again.usage.prompt_tokens
    used = r.usage.completion_tokens + again.usage.completion_tokens
    assert delta("generation_tokens_total") == used
    assert delta("prefix_cache_queries_total") == delta("prompt_tokens_total")
    hits = again.usage.prompt_tokens_details.cached_tokens
    assert hits > 0  # the same prompt again reuses saved state
    assert delta("prefix_cache_hits_total") == r.usage.prompt_tokens_details.cached_tokens + hits
    assert delta("e2e_request_latency_seconds_count") == 2
    assert delta("time_to_first_token_seconds_count") == 2
    assert delta("inter_token_latency_seconds_count") == used - 2
    assert after["lily:num_requests_running"] == 0 and after["lily:num_requests_waiting"] == 0
