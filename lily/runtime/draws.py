"""The random stream every sampler draws from, and the Gumbel-max perturbation it feeds.

A counter-based hash of (seed, draw number, token index): splitmix64 in wrapping int64
torch ops. A counter, not a ``torch.Generator`` (which cannot be replayed from a graph
here): any sampler that knows a request's seed and how many draws it made continues the
request's stream exactly, so a seeded request draws the same tokens from the same logits
whichever sampler draws them (the host's ``Sampler``, the runner's ``DeviceSampler``, a
row of the ``RowsSampler``).
"""

from __future__ import annotations

import torch

GAMMA = 0x9E3779B97F4A7C15  # splitmix64's increment (the golden ratio in 64 bits)
_MUL1 = 0xBF58476D1CE4E5B9
_MUL2 = 0x94D049BB133111EB


def as_i64(c: int) -> int:
    """The int64 with the same 64 bits as ``c`` (torch has no uint64 arithmetic)."""
    c %= 1 << 64
    return c - (1 << 64) if c >= 1 << 63 else c


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's ``>>`` is arithmetic: mask the sign)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def mix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on int64 tensors (multiplications wrap like uint64's)."""
    z = (z ^ _shr(z, 30)) * as_i64(_MUL1)
    z = (z ^ _shr(z, 27)) * as_i64(_MUL2)
    return z ^ _shr(z, 31)


def to_unit(z: torch.Tensor) -> torch.Tensor:
    """The top 52 bits of int64 ``z`` as a float64 strictly inside (0, 1)."""
    # NOTE: 52 bits, so that the largest value, 1 - 2**-53, is a float64 below 1 (with 53
    # bits it would round to 1.0, and -log(-log 1) is an infinite Gumbel draw).
    return (_shr(z, 12).double() + 0.5) * 2.0**-52


def token_lanes(vocab_size: int, device: torch.device | str) -> torch.Tensor:
    """``(arange(V) + 1) * GAMMA`` (wrapped): each token index's splitmix state."""
    return torch.arange(1, vocab_size + 1, dtype=torch.long, device=device) * as_i64(GAMMA)


def uniforms(seed: torch.Tensor, step: torch.Tensor, lanes: torch.Tensor) -> torch.Tensor:
    """float64 uniforms in (0, 1), one per lane, for draw ``step`` of ``seed``.

    ``seed`` and ``step`` are int64 (1,) (one request) or (B, 1) (one per row: the result
    is (B, V)); ``lanes`` is ``token_lanes(V)``. The draw's base is the splitmix output
    number ``step + 1`` of ``seed``; each token then takes output ``i + 1`` of a second
    splitmix stream started at that base.
    """
    base = mix64(seed + (step + 1) * as_i64(GAMMA))
    return to_unit(mix64(base + lanes))


def perturbed(x: torch.Tensor, seed: torch.Tensor, step: torch.Tensor,
              lanes: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """fp32 warped logits ``x`` plus draw ``step``'s Gumbel noise: their argmax is the draw.

    Gumbel-max: argmax(x + G), G = -log(-log U), picks i with probability softmax(x)_i and,
    unlike torch.multinomial, needs no normalization or validity check. G is computed in
    float64 and rounded once, so every sampler adds the very same fp32 noise.
    """
    u = uniforms(seed, step, lanes)
    return x - (-u.log()).log().float()
