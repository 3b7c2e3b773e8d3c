"""The test tokenizer: a small byte-level BPE with Qwen's special tokens, and our chat template.

The real tokenizer files cannot be downloaded here; `write_test_tokenizer` writes files of
the same form (tokenizer.json, tokenizer_config.json, chat_template.jinja) that
`lily.tokenizer.Tokenizer`, transformers and mlx-lm all load.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import BPE

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
