"""What the kernel benchmarks share: the model's shapes (D, E, TOP_K, ...), the projection and
MoE shapes they time, the tile sweeps (``Sweeps``: the full set and ``--quick``'s), the
timing helpers (``bench_ms``, ``graph_ms``), random and zero quantized weights, the device
ceilings, the relative error and the plain-text table.

Imported by lily.bench.gpu.kernels.linear (and its moe_linear and compile_report parts),
mixer, tile_sweep, moe_tile, moe_rows, repeat and diagnostics.gemv_trace; not a script.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

from lily.bench.measure import capture_graph
from lily.ops.moe_decode_config import MoeDecodeConfig
from lily.ops.moe_prefill import MoePrefillConfig
from lily.ops.qgemm import GemmConfig
from lily.ops.qgemv import GemvConfig
from lily.ops.qgemv_mma import MmaGemvConfig
from lily.quant import QuantWeight, quantize

DEV = "cuda"
BF16 = torch.bfloat16
D, E, I_E, I_S, TOP_K = 2048, 256, 512, 512, 8
EPS = 1e-6
L2_BYTES = 60 << 20
GEMV_SHAPES = [  # (name, N, K, bits)
    ("in_proj_qkv/q_proj", 8192, 2048, 4), ("in_proj_z", 4096, 2048, 4),
    ("o_proj/out_proj", 2048, 4096, 4), ("k/v_proj", 512, 2048, 4),
    ("in_proj_a/b", 32, 2048, 4), ("lm_head", 248320, 2048, 4), ("router", 256, 2048, 8),
]  # fmt: skip
# Kept in --quick: the table before this change (split-K 2 on 2048x4096), for comparison.
GEMV_OLD = {"o_proj/out_proj": [GemvConfig(8, 32, 2, 4)]}
FUSED_SHAPES = [("dn qkv|z|b|a", 8192 + 4096 + 32 + 32, 2048), ("attn q|k|v", 8192 + 512 + 512,
                2048), ("lm_head", 248320, 2048)]  # fmt: skip
GEMM_SHAPES = [("in_proj_qkv", 8192, 2048), ("o_proj", 2048, 4096), ("in_proj_z", 4096, 2048),
               ("dn qkv|z|b|a", 12352, 2048), ("in_proj_a/b", 32, 2048)]  # fmt: skip
GEMM_T = (256, 512, 2048, 8192)
GEMM_SMALL = [GemmConfig(64, 64, 64, 4, 3), GemmConfig(32, 64, 64, 4, 4),
              GemmConfig(64, 128, 64, 8, 3)]  # fmt: skip
PREFILL_T = (256, 512, 2048, 8192)
GEMV_GRAPH_CALLS = 32
ROWS_SHAPE = (8192, 2048)  # the shape of the few-rows comparison
# Tensor-core GEMV rows (name, N, K, prologue/epilogue): qgemv_mma next to qgemv.
MMA_SHAPES = [
    ("in_proj_qkv/q_proj", 8192, 2048, ""), ("in_proj_z", 4096, 2048, ""),
    ("dn qkv|z|b|a", 12352, 2048, "norm"), ("attn q|k|v", 9216, 2048, "norm"),
    ("o_proj/out_proj", 2048, 4096, "res"), ("lm_head", 248320, 2048, "norm fp32"),
]  # fmt: skip


@dataclass(frozen=True)
class Sweeps:
    """The tiles tried beside each kernel table's choice, by section: ``FULL`` by default,
    ``QUICK`` for ``--quick`` (table tiles only; the first three moe_decode variants).
    Passed to the row functions and compile_report, so that one choice reaches them all."""

    gemv: Mapping[str, tuple[GemvConfig, ...]]  # qgemv, by GEMV_SHAPES name
    gemm: tuple[GemmConfig, ...]  # qgemm at T = 2048
    prefill_bm: tuple[int, ...]  # moe_prefill token tiles (uniform routing)
    decode: tuple[MoeDecodeConfig | None, ...]  # moe_decode variants (None: the table)
    mma: Mapping[str, tuple[MmaGemvConfig, ...]]  # qgemv_mma, by MMA_SHAPES name


FULL = Sweeps(
    gemv={  # extra tiles tried on the shapes that carry the bytes
        "in_proj_qkv/q_proj": (GemvConfig(8, 32), GemvConfig(32, 8), GemvConfig(16, 16, 1, 8),
                               GemvConfig(32, 32, 1, 8)),
        "o_proj/out_proj": (GemvConfig(8, 64), GemvConfig(16, 32), GemvConfig(2, 128),
                            GemvConfig(8, 64, 1, 8)),
        "lm_head": (GemvConfig(32, 8), GemvConfig(64, 16, 1, 8), GemvConfig(16, 32)),
    },
    gemm=(GemmConfig(128, 128, 64, 8, 3), GemmConfig(128, 256, 64, 8, 3),
          GemmConfig(128, 128, 128, 8, 3), GemmConfig(64, 128, 64, 4, 4)),
    prefill_bm=(16, 32, 64, 128),
    decode=(
        None, MoeDecodeConfig(mma=False), MoeDecodeConfig(mma_rows=32),
        MoeDecodeConfig(mma_warps=4), MoeDecodeConfig(mma_warps=16),
        MoeDecodeConfig(mma_rows=32, mma_warps=16),
    ),
    mma={  # qgemv_mma tiles besides the table (rows x warps, register cap)
        "in_proj_qkv/q_proj": (MmaGemvConfig(16, 8), MmaGemvConfig(32, 8, 80),
                               MmaGemvConfig(32, 4), MmaGemvConfig(64, 16)),
        "dn qkv|z|b|a": (MmaGemvConfig(32, 8), MmaGemvConfig(16, 4), MmaGemvConfig(32, 4),
                         MmaGemvConfig(64, 16)),
        "o_proj/out_proj": (MmaGemvConfig(16, 8), MmaGemvConfig(32, 16)),
        "lm_head": (MmaGemvConfig(32, 8), MmaGemvConfig(64, 16), MmaGemvConfig(64, 8),
                    MmaGemvConfig(16, 4)),
    },
)  # fmt: skip
QUICK = Sweeps(gemv={}, gemm=(), prefill_bm=(), decode=FULL.decode[:3], mma={})


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative error ||a - b|| / ||b|| in float64; NaN where ``a`` is not finite."""
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return float("nan")
    return ((a - b).norm() / b.norm()).item()


