"""Gated attention kernels (decode plain and split-KV, prefill flash) against the plain fp32
reference in lily.model.ref.

Small shapes under the Triton interpreter (4 query heads over 2 KV heads, Dh 64 with 16
rotary dims, cache lengths 1, 5, 77, split blocks of 16; 6 over 2 at Dh 48 with the new row
placed around the tiles of split blocks of 32), compiled on CUDA when present.
Cache rows nobody has written are NaN, as is every buffer the launchers allocate, so a read
past the valid length or an unwritten output fails. Bounds (relative L2): fp32 1e-5
(5e-3 on a GPU, whose tensor cores take fp32 products as tf32);
bf16 2e-2 (q and the softmax weights enter the tensor-core products as bf16, the output and
the cached K are rounded to bf16).
"""

from __future__ import annotations

import pytest
import torch

try:  # tests/ops may or may not be a package
    from .test_deltanet_ops import DEVICE, DOT_F32_TOL, OPS, nan_poisoned_empty, rel  # noqa: F401
except ImportError:
    from test_deltanet_ops import DEVICE, DOT_F32_TOL, OPS, nan_poisoned_empty, rel  # noqa: F401

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from lily.model.norm import rms_norm  # noqa: E402
from lily.model.ref import ref_attention  # noqa: E402
from lily.model.rope import apply_rope, rope_cos_sin  # noqa: E402

DEVICES = [DEVICE]
THETA = 1e7
rms_rope_rows = OPS["norm_rope"].rms_rope_rows


