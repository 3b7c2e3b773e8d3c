"""Where do non-finite logits come from? Attention kernels near the cache end, on the GPU."""

from __future__ import annotations

import torch

from lily.ops.attention_decode import attention_decode
from lily.ops.attention_prefill import attention_prefill
from lily.ops.norm_rope import rope_inv_freq
from lily.ops.ref_mixer import ref_attention

dev = "cuda"
H, HKV, DH = 16, 2, 256
inv = rope_inv_freq(64, 1e7, dev)


def case(cap: int, start: int, t: int, max_len: int | None):
    g = torch.Generator(device=dev).manual_seed(start + t)
    kc = torch.randn(HKV, cap, DH, device=dev, generator=g).bfloat16()
    vc = torch.randn(HKV, cap, DH, device=dev, generator=g).bfloat16()
    kc[:, start:] = float("nan")  # never read past what is written
    vc[:, start:] = float("nan")
    qg = torch.randn(t, H * 2 * DH, device=dev, generator=g).bfloat16()
    k = torch.randn(t, HKV * DH, device=dev, generator=g).bfloat16()
    v = torch.randn(t, HKV * DH, device=dev, generator=g).bfloat16()
    qn = torch.rand(DH, device=dev, generator=g) + 0.5
    kn = torch.rand(DH, device=dev, generator=g) + 0.5
    rk, rv = kc.clone(), vc.clone()
    ref, _, _ = ref_attention(qg.float(), k.float(), v.float(), qn, kn, rk.float(), rv.float(),
                              start, 64, 1e7)  # fmt: skip
    if t == 1:
        pos = torch.tensor([start], dtype=torch.int32, device=dev)
        out = attention_decode(qg[0], k[0], v[0], qn, kn, kc, vc, pos, inv, max_len=max_len)[None]
    else:
        out = attention_prefill(qg, k, v, qn, kn, kc, vc, start, inv)
    err = float((out.float() - ref.float()).norm() / ref.float().norm())
    fin = bool(torch.isfinite(out).all())
    print(f"cap {cap} start {start} T {t} max_len {max_len}: finite {fin} rel {err:.3g}")


for cap, start, t, ml in [
    (8192, 8119, 1, 8192),
    (8192, 8191, 1, 8192),
    (8192, 7200, 1, 8192),
    (8192, 6502, 1, 8192),
    (16384, 8200, 1, 16384),
    (16384, 16000, 1, 16384),
    (65536, 40000, 1, 65536),
    (8192, 8108, 11, None),
    (8192, 6491, 11, None),
    (8192, 6502, 1606, None),
    (16384, 8192, 1545, None),
    (16384, 9000, 5, None),
]:
    try:
        case(cap, start, t, ml)
    except Exception as e:  # noqa: BLE001
        print(f"cap {cap} start {start} T {t}: {type(e).__name__}: {e}")
