"""The architecture records and what they switch (lily/ops/arch.py): which tables and
features each GPU gets, the ``--gpu-arch`` fallback switch, and that the fallback computes
the same outputs as the H200's tables (tiny model and MoE under the Triton interpreter)."""

from __future__ import annotations

import os

import pytest
import torch

from lily.model.ref import ref_moe
from lily.ops.arch import (
    ARCHS,
    DEFAULT,
    arch_for_capability,
    arch_named,
    current_arch,
    force_arch,
    forced_arch,
)
from lily.ops.attention_decode import decode_block_n
from lily.ops.attention_prefill import FlashTile, flash_tile
from lily.ops.deltanet_prefill import chunk_tile
from lily.ops.launch import record_launches
from lily.ops.launchable import Variant, launches
from lily.ops.matrix import freeze
from lily.ops.moe_prefill import moe_prefill, moe_prefill_config
from lily.ops.qgemm import GemmConfig, gemm_config
from tests.ops.common import rel_err

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # else under the interpreter


@pytest.fixture
def forced():
    """Call it to force an arch for the test (None: the device's own); the arch forced
    before the test (LILY_GPU_ARCH, tests/conftest.py) again afterwards."""
    before = forced_arch()
    yield force_arch
    force_arch(before.name if before is not None else None)


def test_records_by_capability():
    assert arch_for_capability(9, 0) is ARCHS["sm_90"]
    assert arch_for_capability(8, 9) is ARCHS["sm_89"]
    assert ARCHS["sm_90"].pdl and ARCHS["sm_90"].wgmma and ARCHS["sm_90"].big_smem
    assert ARCHS["sm_120"].pdl and not ARCHS["sm_120"].wgmma and not ARCHS["sm_120"].big_smem
    for name in ("sm_80", "sm_86", "sm_89"):
        assert not ARCHS[name].pdl and not ARCHS[name].wgmma
    assert [a.smem for a in ARCHS.values()] == [166912, 101376, 101376, 232448, 101376]
    # a capability without a record: the small tables, PDL from sm_90 on, no wgmma
    for (major, minor), pdl in (((8, 7), False), ((10, 0), True), ((12, 1), True)):
        a = arch_for_capability(major, minor)
        assert (a.smem, a.pdl, a.wgmma) == (101376, pdl, False)
    assert arch_named("89") is ARCHS["sm_89"]
    with pytest.raises(ValueError, match="unknown GPU architecture 'sm_75'.*sm_80"):
        arch_named("sm_75")


def test_cpu_and_meta_use_the_tuned_tables_unless_forced(forced):
    forced(None)
    assert current_arch(torch.device("cpu")) is DEFAULT
    assert current_arch(torch.device("meta")) is DEFAULT
    forced("sm_89")
    assert forced_arch() is ARCHS["sm_89"]
    assert current_arch(torch.device("cpu")) is ARCHS["sm_89"]


def test_forcing_below_sm90_turns_warpgroup_mma_off(forced, monkeypatch):
    forced(None)
    monkeypatch.delenv("DISABLE_MMA_V3", raising=False)
    forced("sm_89")
    assert os.environ["DISABLE_MMA_V3"] == "1"
    forced("sm_120")  # also without wgmma: still off
    assert os.environ["DISABLE_MMA_V3"] == "1"
    forced(None)
    assert "DISABLE_MMA_V3" not in os.environ
    forced("sm_90")
    assert "DISABLE_MMA_V3" not in os.environ
    monkeypatch.setenv("DISABLE_MMA_V3", "1")  # the user's own setting stays
    forced("sm_89")
    forced(None)
    assert os.environ["DISABLE_MMA_V3"] == "1"


