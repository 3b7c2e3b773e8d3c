"""Tokenizer, chat template and incremental detokenizer.

`Tokenizer.from_dir` reads a checkpoint's `tokenizer.json` (byte-level BPE, through the
`tokenizers` library) and its Jinja chat template, which is rendered in a sandbox: the
template ships with downloaded weights and must not reach Python internals.
`write_test_tokenizer` builds a small tokenizer with Qwen's special tokens for tests, since
the real tokenizer files cannot be downloaded here.
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
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import BPE


class TokenizerError(ValueError):
    """A tokenizer directory is missing a file or holds a corrupt one."""


class ChatTemplateError(ValueError):
    """The chat template is missing, invalid, unsafe, or rejected the messages."""


# Qwen's added tokens in their published order; `<|...|>` ones are special (skipped by
# skip_special_tokens), the XML-like ones are plain text the model reads and writes.
QWEN_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)

# The pre-tokenizer split of the Qwen3.5 tokenizer (what transformers' Qwen3_5Tokenizer
# rebuilds at load time): we use the same so every loader encodes our files identically.
_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Our own Jinja text for the Qwen3.5/3.6 chat format (see `docs` in the module docstring).
CHAT_TEMPLATE = r"""{#- lily: Qwen3.5/3.6 chat format. -#}
{%- macro text_of(content) -%}
    {%- if content is not defined or content is none -%}
    {%- elif content is string -%}
        {{- content -}}
    {%- elif content is iterable and content is not mapping -%}
        {%- for part in content -%}
            {%- if part is mapping and part.type == 'text' -%}
                {{- part.text -}}
            {%- else -%}
                {{- raise_exception('only text content parts are supported, got type '
                                    ~ (part.type if part is mapping else 'non-object')) -}}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{- raise_exception('message content must be a string or a list of text parts') -}}
    {%- endif -%}
{%- endmacro -%}
{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages -%}
    {%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{%- set has_tools = tools is defined and tools is not none and tools | length > 0 -%}
{%- set first_system = messages | length > 0 and messages[0].role == 'system' -%}
{%- if has_tools or first_system -%}
    {{- '<|im_start|>system\n' -}}
    {%- if first_system -%}
        {{- text_of(messages[0].content) -}}
        {%- if has_tools -%}{{- '\n\n' -}}{%- endif -%}
    {%- endif -%}
    {%- if has_tools -%}
        {{- '# Tools\n\nYou have access to these functions:\n\n<tools>' -}}
        {%- for tool in tools -%}{{- '\n' ~ (tool | tojson) -}}{%- endfor -%}
        {{- '\n</tools>\n\nTo call a function, reply with the call in exactly this form, '
            ~ 'and write nothing after it:\n\n<tool_call>\n<function=function_name>\n'
            ~ '<parameter=first_parameter>\nvalue\n</parameter>\n<parameter=second_parameter>\n'
            ~ 'a value may run\nover several lines\n</parameter>\n</function>\n</tool_call>\n\n'
            ~ 'Rules:\n- Each <function=...></function> block goes inside its own '
            ~ '<tool_call></tool_call> tags.\n- Give every required parameter.\n'
            ~ '- Any explanation goes before the call, never after it.\n'
            ~ '- When no function is needed, answer directly without a call.' -}}
    {%- endif -%}
    {{- '<|im_end|>\n' -}}
{%- endif -%}
{%- for m in messages -%}
    {%- set i = loop.index0 -%}
    {%- if m.role == 'system' -%}
        {%- if i > 0 -%}
            {{- '<|im_start|>system\n' ~ text_of(m.content) ~ '<|im_end|>\n' -}}
        {%- endif -%}
    {%- elif m.role == 'user' -%}
        {{- '<|im_start|>user\n' ~ text_of(m.content) ~ '<|im_end|>\n' -}}
    {%- elif m.role == 'assistant' -%}
        {%- set content = text_of(m.content) | string -%}
        {%- set reasoning = '' -%}
        {%- if m.reasoning_content is string -%}
            {%- set reasoning = m.reasoning_content -%}
        {%- elif '</think>' in content -%}
            {%- set reasoning = content.split('</think>')[0].split('<think>')[-1] -%}
            {%- set content = content.split('</think>')[-1] -%}
        {%- endif -%}
        {%- set content = content.lstrip('\n') -%}
        {%- if m.tool_calls -%}{%- set content = content.rstrip() -%}{%- endif -%}
        {{- '<|im_start|>assistant\n' -}}
        {#- Reasoning is kept only after the last user message, as the model wrote it. -#}
        {%- if i > ns.last_user -%}
            {{- '<think>\n' ~ reasoning.strip('\n') ~ '\n</think>\n\n' -}}
        {%- endif -%}
        {{- content -}}
        {%- if m.tool_calls -%}
            {%- for tc in m.tool_calls -%}
                {%- set fn = tc.function if tc.function is defined else tc -%}
                {%- if not loop.first -%}{{- '\n' -}}{%- elif content -%}{{- '\n\n' -}}{%- endif -%}
                {{- '<tool_call>\n<function=' ~ fn.name ~ '>\n' -}}
                {%- if fn.arguments is mapping -%}
                    {%- for key, value in fn.arguments | items -%}
                        {{- '<parameter=' ~ key ~ '>\n' -}}
                        {{- value if value is string else value | tojson -}}
                        {{- '\n</parameter>\n' -}}
                    {%- endfor -%}
                {%- elif fn.arguments is defined and fn.arguments is not none -%}
                    {{- raise_exception('tool call arguments must be an object') -}}
                {%- endif -%}
                {{- '</function>\n</tool_call>' -}}
            {%- endfor -%}
        {%- endif -%}
        {{- '<|im_end|>\n' -}}
    {%- elif m.role == 'tool' -%}
        {%- if i == 0 or messages[i - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
        {{- '\n<tool_response>\n' ~ text_of(m.content) ~ '\n</tool_response>' -}}
        {%- if loop.last or messages[i + 1].role != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}
    {%- else -%}
        {{- raise_exception('unknown message role: ' ~ m.role) -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
    {%- if enable_thinking is defined and not enable_thinking -%}
        {{- '<think>\n\n</think>\n\n' -}}
    {%- else -%}
        {{- '<think>\n' -}}
    {%- endif -%}
{%- endif -%}
"""

# A small multilingual text to train the test tokenizer on (several scripts, code, JSON,
# the chat and tool-call markup), so common words become single tokens.
_TRAINING_TEXT = """\
The quick brown fox jumps over the lazy dog. The engine reads the weights once per token.
def add(a: int, b: int) -> int:
    return a + b
for i in range(10):
    print(f"step {i}: loss={0.5 / (i + 1):.3f}")
{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius", "days": 3}}
<tool_call>
<function=get_weather>
<parameter=city>
Paris
</parameter>
</function>
</tool_call>
<think>
The user asks about the weather, so I should call the tool first.
</think>
Le renard brun rapide saute par-dessus le chien paresseux. Où est la gare ? Très bien, merci.
Der schnelle braune Fuchs springt über den faulen Hund. Straße, Größe, Übung, schön.
El rápido zorro marrón salta sobre el perro perezoso. ¿Dónde está la estación? Mañana.
Быстрая коричневая лиса прыгает через ленивую собаку. Привет, как дела? Спасибо.
敏捷的棕色狐狸跳过了懒狗。今天天气很好，我们去公园散步吧。模型正在生成文本。
素早い茶色の狐がのろまな犬を飛び越える。こんにちは、元気ですか？ありがとうございます。
빠른 갈색 여우가 게으른 개를 뛰어넘는다. 안녕하세요, 감사합니다. 오늘 날씨가 좋네요.
الثعلب البني السريع يقفز فوق الكلب الكسول. مرحبا، كيف حالك؟ شكرا جزيلا.
नमस्ते, आप कैसे हैं? तेज़ भूरी लोमड़ी आलसी कुत्ते के ऊपर कूदती है।
Emoji: 😀 😃 😄 🚀 🎉 👍🏽 ❤️ 🇫🇷 👨‍👩‍👧 — math: ∑ ∫ √ π ≈ 3.14159, x² + y² = z².
SELECT id, name FROM users WHERE age > 30 ORDER BY name; -- a SQL query
| column | value |\n| --- | --- |\n| tokens | 1024 |
"""


def write_test_tokenizer(out_dir: str | Path, vocab_size: int) -> None:
    """Write a small byte-level BPE tokenizer with Qwen's special tokens into `out_dir`.

    Writes `tokenizer.json`, `tokenizer_config.json` (eos `<|im_end|>`, pad `<|endoftext|>`,
    no chat template), `special_tokens_map.json` and `chat_template.jinja`. Training is
    deterministic. All 256 byte tokens are present, so any (NFC) text round-trips. The
    trained vocabulary is capped at 2048 tokens; the 26 added tokens follow it directly
    (they are NOT at their published ids 248044.., so code must look ids up by text).
    Every id is < `vocab_size`, which must be at least 256 + 26.
    """
    if vocab_size < 256 + len(QWEN_ADDED_TOKENS):
        raise ValueError(f"vocab_size must be >= {256 + len(QWEN_ADDED_TOKENS)}, got {vocab_size}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = HFTokenizer(BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    # NOTE: the same normalizer, split and decoder as the real Qwen3.5 tokenizer.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=min(vocab_size - len(QWEN_ADDED_TOKENS), 2048),
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(_TRAINING_TEXT.splitlines(keepends=True) * 4, trainer=trainer)
    for text, special in QWEN_ADDED_TOKENS:
        token = AddedToken(text, special=special, normalized=False)
        if special:
            tok.add_special_tokens([token])
        else:
            tok.add_tokens([token])
    assert tok.get_vocab_size(with_added_tokens=True) <= vocab_size
    tok.save(str(out / "tokenizer.json"))

    added = {
        str(tok.token_to_id(text)): {
            "content": text,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }
        for text, special in QWEN_ADDED_TOKENS
    }
    config = {
        "tokenizer_class": "TokenizersBackend",
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "errors": "replace",
        "model_max_length": 262144,
        "split_special_tokens": False,
    }
    special_map = {
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "additional_special_tokens": [t for t, special in QWEN_ADDED_TOKENS if special],
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    (out / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2))
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")


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
