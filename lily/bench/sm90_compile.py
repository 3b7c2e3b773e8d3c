"""Kernels compiled for sm_90 without a GPU: what ptxas gives each one.

The public op functions run on CPU tensors of the real shapes with every kernel launch
intercepted (``intercepted``), so each kernel is compiled (``compile_row``) with exactly the
arguments its launcher passes (``ON_CPU`` forced off; ints divisible by 16 and 16-byte
aligned tensors specialized as Triton does at a launch). The row holds registers, stack
bytes (spills), shared memory, and counts of warpgroup MMAs, TMA copies and cp.async copies
in the PTX: enough to see whether a configuration can launch at all (shared memory under
227 KB) and what it compiled to before any GPU time is spent on it.
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import tempfile
from pathlib import Path

import torch
import triton

_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
          torch.int32: "i32", torch.int64: "i64", torch.int8: "i8", torch.uint8: "u8",
          torch.float8_e4m3fn: "fp8e4nv"}  # fmt: skip
SMEM_LIMIT = 227 * 1024  # an sm_90 block's shared memory


@contextlib.contextmanager
def intercepted():
    """Kernel launches recorded instead of run, into the yielded list as (jit function,
    args, kwargs); a caller may append label strings between calls."""
    from triton.runtime.jit import JITFunction

    from lily.ops.launch import Launched

    launches: list = []
    real_getitem, real_launch = JITFunction.__getitem__, Launched.launch
    JITFunction.__getitem__ = lambda fn, grid: lambda *a, **kw: launches.append((fn, a, kw))
    # Launched's fast path asks CUDA for the device: every launch goes to the JIT function.
    Launched.launch = lambda self, grid, args, kwargs: self.fn[grid](*args, **kwargs)
    try:
        yield launches
    finally:
        JITFunction.__getitem__, Launched.launch = real_getitem, real_launch


def _signature(fn, args: tuple, const: dict) -> tuple[dict, dict]:
    sig, attrs = {}, {}
    for i, (name, v) in enumerate(zip(fn.arg_names, args, strict=False)):
        if type(v).__name__ == "TensorDescriptor":
            box = ", ".join(map(str, v.block_shape))
            sig[name], aligned = f"tensordesc<{_TYPES[v.base.dtype]}[{box}]>", False
        elif isinstance(v, torch.Tensor):
            sig[name], aligned = "*" + _TYPES[v.dtype], v.data_ptr() % 16 == 0
        elif isinstance(v, float):
            sig[name], aligned = "fp32", False
        else:
            sig[name] = "i64" if isinstance(v, int) and abs(v) >= 2**31 else "i32"
            aligned = isinstance(v, int) and v % 16 == 0 and not fn.params[i].do_not_specialize
        if aligned:
            attrs[(i,)] = [["tt.divisibility", 16]]
    sig.update({k: "constexpr" for k in const})
    return sig, attrs


def compile_row(fn, args: tuple, kwargs: dict, label: str = "") -> dict:
    """One recorded launch compiled for sm_90: kernel, label, warps, stages, regs, stack,
    smem (bytes), fits (smem under the limit), wgmma, mma (warp MMAs), tma (bulk tensor
    copies), cp_async; or the error a configuration that does not compile gives."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    const = {k: v for k, v in kwargs.items() if k in fn.arg_names}
    if "ON_CPU" in const:
        const["ON_CPU"] = False
    opts = {"num_warps": kwargs.get("num_warps", 4), "num_stages": kwargs.get("num_stages", 3)}
    row = {"kernel": fn.__name__, "config": label, **opts}
    try:
        sig, attrs = _signature(fn, args, const)
        c = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs),
                           target=GPUTarget("cuda", 90, 32), options=opts)  # fmt: skip
        tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(c.asm["cubin"])
            f.flush()
            res = subprocess.run([str(tool), "--dump-resource-usage", f.name], text=True,
                                 capture_output=True).stdout  # fmt: skip
        m = re.search(r"REG:(\d+) STACK:(\d+)", res)
        ptx = c.asm["ptx"]
        row |= {"regs": int(m[1]), "stack": int(m[2]), "smem": c.metadata.shared,
                "fits": c.metadata.shared <= SMEM_LIMIT,
                "wgmma": ptx.count("wgmma.mma_async"), "mma": ptx.count("mma.sync"),
                "tma": ptx.count("cp.async.bulk.tensor"),
                "cp_async": ptx.count("cp.async.cg")}  # fmt: skip
    except Exception as e:  # noqa: BLE001 - a config that does not compile is data
        row["error"] = f"{type(e).__name__}: {e}"[-600:]
    return row
