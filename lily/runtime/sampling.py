"""Sampling parameters and the per-request sampler.

The sampler follows vLLM's order: repetition penalty (prompt and output tokens), frequency
and presence penalties (output tokens), temperature (below 1e-5 means greedy), top-k,
top-p, min-p, then one Gumbel-max draw from the random stream of lily/runtime/draws.py,
numbered by the draws made so far: the stream, the numbering and the maths of the device
samplers (lily/runtime/device_sampling.py, rows_sampling.py), so a seeded request draws
the same tokens from the same logits whichever sampler draws them. Everything stays on the
logits' device; the only host sync is the final `.item()` (or `.tolist()` for logprobs).
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lily.runtime.draws import as_i64, perturbed, token_lanes

GREEDY_BELOW = 1e-5  # a temperature below this is greedy decoding
NO_TOKEN = "no token to sample: the logits are all -inf or contain NaN"


@dataclass(frozen=True)
class SamplingParams:
    """What a request asks of the sampler and of the generation loop.

    `top_k` 0 or -1 is off. `logprobs` None means none, 0 only the chosen token's,
    k the chosen token's and the top k. `stop` strings and `stop_token_ids` end generation.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self) -> None:
        # Accept what JSON gives (a single string, lists) but store hashable tuples.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif isinstance(self.stop, list):
            object.__setattr__(self, "stop", tuple(self.stop))
        if isinstance(self.stop_token_ids, list):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        """True when the draw is an argmax."""
        return self.temperature < GREEDY_BELOW

    @property
    def has_penalties(self) -> bool:
        """True when any of the three penalties changes the logits."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def validate(self) -> None:
        """Raise ValueError naming the first bad field (NaN, wrong type, out of range)."""
        _real("temperature", self.temperature, lo=0.0)
        _integer("top_k", self.top_k, lo=-1)
        _real("top_p", self.top_p, lo=0.0, hi=1.0, lo_open=True)
        _real("min_p", self.min_p, lo=0.0, hi=1.0)
        _real("repetition_penalty", self.repetition_penalty, lo=0.0, lo_open=True)
        _real("presence_penalty", self.presence_penalty, lo=-2.0, hi=2.0)
        _real("frequency_penalty", self.frequency_penalty, lo=-2.0, hi=2.0)
        if self.seed is not None:
            _integer("seed", self.seed, lo=-(2**63), hi=2**64 - 1)
        if self.max_tokens is not None:
            _integer("max_tokens", self.max_tokens, lo=1)
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop: must be a list of non-empty strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, tuple):
            raise ValueError(f"stop_token_ids: must be a list, got {self.stop_token_ids!r}")
        for i in self.stop_token_ids:
            _integer("stop_token_ids", i, lo=0)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos: must be a boolean, got {self.ignore_eos!r}")
        if self.logprobs is not None:
            _integer("logprobs", self.logprobs, lo=0)


def _real(name: str, value: object, lo: float, hi: float = math.inf, lo_open: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if ok and math.isfinite(value) and (value > lo if lo_open else value >= lo) and value <= hi:
        return
    low = f"> {lo}" if lo_open else f">= {lo}"
    bound = f"{low} and <= {hi}" if hi != math.inf else low
    raise ValueError(f"{name}: must be a finite number {bound}, got {value!r}")


def _integer(name: str, value: object, lo: int, hi: int | None = None) -> None:
    if isinstance(value, int) and not isinstance(value, bool):
        if value >= lo and (hi is None or value <= hi):
            return
    bound = f">= {lo}" + (f" and <= {hi}" if hi is not None else "")
    raise ValueError(f"{name}: must be an integer {bound}, got {value!r}")


class Sampler:
    """Draws tokens for one request. Holds its seed, its draw count and its token counts.

    Call `observe_prompt` once with the prompt ids, then per step `sample` and `observe`.
    `seed`: the request's seed, or one from the OS's entropy when it gave none.
    """

    def __init__(self, params: SamplingParams, vocab_size: int, device: torch.device | str):
        params.validate()
        if vocab_size < 1:
            raise ValueError(f"vocab_size: must be >= 1, got {vocab_size}")
        self.params = params
        self.vocab_size = vocab_size
        self.device = dev = torch.device(device)
        self.seed = params.seed if params.seed is not None else secrets.randbits(64)
        self._seed = torch.full((1,), as_i64(self.seed), dtype=torch.long, device=dev)
        self._step = torch.zeros(1, dtype=torch.long, device=dev)  # draws made so far
        # NOTE: held, as the device samplers hold theirs (V int64 per request, the size of
        # its penalty tables): made per draw, they would raise the draw's peak above theirs.
        self._lanes = token_lanes(vocab_size, dev)

        def value(v: float) -> torch.Tensor:
            return torch.full((1,), v, dtype=torch.float32, device=dev)

        # NOTE: what the logits are divided by sits in fp32 tensors, as in the device
        # samplers: CUDA divides by a Python float as a multiplication by its reciprocal,
        # which can differ in the last bit (and so, rarely, in the token drawn).
        self._temperature = value(params.temperature)
        self._penalties = tuple(value(v) for v in (params.repetition_penalty,
                                params.frequency_penalty, params.presence_penalty))  # fmt: skip
        self._penalize = params.has_penalties
        # Counts live on the device so penalties never copy them to the host.
        self._seen = torch.zeros(vocab_size, dtype=torch.bool, device=self.device)
        self._counts = torch.zeros(vocab_size, dtype=torch.float32, device=self.device)

    def observe_prompt(self, ids: Sequence[int]) -> None:
        """Mark prompt tokens as seen (they count for the repetition penalty only)."""
        if self._penalize:
            mark_seen(self._seen, ids)

    def observe(self, token_id: int) -> None:
        """Record a generated token (for all three penalties)."""
        check_id(token_id, self.vocab_size)
        if self._penalize:
            self._seen[token_id] = True
            self._counts[token_id] += 1.0

    def penalized(self, logits: torch.Tensor) -> torch.Tensor:
        """fp32 logits after the repetition, frequency and presence penalties."""
        check_logits(logits, self.vocab_size, self.device)
        x = logits.float()
        if not self._penalize:
            return x
        return penalize(x, self._seen, self._counts, *self._penalties)

    def warp(self, x: torch.Tensor) -> torch.Tensor:
        """Penalized fp32 logits -> temperature-scaled logits with the tokens that top-k,
        top-p and min-p exclude set to -inf (what `sample` draws from when not greedy)."""
        p = self.params
        x = x / self._temperature
        if 0 < p.top_k < self.vocab_size:
            kth = torch.topk(x, p.top_k).values[-1]
            x = x.masked_fill(x < kth, -math.inf)  # NOTE: ties with the k-th are kept
        if p.top_p < 1.0:
            x = _top_p(x, p.top_p)
        if p.min_p > 0.0:
            # p_i >= min_p * p_max  <=>  x_i >= x_max + log(min_p), whatever the normalization
            x = x.masked_fill(x < x.max() + math.log(p.min_p), -math.inf)
        return x

    def sample(self, logits: torch.Tensor) -> int:
        """Pick the next token from `logits` (V,) of any float dtype."""
        x = self.penalized(logits)
        if not self.params.greedy:
            x = perturbed(self.warp(x), self._seed, self._step, self._lanes)
        self._step.add_(1)  # every draw counts, greedy too (as the device samplers count)
        best = torch.argmax(x)
        # One sync for both the id and whether anything was sampleable at all. NOTE: `take`,
        # not x[best]: indexing by a 0-dim device tensor reads the index on the host (a sync).
        token = int(best.masked_fill(~torch.isfinite(x.take(best)), -1).item())
        if token < 0:
            raise ValueError(NO_TOKEN)
        return token

    def logprobs(
        self, logits: torch.Tensor, token_id: int, k: int
    ) -> tuple[float, list[tuple[int, float]]]:
        """Log-probability of `token_id` and the `k` most likely (id, log-prob), best first.

        NOTE: of the distribution after the penalties, at temperature 1 and without top-k,
        top-p or min-p (as vLLM's processed logprobs less the temperature): what the model
        believes, not the truncated distribution drawn from.
        """
        check_id(token_id, self.vocab_size)
        lp = torch.log_softmax(self.penalized(logits), dim=-1)
        k = max(0, min(k, self.vocab_size))
        top = torch.topk(lp, k)
        packed = torch.cat([lp[token_id : token_id + 1], top.values, top.indices.float()])
        values = packed.tolist()  # one sync
        ids = [int(i) for i in values[1 + k :]]
        return values[0], list(zip(ids, values[1 : 1 + k], strict=True))


def _top_p(x: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability mass reaches top_p."""
    sorted_x, order = torch.sort(x, descending=True)
    probs = torch.softmax(sorted_x, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    drop = mass_before >= top_p
    # The most likely token always stays. NOTE: fill_, not `drop[0] = False`: assigning a
    # Python scalar to a CUDA tensor element copies it from the host, a sync per draw.
    drop[0].fill_(False)
    return x.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), -math.inf)


