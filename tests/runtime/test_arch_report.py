"""The architecture report on the CPU: the device, the reference path and the memory plan."""

from __future__ import annotations

import platform

from lily.config import EngineConfig
from lily.runtime.arch_report import architecture_report, format_report
from lily.runtime.engine import Engine
from lily.runtime.memory_plan import weight_bytes


def test_cpu_report_names_the_reference_path_and_the_plan(hf_tiny_dir):
    ecfg = EngineConfig(prefill_chunk=32, max_context=2048, prefix_cache_gb=0.5)
    engine = Engine.load(hf_tiny_dir, ecfg, progress=False)
    rep = architecture_report(engine)
    assert rep["device"] == "cpu" and rep["arch"] == platform.machine()
    assert rep["path"].startswith("reference") and rep["fast_paths"] == {}
    mem = rep["memory_plan"]
    assert mem["weights"] == weight_bytes(engine.model.params()) > 0
    # tiny model: one attention layer, 2 KV heads x 64 dims, fp32, K and V
    assert rep["kv_bytes_per_token"] == 2 * 2 * 64 * 4
    assert mem["kv_cache"] == 2048 * 1024 and mem["prefix_cache"] == 2**29
    assert mem["graphs"] == 0  # no CUDA graphs on the reference path
    assert mem["total"] == sum(v for k, v in mem.items() if k != "total")
    text = format_report(rep)
    assert text[0].startswith("device cpu") and "reference (plain PyTorch)" in text[0]
    assert text[1] == "fast paths: none (the reference path)"
    assert text[2] == "context: 2,048 tokens (--max-context)"
    for name in ("weights", "KV cache", "DeltaNet states", "scratch", "prefix cache", "total"):
        assert any(line.startswith(f"  {name} ") for line in text), name
    assert any("KV cache" in line and "1.0 KiB a token" in line for line in text)
    assert any("512.0 MiB" in line and "prefix cache" in line for line in text)
    assert rep["kernel_tables"] is None and not any("kernel tables" in x for x in text)
    assert not any("batched steps" in x for x in text)  # one request at a time
    batched = {**rep, "max_running": 8,
               "memory_plan": {**mem, "batched_steps": 200 << 20}}  # fmt: skip
    assert any(
        line.startswith("  batched steps ")
        and "200.0 MiB" in line
        and "up to 8 requests together" in line
        for line in format_report(batched)
    )
    forced = format_report({**rep, "kernel_tables": "sm_89 (forced by --gpu-arch)"})
    assert "kernel tables: sm_89 (forced by --gpu-arch)" in forced


def test_report_warns_when_the_plan_exceeds_the_free_memory(hf_tiny_dir):
    engine = Engine.load(hf_tiny_dir, EngineConfig(max_context=4096), progress=False)
    rep = {**architecture_report(engine), "free_beyond_weights": 1 << 20}
    assert any(line.startswith("warning: the plan needs more") for line in format_report(rep))
    auto = {**rep, "context_auto": True, "free_beyond_weights": 1 << 40}
    text = format_report(auto)
    assert "the largest the free memory allows" in text[2]
    assert not any(line.startswith("warning") for line in text)
