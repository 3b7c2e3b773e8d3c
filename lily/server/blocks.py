"""Engine output as ordered content blocks, for the APIs whose answer is a list of blocks.

The Responses API (output items) and the Anthropic Messages API (content blocks) show one
answer as a sequence: the thinking, text, tool calls. Both map onto the same engine job as a
chat completion (``prepare_chat``) and read its steps through the same parsers
(``ChatOutput``: reasoning split, tool-call parser); ``Turn`` turns those deltas into block
operations (open a block, add to it, close it) that each API renders as its own events. A
non-streamed answer is the blocks at the end of the same run, so both forms agree.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from lily.server.handlers import Prepared, cancelled_error, engine_error, prepare_chat
from lily.server.protocol import ApiError, ChatCompletionRequest, validation_message
from lily.server.responses import ChatOutput, Delta
from lily.server.serving import events

# The chat request field that carries a reasoning budget (thinking tokens before the
# reasoning is closed); the Messages API fills it from ``thinking.budget_tokens``.
# NOTE: the budget mechanism lives in the shared job layer; this name must match its field.
REASONING_BUDGET_FIELD = "thinking_budget"

# Chat fields each block API maps from its own fields; the others pass through unchanged,
# so lily's chat extensions (top_k, min_p, seed, penalties, ...) work in every API.
_MAPPED = frozenset(
    {"model", "messages", "tools", "tool_choice", "parallel_tool_calls", "response_format",
     "max_tokens", "max_completion_tokens", "stream", "stream_options", "logprobs",
     "top_logprobs", "n", "chat_template_kwargs"}
)  # fmt: skip


def passthrough(fields: dict[str, Any]) -> dict[str, Any]:
    """The chat-completion fields among a request's extra fields (not mapped by the API)."""
    known = ChatCompletionRequest.model_fields
    return {k: v for k, v in fields.items() if k in known and k not in _MAPPED}


def prepare_as_chat(body: dict[str, Any], ctx: Any, request_id: str,
                    params: dict[str, str]) -> Prepared:  # fmt: skip
    """The engine job of a chat completion ``body``; 400s name the API's own field
    (``params`` maps chat field names to them)."""
    try:
        req = ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        msg, param = validation_message(e.errors())
        raise _renamed(ApiError(400, msg, param=param), params) from None
    try:
        return prepare_chat(req, ctx, request_id)
    except ApiError as e:
        raise _renamed(e, params) from None


def _renamed(e: ApiError, params: dict[str, str]) -> ApiError:
    if e.param is not None:
        head = e.param.split(".", 1)[0]
        e.param = params.get(head, e.param)
    return e


@dataclass
class Block:
    """One block of the answer: thinking, text, or a tool call (``text`` is its arguments)."""

    kind: str  # "reasoning", "text" or "tool"
    text: str = ""
    call_id: str = ""
    name: str = ""
    done: bool = False


Op = tuple[str, int, str]  # ("open" | "delta" | "close", block index, the delta's text)


