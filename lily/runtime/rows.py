"""What a batched decode step of B sequences reads on the device besides the weights: the
input ids, the positions, and per layer the table of each row's buffers (its K and V cache
and their capacity, or its DeltaNet conv and recurrent state) that the batched mixer
kernels read (lily/ops/attention_decode.py ``kv_table``, deltanet_decode.py
``state_table``).

One set per batch size B, allocated once: a CUDA graph captured over them stays valid for
any B sequences, whatever their caches; the tables are rewritten (one copy each) only when
the rows' buffers change (another sequence in a row, a cache grown).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lily.model.model import Rows
from lily.transfer import table_address, to_device


def graph_key(state) -> tuple:
    """What a captured step bakes in about the state: every buffer's address and the KV
    capacity (the attention kernels' row stride). A freed cache's address can come back
    with another capacity; replaying a graph captured for the old one would then read
    and write KV rows at the wrong stride."""
    key = tuple((c.k.data_ptr(), c.v.data_ptr(), tuple(c.k.shape)) for c in state.kv.values())
    return key + tuple((s.recurrent.data_ptr(), s.conv.data_ptr(), tuple(s.recurrent.shape))
                       for s in state.deltanet.values())  # fmt: skip


@dataclass(eq=False)
class RowsSent:
    """A launched batched step: its buffers, the host slot its draws are copied to, its
    logits (a buffer the next replay overwrites)."""

    buf: RowBuffers
    slot: int
    logits: torch.Tensor


class RowBuffers:
    """The device inputs of a batched step of ``n`` rows over a model's layers."""

    def __init__(self, cfg, n: int, device: torch.device):
        self.n = n
        self.ids = torch.zeros(n, dtype=torch.long, device=device)
        self.pos = torch.zeros(n, dtype=torch.int32, device=device)
        self.drawn = torch.zeros(n, dtype=torch.long, device=device)  # the rows' draws
        # Two host slots (a step's draws are read while the next step runs), one event each.
        cuda = torch.device(device).type == "cuda"
        self.host = torch.zeros(2, n, dtype=torch.long, pin_memory=cuda)
        self.events = [torch.cuda.Event() for _ in range(2)] if cuda else None
        self.sent = 0
        self.attn = list(cfg.attn_layers)
        self.linear = list(cfg.linear_layers)
        self.kv = torch.zeros(len(self.attn), n, 3, dtype=torch.int64, device=device)
        self.st = torch.zeros(len(self.linear), n, 2, dtype=torch.int64, device=device)
        self.tables = {i: self.kv[j] for j, i in enumerate(self.attn)}
        self.tables |= {i: self.st[j] for j, i in enumerate(self.linear)}
        self._key: tuple | None = None
        self._states: list = []
        self.logits: torch.Tensor | None = None  # the captured steps' output (logits_buffer)

    def rows(self, states: list) -> Rows:
        """``Rows`` of ``states`` over these tables (rewritten when their buffers moved)."""
        # NOTE: a state's DeltaNet tensors never move (restores copy into them), its KV
        # caches move when they grow; the states are held below, so an id is not reused.
        key = tuple((id(s), tuple(c.k.data_ptr() for c in s.kv.values())) for s in states)
        if key != self._key:
            kv = [[(table_address(s.kv[i].k, "rows"), table_address(s.kv[i].v, "rows"),
                    s.kv[i].capacity) for s in states] for i in self.attn]  # fmt: skip
            st = [[(table_address(s.deltanet[i].conv, "rows"),
                    table_address(s.deltanet[i].recurrent, "rows")) for s in states]
                  for i in self.linear]  # fmt: skip
            # NOTE: a replay already queued reads the old tables first (stream order)
            if self.attn:
                self._put(self.kv, [x for layer in kv for row in layer for x in row])
            if self.linear:
                self._put(self.st, [x for layer in st for row in layer for x in row])
            self._key, self._states = key, list(states)
        return Rows(states, self.tables)

    def forget(self) -> None:
        """Drop the states the tables name (the next ``rows`` rewrites them)."""
        self._key, self._states = None, []

    def logits_buffer(self, vocab_size: int) -> torch.Tensor:
        """The fp32 (n, V) logits every captured step of this batch size writes (one
        buffer for all their graphs: the next replay of any of them overwrites it)."""
        if self.logits is None:
            self.logits = torch.empty(self.n, vocab_size, dtype=torch.float32,
                                      device=self.ids.device)  # fmt: skip
        return self.logits

    def load(self, token_ids: list[int] | None, starts: list[int]) -> None:
        """The step's input ids (None: those the last step drew, already there) and
        positions (one copy each)."""
        if token_ids is not None:
            self._put(self.ids, token_ids)
        self._put(self.pos, starts)

    @staticmethod
    def _put(dst: torch.Tensor, values: list[int]) -> None:
        # NOTE: through pinned memory (lily/transfer.py): a copy from pageable memory would
        # wait for the device's queue, and the batch runs a step ahead of the host.
        dst.copy_(to_device(values, dst.dtype, dst.device).view(dst.shape))

    def send(self) -> int:
        """Start the copy of the step's draws to a host slot (after its launch); the slot."""
        slot = self.sent % 2
        self.sent += 1
        if self.events is None:
            self.host[slot].copy_(self.drawn)
        else:
            self.host[slot].copy_(self.drawn, non_blocking=True)
            self.events[slot].record()
        return slot

    def recv(self, slot: int) -> list[int]:
        """The draws copied to ``slot``, waiting for that copy alone."""
        if self.events is not None:
            self.events[slot].synchronize()
        return self.host[slot].tolist()
