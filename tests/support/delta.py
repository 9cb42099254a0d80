"""Inputs of the gated delta rule (hybrid models' linear attention) and the reference it is
checked against: mlx-lm's sequential form."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models import gated_delta
from mlx_lm.models.gated_delta import normalize_qk

SEQUENTIAL = getattr(gated_delta.gated_delta_ops, "reference", gated_delta.gated_delta_ops)


def inputs(T, gates, B=2, Hk=2, Hv=4, D=32, seed=0, dtype=mx.float32, state_scale=0.5):
    mx.random.seed(seed)
    q, k = mx.random.normal((B, T, Hk, D)), mx.random.normal((B, T, Hk, D))
    q, k = normalize_qk(q, k, inv_scale=D**-0.5, eps=1e-6)
    v = mx.random.normal((B, T, Hv, D))
    g = mx.random.uniform(*gates, (B, T, Hv))
    beta = mx.random.uniform(0, 1, (B, T, Hv))
    state = mx.random.normal((B, Hv, D, D)) * state_scale  # carried in, as from a snapshot
    return q.astype(dtype), k.astype(dtype), v.astype(dtype), g, beta, state


def rel(a, b) -> float:
    return float(mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max()
                 / mx.abs(b.astype(mx.float32)).max())
