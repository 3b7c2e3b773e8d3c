"""Guard bands: every kernel op of the GPU runner on tensors that sit inside NaN buffers.

The H200 multi-turn runs showed rare NaN prefill logits that no repeat reproduced. One cause
that fits: a kernel reading a few elements outside the tensors it was given (padded tile
rows or columns, a mask against the wrong bound, a wrong stride, an unmasked load). Usually
the neighbours are finite and the stray values are multiplied by zero or masked later; when
a neighbour happens to hold NaN bits, 0 * NaN = NaN leaks into the result.

Here every tensor an op touches is a contiguous view in the middle of a larger buffer whose
other elements are NaN (floats) or 0x7FC00000 (int32: NaN's bit pattern, and a wild index):
inputs, packed weights (qweight, scales, biases), caches, states, workspaces, and the
buffers the launchers allocate themselves (torch.empty / empty_like / zeros are redirected
while the op runs; their own elements start as NaN too, as in the other op tests). Each op
must give bit for bit what it gives on ordinary tensors, with finite outputs, and leave
every guard element as it was (no write out of bounds). Under the Triton interpreter a load
goes straight to host memory, so any read outside a tensor lands in its guards. Races
between GPU threads (tickets, barriers) are out of reach of a CPU test.

Shapes are the small odd ones of the other op tests (N=40, K=320 in 10 groups, T=13, Vd=48,
Dh=64 with 16 rotary dims, ...), so the module stays quick under the interpreter.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager

import pytest
import torch

try:  # tests/ops may or may not be a package
    from . import test_attention_ops as attn_t
    from . import test_deltanet_ops as dn_t
    from . import test_moe_ops as moe_t
    from . import test_qlinear_ops as lin_t
except ImportError:
    import test_attention_ops as attn_t
    import test_deltanet_ops as dn_t
    import test_moe_ops as moe_t
    import test_qlinear_ops as lin_t

from lily.ops.attention_decode import attention_decode
from lily.ops.attention_prefill import attention_prefill
from lily.ops.deltanet_decode import DeltaNetDecodeWorkspace, deltanet_decode
from lily.ops.deltanet_prefill import deltanet_prefill
from lily.ops.moe_decode import moe_decode
from lily.ops.moe_prefill import MoePrefillConfig, moe_prefill
from lily.ops.qgemm import GemmConfig, qgemm
from lily.ops.qgemv import GemvConfig, qgemv
from lily.ops.rmsnorm import add_rmsnorm, rmsnorm
from lily.quant import QuantWeight

DEVICE = dn_t.DEVICE
INT_POISON = 0x7FC00000  # an int32 whose bits are a float NaN
MIN_PAD = 64  # guard elements each side, at least (and at least the tensor's own size)

# The real allocators, taken before any test redirects them.
_empty, _empty_like, _zeros = torch.empty, torch.empty_like, torch.zeros


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shape, dtype and bytes (NaN payloads included)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
    )


class Guards:
    """Tensors placed inside poisoned buffers; ``check`` asserts the guards are untouched."""

    def __init__(self) -> None:
        self.bands: list[tuple[torch.Tensor, int, int, torch.Tensor]] = []

    def alloc(self, shape, dtype: torch.dtype, device, fill=None) -> torch.Tensor:
        n = 1
        for s in shape:
            n *= s
        # 16-element multiples keep the view as aligned as a fresh allocation.
        pad = -(-max(n, MIN_PAD) // 16) * 16
        poison = float("nan") if dtype.is_floating_point else INT_POISON
        buf = _empty(n + 2 * pad, dtype=dtype, device=device).fill_(poison)
        self.bands.append((buf, pad, n, buf.clone()))
        t = buf[pad : pad + n]
        if fill is not None:
            t.fill_(fill)
        return t.view(tuple(shape))

    def place(self, x):
        """A guarded copy of a tensor or of a QuantWeight's three tensors (others as is)."""
        if isinstance(x, QuantWeight):
            return QuantWeight(
                self.place(x.qweight), self.place(x.scales), self.place(x.biases), x.bits,
                x.group_size,
            )  # fmt: skip
        if not isinstance(x, torch.Tensor):
            return x
        t = self.alloc(x.shape, x.dtype, x.device)
        t.copy_(x)
        return t

    def check(self) -> None:
        for i, (buf, pad, n, snap) in enumerate(self.bands):
            for part in (slice(0, pad), slice(pad + n, None)):
                assert same_bits(buf[part], snap[part]), f"write outside tensor #{i} ({n} elems)"

    @contextmanager
    def allocations(self, monkeypatch):
        """While open, the launchers' torch.empty / empty_like / zeros come from here."""

        def redirect(real, fill):
            def alloc(*args, **kwargs):
                t = real(*args, **kwargs)  # resolves the shape, dtype and device
                return self.alloc(t.shape, t.dtype, t.device, fill)

            return alloc

        with monkeypatch.context() as m:
            m.setattr(torch, "empty", redirect(_empty, None))
            m.setattr(torch, "empty_like", redirect(_empty_like, None))
            m.setattr(torch, "zeros", redirect(_zeros, 0))
            yield


