"""Request handling: prompt, sampling parameters and constraints in; responses out.

``prepare_chat`` / ``prepare_completion`` check a request and build the engine job (all
client mistakes become 400s here, before anything is queued); ``run_stream`` and
``run_full`` turn the job's steps into an SSE stream or one JSON body.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import torch
from jinja2.exceptions import SecurityError, TemplateNotFound

from lily.runtime.engine import ContextLengthError
from lily.runtime.sampling import SamplingParams
from lily.server.constraints import DecodeSpec, build_processor, parse_logit_bias
from lily.server.grammar import ConstraintFailed
from lily.server.limits import check_lengths, prompt_limit, too_long
from lily.server.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    NamedToolChoice,
    SamplingFields,
    bad_request,
    check_model,
    check_request,
    response_schema,
    usage_dict,
)
from lily.server.reasoning import prompt_opens_thinking
from lily.server.responses import ChatOutput, ChunkMaker, LogprobFormatter, chat_delta_json
from lily.server.serving import Job, events, log_error
from lily.tokenizer import ChatTemplateError, PromptTooLong

log = logging.getLogger("lily.server")

_DEFAULTED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
              "presence_penalty", "frequency_penalty")  # fmt: skip


@dataclass
class Prepared:
    """A checked request: the engine job and how to present its output."""

    kind: str  # "chat" or "completion"
    job: Job
    stream: bool
    include_usage: bool
    reasoning_mode: str = "content"
    tools: list[dict[str, Any]] | None = None  # parse tool calls against these
    logprobs: bool = False
    echo: str = ""
    parallel_tool_calls: bool = True


def _sampling(req: SamplingFields, ctx: Any, n_prompt: int, max_tokens: int | None) -> Any:
    engine = ctx.engine
    max_tokens = check_lengths(ctx, n_prompt, max_tokens, _prompt_param(req))
    defaults = engine.generation_defaults or {}
    kw = {n: defaults[n] for n in _DEFAULTED if defaults.get(n) is not None}
    kw.update({n: getattr(req, n) for n in _DEFAULTED if getattr(req, n) is not None})
    if isinstance(req, ChatCompletionRequest):
        lp = (req.top_logprobs or 0) if req.logprobs else None
    else:
        lp = req.logprobs
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    bad = [i for i in req.stop_token_ids or () if not 0 <= i < ctx.vocab_size]
    if bad:  # as for prompt token ids: an id the model has no row for is the client's error
        raise bad_request(f"stop_token_ids: token ids must be in [0, {ctx.vocab_size}), "
                          f"got {bad[0]}", "stop_token_ids")  # fmt: skip
    try:
        params = SamplingParams(
            **kw,
            seed=req.seed,
            max_tokens=max_tokens,
            stop=tuple(stop),
            stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=bool(req.ignore_eos),
            logprobs=lp,
        )
        params.validate()
    except (TypeError, ValueError) as e:
        msg = str(e)
        raise bad_request(msg, msg.split(":", 1)[0] if ":" in msg else None) from None
    return params


def _prompt_param(req: SamplingFields) -> str:
    return "messages" if isinstance(req, ChatCompletionRequest) else "prompt"


def render_chat(
    ctx: Any,
    messages_in: list[Any],
    tools: list[dict[str, Any]] | None,
    template_kwargs: dict[str, Any] | None,
    request_id: str,
    add_generation_prompt: bool = True,
) -> tuple[str, list[int], Any]:
    """The prompt text of chat messages, its token ids (special-token text in the messages
    stays text) and the ``enable_thinking`` it was rendered with."""
    kwargs = {**ctx.default_template_kwargs, **(template_kwargs or {})}
    enable_thinking = kwargs.pop("enable_thinking", True)
    for reserved in ("messages", "tools", "add_generation_prompt"):
        kwargs.pop(reserved, None)
    messages = []
    for m in messages_in:
        d = m.model_dump(exclude_none=True)
        if d["role"] == "developer":
            d["role"] = "system"
        messages.append(d)
    try:
        prompt, ids = ctx.engine.tokenizer.render_chat(
            messages, tools=tools, add_generation_prompt=add_generation_prompt,
            enable_thinking=bool(enable_thinking), max_tokens=prompt_limit(ctx), **kwargs,
        )  # fmt: skip
    except PromptTooLong as e:
        raise too_long(ctx, e, "messages") from None
    except ChatTemplateError as e:
        if template_at_fault(e):
            log.error("request %s: the chat template failed: %s", request_id, e)
            raise ApiError(500, f"the server's chat template failed: {e}", type="server_error",
                           code="chat_template_error") from None  # fmt: skip
        raise bad_request(str(e), "messages") from None
    return prompt, ids, enable_thinking


def prepare_chat(
    req: ChatCompletionRequest, ctx: Any, request_id: str, thinking_budget: int | None = None
) -> Prepared:
    """Render the prompt, build sampling parameters and the decoding controls (tools,
    response format, reasoning budget, logit_bias). Runs in a thread.

    ``thinking_budget``, when given, overrides the request's own field (the other APIs map
    their budget onto it)."""
    check_request(req)
    check_model(req.model, ctx.model_names)
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    prompt, ids, enable_thinking = render_chat(
        ctx, req.messages, tools, req.chat_template_kwargs, request_id
    )
    max_tokens = req.max_completion_tokens or req.max_tokens
    params = _sampling(req, ctx, len(ids), max_tokens)

    if prompt_opens_thinking(prompt):
        mode = "reasoning"
    else:
        mode = "content" if enable_thinking is False else "detect"
    choice = req.tool_choice
    named = isinstance(choice, NamedToolChoice)
    parallel = req.parallel_tool_calls is not False
    spec = DecodeSpec(
        tools=tools,
        tool_choice="required" if named else (choice or "auto"),
        tool_name=choice.function.name if named else None,
        json_schema=response_schema(req.response_format),
        parallel_tool_calls=parallel,
        thinking_budget=req.reasoning_budget if thinking_budget is None else thinking_budget,
        logit_bias=parse_logit_bias(req.logit_bias, ctx.vocab_size),
    )
    processor = build_processor(
        ctx, spec, after_think=mode == "reasoning", max_new=_max_new(ctx, params, len(ids)),
        stop_ids=params.stop_token_ids, ignore_eos=params.ignore_eos,
    )  # fmt: skip
    if ctx.log_requests:
        log.info("request %s prompt: %r", request_id, prompt)
    return Prepared(
        kind="chat",
        job=Job(ids, params, processor, request_id=request_id),
        stream=bool(req.stream),
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        reasoning_mode=mode,
        tools=tools if tools and choice != "none" else None,
        logprobs=bool(req.logprobs),
        parallel_tool_calls=parallel,
    )


def _max_new(ctx: Any, params: SamplingParams, n_prompt: int) -> int:
    """Tokens the job may generate: max_tokens, else the rest of the context."""
    return params.max_tokens if params.max_tokens is not None else ctx.engine.max_context - n_prompt


def template_at_fault(e: ChatTemplateError) -> bool:
    """True when the template, not the request, failed: it tried something the sandbox
    forbids (Python internals, loading other templates). Such a template is the server's
    fault (it came with the checkpoint), so the request gets a 500, not a 400."""
    cause = e.__cause__
    if isinstance(cause, SecurityError | TemplateNotFound):
        return True
    return isinstance(cause, TypeError) and "no loader" in str(cause)


def prepare_completion(req: CompletionRequest, ctx: Any, request_id: str) -> Prepared:
    """Tokenize the prompt (text or ids) and build sampling parameters. Runs in a thread."""
    check_request(req)
    check_model(req.model, ctx.model_names)
    p = req.prompt
    if isinstance(p, list) and p and isinstance(p[0], str | list):
        if len(p) != 1:
            raise bad_request("prompt: only one prompt per request is supported", "prompt")
        p = p[0]
    if isinstance(p, str):
        try:
            text, ids = p, ctx.engine.tokenizer.encode(p, max_tokens=prompt_limit(ctx))
        except PromptTooLong as e:
            raise too_long(ctx, e, "prompt") from None
    else:
        ids = list(p)
        if any(not isinstance(i, int) or not 0 <= i < ctx.vocab_size for i in ids):
            raise bad_request(f"prompt: token ids must be in [0, {ctx.vocab_size})", "prompt")
        text = ctx.engine.tokenizer.decode(ids)
    if not ids:
        raise bad_request("prompt: the prompt is empty", "prompt")
    params = _sampling(req, ctx, len(ids), req.max_tokens)
    spec = DecodeSpec(json_schema=response_schema(req.response_format),
                      logit_bias=parse_logit_bias(req.logit_bias, ctx.vocab_size))  # fmt: skip
    processor = build_processor(
        ctx, spec, after_think=False, max_new=_max_new(ctx, params, len(ids)),
        stop_ids=params.stop_token_ids, ignore_eos=params.ignore_eos,
    )  # fmt: skip
    if ctx.log_requests:
        log.info("request %s prompt: %r", request_id, text)
    return Prepared(
        kind="completion",
        job=Job(ids, params, processor, request_id=request_id),
        stream=bool(req.stream),
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        logprobs=req.logprobs is not None,
        echo=text if req.echo else "",
    )


def _usage(usage: Any, reasoning_tokens: int) -> dict[str, Any]:
    return usage_dict(
        usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens, reasoning_tokens
    )


def engine_error(e: BaseException) -> ApiError:
    """The client's view of a job that failed in the engine."""
    if isinstance(e, ConstraintFailed):
        # The request's schema was more than the grammar engine could follow: retrying
        # will not help (so not a 5xx), and no answer breaking the constraint is sent.
        return ApiError(400, str(e), param=e.param, code="constraint_failed")
    if isinstance(e, ContextLengthError):
        return ApiError(400, str(e), param="messages", code="context_length_exceeded")
    if isinstance(e, torch.OutOfMemoryError):
        return ApiError(503, "the engine ran out of memory for this request; try a shorter "
                        "one or later", type="server_error", code="out_of_memory",
                        headers={"Retry-After": "5"})  # fmt: skip
    return ApiError(500, f"engine error: {type(e).__name__}: {e}", type="server_error")


