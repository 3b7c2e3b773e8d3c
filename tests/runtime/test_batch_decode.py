"""A decode step of several sequences at once (``Runner.decode_rows``) against each sequence
run alone, and against transformers; on the reference ops, and on the kernels (the Triton
interpreter on the CPU).

Rows differ in everything a step reads per sequence: prompt length (so position and KV
length), KV capacity (one prompt passes the first growth step), DeltaNet states, and when
they join the batch.
"""

from __future__ import annotations

import pytest
import torch

from lily.checkpoint import TINY_TEXT_CONFIG, write_random_checkpoint
from lily.config import ModelConfig
from lily.model.model import Model, Rows
from lily.runtime.runner import Runner
from lily.runtime.state import SessionState
from lily.weights import load_params

PROMPTS = [[5, 6, 7, 8, 9], list(range(10, 300)), [3, 1, 4, 1, 5, 9, 2, 6], list(range(400, 430))]
JOIN = [0, 0, 2, 3]  # the step at which each row joins the batch
STEPS = 7
# The batched step multiplies B rows at once, which sums in another order than one row
# (BLAS picks its kernel by shape): fp32 rounding, not a different computation.
LOGPROB_TOL = 1e-5


def model_from(path, dtype=torch.float32, kernels=False, device="cpu") -> Model:
    cfg = ModelConfig.from_dir(path)
    params = load_params(path, cfg, device=device, dtype=dtype, progress=False)
    return Model(cfg, params, dtype, kernels=kernels)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("batch-decode")
    write_random_checkpoint(d, TINY_TEXT_CONFIG, "mlx4", seed=5, progress=False)
    return d


@pytest.fixture(scope="module")
def conditioned(tmp_path_factory):
    """The tiny model with the benchmark's well-conditioned weights (lily/bench/
    conditioned.py): bf16 rounded in another order stays near, where the plain random
    weights are rounding-chaotic (the one-row bf16 step was seen 10% off fp32 at a row)."""
    d = tmp_path_factory.mktemp("batch-decode-conditioned")
    write_random_checkpoint(d, TINY_TEXT_CONFIG, "mlx4", seed=5, init="conditioned",
                            progress=False)  # fmt: skip
    return d


def new_state(model: Model, limit: int = 1024) -> SessionState:
    return SessionState.new(model.cfg, model.device, model.dtype, limit)


