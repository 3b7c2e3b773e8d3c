"""The batched projections benchmark (lily/bench/gpu/kernels/gemv_rows.py) on the CPU: the
shapes ``--shapes`` picks, the tiles ``--variants`` sweeps, the paths a run times, and the
fastest line as a MEASURED_TILES entry that qgemv_mma_rows' table then serves."""

from __future__ import annotations

import sys

import pytest

from lily.bench.gpu.kernels import gemv_rows
from lily.ops.qgemv_mma import MmaGemvConfig


def test_shapes_by_their_first_word(monkeypatch, capsys):
    assert gemv_rows.pick_shapes(None) == gemv_rows.SHAPES
    picked = gemv_rows.pick_shapes("o_proj, attn")
    assert [(s[1], s[2]) for s in picked] == [(2048, 4096), (9216, 2048)]
    assert [s[0] for s in gemv_rows.pick_shapes("dn,lm_head")] == ["dn qkv|z|b|a", "lm_head"]
    with pytest.raises(ValueError, match=r"unknown \['qkv'\].*'attn', 'dn', 'lm_head'"):
        gemv_rows.pick_shapes("o_proj,qkv")
    # on the command line: a usage error naming the shapes, before anything runs
    monkeypatch.setattr(sys, "argv", ["gemv_rows", "--shapes", "oproj"])
    with pytest.raises(SystemExit) as e:
        gemv_rows.main()
    assert e.value.code == 2 and "unknown ['oproj']" in capsys.readouterr().err


def test_the_sweep_and_the_paths():
    """SWEEP: 16/32/64 rows on 4/8/16 warps; without --variants the paths are the ones
    always timed; --sweep-only keeps qgemv_mma_rows (the table's and the sweep's tiles)."""
    assert {(c.block_n, c.num_warps) for c in gemv_rows.SWEEP} == {
        (n, w) for n in (16, 32, 64) for w in (4, 8, 16)}  # fmt: skip

    def ops(b, norm, variants=(), sweep_only=False, op="qgemv_mma_rows"):
        return [(p[0], p[1], p[3])
                for p in gemv_rows.paths(b, norm, None, variants, sweep_only, op)]  # fmt: skip

    assert [o[0] for o in ops(4, True)] == [
        "qgemv_mma_rows", "rmsnorm+qgemv_mma_rows", "rows_prep+qgemv_mma_rows",
        "qgemv_mma_rows pow2", "qgemv_mma_rows prepared", "qgemv", "qgemm",
        "qgemv_mma x B"]  # fmt: skip
    assert [o[0] for o in ops(16, False)] == ["qgemv_mma_rows", "qgemv_mma_rows prepared",
                                              "qgemm", "qgemv_mma x B"]  # fmt: skip
    tiles = [MmaGemvConfig(16, 8), MmaGemvConfig(32, 4)]
    assert ops(8, True, tiles, True) == [("qgemv_mma_rows", "table", None),
                                         ("qgemv_mma_rows", "n16 w8", tiles[0]),
                                         ("qgemv_mma_rows", "n32 w4", tiles[1])]  # fmt: skip
    # the lm_head: its norm a launch of its own in the batched step, and so in its sweep
    # (without ROWS_PREP; with it every normed shape's rows are prepared by rows_prep)
    import lily.model.ops as model_ops

    split = gemv_rows.swept("lm_head")
    assert split == "rmsnorm+qgemv_mma_rows" and gemv_rows.swept("o_proj") == "qgemv_mma_rows"
    assert gemv_rows.swept("dn", True) == ("rows_prep+qgemv_mma_rows" if model_ops.ROWS_PREP
                                           else "qgemv_mma_rows")  # fmt: skip
    prep = "rows_prep+qgemv_mma_rows"
    assert ops(8, True, tiles[1:], True, prep) == [(prep, "table", None),
                                                   (prep, "n32 w4", tiles[1])]  # fmt: skip
    assert ops(16, True, tiles[:1], True, split) == [(split, "table", None),
                                                     (split, "n16 w8", tiles[0])]  # fmt: skip


def test_the_fastest_tile_becomes_a_table_entry(monkeypatch):
    """The fastest qgemv_mma_rows line within the bound (not a faster one out of it, nor
    another op) is printed against the table's as a MEASURED_TILES entry; put in the table,
    that entry is the tile qgemv_mma_rows then takes at that B and above."""
    import lily.ops.qgemv_mma_rows as mod

    def line(op, config, tile, us, err=3e-3):
        return {"shape": "o_proj", "op": op, "config": config, "tile": tile, "us": us,
                "rel_err": err}  # fmt: skip

    lines = [line("qgemv_mma_rows", "table (n16 w16)", (16, 16), 7.2),
             line("qgemv_mma_rows", "n16 w8", (16, 8), 5.8),
             line("qgemv_mma_rows", "n32 w8", (32, 8), 4.0, err=0.2),
             {"shape": "o_proj", "op": "qgemv", "config": "table", "us": 3.0,
              "rel_err": 0.0}]  # fmt: skip
    top = gemv_rows.fastest(lines, 2048, 4096, 64, 4)
    assert (top["config"], top["us"], top["table_us"]) == ("n16 w8", 5.8, 7.2)
    assert top["entry"] == "(2048, 4096, 64): {4: MmaGemvConfig(16, 8)}"
    assert "n16 w8 5.80 us against table (n16 w16) 7.20 (1.24x)" in gemv_rows.best_line(top)
    entry = eval("{" + top["entry"] + "}", {"MmaGemvConfig": MmaGemvConfig})  # noqa: S307
    monkeypatch.setattr(mod, "MEASURED_TILES", entry)
    mod.mma_rows_config.cache_clear()
    try:
        assert mod.mma_rows_config(2048, 4096, 64, 4) == MmaGemvConfig(16, 8)
        assert mod.mma_rows_config(2048, 4096, 64, 3) != MmaGemvConfig(16, 8)
    finally:
        mod.mma_rows_config.cache_clear()
