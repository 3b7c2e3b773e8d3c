"""Check and time the quantized linear and MoE kernels (lily.ops.q*, moe_*) on one GPU.

Run from the repository root on the GPU machine (about 4-5 minutes, most of it compiling;
``--quick`` skips the tile sweeps: under 3 minutes):

    PYTHONUNBUFFERED=1 python -m lily.bench.gpu.kernels.linear --quick \
        --out $OUT/linear.json

Without a GPU, ``--compile-only`` compiles the same configurations (of the ``--only``
sections) for sm_90 and prints registers, spilled stack bytes, shared memory, warpgroup and
warp MMA counts and the SASS instruction count per kernel (per 4-bit code for qgemv_mma).

Order: the ceilings (device-to-device copy, read-only sum, bf16 matmul), then at the real
shapes (D=2048, MLX 4-bit group 64, 8-bit routers) every op is checked against the fp32
reference in lily.model.ref on fresh random inputs and timed:
1. qgemv on the projection shapes: CUDA graphs of back-to-back calls over enough weight
   copies to overflow L2 (what a decode step sees), a few tiles per shape; GB/s of the
   bytes that must be read against the copy rate; rows T = 2, 4, 8 against qgemm;
   ``fused``: the decode projections concatenated at load (DeltaNet qkv|z|b|a, attention
   q|k|v) and the lm_head with the RMSNorm prologue, against torch rms_norm + qgemv;
2. qgemm at T = 256, 512, 2048, 8192: TFLOP/s against the matmul rate and the roofline
   floor, next to torch's bf16 matmul on the dequantized weight; small tiles at T <= 512;
3. moe_decode (norm and router to residual, graph of 32 tokens): GB/s of the experts
   touched, tile variants, fused norm against rms_norm + moe_decode, device time per
   launch; ``chain``: a decode layer's linear part (fused-norm projection GEMV, out_proj
   with residual, fused-norm MoE) replayed over 8 layers of distinct weights;
4. moe_prefill at T = 256, 512, 2048, 8192, uniform and skewed routing (4 hot experts), the
   token tile swept: TFLOP/s, the expert-load histogram, graph against eager time (host
   overhead) and device time per launch at 256 and 4096 tokens; a stress row: chunks of
   4096 with NaN tokens and skew in a row (the 32K prefill's illegal memory access);
5. ``gemv_mma``: the tensor-core GEMV qgemv_mma (the runner's decode GEMV) next to qgemv
   on the decode shapes (plain, fused norm, residual, lm_head with fp32 out), both with
   and without PDL, in CUDA graphs as in 1., plus qgemv_mma tile variants;
6. ``floors``: qgemv_mma with PDL over distinct weights and over one (L2-resident) weight,
   next to what one torch copy kernel of the same bytes reaches in the same harness.
``do_bench`` medians flush L2 between runs. A configuration that fails is a row with its
error. Prints compact tables (again all together at the end); the JSON holds every number.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial

import torch
import triton
from triton.testing import do_bench

from lily.bench.measure import attempt, capture_graph, kernel_times
from lily.model.norm import rms_norm
from lily.model.ref import ref_moe, ref_qlinear, ref_route
from lily.ops.moe_decode import MoeDecodeConfig, moe_decode
from lily.ops.moe_prefill import MoePrefillConfig, moe_prefill, moe_prefill_config
from lily.ops.qgemm import GemmConfig, gemm_config, qgemm
from lily.ops.qgemv import GemvConfig, gemv_config, qgemv
from lily.ops.qgemv_mma import MmaGemvConfig, mma_gemv_config, qgemv_mma
from lily.ops.rmsnorm import add_rmsnorm, rmsnorm
from lily.quant import QuantWeight, dequantize, quantize

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
GEMV_SWEEP = {  # extra tiles tried on the shapes that carry the bytes
    "in_proj_qkv/q_proj": [GemvConfig(8, 32), GemvConfig(32, 8), GemvConfig(16, 16, 1, 8),
                           GemvConfig(32, 32, 1, 8)],
    "o_proj/out_proj": [GemvConfig(8, 64), GemvConfig(16, 32), GemvConfig(2, 128),
                        GemvConfig(8, 64, 1, 8)],
    "lm_head": [GemvConfig(32, 8), GemvConfig(64, 16, 1, 8), GemvConfig(16, 32)],
}  # fmt: skip
# Decode projections concatenated at load (one GEMV each), and the lm_head: norm fused.
FUSED_SHAPES = [("dn qkv|z|b|a", 8192 + 4096 + 32 + 32, 2048), ("attn q|k|v", 8192 + 512 + 512,
                2048), ("lm_head", 248320, 2048)]  # fmt: skip
GEMM_SHAPES = [("in_proj_qkv", 8192, 2048), ("o_proj", 2048, 4096), ("in_proj_z", 4096, 2048),
               ("dn qkv|z|b|a", 12352, 2048), ("in_proj_a/b", 32, 2048)]  # fmt: skip
GEMM_T = (256, 512, 2048, 8192)
GEMM_SWEEP = [GemmConfig(128, 128, 64, 8, 3), GemmConfig(128, 256, 64, 8, 3),
              GemmConfig(128, 128, 128, 8, 3), GemmConfig(64, 128, 64, 4, 4)]  # fmt: skip
# Small-T tiles (more programs) tried at T <= 512 even in --quick: the table gives 128x128.
GEMM_SMALL = [GemmConfig(64, 64, 64, 4, 3), GemmConfig(32, 64, 64, 4, 4),
              GemmConfig(64, 128, 64, 8, 3)]  # fmt: skip
PREFILL_T = (256, 512, 2048, 8192)
PREFILL_BM = (16, 32, 64, 128)
CHECK_T = 512  # prefill lengths checked against the reference on every config
GEMV_GRAPH_CALLS = 32
ROWS_SHAPE = (8192, 2048)  # the shape of the few-rows comparison
DECODE_CFGS = [  # moe_decode variants (None: the table, the experts on the tensor cores)
    None, MoeDecodeConfig(mma=False), MoeDecodeConfig(mma_rows=32),
    MoeDecodeConfig(mma_warps=4), MoeDecodeConfig(mma_warps=16),
    MoeDecodeConfig(mma_rows=32, mma_warps=16),
]  # fmt: skip
CHAIN_LAYERS = 8
CHAIN_PROJ, CHAIN_O = 12352, 4096  # fused DeltaNet projection rows, mixer output width
# Tensor-core GEMV rows (name, N, K, prologue/epilogue): qgemv_mma next to qgemv.
MMA_SHAPES = [
    ("in_proj_qkv/q_proj", 8192, 2048, ""), ("in_proj_z", 4096, 2048, ""),
    ("dn qkv|z|b|a", 12352, 2048, "norm"), ("attn q|k|v", 9216, 2048, "norm"),
    ("o_proj/out_proj", 2048, 4096, "res"), ("lm_head", 248320, 2048, "norm fp32"),
]  # fmt: skip
MMA_SWEEP = {  # qgemv_mma tiles besides the table (rows x warps, register cap); not --quick
    "in_proj_qkv/q_proj": [MmaGemvConfig(16, 8), MmaGemvConfig(32, 8, 80), MmaGemvConfig(32, 4),
                           MmaGemvConfig(64, 16)],
    "dn qkv|z|b|a": [MmaGemvConfig(32, 8), MmaGemvConfig(16, 4), MmaGemvConfig(32, 4),
                     MmaGemvConfig(64, 16)],
    "o_proj/out_proj": [MmaGemvConfig(16, 8), MmaGemvConfig(32, 16)],
    "lm_head": [MmaGemvConfig(32, 8), MmaGemvConfig(64, 16), MmaGemvConfig(64, 8),
                MmaGemvConfig(16, 4)],
}  # fmt: skip
STRESS_T = (4096, 4096, 1000)  # prefill chunks in a row for the stress row
ERR_CHARS = 200


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return float("nan")
    return ((a - b).norm() / b.norm()).item()


def bench_ms(fn) -> float:
    return do_bench(fn, warmup=10, rep=60, return_mode="median")


def graph_ms(fns: list) -> float:
    """Median time of one call, from a CUDA graph of ``fns`` called back to back."""

    def calls():
        for f in fns:
            f()

    return bench_ms(capture_graph(calls)[0].replay) / len(fns)


def cfg_str(cfg) -> str:
    """Short name of a tile config for the tables."""
    if isinstance(cfg, GemvConfig):
        return f"n{cfg.block_n} g{cfg.block_g} s{cfg.split_k} w{cfg.num_warps}"
    if isinstance(cfg, GemmConfig):
        return f"m{cfg.block_m} n{cfg.block_n} k{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages}"
    if isinstance(cfg, MoeDecodeConfig):
        if cfg.mma:
            return f"r{cfg.router_rows} s{cfg.shared_rows} mma n{cfg.mma_rows} w{cfg.mma_warps}"
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
    return (1.0 + 0.05 * torch.randn(D, generator=gen, device=DEV)).to(BF16)


def ceilings() -> dict:
    src = torch.rand(1 << 28, device=DEV)  # 1 GiB
    dst = torch.empty_like(src)
    copy = 2 * src.nbytes / bench_ms(lambda: dst.copy_(src)) / 1e6
    read = src.nbytes / bench_ms(lambda: src.sum()) / 1e6
    a = torch.randn(8192, 8192, device=DEV, dtype=BF16)
    b = torch.randn(8192, 8192, device=DEV, dtype=BF16)
    mm = 2 * 8192**3 / bench_ms(lambda: a @ b) / 1e9
    return {"copy_GBps": copy, "read_GBps": read, "bf16_matmul_TFLOPs": mm}


# ------------------------------------------------------------------------------ GEMV


def gemv_point(calls: list, check, ref, nbytes: float, floor_us: float) -> dict:
    err = rel(check(), ref)
    us = graph_ms(calls) * 1e3
    return {"rel_err": err, "us": us, "GBps": nbytes / us / 1e3, "of_copy": floor_us / us,
            "floor_us": floor_us}  # fmt: skip


def rows_point(fn, ref, nbytes: float) -> dict:
    err = rel(fn(), ref)
    us = bench_ms(fn) * 1e3
    return {"rel_err": err, "us": us, "GBps": nbytes / us / 1e3}


def weight_copies(n: int, k: int, bits: int, gen: torch.Generator) -> list[QuantWeight]:
    """Enough distinct weights that a graph of calls over them streams from HBM, not L2."""
    w0 = rand_qweight((n, k), bits, gen)
    copies = max(1, min(GEMV_GRAPH_CALLS, math.ceil(3 * L2_BYTES / w0.nbytes())))
    return [w0] + [rand_qweight((n, k), bits, gen) for _ in range(copies - 1)]


def gemv_rows(ceil: dict, gen: torch.Generator) -> list[dict]:
    rows: list[dict] = []
    for name, n, k, bits in GEMV_SHAPES:
        ws = weight_copies(n, k, bits, gen)
        xs = [torch.randn(k, generator=gen, device=DEV).to(BF16) for _ in ws]
        ref = ref_qlinear(xs[0], ws[0])
        nbytes = ws[0].nbytes() + 2 * k + 2 * n
        floor_us = nbytes / ceil["copy_GBps"] / 1e3
        for cfg in [None] + GEMV_OLD.get(name, []) + GEMV_SWEEP.get(name, []):
            used = cfg or gemv_config(n, k, 1, bits, 64)
            old = cfg in GEMV_OLD.get(name, [])
            label = "table " if cfg is None else "old table " if old else ""
            base = {"op": "qgemv", "shape": name, "N": n, "K": k, "bits": bits, "T": 1,
                    "config": label + cfg_str(used)}  # fmt: skip
            calls = [partial(qgemv, x, w, config=cfg) for w, x in zip(ws, xs, strict=True)]
            check = partial(qgemv, xs[0], ws[0], config=cfg)
            attempt(rows, base, partial(gemv_point, calls, check, ref, nbytes, floor_us))
    # Few rows: the FMA GEMV per row against the tensor-core GEMM with 16-row tiles.
    w0 = rand_qweight(ROWS_SHAPE, 4, gen)
    for t in (2, 4, 8):
        x = torch.randn(t, ROWS_SHAPE[1], generator=gen, device=DEV).to(BF16)
        ref = ref_qlinear(x, w0)
        for op, fn in (("qgemv", partial(qgemv, x, w0)), ("qgemm", partial(qgemm, x, w0))):
            base = {"op": op, "shape": "in_proj_qkv rows", "N": ROWS_SHAPE[0],
                    "K": ROWS_SHAPE[1], "bits": 4, "T": t, "config": "table"}  # fmt: skip
            attempt(rows, base, partial(rows_point, fn, ref, w0.nbytes()))
    return rows


def fused_rows(ceil: dict, gen: torch.Generator) -> list[dict]:
    """GEMV with the RMSNorm prologue against torch rms_norm (7 ops) + GEMV, on the decode
    projections as the runner concatenates them, and the lm_head."""
    rows: list[dict] = []
    nw = norm_weight(gen)
    for name, n, k in FUSED_SHAPES:
        ws = weight_copies(n, k, 4, gen)
        xs = [(2 * torch.randn(k, generator=gen, device=DEV)).to(BF16) for _ in ws]
        ref = ref_qlinear(rms_norm(xs[0], nw, EPS), ws[0])
        nbytes = ws[0].nbytes() + 2 * k + 2 * n
        floor_us = nbytes / ceil["copy_GBps"] / 1e3
        variants = {
            "fused norm": lambda x, w: qgemv(x, w, norm_weight=nw, eps=EPS),
            "fused norm pdl": lambda x, w: qgemv(x, w, norm_weight=nw, eps=EPS, pdl=True),
            "rms_norm + qgemv": lambda x, w: qgemv(rms_norm(x, nw, EPS), w),
        }
        for label, fn in variants.items():
            base = {"op": "qgemv+norm", "shape": name, "N": n, "K": k, "bits": 4, "T": 1,
                    "config": f"{label} {cfg_str(gemv_config(n, k, 1, 4, 64))}"}  # fmt: skip
            calls = [partial(fn, x, w) for w, x in zip(ws, xs, strict=True)]
            check = partial(fn, xs[0], ws[0])
            attempt(rows, base, partial(gemv_point, calls, check, ref, nbytes, floor_us))
    # Prefill-side norms (T, D): one kernel against torch's 7 ops, eager (host included).
    for t in (1, 256, 4096):
        x = (2 * torch.randn(t, D, generator=gen, device=DEV)).to(BF16)
        r = torch.randn(t, D, generator=gen, device=DEV).to(BF16)
        ref = rms_norm(x + r, nw, EPS)
        variants = {
            "torch add + rms_norm": lambda x=x, r=r: rms_norm(x + r, nw, EPS),
            "add_rmsnorm": lambda x=x, r=r: add_rmsnorm(x, r, nw, EPS)[1],
            "torch rms_norm (no add)": lambda x=x, r=r: rms_norm(x, nw, EPS),
            "rmsnorm (no add)": lambda x=x, r=r: rmsnorm(x, nw, EPS),
        }
        for label, fn in variants.items():
            base = {"op": "rmsnorm", "shape": f"({t}, {D})", "T": t, "config": label}
            want = ref if "no add" not in label else rms_norm(x, nw, EPS)
            attempt(rows, base, partial(rows_point, fn, want, 6 * t * D))
    return rows


@dataclass
class MmaCase:
    """One decode GEMV shape with its inputs: weight copies (enough to stream from HBM),
    rows x and residuals, the launcher's keywords (norm, out dtype), the fp32 reference of
    the first call, and the bytes it must read with their floor at the copy rate."""

    ws: list
    xs: list
    rs: list
    kw: dict
    res: bool
    ref: torch.Tensor
    nbytes: int
    floor_us: float
    suffix: str


def mma_case(n: int, k: int, extra: str, nw, ceil: dict, gen: torch.Generator) -> MmaCase:
    """The inputs of an MMA_SHAPES row (``extra``: "norm", "res", "fp32")."""
    ws = weight_copies(n, k, 4, gen)
    scale = 2.0 if "norm" in extra else 1.0
    xs = [(scale * torch.randn(k, generator=gen, device=DEV)).to(BF16) for _ in ws]
    rs = [torch.randn(n, generator=gen, device=DEV).to(BF16) for _ in ws]
    kw: dict = {}
    if "norm" in extra:
        kw.update(norm_weight=nw, eps=EPS)
    if "fp32" in extra:
        kw["out_dtype"] = torch.float32
    res = "res" in extra
    x0 = rms_norm(xs[0], nw, EPS) if "norm" in extra else xs[0]
    ref = ref_qlinear(x0, ws[0], rs[0] if res else None)
    out_bytes = 4 if "fp32" in extra else 2
    nbytes = ws[0].nbytes() + 2 * k * (1 + ("norm" in extra)) + n * (out_bytes + 2 * res)
    return MmaCase(ws, xs, rs, kw, res, ref, nbytes, nbytes / ceil["copy_GBps"] / 1e3,
                   f" +{extra}" if extra else "")  # fmt: skip


def mma_after_rmsnorm(x, w, *, norm_weight, eps, pdl=False, **kw):
    """rmsnorm kernel, then qgemv_mma on the normed row: one launch more, but the statistics
    once instead of in each of the (7,760 for the lm_head) programs."""
    return qgemv_mma(rmsnorm(x, norm_weight, eps), w, pdl=pdl, **kw)


def gemv_mma_rows(ceil: dict, gen: torch.Generator) -> list[dict]:
    """qgemv_mma (tensor cores) against qgemv (FMA) on the decode shapes, table tiles with
    and without PDL, then qgemv_mma tile variants; every row checked against the fp32
    reference first. In a graph of PDL calls each kernel overlaps its predecessor's tail,
    which is what the decode step sees."""
    rows: list[dict] = []
    nw = norm_weight(gen)
    for name, n, k, extra in MMA_SHAPES:
        c = mma_case(n, k, extra, nw, ceil, gen)
        ws, xs, rs, kw, res = c.ws, c.xs, c.rs, c.kw, c.res
        variants = [
            ("qgemv", qgemv, None, False),
            ("qgemv", qgemv, None, True),
            ("qgemv_mma", qgemv_mma, None, False),
            ("qgemv_mma", qgemv_mma, None, True),
        ]
        if "norm" in extra:  # the norm once (its own launch) instead of in every program
            variants.append(("rmsnorm + qgemv_mma", mma_after_rmsnorm, None, True))
        variants += [("qgemv_mma", qgemv_mma, c, False) for c in MMA_SWEEP.get(name, [])]
        for op, fn, cfg, pdl in variants:
            used = cfg or (
                gemv_config(n, k, 1, 4, 64) if fn is qgemv else mma_gemv_config(n, k, 64)
            )
            base = {
                "op": op,
                "shape": name + c.suffix,
                "N": n,
                "K": k,
                "bits": 4,
                "T": 1,
                "config": "table " * (cfg is None) + cfg_str(used) + " pdl" * pdl,
            }
            ckw = {**kw, "pdl": pdl} | ({"config": cfg} if cfg is not None else {})

            def call(x, w, r, fn=fn, ckw=ckw, res=res):
                return fn(x, w, residual=r if res else None, **ckw)

            calls = [partial(call, x, w, r) for w, x, r in zip(ws, xs, rs, strict=True)]
            check = partial(call, xs[0], ws[0], rs[0])
            attempt(rows, base, partial(gemv_point, calls, check, c.ref, c.nbytes, c.floor_us))
        del ws, c
    return rows


def size_floor_rows(name: str, ws: list[QuantWeight], nbytes: float, ceil: dict) -> list[dict]:
    """What one kernel reading this many bytes reaches in the same harness (a graph of calls
    over the same distinct buffers): torch's copy of the packed words (read + write) and
    torch's sum of them (read only)."""
    rows: list[dict] = []
    flats = [w.qweight.view(-1) for w in ws]
    dsts = [torch.empty_like(f) for f in flats]
    wbytes = flats[0].numel() * 4
    copies = [partial(d.copy_, f) for d, f in zip(dsts, flats, strict=True)]
    for label, calls, moved in (
        ("torch copy (read+write)", copies, 2),
        ("torch sum (read)", [partial(torch.sum, f) for f in flats], 1),
    ):
        base = {"op": "size floor", "shape": name, "config": label}

        def point(calls=calls, moved=moved):
            us = graph_ms(calls) * 1e3
            gbps = moved * wbytes / us / 1e3
            return {"us": us, "GBps": gbps, "frac_copy": gbps / ceil["copy_GBps"],
                    "gemv_bytes_us": nbytes / gbps / 1e3}  # fmt: skip

        attempt(rows, base, point)
    return rows