def bench_ms(fn) -> float:
    """Median ms of ``fn`` (triton's do_bench: L2 flushed between runs)."""
    return do_bench(fn, warmup=10, rep=60, return_mode="median")


def graph_ms(fns: list) -> float:
    """Median time of one call, from a CUDA graph of ``fns`` called back to back."""

    def calls():
        for f in fns:
            f()

    return graph_call_ms(calls) / len(fns)


def graph_call_ms(fn) -> float:
    """Median time of one replay of ``fn`` captured in a CUDA graph (fn run before)."""
    return bench_ms(capture_graph(fn)[0].replay)


def cfg_str(cfg) -> str:
    """Short name of a tile config for the tables."""
    if isinstance(cfg, GemvConfig):
        return f"n{cfg.block_n} g{cfg.block_g} s{cfg.split_k} w{cfg.num_warps}"
    if isinstance(cfg, GemmConfig):
        return f"m{cfg.block_m} n{cfg.block_n} k{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages}"
    if isinstance(cfg, MoeDecodeConfig):
        if cfg.mma:  # (the down tile and the router's warps shown where not the defaults)
            out = f"r{cfg.router_rows} s{cfg.shared_rows} mma n{cfg.mma_rows} w{cfg.mma_warps}"
            if cfg.mma_down_rows or cfg.mma_down_warps:
                rows, warps = cfg.mma_down_rows or cfg.mma_rows, cfg.mma_down_warps or cfg.mma_warps
                out += f" dn n{rows} w{warps}"
            out += f" rw{cfg.num_warps}" if cfg.num_warps != 4 else ""
            out += (" once" if cfg.route_once else "") + (" hop" if cfg.down_operand else "")
            return out + (" early" if cfg.down_early else "")
        return (f"r{cfg.router_rows} s{cfg.shared_rows} gu{cfg.gate_up_rows} "
                f"dn{cfg.down_rows} w{cfg.num_warps}/{cfg.down_warps}")  # fmt: skip
    if isinstance(cfg, MmaGemvConfig):
        return f"n{cfg.block_n} w{cfg.num_warps}" + (f" r{cfg.maxnreg}" if cfg.maxnreg else "")
    if isinstance(cfg, MoePrefillConfig):
        return f"m{cfg.block_m} gu[{cfg_str(cfg.gate_up)}] dn[{cfg_str(cfg.down)}]"
    return str(cfg)


