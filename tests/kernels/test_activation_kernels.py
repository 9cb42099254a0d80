"""The SiLU and softmax kernels (mas_kernels.silu / .softmax, native/src/activation.inc) and the
sampling ones (.categorical / .filter_floor, native/src/sampling.inc) against float64 references
on every instruction-set path this CPU has: saturation far out on both sides, lengths that are
not a multiple of the vector width, the causal mask of a later prompt chunk over grouped query
heads, draws that are the inverse of the softmax's cumulative distribution, filters' thresholds
that keep the float64 nucleus, and clear errors for inputs they do not take."""

from __future__ import annotations

import numpy as np
import pytest

mk = pytest.importorskip(
    "mas_kernels", reason="mas_kernels is not built (pip install --no-build-isolation ./native)")
import mlx.core as mx  # noqa: E402



def _silu64(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    with np.errstate(over="ignore"):
        return x / (1.0 + np.exp(-x))


@pytest.mark.parametrize("n", [1, 15, 16, 17, 1000, 70_001])
def test_silu_matches_float64(isa, n):
    x = np.random.default_rng(n).normal(0, 8, n).astype(np.float32)
    x[: min(n, 4)] = [-200.0, 200.0, 0.0, -88.5][: min(n, 4)]
    got = np.asarray(mk.silu(mx.array(x))).astype(np.float64)
    want = _silu64(x)
    big = np.abs(want) > 1e-30
    assert np.all(np.abs(got - want)[big] <= 5e-7 * np.abs(want[big]))
    assert np.all(np.abs(got[~big]) < 1e-30)  # far left: silu is ~0, never nan or inf
    assert got[0] == 0.0  # silu(-200): exactly -0.0, as MLX gives
    assert np.isfinite(got).all()


def test_silu_times_x_and_strided_inputs(isa):
    g = mx.random.normal((64, 300), key=mx.random.key(1)) * 5
    x = mx.random.normal((300, 64), key=mx.random.key(2)).T  # not row-contiguous
    got = np.asarray(mk.silu(g, x)).astype(np.float64)
    want = _silu64(np.asarray(g)) * np.asarray(x).astype(np.float64)
    assert np.abs(got - want).max() < 5e-6


@pytest.mark.parametrize("n", [1, 17, 70_001])
def test_bfloat16_silu_and_swiglu_have_mlx_bits(isa, n):
    """bf16: nn.silu and mlx-lm's swiglu as MLX computes them in bf16 (its exp, the sigmoid
    rounded, each product rounded), bit for bit, saturation included."""
    import mlx.nn as nn
    from mlx_lm.models import activations

    rng = np.random.default_rng(n)
    g = rng.normal(0, 8, n).astype(np.float32)
    g[: min(n, 6)] = [-200.0, 200.0, 0.0, -88.5, 88.5, -1e-3][: min(n, 6)]
    g = mx.array(g).astype(mx.bfloat16)
    x = mx.array(rng.normal(0, 2, n).astype(np.float32)).astype(mx.bfloat16)
    assert mk.silu(g).dtype == mx.bfloat16
    assert mx.array_equal(mk.silu(g), nn.silu(g)).item()
    assert mx.array_equal(mk.silu(g, x), activations.swiglu(g, x)).item()


def _softmax64(s: np.ndarray, keep: np.ndarray | None = None) -> np.ndarray:
    s = s.astype(np.float64)
    if keep is not None:
        s = np.where(keep, s, -np.inf)
    e = np.exp(s - s.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@pytest.mark.parametrize("width", [1, 7, 16, 33, 2000])
def test_softmax_rows_match_float64(isa, width):
    s = (np.random.default_rng(width).normal(0, 6, (3, 5, width))).astype(np.float32)
    got = np.asarray(mk.softmax(mx.array(s)))
    assert np.abs(got - _softmax64(s)).max() < 1e-6
    assert np.allclose(got.sum(-1), 1.0, atol=1e-6)


@pytest.mark.parametrize("length, width", [(1, 1), (5, 5), (100, 400), (37, 53)])
def test_causal_softmax_masks_later_keys(isa, length, width):
    """Rows (group, query) as fastmath stacks them: query r % length sits at key position
    width - length + r % length and sees keys up to it."""
    group = 3
    s = np.random.default_rng(length).normal(0, 4, (2, group * length, width)).astype(np.float32)
    pos = width - length + np.arange(group * length) % length
    keep = np.arange(width)[None, :] <= pos[:, None]
    got = np.asarray(mk.softmax(mx.array(s), length))
    assert np.abs(got - _softmax64(s, keep)).max() < 1e-6
    assert np.all(got[:, ~keep] == 0.0)


@pytest.mark.parametrize("width", [1, 7, 16, 33, 2000])
def test_bfloat16_softmax_has_mlx_bits(isa, width):
    """bf16 scores: the bits of MLX's own mx.softmax(precise=True), not merely close (its exp
    and its order of sums reproduced: a weight one float32 ulp off rounds to another bf16 now
    and then, and a bf16 model's greedy tokens could follow it)."""
    s = mx.array(np.random.default_rng(width).normal(0, 6, (3, 5, width)).astype(np.float32))
    s = s.astype(mx.bfloat16)
    got = mk.softmax(s)
    assert got.dtype == mx.bfloat16
    assert mx.array_equal(got, mx.softmax(s, axis=-1, precise=True)).item()


@pytest.mark.parametrize("length, width", [(5, 5), (100, 400), (37, 53)])
def test_bfloat16_causal_softmax_is_mlxs_over_the_kept_keys(isa, length, width):
    """Later keys masked as MLX's attention masks them (bf16's lowest value): its bits."""
    group = 3
    rng = np.random.default_rng(length)
    s = mx.array(rng.normal(0, 4, (2, group * length, width)).astype(np.float32)).astype(
        mx.bfloat16)
    pos = width - length + np.arange(group * length) % length
    keep = mx.array(np.arange(width)[None, :] <= pos[:, None])
    want = mx.softmax(mx.where(keep, s, mx.finfo(mx.bfloat16).min), axis=-1, precise=True)
    assert mx.array_equal(mk.softmax(s, length), want).item()


def test_bad_inputs_are_refused_by_name():
    with pytest.raises(ValueError, match="float32"):
        mk.silu(mx.zeros((4,), mx.float16))
    with pytest.raises(ValueError, match="both bfloat16"):
        mk.silu(mx.zeros((4,), mx.bfloat16), mx.zeros((4,)))
    with pytest.raises(ValueError, match="shape"):
        mk.silu(mx.zeros((4,)), mx.zeros((5,)))
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        mk.softmax(mx.zeros((2, 6, 4), mx.float16))
    with pytest.raises(ValueError, match="causal_length"):
        mk.softmax(mx.zeros((2, 6, 4)), 4)  # 6 rows are not queries of chunks of 4
    with pytest.raises(ValueError, match="causal_length"):
        mk.softmax(mx.zeros((2, 4, 3)), 4)  # a chunk wider than the keys
    with pytest.raises(ValueError, match="float32"):
        mk.categorical(mx.zeros((2, 4), mx.bfloat16), mx.zeros((2,)))
    with pytest.raises(ValueError, match="without its last axis"):
        mk.categorical(mx.zeros((2, 4)), mx.zeros((4,)))
    with pytest.raises(ValueError, match="V > 0"):
        mk.categorical(mx.zeros((2, 0)), mx.zeros((2,)))


def _inverse_cdf(logits: np.ndarray, u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The float64 draw for each u (the first index whose cumulative probability passes u),
    and each u's distance to the nearest boundary of the cumulative distribution."""
    p = _softmax64(logits)
    cdf = np.cumsum(p)
    idx = np.minimum(np.searchsorted(cdf, u, side="right"), len(p) - 1)
    # u lies between edges[k] and edges[k + 1], k = searchsorted(edges, u, "right") - 1 (edges
    # ascend): the nearest boundary is one of those two (without a [len(u), width] table).
    edges = np.concatenate([[0.0], cdf, [np.inf]])
    k = np.searchsorted(edges, u, side="right") - 1
    return idx, np.minimum(u - edges[k], edges[k + 1] - u)


@pytest.mark.parametrize("width", [1, 5, 17, 70_001])
def test_categorical_is_the_inverse_cdf(isa, width):
    rng = np.random.default_rng(width)
    logits = rng.normal(0, 3, width).astype(np.float32)
    logits[rng.random(width) < 0.3] = -np.inf  # filtered out: never drawn
    logits[0] = 1.0
    n = 4000 if width < 1000 else 600  # rows of width: the wide one is still 42M logits
    u = ((np.arange(n) + 0.5) / n).astype(np.float32)  # stratified: counts ~ n p
    got = np.asarray(mk.categorical(mx.array(np.tile(logits, (len(u), 1))), mx.array(u)))
    assert got.dtype == np.uint32 and got.shape == u.shape
    assert np.isfinite(logits[got]).all()
    want, margin = _inverse_cdf(logits, u.astype(np.float64))
    clear = margin > 2e-6  # float32 sums may cross a boundary only where u sits on it
    assert clear.sum() > n // 2 and (got[clear] == want[clear]).all()
    counts = np.bincount(got, minlength=width)
    assert np.abs(counts - n * _softmax64(logits)).max() <= 2


def test_categorical_ends_and_empty_rows(isa):
    logits = np.array([[-np.inf, 0.0, 5.0, -np.inf, 0.0, -np.inf]] * 2, np.float32)
    got = mk.categorical(mx.array(logits), mx.array([0.0, 0.9999999], mx.float32))
    assert np.asarray(got).tolist() == [1, 4]  # u = 0: the first kept token; u ~ 1: the last
    nothing = mk.categorical(mx.full((3, 40), -np.inf), mx.array([0.2, 0.5, 0.9]))
    assert np.asarray(nothing).tolist() == [0, 0, 0]
    rows = mx.random.normal((2, 3, 50), key=mx.random.key(5))  # any leading shape
    assert mk.categorical(rows, mx.full((2, 3), 0.5)).shape == (2, 3)


def _nucleus64(logits: np.ndarray, top_p: float) -> int:
    """How many of the best tokens the smallest set with mass >= top_p holds (float64)."""
    cum = np.cumsum(np.sort(_softmax64(logits))[::-1])
    return int(np.searchsorted(cum, top_p)) + 1


@pytest.mark.parametrize("shape", ["peaked", "flat"])
def test_filter_floor_on_a_real_vocabulary(isa, shape):
    """151,936 logits per row: the top_p nucleus is the float64 one (flat: ~10^5 tokens, where
    a bin of the kernel's histogram holds hundreds), top_k keeps its ties, min_p is max +
    log(min_p), and the strictest filter of a row wins."""
    rng = np.random.default_rng(3)
    width = 151_936
    x = rng.normal(0, 1, (4, width)).astype(np.float32) * (2 if shape == "peaked" else 1)
    if shape == "peaked":
        x[:, rng.integers(0, width, 40)] += 12
    x[2, :7] = x[2].max() + 1  # seven tokens tie for the best
    # top_p halfway between the masses of the n and n + 1 best tokens: a nucleus of n + 1
    top_p = np.ones(4, np.float32)
    for r, n in enumerate((9, 20) if shape == "peaked" else (50_000, 60_000)):
        cum = np.cumsum(np.sort(_softmax64(x[r]))[::-1])
        top_p[r] = (cum[n - 1] + cum[n]) / 2
    ks = np.array([0, 0, 3, 0], np.int32)
    mins = np.array([-np.inf, -np.inf, -np.inf, np.log(0.05)], np.float32)
    floor = np.asarray(mk.filter_floor(mx.array(x), mx.array(ks), mx.array(top_p),
                                       mx.array(mins)))
    kept = (x >= floor[:, None]).sum(1)
    assert kept[0] == _nucleus64(x[0], float(top_p[0]))
    assert kept[1] == _nucleus64(x[1], float(top_p[1]))
    assert kept[2] == 7  # top_k 3 of seven equal best: all seven stay
    assert floor[3] == np.float32(x[3].max() + np.log(np.float32(0.05)))


def test_categorical_draws_only_above_the_floor(isa):
    rng = np.random.default_rng(9)
    logits = rng.normal(0, 2, (1, 300)).astype(np.float32)
    floor = np.float32(np.sort(logits[0])[-20])  # the 20 best stay
    u = ((np.arange(3000) + 0.5) / 3000).astype(np.float32)
    got = np.asarray(mk.categorical(mx.array(np.tile(logits, (3000, 1))), mx.array(u),
                                    mx.full((3000,), floor)))
    kept = np.where(logits[0] >= floor, logits[0], -np.inf)
    counts = np.bincount(got, minlength=300)
    assert set(np.flatnonzero(counts)) <= set(np.flatnonzero(np.isfinite(kept)))
    assert np.abs(counts - 3000 * _softmax64(kept)).max() <= 2


@pytest.mark.parametrize("width", [1, 15, 16, 17, 151_936])
def test_argmax_is_mlxs(isa, width):
    """mlx's own answers: the first maximum, ties and infinities included, and a NaN wins."""
    rng = np.random.default_rng(width)
    x = rng.normal(0, 1, (6, width)).astype(np.float32)
    x[1] = np.round(x[1])  # many ties: the first of them
    x[2, width // 2:] = np.inf
    x[3] = -np.inf
    x[4, width - 1] = np.nan
    x[5, width // 3] = np.nan
    x[5, width - 1] = np.nan
    got = mk.argmax(mx.array(x))
    assert got.dtype == mx.uint32
    assert np.asarray(got).tolist() == np.asarray(mx.argmax(mx.array(x), axis=-1)).tolist()


def test_sampling_kernels_refuse_bad_rows_by_name():
    x = mx.zeros((2, 8))
    with pytest.raises(ValueError, match="floor must be logits' shape"):
        mk.categorical(x, mx.zeros((2,)), mx.zeros((3,)))
    with pytest.raises(ValueError, match="top_k must be int32"):
        mk.filter_floor(x, mx.zeros((2,)), mx.ones((2,)), mx.zeros((2,)))
    with pytest.raises(ValueError, match="top_p must be logits' shape"):
        mk.filter_floor(x, mx.zeros((2,), mx.int32), mx.ones((3,)), mx.zeros((2,)))
    with pytest.raises(ValueError, match="x must be float32"):
        mk.argmax(mx.zeros((2, 4), mx.bfloat16))
    with pytest.raises(ValueError, match="logits must be float32"):
        mk.filter_floor(x.astype(mx.float16), mx.zeros((2,), mx.int32), mx.ones((2,)),
                        mx.zeros((2,)))
