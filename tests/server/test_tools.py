"""Tool-call parser: XML and JSON forms, schema conversion, streaming in any split."""

import json
import random

import pytest

from lily.server.tools import ToolCallParser, convert_value

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "metric": {"type": "boolean"},
                    "ratio": {"type": "number"},
                    "tags": {"type": "array", "items": {"type": "string"}},
                    "opts": {"type": "object"},
                    "note": {"type": ["string", "null"]},
                },
            },
        },
    },
    {"type": "function", "function": {"name": "noop", "parameters": {"type": "object"}}},
]

XML = (
    "Let me check.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n"
    "</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=metric>\nTrue\n</parameter>\n"
    '<parameter=ratio>\n0.5\n</parameter>\n<parameter=tags>\n["a", "b"]\n</parameter>\n'
    "<parameter=opts>\n{'deep': {'x': 1}}\n</parameter>\n<parameter=note>\nnull\n</parameter>\n"
    "</function>\n</tool_call>\n<tool_call>\n<function=noop>\n</function>\n</tool_call>"
)
EXPECTED_ARGS = [
    {
        "city": "New York",
        "days": 3,
        "metric": True,
        "ratio": 0.5,
        "tags": ["a", "b"],
        "opts": {"deep": {"x": 1}},
        "note": None,
    },
    {},
]


def run(parser: ToolCallParser, pieces: list[str]):
    content, calls = "", {}
    for piece in [*pieces, None]:
        d = parser.feed(piece) if piece is not None else parser.finish()
        content += d.content
        for tc in d.tool_calls:
            if tc.id is not None:
                assert tc.index not in calls and tc.arguments == ""
                calls[tc.index] = {"id": tc.id, "name": tc.name, "arguments": ""}
            calls[tc.index]["arguments"] += tc.arguments
    return content, [calls[i] for i in sorted(calls)]


