"""Layer-local consistency: every layer of every path fed the judge's own input and state.

The judge is the fp32 reference. For one chunk of tokens (a prefill chunk, or one decode
token) each decoder layer i runs in the judge on the judge's input x_i, and in each
compared path on the same x_i (in that path's dtype) with a copy of the judge's layer-i
state, so errors never compound: what a path's layer adds is its own. Reported per layer
and per layer kind: ``rel_out`` = |y_path - y| / |y| (the layer's output, residual
included, as the next layer would see it) and ``rel_delta`` = |y_path - y| / |y - x|
(the same error against what the layer itself contributed).

Models follow ``lily.model.model.Model``'s interface: ``embed(ids)``, ``layer(i, x,
state, start)`` (advances only layer i's state) and ``head(x)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from lily.runtime.state import SessionState

KIND_NAMES = {"linear_attention": "deltanet", "full_attention": "attention"}


def copy_layer_state(src: SessionState, dst: SessionState, i: int, length: int, end: int) -> None:
    """Layer i's state in ``dst`` := ``src``'s (positions [0, length) of a KV cache, with
    room up to ``end``), converted to ``dst``'s dtypes."""
    if i in src.kv:
        s, d = src.kv[i], dst.kv[i]
        d.ensure(end)
        d.k[:, :length] = s.k[:, :length].to(d.k.dtype)
        d.v[:, :length] = s.v[:, :length].to(d.v.dtype)
    else:
        s, d = src.deltanet[i], dst.deltanet[i]
        d.conv.copy_(s.conv.to(d.conv.dtype))
        d.recurrent.copy_(s.recurrent.to(d.recurrent.dtype))


@dataclass
class _Acc:
    """Sums of squares over the chunks (or decode steps) seen, per layer."""

    err: list[float] = field(default_factory=list)
    out: list[float] = field(default_factory=list)
    delta: list[float] = field(default_factory=list)

    def add(self, i: int, err: float, out: float, delta: float) -> None:
        while len(self.err) <= i:
            self.err.append(0.0), self.out.append(0.0), self.delta.append(0.0)
        self.err[i] += err
        self.out[i] += out
        self.delta[i] += delta


def _sq(t: torch.Tensor) -> float:
    return t.double().pow(2).sum().item()


class LayerCheck:
    """Runs chunks through the judge layer by layer and each path on the judge's inputs."""

    def __init__(self, judge, paths: dict, judge_state: SessionState):
        self.judge = judge
        self.paths = paths
        self.state = judge_state
        cfg = judge.cfg
        self.kinds = [KIND_NAMES[k] for k in cfg.layer_types]
        # one state per path; layer i's part is overwritten from the judge before each call
        self.pstates = {n: SessionState.new(cfg, m.device, m.dtype, judge_state.limit)
                        for n, m in paths.items()}  # fmt: skip
        self.acc: dict[str, dict[str, _Acc]] = {}

    @torch.inference_mode()
    def run(self, ids: list[int], phase: str, logits: bool = True) -> torch.Tensor:
        """Consume ``ids`` at the judge's position (one chunk); accumulate the errors under
        ``phase`` ("prefill" or "decode"); return the judge's fp32 logits of the chunk
        (its last hidden states without ``logits``)."""
        j, st = self.judge, self.state
        start = st.length
        if start + len(ids) > st.limit:
            raise ValueError(f"context of {start + len(ids)} tokens exceeds {st.limit}")
        x = j.embed(torch.tensor(ids, dtype=torch.long, device=j.device))
        acc = self.acc.setdefault(phase, {n: _Acc() for n in self.paths})
        for i in range(j.cfg.num_hidden_layers):
            outs = {}
            for name, m in self.paths.items():  # before the judge advances layer i's state
                copy_layer_state(st, self.pstates[name], i, start, start + len(ids))
                outs[name] = m.layer(i, x.to(m.dtype), self.pstates[name], start)
            y = j.layer(i, x, st, start)
            out2, delta2 = _sq(y), _sq(y - x)
            for name, yp in outs.items():
                acc[name].add(i, _sq(yp.float() - y), out2, delta2)
            x = y
        st.length = start + len(ids)
        st.tokens.extend(ids)
        return j.head(x) if logits else x

    def report(self) -> dict:
        """Per phase and path: per-layer and per-kind relative errors, and the worst."""
        out: dict = {}
        for phase, by_path in self.acc.items():
            out[phase] = {name: _summary(a, self.kinds) for name, a in by_path.items()}
        return out


def _summary(a: _Acc, kinds: list[str]) -> dict:
    def rel(num: float, den: float) -> float:
        return math.sqrt(num / den) if den > 0 else (0.0 if num == 0 else math.inf)

    layers = [
        {"layer": i, "kind": kinds[i], "rel_out": rel(a.err[i], a.out[i]),
         "rel_delta": rel(a.err[i], a.delta[i])}
        for i in range(len(a.err))
    ]  # fmt: skip
    per_kind = {}
    for kind in dict.fromkeys(kinds):
        idx = [i for i in range(len(a.err)) if kinds[i] == kind]
        if not idx:
            continue
        per_kind[kind] = {
            "rel_out": rel(sum(a.err[i] for i in idx), sum(a.out[i] for i in idx)),
            "rel_delta": rel(sum(a.err[i] for i in idx), sum(a.delta[i] for i in idx)),
            "max_rel_out": max(layers[i]["rel_out"] for i in idx),
            "max_rel_delta": max(layers[i]["rel_delta"] for i in idx),
        }
    worst = max(layers, key=lambda r: r["rel_delta"]) if layers else None
    return {"layers": layers, "kinds": per_kind, "worst": worst,
            "max_rel_out": max((r["rel_out"] for r in layers), default=0.0),
            "max_rel_delta": max((r["rel_delta"] for r in layers), default=0.0)}  # fmt: skip
