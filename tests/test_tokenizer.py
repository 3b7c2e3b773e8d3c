"""Tokenizer, chat template and incremental detokenizer.

References: the `tokenizers` library on the written files, transformers' AutoTokenizer
(which loads the files its own way and renders templates with its own Jinja setup), and
hand-written expected prompts for the Qwen3.5 chat format.
"""

import json
import shutil
import unicodedata
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import pre_tokenizers

from lily.tokenizer import (
    ChatTemplateError,
    IncrementalDetokenizer,
    Tokenizer,
    TokenizerError,
)
from lily.tokenizer_files import write_test_tokenizer

TEXTS = [
    "Hello, world! The engine reads the weights once per token.",
    "Grüße aus Köln — naïve café, straße; ¿Dónde está?",
    "敏捷的棕色狐狸跳过了懒狗。龘靐齉 (rare CJK never seen in training)",
    "こんにちは世界 안녕하세요 Привет мир مرحبا नमस्ते",
    "Emoji 😀🦜🫠 👨‍👩‍👧 👍🏽 🇯🇵 ❤️ and math ∮ ℵ₀ ≠ ∞",
    "def f(x):\n\treturn {'a': [1, 2.5e-3]}\r\n\n\n   trailing   ",
    "<|im_start|>user\nhi<|im_end|>\n<think>\nhm\n</think>\n\n<tool_call>\n<function=f>",
    "",
    " ",
    "\x00\x01\x7f control bytes \u200b zero width",
]

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Météo d'une ville",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tok")
    write_test_tokenizer(path, 512)
    (path / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [488, 7], "temperature": 0.6, "top_k": 20})
    )
    return path


@pytest.fixture(scope="module")
def tok(tok_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tok_dir)


# ---- write_test_tokenizer -------------------------------------------------------------


@pytest.mark.parametrize("vocab_size", [282, 512, 248320])
def test_written_tokenizer_ids_fit_and_bytes_complete(tmp_path: Path, vocab_size: int) -> None:
    write_test_tokenizer(tmp_path, vocab_size)
    hf = HFTokenizer.from_file(str(tmp_path / "tokenizer.json"))
    vocab = hf.get_vocab(with_added_tokens=True)
    assert max(vocab.values()) < vocab_size
    assert len(set(vocab.values())) == len(vocab)
    # every one of the 256 byte-level symbols is a token of its own
    assert set(pre_tokenizers.ByteLevel.alphabet()) <= set(vocab)
    for name in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"):
        assert name in vocab
    for name in ("<think>", "</think>", "<tool_response>", "</tool_response>"):
        assert name in vocab
    for text in TEXTS:
        ids = hf.encode(text).ids
        assert hf.decode(ids, skip_special_tokens=False) == unicodedata.normalize("NFC", text)


