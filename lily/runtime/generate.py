"""Decode of one sequence running alone: after the prefill, one token at a time.

Two ways, chosen per request (``Seq.device_draws``): tokens sampled on the host side of each
step's logits (logits processors and log-probs need it, and runners without device
sampling), or ``Pipelined``: the runner draws on the device and the step that consumes token
i is launched before the host reads token i. ``step_alone`` is one token either way; the
batch (lily/runtime/batch.py) calls it while a sequence runs by itself and ``leave_alone``
when others join; ``decode_loop`` is the whole stream.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from lily.runtime.runner import Runner
from lily.runtime.sampling import SamplingParams
from lily.runtime.sequence import LogitsProcessor, Seq, StepOutput, Usage
from lily.tokenizer import Tokenizer

__all__ = ["LogitsProcessor", "Pipelined", "StepOutput", "Usage", "decode_loop", "step_alone"]


class Pipelined:
    """A lone sequence decoded from the runner's device draws, the host one step behind.

    A stop is seen one step late: the step launched for token i has already fed it to the
    model, so token i goes into ``state.tokens`` (at every output, state.length and
    state.tokens name exactly what the model consumed). No step is launched past
    ``max_new``. The first token is the exception: it goes out before the step that
    consumes it is launched (``owed``, launched by ``settle`` at the next token), because
    that launch may first capture a graph (a new context bucket or cache: tens of
    milliseconds) that the time to first token should not wait on.
    """

    def __init__(self, runner: Runner, seq: Seq):
        self.runner, self.seq, self.dd = runner, seq, runner.device_decode
        self.fresh = False  # draw 0 (from the prefill logits) is in flight
        self.owed = False  # the last emitted token's step is not launched yet

    def start(self, logits: torch.Tensor) -> None:
        """Draw the first token from the prefill's ``logits`` (its copy to the host starts)."""
        s = self.seq
        self.dd.start(s.params, s.prompt, logits)
        s.drawn_elsewhere()
        self.fresh = True

    def resume(self) -> None:
        """Take over a sequence whose last token is emitted but not consumed (a batch's)."""
        s = self.seq
        self.dd.resume(s.params, s.prompt, s.generated)
        s.drawn_elsewhere()
        self.owed = True

    def settle(self) -> None:
        """Launch the step the last emitted token is owed (before a cancel check: after a
        cancel, every emitted token was consumed)."""
        if self.owed:
            s = self.seq
            self.runner.decode_sampled(s.state)
            self.runner.consumed(s.state, s.pending)
            s.pending = None
            self.owed = False

    def next(self) -> StepOutput:
        """The next token (``settle`` first): its draw is in flight."""
        s, runner = self.seq, self.runner
        i = len(s.generated)
        ahead = i + 1 < s.max_new
        early = ahead and not self.fresh
        self.fresh = False
        if early:
            runner.decode_sampled(s.state)  # consumes draw i, draws i + 1
        tok = self.dd.recv(i)
        if early:
            runner.consumed(s.state, tok)
        out = s.accept(tok)
        if early:
            s.pending = None
        elif out.finish_reason is None:
            self.owed = True  # the first token is out: its step comes with the next one
        return out

    def drain(self) -> StepOutput | None:
        """Leave: the draw in flight (if any) comes to the host and is emitted, left
        pending (not consumed) for whoever decodes the sequence next."""
        if self.owed:
            self.owed = False
            return None
        return self.seq.accept(self.dd.recv(len(self.seq.generated)))


def step_alone(runner: Runner, seq: Seq, logits: torch.Tensor | None = None) -> StepOutput:
    """The next token of ``seq`` decoding by itself: its pending token consumed (or, for the
    first, the prefill's ``logits``), then the cancel check, then the draw."""
    if seq.device_draws and runner.device_decode is not None:
        pipe = seq.pipe
        if pipe is None:
            pipe = seq.pipe = Pipelined(runner, seq)
            if logits is not None:
                pipe.start(logits)
            else:
                pipe.resume()
        pipe.settle()
        if seq.cancelled():
            return seq.cancel()
        return pipe.next()
    if logits is None:
        logits = runner.decode(seq.pending, seq.state)
        seq.pending = None
    if seq.cancelled():
        return seq.cancel()
    return seq.emit(logits)


def leave_alone(seq: Seq) -> StepOutput | None:
    """End the lone mode of ``seq`` before it joins a batched step: a token drawn in flight
    is emitted (returned) and left pending."""
    pipe, seq.pipe = seq.pipe, None
    return None if pipe is None else pipe.drain()


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
    """Sample from ``logits`` (of the last prompt token) and continue until a stop, the
    sequence alone on ``state``; device draws where the runner has them and the request
    needs no logits processor or log-probs."""
    device = (runner.device_decode is not None and logits_processor is None
              and params.logprobs is None)  # fmt: skip
    seq = Seq(prompt_ids, params, max_new, tokenizer, logits.shape[-1], logits.device,
              cancelled=cancelled, processor=logits_processor, usage=usage,
              device_draws=device)  # fmt: skip
    seq.state = state
    out = step_alone(runner, seq, logits)
    while True:
        yield out
        if out.finish_reason is not None:
            return
        out = step_alone(runner, seq)
