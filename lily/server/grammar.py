"""Constrained decoding with llguidance: JSON schema / JSON object output and forced tool calls.

A grammar is compiled per request and checked before the request is queued: one that
llguidance rejects, or gives up on in a short probe walk (a regex too large to build, a
schema whose recursion never ends), is a 400. One that fails later, while generating, raises
``ConstraintFailed`` out of the decode loop, so the client sees an error and never a normal
answer that breaks the constraint. ``Processor`` (lily/server/constraints.py) applies it.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import torch

from lily.server.protocol import bad_request

try:
    import llguidance as llg
    from llguidance._tokenizer import TokenizerWrapper
except ImportError:  # pragma: no cover - reported as a 400 when a request needs it
    llg = None

# Compact but readable JSON, as the model writes it; no free whitespace, so a weak model
# cannot wander off into blank space.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# A string parameter value runs until the first "\n</parameter>", which ends the lexeme;
# SPAN is "*" or a minLength/maxLength count.
_STRING_LEXEME = r"/(?s:.SPAN)\n<\/parameter>/ & ~/(?s:.*)<\/parameter>(?s:.+)/"
_STRING_TOKEN = "STRING_VALUE: " + _STRING_LEXEME.replace("SPAN", "*")
_STRING_VALUE = "STRING_VALUE"
# A bare number parameter: JSON's number with at most 16 digits either side of the point and
# a two-digit exponent, so the value is always a finite double ("842e07588848" is valid JSON
# but overflows every client's parser to infinity); a bare integer fits in 64 bits.
_NUMBER_TOKENS = (
    r"NUMBER_VALUE: /-?(0|[1-9][0-9]{0,15})(\.[0-9]{1,16})?([eE][+-]?[0-9]{1,2})?/",
    r"INTEGER_VALUE: /-?(0|[1-9][0-9]{0,17})/",
)
_NUMBER_KEYS = {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
                "enum", "const", "anyOf", "oneOf", "allOf", "not", "$ref"}  # fmt: skip
MAX_COUNTED = 4096  # longest minLength/maxLength of a raw string value the grammar counts
PROBE_STEPS = 24  # tokens of the probe walk made before a request is queued


class ConstraintFailed(ValueError):
    """The grammar engine gave up while generating (a schema too large or recursive for it)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: the constraint could not be applied: {message}")
        self.param = param


def _short(error: str) -> str:
    # llguidance appends a dump of its parser state; the first line says what went wrong.
    return error.strip().split("\n", 1)[0][:300]


class _Vocab:
    """What llguidance's TokenizerWrapper reads: token bytes, EOS and an encoder."""

    def __init__(self, tokenizer: Any, n_vocab: int) -> None:
        self.eos_token_id = tokenizer.eos_token_ids[0]
        self.bos_token_id = None
        self.special_token_ids = sorted(tokenizer.special_ids)
        self.tokens = [
            (tokenizer.token_bytes(i) or b"") if i < tokenizer.vocab_size else b""
            for i in range(n_vocab)
        ]
        self._encode = tokenizer.encode

    def __call__(self, text: str) -> list[int]:
        return self._encode(text)


