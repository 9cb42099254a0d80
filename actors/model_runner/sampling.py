"""Token selection for a batch of rows, inside MLX (no per-row Python on the hot path)."""

from __future__ import annotations

import mlx.core as mx


def sample_tokens(logits: mx.array, temperatures: list[float]) -> mx.array:
    """logits [rows, vocab] -> int32 tokens [rows]. Temperature 0 is greedy (argmax)."""
    greedy = mx.argmax(logits, axis=-1).astype(mx.int32)
    if not any(t > 0 for t in temperatures):
        return greedy
    temps = mx.array([t if t > 0 else 1.0 for t in temperatures], dtype=logits.dtype)
    drawn = mx.random.categorical(logits.astype(mx.float32) / temps[:, None]).astype(mx.int32)
    use_greedy = mx.array([t <= 0 for t in temperatures])
    return mx.where(use_greedy, greedy, drawn)
