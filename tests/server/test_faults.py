"""Faults on a live server: clients vanishing at random points, engine errors, requests too
big for memory, SIGTERM while streaming, broken checkpoints at start.

The servers compute one request at a time (--max-running 1: the queue is what these tests
exercise; tests/server/test_batching.py runs requests together). The server's engine is
slowed by tests/server/launch.py: a 0.3 s "prefill" before the first
step (which, like the engine's real prefill, does not look at cancellation) and 0.03 s per
decode step, so each phase of a request is wide enough to hit.
"""

from __future__ import annotations

import json
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch

from tests.server.conftest import ROOT, Server, free_port
from tests.server.helpers import assert_openai_error, metrics, sse_events, wait_for

PREFILL = 0.3
STEP = 0.03
CONTEXT = 512
FAULT_SEED = 666
MSGS = [{"role": "user", "content": "hi"}]
LONG = {"messages": MSGS, "max_tokens": 200, "ignore_eos": True}
# From a vanished client to an idle engine: the rest of the prefill, one step, and slack
# for a busy CI host.
FREED_WITHIN = PREFILL + 10 * STEP + 1.5


def memory_limit_mb(model_dir) -> float:
    """A per-request limit between what (200 prompt + 56 generated) and (200 + 57) need:
    the K/V cache grows from 256 positions to the 512 of the context at the 257th token."""
    from lily.config import EngineConfig, ModelConfig
    from lily.server.limits import estimate

    cfg = ModelConfig.from_dir(model_dir)
    chunk = EngineConfig.prefill_chunk
    fits, over = (estimate(cfg, torch.float32, 200, n, chunk, CONTEXT, False).total
                  for n in (256, 257))  # fmt: skip
    assert fits < over
    return (fits + over) / 2 / 2**20


@pytest.fixture(scope="module")
def fault_server(model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "faults.log"
    argv = [str(ROOT / "tests/server/launch.py"), "--step-delay", str(STEP), "--prefill-delay",
            str(PREFILL), "--fault-seed", str(FAULT_SEED), "serve", "--model", str(model_dir),
            "--device", "cpu",  # the limit below is the CPU path's estimate (fp32, no kernels)
            "--max-context", str(CONTEXT), "--keepalive", "0.1", "--max-running", "1",
            "--max-request-memory-mb", f"{memory_limit_mb(model_dir):.4f}"]  # fmt: skip
    s = Server(argv, log)
    try:
        s.health_history()
        yield s
    finally:
        s.stop()


@pytest.fixture
def fs(fault_server):
    with httpx.Client(base_url=fault_server.url, timeout=60) as c:
        wait_for(lambda: _idle(c), what="idle engine")
        yield c


def _idle(c: httpx.Client) -> bool:
    m = metrics(c)
    return m["num_requests_running"] == 0 and m["num_requests_waiting"] == 0


def _raw_request(port: int, path: str, body: dict, stream: bool = False) -> bytes:
    data = json.dumps({**body, "stream": stream}).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json"
            f"\r\nContent-Length: {len(data)}\r\n\r\n").encode()  # fmt: skip
    return head + data


def _vanish(port: int, mode: str, k: int, delay: float) -> None:
    """One client that goes away: ``mode`` says when; ``k`` events, ``delay`` seconds."""
    raw = _raw_request(port, "/v1/chat/completions", LONG, stream=mode.startswith("stream"))
    with socket.create_connection(("127.0.0.1", port)) as s:
        if mode == "partial_headers":
            s.sendall(raw[: raw.index(b"\r\n") + 5])
        elif mode == "partial_body":
            s.sendall(raw[: len(raw) - 10])
        else:
            s.sendall(raw)
        time.sleep(delay)
        if mode in ("stream_headers", "stream_mid"):
            got = b""
            want = b"\r\n\r\n" if mode == "stream_headers" else b"data: "
            while got.count(want) < (1 if mode == "stream_headers" else k + 1):
                chunk = s.recv(4096)
                assert chunk, "server closed first"
                got += chunk
        # NOTE: SO_LINGER 0 sends RST, the harshest way to leave; plain close is tried too.
        if k % 2:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")


