"""The gated delta kernel (mas_kernels.gated_delta) against mlx-lm's sequential form, on every
instruction-set path this CPU has: gates near 0 and 1 and exactly 0 (a reset), state carried
in from a snapshot, more value heads than key heads, batches of decode rows (T = 1) and prompt
chunks, head dims that are not a multiple of the kernel's row blocks; and its use by the
runner's dispatch (chunked_delta.install). Also the layers' causal convolution kernel."""

from __future__ import annotations

import pytest

mk = pytest.importorskip(
    "mas_kernels", reason="mas_kernels is not built (pip install --no-build-isolation ./native)")
import mlx.core as mx  # noqa: E402
from mlx_lm.models import gated_delta  # noqa: E402

from actors.model_runner import chunked_delta  # noqa: E402
from tests.support.delta import SEQUENTIAL, inputs, rel  # noqa: E402


@pytest.mark.parametrize("gates", [(0.9, 1.0), (0.999, 1.0), (0.0, 0.05), (0.3, 1.0)])
@pytest.mark.parametrize("T,B,Hk,Hv,D", [(1, 16, 2, 4, 32), (37, 2, 2, 4, 32),
                                         (130, 1, 1, 3, 48), (5, 3, 2, 2, 128)])
def test_equals_the_sequential_form(isa, gates, T, B, Hk, Hv, D):
    q, k, v, g, beta, state = inputs(T, gates, B=B, Hk=Hk, Hv=Hv, D=D)
    want_y, want_s = SEQUENTIAL(q, k, v, g, beta, state)
    y, s = mk.gated_delta(q, k, v, g, beta, state)
    assert y.shape == want_y.shape and s.shape == want_s.shape
    assert rel(y, want_y) < 2e-6 and rel(s, want_s) < 2e-6


def test_the_state_input_is_left_as_it_was(isa):
    q, k, v, g, beta, state = inputs(9, (0.5, 1.0))
    before = mx.array(state)
    mx.eval(mk.gated_delta(q, k, v, g, beta, state))
    assert mx.array_equal(state, before)


def test_gates_of_exactly_zero_reset_the_state(isa):
    q, k, v, g, beta, state = inputs(300, (0.5, 1.0))
    g = mx.where(mx.arange(300)[None, :, None] % 7 == 3, 0.0, g)
    want_y, want_s = SEQUENTIAL(q, k, v, g, beta, state)
    y, s = mk.gated_delta(q, k, v, g, beta, state)
    assert not mx.isnan(y).any() and rel(y, want_y) < 2e-6 and rel(s, want_s) < 2e-6


def test_long_runs_of_small_gates_stay_finite(isa):
    """The kernel keeps the state as a scale times stored rows: gates of ~1e-3 for hundreds
    of tokens take the scale far below float's range unless the rows take it in."""
    q, k, v, g, beta, state = inputs(400, (1e-3, 2e-3))
    want_y, want_s = SEQUENTIAL(q, k, v, g, beta, state)
    y, s = mk.gated_delta(q, k, v, g, beta, state)
    assert mx.isfinite(s).all() and rel(y, want_y) < 2e-6 and rel(s, want_s) < 2e-6


def test_refuses_what_it_cannot_run():
    q, k, v, g, beta, state = inputs(4, (0.5, 1.0), D=32)
    with pytest.raises(ValueError, match="inputs must be float32"):
        mk.gated_delta(q.astype(mx.bfloat16), k, v, g, beta, state)
    with pytest.raises(ValueError, match="Dk a multiple of 16"):
        mk.gated_delta(q[..., :24], k[..., :24], v, g, beta, state[..., :24])
    with pytest.raises(ValueError, match="g and beta must be"):
        mk.gated_delta(q, k, v, g[:, :3], beta, state)
    with pytest.raises(ValueError, match="state must be"):
        mk.gated_delta(q, k, v, g, beta, state[:1])
    with pytest.raises(ValueError, match="does not match q"):
        mk.gated_delta(q, k, v[:, :, :3], g[..., :3], beta[..., :3], state[:, :3])


def test_install_sends_every_unmasked_length_to_the_kernel():
    calls, seen = [], []

    def spy(*args):
        calls.append(args[0].shape[1])
        return SEQUENTIAL(*args)

    class Kernels:
        @staticmethod
        def gated_delta(*args):
            seen.append(args[0].shape[1])
            return mk.gated_delta(*args)

    saved = gated_delta.gated_delta_ops
    try:
        gated_delta.gated_delta_ops = spy
        assert chunked_delta.install(True, Kernels)
        q, k, v, g, beta, state = inputs(12, (0.9, 1.0), dtype=mx.bfloat16)
        y, s = gated_delta.gated_delta_ops(q, k, v, g, beta, state)
        want_y, want_s = SEQUENTIAL(q, k, v, g, beta, state)
        assert y.dtype == mx.bfloat16 and s.dtype == mx.float32
        assert rel(y, want_y) < 1e-2 and rel(s, want_s) < 1e-5
        gated_delta.gated_delta_ops(*(x[:, :1] for x in (q, k, v, g, beta)), state)  # decode
        assert seen == [12, 1] and calls == []
        gated_delta.gated_delta_ops(q, k, v, g, beta, state, mx.ones((2, 12), mx.bool_))
        assert calls == [12]  # masked: mlx-lm's own
        assert chunked_delta.install(True, None)  # again, without kernels: the blocks
        gated_delta.gated_delta_ops(q, k, v, g, beta, state)
        assert seen == [12, 1] and calls == [12]
        assert gated_delta.gated_delta_ops.reference is spy
        assert not chunked_delta.install(False) and gated_delta.gated_delta_ops is spy
    finally:
        gated_delta.gated_delta_ops = saved


def test_value_dims_off_the_row_blocks(isa):
    """Dv = 21: row blocks of the task and of the registers end part-way."""
    q, k, _, g, beta, _ = inputs(17, (0.6, 1.0), B=2, Hk=1, Hv=2, D=32)
    v = mx.random.normal((2, 17, 2, 21))
    state = mx.random.normal((2, 2, 21, 32)) * 0.5
    want_y, want_s = SEQUENTIAL(q, k, v, g, beta, state)
    y, s = mk.gated_delta(q, k, v, g, beta, state)
    assert rel(y, want_y) < 2e-6 and rel(s, want_s) < 2e-6


@pytest.mark.parametrize("B,T,C,K", [(1, 1, 3072, 4), (2, 37, 40, 4), (1, 300, 17, 3),
                                     (3, 5, 16, 1)])
def test_causal_conv_equals_mlx_convolution(isa, B, T, C, K):
    """The layers' depthwise convolution (mas_kernels.causal_conv, and ShiftedConv1d through
    it) against MLX's nn.Conv1d; channels not a multiple of 16 take the kernel's scalar tail."""
    import mlx.nn as nn

    conv = nn.Conv1d(C, C, K, groups=C, bias=False)
    x = mx.random.normal((B, T + K - 1, C), key=mx.random.key(T))
    want = conv(x)
    assert rel(mk.causal_conv(x, conv.weight[:, :, 0].T), want) < 1e-6
    assert rel(chunked_delta.ShiftedConv1d(conv, mk)(x), want) < 1e-6
    with pytest.raises(ValueError, match="causal_conv"):
        mk.causal_conv(x, conv.weight[:, :, 0])  # [C, K]: not [K, C]
