"""In-process checks of the request limits: the memory estimate against the engine's real
session state, the memory guard's arithmetic, and the strict JSON reader."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from lily.server.guard import MAX_JSON_DEPTH, BadJson, strict_loads
from lily.server.limits import MemoryGuard, _meminfo_available, estimate, kv_capacity

MiB = 1 << 20


@pytest.fixture(scope="module")
def engine_factory(model_dir):
    from lily.config import EngineConfig
    from lily.runtime.engine import Engine

    def make(chunk: int, limit: int):
        # No prefix cache: every request starts from a fresh state, as the estimate assumes.
        cfg = EngineConfig(max_context=limit, prefill_chunk=chunk, prefix_cache_gb=0.0)
        return Engine.load(model_dir, cfg, progress=False)

    return make


@pytest.mark.parametrize(
    "n_prompt,n_new,chunk,limit",
    [(30, 5, 2048, 512), (250, 12, 2048, 512), (300, 3, 64, 512), (250, 12, 2048, 300),
     (97, 170, 33, 1024), (1, 1, 2048, 512)],
)  # fmt: skip
def test_estimate_matches_the_engines_real_state(engine_factory, n_prompt, n_new, chunk, limit):
    from lily.runtime.sampling import SamplingParams

    engine = engine_factory(chunk, limit)
    ids = [(7 * i) % 400 + 10 for i in range(n_prompt)]
    params = SamplingParams(max_tokens=n_new, ignore_eos=True, seed=0)
    with torch.inference_mode():
        steps = list(engine.generate(ids, params))
    assert steps[-1].finish_reason == "length"
    state = engine.state
    # The last sampled token is never fed back, so the state holds one position less.
    assert state.length == n_prompt + n_new - 1
    caps = {c.capacity for c in state.kv.values()}
    assert caps == {kv_capacity(n_prompt, state.length, chunk, limit)}
    est = estimate(engine.cfg, engine.dtype, n_prompt, state.length, chunk, limit, False)
    assert state.nbytes() == est.kv + est.recurrent
    # The estimate the server uses (for n_prompt + max_tokens) is never below it.
    served = estimate(engine.cfg, engine.dtype, n_prompt, n_prompt + n_new, chunk, limit, False)
    assert served.kv >= est.kv and served.total > state.nbytes()


def test_estimate_of_the_full_model_in_bf16():
    # Qwen3.6-35B-A3B: 10 full-attention layers x 2 KV heads x 256 dims, 30 DeltaNet layers.
    from lily.checkpoint import FULL_TEXT_CONFIG
    from lily.config import ModelConfig

    cfg = ModelConfig.from_dict(FULL_TEXT_CONFIG)
    est = estimate(cfg, torch.bfloat16, 1000, 262144, 2048, 262144, True)
    assert est.kv == 10 * 2 * 2 * 256 * 2 * 262144  # 5 GiB of K/V for the whole window
    conv = 3 * (2 * 16 * 128 + 32 * 128) * 2
    assert est.recurrent == 30 * (conv + 32 * 128 * 128 * 4)


def _fake_engine(state_bytes: int, cache_budget: int, cache_used: int, device: str = "cpu",
                 idle: list[int] = ()):  # fmt: skip
    """An engine whose working states hold ``state_bytes`` (of which ``idle`` states hold
    the given bytes; ``dropped`` records ``drop_idle`` calls)."""
    from lily.checkpoint import TINY_TEXT_CONFIG
    from lily.config import ModelConfig

    e = SimpleNamespace(
        cfg=ModelConfig.from_dict(TINY_TEXT_CONFIG),
        dtype=torch.float32,
        max_context=1024,
        engine_cfg=SimpleNamespace(device=device, prefill_chunk=2048, use_kernels=False),
        states_nbytes=lambda: state_bytes,
        idle_nbytes=lambda: sum(e.idle),
        largest_idle_nbytes=lambda: max(e.idle, default=0),
        prefix_cache=SimpleNamespace(budget=cache_budget, nbytes=lambda: cache_used),
        idle=list(idle),
        dropped=[],
    )
    e.drop_idle = lambda keep: e.dropped.append(keep)
    return e


def test_available_counts_reusable_state_and_what_the_cache_may_take():
    snap = 3 * (3 * 256 * 4 + 4 * 32 * 32 * 4)  # the tiny model's DeltaNet states, fp32
    e = _fake_engine(state_bytes=3 * MiB, cache_budget=100 * MiB, cache_used=40 * MiB)
    g = MemoryGuard(e, None, free_reader=lambda: 1024 * MiB)
    # free + the working state (reused) - its copy and 8 snapshots in the cache - margin
    assert g.available() == (1024 + 3 - 3 - 256) * MiB - 8 * snap
    full = _fake_engine(state_bytes=3 * MiB, cache_budget=100 * MiB, cache_used=99 * MiB)
    g = MemoryGuard(full, None, free_reader=lambda: 1024 * MiB)
    assert g.available() == (1024 + 3 - 1 - 256) * MiB  # the cache can grow 1 MiB only
    assert MemoryGuard(e, 5 * MiB, free_reader=lambda: 1024 * MiB).available() == 5 * MiB
    assert MemoryGuard(e, 5 * MiB, free_reader=lambda: None).available() == 5 * MiB
    assert MemoryGuard(e, None, free_reader=lambda: None).available() is None
    assert MemoryGuard(e, None, free_reader=lambda: 10 * MiB).available() == 0  # margin


def test_admission_counts_what_running_requests_will_still_need():
    """Beside running requests, a new one starts when all of them fit at their ends (one
    prefill's workspace only); idle working states are given back when their memory is
    what makes it fit."""
    e = _fake_engine(state_bytes=0, cache_budget=0, cache_used=0)
    one = estimate(e.cfg, torch.float32, 100, 600, 2048, 1024, False)
    free = 256 * MiB + 3 * one.total - 2 * one.workspace  # the margin and three requests
    g = MemoryGuard(e, None, free_reader=lambda: free)
    assert g.admits(100, 600, [(100, 600), (100, 600)])
    assert not g.admits(100, 600, [(100, 600)] * 3)
    assert not g.admits(100, 1024, [(100, 600)] * 2)  # a longer context: a bigger cache
    assert MemoryGuard(e, None, free_reader=lambda: None).admits(100, 600, [(1, 1024)] * 50)
    assert e.dropped == []
    # Half of the room is in two idle states: the request fits only once they are given back.
    e = _fake_engine(state_bytes=free // 2, cache_budget=0, cache_used=0,
                     idle=[free // 4, free // 4])  # fmt: skip
    g = MemoryGuard(e, None, free_reader=lambda: free - free // 2)
    assert g.admits(100, 600, [(100, 600), (100, 600)]) and e.dropped == [1]
    e.dropped.clear()
    roomy = MemoryGuard(e, None, free_reader=lambda: 2 * free)
    assert roomy.admits(100, 600, [(100, 600)]) and e.dropped == []  # no need


def test_fit_finds_the_largest_total_that_fits():
    e = _fake_engine(0, 0, 0)
    need = estimate(e.cfg, torch.float32, 20, 256, 2048, 1024, False).total
    over = estimate(e.cfg, torch.float32, 20, 257, 2048, 1024, False).total
    g = MemoryGuard(e, (need + over) // 2, free_reader=lambda: None)
    assert g.fit(20, 200)[0] == 200  # fits as asked
    assert g.fit(20, 1000)[0] == 256  # past 256 positions the K/V cache grows a step
    tiny = MemoryGuard(e, 1000, free_reader=lambda: None)
    total, est, avail = tiny.fit(20, 100)
    assert total == 20 and est.total > avail == 1000  # not even one token fits


def test_meminfo_is_read():
    avail = _meminfo_available()
    total = 0
    with open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                total = int(line.split()[1]) * 1024
    assert avail is not None and 0 < avail <= total


# ---- strict JSON
@pytest.mark.parametrize(
    "raw,says",
    [
        (b'{"t": NaN}', "NaN"),
        (b'{"t": -Infinity}', "Infinity"),
        (b'{"t": 1e400}', "out of range"),
        (b'{"t": -1e400}', "out of range"),
        (b'{"a": "\\udc80"}', "surrogate"),
        (b'{"\\ud800": 1}', "surrogate"),
        (b'"\xc3\x28"', "UTF-8"),
        (b"\xef\xbb\xbf{}", "JSON"),  # a BOM is not JSON text (RFC 8259 section 8.1)
        (b"[1] x", "JSON"),
        (b"1" * 5000, "JSON"),
        (b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1), "nested"),
        (b'{"a":' * (MAX_JSON_DEPTH + 1) + b"0" + b"}" * (MAX_JSON_DEPTH + 1), "nested"),
        (b"[" * 100000 + b"]" * 100000, "nested"),
    ],
)  # fmt: skip
def test_strict_loads_refuses_what_json_does_not_allow(raw, says):
    with pytest.raises(BadJson, match=says):
        strict_loads(raw)


@pytest.mark.parametrize(
    "text",
    ['{"a": [1, 2.5, -0.0, 1e300, true, null, "\\u00e9\\ud83d\\ude00"]}',
     "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH, '"plain"', "12345678901234567890"],
)  # fmt: skip
def test_strict_loads_reads_valid_json_as_json_does(text):
    assert strict_loads(text.encode()) == json.loads(text)


def test_strict_loads_keeps_floats_finite():
    v = strict_loads(b"[1.7976931348623157e308, 5e-324]")
    assert all(math.isfinite(x) for x in v) and v[1] > 0
