"""The FastAPI app: routes, CORS, OpenAI-shaped errors, start-up and graceful shutdown.

``lily serve`` runs it (lily/server/serve_cli.py: its flags, uvicorn, SIGTERM). The engine
loads in a background thread so ``/health`` answers 503 while it loads and while its
kernels warm up (lily/runtime/warmup.py; ``--no-warmup`` skips it); then one worker thread
runs the requests (serving.py). API keys, body limits and strict JSON are checked in front
of the app (guard.py). SIGTERM drains: the port closes, requests already accepted (running
or queued) finish, then the process exits 0.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from lily.server import api_messages, api_responses
from lily.server.api_messages_events import AnthropicErrors
from lily.server.grammar import GrammarCompiler
from lily.server.guard import Gate
from lily.server.handlers import prepare_chat, prepare_completion, run_full, run_stream
from lily.server.limits import MemoryGuard
from lily.server.metrics import Metrics
from lily.server.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    check_model,
    validation_message,
)
from lily.server.response_store import ResponseStore
from lily.server.serving import QueueFull, Scheduler, log_error
from lily.server.tokens import detokenize, tokenize

log = logging.getLogger("lily.server")
_JOIN_TIMEOUT = 30.0  # one prefill chunk or decode step, with a wide margin


@dataclass
class Settings:
    """Server options (from the command line)."""

    served_model_names: list[str] = field(default_factory=list)
    api_keys: list[str] = field(default_factory=list)
    queue_size: int = 64
    max_running: int = 8  # requests computed together (continuous batching)
    default_template_kwargs: dict[str, Any] = field(default_factory=dict)
    cors_origins: list[str] = field(default_factory=list)
    keepalive: float = 5.0
    log_requests: bool = False
    max_body_bytes: int = 32 << 20
    max_prompt_tokens: int | None = None  # None: the context window is the only limit
    max_request_memory: int | None = None  # bytes; None: what the device or host has free
    drain_timeout: float = 30.0
    thinking_budget: int | None = None  # reasoning tokens before </think> is forced
    # Compile (or load from Triton's cache) every kernel variant before reporting ready, so
    # the first request of each shape does not wait for compiles (docs/RELIABILITY.md).
    warmup: bool = True
    # Once the model is loaded and warm, the objects that exist live as long as the server:
    # gc.freeze() puts them out of the collector's reach. A full collection walks every
    # tracked object holding the GIL (0.09 s over the loaded server's modules on a 2-core
    # host; 0.003 ms once frozen), and the engine thread stops for it. On an H100 beside a
    # new prefill no full collection fell in the six waits traced, frozen or not, and the
    # gaps were the same (docs/notes/batching.md, "Fourteenth session"): it bounds a rare
    # pause, not the gaps measured there.
    gc_freeze: bool = True


class Context:
    """What request handlers need: the engine, its scheduler and the server's options."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.status = "loading"
        self.error = ""
        self.engine: Any = None
        self.scheduler: Scheduler | None = None
        self.memory: MemoryGuard | None = None
        self.grammars: GrammarCompiler | None = None
        self.metrics = Metrics(settings.served_model_names[0] if settings.served_model_names
                               else "lily")  # fmt: skip
        self.model_names = list(settings.served_model_names)
        self.default_template_kwargs = dict(settings.default_template_kwargs)
        self.keepalive = settings.keepalive
        self.log_requests = settings.log_requests
        self.vocab_size = 0
        self.created = int(time.time())
        self.frozen = False  # the heap was frozen at start-up (Settings.gc_freeze)

    def attach(self, engine: Any) -> None:
        self.engine = engine
        if not self.model_names:
            self.model_names = [engine.model_name]
        self.metrics.model_name = self.model_names[0]
        cfg = getattr(engine, "cfg", None)
        self.vocab_size = max(getattr(cfg, "vocab_size", 0), engine.tokenizer.vocab_size)
        self.grammars = GrammarCompiler(engine.tokenizer)
        self.memory = MemoryGuard(engine, self.settings.max_request_memory)
        self.scheduler = Scheduler(engine, self.metrics, self.settings.queue_size,
                                   self.settings.max_running, self._admit)  # fmt: skip
        self.scheduler.start()
        if self.status == "loading":  # not when a SIGTERM came during the load
            self.status = "ready"

    def _admit(self, job: Any, running: list[Any]) -> bool:
        """Whether ``job`` may start beside ``running`` ones: the memory their contexts
        will need (lily/server/limits.py)."""
        if self.memory is None:
            return True

        def lengths(j: Any) -> tuple[int, int]:
            n, mt = len(j.prompt_ids), j.params.max_tokens
            return n, n + (mt if mt is not None else self.engine.max_context - n)

        return self.memory.admits(*lengths(job), [lengths(j) for j in running])

    def ready(self) -> Context:
        if self.status != "ready" or self.scheduler is None or not self.scheduler.alive:
            msg = {
                "loading": "the model is still loading",
                "warming up": "the kernels are still compiling",
                "draining": "the server is shutting down",
            }.get(self.status, "engine is down")
            raise ApiError(503, msg, type="service_unavailable", headers={"Retry-After": "5"})
        return self

    def drain(self) -> None:
        """Refuse new requests from now on (the ones accepted still finish)."""
        if self.status in ("ready", "loading", "warming up"):
            self.status = "draining"