def cancelled_error() -> ApiError:
    # Seen only by a client still there: the server dropped its queued request on shutdown.
    msg = "the request was cancelled: the server is shutting down"
    return ApiError(503, msg, type="server_error", code="cancelled", headers={"Retry-After": "5"})


# Characters JSON may leave raw but str.splitlines() (and clients built on it) takes for line
# ends, which would cut an SSE event in two: sent as \u escapes (the same JSON).
_LINE_BREAKS = {c: f"\\u{c:04x}" for c in (0x85, 0x2028, 0x2029)}


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False).translate(_LINE_BREAKS)}\n\n"


def _chat_output(p: Prepared, ctx: Any) -> ChatOutput:
    tok = ctx.engine.tokenizer
    return ChatOutput(tok, p.reasoning_mode, p.tools, p.logprobs, set(tok.eos_token_ids),
                      p.parallel_tool_calls)  # fmt: skip


async def run_stream(p: Prepared, ctx: Any, model: str) -> AsyncIterator[str]:
    """SSE body: role first, deltas, a finish chunk, usage if asked, then [DONE].

    A bug past the headers still ends the stream cleanly: an error event, then [DONE]."""
    try:
        async for piece in _stream_body(p, ctx, model):
            yield piece
    except Exception as e:
        log_error(f"request {p.job.request_id}: streaming failed", e, ctx.log_requests)
        err = ApiError(500, f"internal error: {type(e).__name__}", type="server_error")
        yield _sse(err.body())
        yield "data: [DONE]\n\n"
    finally:
        ctx.scheduler.cancel(p.job)


