"""MoE decode and prefill kernels against the plain-PyTorch reference (docs MODEL.md maths).

Under the Triton interpreter when there is no CUDA (see test_qlinear_ops.py). Small odd
shapes: E=5 experts (also 12 with top-8), I=64, shared Is=128, D=192, T=13 and 37 tokens.
Bounds (relative L2 of the MoE output, residual removed): fp32 decode 1e-4 (fp32 all
through); bf16 in or out, or prefill (bf16 tensor-core operands, h and y stored in bf16)
2e-2, where ~5e-3 is seen.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import triton
import triton.language as tl

if not torch.cuda.is_available():
    # Kernels are built at import; tests/conftest.py normally sets this first.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from lily.model.norm import rms_norm  # noqa: E402
from lily.model.ref import ref_moe, ref_qlinear, ref_route  # noqa: E402
from lily.ops.moe_decode import moe_decode  # noqa: E402
from lily.ops.moe_decode_config import MoeDecodeConfig  # noqa: E402
from lily.ops.moe_decode_parts import topk_rows  # noqa: E402
from lily.ops.moe_prefill import MoePrefillConfig, moe_prefill, moe_prefill_config  # noqa: E402
from lily.ops.qgemm import GemmConfig  # noqa: E402
from lily.quant import quantize  # noqa: E402
from tests.ops.common import rel_err, replayed  # noqa: E402

DEVICES = ["cuda"] if torch.cuda.is_available() else ["cpu"]
D, I_E, I_S = 192, 64, 128


def make_moe(e: int, bits: int, gs: int, shared: bool, seed: int, device: str, d: int = D,
             i_e: int = I_E, i_s: int = I_S) -> dict:  # fmt: skip
    g = torch.Generator().manual_seed(seed)

    def q(shape, b=bits):
        return quantize(torch.randn(shape, generator=g) / shape[-1] ** 0.5, b, gs).to(device)

    w = {
        # Logits of order 1: a soft softmax, so every routing weight matters.
        "router": quantize(torch.randn(e, d, generator=g) / d**0.5, 8, gs).to(device),
        "gate": q((e, i_e, d)),
        "up": q((e, i_e, d)),
        "down": q((e, d, i_e)),
        "shared_gate": None,
        "shared_up": None,
        "shared_down": None,
        "shared_expert_gate": None,
    }
    if shared:
        w |= {
            "shared_gate": q((i_s, d)),
            "shared_up": q((i_s, d)),
            "shared_down": q((d, i_s)),
            "shared_expert_gate": q((1, d), 8),
        }
    return w


def moe_err(y: torch.Tensor, w: dict, x: torch.Tensor, k: int, res: torch.Tensor) -> float:
    ref = ref_moe(x, *w.values(), k, res)
    return rel_err(y.float() - res.float(), ref - res.float())


# Wider tiles keep the interpreter quick (fewer programs); the default table elsewhere.
WIDE = MoeDecodeConfig(router_rows=8, shared_rows=32, gate_up_rows=32, down_rows=32)
ODD = MoeDecodeConfig(router_rows=2, shared_rows=16, gate_up_rows=16, down_rows=16,
                      num_warps=2, down_warps=2)  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "e,k,bits,gs,shared,dtype,norm,cfg,bound",
    [
        (5, 2, 4, 64, True, torch.float32, False, None, 1e-4),
        (5, 3, 8, 32, False, torch.float32, True, ODD, 1e-4),
        (12, 8, 4, 32, True, torch.bfloat16, False, WIDE, 2e-2),
        (12, 8, 4, 64, True, torch.bfloat16, True, WIDE, 2e-2),
    ],
    ids=[
        "4b-g64-shared-fp32",
        "8b-g32-k3-fp32-norm",
        "4b-g32-e12-k8-bf16",
        "4b-g64-e12-k8-bf16-norm",
    ],  # fmt: skip
)
def test_moe_decode_matches_reference(
    poison, device, e, k, bits, gs, shared, dtype, norm, cfg, bound
):  # fmt: skip
    """One token, router to residual. With ``norm``: the MoE of rmsnorm(x) * w_norm, the
    residual the un-normed x (a decoder layer's post-attention half); reference: the
    model's unfused rms_norm, then ref_moe."""
    w = make_moe(e, bits, gs, shared, seed=e * k + bits, device=device)
    g = torch.Generator().manual_seed(1)
    x = (2.0 * torch.randn(D, generator=g) + 0.3).to(device, dtype)
    res = torch.randn(D, generator=g).to(device, dtype)
    if norm:
        nw = (1.0 + 0.2 * torch.randn(D, generator=g)).to(device, torch.bfloat16)
        y = moe_decode(x, *w.values(), k, res, norm_weight=nw, eps=1e-5, config=cfg)
        h = rms_norm(x, nw, 1e-5)
    else:
        y = moe_decode(x, *w.values(), k, res, config=cfg)
        h = x
    assert y.shape == (D,) and y.dtype == dtype
    assert moe_err(y, w, h, k, res) < bound
    if norm:  # the norm must matter (x is far from unit RMS)
        assert moe_err(y, w, x, k, res) > 0.1


FMA = MoeDecodeConfig(mma=False)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "d,i_e,i_s,gs,e,k,dtype,cfg",
    [
        (192, 64, 128, 64, 5, 2, torch.bfloat16, FMA),
        (192, 64, 128, 64, 5, 2, torch.bfloat16, MoeDecodeConfig()),
        (224, 96, 160, 32, 6, 3, torch.float16, MoeDecodeConfig(mma_rows=64, mma_warps=4)),
        (256, 128, 0, 128, 9, 4, torch.float32, MoeDecodeConfig(mma_rows=32, mma_warps=2)),
    ],
    ids=["fma-4b", "mma-4b", "mma-odd-g32-k3-fp16-n64", "mma-g128-k4-fp32-noshared"],
)
def test_moe_decode_tensor_core_path(poison, monkeypatch, device, d, i_e, i_s, gs, e, k, dtype,
                                     cfg):  # fmt: skip
    """The routed experts on the tensor cores (qgemv_mma's tile, K as slots of the chosen
    experts in the down launch) against the reference, and the path actually taken: odd
    shapes give a K of 7 groups (padded to 8), 3 groups an expert (k * 3 = 9 of 16 in the
    down launch), row blocks past D and I, groups of 32 and 128, fp16/fp32 x (2 and 3 bf16
    terms) and fp32 h; with the norm fused."""
    import lily.ops.moe_decode as mod

    taken = []
    real = mod.moe_mma_experts
    monkeypatch.setattr(mod, "moe_mma_experts", lambda *a: taken.append(1) or real(*a))
    w = make_moe(e, 4, gs, i_s > 0, seed=d + k, device=device, d=d, i_e=i_e, i_s=i_s)
    g = torch.Generator().manual_seed(5)
    x = (2.0 * torch.randn(d, generator=g) + 0.3).to(device, dtype)
    res = torch.randn(d, generator=g).to(device, dtype)
    nw = (1.0 + 0.2 * torch.randn(d, generator=g)).to(device, torch.bfloat16)
    y = moe_decode(x, *w.values(), k, res, norm_weight=nw, eps=1e-5, config=cfg)
    assert taken == ([1] if cfg.mma else [])
    bound = 1e-4 if dtype == torch.float32 else 2e-2
    assert moe_err(y, w, rms_norm(x, nw, 1e-5), k, res) < bound


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cfg", [FMA, MoeDecodeConfig(mma_rows=32)], ids=["fma", "mma"])
def test_moe_decode_rows_equal_each_row_alone(poison, device, cfg):
    """Three rows in one call (a batched decode step: each launch's grid once a row) against
    each row alone, bit for bit (the same programs on the same values), and against the
    reference; rows differ in x, residual and so routing; the norm fused."""
    w = make_moe(7, 4, 64, True, seed=33, device=device)
    g = torch.Generator().manual_seed(4)
    x = (2.0 * torch.randn(3, D, generator=g) + 0.3).to(device, torch.bfloat16)
    res = torch.randn(3, D, generator=g).to(device, torch.bfloat16)
    nw = (1.0 + 0.2 * torch.randn(D, generator=g)).to(device, torch.bfloat16)
    y = moe_decode(x, *w.values(), 3, res, norm_weight=nw, eps=1e-5, config=cfg)
    assert y.shape == (3, D) and y.dtype == torch.bfloat16
    for r in range(3):
        alone = moe_decode(x[r], *w.values(), 3, res[r], norm_weight=nw, eps=1e-5, config=cfg)
        assert torch.equal(y[r], alone), r
        assert moe_err(y[r], w, rms_norm(x[r], nw, 1e-5), 3, res[r]) < 2e-2
    logits = ref_qlinear(rms_norm(x, nw, 1e-5).float(), w["router"])
    ids = ref_route(logits, 3)[1]
    assert len({tuple(sorted(i.tolist())) for i in ids}) > 1  # the rows are routed apart


