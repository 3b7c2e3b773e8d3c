"""The attention sections of lily.bench.gpu.kernels.mixer (not a script): projections and
caches at the model's shapes, ``attn_decode``/``attn_bucket`` (a decode step over 10 layers'
caches in a graph, plain against split-KV, as the runner's graph buckets see it) and
``attn_prefill``/``attn_split`` (prefill tiles, keys split S ways), each row checked against
lily.model.ref."""

from __future__ import annotations

from functools import partial

import torch

from lily.bench.gpu.kernels.common import BF16, DEV, bench_ms, graph_call_ms, rel
from lily.bench.measure import attempt, kernel_times
from lily.model.ref import ref_attention
from lily.ops.attention_decode import attention_decode, default_split
from lily.ops.attention_prefill import attention_prefill, flash_per_sm, flash_split
from lily.ops.launch import cdiv
from lily.ops.norm_rope import rope_inv_freq

H, HKV, DH, R, THETA = 16, 2, 256, 64, 1e7
ATTN_LAYERS = 10
ATTN_CONTEXTS = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
ATTN_SPLITS = (64, 256, 1024)  # tried beside the plain variant and default_split
# (context, graph bucket) of decode steps as the runner captures them, and splits tried
ATTN_BUCKET_POINTS = ((4200, 8192), (7900, 8192), (16500, 32768), (33000, 65536),
                      (62000, 65536), (66000, 131072), (131200, 135168))  # fmt: skip
ATTN_BUCKET_SPLITS = (64, 128, 256, 512, 1024)
ATTN_PREFILL_SHAPES = ((512, 0), (2048, 0), (8192, 0), (512, 1536), (2048, 30720))  # T, start
# block_m, block_n, warps (the default first)
ATTN_PREFILL_CONFIGS = [(128, 64, 8), (64, 32, 4), (64, 64, 8), (32, 64, 4), (128, 32, 8),
                        (64, 16, 4)]  # fmt: skip
# Key splits of the prefill (T, start): short chunks after a long history (reused turns)
ATTN_SPLIT_SHAPES = ((1128, 16080), (512, 16000), (2048, 16000), (1128, 4000), (4096, 0),
                     (4096, 12288), (4096, 126976))  # fmt: skip
ATTN_SPLIT_TRIES = (1, 2, 3, 4, 6, 8, 12)
ATTN_SPLIT_CONFIGS = [(64, 32, 4), (128, 32, 8)]  # block_m, block_n, warps
# block_m, block_n, warps, stages
ATTN_TILE_CONFIGS = [(64, 32, 4, 2), (64, 32, 4, 3), (64, 64, 4, 2), (64, 64, 4, 3),
                     (64, 64, 8, 2), (128, 64, 8, 2), (64, 16, 4, 3)]  # fmt: skip

ATTN_ARGS = ("qg", "k", "v", "q_norm", "k_norm", "k_cache", "v_cache")


def attn_inputs(t: int, t_max: int, gen: torch.Generator, filled: int) -> dict:
    """Projections of T tokens and caches of T_max rows, the first ``filled`` random."""
    dev = gen.device

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device=dev).to(BF16)

    d = {"qg": rnd(t, H * 2 * DH), "k": rnd(t, HKV * DH), "v": rnd(t, HKV * DH)}
    for name in ("q_norm", "k_norm"):
        d[name] = (torch.rand(DH, generator=gen, device=dev) + 0.5).to(BF16)
    for name in ("k_cache", "v_cache"):
        d[name] = torch.zeros(HKV, t_max, DH, device=dev, dtype=BF16)
        d[name][:, :filled] = rnd(HKV, filled, DH)
    return d


def attn_args(d: dict, row: int | None = None) -> list:
    """Positional arguments of the attention ops (one token's row for decode)."""
    return [d[k] if row is None or "norm" in k or "cache" in k else d[k][row] for k in ATTN_ARGS]


def attn_point(layers, pos, inv_freq, ref_out, kw: dict, nbytes: int, copy_gbs: float,
               kernels: bool) -> dict:  # fmt: skip
    """One attention decode configuration: checked on layer 0, then timed as a graph over
    all layers (us a layer); with ``kernels`` also each kernel's device time."""

    def step():
        for x in layers:
            attention_decode(*attn_args(x, 0), pos, inv_freq, **kw)

    err = rel(attention_decode(*attn_args(layers[0], 0), pos, inv_freq, **kw), ref_out)
    us = graph_call_ms(step) * 1e3 / ATTN_LAYERS
    gbs = nbytes / us / 1e3
    row = {"us_per_layer": us, "GBps": gbs, "frac_copy": gbs / copy_gbs, "rel_err": err}
    if kernels:
        row["kernels_us"] = kernel_times(
            lambda: attention_decode(*attn_args(layers[0], 0), pos, inv_freq, **kw)
        )
    return row


def attn_decode(gen: torch.Generator, copy_gbs: float) -> list[dict]:
    return attn_points(gen, copy_gbs, [(ctx, ctx) for ctx in ATTN_CONTEXTS], ATTN_SPLITS,
                       "attn_decode")  # fmt: skip


def attn_bucket(gen: torch.Generator, copy_gbs: float) -> list[dict]:
    """Split sizes as the runner's decode graphs see them: a graph is captured per context
    bucket (``max_len``, the next power of two), so the split is fixed while the length
    runs from half the bucket to all of it."""
    return attn_points(gen, copy_gbs, ATTN_BUCKET_POINTS, ATTN_BUCKET_SPLITS, "attn_bucket")


