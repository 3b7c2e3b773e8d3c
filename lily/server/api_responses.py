"""The OpenAI Responses API: ``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``.

A request becomes the same engine job as a chat completion: ``input`` items (messages,
``function_call``, ``function_call_output``, ``reasoning``) become chat messages,
``instructions`` a system message first, the flat function tools chat tools, ``text.format``
a ``response_format``; then ``prepare_chat`` renders, checks and constrains it as usual.
The output is written by api_responses_events.py. Errors have the chat API's shape
(``{"error": {...}}``), which is also the Responses API's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ConfigDict, Field

from lily.server.api_responses_events import ResponseWriter, stream_response
from lily.server.blocks import passthrough, prepare_as_chat, run_turn
from lily.server.protocol import ApiError, Lenient, bad_request
from lily.server.response_store import ResponseStore

# Chat field -> Responses field, for the ``param`` of a 400.
_PARAMS = {"messages": "input", "response_format": "text.format", "max_tokens":
           "max_output_tokens", "max_completion_tokens": "max_output_tokens"}  # fmt: skip


class TextFormat(Lenient):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(Lenient):
    format: TextFormat | None = None
    verbosity: str | None = None  # accepted, ignored


class ReasoningConfig(Lenient):
    effort: str | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None  # the old name


class ResponsesRequest(Lenient):
    """``POST /v1/responses``. Other chat-completion fields (top_k, seed, ...) pass through."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[dict[str, Any]] = ""
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = False
    store: bool | None = True
    previous_response_id: str | None = None
    metadata: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    user: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None


def _text(content: Any, where: str, kinds: tuple[str, ...], sep: str = "") -> str:
    """The text of ``where`` (a content field): a string or text parts of the given types."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}: must be a string or a list of parts", "input")
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "refusal" and isinstance(part.get("refusal"), str):
            out.append(part["refusal"])
        elif kind in kinds and isinstance(part.get("text"), str):
            out.append(part["text"])
        elif kind in kinds:
            raise bad_request(f"{where}[{j}].text: must be a string", "input")
        else:
            what = "image, file and audio inputs are" if "input_" in str(kind) else "it is"
            raise bad_request(
                f"{where}[{j}]: part type {str(kind)[:40]!r} is not supported here "
                f"({what} not supported; send {' or '.join(kinds)} parts)",
                "input",
                code="unsupported_content",
            )
    return sep.join(out)


_TEXT_PARTS = ("input_text", "output_text", "text")


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages for ``input``. Consecutive reasoning, assistant message and
    function_call items are one assistant turn (as the model wrote them)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}] if items else []
    out: list[dict[str, Any]] = []
    turn: dict[str, Any] | None = None  # the assistant turn being gathered

    def assistant(part: str) -> dict[str, Any]:
        nonlocal turn
        # A turn's parts come in order reasoning, text, calls; one out of order starts anew.
        order = ("reasoning_content", "content", "tool_calls")
        if (
            turn is None
            or any(turn.get(k) for k in order[order.index(part) + 1 :])
            or (part != "tool_calls" and turn.get(part))
        ):
            turn = {"role": "assistant", "content": ""}
            out.append(turn)
        return turn

    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where}: each input item must be an object", "input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad_request(f"{where}.role: must be user, assistant, system or "
                                  f"developer, got {str(role)[:40]!r}", "input")  # fmt: skip
            text = _text(item.get("content"), f"{where}.content", _TEXT_PARTS)
            if role == "assistant":
                assistant("content")["content"] = text
                continue
            turn = None
            out.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            name, args = item.get("name"), item.get("arguments", "")
            call_id = item.get("call_id") or item.get("id")
            if not isinstance(name, str) or not isinstance(args, str):
                raise bad_request(f"{where}: a function_call needs a string name and string "
                                  "arguments", "input")  # fmt: skip
            call = {"id": call_id, "type": "function",
                    "function": {"name": name, "arguments": args or "{}"}}  # fmt: skip
            assistant("tool_calls").setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = item.get("output", "")
            text = _text(output, f"{where}.output", _TEXT_PARTS)
            turn = None
            out.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": text})
        elif kind == "reasoning":
            text = _text(item.get("content") or [], f"{where}.content", ("reasoning_text",))
            if not text:  # only a summary came back: it stands for the thinking
                summary = item.get("summary") or []
                text = _text(summary, f"{where}.summary", ("summary_text",), "\n\n")
            assistant("reasoning_content")["reasoning_content"] = text
        else:
            raise bad_request(f"{where}: input items of type {str(kind)[:40]!r} are not "
                              "supported (message, function_call, function_call_output and "
                              "reasoning are)", "input", code="unsupported_input")  # fmt: skip
    return out


def _tools(req: ResponsesRequest) -> list[dict[str, Any]] | None:
    if req.tools is None:
        return None
    tools = []
    for i, t in enumerate(req.tools):
        if t.get("type", "function") != "function":
            raise bad_request(f"tools[{i}]: tool type {str(t.get('type'))[:40]!r} is not "
                              "supported; only function tools are", "tools")  # fmt: skip
        fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if k in t}
        tools.append({"type": "function", "function": fn})
    return tools


def _tool_choice(choice: Any) -> Any:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_request("tool_choice: must be none, auto, required or {\"type\": \"function\", "
                      "\"name\": ...}", "tool_choice")  # fmt: skip


def _format(req: ResponsesRequest) -> dict[str, Any] | None:
    f = req.text.format if req.text else None
    if f is None or f.type == "text":
        return None
    if f.type == "json_object":
        return {"type": "json_object"}
    if f.schema_ is None:
        raise bad_request("text.format: a json_schema format needs a schema", "text.format")
    return {"type": "json_schema", "json_schema": {"name": f.name or "output",
            "schema": f.schema_, "strict": f.strict}}  # fmt: skip


def _check(req: ResponsesRequest) -> None:
    if req.background:
        raise bad_request("background: background responses are not supported", "background")
    if req.conversation is not None:
        raise bad_request("conversation: conversations are not supported; use "
                          "previous_response_id or send the items", "conversation")  # fmt: skip
    if req.prompt is not None:
        raise bad_request("prompt: prompt templates are not supported", "prompt")


def chat_body(
    req: ResponsesRequest, history: tuple[dict[str, Any], ...]
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The chat completion request that ``req`` amounts to, and its conversation without
    the instructions (``history``: the conversation of ``previous_response_id``)."""
    _check(req)
    talk = [*history, *input_messages(req.input)]
    if not talk:
        raise bad_request("input: the input is empty", "input")
    messages = list(talk)
    if req.instructions:
        messages.insert(0, {"role": "system", "content": req.instructions})
    lead = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
    if lead > 1:
        # Instructions and developer items before the conversation are one system message:
        # chat templates (Qwen's among them) may take a system message only at the start.
        merged = "\n\n".join(m["content"] for m in messages[:lead])
        messages[:lead] = [{"role": "system", "content": merged}]
    kwargs = dict(req.chat_template_kwargs or {})
    effort = req.reasoning.effort if req.reasoning else None
    if effort == "none":
        kwargs.setdefault("enable_thinking", False)
    tools = _tools(req)
    body = {
        **passthrough(req.model_extra or {}),
        "model": req.model,
        "messages": messages,
        "tools": tools or None,
        # Agents send tool_choice "auto" with no tools; that is no choice at all.
        "tool_choice": _tool_choice(req.tool_choice) if tools else None,
        "parallel_tool_calls": req.parallel_tool_calls,
        "response_format": _format(req),
        "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "chat_template_kwargs": kwargs,
    }
    if req.tool_choice not in (None, "auto", "none") and not tools:
        raise bad_request("tool_choice: only allowed when tools are given", "tool_choice")
    return {k: v for k, v in body.items() if v is not None}, talk


