"""Security on live servers: loopback bind, API keys, the sandboxed chat template, no file
access from requests, CORS, and prompts kept out of the logs."""

from __future__ import annotations

import ctypes
import os
import shutil

import httpx
import pytest

from lily.server import guard
from tests.server.conftest import ENV_KEYS, FILE_KEY, GUARD_FAULT_SEED, KEYS, ROOT, Server
from tests.server.helpers import assert_openai_error

MSGS = [{"role": "user", "content": "hi"}]
CHAT = "/v1/chat/completions"
MARKER = "zebra-7f3a-secret-prompt"  # a string no log line has any other reason to hold


# ---- bind address
def _listening(port: int) -> list[str]:
    """Local addresses (hex, as in /proc/net/tcp*) of sockets listening on ``port``."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table, encoding="ascii") as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                addr, hexport = local.rsplit(":", 1)
                if int(hexport, 16) == port and state == "0A":  # TCP_LISTEN
                    found.append(addr)
    return found


def test_binds_to_loopback_only_by_default(server):
    assert _listening(server.port) == ["0100007F"]  # 127.0.0.1, no IPv6, no 0.0.0.0


# ---- API keys
def test_every_configured_key_works_on_every_v1_route(guarded_server):
    url = guarded_server.url
    for key in (*ENV_KEYS, FILE_KEY):  # $LILY_API_KEY (comma-separated) and --api-key-file
        h = {"Authorization": f"Bearer {key}"}
        assert httpx.get(url + "/v1/models", headers=h).status_code == 200
        r = httpx.post(url + CHAT, headers=h, json={"messages": MSGS, "max_tokens": 1})
        assert r.status_code == 200, r.text
    lower = {"Authorization": f"bearer {ENV_KEYS[1]}"}  # the scheme is case-insensitive
    assert httpx.get(url + "/v1/models", headers=lower).status_code == 200


@pytest.mark.parametrize(
    "auth",
    [None, "Bearer", "Bearer  x", "Bearer wrong", f"Basic {ENV_KEYS[0]}", ENV_KEYS[0],
     f"Bearer {ENV_KEYS[0]}x", f"Bearer {ENV_KEYS[0][:-1]}", f"Bearer {ENV_KEYS[0].upper()}",
     f"Bearer {KEYS[0]}"],
)  # fmt: skip
def test_wrong_or_missing_key_is_401_everywhere_under_v1(guarded_server, auth):
    url = guarded_server.url
    h = {"Authorization": auth} if auth is not None else {}
    for method, path in [("GET", "/v1/models"), ("POST", CHAT), ("POST", "/v1/completions"),
                         ("GET", "/v1/no-such-route"), ("POST", "/v1/anything")]:  # fmt: skip
        r = httpx.request(method, url + path, headers=h, json={"messages": MSGS})
        err = assert_openai_error(r, 401)
        assert err["code"] == "invalid_api_key" and r.headers["www-authenticate"] == "Bearer"
    assert httpx.get(url + "/health").status_code == 200  # open: probes carry no key
    assert httpx.get(url + "/metrics").status_code == 200


def test_key_check_takes_the_same_path_whichever_key_matches(monkeypatch):
    # Timing cannot be measured reliably in CI; the property that makes it constant can:
    # one fixed-length digest comparison per configured key, whatever the outcome.
    calls = []
    real = guard.hmac.compare_digest

    def counting(a, b):
        calls.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(guard.hmac, "compare_digest", counting)
    g = guard.Gate(None, ["k1", "a-much-longer-key-2", "k3"], 1 << 20)
    for header, ok in [(b"Bearer k1", True), (b"Bearer k3", True), (b"Bearer nope", False),
                       (b"Bearer " + b"x" * 5000, False), (b"", False)]:  # fmt: skip
        calls.clear()
        assert g.authorized(header) is ok
        assert calls == [(32, 32)] * 3


# ---- a malicious chat template shipped with a checkpoint
def _evil_template(canary: str) -> str:
    probes = {
        "mro": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "globals": "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
        "format": "{{ '{0.__class__.__init__.__globals__}'.format(c) }}",
        "mutate": "{{ messages.append(1) }}",
        "include": "{% include '" + canary + "' %}",
        "import": "{% import '" + canary + "' as m %}{{ m }}",
        "extends": "{% extends '" + canary + "' %}",
        "bomb": '{{ "x" * 1000000000 }}',  # issue 19: 18 GB at 1e8, OOM-killed at 1e9
    }
    branches = "".join(
        ("{%- if" if i == 0 else "{%- elif") + f" c == '{name}' -%}}{body}"
        for i, (name, body) in enumerate(probes.items())
    )
    normal = "<|im_start|>user\n{{ c }}<|im_end|>\n<|im_start|>assistant\n"
    return (
        "{%- set c = messages[0].content -%}"
        + branches
        + "{%- else -%}"
        + normal
        + ("{%- endif -%}")
    )


PROBES = ["mro", "globals", "format", "mutate", "include", "import", "bomb"]


@pytest.fixture(scope="module")
def canary(tmp_path_factory):
    d = tmp_path_factory.mktemp("canary")
    (d / "secret.txt").write_text("CANARY-CONTENT {{ 6*7 }}")
    return d


@pytest.fixture(scope="module")
def evil_server(model_dir, canary, tmp_path_factory):
    """A checkpoint whose chat_template.jinja probes for internals and files; prompts are
    logged (--log-requests) so the log test has a positive control."""
    tmp = tmp_path_factory.mktemp("evil")
    model = tmp / "evil-model"
    shutil.copytree(model_dir, model)
    (model / "chat_template.jinja").write_text(_evil_template(str(canary / "secret.txt")))
    argv = ["-m", "lily.cli", "serve", "--model", str(model), "--max-context", "512",
            "--log-requests"]  # fmt: skip
    s = Server(argv, tmp / "evil.log")
    try:
        s.health_history()
        yield s
    finally:
        s.stop()


class FileWatch:
    """inotify on a directory: any open, read, write or creation in it (by any process,
    any language: the engine's Rust and C libraries included) is an event."""

    MASK = 0x1 | 0x2 | 0x4 | 0x8 | 0x10 | 0x20 | 0x40 | 0x80 | 0x100 | 0x200

    def __init__(self, path) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self.fd = libc.inotify_init1(os.O_NONBLOCK)
        assert self.fd >= 0, os.strerror(ctypes.get_errno())
        assert libc.inotify_add_watch(self.fd, str(path).encode(), self.MASK) >= 0

    def events(self) -> bytes:
        try:
            return os.read(self.fd, 1 << 16)
        except BlockingIOError:
            return b""

    def close(self) -> None:
        os.close(self.fd)


def test_template_reaching_for_internals_or_files_fails_alone(evil_server, canary):
    url = evil_server.url
    watch = FileWatch(canary)
    try:
        for probe in PROBES:
            r = httpx.post(url + CHAT, json={"messages": [{"role": "user", "content": probe}],
                                             "max_tokens": 1}, timeout=60)  # fmt: skip
            # The template, not the request, is at fault: a 500 the operator sees in the
            # log and metrics; the sandbox stopped it before it reached anything.
            err = assert_openai_error(r, 500)
            assert err["code"] == "chat_template_error" and err["type"] == "server_error"
            assert "CANARY" not in r.text and "uid=" not in r.text
            assert "chat_template.jinja" in err["message"]  # names the template
            # The server keeps serving, chat included.
            ok = httpx.post(url + CHAT, json={"messages": MSGS, "max_tokens": 1}, timeout=60)
            assert ok.status_code == 200, ok.text
        assert watch.events() == b""  # the template never touched the file
        (canary / "secret.txt").read_text()
        assert watch.events() != b""  # positive control: the watch does see a read
    finally:
        watch.close()
    assert evil_server.alive() and httpx.get(url + "/health").status_code == 200


def test_no_request_field_is_used_as_a_path(server, canary):
    path = str(canary / "secret.txt")
    url = "file://" + path
    h = {"Authorization": f"Bearer {KEYS[0]}", "X-Request-Id": "x" + path.replace("/", "-")}
    schema = {"$ref": url, "$schema": url, "$id": url, "type": "object"}
    bodies = [
        {"model": path, "messages": MSGS},
        {"messages": [{"role": "user", "content": path, "name": path}], "max_tokens": 1,
         "stop": [path], "user": path, "chat_template": path, "chat_template_kwargs": {
             "chat_template": path, "template": path, "tokenizer": path, "add_vision_id": path}},
        {"messages": [{"role": "user", "content": [{"type": "image_url",
                                                    "image_url": {"url": url}}]}]},
        {"messages": MSGS, "max_tokens": 1, "response_format": {
            "type": "json_schema", "json_schema": {"name": path, "schema": schema}}},
        {"messages": MSGS, "max_tokens": 1, "tool_choice": "required", "tools": [
            {"type": "function", "function": {"name": "f", "description": path,
                                              "parameters": schema}}]},
        {"messages": [{"role": "tool", "content": path, "tool_call_id": path}], "max_tokens": 1},
    ]  # fmt: skip
    watch = FileWatch(canary)
    try:
        for body in bodies:
            r = httpx.post(server.url + CHAT, json=body, headers=h, timeout=60)
            assert r.status_code < 500 and "CANARY" not in r.text, r.text[:300]
        for prompt in (path, url):
            r = httpx.post(server.url + "/v1/completions", headers=h, timeout=60,
                           json={"prompt": prompt, "max_tokens": 1, "suffix": path})  # fmt: skip
            assert r.status_code < 500 and "CANARY" not in r.text
        assert watch.events() == b""
    finally:
        watch.close()
    assert sorted(os.listdir(canary)) == ["secret.txt"]  # nothing written next to it


# ---- CORS
PREFLIGHT = {"Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}  # fmt: skip


def test_cors_preflight_with_origins(server):
    ok = httpx.options(server.url + CHAT, headers={**PREFLIGHT, "Origin": "http://allowed.test"})
    assert ok.status_code == 200  # a preflight carries no key and needs none
    assert ok.headers["access-control-allow-origin"] == "http://allowed.test"
    assert "POST" in ok.headers["access-control-allow-methods"]
    assert "authorization" in ok.headers["access-control-allow-headers"].lower()
    bad = httpx.options(server.url + CHAT, headers={**PREFLIGHT, "Origin": "http://evil.test"})
    assert bad.status_code >= 400 and "access-control-allow-origin" not in bad.headers
    # The real request from the allowed origin still needs its key.
    r = httpx.post(server.url + CHAT, json={"messages": MSGS},
                   headers={"Origin": "http://allowed.test"})  # fmt: skip
    assert_openai_error(r, 401)
    assert r.headers["access-control-allow-origin"] == "http://allowed.test"


def test_cors_off_without_origins(guarded_server):
    r = httpx.options(guarded_server.url + CHAT,
                      headers={**PREFLIGHT, "Origin": "http://allowed.test"})  # fmt: skip
    assert not any(k.startswith("access-control-") for k in r.headers)
    assert_openai_error(r, 405)
    r = httpx.get(guarded_server.url + "/health", headers={"Origin": "http://allowed.test"})
    assert not any(k.startswith("access-control-") for k in r.headers)


# ---- logs
def test_logs_hold_no_prompt_unless_asked(guarded_server, evil_server):
    h = {"Authorization": f"Bearer {ENV_KEYS[0]}"}
    url = guarded_server.url
    bodies = [
        (CHAT, {"messages": [{"role": "system", "content": MARKER},
                             {"role": "user", "content": MARKER}], "max_tokens": 2}),
        (CHAT, {"messages": [{"role": "user", "content": MARKER}], "max_tokens": 2,
                "stream": True, "stop": [MARKER]}),
        (CHAT, {"messages": [{"role": "user", "content": MARKER}], "max_tokens": 4,
                "seed": GUARD_FAULT_SEED, "ignore_eos": True}),  # an engine fault
        (CHAT, {"messages": [{"role": "user", "content": MARKER}], "tool_choice": "auto"}),
        (CHAT, {"messages": [{"role": MARKER, "content": MARKER}]}),
        (CHAT, {"messages": [{"role": "user", "content": [{"type": MARKER}]}]}),
        ("/v1/completions", {"prompt": MARKER, "max_tokens": 2}),
        ("/v1/completions", {"prompt": MARKER * 200}),  # over --max-prompt-tokens
        (CHAT, {"messages": MSGS, "tools": [{"type": "function", "function": {
            "name": "f", "description": MARKER}}]}),  # tool prompt over the limit
    ]  # fmt: skip
    codes = []
    for path, body in bodies:
        codes.append(httpx.post(url + path, json=body, headers=h, timeout=60).status_code)
    assert codes == [200, 200, 500, 400, 400, 400, 200, 400, 400]
    log = guarded_server.log_text()
    assert "engine error" in log  # the fault was logged ...
    assert MARKER not in log  # ... and no prompt was
    # Positive control: with --log-requests the same marker does reach the log.
    r = httpx.post(evil_server.url + "/v1/completions", timeout=60,
                   json={"prompt": MARKER, "max_tokens": 1})  # fmt: skip
    assert r.status_code == 200
    assert MARKER in evil_server.log_text()


def test_server_refuses_to_start_on_bad_serve_flags(model_dir, tmp_path):
    import subprocess
    import sys

    from tests.server.conftest import free_port

    for flags, name in [(["--max-body-bytes", "10"], "--max-body-bytes"),
                        (["--max-request-memory-mb", "nan"], "--max-request-memory-mb"),
                        (["--max-prompt-tokens", "0"], "--max-prompt-tokens")]:  # fmt: skip
        r = subprocess.run(
            [sys.executable, "-m", "lily.cli", "serve", "--model", str(model_dir),
             "--port", str(free_port()), *flags],
            cwd=ROOT, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert r.returncode != 0 and name in r.stderr and "Traceback" not in r.stderr
