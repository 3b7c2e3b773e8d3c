"""The MoE prefill's grouped fused-dequant GEMMs, portable against sm_90 (TMA), in TFLOP/s.

    lily bench --run kernels.moe_gemm -- [--tokens 4096,8192] [--configs all] [--out F.json]
    lily bench --run kernels.moe_gemm -- --compile-only [--tokens 4096,8192]

At the real shapes (E=256 experts, top-8, I=512, a shared expert of 512, D=2048, MLX 4-bit
group 64 experts, 8-bit router), random weights and tokens (near-uniform routing). For each
T and configuration (the tile table's and candidate tiles), both paths of
lily/ops/moe_prefill.py (``gemm="portable"``, ``gemm="sm90"``: lily/ops/moe_gemm_sm90.py):

- gate/up and down alone: their launches (routed and shared experts) replayed on the plan
  the call built, ``do_bench`` medians (L2 flushed between runs: the weights come from
  HBM); TFLOP/s = 2 x (T k + T) x D x I x (2 for gate/up, 1 for down) / time, against 800
  (the bar's bf16 ceiling) and the bf16 matmul rate measured here;
- the whole moe_prefill (routing, plan, GEMMs, combine) per path;
- the output against the portable path's at the table's tiles (relative L2; bf16
  products summed in another order: about 1e-3 expected).
A configuration that fails (does not compile, no shared memory) is a row with its error.
``--compile-only`` needs no GPU: every configuration compiled for sm_90 (registers, spilled
stack bytes, shared memory, TMA and wgmma counts), lily/bench/sm90_compile.py.
Prints one JSON line per row and a table at the end; ``--out`` writes them all.
"""

from __future__ import annotations

import argparse
import json

import torch

from lily.bench.gpu.kernels.linear import I_E, I_S, TOP_K, D, E, bench_ms, ceilings, moe_weights
from lily.ops.moe_prefill import MoePrefillConfig, moe_prefill, moe_prefill_config
from lily.ops.qgemm import GemmConfig as G
from lily.quant import QuantWeight

CEILING = 800.0  # TFLOP/s: the bf16 matmul ceiling of the H200
# Tiles beyond the table's, chosen from their sm_90 compiles (lily/bench/sm90_compile.py):
# every one fits shared memory with the sm90 kernels and spills under 150 bytes.
CANDIDATES = {
    "m128 n128k64 s4 | n128k128": MoePrefillConfig(128, G(128, 128, 64, 8, 4),
                                                    G(128, 128, 128, 8, 3)),
    "m128 n64k128 w4 | n64k128 w4": MoePrefillConfig(128, G(128, 64, 128, 4, 4),
                                                      G(128, 64, 128, 4, 4)),
    "m256 n64k128 | n64k64": MoePrefillConfig(256, G(256, 64, 128, 8, 3), G(256, 64, 64, 8, 3)),
}  # fmt: skip
PATHS = ("portable", "sm90")


def gemm_flop(t: int) -> dict[str, float]:
    """FLOPs of the two grouped GEMMs at T tokens (routed rows T k, shared rows T)."""
    rows = t * TOP_K * I_E + t * I_S  # (row, intermediate) products, each over D
    return {"gate_up": 2.0 * rows * D * 2, "down": 2.0 * rows * D}


def recorded(fn) -> list:
    """Run ``fn`` with the grouped GEMMs' launches recorded: [(stage, kernel, grid, args,
    kwargs)] (their tensors stay alive in the record, so the launches can be replayed)."""
    from lily.ops.launch import Launched

    real = Launched.launch
    out = []

    def spy(self, grid, args, kwargs):
        name = self.fn.__name__
        if "gate_up" in name or "down" in name:
            out.append(("gate_up" if "gate_up" in name else "down", self, grid, args, kwargs))
        return real(self, grid, args, kwargs)

    Launched.launch = spy
    try:
        fn()
    finally:
        Launched.launch = real
    return out


def replay(launches: list, stage: str):
    from lily.ops.launch import Launched

    mine = [rec[1:] for rec in launches if rec[0] == stage]

    def run():
        for kernel, grid, args, kwargs in mine:
            Launched.launch(kernel, grid, args, kwargs)

    return run


