"""The batched MoE decode (moe_decode_rows: one token of each of B sequences, each chosen
expert read once for all the rows that chose it) against the plain-PyTorch reference row
by row (the reference MoE of each row alone).

Under the Triton interpreter when there is no CUDA. Odd small shapes: D = 192 (3 groups of
64, padded to 4) and 224 with groups of 32 (7, padded to 8), expert intermediate 64 or 96
(3 groups of 32 a slot: a down chunk's K padded), shared 128, 192 or 96 (3 groups, padded
to 4) or none, 5 to 12 experts,
top 2 or 3, B = 2, 3, 5 (8 columns) and 10 (16 columns, 4 slots a down chunk). Inputs are
drawn until the routing has the pattern a case asks for (checked with the reference
router): rows sharing no expert, rows sharing some, a row on the same expert set as
another. Fresh buffers are NaN (ints -1), so an unwritten output, partial or ticket, or a
read of an h slot nobody wrote, fails. Bound: relative L2 of the MoE output (residual
removed) 2e-2 per row, as the one-row kernel's bf16 tests (bf16 operands; about 6e-3 seen).
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    # Kernels are built at import; tests/conftest.py normally sets this first.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from lily.model.norm import rms_norm  # noqa: E402
from lily.model.ref import ref_moe, ref_qlinear, ref_route  # noqa: E402
from lily.ops.launch import cdiv  # noqa: E402
from lily.ops.moe_decode_config import MoeDecodeConfig  # noqa: E402
from lily.ops.moe_decode_rows import RowsPlan, moe_decode_rows, rows_fit  # noqa: E402
from tests.ops.common import rel_err, replayed  # noqa: E402
from tests.ops.test_moe_ops import make_moe  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-5
BOUND = 2e-2


def routed(x: torch.Tensor, w: dict, k: int, nw: torch.Tensor | None) -> list[set[int]]:
    """Each row's expert set as the reference router picks it (after the norm)."""
    h = rms_norm(x, nw, EPS) if nw is not None else x
    _, ids = ref_route(ref_qlinear(h.cpu(), w["router"].to("cpu")), k)
    return [set(r) for r in ids.tolist()]


def has_pattern(sets: list[set[int]], pattern: str) -> bool:
    pairs = [(a, b) for i, a in enumerate(sets) for b in sets[i + 1 :]]
    if pattern == "disjoint":  # no two rows share an expert
        return all(not (a & b) for a, b in pairs)
    if pattern == "same-set":  # a row on another's exact set, and another sharing some
        return any(a == b for a, b in pairs) and any(a & b and a != b for a, b in pairs)
    if pattern == "overlap":  # some rows share, some pair shares nothing
        return any(a & b for a, b in pairs) and any(not (a & b) for a, b in pairs)
    return pattern == "any"


def draw_rows(w: dict, b: int, d: int, k: int, nw, pattern: str, seed: int) -> torch.Tensor:
    """B rows of x (bf16) whose routing has ``pattern``; for "same-set" row 1 is row 0
    plus a small perturbation (another row on the same experts, different values)."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(2000):
        x = 2.0 * torch.randn(b, d, generator=g) + 0.3
        if pattern == "same-set":
            x[1] = x[0] + 0.05 * torch.randn(d, generator=g)
        x = x.bfloat16().to(DEV)
        if has_pattern(routed(x, w, k, nw), pattern):
            return x
    raise AssertionError(f"no rows with routing {pattern!r} drawn")


def check_rows(y, x, w, k, nw, res) -> list[float]:
    """Each row's relative error against the reference MoE of that row alone."""
    h = rms_norm(x, nw, EPS) if nw is not None else x
    errs = []
    for r in range(x.shape[0]):
        ref = ref_moe(h[r], *w.values(), k, res[r])
        errs.append(rel_err(y[r].float() - res[r].float(), ref - res[r].float()))
    return errs


