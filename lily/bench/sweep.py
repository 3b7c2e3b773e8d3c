"""The timing loop: one point (a prefill of L tokens, then greedy decode), budgets, rounds.

Every engine, ours or a peer, is driven through the same small interface
(``BenchAdapter``) and timed by ``run_point`` in its own process, so inter-process calls
never fall inside a timed interval. Time is read with ``perf_counter`` after a device
synchronize: the first output token id reaching the host ends the prefill interval, as
in real generation.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lily.bench.measure import sync
from lily.runtime.sampling import SamplingParams

GROWTH = 1.3  # prefill time per token grows with length (attention): margin when predicting


class BenchAdapter:
    """What the sweep needs from an engine; one prompt (session) at a time."""

    name = "engine"

    def prefill(self, ids: list[int]) -> int:
        """Start a new session with ``ids``; return the greedy first output token."""
        raise NotImplementedError

    def decode(self, token: int) -> int:
        """Feed ``token`` to the session; return the next greedy token."""
        raise NotImplementedError

    def decode_timed(self, token: int, n: int, deadline: float) -> tuple[int, float]:
        """Greedy decode after ``token`` (the prefill's output): one untimed step (see
        ``run_point``), then up to ``n`` timed ones, stopping once ``deadline``
        (perf_counter) has passed with at least one timed; returns (timed steps, seconds).
        Here a synchronous step at a time; an engine whose own loop runs ahead of the host
        measures that loop instead."""
        tok = self.decode(token)  # untimed
        t1 = time.perf_counter()
        k = 0
        while k < n and (k == 0 or time.perf_counter() < deadline):
            tok = self.decode(tok)
            k += 1
        return k, time.perf_counter() - t1

    def fill_context(self, n_tokens: int) -> int:
        """Start a new session as if a prompt of ``n_tokens`` had been prefilled, without
        running the prefill (state of the right shapes, arbitrary values); return a token
        to decode from. Lets the sweep time decode at depths whose prefill does not fit the
        time budget; an adapter that does not override it is never filled."""
        raise NotImplementedError

    def score(self, ids: list[int]) -> torch.Tensor:
        """Teacher-forced fp32 logits (T, V) on the CPU."""
        raise NotImplementedError

    def sync(self) -> None:
        """Wait for the device to finish queued work."""

    def release(self) -> None:
        """Drop the session and cached device memory."""

    def reset_peak(self) -> None:
        pass

    def peak_memory(self) -> int | None:
        return None

    def peak_reserved(self) -> int | None:
        """Peak bytes the allocator held from the device (allocated plus cached)."""
        return None

    def info(self) -> dict:
        return {}


class LilyAdapter(BenchAdapter):
    """Our engine through ``engine.runner``: whichever path the engine uses is measured."""

    def __init__(self, engine, name: str = "lily"):
        self.engine = engine
        self.name = name
        self.device = str(engine.model.device)
        self.cuda = torch.device(self.device).type == "cuda"
        self.state = None

    def prefill(self, ids: list[int]) -> int:
        self.state = self.engine.new_state()
        self.state.reserve(len(ids) + 1)  # as the engine does: one growth for the prompt
        self.ids = list(ids)
        self.logits = self.engine.runner.prefill(self.ids, self.state)
        return int(self.logits.argmax())

    def decode(self, token: int) -> int:
        return int(self.engine.runner.decode(token, self.state).argmax())

    def decode_timed(self, token: int, n: int, deadline: float) -> tuple[int, float]:
        """The engine's own decode loop (``decode_loop``), as a streaming client gets it:
        with tokens drawn on the device it launches the step for token i before it waits
        for token i, so the host's turn (the sync, the token's text) overlaps the device's
        work; otherwise one step at a time. Greedy, EOS ignored; token 0 is ``token``
        (drawn from the prefill's logits), token 1's step is the untimed one."""
        from lily.runtime.generate import Usage, decode_loop

        params = SamplingParams(temperature=0.0, max_tokens=n + 2, ignore_eos=True)
        steps = decode_loop(self.engine.runner, self.engine.tokenizer, self.state,
                            self.logits, self.ids, params, n + 2, lambda: False, None,
                            Usage())  # fmt: skip
        try:
            first = next(steps).token_id
            if first != token:
                raise RuntimeError(f"the loop's first token {first} is not the prefill's {token}")
            next(steps)  # untimed: its step may capture a graph
            t1 = time.perf_counter()
            k = 0
            for _ in steps:
                k += 1
                if k >= n or time.perf_counter() >= deadline:
                    break
            return k, time.perf_counter() - t1
        finally:
            steps.close()

    def score(self, ids: list[int]) -> torch.Tensor:
        return self.engine.score(list(ids)).float()

    def sync(self) -> None:
        sync(self.device)

    def release(self) -> None:
        self.state = None
        if self.cuda:
            torch.cuda.empty_cache()

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak_memory(self) -> int | None:
        return torch.cuda.max_memory_allocated(self.device) if self.cuda else None

    def peak_reserved(self) -> int | None:
        return torch.cuda.max_memory_reserved(self.device) if self.cuda else None

    def info(self) -> dict:
        ecfg = self.engine.engine_cfg
        return {
            "device": self.device,
            "dtype": ecfg.dtype,
            "runner": "kernels" if self.engine.model.kernels else "reference ops",
            "use_kernels": ecfg.use_kernels,
            "prefill_chunk": ecfg.prefill_chunk,
            "gpu_arch": ecfg.gpu_arch or "device's own",
        }


def run_point(eng: BenchAdapter, ids: list[int], n_decode: int, allowance_s: float) -> dict:
    """Time a prefill of ``ids`` then up to ``n_decode`` greedy decode steps.

    The first decode step after the prefill is not timed: it is where a new session's
    one-time work lands (CUDA-graph capture for the new buffers, cache growth), so the
    figure is the steady per-token rate. Decode stops early once ``allowance_s`` (counted
    from the prefill start) is spent, with at least one timed step; the result says how
    many were timed.
    """
    eng.reset_peak()
    eng.sync()
    t0 = time.perf_counter()
    tok = eng.prefill(ids)
    t1 = time.perf_counter()
    out = {"length": len(ids), "prefill_s": t1 - t0, "prefill_tok_s": len(ids) / (t1 - t0)}
    out |= _decode(eng, tok, n_decode, t0 + allowance_s)
    out["peak_mem_bytes"] = eng.peak_memory()
    out["peak_reserved_bytes"] = eng.peak_reserved()
    eng.release()
    return out


def run_filled_point(eng: BenchAdapter, length: int, n_decode: int, allowance_s: float) -> dict:
    """Decode as in ``run_point``, at depth ``length`` reached by ``fill_context`` instead
    of a prefill (the allowance counted from the fill's start). The prefill fields are
    None; no peak memory, as the fill's is not a prefill's."""
    eng.sync()
    t0 = time.perf_counter()
    tok = eng.fill_context(length)
    eng.sync()
    out = {"length": length, "prefill_s": None, "prefill_tok_s": None,
           "fill_s": time.perf_counter() - t0}  # fmt: skip
    out |= _decode(eng, tok, n_decode, t0 + allowance_s)
    eng.release()
    return out


def _decode(eng: BenchAdapter, tok: int, n_decode: int, deadline: float) -> dict:
    n, dt = eng.decode_timed(tok, n_decode, deadline) if n_decode else (0, 0.0)
    if not n:
        return {}
    out = {"decode_tokens": n, "decode_s": dt, "decode_tok_s": n / dt}
    if n < n_decode:
        out["decode_cut"] = f"{n} of {n_decode} tokens within the time budget"
    return out


def can_fill(eng: BenchAdapter) -> bool:
    return type(eng).fill_context is not BenchAdapter.fill_context


def warmup(eng: BenchAdapter, ids: list[int], n_decode: int = 2) -> dict:
    """Run the paths once (compilation, autotuning, allocator); the rate seeds predictions."""
    return run_point(eng, ids, n_decode, float("inf"))


class LocalEngine:
    """An adapter in this process, with the call interface of a peer process."""

    def __init__(self, adapter: BenchAdapter):
        self.adapter = adapter
        self.name = adapter.name

    def call(self, method: str, *args, timeout: float | None = None):
        return dispatch(self.adapter, method, args)

    def close(self) -> None:
        self.adapter.release()


def dispatch(adapter: BenchAdapter, method: str, args: tuple):
    if method == "run_point":
        return run_point(adapter, *args)
    if method == "run_filled_point":  # None: this adapter cannot fill its context
        return run_filled_point(adapter, *args) if can_fill(adapter) else None
    if method == "warmup":
        return warmup(adapter, *args)
    if method == "score":
        return adapter.score(*args)
    if method == "info":
        return adapter.info()
    raise ValueError(f"unknown method {method!r}")


@dataclass
class Slot:
    """One engine in the sweep: its handle, what it measures, what it has shown so far."""

    name: str
    handle: object  # LocalEngine or peers.PeerProcess
    decode: bool = True
    peer: bool = False  # ratios are reported against peers
    used_s: float = 0.0
    rate: float | None = None  # last prefill tok/s, for predictions
    last_len: int = 0
    cut_from: int | None = None  # first length whose prefill was skipped this round
    fill: bool = True  # False once the adapter has answered that it cannot fill its context
    failed: str | None = None

    @property
    def live(self) -> bool:
        return self.failed is None and self.cut_from is None


def sweep(
    slots: list[Slot],
    lengths: list[int],
    prompts: Callable[[int], list[int]],
    n_decode: int,
    rounds: int,
    point_budget_s: float = math.inf,
    budget_s: float = math.inf,
    on_point: Callable[[dict], None] = lambda r: None,
) -> list[dict]:
    """All rounds over all lengths, shortest first.

    Engine order rotates at every point so heat and background load hit every engine
    alike. Each round may use its part of ``budget_s`` (what one round leaves passes to
    the next); at each point the time left is split evenly among the engines still to run
    at that length, capped by ``point_budget_s``. A point whose predicted prefill does not
    fit its allowance is cut, and so are that engine's longer ones in the round; an engine
    that can fill its context directly (``run_filled_point``) still has its decode timed
    at those depths. Such an engine no longer counts among those still to run, so the
    others' allowances are what they would be without it; it takes its share at its turn.
    """
    results = []
    start = time.perf_counter()
    for r in range(rounds):
        round_end = start + budget_s * (r + 1) / rounds
        for s in slots:
            s.cut_from = None
        for i, length in enumerate(lengths):
            k = (r + i) % len(slots)
            order = slots[k:] + slots[:k]
            for j, s in enumerate(order):
                waiting = 1 + sum(t.live for t in order[j + 1 :])
                allowance = min(point_budget_s, (round_end - time.perf_counter()) / waiting)
                res = _one(s, length, prompts, n_decode, allowance)
                res |= {"engine": s.name, "round": r, "length": length}
                results.append(res)
                on_point(res)
    return results


def _one(s: Slot, length: int, prompts, n_decode: int, allowance: float) -> dict:
    if s.failed:
        return {"status": "failed", "note": s.failed}
    if s.cut_from is None:
        growth = GROWTH if length > s.last_len else 1.0
        predicted = length / s.rate * growth if s.rate else 0.0
        if predicted <= allowance and allowance > 0:
            res = _call(s, "run_point", prompts(length), n_decode if s.decode else 0, allowance)
            if res["status"] == "ok":
                s.rate, s.last_len = res["prefill_tok_s"], length
            return res
        s.cut_from = length
        left = f"{predicted:.0f} s > {max(allowance, 0):.0f} s left"
        why, cut = f"prefill predicted {left}", f"time budget: predicted prefill {left}"
    else:
        why = f"prefill cut from {s.cut_from} tokens"
        cut = f"time budget (cut from {s.cut_from} tokens)"
    if not (s.fill and s.decode and n_decode and allowance > 0):
        return {"status": "cut", "note": cut}
    res = _call(s, "run_filled_point", length, n_decode, allowance)
    if res is None:  # the adapter cannot fill its context
        s.fill = False
        return {"status": "cut", "note": cut}
    if res["status"] == "ok":
        res["note"] = f"decode after a directly filled cache of {length} tokens ({why})"
    return res


def _call(s: Slot, method: str, *args) -> dict | None:
    """``method`` on the slot's engine, ``args`` ending with the allowance; an engine that
    fails is skipped from here on, never a crash."""
    allowance = args[-1]
    t0 = time.perf_counter()
    try:
        res = s.handle.call(
            method, *args, timeout=2 * allowance + 120 if math.isfinite(allowance) else None
        )
    except Exception as e:
        s.failed = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        s.handle.close()  # frees its memory (a peer's worker is stopped)
        return {"status": "failed", "note": s.failed}
    finally:
        s.used_s += time.perf_counter() - t0
    return res if res is None else {"status": "ok", **res}
