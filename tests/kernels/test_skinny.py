"""The skinny-matmul path: the same products as MLX's x @ W.T, switched in only where it is
meant to be (exact nn.Linear / nn.Embedding, 2-128 rows; 1-32 rows through the compiled
float32 kernel where it is built)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.cache import make_prompt_cache

from actors.model_runner.cpu import skinny
from models.builtin import ensure_builtin
from actors.model_runner.loading import load_model


@pytest.mark.parametrize("shape", [(1, 64), (2, 64), (5, 1, 64), (3, 4, 64), (128, 64),
                                   (129, 64), (2, 200, 64)])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_gives_the_same_product(shape, bias):
    mx.random.seed(0)
    layer = nn.Linear(64, 96, bias=bias)
    x = mx.random.normal(shape)
    want = layer(x)
    layer.__class__ = skinny.SkinnyLinear
    got = layer(x)
    assert got.shape == want.shape == (*shape[:-1], 96)
    assert mx.allclose(got, want, atol=1e-5).item()
    rows = x.size // 64
    if not 2 <= rows <= skinny.MAX_ROWS:  # outside the range: MLX's own path, bit for bit
        assert mx.array_equal(got, want).item()


@pytest.mark.parametrize("shape", [(1, 64), (1, 1, 64), (7, 64), (4, 2, 64), (3, 3, 64),
                                   (33, 64)])
def test_kernel_layers_give_the_same_product(shape, monkeypatch):
    kernels = pytest.importorskip("mas_kernels")
    mx.random.seed(2)
    model = nn.Sequential(nn.Linear(64, 96), nn.Embedding(300, 64))
    x = mx.random.normal(shape)
    want = model.layers[0](x), model.layers[1].as_linear(x)
    assert skinny.apply(model, kernels) == 2
    assert [type(m) for m in model.layers] == [skinny.KernelLinear, skinny.KernelEmbedding]
    calls = []

    class Spy:  # the kernels, counting the products they take
        def f32_matmul(self, *args):
            calls.append(args[0].shape)
            return kernels.f32_matmul(*args)

    monkeypatch.setattr(skinny, "_kernels", Spy())
    got = model.layers[0](x), model.layers[1].as_linear(x)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        assert mx.allclose(g, w, atol=1e-5).item()
    rows = x.size // 64
    assert len(calls) == (2 if rows <= skinny.KERNEL_ROWS else 0)


def test_large_weights_take_the_kernel_for_more_rows():
    assert skinny.kernel_rows(mx.zeros((1536, 512))) == skinny.KERNEL_ROWS
    assert skinny.kernel_rows(mx.zeros((151936, 8))) == skinny.KERNEL_ROWS_LARGE


def test_tied_embedding_head_gives_the_same_logits():
    mx.random.seed(1)
    emb = nn.Embedding(1000, 32)
    h = mx.random.normal((4, 1, 32))
    want = emb.as_linear(h)
    emb.__class__ = skinny.SkinnyEmbedding
    assert mx.allclose(emb.as_linear(h), want, atol=1e-5).item()
    ids = mx.array([[1, 2, 3]])
    assert mx.array_equal(emb(ids), emb.weight[ids]).item()  # lookup unchanged


def test_apply_switches_only_plain_layers():
    model = nn.Sequential(nn.Embedding(50, 32), nn.Linear(32, 64), nn.QuantizedLinear(64, 64),
                          nn.Linear(64, 8, bias=False))
    assert skinny.apply(model) == 3
    kinds = [type(layer) for layer in model.layers]
    assert kinds == [skinny.SkinnyEmbedding, skinny.SkinnyLinear, nn.QuantizedLinear,
                     skinny.SkinnyLinear]
    assert skinny.apply(model) == 0  # already switched: a second runner changes nothing


def test_batched_greedy_decode_is_unchanged_on_a_real_model(model_cache):
    path = str(ensure_builtin("qwen3-tiny", cache_dir=model_cache, progress=False))
    plain, fast = load_model(path), load_model(path)
    assert skinny.apply(fast) > 0

    def decode(model) -> list:
        prompt = mx.array([[1000 + (7 * r + 13 * i) % 50000 for i in range(40)]
                           for r in range(4)])
        cache = make_prompt_cache(model)
        logits = model(prompt, cache=cache)[:, -1, :]
        out = []
        for _ in range(16):
            token = mx.argmax(logits, axis=-1)
            out.append(token.tolist())
            logits = model(token[:, None], cache=cache)[:, -1, :]
        return out

    assert decode(fast) == decode(plain)