def test_write_test_tokenizer_rejects_tiny_vocab(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        write_test_tokenizer(tmp_path, 100)


def test_write_test_tokenizer_is_deterministic(tmp_path: Path) -> None:
    write_test_tokenizer(tmp_path / "a", 700)
    write_test_tokenizer(tmp_path / "b", 700)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


@pytest.mark.parametrize("with_model_config", [False, True], ids=["plain", "qwen3_5_moe_config"])
def test_transformers_autotokenizer_matches(
    tok_dir: Path, tok: Tokenizer, tmp_path: Path, with_model_config: bool
) -> None:
    from transformers import AutoTokenizer

    path = tok_dir
    if with_model_config:
        # with a qwen3_5_moe config.json, transformers rebuilds the pipeline itself
        path = tmp_path / "tok"
        shutil.copytree(tok_dir, path)
        (path / "config.json").write_text(json.dumps({"model_type": "qwen3_5_moe"}))
    hf = AutoTokenizer.from_pretrained(path)
    assert hf.eos_token_id == tok.im_end_id
    assert hf.pad_token_id == tok.endoftext_id
    for text in TEXTS:
        ids = tok.encode(text)
        assert hf.encode(text, add_special_tokens=False) == ids
        assert hf.decode(ids) == tok.decode(ids)
        assert hf.decode(ids, skip_special_tokens=True) == tok.decode(ids, True)


# ---- Tokenizer.from_dir ---------------------------------------------------------------


def test_special_ids_and_generation_config(tok_dir: Path, tok: Tokenizer) -> None:
    hf = HFTokenizer.from_file(str(tok_dir / "tokenizer.json"))
    assert tok.im_start_id == hf.token_to_id("<|im_start|>")
    assert tok.im_end_id == hf.token_to_id("<|im_end|>")
    assert tok.endoftext_id == hf.token_to_id("<|endoftext|>")
    assert tok.think_start_id == hf.token_to_id("<think>")
    assert tok.think_end_id == hf.token_to_id("</think>")
    assert tok.tool_call_start_id == hf.token_to_id("<tool_call>")
    assert tok.tool_call_end_id == hf.token_to_id("</tool_call>")
    assert tok.token_id("no such token") is None
    assert set(tok.eos_token_ids) == {tok.im_end_id, tok.endoftext_id, 488, 7}
    assert tok.generation_config["top_k"] == 20
    assert tok.vocab_size == hf.get_vocab_size(with_added_tokens=True)
    assert tok.im_end_id in tok.special_ids and tok.think_end_id not in tok.special_ids


def test_token_bytes_concatenate_to_utf8(tok: Tokenizer) -> None:
    for text in TEXTS:
        ids = tok.encode(text)
        assert b"".join(tok.token_bytes(i) for i in ids) == text.encode("utf-8")
    assert tok.token_bytes(10**6) == b""


def test_from_dir_errors(tmp_path: Path, tok_dir: Path) -> None:
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        Tokenizer.from_dir(tmp_path / "missing")
    bad = tmp_path / "bad"
    shutil.copytree(tok_dir, bad)
    (bad / "tokenizer.json").write_text("{ not json")
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        Tokenizer.from_dir(bad)
    shutil.copy(tok_dir / "tokenizer.json", bad / "tokenizer.json")
    (bad / "generation_config.json").write_text("[1, 2")
    with pytest.raises(TokenizerError, match="generation_config.json"):
        Tokenizer.from_dir(bad)
    (bad / "generation_config.json").unlink()
    (bad / "chat_template.jinja").write_text("{% if %}")
    with pytest.raises(ChatTemplateError, match="syntax error"):
        Tokenizer.from_dir(bad)
    (bad / "chat_template.jinja").unlink()
    config = json.loads((bad / "tokenizer_config.json").read_text())
    (bad / "tokenizer_config.json").write_text(json.dumps(config))
    no_template = Tokenizer.from_dir(bad)
    assert no_template.encode("hi") == Tokenizer.from_dir(tok_dir).encode("hi")
    with pytest.raises(ChatTemplateError, match="no chat template"):
        no_template.apply_chat_template([{"role": "user", "content": "hi"}])


def test_template_from_tokenizer_config(tmp_path: Path, tok_dir: Path) -> None:
    shutil.copytree(tok_dir, tmp_path / "t")
    (tmp_path / "t" / "chat_template.jinja").unlink()
    config_file = tmp_path / "t" / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    msgs = [{"role": "user", "content": "hi"}]
    config["chat_template"] = "S:{{ messages[0].content }}"
    config_file.write_text(json.dumps(config))
    assert Tokenizer.from_dir(tmp_path / "t").apply_chat_template(msgs) == "S:hi"
    config["chat_template"] = [
        {"name": "default", "template": "D:{{ messages[0].content }}"},
        {"name": "tool_use", "template": "T:{{ tools[0].name }}"},
    ]
    config_file.write_text(json.dumps(config))
    named = Tokenizer.from_dir(tmp_path / "t")
    assert named.apply_chat_template(msgs) == "D:hi"
    assert named.apply_chat_template(msgs, tools=[{"name": "f"}]) == "T:f"


# ---- chat template --------------------------------------------------------------------

USER_HI = [{"role": "user", "content": "Hi"}]


def test_generation_prompt_thinking_on_and_off(tok: Tokenizer) -> None:
    assert tok.apply_chat_template(USER_HI) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    )
    assert tok.apply_chat_template(USER_HI, enable_thinking=False) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert tok.apply_chat_template(USER_HI, add_generation_prompt=False) == (
        "<|im_start|>user\nHi<|im_end|>\n"
    )


