"""Concurrent clients on `lily serve` (continuous batching) with the official openai client.

Total and per-stream decode tok/s at 1, 2, 4, 8 streams, a 4K prompt's time to first token
while 7 streams decode against idle, the streams' longest gap meanwhile; JSON, Markdown and
a PNG plot (``--png``; ``--render`` draws the Markdown and the plot again from a JSON, e.g.
where matplotlib is, when the GPU machine has none).

The server runs in this process (uvicorn in a thread; each stream's client in a process of
its own) over the full-size random model on the kernels, with ``lily serve``'s defaults but
``--max-running`` (and the engine's ``--decode-prefill-chunk``); the measurements are
lily/bench/serve_load.py's. One warm-up pass of every round first (kernel compiles,
CUDA-graph captures per batch size), then the measured pass. ``--tiny`` runs the same on
the CPU with the tiny random model (a check of the script, not a measurement).

    lily bench --run e2e.concurrency -- --out bench/results/concurrency_h200.json \\
        --md bench/results/concurrency_h200.md --png bench/results/concurrency_h200.png
    lily bench --run e2e.concurrency -- --render bench/results/concurrency_h200.json \\
        --png bench/results/concurrency_h200.png
"""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    ap.add_argument("--concurrency", default="1,2,4,8", help="stream counts, comma-separated")
    ap.add_argument("--prompt", type=int, default=4096, help="prompt tokens of every stream")
    ap.add_argument("--max-tokens", type=int, default=256, help="tokens each stream generates")
    ap.add_argument("--busy", type=int, default=7, help="streams decoding during the TTFT test")
    ap.add_argument(
        "--busy-tokens",
        type=int,
        default=2048,
        help="max tokens of those streams (enough to outlast the new prefill)",
    )
    ap.add_argument("--repeats", type=int, default=3, help="idle TTFT runs (median)")
    ap.add_argument("--max-running", type=int, default=8)
    ap.add_argument("--decode-prefill-chunk", type=int, default=None)
    ap.add_argument("--prefill-chunk", type=int, default=None)
    ap.add_argument("--max-context", type=int, default=65536)
    ap.add_argument(
        "--sampled",
        action="store_true",
        help="temperature 0.6, top-p 0.95, top-k 20 on the device (default: greedy)",
    )
    ap.add_argument(
        "--no-rows-mma",
        action="store_true",
        help="A/B: the batched step's projections on qgemv/qgemm, not qgemv_mma_rows (ROWS_MMA)",
    )
    ap.add_argument(
        "--rows-moe",
        action="store_true",
        help="A/B: the batched step's MoE on moe_decode_rows (ROWS_MOE)",
    )
    ap.add_argument(
        "--switch-interval",
        type=float,
        default=None,
        help="A/B: sys.setswitchinterval in seconds for this process (server and engine)",
    )
    ap.add_argument(
        "--no-gc-freeze",
        action="store_true",
        help="A/B: the server leaves its start-up heap to the collector (Settings.gc_freeze)",
    )
    ap.add_argument(
        "--gc-ab",
        type=int,
        default=0,
        metavar="N",
        help="A/B in one server: N pairs of the TTFT test with the start-up heap left to the "
        "collector, then frozen (gc_ab in the JSON; the bars take the first frozen one)",
    )
    ap.add_argument("--no-warmup", action="store_true", help="no warm-up pass of the rounds")
    ap.add_argument(
        "--no-server-warmup",
        action="store_true",
        help="the server starts without its kernel warm-up (every tile and bucket: minutes on "
        "an empty Triton cache); the warm-up pass still compiles what the rounds use",
    )
    ap.add_argument("--tiny", action="store_true", help="the tiny random model on the CPU")
    ap.add_argument("--out", help="JSON results")
    ap.add_argument("--md", help="Markdown results")
    ap.add_argument("--png", help="the plot (needs matplotlib)")
    ap.add_argument("--render", metavar="JSON", help="no run: --md and --png from this JSON")
    args = ap.parse_args(argv)
    if args.render:
        return _render(args)

    import torch

    import lily.model.ops as model_ops
    from lily.bench import serve_load
    from lily.bench.random_model import model_config, random_params
    from lily.bench.source import engine_from_params
    from lily.config import EngineConfig

    model_ops.ROWS_MMA = model_ops.ROWS_MMA and not args.no_rows_mma
    model_ops.ROWS_MOE = model_ops.ROWS_MOE or args.rows_moe
    if not args.tiny and not torch.cuda.is_available():
        print("no CUDA device: run with --tiny for a CPU check", file=sys.stderr)
        return 2
    device = "cpu" if args.tiny else "cuda"
    cfg = model_config("tiny" if args.tiny else "full")
    # (max_running: the engine plans memory for the batched steps; the server warms them)
    kw = {"device": device, "max_context": args.max_context, "max_running": args.max_running}
    if not args.tiny:
        kw |= {"dtype": "bfloat16", "use_kernels": True}
    if args.prefill_chunk:
        kw["prefill_chunk"] = args.prefill_chunk
    if args.decode_prefill_chunk:
        kw["decode_prefill_chunk"] = args.decode_prefill_chunk
    dtype = torch.bfloat16 if not args.tiny else torch.float32
    engine = engine_from_params(cfg, random_params(cfg, device, dtype=dtype), EngineConfig(**kw),
                                name="random " + ("tiny" if args.tiny else "full"),
                                text_only=True)  # fmt: skip
    conc = [int(c) for c in args.concurrency.split(",")]
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    freeze = not (args.no_gc_freeze or args.gc_ab)  # (--gc-ab freezes between its runs)
    server = serve_load.Server(engine, args.max_running, gc_freeze=freeze,
                               warmup=not args.no_server_warmup)  # fmt: skip
    try:
        # (the clients: a process each, started once and reused by every pass)
        with serve_load.Load(server.url, cfg.vocab_size, args.sampled) as load:
            passes = [False] if args.no_warmup else [True, False]
            for warm in passes:
                n = min(args.max_tokens, 16) if warm else args.max_tokens
                result = {"rounds": serve_load.rounds(load, conc, args.prompt, n)}
                if not warm:
                    # The rounds on disk before the TTFT test: a run cut by a time limit
                    # keeps the throughput it measured.
                    _write(args, device, result | {"partial": "rounds only (no TTFT yet)"})
                result["ttft"] = serve_load.busy_ttft(
                    load,
                    args.prompt,
                    args.busy,
                    args.busy_tokens,
                    1 if warm else args.repeats,
                    engine=None if warm else engine,
                )
            if args.gc_ab:
                result["gc_ab"] = _gc_ab(args, load, engine, result.pop("ttft"))
                result["ttft"] = next(r for r in result["gc_ab"] if r["frozen"])
    finally:
        server.close()
    result["bars"] = serve_load.bars(result)
    env = _write(args, device, result)
    return _outputs(args, result, env["gpu"])


