"""GPU check of the server's per-request memory estimate (lily/server/limits.py).

    python tests/server/gpu_memory_check.py --model CKPT [--prompts 1000,8000,32000]
        [--max-tokens 64] [--max-context 65536]

For each prompt length: a fresh state (prefix cache off), one request, and the peak of
``torch.cuda.max_memory_allocated`` above the idle engine, against the estimate the server
would make. The estimate must cover the peak (else a request the guard lets through could
run out of memory) without being far above it (else the guard refuses requests that fit).
Also prints what the guard reports as available and the largest request it would accept.
Prints one JSON line per length and exits 1 if any estimate is below the measured peak.
Not collected by pytest: it needs a GPU and a real checkpoint.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", default="1000,8000,32000")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-context", type=int, default=65536)
    ap.add_argument("--prefill-chunk", type=int, default=2048)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2

    from lily.config import EngineConfig
    from lily.runtime.engine import Engine
    from lily.runtime.sampling import SamplingParams
    from lily.server.limits import MemoryGuard

    ecfg = EngineConfig(device="cuda", dtype="bfloat16", use_kernels=True, prefix_cache_gb=0.0,
                        max_context=args.max_context, prefill_chunk=args.prefill_chunk)  # fmt: skip
    engine = Engine.load(args.model, ecfg)
    guard = MemoryGuard(engine)
    ok = True
    for n in [int(x) for x in args.prompts.split(",")]:
        ids = [(17 * i) % 50000 + 1000 for i in range(n)]
        params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, seed=0)
        engine.reset()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        with torch.inference_mode():
            for _ in engine.generate(ids, params):
                pass
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        est = guard.need(n, n + args.max_tokens)
        avail = guard.available()
        largest = guard.fit(n, engine.max_context)[0]
        row = {
            "prompt": n,
            "seconds": round(time.perf_counter() - t0, 2),
            "peak_mib": round(peak / 2**20, 1),
            "estimate_mib": round(est.total / 2**20, 1),
            "parts_mib": {
                k: round(getattr(est, k) / 2**20, 1)
                for k in ("kv", "kv_growth", "recurrent", "workspace")
            },  # fmt: skip
            "ratio": round(est.total / max(peak, 1), 2),
            "available_mib": None if avail is None else round(avail / 2**20),
            "largest_total_tokens_accepted": largest,
        }
        print(json.dumps(row), flush=True)
        ok &= est.total >= peak
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
