"""What each layer of the model keeps per request, found once at launch (docs/architecture.md,
section 7, "Layer kinds and the prefix cache").

The mlx-lm cache object a layer gets from `make_prompt_cache` is what the runner keeps for a
request, so it decides the layer's kind (protocol.messages LAYER_*):
- KVCache: "full", K and V of every position (the KV pool can hold a prefix of it);
- RotatingKVCache: "sliding", K and V of the last `window` positions only (a snapshot in the
  state pool: windows.py);
- ArraysCache and its subclasses (MambaCache): "recurrent", one state (the state pool);
- anything else: "other:<cache type>", served as mlx-lm serves it.
The decode batch (decode_batch.py) keeps full-attention and recurrent layers in its own layout;
any other cache it batches as mlx-lm does (merge, then filter/extend), so a cache it cannot
batch is refused here, at launch, by layer and type, never by a failing request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache, make_prompt_cache

from protocol.messages import LAYER_FULL, LAYER_OTHER, LAYER_RECURRENT, LAYER_SLIDING

ATTENTION, LINEAR = "attention", "linear"
STATEFUL = (LAYER_RECURRENT, LAYER_SLIDING)  # kept per request in the state pool
BATCHED = ("filter", "extend")  # what the decode batch calls on an mlx-lm merged cache


@dataclass(frozen=True)
class Layers:
    """The model's layer kinds, and for each part of the runner the layers it works on."""

    kinds: list[str]
    full: list[int]  # the KV pool's layers
    linear: list[int]  # recurrent layers: their state goes to the state pool
    windows: list[int]  # sliding-window layers: their window goes to the state pool
    attention: list[int]  # caches that keep K/V and count positions in `offset`
    unpooled: list[int]  # layers the pools cannot restore a prefix of: KV ops are refused

    @classmethod
    def of(cls, kinds: list[str]) -> Layers:
        return cls(kinds=kinds,
                   full=[i for i, k in enumerate(kinds) if k == LAYER_FULL],
                   linear=[i for i, k in enumerate(kinds) if k == LAYER_RECURRENT],
                   windows=[i for i, k in enumerate(kinds) if k == LAYER_SLIDING],
                   attention=[i for i, k in enumerate(kinds) if k in (LAYER_FULL, LAYER_SLIDING)],
                   unpooled=[i for i, k in enumerate(kinds) if k not in STATEFUL + (LAYER_FULL,)])

    @property
    def stateful(self) -> list[int]:
        """The layers a state slot holds: recurrent states and sliding windows."""
        return sorted(self.linear + self.windows)


def _is_attention(module: Any) -> bool:
    parts = ("q_proj", "k_proj", "v_proj", "o_proj", "rope")
    heads = any(hasattr(module, a) for a in ("n_kv_heads", "num_key_value_heads", "n_heads",
                                             "num_attention_heads", "num_heads"))
    return all(hasattr(module, p) for p in parts) and heads


def _is_linear_attention(module: Any) -> bool:
    # Gated delta nets, Mamba-style mixers: a short convolution over the sequence and a
    # recurrent state instead of a growing KV.
    return hasattr(module, "conv1d") and any(
        hasattr(module, a) for a in ("A_log", "in_proj_qkv", "in_proj_qkvz", "in_proj"))


def layer_kinds(model: nn.Module) -> list[str | None]:
    """Layer by layer, the mixer found by duck typing: ATTENTION, LINEAR, or None where the
    layer has neither module this file knows (its cache still decides how it is served)."""
    kinds: list[str | None] = []
    for layer in model.layers:
        children = [m for _, m in layer.children().items() if isinstance(m, nn.Module)]
        if any(_is_attention(m) for m in children):
            kinds.append(ATTENTION)
        elif any(_is_linear_attention(m) for m in children):
            kinds.append(LINEAR)
        else:
            kinds.append(None)
    return kinds


def cache_kind(cache: Any) -> str:
    if isinstance(cache, RotatingKVCache):
        return LAYER_SLIDING
    if isinstance(cache, KVCache):
        return LAYER_FULL
    if isinstance(cache, ArraysCache):
        return LAYER_RECURRENT
    return f"{LAYER_OTHER}:{type(cache).__name__}"


def batchable(cache: Any) -> bool:
    """Rows join the decode batch through `type(c).merge`, a running batch through extend;
    leaving it takes filter. A fresh cache merges like a filled one."""
    merge = getattr(type(cache), "merge", None)
    if merge is None:
        return False
    try:
        merged = merge([cache])
    except Exception:
        return False
    return all(callable(getattr(merged, name, None)) for name in BATCHED)


def classify(model: nn.Module) -> list[str]:
    """Every layer's kind, in layer order; ValueError naming the layers and cache types the
    runner cannot serve."""
    caches = make_prompt_cache(model)
    refused: dict[str, list[int]] = {}
    for i, cache in enumerate(caches):
        if not batchable(cache):
            refused.setdefault(type(cache).__name__, []).append(i)
    if refused:
        named = "; ".join(_layers_named(at, kind) for kind, at in refused.items())
        raise ValueError(f"the runner cannot batch the cache of {named}: mlx-lm gives it no "
                         "merge, or no filter/extend once merged")
    kinds = [cache_kind(c) for c in caches]
    _check_mixers(model, kinds)
    return kinds


def _layers_named(at: list[int], kind: str) -> str:
    """"layer 2 (X)" or "layers 1, 3 (X)"."""
    word = "layers" if len(at) > 1 else "layer"
    return f"{word} {', '.join(map(str, at))} ({kind})"


def _check_mixers(model: nn.Module, kinds: list[str]) -> None:
    """The runner restores a layer's KV or state by the cache's index: a KV cache on a
    linear-attention layer, or a state on an attention layer, means the caches do not follow
    the layers, and a request would resume from the wrong layer's memory."""
    layers = getattr(model, "layers", None)
    if layers is None or len(layers) != len(kinds):
        return  # caches not one per layer (shared KV): nothing to compare them with
    for i, (mixer, kind) in enumerate(zip(layer_kinds(model), kinds)):
        keeps_kv = kind in (LAYER_FULL, LAYER_SLIDING)
        if (mixer == LINEAR and keeps_kv) or (mixer == ATTENTION and kind == LAYER_RECURRENT):
            raise ValueError(f"layer {i} is {mixer} attention but its mlx-lm cache is "
                             f"{kind}: the caches do not follow the layers")
