"""The standalone RMSNorm kernels against the model's torch rms_norm and plain maths.

Under the Triton interpreter when there is no CUDA. Odd shapes (D = 200, not a power of
two; 3-D input), bf16 and fp32, outputs NaN-poisoned. The kernel rounds like the reference
(fp32 statistics, one rounding to x's dtype), so bf16 results agree to the last bit but for
a rare last-ulp flip (rsqrt vs 1/sqrt): bound 1e-3 relative L2 (a flip is ~4e-3 on one
element of 1,000); fp32: 1e-6.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from lily.model.norm import rms_norm  # noqa: E402
from lily.ops.rmsnorm import add_rmsnorm, rmsnorm  # noqa: E402
from tests.ops.common import rel_err  # noqa: E402

DEVICES = ["cuda"] if torch.cuda.is_available() else ["cpu"]


@pytest.fixture
def poison(poison_empty):
    """torch.empty / empty_like return NaN-filled floats while the test runs."""
    poison_empty()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_rmsnorm_matches_reference(poison, device, dtype):
    g = torch.Generator().manual_seed(1)
    x = (3 * torch.randn(2, 3, 200, generator=g) + 0.5).to(device, dtype)
    w = (1 + 0.2 * torch.randn(200, generator=g)).to(device, torch.bfloat16)
    y = rmsnorm(x, w, 1e-5)
    assert y.shape == x.shape and y.dtype == dtype
    bound = 1e-3 if dtype == torch.bfloat16 else 1e-6
    assert rel_err(y, rms_norm(x, w, 1e-5)) < bound
    # Independent of the model's helper: plain maths in fp64.
    xd = x.double()
    plain = xd / torch.sqrt((xd * xd).mean(-1, keepdim=True) + 1e-5) * w.double()
    assert rel_err(y, plain) < (1e-2 if dtype == torch.bfloat16 else 1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_add_rmsnorm_matches_add_then_norm(poison, device):
    """``s = x + r`` rounded to bf16 as torch's add rounds it, then the norm of s."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(7, 200, generator=g).bfloat16().to(device)
    r = (4 * torch.randn(7, 200, generator=g)).bfloat16().to(device)
    w = (1 + 0.2 * torch.randn(200, generator=g)).bfloat16().to(device)
    s, h = add_rmsnorm(x, r, w, 1e-6)
    assert torch.equal(s.cpu(), (x + r).cpu())
    assert rel_err(h, rms_norm(x + r, w, 1e-6)) < 1e-3
    assert rel_err(h, rms_norm(x, w, 1e-6)) > 0.1  # the residual must matter


def test_rmsnorm_bad_inputs():
    x = torch.randn(3, 16)
    with pytest.raises(ValueError, match="norm_weight"):
        rmsnorm(x, torch.ones(15))
    with pytest.raises(TypeError, match="dtype"):
        rmsnorm(x.double(), torch.ones(16))
    with pytest.raises(ValueError, match="residual"):
        add_rmsnorm(x, torch.randn(2, 16), torch.ones(16))
    assert rmsnorm(torch.zeros(0, 16), torch.ones(16)).shape == (0, 16)
