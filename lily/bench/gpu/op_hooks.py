"""Hooks on the model's ops for the GPU scripts: each op the decoder loop calls
(lily/model/ops.py) is wrapped so a callback sees its name, arguments and output. Used to
find the first op that returns a non-finite value and to checksum every op."""

from __future__ import annotations

from collections.abc import Callable

import torch

import lily.model.ops as model_ops

MODEL_OPS = ("embed", "project", "deltanet", "attention", "out_norm", "moe", "head")


def finite(t) -> bool:
    if isinstance(t, (tuple, list)):
        return all(finite(x) for x in t)
    return not isinstance(t, torch.Tensor) or bool(torch.isfinite(t).all())


def hook_ops(hook: Callable[[str, tuple, object], None]) -> Callable[[], None]:
    """Call ``hook(name, args, out)`` after every model op (not while a CUDA graph is being
    captured: a host sync there would invalidate the capture). Returns the undo."""
    saved = {n: getattr(model_ops, n) for n in MODEL_OPS}

    def wrap(name, fn):
        def hooked(*a, **k):
            out = fn(*a, **k)
            if not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
                hook(name, a, out)
            return out

        return hooked

    for n, fn in saved.items():
        setattr(model_ops, n, wrap(n, fn))

    def undo() -> None:
        for n, fn in saved.items():
            setattr(model_ops, n, fn)

    return undo


def first_nonfinite(found: list) -> Callable[[str, tuple, object], None]:
    """A hook that records the first op returning a non-finite value into ``found``: op,
    call index, whether each argument was finite, the argument shapes."""
    calls = [0]

    def hook(name: str, args: tuple, out) -> None:
        calls[0] += 1
        if not found and not finite(out):
            found.append({"op": name, "call": calls[0], "args_finite": [finite(x) for x in args],
                          "shapes": [list(x.shape) for x in args
                                     if isinstance(x, torch.Tensor)]})  # fmt: skip

    return hook
