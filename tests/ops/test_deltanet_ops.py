"""Gated DeltaNet kernels (decode step, prefill token scan, prefill chunked scan) against the
plain fp32 reference in lily.model.ref.

On a machine without CUDA the Triton kernels run under TRITON_INTERPRET=1 on small odd
shapes (Hk=2, Hv=4, K=32, Vd=48: not powers of two, so every mask is exercised); with CUDA
they run compiled on the GPU. Outputs the kernels must write are NaN-poisoned. Error bounds
(relative L2): fp32 inputs 1e-5 (rounding only; 5e-3 where a GPU's tensor cores take fp32
products as tf32); bf16 inputs 1.5e-2 on outputs (bf16 storage of q, k, v and the output),
2e-2 on states (the chunked form also rounds w, u and the operands of its tensor-core
products to bf16: about twice the token scan's state error, measured 1.2e-2, not growing
over 300 tokens).
"""

from __future__ import annotations

import pytest
import torch

from lily.bench.measure import capture_graph
from lily.model.ref import ref_deltanet
from lily.ops import (
    attention_decode,
    attention_prefill,
    deltanet_decode,
    deltanet_prefill,
    norm_rope,
)
from lily.ops.qgemv import qgemv
from lily.quant import quantize

# NOTE: without CUDA, tests/conftest.py sets TRITON_INTERPRET=1 and patches the Triton 3.6
# interpreter's defects (tests/triton_interp.py) before any kernel module is imported.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DEVICES = [DEVICE]
# fp32 comparisons through tl.dot: exact maths in the interpreter, tf32 on tensor cores
DOT_F32_TOL = 1e-5 if DEVICE == "cpu" else 5e-3
OPS = {
    "norm_rope": norm_rope,
    "dn_decode": deltanet_decode,
    "dn_prefill": deltanet_prefill,
    "attn_decode": attention_decode,
    "attn_prefill": attention_prefill,
}


@pytest.fixture(autouse=True)
def nan_poisoned_empty(poison_empty):
    """Every float buffer the launchers allocate starts as NaN, so a kernel that leaves any
    element of an output or intermediate unwritten fails the comparison."""
    poison_empty(like=False)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    assert torch.isfinite(a).all(), "non-finite values (an unwritten output?)"
    return ((a - b).norm() / b.norm()).item()


def make_inputs(t, hk=2, hv=4, kd=32, vd=48, width=4, dtype=torch.bfloat16, device=DEVICE, seed=0):
    """Random inputs of one DeltaNet layer for T tokens, in realistic ranges."""
    gen = torch.Generator().manual_seed(seed)
    c = 2 * hk * kd + hv * vd

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    d = dict(
        mixed_qkv=rnd(t, c),
        z=rnd(t, hv * vd),
        b=rnd(t, hv),
        a=rnd(t, hv),
        conv_weight=rnd(c, width, scale=0.5),
        conv_state=rnd(width - 1, c),
        A_log=torch.randn(hv, generator=gen) * 0.5,
        dt_bias=torch.randn(hv, generator=gen),
        norm_weight=(torch.rand(vd, generator=gen) + 0.5).to(dtype),
        state=torch.randn(hv, kd, vd, generator=gen) * 0.3,
    )
    return {k: v.to(device) for k, v in d.items()}


def reference(d, eps=1e-6):
    cpu = {k: v.cpu() for k, v in d.items()}
    return ref_deltanet(
        cpu["mixed_qkv"],
        cpu["z"],
        cpu["b"],
        cpu["a"],
        cpu["conv_weight"],
        cpu["conv_state"],
        cpu["A_log"],
        cpu["dt_bias"],
        cpu["norm_weight"],
        cpu["state"],
        eps,
    )


def run_prefill(d, method, cs=None, st=None, rows=slice(None), **kw):
    """The kernel on tokens ``rows``, with the given states (default: copies of d's);
    returns (out, conv_state, state)."""
    cs = d["conv_state"].clone() if cs is None else cs
    st = d["state"].clone() if st is None else st
    x, z, b, a = (d[k][rows] for k in ("mixed_qkv", "z", "b", "a"))
    out = OPS["dn_prefill"].deltanet_prefill(
        x,
        z,
        b,
        a,
        d["conv_weight"],
        cs,
        d["A_log"],
        d["dt_bias"],
        d["norm_weight"],
        st,
        1e-6,
        method=method,
        **kw,
    )
    return out, cs, st


