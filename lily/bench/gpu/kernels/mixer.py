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
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from datetime import UTC, datetime
from functools import partial

import torch
import triton
from triton.testing import do_bench

from lily.bench.measure import attempt, capture_graph, kernel_times
from lily.model.ref import ref_attention, ref_deltanet
from lily.ops.attention_decode import attention_decode, default_split
from lily.ops.attention_prefill import attention_prefill, flash_per_sm, flash_split
from lily.ops.deltanet_decode import DeltaNetDecodeWorkspace, deltanet_decode
from lily.ops.deltanet_prefill import deltanet_prefill
from lily.ops.launch import cdiv
from lily.ops.norm_rope import rope_inv_freq

HK, HV, K, VD, W = 16, 32, 128, 128, 4
C = 2 * HK * K + HV * VD
H, HKV, DH, R, THETA = 16, 2, 256, 64, 1e7
DN_LAYERS, ATTN_LAYERS = 30, 10
# the sweeps (module constants so that a dry run can shrink them)
DN_DECODE_CONFIGS = [(bv, w) for bv in (16, 32, 64, 128) for w in (4, 8)]  # block_v, warps
DN_PREFILL_T = (512, 2048, 8192)
DN_PREFILL_CONFIGS = [("scan", 16), ("scan", 32), ("scan", 128)]
DN_PREFILL_CONFIGS += [("chunk", 32), ("chunk", 64), ("chunk", 128)]
DN_PREFILL_CONFIGS += [("chunk_par", 32), ("chunk_par", 64), ("chunk_par", 128)]
SCAN_ALL_UP_TO = 2048  # longer chunks time only the first scan configuration (it is slow)
ATTN_CONTEXTS = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
ATTN_SPLITS = (64, 256, 1024)  # tried beside the plain variant and default_split
# (context, graph bucket) of decode steps as the runner captures them, and splits tried
ATTN_BUCKET_POINTS = ((4200, 8192), (7900, 8192), (16500, 32768), (33000, 65536),
                      (62000, 65536), (66000, 131072), (131200, 135168))  # fmt: skip
ATTN_BUCKET_SPLITS = (64, 128, 256, 512, 1024)
ATTN_PREFILL_SHAPES = ((512, 0), (2048, 0), (8192, 0), (512, 1536), (2048, 30720))  # T, start
# block_m, block_n, warps (the default first)
ATTN_PREFILL_CONFIGS = [(128, 64, 8), (64, 32, 4), (64, 64, 8), (32, 64, 4), (128, 32, 8),
                        (64, 16, 4)]  # fmt: skip
# Key splits of the prefill (T, start): short chunks after a long history (reused turns)
ATTN_SPLIT_SHAPES = ((1128, 16080), (512, 16000), (2048, 16000), (1128, 4000), (4096, 0),
                     (4096, 12288), (4096, 126976))  # fmt: skip
ATTN_SPLIT_TRIES = (1, 2, 3, 4, 6, 8, 12)
ATTN_SPLIT_CONFIGS = [(64, 32, 4), (128, 32, 8)]  # block_m, block_n, warps
# block_m, block_n, warps, stages
ATTN_TILE_CONFIGS = [(64, 32, 4, 2), (64, 32, 4, 3), (64, 64, 4, 2), (64, 64, 4, 3),
                     (64, 64, 8, 2), (128, 64, 8, 2), (64, 16, 4, 3)]  # fmt: skip
BF16 = torch.bfloat16
DEV = "cuda"


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return float("nan")
    return ((a - b).norm() / b.norm()).item()


def bench_ms(fn) -> float:
    return do_bench(fn, warmup=10, rep=60, return_mode="median")


def graph_ms(fn) -> float:
    """Median time of one replay of ``fn`` captured in a CUDA graph (fn run before)."""
    return bench_ms(capture_graph(fn)[0].replay)


def ceilings() -> dict:
    src = torch.rand(1 << 28, device=DEV)  # 1 GiB
    dst = torch.empty_like(src)
    copy_gbs = 2 * src.nbytes / bench_ms(lambda: dst.copy_(src)) / 1e6
    a = torch.randn(8192, 8192, device=DEV, dtype=BF16)
    b = torch.randn(8192, 8192, device=DEV, dtype=BF16)
    mm_tflops = 2 * 8192**3 / bench_ms(lambda: a @ b) / 1e9
    return {"copy_GBps": copy_gbs, "bf16_matmul_TFLOPs": mm_tflops}


# ----------------------------------------------------------------------------- DeltaNet

DN_INPUTS = ("mixed_qkv", "z", "b", "a")
DN_ARGS = DN_INPUTS + ("conv_weight", "conv_state", "A_log", "dt_bias", "norm_weight", "state")


