"""What the server changes in the Python process once the model is ready, and puts back at
shutdown (Settings.gc_freeze, Settings.switch_interval): the start-up heap frozen, so a
full collection walks only what came after; the GIL's switch interval short, so the event
loop that hands out the streams' tokens is not held a whole prefill chunk by the engine
thread's launches (in-process app, CPU)."""

from __future__ import annotations

import gc
import sys
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


@pytest.mark.parametrize("tuned", [True, False], ids=["default", "off"])
def test_the_host_is_tuned_while_the_server_runs(model_dir, tuned):
    gc.unfreeze()  # (nothing left frozen by an earlier test in this process)
    before = sys.getswitchinterval()
    assert before != Settings().switch_interval
    engine = Engine.load(model_dir, EngineConfig(prefill_chunk=64), progress=False)
    settings = (Settings(warmup=False) if tuned
                else Settings(warmup=False, gc_freeze=False, switch_interval=None))  # fmt: skip
    assert Settings().gc_freeze and Settings().switch_interval == 0.0005  # the defaults
    with TestClient(create_app(lambda: engine, settings)) as client:
        _ready(client)
        frozen, interval = gc.get_freeze_count(), sys.getswitchinterval()
        in_reach = any(o is engine for o in gc.get_objects())
        r = client.post("/v1/completions", json={"prompt": "rivers", "max_tokens": 2})
        assert r.status_code == 200
    if tuned:
        # the loaded engine is out of the collector's reach while the server runs ...
        assert frozen > 1000 and not in_reach
        assert interval == pytest.approx(0.0005)
    else:
        assert frozen == 0 and in_reach and interval == before
    # ... and back in it once the server is gone, with Python's switch interval
    assert gc.get_freeze_count() == 0
    assert any(o is engine for o in gc.get_objects())
    assert sys.getswitchinterval() == before
