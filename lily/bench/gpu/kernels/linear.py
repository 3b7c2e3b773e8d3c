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

This module is the command line; the sections live in dense_linear (1, 2, 5, 6) and
moe_linear (3, 4), the compile-only path in compile_report, and the shapes, the sweeps
(``--quick``'s and the full set) and the helpers in common.
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

from lily.bench.gpu.kernels.common import DEV, FULL, QUICK, ceilings, moe_weights, table
from lily.bench.gpu.kernels.compile_report import compile_report
from lily.bench.gpu.kernels.dense_linear import (
    floor_rows,
    fused_rows,
    gemm_rows,
    gemv_mma_rows,
    gemv_rows,
)
from lily.bench.gpu.kernels.moe_linear import chain_point, moe_decode_rows, moe_prefill_rows
from lily.bench.measure import attempt


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
    sweeps = QUICK if args.quick else FULL
    if args.compile_only:
        rows = compile_report(set(args.only.split(",")), sweeps, args.sass_dir)
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
    gemv_cols = ["op", "shape", "T", "config", "rel_err", "us", "GBps", "of_copy"]
    sections = {
        "gemv": (lambda: gemv_rows(ceil, gen, sweeps), gemv_cols),
        "fused": (lambda: fused_rows(ceil, gen), gemv_cols),
        "gemm": (lambda: gemm_rows(ceil, gen, sweeps), ["op", "shape", "T", "config", "rel_err",
                                                        "us", "TFLOPs", "of_floor"]),
        "gemv_mma": (lambda: gemv_mma_rows(ceil, gen, sweeps), ["op", "shape", "config",
                                                                "rel_err", "us", "GBps",
                                                                "of_copy"]),
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
            rows = moe_decode_rows(ceil, w, gen, sweeps)
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
            rows = moe_prefill_rows(ceil, w, gen, sweeps)
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
