"""Concurrent streams against a live server, measured as a user sees them: the official
``openai`` client streaming completions from ``lily serve`` (the server in this process, on
an engine built by the caller; lily/bench/gpu/e2e/concurrency.py is the GPU run). Every
stream's client runs in a process of its own (lily/bench/serve_clients.py), as a user's
agents do: clients parsing chunks here would compete with the server for this process's
GIL and lower what it delivers. The idle and the busy time to first token are both
measured through those processes.

- ``rounds``: for each concurrency c, c streams of distinct prompts started together;
  total decode tok/s over the window in which all c decode (from the last first token to
  the first last token), each stream's share, each stream's time to first token.
- ``busy_ttft``: the time to first token of a new prompt on an idle server (median of a
  few), and while ``busy`` streams decode: its time to first token and the longest gap
  between the running streams' chunks while it was prefilled.

Tokens are counted from the streamed chunks, scaled by each stream's usage (a chunk is a
token except where the detokenizer holds back part of a character); gaps are between
chunks. Prompts are distinct token ids, so no prefix is reused between streams.
"""

from __future__ import annotations

import socket
import statistics
import threading
import time
from typing import Any

from lily.bench.serve_clients import MODEL, Load, Stream

__all__ = ["MODEL", "Load", "Server", "Stream", "bars", "busy_ttft", "gap_trace", "markdown",
           "plot", "rounds", "series"]  # fmt: skip


class Server:
    """``lily serve``'s app on ``engine`` under uvicorn in a thread, on a free local port."""

    def __init__(self, engine, max_running: int, queue_size: int = 64, gc_freeze: bool = True,
                 warmup: bool = True):  # fmt: skip
        import httpx
        import uvicorn

        from lily.server.app import Settings, create_app

        settings = Settings(served_model_names=[MODEL], max_running=max_running,
                            queue_size=queue_size, gc_freeze=gc_freeze,
                            warmup=warmup)  # fmt: skip
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        config = uvicorn.Config(create_app(lambda: engine, settings), host="127.0.0.1",
                                port=port, log_level="warning")  # fmt: skip
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 600
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the server did not become ready")
            time.sleep(0.1)

    def close(self) -> None:
        self._server.should_exit = True
        self._thread.join(60)


def round_result(c: int, streams: list[Stream]) -> dict:
    """Figures of one concurrency round (see the module docstring)."""
    errors = [s.error for s in streams if s.error]
    # A chunk is a token but where the detokenizer holds part of a character back; a
    # stream whose tokens mostly came as no text cannot be timed token by token.
    errors += [
        f"{s.tokens} tokens came in {len(s.chunks)} text chunks: not timeable"
        for s in streams
        if not s.error and s.tokens > 2 * max(len(s.chunks), 1)
    ]
    firsts = [s.chunks[0] for s in streams if s.chunks]
    lasts = [s.chunks[-1] for s in streams if s.chunks]
    out: dict[str, Any] = {"concurrency": c, "errors": errors,
                           "ttft_s": [s.ttft for s in streams],
                           "tokens": [s.tokens for s in streams]}  # fmt: skip
    if len(firsts) < c or errors:
        return out
    t0, t1 = max(firsts), min(lasts)
    if t1 <= t0:  # no moment with every stream decoding: each over its own span
        rates = [s.rate_in(s.chunks[0], s.chunks[-1]) for s in streams]
        t0, t1 = min(firsts), max(lasts)
    else:
        rates = [s.rate_in(t0, t1) for s in streams]
    out |= {
        "window_s": t1 - t0,
        "total_tok_s": sum(rates),
        "per_stream_tok_s": rates,
        "min_stream_tok_s": min(rates),
        "median_stream_tok_s": statistics.median(rates),
        "max_gap_s": max(s.max_gap(t0, t1) for s in streams),
    }
    return out


def rounds(load: Load, concurrency: list[int], prompt: int, max_tokens: int) -> list[dict]:
    """One round per concurrency level (see the module docstring)."""
    out = []
    for c in concurrency:
        streams = load.together([load.prompt(prompt) for _ in range(c)], max_tokens).wait()
        out.append(round_result(c, streams))
    return out