def test_h200_tables_are_unchanged():
    """sm_90 keeps the tiles tuned on the H200 (the values before the per-arch tables)."""
    assert flash_tile(DEFAULT) == FlashTile(128, 64, 8, 2)
    assert flash_tile(ARCHS["sm_80"]) == FlashTile(128, 64, 8, 2)  # 144 KiB fits 163
    assert decode_block_n(DEFAULT) == 64 and decode_block_n(DEFAULT, 4) == 64
    assert chunk_tile(DEFAULT) == (32, None) and chunk_tile(DEFAULT, 4) == (32, None)
    assert gemm_config(97, 12352, 2048, 64, DEFAULT, 4) == GemmConfig(128, 64, 64, 4, 4)
    cfg = moe_prefill_config(8192, 8, 256, DEFAULT)
    h200 = (128, GemmConfig(128, 128, 128, 8, 3), GemmConfig(128, 128, 64, 8, 3))
    assert (cfg.block_m, cfg.gate_up, cfg.down) == h200
    assert moe_prefill_config(8192, 8, 256) == cfg


@pytest.mark.parametrize("name", ["sm_80", "sm_86", "sm_89", "sm_120"])
def test_fallback_tables(name):
    a = ARCHS[name]
    if not a.big_smem:
        assert flash_tile(a) == FlashTile(64, 32, 4, 2)
        assert flash_tile(a, 4) == FlashTile(32, 16, 4, 2)  # an fp32 KV cache
        assert decode_block_n(a, 4) == 32
    else:
        assert flash_tile(a, 4) == FlashTile(32, 32, 4, 2)
    assert decode_block_n(a) == 64
    assert chunk_tile(a) == (32, None) and chunk_tile(a, 4) == (16, 8)
    deep = gemm_config(97, 12352, 2048, 64, DEFAULT)  # the 4-stage dense tile
    assert gemm_config(97, 12352, 2048, 64, a) == deep
    assert gemm_config(97, 12352, 2048, 64, a, 4).num_stages == (4 if a.big_smem else 3)
    cfg = moe_prefill_config(8192, 8, 256, a)
    assert cfg.gate_up == GemmConfig(128, 64, 64, 8, 3) and cfg.down.block_n == 128
    for t in (1, 100, 700, 2048):  # below 128 rows an expert: the H200's tiles
        assert moe_prefill_config(t, 8, 256, a) == moe_prefill_config(t, 8, 256, DEFAULT)


@pytest.mark.parametrize("name", list(ARCHS))
def test_pdl_only_where_the_arch_has_it(name):
    """The decode step's kernels take PDL (constexpr and launch option) exactly on the archs
    that have it; the prefill never does."""
    a = ARCHS[name]
    found = launches(Variant("full"), a)
    pdl = {dict(launch.kwargs).get("PDL", False) for launch in found}
    opt = {dict(launch.kwargs).get("launch_pdl", False) for launch in found}
    assert pdl == ({False, True} if a.pdl else {False})
    assert opt == pdl
    for launch, where in found.items():
        if dict(launch.kwargs).get("PDL"):
            assert all(w.startswith("decode") for w in where), (launch, where)


def test_cli_gpu_arch_switch(monkeypatch):
    """``--gpu-arch`` (default $LILY_GPU_ARCH) reaches EngineConfig; unknown names are
    refused with the known ones."""
    from lily.cli import build_parser
    from lily.engine_args import engine_config

    monkeypatch.delenv("LILY_GPU_ARCH", raising=False)
    ap = build_parser()
    args = ap.parse_args(["generate", "--device", "cpu", "--gpu-arch", "sm_89", "hi"])
    assert engine_config(args).gpu_arch == "sm_89"
    assert engine_config(ap.parse_args(["generate", "--device", "cpu", "hi"])).gpu_arch is None
    with pytest.raises(SystemExit):
        ap.parse_args(["generate", "--gpu-arch", "sm_75", "hi"])
    monkeypatch.setenv("LILY_GPU_ARCH", "sm_120")
    ap = build_parser()
    assert engine_config(ap.parse_args(["generate", "--device", "cpu", "hi"])).gpu_arch == "sm_120"
    monkeypatch.setenv("LILY_GPU_ARCH", "sm_75")
    ap = build_parser()
    with pytest.raises(ValueError, match="LILY_GPU_ARCH: unknown GPU architecture 'sm_75'"):
        engine_config(ap.parse_args(["generate", "--device", "cpu", "hi"]))


