"""``lily bench --run kernels.linear -- --compile-only`` (not a script): with no GPU, compile
every configuration the linear benchmark times for sm_90 on the CPU and read what ptxas gave
each kernel: registers, spilled stack bytes, shared memory, warpgroup and warp MMA counts,
the SASS instruction count (after the PDL wait, and per 4-bit code for the tensor-core
tiles)."""

from __future__ import annotations

import contextlib
import dataclasses
import subprocess

import torch

from lily.bench.gpu.kernels.common import (
    BF16,
    FUSED_SHAPES,
    GEMM_SHAPES,
    GEMM_SMALL,
    GEMM_T,
    GEMV_OLD,
    GEMV_SHAPES,
    I_E,
    I_S,
    MMA_SHAPES,
    PREFILL_T,
    ROWS_SHAPE,
    TOP_K,
    D,
    E,
    Sweeps,
    cfg_str,
    compile_sm90,
    cuobjdump,
    zero_qweight,
)
from lily.ops.mma_rows import rows_prep
from lily.ops.moe_decode import moe_decode
from lily.ops.moe_decode_config import MoeDecodeConfig
from lily.ops.moe_prefill import moe_prefill, moe_prefill_config
from lily.ops.qgemm import gemm_config, qgemm
from lily.ops.qgemv import gemv_config, qgemv
from lily.ops.qgemv_mma import mma_gemv_config, qgemv_mma
from lily.ops.qgemv_mma_rows import qgemv_mma_rows

ERR_CHARS = 200


@contextlib.contextmanager
def pdl_forced():
    """PDL switched on for CPU tensors (compile-only: the launches are intercepted)."""
    import lily.ops.moe_decode as md
    import lily.ops.qgemv as qg
    import lily.ops.qgemv_mma as qm

    saved = md.use_pdl, qg.use_pdl, qm.use_pdl
    md.use_pdl = qg.use_pdl = qm.use_pdl = lambda pdl, device: pdl
    try:
        yield
    finally:
        md.use_pdl, qg.use_pdl, qm.use_pdl = saved


