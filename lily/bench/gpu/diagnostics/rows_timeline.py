"""Where a batched decode step's time goes, by batch size (one GPU call).

On the full-size random model on the kernels: ``--rows``' largest number of sequences, each
prefilled with ``--context`` tokens of its own pseudo-text; then for each batch size B the
batched step of the first B (``Runner.decode_rows``, its CUDA graph) is timed by replay
(CUDA events, median) and one replay is profiled (decode_timeline's exposed time by layer
kind and by kernel), with the host's wall time of a whole ``decode_rows`` call beside it
and the one-row step's replay for scale. ``--variants`` repeats it with the batched step's
switches of lily/model/ops.py changed, in the same process: ``no_rows_mma`` (projections on
qgemv/qgemm), ``rows_moe`` (the MoE on moe_decode_rows), ``rows_prep`` /
``no_rows_prep`` (the normed projections' rows prepared once, ROWS_PREP, or not),
``no_head_prep``, ``no_pow2``, ``every_table`` (the MoE's earlier entries, every gate/up
program routing its row: lily/model/ops.py MOE_ROWS_EVERY), and on the entries that route
once: ``no_down_early`` (the down launch's experts' tiles loaded after its PDL wait),
``down_n32w8`` / ``down_n16w8`` (the down launch's tile), ``shared16`` / ``shared4`` (the
shared expert's rows a router-launch program), ``router16`` (router rows a program).

    python3 -m lily.bench.gpu.diagnostics.rows_timeline --rows 2,4,8 --out $OUT/rows.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import time

import torch

import lily.model.ops as ops_mod
import lily.ops.qgemv_mma_rows as rows_mod
from lily.bench.gpu.diagnostics.decode_timeline import print_timeline, timeline
from lily.bench.gpu.full_model import full_params, kernel_engine, write_json
from lily.bench.measure import pseudo_text_ids, replay_ms


def _routed(**fields) -> dict:
    """MOE_ROWS_CONFIGS with ``fields`` (MoeDecodeConfig's) changed on the entries that
    route once and write the down launch's operand (4 and 8 rows)."""
    table = ops_mod.MOE_ROWS_CONFIGS
    return {b: dataclasses.replace(c, **fields) if c.down_operand else c
            for b, c in table.items()}  # fmt: skip


SWITCHES = {
    "current": {},
    "no_rows_mma": {"ROWS_MMA": False},
    "rows_moe": {"ROWS_MOE": True},
    "rows_prep": {"ROWS_PREP": True},
    "no_rows_prep": {"ROWS_PREP": False},
    "no_head_prep": {"ROWS_PREP_HEAD": False},
    "no_pow2": {"OPERAND_POW2": False},
    "every_table": {"MOE_ROWS_CONFIGS": ops_mod.MOE_ROWS_EVERY},
    "no_down_early": {"MOE_ROWS_CONFIGS": _routed(down_early=False)},
    # the route entries' other tiles, now that down loads early (its first wave's bytes
    # are what it hides) and the router launch routes
    "down_n32w8": {"MOE_ROWS_CONFIGS": _routed(mma_down_rows=32, mma_down_warps=8)},
    "down_n16w8": {"MOE_ROWS_CONFIGS": _routed(mma_down_warps=8)},
    "shared16": {"MOE_ROWS_CONFIGS": _routed(shared_rows=16)},
    "shared4": {"MOE_ROWS_CONFIGS": _routed(shared_rows=4)},
    "router16": {"MOE_ROWS_CONFIGS": _routed(router_rows=16)},
}  # fmt: skip


def _owner(name: str):
    """The module that holds switch ``name`` (lily/model/ops.py, else the rows' GEMV's)."""
    return ops_mod if hasattr(ops_mod, name) else rows_mod


@contextlib.contextmanager
def switched(name: str, runner):
    """lily/model/ops.py's switches of variant ``name`` while measuring (graphs rebuilt)."""
    if name not in SWITCHES:
        raise SystemExit(f"unknown variant {name!r}: one of {', '.join(SWITCHES)}")
    old = {k: getattr(_owner(k), k) for k in SWITCHES[name]}
    for k, v in SWITCHES[name].items():
        setattr(_owner(k), k, v)
    runner.graphs.clear()
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(_owner(k), k, v)
        runner.graphs.clear()


def wall_ms(runner, tokens: list[int], states: list, n: int = 20) -> float:
    """Host wall time of one ``decode_rows`` call, synchronised, over ``n`` calls."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        runner.decode_rows(tokens, states)
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="2,4,8", help="batch sizes B (at least 2)")
    ap.add_argument("--context", type=int, default=1024, help="tokens prefilled per sequence")
    ap.add_argument("--variants", default="current", help=", ".join(SWITCHES))
    ap.add_argument("--out")
    args = ap.parse_args()
    rows = [int(b) for b in args.rows.split(",")]
    if min(rows) < 2:
        raise SystemExit("--rows: batch sizes of at least 2 (one row is the single step)")
    engine = kernel_engine(full_params(), max_context=args.context + 4096)
    runner = engine.runner
    states = []
    for i in range(max(rows)):
        st = engine.new_state()
        runner.prefill(pseudo_text_ids(args.context, engine.cfg.vocab_size, 5 + i), st)
        states.append(st)
    nexts = [pseudo_text_ids(args.context + 1, engine.cfg.vocab_size, 5 + i)[-1]
             for i in range(max(rows))]  # fmt: skip
    results = []
    for name in args.variants.split(","):
        with switched(name, runner):
            for b in rows:
                # each row its own text's next token: one token for every row would route the
                # rows to the same experts, a MoE far cheaper than real requests' (seventh
                # session: 2.68 against 3.12 ms at 8 rows)
                toks = nexts[:b]
                for _ in range(3):  # capture, then settle
                    runner.decode_rows(toks, states[:b])
                wall = wall_ms(runner, toks, states[:b])
                graph = [v for k, v in runner.graphs.items() if k[0] == "rows" and k[1] == b][-1][0]
                ms = replay_ms(graph)
                tl = timeline(graph)
                results.append({"variant": name, "rows": b, "context": args.context,
                                "step_ms": round(ms, 4), "wall_ms": round(wall, 4),
                                "tok_per_s": round(b * 1e3 / ms, 1), **tl})  # fmt: skip
                print_timeline(f"{name} B={b}: step {ms:.3f} ms ({b * 1e3 / ms:.0f} tok/s), "
                               f"wall {wall:.3f} ms", tl, top=8)  # fmt: skip
            write_json(args.out, args, results=results)  # after each variant: kept if cut
    st = states[0]
    for _ in range(3):
        runner.decode(17, st)
    one = replay_ms(runner._graph(st, st.length)[0])
    results.append({"variant": "one row", "rows": 1, "context": args.context,
                    "step_ms": round(one, 4)})  # fmt: skip
    print(f"one row: step {one:.3f} ms ({1e3 / one:.0f} tok/s)", flush=True)
    write_json(args.out, args, results=results)


if __name__ == "__main__":
    main()
