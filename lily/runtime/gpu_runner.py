"""The GPU path: Triton kernels for every layer, decode steps replayed from CUDA graphs.

Same maths and state as the reference runner (lily/model); what changes is how it runs:
packed weights feed fused-dequant GEMV/GEMM kernels, routing stays on the GPU, and a
decode step is one graph replay. Graphs are captured per context bucket (powers of two)
so attention's grid fits the context and long contexts take the split-KV kernel.
With device sampling the graph also draws the next token into its own input buffer, so a
step needs nothing from the host but its position.
"""

from __future__ import annotations

import contextlib
import gc

import torch
import torch.nn.functional as F

from lily.config import ModelConfig
from lily.model.linear import embedding
from lily.ops.attention_decode import attention_decode
from lily.ops.attention_prefill import attention_prefill
from lily.ops.deltanet_decode import DeltaNetDecodeWorkspace, deltanet_decode
from lily.ops.deltanet_prefill import deltanet_prefill
from lily.ops.embedding import DTYPES as EMBED_DTYPES
from lily.ops.embedding import embedding_rows
from lily.ops.launch import to_device
from lily.ops.moe_decode import moe_decode
from lily.ops.moe_prefill import moe_prefill
from lily.ops.norm_rope import rope_inv_freq
from lily.ops.qgemm import qgemm
from lily.ops.qgemv import qgemv
from lily.ops.qgemv_mma import mma_supports, qgemv_mma
from lily.ops.rmsnorm import add_rmsnorm, rmsnorm
from lily.quant import QuantWeight, Weight
from lily.runtime.device_decode import DeviceDecode
from lily.runtime.generate import Runner
from lily.runtime.state import DeltaNetState

# Rows at or below this run through the GEMV kernel (it handles up to 8 rows).
_GEMV_ROWS = 8
_MIN_BUCKET = 4096