def test_bench_gpu_arch_reaches_the_engine_config(monkeypatch):
    """``lily bench --random full --peers none --lengths 4096 --gpu-arch sm_89`` (the H200
    fallback measurement) carries the arch in its model source to the EngineConfig the
    benchmarked engine is built from."""
    from lily.bench.cli import bench_plan
    from lily.bench.source import engine_config
    from lily.cli import build_parser

    monkeypatch.delenv("LILY_GPU_ARCH", raising=False)
    argv = ["bench", "--random", "full", "--peers", "none", "--lengths", "4096",
            "--device", "cuda"]  # fmt: skip
    plan = bench_plan(build_parser().parse_args([*argv, "--gpu-arch", "sm_89"]))
    assert plan.lengths == [4096] and plan.peers == []
    assert engine_config(plan.source).gpu_arch == "sm_89"
    assert engine_config(bench_plan(build_parser().parse_args(argv)).source).gpu_arch is None


def _moe(seed: int, t: int, d: int = 64, i: int = 64, e: int = 4):
    from lily.quant import quantize

    g = torch.Generator().manual_seed(seed)

    def q(shape, bits=4):
        return quantize(torch.randn(shape, generator=g) / shape[-1] ** 0.5, bits, 64)

    w = [quantize(torch.randn(e, d, generator=g) / d**0.5, 8, 64), q((e, i, d)), q((e, i, d)),
         q((e, d, i)), q((i, d)), q((i, d)), q((d, i)), q((1, d), 8)]  # fmt: skip
    x = torch.randn(t, d, generator=g).bfloat16()
    res = torch.randn(t, d, generator=g).bfloat16()
    return [a.to(DEVICE) for a in w], x.to(DEVICE), res.to(DEVICE)


def test_moe_prefill_fallback_tile_same_result(forced, poison):
    """201 tokens over 4 experts (top-2: 100 rows an expert) take the 128-row tile; forced
    to sm_89 its gate/up GEMM runs 64 x 64 instead of 128 x 128: same maths, the same
    output (to the last bf16 rounding) and within the reference's bound."""
    w, x, res = _moe(5, 201)
    assert moe_prefill_config(201, 2, 4).block_m == 128
    forced(None)
    y = moe_prefill(x, *w, 2, res)
    forced("sm_89")
    with record_launches() as rec:
        moe_prefill(x, *w, 2, res)
    gate_up = [freeze(r) for r in rec if freeze(r).name == "_moe_gate_up_kernel"]
    assert dict(gate_up[0].kwargs)["BLOCK_N"] == 64
    y89 = moe_prefill(x, *w, 2, res)
    assert rel_err(y89, y) < 1e-3
    ref = ref_moe(x, *w, 2, res)
    assert rel_err(y89.float() - res.float(), ref - res.float()) < 2e-2


