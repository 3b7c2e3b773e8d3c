"""Hypothesis strategies for request bodies, built from the server's OpenAPI schema.

A small JSON-Schema-to-strategy translation (refs, anyOf, enums, objects, arrays, bounded
numbers, strings): enough for the request models of lily/server/protocol.py, so the fuzz
follows the schema the server publishes rather than a hand copy of it. Optional fields
appear one time in four, so most bodies are valid and reach the handlers and the engine;
strings are drawn partly from a list of nasties (template syntax, chat markup, paths).
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

NASTY = [
    "", " ", "\x00", "\u202e", "\U0001f600", "<|im_start|>system\n", "<|im_end|>", "<think>",
    "</think>", "<tool_call>\n<function=x>", "{{ 7*7 }}", "{% for x in range(10) %}",
    "{{ ''.__class__.__mro__ }}", "/etc/passwd", "../../../../etc/passwd", "file:///etc/shadow",
    "${HOME}", "%s%n%x", "\\u0000", "'; DROP TABLE x; --", "a" * 300,
]  # fmt: skip
_MAX_DEPTH = 4

_json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**40), 2**40),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
)
_json = st.recursive(
    _json_leaf,
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3),
    max_leaves=6,
)
_text = st.one_of(st.text(max_size=24), st.sampled_from(NASTY))


def request_bodies(openapi: dict[str, Any], name: str) -> st.SearchStrategy[dict[str, Any]]:
    """Bodies for the component schema ``name`` of ``openapi``."""
    defs = openapi["components"]["schemas"]
    return _from(defs[name], defs, 0)


def _from(s: dict[str, Any], defs: dict[str, Any], depth: int) -> st.SearchStrategy:
    if "$ref" in s:
        return _from(defs[s["$ref"].rsplit("/", 1)[1]], defs, depth)
    if "anyOf" in s or "oneOf" in s:
        alts = s.get("anyOf") or s["oneOf"]
        return st.one_of([_from(a, defs, depth) for a in alts])
    if "enum" in s:
        return st.sampled_from(s["enum"])
    if "const" in s:
        return st.just(s["const"])
    kind = s.get("type")
    if depth > _MAX_DEPTH:
        return _json_leaf
    if kind == "object":
        return _object(s, defs, depth)
    if kind == "array":
        items = _from(s.get("items", {}), defs, depth + 1)
        lo = s.get("minItems", 0)
        return st.lists(items, min_size=lo, max_size=max(lo, min(s.get("maxItems", 3), 3)))
    if kind == "string":
        return _text
    if kind == "integer":
        lo, hi = s.get("minimum"), s.get("maximum")
        lo = int(lo) if lo is not None else -(10**6)
        hi = int(min(hi, 2**62)) if hi is not None else 10**6
        # Small values half the time: counts like n and best_of are valid only near 1.
        if max(lo, -2) > min(hi, 3):
            return st.integers(lo, hi)
        return st.one_of(st.integers(max(lo, -2), min(hi, 3)), st.integers(lo, hi))
    if kind == "number":
        return st.floats(
            min_value=s.get("minimum", s.get("exclusiveMinimum", -1e6)),
            max_value=s.get("maximum", s.get("exclusiveMaximum", 1e6)),
            exclude_min="exclusiveMinimum" in s,
            exclude_max="exclusiveMaximum" in s,
            allow_nan=False,
        )
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    return _json  # no type: anything


def _object(s: dict[str, Any], defs: dict[str, Any], depth: int) -> st.SearchStrategy:
    props = s.get("properties") or {}
    if not props:
        return st.dictionaries(st.text(max_size=8), _json, max_size=3)
    required = set(s.get("required", []))
    fields = {k: _from(v, defs, depth + 1) for k, v in props.items()}
    keep = {k: st.just(True) if k in required else st.integers(0, 3).map(lambda x: x == 0)
            for k in props}  # fmt: skip

    @st.composite
    def build(draw) -> dict[str, Any]:
        return {k: draw(fields[k]) for k in props if draw(keep[k])}

    return build()
