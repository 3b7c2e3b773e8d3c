"""The batched step's attention (attention_decode_rows over B rows) by split size, against
its byte floor.

B rows (one token each) at the model's shapes (16 query heads over 2 KV heads, Dh 256), each
over its own K/V caches filled to about ``--context`` rows (row r: 31 r fewer, as requests
of different lengths), in a graph built for ``--max-len`` (the runner's context bucket: a
4K prompt decodes in the 8,192 bucket). Per (split, num_warps, num_stages) the call of
each of 10 layers (distinct caches) is captured in one CUDA graph and replayed (triton's
do_bench, median); the figure is the time a layer. The floor is the K/V rows a layer reads
at the copy rate measured here. Each line is first checked row by row against the fp32
reference (lily.model.ref ref_attention): ``rel_err`` is the worst row's.

    lily bench --run kernels.attention_rows -- --rows 8,4 --out $OUT/attention_rows.json
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from lily.bench.gpu.kernels.common import DEV, graph_call_ms, rel, sweep_start, write_json
from lily.bench.gpu.kernels.mixer_attention import (
    ATTN_LAYERS,
    DH,
    HKV,
    THETA,
    R,
    attn_args,
    attn_inputs,
)
from lily.model.ref import ref_attention
from lily.ops.attention_decode import attention_decode_rows, default_split, kv_table
from lily.ops.norm_rope import rope_inv_freq

SPLITS = (64, 128, 256, 512, 1024)
TILES = [(4, 2), (4, 3), (8, 2)]  # (num_warps, num_stages); attention_decode_rows' first
ERR_BOUND = 2e-2  # the decode kernels' bf16 bound (tests/ops/test_attention_ops.py)


def lengths(b: int, context: int) -> list[int]:
    """Row r's cached rows before the new token: ``context - 31 r`` (at least 1)."""
    return [max(1, context - 31 * r) for r in range(b)]


class Layer:
    """One layer's B rows: stacked projections, each row's caches, their table."""

    def __init__(self, b: int, context: int, max_len: int, gen: torch.Generator):
        self.rows = [attn_inputs(1, max_len, gen, n) for n in lengths(b, context)]
        r0 = self.rows[0]
        for d in self.rows:  # (one layer's norm weights serve every row)
            d["q_norm"], d["k_norm"] = r0["q_norm"], r0["k_norm"]
        self.qg, self.k, self.v = (torch.cat([d[n] for d in self.rows]) for n in ("qg", "k", "v"))
        self.q_norm, self.k_norm = r0["q_norm"], r0["k_norm"]
        self.table = kv_table([(d["k_cache"], d["v_cache"]) for d in self.rows], DEV)
        self.pos = torch.tensor(lengths(b, context), device=DEV, dtype=torch.int32)

    def call(self, inv_freq, max_len: int, **kw) -> torch.Tensor:
        return attention_decode_rows(self.qg, self.k, self.v, self.q_norm, self.k_norm,
                                     self.table, self.rows[0]["k_cache"], self.pos, inv_freq,
                                     max_len=max_len, **kw)  # fmt: skip

    def refs(self) -> list[torch.Tensor]:
        """Each row's fp32 reference output (on copies of its caches)."""
        return [ref_attention(*attn_args(d), int(p), R, THETA)[0][0]
                for d, p in zip(self.rows, self.pos.tolist(), strict=True)]  # fmt: skip


def point(layers: list[Layer], refs, inv_freq, max_len: int, kw: dict, nbytes: int,
          copy_gbs: float) -> dict:  # fmt: skip
    out = layers[0].call(inv_freq, max_len, **kw)
    err = max(rel(out[r], ref) for r, ref in enumerate(refs))

    def step():
        for x in layers:
            x.call(inv_freq, max_len, **kw)

    us = graph_call_ms(step) * 1e3 / len(layers)
    gbs = nbytes / us / 1e3
    return {"us": round(us, 2), "GBps": round(gbs, 1), "frac_copy": round(gbs / copy_gbs, 3),
            "rel_err": err}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="8,4", help="batch sizes, comma-separated")
    ap.add_argument("--context", type=int, default=4200, help="cached rows of row 0")
    ap.add_argument("--max-len", type=int, default=8192, help="the graph's context bucket")
    ap.add_argument("--max-seconds", type=float, default=None)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    rows = [int(b) for b in args.rows.split(",")]
    if args.context >= args.max_len:
        sys.exit(f"--context {args.context} must be below --max-len {args.max_len}")
    t0, gen, ceil = sweep_start("attention_rows")
    copy_gbs = ceil["copy_GBps"]
    inv_freq = rope_inv_freq(R, THETA, DEV)
    lines: list[dict] = []
    default = default_split(args.max_len)
    for b in rows:
        layers = [Layer(b, args.context, args.max_len, gen) for _ in range(ATTN_LAYERS)]
        refs = layers[0].refs()
        nbytes = sum(2 * HKV * (n + 1) * DH * 2 for n in lengths(b, args.context))
        floor_us = nbytes / copy_gbs / 1e3
        for split in SPLITS:
            for warps, stages in TILES:
                if args.max_seconds and time.perf_counter() - t0 > args.max_seconds:
                    break
                kw = {"split": split, "num_warps": warps, "num_stages": stages}
                line = {"B": b, "split": split, "num_warps": warps, "num_stages": stages,
                        "default": (split, warps, stages) == (default, 4, 2),
                        "floor_us": round(floor_us, 2)}  # fmt: skip
                try:
                    line |= point(layers, refs, inv_freq, args.max_len, kw, nbytes, copy_gbs)
                except Exception as e:  # noqa: BLE001 - a tile that does not run is a line
                    line["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                lines.append(line)
                print(f"B={b} split {split:5d} w{warps} s{stages}: " + (
                    line.get("error") or f"{line['us']:7.2f} us a layer ({line['GBps']:.0f} "
                    f"GB/s, floor {floor_us:.2f}) err {line['rel_err']:.1e}"
                    + (" (default)" if line["default"] else "")), flush=True)  # fmt: skip
                write_json(args.out, {"args": vars(args), "copy_GBps": copy_gbs, "lines": lines})
        ok = [x for x in lines if x["B"] == b and "us" in x and x["rel_err"] < ERR_BOUND]
        if ok:
            top = min(ok, key=lambda x: x["us"])
            was = next((x["us"] for x in ok if x["default"]), float("nan"))
            print(
                f"best B={b}: split {top['split']} w{top['num_warps']} s{top['num_stages']} "
                f"{top['us']:.2f} us a layer against the default's {was:.2f}",
                flush=True,
            )
        del layers
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
