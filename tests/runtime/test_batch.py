"""Continuous batching (lily/runtime/batch.py) on the reference ops: requests that arrive at
different steps, with their own sampling, stops, log-probs, logits processors and
cancellation, each stream equal to the same request run alone (``Engine.generate``).

The device-draw mode runs on the CPU too (the runner's eager device sampler): a lone
request takes the pipelined single-sequence path, leaves it when others join and takes it
up again when they are gone, and its seeded stream does not change; nor does it when
log-probs or a logits processor send its draws to the host.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest

from lily.config import EngineConfig
from lily.runtime.engine import Engine
from lily.runtime.runner import Runner
from lily.runtime.sampling import NO_TOKEN, SamplingParams

CFG = EngineConfig(prefill_chunk=8, decode_prefill_chunk=3, max_context=512)
LP_TOL = 1e-5  # batched rows sum in another order (see test_batch_decode.py)

P1 = [3, 50, 7, 120, 9]
P2 = list(range(20, 61))  # 41 tokens: several chunks
P3 = [9, 8, 7, 6, 5, 4, 3, 2, 1, 250, 251]
P4 = [300, 12]

SAMPLED = dict(temperature=0.9, top_k=40, top_p=0.95, repetition_penalty=1.3,
               frequency_penalty=0.5, ignore_eos=True)  # fmt: skip


def ban(ids):
    """A logits processor that depends on the ids generated so far (as a grammar does)."""

    def processor(generated, logits):
        out = logits.clone()
        out[[i for i in ids if i not in generated[-1:]]] = -math.inf
        return out

    return processor


def make(hf_tiny_dir, device_draws: bool = False, **kw) -> Engine:
    e = Engine.load(hf_tiny_dir, EngineConfig(**{**CFG.__dict__, **kw}), progress=False)
    if device_draws:
        e.runner = Runner(e.model, e.engine_cfg.prefill_chunk, sample_on_device=True)
    return e


def alone(engine: Engine, prompt, params, processor=None):
    return list(engine.generate(prompt, params, logits_processor=processor))


def drive(engine: Engine, reqs: list[dict], max_steps: int = 500):
    """Run ``reqs`` ({"at": step, "prompt", "params", "processor"?, "cancel_at"?: output
    count}) through the engine's batch; each request's outputs (or its exception)."""
    got: dict[int, list] = {i: [] for i in range(len(reqs))}
    seqs = {}
    for step in range(max_steps):
        for i, r in enumerate(reqs):
            if r["at"] == step:
                n = r.get("cancel_at")
                seqs[i] = engine.batch.add(
                    r["prompt"], r["params"], processor=r.get("processor"), tag=i,
                    cancelled=(lambda i=i, n=n: n is not None and len(got[i]) >= n),
                )  # fmt: skip
        if not len(engine.batch) and step > max(r["at"] for r in reqs):
            return got, seqs
        for s, out in engine.batch.step():
            got[s.tag].append(out)
            if s.done and s.state is not None:  # what its state held as it ended
                st = s.state
                s.end_state = (list(st.tokens), st.length, st.busy)
    raise AssertionError("the batch did not finish")


def poisoned(forward, at: int, row: int | None = None):
    """``forward`` whose ``at``-th batched step gives NaN logits (for ``row``, or all)."""
    calls = []

    def run(ids, state, *a, **k):
        out, snaps = forward(ids, state, *a, **k)
        if ids.shape[0] > 1 and k.get("step"):
            calls.append(1)
            if len(calls) == at:
                out = out.clone()
                out[slice(None) if row is None else row] = math.nan
        return out, snaps

    return run


def same_stream(a: list, b: list) -> None:
    assert [(o.token_id, o.text, o.finish_reason) for o in a] == [
        (o.token_id, o.text, o.finish_reason) for o in b
    ]
    for x, y in zip(a, b, strict=True):
        assert (x.logprob is None) == (y.logprob is None)
        if x.logprob is not None:
            assert abs(x.logprob - y.logprob) <= LP_TOL
            assert [t for t, _ in x.top_logprobs] == [t for t, _ in y.top_logprobs]


REQS = [
    dict(at=0, prompt=P1, params=SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)),
    dict(at=2, prompt=P2, params=SamplingParams(seed=5, max_tokens=9, **SAMPLED)),
    dict(at=3, prompt=P3, params=SamplingParams(temperature=0.0, max_tokens=10, logprobs=3,
                                                ignore_eos=True)),
    dict(at=3, prompt=P4, params=SamplingParams(temperature=0.7, seed=9, max_tokens=7,
                                                ignore_eos=True), processor=ban([5, 6, 7])),
    dict(at=14, prompt=P1 + [4], params=SamplingParams(temperature=0.0, max_tokens=4,
                                                       ignore_eos=True)),
]  # fmt: skip


@pytest.mark.parametrize("device_draws", [False, True], ids=["host", "device"])
def test_each_stream_equals_running_alone(hf_tiny_dir, device_draws):
    batched, ref = make(hf_tiny_dir, device_draws), make(hf_tiny_dir, device_draws)
    rows = []
    runner = batched.runner
    plain, drawn = runner.decode_rows, runner.decode_rows_drawn

    def counting(tokens, states):
        rows.append(len(states))
        return plain(tokens, states)

    def counting_drawn(tokens, states, loads):
        rows.append(len(states))
        assert device_draws and any(loads)  # the device draws ride in the batched step
        return drawn(tokens, states, loads)

    runner.decode_rows, runner.decode_rows_drawn = counting, counting_drawn
    got, _ = drive(batched, REQS)
    for i, r in enumerate(REQS):
        same_stream(got[i], alone(ref, r["prompt"], r["params"], r.get("processor")))
    assert max(rows) >= 3  # really batched
    assert not batched.batch.seqs
    assert all(not st.busy and len(st.tokens) == st.length for st in batched.pool)


def test_a_request_changes_mode_without_changing_its_stream(hf_tiny_dir):
    """Alone (pipelined, device draws), then batched with a second request, then alone
    again once that one ends: one seeded stream with penalties, as when run alone."""
    batched, ref = make(hf_tiny_dir, True), make(hf_tiny_dir, True)
    calls = {"sampled": 0, "rows": 0, "ahead": 0}
    runner = batched.runner
    sampled, rows, ahead = runner.decode_sampled, runner.launch_rows, runner.launch_rows_ahead

    def count_sampled(state):
        calls["sampled"] += 1
        sampled(state)

    def count_rows(tokens, states, loads):
        calls["rows"] += 1
        return rows(tokens, states, loads)

    def count_ahead(states):
        calls["ahead"] += 1
        return ahead(states)

    runner.decode_sampled, runner.launch_rows = count_sampled, count_rows
    runner.launch_rows_ahead = count_ahead
    params = SamplingParams(seed=3, max_tokens=24, **SAMPLED)
    short = SamplingParams(seed=4, max_tokens=5, **SAMPLED)
    got, _ = drive(batched, [dict(at=0, prompt=P1, params=params),
                             dict(at=6, prompt=P4, params=short)])  # fmt: skip
    same_stream(got[0], alone(ref, P1, params))
    same_stream(got[1], alone(ref, P4, short))
    # both modes really ran; batched, the steps went one ahead of the host
    assert calls["rows"] >= 1 and calls["ahead"] >= 2 and calls["sampled"] >= 10
    assert len(set(o.token_id for o in got[0])) > 5  # really sampled


def test_log_probs_or_a_processor_leave_a_seeded_stream_as_it_is(hf_tiny_dir):
    """On a runner that draws on the device, a request with log-probs or a logits processor
    draws on the host (``Sampler``) instead: the same seeded request gives the same tokens
    either way, alone (against the pipelined device draws) and batched (against the rows
    sampler)."""
    engine = make(hf_tiny_dir, True)
    plain = SamplingParams(seed=5, max_tokens=9, **SAMPLED)
    lp = SamplingParams(seed=5, max_tokens=9, logprobs=2, **SAMPLED)

    def keep(generated, logits):  # a processor that changes nothing
        return logits

    def ids(outs):
        return [o.token_id for o in outs]

    want = ids(alone(engine, P2, plain))
    assert len(set(want)) > 4  # really sampled
    assert ids(alone(engine, P2, lp)) == want
    assert ids(alone(engine, P2, plain, keep)) == want
    got, seqs = drive(engine, [dict(at=0, prompt=P2, params=plain),
                               dict(at=0, prompt=P2, params=lp),
                               dict(at=0, prompt=P2, params=plain, processor=keep)])  # fmt: skip
    assert [seqs[i].device_draws for i in range(3)] == [True, False, False]
    assert [ids(got[i]) for i in range(3)] == [want] * 3


def test_cancel_ends_one_request_only(hf_tiny_dir):
    batched, ref = make(hf_tiny_dir), make(hf_tiny_dir)
    p = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    got, seqs = drive(batched, [dict(at=0, prompt=P1, params=p),
                                dict(at=0, prompt=P3, params=p, cancel_at=4),
                                dict(at=1, prompt=P2, params=p, cancel_at=0)])  # fmt: skip
    assert [o.finish_reason for o in got[1]][-1] == "cancelled"
    assert sum(o.token_id is not None for o in got[1]) == 4
    assert got[2][-1].finish_reason == "cancelled" and got[2][0].token_id is None
    same_stream(got[0], alone(ref, P1, p))
    st = seqs[1].state
    assert not st.busy and st.tokens == P3 + [o.token_id for o in got[1][:4]]


def test_a_failing_request_leaves_the_others_running(hf_tiny_dir):
    batched, ref = make(hf_tiny_dir), make(hf_tiny_dir)

    def boom(generated, logits):
        if len(generated) == 3:
            raise RuntimeError("processor fault")
        return logits

    p = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    got, _ = drive(batched, [dict(at=0, prompt=P1, params=p),
                             dict(at=0, prompt=P3, params=p, processor=boom),
                             dict(at=1, prompt=P4, params=p)])  # fmt: skip
    assert isinstance(got[1][-1], RuntimeError) and len(got[1]) == 4
    same_stream(got[0], alone(ref, P1, p))
    same_stream(got[2], alone(ref, P4, p))


def test_a_model_fault_fails_the_rows_and_their_states_are_dropped(hf_tiny_dir, monkeypatch):
    batched, ref = make(hf_tiny_dir), make(hf_tiny_dir)
    monkeypatch.setattr(batched.model, "forward", poisoned(batched.model.forward, 2))
    p = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    got, seqs = drive(batched, [dict(at=0, prompt=P1, params=p),
                                dict(at=0, prompt=P3, params=p)])  # fmt: skip
    for i in (0, 1):
        assert isinstance(got[i][-1], ValueError) and str(got[i][-1]) == NO_TOKEN
    monkeypatch.undo()
    # NaN logits: the rows consumed their tokens (states consistent), the draws failed
    for s in seqs.values():
        assert not s.state.busy and len(s.state.tokens) == s.state.length
    got, _ = drive(batched, [dict(at=0, prompt=P1, params=p), dict(at=1, prompt=P2, params=p)])
    same_stream(got[0], alone(ref, P1, p))
    same_stream(got[1], alone(ref, P2, p))


def test_a_raising_step_discards_the_half_updated_states(hf_tiny_dir, monkeypatch):
    batched = make(hf_tiny_dir)
    forward = batched.model.forward

    def broken(ids, state, *a, **k):
        if ids.shape[0] > 1 and k.get("step"):
            raise RuntimeError("device fault")
        return forward(ids, state, *a, **k)

    monkeypatch.setattr(batched.model, "forward", broken)
    p = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    got, seqs = drive(batched, [dict(at=0, prompt=P1, params=p),
                                dict(at=0, prompt=P3, params=p)])  # fmt: skip
    assert all(isinstance(got[i][-1], RuntimeError) for i in (0, 1))
    assert not any(s.state is st for s in seqs.values() for st in batched.pool)  # forgotten
    assert id(seqs[0].state) not in batched.prefix_cache.lives


def test_long_prefill_is_interleaved_with_running_decodes(hf_tiny_dir):
    """While a 41-token prompt prefills in chunks of 3, the running request gets a token at
    every step; the new one's first token comes after its last chunk."""
    batched, ref = make(hf_tiny_dir), make(hf_tiny_dir)
    chunks = []
    inner = batched.runner.prefill_snapshots

    def counting(ids, state, points):
        chunks.append(len(ids))
        return inner(ids, state, points)

    batched.runner.prefill_snapshots = counting
    p = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    a = batched.batch.add(P1, p, tag=0)
    while not a.decoding:
        batched.batch.step()
    b = batched.batch.add(P2, SamplingParams(temperature=0.0, max_tokens=3), tag=1)
    per_step = []
    while not b.decoding:
        per_step.append([s.tag for s, _ in batched.batch.step()])
    assert all(0 in tags for tags in per_step)  # the running stream never paused
    assert per_step[-1] == [0, 1]  # b's first token with its last chunk
    assert chunks[-len(per_step) :] == [3] * 13 + [2]  # 41 tokens in chunks of 3
    while len(batched.batch):
        batched.batch.step()
    assert b.usage.cached_tokens == 0 and b.usage.prompt_tokens == len(P2)
    assert b.generated == [o.token_id for o in alone(ref, P2, SamplingParams(
        temperature=0.0, max_tokens=3))][: len(b.generated)]  # fmt: skip


