"""Host time of a prefill, measured while the GPU is held busy by a sleep kernel.

With the device asleep the host cannot wait on it, so the time to return from the call is
the pure cost of enqueueing (Python, Triton's launch path, allocations); a call that
returns only after the sleep ends contains a host sync. Also: inclusive host time per
model op (out_norm includes its linear) and a cProfile of one enqueue.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time
from collections import defaultdict

import torch

import lily.model.ops as model_ops
from lily.bench.gpu.full_model import full_params, kernel_engine
from lily.bench.gpu.op_hooks import MODEL_OPS
from lily.bench.measure import env_info, pseudo_text_ids

SLEEP_CYCLES = 3_000_000_000  # about 1.5 s at the H200's clock: longer than any enqueue


def enqueue(fn) -> tuple[float, float]:
    """(seconds to return from fn, seconds until the device finished) with the device
    asleep when fn starts."""
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    t0 = time.perf_counter()
    fn()
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    return host, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=1128)
    ap.add_argument("--cuts", default="2,1123", help="snapshot offsets inside the prompt")
    ap.add_argument("--context", type=int, default=0, help="history before the prompt")
    ap.add_argument("--out")
    args = ap.parse_args()
    eng = kernel_engine(full_params())
    ids = pseudo_text_ids(args.tokens, 1100, seed=1)
    ctx = args.context
    cuts = [ctx + int(c) for c in args.cuts.split(",") if c]
    st = eng.new_state()
    for c in st.kv.values():
        c.ensure(ctx + args.tokens + 8)
    if ctx:
        eng.runner.prefill(pseudo_text_ids(ctx, 1100, seed=2), st)
    snap = st.snapshot_recurrent()

    def run(points):
        st.restore(snap, ctx)
        return eng.runner.prefill_snapshots(ids, st, points)

    out: dict = {"env": env_info("cuda"), "args": vars(args)}
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    torch.cuda._sleep(SLEEP_CYCLES)
    torch.cuda.synchronize()
    out["sleep_s"] = time.perf_counter() - t0
    for name, points in (("plain", []), ("cuts", cuts)):
        for _ in range(2):
            run(points)  # compile and warm up
        rows = [enqueue(lambda p=points: run(p)) for _ in range(3)]
        out[name] = {"host_s": [round(h, 4) for h, _ in rows],
                     "until_done_s": [round(d, 4) for _, d in rows]}  # fmt: skip
    # inclusive host time per model op, device asleep
    spent: dict = defaultdict(float)
    calls: dict = defaultdict(int)
    saved = {n: getattr(model_ops, n) for n in MODEL_OPS}

    def timed(name, fn):
        def wrap(*a, **k):
            t = time.perf_counter()
            r = fn(*a, **k)
            spent[name] += time.perf_counter() - t
            calls[name] += 1
            return r

        return wrap

    for n, fn in saved.items():
        setattr(model_ops, n, timed(n, fn))
    host, _ = enqueue(lambda: run(cuts))
    for n, fn in saved.items():
        setattr(model_ops, n, fn)
    out["per_op_ms"] = {"total": round(host * 1e3, 2), **{
        n: {"ms": round(spent[n] * 1e3, 2), "calls": calls[n]} for n in spent}}  # fmt: skip
    prof = cProfile.Profile()
    enqueue(lambda: prof.runcall(run, cuts))
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(35)
    out["cprofile"] = s.getvalue()
    print(json.dumps({k: v for k, v in out.items() if k not in ("env", "cprofile")}, indent=1))
    print(out["cprofile"][:6000])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
