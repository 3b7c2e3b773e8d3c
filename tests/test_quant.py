"""lily.quant.quantize against mlx.core.quantize, and quantize-at-load against mlx_lm.convert.

Both are byte-for-byte comparisons: the packed words, the scales and the biases.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import torch

from lily.config import ModelConfig
from lily.quant import QuantWeight, dequantize, quantize
from lily.weights import load_params

_MX_DTYPES = {torch.bfloat16: mx.bfloat16, torch.float32: mx.float32}


def _to_mx(t: torch.Tensor) -> mx.array:
    return mx.array(t.float().numpy()).astype(_MX_DTYPES[t.dtype])


def _bits_of(a: mx.array) -> np.ndarray:
    """Exact bit pattern of an mx array (bf16 widens to fp32 exactly)."""
    if a.dtype == mx.uint32:
        return np.array(a).view(np.int32)
    return np.array(a.astype(mx.float32)).view(np.int32)


def _torch_bits(t: torch.Tensor) -> np.ndarray:
    return t.float().numpy().view(np.int32) if t.is_floating_point() else t.numpy()


def _awkward(shape: tuple[int, ...], group: int, g: torch.Generator) -> torch.Tensor:
    """Normal weights plus the groups where rounding choices matter."""
    w = torch.randn(shape, generator=g) * 0.05
    flat = w.view(-1, shape[-1])
    flat[0, :group] = 0.3  # constant group: zero range
    flat[1, :group] = -torch.rand(group, generator=g)  # all negative
    flat[2, :group] = torch.rand(group, generator=g)  # all positive
    flat[3, :group] *= 1e-6  # tiny range, scale clamps at eps
    flat[4, 0] = 5.0  # one outlier dominates its group
    flat[5, 0] = -5.0
    return w


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("group", [32, 64])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("shape", [(33, 192), (3, 7, 128)], ids=["2d", "3d"])
def test_quantize_equals_mlx(shape, bits, group, dtype):
    g = torch.Generator().manual_seed(bits * 100 + group)
    w = _awkward(shape, group, g).to(dtype)
    ours = quantize(w, bits=bits, group_size=group)
    wq, scales, biases = mx.quantize(_to_mx(w), group_size=group, bits=bits)
    assert ours.scales.dtype == dtype and ours.biases.dtype == dtype
    np.testing.assert_array_equal(_torch_bits(ours.qweight), _bits_of(wq))
    np.testing.assert_array_equal(_torch_bits(ours.scales), _bits_of(scales))
    np.testing.assert_array_equal(_torch_bits(ours.biases), _bits_of(biases))
    # and the values decode like mlx's own dequantize
    f32 = mx.float32  # decode in fp32 on both sides (mlx would round to bf16 otherwise)
    ref = mx.dequantize(wq, scales.astype(f32), biases.astype(f32), group_size=group, bits=bits)
    torch.testing.assert_close(
        dequantize(ours, torch.float32), torch.from_numpy(np.array(ref)), rtol=1e-6, atol=1e-7
    )


def _mlx_key(name: str) -> str:
    """Canonical name -> module path in an mlx_lm.convert checkpoint (test's own table)."""
    if name == "lm_head":
        return "language_model.lm_head"
    if not name.startswith("layers."):
        return "language_model.model." + name
    _, i, rest = name.split(".", 2)
    table = {
        "attn.": "self_attn.",
        "dn.": "linear_attn.",
        "moe.router": "mlp.gate",
        "moe.shared_expert_gate": "mlp.shared_expert_gate",
        "moe.shared_gate_proj": "mlp.shared_expert.gate_proj",
        "moe.shared_up_proj": "mlp.shared_expert.up_proj",
        "moe.shared_down_proj": "mlp.shared_expert.down_proj",
        "moe.": "mlp.switch_mlp.",
    }
    for a, b in table.items():
        if rest.startswith(a):
            rest = b + rest[len(a) :]
            break
    return f"language_model.model.layers.{i}.{rest}"


def _mlx_tensors(d) -> dict[str, mx.array]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out |= mx.load(str(f))
    return out


@pytest.mark.parametrize("bits", [4, 8])
def test_quantize_on_load_equals_mlx_lm_convert(bits, hf_fused_dir, mlx4_dir, mlx8_dir):
    mlx_dir = mlx4_dir if bits == 4 else mlx8_dir
    params = load_params(
        hf_fused_dir, ModelConfig.from_dir(hf_fused_dir), quantize_on_load=bits, progress=False
    )
    ref = _mlx_tensors(mlx_dir)
    packed = {_mlx_key(n): w for n, w in params.items() if isinstance(w, QuantWeight)}
    # every linear mlx_lm.convert packed is packed here, and nothing else
    assert set(packed) == {k.removesuffix(".scales") for k in ref if k.endswith(".scales")}
    for key, w in packed.items():
        router = key.endswith(("mlp.gate", "shared_expert_gate"))
        assert (w.bits, w.group_size) == (8 if router else bits, 64), key
        np.testing.assert_array_equal(_torch_bits(w.qweight), _bits_of(ref[key + ".weight"]), key)
        np.testing.assert_array_equal(_torch_bits(w.scales), _bits_of(ref[key + ".scales"]), key)
        np.testing.assert_array_equal(_torch_bits(w.biases), _bits_of(ref[key + ".biases"]), key)
        assert w.scales.dtype == torch.bfloat16  # as stored: the checkpoint is bf16
