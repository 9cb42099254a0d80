"""RMS norm and RoPE as one graph node each (mas_kernels.rms_norm / rope, cpu/norm_rope.py):
the same values as MLX's mx.fast.rms_norm and mx.fast.rope for the shapes and options the
models use, per-row offsets as the decode batch gives them, MLX's very bits in bfloat16, and
the runner's switch of exact nn.RMSNorm / nn.RoPE modules (float32 and bfloat16; float16
keeps MLX's path)."""

from __future__ import annotations

import numpy as np
import pytest

mk = pytest.importorskip(
    "mas_kernels", reason="mas_kernels is not built (pip install --no-build-isolation ./native)")
import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402

from actors.model_runner.cpu import norm_rope  # noqa: E402


@pytest.mark.parametrize("shape", [(1, 1, 512), (16, 1, 64), (3, 7, 80), (5, 128)])
def test_rms_norm_equals_mlx(shape):
    x = mx.random.normal(shape, key=mx.random.key(1)) * 3
    w = mx.random.normal((shape[-1],), key=mx.random.key(2))
    got, want = mk.rms_norm(x, w, 1e-6), mx.fast.rms_norm(x, w, 1e-6)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-6, atol=1e-6)
    strided = x.swapaxes(0, -2) if x.ndim == 3 else x.T  # a view the kernel copies first
    np.testing.assert_allclose(np.array(mk.rms_norm(strided, mx.ones((strided.shape[-1],)), 1e-5)),
                               np.array(mx.fast.rms_norm(strided, mx.ones((strided.shape[-1],)),
                                                         1e-5)), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("dims", [64, 32])
def test_rope_equals_mlx_per_row_and_scalar_offsets(traditional, dims):
    x = mx.random.normal((4, 8, 3, 64), key=mx.random.key(3))
    # Positions of hundreds: both are within ~2e-5 of a float64 reference there (the float32
    # angle's rounding), so they differ by up to about twice that.
    rows = mx.array([0, 5, 100, 300], dtype=mx.int32)
    got = mk.rope(x, dims, traditional, 1e6, 1.0, rows)
    want = mx.fast.rope(x, dims, traditional=traditional, base=1e6, scale=1.0, offset=rows)
    np.testing.assert_allclose(np.array(got), np.array(want), atol=5e-5)
    got = mk.rope(x, dims, traditional, 1e4, 0.5, mx.array([7], dtype=mx.int32))
    want = mx.fast.rope(x, dims, traditional=traditional, base=1e4, scale=0.5, offset=7)
    np.testing.assert_allclose(np.array(got), np.array(want), atol=2e-6)
    if dims < 64:  # the features past dims pass through
        assert mx.array_equal(got[..., dims:], x[..., dims:]).item()


def _bf16(shape, seed, scale=1.0):
    return (mx.random.normal(shape, key=mx.random.key(seed)) * scale).astype(mx.bfloat16)


@pytest.mark.parametrize("shape", [(1, 1, 512), (16, 1, 64), (3, 7, 80), (5, 128)])
def test_bf16_rms_norm_has_mlx_bits(shape):
    """A bf16 model's norms: MLX rounds x * rsqrt(mean(x^2) + eps) to bf16, then the product
    with the weight; the kernel rounds at the same places, from the same float32 mean."""
    x, w = _bf16(shape, 1, 3.0), _bf16((shape[-1],), 2)
    got = mk.rms_norm(x, w, 1e-6)
    assert got.dtype == mx.bfloat16
    assert mx.array_equal(got, mx.fast.rms_norm(x, w, 1e-6)).item()


@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("offsets", [[0], [7], [3000], [100_000], [1, 50, 900, 4000]])
def test_bf16_rope_has_mlx_bits(traditional, offsets):
    """bf16 RoPE: MLX's cos/sin (its own polynomials, unlike the C library's a few ulps away
    at positions of thousands) rounded to bf16, and every product and sum rounded: the same
    bits at every position."""
    x = _bf16((len(offsets), 8, 5, 64), 3, 2.0)
    rows = mx.array(offsets, dtype=mx.int32)
    got = mk.rope(x, 64, traditional, 1e6, 1.0, rows)
    want = mx.fast.rope(x, 64, traditional=traditional, base=1e6, scale=1.0,
                        offset=rows if len(offsets) > 1 else offsets[0])
    assert got.dtype == mx.bfloat16 and mx.array_equal(got, want).item()
    half = mk.rope(x, 32, traditional, 1e4, 0.5, rows)  # features past dims pass through
    assert mx.array_equal(half, mx.fast.rope(x, 32, traditional=traditional, base=1e4,
                                             scale=0.5, offset=rows if len(offsets) > 1
                                             else offsets[0])).item()


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="float32 or both bfloat16"):
        mk.rms_norm(mx.zeros((2, 8), mx.float16), mx.zeros((8,), mx.float16), 1e-6)
    with pytest.raises(ValueError, match="float32 or both bfloat16"):
        mk.rms_norm(mx.zeros((2, 8), mx.bfloat16), mx.zeros((8,)), 1e-6)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        mk.rope(mx.zeros((2, 4, 1, 16), mx.float16), 16, False, 1e4, 1.0,
                mx.array([0], dtype=mx.int32))
    with pytest.raises(ValueError, match=r"weight must be \[8\]"):
        mk.rms_norm(mx.zeros((2, 8)), mx.zeros((4,)), 1e-6)
    x = mx.zeros((2, 4, 1, 16))
    with pytest.raises(ValueError, match=r"\[batch, heads, tokens, dim\]"):
        mk.rope(mx.zeros((2, 1, 16)), 16, False, 1e4, 1.0, mx.array([0], dtype=mx.int32))
    with pytest.raises(ValueError, match="dims must be even"):
        mk.rope(x, 15, False, 1e4, 1.0, mx.array([0], dtype=mx.int32))
    with pytest.raises(ValueError, match="offsets must be int32"):
        mk.rope(x, 16, False, 1e4, 1.0, mx.array([0, 1, 2], dtype=mx.int32))


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("traditional,dims,offsets", [(False, 64, [0, 17, 300]), (True, 32, [5])])
def test_norm_rope_is_the_norm_then_the_rope_bit_for_bit(dtype, traditional, dims, offsets):
    """One token per row, [rows, 1, heads x dim] in: the very values of rms_norm on the heads
    then rope, the two nodes it stands in for (cpu/qwen3_layers.py)."""
    x = (mx.random.normal((3, 1, 8 * 64), key=mx.random.key(7)) * 3).astype(dtype)
    w = mx.random.normal((64,), key=mx.random.key(8)).astype(dtype)
    off = mx.array(offsets, dtype=mx.int32)
    want = mk.rope(mk.rms_norm(x.reshape(3, 8, 1, 64), w, 1e-6), dims, traditional, 1e6, 1.0, off)
    got = mk.norm_rope(x, w, 1e-6, 8, dims, traditional, 1e6, 1.0, off)
    assert got.shape == (3, 8, 1, 64) and got.dtype == dtype
    assert mx.array_equal(got, want).item()