MODES = ["partial_headers", "partial_body", "sent", "stream_headers", "stream_mid"]


def test_vanishing_clients_never_leave_the_engine_busy(fault_server, fs):
    rng = random.Random(11)
    trials = [(m, rng.randrange(6), rng.uniform(0, PREFILL + 0.2)) for m in MODES * 2]
    rng.shuffle(trials)
    for mode, k, delay in trials:
        before = metrics(fs)
        _vanish(fault_server.port, mode, k, delay)
        freed = wait_for(lambda: _idle(fs), timeout=FREED_WITHIN, what=f"idle after {mode}")
        after = metrics(fs)
        reached = mode not in ("partial_headers", "partial_body")
        if reached:  # it was queued or ran, then was counted as cancelled, never as success
            want = before["request_cancelled_total"] + 1
            wait_for(lambda w=want: metrics(fs)["request_cancelled_total"] == w, timeout=5)
        else:
            assert after["request_cancelled_total"] == before["request_cancelled_total"]
        assert after["request_success_total"] == before["request_success_total"]
        generated = after["generation_tokens_total"] - before["generation_tokens_total"]
        assert generated < 60, (mode, k, delay, generated)  # far short of 200: it stopped
        t0 = time.monotonic()  # the next request starts at once
        r = fs.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 1})
        assert r.status_code == 200, r.text
        assert time.monotonic() - t0 < PREFILL + 2.0, (mode, freed)
    assert fault_server.alive() and fs.get("/health").status_code == 200


def test_client_leaving_the_queue_is_dropped_without_running(fault_server, fs):
    before = metrics(fs)
    with fs.stream("POST", "/v1/chat/completions", json={**LONG, "stream": True}) as running:
        data = (line for line in running.iter_lines() if line.startswith("data: "))
        [next(data) for _ in range(3)]  # the role chunk and two tokens: it is decoding
        with socket.create_connection(("127.0.0.1", fault_server.port)) as s:
            s.sendall(_raw_request(fault_server.port, "/v1/chat/completions", LONG))
            wait_for(lambda: metrics(fs)["num_requests_waiting"] == 1)
        wait_for(lambda: metrics(fs)["num_requests_waiting"] == 0, timeout=2.0)
        assert metrics(fs)["num_requests_running"] == 1  # the running one goes on
    wait_for(lambda: _idle(fs))
    after = metrics(fs)
    assert after["request_cancelled_total"] - before["request_cancelled_total"] == 2
    # Only the first request generated anything: ttft counted once.
    n = after["time_to_first_token_seconds_count"] - before["time_to_first_token_seconds_count"]
    assert n == 1


def test_engine_fault_fails_alone_and_the_next_request_succeeds(fs):
    before = metrics(fs)
    results = {}

    def queued() -> None:
        results["next"] = httpx.post(fs.base_url.join("/v1/chat/completions"), timeout=60,
                                     json={"messages": MSGS, "max_tokens": 3})  # fmt: skip

    body = {"messages": MSGS, "max_tokens": 20, "ignore_eos": True, "seed": FAULT_SEED}
    with fs.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        t = threading.Thread(target=queued)
        t.start()  # queued behind the request that will fault
        events = sse_events(r.read().decode())
    t.join(60)
    assert events[-1] == "[DONE]" and "injected" in events[-2]["error"]["message"]
    assert results["next"].status_code == 200
    assert results["next"].json()["choices"][0]["finish_reason"] in ("stop", "length")
    err = assert_openai_error(fs.post("/v1/chat/completions", json=body), 500)
    assert err["type"] == "server_error" and "injected" in err["message"]
    after = metrics(fs)
    assert after["request_failure_total"] - before["request_failure_total"] == 2
    assert after["request_success_total"] - before["request_success_total"] == 1
    assert fs.get("/health").status_code == 200


# ---- memory: the server's limit sits between what 256 and 257 positions need
PROMPT = list(range(10, 210))  # 200 token ids


