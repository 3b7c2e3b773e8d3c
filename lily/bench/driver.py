"""``lily bench``: build or load the model, measure ceilings, start peers, sweep, report."""

from __future__ import annotations

import dataclasses
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from lily.bench import measure, peers, report
from lily.bench.random_model import (
    fingerprint,
    params_nbytes,
    save_mlx_checkpoint,
    skewed_params,
)
from lily.bench.source import canonical_params, describe, engine_from_params
from lily.bench.sweep import LilyAdapter, LocalEngine, Slot, sweep
from lily.config import EngineConfig

BENCH_LENGTHS = [256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072]


@dataclasses.dataclass
class BenchPlan:
    """Everything ``lily bench`` was asked, after validation."""

    source: dict  # lily.bench.source dict (device, dtype, chunk, kernels included)
    lengths: list[int]
    decode_tokens: int
    peers: list[str]
    rounds: int
    out: Path
    skew: float = 0.0
    budget_s: float = 0.0  # the whole run, setup included; 0 = no limit
    point_budget_s: float = math.inf
    disk_load: bool = False
    disk_dir: str | None = None
    load_tokens: int = 2048
    seed: int = 0


def parse_lengths(text: str | None, flag: str = "--lengths", least: int = 1) -> list[int] | None:
    """``"256,1K,2k"`` -> [256, 1024, 2048]; None when not given. Errors name ``flag``;
    counts below ``least`` are refused."""
    if not text:
        return None
    out = []
    for part in text.split(","):
        s = part.strip().upper()
        try:
            n = int(s[:-1]) * 1024 if s.endswith("K") else int(s)
        except ValueError:
            raise ValueError(f"{flag}: {part.strip()!r} is not a token count") from None
        if n < least:
            bound = "positive" if least == 1 else f">= {least}"
            raise ValueError(f"{flag}: {n} must be {bound}")
        out.append(n)
    return sorted(set(out))


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _build_ours(plan: BenchPlan, result: dict):
    """Our engine (timed build or load), its parameters and config."""
    src = plan.source
    sync = lambda: measure.sync(src["device"])  # noqa: E731
    t0 = time.perf_counter()
    if src["kind"] == "random":
        cfg, params, text_cfg = canonical_params(src)
        sync()
        result["model"]["build_s"] = time.perf_counter() - t0
        from lily.bench.source import engine_config

        engine = engine_from_params(cfg, params, engine_config(src), name=describe(src))
    else:
        from lily.bench.source import lily_engine

        engine = lily_engine(src)
        sync()
        result["model"]["load_s"] = time.perf_counter() - t0
        cfg, text_cfg = engine.cfg, None
    # The engine's own weights from here on (the input projections are views of its fused
    # ones): the separate copies the random build made can go.
    params = engine.model.params()
    result["model"]["weight_bytes"] = params_nbytes(params)
    _log(f"lily: {describe(src)}: {params_nbytes(params) / 1e9:.2f} GB of weights on "
         f"{src['device']} in {time.perf_counter() - t0:.1f} s")  # fmt: skip
    return engine, cfg, params, text_cfg


