"""The fast softmax and SiLU paths, through the compiled kernels or NumPy: MLX's results to float
rounding where one is taken, MLX's own path bit for bit everywhere else (outside active(),
small shapes, other dtypes)."""

from __future__ import annotations

import sys
import warnings

import mlx.core as mx
import numpy as np
import mlx.nn as nn
import pytest
from mlx_lm.models import activations, base, qwen3, qwen3_next
from mlx_lm.models.cache import make_prompt_cache

from actors.model_runner.cpu import fastmath
from models.builtin import ensure_builtin
from actors.model_runner.loading import load_model

try:
    import mas_kernels
except ImportError:  # not built: the NumPy path only
    mas_kernels = None


@pytest.fixture(params=["numpy", "kernels"])
def path(request, monkeypatch):
    """Which path fastmath takes: NumPy's exp, or mas_kernels' silu and softmax."""
    if request.param == "kernels" and mas_kernels is None:
        pytest.skip("mas_kernels is not built")
    monkeypatch.setattr(fastmath, "_kernels", mas_kernels if request.param == "kernels" else None)
    return request.param


MASKS = {
    "none": lambda b, h, n, w: None,
    "causal": lambda b, h, n, w: "causal",
    "bool, one per row": lambda b, h, n, w: mx.random.uniform(shape=(b, 1, n, w)) > 0.3,
    "bool, per head": lambda b, h, n, w: mx.random.uniform(shape=(b, h, n, w)) > 0.3,
    "additive 2-d": lambda b, h, n, w: mx.random.normal((n, w)),
}


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("b, heads, kv_heads, length, width", [
    (1, 8, 4, 300, 300),  # a first prefill chunk, GQA
    (2, 8, 2, 100, 400),  # a later chunk: queries are the last 100 of 400 positions
    (16, 8, 8, 1, 384),  # a decode step of 16 rows
])
def test_attention_matches_mlx(path, mask, b, heads, kv_heads, length, width):
    mx.random.seed(3)
    q = mx.random.normal((b, heads, length, 64))
    k, v = mx.random.normal((2, b, kv_heads, width, 64))
    m = MASKS[mask](b, heads, length, width)
    want = base.scaled_dot_product_attention(q, k, v, None, scale=0.125, mask=m)
    with fastmath.active():
        got = fastmath.attention(q, k, v, None, scale=0.125, mask=m)
    assert got.shape == want.shape
    assert mx.allclose(got, want, atol=2e-6, rtol=1e-5).item()
    # Outside active(): MLX's own path, bit for bit.
    assert mx.array_equal(fastmath.attention(q, k, v, None, scale=0.125, mask=m), want).item()


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("b, heads, kv_heads, length, width", [
    (1, 8, 4, 300, 300), (2, 8, 2, 100, 400)])
def test_bf16_attention_is_mlxs_under_every_mask(monkeypatch, mask, b, heads, kv_heads,
                                                     length, width):
    """A bf16 prompt chunk through the kernels: MLX's bf16 attention, whatever the mask
    (causal inside the softmax kernel; bool and bf16 additive ones built here); a float32
    additive mask is MLX's own error, as on MLX's path. The softmax is MLX's bit for bit; the
    two products sum their exact float32 terms in the BLAS's order, not MLX's, so now and then
    (~1e-4 of the outputs with MKL) a sum on a bf16 rounding boundary rounds the other way:
    one bf16 step apart, nothing more."""
    if mas_kernels is None:
        pytest.skip("mas_kernels is not built")
    monkeypatch.setattr(fastmath, "_kernels", mas_kernels)
    mx.random.seed(5)
    q = (mx.random.normal((b, heads, length, 64)) * 2).astype(mx.bfloat16)
    k, v = (mx.random.normal((2, b, kv_heads, width, 64)) * 2).astype(mx.bfloat16)
    m = MASKS[mask](b, heads, length, width)
    if isinstance(m, mx.array) and m.dtype == mx.float32:
        with fastmath.active(), pytest.raises(ValueError, match="Mask type must promote"):
            fastmath.attention(q, k, v, None, scale=0.125, mask=m)
        m = m.astype(mx.bfloat16)
    want = base.scaled_dot_product_attention(q, k, v, None, scale=0.125, mask=m)
    with fastmath.active():
        got = fastmath.attention(q, k, v, None, scale=0.125, mask=m)
    assert got.dtype == mx.bfloat16
    g, w = (np.array(a.astype(mx.float32)) for a in (got, want))
    off = g != w
    assert off.mean() < 1e-3
    big = np.maximum(np.abs(g), np.abs(w))[off]
    step = 2.0 ** (np.floor(np.log2(big)) - 7)  # one bf16 step there (8 significant bits)
    # ... or, where the sum cancelled to near 0, float32 rounding of its terms' size.
    assert (np.abs(g - w)[off] <= np.maximum(step, 1e-5 * np.abs(w).max())).all()


