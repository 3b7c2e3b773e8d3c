"""Request limits: prompt length, context window, and memory for the KV cache and state.

A request whose KV cache and state would not fit in memory is refused before it runs.

A request that runs out of device memory halfway wastes the work done and, on a CPU host,
invites the kernel's OOM killer, which takes the whole server down. So each request's
memory is estimated before it is queued, by the runtime's memory plan
(lily/runtime/memory_plan.py: K/V caches grow in steps, the DeltaNet states are fixed, and
a prefill chunk needs activations). It is compared with what is free: on a GPU, free
device memory plus what PyTorch holds in reserve plus the working state (reused by the
next request), less what
the prefix cache may take meanwhile (a copy of that state and a few snapshots, within its
budget) and a margin; on a CPU, MemAvailable from /proc/meminfo likewise.
``--max-request-memory-mb`` caps it further (the only limit where neither reading works).
The estimate is deliberately simple; a request that still runs out of device memory is
caught as an engine error (serving.py, a 503), not a crash.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lily.encoding import PromptTooLong
from lily.runtime.engine import ContextLengthError
from lily.runtime.memory_plan import (
    MARGIN,
    SNAPSHOTS,
    RequestEstimate,
    meminfo_available,
    request_estimate,
    request_kv_capacity,
)
from lily.server.protocol import ApiError, bad_request

MiB = 1 << 20
_SAFETY = MARGIN  # allocator fragmentation, CUDA graphs, sampler and grammar buffers
Estimate = RequestEstimate


def kv_capacity(n_prompt: int, n_total: int, chunk: int, limit: int) -> int:
    """The K/V capacity a fresh state reaches for ``n_total`` tokens (the runtime's policy;
    ``chunk`` no longer matters: the engine reserves the whole prompt at once)."""
    return request_kv_capacity(n_prompt, n_total, limit)


def estimate(cfg: Any, dtype: torch.dtype, n_prompt: int, n_total: int, chunk: int,
             limit: int, kernels: bool) -> Estimate:  # fmt: skip
    """What a request of ``n_prompt`` prompt tokens growing to ``n_total`` needs (asked of
    the runtime's memory plan)."""
    return request_estimate(cfg, dtype, n_prompt, n_total, chunk, limit, kernels)


_meminfo_available = meminfo_available


def _device_free(device: str) -> int | None:
    if not device.startswith("cuda") or not torch.cuda.is_available():
        return None
    dev = torch.device(device)
    free, _ = torch.cuda.mem_get_info(dev)
    return free + torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)


class MemoryGuard:
    """Answers how many tokens a request may grow to; ``limit_bytes`` None reads the host."""

    def __init__(self, engine: Any, limit_bytes: int | None = None,
                 free_reader: Callable[[], int | None] | None = None) -> None:  # fmt: skip
        self.engine = engine
        self.limit = limit_bytes
        ecfg = engine.engine_cfg
        self.device = str(ecfg.device)
        self._free = free_reader or (
            (lambda: _device_free(self.device))
            if self.device.startswith("cuda")
            else _meminfo_available
        )

    def available(self) -> int | None:
        """Bytes a new request may use, or None when there is no way to know."""
        free = self._free()
        if free is not None:
            e = self.engine
            # The working states' buffers are reused by the next request (idle ones are
            # given back when others need the room: ``admits``) ...
            reusable = _nbytes(e.states_nbytes)
            # ... but the prefix cache may first copy it out, and it saves DeltaNet
            # snapshots at turn starts, as far as its budget lets it grow.
            cache = e.prefix_cache
            room = max(0, cache.budget - _nbytes(cache.nbytes))
            growth = min(room, reusable + SNAPSHOTS * self.need(1, 1).recurrent)
            free = max(0, free + reusable - growth - _SAFETY)
        if self.limit is not None:
            free = self.limit if free is None else min(free, self.limit)
        return free

    def need(self, n_prompt: int, n_total: int) -> Estimate:
        e = self.engine
        return estimate(e.cfg, e.dtype, n_prompt, n_total, e.engine_cfg.prefill_chunk,
                        e.max_context, bool(e.engine_cfg.use_kernels))  # fmt: skip

    def admits(self, n_prompt: int, n_total: int, running: list[tuple[int, int]]) -> bool:
        """Whether a request of ``n_prompt`` prompt tokens growing to ``n_total`` may start
        beside the ``running`` ones (each its (n_prompt, n_total)): what all of them will
        hold at their ends, and one prefill's workspace (prefills run one at a time), within
        ``available`` (what is free and what the working states hold). When that needs the
        memory of idle working states beyond the one the request may take over, they are
        given back (their conversations copied to the prefix cache within its budget)."""
        avail = self.available()
        if avail is None:
            return True
        new = self.need(n_prompt, n_total)
        later = [self.need(p, t) for p, t in running]
        demand = new.total + sum(x.total - x.workspace for x in later)
        if demand > avail:
            return False
        e = self.engine
        free = self._free()
        idle = _nbytes(e.idle_nbytes)
        if free is not None and idle:
            held = _nbytes(e.states_nbytes) - idle  # by the running requests
            still = demand - held - _nbytes(e.largest_idle_nbytes)
            if free - _SAFETY < still:
                e.drop_idle(keep=1)
        return True

    def fit(self, n_prompt: int, n_total: int) -> tuple[int, Estimate, int | None]:
        """The largest total length <= ``n_total`` that fits (``n_prompt`` when even one
        generated token does not), its estimate, and the bytes available."""
        avail = self.available()
        est = self.need(n_prompt, n_total)
        if avail is None or est.total <= avail:
            return n_total, est, avail
        lo, hi = n_prompt, n_total  # need() grows with the total: bisect the largest fit
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.need(n_prompt, mid).total <= avail:
                lo = mid
            else:
                hi = mid - 1
        return lo, self.need(n_prompt, max(lo, n_prompt + 1)), avail


