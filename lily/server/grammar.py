"""Constrained decoding with llguidance: JSON schema / JSON object output and forced tool calls.

A grammar is compiled per request and applied through the engine's ``logits_processor``
hook: tokens the grammar cannot accept get -inf before sampling. When the prompt opened a
``<think>`` block the constraint starts after the ``</think>`` token, so reasoning is free.
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
# A string parameter value runs until the first "\n</parameter>", which ends the lexeme.
_STRING_TOKEN = r"STRING_VALUE: /(?s:.*)\n<\/parameter>/ & ~/(?s:.*)<\/parameter>(?s:.+)/"
_STRING_VALUE = "STRING_VALUE"


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

    def processor(self, grammar: str, n_vocab: int, after_think: bool, param: str) -> Processor:
        """A logits processor for ``grammar``; a grammar llguidance rejects is a 400."""
        if llg is None:
            raise bad_request("constrained decoding needs the llguidance package", param)
        matcher = llg.LLMatcher(self.ll_tokenizer(n_vocab), grammar, log_level=0)
        if matcher.is_error():
            raise bad_request(
                f"{param}: cannot compile the constraint: {matcher.get_error()}", param
            )
        think_end = self.tokenizer.think_end_id if after_think else None
        return Processor(matcher, n_vocab, think_end, list(self.tokenizer.eos_token_ids))


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


def _value_rule(schema: Any) -> str:
    """The rule body for one parameter's value, in the XML form."""
    if not isinstance(schema, dict):
        return _STRING_VALUE
    t = schema.get("type")
    if "enum" in schema and all(isinstance(v, str) for v in schema["enum"]) and schema["enum"]:
        alts = " | ".join(json.dumps(v + "\n</parameter>") for v in schema["enum"])
        return f"({alts})"
    if t == "string" or (t is None and not schema.get("enum")):
        return _STRING_VALUE
    # Numbers, booleans, null, objects and arrays are written as JSON text.
    return _lark_json({**schema, "x-guidance": JSON_OPTIONS}) + ' "\\n</parameter>"'


def tool_grammar(tools: list[dict[str, Any]], name: str | None, after_think: bool) -> str:
    """Grammar forcing one or more tool calls (``name``: exactly one call of that function).

    Required parameters come in schema order; optional ones may be left out.
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
            rules.append(f'p{k}_{j}: {head} {_value_rule(pschema)} "\\n"')
            parts.append(f"p{k}_{j}" + ("" if pname in required else "?"))
        head = json.dumps(f"<function={fn['name']}>\n")
        rules.append(f'f{k}: {head} {" ".join(parts)} "</function>"')
        fn_alts.append(f"f{k}")
    if not fn_alts:
        raise bad_request(f"tool_choice: function {name!r} is not in tools", "tool_choice")
    calls = "call" if name is not None else 'call ("\\n" call)*'
    lines = [
        ("start: /\\n{0,2}/ " if after_think else "start: ") + calls,
        'call: "<tool_call>\\n" (' + " | ".join(fn_alts) + ') "\\n</tool_call>"',
        *rules,
        _STRING_TOKEN,
    ]
    return llg.LLMatcher.grammar_from_lark("\n".join(lines) + "\n")


class Processor:
    """``logits_processor(generated_ids, logits)`` masking what the grammar forbids."""

    def __init__(
        self, matcher: Any, n_vocab: int, think_end: int | None, eos_ids: list[int]
    ) -> None:
        self.matcher = matcher
        self._eos = eos_ids
        self.n_vocab = n_vocab
        self._think_end = think_end
        self._start: int | None = 0 if think_end is None else None
        self._fed = 0
        self._words = torch.empty((n_vocab + 31) // 32, dtype=torch.int32)
        self._shifts = torch.arange(32, dtype=torch.int32)

    def __call__(self, generated: list[int], logits: torch.Tensor) -> torch.Tensor:
        if self._start is None:
            # Still thinking: wait for the end of the think block.
            for i in range(self._fed, len(generated)):
                if generated[i] == self._think_end:
                    self._start = self._fed = i + 1
                    break
            else:
                self._fed = len(generated)
                return logits
        new = generated[self._fed :]
        if new:
            self.matcher.consume_tokens(new)
            self._fed = len(generated)
        allowed = self.mask()
        if logits.shape[-1] != allowed.shape[0]:
            raise ValueError(f"logits have {logits.shape[-1]} entries, grammar {self.n_vocab}")
        return logits.masked_fill(~allowed.to(logits.device), float("-inf"))

    def mask(self) -> torch.Tensor:
        """Bool (V,) of allowed tokens now; EOS alone once the grammar is complete or broken."""
        m = self.matcher
        if m.is_error():
            allowed = torch.zeros(self.n_vocab, dtype=torch.bool)
            allowed[self._eos] = True  # never leave the sampler with nothing to pick
            return allowed
        m.unsafe_compute_mask_ptr(self._words.data_ptr(), self._words.numel() * 4)
        bits = (self._words.view(-1, 1) >> self._shifts) & 1
        return bits.flatten()[: self.n_vocab].bool()
