"""Localize non-finite values in the kernel runner's prefill (full random model, GPU)."""

from __future__ import annotations

import torch

import lily.runtime.gpu_runner as gr
from lily.bench.measure import pseudo_text_ids
from lily.bench.random_model import engine_from_params, model_config, random_params
from lily.config import EngineConfig

found: list = []


def checked(name, fn):
    def wrap(*a, **k):
        out = fn(*a, **k)
        if not found and not bool(torch.isfinite(out).all()):
            x = a[0]
            found.append((name, tuple(x.shape), bool(torch.isfinite(x).all()),
                          float(x.float().abs().max())))  # fmt: skip
        return out

    return wrap


for n in ("moe", "deltanet_prefill", "attention_prefill", "linear", "rms_norm"):
    setattr(gr, n, checked(n, getattr(gr, n)))

cfg = model_config("full")
params = random_params(cfg, "cuda")
eng = engine_from_params(cfg, params, EngineConfig(device="cuda", dtype="bfloat16",
                         prefill_chunk=4096, max_context=40000, use_kernels=True,
                         prefix_cache_gb=0))  # fmt: skip
for n, seed in [(12970, 8), (682, 1), (4778, 2), (12970, 3), (20000, 4)]:
    found.clear()
    st = eng.new_state()
    ids = pseudo_text_ids(n, 1100, seed=seed)  # ids inside the test tokenizer, as in chat
    logits = eng.runner.prefill(ids, st)
    print(n, seed, "finite", bool(torch.isfinite(logits).all()), "first bad op:", found[:1],
          flush=True)  # fmt: skip
