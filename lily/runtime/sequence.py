"""One request from its prefill to its last token: what it asked for, what it emitted, and
how its next token is chosen.

A ``Seq`` is driven by the batch (lily/runtime/batch.py) or, running alone, by the loops of
lily/runtime/generate.py; every path ends a token the same way (``accept``: the end checks
of ``Ends``, the usage). Between steps a decoding sequence holds ``pending``: its last
emitted token, which the model has not consumed yet (the next step consumes it).

Its token is drawn either on the host side of the logits (``Sampler``: logits processors
and log-probs need it) or, where the runner samples on the device, by the device sampler's
maths (``device_draws``): alone by the runner's graph-captured sampler, in a batched step
by the runner's rows sampler (lily/runtime/rows_sampling.py), its first token beside
others by its own ``DeviceSampler`` (``draw_into``). All draw from one random stream
(lily/runtime/draws.py), number the draws the same way and key them by the same seed, so a
seeded request draws the same tokens from the same logits either way (with or without
log-probs, for one).
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lily.runtime.device_sampling import DeviceSampler
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


class Ends:
    """The host's end checks: EOS and stop ids, stop strings (text that could still start
    one is held back), max_tokens."""

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


class Seq:
    """One request's generation state (see the module docstring).

    ``device_draws``: its tokens are drawn by the device sampler's maths (no logits
    processor, no log-probs, a runner that samples on the device); else by a host-side
    ``Sampler``. ``state`` is the session state it runs on (set when its prefill starts).
    """

    def __init__(self, prompt: list[int], params: SamplingParams, max_new: int,
                 tokenizer: Tokenizer, vocab_size: int, device: torch.device, *,
                 cancelled: Callable[[], bool] = lambda: False,
                 processor: LogitsProcessor | None = None, usage: Usage | None = None,
                 device_draws: bool = False, tag: object = None):  # fmt: skip
        self.prompt = list(prompt)
        # NOTE: the seed is fixed once, so every sampler this request meets (the runner's
        # for a lone sequence, its own in a batch) continues one random stream.
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        self.params = dataclasses.replace(params, seed=seed)
        self.max_new = max_new
        self.cancelled = cancelled
        self.processor = processor
        self.usage = usage if usage is not None else Usage(prompt_tokens=len(prompt))
        self.ends = Ends(tokenizer, params, max_new)
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.device_draws = device_draws
        self.tag = tag  # the caller's handle (the server's job)
        self.generated: list[int] = []
        self.pending: int | None = None  # emitted, not yet consumed by the model
        self.state = None
        self.finish_reason: str | None = None
        self.sampler: Sampler | None = None
        if not device_draws:
            self.sampler = Sampler(self.params, vocab_size, self.device)
            self.sampler.observe_prompt(self.prompt)
        # Set by the batch: the next prompt position to prefill (None: not started), where
        # to save snapshots, and whether the prompt is done.
        self.at: int | None = None
        self.cuts: list[int] = []
        self.decoding = False
        self.pipe = None  # lily.runtime.generate.Pipelined while it decodes alone on device draws
        self._rows: DeviceSampler | None = None  # its own device sampler, for batched steps
        self._rows_current = False  # False: the runner's sampler drew for it since

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    # ---- one token
    def emit(self, logits: torch.Tensor) -> StepOutput:
        """Draw the next token on the host side of ``logits`` (V,) (the logits processor
        first, log-probs after) and accept it."""
        p = self.params
        scores = logits if self.processor is None else self.processor(self.generated, logits)
        tok = self.sampler.sample(scores)
        lp = top = None
        if p.logprobs is not None:
            lp, top = self.sampler.logprobs(logits, tok, p.logprobs)
        self.sampler.observe(tok)
        return self.accept(tok, lp, top)

    def accept(self, tok: int, lp: float | None = None, top=None) -> StepOutput:
        """Record the drawn token: its output, and either the end or ``pending``."""
        self.generated.append(tok)
        self.usage.completion_tokens = len(self.generated)
        out = self.ends.step(tok, lp, top)
        if out.finish_reason is not None:
            self.finish_reason = out.finish_reason
            self.pending = None
        else:
            self.pending = tok
        return out

    def cancel(self) -> StepOutput:
        """End as cancelled (a pending token stays unconsumed)."""
        self.finish_reason = "cancelled"
        self.pending = None
        return StepOutput(None, "", finish_reason="cancelled")

    # ---- device draws in a batch
    def draw_into(self, logits: torch.Tensor, out: torch.Tensor) -> None:
        """Draw the next token from ``logits`` (V,) into ``out`` (1,) on the device with the
        sequence's own device sampler (no host sync); the host reads it, then ``accept``."""
        if self._rows is None:
            self._rows = DeviceSampler(self.vocab_size, self.device)
        if not self._rows_current:
            self._rows.load(self.params, self.prompt, self.generated)
            self._rows_current = True
        self._rows.sample_into(logits, out)

    def drawn_elsewhere(self) -> None:
        """Another sampler (the runner's, for a lone sequence) drew for this request: its
        own is reloaded from the tokens before it draws again."""
        self._rows_current = False
