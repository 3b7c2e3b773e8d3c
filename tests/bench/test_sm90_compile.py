"""The MoE prefill's sm_90 GEMMs compiled for sm_90 on a machine without a GPU
(lily/bench/sm90_compile.py): what the interpreter cannot see (a kernel that does not
lower, shared memory over an sm_90 block's, the TMA copies and warpgroup MMAs that are the
point of these kernels) shows here. Small shapes (E=5, D=192, I=64, shared Is=128).

The compiles run in a child process: this one runs the kernels under Triton's interpreter
(tests/conftest.py), whose kernels cannot be compiled."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="the GPU runs these kernels itself (tests/ops)"
)

CHILD = textwrap.dedent("""
    import json, torch
    from lily.bench.sm90_compile import compile_row, intercepted
    from lily.ops.moe_prefill import MoePrefillConfig, moe_prefill
    from lily.ops.qgemm import GemmConfig
    from lily.quant import QuantWeight

    def zero(shape, bits):
        q = torch.zeros(*shape[:-1], shape[-1] * bits // 32, dtype=torch.int32)
        s = torch.zeros(*shape[:-1], shape[-1] // 64, dtype=torch.bfloat16)
        return QuantWeight(q, s, s.clone(), bits, 64)

    e, d, i, i_s = 5, 192, 64, 128
    w = [zero((e, d), 8), zero((e, i, d), 4), zero((e, i, d), 4), zero((e, d, i), 4),
         zero((i_s, d), 4), zero((i_s, d), 4), zero((d, i_s), 4), zero((1, d), 8)]
    x = torch.zeros(37, d, dtype=torch.bfloat16)
    cfg = MoePrefillConfig(32, GemmConfig(32, 64, 64, 4, 3), GemmConfig(32, 64, 64, 4, 3))
    with intercepted() as launches:
        moe_prefill(x, *w, 2, x, config=cfg, gemm="sm90")
    for fn, a, kw in launches:
        if "tma" in fn.__name__:
            print(json.dumps(compile_row(fn, a, kw)))
""")


def test_sm90_moe_gemms_compile_with_tma_and_wgmma():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True,
                         text=True, timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    # routed and shared experts, gate/up and down: four launches
    assert (
        sorted(r["kernel"] for r in rows) == ["_down_tma_kernel"] * 2 + ["_gate_up_tma_kernel"] * 2
    )
    for row in rows:
        assert "error" not in row, row
        assert row["fits"] and row["tma"] > 0 and row["wgmma"] > 0, row
        assert row["stack"] <= 64, row  # no real spills at these tiles
