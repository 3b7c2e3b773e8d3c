"""Run-time CUDA C++ compilation (lily/ops/cuda_rtc.py). Compiling needs NVRTC but no GPU:
these run wherever NVRTC loads (PyTorch's CUDA wheels ship it) and skip elsewhere."""

from __future__ import annotations

import pytest

from lily.bench.gpu import persistent_stream as ps
from lily.ops import cuda_rtc

try:
    cuda_rtc.nvrtc()
    HAS_NVRTC = True
except cuda_rtc.CudaRtcError:
    HAS_NVRTC = False

needs_nvrtc = pytest.mark.skipif(not HAS_NVRTC, reason="NVRTC is not installed here")


@needs_nvrtc
@pytest.mark.parametrize("mma", [0, 1])
def test_the_stream_kernel_compiles_for_hopper(mma):
    opts = tuple(f"-D{k}={v}" for k, v in (("NSTAGE", 4), ("CHUNK", 4096), ("NCW", 8),
                                           ("MMA", mma), ("TRACE", 1), ("ACT", ps.ACT),
                                           ("RESULTS", ps.RESULTS)))  # fmt: skip
    cubin = cuda_rtc.compile_cubin(ps.SOURCE, "sm_90a", opts)
    assert cubin[:4] == b"\x7fELF"
    assert b"persistent_stream" in cubin


@needs_nvrtc
def test_a_compile_error_names_the_problem():
    with pytest.raises(cuda_rtc.CudaRtcError, match="undefined_thing"):
        cuda_rtc.compile_cubin('extern "C" __global__ void k() { undefined_thing(); }', "sm_90a")
