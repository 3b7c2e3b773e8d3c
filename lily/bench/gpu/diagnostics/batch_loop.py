"""The engine's batch loop without the server: where a batched step's wall time goes.

On the full-size random model on the kernels: for each batch size B, B greedy requests of
``--context`` distinct pseudo-text tokens are added to the engine's batch (``Batch``, as
``lily serve``'s worker drives it) and stepped until every one decodes; then ``--steps``
steps are timed by the host's clock. Each step's wall time is split into the time the host
waited for the device's draws (``Runner.recv_rows``) and the rest (the host's own work:
launches, table updates, each row's accept, detokenize and stop checks). The batched
step's CUDA graph replayed alone (CUDA events) gives the device's time for scale (where the
loop's step is longer than the replay, the host or a sync holds the device idle), and one
replay profiled gives its kernels (decode_timeline's exposed time by kind and kernel).

``--profile`` runs the largest B's loop once more under cProfile. ``--gil`` runs the same
loop beside a thread that holds the GIL in pure-Python work for that many microseconds out
of every millisecond, as a server's event loop does while it formats the streams' chunks;
``--switch-interval`` sets ``sys.setswitchinterval`` (the longest a thread holding the GIL
keeps a waiting one out) for the run.

    python3 -m lily.bench.gpu.diagnostics.batch_loop --rows 1,4,8 --out $OUT/loop.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time

import torch

from lily.bench.gpu.diagnostics.decode_timeline import print_timeline, timeline
from lily.bench.gpu.full_model import full_params, kernel_engine, write_json
from lily.bench.measure import pseudo_text_ids, replay_ms
from lily.runtime.sampling import SamplingParams


def busy_thread(us: float, stop: threading.Event) -> threading.Thread:
    """A thread that holds the GIL in Python work ``us`` microseconds a millisecond."""

    def run():
        while not stop.is_set():
            t = time.perf_counter() + us * 1e-6
            while time.perf_counter() < t:
                pass
            time.sleep(max(0.0, 1e-3 - us * 1e-6))

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th


def loop(engine, b: int, context: int, steps: int, seed: int) -> dict:
    """B requests stepped to steady decode, then ``steps`` steps timed (see above)."""
    batch, runner = engine.batch, engine.runner
    params = SamplingParams(temperature=0.0, max_tokens=steps + 64, ignore_eos=True)
    seqs = [batch.add(pseudo_text_ids(context, engine.cfg.vocab_size, seed + i), params)
            for i in range(b)]  # fmt: skip
    while not all(s.decoding for s in seqs):
        batch.step()
    for _ in range(8):  # graphs captured, the pipeline full
        batch.step()
    waits: list[float] = []
    real = runner.recv_rows

    def timed_recv(sent):
        t = time.perf_counter()
        out = real(sent)
        waits.append(time.perf_counter() - t)
        return out

    runner.recv_rows = timed_recv
    walls = []
    emitted = 0
    try:
        if engine.model.device.type == "cuda":
            torch.cuda.synchronize()
        t_all = time.perf_counter()
        for _ in range(steps):
            t = time.perf_counter()
            emitted += sum(1 for _, o in batch.step() if getattr(o, "token_id", None) is not None)
            walls.append(time.perf_counter() - t)
        total = time.perf_counter() - t_all
    finally:
        runner.recv_rows = real
    # (the graph replayed while its states are still the batch's: a replay rewrites the
    # rows' last positions and draws again, harmless to requests ended right after)
    graphs = [v for k, v in runner.graphs.items() if k[0] == "rows" and k[1] == b]
    replay = replay_ms(graphs[-1][0]) if graphs else None
    tl = timeline(graphs[-1][0]) if graphs else None
    for s in seqs:
        batch.abort(s)
    batch.step()  # (drains what is in flight)
    wall = statistics.median(walls) * 1e3
    wait = statistics.median(waits) * 1e3 if len(waits) >= steps // 2 else None
    out = {"rows": b, "context": context, "steps": steps, "tokens": emitted,
           "tok_s": round(emitted / total, 1), "step_wall_ms": round(wall, 4),
           "wait_ms": None if wait is None else round(wait, 4),
           "host_ms": None if wait is None else round(wall - wait, 4),
           "replay_ms": None if replay is None else round(replay, 4), "timeline": tl}  # fmt: skip
    if tl is not None:
        print_timeline(f"B={b} replay {replay:.3f} ms", tl, top=14)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,4,8", help="batch sizes")
    ap.add_argument("--context", type=int, default=4096, help="prompt tokens a request")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--gil", default="0", help="busy-thread microseconds a ms, comma-separated")
    ap.add_argument("--switch-interval", type=float, default=None, help="seconds")
    ap.add_argument(
        "--profile",
        action="store_true",
        help="then the largest B's loop once more under cProfile (top by own time)",
    )
    ap.add_argument("--out")
    args = ap.parse_args()
    rows = [int(b) for b in args.rows.split(",")]
    if min(rows) < 1:
        raise SystemExit("--rows: batch sizes of at least 1")
    engine = kernel_engine(full_params(), max_context=args.context + args.steps + 4096,
                           max_running=max(rows))  # fmt: skip
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    results = []
    for gil in (float(g) for g in args.gil.split(",")):
        stop = threading.Event()
        th = busy_thread(gil, stop) if gil > 0 else None
        try:
            for i, b in enumerate(rows):
                r = loop(engine, b, args.context, args.steps, 100 * i) | {"gil_us": gil}
                results.append(r)
                print(f"gil {gil:.0f} us/ms B={b}: {r['tok_s']:.0f} tok/s, step wall "
                      f"{r['step_wall_ms']:.3f} ms (waited {r['wait_ms']}, host "
                      f"{r['host_ms']}), graph replay {r['replay_ms']} ms", flush=True)  # fmt: skip
        finally:
            stop.set()
            if th is not None:
                th.join()
        write_json(args.out, args, switch_interval=sys.getswitchinterval(), results=results)
    if args.profile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        loop(engine, max(rows), args.context, args.steps, 1000)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
