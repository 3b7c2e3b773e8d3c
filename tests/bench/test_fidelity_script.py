"""The full-size fidelity script (lily/bench/gpu/e2e/fidelity.py) as a dry run on the CPU:
the tiny random model, no kernels, and MLX-LM (CPU build) on the very bytes it writes
where mlx-lm is importable."""

from __future__ import annotations

import json

from optional_deps import mlx_missing

from lily.bench.gpu.e2e import fidelity


def test_dry_run_reports_every_column_and_the_study(tmp_path):
    out = tmp_path / "fid.json"
    argv = ["--random", "tiny", "--device", "cpu", "--context", "16", "--positions", "4",
            "--chunk", "4", "--decode-steps", "1", "--load-tokens", "0", "--mlx", "auto",
            "--mlx-context", "16", "--disk-dir", str(tmp_path / "mlx"),
            "--out", str(out)]  # fmt: skip
    assert fidelity.main(argv) == 0
    res = json.loads(out.read_text())
    (run,) = res["contexts"]
    assert run["context"] == 16 and "kernels_vs_fp32" not in run  # no kernels on the CPU
    assert 0 < run["bf16_reference_vs_fp32"]["rel_l2"] < 5e-2
    m = run["fp32_margins"]
    assert 0 <= m["min"] <= m["median"] and m["std"] > 0
    assert set(run["layer_local"]) == {"prefill", "decode"}
    # the study saw every layer's MoE output (it hooks the reference MoE by name)
    rows = res["study"]["per_layer"]
    assert len(rows) == 4 and all(r["moe_share"] > 0 for r in rows)
    if mlx_missing():  # --mlx auto: no column, and no checkpoint written
        assert "mlx_lm_vs_fp32" not in run and not (tmp_path / "mlx").exists()
        return
    # MLX-LM in bf16 on the checkpoint the script wrote, against the same fp32 logits
    assert (tmp_path / "mlx" / "config.json").exists()
    assert run["mlx_lm_vs_fp32"]["positions"] == 4 and run["mlx_lm_vs_fp32"]["rel_l2"] < 0.1