def _nbytes(fn: Callable[[], int]) -> int:
    # Read while the engine thread may be changing the state: an estimate is enough.
    try:
        return int(fn())
    except Exception:  # noqa: BLE001 - a racing dict change; treat as nothing reusable
        return 0


def prompt_limit(ctx: Any) -> int:
    """The most tokens a prompt may have: --max-prompt-tokens, and one less than the
    context window (a token must be left to generate)."""
    cap = ctx.engine.max_context - 1
    return min(cap, ctx.settings.max_prompt_tokens or cap)


def too_long(ctx: Any, e: PromptTooLong, prompt_param: str) -> ApiError:
    """The 400 for a prompt found over ``prompt_limit`` before it was fully tokenized."""
    cap = ctx.settings.max_prompt_tokens
    if cap and e.limit == cap:
        what = f"This server's maximum prompt length is {cap} tokens"
    else:
        what = f"This model's maximum context length is {ctx.engine.max_context} tokens"
    return ApiError(
        400,
        f"{what}. However, your prompt has at least {e.at_least} tokens. Please reduce the "
        f"length of the {prompt_param}.",
        param=prompt_param,
        code="context_length_exceeded",
    )


def check_lengths(ctx: Any, n_prompt: int, max_tokens: int | None, prompt_param: str) -> int | None:
    """The prompt-length, context and memory limits, as 400s naming ``prompt_param`` or
    max_tokens; returns the max_tokens to run with (None: the rest of the context)."""
    engine = ctx.engine
    cap = ctx.settings.max_prompt_tokens
    if cap and n_prompt > cap:
        raise ApiError(
            400,
            f"This server's maximum prompt length is {cap} tokens. However, your prompt has "
            f"{n_prompt} tokens. Please reduce the length of the {prompt_param}.",
            param=prompt_param,
            code="context_length_exceeded",
        )
    try:
        max_new = engine.check_fits(n_prompt, max_tokens)
    except ContextLengthError as e:
        param = prompt_param
        if max_tokens is not None and n_prompt < engine.max_context:
            param = "max_tokens"
        raise ApiError(400, str(e), param=param, code="context_length_exceeded") from None
    except ValueError as e:
        raise bad_request(str(e), "prompt") from None
    if ctx.memory is None:
        return max_tokens
    total, est, avail = ctx.memory.fit(n_prompt, n_prompt + max_new)
    if total == n_prompt + max_new:
        return max_tokens
    if max_tokens is None and total > n_prompt:
        # "The rest of the context" is as much of it as memory holds.
        return total - n_prompt
    mib = 1 << 20
    raise ApiError(
        400,
        f"This request needs about {est.total / mib:.1f} MiB of memory for its KV cache and "
        f"state ({n_prompt} prompt tokens + {max_new} to generate), but only "
        f"{(avail or 0) / mib:.1f} MiB is available to one request. Please reduce the "
        f"length of the {prompt_param if total <= n_prompt else 'completion (max_tokens)'}.",
        param=prompt_param if total <= n_prompt else "max_tokens",
        code="insufficient_memory",
    )
