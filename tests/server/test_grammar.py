"""Constrained decoding on the test tokenizer: random walks through the grammar's masks must
give JSON that validates (checked by `jsonschema`) and tool calls our parser accepts."""

import json
import math
import random

import jsonschema
import pytest
import torch

from lily.server.constraints import Processor
from lily.server.grammar import ConstraintFailed, GrammarCompiler, json_grammar, tool_grammar
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


def constrained(tok, text, after_think=False, param="response_format"):
    """A processor applying grammar ``text`` (after ``</think>`` with ``after_think``)."""
    g = GrammarCompiler(tok).grammar(text, V, param)
    think_end = tok.think_end_id if after_think else None
    return Processor(V, eos_ids=list(tok.eos_token_ids), grammar=g, think_end=think_end)


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
    proc = constrained(tok, json_grammar(SCHEMA, False))
    ids, ended = walk(tok, proc, random.Random(seed))
    assert ended
    jsonschema.validate(json.loads(tok.decode(ids)), SCHEMA)


def test_json_object_rejects_non_object_text(tok):
    proc = constrained(tok, json_grammar({"type": "object"}, False))
    logits = proc([], torch.zeros(V))
    allowed = {tok.decode([t]) for t in torch.isfinite(logits).nonzero().flatten().tolist()}
    assert allowed and all(t.startswith("{") for t in allowed)


def test_constraint_starts_after_think(tok):
    proc = constrained(tok, json_grammar(SCHEMA, True), after_think=True)
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
    proc = constrained(tok, tool_grammar(TOOLS, "set_alarm", False), param="tool_choice")
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
    good = (
        "<tool_call>\n<function=note>\n<parameter=label>\nwake <up>\n</param\n"
        "</parameter>\n<parameter=n>\n7\n</parameter>\n</function>\n</tool_call>"
    )
    m = constrained(tok, tool_grammar(TOOLS, None, False), param="tool_choice").grammar.matcher
    assert m.consume_tokens(tok.encode(good)) and not m.is_error()
    assert m.is_accepting()
    bad = good.replace("<parameter=n>\n7", "<parameter=n>\nseven")
    m = constrained(tok, tool_grammar(TOOLS, None, False), param="tool_choice").grammar.matcher
    m.consume_tokens(tok.encode(bad))
    assert m.is_error()


def test_bad_schema_is_a_400(tok):
    with pytest.raises(ApiError) as e:
        constrained(tok, json_grammar({"type": "no-such-type"}, False))
    assert e.value.status == 400 and e.value.param == "response_format"


# Schemas llguidance gives up on within a few tokens (what the request check must catch).
GIVE_UP = {
    "pattern": {"type": "string", "pattern": "^(a{1000}){1000}$"},
    "nested-pattern": {
        "type": "object",
        "properties": {"s": {"type": "string", "pattern": "^(a{1000}){1000}$"}},
        "required": ["s"],
    },
    "recursive-ref": {
        "$ref": "#/$defs/a",
        "$defs": {
            "a": {"type": "object", "required": ["x"], "properties": {"x": {"$ref": "#/$defs/a"}}}
        },
    },
}
# One it gives up on only after a 30-character string, past the request check's probe walk.
LATE_FAILING = {
    "type": "object",
    "properties": {
        "a": {"type": "string", "minLength": 30, "maxLength": 30},
        "b": {"type": "string", "pattern": "^(a{1000}){1000}$"},
    },
    "required": ["a", "b"],
}


@pytest.mark.parametrize("schema", list(GIVE_UP.values()), ids=list(GIVE_UP))
def test_schema_the_engine_gives_up_on_is_a_400_before_generation(tok, schema):
    with pytest.raises(ApiError) as e:
        constrained(tok, json_grammar(schema, False))
    assert e.value.status == 400 and e.value.param == "response_format"
    assert "could not be applied" in e.value.message


def test_constraint_failing_while_generating_raises(tok):
    """A pattern the probe walk does not reach (behind a 30-character string) fails when the
    model gets there: an exception out of the decode loop, never an EOS-only mask."""
    proc = constrained(tok, json_grammar(LATE_FAILING, False))  # passes the probe
    text = '{"a": "' + "x" * 30 + '", "b": "aaa'
    generated = []
    with pytest.raises(ConstraintFailed, match="too many expressions") as e:
        for t in tok.encode(text):
            proc(generated, torch.zeros(V))
            generated.append(t)
    assert e.value.param == "response_format"


ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "number"},
                "b": {"type": "number"},
                "n": {"type": "integer"},
                "who": {"type": "string", "minLength": 2, "maxLength": 5},
            },
            "required": ["a", "b", "n", "who"],
        },
    },
}


@pytest.mark.parametrize("seed", range(6))
def test_forced_call_values_have_their_schema_types(tok, seed):
    """Random walks: numbers are finite JSON numbers, integers fit in 64 bits, strings keep
    their length bounds, whatever tokens the model picks."""
    proc = constrained(tok, tool_grammar([ADD], "add", False), param="tool_choice")
    ids, ended = walk(tok, proc, random.Random(seed), limit=600)
    assert ended, tok.decode(ids)
    parser = ToolCallParser([ADD])
    parser.feed(tok.decode(ids))
    parser.finish()
    args = json.loads(parser.calls[0].arguments)
    jsonschema.validate(args, ADD["function"]["parameters"])
    assert all(math.isfinite(args[k]) for k in "ab")
    assert type(args["n"]) is int and abs(args["n"]) < 2**63
    assert 2 <= len(args["who"]) <= 5


def test_number_grammar_refuses_an_overflowing_exponent(tok):
    """The issue's "842e07588848" is valid JSON but infinite as a double: not allowed."""

    def accepts(value):
        text = f"<tool_call>\n<function=add>\n<parameter=a>\n{value}\n</parameter>\n"
        m = constrained(tok, tool_grammar([ADD], "add", False), param="tool_choice")
        m = m.grammar.matcher
        m.consume_tokens(tok.encode(text))
        return not m.is_error()

    assert accepts("-12.5") and accepts("1.5e10") and accepts("0")
    assert not accepts("842e07588848") and not accepts("1e999") and not accepts("x")


def test_one_call_only_when_not_parallel(tok):
    call = "<tool_call>\n<function=ping>\n</function>\n</tool_call>"
    for parallel, ok in ((True, True), (False, False)):
        proc = constrained(tok, tool_grammar(TOOLS, None, False, parallel), param="tool_choice")
        m = proc.grammar.matcher
        m.consume_tokens(tok.encode(call + "\n" + call))
        assert (not m.is_error()) is ok
