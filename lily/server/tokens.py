"""vLLM's utility endpoints: ``POST /tokenize`` and ``POST /detokenize``.

``/tokenize`` takes a ``prompt``, or ``messages`` (with ``tools``, ``add_generation_prompt``
and ``chat_template_kwargs``) rendered exactly as a chat completion renders them, and
returns ``{count, max_model_len, tokens, token_strs}``; ``/detokenize`` takes ``tokens`` and
returns ``{prompt}``. Both run in a worker thread, never on the event loop.
"""

from __future__ import annotations

from typing import Any

from lily.server.handlers import render_chat
from lily.server.protocol import (
    DetokenizeRequest,
    TokenizeRequest,
    bad_request,
    check_content,
    check_model,
    check_tools,
)


def tokenize(req: TokenizeRequest, ctx: Any, request_id: str) -> dict[str, Any]:
    """The token ids of a prompt or of rendered chat messages."""
    check_model(req.model, ctx.model_names)
    if req.chat_template is not None:
        raise bad_request("chat_template: not accepted; the server's own template is used",
                          "chat_template")  # fmt: skip
    if req.continue_final_message:
        raise bad_request("continue_final_message: not supported", "continue_final_message")
    tok = ctx.engine.tokenizer
    if req.messages is not None:
        if not req.messages:
            raise bad_request("messages: give at least one message", "messages")
        check_content(req.messages)
        check_tools(req.tools)
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        prompt, ids, _ = render_chat(
            ctx,
            req.messages,
            tools,
            req.chat_template_kwargs,
            request_id,
            add_generation_prompt=req.add_generation_prompt,
        )
    else:
        prompt = req.prompt or ""
        ids = tok.encode(prompt)
    strs = None
    if req.return_token_strs:
        # Each token's own text (bytes that are not whole UTF-8 characters show as U+FFFD).
        strs = [(tok.token_bytes(i) or tok.decode([i]).encode()).decode("utf-8", "replace")
                for i in ids]  # fmt: skip
    return {"count": len(ids), "max_model_len": ctx.engine.max_context, "tokens": ids,
            "token_strs": strs}  # fmt: skip


def detokenize(req: DetokenizeRequest, ctx: Any, request_id: str) -> dict[str, Any]:
    """The text of token ids (special tokens included)."""
    check_model(req.model, ctx.model_names)
    bad = next((t for t in req.tokens if not 0 <= t < ctx.vocab_size), None)
    if bad is not None:
        raise bad_request(f"tokens: {bad} is not a token id of this model (an integer in "
                          f"[0, {ctx.vocab_size}))", "tokens")  # fmt: skip
    return {"prompt": ctx.engine.tokenizer.decode(req.tokens)}
