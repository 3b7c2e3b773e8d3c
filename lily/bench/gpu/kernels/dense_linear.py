"""The dense sections of lily.bench.gpu.kernels.linear (not a script): ``gemv`` (qgemv on
the projection shapes, few rows against qgemm), ``fused`` (the RMSNorm prologue against
torch's norm first), ``gemv_mma`` (the tensor-core GEMV next to qgemv, with and without
PDL), ``floors`` (qgemv_mma over distinct weights and over one, next to torch kernels moving
the same bytes) and ``gemm`` (qgemm against the roofline and torch's bf16 matmul); each row
checked against lily.model.ref."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from lily.bench.gpu.kernels.common import (
    BF16,
    DEV,
    EPS,
    FUSED_SHAPES,
    GEMM_SHAPES,
    GEMM_SMALL,
    GEMM_T,
    GEMV_OLD,
    GEMV_SHAPES,
    MMA_SHAPES,
    ROWS_SHAPE,
    D,
    Sweeps,
    bench_ms,
    cfg_str,
    gemv_point,
    graph_ms,
    norm_weight,
    rand_qweight,
    rel,
    weight_copies,
)
from lily.bench.measure import attempt
from lily.model.norm import rms_norm
from lily.model.ref import ref_qlinear
from lily.ops.qgemm import gemm_config, qgemm
from lily.ops.qgemv import gemv_config, qgemv
from lily.ops.qgemv_mma import mma_gemv_config, qgemv_mma
from lily.ops.rmsnorm import add_rmsnorm, rmsnorm
from lily.quant import QuantWeight, dequantize

# ------------------------------------------------------------------------------ GEMV


def rows_point(fn, ref, nbytes: float) -> dict:
    err = rel(fn(), ref)
    us = bench_ms(fn) * 1e3
    return {"rel_err": err, "us": us, "GBps": nbytes / us / 1e3}


def gemv_rows(ceil: dict, gen: torch.Generator, sweeps: Sweeps) -> list[dict]:
    """qgemv on GEMV_SHAPES (the table's tile, the old table's, ``sweeps.gemv``'s) in graphs
    over weights that overflow L2, then T = 2, 4, 8 rows against qgemm."""
    rows: list[dict] = []
    for name, n, k, bits in GEMV_SHAPES:
        ws = weight_copies(n, k, bits, gen)
        xs = [torch.randn(k, generator=gen, device=DEV).to(BF16) for _ in ws]
        ref = ref_qlinear(xs[0], ws[0])
        nbytes = ws[0].nbytes() + 2 * k + 2 * n
        floor_us = nbytes / ceil["copy_GBps"] / 1e3
        for cfg in [None, *GEMV_OLD.get(name, []), *sweeps.gemv.get(name, ())]:
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


def gemv_mma_rows(ceil: dict, gen: torch.Generator, sweeps: Sweeps) -> list[dict]:
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
        variants += [("qgemv_mma", qgemv_mma, c, False) for c in sweeps.mma.get(name, ())]
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


def gemm_rows(ceil: dict, gen: torch.Generator, sweeps: Sweeps) -> list[dict]:
    """qgemm on GEMM_SHAPES at GEMM_T (the table's tile; ``sweeps.gemm`` at T = 2048, the
    small tiles at T <= 512) next to torch's bf16 matmul on the dequantized weight."""
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
            extra = sweeps.gemm if t == 2048 else GEMM_SMALL if t <= 512 else ()
            for cfg in [None, *extra]:
                used = cfg or gemm_config(t, n, k, 64)
                base = {"op": "qgemm", "shape": name, "N": n, "K": k, "T": t,
                        "config": "table " * (cfg is None) + cfg_str(used)}  # fmt: skip
                attempt(rows, base, partial(gemm_point, cfg, x, w, ref, flop, floor_us))
            base = {"op": "torch bf16 mm", "shape": name, "N": n, "K": k, "T": t,
                    "config": "dense bf16 weight"}  # fmt: skip
            attempt(rows, base, partial(torch_mm_point, x, wd, flop, floor_us))
    return rows
