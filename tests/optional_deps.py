"""Optional references a host may lack: tests that need one skip, naming why."""

from __future__ import annotations

import functools


@functools.cache
def mlx_missing() -> str | None:
    """Why mlx-lm cannot serve as a reference here (None when it can): a CUDA host may
    have no mlx wheel, and mlx's own import can fail with more than ImportError."""
    try:
        import mlx.core  # noqa: F401
        import mlx_lm  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any failure means: no reference here
        return f"mlx-lm is not importable here ({type(e).__name__}: {e})"
    return None
