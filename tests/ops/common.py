"""Helpers the kernel tests share."""

from __future__ import annotations

import torch


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``|a - b| / |b|`` in fp64 on the CPU; a non-finite ``a`` fails (an unwritten or bad
    output element)."""
    a, b = a.double().cpu(), b.double().cpu()
    assert torch.isfinite(a).all(), "output has NaN/inf (unwritten or bad values)"
    return ((a - b).norm() / b.norm()).item()


def replayed(call, x: torch.Tensor, xs: list[torch.Tensor]):
    """``call()`` as a decode step runs it, on each of ``xs[1:]`` copied into ``x`` in
    turn: one CUDA graph captured (on ``x`` as it is) and replayed on the GPU, so launches
    with PDL run as in the step; an eager call on the CPU. Yields (input, output) pairs:
    nothing may leak from one replay into the next."""
    from lily.bench.measure import capture_graph

    cuda = x.device.type == "cuda"
    if cuda:
        graph, out = capture_graph(call)
    for xi in xs[1:]:
        x.copy_(xi)
        if cuda:
            graph.replay()
            torch.cuda.synchronize()
        else:
            out = call()
        yield xi, out