CASES = {
    # id: (d, i_e, i_s, gs, e, k, b, pattern, norm, config)
    "b2-disjoint-e5-k2": (192, 64, 128, 64, 5, 2, 2, "disjoint", True, None),
    "b3-same-set-e5-k2": (192, 64, 128, 64, 5, 2, 3, "same-set", True, None),
    "b3-overlap-g32-i96-k3-noshared": (224, 96, 0, 32, 9, 3, 3, "overlap", True, None),
    "b5-e5-k3-all-experts-nonorm": (192, 64, 192, 64, 5, 3, 5, "any", False, None),
    "b5-e12-k3-rows64-warps4": (224, 96, 96, 32, 12, 3, 5, "overlap", True,
                                MoeDecodeConfig(mma_rows=64, mma_warps=4)),
    "b10-e12-k2-16-columns": (192, 64, 128, 64, 12, 2, 10, "same-set", True, None),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_rows_match_each_row_alone(poison, case):
    d, i_e, i_s, gs, e, k, b, pattern, norm, cfg = CASES[case]
    w = make_moe(e, 4, gs, i_s > 0, seed=d + e + b, device=DEV, d=d, i_e=i_e, i_s=i_s)
    g = torch.Generator().manual_seed(b)
    nw = (1.0 + 0.2 * torch.randn(d, generator=g)).bfloat16().to(DEV) if norm else None
    x = draw_rows(w, b, d, k, nw, pattern, seed=e * b)
    res = torch.randn(b, d, generator=g).bfloat16().to(DEV)
    y = moe_decode_rows(x, *w.values(), k, res, norm_weight=nw, eps=EPS, config=cfg)
    assert y.shape == (b, d) and y.dtype == torch.bfloat16
    errs = check_rows(y, x, w, k, nw, res)
    assert max(errs) < BOUND, errs
    if norm:  # the norm must matter (the rows are far from unit RMS)
        assert max(check_rows(y, x, w, k, None, res)) > 0.1


def test_rows_on_the_same_experts_differ_only_by_their_values(poison):
    """Two rows equal up to the residual take the same path and give the same MoE output:
    a row's result does not depend on which other rows share its experts."""
    w = make_moe(5, 4, 64, True, seed=31, device=DEV, d=192, i_e=64, i_s=128)
    g = torch.Generator().manual_seed(31)
    x = (2.0 * torch.randn(3, 192, generator=g)).bfloat16().to(DEV)
    x[2] = x[0]
    res = torch.randn(3, 192, generator=g).bfloat16().to(DEV)
    res[2] = 0
    res[0] = 0
    y = moe_decode_rows(x, *w.values(), 2, res)
    assert rel_err(y[0].float(), y[2].float()) < 1e-3  # (a column's sums: same maths)
    # and a batch of one row gives the same as its row in the batch of three
    one = moe_decode_rows(x[1:2], *w.values(), 2, res[1:2])
    assert rel_err(one[0].float(), y[1].float()) < 1e-2


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NaN maths, on purpose
def test_a_nan_row_stays_in_its_row(poison):
    """A NaN row still routes to k distinct experts in range (an expert id is an address)
    and gets NaN outputs; the other rows, sharing its experts, keep their results."""
    w = make_moe(5, 4, 64, True, seed=37, device=DEV, d=192, i_e=64, i_s=128)
    g = torch.Generator().manual_seed(37)
    x = (2.0 * torch.randn(4, 192, generator=g)).bfloat16().to(DEV)
    res = torch.randn(4, 192, generator=g).bfloat16().to(DEV)
    x[1] = float("nan")
    y = moe_decode_rows(x, *w.values(), 2, res)
    assert torch.isnan(y[1]).all()
    keep = [0, 2, 3]
    assert max(check_rows(y[keep], x[keep], w, 2, None, res[keep])) < BOUND


def test_calls_reuse_nothing_and_replay(poison):
    """Two calls on new rows (on the GPU: one CUDA graph captured with PDL and replayed
    on new rows written into its inputs, as the batched step runs): the slot plan, the
    tickets and h must be rebuilt every time."""
    w = make_moe(6, 4, 64, True, seed=41, device=DEV, d=192, i_e=64, i_s=128)
    g = torch.Generator().manual_seed(41)
    nw = (1.0 + 0.2 * torch.randn(192, generator=g)).bfloat16().to(DEV)
    xs = [(2.0 * torch.randn(3, 192, generator=g)).bfloat16().to(DEV) for _ in range(3)]
    x = xs[0].clone()

    def call():
        return moe_decode_rows(x, *w.values(), 2, x, norm_weight=nw, eps=EPS, pdl=True)

    for xi, out in replayed(call, x, xs):
        assert max(check_rows(out, xi, w, 2, nw, xi)) < BOUND


def test_plan_sizes():
    """Columns 8 up to 8 rows, 16 up to 16; a down program's slots times its columns stay
    64; at most min(E, B k) slots, padded to whole chunks, with bounds that hold for any B
    of the same column count."""
    p = RowsPlan.new(8, 256, 8)
    assert (p.columns, p.slots, p.chunk, p.chunks, p.padded) == (8, 64, 8, 8, 64)
    p = RowsPlan.new(9, 256, 8)
    assert (p.columns, p.slots, p.chunk, p.chunks) == (16, 72, 4, 18)
    assert (p.max_padded, p.max_chunks) == (128, 32)
    p = RowsPlan.new(3, 5, 2)
    assert (p.slots, p.chunks, p.padded, p.max_chunks) == (5, 1, 8, 1)
    for b in range(2, 17):
        p = RowsPlan.new(b, 12, 3)
        assert p.slots <= p.padded <= p.max_padded and p.chunks <= p.max_chunks


def test_rows_checks_its_inputs():
    w = make_moe(5, 4, 64, True, seed=6, device="cpu")
    args = list(w.values())
    x = torch.randn(3, 192).bfloat16()
    with pytest.raises(TypeError, match="bf16"):
        moe_decode_rows(x.float(), *args, 2)
    with pytest.raises(ValueError, match="B <= 16"):
        moe_decode_rows(torch.randn(17, 192).bfloat16(), *args, 2)
    with pytest.raises(ValueError, match="top_k"):
        moe_decode_rows(x, *args, 6)
    with pytest.raises(ValueError, match="residual"):
        moe_decode_rows(x, *args, 2, torch.zeros(2, 192).bfloat16())
    w8 = make_moe(5, 8, 64, True, seed=6, device="cpu")
    with pytest.raises(ValueError, match="4-bit"):
        moe_decode_rows(x, *w8.values(), 2)
    assert rows_fit(x, *args[1:4], args[4:7])
    assert not rows_fit(x.float(), *args[1:4], args[4:7])
    assert not rows_fit(x, *list(w8.values())[1:4], args[4:7])
    assert not rows_fit(x[:1], *args[1:4], args[4:7])  # one row: moe_decode


@pytest.mark.skipif(not torch.cuda.is_available(), reason="real shapes: GPU")
@pytest.mark.parametrize("b", [2, 8, 16])
def test_rows_at_the_model_shapes(b):
    """D 2048, 256 experts, top 8, intermediate 512, shared 512, MLX 4-bit groups of 64,
    8-bit routers (the kernel benchmark's random weights, made on the GPU), the
    post-attention norm fused, PDL: every row against its reference."""
    from lily.bench.gpu.kernels.common import moe_weights

    gen = torch.Generator(device="cuda").manual_seed(b)
    w = moe_weights(gen)
    nw = (1.0 + 0.2 * torch.randn(2048, generator=gen, device="cuda")).bfloat16()
    x = (2.0 * torch.randn(b, 2048, generator=gen, device="cuda")).bfloat16()
    y = moe_decode_rows(x, *w.values(), 8, x, norm_weight=nw, eps=EPS, pdl=True)
    assert max(check_rows(y, x, w, 8, nw, x)) < BOUND


def test_memory_plan_covers_the_scratch(monkeypatch):
    """What a call allocates besides its output, at the full model's shapes for every
    batch size (meta tensors, launches recorded, not run), is within the memory plan's
    figure for the batched MoE (lily/runtime/memory_plan.py moe_rows_bytes)."""
    from lily.bench.random_model import model_config
    from lily.ops.launch import record_launches
    from lily.quant import QuantWeight
    from lily.runtime.memory_plan import moe_rows_bytes

    cfg = model_config("full")
    e, d, i, k = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, 8

    def q(*shape, bits=4):
        meta = {"device": "meta"}
        return QuantWeight(torch.empty(*shape[:-1], shape[-1] * bits // 32, dtype=torch.int32,
                                       **meta),
                           torch.empty(*shape[:-1], shape[-1] // 64, dtype=torch.bfloat16,
                                       **meta),
                           torch.empty(*shape[:-1], shape[-1] // 64, dtype=torch.bfloat16,
                                       **meta), bits, 64)  # fmt: skip

    w = [q(e, d, bits=8), q(e, i, d), q(e, i, d), q(e, d, i), q(i, d), q(i, d), q(d, i),
         q(1, d, bits=8)]  # fmt: skip
    made = []
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: made.append(real_empty(*a, **kw))
                        or made[-1])  # fmt: skip
    for n in range(2, 17):
        x = real_empty(n, d, dtype=torch.bfloat16, device="meta")
        made.clear()
        with record_launches() as rec:
            out = moe_decode_rows(x, *w, k, x, norm_weight=real_empty(d, device="meta"))
        assert len(rec) == 4
        scratch = sum(t.nbytes for t in made) - out.nbytes
        assert 0 < scratch <= moe_rows_bytes(cfg, n), n


