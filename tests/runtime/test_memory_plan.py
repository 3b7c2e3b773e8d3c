"""The memory plan (lily/runtime/memory_plan.py) against numbers worked out by hand for the
real model, the K/V growth policy (lily/runtime/state.py), and the context the engine picks
from a given free-memory figure."""

from __future__ import annotations

import pytest
import torch

from lily.checkpoint import FULL_TEXT_CONFIG, TINY_TEXT_CONFIG
from lily.config import EngineConfig, ModelConfig
from lily.runtime import memory_plan
from lily.runtime.memory_plan import (
    ContextDoesNotFit,
    kv_bytes_per_token,
    largest_context,
    plan,
    scratch_bytes,
    state_bytes,
)
from lily.runtime.state import KV_STEP, SessionState, kv_capacity

MiB, GiB = 1 << 20, 1 << 30
FULL = ModelConfig.from_dict(FULL_TEXT_CONFIG)
TINY = ModelConfig.from_dict(TINY_TEXT_CONFIG)
WEIGHTS = 19_508_789_376  # the full model's 4-bit weights (bench/results/*_h200*.json)
DEFAULTS = dict(chunk=2048, kernels=True, graphs=True, prefix_cache_bytes=1 * GiB)


def test_per_token_and_state_bytes_of_the_real_model():
    # 10 attention layers x (K, V) x 2 KV heads x 256 dims x 2 bytes (MODEL.md: 20 KiB)
    assert kv_bytes_per_token(FULL, torch.bfloat16) == 20 * 1024
    # 30 DeltaNet layers x (conv 3 x 8192 bf16 + recurrent 32 x 128 x 128 fp32)
    assert state_bytes(FULL, torch.bfloat16) == 30 * (3 * 8192 * 2 + 32 * 128 * 128 * 4)
    assert state_bytes(FULL, torch.bfloat16) == 64_389_120


def test_scratch_of_a_2048_token_chunk_by_hand():
    # Bytes a token of the chunk holds while each layer kind runs (bf16 activations):
    deltanet = (
        (8192 + 4096 + 64) * 2  # fused in_proj output: qkv 8192, z 4096, b and a 32 each
        + 8192 * 2  # conv output
        + 2 * 32 * 4  # g and beta, fp32
        + 32 * 128 * 4  # the recurrence's fp32 output
        + 32 * (128 + 128) * 2  # w and u
        + 4096 * 2  # gated norm output
    )
    assert deltanet == 82_304
    attention = (16 * 512 + 2 * 2 * 256) * 2 + 2 * 16 * 256 * 2  # q|gate|k|v, q, out
    moe = 256 * 4 + 4 * 9 * 4 + 9 * 512 * 2 + 9 * 2048 * 2 + 2 * 2048 * 2
    assert (attention, moe) == (34_816, 55_440)
    partials = 128 * MiB  # attention prefill's split partials, capped per call
    residual = 2 * 2048 * 2
    tail = 2 * 248_320 * 4 + 4 * 248_320 * 8  # fp32 logits twice, the sampler's lanes
    # the partials live beside attention's temporaries: that layer is the largest here
    layer = max(2048 * deltanet, 2048 * moe, 2048 * attention + partials)
    want = 2048 * residual + layer + tail
    assert scratch_bytes(FULL, torch.bfloat16, 2048, True, 131072) == want == 232_230_912


def test_plan_for_128k_by_hand_and_within_the_bar():
    p = plan(FULL, torch.bfloat16, weights=WEIGHTS, max_context=131072, **DEFAULTS)
    assert p.kv == 131072 * 20480 == 2_684_354_560  # 2.5 GiB
    assert p.kv_growth == 131072 * 2 * 256 * 2  # one layer's K (or V) buffer
    assert p.states == 2 * 64_389_120
    assert p.graphs == 64 * MiB and p.prefix_cache == GiB and p.margin == 256 * MiB
    parts = (WEIGHTS + 2_684_354_560 + 134_217_728 + 128_778_240 + 232_230_912 + 64 * MiB
             + GiB + 256 * MiB)  # fmt: skip
    assert p.total == parts == 24_097_656_960
    # Even with every reserve full (a 1 GiB prefix cache, graphs, margin), 128K plans under
    # the 22.5 GiB bar of issue 25.
    assert p.total <= 22.5 * GiB


