"""What one chat-template render may allocate: the budget and the size checks.

A render gets a budget of characters and items (``TemplateLimits``): the sandbox
(lily/chat_template.py) charges every value the template makes by its size, and checks
operators, methods and filters that would allocate much at once before they run (``"x" *
N``, ``"%9999999d"``, ``s.replace("", t)``, ``join`` of many copies of a long string, widths
of ``indent`` or ``center``). A deadline stops templates that spin. Past either,
``TemplateLimitError``, whose message is a phrase to follow the template's name.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import re
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from jinja2.exceptions import SecurityError


class TemplateLimitError(SecurityError):
    """The template went past its output, loop or time budget."""


@dataclass(frozen=True)
class TemplateLimits:
    """A render's budget: ``base_chars`` plus ``per_input_char`` per character of the
    request's strings (a template may copy its input several times), and ``seconds``."""

    base_chars: int = 32 << 20
    per_input_char: int = 8
    seconds: float = 5.0
    max_int_arg: int = 100_000  # widths, counts and sizes passed to calls and filters


class _Budget:
    def __init__(self, units: int, seconds: float, limits: TemplateLimits) -> None:
        self.left = units
        self.units = units
        self.deadline = time.monotonic() + seconds
        self.seconds = seconds
        self.limits = limits

    def check(self, n: int) -> None:
        """Raise unless ``n`` more units fit (without charging them)."""
        if n > self.left:
            self.charge(n)

    def charge(self, n: int) -> None:
        self.left -= n
        if self.left < 0:
            raise TemplateLimitError(
                f"produced more than {self.units} characters or items for one request "
                "(output, copies and loop iterations); it must render a prompt, not build "
                "large values"
            )
        if time.monotonic() > self.deadline:
            raise TemplateLimitError(f"ran longer than {self.seconds:g} s")


_BUDGET: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("_BUDGET", default=None)


def active() -> _Budget:
    """The budget of the render in progress in this thread."""
    b = _BUDGET.get()
    if b is None:  # compile-time constant folding: let Jinja evaluate it at render time
        raise RuntimeError("no render in progress")
    return b


_ITEM = 8  # a container item: a pointer, often an object of its own


def size(x: Any) -> int:
    """What a value costs: strings by characters, containers by items (at ``_ITEM``)."""
    if isinstance(x, str | bytes):
        return len(x)
    return _ITEM * len(x) if isinstance(x, list | tuple | dict) else 1


def _weight(x: Any, cap: int) -> int:
    """About the length of ``str(x)`` (nested strings at 4 characters each, for repr's
    escapes), counted only up to ``cap``: a list of many references to one long string is
    small in memory until it is printed."""
    if isinstance(x, str):
        return len(x)
    n, stack = 0, [x]
    while stack and n <= cap:
        y = stack.pop()
        if isinstance(y, str | bytes):
            n += 4 * len(y) + 2
        elif isinstance(y, Mapping):
            n += 4
            stack.extend(y.keys())
            stack.extend(y.values())
        elif isinstance(y, list | tuple | set | frozenset):
            n += 2
            stack.extend(y)
        else:
            n += 24
    return n


def _check_str(*values: Any) -> None:
    """``values`` will be turned into strings: their printed size must fit the budget."""
    b = active()
    for v in values:
        if not isinstance(v, str | int | float | bool | None):
            b.check(_weight(v, b.left))


def check_int(x: Any, what: str) -> None:
    limit = active().limits.max_int_arg
    if isinstance(x, int) and not isinstance(x, bool) and abs(x) > limit:
        raise TemplateLimitError(f"passed {x} to {what}, over the limit of {limit}")


_FORMAT_WIDTH = re.compile(r"\d{6,}|%[#0 +-]*\*|\{[^}]*\{")


def _check_format(fmt: str) -> None:
    """printf and str.format specs with huge widths (or widths from arguments) allocate
    that many characters at once."""
    if _FORMAT_WIDTH.search(fmt):
        raise TemplateLimitError("used a format width or precision over the limit")


_MAX_INT_BITS = 4096  # a prompt template has no use for larger numbers


def check_binop(op: str, a: Any, b: Any) -> None:
    seq = str | list | tuple
    if op == "*":
        if isinstance(a, int) and isinstance(b, seq):
            a, b = b, a
        if isinstance(a, seq) and isinstance(b, int):
            active().charge(size(a) * max(0, b))
        elif isinstance(a, int) and isinstance(b, int):
            _check_bits(a.bit_length() + b.bit_length())
    elif op == "**" and isinstance(a, int) and isinstance(b, int) and b > 0:
        _check_bits(max(1, a.bit_length() - 1) * min(b, 1 << 40))
    elif op == "+" and isinstance(a, seq) and isinstance(b, seq):
        active().charge(size(a) + size(b))
    elif op == "%" and isinstance(a, str):
        _check_format(a)
        _check_str(*(b.values() if isinstance(b, Mapping) else b if isinstance(b, tuple) else [b]))


def _check_bits(bits: int) -> None:
    if bits > _MAX_INT_BITS:
        raise TemplateLimitError(f"made a number of over {_MAX_INT_BITS} bits")


# str methods a template may call (with the size checks below); other methods of builtin
# types, and callables the template did not get from us, are refused.
_STR_METHODS = frozenset(
    "strip lstrip rstrip split rsplit splitlines partition rpartition startswith endswith "
    "lower upper title capitalize swapcase casefold replace find rfind index rindex count "
    "join format removeprefix removesuffix center ljust rjust zfill isdigit isalpha isalnum "
    "isspace isupper islower istitle isdecimal isnumeric isidentifier isascii".split()
)
_CONTAINER_METHODS = frozenset("items keys values get index count copy".split())