def rand_qweight(shape: tuple[int, ...], bits: int, gen: torch.Generator, gs: int = 64):
    """Random codes and scales with dequantized weights of std ~ 1/sqrt(K)."""
    *lead, n, k = shape
    words = torch.randint(-(2**31), 2**31, (*lead, n, k * bits // 32), generator=gen,
                          device=DEV, dtype=torch.int64).to(torch.int32)  # fmt: skip
    levels = 2**bits - 1
    scale = torch.rand(*lead, n, k // gs, generator=gen, device=DEV) + 0.5
    scale = scale * (3.0 / k) ** 0.5 * 2 / levels  # uniform in about [-a, a], std a/sqrt(3)
    return QuantWeight(words, scale.to(BF16), (-scale * levels / 2).to(BF16), bits, gs)


def norm_weight(gen: torch.Generator) -> torch.Tensor:
    """A random RMSNorm weight of D entries near 1."""
    return (1.0 + 0.05 * torch.randn(D, generator=gen, device=DEV)).to(BF16)


def ceilings(read: bool = True) -> dict:
    """The device's rates: device-to-device copy, (``read``) a read-only sum, bf16 matmul."""
    src = torch.rand(1 << 28, device=DEV)  # 1 GiB
    dst = torch.empty_like(src)
    out = {"copy_GBps": 2 * src.nbytes / bench_ms(lambda: dst.copy_(src)) / 1e6}
    if read:
        out["read_GBps"] = src.nbytes / bench_ms(lambda: src.sum()) / 1e6
    a = torch.randn(8192, 8192, device=DEV, dtype=BF16)
    b = torch.randn(8192, 8192, device=DEV, dtype=BF16)
    out["bf16_matmul_TFLOPs"] = 2 * 8192**3 / bench_ms(lambda: a @ b) / 1e9
    return out


def sweep_start(name: str) -> tuple[float, torch.Generator, dict]:
    """What a rows sweep does first: stop with a message where there is no CUDA GPU, then its
    start time, the seeded generator and the device's rates (printed as JSON)."""
    if not torch.cuda.is_available():
        sys.exit(f"kernels.{name} needs a CUDA GPU")
    t0 = time.perf_counter()
    gen = torch.Generator(device=DEV).manual_seed(0)
    ceil = ceilings(read=False)
    print(json.dumps(ceil), flush=True)
    return t0, gen, ceil


def gemv_point(calls: list, check, ref, nbytes: float, floor_us: float) -> dict:
    """A GEMV row: ``check()`` against ``ref``, then one call's time in a graph of ``calls``
    and its GB/s of ``nbytes`` against the copy-rate floor."""
    err = rel(check(), ref)
    us = graph_ms(calls) * 1e3
    return {"rel_err": err, "us": us, "GBps": nbytes / us / 1e3, "of_copy": floor_us / us,
            "floor_us": floor_us}  # fmt: skip


def weight_copies(n: int, k: int, bits: int, gen: torch.Generator) -> list[QuantWeight]:
    """Enough distinct weights that a graph of calls over them streams from HBM, not L2."""
    w0 = rand_qweight((n, k), bits, gen)
    copies = max(1, min(GEMV_GRAPH_CALLS, math.ceil(3 * L2_BYTES / w0.nbytes())))
    return [w0] + [rand_qweight((n, k), bits, gen) for _ in range(copies - 1)]


def moe_weights(gen: torch.Generator) -> dict:
    """One MoE layer's random weights at the model's shapes: 8-bit routers, 4-bit experts."""

    def router(rows: int) -> QuantWeight:
        return quantize(torch.randn(rows, D, generator=gen, device=DEV) / D**0.5, 8, 64)

    return {
        "router": router(E),
        "gate": rand_qweight((E, I_E, D), 4, gen),
        "up": rand_qweight((E, I_E, D), 4, gen),
        "down": rand_qweight((E, D, I_E), 4, gen),
        "shared_gate": rand_qweight((I_S, D), 4, gen),
        "shared_up": rand_qweight((I_S, D), 4, gen),
        "shared_down": rand_qweight((D, I_S), 4, gen),
        "shared_expert_gate": router(1),
    }


def expert_bytes(w: dict) -> int:
    """Bytes of one routed expert (gate, up, down)."""
    return sum(w[p][0].nbytes() for p in ("gate", "up", "down"))


def fixed_bytes(w: dict) -> int:
    """Bytes every token reads whatever its routing: the routers and the shared expert."""
    parts = ("router", "shared_gate", "shared_up", "shared_down", "shared_expert_gate")
    return sum(w[p].nbytes() for p in parts)


def zero_qweight(shape: tuple[int, ...], bits: int, gs: int = 64) -> QuantWeight:
    """A zero quantized weight on the CPU (compile-only runs need shapes, not values)."""
    *lead, n, k = shape
    return QuantWeight(
        torch.zeros(*lead, n, k * bits // 32, dtype=torch.int32),
        torch.zeros(*lead, n, k // gs, dtype=BF16), torch.zeros(*lead, n, k // gs, dtype=BF16),
        bits, gs,
    )  # fmt: skip


def table(rows: list[dict], cols: list[str]) -> str:
    """Rows as a ``|``-separated text table of ``cols``; a failed row shows its error."""

    def fmt(v) -> str:
        if isinstance(v, float):
            return f"{v:.3g}"
        return "" if v is None else str(v)

    lines = [" | ".join(cols)]
    for r in rows:
        if "error" in r:
            lines.append(
                " | ".join(fmt(r.get(c)) for c in cols[:4]) + " | ERROR " + r["error"][:80]
            )
        else:
            lines.append(" | ".join(fmt(r.get(c)) for c in cols))
    return "\n".join(lines)


def compile_sm90(fn, args, const: dict, opts: dict, aligned_tensors: bool):
    """Compile a recorded launch (a JIT function, its arguments, constexprs and options)
    for sm_90 on the host, as ``--compile-only`` reports it: the signature from the
    arguments' types, 16-byte divisibility for an int that is a multiple of 16 and for a
    tensor (every one with ``aligned_tensors``, as the engine's buffers are; else by its
    address)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    types = {torch.bfloat16: "*bf16", torch.float32: "*fp32", torch.int32: "*i32",
             torch.int64: "*i64"}  # fmt: skip
    sig, attrs = {}, {}
    for i, (name, v) in enumerate(zip(fn.arg_names, args, strict=False)):
        if isinstance(v, torch.Tensor):
            sig[name] = types[v.dtype]
            aligned = aligned_tensors or v.data_ptr() % 16 == 0
        else:
            sig[name] = "fp32" if isinstance(v, float) else "i32"
            aligned = isinstance(v, int) and v % 16 == 0
        if aligned:
            attrs[(i,)] = [["tt.divisibility", 16]]
    sig.update({k: "constexpr" for k in const})
    src = ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)


def cuobjdump() -> str:
    """The cuobjdump Triton ships (reads a cubin's registers and SASS); FileNotFoundError
    where this Triton has none."""
    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not path.exists():
        raise FileNotFoundError(f"no cuobjdump at {path} (Triton's NVIDIA backend ships it)")
    return str(path)


def sweep_args(ap, lines: str) -> None:
    """``--sweep-only`` (with --variants: ``lines`` alone) and ``--max-seconds``, the
    options of a script whose tile sweep must fit a time limit."""
    ap.add_argument("--sweep-only", action="store_true",
                    help=f"only the {lines} lines (the table's tile and the sweep)")  # fmt: skip
    ap.add_argument(
        "--max-seconds",
        type=float,
        help="start no line past this many seconds (the JSON keeps the rest)",
    )


def write_json(path: str | None, obj) -> None:
    """``obj`` as JSON at ``path`` (None: nothing), through a temporary file: a script
    that rewrites it after each measured line leaves a whole file when it is stopped."""
    if path:
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=1)
        os.replace(tmp, path)


_problems: dict = {}  # Launch -> what the compile matrix rejects in it (one check each)


def compile_problems(fn) -> list[str]:
    """What the compile matrix (lily/ops/matrix.py) would reject in the launches ``fn()``
    makes on this GPU's arch: registers, spills past its stack limit, shared memory; one
    line a kernel, [] where they fit (or the arch has no record). ``fn`` runs under
    ``record_launches``: nothing is launched. Each config is compiled once a process (a
    compile that fails here is printed, not held against the config: its launch will
    show it)."""
    from lily.ops.arch import ARCHS, current_arch
    from lily.ops.launch import record_launches
    from lily.ops.matrix import check, freeze, problems

    arch = current_arch(torch.device(DEV)).name
    if arch not in ARCHS:
        return []
    with record_launches() as rec:
        fn()
    out = []
    for launch in (freeze(r) for r in rec):
        if launch not in _problems:
            res = check(launch, arch)
            if res.error:
                print(f"  compile check of {launch.name} failed: {res.error}", flush=True)
            _problems[launch] = [] if res.error else problems(res)
        out += [f"{launch.name}: {p}" for p in _problems[launch]]
    return out


def against_table(ok: list[dict], key: str, table: dict | None) -> tuple[dict, dict]:
    """A sweep's fastest line of ``ok`` (by ``key``, its time) and how it compares with the
    table's line ``table`` (none: {}): the fields ``than_table`` prints."""
    top = min(ok, key=lambda r: r[key])
    if table is None:
        return top, {}
    return top, {"table": table["config"], "table_us": table[key],
                 "speedup": table[key] / top[key]}  # fmt: skip


def than_table(r: dict, digits: int = 1, name: str = "the table's") -> str:
    """`` against the table's T (Sx)`` for a best line with ``against_table``'s fields."""
    if "table_us" not in r:
        return ""
    return f" against {name} {r['table_us']:.{digits}f} ({r['speedup']:.2f}x)"