def test_a_context_past_a_step_plans_the_capacity_it_reaches():
    p = plan(FULL, torch.bfloat16, weights=0, max_context=131073, **DEFAULTS)
    assert p.kv == 20480 * 131073  # the limit clamps the last step
    q = plan(FULL, torch.bfloat16, weights=0, max_context=100, **DEFAULTS)
    assert q.kv == 20480 * 100  # a context under one step holds just that


@pytest.mark.parametrize("positions,limit,cap", [
    (1, 262144, 256), (256, 262144, 256), (257, 262144, 4096), (4096, 262144, 4096),
    (4097, 262144, 8192), (131072, 262144, 131072), (131073, 262144, 135168),
    (131073, 132000, 132000), (300, 1000, 1000), (100, 64, 64),
])  # fmt: skip
def test_kv_capacity_steps_and_clamps(positions, limit, cap):
    assert kv_capacity(positions, limit) == cap


def test_cache_grows_in_steps_keeps_its_rows_and_stops_at_the_limit():
    limit = 3 * KV_STEP + 100
    st = SessionState.new(TINY, "cpu", torch.float32, limit)
    c = next(iter(st.kv.values()))
    assert c.capacity == 256
    c.k[:, :256] = torch.randn(c.k.shape[0], 256, c.k.shape[2])
    kept = c.k[:, :256].clone()
    seen = []
    for n in range(1, limit + 1, 37):  # a decode-like walk, one position at a time
        c.ensure(n)
        seen.append(c.capacity)
    c.ensure(limit)
    seen.append(c.capacity)
    assert sorted(set(seen)) == [256, KV_STEP, 2 * KV_STEP, 3 * KV_STEP, limit]
    assert max(seen) == limit  # never past the limit (doubling went to 2 x 8192 here)
    assert torch.equal(c.k[:, :256], kept)
    assert not c.k[:, 256:].any()  # the grown tail starts at zero
    with pytest.raises(ValueError, match="exceeds the cache limit"):
        c.ensure(limit + 1)


def test_reserve_grows_every_layer_once_and_clamps_to_the_limit():
    st = SessionState.new(TINY, "cpu", torch.float32, 5000)
    st.reserve(4097)
    assert {c.capacity for c in st.kv.values()} == {5000}
    st.reserve(10**6)  # clamped, no error
    assert {c.capacity for c in st.kv.values()} == {5000}


def test_engine_reserves_the_prompt_and_a_step_not_twice_the_prompt(tmp_path):
    from lily.checkpoint import write_random_checkpoint
    from lily.runtime.engine import Engine
    from lily.runtime.sampling import SamplingParams

    write_random_checkpoint(tmp_path, dict(TINY_TEXT_CONFIG, max_position_embeddings=65536),
                            "mlx4", seed=0, progress=False)  # fmt: skip
    ecfg = EngineConfig(max_context=65536, prefill_chunk=5000, prefix_cache_gb=0.0)
    engine = Engine.load(tmp_path, ecfg, progress=False)
    ids = [(5 * i) % 400 + 10 for i in range(5000)]
    with torch.inference_mode():
        list(engine.generate(ids, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)))
    # the old doubling reached 10,000 positions on the first decode step after 5,000
    assert {c.capacity for c in engine.state.kv.values()} == {8192}


def _tiny_kw():
    return dict(chunk=64, kernels=False, graphs=False, prefix_cache_bytes=0)


def test_largest_context_from_a_free_figure_by_hand():
    # Full model on a 24 GiB card: about 5 GiB beside the weights. Each token costs its
    # K/V (20 KiB) and a 20th of that while a buffer grows (1 KiB); the rest is fixed.
    free = 5 * GiB
    fixed = 2 * 64_389_120 + 232_230_912 + 64 * MiB + GiB + 256 * MiB
    want = (free - fixed) // (20480 + 1024) // KV_STEP * KV_STEP
    got = largest_context(FULL, torch.bfloat16, free, 262144, **DEFAULTS)
    assert got == want == 163_840  # 160K: 128K fits on a 24 GiB card with the default reserves
    assert largest_context(FULL, torch.bfloat16, 10**13, 262144, **DEFAULTS) == 262144
    with pytest.raises(ContextDoesNotFit, match="--prefix-cache-gb"):
        largest_context(FULL, torch.bfloat16, GiB, 262144, **DEFAULTS)


