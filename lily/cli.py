"""The ``lily`` command line: generate, chat, score, init, serve, bench, compare."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

# The architectures lily/ops/arch.py has records for (kept here as names: the command line
# must not import torch before it needs to).
GPU_ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90", "sm_120")


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="checkpoint directory (default: the built-in tiny model)")
    p.add_argument("--device", default="auto", help="cpu, cuda or auto (default)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--prefill-chunk", type=int, default=2048, help="tokens per prefill chunk")
    p.add_argument("--max-context", type=int, default=262144)
    p.add_argument("--quantize", action="store_true",
                   help="pack a bf16 Hugging Face checkpoint to MLX 4-bit at load")  # fmt: skip
    p.add_argument("--load-mtp", action="store_true", help="also load the mtp.* weights")
    p.add_argument("--kernels", choices=["auto", "on", "off"], default="auto",
                   help="Triton GPU paths (auto: on when a GPU is used)")  # fmt: skip
    p.add_argument("--prefix-cache-gb", type=float, default=1.0,
                   help="device memory for earlier turns' saved states (0: no reuse)")  # fmt: skip
    p.add_argument("--prefix-cache-host-gb", type=float, default=0.0,
                   help="host memory they spill to when the device budget is full")  # fmt: skip
    p.add_argument("--gpu-arch", default="auto", choices=["auto", *GPU_ARCHS],
                   help="kernel tables and features of this GPU architecture instead of the "
                        "device's own (e.g. sm_89 on an H200: no PDL, no warpgroup MMA, "
                        "small-shared-memory tiles), to measure a fallback")  # fmt: skip


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


def engine_config(args: argparse.Namespace):
    import torch

    from lily.config import EngineConfig

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = args.dtype
    if dtype == "auto":
        dtype = "bfloat16" if device.startswith("cuda") else "float32"
    kernels = args.kernels == "on" or (args.kernels == "auto" and device.startswith("cuda"))
    return EngineConfig(
        device=device,
        dtype=dtype,
        prefill_chunk=args.prefill_chunk,
        max_context=args.max_context,
        load_mtp=args.load_mtp,
        quantize_on_load=args.quantize,
        use_kernels=kernels,
        prefix_cache_gb=getattr(args, "prefix_cache_gb", 1.0),
        prefix_cache_host_gb=getattr(args, "prefix_cache_host_gb", 0.0),
        gpu_arch=None if getattr(args, "gpu_arch", "auto") == "auto" else args.gpu_arch,
    )


def load_engine(args: argparse.Namespace):
    from lily.runtime.engine import Engine

    ecfg = engine_config(args)
    if not args.model:
        msg = ("lily: no --model given: using the built-in tiny random model "
               "(its output is noise; point --model at a real checkpoint)")  # fmt: skip
        print(msg, file=sys.stderr)
        return Engine.tiny(ecfg)
    return Engine.load(args.model, ecfg)


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
    write_random_checkpoint(Path(args.out), text_cfg, args.layout, seed=args.seed)
    print(f"wrote a random {args.config} checkpoint ({args.layout}) to {args.out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="lily", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="generate from a prompt, streamed")
    _engine_args(g)
    _sampling_args(g)
    g.add_argument("prompt", nargs="?", help="user message (default: read stdin)")
    g.add_argument("--messages", help="JSON file with a list of chat messages")
    g.add_argument("--raw", action="store_true", help="no chat template: continue the text")
    g.set_defaults(fn=cmd_generate)

    c = sub.add_parser("chat", help="interactive multi-turn chat in the terminal")
    _engine_args(c)
    _sampling_args(c)
    c.set_defaults(fn=cmd_chat)

    s = sub.add_parser("score", help="teacher-forced log-probs and perplexity as JSON")
    _engine_args(s)
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
    i.set_defaults(fn=cmd_init)

    from lily.bench.cli import add_bench_args, add_compare_args, run_bench, run_compare

    v = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    _engine_args(v)
    try:
        from lily.server.app import add_serve_args, run_server
    except ImportError as e:  # the server's web stack is not installed here
        missing = str(e)

        def run_server(args: argparse.Namespace) -> int:
            raise OSError(f"lily serve is unavailable: {missing} (run scripts/install.sh)")
    else:
        add_serve_args(v)
    v.set_defaults(fn=run_server)

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
