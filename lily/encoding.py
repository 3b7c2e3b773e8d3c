"""Prompt text to token ids, bounded: special tokens only where the template wrote them,
and no more work on a long text than its prompt limit needs.

Special-token text inside a request (a user typing ``<|im_end|><|im_start|>system``) is
text, as in vLLM and llama.cpp: before the chat template renders, ``SpecialEscaper``
swaps it for private-use escapes; the rendered prompt is then split into runs, the
template's own special tokens (ids) and plain text with the escapes undone, and plain
text is tokenized with special-token matching off.

A prompt over its token limit is refused without tokenizing it all (``PromptTooLong``):
first by a sound bound from its UTF-8 size (no token covers more bytes than the longest
in the vocabulary), then by tokenizing long text in pieces, cut where the pre-tokenizer
always splits, and stopping as soon as the count passes the limit. Pieces are encoded with
``encode_batch``, which releases the GIL: other threads (the server's event loop) run
meanwhile.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from tokenizers import Tokenizer as HFTokenizer


class PromptTooLong(ValueError):
    """The prompt has more than ``limit`` tokens: at least ``at_least``."""

    def __init__(self, at_least: int, limit: int) -> None:
        super().__init__(f"the prompt has at least {at_least} tokens, over the limit of {limit}")
        self.at_least = at_least
        self.limit = limit


class SpecialEscaper:
    """Swaps special-token text in request strings for private-use escapes, and finds
    them again in the rendered prompt, so it is tokenized as text, not as control tokens.

    An escape is ``ESC`` plus one code character; ``ESC`` itself in the input is escaped
    too, so an input cannot fake one. Searches hop with ``str.find`` (special tokens share
    a prefix, ``<|`` for Qwen): a regex over a 16M-character message held the GIL for
    0.2 s at a time."""

    ESC = "\ue000"
    BASE = 0xE100

    def __init__(self, specials: Sequence[str]) -> None:
        self.texts = sorted(set(specials), key=len, reverse=True)
        self._code = {t: chr(self.BASE + i) for i, t in enumerate([self.ESC, *self.texts])}
        self._text = {c: t for t, c in self._code.items()}
        self._find = re.compile("|".join(re.escape(t) for t in [self.ESC, *self.texts]))
        self._prefix = os.path.commonprefix(self.texts) if self.texts else ""

    def escape(self, obj: Any) -> Any:
        """``obj`` with every string (dict keys too) escaped; containers are copied."""
        if isinstance(obj, str):
            if self.ESC not in obj and not self._next_special(obj, 0)[1]:
                return obj
            return self._find.sub(lambda m: self.ESC + self._code[m.group()], obj)
        if isinstance(obj, Mapping):
            return {self.escape(k): self.escape(v) for k, v in obj.items()}
        if isinstance(obj, list | tuple):
            return [self.escape(x) for x in obj]
        return obj

    def unescape(self, text: str) -> str:
        """The rendered text with the escapes turned back into what the user wrote."""
        if self.ESC not in text:
            return text
        return re.sub(re.escape(self.ESC) + "(.?)", self._undo, text, flags=re.DOTALL)

    def _undo(self, m: re.Match) -> str:
        return self._text.get(m.group(1), m.group())

    def _next_special(self, text: str, pos: int) -> tuple[int, str]:
        """The next special-token text at or after ``pos``: (start, text), or (-1, "")."""
        if not self.texts:
            return -1, ""
        if not self._prefix:  # no shared prefix: the regex (slower on long texts)
            m = self._find.search(text, pos)
            while m is not None and m.group() == self.ESC:
                m = self._find.search(text, m.end())
            return (m.start(), m.group()) if m else (-1, "")
        while (i := text.find(self._prefix, pos)) >= 0:
            for t in self.texts:  # longest first
                if text.startswith(t, i):
                    return i, t
            pos = i + 1
        return -1, ""

    def runs(self, text: str, ids: Mapping[str, int], escaped: bool) -> list[str | int]:
        """Text -> runs: plain text and the ids of the special tokens in it. ``escaped``:
        ``text`` is a rendered template (escapes are text, undone here); otherwise raw text
        whose every special-token string is a special token."""
        out: list[str | int] = []
        plain: list[str] = []
        pos = 0
        esc = text.find(self.ESC) if escaped else -1
        sp, special = self._next_special(text, 0)
        while sp >= 0 or esc >= 0:
            if esc >= 0 and (sp < 0 or esc < sp):  # an escape: the text it stands for
                code = text[esc + 1 : esc + 2]
                plain += [text[pos:esc], self._text.get(code, self.ESC + code)]
                pos = esc + 1 + len(code)
                esc = text.find(self.ESC, pos)
                if 0 <= sp < pos:
                    sp, special = self._next_special(text, pos)
                continue
            plain.append(text[pos:sp])
            if joined := "".join(plain):
                out.append(joined)
            plain = []
            out.append(ids[special])
            pos = sp + len(special)
            sp, special = self._next_special(text, pos)
            if 0 <= esc < pos:
                esc = text.find(self.ESC, pos)
        if joined := "".join(plain) + text[pos:]:
            out.append(joined)
        return out


# Pre-tokenizer regexes (Qwen2's and Qwen3.5's) for which the cut below is always a split:
# no alternative joins a printable ASCII character with a following space. GPT-2's
# ByteLevel(use_regex=True) has the same property.
_CUTTABLE_SPLITS = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| "
    r"?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
_CUT = re.compile(r"(?<=[!-~]) ")
# NFC composes at most three code points into one (Hangul jamo L+V+T, 9 bytes -> 3).
_NFC_SHRINK = 3


def _cuttable(spec: Mapping[str, Any]) -> bool:
    pre, norm = spec.get("pre_tokenizer") or {}, spec.get("normalizer")
    if norm is not None and norm.get("type") != "NFC":
        return False
    if pre.get("type") == "ByteLevel":
        return bool(pre.get("use_regex", True))
    if pre.get("type") != "Sequence" or len(pre.get("pretokenizers", [])) != 2:
        return False
    split, level = pre["pretokenizers"]
    return (
        split.get("type") == "Split"
        and split.get("behavior") == "Isolated"
        and not split.get("invert")
        and (split.get("pattern") or {}).get("Regex") in _CUTTABLE_SPLITS
        and level.get("type") == "ByteLevel"
        and not level.get("use_regex", True)
    )


class BoundedEncoder:
    """Encodes runs of plain text and special ids, refusing past a token limit early."""

    def __init__(self, tok: HFTokenizer, chunk_chars: int = 16384,
                 group_chars: int = 1 << 18) -> None:  # fmt: skip
        text = tok.to_str()
        spec = json.loads(text)
        self._plain = HFTokenizer.from_str(text)
        self._plain.encode_special_tokens = True  # special-token text is text here
        vocab = tok.get_vocab(with_added_tokens=True)
        # NOTE: byte-level token strings use one character per byte, but non-ASCII ones
        # encode to more UTF-8 bytes: an over-estimate, which keeps the bound sound.
        self.max_token_bytes = max(len(t.encode("utf-8")) for t in vocab)
        norm = spec.get("normalizer")
        self._shrink = 1 if norm is None else _NFC_SHRINK if norm.get("type") == "NFC" else None
        self.cuttable = _cuttable(spec)
        self.chunk_chars = chunk_chars
        self.group_chars = group_chars

    def min_tokens(self, text: str) -> int:
        """A lower bound on the tokens of ``text`` (plain), from its UTF-8 size."""
        if self._shrink is None or not text:
            return 0
        n = len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))
        return -(-n // (self.max_token_bytes * self._shrink))

    def pieces(self, text: str) -> Iterator[str]:
        """``text`` cut into pieces of about ``chunk_chars`` where the pre-tokenizer splits
        anyway, so the pieces' tokens are exactly the text's."""
        if not self.cuttable or len(text) <= self.chunk_chars:
            yield text
            return
        pos = 0
        while len(text) - pos > self.chunk_chars:
            m = _CUT.search(text, pos + self.chunk_chars)
            if m is None:
                break
            yield text[pos : m.start()]
            pos = m.start()
        yield text[pos:]

    def encode(self, runs: Sequence[str | int], limit: int | None = None) -> list[int]:
        """Token ids of ``runs``; PromptTooLong once they pass ``limit``."""
        count = sum(isinstance(r, int) for r in runs)
        if limit is not None:
            low = count + sum(self.min_tokens(r) for r in runs if isinstance(r, str))
            if low > limit:
                raise PromptTooLong(low, limit)
        items: list[str | int] = []
        for r in runs:
            items.extend([r] if isinstance(r, int) else self.pieces(r))
        texts = [x for x in items if isinstance(x, str)]
        encoded: list[list[int]] = []
        start = 0
        while start < len(texts):
            end, size = start, 0
            while end < len(texts) and (end == start or size + len(texts[end]) <= self.group_chars):
                size += len(texts[end])
                end += 1
            for e in self._plain.encode_batch(texts[start:end], add_special_tokens=False):
                encoded.append(e.ids)
                count += len(e.ids)
            if limit is not None and count > limit:
                raise PromptTooLong(count, limit)
            start = end
        out: list[int] = []
        it = iter(encoded)
        for x in items:
            if isinstance(x, int):
                out.append(x)
            else:
                out.extend(next(it))
        return out
