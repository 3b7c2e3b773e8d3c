"""Tokenizer, chat template and incremental detokenizer.

`Tokenizer.from_dir` reads a checkpoint's `tokenizer.json` (byte-level BPE, through the
`tokenizers` library) and its Jinja chat template, which is rendered in a bounded sandbox
(lily/chat_template.py): the template ships with downloaded weights and must not reach
Python internals or exhaust memory. Prompts are tokenized with a limit and with request
text kept as text (lily/encoding.py).
The small test tokenizer and our chat template text live in lily/tokenizer_files.py.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from jinja2.exceptions import SecurityError
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders

from lily.chat_template import (
    ChatTemplateError,
    TemplateLimitError,
    TemplateLimits,
    compile_template,
    input_chars,
    prepare_messages,
    render,
)
from lily.encoding import BoundedEncoder, PromptTooLong, SpecialEscaper

__all__ = ["ChatTemplateError", "PromptTooLong", "Tokenizer", "TokenizerError"]


class TokenizerError(ValueError):
    """A tokenizer directory is missing a file or holds a corrupt one."""


def _byte_level_chars() -> dict[str, int]:
    """Map each character of the byte-level alphabet back to its byte (GPT-2's scheme).

    Printable Latin-1 bytes stand for themselves; the other 68 bytes are shifted to
    code points 256.. in byte order, so every token is a printable string.
    """
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in printable:
            chars[chr(256 + shifted)] = b
            shifted += 1
    return chars


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizerError(f"{path}: not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


class Tokenizer:
    """A checkpoint's tokenizer and chat template. Build with `Tokenizer.from_dir`."""

    def __init__(
        self,
        tokenizer: HFTokenizer,
        chat_template: str | None = None,
        named_templates: Mapping[str, str] | None = None,
        config: Mapping[str, Any] | None = None,
        generation_config: Mapping[str, Any] | None = None,
        source: str = "<memory>",
        template_origin: str = "the chat template",
        limits: TemplateLimits | None = None,
    ) -> None:
        self._tok = tokenizer
        self._source = source
        self.template_origin = template_origin
        self.limits = limits or TemplateLimits()
        self._config = dict(config or {})
        self.generation_config: dict[str, Any] = dict(generation_config or {})
        self.chat_template = chat_template
        self._named = dict(named_templates or {})
        self._compiled = {
            name: compile_template(text)
            for name, text in [("", chat_template), *self._named.items()]
            if text is not None
        }
        # max id + 1, not the token count: a tokenizer.json may leave gaps in its ids
        self.vocab_size: int = max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1
        added = tokenizer.get_added_tokens_decoder()
        self.special_ids = frozenset(i for i, t in added.items() if t.special)
        self._added_text = {i: t.content for i, t in added.items()}
        self.endoftext_id = self.token_id("<|endoftext|>")
        self.im_start_id = self.token_id("<|im_start|>")
        self.im_end_id = self.token_id("<|im_end|>")
        self.think_start_id = self.token_id("<think>")
        self.think_end_id = self.token_id("</think>")
        self.tool_call_start_id = self.token_id("<tool_call>")
        self.tool_call_end_id = self.token_id("</tool_call>")
        self.eos_token_ids: tuple[int, ...] = self._find_eos_ids()
        self._byte_level = isinstance(tokenizer.decoder, decoders.ByteLevel)
        self._bytes: list[bytes] | None = None
        self._special_id = {t.content: i for i, t in added.items() if t.special}
        # NOTE: splitting text at special tokens ourselves equals the library's matching
        # only for tokens that do not absorb neighbouring spaces (Qwen's do not).
        self._plain_specials = not any(
            t.lstrip or t.rstrip or t.single_word or t.normalized
            for t in added.values()
            if t.special
        )
        self._escaper = SpecialEscaper(list(self._special_id))
        self._encoder = BoundedEncoder(tokenizer)

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load `tokenizer.json`, the chat template and `generation_config.json` from `path`.

        The template comes from `chat_template.jinja`, else from `tokenizer_config.json`'s
        `chat_template` (a string, or a list of `{name, template}` where `default` is used).
        """
        root = Path(path)
        tok_file = root / "tokenizer.json"
        if not tok_file.is_file():
            raise TokenizerError(f"{root}: no tokenizer.json found")
        try:
            tok = HFTokenizer.from_file(str(tok_file))
        except Exception as e:  # the Rust side raises bare Exceptions on corrupt files
            raise TokenizerError(f"{tok_file}: cannot load tokenizer: {e}") from e
        config = _read_json(root / "tokenizer_config.json")
        template, named = None, {}
        jinja_file = root / "chat_template.jinja"
        if jinja_file.is_file():
            try:
                template = jinja_file.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise TokenizerError(f"{jinja_file}: cannot read: {e}") from e
        else:
            raw = config.get("chat_template")
            if isinstance(raw, str):
                template = raw
            elif isinstance(raw, list):
                try:
                    named = {t["name"]: t["template"] for t in raw}
                except (TypeError, KeyError) as e:
                    raise TokenizerError(
                        f"{root / 'tokenizer_config.json'}: chat_template list entries need "
                        "'name' and 'template'"
                    ) from e
                template = named.pop("default", None)
            elif raw is not None:
                raise TokenizerError(f"{root}: chat_template must be a string or a list")
        if jinja_file.is_file():
            origin = str(jinja_file)
        else:
            origin = f"the chat_template of {root / 'tokenizer_config.json'}"
        tokenizer = cls(
            tok,
            chat_template=template,
            named_templates=named,
            config=config,
            generation_config=_read_json(root / "generation_config.json"),
            source=str(root),
            template_origin=origin,
        )
        tokenizer.check_template()
        return tokenizer

    def check_template(self) -> None:
        """Render a two-message conversation once: a template that goes past its budget or
        reaches for internals on every input is refused at load (TokenizerError naming the
        file), not on each request. Other failures are left to requests."""
        sample = [{"role": "system", "content": "You are a helpful assistant."},
                  {"role": "user", "content": "Hello."}]  # fmt: skip
        if "" not in self._compiled:
            return
        limits = self.limits
        self.limits = replace(limits, seconds=min(2.0, limits.seconds))
        try:
            self.apply_chat_template(sample)
        except ChatTemplateError as e:
            if isinstance(e.__cause__, SecurityError):
                raise TokenizerError(str(e)) from e
        finally:
            self.limits = limits

    def _find_eos_ids(self) -> tuple[int, ...]:
        ids = [self.im_end_id, self.endoftext_id]
        eos = self.generation_config.get("eos_token_id")
        ids += eos if isinstance(eos, list) else [eos]
        eos_text = self._config.get("eos_token")
        if isinstance(eos_text, Mapping):
            eos_text = eos_text.get("content")
        if isinstance(eos_text, str):
            ids.append(self.token_id(eos_text))
        return tuple(dict.fromkeys(i for i in ids if isinstance(i, int)))

    def encode(self, text: str, max_tokens: int | None = None) -> list[int]:
        """Token ids of `text`; special-token text in it (e.g. `<|im_start|>`) is matched.
        PromptTooLong past ``max_tokens``, found without tokenizing all of a long text."""
        if not isinstance(text, str):
            raise TypeError(f"encode needs a str, got {type(text).__name__}")
        if not self._plain_specials:  # specials that absorb spaces: only the library knows
            return self._tok.encode(text, add_special_tokens=False).ids
        runs = self._escaper.runs(text, self._special_id, escaped=False)
        return self._encoder.encode(runs, max_tokens)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`; ids with no token (padding rows of the embedding) give nothing."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def id_count(self) -> int:
        """How many ids the tokenizer names (added tokens included); the model's vocabulary
        may be larger (padding rows)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_id(self, text: str) -> int | None:
        """The id of the single token `text`, or None."""
        return self._tok.token_to_id(text)

    def token_bytes(self, token_id: int) -> bytes | None:
        """The bytes token `token_id` stands for (b"" for unknown ids); None if the
        tokenizer is not byte-level, where tokens have no fixed byte form."""
        if not self._byte_level:
            return None
        if self._bytes is None:
            chars = _byte_level_chars()
            table = []
            for i in range(self.vocab_size):
                if i in self._added_text:
                    table.append(self._added_text[i].encode("utf-8"))
                else:
                    token = self._tok.id_to_token(i) or ""
                    table.append(bytes(chars[c] for c in token if c in chars))
            self._bytes = table
        return self._bytes[token_id] if 0 <= token_id < len(self._bytes) else b""

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        enable_thinking: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """Render `messages` (OpenAI chat format) to the prompt text.

        Assistant `reasoning` is accepted as `reasoning_content`; tool-call arguments may be
        a JSON string or an object. Raises ChatTemplateError on bad messages, on a missing
        template, and on a template that fails, reaches for Python internals or goes past
        its budget (TemplateLimits). Tokenize with `render_chat`, not `encode`: special-token
        text in the messages is text, not control tokens.
        """
        rendered = self._render(messages, tools, add_generation_prompt, enable_thinking,
                                template_kwargs)  # fmt: skip
        return self._escaper.unescape(rendered)

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        enable_thinking: bool = True,
        max_tokens: int | None = None,
        **template_kwargs: Any,
    ) -> tuple[str, list[int]]:
        """The prompt text and its token ids, as `apply_chat_template` renders it.

        Only the special tokens the template writes are control tokens; the same text in
        a message (or a tool, or a template argument) is tokenized as plain text.
        PromptTooLong when the prompt has more than ``max_tokens`` tokens, found without
        tokenizing all of a long one."""
        rendered = self._render(messages, tools, add_generation_prompt, enable_thinking,
                                template_kwargs)  # fmt: skip
        runs = self._escaper.runs(rendered, self._special_id, escaped=True)
        return self._escaper.unescape(rendered), self._encoder.encode(runs, max_tokens)

    def _render(self, messages: Any, tools: Any, add_generation_prompt: bool,
                enable_thinking: bool, template_kwargs: dict[str, Any]) -> str:  # fmt: skip
        name = "tool_use" if tools and "tool_use" in self._compiled else ""
        if name not in self._compiled:
            raise ChatTemplateError(f"{self._source}: the tokenizer has no chat template")
        if tools is not None and (not isinstance(tools, Sequence) or isinstance(tools, str)):
            raise ChatTemplateError("tools must be a list of objects")
        esc = self._escaper.escape
        request = {
            **esc(template_kwargs),
            "messages": esc(prepare_messages(messages)),
            "tools": esc(list(tools)) if tools else None,
        }
        context = {
            "eos_token": self._config.get("eos_token"),
            "pad_token": self._config.get("pad_token"),
            "bos_token": self._config.get("bos_token"),
            **request,
            "add_generation_prompt": add_generation_prompt,
            "enable_thinking": enable_thinking,
        }
        origin = self.template_origin
        try:
            return render(self._compiled[name], context, self.limits, input_chars(request))
        except ChatTemplateError:
            raise
        except TemplateLimitError as e:
            raise ChatTemplateError(f"the chat template ({origin}) {e}") from e
        except SecurityError as e:
            raise ChatTemplateError(
                f"the chat template ({origin}) tried an unsafe operation: {e}"
            ) from e
        except Exception as e:  # any template fault is the template's or the input's
            raise ChatTemplateError(
                f"the chat template ({origin}) failed: {type(e).__name__}: {e}"
            ) from e


