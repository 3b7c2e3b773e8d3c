"""A hostile chat template is stopped by its budget, fast and in little memory, with an
error naming the template; ordinary templates and conversations are untouched.

Issue 19: ``{{ "x" * N }}`` took 223 s and 18 GB at N = 1e8 and got the server
OOM-killed at 1e9. Every case here would allocate gigabytes or spin for hours unbounded.
"""

from __future__ import annotations

import resource
import shutil
import time
from pathlib import Path

import pytest

from lily.chat_template import TemplateLimits
from lily.tokenizer import ChatTemplateError, Tokenizer, TokenizerError
from lily.tokenizer_files import write_test_tokenizer

USER_HI = [{"role": "user", "content": "hi"}]
BIG = "1000000000"

HOSTILE = {
    "repeat": '{{ "x" * ' + BIG + " }}",
    "repeat-list": '{{ ["x"] * ' + BIG + " }}",
    "power": "{{ 10 ** " + BIG + " }}",
    "squaring": "{% set ns = namespace(x=3) %}{% for i in range(40) %}"
    "{% set ns.x = ns.x * ns.x %}{% endfor %}{{ ns.x }}",
    "doubling": '{% set ns = namespace(s="x") %}{% for i in range(60) %}'
    "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
    "doubling-plus": '{% set ns = namespace(s="x") %}{% for i in range(60) %}'
    "{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s }}",
    "literal-loop": "{% for i in range(100000) %}{% for j in range(100000) %}xxxxxxxxxxxxxxxx"
    "{% endfor %}{% endfor %}",
    "macro-buffer": "{% macro m() %}{% for i in range(100000) %}{% for j in range(100000) %}"
    "xxxxxxxx{% endfor %}{% endfor %}{% endmacro %}{{ m()|length }}",
    "set-block": "{% set b %}{% for i in range(100000) %}{% for j in range(1000) %}xxxxxxxx"
    "{% endfor %}{% endfor %}{% endset %}{{ b|length }}",
    "center": '{{ "x"|center(' + BIG + ") }}",
    "center-method": '{{ "x".center(' + BIG + ") }}",
    "printf-width": '{{ "%' + BIG + 'd" % 1 }}',
    "format-width": '{{ "{:>' + BIG + '}".format(1) }}',
    "replace-empty": '{% set s = "x" * 1000000 %}{{ s.replace("", s) }}',
    "replace-filter": '{% set s = "x" * 1000000 %}{{ s|replace("", s) }}',
    "join-copies": '{% set s = "x" * 10000000 %}{{ ([s] * 100000)|join }}',
    "join-method": '{% set s = "x" * 10000000 %}{{ "".join([s] * 100000) }}',
    "print-copies": '{% set s = "x" * 10000000 %}{{ [s] * 100000 }}',
    "indent": '{% set s = "\\n" * 1000000 %}{{ s|indent(100000) }}',
    "slices": '{% set s = "x" * 10000000 %}{% set ns = namespace(l=[]) %}'
    "{% for i in range(10000) %}{% set ns.l = ns.l + [s[i:]] %}{% endfor %}{{ ns.l|length }}",
    "sum-lists": "{{ ([[1] * 100000] * 100000)|sum(start=[]) }}",
    "translate": '{{ "abc".translate("".maketrans({"a": "x" * 100000})) }}',
    "batch-fill": "{{ [1]|batch(" + BIG + ', "x")|list }}',
    "tojson-indent": "{{ [[[1]]]|tojson(indent=" + BIG + ") }}",
    "chars": '{{ ("中" * 50000000)|list|length }}',
}


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tok")
    write_test_tokenizer(path, 512)
    return path


@pytest.fixture(scope="module")
def tok(tok_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tok_dir)


