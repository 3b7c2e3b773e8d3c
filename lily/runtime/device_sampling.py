"""The sampler on the device, safe to capture in a CUDA graph.

Same maths and order as `Sampler` (lily/runtime/sampling.py): repetition penalty over
prompt and output, frequency and presence penalties over output, temperature (below 1e-5
greedy), top-k, top-p, min-p, one Gumbel-max draw. What differs is where things live:
every per-request value sits in a device tensor owned by the sampler, so one captured
graph serves every request of the same `Structure` (which ops run), and the chosen id is
written into a device tensor instead of being returned to the host.

The random stream is lily/runtime/draws.py's, the one every sampler draws from (a hash of
seed, draw number and token index that a graph can replay): the host's ``Sampler`` draws
the same tokens from the same logits, seed and draw number.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence
from typing import NamedTuple

import torch

from lily.runtime.draws import as_i64, perturbed, token_lanes
from lily.runtime.sampling import (
    NO_TOKEN,
    SamplingParams,
    check_logits,
    mark_seen,
    penalize,
)


class Structure(NamedTuple):
    """Which ops a draw runs: part of a captured graph's key (values never are)."""

    greedy: bool
    penalties: bool
    top_k: bool
    top_p: bool
    min_p: bool

    @classmethod
    def of(cls, p: SamplingParams, vocab_size: int) -> Structure:
        penalties = p.has_penalties
        if p.greedy:  # temperature and the truncations are never applied
            return cls(True, penalties, False, False, False)
        return cls(False, penalties, 0 < p.top_k < vocab_size, p.top_p < 1.0, p.min_p > 0.0)