ROUTE_ONCE = MoeDecodeConfig(router_rows=2, mma_rows=32, route_once=True)


def _launched(fn) -> dict:
    """{kernel name: its constexprs} of the launches ``fn()`` would make."""
    from lily.ops.launch import record_launches

    with record_launches() as rec:
        fn()
    return {getattr(r[0].fn, "fn", r[0].fn).__name__: r[3] for r in rec}


ROUTE_CASES = pytest.mark.parametrize(
    "b,d,i_e,i_s,gs,e,k,norm",
    [(3, 192, 64, 128, 64, 7, 3, True), (1, 224, 96, 0, 32, 9, 3, False)],
    ids=["3rows-norm-g64", "1row-h-g32-7of8-noshared"],
)


@pytest.mark.parametrize("device", DEVICES)
@ROUTE_CASES
def test_route_once_equals_routing_in_every_program(poison, device, b, d, i_e, i_s, gs, e, k,
                                                    norm):  # fmt: skip
    """route_once (the router launch's last program of a row takes the top-k and prepares
    x') against the same tile routing in every gate/up program: the same output (bit for
    bit under the interpreter, within fp32 rounding of the group sums on the GPU), both
    against the reference; the launches carry the routed form, and the tickets are left
    at zero. Odd shapes: 7 of 8 groups (K padded), a gate/up block past I, 9 experts; the
    norm fused (3 rows) or x' given (one row, no shared expert)."""
    w = make_moe(e, 4, gs, i_s > 0, seed=d + b, device=device, d=d, i_e=i_e, i_s=i_s)
    g = torch.Generator().manual_seed(17)
    x = (2.0 * torch.randn(b, d, generator=g) + 0.3).to(device, torch.bfloat16)
    res = torch.randn(b, d, generator=g).to(device, torch.bfloat16)
    nw = (1.0 + 0.2 * torch.randn(d, generator=g)).to(device, torch.bfloat16) if norm else None
    tickets = torch.zeros(16, dtype=torch.int32, device=device)
    every = dataclasses.replace(ROUTE_ONCE, route_once=False)

    def call(cfg, t=None):
        return moe_decode(x, *w.values(), k, res, norm_weight=nw, eps=1e-5, config=cfg,
                          tickets=t)  # fmt: skip

    kernels = _launched(lambda: call(ROUTE_ONCE, tickets))
    assert kernels["_moe_router_kernel"]["ROUTED"] and kernels["_moe_gate_up_mma_kernel"]["ROUTED"]
    assert not _launched(lambda: call(every))["_moe_router_kernel"]["ROUTED"]
    y, want = call(ROUTE_ONCE, tickets), call(every)
    assert torch.count_nonzero(tickets) == 0
    if device == "cpu":
        assert torch.equal(y, want)
    else:
        assert rel_err(y.float() - res.float(), want.float() - res.float()) < 1e-3
    xn = rms_norm(x, nw, 1e-5) if norm else x
    for r in range(b):
        assert moe_err(y[r], w, xn[r], k, res[r]) < 2e-2, r
    # without a tickets buffer a call makes its own; fp16 x has no one-term operand: the
    # gate/up programs route (route_once is not taken)
    assert torch.equal(call(ROUTE_ONCE), y)
    half = _launched(lambda: moe_decode(x.half(), *w.values(), k, res.half(), norm_weight=nw,
                                        eps=1e-5, config=ROUTE_ONCE))  # fmt: skip
    assert not half["_moe_router_kernel"]["ROUTED"]


