"""The batched step's MoE (moe_decode over B rows; moe_decode_rows) against the byte floor.

B = 1, 2, 4, 8, 16 rows (one token each) at the model's shapes.

Run on the GPU (about 2 minutes, most of it compiling and making 4 layers of weights):

    lily bench --run kernels.moe_rows -- --out $OUT/moe_rows.json

Per B, each path is a CUDA graph of one MoE per layer over ``--layers`` layers of distinct
random weights (1.8 GB at 4: each call streams its experts from HBM, as a decode step
does, not from L2), replayed back to back and timed with CUDA events; the figure is the
time a layer. Paths:
- ``moe_decode_rows``: the batched kernel, the post-attention norm fused, PDL (ROWS_MOE);
- ``rmsnorm+moe_prefill``: what the batched step ran before: an rmsnorm launch, then the
  prefill MoE with the next layer's norm in its last launch;
- ``moe_decode``: the one-row kernel (B = 1: the single-sequence step), ``moe_decode
  x B``: B one-row calls in a row (no expert shared between rows), and ``moe_decode rows``:
  one call over the B rows, each launch's grid once a row, on the tile the batched step
  takes (lily/model/ops.py MOE_ROWS_CONFIGS; MoeDecodeConfig's defaults without an entry).
The floor is the bytes a layer must read (router, shared expert and its gate, each distinct
expert chosen by the rows once, the rows in and out) at the copy rate measured here;
``distinct`` the experts the rows actually chose (the reference router, the mean over the
layers), ``expected`` the mean under uniform random routing, E (1 - (1 - k/E)^B).
Every path is checked against the reference MoE of each row (``rel_err``, the worst row).

``--variants`` (B >= 2): ``moe_decode rows`` on other tiles, each line's ``sweep``:
``mma``, the tensor-core tile (mma_rows 16/32/64 x mma_warps 4/8/16, gate/up and down
alike); ``router``, the first launch's router_rows, shared_rows or num_warps (one field at a
time); ``route``, route_once (the router launch routes each row once) on the table's tile
and on a few tensor-core tiles; ``combined``, the fastest gate/up tile, down tile
(mma_down_rows/warps) and first launch of those lines, each by its own kernel's time
(``kernels_us``), together.
gate_up_rows, down_rows and down_warps belong to the FMA kernels (8-bit experts): not
swept. A tile the compile matrix would reject on this GPU (lily/ops/matrix.py: registers,
spills past its limit) is skipped with the reason (``skipped``); where it rejects one of
the two tensor-core launches alone, the other's tile is timed with that launch on the
table's tile. Per B the fastest tile within ERR_BOUND is printed beside the table's, with
its MOE_ROWS_CONFIGS entry (``best``). The sweep's rules: kernels/moe_rows_sweep.py.
``--sweep-only``: the ``moe_decode rows`` lines alone; ``--kinds route,router``: those
sweeps alone. The JSON is rewritten after every
line, and ``--max-seconds`` starts no line past that time, so a run stopped early keeps
what it measured. The sweep (B in the order given; about 2 minutes, most of it compiling):

    lily bench --run kernels.moe_rows -- --variants --sweep-only --rows 8,4,16,2 \\
        --max-seconds 200 --out $OUT/moe_rows_sweep.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from functools import partial

import torch

from lily.bench.gpu.kernels.common import (
    BF16,
    DEV,
    EPS,
    TOP_K,
    D,
    E,
    ceilings,
    cfg_str,
    compile_problems,
    expert_bytes,
    fixed_bytes,
    moe_weights,
    norm_weight,
    rel,
    sweep_args,
    write_json,
)
from lily.bench.gpu.kernels.moe_rows_sweep import (
    best_line,
    best_of,
    canon,
    combined,
    fit,
    sweep_tiles,
)
from lily.bench.measure import attempt, capture_graph, kernel_times, replay_ms
from lily.model.norm import rms_norm
from lily.model.ops import moe_rows_config
from lily.model.ref import ref_moe, ref_qlinear, ref_route
from lily.ops.moe_decode import moe_decode
from lily.ops.moe_decode_config import MoeDecodeConfig
from lily.ops.moe_decode_rows import moe_decode_rows
from lily.ops.moe_prefill import moe_prefill
from lily.ops.rmsnorm import rmsnorm


def expected_distinct(b: int, e: int = E, k: int = TOP_K) -> float:
    """Mean number of distinct experts B rows choose when each row's k experts are a
    uniform random k-subset of E: each expert is missed by a row with probability 1 - k/E."""
    return e * (1.0 - (1.0 - k / e) ** b)


def layer_bytes(b: int, distinct: float, fixed: int, expert: int) -> float:
    """Bytes one MoE layer of B rows must read or write: the router, the shared expert and
    its gate (``fixed``), each distinct expert once (``expert`` bytes), x in and out."""
    return fixed + distinct * expert + 2 * b * D * 2


def distinct_experts(x: torch.Tensor, w: dict, nw: torch.Tensor) -> int:
    """The experts the reference router picks for the rows of x (after the norm)."""
    _, ids = ref_route(ref_qlinear(rms_norm(x, nw, EPS), w["router"]), TOP_K)
    return len(set(ids.flatten().tolist()))


def worst_row(out: torch.Tensor, x: torch.Tensor, w: dict, nw: torch.Tensor) -> float:
    """The largest relative error of a row's MoE output (the residual x taken off) against
    the reference MoE of that row alone."""
    h, xf = rms_norm(x, nw, EPS), x.float()
    return max(rel(out[r].float() - xf[r], ref_moe(h[r], *w.values(), TOP_K, x[r]) - xf[r])
               for r in range(len(x)))  # fmt: skip


def rows_call(cfg: MoeDecodeConfig | None):
    """One layer's ``moe_decode rows`` call (x, w, nw, next_nw) -> out on tile ``cfg``; a
    route_once tile on one tickets buffer for every layer, as the engine's (a new one a
    call would put a memset between two layers' launches)."""
    tickets = [None]  # (route_once: made at the first call, on its device)

    def call(x, w, nw, nn):
        if cfg is not None and cfg.route_once and tickets[0] is None:
            tickets[0] = torch.zeros(16, dtype=torch.int32, device=x.device)
        return moe_decode(x, *w.values(), TOP_K, x, norm_weight=nw, eps=EPS, config=cfg,
                          pdl=True, tickets=tickets[0])  # fmt: skip

    return call


