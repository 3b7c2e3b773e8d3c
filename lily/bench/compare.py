"""``lily compare``: teacher forcing on our engine and a reference over the same tokens.

Every position predicts from the same reference prefix, so errors never compound. The
figures are those the original engine reported (top-1 agreement, perplexity ratio) plus
the relative L2 error of the logits, which means more on random weights.
"""

from __future__ import annotations

import math

import torch

SCHEMA = "lily.compare/1"
# The original engine (Rust/Metal) against MLX-LM over 192 positions of a reference text.
ORIGINAL = {"reference": "MLX-LM", "top1_agreement_pct": 96.35, "perplexity_delta_pct": 0.04}


def metrics(ours: torch.Tensor, ref: torch.Tensor, ids: list[int]) -> dict:
    """Compare logits (P, V) at positions 0..P-1 whose targets are ``ids[1 : P + 1]``."""
    if ours.shape != ref.shape:
        raise ValueError(f"logits shapes differ: ours {tuple(ours.shape)}, reference "
                         f"{tuple(ref.shape)}")  # fmt: skip
    p = ours.shape[0]
    if len(ids) < p + 1:
        raise ValueError(f"need {p + 1} token ids for {p} positions, got {len(ids)}")
    a, b = ours.double(), ref.double()
    target = torch.tensor(ids[1 : p + 1])
    la, lb = torch.log_softmax(a, -1), torch.log_softmax(b, -1)
    nll_a = -la.gather(1, target[:, None]).mean().item()
    nll_b = -lb.gather(1, target[:, None]).mean().item()
    kl = (lb.exp() * (lb - la)).sum(-1)  # KL(reference || ours) per position
    ppl_a, ppl_b = math.exp(nll_a), math.exp(nll_b)
    return {
        "positions": p,
        "top1_agreement_pct": 100.0 * (a.argmax(-1) == b.argmax(-1)).double().mean().item(),
        "perplexity": {
            "ours": ppl_a,
            "reference": ppl_b,
            "ratio": ppl_a / ppl_b,
            "delta_pct": 100.0 * (ppl_a / ppl_b - 1.0),
        },
        "rel_l2": ((a - b).norm() / b.norm()).item(),
        "max_abs_diff": (a - b).abs().max().item(),
        "mean_kl": kl.mean().item(),
        "ours_top1_matches_next_pct": 100.0 * (a.argmax(-1) == target).double().mean().item(),
    }


def run_compare(ours, ref, ids: list[int], positions: int) -> dict:
    """Score ``ids`` (positions + 1 tokens) on both adapters and compare."""
    a = ours.score(ids)[:positions]
    b = ref.score(ids)[:positions]
    return metrics(a, b, ids)


def table(res: dict) -> str:
    """The short side-by-side table printed after a compare."""
    ref = res["reference"]
    p = res["perplexity"]
    rows = [
        ("", f"lily vs {ref}", f"original engine vs {ORIGINAL['reference']}"),
        ("positions", str(res["positions"]), "192"),
        ("top-1 agreement", f"{res['top1_agreement_pct']:.2f}%",
         f"{ORIGINAL['top1_agreement_pct']:.2f}%"),
        ("perplexity ours/ref", f"{p['ratio']:.5f} ({p['delta_pct']:+.3f}%)",
         f"({ORIGINAL['perplexity_delta_pct']:+.2f}%)"),
        ("relative L2 of logits", f"{res['rel_l2']:.3g}", "-"),
        ("mean KL(ref || ours)", f"{res['mean_kl']:.3g}", "-"),
    ]  # fmt: skip
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    return "\n".join(f"{r[0]:<{w0}}  {r[1]:<{w1}}  {r[2]}" for r in rows)


def tables(out: dict) -> str:
    """``table`` for each context of a ``lily compare`` run."""
    parts = []
    for run in out.get("contexts", [out]):
        head = f"context {run.get('context', 0)} tokens, then {run['positions']} positions"
        parts.append(head + "\n" + table({**run, "reference": out["reference"]}))
    return "\n\n".join(parts)
