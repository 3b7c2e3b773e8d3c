"""What steers one request's decoding, whatever API it came in through: the one place that
turns tools, tool_choice, a response schema, the reasoning budget and logit_bias into the
engine job's ``logits_processor``.

The rules (docs/API.md, "Decoding controls"):

- A required constraint (a forced tool call, a JSON response format) always gets its turn.
  While the model thinks, end-of-sequence (EOS and the request's stop ids) is masked, so
  it cannot end the answer before the constraint has run; the model may close
  ``</think>`` itself, and the grammar applies from there.
- The reasoning ends when its budget is spent: ``</think>`` is forced (after a newline when
  the reasoning's text did not end with one) and then the blank line the chat template
  writes after it. The budget is the request's (``thinking_budget``), else the server's
  (``--thinking-budget``). With a required constraint it is also capped at ``max_new -
  reserve``, ``reserve = min(max_new // 2, RESERVE_CAP)``: the answer always has room.
- ``parallel_tool_calls: false``: a forced choice's grammar allows one call; in free
  generation EOS is forced right after the first ``</tool_call>``.
- ``logit_bias`` is added to the logits before any mask.

A request with none of these has no processor (the engine's fastest decode loop).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lily.server.grammar import Grammar, json_grammar, tool_grammar
from lily.server.protocol import bad_request

RESERVE_CAP = 1024  # most tokens kept back for a required constraint's answer
BIAS_LIMIT = 100.0  # OpenAI's range for logit_bias values


@dataclass
class DecodeSpec:
    """The decoding controls of one chat-like request."""

    tools: list[dict[str, Any]] | None = None
    tool_choice: str = "auto"  # "auto", "none" or "required"
    tool_name: str | None = None  # a function the call must be (implies required)
    json_schema: Any = None  # the answer must be JSON matching it; None: free text
    json_param: str = "response_format"
    parallel_tool_calls: bool = True
    thinking_budget: int | None = None  # None: the server's default
    logit_bias: dict[int, float] | None = None


def parse_logit_bias(raw: dict[str, Any] | None, n_vocab: int) -> dict[int, float] | None:
    """OpenAI's ``logit_bias`` (token id as a decimal string -> bias in [-100, 100])."""
    if not raw:
        return None
    out = {}
    for key, value in raw.items():
        k = str(key).strip()
        if not k.isdigit() or not 0 <= int(k) < n_vocab:
            raise bad_request(f"logit_bias: {str(key)[:40]!r} is not a token id of this model "
                              f"(an integer in [0, {n_vocab}))", "logit_bias")  # fmt: skip
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        if not ok or not math.isfinite(value) or abs(value) > BIAS_LIMIT:
            raise bad_request(f"logit_bias: the bias of token {k} must be a number in "
                              f"[-{BIAS_LIMIT:g}, {BIAS_LIMIT:g}], got {value!r}",
                              "logit_bias")  # fmt: skip
        out[int(k)] = float(value)
    return out


