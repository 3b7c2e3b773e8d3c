"""The generation loop: chunked prefill, then one token at a time until a stop."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

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


class Runner:
    """What the loop needs from a forward path (reference or GPU)."""

    def prefill(self, ids: list[int], state) -> torch.Tensor:  # logits (V,) of the last
        raise NotImplementedError

    def decode(self, token_id: int, state) -> torch.Tensor:  # logits (V,)
        raise NotImplementedError

    def prefill_snapshots(
        self, ids: list[int], state, points: list[int]
    ) -> tuple[torch.Tensor, dict[int, dict]]:
        """Prefill ``ids`` and return the DeltaNet states at absolute positions ``points``.

        This version prefills the pieces between the points separately; runners that can
        copy the state out in the middle of a chunk override it.
        """
        snaps, logits = {}, None
        origin = pos = state.length
        end = origin + len(ids)
        for cut in [*[p for p in points if origin < p < end], end]:
            logits = self.prefill(ids[pos - origin : cut - origin], state)
            pos = cut
            if cut < end:
                snaps[cut] = state.snapshot_recurrent()
        return logits, snaps


class ReferenceRunner(Runner):
    """The plain-PyTorch forward, prefilling in chunks of ``chunk`` tokens."""

    def __init__(self, model, chunk: int):
        self.model = model
        self.chunk = max(1, chunk)

    def prefill(self, ids: list[int], state) -> torch.Tensor:
        dev = self.model.device
        logits = None
        with torch.inference_mode():
            for i in range(0, len(ids), self.chunk):
                t = torch.tensor(ids[i : i + self.chunk], dtype=torch.long, device=dev)
                logits = self.model.forward(t, state)
        assert logits is not None, "prefill needs at least one token"
        return logits[0]

    def decode(self, token_id: int, state) -> torch.Tensor:
        t = torch.tensor([token_id], dtype=torch.long, device=self.model.device)
        with torch.inference_mode():
            return self.model.forward(t, state)[0]


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
    sampler = Sampler(params, logits.shape[-1], logits.device)
    sampler.observe_prompt(prompt_ids)
    detok = IncrementalDetokenizer(tokenizer)
    stopper = StopMatcher(params.stop)
    ends = set(params.stop_token_ids)
    if not params.ignore_eos:
        ends |= set(tokenizer.eos_token_ids)
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
        if tok in ends:
            text = stopper.feed(detok.flush()) + stopper.flush()
            yield StepOutput(tok, text, lp, top, finish_reason="stop")
            return
        text = stopper.feed(detok.push(tok))
        if stopper.stopped:
            yield StepOutput(tok, text, lp, top, finish_reason="stop")
            return
        if len(generated) >= max_new:
            text += stopper.feed(detok.flush()) + stopper.flush()
            yield StepOutput(tok, text, lp, top, finish_reason="length")
            return
        yield StepOutput(tok, text, lp, top)
        logits = runner.decode(tok, state)
