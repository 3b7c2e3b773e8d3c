"""The sweep's scheduling: engine order, time budgets, failures; and option parsing."""

from __future__ import annotations

import math
import time

import pytest
import torch

from lily.bench.driver import parse_lengths
from lily.bench.peers import (
    PEERS,
    PeerSpec,
    PeerUnavailable,
    check_available,
    parse_peers,
    start_peer,
)
from lily.bench.sweep import BenchAdapter, LocalEngine, Slot, run_point, sweep


class FakeAdapter(BenchAdapter):
    """Prefill takes ``per_token`` seconds per prompt token; decode ``step`` per token."""

    def __init__(self, name, per_token=0.0, step=0.0, fail_at=None, log=None):
        self.name, self.per_token, self.step, self.fail_at = name, per_token, step, fail_at
        self.log = log if log is not None else []

    def prefill(self, ids):
        if self.fail_at is not None and len(ids) >= self.fail_at:
            raise MemoryError("out of memory")
        self.log.append((self.name, len(ids)))
        time.sleep(self.per_token * len(ids))
        return 1

    def decode(self, token):
        self.log.append((self.name, "decode"))
        time.sleep(self.step)
        return token + 1


def slot(adapter, **kw):
    return Slot(adapter.name, LocalEngine(adapter), **kw)


def test_run_point_counts_tokens_and_cuts_decode_at_the_deadline():
    a = FakeAdapter("a", per_token=0.001, step=0.0)
    r = run_point(a, [0] * 50, 16, math.inf)
    assert r["length"] == 50 and r["decode_tokens"] == 16 and "decode_cut" not in r
    assert a.log.count(("a", "decode")) == 17  # one untimed step, then the 16 timed
    assert r["prefill_s"] >= 0.05 and r["prefill_tok_s"] == pytest.approx(50 / r["prefill_s"])
    assert r["decode_tok_s"] == pytest.approx(16 / r["decode_s"])
    r = run_point(FakeAdapter("a", step=0.05), [0] * 4, 100, allowance_s=0.2)
    assert 1 <= r["decode_tokens"] < 100 and "within the time budget" in r["decode_cut"]
    assert "decode_tokens" not in run_point(FakeAdapter("a"), [0] * 4, 0, math.inf)


def test_engine_order_alternates_within_each_round():
    log = []
    slots = [slot(FakeAdapter(n, log=log)) for n in ("a", "b", "c")]
    res = sweep(slots, [1, 2, 3], lambda n: [0] * n, 1, 2)
    assert len(res) == 18 and all(r["status"] == "ok" for r in res)
    prefills = [e for e in log if e[1] != "decode"]
    firsts = [prefills[i][0] for i in range(0, 18, 3)]
    assert firsts == ["a", "b", "c", "b", "c", "a"]  # rotates at every point and round
    assert {r["round"] for r in res} == {0, 1}


def test_long_lengths_are_cut_by_the_budget_and_failures_are_contained():
    fast = slot(FakeAdapter("fast", per_token=0.0001))
    slow = slot(FakeAdapter("slow", per_token=0.002))
    broken = slot(FakeAdapter("broken", fail_at=20))
    res = sweep([fast, slow, broken], [10, 20, 200, 400], lambda n: [0] * n, 2, 1, 0.3, 60.0)
    by = {(r["engine"], r["length"]): r for r in res}
    assert all(by[("fast", n)]["status"] == "ok" for n in (10, 20, 200, 400))
    assert by[("slow", 20)]["status"] == "ok"
    assert by[("slow", 200)]["status"] == "cut"  # predicted 200 * 2 ms * 1.3 > 0.3 s
    assert "predicted prefill" in by[("slow", 200)]["note"]
    assert by[("slow", 400)]["status"] == "cut" and "cut from 200" in by[("slow", 400)]["note"]
    assert by[("broken", 10)]["status"] == "ok"
    assert by[("broken", 20)]["status"] == "failed" and "MemoryError" in by[("broken", 20)]["note"]
    assert by[("broken", 400)]["status"] == "failed"


def test_the_whole_budget_is_shared_and_respected():
    a = slot(FakeAdapter("a", per_token=0.001))
    b = slot(FakeAdapter("b", per_token=0.001))
    t0 = time.perf_counter()
    res = sweep([a, b], [20, 40, 80, 160, 320], lambda n: [0] * n, 0, 1, budget_s=0.25)
    elapsed = time.perf_counter() - t0
    status = {(r["engine"], r["length"]): r["status"] for r in res}
    assert status[("a", 20)] == status[("b", 20)] == "ok"
    assert status[("a", 320)] == status[("b", 320)] == "cut"
    assert elapsed < 0.25 + 0.15  # unlimited, the sweep would take 1.24 s
    # with no budget nothing is cut
    res = sweep([a], [20, 320], lambda n: [0] * n, 0, 1)
    assert [r["status"] for r in res] == ["ok", "ok"]


