"""The gated delta rule in blocks against mlx-lm's sequential form, on random inputs."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models import gated_delta
from mlx_lm.models.gated_delta import normalize_qk

from actors.model_runner import chunked_delta
from actors.model_runner.chunked_delta import chunked_gated_delta
from tests.support.delta import SEQUENTIAL, inputs, rel

@pytest.mark.parametrize("gates", [(0.9, 1.0), (0.999, 1.0), (0.0, 0.05), (0.3, 1.0)])
@pytest.mark.parametrize("T,block", [(37, 16), (130, 32), (200, 64), (64, 64), (5, 64)])
def test_blocks_equal_the_sequential_form(gates, T, block):
    q, k, v, g, beta, state = inputs(T, gates)
    want_y, want_s = SEQUENTIAL(q, k, v, g, beta, state)
    y, s = chunked_gated_delta(q, k, v, g, beta, state, block=block)
    assert y.shape == want_y.shape and s.shape == want_s.shape
    assert rel(y, want_y) < 2e-6 and rel(s, want_s) < 2e-6


def test_gates_of_exactly_zero_reset_the_state():
    q, k, v, g, beta, state = inputs(50, (0.5, 1.0))
    g = mx.where(mx.arange(50)[None, :, None] % 7 == 3, 0.0, g)
    want_y, want_s = SEQUENTIAL(q, k, v, g, beta, state)
    y, s = chunked_gated_delta(q, k, v, g, beta, state, block=16)
    assert not mx.isnan(y).any() and rel(y, want_y) < 2e-6 and rel(s, want_s) < 2e-6


def test_bf16_activations_keep_their_dtype_and_a_float32_state():
    q, k, v, g, beta, state = inputs(40, (0.8, 1.0), dtype=mx.bfloat16)
    want_y, want_s = SEQUENTIAL(q, k, v, g, beta, state)
    y, s = chunked_gated_delta(q, k, v, g, beta, state, block=16)
    assert y.dtype == mx.bfloat16 and s.dtype == mx.float32
    assert rel(y, want_y) < 1e-2 and rel(s, want_s) < 1e-5


def test_a_state_run_in_two_pieces_equals_one_run():
    q, k, v, g, beta, state = inputs(90, (0.7, 1.0))
    y, s = chunked_gated_delta(q, k, v, g, beta, state, block=32)
    y1, s1 = chunked_gated_delta(q[:, :41], k[:, :41], v[:, :41], g[:, :41], beta[:, :41],
                                 state, block=32)
    y2, s2 = chunked_gated_delta(q[:, 41:], k[:, 41:], v[:, 41:], g[:, 41:], beta[:, 41:],
                                 s1, block=32)
    assert rel(mx.concatenate([y1, y2], axis=1), y) < 2e-6 and rel(s2, s) < 2e-6


def test_install_dispatches_by_length_and_mask_and_can_be_undone():
    calls = []

    def spy(*args):
        calls.append(args[0].shape[1])
        return SEQUENTIAL(*args)

    saved = gated_delta.gated_delta_ops
    try:
        gated_delta.gated_delta_ops = spy
        assert chunked_delta.install(True)
        assert chunked_delta.install(True) and gated_delta.gated_delta_ops.reference is spy
        q, k, v, g, beta, state = inputs(12, (0.9, 1.0))
        y, _ = gated_delta.gated_delta_ops(q, k, v, g, beta, state)  # blocks
        assert calls == []
        want_y, _ = SEQUENTIAL(q, k, v, g, beta, state)
        assert rel(y, want_y) < 2e-6
        one = [x[:, :1] for x in (q, k, v, g, beta)]
        gated_delta.gated_delta_ops(*one, state)  # a decode row: the loop
        mask = mx.ones((2, 12), dtype=mx.bool_)
        gated_delta.gated_delta_ops(q, k, v, g, beta, state, mask)  # masked: the loop
        assert calls == [1, 12]
        assert not chunked_delta.install(False) and gated_delta.gated_delta_ops is spy
    finally:
        gated_delta.gated_delta_ops = saved


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("T", [4, 5, 40])
def test_shifted_sums_equal_mlx_depthwise_convolution(bias, T):
    import mlx.nn as nn

    conv = nn.Conv1d(24, 24, 4, groups=24, bias=bias)
    x = mx.random.normal((2, T, 24))
    assert rel(chunked_delta.ShiftedConv1d(conv)(x), conv(x)) < 1e-6


def test_apply_swaps_only_causal_depthwise_convolutions():
    import mlx.nn as nn

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1d = nn.Conv1d(16, 16, 4, groups=16, bias=False)
            self.dense = nn.Conv1d(16, 16, 4)  # not depthwise
            self.padded = nn.Conv1d(16, 16, 4, groups=16, padding=3)

    model = nn.Sequential(Layer(), Layer())
    assert chunked_delta.apply(model) == 2
    layer = model.layers[0]
    assert isinstance(layer.conv1d, chunked_delta.ShiftedConv1d)
    assert isinstance(layer.dense, nn.Conv1d) and isinstance(layer.padded, nn.Conv1d)
    assert "conv1d.weight" in dict(mlx_flatten(layer.parameters()))
    assert chunked_delta.apply(model) == 0  # once


def mlx_flatten(tree):
    from mlx.utils import tree_flatten

    return tree_flatten(tree)
