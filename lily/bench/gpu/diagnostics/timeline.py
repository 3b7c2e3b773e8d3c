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

import lily.model.ops as model_ops
import lily.runtime.engine as engine_mod
import lily.runtime.runner as runner_mod
import lily.transfer as transfer_mod
from lily.bench.gpu.e2e.multiturn import filler, ttft
from lily.bench.gpu.full_model import full_params, kernel_engine, write_json
from lily.ops.launch import Launched
from lily.runtime.sampling import SamplingParams
from lily.runtime.state import SessionState


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


def host_probe(eng) -> tuple[list, callable]:
    """Record a host timestamp at every Triton launch and at the engine's steps before the
    first launch (no syncs, so the host runs as in a plain turn); returns the list and an
    undo function."""
    marks: list = []
    now = time.perf_counter
    undo = []

    def wrap(obj, name, label):
        orig = getattr(obj, name)
        raw = vars(obj).get(name, orig)  # a staticmethod goes back as one

        def inner(*a, **kw):
            marks.append((now(), label + ">"))
            out = orig(*a, **kw)
            marks.append((now(), label + "<"))
            return out

        # a staticmethod must stay one (an instance's call would pass itself)
        setattr(obj, name, staticmethod(inner) if isinstance(raw, staticmethod) else inner)
        undo.append(lambda: setattr(obj, name, raw))

    launch = Launched.launch

    def probe_launch(self, grid, args, kwargs):
        marks.append((now(), getattr(self.fn, "__name__", "?")))
        launch(self, grid, args, kwargs)

    Launched.launch = probe_launch
    undo.append(lambda: setattr(Launched, "launch", launch))
    wrap(eng.prefix_cache, "acquire", "acquire")
    wrap(eng.runner, "prefill_snapshots", "prefill_snapshots")
    wrap(runner_mod, "to_device", "to_device")
    wrap(model_ops, "embed", "embedding")
    wrap(engine_mod.PrefixCache, "snapshot_points", "snapshot_points")
    wrap(engine_mod.PrefixCache, "resume_point", "resume_point")
    wrap(SessionState, "restore", "restore")
    wrap(transfer_mod.array, "array", "array")
    wrap(torch.Tensor, "pin_memory", "pin_memory")
    return marks, lambda: [u() for u in reversed(undo)]


def host_gaps(marks: list, t0: float, top: int) -> dict:
    """The host's time between consecutive marks (launches and steps), largest first, and
    the marks of the first 2 ms."""
    steps = [(round((b[0] - a[0]) * 1e6, 1), a[1], b[1], round((a[0] - t0) * 1e6))
             for a, b in zip(marks, marks[1:], strict=False)]  # fmt: skip
    return {"marks": len(marks), "first_mark_us": round((marks[0][0] - t0) * 1e6, 1),
            "last_mark_us": round((marks[-1][0] - t0) * 1e6, 1),
            "top_steps_us": sorted(steps, reverse=True)[:top],
            "start": [[round((m[0] - t0) * 1e6, 1), m[1]]
                      for m in marks if m[0] - t0 < 2e-3]}  # fmt: skip


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
        # one more turn with host timestamps at every launch (no profiler, no syncs)
        msgs.append({"role": "assistant", "content": "ok"})
        msgs.append({"role": "user", "content": filler(eng, args.turn_tokens, 99)})
        ids = eng.encode_chat(msgs, enable_thinking=True)
        marks, undo = host_probe(eng)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        host = {"ttft_s": first_token(eng, ids), **host_gaps(marks, t0, args.top)}
        undo()
        print(json.dumps({k: v for k, v in host.items() if k != "start"}, indent=1), flush=True)
        write_json(args.out, args, warmup=rows, timeline=res, host=host)


if __name__ == "__main__":
    main()
