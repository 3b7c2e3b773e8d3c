"""Decode where the next token is chosen on the device: the step's input-token buffer,
the runner's one device sampler, and a ring of sampled ids on their way to the host.

Each draw writes its id into the input buffer (the next step reads it there) and into
slot ``j % SLOTS`` of a device ring; ``send`` then starts that slot's copy into pinned host
memory and records an event, so the host waits for the one token it reads and nothing
else. Without CUDA the same calls run eagerly and ``recv`` reads the ring directly.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lily.runtime.device_sampling import DeviceSampler, check_token
from lily.runtime.sampling import SamplingParams

SLOTS = 8  # ids in flight at most; the loop runs one step ahead of the host


class DeviceDecode:
    """What a runner owns to decode from device-sampled tokens (one per runner: the
    tensors never move, so the graphs that captured them stay valid)."""

    def __init__(self, tok: torch.Tensor, vocab_size: int):
        self.tok = tok  # (1,) int64: the next step's input, written by every draw
        dev = tok.device
        self.sampler = DeviceSampler(vocab_size, dev)
        self.ring = torch.zeros(SLOTS, dtype=torch.long, device=dev)
        cuda = dev.type == "cuda"
        self.host = torch.zeros(SLOTS, dtype=torch.long, pin_memory=cuda)
        self.events = [torch.cuda.Event() for _ in range(SLOTS)] if cuda else None
        self.sent = 0  # draws of this request whose copy to the host has been started
        # Taken once: these tensors are only ever written in place (a key per step).
        self._addresses = (tok.data_ptr(), self.ring.data_ptr(), *self.sampler.ident())

    def ident(self) -> tuple:
        """What a captured draw bakes in: the sampler's structure and every address."""
        return self.sampler.structure, self._addresses

    def start(self, params: SamplingParams, prompt_ids: Sequence[int], logits: torch.Tensor):
        """Load a request and draw its first token from the prefill logits, eagerly."""
        with torch.inference_mode():
            self.sampler.load(params, prompt_ids)
            self.sent = 0
            self.draw(logits)
            self.send()

    def resume(self, params: SamplingParams, prompt_ids: Sequence[int],
               generated: Sequence[int]) -> None:  # fmt: skip
        """Load a request that already drew ``generated`` elsewhere (a batch), its last
        token not consumed yet: that token becomes the next step's input and the draws go
        on at number ``len(generated)``."""
        with torch.inference_mode():
            self.sampler.load(params, prompt_ids, generated)
            self.tok.fill_(generated[-1])
            self.sent = len(generated)

    def draw(self, logits: torch.Tensor) -> None:
        """Graph-safe: the next id into the ring and (kept a valid id) into ``tok``."""
        self.sampler.sample_into(logits, self.tok)
        slot = torch.remainder(self.sampler.step - 1, SLOTS)  # this draw's number mod SLOTS
        self.ring.index_copy_(0, slot, self.tok)
        # NOTE: a failed draw (-1) reaches the host through the ring; the step already
        # queued behind it must still embed a valid id, so the input gets 0 instead.
        self.tok.clamp_(min=0)

    def send(self) -> None:
        """Start the latest draw's trip to the host (after launching it, outside graphs)."""
        s = self.sent % SLOTS
        if self.events is not None:
            self.host[s : s + 1].copy_(self.ring[s : s + 1], non_blocking=True)
            self.events[s].record()
        self.sent += 1

    def recv(self, j: int) -> int:
        """Draw ``j`` of the request (0: from the prefill logits), waiting for it alone.
        Raises Sampler's ValueError when nothing was sampleable."""
        if not self.sent - SLOTS <= j < self.sent:
            raise IndexError(f"draw {j} is not in flight (sent {self.sent}, {SLOTS} slots)")
        s = j % SLOTS
        if self.events is None:
            return check_token(int(self.ring[s]))
        self.events[s].synchronize()
        return check_token(int(self.host[s]))

    def snapshot(self) -> tuple:
        """What a draw changes besides its ring slot (a warm-up run must leave no trace)."""
        return self.tok.clone(), self.sampler.snapshot()

    def restore(self, snap: tuple) -> None:
        tok, sampler = snap
        self.tok.copy_(tok)
        self.sampler.restore(sampler)
