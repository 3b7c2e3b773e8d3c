"""The batched MoE benchmark's tile sweep (lily/bench/gpu/kernels/moe_rows_sweep.py and
kernels.moe_rows' ``Bench.sweep``) on the CPU: which tiles it times, how a tile the compile
matrix rejects is skipped or cut back to its other launch, the fastest launches of several
lines put together, the table entry it prints, and (with the GPU parts faked: timing,
compile check) a whole sweep rewriting its JSON after every line and stopping at its time
limit."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, replace

import pytest

from lily.bench.gpu.kernels import moe_rows
from lily.bench.gpu.kernels.moe_rows_sweep import (
    ERR_BOUND,
    best_of,
    combined,
    down_tile,
    fit,
    sweep_tiles,
    table_entry,
)
from lily.ops.moe_decode_config import MoeDecodeConfig

DEFAULT = MoeDecodeConfig()
GATE_UP, DOWN = "_moe_gate_up_mma_kernel", "_moe_down_mma_kernel"


def test_the_sweep_covers_every_tile_once():
    tiles = sweep_tiles(DEFAULT)
    mma = {(c.mma_rows, c.mma_warps) for k, c in tiles if k == "mma"}
    assert mma == {(r, w) for r in (16, 32, 64) for w in (4, 8, 16)} - {(16, 8)}
    assert all(c.mma_down_rows is None and c.mma_down_warps is None for _, c in tiles)
    router = [c for k, c in tiles if k == "router"]
    assert {(c.router_rows, c.shared_rows, c.num_warps) for c in router} == {
        (2, 8, 4), (8, 8, 4), (16, 8, 4), (4, 4, 4), (4, 16, 4), (4, 8, 8)}  # fmt: skip
    assert all((c.mma_rows, c.mma_warps) == (16, 8) for c in router)
    route = [c for k, c in tiles if k == "route"]
    assert all(c.route_once for c in route) and not any(c.route_once for c in router)
    assert [c for c in route if not c.down_operand] == [replace(DEFAULT, route_once=True)]
    assert {(c.mma_rows, c.mma_warps) for c in route if c.down_operand} == {
        (16, 8), (16, 4), (32, 4), (32, 8), (64, 8)}  # fmt: skip
    # down_early switched on the table's tile, once
    early = [c for c in route if c.down_early]
    assert early == [replace(DEFAULT, route_once=True, down_operand=True, down_early=True)]
    assert len({c for _, c in tiles}) == len(tiles) == 21 and DEFAULT not in {c for _, c in tiles}
    # around a table entry with a down tile of its own: the entry itself is not timed again
    table = MoeDecodeConfig(mma_rows=32, mma_warps=16, mma_down_rows=16, mma_down_warps=16)
    around = sweep_tiles(table)
    assert table not in {c for _, c in around} and len(around) == 23
    assert replace(table, route_once=True) in {c for _, c in around}
    assert all(c.mma_down_rows == 16 for k, c in around if k == "router")


def test_fit_keeps_what_the_compile_matrix_takes():
    cfg = MoeDecodeConfig(mma_rows=64, mma_warps=16)
    table = MoeDecodeConfig(mma_rows=16, mma_warps=8)
    assert fit(cfg, table, []) == cfg
    spill = "stack frame (spills) 384 B a thread > 256"
    # down rejected: gate/up's 64-row tile still timed, down back on the table's
    assert fit(cfg, table, [f"{DOWN}: {spill}"]) == replace(cfg, mma_down_rows=16,
                                                            mma_down_warps=8)  # fmt: skip
    # gate/up rejected: the reverse
    assert fit(cfg, table, [f"{GATE_UP}: {spill}"]) == MoeDecodeConfig(
        mma_rows=16, mma_warps=8, mma_down_rows=64, mma_down_warps=16)  # fmt: skip
    assert fit(cfg, table, [f"{GATE_UP}: {spill}", f"{DOWN}: {spill}"]) is None
    assert fit(cfg, table, [f"_moe_router_kernel: {spill}"]) is None


def line(cfg: MoeDecodeConfig, us: float, gate_up: float, down: float, router: float,
         err: float = 1e-3) -> dict:  # fmt: skip
    return {"op": "moe_decode rows", "config": "x", "time_us": us, "rel_err": err,
            "tile": asdict(cfg), "kernels_us": {"_moe_router_kernel": router,
                                                "_moe_gate_up_mma_kernel": gate_up,
                                                "_moe_down_mma_kernel": down}}  # fmt: skip


def test_combined_takes_each_launch_from_its_fastest_line():
    a = MoeDecodeConfig(mma_rows=32, mma_warps=16)  # fastest gate/up
    b = MoeDecodeConfig(mma_rows=16, mma_warps=16)  # fastest down
    c = MoeDecodeConfig(router_rows=8)  # fastest router
    bad = MoeDecodeConfig(mma_rows=64, mma_warps=16)  # fastest of all, but wrong
    lines = [line(DEFAULT, 90, 40, 35, 9), line(a, 80, 30, 36, 9.1), line(b, 85, 41, 30, 9),
             line(c, 88, 40, 35, 7), line(bad, 50, 10, 10, 5, err=10 * ERR_BOUND)]  # fmt: skip
    want = MoeDecodeConfig(router_rows=8, mma_rows=32, mma_warps=16, mma_down_rows=16,
                           mma_down_warps=16)  # fmt: skip
    assert combined(DEFAULT, lines) == want
    # the same tile for both launches is one name
    assert combined(DEFAULT, [line(a, 80, 30, 30, 9)]) == a
    assert combined(DEFAULT, [{**lines[0], "kernels_us": {"error": "no profiler"}}]) is None
    # route_once rides with its gate/up tile, and the first launch is the fastest of the
    # lines that route once too (a routing router launch does more)
    once = MoeDecodeConfig(mma_rows=32, mma_warps=8, route_once=True)
    once_rt = MoeDecodeConfig(router_rows=16, route_once=True)
    got = combined(DEFAULT, [*lines, line(once, 70, 20, 35, 12), line(once_rt, 90, 40, 35, 11)])
    assert got == MoeDecodeConfig(router_rows=16, mma_rows=32, mma_warps=8, mma_down_rows=16,
                                  mma_down_warps=16, route_once=True)  # fmt: skip
    # a table entry loading down early keeps it where the fastest gate/up writes down's
    # operand, and drops it where not (it needs it)
    table = MoeDecodeConfig(route_once=True, down_operand=True, down_early=True)
    assert combined(table, lines).down_early is False
    hop = MoeDecodeConfig(mma_rows=32, mma_warps=8, route_once=True, down_operand=True)
    assert combined(table, [*lines, line(hop, 60, 15, 35, 9)]).down_early is True
    top = best_of(8, [{**lines[0], "config": "table, pdl"}, *lines[1:]])
    assert top["time_us"] == 80 and top["table_us"] == 90 and top["speedup"] == 90 / 80
    assert top["entry"] == "8: MoeDecodeConfig(mma_rows=32, mma_warps=16),"


@pytest.mark.parametrize("cfg", [DEFAULT, MoeDecodeConfig(router_rows=8, num_warps=8,
                                 mma_rows=32, mma_warps=16, mma_down_rows=16,
                                 mma_down_warps=4)])  # fmt: skip
def test_the_table_entry_reads_back_as_the_tile(cfg):
    entry = table_entry(12, cfg)
    table = eval("{" + entry + "}", {"MoeDecodeConfig": MoeDecodeConfig})  # noqa: S307
    assert table == {12: cfg}


class Call:
    """A stand-in for one layer's call on tile ``cfg`` (never run: timing is faked)."""

    def __init__(self, cfg):
        self.cfg = cfg

    def __call__(self, *args):
        raise AssertionError("a faked sweep runs no kernel")


