"""Loading the served model's weights onto the MLX thread (the runner only; what every actor
knows about the model without MLX is models/info.py)."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn


def load_model(path: str) -> nn.Module:
    from mlx_lm.utils import load_model as mlx_lm_load_model

    model, _ = mlx_lm_load_model(Path(path))
    mx.eval(model.parameters())
    return model