@pytest.mark.parametrize("device_draws", [False, True], ids=["host", "device"])
def test_the_decode_tokens_are_delivered_before_the_prefill_chunk(hf_tiny_dir, device_draws):
    """``step(deliver)``: each step's decode outputs reach ``deliver`` before its prefill
    chunk is launched (the server hands them out while the chunk's launches hold the host);
    step returns the rest, and the streams are those of a plain ``step()``."""

    def run(with_deliver: bool) -> list[tuple]:
        e = make(hf_tiny_dir, device_draws)
        log: list[tuple] = []  # (step, "chunk") as launched, (step, tag, id) as handed out
        step = [0]
        inner = e.runner.prefill_snapshots

        def chunk(ids, state, points):
            log.append((step[0], "chunk"))
            return inner(ids, state, points)

        def out(outs):
            log.extend((step[0], s.tag, o.token_id) for s, o in outs)

        e.runner.prefill_snapshots = chunk
        a = e.batch.add(P1, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
                        tag=0)  # fmt: skip
        while not a.decoding:
            e.batch.step()
        e.batch.add(P2, SamplingParams(temperature=0.0, max_tokens=3), tag=1)
        log.clear()
        while len(e.batch):
            step[0] += 1
            out(e.batch.step(out) if with_deliver else e.batch.step())
        return log

    got, plain = run(True), run(False)
    chunks = [i for i, x in enumerate(got) if x[1] == "chunk"]
    assert len(chunks) == 14  # 41 tokens in chunks of 3, one a step
    for i in chunks:  # a's token of the same step is out before the step's chunk ...
        k = got[i][0]
        assert (k, 0) in [x[:2] for x in got[:i]]
    for i, x in enumerate(plain):  # ... where a plain step returns it after the chunk
        if x[1] == "chunk":
            assert (x[0], 0) not in [y[:2] for y in plain[:i]]
    assert Counter(got) == Counter(plain)  # the same tokens at the same steps