def floor_rows(ceil: dict, gen: torch.Generator) -> list[dict]:
    """qgemv_mma with PDL in graphs of back-to-back calls over distinct weights (HBM) and
    over one weight (L2-resident: the kernel's time without DRAM), next to the size floors
    (what one torch kernel moving this many bytes reaches in the same harness)."""
    rows: list[dict] = []
    nw = norm_weight(gen)
    for name, n, k, extra in MMA_SHAPES:
        if n > 20000:
            continue  # the lm_head streams long enough to pass
        c = mma_case(n, k, extra, nw, ceil, gen)
        ws, xs, rs = c.ws, c.xs, c.rs
        shape = name + c.suffix

        def call(x, w, r, res=c.res, kw=c.kw):
            return qgemv_mma(x, w, residual=r if res else None, pdl=True, **kw)

        variants = {
            "pdl": [partial(call, x, w, r) for w, x, r in zip(ws, xs, rs, strict=True)],
            "pdl, one weight (L2)": [partial(call, x, ws[0], r)
                                     for x, r in zip(xs, rs, strict=True)],
        }  # fmt: skip
        for label, calls in variants.items():
            base = {"op": "qgemv_mma", "shape": shape, "config": label}
            check = partial(call, xs[0], ws[0], rs[0])
            attempt(rows, base, partial(gemv_point, calls, check, c.ref, c.nbytes, c.floor_us))
        rows += size_floor_rows(shape, ws, c.nbytes, ceil)
        del ws, c
    return rows


