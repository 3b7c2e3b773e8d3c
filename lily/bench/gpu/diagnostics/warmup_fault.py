"""Which warm-up probe, which op and which launch faults: the warm-up's probes (or a chosen
few) run with a synchronisation after every model op, so an asynchronous fault is pinned to
the op that raised it; then the failing probe is replayed in a fresh process with
CUDA_LAUNCH_BLOCKING=1, whose traceback names the launch.

    lily bench --run diagnostics.warmup_fault -- [--only I,J] [--chunk N] [--no-replay]
        [--out FILE.json]

Issue 19 item 6: the warm-up reported an illegal memory access at "a 4-token chunk at
position 2048" on the H200, with the faulting launch unknown (CUDA reports faults at the
next synchronisation). Exit 0 when every probe ran, 3 when one faulted, 2 without CUDA.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import traceback


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="probe indices to run (default: all)")
    ap.add_argument("--chunk", type=int, default=None, help="prefill chunk (default: serve's)")
    ap.add_argument("--max-context", type=int, default=32768)
    ap.add_argument("--no-replay", action="store_true", help="no CUDA_LAUNCH_BLOCKING replay")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: this script hunts a GPU fault", file=sys.stderr)
        return 2
    from lily.bench.gpu.full_model import FULL, full_params, write_json
    from lily.bench.gpu.op_hooks import hook_ops
    from lily.bench.source import engine_from_params
    from lily.config import EngineConfig
    from lily.runtime import warmup
    from lily.runtime.state import SessionState

    chunk = args.chunk or EngineConfig.prefill_chunk
    ecfg = EngineConfig(device="cuda", dtype="bfloat16", use_kernels=True, prefill_chunk=chunk,
                        max_context=args.max_context, prefix_cache_gb=0.0)  # fmt: skip
    engine = engine_from_params(FULL, full_params(), ecfg, name="random full")
    probes = warmup.prefill_probes(FULL, chunk, engine.max_context)
    chosen = [int(i) for i in args.only.split(",") if i] or list(range(len(probes)))
    print(f"{len(probes)} probes (chunk {chunk}); running {len(chosen)}", flush=True)

    last = {"op": None, "calls": 0}

    def hook(name, a, out) -> None:
        last["calls"] += 1
        last["op"] = name
        torch.cuda.synchronize()

    scratch = SessionState.new(FULL, "cuda", engine.dtype, engine.max_context)
    undo = hook_ops(hook)
    fault = None
    t0 = time.perf_counter()
    try:
        for i in chosen:
            p = probes[i]
            last.update(op=None, calls=0)
            try:
                with torch.inference_mode():
                    warmup.run_probe(engine.runner, scratch, p, FULL.vocab_size, sync=True)
            except Exception as e:
                fault = {"index": i, "probe": str(p),
                         "after_op": last["op"], "op_calls": last["calls"],
                         "error": f"{type(e).__name__}: {e}",
                         "traceback": traceback.format_exc()[-4000:]}  # fmt: skip
                print(f"probe {i} {p}: FAULT after {last['calls']} ops, in or after op "
                      f"{last['op']}: {e}", flush=True)  # fmt: skip
                if args.no_replay:  # the replay itself: its traceback names the launch
                    print(fault["traceback"], flush=True)
                break
            print(f"probe {i} {p}: ok ({last['calls']} ops)", flush=True)
    finally:
        undo()
    replay = None
    if fault and not args.no_replay:
        # the context is dead after a fault: replay the probe (and the one before it, in
        # case it left something behind) in a fresh process, each launch synchronous
        i = fault["index"]
        only = ",".join(str(j) for j in sorted({max(0, i - 1), i}))
        cmd = [sys.executable, "-m", "lily.bench.gpu.diagnostics.warmup_fault", "--only", only,
               "--chunk", str(chunk), "--max-context", str(args.max_context),
               "--no-replay"]  # fmt: skip
        env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1")
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        replay = {"cmd": " ".join(cmd), "rc": r.returncode, "out": r.stdout[-4000:],
                  "err": r.stderr[-6000:]}  # fmt: skip
        print("--- replay with CUDA_LAUNCH_BLOCKING=1 ---\n" + r.stdout[-3000:] + r.stderr[-5000:])
    write_json(args.out, args, probes=len(probes), chunk=chunk, fault=fault, replay=replay,
               seconds=time.perf_counter() - t0)  # fmt: skip
    return 3 if fault else 0


if __name__ == "__main__":
    sys.exit(main())
