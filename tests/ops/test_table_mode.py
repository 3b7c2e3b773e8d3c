"""The prefill kernels' table mode (what a captured prefill graph runs): the state's buffers,
the rows that are tokens and the snapshot cut read from an int64 table on the device.

A padded chunk in table mode must give, on its token rows, what the plain call gives on
those rows alone: DeltaNet's output, final states and the snapshot at the cut (the same
chunk grid: bit for bit), and attention's output and cache rows; padding past the cache
is not written. Small odd shapes under the Triton interpreter, compiled on CUDA when present.
"""

from __future__ import annotations

import pytest
import torch

try:  # tests/ops may or may not be a package
    from .test_attention_ops import fill_cache, inv_freq
    from .test_attention_ops import make_inputs as attn_inputs
    from .test_attention_ops import reference as attn_reference
    from .test_deltanet_ops import DEVICE, OPS, make_inputs, nan_poisoned_empty, rel  # noqa: F401
except ImportError:
    from test_attention_ops import fill_cache, inv_freq
    from test_attention_ops import make_inputs as attn_inputs
    from test_attention_ops import reference as attn_reference
    from test_deltanet_ops import DEVICE, OPS, make_inputs, nan_poisoned_empty, rel  # noqa: F401


def proto(shape, dtype, device=DEVICE):
    """A stand-in that gives only shape and dtype (what table mode reads of the buffers)."""
    return torch.zeros(1, dtype=dtype, device=device).expand(*shape)


def padded(x: torch.Tensor, rows: int, seed: int) -> torch.Tensor:
    """x (T, N) with random rows appended up to ``rows`` (finite, as a padding id gives)."""
    gen = torch.Generator().manual_seed(seed)
    pad = torch.randn(rows - x.shape[0], x.shape[1], generator=gen).to(x.dtype).to(x.device)
    return torch.cat([x, pad])


def dn_call(d, x, z, b, a, cs, st, **kw):
    return OPS["dn_prefill"].deltanet_prefill(
        x, z, b, a, d["conv_weight"], cs, d["A_log"], d["dt_bias"], d["norm_weight"], st, 1e-6,
        method="chunk", **kw,
    )  # fmt: skip


@pytest.mark.parametrize(
    "n,rows,cut,chunk_size,block_v,dtype",
    [
        (37, 48, 21, 16, 16, torch.float32),  # shift 11; padding inside the last chunk
        (37, 64, 0, 16, 64, torch.float32),  # no cut; a whole chunk of padding; norm fused
        (5, 16, 2, 16, 16, torch.float32),  # fewer tokens than the conv's taps; cut < W-1
        (16, 16, 16 - 1, 16, 16, torch.float32),  # no padding; the cut one before the end
        (23, 64, 10, 64, 64, torch.bfloat16),  # the real chunk size and dtype
    ],
    ids=["37in48-cut21", "37in64", "5in16-cut2", "16in16-cut15", "23in64-cut10-bf16"],
)
def test_deltanet_table_mode_equals_the_plain_call(n, rows, cut, chunk_size, block_v, dtype):
    d = make_inputs(n, dtype=dtype, seed=21)
    d["A_log"] = d["A_log"] - 2.5  # slow decays: the state remembers across chunks
    kw = {"chunk_size": chunk_size, "block_v": block_v}
    cs, st = d["conv_state"].clone(), d["state"].clone()
    snaps: list = []
    cuts = (cut,) if cut else ()
    want = dn_call(d, *(d[k] for k in ("mixed_qkv", "z", "b", "a")), cs, st, cuts=cuts,
                   snaps=snaps if cuts else None, **kw)  # fmt: skip

    parts = [padded(d[k], rows, seed=i) for i, k in enumerate(("mixed_qkv", "z", "b", "a"))]
    cs2, st2 = d["conv_state"].clone(), d["state"].clone()
    snap_cs = torch.full_like(cs2, float("nan"))
    snap_st = torch.full_like(st2, float("nan"))
    addr = [cs2.data_ptr(), st2.data_ptr(), snap_cs.data_ptr(), snap_st.data_ptr(), n, cut]
    table = torch.tensor(addr, dtype=torch.int64, device=DEVICE)
    got = dn_call(d, *parts, proto(cs2.shape, cs2.dtype), proto(st2.shape, torch.float32),
                  table=table, **kw)  # fmt: skip
    assert got.shape == (rows, want.shape[1])
    assert torch.equal(got[:n], want)
    assert torch.equal(st2, st) and torch.equal(cs2, cs)
    if cut:
        assert torch.equal(snap_cs, snaps[0][0]) and torch.equal(snap_st, snaps[0][1])
    else:  # no cut: the snapshot buffers are not touched
        assert snap_cs.isnan().all() and snap_st.isnan().all()


