"""The well-conditioned random model: weight statistics under which bf16 agrees with fp32.

Uniform random weights make a rounding-chaotic model (docs/notes/fidelity.md): router
near-ties swap experts, every branch passes its input's noise on at gain >= 1 through 80
residual branches, the bf16 residual is re-rounded 80 times, and the top-1 of 248K
Gaussian logits is often within a bf16 ulp of the second. ``Recipe`` holds the choices
that remove each cause; the shapes and the MLX layout stay, so speed is unchanged:

- token dims: one 64-dim group in every ``token_every`` of the residual carries the token
  embedding, and no layer writes there (the output projections' rows are zero), so it is
  never re-rounded. The layers write the other dims and read them at ``read_w`` of the
  token dims' weight (norm weights): a layer's noise reaches the next ones damped;
- branch outputs grow by ``growth`` per layer up to ``w_energy`` times the token energy
  (trained residual streams grow with depth); update ratios about 0.05-0.2 per branch;
- routing by token codes (``sparse_router``): each token's embedding has k large values
  on the first E token dims, and expert j of a layer reads one of them (a permutation per
  layer) plus a small dense part, so the top-k set has a wide margin (no swaps); the
  small values lean negative so that tokens share no mean direction (``zero_mean``: a
  long context's attention average would keep it and write far more than designed);
- attention's output projection is scaled for what its average keeps at
  ``attn_context``, recurring tokens included (``attn_average``);
- lm_head: the token groups of row v are the embedding of token perm(v), a bigram direct
  path whose logit stands out of the bulk; the layers' dims give ``logit_w_share`` of the
  logits' variance;
- exact bf16 dequantization: 4-bit scales with 4 significant bits and bias -7.5*scale,
  8-bit scales powers of two and bias -127.5*scale: ``scale*q + bias`` is exact in bf16.

Everything derives from the config: a reduced-depth full-width model is the same
generator as the full one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lily.config import ModelConfig
from lily.quant import QuantWeight, pack

GROUP = 64
_SILU_RMS = 0.5968  # rms of silu(z), z ~ N(0, 1)
_SIGMOID_RMS = 0.5417  # rms of sigmoid(z), z ~ N(0, 1)
_BIG = (2.0, 4.0)  # a token's k routed values, in code units
_SMALL = 0.15  # its other routed values (they quantize to +-0.27 units)
_ROUTER_NOISE = 0.3  # router logit std of the dense part, in units; skew 2: ~2.5x share


@dataclass(frozen=True)
class Recipe:
    """The statistics of the conditioned model (module docstring); ablations flip one."""

    token_every: int = 8  # 0: no token dims (layers write every dim, read with weight 1)
    read_w: float = 0.2  # norm weight on the layers' dims (token dims: 1)
    final_w: float = 1.0  # final norm weight on the layers' dims
    w_energy: float = 2.0  # layers' energy / token energy in the last residual
    growth: float = 1.05  # branch output rms growth per layer
    sparse_router: bool = True  # route by token codes (else Gaussian, ``router_std``)
    router_max: float = 2.0  # sparse router: the largest logit (big values 2-4 -> 1-2)
    router_std: float = 0.9  # Gaussian router logit std (the plain init's is 0.9)
    score_std: float = 1.5  # attention score standard deviation (q_norm, k_norm)
    attn_context: int = 4096  # context the attention output scale is set for
    repeat: float = 1e-3  # sum of squared unigram frequencies of the text (pseudo-text's)
    logit_std: float = 2.0  # standard deviation of the logits over the vocabulary
    logit_w_share: float = 0.5  # share of that variance from the layers' dims
    bigram: bool = True  # lm_head token groups = permuted embedding
    slow_decay: bool = True  # DeltaNet dt in [1e-3, 0.1] (else softplus(N(1, 0.1)): ~1.3)
    exact_bf16: bool = True  # scales with few significant bits (exact dequantization)
    zero_mean: bool = True  # token codes average to zero over tokens (no common direction)


DEFAULT = Recipe()


def token_groups(d: int, recipe: Recipe) -> torch.Tensor:
    """(D // 64,) bool: the residual's groups that carry the token embedding."""
    if not recipe.token_every:
        return torch.zeros(d // GROUP, dtype=torch.bool)
    return torch.arange(d // GROUP) % recipe.token_every == 0


def token_dims(d: int, recipe: Recipe) -> torch.Tensor:
    """(D,) bool: the token dims (``token_groups`` expanded)."""
    return token_groups(d, recipe).repeat_interleave(GROUP)


def _scale4(x: float) -> float:
    """The 4-significant-bit number nearest ``x`` (> 0)."""
    e = math.floor(math.log2(x))
    return min(15, max(8, round(x / 2**e * 8))) * 2.0 ** (e - 3)


def _small_mean(cfg: ModelConfig, recipe: Recipe) -> float:
    """Mean of a token's small routed values, in units: with ``zero_mean`` it cancels the
    k big ones on average, so every token dim averages to zero over tokens (256 experts:
    -0.097). It stays within ``_SMALL`` of zero so the values stay small: with few experts
    (the tiny model's 6 small per 2 big) the mean is only partly cancelled."""
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    return -min(_SMALL, k * sum(_BIG) / 2 / (e - k)) if recipe.zero_mean else 0.0


@dataclass(frozen=True)
class TokenCode:
    """The embedding's token groups: their 4-bit scale, the value of one code unit (big
    values are 2-4 units) and the energy over the token dims (8-bit: about the same)."""

    scale: float
    unit: float
    energy: float


def token_code(cfg: ModelConfig, recipe: Recipe) -> TokenCode:
    d, e, k = cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok
    n_tok = int(token_dims(d, recipe).sum())
    if not n_tok:
        return TokenCode(0.0, 1.0, float(d))  # a plain embedding of rms 1
    hi, lo = _BIG[1], _BIG[0]
    s = _scale4(hi / 7.5) if recipe.exact_bf16 else hi / 7.5
    big = (lo * lo + lo * hi + hi * hi) / 3  # E[U(lo, hi)^2]
    small = (0.5 * s) ** 2  # they round to +-s/2 (stochastically with zero_mean)
    dense = (hi / 2.5) ** 2
    ms = (k * big + (e - k) * small + (n_tok - e) * dense) / n_tok
    # a power of two keeps the dequantization exact; rms within sqrt(2) of 1
    unit = 2.0 ** -round(0.5 * math.log2(ms)) if recipe.exact_bf16 else ms**-0.5
    return TokenCode(s * unit, unit, n_tok * ms * unit * unit)


@dataclass(frozen=True)
class LayerPlan:
    """Designed statistics of one layer."""

    h_mixer: float  # |rmsnorm(x)| at the mixer's input
    h_moe: float  # and at the MoE's
    c_moe: float  # 1 / rms(x) at the MoE's input (token dims of h = x * c)
    out_rms: float  # each branch's output rms over the layers' dims


def plan(cfg: ModelConfig, recipe: Recipe) -> list[LayerPlan]:
    """The residual stream as designed: geometric branch growth to ``w_energy``."""
    d = cfg.hidden_size
    n_w = d - int(token_dims(d, recipe).sum())
    tok = token_code(cfg, recipe).energy
    steps = sum(recipe.growth ** (2 * i) for i in range(cfg.num_hidden_layers))
    b0 = math.sqrt(recipe.w_energy * tok / (2 * n_w * steps))
    read = recipe.read_w if n_w < d else 1.0

    def h_norm(w: float) -> float:
        return math.sqrt(d * (tok + read * read * w) / (tok + w))

    out, acc = [], 0.0
    for i in range(cfg.num_hidden_layers):
        b = b0 * recipe.growth**i
        mid = acc + b * b * n_w
        out.append(LayerPlan(h_norm(acc), h_norm(mid), math.sqrt(d / (tok + mid)), b))
        acc += 2 * b * b * n_w
    return out


# ---- packed tensors


def _scales(std: torch.Tensor, bits: int, exact: bool, g) -> torch.Tensor:
    """Per-group scales (fp32) for codes uniform on 0..2^bits-1 so that weights have
    standard deviation ``std`` (one per group), varied +-20% per group. ``exact``: 4
    significant bits (4-bit) or a power of two (8-bit)."""
    levels = 1 << bits
    step = std / math.sqrt((levels * levels - 1) / 12)
    s = step * torch.empty(std.shape, device=std.device).uniform_(0.8, 1.2, generator=g)
    if not exact:
        return s
    e = torch.log2(s.clamp_min(1e-30))
    if bits == 8:
        return torch.where(s > 0, torch.exp2(torch.round(e)), 0.0)
    m = torch.round(s / torch.exp2(torch.floor(e)) * 8).clamp(8, 15)
    return torch.where(s > 0, m * torch.exp2(torch.floor(e) - 3), 0.0)


def _quant(words: torch.Tensor, s: torch.Tensor, bits: int) -> QuantWeight:
    """Codes ``words`` with scales ``s`` and the symmetric bias -s*(2^bits-1)/2."""
    b = -s * ((1 << bits) - 1) / 2
    return QuantWeight(words, s.to(torch.bfloat16), b.to(torch.bfloat16), bits, GROUP)


def random_quant(shape, bits: int, std: torch.Tensor, exact: bool, device, g) -> QuantWeight:
    """Uniform random codes; scales from ``std`` (broadcast to (..., N, K/64)). Groups with
    std 0 are exactly zero."""
    *lead, n, k = shape
    words = torch.empty((*lead, n, k * bits // 32), dtype=torch.int32, device=device)
    words.random_(-(2**31), 2**31, generator=g)
    gshape = (*lead, n, k // GROUP)
    return _quant(words, _scales(std.to(device).float().expand(gshape), bits, exact, g), bits)


def _rows(n: int, std: float, zero: torch.Tensor | None = None) -> torch.Tensor:
    """(n, 1) row standard deviations; rows in ``zero`` get 0."""
    r = torch.full((n, 1), float(std))
    if zero is not None:
        r[zero] = 0.0
    return r


def embedding(cfg: ModelConfig, recipe: Recipe, bits: int, device, g) -> QuantWeight:
    """(V, D). Token dims: on the first E (one per expert) each token has k big values
    (its experts) and small ones elsewhere; further token dims random. The layers' dims
    are zero. Without token dims: uniform random codes, rms 1."""
    v, d = cfg.vocab_size, cfg.hidden_size
    tok = token_groups(d, recipe)
    if not tok.any():
        return random_quant((v, d), bits, torch.ones(1, d // GROUP), recipe.exact_bf16, device, g)
    n_tok = int(tok.sum()) * GROUP
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    if e > n_tok:
        raise ValueError(f"{e} experts need as many token dims, have {n_tok}")
    code = token_code(cfg, recipe)
    half = ((1 << bits) - 1) / 2
    s = code.scale / code.unit  # the 4-bit scale, in units
    if bits != 4:  # a power of two near the same range (exact dequantization)
        s = 2.0 ** round(math.log2(_BIG[1] / half)) if recipe.exact_bf16 else _BIG[1] / half
    vals = torch.empty(v, n_tok, device=device)
    # The k big values are positive: without an offset on the small ones every token would
    # share a mean direction (~16% of its norm at full size) that a long context's
    # attention average keeps while it averages the rest away (docs/notes/fidelity.md).
    vals[:, :e].normal_(_small_mean(cfg, recipe), _SMALL, generator=g)
    vals[:, e:].normal_(0.0, _BIG[1] / 2.5, generator=g)
    big = torch.rand(v, e, device=device, generator=g).argsort(-1)[:, :k]
    vals[:, :e].scatter_(1, big, torch.empty(v, k, device=device).uniform_(*_BIG, generator=g))
    if recipe.zero_mean:  # stochastic rounding: the codes' mean is the values' (no bias)
        dither = torch.rand(vals.shape, device=device, generator=g)
        codes = torch.floor(vals / s + half + dither).clamp(0, 2 * half).int()
    else:
        codes = torch.round(vals / s + half).clamp(0, 2 * half).int()
    # the layers' groups have scale and bias 0: their codes do not matter (zeros)
    per = 32 // bits
    words = torch.zeros(v, d // GROUP, GROUP // per, dtype=torch.int32, device=device)
    words[:, tok.to(device)] = pack(codes, bits).view(v, -1, GROUP // per)
    scales = torch.where(tok.to(device), s * code.unit, 0.0).expand(v, -1)
    return _quant(words.view(v, -1), scales, bits)


def lm_head(cfg: ModelConfig, recipe: Recipe, bits: int, device, g, embed: QuantWeight):
    """(V, D): token groups of row v = c * embedding row perm(v) (bigram direct path),
    the layers' groups random; scales set from the designed last residual."""
    v, d = cfg.vocab_size, cfg.hidden_size
    tok = token_groups(d, recipe)
    if not tok.any() or not recipe.bigram:
        std = _rows(v, recipe.logit_std / math.sqrt(d))
        return random_quant((v, d), bits, std, recipe.exact_bf16, device, g)
    a = recipe.w_energy
    h_tok = math.sqrt(d / (1 + a))  # |h| over the token dims in the last residual
    h_w = recipe.final_w * math.sqrt(a * d / (1 + a))
    w_std = recipe.logit_std * math.sqrt(recipe.logit_w_share) / h_w
    out = random_quant((v, d), bits, torch.where(tok, 0.0, w_std).view(1, -1).expand(v, -1),
                       recipe.exact_bf16, device, g)  # fmt: skip
    rms = math.sqrt(token_code(cfg, recipe).energy / (int(tok.sum()) * GROUP))
    tok_std = recipe.logit_std * math.sqrt(1 - recipe.logit_w_share) / (h_tok * rms)
    perm = torch.randperm(v, generator=g, device=device)[:, None]
    cols = torch.nonzero(tok.to(device)).view(-1)
    per = 32 // bits
    wcols = (cols[:, None] * (GROUP // per) + torch.arange(GROUP // per, device=device)).view(-1)
    out.qweight[:, wcols] = embed.qweight[perm, wcols[None, :]]
    # the embedding's codes under one scale: ``tok_std`` times the embedding's, rounded to
    # what keeps the dequantization exact (4 significant bits: within 6%; 8-bit: a power
    # of two)
    want = float(embed.scales[0, cols[0]]) * tok_std
    if not recipe.exact_bf16:
        sh = want
    else:
        sh = _scale4(want) if bits == 4 else 2.0 ** round(math.log2(want))
    out.scales[:, cols] = sh
    out.biases[:, cols] = -sh * ((1 << bits) - 1) / 2
    return out


def router(cfg: ModelConfig, recipe: Recipe, lp: LayerPlan, bits: int, device, g):
    """(E, D): expert j reads token dim perm(j) (so a token's k big values pick its k
    experts; logits up to ``router_max``) plus a dense part (context). Per group a
    power-of-two scale fitted to its largest value (exact dequantization)."""
    e, d = cfg.num_experts, cfg.hidden_size
    cols = torch.nonzero(token_dims(d, recipe)).view(-1)[:e].to(device)
    perm = torch.randperm(e, generator=g, device=device)
    temp = recipe.router_max / _BIG[1]  # logit per code unit
    vals = torch.empty(e, d, device=device).normal_(0.0, temp * _ROUTER_NOISE / lp.h_moe,
                                                    generator=g)  # fmt: skip
    lam = temp / (token_code(cfg, recipe).unit * lp.c_moe)
    vals[torch.arange(e, device=device), cols[perm]] = lam
    half = ((1 << bits) - 1) / 2
    top = vals.abs().view(e, d // GROUP, GROUP).amax(-1)
    s = torch.exp2(torch.ceil(torch.log2(top / half)))
    codes = torch.round(vals / s.repeat_interleave(GROUP, -1) + half).clamp(0, 2 * half).int()
    return _quant(pack(codes, bits), s, bits)


def layer_quant(cfg: ModelConfig, recipe: Recipe, name: str, shape, bits: int, device, g):
    """A packed layer weight (``layers.i.*``) with the recipe's statistics."""
    i = int(name.split(".")[1])
    leaf = name.split(".", 2)[2]
    lp = plan(cfg, recipe)[i]
    tok = token_dims(cfg.hidden_size, recipe)
    if leaf == "moe.router" and recipe.sparse_router and tok.any():
        return router(cfg, recipe, lp, bits, device, g)
    h = lp.h_moe if leaf.startswith("moe.") else lp.h_mixer
    unit = {  # input projections: pre-activation standard deviation (times 1/|h|)
        "dn.in_proj_qkv": 1.0, "dn.in_proj_z": 1.0, "dn.in_proj_b": 1.0, "dn.in_proj_a": 0.5,
        "attn.q_proj": 1.0, "attn.k_proj": 1.0, "attn.v_proj": 1.0,
        "moe.router": recipe.router_std, "moe.gate_proj": 1.0, "moe.up_proj": 1.0,
        "moe.shared_gate_proj": 1.0, "moe.shared_up_proj": 1.0, "moe.shared_expert_gate": 1.0,
    }  # fmt: skip
    n = shape[-2]
    if leaf in unit:
        return random_quant(shape, bits, _rows(n, unit[leaf] / h), recipe.exact_bf16, device, g)
    # output projections: the layers' dims only, each branch ``out_rms`` (MoE: half routed)
    act = {  # rms of the activation each output projection reads
        "dn.out_proj": _SILU_RMS,
        "attn.o_proj": _SIGMOID_RMS / math.sqrt(attn_average(recipe)),
        "moe.down_proj": _SILU_RMS * _routed_rms(cfg, recipe),
        "moe.shared_down_proj": _SIGMOID_RMS * _SILU_RMS,
    }
    if leaf not in act:
        raise ValueError(f"no conditioned statistics for {name}")
    target = lp.out_rms / math.sqrt(2) if leaf.startswith("moe.") else lp.out_rms
    std = target / (act[leaf] * math.sqrt(shape[-1]))
    return random_quant(shape, bits, _rows(n, std, tok), recipe.exact_bf16, device, g)


def attn_average(recipe: Recipe) -> float:
    """How many independent values the attention averages over ``attn_context`` tokens.
    Softmax weights of log-normal spread (score std sigma) count N exp(-sigma^2) keys;
    but a recurring token brings one key and one value at each occurrence, so its total
    weight is its count times one weight: the sum of squared weights gains exp(sigma^2)
    times the text's sum of squared unigram frequencies, which no context length averages
    away (pseudo-text, 1e-3: about 84 values at 4K and 100 at 32K instead of 430 and
    3,450; docs/notes/fidelity.md)."""
    spread = math.exp(recipe.score_std**2)
    return max(1.0, 1.0 / (spread * (1.0 / recipe.attn_context + recipe.repeat)))


def _routed_rms(cfg: ModelConfig, recipe: Recipe) -> float:
    """rms of sum_k w_k y_k for unit independent y_k: sqrt(E[sum w_k^2]) of the top-k
    weights (a fixed draw of the router's logits: deterministic)."""
    gen = torch.Generator().manual_seed(0)
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    if recipe.sparse_router and recipe.token_every:
        z = torch.empty(1024, k).uniform_(*_BIG, generator=gen) * recipe.router_max / _BIG[1]
    else:
        z = (torch.randn(1024, e, generator=gen) * recipe.router_std).topk(k, -1).values
    w = torch.softmax(z, -1)
    return math.sqrt(w.pow(2).sum(-1).mean().item())


def dense(cfg: ModelConfig, recipe: Recipe, name: str, shape, device, g) -> torch.Tensor:
    """A dense parameter (fp32 values of bf16 precision; A_log full fp32)."""
    leaf = name.rsplit(".", 1)[-1]
    t = torch.empty(shape, dtype=torch.float32, device=device)
    if leaf == "A_log":
        return t.uniform_(1.0, 16.0, generator=g).log_()
    if leaf == "dt_bias" and not recipe.slow_decay:
        return t.normal_(1.0, 0.1, generator=g).bfloat16().float()
    if leaf == "dt_bias":  # softplus^-1 of dt log-uniform on [1e-3, 0.1]
        dt = t.uniform_(math.log(1e-3), math.log(0.1), generator=g).exp_()
        return (dt + torch.log(-torch.expm1(-dt))).bfloat16().float()
    if leaf == "conv1d":
        return t.uniform_(-0.5, 0.5, generator=g).bfloat16().float()
    base = 1.0 + 0.02 * t.normal_(0.0, 1.0, generator=g)
    if leaf in ("q_norm", "k_norm"):
        base = base * math.sqrt(recipe.score_std)
    elif name == "norm" or leaf in ("input_norm", "post_norm"):
        tok = token_dims(cfg.hidden_size, recipe).to(device)
        if tok.any():  # the layers' dims are read (finally: weighted) less
            w = recipe.final_w if name == "norm" else recipe.read_w
            base = torch.where(tok, base, base * w)
    return base.bfloat16().float()
