"""Where a reused turn's time to first token goes on the GPU timeline (one GPU call).

An agent-shaped conversation (a long system prompt, about 1.1K new tokens a turn) on the
full-size random model; after a few turns (compiles, caches), one turn is run under
torch.profiler (CUDA activity only, so the host's launch path is barely slowed) and the
kernels' intervals give: the GPU span from the first to the last kernel before the first
token, the busy time inside it, and the largest idle gaps with the kernels around them.
The earlier turns' times to first token (same shape, no profiler) are printed before.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch.profiler import ProfilerActivity, profile

from bench.full_model import full_params, kernel_engine, write_json
from bench.multiturn import filler, ttft
from lily.runtime.sampling import SamplingParams


def first_token(engine, ids: list[int]) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for step in engine.generate(ids, SamplingParams(temperature=0.0, max_tokens=1)):
        if step.token_id is not None:
            return time.perf_counter() - t0
    raise RuntimeError("no token")


def gaps(prof, top: int) -> dict:
    ks = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                if e.device_type == torch.autograd.DeviceType.CUDA)  # fmt: skip
    busy, idle, end = 0.0, [], ks[0][0]
    for i, (s, e, name) in enumerate(ks):
        if s > end:
            idle.append((s - end, ks[i - 1][2][:60], name[:60]))
        busy += max(0.0, e - max(s, end))
        end = max(end, e)
    idle.sort(reverse=True)
    return {"kernels": len(ks), "span_ms": (end - ks[0][0]) / 1e3, "busy_ms": busy / 1e3,
            "idle_ms": sum(g for g, _, _ in idle) / 1e3,
            "idle_over_20us_ms": sum(g for g, _, _ in idle if g > 20) / 1e3,
            "top_gaps_us": [[round(g, 1), a, b] for g, a, b in idle[:top]]}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--system-tokens", type=int, default=6000)
    ap.add_argument("--turn-tokens", type=int, default=1100)
    ap.add_argument("--turns", type=int, default=6, help="turns before the profiled one")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out")
    args = ap.parse_args()
    eng = kernel_engine(full_params(), prefix_cache_gb=2.0)
    list(eng.generate(list(range(10, 4123)), SamplingParams(max_tokens=2)))  # compile
    eng.reset()
    system = "You are a coding agent. Use the tools.\n" + filler(eng, args.system_tokens, 1000)
    msgs = [{"role": "system", "content": system}]
    rows = []
    for turn in range(args.turns + 1):
        msgs.append({"role": "user", "content": filler(eng, args.turn_tokens, turn)})
        ids = eng.encode_chat(msgs, enable_thinking=True)
        if turn < args.turns:
            t, reply, cached = ttft(eng, ids, 8)
            rows.append({"turn": turn + 1, "tokens": len(ids), "cached": cached, "ttft_s": t})
            print(json.dumps(rows[-1]), flush=True)
            msgs.append({"role": "assistant", "content": reply})
            continue
        # the last turn under the profiler (the earlier turns' times are the plain ones)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            profiled = first_token(eng, ids)
            torch.cuda.synchronize()
        res = {"tokens": len(ids), "cached": eng.last_usage.cached_tokens,
               "ttft_profiled_s": profiled, **gaps(prof, args.top)}  # fmt: skip
        print(json.dumps(res, indent=1), flush=True)
        write_json(args.out, args, warmup=rows, timeline=res)


if __name__ == "__main__":
    main()
