"""Command-line flags of ``lily serve``: parsing and the errors bad values give."""

import argparse

import pytest

from lily.server.serve_cli import add_serve_args, settings_from_args


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_serve_args(p)
    return p.parse_args(list(argv))


def test_defaults_bind_loopback_without_cors():
    a = parse()
    s = settings_from_args(a, environ={})
    assert a.host == "127.0.0.1" and s.cors_origins == [] and s.api_keys == []
    assert not s.log_requests


def test_keys_from_flags_and_file(tmp_path):
    f = tmp_path / "keys"
    f.write_text("k3\n\n  k4  \n")
    a = parse("--api-key", "k1", "--api-key", "k2", "--api-key-file", str(f))
    s = settings_from_args(a, environ={})
    assert s.api_keys == ["k1", "k2", "k3", "k4"]


def test_keys_from_the_environment_add_to_the_flags():
    s = settings_from_args(parse("--api-key", "k1"), environ={"LILY_API_KEY": " e1, e2 ,,k1"})
    assert s.api_keys == ["k1", "e1", "e2"]
    assert settings_from_args(parse(), environ={"LILY_API_KEY": ""}).api_keys == []
    with pytest.raises(ValueError, match="--api-key"):
        settings_from_args(parse(), environ={"LILY_API_KEY": "has space"})


def test_limit_flags():
    flags = ["--max-body-bytes", "4096", "--max-prompt-tokens", "100",
             "--max-request-memory-mb", "1.5", "--drain-timeout", "7",
             "--thinking-budget", "64"]  # fmt: skip
    s = settings_from_args(parse(*flags))
    assert (s.max_body_bytes, s.max_prompt_tokens) == (4096, 100)
    assert s.max_request_memory == 3 << 19 and s.drain_timeout == 7
    assert s.thinking_budget == 64
    assert settings_from_args(parse("--max-running", "3")).max_running == 3
    d = settings_from_args(parse(), environ={})
    assert d.max_running == 8
    assert d.max_body_bytes == 32 << 20 and d.max_prompt_tokens is None
    assert d.max_request_memory is None and d.thinking_budget is None


@pytest.mark.parametrize(
    "argv,flag",
    [
        (["--default-chat-template-kwargs", "{bad"], "--default-chat-template-kwargs"),
        (["--default-chat-template-kwargs", "[1]"], "--default-chat-template-kwargs"),
        (["--queue-size", "-1"], "--queue-size"),
        (["--max-running", "0"], "--max-running"),
        (["--max-running", "17"], "--max-running"),  # past the rows a batched step holds
        (["--keepalive", "0"], "--keepalive"),
        (["--api-key", "has space"], "--api-key"),
        (["--max-body-bytes", "100"], "--max-body-bytes"),
        (["--max-prompt-tokens", "0"], "--max-prompt-tokens"),
        (["--max-request-memory-mb", "-1"], "--max-request-memory-mb"),
        (["--max-request-memory-mb", "inf"], "--max-request-memory-mb"),
        (["--drain-timeout", "-1"], "--drain-timeout"),
        (["--thinking-budget", "-1"], "--thinking-budget"),
    ],
)
def test_bad_flags_name_the_flag(argv, flag):
    with pytest.raises(ValueError, match=flag):
        settings_from_args(parse(*argv))


def test_a_model_that_fails_to_load_ends_the_server(tmp_path):
    import subprocess
    import sys

    from tests.server.conftest import ROOT, free_port

    (tmp_path / "config.json").write_text("{}")  # no model_type: the load fails
    r = subprocess.run(
        [sys.executable, "-m", "lily.cli", "serve", "--model", str(tmp_path),
         "--port", str(free_port())],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 1 and "model_type" in r.stderr


def test_max_running_reaches_the_engine_config():
    """``lily serve --max-running`` also sizes the engine (its memory plan and warm-up);
    the other commands, which run one request at a time, plan for one."""
    from lily.engine_args import add_engine_args, engine_config

    p = argparse.ArgumentParser()
    add_engine_args(p)
    add_serve_args(p)
    assert engine_config(p.parse_args(["--device", "cpu", "--max-running", "5"])).max_running == 5
    assert engine_config(p.parse_args(["--device", "cpu"])).max_running == 8
    alone = argparse.ArgumentParser()
    add_engine_args(alone)
    assert engine_config(alone.parse_args(["--device", "cpu"])).max_running == 1
    with pytest.raises(ValueError, match="--max-running: must be between 1 and 16"):
        engine_config(p.parse_args(["--device", "cpu", "--max-running", "17"]))
