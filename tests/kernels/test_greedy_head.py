"""The greedy head (mas_kernels.greedy_head, cpu/greedy_head.py): the argmax of x @ W.T found
from an int8 copy of W with error bounds, the surviving rows multiplied exactly. It must give
the exact argmax (the lowest index on ties) on every instruction-set path, for odd shapes,
bf16 heads, flat logits (the exhaustive fallback) and degenerate rows; the runner must use it
for plain greedy rows only, and only where the model's output is its head's."""

from __future__ import annotations

import numpy as np
import pytest

mk = pytest.importorskip(
    "mas_kernels", reason="mas_kernels is not built (pip install --no-build-isolation ./native)")
import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
from mlx_lm.models import qwen3  # noqa: E402

from actors.model_runner.cpu import greedy_head, head  # noqa: E402


def exact_argmax(x: mx.array, w: mx.array) -> np.ndarray:
    logits = np.array(x, np.float64) @ np.array(w.astype(mx.float32), np.float64).T
    return logits.argmax(axis=1)


def tokens(x: mx.array, w: mx.array) -> np.ndarray:
    p = greedy_head.prepare(w)
    return np.array(mk.greedy_head(x, w, p.wq, p.stats))


# Up to 12 rows AVX-512 reads a tile's rows one after another, more in 4-row register tiles.
@pytest.mark.parametrize("n, k, m", [(1000, 100, 3), (4099, 640, 17), (517, 64, 1),
                                     (50, 1000, 33), (2048, 130, 4), (1000, 256, 12),
                                     (1000, 256, 13)])
def test_equals_the_exact_argmax(isa, n, k, m):
    rng = np.random.default_rng(n + k + m)
    # Rows of different norms, so the per-row scales and bounds differ.
    w = rng.standard_normal((n, k)) * rng.uniform(0.01, 0.2, (n, 1))
    x = rng.standard_normal((m, k)) * rng.uniform(0.5, 4, (m, 1))
    w, x = mx.array(w.astype(np.float32)), mx.array(x.astype(np.float32))
    np.testing.assert_array_equal(tokens(x, w), exact_argmax(x, w))


def test_bf16_head_equals_the_exact_argmax(isa):
    rng = np.random.default_rng(5)
    w = mx.array(rng.standard_normal((3001, 256)).astype(np.float32) * 0.05).astype(mx.bfloat16)
    x = mx.array(rng.standard_normal((6, 256)).astype(np.float32))
    np.testing.assert_array_equal(tokens(x, w), exact_argmax(x, w))


def test_bf16_logits_take_the_argmax_of_the_rounded_logits(isa):
    """A bf16 model's logits are float32 sums rounded to bf16: near the top, equal values are
    common, and the first of them wins."""
    rng = np.random.default_rng(8)
    w = mx.array(rng.standard_normal((20000, 128)).astype(np.float32) * 0.05).astype(mx.bfloat16)
    x = mx.array(rng.standard_normal((24, 128)).astype(np.float32)).astype(mx.bfloat16)
    exact = (np.array(x.astype(mx.float32), np.float64)
             @ np.array(w.astype(mx.float32), np.float64).T).astype(np.float32)
    rounded = np.array(mx.array(exact).astype(mx.bfloat16).astype(mx.float32))
    want = rounded.argmax(axis=1)
    ties = sum(int((r == r.max()).sum() > 1) for r in rounded)
    assert ties >= 2  # the case is exercised: rows whose maximum is shared
    p = greedy_head.prepare(w)
    got = np.array(mk.greedy_head(x.astype(mx.float32), w, p.wq, p.stats, True))
    np.testing.assert_array_equal(got, want)
    assert (got != exact.argmax(axis=1)).any()  # not the float32 argmax


