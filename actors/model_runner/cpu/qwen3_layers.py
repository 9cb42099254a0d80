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
- The whole layer, one token per row, where every piece above takes its kernel and all seven
  projections are affine-quantized in one format: two nodes around the pool writes
  (mas_kernels.decode_layer_in: norm, q/k/v, norm+RoPE; decode_layer_out: attention, o_proj,
  residual, norm, SwiGLU, down, residual) where the forms above leave twelve, bit for bit
  their values. qwen3-small-4bit's decode step at one row: 134 nodes -> 46.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import qwen3

from actors.model_runner.cpu import attention, fastmath
from actors.model_runner.cpu.norm_rope import (KernelRMSNorm, KernelRoPE, heads_normed_rotated,
                                               offsets_of, swap_classes)
from actors.model_runner.cpu.weights import layer_products, shared_products, swiglu_product
from actors.model_runner.decode_batch import BatchedKV


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


class FusedBlock(qwen3.TransformerBlock):
    def __call__(self, x: mx.array, mask: mx.array | None = None, cache: Any = None) -> mx.array:
        fused = _fused(self, x, cache)
        if fused is None:
            return super().__call__(x, mask, cache)
        kernels, arrays, group_size, bits = fused
        attn, norm = self.self_attn, self.input_layernorm
        rope = attn.rope
        q, k, v = kernels.decode_layer_in(
            x, norm["weight"], arrays[:9], attn.q_norm["weight"], attn.k_norm["weight"],
            offsets_of(cache.offset), attn.n_heads, attn.n_kv_heads, norm.eps, attn.q_norm.eps,
            attn.k_norm.eps, rope.dims, rope.traditional, rope.base, rope.scale, group_size,
            bits)
        keys, values = cache.update_and_fetch(k, v)
        if not attention.takes_kernel(q, keys, values, cache, mask):
            # OneTokenAttention's own rest, from its queries, keys and values.
            out = qwen3.scaled_dot_product_attention(q, keys, values, cache=cache,
                                                     scale=attn.scale, mask=mask)
            h = x + attn.o_proj(out.reshape(x.shape[0], 1, -1))
            return h + self.mlp(self.post_attention_layernorm(h))
        post, p = self.post_attention_layernorm, cache.positions
        return kernels.decode_layer_out(x, q, cache.keys, cache.values, p.table, p.keys_per_row,
                                        attn.scale, arrays[9:], post["weight"], post.eps,
                                        group_size, bits)


def _fused(block: qwen3.TransformerBlock, x: mx.array, cache: Any) -> tuple | None:
    """What the fused layer takes (layer_products), where each of the layer's pieces would take
    its kernel one token per row; else None."""
    attn, mlp = block.self_attn, block.mlp
    if (x.ndim != 3 or x.shape[1] != 1 or x.dtype != mx.float32
            or not isinstance(cache, BatchedKV) or type(attn) is not OneTokenAttention
            or type(mlp) is not FusedMLP or type(attn.rope) is not KernelRoPE
            or qwen3.scaled_dot_product_attention is not attention.attention
            or qwen3.swiglu is not fastmath.swiglu or not fastmath.swiglu_takes_kernel()):
        return None
    norms = (block.input_layernorm, block.post_attention_layernorm, attn.q_norm, attn.k_norm)
    if any(type(n) is not KernelRMSNorm or n["weight"].dtype != mx.float32 for n in norms):
        return None
    return layer_products(x, [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj,
                              mlp.gate_proj, mlp.up_proj, mlp.down_proj])


_SWAPS = {qwen3.Attention: OneTokenAttention, qwen3.MLP: FusedMLP,
          qwen3.TransformerBlock: FusedBlock}


def apply(model: nn.Module) -> int:
    """Switch the model's layers of the classes above to their forms here. Returns how many
    were switched; a second call switches none."""
    return swap_classes(model, _SWAPS)