def run_decode(d, t, cs, st, **kw):
    return OPS["dn_decode"].deltanet_decode(
        d["mixed_qkv"][t],
        d["z"][t],
        d["b"][t],
        d["a"][t],
        d["conv_weight"],
        cs,
        d["A_log"],
        d["dt_bias"],
        d["norm_weight"],
        st,
        1e-6,
        **kw,
    )


# ----------------------------------------------------------------------------- decode


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "heads,block_v,dtype,bound",
    [
        ((2, 4), 16, torch.bfloat16, 1e-2),  # 3 Vd blocks: last-arrival norm and conv state
        ((2, 4), 64, torch.bfloat16, 1e-2),  # one block per head: norm fused directly
        ((4, 4), 64, torch.float32, 1e-5),  # G = 1 and one block: no counters at all
        ((4, 4), 16, torch.float32, 1e-5),  # G = 1, 3 blocks: the counter for the norm only
    ],
    ids=["split-bf16", "whole-bf16", "g1-fp32", "g1-split-fp32"],
)
def test_decode_step_matches_reference(device, heads, block_v, dtype, bound):
    hk, hv = heads
    d = make_inputs(1, hk=hk, hv=hv, dtype=dtype, device=device, seed=1)
    ref_out, ref_cs, ref_st = reference(d)
    cs, st = d["conv_state"].clone(), d["state"].clone()
    ws = OPS["dn_decode"].DeltaNetDecodeWorkspace.new(hk, hv, 48, device)
    ws.o_buf.fill_(float("nan"))
    out = run_decode(d, 0, cs, st, block_v=block_v, workspace=ws)
    assert out.shape == (hv * 48,) and out.dtype == dtype
    assert rel(out, ref_out[0]) < bound
    assert rel(st, ref_st) < 1e-5  # fp32 maths on the same (exact) inputs
    assert torch.equal(cs.cpu().float(), ref_cs.to(dtype).float())
    assert (ws.counters == 0).all(), "counters must reset for the next launch"


@pytest.mark.parametrize("device", DEVICES)
def test_decode_steps_match_one_shot_reference(device):
    """12 chained decode steps (states carried in place) equal the reference over 12 tokens."""
    t = 12
    d = make_inputs(t, device=device, seed=2)
    ref_out, ref_cs, ref_st = reference(d)
    cs, st = d["conv_state"].clone(), d["state"].clone()
    outs = [run_decode(d, i, cs, st, block_v=16) for i in range(t)]
    assert rel(torch.stack(outs), ref_out) < 1e-2
    assert rel(st, ref_st) < 1e-5
    assert torch.equal(cs.cpu().float(), ref_cs.to(torch.bfloat16).float())


@pytest.mark.parametrize("device", DEVICES)
def test_decode_with_pdl_after_a_pdl_producer(device):
    """The decode step as the runner chains it: a PDL GEMV writes the step's inputs and the
    PDL DeltaNet kernel (states loaded before its wait) reads them, six tokens through one
    CUDA graph on the GPU (eager calls on the CPU, where ``pdl`` is a no-op). Against the
    reference over the six tokens of the GEMV's own outputs: a state or input read too early
    would use the previous token's values."""
    t, hk, hv, kd, vd = 6, 2, 4, 32, 48
    d = make_inputs(t, hk=hk, hv=hv, kd=kd, vd=vd, device=device, seed=7)
    c = 2 * hk * kd + hv * vd
    sizes = [c, hv * vd, hv, hv]
    gen = torch.Generator().manual_seed(8)
    w = quantize(torch.randn(sum(sizes), 64, generator=gen) / 8, 4, 64).to(device)
    xs = torch.randn(t, 64, generator=gen).to(device, torch.bfloat16)
    ys = torch.stack([qgemv(xs[i], w) for i in range(t)])  # the inputs the step will see
    parts = ys.split(sizes, dim=-1)
    ref = dict(d, mixed_qkv=parts[0], z=parts[1], b=parts[2], a=parts[3])
    ref_out, ref_cs, ref_st = reference(ref)
    cs, st = d["conv_state"].clone(), d["state"].clone()
    ws = OPS["dn_decode"].DeltaNetDecodeWorkspace.new(hk, hv, vd, device)
    x = xs[0].clone()

    def step():
        qkv, z, b, a = qgemv(x, w, pdl=True).split(sizes)
        return OPS["dn_decode"].deltanet_decode(
            qkv, z, b, a, d["conv_weight"], cs, d["A_log"], d["dt_bias"], d["norm_weight"],
            st, 1e-6, workspace=ws, block_v=16, pdl=True,
        )  # fmt: skip

    if device == "cuda":
        cs0, st0 = cs.clone(), st.clone()
        graph, out = capture_graph(step)
        cs.copy_(cs0)
        st.copy_(st0)
    outs = []
    for i in range(t):
        x.copy_(xs[i])
        if device == "cuda":
            graph.replay()
            outs.append(out.clone())
        else:
            outs.append(step())
    assert rel(torch.stack(outs), ref_out) < 1e-2
    assert rel(st, ref_st) < 1e-5
    assert torch.equal(cs.cpu().float(), ref_cs.to(torch.bfloat16).float())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", ["scan", "chunk"])