def paths(b: int, sweep_only: bool = False) -> list[tuple]:
    """(op, config label, one layer's call (x, w, nw, next_nw) -> out) of each path;
    ``sweep_only``: the batched step's ``moe_decode rows`` alone."""
    # the batched step's own: the B calls' programs in one grid a launch, the table's tile
    table_rows = [("moe_decode rows", "table, pdl", rows_call(moe_rows_config(b)))] * (b > 1)
    if sweep_only:
        return table_rows
    rows = partial(moe_decode_rows, eps=EPS, pdl=True)
    out = [("moe_decode_rows", "table",
            lambda x, w, nw, nn: rows(x, *w.values(), TOP_K, x, norm_weight=nw))]  # fmt: skip
    if b > 1:
        out.append(("rmsnorm+moe_prefill", "table",
                    lambda x, w, nw, nn: moe_prefill(rmsnorm(x, nw, EPS), *w.values(),
                                                     top_k=TOP_K, residual=x, norm_weight=nn,
                                                     eps=EPS)[0]))  # fmt: skip

    def one_by_one(x, w, nw, nn):
        return torch.stack([moe_decode(x[r], *w.values(), TOP_K, x[r], norm_weight=nw,
                                       eps=EPS, pdl=True) for r in range(len(x))])  # fmt: skip

    out.append(("moe_decode" if b == 1 else "moe_decode x B", "table, pdl", one_by_one))
    return out + table_rows


