"""Split generated text into reasoning (inside ``<think>...</think>``) and content.

Qwen3.5/3.6 templates open ``<think>`` in the prompt when thinking is on, so the output
usually holds only the closing ``</think>``: everything before it is reasoning. With
thinking off the template writes an empty think block and everything is content. An
unclosed reasoning (cut by max_tokens) stays all reasoning.
"""

from __future__ import annotations

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def prompt_opens_thinking(prompt: str) -> bool:
    """True when the rendered prompt ends inside an open ``<think>`` block."""
    i = prompt.rfind(THINK_OPEN)
    return i >= 0 and THINK_CLOSE not in prompt[i:]


def _held(buf: str, tag: str) -> int:
    for n in range(min(len(tag) - 1, len(buf)), 0, -1):
        if buf.endswith(tag[:n]):
            return n
    return 0


class ReasoningParser:
    """Incremental splitter. ``mode``: "reasoning" (the prompt opened ``<think>``),
    "content" (thinking off: no split at all) or "detect" (reasoning only if the output
    itself starts with ``<think>``)."""

    def __init__(self, mode: str) -> None:
        if mode not in ("reasoning", "content", "detect"):
            raise ValueError(f"unknown reasoning mode {mode!r}")
        self._mode = mode
        self._buf = ""
        self._content_started = False
        self.reasoning_seen = False

    @property
    def in_reasoning(self) -> bool:
        """Whether text fed now would count as reasoning."""
        return self._mode in ("reasoning", "detect")

    def feed(self, text: str) -> tuple[str, str]:
        """Consume new text; return the (reasoning, content) that can be emitted now."""
        self._buf += text
        return self._drain(final=False)

    def finish(self) -> tuple[str, str]:
        """Flush held-back text at the end of the output."""
        return self._drain(final=True)

    def _drain(self, final: bool) -> tuple[str, str]:
        reasoning = content = ""
        while True:
            buf = self._buf
            if self._mode == "detect":
                s = buf.lstrip()
                if s.startswith(THINK_OPEN):
                    self._buf, self._mode = s[len(THINK_OPEN) :], "reasoning"
                    continue
                if not final and THINK_OPEN.startswith(s):
                    return reasoning, content  # still undecided
                self._mode = "content"
                continue
            if self._mode == "reasoning":
                if not self.reasoning_seen and buf.startswith(THINK_OPEN):
                    buf = self._buf = buf[len(THINK_OPEN) :]  # a repeated opening tag
                i = buf.find(THINK_CLOSE)
                if i >= 0:
                    reasoning += buf[:i]
                    self.reasoning_seen = True
                    self._buf, self._mode = buf[i + len(THINK_CLOSE) :], "after"
                    continue
                keep = 0 if final else _held(buf, THINK_CLOSE)
                if not final and THINK_OPEN.startswith(buf) and not self.reasoning_seen:
                    keep = len(buf)  # could still be a repeated "<think>"
                reasoning += buf[: len(buf) - keep]
                if buf[: len(buf) - keep]:
                    self.reasoning_seen = True
                self._buf = buf[len(buf) - keep :]
                return reasoning, content
            # content (after the think block the template's "\n\n" is dropped)
            if self._mode == "after" and not self._content_started:
                buf = buf.lstrip("\n")
                if not buf:
                    self._buf = ""
                    return reasoning, content
                self._content_started = True
            content += buf
            self._buf = ""
            return reasoning, content
