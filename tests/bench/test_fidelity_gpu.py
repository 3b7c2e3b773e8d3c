"""Full-size fidelity on the GPU: the layer-local check and the bf16/kernel paths against
the fp32 reference on the well-conditioned random model (issue 26). Skips without CUDA.

Bounds: end to end, issue 26's bars (top-1 99%, relative L2 1e-2 over 192 positions
after 4K). Layer-local, from the H200 run of 2026-12-02 on the model before its
zero-mean token codes (worst rel_out 3.4e-3, rel_delta 3.6e-2 at a DeltaNet layer whose
own output was ~0.1 of the residual), with room for the new model's different residual
mix; a wrong kernel gives about 1. Run lily/bench/gpu/e2e/fidelity.py for the numbers."""

from __future__ import annotations

import pytest
import torch

from lily.bench.compare import metrics
from lily.bench.consistency import layer_local, make_paths, score_model, score_runner
from lily.bench.measure import pseudo_text_ids
from lily.bench.random_model import model_config, random_params
from lily.bench.source import engine_from_params
from lily.config import EngineConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CONTEXT = 4096
# Per layer, |y_path - y_fp32| / |y_fp32| (the layer's output) and the same error over
# |y_fp32 - x| (what the layer added).
MAX_REL_OUT = 6e-3
MAX_REL_DELTA = 5e-2
# End to end over 192 positions after 4K: issue 26's bars.
MIN_TOP1 = 99.0
MAX_REL_L2 = 1e-2
# The model must keep its top-1 clear of ties, or top-1 agreement measures rounding (the
# model of 2026-12-02, as simulated: median lead ~0.4 logits; 7 of 192 flipped). Designed:
# median ~11, 5th percentile ~8 (docs/notes/fidelity.md).
MIN_MARGIN_P5 = 2.0


@pytest.fixture(scope="module")
def full():
    cfg = model_config("full")
    params = random_params(cfg, "cuda")
    ids = pseudo_text_ids(CONTEXT + 256, cfg.vocab_size, seed=0)
    return cfg, params, ids


def test_every_layer_of_every_path_is_close_to_fp32_prefill_and_decode(full):
    cfg, params, ids = full
    judge, paths = make_paths(cfg, params, kernels=True)
    rep = layer_local(judge, paths, ids, CONTEXT, chunk=128, steps=4)
    for phase in ("prefill", "decode"):
        for name, r in rep[phase].items():
            w = r["worst"]
            assert r["max_rel_out"] <= MAX_REL_OUT, (phase, name, w)
            assert r["max_rel_delta"] <= MAX_REL_DELTA, (phase, name, w)


def test_bf16_and_kernels_agree_with_fp32_end_to_end_and_the_layers_matter(full):
    """The issue's bars at 4K context over 192 positions."""
    cfg, params, ids = full
    judge, paths = make_paths(cfg, params, kernels=False)
    part = ids[: CONTEXT + 193]
    l32 = score_model(judge, part, CONTEXT)[:192]
    l16 = score_model(paths["bf16_reference"], part, CONTEXT)[:192]
    ecfg = EngineConfig(device="cuda", dtype="bfloat16", use_kernels=True, max_context=8192,
                        prefix_cache_gb=0.0)  # fmt: skip
    lk = score_runner(engine_from_params(cfg, params, ecfg), part[:-1], CONTEXT)
    top = l32.topk(2, -1).values
    lead = top[:, 0] - top[:, 1]
    assert lead.quantile(0.05) >= MIN_MARGIN_P5, lead.sort().values[:12]
    for ours in (l16, lk):
        m = metrics(ours, l32, part[CONTEXT:])
        assert m["top1_agreement_pct"] >= MIN_TOP1 and m["rel_l2"] <= MAX_REL_L2, m
    with torch.inference_mode():
        x = judge.embed(torch.tensor(part[CONTEXT:-1], device="cuda"))
        skip = judge.head(x).cpu()
    assert ((l32 - skip).norm() / skip.norm()).item() >= 0.5


def test_batched_decode_matches_each_sequence_alone(full):
    """Continuous batching (issue 22's bar): 4 sequences at different contexts decoded
    together by the kernels' batched step (graphs, each row on its own caches and states)
    against each decoded alone by the single-sequence path, teacher-forced on the same
    tokens: 48 steps each, 192 positions, relative L2 <= 1e-2 and top-1 agreement >= 99%."""
    from lily.runtime.state import SessionState

    cfg, params, ids = full
    ecfg = EngineConfig(device="cuda", dtype="bfloat16", use_kernels=True, max_context=8192,
                        prefix_cache_gb=0.0, max_running=4)  # fmt: skip
    engine = engine_from_params(cfg, params, ecfg)
    runner, steps = engine.runner, 48
    lengths = (CONTEXT, 2500, 1000, 300)  # row 0 crosses the 4K graph bucket as it goes
    seqs = [pseudo_text_ids(n + steps + 1, cfg.vocab_size, seed=11 + r)
            for r, n in enumerate(lengths)]  # fmt: skip

    def prefilled() -> list:
        out = []
        for n, s in zip(lengths, seqs, strict=True):
            st = SessionState.new(cfg, "cuda", engine.dtype, engine.max_context)
            st.reserve(n + steps + 1)
            runner.prefill(s[:n], st)
            out.append(st)
        return out

    alone = [[] for _ in lengths]
    for r, st in enumerate(prefilled()):
        for t in range(steps):
            alone[r].append(runner.decode(seqs[r][lengths[r] + t], st).float().cpu())
    together = [[] for _ in lengths]
    states = prefilled()
    for t in range(steps):
        out = runner.decode_rows([s[n + t] for s, n in zip(seqs, lengths, strict=True)], states)
        for r in range(len(lengths)):
            together[r].append(out[r].float().cpu())
    assert {k[:2] for k in runner.graphs if k[0] == "rows"} == {("rows", 4)}
    ours = torch.stack([x for row in together for x in row])
    ref = torch.stack([x for row in alone for x in row])
    targets = [0] + [s[n + t + 1] for s, n in zip(seqs, lengths, strict=True)
                     for t in range(steps)]  # fmt: skip
    m = metrics(ours, ref, targets)
    assert m["top1_agreement_pct"] >= MIN_TOP1 and m["rel_l2"] <= MAX_REL_L2, m
    for r in range(len(lengths)):  # and per row (a row on another row's state is ~1)
        a, b = torch.stack(together[r]).double(), torch.stack(alone[r]).double()
        assert ((a - b).norm() / b.norm()).item() <= MAX_REL_L2, r