def attn_points(gen: torch.Generator, copy_gbs: float, points, splits, op: str) -> list[dict]:
    """Each (ctx, max_len) point: ``ctx`` rows in a graph of 10 layers built for
    ``max_len``, at the default split and ``splits`` (and the plain variant when
    ctx == max_len, as run 1 measured it)."""
    rows = []
    inv_freq = rope_inv_freq(R, THETA, DEV)
    for ctx, max_len in points:
        pos = torch.tensor([ctx - 1], device=DEV, dtype=torch.int32)
        layers = [attn_inputs(1, max_len, gen, ctx - 1) for _ in range(ATTN_LAYERS)]
        ref_out = ref_attention(*attn_args(layers[0]), ctx - 1, R, THETA)[0][0]
        nbytes = 2 * HKV * ctx * DH * 2  # K and V rows read per layer
        default = default_split(max_len)
        tried = [0] if ctx == max_len else []
        tried += [default] + [s for s in splits if s < max_len]
        for split in dict.fromkeys(tried):
            base = {"op": op, "ctx": ctx, "max_len": max_len, "split": split,
                    "default": split == default}  # fmt: skip
            kw = {"split": split, "max_len": max_len}
            kernels = split == default or op == "attn_bucket"
            attempt(rows, base, partial(attn_point, layers, pos, inv_freq, ref_out, kw, nbytes,
                                        copy_gbs, kernels))  # fmt: skip
        del layers
        torch.cuda.empty_cache()
    return rows


def attn_prefill(gen: torch.Generator, mm_tflops: float) -> list[dict]:
    rows = []
    inv_freq = rope_inv_freq(R, THETA, DEV)
    for t, start in ATTN_PREFILL_SHAPES:
        d = attn_inputs(t, start + t, gen, start)
        ref = ref_attention(*attn_args(d), start, R, THETA)[0]
        torch.cuda.empty_cache()
        flops = 4 * H * DH * (t * start + t * (t + 1) // 2)  # causal QK^T and PV
        start_t = torch.tensor([start], device=DEV)  # a device start: no copy in the graph

        def measure(bm: int, bn: int, warps: int, d=d, ref=ref, flops=flops, start_t=start_t):
            kw = {"block_m": bm, "block_n": bn, "num_warps": warps}

            def call():
                return attention_prefill(*attn_args(d), start_t, inv_freq, **kw)

            err = rel(call(), ref)
            ms, ms_eager = graph_call_ms(call), bench_ms(call)
            tflops = flops / ms / 1e9
            return {"ms": ms, "ms_eager": ms_eager, "TFLOPs": tflops,
                    "frac_matmul": tflops / mm_tflops, "rel_err": err,
                    "kernels_us": kernel_times(call)}  # fmt: skip

        for bm, bn, warps in ATTN_PREFILL_CONFIGS:
            base = {"op": "attn_prefill", "T": t, "start": start, "block_m": bm, "block_n": bn,
                    "num_warps": warps}  # fmt: skip
            attempt(rows, base, lambda a=bm, b=bn, w=warps, f=measure: f(a, b, w))
        del d, ref
    return rows


def attn_split(gen: torch.Generator, mm_tflops: float, shapes=ATTN_SPLIT_SHAPES,
               configs=ATTN_SPLIT_CONFIGS, tries=ATTN_SPLIT_TRIES) -> list[dict]:  # fmt: skip
    """Prefill tiles with their keys split S ways, and the S that flash_split picks.
    ``configs``: (block_m, block_n, warps) or (block_m, block_n, warps, stages)."""
    rows = []
    inv_freq = rope_inv_freq(R, THETA, DEV)
    n_sm = torch.cuda.get_device_properties(DEV).multi_processor_count
    for t, start in shapes:
        d = attn_inputs(t, start + t, gen, start)
        ref = ref_attention(*attn_args(d), start, R, THETA)[0]
        torch.cuda.empty_cache()
        flops = 4 * H * DH * (t * start + t * (t + 1) // 2)
        start_t = torch.tensor([start], device=DEV)
        for bm, bn, warps, *st in configs:
            stages = st[0] if st else 2
            kw = {"block_m": bm, "block_n": bn, "num_warps": warps, "num_stages": stages}
            per_sm = flash_per_sm(bm, bn, DH, warps, stages, d["k_cache"])
            auto = flash_split(cdiv(t, bm // (H // HKV)) * HKV, start + t, n_sm * per_sm, bn)

            def measure(split: int, d=d, ref=ref, flops=flops, start_t=start_t, kw=kw, auto=auto):
                def call():
                    return attention_prefill(*attn_args(d), start_t, inv_freq, split=split, **kw)

                err = rel(call(), ref)
                ms = graph_call_ms(call)
                tflops = flops / ms / 1e9
                return {"ms": ms, "TFLOPs": tflops, "frac_matmul": tflops / mm_tflops,
                        "rel_err": err, "picked": split == auto}  # fmt: skip

            for split in dict.fromkeys((auto, *tries)):
                base = {"op": "attn_split", "T": t, "start": start, "block_m": bm,
                        "block_n": bn, "num_warps": warps, "num_stages": stages,
                        "split": split}  # fmt: skip
                attempt(rows, base, lambda sp=split, f=measure: f(sp))
        del d, ref
        torch.cuda.empty_cache()
    return rows