def dn_inputs(t: int, gen: torch.Generator) -> dict:
    """One layer's inputs for T tokens, in the ranges the model produces."""
    dev = gen.device

    def rnd(*shape, scale=1.0, dtype=BF16):
        return (torch.randn(*shape, generator=gen, device=dev) * scale).to(dtype)

    f32 = torch.float32
    return {
        "mixed_qkv": rnd(t, C), "z": rnd(t, HV * VD), "b": rnd(t, HV), "a": rnd(t, HV),
        "conv_weight": rnd(C, W, scale=0.5), "conv_state": rnd(W - 1, C),
        "A_log": rnd(HV, scale=0.5, dtype=f32), "dt_bias": rnd(HV, dtype=f32),
        "norm_weight": (torch.rand(VD, generator=gen, device=dev) + 0.5).to(BF16),
        "state": rnd(HV, K, VD, scale=0.05, dtype=f32),
    }  # fmt: skip


def dn_args(d: dict, rows=slice(None), **states) -> list:
    """Positional arguments of the DeltaNet ops: tokens ``rows``, states overridable."""
    d = {**d, **states}
    return [d[k][rows] if k in DN_INPUTS else d[k] for k in DN_ARGS]


def fresh_states(d: dict) -> dict:
    return {"conv_state": d["conv_state"].clone(), "state": d["state"].clone()}


def dn_decode(gen: torch.Generator, copy_gbs: float) -> list[dict]:
    rows = []
    d = dn_inputs(1, gen)
    ref_out, ref_cs, ref_st = ref_deltanet(*dn_args(d), 1e-6)
    layers = [dn_inputs(1, gen) for _ in range(DN_LAYERS)]
    ws = DeltaNetDecodeWorkspace.new(HK, HV, VD, DEV)
    # bytes one step must move per layer: state and conv state read and written, conv and
    # norm weights, the inputs (qkv, z, b, a) and the output
    nbytes = 2 * HV * K * VD * 4 + 2 * (W - 1) * C * 2 + C * W * 2 + VD * 2
    nbytes += (C + 2 * HV * VD + 2 * HV) * 2

    def measure(block_v: int, warps: int) -> dict:
        kw = {"workspace": ws, "block_v": block_v, "num_warps": warps}
        st = fresh_states(d)
        out = deltanet_decode(*dn_args(d, 0, **st), 1e-6, **kw)
        err = max(rel(out, ref_out[0]), rel(st["state"], ref_st))
        err_cs = rel(st["conv_state"].float(), ref_cs)

        def step():
            for x in layers:
                deltanet_decode(*dn_args(x, 0), 1e-6, **kw)

        us = graph_ms(step) * 1e3 / DN_LAYERS
        gbs = nbytes / us / 1e3
        return {"us_per_layer": us, "GBps": gbs, "frac_copy": gbs / copy_gbs,
                "rel_err": err, "conv_state_err": err_cs}  # fmt: skip

    for block_v, warps in DN_DECODE_CONFIGS:
        base = {"op": "dn_decode", "block_v": block_v, "num_warps": warps}
        attempt(rows, base, lambda b=block_v, w=warps: measure(b, w))
    return rows


def dn_prefill(gen: torch.Generator, ts: tuple[int, ...] = DN_PREFILL_T) -> list[dict]:
    rows = []
    for t in ts:
        d = dn_inputs(t, gen)
        ref = ref_deltanet(*dn_args(d), 1e-6)[::2]

        def measure(method: str, block_v: int, d=d, ref=ref, t=t) -> dict:
            kw = {"method": method, "block_v": block_v}
            st = fresh_states(d)
            out = deltanet_prefill(*dn_args(d, **st), 1e-6, **kw)
            err = max(rel(out, ref[0]), rel(st["state"], ref[1]))
            st = fresh_states(d)  # timed runs update states of their own

            def call():
                deltanet_prefill(*dn_args(d, **st), 1e-6, **kw)

            ms, ms_eager = graph_ms(call), bench_ms(call)
            return {"ms": ms, "ms_eager": ms_eager, "tok_per_s": t / ms * 1e3,
                    "ms_30_layers": 30 * ms, "rel_err": err,
                    "kernels_us": kernel_times(call)}  # fmt: skip

        for method, block_v in DN_PREFILL_CONFIGS:
            if method == "scan" and t > SCAN_ALL_UP_TO and block_v != DN_PREFILL_CONFIGS[0][1]:
                continue
            base = {"op": "dn_prefill", "T": t, "method": method, "block_v": block_v}
            attempt(rows, base, lambda m=method, b=block_v, f=measure: f(m, b))
        del d, ref
    return rows


# ----------------------------------------------------------------------------- attention

ATTN_ARGS = ("qg", "k", "v", "q_norm", "k_norm", "k_cache", "v_cache")


