"""Session state carried between prefill chunks and decode steps.

Per attention layer a KV cache; per DeltaNet layer the conv state (last ``kernel - 1``
inputs of the causal conv) and the fp32 recurrent state. Shapes: docs/CONTRACTS.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lily.config import ModelConfig

# The K/V caches grow in steps of this many positions (never past the context limit). A
# doubling cache reached 2x the prompt on the first decode token after a long prompt (5 GiB
# instead of 2.5 at 128K on the full model: docs/notes/memory.md); steps of 4,096 cost a copy
# of the cache every 4,096 decode tokens, and the engine reserves a whole prompt at once.
KV_STEP = 4096
INITIAL_CAPACITY = 256  # positions of a new state's caches
RELEASE_BYTES = 32 << 20  # a layer's old K and V at least this big go back to the driver


def kv_capacity(positions: int, limit: int, initial: int = INITIAL_CAPACITY) -> int:
    """The capacity a cache of ``initial`` positions grows to so that ``positions`` fit:
    the next multiple of KV_STEP, clamped to ``limit``."""
    if positions <= initial:
        return min(initial, limit)
    return min(-(-positions // KV_STEP) * KV_STEP, limit)


# NOTE: eq=False on the classes that hold tensors (here, the prefix cache's Entry, the
# rows' RowsSent): they live in lists that `in`, `index` and `remove` search, and a
# generated __eq__ compares fields, so two conversations with the same tokens would compare
# their tensors and raise ("Boolean value of Tensor ... is ambiguous"). Identity is meant.
@dataclass(eq=False)
class KVCache:
    """K and V of shape (Hkv, capacity, Dh); positions [0, length) are valid."""

    k: torch.Tensor
    v: torch.Tensor
    limit: int

    @property
    def capacity(self) -> int:
        return self.k.shape[1]

    def ensure(self, n: int) -> None:
        """Grow (in steps of KV_STEP, capped at ``limit``) so that ``n`` positions fit."""
        if n <= self.capacity:
            return
        if n > self.limit:
            raise ValueError(f"context of {n} tokens exceeds the cache limit of {self.limit}")
        cap = kv_capacity(n, self.limit, self.capacity)
        old = 2 * self.k.numel() * self.k.element_size()
        # NOTE: K, then V: only one old buffer is held beside its new copy at any time.
        self.k = _grown(self.k, cap)
        self.v = _grown(self.v, cap)
        if self.k.is_cuda and old >= RELEASE_BYTES:
            # The old buffers go back to the driver now: cached, they would stay reserved
            # beside the larger new ones and a card sized for one cache would hold two.
            # (A sync; small caches skip it, a short prompt's timing would show it.)
            torch.cuda.empty_cache()


def _grown(t: torch.Tensor, cap: int) -> torch.Tensor:
    """``t`` (Hkv, old, Dh) copied into a new (Hkv, cap, Dh) buffer whose tail is zero."""
    hkv, old, dh = t.shape
    out = t.new_empty(hkv, cap, dh)
    out[:, :old] = t
    out[:, old:].zero_()
    return out


@dataclass(eq=False)
class DeltaNetState:
    conv: torch.Tensor  # (kernel - 1, conv_dim), compute dtype
    recurrent: torch.Tensor  # (Hv, K, Vd), fp32


@dataclass(eq=False)
class SessionState:
    """Everything one sequence needs to continue; ``length`` tokens have been consumed."""

    kv: dict[int, KVCache]
    deltanet: dict[int, DeltaNetState]
    limit: int
    length: int = 0
    tokens: list[int] = field(default_factory=list)
    # NOTE: set while a forward is updating the state in place; still set after a
    # fault means the state is half-updated and must not be resumed from.
    busy: bool = False

    @classmethod
    def new(
        cls,
        cfg: ModelConfig,
        device: torch.device | str,
        dtype: torch.dtype,
        limit: int,
        initial_capacity: int = INITIAL_CAPACITY,
    ) -> SessionState:
        cap = min(initial_capacity, limit)
        kv = {
            i: KVCache(
                torch.zeros(cfg.num_key_value_heads, cap, cfg.head_dim, device=device, dtype=dtype),
                torch.zeros(cfg.num_key_value_heads, cap, cfg.head_dim, device=device, dtype=dtype),
                limit,
            )
            for i in cfg.attn_layers
        }
        dn = {
            i: DeltaNetState(
                torch.zeros(
                    cfg.linear_conv_kernel_dim - 1, cfg.conv_dim, device=device, dtype=dtype
                ),
                torch.zeros(
                    cfg.linear_num_value_heads,
                    cfg.linear_key_head_dim,
                    cfg.linear_value_head_dim,
                    device=device,
                    dtype=torch.float32,
                ),
            )
            for i in cfg.linear_layers
        }
        return cls(kv=kv, deltanet=dn, limit=limit)

    def reserve(self, n: int) -> None:
        """Make every K/V cache hold ``n`` positions (at most the limit) in one growth, so a
        prompt prefilled chunk by chunk does not copy its cache at every step."""
        n = min(n, self.limit)
        for c in self.kv.values():
            c.ensure(n)

    def snapshot_recurrent(self) -> dict[int, DeltaNetState]:
        """A copy of the DeltaNet states (they cannot be rewound, only restored)."""
        return {
            i: DeltaNetState(s.conv.clone(), s.recurrent.clone()) for i, s in self.deltanet.items()
        }

    def restore(self, snap: dict[int, DeltaNetState], length: int) -> None:
        """Return to an earlier point: DeltaNet states from ``snap``, KV truncated to ``length``."""
        # Two multi-tensor copies, one per dtype, not 60 launches: torch's fused path takes
        # lists of one dtype only (mixed, it fell back to 60 copies: ~1 ms of host time on
        # a slow host, before any GPU work of the turn; lily/bench/gpu/diagnostics/timeline.py).
        conv = [self.deltanet[i].conv for i in snap]
        torch._foreach_copy_(conv, [s.conv for s in snap.values()])
        rec = [self.deltanet[i].recurrent for i in snap]
        torch._foreach_copy_(rec, [s.recurrent for s in snap.values()])
        self.length = length
        del self.tokens[length:]

    def nbytes(self) -> int:
        n = sum(c.k.numel() * c.k.element_size() * 2 for c in self.kv.values())
        for s in self.deltanet.values():
            n += s.conv.numel() * s.conv.element_size()
            n += s.recurrent.numel() * s.recurrent.element_size()
        return n