def reasoning_limit(budget: int | None, required: bool, max_new: int) -> int | None:
    """Reasoning tokens after which ``</think>`` is forced (None: never)."""
    limits = [] if budget is None else [budget]
    if required:
        limits.append(max(0, max_new - min(max_new // 2, RESERVE_CAP)))
    return min(limits) if limits else None


def build_processor(
    ctx: Any,
    spec: DecodeSpec,
    *,
    after_think: bool,
    max_new: int,
    stop_ids: Sequence[int] = (),
    ignore_eos: bool = False,
) -> Processor | None:
    """The processor for ``spec`` (None when nothing constrains the request).

    ``after_think``: the prompt opened a ``<think>`` block; ``max_new``: the tokens the
    request may generate. Client mistakes (a grammar that cannot be built) are 400s.
    """
    tok = ctx.engine.tokenizer
    n_vocab = ctx.vocab_size
    grammar_text, param = None, None
    tools = spec.tools if spec.tool_choice != "none" else None
    if tools and (spec.tool_choice == "required" or spec.tool_name is not None):
        grammar_text = tool_grammar(tools, spec.tool_name, after_think, spec.parallel_tool_calls)
        param = "tool_choice"
    elif spec.json_schema is not None:
        grammar_text, param = json_grammar(spec.json_schema, after_think), spec.json_param
    grammar = None
    if grammar_text is not None:
        grammar = ctx.grammars.grammar(grammar_text, n_vocab, param)
    budget = spec.thinking_budget
    if budget is None:
        budget = getattr(ctx.settings, "thinking_budget", None)
    limit = reasoning_limit(budget, grammar is not None, max_new) if after_think else None
    one_call = (
        tok.tool_call_end_id
        if tools and not spec.parallel_tool_calls and grammar is None and not ignore_eos
        else None
    )
    bias = None
    if spec.logit_bias:
        bias = torch.zeros(n_vocab)
        for i, b in spec.logit_bias.items():
            bias[i] = b
    if grammar is None and limit is None and one_call is None and bias is None:
        return None
    ends = [] if ignore_eos else list(tok.eos_token_ids)
    return Processor(
        n_vocab,
        eos_ids=list(tok.eos_token_ids),
        grammar=grammar,
        think_end=tok.think_end_id if after_think else None,
        think_limit=limit,
        close_ids=_close_ids(tok),
        newline_ids=tok.encode("\n"),
        guard_ids=sorted({*ends, *stop_ids}) if grammar is not None else [],
        one_call_end=one_call,
        bias=bias,
        token_text=lambda i: tok.decode([i]),
    )


def _close_ids(tok: Any) -> list[int]:
    """``</think>`` and the blank line the chat template writes after it."""
    if tok.think_end_id is None:
        raise bad_request("this model's tokenizer has no </think> token", "thinking_budget")
    return [tok.think_end_id, *tok.encode("\n\n")]


class Processor:
    """``logits_processor(generated_ids, logits)`` for one request.

    In order: ``bias`` is added; a token forced by the reasoning budget wins; while the model
    thinks (``think_end`` not generated yet) ``guard_ids`` are masked; after it, ``grammar``
    masks what it does not allow and, with ``one_call_end``, EOS alone follows that token.
    """

    def __init__(
        self,
        n_vocab: int,
        *,
        eos_ids: list[int],
        grammar: Grammar | None = None,
        think_end: int | None = None,
        think_limit: int | None = None,
        close_ids: list[int] | None = None,
        newline_ids: list[int] | None = None,
        guard_ids: list[int] | None = None,
        one_call_end: int | None = None,
        bias: torch.Tensor | None = None,
        token_text: Any = None,
    ) -> None:
        self.n_vocab = n_vocab
        self.grammar = grammar
        self._eos = eos_ids
        self._think_end = think_end
        self._limit = think_limit
        self._close = close_ids or []
        self._newline = newline_ids or []
        self._guard = torch.tensor(guard_ids or [], dtype=torch.long)
        self._one_call = one_call_end
        self._bias = bias
        self._copies: dict[tuple[str, torch.device], torch.Tensor] = {}
        self._text = token_text
        # NOTE: positions in `generated`: where the answer starts (None while thinking),
        # how far it was scanned, how far the grammar was fed, tokens forced at positions.
        self.answer_at: int | None = 0 if think_end is None else None
        self._scanned = 0
        self._fed = 0
        self._forced: dict[int, int] = {}
        self._calls_done = False

    def __call__(self, generated: list[int], logits: torch.Tensor) -> torch.Tensor:
        n = len(generated)
        self._scan(generated)
        if self._bias is not None:
            logits = logits + self._on(logits.device, "_bias")
        if self.answer_at is None and self._limit is not None and n >= self._limit:
            self._close_reasoning(generated)
        if n in self._forced:
            return self._only([self._forced[n]], logits)
        if self.answer_at is None:  # thinking
            if self._guard.numel():
                logits = logits.index_fill(0, self._on(logits.device, "_guard"), float("-inf"))
            return logits
        if self._calls_done:
            return self._only(self._eos, logits)
        if self.grammar is not None:
            self.grammar.feed(generated[max(self._fed, self.answer_at) :])
            self._fed = n
            allowed = self.grammar.mask()
            if logits.shape[-1] != allowed.shape[0]:
                raise ValueError(f"logits have {logits.shape[-1]} entries, grammar {self.n_vocab}")
            logits = logits.masked_fill(~allowed.to(logits.device), float("-inf"))
        return logits

    def _scan(self, generated: list[int]) -> None:
        for i in range(self._scanned, len(generated)):
            t = generated[i]
            if self.answer_at is None:
                if t == self._think_end:
                    self.answer_at = i + 1
            elif t == self._one_call:
                self._calls_done = True
        self._scanned = len(generated)

    def _close_reasoning(self, generated: list[int]) -> None:
        if self._forced:
            return  # already closing
        n = len(generated)
        last = self._text(generated[-1]) if generated and self._text else "\n"
        seq = ([] if last.endswith("\n") else self._newline) + self._close
        self._forced.update({n + i: t for i, t in enumerate(seq)})

    def _on(self, device: torch.device, name: str) -> torch.Tensor:
        """Tensor attribute ``name`` on ``device``, copied there once."""
        key = (name, device)
        if key not in self._copies:
            self._copies[key] = getattr(self, name).to(device)
        return self._copies[key]

    def _only(self, ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        out = torch.full_like(logits, float("-inf"))
        out[ids] = 0.0
        return out
