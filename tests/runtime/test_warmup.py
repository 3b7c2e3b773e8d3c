"""Kernel warm-up (lily/runtime/warmup.py): which shapes it runs, and that it leaves nothing
behind: the working state, the prefix cache and the first request are as without it.

The warm-up itself only matters on a GPU (lily/bench/gpu/e2e/warmup_check.py times it there); here
its machinery runs on the reference path (``force``), whose forward is fast on the CPU.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lily.bench.random_model import model_config
from lily.config import EngineConfig
from lily.runtime.engine import Engine
from lily.runtime.runner import Runner
from lily.runtime.sampling import SamplingParams
from lily.runtime.warmup import (
    GEMV_ROWS,
    Probe,
    batch_probes,
    chunk_lengths,
    decode_starts,
    gemm_shapes,
    prefill_probes,
    warm_up,
)

FULL = model_config("full")


def _classes(t: int, chunk_cfg) -> tuple:
    """Everything a chunk length selects: the tiles of every GEMM, the MoE and router tiles,
    and the divisibility class of the ints that depend on it."""
    from lily.ops.moe_prefill import moe_prefill_config, router_gemm_config
    from lily.ops.qgemm import gemm_config

    cfg = chunk_cfg
    moe = moe_prefill_config(t, cfg.num_experts_per_tok, cfg.num_experts)
    bm = moe.block_m
    tiles = -(-t * cfg.num_experts_per_tok // bm) + cfg.num_experts + -(-t // bm)
    gemms = tuple(gemm_config(t, n, k, 64) for n, k in gemm_shapes(cfg))
    rows = t * cfg.num_attention_heads
    return gemms, moe, router_gemm_config(t, 64), t % 16 == 0, tiles % 16 == 0, rows % 16 == 0


@pytest.mark.parametrize("name,chunk", [("full", 2048), ("full", 4096), ("full", 300),
                                        ("tiny", 64)])  # fmt: skip
def test_chunk_lengths_cover_every_class_a_prompt_can_hit(name, chunk):
    cfg = model_config(name)
    reps = chunk_lengths(cfg, chunk)
    assert set(range(2, GEMV_ROWS + 1)) <= set(reps) and chunk in reps
    every = {_classes(t, cfg) for t in range(GEMV_ROWS + 1, chunk + 1)}
    covered = {_classes(t, cfg) for t in reps if t > GEMV_ROWS}
    assert covered == every
    assert len(reps) < 60  # a few seconds of warm-up with Triton's cache warm


def test_probes_cover_fresh_resumed_and_long_prompts_within_the_context():
    probes = prefill_probes(FULL, 2048, 262144)
    full = [p for p in probes if p.tokens == 2048]
    assert {p.start for p in full} == {0, 2048, 2048 + 7}  # fresh, its second chunk, resumed
    assert any(p.cuts for p in full if p.start == 0)  # a fresh chat prompt's snapshots
    assert any(p.start >= 16384 and p.start % 16 for p in probes)  # short after long history
    assert [p for p in probes if p.tokens == 1]  # one-token chunks
    small = prefill_probes(FULL, 2048, 3000)
    assert small and all(p.start + p.tokens < 3000 for p in small)
    assert all(0 < c < p.tokens for p in probes for c in p.cuts)


@pytest.mark.parametrize("cap", [64, 256, 1000, 4096, 8192, 135168])
def test_decode_starts_cover_every_bucket_of_the_runner(cap):
    state = SimpleNamespace(kv={3: SimpleNamespace(capacity=cap)})
    want = {Runner._bucket(None, s, state) for s in range(0, cap, 7)}
    want.add(Runner._bucket(None, cap - 1, state))
    got = {Runner._bucket(None, s, state) for s in decode_starts(cap)}
    assert got == want and all(s < cap for s in decode_starts(cap))


@pytest.fixture
def make_engine(hf_tiny_dir):
    def make():
        ecfg = EngineConfig(prefill_chunk=16, max_context=1024)
        engine = Engine.load(hf_tiny_dir, ecfg, progress=False)
        # the device sampler's hooks, as the kernel runner has them (run eagerly here)
        engine.runner = Runner(engine.model, 16, sample_on_device=True)
        return engine

    return make


PROBES = [Probe(5, 0, (1, 3)), Probe(16, 16), Probe(9, 23, (4,)), Probe(1, 99)]


def _requests(engine: Engine) -> list:
    ids = [(13 * i) % 400 + 7 for i in range(40)]
    out = []
    for params in (SamplingParams(temperature=0.0, max_tokens=6, logprobs=2, ignore_eos=True),
                   SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=6,
                                  ignore_eos=True)):  # fmt: skip
        steps = list(engine.generate(ids, params))
        out.append([(s.token_id, s.logprob, s.top_logprobs) for s in steps])
        ids = ids + [s.token_id for s in steps if s.token_id is not None] + [9, 10]
    return out


def _fingerprint(engine: Engine) -> dict:
    st = engine.state
    n = st.length
    return {
        "length": n,
        "tokens": list(st.tokens),
        "kv": [(c.k[:, :n].clone(), c.v[:, :n].clone()) for c in st.kv.values()],
        "dn": [(s.conv.clone(), s.recurrent.clone()) for s in st.deltanet.values()],
        "stored": [list(e.tokens) for e in engine.prefix_cache.stored],
        "live": None if engine.prefix_cache.live is None else len(engine.prefix_cache.live.snaps),
        "busy": st.busy,
    }


def _same(a: dict, b: dict) -> bool:
    def eq(x, y):
        if isinstance(x, torch.Tensor):
            return torch.equal(x, y)
        if isinstance(x, list | tuple):
            return len(x) == len(y) and all(eq(p, q) for p, q in zip(x, y, strict=True))
        return x == y

    return all(eq(a[k], b[k]) for k in a)


def test_warm_up_leaves_nothing_behind_for_the_first_request(make_engine):
    cold = make_engine()
    warm = make_engine()
    tokens = warm.state.tokens
    before = _fingerprint(warm)
    with torch.inference_mode():
        report = warm_up(warm, force=True, probes=PROBES, context=512, progress=False,
                         log=lambda m: None)  # fmt: skip
    assert report["prefill_runs"] == len(PROBES)
    assert report["decode_runs"] == len(decode_starts(512)) * 3  # unsampled, greedy, default
    assert _same(_fingerprint(warm), before) and warm.state.tokens is tokens
    assert warm.prefix_cache.live is None and warm.prefix_cache.stored == []
    assert _requests(warm) == _requests(cold)


def _bound(p) -> int:
    from lily.runtime.runner import context_bucket
    from lily.runtime.state import INITIAL_CAPACITY

    return INITIAL_CAPACITY if p.start is None else context_bucket(p.start, p.capacity)


def test_batch_probes_cover_every_batch_size_and_bound_class():
    """Every batch size the server may run (2 to --max-running, at most 16), each at a
    context bound of every class of the batched attention's launch plan (split or not,
    key tile, combine block) that any rows can give: all short (caches of 256), or the
    longest at any bucket of any capacity (multiples of 4,096) up to a 256K context."""
    from lily.ops.arch import ARCHS
    from lily.ops.attention_decode import decode_plan
    from lily.ops.launch import pow2
    from lily.runtime.runner import context_bucket
    from lily.runtime.state import INITIAL_CAPACITY, KV_STEP

    def plan_class(bound: int, arch, elem: int) -> tuple:
        split, block_n, nb = decode_plan(bound, arch, elem_bytes=elem)
        return split > 0, block_n, min(64, pow2(nb)), bound % 16 == 0, nb % 16 == 0

    probes = batch_probes(8, 8192)
    assert {p.rows for p in probes} == set(range(2, 9))
    assert batch_probes(1, 8192) == [] and max(p.rows for p in batch_probes(40, 8192)) == 16
    reachable = {INITIAL_CAPACITY} | {context_bucket(s, cap)
                                      for cap in range(KV_STEP, 262144 + 1, KV_STEP)
                                      for s in (cap - 1, cap // 2, 0)}  # fmt: skip
    for b in range(2, 9):
        warmed = {_bound(p) for p in probes if p.rows == b}
        assert {256, 4096, 8192} <= warmed  # and so each graph a short chat replays
        for arch in ARCHS.values():
            for elem in (2, 4):
                want = {plan_class(n, arch, elem) for n in reachable}
                assert want == {plan_class(n, arch, elem) for n in warmed}, (b, arch.name)


def _together(engine: Engine) -> list:
    """Three requests decoded together through the engine's batch (one greedy with
    log-probs, two sampled), each stream's tokens."""
    reqs = [([3, 50, 7, 120, 9], SamplingParams(temperature=0.0, max_tokens=5, logprobs=1,
                                                ignore_eos=True)),
            (list(range(20, 41)), SamplingParams(temperature=0.9, top_k=40, seed=3,
                                                 max_tokens=5, ignore_eos=True)),
            ([300, 12], SamplingParams(temperature=0.7, top_p=0.9, seed=4, max_tokens=5,
                                       ignore_eos=True))]  # fmt: skip
    seqs = [engine.batch.add(p, params, tag=i) for i, (p, params) in enumerate(reqs)]
    got: dict = {i: [] for i in range(len(reqs))}
    with torch.inference_mode():
        while len(engine.batch):
            for s, out in engine.batch.step():
                got[s.tag].append((out.token_id, out.logprob))
    assert all(s.done for s in seqs)
    return [got[i] for i in range(len(reqs))]