def test_the_batched_step_takes_the_rows_kernel():
    """The engine's batched decode step (the compile matrix's record of Runner.decode_rows
    on meta tensors, what the warm-up runs for every batch size) sends every layer's MoE
    through moe_decode's three launches over the rows at 2 to 16 rows, and with ROWS_MOE
    through moe_decode_rows' four; never through moe_prefill. 8-bit experts take
    moe_decode's FMA launches either way (moe_decode_rows takes 4-bit experts only)."""
    from lily.ops.arch import DEFAULT
    from lily.ops.launchable import Variant, launches

    def in_rows(found, module: str, rows_moe: bool) -> dict[str, set[int]]:
        out: dict[str, set[int]] = {}
        for launch, where in found.items():
            bs = {int(w.split("B=")[1].split()[0]) for w in where
                  if "decode rows" in w and w.endswith("ROWS_MOE") == rows_moe}  # fmt: skip
            if launch.module == f"lily.ops.{module}" and bs:
                out.setdefault(launch.name, set()).update(bs)
        return out

    every = set(range(2, 17))
    full = launches(Variant("full"), DEFAULT)
    rows = ("_rows_router_kernel", "_rows_route_kernel", "_rows_gate_up_kernel",
            "_rows_down_kernel")  # fmt: skip
    assert in_rows(full, "moe_decode_rows", True) == {n: every for n in rows}
    assert in_rows(full, "moe_decode_rows", False) == {}
    assert in_rows(full, "moe_decode", False) == {"_moe_router_kernel": every}
    assert in_rows(full, "moe_decode_mma", False) == {
        "_moe_gate_up_mma_kernel": every,
        "_moe_down_mma_kernel": every,
    }
    for rows_moe in (False, True):
        assert in_rows(full, "moe_prefill", rows_moe) == {}
    eight = launches(Variant("tiny", "mlx8"), DEFAULT)
    for rows_moe in (False, True):
        assert in_rows(eight, "moe_decode_rows", rows_moe) == {}
        assert in_rows(eight, "moe_prefill", rows_moe) == {}
        assert in_rows(eight, "moe_decode", rows_moe) == {
            n: every for n in ("_moe_router_kernel", "_moe_gate_up_kernel", "_moe_down_kernel")
        }


