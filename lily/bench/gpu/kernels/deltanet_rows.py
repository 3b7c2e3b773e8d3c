"""The batched step's DeltaNet (deltanet_decode_rows over B rows) against its byte floor.

B = 2, 4, 8, 16 rows (one token each) at the model's shapes (Hk 16, Hv 32, K = Vd = 128),
each row with its own conv and recurrent states, as the engine has them (a 2 MiB fp32 state
a row and a layer). Run on the GPU (well under a minute):

    lily bench --run kernels.deltanet_rows -- --out $OUT/deltanet_rows.json

Per B, each path is a CUDA graph of one call a layer over enough layers of distinct states
(at least 30, the model's DeltaNet layers, and three times the L2 cache's worth), so the
states stream from HBM as in a decode step, replayed back to back and timed with CUDA
events; the figure is the time a layer. Paths:
- ``deltanet_decode_rows``: one launch over the B rows, on the tile the batched step takes
  (lily/model/ops.py DELTANET_ROWS_CONFIGS; the one-row (16, 4) without an entry), PDL;
- ``deltanet_decode x B``: B one-row launches in a row (the one-row step's tile).
The floor is the bytes a layer must move (``layer_bytes``: each row's states read and
written, its inputs and output; the layer's conv and norm weights once) at the copy rate
measured here. Every path is first checked on fresh inputs and states against the fp32
reference (lily.model.ref ref_deltanet) row by row: ``rel_err`` is the worst row's output
or state error.

``--variants``: deltanet_decode_rows also at block_v 8/16/32/64 x num_warps 2/4/8; a tile
the compile matrix would reject on this GPU (lily/ops/matrix.py: registers, spills past
its limit) is skipped with the reason (``skipped``). Per B the fastest tile within ERR_BOUND
is printed beside the table's as a DELTANET_ROWS_CONFIGS entry (``best``).
``--sweep-only``: the deltanet_decode_rows lines alone. The JSON is rewritten after every
line, and ``--max-seconds`` starts no line past that time, so a run stopped early keeps
what it measured. The sweep (B in the order given; about a minute, most of it compiling):

    lily bench --run kernels.deltanet_rows -- --variants --sweep-only --rows 8,4,2,16 \\
        --max-seconds 80 --out $OUT/deltanet_rows_sweep.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from functools import partial

import torch

from lily.bench.gpu.kernels.common import (
    DEV,
    L2_BYTES,
    against_table,
    compile_problems,
    rel,
    sweep_args,
    sweep_start,
    than_table,
    write_json,
)
from lily.bench.gpu.kernels.mixer_deltanet import DN_LAYERS, HK, HV, VD, C, K, W, dn_inputs
from lily.bench.measure import attempt, capture_graph, replay_ms
from lily.model.ops import MAX_ROWS, deltanet_rows_config
from lily.model.ref import ref_deltanet
from lily.ops.deltanet_decode import (
    DeltaNetDecodeWorkspace,
    deltanet_decode,
    deltanet_decode_rows,
    state_table,
)

EPS = 1e-6
SWEEP = [(bv, w) for bv in (8, 16, 32, 64) for w in (2, 4, 8)]  # (block_v, num_warps)
# A tile counts within the kernel tests' bf16 output bound (tests/ops/test_deltanet_ops.py).
ERR_BOUND = 1.5e-2
STATE_BYTES = HV * K * VD * 4  # one row's recurrent state (fp32)
INPUTS = ("mixed_qkv", "z", "b", "a")
WEIGHTS = ("conv_weight", "A_log", "dt_bias", "norm_weight")


def layer_bytes(b: int) -> int:
    """Bytes one layer of B rows must move: per row its recurrent (fp32) and conv (bf16)
    states read and written, its inputs (qkv, z, b, a) and output (bf16); once the conv
    weight, A_log, dt_bias (fp32) and the norm weight."""
    row = 2 * STATE_BYTES + 2 * (W - 1) * C * 2 + (C + HV * VD + 2 * HV) * 2 + HV * VD * 2
    return b * row + C * W * 2 + 2 * HV * 4 + VD * 2


def layers_for(b: int) -> int:
    """Layers of distinct states a graph runs over: DN_LAYERS, or more where B rows' states
    are under three L2 caches (so each call reads its states from HBM)."""
    return max(DN_LAYERS, math.ceil(3 * L2_BYTES / (b * STATE_BYTES)))


def parse_rows(spec: str) -> list[int]:
    """``--rows``: comma-separated batch sizes, each 2..MAX_ROWS (the table's keys)."""
    try:
        rows = [int(s) for s in spec.split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"--rows: {spec!r} is not a comma-separated list of integers") from None
    bad = [b for b in rows if not 2 <= b <= MAX_ROWS]
    if not rows or bad:
        raise ValueError(f"--rows: batch sizes must be 2..{MAX_ROWS}, got {spec!r}")
    return rows


def sweep_tiles(table: tuple[int, int]) -> list[tuple[int, int]]:
    """The tiles ``--variants`` times beside the table's, in order."""
    return [t for t in SWEEP if t != tuple(table)]


def label(tile: tuple[int, int]) -> str:
    return f"bv{tile[0]} w{tile[1]}"


def table_entry(b: int, tile: tuple[int, int]) -> str:
    """``tile`` as an entry of lily/model/ops.py's DELTANET_ROWS_CONFIGS."""
    return f"{b}: ({tile[0]}, {tile[1]}),"


def best_of(b: int, lines: list[dict]) -> dict | None:
    """The fastest deltanet_decode_rows line of B within ERR_BOUND, against the table's."""
    ok = [r for r in lines if r.get("op") == "deltanet_decode_rows" and "us" in r
          and r["rel_err"] < ERR_BOUND and "tile" in r]  # fmt: skip
    if not ok:
        return None
    table = next((r for r in ok if r["config"].startswith("table")), None)
    top, vs = against_table(ok, "us", table)
    return {"B": b, "config": top["config"], "us": top["us"], "GBps": top["GBps"],
            "entry": table_entry(b, tuple(top["tile"])), **vs}  # fmt: skip


def best_line(r: dict) -> str:
    """One B's fastest tile against the table's, and its DELTANET_ROWS_CONFIGS entry."""
    return (f"best B={r['B']}: {r['config']}, {r['us']:.1f} us a layer ({r['GBps']:.0f} GB/s)"
            f"{than_table(r)}; {r['entry']}")  # fmt: skip


@dataclasses.dataclass
class Layer:
    """One layer's B rows: inputs (B, n), weights, each row's states and their table."""

    inputs: dict
    weights: dict
    convs: list
    states: list
    table: torch.Tensor

    @classmethod
    def new(cls, b: int, gen: torch.Generator) -> Layer:
        """Random inputs and weights (mixer_deltanet's ranges), B rows' own states."""
        d = dn_inputs(b, gen)
        rows = [d] + [dn_inputs(1, gen) for _ in range(b - 1)]
        return cls.of({k: d[k] for k in INPUTS}, {k: d[k] for k in WEIGHTS},
                      [r["conv_state"] for r in rows], [r["state"] for r in rows])  # fmt: skip

    @classmethod
    def of(cls, inputs: dict, weights: dict, convs: list, states: list) -> Layer:
        table = state_table(list(zip(convs, states, strict=True)), states[0].device)
        return cls(inputs, weights, convs, states, table)

    def fresh(self) -> Layer:
        """This layer with copies of its states (the original states left as they are)."""
        return Layer.of(self.inputs, self.weights, [c.clone() for c in self.convs],
                        [s.clone() for s in self.states])  # fmt: skip


def rows_call(tile: tuple[int, int], ws: DeltaNetDecodeWorkspace):
    """deltanet_decode_rows over a layer's rows on ``tile`` (block_v, num_warps), PDL."""

    def call(x: Layer) -> torch.Tensor:
        i, w = x.inputs, x.weights
        return deltanet_decode_rows(
            i["mixed_qkv"], i["z"], i["b"], i["a"], w["conv_weight"], x.table, x.convs[0],
            x.states[0], w["A_log"], w["dt_bias"], w["norm_weight"], EPS, workspace=ws,
            block_v=tile[0], num_warps=tile[1], pdl=True,
        )  # fmt: skip

    return call


def one_by_one(ws: DeltaNetDecodeWorkspace):
    """B one-row deltanet_decode calls in a row, each on its row's states."""

    def call(x: Layer) -> torch.Tensor:
        i, w = x.inputs, x.weights
        return torch.stack([
            deltanet_decode(i["mixed_qkv"][r], i["z"][r], i["b"][r], i["a"][r],
                            w["conv_weight"], x.convs[r], w["A_log"], w["dt_bias"],
                            w["norm_weight"], x.states[r], EPS, workspace=ws, pdl=True)
            for r in range(len(x.states))
        ])  # fmt: skip

    return call


def worst_row(fn, layer: Layer) -> float:
    """``fn`` on copies of ``layer``'s states against the fp32 reference of each row alone:
    the largest relative error of a row's output or new state (NaN where one is not
    finite)."""
    x = layer.fresh()
    out = fn(x)
    i, w = layer.inputs, layer.weights
    errs = []
    for r in range(len(x.states)):
        ref_out, _, ref_state = ref_deltanet(
            *(i[k][r : r + 1] for k in INPUTS), w["conv_weight"], layer.convs[r], w["A_log"],
            w["dt_bias"], w["norm_weight"], layer.states[r], EPS,
        )  # fmt: skip
        errs += [rel(out[r], ref_out[0]), rel(x.states[r], ref_state)]
    return math.nan if any(math.isnan(e) for e in errs) else max(errs)  # (NaN: not finite)


def point(fn, layers: list[Layer], fresh: Layer, floor_us: float, nbytes: float) -> dict:
    """One path: checked on ``fresh``, then timed as a graph of one call a layer."""
    err = worst_row(fn, fresh)

    def step():
        return [fn(x) for x in layers]

    graph, _ = capture_graph(step)
    us = replay_ms(graph) * 1e3 / len(layers)
    return {"rel_err": err, "us": us, "floor_us": floor_us, "of_floor": floor_us / us,
            "GBps": nbytes / us / 1e3}  # fmt: skip


@dataclasses.dataclass
class Rows:
    """One batch size's layers, its check layer, the rows' workspace and its floor."""

    b: int
    layers: list
    fresh: Layer | None
    ws: DeltaNetDecodeWorkspace | None
    nbytes: float
    floor_us: float


class Bench:
    """The lines measured so far (``report``, rewritten at ``out`` after each line); no line
    starts past ``max_seconds``."""

    def __init__(self, ceil: dict, out: str | None, max_seconds: float | None,
                 t0: float | None = None):  # fmt: skip
        self.out, self.max_seconds = out, max_seconds
        self.t0 = time.perf_counter() if t0 is None else t0
        self.results, self.skipped, self.best = [], [], {}
        self.report = {"ceilings": ceil, "deltanet_rows": self.results, "skipped": self.skipped,
                       "best": self.best}  # fmt: skip

    def over(self) -> bool:
        return bool(self.max_seconds) and time.perf_counter() - self.t0 > self.max_seconds

    def measure(self, rows: Rows, op: str, config: str, fn, extra: dict) -> None:
        base = {"op": op, "B": rows.b, "config": config, "bytes": rows.nbytes, **extra}
        if self.over():
            self.skipped.append({**base, "reason": "past --max-seconds"})
            return
        attempt(self.results, base, partial(point, fn, rows.layers, rows.fresh, rows.floor_us,
                                            rows.nbytes))  # fmt: skip
        print(json.dumps(self.results[-1]), flush=True)
        write_json(self.out, self.report)

    def run(self, rows: Rows, variants: bool, sweep_only: bool) -> None:
        """B's lines: the table's tile, (not ``sweep_only``) B one-row calls, (``variants``)
        the sweep's tiles the compile matrix takes; the fastest into ``best``."""
        table = deltanet_rows_config(rows.b)
        before = len(self.results)
        self.measure(rows, "deltanet_decode_rows", f"table ({label(table)})",
                     rows_call(table, rows.ws), {"tile": list(table)})  # fmt: skip
        if not sweep_only:
            ws1 = DeltaNetDecodeWorkspace.new(HK, HV, VD, DEV)
            self.measure(rows, "deltanet_decode x B", label((16, 4)), one_by_one(ws1), {})
        if not variants:
            return
        for tile in sweep_tiles(table):
            base = {"op": "deltanet_decode_rows", "B": rows.b, "config": label(tile)}
            fn = rows_call(tile, rows.ws)
            if self.over():  # (no compile for a line that will not be timed)
                self.skipped.append({**base, "reason": "past --max-seconds"})
                continue
            if bad := compile_problems(partial(fn, rows.layers[0])):
                self.skipped.append({**base, "reason": "; ".join(bad)})
                print(f"  skipped B={rows.b} {label(tile)}: {'; '.join(bad)}", flush=True)
                continue
            self.measure(rows, base["op"], base["config"], fn, {"tile": list(tile)})
        if top := best_of(rows.b, self.results[before:]):
            self.best[rows.b] = top
            print(best_line(top), flush=True)
        write_json(self.out, self.report)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="2,4,8,16", help="batch sizes B (2..MAX_ROWS), in order")
    ap.add_argument("--variants", action="store_true", help="also the block_v x warps sweep")
    sweep_args(ap, "deltanet_decode_rows")
    ap.add_argument("--out")
    args = ap.parse_args()
    try:
        batches = parse_rows(args.rows)
    except ValueError as e:
        ap.error(str(e))
    t0, gen, ceil = sweep_start("deltanet_rows")
    bench = Bench(ceil, args.out, args.max_seconds, t0)
    for b in batches:
        if bench.over():
            bench.skipped.append({"B": b, "reason": "past --max-seconds"})
            continue
        nbytes = layer_bytes(b)
        layers = [Layer.new(b, gen) for _ in range(layers_for(b))]
        ws = DeltaNetDecodeWorkspace.new(HK, HV, VD, DEV, rows=b)
        rows = Rows(b, layers, Layer.new(b, gen), ws, nbytes, nbytes / ceil["copy_GBps"] / 1e3)
        bench.run(rows, args.variants, args.sweep_only)
        del rows, layers
        torch.cuda.empty_cache()
    print(f"\n{'op':22} {'config':16} {'B':>3} {'us/layer':>9} {'floor':>7} {'of floor':>8} "
          f"{'GB/s':>6} {'rel_err':>8}")  # fmt: skip
    for r in bench.results:
        if "error" in r:
            print(f"{r['op']:22} {r['config']:16} {r['B']:>3} error: {r['error']}")
            continue
        print(f"{r['op']:22} {r['config']:16} {r['B']:>3} {r['us']:>9.1f} {r['floor_us']:>7.1f} "
              f"{r['of_floor']:>8.0%} {r['GBps']:>6.0f} {r['rel_err']:>8.1e}")  # fmt: skip
    for r in bench.best.values():
        print(best_line(r))
    write_json(args.out, bench.report)


if __name__ == "__main__":
    main()