def test_system_and_content_parts(tok: Tokenizer) -> None:
    msgs = [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}]},
    ]
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nAB<|im_end|>\n"
    )


def test_multi_turn_drops_earlier_reasoning(tok: Tokenizer) -> None:
    msgs = [
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "A1", "reasoning_content": "R1"},
        {"role": "user", "content": "Q2"},
        {"role": "assistant", "content": "<think>\nR2\n</think>\n\nA2"},
    ]
    expected = (
        "<|im_start|>user\nQ1<|im_end|>\n"
        "<|im_start|>assistant\nA1<|im_end|>\n"
        "<|im_start|>user\nQ2<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nR2\n</think>\n\nA2<|im_end|>\n"
    )
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == expected
    # `reasoning` (the other name in use) is the same as `reasoning_content`
    msgs[3] = {"role": "assistant", "content": "A2", "reasoning": "R2"}
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == expected


def test_tools_tool_calls_and_responses(tok: Tokenizer) -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather"}}
    msgs = [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": "Weather in Paris and Köln?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {**call, "function": {**call["function"], "arguments": '{"city": "Paris"}'}},
                {
                    **call,
                    "function": {**call["function"], "arguments": {"city": "Köln", "days": 2}},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "rain"},
    ]
    text = tok.apply_chat_template(msgs, tools=[WEATHER_TOOL])
    system, rest = text.split("<|im_end|>\n", 1)
    assert system.startswith("<|im_start|>system\nYou are helpful.\n\n# Tools\n")
    # the schema is there as JSON with non-ASCII kept, and the XML call form is explained
    assert "\n<tools>\n" + json.dumps(WEATHER_TOOL, ensure_ascii=False) + "\n</tools>" in system
    assert "<tool_call>\n<function=" in system and "<parameter=" in system
    assert rest == (
        "<|im_start|>user\nWeather in Paris and Köln?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "</function>\n</tool_call>\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nKöln\n</parameter>\n"
        "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n"
        "<tool_response>\nrain\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\n"
    )


def test_tool_call_after_content(tok: Tokenizer) -> None:
    msgs = [
        {"role": "user", "content": "Go"},
        {
            "role": "assistant",
            "content": "Checking.\n",
            "reasoning_content": "\nplan\n",
            "tool_calls": [{"function": {"name": "f", "arguments": {"o": {"k": [1, "é"]}}}}],
        },
    ]
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == (
        "<|im_start|>user\nGo<|im_end|>\n<|im_start|>assistant\n<think>\nplan\n</think>\n\n"
        'Checking.\n\n<tool_call>\n<function=f>\n<parameter=o>\n{"k": [1, "é"]}\n'
        "</parameter>\n</function>\n</tool_call><|im_end|>\n"
    )


def test_matches_transformers_rendering(tok_dir: Path, tok: Tokenizer) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tok_dir)
    conversations = [
        USER_HI,
        [
            {"role": "system", "content": "S"},
            {"role": "user", "content": "Q"},
            {"role": "assistant", "content": "A", "reasoning_content": "R"},
            {"role": "user", "content": "Q2"},
        ],
        [
            {"role": "user", "content": "Q"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "P"}}}],
            },
            {"role": "tool", "content": '{"t": 20}'},
        ],
    ]
    for msgs in conversations:
        for thinking in (True, False):
            for tools in (None, [WEATHER_TOOL]):
                ours = tok.apply_chat_template(msgs, tools=tools, enable_thinking=thinking)
                ref = hf.apply_chat_template(
                    msgs,
                    tools=tools,
                    tokenize=False,
                    add_generation_prompt=True,
                    enable_thinking=thinking,
                )
                assert ours == ref


