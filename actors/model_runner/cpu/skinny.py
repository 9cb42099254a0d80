"""Decode-shaped matmuls on the CPU, computed the fast way round.

A linear layer computes x @ W.T with x [rows, in] and W [out, in]. In decode, rows is the batch
(1-16), and with MKL behind MLX on the CPU that product is slow for rows >= 2: the BLAS packs
the whole transposed weight for a handful of rows. The same product written as (W @ x.T).T lets
the BLAS stream W as the big left operand. Measured on this project's 2-core x86 machine with
MKL (benchmarks/kernels/skinny.py): 1.2-2x faster for 2-128 rows, equal for 1 row, on the attention
and MLP shapes and on the tied 151,936-row LM head. Same math; the sums are ordered
differently, so results can differ from x @ W.T in the last bits (like any change of batch).

Where the compiled kernels are built (weights.py, `runtime.weights = "auto"`), few-row products
go through their float32 matmul instead: one pass over W with x held in registers, where MKL's
GEMM reads W at a fraction of the memory bandwidth. Measured on the 2-core EPYC with MKL
(ms, best of x @ W.T and (W @ x.T).T against the kernel): the tied 151,936 x 512 LM head
42 / 16.8 at 1 row, 59 / 31 at 16, 126 / 91 at 64; 3072 x 1024: 0.61 / 0.28 at 1 row, 1.05 /
0.82 at 16, 3.2 / 2.7 at 64; but 1536 x 512 (3 MiB) only wins at 2-8 rows (0.24 / 0.28 at 16).
So: kernel_rows() rows for a weight, more for large ones.

Only exact nn.Linear and nn.Embedding (tied LM head: as_linear) with float32 weights are
changed, only for inputs of at most MAX_ROWS rows; prefill chunks keep MLX's own path. Layers
with weights in other formats are weights.py's.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

MAX_ROWS = 128
KERNEL_ROWS = 8  # any weight
KERNEL_ROWS_LARGE = 64  # weights of at least LARGE elements (4 MiB)
LARGE = 1 << 20

# The compiled kernels module, once an apply() was given it: products run per layer per step,
# so no import lookup there. Which layers use it is their class's `kernels`.
_kernels: Any = None


def _product(x: mx.array, weight: mx.array, kernels: bool) -> mx.array | None:
    """x @ weight.T the fast way for skinny x; None when x is not skinny."""
    rows = x.size // x.shape[-1] if x.ndim else 0
    if rows == 0 or rows > MAX_ROWS:
        return None
    flat = x.reshape(rows, x.shape[-1])
    if kernels and rows <= kernel_rows(weight) and x.dtype == mx.float32:
        out = _kernels.f32_matmul(flat, weight)
    elif rows >= 2:
        out = (weight @ flat.T).T
    else:
        return None  # one row: MLX's own GEMV
    return out.reshape(*x.shape[:-1], weight.shape[0])


def kernel_rows(weight: mx.array) -> int:
    """Up to how many rows a product with this weight takes the compiled kernel."""
    return KERNEL_ROWS_LARGE if weight.size >= LARGE else KERNEL_ROWS


class SkinnyLinear(nn.Linear):
    kernels = False

    def __call__(self, x: mx.array) -> mx.array:
        out = _product(x, self["weight"], self.kernels)
        if out is None:
            return super().__call__(x)
        return out + self["bias"] if "bias" in self else out


class SkinnyEmbedding(nn.Embedding):
    kernels = False

    def as_linear(self, x: mx.array) -> mx.array:
        out = _product(x, self.weight, self.kernels)
        return super().as_linear(x) if out is None else out


class KernelLinear(SkinnyLinear):
    kernels = True


class KernelEmbedding(SkinnyEmbedding):
    kernels = True


def apply(model: nn.Module, kernels: Any = None) -> int:
    """Switch the model's plain linear and embedding layers to the skinny path, in place;
    `kernels`: the compiled kernels module, or None for the BLAS alone. Returns how many
    layers were switched. Only for the CPU: GPU kernels have their own small-batch paths."""
    if mx.default_device() != mx.cpu:
        return 0
    global _kernels
    if kernels is not None:
        _kernels = kernels
    linear, embedding = ((KernelLinear, KernelEmbedding) if kernels is not None
                         else (SkinnyLinear, SkinnyEmbedding))
    switched = 0
    for _, module in model.named_modules():
        if module.get("weight") is None or module.weight.dtype != mx.float32:
            continue
        if type(module) is nn.Linear:
            module.__class__ = linear
            switched += 1
        elif type(module) is nn.Embedding:
            module.__class__ = embedding
            switched += 1
    return switched