def test_warm_up_runs_every_batch_size_and_leaves_nothing_behind(make_engine):
    """With max_running 3 the warm-up also runs batched steps of 2 and 3 rows at each
    bound, unsampled and with each sampler structure, on scratch states: the working
    state, the prefix cache, the batched requests after it are as without it, and the
    runner keeps neither the scratch states nor a warm-up row in its sampler."""
    cold, warm = make_engine(), make_engine()
    before = _fingerprint(warm)
    with torch.inference_mode():
        report = warm_up(warm, force=True, probes=PROBES, context=512, progress=False,
                         log=lambda m: None, max_running=3)  # fmt: skip
    # (512 positions take the first KV capacity past 256: the 1,024-token limit here), so
    # per batch size: all rows short, and one at that capacity's one bucket
    probes = batch_probes(3, 1024, 1024)
    assert report["batch_runs"] == len(probes) * 3 == 2 * 2 * 3  # unsampled, greedy, default
    assert set(warm.runner.row_buffers) == {2, 3}  # both batch sizes ran
    assert all(not b._states for b in warm.runner.row_buffers.values())  # scratch let go
    assert warm.runner.rows_sampler.owners == [None] * warm.runner.rows_sampler.rows
    assert _same(_fingerprint(warm), before)
    assert warm.prefix_cache.live is None and warm.prefix_cache.stored == []
    assert _together(warm) == _together(cold)
    # the engine's own max_running is the default (lily serve sets it from --max-running)
    with torch.inference_mode():
        report = warm_up(warm, force=True, probes=[], context=512, progress=False,
                         log=lambda m: None)  # fmt: skip
    assert report["batch_runs"] == 0 and warm.engine_cfg.max_running == 1


