"""Is the kernel prefill deterministic? Run the same prompt several times on fresh states and
compare an exact checksum of every op's output; the first op whose output differs on
identical inputs is racing. Also reports runs whose logits are not finite. One GPU call.
"""

from __future__ import annotations

import argparse
import json

import torch

from lily.bench.gpu.full_model import FULL, full_params, kernel_engine
from lily.bench.gpu.op_hooks import hook_ops
from lily.bench.measure import pseudo_text_ids


def checksum(t) -> list:
    if isinstance(t, (tuple, list)):
        return [checksum(x) for x in t]
    if not isinstance(t, torch.Tensor):
        return None
    x = t.detach().contiguous()
    bits = x.view(torch.int16) if x.element_size() == 2 else x.view(torch.int32)
    return [int(bits.long().sum()), int((~torch.isfinite(x)).sum()) if x.is_floating_point() else 0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=1651)
    ap.add_argument("--runs", type=int, default=8)
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--out")
    args = ap.parse_args()
    eng = kernel_engine(full_params(), chunk=args.chunk)
    ids = pseudo_text_ids(args.tokens, FULL.vocab_size, seed=3)
    log: list = []

    hook_ops(lambda name, a, out: log.append((name, checksum(list(a)), checksum(out))))
    runs = []
    for r in range(args.runs):  # noqa: B007
        log.clear()
        logits = eng.runner.prefill(ids, eng.new_state())
        runs.append((list(log), int((~torch.isfinite(logits)).sum())))
    base, _ = runs[0]
    report = []
    for r, (lg, bad) in enumerate(runs):
        first = None
        for i, (a, b) in enumerate(zip(base, lg, strict=False)):
            if a != b:
                first = {"call": i, "op": b[0], "inputs_equal": a[1] == b[1],
                         "out_base": a[2], "out_this": b[2]}  # fmt: skip
                break
        report.append({"run": r, "nonfinite_logits": bad, "calls": len(lg), "first_diff": first})
        print(json.dumps(report[-1])[:600], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
