"""CUDA C++ kernels compiled on the user's machine at run time (NVRTC) and launched through
the driver API, for what Triton cannot express (shared-memory rings fed by bulk copies,
mbarriers, spin waits with acquire/release at GPU scope).

No extra install: NVRTC ships with PyTorch's CUDA wheels (``nvidia/cu13/lib`` or
``nvidia/cuda_nvrtc/lib``) and the driver library with the driver. Launches go to the
current torch stream, so they are captured in CUDA graphs like any other kernel. Compiled
binaries are kept per process (keyed by source, options and architecture).
"""

from __future__ import annotations

import ctypes
import glob
import hashlib
import os
import sys
from dataclasses import dataclass
from functools import lru_cache

import torch

_NVRTC_NAMES = ("libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so")


class CudaRtcError(RuntimeError):
    """NVRTC or the driver refused: the message names the step and carries its log."""


def _nvrtc_candidates() -> list[str]:
    # NVRTC of PyTorch's wheels first (the CUDA it was built for), then the loader's path.
    out = []
    for base in sys.path:
        for sub in ("nvidia/cu13/lib", "nvidia/cuda_nvrtc/lib"):
            out += sorted(glob.glob(os.path.join(base, sub, "libnvrtc.so*")))
    return [p for p in out if "alt" not in os.path.basename(p) and "builtins" not in p] + list(
        _NVRTC_NAMES
    )


@lru_cache(maxsize=1)
def nvrtc() -> ctypes.CDLL:
    """The NVRTC library (CudaRtcError when none loads)."""
    tried = []
    for name in _nvrtc_candidates():
        try:
            lib = ctypes.CDLL(name)
        except OSError as e:
            tried.append(f"{name}: {e}")
            continue
        # NVRTC opens its builtins library by name at compile time: load the one beside it
        # first (a wheel's directory is not on the loader's path).
        here = os.path.dirname(name)
        for b in sorted(glob.glob(os.path.join(here, "libnvrtc-builtins.so*")) if here else []):
            if ".alt." not in b:
                ctypes.CDLL(b, mode=ctypes.RTLD_GLOBAL)
        return lib
    raise CudaRtcError(
        "no NVRTC library found (PyTorch's CUDA wheels ship one): " + "; ".join(tried[-3:])
    )


def _check_nvrtc(lib: ctypes.CDLL, res: int, what: str, prog=None) -> None:
    if res == 0:
        return
    lib.nvrtcGetErrorString.restype = ctypes.c_char_p
    msg = lib.nvrtcGetErrorString(res).decode()
    log = ""
    if prog is not None:
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, buf)
        log = "\n" + buf.value.decode(errors="replace")
    raise CudaRtcError(f"NVRTC {what}: {msg}{log}")


def compile_cubin(source: str, arch: str, options: tuple[str, ...] = ()) -> bytes:
    """``source`` compiled for ``arch`` (e.g. "sm_90a") to a cubin; raises CudaRtcError with
    the compiler's log when it does not compile. Needs no GPU."""
    lib = nvrtc()
    prog = ctypes.c_void_p()
    _check_nvrtc(lib, lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"lily.cu",
                                             0, None, None), "create")  # fmt: skip
    opts = [f"--gpu-architecture={arch}", "-std=c++17", "-default-device", *options]
    arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    try:
        _check_nvrtc(lib, lib.nvrtcCompileProgram(prog, len(opts), arr), "compile", prog)
        size = ctypes.c_size_t()
        _check_nvrtc(lib, lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "cubin size")
        buf = ctypes.create_string_buffer(size.value)
        _check_nvrtc(lib, lib.nvrtcGetCUBIN(prog, buf), "cubin")
        return buf.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


@lru_cache(maxsize=1)
def _driver() -> ctypes.CDLL:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise CudaRtcError(f"the CUDA driver library did not load: {e}") from e


def _check_cu(res: int, what: str) -> None:
    if res != 0:
        s = ctypes.c_char_p()
        _driver().cuGetErrorString(res, ctypes.byref(s))
        raise CudaRtcError(f"CUDA driver {what}: error {res} ({(s.value or b'?').decode()})")


_MAX_DYNAMIC_SMEM = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
_NUM_REGS = 4  # CU_FUNC_ATTRIBUTE_NUM_REGS
_LOCAL_BYTES = 3  # CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES


@dataclass
class Kernel:
    """A loaded kernel: ``launch`` it on the current torch stream."""

    func: ctypes.c_void_p
    module: ctypes.c_void_p
    smem: int

    def attribute(self, attr: int) -> int:
        v = ctypes.c_int()
        _check_cu(_driver().cuFuncGetAttribute(ctypes.byref(v), attr, self.func), "attribute")
        return v.value

    @property
    def registers(self) -> int:
        return self.attribute(_NUM_REGS)

    @property
    def spill_bytes(self) -> int:
        return self.attribute(_LOCAL_BYTES)

    def launch(self, grid: int, block: int, args: list) -> None:
        """One launch of ``grid`` blocks of ``block`` threads with the dynamic shared memory
        it was loaded with. ``args``: tensors (their data pointers), ints as 64-bit
        (``ctypes`` values are passed as they are)."""
        vals = []
        for a in args:
            if isinstance(a, torch.Tensor):
                vals.append(ctypes.c_uint64(a.data_ptr()))
            elif isinstance(a, bool | int):
                vals.append(ctypes.c_int64(int(a)))
            elif isinstance(a, ctypes._SimpleCData):
                vals.append(a)
            else:
                raise TypeError(f"Kernel.launch: unsupported argument {type(a).__name__}")
        ptrs = (ctypes.c_void_p * len(vals))(*[ctypes.addressof(v) for v in vals])
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        _check_cu(_driver().cuLaunchKernel(self.func, grid, 1, 1, block, 1, 1, self.smem, stream,
                                           ptrs, None), "launch")  # fmt: skip


_MODULES: dict[str, Kernel] = {}


def load(source: str, name: str, smem: int = 0, options: tuple[str, ...] = ()) -> Kernel:
    """Kernel ``name`` (``extern "C"``) of ``source`` compiled for the current GPU, with
    ``smem`` bytes of dynamic shared memory allowed; compiled once per process."""
    torch.cuda.init()
    major, minor = torch.cuda.get_device_capability()
    arch = f"sm_{major}{minor}" + ("a" if major == 9 else "")
    key = hashlib.sha256(repr((source, name, smem, options, arch)).encode()).hexdigest()
    if key in _MODULES:
        return _MODULES[key]
    cubin = compile_cubin(source, arch, options)
    torch.cuda.synchronize()  # the runtime's primary context exists and is current here
    module, func = ctypes.c_void_p(), ctypes.c_void_p()
    _check_cu(_driver().cuModuleLoadData(ctypes.byref(module), cubin), "module load")
    _check_cu(_driver().cuModuleGetFunction(ctypes.byref(func), module, name.encode()), "function")
    if smem > 48 * 1024:
        _check_cu(_driver().cuFuncSetAttribute(func, _MAX_DYNAMIC_SMEM, smem), "shared memory size")
    k = Kernel(func, module, smem)
    _MODULES[key] = k
    return k
