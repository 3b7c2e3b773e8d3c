"""Multi-turn reuse: resume a new request from the saved state of an earlier one.

The 30 DeltaNet layers carry a recurrent state that cannot be rewound, so a KV prefix is
not enough: we keep snapshots of the DeltaNet states (conv and recurrent) at positions
where a later request is likely to diverge, and resume from the latest snapshot at or
before the point where the new prompt stops matching. Qwen's template drops earlier
reasoning, so a resent conversation matches only up to the last assistant header: the
start of every turn (each ``<|im_start|>``) in a prompt gets a snapshot.

One working ``SessionState`` is live (it holds the last request's KV cache and state);
other conversations are kept as copies (KV trimmed to their length, plus snapshots),
least-recently-used first out, within a byte budget; over the device budget they move
to host memory, over the host budget they are dropped.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from lily.runtime.state import DeltaNetState, SessionState

Snap = dict[int, DeltaNetState]


def _snap_bytes(s: Snap) -> int:
    return sum(
        t.conv.numel() * t.conv.element_size() + t.recurrent.numel() * t.recurrent.element_size()
        for t in s.values()
    )


def _snap_to(s: Snap, device) -> Snap:
    return {i: DeltaNetState(t.conv.to(device), t.recurrent.to(device)) for i, t in s.items()}


@dataclass
class Entry:
    """One conversation's reusable state: its tokens, KV (None while live), snapshots."""

    tokens: list[int]
    kv: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None
    deltanet: Snap | None = None  # state at len(tokens) (None while live)
    snaps: dict[int, Snap] = field(default_factory=dict)
    stamp: int = 0

    def nbytes(self) -> int:
        n = sum(_snap_bytes(s) for s in self.snaps.values())
        if self.kv is not None:
            n += sum(k.numel() * k.element_size() * 2 for k, _ in self.kv.values())
        if self.deltanet is not None:
            n += _snap_bytes(self.deltanet)
        return n

    def on_host(self) -> bool:
        return self.kv is not None and any(k.device.type == "cpu" for k, _ in self.kv.values())