def check_id(token_id: int, vocab_size: int) -> None:
    if not 0 <= token_id < vocab_size:
        raise ValueError(f"token id {token_id} is outside 0..{vocab_size - 1}")


def mark_seen(seen: torch.Tensor, ids: Sequence[int]) -> None:
    """Set ``seen`` (V,) bool at the prompt's ids (checked against V first)."""
    if len(ids) == 0:
        return
    for i in (min(ids), max(ids)):
        check_id(i, seen.shape[0])
    seen[torch.as_tensor(list(ids), dtype=torch.long, device=seen.device)] = True


def check_logits(logits: torch.Tensor, vocab_size: int, device: torch.device) -> None:
    if logits.dim() != 1 or logits.shape[0] != vocab_size:
        raise ValueError(f"logits: expected shape ({vocab_size},), got {tuple(logits.shape)}")
    if logits.device.type != device.type:
        raise ValueError(f"logits are on {logits.device}, the sampler on {device}")


def penalize(x: torch.Tensor, seen: torch.Tensor, counts: torch.Tensor, repetition,
             frequency, presence) -> torch.Tensor:  # fmt: skip
    """fp32 logits ``x`` after vLLM's repetition penalty (tokens ``seen`` in the prompt or
    output), then the frequency and presence penalties (output ``counts``). The three
    values may be numbers or device tensors (a captured graph reads them there).

    NOTE: a neutral value leaves x bit-identical (x / 1, x * 1, x - 0), so applying all
    three whenever one is set equals applying only those that are set."""
    x = torch.where(seen, torch.where(x > 0, x / repetition, x * repetition), x)
    x = x - frequency * counts
    return x - presence * (counts > 0).float()
