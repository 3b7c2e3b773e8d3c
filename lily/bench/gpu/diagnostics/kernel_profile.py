"""Where the time goes: prefill and decode split by kernel and by layer kind (one GPU call).

On the full-size random model on the kernels:
- prefill of T tokens (several T): wall time, the time only to enqueue the launches (host
  side), and the device time of every kernel (torch.profiler), grouped by layer kind;
- one decode step: graph replay time, and the eager step's kernels grouped the same way;
- optionally (--poison) the allocator is filled with NaN first, so a kernel reading memory
  it never wrote shows up as a non-finite logit (a long-running server reuses dirty memory).
Writes JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from lily.bench.gpu.full_model import full_params, kernel_engine
from lily.bench.gpu.op_hooks import first_nonfinite, hook_ops
from lily.bench.measure import env_info, kernel_times, pseudo_text_ids

# Kernel name fragments -> what they belong to (first match wins).
KINDS = (
    ("moe", "moe"),
    ("deltanet", "deltanet"),
    ("_chunk", "deltanet"),
    ("conv", "deltanet"),
    ("attn", "attention"),
    ("flash", "attention"),
    ("attention", "attention"),
    ("rope", "attention"),
    ("gemv", "projections (GEMV)"),
    ("gemm", "projections (GEMM)"),
    ("norm", "norms"),
)


def kind_of(name: str) -> str:
    low = name.lower()
    for frag, kind in KINDS:
        if frag in low:
            return kind
    return "other (torch)"


def split(times: dict[str, float]) -> dict[str, float]:
    out: dict[str, float] = {}
    for k, v in times.items():
        if k == "error":
            continue
        out[kind_of(k)] = round(out.get(kind_of(k), 0.0) + v, 1)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def top(times: dict[str, float], n: int = 12) -> dict[str, float]:
    items = [(k, v) for k, v in times.items() if k != "error"]
    return dict(sorted(items, key=lambda kv: -kv[1])[:n])


def sync_time(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def profile_prefill(engine, n: int, context: int = 0) -> dict:
    """T = n new tokens; with ``context``, after that many tokens of history (a reused
    multi-turn prompt: the DeltaNet states restored from a snapshot, the KV cache kept)."""
    runner = engine.runner
    ids = pseudo_text_ids(n, engine.cfg.vocab_size, seed=n)
    base = engine.new_state()
    for c in base.kv.values():
        c.ensure(context + n + 8)
    if context:
        runner.prefill(pseudo_text_ids(context, engine.cfg.vocab_size, seed=1), base)
    snap = base.snapshot_recurrent()

    def once():
        base.restore(snap, context)
        return runner.prefill(ids, base)

    once()
    walls = sorted(sync_time(once) for _ in range(3))
    # Host side alone: time to return from the call before the device finishes.
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    once()
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    kt = kernel_times(once, reps=2, key_width=90)
    dev_us = sum(v for k, v in kt.items() if k != "error")
    return {"tokens": n, "context": context, "wall_ms": round(walls[1] * 1e3, 2),
            "tok_s": round(n / walls[1]),
            "host_enqueue_ms": round(host * 1e3, 2), "kernel_sum_ms": round(dev_us / 1e3, 2),
            "by_kind_us": split(kt), "top_kernels_us": top(kt)}  # fmt: skip


def profile_decode(engine, context: int) -> dict:
    runner = engine.runner
    st = engine.new_state()
    for c in st.kv.values():
        c.ensure(context + 64)
    logits = runner.prefill(pseudo_text_ids(context, engine.cfg.vocab_size, 5), st)
    tok = int(logits.argmax())
    runner.decode(tok, st)  # captures the graph

    def steps(k: int) -> None:
        for _ in range(k):
            runner.decode(tok, st)

    steps(4)
    graph_ms = sync_time(lambda: steps(32)) / 32 * 1e3
    # Replay alone, no host work between steps: the device's step time.
    graph, _ = runner._graph(st, st.length)
    torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    ev[0].record()
    for _ in range(32):
        graph.replay()
    ev[1].record()
    torch.cuda.synchronize()
    replay_ms = ev[0].elapsed_time(ev[1]) / 32
    runner.use_graphs = False
    kt = kernel_times(lambda: runner.decode(tok, st), reps=4, key_width=90)
    runner.use_graphs = True
    dev_us = sum(v for k, v in kt.items() if k != "error")
    return {"context": context, "step_ms_with_host": round(graph_ms, 3),
            "replay_only_ms": round(replay_ms, 3), "eager_kernel_sum_ms": round(dev_us / 1e3, 3),
            "by_kind_us": split(kt), "top_kernels_us": top(kt, 16)}  # fmt: skip


def host_profile(engine, n: int, reps: int = 3) -> str:
    """cProfile of the host side of ``reps`` prefills of n tokens: where launch time goes."""
    import cProfile
    import io
    import pstats

    runner = engine.runner
    ids = pseudo_text_ids(n, engine.cfg.vocab_size, seed=n)
    states = [engine.new_state() for _ in range(reps + 1)]
    runner.prefill(ids, states[-1])
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for st in states[:reps]:
        runner.prefill(ids, st)
    prof.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(30)
    return buf.getvalue()


def poison_allocator(frac: float = 0.8) -> None:
    free, _ = torch.cuda.mem_get_info()
    n = int(free * frac) // 2
    x = torch.full((n,), float("nan"), dtype=torch.bfloat16, device="cuda")
    del x  # the caching allocator keeps the block: later torch.empty gets NaN bytes


def locate(eng, ids: list[int]) -> list:
    """Run again on dirty memory with every op checked: the first one to emit a non-finite."""
    found: list = []
    undo = hook_ops(first_nonfinite(found))
    try:
        torch.cuda.empty_cache()
        poison_allocator()
        eng.runner.prefill(ids, eng.new_state())
    finally:
        undo()
    return found


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefill", default="256,1024,1664,4096")
    ap.add_argument("--decode-context", default="256")
    ap.add_argument("--poison", default="12970", help="prompt lengths to run on dirty memory")
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--context", type=int, default=0, help="history before each prefill")
    ap.add_argument("--host", type=int, default=0, help="cProfile the host side at this T")
    ap.add_argument("--out")
    args = ap.parse_args()
    eng = kernel_engine(full_params(), chunk=args.chunk)
    res: dict = {"env": env_info("cuda"), "args": vars(args), "prefill": [], "decode": []}

    def dump() -> None:
        print(json.dumps(res["prefill"][-1:] + res["decode"][-1:])[:3000], flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(res, f, indent=1)

    if args.host:
        res["host_profile"] = host_profile(eng, args.host)
        print(res["host_profile"][:6000], flush=True)
    for n in [int(x) for x in args.prefill.split(",") if x]:
        res["prefill"].append(profile_prefill(eng, n, args.context))
        dump()
    for c in [int(x) for x in args.decode_context.split(",") if x]:
        res["decode"].append(profile_decode(eng, c))
        dump()
    res["poison"] = []
    for n in [int(x) for x in args.poison.split(",") if x]:
        torch.cuda.empty_cache()
        poison_allocator()
        st = eng.new_state()
        ids = pseudo_text_ids(n, eng.cfg.vocab_size, seed=8)
        logits = eng.runner.prefill(ids, st)
        bad = int((~torch.isfinite(logits)).sum())
        nxt = eng.runner.decode(int(torch.nan_to_num(logits).argmax()), st)
        row = {
            "tokens": n,
            "nonfinite_logits": bad,
            "nonfinite_after_decode": int((~torch.isfinite(nxt)).sum()),
        }
        if bad:
            row["first_nonfinite_op"] = locate(eng, ids)
        res["poison"].append(row)
        print(json.dumps(res["poison"][-1]), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