@pytest.mark.parametrize("device", DEVICES)
@ROUTE_CASES
def test_down_operand_rounds_only_h(poison, device, b, d, i_e, i_s, gs, e, k, norm):
    """down_operand (gate/up writes h, weighted and bf16, as the down launch's operand)
    against route_once alone: the launches carry it, every row within h's bf16 rounding of
    route_once's (where a wrong slot, group or K order is an O(1) error) and within the
    kernels' bound of the reference. Shapes as above: k * I of 3 groups (4 with padding)
    and 9 groups of 32 (16), a gate/up block past I."""
    w = make_moe(e, 4, gs, i_s > 0, seed=d + b, device=device, d=d, i_e=i_e, i_s=i_s)
    g = torch.Generator().manual_seed(19)
    x = (2.0 * torch.randn(b, d, generator=g) + 0.3).to(device, torch.bfloat16)
    res = torch.randn(b, d, generator=g).to(device, torch.bfloat16)
    nw = (1.0 + 0.2 * torch.randn(d, generator=g)).to(device, torch.bfloat16) if norm else None
    hop = dataclasses.replace(ROUTE_ONCE, down_operand=True)

    def call(cfg):
        return moe_decode(x, *w.values(), k, res, norm_weight=nw, eps=1e-5, config=cfg)

    kernels = _launched(lambda: call(hop))
    assert kernels["_moe_gate_up_mma_kernel"]["H_OP"] and kernels["_moe_down_mma_kernel"]["H_OP"]
    assert not _launched(lambda: call(ROUTE_ONCE))["_moe_down_mma_kernel"]["H_OP"]
    y, once = call(hop), call(ROUTE_ONCE)
    xn = rms_norm(x, nw, 1e-5) if norm else x
    for r in range(b):
        assert rel_err(y[r].float() - res[r].float(), once[r].float() - res[r].float()) < 5e-3
        assert moe_err(y[r], w, xn[r], k, res[r]) < 2e-2, r
    with pytest.raises(ValueError, match="down_operand needs route_once"):
        MoeDecodeConfig(down_operand=True)