def make_inputs(t, t_max, h=4, hkv=2, dh=64, dtype=torch.bfloat16, device=DEVICE, seed=0):
    """Projections of T tokens, norm weights, and caches of T_max rows all NaN."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(dtype).to(device)

    d = dict(
        qg=rnd(t, h * 2 * dh),
        k=rnd(t, hkv * dh),
        v=rnd(t, hkv * dh),
        q_norm=(torch.rand(dh, generator=gen) + 0.5).to(dtype).to(device),
        k_norm=(torch.rand(dh, generator=gen) + 0.5).to(dtype).to(device),
        k_cache=torch.full((hkv, t_max, dh), float("nan"), dtype=dtype, device=device),
    )
    d["v_cache"] = d["k_cache"].clone()
    return d


def reference(d, start, rows, r=16):
    """One-shot reference for tokens ``rows`` at positions start.., on the caches of d."""
    c = {k: v.cpu() for k, v in d.items()}
    return ref_attention(
        c["qg"][rows],
        c["k"][rows],
        c["v"][rows],
        c["q_norm"],
        c["k_norm"],
        c["k_cache"],
        c["v_cache"],
        start,
        r,
        THETA,
    )


def inv_freq(r=16, device=DEVICE):
    return OPS["norm_rope"].rope_inv_freq(r, THETA, device)


def prefill(d, start, rows, **kw):
    return OPS["attn_prefill"].attention_prefill(
        d["qg"][rows],
        d["k"][rows],
        d["v"][rows],
        d["q_norm"],
        d["k_norm"],
        d["k_cache"],
        d["v_cache"],
        start,
        inv_freq(device=d["qg"].device),
        **kw,
    )


def decode(d, i, pos, **kw):
    pos_t = torch.tensor([pos], dtype=torch.int32, device=d["qg"].device)
    return OPS["attn_decode"].attention_decode(
        d["qg"][i],
        d["k"][i],
        d["v"][i],
        d["q_norm"],
        d["k_norm"],
        d["k_cache"],
        d["v_cache"],
        pos_t,
        inv_freq(device=d["qg"].device),
        **kw,
    )


def fill_cache(d, n, seed=1):
    """Rows [0, n) of the caches hold earlier tokens (random); the rest stays NaN."""
    gen = torch.Generator().manual_seed(seed)
    for name in ("k_cache", "v_cache"):
        rows = torch.randn(d[name].shape[0], n, d[name].shape[2], generator=gen)
        d[name][:, :n] = rows.to(d[name].dtype).to(d[name].device)


# ----------------------------------------------------------------------------- decode


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("length", [1, 5, 77])
@pytest.mark.parametrize("split", [0, 16], ids=["plain", "split16"])
def test_decode_matches_reference(device, length, split):
    d = make_inputs(1, 96, device=device, seed=length)
    fill_cache(d, length - 1)
    ref_out, ref_k, ref_v = reference(d, length - 1, slice(0, 1))
    out = decode(d, 0, length - 1, split=split, block_n=16)
    assert out.shape == (4 * 64,) and out.dtype == torch.bfloat16
    assert rel(out, ref_out[0]) < 2e-2
    # the new row went in at pos (rounding of K in bf16 may differ by one unit)
    assert rel(d["k_cache"][:, :length], ref_k[:, :length]) < 2e-3
    assert torch.equal(d["v_cache"][:, :length].cpu(), ref_v[:, :length])
    assert d["k_cache"][:, length:].isnan().all()


@pytest.mark.parametrize("device", DEVICES)
def test_decode_group_of_8_fp32_plain_and_split_agree(device):
    """The real GQA group (8 query heads per KV head); 300 rows = 19 split blocks."""
    d = make_inputs(1, 320, h=16, dtype=torch.float32, device=device, seed=3)
    fill_cache(d, 299)
    ref_out, _, _ = reference(d, 299, slice(0, 1))
    out_split = decode(d, 0, 299, split=16, block_n=16)
    out_plain = decode(d, 0, 299, split=0, block_n=64)  # rewrites the same row
    assert rel(out_split, ref_out[0]) < DOT_F32_TOL
    assert rel(out_plain, ref_out[0]) < DOT_F32_TOL


@pytest.mark.parametrize("device", DEVICES)
def test_decode_split_combine_in_steps_and_dim_chunks(device):
    """A long split: 1,050 rows in 66 blocks of 16 (the combine takes 64 blocks a step, so
    two steps), head dim 96 (the combine's programs take 64 dims each: a full chunk and a
    masked one)."""
    d = make_inputs(1, 1100, dh=96, dtype=torch.float32, device=device, seed=4)
    fill_cache(d, 1049)
    ref_out, _, _ = reference(d, 1049, slice(0, 1))
    out = decode(d, 0, 1049, split=16, block_n=16)
    assert rel(out, ref_out[0]) < DOT_F32_TOL


@pytest.mark.parametrize("device", DEVICES)
def test_decode_equals_one_token_of_prefill(device):
    d = make_inputs(31, 48, dtype=torch.float32, device=device, seed=4)
    prefill(d, 0, slice(0, 30), block_m=16, block_n=16)
    k_before, v_before = d["k_cache"].clone(), d["v_cache"].clone()
    out_p = prefill(d, 30, slice(30, 31), block_m=16, block_n=16)
    k_p = d["k_cache"].clone()
    d["k_cache"].copy_(k_before)
    d["v_cache"].copy_(v_before)
    out_d = decode(d, 30, 30, split=0)
    assert rel(out_d, out_p[0]) < DOT_F32_TOL
    assert rel(d["k_cache"][:, :31], k_p[:, :31]) < 1e-6


@pytest.mark.parametrize("device", DEVICES)
def test_prefill_then_decode_steps_match_one_shot(device):
    """A 30-token prefill then 3 decode steps (split-KV) equal the reference over 33 tokens."""
    d = make_inputs(33, 64, device=device, seed=5)
    ref_out, _, _ = reference(d, 0, slice(0, 33))
    outs = [prefill(d, 0, slice(0, 30), block_m=16, block_n=16)]
    outs += [decode(d, i, i, split=16, block_n=16)[None] for i in range(30, 33)]
    assert rel(torch.cat(outs), ref_out) < 2e-2


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pos", [0, 9, 15, 16, 31, 32, 41, 63, 70])
@pytest.mark.parametrize("split", [0, 32], ids=["plain", "split32"])
def test_decode_new_row_in_and_after_the_first_tile(device, split, pos):
    """The program whose range holds pos writes the new row, then reads it back with its
    tiles. Tiles of 16 rows, split blocks of two tiles; pos at 0, inside, at the end of and
    just after block 0's first tile, at block 0's end, alone at block 1's start, inside
    block 1's first tile, at its end, and inside the last block's first tile (later blocks
    empty). G = 3 heads over Dh = 48 (masked rows and columns), fp32. The row at pos holds
    NaN until the kernel writes it, so a tile read before the write, or a tile counted twice
    or not at all, fails."""
    d = make_inputs(1, 80, h=6, hkv=2, dh=48, dtype=torch.float32, device=device, seed=20 + pos)
    fill_cache(d, pos)
    ref_out, ref_k, ref_v = reference(d, pos, slice(0, 1))
    out = decode(d, 0, pos, split=split, block_n=16)
    assert rel(out, ref_out[0]) < DOT_F32_TOL
    # the new row (fp32 RoPE: rounding only), the rows before it untouched, none after it
    assert rel(d["k_cache"][:, pos], ref_k[:, pos]) < 1e-5
    assert torch.equal(d["k_cache"][:, :pos].cpu(), ref_k[:, :pos])
    assert torch.equal(d["v_cache"][:, : pos + 1].cpu(), ref_v[:, : pos + 1])
    assert d["k_cache"][:, pos + 1 :].isnan().all() and d["v_cache"][:, pos + 1 :].isnan().all()


def test_decode_rejects_bad_input():
    d = make_inputs(1, 8, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="pos must be a one-element integer tensor"):
        OPS["attn_decode"].attention_decode(
            d["qg"][0],
            d["k"][0],
            d["v"][0],
            d["q_norm"],
            d["k_norm"],
            d["k_cache"],
            d["v_cache"],
            torch.tensor([1.0]),
            inv_freq(device="cpu"),
        )
    with pytest.raises(ValueError, match="split must be 0 or a multiple of block_n"):
        decode(d, 0, 3, split=24, block_n=16)
    with pytest.raises(ValueError, match="k_cache and v_cache must be contiguous"):
        decode({**d, "v_cache": d["v_cache"][:, :4]}, 0, 3)


# ----------------------------------------------------------------------------- prefill


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "split,block_m,block_n,on_device",
    [((37,), 16, 16, False), ((20, 17), 64, 32, True), ((5, 32), 16, 16, True),
     ((1, 19, 17), 16, 16, False)],
    ids=["one-chunk", "20+17", "5+32", "1+19+17-int"],
)  # fmt: skip
def test_prefill_chunks_match_one_shot_reference(device, split, block_m, block_n, on_device):
    d = make_inputs(37, 48, device=device, seed=6)
    ref_out, ref_k, ref_v = reference(d, 0, slice(0, 37))
    outs, s = [], 0
    for n in split:
        # the host's int (1 and 20 here: Triton makes a 1 a constant) or a device scalar
        start = torch.tensor([s], device=device) if s and on_device else s
        outs.append(prefill(d, start, slice(s, s + n), block_m=block_m, block_n=block_n))
        s += n
    out = torch.cat(outs)
    assert out.shape == (37, 4 * 64) and out.dtype == torch.bfloat16
    assert rel(out, ref_out) < 2e-2
    assert rel(d["k_cache"][:, :37], ref_k[:, :37]) < 5e-3
    assert torch.equal(d["v_cache"][:, :37].cpu(), ref_v[:, :37])
    assert d["k_cache"][:, 37:].isnan().all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.filterwarnings("ignore:divide by zero")  # log2(0) of an empty share
@pytest.mark.parametrize("split", [2, 3, 7])
def test_prefill_split_kv_matches_reference(device, split):
    """Keys split S ways (partials, then the combine): 9 tokens after 70 cached ones, real
    group of 8 query heads, fp32. 3 ways leaves shares of 2, 2 and 0 full tiles plus the
    diagonal; 7 ways gives empty shares (no keys: weight 0). The unsplit kernel on the same
    input agrees too."""
    d = make_inputs(9, 96, h=16, dtype=torch.float32, device=device, seed=11)
    fill_cache(d, 70)
    ref_out, _, _ = reference(d, 70, slice(0, 9))
    out = prefill(d, 70, slice(0, 9), block_m=16, block_n=16, split=split)
    assert out.shape == (9, 16 * 64)
    assert rel(out, ref_out) < DOT_F32_TOL
    plain = prefill(d, 70, slice(0, 9), block_m=16, block_n=16, split=1)
    assert rel(out, plain) < DOT_F32_TOL


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("split", [1, 3])
def test_prefill_of_one_wide_projection_output(device, split):
    """qg, k and v as column slices of one fused projection output (q|k|v with NaN columns
    between): the prep, flash and combine kernels use the row stride; results equal those
    of contiguous copies, caches included."""
    d = make_inputs(9, 96, h=16, dtype=torch.float32, device=device, seed=12)
    fill_cache(d, 70)
    caches = (d["k_cache"].clone(), d["v_cache"].clone())
    ref = prefill(d, 70, slice(0, 9), block_m=16, block_n=16, split=split)
    ref_caches = (d["k_cache"].clone(), d["v_cache"].clone())
    d["k_cache"].copy_(caches[0])
    d["v_cache"].copy_(caches[1])
    gap = torch.full((9, 5), float("nan"), device=device)
    wide = torch.cat([d["qg"], gap, d["k"], gap, d["v"]], dim=1)
    nq, nk = d["qg"].shape[1], d["k"].shape[1]
    views = {"qg": wide[:, :nq], "k": wide[:, nq + 5 : nq + 5 + nk], "v": wide[:, nq + 10 + nk :]}
    assert all(not x.is_contiguous() for x in views.values())
    got = prefill({**d, **views}, 70, slice(0, 9), block_m=16, block_n=16, split=split)
    assert torch.equal(got, ref)
    for c, r in zip((d["k_cache"], d["v_cache"]), ref_caches, strict=True):
        assert torch.equal(c[:, :79], r[:, :79]) and c[:, 79:].isnan().all()


def test_flash_split_fills_the_last_wave():
    """The split rule: 282 programs on 132 SMs (two a SM) after 16K keys leave the second
    wave 7% full, so it splits; a chunk of many waves, or a short history, does not."""
    fs = OPS["attn_prefill"].flash_split
    s = fs(282, 17208, 264, 32)
    assert 4 <= s <= 12
    assert fs(1024, 4096, 264, 32) == 1  # 4096 tokens from position 0: 3.9 waves
    assert fs(282, 1128, 264, 32) <= 4  # a short history: the partials would cost more
    assert fs(10, 200, 264, 32) == 1  # under 8 key tiles a share
    assert fs(1024, 131072, 264, 32) == 1  # 3.9 waves: under 5% to gain
    assert 2 <= fs(282, 17208, 264, 32, max_split=3) <= 3  # the partials' memory cap
    # residency from the tile's shared memory (the compiled kernels' figures, sm_90)
    per_sm = OPS["attn_prefill"].flash_per_sm
    bf16 = torch.empty(0, dtype=torch.bfloat16)
    assert per_sm(64, 32, 256, 4, 2, bf16) == 2
    assert per_sm(128, 32, 256, 8, 2, bf16) == 1


def test_prefill_rejects_bad_input():
    d = make_inputs(4, 8, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match=r"positions \[6, 10\) do not fit a cache of 8"):
        prefill(d, 6, slice(0, 4))
    with pytest.raises(ValueError, match=r"v must be \(4, 128\) with contiguous rows"):
        prefill({**d, "v": d["v"][:, :-1]}, 0, slice(0, 4))
    with pytest.raises(ValueError, match="block_m=16 must be a multiple of the group size 3"):
        e = make_inputs(4, 8, h=6, dtype=torch.float32, device="cpu")
        prefill(e, 0, slice(0, 4), block_m=16)


@pytest.mark.filterwarnings("ignore:All-NaN slice")  # the rows past the cache hold NaN
@pytest.mark.parametrize("device", DEVICES)
def test_positions_past_the_cache_write_nothing_outside(device):
    """A device position beyond T_max (a caller's bug, unseen by the host) stays in bounds:
    the cache is a view of a larger buffer whose tail must stay NaN."""
    d = make_inputs(4, 16, h=2, hkv=1, dtype=torch.float32, device=device)
    big = torch.full((2, 1, 24, 64), float("nan"), device=device)
    d["k_cache"], d["v_cache"] = big[0, :, :16], big[1, :, :16]
    fill_cache(d, 16)
    decode(d, 0, 20, split=0)
    decode(d, 0, 20, split=16, block_n=16)
    prefill(d, torch.tensor([14], device=device), slice(0, 4), block_m=16, block_n=16)
    assert big[:, :, 16:].isnan().all()


# ----------------------------------------------------------------------------- norm + rope


@triton.jit
def _rms_rope_probe_kernel(
    x,
    w,
    f,
    pos,
    out,
    n_rows,
    eps,
    D: tl.constexpr,
    R: tl.constexpr,
    BR: tl.constexpr,
    BD: tl.constexpr,
):
    o_r = tl.arange(0, BR)
    m_r = o_r < n_rows
    b_y = rms_rope_rows(x, o_r * D, m_r, w, f, tl.load(pos + o_r, mask=m_r, other=0), eps, D, R, BD)
    o_d = tl.arange(0, BD)
    tl.store(out + o_r[:, None] * D + o_d[None, :], b_y, mask=m_r[:, None] & (o_d < D)[None, :])


@pytest.mark.parametrize("device", DEVICES)
def test_norm_rope_at_long_positions(device):
    """Angles up to 2.6e5 rad: the kernel's fp64 range reduction before sin/cos keeps it on
    the fp32 reference (a wrong reduction constant would be off by whole radians)."""
    pos = torch.tensor([0, 1, 4097, 65535, 199999, 262143], dtype=torch.int32)
    x = torch.randn(6, 64)
    w = torch.rand(64) + 0.5
    ref = apply_rope(rms_norm(x, w, 1e-6)[:, None], *rope_cos_sin(pos, 16, THETA))[:, 0]
    out = torch.empty(6, 64, device=device)
    _rms_rope_probe_kernel[(1,)](
        x.to(device),
        w.to(device),
        inv_freq(device=device),
        pos.to(device),
        out,
        6,
        1e-6,
        D=64,
        R=16,
        BR=8,
        BD=64,
    )
    assert (out.cpu() - ref).abs().max().item() < 1e-4
