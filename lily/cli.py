"""The ``lily`` command line: generate, chat, score, init, serve, bench, compare."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from lily.engine_args import add_engine_args, load_engine


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--repetition-penalty", type=float, default=None)
    p.add_argument("--presence-penalty", type=float, default=None)
    p.add_argument("--frequency-penalty", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--no-think", action="store_true", help="chat with enable_thinking=false")


def sampling_params(args: argparse.Namespace, defaults: dict):
    from lily.runtime.sampling import SamplingParams

    names = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
             "presence_penalty", "frequency_penalty")  # fmt: skip
    kw = {n: defaults[n] for n in names if n in defaults}
    kw.update({n: getattr(args, n) for n in names if getattr(args, n) is not None})
    return SamplingParams(**kw, seed=args.seed, max_tokens=args.max_tokens, stop=tuple(args.stop))


def _stream(engine, ids: list[int], params, out=sys.stdout) -> str:
    t0 = time.perf_counter()
    t_first = None
    text = []
    n = 0
    for step in engine.generate(ids, params):
        if step.token_id is not None:
            n += 1
            if t_first is None:
                t_first = time.perf_counter()
        if step.text:
            out.write(step.text)
            out.flush()
            text.append(step.text)
    t1 = time.perf_counter()
    pre = (t_first or t1) - t0
    dec = (n - 1) / (t1 - t_first) if t_first and n > 1 and t1 > t_first else 0.0
    print(f"\n[{len(ids)} prompt tokens in {pre:.2f}s ({len(ids) / max(pre, 1e-9):.1f} tok/s); "
          f"{n} generated, {dec:.1f} tok/s]", file=sys.stderr)  # fmt: skip
    return "".join(text)


def cmd_generate(args: argparse.Namespace) -> int:
    engine = load_engine(args)
    params = sampling_params(args, engine.generation_defaults)
    if args.messages:
        messages = json.loads(Path(args.messages).read_text())
    elif args.raw:
        ids = engine.tokenizer.encode(args.prompt or sys.stdin.read())
        _stream(engine, ids, params)
        return 0
    else:
        messages = [{"role": "user", "content": args.prompt or sys.stdin.read()}]
    ids = engine.encode_chat(messages, enable_thinking=not args.no_think)
    _stream(engine, ids, params)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from lily.runtime.chat import chat_loop

    engine = load_engine(args)
    return chat_loop(engine, sampling_params(args, engine.generation_defaults),
                     enable_thinking=not args.no_think)  # fmt: skip


def cmd_score(args: argparse.Namespace) -> int:
    from lily.runtime.score import score_command

    return score_command(load_engine(args), args)


def cmd_init(args: argparse.Namespace) -> int:
    from lily.checkpoint import FULL_TEXT_CONFIG, TINY_TEXT_CONFIG, write_random_checkpoint

    if args.config == "tiny":
        text_cfg = dict(TINY_TEXT_CONFIG)
    elif args.config == "full":
        text_cfg = dict(FULL_TEXT_CONFIG)
    else:
        raw = json.loads(Path(args.config).read_text())
        text_cfg = raw.get("text_config", raw)
    init = args.init or ("plain" if args.layout == "hf" else "conditioned")
    write_random_checkpoint(Path(args.out), text_cfg, args.layout, seed=args.seed, init=init)
    print(f"wrote a random {args.config} checkpoint ({args.layout}, {init} init) to {args.out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="lily", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="generate from a prompt, streamed")
    add_engine_args(g)
    _sampling_args(g)
    g.add_argument("prompt", nargs="?", help="user message (default: read stdin)")
    g.add_argument("--messages", help="JSON file with a list of chat messages")
    g.add_argument("--raw", action="store_true", help="no chat template: continue the text")
    g.set_defaults(fn=cmd_generate)

    c = sub.add_parser("chat", help="interactive multi-turn chat in the terminal")
    add_engine_args(c)
    _sampling_args(c)
    c.set_defaults(fn=cmd_chat)

    s = sub.add_parser("score", help="teacher-forced log-probs and perplexity as JSON")
    add_engine_args(s)
    src = s.add_mutually_exclusive_group(required=True)
    src.add_argument("--text", help="text to score")
    src.add_argument("--text-file", help="file whose text to score")
    src.add_argument("--ids-file", help="file of token ids (JSON list or whitespace separated)")
    s.add_argument("--save-logits", help="write the float32 logits (T, V) as .npy")
    s.add_argument("--out", help="write the JSON here (default: stdout)")
    s.set_defaults(fn=cmd_score)

    i = sub.add_parser("init", help="write a random-weight checkpoint")
    i.add_argument("out", help="output directory")
    i.add_argument("--config", default="tiny", help="tiny, full, or a config.json path")
    i.add_argument("--layout", default="mlx4", choices=["mlx4", "mlx8", "hf"])
    i.add_argument("--seed", type=int, default=0)
    i.add_argument(
        "--init",
        choices=["conditioned", "plain"],
        default=None,
        help="conditioned: the well-conditioned benchmark model (default for the "
        "MLX layouts); plain: every weight ~normal(0, 0.02) (hf's default)",
    )
    i.set_defaults(fn=cmd_init)

    from lily.bench.cli import add_bench_args, add_compare_args, run_bench, run_compare

    v = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_engine_args(v)
    try:
        from lily.server.serve_cli import add_serve_args, run_server
    except ImportError as e:  # the server's web stack is not installed here
        missing = str(e)

        def cmd_serve(args: argparse.Namespace) -> int:
            raise OSError(f"lily serve is unavailable: {missing} (run scripts/install.sh)")
    else:
        add_serve_args(v)

        def cmd_serve(args: argparse.Namespace) -> int:
            return run_server(args, load_engine=lambda: load_engine(args))

    v.set_defaults(fn=cmd_serve)

    b = sub.add_parser("bench", help="prefill and decode sweep, side by side with peers")
    add_bench_args(b)
    b.set_defaults(fn=run_bench)

    m = sub.add_parser("compare", help="teacher-forced consistency against a reference engine")
    add_compare_args(m)
    m.set_defaults(fn=run_compare)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.fn(args) or 0)
    except KeyboardInterrupt:
        return 130
    except (ValueError, OSError) as e:  # config, checkpoint and input errors
        print(f"lily: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
