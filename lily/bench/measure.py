"""What the benchmark measures besides time: the machine's ceilings, the bytes and FLOPs
each token must cost, the software versions, the prompt ids and the expert load."""

from __future__ import annotations

import contextlib
import datetime
import importlib.metadata
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

import numpy as np
import torch

from lily.config import ModelConfig
from lily.quant import QuantWeight, Weight

# Recurrent update per value head and token: decay, S^T k, outer-product update, S^T q.
_DELTA_FLOPS_PER_KV = 7


def pseudo_text_ids(n: int, vocab: int, seed: int = 0) -> list[int]:
    """``n`` deterministic token ids with a text-like (Zipf) frequency profile."""
    if n < 0 or vocab < 2:
        raise ValueError(f"need n >= 0 and vocab >= 2, got n={n}, vocab={vocab}")
    rng = np.random.default_rng(seed)
    order = rng.permutation(vocab)  # which ids are the frequent ones
    p = 1.0 / (np.arange(vocab) + 10.0)
    return [int(i) for i in order[rng.choice(vocab, size=n, p=p / p.sum())]]


# ---- environment


def _version(pkg: str) -> str | None:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git(*args: str) -> str | None:
    root = Path(__file__).resolve().parents[2]
    try:
        r = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def env_info(device: str) -> dict:
    """GPU, driver, library versions, git commit and date for the JSON report.

    ``LILY_GIT_COMMIT``, where set, is the commit (and the tree's state unknown: None): a
    copy of a working tree can carry stale git metadata (the lent GPU machine's does)."""
    info = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": platform.node(),
        "python": platform.python_version(),
        "device": device,
        "gpu": None,
        "driver": None,
        "cuda": torch.version.cuda,
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
    }
    if os.environ.get("LILY_GIT_COMMIT"):
        info["git_commit"], info["git_dirty"] = os.environ["LILY_GIT_COMMIT"], None
    for pkg in ("torch", "triton", "transformers", "mlx", "mlx-cuda", "mlx-cuda-13", "mlx-lm"):
        info[pkg.replace("-", "_")] = _version(pkg)
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(device)
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            q = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
            r = subprocess.run(q, capture_output=True, text=True, timeout=20)
            info["driver"] = r.stdout.strip().splitlines()[0] if r.returncode == 0 else None
    else:
        info["gpu"] = platform.processor() or platform.machine()
    return info


# ---- ceilings