def test_ties_take_the_lowest_index_and_zero_rows_token_zero(isa):
    rng = np.random.default_rng(6)
    w = rng.standard_normal((2000, 96)).astype(np.float32) * 0.1
    w[1500] = w[40] = w[1999] = rng.standard_normal(96).astype(np.float32)  # three equal rows
    x = np.stack([w[40] * 3, np.zeros(96, np.float32)])
    got = tokens(mx.array(x), mx.array(w))
    assert got.tolist() == [40, 0]  # mx.argmax's rule: the first of the equal maxima


def test_flat_logits_fall_back_to_exact_scans(isa):
    """Rows within the int8 error of each other: no task narrows down (its kept list
    overflows), so whole tasks are multiplied exactly; still the exact argmax."""
    rng = np.random.default_rng(7)
    base = rng.standard_normal(128)
    w = base + 1e-5 * rng.standard_normal((5000, 128))
    x = rng.standard_normal((3, 128))
    w, x = mx.array(w.astype(np.float32)), mx.array(x.astype(np.float32))
    np.testing.assert_array_equal(tokens(x, w), exact_argmax(x, w))


def pack(keep: np.ndarray) -> mx.array:
    """bool [M, N] -> uint32 [M, ceil(N / 32)] (bit t % 32 of word t // 32), as grammars give."""
    m, n = keep.shape
    padded = np.zeros((m, -(-n // 32) * 32), bool)
    padded[:, :n] = keep
    return mx.array(np.packbits(padded, axis=1, bitorder="little").view(np.uint32))


@pytest.mark.parametrize("density", [0.5, 0.01, 3 / 4099])
def test_masks_give_the_argmax_over_the_allowed_rows(isa, density):
    """A constrained greedy row: the argmax over the tokens its grammar allows, dense masks or
    a handful of tokens (1 in 100, 3 in 4,099 with the row's true argmax forbidden)."""
    rng = np.random.default_rng(int(density * 1000))
    n, k, m = 4099, 256, 5
    w = mx.array((rng.standard_normal((n, k)) * rng.uniform(0.01, 0.2, (n, 1))).astype(np.float32))
    x = mx.array(rng.standard_normal((m, k)).astype(np.float32))
    logits = np.array(x, np.float64) @ np.array(w, np.float64).T
    keep = rng.random((m, n)) < density
    keep[np.arange(m), logits.argmax(axis=1)] = False  # the unmasked winner may not win
    keep[:, rng.integers(0, n, m)] = True  # at least one token each
    keep[1] = True  # an unconstrained row beside them (all ones)
    p = greedy_head.prepare(w)
    got = np.array(mk.greedy_head(x, w, p.wq, p.stats, False, pack(keep)))
    want = np.where(keep, logits, -np.inf).argmax(axis=1)
    np.testing.assert_array_equal(got, want)
    assert (got != logits.argmax(axis=1)).sum() >= m - 1


def test_masks_reach_the_exact_scans_and_an_empty_mask_gives_token_zero(isa):
    """Flat logits (whole tasks rescanned exactly) still honour the mask; a row whose mask
    allows nothing gets token 0, as the argmax of all -inf logits does."""
    rng = np.random.default_rng(9)
    base = rng.standard_normal(128)
    w = mx.array((base + 1e-5 * rng.standard_normal((5000, 128))).astype(np.float32))
    x = mx.array(rng.standard_normal((3, 128)).astype(np.float32))
    keep = np.zeros((3, 5000), bool)
    keep[0, 4000:4999] = True  # crosses word and task boundaries, not the last row
    keep[1, ::7] = True
    logits = np.array(x, np.float64) @ np.array(w, np.float64).T
    p = greedy_head.prepare(w)
    got = np.array(mk.greedy_head(x, w, p.wq, p.stats, False, pack(keep)))
    assert got[0] == np.where(keep[0], logits[0], -np.inf).argmax()
    assert got[1] == np.where(keep[1], logits[1], -np.inf).argmax()
    assert got[2] == 0


def test_infinite_inputs_follow_the_float_logits():
    w = np.zeros((300, 64), np.float32)
    w[[12, 70, 200], 0] = [1.0, 2.0, 1.0]
    x = np.zeros((1, 64), np.float32)
    x[0, 0] = np.inf  # logits inf at rows 12, 70, 200 (nan where w is 0): the first inf wins
    got = tokens(mx.array(x), mx.array(w))
    assert got.tolist() == [12]


def test_bad_masks_raise():
    w, x = mx.zeros((100, 64)), mx.zeros((2, 64))
    p = greedy_head.prepare(w)
    with pytest.raises(ValueError, match="allowed must be uint32"):
        mk.greedy_head(x, w, p.wq, p.stats, False, mx.zeros((2, 3), mx.uint32))  # 3 < 4 words
    with pytest.raises(ValueError, match="allowed must be uint32"):
        mk.greedy_head(x, w, p.wq, p.stats, False, mx.zeros((1, 4), mx.uint32))


def test_bad_arguments_raise():
    w = mx.zeros((100, 64))
    p = greedy_head.prepare(w)
    with pytest.raises(ValueError, match="x must be float32"):
        mk.greedy_head(mx.zeros((2, 64), mx.bfloat16), w, p.wq, p.stats)
    with pytest.raises(ValueError, match=r"w must be float32 or bfloat16 \[N, K\]"):
        mk.greedy_head(mx.zeros((2, 32)), w, p.wq, p.stats)
    with pytest.raises(ValueError, match="wq must be uint8"):
        mk.greedy_head(mx.zeros((2, 64)), w, p.wq[:, :32], p.stats)
    with pytest.raises(ValueError, match="stats must be float32"):
        mk.greedy_head(mx.zeros((2, 64)), w, p.wq, p.stats[:2])
    with pytest.raises(ValueError, match="non-finite"):
        greedy_head.prepare(mx.array([[1.0, np.nan]]))


def _model(tied: bool) -> nn.Module:
    mx.random.seed(3)
    m = qwen3.Model(qwen3.ModelArgs(
        model_type="qwen3", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
        num_attention_heads=4, rms_norm_eps=1e-6, vocab_size=500, num_key_value_heads=2,
        max_position_embeddings=128, rope_theta=1e4, head_dim=16, tie_word_embeddings=tied))
    head.install(m, 500)
    return m


class _SoftCap(nn.Module):
    """A model whose logits are changed after the head (as Gemma 2's soft-cap does)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def __call__(self, inputs, cache=None):
        return 30 * mx.tanh(self.inner(inputs, cache=cache) / 30)

    @property
    def layers(self):
        return self.inner.layers


def test_probe_finds_the_head_only_where_it_stands_in_exactly():
    tied, untied = _model(True), _model(False)
    assert greedy_head.probe(tied).weight is tied.model.embed_tokens.weight
    assert greedy_head.probe(untied).weight is untied.lm_head.weight
    assert greedy_head.probe(_SoftCap(_model(True))) is None  # output is not the head's
    quantized = _model(False)
    nn.quantize(quantized, group_size=32, bits=4)
    head.install(quantized, 500)
    assert greedy_head.probe(quantized) is None  # quantized heads only when asked (and K % 128)
    bf16 = _model(True)
    bf16.set_dtype(mx.bfloat16)
    probed = greedy_head.probe(bf16)  # bf16 activations: logits rounded to bf16
    assert probed.weight is bf16.model.embed_tokens.weight and probed.bf16_logits
    assert not greedy_head.probe(tied).bf16_logits
    f16 = _model(True)
    f16.set_dtype(mx.float16)
    assert greedy_head.probe(f16) is None


def test_the_model_forward_hands_its_head_input_over():
    m = _model(True)
    ids = mx.array([[5, 17, 300, 42]])
    from mlx_lm.models.cache import make_prompt_cache

    want = m(ids, cache=make_prompt_cache(m))[:, -1]
    with greedy_head.capture() as got:
        out = m(ids, cache=make_prompt_cache(m))
    assert out is got.placeholder
    gh = greedy_head.GreedyHead(m.model.embed_tokens.weight, mk)
    assert gh.tokens(got.hidden[:, -1]).tolist() == mx.argmax(want, axis=-1).tolist()
