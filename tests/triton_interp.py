"""Fixes for Triton 3.6 interpreter defects, applied once for the whole test session."""

from __future__ import annotations


def fix_triton_interpreter() -> None:
    """Work around three Triton 3.6 interpreter defects (the GPU compiler is not affected):
    loop bounds that are kernel arguments fail with NumPy >= 2 (size-1 arrays lose
    ``__index__``); ``tl.dot`` multiplies bf16 operands as their raw uint16 bits; and
    fp32 -> bf16 casts truncate where the GPU rounds to nearest even."""
    import numpy as np
    import triton.language as tl
    import triton.runtime.interpreter as interp

    if getattr(interp, "_lily_fixed", False):
        return
    patch_tensor = interp._patch_lang_tensor

    def patched_tensor(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    def bf16_to_f32(h):
        if h.dtype == tl.bfloat16:
            return interp.TensorHandle(
                (h.data.astype(np.uint32) << 16).view(np.float32), tl.float32
            )
        return h

    create_dot = interp.InterpreterBuilder.create_dot

    def dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return create_dot(
            self, bf16_to_f32(a), bf16_to_f32(b), d, input_precision, max_num_imprecise_acc
        )

    cast_impl = interp.InterpreterBuilder.cast_impl

    def cast(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = np.ascontiguousarray(src.data, dtype=np.float32).view(np.uint32)
            rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            rounded = np.where(np.isnan(src.data), 0x7FC0, rounded).astype(np.uint16)
            return interp.TensorHandle(rounded, tl.bfloat16)
        return cast_impl(self, src, dst_type)

    interp._patch_lang_tensor = patched_tensor
    interp.InterpreterBuilder.create_dot = dot
    interp.InterpreterBuilder.cast_impl = cast
    interp._lily_fixed = True
