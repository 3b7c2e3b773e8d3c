"""Constrained decoding on the test tokenizer: random walks through the grammar's masks must
give JSON that validates (checked by `jsonschema`) and tool calls our parser accepts."""

import json
import random

import jsonschema
import pytest
import torch

from lily.server.grammar import GrammarCompiler, json_grammar, tool_grammar
from lily.server.protocol import ApiError
from lily.server.tools import ToolCallParser
from lily.tokenizer import Tokenizer
from lily.tokenizer_files import write_test_tokenizer

V = 512  # the tiny model's vocabulary (the tokenizer's ids all fit below it)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    write_test_tokenizer(d, V)
    return Tokenizer.from_dir(d)


def walk(tok, proc, rng, prefix=(), limit=400):
    """Sample uniformly among allowed tokens (EOS half the time it is allowed)."""
    generated = list(prefix)
    eos = set(tok.eos_token_ids)
    for _ in range(limit):
        logits = torch.zeros(V)
        allowed = torch.isfinite(proc(generated, logits)).nonzero().flatten().tolist()
        assert allowed, "the grammar left nothing to sample"
        ends = [t for t in allowed if t in eos]
        if ends and (rng.random() < 0.5 or len(ends) == len(allowed)):
            return generated[len(prefix) :], True
        generated.append(rng.choice([t for t in allowed if t not in eos]))
    return generated[len(prefix) :], False


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 4},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "ok": {"type": "boolean"},
        "kind": {"enum": ["cat", "dog"]},
        "tags": {"type": "array", "items": {"enum": [1, 2]}, "maxItems": 2},
    },
    "required": ["name", "age", "ok", "kind", "tags"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("seed", range(6))
def test_json_schema_walks_validate(tok, seed):
    gc = GrammarCompiler(tok)
    proc = gc.processor(json_grammar(SCHEMA, False), V, False, "response_format")
    ids, ended = walk(tok, proc, random.Random(seed))
    assert ended
    jsonschema.validate(json.loads(tok.decode(ids)), SCHEMA)


def test_json_object_rejects_non_object_text(tok):
    gc = GrammarCompiler(tok)
    proc = gc.processor(json_grammar({"type": "object"}, False), V, False, "response_format")
    logits = proc([], torch.zeros(V))
    allowed = {tok.decode([t]) for t in torch.isfinite(logits).nonzero().flatten().tolist()}
    assert allowed and all(t.startswith("{") for t in allowed)


def test_constraint_starts_after_think(tok):
    gc = GrammarCompiler(tok)
    proc = gc.processor(json_grammar(SCHEMA, True), V, True, "response_format")
    free = torch.randn(V)
    thinking = tok.encode("hmm, let me think")
    assert torch.equal(proc(thinking, free), free)  # reasoning is not constrained
    after = proc([*thinking, tok.think_end_id], free)
    allowed = {tok.decode([t]) for t in torch.isfinite(after).nonzero().flatten().tolist()}
    assert allowed and all(t.lstrip("\n").startswith("{") or t == "\n" for t in allowed)
    rng = random.Random(0)
    ids, ended = walk(tok, proc, rng, prefix=[*thinking, tok.think_end_id])
    assert ended
    jsonschema.validate(json.loads(tok.decode(ids)), SCHEMA)


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "set_alarm",
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
    },
    {
        "type": "function",
        "function": {
            "name": "ping",
            "parameters": {"type": "object", "properties": {"n": {"type": "integer"}}},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "note",
            "parameters": {
                "type": "object",
                "properties": {"label": {"type": "string"}, "n": {"type": "integer"}},
                "required": ["label", "n"],
            },
        },
    },
]


@pytest.mark.parametrize("seed", range(4))
def test_named_tool_walks_parse_and_match_schema(tok, seed):
    gc = GrammarCompiler(tok)
    grammar = tool_grammar(TOOLS, "set_alarm", False)
    proc = gc.processor(grammar, V, False, "tool_choice")
    ids, ended = walk(tok, proc, random.Random(seed), limit=600)
    text = tok.decode(ids)
    if not ended:
        pytest.fail(f"walk did not finish: {text!r}")
    parser = ToolCallParser(TOOLS)
    d = parser.feed(text)
    d.extend(parser.finish())
    assert d.content == ""
    assert [c.name for c in parser.calls] == ["set_alarm"]
    args = json.loads(parser.calls[0].arguments)
    jsonschema.validate(args, TOOLS[0]["function"]["parameters"])


def test_tool_grammar_accepts_multiline_strings_and_rejects_bad_values(tok):
    gc = GrammarCompiler(tok)
    good = (
        "<tool_call>\n<function=note>\n<parameter=label>\nwake <up>\n</param\n"
        "</parameter>\n<parameter=n>\n7\n</parameter>\n</function>\n</tool_call>"
    )
    m = gc.processor(tool_grammar(TOOLS, None, False), V, False, "tool_choice").matcher
    assert m.consume_tokens(tok.encode(good)) and not m.is_error()
    assert m.is_accepting()
    bad = good.replace("<parameter=n>\n7", "<parameter=n>\nseven")
    m = gc.processor(tool_grammar(TOOLS, None, False), V, False, "tool_choice").matcher
    m.consume_tokens(tok.encode(bad))
    assert m.is_error()


def test_bad_schema_is_a_400(tok):
    gc = GrammarCompiler(tok)
    with pytest.raises(ApiError) as e:
        gc.processor(json_grammar({"type": "no-such-type"}, False), V, False, "response_format")
    assert e.value.status == 400 and e.value.param == "response_format"
