"""The server freezes its start-up heap once the model is ready (Settings.gc_freeze) and lets
it go at shutdown: a full collection then walks only what came after, and stops the engine
thread for that long, not for the whole loaded server (in-process app, CPU)."""

from __future__ import annotations

import gc
import time

import pytest
from fastapi.testclient import TestClient

from lily.config import EngineConfig
from lily.runtime.engine import Engine
from lily.server.app import Settings, create_app


def _ready(client: TestClient) -> None:
    deadline = time.monotonic() + 60
    while client.get("/health").status_code != 200:
        assert time.monotonic() < deadline, "the server never became ready"
        time.sleep(0.05)


@pytest.mark.parametrize("freeze", [True, False], ids=["default", "off"])
def test_the_heap_is_frozen_while_the_server_runs(model_dir, freeze):
    gc.unfreeze()  # (nothing left frozen by an earlier test in this process)
    engine = Engine.load(model_dir, EngineConfig(prefill_chunk=64), progress=False)
    settings = Settings(warmup=False) if freeze else Settings(warmup=False, gc_freeze=False)
    assert Settings().gc_freeze  # the default
    with TestClient(create_app(lambda: engine, settings)) as client:
        _ready(client)
        frozen = gc.get_freeze_count()
        in_reach = any(o is engine for o in gc.get_objects())
        r = client.post("/v1/completions", json={"prompt": "rivers", "max_tokens": 2})
        assert r.status_code == 200
    if freeze:
        # the loaded engine is out of the collector's reach while the server runs ...
        assert frozen > 1000 and not in_reach
    else:
        assert frozen == 0 and in_reach
    # ... and back in it once the server is gone
    assert gc.get_freeze_count() == 0
    assert any(o is engine for o in gc.get_objects())
