"""The Messages API's output and errors: Message objects, the streamed events, error shapes.

Each block of the answer (blocks.py) is one content block: the thinking a ``thinking``
block, text a ``text`` block, a tool call a ``tool_use`` block. A stream is
``message_start``, ``ping``, per block ``content_block_start``, its deltas
(``thinking_delta``, ``text_delta``, ``input_json_delta``) and ``content_block_stop``, then
``message_delta`` (stop_reason, final usage) and ``message_stop``; ``ping`` keeps a quiet
stream alive. Errors are ``{"type": "error", "error": {"type", "message"}}``, also the
ones raised in front of the route (API key, body, validation): ``AnthropicErrors``
rewrites every error answer under /v1/messages into that shape.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from lily.server.blocks import Op, Turn, sse, turn_events
from lily.server.protocol import ApiError
from lily.server.serving import log_error

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
_STOP_REASONS = {"tool_calls": "tool_use", "length": "max_tokens"}


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    """The Anthropic error body for an HTTP status."""
    kind = _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def _tool_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def _input(arguments: str) -> dict[str, Any]:
    # A call cut off by max_tokens has no complete JSON: its input is empty, and the
    # message's stop_reason "max_tokens" says it did not finish.
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class MessageWriter:
    """Builds one message's events and final object from a Turn's blocks."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.id = f"msg_{uuid.uuid4().hex}"

    def block(self, turn: Turn, i: int, started: bool = False) -> dict[str, Any]:
        """Content block ``i``: as it starts (empty), or as it stands."""
        b = turn.blocks[i]
        text = "" if started else b.text
        if b.kind == "reasoning":
            return {"type": "thinking", "thinking": text, "signature": ""}
        if b.kind == "text":
            return {"type": "text", "text": text}
        args = {} if started else _input(b.text)
        return {"type": "tool_use", "id": _tool_id(b.call_id), "name": b.name, "input": args}

    def usage(self, turn: Turn | None) -> dict[str, Any]:
        """Anthropic's usage: input_tokens excludes the tokens read from the prefix cache."""
        if turn is None or not turn.finished:
            n = turn.n_prompt if turn is not None else 0
            return {"input_tokens": n, "output_tokens": 0, "cache_read_input_tokens": 0,
                    "cache_creation_input_tokens": 0}  # fmt: skip
        return {
            "input_tokens": turn.n_prompt - turn.cached_tokens,
            "output_tokens": turn.output_tokens,
            "cache_read_input_tokens": turn.cached_tokens,
            "cache_creation_input_tokens": 0,
            "output_tokens_details": {"thinking_tokens": turn.reasoning_tokens},
        }

    def stop(self, turn: Turn) -> tuple[str, str | None]:
        """stop_reason and stop_sequence."""
        if turn.stop_sequence is not None:
            return "stop_sequence", turn.stop_sequence
        return _STOP_REASONS.get(turn.finish_reason, "end_turn"), None

    def message(self, turn: Turn | None, started: bool = False) -> dict[str, Any]:
        """The Message object (``started``: as message_start shows it)."""
        reason, seq = (None, None) if started or turn is None else self.stop(turn)
        blocks = [] if started or turn is None else range(len(turn.blocks))
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [self.block(turn, i) for i in blocks],
            "stop_reason": reason,
            "stop_sequence": seq,
            "usage": self.usage(turn),
        }

    def events(self, turn: Turn, ops: list[Op]) -> list[tuple[str, dict[str, Any]]]:
        out: list[tuple[str, dict[str, Any]]] = []
        for op, i, text in ops:
            if op == "open":
                block = self.block(turn, i, started=True)
                out.append(("content_block_start", {"index": i, "content_block": block}))
            elif op == "close":
                out.append(("content_block_stop", {"index": i}))
            else:
                kind = turn.blocks[i].kind
                delta = ({"type": "thinking_delta", "thinking": text} if kind == "reasoning"
                         else {"type": "text_delta", "text": text} if kind == "text"
                         else {"type": "input_json_delta", "partial_json": text})  # fmt: skip
                out.append(("content_block_delta", {"index": i, "delta": delta}))
        return [(name, {"type": name, **data}) for name, data in out]

    def end(self, turn: Turn) -> list[tuple[str, dict[str, Any]]]:
        reason, seq = self.stop(turn)
        delta = {"stop_reason": reason, "stop_sequence": seq}
        return [
            ("message_delta", {"type": "message_delta", "delta": delta, "usage": self.usage(turn)}),
            ("message_stop", {"type": "message_stop"}),
        ]


async def stream_message(p: Any, ctx: Any, writer: MessageWriter) -> AsyncIterator[str]:
    """The SSE body of a streamed message."""
    turn = Turn(p, ctx)
    ping = sse("ping", {"type": "ping"})
    try:
        start = {"type": "message_start", "message": writer.message(turn, started=True)}
        yield sse("message_start", start)
        yield ping
        async for kind, value in turn_events(p, ctx, ctx.keepalive, turn):
            if kind == "keepalive":
                yield ping
            elif kind == "ops":
                for name, data in writer.events(turn, value):
                    yield sse(name, data)
            else:
                for name, data in writer.end(turn):
                    yield sse(name, data)
    except ApiError as e:  # an engine fault, or the server dropped the queued job
        yield sse("error", anthropic_error(e.status, e.message))
    except Exception as e:  # a bug past the headers: still end the stream cleanly
        log_error(f"request {p.job.request_id}: streaming failed", e, ctx.log_requests)
        yield sse("error", anthropic_error(500, f"internal error: {type(e).__name__}"))
    finally:
        ctx.scheduler.cancel(p.job)


class AnthropicErrors:
    """Rewrite error answers under /v1/messages from ``{"error": {...}}`` (what the app and
    its front door send) into the Anthropic shape; everything else passes untouched."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope.get("path", "").startswith("/v1/messages"):
            await self.app(scope, receive, send)
            return
        start: Message | None = None
        chunks: list[bytes] = []

        async def rewrite(message: Message) -> None:
            nonlocal start
            if message["type"] == "http.response.start" and message["status"] >= 400:
                start = message
                return
            if start is None or message["type"] != "http.response.body":
                await send(message)
                return
            chunks.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            body = _rewritten(b"".join(chunks), start["status"])
            headers = [h for h in start.get("headers", []) if h[0].lower() != b"content-length"]
            headers.append((b"content-length", str(len(body)).encode()))
            await send({**start, "headers": headers})
            await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, rewrite)


def _rewritten(body: bytes, status: int) -> bytes:
    try:
        obj = json.loads(body)
    except ValueError:
        return body
    err = obj.get("error") if isinstance(obj, dict) else None
    if not isinstance(err, dict) or obj.get("type") == "error":
        return body
    msg = err.get("message") if isinstance(err.get("message"), str) else "error"
    return json.dumps(anthropic_error(status, msg), ensure_ascii=False).encode()