def fake_sweep(monkeypatch, tmp_path, max_seconds=None):
    """Bench.sweep at 8 rows with its GPU parts faked: a cost model of the three launches
    (gate/up fastest at 32 rows on 16 warps, down at 16 on 16, router at 8 rows a program),
    and a compile check that rejects every 64-row down launch and the 32 x 4 tile."""

    def cost(cfg):
        gu = {(32, 16): 20.0}.get((cfg.mma_rows, cfg.mma_warps), 30.0)
        dn = {(16, 16): 15.0}.get(down_tile(cfg), 25.0)
        rt = 5.0 if cfg.router_rows == 8 else 8.0
        return gu, dn, rt

    def point(fn, *args):
        gu, dn, rt = cost(fn.cfg)
        return {"rel_err": 1e-3, "time_us": gu + dn + rt,
                "kernels_us": {GATE_UP: gu, DOWN: dn, "_moe_router_kernel": rt}}  # fmt: skip

    def problems(fn):
        cfg = fn.func.cfg
        out = []
        if (cfg.mma_down_rows or cfg.mma_rows) == 64:
            out.append(f"{DOWN}: stack frame (spills) 416 B a thread > 256")
        if (cfg.mma_rows, cfg.mma_warps) == (32, 4):
            out.append(f"{GATE_UP}: 255 registers, stack frame (spills) 300 B > 256")
            out.append(f"{DOWN}: stack frame (spills) 624 B a thread > 256")
        return out

    writes = []
    real_write = moe_rows.write_json
    monkeypatch.setattr(moe_rows, "rows_call", Call)
    monkeypatch.setattr(moe_rows, "point", point)
    monkeypatch.setattr(moe_rows, "compile_problems", problems)
    monkeypatch.setattr(moe_rows, "write_json",
                        lambda path, obj: writes.append(len(obj["moe_rows"]))
                        or real_write(path, obj))  # fmt: skip
    out = tmp_path / "sweep.json"
    bench = moe_rows.Bench({}, [{}], str(out), max_seconds)
    rows = moe_rows.Rows(8, [None], [None], 57.4, 1e8, 25.0)
    bench.measure(rows, "moe_decode rows", "table, pdl", Call(DEFAULT), {"tile": asdict(DEFAULT)})
    bench.sweep(rows, DEFAULT, bench.results[-1:])
    return bench, json.loads(out.read_text()), writes