DEVICE_REQS = [
    dict(at=0, prompt=P1, params=SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)),
    dict(at=0, prompt=P3, params=SamplingParams(seed=5, max_tokens=11, **SAMPLED)),
    dict(at=1, prompt=P4, params=SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True,
                                                stop_token_ids=(0,))),
    dict(at=2, prompt=P2, params=SamplingParams(seed=8, max_tokens=12, **SAMPLED), cancel_at=5),
    dict(at=9, prompt=P1 + [4], params=SamplingParams(temperature=0.7, seed=2, max_tokens=6,
                                                      stop=("e",), ignore_eos=True)),
]  # fmt: skip


def test_pipelined_batch_streams_and_states(hf_tiny_dir):
    """Every row drawn on the device: each batched step is launched before the host reads
    the one before (as one sequence alone), across arrivals, stops, cancels and max_tokens;
    each stream equals running alone and each state names what the model consumed."""
    batched, ref = make(hf_tiny_dir, True), make(hf_tiny_dir, True)
    aheads = []
    ahead = batched.runner.launch_rows_ahead

    def counting(states):
        aheads.append(len(states))
        return ahead(states)

    batched.runner.launch_rows_ahead = counting
    got, seqs = drive(batched, DEVICE_REQS)
    for i, r in enumerate(DEVICE_REQS):
        if "cancel_at" in r:
            assert got[i][-1].finish_reason == "cancelled" and len(got[i]) == r["cancel_at"] + 1
            want = alone(ref, r["prompt"], r["params"])[: r["cancel_at"]]
            same_stream(got[i][:-1], want)
        else:
            same_stream(got[i], alone(ref, r["prompt"], r["params"]))
        s = seqs[i]
        tokens, length, busy = s.end_state
        assert not busy and len(tokens) == length
        consumed = len(tokens) - len(r["prompt"])
        assert tokens == r["prompt"] + s.generated[:consumed]
        assert consumed in (len(s.generated) - 1, len(s.generated))
    assert max(aheads) >= 3 and len(aheads) >= 5


def test_a_failed_draw_in_a_pipelined_batch_fails_its_row_alone(hf_tiny_dir, monkeypatch):
    batched, ref = make(hf_tiny_dir, True), make(hf_tiny_dir, True)
    # row 1's logits of the fourth batched step
    monkeypatch.setattr(batched.model, "forward", poisoned(batched.model.forward, 4, row=1))
    p = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    got, seqs = drive(batched, [dict(at=0, prompt=P1, params=p), dict(at=0, prompt=P3, params=p),
                                dict(at=0, prompt=P4, params=p)])  # fmt: skip
    assert isinstance(got[1][-1], ValueError) and str(got[1][-1]) == NO_TOKEN
    # a placeholder was fed behind it: that state is forgotten
    assert all(seqs[1].state is not st for st in batched.pool)
    same_stream(got[0], alone(ref, P1, p))
    same_stream(got[2], alone(ref, P4, p))
