"""How well-conditioned a random model is: the reference in bf16 against itself in fp32.

``python -m lily.bench.fidelity`` builds a random model on the device (full widths; any
depth, keeping the 3:1 DeltaNet:attention pattern), prefills a context with the fp32 and
the bf16 reference (each its own state), then over the scored positions reports:

- end to end: top-1 agreement, relative L2 and perplexity ratio of the logits;
- per layer, compounded: the relative error of the residual stream after each layer;
- per layer, local: each bf16 layer fed the fp32 layer's input and state (layerwise.py);
- router flips: tokens whose top-k experts differ (local), top-k weights, 8/9 logit gaps;
- shares: |mixer output| / |residual| and |MoE output| / |residual| per layer;
- layers matter: the logits against those with every layer skipped;
- the expert-load histogram of a prefill.

It is the study behind docs/notes/fidelity.md, and runs at full size on a GPU in minutes.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import sys
import time
from types import SimpleNamespace

import torch

from lily.bench import conditioned
from lily.bench.compare import metrics
from lily.bench.consistency import prefill_context, upcast
from lily.bench.fast_context import fast_deltanet
from lily.bench.layerwise import LayerCheck
from lily.bench.measure import expert_load, pseudo_text_ids
from lily.bench.random_model import random_params
from lily.config import ModelConfig
from lily.model.model import Model
from lily.runtime.state import SessionState


def reduced_config(layers: int, base: str = "full") -> ModelConfig:
    """The ``base`` model's widths with ``layers`` layers (every 4th full attention)."""
    from lily.bench.random_model import text_config
    from lily.checkpoint import complete_text_config, make_config

    tc = {k: v for k, v in text_config(base).items() if k != "layer_types"}
    tc = complete_text_config(tc | {"num_hidden_layers": layers})
    return ModelConfig.from_dict(make_config(tc, "mlx4", torch.bfloat16))


def shared_params(cfg: ModelConfig, device, recipe, share: int, seed: int = 0) -> dict:
    """``random_params`` (bf16), except that layer i's experts' packed codes are layer
    (i % share)'s (their scales its own): a deep full-width model in the memory of about
    ``share`` layers, for studies on a small machine. Everything else (routers included,
    so a token meets other experts in each layer) is drawn per layer. ``share`` must keep
    the layer kinds (a multiple of 4)."""
    from lily.bench.random_model import packing, random_tensor
    from lily.quant import QuantWeight
    from lily.weights import canonical_shapes

    kinds = cfg.layer_types
    if any(kinds[i] != kinds[i % share] for i in range(len(kinds))):
        raise ValueError(f"--share-layers {share} does not keep the layer kinds")
    bits, out = packing(cfg), {}
    for name, shape in canonical_shapes(cfg).items():
        key = name
        if name.endswith(("moe.gate_proj", "moe.up_proj", "moe.down_proj")):
            _, i, rest = name.split(".", 2)
            key = f"layers.{int(i) % share}.{rest}"
        w = random_tensor(cfg, name, shape, bits[name], torch.device(device), seed,
                          torch.bfloat16, recipe, out.get("embed_tokens"), key)  # fmt: skip
        if key != name and isinstance(w, QuantWeight):
            w.qweight = out[key].qweight  # the same codes: keep one copy
        out[name] = w
    return out


