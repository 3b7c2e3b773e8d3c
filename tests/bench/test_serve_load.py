"""The concurrency benchmark (lily/bench/serve_load.py, lily/bench/gpu/e2e/concurrency.py):
its arithmetic on made-up chunk times, and the whole script on the CPU with the tiny model
(the official openai client against the in-process server)."""

from __future__ import annotations

import json

import pytest

from lily.bench.serve_load import Stream, bars, round_result


def stream(sent: float, times: list[float], tokens: int | None = None) -> Stream:
    return Stream(sent=sent, chunks=times, tokens=tokens if tokens is not None else len(times))


def test_window_rates_gaps_and_scaling():
    a = stream(0.0, [1.0, 1.1, 1.2, 1.3, 1.4, 2.0])  # a 0.6 s gap at the end
    b = stream(0.5, [1.2, 1.25, 1.3, 1.35, 1.4, 1.45, 1.5], tokens=14)  # 2 tokens a chunk
    r = round_result(2, [a, b])
    # every stream decodes from 1.2 (b's first token) to 1.5 (b's last)
    assert r["window_s"] == pytest.approx(0.3)
    assert r["per_stream_tok_s"] == pytest.approx([2 / 0.3, 2 * 6 / 0.3])
    assert r["total_tok_s"] == pytest.approx(14 / 0.3)
    assert r["ttft_s"] == pytest.approx([1.0, 0.7])
    assert r["max_gap_s"] == pytest.approx(0.1)  # a's chunks at 1.3 and 1.4, none after
    assert a.max_gap(1.0, 2.0) == pytest.approx(0.6)


def test_failed_streams_and_bars():
    bad = round_result(2, [stream(0, [1.0]), Stream(error="APIError: boom")])
    assert "total_tok_s" not in bad and bad["errors"] == ["APIError: boom"]
    rounds = [{"concurrency": 1, "total_tok_s": 100.0, "min_stream_tok_s": 100.0},
              {"concurrency": 4, "total_tok_s": 210.0, "min_stream_tok_s": 52.0},
              {"concurrency": 8, "total_tok_s": 290.0, "min_stream_tok_s": 36.0}]  # fmt: skip
    got = bars({"rounds": rounds, "ttft": {"ratio": 1.5, "max_gap_during_prefill_s": 0.12}})
    assert got == {"4 streams >= 2.0x one": True, "8 streams >= 3.0x one": False,
                   "each of 8 streams >= 250 tok/s": False, "busy TTFT <= 2x idle": True,
                   "no gap > 100 ms meanwhile": False}  # fmt: skip


def test_a_stream_of_mostly_textless_tokens_is_an_error_not_a_rate():
    # 256 tokens in 1 text chunk (the rest decoded to nothing): no per-token timing
    r = round_result(2, [stream(0.0, [1.0], tokens=256), stream(0.0, [0.5, 0.6], tokens=3)])
    assert r["errors"] == ["256 tokens came in 1 text chunks: not timeable"]
    assert "total_tok_s" not in r


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_the_script_runs_on_the_cpu(tmp_path, sampled, monkeypatch):
    from lily.bench.gpu.e2e.concurrency import main
    from lily.runtime import warmup

    warmed = []
    real = warmup.warm_up
    monkeypatch.setattr(warmup, "warm_up", lambda *a, **k: warmed.append(1) or real(*a, **k))

    out, md, png = tmp_path / "c.json", tmp_path / "c.md", tmp_path / "c.png"
    assert main(["--tiny", "--concurrency", "1,2", "--prompt", "12", "--max-tokens", "6",
                 "--busy", "2", "--busy-tokens", "400", "--repeats", "1", "--no-warmup",
                 "--out", str(out), "--md", str(md), "--png", str(png)]
                + ["--sampled"] * sampled) == 0  # fmt: skip
    res = json.loads(out.read_text())
    assert [r["concurrency"] for r in res["rounds"]] == [1, 2]
    for r in res["rounds"]:
        assert r["errors"] == [] and r["tokens"] == [6] * r["concurrency"]
        assert r["total_tok_s"] > 0 and len(r["per_stream_tok_s"]) == r["concurrency"]
    t = res["ttft"]
    assert t["errors"] == [] and t["busy_ttft_s"] > 0 and t["idle_ttft_median_s"] > 0
    # the engine's work while the new prompt waited: its own prefill among the steps
    whats = {e["what"] for e in t["gap_trace"]["events"]}
    assert {"Batch.step", "Engine.prefill_chunk", "Engine.take_state"} <= whats
    assert "| 2 |" in md.read_text() and "Bars (issue 22)" in md.read_text()
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert warmed == [1]  # the server warmed its kernels up, as lily serve does


