"""``lily serve``'s command line: its flags, the Settings they make (with clear errors
naming a bad flag), and the run under uvicorn with a graceful drain on SIGTERM (the app
itself: lily/server/app.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import signal
import threading
from collections.abc import Callable, Mapping
from typing import Any

from lily.config import MAX_RUNNING
from lily.server.app import Context, Settings, create_app

log = logging.getLogger("lily.server")
# After --drain-timeout the server ends what is left (queued requests get a 503, running
# ones are cancelled and their streams closed properly); uvicorn cancels tasks only if they
# are still there this much later.
_END_GRACE = 10.0


async def _end_after_drain(ctx: Context, timeout: float) -> None:
    """Past the drain timeout, end the requests still there ourselves, before uvicorn
    would cancel their tasks (which cut streams mid-chunk and answered queued requests
    with a plain-text 500): queued ones get a 503, running ones are cancelled at their
    next step and their handlers finish the response (an error event, then [DONE])."""
    await asyncio.sleep(timeout)
    if ctx.scheduler is not None:
        running, waiting = ctx.scheduler.busy
        if running or waiting:
            log.warning("drain timeout: ending %d running and %d queued request(s)", running,
                        waiting)  # fmt: skip
        ctx.scheduler.stop()


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """Server flags for ``lily serve`` (the engine flags come from the CLI)."""
    p.add_argument("--host", default="127.0.0.1",
                   help="bind address (default 127.0.0.1: this machine only)")  # fmt: skip
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", action="append", default=[],
                   help=f"accept this bearer key on /v1/* (repeatable; also ${API_KEY_ENV}, "
                   "comma-separated)")  # fmt: skip
    p.add_argument("--api-key-file", help="file with one API key per line")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) clients use (default: the checkpoint's folder)")  # fmt: skip
    p.add_argument("--max-running", type=int, default=Settings.max_running,
                   help="requests computed at once (continuous batching; more wait in the "
                   "queue, as do those whose context memory is not free yet)")  # fmt: skip
    p.add_argument("--queue-size", type=int, default=64,
                   help="requests that may wait; more get 429 (default 64)")  # fmt: skip
    p.add_argument("--default-chat-template-kwargs", default=None,
                   help='JSON, e.g. \'{"enable_thinking": false}\'')  # fmt: skip
    p.add_argument("--cors-origins", nargs="+", default=[],
                   help="allowed CORS origins (default: CORS off)")  # fmt: skip
    p.add_argument("--keepalive", type=float, default=5.0,
                   help="seconds between SSE keep-alive comments while a stream waits")  # fmt: skip
    p.add_argument("--log-requests", action="store_true",
                   help="log prompts (off by default: prompts are private)")  # fmt: skip
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--max-body-bytes", type=int, default=32 << 20,
                   help="largest request body; more gets 413 (default 32 MiB)")  # fmt: skip
    p.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="longest prompt in tokens (default: the context window)")  # fmt: skip
    p.add_argument("--max-request-memory-mb", type=float, default=None,
                   help="most memory one request's KV cache and state may take; requests "
                   "that need more get 400 (default: what the GPU or host has free)")  # fmt: skip
    p.add_argument("--thinking-budget", type=int, default=None,
                   help="reasoning tokens after which </think> is forced, when a request "
                   "sets no budget of its own (default: none; with a budget, thinking requests "
                   "sample on the host each step)")  # fmt: skip
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="compile every kernel variant (or load it from Triton's cache) before "
                   "reporting ready (default: on; --no-warmup starts at once, and the first "
                   "request of each shape waits for its compiles)")  # fmt: skip
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds to let accepted requests finish (default 30)",
    )


API_KEY_ENV = "LILY_API_KEY"


def settings_from_args(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> Settings:
    """Settings from parsed flags (and $LILY_API_KEY); a bad value raises ValueError naming
    the flag."""
    environ = os.environ if environ is None else environ
    keys = list(args.api_key or [])
    if args.api_key_file:
        with open(args.api_key_file, encoding="utf-8") as f:
            keys += [line.strip() for line in f if line.strip()]
    keys += [k.strip() for k in environ.get(API_KEY_ENV, "").split(",") if k.strip()]
    if any(not k.isprintable() or " " in k for k in keys):
        raise ValueError("--api-key: keys must be printable and contain no spaces")
    kwargs: dict[str, Any] = {}
    if args.default_chat_template_kwargs:
        try:
            kwargs = json.loads(args.default_chat_template_kwargs)
        except json.JSONDecodeError as e:
            raise ValueError(f"--default-chat-template-kwargs: not valid JSON ({e})") from None
        if not isinstance(kwargs, dict):
            raise ValueError("--default-chat-template-kwargs: expected a JSON object")
    if args.queue_size < 0:
        raise ValueError("--queue-size: must be >= 0")
    max_running = getattr(args, "max_running", Settings.max_running)
    if not 1 <= max_running <= MAX_RUNNING:
        raise ValueError(f"--max-running: must be between 1 and {MAX_RUNNING} (the requests "
                         "one batched decode step holds)")  # fmt: skip
    if not 0 < args.keepalive <= 3600:
        raise ValueError("--keepalive: must be in (0, 3600] seconds")
    if args.max_body_bytes < 1024:
        raise ValueError("--max-body-bytes: must be at least 1024")
    if args.max_prompt_tokens is not None and args.max_prompt_tokens < 1:
        raise ValueError("--max-prompt-tokens: must be >= 1")
    mem = args.max_request_memory_mb
    if mem is not None and not (math.isfinite(mem) and mem > 0):
        raise ValueError("--max-request-memory-mb: must be a positive number")
    if not (math.isfinite(args.drain_timeout) and args.drain_timeout >= 0):
        raise ValueError("--drain-timeout: must be >= 0 seconds")
    budget = getattr(args, "thinking_budget", None)
    if budget is not None and budget < 0:
        raise ValueError("--thinking-budget: must be >= 0")
    return Settings(
        served_model_names=list(args.served_model_name or []),
        api_keys=list(dict.fromkeys(keys)),
        queue_size=args.queue_size,
        max_running=max_running,
        default_template_kwargs=kwargs,
        cors_origins=list(args.cors_origins or []),
        keepalive=args.keepalive,
        log_requests=args.log_requests,
        max_body_bytes=args.max_body_bytes,
        max_prompt_tokens=args.max_prompt_tokens,
        max_request_memory=None if mem is None else int(mem * (1 << 20)),
        drain_timeout=args.drain_timeout,
        thinking_budget=budget,
        warmup=bool(getattr(args, "warmup", True)),
    )


def run_server(args: argparse.Namespace, load_engine: Callable[[], Any] | None = None) -> int:
    """``lily serve``: build the app and run uvicorn until SIGTERM or Ctrl-C.

    Returns 0 after a graceful shutdown, 1 when the model failed to load."""
    import uvicorn

    settings = settings_from_args(args)
    if load_engine is None:
        from lily.engine_args import load_engine as load_from_args

        def load_engine() -> Any:
            return load_from_args(args)

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    if args.host not in ("127.0.0.1", "localhost", "::1") and not settings.api_keys:
        log.warning("serving on %s without an API key: anyone who can reach it may use it",
                    args.host)  # fmt: skip
    failed = threading.Event()
    ctx = Context(settings)
    server: Any = None

    def stop_on_failure() -> None:
        # A server without a model is of no use: shut uvicorn down and exit non-zero.
        failed.set()
        if server is not None:
            server.should_exit = True

    class _Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            ctx.drain()  # /health turns 503 at once, so balancers stop sending
            if not self.should_exit:
                log.info("signal %d: draining (up to %gs) then exiting", sig,
                         settings.drain_timeout)  # fmt: skip
            super().handle_exit(sig, frame)

        async def shutdown(self, sockets: Any = None) -> None:
            ender = asyncio.ensure_future(_end_after_drain(ctx, settings.drain_timeout))
            try:
                await super().shutdown(sockets)
            finally:
                ender.cancel()

    app = create_app(load_engine, settings, on_load_failure=stop_on_failure, ctx=ctx)
    grace = settings.drain_timeout + _END_GRACE
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=grace)  # fmt: skip
    server = _Server(config)
    if failed.is_set():
        return 1
    # NOTE: uvicorn re-raises the signal it caught once it has shut down, under the handler
    # that was there before; a no-op one makes a drained SIGTERM exit with status 0.
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        server.run()
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 1 if failed.is_set() else 0
