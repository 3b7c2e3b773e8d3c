"""The full-size fidelity check on the GPU in one process (issue 26).

On the well-conditioned full-size random model (built on the device once), for each
context (default 4K and 32K, pseudo-text ids):

1. the fp32 reference prefills the context once (DeltaNet by chunks); from copies of
   that state:
   - end to end, teacher forcing over ``--positions``: the fp32 reference (the judge), the
     bf16 reference (its own context) and the kernel runner (its own prefill, then
     teacher-forced decode steps): top-1, relative L2, perplexity ratio against fp32;
   - layer-local: a prefill chunk and decode steps, every layer of the bf16 reference
     and of the kernels fed the judge's input and state (per layer and kind);
2. at the first context: the conditioning study (lily/bench/fidelity.py): bf16 against
   fp32 per layer, router margins, residual shares, layers-skipped logits, expert load.

    lily bench --run e2e.fidelity -- --out bench/results/fidelity_h200.json

About 5 minutes on an H200 with the defaults (most of it the fp32 reference over 32K).
"""

from __future__ import annotations

import argparse
import copy
import sys
import time

import torch

from lily.bench import fidelity
from lily.bench.compare import metrics
from lily.bench.consistency import (
    make_paths,
    parse_contexts,
    prefill_context,
    run_layers,
    score_runner,
)
from lily.bench.gpu.full_model import FULL, full_params, kernel_engine, write_json
from lily.bench.layerwise import LayerCheck
from lily.bench.measure import pseudo_text_ids
from lily.runtime.state import SessionState


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@torch.inference_mode()
def run_context(judge, paths, engine, ids: list[int], n: int, args) -> dict:
    """Everything after a context of ``n`` tokens (module docstring, item 1)."""
    cfg, p = FULL, args.positions
    limit = n + max(p, args.chunk + args.decode_steps) + 1
    t0 = time.perf_counter()
    st = SessionState.new(cfg, "cuda", torch.float32, limit)
    prefill_context(judge, st, ids[:n])
    out: dict = {"context": n, "fp32_context_s": time.perf_counter() - t0}
    scored = ids[n : n + p]
    l32 = run_layers(judge, copy.deepcopy(st), scored, logits=True).cpu()
    target = ids[n : n + p + 1]
    bf16 = paths["bf16_reference"]
    s16 = SessionState.new(cfg, "cuda", torch.bfloat16, limit)
    prefill_context(bf16, s16, ids[:n])
    l16 = run_layers(bf16, s16, scored, logits=True).cpu()
    out["bf16_reference_vs_fp32"] = metrics(l16, l32, target)
    _log(f"context {n}: bf16 reference {_short(out['bf16_reference_vs_fp32'])}")
    if engine is not None:
        t1 = time.perf_counter()
        lk = score_runner(engine, ids[: n + p], n)
        out["kernels_vs_fp32"] = metrics(lk, l32, target)
        out["kernels_score_s"] = time.perf_counter() - t1
        _log(f"context {n}: kernels {_short(out['kernels_vs_fp32'])}")
    t2 = time.perf_counter()
    check = LayerCheck(judge, paths, st)
    check.run(ids[n : n + args.chunk], "prefill", logits=False)
    for s in range(args.decode_steps):
        check.run([ids[n + args.chunk + s]], "decode", logits=False)
    out["layer_local"] = check.report()
    out["layer_local_s"] = time.perf_counter() - t2
    for phase, by_path in out["layer_local"].items():
        for name, rep in by_path.items():
            w = rep["worst"]
            _log(f"context {n} {phase} {name}: max rel_out {rep['max_rel_out']:.2e}, worst "
                 f"rel_delta {w['rel_delta']:.2e} (layer {w['layer']} {w['kind']})")  # fmt: skip
    return out


def _short(m: dict) -> str:
    return (f"top-1 {m['top1_agreement_pct']:.2f}%, rel L2 {m['rel_l2']:.3g}, "
            f"ppl ratio {m['perplexity']['ratio']:.5f}")  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--context", default="4K,32K", help="context lengths")
    ap.add_argument("--positions", type=int, default=192, help="teacher-forced positions")
    ap.add_argument("--chunk", type=int, default=256, help="layer-local prefill chunk")
    ap.add_argument("--decode-steps", type=int, default=8, help="layer-local decode steps")
    ap.add_argument("--no-kernels", action="store_true", help="reference paths only")
    ap.add_argument("--no-study", action="store_true", help="skip the conditioning study")
    ap.add_argument("--load-tokens", type=int, default=2048, help="expert-load tokens")
    ap.add_argument("--seed", type=int, default=0, help="pseudo-text ids")
    ap.add_argument("--out", help="JSON output")
    args = ap.parse_args()
    contexts = parse_contexts(args.context)
    t0 = time.perf_counter()
    params = full_params()
    torch.cuda.synchronize()
    _log(f"built the full-size model in {time.perf_counter() - t0:.1f} s")
    judge, paths = make_paths(FULL, params, kernels=not args.no_kernels)
    engine = None if args.no_kernels else kernel_engine(params, max_context=max(contexts) + 4096)
    need = max(contexts) + max(args.positions, args.chunk + args.decode_steps) + 1
    ids = pseudo_text_ids(need, FULL.vocab_size, seed=args.seed)
    runs = []
    for n in contexts:
        runs.append(run_context(judge, paths, engine, ids, n, args))
        write_json(args.out, args, contexts=runs)  # partial results survive a timeout
    study = None
    if not args.no_study:
        _log("conditioning study")
        study = fidelity.study(FULL, params, contexts[0], args.positions, args.seed,
                               load_tokens=args.load_tokens)  # fmt: skip
        print(fidelity.summary(study), file=sys.stderr)
    peak = torch.cuda.max_memory_allocated() / 2**30
    write_json(args.out, args, contexts=runs, study=study, total_s=time.perf_counter() - t0,
               peak_gb=peak)  # fmt: skip
    _log(f"done in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
