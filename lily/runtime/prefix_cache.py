"""Multi-turn reuse: resume a new request from the saved state of an earlier one.

The 30 DeltaNet layers carry a recurrent state that cannot be rewound, so a KV prefix is
not enough: we keep snapshots of the DeltaNet states (conv and recurrent) at positions
where a later request is likely to diverge, and resume from the latest snapshot at or
before the point where the new prompt stops matching. Qwen's template drops earlier
reasoning, so a resent conversation matches only up to the last assistant header: the
start of every turn (each ``<|im_start|>``) in a prompt gets a snapshot.

Each working ``SessionState`` (one per request that ran at once, lily/runtime/engine.py)
is live: it holds the last conversation it ran, KV cache and state in place. A new request
takes the idle working state whose conversation it continues, else the least recently used
one, whose conversation is first copied out; stored conversations are kept as copies (KV
trimmed to their length, plus snapshots), least-recently-used first out, within a byte
budget; over the device budget they move to host memory, over the host budget they are
dropped. A request may also start from a snapshot of a state still running (a shared
system prompt): its KV prefix is copied, the state is never shared.
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


@dataclass(eq=False)
class Entry:
    """One conversation's reusable state: its tokens, KV (None while live), snapshots."""

    tokens: list[int]
    kv: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None
    deltanet: Snap | None = None  # state at len(tokens) (None while live)
    snaps: dict[int, Snap] = field(default_factory=dict)
    stamp: int = 0
    spilled: bool = False  # moved to host memory: counted against the host budget

    def nbytes(self) -> int:
        n = sum(_snap_bytes(s) for s in self.snaps.values())
        if self.kv is not None:
            n += sum(k.numel() * k.element_size() * 2 for k, _ in self.kv.values())
        if self.deltanet is not None:
            n += _snap_bytes(self.deltanet)
        return n

    def trim(self) -> bool:
        """Cut a stored entry back to its latest snapshot before its end, freeing the tail's
        KV; False when it has none left. A conversation squeezed out of the budget keeps
        its start (the shared system prompt) instead of being lost whole."""
        n = len(self.tokens)
        below = [p for p in self.snaps if p < n]
        if self.kv is None or not below:
            return False
        p = max(below)
        # NOTE: clones, not views: a view would keep the whole old buffer alive.
        self.kv = {i: (k[:, :p].clone(), v[:, :p].clone()) for i, (k, v) in self.kv.items()}
        self.tokens = self.tokens[:p]
        self.deltanet = self.snaps[p]
        self.snaps = {q: s for q, s in self.snaps.items() if q < p}
        return True


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
        self.lives: dict[int, tuple[SessionState, Entry]] = {}  # id(state) -> its conversation
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

    @property
    def live(self) -> Entry | None:
        """The conversation of the working state acquired last (None before any)."""
        if not self.lives:
            return None
        return max((e for _, e in self.lives.values()), key=lambda e: e.stamp)

    def acquire(self, prompt: list[int], state: SessionState) -> int:
        """Put the best saved state for ``prompt`` into ``state`` (the one working state);
        returns tokens reused."""
        return self.take(prompt, [state])[1]

    def take(self, prompt: list[int], idle: list[SessionState],
             running: list[SessionState] = ()) -> tuple[SessionState, int]:  # fmt: skip
        """Choose one of the ``idle`` working states for ``prompt`` and bring it to the best
        saved point: its own conversation where the prompt continues it (no copy), else a
        stored one or a snapshot of a ``running`` state loaded into the least recently used
        idle state (its conversation copied out first). Returns the state and the tokens
        reused."""
        self.queries += len(prompt)
        for st, e in self.lives.values():
            # NOTE: a live entry's tokens are its state's own list (kept current by the
            # forward), so its head is always the state's length.
            e.tokens = st.tokens
        mine = {id(s) for s in idle}
        best, best_r, src = None, 0, None
        for st, e in self.lives.values():
            if id(st) in mine:
                r = self.resume_point(e, prompt)
            elif any(st is x for x in running):
                r = self._snapshot_point(e, prompt)
            else:
                continue
            if r > best_r:
                best, best_r, src = e, r, st
        for e in self.stored:
            r = self.resume_point(e, prompt)
            if r > best_r:
                best, best_r, src = e, r, None
        # In place when the prompt continues the state's conversation; a rewind would cut
        # that conversation's tail, so with another idle state the prefix is copied instead.
        if src is not None and id(src) in mine and (best_r == src.length or len(idle) == 1):
            state = src
            if best_r < state.length:
                state.restore(best.snaps[best_r], best_r)
        else:
            state = self._victim([st for st in idle if st is not src])
            if best is not None and src is None:
                # NOTE: out of `stored` before the victim's copy goes in: storing evicts, and
                # the least recently used entry may be this very one.
                self.stored.remove(best)
            self._store_live(state)
            if best is None:
                state.restore(_zero_like(state.deltanet), 0)
                best = Entry(tokens=state.tokens)
            elif src is None:
                snap = self._load(best.kv, best, best_r, state)
                if best_r == len(best.tokens):
                    # Keep the point resumed from (often a trimmed entry's system-prompt end):
                    # the prefill saves only the new part's last turn start.
                    best.snaps[best_r] = snap
                best.kv, best.deltanet, best.spilled = None, None, False
            else:  # another state's snapshot: copied, that state is not touched
                kv = {i: (c.k, c.v) for i, c in src.kv.items()}
                snap = self._load(kv, best, best_r, state)
                best = Entry(tokens=state.tokens, snaps={best_r: snap})
            self.lives[id(state)] = (state, best)
        live = best
        live.tokens = state.tokens
        # (to the device: a spilled entry resumed brings its snapshots back from the host)
        live.snaps = {p: _snap_to(s, self.device) for p, s in live.snaps.items() if p <= best_r}
        live.stamp = next(self._clock)
        self.hits += best_r
        return state, best_r

    @staticmethod
    def _snapshot_point(entry: Entry, prompt: list[int]) -> int:
        """Latest snapshot of a running conversation at or before the divergence point."""
        limit = min(common_prefix(entry.tokens, prompt), len(prompt) - 1)
        return max((p for p in entry.snaps if p <= limit), default=0)

    def _victim(self, idle: list[SessionState]) -> SessionState:
        """The idle state to load into: one holding no conversation, else the least
        recently used."""
        for st in idle:
            if id(st) not in self.lives:
                return st
        return min(idle, key=lambda st: self.lives[id(st)][1].stamp)

    def release(self, state: SessionState) -> None:
        """Copy ``state``'s conversation out (within the budget); the state is given up."""
        self._store_live(state)

    def forget(self, state: SessionState) -> None:
        """Drop ``state``'s conversation (the state is being discarded)."""
        self.lives.pop(id(state), None)

    def _load(self, kv: dict, e: Entry, r: int, state: SessionState) -> Snap:
        """Restore ``e``'s first ``r`` tokens into ``state`` with KV from ``kv``; returns the
        snapshot used (on the device)."""
        snap = _snap_to(e.snaps[r] if r in e.snaps else e.deltanet, self.device)
        for i, (k, v) in kv.items():
            c = state.kv[i]
            c.ensure(r)
            c.k[:, :r].copy_(k[:, :r])
            c.v[:, :r].copy_(v[:, :r])
        state.tokens[:] = e.tokens[:r]
        state.restore(snap, r)
        return snap

    def _store_live(self, state: SessionState) -> None:
        """Copy the state's live conversation out before the state is reused."""
        live = self.lives.pop(id(state), (None, None))[1]
        if live is None or state.length == 0:
            return
        n = state.length if self.host_budget > 0 else _fitting_length(live, state, self.budget)
        if n == 0:  # not even its first snapshot fits the budget
            return
        live.tokens = list(state.tokens[:n])
        live.kv = {i: (c.k[:, :n].clone(), c.v[:, :n].clone()) for i, c in state.kv.items()}
        live.deltanet = state.snapshot_recurrent() if n == state.length else live.snaps[n]
        # (a prefill cancelled right at a snapshot leaves one at the end: `deltanet` is it)
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

    def save(self, pos: int, snap: Snap, state: SessionState | None = None) -> None:
        """Keep the DeltaNet state at ``pos`` of ``state``'s live conversation (default: the
        state acquired last)."""
        live = self.live if state is None else self.lives[id(state)][1]
        assert live is not None
        live.snaps[pos] = snap
        self.evict()

    # ---- budget
    def nbytes(self) -> int:
        """Bytes held in device memory (stored entries not spilled, live snapshots)."""
        return self._live_snap_bytes() + sum(e.nbytes() for e in self.stored if not e.spilled)

    def host_nbytes(self) -> int:
        """Bytes of the entries spilled to host memory."""
        return sum(e.nbytes() for e in self.stored if e.spilled)

    def evict(self) -> None:
        """Least recently used first: spill conversations to host memory (when it has a
        budget), else cut them back to an earlier snapshot, then drop them.

        On a CPU device the host tier is a second budget of the same memory (spilling
        moves nothing); it keeps one code path, tested without a GPU."""
        for e in sorted(self.stored, key=lambda e: e.stamp):
            if self.nbytes() <= self.budget:
                break
            if e.spilled:
                continue
            if self.host_budget > 0:
                _to_host(e)
            else:
                self._shrink(e, lambda: self.nbytes() > self.budget)
        for e in sorted((x for x in self.stored if x.spilled), key=lambda e: e.stamp):
            if self.host_nbytes() <= self.host_budget:
                break
            self._shrink(e, lambda: self.host_nbytes() > self.host_budget)
        # The live conversations' own snapshots: drop the oldest when still over budget
        # (least recently used conversation first).
        for _, live in sorted(self.lives.values(), key=lambda x: x[1].stamp):
            while len(live.snaps) > 1 and self.nbytes() > self.budget:
                del live.snaps[min(live.snaps)]

    def _shrink(self, e: Entry, over) -> None:
        """Trim ``e`` while ``over()``; drop it when nothing is left to trim."""
        while over():
            if not e.trim():
                self.stored.remove(e)
                return

    def _live_snap_bytes(self) -> int:
        return sum(_snap_bytes(s) for _, e in self.lives.values() for s in e.snaps.values())


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
    e.spilled = True
    e.kv = {i: (k.cpu(), v.cpu()) for i, (k, v) in e.kv.items()}
    e.deltanet = _snap_to(e.deltanet, "cpu")
    e.snaps = {p: _snap_to(s, "cpu") for p, s in e.snaps.items()}


def _zero_like(s: Snap) -> Snap:
    return {
        i: DeltaNetState(torch.zeros_like(t.conv), torch.zeros_like(t.recurrent))
        for i, t in s.items()
    }
