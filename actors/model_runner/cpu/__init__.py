"""The runner's patches of MLX and mlx-lm for the CPU, installed together by install().

- blas.py: the BLAS behind MLX's matmuls, loaded by the runner's entry point before MLX is
  imported (not by install(): by then it is too late);
- weights.py: weights stored as 4-bit, 8-bit, bf16, ... multiplied by our compiled kernels or
  a fallback (`runtime.weights`); first, so the float32 patches below see resident upcasts;
- skinny.py: decode-shaped matmuls as (W @ x.T).T (`runtime.skinny_matmul`, CPU only);
- attention.py: the decode batch's attention through the compiled kernel (with
  `runtime.weights = "auto"` where the kernels are built, CPU only);
- norm_rope.py: RMS norms and RoPEs as one graph node each through the compiled kernels (same
  condition);
- qwen3_layers.py: mlx-lm's Qwen3 attention and MLP in fewer graph nodes, and a whole decode
  layer with affine-quantized projections in two (same condition);
- chunked_delta.py: the gated-delta recurrence of hybrid models through the compiled kernel,
  or in blocks of matrix products (`runtime.linear_prefill`);
- fastmath.py: the attention softmax and the SiLU in NumPy (`runtime.fast_math`, CPU only);
- MLX's buffer cache limit (`runtime.buffer_cache_mib`, CPU only): big freed buffers are
  kept for reuse rather than returned to the OS and faulted in again;
- head.py: the LM head on the last position only while a prompt's last chunk runs. It skips
  work on any device, so it is installed everywhere;
- greedy_head.py: plain greedy rows' tokens without the vocabulary-wide head product, through
  the compiled kernels (`runtime.greedy_head`, a float32 or bf16 head, CPU only).

This file imports no MLX: `from actors.model_runner.cpu import blas` must stay possible before
blas.load(), so install() imports the patch modules when it runs.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import mlx.nn as nn

    from actors.model_runner.cpu.weights import WeightPlan
    from protocol.config import RuntimeConfig


@dataclass(frozen=True)
class Installed:
    """What install() did, for the runner's startup log (`runner.blas`). Counts are 0 where
    the model was patched already (a runner rebuilt after a failed step) or not on the CPU."""

    library: str  # the BLAS in use (blas.in_use())
    weights: WeightPlan  # each weight kind's strategy (cpu/weights.py)
    skinny_matmul: bool  # as configured
    fast_math: bool  # as configured: whether the runner's steps take the NumPy path
    skinny_layers: int  # linear and embedding layers switched to the skinny path
    skinny_kernels: bool  # whether their few-row products take the compiled kernels
    fast_math_globals: int  # mlx-lm module globals pointed at fastmath's dispatchers
    decode_attention: bool  # whether the decode batch's attention takes the compiled kernel
    norm_rope_modules: int  # RMS norm and RoPE modules switched to the compiled kernels
    qwen3_layers: int  # Qwen3 attention, MLP and block modules switched to few-node forms
    buffer_cache_mib: int  # MLX's buffer cache limit set (0: MLX's default kept)
    head_modules: int  # LM head modules that can cut to the last position
    greedy_head_mib: float  # the greedy head's int8 copy of the LM head (0: not in use)
    greedy: Any = field(default=None, repr=False)  # the GreedyHead, or None
    chunked_delta: bool = False  # prompt chunks' gated-delta recurrence in blocks
    delta_kernel: bool = False  # every gated-delta recurrence (decode too) through the kernel
    shifted_convs: int = 0  # depthwise convolutions computed as shifted sums

    def log_fields(self) -> dict[str, Any]:
        """The fields of the `runner.blas` log (the weight plan and the greedy head object
        have their own)."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name not in ("weights", "greedy")}

    def steps(self, in_place: bool = False) -> AbstractContextManager[None]:
        """The context the runner builds its steps in: fast math on where configured, the
        decode attention kernel and the sampled rows' draws through the kernels where built;
        in_place: the pool writes in place (attention.active)."""
        from actors.model_runner import sampling
        from actors.model_runner.cpu import attention, fastmath, weights

        kernels = weights.loaded_kernels() if self.decode_attention else None
        stack = ExitStack()
        stack.enter_context(fastmath.active(self.fast_math))
        stack.enter_context(attention.active(kernels, in_place))
        stack.enter_context(sampling.kernel_draws(kernels))
        return stack


def install(model: nn.Module, runtime: RuntimeConfig, vocab_size: int) -> Installed:
    """Apply every patch the `[runtime]` config asks for to `model` (in place)."""
    from actors.model_runner import chunked_delta
    from actors.model_runner.cpu import (attention, blas, fastmath, greedy_head, head,
                                         norm_rope, qwen3_layers, skinny, weights)

    import mlx.core as mx

    from models.sizing import BUFFER_CACHE_MIB

    plan = weights.install(model, runtime)
    cache_mib = runtime.buffer_cache_mib if mx.default_device() == mx.cpu else 0
    if cache_mib == "auto":  # the actor sizes it for the model (models/sizing.py); else
        cache_mib = BUFFER_CACHE_MIB[1]
    if cache_mib:
        mx.set_cache_limit(cache_mib << 20)
    compiled = weights.compiled_kernels(runtime)
    kernels = compiled if runtime.skinny_matmul else None
    fast_math_globals = fastmath.install(model, compiled) if runtime.fast_math else 0
    if compiled is not None:
        attention.install(model)  # after fastmath: it falls back to fastmath's dispatcher
    chunked = chunked_delta.install(runtime.linear_prefill, compiled)
    convs = chunked_delta.apply(model, compiled) if runtime.linear_prefill else 0
    head_modules = head.install(model, vocab_size)
    greedy = None
    if compiled is not None and runtime.greedy_head:
        # after head.install: its modules hand over x. Quantized heads only where the
        # kernel is vectorized (its scalar code is slower than their own product).
        probed = greedy_head.probe(model, quantized=compiled.qhead_fast())
        if probed is not None:
            greedy = greedy_head.GreedyHead(probed.weight, compiled, probed.bf16_logits)
    return Installed(
        library=blas.in_use(),
        weights=plan,
        skinny_matmul=runtime.skinny_matmul,
        fast_math=runtime.fast_math,
        skinny_layers=skinny.apply(model, kernels) if runtime.skinny_matmul else 0,
        skinny_kernels=kernels is not None,
        fast_math_globals=fast_math_globals,
        decode_attention=compiled is not None,
        norm_rope_modules=norm_rope.apply(model, compiled) if compiled is not None else 0,
        qwen3_layers=qwen3_layers.apply(model) if compiled is not None else 0,
        buffer_cache_mib=cache_mib,
        head_modules=head_modules,
        greedy_head_mib=round(greedy.nbytes / 2**20, 1) if greedy is not None else 0.0,
        greedy=greedy,
        chunked_delta=chunked,
        delta_kernel=chunked and compiled is not None,
        shifted_convs=convs,
    )