def register(app: FastAPI, ctx: Any, start: Callable, store: ResponseStore) -> None:
    """Add the Responses routes. ``start(prepare, req, request)`` checks readiness,
    prepares in a thread and queues the job (app.py)."""

    @app.post("/v1/responses")
    async def create(req: ResponsesRequest, request: Request) -> Response:
        history: tuple[dict[str, Any], ...] = ()
        if req.previous_response_id:
            prev = store.get(req.previous_response_id)
            if prev is None:
                raise ApiError(400, f"Previous response with id '{req.previous_response_id}' "
                               "not found.", param="previous_response_id",
                               code="previous_response_not_found")  # fmt: skip
            history = prev.messages
        conversation: list[dict[str, Any]] = []

        def prepare(r: ResponsesRequest, c: Any, rid: str) -> Any:
            body, talk = chat_body(r, history)
            conversation.extend(talk)
            return prepare_as_chat(body, c, rid, _PARAMS)

        p = await start(prepare, req, request)
        writer = ResponseWriter(req, req.model or ctx.model_names[0], _summary(req))

        def keep(response: dict[str, Any]) -> None:
            if req.store is not False:
                store.put(response, [*conversation, *writer.assistant_messages()])

        if req.stream:
            headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            body = stream_response(p, ctx, writer, keep)
            return StreamingResponse(body, media_type="text/event-stream", headers=headers)
        response = writer.final(await run_turn(p, ctx, request.receive))
        keep(response)
        return JSONResponse(response)

    @app.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str) -> Response:
        ctx.ready()
        item = store.get(response_id)
        if item is None:
            raise _not_found(response_id)
        return JSONResponse(item.response)

    @app.delete("/v1/responses/{response_id}")
    async def delete(response_id: str) -> Response:
        ctx.ready()
        if not store.delete(response_id):
            raise _not_found(response_id)
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


def _summary(req: ResponsesRequest) -> bool:
    r = req.reasoning
    return r is not None and (r.summary or r.generate_summary) is not None


def _not_found(response_id: str) -> ApiError:
    return ApiError(404, f"No response found with id '{response_id}'.", param="response_id",
                    code="response_not_found")  # fmt: skip