class Turn:
    """One job's output as blocks; ``push`` each engine step, then ``finish``."""

    def __init__(self, p: Prepared, ctx: Any) -> None:
        tok = ctx.engine.tokenizer
        self._tok = tok
        params = p.job.params
        self._ends = set(params.stop_token_ids or ())
        if not params.ignore_eos:
            self._ends |= set(tok.eos_token_ids)
        self._stops = [s for s in params.stop or () if s]
        self.out = ChatOutput(tok, p.reasoning_mode, p.tools, False, set(tok.eos_token_ids),
                              p.parallel_tool_calls)  # fmt: skip
        self.n_prompt = len(p.job.prompt_ids)
        self.blocks: list[Block] = []
        self.reason: str | None = None  # the engine's: "stop", "length" or "cancelled"
        self.usage: Any = None
        self.stop_sequence: str | None = None
        self.finished = False
        self._ws = ""  # whitespace-only text, held until more text follows
        self._ids: list[int] = []
        self._emitted = ""

    # ---- results
    @property
    def finish_reason(self) -> str:
        """As a chat completion's: "stop", "length" or "tool_calls"."""
        return self.out.finish_reason(self.reason)

    @property
    def reasoning_tokens(self) -> int:
        return self.out.reasoning_tokens

    @property
    def cached_tokens(self) -> int:
        return self.usage.cached_tokens if self.usage is not None else 0

    @property
    def output_tokens(self) -> int:
        return self.usage.completion_tokens if self.usage is not None else len(self._ids)

    def cut_off(self, index: int) -> bool:
        """Whether block ``index`` was cut by the token limit."""
        return self.finished and self.reason == "length" and index == len(self.blocks) - 1

    # ---- input
    def push(self, step: Any) -> list[Op]:
        if step.token_id is not None:
            self._ids.append(step.token_id)
        self._emitted += step.text
        self.reason = step.finish_reason or self.reason
        return self._ops(self.out.push(step))

    def finish(self, usage: Any) -> list[Op]:
        self.usage, self.finished = usage, True
        ops = self._ops(self.out.finish(self.reason))
        self._close(ops)
        self.stop_sequence = self._stop_sequence()
        return ops

    # ---- blocks
    def _current(self) -> Block | None:
        return self.blocks[-1] if self.blocks and not self.blocks[-1].done else None

    def _close(self, ops: list[Op]) -> None:
        if self._current() is not None:
            self.blocks[-1].done = True
            ops.append(("close", len(self.blocks) - 1, ""))

    def _open(self, ops: list[Op], block: Block) -> None:
        self._close(ops)
        self.blocks.append(block)
        ops.append(("open", len(self.blocks) - 1, ""))

    def _add(self, ops: list[Op], kind: str, text: str) -> None:
        cur = self._current()
        if cur is None or cur.kind != kind:
            self._open(ops, Block(kind))
        self.blocks[-1].text += text
        ops.append(("delta", len(self.blocks) - 1, text))

    def _ops(self, d: Delta) -> list[Op]:
        ops: list[Op] = []
        if d.reasoning:
            self._add(ops, "reasoning", d.reasoning)
        calls = list(d.tool_calls)
        cur = self._current()
        # NOTE: a delta loses the order of its text and calls. A step is one token, so a
        # call never starts and ends in one delta: the open call's last fragments come
        # before the text, and the text before a call that starts in this delta.
        while calls and calls[0].id is None and cur is not None and cur.kind == "tool":
            self._add(ops, "tool", calls.pop(0).arguments)
        if d.content:
            text, self._ws = self._ws + d.content, ""
            cur = self._current()
            if text.strip() or (cur is not None and cur.kind == "text"):
                self._add(ops, "text", text)
            else:
                self._ws = text  # a blank between blocks is not a block of its own
        for tc in calls:
            if tc.id is not None:
                self._ws = ""
                self._open(ops, Block("tool", call_id=tc.id, name=tc.name or ""))
            if tc.arguments:
                self._add(ops, "tool", tc.arguments)
        return ops

    def _stop_sequence(self) -> str | None:
        """The stop string that ended the output (None: EOS, a stop id, or no stop)."""
        if self.reason != "stop" or not self._stops or not self._ids or self._ids[-1] in self._ends:
            return None
        # The engine emits the text before the stop string; the tokens hold the string too.
        rest = self._tok.decode(self._ids)[len(self._emitted) :]
        return next((s for s in self._stops if rest.startswith(s)), None)


def sse(event: str, data: Any) -> str:
    """One named server-sent event."""
    return f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


async def turn_events(
    p: Prepared, ctx: Any, keepalive: float | None, turn: Turn
) -> AsyncIterator[tuple[str, Any]]:
    """("keepalive", None), ("ops", list of Op) per step, and last ("done", turn).

    An engine fault or a cancelled job raises ApiError; the job is cancelled on every exit
    (a no-op once it finished), so a client that leaves frees the engine."""
    try:
        async for kind, value in events(p.job, keepalive):
            if kind == "keepalive":
                yield "keepalive", None
            elif kind == "cancelled":
                raise cancelled_error()
            elif kind == "error":
                raise engine_error(value)
            elif kind == "step":
                yield "ops", turn.push(value)
            elif kind == "done":
                ops = turn.finish(value)
                if turn.reason == "cancelled":  # the server stopped it: shutting down
                    raise cancelled_error()
                yield "ops", ops
                yield "done", turn
    finally:
        ctx.scheduler.cancel(p.job)


async def run_turn(p: Prepared, ctx: Any, receive: Callable) -> Turn:
    """The whole turn, for a non-streamed answer.

    ``receive`` is the request's ASGI receive: a client that goes away cancels the job."""

    async def watch() -> None:
        # NOTE: the body is read, so the next ASGI message is the client going away.
        while (await receive())["type"] != "http.disconnect":
            pass
        ctx.scheduler.cancel(p.job)

    turn = Turn(p, ctx)
    watcher = asyncio.ensure_future(watch())
    try:
        async for _ in turn_events(p, ctx, None, turn):
            pass
    finally:
        watcher.cancel()
    return turn