def plain_copy(x):
    if isinstance(x, QuantWeight):
        return QuantWeight(x.qweight.clone(), x.scales.clone(), x.biases.clone(), x.bits,
                           x.group_size)  # fmt: skip
    return x.clone() if isinstance(x, torch.Tensor) else x


def check_op(monkeypatch, call: Callable[[dict], object], inputs: dict, inplace=()) -> None:
    """``call`` on guarded copies of ``inputs`` and on plain ones: no guard element
    changed, outputs finite and bit-identical, the tensors named in ``inplace`` (states,
    caches) updated identically. The guarded call runs first: a stray write lands in a
    guard and fails here, where on plain tensors it would corrupt the heap."""
    plain = {k: plain_copy(v) for k, v in inputs.items()}
    g = Guards()
    guarded = {k: g.place(v) for k, v in inputs.items()}
    with g.allocations(monkeypatch):
        got = call(guarded)
    g.check()
    want = call(plain)
    want = want if isinstance(want, tuple) else (want,)
    got = got if isinstance(got, tuple) else (got,)
    for i, (a, b) in enumerate(zip(want, got, strict=True)):
        assert torch.isfinite(a).all(), f"output {i}: non-finite on plain tensors"
        assert torch.isfinite(b).all(), f"output {i}: non-finite inside the guards"
        assert same_bits(a, b), f"output {i} differs inside the guards"
    for k in inplace:
        assert same_bits(plain[k], guarded[k]), f"{k} updated differently inside the guards"


def rand(gen: torch.Generator, *shape, dtype=torch.bfloat16, scale=1.0, shift=0.0):
    return (torch.randn(*shape, generator=gen) * scale + shift).to(DEVICE, dtype)


# ----------------------------------------------------------------------------- norms


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_rmsnorm_and_add_rmsnorm_guarded(monkeypatch, dtype):
    gen = torch.Generator().manual_seed(1)
    inputs = {
        "x": rand(gen, 5, 100, dtype=dtype, scale=3.0, shift=0.5),
        "r": rand(gen, 5, 100, dtype=dtype),
        "w": rand(gen, 100, scale=0.2, shift=1.0),
    }
    check_op(monkeypatch, lambda a: rmsnorm(a["x"], a["w"], 1e-6), inputs)
    check_op(monkeypatch, lambda a: rmsnorm(a["x"][-1:], a["w"], 1e-6), inputs)
    check_op(monkeypatch, lambda a: add_rmsnorm(a["x"], a["r"], a["w"], 1e-6), inputs)


# ----------------------------------------------------------------------------- qgemm, qgemv


@pytest.mark.parametrize(
    "bits,gs,cfg,precise,out_dtype",
    [
        (4, 64, None, False, torch.bfloat16),
        (8, 32, GemmConfig(16, 32, 128), False, torch.float32),
        (4, 64, GemmConfig(16, 32, 128), True, torch.float32),
    ],
    ids=["4b-g64-table", "8b-g32-k128-tail", "4b-g64-precise-k128-tail"],
)
def test_qgemm_guarded(monkeypatch, bits, gs, cfg, precise, out_dtype):
    """T=13, N=40 (partial row and token tiles), K=192 (a 128-wide K step half past K)."""
    gen = torch.Generator().manual_seed(bits * gs)
    inputs = {"x": rand(gen, 13, 192), "w": lin_t._weight(40, 192, bits, gs, DEVICE, gen)}
    check_op(
        monkeypatch,
        lambda a: qgemm(a["x"], a["w"], out_dtype=out_dtype, precise=precise, config=cfg),
        inputs,
    )


