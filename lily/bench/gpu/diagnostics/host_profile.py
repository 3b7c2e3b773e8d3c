"""The kernel path's host work for one prefill chunk, on the CPU machine (no GPU).

What the host does between launches (argument checks, views, allocations, launch keys) sets
the pace of a reused turn when it falls behind the GPU
(lily/bench/gpu/diagnostics/timeline.py). This runs ``Model.forward`` on the kernels for
the full model's layer layout and shapes (16 experts instead of 256, which only the kernel
grids see) with every Triton launch replaced by its launch key and argument binding, so the
time is the host's own work less the driver call. Prints the median time per chunk and a
cProfile of one.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch

import lily.ops.launch as launch_mod
from lily.bench.random_model import random_params
from lily.checkpoint import FULL_TEXT_CONFIG, make_config
from lily.config import ModelConfig
from lily.model.model import Model
from lily.runtime.state import SessionState


def stub_launches() -> None:
    """Launched.launch keeps its key and argument binding and skips the driver call."""

    def launch(self, grid, args, kwargs):
        if not hasattr(self, "by_value"):  # set up only where a GPU is seen
            params = self.fn.params
            self.names = [p.name for p in params]
            self.defaults = {p.name: p.default for p in params if p.has_default}
            self.by_value = tuple(p.is_constexpr for p in params)
        key = (0, self._key(args), tuple(sorted(kwargs.items())))
        self.cache.get(key)
        rest = self.names[len(args) :]
        [*args, *(kwargs[n] if n in kwargs else self.defaults[n] for n in rest)]

    launch_mod.Launched.launch = launch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1128)
    ap.add_argument("--context", type=int, default=16000)
    ap.add_argument("--cut", type=int, default=1123, help="snapshot offset (0: none)")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    torch.manual_seed(0)
    cfg = ModelConfig.from_dict(
        make_config({**FULL_TEXT_CONFIG, "num_experts": 16}, "mlx4", torch.bfloat16)
    )
    model = Model(cfg, random_params(cfg, "cpu"), torch.bfloat16, kernels=True)
    stub_launches()
    state = SessionState.new(cfg, "cpu", torch.bfloat16, 65536)
    for c in state.kv.values():
        c.ensure(args.context + args.tokens)
    ids = torch.randint(0, cfg.vocab_size, (args.tokens,))
    cuts = (args.cut,) if args.cut else ()

    def chunk():
        with torch.inference_mode():
            model.forward(ids, state, args.context, args.context + args.tokens, cuts=cuts)

    chunk()
    times = []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        chunk()
        times.append(time.perf_counter() - t0)
    print(f"host per chunk: median {statistics.median(times) * 1e3:.2f} ms, "
          f"min {min(times) * 1e3:.2f} ms ({args.repeat} runs)")  # fmt: skip
    prof = cProfile.Profile()
    prof.enable()
    chunk()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(args.top)
    print(out.getvalue())


if __name__ == "__main__":
    main()
