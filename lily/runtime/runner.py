"""The runner: prefill chunks, decode steps and CUDA-graph capture over the one model.

It owns the scheduling of a session state: it grows the KV caches before a forward, and it
alone advances ``state.length`` and ``state.tokens``. The model (lily/model/model.py)
decides which kernels run; the runner only chooses between a prefill chunk and a decode
step. On a CUDA device with the kernels, a decode step is one replay of a graph captured per
context bucket (powers of two, so attention's grid fits the context and long contexts take
the split-KV kernel); with device sampling the graph also draws the next token into its own
input buffer, so a step needs nothing from the host but its position.
"""

from __future__ import annotations

import contextlib
import gc

import torch

from lily.model.model import Model, Rows
from lily.model.ops import MAX_ROWS
from lily.runtime.device_decode import DeviceDecode
from lily.runtime.rows import RowBuffers, RowsSent, graph_key
from lily.runtime.rows_sampling import RowsSampler
from lily.runtime.sampling import SamplingParams
from lily.runtime.state import DeltaNetState
from lily.transfer import to_device

MIN_BUCKET = 4096  # the smallest context a decode graph is captured for
MAX_SINGLE_GRAPHS = 32  # single-sequence graphs kept (about 1 MB of logits each)
SCORE_ROWS = 2048  # lm_head rows at a time when scoring (fp32 logits of 2048 x V: 2 GB)
_NEUTRAL = SamplingParams(temperature=0.0, seed=0)  # a batched row drawn on the host