# ---------------------------------------------------------------- moe_decode over rows:
# the batched step's tile table (lily/model/ops.py MOE_ROWS_CONFIGS)

# Every tile field of the mma path off its default; the down launch on a tile of its own.
SPLIT = MoeDecodeConfig(router_rows=2, shared_rows=32, num_warps=2, mma_rows=64, mma_warps=4,
                        mma_down_rows=16, mma_down_warps=2)  # fmt: skip
WIDE_ROWS = MoeDecodeConfig(router_rows=8, shared_rows=16, mma_rows=32, mma_warps=2)


def _step_moe(x, w: dict, k: int, nw, tickets=None):
    """lily.model.ops.moe as a batched decode step calls it (kernels, ``step``; the model's
    route_once ``tickets``)."""
    from types import SimpleNamespace

    from lily.model.bundles import MoEWeights
    from lily.model.ops import Kernels, moe

    kern = Kernels(step=True, pdl=False, mma=True, workspace=None, inv_freq=None,
                   rows_workspace=None, moe_tickets=tickets)  # fmt: skip
    cfg = SimpleNamespace(rms_norm_eps=EPS, num_experts_per_tok=k, norm_topk_prob=True)
    return moe(x, None, nw, MoEWeights(*w.values()), None, cfg, kern)[0]


