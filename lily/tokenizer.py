"""Tokenizer, chat template and incremental detokenizer.

`Tokenizer.from_dir` reads a checkpoint's `tokenizer.json` (byte-level BPE, through the
`tokenizers` library) and its Jinja chat template, which is rendered in a sandbox: the
template ships with downloaded weights and must not reach Python internals.
The small test tokenizer and our chat template text live in lily/tokenizer_files.py.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders


class TokenizerError(ValueError):
    """A tokenizer directory is missing a file or holds a corrupt one."""


class ChatTemplateError(ValueError):
    """The chat template is missing, invalid, unsafe, or rejected the messages."""


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


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"chat template rejected the request: {message}")


def _tojson(
    value: Any, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # Keep non-ASCII as is: tool schemas in other languages must reach the model readable.
    return json.dumps(
        value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys
    )


class _Sandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, but an unsafe attribute raises at once instead of rendering
    as an empty string, so a template that probes internals fails visibly."""

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        raise SecurityError(
            f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe"
        )


def _compile_template(source: str) -> jinja2.Template:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template syntax error at line {e.lineno}: {e}") from e


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


def _tool_arguments(args: Any, where: str) -> dict[str, Any]:
    """OpenAI clients send arguments as a JSON string; the template needs an object."""
    if args is None or args == "":
        return {}
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError as e:
            raise ChatTemplateError(f"{where}.arguments is not valid JSON: {e}") from e
    if not isinstance(args, Mapping):
        raise ChatTemplateError(f"{where}.arguments must be a JSON object")
    return dict(args)


def _prepare_messages(messages: Any) -> list[dict[str, Any]]:
    """Validate OpenAI-style messages and put them in the shape the template reads."""
    if not isinstance(messages, Sequence) or isinstance(messages, str):
        raise ChatTemplateError("messages must be a list of objects")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise ChatTemplateError(f"messages[{i}] must be an object with a string 'role'")
        m = dict(message)
        if m["role"] == "assistant":
            if not isinstance(m.get("reasoning_content"), str) and isinstance(
                m.get("reasoning"), str
            ):
                m["reasoning_content"] = m["reasoning"]
            calls = m.get("tool_calls") or []
            if not isinstance(calls, Sequence) or isinstance(calls, str):
                raise ChatTemplateError(f"messages[{i}].tool_calls must be a list")
            prepared = []
            for j, call in enumerate(calls):
                where = f"messages[{i}].tool_calls[{j}]"
                fn = call.get("function", call) if isinstance(call, Mapping) else None
                if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
                    raise ChatTemplateError(f"{where} must have a function with a string name")
                args = _tool_arguments(fn.get("arguments"), f"{where}.function")
                prepared.append(
                    {
                        "id": call.get("id"),
                        "type": "function",
                        "function": {"name": fn["name"], "arguments": args},
                    }
                )
            m["tool_calls"] = prepared
        out.append(m)
    return out


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
    ) -> None:
        self._tok = tokenizer
        self._source = source
        self._config = dict(config or {})
        self.generation_config: dict[str, Any] = dict(generation_config or {})
        self.chat_template = chat_template
        self._named = dict(named_templates or {})
        self._compiled = {
            name: _compile_template(text)
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
        return cls(
            tok,
            chat_template=template,
            named_templates=named,
            config=config,
            generation_config=_read_json(root / "generation_config.json"),
            source=str(root),
        )

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

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special-token text in it (e.g. `<|im_start|>`) is matched."""
        if not isinstance(text, str):
            raise TypeError(f"encode needs a str, got {type(text).__name__}")
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`; ids with no token (padding rows of the embedding) give nothing."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

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
        template, and on a template that fails or reaches for Python internals.
        """
        name = "tool_use" if tools and "tool_use" in self._compiled else ""
        if name not in self._compiled:
            raise ChatTemplateError(f"{self._source}: the tokenizer has no chat template")
        if tools is not None and (not isinstance(tools, Sequence) or isinstance(tools, str)):
            raise ChatTemplateError("tools must be a list of objects")
        context = {
            "eos_token": self._config.get("eos_token"),
            "pad_token": self._config.get("pad_token"),
            "bos_token": self._config.get("bos_token"),
            **template_kwargs,
            "messages": _prepare_messages(messages),
            "tools": list(tools) if tools else None,
            "add_generation_prompt": add_generation_prompt,
            "enable_thinking": enable_thinking,
        }
        try:
            return self._compiled[name].render(**context)
        except ChatTemplateError:
            raise
        except SecurityError as e:
            raise ChatTemplateError(f"chat template tried an unsafe operation: {e}") from e
        except Exception as e:  # any template fault is the template's or the input's
            raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from e


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
