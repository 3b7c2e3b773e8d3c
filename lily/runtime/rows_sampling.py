"""The device sampler over the rows of a batched decode step, in one set of launches.

Row r draws for the request loaded into row r, with the maths, the order and the random
stream of that request's own ``DeviceSampler`` (lily/runtime/device_sampling.py; the
stream is lily/runtime/draws.py's): the draws of a seeded request are the same numbered
draws whether it runs alone or in a batch.
Graph-safe: every per-request value sits in row r of a device tensor, so the runner
captures the draw in the batched step's graph; the ops a draw runs (``Structure``) are
the union over the rows, each op left neutral where a row does not ask for it (penalties
of 1 and 0 leave the logits bit-identical, a top-k of V, a top-p of 2 and a min-p log of
-inf mask nothing, greedy rows take the penalized logits' argmax).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from lily.runtime.device_sampling import Structure
from lily.runtime.draws import as_i64, perturbed, token_lanes
from lily.runtime.sampling import SamplingParams, mark_seen, penalize


def union(structures: Sequence[Structure]) -> Structure:
    """The ops a draw over rows with these structures runs."""
    return Structure(all(s.greedy for s in structures), any(s.penalties for s in structures),
                     any(s.top_k for s in structures), any(s.top_p for s in structures),
                     any(s.min_p for s in structures))  # fmt: skip


class RowsSampler:
    """Device draws for up to ``rows`` requests at once (see the module docstring)."""

    def __init__(self, rows: int, vocab_size: int, device: torch.device | str):
        self.rows, self.vocab_size = rows, vocab_size
        dev = torch.device(device)

        def col(dtype: torch.dtype, fill) -> torch.Tensor:
            return torch.full((rows, 1), fill, dtype=dtype, device=dev)

        f32 = torch.float32
        self.temperature, self.top_k = col(f32, 1.0), col(torch.long, vocab_size)
        self.top_p, self.log_min_p = col(f32, 2.0), col(f32, -math.inf)
        self.repetition, self.presence, self.frequency = col(f32, 1.0), col(f32, 0.0), col(f32, 0)
        self.seed, self.step = col(torch.long, 0), col(torch.long, 0)
        self.greedy = col(torch.bool, True)
        self.seen = torch.zeros(rows, vocab_size, dtype=torch.bool, device=dev)
        self.counts = torch.zeros(rows, vocab_size, dtype=f32, device=dev)
        self.lanes = token_lanes(vocab_size, dev)
        self.structures = [Structure(True, False, False, False, False)] * rows
        self.owners: list = [None] * rows

    def load(self, r: int, owner, params: SamplingParams, prompt_ids: Sequence[int],
             generated: Sequence[int]) -> None:  # fmt: skip
        """Row ``r`` draws for a request (``owner``: any key naming the request and its draw
        count; a row that already holds it is left as it is) that drew ``generated``
        before, as ``DeviceSampler.load(params, prompt_ids, generated)``."""
        if self.owners[r] == owner:
            return
        v = self.vocab_size
        s = self.structures[r] = Structure.of(params, v)
        self.temperature[r].fill_(1.0 if s.greedy else params.temperature)
        self.top_k[r].fill_(params.top_k if s.top_k else v)
        self.top_p[r].fill_(params.top_p if s.top_p else 2.0)
        self.log_min_p[r].fill_(math.log(params.min_p) if s.min_p else -math.inf)
        self.repetition[r].fill_(params.repetition_penalty)
        self.presence[r].fill_(params.presence_penalty)
        self.frequency[r].fill_(params.frequency_penalty)
        self.seed[r].fill_(as_i64(params.seed))
        self.step[r].fill_(len(generated))
        self.greedy[r].fill_(s.greedy)
        self.seen[r].zero_()
        self.counts[r].zero_()
        if s.penalties:
            mark_seen(self.seen[r], prompt_ids)
            if generated:
                mark_seen(self.seen[r], generated)
                ids = torch.as_tensor(list(generated), dtype=torch.long, device=self.seen.device)
                self.counts[r].index_add_(0, ids, torch.ones(len(ids), device=ids.device))
        self.owners[r] = owner

    def clear(self) -> None:
        """No row holds a request any more: the next ``load`` of each row loads it."""
        self.owners = [None] * self.rows

    def drawn(self, r: int, owner) -> None:
        """Row ``r`` made a draw: its owner key moves on (the request's count with it)."""
        self.owners[r] = owner

    def structure(self, n: int) -> Structure:
        """The ops a draw over rows [0, n) runs (part of a captured graph's key)."""
        return union(self.structures[:n])

    def sample_into(self, logits: torch.Tensor, out: torch.Tensor, s: Structure) -> None:
        """Row r's next id from ``logits`` (B, V) into ``out[r]`` (-1: nothing finite to
        draw), recorded for its penalties; graph-safe."""
        n = logits.shape[0]
        x = logits.float()
        if s.penalties:
            x = penalize(x, self.seen[:n], self.counts[:n], self.repetition[:n],
                         self.frequency[:n], self.presence[:n])  # fmt: skip
        if not s.greedy:
            # Gumbel-max, as DeviceSampler.sample_into; greedy rows keep the plain argmax
            w = perturbed(self._warp(x, n, s), self.seed[:n], self.step[:n], self.lanes)
            x = torch.where(self.greedy[:n], x, w)
        best = torch.argmax(x, dim=-1, keepdim=True)
        tok = torch.where(torch.isfinite(x.gather(1, best)), best, -1)
        out.copy_(tok.view(-1))
        if s.penalties:
            idx, ok = tok.clamp_min(0), tok >= 0
            seen = self.seen[:n]
            seen.scatter_(1, idx, seen.gather(1, idx) | ok)
            self.counts[:n].scatter_add_(1, idx, ok.float())
        self.step[:n].add_(1)

    def _warp(self, x: torch.Tensor, n: int, s: Structure) -> torch.Tensor:
        """``DeviceSampler.warp`` row by row (one sort serves top-k and top-p)."""
        x = x / self.temperature[:n]
        if s.top_k or s.top_p:
            sorted_x, order = torch.sort(x, dim=-1, descending=True)
            if s.top_k:
                kth = sorted_x.gather(1, self.top_k[:n] - 1)
                x = x.masked_fill(x < kth, -math.inf)  # NOTE: ties with the k-th are kept
                sorted_x = sorted_x.masked_fill(sorted_x < kth, -math.inf)
            if s.top_p:
                probs = torch.softmax(sorted_x, dim=-1)
                drop = torch.cumsum(probs, dim=-1) - probs >= self.top_p[:n]
                drop[:, :1].fill_(False)  # the most likely token always stays
                x = x.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), -math.inf)
        if s.min_p:
            x = x.masked_fill(x < x.max(dim=-1, keepdim=True).values + self.log_min_p[:n],
                              -math.inf)  # fmt: skip
        return x

    def snapshot(self) -> tuple[torch.Tensor, ...]:
        """Copies of what a draw changes (a graph's warm-up run must leave no trace)."""
        return self.step.clone(), self.seen.clone(), self.counts.clone()

    def restore(self, snap: tuple[torch.Tensor, ...]) -> None:
        for t, saved in zip((self.step, self.seen, self.counts), snap, strict=True):
            t.copy_(saved)