def alone(model: Model, prompt: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and the logits each was taken from, the sequence run by itself."""
    runner, st = Runner(model, 64), new_state(model)
    logits = runner.prefill(prompt, st)
    toks, seen = [], []
    for _ in range(n):
        toks.append(int(logits.argmax()))
        seen.append(logits)
        logits = runner.decode(toks[-1], st)
    return toks, seen


def batched(model: Model, prompts, join, steps: int):
    """The same greedy decode with every row in one batched step from its join step on."""
    runner = Runner(model, 64)
    states = [new_state(model) for _ in prompts]
    toks: list[list[int]] = [[] for _ in prompts]
    seen: list[list[torch.Tensor]] = [[] for _ in prompts]
    for step in range(steps + max(join)):
        for r, p in enumerate(prompts):
            if join[r] == step:  # its prefill comes between the others' steps
                logits = runner.prefill(p, states[r])
                toks[r].append(int(logits.argmax()))
                seen[r].append(logits)
        rows = [r for r in range(len(prompts)) if join[r] <= step and len(toks[r]) < steps]
        if not rows:
            break
        out = runner.decode_rows([toks[r][-1] for r in rows], [states[r] for r in rows])
        assert out.shape == (len(rows), model.cfg.vocab_size)
        for i, r in enumerate(rows):
            toks[r].append(int(out[i].argmax()))
            seen[r].append(out[i])
    return toks, seen, states


def test_batched_decode_equals_each_sequence_alone(checkpoint):
    model = model_from(checkpoint)
    toks, seen, states = batched(model, PROMPTS, JOIN, STEPS)
    caps = {st.kv[model.cfg.attn_layers[0]].capacity for st in states}
    assert len(caps) > 1, "the rows should have different KV capacities"
    for r, p in enumerate(PROMPTS):
        ref_toks, ref_seen = alone(model, p, STEPS)
        assert toks[r] == ref_toks, r
        for a, b in zip(seen[r], ref_seen, strict=True):
            lp, ref = torch.log_softmax(a, -1), torch.log_softmax(b, -1)
            assert float((lp - ref).abs().max()) <= LOGPROB_TOL
        # the runner kept each state's bookkeeping: the prompt and every consumed token
        assert states[r].tokens == p + toks[r][:-1]
        assert states[r].length == len(p) + STEPS - 1 and not states[r].busy


def test_batched_decode_matches_transformers(hf_tiny_dir, tiny_hf_model):
    """Each row's logits at every batched step against transformers' forward over that
    row's whole sequence alone (the same bound as the reference forward's own test)."""
    model = model_from(hf_tiny_dir)
    prompts = [[7, 300, 12, 45], list(range(20, 61)), [99, 1, 250]]
    toks, seen, _ = batched(model, prompts, [0, 0, 1], 4)
    for r, p in enumerate(prompts):
        ids = torch.tensor(p + toks[r][:-1])
        with torch.no_grad():
            ref = tiny_hf_model(ids[None]).logits[0].float()[len(p) - 1 :]
        got = torch.stack(seen[r])
        err = float((got.double() - ref.double()).norm() / ref.double().norm())
        assert err <= 1e-4, (r, err)
        assert toks[r] == ref.argmax(-1).tolist()


def test_batched_step_checks_its_rows(checkpoint):
    model = model_from(checkpoint)
    runner = Runner(model, 64)
    a, b = new_state(model), new_state(model)
    runner.prefill([1, 2, 3], a)
    runner.prefill([4, 5], b)
    with pytest.raises(ValueError, match="2 tokens for 1 states"):
        runner.decode_rows([1, 2], [a])
    with pytest.raises(ValueError, match="one token per row"):
        model.run(torch.tensor([1, 2, 3]), Rows([a, b]), [3, 2], step=True)


# NOTE: on the GPU only: under the Triton interpreter one step of this tiny model took about
# a minute on the shared CPU; the batched kernels are checked op by op there
# (tests/ops/test_batch_decode_ops.py).
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the whole model on the kernels: GPU")
@pytest.mark.parametrize("graphs", [False, True], ids=lambda g: f"graphs={g}")
def test_kernel_rows_match_kernel_single_steps(conditioned, graphs):
    """The kernels' batched step (B-row GEMVs, the MoE over rows routed apart, each row's
    mixers on its own state through the row tables, one graph per batch size) against the
    kernels' one-sequence step, in bf16, while rows leave and others take their places: on
    the conditioned tiny model, within issue 22's bar (relative L2 1e-2, the same top-1).
    The batched MoE's 4-row entry rounds h to bf16 (route_once with down_operand), so the
    step is not bitwise the one-row step's; on the H100 it stayed within 0.43%."""
    model = model_from(conditioned, torch.bfloat16, kernels=True, device="cuda")
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15], [300, 301], list(range(40, 340))]
    runner = Runner(model, 16, use_graphs=graphs)
    singles, states = [], []
    for p in prompts:
        st, ref = new_state(model, 1024), new_state(model, 1024)
        runner.prefill(p, st)
        runner.prefill(p, ref)
        singles.append(ref)
        states.append(st)
    toks = [17, 18, 19, 20]
    for step, live in enumerate([[0, 1, 2], [0, 1, 2], [0, 2, 3], [1, 2, 3], [0, 1, 2, 3]]):
        # (a copy: the single steps below replay graphs that share the batched one's pool)
        out = runner.decode_rows([toks[r] for r in live], [states[r] for r in live]).clone()
        for i, r in enumerate(live):
            want = runner.decode(toks[r], singles[r])
            err = float((out[i].double() - want.double()).norm() / want.double().norm())
            assert err <= 1e-2, (step, r, err)  # bf16 roundings in another order
            assert int(out[i].argmax()) == int(want.argmax()), (step, r)
            toks[r] = int(want.argmax())
    if graphs:
        assert {k[:2] for k in runner.graphs if k[0] == "rows"} == {("rows", 3), ("rows", 4)}


@pytest.mark.parametrize(("rows_moe", "rows_prep"), [(False, False), (True, False), (True, True)],
                         ids=["no_rows_mma", "rows_switches", "rows_prep"])  # fmt: skip
