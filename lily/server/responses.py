"""Turn engine steps into OpenAI responses: reasoning split, tool calls, logprobs, chunks.

One ``ChatOutput`` per request consumes the engine's steps; streaming sends its deltas as
they come, non-streaming joins them. Both run the same parsers over the same text, so a
streamed answer joins to exactly the non-streamed one.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from lily.server.reasoning import ReasoningParser
from lily.server.tools import ToolCallDelta, ToolCallParser


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class LogprobFormatter:
    """Chat (``content`` entries) and legacy completions logprob shapes."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer

    def _text(self, token_id: int) -> tuple[str, list[int]]:
        raw = self.tok.token_bytes(token_id)
        if raw is None:
            raw = self.tok.decode([token_id]).encode()
        return raw.decode("utf-8", errors="replace"), list(raw)

    def chat_entry(self, step: Any) -> dict[str, Any]:
        text, raw = self._text(step.token_id)
        top = []
        for tid, lp in step.top_logprobs or []:
            t, b = self._text(tid)
            top.append({"token": t, "logprob": float(lp), "bytes": b})
        return {"token": text, "logprob": float(step.logprob), "bytes": raw, "top_logprobs": top}

    def completion_entry(self, step: Any) -> tuple[str, float, dict[str, float]]:
        text, _ = self._text(step.token_id)
        top = {self._text(t)[0]: float(lp) for t, lp in step.top_logprobs or []}
        return text, float(step.logprob), top


@dataclass
class Delta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)

    def empty(self) -> bool:
        return not (self.reasoning or self.content or self.tool_calls)


class ChatOutput:
    """Accumulates one chat completion from engine steps."""

    def __init__(
        self,
        tokenizer: Any,
        reasoning_mode: str,
        tools: list[dict[str, Any]] | None,
        logprobs: bool,
        eos_ids: set[int],
        parallel_tool_calls: bool = True,
    ) -> None:
        self.reasoner = ReasoningParser(reasoning_mode)
        self.tool_parser = None
        if tools is not None:
            self.tool_parser = ToolCallParser(tools, None if parallel_tool_calls else 1)
        self.fmt = LogprobFormatter(tokenizer) if logprobs else None
        self.eos_ids = eos_ids
        self.reasoning_tokens = 0
        self.reasoning = ""
        self.content = ""
        self.all_logprobs: list[dict[str, Any]] = []
        self._pending_lp: list[dict[str, Any]] = []

    def _route(self, reasoning: str, content: str, final: bool, truncated: bool = False) -> Delta:
        d = Delta(reasoning=reasoning)
        if self.tool_parser is not None:
            parsed = self.tool_parser.feed(content)
            if final:
                parsed.extend(self.tool_parser.finish(truncated))
            d.content, d.tool_calls = parsed.content, parsed.tool_calls
        else:
            d.content = content
        self.reasoning += d.reasoning
        self.content += d.content
        return d

    def _attach(self, d: Delta, final: bool) -> Delta:
        # Logprobs ride on the next chunk that carries text, so none are lost in held text.
        if self._pending_lp and (final or not d.empty()):
            d.logprobs, self._pending_lp = self._pending_lp, []
        return d

    def push(self, step: Any) -> Delta:
        """One engine step; returns what may be sent now."""
        if step.token_id is None:
            return Delta()
        if self.reasoner.in_reasoning:
            self.reasoning_tokens += 1
        is_eos = step.finish_reason == "stop" and step.token_id in self.eos_ids
        if self.fmt is not None and step.logprob is not None and not is_eos:
            entry = self.fmt.chat_entry(step)
            self.all_logprobs.append(entry)
            self._pending_lp.append(entry)
        r, c = self.reasoner.feed(step.text)
        return self._attach(self._route(r, c, final=False), final=False)

    def finish(self, engine_reason: str | None) -> Delta:
        """Flush held text at the end of the output. ``engine_reason`` is the last step's
        finish reason: "length" leaves a tool call cut short as generated (unclosed)."""
        r, c = self.reasoner.finish()
        d = self._route(r, c, final=True, truncated=engine_reason == "length")
        return self._attach(d, final=True)

    @property
    def tool_calls(self) -> list[dict[str, Any]]:
        if self.tool_parser is None:
            return []
        return [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in self.tool_parser.calls
        ]

    def finish_reason(self, engine_reason: str | None) -> str:
        """OpenAI's finish_reason: "length" whenever max_tokens cut the output, even inside
        a tool call (whose arguments are then incomplete); "tool_calls" only for calls the
        model finished."""
        if self.tool_calls and engine_reason == "stop":
            return "tool_calls"
        return "length" if engine_reason == "length" else "stop"

    def message(self) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant", "content": self.content or None}
        if self.reasoning or self.reasoner.reasoning_seen:
            msg["reasoning_content"] = self.reasoning
            msg["reasoning"] = self.reasoning
        if self.tool_calls:
            msg["tool_calls"] = self.tool_calls
        return msg


def chat_delta_json(d: Delta) -> list[dict[str, Any]]:
    """Wire deltas for one Delta: reasoning/content first, then merged tool-call pieces."""
    out: list[dict[str, Any]] = []
    text: dict[str, Any] = {}
    if d.reasoning:
        text["reasoning_content"] = d.reasoning
        text["reasoning"] = d.reasoning
    if d.content:
        text["content"] = d.content
    if text:
        out.append(text)
    calls: list[dict[str, Any]] = []
    for tc in d.tool_calls:
        if tc.id is not None:
            calls.append(
                {
                    "index": tc.index,
                    "id": tc.id,
                    "type": "function",
                    "function": {"name": tc.name, "arguments": ""},
                }
            )
            if tc.arguments:
                calls.append({"index": tc.index, "function": {"arguments": tc.arguments}})
        elif calls and calls[-1]["index"] == tc.index and "id" not in calls[-1]:
            calls[-1]["function"]["arguments"] += tc.arguments
        else:
            calls.append({"index": tc.index, "function": {"arguments": tc.arguments}})
    out.extend({"tool_calls": [c]} for c in calls)
    return out


class ChunkMaker:
    """Builds ``chat.completion.chunk`` / ``text_completion`` stream objects."""

    def __init__(self, kind: str, model: str, include_usage: bool) -> None:
        self.kind = kind
        self.id = new_id("chatcmpl" if kind == "chat" else "cmpl")
        self.created = int(time.time())
        self.model = model
        self.include_usage = include_usage

    def chunk(
        self,
        delta: dict[str, Any] | None = None,
        text: str | None = None,
        logprobs: Any = None,
        finish_reason: str | None = None,
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0}
        if self.kind == "chat":
            choice["delta"] = delta or {}
        else:
            choice["text"] = text or ""
        choice["logprobs"] = logprobs
        choice["finish_reason"] = finish_reason
        obj = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }
        if self.include_usage:
            obj["usage"] = None
        return obj

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        obj = self.chunk()
        obj["choices"] = []
        obj["usage"] = usage
        return obj
