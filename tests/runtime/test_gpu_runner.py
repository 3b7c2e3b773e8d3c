"""The kernel runner (lily/runtime/gpu_runner.py) against the reference forward.

On a GPU it runs compiled with CUDA-graph decode; on the CPU the same kernels run under
the Triton interpreter (no graphs), on a shorter sequence.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from lily.checkpoint import TINY_TEXT_CONFIG, write_random_checkpoint
from lily.config import ModelConfig
from lily.model.model import Model
from lily.runtime.generate import Usage, decode_loop
from lily.runtime.gpu_runner import GpuRunner
from lily.runtime.sampling import SamplingParams
from lily.runtime.state import SessionState
from lily.tokenizer import Tokenizer
from lily.weights import load_params

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
STEPS = 64 if CUDA else 6
# bf16 activations through 4 layers against an fp32 reference. At a step where two experts'
# router scores nearly tie, bf16 rounding can pick the other expert, and the recurrent state
# carries that for a few steps (measured on the H200: 2 of 65 steps at 0.08 and 0.11 in one
# run; 7 of 65 at 0.04-0.18 after one flip in another, the rest 0.01-0.025): three quarters
# of the steps must be within TOL and none beyond TOL_FLIP. A wrong kernel gives about 1.
TOL = 3e-2
TOL_FLIP = 0.2


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    # Both sides are ours here, so the checkpoint comes from our own MLX-layout writer.
    d = tmp_path_factory.mktemp("kernel-runner")
    write_random_checkpoint(d, TINY_TEXT_CONFIG, "mlx4", seed=3, progress=False)
    return d


@pytest.fixture(scope="module")
def models(checkpoint):
    d = checkpoint
    cfg = ModelConfig.from_dir(d)
    ref = Model(cfg, load_params(d, cfg, device=DEVICE, dtype=torch.float32, progress=False),
                torch.float32)  # fmt: skip
    fast = Model(cfg, load_params(d, cfg, device=DEVICE, dtype=torch.bfloat16, progress=False),
                 torch.bfloat16)  # fmt: skip
    return ref, fast


@pytest.mark.parametrize("graphs", [False, True] if CUDA else [False], ids=lambda g: f"graphs={g}")
def test_kernel_runner_matches_reference(models, graphs):
    ref, fast = models
    runner = GpuRunner(fast, chunk=16, use_graphs=graphs)
    prompt = [7, 300, 12, 45, 99, 1, 250, 31, 8, 77, 400, 5, 6, 140, 141, 142, 9, 3, 21]
    st = SessionState.new(fast.cfg, DEVICE, torch.bfloat16, 512, initial_capacity=512)
    logits = [runner.prefill(prompt, st)]
    toks = []
    for _ in range(STEPS):
        toks.append(int(logits[-1].argmax()))
        logits.append(runner.decode(toks[-1], st))
    assert st.length == len(prompt) + STEPS

    # Teacher-force the same tokens through the fp32 reference, one step at a time.
    rs = SessionState.new(ref.cfg, DEVICE, torch.float32, 512)
    want = [ref.forward(torch.tensor(prompt, device=DEVICE), rs)[0]]
    for t in toks:
        want.append(ref.forward(torch.tensor([t], device=DEVICE), rs)[0])
    errs = [rel(a, b) for a, b in zip(logits, want, strict=True)]
    print("rel L2 per step:", " ".join(f"{e:.3g}" for e in errs))
    assert all(torch.isfinite(a).all() for a in logits)
    assert max(errs) <= TOL_FLIP, f"per-step rel L2: {errs}"
    assert sum(e <= TOL for e in errs) >= 0.75 * len(errs), f"per-step rel L2: {errs}"
    # Greedy continuation: the reference picks the same token wherever its choice is
    # not a near tie (bf16 rounding may flip those).
    for i, t in enumerate(toks):
        top2 = want[i].topk(2).values
        if float(top2[0] - top2[1]) > 0.05:
            assert int(want[i].argmax()) == t, f"step {i}"


@pytest.mark.skipif(not CUDA, reason="programmatic dependent launch is a no-op without a GPU")
def test_decode_with_pdl_equals_without(models):
    """The decode graph with PDL launches (each GEMV/MoE kernel starts while the one before
    drains, waiting in-kernel before it reads) gives the same bits as plain launches."""
    _, fast = models
    prompt = [7, 300, 12, 45, 99, 1, 250, 31, 8, 77, 400, 5, 6, 140, 141, 142, 9, 3, 21]
    outs = []
    for pdl in (False, True):
        runner = GpuRunner(fast, chunk=16, use_graphs=True, pdl=pdl)
        st = SessionState.new(fast.cfg, DEVICE, torch.bfloat16, 512, initial_capacity=512)
        logits = [runner.prefill(prompt, st)]
        for _ in range(STEPS):
            logits.append(runner.decode(int(logits[-1].argmax()), st))
        outs.append(torch.stack(logits))
    assert torch.equal(outs[0], outs[1])


def test_snapshots_in_the_middle_of_a_chunk(models):
    """States copied out mid-chunk equal those of prefilling up to each point."""
    ref, fast = models
    runner = GpuRunner(fast, chunk=16, use_graphs=False)
    prompt = [7, 300, 12, 45, 99, 1, 250, 31, 8, 77, 400, 5, 6, 140, 141, 142, 9, 3, 21]
    points = [5, 16, 18]  # inside the first chunk, on its boundary, inside the second
    st = SessionState.new(fast.cfg, DEVICE, torch.bfloat16, 64, initial_capacity=64)
    logits, snaps = runner.prefill_snapshots(prompt, st, points)
    assert sorted(snaps) == points
    for p in points:
        rs = SessionState.new(ref.cfg, DEVICE, torch.float32, 64)
        ref.forward(torch.tensor(prompt[:p], device=DEVICE), rs)
        for i, want in rs.deltanet.items():
            assert rel(snaps[p][i].recurrent, want.recurrent) <= TOL, (p, i)
            assert rel(snaps[p][i].conv.float(), want.conv) <= TOL, (p, i)
    rs = SessionState.new(ref.cfg, DEVICE, torch.float32, 64)
    assert rel(logits, ref.forward(torch.tensor(prompt, device=DEVICE), rs)[0]) <= TOL


def test_one_token_chunks(models):
    """Prefill in chunks of one token (the decode kernels with a host position)."""
    ref, fast = models
    runner = GpuRunner(fast, chunk=1, use_graphs=False)
    prompt = [7, 300]
    st = SessionState.new(fast.cfg, DEVICE, torch.bfloat16, 64, initial_capacity=64)
    logits = runner.prefill(prompt, st)
    rs = SessionState.new(ref.cfg, DEVICE, torch.float32, 64)
    assert st.length == 2
    assert rel(logits, ref.forward(torch.tensor(prompt, device=DEVICE), rs)[0]) <= TOL


@pytest.mark.parametrize("n", [37])
def test_prefill_never_reads_unwritten_memory(models, poison_empty, n):
    """Chunks that end mid-tile (37 = 2 x 16 + 5): with poisoned scratch the
    logits are bit-identical to a clean run's, finite, and near the reference."""
    ref, fast = models
    prompt = [(7 + 131 * i) % fast.cfg.vocab_size for i in range(n)]

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        runner = GpuRunner(fast, chunk=16, use_graphs=False)
        st = SessionState.new(fast.cfg, DEVICE, torch.bfloat16, 64, initial_capacity=64)
        logits = runner.prefill(prompt, st)
        return logits, runner.decode(int(logits.argmax()), st)

    clean = run()
    poison_empty(int_value=2**30)
    dirty = run()
    for a, b in zip(dirty, clean, strict=True):
        assert torch.isfinite(a).all()
        assert torch.equal(a, b)
    rs = SessionState.new(ref.cfg, DEVICE, torch.float32, 64)
    assert rel(clean[0], ref.forward(torch.tensor(prompt, device=DEVICE), rs)[0]) <= TOL_FLIP