def attn_inputs(t: int, t_max: int, gen: torch.Generator, filled: int) -> dict:
    """Projections of T tokens and caches of T_max rows, the first ``filled`` random."""
    dev = gen.device

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device=dev).to(BF16)

    d = {"qg": rnd(t, H * 2 * DH), "k": rnd(t, HKV * DH), "v": rnd(t, HKV * DH)}
    for name in ("q_norm", "k_norm"):
        d[name] = (torch.rand(DH, generator=gen, device=dev) + 0.5).to(BF16)
    for name in ("k_cache", "v_cache"):
        d[name] = torch.zeros(HKV, t_max, DH, device=dev, dtype=BF16)
        d[name][:, :filled] = rnd(HKV, filled, DH)
    return d


def attn_args(d: dict, row: int | None = None) -> list:
    """Positional arguments of the attention ops (one token's row for decode)."""
    return [d[k] if row is None or "norm" in k or "cache" in k else d[k][row] for k in ATTN_ARGS]


def attn_point(layers, pos, inv_freq, ref_out, kw: dict, nbytes: int, copy_gbs: float,
               kernels: bool) -> dict:  # fmt: skip
    """One attention decode configuration: checked on layer 0, then timed as a graph over
    all layers (us a layer); with ``kernels`` also each kernel's device time."""

    def step():
        for x in layers:
            attention_decode(*attn_args(x, 0), pos, inv_freq, **kw)

    err = rel(attention_decode(*attn_args(layers[0], 0), pos, inv_freq, **kw), ref_out)
    us = graph_ms(step) * 1e3 / ATTN_LAYERS
    gbs = nbytes / us / 1e3
    row = {"us_per_layer": us, "GBps": gbs, "frac_copy": gbs / copy_gbs, "rel_err": err}
    if kernels:
        row["kernels_us"] = kernel_times(
            lambda: attention_decode(*attn_args(layers[0], 0), pos, inv_freq, **kw)
        )
    return row


def attn_decode(gen: torch.Generator, copy_gbs: float) -> list[dict]:
    return attn_points(gen, copy_gbs, [(ctx, ctx) for ctx in ATTN_CONTEXTS], ATTN_SPLITS,
                       "attn_decode")  # fmt: skip


def attn_bucket(gen: torch.Generator, copy_gbs: float) -> list[dict]:
    """Split sizes as the runner's decode graphs see them: a graph is captured per context
    bucket (``max_len``, the next power of two), so the split is fixed while the length
    runs from half the bucket to all of it."""
    return attn_points(gen, copy_gbs, ATTN_BUCKET_POINTS, ATTN_BUCKET_SPLITS, "attn_bucket")


def attn_points(gen: torch.Generator, copy_gbs: float, points, splits, op: str) -> list[dict]:
    """Each (ctx, max_len) point: ``ctx`` rows in a graph of 10 layers built for
    ``max_len``, at the default split and ``splits`` (and the plain variant when
    ctx == max_len, as run 1 measured it)."""
    rows = []
    inv_freq = rope_inv_freq(R, THETA, DEV)
    for ctx, max_len in points:
        pos = torch.tensor([ctx - 1], device=DEV, dtype=torch.int32)
        layers = [attn_inputs(1, max_len, gen, ctx - 1) for _ in range(ATTN_LAYERS)]
        ref_out = ref_attention(*attn_args(layers[0]), ctx - 1, R, THETA)[0][0]
        nbytes = 2 * HKV * ctx * DH * 2  # K and V rows read per layer
        default = default_split(max_len)
        tried = [0] if ctx == max_len else []
        tried += [default] + [s for s in splits if s < max_len]
        for split in dict.fromkeys(tried):
            base = {"op": op, "ctx": ctx, "max_len": max_len, "split": split,
                    "default": split == default}  # fmt: skip
            kw = {"split": split, "max_len": max_len}
            kernels = split == default or op == "attn_bucket"
            attempt(rows, base, partial(attn_point, layers, pos, inv_freq, ref_out, kw, nbytes,
                                        copy_gbs, kernels))  # fmt: skip
        del layers
        torch.cuda.empty_cache()
    return rows


