"""The decoder stack, written once: embedding, 40 layers (DeltaNet or attention mixer, then
MoE), final norm and lm_head. Each op runs its Triton kernels or its reference maths as
the Model was built (lily/model/ops.py); the runner (lily/runtime/runner.py) schedules."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from lily.config import ModelConfig
from lily.model import ops
from lily.model.bundles import DeltaNetWeights, LayerWeights, ModelWeights
from lily.quant import QuantWeight, Weight
from lily.transfer import to_device

Tensor = torch.Tensor


@dataclasses.dataclass(frozen=True)
class Rows:
    """B sequences decoded together, one token each: row r of a step is ``states[r]``'s
    next token (each with its own KV caches, DeltaNet states and position)."""

    states: Sequence
    # With the kernels: per layer, the device table of the rows' buffers the batched
    # mixer kernels read (lily/runtime/rows.py keeps them; None: one launch per row).
    tables: dict | None = None

    def __len__(self) -> int:
        return len(self.states)


class Model:
    """The model over its weights, on the reference ops or the kernels.

    ``weights``: a ModelWeights, or the canonical flat parameters (docs/CONTRACTS.md),
    bundled here (input projections fused once). ``kernels``: run the Triton kernels (None:
    iff the weights are on a CUDA device); ``pdl`` and ``mma`` choose programmatic dependent
    launch and tensor-core GEMVs in decode steps; ``capturable``: a decode step can be
    captured in a CUDA graph. The methods advance the session state's
    caches and recurrent states, never its length or tokens (the runner's).
    """

    def __init__(self, cfg: ModelConfig, weights: ModelWeights | dict[str, Weight],
                 dtype: torch.dtype, kernels: bool | None = None, *, pdl: bool = True,
                 mma: bool = True):  # fmt: skip
        self.cfg = cfg
        if not isinstance(weights, ModelWeights):
            weights = ModelWeights.from_params(cfg, weights)
        self.weights = weights
        self.dtype = dtype
        self.device = weights.norm.device
        self.kernels = self.device.type == "cuda" if kernels is None else kernels
        # A decode step goes into a CUDA graph when every op runs on the kernels (the MoE
        # kernels take packed experts only).
        packed = all(isinstance(lw.moe.gate_proj, QuantWeight) for lw in weights.layers)
        self.capturable = self.kernels and self.device.type == "cuda" and packed
        self.chunk_ops: ops.Kernels | None = None
        self.step_ops: ops.Kernels | None = None
        if self.kernels:
            self.chunk_ops = ops.Kernels.new(cfg, self.device, step=False, pdl=False, mma=False)
            self.step_ops = dataclasses.replace(self.chunk_ops, step=True, pdl=pdl, mma=mma)

    def params(self) -> dict[str, Weight]:
        """The canonical flat parameters (the fused projections as row views)."""
        return self.weights.params()

    # ---- the public pieces: embedding, one layer, head (each correct on its own)
    def embed(self, ids: Tensor) -> Tensor:
        """Token embeddings (T, D) in the compute dtype for ids (T,)."""
        return ops.embed(ids, self.weights.embed_tokens, self.dtype, self.chunk_ops)

    def layer(self, i: int, x: Tensor, state, start: int) -> Tensor:
        """Decoder layer ``i`` on x (T, D) at positions [start, start+T): input norm, mixer,
        residual, post norm, MoE, residual. Advances only layer i's state (its KV cache grows
        as needed)."""
        t = x.shape[0]
        if i in state.kv:
            state.kv[i].ensure(start + t)
        pos = self._position(start, t, self.chunk_ops)
        x, _ = self._layer(i, self.weights.layers[i], x, None, state, pos, start + t,
                           self.chunk_ops, None, (), {})  # fmt: skip
        return x

    def head(self, x: Tensor, step: bool = False) -> Tensor:
        """fp32 logits (T, V) for x (T, D): final norm and lm_head (``step``: as in a decode
        step, see lily/model/ops.py)."""
        w = self.weights
        k = self.step_ops if step else self.chunk_ops
        return ops.head(x, w.norm, w.lm_head, self.cfg.rms_norm_eps, k)

    # ---- the stack
    def run(self, ids: Tensor, state, start: int | Tensor, max_len: int | None = None, *,
            step: bool = False, cuts: Sequence[int] = ()) -> tuple[Tensor, dict]:  # fmt: skip
        """The last layer's output (T, D) for ids (T,) at positions [start, start+T), and
        the DeltaNet states after the first ``c`` tokens for ``c`` in ``cuts`` (offsets in
        (0, T)) as ``{c: {layer: (conv, recurrent)}}``. The caches must already hold
        start + T positions. ``step``: a decode step (one token; ``start`` may be a device
        tensor, then ``max_len`` bounds it and stays fixed within a captured graph).

        ``state`` may also be ``Rows``: a decode step of B sequences, ids (B,) one token
        each, ``start`` their B positions (ints, or a (B,) int32 device tensor with the
        kernels), ``max_len`` a bound on every row's context; no cuts."""
        k = self.step_ops if step else self.chunk_ops
        t = ids.shape[0]
        if isinstance(state, Rows):
            if len(state) != t or cuts:
                raise ValueError(f"a batched step takes one token per row and no cuts: "
                                 f"{t} ids for {len(state)} rows")  # fmt: skip
            if max_len is None:
                max_len = max(start) + 1
        else:
            if max_len is None:
                max_len = start + t
            start = self._position(start, t, k)
        snaps: dict[int, dict] = {}
        layers = self.weights.layers
        last = len(layers) - 1
        x = ops.embed(ids, self.weights.embed_tokens, self.dtype, k)
        h = None  # the layer's normed input, when the op before made it
        for i, lw in enumerate(layers):
            nxt = layers[i + 1].input_norm if i < last else None
            x, h = self._layer(i, lw, x, h, state, start, max_len, k, nxt, cuts, snaps)
        return x, snaps

    def forward(self, ids: Tensor, state, start: int | Tensor, max_len: int | None = None, *,
                step: bool = False, cuts: Sequence[int] = ()) -> tuple[Tensor, dict]:  # fmt: skip
        """Logits (V,) of the last of ids (T,), and the snapshots of ``run``; for ``Rows``
        the logits (B, V) of every row."""
        x, snaps = self.run(ids, state, start, max_len, step=step, cuts=cuts)
        if isinstance(state, Rows):
            return self.head(x, step), snaps
        return self.head(x[-1:], step)[0], snaps

    def _position(self, start: int | Tensor, t: int, k: ops.Kernels | None) -> int | Tensor:
        # A one-token chunk takes the decode kernels, which read the position on the device.
        if k is not None and t == 1 and isinstance(start, int):
            return to_device([start], torch.int32, self.device)
        return start

    def _layer(self, i: int, lw: LayerWeights, x: Tensor, h: Tensor | None, state,
               start: int | Tensor, max_len: int, k: ops.Kernels | None,
               next_norm: Tensor | None, cuts: Sequence[int],
               snaps: dict) -> tuple[Tensor, Tensor | None]:  # fmt: skip
        """Layer ``i`` on the residual stream x, with ``h`` its input norm when the op before
        made it; returns x and, where the MoE made it, its norm by ``next_norm``."""
        cfg = self.cfg
        eps = cfg.rms_norm_eps
        mw = lw.mixer
        parts = ops.project(x, h, lw.input_norm, mw.proj, eps, k)
        if isinstance(state, Rows):
            o = self._mixer_rows(i, mw, parts, state, start, max_len, k)
        elif isinstance(mw, DeltaNetWeights):
            st = state.deltanet[i]
            if cuts:
                got: list = []
                o = ops.deltanet(parts, mw, st.conv, st.recurrent, eps, k, cuts, got)
                for c, s in zip(cuts, got, strict=True):
                    snaps.setdefault(c, {})[i] = s
            else:
                o = ops.deltanet(parts, mw, st.conv, st.recurrent, eps, k)
        else:
            kv = state.kv[i]
            o = ops.attention(parts, mw, kv.k, kv.v, start, max_len, cfg, k)
        x, h = ops.out_norm(o, mw.out_proj, x, lw.post_norm, eps, k)
        return ops.moe(x, h, lw.post_norm, lw.moe, next_norm, cfg, k)

    def _mixer_rows(self, i: int, mw, parts: tuple[Tensor, ...], rows: Rows, start,
                    max_len: int, k: ops.Kernels | None) -> Tensor:  # fmt: skip
        """Layer ``i``'s mixer for one token of each row, each on its own state."""
        table = None if rows.tables is None else rows.tables[i]
        if isinstance(mw, DeltaNetWeights):
            sts = [s.deltanet[i] for s in rows.states]
            return ops.deltanet_rows(parts, mw, [s.conv for s in sts], [s.recurrent for s in sts],
                                     self.cfg.rms_norm_eps, k, table)  # fmt: skip
        kvs = [(s.kv[i].k, s.kv[i].v) for s in rows.states]
        return ops.attention_rows(parts, mw, kvs, start, max_len, self.cfg, k, table)
