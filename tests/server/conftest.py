"""Live ``lily serve`` processes on a tiny random checkpoint, shared by the server tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
KEYS = ("key-one", "key-two")
MAX_CONTEXT = 1024  # tool prompts take ~650 tokens of the tiny tokenizer
SLOW_CONTEXT = 96  # small, so "the rest of the context" is cheap to generate on CPU


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server subprocess; ``url`` once it answers."""

    def __init__(self, argv: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        # One torch thread: the tiny model gains nothing from more, and on a busy CI host
        # spinning worker threads slow every step several-fold.
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
        # No warm-up: on a GPU it compiles every kernel variant before /health says ready
        # (minutes with a dozen test workers compiling at once; these fixtures errored on the
        # H200 once it was on by default), and these tests are of the API; the warm-up has
        # its own tests (tests/runtime/test_warmup.py, tests/server/test_context_limit.py).
        self._out = open(log, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, *argv, "--port", str(self.port), "--no-warmup"],
            cwd=ROOT, env=env, stdout=self._out, stderr=subprocess.STDOUT,
        )  # fmt: skip

    def health_history(self, timeout: float = 180.0) -> list[int]:
        """Poll /health until 200; return the status codes seen."""
        seen: list[int] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.log.read_text()[-3000:]}")
            try:
                code = httpx.get(self.url + "/health", timeout=2).status_code
            except httpx.TransportError:
                time.sleep(0.05)
                continue
            seen.append(code)
            if code == 200:
                return seen
            time.sleep(0.05)
        raise TimeoutError(f"server not ready: {self.log.read_text()[-3000:]}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def rss(self) -> int:
        """Resident memory of the server process in bytes (from /proc)."""
        with open(f"/proc/{self.proc.pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS in /proc/PID/status")

    def log_text(self) -> str:
        self._out.flush()
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._out.close()


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    from lily.checkpoint import TINY_TEXT_CONFIG, write_random_checkpoint

    d = tmp_path_factory.mktemp("serve_model") / "tiny-model"
    write_random_checkpoint(d, TINY_TEXT_CONFIG, "mlx4", seed=0, progress=False)
    return d


def main_server(model_dir, log, *extra: str):
    """The main server's settings (plus ``extra`` flags), running until the generator ends."""
    argv = ["-m", "lily.cli", "serve", "--model", str(model_dir),
            "--max-context", str(MAX_CONTEXT), "--served-model-name", "tiny", "tiny-alias",
            "--cors-origins", "http://allowed.test", *extra]  # fmt: skip
    for k in KEYS:
        argv += ["--api-key", k]
    s = Server(argv, log)
    try:
        s.health_history()
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="session")
def server(model_dir, tmp_path_factory):
    """The main server: two API keys, CORS for one origin, a small context window."""
    yield from main_server(model_dir, tmp_path_factory.mktemp("logs") / "main.log")


@pytest.fixture(scope="session")
def slow_server(model_dir, tmp_path_factory):
    """Steps slowed to 0.15 s, one request at a time and a queue of one, a fault on seed
    666, a held model load."""
    log = tmp_path_factory.mktemp("logs") / "slow.log"
    argv = [str(ROOT / "tests/server/launch.py"), "--step-delay", "0.15", "--fault-seed", "666",
            "--load-delay", "2", "serve", "--model", str(model_dir), "--max-context",
            str(SLOW_CONTEXT),
            "--queue-size", "1", "--max-running", "1", "--keepalive", "0.3",
            "--default-chat-template-kwargs", '{"enable_thinking": false}']  # fmt: skip
    s = Server(argv, log)
    try:
        s.seen_while_loading = s.health_history()
        yield s
    finally:
        s.stop()


@pytest.fixture
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key=KEYS[1], max_retries=0, timeout=120)


@pytest.fixture
def http(server):
    with httpx.Client(
        base_url=server.url, headers={"Authorization": f"Bearer {KEYS[0]}"}, timeout=120
    ) as c:
        yield c


ENV_KEYS = ("env-key-1", "env-key-2")
FILE_KEY = "file-key-1"
GUARD_BODY_LIMIT = 65536
GUARD_PROMPT_LIMIT = 200
GUARD_FAULT_SEED = 666


@pytest.fixture(scope="session")
def guarded_server(model_dir, tmp_path_factory):
    """Tight limits, keys from $LILY_API_KEY and a key file, no CORS, no --log-requests;
    an engine fault on seed 666 (tests/server/launch.py)."""
    tmp = tmp_path_factory.mktemp("guarded")
    (tmp / "keys").write_text(FILE_KEY + "\n")
    argv = [str(ROOT / "tests/server/launch.py"), "--fault-seed", str(GUARD_FAULT_SEED),
            "serve", "--model", str(model_dir), "--max-context", str(MAX_CONTEXT),
            "--max-body-bytes", str(GUARD_BODY_LIMIT),
            "--max-prompt-tokens", str(GUARD_PROMPT_LIMIT),
            "--api-key-file", str(tmp / "keys")]  # fmt: skip
    s = Server(argv, tmp / "guarded.log", env={"LILY_API_KEY": ",".join(ENV_KEYS)})
    try:
        s.health_history()
        yield s
    finally:
        s.stop()


@pytest.fixture
def guarded(guarded_server):
    with httpx.Client(base_url=guarded_server.url, timeout=60,
                      headers={"Authorization": f"Bearer {ENV_KEYS[0]}"}) as c:  # fmt: skip
        yield c
