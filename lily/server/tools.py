"""Tool calls in the Qwen3.5/3.6 XML form, parsed incrementally from the content stream.

The model writes::

    <tool_call>
    <function=NAME>
    <parameter=P>
    VALUE
    </parameter>
    </function>
    </tool_call>

and sometimes JSON (``{"name": ..., "arguments": {...}}``) inside ``<tool_call>``. The
parser turns this into OpenAI ``tool_calls``: a first delta with index, id, name and empty
arguments, then argument fragments whose concatenation is one JSON object. Values are raw
text converted by the tool's JSON schema. The same parser serves streaming and non-streaming
responses, so both give the same result for the same text.
"""

from __future__ import annotations

import ast
import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
FUNC_OPEN, FUNC_CLOSE = "<function=", "</function>"
PARAM_OPEN, PARAM_CLOSE = "<parameter=", "</parameter>"
# A value ends at its close tag, or (models sometimes omit it) at the next tag.
VALUE_ENDS = (PARAM_CLOSE, "\n" + PARAM_OPEN, "\n" + FUNC_CLOSE, "\n" + CALL_CLOSE)

_INT = re.compile(r"[+-]?\d+")
# A JSON-form call cut short: its name and where its arguments begin.
_JSON_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_JSON_ARGS = re.compile(r'"(?:arguments|parameters)"\s*:\s*')


def new_call_id() -> str:
    """An OpenAI-style tool call id."""
    return "call_" + secrets.token_hex(12)


@dataclass
class ToolCallDelta:
    """One streamed piece of a tool call: the header (id, name) or an argument fragment."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class ParsedDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def extend(self, other: ParsedDelta) -> None:
        self.content += other.content
        self.tool_calls.extend(other.tool_calls)


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""


def _held_prefix(buf: str, tags: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``buf`` that is a proper prefix of one of ``tags``."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(buf)), best, -1):
            if buf.endswith(tag[:n]):
                best = n
                break
    return best


def _schema_types(schema: Any) -> set[str]:
    """The JSON types a schema admits (empty: unknown)."""
    if not isinstance(schema, dict):
        return set()
    t = schema.get("type")
    types = {t} if isinstance(t, str) else {x for x in t if isinstance(x, str)} if t else set()
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or []:
            types |= _schema_types(sub)
    if not types and "enum" in schema:
        types = {_json_type(v) for v in schema["enum"]}
    if not types and "properties" in schema:
        types = {"object"}
    return types


def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "number"
    if isinstance(v, str):
        return "string"
    return "array" if isinstance(v, list) else "object"


def convert_value(raw: str, schema: Any) -> Any:
    """Convert a parameter's raw text by its JSON schema; unknown or failing types stay text."""
    types = _schema_types(schema)
    if not types or types == {"string"}:
        return raw
    s = raw.strip()
    low = s.lower()
    if "null" in types and low in ("null", "none"):
        return None
    if "boolean" in types and low in ("true", "false"):
        return low == "true"
    if "integer" in types and _INT.fullmatch(s):
        return int(s)
    if types & {"integer", "number"}:
        try:
            f = float(s)
        except ValueError:
            pass
        else:
            if f == f and abs(f) != float("inf"):  # JSON has no NaN or infinity
                return int(f) if "number" not in types and f.is_integer() else f
    if types & {"object", "array"}:
        for parse in (json.loads, ast.literal_eval):
            try:
                v = parse(s)
            except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
                continue
            if isinstance(v, dict | list):
                return v
    return raw


