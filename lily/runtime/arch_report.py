"""What the engine runs on, printed at the start of ``lily serve`` and ``lily bench``: the
device and its architecture, the memory plan (lily/runtime/memory_plan.py) and which fast
paths are on. On the CPU: the device and the reference path."""

from __future__ import annotations

import platform

import torch

from lily.ops.arch import current_arch, forced_arch

MiB = 1 << 20
GiB = 1 << 30


def device_info(device: str) -> dict:
    """Name, architecture (sm_XY on NVIDIA), SM count and memory of ``device``."""
    dev = torch.device(device)
    if dev.type == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(dev)
        major, minor = torch.cuda.get_device_capability(dev)
        return {
            "device": str(dev),
            "name": props.name,
            "arch": f"sm_{major}{minor}",
            "sms": props.multi_processor_count,
            "memory_bytes": props.total_memory,
        }
    return {"device": str(dev), "name": platform.processor() or platform.machine(),
            "arch": platform.machine(), "sms": None, "memory_bytes": None}  # fmt: skip


def fast_paths(runner, device: str) -> dict[str, bool]:
    """The kernel path's optional techniques and whether each is on (empty on the
    reference path), as the architecture whose tables the kernels use has them
    (lily/ops/arch.py: the device's own, or the one ``--gpu-arch`` forces)."""
    step = runner.model.step_ops
    if step is None:
        return {}
    arch = current_arch(torch.device(device))
    return {
        # PDL is a no-op before sm_90 (lily.ops.launch.use_pdl)
        "PDL": step.pdl and arch.pdl,
        "tensor-core GEMV": step.mma,
        # Triton's MMAv3 for the prefill's tl.dot (sm_90 only)
        "warpgroup MMA": arch.wgmma,
        "CUDA graphs": bool(getattr(runner, "use_graphs", False)),
        "device sampling": getattr(runner, "device_decode", None) is not None,
        # attention decode splits the keys from 256 positions on; prefill after long history
        "split-KV attention": True,
        "fused-dequant GEMM prefill": True,
    }


def kernel_tables(engine) -> str | None:
    """Whose tile tables the kernels use: the architecture, and whether ``--gpu-arch``
    forced it (None on the reference path)."""
    if not engine.model.kernels:
        return None
    arch = current_arch(torch.device(str(engine.engine_cfg.device)))
    return arch.name + (" (forced by --gpu-arch)" if forced_arch() is not None else "")


def architecture_report(engine) -> dict:
    """The report as a dict (for JSON): device, path, memory plan, fast paths."""
    dev = str(engine.engine_cfg.device)
    plan = engine.memory_plan
    reference = not engine.model.kernels
    return {
        **device_info(dev),
        "path": "reference (plain PyTorch)" if reference else "Triton kernels",
        "dtype": str(engine.dtype).removeprefix("torch."),
        "max_context": plan.max_context,
        "context_auto": plan.auto,
        "prefill_chunk": plan.chunk,
        "max_running": plan.max_running,
        "memory_plan": plan.parts(),
        "kv_bytes_per_token": plan.kv_per_token,
        "free_beyond_weights": plan.free,
        "fast_paths": fast_paths(engine.runner, dev),
        "kernel_tables": kernel_tables(engine),
    }


def _bytes(n: int) -> str:
    return f"{n / GiB:8.2f} GiB" if n >= GiB else f"{n / MiB:8.1f} MiB"


def format_report(rep: dict) -> list[str]:
    """The report as lines of text."""
    mem = rep["memory_plan"]
    if rep["sms"]:
        where = (f"{rep['name']} ({rep['arch']}, {rep['sms']} SMs, "
                 f"{rep['memory_bytes'] / GiB:.1f} GiB)")  # fmt: skip
    else:
        where = f"({rep['arch']})"
    lines = [f"device {rep['device']} {where}: {rep['path']}, {rep['dtype']}"]
    paths = rep["fast_paths"]
    if paths:
        on = [k for k, v in paths.items() if v]
        off = [k for k, v in paths.items() if not v]
        lines.append("fast paths on: " + (", ".join(on) or "none")
                     + ("; off: " + ", ".join(off) if off else ""))  # fmt: skip
    else:
        lines.append("fast paths: none (the reference path)")
    if rep.get("kernel_tables"):
        lines.append(f"kernel tables: {rep['kernel_tables']}")
    how = ("the largest the free memory allows; --max-context sets it" if rep["context_auto"]
           else "--max-context")  # fmt: skip
    lines.append(f"context: {rep['max_context']:,} tokens ({how})")
    rows = [
        ("weights", mem["weights"], ""),
        ("KV cache", mem["kv_cache"], f"{rep['kv_bytes_per_token'] / 1024:.1f} KiB a token"),
        ("KV growth", mem["kv_growth"], "one old buffer while the cache grows"),
        ("DeltaNet states", mem["deltanet_states"], "working state and one copy"),
        ("scratch", mem["scratch"], f"prefill chunks of {rep['prefill_chunk']} tokens"),
        ("CUDA graphs", mem["graphs"], ""),
        ("batched steps", mem.get("batched_steps", 0),
         f"up to {rep.get('max_running', 1)} requests together (--max-running)"),
        ("prefix cache", mem["prefix_cache"], "--prefix-cache-gb"),
        ("margin", mem["margin"], "allocator, workspaces"),
    ]  # fmt: skip
    rows = [r for r in rows if r[0] != "batched steps" or r[1]]  # (none for one at a time)
    lines.append("memory plan:")
    lines += [f"  {name:<16}{_bytes(n)}" + (f"  ({why})" if why else "")
              for name, n, why in rows]  # fmt: skip
    total = f"  {'total':<16}{_bytes(mem['total'])}"
    free = rep["free_beyond_weights"]
    beyond = mem["total"] - mem["weights"]
    if free is not None:
        total += f"  ({_bytes(beyond).strip()} beside the weights, {_bytes(free).strip()} free)"
    lines.append(total)
    if free is not None and beyond > free:
        lines.append(
            f"warning: the plan needs more than the {_bytes(free).strip()} free: requests "
            "that would not fit are refused with a 400 naming the limit"
        )
    return lines
