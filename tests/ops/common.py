"""Helpers the kernel tests share."""

from __future__ import annotations

import torch


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``|a - b| / |b|`` in fp64 on the CPU; a non-finite ``a`` fails (an unwritten or bad
    output element)."""
    a, b = a.double().cpu(), b.double().cpu()
    assert torch.isfinite(a).all(), "output has NaN/inf (unwritten or bad values)"
    return ((a - b).norm() / b.norm()).item()


def capture(fn):
    """``fn`` captured in a CUDA graph after one warm-up call on a side stream (compiles
    outside the capture); returns (graph, what the captured call returned). The warm-up
    really runs: callers restore any state it changed."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out