class DeviceSampler:
    """Draws into device tensors. One per runner, reloaded per request: its tensors never
    move, so graphs that captured them stay valid.

    `load` (outside graphs) fills the request's values; `sample_into` (graph-safe: no host
    sync, no branch on tensor values) writes the chosen id, or -1 when the best candidate
    is not finite, and records it for the penalties.
    """

    def __init__(self, vocab_size: int, device: torch.device | str):
        if vocab_size < 1:
            raise ValueError(f"vocab_size: must be >= 1, got {vocab_size}")
        self.vocab_size = vocab_size
        self.device = dev = torch.device(device)

        def scalar(dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(1, dtype=dtype, device=dev)

        self.temperature = scalar(torch.float32)
        self.top_k = scalar(torch.long)
        self.top_p = scalar(torch.float32)
        self.log_min_p = scalar(torch.float32)
        self.repetition = scalar(torch.float32)
        self.presence = scalar(torch.float32)
        self.frequency = scalar(torch.float32)
        self.seed = scalar(torch.long)
        self.step = scalar(torch.long)  # draws made for this request
        self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=dev)
        self.counts = torch.zeros(vocab_size, dtype=torch.float32, device=dev)
        self.lanes = token_lanes(vocab_size, dev)
        self.structure = Structure(True, False, False, False, False)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Everything a captured draw reads or writes."""
        return (self.temperature, self.top_k, self.top_p, self.log_min_p, self.repetition,
                self.presence, self.frequency, self.seed, self.step, self.seen, self.counts,
                self.lanes)  # fmt: skip

    def ident(self) -> tuple[int, ...]:
        """The tensors' addresses (a graph's key: they must not have moved)."""
        return tuple(t.data_ptr() for t in self.tensors())

    def load(self, params: SamplingParams, prompt_ids: Sequence[int],
             generated: Sequence[int] = ()) -> None:  # fmt: skip
        """Start a request: its values into the tensors, the prompt marked as seen.
        ``generated``: tokens the request already drew (with this seed): the penalties count
        them and the next draw is number ``len(generated)`` of the random stream."""
        params.validate()
        s = self.structure = Structure.of(params, self.vocab_size)
        self.temperature.fill_(params.temperature)
        self.top_k.fill_(params.top_k)
        self.top_p.fill_(params.top_p)
        # As Sampler does it: the log in float64, then rounded to fp32 once.
        self.log_min_p.fill_(math.log(params.min_p) if params.min_p > 0.0 else 0.0)
        self.repetition.fill_(params.repetition_penalty)
        self.presence.fill_(params.presence_penalty)
        self.frequency.fill_(params.frequency_penalty)
        seed = params.seed if params.seed is not None else secrets.randbits(64)
        self.seed.fill_(as_i64(seed))
        self.step.zero_()
        self.seen.zero_()
        self.counts.zero_()
        if s.penalties:
            mark_seen(self.seen, prompt_ids)
        if generated:
            ids = torch.as_tensor(list(generated), dtype=torch.long, device=self.device)
            if s.penalties:
                mark_seen(self.seen, generated)
                self.counts.index_add_(0, ids, torch.ones(len(ids), device=self.device))
            self.step.fill_(len(generated))

    def penalized(self, logits: torch.Tensor) -> torch.Tensor:
        """fp32 logits after the repetition, frequency and presence penalties."""
        check_logits(logits, self.vocab_size, self.device)
        x = logits.float()
        if not self.structure.penalties:
            return x
        return penalize(x, self.seen, self.counts, self.repetition, self.frequency,
                        self.presence)  # fmt: skip

    def warp(self, x: torch.Tensor) -> torch.Tensor:
        """Penalized logits -> temperature-scaled, with what top-k, top-p and min-p exclude
        set to -inf (as `Sampler.warp`)."""
        s = self.structure
        x = x / self.temperature
        if s.top_k or s.top_p:
            # One sort serves both: masking the tail below the k-th value keeps the sorted
            # order, so top-p sees what sorting the top-k result again would give.
            sorted_x, order = torch.sort(x, descending=True)
            if s.top_k:
                kth = sorted_x.gather(0, self.top_k - 1)
                x = x.masked_fill(x < kth, -math.inf)  # NOTE: ties with the k-th are kept
                sorted_x = sorted_x.masked_fill(sorted_x < kth, -math.inf)
            if s.top_p:
                probs = torch.softmax(sorted_x, dim=-1)
                drop = torch.cumsum(probs, dim=-1) - probs >= self.top_p
                # the most likely token always stays (fill_, not drop[0] = False: that
                # copies a host scalar, which a CUDA graph capture refuses)
                drop[:1].fill_(False)
                x = x.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), -math.inf)
        if s.min_p:
            x = x.masked_fill(x < x.max() + self.log_min_p, -math.inf)
        return x

    def sample_into(self, logits: torch.Tensor, out: torch.Tensor) -> None:
        """Write the next id (or -1: nothing finite to draw) into ``out`` (1,) int64 and
        record it; graph-safe."""
        s = self.structure
        x = self.penalized(logits)
        if not s.greedy:
            x = perturbed(self.warp(x), self.seed, self.step, self.lanes)
        best = torch.argmax(x).view(1)
        tok = torch.where(torch.isfinite(x.gather(0, best)), best, -1)
        out.copy_(tok)
        if s.penalties:
            # A failed draw (-1) records nothing; the clamp only keeps the index valid.
            idx, ok = tok.clamp_min(0), tok >= 0
            self.seen.index_put_((idx,), self.seen[idx] | ok)
            self.counts.index_add_(0, idx, ok.float())
        self.step.add_(1)

    def snapshot(self) -> tuple[torch.Tensor, ...]:
        """Copies of what a draw changes (a graph's warm-up run must leave no trace)."""
        return self.step.clone(), self.seen.clone(), self.counts.clone()

    def restore(self, snap: tuple[torch.Tensor, ...]) -> None:
        for t, saved in zip((self.step, self.seen, self.counts), snap, strict=True):
            t.copy_(saved)


def check_token(token_id: int) -> int:
    """The host's side of a draw: -1 means nothing was sampleable (Sampler's error)."""
    if token_id < 0:
        raise ValueError(NO_TOKEN)
    return token_id