@pytest.mark.parametrize(
    "rows,bits,gs,norm,res,cfg,out_dtype",
    [
        (0, 4, 32, False, False, None, None),
        (0, 4, 32, True, True, GemvConfig(8, 2, 3, 4), None),
        (0, 8, 32, True, False, GemvConfig(8, 16, 1, 4), torch.float32),
        (3, 4, 32, False, True, None, None),
        (3, 8, 32, True, True, GemvConfig(8, 4, 2, 4), torch.float32),
    ],
    ids=[
        "t1-table",
        "t1-norm-res-split3",
        "t1-8b-norm-whole-row-fp32",
        "t3-res-table",
        "t3-8b-norm-res-split2-fp32",
    ],  # fmt: skip
)
def test_qgemv_guarded(monkeypatch, rows, bits, gs, norm, res, cfg, out_dtype):
    """N=40 (a partial row block), K=320 (10 groups: uneven split-K slices, masked steps);
    T=1 as (K,) and T=3 as (3, K), norm prologue and residual on and off."""
    gen = torch.Generator().manual_seed(40 + rows + bits)
    lead = () if rows == 0 else (rows,)
    inputs = {
        "x": rand(gen, *lead, 320, scale=3.0, shift=0.5),
        "w": lin_t._weight(40, 320, bits, gs, DEVICE, gen),
        "nw": rand(gen, 320, scale=0.2, shift=1.0) if norm else None,
        "res": rand(gen, *lead, 40) if res else None,
    }
    check_op(
        monkeypatch,
        lambda a: qgemv(
            a["x"], a["w"], norm_weight=a["nw"], residual=a["res"], out_dtype=out_dtype, config=cfg
        ),  # fmt: skip
        inputs,
    )


# ----------------------------------------------------------------------------- MoE


@pytest.mark.parametrize(
    "t,bits,gs,shared,k,res,cfg",
    [
        (13, 4, 64, True, 2, True,
         MoePrefillConfig(16, GemmConfig(16, 32, 64), GemmConfig(16, 64, 64))),
        (13, 8, 64, False, 3, False, None),
        (3, 4, 32, True, 2, True, None),
    ],
    ids=["t13-4b-g64-shared-k2-m16-res", "t13-8b-g64-k3-table", "t3-4b-g32-shared-table"],
)  # fmt: skip
def test_moe_prefill_guarded(monkeypatch, t, bits, gs, shared, k, res, cfg):
    """E=5, I=64, Is=128, D=192, T=13 and 3: partial tiles, empty experts, the worst-case
    block map mostly unused, h wider than a routed expert's I when the shared expert is on."""
    w = moe_t.make_moe(5, bits, gs, shared, seed=bits + gs, device=DEVICE)
    gen = torch.Generator().manual_seed(2)
    inputs = {"x": rand(gen, t, moe_t.D), "res": rand(gen, t, moe_t.D) if res else None, **w}
    check_op(
        monkeypatch,
        lambda a: moe_prefill(a["x"], *[a[n] for n in w], k, a["res"], config=cfg),
        inputs,
    )


@pytest.mark.parametrize(
    "bits,gs,shared,k,norm,cfg",
    [
        (4, 64, True, 2, True, None),
        (8, 32, False, 3, False, moe_t.ODD),
    ],
    ids=["4b-g64-shared-k2-norm", "8b-g32-k3-odd-tiles"],
)
def test_moe_decode_guarded(monkeypatch, bits, gs, shared, k, norm, cfg):
    w = moe_t.make_moe(5, bits, gs, shared, seed=bits * gs, device=DEVICE)
    gen = torch.Generator().manual_seed(3)
    inputs = {
        "x": rand(gen, moe_t.D, scale=2.0, shift=0.3),
        "nw": rand(gen, moe_t.D, scale=0.2, shift=1.0) if norm else None,
        **w,
    }
    check_op(
        monkeypatch,
        lambda a: moe_decode(
            a["x"], *[a[n] for n in w], k, a["x"], norm_weight=a["nw"], config=cfg
        ),  # fmt: skip
        inputs,
    )


# ----------------------------------------------------------------------------- DeltaNet

DN_ARGS = ("mixed_qkv", "z", "b", "a", "conv_weight", "conv_state", "A_log", "dt_bias",
           "norm_weight", "state")  # fmt: skip


@pytest.mark.parametrize(
    "t,chunk_size,block_v",
    [(19, 64, None), (19, 16, None), (19, 64, 64), (2, 16, None), (37, 32, 64)],
    ids=[
        "t19-runner-defaults",
        "t19-chunk16-split-norm",
        "t19-chunk64-fused-norm",
        "t2-conv-state-mix",
        "t37-chunk32-fused-norm",
    ],  # fmt: skip
)
def test_deltanet_prefill_chunk_guarded(monkeypatch, t, chunk_size, block_v):
    """The chunked form (the runner's) on T not a multiple of the chunk (padded chunk
    rows), Vd=48 split over two programs (separate gated-norm kernel) or whole, and T=2
    below the conv width (the new conv state mixes old state rows)."""
    d = dn_t.make_inputs(t, device=DEVICE, seed=t)
    check_op(
        monkeypatch,
        lambda a: deltanet_prefill(
            *[a[n] for n in DN_ARGS], 1e-6, method="chunk", chunk_size=chunk_size, block_v=block_v
        ),  # fmt: skip
        d,
        inplace=("conv_state", "state"),
    )


