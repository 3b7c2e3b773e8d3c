"""The compile matrix: every kernel config the engine can launch, compiled for sm_80, sm_86,
sm_89, sm_90 and sm_120 on this GPU-less machine and checked against each architecture's
limits (shared memory a block, registers, spills): lily/ops/matrix.py compiles and checks,
lily/ops/launchable.py says what the engine launches (docs/notes/compile_matrix.md).

Tiers (LILY_COMPILE_MATRIX):
- ``ci`` (default): the engine's default run (the full model, 4-bit checkpoint, bf16) and
  the tiny test model, every config on all five archs. A config whose Triton cache key
  (Triton, the kernel's source and callees, constexprs, options, target) is in
  ``STORED`` takes its stored result; the others are compiled. A change to a kernel or a
  table therefore compiles exactly the configs it changes.
- ``full``: also the 8-bit checkpoints and fp32 activations, every config compiled afresh.
LILY_COMPILE_WORKERS sets how many processes compile (2). LILY_COMPILE_MATRIX_SAVE=1
writes this run's results to ``STORED`` (run it with the ``ci`` tier after changing a
kernel, and commit the file). A machine whose Triton build or ptxas differs (the lent GPU
machine) has keys of its own: LILY_COMPILE_MATRIX_SAVE=DIR writes each arch's results
there as it is checked (scripts/gpu_suite.sh does), to be committed beside ``STORED`` as
``compile_matrix_results_<machine>.json``; every such file is read too.
Compiles run in two spawned worker processes (the interpreter the other CPU tests use
cannot compile) and land in Triton's cache too.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from lily.ops.arch import ARCHS, DEFAULT
from lily.ops.launchable import (
    MAX_CONTEXT,
    SCAN_ROWS,
    VARIANTS,
    Variant,
    config_key,
    configs,
    model_config,
)
from lily.ops.matrix import (
    Result,
    check_all,
    compile_pool,
    load_results,
    problems,
    report,
    save_results,
)

TIER = os.environ.get("LILY_COMPILE_MATRIX", "ci")
TIERS = {"ci": VARIANTS[:2], "full": VARIANTS}
if TIER not in TIERS:
    raise ValueError(f"LILY_COMPILE_MATRIX must be one of {sorted(TIERS)}, got {TIER!r}")
STORED = Path(__file__).with_name("compile_matrix_results.json")


def stored_results() -> dict[str, dict]:
    """``STORED`` and the other machines' files beside it, by key."""
    out: dict[str, dict] = {}
    for path in sorted(STORED.parent.glob("compile_matrix_results_*.json")) + [STORED]:
        out |= load_results(path)
    return out


# Two compile processes suit CI's two cores. A machine whose Triton build or ptxas differs
# from the one that stored the results (the lent GPU machine) compiles every config again:
# scripts/gpu_suite.sh gives it more (LILY_COMPILE_WORKERS).
WORKERS = int(os.environ.get("LILY_COMPILE_WORKERS", "2"))


@pytest.fixture(scope="session")
def pool():
    with compile_pool(WORKERS) as p:
        yield p


_results: dict[str, list[Result]] = {}


def matrix_results(arch: str, pool) -> list[Result]:
    """The tier's configs for ``arch``, compiled (or taken from ``STORED``) and checked
    once a session."""
    if arch not in _results:
        t0 = time.perf_counter()
        found = configs(TIERS[TIER], ARCHS[arch])
        jobs = list(found.values())
        stored = stored_results() if TIER == "ci" else {}
        res = check_all([(launch, arch) for launch, _ in jobs], pool, stored)
        for r, (_, where) in zip(res, jobs, strict=True):
            r.cases = where
        cpu = sum(r.seconds for r in res)
        kept = sum(r.stored for r in res)
        print(f"\n{arch}: {len(res)} configs ({TIER} tier), {kept} stored, "
              f"{len(res) - kept} compiled in {cpu:.0f} CPU-s, "
              f"{time.perf_counter() - t0:.0f} s")  # fmt: skip
        _results[arch] = res
        save = os.environ.get("LILY_COMPILE_MATRIX_SAVE", "")
        if save == "1" and len(_results) == len(ARCHS):
            n = save_results(STORED, [r for rs in _results.values() for r in rs])
            print(f"{n} results written to {STORED}")
        elif save not in ("", "0", "1"):  # a folder: this arch's results, as checked here
            Path(save).mkdir(parents=True, exist_ok=True)
            save_results(Path(save) / f"compile_matrix_results_{arch}.json", res)
    return _results[arch]


