"""The full-size fidelity check on the GPU in one process (issue 26).

On the well-conditioned full-size random model (built on the device once), for each
context (default 4K and 32K, pseudo-text ids):

1. the fp32 reference prefills the context once (DeltaNet by chunks, the reference in
   chunks of ``--context-chunk`` tokens); from copies of that state:
   - end to end, teacher forcing over ``--positions``: the fp32 reference (the judge), the
     bf16 reference (its own context) and the kernel runner (its own prefill, then
     teacher-forced decode steps): top-1, relative L2, perplexity ratio against fp32, and
     the judge's top-1 margins (how near the ties are);
   - layer-local: a prefill chunk and decode steps, every layer of the bf16 reference
     and of the kernels fed the judge's input and state (per layer and kind);
2. at the first context: the conditioning study (lily/bench/fidelity.py): bf16 against
   fp32 per layer, router margins, residual shares, layers-skipped logits, expert load;
3. where MLX-LM is importable (its CUDA build carried as BENCH.md says; ``--mlx on``
   fails without it): the very bytes written as an MLX checkpoint to ``--disk-dir``
   (19.5 GB), MLX-LM (bf16) scored at ``--mlx-context`` against the same fp32 logits.

    lily bench --run e2e.fidelity -- --out bench/results/fidelity_h200.json

About 4-5 minutes on an H200 with the defaults without MLX-LM; MLX-LM adds about 2
minutes at 4K (writing and loading the checkpoint, its prefill at ~230 tok/s) and 2.5 more
at 32K.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time

import torch

from lily.bench import fidelity, peers
from lily.bench.compare import metrics
from lily.bench.consistency import (
    make_paths,
    parse_contexts,
    prefill_context,
    run_layers,
    score_runner,
)
from lily.bench.gpu.full_model import kernel_engine, write_json
from lily.bench.layerwise import LayerCheck
from lily.bench.measure import pseudo_text_ids
from lily.bench.random_model import model_config, random_params, save_mlx_checkpoint, text_config
from lily.runtime.state import SessionState


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@torch.inference_mode()
def run_context(judge, paths, engine, ids: list[int], n: int, args) -> tuple[dict, torch.Tensor]:
    """Everything after a context of ``n`` tokens (module docstring, item 1), and the
    judge's logits (positions, V) on the CPU."""
    cfg, dev, p = judge.cfg, judge.device, args.positions
    limit = n + max(p, args.chunk + args.decode_steps) + 1
    t0 = time.perf_counter()
    st = SessionState.new(cfg, dev, torch.float32, limit)
    prefill_context(judge, st, ids[:n], chunk=args.context_chunk)
    out: dict = {"context": n, "fp32_context_s": time.perf_counter() - t0}
    scored = ids[n : n + p]
    l32 = run_layers(judge, copy.deepcopy(st), scored, logits=True).cpu()
    out["fp32_margins"] = margins(l32)
    _log(f"context {n}: fp32 top-1 margins {out['fp32_margins']}")
    target = ids[n : n + p + 1]
    bf16 = paths["bf16_reference"]
    s16 = SessionState.new(cfg, dev, torch.bfloat16, limit)
    prefill_context(bf16, s16, ids[:n], chunk=args.context_chunk)
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
    return out, l32


def margins(logits: torch.Tensor) -> dict:
    """The top-1 logit's lead over the second per position: how far from a tie (a bf16
    logit between 8 and 16 has an ulp of 0.0625)."""
    top = logits.float().topk(2, -1).values
    m = top[:, 0] - top[:, 1]
    return {"min": m.min().item(), "p1": m.quantile(0.01).item(),
            "p5": m.quantile(0.05).item(), "median": m.median().item(),
            "below_0.0625": int((m < 0.0625).sum()), "top1_mean": top[:, 0].mean().item(),
            "std": logits.float().std(-1).mean().item()}  # fmt: skip


