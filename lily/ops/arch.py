"""The GPU architectures the kernels are built for: one small capability record per arch,
and which record the launchers use.

Every tile table in lily/ops takes an ``Arch`` and keeps the configs tuned on the H200
(sm_90) where they fit; on GPUs with less shared memory per block (RTX 30xx/40xx/50xx:
99 KB) it picks smaller tiles or fewer stages of the same kernels, so the maths is the same.
Features a GPU lacks are off there: programmatic dependent launch before sm_90, warpgroup
MMA (Triton's MMAv3 for ``tl.dot``) outside sm_90. The compile matrix
(tests/ops/test_compile_matrix.py, lily/ops/matrix.py) compiles every launchable config for
each record and checks it against these limits.

``current_arch(device)`` reads the device's compute capability once. ``force_arch("sm_89")``
(EngineConfig.gpu_arch, ``--gpu-arch``) makes every launcher use another record's tables and
switches instead, so the fallbacks can be measured on an H200.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

KIB = 1024


@dataclass(frozen=True)
class Arch:
    """What the tile tables and launch switches need to know about one architecture.

    smem: the most shared memory one block may use (the opt-in maximum, bytes);
    pdl: programmatic dependent launch (``griddepcontrol``, sm_90 and newer);
    wgmma: warpgroup MMA and TMA (sm_90 only; Triton uses MMAv3 for ``tl.dot`` there).
    """

    name: str
    cc: int
    smem: int
    pdl: bool
    wgmma: bool
    regs_per_block: int = 65536
    max_regs: int = 255

    @property
    def big_smem(self) -> bool:
        """Whether the H200's tiles' shared memory may fit (A100 and H100/H200 class)."""
        return self.smem >= 160 * KIB


# NOTE: shared memory per block (with opt-in) from the CUDA programming guide's table of
# compute capabilities: 8.0 163 KB, 8.6 and 8.9 99 KB, 9.0 227 KB, 12.0 99 KB (an SM has
# 1 KB more, reserved for the system).
ARCHS: dict[str, Arch] = {
    a.name: a
    for a in (
        Arch("sm_80", 80, 163 * KIB, pdl=False, wgmma=False),  # A100
        Arch("sm_86", 86, 99 * KIB, pdl=False, wgmma=False),  # RTX 30xx
        Arch("sm_89", 89, 99 * KIB, pdl=False, wgmma=False),  # RTX 40xx
        Arch("sm_90", 90, 227 * KIB, pdl=True, wgmma=True),  # H100, H200
        Arch("sm_120", 120, 99 * KIB, pdl=True, wgmma=False),  # RTX 50xx
    )
}

# The tables as tuned, and the record of the CPU (the interpreter runs the H200's tiles).
DEFAULT = ARCHS["sm_90"]


def arch_for_capability(major: int, minor: int) -> Arch:
    """The record of a compute capability; one not listed gets the small tables (they fit
    every GPU lily knows) with PDL from sm_90 on and no warpgroup MMA."""
    cc = 10 * major + minor
    for a in ARCHS.values():
        if a.cc == cc:
            return a
    return Arch(f"sm_{cc}", cc, 99 * KIB, pdl=cc >= 90, wgmma=False)


def arch_named(name: str) -> Arch:
    """The record called ``name`` ("sm_89" or "89"); a clear error for an unknown one."""
    key = name if name.startswith("sm_") else f"sm_{name}"
    if key not in ARCHS:
        raise ValueError(f"unknown GPU architecture {name!r} (known: {', '.join(ARCHS)})")
    return ARCHS[key]


# NOTE: process-wide, like the device itself: set once when an engine is built (before
# any kernel compiles), read by every launcher; None: each device's own record.
_forced: Arch | None = None
_by_index: dict[int | None, Arch] = {}  # by device index (None: the current device)
_MMA_V3_OFF = "DISABLE_MMA_V3"
_set_env = False  # whether force_arch set it (one set by the user stays)


def force_arch(name: str | None) -> Arch | None:
    """Make every launcher use the tables and switches of ``name`` (None: the device's own).

    Forcing an arch below sm_90 on a Hopper GPU also turns warpgroup MMA off for the kernels
    compiled after this call (Triton's DISABLE_MMA_V3, part of its cache key): the fallback
    then runs the code a GPU without it gets. Returns the record now forced."""
    global _forced, _set_env
    _forced = arch_named(name) if name is not None else None
    if _forced is not None and not _forced.wgmma:
        if _MMA_V3_OFF not in os.environ:
            os.environ[_MMA_V3_OFF] = "1"
            _set_env = True
    elif _set_env:
        os.environ.pop(_MMA_V3_OFF, None)
        _set_env = False
    return _forced


def forced_arch() -> Arch | None:
    """The record ``force_arch`` set, or None."""
    return _forced


def current_arch(device: torch.device) -> Arch:
    """The record the launchers use for ``device``: the forced one, else the device's own
    (read once per device); the tuned tables on the CPU and on meta tensors."""
    if _forced is not None:
        return _forced
    if device.type != "cuda":
        return DEFAULT
    arch = _by_index.get(device.index)
    if arch is None:
        import torch  # NOTE: here, so that the command line can list the records cheaply

        index = device.index if device.index is not None else torch.cuda.current_device()
        arch = arch_for_capability(*torch.cuda.get_device_capability(index))
        _by_index[device.index] = arch
    return arch