# ------------------------------------------------------------------------------ GEMM


def gemm_point(cfg, x, w, ref, flop: float, floor_us: float) -> dict:
    err = rel(qgemm(x, w, config=cfg), ref)
    us = bench_ms(partial(qgemm, x, w, config=cfg)) * 1e3
    return {"rel_err": err, "us": us, "TFLOPs": flop / us / 1e6, "floor_us": floor_us,
            "of_floor": floor_us / us}  # fmt: skip


def torch_mm_point(x, wd, flop: float, floor_us: float) -> dict:
    us = bench_ms(lambda: x @ wd.T) * 1e3
    return {"us": us, "TFLOPs": flop / us / 1e6, "floor_us": floor_us}


def gemm_rows(ceil: dict, gen: torch.Generator) -> list[dict]:
    rows: list[dict] = []
    for name, n, k in GEMM_SHAPES:
        w = rand_qweight((n, k), 4, gen)
        wd = dequantize(w, BF16)
        for t in GEMM_T:
            x = torch.randn(t, k, generator=gen, device=DEV).to(BF16)
            ref = ref_qlinear(x, w)
            flop = 2 * t * n * k
            nbytes = w.nbytes() + 2 * t * (n + k)
            floor_us = max(flop / ceil["bf16_matmul_TFLOPs"] / 1e6,
                           nbytes / ceil["copy_GBps"] / 1e3)  # fmt: skip
            extra = GEMM_SWEEP if t == 2048 else GEMM_SMALL if t <= 512 else []
            for cfg in [None] + extra:
                used = cfg or gemm_config(t, n, k, 64)
                base = {"op": "qgemm", "shape": name, "N": n, "K": k, "T": t,
                        "config": "table " * (cfg is None) + cfg_str(used)}  # fmt: skip
                attempt(rows, base, partial(gemm_point, cfg, x, w, ref, flop, floor_us))
            base = {"op": "torch bf16 mm", "shape": name, "N": n, "K": k, "T": t,
                    "config": "dense bf16 weight"}  # fmt: skip
            attempt(rows, base, partial(torch_mm_point, x, wd, flop, floor_us))
    return rows


