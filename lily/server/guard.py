"""The front door: request ids, API keys, body size, strict JSON. Pure ASGI, streaming-safe.

Everything here runs before FastAPI parses a request, so a hostile body is refused cheaply:
an unauthenticated client's body is never read; a body over ``max_body_bytes`` is cut off
with a 413 without buffering it; a body that Python's lenient JSON parser would accept but
JSON does not (NaN, Infinity, 1e999, invalid UTF-8, lone surrogates) or that nests deeper
than ``MAX_JSON_DEPTH`` is a 400 before any model code sees it.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import math
import uuid
from typing import Any

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from lily.server.protocol import ApiError

# JSON schemas and tool arguments nest a few levels; hundreds only serve to exhaust the
# recursion of every later walker (pydantic, Jinja's tojson, llguidance).
MAX_JSON_DEPTH = 64
GUARDED = ("/v1", "/tokenize", "/detokenize")  # paths behind the API key and body checks
_PARSE_IN_THREAD = 1 << 20  # bytes
_ID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.:/+=")


class BadJson(ValueError):
    """A body that is not strict JSON; the message says why."""


def _reject_constant(name: str) -> Any:
    raise BadJson(f"{name} is not a valid JSON number")


def _finite_float(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):
        raise BadJson(f"the number {text[:40]} is out of range")
    return v


def strict_loads(body: bytes) -> Any:
    """Parse ``body`` as RFC 8259 JSON in UTF-8; raise BadJson naming the problem."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadJson(f"the request body is not valid UTF-8 (byte {e.start})") from None
    try:
        obj = json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
    except BadJson:
        raise
    except RecursionError:
        raise BadJson(f"JSON nested deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as e:  # JSONDecodeError, and ints over Python's 4300-digit limit
        raise BadJson(f"the request body is not valid JSON: {e}") from None
    check_tree(obj)
    return obj


def check_tree(obj: Any) -> None:
    """Depth limit and valid Unicode (no lone surrogates) over the parsed body."""
    stack = [(obj, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            items = list(node.keys()) + list(node.values())
        elif isinstance(node, list):
            items = node
        else:
            continue
        if depth > MAX_JSON_DEPTH:
            raise BadJson(f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
        for x in items:
            if isinstance(x, str):
                if not x.isascii():
                    _check_unicode(x)
            elif isinstance(x, dict | list):
                stack.append((x, depth + 1))


def _check_unicode(s: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = s[e.start]
        msg = f"a string holds the lone surrogate \\u{ord(bad):04x} (not valid Unicode)"
        raise BadJson(msg) from None


def _key_digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


class Gate:
    """Echo ``X-Request-Id``; check API keys (Bearer or x-api-key) on /v1/* and the tokenizer
    endpoints; cap and strictly parse their POST bodies."""

    def __init__(self, app: ASGIApp, keys: list[str], max_body_bytes: int) -> None:
        self.app = app
        # NOTE: compared as SHA-256 digests, so the comparison takes the same time whatever
        # the length of the key sent (compare_digest alone returns early on a length mismatch).
        self.digests = [_key_digest(k.encode()) for k in keys]
        self.max_body = max_body_bytes

    def authorized(self, header: bytes) -> bool:
        scheme, _, token = header.partition(b" ")
        got = _key_digest(token.strip())
        ok = False
        for d in self.digests:  # no early exit: the time taken does not depend on which key
            ok |= hmac.compare_digest(got, d)
        return ok and scheme.lower() == b"bearer"

    def _any_key(self, headers: dict[bytes, bytes]) -> bool:
        # The Anthropic API sends its key as x-api-key; either header may carry it.
        if self.authorized(headers.get(b"authorization", b"")):
            return True
        return b"x-api-key" in headers and self.authorized(b"Bearer " + headers[b"x-api-key"])

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        rid = _request_id(headers.get(b"x-request-id", b""))
        scope.setdefault("state", {})["request_id"] = rid

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-request-id", rid.encode())]
            await send(message)

        path = scope.get("path", "")
        guarded = path.startswith(GUARDED) and scope.get("method") != "OPTIONS"
        if guarded and self.digests and not self._any_key(headers):
            msg = "Invalid or missing API key (send 'Authorization: Bearer KEY' or 'x-api-key')"
            e = ApiError(401, msg, type="authentication_error", code="invalid_api_key",
                         headers={"WWW-Authenticate": "Bearer"})  # fmt: skip
            await _respond(e, scope, receive, send_with_id)
            return
        if not (guarded and scope.get("method") == "POST"):
            await self.app(scope, receive, send_with_id)
            return
        try:
            body = await self._read_body(headers, receive)
            if len(body) > _PARSE_IN_THREAD:  # tens of ms per MiB: not on the event loop
                await asyncio.to_thread(strict_loads, body)
            else:
                strict_loads(body)
        except ApiError as e:
            await _respond(e, scope, receive, send_with_id)
            return
        except BadJson as e:
            await _respond(ApiError(400, str(e)), scope, receive, send_with_id)
            return
        await self.app(scope, _replay(body, receive), send_with_id)

    async def _read_body(self, headers: dict[bytes, bytes], receive: Receive) -> bytes:
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body:
            raise self._too_large()
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ApiError(400, "the client went away before sending the whole body")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                raise self._too_large()
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    def _too_large(self) -> ApiError:
        return ApiError(413, f"the request body is larger than this server's limit of "
                        f"{self.max_body} bytes (--max-body-bytes)",
                        code="request_too_large", headers={"Connection": "close"})  # fmt: skip


def _request_id(raw: bytes) -> str:
    # Echoed in a header and written to logs: keep it short and plain.
    rid = raw.decode("latin-1")[:128]
    return rid if rid and set(rid) <= _ID_CHARS else uuid.uuid4().hex


async def _respond(e: ApiError, scope: Scope, receive: Receive, send: Send) -> None:
    await JSONResponse(e.body(), status_code=e.status, headers=e.headers)(scope, receive, send)


def _replay(body: bytes, receive: Receive) -> Receive:
    """The app reads the buffered body once; after that, the client's own messages (the
    disconnect a non-streaming request watches for)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