@contextlib.contextmanager
def no_gc():
    """Python's cyclic collector off while a prefill is enqueued.

    NOTE: the host enqueues a reused turn's ~800 launches barely ahead of the GPU (28-32 ms
    against 45 ms of kernels, less at the start), so a collector pass in the middle shows
    up as idle GPU time (lily/bench/gpu/diagnostics/timeline.py: 1.9 ms of gaps over
    20 us). The launches make tuples, not cycles: nothing is left for the collector that
    refcounting misses."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def context_bucket(start: int, capacity: int) -> int:
    """The context bound a decode step at ``start`` is captured for (its graph's key): a
    power of two from MIN_BUCKET, capped at the KV ``capacity``."""
    b = MIN_BUCKET
    while b < start + 1:
        b *= 2
    return min(b, capacity)


class Runner:
    """Chunked prefill and decode of one session state at a time over ``model``.

    ``chunk``: prefill tokens per forward. ``use_graphs``: replay decode steps from CUDA
    graphs (where the model is ``capturable``: the kernels on a CUDA device).
    ``sample_on_device`` (default: with the kernels): the next token is drawn on the device
    (``decode_sampled``).
    """

    def __init__(self, model: Model, chunk: int, use_graphs: bool = True,
                 sample_on_device: bool | None = None):  # fmt: skip
        self.model = model
        self.chunk = max(1, chunk)
        self.dev = model.device
        self.use_graphs = use_graphs and model.capturable
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # NOTE: one memory pool for every captured step (each had its own, up to 17, each the
        # size of a step's temporaries). Safe because steps replay one at a time on one
        # stream and a step's output is read (decode clones it) before another step replays.
        self.graph_pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self.row_buffers: dict[int, RowBuffers] = {}  # a batched step's inputs, per size
        self.tok = torch.zeros(1, dtype=torch.long, device=self.dev)
        self.pos = torch.zeros(1, dtype=torch.int32, device=self.dev)
        if sample_on_device is None:
            sample_on_device = model.kernels
        # Draws write self.tok: the graph's own input for the next step.
        self.device_decode = (DeviceDecode(self.tok, model.cfg.vocab_size)
                              if sample_on_device else None)  # fmt: skip
        # A batched step's draws, one row per sequence (decode_rows_drawn).
        self.rows_sampler = (RowsSampler(MAX_ROWS, model.cfg.vocab_size, self.dev)
                             if sample_on_device else None)  # fmt: skip

    # ---- prefill
    def prefill(self, ids: list[int], state) -> torch.Tensor:
        """Consume ``ids`` at ``state.length`` in chunks; logits (V,) of the last."""
        return self.prefill_snapshots(ids, state, [])[0]

    def prefill_snapshots(
        self, ids: list[int], state, points: list[int]
    ) -> tuple[torch.Tensor, dict[int, dict]]:
        """Chunked prefill; the DeltaNet states at absolute positions ``points`` (inside
        ``ids``' span or at its end) are copied out, mid-chunk where they fall there."""
        logits, snaps = None, {}
        with torch.inference_mode(), no_gc():
            for i in range(0, len(ids), self.chunk):
                part = ids[i : i + self.chunk]
                start, end = self._begin(state, len(part))
                cuts = tuple(p - start for p in points if start < p < end)
                t = to_device(part, torch.long, self.dev)
                logits, got = self.model.forward(t, state, start, end, cuts=cuts)
                for c, layers in got.items():
                    snaps[start + c] = {i: DeltaNetState(*s) for i, s in layers.items()}
                self._end(state, part)
                if end in points:  # a point on a chunk boundary
                    snaps[end] = state.snapshot_recurrent()
        if logits is None:
            raise ValueError("prefill needs at least one token")
        return logits, snaps

    def score(self, ids: list[int], state) -> torch.Tensor:
        """Teacher-forced fp32 logits (T, V) on the CPU for every position of ``ids``,
        consumed at ``state.length`` in chunks as a prefill does."""
        out = []
        with torch.inference_mode(), no_gc():
            for i in range(0, len(ids), self.chunk):
                part = ids[i : i + self.chunk]
                start, end = self._begin(state, len(part))
                x, _ = self.model.run(to_device(part, torch.long, self.dev), state, start, end)
                out += [self.model.head(x[r : r + SCORE_ROWS]).cpu()
                        for r in range(0, len(part), SCORE_ROWS)]  # fmt: skip
                self._end(state, part)
        return torch.cat(out)

    def _begin(self, state, n: int) -> tuple[int, int]:
        start = state.length
        end = start + n
        if end > state.limit:
            raise ValueError(f"context of {end} tokens exceeds the limit of {state.limit}")
        for c in state.kv.values():
            c.ensure(end)
        state.busy = True
        return start, end

    def _end(self, state, ids: list[int]) -> None:
        state.length += len(ids)
        state.tokens.extend(ids)
        state.busy = False

    # ---- decode
    def decode(self, token_id: int, state) -> torch.Tensor:
        """Consume ``token_id`` at ``state.length``; logits (V,) of the next."""
        self.tok.fill_(token_id)
        with torch.inference_mode():
            # NOTE: a graph writes the same buffer every step; hand out a copy so a caller
            # may keep logits across steps (1 MB, about a microsecond).
            out = self._advance(state, sampled=False).clone()
        self.consumed(state, token_id)
        return out

    def decode_rows(self, token_ids: list[int], states: list) -> torch.Tensor:
        """One decode step of B sequences at once: consume ``token_ids[r]`` at
        ``states[r].length`` for every row r; fp32 logits (B, V) of each row's next token
        (with graphs, a buffer the next step overwrites: read it first). One row takes the
        single-sequence step (``decode``: its graphs). With the kernels every mixer runs
        once for all rows over tables of their buffers (lily/runtime/rows.py), and with
        graphs the step is one replay of a graph captured per batch size and context bucket
        (whichever sequences fill the rows)."""
        if len(token_ids) != len(states) or not states:
            raise ValueError(f"{len(token_ids)} tokens for {len(states)} states")
        if len(states) == 1:
            return self.decode(token_ids[0], states[0])[None]
        return self._rows_step(token_ids, states, None)[0]

    def decode_rows_drawn(self, token_ids: list[int], states: list,
                          loads: list) -> tuple[torch.Tensor, list[int]]:  # fmt: skip
        """``decode_rows`` (B >= 2) with every row's next token drawn in the same step by
        ``rows_sampler`` (in the batched graph, one copy to the host): ``loads[r]`` is
        (owner, params, prompt, generated) of a row drawn on the device (owner: the request
        and its draw count, e.g. (id, len(generated))), None for a row sampled on the host
        from the logits (its draw means nothing). Returns the logits and the drawn ids
        (-1 where nothing was sampleable)."""
        sent = self.launch_rows(token_ids, states, loads)
        return sent.logits, self.recv_rows(sent)

    def launch_rows(self, token_ids: list[int], states: list, loads: list) -> RowsSent:
        """``decode_rows_drawn`` without waiting: the draws' copy to the host is started,
        ``recv_rows`` reads them. The draws are also the input of ``launch_rows_ahead``."""
        if not 2 <= len(states) == len(token_ids) == len(loads):
            raise ValueError(f"{len(token_ids)} tokens, {len(states)} states, {len(loads)} "
                             "loads: at least two rows, one of each per row")  # fmt: skip
        rs = self.rows_sampler
        for r, ld in enumerate(loads):
            if ld is None:
                rs.load(r, None, _NEUTRAL, (), ())
            else:
                rs.load(r, *ld)
        logits, buf = self._rows_step(token_ids, states, rs.structure(len(states)))
        return self._sent(buf, logits)

    def launch_rows_ahead(self, states: list) -> RowsSent:
        """The next step of the rows of the last ``launch_rows``(``_ahead``), before the
        host has read that step's draws: it consumes them on the device (the states
        advance and stay ``busy``; the loop hands each id to ``consumed`` once read) and
        draws the next."""
        logits, buf = self._rows_step(None, states, self.rows_sampler.structure(len(states)))
        return self._sent(buf, logits)

    def recv_rows(self, sent: RowsSent) -> list[int]:
        """The ids a launched batched step drew (-1: nothing sampleable), waiting for it."""
        return sent.buf.recv(sent.slot)

    def _sent(self, buf: RowBuffers, logits: torch.Tensor) -> RowsSent:
        rs = self.rows_sampler
        for r in range(buf.n):  # every loaded row made one draw more
            if rs.owners[r] is not None:
                owner, count = rs.owners[r]
                rs.drawn(r, (owner, count + 1))
        return RowsSent(buf, buf.send(), logits)

    def _rows_step(self, token_ids: list[int] | None, states: list, draw) -> tuple:
        """The batched step (``draw``: the rows sampler's Structure, or None: no draws) on
        ``token_ids``, or (None) on the ids the last step drew; the logits and the row
        buffers."""
        starts = [self._begin(s, 1)[0] for s in states]
        bound = max(self._bucket(p, s) for p, s in zip(starts, states, strict=True))
        buf = self._row_buffers(len(states))
        with torch.inference_mode():
            rows = buf.rows(states) if self.model.kernels else Rows(states)
            buf.load(token_ids, starts)
            pos = buf.pos if self.model.kernels else starts
            if self.use_graphs:
                graph, logits = self._rows_graph(buf, rows, bound, draw)
                graph.replay()
            else:
                logits = self._rows_forward(rows, buf.ids, pos, bound, buf, draw)
        for s, p in zip(states, starts, strict=True):
            s.length = p + 1
        if token_ids is not None:
            for s, t in zip(states, token_ids, strict=True):
                self.consumed(s, t)
        return logits, buf

    def _rows_forward(self, rows: Rows, ids, pos, bound: int, buf: RowBuffers, draw):
        logits, _ = self.model.forward(ids, rows, pos, bound, step=True)
        if draw is not None:
            self.rows_sampler.sample_into(logits, buf.drawn, draw)
            # the next step's input (a failed draw, -1, reaches the host; the step
            # already queued behind it must still embed a valid id)
            buf.ids.copy_(buf.drawn.clamp_min(0))
        return logits

    def forget_rows(self) -> None:
        """Let go of the states the batched steps last ran (a warm-up's scratch states):
        the next step rewrites its tables and reloads every row's sampler."""
        for buf in self.row_buffers.values():
            buf.forget()
        if self.rows_sampler is not None:
            self.rows_sampler.clear()

    def _row_buffers(self, n: int) -> RowBuffers:
        buf = self.row_buffers.get(n)
        if buf is None:
            buf = self.row_buffers[n] = RowBuffers(self.model.cfg, n, self.dev)
        return buf

    def _rows_graph(self, buf: RowBuffers, rows: Rows, bound: int, draw):
        """The captured batched step for ``buf``'s batch size, the context ``bound`` and
        the draw's structure."""
        key = ("rows", buf.n, bound, draw)
        if key not in self.graphs:
            states = rows.states
            snaps = [s.snapshot_recurrent() for s in states]
            drawn = self.rows_sampler.snapshot() if draw is not None else None

            logits = buf.logits_buffer(self.model.cfg.vocab_size)

            def step():
                pos = buf.pos if self.model.kernels else [s.length for s in states]
                # NOTE: into the batch size's one logits buffer, shared by its graphs: a
                # graph then keeps none of its own (the memory plan's figure holds).
                return logits.copy_(self._rows_forward(rows, buf.ids, pos, bound, buf, draw))

            def put_back():
                for s, snap in zip(states, snaps, strict=True):
                    s.restore(snap, s.length)
                if drawn is not None:
                    self.rows_sampler.restore(drawn)

            # Warm up outside the graph (compiles, allocator pools), put the states back.
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                step()
            torch.cuda.current_stream().wait_stream(side)
            put_back()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.graph_pool):
                out = step()
            put_back()
            self.graphs[key] = (graph, out)
        return self.graphs[key]

    def decode_sampled(self, state) -> None:
        """One step whose input is the last draw of ``device_decode``, already on the
        device: consume it at ``state.length``, draw the next, start its copy to the host.

        NOTE: ``state.length`` advances and ``state.busy`` stays set, but the consumed id is
        not in ``state.tokens`` yet (the host does not know it): the loop passes it to
        ``consumed`` once it has read the draw.
        """
        self._advance(state, sampled=True)
        self.device_decode.send()

    def consumed(self, state, token_id: int) -> None:
        """Record the id a ``decode_sampled`` step consumed (read from the host side)."""
        state.tokens.append(token_id)
        state.busy = False

    def _advance(self, state, sampled: bool) -> torch.Tensor:
        """One step on the id in ``self.tok`` at ``state.length``, eager or replayed; the
        length advances and ``state.busy`` stays set for the caller to clear."""
        start, _ = self._begin(state, 1)
        with torch.inference_mode():
            if self.use_graphs:
                graph, out = self._graph(state, start, sampled)
                self.pos.fill_(start)
                graph.replay()
            else:
                self.pos.fill_(start)
                pos = self.pos if self.model.kernels else start
                out = self._step(state, pos, self._bucket(start, state), sampled)
        state.length = start + 1
        return out

    def _step(self, state, pos, bucket: int, sampled: bool) -> torch.Tensor:
        """The decode step on ``self.tok`` at ``pos``; with ``sampled`` it also draws the
        next token into ``self.tok`` (and the ring). Graph-safe with the kernels."""
        logits, _ = self.model.forward(self.tok, state, pos, bucket, step=True)
        if sampled:
            self.device_decode.draw(logits)
        return logits

    def _bucket(self, start: int, state) -> int:
        cap = min(c.capacity for c in state.kv.values()) if state.kv else start + 1
        return context_bucket(start, cap)

    def _graph(self, state, start: int, sampled: bool = False):
        """The captured step for this state's buffers and context bucket (with ``sampled``,
        for the sampler's current structure)."""
        bucket = self._bucket(start, state)
        key = (bucket, graph_key(state))
        dd = self.device_decode
        if sampled:
            key += dd.ident()
        if key not in self.graphs:
            # One working state per request running at once (lily/runtime/engine.py), each
            # with its own buffers: keep the most recent single-sequence graphs of several
            # (a state freed and made again leaves dead ones, the oldest go first).
            single = [k for k in self.graphs if k[0] != "rows"]  # (batched ones live on)
            for k in single[: max(0, len(single) - MAX_SINGLE_GRAPHS)]:
                del self.graphs[k]
            # Warm up outside the graph (compiles kernels, allocator pools), then put back
            # what it changed: the DeltaNet states, and the token and sampler counters.
            snap = state.snapshot_recurrent()
            drawn = dd.snapshot() if sampled else None
            self.pos.fill_(start)
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                self._step(state, self.pos, bucket, sampled)
            torch.cuda.current_stream().wait_stream(s)
            if sampled:
                dd.restore(drawn)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.graph_pool):
                out = self._step(state, self.pos, bucket, sampled)
            state.restore(snap, state.length)
            self.graphs[key] = (graph, out)
        return self.graphs[key]