def mlx_reference(args, params: dict):
    """MLX-LM (bf16) over the very bytes, or None where ``--mlx auto`` finds no mlx_lm."""
    if args.mlx == "off":
        return None
    try:
        peers.check_available("mlx-lm", load=True)
    except peers.PeerUnavailable as e:
        if args.mlx == "on":
            raise
        _log(f"{e}: no MLX-LM column")
        return None
    t0 = time.perf_counter()
    cfg = model_config(args.random)
    save_mlx_checkpoint(params, cfg, text_config(args.random), args.disk_dir, progress=False)
    _log(f"wrote the MLX checkpoint to {args.disk_dir} in {time.perf_counter() - t0:.0f} s")
    source = {"kind": "dir", "path": args.disk_dir, "dtype": "bfloat16",
              "device": args.device, "prefill_chunk": 2048}  # fmt: skip
    return peers.load_adapter("mlx-lm", source)


def _short(m: dict) -> str:
    return (f"top-1 {m['top1_agreement_pct']:.2f}%, rel L2 {m['rel_l2']:.3g}, "
            f"ppl ratio {m['perplexity']['ratio']:.5f}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
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
    ap.add_argument("--context-chunk", type=int, default=16384,
                    help="reference prefill chunk of the contexts (tokens)")  # fmt: skip
    ap.add_argument("--mlx", choices=("auto", "on", "off"), default="auto",
                    help="MLX-LM column: where mlx_lm imports, always, never")  # fmt: skip
    ap.add_argument("--mlx-context", default="4K", help="contexts MLX-LM is scored at")
    ap.add_argument("--disk-dir", default="/tmp/lily-fidelity-mlx",
                    help="where the MLX checkpoint is written (19.5 GB)")  # fmt: skip
    ap.add_argument("--out", help="JSON output")
    ap.add_argument("--random", choices=("full", "tiny"), default="full",
                    help="the random model (tiny: a dry run on the CPU)")  # fmt: skip
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a dry run")
    args = ap.parse_args(argv)
    contexts = parse_contexts(args.context)
    mlx_contexts = [n for n in parse_contexts(args.mlx_context) if n in contexts]
    if args.context_chunk < 1:
        ap.error("--context-chunk must be >= 1")
    if args.mlx == "on" and not mlx_contexts:
        ap.error("--mlx on: none of --mlx-context is among --context")
    cuda = args.device.startswith("cuda")
    kernels = cuda and not args.no_kernels
    t0 = time.perf_counter()
    cfg = model_config(args.random)
    params = random_params(cfg, args.device)
    if cuda:
        torch.cuda.synchronize()
    _log(f"built the {args.random} model in {time.perf_counter() - t0:.1f} s")
    judge, paths = make_paths(cfg, params, kernels=kernels)
    engine = kernel_engine(params, max_context=max(contexts) + 4096, cfg=cfg) if kernels else None
    need = max(contexts) + max(args.positions, args.chunk + args.decode_steps) + 1
    ids = pseudo_text_ids(need, cfg.vocab_size, seed=args.seed)
    runs, judged = [], {}
    for n in contexts:
        run, judged[n] = run_context(judge, paths, engine, ids, n, args)
        runs.append(run)
        write_json(args.out, args, contexts=runs)  # partial results survive a timeout
    study = None
    if not args.no_study:
        _log("conditioning study")
        study = fidelity.study(cfg, params, contexts[0], args.positions, args.seed,
                               load_tokens=args.load_tokens)  # fmt: skip
        print(fidelity.summary(study), file=sys.stderr)
        write_json(args.out, args, contexts=runs, study=study)
    mlx = mlx_reference(args, params) if mlx_contexts else None
    for run in runs if mlx is not None else []:
        n, p = run["context"], args.positions
        if n in mlx_contexts:
            t1 = time.perf_counter()
            lm = mlx.score(ids[: n + p], n)
            run["mlx_lm_vs_fp32"] = metrics(lm, judged[n], ids[n : n + p + 1])
            run["mlx_lm_score_s"] = time.perf_counter() - t1
            run["mlx_lm"] = mlx.info()
            _log(f"context {n}: MLX-LM {_short(run['mlx_lm_vs_fp32'])}")
            write_json(args.out, args, contexts=runs, study=study)
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    write_json(args.out, args, contexts=runs, study=study, total_s=time.perf_counter() - t0,
               peak_gb=peak)  # fmt: skip
    _log(f"done in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
