"""The LM head for the last position only, while a prompt's last chunk runs.

A chunk's forward computes logits for every position, and only the last one is sampled: the
head is a vocab-wide matmul per position (qwen3-small: 151,936 x 512, as much work per token
as the rest of the model). mlx-lm's own generate therefore runs the last prompt token as a
forward of its own, which costs a second pass over every weight. Inside `last_only()` the
model's head modules (the Linear or tied Embedding whose output is the vocabulary) keep only
the last position of their input, so one forward does both: same logits for that position.
The same modules hand their input to greedy_head.py inside its capture() (greedy rows skip the
product).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import mlx.core as mx
import mlx.nn as nn

from actors.model_runner.cpu import greedy_head
from actors.model_runner.thread_flag import ThreadFlag

_on = ThreadFlag(False)


@contextmanager
def last_only() -> Iterator[None]:
    with _on.holding(True):
        yield


def _cut(x: mx.array) -> mx.array:
    return x[..., -1:, :] if _on.get() and x.ndim == 3 else x


class _LinearHead:
    def __call__(self, x: mx.array) -> mx.array:
        x = _cut(x)
        out = greedy_head.intercept(self, x, self.weight.shape[0])
        return super().__call__(x) if out is None else out


class _EmbeddingHead:
    def as_linear(self, x: mx.array) -> mx.array:
        x = _cut(x)
        out = greedy_head.intercept(self, x, self.weight.shape[0])
        return super().as_linear(x) if out is None else out


_classes: dict[type, type] = {}


def _head_class(cls: type, mixin: type) -> type:
    if cls not in _classes:
        _classes[cls] = type(f"LastOnly{cls.__name__}", (mixin, cls), {})
    return _classes[cls]


def install(model: nn.Module, vocab_size: int) -> int:
    """Switch the model's head modules (by their output width) in place; returns how many.
    Embeddings only change as_linear, the tied head; their lookups are untouched."""
    switched = 0
    for _, module in model.named_modules():
        cls = type(module)
        if cls in _classes.values():
            continue
        if isinstance(module, (nn.Linear, nn.QuantizedLinear)):
            out = module.weight.shape[0]
            mixin = _LinearHead
        elif isinstance(module, (nn.Embedding, nn.QuantizedEmbedding)):
            out = module.weight.shape[0]
            mixin = _EmbeddingHead
        else:
            continue
        if out == vocab_size:
            module.__class__ = _head_class(cls, mixin)
            switched += 1
    return switched
