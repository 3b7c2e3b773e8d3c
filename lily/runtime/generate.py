"""The generation loop: after the prefill, one token at a time until a stop.

Two loops share the host's end checks (`_Ends`): the plain one samples on the host side
of each step (logits processors and log-probs need it); the pipelined one, for runners
that sample on the device, launches step k + 1 before the host reads token k.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from lily.runtime.runner import Runner
from lily.runtime.sampling import Sampler, SamplingParams
from lily.runtime.stops import StopMatcher
from lily.tokenizer import IncrementalDetokenizer, Tokenizer

LogitsProcessor = Callable[[list[int], torch.Tensor], torch.Tensor]


@dataclass
class StepOutput:
    token_id: int | None
    text: str
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    finish_reason: str | None = None  # "stop", "length" or "cancelled" on the last step


@dataclass
class Usage:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0


class _Ends:
    """The host's end checks, shared by both loops: EOS and stop ids, stop strings (text
    that could still start one is held back), max_tokens."""

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams, max_new: int):
        self.detok = IncrementalDetokenizer(tokenizer)
        self.stopper = StopMatcher(params.stop)
        self.ends = set(params.stop_token_ids)
        if not params.ignore_eos:
            self.ends |= set(tokenizer.eos_token_ids)
        self.max_new = max_new
        self.count = 0

    def step(self, tok: int, lp=None, top=None) -> StepOutput:
        """The output for the next token; ``finish_reason`` is set when it is the last."""
        self.count += 1
        stopper = self.stopper
        if tok in self.ends:
            text = stopper.feed(self.detok.flush()) + stopper.flush()
            return StepOutput(tok, text, lp, top, finish_reason="stop")
        text = stopper.feed(self.detok.push(tok))
        if stopper.stopped:
            return StepOutput(tok, text, lp, top, finish_reason="stop")
        if self.count >= self.max_new:
            text += stopper.feed(self.detok.flush()) + stopper.flush()
            return StepOutput(tok, text, lp, top, finish_reason="length")
        return StepOutput(tok, text, lp, top)


def decode_loop(
    runner: Runner,
    tokenizer: Tokenizer,
    state,
    logits: torch.Tensor,
    prompt_ids: list[int],
    params: SamplingParams,
    max_new: int,
    cancelled: Callable[[], bool],
    logits_processor: LogitsProcessor | None,
    usage: Usage,
) -> Iterator[StepOutput]:
    """Sample from ``logits`` (of the last prompt token) and continue until a stop."""
    ends = _Ends(tokenizer, params, max_new)
    if runner.device_decode is not None and logits_processor is None and params.logprobs is None:
        yield from _pipelined(runner, state, logits, prompt_ids, params, cancelled, usage, ends)
        return
    sampler = Sampler(params, logits.shape[-1], logits.device)
    sampler.observe_prompt(prompt_ids)
    generated: list[int] = []
    while True:
        if cancelled():
            yield StepOutput(None, "", finish_reason="cancelled")
            return
        scores = logits if logits_processor is None else logits_processor(generated, logits)
        tok = sampler.sample(scores)
        lp = top = None
        if params.logprobs is not None:
            lp, top = sampler.logprobs(logits, tok, params.logprobs)
        generated.append(tok)
        usage.completion_tokens = len(generated)
        sampler.observe(tok)
        out = ends.step(tok, lp, top)
        yield out
        if out.finish_reason is not None:
            return
        logits = runner.decode(tok, state)


def _pipelined(runner: Runner, state, logits: torch.Tensor, prompt_ids: list[int],
               params: SamplingParams, cancelled: Callable[[], bool], usage: Usage,
               ends: _Ends) -> Iterator[StepOutput]:  # fmt: skip
    """The loop for device sampling: the step that consumes token i is launched before the
    host waits for token i, so the device never idles on the host's checks.

    A stop is seen one step late: the step launched for token i has already fed it to the
    model, so token i goes into ``state.tokens`` (at every yield, state.length and
    state.tokens name exactly what the model consumed). No step is launched past
    ``max_new``. The first token is the exception: it goes out before the step that
    consumes it is launched, because that launch may first capture a graph (a new context
    bucket or cache: tens of milliseconds) that the time to first token should not wait on.
    """
    dd = runner.device_decode
    dd.start(params, prompt_ids, logits)  # draw 0, from the prefill logits
    for i in range(ends.max_new):
        if cancelled():
            yield StepOutput(None, "", finish_reason="cancelled")
            return
        ahead = i + 1 < ends.max_new
        early = ahead and i > 0
        if early:
            runner.decode_sampled(state)  # consumes draw i, draws i + 1
        tok = dd.recv(i)
        if early:
            runner.consumed(state, tok)
        usage.completion_tokens = i + 1
        out = ends.step(tok)
        yield out
        if out.finish_reason is not None:
            return
        if ahead and not early:  # the first token is out: now its step
            runner.decode_sampled(state)
            runner.consumed(state, tok)