_BLOCK = 512  # tokens compared per list-slice equality (C speed) before the item loop


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists.

    A Python loop over a 17K-token conversation took about 1 ms of every reused turn's
    time to first token; whole blocks are compared as slices first, items only inside the
    block that differs."""
    n = min(len(a), len(b))
    i = 0
    while i + _BLOCK <= n and a[i : i + _BLOCK] == b[i : i + _BLOCK]:
        i += _BLOCK
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixCache:
    """Chooses where a prompt resumes and keeps states under ``budget_bytes``."""

    def __init__(self, budget_bytes: int, host_budget_bytes: int = 0, device="cpu"):
        self.budget = budget_bytes
        self.host_budget = host_budget_bytes
        self.device = torch.device(device)
        self.live: Entry | None = None
        self.stored: list[Entry] = []
        self._clock = itertools.count(1)
        self.queries = 0  # prompt tokens looked up
        self.hits = 0  # prompt tokens reused

    # ---- lookup
    @staticmethod
    def resume_point(entry: Entry, prompt: list[int]) -> int:
        """Latest saved position <= the divergence point, leaving >= 1 token to prefill."""
        limit = min(common_prefix(entry.tokens, prompt), len(prompt) - 1)
        points = [p for p in entry.snaps if p <= limit]
        if len(entry.tokens) <= limit:
            points.append(len(entry.tokens))
        return max(points, default=0)

    def acquire(self, prompt: list[int], state: SessionState) -> int:
        """Put the best saved state for ``prompt`` into ``state``; returns tokens reused."""
        self.queries += len(prompt)
        if self.live is not None:
            # NOTE: the live entry's tokens are the working state's own list (kept current
            # by the forward), so its head is always the state's length.
            self.live.tokens = state.tokens
        best, best_r = None, 0
        for e in ([self.live] if self.live else []) + self.stored:
            r = self.resume_point(e, prompt)
            if r > best_r:
                best, best_r = e, r
        if best is None:
            self._store_live(state)
            state.restore(_zero_like(state.deltanet), 0)
        elif best is self.live:
            if best_r < state.length:
                state.restore(self.live.snaps[best_r], best_r)
        else:
            self._store_live(state)
            self.stored.remove(best)
            self._load(best, best_r, state)
            best.kv, best.deltanet = None, None
            self.live = best
        if self.live is None or best is None:
            self.live = Entry(tokens=state.tokens)
        live = self.live
        live.tokens = state.tokens
        live.snaps = {p: s for p, s in live.snaps.items() if p <= best_r}
        live.stamp = next(self._clock)
        self.hits += best_r
        return best_r

    def _load(self, e: Entry, r: int, state: SessionState) -> None:
        snap = e.deltanet if r == len(e.tokens) else e.snaps[r]
        for i, (k, v) in e.kv.items():
            c = state.kv[i]
            c.ensure(r)
            c.k[:, :r].copy_(k[:, :r])
            c.v[:, :r].copy_(v[:, :r])
        state.tokens[:] = e.tokens[:r]
        state.restore(_snap_to(snap, self.device), r)

    def _store_live(self, state: SessionState) -> None:
        """Copy the live conversation out of the working state before it is reused."""
        live, self.live = self.live, None
        if live is None or state.length == 0:
            return
        n = state.length if self.host_budget > 0 else _fitting_length(live, state, self.budget)
        if n == 0:  # not even its first snapshot fits the budget
            return
        live.tokens = list(state.tokens[:n])
        live.kv = {i: (c.k[:, :n].clone(), c.v[:, :n].clone()) for i, c in state.kv.items()}
        live.deltanet = state.snapshot_recurrent() if n == state.length else live.snaps[n]
        live.snaps = {p: s for p, s in live.snaps.items() if p < n}
        self.stored.append(live)
        self.evict()

    # ---- saving during prefill
    @staticmethod
    def snapshot_points(prompt: list[int], start: int, boundary_ids: set[int]) -> list[int]:
        """Where to save the state in (start, len(prompt)): before the last turn start (the
        last assistant header of a chat prompt) and, for a prompt prefilled from scratch,
        before the first one (the end of the system prompt, which new conversations share).

        The next request of the conversation diverges at the last header (the template drops
        the reasoning of earlier assistant turns) or resumes at the end of this generation
        (the live state). Other turn starts in the new part would only serve an edited
        message, and each one split the DeltaNet recurrence of every layer once more: about
        4 ms of launches per reused turn."""
        at = [p for p in range(start + 1, len(prompt)) if prompt[p] in boundary_ids]
        if not at:
            return []
        return sorted({at[0], at[-1]}) if start == 0 else [at[-1]]

    def save(self, pos: int, snap: Snap) -> None:
        """Keep the DeltaNet state at ``pos`` of the live conversation."""
        assert self.live is not None
        self.live.snaps[pos] = snap
        self.evict()

    # ---- budget
    def nbytes(self) -> int:
        live = sum(_snap_bytes(s) for s in self.live.snaps.values()) if self.live else 0
        return live + sum(e.nbytes() for e in self.stored)

    def evict(self) -> None:
        """Move least-recently-used conversations to host memory, then drop them."""
        spill = self.device.type != "cpu" and self.host_budget > 0
        for e in sorted(self.stored, key=lambda e: e.stamp):
            dev = sum(x.nbytes() for x in self.stored if not (spill and x.on_host()))
            if dev + self._live_snap_bytes() <= self.budget:
                break
            if spill and not e.on_host():
                _to_host(e)
            elif not (spill and e.on_host()):
                self.stored.remove(e)
        if spill:
            for e in sorted((x for x in self.stored if x.on_host()), key=lambda e: e.stamp):
                if sum(x.nbytes() for x in self.stored if x.on_host()) <= self.host_budget:
                    break
                self.stored.remove(e)
        # The live conversation's own snapshots: drop the oldest when still over budget.
        while self.live and len(self.live.snaps) > 1 and self.nbytes() > self.budget:
            del self.live.snaps[min(self.live.snaps)]

    def _live_snap_bytes(self) -> int:
        return sum(_snap_bytes(s) for s in self.live.snaps.values()) if self.live else 0


def _fitting_length(live: Entry, state: SessionState, budget: int) -> int:
    """How much of the live conversation to copy out: all of it, else its latest snapshot
    whose copy fits ``budget`` on its own, else nothing (0).

    NOTE: copying a conversation the budget cannot hold, only for eviction to drop it, held
    a second KV cache on the device for a moment (2.5 GiB after a 128K prompt): on a card
    sized for one, an out-of-memory error at the next request."""
    per_pos = sum(c.k.shape[0] * c.k.shape[2] * c.k.element_size() * 2 for c in state.kv.values())
    states = _snap_bytes(state.deltanet)
    points = sorted((p for p in live.snaps if p < state.length), reverse=True)
    for n in (state.length, *points):
        held = sum(_snap_bytes(s) for p, s in live.snaps.items() if p < n)
        if per_pos * n + states + held <= budget:
            return n
    return 0


def _to_host(e: Entry) -> None:
    e.kv = {i: (k.cpu(), v.cpu()) for i, (k, v) in e.kv.items()}
    e.deltanet = _snap_to(e.deltanet, "cpu")
    e.snaps = {p: _snap_to(s, "cpu") for p, s in e.snaps.items()}


def _zero_like(s: Snap) -> Snap:
    return {
        i: DeltaNetState(torch.zeros_like(t.conv), torch.zeros_like(t.recurrent))
        for i, t in s.items()
    }
