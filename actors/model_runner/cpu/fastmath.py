"""The attention softmax and the MLP's SiLU on x86 CPUs, where MLX's own are slow.

Where the compiled kernels are built (mas_kernels.silu and .softmax, native/src/activation.inc)
they take every size: one graph node each, exp vectorized, nothing leaves the graph; the causal
mask is applied inside the softmax. On qwen3_5-small, a 2,000-token prompt's layers in chunks
of 128: 2,074 -> 1,358 ms (the SiLU of chunks under SWIGLU_MIN_ELEMENTS had been MLX's scalar
exp), in chunks of 512: 1,456 -> 1,078 ms. Without them, NumPy's exp, as follows.

MLX's CPU backend vectorizes exp, sigmoid and the other transcendental functions for ARM only:
on x86 each element runs through scalar code. Measured on this project's 2-core x86 machine:
mx.exp of 2M float32 values 24 ms, numpy's (AVX-512) 0.95 ms. In a prefill chunk of 512 tokens
the attention softmax ([heads, 512, 512] exps per layer) and the SiLU ([512, intermediate]) then
take as long as all the matmuls together. Here MLX still computes the attention scores and the
weighted sum (BLAS), NumPy the softmax and the sigmoid: prefill of qwen3-small 1.7x faster, batch-16
decode steps ~8% faster (`python -m benchmarks.kernels.fastmath`). Greedy tokens stay those of
mlx_lm.generate (tests/kernels/test_fastmath.py, and every runner oracle test runs with it on).

Each layer that takes the NumPy path evaluates its graph up to there (the NumPy call needs the
values). That costs nothing measurable at the sizes where it is used (at least MIN_ELEMENTS
values); smaller ones, and float16, quantized caches, attention sinks, GPU, stay on MLX's
path, bit for bit. bfloat16 takes the kernels where they are built, with MLX's bf16 results
(each rounded where MLX rounds it, its exp reproduced: native/src/mlx_math.h; the attention's
products sum in the BLAS's order), and otherwise MLX's path.

mlx-lm's model modules call `scaled_dot_product_attention` and `swiglu` through their module
globals; install() points those names at dispatchers that take the NumPy path only on a thread
inside `active()`. The runner enters it for its steps; the same process's stock mlx-lm (the
tests' oracle, the bare-forward benchmark) keeps MLX's path. The NumPy call waits for MLX
values, so it first lets the runner's pipeline send the previous step's result
(pipeline.before_host_sync).
"""

from __future__ import annotations

import inspect
import sys
import types
from contextlib import contextmanager
from typing import Iterator

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models import activations, base

from actors.model_runner.pipeline import before_host_sync
from actors.model_runner.thread_flag import ThreadFlag

MIN_ELEMENTS = 1 << 14  # below this, MLX's scalar loop costs less than leaving the graph
# The SiLU leaves the graph only for prefill-sized inputs: a decode batch's ([16, 3072] on
# qwen3-small) costs ~0.5 ms per layer in MLX, but leaving the graph in every layer stops
# the step's launch there, so the overlap pipeline cannot build the next step while this one
# runs (python -m benchmarks.kernels.profile, batch 16, float32: graph build 26 -> 1.8 ms,
# step 85 -> 72 ms with the SiLU of decode batches left to MLX).
SWIGLU_MIN_ELEMENTS = 1 << 18

_stock_attention = base.scaled_dot_product_attention
_stock_swiglu = activations.swiglu
_stock_precise_swiglu = activations.precise_swiglu
_on = ThreadFlag(False)
_kernels = None  # mas_kernels where install() was given it


@contextmanager
def active(on: bool = True) -> Iterator[None]:
    """Take the NumPy path on this thread (where install() has patched the model's modules)."""
    with _on.holding(on):
        yield


def _wanted(*arrays: mx.array) -> bool:
    return (_on.get() and mx.default_device() == mx.cpu
            and all(a.dtype == mx.float32 for a in arrays))


def softmax(scores: mx.array) -> mx.array:
    """Softmax over the last axis, computed by NumPy (evaluates `scores`)."""
    before_host_sync()
    a = np.asarray(scores)  # a view of MLX's buffer: never written
    e = np.exp(a - a.max(axis=-1, keepdims=True))
    e /= e.sum(axis=-1, keepdims=True)
    return mx.array(e)


_UNSUPPORTED = object()