def test_norm_rope_bad_arguments_raise():
    w, off = mx.zeros((16,)), mx.array([0], dtype=mx.int32)
    with pytest.raises(ValueError, match="float32 or both bfloat16"):
        mk.norm_rope(mx.zeros((2, 1, 64), mx.float16), w.astype(mx.float16), 1e-6, 4, 16,
                     False, 1e4, 1.0, off)
    with pytest.raises(ValueError, match=r"\[rows, 1, heads x dim\] with 3 heads"):
        mk.norm_rope(mx.zeros((2, 1, 64)), w, 1e-6, 3, 16, False, 1e4, 1.0, off)
    with pytest.raises(ValueError, match=r"\[rows, 1, heads x dim\]"):
        mk.norm_rope(mx.zeros((2, 2, 64)), w, 1e-6, 4, 16, False, 1e4, 1.0, off)
    with pytest.raises(ValueError, match=r"weight must be \[16\]"):
        mk.norm_rope(mx.zeros((2, 1, 64)), mx.zeros((8,)), 1e-6, 4, 16, False, 1e4, 1.0, off)
    with pytest.raises(ValueError, match="dims must be even"):
        mk.norm_rope(mx.zeros((2, 1, 64)), w, 1e-6, 4, 18, False, 1e4, 1.0, off)
    with pytest.raises(ValueError, match="offsets must be int32"):
        mk.norm_rope(mx.zeros((2, 1, 64)), w, 1e-6, 4, 16, False, 1e4, 1.0,
                     mx.array([0, 1, 2], dtype=mx.int32))


def test_apply_switches_exact_modules_and_keeps_fp16_on_mlx(monkeypatch):
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.RMSNorm(32)
            self.rope = nn.RoPE(32, base=1e4)
            self.other = type("OwnRoPE", (nn.RoPE,), {})(32)  # a variant: left alone

    block = Block()
    assert norm_rope.apply(block, mk) == 2
    assert type(block.norm) is norm_rope.KernelRMSNorm and type(block.other).__name__ == "OwnRoPE"
    assert norm_rope.apply(block, mk) == 0  # already switched
    calls = []
    for name in ("rms_norm", "rope"):
        real = getattr(mk, name)
        monkeypatch.setattr(mk, name, lambda *a, real=real, name=name: calls.append(name)
                            or real(*a))
    x = mx.random.normal((2, 4, 3, 32), key=mx.random.key(4))
    np.testing.assert_allclose(np.array(block.rope(x, offset=mx.array([3, 9]))),
                               np.array(mx.fast.rope(x, 32, traditional=False, base=1e4,
                                                     scale=1.0, offset=mx.array([3, 9]))),
                               atol=2e-6)
    np.testing.assert_allclose(np.array(block.norm(x)),
                               np.array(mx.fast.rms_norm(x, block.norm.weight, 1e-5)),
                               rtol=1e-6, atol=1e-6)
    assert calls == ["rope", "rms_norm"]
    block.norm(x.astype(mx.float16))
    block.rope(x.astype(mx.float16), offset=2)
    assert calls == ["rope", "rms_norm"]  # float16: MLX's own path
    block.norm.weight = block.norm.weight.astype(mx.bfloat16)
    half = x.astype(mx.bfloat16)
    assert mx.array_equal(block.norm(half), mx.fast.rms_norm(half, block.norm.weight,
                                                             1e-5)).item()
    assert mx.array_equal(block.rope(half, offset=2), mx.fast.rope(
        half, 32, traditional=False, base=1e4, scale=1.0, offset=2)).item()
    assert calls == ["rope", "rms_norm", "rms_norm", "rope"]  # bf16: the kernels, MLX's bits