async def _stream_body(p: Prepared, ctx: Any, model: str) -> AsyncIterator[str]:
    maker = ChunkMaker(p.kind, model, p.include_usage)
    job = p.job
    out = _chat_output(p, ctx)
    fmt = LogprobFormatter(ctx.engine.tokenizer)
    reason = None
    try:
        if p.kind == "chat":
            yield _sse(maker.chunk({"role": "assistant", "content": ""}))
        elif p.echo:
            yield _sse(maker.chunk(text=p.echo))
        async for kind, value in events(job, ctx.keepalive):
            if kind == "keepalive":
                yield ": keep-alive\n\n"
            elif kind == "cancelled":
                yield _sse(cancelled_error().body())
                break
            elif kind == "error":
                yield _sse(engine_error(value).body())
                break
            elif kind == "step":
                reason = value.finish_reason
                if p.kind == "chat":
                    d = out.push(value)
                    for wire in chat_delta_json(d):
                        lp = {"content": d.logprobs} if p.logprobs and d.logprobs else None
                        d.logprobs = []
                        yield _sse(maker.chunk(wire, logprobs=lp))
                elif value.token_id is not None and (value.text or p.logprobs):
                    lp = None
                    if p.logprobs and value.logprob is not None:
                        t, v, top = fmt.completion_entry(value)
                        lp = {"tokens": [t], "token_logprobs": [v], "top_logprobs": [top],
                              "text_offset": [0]}  # fmt: skip
                    yield _sse(maker.chunk(text=value.text, logprobs=lp))
            elif kind == "done" and reason == "cancelled":
                # Only the server cancels a request whose client is still reading: it is
                # shutting down (a client that left reads nothing).
                yield _sse(cancelled_error().body())
            elif kind == "done":
                if p.kind == "chat":
                    d = out.finish(reason)
                    lp = {"content": d.logprobs} if p.logprobs and d.logprobs else None
                    for wire in chat_delta_json(d) or ([{}] if lp else []):
                        yield _sse(maker.chunk(wire, logprobs=lp))
                        lp = None
                    fr = out.finish_reason(reason)
                    yield _sse(maker.chunk({}, finish_reason=fr))
                    rt = out.reasoning_tokens
                else:
                    fr = "length" if reason == "length" else "stop"
                    yield _sse(maker.chunk(text="", finish_reason=fr))
                    rt = 0
                if p.include_usage:
                    yield _sse(maker.usage_chunk(_usage(value, rt)))
        yield "data: [DONE]\n\n"
    finally:
        ctx.scheduler.cancel(job)  # no-op when finished; frees the engine on disconnect


