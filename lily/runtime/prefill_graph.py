"""Short prefill chunks replayed from CUDA graphs that serve any state.

A prompt of a few hundred tokens costs the GPU about 10-15 ms, but the host took 25-50 ms
to enqueue its ~580 launches (lily/bench/gpu/diagnostics/host_time.py): short prompts were
host-bound. Here a chunk of up to ``MAX_TOKENS`` tokens is one graph replay.

What a replay needs from the host is one copy of a small int64 buffer (``Staging``):
- the chunk's ids, padded with id 0 up to its bucket (``BUCKETS``): the padding rows run
  through every layer and are dropped; the DeltaNet kernels give them g = 0 and beta = 0,
  so they leave the states as they are; attention writes their K/V after the chunk's
  tokens (positions past the state's length, never read before they are rewritten) and
  not past the cache; the logits are those of the last token row, an index on the device;
- the start position, the token count and the snapshot cut (0: none);
- every layer's buffers by address: K and V caches and their capacity, DeltaNet conv and
  recurrent states and where their snapshots at the cut go.
The kernels read those values on the device (their table mode), so a graph is keyed only
by the bucket and the context bucket (for which attention's key split is chosen), never by
a state: a new session, a grown cache or a resumed conversation replays the same graphs.

A chunk with several snapshot cuts is replayed in pieces split at all cuts but the last;
the last is taken inside the DeltaNet kernels. The first chunk of each key runs eagerly on
the staged buffers (the real work, and the kernels' compiles), then the graph is captured
(capture launches nothing).
"""

from __future__ import annotations

import array
from dataclasses import dataclass

import torch

from lily.model.model import Model
from lily.runtime.state import DeltaNetState

Tensor = torch.Tensor

# Chunk lengths a graph is captured for (a chunk is padded to the next one). Up to about
# 1K tokens the host's enqueue (25-30 ms) is at or above the GPU's time; steps of 1.5x
# keep the padding under a third of a chunk.
BUCKETS = (16, 32, 64, 128, 192, 256, 384, 512, 768, 1024)
MAX_TOKENS = BUCKETS[-1]
MIN_CONTEXT = 4096  # the smallest context bucket (powers of four from here)
MAX_GRAPHS = 40  # every (bucket, context bucket) up to 256K; the oldest goes first
HEAD = 8  # staging slots before the layers: start, token rows, last row, spare
ROW = 6  # staging slots per layer (see TableKV, TableDeltaNet)


def bucket(n: int) -> int:
    """The padded length of a chunk of ``n`` tokens (1 <= n <= MAX_TOKENS)."""
    for b in BUCKETS:
        if n <= b:
            return b
    raise ValueError(f"a graph chunk holds at most {MAX_TOKENS} tokens, got {n}")


def context_bucket(end: int) -> int:
    """The context bucket of a chunk ending at ``end``: the power of four from MIN_CONTEXT
    that holds it (attention splits its keys for half of it; a split chosen for up to 2x
    the keys a chunk sees, or half, costs little: bench/results/attn_split_h200.json)."""
    b = MIN_CONTEXT
    while b < end:
        b *= 4
    return b


@dataclass(frozen=True)
class TableKV:
    """An attention layer for a graph: ``k``, ``v`` give dtype and head shape only;
    ``table`` (3 slots of the staging buffer) names K, V and their capacity."""

    k: Tensor
    v: Tensor
    table: Tensor


@dataclass(frozen=True)
class TableDeltaNet:
    """A DeltaNet layer for a graph: ``conv``, ``recurrent`` give shapes and dtypes only;
    ``table`` (6 slots) names the conv state, the recurrent state, their snapshots at the
    cut, and holds the token rows and the cut (lily/ops/deltanet_prefill.py)."""

    conv: Tensor
    recurrent: Tensor
    table: Tensor


@dataclass(frozen=True)
class TableState:
    """What the Model reads of a state (``kv``, ``deltanet`` by layer), for a graph."""

    kv: dict[int, TableKV]
    deltanet: dict[int, TableDeltaNet]


def _proto(shape: tuple[int, ...], dtype: torch.dtype, device) -> Tensor:
    return torch.zeros(1, dtype=dtype, device=device).expand(*shape)


