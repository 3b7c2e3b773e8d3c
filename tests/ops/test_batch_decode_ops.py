"""The decode kernels over B sequences in one launch (continuous batching): attention with
each row's own cache (its address and capacity from a table, its own position) and the
DeltaNet step with each row's own states, against the plain fp32 references row by row.

Odd small shapes under the Triton interpreter: 3 rows whose caches differ in capacity
(96, 40, 64 positions) and length (77, 5, 33), inputs as strided row views of one fused
projection output. Unwritten cache rows and fresh buffers are NaN, so a read past a
row's length, into another row's cache, or an unwritten output fails.
"""

from __future__ import annotations

import pytest
import torch

try:  # tests/ops may or may not be a package
    from .test_attention_ops import fill_cache, inv_freq, make_inputs, reference
    from .test_deltanet_ops import DEVICE, OPS, nan_poisoned_empty, rel  # noqa: F401
    from .test_deltanet_ops import make_inputs as dn_inputs
except ImportError:
    from test_attention_ops import fill_cache, inv_freq, make_inputs, reference
    from test_deltanet_ops import DEVICE, OPS, nan_poisoned_empty, rel  # noqa: F401
    from test_deltanet_ops import make_inputs as dn_inputs

from lily.model.ref import ref_deltanet  # noqa: E402

attn = OPS["attn_decode"]
CAPS = [96, 40, 64]
LENGTHS = [77, 5, 33]


def fused_rows(parts: list[torch.Tensor], extra: int = 24) -> list[torch.Tensor]:
    """The (B, n_i) ``parts`` copied side by side into one (B, sum + extra) buffer; their
    column views (strided rows, as the model's fused projections give them)."""
    widths = [p.shape[1] for p in parts]
    buf = torch.full((parts[0].shape[0], sum(widths) + extra), float("nan"),
                     dtype=parts[0].dtype, device=parts[0].device)  # fmt: skip
    out, c = [], 0
    for p, w in zip(parts, widths, strict=True):
        buf[:, c : c + w] = p
        out.append(buf[:, c : c + w])
        c += w
    return out


@pytest.mark.parametrize("split", [0, 16], ids=["plain", "split16"])
def test_attention_rows_each_on_its_own_cache(split):
    rows = [make_inputs(1, cap, seed=10 + r) for r, cap in enumerate(CAPS)]
    for d, n in zip(rows, LENGTHS, strict=True):
        fill_cache(d, n - 1, seed=n)
        d["q_norm"], d["k_norm"] = rows[0]["q_norm"], rows[0]["k_norm"]  # one layer's
    want = [reference(d, n - 1, slice(0, 1)) for d, n in zip(rows, LENGTHS, strict=True)]
    qg, k, v = fused_rows([torch.cat([d[x] for d in rows]) for x in ("qg", "k", "v")])
    tab = attn.kv_table([(d["k_cache"], d["v_cache"]) for d in rows], DEVICE)
    pos = torch.tensor([n - 1 for n in LENGTHS], dtype=torch.int32, device=DEVICE)
    d0 = rows[0]
    out = attn.attention_decode_rows(qg, k, v, d0["q_norm"], d0["k_norm"], tab, d0["k_cache"],
                                     pos, inv_freq(), max_len=max(CAPS), split=split,
                                     block_n=16)  # fmt: skip
    assert out.shape == (3, 4 * 64)
    for r, (d, n, (ref_out, ref_k, ref_v)) in enumerate(zip(rows, LENGTHS, want, strict=True)):
        assert rel(out[r], ref_out[0]) < 2e-2, r
        assert rel(d["k_cache"][:, :n], ref_k[:, :n]) < 2e-3
        assert torch.equal(d["v_cache"][:, :n].cpu(), ref_v[:, :n])
        assert d["k_cache"][:, n:].isnan().all()  # nothing past its own row was written


def test_attention_rows_checks_its_table():
    d = make_inputs(2, 16)
    pos = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    bad = torch.zeros(2, 2, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="kv_tab must be a contiguous"):
        attn.attention_decode_rows(d["qg"], d["k"], d["v"], d["q_norm"], d["k_norm"], bad,
                                   d["k_cache"], pos, inv_freq(), max_len=16)  # fmt: skip


dn = OPS["dn_decode"]


@pytest.mark.parametrize("block_v", [16, 64], ids=["split-heads", "whole-heads"])
def test_deltanet_rows_each_on_its_own_states(block_v):
    """Three rows with their own conv and recurrent states (one layer's weights), the
    heads split over programs or not (the last-arrival counters are per row)."""
    rows = [dn_inputs(1, seed=20 + r) for r in range(3)]
    for d in rows[1:]:
        for w in ("conv_weight", "A_log", "dt_bias", "norm_weight"):
            d[w] = rows[0][w]
    names = ("mixed_qkv", "z", "b", "a", "conv_weight", "conv_state", "A_log", "dt_bias",
             "norm_weight", "state")  # fmt: skip
    want = [ref_deltanet(*(d[n].cpu() for n in names)) for d in rows]
    x, z, b, a = fused_rows([torch.cat([d[n] for d in rows]) for n in names[:4]])
    tab = dn.state_table([(d["conv_state"], d["state"]) for d in rows], DEVICE)
    d0 = rows[0]
    ws = dn.DeltaNetDecodeWorkspace.new(2, 4, 48, DEVICE, rows=3)
    out = dn.deltanet_decode_rows(x, z, b, a, d0["conv_weight"], tab, d0["conv_state"],
                                  d0["state"], d0["A_log"], d0["dt_bias"], d0["norm_weight"],
                                  workspace=ws, block_v=block_v)  # fmt: skip
    assert out.shape == (3, 4 * 48)
    for r, (d, (ref_out, ref_conv, ref_state)) in enumerate(zip(rows, want, strict=True)):
        assert rel(out[r], ref_out[0]) < 1.5e-2, r
        assert rel(d["state"], ref_state) < 1e-5, r
        assert torch.equal(d["conv_state"].float().cpu(), ref_conv), r  # the inputs, moved up
    assert int(ws.counters.abs().sum()) == 0  # reset for the next launch


def test_tables_take_only_aligned_contiguous_buffers():
    """The batched kernels tell Triton that a buffer named in their table is 16-byte
    aligned (so its loads vectorize, as for a pointer argument): a table of a misaligned
    or strided buffer is refused with an error naming it."""
    d = make_inputs(1, 16)
    kc, vc = d["k_cache"], d["v_cache"]
    flat = torch.zeros(kc.numel() + 1, dtype=kc.dtype, device=DEVICE)
    shifted = flat[1:].view(kc.shape)  # one element (2 bytes) off
    assert attn.kv_table([(kc, vc)], DEVICE).shape == (1, 3)
    with pytest.raises(ValueError, match="kv_table: .*16-byte aligned"):
        attn.kv_table([(kc, vc), (shifted, vc)], DEVICE)
    with pytest.raises(ValueError, match="kv_table: .*contiguous"):
        attn.kv_table([(kc.transpose(1, 2), vc)], DEVICE)
    s = dn_inputs(1, seed=3)
    conv, state = s["conv_state"], s["state"]
    assert dn.state_table([(conv, state)], DEVICE).shape == (1, 2)
    odd = torch.zeros(state.numel() + 1, dtype=state.dtype, device=DEVICE)[1:].view(state.shape)
    with pytest.raises(ValueError, match="state_table: .*16-byte aligned"):
        dn.state_table([(conv, odd)], DEVICE)
