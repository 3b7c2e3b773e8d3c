"""The decoder stack: embeddings, 40 layers (DeltaNet or attention mixer + MoE), lm_head."""

from __future__ import annotations

import torch

from lily.config import ModelConfig
from lily.model.attention import attention_layer
from lily.model.deltanet import deltanet_layer
from lily.model.linear import embedding, linear
from lily.model.moe import moe_layer
from lily.model.norm import rms_norm
from lily.quant import Weight


class Model:
    """Reference forward over canonical parameters (docs/CONTRACTS.md).

    ``forward`` consumes tokens at the session's current position and advances it; the
    caller decides chunking and what to keep.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        params: dict[str, Weight],
        dtype: torch.dtype,
        kernels: bool | None = None,
    ):
        self.cfg = cfg
        self.params = params
        self.dtype = dtype
        self.device = params["norm"].device
        # NOTE: accepted and stored only; this is the reference path. The kernel layers
        # behind the same three methods (embed, layer, head) come with the decoder-stack
        # refactor. None means "kernels iff on CUDA".
        self.kernels = self.device.type == "cuda" if kernels is None else kernels

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings x (T, D) in the compute dtype for ids (T,)."""
        return embedding(ids, self.params["embed_tokens"], self.dtype)

    def layer(self, i: int, x: torch.Tensor, state, start: int) -> torch.Tensor:
        """Decoder layer ``i`` (both norms, mixer, MoE, both residuals) on x (T, D) at
        positions [start, start + T); advances only layer i's part of ``state``."""
        cfg, p = self.cfg, self.params
        pre = f"layers.{i}."
        h = rms_norm(x, p[pre + "input_norm"], cfg.rms_norm_eps)
        if cfg.layer_types[i] == "linear_attention":
            x = x + deltanet_layer(p, pre + "dn.", h, state.deltanet[i], cfg)
        else:
            x = x + attention_layer(p, pre + "attn.", h, state.kv[i], start, cfg)
        h = rms_norm(x, p[pre + "post_norm"], cfg.rms_norm_eps)
        return x + moe_layer(p, pre + "moe.", h, cfg)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 logits (T, V) of the last layer's output x (T, D): final norm, lm_head."""
        return self.logits(rms_norm(x, self.params["norm"], self.cfg.rms_norm_eps))

    def hidden(self, ids: torch.Tensor, state) -> torch.Tensor:
        """Final-norm hidden states (T, D) for ``ids`` (T,), advancing ``state``."""
        cfg, p = self.cfg, self.params
        start = state.length
        if start + ids.shape[0] > state.limit:
            raise ValueError(
                f"context of {start + ids.shape[0]} tokens exceeds the limit of {state.limit}"
            )
        state.busy = True
        x = self.embed(ids)
        for i in range(cfg.num_hidden_layers):
            x = self.layer(i, x, state, start)
        state.length = start + ids.shape[0]
        state.tokens.extend(ids.tolist())
        state.busy = False
        return rms_norm(x, p["norm"], cfg.rms_norm_eps)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """fp32 logits (T, V) for hidden states (T, D)."""
        return linear(h, self.params["lm_head"]).float()

    def forward(self, ids: torch.Tensor, state, all_logits: bool = False) -> torch.Tensor:
        """Logits of the last position (1, V), or of every position with ``all_logits``."""
        h = self.hidden(ids, state)
        return self.logits(h if all_logits else h[-1:])