def test_decode_equals_one_token_of_prefill(device, method):
    d = make_inputs(1, dtype=torch.float32, device=device, seed=3)
    out_p, cs_p, st_p = run_prefill(d, method, chunk_size=16)
    cs, st = d["conv_state"].clone(), d["state"].clone()
    out_d = run_decode(d, 0, cs, st)
    assert rel(out_d, out_p[0]) < DOT_F32_TOL
    assert rel(st, st_p) < DOT_F32_TOL
    assert torch.equal(cs, cs_p)


def test_decode_rejects_bad_shapes():
    d = make_inputs(1, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="state must be a contiguous fp32"):
        OPS["dn_decode"].deltanet_decode(
            d["mixed_qkv"][0],
            d["z"][0],
            d["b"][0],
            d["a"][0],
            d["conv_weight"],
            d["conv_state"],
            d["A_log"],
            d["dt_bias"],
            d["norm_weight"],
            d["state"].half(),
        )
    with pytest.raises(ValueError, match="one token expected"):
        OPS["dn_decode"].deltanet_decode(
            d["mixed_qkv"].expand(2, -1),
            d["z"][0],
            d["b"][0],
            d["a"][0],
            d["conv_weight"],
            d["conv_state"],
            d["A_log"],
            d["dt_bias"],
            d["norm_weight"],
            d["state"],
        )
    with pytest.raises(ValueError, match="conv width C=.* is not 2\\*Hk\\*K"):
        OPS["dn_decode"].deltanet_decode(
            d["mixed_qkv"][0],
            d["z"][0],
            d["b"][0],
            d["a"][0],
            d["conv_weight"],
            d["conv_state"][:, :-1].contiguous(),
            d["A_log"],
            d["dt_bias"],
            d["norm_weight"],
            d["state"],
        )


# ----------------------------------------------------------------------------- prefill


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "method,chunk_size,block_v",
    [
        ("scan", 64, 16),
        ("scan", 64, 64),
        ("chunk", 16, 16),
        ("chunk", 64, 64),
        ("chunk_par", 16, 16),
    ],
    ids=["scan-split-norm", "scan-fused-norm", "chunk16-split-norm", "chunk64-fused-norm", "par16"],
)
def test_prefill_matches_reference(device, method, chunk_size, block_v):
    d = make_inputs(37, device=device, seed=4)
    ref_out, ref_cs, ref_st = reference(d)
    out, cs, st = run_prefill(d, method, chunk_size=chunk_size, block_v=block_v)
    assert out.shape == (37, 4 * 48) and out.dtype == torch.bfloat16
    assert rel(out, ref_out) < 1.5e-2
    assert rel(st, ref_st) < 2e-2
    assert torch.equal(cs.cpu().float(), ref_cs.to(torch.bfloat16).float())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "method,block_v", [("scan", 64), ("chunk", 16), ("chunk", 64), ("chunk_par", 16)]
)
def test_prefill_of_one_wide_projection_output(device, method, block_v):
    """The runner hands the kernels column slices of one fused projection output
    (qkv | z | b | a in one (T, C + Hv*Vd + 2*Hv) tensor): every consumer of x, z, b and a
    must use the row stride, fused-norm and separate-norm paths alike. The result equals
    the same call on contiguous copies; NaN columns between the parts catch a wrong stride."""
    d = make_inputs(37, device=device, seed=9)
    parts = [d[k] for k in ("mixed_qkv", "z", "b", "a")]
    gap = torch.full((37, 3), float("nan"), dtype=parts[0].dtype, device=parts[0].device)
    wide = torch.cat([p for x in parts for p in (x, gap)], dim=1)
    views, c0 = [], 0
    for x in parts:
        views.append(wide[:, c0 : c0 + x.shape[1]])
        c0 += x.shape[1] + 3
    assert all(not v.is_contiguous() for v in views)
    st_ref, st = d["state"].clone(), d["state"].clone()
    cs_ref, cs = d["conv_state"].clone(), d["conv_state"].clone()
    args = (d["conv_weight"],)
    tail = (d["A_log"], d["dt_bias"], d["norm_weight"])
    fn = OPS["dn_prefill"].deltanet_prefill
    kw = {"method": method, "chunk_size": 16, "block_v": block_v}
    ref = fn(*parts, *args, cs_ref, *tail, st_ref, 1e-6, **kw)
    got = fn(*views, *args, cs, *tail, st, 1e-6, **kw)
    assert torch.equal(got, ref)
    assert torch.equal(st, st_ref) and torch.equal(cs, cs_ref)