def test_model_rows_on_the_kernels_equal_each_row_alone(monkeypatch, rows_moe, rows_prep):
    """Model.run over Rows on the kernels (the Triton interpreter on the CPU; bf16, so
    every layer's MoE takes the batched step's kernel: moe_decode over the rows, or with
    ROWS_MOE moe_decode_rows and with ROWS_MMA the projections and head on
    qgemv_mma_rows, with ROWS_PREP their normed rows prepared by rows_prep; the mixers
    their row tables) against Model.run of each
    row alone on the kernels' one-sequence step (moe_decode of one row): the last layer's
    output of every row. Rows at different positions over states prefilled (by the
    reference path) from different prompts. Two layers, one of each kind, of the tiny
    model's shapes: a step of the four-layer model took minutes on the interpreter. On a
    GPU the same, natively."""
    import dataclasses

    import lily.model.ops as model_ops
    from lily.bench.random_model import model_config, random_params
    from lily.runtime.rows import RowBuffers

    cfg = dataclasses.replace(model_config("tiny"), num_hidden_layers=2,
                              layer_types=("linear_attention", "full_attention"))  # fmt: skip
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    params = random_params(cfg, dev, "mlx4", seed=3, dtype=torch.bfloat16)
    ref = Model(cfg, params, torch.bfloat16, kernels=False)
    model = Model(cfg, params, torch.bfloat16, kernels=True)
    prompts, toks = [[5, 6, 7, 8, 9], list(range(40, 71)), [300, 301]], [17, 400, 23]
    batch, alone = [], []
    for p in prompts:  # the same prefill twice: one state for the batch, one alone
        for group in (batch, alone):
            st = new_state(ref)
            Runner(ref, 64).prefill(p, st)
            group.append(st)
    rows_seen = []  # the rows of each MoE call of the batched kernel
    name = "moe_decode_rows" if rows_moe else "moe_decode"
    real = getattr(model_ops, name)
    monkeypatch.setattr(model_ops, "ROWS_MOE", rows_moe)
    monkeypatch.setattr(model_ops, "ROWS_MMA", rows_moe)
    monkeypatch.setattr(model_ops, "ROWS_PREP", rows_prep)
    preps = []
    real_prep = model_ops.rows_prep
    monkeypatch.setattr(
        model_ops, "rows_prep", lambda x, *a, **k: preps.append(len(x)) or real_prep(x, *a, **k)
    )
    mma_rows = []
    real_mma = model_ops.qgemv_mma_rows
    monkeypatch.setattr(
        model_ops,
        "qgemv_mma_rows",
        lambda x, *a, **k: mma_rows.append(len(x)) or real_mma(x, *a, **k),
    )
    monkeypatch.setattr(
        model_ops, name, lambda x, *a, **k: rows_seen.append(len(x)) or real(x, *a, **k)
    )
    bound = 64
    rows = RowBuffers(cfg, len(prompts), dev).rows(batch)
    starts = torch.tensor([len(p) for p in prompts], dtype=torch.int32, device=dev)
    with torch.inference_mode():
        got, _ = model.run(torch.tensor(toks, device=dev), rows, starts, bound, step=True)
        assert rows_seen == [3] * cfg.num_hidden_layers  # every layer's MoE, all rows at once
        # with ROWS_MMA every packed projection and the head: more than one a layer
        assert (len(mma_rows) > cfg.num_hidden_layers) == rows_moe and set(mma_rows) <= {3}
        # with ROWS_PREP each layer's input projection: prepared rows
        assert len(preps) == (cfg.num_hidden_layers if rows_prep else 0)
        if rows_prep:  # and the head's final norm (against the reference head, row by row)
            logits = model.head(got, step=True)
            assert len(preps) == cfg.num_hidden_layers + 1
            for r in range(len(prompts)):
                want = ref.head(got[r : r + 1])[0].double()
                assert float((logits[r].double() - want).norm() / want.norm()) <= 1e-2, r
        monkeypatch.setattr(model_ops, name, real)
        for r, (p, st) in enumerate(zip(prompts, alone, strict=True)):
            want, _ = model.run(torch.tensor(toks[r : r + 1], device=dev), st, len(p), bound,
                                step=True)  # fmt: skip
            err = float((got[r].double() - want[0].double()).norm() / want[0].double().norm())
            assert err <= 2e-2, (r, err)  # bf16 roundings in another order


def test_row_tables_follow_the_rows_buffers(checkpoint):
    """The batched kernels' tables name each row's caches (address, capacity) and states,
    and are rewritten when a cache grows or another state takes a row."""
    from lily.runtime.rows import RowBuffers

    model = model_from(checkpoint)
    cfg = model.cfg
    a, b, c = new_state(model), new_state(model), new_state(model)
    buf = RowBuffers(cfg, 2, torch.device("cpu"))

    def expect(states):
        rows = buf.rows(states)
        for i in cfg.attn_layers:
            want = [[s.kv[i].k.data_ptr(), s.kv[i].v.data_ptr(), s.kv[i].capacity] for s in states]
            assert rows.tables[i].tolist() == want
        for i in cfg.linear_layers:
            want = [[s.deltanet[i].conv.data_ptr(), s.deltanet[i].recurrent.data_ptr()]
                    for s in states]  # fmt: skip
            assert rows.tables[i].tolist() == want

    expect([a, b])
    b.reserve(5000)  # grown: new buffers, another capacity
    expect([a, b])
    expect([c, a])
    buf.load([3, 4], [10, 20])
    assert buf.ids.tolist() == [3, 4] and buf.pos.tolist() == [10, 20]