def point(t: int, name: str, cfg: MoePrefillConfig, path: str, w: list, x, res, ref,
          matmul: float) -> dict:  # fmt: skip
    row = {"T": t, "config": name, "path": path, "block_m": cfg.block_m,
           "gate_up_tile": str(cfg.gate_up), "down_tile": str(cfg.down)}  # fmt: skip
    try:
        call = lambda: moe_prefill(x, *w, TOP_K, res, config=cfg, gemm=path)  # noqa: E731
        launches = recorded(call)
        y = call().float()
        row["rel_vs_portable_table"] = float((y - ref).norm() / ref.norm())
        for stage, flop in gemm_flop(t).items():
            ms = bench_ms(replay(launches, stage))
            tf = flop / ms / 1e9
            row |= {f"{stage}_us": ms * 1e3, f"{stage}_TFLOPs": tf,
                    f"{stage}_pct_800": 100 * tf / CEILING,
                    f"{stage}_pct_matmul": 100 * tf / matmul}  # fmt: skip
        row["moe_prefill_us"] = bench_ms(call) * 1e3
    except Exception as e:  # noqa: BLE001 - a config that fails is data
        row["error"] = f"{type(e).__name__}: {e}"[:300]
    print(json.dumps(row), flush=True)
    return row


def configs(t: int, which: str) -> dict[str, MoePrefillConfig]:
    table = {"table": moe_prefill_config(t, TOP_K, E)}
    return table if which == "table" else table | CANDIDATES


def compile_only(tokens: list[int], which: str) -> list[dict]:
    """No GPU: each configuration's two GEMM kernels (both paths) compiled for sm_90."""
    from lily.bench.sm90_compile import compile_row, intercepted

    def zero(shape: tuple[int, ...], bits: int) -> QuantWeight:
        per, groups = 32 // bits, shape[-1] // 64
        q = torch.zeros(*shape[:-1], shape[-1] // per, dtype=torch.int32)
        s = torch.zeros(*shape[:-1], groups, dtype=torch.bfloat16)
        return QuantWeight(q, s, s.clone(), bits, 64)

    w = [zero((E, D), 8), zero((E, I_E, D), 4), zero((E, I_E, D), 4), zero((E, D, I_E), 4),
         zero((I_S, D), 4), zero((I_S, D), 4), zero((D, I_S), 4), zero((1, D), 8)]  # fmt: skip
    rows = []
    for t in tokens:
        x = torch.zeros(t, D, dtype=torch.bfloat16)
        for name, cfg in configs(t, which).items():
            for path in PATHS:
                with intercepted() as launches:
                    moe_prefill(x, *w, TOP_K, x, config=cfg, gemm=path)
                for fn, args, kwargs in launches:
                    if "gate_up" in fn.__name__ or "down" in fn.__name__:
                        row = compile_row(fn, args, kwargs, f"T={t} {path} {name}")
                        print(json.dumps(row), flush=True)
                        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    cols = [
        "T",
        "path",
        "config",
        "gate_up_us",
        "gate_up_TFLOPs",
        "gate_up_pct_800",
        "down_us",
        "down_TFLOPs",
        "down_pct_800",
        "moe_prefill_us",
        "rel_vs_portable_table",
    ]
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = [" | ".join(cols)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['T']} | {r['path']} | {r['config']} | ERROR {r['error'][:90]}")
        else:
            lines.append(" | ".join(fmt(r.get(c, "")) for c in cols))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="4096,8192")
    ap.add_argument("--configs", default="all", choices=("all", "table"))
    ap.add_argument("--compile-only", action="store_true", help="no GPU: sm_90 compiles")
    ap.add_argument("--out")
    args = ap.parse_args()
    tokens = [int(s) for s in args.tokens.split(",")]
    if args.compile_only:
        rows = compile_only(tokens, args.configs)
    else:
        ceil = ceilings()
        print(json.dumps({"ceilings": ceil}), flush=True)
        g = torch.Generator(device="cuda").manual_seed(0)
        w = list(moe_weights(g).values())
        rows = []
        for t in tokens:
            x = torch.randn(t, D, generator=g, device="cuda").bfloat16()
            res = torch.randn(t, D, generator=g, device="cuda").bfloat16()
            table_cfg = moe_prefill_config(t, TOP_K, E)
            ref = moe_prefill(x, *w, TOP_K, res, config=table_cfg, gemm="portable").float()
            for name, cfg in configs(t, args.configs).items():
                for path in PATHS:
                    rows.append(point(t, name, cfg, path, w, x, res, ref,
                                      ceil["bf16_matmul_TFLOPs"]))  # fmt: skip
        print(table(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