# The additive masks MLX's attention takes for each output dtype: those that promote to it (a
# float32 mask on bf16 scores is MLX's ValueError, which its own path then raises).
_ADDITIVE = {mx.float32: (mx.float32, mx.bfloat16), mx.bfloat16: (mx.bfloat16,)}


def _group_mask(mask, heads: int, kv_heads: int, length: int, width: int, dtype: mx.Dtype):
    """The mask as a bool or additive array that broadcasts over scores of `dtype` shaped
    [b, kv_heads, group, length, width]; None for no mask; _UNSUPPORTED for other kinds."""
    if mask is None:
        return None
    if isinstance(mask, str):  # causal: the chunk's queries are the last `length` positions
        if mask != "causal":
            return _UNSUPPORTED
        return mx.arange(width - length, width)[:, None] >= mx.arange(width)[None]
    if (mask.dtype != mx.bool_ and mask.dtype not in _ADDITIVE[dtype]) or mask.ndim not in (2, 4):
        return _UNSUPPORTED
    if mask.ndim == 2:
        return mask
    if mask.shape[1] == 1:  # [b or 1, 1, length, width]: one mask for every head
        return mask.reshape(mask.shape[0], 1, 1, length, width)
    if mask.shape[1] == heads:  # per query head: adjacent heads share a KV head
        return mask.reshape(mask.shape[0], kv_heads, heads // kv_heads, length, width)
    return _UNSUPPORTED


def attention(queries: mx.array, keys: mx.array, values: mx.array, cache, scale: float,
              mask, sinks=None) -> mx.array:
    """mlx-lm's scaled_dot_product_attention, with the softmax through the kernel (the causal
    mask inside it), else NumPy, where it pays. A bf16 model's takes the kernel's bf16
    softmax (MLX's own bits) and its products through the float32 BLAS (_bf16_product): MLX's
    bf16 matmul and exp are scalar code on x86, 940 of a 1,240 ms 512-token prefill of
    qwen3-small-bf16."""
    b, heads, length, dim = queries.shape
    kv_heads, width = keys.shape[1], keys.shape[2]
    bf16 = _bf16_kernel_path(queries, keys, values)
    stock = (sinks is not None or hasattr(cache, "bits")
             or b * heads * length * width < MIN_ELEMENTS
             or not (bf16 or _wanted(queries, keys, values)))
    # The kernel applies a causal mask itself (rows are (group, query): row r is query
    # r % length, as it counts); other masks are built here.
    causal = _kernels is not None and isinstance(mask, str) and mask == "causal"
    grouped = (_UNSUPPORTED if stock else None if causal
               else _group_mask(mask, heads, kv_heads, length, width, queries.dtype))
    if grouped is _UNSUPPORTED:
        return _stock_attention(queries, keys, values, cache=cache, scale=scale, mask=mask,
                                sinks=sinks)
    group = heads // kv_heads  # query heads sharing one KV head, adjacent as in MLX's GQA
    product = _bf16_product if bf16 else mx.matmul
    # q * scale in the queries' dtype, as MLX scales them (bf16: rounded).
    scores = product((queries * scale).reshape(b, kv_heads, group * length, dim),
                     keys.swapaxes(-1, -2))
    if causal:
        return product(_kernels.softmax(scores, length), values).reshape(b, heads, length, dim)
    if grouped is not None:
        scores = scores.reshape(b, kv_heads, group, length, width)
        if grouped.dtype == mx.bool_:
            scores = mx.where(grouped, scores, mx.finfo(scores.dtype).min)
        else:
            scores = scores + grouped.astype(scores.dtype)  # as MLX casts it
        scores = scores.reshape(b, kv_heads, group * length, width)
    weights = _kernels.softmax(scores) if _kernels is not None else softmax(scores)
    return product(weights, values).reshape(b, heads, length, dim)


def _bf16_kernel_path(*arrays: mx.array) -> bool:
    return (_kernels is not None and _on.get() and mx.default_device() == mx.cpu
            and all(a.dtype == mx.bfloat16 for a in arrays))


def _bf16_product(a: mx.array, b: mx.array) -> mx.array:
    """a @ b of bf16 arrays as MLX's bf16 matmul gives it (float32 sums rounded to bf16),
    through the float32 BLAS: products of bf16 values are exact in float32, so only the order
    of the sums differs, and the rounding to bf16 hides that but for a sum on a rounding
    boundary (~1e-4 of a prompt chunk's attention outputs with MKL: one bf16 step)."""
    return (a.astype(mx.float32) @ b.astype(mx.float32)).astype(mx.bfloat16)


def _kernel_path(gate: mx.array, *others: mx.array) -> bool:
    """The SiLU kernel: float32, or bf16 (MLX's bf16 silu bit for bit: its exp, each op's
    result rounded; MLX's own took 12 ms of a 512-token chunk's layer on qwen3-small-bf16)."""
    return (_kernels is not None and (_wanted(gate, *others) or _bf16_kernel_path(gate, *others))
            and all(o.shape == gate.shape for o in others))


def swiglu_takes_kernel() -> bool:
    """Whether swiglu() of float32 arrays takes the SiLU kernel (on this thread, now)."""
    return _kernels is not None and _wanted()


def swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """silu(gate) * x: the kernel, else the sigmoid's exp in NumPy when it pays."""
    if _kernel_path(gate, x):
        return _kernels.silu(gate, x)
    if gate.size < SWIGLU_MIN_ELEMENTS or not _wanted(gate, x):
        return _stock_swiglu(gate, x)
    return _numpy_swiglu(gate, x)


def silu(x: mx.array) -> mx.array:
    """nn.silu: the kernel, else the sigmoid's exp in NumPy when it pays."""
    if _kernel_path(x):
        return _kernels.silu(x)
    if x.size < SWIGLU_MIN_ELEMENTS or not _wanted(x):
        return nn.silu(x)
    return x / (1.0 + _exp_neg(x))


def _numpy_swiglu(gate: mx.array, x: mx.array) -> mx.array:
    return gate * x / (1.0 + _exp_neg(gate))


def _exp_neg(x: mx.array) -> mx.array:
    """exp(-x) by NumPy (evaluates `x`)."""
    before_host_sync()
    with np.errstate(over="ignore"):  # exp(-x) = inf for x < -88: silu is -0.0 there
        return mx.array(np.exp(-np.asarray(x)))


def precise_swiglu(h: mx.array, gate: mx.array, x: mx.array) -> mx.array:
    """mlx-lm's precise_swiglu (the gated RMS norm of Qwen3-Next / Qwen3.5): silu(gate) * x
    in float32, cast to h's dtype."""
    if _kernel_path(gate, x) and gate.dtype == mx.float32:  # a bf16 one computes in float32
        return _kernels.silu(gate, x).astype(h.dtype)
    if gate.size < SWIGLU_MIN_ELEMENTS or not _wanted(h, gate, x):
        return _stock_precise_swiglu(h, gate, x)
    return _numpy_swiglu(gate, x).astype(h.dtype)


# mlx.nn as the model modules that call `nn.silu` see it (the gated-delta layers' convolution
# output, [tokens, 3 x 1,024] per layer of a prefill chunk): a copy of its namespace, silu
# through the dispatcher above (a plain copy: no lookup hook on every other nn.X).
_nn = types.ModuleType("mlx.nn")
_nn.__dict__.update(vars(nn))
_nn.silu = silu


def install(model: nn.Module, kernels=None) -> int:
    """Point the model's modules' attention, SwiGLU and SiLU at the dispatchers above (CPU
    only), through `kernels` (mas_kernels) where given. Returns how many module globals were
    changed; a second call changes nothing but the kernels."""
    global _kernels
    if mx.default_device() != mx.cpu:
        return 0
    _kernels = kernels
    changed = 0
    names = {type(layer).__module__ for _, layer in model.named_modules()}
    for module in filter(None, (sys.modules.get(name) for name in names)):
        for name, stock, ours in (("scaled_dot_product_attention", _stock_attention, attention),
                                  ("swiglu", _stock_swiglu, swiglu),
                                  ("precise_swiglu", _stock_precise_swiglu, precise_swiglu)):
            # Not in the module that defines the function (gpt-oss's SwigluOAI layer lives in
            # mlx_lm's activations): that would change it for every later importer.
            if getattr(module, name, None) is stock and module.__name__ != stock.__module__:
                setattr(module, name, ours)
                changed += 1
        if getattr(module, "nn", None) is nn and "nn.silu(" in _source(module):
            module.nn = _nn
            changed += 1
    return changed


def _source(module) -> str:
    try:
        return inspect.getsource(module)
    except (OSError, TypeError):
        return ""
