"""The batched step's DeltaNet tile table (lily/model/ops.py DELTANET_ROWS_CONFIGS): the
lookup, the tile reaching deltanet_decode_rows through ``deltanet_rows``, the same maths on
any tile, and an entry reaching the compile matrix (lily/ops/launchable.py).

Under the Triton interpreter when there is no CUDA. Odd small shapes (Hk=2, Hv=4, K=32,
Vd=48: a 48-wide head over 8-, 16- or 64-wide blocks, so partial blocks and the split-heads
norm through the row buffer are both run), 3 and 5 rows each on its own states, inputs as
strided row views of one fused projection. Fresh buffers are NaN. Bounds as the kernel
tests' (tests/ops/test_deltanet_ops.py): outputs 1.5e-2 against the fp32 reference (bf16
storage), states 1e-5 (fp32; 2e-3 against the model's mixer, which rounds the conv's
output to bf16); one tile against another: the states 1e-6 and the outputs
one bf16 rounding apart (8e-3), the same maths with its sums taken in other orders.
"""

from __future__ import annotations

import inspect

import pytest
import torch

try:  # tests/ops may or may not be a package
    from .test_batch_decode_ops import fused_rows
    from .test_deltanet_ops import DEVICE, OPS, nan_poisoned_empty, reference, rel  # noqa: F401
    from .test_deltanet_ops import make_inputs as dn_inputs
except ImportError:
    from test_batch_decode_ops import fused_rows
    from test_deltanet_ops import DEVICE, OPS, nan_poisoned_empty, reference, rel  # noqa: F401
    from test_deltanet_ops import make_inputs as dn_inputs

import lily.model.ops as model_ops  # noqa: E402
from lily.model.bundles import DeltaNetWeights  # noqa: E402

dn = OPS["dn_decode"]
HK, HV, KD, VD = 2, 4, 32, 48
NAMES = ("mixed_qkv", "z", "b", "a")


# ---------------------------------------------------------------- the lookup


def test_an_empty_table_is_the_one_row_tile(monkeypatch):
    """No entry: every B takes the launcher's own defaults, the tile the step ran before."""
    monkeypatch.setattr(model_ops, "DELTANET_ROWS_CONFIGS", {})
    sig = inspect.signature(dn.deltanet_decode_rows).parameters
    assert model_ops.DELTANET_ROWS_DEFAULT == (sig["block_v"].default, sig["num_warps"].default)
    assert {model_ops.deltanet_rows_config(b) for b in range(1, 17)} == {(16, 4)}


def test_the_lookup_takes_the_largest_key_at_or_below_b(monkeypatch):
    monkeypatch.setattr(model_ops, "DELTANET_ROWS_CONFIGS", {6: (32, 8), 3: (8, 2)})
    got = {b: model_ops.deltanet_rows_config(b) for b in range(1, 17)}
    assert got == {1: (16, 4), 2: (16, 4), 3: (8, 2), 4: (8, 2), 5: (8, 2),
                   **{b: (32, 8) for b in range(6, 17)}}  # fmt: skip


def test_shipped_entries_are_tiles():
    """Every DELTANET_ROWS_CONFIGS entry as shipped: a (block_v, num_warps) of powers of
    two for 2..MAX_ROWS rows."""
    for b, (block_v, warps) in model_ops.DELTANET_ROWS_CONFIGS.items():
        assert 2 <= b <= model_ops.MAX_ROWS
        assert block_v >= 1 and block_v & (block_v - 1) == 0, (b, block_v)
        assert warps in (1, 2, 4, 8, 16), (b, warps)


# ---------------------------------------------------------------- deltanet_rows on a tile


def rows_inputs(n: int, seed: int):
    """``n`` rows of one layer (its weights shared), each with its own states: the fused
    projection's row views, the weights, and per row a dict of its tensors."""
    rows = [dn_inputs(1, HK, HV, KD, VD, seed=seed + r) for r in range(n)]
    for d in rows[1:]:
        for w in ("conv_weight", "A_log", "dt_bias", "norm_weight"):
            d[w] = rows[0][w]
    parts = fused_rows([torch.cat([d[k] for d in rows]) for k in NAMES])
    d0 = rows[0]
    w = DeltaNetWeights(proj=(), conv1d=d0["conv_weight"], A_log=d0["A_log"],
                        dt_bias=d0["dt_bias"], norm=d0["norm_weight"], out_proj=None)  # fmt: skip
    return parts, w, rows


