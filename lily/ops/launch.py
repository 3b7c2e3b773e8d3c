"""Host-side helpers the kernels' launchers share: argument checks with clear errors,
small integer helpers, and programmatic-dependent-launch options."""

from __future__ import annotations

import contextlib
import os
import weakref

import torch
import triton

from lily.ops.arch import current_arch
from lily.quant import QuantWeight

Tensor = torch.Tensor


def mask_lo(bits: int) -> int:
    """Mantissa mask of a code's field; passed at run time so the compiler keeps it in a
    register and folds mask-and-or into one LOP3 (two immediates would take two)."""
    return 0x78000 if bits == 4 else 0x7F8000


def cdiv(a: int, b: int) -> int:
    """Host-side ceil(a / b).

    NOTE: ``triton.cdiv`` and ``triton.next_power_of_2`` are ConstexprFunctions in Triton 3.6:
    a few microseconds per host call, which adds up to tens of microseconds per launcher."""
    return -(-a // b)


def check(cond: bool, op: str, msg) -> None:
    """A ValueError naming ``op`` when ``cond`` fails; ``msg`` a string or a function giving
    one.

    NOTE: the checks run on every layer of a prefill; an f-string message cost ~1.4 us to
    format even when the check passed (behind a lambda it costs nothing)."""
    if not cond:
        raise ValueError(f"{op}: {msg() if callable(msg) else msg}")


def pow2(n: int) -> int:
    """Host-side smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, n - 1).bit_length()


# Weights already checked, by id (weak values: an entry leaves with its weight, so an id
# is never reused while it is here). A prefill checks each weight hundreds of times.
_CHECKED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def check_weight(w: QuantWeight, name: str, ndim: int) -> None:
    """Clear errors for a packed weight the kernels cannot read (once per weight object;
    QuantWeights are not changed in place)."""
    if isinstance(w, QuantWeight) and _CHECKED.get(id(w)) is w and w.qweight.dim() == ndim:
        return
    _check_weight(w, name, ndim)
    _CHECKED[id(w)] = w


def _check_weight(w: QuantWeight, name: str, ndim: int) -> None:
    if not isinstance(w, QuantWeight):
        raise TypeError(f"{name}: expected a QuantWeight, got {type(w).__name__}")
    if w.bits not in (4, 8):
        raise ValueError(f"{name}: {w.bits}-bit weights are not supported (4 or 8)")
    if w.group_size not in (32, 64, 128):
        raise ValueError(f"{name}: group size {w.group_size} is not supported (32, 64 or 128)")
    if w.qweight.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dims, got qweight {tuple(w.qweight.shape)}")
    if w.qweight.dtype != torch.int32:
        raise TypeError(f"{name}: qweight must be int32 (uint32 bits), got {w.qweight.dtype}")
    k = w.shape[-1]
    if k % w.group_size:
        raise ValueError(f"{name}: K={k} is not a multiple of group size {w.group_size}")
    want = (*w.qweight.shape[:-1], k // w.group_size)
    for part in ("scales", "biases"):
        t = getattr(w, part)
        if tuple(t.shape) != want:
            raise ValueError(f"{name}: {part} shape {tuple(t.shape)}, expected {want}")
        if t.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise TypeError(f"{name}: {part} dtype {t.dtype} is not a float type")
        if t.stride(-1) != 1 or t.device != w.qweight.device:
            raise ValueError(f"{name}: {part} must be contiguous along groups, on qweight's device")
    if w.qweight.stride(-1) != 1:
        raise ValueError(f"{name}: qweight must be contiguous along K")
    if w.scales.stride() != w.biases.stride():
        raise ValueError(f"{name}: scales and biases must share strides")


def check_x(x: Tensor, k: int, name: str, device: torch.device) -> None:
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"{name}: x dtype {x.dtype} is not bf16, fp16 or fp32")
    if x.shape[-1] != k:
        raise ValueError(f"{name}: x has {x.shape[-1]} inputs, the weight expects {k}")
    if x.device != device:
        raise ValueError(f"{name}: x is on {x.device}, the weight on {device}")


def pdl_launch(pdl: bool) -> dict:
    """Launch options for programmatic dependent launch (nothing when off, so the kernels
    compiled without it keep their cache entries)."""
    return {"launch_pdl": True} if pdl else {}


def use_pdl(pdl: bool, device: torch.device) -> bool:
    """PDL only where the architecture in use has it (sm_90 and newer, unless a fallback is
    forced; see lily.ops.arch), never on the CPU (a no-op elsewhere)."""
    return pdl and device.type != "cpu" and current_arch(device).pdl


# ---------------------------------------------------------------- fast repeat launches

# LILY_FAST_LAUNCH=0 sends every launch through Triton's own path (for bisecting).
_FAST = os.environ.get("LILY_FAST_LAUNCH", "1") != "0"
# LILY_INT_POINTERS=1: the direct launch passes tensors' addresses as ints (see _key_args).
# Off until measured on a GPU: it saves a driver call a tensor argument, but a host tensor
# that reached a launch would then fault on the device instead of raising in Triton.
_INT_POINTERS = os.environ.get("LILY_INT_POINTERS", "0") == "1"


_I32, _I64 = 2**31, 2**63


def _spec(a) -> tuple:
    """What Triton 3.6 specializes a kernel argument on, or a stricter superset: a
    tensor's dtype and 16-byte alignment; an int's width, equality to 1 and divisibility
    by 16 (a value of 1 becomes a constant inside the kernel)."""
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() % 16 == 0)
    if isinstance(a, bool):
        return ("b", a)
    if isinstance(a, int):
        width = 0 if -_I32 <= a < _I32 else 1 if -_I64 <= a < _I64 else 2
        return ("i", width, a == 1, a % 16 == 0)
    if isinstance(a, float):
        return ("f",)
    if a is None:
        return ("n",)
    raise TypeError(type(a))


def _has_cuda() -> bool:
    return torch.cuda.is_available()


def _current_device() -> int:
    return torch.cuda.current_device()


def _current_stream(device: int) -> int:
    """The raw handle of torch's current stream (a capture stream inside a CUDA graph)."""
    return torch._C._cuda_getCurrentRawStream(device)


def _hooked() -> bool:
    """Whether a launch hook is installed (Triton 3.6 keeps an empty HookChain when none
    is; a profiler such as proton adds one), so launches must go through Triton."""
    rt = triton.knobs.runtime
    h, x = rt.launch_enter_hook, rt.launch_exit_hook  # (no generator: a launch asks this)
    return bool(getattr(h, "calls", h is not None) or getattr(x, "calls", x is not None))


class Launched:
    """A ``@triton.jit`` kernel whose repeated launches skip Triton's dispatch.

    NOTE (why): Triton's ``run`` binds, specializes and hashes the arguments and builds
    launch metadata on every call: tens of microseconds, and a prefill launches about 770
    kernels, so the host (not the GPU) set the pace of short prefills. The first launch
    of each argument signature goes through Triton (compiling when needed) and the
    compiled kernel is kept under a key holding everything Triton specializes on (see
    ``_spec``) plus every keyword (constexprs and launch options); later launches with
    that key call the compiled kernel directly. Under the interpreter, with launch hooks
    installed, or with LILY_FAST_LAUNCH=0, every launch takes Triton's path.
    """

    def __init__(self, fn):
        self.fn = fn
        params = getattr(fn, "params", None)
        # Only with a GPU: the fast path asks CUDA for the current device and stream (a
        # compile-only run on a machine without one goes through Triton's own path).
        self.fast = (_FAST and isinstance(fn, triton.runtime.jit.JITFunction) and params
                     and _has_cuda())  # fmt: skip
        if self.fast:
            self.names = [p.name for p in params]
            self.defaults = {p.name: p.default for p in params if p.has_default}
            # a constexpr passed by position is keyed by its value, like a keyword
            self.by_value = tuple(p.is_constexpr for p in params)
        self.cache: dict = {}

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def _key(self, args: tuple) -> tuple:
        """``_spec`` of each argument (constexprs by value)."""
        return self._key_args(args)[0]

    def _key_args(self, args: tuple) -> tuple[tuple, list]:
        """(``_key``, the arguments as the direct launch passes them: a tensor as its
        address with _INT_POINTERS), in one pass with tensors and ints inline: a prefill
        keys about 500 launches of ~17 arguments, and a call per argument was about a third
        of the key's host time.

        NOTE: Triton's launcher calls cuPointerGetAttribute on every tensor's address (a
        driver call each, ~12 a launch) to reject host memory; an int it passes as it is.
        A signature's first launch goes through Triton's checks, and the launchers check
        devices themselves."""
        out, call = [], []
        tensor, param, ints = torch.Tensor, torch.nn.Parameter, _INT_POINTERS
        for a, v in zip(args, self.by_value, strict=False):
            t = type(a)
            if v:
                out.append(a)
            elif t is tensor or t is param:
                p = a.data_ptr()
                out.append((a.dtype, p % 16 == 0))
                if ints:
                    a = p
            elif t is int:  # as _spec: width, equality to 1, divisibility by 16
                w = 0 if -_I32 <= a < _I32 else 1 if -_I64 <= a < _I64 else 2
                out.append(("i", w, a == 1, a % 16 == 0))
            else:
                out.append(_spec(a))
            call.append(a)
        return tuple(out), call

    def launch(self, grid, args: tuple, kwargs: dict) -> None:
        if _recording is not None:  # the compile matrix: note the launch, run nothing
            _recording.append((self, grid, args, kwargs))
            return
        if not self.fast or _hooked():
            self.fn[grid](*args, **kwargs)
            return
        try:
            # a call site passes its keywords in one order: no sort needed for a stable key
            spec, call = self._key_args(args)
            key = (_current_device(), spec, tuple(kwargs.items()))
            kernel = self.cache.get(key)
        except TypeError:  # an argument kind the key does not cover, or unhashable
            self.fn[grid](*args, **kwargs)
            return
        if kernel is None:
            self.cache[key] = self.fn[grid](*args, **kwargs)
            return
        rest = self.names[len(args) :]
        bound = [*call, *(kwargs[n] if n in kwargs else self.defaults[n] for n in rest)]
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        stream = _current_stream(key[0])
        # No hook is installed (checked above): no launch metadata, no hook calls.
        kernel.run(grid[0], g1, g2, stream, kernel.function, kernel.packed_metadata, None,
                   None, None, *bound)  # fmt: skip


def launched(fn) -> Launched:
    """Decorator over ``@triton.jit`` for kernels launched from the host (see Launched)."""
    return Launched(fn)


# (kernel, grid, args, kwargs) of each launch while ``record_launches`` is active
_recording: list | None = None


@contextlib.contextmanager
def record_launches():
    """Inside, every ``Launched`` kernel records its launch instead of running; yields the
    list of ``(Launched, grid, args, kwargs)``. The compile matrix (lily/ops/matrix.py)
    calls the public ops on meta tensors under it, so it sees exactly the arguments, dtypes
    and constexprs the launchers pass."""
    global _recording
    outer, _recording = _recording, []
    try:
        yield _recording
    finally:
        _recording = outer
