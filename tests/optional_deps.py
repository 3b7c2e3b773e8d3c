"""Optional references a host may lack: tests that need one skip, naming why."""

from __future__ import annotations

import functools


@functools.cache
def mlx_missing() -> str | None:
    """Why mlx-lm cannot serve as a reference here (None when it can): a CUDA host may
    have no mlx wheel, or mlx without its backend, which fails only on import."""
    from lily.bench import peers

    try:
        peers.check_available("mlx-lm", load=True)
    except peers.PeerUnavailable as e:
        return str(e)
    return None