class ToolCallParser:
    """Incremental parser of tool calls out of content text.

    ``max_calls``: calls after that many are dropped (``parallel_tool_calls: false``).
    """

    def __init__(self, tools: list[dict[str, Any]] | None, max_calls: int | None = None) -> None:
        self._params: dict[str, dict[str, Any]] = {}
        for t in tools or []:
            fn = t.get("function", t) if isinstance(t, dict) else {}
            if isinstance(fn, dict) and isinstance(fn.get("name"), str):
                params = fn.get("parameters") or {}
                props = params.get("properties") if isinstance(params, dict) else None
                self._params[fn["name"]] = props if isinstance(props, dict) else {}
        self.calls: list[ToolCall] = []
        self.max_calls = max_calls
        self._buf = ""
        self._mode = "text"
        self._after_call = False  # strip whitespace between and after calls
        self._n_args = 0  # parameters written in the current call
        self._param = ""
        self._streaming_value = False

    # ---- public API
    def feed(self, text: str) -> ParsedDelta:
        """Consume new content text; return what can be emitted now."""
        self._buf += text
        out = ParsedDelta()
        while self._step(out, final=False):
            pass
        return out

    def finish(self, truncated: bool = False) -> ParsedDelta:
        """End of output: flush held text. An unfinished call is closed so its JSON parses
        when the model ended it (a missing close tag), but left as generated when the output
        was ``truncated`` (max_tokens): a call cut short must not look complete."""
        out = ParsedDelta()
        # Cut short, a tag begun is still a tag: keep the modes that wait for more text.
        while self._step(out, final=not truncated):
            pass
        if truncated and self._mode != "text":
            self._cut(out)
        elif self._mode in ("params", "value"):
            if self._mode == "value":
                self._end_value(out, self._buf)
            self._close_args(out)
        elif self._mode == "json":
            self._emit_json_call(out, self._buf, final=True)
        elif self._mode == "start" and self._buf.strip():
            out.content += CALL_OPEN + self._buf
        elif self._mode == "text":
            self._emit_text(out, self._buf)
        self._buf, self._mode = "", "text"
        return out

    # ---- state machine; each step returns True when it made progress
    def _step(self, out: ParsedDelta, final: bool) -> bool:
        buf = self._buf
        if self._mode == "drop":
            self._buf = ""
            return False
        if self._mode == "text":
            i = buf.find(CALL_OPEN)
            if i >= 0:
                self._emit_text(out, buf[:i])
                full = self.max_calls is not None and len(self.calls) >= self.max_calls
                self._buf, self._mode = buf[i + len(CALL_OPEN) :], "drop" if full else "start"
                return True
            keep = 0 if final else _held_prefix(buf, (CALL_OPEN,))
            if final:
                return False
            self._emit_text(out, buf[: len(buf) - keep])
            self._buf = buf[len(buf) - keep :]
            return False
        s = buf.lstrip()
        if self._mode == "start":
            if not s:
                return False
            if s.startswith("{"):
                self._buf, self._mode = s, "json"
                return True
            if s.startswith(FUNC_OPEN):
                j = s.find(">")
                if j < 0:
                    return False
                name = s[len(FUNC_OPEN) : j].strip()
                self._start_call(out, name)
                self._buf, self._mode = s[j + 1 :], "params"
                return True
            if FUNC_OPEN.startswith(s) and not final:
                return False
            # Not a tool call after all: give the text back as content.
            out.content += CALL_OPEN
            self._buf, self._mode = buf, "text"
            return True
        if self._mode == "params":
            if s.startswith(PARAM_OPEN):
                j = s.find(">")
                if j < 0 or (j == len(s) - 1 and not final):
                    return False  # need one more char to strip the leading newline
                self._param = s[len(PARAM_OPEN) : j].strip()
                rest = s[j + 1 :]
                self._buf = rest[1:] if rest.startswith("\n") else rest
                self._mode = "value"
                self._streaming_value = False
                return True
            if s.startswith(FUNC_CLOSE) or s.startswith(CALL_CLOSE):
                self._close_args(out)
                if s.startswith(CALL_CLOSE):
                    self._buf, self._mode = s[len(CALL_CLOSE) :], "text"
                    self._after_call = True
                else:
                    self._buf, self._mode = s[len(FUNC_CLOSE) :], "end"
                return True
            if not s or any(t.startswith(s) for t in (PARAM_OPEN, FUNC_CLOSE, CALL_CLOSE)):
                return False
            k = s.find("<", 1)  # junk between tags: drop it
            self._buf = s[k:] if k > 0 else ""
            return k > 0
        if self._mode == "value":
            return self._step_value(out, final)
        if self._mode == "end":
            if s.startswith(CALL_CLOSE):
                self._buf = s[len(CALL_CLOSE) :]
            elif not s or (CALL_CLOSE.startswith(s) and not final):
                return False
            self._mode, self._after_call = "text", True
            return True
        if self._mode == "json":
            i = buf.find(CALL_CLOSE)
            if i < 0:
                return False
            self._emit_json_call(out, buf[:i], final=False)
            self._buf, self._mode, self._after_call = buf[i + len(CALL_CLOSE) :], "text", True
            return True
        raise AssertionError(self._mode)

    def _step_value(self, out: ParsedDelta, final: bool) -> bool:
        buf = self._buf
        hits = [(buf.find(t), t) for t in VALUE_ENDS if t in buf]
        if hits:
            i, tag = min(hits)
            self._end_value(out, buf[:i])
            self._buf = buf[i + len(tag) :] if tag == PARAM_CLOSE else buf[i:]
            self._mode = "params"
            return True
        if self._is_string_param() and not final:
            # Stream string values as they come; hold back a possible closing tag and
            # the newline that precedes it (stripped from the value).
            keep = _held_prefix(buf, VALUE_ENDS)
            safe = buf[: len(buf) - keep]
            if safe.endswith("\n"):
                safe = safe[:-1]
            if safe:
                self._open_value(out)
                self._args(out, _esc(safe))
                self._buf = buf[len(safe) :]
        return False

    def _cut(self, out: ParsedDelta) -> None:
        """Output ended by max_tokens inside a call: its arguments as far as generated."""
        buf, mode = self._buf, self._mode
        self._buf, self._mode = "", "text"
        if mode == "value":
            raw = buf[: len(buf) - _held_prefix(buf, VALUE_ENDS)]  # a close tag begun
            raw = raw[:-1] if raw.endswith("\n") else raw
            if self._is_string_param():
                self._open_value(out)
                if raw:
                    self._args(out, _esc(raw))
            else:
                sep = "{" if self._n_args == 0 else ", "
                self._args(out, f"{sep}{json.dumps(self._param)}: {raw.strip()}")
        elif mode == "json":
            name = _JSON_NAME.search(buf)
            if name is None:
                return
            try:
                fn = json.loads(f'"{name.group(1)}"')
            except ValueError:
                return
            self._start_call(out, fn)
            args = _JSON_ARGS.search(buf)
            if args is not None and buf[args.end() :].rstrip():
                self._args(out, buf[args.end() :].rstrip())
        # "params": arguments so far, unclosed; "end": complete but for </tool_call>;
        # "start", "drop": no call header was written: nothing to report.

    # ---- helpers
    @property
    def _index(self) -> int:
        return len(self.calls) - 1

    def _emit_text(self, out: ParsedDelta, text: str) -> None:
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        out.content += text

    def _start_call(self, out: ParsedDelta, name: str) -> None:
        self.calls.append(ToolCall(new_call_id(), name))
        self._n_args = 0
        out.tool_calls.append(ToolCallDelta(self._index, self.calls[-1].id, name, ""))

    def _args(self, out: ParsedDelta, frag: str) -> None:
        self.calls[-1].arguments += frag
        out.tool_calls.append(ToolCallDelta(self._index, arguments=frag))

    def _is_string_param(self) -> bool:
        schema = self._params.get(self.calls[-1].name, {}).get(self._param)
        types = _schema_types(schema)
        return not types or types == {"string"}

    def _open_value(self, out: ParsedDelta) -> None:
        if not self._streaming_value:
            sep = "{" if self._n_args == 0 else ", "
            self._args(out, f'{sep}{json.dumps(self._param)}: "')
            self._streaming_value = True
            self._n_args += 1

    def _end_value(self, out: ParsedDelta, raw: str) -> None:
        if raw.endswith("\n"):
            raw = raw[:-1]
        if self._streaming_value:
            self._args(out, _esc(raw) + '"')
            self._streaming_value = False
            return
        schema = self._params.get(self.calls[-1].name, {}).get(self._param)
        value = convert_value(raw, schema)
        sep = "{" if self._n_args == 0 else ", "
        self._args(out, f"{sep}{json.dumps(self._param)}: {json.dumps(value)}")
        self._n_args += 1

    def _close_args(self, out: ParsedDelta) -> None:
        self._args(out, "}" if self._n_args else "{}")

    def _emit_json_call(self, out: ParsedDelta, text: str, final: bool) -> None:
        try:
            obj = json.loads(text)
        except ValueError:
            obj = None
        name = obj.get("name") if isinstance(obj, dict) else None
        args = obj.get("arguments", obj.get("parameters", {})) if isinstance(obj, dict) else None
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                args = None
        if not isinstance(name, str) or not isinstance(args, dict):
            out.content += CALL_OPEN + text + ("" if final else CALL_CLOSE)
            return
        self._start_call(out, name)
        self._args(out, json.dumps(args, ensure_ascii=False))


def _esc(s: str) -> str:
    """JSON string-body escaping of a fragment; escaping is per character, so pieces join."""
    return json.dumps(s, ensure_ascii=False)[1:-1]