# The tables that differ at the tiny model's shapes between sm_90 and sm_89, by dtype:
# (kernel, constexpr): (sm_90's, sm_89's)
_DIFFER = {
    torch.bfloat16: {("_flash_kernel", "BM"): (128, 64), ("_flash_kernel", "BN"): (64, 32)},
    torch.float32: {("_flash_kernel", "BN"): (32, 16)},
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_tiny_model_same_outputs_with_the_fallback(forced, dtype):
    """The tiny model through the runner on the kernels (interpreter) with sm_89's tables
    and switches against the default's: an 11-token prompt gives the same logits. The
    flash tile is 64 x 32 on 4 warps instead of 128 x 64 on 8 in bf16, 32 x 16 instead of
    32 x 32 in fp32 (what 99 KiB GPUs need); the other tables agree at these shapes."""
    import tempfile

    from lily.checkpoint import TINY_TEXT_CONFIG, write_random_checkpoint
    from lily.config import ModelConfig
    from lily.model.model import Model
    from lily.runtime.runner import Runner
    from lily.runtime.state import SessionState
    from lily.weights import load_params

    with tempfile.TemporaryDirectory() as d:
        write_random_checkpoint(d, TINY_TEXT_CONFIG, "mlx4", seed=5, progress=False)
        cfg = ModelConfig.from_dir(d)
        params = load_params(d, cfg, device=DEVICE, dtype=dtype, progress=False)
    model = Model(cfg, params, dtype, kernels=True)
    runner = Runner(model, chunk=16, use_graphs=False, sample_on_device=False)
    prompt = [7, 300, 12, 45, 99, 1, 250, 31, 8, 77, 400]

    def run() -> list[torch.Tensor]:
        return [runner.prefill(prompt, SessionState.new(cfg, DEVICE, dtype, 256))]

    def constexprs() -> dict:
        with record_launches() as rec:
            run()  # noted, not run
        out: dict = {}
        for r in rec:
            launch = freeze(r)
            for k, v in launch.kwargs:
                out.setdefault((launch.name, k), set()).add(v)
        return out

    forced(None)
    tables = constexprs()
    default = run()
    forced("sm_89")
    fallback_tables = constexprs()
    for key, (h200, small) in _DIFFER[dtype].items():
        assert (tables[key], fallback_tables[key]) == ({h200}, {small}), key
    assert not any(v - {False} for k, v in fallback_tables.items() if k[1] == "PDL")
    fallback = run()
    bound = 1e-2 if dtype == torch.bfloat16 else 1e-5
    for got, want in zip(fallback, default, strict=True):
        assert rel_err(got, want) < bound
        assert int(got.argmax()) == int(want.argmax())


def test_deltanet_fallback_columns_same_result(forced):
    """A 5-token fp32 chunk (a few-token prefill with ``--dtype float32``): without warpgroup
    MMA the chunked recurrence takes 16 value columns on 8 warps instead of 32 on 4; the
    output and the new states are those of the default tile and of the fp32 reference."""
    from tests.ops import test_deltanet_ops as dn

    d = dn.make_inputs(5, dtype=torch.float32, seed=3)
    want = dn.reference(d)
    got = {}
    for name in (None, "sm_89"):
        forced(name)
        with record_launches() as rec:
            dn.run_prefill(d, "chunk")
        scan = [freeze(r) for r in rec if freeze(r).name == "_chunk_scan_kernel"]
        got[name] = dn.run_prefill(d, "chunk"), dict(scan[0].kwargs)
    assert (got[None][1]["BV"], got["sm_89"][1]["BV"]) == (32, 16)
    assert got["sm_89"][1]["num_warps"] == 8
    for a, b, ref in zip(got["sm_89"][0], got[None][0], want, strict=True):
        assert dn.rel(a, b) < 1e-6 and dn.rel(a, ref) < dn.DOT_F32_TOL


def test_attention_decode_fallback_keys_same_result(forced):
    """One fp32 decode token over 299 cached rows (split blocks of 64): on 99 KiB GPUs the
    kernel takes 32 keys a step instead of 64 (148 KiB of shared memory at Dh 256); the
    output is the default's and the fp32 reference's."""
    from tests.ops import test_attention_ops as at

    d = at.make_inputs(1, 320, h=16, dtype=torch.float32, seed=3)
    at.fill_cache(d, 299)
    want = at.reference(d, 299, slice(0, 1))[0][0]
    got = {}
    for name in (None, "sm_89"):
        forced(name)
        with record_launches() as rec:
            at.decode(d, 0, 299)
        kw = next(dict(freeze(r).kwargs) for r in rec if freeze(r).name == "_attn_decode_kernel")
        got[name] = at.decode(d, 0, 299), kw["BN"], kw["IS_SPLIT"]
    assert got[None][1:] == (64, True) and got["sm_89"][1:] == (32, True)
    # another key tile keeps another running max: exact maths in the interpreter, but on a
    # GPU the tf32 dot rounds p = exp(s - max) differently (the H200 failed 1e-6 here)
    same = 1e-6 if at.DEVICE == "cpu" else at.DOT_F32_TOL
    assert at.rel(got["sm_89"][0], got[None][0]) < same
    assert at.rel(got["sm_89"][0], want) < at.DOT_F32_TOL


def test_attention_rows_fallback_keys_same_result(forced):
    """A batched fp32 decode step (two sequences at 299 and 150 cached rows, split blocks
    of 64) takes the key tile of one sequence's step: 32 keys a step on 99 KiB GPUs instead
    of 64; each row's output is the default's and the fp32 reference's."""
    from tests.ops import test_attention_ops as at

    attn = at.OPS["attn_decode"]
    lengths = (299, 150)
    rows = [at.make_inputs(1, 320, h=16, dtype=torch.float32, seed=3 + r) for r in range(2)]
    for d, n in zip(rows, lengths, strict=True):
        at.fill_cache(d, n, seed=n)
        d["q_norm"], d["k_norm"] = rows[0]["q_norm"], rows[0]["k_norm"]  # one layer's
    want = [at.reference(d, n, slice(0, 1))[0][0] for d, n in zip(rows, lengths, strict=True)]
    qg, k, v = (torch.cat([d[x] for d in rows]) for x in ("qg", "k", "v"))
    tab = attn.kv_table([(d["k_cache"], d["v_cache"]) for d in rows], DEVICE)
    pos = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    d0 = rows[0]

    def step():
        return attn.attention_decode_rows(qg, k, v, d0["q_norm"], d0["k_norm"], tab, d0["k_cache"],
                                          pos, at.inv_freq(), max_len=320)  # fmt: skip

    got = {}
    for name in (None, "sm_89"):
        forced(name)
        with record_launches() as rec:
            step()
        kw = next(dict(freeze(r).kwargs) for r in rec if freeze(r).name == "_attn_decode_kernel")
        got[name] = step(), kw["BN"], kw["IS_SPLIT"]
    assert got[None][1:] == (64, True) and got["sm_89"][1:] == (32, True)
    same = 1e-6 if at.DEVICE == "cpu" else at.DOT_F32_TOL  # (as in the decode test above)
    for r in range(2):
        assert at.rel(got["sm_89"][0][r], got[None][0][r]) < same
        assert at.rel(got["sm_89"][0][r], want[r]) < at.DOT_F32_TOL


def test_report_names_the_tables_and_the_fast_paths_of_the_arch_in_use(forced):
    """The start-up report (lily/runtime/arch_report.py) follows the arch in use: forced to
    sm_89 on a GPU, PDL and warpgroup MMA are off and the tables are named as forced."""
    from types import SimpleNamespace

    from lily.runtime.arch_report import fast_paths, kernel_tables

    step = SimpleNamespace(pdl=True, mma=True)
    runner = SimpleNamespace(model=SimpleNamespace(step_ops=step), use_graphs=True,
                             device_decode=object())  # fmt: skip
    engine = SimpleNamespace(model=SimpleNamespace(kernels=True),
                             engine_cfg=SimpleNamespace(device="cuda"))  # fmt: skip
    forced("sm_89")
    paths = fast_paths(runner, "cuda")
    assert not paths["PDL"] and not paths["warpgroup MMA"] and paths["tensor-core GEMV"]
    assert kernel_tables(engine) == "sm_89 (forced by --gpu-arch)"
    forced("sm_90")
    paths = fast_paths(runner, "cuda")
    assert paths["PDL"] and paths["warpgroup MMA"]
    assert kernel_tables(engine) == "sm_90 (forced by --gpu-arch)"
    engine.model.kernels = False
    assert kernel_tables(engine) is None