@pytest.mark.parametrize("device", DEVICES)
def test_chunked_form_equals_token_scan(device):
    """Same function, two algorithms: in fp32 they agree to rounding (3 chunks of 16)."""
    d = make_inputs(37, dtype=torch.float32, device=device, seed=5)
    out_s, _, st_s = run_prefill(d, "scan", block_v=16)
    out_c, _, st_c = run_prefill(d, "chunk", chunk_size=16, block_v=64)
    assert rel(out_c, out_s) < DOT_F32_TOL
    assert rel(st_c, st_s) < DOT_F32_TOL


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("split", [(20, 17), (2, 35)], ids=["20+17", "2+35"])
def test_prefill_after_earlier_chunks_equals_one_shot(device, split):
    """Chunks carry the conv and recurrent state (and may use different methods); T=2 < W-1
    mixes old state into the new."""
    d = make_inputs(37, device=device, seed=6)
    ref_out, ref_cs, ref_st = reference(d)
    cs, st = d["conv_state"].clone(), d["state"].clone()
    outs, s = [], 0
    for n in split:
        method = "chunk" if n % 2 else "chunk_par"  # both chunked forms carry the states
        outs.append(run_prefill(d, method, cs, st, slice(s, s + n), chunk_size=16)[0])
        s += n
    assert rel(torch.cat(outs), ref_out) < 1.5e-2
    assert rel(st, ref_st) < 2e-2
    assert torch.equal(cs.cpu().float(), ref_cs.to(torch.bfloat16).float())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", ["scan", "chunk"])
def test_long_recurrence_bf16_against_fp32(device, method):
    """300 tokens in bf16 (5 chunks of 64) stay within bf16 error of the fp32 recurrence."""
    d = make_inputs(300, device=device, seed=7)
    ref_out, _, ref_st = reference(d)
    out, _, st = run_prefill(d, method, block_v=64)
    assert rel(out, ref_out) < 2e-2
    assert rel(st, ref_st) < 2e-2


def test_prefill_rejects_bad_input():
    d = make_inputs(3, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="method must be"):
        run_prefill(d, "fast")
    with pytest.raises(ValueError, match=r"z must be \(3, 192\) with contiguous rows"):
        run_prefill({**d, "z": d["z"][:2]}, "scan")
    with pytest.raises(ValueError, match="b must be .* with contiguous rows"):
        run_prefill({**d, "b": d["b"].t().contiguous().t()}, "scan")
    with pytest.raises(ValueError, match="chunk_size must be"):
        run_prefill(d, "chunk", chunk_size=48)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", ["scan", "chunk", "chunk_par"])