def _joinsize(sep: str, items: Sequence[Any]) -> int:
    cap = active().left
    total = len(sep) * len(items)
    for x in items:
        total += _weight(x, cap)
        if total > cap:
            break
    return total


def check_method(obj: Any, name: str, args: tuple, kwargs: dict) -> tuple:
    """Check a builtin method call before it runs; returns ``args`` (``join``'s iterable
    made a list, so its size can be known)."""
    b = active()
    for a in (*args, *kwargs.values()):
        check_int(a, f"{type(obj).__name__}.{name}()")
    if isinstance(obj, str):
        if name not in _STR_METHODS:
            raise SecurityError(f"a chat template may not call str.{name}()")
        if name == "replace" and len(args) >= 2 and isinstance(args[1], str):
            old, new = str(args[0]), args[1]
            hits = len(obj) + 1 if not old else obj.count(old)
            b.charge(len(obj) + hits * len(new))
        elif name == "join" and args:
            items = list(args[0])
            b.charge(_ITEM * len(items) + _joinsize(obj, items))
            args = (items, *args[1:])
        elif name == "format":
            _check_format(obj)
            _check_str(*args, *kwargs.values())
        return args
    if isinstance(obj, dict | list | tuple) and name in _CONTAINER_METHODS:
        return args
    raise SecurityError(f"a chat template may not call {type(obj).__name__}.{name}()")


# Filters that turn a container into text (its printed size is checked first).
_STRINGIFY = frozenset(
    "string tojson pprint join format center indent wordwrap trim upper lower title "
    "capitalize replace truncate striptags escape e forceescape safe urlize".split()
)


def bounded_filter(name: str, f: Callable) -> Callable:
    """``f`` with its numeric arguments bounded, its known amplifiers checked before it
    runs and its result charged."""
    skip = 0 if getattr(f, "jinja_pass_arg", None) is None else 1  # context or environment

    @functools.wraps(f)
    def run(*args: Any, **kwargs: Any) -> Any:
        b = active()
        values = args[skip:]
        for a in (*values[1:], *kwargs.values()):
            check_int(a, f"the {name} filter")
        value = values[0] if values else None
        if name in _STRINGIFY and not isinstance(value, str):
            _check_str(value)
        if name == "indent" and isinstance(value, str):
            width = kwargs.get("width", values[1] if len(values) > 1 else 4)
            wide = len(width) if isinstance(width, str) else int(width)
            b.charge(len(value) + wide * (value.count("\n") + 1))
        elif name == "join" and value is not None and not isinstance(value, str):
            items = list(value)
            sep = kwargs.get("d", values[1] if len(values) > 1 else "")
            b.charge(_ITEM * len(items) + _joinsize(str(sep), items))
            args = (*args[:skip], items, *values[1:])
        elif name == "replace" and isinstance(value, str) and len(values) >= 3:
            old, new = str(values[1]), str(values[2])
            b.charge(len(value) + (len(value) + 1 if not old else value.count(old)) * len(new))
        elif name == "format" and isinstance(value, str):
            _check_format(value)
            _check_str(*values[1:], *kwargs.values())
        elif name == "sum" and not isinstance(kwargs.get("start", 0), int | float):
            raise SecurityError("the sum filter adds numbers only in a chat template")
        out = f(*args, **kwargs)
        b.charge(size(out))
        return out

    return run


def guarded_loop(items: Any, body_chars: int) -> Any:
    """Each iteration of a ``for`` costs one unit plus the literal text of its body."""
    b = active()
    for x in items:
        b.charge(1 + body_chars)
        yield x


def concat(*parts: Any) -> str:
    """Jinja's ``~``, charged before the string is built."""
    _check_str(*parts)
    strs = [p if isinstance(p, str) else str(p) for p in parts]
    active().charge(sum(map(len, strs)))
    return "".join(strs)


def slice_of(obj: Any, start: Any, stop: Any, step: Any) -> Any:
    """``obj[start:stop:step]`` (Jinja slices Python objects directly), charged first."""
    if isinstance(obj, str | list | tuple):
        n = len(range(*slice(start, stop, step).indices(len(obj))))
        active().charge(n if isinstance(obj, str) else _ITEM * n)
    return obj[start:stop:step]


def finalize(value: Any) -> Any:
    b = _BUDGET.get()
    if b is not None:  # None: constant folding at compile time
        b.charge(len(value) if isinstance(value, str) else _weight(value, b.left))
    return value


def input_chars(obj: Any) -> int:
    """Characters in the strings of a request's template context (keys included)."""
    n, stack = 0, [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, str):
            n += len(x)
        elif isinstance(x, Mapping):
            stack.extend(x.keys())
            stack.extend(x.values())
        elif isinstance(x, list | tuple):
            stack.extend(x)
    return n


@contextlib.contextmanager
def budget(limits: TemplateLimits, n_input: int) -> Iterator[None]:
    """The budget of one render, for ``n_input`` characters in the request's strings."""
    units = limits.base_chars + limits.per_input_char * n_input
    token = _BUDGET.set(_Budget(units, limits.seconds, limits))
    try:
        yield
    finally:
        _BUDGET.reset(token)