@pytest.mark.parametrize("device", DEVICES)
def test_route_once_tickets_serve_every_layer_and_replay(device):
    """Two layers' route_once calls (the second with down_operand) sharing one tickets
    buffer, captured in one CUDA graph with programmatic dependent launch and replayed on
    new rows (eager on the CPU): each
    layer routes its own rows right every time (a ticket left off zero would route no row,
    or the wrong one), and the tickets end at zero."""
    ws = [make_moe(8, 4, 64, True, seed=s, device=device) for s in (61, 62)]
    g = torch.Generator().manual_seed(63)
    xs = [torch.randn(2, D, generator=g).bfloat16().to(device) for _ in range(3)]
    nw = (1.0 + 0.2 * torch.randn(D, generator=g)).bfloat16().to(device)
    x = xs[0].clone()
    tickets = torch.zeros(16, dtype=torch.int32, device=device)
    hop = dataclasses.replace(ROUTE_ONCE, down_operand=True)

    def call():
        h = moe_decode(x, *ws[0].values(), 2, x, norm_weight=nw, config=ROUTE_ONCE, pdl=True,
                       tickets=tickets)  # fmt: skip
        return h, moe_decode(h, *ws[1].values(), 2, h, norm_weight=nw, config=hop, pdl=True,
                             tickets=tickets)  # fmt: skip

    for xi, (h, out) in replayed(call, x, xs):
        assert torch.count_nonzero(tickets) == 0
        for r in range(2):
            assert moe_err(h[r], ws[0], rms_norm(xi[r], nw, 1e-6), 2, xi[r]) < 2e-2
            assert moe_err(out[r], ws[1], rms_norm(h[r], nw, 1e-6), 2, h[r]) < 2e-2


@pytest.mark.parametrize("device", DEVICES)
def test_the_route_entry_over_layers_at_the_tiny_model_shapes(device):
    """The batched step's 4-row entry (lily/model/ops.py MOE_ROWS_CONFIGS: route_once,
    down_operand and down_early, gate/up n32 w8, down n16 w4) at the tiny model's MoE
    shapes (D 128 in 2 groups, 8 experts, top 2, I and the shared I 64, one router program a
    row), four layers in a row as a step runs them (one tickets buffer, PDL, one CUDA graph
    on the GPU), replayed on new rows: every layer's every row against the reference MoE of
    its input. The op alone, as the plain tiny model's batched step runs it (that step is
    judged on the conditioned model: tests/runtime/test_batch_decode.py)."""
    from lily.model.ops import MOE_ROWS_CONFIGS

    cfg = MOE_ROWS_CONFIGS[4]
    assert cfg.route_once and cfg.down_operand and cfg.down_early
    ws = [make_moe(8, 4, 64, True, seed=80 + j, device=device, d=128, i_e=64, i_s=64)
          for j in range(4)]  # fmt: skip
    g = torch.Generator().manual_seed(81)
    xs = [(2.0 * torch.randn(4, 128, generator=g)).bfloat16().to(device) for _ in range(3)]
    nw = (1.0 + 0.2 * torch.randn(128, generator=g)).bfloat16().to(device)
    x = xs[0].clone()
    tickets = torch.zeros(16, dtype=torch.int32, device=device)

    def step():
        hs = [x]
        for w in ws:
            hs.append(moe_decode(hs[-1], *w.values(), 2, hs[-1], norm_weight=nw, config=cfg,
                                 pdl=True, tickets=tickets))  # fmt: skip
        return hs[1:]

    for xi, outs in replayed(step, x, xs):
        assert torch.count_nonzero(tickets) == 0
        ins = [xi, *outs[:-1]]
        for j, (w, h, y) in enumerate(zip(ws, ins, outs, strict=True)):
            for r in range(4):
                assert moe_err(y[r], w, rms_norm(h[r], nw, 1e-6), 2, h[r]) < 2e-2, (j, r)


