"""Peak GPU memory of a 128K-token prompt with ``lily serve``'s default settings (issue 25:
at most 22.5 GiB), against the memory plan's per-part estimate.

    lily bench --run e2e.memory_128k -- [--tokens 131072] [--decode 8] [--out FILE.json]
        [--prefill-chunk 2048] [--prefix-cache-gb 1.0] [--max-context N] [--no-warmup]
        [--max-running 8]

The full-size random model (MLX 4-bit layout, 19.5 GB) is built on the GPU and served the
way ``lily serve`` does: bf16, the kernel runner, chunks of 2,048, a 1 GiB prefix cache,
the context chosen from the free memory, up to 8 requests together (the plan holds the
batched steps' buffers, the warm-up captures them), the kernels warmed up. Then one chat-shaped
prompt of ``--tokens`` tokens goes through ``Engine.generate`` (prefix cache on: its
turn-start snapshots are taken) and ``--decode`` tokens are generated. Printed and written
as JSON: ``torch.cuda.max_memory_allocated`` and ``max_memory_reserved`` after the load,
over the warm-up and over the request, the device memory in use (``mem_get_info``), and
the plan's parts for the engine's context and for the capacity the request reached. Exits
1 when the request's peak (allocated or reserved) is above the bar, 2 without CUDA.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

GiB = 1 << 30
BAR = 22.5 * GiB


def _mem() -> dict:
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return {
        "allocated": torch.cuda.memory_allocated(),
        "reserved": torch.cuda.memory_reserved(),
        "max_allocated": torch.cuda.max_memory_allocated(),
        "max_reserved": torch.cuda.max_memory_reserved(),
        "device_used": total - free,
        "device_total": total,
    }


def _gib(d: dict) -> str:
    return ", ".join(f"{k} {v / GiB:.2f}" for k, v in d.items() if isinstance(v, int))


def chat_prompt(engine, n_tokens: int, seed: int = 5) -> list[int]:
    """``n_tokens`` ids shaped as a chat prompt: a system turn, one long user turn of
    pseudo-text and the assistant header (the turn starts are where snapshots go)."""
    from lily.bench.measure import pseudo_text_ids

    tok = engine.tokenizer
    start, end, nl = tok.im_start_id, tok.im_end_id, tok.encode("\n")
    head = [start, *tok.encode("system\nYou are a careful assistant."), end, *nl,
            start, *tok.encode("user\n")]  # fmt: skip
    tail = [end, *nl, start, *tok.encode("assistant\n")]
    n_body = n_tokens - len(head) - len(tail)
    body = [i for i in pseudo_text_ids(2 * n_body, engine.cfg.vocab_size, seed=seed)
            if i not in tok.special_ids][:n_body]  # fmt: skip
    return head + body + tail


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--decode", type=int, default=8)
    ap.add_argument("--prefill-chunk", type=int, default=2048)
    ap.add_argument("--prefix-cache-gb", type=float, default=1.0)
    ap.add_argument("--max-context", type=int, default=None)
    ap.add_argument("--no-warmup", action="store_true")
    ap.add_argument("--max-running", type=int, default=8,
                    help="as lily serve's: the plan holds the batched steps' buffers, the "
                    "warm-up captures them")  # fmt: skip
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: this script measures GPU memory", file=sys.stderr)
        return 2

    from lily.bench.gpu.full_model import FULL, full_params, write_json
    from lily.bench.source import engine_from_params
    from lily.config import EngineConfig
    from lily.runtime.arch_report import architecture_report, format_report
    from lily.runtime.memory_plan import plan
    from lily.runtime.sampling import SamplingParams
    from lily.runtime.warmup import warm_up

    phases = {}
    ecfg = EngineConfig(device="cuda", dtype="bfloat16", use_kernels=True,
                        prefill_chunk=args.prefill_chunk, max_context=args.max_context,
                        prefix_cache_gb=args.prefix_cache_gb,
                        max_running=args.max_running)  # fmt: skip
    engine = engine_from_params(FULL, full_params(), ecfg, name="random full")
    phases["load"] = _mem()
    report = architecture_report(engine)
    print("\n".join(format_report(report)), flush=True)
    warm = None
    if not args.no_warmup:
        torch.cuda.reset_peak_memory_stats()
        warm = warm_up(engine)
        phases["warmup"] = _mem()
    ids = chat_prompt(engine, args.tokens)
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    params = SamplingParams(temperature=0.0, max_tokens=args.decode, ignore_eos=True)
    with torch.inference_mode():
        steps = list(engine.generate(ids, params))
    seconds = time.perf_counter() - t0
    phases["request"] = req = _mem()
    cap = max(c.capacity for c in engine.state.kv.values())
    at_request = plan(FULL, engine.dtype, weights=engine.memory_plan.weights, max_context=cap,
                      chunk=args.prefill_chunk, kernels=True, graphs=True,
                      prefix_cache_bytes=int(args.prefix_cache_gb * GiB),
                      max_running=args.max_running)  # fmt: skip
    for name, m in phases.items():
        print(f"{name}: {_gib(m)} GiB", flush=True)
    print("plan at the request's capacity "
          f"({cap} positions): {_gib(at_request.parts())} GiB", flush=True)  # fmt: skip
    ok_alloc, ok_res = req["max_allocated"] <= BAR, req["max_reserved"] <= BAR
    print(f"peak allocated {req['max_allocated'] / GiB:.2f} GiB, reserved "
          f"{req['max_reserved'] / GiB:.2f} GiB (bar 22.5): allocated "
          f"{'PASS' if ok_alloc else 'FAIL'}, reserved {'PASS' if ok_res else 'FAIL'}")  # fmt: skip
    write_json(args.out, args, arch=report, phases=phases, warmup=warm,
               plan_engine=engine.memory_plan.parts(), plan_request=at_request.parts(),
               request={"prompt_tokens": len(ids), "generated": len(steps), "seconds": seconds,
                        "cached_tokens": engine.last_usage.cached_tokens,
                        "kv_capacity": cap, "state_bytes": engine.state.nbytes(),
                        "prefix_cache_bytes": engine.prefix_cache.nbytes()},
               bar_bytes=BAR, passed={"allocated": ok_alloc, "reserved": ok_res})  # fmt: skip
    return 0 if ok_alloc and ok_res else 1


if __name__ == "__main__":
    sys.exit(main())