def _hostile(tok: Tokenizer, template: str, limits: TemplateLimits | None = None) -> Tokenizer:
    return Tokenizer(tok._tok, chat_template=template, template_origin="/ckpt/evil.jinja",
                     limits=limits)  # fmt: skip


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_template_is_stopped_fast_in_little_memory(tok: Tokenizer, name: str) -> None:
    evil = _hostile(tok, HOSTILE[name])
    before, t0 = _peak_mib(), time.monotonic()
    with pytest.raises(ChatTemplateError) as e:
        evil.apply_chat_template(USER_HI)
    assert time.monotonic() - t0 < 5.0
    # The budget (32M characters) in the worst case of 4 bytes each, plus slack.
    assert _peak_mib() - before < 400
    msg = str(e.value)
    assert msg.startswith("the chat template (/ckpt/evil.jinja) "), msg


def test_a_spinning_template_stops_at_its_deadline(tok: Tokenizer) -> None:
    spin = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    evil = _hostile(tok, spin, TemplateLimits(seconds=0.5))
    t0 = time.monotonic()
    with pytest.raises(ChatTemplateError, match=r"\(/ckpt/evil.jinja\) ran longer than 0.5 s"):
        evil.apply_chat_template(USER_HI)
    assert time.monotonic() - t0 < 3.0


def test_the_budget_grows_with_the_request(tok: Tokenizer) -> None:
    """A template that copies its input a few times is fine at any request size the
    server accepts; the same copies past the budget are not."""
    copies = "{% for m in messages %}{{ m.content }}{{ m.content|upper }}{{ m.content ~ 'x' }}" \
             "{% endfor %}"  # fmt: skip
    big = [{"role": "user", "content": "y" * 8_000_000}]
    t = _hostile(tok, copies)
    assert len(t.apply_chat_template(big)) == 24_000_001
    tight = _hostile(tok, copies, TemplateLimits(base_chars=1000, per_input_char=2))
    with pytest.raises(ChatTemplateError, match="produced more than"):
        tight.apply_chat_template(big)


def test_ordinary_template_features_still_work(tok: Tokenizer) -> None:
    t = _hostile(tok, (
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
        "{{ loop.index }}:{{ m.content|trim|upper }}{{ ' ' if not loop.last }}{% endfor %}"
        "|{{ ns.n }}|{{ messages[::-1][0].content }}|{{ 'a,b'.split(',')|join('-') }}"
        "|{{ '%s=%d' % ('k', 3) }}|{{ '{}!'.format('hi') }}|{{ {'b': 1}|tojson(indent=2) }}"
        "|{{ 2 ** 10 }}|{{ 'ab' * 3 }}|{{ ('x ' ~ 'y')|replace(' ', '_') }}"
        "|{% for k, v in {'a': 1}.items() %}{{ k }}{{ v }}{% endfor %}"
        "|{{ range(3)|list }}|{{ 'abc'[1:] }}|{{ cycler('p', 'q').next() }}"
        "|{% set j = joiner(',') %}{% for x in 'ab' %}{{ j() }}{{ x }}{% endfor %}"
        "|{% macro m(x) %}<{{ x }}{{ caller() }}>{% endmacro %}{% call m(1) %}c{% endcall %}"
    ))  # fmt: skip
    msgs = [{"role": "user", "content": " hi "}, {"role": "user", "content": "yo"}]
    assert t.apply_chat_template(msgs) == (
        '1:HI 2:YO|2|yo|a-b|k=3|hi!|{\n  "b": 1\n}|1024|ababab|x_y|a1|[0, 1, 2]|bc|p|a,b|<1c>'
    )


def test_hostile_template_is_refused_at_load_naming_the_file(tok_dir: Path, tmp_path) -> None:
    """A template past its budget on every conversation is refused when the checkpoint
    loads (`lily serve` exits with the message) rather than on every request."""
    bad = tmp_path / "ckpt"
    shutil.copytree(tok_dir, bad)
    (bad / "chat_template.jinja").write_text(HOSTILE["repeat"])
    with pytest.raises(TokenizerError, match=str(bad / "chat_template.jinja")):
        Tokenizer.from_dir(bad)
    (bad / "chat_template.jinja").write_text("{{ raise_exception('no system role') }}")
    Tokenizer.from_dir(bad)  # a template that rejects requests on purpose still loads