def point(fn, layers: list[dict], xs: list, nws: list, b: int, floor_us: float,
          nbytes: float) -> dict:  # fmt: skip
    """One path over every layer in one graph: time a layer, the worst row's error."""
    n = len(layers)

    def step():
        return [fn(xs[j], layers[j], nws[j], nws[(j + 1) % n]) for j in range(n)]

    graph, outs = capture_graph(step)
    graph.replay()
    torch.cuda.synchronize()
    err = worst_row(outs[0], xs[0], layers[0], nws[0])
    us = replay_ms(graph) * 1e3 / n
    return {"rel_err": err, "time_us": us, "floor_us": floor_us,
            "fraction_of_floor": floor_us / us, "GBps": nbytes / us / 1e3,
            "kernels_us": kernel_times(partial(fn, xs[0], layers[0], nws[0], nws[1]),
                                       key_width=48)}  # fmt: skip


@dataclasses.dataclass
class Rows:
    """One batch size's inputs (a row block a layer) and what its lines share."""

    b: int
    xs: list
    nws: list
    distinct: float
    nbytes: float
    floor_us: float


class Bench:
    """The lines measured so far (``report``, rewritten at ``out`` after each line) over
    ``layers``; no line starts past ``max_seconds``."""

    def __init__(self, ceil: dict, layers: list[dict], out: str | None,
                 max_seconds: float | None, t0: float | None = None):  # fmt: skip
        self.layers, self.out, self.max_seconds = layers, out, max_seconds
        self.t0 = time.perf_counter() if t0 is None else t0  # (the run's start)
        self.results, self.skipped, self.best = [], [], {}
        self.report = {"ceilings": ceil, "moe_rows": self.results, "skipped": self.skipped,
                       "best": self.best}  # fmt: skip

    def over(self) -> bool:
        """Whether the run is past ``max_seconds``."""
        return bool(self.max_seconds) and time.perf_counter() - self.t0 > self.max_seconds

    def measure(self, rows: Rows, op: str, label: str, fn, extra: dict) -> bool:
        """Time one line (False: past ``max_seconds``, nothing measured)."""
        base = {"op": op, "B": rows.b, "config": label, "distinct": rows.distinct,
                "expected": round(expected_distinct(rows.b), 1), "bytes": rows.nbytes}  # fmt: skip
        if self.over():
            self.skipped.append({**base, **extra, "reason": "past --max-seconds"})
            return False
        attempt(self.results, base, partial(point, fn, self.layers, rows.xs, rows.nws, rows.b,
                                            rows.floor_us, rows.nbytes))  # fmt: skip
        self.results[-1].update(extra)
        print(json.dumps({k: v for k, v in self.results[-1].items()
                          if k not in ("kernels_us", "tile")}), flush=True)  # fmt: skip
        write_json(self.out, self.report)
        return True

    def sweep(self, rows: Rows, table: MoeDecodeConfig, lines: list[dict],
              kinds: set[str] | None = None) -> None:  # fmt: skip
        """``moe_decode rows`` on the tiles of ``sweep_tiles`` (each as ``fit`` takes it;
        ``kinds``: those sweeps alone), then on ``combined``, beside the table's ``lines``;
        the fastest usable line into ``best``."""
        tried = {canon(table)}

        def run(kind: str, cfg: MoeDecodeConfig) -> bool:
            if self.over():  # (no compile for a line that will not be timed)
                return self.measure(rows, "moe_decode rows", cfg_str(cfg), None, {"sweep": kind})
            fn = rows_call(cfg)
            args = (rows.xs[0], self.layers[0], rows.nws[0], rows.nws[0])
            bad = compile_problems(partial(fn, *args))
            cfg2 = fit(cfg, table, bad)
            if bad:
                why = "; ".join(bad)
                self.skipped.append({"op": "moe_decode rows", "B": rows.b, "config": cfg_str(cfg),
                                     "sweep": kind, "reason": why})  # fmt: skip
                taken = f", timed as {cfg_str(cfg2)}" if cfg2 else ""
                print(f"  skipped B={rows.b} {cfg_str(cfg)}: {why}{taken}", flush=True)
                if cfg2 is None or compile_problems(partial(rows_call(cfg2), *args)):
                    return True
            if cfg2 in tried:
                return True
            tried.add(cfg2)
            extra = {"sweep": kind, "tile": dataclasses.asdict(cfg2)}
            ok = self.measure(rows, "moe_decode rows", cfg_str(cfg2), rows_call(cfg2), extra)
            if ok:
                lines.append(self.results[-1])
            return ok

        tiles = [(k, c) for k, c in sweep_tiles(table) if kinds is None or k in kinds]
        if all(run(kind, cfg) for kind, cfg in tiles):
            both = combined(table, lines)
            if both is not None:
                run("combined", both)
        top = best_of(rows.b, lines)
        if top:
            self.best[rows.b] = top
            print(best_line(top), flush=True)
        write_json(self.out, self.report)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,4,8,16", help="batch sizes B, in this order")
    ap.add_argument("--layers", type=int, default=4, help="layers of distinct weights")
    ap.add_argument("--variants", action="store_true", help="also the moe_decode rows sweep")
    ap.add_argument("--kinds", help="with --variants: these sweeps alone (mma,router,route)")
    sweep_args(ap, "moe_decode rows")
    ap.add_argument("--out")
    args = ap.parse_args()
    t0 = time.perf_counter()
    gen = torch.Generator(device=DEV).manual_seed(0)
    ceil = ceilings()
    print(json.dumps(ceil), flush=True)
    layers = [moe_weights(gen) for _ in range(args.layers)]
    fixed, expert = fixed_bytes(layers[0]), expert_bytes(layers[0])
    bench = Bench(ceil, layers, args.out, args.max_seconds, t0)
    results = bench.results
    for b in [int(s) for s in args.rows.split(",")]:
        xs = [(2.0 * torch.randn(b, D, generator=gen, device=DEV)).to(BF16) for _ in layers]
        nws = [norm_weight(gen) for _ in layers]
        got = [distinct_experts(x, w, nw) for x, w, nw in zip(xs, layers, nws, strict=True)]
        distinct = sum(got) / len(got)
        nbytes = layer_bytes(b, distinct, fixed, expert)
        rows = Rows(b, xs, nws, distinct, nbytes, nbytes / ceil["copy_GBps"] / 1e3)
        before = len(results)
        table = moe_rows_config(b) or MoeDecodeConfig()
        for op, label, fn in paths(b, args.variants and args.sweep_only):
            # (the table's tile, what the sweep reads)
            sweeps = args.variants and op == "moe_decode rows"
            extra = {"tile": dataclasses.asdict(table)} if sweeps else {}
            bench.measure(rows, op, label, fn, extra)
        # against what the engine ran before: moe_prefill for several rows, moe_decode for one
        old = ("rmsnorm+moe_prefill", "moe_decode")
        base_us = next((r.get("time_us") for r in results[before:] if r["op"] in old), None)
        for r in results[before:]:
            if base_us and r.get("time_us"):
                r["speedup_vs_previous"] = base_us / r["time_us"]
        if args.variants and b > 1:
            kinds = set(args.kinds.split(",")) if args.kinds else None
            bench.sweep(rows, table, [r for r in results[before:] if r["op"] == "moe_decode rows"],
                        kinds)  # fmt: skip
    cw = max([24] + [len(r["config"]) for r in results])  # the sweep's labels are longer
    print(f"\n{'op':20} {'config':{cw}} {'B':>3} {'distinct':>8} {'us/layer':>9} {'floor':>7} "
          f"{'of floor':>8} {'vs prev':>7} {'rel_err':>8}")  # fmt: skip
    for r in results:
        if "error" in r:
            print(f"{r['op']:20} {r['config']:{cw}} {r['B']:>3} error: {r['error']}")
            continue
        print(f"{r['op']:20} {r['config']:{cw}} {r['B']:>3} {r['distinct']:>8.1f} "
              f"{r['time_us']:>9.1f} {r['floor_us']:>7.1f} {r['fraction_of_floor']:>8.0%} "
              f"{r.get('speedup_vs_previous', 0):>7.2f} {r['rel_err']:>8.1e}")  # fmt: skip
    for r in bench.best.values():
        print(best_line(r))
    write_json(args.out, bench.report)


if __name__ == "__main__":
    main()
