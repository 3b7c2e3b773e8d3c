"""What one request's session state and activations take in memory, asked of the runtime.

The K/V caches are replayed through the runtime's own growth (``KVCache.ensure`` on
``SessionState.new``'s initial capacity, at each prefill chunk's end and each decoded token)
on the meta device: no memory is taken and no policy is copied here. The DeltaNet states
are fixed; a prefill chunk needs activations, and the reference attention a bounded score
block (``lily.model.attention.SCORE_ELEMS``).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from lily.model.attention import SCORE_ELEMS
from lily.runtime.state import SessionState

META = torch.device("meta")
# A model with one attention layer of one head and dim: what the KV growth replay needs.
_ONE_CACHE = SimpleNamespace(num_key_value_heads=1, head_dim=1, attn_layers=(0,),
                             linear_layers=())  # fmt: skip


@dataclass(frozen=True)
class Estimate:
    """Bytes one request needs, by part."""

    kv: int  # K/V caches at their final capacity
    kv_growth: int  # the old buffer held while one layer's cache grows
    recurrent: int  # DeltaNet conv and recurrent states
    workspace: int  # activations of one prefill chunk

    @property
    def total(self) -> int:
        return self.kv + self.kv_growth + self.recurrent + self.workspace


def kv_growth(n_prompt: int, n_total: int, chunk: int, limit: int) -> tuple[int, int]:
    """(the K/V capacity a fresh state reaches for ``n_prompt`` prompt tokens prefilled in
    chunks of ``chunk`` and then decoded to ``n_total``, the capacity before its last
    growth (0: it never grew))."""
    cache = SessionState.new(_ONE_CACHE, META, torch.float32, limit).kv[0]
    before = 0

    def ensure(n: int) -> None:
        nonlocal before
        cap = cache.capacity
        cache.ensure(n)
        if cache.capacity != cap:
            before = cap

    for end in [*range(min(chunk, n_prompt), n_prompt, chunk), n_prompt]:
        ensure(end)
    while cache.capacity < min(n_total, limit):  # decode: one position at a time
        ensure(cache.capacity + 1)
    return cache.capacity, before


def kv_capacity(n_prompt: int, n_total: int, chunk: int, limit: int) -> int:
    """The K/V capacity a fresh state reaches for ``n_total`` tokens (see ``kv_growth``)."""
    return kv_growth(n_prompt, n_total, chunk, limit)[0]


def estimate(cfg: Any, dtype: torch.dtype, n_prompt: int, n_total: int, chunk: int,
             limit: int, kernels: bool) -> Estimate:  # fmt: skip
    """What a request of ``n_prompt`` prompt tokens growing to ``n_total`` needs."""
    state = SessionState.new(cfg, META, dtype, limit)
    cap, before = kv_growth(n_prompt, n_total, chunk, limit)
    es = torch.empty((), dtype=dtype).element_size()
    per_pos = 2 * cfg.num_key_value_heads * cfg.head_dim * es  # K and V, one layer
    kv = per_pos * cap * len(state.kv)
    # NOTE: growing one layer's cache briefly holds the old and the new buffer.
    growth = per_pos * max(before, cap // 2)
    recurrent = sum(s.conv.nbytes + s.recurrent.nbytes for s in state.deltanet.values())
    t = min(chunk, n_prompt)
    widths = (
        4 * cfg.hidden_size  # residual, normed input, mixer and MoE outputs
        + 2 * cfg.conv_dim  # DeltaNet projections before and after the conv
        + 2 * cfg.num_attention_heads * cfg.head_dim  # gated queries
        + 3 * cfg.num_experts_per_tok * cfg.moe_intermediate_size  # routed gate/up/act
    )
    workspace = t * widths * 4 + 2 * cfg.vocab_size * 4  # and the last token's fp32 logits
    if not kernels:  # the reference attention materializes a bounded fp32 score block
        workspace += 2 * min(SCORE_ELEMS, cfg.num_attention_heads * t * n_total) * 4
    return Estimate(kv=kv, kv_growth=growth, recurrent=recurrent, workspace=workspace)