def step(parts, w, rows, kernels: bool):
    """``deltanet_rows`` as the batched step calls it (kernels with a state table, or the
    reference per row) on copies of the rows' states: (out, conv states, states)."""
    convs = [d["conv_state"].clone() for d in rows]
    states = [d["state"].clone() for d in rows]
    k = table = None
    if kernels:
        k = model_ops.Kernels(step=True, pdl=False, mma=True, workspace=None, inv_freq=None,
                              rows_workspace=dn.DeltaNetDecodeWorkspace.new(
                                  HK, HV, VD, DEVICE, rows=len(rows)),
                              moe_tickets=None)  # fmt: skip
        table = dn.state_table(list(zip(convs, states, strict=True)), DEVICE)
    out = model_ops.deltanet_rows(parts, w, convs, states, 1e-6, k, table)
    return out, convs, states


@pytest.mark.parametrize(("n", "entry"), [(3, (8, 2)), (5, (64, 8))],
                         ids=["3rows-bv8-w2", "5rows-bv64-w8"])  # fmt: skip
def test_a_table_entry_reaches_the_launch_with_the_same_maths(monkeypatch, n, entry):
    """With an entry at B, the step's one launch takes its block_v (clamped to the head's
    width, as the launcher does) and warps; its output and states are those of the
    default tile and of the plain-PyTorch mixer row by row."""
    from lily.ops.launch import record_launches

    parts, w, rows = rows_inputs(n, seed=70 + n)
    want = step(parts, w, rows, kernels=False)
    monkeypatch.setattr(model_ops, "DELTANET_ROWS_CONFIGS", {})
    default = step(parts, w, rows, kernels=True)
    monkeypatch.setattr(model_ops, "DELTANET_ROWS_CONFIGS", {2: entry, n + 1: (16, 4)})
    with record_launches() as rec:
        step(parts, w, rows, kernels=True)
    (launch,) = rec
    assert (launch[1], launch[3]["BV"], launch[3]["num_warps"]) == (
        (-(-VD // min(entry[0], 64)), HV, n), min(entry[0], 64), entry[1])  # fmt: skip
    out, convs, states = step(parts, w, rows, kernels=True)
    assert out.shape == (n, HV * VD)
    assert rel(out, default[0]) < 8e-3
    for r, d in enumerate(rows):
        exact = reference(d)  # the fp32 recurrence (the mixer rounds the conv to bf16)
        assert rel(out[r], want[0][r]) < 1.5e-2 and rel(out[r], exact[0][0]) < 1.5e-2, r
        assert rel(states[r], default[2][r]) < 1e-6, r
        assert rel(states[r], exact[2]) < 1e-5 and rel(states[r], want[2][r]) < 2e-3, r
        assert torch.equal(convs[r], want[1][r]), r  # the inputs, moved up


# ---------------------------------------------------------------- the compile matrix


def test_the_compile_matrix_sees_the_row_table(monkeypatch):
    """An entry put in DELTANET_ROWS_CONFIGS reaches the compile matrix: the registry
    (lily/ops/launchable.py, the engine's batched steps on meta tensors) records
    deltanet_decode_rows' launch at the table's tile from its key up to MAX_ROWS, the
    defaults below it (the tiny model: Vd = 32, so 8-wide blocks are a tile of their own)."""
    from lily.ops.arch import DEFAULT
    from lily.ops.launchable import Variant, launches

    monkeypatch.setattr(model_ops, "DELTANET_ROWS_CONFIGS", {5: (8, 2)})
    found = launches.__wrapped__(Variant("tiny"), DEFAULT)  # (uncached: the table is patched)
    tiles: dict[tuple[int, int], set[int]] = {}
    for launch, where in found.items():
        kw = dict(launch.kwargs)
        if launch.name != "_deltanet_decode_kernel" or not kw["ROWS"]:
            continue
        rows = {int(p.split("B=")[1].split()[0]) for p in where if p.startswith("decode rows B=")}
        tiles.setdefault((kw["BV"], kw["num_warps"]), set()).update(rows)
    top = model_ops.MAX_ROWS
    assert tiles == {(16, 4): set(range(2, 5)), (8, 2): set(range(5, top + 1))}
