"""Command-line entry points ``lily bench`` and ``lily compare`` (wired into lily/cli.py).

Both add the engine options of ``lily`` itself (``--model``, ``--device``, ``--dtype``,
``--prefill-chunk``, ``--kernels``, ...) unless the parser already has them.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from lily.engine_args import add_engine_args, engine_config


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    if "--device" not in p._option_string_actions:
        add_engine_args(p)


def _source_kw(args: argparse.Namespace) -> dict:
    ecfg = engine_config(args)
    return {
        "device": ecfg.device,
        "dtype": ecfg.dtype,
        "prefill_chunk": ecfg.prefill_chunk,
        "use_kernels": ecfg.use_kernels,
        "max_context": ecfg.max_context,  # None: the largest the free memory allows
        "gpu_arch": ecfg.gpu_arch,
    }


# ---- lily bench


def add_bench_args(p: argparse.ArgumentParser) -> None:
    """Options of ``lily bench``."""
    _add_engine_args(p)
    p.add_argument("--random", choices=["full", "tiny"],
                   help="random weights in the real (full) or test (tiny) shape, built on "
                   "the device (default: full on a GPU, tiny on the CPU); the "
                   "well-conditioned model of docs/notes/fidelity.md")  # fmt: skip
    p.add_argument("--lengths", help="prompt lengths, e.g. 256,1K,32K (default: 256 .. 128K, "
                   "those that fit the model's context)")  # fmt: skip
    p.add_argument("--decode-tokens", type=int, default=128,
                   help="tokens generated one at a time after each prompt")  # fmt: skip
    p.add_argument("--peers", default="mlx-lm,transformers",
                   help="comma-separated: mlx-lm, transformers, lily; 'none' for none")  # fmt: skip
    p.add_argument("--rounds", type=int, default=1, help="rounds over all lengths")
    p.add_argument("--out", default="bench/results", help="folder for JSON, Markdown and PNG")
    p.add_argument("--name", default=None, help="file stem of the outputs (default: derived)")
    p.add_argument("--skew", type=float, nargs="?", const=2.0, default=0.0,
                   help="also time prefill with a skewed router (a few hot experts); value: "
                        "extra row scale of the hot experts (default 2)")  # fmt: skip
    p.add_argument("--budget", type=float, default=450.0,
                   help="seconds for the whole run, setup included; the sweep shares what is "
                        "left among the engines and cuts (and marks) the lengths that would "
                        "not fit (0: no limit)")  # fmt: skip
    p.add_argument("--point-budget", type=float, default=120.0,
                   help="seconds at most for one engine at one length (0: no limit)")  # fmt: skip
    p.add_argument("--disk-load", action="store_true",
                   help="also write the random model to disk and time Engine.load of it "
                        "(always done when mlx-lm runs)")  # fmt: skip
    p.add_argument("--disk-dir", help="where to write that checkpoint (kept; default: a "
                   "temporary folder, removed)")  # fmt: skip
    p.add_argument("--load-tokens", type=int, default=2048,
                   help="prompt tokens of the expert-load histogram")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="weights and prompt ids")
    p.add_argument("--run", metavar="NAME",
                   help="instead of the sweep, run one GPU script of lily.bench.gpu with the "
                        "arguments after --: e.g. kernels (the kernel benchmarks, merged), "
                        "kernels.linear, diagnostics.kernel_profile; 'list' names them "
                        "all")  # fmt: skip
    p.add_argument("script_args", nargs="*", metavar="-- ARGS", help="arguments for --run")


def bench_plan(args: argparse.Namespace):
    """Validate the options into a ``driver.BenchPlan``."""
    from lily.bench.driver import BENCH_LENGTHS, BenchPlan, parse_lengths
    from lily.bench.peers import parse_peers
    from lily.bench.source import dir_source, random_source

    kw = _source_kw(args)
    if args.model and args.random:
        raise ValueError("give either --model or --random, not both")
    if args.model:
        source = dir_source(args.model, **kw)
    else:
        name = args.random or ("full" if kw["device"].startswith("cuda") else "tiny")
        source = random_source(name, seed=args.seed, **kw)
    if args.decode_tokens < 0 or args.rounds < 1:
        raise ValueError("--decode-tokens must be >= 0 and --rounds >= 1")
    if args.budget < 0 or args.point_budget < 0:
        raise ValueError("--budget and --point-budget must be >= 0")
    lengths = parse_lengths(args.lengths)
    if lengths is None:
        ctx = _context_of(source)
        lengths = [n for n in BENCH_LENGTHS if n + args.decode_tokens < ctx] or [
            n for n in (16, 32, 64, 128) if n + args.decode_tokens < ctx
        ]
        if not lengths:
            raise ValueError(f"the model's context ({ctx}) is too short to benchmark")
    peer_names = [] if args.peers.strip().lower() == "none" else parse_peers(args.peers)
    return BenchPlan(
        source=source,
        lengths=lengths,
        decode_tokens=args.decode_tokens,
        peers=peer_names,
        rounds=args.rounds,
        out=Path(args.out),
        skew=args.skew,
        budget_s=args.budget,
        point_budget_s=args.point_budget or math.inf,
        disk_load=args.disk_load,
        disk_dir=args.disk_dir,
        load_tokens=args.load_tokens,
        seed=args.seed,
    )


def _context_of(source: dict) -> int:
    from lily.config import ModelConfig

    if source["kind"] == "dir":
        ctx = ModelConfig.from_dir(source["path"]).max_position_embeddings
    else:
        from lily.bench.random_model import model_config

        ctx = model_config(source["name"]).max_position_embeddings
    return min(ctx, source.get("max_context") or ctx)


def run_bench(args: argparse.Namespace) -> int:
    """``lily bench``: run the sweep and write JSON, Markdown and PNG (or, with ``--run``,
    one GPU script)."""
    if args.run:
        from lily.bench import gpu

        return gpu.run(args.run, args.script_args)
    if args.script_args:
        raise ValueError(f"unexpected arguments {args.script_args} (they belong after --run)")
    from lily.bench import driver, report

    plan = bench_plan(args)
    result = driver.run(plan)
    stem = args.name or _stem(result)
    paths = report.write_outputs(result, plan.out, stem)
    sys.stdout.write(report.markdown(result))
    if "png" not in paths:
        print("(matplotlib is not installed: no PNG; render it elsewhere with "
              f"`python -m lily.bench.report {paths['json']}`)", file=sys.stderr)  # fmt: skip
    print("wrote " + ", ".join(paths.values()), file=sys.stderr)
    return 0


def _stem(result: dict) -> str:
    src = result["config"]["source"]
    what = f"random-{src['name']}" if src["kind"] == "random" else Path(src["path"]).name
    date = result["env"]["date"][:19].replace(":", "").replace("-", "")
    return f"bench-{what}-{src['device'].split(':')[0]}-{date}"


# ---- lily compare


def add_compare_args(p: argparse.ArgumentParser) -> None:
    """Options of ``lily compare``."""
    _add_engine_args(p)
    p.add_argument(
        "--reference",
        choices=["mlx-lm", "transformers", "lily"],
        help="the engine to compare against on the same bytes; 'lily' is our own "
        "plain-PyTorch path in --reference-dtype (checks --kernels on)",
    )
    p.add_argument("--reference-dtype", choices=["float32", "bfloat16"], default=None,
                   help="dtype of the reference (default: float32 for lily, --dtype for "
                        "mlx-lm)")  # fmt: skip
    p.add_argument("--random", choices=["full", "tiny"],
                   help="random weights of that shape built on the device, instead of --model "
                        "(the well-conditioned model; see --init)")  # fmt: skip
    p.add_argument("--init", choices=["conditioned", "plain"], default="conditioned",
                   help="--random: the well-conditioned statistics (default) or the plain "
                        "uniform init (rounding-chaotic at full size)")  # fmt: skip
    p.add_argument(
        "--context",
        default="0",
        help="tokens before the scored positions, e.g. 4K,32K (one run each)",
    )
    p.add_argument("--positions", type=int, default=192, help="teacher-forced positions")
    p.add_argument(
        "--layerwise",
        action="store_true",
        help="layer-local check: every layer of the bf16 reference (and the "
        "kernels) fed the fp32 reference's input and state, per layer and "
        "kind, for a prefill chunk and decode steps after each context",
    )
    p.add_argument("--chunk", type=int, default=256, help="--layerwise: prefill chunk tokens")
    p.add_argument("--decode-steps", type=int, default=8, help="--layerwise: decode steps")
    p.add_argument("--token-loop", action="store_true",
                   help="prefill contexts with the token-by-token DeltaNet (slow; default: "
                        "the same recurrence by chunks)")  # fmt: skip
    p.add_argument("--disk-dir", help="--random with mlx-lm: where to write the checkpoint")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--text", help="text to score (default: deterministic pseudo-text ids)")
    src.add_argument("--text-file", help="file whose text to score")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and pseudo-text ids")
    p.add_argument("--out", help="write the JSON here (default: JSON on stdout, table on "
                   "stderr)")  # fmt: skip


def run_compare(args: argparse.Namespace) -> int:
    """``lily compare``: top-1 agreement, perplexity ratio and logit error vs a reference
    (after each --context), or the layer-local check (--layerwise)."""
    from lily.bench import compare, consistency, measure

    if args.positions < 1:
        raise ValueError(f"--positions must be at least 1, got {args.positions}")
    contexts = consistency.parse_contexts(args.context)
    if args.layerwise:
        return _emit(args, consistency.run_layerwise(args, contexts), consistency.layer_table)
    if args.reference is None:
        raise ValueError("give --reference (or --layerwise)")
    ours = consistency.load_ours(args)
    try:
        ref = consistency.load_reference(args, ours)
    except Exception as e:  # a missing or broken reference: one line, not a traceback
        from lily.bench import peers

        print(f"lily compare: error: reference {args.reference}: {peers.one_line(e)}",
              file=sys.stderr)  # fmt: skip
        return 2
    ids = _compare_ids(args, ours.engine, max(contexts))
    runs = []
    for n in contexts:
        positions = min(args.positions, len(ids) - 1 - n)
        if positions < 1:
            raise ValueError(f"the text is too short for a context of {n}")
        part = ids[: n + positions + 1]
        if len(part) > ours.engine.max_context:
            raise ValueError(f"{len(part)} tokens exceed the context of {ours.engine.max_context}")
        a = ours.score(part, n)[:positions]
        b = ref.score(part, n)[:positions]
        runs.append({"context": n, **compare.metrics(a, b, part[n:])})
    out = {
        "schema": compare.SCHEMA,
        "model": ours.name,
        "reference": args.reference,
        "ids": "text" if (args.text or args.text_file) else f"pseudo-text seed {args.seed}",
        "requested_positions": args.positions,
        **runs[0],
        "contexts": runs,
        "ours": ours.info(),
        "reference_info": ref.info(),
        "original_engine": compare.ORIGINAL,
        "env": measure.env_info(ours.device),
    }
    return _emit(args, out, compare.tables)


def _emit(args: argparse.Namespace, out: dict, table) -> int:
    text = json.dumps(out, indent=1)
    if args.out:
        Path(args.out).write_text(text)
        print(table(out))
    else:
        print(table(out), file=sys.stderr)
        print(text)
    return 0


def _compare_ids(args: argparse.Namespace, engine, context: int = 0) -> list[int]:
    from lily.bench.measure import pseudo_text_ids

    if args.text is None and args.text_file is None:
        return pseudo_text_ids(context + args.positions + 1, engine.cfg.vocab_size, seed=args.seed)
    text = args.text if args.text is not None else Path(args.text_file).read_text()
    ids = engine.tokenizer.encode(text)
    if len(ids) < context + 2:
        raise ValueError(f"the text gives {len(ids)} token(s); at least {context + 2} are needed")
    if len(ids) < context + args.positions + 1:
        print(f"lily compare: the text gives {len(ids)} tokens: comparing "
              f"{len(ids) - 1 - context} positions", file=sys.stderr)  # fmt: skip
    return ids
