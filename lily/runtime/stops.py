"""Stop strings over streamed text: emit what can no longer become a stop string."""

from __future__ import annotations


class StopMatcher:
    """Feed detokenized text; get back the text that is safe to emit.

    Text that could still be the start of a stop string is held back until it either
    completes one (generation stops; the stop string itself is not emitted) or cannot.
    """

    def __init__(self, stops: tuple[str, ...] | list[str]):
        self.stops = tuple(s for s in stops if s)
        self.pending = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        if self.stopped:
            return ""
        if not self.stops:
            return text
        buf = self.pending + text
        hits = [(buf.find(s), s) for s in self.stops if s in buf]
        if hits:
            pos = min(h[0] for h in hits)
            self.stopped = True
            self.pending = ""
            return buf[:pos]
        keep = 0
        for s in self.stops:  # longest suffix of buf that is a proper prefix of a stop
            for n in range(min(len(s) - 1, len(buf)), keep, -1):
                if buf.endswith(s[:n]):
                    keep = n
                    break
        self.pending = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        out, self.pending = ("" if self.stopped else self.pending), ""
        return out