def _disk_round_trip(plan: BenchPlan, cfg, params, text_cfg, result: dict) -> str:
    """Write the random model as an MLX checkpoint, time Engine.load of it, check bytes."""
    from lily.bench.source import dir_source, lily_engine

    d = plan.disk_dir or tempfile.mkdtemp(prefix="lily-bench-ckpt-")
    t0 = time.perf_counter()
    save_mlx_checkpoint(params, cfg, text_cfg, d, progress=True)
    result["model"]["disk_write_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    same_settings = {k: v for k, v in plan.source.items() if k not in ("kind", "path", "name")}
    loaded = lily_engine(dir_source(d, **same_settings))
    measure.sync(plan.source["device"])
    result["model"]["disk_load_s"] = time.perf_counter() - t0
    same = fingerprint(loaded.model.params()) == fingerprint(params)
    result["model"]["disk_identical_bytes"] = same
    _log(
        f"disk: wrote {d} in {result['model']['disk_write_s']:.1f} s, Engine.load "
        f"{result['model']['disk_load_s']:.1f} s (page cache warm), identical bytes: {same}"
    )
    del loaded
    if torch.device(plan.source["device"]).type == "cuda":
        torch.cuda.empty_cache()
    return d


def _skewed_engine(engine, cfg, params, skew: float, seed: int):
    p2 = skewed_params(params, cfg.num_experts, skew, seed)
    return engine_from_params(cfg, p2, engine.engine_cfg, name="skewed router")


def run(plan: BenchPlan) -> dict:
    """The whole benchmark; returns the result dict (also written under ``plan.out``)."""
    src, device = plan.source, plan.source["device"]
    t_start = time.perf_counter()
    result: dict = {
        "schema": report.SCHEMA,
        "env": measure.env_info(device),
        "config": {
            "model": describe(src),
            "source": src,
            "lengths": plan.lengths,
            "decode_tokens": plan.decode_tokens,
            "rounds": plan.rounds,
            "peers": plan.peers,
            "skew": plan.skew,
            "budget_s": plan.budget_s,
            "point_budget_s": plan.point_budget_s if math.isfinite(plan.point_budget_s) else 0,
            "seed": plan.seed,
        },
        "model": {},
        "engines": [],
        "notes": [],
    }
    _log(f"measuring ceilings on {device} ...")
    result["ceilings"] = measure.measure_ceilings(device)
    engine, cfg, params, text_cfg = _build_ours(plan, result)
    from lily.runtime.arch_report import architecture_report, format_report

    result["arch"] = architecture_report(engine)
    for line in format_report(result["arch"]):
        _log(f"lily: {line}")
    limit = engine.max_context - plan.decode_tokens - 1
    if max(plan.lengths) > limit:
        raise ValueError(
            f"length {max(plan.lengths)} plus {plan.decode_tokens} decode tokens does not fit "
            f"the model's context of {engine.max_context} tokens"
        )
    cost = measure.cost_model(cfg, params, torch.empty((), dtype=engine.dtype).element_size())
    result["cost_model"] = cost
    mlx_wanted = _peer_available("mlx-lm", plan, result)
    if src["kind"] == "random" and (plan.disk_load or mlx_wanted):
        d = _disk_round_trip(plan, cfg, params, text_cfg, result)
        if mlx_wanted:
            src = {**src, "mlx_dir": d}  # MLX-LM runs on the very bytes we run
        elif not plan.disk_dir:
            shutil.rmtree(d, ignore_errors=True)

    n_load = min(plan.load_tokens, max(plan.lengths))
    load_ids = measure.pseudo_text_ids(n_load, cfg.vocab_size, seed=plan.seed + 99)
    _log(f"expert load of a {n_load}-token prefill (reference forward) ...")
    result["expert_load"] = {"uniform router": measure.expert_load(engine, load_ids)}
    slots = [Slot("lily", LocalEngine(LilyAdapter(engine)))]
    if plan.skew:
        skewed = _skewed_engine(engine, cfg, params, plan.skew, src.get("seed", 0))
        result["expert_load"][f"router skew {plan.skew}"] = measure.expert_load(skewed, load_ids)
        slots.append(Slot("lily (skewed router)", LocalEngine(LilyAdapter(skewed)),
                          decode=False))  # fmt: skip
    for s in slots:
        result["engines"].append({"name": s.name, "status": "ok",
                                  "info": s.handle.adapter.info()})  # fmt: skip
    for name in plan.peers:
        if name == "mlx-lm" and not mlx_wanted:
            continue  # already reported
        _log(f"starting peer {name} ...")
        handle = peers.start_peer(name, src, log=lambda m: (_log(m), result["notes"].append(m)))
        if handle is None:
            result["engines"].append({"name": name, "status": "skipped",
                                      "reason": result["notes"][-1]})  # fmt: skip
            continue
        fp = handle.info.get("fingerprint")
        if fp and fp != fingerprint(params):
            result["notes"].append(f"{name}: built from different bytes (fingerprint {fp})")
        label = "lily (worker)" if name == "lily" else name
        result["engines"].append({"name": label, "status": "ok", "info": handle.info})
        slots.append(Slot(label, handle, peer=True))
    try:
        _warm_and_sweep(plan, slots, cfg, cost, result, t_start)
    finally:
        for s in slots:
            s.handle.close()
        if src.get("mlx_dir") and not plan.disk_dir:
            shutil.rmtree(src["mlx_dir"], ignore_errors=True)
    names = [s.name for s in slots]
    result["summary"] = report.summarize(result["points"], names, [s.name for s in slots if s.peer])
    return result


def _peer_available(name: str, plan: BenchPlan, result: dict) -> bool:
    if name not in plan.peers:
        return False
    try:
        peers.check_available(name)
        return True
    except peers.PeerUnavailable as e:
        _log(str(e))
        result["notes"].append(str(e))
        result["engines"].append({"name": name, "status": "skipped", "reason": str(e)})
        return False


def _warm_and_sweep(
    plan: BenchPlan, slots: list[Slot], cfg, cost, result: dict, t_start: float
) -> None:
    prompts_cache: dict[int, list[int]] = {}

    def prompts(n: int) -> list[int]:
        if n not in prompts_cache:
            prompts_cache[n] = measure.pseudo_text_ids(n, cfg.vocab_size, seed=plan.seed + n)
        return prompts_cache[n]

    # One warm-up prefill per distinct first-chunk size, so kernel compilation and
    # autotuning for each shape happen before timing (decode warms on the first).
    chunk = plan.source.get("prefill_chunk", EngineConfig.prefill_chunk)
    sizes = sorted({min(n, chunk) for n in plan.lengths})
    for s in slots:
        _log(f"warming up {s.name} ({', '.join(map(str, sizes))} tokens) ...")
        try:
            for j, n in enumerate(sizes):
                decode = 2 if s.decode and j == 0 else 0
                w = s.handle.call("warmup", prompts(n)[::-1], decode, timeout=1800)
            s.rate, s.last_len = w["prefill_tok_s"], sizes[-1]
        except Exception as e:
            s.failed = f"warm-up failed: {peers.one_line(e)}"
            s.handle.close()
            _log(f"{s.name}: {s.failed} (skipped)")
            result["notes"].append(f"{s.name}: {s.failed}")
    total = plan.rounds * len(plan.lengths) * len(slots)
    bar = None
    try:
        from tqdm import tqdm

        bar = tqdm(total=total, desc="bench", unit="pt", file=sys.stderr)
    except ImportError:
        pass

    def on_point(p: dict) -> None:
        report.enrich(p, cost, result["ceilings"])
        if bar is not None:
            rate = p["status"]
            if p.get("prefill_tok_s"):
                rate = f"{p['prefill_tok_s']:,.0f}"
            elif p.get("decode_tok_s"):  # decode only, on a directly filled context
                rate = f"decode {p['decode_tok_s']:,.1f}"
            bar.set_postfix_str(f"{p['engine']} {p['length']}: {rate}")
            bar.update(1)

    # NOTE: the budget covers the whole run: the sweep gets what setup left, less a margin
    # for stopping the peers and writing the report.
    budget = plan.budget_s - (time.perf_counter() - t_start) - 15 if plan.budget_s else math.inf
    result["config"]["sweep_budget_s"] = budget if math.isfinite(budget) else 0
    _log(
        f"sweep: {len(plan.lengths)} lengths x {len(slots)} engines x {plan.rounds} round(s)"
        + (f", {budget:.0f} s left of the {plan.budget_s:.0f} s budget" if plan.budget_s else "")
    )
    result["points"] = sweep(slots, plan.lengths, prompts, plan.decode_tokens, plan.rounds,
                             plan.point_budget_s, budget, on_point)  # fmt: skip
    if bar is not None:
        bar.close()
    if any(p.get("status") == "cut" or p.get("decode_cut") or p.get("fill_s") is not None
           for p in result["points"]):  # fmt: skip
        result["notes"].append(
            f"some points were cut by the time budget (run {plan.budget_s or 'unlimited'} s, "
            f"one point at most {plan.point_budget_s} s): see the per-point notes"
        )