def test_graph_key_sees_the_kv_capacity(models):
    """A captured decode step bakes in the KV row stride: a cache at the same address with
    another capacity must not replay the old graph."""
    from lily.runtime.gpu_runner import graph_key

    _, fast = models
    st = SessionState.new(fast.cfg, DEVICE, torch.bfloat16, 512, initial_capacity=64)
    before = graph_key(st)
    assert graph_key(st) == before
    c = next(iter(st.kv.values()))
    hkv, cap, dh = c.k.shape
    # Same addresses, half the capacity (what a freed and reallocated cache can look like).
    c.k = c.k.reshape(-1)[: hkv * (cap // 2) * dh].view(hkv, cap // 2, dh)
    c.v = c.v.reshape(-1)[: hkv * (cap // 2) * dh].view(hkv, cap // 2, dh)
    assert graph_key(st) != before


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_decode_and_draw_in_one_graph(models, checkpoint):
    """The step and the device draw captured together: the greedy stream equals the plain
    loop's (host argmax, no graphs) over 32 tokens; seeded draws equal the same draws
    without graphs, also for a second request replaying the captured graph with reloaded
    values; launching a step never waits for the device."""
    _, fast = models
    tokenizer = Tokenizer.from_dir(checkpoint)
    prompt = [7, 300, 12, 45, 99, 1, 250, 31, 8, 77, 400, 5, 6, 140, 141, 142, 9, 3, 21]
    n = 32

    def stream(runner, params, st=None):
        if st is None:
            st = SessionState.new(fast.cfg, DEVICE, torch.bfloat16, 512, initial_capacity=512)
        logits = runner.prefill(prompt, st)
        steps = list(decode_loop(runner, tokenizer, st, logits, prompt, params, n,
                                 lambda: False, None, Usage()))  # fmt: skip
        assert st.length == len(st.tokens) == len(prompt) + n - 1 and not st.busy
        return [s.token_id for s in steps], st

    greedy = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    host, _ = stream(GpuRunner(fast, chunk=16, use_graphs=False, sample_on_device=False), greedy)
    graphed = GpuRunner(fast, chunk=16, use_graphs=True)
    got, _ = stream(graphed, greedy)
    assert got == host
    assert any(len(k) == 4 for k in graphed.graphs)  # the sampled step was captured

    eager = GpuRunner(fast, chunk=16, use_graphs=False)
    st = None
    for seed in (5, 6):  # the second request reuses the state's buffers, so the graph too
        params = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, repetition_penalty=1.1,
                                seed=seed, max_tokens=n, ignore_eos=True)  # fmt: skip
        if st is not None:
            for s in st.deltanet.values():
                s.conv.zero_()
                s.recurrent.zero_()
            st.length = 0
            st.tokens.clear()
            captured = len(graphed.graphs)
        got, st = stream(graphed, params, st)
        assert got == stream(eager, params)[0], seed
        if seed == 6:
            assert len(graphed.graphs) == captured

    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(4):
                graphed.decode_sampled(st)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert caught == []


def test_no_gc_restores_the_collector():
    """The collector is off inside a prefill's enqueue and back as it was after, also when
    the prefill raises; a collector already off stays off."""
    import gc

    from lily.runtime.gpu_runner import _no_gc

    assert gc.isenabled()
    with _no_gc():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), _no_gc():
        raise RuntimeError("fault mid-prefill")
    assert gc.isenabled()
    gc.disable()
    try:
        with _no_gc():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