def linear(x: torch.Tensor, w: Weight, residual: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:  # fmt: skip
    """``residual + x @ w.T`` with the packed kernels (dense weights go to cuBLAS)."""
    if isinstance(w, QuantWeight):
        rows = 1 if x.dim() == 1 else x.shape[0]
        if rows <= _GEMV_ROWS:
            return qgemv(x, w, residual=residual, out_dtype=out_dtype)
        y = qgemm(x, w, out_dtype=out_dtype)
    else:
        y = F.linear(x, w.to(x.dtype))
        if out_dtype is not None:
            y = y.to(out_dtype)
    return y if residual is None else y + residual


def embed(ids: torch.Tensor, w: Weight, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``ids`` of the embedding table: one kernel for a packed table (the reference's
    gather and dequantize were ten launches), the reference otherwise."""
    if isinstance(w, QuantWeight) and dtype in EMBED_DTYPES:
        return embedding_rows(ids, w, dtype)
    return embedding(ids, w, dtype)


def residual_norm(o: torch.Tensor, w: Weight, x: torch.Tensor, norm_w: torch.Tensor,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``x + o @ w.T`` and its RMSNorm. The GEMV (few rows) adds the residual before its
    one rounding; after a GEMM the add and the norm share one launch."""
    if isinstance(w, QuantWeight) and o.shape[0] > _GEMV_ROWS:
        return add_rmsnorm(linear(o, w), x, norm_w, eps)
    x = linear(o, w, residual=x)
    return x, rmsnorm(x, norm_w, eps)


@contextlib.contextmanager
def _no_gc():
    """Python's cyclic collector off while a prefill is enqueued.

    NOTE: the host enqueues a reused turn's ~800 launches barely ahead of the GPU (28-32 ms
    against 45 ms of kernels, less at the start), so a collector pass in the middle shows
    up as idle GPU time (bench/gpu_timeline.py: 1.9 ms of gaps over 20 us). The launches
    make tuples, not cycles: nothing is left for the collector that refcounting misses."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


MOE_WEIGHTS = ("router", "gate_proj", "up_proj", "down_proj", "shared_gate_proj",
               "shared_up_proj", "shared_down_proj", "shared_expert_gate")  # fmt: skip


def moe(
    p: dict,
    pre: str,
    h: torch.Tensor,
    x: torch.Tensor,
    cfg: ModelConfig,
    next_norm: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``x + moe(h)`` for h, x (T, D), with routing on the GPU, and for several rows with
    ``next_norm`` also its RMSNorm by that weight (the next layer's input), else None."""
    args = [p[pre + n] for n in MOE_WEIGHTS]
    k = cfg.num_experts_per_tok
    if h.shape[0] == 1:
        return moe_decode(h[0], *args, top_k=k, residual=x[0])[None], None
    if next_norm is None:
        return moe_prefill(h, *args, top_k=k, residual=x), None
    return moe_prefill(h, *args, top_k=k, residual=x, norm_weight=next_norm,
                       eps=cfg.rms_norm_eps)  # fmt: skip


def fuse_rows(ws: list[Weight]) -> Weight | None:
    """One weight whose output rows are those of ``ws`` in order (None if they differ in kind)."""
    if all(isinstance(w, QuantWeight) for w in ws):
        if len({(w.bits, w.group_size, w.scales.dtype) for w in ws}) != 1:
            return None
        return QuantWeight(
            torch.cat([w.qweight for w in ws]),
            torch.cat([w.scales for w in ws]),
            torch.cat([w.biases for w in ws]),
            ws[0].bits,
            ws[0].group_size,
        )
    if all(isinstance(w, torch.Tensor) for w in ws):
        return torch.cat(ws)
    return None


# The projections that read the same normed input: one GEMV each in decode.
FUSED = {
    "linear_attention": ("dn.", ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")),
    "full_attention": ("attn.", ("q_proj", "k_proj", "v_proj")),
}


def graph_key(state) -> tuple:
    """What a captured step bakes in about the state: every buffer's address and the KV
    capacity (the attention kernels' row stride). A freed cache's address can come back
    with another capacity; replaying a graph captured for the old one would then read
    and write KV rows at the wrong stride."""
    key = tuple((c.k.data_ptr(), c.v.data_ptr(), tuple(c.k.shape)) for c in state.kv.values())
    return key + tuple((s.recurrent.data_ptr(), s.conv.data_ptr(), tuple(s.recurrent.shape))
                       for s in state.deltanet.values())  # fmt: skip


class GpuRunner(Runner):
    """Kernel forward over the model's parameters and the engine's session state."""

    def __init__(self, model, chunk: int, use_graphs: bool = True, sample_on_device: bool = True,
                 pdl: bool = True, mma: bool = True):  # fmt: skip
        self.model = model
        # Programmatic dependent launch for the decode step's GEMVs, DeltaNet step and MoE
        # (Hopper): each issues its weight (or state) loads while the kernel before it
        # drains (bench: the fused projection GEMV 10.3 -> 8.6 us, o_proj 4.98 -> 4.36 us;
        # the whole step at 4K 1.776 -> 1.522 ms). No-op elsewhere.
        self.pdl = pdl
        # 4-bit decode GEMVs on the tensor cores (qgemv_mma; H200, in graphs with PDL:
        # DeltaNet projections 8.67 -> 7.47 us, attention's 7.6 -> 5.81, o_proj 4.38 -> 3.97,
        # lm_head 114 -> 89 us after its own norm launch; bench/results/linear_mma_h200.json)
        self.mma = mma
        self.cfg: ModelConfig = model.cfg
        self.p = model.params
        self.chunk = max(1, chunk)
        self.dev = model.device
        cfg = self.cfg
        self.inv_freq = rope_inv_freq(cfg.rotary_dim, cfg.rope_theta, self.dev)
        self.ws = DeltaNetDecodeWorkspace.new(
            cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_value_head_dim,
            self.dev,
        )  # fmt: skip
        self.use_graphs = use_graphs
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # NOTE: one memory pool for every captured step (each had its own, up to 17, each the
        # size of a step's temporaries). Safe because steps replay one at a time on one
        # stream and a step's output is read (decode clones it) before another step replays.
        self.graph_pool = (
            torch.cuda.graph_pool_handle() if use_graphs and self.dev.type == "cuda" else None
        )
        self.tok = torch.zeros(1, dtype=torch.long, device=self.dev)
        self.pos = torch.zeros(1, dtype=torch.int32, device=self.dev)
        if sample_on_device:  # draws write self.tok: the graph's own input for the next step
            self.device_decode = DeviceDecode(self.tok, self.cfg.vocab_size)
        self.fused = self._fuse_projections()

    def _fuse_projections(self) -> dict[int, tuple[Weight, list[int]]]:
        """Concatenate each layer's input projections once; the parameters become views."""
        fused = {}
        for i, kind in enumerate(self.cfg.layer_types):
            sub, names = FUSED[kind]
            keys = [f"layers.{i}.{sub}{n}" for n in names]
            w = fuse_rows([self.p[k] for k in keys])
            if w is None:
                continue
            sizes = [self.p[k].shape[-2] for k in keys]
            start = 0
            for k, n in zip(keys, sizes, strict=True):
                self.p[k] = w[start : start + n]  # row views: frees the separate copies
                start += n
            fused[i] = (w, sizes)
        return fused

    def _project(self, i: int, x: torch.Tensor, norm_w: torch.Tensor, eps: float,
                 kind: str) -> list[torch.Tensor]:  # fmt: skip
        """The layer's input projections of rmsnorm(x) for one token: (N,) each."""
        w = self.fused[i][0] if i in self.fused else None
        if isinstance(w, QuantWeight):  # the norm rides in the GEMV's prologue
            y = self._gemv(x, w, norm_weight=norm_w, eps=eps)
            return list(y.split(self.fused[i][1]))
        return self._project_chunk(i, rmsnorm(x, norm_w, eps), kind)

    def _project_chunk(self, i: int, h: torch.Tensor, kind: str) -> list[torch.Tensor]:
        """The layer's input projections of T normed rows: one GEMM over the fused weight,
        its output split into column views (the mixer kernels take row strides). The small
        ones alone (b and a: 32 rows, k and v: 512) left most SMs idle for ~25 us each."""
        sub, names = FUSED[kind]
        if i in self.fused:
            w, sizes = self.fused[i]
            return list(linear(h, w).split(sizes, dim=-1))
        return [linear(h, self.p[f"layers.{i}.{sub}{n}"]) for n in names]

    def _decode_forward(self, ids: torch.Tensor, state, pos: torch.Tensor, max_len: int
                        ) -> torch.Tensor:  # fmt: skip
        """One token: fused norms and projections, mixer kernel, fused MoE (graph-safe)."""
        cfg, p = self.cfg, self.p
        eps = cfg.rms_norm_eps
        x = embed(ids, p["embed_tokens"], self.model.dtype)[0]
        for i, kind in enumerate(cfg.layer_types):
            pre = f"layers.{i}."
            parts = self._project(i, x, p[pre + "input_norm"], eps, kind)
            if kind == "linear_attention":
                d, st = pre + "dn.", state.deltanet[i]
                o = deltanet_decode(*parts, p[d + "conv1d"], st.conv, p[d + "A_log"],
                                    p[d + "dt_bias"], p[d + "norm"], st.recurrent, eps,
                                    workspace=self.ws, pdl=self.pdl)  # fmt: skip
                x = self._out_proj(o, p[d + "out_proj"], x)
            else:
                at, kv = pre + "attn.", state.kv[i]
                o = attention_decode(*parts, p[at + "q_norm"], p[at + "k_norm"], kv.k, kv.v,
                                     pos, self.inv_freq, eps, max_len=max_len)  # fmt: skip
                x = self._out_proj(o, p[at + "o_proj"], x)
            # The post-attention norm is fused into the MoE's prologue; x stays the residual.
            x = moe_decode(x, *[p[pre + "moe." + n] for n in MOE_WEIGHTS],
                           top_k=cfg.num_experts_per_tok, residual=x,
                           norm_weight=p[pre + "post_norm"], eps=eps, pdl=self.pdl)  # fmt: skip
        w = p["lm_head"]
        if isinstance(w, QuantWeight) and self._on_mma(w):
            # its own norm launch: in the GEMV's prologue each of ~7,800 programs redid it
            # (95 against 89 us)
            return self._gemv(rmsnorm(x, p["norm"], eps), w, out_dtype=torch.float32)
        if isinstance(w, QuantWeight):
            return self._gemv(x, w, norm_weight=p["norm"], eps=eps, out_dtype=torch.float32)
        return linear(rmsnorm(x, p["norm"], eps), p["lm_head"], out_dtype=torch.float32)

    def _out_proj(self, o: torch.Tensor, w: Weight, x: torch.Tensor) -> torch.Tensor:
        """``x + o @ w.T`` for the decode row (the residual added before the one rounding)."""
        if isinstance(w, QuantWeight):
            return self._gemv(o, w, residual=x)
        return linear(o, w, residual=x)

    def _on_mma(self, w: QuantWeight) -> bool:
        """Whether this weight's decode GEMV runs on the tensor cores (qgemv_mma takes 4 bits
        on aligned rows)."""
        return self.mma and mma_supports(w)

    def _gemv(self, x: torch.Tensor, w: QuantWeight, **kw) -> torch.Tensor:
        """One decode row through a packed weight: qgemv_mma where ``_on_mma``, else the
        CUDA-core GEMV; PDL as the runner says."""
        if self._on_mma(w):
            return qgemv_mma(x, w, pdl=self.pdl, **kw)
        return qgemv(x, w, pdl=self.pdl, **kw)

    # ---- one forward over T tokens (T = 1 is the decode step)
    def _forward(
        self,
        ids: torch.Tensor,
        state,
        start: int | torch.Tensor,
        max_len: int,
        cuts: tuple[int, ...] = (),
        snaps: dict | None = None,
    ) -> torch.Tensor:
        """Logits of the last of T tokens; with ``cuts`` (offsets inside the chunk), the
        DeltaNet states at those offsets are copied into ``snaps`` (keyed by position)."""
        cfg, p = self.cfg, self.p
        eps = cfg.rms_norm_eps
        t_len = ids.shape[0]
        if t_len == 1 and isinstance(start, int):
            # A one-token chunk takes the decode kernels, which read the position on device.
            start = to_device([start], torch.int32, self.dev)
        x = embed(ids, p["embed_tokens"], self.model.dtype)
        h = None  # this layer's normed input, when the previous layer's MoE made it
        last = len(cfg.layer_types) - 1
        for i, kind in enumerate(cfg.layer_types):
            pre = f"layers.{i}."
            if h is None:
                h = rmsnorm(x, p[pre + "input_norm"], eps)
            parts = self._project_chunk(i, h, kind)
            if kind == "linear_attention":
                d, st = pre + "dn.", state.deltanet[i]
                qkv, z, b, a = parts
                args = (p[d + "conv1d"], st.conv, p[d + "A_log"], p[d + "dt_bias"],
                        p[d + "norm"], st.recurrent, eps)  # fmt: skip
                if t_len == 1:
                    o = deltanet_decode(qkv[0], z[0], b[0], a[0], *args, workspace=self.ws)[None]
                else:
                    # With cuts the recurrence runs piece by piece and the states at the
                    # cuts are copied out; everything else still sees the whole chunk.
                    got: list = []
                    o = deltanet_prefill(qkv, z, b, a, *args, cuts=cuts, snaps=got)
                    for c, (conv, rec) in zip(cuts, got, strict=True):
                        snaps.setdefault(start + c, {})[i] = DeltaNetState(conv, rec)
                out_w = p[d + "out_proj"]
            else:
                at, kv = pre + "attn.", state.kv[i]
                qg, k, v = parts
                norms = (p[at + "q_norm"], p[at + "k_norm"], kv.k, kv.v)
                if t_len == 1:
                    o = attention_decode(qg[0], k[0], v[0], *norms, start, self.inv_freq, eps,
                                         max_len=max_len)[None]  # fmt: skip
                else:
                    o = attention_prefill(qg, k, v, *norms, start, self.inv_freq, eps)
                out_w = p[at + "o_proj"]
            x, h = residual_norm(o, out_w, x, p[pre + "post_norm"], eps)
            nxt = p[f"layers.{i + 1}.input_norm"] if i < last else None
            x, h = moe(p, pre + "moe.", h, x, cfg, nxt)
        h = rmsnorm(x[-1:], p["norm"], eps)
        return linear(h, p["lm_head"], out_dtype=torch.float32)[0]

    # ---- Runner
    def prefill(self, ids: list[int], state) -> torch.Tensor:
        return self.prefill_snapshots(ids, state, [])[0]

    def prefill_snapshots(
        self, ids: list[int], state, points: list[int]
    ) -> tuple[torch.Tensor, dict[int, dict]]:
        """Chunked prefill; DeltaNet states at ``points`` are copied out mid-chunk."""
        logits, snaps = None, {}
        with torch.inference_mode(), _no_gc():
            for i in range(0, len(ids), self.chunk):
                part = ids[i : i + self.chunk]
                start = state.length
                end = start + len(part)
                cuts = tuple(p - start for p in points if start < p < end)
                for c in state.kv.values():
                    c.ensure(end)
                state.busy = True
                t = to_device(part, torch.long, self.dev)
                logits = self._forward(t, state, start, end, cuts, snaps)
                state.length = end
                state.tokens.extend(part)
                state.busy = False
                if end in points:  # a point on a chunk boundary
                    snaps[end] = state.snapshot_recurrent()
        assert logits is not None, "prefill needs at least one token"
        return logits, snaps

    def decode(self, token_id: int, state) -> torch.Tensor:
        self.tok.fill_(token_id)
        with torch.inference_mode():
            # NOTE: a graph writes the same buffer every step; hand out a copy so a caller
            # may keep logits across steps (1 MB, about a microsecond).
            out = self._advance(state, sampled=False).clone()
        state.tokens.append(token_id)
        state.busy = False
        return out

    def decode_sampled(self, state) -> None:
        self._advance(state, sampled=True)
        self.device_decode.send()
        # NOTE: the loop appends the id to state.tokens and clears busy (see Runner)

    def _advance(self, state, sampled: bool) -> torch.Tensor:
        """One step on the id in ``self.tok`` at ``state.length``, eager or replayed; the
        length advances and ``state.busy`` stays set for the caller to clear."""
        start = state.length
        for c in state.kv.values():
            c.ensure(start + 1)
        state.busy = True
        with torch.inference_mode():
            if self.use_graphs:
                graph, out = self._graph(state, start, sampled)
                self.pos.fill_(start)
                graph.replay()
            else:
                self.pos.fill_(start)
                out = self._step(state, self._bucket(start, state), sampled)
        state.length = start + 1
        return out

    def _step(self, state, bucket: int, sampled: bool) -> torch.Tensor:
        """The decode step on ``self.tok`` at ``self.pos``; with ``sampled`` it also draws
        the next token into ``self.tok`` (and the ring). Graph-safe."""
        logits = self._decode_forward(self.tok, state, self.pos, bucket)
        if sampled:
            self.device_decode.draw(logits)
        return logits

    def _bucket(self, start: int, state) -> int:
        cap = min(c.capacity for c in state.kv.values()) if state.kv else start + 1
        b = _MIN_BUCKET
        while b < start + 1:
            b *= 2
        return min(b, cap)

    def _graph(self, state, start: int, sampled: bool = False):
        """The captured step for this state's buffers and context bucket (with ``sampled``,
        for the sampler's current structure)."""
        bucket = self._bucket(start, state)
        key = (bucket, graph_key(state))
        dd = self.device_decode
        if sampled:
            key += dd.ident()
        if key not in self.graphs:
            if len(self.graphs) > 16:  # buffers moved (new state): old graphs are dead
                self.graphs.clear()
            # Warm up outside the graph (compiles kernels, allocator pools), then put back
            # what it changed: the DeltaNet states, and the token and sampler counters.
            snap = state.snapshot_recurrent()
            drawn = dd.snapshot() if sampled else None
            self.pos.fill_(start)
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                self._step(state, bucket, sampled)
            torch.cuda.current_stream().wait_stream(s)
            if sampled:
                dd.restore(drawn)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.graph_pool):
                out = self._step(state, bucket, sampled)
            state.restore(snap, state.length)
            self.graphs[key] = (graph, out)
        return self.graphs[key]