@pytest.mark.parametrize(
    "messages, match",
    [
        ("hello", "messages must be a list"),
        ([{"content": "no role"}], r"messages\[0\]"),
        ([{"role": "wizard", "content": "x"}], "unknown message role: wizard"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "image_url"),
        ([{"role": "user", "content": 5}], "content must be"),
        (
            [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}],
            r"tool_calls\[0\].function.arguments is not valid JSON",
        ),
        (
            [
                {
                    "role": "assistant",
                    "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}],
                }
            ],
            "must be a JSON object",
        ),
        ([{"role": "assistant", "tool_calls": [{"function": {}}]}], "string name"),
    ],
    ids=["str", "no-role", "bad-role", "image", "int-content", "bad-json", "array", "no-name"],
)
def test_bad_messages(tok: Tokenizer, messages: object, match: str) -> None:
    with pytest.raises(ChatTemplateError, match=match):
        tok.apply_chat_template(messages)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ cycler.__init__.__globals__.os }}",
        "{{ joiner.__init__.__globals__ }}",
        "{{ namespace.__init__.__globals__['__builtins__'] }}",
        "{{ raise_exception.__globals__ }}",
        "{{ messages.append(1) }}{{ messages }}",
        "{{ messages[0].update({'role': 'x'}) }}",
        "{{ lipsum.__globals__['os'].system('true') }}",
        "{% for i in range(10**9) %}{% endfor %}",
    ],
)
def test_sandbox_blocks_escapes(tok: Tokenizer, template: str) -> None:
    evil = Tokenizer(tok._tok, chat_template=template)
    with pytest.raises(ChatTemplateError):
        evil.apply_chat_template(USER_HI)


def test_template_helpers(tok: Tokenizer) -> None:
    t = Tokenizer(
        tok._tok,
        chat_template="{{ {'k': 'é中'} | tojson }}|{{ strftime_now('%Y') | length }}|{{ x }}",
    )
    assert t.apply_chat_template(USER_HI, x=7) == '{"k": "é中"}|4|7'
    raising = Tokenizer(tok._tok, chat_template="{{ raise_exception('nope') }}")
    with pytest.raises(ChatTemplateError, match="nope"):
        raising.apply_chat_template(USER_HI)


# ---- incremental detokenizer ----------------------------------------------------------


def _stream(tok: Tokenizer, ids: list[int], skip: bool = False) -> list[str]:
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    return [detok.push(i) for i in ids] + [detok.flush()]


@pytest.mark.parametrize("byte_level", [True, False], ids=["bytes", "redecode"])
def test_detokenizer_splits_multibyte_chars(tok: Tokenizer, byte_level: bool) -> None:
    if not byte_level:  # exercise the path for tokenizers without a byte form
        tok = Tokenizer.from_dir(Path(tok._source))
        tok._byte_level = False
    for text in TEXTS:
        ids = tok.encode(text)
        pieces = _stream(tok, ids)
        assert "".join(pieces) == tok.decode(ids) == text
        assert all("\ufffd" not in p for p in pieces)
    # characters unseen in training are spelt in byte tokens, so some tokens end mid-char;
    # after each token the text so far is the decoded prefix without its broken tail
    ids = tok.encode("🦜龘 ok 齉")
    pieces = _stream(tok, ids)
    for k in range(1, len(ids) + 1):
        assert "".join(pieces[:k]) == tok.decode(ids[:k]).rstrip("\ufffd")
    assert pieces.count("") >= 3


def test_detokenizer_special_tokens_and_invalid_bytes(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>a<think>b</think><|im_end|>")
    assert "".join(_stream(tok, ids, skip=True)) == tok.decode(ids, True) == "a<think>b</think>"
    assert "".join(_stream(tok, ids)) == tok.decode(ids)
    # a lone continuation byte, then a truncated 3-byte character at the end
    lone = tok.encode("é")[-1:] if len(tok.encode("é")) == 2 else None
    start = tok.encode("龘")[:2]
    assert lone is not None
    ids = tok.encode("x") + lone + tok.encode("y") + start
    assert "".join(_stream(tok, ids)) == tok.decode(ids) == "x\ufffdy\ufffd"
