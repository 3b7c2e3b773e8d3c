"""End-to-end timing of the kernel path on the full-size random model (one GPU call).

Prefill tok/s at a few lengths and decode tok/s (CUDA-graph steps) after them, with the
reference ops' numbers at the shortest length beside them. Writes JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from lily.bench.measure import pseudo_text_ids
from lily.bench.random_model import model_config, random_params
from lily.bench.source import engine_from_params
from lily.config import EngineConfig


def timed(fn) -> tuple[object, float]:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def run(engine, lengths: list[int], decode: int) -> list[dict]:
    rows = []
    runner = engine.runner
    for n in lengths:
        print(f"length {n}: warm-up", flush=True)
        ids = pseudo_text_ids(n, engine.cfg.vocab_size, seed=n)
        # Warm-up at this length: Triton compiles per shape outside the timed region.
        warm = engine.new_state()
        runner.prefill(ids[: min(n, 2 * runner.chunk)], warm)
        del warm
        state = engine.new_state()
        for c in state.kv.values():
            c.ensure(n + decode + 8)
        print(f"length {n}: prefill", flush=True)
        logits, t_pre = timed(lambda ids=ids, state=state: runner.prefill(ids, state))
        print(f"length {n}: decode", flush=True)
        tok = int(logits.argmax())
        runner.decode(tok, state)  # first step captures the graph

        def steps(tok=tok, state=state):
            t = tok
            for _ in range(decode):
                t = int(runner.decode(t, state).argmax())
            return t

        _, t_dec = timed(steps)
        row = {
            "length": n,
            "prefill_s": t_pre,
            "prefill_tok_s": n / t_pre,
            "decode_tok_s": decode / t_dec,
            "peak_GiB": torch.cuda.max_memory_allocated() / 2**30,
        }
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="512,4096")
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--out")
    ap.add_argument("--reference", action="store_true")
    args = ap.parse_args()
    cfg = model_config("full")
    params = random_params(cfg, "cuda")
    lengths = [int(x) for x in args.lengths.split(",")]
    res = {}

    def engine(use_kernels: bool):
        ecfg = EngineConfig(
            device="cuda",
            dtype="bfloat16",
            prefill_chunk=args.chunk,
            max_context=131072,
            use_kernels=use_kernels,
            prefix_cache_gb=0,
        )
        return engine_from_params(cfg, params, ecfg)

    eng = engine(True)
    run(eng, [256], 4)  # warm-up: compile the kernels
    res["kernels"] = run(eng, lengths, args.decode)
    if args.reference:
        ref = engine(False)
        res["reference"] = run(ref, lengths[:1], 8)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