def _gc_ab(args, load, engine, first: dict) -> list[dict]:
    """``--gc-ab``: the TTFT test with the heap left to the collector (``first``, then
    every other run) and frozen as ``lily serve`` freezes it, alternately."""
    import gc

    from lily.bench import serve_load

    runs = [first | {"frozen": False}]
    for i in range(2 * args.gc_ab - 1):
        frozen = i % 2 == 0
        if frozen:
            gc.collect()
            gc.freeze()
        else:
            gc.unfreeze()
        run = serve_load.busy_ttft(load, args.prompt, args.busy, args.busy_tokens,
                                   args.repeats, engine=engine)  # fmt: skip
        runs.append(run | {"frozen": frozen})
    gc.unfreeze()
    for r in runs:
        passes = [(e["what"], e["ms"]) for e in r["gap_trace"]["events"]
                  if e["what"].startswith("gc")]  # fmt: skip
        print(f"heap {'frozen' if r['frozen'] else 'not frozen'}: longest gap "
              f"{1000 * r['max_gap_during_prefill_s']:.1f} ms, busy TTFT "
              f"{r['busy_ttft_s']:.3f} s, collections in the wait: {passes}")  # fmt: skip
    return runs


def _outputs(args, result: dict, gpu: str | None) -> int:
    """Print the Markdown; write it to --md and the plot to --png where asked."""
    from lily.bench import serve_load

    md = serve_load.markdown(result, serve_load.bars(result))
    print(md)
    if args.md:
        with open(args.md, "w") as f:
            f.write(md)
    if args.png and not serve_load.plot(result, args.png, gpu):
        print(f"(matplotlib is not installed: no PNG; draw it elsewhere with --render "
              f"{args.out or 'the JSON'} --png {args.png})", file=sys.stderr)  # fmt: skip
    return 0


def _render(args) -> int:
    """``--render``: the Markdown and the plot of a JSON this script wrote."""
    try:
        with open(args.render) as f:
            result = json.load(f)
    except (OSError, ValueError) as e:
        print(f"e2e.concurrency: cannot render {args.render}: {e}", file=sys.stderr)
        return 2
    if not isinstance(result, dict) or not isinstance(result.get("rounds"), list):
        print(f"e2e.concurrency: cannot render {args.render}: not this script's JSON (no "
              f"rounds)", file=sys.stderr)  # fmt: skip
        return 2
    return _outputs(args, result, (result.get("env") or {}).get("gpu"))


def _write(args, device: str, result: dict) -> dict:
    """The JSON of ``--out`` (none without it), with the run's environment and arguments;
    returns that environment."""
    from lily.bench.measure import env_info

    env = env_info(device)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"env": env, "args": vars(args), **result}, f, indent=1)
    return env


if __name__ == "__main__":
    sys.exit(main())
