"""``python -m lily.bench.smoke``: a one-minute pre-flight of the bench on the GPU.

Checks, and times, what ``lily bench --random full`` relies on: the ceilings, building the
full random model on the device (twice: the same seed must give the same bytes, as the
transformers peer rebuilds it in its own process), finite logits through 40 layers on a
prefill and a few decode steps, and the expert load with and without a skewed router.
Prints one line per check and writes JSON with ``--out``; exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from lily.bench import measure
from lily.bench.random_model import (
    fingerprint,
    model_config,
    params_nbytes,
    random_params,
    skewed_params,
)
from lily.bench.source import engine_from_params
from lily.config import EngineConfig


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lily.bench.smoke", description=__doc__)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", default=None, help="full or tiny (default: full on a GPU)")
    ap.add_argument("--tokens", type=int, default=512, help="prefill length")
    ap.add_argument("--kernels", action="store_true", help="EngineConfig.use_kernels")
    ap.add_argument("--out", help="write the JSON here")
    args = ap.parse_args(argv)
    name = args.model or ("full" if args.device.startswith("cuda") else "tiny")
    cuda = args.device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    out: dict = {"env": measure.env_info(args.device), "model": name, "checks": {}}
    ok = True

    def check(label: str, passed: bool, detail: str) -> None:
        nonlocal ok
        ok &= passed
        out["checks"][label] = {"ok": passed, "detail": detail}
        print(f"[{'ok' if passed else 'FAIL'}] {label}: {detail}", flush=True)

    out["ceilings"] = c = measure.measure_ceilings(args.device)
    check("ceilings", c["copy_GBps"] > 0, f"copy {c['copy_GBps']:,.0f} GB/s, "
          f"matmul {c['matmul_TFLOPs']:,.1f} TFLOP/s")  # fmt: skip
    cfg = model_config(name)
    times = []
    prints = []
    for _ in range(2):
        measure.sync(args.device)
        t0 = time.perf_counter()
        params = random_params(cfg, args.device, seed=0, dtype=dtype)
        measure.sync(args.device)
        times.append(time.perf_counter() - t0)
        prints.append(fingerprint(params))
        if len(prints) == 1:
            del params
            if cuda:
                torch.cuda.empty_cache()
    same = prints[0] == prints[1]
    gb = params_nbytes(params) / 1e9
    check("build", same, f"{gb:.2f} GB in {times[0]:.1f} s / {times[1]:.1f} s, same bytes: {same}")
    ecfg = EngineConfig(device=args.device, dtype=str(dtype).removeprefix("torch."),
                        use_kernels=args.kernels)  # fmt: skip
    engine = engine_from_params(cfg, params, ecfg)
    ids = measure.pseudo_text_ids(args.tokens, cfg.vocab_size, seed=1)
    state = engine.new_state()
    measure.sync(args.device)
    t0 = time.perf_counter()
    logits = engine.runner.prefill(ids, state)
    tok = int(logits.argmax())
    t1 = time.perf_counter()
    steps = [logits]
    for _ in range(4):
        steps.append(engine.runner.decode(tok, state))
        tok = int(steps[-1].argmax())
    t2 = time.perf_counter()
    finite = all(bool(s.isfinite().all()) for s in steps)
    spread = float(steps[0].float().std())
    check("forward", finite and spread > 0.01, f"{type(engine.runner).__name__}: prefill "
          f"{args.tokens / (t1 - t0):,.0f} tok/s, decode {4 / (t2 - t1):,.1f} tok/s, logits "
          f"finite {finite}, std {spread:.3f}")  # fmt: skip
    load_ids = measure.pseudo_text_ids(min(2048, args.tokens * 4), cfg.vocab_size, seed=2)
    even = measure.expert_load(engine, load_ids)
    skew_engine = engine_from_params(cfg, skewed_params(params, cfg.num_experts, 2.0), ecfg)
    skewed = measure.expert_load(skew_engine, load_ids)
    top = next(k for k in even if k.endswith("_row_share"))
    out["expert_load"] = {"uniform": even, "skew 2": skewed}
    check("expert load", skewed[top] > even[top], f"max/mean {even['max_over_mean']:.1f} -> "
          f"{skewed['max_over_mean']:.1f} with skew 2; {top} {even[top]:.3f} -> "
          f"{skewed[top]:.3f}; idle {even['idle_expert_fraction']:.2%}")  # fmt: skip
    if cuda:
        out["peak_mem_bytes"] = torch.cuda.max_memory_allocated(args.device)
        print(f"peak GPU memory {out['peak_mem_bytes'] / 1e9:.1f} GB")
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