def _same_over_layers(device: str, b: int, seed: int, form, base) -> dict:
    """MoE configs ``form`` and ``base`` each over the same layers in a row (4 on the GPU,
    2 under the interpreter), under PDL in one CUDA graph (eager on the CPU), replayed on
    new rows of ``b``: ``form``'s output bit for bit ``base``'s at every layer, every row
    against the reference MoE of its input, the tickets left at zero. Odd shapes, groups
    of 32: D 192 (6 groups, padded to 8), I 96 (3 blocks of 32; a down K of 9 groups,
    padded to 16), 9 experts, top 3. Returns ``form``'s launches' constexprs by kernel."""
    n = 4 if device == "cuda" else 2
    ws = [make_moe(9, 4, 32, True, seed=seed + j, device=device, d=192, i_e=96, i_s=64)
          for j in range(n)]  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    xs = [(2.0 * torch.randn(b, 192, generator=g)).bfloat16().to(device) for _ in range(3)]
    nw = (1.0 + 0.2 * torch.randn(192, generator=g)).bfloat16().to(device)
    x = xs[0].clone()
    tickets = torch.zeros(16, dtype=torch.int32, device=device)

    def layers(cfg):
        hs = [x]
        for w in ws:
            hs.append(moe_decode(hs[-1], *w.values(), 3, hs[-1], norm_weight=nw, config=cfg,
                                 pdl=True, tickets=tickets))  # fmt: skip
        return hs[1:]

    kernels = _launched(lambda: layers(form))
    for xi, (outs, want) in replayed(lambda: (layers(form), layers(base)), x, xs):
        assert torch.count_nonzero(tickets) == 0
        ins = [xi, *outs[:-1]]
        for j in range(n):
            assert torch.equal(outs[j], want[j]), j
            for r in range(b):
                assert moe_err(outs[j][r], ws[j], rms_norm(ins[j][r], nw, 1e-6), 3,
                               ins[j][r]) < 2e-2, (j, r)  # fmt: skip
    return kernels


def _route_entry(device: str) -> MoeDecodeConfig:
    """The batched step's 4-row entry on the GPU; its routing forms on the CPU's tile."""
    from lily.model.ops import MOE_ROWS_CONFIGS

    if device == "cuda":
        return MOE_ROWS_CONFIGS[4]
    return dataclasses.replace(ROUTE_ONCE, down_operand=True, down_early=True)


@pytest.mark.parametrize("device", DEVICES)
def test_down_early_equals_down_operand_over_layers(device):
    """down_early (the down launch loads its experts' tiles before its PDL wait, from the
    ids the router launch wrote two launches back) against the same entry without it, over
    layers in a row (``_same_over_layers``, 3 rows): bit for bit the same (only when the
    loads are issued differs; a tile read before its ids were written is another
    expert's, an O(1) error), and the launch carries it."""
    early = _route_entry(device)
    assert early.down_early
    hop = dataclasses.replace(early, down_early=False)
    assert _same_over_layers(device, 3, 90, early, hop)["_moe_down_mma_kernel"]["EARLY_W"]
    assert not _launched(lambda: moe_decode(
        torch.zeros(2, D, dtype=torch.bfloat16, device=device),
        *make_moe(8, 4, 64, True, seed=1, device=device).values(), 2, config=hop,
    ))["_moe_down_mma_kernel"]["EARLY_W"]  # fmt: skip
    with pytest.raises(ValueError, match="down_early needs down_operand"):
        MoeDecodeConfig(route_once=True, down_early=True)