class Grammar:
    """One request's matcher: fed the answer's tokens, it gives the mask of allowed ones."""

    def __init__(self, matcher: Any, n_vocab: int, eos_ids: list[int], param: str) -> None:
        self.matcher = matcher
        self.n_vocab = n_vocab
        self.param = param
        self._eos = eos_ids
        self._words = torch.empty((n_vocab + 31) // 32, dtype=torch.int32)
        self._shifts = torch.arange(32, dtype=torch.int32)

    def feed(self, ids: list[int]) -> None:
        """Consume generated tokens; raises ConstraintFailed when the matcher gives up."""
        m = self.matcher
        if ids and not m.is_stopped():  # past the end (ignore_eos) there is nothing to match
            m.consume_tokens(ids)
        if m.is_error():
            raise ConstraintFailed(self.param, _short(m.get_error()))

    def mask(self) -> torch.Tensor:
        """Bool (V,) of the tokens allowed now; EOS alone once the grammar is complete."""
        m = self.matcher
        if m.is_stopped():
            allowed = torch.zeros(self.n_vocab, dtype=torch.bool)
            allowed[self._eos] = True
            return allowed
        m.unsafe_compute_mask_ptr(self._words.data_ptr(), self._words.numel() * 4)
        if m.is_error():
            raise ConstraintFailed(self.param, _short(m.get_error()))
        bits = (self._words.view(-1, 1) >> self._shifts) & 1
        return bits.flatten()[: self.n_vocab].bool()


class GrammarCompiler:
    """Builds matchers for one tokenizer; the llguidance tokenizer is made once per vocab size."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._ll: dict[int, Any] = {}
        self._lock = threading.Lock()

    def ll_tokenizer(self, n_vocab: int) -> Any:
        with self._lock:
            if n_vocab not in self._ll:
                wrapper = TokenizerWrapper(_Vocab(self.tokenizer, n_vocab))
                eos = list(self.tokenizer.eos_token_ids)
                self._ll[n_vocab] = llg.LLTokenizer(wrapper, n_vocab=n_vocab, eos_token=eos)
            return self._ll[n_vocab]

    def grammar(self, text: str, n_vocab: int, param: str) -> Grammar:
        """A checked matcher for grammar ``text``: one llguidance rejects is a 400, and so is
        one it gives up on within a short probe walk."""
        if llg is None:
            raise bad_request("constrained decoding needs the llguidance package", param)
        matcher = llg.LLMatcher(self.ll_tokenizer(n_vocab), text, log_level=0)
        if matcher.is_error():
            raise bad_request(f"{param}: cannot compile the constraint: {matcher.get_error()}",
                              param)  # fmt: skip
        eos = list(self.tokenizer.eos_token_ids)
        probe = Grammar(matcher.deep_copy(), n_vocab, eos, param)
        try:
            _probe_walk(probe, eos)
        except ConstraintFailed as e:
            raise bad_request(f"{e} (found while checking the request)", param) from None
        return Grammar(matcher, n_vocab, eos, param)


def _probe_walk(g: Grammar, eos: list[int]) -> None:
    """Walk the grammar taking the first allowed token that is not EOS each step: llguidance
    builds lexers and parser rows lazily, so what it cannot build (``(a{1000}){1000}``, a
    required property that recurses forever) fails here within the first few tokens."""
    banned = torch.zeros(g.n_vocab, dtype=torch.bool)
    banned[eos] = True
    for _ in range(PROBE_STEPS):
        allowed = g.mask() & ~banned
        nxt = allowed.nonzero()
        if nxt.numel() == 0:
            return
        g.feed([int(nxt[0])])


def _lark_json(schema: Any) -> str:
    return "%json " + json.dumps(schema)


def _wrap(body: str, after_think: bool) -> str:
    # After "</think>" the model writes a blank line before its answer; allow it.
    lead = "start: /\\n{0,2}/ body\n" if after_think else "start: body\n"
    return lead + "body: " + body + "\n"


def json_grammar(schema: Any, after_think: bool) -> str:
    """Grammar for a JSON value matching ``schema`` (``{"type": "object"}`` for json_object)."""
    if llg is None:
        raise bad_request("constrained decoding needs the llguidance package", "response_format")
    if not isinstance(schema, dict | bool):
        raise bad_request("response_format: the schema must be a JSON object", "response_format")
    schema = {**schema, "x-guidance": JSON_OPTIONS} if isinstance(schema, dict) else schema
    return llg.LLMatcher.grammar_from_lark(_wrap(_lark_json(schema), after_think))


def _string_rule(schema: dict[str, Any], name: str, rules: list[str]) -> str:
    """A raw string value; ``minLength``/``maxLength`` (up to MAX_COUNTED) become a lexeme of
    its own named ``name``."""
    lo, hi = schema.get("minLength"), schema.get("maxLength")
    lo = lo if isinstance(lo, int) and 0 < lo <= MAX_COUNTED else 0
    hi = hi if isinstance(hi, int) and lo <= hi <= MAX_COUNTED else None
    if not lo and hi is None:
        return _STRING_VALUE
    span = "{" + f"{lo},{'' if hi is None else hi}" + "}"
    rules.append(f"{name}: " + _STRING_LEXEME.replace("SPAN", span))
    return name


def _value_rule(schema: Any, name: str, rules: list[str]) -> str:
    """The rule body for one parameter's value, in the XML form (``name``: for a lexeme of
    its own, added to ``rules``)."""
    if not isinstance(schema, dict):
        return _STRING_VALUE
    t = schema.get("type")
    if "enum" in schema and all(isinstance(v, str) for v in schema["enum"]) and schema["enum"]:
        alts = " | ".join(json.dumps(v + "\n</parameter>") for v in schema["enum"])
        return f"({alts})"
    if t == "string" or (t is None and not schema.get("enum")):
        return _string_rule(schema, name, rules)
    if t in ("number", "integer") and not _NUMBER_KEYS & schema.keys():
        return f'{t.upper()}_VALUE "\\n</parameter>"'
    # The rest (bounded numbers, booleans, null, objects, arrays) are written as JSON text.
    return _lark_json({**schema, "x-guidance": JSON_OPTIONS}) + ' "\\n</parameter>"'


def tool_grammar(
    tools: list[dict[str, Any]], name: str | None, after_think: bool, parallel: bool = True
) -> str:
    """Grammar forcing tool calls: ``name`` gives exactly one call of that function, else one
    or more calls of any (exactly one when not ``parallel``).

    Required parameters come in schema order; optional ones may be left out. Each value is
    held to its schema's type (strings as raw text, the rest as JSON).
    """
    if llg is None:
        raise bad_request("constrained decoding needs the llguidance package", "tool_choice")
    rules: list[str] = []
    fn_alts = []
    for k, tool in enumerate(tools):
        fn = tool["function"]
        if name is not None and fn["name"] != name:
            continue
        params = fn.get("parameters") or {}
        props = params.get("properties") or {} if isinstance(params, dict) else {}
        required = set(params.get("required") or []) if isinstance(params, dict) else set()
        parts = []
        for j, (pname, pschema) in enumerate(props.items()):
            if "\n" in pname or ">" in pname:
                raise bad_request(f"tools: parameter name {pname!r} is not usable", "tools")
            head = json.dumps(f"<parameter={pname}>\n")
            value = _value_rule(pschema, f"STRING_{k}_{j}", rules)
            rules.append(f'p{k}_{j}: {head} {value} "\\n"')
            parts.append(f"p{k}_{j}" + ("" if pname in required else "?"))
        head = json.dumps(f"<function={fn['name']}>\n")
        rules.append(f'f{k}: {head} {" ".join(parts)} "</function>"')
        fn_alts.append(f"f{k}")
    if not fn_alts:
        raise bad_request(f"tool_choice: function {name!r} is not in tools", "tool_choice")
    calls = "call" if name is not None or not parallel else 'call ("\\n" call)*'
    lines = [
        ("start: /\\n{0,2}/ " if after_think else "start: ") + calls,
        'call: "<tool_call>\\n" (' + " | ".join(fn_alts) + ') "\\n</tool_call>"',
        *rules,
        _STRING_TOKEN,
        *_NUMBER_TOKENS,
    ]
    return llg.LLMatcher.grammar_from_lark("\n".join(lines) + "\n")