def busy_ttft(load: Load, prompt: int, busy: int, busy_tokens: int, repeats: int,
              engine: Any = None) -> dict:  # fmt: skip
    """A new prompt's time to first token, idle and while ``busy`` streams decode. With the
    server's ``engine``, what it did while the new prompt waited for its first token
    (``gap_trace``: lily/bench/step_trace.py)."""
    from lily.bench.step_trace import StepTrace

    idle = [load.run(load.prompt(prompt), 1).ttft for _ in range(repeats)]
    batch = load.together([load.prompt(prompt) for _ in range(busy)], busy_tokens,
                          stoppable=True)  # fmt: skip
    batch.started(load.timeout)
    time.sleep(0.2)  # all of them decoding for a moment
    trace = StepTrace(engine) if engine is not None else None
    try:
        new = load.run(load.prompt(prompt), 1)
    finally:
        if trace is not None:
            trace.close()
    t_first = new.chunks[0] if new.chunks else time.perf_counter()  # (the clients' clock)
    time.sleep(0.2)
    batch.stop()
    streams = batch.wait()
    errors = [s.error for s in (*streams, new) if s.error]
    med = statistics.median(x for x in idle if x is not None) if all(idle) else None
    return {
        "prompt_tokens": prompt,
        "busy_streams": busy,
        "idle_ttft_s": idle,
        "idle_ttft_median_s": med,
        "busy_ttft_s": new.ttft,
        "ratio": new.ttft / med if med and new.ttft else None,
        # the running streams while the new prompt was prefilled (sent to first token)
        "max_gap_during_prefill_s": max(s.max_gap(new.sent, t_first) for s in streams),
        "busy_rate_during_prefill_tok_s": sum(s.rate_in(new.sent, t_first) for s in streams),
        "errors": errors,
    } | ({"gap_trace": gap_trace(trace, streams, new.sent, t_first)} if trace else {})


def gap_trace(trace, streams: list[Stream], sent: float, first: float) -> dict:
    """The running streams' longest gap between ``sent`` and ``first`` (milliseconds from
    ``sent``) and the engine's recorded work over that whole span."""
    a, b = max((s.longest_gap(sent, first) for s in streams), key=lambda g: g[1] - g[0],
               default=(sent, sent))  # fmt: skip
    return {"gap_start_ms": round(1000 * (a - sent), 3), "gap_ms": round(1000 * (b - a), 3),
            "first_token_ms": round(1000 * (first - sent), 3),
            "events": trace.during(sent, first, origin=sent)}  # fmt: skip