@pytest.mark.parametrize("device", DEVICES)
def test_moe_decode_replays_on_new_tokens(device):
    """Two tokens through one captured call (a CUDA graph on the GPU, as the decode step
    runs, with programmatic dependent launch; two eager calls on the CPU, where ``pdl`` is a
    no-op): nothing may leak from one call into the next."""
    w = make_moe(8, 4, 64, True, seed=21, device=device)
    g = torch.Generator().manual_seed(9)
    xs = [torch.randn(D, generator=g).bfloat16().to(device) for _ in range(3)]
    nw = (1.0 + 0.2 * torch.randn(D, generator=g)).bfloat16().to(device)
    x = xs[0].clone()

    def call():
        return moe_decode(x, *w.values(), 2, x, norm_weight=nw, config=WIDE, pdl=True)

    for xi, out in replayed(call, x, xs):
        assert moe_err(out, w, rms_norm(xi, nw, 1e-6), 2, xi) < 2e-2


@triton.jit
def _topk_test_kernel(p_l, p_ids, p_wts, E, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr,
                      BLOCK_E: tl.constexpr):  # fmt: skip
    o_r = tl.program_id(0) * 2 + tl.arange(0, 2)
    o_e = tl.arange(0, BLOCK_E)
    o_k = tl.arange(0, BLOCK_K)
    b_l = tl.load(p_l + o_r[:, None] * E + o_e[None, :], mask=(o_e < E)[None, :], other=0.0)
    ids, wts = topk_rows(b_l, E, TOP_K, BLOCK_K)
    p_o = o_r[:, None] * TOP_K + o_k[None, :]
    tl.store(p_ids + p_o, ids, mask=(o_k < TOP_K)[None, :])
    tl.store(p_wts + p_o, wts, mask=(o_k < TOP_K)[None, :])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NaN maths, on purpose
def test_topk_rows_ties_and_nan(device):
    """The routing top-k: against torch's softmax/topk/renormalise on finite rows (E = 11,
    not a power of two; equal logits go to the lowest index), and on rows holding NaN or
    inf it must still pick k distinct experts in 0..E-1: an expert id is an address, and a
    NaN activation used to turn into an illegal memory access in moe_prefill."""
    e, k = 11, 4
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(8, e, generator=g) * 3
    logits[1, [2, 7, 9]] = 50.0  # a three-way tie for the top
    logits[2] = 0.0  # all equal: experts 0..3
    logits[3] = -1e30  # huge negatives: exp underflows in a naive softmax
    logits[4, 3] = float("nan")
    logits[5] = float("nan")
    logits[6, [1, 8]] = float("inf")
    logits[7, 5] = float("-inf")
    ids = torch.full((8, k), -1, dtype=torch.int32, device=device)
    wts = torch.full((8, k), -1.0, device=device)
    _topk_test_kernel[(4,)](logits.to(device), ids, wts, e, TOP_K=k, BLOCK_K=4, BLOCK_E=16)
    ids, wts = ids.cpu().long(), wts.cpu()
    for r in range(8):
        assert len(set(ids[r].tolist())) == k and 0 <= ids[r].min() and ids[r].max() < e, r
    finite = [0, 1, 2, 3, 7]
    ref_w, _ = ref_route(logits[finite], k)
    assert torch.allclose(wts[finite], ref_w, rtol=1e-5, atol=1e-6)
    assert ids[1, :3].tolist() == [2, 7, 9] and ids[2].tolist() == [0, 1, 2, 3]
    order = torch.sort(-logits[[0, 7]], dim=1, stable=True).indices[:, :k]
    assert torch.equal(ids[[0, 7]], order)
    assert set(ids[6, :2].tolist()) == {1, 8}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "bits,gs,shared,block_m,atomic",
    [
        (4, 64, True, 16, False),
        (4, 32, True, 32, True),
        (8, 64, False, 16, False),
    ],
    ids=["4b-g64-shared-m16", "4b-g32-shared-m32-atomic", "8b-g64-m16"],
)
def test_moe_prefill_matches_reference(poison, device, bits, gs, shared, block_m, atomic):
    w = make_moe(5, bits, gs, shared, seed=bits + gs, device=device)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(13, D, generator=g).bfloat16().to(device)
    res = torch.randn(13, D, generator=g).bfloat16().to(device)
    bk = max(64, gs)
    cfg = MoePrefillConfig(block_m, GemmConfig(block_m, 32, bk), GemmConfig(block_m, 64, bk))
    y = moe_prefill(x, *w.values(), 2, res, atomic=atomic, config=cfg)
    assert y.shape == (13, D) and y.dtype == torch.bfloat16
    assert moe_err(y, w, x, 2, res) < 2e-2


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("atomic", [False, True], ids=["slots", "atomic"])
def test_moe_prefill_with_the_next_norm(poison, device, atomic):
    """With norm_weight the output is unchanged and the second result is its RMSNorm (the
    next layer's input), against the reference norm of that output."""
    w = make_moe(5, 4, 64, True, seed=7, device=device)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(11, D, generator=g).bfloat16().to(device)
    res = torch.randn(11, D, generator=g).bfloat16().to(device)
    nw = (1.0 + 0.3 * torch.randn(D, generator=g)).bfloat16().to(device)
    cfg = MoePrefillConfig(16, GemmConfig(16, 32, 64), GemmConfig(16, 64, 64))
    plain = moe_prefill(x, *w.values(), 2, res, atomic=atomic, config=cfg)
    y, h = moe_prefill(x, *w.values(), 2, res, atomic=atomic, config=cfg, norm_weight=nw,
                       eps=1e-5)  # fmt: skip
    if not atomic:  # atomics add in a varying order: only the slot sum is bit-stable
        assert torch.equal(y, plain)
    assert moe_err(y, w, x, 2, res) < 2e-2
    assert h.shape == y.shape and h.dtype == y.dtype
    assert rel_err(h.float(), rms_norm(y, nw, 1e-5).float()) < 4e-3
    with pytest.raises(ValueError, match="norm_weight"):
        moe_prefill(x, *w.values(), 2, res, config=cfg, norm_weight=nw[:-1])