@pytest.mark.parametrize("arch", list(ARCHS))
def test_every_config_fits(arch, pool):
    """Each config the engine launches compiles for ``arch`` and fits its shared memory,
    registers and spill bound; a failure names the kernel, config, arch and where it is
    launched."""
    res = matrix_results(arch, pool)
    assert len(res) > 50  # the engine's configs were found
    bad = report(res)
    assert not bad, f"{len(bad)} configs do not fit {arch}:\n" + "\n".join(bad)


def test_a_config_that_does_not_fit_is_named(pool):
    """The H200's flash tile compiled for sm_89 (144 KiB of shared memory against 99):
    the report names the kernel, the config and the arch."""
    flash = next(launch for launch, _ in configs([Variant("full")], DEFAULT).values()
                 if launch.name == "_flash_kernel")  # fmt: skip
    (res,) = check_all([(flash, "sm_89")], pool)
    res.cases = ["a test"]
    assert res.error is None and res.shared > ARCHS["sm_89"].smem
    (line,) = report([res])
    assert "attention_prefill._flash_kernel[" in line and "BM=128" in line
    assert f"on sm_89: shared memory {res.shared} B > {ARCHS['sm_89'].smem} B" in line
    assert problems(res) == [line.split(": ", 1)[1].split(" (launched")[0]]


def test_every_kernel_is_in_the_matrix():
    """Every kernel in lily.ops is launched by the engine somewhere in the matrix, or is
    listed here as one it never launches: a new kernel cannot escape the matrix."""
    import importlib
    import pkgutil

    import lily.ops
    from lily.ops.launch import Launched

    kernels = set()
    for m in pkgutil.iter_modules(lily.ops.__path__):
        mod = importlib.import_module(f"lily.ops.{m.name}")
        for name, obj in vars(mod).items():
            own = isinstance(obj, Launched) and getattr(obj.fn, "fn", obj.fn).__module__
            if own == mod.__name__:  # defined here, not imported
                kernels.add((mod.__name__, name))
    seen = set()
    for arch in (DEFAULT, ARCHS["sm_89"]):
        seen |= {key[:2] for key in configs(VARIANTS, arch)}
    # DeltaNet prefill's token scan and chunk_par forms: the public op offers them, the
    # engine runs method="chunk" (bench/gpu_mixer_kernels.py times the others).
    unused = {("lily.ops.deltanet_recurrence", n)
              for n in ("_scan_kernel", "_chunk_state_kernel", "_chunk_out_kernel")}  # fmt: skip
    assert kernels - seen == unused
    assert seen <= kernels


def test_prefill_tables_are_constant_past_the_scan():
    """The registry scans chunk lengths up to SCAN_ROWS; past it (up to the context) every
    prefill table of the full model keeps its choice, so no longer chunk picks a config
    the matrix has not compiled."""
    from lily.runtime.warmup import table_choices

    cfg = model_config(Variant("full"))
    lengths = [SCAN_ROWS + 1, 20000, 32767, 32768, 65537, 131072, 200001, MAX_CONTEXT]
    for arch in ARCHS.values():
        for x_bytes in (2, 4):
            last = table_choices(cfg, SCAN_ROWS, arch, x_bytes)
            assert all(table_choices(cfg, t, arch, x_bytes) == last for t in lengths)


