"""Host-side launch helpers (lily/ops/launch.py)."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from lily.ops import launch
from lily.transfer import to_device


def test_to_device_on_cpu_keeps_values_and_dtype():
    t = to_device([3, -1, 2**40], torch.long, torch.device("cpu"))
    assert t.dtype == torch.long and t.tolist() == [3, -1, 2**40]
    t = to_device([7, -(2**31), 2**31 - 1], torch.int32, torch.device("cpu"))
    assert t.dtype == torch.int32 and t.tolist() == [7, -(2**31), 2**31 - 1]
    assert to_device([], torch.long, torch.device("cpu")).shape == (0,)
    assert to_device([1, 0], torch.bool, torch.device("cpu")).tolist() == [True, False]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned non-blocking copies: CUDA")
def test_to_device_copies_survive_a_busy_device():
    """Many copies queued behind a sleeping device (the host does not wait for it): each
    must arrive with its own values, so no pinned block is reused before its copy ran."""
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)
    outs = [to_device([i, 2 * i, 3 * i], torch.long, torch.device("cuda")) for i in range(200)]
    torch.cuda.synchronize()
    assert all(o.tolist() == [i, 2 * i, 3 * i] for i, o in enumerate(outs))


class _Compiled:
    """Stands in for Triton's CompiledKernel: records what a direct launch passes."""

    function, packed_metadata = "fn", "meta"

    def __init__(self):
        self.calls = []

    def run(self, *a):
        self.calls.append(a)


def _kernel_source(p_x, n, eps, BLOCK: tl.constexpr, FLAG: tl.constexpr = False):
    pass


@pytest.fixture
def fake_triton(monkeypatch):
    """A real JITFunction whose Triton path is replaced by a recorder (no GPU here)."""
    monkeypatch.setattr(launch, "_FAST", True)
    monkeypatch.setattr(launch, "_INT_POINTERS", True)
    monkeypatch.setattr(launch, "_has_cuda", lambda: True)
    monkeypatch.setattr(launch, "_current_device", lambda: 0)
    monkeypatch.setattr(launch, "_current_stream", lambda dev: 1234)
    jf = triton.runtime.jit.JITFunction(_kernel_source)
    slow: list = []

    def run(*args, grid, warmup, **kwargs):
        slow.append((grid, args, kwargs))
        return _Compiled()

    jf.run = run
    return launch.Launched(jf), slow


def test_launched_goes_direct_only_for_a_seen_signature(fake_triton):
    k, slow = fake_triton
    x = torch.zeros(64, dtype=torch.float32)
    k[(3,)](x, 5, 1e-6, BLOCK=4)  # first: through Triton, which compiles
    assert len(slow) == 1 and slow[0][0] == (3,)
    k[(7, 2)](x, 5, 1e-6, BLOCK=4)  # same signature: the compiled kernel, directly
    assert len(slow) == 1
    compiled = next(iter(k.cache.values()))
    # grid padded to 3-D, the stream, no metadata or hooks, then every parameter in order
    # with the defaults filled in; with LILY_INT_POINTERS=1 a tensor as its address (an
    # int: Triton's launcher then makes no driver call to check it)
    assert compiled.calls == [(7, 2, 1, 1234, "fn", "meta", None, None, None, x.data_ptr(),
                               5, 1e-6, 4, False)]  # fmt: skip
    assert type(compiled.calls[0][9]) is int
    # anything Triton specializes on makes a new signature, which goes through Triton
    k[(1,)](x[1:], 5, 1e-6, BLOCK=4)  # a pointer off 16-byte alignment
    k[(1,)](x, 16, 1e-6, BLOCK=4)  # an int divisible by 16
    k[(1,)](x, 1, 1e-6, BLOCK=4)  # an int equal to 1 (a constant in the kernel)
    k[(1,)](x, 2**40, 1e-6, BLOCK=4)  # a 64-bit int
    k[(1,)](x.double(), 5, 1e-6, BLOCK=4)  # another dtype
    k[(1,)](x, 5, 1e-6, BLOCK=8)  # another constexpr
    k[(1,)](x, 5, 1e-6, BLOCK=4, num_warps=8)  # another launch option
    assert len(slow) == 8
    k[(1,)](x, 7, 2e-6, BLOCK=4)  # values Triton does not specialize on: direct
    assert len(slow) == 8 and len(compiled.calls) == 2
    k[(1,)](x, 7, 2e-6, 4)  # a constexpr by position: keyed by value, a new signature
    k[(1,)](x, 7, 2e-6, 8)
    k[(1,)](x, 7, 2e-6, 8)
    assert len(slow) == 10


def test_without_a_gpu_every_launch_goes_through_triton(monkeypatch):
    """A compile-only run on a machine without CUDA: the fast path (which asks CUDA for
    the device and stream) is off, so each launch is Triton's own."""
    monkeypatch.setattr(launch, "_FAST", True)
    monkeypatch.setattr(launch, "_has_cuda", lambda: False)
    jf = triton.runtime.jit.JITFunction(_kernel_source)
    slow: list = []
    jf.run = lambda *a, grid, warmup, **kw: slow.append(grid) or _Compiled()
    k = launch.Launched(jf)
    x = torch.zeros(64, dtype=torch.float32)
    k[(3,)](x, 5, 1e-6, BLOCK=4)
    k[(3,)](x, 5, 1e-6, BLOCK=4)
    assert not k.fast and slow == [(3,), (3,)] and not k.cache


def test_launch_key_is_the_spec_of_every_argument():
    """The inlined key (tensors and ints) equals ``_spec`` argument by argument, and a
    constexpr passed by position is keyed by its value."""
    k = launch.Launched.__new__(launch.Launched)
    t = torch.zeros(8, dtype=torch.bfloat16)
    args = (t, t[1:], torch.nn.Parameter(torch.zeros(4)), 1, 16, 17, 2**40, -(2**31) - 1,
            2**63, True, 0.5, None, 64)  # fmt: skip
    k.by_value = (False,) * (len(args) - 1) + (True,)
    assert k._key(args) == tuple(launch._spec(a) for a in args[:-1]) + (64,)
    assert k._key((t[1:],)) != k._key((t,))  # 2-byte offset: not 16-byte aligned


@pytest.mark.parametrize("ints", [True, False])
def test_direct_launch_passes_each_view_at_its_own_address(fake_triton, monkeypatch, ints):
    """A view 64 bytes into x (the same signature: direct) reaches the kernel at x's
    address + 64: as an int with LILY_INT_POINTERS=1, else as the tensor itself."""
    monkeypatch.setattr(launch, "_INT_POINTERS", ints)
    k, slow = fake_triton
    x = torch.zeros(64, dtype=torch.float32)
    k[(1,)](x, 5, 1e-6, BLOCK=4)
    k[(1,)](x[16:], 5, 1e-6, BLOCK=4)
    compiled = next(iter(k.cache.values()))
    assert len(slow) == 1 and len(compiled.calls) == 1
    p = compiled.calls[0][9]
    assert (type(p) is int) == ints
    assert (p if ints else p.data_ptr()) == x.data_ptr() + 64
