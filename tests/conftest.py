"""Tiny checkpoints written by the reference libraries' own writers.

One random tiny model (``lily.checkpoint.TINY_TEXT_CONFIG``) is built with ``transformers``
and saved four ways, so the loader is tested on bytes that no one here laid out:

- ``hf_tiny_dir``: ``save_pretrained`` of ``Qwen3_5MoeForCausalLM`` in fp32 (text-only keys
  ``model.``, one tensor per expert, norm offsets, conv (C, 1, K)).
- ``hf_fused_dir``: the same values in the official layout, bf16: ``model.language_model.``
  keys, fused ``mlp.experts.gate_up_proj`` / ``down_proj``, A_log fp32, config written by
  ``transformers``' ``Qwen3_5MoeConfig``, plus a few vision-tower and ``mtp.*`` tensors
  that loaders must skip (or keep on request).
- ``mlx4_dir``, ``mlx8_dir``: ``mlx_lm.convert`` of ``hf_fused_dir`` (group 64).

Every parameter is rounded to a bf16 value once, so the fp32 and bf16 directories hold
identical numbers and comparisons between them are exact.
"""

from __future__ import annotations

import os

# Without a GPU the Triton kernels run under the interpreter; this must be set before
# any kernel module is imported.
try:
    import torch as _torch

    if not _torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
        from triton_interp import fix_triton_interpreter

        fix_triton_interpreter()
except ImportError:  # pragma: no cover
    pass

from pathlib import Path  # noqa: E402

# LILY_GPU_ARCH=sm_89 runs the tests with that architecture's kernel tables and switches
# (on an H200: the fallback, no PDL, no warpgroup MMA), before any kernel compiles.
if os.environ.get("LILY_GPU_ARCH"):
    from lily.ops.arch import force_arch

    force_arch(os.environ["LILY_GPU_ARCH"])

import pytest  # noqa: E402
import torch  # noqa: E402

# The tiny models' ops are microseconds long: one intra-op thread avoids the thread
# hand-offs that otherwise dominate on a small, shared CPU.
torch.set_num_threads(1)

from optional_deps import mlx_missing  # noqa: E402

from lily.checkpoint import TINY_TEXT_CONFIG  # noqa: E402

SEED = 1234
# Fake tensors of the official checkpoint that the text model does not use.
VISION_KEYS = {"model.visual.patch_embed.proj.weight": (16, 3, 2, 4, 4)}
MTP_KEYS = {"mtp.fc.weight": (128, 256), "mtp.norm.weight": (128,)}


def _write_tokenizer(d: Path, vocab_size: int) -> None:
    from lily.tokenizer_files import write_test_tokenizer

    write_test_tokenizer(d, vocab_size)


