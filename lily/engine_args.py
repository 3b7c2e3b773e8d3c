"""Engine options on the command line: the flags every engine-loading command shares, the
EngineConfig they make, and the engine they load. Below the CLI, so ``lily``, ``lily serve``
and ``lily bench`` all take them from here (configuration flows one way)."""

from __future__ import annotations

import argparse
import os
import sys

from lily.config import MAX_RUNNING, EngineConfig
from lily.ops.arch import ARCHS


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine flags (``--model``, ``--device``, ``--dtype``, ``--kernels``, ...)."""
    p.add_argument("--model", help="checkpoint directory (default: the built-in tiny model)")
    p.add_argument("--device", default="auto", help="cpu, cuda or auto (default)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--prefill-chunk", type=int, default=EngineConfig.prefill_chunk,
                   help="tokens per prefill chunk")  # fmt: skip
    p.add_argument("--decode-prefill-chunk", type=int, default=EngineConfig.decode_prefill_chunk,
                   help="prefill tokens per step while other requests decode (their "
                   "streams pause for each chunk)")  # fmt: skip
    p.add_argument("--max-context", type=int, default=None,
                   help="context window in tokens (default: the largest the free memory "
                   "allows beside the weights, at most the model's own)")  # fmt: skip
    p.add_argument("--quantize", action="store_true",
                   help="pack a bf16 Hugging Face checkpoint to MLX 4-bit at load")  # fmt: skip
    p.add_argument("--load-mtp", action="store_true", help="also load the mtp.* weights")
    p.add_argument("--kernels", choices=["auto", "on", "off"], default="auto",
                   help="Triton GPU paths (auto: on when a GPU is used)")  # fmt: skip
    p.add_argument("--prefix-cache-gb", type=float, default=1.0,
                   help="device memory for earlier turns' saved states (0: no reuse)")  # fmt: skip
    p.add_argument("--prefix-cache-host-gb", type=float, default=0.0,
                   help="host memory they spill to when the device budget is full")  # fmt: skip
    p.add_argument("--gpu-arch", default=os.environ.get("LILY_GPU_ARCH") or "auto",
                   choices=["auto", *ARCHS],
                   help="kernel tables and switches of this GPU architecture instead of the "
                   "device's own, to measure a fallback (sm_89 on an H200: no PDL, no "
                   "warpgroup MMA, small-shared-memory tiles); default $LILY_GPU_ARCH or "
                   "auto")  # fmt: skip


def engine_config(args: argparse.Namespace):
    """The EngineConfig of parsed engine flags ("auto" resolved against this machine)."""
    import torch

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = args.dtype
    if dtype == "auto":
        dtype = "bfloat16" if device.startswith("cuda") else "float32"
    kernels = args.kernels == "on" or (args.kernels == "auto" and device.startswith("cuda"))
    if getattr(args, "decode_prefill_chunk", 1) < 1:
        raise ValueError("--decode-prefill-chunk: must be at least 1 token")
    arch = getattr(args, "gpu_arch", "auto")
    if arch != "auto" and arch not in ARCHS:  # from LILY_GPU_ARCH (argparse checked a flag)
        raise ValueError(f"LILY_GPU_ARCH: unknown GPU architecture {arch!r} "
                         f"(known: {', '.join(ARCHS)})")  # fmt: skip
    max_running = getattr(args, "max_running", 1)  # (a flag of lily serve's)
    if not 1 <= max_running <= MAX_RUNNING:
        raise ValueError(f"--max-running: must be between 1 and {MAX_RUNNING} (the requests "
                         f"one batched decode step holds), got {max_running}")  # fmt: skip
    if args.max_context is not None and args.max_context < 2:
        raise ValueError(f"--max-context: must be at least 2 tokens, got {args.max_context}")
    return EngineConfig(
        device=device,
        dtype=dtype,
        prefill_chunk=args.prefill_chunk,
        decode_prefill_chunk=getattr(
            args, "decode_prefill_chunk", EngineConfig.decode_prefill_chunk
        ),  # fmt: skip
        max_context=args.max_context,
        load_mtp=args.load_mtp,
        quantize_on_load=args.quantize,
        use_kernels=kernels,
        prefix_cache_gb=getattr(args, "prefix_cache_gb", 1.0),
        prefix_cache_host_gb=getattr(args, "prefix_cache_host_gb", 0.0),
        gpu_arch=None if arch == "auto" else arch,
        max_running=max_running,
    )


def load_engine(args: argparse.Namespace):
    """The Engine the flags name (the built-in tiny model, with a warning, without
    ``--model``)."""
    from lily.runtime.engine import Engine

    ecfg = engine_config(args)
    if not args.model:
        msg = ("lily: no --model given: using the built-in tiny random model "
               "(its output is noise; point --model at a real checkpoint)")  # fmt: skip
        print(msg, file=sys.stderr)
        return Engine.tiny(ecfg)
    return Engine.load(args.model, ecfg)
