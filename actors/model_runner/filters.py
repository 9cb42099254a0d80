"""The top_k / top_p / min_p filters of sampled rows (step 4 of sampling.py's docstring), in one
pass for a batch of rows with different settings."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

NUCLEUS_WIDTH = 1024  # top_p looks for its nucleus among this many best tokens first


def apply_filters(x: mx.array, top_k: np.ndarray, top_p: np.ndarray,
                  min_p: np.ndarray) -> mx.array:
    """Tempered logits [n, V] with the tokens that top_k / top_p / min_p drop set to -inf.
    Per row: top_k 0, top_p 1 and min_p 0 are off. Each filter keeps a set of best tokens, so
    the result is `x >= threshold` for the highest of the per-row thresholds; min_p needs only
    the max (p >= min_p * p_max <=> x >= x_max + log min_p). A full sort of V costs ~10x a
    top-k on CPU, so top_k and top_p sort only the best max(k, NUCLEUS_WIDTH) values; rows
    whose nucleus is wider (a flat distribution) are sorted in full after one host sync."""
    vocab = x.shape[1]
    k = np.where(top_k > 0, np.minimum(top_k, vocab), vocab)
    # top_p 1 keeps all (2 > 1), even where rounding takes the better tokens' mass to 1 early.
    p = np.where(top_p < 1, top_p, 2.0).astype(np.float32)
    if not ((p < 1).any() or (k < vocab).any() or (min_p > 0).any()):
        return x  # temperature alone: nothing to drop
    with np.errstate(divide="ignore"):
        floor = mx.array(np.log(min_p.astype(np.float32)))[:, None]  # log 0 = -inf: off
    thresh = mx.max(x, axis=-1, keepdims=True) + floor
    if (p < 1).any() or (k < vocab).any():
        width = max(int(k[k < vocab].max(initial=0)), NUCLEUS_WIDTH if (p < 1).any() else 0)
        cut, fits = _sorted_cut(x, k, p, min(width, vocab))
        if not fits.all():
            redo = np.flatnonzero(~fits)
            at = mx.array(redo)
            cut[at] = _sorted_cut(x[at], k[redo], p[redo], vocab)[0]
        thresh = mx.maximum(thresh, cut)
    # Ties with a threshold are kept: a filter may keep a few more equal-logit tokens.
    return mx.where(x >= thresh, x, -mx.inf)


def _sorted_cut(x: mx.array, k: np.ndarray, p: np.ndarray,
                width: int) -> tuple[mx.array, np.ndarray]:
    """The top_k / top_p threshold [n, 1] from each row's `width` best values, and whether each
    row's nucleus lies within them (known only after a host sync, taken only when needed)."""
    n, vocab = x.shape
    best = x if width == vocab else mx.topk(x, width, axis=-1)
    s = -mx.sort(-best, axis=-1)  # descending
    kc = mx.array(k)[:, None]
    kth = mx.take_along_axis(s, mx.array(np.minimum(k, width) - 1)[:, None], axis=-1)
    cut = mx.where(kc <= width, kth, -mx.inf)  # k past the width: this row's top_k is off
    if (p > 1).all():
        return cut, np.ones(n, bool)
    # top_p sees the distribution top_k left, renormalized over all that top_k keeps.
    lse = mx.logsumexp(mx.where(x >= cut, x, -mx.inf), axis=-1, keepdims=True)
    probs = mx.exp(mx.where(mx.arange(width)[None] < kc, s, -mx.inf) - lse)
    better = mx.cumsum(probs, axis=-1, inclusive=False)  # mass of the better tokens
    pc = mx.array(p)[:, None]
    keep = mx.sum(better < pc, axis=-1, keepdims=True)  # >= 1: better[0] = 0
    nucleus = mx.take_along_axis(s, keep - 1, axis=-1)  # past the width where top_p is off
    cut = mx.where(pc < 1, mx.maximum(cut, nucleus), cut)
    if width == vocab:
        return cut, np.ones(n, bool)
    mass = better[:, -1] + probs[:, -1]  # of all `width` values: the nucleus fits if >= p
    return cut, np.array(mass >= pc[:, 0]) | (p > 1)