@contextlib.contextmanager
def _recording(log: list):
    """Every reference ``route`` call's (weights, ids, logits) appended to ``log``; every
    reference MoE output's norm per row (``sparse_moe`` as lily/model/ops.py calls it)
    appended as ("moe", norms)."""
    import lily.model.moe as moe
    import lily.model.ops as ops

    # NOTE: both are looked up in their modules at call time; fail loudly if that changes
    if not (hasattr(moe, "route") and hasattr(ops, "sparse_moe")):
        raise RuntimeError("lily.model.moe.route or lily.model.ops.sparse_moe is gone")
    route, sparse = moe.route, ops.sparse_moe

    def rec_route(logits, top_k, renorm):
        w, ids = route(logits, top_k, renorm)
        log.append(("route", w.float().cpu(), ids.cpu(), logits.float().cpu()))
        return w, ids

    def rec_moe(*a, **kw):
        out = sparse(*a, **kw)
        log.append(("moe", out.float().norm(dim=-1).cpu()))
        return out

    moe.route, ops.sparse_moe = rec_route, rec_moe
    try:
        yield log
    finally:
        moe.route, ops.sparse_moe = route, sparse


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@torch.inference_mode()
def study(cfg, params, context: int, positions: int, seed: int = 0, chunk: int = 2048,
          load_tokens: int = 0) -> dict:  # fmt: skip
    """The report (module docstring) for ``params`` (bf16 dense tensors) on its device."""
    dev = params["norm"].device
    ids = pseudo_text_ids(context + positions + 1, cfg.vocab_size, seed)
    scored = ids[context : context + positions]
    limit = context + positions + 1
    m32 = Model(cfg, upcast(params, torch.float32), torch.float32, kernels=False)
    m16 = Model(cfg, params, torch.bfloat16, kernels=False)
    s32 = SessionState.new(cfg, dev, torch.float32, limit)
    s16 = SessionState.new(cfg, dev, torch.bfloat16, limit)
    t0 = time.perf_counter()
    prefill_context(m32, s32, ids[:context])
    prefill_context(m16, s16, ids[:context])
    t_ctx = time.perf_counter() - t0
    local = copy.deepcopy(s32)  # the layer-local check starts from the same fp32 state

    # end to end, compounding: both paths layer by layer on their own states
    t = torch.tensor(scored, dtype=torch.long, device=dev)
    x32, x16 = m32.embed(t), m16.embed(t)
    x_skip = x32
    layers = []
    for i, kind in enumerate(cfg.layer_types):
        log: list = []
        with _recording(log):
            y32 = m32.layer(i, x32, s32, context)
        y16 = m16.layer(i, x16, s16, context)
        xn = x32.float().norm(dim=-1)
        row = {"layer": i, "kind": kind, "residual_rms": (xn / cfg.hidden_size**0.5).mean().item(),
               "compound_rel": _rel(y16.float(), y32),
               "update_share": ((y32 - x32).float().norm(dim=-1) / xn).mean().item()}  # fmt: skip
        moe = [r[1].to(xn.device) for r in log if r[0] == "moe"]
        if moe:  # the MoE's own output, where the model's code lets it be observed
            mix = (y32 - x32).float().norm(dim=-1).pow(2) - moe[0].pow(2)
            row["moe_share"] = (moe[0] / xn).mean().item()
            row["mixer_share_approx"] = (mix.clamp_min(0).sqrt() / xn).mean().item()
        layers.append(row)
        x32, x16 = y32, y16
    both = m32.head(torch.cat([x32, x_skip]))  # one pass over the lm_head (CPU: 20 s)
    l32, skip, l16 = both[:positions], both[positions:], m16.head(x16)
    tgt = ids[context : context + positions + 1]
    e2e = metrics(l16.cpu(), l32.cpu(), tgt)
    top = l32.topk(2, -1).values
    logit_stats = {
        "std": l32.std(-1).mean().item(),
        "top1_margin_over_std": ((top[:, 0] - top[:, 1]) / l32.std(-1)).median().item(),
        "top1_minus_mean_over_std": ((top[:, 0] - l32.mean(-1)) / l32.std(-1)).mean().item(),
    }
    matter = {
        "rel_l2": _rel(l32, skip),
        "top1_agreement_pct": 100 * (l32.argmax(-1) == skip.argmax(-1)).double().mean().item(),
    }

    # layer-local: bf16 layers on the fp32 input and state; router decisions of both
    log = []
    check = LayerCheck(m32, {"bf16_reference": m16}, local)
    with _recording(log):
        check.run(scored, "prefill", logits=False)
    routes = [r for r in log if r[0] == "route"]  # per layer: the path's, then the judge's
    flips = []
    for i in range(cfg.num_hidden_layers if len(routes) == 2 * cfg.num_hidden_layers else 0):
        (_, _, id16, _), (_, w32, id32, lg) = routes[2 * i], routes[2 * i + 1]
        diff = (id16.sort(-1).values != id32.sort(-1).values).any(-1)
        srt = lg.sort(-1, descending=True).values
        k = cfg.num_experts_per_tok
        flips.append({"layer": i, "tokens_flipped": int(diff.sum()), "tokens": len(scored),
                      "w1": w32[:, 0].mean().item(), "wk": w32[:, k - 1].mean().item(),
                      "gap_k_k1_median": (srt[:, k - 1] - srt[:, k]).median().item(),
                      "logit_std": lg.std(-1).mean().item()})  # fmt: skip
    out = {
        "config": {"layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size,
                   "experts": cfg.num_experts, "vocab": cfg.vocab_size},
        "context": context, "positions": positions, "device": str(dev),
        "context_s": t_ctx, "end_to_end_bf16_vs_fp32": e2e, "logits": logit_stats,
        "layers_matter": matter, "per_layer": layers, "router": flips,
        "layer_local": check.report()["prefill"]["bf16_reference"],
    }  # fmt: skip
    if load_tokens:
        shim = SimpleNamespace(cfg=cfg, model=m16, engine_cfg=SimpleNamespace(prefill_chunk=chunk),
                               new_state=lambda: SessionState.new(cfg, dev, torch.bfloat16,
                                                                  load_tokens))  # fmt: skip
        with fast_deltanet():
            load = expert_load(shim, pseudo_text_ids(load_tokens, cfg.vocab_size, seed + 1))
        load.pop("counts")
        out["expert_load"] = load
    return out