def split_randomly(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, len(text) // 3)))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def test_xml_whole():
    content, calls = run(ToolCallParser(TOOLS), [XML])
    assert content == "Let me check.\n\n"
    assert [c["name"] for c in calls] == ["get_weather", "noop"]
    assert [json.loads(c["arguments"]) for c in calls] == EXPECTED_ARGS
    assert calls[0]["id"].startswith("call_") and calls[0]["id"] != calls[1]["id"]


@pytest.mark.parametrize("seed", range(25))
def test_xml_streamed_in_random_pieces(seed):
    """Any split of the text gives the same content and arguments as the whole text."""
    rng = random.Random(seed)
    content, calls = run(ToolCallParser(TOOLS), split_randomly(XML, rng))
    assert content == "Let me check.\n\n"
    assert [json.loads(c["arguments"]) for c in calls] == EXPECTED_ARGS


def test_char_by_char_never_leaks_tags():
    parser = ToolCallParser(TOOLS)
    pieces = list(XML)
    content, calls = run(parser, pieces)
    assert "<" not in content and "tool_call" not in content
    assert len(calls) == 2


def test_string_values_stream_before_close_and_keep_inner_newlines():
    parser = ToolCallParser(TOOLS)
    d = parser.feed("<tool_call>\n<function=get_weather>\n<parameter=city>\nline one\nline")
    frags = [tc.arguments for tc in d.tool_calls]
    assert frags[0] == "" and "line one" in "".join(frags)  # streamed before </parameter>
    d2 = parser.feed(" two\n</parameter>\n</function>\n</tool_call>")
    d3 = parser.finish()
    args = "".join(tc.arguments for tc in d.tool_calls + d2.tool_calls + d3.tool_calls)
    assert json.loads(args) == {"city": "line one\nline two"}


def test_json_inside_tool_call():
    text = 'ok <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    content, calls = run(ToolCallParser(TOOLS), [text])
    assert content == "ok "
    assert calls[0]["name"] == "get_weather"
    assert json.loads(calls[0]["arguments"]) == {"city": "Oslo"}


def test_unfinished_call_still_gives_valid_json():
    text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar"
    content, calls = run(ToolCallParser(TOOLS), [text])
    assert content == ""
    assert json.loads(calls[0]["arguments"]) == {"city": "Par"}


def test_plain_text_and_lookalikes_pass_through():
    text = "a < b and <tool> is not <tool_call but x<y"
    content, calls = run(ToolCallParser(TOOLS), list(text))
    assert content == text and calls == []


def test_missing_close_parameter_tag():
    text = (
        "<tool_call>\n<function=get_weather>\n<parameter=days>\n7\n<parameter=city>\nRome\n"
        "</function>\n</tool_call>"
    )
    _, calls = run(ToolCallParser(TOOLS), [text])
    assert json.loads(calls[0]["arguments"]) == {"days": 7, "city": "Rome"}


@pytest.mark.parametrize(
    "raw,schema,expected",
    [
        ("42", {"type": "integer"}, 42),
        ("-7", {"type": "integer"}, -7),
        ("4.0", {"type": "integer"}, 4),
        ("2.5", {"type": "number"}, 2.5),
        ("1e3", {"type": "number"}, 1000.0),
        ("false", {"type": "boolean"}, False),
        ("None", {"type": "null"}, None),
        ('{"a": [1, 2]}', {"type": "object"}, {"a": [1, 2]}),
        ("[1, 'x']", {"type": "array"}, [1, "x"]),
        ("42", {"type": "string"}, "42"),
        ("42", None, "42"),
        ("nope", {"type": "integer"}, "nope"),  # unconvertible stays text
        ("nan", {"type": "number"}, "nan"),  # JSON has no NaN
        ("842e07588848", {"type": "number"}, "842e07588848"),  # infinite as a double: text
        ("7", {"anyOf": [{"type": "integer"}, {"type": "string"}]}, 7),
        ("x", {"enum": ["x", "y"]}, "x"),
    ],
)
def test_convert_value(raw, schema, expected):
    got = convert_value(raw, schema)
    assert got == expected and type(got) is type(expected)


def test_streamed_arguments_equal_the_calls_arguments():
    """The non-streamed response reads ``calls[i].arguments``; it must hold the string value
    streamed in pieces, not only the part after the last piece (it held ``{"city": ""}``)."""
    parser = ToolCallParser(TOOLS)
    content, calls = run(parser, list(XML))
    assert [c.arguments for c in parser.calls] == [c["arguments"] for c in calls]
    assert [json.loads(c.arguments) for c in parser.calls] == EXPECTED_ARGS


CUT = [
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nPar", '{"city": "Par'),
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</para", '{"city": "Paris'),
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
     "<parameter=days>\n1", '{"city": "Paris", "days": 1'),
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n",
     '{"city": "Paris"'),
    ("<tool_call>\n<function=get_weather>\n", ""),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Os', '{"city": "Os'),
]  # fmt: skip


@pytest.mark.parametrize("text,args", CUT)
def test_call_cut_by_max_tokens_is_left_as_generated(text, args):
    """A call cut short keeps the arguments as generated (no invented closing), and the
    streamed pieces join to the same text whatever the split."""
    for pieces in ([text], list(text)):
        parser = ToolCallParser(TOOLS)
        content, calls = run_cut(parser, pieces)
        assert content == "" and [c["name"] for c in calls] == ["get_weather"]
        assert calls[0]["arguments"] == args == parser.calls[0].arguments
        with pytest.raises(ValueError):
            json.loads(args)


def run_cut(parser, pieces):
    content, calls = "", {}
    for piece in [*pieces, None]:
        d = parser.feed(piece) if piece is not None else parser.finish(truncated=True)
        content += d.content
        for tc in d.tool_calls:
            if tc.id is not None:
                calls[tc.index] = {"name": tc.name, "arguments": ""}
            calls[tc.index]["arguments"] += tc.arguments
    return content, [calls[i] for i in sorted(calls)]


def test_a_cut_call_header_leaks_no_tag_text():
    content, calls = run_cut(ToolCallParser(TOOLS), ["Hi <tool_call>\n<func"])
    assert content == "Hi " and calls == []


def test_max_calls_keeps_the_first_call_only():
    parser = ToolCallParser(TOOLS, max_calls=1)
    content, calls = run(parser, list(XML + " tail"))
    assert [c["name"] for c in calls] == ["get_weather"] and len(parser.calls) == 1
    assert json.loads(calls[0]["arguments"]) == EXPECTED_ARGS[0]
    assert "noop" not in content and "tool_call" not in content