def test_request_over_memory_is_refused_before_it_runs(fs):
    before = metrics(fs)
    r = fs.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 250})
    err = assert_openai_error(r, 400)
    assert err["code"] == "insufficient_memory" and err["param"] == "max_tokens"
    assert "MiB" in err["message"] and "KV cache" in err["message"]
    r = fs.post("/v1/completions", json={"prompt": list(range(10, 310)), "max_tokens": 1})
    assert assert_openai_error(r, 400)["param"] == "prompt"  # the prompt alone is too big
    ok = fs.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 40})
    assert ok.status_code == 200
    after = metrics(fs)
    # Refused requests never reached the engine; the one that fit ran once.
    assert after["request_success_total"] - before["request_success_total"] == 1
    assert after["prompt_tokens_total"] - before["prompt_tokens_total"] == len(PROMPT)


def test_unset_max_tokens_runs_to_what_memory_holds(fs):
    r = fs.post("/v1/completions", json={"prompt": PROMPT, "ignore_eos": True})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    # "The rest of the context" would be 312 tokens; memory holds 256 positions.
    assert usage["completion_tokens"] == 256 - len(PROMPT)
    assert r.json()["choices"][0]["finish_reason"] == "length"


# ---- SIGTERM
@pytest.fixture
def drain_server(model_dir, tmp_path):
    argv = [str(ROOT / "tests/server/launch.py"), "--step-delay", "0.05", "serve",
            "--model", str(model_dir), "--max-context", str(CONTEXT), "--max-running", "1",
            "--drain-timeout", "30"]  # fmt: skip
    s = Server(argv, tmp_path / "drain.log")
    try:
        s.health_history()
        yield s
    finally:
        if s.alive():
            s.stop()


def test_sigterm_drains_in_flight_requests_then_exits_zero(drain_server):
    s = drain_server
    body = {"messages": MSGS, "max_tokens": 40, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    queued = {}

    def second() -> None:  # accepted before SIGTERM, waiting in the queue
        queued["r"] = httpx.post(s.url + "/v1/chat/completions", timeout=60,
                                 json={"messages": MSGS, "max_tokens": 5})  # fmt: skip

    with httpx.Client(base_url=s.url, timeout=60) as c:
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]  # role chunk and a few tokens
            # A non-streaming client that queued and left: its handler must end too, or
            # the drain would wait for it until --drain-timeout.
            with socket.create_connection(("127.0.0.1", s.port)) as gone:
                gone.sendall(_raw_request(s.port, "/v1/chat/completions", LONG))
                wait_for(lambda: metrics(c)["num_requests_waiting"] == 1)
            wait_for(lambda: metrics(c)["num_requests_waiting"] == 0)
            t = threading.Thread(target=second)
            t.start()
            wait_for(lambda: metrics(c)["num_requests_waiting"] == 1)
            s.proc.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            # New connections are refused (the port is closed) or answered 503.
            try:
                late = httpx.post(s.url + "/v1/chat/completions", timeout=5,
                                  json={"messages": MSGS, "max_tokens": 1})  # fmt: skip
                assert late.status_code == 503, late.text
            except httpx.ConnectError:
                pass
            got += list(lines)
    t.join(60)
    events = sse_events("\n".join(got) + "\n\n")
    assert events[-1] == "[DONE]"
    assert events[-2]["usage"]["completion_tokens"] == 40  # the stream ran to its end
    assert [e for e in events[:-1] if e["choices"] and e["choices"][0]["finish_reason"]]
    assert queued["r"].status_code == 200  # the queued request was served too
    assert s.proc.wait(timeout=10) == 0  # well inside the 30 s drain timeout
    assert "Traceback" not in s.log_text()


