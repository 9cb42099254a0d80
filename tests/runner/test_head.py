"""The LM head on the last position only: the same logits there, nothing else changed."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import qwen3
from mlx_lm.models.cache import make_prompt_cache

from actors.model_runner.cpu import head


def model(tied: bool) -> nn.Module:
    mx.random.seed(2)
    return qwen3.Model(qwen3.ModelArgs(
        model_type="qwen3", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
        num_attention_heads=4, rms_norm_eps=1e-6, vocab_size=500, num_key_value_heads=2,
        max_position_embeddings=128, rope_theta=1e4, head_dim=16, tie_word_embeddings=tied))


def test_last_only_gives_the_last_positions_logits_in_one_forward():
    for tied in (True, False):
        m = model(tied)
        ids = mx.array([[5, 17, 300, 42, 7, 99]])
        want = m(ids, cache=make_prompt_cache(m))
        assert head.install(m, 500) == (1 if tied else 2)  # embedding (as_linear) and lm_head
        assert head.install(m, 500) == 0  # already switched
        with head.last_only():
            got = m(ids, cache=make_prompt_cache(m))
        assert got.shape == (1, 1, 500)
        assert mx.allclose(got[:, -1], want[:, -1], atol=1e-5).item()
        # Outside the context every position, bit for bit; embedding lookups untouched.
        assert mx.array_equal(m(ids, cache=make_prompt_cache(m)), want).item()
        assert mx.array_equal(m.model.embed_tokens(ids), m.model.embed_tokens.weight[ids]).item()


def test_only_the_vocabulary_wide_layers_are_heads():
    layers = nn.Sequential(nn.Embedding(500, 32), nn.Linear(32, 500), nn.Linear(32, 64))
    assert head.install(layers, 500) == 2
    assert type(layers.layers[2]) is nn.Linear