class Staging:
    """The int64 device buffer a replay reads, its views, and the host side that fills it."""

    def __init__(self, model: Model):
        cfg, dev = model.cfg, model.device
        self.layers = cfg.num_hidden_layers
        self.ids_at = HEAD + ROW * self.layers
        self.buf = torch.zeros(self.ids_at + MAX_TOKENS, dtype=torch.int64, device=dev)
        self.start = self.buf[0:1]
        self.last = self.buf[2:3]
        hkv, dh = cfg.num_key_value_heads, cfg.head_dim
        conv = (cfg.linear_conv_kernel_dim - 1, cfg.conv_dim)
        rec = (cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim)
        self.kv_shape, self.conv_shape, self.rec_shape = (hkv, dh), conv, rec
        self.dtype = model.dtype
        row = lambda i, n: self.buf[HEAD + ROW * i : HEAD + ROW * i + n]  # noqa: E731
        kv_proto = _proto((hkv, 1, dh), model.dtype, dev)
        conv_proto, rec_proto = _proto(conv, model.dtype, dev), _proto(rec, torch.float32, dev)
        self.state = TableState(
            kv={i: TableKV(kv_proto, kv_proto, row(i, 3)) for i in cfg.attn_layers},
            deltanet={
                i: TableDeltaNet(conv_proto, rec_proto, row(i, 6)) for i in cfg.linear_layers
            },
        )

    def ids(self, rows: int) -> Tensor:
        return self.buf[self.ids_at : self.ids_at + rows]

    def fill(self, ids: list[int], rows: int, state, start: int, cut: int) -> dict | None:
        """Stage a chunk of ``ids`` padded to ``rows`` at ``start`` of ``state`` with a
        snapshot after ``cut`` tokens (0: none); returns that snapshot's tensors (written
        by the replay) as ``{layer: DeltaNetState}``, or None."""
        n = len(ids)
        snap = self._snapshot(state) if cut else None
        vals = [start, n, n - 1, 0, 0, 0, 0, 0]
        kv, dn, dt = state.kv, state.deltanet, self.dtype
        for i in range(self.layers):
            c = kv.get(i)
            if c is not None:
                k, v = c.k, c.v
                _check(k, (k.shape[0], k.shape[2]), self.kv_shape, dt)
                _check(v, (v.shape[0], v.shape[2]), self.kv_shape, dt)
                vals += (k.data_ptr(), v.data_ptr(), k.shape[1], 0, 0, 0)
            else:
                s = dn[i]
                _check(s.conv, s.conv.shape, self.conv_shape, dt)
                _check(s.recurrent, s.recurrent.shape, self.rec_shape, torch.float32)
                sc, sr = (snap[i].conv.data_ptr(), snap[i].recurrent.data_ptr()) if snap else (0, 0)
                vals += (s.conv.data_ptr(), s.recurrent.data_ptr(), sc, sr, n, cut)
        vals += ids
        vals += [0] * (rows - n)  # the padding's id
        host = torch.frombuffer(array.array("q", vals), dtype=torch.int64)
        if self.buf.is_cuda:
            # NOTE: a pinned copy does not wait for the queued work (lily/transfer.py); the
            # caching host allocator keeps the block until the copy has run.
            host = host.pin_memory()
        self.buf[: len(vals)].copy_(host, non_blocking=True)
        return snap

    def _snapshot(self, state) -> dict[int, DeltaNetState]:
        """Fresh tensors for the DeltaNet states at the cut (two allocations, views per
        layer: the kernels write them, the prefix cache keeps them)."""
        layers = sorted(state.deltanet)
        one = state.deltanet[layers[0]]
        dev = one.conv.device
        conv = torch.empty((len(layers), *self.conv_shape), dtype=one.conv.dtype, device=dev)
        rec = torch.empty((len(layers), *self.rec_shape), dtype=torch.float32, device=dev)
        return {i: DeltaNetState(conv[j], rec[j]) for j, i in enumerate(layers)}


def _check(t: Tensor, shape: torch.Size | tuple, want: tuple, dtype: torch.dtype) -> None:
    """A buffer a table names must be what the kernels assume: contiguous, of the model's
    dtype and shape (a cache's capacity aside)."""
    if not (t.dtype == dtype and tuple(shape) == want and t.is_contiguous()):
        raise ValueError(f"prefill graph: a state buffer {tuple(t.shape)} {t.dtype} is not "
                         f"a contiguous {want} {dtype} buffer")  # fmt: skip


class PrefillGraphs:
    """Chunks of up to MAX_TOKENS tokens on the staged buffers: replayed from a graph per
    (bucket, context bucket) with ``capture`` (graphs in ``pool``, shared with the decode
    graphs), else run eagerly the same way (what the CPU tests check)."""

    def __init__(self, model: Model, pool=None, capture: bool = True):
        self.model = model
        self.pool = pool
        self.capture = capture
        self.staging = Staging(model)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        # NOTE: every graph copies its logits here (one buffer, not one per graph)
        self.out = torch.empty(model.cfg.vocab_size, dtype=torch.float32, device=model.device)

    def run(self, ids: list[int], state, start: int, cut: int = 0) -> tuple[Tensor, dict | None]:
        """Logits (V,) of the last of ``ids`` consumed at ``start`` of ``state`` (whose caches
        hold start + len(ids) positions), and the DeltaNet states after the first ``cut``
        tokens (0 < cut < len(ids)) as ``{layer: DeltaNetState}``, else None. Advances the
        caches and states, not the state's length (the runner's)."""
        n = len(ids)
        if not 0 <= cut < n:
            raise ValueError(f"prefill graph: cut {cut} is not inside a chunk of {n} tokens")
        rows, ctx = bucket(n), context_bucket(start + n)
        snap = self.staging.fill(ids, rows, state, start, cut)
        key = (rows, ctx)
        graph = self.graphs.get(key)
        if graph is not None:
            graph.replay()
            # NOTE: every replay writes the same buffer: a copy is the caller's (1 MB, about
            # a microsecond).
            return self.out.clone(), snap
        logits = self._forward(rows, ctx)
        if self.capture:
            self._capture(key)
        return logits, snap

    def _forward(self, rows: int, ctx: int) -> Tensor:
        s = self.staging
        logits, _ = self.model.forward(s.ids(rows), s.state, s.start, ctx, last=s.last)
        return logits

    def _capture(self, key: tuple[int, int]) -> None:
        if len(self.graphs) >= MAX_GRAPHS:
            self.graphs.pop(next(iter(self.graphs)))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.out.copy_(self._forward(*key))
        self.graphs[key] = graph
