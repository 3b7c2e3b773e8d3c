"""The Anthropic Messages API: ``POST /v1/messages`` and ``/v1/messages/count_tokens``.

A request becomes the same engine job as a chat completion: ``system`` a system message,
content blocks chat messages (``text``; ``thinking`` the assistant's reasoning;
``tool_use`` its tool calls; ``tool_result`` tool messages), ``tools`` (``input_schema``)
chat tools, ``tool_choice`` auto/any/tool/none the chat auto/required/named/none, and
``thinking`` the template's enable_thinking switch and a reasoning budget. The output and
the Anthropic error shape are in api_messages_events.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ConfigDict, Field

from lily.server.api_messages_events import MessageWriter, stream_message
from lily.server.blocks import REASONING_BUDGET_FIELD, passthrough, prepare_as_chat, run_turn
from lily.server.protocol import Lenient, bad_request

_PARAMS = {"stop": "stop_sequences", "max_completion_tokens": "max_tokens"}
# Text blocks of one message are joined as separate paragraphs.
_JOIN = "\n\n"


class AnthropicMessage(Lenient):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class AnthropicTool(Lenient):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    input_schema: dict[str, Any]
    type: str | None = None


class AnthropicToolChoice(Lenient):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(Lenient):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(default=None, ge=1)


class CountTokensRequest(Lenient):
    """``POST /v1/messages/count_tokens``; also the fields the prompt depends on."""

    model_config = ConfigDict(extra="allow")

    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: ThinkingConfig | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class MessagesRequest(CountTokensRequest):
    """``POST /v1/messages``. Other chat-completion fields (min_p, seed, ...) pass through."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    metadata: dict[str, Any] | None = None  # accepted, ignored


def _texts(blocks: Any, where: str) -> str:
    """The text of a string or of a list of text blocks (``system``, a tool result)."""
    if isinstance(blocks, str):
        return blocks
    out = []
    for j, b in enumerate(blocks or []):
        if not (isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str)):
            raise _unsupported(f"{where}[{j}]", b)
        out.append(b["text"])
    return _JOIN.join(out)


def _unsupported(where: str, block: Any) -> Exception:
    kind = str(block.get("type") if isinstance(block, dict) else type(block).__name__)[:40]
    why = f"block type {kind!r} is not supported here"
    if kind in ("image", "document"):
        why = "image and document inputs are not supported: this server runs a text-only model"
    return bad_request(f"{where}: {why}", where.split("[", 1)[0], code="unsupported_content")


def _assistant(blocks: list[dict[str, Any]], where: str) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": ""}
    texts, calls = [], []
    for j, b in enumerate(blocks):
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text" and isinstance(b.get("text"), str):
            texts.append(b["text"])
        elif kind == "thinking" and isinstance(b.get("thinking"), str):
            msg["reasoning_content"] = msg.get("reasoning_content", "") + b["thinking"]
        elif kind == "redacted_thinking":
            continue  # opaque to this model: nothing to give it
        elif kind == "tool_use" and isinstance(b.get("name"), str):
            args = b.get("input") or {}
            if not isinstance(args, dict):
                raise bad_request(f"{where}[{j}].input: must be an object", "messages")
            fn = {"name": b["name"], "arguments": args}
            calls.append({"id": b.get("id"), "type": "function", "function": fn})
        else:
            raise _unsupported(f"{where}[{j}]", b)
    msg["content"] = _JOIN.join(texts)
    if calls:
        msg["tool_calls"] = calls
    return msg


