"""Decode at depths whose prefill does not fit the budget: a directly filled context."""

from __future__ import annotations

import math
import time

import pytest

from lily.bench import report
from lily.bench.peers import PeerProcess
from lily.bench.sweep import BenchAdapter, LocalEngine, Slot, sweep
from lily.checkpoint import TINY_TEXT_CONFIG

VOCAB = TINY_TEXT_CONFIG["vocab_size"]
# report.enrich's cost model, made up
COST = {"weight_bytes_per_token": 1e6, "state_bytes_per_token": 1e4,
        "kv_bytes_per_context_token": 100, "active_linear_params": 1e6,
        "deltanet_flops_per_token": 1e5, "attn_flops_per_key": 100,
        "lm_head_params": 1e5}  # fmt: skip


def test_mlx_fill_context_leaves_the_state_a_real_prefill_leaves(mlx4_dir):
    """After fill_context(n) every cache entry has the type, shapes, dtypes and offset a
    real prefill of the same n tokens leaves (random values instead of computed ones), and
    a decode step attends to n + 1 keys. With the real prefill's values copied into the
    filled arrays (contents only), decode gives the real prefill's logits and tokens: the
    depth and positions decode sees are the filled ones (a wrong offset would change them,
    as the last check shows)."""
    import mlx.core as mx
    from mlx_lm.models.cache import ArraysCache, KVCache

    from lily.bench.measure import pseudo_text_ids
    from lily.bench.peer_mlx import MlxAdapter

    n = 300  # over the KV allocation step (256) and chunked: the cache grew as a prompt's
    a = MlxAdapter({"kind": "dir", "path": str(mlx4_dir), "dtype": "float32",
                    "prefill_chunk": 64})  # fmt: skip
    tok = a.prefill(pseudo_text_ids(n, VOCAB, seed=3))
    real = a.cache
    # copies of the real state's values (x * 1: decode writes into the cache's arrays)
    snap = [[c.keys * 1, c.values * 1] if type(c) is KVCache else [x * 1 for x in c.cache]
            for c in real]  # fmt: skip
    mx.eval(snap)
    ref_logits = a._step([tok])[0, -1]
    ref_toks = [int(mx.argmax(ref_logits).item())]
    ref_toks += [a.decode(ref_toks[-1]) for _ in range(3)]

    first = a.fill_context(n)
    filled = a.cache
    assert 0 <= first < VOCAB
    assert [type(c) for c in filled] == [type(c) for c in real]
    assert {KVCache, ArraysCache} <= {type(c) for c in filled}
    for f, r, s in zip(filled, real, snap, strict=True):
        got = [f.keys, f.values] if type(f) is KVCache else f.cache
        assert [(x.shape, x.dtype) for x in got] == [(x.shape, x.dtype) for x in s]
        same = [mx.array_equal(x, y).item() for x, y in zip(got, s, strict=True)]
        assert not any(same)  # random values, not the computed ones
        if type(f) is KVCache:
            assert f.offset == n and r.offset == n + 4  # the real one decoded 4 more
        else:
            assert f.lengths is None and f.left_padding is None
    logits = a._step([first])[0, -1]
    assert mx.all(mx.isfinite(logits)).item()
    for c in filled:
        if type(c) is KVCache:
            assert c.offset == n + 1 and c.keys_and_values()[0].shape[2] == n + 1
    k, _ = a.decode_timed(int(mx.argmax(logits).item()), 4, math.inf)
    assert k == 4 and all(0 <= t < VOCAB for t in a.timed)

    def decode_from_copied(offset_shift: int = 0):
        a.fill_context(n)
        for f, s in zip(a.cache, snap, strict=True):
            if type(f) is KVCache:
                f.keys, f.values = s[0] * 1, s[1] * 1
                f.offset += offset_shift
            else:
                f.cache = [x * 1 for x in s]
        return a._step([tok])[0, -1]

    logits = decode_from_copied()
    assert mx.allclose(logits, ref_logits, rtol=1e-5, atol=1e-5).item()
    toks = [int(mx.argmax(logits).item())]
    toks += [a.decode(toks[-1]) for _ in range(3)]
    assert toks == ref_toks
    assert not mx.allclose(decode_from_copied(-1), ref_logits, rtol=1e-3, atol=1e-3).item()


class Fake(BenchAdapter):
    """Prefill and decode take no time; records each decode's allowance (deadline - now)."""

    def __init__(self, name):
        self.name, self.prefills, self.allowances = name, [], []

    def prefill(self, ids):
        self.prefills.append(len(ids))
        return 1

    def decode(self, token):
        return token + 1

    def decode_timed(self, token, n, deadline):
        self.allowances.append(deadline - time.perf_counter())
        return super().decode_timed(token, n, deadline)


