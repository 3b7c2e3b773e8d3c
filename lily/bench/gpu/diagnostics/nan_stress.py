"""Hunt the rare non-finite logits of the kernel path (full random model, GPU).

Repeats a fresh-state prefill and a few decode steps, with and without CUDA graphs,
optionally on NaN-poisoned free memory (so that a read of uninitialised memory shows up
every time instead of by chance), and records the first op that returned a non-finite
value (ops inside a captured graph are not checked; the graph-free rows localize them).
"""

from __future__ import annotations

import argparse
import json

import torch

from lily.bench.gpu.full_model import full_params, kernel_engine, write_json
from lily.bench.gpu.op_hooks import first_nonfinite, hook_ops


def poison_free_memory(frac: float = 0.6) -> None:
    """Fill most free device memory with NaN bytes and hand it back to the caching
    allocator: later torch.empty calls return NaN-filled blocks."""
    free, _ = torch.cuda.mem_get_info()
    junk = torch.empty(int(free * frac), dtype=torch.uint8, device="cuda").fill_(0xFF)
    del junk


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=4113)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--poison", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args()
    found: list = []
    hook_ops(first_nonfinite(found))
    eng = kernel_engine(full_params())
    ids = list(range(10, 10 + args.tokens))
    rows = []
    for it in range(args.iters):
        for graphs in (True, False):
            eng.runner.use_graphs = graphs
            if args.poison:
                poison_free_memory()
            st = eng.new_state()
            found.clear()
            row = {"iter": it, "graphs": graphs, "bad": []}
            logits = eng.runner.prefill(ids, st)
            for step in range(args.steps + 1):
                if not bool(torch.isfinite(logits).all()):
                    row["bad"].append(step)
                if step == args.steps:
                    break
                tok = int(torch.nan_to_num(logits.float(), nan=-1e9).argmax())
                logits = eng.runner.decode(tok, st)
            if found:
                row["first_nonfinite_op"] = list(found)
            print(json.dumps(row), flush=True)
            rows.append(row)
    write_json(args.out, args, rows=rows)


if __name__ == "__main__":
    main()
