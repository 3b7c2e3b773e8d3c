"""moe_prefill between 16 and 52 rows per expert: the table's tiles against the 64-row
tile and two others (full-size shapes, uniform routing); output bits against the table's
and the median time of a layer. Writes JSON to --out."""

from __future__ import annotations

import argparse
import json

import torch

from lily.bench.gpu.kernels.common import TOP_K, D, bench_ms, moe_weights
from lily.ops.moe_prefill import MoePrefillConfig, moe_prefill, moe_prefill_config
from lily.ops.qgemm import GemmConfig as G

CANDIDATES = {
    "m64": MoePrefillConfig(64, G(64, 64, 64, 4, 4), G(64, 128, 64, 8, 3)),
    "m32n128": MoePrefillConfig(32, G(32, 128, 64, 4, 4), G(32, 128, 64, 4, 4)),
    "m64k128": MoePrefillConfig(64, G(64, 64, 128, 4, 4), G(64, 64, 128, 4, 4)),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="512,768,1128,1400,1664")
    ap.add_argument("--out")
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    w = list(moe_weights(g).values())
    rows = []
    for t in [int(s) for s in args.tokens.split(",")]:
        x = torch.randn(t, D, generator=g, device="cuda").bfloat16()
        res = torch.randn(t, D, generator=g, device="cuda").bfloat16()
        table = moe_prefill_config(t, TOP_K, 256)
        ref = moe_prefill(x, *w, TOP_K, res, config=table).float()
        for name, cfg in {"table": table, **CANDIDATES}.items():

            def run(cfg=cfg, x=x, res=res):
                return moe_prefill(x, *w, TOP_K, res, config=cfg)

            y = run().float()
            err = float((y - ref).norm() / ref.norm())
            r = {"T": t, "rows_per_expert": t * TOP_K / 256, "config": name, "tile": str(cfg),
                 "rel_vs_table": err, "ms": bench_ms(run)}  # fmt: skip
            print(json.dumps(r), flush=True)
            rows.append(r)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