class IncrementalDetokenizer:
    """Turns a stream of token ids into text, never emitting a partial UTF-8 character.

    Byte-level tokenizers: bytes go through an incremental UTF-8 decoder (invalid bytes
    become U+FFFD as soon as they are known invalid, as `decode` does). Other tokenizers:
    re-decode a short window and hold back text ending in U+FFFD.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._ids: list[int] = []
        self._prefix = 0  # window start: the text of ids[prefix:read] was already emitted
        self._read = 0

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly "")."""
        if self._skip and token_id in self._tok.special_ids:
            return ""
        data = self._tok.token_bytes(token_id)
        if data is not None:
            return self._utf8.decode(data)
        self._ids.append(token_id)
        done = self._tok.decode(self._ids[self._prefix : self._read])
        text = self._tok.decode(self._ids[self._prefix :])
        if len(text) > len(done) and not text.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self._ids)
            return text[len(done) :]
        return ""

    def flush(self) -> str:
        """Return what is held back (an incomplete character becomes U+FFFD)."""
        if self._ids:
            done = self._tok.decode(self._ids[self._prefix : self._read])
            text = self._tok.decode(self._ids[self._prefix :])
            self._ids, self._prefix, self._read = [], 0, 0
            return text[len(done) :]
        return self._utf8.decode(b"", final=True)
