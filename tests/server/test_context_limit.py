"""``lily serve`` without --max-context: the context the free memory allows is chosen, said at
start, and a request past it gets a 400 naming the limit; /health is 503 while the kernels
warm up by default, and with --no-warmup does not (in-process app, CPU)."""

from __future__ import annotations

import logging
import threading
import time

import torch
from fastapi.testclient import TestClient

from lily.checkpoint import TINY_TEXT_CONFIG, write_random_checkpoint
from lily.config import EngineConfig, ModelConfig
from lily.runtime import memory_plan
from lily.runtime.engine import Engine
from lily.runtime.state import KV_STEP
from lily.server.app import Settings, create_app


def test_auto_context_is_said_at_start_and_enforced(tmp_path, monkeypatch, caplog):
    write_random_checkpoint(tmp_path, dict(TINY_TEXT_CONFIG, max_position_embeddings=65536),
                            "mlx4", seed=0, progress=False)  # fmt: skip
    ecfg = EngineConfig(max_context=None, prefill_chunk=64, prefix_cache_gb=0.0)
    cfg = ModelConfig.from_dir(tmp_path)
    room = memory_plan.plan(cfg, torch.float32, weights=0, max_context=2 * KV_STEP, chunk=64,
                            kernels=False, graphs=False, prefix_cache_bytes=0)  # fmt: skip
    # the free memory holds two K/V steps beside the weights and the reserves, not three
    monkeypatch.setattr(memory_plan, "free_bytes", lambda device: room.beyond_weights + 4096)
    engine = Engine.load(tmp_path, ecfg, progress=False)
    limit = 2 * KV_STEP
    assert engine.max_context == limit
    app = create_app(lambda: engine, Settings())
    long_text = "rivers and lakes " * 4000
    assert len(engine.tokenizer.encode(long_text)) > limit
    with caplog.at_level(logging.INFO, logger="lily.server"), TestClient(app) as client:
        deadline = time.monotonic() + 60
        while client.get("/health").status_code != 200:
            assert time.monotonic() < deadline, "the server never became ready"
            time.sleep(0.05)
        r = client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": long_text}], "max_tokens": 2})  # fmt: skip
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["code"] == "context_length_exceeded" and err["param"] == "messages"
        assert f"maximum context length is {limit} tokens" in err["message"]
        ok = client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})  # fmt: skip
        assert ok.status_code == 200
        models = client.get("/v1/models").json()["data"]
        assert models[0]["max_model_len"] == limit
    assert f"context: {limit:,} tokens (the largest the free memory allows" in caplog.text
    assert "device cpu" in caplog.text and "memory plan:" in caplog.text


def test_health_waits_for_the_warm_up_and_the_flag_skips_it(tmp_path, monkeypatch):
    from lily.cli import build_parser
    from lily.runtime import warmup
    from lily.server.serve_cli import settings_from_args

    write_random_checkpoint(tmp_path, TINY_TEXT_CONFIG, "mlx4", seed=0, progress=False)
    engine = Engine.load(tmp_path, EngineConfig(max_context=256), progress=False)
    release, calls = threading.Event(), []

    def slow_warm_up(e, **kw):
        calls.append(e)
        release.wait(30)

    monkeypatch.setattr(warmup, "warm_up", slow_warm_up)
    on = settings_from_args(build_parser().parse_args(["serve"]), environ={})
    assert on.warmup is True
    with TestClient(create_app(lambda: engine, on)) as client:
        deadline = time.monotonic() + 30
        while not calls:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        r = client.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "warming up"
        busy = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
        assert busy.status_code == 503
        assert "kernels are still compiling" in busy.json()["error"]["message"]
        release.set()
        while client.get("/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.02)
    args = build_parser().parse_args(["serve", "--no-warmup"])
    assert settings_from_args(args, environ={}).warmup is False
    calls.clear()
    with TestClient(create_app(lambda: engine, settings_from_args(args, environ={}))) as client:
        deadline = time.monotonic() + 30
        while client.get("/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.02)
    assert calls == []