def sync(device: str | torch.device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _best_time(fn, device, reps: int) -> float:
    fn()
    sync(device)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def _copy_time(nbytes: int, device: str) -> float:
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    return _best_time(lambda: dst.copy_(src), device, 10)


def _matmul_time(n: int, dtype: torch.dtype, device: str, reps: int) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    return _best_time(lambda: [a @ b for _ in range(reps)], device, 5)


def measure_ceilings(device: str, copy_bytes: int | None = None, n: int | None = None) -> dict:
    """Copy bandwidth (bytes read + written per second) and matrix-product FLOP/s.

    On CUDA: a 2 GiB device copy and a bf16 8192^3 matmul; on the CPU small fp32 ones.
    """
    cuda = torch.device(device).type == "cuda"
    copy_bytes = copy_bytes or ((2 << 30) if cuda else (64 << 20))
    n = n or (8192 if cuda else 512)
    dtype = torch.bfloat16 if cuda else torch.float32
    t_copy = _copy_time(copy_bytes, device)
    reps = 5
    t_mm = _matmul_time(n, dtype, device, reps) / reps
    if cuda:
        torch.cuda.empty_cache()
    return {
        "copy_bytes": copy_bytes,
        "copy_GBps": 2 * copy_bytes / t_copy / 1e9,
        "matmul_n": n,
        "matmul_dtype": str(dtype).removeprefix("torch."),
        "matmul_TFLOPs": 2 * n**3 / t_mm / 1e12,
    }


# ---- cost model


def _nbytes(w: Weight) -> int:
    if isinstance(w, QuantWeight):
        return w.nbytes()
    return w.numel() * w.element_size()


def _numel(w: Weight) -> int:
    shape = w.shape
    return int(np.prod(shape))


def cost_model(cfg: ModelConfig, params: dict[str, Weight], act_bytes: int) -> dict:
    """Bytes a decode step must read and FLOPs a prefill token costs, from the weights held.

    ``act_bytes``: bytes per element of the KV cache (the compute dtype).
    """
    expert_leaves = ("moe.gate_proj", "moe.up_proj", "moe.down_proj")
    # per_expert: one expert's bytes summed over all layers (top-k of them are read per layer)
    dense = per_expert = 0
    linear_params = expert_params = 0
    seen = set()
    for name, w in params.items():
        if id(w) in seen or name.startswith("mtp."):
            continue
        seen.add(id(w))
        if name.endswith(expert_leaves):
            per_expert += _nbytes(w) // cfg.num_experts
            expert_params += _numel(w) // cfg.num_experts
        elif name == "embed_tokens":
            dense += _nbytes(w) // cfg.vocab_size  # one row per token
        else:
            dense += _nbytes(w)
            if len(w.shape) >= 2 and name != "lm_head" and not name.endswith("conv1d"):
                linear_params += _numel(w)
    k, vd, hv = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_num_value_heads
    n_dn, n_attn = len(cfg.linear_layers), len(cfg.attn_layers)
    state = n_dn * (hv * k * vd * 4 + (cfg.linear_conv_kernel_dim - 1) * cfg.conv_dim * act_bytes)
    return {
        "weight_bytes_per_token": dense + cfg.num_experts_per_tok * per_expert,
        "state_bytes_per_token": 2 * state,  # DeltaNet state read and written
        "kv_bytes_per_context_token": n_attn
        * cfg.num_key_value_heads
        * cfg.head_dim
        * 2
        * act_bytes,  # fmt: skip
        "active_linear_params": linear_params + cfg.num_experts_per_tok * expert_params,
        "lm_head_params": cfg.vocab_size * cfg.hidden_size,
        "attn_flops_per_key": n_attn * 4 * cfg.num_attention_heads * cfg.head_dim,
        "deltanet_flops_per_token": n_dn * hv * k * vd * _DELTA_FLOPS_PER_KV,
    }


def decode_bytes(cost: dict, context: float) -> float:
    """Bytes one decode step at ``context`` tokens of KV must move."""
    return (
        cost["weight_bytes_per_token"]
        + cost["state_bytes_per_token"]
        + cost["kv_bytes_per_context_token"] * context
    )


def prefill_flops(cost: dict, length: int) -> float:
    """FLOPs of a ``length``-token prefill (logits of the last token only)."""
    per_token = 2 * cost["active_linear_params"] + cost["deltanet_flops_per_token"]
    attn = cost["attn_flops_per_key"] * length * (length + 1) / 2  # causal
    return per_token * length + attn + 2 * cost["lm_head_params"]


# ---- expert load


@contextlib.contextmanager
def record_routing(num_layers: int, num_experts: int):
    """Collect rows per expert per MoE layer from the reference MoE's ``route``."""
    import lily.model.moe as moe

    counts = torch.zeros(num_layers, num_experts, dtype=torch.long)
    calls = [0]
    original = moe.route

    def route(logits, top_k, renorm):
        w, ids = original(logits, top_k, renorm)
        layer = calls[0] % num_layers
        counts[layer] += torch.bincount(ids.reshape(-1).cpu(), minlength=num_experts)
        calls[0] += 1
        return w, ids

    moe.route = route
    try:
        yield counts
    finally:
        moe.route = original


def expert_load(engine, ids: list[int]) -> dict:
    """Rows per expert in each MoE layer during a reference prefill of ``ids``, summarised.

    The model runs on its reference ops whatever the engine times (over the same
    weights), so the load does not depend on the kernels (routing is the same maths).
    """
    from lily.model.model import Model
    from lily.runtime.runner import Runner

    cfg, model = engine.cfg, engine.model
    ref = Model(cfg, model.weights, model.dtype, kernels=False)
    runner = Runner(ref, engine.engine_cfg.prefill_chunk, sample_on_device=False)
    with record_routing(cfg.num_hidden_layers, cfg.num_experts) as counts:
        runner.prefill(list(ids), engine.new_state())
    c = counts.double()
    mean = len(ids) * cfg.num_experts_per_tok / cfg.num_experts
    flat = c.reshape(-1).numpy()
    q = np.quantile(flat, [0.0, 0.1, 0.5, 0.9, 0.99, 1.0])
    top = np.sort(c.numpy(), axis=1)[:, ::-1]
    n_top = max(1, cfg.num_experts // 32)
    return {
        "tokens": len(ids),
        "mean_rows_per_expert": mean,
        "quantiles": dict(
            zip(("min", "p10", "p50", "p90", "p99", "max"), q.tolist(), strict=True)
        ),  # fmt: skip
        "max_over_mean": float(flat.max() / mean),
        "cv": float(flat.std() / mean),
        "idle_expert_fraction": float((flat == 0).mean()),
        f"top{n_top}_row_share": float(top[:, :n_top].sum() / top.sum()),
        "per_layer_max_over_mean": (c.max(1).values / mean).round(decimals=3).tolist(),
        "counts": counts.tolist(),
    }


# ---- kernel benchmark helpers (lily/bench/gpu/kernels/*.py)


def attempt(rows: list[dict], base: dict, fn) -> None:
    """Measure one configuration; a failure becomes a row with its error, not a crash."""
    try:
        rows.append({**base, **fn()})
    except Exception as e:  # noqa: BLE001 - any failure of one config is data
        rows.append({**base, "error": f"{type(e).__name__}: {e}"[:300]})
        print(f"  failed {base}: {rows[-1]['error']}", flush=True)


def kernel_times(fn, reps: int = 5, key_width: int | None = None) -> dict[str, float]:
    """Device time per kernel (us per call, torch.profiler over ``reps`` calls), or {}."""
    try:
        from torch.profiler import ProfilerActivity, profile

        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                fn()
            torch.cuda.synchronize()
        times = {e.key: e.self_device_time_total / reps for e in prof.key_averages()}
        return {k[:key_width]: round(v, 2) for k, v in times.items() if v > 0}
    except Exception as e:  # noqa: BLE001 - the breakdown is an extra; never fail for it
        return {"error": f"{type(e).__name__}: {e}"[:200]}


def capture_graph(fn):
    """``fn`` captured in a CUDA graph after one warm-up call on a side stream (it compiles
    kernels and settles the allocator outside the capture); returns (graph, what the
    captured call returned). The warm-up really runs: callers restore any state it
    changed."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def replay_ms(graph, n: int = 64, reps: int = 5) -> float:
    """Median device time of one replay of a captured graph: ``reps`` runs of ``n``
    back-to-back replays, timed with CUDA events (the launch of one replay hides behind the
    one before, as in a decode loop)."""
    times = []
    for _ in range(reps):
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        ev[0].record()
        for _ in range(n):
            graph.replay()
        ev[1].record()
        torch.cuda.synchronize()
        times.append(ev[0].elapsed_time(ev[1]) / n)
    return statistics.median(times)
