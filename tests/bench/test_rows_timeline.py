"""rows_timeline's variants on the CPU: each sets the engine's switches where they live (the
model's ops, or the rows' GEMV for OPERAND_POW2), drops the captured graphs, and puts
everything back afterwards, also when the measurement fails."""

from __future__ import annotations

import pytest

import lily.model.ops as model_ops
import lily.ops.qgemv_mma_rows as rows_mod
from lily.bench.gpu.diagnostics import rows_timeline


class _Runner:
    def __init__(self) -> None:
        self.graphs = {"B=4": object()}


def test_every_variant_names_a_real_switch():
    for name, switches in rows_timeline.SWITCHES.items():
        for key in switches:
            owner = rows_timeline._owner(key)
            assert hasattr(owner, key), (name, key)


def test_a_variant_switches_and_restores(monkeypatch):
    monkeypatch.setattr(rows_mod, "OPERAND_POW2", True)
    monkeypatch.setattr(model_ops, "ROWS_PREP_HEAD", True)
    runner = _Runner()
    with rows_timeline.switched("no_pow2", runner):
        assert rows_mod.OPERAND_POW2 is False
        assert model_ops.ROWS_PREP_HEAD is True
        assert runner.graphs == {}
        assert not hasattr(model_ops, "OPERAND_POW2")  # set where the GEMV reads it
        runner.graphs["B=4"] = object()
    assert rows_mod.OPERAND_POW2 is True and runner.graphs == {}
    with pytest.raises(RuntimeError), rows_timeline.switched("no_head_prep", runner):
        assert model_ops.ROWS_PREP_HEAD is False
        raise RuntimeError("a failed measurement")
    assert model_ops.ROWS_PREP_HEAD is True


def test_every_table_is_the_earlier_moe_entries():
    table = model_ops.MOE_ROWS_CONFIGS
    assert model_ops.moe_rows_config(8).route_once and model_ops.moe_rows_config(4).down_operand
    with rows_timeline.switched("every_table", _Runner()):
        assert model_ops.MOE_ROWS_CONFIGS is model_ops.MOE_ROWS_EVERY
        assert not any(model_ops.moe_rows_config(b).route_once for b in (2, 4, 8))
        assert model_ops.moe_rows_config(8).mma_warps == 4
    assert model_ops.MOE_ROWS_CONFIGS is table


def test_an_unknown_variant_is_refused():
    with pytest.raises(SystemExit, match="unknown variant 'fast'.*no_pow2"):
        with rows_timeline.switched("fast", _Runner()):
            pass


def test_the_route_entry_variants_change_only_those_entries():
    table = model_ops.MOE_ROWS_CONFIGS
    assert table[8].down_early and not table[2].route_once
    with rows_timeline.switched("no_down_early", _Runner()):
        now = model_ops.MOE_ROWS_CONFIGS
        assert not now[8].down_early and not now[4].down_early and now[8].down_operand
        assert now[2] is table[2]
    with rows_timeline.switched("down_n32w8", _Runner()):
        now = model_ops.MOE_ROWS_CONFIGS
        assert (now[8].mma_down_rows, now[8].mma_down_warps) == (32, 8) and now[8].down_early
        assert now[2] is table[2]
    assert model_ops.MOE_ROWS_CONFIGS is table
