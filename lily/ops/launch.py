"""Host-side helpers the kernels' launchers share: argument checks with clear errors,
small integer helpers, and programmatic-dependent-launch options."""

from __future__ import annotations

import weakref

import torch

from lily.quant import QuantWeight

Tensor = torch.Tensor


def mask_lo(bits: int) -> int:
    """Mantissa mask of a code's field; passed at run time so the compiler keeps it in a
    register and folds mask-and-or into one LOP3 (two immediates would take two)."""
    return 0x78000 if bits == 4 else 0x7F8000


def cdiv(a: int, b: int) -> int:
    """Host-side ceil(a / b).

    NOTE: ``triton.cdiv`` and ``triton.next_power_of_2`` are ConstexprFunctions in Triton 3.6:
    a few microseconds per host call, which adds up to tens of microseconds per launcher."""
    return -(-a // b)


def to_device(values: list[int], dtype: torch.dtype, device: torch.device) -> Tensor:
    """A small host list as a device tensor without stalling the host.

    NOTE: ``torch.tensor(values, device="cuda")`` copies from pageable memory, which waits
    for the device to finish the work already queued: called inside a prefill it drained
    the queue and the host could never run ahead of the GPU (bench/gpu_host_time.py). A
    pinned copy with non_blocking does not wait; torch keeps the pinned block until the
    copy is done."""
    t = torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def pow2(n: int) -> int:
    """Host-side smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, n - 1).bit_length()


# Weights already checked, by id (weak values: an entry leaves with its weight, so an id
# is never reused while it is here). A prefill checks each weight hundreds of times.
_CHECKED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def check_weight(w: QuantWeight, name: str, ndim: int) -> None:
    """Clear errors for a packed weight the kernels cannot read (once per weight object;
    QuantWeights are not changed in place)."""
    if isinstance(w, QuantWeight) and _CHECKED.get(id(w)) is w and w.qweight.dim() == ndim:
        return
    _check_weight(w, name, ndim)
    _CHECKED[id(w)] = w


def _check_weight(w: QuantWeight, name: str, ndim: int) -> None:
    if not isinstance(w, QuantWeight):
        raise TypeError(f"{name}: expected a QuantWeight, got {type(w).__name__}")
    if w.bits not in (4, 8):
        raise ValueError(f"{name}: {w.bits}-bit weights are not supported (4 or 8)")
    if w.group_size not in (32, 64, 128):
        raise ValueError(f"{name}: group size {w.group_size} is not supported (32, 64 or 128)")
    if w.qweight.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dims, got qweight {tuple(w.qweight.shape)}")
    if w.qweight.dtype != torch.int32:
        raise TypeError(f"{name}: qweight must be int32 (uint32 bits), got {w.qweight.dtype}")
    k = w.shape[-1]
    if k % w.group_size:
        raise ValueError(f"{name}: K={k} is not a multiple of group size {w.group_size}")
    want = (*w.qweight.shape[:-1], k // w.group_size)
    for part in ("scales", "biases"):
        t = getattr(w, part)
        if tuple(t.shape) != want:
            raise ValueError(f"{name}: {part} shape {tuple(t.shape)}, expected {want}")
        if t.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise TypeError(f"{name}: {part} dtype {t.dtype} is not a float type")
        if t.stride(-1) != 1 or t.device != w.qweight.device:
            raise ValueError(f"{name}: {part} must be contiguous along groups, on qweight's device")
    if w.qweight.stride(-1) != 1:
        raise ValueError(f"{name}: qweight must be contiguous along K")
    if w.scales.stride() != w.biases.stride():
        raise ValueError(f"{name}: scales and biases must share strides")


def check_x(x: Tensor, k: int, name: str, device: torch.device) -> None:
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"{name}: x dtype {x.dtype} is not bf16, fp16 or fp32")
    if x.shape[-1] != k:
        raise ValueError(f"{name}: x has {x.shape[-1]} inputs, the weight expects {k}")
    if x.device != device:
        raise ValueError(f"{name}: x is on {x.device}, the weight on {device}")


def pdl_launch(pdl: bool) -> dict:
    """Launch options for programmatic dependent launch (nothing when off, so the kernels
    compiled without it keep their cache entries)."""
    return {"launch_pdl": True} if pdl else {}


def use_pdl(pdl: bool, device: torch.device) -> bool:
    """PDL only on a CUDA device of compute capability 9.0 or newer (a no-op elsewhere)."""
    return pdl and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9
