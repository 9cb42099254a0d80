"""mlx-lm's Qwen3 attention and MLP layers in fewer graph nodes, the same values.

On the CPU each graph node costs the thread that queues it and the stream that runs it
microseconds whatever its size, and in a decode step most nodes are small: queueing
qwen3-small-4bit's step at one row (mx.async_eval, ~10 us a node on this 2-core machine) was
most of the runner thread's step. Here:

- Attention, one token per row (decode): mlx-lm reshapes q, k and v to [B, L, heads, dim] and
  transposes them to [B, heads, L, dim], then transposes the attention's output back. With
  L = 1 each transpose is the same memory as a plain reshape, so the arrays are reshaped
  straight to the layout the next op wants (four nodes fewer a layer). Where the norms and RoPE
  are the kernels' (norm_rope.py), q's and k's reshape, norm and RoPE are one node each
  (mas_kernels.norm_rope, bit for bit the three's values), and where our kernel multiplies the
  q, k and v projections (cpu/weights.py), they are one node (shared_products). Prompt chunks
  (L > 1) run mlx-lm's own code.
- MLP: where our kernel multiplies gate and up and the SwiGLU takes the SiLU kernel, the two
  products and the SiLU are one node (swiglu_product).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import qwen3

from actors.model_runner.cpu import fastmath
from actors.model_runner.cpu.norm_rope import heads_normed_rotated, swap_classes
from actors.model_runner.cpu.weights import shared_products, swiglu_product


class OneTokenAttention(qwen3.Attention):
    def __call__(self, x: mx.array, mask: mx.array | None = None, cache: Any = None) -> mx.array:
        B, L, _ = x.shape
        if L != 1:
            return super().__call__(x, mask, cache)
        projected = shared_products(x, [self.q_proj, self.k_proj, self.v_proj])
        q, k, v = projected or (self.q_proj(x), self.k_proj(x), self.v_proj(x))
        offset = 0 if cache is None else cache.offset
        queries = heads_normed_rotated(q, self.q_norm, self.rope, self.n_heads, offset)
        keys = heads_normed_rotated(k, self.k_norm, self.rope, self.n_kv_heads, offset)
        values = v.reshape(B, self.n_kv_heads, 1, -1)
        if cache is not None:
            keys, values = cache.update_and_fetch(keys, values)
        # Through the module global, as mlx-lm's code calls it (cpu/attention.py points it at
        # the decode batch's kernel).
        output = qwen3.scaled_dot_product_attention(queries, keys, values, cache=cache,
                                                    scale=self.scale, mask=mask)
        return self.o_proj(output.reshape(B, 1, -1))


class FusedMLP(qwen3.MLP):
    # mlx-lm's MLP calls its module global `swiglu`, which fastmath.install() points at
    # fastmath.swiglu: the fused node is taken only where that would take the SiLU kernel.
    def __call__(self, x: mx.array) -> mx.array:
        takes = qwen3.swiglu is fastmath.swiglu and fastmath.swiglu_takes_kernel()
        h = swiglu_product(x, self.gate_proj, self.up_proj) if takes else None
        return super().__call__(x) if h is None else self.down_proj(h)


_SWAPS = {qwen3.Attention: OneTokenAttention, qwen3.MLP: FusedMLP}


def apply(model: nn.Module) -> int:
    """Switch the model's layers of the classes above to their forms here. Returns how many
    were switched; a second call switches none."""
    return swap_classes(model, _SWAPS)