def markdown(result: dict, bars: dict) -> str:
    """The results as Markdown tables, with the issue's bars."""
    lines = ["| streams | total tok/s | x one stream | min stream tok/s | median stream tok/s "
             "| max gap ms | TTFT s (max) |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    one = next((r.get("total_tok_s") for r in result["rounds"] if r["concurrency"] == 1), None)
    for r in result["rounds"]:
        if "total_tok_s" not in r:
            lines.append(f"| {r['concurrency']} | failed: {r['errors'][:1]} |||||")
            continue
        x = f"{r['total_tok_s'] / one:.2f}" if one else "-"
        ttft = max(t for t in r["ttft_s"] if t is not None)
        lines.append(f"| {r['concurrency']} | {r['total_tok_s']:.1f} | {x} | "
                     f"{r['min_stream_tok_s']:.1f} | {r['median_stream_tok_s']:.1f} | "
                     f"{1000 * r['max_gap_s']:.0f} | {ttft:.3f} |")  # fmt: skip
    b = result.get("ttft")
    if b:
        lines += ["", f"A new {b['prompt_tokens']}-token prompt: time to first token "
                  f"{_f(b['idle_ttft_median_s'])} s idle, {_f(b['busy_ttft_s'])} s while "
                  f"{b['busy_streams']} streams decode ({_f(b['ratio'], 2)}x); their longest "
                  f"gap meanwhile {_f(b['max_gap_during_prefill_s'], 0, 1000)} ms, "
                  f"{_f(b['busy_rate_during_prefill_tok_s'], 1)} tok/s in total."]  # fmt: skip
        g = b.get("gap_trace")
        if g:
            lo, hi = g["gap_start_ms"], g["gap_start_ms"] + g["gap_ms"]
            inside = [e for e in g["events"]
                      if e["start_ms"] <= hi and e["start_ms"] + e["ms"] >= lo]  # fmt: skip
            lines += ["", f"The longest gap: {g['gap_ms']:.1f} ms from {lo:.1f} ms after the "
                      f"prompt was sent (first token at {g['first_token_ms']:.1f} ms); the "
                      "engine's work over it:", "", "| what | thread | start ms | ms | CPU ms |",
                      "|---|---|---|---|---|"]  # fmt: skip
            lines += [f"| {e['what']} | {e['thread']} | {e['start_ms']:.1f} | {e['ms']:.1f} | "
                      f"{'-' if e['cpu_ms'] is None else format(e['cpu_ms'], '.1f')} |"
                      for e in inside]  # fmt: skip
    lines += ["", "Bars (issue 22): " + "; ".join(f"{k}: {v}" for k, v in bars.items())]
    return "\n".join(lines) + "\n"


def bars(result: dict) -> dict:
    """The issue's bars, each met (True), missed (False) or not measured (None)."""
    by_c = {r["concurrency"]: r for r in result["rounds"] if "total_tok_s" in r}
    one = by_c.get(1, {}).get("total_tok_s")

    def x(c: int, need: float):
        return by_c[c]["total_tok_s"] >= need * one if one and c in by_c else None

    b = result.get("ttft") or {}
    ratio, gap = b.get("ratio"), b.get("max_gap_during_prefill_s")
    return {
        "4 streams >= 2.0x one": x(4, 2.0),
        "8 streams >= 3.0x one": x(8, 3.0),
        "each of 8 streams >= 250 tok/s": by_c[8]["min_stream_tok_s"] >= 250 if 8 in by_c else None,
        "busy TTFT <= 2x idle": ratio <= 2.0 if ratio is not None else None,
        "no gap > 100 ms meanwhile": gap <= 0.1 if gap is not None else None,
    }


def series(result: dict) -> dict:
    """What ``plot`` draws, from the rounds that ran: the stream counts, total tok/s, the
    slowest and the median stream's tok/s, and one stream's total times the count (every
    stream as fast as one alone; None without a one-stream round)."""
    ran = sorted((r for r in result["rounds"] if "total_tok_s" in r),
                 key=lambda r: r["concurrency"])  # fmt: skip
    c = [r["concurrency"] for r in ran]
    one = next((r["total_tok_s"] for r in ran if r["concurrency"] == 1), None)
    return {
        "streams": c,
        "total": [r["total_tok_s"] for r in ran],
        "min_stream": [r["min_stream_tok_s"] for r in ran],
        "median_stream": [r["median_stream_tok_s"] for r in ran],
        "linear": [one * n for n in c] if one else None,
    }


def plot(result: dict, path: str, gpu: str | None = None) -> bool:
    """Total and per-stream decode tok/s against the stream count, with the issue's bars
    (2.0x one stream at 4, 3.0x at 8, 250 tok/s a stream), as a PNG at ``path``; False
    when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    s = series(result)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    left.plot(s["streams"], s["total"], marker="o", label="total")
    if s["linear"]:
        left.plot(s["streams"], s["linear"], ls=":", color="grey", label="one stream x n")
        one = s["linear"][0] / s["streams"][0]
        left.scatter([4, 8], [2.0 * one, 3.0 * one], marker="_", s=400, color="red",
                     label="bars: 2.0x at 4, 3.0x at 8")  # fmt: skip
    left.set_title("total decode")
    right.plot(s["streams"], s["median_stream"], marker="o", label="median stream")
    right.plot(s["streams"], s["min_stream"], marker="v", label="slowest stream")
    right.axhline(250, color="red", ls="--", label="bar: 250 tok/s each at 8")
    right.set_title("each stream")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(s["streams"], [str(c) for c in s["streams"]])
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel("tokens / s")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    b = result.get("ttft") or {}
    note = (f"; a new {b['prompt_tokens']}-token prompt: TTFT {_f(b.get('idle_ttft_median_s'))} s"
            f" idle, {_f(b.get('busy_ttft_s'))} s beside {b['busy_streams']} streams"
            if b else "")  # fmt: skip
    fig.suptitle(f"lily serve, concurrent streams{' on ' + gpu if gpu else ''}{note}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _f(v, digits: int = 3, scale: float = 1.0) -> str:
    return "-" if v is None else f"{v * scale:.{digits}f}"
