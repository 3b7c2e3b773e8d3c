"""``python -m lily.bench.kernels``: merging the kernel scripts' JSON, missing scripts."""

from __future__ import annotations

import json
import textwrap

from lily.bench import kernels


def script(path, body: str):
    path.write_text(
        textwrap.dedent(f"""
        import argparse, json
        ap = argparse.ArgumentParser()
        ap.add_argument("--out")
        ap.add_argument("--quick", action="store_true")
        args = ap.parse_args()
        {body}
    """)
    )
    return str(path)


def test_merge_sorts_by_fraction_of_floor_and_reports_problems(tmp_path, capsys):
    # sections of rows, as lily/bench/gpu/kernels/mixer.py writes them
    mixer = script(
        tmp_path / "mix.py",
        """assert args.quick, "extra args are passed on"
        json.dump({"gpu": "H200", "ceilings": {"copy_GBps": 4200.0},
          "dn_decode": [{"op": "dn_decode", "block_v": 32, "us_per_layer": 20.0,
                         "GBps": 3000.0, "frac_copy": 0.7, "rel_err": 1e-6}],
          "attn_prefill": [{"op": "attn_prefill", "T": 2048, "ms": 0.5, "TFLOPs": 300,
                            "frac_matmul": 0.45},
                           {"op": "attn_prefill", "T": 4096, "error": "out of resources"}],
          "dn_prefill": [{"op": "dn_prefill", "T": 512, "ms": 1.5, "tok_per_s": 3e5}]},
          open(args.out, "w"))""",
    )
    linear = script(
        tmp_path / "lin.py",
        """json.dump([
            {"kernel": "gemv_4bit", "shape": "2048x4096", "time_us": 10.0, "floor_us": 9.0},
        ], open(args.out, "w"))""",
    )
    broken = script(tmp_path / "bad.py", "raise SystemExit('no GPU here')")
    missing = str(tmp_path / "nope.py")
    out = tmp_path / "merged.json"
    rc = kernels.main(["--scripts", ",".join([mixer, linear, broken, missing]),
                       "--out", str(out), "--", "--quick"])  # fmt: skip
    assert rc == 0
    merged = json.loads(out.read_text())["kernels"]
    got = [(r["kernel"], r["fraction_of_floor"]) for r in merged]
    assert got == [("attn_prefill", 0.45), ("dn_decode", 0.7), ("gemv_4bit", 0.9),
                   ("attn_prefill", None), ("dn_prefill", None)]  # fmt: skip
    assert merged[0]["time_us"] == 500.0 and merged[0]["case"] == "T=2048"
    assert merged[1]["time_us"] == 20.0 and merged[1]["case"] == "block_v=32"
    assert merged[3]["error"] == "out of resources"
    problems = json.loads(out.read_text())["problems"]
    assert [p.split(":")[0] for p in problems] == [broken, missing]
    assert "exit code 1: no GPU here" in problems[0]
    assert problems[1].endswith("not found (skipped)")
    table = capsys.readouterr().out.splitlines()
    assert table[2].startswith("| attn_prefill | T=2048 | 500.0 | 45.0 |")
    assert "error: out of resources" in table[5]


def test_nothing_to_merge_is_a_failure_but_not_a_crash(tmp_path, capsys):
    assert kernels.main(["--scripts", str(tmp_path / "a.py")]) == 1
    assert "not found (skipped)" in capsys.readouterr().out


def test_bad_json_is_named(tmp_path):
    bad = script(tmp_path / "s.py", "open(args.out, 'w').write('{')")
    recs, problem = kernels.run_script(bad, [], 60)
    assert recs == [] and "unreadable output" in problem
    empty = script(tmp_path / "e.py", "json.dump({'gpu': 'x'}, open(args.out, 'w'))")
    recs, problem = kernels.run_script(empty, [], 60)
    assert recs == [] and "no list of result rows" in problem


def test_gpu_scripts_are_modules_of_the_package(capsys):
    """``lily bench --run list`` names every GPU script by module (no repository paths);
    each one is importable from the installed package; a wrong name is a clear error."""
    import importlib.util

    import pytest

    from lily.bench import gpu
    from lily.cli import main

    assert main(["bench", "--run", "list"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert listed == list(gpu.scripts()) and "kernels.linear" in listed
    assert {n.split(".")[0] for n in listed} == set(gpu.GROUPS)
    for n in listed:
        assert importlib.util.find_spec(f"lily.bench.gpu.{n}") is not None, n
    assert all(s.startswith("lily.bench.gpu.") for s in kernels.SCRIPTS)
    with pytest.raises(ValueError, match="no GPU script 'nope'"):
        gpu.run("nope", [])
    # the scripts' parts (no __main__ block) exist but are neither listed nor run
    parts = ["kernels.common", "kernels.compile_report", "kernels.dense_linear",
             "kernels.moe_linear", "kernels.mixer_deltanet", "kernels.mixer_attention"]  # fmt: skip
    for n in parts:
        assert importlib.util.find_spec(f"lily.bench.gpu.{n}") is not None, n
        assert n not in listed
    with pytest.raises(ValueError, match="no GPU script 'kernels.common'"):
        gpu.run("kernels.common", [])
    recs, problem = kernels.run_script("lily.bench.gpu.kernels.nope", [], 60)
    assert recs == [] and problem.endswith("not found (skipped)")


def test_quick_reaches_the_compile_only_path(monkeypatch, tmp_path):
    """``--quick`` picks the table-only sweeps and hands them to compile_report as an
    argument (the parts read no module global): no GEMV, GEMM, qgemv_mma or moe_prefill
    tile sweeps, the first three moe_decode variants; without it, every sweep."""
    import sys

    from lily.bench.gpu.kernels import common, linear

    seen = []
    monkeypatch.setattr(linear, "compile_report", lambda *a: seen.append(a) or [])
    out = tmp_path / "x.json"
    for flag in (["--quick"], []):
        monkeypatch.setattr(sys, "argv", ["linear", "--compile-only", "--only", "gemv,gemm",
                                          "--out", str(out), *flag])  # fmt: skip
        linear.main()
        assert json.loads(out.read_text()) == {"compile_only": []}
    (only, quick, sass), (_, full, _) = seen
    assert only == {"gemv", "gemm"} and sass is None
    assert quick is common.QUICK and full is common.FULL
    assert not (quick.gemv or quick.gemm or quick.mma or quick.prefill_bm)
    assert quick.decode == full.decode[:3] and len(full.decode) == 6
    assert full.gemv and full.gemm and full.mma and full.prefill_bm == (16, 32, 64, 128)