# ------------------------------------------------------------------------------ MoE


def moe_weights(gen: torch.Generator) -> dict:
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
    return sum(w[p][0].nbytes() for p in ("gate", "up", "down"))


def fixed_bytes(w: dict) -> int:
    parts = ("router", "shared_gate", "shared_up", "shared_down", "shared_expert_gate")
    return sum(w[p].nbytes() for p in parts)


def decode_point(calls: list, check, ref, nbytes: float, floor_us: float) -> dict:
    err = rel(check(), ref)
    us = graph_ms(calls) * 1e3
    return {"rel_err": err, "us": us, "GBps": nbytes / us / 1e3, "of_copy": floor_us / us,
            "floor_us": floor_us, "kernels_us": kernel_times(calls[0], key_width=48)}  # fmt: skip


def decode_replay(args, xs, rs, nw) -> dict:
    """Captured once (with PDL), replayed on a new token written into the captured input."""
    x, r = xs[1].clone(), rs[1].clone()
    graph, out = capture_graph(lambda: moe_decode(x, *args, TOP_K, r, norm_weight=nw, pdl=True))
    x.copy_(xs[2])
    r.copy_(rs[2])
    graph.replay()
    torch.cuda.synchronize()
    return {"rel_err": rel(out, ref_moe(rms_norm(xs[2], nw, EPS), *args, TOP_K, rs[2]))}


