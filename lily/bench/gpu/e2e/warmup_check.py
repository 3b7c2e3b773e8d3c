"""The first request after ``lily serve``'s kernel warm-up against the tenth (issue 19 item
6: on a fresh machine, with an empty Triton cache, the first 4K prompt within 1.5x of the
tenth), and the startup time (build + warm-up).

    lily bench --run e2e.warmup_check -- [--tokens 4096] [--requests 10] [--max-tokens 32]
        [--coverage 20] [--max-running 8] [--cache-dir DIR] [--no-warmup] [--out FILE.json]

TRITON_CACHE_DIR is pointed at a new empty folder (``--cache-dir`` reuses one: a second
start) before Triton is imported. The full-size random model is built on the GPU with
``lily serve``'s defaults and warmed up by the server's own warm-up (lily/runtime/warmup.py).
Then ``--requests`` chat prompts of ``--tokens`` tokens are answered one after another in
this process, as the server would: one system prompt shared (so the prefix cache resumes
the later ones at its end), a different user turn each, the model's default sampling,
``--max-tokens`` generated. Each is timed to its first token and to its last. Then
``--coverage`` prompts of random lengths (1 to 3 chunks, fresh and resumed) look for
kernel variants the warm-up missed: any compiled after it is listed by kernel. Then batches
of 2 to ``--max-running`` such prompts decoded together (``lily serve``'s default 8, which
the warm-up covers): kernel variants compiled there are listed apart. Exit 1 when the
first request took more than 1.5x the tenth, 2 without CUDA.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import sys
import tempfile
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--requests", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--coverage", type=int, default=20)
    ap.add_argument("--max-running", type=int, default=8, help="as lily serve's")
    ap.add_argument("--cache-dir", default=None, help="Triton cache (default: a new empty one)")
    ap.add_argument("--no-warmup", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    # NOTE: before anything imports Triton: its cache folder is read from the environment.
    cache = args.cache_dir or tempfile.mkdtemp(prefix="lily-triton-cache-")
    os.environ["TRITON_CACHE_DIR"] = cache
    fresh = not os.listdir(cache)

    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: this script times kernel compiles on the GPU", file=sys.stderr)
        return 2
    from lily.bench.gpu.e2e.memory_128k import chat_prompt
    from lily.bench.gpu.full_model import FULL, full_params, write_json
    from lily.bench.source import engine_from_params
    from lily.config import EngineConfig
    from lily.runtime.warmup import kernel_variants, sampling_variants, warm_up

    t0 = time.perf_counter()
    # lily serve's defaults (prefill chunk, prefix cache), the context the free memory allows
    ecfg = EngineConfig(device="cuda", dtype="bfloat16", use_kernels=True, max_context=None,
                        max_running=args.max_running)  # fmt: skip
    engine = engine_from_params(FULL, full_params(), ecfg, name="random full")
    torch.cuda.synchronize()
    build_s = time.perf_counter() - t0
    warm = None if args.no_warmup else warm_up(engine)
    ready_s = time.perf_counter() - t0
    print(f"Triton cache {cache} ({'empty' if fresh else 'reused'}): built in {build_s:.1f} s, "
          f"ready after {ready_s:.1f} s", flush=True)  # fmt: skip
    after_warmup = kernel_variants()
    params = sampling_variants(engine.generation_defaults)[-1]  # what a silent request gets
    params = dataclasses.replace(params, max_tokens=args.max_tokens, seed=1, ignore_eos=True)
    rows = []
    for i in range(args.requests):
        ids = chat_prompt(engine, args.tokens, seed=100 + i)
        rows.append(_timed(engine, ids, params))
        print(f"request {i + 1}: first token {rows[-1]['ttft_s']:.3f} s, answered "
              f"{rows[-1]['total_s']:.3f} s, {rows[-1]['cached_tokens']} tokens reused",
              flush=True)  # fmt: skip
    rng = random.Random(0)
    coverage = []
    for _ in range(args.coverage):
        n = rng.randint(2, 3 * ecfg.prefill_chunk)
        ids = chat_prompt(engine, max(n, 48), seed=rng.randint(0, 1 << 30))
        if rng.random() < 0.5:
            engine.reset()  # fresh, not resumed
        coverage.append({"tokens": len(ids), **_timed(engine, ids, params)})
    after = kernel_variants()
    missed = {k: after[k] - after_warmup.get(k, 0) for k in after
              if after[k] > after_warmup.get(k, 0)}  # fmt: skip
    batched = [_together(engine, [chat_prompt(engine, rng.randint(48, 2 * ecfg.prefill_chunk),
                                              seed=rng.randint(0, 1 << 30)) for _ in range(b)],
                         params) for b in range(2, args.max_running + 1)]  # fmt: skip
    after_batched = kernel_variants()
    missed_batched = {k: after_batched[k] - after.get(k, 0) for k in after_batched
                      if after_batched[k] > after.get(k, 0)}  # fmt: skip
    first, tenth = rows[0]["total_s"], rows[-1]["total_s"]
    ok = first <= 1.5 * tenth
    print(f"first {first:.3f} s, last {tenth:.3f} s: ratio {first / tenth:.2f} (bar 1.5): "
          f"{'PASS' if ok else 'FAIL'}", flush=True)  # fmt: skip
    print(
        "kernel variants compiled after the warm-up: "
        + (", ".join(f"{k} +{v}" for k, v in missed.items()) or "none"),
        flush=True,
    )
    print(
        "kernel variants compiled by batched requests after the warm-up: "
        + (", ".join(f"{k} +{v}" for k, v in missed_batched.items()) or "none"),
        flush=True,
    )
    write_json(args.out, args, triton_cache=cache, cache_was_empty=fresh, build_s=build_s,
               ready_s=ready_s, warmup=warm, requests=rows, coverage=coverage,
               variants_missed=missed, batched=batched, variants_missed_batched=missed_batched,
               ratio=first / tenth, passed=ok)  # fmt: skip
    return 0 if ok else 1


def _together(engine, prompts: list[list[int]], params) -> dict:
    """``prompts`` decoded together through the engine's batch (each its own seed): the
    time until every one is answered."""
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.batch.add(ids, dataclasses.replace(params, seed=i))
    with torch.inference_mode():
        while len(engine.batch):
            engine.batch.step()
    return {"rows": len(prompts), "total_s": time.perf_counter() - t0}


def _timed(engine, ids: list[int], params) -> dict:
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    ttft = None
    n = 0
    with torch.inference_mode():
        for step in engine.generate(ids, params):
            if step.token_id is not None:
                n += 1
                if ttft is None:
                    ttft = time.perf_counter() - t0
    return {"ttft_s": ttft, "total_s": time.perf_counter() - t0, "generated": n,
            "cached_tokens": engine.last_usage.cached_tokens}  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