def test_the_gc_ab_runs_the_ttft_test_unfrozen_then_frozen(tmp_path, monkeypatch):
    import gc

    from lily.bench import serve_load
    from lily.bench.gpu.e2e.concurrency import main

    seen = []
    real = serve_load.busy_ttft

    def spy(*a, **k):  # the heap's state when each TTFT test ran
        seen.append(gc.get_freeze_count() > 0)
        return real(*a, **k)

    from lily.runtime import warmup

    warmed = []
    monkeypatch.setattr(serve_load, "busy_ttft", spy)
    monkeypatch.setattr(warmup, "warm_up", lambda *a, **k: warmed.append(1))
    out = tmp_path / "c.json"
    assert main(["--tiny", "--concurrency", "1", "--prompt", "12", "--max-tokens", "4",
                 "--busy", "2", "--busy-tokens", "400", "--repeats", "1", "--no-warmup",
                 "--gc-ab", "2", "--no-server-warmup", "--out", str(out)]) == 0  # fmt: skip
    assert warmed == []  # --no-server-warmup: the server skipped its kernel warm-up
    assert seen == [False, True, False, True]  # the server itself froze nothing
    res = json.loads(out.read_text())
    assert [r["frozen"] for r in res["gc_ab"]] == [False, True, False, True]
    assert res["ttft"] == res["gc_ab"][1]
    assert all(r["errors"] == [] and "gap_trace" in r for r in res["gc_ab"])
    assert gc.get_freeze_count() == 0


def test_a_run_cut_after_its_rounds_keeps_them(tmp_path, monkeypatch):
    # the TTFT test fails (as a run stopped by a time limit would never reach its end): the
    # rounds are already in --out, marked partial
    from lily.bench import serve_load
    from lily.bench.gpu.e2e.concurrency import main

    def cut(*a, **k):
        raise RuntimeError("stopped: the call's time limit")

    monkeypatch.setattr(serve_load, "busy_ttft", cut)
    out = tmp_path / "c.json"
    with pytest.raises(RuntimeError, match="time limit"):
        main(["--tiny", "--concurrency", "2", "--prompt", "12", "--max-tokens", "6",
              "--no-warmup", "--out", str(out)])  # fmt: skip
    res = json.loads(out.read_text())
    assert [r["concurrency"] for r in res["rounds"]] == [2]
    assert res["rounds"][0]["tokens"] == [6, 6] and "ttft" not in res
    assert res["partial"].startswith("rounds only") and res["args"]["concurrency"] == "2"


def test_every_stream_runs_in_a_client_process_of_its_own():
    # the clients must not share the server's process (and its GIL): each stream reports
    # the id of the process that streamed it
    import os

    import torch

    from lily.bench.random_model import model_config, random_params
    from lily.bench.serve_load import Load, Server
    from lily.bench.source import engine_from_params
    from lily.config import EngineConfig

    cfg = model_config("tiny")
    engine = engine_from_params(cfg, random_params(cfg, "cpu", dtype=torch.float32),
                                EngineConfig(device="cpu", max_context=4096, max_running=4),
                                name="random tiny", text_only=True)  # fmt: skip
    server = Server(engine, 4)
    try:
        with Load(server.url, cfg.vocab_size) as load:
            first = load.together([load.prompt(12) for _ in range(3)], 4).wait()
            again = load.together([load.prompt(12) for _ in range(2)], 4).wait()
            # a stoppable batch ends early once asked; the probe runs in yet another process
            batch = load.together([load.prompt(12) for _ in range(2)], 3000, stoppable=True)
            assert batch.started(60)
            probe = load.run(load.prompt(12), 1)
            batch.stop()
            stopped = batch.wait()
    finally:
        server.close()
    for s in (*first, *again, probe, *stopped):
        assert s.error == "" and s.pid not in (0, os.getpid())
    assert len({s.pid for s in first}) == 3 and len({s.pid for s in (*stopped, probe)}) == 3
    assert {s.pid for s in again} <= {s.pid for s in first}  # the pool is reused
    assert [s.tokens for s in (*first, *again)] == [4] * 5 and probe.tokens == 1
    assert all(0 < len(s.chunks) < 3000 for s in stopped)