def _error(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def create_app(
    load_engine: Callable[[], Any],
    settings: Settings,
    on_load_failure: Callable[[], None] | None = None,
    ctx: Context | None = None,
) -> FastAPI:
    """The app; ``load_engine`` runs in a background thread at startup.

    If loading fails, /health stays 503 and ``on_load_failure`` (if given) is called.
    """
    ctx = ctx or Context(settings)

    async def lifespan(app: FastAPI):  # noqa: ANN202
        def load() -> None:
            try:
                engine = load_engine()
                _start_engine(engine, ctx)
                ctx.attach(engine)
                if settings.gc_freeze:
                    gc.collect()
                    gc.freeze()
                    ctx.frozen = True
                log.info("model ready: %s", ", ".join(ctx.model_names))
            except Exception as e:
                if isinstance(e, ValueError | OSError):
                    # A bad checkpoint or flag: the message names the file and tensor; a
                    # traceback would only hide it.
                    log.error("lily: error: cannot load the model: %s", e)
                else:
                    log.exception("loading the model failed")
                ctx.status, ctx.error = "failed", f"{type(e).__name__}: {e}"
                if on_load_failure is not None:
                    on_load_failure()

        threading.Thread(target=load, name="lily-load", daemon=True).start()
        yield
        if ctx.scheduler is not None:
            # NOTE: joined, not left to die with the process: a daemon thread inside torch
            # at interpreter exit aborted it ("terminate called without an active
            # exception", exit status -6).
            if not await asyncio.to_thread(ctx.scheduler.close, _JOIN_TIMEOUT):
                log.error("the engine did not stop within %gs", _JOIN_TIMEOUT)
        if ctx.frozen:  # (what the server held may be collected again once it is gone)
            gc.unfreeze()
            ctx.frozen = False

    # No /docs or /redoc: they load scripts from a CDN. /openapi.json stays (no secrets).
    app = FastAPI(title="lily", version="0.1.0", lifespan=lifespan, docs_url=None,
                  redoc_url=None)  # fmt: skip
    app.state.ctx = ctx

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return _error(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        msg, param = validation_message(exc.errors())
        return _error(ApiError(400, msg, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        e = ApiError(exc.status_code, str(exc.detail), type=kind)
        e.headers = dict(exc.headers or {})
        return _error(e)

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception) -> JSONResponse:
        rid = request.scope.get("state", {}).get("request_id", "?")
        log_error(f"request {rid}: unhandled error", exc, ctx.log_requests)
        return _error(ApiError(500, f"internal error: {type(exc).__name__}", type="server_error"))

    @app.get("/health")
    async def health() -> Response:
        if ctx.status == "ready" and ctx.scheduler is not None and ctx.scheduler.alive:
            return JSONResponse({"status": "ok"})
        body = {"status": ctx.status if ctx.status != "ready" else "dead", "error": ctx.error}
        return JSONResponse(body, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return PlainTextResponse(ctx.metrics.render(), media_type="text/plain; version=0.0.4")

    def card(c: Context, name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": c.created, "owned_by": "lily",
                "root": name, "max_model_len": c.engine.max_context}  # fmt: skip

    @app.get("/v1/models")
    async def models() -> Response:
        c = ctx.ready()
        return JSONResponse({"object": "list", "data": [card(c, n) for n in c.model_names]})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        c = ctx.ready()
        check_model(model_id, c.model_names)
        return JSONResponse(card(c, model_id))

    @app.post("/tokenize")
    async def tokenize_route(req: TokenizeRequest, request: Request) -> Response:
        rid = request.scope["state"]["request_id"]
        return JSONResponse(await asyncio.to_thread(tokenize, req, ctx.ready(), rid))

    @app.post("/detokenize")
    async def detokenize_route(req: DetokenizeRequest, request: Request) -> Response:
        rid = request.scope["state"]["request_id"]
        return JSONResponse(await asyncio.to_thread(detokenize, req, ctx.ready(), rid))

    async def start(prepare: Callable, req: Any, request: Request) -> Any:
        """Check readiness, prepare the job in a thread (400s come from there), queue it."""
        if ctx.status == "draining":
            ctx.metrics.add("request_rejected")
        c = ctx.ready()
        rid = request.scope["state"]["request_id"]
        p = await asyncio.to_thread(prepare, req, c, rid)
        try:
            c.scheduler.submit(p.job)
        except QueueFull:
            c.metrics.add("request_rejected")
            raise ApiError(
                429,
                f"the server is busy: {c.settings.queue_size} requests are already waiting",
                type="rate_limit_error",
                code="queue_full",
                headers={"Retry-After": str(_retry_after(c))},
            ) from None
        return p

    async def dispatch(prepare: Callable, req: Any, request: Request) -> Response:
        p = await start(prepare, req, request)
        model = req.model or ctx.model_names[0]
        if p.stream:
            headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            return StreamingResponse(
                run_stream(p, ctx, model), media_type="text/event-stream", headers=headers
            )
        return JSONResponse(await run_full(p, ctx, model, request.receive))

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
        return await dispatch(prepare_chat, req, request)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Response:
        return await dispatch(prepare_completion, req, request)

    # The other APIs agents speak: same engine job, their own wire (docs/API.md).
    api_responses.register(app, ctx, start, ResponseStore())
    api_messages.register(app, ctx, start)

    app = Gate(app, settings.api_keys, settings.max_body_bytes)  # type: ignore[assignment]
    app = AnthropicErrors(app)  # type: ignore[assignment]
    if settings.cors_origins:
        app = CORSMiddleware(  # type: ignore[assignment]
            app, allow_origins=settings.cors_origins, allow_methods=["*"],
            allow_headers=["*"], expose_headers=["X-Request-Id"],
        )  # fmt: skip
    return app


def _start_engine(engine: Any, ctx: Context) -> None:
    """Print the architecture report, then warm the kernels up (/health says "warming up"
    meanwhile); the report goes to the log, the warm-up's progress bar to stderr. An engine
    without a memory plan or runner (a test double) skips them."""
    from lily.runtime.arch_report import architecture_report, format_report

    if hasattr(engine, "memory_plan"):
        for line in format_report(architecture_report(engine)):
            log.info("%s", line)
    if ctx.settings.warmup and hasattr(engine, "runner"):
        from lily.runtime.warmup import warm_up

        if ctx.status == "loading":
            ctx.status = "warming up"
        warm_up(engine, log=lambda m: log.info("%s", m), max_running=ctx.settings.max_running)
        if ctx.status == "warming up":
            ctx.status = "loading"  # attach makes it ready


def _retry_after(ctx: Context) -> int:
    h = ctx.metrics.histograms["e2e_request_latency_seconds"]
    mean = h.total / h.n if h.n else 1.0
    return max(1, min(60, math.ceil(mean)))
