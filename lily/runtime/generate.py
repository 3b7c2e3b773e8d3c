"""The generation loop: chunked prefill, then one token at a time until a stop.

Two loops share the host's end checks (`_Ends`): the plain one samples on the host side
of each step (logits processors and log-probs need it); the pipelined one, for runners
that sample on the device, launches step k + 1 before the host reads token k.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from lily.runtime.device_decode import DeviceDecode
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

    # Set by runners that can decode from device-sampled tokens (see `decode_sampled`).
    device_decode: DeviceDecode | None = None

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

    def decode_sampled(self, state) -> None:
        """One step whose input is the last draw of ``device_decode``, already on the
        device: consume it at ``state.length``, draw the next, start its copy to the host.

        NOTE: ``state.length`` advances and ``state.busy`` is set, but the consumed id is
        not in ``state.tokens`` yet (the host does not know it): the loop appends it and
        clears ``busy`` when it reads the draw.
        """
        raise NotImplementedError


class ReferenceRunner(Runner):
    """The plain-PyTorch forward, prefilling in chunks of ``chunk`` tokens. With
    ``sample_on_device`` it also offers the pipelined loop's hook, run eagerly."""

    def __init__(self, model, chunk: int, sample_on_device: bool = False):
        self.model = model
        self.chunk = max(1, chunk)
        if sample_on_device:
            tok = torch.zeros(1, dtype=torch.long, device=model.device)
            self.device_decode = DeviceDecode(tok, model.cfg.vocab_size)

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

    def decode_sampled(self, state) -> None:
        dd = self.device_decode
        with torch.inference_mode():
            dd.draw(self.model.forward(dd.tok, state)[0])
            dd.send()
        # The model's forward recorded the id; as with the GPU runner, the loop records it
        # when it reads the draw.
        state.tokens.pop()
        state.busy = True


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
            state.tokens.append(tok)
            state.busy = False
        usage.completion_tokens = i + 1
        out = ends.step(tok)
        yield out
        if out.finish_reason is not None:
            return
        if ahead and not early:  # the first token is out: now its step
            runner.decode_sampled(state)
            state.tokens.append(tok)
            state.busy = False
