"""Long contexts for the fp32 reference in seconds: the gated delta rule by chunks.

The reference DeltaNet (lily/model/deltanet.py) steps token by token: about 70 us a token
and layer on a GPU, a minute for 32K tokens over 30 layers. The fidelity checks only need
the state a context leaves, so ``fast_deltanet`` swaps in the same recurrence computed a
chunk at a time (same maths in fp32; the order of sums differs, ~1e-6 relative). The
tokens that are compared always run through the token-by-token scan.

Chunk form (per value head, chunk of C tokens, state S (K, Vd), cum = cumsum of g, so the
decay from token s to t is exp(cum_t - cum_s)): every update adds k_s u_s^T, with
pseudo-values U solving (I + A) U = diag(beta) (V - diag(exp(cum)) K S), A[t, s] =
beta_t exp(cum_t - cum_s) k_t.k_s for s < t; then O = diag(exp(cum)) Q S +
(M * Q K^T) U with M[t, s] = exp(cum_t - cum_s) for s <= t, and the state becomes
exp(cum_C) S + K^T diag(exp(cum_C - cum)) U.
"""

from __future__ import annotations

import contextlib

import torch

import lily.model.deltanet as _deltanet


def chunked_delta_scan(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int = 64,
) -> torch.Tensor:
    """``gated_delta_scan``'s contract (q, k (T, Hv, K), v (T, Hv, Vd), g, beta (T, Hv),
    state (Hv, K, Vd) updated in place; returns o (T, Hv, Vd) fp32), by chunks."""
    s = state
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    for t0 in range(0, v.shape[0], chunk):
        t1 = min(v.shape[0], t0 + chunk)
        # (H, C, .) per head
        qc, kc = q[t0:t1].float().transpose(0, 1), k[t0:t1].float().transpose(0, 1)
        vc = v[t0:t1].float().transpose(0, 1)
        gc, bc = g[t0:t1].float().T, beta[t0:t1].float().T  # (H, C)
        cum = gc.cumsum(-1)
        c = cum.shape[-1]
        diff = cum[:, :, None] - cum[:, None, :]  # (H, C, C): cum_t - cum_s
        lower = torch.ones(c, c, dtype=torch.bool, device=v.device).tril()
        decay = torch.where(lower, diff, float("-inf")).exp()  # s <= t
        kk = kc @ kc.transpose(1, 2)
        a = (bc[:, :, None] * decay * kk).tril(-1)
        rhs = bc[:, :, None] * (vc - cum.exp()[:, :, None] * (kc @ s))
        eye = torch.eye(c, device=v.device)
        u = torch.linalg.solve_triangular(eye + a, rhs, upper=False, unitriangular=True)
        o = cum.exp()[:, :, None] * (qc @ s) + (decay * (qc @ kc.transpose(1, 2))) @ u
        out[t0:t1] = o.transpose(0, 1)
        last = cum[:, -1:]
        s.mul_(last.exp()[:, :, None])
        s.add_(kc.transpose(1, 2) @ ((last - cum).exp()[:, :, None] * u))
    return out


@contextlib.contextmanager
def fast_deltanet(chunk: int = 64):
    """Within the block, the reference DeltaNet layers scan by chunks (``chunked_delta_scan``)."""
    # NOTE: deltanet_layer looks the scan up in its module at call time; if the model code
    # stops doing so, this swap would silently not apply: fail loudly instead.
    if not hasattr(_deltanet, "gated_delta_scan"):
        raise RuntimeError("lily.model.deltanet.gated_delta_scan is gone: update fast_context")
    original = _deltanet.gated_delta_scan

    def scan(q, k, v, g, beta, state, cuts=()):
        if cuts:  # states mid-chunk: the token scan takes them
            return original(q, k, v, g, beta, state, cuts)
        rep = v.shape[1] // k.shape[1]  # the reference passes one key head per pair
        q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
        return chunked_delta_scan(q, k, v, g, beta, state, chunk=chunk), []

    _deltanet.gated_delta_scan = scan
    try:
        yield
    finally:
        _deltanet.gated_delta_scan = original