@pytest.mark.parametrize("block_v", [16, 64], ids=["split-last-arrival", "whole-head"])
def test_deltanet_decode_guarded(monkeypatch, block_v):
    """G=2 value heads per key head; block_v=16 splits Vd=48 over 3 programs (the counter,
    the parked fp32 rows); the workspace is guarded like everything else."""
    d = dn_t.make_inputs(1, device=DEVICE, seed=9)
    d = {k: (v[0] if k in ("mixed_qkv", "z", "b", "a") else v) for k, v in d.items()}

    def call(a):
        ws = DeltaNetDecodeWorkspace.new(2, 4, 48, DEVICE)
        out = deltanet_decode(*[a[n] for n in DN_ARGS], 1e-6, workspace=ws, block_v=block_v)
        assert (ws.counters == 0).all()
        return out

    check_op(monkeypatch, call, d, inplace=("conv_state", "state"))


# ----------------------------------------------------------------------------- attention

ATTN_ARGS = ("qg", "k", "v", "q_norm", "k_norm", "k_cache", "v_cache")


@pytest.mark.parametrize(
    "t,start,device_start,block_m,block_n",
    [(13, 0, False, 64, 32), (13, 11, True, 16, 16), (5, 30, False, 16, 16)],
    ids=["t13-at0-default-tiles", "t13-at11-device-start", "t5-at30-near-cache-end"],
)
def test_attention_prefill_guarded(monkeypatch, t, start, device_start, block_m, block_n):
    """Cache rows [0, start) filled, the rest NaN (never-written rows); T_max=40, so the
    last case ends five rows short of the cache's end."""
    d = attn_t.make_inputs(t, 40, device=DEVICE, seed=start)
    attn_t.fill_cache(d, start)
    d["inv_freq"] = attn_t.inv_freq(device=DEVICE)
    d["start"] = torch.tensor([start], dtype=torch.int32, device=DEVICE) if device_start else start
    check_op(
        monkeypatch,
        lambda a: attention_prefill(
            *[a[n] for n in ATTN_ARGS], a["start"], a["inv_freq"], block_m=block_m, block_n=block_n
        ),  # fmt: skip
        d,
        inplace=("k_cache", "v_cache"),
    )


@pytest.mark.parametrize(
    "pos,max_len,split",
    [(37, None, 0), (37, None, 16), (21, 32, 16), (47, None, 16)],
    ids=["plain", "split16", "split16-bucket32", "split16-last-row"],
)
def test_attention_decode_guarded(monkeypatch, pos, max_len, split):
    """T_max=48, rows [0, pos) filled, the rest NaN; split-KV with a partial last block, a
    bucket (max_len) below T_max, and pos at the cache's last row."""
    d = attn_t.make_inputs(1, 48, device=DEVICE, seed=pos)
    attn_t.fill_cache(d, pos)
    d = {k: (v[0] if k in ("qg", "k", "v") else v) for k, v in d.items()}
    d["inv_freq"] = attn_t.inv_freq(device=DEVICE)
    d["pos"] = torch.tensor([pos], dtype=torch.int32, device=DEVICE)
    check_op(
        monkeypatch,
        lambda a: attention_decode(
            *[a[n] for n in ATTN_ARGS],
            a["pos"],
            a["inv_freq"],
            max_len=max_len,
            split=split,
            block_n=16,
        ),  # fmt: skip
        d,
        inplace=("k_cache", "v_cache"),
    )


def test_guards_catch_a_stray_read_and_write():
    """The harness itself: one element read past a guarded tensor is NaN (int32: the
    poison), and one element written past it fails the check."""
    g = Guards()
    x = g.place(torch.ones(7, device=DEVICE))
    i = g.place(torch.zeros(5, dtype=torch.int32, device=DEVICE))
    assert torch.isnan(x.as_strided((8,), (1,))[7])
    assert i.as_strided((1,), (1,), i.storage_offset() - 1).item() == INT_POISON
    g.check()
    x.as_strided((8,), (1,))[7] = 1.0
    with pytest.raises(AssertionError, match="write outside"):
        g.check()