def test_a_dead_or_hung_client_process_is_an_error_not_a_hang():
    import multiprocessing
    import os
    import signal
    import socket
    import time

    from lily.bench.serve_load import Load

    with socket.socket() as hole:  # accepts connections (the backlog), never answers
        hole.bind(("127.0.0.1", 0))
        hole.listen(8)
        url = f"http://127.0.0.1:{hole.getsockname()[1]}"
        with Load(url, 100, timeout=1.0) as load:
            batch = load.together([[1, 2, 3], [4, 5, 6]], 4)
            procs = [p for p in multiprocessing.active_children() if p.name == "lily-bench-client"]
            assert len(procs) == 2
            os.kill(procs[0].pid, signal.SIGKILL)
            os.kill(procs[1].pid, signal.SIGSTOP)  # hangs: its own client timeout cannot fire
            t0 = time.perf_counter()
            streams = batch.wait()
            assert time.perf_counter() - t0 < 10
            assert sorted(s.error for s in streams) == [
                "the client process died (exit code -9)",
                "the client process gave no result in 1 s: killed",
            ]
            # the pool starts a fresh process for the next stream (which the hole hangs too)
            again = load.run([7, 8], 2)
            assert again.pid not in (0, procs[0].pid, procs[1].pid)
            assert again.error == "the client process gave no result in 1 s: killed"


ROUNDS = [{"concurrency": 2, "total_tok_s": 180.0, "min_stream_tok_s": 88.0,
           "median_stream_tok_s": 90.0, "max_gap_s": 0.01, "ttft_s": [0.2, 0.3]},
          {"concurrency": 1, "total_tok_s": 100.0, "min_stream_tok_s": 100.0,
           "median_stream_tok_s": 100.0, "max_gap_s": 0.01, "ttft_s": [0.1]},
          {"concurrency": 4, "errors": ["APIError: boom"]}]  # fmt: skip
TTFT = {"prompt_tokens": 64, "busy_streams": 7, "idle_ttft_median_s": 0.1, "busy_ttft_s": 0.15,
        "ratio": 1.5, "max_gap_during_prefill_s": 0.02,
        "busy_rate_during_prefill_tok_s": 90.0}  # fmt: skip


def test_the_plot_draws_the_rounds_that_ran_in_order(tmp_path):
    from lily.bench.serve_load import plot, series

    s = series({"rounds": ROUNDS})
    assert s == {"streams": [1, 2], "total": [100.0, 180.0], "min_stream": [100.0, 88.0],
                 "median_stream": [100.0, 90.0], "linear": [100.0, 200.0]}  # fmt: skip
    assert series({"rounds": ROUNDS[:1]})["linear"] is None  # no one-stream round
    png = tmp_path / "c.png"
    assert plot({"rounds": ROUNDS, "ttft": TTFT}, str(png), "a GPU")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_render_draws_a_saved_json_again_and_refuses_others(tmp_path, capsys):
    from lily.bench.gpu.e2e.concurrency import main

    saved = tmp_path / "c.json"
    saved.write_text(json.dumps({"env": {"gpu": "a GPU"}, "rounds": ROUNDS, "ttft": TTFT}))
    md, png = tmp_path / "c.md", tmp_path / "c.png"
    assert main(["--render", str(saved), "--md", str(md), "--png", str(png)]) == 0
    text = md.read_text()
    assert "| 2 | 180.0 | 1.80 | 88.0 | 90.0 | 10 | 0.300 |" in text
    assert "| 4 | failed: ['APIError: boom'] |" in text and "0.150 s while 7 streams" in text
    assert png.read_bytes()[:4] == b"\x89PNG"
    other = tmp_path / "bench.json"
    other.write_text(json.dumps({"schema": "lily.bench/1"}))
    assert main(["--render", str(other)]) == 2
    assert main(["--render", str(tmp_path / "missing.json")]) == 2
    err = capsys.readouterr().err
    assert "not this script's JSON (no rounds)" in err and "missing.json" in err