@pytest.mark.parametrize("cuts", [(2,), (1, 20, 35)], ids=["2", "1-20-35"])
def test_prefill_cuts_give_the_states_at_the_cuts(device, method, cuts):
    """One call with cuts: the output of a call without them, and at each cut the conv and
    recurrent states of the reference run over the tokens before it (a cut at 1 or 2 < W-1
    takes part of the old conv state)."""
    d = make_inputs(37, dtype=torch.float32, device=device, seed=9)
    snaps: list = []
    out, cs, st = run_prefill(d, method, chunk_size=16, cuts=cuts, snaps=snaps)
    plain, plain_cs, plain_st = run_prefill(d, method, chunk_size=16)
    errs = [rel(out, plain), rel(st, plain_st)]
    assert torch.equal(cs, plain_cs) and len(snaps) == len(cuts)
    for c, (conv, rec) in zip(cuts, snaps, strict=True):
        head = {k: (v[:c] if k in ("mixed_qkv", "z", "b", "a") else v) for k, v in d.items()}
        _, ref_cs, ref_st = reference(head)
        assert torch.equal(conv.cpu(), ref_cs)
        errs.append(rel(rec, ref_st))
    assert max(errs) < DOT_F32_TOL, errs


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "cuts,chunk_size,block_v,dtype",
    [
        ((21,), 16, 16, torch.float32),  # shift 11: the grid's 2nd chunk ends at the cut
        ((16,), 16, 16, torch.float32),  # a multiple of the chunk: no shift
        ((1,), 16, 16, torch.float32),  # shift 15: the first chunk holds one token
        ((36,), 16, 64, torch.float32),  # T-1: the last chunk holds one token; norm fused
        ((35,), 64, 16, torch.float32),  # 29 padding rows span a whole 16-row block
        ((20, 35), 16, 16, torch.float32),  # split at 20; 35 in-kernel, 15 into its piece
        ((5, 21), 16, 64, torch.float32),  # split at 5; 21 in-kernel, 16 into it: no shift
        ((23,), 64, 64, torch.bfloat16),  # the real dtype and chunk size, norm fused
    ],
    ids=["21", "16", "1", "T-1", "35-c64", "20-35", "5-21", "23-c64-bf16"],
)
def test_prefill_chunk_cut_in_kernel(device, cuts, chunk_size, block_v, dtype):
    """method="chunk" takes the last cut inside its kernels by shifting its chunk grid: the
    outputs and final state equal a call without cuts (to rounding: chunk boundaries move),
    the state at each cut equals the fp32 reference over the tokens before it, and the
    snapshots are fresh tensors."""
    d = make_inputs(37, dtype=dtype, device=device, seed=10)
    # slow decays (about e^-0.1 a token): with make_inputs' e^-1 the state forgets within a
    # few tokens, and w, u of a wrongly placed chunk boundary passed (tried)
    d["A_log"] = d["A_log"] - 2.5
    snaps: list = []
    kw = {"chunk_size": chunk_size, "block_v": block_v}
    out, cs, st = run_prefill(d, "chunk", cuts=cuts, snaps=snaps, **kw)
    plain, plain_cs, plain_st = run_prefill(d, "chunk", **kw)
    # fp32: rounding only; bf16: the usual bounds against fp32 (module docstring), and
    # moved chunk boundaries change where w, u and S are rounded to bf16
    out_tol, st_tol = (DOT_F32_TOL, DOT_F32_TOL) if dtype == torch.float32 else (1.5e-2, 2e-2)
    assert rel(out, plain) < out_tol and rel(st, plain_st) < st_tol
    assert torch.equal(cs, plain_cs) and len(snaps) == len(cuts)
    for c, (conv, rec) in zip(cuts, snaps, strict=True):
        head = {k: (v[:c] if k in ("mixed_qkv", "z", "b", "a") else v) for k, v in d.items()}
        _, ref_cs, ref_st = reference(head)
        assert torch.equal(conv.cpu().float(), ref_cs.to(dtype).float())
        assert rec.dtype == torch.float32 and rec.shape == st.shape
        assert rec.data_ptr() != st.data_ptr()
        assert rel(rec, ref_st) < st_tol, c


@pytest.mark.parametrize("cuts", [(21,), (1,), (20, 35)], ids=["21", "1", "20-35"])
def test_prefill_chunk_cut_guarded(monkeypatch, cuts):
    """The shifted grid's padding rows before the first token are masked: with every tensor
    inside NaN guard bands (test_guard_bands.check_op) the call with cuts reads and writes
    nothing outside its tensors, snapshots included."""
    try:  # imported here: test_guard_bands imports this module
        from . import test_guard_bands as gb
    except ImportError:
        import test_guard_bands as gb

    def call(a):
        snaps: list = []
        args = [a[n] for n in gb.DN_ARGS]
        out = OPS["dn_prefill"].deltanet_prefill(
            *args, 1e-6, method="chunk", chunk_size=16, cuts=cuts, snaps=snaps
        )
        return (out, *(x for snap in snaps for x in snap))

    d = make_inputs(37, seed=12)
    gb.check_op(monkeypatch, call, d, inplace=("conv_state", "state"))


