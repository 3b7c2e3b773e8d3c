"""The poisoned-allocation fixture the kernel tests share."""

from __future__ import annotations

import pytest


@pytest.fixture
def poison(poison_empty):
    """Every torch.empty made while the test runs is filled with NaN (floats) or -1 (ints),
    so any output element a kernel fails to write shows up."""
    poison_empty(int_value=-1, like=False)