@pytest.mark.parametrize("device", DEVICES)
def test_moe_prefill_skewed_routing_and_empty_experts(poison, device):
    """Every token picks experts 0 and 1: 37 rows each (three 16-row tiles, one partial),
    experts 2..4 get no rows, and most of the worst-case block map stays empty."""
    w = make_moe(5, 4, 64, True, seed=11, device=device)
    g = torch.Generator().manual_seed(3)
    u = torch.randn(D, generator=g)
    router = torch.randn(5, D, generator=g) * 0.05
    router[0] += u
    router[1] += 0.8 * u
    w["router"] = quantize(router, 8, 64).to(device)
    x = (torch.randn(37, D, generator=g) * 0.3 + u).bfloat16().to(device)
    _, ids = ref_route(ref_qlinear(x, w["router"]), 2)
    assert set(ids.flatten().tolist()) == {0, 1}, "the test router must be skewed"
    cfg = MoePrefillConfig(16, GemmConfig(16, 32, 64), GemmConfig(16, 64, 64))
    y = moe_prefill(x, *w.values(), 2, None, config=cfg)
    assert rel_err(y, ref_moe(x, *w.values(), 2)) < 2e-2


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NaN maths, on purpose
def test_moe_prefill_nan_tokens_stay_contained(poison, device):
    """Tokens whose activations are NaN (or inf) must not disturb the plan: before the
    integer-key top-k, a NaN row's experts came out as E (out of range), so the expert
    histogram lost rows, some (token, slot) pairs were never scattered and their rows read
    garbage indices: the 32K-token prefill's illegal memory access. Every other token must
    still match the reference exactly as without the bad rows."""
    w = make_moe(5, 4, 64, True, seed=13, device=device)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(37, D, generator=g).bfloat16()
    res = torch.randn(37, D, generator=g).bfloat16()
    bad = [0, 16, 17, 36]  # tile edges, the first and the last token
    x[bad[:3]] = float("nan")
    x[bad[3], 5] = float("inf")
    cfg = MoePrefillConfig(16, GemmConfig(16, 32, 64), GemmConfig(16, 64, 64))
    y = moe_prefill(x.to(device), *w.values(), 2, res.to(device), config=cfg).cpu()
    good = [t for t in range(37) if t not in bad]
    w_cpu = {n: (v.to("cpu") if v is not None else None) for n, v in w.items()}
    ref = ref_moe(x[good], *w_cpu.values(), 2, res[good])
    assert rel_err(y[good].float() - res[good].float(), ref - res[good].float()) < 2e-2
    assert torch.isnan(y[bad[:3]]).all()