def moe_decode_rows(ceil: dict, w: dict, gen: torch.Generator) -> list[dict]:
    rows: list[dict] = []
    xs = [torch.randn(D, generator=gen, device=DEV).to(BF16) for _ in range(GEMV_GRAPH_CALLS)]
    rs = [torch.randn(D, generator=gen, device=DEV).to(BF16) for _ in xs]
    nw = norm_weight(gen)
    args = list(w.values())
    ref = ref_moe(xs[0], *args, TOP_K, rs[0])
    # Every token touches the router, the shared expert and TOP_K distinct experts.
    nbytes = fixed_bytes(w) + TOP_K * expert_bytes(w) + 6 * D
    floor_us = nbytes / ceil["copy_GBps"] / 1e3
    shape = "E256 I512 top8 +shared"
    for cfg in DECODE_CFGS:
        base = {"op": "moe_decode", "shape": shape, "T": 1,
                "config": "table " * (cfg is None) + cfg_str(cfg or MoeDecodeConfig())}  # fmt: skip
        calls = [partial(moe_decode, x, *args, TOP_K, r, config=cfg)
                 for x, r in zip(xs, rs, strict=True)]  # fmt: skip
        check = partial(moe_decode, xs[0], *args, TOP_K, rs[0], config=cfg)
        attempt(rows, base, partial(decode_point, calls, check, ref, nbytes, floor_us))
    # The layer's post-attention norm: fused into the MoE launches, or torch's 7 ops first.
    ref_n = ref_moe(rms_norm(xs[0], nw, EPS), *args, TOP_K, xs[0])
    variants = {
        "fused norm": lambda x: moe_decode(x, *args, TOP_K, x, norm_weight=nw, eps=EPS),
        "fused norm pdl": lambda x: moe_decode(
            x, *args, TOP_K, x, norm_weight=nw, eps=EPS, pdl=True
        ),
        "rms_norm + moe_decode": lambda x: moe_decode(rms_norm(x, nw, EPS), *args, TOP_K, x),
    }
    for label, fn in variants.items():
        base = {"op": "moe_decode+norm", "shape": shape, "T": 1, "config": label}
        calls = [partial(fn, x) for x in xs]
        attempt(rows, base, partial(decode_point, calls, partial(fn, xs[0]), ref_n, nbytes,
                                    floor_us))  # fmt: skip
    base = {"op": "moe_decode", "shape": "graph replay, new token", "T": 1,
            "config": "table, norm, pdl"}  # fmt: skip
    attempt(rows, base, partial(decode_replay, args, xs, rs, nw))
    return rows


def chain_point(w: dict, gen: torch.Generator, pdl: bool) -> dict:
    """A decode layer's linear part over CHAIN_LAYERS layers of distinct projection weights:
    fused-norm qkv|z|b|a GEMV, out_proj GEMV with the residual (its input a stand-in slice
    for the mixer's output), fused-norm MoE. One graph; the mixers are not included. Checked
    against the same chain through the references (fp32)."""
    proj = [rand_qweight((CHAIN_PROJ, D), 4, gen) for _ in range(CHAIN_LAYERS)]
    outp = [rand_qweight((D, CHAIN_O), 4, gen) for _ in range(CHAIN_LAYERS)]
    nw = norm_weight(gen)
    args = list(w.values())
    x0 = torch.randn(D, generator=gen, device=DEV).to(BF16)

    def layers(x, n: int = CHAIN_LAYERS):
        for p, o in zip(proj[:n], outp[:n], strict=True):
            y = qgemv(x, p, norm_weight=nw, eps=EPS, pdl=pdl)
            x = qgemv(y[-CHAIN_O:], o, residual=x, pdl=pdl)
            x = moe_decode(x, *args, TOP_K, x, norm_weight=nw, eps=EPS, pdl=pdl)
        return x

    def reference(x, n: int):
        for p, o in zip(proj[:n], outp[:n], strict=True):
            y = ref_qlinear(rms_norm(x, nw, EPS), p).to(BF16)
            x = ref_qlinear(y[-CHAIN_O:], o, x).to(BF16)
            x = ref_moe(rms_norm(x, nw, EPS), *args, TOP_K, x).to(BF16)
        return x

    # Two layers only: bf16 rounding and router near-ties make longer chains drift apart.
    err = rel(layers(x0, 2), reference(x0, 2))
    us = graph_ms([partial(layers, x0)]) * 1e3 / CHAIN_LAYERS
    nbytes = proj[0].nbytes() + outp[0].nbytes() + fixed_bytes(w) + TOP_K * expert_bytes(w)
    return {"rel_err": err, "us": us, "launches": 5, "GBps": nbytes / us / 1e3,
            "kernels_us": kernel_times(partial(layers, x0))}  # fmt: skip


def skewed_router(gen: torch.Generator, hot: int = 4) -> tuple[QuantWeight, torch.Tensor]:
    """A router whose ``hot`` experts every token prefers, and the direction that does it."""
    u = torch.randn(D, generator=gen, device=DEV)
    u = u / u.norm()
    r = torch.randn(E, D, generator=gen, device=DEV) / D**0.5
    r[:hot] += 3.0 * u
    return quantize(r, 8, 64), u


def prefill_point(cfg, atomic, x, a, res, ref, t, flop, floor_us, extra: bool) -> dict:
    fn = partial(moe_prefill, x, *a, TOP_K, res, atomic=atomic, config=cfg)
    err = rel(fn(), ref) if ref is not None else None
    us = bench_ms(fn) * 1e3
    row = {"rel_err": err, "us": us, "TFLOPs": flop / us / 1e6, "floor_us": floor_us,
           "of_floor": floor_us / us, "tok_per_s_layer": t / us * 1e6}  # fmt: skip
    if extra:  # GPU time without the host (graph) and the device time of each launch
        row["graph_us"] = graph_ms([fn]) * 1e3
        row["kernels_us"] = kernel_times(fn)
    return row