def _randomize(model: torch.nn.Module) -> None:
    """Give norms, A_log, dt_bias and conv values that would expose any mishandling."""
    g = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):  # plain multiplier
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("norm.weight"):  # offset from 1
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(1.0, 16.0, generator=g).log())
            elif name.endswith("dt_bias"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith("conv1d.weight"):
                p.copy_(torch.empty(p.shape).uniform_(-0.5, 0.5, generator=g))
            # NOTE: every value made bf16-exact so fp32 and bf16 copies agree bit for bit.
            p.copy_(p.to(torch.bfloat16).float())


@pytest.fixture
def poison_empty(monkeypatch):
    """Call it to make ``torch.empty`` (and ``empty_like`` with ``like``) hand out NaN
    floats, and ``int_value`` in other dtypes (None: left as allocated), until the test
    ends: a kernel that leaves an element unwritten, or reads scratch it never wrote, shows
    it (fresh allocations are often zeros, which hides the fault)."""

    def apply(int_value: int | None = None, like: bool = True) -> None:
        def poisoned(make):
            def alloc(*args, **kwargs):
                t = make(*args, **kwargs)
                if t.is_floating_point():
                    return t.fill_(float("nan"))
                return t if int_value is None else t.fill_(int_value)

            return alloc

        monkeypatch.setattr(torch, "empty", poisoned(torch.empty))
        if like:
            monkeypatch.setattr(torch, "empty_like", poisoned(torch.empty_like))

    return apply


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny_ckpt")


@pytest.fixture(scope="session")
def tiny_hf_model():
    """The transformers model (fp32, eval) that every tiny checkpoint holds."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    torch.manual_seed(SEED)
    cfg = Qwen3_5MoeTextConfig(**TINY_TEXT_CONFIG)
    model = Qwen3_5MoeForCausalLM(cfg).float().eval()
    _randomize(model)
    return model


@pytest.fixture(scope="session")
def hf_tiny_dir(tiny_root, tiny_hf_model) -> Path:
    """transformers ``save_pretrained`` (fp32, per-expert tensors, text-only keys)."""
    d = tiny_root / "hf_fp32"
    tiny_hf_model.save_pretrained(d)
    _write_tokenizer(d, TINY_TEXT_CONFIG["vocab_size"])
    return d


@pytest.fixture(scope="session")
def hf_fused_dir(tiny_root, hf_tiny_dir) -> Path:
    """The official layout in bf16, the input mlx_lm.convert expects."""
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeTextConfig

    d = tiny_root / "hf_fused_bf16"
    d.mkdir()
    src = load_file(hf_tiny_dir / "model.safetensors")
    n_exp = TINY_TEXT_CONFIG["num_experts"]
    out = {}
    for k, v in src.items():
        if ".mlp.experts." in k:
            continue
        key = k if k.startswith("lm_head") else "model.language_model." + k.removeprefix("model.")
        out[key] = v if k.endswith("A_log") else v.to(torch.bfloat16)
    for i in range(TINY_TEXT_CONFIG["num_hidden_layers"]):
        e = f"model.layers.{i}.mlp.experts"
        gate = torch.stack([src[f"{e}.{j}.gate_proj.weight"] for j in range(n_exp)])
        up = torch.stack([src[f"{e}.{j}.up_proj.weight"] for j in range(n_exp)])
        down = torch.stack([src[f"{e}.{j}.down_proj.weight"] for j in range(n_exp)])
        f = f"model.language_model.layers.{i}.mlp.experts"
        out[f + ".gate_up_proj"] = torch.cat([gate, up], dim=1).to(torch.bfloat16)
        out[f + ".down_proj"] = down.to(torch.bfloat16)
    g = torch.Generator().manual_seed(SEED + 1)
    for k, shape in {**VISION_KEYS, **MTP_KEYS}.items():
        out[k] = (0.02 * torch.randn(shape, generator=g)).to(torch.bfloat16)
    save_file(out, d / "model.safetensors", metadata={"format": "pt"})
    text = Qwen3_5MoeTextConfig(**TINY_TEXT_CONFIG, dtype="bfloat16")
    cfg = Qwen3_5MoeConfig(text_config=text.to_dict(), tie_word_embeddings=False)
    cfg.dtype = "bfloat16"
    cfg.save_pretrained(d)
    _write_tokenizer(d, TINY_TEXT_CONFIG["vocab_size"])
    return d


def _mlx_convert(hf_dir: Path, out: Path, bits: int) -> Path:
    if (why := mlx_missing()) is not None:
        pytest.skip(why)
    import mlx_lm

    mlx_lm.convert(str(hf_dir), str(out), quantize=True, q_bits=bits, q_group_size=64)
    _write_tokenizer(out, TINY_TEXT_CONFIG["vocab_size"])
    return out


@pytest.fixture(scope="session")
def mlx4_dir(tiny_root, hf_fused_dir) -> Path:
    """``mlx_lm.convert -q --q-bits 4 --q-group-size 64`` of ``hf_fused_dir``."""
    return _mlx_convert(hf_fused_dir, tiny_root / "mlx4", 4)


@pytest.fixture(scope="session")
def mlx8_dir(tiny_root, hf_fused_dir) -> Path:
    """``mlx_lm.convert -q --q-bits 8 --q-group-size 64`` of ``hf_fused_dir``."""
    return _mlx_convert(hf_fused_dir, tiny_root / "mlx8", 8)
