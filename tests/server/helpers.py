"""Small helpers shared by the reliability tests: metrics, SSE parsing, waiting."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx


def metrics(client: httpx.Client) -> dict[str, float]:
    """Every unlabelled-or-model-labelled ``lily:`` sample of /metrics, by name."""
    out = {}
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("lily:") and "le=" not in line:
            name, value = line.rsplit(" ", 1)
            out[name.split("{", 1)[0][len("lily:") :]] = float(value)
    return out


def metric(client: httpx.Client, name: str) -> float:
    return metrics(client)[name]


def wait_for(pred, timeout: float = 30.0, what: str = "condition") -> float:
    """Poll ``pred`` until true; return the seconds it took."""
    t0 = time.monotonic()
    while not pred():
        assert time.monotonic() - t0 < timeout, f"{what} not reached in {timeout}s"
        time.sleep(0.02)
    return time.monotonic() - t0


def sse_events(text: str) -> list[Any]:
    """The ``data:`` payloads of an SSE body, JSON-decoded, ``[DONE]`` kept as a string."""
    out = []
    for block in text.split("\n\n"):
        for line in block.splitlines():
            if line.startswith("data: "):
                data = line[6:]
                out.append(data if data == "[DONE]" else json.loads(data))
    return out


def assert_openai_error(r: httpx.Response, status: int) -> dict[str, Any]:
    """``r`` is ``status`` with an OpenAI-shaped error body; returns the error object."""
    assert r.status_code == status, (r.status_code, r.text[:500])
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    return err


# A tool schema whose calls always end: a city from two, a small integer.
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
}


def answer_header_len(model_dir) -> int:
    """Tokens of the answer's turn header with thinking off, counted by ``tokenizers``: a
    continued conversation resumes from saved state at least at that turn's start."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    header = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    return len(tok.encode(header, add_special_tokens=False).ids)
