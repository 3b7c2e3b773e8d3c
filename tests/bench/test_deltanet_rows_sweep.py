"""The batched DeltaNet benchmark (lily/bench/gpu/kernels/deltanet_rows.py) on the CPU: its
byte floor (from the sizes of real tensors at the model's shapes), the layers a graph runs
over, ``--rows``, the tiles it sweeps, the table entry it prints, its row-by-row check
(under the Triton interpreter on small odd shapes: a right launch passes, a wrong one
fails), and (with the GPU parts faked: timing, compile check) a whole sweep skipping what
the compile matrix rejects, rewriting its JSON after every line and stopping at its time
limit."""

from __future__ import annotations

import json

import pytest
import torch

import lily.model.ops as model_ops
from lily.bench.gpu.kernels import deltanet_rows as dr
from lily.bench.gpu.kernels.common import L2_BYTES
from lily.bench.gpu.kernels.mixer_deltanet import dn_inputs
from lily.ops.deltanet_decode import DeltaNetDecodeWorkspace
from tests.ops.test_deltanet_ops import make_inputs


def test_the_floor_is_the_bytes_of_the_rows_tensors():
    """layer_bytes against the sizes of one layer's tensors at the model's shapes: each
    row's states read and written, its inputs read and its output (bf16, Hv*Vd) written;
    the weights once. At 8 rows and 30 layers that is the 1 GB (about 0.2 ms at HBM rate)
    docs/notes/batching.md names."""
    d = dn_inputs(1, torch.Generator().manual_seed(0))
    state = 2 * (d["state"].nbytes + d["conv_state"].nbytes)
    inputs = sum(d[k].nbytes for k in ("mixed_qkv", "z", "b", "a"))
    out = d["z"].nbytes  # (the output has z's shape and dtype)
    weights = sum(d[k].nbytes for k in ("conv_weight", "A_log", "dt_bias", "norm_weight"))
    for b in (2, 5, 8, 16):
        assert dr.layer_bytes(b) == b * (state + inputs + out) + weights
    assert d["state"].nbytes == dr.STATE_BYTES == 2 << 20
    assert 1.0e9 < 30 * dr.layer_bytes(8) < 1.05e9


def test_the_graph_streams_its_states_from_hbm():
    for b in (2, 4, 8, 16):
        n = dr.layers_for(b)
        assert n >= 30 and n * b * dr.STATE_BYTES >= 3 * L2_BYTES, b
    assert dr.layers_for(16) == 30 and dr.layers_for(2) > 30


def test_rows_are_the_tables_keys():
    assert dr.parse_rows("8,4,2,16") == [8, 4, 2, 16]
    for bad in ("1,2", f"{model_ops.MAX_ROWS + 1}", "", "2,x"):
        with pytest.raises(ValueError, match="--rows"):
            dr.parse_rows(bad)


def test_the_sweep_covers_every_tile_once():
    tiles = dr.sweep_tiles((16, 4))
    assert len(tiles) == len(set(tiles)) == 11 and (16, 4) not in tiles
    assert set(tiles) | {(16, 4)} == {(bv, w) for bv in (8, 16, 32, 64) for w in (2, 4, 8)}
    assert len(dr.sweep_tiles((128, 4))) == 12  # a table tile off the sweep: all of it


def test_the_table_entry_reads_back_as_the_tile(monkeypatch):
    entry = dr.table_entry(8, (32, 2))
    table = eval("{" + entry + "}")  # noqa: S307
    assert table == {8: (32, 2)}
    monkeypatch.setattr(model_ops, "DELTANET_ROWS_CONFIGS", table)
    assert model_ops.deltanet_rows_config(8) == (32, 2)


def line(tile, us, err=1e-3, table=False) -> dict:
    cfg = f"table ({dr.label(tile)})" if table else dr.label(tile)
    return {"op": "deltanet_decode_rows", "config": cfg, "us": us, "GBps": 1e3 / us,
            "rel_err": err, "tile": list(tile)}  # fmt: skip


def test_the_best_line_is_the_fastest_within_bound():
    lines = [line((16, 4), 60.0, table=True), line((32, 4), 40.0), line((8, 2), 30.0, err=0.1),
             line((64, 8), 35.0, err=float("nan")), {"op": "deltanet_decode x B", "us": 1.0,
             "config": "bv16 w4", "rel_err": 0.0}]  # fmt: skip
    top = dr.best_of(8, lines)
    assert top["us"] == 40.0 and top["table_us"] == 60.0 and top["speedup"] == 1.5
    assert top["entry"] == "8: (32, 4),"
    text = dr.best_line(top)
    assert text.startswith("best B=8: bv32 w4, 40.0 us") and text.endswith("; 8: (32, 4),")
    assert "against the table's 60.0 (1.50x)" in text
    assert dr.best_of(8, lines[2:4]) is None


# ---------------------------------------------------------------- the row-by-row check

HK, HV, KD, VD = 2, 4, 32, 48


def tiny_layer(n: int, seed: int) -> dr.Layer:
    """``n`` rows of a small odd layer (Vd 48) on this machine's device, each its own
    states, one set of weights."""
    rows = [make_inputs(1, HK, HV, KD, VD, seed=seed + r) for r in range(n)]
    inputs = {k: torch.cat([r[k] for r in rows]) for k in dr.INPUTS}
    weights = {k: rows[0][k] for k in dr.WEIGHTS}
    return dr.Layer.of(inputs, weights, [r["conv_state"] for r in rows],
                       [r["state"] for r in rows])  # fmt: skip