def test_a_sweep_times_mlx_decode_where_its_prefill_is_cut(mlx4_dir):
    """The MLX-LM peer (its worker process), predicted far too slow to prefill, still has
    its decode timed at every length on a filled context, with a note; an engine that
    cannot fill is cut as before; lily's points are whole and its allowance is not shared
    with the cut engines. The summary and Markdown carry the decode figures and ratios."""
    lily, nofill = Fake("lily"), Fake("nofill")
    mlx = PeerProcess("mlx-lm", {"kind": "dir", "path": str(mlx4_dir), "dtype": "float32"})
    slots = [Slot("lily", LocalEngine(lily)), Slot("mlx-lm", mlx, peer=True, rate=0.1),
             Slot("nofill", LocalEngine(nofill), peer=True, rate=0.1)]  # fmt: skip
    lengths = [16, 64, 128]
    try:
        t0 = time.perf_counter()
        res = sweep(slots, lengths, lambda n: list(range(3, 3 + n)), 4, 1, budget_s=60.0)
        elapsed = time.perf_counter() - t0
    finally:
        mlx.close()
    by = {(r["engine"], r["length"]): r for r in res}
    for n in lengths:
        p = by[("mlx-lm", n)]
        assert p["status"] == "ok" and p["prefill_tok_s"] is None and p["prefill_s"] is None
        assert p["decode_tokens"] == 4 and p["decode_tok_s"] > 0 and p["fill_s"] > 0
        assert p["note"].startswith(f"decode after a directly filled cache of {n} tokens")
        assert by[("nofill", n)]["status"] == "cut"
        assert by[("lily", n)]["status"] == "ok" and "note" not in by[("lily", n)]
        assert by[("lily", n)]["prefill_tok_s"] > 0 and by[("lily", n)]["decode_tokens"] == 4
    assert by[("mlx-lm", 16)]["note"].endswith("(prefill predicted 208 s > 30 s left)")
    assert by[("mlx-lm", 128)]["note"].endswith("(prefill cut from 16 tokens)")
    assert by[("nofill", 16)]["note"].startswith("time budget: predicted prefill 208 s > ")
    assert by[("nofill", 128)]["note"] == "time budget (cut from 16 tokens)"
    assert lily.prefills == lengths and nofill.prefills == [] and not slots[2].fill
    # at 16 all three were still to run; at 128 lily runs before mlx-lm (order: nofill,
    # lily, mlx-lm) and gets all that is left, as without the filled decodes
    assert lily.allowances[0] == pytest.approx(20, abs=1)
    assert lily.allowances[2] > 60 - elapsed - 1

    for p in res:
        report.enrich(p, COST, {"matmul_TFLOPs": 1.0, "copy_GBps": 1.0})
    assert "prefill_TFLOPs" not in by[("mlx-lm", 16)] and by[("mlx-lm", 16)]["decode_GBps"] > 0
    summ = report.summarize(res, ["lily", "mlx-lm", "nofill"], ["mlx-lm", "nofill"])
    m = summ["engines"]["mlx-lm"]
    assert m["prefill_tok_s"] == {} and m["avg_prefill_tok_s"] is None and m["lengths"] == []
    assert set(m["decode_tok_s"]) == {"16", "64", "128"}
    assert m["avg_decode_tok_s"] == pytest.approx(sum(m["decode_tok_s"].values()) / 3)
    r = summ["ratios"]["lily/mlx-lm"]
    assert r["prefill"]["per_length"] == {} and r["prefill"]["mean_ratio"] is None
    want = {k: summ["engines"]["lily"]["decode_tok_s"][k] / m["decode_tok_s"][k]
            for k in ("16", "64", "128")}  # fmt: skip
    assert r["decode"]["per_length"] == pytest.approx(want) and r["decode"]["lengths"] == lengths
    md = report.markdown({"env": {}, "config": {"model": "tiny", "lengths": lengths, "rounds": 1,
                                                "decode_tokens": 4},
                          "summary": summ, "points": res})  # fmt: skip
    rows = {x.split(" | ")[0][2:]: x.split(" | ")[1:] for x in md.splitlines() if "|" in x}
    assert "-" not in rows["mlx-lm: decode tok/s"] and "mlx-lm: prefill tok/s" not in rows
    assert rows["lily/mlx-lm: prefill"] == ["-", "-", "-", "- |"]
    want = [f"{r['decode']['per_length'][k]:,.2f}" for k in ("16", "64", "128")]
    assert rows["lily/mlx-lm: decode"] == want + [f"{r['decode']['mean_ratio']:,.2f} |"]
    assert "- mlx-lm at 64: decode after a directly filled cache of 64 tokens" in md
    assert "timed after a cache filled directly to that depth" in md