def test_parse_lengths():
    assert parse_lengths("256, 1K,2k,512") == [256, 512, 1024, 2048]
    assert parse_lengths(None) is None
    with pytest.raises(ValueError, match="'12x'"):
        parse_lengths("1K,12x")
    with pytest.raises(ValueError, match="positive"):
        parse_lengths("0")


def test_peer_names_and_a_peer_whose_import_fails(monkeypatch):
    assert parse_peers("mlx-lm, transformers,mlx-lm") == ["mlx-lm", "transformers"]
    with pytest.raises(ValueError, match="unknown peer 'llama'"):
        parse_peers("transformers,llama")
    monkeypatch.setitem(PEERS, "ghost", PeerSpec("ghost", ("lily_no_such_module",), "x:Y"))
    lines = []
    assert start_peer("ghost", {"device": "cpu"}, log=lines.append) is None
    assert lines == ["peer ghost: skipped (Python package 'lily_no_such_module' not installed)"]
    check_available("transformers")  # installed here: no error


def test_a_peer_installed_but_failing_to_import_is_unavailable_when_loaded(tmp_path, monkeypatch):
    """mlx without its backend wheel is found by find_spec and fails on import (the H200
    host with mlx but not mlx-cpu): a peer run in this process must see that up front."""
    pkg = tmp_path / "lily_broken_backend"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        "raise ImportError('libbackend.so: cannot open shared object file')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(PEERS, "broken", PeerSpec("broken", ("lily_broken_backend",), "x:Y"))
    check_available("broken")  # installed: the worker reports the import error itself
    with pytest.raises(
        PeerUnavailable, match=r"'lily_broken_backend' does not import: .*libbackend"
    ):
        check_available("broken", load=True)


def test_lily_adapter_times_the_engines_own_loop():
    """With tokens drawn on the device the adapter times the engine's pipelined loop: the
    same greedy tokens as synchronous steps, the asked number of timed steps, and the
    session holds exactly the tokens the model consumed."""
    from lily.bench.random_model import model_config, random_params
    from lily.bench.source import engine_from_params
    from lily.bench.sweep import LilyAdapter
    from lily.config import EngineConfig
    from lily.runtime.runner import Runner

    cfg = model_config("tiny")
    ecfg = EngineConfig(device="cpu", dtype="float32", prefill_chunk=8, max_context=256)
    eng = engine_from_params(cfg, random_params(cfg, "cpu", dtype=torch.float32), ecfg)
    ids = list(range(5, 17))
    sync = LilyAdapter(eng)
    assert sync.engine.runner.device_decode is None
    toks = [sync.prefill(ids)]
    for _ in range(6):
        toks.append(sync.decode(toks[-1]))
    eng.runner = Runner(eng.model, 8, sample_on_device=True)
    eng.runner.decode = lambda *a: pytest.fail("a synchronous step in the pipelined loop")
    piped = LilyAdapter(eng)
    assert piped.prefill(ids) == toks[0]
    n, dt = piped.decode_timed(toks[0], 5, math.inf)
    assert n == 5 and dt > 0
    # tokens 0..6 went out; the steps that consumed 0..5 ran (none past max_tokens)
    assert piped.state.tokens == ids + toks[:6]
    # a deadline already passed still times one step; a session after that cut is whole
    piped.prefill(ids)
    assert piped.decode_timed(toks[0], 5, 0.0)[0] == 1
    assert piped.prefill(ids) == toks[0]
    assert piped.decode_timed(toks[0], 3, math.inf)[0] == 3
    assert piped.state.tokens == ids + toks[:4]


def test_mlx_adapter_times_its_own_pipelined_loop(mlx4_dir):
    """The MLX-LM peer's timed decode (its generate_step pattern: one step queued ahead)
    gives the same greedy tokens as synchronous steps, and the asked number of them."""
    from lily.bench.peer_mlx import MlxAdapter

    a = MlxAdapter({"kind": "dir", "path": str(mlx4_dir), "dtype": "float32"})
    ids = list(range(5, 17))
    toks = [a.prefill(ids)]
    for _ in range(7):
        toks.append(a.decode(toks[-1]))
    assert a.prefill(ids) == toks[0]
    n, dt = a.decode_timed(toks[0], 5, math.inf)
    assert n == 5 and dt > 0
    assert a.timed == toks[2:7]  # token 1 came from the untimed step
