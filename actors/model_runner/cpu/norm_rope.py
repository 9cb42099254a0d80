"""RMS norm and RoPE as one graph node each (mas_kernels.rms_norm, mas_kernels.rope).

On the CPU, MLX expands mx.fast.rms_norm and mx.fast.rope into their fallbacks: ~10 and ~20
primitive ops each (casts, squares, sums, broadcasts, aranges, cos/sin, concatenations). A Qwen3
decode step has 4 norms and 2 RoPEs per layer: ~650 of the ~1,450 nodes of qwen3-small's
step, and the CPU stream pays a few microseconds per node whatever its size, so at batch 1 they
cost more than the 4-bit weights take to read. The kernels compute the same formulas in one
pass. In float32 the norm gives MLX's bits; RoPE's cos/sin are the C library's (both are
within ~2e-5 of a float64 reference at positions of hundreds, from the float32 angle; they
differ by up to ~3e-4 at positions of thousands with base 1e6). In bfloat16 both give MLX's
bits: its fallbacks' float32 steps, its exp and sin/cos, each result rounded to bf16 where
MLX rounds it (native/src/mlx_math.h), so a bf16 model's greedy tokens stay mlx-lm's.

apply() switches exact nn.RMSNorm and nn.RoPE modules to subclasses that take the kernels for
float32 and bfloat16 inputs (float16 keeps MLX's path); subclasses of them (mlx-lm's own RoPE
variants with frequency tables) are left alone.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

# The compiled kernels module, once apply() was given it.
_kernels: Any = None


KERNEL_DTYPES = (mx.float32, mx.bfloat16)


class KernelRMSNorm(nn.RMSNorm):
    def __call__(self, x: mx.array) -> mx.array:
        weight = self["weight"]
        if x.dtype not in KERNEL_DTYPES or weight.dtype != x.dtype:
            return super().__call__(x)
        return _kernels.rms_norm(x, weight, self.eps)


def offsets_of(offset: int | mx.array) -> mx.array:
    """A RoPE offset as the kernels take it: int32 [1], or [rows] per row."""
    if not isinstance(offset, mx.array):
        return mx.array([offset], dtype=mx.int32)
    # The decode batch's offsets are int32 [n] already: no node added for them.
    offsets = offset if offset.ndim == 1 else offset.reshape(-1)
    return offsets if offsets.dtype == mx.int32 else offsets.astype(mx.int32)


class KernelRoPE(nn.RoPE):
    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        if x.dtype not in KERNEL_DTYPES or x.ndim != 4:
            return super().__call__(x, offset)
        return _kernels.rope(x, self.dims, self.traditional, self.base, self.scale,
                             offsets_of(offset))


def heads_normed_rotated(x: mx.array, norm: nn.Module, rope: nn.Module, heads: int,
                         offset: int | mx.array) -> mx.array:
    """One token per row: x [rows, 1, heads x dim] as [rows, heads, 1, dim], each head
    normed by `norm` and rotated by `rope`: one graph node where both are the kernels' (the
    two nodes' very values), else the modules' own calls."""
    if (_kernels is not None and type(norm) is KernelRMSNorm and type(rope) is KernelRoPE
            and x.dtype in KERNEL_DTYPES and norm["weight"].dtype == x.dtype):
        return _kernels.norm_rope(x, norm["weight"], norm.eps, heads, rope.dims,
                                  rope.traditional, rope.base, rope.scale, offsets_of(offset))
    return rope(norm(x.reshape(x.shape[0], heads, 1, -1)), offset=offset)


_SWAPS = {nn.RMSNorm: KernelRMSNorm, nn.RoPE: KernelRoPE}


def apply(model: nn.Module, kernels: Any) -> int:
    """Switch the model's RMS norms and RoPEs to the kernels. Returns how many modules were
    switched; a second call switches none."""
    global _kernels
    _kernels = kernels
    return swap_classes(model, _SWAPS)


def swap_classes(model: nn.Module, swaps: dict[type, type]) -> int:
    """Switch each module of exactly a class in `swaps` to its subclass there, in place.
    Returns how many were switched (a module switched already is not of the class)."""
    changed = 0
    for _, module in model.named_modules():
        swap = swaps.get(type(module))
        if swap is not None:
            module.__class__ = swap
            changed += 1
    return changed
