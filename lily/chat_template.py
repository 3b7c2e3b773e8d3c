"""The chat template: a checkpoint's Jinja, rendered in a bounded sandbox.

The template ships with downloaded weights, so it is untrusted code: it renders in Jinja's
immutable sandbox (no Python internals, no mutation, no file loading) and, on top of it,
within a budget (lily/template_budget.py). Every value the template makes is charged by
its size: the results of operators, calls (only listed methods of builtin types) and
filters, slices, every ``{{ }}`` output, and each loop iteration with the literal text of
its body; the parsed template is rewritten so that loops, ``~`` and slices go through the
budget. A template past its budget fails with ``TemplateLimitError`` (a SecurityError, so
the server answers 500: the template is the operator's, not the client's).

Request text stays text: lily/encoding.py escapes special-token strings in the context
before rendering, so the template's own control tokens can be told from look-alikes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.exceptions import SecurityError
from jinja2.runtime import LoopContext, Macro
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Cycler, Joiner
from jinja2.visitor import NodeTransformer

from lily.template_budget import (
    TemplateLimitError,
    TemplateLimits,
    active,
    bounded_filter,
    budget,
    check_binop,
    check_int,
    check_method,
    concat,
    finalize,
    guarded_loop,
    input_chars,
    size,
    slice_of,
)

__all__ = ["ChatTemplateError", "TemplateLimitError", "TemplateLimits", "compile_template",
           "input_chars", "prepare_messages", "render"]  # fmt: skip


class ChatTemplateError(ValueError):
    """The chat template is missing, invalid, unsafe, or rejected the messages."""


def _tojson(value: Any, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:  # fmt: skip
    # Keep non-ASCII as is: tool schemas in other languages must reach the model readable.
    if indent is not None and not 0 <= int(indent) <= 16:
        raise TemplateLimitError("asked tojson for an indent over 16")
    return json.dumps(
        value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"chat template rejected the request: {message}")


_LOOP, _CONCAT, _SLICE = "__lily_loop", "__lily_concat", "__lily_slice"


def _literal_chars(body: list[nodes.Node]) -> int:
    """Literal text in a loop body, outside nested loops (they charge their own)."""
    n, stack = 0, list(body)
    while stack:
        x = stack.pop()
        if isinstance(x, nodes.TemplateData):
            n += len(x.data)
        elif not isinstance(x, nodes.For):
            stack.extend(x.iter_child_nodes())
    return n


class _Bound(NodeTransformer):
    """Routes every ``for`` iterable, ``~`` and slice through the budget."""

    def __init__(self, env: jinja2.Environment) -> None:
        self.env = env

    def _call(self, name: str, args: list[nodes.Expr], lineno: int) -> nodes.Call:
        call = nodes.Call(nodes.Name(name, "load"), args, [], None, None)
        return call.set_lineno(lineno).set_environment(self.env)

    def visit_For(self, node: nodes.For) -> nodes.Node:  # noqa: N802 (Jinja's names)
        node = self.generic_visit(node)
        body = _literal_chars(node.body)
        const = nodes.Const(body).set_lineno(node.lineno).set_environment(self.env)
        node.iter = self._call(_LOOP, [node.iter, const], node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:  # noqa: N802
        node = self.generic_visit(node)
        return self._call(_CONCAT, list(node.nodes), node.lineno)

    def visit_Getitem(self, node: nodes.Getitem) -> nodes.Node:  # noqa: N802
        node = self.generic_visit(node)
        if not isinstance(node.arg, nodes.Slice):
            return node
        parts = [node.arg.start, node.arg.stop, node.arg.step]
        none = [p or nodes.Const(None).set_lineno(node.lineno).set_environment(self.env)
                for p in parts]  # fmt: skip
        return self._call(_SLICE, [node.node, *none], node.lineno)


class _Sandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, with every allocation charged to the render's budget. An
    unsafe attribute raises at once instead of rendering as an empty string, so a template
    that probes internals fails visibly."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        raise SecurityError(
            f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe"
        )

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        return _Bound(self).visit(super()._parse(source, name, filename))

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        check_binop(operator, left, right)
        out = super().call_binop(context, operator, left, right)
        active().charge(size(out))
        return out

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        # Jinja's own bookkeeping, not arguments (the context uses them)
        extra = {k: kwargs.pop(k) for k in ("_loop_vars", "_block_vars") if k in kwargs}
        if __obj is guarded_loop or __obj is concat or __obj is slice_of:  # the budget's own
            return __obj(*args, **kwargs)
        target = getattr(__obj, "__wrapped__", __obj)  # the sandbox's str.format wrapper
        owner = getattr(target, "__self__", None)
        if owner is not None and not isinstance(owner, LoopContext | Cycler | Joiner):
            # builtin methods (types' own included): only the listed ones, checked
            args = check_method(owner, target.__name__, args, kwargs)
        elif owner is None and not (
            isinstance(__obj, Macro | LoopContext | Joiner)
            or any(__obj is g for g in __self.globals.values())
        ):
            raise SecurityError(f"a chat template may not call {__obj!r}")
        else:
            for a in (*args, *kwargs.values()):
                check_int(a, getattr(__obj, "__name__", "a call"))
        out = super().call(__context, __obj, *args, **kwargs, **extra)
        active().charge(size(out))
        return out


def compile_template(source: str) -> jinja2.Template:
    """Compile a chat template in the bounded sandbox; ChatTemplateError on bad syntax."""
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"],
                   finalize=finalize)  # fmt: skip
    env.filters = {name: bounded_filter(name, f) for name, f in env.filters.items()}
    env.filters["tojson"] = bounded_filter("tojson", _tojson)
    env.globals.pop("lipsum", None)  # lorem ipsum of any length: no use in a prompt
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals[_LOOP] = guarded_loop
    env.globals[_CONCAT] = concat
    env.globals[_SLICE] = slice_of
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template syntax error at line {e.lineno}: {e}") from e


def render(template: jinja2.Template, context: dict[str, Any], limits: TemplateLimits,
           n_input: int) -> str:  # fmt: skip
    """Render within ``limits`` (``n_input``: characters in the request's strings);
    TemplateLimitError past them, its message a phrase to follow the template's name."""
    with budget(limits, n_input):
        return template.render(**context)


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


def prepare_messages(messages: Any) -> list[dict[str, Any]]:
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
