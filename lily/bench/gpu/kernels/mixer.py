"""Check and time the mixer kernels (Gated DeltaNet, gated attention) on one GPU.

Run from the repository root on the GPU machine (about 3-4 minutes, most of it compiling):

    PYTHONUNBUFFERED=1 python -m lily.bench.gpu.kernels.mixer --out $OUT/mixer.json

Order: the two ceilings (device-to-device copy bandwidth, bf16 matmul rate), then at the
model's real shapes each op is checked against the fp32 reference in lily.model.ref on
fresh random inputs and timed (CUDA graphs for the decode ops, so launch gaps are those of
the engine's captured step; ``triton.testing.do_bench`` medians, L2 flushed between runs):
1. DeltaNet decode step, 30 layers' states (60 MiB) per graph: GB/s against the copy rate;
2. attention decode at 256..128K context, 10 layers' caches per graph, plain vs split-KV;
3. DeltaNet prefill, token scan vs chunked, T = 512, 2048, 8192;
4. attention prefill TFLOP/s at a few chunk/context sizes.
A configuration that fails (too many resources, say) becomes a row with its error. Prints
compact tables (again all together at the end); the JSON holds every number.

Without a GPU, ``--compile-only`` compiles the same configurations for sm_90 and prints
registers, spilled stack bytes and shared memory per kernel (seconds, no device time).

This module is the command line, the compile-only path and the report; the sections live in
mixer_deltanet (1, 3) and mixer_attention (2, 4).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from datetime import UTC, datetime

import torch
import triton

from lily.bench.gpu.kernels.common import DEV, ceilings, compile_sm90, cuobjdump
from lily.bench.gpu.kernels.mixer_attention import (
    ATTN_PREFILL_CONFIGS,
    ATTN_SPLIT_SHAPES,
    ATTN_TILE_CONFIGS,
    THETA,
    R,
    attn_args,
    attn_bucket,
    attn_decode,
    attn_inputs,
    attn_prefill,
    attn_split,
)
from lily.bench.gpu.kernels.mixer_deltanet import (
    DN_DECODE_CONFIGS,
    DN_PREFILL_CONFIGS,
    DN_PREFILL_T,
    dn_args,
    dn_decode,
    dn_inputs,
    dn_prefill,
)
from lily.ops.attention_decode import attention_decode
from lily.ops.attention_prefill import attention_prefill
from lily.ops.deltanet_decode import deltanet_decode
from lily.ops.deltanet_prefill import deltanet_prefill
from lily.ops.norm_rope import rope_inv_freq

# ----------------------------------------------------------------------------- compile


def compile_report() -> list[dict]:
    """Compile every timed configuration for sm_90 on this machine (no GPU needed) and read
    what ptxas gave each kernel: registers, stack bytes (spills) and shared memory.

    The public functions run on CPU tensors of the real shapes with kernel launches
    intercepted, so the kernels see exactly the arguments their launchers pass.
    """
    import re
    import tempfile

    from triton.runtime.jit import JITFunction

    launches = []
    launch = JITFunction.__getitem__
    JITFunction.__getitem__ = lambda fn, grid: lambda *a, **kw: launches.append((fn, a, kw))
    try:
        gen = torch.Generator().manual_seed(0)
        d = dn_inputs(1, gen)
        for block_v, warps in DN_DECODE_CONFIGS:
            launches.append(f"block_v={block_v} warps={warps}")
            deltanet_decode(*dn_args(d, 0), block_v=block_v, num_warps=warps)
        d = dn_inputs(512, gen)
        for method, block_v in DN_PREFILL_CONFIGS:
            launches.append(f"{method} block_v={block_v}")
            deltanet_prefill(*dn_args(d), method=method, block_v=block_v)
        inv_freq = rope_inv_freq(R, THETA)
        d = attn_inputs(1, 4096, gen, 4095)
        for split in (0, 256):
            launches.append(f"split={split}")
            attention_decode(*attn_args(d, 0), torch.tensor([4095]), inv_freq, split=split)
        d = attn_inputs(512, 512, gen, 0)
        for bm, bn, warps in ATTN_PREFILL_CONFIGS:
            launches.append(f"block_m={bm} block_n={bn} warps={warps}")
            attention_prefill(*attn_args(d), 0, inv_freq, block_m=bm, block_n=bn, num_warps=warps)
    finally:
        JITFunction.__getitem__ = launch

    rows, seen, label = [], set(), ""
    for item in launches:
        if isinstance(item, str):
            label = item
            continue
        fn, args, kw = item
        const = {k: v for k, v in kw.items() if k in fn.arg_names}
        opts = {"num_warps": kw.get("num_warps", 4), "num_stages": kw.get("num_stages", 3)}
        key = (fn.__name__, tuple(sorted(const.items())), tuple(opts.values()))
        if key in seen:
            continue
        seen.add(key)
        row = {"kernel": fn.__name__, "config": label, **opts}
        try:
            k = compile_sm90(fn, args, const, opts, aligned_tensors=False)
            with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                f.write(k.asm["cubin"])
                f.flush()
                res = subprocess.run([cuobjdump(), "-res-usage", f.name], text=True,
                                     capture_output=True).stdout  # fmt: skip
            m = re.search(r"REG:(\d+) STACK:(\d+)", res)
            ptx = k.asm["ptx"]
            row.update(regs=int(m[1]), stack=int(m[2]), smem=k.metadata.shared,
                       wgmma=ptx.count("wgmma.mma_async"), mma=ptx.count("mma.sync"))  # fmt: skip
        except Exception as e:  # noqa: BLE001 - a config that does not compile is data
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------- report


def table(rows: list[dict], keys: list[str]) -> str:
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1e4 else f"{v:.0f}"
        return str(v)

    lines = [" ".join(f"{k:>12}" for k in keys)]
    for r in rows:
        cells = [f"{fmt(r.get(k, '')):>12}" for k in keys]
        lines.append(" ".join(cells) + (f"  {r['error'][:60]}" if "error" in r else ""))
    return "\n".join(lines)


def crossover(rows: list[dict]) -> str:
    """The shortest context from which the best split-KV row beats the plain one."""
    best: dict[int, dict[bool, float]] = {}
    for r in rows:
        if "us_per_layer" in r:
            cur = best.setdefault(r["ctx"], {})
            key = r["split"] > 0
            cur[key] = min(cur.get(key, float("inf")), r["us_per_layer"])
    wins = [c for c, v in sorted(best.items()) if v.get(True, 1e9) < v.get(False, 1e9)]
    return f"split-KV faster from ctx {wins[0]}" if wins else "split-KV never faster"


SECTIONS = {
    "dn_decode": ["block_v", "num_warps", "us_per_layer", "GBps", "frac_copy", "rel_err"],
    "attn_decode": ["ctx", "split", "us_per_layer", "GBps", "frac_copy", "rel_err"],
    "attn_bucket": ["ctx", "max_len", "split", "default", "us_per_layer", "frac_copy",
                    "rel_err", "kernels_us"],
    "dn_prefill": ["T", "method", "block_v", "ms", "ms_eager", "ms_30_layers", "rel_err"],
    "attn_prefill": ["T", "start", "block_m", "block_n", "num_warps", "ms", "ms_eager", "TFLOPs",
                     "rel_err"],
    "attn_split": ["T", "start", "block_m", "split", "picked", "ms", "TFLOPs", "rel_err"],
    "attn_tiles": ["block_m", "block_n", "num_warps", "num_stages", "split", "picked", "ms",
                   "TFLOPs", "rel_err"],
    "attn_tiles_all": ["T", "start", "block_m", "block_n", "num_warps", "split", "picked", "ms",
                       "TFLOPs", "rel_err"],
}  # fmt: skip


def breakdowns(rows: list[dict]) -> str:
    """One line per row that carries a per-kernel breakdown: the us of its kernels."""
    lines = []
    for r in rows:
        ks = r.get("kernels_us")
        if ks:
            head = " ".join(f"{k}={r[k]}" for k in ("T", "ctx", "split", "method", "block_v",
                                                     "block_m", "block_n") if k in r)  # fmt: skip
            parts = ", ".join(f"{k.split('(')[0][:28]} {v:.1f}" for k, v in ks.items())
            lines.append(f"  {head}: {parts}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="mixer_kernels.json", help="JSON results path")
    ap.add_argument("--only", default=",".join(SECTIONS), help="comma-separated sections")
    ap.add_argument(
        "--compile-only",
        action="store_true",
        help="no GPU: compile for sm_90 and report registers, spills, shared memory",
    )
    ap.add_argument("--dn-t", default=",".join(map(str, DN_PREFILL_T)), help="dn_prefill T")
    args = ap.parse_args()
    dn_t = tuple(int(x) for x in args.dn_t.split(","))
    if args.compile_only:
        keys = ["kernel", "config", "num_warps", "num_stages", "regs", "stack", "smem", "wgmma",
                "mma"]  # fmt: skip
        print(table(compile_report(), keys))
        return
    names = args.only.split(",")
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        sys.exit(f"gpu_mixer_kernels: unknown section(s) {unknown}; choose from {list(SECTIONS)}")
    if not torch.cuda.is_available():
        sys.exit("gpu_mixer_kernels: needs a CUDA GPU")
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True)
        commit = commit.stdout.strip() or "unknown"
    except OSError:
        commit = "unknown"
    t0 = time.time()
    gen = torch.Generator(device=DEV).manual_seed(0)
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": triton.__version__, "commit": commit,
           "date": datetime.now(UTC).isoformat(timespec="seconds")}  # fmt: skip
    res["ceilings"] = ceil = ceilings(read=False)
    head = (
        f"copy {ceil['copy_GBps']:.0f} GB/s, bf16 matmul {ceil['bf16_matmul_TFLOPs']:.0f} TFLOP/s"
    )
    print(head, flush=True)
    run = {
        "dn_decode": lambda: dn_decode(gen, ceil["copy_GBps"]),
        "attn_decode": lambda: attn_decode(gen, ceil["copy_GBps"]),
        "attn_bucket": lambda: attn_bucket(gen, ceil["copy_GBps"]),
        "dn_prefill": lambda: dn_prefill(gen, dn_t),
        "attn_prefill": lambda: attn_prefill(gen, ceil["bf16_matmul_TFLOPs"]),
        "attn_split": lambda: attn_split(gen, ceil["bf16_matmul_TFLOPs"]),
        # the reused turn's shape only, more tiles and pipeline depths
        "attn_tiles": lambda: attn_split(
            gen, ceil["bf16_matmul_TFLOPs"], ((1128, 16080),), ATTN_TILE_CONFIGS, (1, 4, 8)
        ),
        # the table's tile against 128 x 64 (8 warps) on every split shape, at the rule's S
        "attn_tiles_all": lambda: attn_split(
            gen, ceil["bf16_matmul_TFLOPs"], ATTN_SPLIT_SHAPES, ATTN_TILE_CONFIGS[::5], (1,)
        ),
    }
    tables = [head]
    for name in names:
        ts = time.time()
        res[name] = rows = run[name]()
        tables.append(f"== {name} ({time.time() - ts:.0f} s)\n{table(rows, SECTIONS[name])}")
        if name == "attn_decode":
            res["attn_decode_crossover"] = crossover(rows)
            tables[-1] += "\n" + res["attn_decode_crossover"]
        print(tables[-1], flush=True)
        if any("kernels_us" in r for r in rows):  # printed once; the JSON keeps them
            print("kernel us per call (profiler):\n" + breakdowns(rows), flush=True)
        with open(args.out, "w") as f:  # after each section, in case a later one fails
            json.dump(res, f, indent=1)
    res["seconds"] = time.time() - t0
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print("\n\n".join(tables) + f"\ntotal {res['seconds']:.0f} s; JSON in {args.out}")


if __name__ == "__main__":
    main()