def _user(blocks: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    for j, b in enumerate(blocks):
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text" and isinstance(b.get("text"), str):
            texts.append(b["text"])
        elif kind == "tool_result":
            if texts:  # tool results answer the last turn's calls; text after them follows
                out.append({"role": "user", "content": _JOIN.join(texts)})
                texts = []
            text = _texts(b.get("content", ""), f"{where}[{j}].content")
            if b.get("is_error"):
                text = "Error: " + text
            out.append({"role": "tool", "tool_call_id": b.get("tool_use_id"), "content": text})
        else:
            raise _unsupported(f"{where}[{j}]", b)
    if texts or not out:
        out.append({"role": "user", "content": _JOIN.join(texts)})
    return out


def chat_messages(req: CountTokensRequest) -> list[dict[str, Any]]:
    """The chat messages of a Messages request."""
    out: list[dict[str, Any]] = []
    if req.system:
        out.append({"role": "system", "content": _texts(req.system, "system")})
    for i, m in enumerate(req.messages):
        where = f"messages[{i}].content"
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
        elif m.role == "assistant":
            out.append(_assistant(m.content, where))
        else:
            out.extend(_user(m.content, where))
    if req.messages[-1].role == "assistant":
        raise bad_request("messages: the last message must be from the user (continuing a "
                          "prefilled assistant message is not supported)", "messages")  # fmt: skip
    return out


def chat_body(req: CountTokensRequest, counting: bool = False) -> dict[str, Any]:
    """The chat completion request that ``req`` amounts to (``counting``: only its prompt)."""
    tools = []
    for i, t in enumerate(req.tools or []):
        if t.type not in (None, "custom"):
            raise bad_request(f"tools[{i}]: tool type {t.type[:40]!r} is not supported; only "
                              "client tools with an input_schema are", "tools")  # fmt: skip
        fn = {"name": t.name, "description": t.description, "parameters": t.input_schema}
        tools.append({"type": "function", "function": {k: v for k, v in fn.items() if v}})
    choice, parallel = _tool_choice(req.tool_choice, bool(tools))
    kwargs = dict(req.chat_template_kwargs or {})
    th, budget = req.thinking, None
    if th is not None:
        kwargs["enable_thinking"] = th.type != "disabled"
        if th.type == "enabled":
            if th.budget_tokens is None:
                raise bad_request("thinking.budget_tokens: required when thinking is enabled",
                                  "thinking.budget_tokens")  # fmt: skip
            budget = th.budget_tokens
    body: dict[str, Any] = {
        **passthrough(req.model_extra or {}),
        "model": req.model,
        "messages": chat_messages(req),
        "tools": tools or None,
        "chat_template_kwargs": kwargs,
    }
    if counting:  # the prompt alone: no constraint to compile, one token to fit
        return {**body, "max_tokens": 1}
    assert isinstance(req, MessagesRequest)
    if budget is not None and budget >= req.max_tokens:
        raise bad_request("thinking.budget_tokens: must be less than max_tokens",
                          "thinking.budget_tokens")  # fmt: skip
    body.update(
        tool_choice=choice, parallel_tool_calls=parallel, max_tokens=req.max_tokens,
        stop=req.stop_sequences, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
    )  # fmt: skip
    body[REASONING_BUDGET_FIELD] = budget
    return {k: v for k, v in body.items() if v is not None}


def _tool_choice(tc: AnthropicToolChoice | None, tools: bool) -> tuple[Any, bool | None]:
    if tc is None:
        return None, None
    parallel = False if tc.disable_parallel_tool_use else None
    if tc.type in ("auto", "none"):
        return (tc.type if tools else None), parallel
    if not tools:
        raise bad_request(f"tool_choice: type {tc.type!r} needs tools", "tool_choice")
    if tc.type == "any":
        return "required", parallel
    if not tc.name:
        raise bad_request("tool_choice.name: required for type 'tool'", "tool_choice.name")
    return {"type": "function", "function": {"name": tc.name}}, parallel


def register(app: FastAPI, ctx: Any, start: Callable) -> None:
    """Add the Messages routes. ``start(prepare, req, request)`` checks readiness, prepares
    in a thread and queues the job (app.py)."""

    def prepare(req: MessagesRequest, c: Any, rid: str) -> Any:
        return prepare_as_chat(chat_body(req), c, rid, _PARAMS)

    @app.post("/v1/messages")
    async def create(req: MessagesRequest, request: Request) -> Response:
        p = await start(prepare, req, request)
        writer = MessageWriter(req.model)
        if req.stream:
            headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            body = stream_message(p, ctx, writer)
            return StreamingResponse(body, media_type="text/event-stream", headers=headers)
        return JSONResponse(writer.message(await run_turn(p, ctx, request.receive)))

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(req: CountTokensRequest, request: Request) -> Response:
        c = ctx.ready()
        rid = request.scope["state"]["request_id"]

        def count() -> int:
            p = prepare_as_chat(chat_body(req, counting=True), c, rid, _PARAMS)
            return len(p.job.prompt_ids)

        return JSONResponse({"input_tokens": await asyncio.to_thread(count)})
