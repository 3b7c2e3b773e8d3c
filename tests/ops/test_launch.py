"""Host-side launch helpers (lily/ops/launch.py)."""

from __future__ import annotations

import pytest
import torch

from lily.ops.launch import to_device


def test_to_device_on_cpu_keeps_values_and_dtype():
    t = to_device([3, -1, 2**40], torch.long, torch.device("cpu"))
    assert t.dtype == torch.long and t.tolist() == [3, -1, 2**40]
    assert to_device([7], torch.int32, torch.device("cpu")).dtype == torch.int32


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned non-blocking copies: CUDA")
def test_to_device_copies_survive_a_busy_device():
    """Many copies queued behind a sleeping device (the host does not wait for it): each
    must arrive with its own values, so no pinned block is reused before its copy ran."""
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)
    outs = [to_device([i, 2 * i, 3 * i], torch.long, torch.device("cuda")) for i in range(200)]
    torch.cuda.synchronize()
    assert all(o.tolist() == [i, 2 * i, 3 * i] for i, o in enumerate(outs))