def attn_prefill(gen: torch.Generator, mm_tflops: float) -> list[dict]:
    rows = []
    inv_freq = rope_inv_freq(R, THETA, DEV)
    for t, start in ATTN_PREFILL_SHAPES:
        d = attn_inputs(t, start + t, gen, start)
        ref = ref_attention(*attn_args(d), start, R, THETA)[0]
        torch.cuda.empty_cache()
        flops = 4 * H * DH * (t * start + t * (t + 1) // 2)  # causal QK^T and PV
        start_t = torch.tensor([start], device=DEV)  # a device start: no copy in the graph

        def measure(bm: int, bn: int, warps: int, d=d, ref=ref, flops=flops, start_t=start_t):
            kw = {"block_m": bm, "block_n": bn, "num_warps": warps}

            def call():
                return attention_prefill(*attn_args(d), start_t, inv_freq, **kw)

            err = rel(call(), ref)
            ms, ms_eager = graph_ms(call), bench_ms(call)
            tflops = flops / ms / 1e9
            return {"ms": ms, "ms_eager": ms_eager, "TFLOPs": tflops,
                    "frac_matmul": tflops / mm_tflops, "rel_err": err,
                    "kernels_us": kernel_times(call)}  # fmt: skip

        for bm, bn, warps in ATTN_PREFILL_CONFIGS:
            base = {"op": "attn_prefill", "T": t, "start": start, "block_m": bm, "block_n": bn,
                    "num_warps": warps}  # fmt: skip
            attempt(rows, base, lambda a=bm, b=bn, w=warps, f=measure: f(a, b, w))
        del d, ref
    return rows


def attn_split(gen: torch.Generator, mm_tflops: float, shapes=ATTN_SPLIT_SHAPES,
               configs=ATTN_SPLIT_CONFIGS, tries=ATTN_SPLIT_TRIES) -> list[dict]:  # fmt: skip
    """Prefill tiles with their keys split S ways, and the S that flash_split picks.
    ``configs``: (block_m, block_n, warps) or (block_m, block_n, warps, stages)."""
    rows = []
    inv_freq = rope_inv_freq(R, THETA, DEV)
    n_sm = torch.cuda.get_device_properties(DEV).multi_processor_count
    for t, start in shapes:
        d = attn_inputs(t, start + t, gen, start)
        ref = ref_attention(*attn_args(d), start, R, THETA)[0]
        torch.cuda.empty_cache()
        flops = 4 * H * DH * (t * start + t * (t + 1) // 2)
        start_t = torch.tensor([start], device=DEV)
        for bm, bn, warps, *st in configs:
            stages = st[0] if st else 2
            kw = {"block_m": bm, "block_n": bn, "num_warps": warps, "num_stages": stages}
            per_sm = flash_per_sm(bm, bn, DH, warps, stages, d["k_cache"])
            auto = flash_split(cdiv(t, bm // (H // HKV)) * HKV, start + t, n_sm * per_sm, bn)

            def measure(split: int, d=d, ref=ref, flops=flops, start_t=start_t, kw=kw, auto=auto):
                def call():
                    return attention_prefill(*attn_args(d), start_t, inv_freq, split=split, **kw)

                err = rel(call(), ref)
                ms = graph_ms(call)
                tflops = flops / ms / 1e9
                return {"ms": ms, "TFLOPs": tflops, "frac_matmul": tflops / mm_tflops,
                        "rel_err": err, "picked": split == auto}  # fmt: skip

            for split in dict.fromkeys((auto, *tries)):
                base = {"op": "attn_split", "T": t, "start": start, "block_m": bm,
                        "block_n": bn, "num_warps": warps, "num_stages": stages,
                        "split": split}  # fmt: skip
                attempt(rows, base, lambda sp=split, f=measure: f(sp))
        del d, ref
        torch.cuda.empty_cache()
    return rows


# ----------------------------------------------------------------------------- compile


def compile_report() -> list[dict]:
    """Compile every timed configuration for sm_90 on this machine (no GPU needed) and read
    what ptxas gave each kernel: registers, stack bytes (spills) and shared memory.

    The public functions run on CPU tensors of the real shapes with kernel launches
    intercepted, so the kernels see exactly the arguments their launchers pass.
    """
    import re
    import tempfile
    from pathlib import Path

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
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

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    types = {torch.bfloat16: "*bf16", torch.float32: "*fp32", torch.int32: "*i32",
             torch.int64: "*i64"}  # fmt: skip
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
        sig, attrs = {}, {}
        for i, (name, v) in enumerate(zip(fn.arg_names, args, strict=False)):
            if isinstance(v, torch.Tensor):
                sig[name] = types[v.dtype]
                aligned = v.data_ptr() % 16 == 0
            else:
                sig[name] = "fp32" if isinstance(v, float) else "i32"
                aligned = isinstance(v, int) and v % 16 == 0
            if aligned:
                attrs[(i,)] = [["tt.divisibility", 16]]
        sig.update({k: "constexpr" for k in const})
        row = {"kernel": fn.__name__, "config": label, **opts}
        try:
            src = ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs)
            k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
            with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                f.write(k.asm["cubin"])
                f.flush()
                res = subprocess.run([str(cuobjdump), "-res-usage", f.name], text=True,
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
    res["ceilings"] = ceil = ceilings()
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