def test_warm_up_after_requests_keeps_their_state(make_engine):
    engine = make_engine()
    _requests(engine)
    before = _fingerprint(engine)
    assert before["length"] > 0 and before["stored"] or before["live"] is not None
    with torch.inference_mode():
        warm_up(engine, force=True, probes=PROBES, context=512, progress=False,
                log=lambda m: None)  # fmt: skip
    assert _same(_fingerprint(engine), before)


def test_warm_up_is_a_no_op_on_the_reference_path(make_engine):
    engine = make_engine()
    before = _fingerprint(engine)
    assert "skipped" in warm_up(engine, progress=False)
    assert _same(_fingerprint(engine), before)
    assert {c.capacity for c in engine.state.kv.values()} == {256}  # not even reserved


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the kernel runner's warm-up: GPU")
def test_gpu_warm_up_compiles_what_requests_need_and_changes_no_output(tmp_path):
    from lily.bench.measure import pseudo_text_ids
    from lily.checkpoint import TINY_TEXT_CONFIG, write_random_checkpoint
    from lily.runtime.warmup import kernel_variants

    write_random_checkpoint(tmp_path, TINY_TEXT_CONFIG, "mlx4", seed=3, progress=False)
    ecfg = EngineConfig(device="cuda", dtype="bfloat16", use_kernels=True, prefill_chunk=64,
                        max_context=2048)  # fmt: skip
    warm = Engine.load(tmp_path, ecfg, progress=False)
    report = warm_up(warm, progress=False, log=lambda m: None)
    assert report["prefill_runs"] > 0 and warm.state.length == 0
    before = kernel_variants()
    cold = Engine.load(tmp_path, ecfg, progress=False)
    start = warm.tokenizer.im_start_id
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for n, seed in ((301, 1), (157, 2), (250, 3), (64 * 3 + 5, 4)):
        ids = [start, 5, 6, start] + pseudo_text_ids(n, 400, seed=seed) + [start, 7]
        with torch.inference_mode():
            got = [s.token_id for s in warm.generate(ids, params)]
            want = [s.token_id for s in cold.generate(ids, params)]
        assert got == want
    after = kernel_variants()
    missed = {k: after[k] - before.get(k, 0) for k in after if after[k] > before.get(k, 0)}
    assert not missed, f"kernel variants the warm-up did not compile: {missed}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the kernel runner's warm-up: GPU")
