"""Host values to the device without stalling the host, and the addresses of buffers that
device tables name."""

from __future__ import annotations

import array

import torch

TABLE_ALIGN = 16  # bytes: what a kernel assumes of a buffer it reads by address
# array type codes of the same width as the torch dtype ("q": 8 bytes, "i": 4 bytes)
_ARRAY_CODES = {torch.long: "q", torch.int32: "i"}


def to_device(values: list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list as a device tensor without stalling the host.

    NOTE: ``torch.tensor(values, device="cuda")`` copies from pageable memory, which waits
    for the device to finish the work already queued: called inside a prefill it drained
    the queue and the host could never run ahead of the GPU
    (lily/bench/gpu/diagnostics/host_time.py). A pinned copy with non_blocking does not
    wait; torch keeps the pinned block until the copy is done. The list goes through
    ``array`` (one C loop): ``torch.tensor`` of a 1,128-id prompt took 82 us on the CPU
    machine, the array 24 us."""
    code = _ARRAY_CODES.get(dtype)
    if code is None or not values:
        t = torch.tensor(values, dtype=dtype)
    else:
        t = torch.frombuffer(array.array(code, values), dtype=dtype)
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def table_address(t: torch.Tensor, who: str) -> int:
    """``t``'s address for a device table of buffers a kernel reads by address (a batched
    step's caches and states). ``t`` must be contiguous and 16-byte aligned: the kernels
    tell Triton so, as it assumes of a pointer argument, and vectorize their loads."""
    if not (t.is_contiguous() and t.data_ptr() % TABLE_ALIGN == 0):
        raise ValueError(f"{who}: a buffer named in a table must be contiguous and "
                         f"{TABLE_ALIGN}-byte aligned, got shape {tuple(t.shape)} strides "
                         f"{t.stride()} at {t.data_ptr():#x}")  # fmt: skip
    return t.data_ptr()
