"""Peer engines (MLX-LM, transformers) in worker processes of the same process tree.

Each peer lives in its own spawned process: its allocator, peak memory and any crash stay
its own, and a peer that runs past its time budget can be stopped. The parent sends
calls over a pipe; the worker times each point itself (``sweep.run_point``), so the pipe
never falls inside a timed interval. A peer that is not installed or fails is skipped
with one clear line, never a crash.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import multiprocessing as mp
import os
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

from lily.bench.sweep import BenchAdapter, dispatch


@dataclass(frozen=True)
class PeerSpec:
    """A peer: the Python modules it needs and the adapter class (``module:Class``)."""

    name: str
    requires: tuple[str, ...]
    adapter: str


PEERS: dict[str, PeerSpec] = {
    "transformers": PeerSpec(
        "transformers", ("transformers",), "lily.bench.peer_hf:TransformersAdapter"
    ),
    "mlx-lm": PeerSpec("mlx-lm", ("mlx.core", "mlx_lm"), "lily.bench.peer_mlx:MlxAdapter"),
    "lily": PeerSpec("lily", ("torch",), "lily.bench.source:LilyPeerAdapter"),
}


class PeerUnavailable(RuntimeError):
    """A peer that cannot run here; the message is the one line the user sees."""


def parse_peers(text: str | None) -> list[str]:
    """``"mlx-lm,transformers"`` -> names; unknown names are an error naming them."""
    names = [n.strip() for n in (text or "").split(",") if n.strip()]
    bad = [n for n in names if n not in PEERS]
    if bad:
        raise ValueError(f"unknown peer {bad[0]!r} (known: {', '.join(sorted(PEERS))})")
    return list(dict.fromkeys(names))


def check_available(name: str, load: bool = False) -> None:
    """Raise PeerUnavailable when a module the peer needs is not installed, or with
    ``load`` (a peer run in this process) when it does not import: an mlx wheel without
    its backend (mlx-cpu or mlx-cuda) is installed, and fails only on import."""
    for mod in PEERS[name].requires:
        try:
            found = importlib.util.find_spec(mod) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise PeerUnavailable(f"peer {name}: skipped (Python package {mod!r} not installed)")
        if load:
            try:
                importlib.import_module(mod)
            except Exception as e:  # noqa: BLE001 - any failure: the peer cannot run here
                raise PeerUnavailable(
                    f"peer {name}: skipped ({mod!r} does not import: {one_line(e)})"
                ) from e


def load_adapter(name: str, source: dict) -> BenchAdapter:
    mod, cls = PEERS[name].adapter.split(":")
    return getattr(importlib.import_module(mod), cls)(source)


def _worker_main(conn, name: str, source: dict) -> None:
    """Worker process: build the adapter, then answer calls until told to stop."""
    try:
        t0 = time.perf_counter()
        adapter = load_adapter(name, source)
        info = adapter.info() | {"setup_s": time.perf_counter() - t0, "pid": os.getpid()}
        conn.send(("ok", info))
    except BaseException as e:  # reported to the parent as one line
        conn.send(("error", one_line(e)))
        return
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg[0] == "stop":
            return
        try:
            conn.send(("ok", dispatch(adapter, msg[0], msg[1])))
        except BaseException as e:
            traceback.print_exc(file=sys.stderr)
            conn.send(("error", one_line(e)))


def one_line(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip().splitlines()
    return (text[0] if text else type(e).__name__)[:300]


class PeerProcess:
    """Parent-side handle of a peer worker; ``call`` mirrors ``sweep.LocalEngine``.

    The worker is a fresh ``python -m lily.bench.peers`` (not a multiprocessing spawn,
    which would re-run the parent's main script), talking over an inherited socket pair.
    """

    def __init__(self, name: str, source: dict, setup_timeout: float = 900):
        check_available(name)
        self.name = name
        self.conn, child = mp.Pipe()
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])  # so the worker imports this lily
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        try:  # the worker's prints go to our stderr, keeping stdout for the report
            out = sys.stderr.fileno()
        except (AttributeError, OSError, ValueError):
            out = None
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "lily.bench.peers", str(child.fileno()), name],
            pass_fds=[child.fileno()], stdin=subprocess.DEVNULL, stdout=out, env=env,
        )  # fmt: skip
        child.close()
        try:
            self.conn.send(source)
            self.info = self._recv(setup_timeout, "setup")
        except Exception:
            self.close()
            raise

    def _recv(self, timeout: float | None, what: str):
        if not self.conn.poll(timeout):
            raise TimeoutError(f"peer {self.name}: {what} took over {timeout:.0f} s, stopped")
        try:
            status, value = self.conn.recv()
        except (EOFError, OSError):
            code = self.proc.wait(10)
            raise RuntimeError(
                f"peer {self.name}: worker died during {what} (exit code {code})"
            ) from None
        if status != "ok":
            raise RuntimeError(f"peer {self.name}: {what} failed: {value}")
        return value

    def call(self, method: str, *args, timeout: float | None = None):
        if self.proc.poll() is not None:
            raise RuntimeError(f"peer {self.name}: worker is no longer running")
        self.conn.send((method, args))
        try:
            return self._recv(timeout, method)
        except TimeoutError:
            self.close()
            raise

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                self.conn.send(("stop", ()))
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)
        if self.proc.poll() is None:
            self.proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.conn.close()


def start_peer(name: str, source: dict, log=print) -> PeerProcess | None:
    """Start a peer worker, or print one line saying why it is skipped and return None."""
    try:
        return PeerProcess(name, source)
    except PeerUnavailable as e:
        log(str(e))
    except Exception as e:
        msg = str(e) if str(e).startswith(f"peer {name}") else f"peer {name}: {one_line(e)}"
        log(f"{msg} (skipped)")
    return None


def _worker_entry(argv: list[str]) -> int:
    """``python -m lily.bench.peers FD NAME``: the worker side of ``PeerProcess``."""
    conn = Connection(int(argv[0]))
    try:
        source = conn.recv()
    except (EOFError, OSError):
        return 1
    _worker_main(conn, argv[1], source)
    return 0


if __name__ == "__main__":
    sys.exit(_worker_entry(sys.argv[1:]))
