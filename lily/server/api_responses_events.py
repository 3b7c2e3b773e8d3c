"""The Responses API's output: the response object and its streamed events.

Each block of the answer (blocks.py) is one output item: the thinking a ``reasoning`` item
(as ``reasoning_text`` content, or as the summary when ``reasoning.summary`` is asked for:
the model writes no separate summary), text a ``message`` with one ``output_text`` part, a
tool call a ``function_call``. A stream is ``response.created``, ``response.in_progress``,
per item ``output_item.added``, its part and delta events, ``output_item.done``, then
``response.completed`` (or ``response.incomplete`` when max_output_tokens cut it, or
``response.failed`` on an engine fault), every event with its ``sequence_number``. The
non-streamed response is the final object of the same run.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from lily.server.blocks import Op, Turn, sse, turn_events
from lily.server.protocol import ApiError
from lily.server.serving import log_error

log = logging.getLogger("lily.server")

_PREFIX = {"reasoning": "rs", "text": "msg", "tool": "fc"}


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseWriter:
    """Builds one response's events and final object from a Turn's blocks."""

    def __init__(self, req: Any, model: str, summary: bool) -> None:
        self.req, self.model, self.summary = req, model, summary
        self.id = _new_id("resp")
        self.created = int(time.time())
        self.seq = 0
        self._ids: list[str] = []
        self.turn: Turn | None = None

    # ---- objects
    def response(self, status: str, turn: Turn | None = None, error: Any = None) -> dict[str, Any]:
        """The response object; its output and usage come from ``turn`` once it is done."""
        req = self.req
        fmt = req.text.format if req.text and req.text.format else None
        tools = [
            {"type": "function", "name": t.get("name"), "description": t.get("description"),
             "parameters": t.get("parameters"), "strict": t.get("strict")}
            for t in req.tools or []
        ]  # fmt: skip
        r = req.reasoning
        fmt_out = fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        summary = (r.summary or r.generate_summary) if r else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "background": False,
            "error": error,
            "incomplete_details": incomplete,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "model": self.model,
            "output": [self.item(turn, i) for i in range(len(turn.blocks))] if turn else [],
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": r.effort if r else None, "summary": summary},
            "store": req.store is not False,
            "temperature": req.temperature,
            "text": {"format": fmt_out},
            "tool_choice": req.tool_choice or "auto",
            "tools": tools,
            "top_p": req.top_p,
            "truncation": req.truncation or "disabled",
            "usage": _usage(turn) if turn is not None and turn.finished else None,
            "user": req.user,
            "metadata": req.metadata or {},
        }

    def item(self, turn: Turn, i: int, added: bool = False) -> dict[str, Any]:
        """Output item ``i``: as first announced (``added``), or as it stands."""
        b = turn.blocks[i]
        while len(self._ids) <= i:
            self._ids.append(_new_id(_PREFIX[turn.blocks[len(self._ids)].kind]))
        status = "in_progress" if added or not b.done else "completed"
        if turn.cut_off(i):
            status = "incomplete"
        text = "" if added else b.text
        if b.kind == "reasoning":
            it: dict[str, Any] = {"type": "reasoning", "id": self._ids[i], "summary": []}
            if self.summary and not added:
                it["summary"] = [{"type": "summary_text", "text": text}]
            elif not self.summary:
                it["content"] = [{"type": "reasoning_text", "text": text}] if not added else []
            it["status"] = status
            return it
        if b.kind == "text":
            content = [] if added else [_text_part(text)]
            return {"type": "message", "id": self._ids[i], "status": status, "role": "assistant",
                    "content": content}  # fmt: skip
        return {"type": "function_call", "id": self._ids[i], "call_id": b.call_id,
                "name": b.name, "arguments": text, "status": status}  # fmt: skip

    def final(self, turn: Turn) -> dict[str, Any]:
        """The finished response (what the non-streamed request returns)."""
        self.turn = turn
        return self.response("incomplete" if turn.reason == "length" else "completed", turn)

    def assistant_messages(self) -> list[dict[str, Any]]:
        """The output as chat messages, for a continuation by previous_response_id."""
        blocks = self.turn.blocks if self.turn else []
        msg: dict[str, Any] = {"role": "assistant", "content": ""}
        for b in blocks:
            if b.kind == "reasoning":
                msg["reasoning_content"] = msg.get("reasoning_content", "") + b.text
            elif b.kind == "text":
                msg["content"] += b.text
            else:
                call = {"name": b.name, "arguments": b.text}
                msg.setdefault("tool_calls", []).append(
                    {"id": b.call_id, "type": "function", "function": call}
                )
        return [msg]

    # ---- events
    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        e = {"type": kind, **fields, "sequence_number": self.seq}
        self.seq += 1
        return e

    def start(self) -> list[dict[str, Any]]:
        r = self.response("in_progress")
        return [self.event("response.created", response=r),
                self.event("response.in_progress", response=r)]  # fmt: skip

    def ops(self, turn: Turn, ops: list[Op]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for op, i, text in ops:
            kind = turn.blocks[i].kind
            where = {"item_id": None, "output_index": i}
            if op == "open":
                item = self.item(turn, i, added=True)
                where["item_id"] = item["id"]
                out.append(self.event("response.output_item.added", output_index=i, item=item))
                out.extend(self._part(kind, where, "added", ""))
                continue
            where["item_id"] = self._ids[i]
            if op == "delta":
                out.append(self._delta(kind, where, text))
                continue
            full = turn.blocks[i].text
            if kind == "tool":
                out.append(self.event("response.function_call_arguments.done", **where,
                                      arguments=full, name=turn.blocks[i].name))  # fmt: skip
            else:
                name = {"reasoning": "reasoning_text", "text": "output_text"}[kind]
                if kind == "reasoning" and self.summary:
                    name = "reasoning_summary_text"
                idx = "summary_index" if name == "reasoning_summary_text" else "content_index"
                extra = {"logprobs": []} if kind == "text" else {}
                out.append(self.event(f"response.{name}.done", **where, **{idx: 0}, text=full,
                                      **extra))  # fmt: skip
                out.extend(self._part(kind, where, "done", full))
            item = self.item(turn, i)
            out.append(self.event("response.output_item.done", output_index=i, item=item))
        return out

    def _part(self, kind: str, where: dict[str, Any], when: str, text: str) -> list[dict]:
        if kind == "tool":
            return []
        if kind == "reasoning" and self.summary:
            part = {"type": "summary_text", "text": text}
            return [self.event(f"response.reasoning_summary_part.{when}", **where,
                               summary_index=0, part=part)]  # fmt: skip
        part = _text_part(text) if kind == "text" else {"type": "reasoning_text", "text": text}
        return [self.event(f"response.content_part.{when}", **where, content_index=0, part=part)]

    def _delta(self, kind: str, where: dict[str, Any], text: str) -> dict[str, Any]:
        if kind == "tool":
            return self.event("response.function_call_arguments.delta", **where, delta=text)
        if kind == "text":
            return self.event("response.output_text.delta", **where, content_index=0,
                              delta=text, logprobs=[])  # fmt: skip
        if self.summary:
            return self.event("response.reasoning_summary_text.delta", **where,
                              summary_index=0, delta=text)  # fmt: skip
        return self.event("response.reasoning_text.delta", **where, content_index=0, delta=text)

    def failed(self, e: ApiError, turn: Turn | None) -> dict[str, Any]:
        code = "invalid_prompt" if e.status == 400 else "server_error"
        error = {"code": code, "message": e.message, "param": e.param, "type": e.type}
        return self.event("response.failed", response=self.response("failed", turn, error))


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _usage(turn: Turn) -> dict[str, Any]:
    out = turn.output_tokens
    return {
        "input_tokens": turn.n_prompt,
        # NOTE: cache writes are not counted (as in the Messages API's usage).
        "input_tokens_details": {"cached_tokens": turn.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": out,
        "output_tokens_details": {"reasoning_tokens": turn.reasoning_tokens},
        "total_tokens": turn.n_prompt + out,
    }


async def stream_response(
    p: Any, ctx: Any, writer: ResponseWriter, keep: Callable[[dict[str, Any]], None]
) -> AsyncIterator[str]:
    """The SSE body; ``keep`` gets the finished response (to store it)."""
    turn = Turn(p, ctx)
    try:
        for e in writer.start():
            yield sse(e["type"], e)
        async for kind, value in turn_events(p, ctx, ctx.keepalive, turn):
            if kind == "keepalive":
                yield ": keep-alive\n\n"
            elif kind == "ops":
                for e in writer.ops(turn, value):
                    yield sse(e["type"], e)
            else:
                response = writer.final(turn)
                keep(response)
                kind = "response.incomplete" if response["status"] == "incomplete" else (
                    "response.completed")  # fmt: skip
                yield sse(kind, writer.event(kind, response=response))
    except ApiError as e:  # an engine fault, or the server dropped the queued job
        yield sse("response.failed", writer.failed(e, turn))
    except Exception as e:  # a bug past the headers: still end the stream cleanly
        log_error(f"request {p.job.request_id}: streaming failed", e, ctx.log_requests)
        err = writer.event("error", code="server_error", param=None,
                           message=f"internal error: {type(e).__name__}")  # fmt: skip
        yield sse("error", err)
    finally:
        ctx.scheduler.cancel(p.job)
