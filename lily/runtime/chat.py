"""``lily chat``: an interactive multi-turn session in the terminal."""

from __future__ import annotations

import sys
import time

HELP = "commands: /reset (new conversation), /exit (or Ctrl-D)"


def chat_loop(engine, params, enable_thinking: bool = True, inp=None, out=None) -> int:
    """Read user turns from ``inp`` line by line; stream each answer to ``out``."""
    inp = inp or sys.stdin
    out = out or sys.stdout
    messages: list[dict] = []
    think_end = "</think>"
    print(f"lily chat ({engine.model_name}); {HELP}", file=out)
    while True:
        out.write("\n> ")
        out.flush()
        line = inp.readline()
        if not line:
            out.write("\n")
            return 0
        line = line.rstrip("\n")
        if not line.strip():
            continue
        if line.strip() == "/exit":
            return 0
        if line.strip() == "/reset":
            messages = []
            print("(new conversation)", file=out)
            continue
        messages.append({"role": "user", "content": line})
        ids = engine.encode_chat(messages, enable_thinking=enable_thinking)
        text = []
        t0 = time.perf_counter()
        n = 0
        for step in engine.generate(ids, params):
            n += step.token_id is not None
            if step.text:
                out.write(step.text)
                out.flush()
                text.append(step.text)
        dt = time.perf_counter() - t0
        full = "".join(text)
        reasoning, sep, content = full.partition(think_end)
        if not sep:  # thinking off, or never closed
            reasoning, content = ("", full) if not enable_thinking else (full, "")
        msg = {"role": "assistant", "content": content.strip()}
        if reasoning.strip():
            msg["reasoning_content"] = reasoning.strip()
        messages.append(msg)
        u = engine.last_usage
        print(f"\n[{n} tokens, {n / max(dt, 1e-9):.1f} tok/s; prompt {u.prompt_tokens}, "
              f"reused {u.cached_tokens}]", file=out)  # fmt: skip
