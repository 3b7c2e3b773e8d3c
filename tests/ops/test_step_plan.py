"""The persistent decode step's plan (lily/ops/step_plan.py): byte counts against the
model's published per-token costs and real packed weights, the chunk split against plain
interval arithmetic, the predicted step time against hand-computed cases."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lily.checkpoint import complete_text_config, make_config
from lily.config import ModelConfig
from lily.ops.step_plan import (
    ALIGN,
    Hardware,
    Phase,
    decode_phases,
    packed_bytes,
    predict_step,
    split_chunks,
)
from lily.quant import quantize

MB = 1e6


def config(**text) -> ModelConfig:
    return ModelConfig.from_dict(make_config(complete_text_config(text), "mlx4", torch.bfloat16))


@pytest.fixture(scope="module")
def full():
    return config()


def _by_kind(phases, field="read_bytes"):
    out: dict[str, int] = {}
    for ph in phases:
        out[ph.kind] = out.get(ph.kind, 0) + getattr(ph, field)
    return out


@pytest.mark.parametrize("shape,bits", [((48, 128), 4), ((5, 320), 8), ((3, 64), 4)])
def test_packed_bytes_match_a_real_packed_weight(shape, bits):
    w = quantize(torch.randn(*shape, dtype=torch.bfloat16), bits=bits, group_size=64)
    assert w.scales.dtype == torch.bfloat16
    assert packed_bytes(*shape, bits=bits, group=64) == w.nbytes()


def test_packed_bytes_refuses_partial_groups():
    with pytest.raises(ValueError, match="whole groups"):
        packed_bytes(4, 100)


def test_full_model_bytes_match_the_published_costs(full):
    # MODEL.md, "Cost per token": experts + shared + routers ~660 MB, DeltaNet projections
    # 569 MB, attention projections 154 MB, lm_head 286 MB, DeltaNet state 60 MiB each way,
    # KV 20 KiB a token of context.
    ph = decode_phases(full, 4096)
    k = _by_kind(ph)
    norms = 2 * full.hidden_size  # the fused norm weight each projection phase reads
    moe = k["router"] + k["experts_gate_up"] + k["experts_down"] - 40 * norms
    assert moe == pytest.approx(660 * MB, rel=0.01)
    dn_out = sum(
        p.read_bytes for p in ph if p.kind == "out_proj" and p.layer not in full.attn_layers
    )
    assert k["dn_in"] - 30 * norms + dn_out == pytest.approx(569 * MB, rel=0.01)
    attn_out = sum(p.read_bytes for p in ph if p.kind == "out_proj" and p.layer in full.attn_layers)
    assert k["attn_in"] - 10 * norms + attn_out == pytest.approx(154 * MB, rel=0.01)
    assert k["lm_head"] - norms == pytest.approx(286 * MB, rel=0.01)
    state = 30 * 32 * 128 * 128 * 4
    assert state <= _by_kind(ph, "write_bytes")["deltanet"] <= state * 1.03
    longer = _by_kind(decode_phases(full, 8192))
    assert longer["attention"] - k["attention"] == 4096 * 20 * 1024
    assert len(ph) == 40 * 6 + 2


def test_phases_depend_on_the_one_before_and_experts_on_their_router(full):
    ph = decode_phases(full, 100)
    for i, p in enumerate(ph):
        assert p.after == i - 1
        if p.routed_bytes:
            assert ph[p.fetch_after].kind == "router" and p.layer == ph[p.fetch_after].layer
            assert p.slots == 8 and p.per_slot * 8 == p.routed_bytes
    assert [p.kind for p in ph[:6]] == ["dn_in", "deltanet", "out_proj", "router",
                                        "experts_gate_up", "experts_down"]  # fmt: skip
    assert ph[19].kind == "attention" and ph[-2].kind == "lm_head" and ph[-1].kind == "draw"


def test_decode_phases_refuses_an_empty_context(full):
    with pytest.raises(ValueError, match="context"):
        decode_phases(full, 0)


def _covered(chunks, phase, slot):
    spans = sorted((c.offset, c.offset + c.nbytes) for c in chunks
                   if c.phase == phase and c.slot == slot)  # fmt: skip
    return spans


@pytest.mark.parametrize("blocks,chunk", [(1, 16), (3, 48), (7, 4096), (13, 160)])
def test_split_covers_every_byte_once_in_phase_order(blocks, chunk):
    tiny = config(hidden_size=128, num_hidden_layers=4, num_experts=8, num_experts_per_tok=3,
                  moe_intermediate_size=64, shared_expert_intermediate_size=64,
                  vocab_size=320, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                  linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                  linear_value_head_dim=32)  # fmt: skip
    ph = decode_phases(tiny, 37)
    per_block = split_chunks(ph, blocks, chunk)
    assert len(per_block) == blocks
    every = [c for cl in per_block for c in cl]
    for cl in per_block:
        assert [c.phase for c in cl] == sorted(c.phase for c in cl)
    for c in every:
        assert 0 < c.nbytes <= chunk and c.nbytes % ALIGN == 0 and c.offset % ALIGN == 0
    for p, phase in enumerate(ph):
        spans = _covered(every, p, -1)  # contiguous from 0 to the phase's bytes
        assert [s for s, _ in spans] == ([0] + [e for _, e in spans[:-1]] if spans else [])
        assert (spans[-1][1] if spans else 0) == phase.fixed_bytes
        for j in range(phase.slots):
            spans = _covered(every, p, j)
            assert spans[0][0] == 0 and spans[-1][1] == phase.per_slot  # within one expert
            assert all(a == b for (_, a), (b, _) in zip(spans, spans[1:], strict=False))
        assert all(c.slot < phase.slots for c in every if c.phase == p)
    # even: the blocks' shares of a phase differ by one ALIGN unit at most
    for p in range(len(ph)):
        shares = [sum(c.nbytes for c in cl if c.phase == p and c.slot < 0) for cl in per_block]
        assert max(shares) - min(shares) <= ALIGN


def test_split_refuses_bad_sizes():
    ph = [Phase("a", 0, "x", 40, -1)]
    with pytest.raises(ValueError, match="multiple"):
        split_chunks(ph, 2, 32)
    with pytest.raises(ValueError, match="chunk"):
        split_chunks([Phase("a", 0, "x", 32, -1)], 2, 24)


HW = Hardware(bw=1e9, link=2e-6, latency=1e-6, buffer=1e6, work=1e-12, tail=0.5e-6)


def test_one_phase_is_its_stream_then_its_work():
    # 1 MB: stream 1 ms, + latency; ready at the link; then the work (1 us) and the tail.
    p = predict_step([Phase("a", 0, "x", 1_000_000, -1)], HW)
    assert p["step_s"] == pytest.approx(1e-3 + 1e-6 + 1e-6 + 0.5e-6)


def test_empty_phases_cost_a_link_and_a_tail_each():
    ph = [Phase(str(i), 0, "x", 0, i - 1) for i in range(5)]
    assert predict_step(ph, HW)["step_s"] == pytest.approx(5 * (2e-6 + 0.5e-6))


def test_routed_bytes_stream_only_after_their_router():
    router = Phase("r", 0, "router", 0, -1)
    experts = Phase("e", 0, "experts", 0, 0, routed_bytes=1000, slots=2, fetch_after=0)
    p = predict_step([router, experts], HW)
    # router done at link + tail; experts requested a link later, 1 us of stream, latency.
    r_done = 2e-6 + 0.5e-6
    want = r_done + 2e-6 + 1000 / 1e9 + 1e-6 + 1000 * 1e-12 + 0.5e-6
    assert p["step_s"] == pytest.approx(want)
    assert p["by_kind"]["experts"]["wait_us"] == pytest.approx(
        (want - r_done - 1e-9 - 0.5e-6) * 1e6
    )


def test_fixed_bytes_prefetch_under_earlier_phases_until_the_buffer_is_full():
    # Ten phases of 0.1 MB: with a 1 MB buffer all stream from the start (FIFO: 1 ms);
    # each phase's link (2 us) hides under the next 0.1 ms of data, so the step is the
    # stream, one latency and the last tail.
    ph = [Phase(str(i), 0, "x", 100_000, i - 1) for i in range(10)]
    fast = predict_step(ph, dataclasses.replace(HW, work=0.0))["step_s"]
    assert fast == pytest.approx(1e-3 + 1e-6 + 0.5e-6)
    # With room for one phase only, each waits for the one before it to be consumed.
    slow = predict_step(ph, dataclasses.replace(HW, work=0.0, buffer=100_000))["step_s"]
    assert slow > fast + 9 * 1e-6


def test_full_model_prediction_sits_between_the_stream_and_the_serial_chain(full):
    ph = decode_phases(full, 4096)
    p = predict_step(ph)
    assert p["stream_s"] < p["step_s"] < p["stream_s"] + len(ph) * 4e-6
    zero = Hardware(link=0.0, latency=0.0, work=0.0, tail=0.0)
    assert predict_step(ph, zero)["step_s"] == pytest.approx(p["stream_s"], rel=0.05)


def test_full_model_regions_need_no_padding(full):
    # decode_phases pads regions to 16-byte copies; the full model's bytes are exact.
    for ph in decode_phases(full, 4096):
        assert ph.fixed_bytes % ALIGN == 0 and ph.per_slot % ALIGN == 0
    d = full.hidden_size
    ph = decode_phases(full, 4096)
    assert ph[0].fixed_bytes == packed_bytes(12352, d) + 2 * d
    assert ph[4].per_slot == 2 * packed_bytes(512, d)