def test_a_faked_sweep_skips_times_and_combines(monkeypatch, tmp_path):
    bench, saved, writes = fake_sweep(monkeypatch, tmp_path)
    timed = {r["config"]: r for r in bench.results}
    # 32 x 4 rejected in both launches: skipped; 64-row tiles: gate/up timed, down on 16 x 8
    assert "r4 s8 mma n32 w4" not in timed
    assert "r4 s8 mma n64 w16 dn n16 w8" in timed and "r4 s8 mma n64 w16" not in timed
    reasons = {s["config"]: s["reason"] for s in bench.skipped}
    assert "spills" in reasons["r4 s8 mma n32 w4"] and "416 B" in reasons["r4 s8 mma n64 w8"]
    # combined: gate/up 32 x 16, down 16 x 16, router 8 rows: 20 + 15 + 5
    last = bench.results[-1]
    assert last["sweep"] == "combined" and last["config"] == "r8 s8 mma n32 w16 dn n16 w16"
    assert last["time_us"] == 40.0
    assert bench.best[8]["time_us"] == 40.0 and bench.best[8]["table_us"] == 63.0
    assert bench.best[8]["entry"] == (
        "8: MoeDecodeConfig(router_rows=8, mma_rows=32, "
        "mma_warps=16, mma_down_rows=16, mma_down_warps=16),"
    )
    # the JSON was rewritten after every line and holds the whole run
    assert writes[: len(bench.results)] == list(range(1, len(bench.results) + 1))
    assert len(saved["moe_rows"]) == len(bench.results) and saved["best"]["8"]["time_us"] == 40