def test_the_batched_step_takes_its_tile_from_the_row_table(poison, monkeypatch):
    """The step's moe_decode over B rows takes the entry of the largest key <= B (none
    below the smallest key, none for one row) and launches with it: router rows and warps,
    the gate/up tile and the down launch's own tile. Then a real call at an odd shape (D
    224 in groups of 32: 7 of 8 groups; I 96: a gate/up block past I; 9 experts, top 3,
    5 rows) on that split tile, each row against the reference MoE of that row alone."""
    import lily.model.ops as model_ops
    from lily.ops.launch import record_launches

    monkeypatch.setattr(model_ops, "MOE_ROWS_CONFIGS", {3: WIDE_ROWS, 5: SPLIT})
    d, i_e, i_s, gs, e, k = 224, 96, 96, 32, 9, 3
    w = make_moe(e, 4, gs, True, seed=53, device=DEV, d=d, i_e=i_e, i_s=i_s)
    g = torch.Generator().manual_seed(53)
    nw = (1.0 + 0.2 * torch.randn(d, generator=g)).bfloat16().to(DEV)
    got = {}
    for b in (1, 2, 3, 4, 5, 16):
        with record_launches() as rec:
            _step_moe(torch.zeros(b, d, dtype=torch.bfloat16, device=DEV), w, k, nw)
        got[b] = {getattr(r[0].fn, "fn", r[0].fn).__name__: (r[1], r[3]) for r in rec}
    default = MoeDecodeConfig()
    want = {1: default, 2: default, 3: WIDE_ROWS, 4: WIDE_ROWS, 5: SPLIT, 16: SPLIT}
    for b, cfg in want.items():
        router_grid, router = got[b]["_moe_router_kernel"]
        assert router["R_BN"] == cfg.router_rows and router["S_BN"] == cfg.shared_rows
        assert router["num_warps"] == cfg.num_warps
        assert router_grid == (cdiv(e, cfg.router_rows) + 1 + cdiv(i_s, cfg.shared_rows), b)
        _, gate_up = got[b]["_moe_gate_up_mma_kernel"]
        assert (gate_up["BLOCK_N"], gate_up["num_warps"]) == (cfg.mma_rows, min(cfg.mma_warps, 8))
        down_grid, down = got[b]["_moe_down_mma_kernel"]
        rows = cfg.mma_down_rows or cfg.mma_rows
        assert (down["BLOCK_N"], down["num_warps"]) == (rows, cfg.mma_down_warps or cfg.mma_warps)
        assert down_grid == (cdiv(d, rows), b)
    x = draw_rows(w, 5, d, k, nw, "overlap", seed=59)
    y = _step_moe(x, w, k, nw)
    assert y.shape == (5, d) and y.dtype == torch.bfloat16
    assert max(check_rows(y, x, w, k, nw, x)) < BOUND