def test_deltanet_table_mode_padding_leaves_the_states():
    """A chunk of one token and 15 of padding: the states after it are those after that one
    token (the decode kernel's step is the independent check here)."""
    d = make_inputs(1, dtype=torch.float32, seed=22)
    cs, st = d["conv_state"].clone(), d["state"].clone()
    OPS["dn_decode"].deltanet_decode(
        d["mixed_qkv"][0], d["z"][0], d["b"][0], d["a"][0], d["conv_weight"], cs, d["A_log"],
        d["dt_bias"], d["norm_weight"], st, 1e-6,
    )  # fmt: skip
    parts = [padded(d[k], 16, seed=i) for i, k in enumerate(("mixed_qkv", "z", "b", "a"))]
    cs2, st2 = d["conv_state"].clone(), d["state"].clone()
    table = torch.tensor([cs2.data_ptr(), st2.data_ptr(), 0, 0, 1, 0], device=DEVICE)
    dn_call(d, *parts, proto(cs2.shape, cs2.dtype), proto(st2.shape, torch.float32),
            table=table, chunk_size=16, block_v=16)  # fmt: skip
    assert torch.equal(cs2, cs)
    assert rel(st2, st) < 1e-5


def test_deltanet_table_mode_rejects_what_it_cannot_do():
    d = make_inputs(4, dtype=torch.float32, device="cpu")
    x = [d[k] for k in ("mixed_qkv", "z", "b", "a")]
    table = torch.zeros(6, dtype=torch.int64)
    with pytest.raises(ValueError, match="a table needs method 'chunk' and no cuts"):
        dn_call(d, *x, d["conv_state"], d["state"], table=table, cuts=(2,), snaps=[])
    with pytest.raises(ValueError, match=r"table must be a \(6,\) int64 tensor"):
        dn_call(d, *x, d["conv_state"], d["state"], table=table[:5])


@pytest.mark.parametrize(
    "start,n,rows,t_max", [(0, 9, 16, 48), (30, 9, 32, 48), (70, 5, 16, 96)],
    ids=["fresh", "padding-past-the-cache", "after-history"],
)  # fmt: skip
def test_attention_table_mode_equals_the_plain_call(start, n, rows, t_max):
    """Token rows of a padded chunk with a device start and the caches named by a table:
    the plain call's output and cache rows; padding rows are written only inside the cache
    (the table's T_max), never into the guard band after it."""
    d = attn_inputs(n, t_max, h=16, dtype=torch.float32, seed=23)
    fill_cache(d, start)
    ref_out, _, _ = attn_reference(d, start, slice(0, n))
    want = OPS["attn_prefill"].attention_prefill(
        d["qg"], d["k"], d["v"], d["q_norm"], d["k_norm"], d["k_cache"].clone(),
        d["v_cache"].clone(), start, inv_freq(), block_m=16, block_n=16,
    )  # fmt: skip
    hkv, _, dh = d["k_cache"].shape
    guard = 4 * dh  # NaN past each cache: a write beyond T_max shows there
    flat = [torch.full((hkv * t_max * dh + guard,), float("nan"), device=DEVICE) for _ in "kv"]
    caches = [f[: hkv * t_max * dh].view(hkv, t_max, dh) for f in flat]
    for c, src in zip(caches, (d["k_cache"], d["v_cache"]), strict=True):
        c.copy_(src)
    qg, k, v = (padded(d[x], rows, seed=i) for i, x in enumerate(("qg", "k", "v")))
    table = torch.tensor([caches[0].data_ptr(), caches[1].data_ptr(), t_max], device=DEVICE)
    got = OPS["attn_prefill"].attention_prefill(
        qg, k, v, d["q_norm"], d["k_norm"], proto((hkv, 1, dh), torch.float32),
        proto((hkv, 1, dh), torch.float32), torch.tensor([start], device=DEVICE), inv_freq(),
        block_m=16, block_n=16, table=table,
    )  # fmt: skip
    assert got.shape == (rows, want.shape[1])
    assert torch.isfinite(got).all()  # padding past the cache too (see the prep kernel)
    assert rel(got[:n], want) < 1e-6 and rel(got[:n], ref_out) < 1e-4
    end = start + n
    for c, src in zip(caches, (d["k_cache"], d["v_cache"]), strict=True):
        assert torch.equal(c[:, :start], src[:, :start])  # history untouched
    plain = OPS["attn_prefill"].attention_prefill  # the token rows' K/V as the plain call
    kc, vc = d["k_cache"].clone(), d["v_cache"].clone()
    plain(d["qg"], d["k"], d["v"], d["q_norm"], d["k_norm"], kc, vc, start, inv_freq(),
          block_m=16, block_n=16)  # fmt: skip
    assert torch.equal(caches[0][:, :end], kc[:, :end])
    assert torch.equal(caches[1][:, :end], vc[:, :end])
    written = min(start + rows, t_max)  # padding rows inside the cache hold their K
    assert torch.isfinite(caches[0][:, end:written]).all()
    assert caches[0][:, written:].isnan().all()
    assert flat[0][-guard:].isnan().all() and flat[1][-guard:].isnan().all()