def test_gpu_warm_up_compiles_what_batched_requests_need(tmp_path):
    """With max_running 4 the warm-up compiles every kernel variant the batched steps of
    2-4 requests launch (greedy and sampled rows; the prompts of the test above, whose
    prefills it covers): the four decoded together afterwards compile nothing, and their
    tokens are a cold engine's."""
    from lily.bench.measure import pseudo_text_ids
    from lily.checkpoint import TINY_TEXT_CONFIG, write_random_checkpoint
    from lily.runtime.warmup import kernel_variants

    write_random_checkpoint(tmp_path, TINY_TEXT_CONFIG, "mlx4", seed=3, progress=False)
    ecfg = EngineConfig(device="cuda", dtype="bfloat16", use_kernels=True, prefill_chunk=64,
                        max_context=2048, max_running=4)  # fmt: skip
    warm = Engine.load(tmp_path, ecfg, progress=False)
    report = warm_up(warm, progress=False, log=lambda m: None)
    assert report["batch_runs"] > 0
    start = warm.tokenizer.im_start_id

    def together(engine: Engine) -> list:
        reqs = []
        for n, seed, t in ((301, 1, 0.0), (157, 2, 0.8), (250, 3, 0.0), (64 * 3 + 5, 4, 0.7)):
            ids = [start, 5, 6, start] + pseudo_text_ids(n, 400, seed=seed) + [start, 7]
            reqs.append((ids, SamplingParams(temperature=t, seed=seed, max_tokens=12,
                                             ignore_eos=True)))  # fmt: skip
        seqs = [engine.batch.add(p, params, tag=i) for i, (p, params) in enumerate(reqs)]
        got: dict = {i: [] for i in range(len(reqs))}
        with torch.inference_mode():
            while len(engine.batch):
                for s, out in engine.batch.step():
                    got[s.tag].append(out.token_id)
        assert all(s.done for s in seqs)
        return [got[i] for i in range(len(reqs))]

    before = kernel_variants()
    got = together(warm)
    after = kernel_variants()
    missed = {k: after[k] - before.get(k, 0) for k in after if after[k] > before.get(k, 0)}
    assert not missed, f"kernel variants the warm-up did not compile: {missed}"
    assert got == together(Engine.load(tmp_path, ecfg, progress=False))