def test_the_check_passes_a_right_launch_and_fails_a_wrong_one(poison_empty):
    """worst_row on 3 rows: deltanet_decode_rows on two tiles and the one-row calls come
    within the kernel tests' bounds of the fp32 reference of each row, on copies of the
    states (the layer's own are left as they were); rows swapped are caught."""
    poison_empty(like=False)
    layer = tiny_layer(3, seed=90)
    before = [s.clone() for s in layer.states]
    ws = DeltaNetDecodeWorkspace.new(HK, HV, VD, layer.states[0].device, rows=3)
    ws1 = DeltaNetDecodeWorkspace.new(HK, HV, VD, layer.states[0].device)
    for fn in (dr.rows_call((16, 4), ws), dr.rows_call((64, 2), ws), dr.one_by_one(ws1)):
        assert dr.worst_row(fn, layer) < dr.ERR_BOUND
    assert all(torch.equal(a, b) for a, b in zip(before, layer.states, strict=True))
    rows = dr.rows_call((16, 4), ws)
    assert dr.worst_row(lambda x: rows(x).flip(0), layer) > 10 * dr.ERR_BOUND


# ---------------------------------------------------------------- a faked sweep


class Call:
    """A stand-in for deltanet_decode_rows on ``tile`` (never run: timing is faked)."""

    def __init__(self, tile, ws):
        self.tile = tuple(tile)

    def __call__(self, layer):
        raise AssertionError("a faked sweep runs no kernel")


def fake_sweep(monkeypatch, tmp_path, max_seconds=None):
    """Bench.run at 8 rows with the table at (32, 4), its GPU parts faked: a cost model
    (wider blocks faster, 2 and 8 warps slower: (64, 4) the fastest; (64, 8) faster still
    but wrong), and a compile check that rejects (8, 8) and (64, 2)."""

    def point(fn, *args):
        bv, w = fn.tile
        us = {(64, 8): 5.0}.get(fn.tile, 100.0 / bv**0.5 + 10.0 * (w == 2) + 1.0 * (w == 8))
        err = 0.5 if fn.tile == (64, 8) else 1e-3
        return {"rel_err": err, "us": us, "GBps": 1e3 / us}

    compiled = []

    def problems(fn):
        compiled.append(fn.func.tile)
        return [f"_deltanet_decode_kernel: {fn.func.tile} spills"] * (
            fn.func.tile in ((8, 8), (64, 2)))  # fmt: skip

    writes = []
    real_write = dr.write_json
    monkeypatch.setattr(model_ops, "DELTANET_ROWS_CONFIGS", {4: (32, 4)})
    monkeypatch.setattr(dr, "rows_call", Call)
    monkeypatch.setattr(dr, "point", point)
    monkeypatch.setattr(dr, "compile_problems", problems)
    monkeypatch.setattr(dr, "write_json", lambda path, obj: writes.append(
        len(obj["deltanet_rows"])) or real_write(path, obj))  # fmt: skip
    out = tmp_path / "sweep.json"
    bench = dr.Bench({}, str(out), max_seconds)
    bench.run(dr.Rows(8, [None], None, None, 1e8, 25.0), variants=True, sweep_only=True)
    return bench, json.loads(out.read_text()), writes, compiled


def test_a_faked_sweep_skips_times_and_prints_the_entry(monkeypatch, tmp_path):
    bench, saved, writes, compiled = fake_sweep(monkeypatch, tmp_path)
    timed = [r["config"] for r in bench.results]
    assert timed[0] == "table (bv32 w4)" and len(timed) == 1 + 11 - 2
    assert "bv8 w8" not in timed and "bv64 w2" not in timed and "bv32 w4" not in timed[1:]
    assert {s["config"]: s["reason"] for s in bench.skipped} == {
        "bv8 w8": "_deltanet_decode_kernel: (8, 8) spills",
        "bv64 w2": "_deltanet_decode_kernel: (64, 2) spills"}  # fmt: skip
    assert (32, 4) not in compiled and len(compiled) == 11
    best = bench.best[8]
    assert best["entry"] == "8: (64, 4)," and best["us"] == 12.5
    assert best["table_us"] == pytest.approx(100.0 / 32**0.5)
    # the JSON was rewritten after every line and holds the whole run
    assert writes[: len(bench.results)] == list(range(1, len(bench.results) + 1))
    assert len(saved["deltanet_rows"]) == len(bench.results)
    assert saved["best"]["8"]["entry"] == "8: (64, 4),"


def test_a_faked_sweep_stops_at_its_time_limit(monkeypatch, tmp_path):
    bench, saved, _, compiled = fake_sweep(monkeypatch, tmp_path, max_seconds=1e-9)
    assert bench.results == [] and bench.best == {} and compiled == []
    assert [s["reason"] for s in saved["skipped"]] == ["past --max-seconds"] * 12


def test_the_script_is_listed():
    from lily.bench import gpu

    assert "kernels.deltanet_rows" in gpu.scripts()