async def run_full(p: Prepared, ctx: Any, model: str, receive: Callable) -> dict[str, Any]:
    """The whole response as one object; raises ApiError on an engine fault.

    ``receive`` is the request's ASGI receive: a disconnect cancels the job.
    """
    job = p.job
    eos = set(ctx.engine.tokenizer.eos_token_ids)
    out = _chat_output(p, ctx)
    fmt = LogprobFormatter(ctx.engine.tokenizer)
    text, reason, usage = "", None, None
    lps: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                            "text_offset": []}  # fmt: skip

    async def watch() -> None:
        # NOTE: the body is read, so the next ASGI message is the client going away.
        while (await receive())["type"] != "http.disconnect":
            pass
        ctx.scheduler.cancel(job)

    watcher = asyncio.ensure_future(watch())
    try:
        async for kind, value in events(job, None):
            if kind == "error":
                raise engine_error(value)
            if kind == "cancelled":
                raise cancelled_error()
            if kind == "step":
                reason = value.finish_reason
                if p.kind == "chat":
                    out.push(value)
                    continue
                if value.token_id is None:
                    continue
                if (
                    p.logprobs
                    and value.logprob is not None
                    and not (reason == "stop" and value.token_id in eos)
                ):
                    t, v, top = fmt.completion_entry(value)
                    lps["text_offset"].append(len(p.echo) + len(text))
                    lps["tokens"].append(t)
                    lps["token_logprobs"].append(v)
                    lps["top_logprobs"].append(top)
                text += value.text
            elif kind == "done":
                if reason == "cancelled":  # the server is shutting down (see run_stream)
                    raise cancelled_error()
                usage = value
    finally:
        watcher.cancel()
        ctx.scheduler.cancel(job)
    maker = ChunkMaker(p.kind, model, False)
    if p.kind == "chat":
        out.finish(reason)
        choice = {
            "index": 0,
            "message": out.message(),
            "logprobs": {"content": out.all_logprobs} if p.logprobs else None,
            "finish_reason": out.finish_reason(reason),
        }
        obj, rt = "chat.completion", out.reasoning_tokens
    else:
        choice = {
            "index": 0,
            "text": p.echo + text,
            "logprobs": lps if p.logprobs else None,
            "finish_reason": "length" if reason == "length" else "stop",
        }
        obj, rt = "text_completion", 0
    return {
        "id": maker.id,
        "object": obj,
        "created": maker.created,
        "model": model,
        "choices": [choice],
        "usage": _usage(usage, rt),
    }