def test_configs_dedupe_only_specializations():
    """Launches that differ in a constexpr are separate configs; those that differ only in
    an integer's divisibility (a chunk of 17 against 32 tokens) are one."""
    found = configs([Variant("tiny")], DEFAULT)
    keys = list(found)
    assert len(keys) == len(set(keys))
    flash = [k for k in keys if k[1] == "_flash_kernel"]
    assert {dict(k[2])["IS_SPLIT"] for k in flash} == {False, True}
    assert config_key(found[flash[0]][0]) == flash[0]


def test_stored_results_stand_for_a_compile(pool):
    """A stored result is taken only under the launch's own Triton key (one key per arch),
    and where ``STORED`` has that key its figures are the ones compiling gives."""
    launch = next(launch for launch, _ in configs([Variant("tiny")], DEFAULT).values()
                  if launch.name == "_embedding_kernel")  # fmt: skip
    stored = load_results(STORED)
    assert stored, f"{STORED} is missing or empty"
    keys = set()
    for arch in ARCHS:
        (fresh,) = check_all([(launch, arch)], pool)
        assert fresh.error is None and fresh.key and not fresh.stored
        keys.add(fresh.key)
        entry = stored.get(fresh.key)
        if entry is not None:  # (absent only where the kernel changed since it was saved)
            assert (entry["shared"], entry["regs"], entry["stack"]) == (
                fresh.shared, fresh.regs, fresh.stack)  # fmt: skip
        fake = {fresh.key: {"key": fresh.key, "arch": arch, "shared": 12345, "regs": 7}}
        (got,) = check_all([(launch, arch)], pool, fake)
        assert got.stored and (got.shared, got.regs, got.key) == (12345, 7, fresh.key)
        other = "sm_90" if arch != "sm_90" else "sm_89"
        (miss,) = check_all([(launch, other)], pool, fake)
        assert not miss.stored and miss.shared != 12345
    assert len(keys) == len(ARCHS)


def test_workers_compile_each_arch_as_its_gpu_does(pool, monkeypatch):
    """Workers spawned while a forced fallback turned warpgroup MMA off in this process
    (LILY_GPU_ARCH=sm_89 on an H200 sets DISABLE_MMA_V3) still compile sm_90 as an H200
    does: the same Triton key as the default pool's."""
    from lily.ops.matrix import launch_key

    launch = next(launch for launch, _ in configs([Variant("tiny")], DEFAULT).values()
                  if launch.name == "_embedding_kernel")  # fmt: skip
    want = pool.executor.submit(launch_key, launch, "sm_90").result()
    monkeypatch.setenv("DISABLE_MMA_V3", "1")
    with compile_pool(1) as forced_pool:
        got = forced_pool.executor.submit(launch_key, launch, "sm_90").result()
        assert forced_pool.executor.submit(os.getenv, "DISABLE_MMA_V3").result() is None
    assert got == want


def test_a_machines_results_merge_into_one_file(pool, tmp_path):
    """What scripts/gpu_suite.sh keeps of another machine's matrix (one file an arch) merges
    into one file that the matrix reads back: every key of every arch, with its figures."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "matrix_merge", Path(__file__).parents[2] / "scripts" / "matrix_merge.py"
    )
    merge = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(merge)
    results = {arch: matrix_results(arch, pool) for arch in ARCHS}
    for arch, res in results.items():
        save_results(tmp_path / f"compile_matrix_results_{arch}.json", res)
    out = tmp_path / "merged.json"
    assert merge.main([str(tmp_path), str(out)]) == 0
    merged = load_results(out)
    assert set(merged) == {r.key for res in results.values() for r in res if r.key}
    some = results["sm_89"][0]
    assert merged[some.key]["regs"] == some.regs and merged[some.key]["arch"] == "sm_89"
    assert merge.main([str(tmp_path / "nothing"), str(out)]) == 1