def test_a_route_once_entry_routes_in_the_router_launch(poison, monkeypatch):
    """A table entry with route_once: the step's router launch routes each row (ROUTED,
    on the model's tickets, left at zero) and the gate/up launch reads it; every row
    against the reference MoE of that row alone, on rows on one set of experts and rows
    where some pair shares none."""
    import lily.model.ops as model_ops
    from lily.ops.launch import record_launches

    monkeypatch.setattr(model_ops, "MOE_ROWS_CONFIGS",
                        {2: dataclasses.replace(WIDE_ROWS, route_once=True)})  # fmt: skip
    d, i_e, i_s, gs, e, k = 224, 96, 96, 32, 9, 3
    w = make_moe(e, 4, gs, True, seed=71, device=DEV, d=d, i_e=i_e, i_s=i_s)
    g = torch.Generator().manual_seed(71)
    nw = (1.0 + 0.2 * torch.randn(d, generator=g)).bfloat16().to(DEV)
    tickets = torch.zeros(16, dtype=torch.int32, device=DEV)
    with record_launches() as rec:
        _step_moe(torch.zeros(3, d, dtype=torch.bfloat16, device=DEV), w, k, nw, tickets)
    got = {getattr(r[0].fn, "fn", r[0].fn).__name__: r for r in rec}
    assert got["_moe_router_kernel"][3]["ROUTED"] and got["_moe_gate_up_mma_kernel"][3]["ROUTED"]
    assert any(a is tickets for a in got["_moe_router_kernel"][2])
    for pattern in ("overlap", "same-set"):
        x = draw_rows(w, 3, d, k, nw, pattern, seed=73)
        y = _step_moe(x, w, k, nw, tickets)
        assert torch.count_nonzero(tickets) == 0
        assert max(check_rows(y, x, w, k, nw, x)) < BOUND, pattern


def test_the_compile_matrix_sees_the_row_table(monkeypatch):
    """An entry put in MOE_ROWS_CONFIGS reaches the compile matrix: the registry
    (lily/ops/launchable.py, the engine's batched steps on meta tensors) records moe_decode's
    launches at the table's tile from its key up to MAX_ROWS, the defaults below it."""
    import lily.model.ops as model_ops
    from lily.ops.arch import DEFAULT
    from lily.ops.launchable import Variant, launches

    monkeypatch.setattr(model_ops, "MOE_ROWS_CONFIGS", {5: WIDE_ROWS})
    found = launches.__wrapped__(Variant("tiny"), DEFAULT)  # (uncached: the table is patched)
    tiles: dict[tuple[str, int], set[int]] = {}
    for launch, where in found.items():
        if launch.module not in ("lily.ops.moe_decode", "lily.ops.moe_decode_mma"):
            continue
        kw = dict(launch.kwargs)
        tile = kw["R_BN"] if launch.name == "_moe_router_kernel" else kw["BLOCK_N"]
        rows = {int(p.split("B=")[1].split()[0]) for p in where
                if p.startswith("decode rows B=") and not p.endswith("ROWS_MOE")}  # fmt: skip
        tiles.setdefault((launch.name, tile), set()).update(rows)
    below, above = set(range(2, 5)), set(range(5, 17))
    assert tiles[("_moe_router_kernel", 4)] == below
    assert tiles[("_moe_router_kernel", 8)] == above
    for name in ("_moe_gate_up_mma_kernel", "_moe_down_mma_kernel"):
        assert tiles[(name, 16)] == below and tiles[(name, 32)] == above


def test_row_table_entries_are_tiles():
    """Every MOE_ROWS_CONFIGS entry as shipped: a MoeDecodeConfig for 2..MAX_ROWS rows."""
    from lily.model.ops import MAX_ROWS, MOE_ROWS_CONFIGS

    for b, cfg in MOE_ROWS_CONFIGS.items():
        assert 2 <= b <= MAX_ROWS and isinstance(cfg, MoeDecodeConfig)