@pytest.mark.parametrize("device", DEVICES)
def test_moe_prefill_repeated_calls_skewed(poison, device):
    """Calls of different T in a row (as prefill chunks run) with routing as skewed as it
    gets: every token on the same two experts (70 rows each: five 16-row tiles, the last
    partial), then a short call, then one where tokens split between two expert pairs.
    Nothing may carry over between calls, and T is never a multiple of the tile."""
    w = make_moe(5, 4, 64, False, seed=17, device=device)
    g = torch.Generator().manual_seed(8)
    u, v = torch.randn(D, generator=g), torch.randn(D, generator=g)
    router = torch.randn(5, D, generator=g) * 0.02
    router[0] += u
    router[1] += 0.9 * u
    router[3] += v
    router[4] += 0.9 * v
    w["router"] = quantize(router, 8, 64).to(device)
    cfg = MoePrefillConfig(16, GemmConfig(16, 32, 64), GemmConfig(16, 64, 64))
    for t, mix in ((70, 1.0), (5, 1.0), (45, 0.5)):
        z = torch.randn(t, D, generator=g) * 0.2
        pick = torch.rand(t, 1, generator=g) < mix
        x = (z + torch.where(pick, u, v) * 1.5).bfloat16()
        _, ids = ref_route(ref_qlinear(x, w["router"].to("cpu")), 2)
        hot = {0, 1} if mix == 1.0 else {0, 1, 3, 4}
        assert set(ids.flatten().tolist()) == hot, "the test router must be skewed"
        y = moe_prefill(x.to(device), *w.values(), 2, None, config=cfg)
        w_cpu = {n: (v_.to("cpu") if v_ is not None else None) for n, v_ in w.items()}
        assert rel_err(y, ref_moe(x, *w_cpu.values(), 2)) < 2e-2, t


@pytest.mark.parametrize("device", DEVICES)
def test_moe_prefill_fp32_input_no_shared_top3(poison, device):
    """fp32 activations in and out, no shared expert, an odd top-k, the default tile table."""
    w = make_moe(5, 4, 64, False, seed=5, device=device)
    x = torch.randn(13, D, generator=torch.Generator().manual_seed(4)).to(device)
    y = moe_prefill(x, *w.values(), 3)
    assert y.dtype == torch.float32
    assert rel_err(y, ref_moe(x, *w.values(), 3)) < 2e-2


def test_prefill_tile_table_follows_rows_per_expert():
    """BLOCK_M grows with the mean rows per expert (T*k/E): 16 rows at 512 tokens, 64 at 2K."""
    assert moe_prefill_config(512, 8, 256).block_m == 16
    assert moe_prefill_config(2048, 8, 256).block_m == 64
    assert moe_prefill_config(1128, 8, 256).block_m == 64  # 35 rows: measured faster than 32
    assert moe_prefill_config(600, 8, 256).block_m == 16  # 19 rows
    assert moe_prefill_config(8192, 8, 256).block_m == 128
    for t in (1, 100, 512, 1000, 2048, 8192, 65536):
        cfg = moe_prefill_config(t, 8, 256)
        assert cfg.gate_up.block_k % 64 == 0 and cfg.down.block_k % 64 == 0


def test_moe_bad_inputs_give_clear_errors():
    w = make_moe(5, 4, 64, True, seed=6, device="cpu")
    x = torch.randn(D).bfloat16()
    args = list(w.values())
    with pytest.raises(ValueError, match="top_k"):
        moe_decode(x, *args, 6)
    with pytest.raises(ValueError, match="one token"):
        moe_decode(x[None, None], *args, 2)
    with pytest.raises(ValueError, match="all of shared"):
        moe_decode(x, *args[:4], None, *args[5:], 2)
    with pytest.raises(ValueError, match="tickets must be contiguous int32"):
        moe_decode(x, *args, 2, config=ROUTE_ONCE, tickets=torch.zeros(1, dtype=torch.int64))
    with pytest.raises(ValueError, match="expert shapes"):
        moe_prefill(x[None], args[0], args[1], args[2], args[1], *args[4:], 2)
    with pytest.raises(ValueError, match="residual"):
        moe_prefill(x[None], *args, 2, torch.zeros(2, D))
    with pytest.raises(ValueError, match="inputs"):
        moe_prefill(torch.randn(3, D + 1), *args, 2)