def test_small_or_low_precision_inputs_stay_on_mlx(path):
    mx.random.seed(4)
    q = mx.random.normal((1, 4, 8, 32))  # 4 * 8 * 8 scores: below MIN_ELEMENTS
    k, v = mx.random.normal((2, 1, 4, 8, 32))
    want = base.scaled_dot_product_attention(q, k, v, None, scale=0.2, mask="causal")
    with fastmath.active():
        assert mx.array_equal(fastmath.attention(q, k, v, None, 0.2, "causal"), want).item()
        # bf16: MLX's path, or with the kernels its bits (repeated keys: many equal weights,
        # where a sum in another order would round one of them differently).
        half = [a.astype(mx.bfloat16) for a in (q, k, v)]
        big = [mx.repeat(a, 40, axis=2) for a in half]
        stock = base.scaled_dot_product_attention(*big, None, scale=0.2, mask="causal")
        assert mx.array_equal(fastmath.attention(*big, None, 0.2, "causal"), stock).item()
        gate = mx.random.normal((4, 16))
        if path == "numpy":  # the kernel takes every size: it never leaves the graph
            assert mx.array_equal(fastmath.swiglu(gate, gate),
                                  activations.swiglu(gate, gate)).item()
        gate = gate.astype(mx.bfloat16)
        assert mx.array_equal(fastmath.swiglu(gate, gate), activations.swiglu(gate, gate)).item()