def compile_report(only: set[str], sweeps: Sweeps, sass_dir: str | None = None) -> list[dict]:
    """No GPU: compile every configuration the bench times (in the sections of ``only``)
    for sm_90 and read what ptxas gave each kernel (registers, stack bytes = spills, warpgroup
    and warp MMAs and the instruction count of the SASS, with PDL the part after the wait;
    qgemv_mma also per 4-bit code).

    The public functions run on CPU tensors of the real shapes with every kernel launch
    intercepted, so each kernel sees the arguments its launcher passes (ON_CPU forced off).
    """
    import re
    import tempfile
    from pathlib import Path

    from triton.runtime.jit import JITFunction

    from lily.ops.launch import Launched

    launches: list = []
    real_getitem, real_launch = JITFunction.__getitem__, Launched.launch
    JITFunction.__getitem__ = lambda fn, grid: lambda *a, **kw: launches.append((fn, a, kw))
    # Launched's fast path asks CUDA for the device: send every launch to the JIT function.
    Launched.launch = lambda self, grid, args, kwargs: self.fn[grid](*args, **kwargs)
    try:
        x = torch.zeros(2048, dtype=BF16)
        nw = torch.ones(2048, dtype=BF16)
        if only & {"gemv", "fused"}:
            for name, n, k, bits in GEMV_SHAPES:
                n_model = n
                n = min(n, 65536)  # the lm_head's table tile is the same from 65536 rows
                for cfg in [None, *GEMV_OLD.get(name, []), *sweeps.gemv.get(name, ())]:
                    cfg = cfg or gemv_config(n_model, k, 1, bits, 64)
                    launches.append(f"{name} {cfg_str(cfg)}")
                    qgemv(torch.zeros(k, dtype=BF16), zero_qweight((n, k), bits), config=cfg)
            for name, n, k in FUSED_SHAPES:
                cfg = gemv_config(n, k, 1, 4, 64)
                launches.append(f"{name} +norm {cfg_str(cfg)}")
                qgemv(x, zero_qweight((min(n, 65536), k), 4), norm_weight=nw, config=cfg)
            launches.append("out_proj +residual")
            qgemv(torch.zeros(4096, dtype=BF16), zero_qweight((D, 4096), 4), residual=x)
            for t in (2, 4, 8):
                launches.append(f"rows T={t}")
                qgemv(torch.zeros(t, ROWS_SHAPE[1], dtype=BF16), zero_qweight(ROWS_SHAPE, 4))
        if "gemm" in only:
            for name, n, k in GEMM_SHAPES:
                tables = [gemm_config(t, n, k, 64) for t in GEMM_T]
                for cfg in [*tables, *sweeps.gemm, *GEMM_SMALL]:
                    launches.append(f"{name} {cfg_str(cfg)}")
                    qgemm(
                        torch.zeros(cfg.block_m, k, dtype=BF16), zero_qweight((n, k), 4), config=cfg
                    )
        w = {"router": zero_qweight((E, D), 8), "gate": zero_qweight((E, I_E, D), 4),
             "up": zero_qweight((E, I_E, D), 4), "down": zero_qweight((E, D, I_E), 4),
             "shared_gate": zero_qweight((I_S, D), 4), "shared_up": zero_qweight((I_S, D), 4),
             "shared_down": zero_qweight((D, I_S), 4),
             "shared_expert_gate": zero_qweight((1, D), 8)}  # fmt: skip
        args = list(w.values())
        if "moe_decode" in only:
            for cfg in sweeps.decode:
                for norm in (None, nw):
                    label = "+norm " * (norm is not None) + cfg_str(cfg or MoeDecodeConfig())
                    launches.append(f"moe_decode {label}")
                    moe_decode(x, *args, TOP_K, x, norm_weight=norm, config=cfg)
        if only & {"gemv", "fused", "moe_decode"}:
            # PDL (no-op on CPU tensors): forced on so griddepcontrol is assembled for sm_90.
            with pdl_forced():
                launches.append("moe_decode +norm pdl")
                moe_decode(x, *args, TOP_K, x, norm_weight=nw, pdl=True)
                launches.append("dn qkv|z|b|a +norm pdl")
                qgemv(x, zero_qweight((12352, D), 4), norm_weight=nw, pdl=True)
        if "moe_rows" in only:  # the batched step's MoE, routing in every program or once
            from lily.model.ops import moe_rows_config

            with pdl_forced():
                for b in (1, 4, 8):
                    table = moe_rows_config(b) or MoeDecodeConfig()
                    xb = torch.zeros(b, D, dtype=BF16)
                    once = dataclasses.replace(table, route_once=True)
                    hop = dataclasses.replace(once, down_operand=True)
                    early = dataclasses.replace(hop, down_early=not hop.down_early)
                    for cfg in dict.fromkeys((table, once, hop, early)):
                        launches.append(f"moe_decode B={b} +norm pdl {cfg_str(cfg)}")
                        moe_decode(xb, *args, TOP_K, xb, norm_weight=nw, config=cfg, pdl=True)
        if "moe_prefill" in only:
            for t in PREFILL_T:
                for bm in (None, *sweeps.prefill_bm):
                    cfg = moe_prefill_config(t if bm is None else bm * E // TOP_K, TOP_K, E)
                    for atomic in (False, True):
                        launches.append(f"moe_prefill T={t} {'atomic ' * atomic}{cfg_str(cfg)}")
                        xt = torch.zeros(t, D, dtype=BF16)
                        moe_prefill(xt, *args, TOP_K, xt, atomic=atomic, config=cfg)
        if "gemv_mma" in only:
            for name, n, k, extra in MMA_SHAPES:
                kw = {"norm_weight": nw} if "norm" in extra else {}
                if "res" in extra:
                    kw["residual"] = torch.zeros(n, dtype=BF16)
                if "fp32" in extra:
                    kw["out_dtype"] = torch.float32
                xk = torch.zeros(k, dtype=BF16)
                for cfg in [mma_gemv_config(n, k, 64), *sweeps.mma.get(name, ())]:
                    launches.append(f"{name} {extra} {cfg_str(cfg)}")
                    qgemv_mma(xk, zero_qweight((min(n, 65536), k), 4), config=cfg, **kw)
            with pdl_forced():
                launches.append("dn qkv|z|b|a norm pdl")
                qgemv_mma(x, zero_qweight((12352, D), 4), norm_weight=nw, pdl=True)
                launches.append("o_proj/out_proj res pdl")
                qgemv_mma(torch.zeros(4096, dtype=BF16), zero_qweight((D, 4096), 4),
                          residual=x, pdl=True)  # fmt: skip
        if "gemv_rows" in only:  # the batched step's projections, three operand forms
            for name, n, k, norm in (("dn qkv|z|b|a norm", 12352, D, True),
                                     ("o_proj res", D, 4096, False)):  # fmt: skip
                wr = zero_qweight((n, k), 4)
                kw = {"norm_weight": torch.ones(k, dtype=BF16)} if norm else {}
                for b in (2, 4, 8):
                    xb = torch.zeros(b, k, dtype=BF16)
                    res = torch.zeros(b, n, dtype=BF16) if not norm else None
                    for form in ("operand8", "pow2(B)", "rows_prep"):
                        launches.append(f"{name} B={b} {form}")
                        if form == "rows_prep":
                            qgemv_mma_rows(rows_prep(xb, 64, kw.get("norm_weight")), wr, res)
                        else:
                            rows = 8 if form == "operand8" else b
                            qgemv_mma_rows(xb, wr, res, operand_rows=rows, **kw)
    finally:
        JITFunction.__getitem__, Launched.launch = real_getitem, real_launch

    rows, seen, label = [], set(), ""
    for item in launches:
        if isinstance(item, str):
            label = item
            continue
        fn, a, kw = item
        const = {k: v for k, v in kw.items() if k in fn.arg_names}
        if "ON_CPU" in const:
            const["ON_CPU"] = False
        opts = {"num_warps": kw.get("num_warps", 4), "num_stages": kw.get("num_stages", 3)}
        if kw.get("launch_pdl"):
            opts["launch_pdl"] = True
        if kw.get("maxnreg"):
            opts["maxnreg"] = kw["maxnreg"]
        dtypes = tuple(str(v.dtype) for v in a if isinstance(v, torch.Tensor))
        key = (fn.__name__, tuple(sorted(const.items())), tuple(opts.values()), dtypes)
        if key in seen:
            continue
        seen.add(key)
        row = {"kernel": fn.__name__, "config": label, **opts}
        try:
            c = compile_sm90(fn, a, const, opts, aligned_tensors=True)
            with tempfile.TemporaryDirectory() as tmp:
                cubin = Path(tmp) / "k.cubin"
                cubin.write_bytes(c.asm["cubin"])
                tool = cuobjdump()
                res = subprocess.run([tool, "--dump-resource-usage", str(cubin)],
                                     capture_output=True, text=True).stdout  # fmt: skip
                sass = subprocess.run([tool, "--dump-sass", str(cubin)], capture_output=True,
                                      text=True).stdout  # fmt: skip
            if sass_dir:
                name = re.sub(r"[^\w.-]+", "_", f"{fn.__name__}_{label}")
                Path(sass_dir).mkdir(parents=True, exist_ok=True)
                (Path(sass_dir) / f"{name}.sass").write_text(sass)
            m = re.search(r"REG:(\d+) STACK:(\d+)", res)
            ops = re.findall(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][\w.]*)", sass,
                             re.M)  # fmt: skip
            row |= {"regs": int(m.group(1)), "stack": int(m.group(2)),
                    "smem": c.metadata.shared, "wgmma": sass.count("HGMMA"),
                    "hmma": sass.count("HMMA."), "instr": sum(o != "NOP" for o in ops),
                    "movs": sum(o in ("MOV", "IMAD.MOV.U32") for o in ops)}  # fmt: skip
            if "ACQBULK" in ops:  # griddepcontrol.wait: what the kernel does once it may read
                after = ops[ops.index("ACQBULK") + 1 :]
                row["after_wait"] = sum(o != "NOP" for o in after)
            if "BLOCK_N" in const and "GROUP" in const and "W" in const:  # tensor-core tiles
                # codes a program multiplies: a tile, two (gate and up), or k slots of SG
                # groups (down; the shared expert's FMA tile not counted)
                tiles = 2 if "gate_up" in fn.__name__ else 1
                ng = const["NG"] if "NG" in const else const["TOP_K"] * const["SG"]
                codes = tiles * const["BLOCK_N"] * ng * const["GROUP"] / (32 * const["W"])
                row["instr_per_code"] = row["instr"] / codes
        except Exception as e:  # noqa: BLE001 - a config that does not compile is data
            row["error"] = f"{type(e).__name__}: {e}"[:ERR_CHARS]
        rows.append(row)
    return rows
