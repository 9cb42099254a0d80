"""Decode-shaped matmuls on the CPU, computed the fast way round.

A linear layer computes x @ W.T with x [rows, in] and W [out, in]. In decode, rows is the batch
(1-16), and with MKL behind MLX on the CPU that product is slow for rows >= 2: the BLAS packs
the whole transposed weight for a handful of rows. The same product written as (W @ x.T).T lets
the BLAS stream W as the big left operand. Measured on this project's 2-core x86 machine with
MKL (benchmarks/kernels/skinny.py): 1.2-2x faster for 2-128 rows, equal for 1 row, on the attention
and MLP shapes and on the tied 151,936-row LM head. Same math; the sums are ordered
differently, so results can differ from x @ W.T in the last bits (like any change of batch).

Only exact nn.Linear and nn.Embedding (tied LM head: as_linear) with float32 weights are
changed, only for inputs of at most MAX_ROWS rows; prefill chunks keep MLX's own path. Layers
with weights in other formats are weights.py's.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

MAX_ROWS = 128


def _product(x: mx.array, weight: mx.array) -> mx.array | None:
    """x @ weight.T as (weight @ x.T).T for skinny x; None when x is not skinny."""
    rows = x.size // x.shape[-1] if x.ndim else 0
    if not 2 <= rows <= MAX_ROWS:
        return None
    flat = x.reshape(rows, x.shape[-1])
    out = (weight @ flat.T).T
    return out.reshape(*x.shape[:-1], weight.shape[0])


class SkinnyLinear(nn.Linear):
    def __call__(self, x: mx.array) -> mx.array:
        out = _product(x, self["weight"])
        if out is None:
            return super().__call__(x)
        return out + self["bias"] if "bias" in self else out


class SkinnyEmbedding(nn.Embedding):
    def as_linear(self, x: mx.array) -> mx.array:
        out = _product(x, self.weight)
        return super().as_linear(x) if out is None else out


def apply(model: nn.Module) -> int:
    """Switch the model's plain linear and embedding layers to the skinny path, in place.
    Returns how many layers were switched. Only for the CPU: GPU kernels have their own
    small-batch paths."""
    if mx.default_device() != mx.cpu:
        return 0
    switched = 0
    for _, module in model.named_modules():
        if module.get("weight") is None or module.weight.dtype != mx.float32:
            continue
        if type(module) is nn.Linear:
            module.__class__ = SkinnyLinear
            switched += 1
        elif type(module) is nn.Embedding:
            module.__class__ = SkinnyEmbedding
            switched += 1
    return switched