def test_swiglu_matches_mlx_and_saturates_quietly(path):
    mx.random.seed(5)
    gate = mx.random.normal((300, 1536)) * 6
    gate[0, :4] = mx.array([-200.0, -89.0, 89.0, 0.0])
    x = mx.random.normal((300, 1536))
    want = activations.swiglu(gate, x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no numpy overflow warning for exp(200)
        with fastmath.active():
            got = fastmath.swiglu(gate, x)
    assert mx.allclose(got, want, atol=1e-5, rtol=1e-5).item()
    assert got[0, 0].item() == 0.0


def test_install_patches_the_model_modules_once():
    # Earlier runners in this process may have installed already: start from stock.
    for module in (qwen3, qwen3_next):
        module.scaled_dot_product_attention = base.scaled_dot_product_attention
        module.swiglu = activations.swiglu
    model = qwen3.Model(qwen3.ModelArgs(
        model_type="qwen3", hidden_size=64, num_hidden_layers=1, intermediate_size=128,
        num_attention_heads=4, rms_norm_eps=1e-6, vocab_size=100, num_key_value_heads=2,
        max_position_embeddings=128, rope_theta=1e4, head_dim=16, tie_word_embeddings=True))
    assert fastmath.install(model) == 2
    assert qwen3.scaled_dot_product_attention is fastmath.attention
    assert qwen3.swiglu is fastmath.swiglu
    assert qwen3_next.swiglu is activations.swiglu  # not this model's module
    assert fastmath.install(model) == 0


# Per model: the globals of its layers' modules that install() points at fastmath.
ROUTED = {
    "qwen3-tiny": [("qwen3", "scaled_dot_product_attention"), ("qwen3", "swiglu")],
    "qwen3_5-tiny": [("qwen3_5", "nn"), ("qwen3_next", "nn"), ("qwen3_next", "precise_swiglu"),
                     ("qwen3_next", "scaled_dot_product_attention"), ("qwen3_next", "swiglu")],
}


def routed(model) -> list[tuple[str, str]]:
    """(module, global) pairs of the model's layers' modules that are fastmath's, sorted."""
    ours = (fastmath.attention, fastmath.swiglu, fastmath.precise_swiglu, fastmath._nn)
    modules = {sys.modules[type(layer).__module__] for _, layer in model.named_modules()}
    return sorted((mod.__name__.rsplit(".", 1)[-1], name) for mod in modules
                  for name, value in vars(mod).items() if any(value is f for f in ours))


@pytest.mark.parametrize("name", ROUTED)
def test_greedy_tokens_are_unchanged_on_a_real_model(path, model_cache, name, monkeypatch):
    # The tiny models' SiLU inputs are below the prefill-sized threshold: lower it, so that
    # both NumPy paths run here (the kernels take every size).
    monkeypatch.setattr(fastmath, "SWIGLU_MIN_ELEMENTS", fastmath.MIN_ELEMENTS)
    path = str(ensure_builtin(name, cache_dir=model_cache, progress=False))
    plain, fast = load_model(path), load_model(path)
    prompt = mx.array([[1000 + (7 * r + 13 * i) % 50000 for i in range(200)] for r in range(2)])

    def greedy(model, on: bool) -> list:
        cache = make_prompt_cache(model)
        out = []
        with fastmath.active(on):
            logits = model(prompt, cache=cache)[:, -1, :]
            for _ in range(12):
                token = mx.argmax(logits, axis=-1)
                out.append(token.tolist())
                logits = model(token[:, None], cache=cache)[:, -1, :]
        return out, logits

    want, want_logits = greedy(plain, on=False)
    fastmath.install(fast, fastmath._kernels)  # may change nothing: module globals outlive a
    # test, and an earlier one may have installed them. Either way, the fast model's attention
    # and SwiGLU (qwen3_5's SiLU too) now go through fastmath, and nothing else does.
    assert routed(fast) == ROUTED[name]
    stock, stock_logits = greedy(fast, on=False)  # installed but inactive: the same bits
    assert stock == want and mx.array_equal(stock_logits, want_logits).item()
    got, got_logits = greedy(fast, on=True)
    assert got == want
    assert mx.allclose(got_logits, want_logits, atol=1e-3).item()
    assert not mx.array_equal(got_logits, want_logits).item()  # the fast path did run


def test_silu_and_precise_swiglu_match_mlx(path):
    mx.random.seed(6)
    x = mx.random.normal((300, 1024)) * 6
    x[0, :3] = mx.array([-200.0, 89.0, 0.0])
    h = mx.random.normal((300, 1024))
    with fastmath.active():
        got_silu = fastmath.silu(x)
        got_gated = fastmath.precise_swiglu(h, x, h)
    assert mx.allclose(got_silu, nn.silu(x), atol=1e-5, rtol=1e-5).item()
    assert mx.allclose(got_gated, activations.precise_swiglu(h, x, h), atol=1e-5,
                       rtol=1e-5).item()
    small = x[:2, :8]
    with fastmath.active():  # NumPy below the threshold: MLX's own, bit for bit
        assert mx.array_equal(fastmath.silu(small), nn.silu(small)).item() == (path == "numpy")


def test_install_gives_the_hybrid_modules_the_fast_silu(model_cache):
    from mlx_lm.models import qwen3_5

    qwen3_5.nn = nn
    qwen3_next.precise_swiglu = activations.precise_swiglu
    model = load_model(str(ensure_builtin("qwen3_5-tiny", cache_dir=model_cache,
                                          progress=False)))
    assert fastmath.install(model) >= 2
    assert qwen3_5.nn.silu is fastmath.silu and qwen3_5.nn.Linear is nn.Linear
    assert qwen3_next.precise_swiglu is fastmath.precise_swiglu
    assert qwen3.nn is nn  # no `nn.silu(` call there: left alone
    assert fastmath.install(model) == 0