def moe_prefill_rows(ceil: dict, w: dict, gen: torch.Generator) -> list[dict]:
    rows: list[dict] = []
    args = list(w.values())
    skew_router, u = skewed_router(gen)
    for t in PREFILL_T:
        for routing in ("uniform", "skewed"):
            x = torch.randn(t, D, generator=gen, device=DEV)
            a = list(args)
            if routing == "skewed":
                x = x + 2.0 * u
                a[0] = skew_router
            x = x.to(BF16)
            res = torch.randn(t, D, generator=gen, device=DEV).to(BF16)
            _, ids = ref_route(ref_qlinear(x, a[0]), TOP_K)
            counts = torch.bincount(ids.flatten(), minlength=E)
            load = {"max": int(counts.max()), "median": float(counts.float().median()),
                    "empty": int((counts == 0).sum()), "mean": t * TOP_K / E}  # fmt: skip
            flop = 2 * t * (E * D + TOP_K * 3 * D * I_E + 3 * D * I_S)
            nbytes = fixed_bytes(w) + int((counts > 0).sum()) * expert_bytes(w) + 6 * t * D
            floor_us = max(flop / ceil["bf16_matmul_TFLOPs"] / 1e6,
                           nbytes / ceil["copy_GBps"] / 1e3)  # fmt: skip
            ref = ref_moe(x, *a, TOP_K, res) if t == CHECK_T or routing == "skewed" else None
            # The table's tile (with and without the atomic combine), then each token tile.
            points = [(None, False), (None, True)]
            points += [(bm, False) for bm in PREFILL_BM if routing == "uniform"]
            for bm, atomic in points:
                cfg = moe_prefill_config(t, TOP_K, E)
                if bm is not None:
                    tiles = moe_prefill_config(bm * E // TOP_K, TOP_K, E)
                    cfg = MoePrefillConfig(bm, tiles.gate_up, tiles.down)
                name = ("table " if bm is None else "") + ("atomic " if atomic else "")
                base = {"op": "moe_prefill", "shape": routing, "T": t, "load": load,
                        "config": name + cfg_str(cfg)}  # fmt: skip
                extra = bm is None and not atomic and routing == "uniform" and t <= 512
                point = partial(prefill_point, cfg, atomic, x, a, res, ref, t, flop, floor_us,
                                extra)  # fmt: skip
                attempt(rows, base, point)
    base = {"op": "moe_prefill", "shape": f"chunks {STRESS_T}, NaN tokens, skewed",
            "T": STRESS_T[0], "config": "table"}  # fmt: skip
    attempt(rows, base, partial(prefill_stress, w, gen))
    return rows


def prefill_stress(w: dict, gen: torch.Generator) -> dict:
    """Chunks in a row as a long prefill runs them, skewed routing, a few NaN/inf tokens:
    no error, NaN rows NaN, the other rows finite and (on a sample) equal to the reference."""
    a = list(w.values())
    a[0], u = skewed_router(gen, hot=2)
    t0 = time.time()
    worst = 0.0
    for t in STRESS_T:
        x = (torch.randn(t, D, generator=gen, device=DEV) + 2.0 * u).to(BF16)
        bad = torch.tensor([0, t // 2 - 1, t // 2, t - 1], device=DEV)
        x[bad[:3]] = float("nan")
        x[bad[3], 7] = float("inf")
        y = moe_prefill(x, *a, TOP_K, x)
        torch.cuda.synchronize()
        good = torch.ones(t, dtype=torch.bool, device=DEV)
        good[bad] = False
        if not torch.isfinite(y[good]).all() or not torch.isnan(y[bad[:3]]).all():
            raise RuntimeError(f"T={t}: NaN rows leaked into other tokens or vanished")
        sample = good.nonzero()[:64, 0]
        worst = max(worst, rel(y[sample], ref_moe(x[sample], *a, TOP_K, x[sample])))
    return {"rel_err": worst, "us": (time.time() - t0) * 1e6}


def zero_qweight(shape: tuple[int, ...], bits: int, gs: int = 64) -> QuantWeight:
    *lead, n, k = shape
    return QuantWeight(
        torch.zeros(*lead, n, k * bits // 32, dtype=torch.int32),
        torch.zeros(*lead, n, k // gs, dtype=BF16), torch.zeros(*lead, n, k // gs, dtype=BF16),
        bits, gs,
    )  # fmt: skip


@contextlib.contextmanager
def pdl_forced():
    """PDL switched on for CPU tensors (compile-only: the launches are intercepted)."""
    import lily.ops.moe_decode as md
    import lily.ops.qgemv as qg
    import lily.ops.qgemv_mma as qm

    saved = md.use_pdl, qg.use_pdl, qm.use_pdl
    md.use_pdl = qg.use_pdl = qm.use_pdl = lambda pdl, device: pdl
    try:
        yield
    finally:
        md.use_pdl, qg.use_pdl, qm.use_pdl = saved


def compile_report(only: set[str], sass_dir: str | None = None) -> list[dict]:
    """No GPU: compile every configuration the bench times (in the sections of ``only``)
    for sm_90 and read what ptxas gave each kernel (registers, stack bytes = spills, warpgroup
    and warp MMAs and the instruction count of the SASS, with PDL the part after the wait;
    qgemv_mma also per 4-bit code).

    The public functions run on CPU tensors of the real shapes with every kernel launch
    intercepted, so each kernel sees the arguments its launcher passes (ON_CPU forced off).
    """
    import re
    import tempfile
    from pathlib import Path

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    from lily.ops.launch import Launched

    launches: list = []
    real_getitem, real_launch = JITFunction.__getitem__, Launched.launch
    JITFunction.__getitem__ = lambda fn, grid: lambda *a, **kw: launches.append((fn, a, kw))
    # Launched's fast path asks CUDA for the device: send every launch to the JIT function.
    Launched.launch = lambda self, grid, args, kwargs: self.fn[grid](*args, **kwargs)
    try:
        x = torch.zeros(2048, dtype=BF16)
        nw = torch.ones(2048, dtype=BF16)
        if only & {"gemv", "fused"}:
            for name, n, k, bits in GEMV_SHAPES:
                n_model = n
                n = min(n, 65536)  # the lm_head's table tile is the same from 65536 rows
                for cfg in [None] + GEMV_OLD.get(name, []) + GEMV_SWEEP.get(name, []):
                    cfg = cfg or gemv_config(n_model, k, 1, bits, 64)
                    launches.append(f"{name} {cfg_str(cfg)}")
                    qgemv(torch.zeros(k, dtype=BF16), zero_qweight((n, k), bits), config=cfg)
            for name, n, k in FUSED_SHAPES:
                cfg = gemv_config(n, k, 1, 4, 64)
                launches.append(f"{name} +norm {cfg_str(cfg)}")
                qgemv(x, zero_qweight((min(n, 65536), k), 4), norm_weight=nw, config=cfg)
            launches.append("out_proj +residual")
            qgemv(torch.zeros(4096, dtype=BF16), zero_qweight((D, 4096), 4), residual=x)
            for t in (2, 4, 8):
                launches.append(f"rows T={t}")
                qgemv(torch.zeros(t, ROWS_SHAPE[1], dtype=BF16), zero_qweight(ROWS_SHAPE, 4))
        if "gemm" in only:
            for name, n, k in GEMM_SHAPES:
                for cfg in [gemm_config(t, n, k, 64) for t in GEMM_T] + GEMM_SWEEP + GEMM_SMALL:
                    launches.append(f"{name} {cfg_str(cfg)}")
                    qgemm(
                        torch.zeros(cfg.block_m, k, dtype=BF16), zero_qweight((n, k), 4), config=cfg
                    )
        w = {"router": zero_qweight((E, D), 8), "gate": zero_qweight((E, I_E, D), 4),
             "up": zero_qweight((E, I_E, D), 4), "down": zero_qweight((E, D, I_E), 4),
             "shared_gate": zero_qweight((I_S, D), 4), "shared_up": zero_qweight((I_S, D), 4),
             "shared_down": zero_qweight((D, I_S), 4),
             "shared_expert_gate": zero_qweight((1, D), 8)}  # fmt: skip
        args = list(w.values())
        if "moe_decode" in only:
            for cfg in DECODE_CFGS:
                for norm in (None, nw):
                    label = "+norm " * (norm is not None) + cfg_str(cfg or MoeDecodeConfig())
                    launches.append(f"moe_decode {label}")
                    moe_decode(x, *args, TOP_K, x, norm_weight=norm, config=cfg)
        if only & {"gemv", "fused", "moe_decode"}:
            # PDL (no-op on CPU tensors): forced on so griddepcontrol is assembled for sm_90.
            with pdl_forced():
                launches.append("moe_decode +norm pdl")
                moe_decode(x, *args, TOP_K, x, norm_weight=nw, pdl=True)
                launches.append("dn qkv|z|b|a +norm pdl")
                qgemv(x, zero_qweight((12352, D), 4), norm_weight=nw, pdl=True)
        if "moe_prefill" in only:
            for t in PREFILL_T:
                for bm in (None, *PREFILL_BM):
                    cfg = moe_prefill_config(t if bm is None else bm * E // TOP_K, TOP_K, E)
                    for atomic in (False, True):
                        launches.append(f"moe_prefill T={t} {'atomic ' * atomic}{cfg_str(cfg)}")
                        xt = torch.zeros(t, D, dtype=BF16)
                        moe_prefill(xt, *args, TOP_K, xt, atomic=atomic, config=cfg)
        if "gemv_mma" in only:
            for name, n, k, extra in MMA_SHAPES:
                kw = {"norm_weight": nw} if "norm" in extra else {}
                if "res" in extra:
                    kw["residual"] = torch.zeros(n, dtype=BF16)
                if "fp32" in extra:
                    kw["out_dtype"] = torch.float32
                xk = torch.zeros(k, dtype=BF16)
                for cfg in [mma_gemv_config(n, k, 64)] + MMA_SWEEP.get(name, []):
                    launches.append(f"{name} {extra} {cfg_str(cfg)}")
                    qgemv_mma(xk, zero_qweight((min(n, 65536), k), 4), config=cfg, **kw)
            with pdl_forced():
                launches.append("dn qkv|z|b|a norm pdl")
                qgemv_mma(x, zero_qweight((12352, D), 4), norm_weight=nw, pdl=True)
                launches.append("o_proj/out_proj res pdl")
                qgemv_mma(torch.zeros(4096, dtype=BF16), zero_qweight((D, 4096), 4),
                          residual=x, pdl=True)  # fmt: skip
    finally:
        JITFunction.__getitem__, Launched.launch = real_getitem, real_launch

    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    types = {BF16: "*bf16", torch.float32: "*fp32", torch.int32: "*i32", torch.int64: "*i64"}
    rows, seen, label = [], set(), ""
    for item in launches:
        if isinstance(item, str):
            label = item
            continue
        fn, a, kw = item
        const = {k: v for k, v in kw.items() if k in fn.arg_names}
        if "ON_CPU" in const:
            const["ON_CPU"] = False
        opts = {"num_warps": kw.get("num_warps", 4), "num_stages": kw.get("num_stages", 3)}
        if kw.get("launch_pdl"):
            opts["launch_pdl"] = True
        if kw.get("maxnreg"):
            opts["maxnreg"] = kw["maxnreg"]
        dtypes = tuple(str(v.dtype) for v in a if isinstance(v, torch.Tensor))
        key = (fn.__name__, tuple(sorted(const.items())), tuple(opts.values()), dtypes)
        if key in seen:
            continue
        seen.add(key)
        sig, attrs = {}, {}
        for i, (name, v) in enumerate(zip(fn.arg_names, a, strict=False)):
            if isinstance(v, torch.Tensor):
                sig[name], aligned = types[v.dtype], True
            else:
                sig[name] = "fp32" if isinstance(v, float) else "i32"
                aligned = isinstance(v, int) and v % 16 == 0
            if aligned:
                attrs[(i,)] = [["tt.divisibility", 16]]
        sig.update({k: "constexpr" for k in const})
        row = {"kernel": fn.__name__, "config": label, **opts}
        try:
            src = ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs)
            c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
            with tempfile.TemporaryDirectory() as tmp:
                cubin = Path(tmp) / "k.cubin"
                cubin.write_bytes(c.asm["cubin"])
                tool = str(bin_dir / "cuobjdump")
                res = subprocess.run([tool, "--dump-resource-usage", str(cubin)],
                                     capture_output=True, text=True).stdout  # fmt: skip
                sass = subprocess.run([tool, "--dump-sass", str(cubin)], capture_output=True,
                                      text=True).stdout  # fmt: skip
            if sass_dir:
                name = re.sub(r"[^\w.-]+", "_", f"{fn.__name__}_{label}")
                (Path(sass_dir) / f"{name}.sass").write_text(sass)
            m = re.search(r"REG:(\d+) STACK:(\d+)", res)
            ops = re.findall(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][\w.]*)", sass,
                             re.M)  # fmt: skip
            row |= {"regs": int(m.group(1)), "stack": int(m.group(2)),
                    "smem": c.metadata.shared, "wgmma": sass.count("HGMMA"),
                    "hmma": sass.count("HMMA."), "instr": sum(o != "NOP" for o in ops),
                    "movs": sum(o in ("MOV", "IMAD.MOV.U32") for o in ops)}  # fmt: skip
            if "ACQBULK" in ops:  # griddepcontrol.wait: what the kernel does once it may read
                after = ops[ops.index("ACQBULK") + 1 :]
                row["after_wait"] = sum(o != "NOP" for o in after)
            if "BLOCK_N" in const and "GROUP" in const and "W" in const:  # tensor-core tiles
                # codes a program multiplies: a tile, two (gate and up), or k slots of SG
                # groups (down; the shared expert's FMA tile not counted)
                tiles = 2 if "gate_up" in fn.__name__ else 1
                ng = const["NG"] if "NG" in const else const["TOP_K"] * const["SG"]
                codes = tiles * const["BLOCK_N"] * ng * const["GROUP"] / (32 * const["W"])
                row["instr_per_code"] = row["instr"] / codes
        except Exception as e:  # noqa: BLE001 - a config that does not compile is data
            row["error"] = f"{type(e).__name__}: {e}"[:ERR_CHARS]
        rows.append(row)
    return rows


# ------------------------------------------------------------------------------ report


def table(rows: list[dict], cols: list[str]) -> str:
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--sass-dir", help="with --compile-only: write each kernel's SASS here")
    ap.add_argument("--only", default="gemv,fused,gemv_mma,floors,gemm,moe_decode,moe_prefill")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="table tiles only, no sweeps")
    ap.add_argument(
        "--compile-only",
        action="store_true",
        help="no GPU: compile for sm_90 and report registers, spills, shared memory",
    )
    args = ap.parse_args()
    if args.quick:
        global GEMV_SWEEP, GEMM_SWEEP, PREFILL_BM, DECODE_CFGS, MMA_SWEEP
        GEMV_SWEEP, GEMM_SWEEP, PREFILL_BM, MMA_SWEEP = {}, [], (), {}
        DECODE_CFGS = DECODE_CFGS[:3]
    if args.compile_only:
        rows = compile_report(set(args.only.split(",")), args.sass_dir)
        print(table(rows, ["kernel", "config", "num_warps", "num_stages", "regs", "stack",
                           "smem", "wgmma", "hmma", "instr", "movs", "after_wait",
                           "instr_per_code"]))  # fmt: skip
        with open(args.out, "w") as f:
            json.dump({"compile_only": rows}, f, indent=1)
        return
    if not torch.cuda.is_available():
        sys.exit("lily/bench/gpu/kernels/linear.py needs a CUDA GPU")
    t0 = time.time()
    gen = torch.Generator(device=DEV).manual_seed(args.seed)
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                check=True).stdout.strip()  # fmt: skip
    except Exception:  # noqa: BLE001 - the device copy may have no .git
        commit = "unknown"
    result = {"device": torch.cuda.get_device_name(), "date": datetime.now(UTC).isoformat(),
              "commit": commit, "torch": torch.__version__,
              "triton": triton.__version__}  # fmt: skip
    ceil = ceilings()
    result["ceilings"] = ceil
    print(f"ceilings: {ceil}", flush=True)
    sections = {
        "gemv": (lambda: gemv_rows(ceil, gen), ["op", "shape", "T", "config", "rel_err", "us",
                                                "GBps", "of_copy"]),
        "fused": (lambda: fused_rows(ceil, gen), ["op", "shape", "T", "config", "rel_err",
                                                  "us", "GBps", "of_copy"]),
        "gemm": (lambda: gemm_rows(ceil, gen), ["op", "shape", "T", "config", "rel_err", "us",
                                                "TFLOPs", "of_floor"]),
        "gemv_mma": (lambda: gemv_mma_rows(ceil, gen), ["op", "shape", "config", "rel_err",
                                                        "us", "GBps", "of_copy"]),
        "floors": (lambda: floor_rows(ceil, gen), ["op", "shape", "config", "rel_err", "us",
                                                   "GBps", "of_copy", "frac_copy"]),
    }  # fmt: skip
    only = set(args.only.split(","))
    tables = []
    for name, (fn, cols) in sections.items():
        if name in only:
            rows = fn()
            result[name] = rows
            tables.append(f"== {name} ({time.time() - t0:.0f}s)\n" + table(rows, cols))
            print(tables[-1], flush=True)
    if only & {"moe_decode", "moe_prefill"}:
        w = moe_weights(gen)
        if "moe_decode" in only:
            rows = moe_decode_rows(ceil, w, gen)
            for pdl in (False, True):
                base = {"op": "decode chain", "shape": "qkv|z|b|a+norm, out_proj+res, moe+norm",
                        "T": 1, "config": "us per layer" + " pdl" * pdl}  # fmt: skip
                attempt(rows, base, partial(chain_point, w, gen, pdl))
            result["moe_decode"] = rows
            cols = ["op", "shape", "T", "config", "rel_err", "us", "GBps", "of_copy",
                    "kernels_us"]  # fmt: skip
            tables.append(f"== moe_decode ({time.time() - t0:.0f}s)\n" + table(rows, cols))
            print(tables[-1], flush=True)
        if "moe_prefill" in only:
            rows = moe_prefill_rows(ceil, w, gen)
            result["moe_prefill"] = rows
            cols = ["op", "shape", "T", "config", "rel_err", "us", "graph_us", "TFLOPs",
                    "of_floor", "load", "kernels_us"]  # fmt: skip
            tables.append(f"== moe_prefill ({time.time() - t0:.0f}s)\n" + table(rows, cols))
            print(tables[-1], flush=True)
    result["seconds"] = time.time() - t0
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print("\n\n".join(["==== summary", f"ceilings: {ceil}", *tables]))
    print(f"wrote {args.out} in {result['seconds']:.0f}s")


if __name__ == "__main__":
    main()
