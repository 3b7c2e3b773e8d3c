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
    linear = script(
        tmp_path / "lin.py",
        """json.dump({"results": [
            {"kernel": "gemv_4bit", "shape": "2048x4096", "time_us": 10.0, "floor_us": 9.0},
            {"kernel": "moe_gemm", "shape": [512, 2048], "time_ms": 0.5, "floor_us": 100.0},
        ]}, open(args.out, "w"))""",
    )
    mixer = script(
        tmp_path / "mix.py",
        """assert args.quick, "extra args are passed on"
        json.dump([{"name": "deltanet_scan", "fraction_of_floor": 0.5, "time_us": 40},
                   {"name": "no_floor", "time_us": 3}], open(args.out, "w"))""",
    )
    broken = script(tmp_path / "bad.py", "raise SystemExit('no GPU here')")
    missing = str(tmp_path / "nope.py")
    out = tmp_path / "merged.json"
    rc = kernels.main(["--scripts", ",".join([linear, mixer, broken, missing]),
                       "--out", str(out), "--", "--quick"])  # fmt: skip
    assert rc == 0
    merged = json.loads(out.read_text())
    names = [r["kernel"] for r in merged["kernels"]]
    assert names == ["moe_gemm", "deltanet_scan", "gemv_4bit", "no_floor"]  # 0.2, 0.5, 0.9, ?
    moe = merged["kernels"][0]
    assert moe["time_us"] == 500.0 and moe["fraction_of_floor"] == 0.2
    assert moe["shape"] == "[512, 2048]"
    assert [p.split(":")[0] for p in merged["problems"]] == [broken, missing]
    assert "exit code 1: no GPU here" in merged["problems"][0]
    assert merged["problems"][1].endswith("not found (skipped)")
    table = capsys.readouterr().out.splitlines()
    assert table[2].startswith("| moe_gemm | [512, 2048] | 500.0 | 100.0 | 20.0 |")


def test_nothing_to_merge_is_a_failure_but_not_a_crash(tmp_path, capsys):
    assert kernels.main(["--scripts", str(tmp_path / "a.py")]) == 1
    assert "not found (skipped)" in capsys.readouterr().out


def test_bad_json_is_named(tmp_path):
    recs, problem = kernels.run_script(script(tmp_path / "s.py", "open(args.out, 'w').write('{')"),
                                       [], 60)  # fmt: skip
    assert recs == [] and "unreadable output" in problem