def parse_recipe(text: str | None) -> conditioned.Recipe | None:
    """``plain``, or comma-separated ``field=value`` overrides of the default recipe."""
    if text == "plain":
        return None
    r = conditioned.DEFAULT
    if not text:
        return r
    fields = {f.name: f.type for f in dataclasses.fields(r)}
    for item in text.split(","):
        key, _, val = item.partition("=")
        key = key.strip()
        if key not in fields:
            raise ValueError(f"unknown recipe field {key!r} (known: {', '.join(fields)})")
        cur = getattr(r, key)
        value = (
            val.strip().lower() in ("1", "true", "yes") if isinstance(cur, bool) else type(cur)(val)
        )
        r = dataclasses.replace(r, **{key: value})
    return r


def summary(res: dict) -> str:
    """A few lines for the terminal."""
    e = res["end_to_end_bf16_vs_fp32"]
    lines = [
        f"{res['config']['layers']} layers, context {res['context']}, {res['positions']} "
        f"positions: bf16 vs fp32 top-1 {e['top1_agreement_pct']:.2f}%, rel L2 "
        f"{e['rel_l2']:.3g}, ppl ratio {e['perplexity']['ratio']:.5f}",
        f"layers matter: rel L2 vs all skipped {res['layers_matter']['rel_l2']:.3g} (top-1 "
        f"agreement {res['layers_matter']['top1_agreement_pct']:.1f}%); logit top-1 margin "
        f"{res['logits']['top1_margin_over_std']:.2f} std",
        "layer kind    compound  local_out local_delta update moe  flips  w1    wk",
    ]
    none = {"tokens_flipped": -1, "tokens": 0, "w1": 0.0, "wk": 0.0}  # routing not observed
    router = res["router"] or [none] * len(res["per_layer"])
    for row, loc, fl in zip(res["per_layer"], res["layer_local"]["layers"], router, strict=True):
        lines.append(
            f"{row['layer']:>5} {loc['kind']:<9} {row['compound_rel']:.2e} {loc['rel_out']:.2e}"
            f"  {loc['rel_delta']:.2e}  {row['update_share']:.3f} {row.get('moe_share', 0):.3f}"
            f" {fl['tokens_flipped']:>3}/{fl['tokens']:<3} {fl['w1']:.3f} {fl['wk']:.4f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lily.bench.fidelity", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--layers", type=int, default=40, help="depth (full widths)")
    ap.add_argument("--context", type=int, default=4096, help="tokens before the scored ones")
    ap.add_argument("--positions", type=int, default=192, help="scored positions")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--recipe",
        default=None,
        help="'plain' (the old uniform init) or overrides such as "
        "router_std=0.9,token_every=0 (default: the conditioned model)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--chunk", type=int, default=2048, help="context prefill chunk")
    ap.add_argument("--load-tokens", type=int, default=0, help="expert-load histogram tokens")
    ap.add_argument(
        "--share-layers",
        type=int,
        default=0,
        help="layer i reuses layer i%%N's codes (deep models in little memory)",
    )
    ap.add_argument("--out", help="write the JSON here")
    args = ap.parse_args(argv)
    recipe = parse_recipe(args.recipe)
    cfg = reduced_config(args.layers)
    t0 = time.perf_counter()
    if args.share_layers:
        params = shared_params(cfg, args.device, recipe, args.share_layers, args.seed)
    else:
        params = random_params(cfg, args.device, seed=args.seed, recipe=recipe)
    built = time.perf_counter() - t0
    res = study(cfg, params, args.context, args.positions, args.seed, args.chunk,
                args.load_tokens)  # fmt: skip
    res |= {"recipe": None if recipe is None else dataclasses.asdict(recipe),
            "build_s": built, "total_s": time.perf_counter() - t0}  # fmt: skip
    print(summary(res), file=sys.stderr)
    text = json.dumps(res, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