def test_sigterm_past_a_short_drain_timeout_ends_requests_cleanly(model_dir, tmp_path):
    """Issue 19: with --drain-timeout 3, a 3000-token stream was cut mid-chunk (no finish,
    error event or [DONE]), the queued request got uvicorn's plain-text 500, and the
    process died of SIGABRT ("terminate called without an active exception")."""
    argv = [str(ROOT / "tests/server/launch.py"), "--step-delay", "0.02", "serve",
            "--model", str(model_dir), "--max-context", "4096", "--drain-timeout", "3",
            "--max-running", "1"]  # fmt: skip
    s = Server(argv, tmp_path / "short-drain.log")
    long = {"messages": MSGS, "max_tokens": 3000, "ignore_eos": True}
    out: dict = {}

    def queued(name: str, stream: bool) -> None:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            r = c.post("/v1/chat/completions", json={**long, "stream": stream})
            out[name] = (r.status_code, r.headers.get("content-type", ""), r.text)

    try:
        s.health_history()
        with httpx.Client(base_url=s.url, timeout=60) as c:
            with c.stream("POST", "/v1/chat/completions", json={**long, "stream": True}) as r:
                lines = r.iter_lines()
                got = [next(lines) for _ in range(8)]
                waiters = [threading.Thread(target=queued, args=(n, n == "stream"))
                           for n in ("full", "stream")]  # fmt: skip
                for t in waiters:
                    t.start()
                wait_for(lambda: metrics(c)["num_requests_waiting"] == 2)
                t0 = time.monotonic()
                s.proc.send_signal(signal.SIGTERM)
                got += list(lines)
        for t in waiters:
            t.join(60)
        code = s.proc.wait(timeout=30)
        took = time.monotonic() - t0
    finally:
        if s.alive():
            s.stop()
    events = sse_events("\n".join(got) + "\n\n")  # every line is whole JSON
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == "cancelled", events[-2]
    deltas = [e["choices"][0]["delta"] for e in events[1:-2]]
    assert sum(bool(d.get("content") or d.get("reasoning_content")) for d in deltas) > 10
    status, ctype, text = out["full"]
    assert status == 503 and ctype.startswith("application/json"), (status, text)
    err = json.loads(text)["error"]
    assert err["code"] == "cancelled" and "shutting down" in err["message"]
    status, _, text = out["stream"]
    queued_events = sse_events(text)
    assert queued_events[-1] == "[DONE]" and queued_events[-2]["error"]["code"] == "cancelled"
    assert code == 0, s.log_text()[-3000:]
    assert 3 <= took < 15, took
    log = s.log_text()
    assert "terminate called" not in log and "Traceback" not in log, log[-3000:]


# ---- broken checkpoints are refused at start, naming the file and the tensor
def _serve_exits(model: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lily.cli", "serve", "--model", model, "--port", str(free_port())],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_truncated_checkpoint_is_refused_at_start(model_dir, tmp_path):
    bad = tmp_path / "truncated"
    shutil.copytree(model_dir, bad)
    f = bad / "model.safetensors"
    header_len = int.from_bytes(f.read_bytes()[:8], "little")
    header = json.loads(f.read_bytes()[8 : 8 + header_len])
    last = max((k for k in header if k != "__metadata__"),
               key=lambda k: header[k]["data_offsets"][1])  # fmt: skip
    with open(f, "r+b") as fh:
        fh.truncate(f.stat().st_size - 64)  # the last tensor's data loses its tail
    r = _serve_exits(str(bad))
    assert r.returncode != 0
    assert str(f) in r.stderr and "truncated" in r.stderr and "Traceback" not in r.stderr
    assert f"tensor {last!r}" in r.stderr


def test_wrong_shape_checkpoint_is_refused_at_start(model_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "wrong-shape"
    shutil.copytree(model_dir, bad)
    f = bad / "model.safetensors"
    tensors = load_file(f)
    key = next(k for k in sorted(tensors) if k.endswith("input_layernorm.weight"))
    tensors[key] = torch.ones(tensors[key].shape[0] + 3)
    save_file(tensors, f, metadata={"format": "pt"})
    r = _serve_exits(str(bad))
    assert r.returncode != 0
    assert key in r.stderr and str(f) in r.stderr and "Traceback" not in r.stderr
