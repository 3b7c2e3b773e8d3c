"""The packed-table embedding kernel (lily/ops/embedding.py) against the reference
dequantization of the same rows (lily.quant.dequantize), bit for bit."""

from __future__ import annotations

import pytest
import torch

from lily.ops.embedding import embedding_rows
from lily.quant import dequantize, quantize

# the interpreter on the CPU machine; compiled on a GPU
DEVICES = ["cuda"] if torch.cuda.is_available() else ["cpu"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits,group", [(4, 64), (4, 32), (8, 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float32])
def test_embedding_rows_equal_reference_dequantization(device, bits, group, dtype, scale_dtype):
    g = torch.Generator().manual_seed(bits * group)
    table = torch.randn(37, 320, generator=g).to(scale_dtype) * 0.7
    w = quantize(table, bits, group).to(device)
    ids = torch.tensor([36, 0, 5, 5, 17, 36, 2], device=device)
    got = embedding_rows(ids, w, dtype)
    want = dequantize(w[ids.cpu()].to("cpu"), dtype)
    assert got.dtype == dtype and got.shape == (7, 320)
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("device", DEVICES)
def test_embedding_rows_int32_ids_and_empty(device):
    w = quantize(torch.randn(11, 128, generator=torch.Generator().manual_seed(1)), 4, 64)
    w = w.to(device)
    ids = torch.tensor([10, 3], dtype=torch.int32, device=device)
    assert torch.equal(embedding_rows(ids, w, torch.bfloat16).cpu(),
                       dequantize(w[[10, 3]].to("cpu"), torch.bfloat16))  # fmt: skip
    assert embedding_rows(ids[:0], w, torch.bfloat16).shape == (0, 128)


def test_embedding_rows_rejects_bad_input():
    w = quantize(torch.randn(11, 128, generator=torch.Generator().manual_seed(2)), 4, 64)
    with pytest.raises(ValueError, match="dtype must be one of"):
        embedding_rows(torch.tensor([1]), w, torch.float32)
    with pytest.raises(ValueError, match="1-D integer tensor"):
        embedding_rows(torch.tensor([[1]]), w, torch.bfloat16)
    with pytest.raises(ValueError, match="1-D integer tensor"):
        embedding_rows(torch.tensor([1.0]), w, torch.bfloat16)
