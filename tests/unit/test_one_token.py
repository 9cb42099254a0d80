"""mlx-lm's Qwen3 attention in its one-token form (cpu/one_token.py): for one token per row
the very values of mlx-lm's layer (the decode batch's paged cache, mlx-lm's own cache, no
cache), four graph nodes fewer, eight with the kernels' norms and RoPE (their fused node);
prompt chunks run mlx-lm's code; only exact Qwen3 attention layers are switched, once."""

from __future__ import annotations

import re

import mlx.core as mx
import pytest
from mlx_lm.models import qwen3
from mlx_lm.models.cache import KVCache, make_prompt_cache

from actors.model_runner.cpu import one_token
from actors.model_runner.decode_batch import DecodeBatch
from actors.model_runner.loading import load_model
from models.builtin import ensure_builtin


@pytest.fixture(scope="module")
def layers(model_cache):
    path = str(ensure_builtin("qwen3-tiny", cache_dir=model_cache, progress=False))
    stock, ours = load_model(path), load_model(path)
    assert one_token.apply(ours) == len(ours.model.layers)
    assert one_token.apply(ours) == 0  # a second call switches none
    assert type(stock.model.layers[0].self_attn) is qwen3.Attention
    return stock, ours


def _nodes(out: mx.array, tmp_path) -> list[str]:
    mx.export_to_dot(str(tmp_path / "g.dot"), out)
    return re.findall(r'label ="([^"]+)"', (tmp_path / "g.dot").read_text())


def test_one_token_rows_get_mlx_lms_values_in_fewer_nodes(layers, tmp_path):
    stock, ours = layers
    a, b = stock.model.layers[0].self_attn, ours.model.layers[0].self_attn
    x = mx.random.normal((3, 1, stock.args.hidden_size), key=mx.random.key(4))
    # No cache; mlx-lm's own cache after a 5-token prompt.
    assert mx.array_equal(a(x), b(x)).item()
    caches = []
    for layer in (a, b):
        cache = KVCache()
        layer(mx.random.normal((3, 5, stock.args.hidden_size), key=mx.random.key(5)),
              cache=cache)
        caches.append(cache)
    want, got = a(x, cache=caches[0]), b(x, cache=caches[1])
    assert mx.array_equal(want, got).item()
    assert mx.array_equal(caches[0].keys[..., :6, :], caches[1].keys[..., :6, :]).item()
    # The decode batch's paged cache, rows of different lengths.
    outs = []
    for model in (stock, ours):
        batch = DecodeBatch()
        for row, n in ((1, 4), (2, 19), (3, 7)):
            prompt = make_prompt_cache(model)
            mx.eval(model(mx.array([[5 + row] * n]), cache=prompt))
            batch.join(row, prompt)
        tokens = mx.array([0, 11, 12, 13], dtype=mx.int32)
        outs.append(model(batch.inputs(tokens), cache=batch.caches))
    mine, theirs = _nodes(outs[1], tmp_path), _nodes(outs[0], tmp_path)
    assert len(theirs) - len(mine) == 4 * len(stock.model.layers), (len(theirs), len(mine))
    assert theirs.count("Transpose") - mine.count("Transpose") == 4 * len(stock.model.layers)
    assert mx.array_equal(outs[0], outs[1]).item()


def test_prompt_chunks_run_mlx_lms_code(layers, tmp_path):
    stock, ours = layers
    a, b = stock.model.layers[1].self_attn, ours.model.layers[1].self_attn
    x = mx.random.normal((2, 6, stock.args.hidden_size), key=mx.random.key(6))
    got = b(x, cache=KVCache())
    assert "Transpose" in _nodes(got, tmp_path)
    assert mx.array_equal(a(x, cache=KVCache()), got).item()


@pytest.mark.parametrize("name", ["qwen3-tiny", "qwen3-tiny-bf16"])
def test_with_the_kernels_norm_and_rope_fuse(name, model_cache, tmp_path):
    """Both models with the kernels' norms and RoPEs (norm_rope.apply), one also in one-token
    form: q's and k's reshape, norm and RoPE are one node each, the same values."""
    mk = pytest.importorskip("mas_kernels", reason="mas_kernels is not built")
    from actors.model_runner.cpu import norm_rope

    path = str(ensure_builtin(name, cache_dir=model_cache, progress=False))
    stock, ours = load_model(path), load_model(path)
    for model in (stock, ours):
        assert norm_rope.apply(model, mk) > 0
    one_token.apply(ours)
    outs = []
    for model in (stock, ours):
        batch = DecodeBatch()
        for row, n in ((1, 3), (2, 21)):
            prompt = make_prompt_cache(model)
            mx.eval(model(mx.array([[9 + row] * n]), cache=prompt))
            batch.join(row, prompt)
        outs.append(model(batch.inputs(mx.array([0, 31, 32], dtype=mx.int32)),
                          cache=batch.caches))
    mine, theirs = _nodes(outs[1], tmp_path), _nodes(outs[0], tmp_path)
    assert mine.count("MasNormRope") == 2 * len(stock.model.layers)
    assert len(theirs) - len(mine) == 8 * len(stock.model.layers), (len(theirs), len(mine))
    assert mx.array_equal(outs[0], outs[1]).item()