@pytest.mark.parametrize(
    "method,cuts,launches",
    [
        ("chunk", (), {"wy": 1, "scan": 1}),
        ("chunk", (30,), {"wy": 1, "scan": 1}),  # the reused turn's case: no extra launch
        ("chunk", (9, 30), {"wy": 2, "scan": 2}),  # one split, the last cut in-kernel
        ("chunk_par", (30,), {"wy": 2, "state": 2, "out": 2}),  # piece by piece, unchanged
    ],
    ids=["chunk-none", "chunk-1", "chunk-2", "par-1"],
)
def test_prefill_cut_launches(monkeypatch, method, cuts, launches):
    """The recurrence's kernel launches per layer: one cut costs "chunk" none more."""
    from lily.ops import deltanet_recurrence as rec

    counts: dict = {}
    names = {"token_scan": "_scan_kernel", "wy": "_chunk_wy_kernel", "scan": "_chunk_scan_kernel",
             "state": "_chunk_state_kernel", "out": "_chunk_out_kernel"}  # fmt: skip
    for key, name in names.items():
        kernel = getattr(rec, name)

        def counted(grid, args, kwargs, kernel=kernel, key=key):
            counts[key] = counts.get(key, 0) + 1
            return type(kernel).launch(kernel, grid, args, kwargs)

        monkeypatch.setattr(kernel, "launch", counted)
    d = make_inputs(33, dtype=torch.float32, seed=11)  # on the GPU where there is one
    snaps: list = []
    run_prefill(d, method, chunk_size=16, block_v=64, cuts=cuts, snaps=snaps)
    assert counts == launches and len(snaps) == len(cuts)


def test_prefill_rejects_bad_cuts():
    d = make_inputs(5, dtype=torch.float32, device="cpu")
    for cuts in ((0,), (5,), (3, 2), (2, 2)):
        with pytest.raises(ValueError, match="cuts must be increasing"):
            run_prefill(d, "chunk", cuts=cuts, snaps=[])
    with pytest.raises(ValueError, match="with a snaps list"):
        run_prefill(d, "chunk", cuts=(2,))


def test_chunked_kernels_never_specialize_the_token_count():
    """Every chunked recurrence kernel takes T as a plain argument: with T = 1 made a
    constant, Triton 3.6's sm_90 code made illegal memory accesses on the H200 (the NOTE in
    lily/ops/deltanet_recurrence.py; the GPU test below is the behaviour)."""
    from lily.ops import deltanet_recurrence as rec

    kernels = [rec._chunk_wy_kernel, rec._chunk_scan_kernel, rec._chunk_state_kernel,
               rec._chunk_out_kernel]  # fmt: skip
    for k in kernels:
        if hasattr(k.fn, "params"):  # compiled: Triton's JITFunction
            (t,) = [p for p in k.fn.params if p.name == "T"]
            assert t.do_not_specialize, k.fn
        else:  # the interpreter keeps the decorator's keywords
            assert "T" in k.fn.kwargs["do_not_specialize"], k.fn


@pytest.mark.skipif(DEVICE != "cuda", reason="compiled sm_90 code (the interpreter does not "
                    "specialize ints); test_chunked_kernels_never_specialize_the_token_count "
                    "checks the cause on the CPU")  # fmt: skip
@pytest.mark.parametrize(
    "t,cuts,method",
    [
        (1, (), "chunk"),
        (1, (), "chunk_par"),
        (4, (1, 2), "chunk"),
        (5, (1, 3), "chunk"),
        (9, (1, 5), "chunk_par"),
    ],  # fmt: skip
    ids=["1-chunk", "1-chunk_par", "4-cuts-1-2", "5-cuts-1-3", "9-cuts-1-5-par"],
)
def test_prefill_one_token_pieces_cuda(t, cuts, method):
    """At the model's head sizes (Hk 16, Hv 32, K = Vd = 128, chunks of 64), a chunk whose
    recurrence runs a one-token piece (a 1-token chunk, or cuts at 1 and later: a fresh
    4-token chat prompt) matches the fp32 reference, output and state at each cut. On the
    H200 these faulted (illegal memory access) while T = 1 was specialized."""
    d = make_inputs(t, dtype=torch.bfloat16, seed=11, hk=16, hv=32, kd=128, vd=128)
    snaps: list = []
    out, cs, st = run_prefill(d, method, chunk_size=64, cuts=cuts, snaps=snaps)
    torch.cuda.synchronize()
    ref_out, ref_cs, ref_st = reference(d)
    assert rel(out, ref_out) < 1.5e-2 and rel(st, ref_st) < 2e-2
    assert len(snaps) == len(cuts)
    for c, (_, rec) in zip(cuts, snaps, strict=True):
        head = {k: (v[:c] if k in ("mixed_qkv", "z", "b", "a") else v) for k, v in d.items()}
        assert rel(rec, reference(head)[2]) < 2e-2, c
