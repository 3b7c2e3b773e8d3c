"""``lily bench`` end to end on the CPU: tiny random model, two lengths, real peers."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest
from optional_deps import mlx_missing

from lily.bench.cli import add_bench_args, bench_plan, run_bench
from lily.bench.peers import PEERS, PeerSpec


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_bench_args(p)
    return p.parse_args(argv)


@pytest.fixture(scope="module")
def bench_result(tmp_path_factory):
    if (why := mlx_missing()) is not None:  # the run's peers include a real mlx-lm
        pytest.skip(why)
    out = tmp_path_factory.mktemp("bench")
    mp = pytest.MonkeyPatch()
    # a peer whose import fails must be skipped with one line, not crash the run
    mp.setitem(PEERS, "ghost", PeerSpec("ghost", ("lily_no_such_module",), "x:Y"))
    args = parse(["--random", "tiny", "--device", "cpu", "--lengths", "16,40",
                  "--decode-tokens", "4", "--peers", "transformers,mlx-lm,ghost", "--skew",
                  "8", "--out", str(out), "--name", "t", "--load-tokens", "32"])  # fmt: skip
    try:
        assert run_bench(args) == 0
    finally:
        mp.undo()
    return out, json.loads((out / "t.json").read_text())


def test_outputs_written(bench_result):
    out, res = bench_result
    assert res["schema"] == "lily.bench/1"
    md = (out / "t.md").read_text()
    assert "| lily: prefill tok/s |" in md and "| transformers: decode tok/s |" in md
    assert "lily/mlx-lm: prefill" in md
    png = (out / "t.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_environment_and_ceilings(bench_result):
    _, res = bench_result
    env = res["env"]
    for key in ("date", "gpu", "driver", "torch", "triton", "transformers", "mlx", "mlx_lm",
                "git_commit", "python"):  # fmt: skip
        assert key in env
    assert env["torch"] and env["transformers"]
    # the commit: git's, or LILY_GIT_COMMIT where the machine's git metadata is stale
    given = os.environ.get("LILY_GIT_COMMIT")
    assert env["git_commit"] == given if given else len(env["git_commit"]) == 40
    assert res["ceilings"]["copy_GBps"] > 0 and res["ceilings"]["matmul_TFLOPs"] > 0
    assert res["model"]["weight_bytes"] > 0 and res["model"]["build_s"] >= 0
    # mlx-lm needs the model on disk: it was written, loaded back and found identical
    assert res["model"]["disk_identical_bytes"] is True and res["model"]["disk_load_s"] > 0


def test_points_for_every_engine_and_length(bench_result):
    _, res = bench_result
    by = {(p["engine"], p["length"]): p for p in res["points"]}
    engines = ["lily", "lily (skewed router)", "transformers", "mlx-lm"]
    assert set(by) == {(e, n) for e in engines for n in (16, 40)}
    for (e, _), p in by.items():
        assert p["status"] == "ok", p
        assert p["prefill_tok_s"] > 0 and p["prefill_TFLOPs"] > 0 and p["round"] == 0
        if e == "lily (skewed router)":
            assert "decode_tokens" not in p  # prefill only
        else:
            assert p["decode_tokens"] == 4 and p["decode_tok_s"] > 0
            assert p["decode_GBps"] > 0 and 0 < p["decode_frac_copy"]
            assert p["decode_bytes_per_token"] > res["cost_model"]["weight_bytes_per_token"]
    assert {e["name"]: e["status"] for e in res["engines"]} == {
        "lily": "ok", "lily (skewed router)": "ok", "transformers": "ok", "mlx-lm": "ok",
        "ghost": "skipped"}  # fmt: skip
    assert any("peer ghost: skipped" in n for n in res["notes"])
    info = {e["name"]: e.get("info", {}) for e in res["engines"]}
    assert info["lily"]["runner"] and info["transformers"]["weights"].startswith("dequantized")


def test_summary_averages_and_ratios(bench_result):
    _, res = bench_result
    s = res["summary"]["engines"]["lily"]
    assert s["lengths"] == [16, 40]
    vals = list(s["prefill_tok_s"].values())
    assert s["avg_prefill_tok_s"] == pytest.approx(sum(vals) / 2)
    r = res["summary"]["ratios"]["lily/transformers"]["decode"]
    want = s["decode_tok_s"]["16"] / res["summary"]["engines"]["transformers"]["decode_tok_s"]["16"]
    assert r["per_length"]["16"] == pytest.approx(want)
    assert set(res["summary"]["ratios"]) == {"lily/transformers", "lily/mlx-lm"}


def test_expert_load_histogram(bench_result):
    _, res = bench_result
    load = res["expert_load"]
    # the tiny model's 8 experts route by token codes: its one hot row must be scaled
    # well past the default 2 before it outbids a token's own experts
    assert set(load) == {"uniform router", "router skew 8.0"}
    for el in load.values():
        counts = el["counts"]
        assert len(counts) == 4 and all(len(c) == 8 for c in counts)  # layers x experts
        assert all(sum(c) == 32 * 2 for c in counts)  # every token picks top-2 per layer
        assert (
            el["tokens"] == 32
            and el["mean_rows_per_expert"] == 8
            and el["quantiles"]["max"] == max(map(max, counts))
        )
    assert load["router skew 8.0"]["top1_row_share"] > load["uniform router"]["top1_row_share"]


def test_bad_options_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown peer 'vllm'"):
        bench_plan(parse(["--device", "cpu", "--peers", "vllm"]))
    with pytest.raises(ValueError, match="either --model or --random"):
        bench_plan(parse(["--device", "cpu", "--model", str(tmp_path), "--random", "tiny"]))
    plan = bench_plan(parse(["--device", "cpu", "--peers", "none"]))
    assert plan.source["name"] == "tiny" and plan.peers == []
    assert plan.lengths == [256, 512, 1024, 2048]  # those that fit the tiny 4K context
    assert Path(plan.out).name == "results"


def test_checkpoint_directory_with_our_engine_as_a_worker_peer(tmp_path, mlx4_dir):
    args = parse(["--model", str(mlx4_dir), "--device", "cpu", "--lengths", "8",
                  "--decode-tokens", "2", "--peers", "lily", "--out", str(tmp_path),
                  "--name", "d", "--load-tokens", "8"])  # fmt: skip
    assert run_bench(args) == 0
    res = json.loads((tmp_path / "d.json").read_text())
    assert res["config"]["source"]["kind"] == "dir" and res["model"]["load_s"] > 0
    assert [(p["engine"], p["status"]) for p in res["points"]] == [
        ("lily", "ok"), ("lily (worker)", "ok")]  # fmt: skip
    assert res["engines"][1]["info"]["pid"] != os.getpid()  # timed in its own process
    assert set(res["summary"]["ratios"]) == {"lily/lily (worker)"}


def test_a_gpu_script_that_exits_with_a_message_shows_it(capsys):
    """``sys.exit("why")`` in a GPU script reaches the user with status 1 (the mixer
    benchmark exits so on a section it does not have, before it needs a GPU), not as a
    silent failure."""
    from lily.bench import gpu

    assert gpu.run("kernels.mixer", ["--only", "nope"]) == 1
    assert "unknown section(s) ['nope']" in capsys.readouterr().err


def test_the_results_name_the_commit_they_are_told(monkeypatch):
    # (a copied working tree's git metadata can be stale: LILY_GIT_COMMIT says which code ran)
    from lily.bench.measure import env_info

    monkeypatch.delenv("LILY_GIT_COMMIT", raising=False)
    here = env_info("cpu")
    assert len(here["git_commit"]) == 40 and isinstance(here["git_dirty"], bool)
    monkeypatch.setenv("LILY_GIT_COMMIT", "76648b9")
    told = env_info("cpu")
    assert told["git_commit"] == "76648b9" and told["git_dirty"] is None