def test_a_faked_sweep_stops_at_its_time_limit(monkeypatch, tmp_path):
    bench, saved, _ = fake_sweep(monkeypatch, tmp_path, max_seconds=1e-9)
    assert bench.results == [] and 8 not in bench.best
    assert [s["reason"] for s in saved["skipped"]] == ["past --max-seconds"] * 2


def test_the_default_lines_and_the_table_line(monkeypatch):
    """The paths a run without --variants times are the ones it always timed (their ops
    and labels, in order); --sweep-only keeps the batched step's line alone, and that line
    takes the tile of lily/model/ops.py's table at its B."""
    import lily.model.ops as model_ops

    def ops(b, sweep_only=False):
        return [(op, label) for op, label, _ in moe_rows.paths(b, sweep_only)]

    assert ops(1) == [("moe_decode_rows", "table"), ("moe_decode", "table, pdl")]
    assert ops(4) == [("moe_decode_rows", "table"), ("rmsnorm+moe_prefill", "table"),
                      ("moe_decode x B", "table, pdl"),
                      ("moe_decode rows", "table, pdl")]  # fmt: skip
    assert ops(4, True) == [("moe_decode rows", "table, pdl")] and ops(1, True) == []
    tile = MoeDecodeConfig(mma_rows=32, mma_warps=16)
    monkeypatch.setattr(model_ops, "MOE_ROWS_CONFIGS", {4: tile})
    seen = []
    monkeypatch.setattr(moe_rows, "moe_decode", lambda *a, **kw: seen.append(kw["config"]))
    for b in (2, 4, 16):
        moe_rows.paths(b, True)[0][2](None, {}, None, None)
    assert seen == [None, tile, tile]


CHECK = """
import json, torch
from lily.ops.arch import force_arch
from lily.bench.gpu.kernels.common import compile_problems
from lily.ops.moe_decode import moe_decode
from lily.ops.moe_decode_config import MoeDecodeConfig
from lily.quant import QuantWeight

force_arch("sm_90")


def q(*shape, bits=4):
    meta = dict(device="meta", dtype=torch.bfloat16)
    *lead, n, k = shape
    return QuantWeight(torch.empty(*lead, n, k * bits // 32, dtype=torch.int32, device="meta"),
                       torch.empty(*lead, n, k // 64, **meta),
                       torch.empty(*lead, n, k // 64, **meta), bits, 64)


e, d, i = 256, 2048, 512
w = [q(e, d, bits=8), q(e, i, d), q(e, i, d), q(e, d, i), q(i, d), q(i, d), q(d, i),
     q(1, d, bits=8)]
x = torch.empty(8, d, dtype=torch.bfloat16, device="meta")
cfg = MoeDecodeConfig(mma_rows=64, mma_warps=4)
print(json.dumps(compile_problems(lambda: moe_decode(x, *w, 8, x, config=cfg, pdl=True))))
"""


def test_the_compile_check_names_the_launch_it_rejects():
    """compile_problems (kernels/common.py) at the model's shapes, compiled for sm_90 on the
    CPU (in a process of its own: this one interprets the kernels): a 64-row tile on 4 warps
    holds 128-256 words of codes a thread, so both tensor-core launches spill far past the
    compile matrix's limit; each problem is led by its kernel's name, as ``fit`` reads it,
    and the router launch, which fits, is not named."""
    import os
    import subprocess
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).parents[2]
    env["PYTHONPATH"] = str(root)
    out = subprocess.run([sys.executable, "-c", CHECK], env=env, cwd=root, capture_output=True,
                         text=True, timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    problems = json.loads(out.stdout.strip().splitlines()[-1])
    assert {p.split(":")[0] for p in problems} == {GATE_UP, DOWN}, problems
    assert all("stack frame (spills)" in p for p in problems if p.startswith(DOWN))
    assert fit(MoeDecodeConfig(mma_rows=64, mma_warps=4), DEFAULT, problems) is None
