"""Prefill chunks on the graphs' path (lily/runtime/prefill_graph.py): padded to a bucket,
the state named by addresses in a device table, snapshot cuts in the kernels.

On the CPU the path runs eagerly under the Triton interpreter (no capture there) against
the fp32 reference; on a GPU the captured graphs' replays must equal the same path run
eagerly bit for bit, for fresh states at other addresses and capacities, and stay within
bf16 rounding of the plain kernel path.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_runner import TOL, TOL_FLIP, checkpoint, models, reference, rel  # noqa: F401

from lily.runtime.prefill_graph import BUCKETS, Staging, bucket, context_bucket
from lily.runtime.runner import Runner
from lily.runtime.state import SessionState

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def ref_states(ref, prompt: list[int]) -> SessionState:
    st = SessionState.new(ref.cfg, DEVICE, torch.float32, 64)
    Runner(ref, 64).prefill(prompt, st)
    return st


def test_graph_path_matches_the_reference(models):  # noqa: F811 (the fixture)
    """13 tokens with snapshot points at 3 and 11: two pieces (3 and 10 tokens, each padded
    to 16 rows), the second taking its cut inside the DeltaNet kernels. The logits, both
    snapshots, the final states and the KV rows against the fp32 reference run up to each
    point: padding neither moves a state nor reaches a token row."""
    ref, fast = models
    prompt = [7, 300, 12, 45, 99, 1, 250, 31, 8, 77, 400, 5, 6]
    runner = Runner(fast, chunk=32, use_graphs=CUDA, prefill_graphs=True)
    assert runner.prefill_graphs is not None
    st = SessionState.new(fast.cfg, DEVICE, torch.bfloat16, 64, initial_capacity=64)
    logits, snaps = runner.prefill_snapshots(prompt, st, [3, 11])
    assert st.length == len(prompt) and st.tokens == prompt and not st.busy
    assert sorted(snaps) == [3, 11]
    for p in (3, 11):
        want = ref_states(ref, prompt[:p])
        for i, s in want.deltanet.items():
            assert rel(snaps[p][i].recurrent, s.recurrent) <= TOL, (p, i)
            assert rel(snaps[p][i].conv.float(), s.conv) <= TOL, (p, i)
    want = ref_states(ref, prompt)
    for i, s in want.deltanet.items():
        assert rel(st.deltanet[i].recurrent, s.recurrent) <= TOL, i
    for i, c in want.kv.items():
        assert rel(st.kv[i].k[:, : len(prompt)], c.k[:, : len(prompt)]) <= TOL, i
        assert rel(st.kv[i].v[:, : len(prompt)], c.v[:, : len(prompt)]) <= TOL, i
    assert rel(logits, reference(ref, prompt, limit=64)[0]) <= TOL


def test_buckets():
    assert [bucket(n) for n in (1, 16, 17, 129, 1000, 1024)] == [16, 16, 32, 192, 1024, 1024]
    with pytest.raises(ValueError, match="at most 1024 tokens"):
        bucket(1025)
    assert [context_bucket(e) for e in (1, 4096, 4097, 70000)] == [4096, 4096, 16384, 262144]
    assert list(BUCKETS) == sorted(BUCKETS) and all(b % 16 == 0 for b in BUCKETS)


def test_staging_refuses_a_buffer_the_kernels_cannot_name(models):  # noqa: F811 (the fixture)
    """The table gives the kernels an address: a non-contiguous state buffer (which they
    would read with the wrong strides) is an error, not a wrong answer."""
    _, fast = models
    staging = Staging(SimpleNamespace(cfg=fast.cfg, device=torch.device("cpu"),
                                      dtype=torch.bfloat16))  # fmt: skip
    st = SessionState.new(fast.cfg, "cpu", torch.bfloat16, 64, initial_capacity=64)
    assert staging.fill([1, 2, 3], 16, st, 0, 0) is None
    assert staging.buf[:3].tolist() == [0, 3, 2]  # start, token rows, last row
    assert staging.ids(16).tolist() == [1, 2, 3] + [0] * 13
    snap = staging.fill([1, 2, 3], 16, st, 0, 2)
    assert sorted(snap) == sorted(st.deltanet)
    i = next(iter(st.kv))
    st.kv[i].k = st.kv[i].k.transpose(0, 1).contiguous().transpose(0, 1)
    with pytest.raises(ValueError, match="not a contiguous"):
        staging.fill([1, 2, 3], 16, st, 0, 0)


@pytest.mark.skipif(not CUDA, reason="graph capture needs a CUDA device")
def test_graph_replay_equals_eager_on_the_same_inputs(models):  # noqa: F811 (the fixture)
    """A 20-token history, then 37 tokens with points 5 and 30 in (pieces of 5 and 32, the
    second cut in-kernel), on two fresh states of other addresses and capacities: the
    second replays the first's graphs (none is added). Replays equal the same path run
    eagerly bit for bit (logits, snapshots, states, KV rows), and the plain kernel path
    within bf16 rounding."""
    _, fast = models
    history = [(3 + 17 * i) % fast.cfg.vocab_size for i in range(20)]
    prompt = [(11 + 29 * i) % fast.cfg.vocab_size for i in range(37)]
    points = [len(history) + 5, len(history) + 30]
    end = len(history) + len(prompt)

    def run(runner: Runner) -> list:
        out = []
        for cap in (64, 512):
            st = SessionState.new(fast.cfg, DEVICE, torch.bfloat16, 512, initial_capacity=cap)
            first = runner.prefill(history, st)
            logits, snaps = runner.prefill_snapshots(prompt, st, points)
            out.append((first, logits, snaps, st))
        return out

    graphed = Runner(fast, chunk=64, use_graphs=True)
    got = run(graphed)
    assert sorted(graphed.prefill_graphs.graphs) == [(16, 4096), (32, 4096)]
    eager = run(Runner(fast, chunk=64, use_graphs=False, prefill_graphs=True))
    plain = run(Runner(fast, chunk=64, use_graphs=False))
    for (g1, g, gs, gst), (e1, e, es, est), (p1, p, ps, pst) in zip(got, eager, plain,
                                                                    strict=True):  # fmt: skip
        assert torch.equal(g1, e1) and torch.equal(g, e)
        assert rel(g, p) <= TOL and rel(g1, p1) <= TOL
        assert sorted(gs) == sorted(es) == sorted(ps) == points
        for pt in points:
            for i, s in gs[pt].items():
                assert torch.equal(s.recurrent, es[pt][i].recurrent)
                assert torch.equal(s.conv, es[pt][i].conv)
                assert rel(s.recurrent, ps[pt][i].recurrent) <= TOL
        for i in gst.deltanet:
            assert torch.equal(gst.deltanet[i].recurrent, est.deltanet[i].recurrent)
            assert torch.equal(gst.deltanet[i].conv, est.deltanet[i].conv)
        for i in gst.kv:
            assert torch.equal(gst.kv[i].k[:, :end], est.kv[i].k[:, :end])
            assert torch.equal(gst.kv[i].v[:, :end], est.kv[i].v[:, :end])
            assert rel(gst.kv[i].k[:, :end], pst.kv[i].k[:, :end]) <= TOL


@pytest.mark.skipif(not CUDA, reason="graph capture needs a CUDA device")
def test_graph_replay_on_poisoned_memory(models, poison_empty):  # noqa: F811
    """Every allocation NaN (and captured so: each replay refills its scratch with NaN): the
    replayed prefill's logits and states equal a clean run's."""
    _, fast = models
    prompt = [(5 + 13 * i) % fast.cfg.vocab_size for i in range(41)]

    def run() -> tuple:
        runner = Runner(fast, chunk=64, use_graphs=True)
        outs = []
        for _ in range(2):  # capture, then replay
            st = SessionState.new(fast.cfg, DEVICE, torch.bfloat16, 128, initial_capacity=128)
            outs.append((runner.prefill(prompt, st), st))
        return outs

    clean = run()
    poison_empty(int_value=2**30)
    dirty = run()
    for (a, sa), (b, sb) in zip(dirty, clean, strict=True):
        assert torch.isfinite(a).all() and torch.equal(a, b)
        for i in sa.deltanet:
            assert torch.equal(sa.deltanet[i].recurrent, sb.deltanet[i].recurrent)
