"""CPU kernels for stored weight formats, as MLX primitives (docs/architecture.md, section 10).

    affine_qmm(x, w, scales, biases, group_size=64, bits=4, *, stream=None) -> mx.array
    affine_qmm_many(x, weights, group_size, bits, *, stream=None) -> tuple[mx.array, ...]
    affine_swiglu(x, gate_w, gate_scales, gate_biases, up_w, up_scales, up_biases, group_size,
                  bits, *, stream=None) -> mx.array
    decode_layer_in(x, norm, qkv, q_norm, k_norm, offsets, heads, kv_heads, eps, q_eps, k_eps,
                    rope_dims, traditional, base, scale, group_size, bits, *, stream=None)
        -> (q, k, v)
    decode_layer_out(x, q, k_pool, v_pool, pages, lengths, attn_scale, weights, norm, eps,
                     group_size, bits, *, stream=None) -> mx.array
    bf16_matmul(x, w, *, stream=None) -> mx.array
    f32_matmul(x, w, *, stream=None) -> mx.array
    decode_attention(q, k, v, pages, lengths, scale, *, stream=None) -> mx.array
    rms_norm(x, weight, eps, *, stream=None) -> mx.array
    rope(x, dims, traditional, base, scale, offsets, *, stream=None) -> mx.array
    norm_rope(x, weight, eps, heads, dims, traditional, base, scale, offsets, *, stream=None)
        -> mx.array
    greedy_head(x, w, wq, stats, bf16_logits=False, allowed=None, *, stream=None) -> mx.array
    greedy_head_quantized(x, codes, table, stats, group_size, bits, bf16_logits=False,
                          allowed=None, *, stream=None) -> mx.array
    gated_delta(q, k, v, g, beta, state, *, stream=None) -> (y, state)
    causal_conv(x, w, *, stream=None) -> mx.array
    kv_write(pool, index, rows, *, stream=None) -> mx.array
    quantized_rows(w, scales, biases, ids, group_size, bits, float32=False, *, stream=None)
        -> mx.array
    silu(gate, x=None, *, stream=None) -> mx.array
    softmax(scores, causal_length=0, *, stream=None) -> mx.array
    argmax(x, *, stream=None) -> mx.array
    categorical(logits, u, floor=None, *, stream=None) -> mx.array
    filter_floor(logits, top_k, top_p, log_min_p, *, stream=None) -> mx.array

They build lazy graph nodes evaluated on MLX's CPU stream. isa() / set_isa(name) report and
force the instruction-set path; threads() / set_threads(n) the thread count,
set_worker_cpus(cpus) where the pool's workers run; stream_thread_id() (a node, int32 []) is the
id of the thread the CPU stream runs on.
"""

from __future__ import annotations

import mlx.core as mx

from . import _ext

if _ext.mlx_version != mx.__version__:
    raise ImportError(
        f"mas_kernels was built against mlx {_ext.mlx_version} but mlx {mx.__version__} is "
        "installed: rebuild it (pip install --no-build-isolation ./native)")

affine_qmm = _ext.affine_qmm
affine_qmm_many = _ext.affine_qmm_many
affine_swiglu = _ext.affine_swiglu
decode_layer_in = _ext.decode_layer_in
decode_layer_out = _ext.decode_layer_out
bf16_matmul = _ext.bf16_matmul
f32_matmul = _ext.f32_matmul
decode_attention = _ext.decode_attention
rms_norm = _ext.rms_norm
rope = _ext.rope
norm_rope = _ext.norm_rope
greedy_head = _ext.greedy_head
greedy_head_quantized = _ext.greedy_head_quantized
qhead_fast = _ext.qhead_fast
qhead_half_table = _ext.qhead_half_table
gated_delta = _ext.gated_delta
causal_conv = _ext.causal_conv
kv_write = _ext.kv_write
quantized_rows = _ext.quantized_rows
silu = _ext.silu
softmax = _ext.softmax
argmax = _ext.argmax
categorical = _ext.categorical
filter_floor = _ext.filter_floor
head_x_levels = _ext.head_x_levels
isa = _ext.isa
set_isa = _ext.set_isa
has_isa = _ext.has_isa
threads = _ext.threads
set_threads = _ext.set_threads
set_compile_fusion = _ext.set_compile_fusion
set_worker_cpus = _ext.set_worker_cpus
stream_thread_id = _ext.stream_thread_id

__all__ = ["affine_qmm", "argmax", "bf16_matmul", "categorical", "causal_conv",
           "decode_attention", "decode_layer_in", "decode_layer_out", "f32_matmul", "filter_floor", "gated_delta", "greedy_head",
           "greedy_head_quantized", "has_isa", "head_x_levels", "isa", "qhead_fast",
           "qhead_half_table", "rms_norm", "rope", "set_compile_fusion", "set_isa",
           "set_threads", "set_worker_cpus", "silu", "softmax", "stream_thread_id", "threads"]
