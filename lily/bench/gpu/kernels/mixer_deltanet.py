"""The DeltaNet sections of lily.bench.gpu.kernels.mixer (not a script): one layer's inputs
at the model's shapes, ``dn_decode`` (a step over 30 layers' states in a graph, block_v and
warps swept) and ``dn_prefill`` (token scan against the chunked forms), each row checked
against lily.model.ref."""

from __future__ import annotations

import torch

from lily.bench.gpu.kernels.common import BF16, DEV, bench_ms, graph_call_ms, rel
from lily.bench.measure import attempt, kernel_times
from lily.model.ref import ref_deltanet
from lily.ops.deltanet_decode import DeltaNetDecodeWorkspace, deltanet_decode
from lily.ops.deltanet_prefill import deltanet_prefill

HK, HV, K, VD, W = 16, 32, 128, 128, 4
C = 2 * HK * K + HV * VD
DN_LAYERS = 30
# the sweeps (module constants so that a dry run can shrink them)
DN_DECODE_CONFIGS = [(bv, w) for bv in (16, 32, 64, 128) for w in (4, 8)]  # block_v, warps
DN_PREFILL_T = (512, 2048, 8192)
DN_PREFILL_CONFIGS = [("scan", 16), ("scan", 32), ("scan", 128)]
DN_PREFILL_CONFIGS += [("chunk", 32), ("chunk", 64), ("chunk", 128)]
DN_PREFILL_CONFIGS += [("chunk_par", 32), ("chunk_par", 64), ("chunk_par", 128)]
SCAN_ALL_UP_TO = 2048  # longer chunks time only the first scan configuration (it is slow)
DN_INPUTS = ("mixed_qkv", "z", "b", "a")
DN_ARGS = DN_INPUTS + ("conv_weight", "conv_state", "A_log", "dt_bias", "norm_weight", "state")


def dn_inputs(t: int, gen: torch.Generator) -> dict:
    """One layer's inputs for T tokens, in the ranges the model produces."""
    dev = gen.device

    def rnd(*shape, scale=1.0, dtype=BF16):
        return (torch.randn(*shape, generator=gen, device=dev) * scale).to(dtype)

    f32 = torch.float32
    return {
        "mixed_qkv": rnd(t, C), "z": rnd(t, HV * VD), "b": rnd(t, HV), "a": rnd(t, HV),
        "conv_weight": rnd(C, W, scale=0.5), "conv_state": rnd(W - 1, C),
        "A_log": rnd(HV, scale=0.5, dtype=f32), "dt_bias": rnd(HV, dtype=f32),
        "norm_weight": (torch.rand(VD, generator=gen, device=dev) + 0.5).to(BF16),
        "state": rnd(HV, K, VD, scale=0.05, dtype=f32),
    }  # fmt: skip


def dn_args(d: dict, rows=slice(None), **states) -> list:
    """Positional arguments of the DeltaNet ops: tokens ``rows``, states overridable."""
    d = {**d, **states}
    return [d[k][rows] if k in DN_INPUTS else d[k] for k in DN_ARGS]


def fresh_states(d: dict) -> dict:
    return {"conv_state": d["conv_state"].clone(), "state": d["state"].clone()}


def dn_decode(gen: torch.Generator, copy_gbs: float) -> list[dict]:
    rows = []
    d = dn_inputs(1, gen)
    ref_out, ref_cs, ref_st = ref_deltanet(*dn_args(d), 1e-6)
    layers = [dn_inputs(1, gen) for _ in range(DN_LAYERS)]
    ws = DeltaNetDecodeWorkspace.new(HK, HV, VD, DEV)
    # bytes one step must move per layer: state and conv state read and written, conv and
    # norm weights, the inputs (qkv, z, b, a) and the output
    nbytes = 2 * HV * K * VD * 4 + 2 * (W - 1) * C * 2 + C * W * 2 + VD * 2
    nbytes += (C + 2 * HV * VD + 2 * HV) * 2

    def measure(block_v: int, warps: int) -> dict:
        kw = {"workspace": ws, "block_v": block_v, "num_warps": warps}
        st = fresh_states(d)
        out = deltanet_decode(*dn_args(d, 0, **st), 1e-6, **kw)
        err = max(rel(out, ref_out[0]), rel(st["state"], ref_st))
        err_cs = rel(st["conv_state"].float(), ref_cs)

        def step():
            for x in layers:
                deltanet_decode(*dn_args(x, 0), 1e-6, **kw)

        us = graph_call_ms(step) * 1e3 / DN_LAYERS
        gbs = nbytes / us / 1e3
        return {"us_per_layer": us, "GBps": gbs, "frac_copy": gbs / copy_gbs,
                "rel_err": err, "conv_state_err": err_cs}  # fmt: skip

    for block_v, warps in DN_DECODE_CONFIGS:
        base = {"op": "dn_decode", "block_v": block_v, "num_warps": warps}
        attempt(rows, base, lambda b=block_v, w=warps: measure(b, w))
    return rows


def dn_prefill(gen: torch.Generator, ts: tuple[int, ...] = DN_PREFILL_T) -> list[dict]:
    rows = []
    for t in ts:
        d = dn_inputs(t, gen)
        ref = ref_deltanet(*dn_args(d), 1e-6)[::2]

        def measure(method: str, block_v: int, d=d, ref=ref, t=t) -> dict:
            kw = {"method": method, "block_v": block_v}
            st = fresh_states(d)
            out = deltanet_prefill(*dn_args(d, **st), 1e-6, **kw)
            err = max(rel(out, ref[0]), rel(st["state"], ref[1]))
            st = fresh_states(d)  # timed runs update states of their own

            def call():
                deltanet_prefill(*dn_args(d, **st), 1e-6, **kw)

            ms, ms_eager = graph_call_ms(call), bench_ms(call)
            return {"ms": ms, "ms_eager": ms_eager, "tok_per_s": t / ms * 1e3,
                    "ms_30_layers": 30 * ms, "rel_err": err,
                    "kernels_us": kernel_times(call)}  # fmt: skip

        for method, block_v in DN_PREFILL_CONFIGS:
            if method == "scan" and t > SCAN_ALL_UP_TO and block_v != DN_PREFILL_CONFIGS[0][1]:
                continue
            base = {"op": "dn_prefill", "T": t, "method": method, "block_v": block_v}
            attempt(rows, base, lambda m=method, b=block_v, f=measure: f(m, b))
        del d, ref
    return rows