def test_engine_picks_its_context_from_the_free_memory(tmp_path, monkeypatch):
    from lily.checkpoint import write_random_checkpoint
    from lily.runtime.engine import Engine

    write_random_checkpoint(tmp_path, dict(TINY_TEXT_CONFIG, max_position_embeddings=65536),
                            "mlx4", seed=0, progress=False)  # fmt: skip
    cfg = ModelConfig.from_dir(tmp_path)
    ecfg = EngineConfig(max_context=None, prefill_chunk=64, prefix_cache_gb=0.0)
    room = plan(cfg, torch.float32, weights=0, max_context=3 * KV_STEP, **_tiny_kw())
    monkeypatch.setattr(memory_plan, "free_bytes", lambda device: room.beyond_weights + 1000)
    engine = Engine.load(tmp_path, ecfg, progress=False)
    assert engine.max_context == 3 * KV_STEP and engine.memory_plan.auto
    assert engine.state.limit == 3 * KV_STEP
    assert engine.memory_plan.fits
    ecfg = EngineConfig(max_context=40000, prefill_chunk=64, prefix_cache_gb=0.0)
    explicit = Engine.load(tmp_path, ecfg, progress=False)
    assert explicit.max_context == 40000 and not explicit.memory_plan.auto
    assert not explicit.memory_plan.fits  # the report warns: more than the free memory


def test_part_bytes_is_the_kernels_cap():
    from lily.ops.attention_prefill import PART_BYTES

    assert memory_plan.PART_BYTES == PART_BYTES


def test_batched_steps_grow_the_plan_with_max_running():
    """Requests decoded together (lily serve --max-running) add the batched steps' buffers
    to the plan, more with every row, nothing for one request at a time or without
    graphs; the figure covers what the runner really allocates for them (each batch
    size's logits buffer, which its graphs share, and the rows sampler's tables)."""
    from lily.runtime.memory_plan import batch_bytes
    from lily.runtime.rows import RowBuffers
    from lily.runtime.rows_sampling import RowsSampler

    kw = dict(DEFAULTS, weights=WEIGHTS, max_context=32768)
    one = plan(FULL, torch.bfloat16, **kw)
    assert one.batch == 0 and plan(FULL, torch.bfloat16, max_running=1, **kw) == one
    eager = plan(FULL, torch.bfloat16, max_running=8, **dict(kw, graphs=False))
    assert eager.batch == 0
    sizes = [plan(FULL, torch.bfloat16, max_running=n, **kw) for n in range(2, 17)]
    assert all(a.batch < b.batch for a, b in zip(sizes, sizes[1:], strict=False))
    eight = sizes[6]
    assert eight.max_running == 8 and eight.parts()["batched_steps"] == eight.batch
    assert eight.total == one.total + eight.batch
    # what the runner holds for batches of 2-8 rows (CPU tensors of the real sizes)
    v = FULL.vocab_size
    logits = sum(RowBuffers(FULL, b, "cpu").logits_buffer(v).nbytes for b in range(2, 9))
    rs = RowsSampler(16, v, "cpu")
    held = logits + rs.seen.nbytes + rs.counts.nbytes
    # and the largest step's fp32 logits and penalized copy: at least two (8, V) fp32
    assert eight.batch >= held + 2 * 8 * v * 4
    assert eight.batch == batch_bytes(FULL, torch.bfloat16, 8, 32768) < GiB // 4


def test_engine_context_leaves_room_for_batched_steps():
    """From a free-memory figure, an engine that decodes up to 8 requests together picks
    a smaller context than one that decodes one at a time, and its plan still fits."""
    from lily.runtime.memory_plan import engine_plan

    free = 5 * GiB
    ecfg = EngineConfig(device="cpu", max_context=None, prefill_chunk=2048, use_kernels=True)
    alone = engine_plan(FULL, ecfg, torch.bfloat16, {}, graphs=True, free=free)
    batched = engine_plan(FULL, EngineConfig(**{**ecfg.__dict__, "max_running": 8}),
                          torch.bfloat16, {}, graphs=True, free=free)  # fmt: skip
    assert alone.max_context == 163_840 and alone.batch == 0  # (as by hand above)
    assert batched.batch > 0 and batched.max_context < alone.max_context
    assert batched.fits and batched.beyond_weights <= free
