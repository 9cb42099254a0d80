"""The batched sampler: draws against exact probabilities (chi-square), the filters' kept sets,
penalties against a numpy re-computation, seeds that ignore the batch around them, raw logprobs,
and the plain greedy fast path. The draws are tested both ways the sampler makes them: the
Gumbel-max over MLX's noise, and the compiled kernel's draw inside kernel_draws() (the
runner's CPU steps)."""

import math

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import assume, given, settings, strategies as st

from actors.model_runner import filters
from actors.model_runner.filters import apply_filters
from actors.model_runner.sampling import MAX_TOP_LOGPROBS, RowParams, Sampler, kernel_draws

Z_999 = 3.090232  # standard normal quantile at 1 - 0.001


def chi2_critical(df: int, z: float = Z_999) -> float:
    """Wilson-Hilferty: (chi2 / df) ** (1/3) is nearly normal, mean 1 - 2/(9 df), var 2/(9 df)."""
    a = 2 / (9 * df)
    return df * (1 - a + z * math.sqrt(a)) ** 3


def chi2_fits(counts: np.ndarray, probs: np.ndarray) -> tuple[float, float]:
    """(statistic, critical value at p = 0.001) of counts against probs over the tokens with
    probs > 0. Categories expecting fewer than 5 draws are pooled (into the smallest other one
    if the pool itself expects fewer than 5)."""
    allowed = probs > 0
    observed, expected = counts[allowed].astype(float), probs[allowed] * counts.sum()
    big = expected >= 5
    obs, exp = list(observed[big]), list(expected[big])
    if (~big).any():
        o, e = observed[~big].sum(), expected[~big].sum()
        if e < 5 and exp:
            j = int(np.argmin(exp))
            obs[j], exp[j] = obs[j] + o, exp[j] + e
        else:
            obs.append(o), exp.append(e)
    obs, exp = np.array(obs), np.array(exp)
    assert len(obs) >= 2, "too few categories for a test"
    return float(((obs - exp) ** 2 / exp).sum()), chi2_critical(len(obs) - 1)


def softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max())
    return e / e.sum()


def expected_probs(logits: np.ndarray, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """The reference distribution (float64), straight from the definitions."""
    p = softmax(logits.astype(np.float64) / temperature)
    keep = np.ones(len(p), bool)
    if top_k:
        keep &= p >= np.sort(p)[-top_k]
    q = np.where(keep, p, 0) / p[keep].sum()
    if top_p < 1:  # the smallest set of best tokens whose mass reaches top_p
        order = np.argsort(-q)
        nucleus = order[: int(np.searchsorted(np.cumsum(q[order]), top_p)) + 1]
        keep &= np.isin(np.arange(len(p)), nucleus)
    if min_p:
        keep &= p >= min_p * p.max()
    return np.where(keep, p, 0) / p[keep].sum()


def draw(logits: np.ndarray, params: RowParams, n: int, seed: int = 0, seeded=False,
         batch: int = 4000) -> np.ndarray:
    """Counts per token of n draws, made as batches of identical rows (different seeds when
    `seeded`, else the sampler's own advancing key)."""
    vocab = len(logits)
    sampler = Sampler(vocab, batch, seed=seed)
    counts = np.zeros(vocab, np.int64)
    done = 0
    while done < n:
        rows = list(range(min(batch, n - done)))
        for r in rows:
            sampler.admit(r, RowParams(**{**params.__dict__, "seed": done + r}) if seeded
                          else params, [])
        tokens = sampler.sample(rows, mx.array(np.tile(logits, (len(rows), 1)))).tokens
        counts += np.bincount(tokens, minlength=vocab)
        done += len(rows)
    return counts


def assert_follows(counts: np.ndarray, probs: np.ndarray) -> None:
    assert counts[probs == 0].sum() == 0, f"dropped tokens drawn: {np.flatnonzero(counts * (probs == 0))}"
    stat, critical = chi2_fits(counts, probs)
    assert stat < critical, (stat, critical)


LOGITS = np.random.default_rng(7).normal(0, 1.5, 16).astype(np.float32)


@pytest.fixture(params=["gumbel", "kernel"])
def draws(request):
    """The test's draws made the Gumbel-max way, or by the compiled kernel as in the runner."""
    if request.param == "gumbel":
        yield
        return
    kernels = pytest.importorskip("mas_kernels", reason="mas_kernels is not built")
    with kernel_draws(kernels):
        yield


# -- the statistics helper itself ---------------------------------------------------------------

def test_chi2_helper_matches_tables_and_has_power():
    for df, table in [(3, 16.266), (10, 29.588), (30, 59.703), (100, 149.449)]:
        assert chi2_critical(df) == pytest.approx(table, rel=0.02)  # WH errs high: safe
    right = draw(LOGITS, RowParams(temperature=1.0), 3000)
    assert chi2_fits(right, expected_probs(LOGITS))[0] < chi2_fits(right, expected_probs(LOGITS))[1]
    stat, critical = chi2_fits(right, expected_probs(LOGITS, temperature=1.3))
    assert stat > critical  # a 30% temperature error is caught


# -- distributions --------------------------------------------------------------------------------

@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_draws_follow_softmax(temperature, draws):
    counts = draw(LOGITS, RowParams(temperature=temperature), 4000, seed=int(temperature * 10))
    assert_follows(counts, expected_probs(LOGITS, temperature))


def test_top_k_draws_only_the_k_best_renormalized(draws):
    counts = draw(LOGITS, RowParams(temperature=1.0, top_k=4), 4000, seed=1)
    probs = expected_probs(LOGITS, top_k=4)
    assert set(np.flatnonzero(probs)) == set(np.argsort(-LOGITS)[:4])
    assert_follows(counts, probs)


def test_top_p_draws_only_the_nucleus_renormalized(draws):
    cum = np.cumsum(np.sort(softmax(LOGITS.astype(np.float64)))[::-1])
    top_p = float(cum[3] + cum[4]) / 2  # mid-gap, far from a boundary: the 5 best tokens
    counts = draw(LOGITS, RowParams(temperature=1.0, top_p=top_p), 4000, seed=2)
    probs = expected_probs(LOGITS, top_p=top_p)
    assert set(np.flatnonzero(probs)) == set(np.argsort(-LOGITS)[:5])
    assert_follows(counts, probs)


def test_min_p_drops_the_unlikely_tokens(draws):
    counts = draw(LOGITS, RowParams(temperature=1.0, min_p=0.1), 4000, seed=3)
    probs = expected_probs(LOGITS, min_p=0.1)
    assert 1 < (probs > 0).sum() < len(LOGITS)
    assert_follows(counts, probs)


def test_a_huge_top_k_is_off(draws):
    """A top_k past the vocabulary keeps everything, however large (2**32 + 2 would be 2 in
    the kernel's int32)."""
    counts = draw(LOGITS, RowParams(temperature=1.0, top_k=2**32 + 2), 4000, seed=6)
    assert_follows(counts, expected_probs(LOGITS))


def test_filters_combine_after_temperature(draws):
    params = RowParams(temperature=0.7, top_k=8, top_p=0.9, min_p=0.02)
    counts = draw(LOGITS, params, 4000, seed=4)
    assert_follows(counts, expected_probs(LOGITS, 0.7, top_k=8, top_p=0.9, min_p=0.02))


def test_seeded_rows_follow_the_distribution(draws):
    counts = draw(LOGITS, RowParams(temperature=1.0), 2000, seeded=True)
    assert_follows(counts, expected_probs(LOGITS))


@pytest.mark.slow
def test_real_model_logits(model_cache):
    from models.builtin import ensure_builtin
    from actors.model_runner.loading import load_model

    model = load_model(str(ensure_builtin("qwen3-tiny", cache_dir=model_cache, progress=False)))
    logits = np.array(model(mx.array([[9707, 1879, 11, 1052]]))[0, -1].astype(mx.float32))
    params = RowParams(temperature=0.8, top_k=20)
    counts = draw(logits, params, 800, batch=200, seed=5)
    assert_follows(counts, expected_probs(logits, 0.8, top_k=20))


# -- filters: exact kept sets --------------------------------------------------------------------

@st.composite
def filter_batches(draw_):
    vocab = draw_(st.integers(2, 40))
    n = draw_(st.integers(1, 4))
    rows = [draw_(st.permutations(range(vocab))) for _ in range(n)]
    scale = draw_(st.floats(0.05, 2.0))
    x = np.array(rows, np.float32) * np.float32(scale)  # distinct values: no ties
    ks = draw_(st.lists(st.integers(0, vocab + 2), min_size=n, max_size=n))
    ps = draw_(st.lists(st.one_of(st.just(1.0), st.floats(0.01, 0.99)), min_size=n, max_size=n))
    mins = draw_(st.lists(st.one_of(st.just(0.0), st.floats(0.0, 0.9)), min_size=n, max_size=n))
    return x, np.array(ks), np.array(ps), np.array(mins), draw_(st.sampled_from([3, 1024]))


def assume_clear_of_boundaries(x, ks, ps, mins) -> None:
    """Only cases where no row's top_p or min_p sits within 1e-4 of a token's mass: there
    float32 and float64 sums may rightly disagree."""
    for i in range(len(x)):
        q = expected_probs(x[i], top_k=min(ks[i], len(x[i])))
        cum = np.cumsum(np.sort(q)[::-1])
        assume(ps[i] == 1 or np.abs(cum - ps[i]).min() > 1e-4)
        p = softmax(x[i].astype(np.float64))
        assume(mins[i] == 0 or np.abs(p / p.max() - mins[i]).min() > 1e-4)


@settings(max_examples=150, deadline=None)
@given(filter_batches())
def test_filters_keep_exactly_the_reference_set(case):
    """Rows with different filters side by side; NUCLEUS_WIDTH 3 takes the path where a nucleus
    wider than the partial sort is sorted again in full."""
    x, ks, ps, mins, width = case
    assume_clear_of_boundaries(x, ks, ps, mins)
    old, filters.NUCLEUS_WIDTH = filters.NUCLEUS_WIDTH, width
    try:
        kept = np.array(apply_filters(mx.array(x), ks, ps, mins)) > -np.inf
    finally:
        filters.NUCLEUS_WIDTH = old
    for i in range(len(x)):
        want = expected_probs(x[i], top_k=min(ks[i], len(x[i])), top_p=ps[i], min_p=mins[i]) > 0
        assert (kept[i] == want).all(), (i, np.flatnonzero(kept[i]), np.flatnonzero(want))


@settings(max_examples=150, deadline=None)
@given(filter_batches())
def test_the_kernel_floor_keeps_exactly_the_reference_set(case):
    """mas_kernels.filter_floor, the runner's filters on the CPU: x >= its threshold per row
    is the reference set, rows with different filters side by side."""
    mk = pytest.importorskip("mas_kernels", reason="mas_kernels is not built")
    x, ks, ps, mins, _ = case
    assume_clear_of_boundaries(x, ks, ps, mins)
    with np.errstate(divide="ignore"):
        log_min_p = np.log(mins.astype(np.float32))
    floor = mk.filter_floor(mx.array(x), mx.array(ks.astype(np.int32)),
                            mx.array(ps.astype(np.float32)), mx.array(log_min_p))
    kept = x >= np.array(floor)[:, None]
    for i in range(len(x)):
        want = expected_probs(x[i], top_k=min(ks[i], len(x[i])), top_p=ps[i], min_p=mins[i]) > 0
        assert (kept[i] == want).all(), (i, np.flatnonzero(kept[i]), np.flatnonzero(want))


# -- penalties, bias, min_new_tokens --------------------------------------------------------------

def forced(vocab: int, token: int) -> mx.array:
    """Logits that any penalty in these tests leaves with `token` on top."""
    x = np.zeros((1, vocab), np.float32)
    x[0, token] = 100
    return mx.array(x)


def reference_process(x, prompt, output, params, generated):
    """Penalties, bias and min_new_tokens masking from their definitions, in numpy."""
    x = x.astype(np.float64).copy()
    counts = np.bincount(output, minlength=len(x)) if output else np.zeros(len(x), int)
    seen = np.isin(np.arange(len(x)), list(prompt) + list(output))
    r = params.repetition_penalty
    x[seen] = np.where(x[seen] > 0, x[seen] / r, x[seen] * r)
    x -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    for t, v in params.logit_bias:
        x[t] += v
    if generated < params.min_new_tokens:
        x[list(params.stop_ids)] = -np.inf
    return x


def test_penalties_and_bias_change_the_logits_exactly():
    vocab, prompt, output = 10, [1, 2, 2, 9], [4, 4, 6, 2]
    params = RowParams(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.25,
                       logit_bias=((3, 1.5), (0, -2.0)))
    sampler = Sampler(vocab, 4)
    sampler.admit(1, params, prompt)
    sampler.admit(2, RowParams(), [5])  # a plain neighbour: untouched
    x = np.linspace(-2.1, 2.4, vocab).astype(np.float32)  # both signs, no zero
    got = np.array(sampler.process([1, 2], mx.array(np.stack([x, x]))))
    np.testing.assert_allclose(got[0], reference_process(x, prompt, [], params, 0), rtol=1e-6)
    np.testing.assert_array_equal(got[1], x)
    for t in output:  # the generated tokens join the history
        assert sampler.sample([1], forced(vocab, t)).tokens == [t]
    want = reference_process(x, prompt, output, params, len(output))
    np.testing.assert_allclose(np.array(sampler.process([1], mx.array(x[None])))[0], want,
                               rtol=1e-6)
    # A resumed request (admitted with its output so far) starts from the same history.
    sampler.admit(3, params, prompt, output=output)
    np.testing.assert_allclose(np.array(sampler.process([3], mx.array(x[None])))[0], want,
                               rtol=1e-6)
    # Re-admitting a row forgets its old history.
    sampler.admit(1, params, [7])
    np.testing.assert_allclose(np.array(sampler.process([1], mx.array(x[None])))[0],
                               reference_process(x, [7], [], params, 0), rtol=1e-6)


def test_frequency_and_presence_ignore_the_prompt():
    params = RowParams(frequency_penalty=1.0, presence_penalty=1.0)
    sampler = Sampler(6, 2)
    sampler.admit(0, params, [1, 1, 1, 2])
    x = np.ones((1, 6), np.float32)
    np.testing.assert_array_equal(np.array(sampler.process([0], mx.array(x))), x)
    sampler.sample([0], forced(6, 3))
    sampler.sample([0], forced(6, 3))
    np.testing.assert_allclose(np.array(sampler.process([0], mx.array(x)))[0],
                               [1, 1, 1, 1 - 2 - 1, 1, 1])


def test_min_new_tokens_masks_stops_until_reached():
    vocab = 8
    x = np.zeros((1, vocab), np.float32)
    x[0, 5], x[0, 2] = 3.0, 1.0  # stop id 5 is the favourite, 2 the runner-up
    params = RowParams(min_new_tokens=2, stop_ids=(5, 7))
    sampler = Sampler(vocab, 2)
    sampler.admit(0, params, [1])
    tokens = []
    for step in range(4):
        processed = np.array(sampler.process([0], mx.array(x)))[0]
        masked = step < 2
        assert (np.isneginf(processed[[5, 7]]) == masked).all()
        np.testing.assert_array_equal(processed[:5], x[0, :5])
        tokens += sampler.sample([0], mx.array(x)).tokens
    assert tokens == [2, 2, 5, 5]


# -- seeds ----------------------------------------------------------------------------------------

SEED_VOCAB = 50
TARGET = RowParams(temperature=1.0, top_p=0.95, repetition_penalty=1.1, seed=1234)
NEIGHBOURS = [RowParams(), RowParams(temperature=1.0), RowParams(temperature=0.7, top_k=5, seed=77),
              RowParams(frequency_penalty=0.5), RowParams(temperature=1.5, min_p=0.05, seed=3)]


def step_logits(steps: int) -> np.ndarray:
    return np.random.default_rng(11).normal(0, 0.7, (steps, SEED_VOCAB)).astype(np.float32)


def seeded_run(target: RowParams, steps: int, neighbours: bool, order_seed: int = 0):
    """The target row's tokens, alone or among neighbours that started earlier, in a shuffled
    row order each step. Also returns each greedy neighbour's (token, argmax) pairs."""
    rng = np.random.default_rng(order_seed)
    sampler = Sampler(SEED_VOCAB, 16, seed=order_seed)
    own = step_logits(steps)
    others = {}
    if neighbours:
        for row, params in zip([3, 0, 9, 5, 12], NEIGHBOURS):
            sampler.admit(row, params, [1, 2, 3])
            others[row] = params
        for _ in range(order_seed + 1):  # the target lands at a different step each time
            sampler.sample(list(others), mx.array(rng.normal(size=(len(others), SEED_VOCAB))))
    sampler.admit(7, target, [4, 5])
    tokens, greedy = [], []
    for step in range(steps):
        rows = list(rng.permutation([7, *others]))
        logits = rng.normal(size=(len(rows), SEED_VOCAB)).astype(np.float32)
        logits[rows.index(7)] = own[step]
        out = sampler.sample(rows, mx.array(logits))
        tokens.append(out.tokens[rows.index(7)])
        greedy += [(out.tokens[i], int(np.argmax(logits[i]))) for i, r in enumerate(rows)
                   if r in others and others[r] == RowParams()]
    return tokens, greedy


def test_a_seeded_row_ignores_the_batch_around_it(draws):
    alone, _ = seeded_run(TARGET, 12, neighbours=False)
    for order_seed in range(3):
        among, greedy = seeded_run(TARGET, 12, neighbours=True, order_seed=order_seed)
        assert among == alone
        assert greedy and all(token == best for token, best in greedy)  # exact argmax
    other_seed, _ = seeded_run(RowParams(**{**TARGET.__dict__, "seed": 4321}), 12, False)
    assert other_seed != alone


def test_unseeded_rows_vary(draws):
    params = RowParams(temperature=1.0)
    runs = [draw(np.zeros(SEED_VOCAB, np.float32), params, 20, seed=s, batch=20) for s in (1, 2)]
    assert not (runs[0] == runs[1]).all()


# -- logprobs -------------------------------------------------------------------------------------

def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def test_logprobs_are_the_raw_distribution():
    vocab = 64
    raw = np.random.default_rng(3).normal(0, 2, (4, vocab)).astype(np.float32)
    params = [RowParams(temperature=1.7, repetition_penalty=1.5, logprobs=True,
                        top_logprobs=MAX_TOP_LOGPROBS, seed=5),
              RowParams(logprobs=True, logit_bias=((0, 30.0),)),
              RowParams(temperature=0.6, top_k=3, top_logprobs=3),
              RowParams()]
    sampler = Sampler(vocab, 4)
    for row, p in enumerate(params):
        sampler.admit(row, p, [1, 2, 3])
    out = sampler.sample([0, 1, 2, 3], mx.array(raw))
    ref = log_softmax(raw)
    assert out.tokens[1] == 0  # the bias decided the token, but not its logprob
    for i, token in enumerate(out.tokens):
        assert out.logprobs[i] == pytest.approx(ref[i, token], abs=1e-4)
    for i, p in enumerate(params):
        k = p.top_logprobs
        assert out.top_ids[i] == list(np.argsort(-ref[i])[:k])
        np.testing.assert_allclose(out.top_logprobs[i], np.sort(ref[i])[::-1][:k], atol=1e-4)
        assert out.top_logprobs[i] == sorted(out.top_logprobs[i], reverse=True)
    assert [len(ids) for ids in out.top_ids] == [20, 0, 3, 0]


def test_no_logprobs_unless_asked():
    sampler = Sampler(8, 2)
    sampler.admit(0, RowParams(temperature=1.0), [])
    sampler.admit(1, RowParams(), [])
    out = sampler.sample([0, 1], mx.zeros((2, 8)))
    assert out.logprobs is None and out.top_ids is None and out.top_logprobs is None


# -- the plain greedy fast path, validation, the old entry point ----------------------------------

def test_plain_greedy_batches_skip_the_full_path():
    vocab = 32
    sampler = Sampler(vocab, 8)
    for row in range(4):
        sampler.admit(row, RowParams(stop_ids=(1,)), [1, 2])  # stop ids alone: still plain
    logits = mx.array(np.random.default_rng(0).normal(size=(4, vocab))).astype(mx.bfloat16)
    out = sampler.sample([2, 0, 3, 1], logits)
    assert out.tokens == np.argmax(np.array(logits.astype(mx.float32)), axis=-1).tolist()
    assert out.logprobs is None and sampler.full_calls == 0
    sampler.admit(5, RowParams(min_new_tokens=2, stop_ids=(1,)), [])  # masks for 2 steps
    for step in range(4):
        sampler.sample([0, 5], logits[:2])
        assert sampler.full_calls == min(step + 1, 2)
    sampler.admit(6, RowParams(logprobs=True), [])
    sampler.sample([0, 6], logits[:2])
    assert sampler.full_calls == 3


def test_tokens_found_without_logits_only_for_plain_greedy_rows():
    """launch_tokens (the greedy head's way in): the rows' histories advance as with logits;
    a row whose token needs the logits (logprobs, sampling, masked stops) is refused."""
    sampler = Sampler(32, 8)
    sampler.admit(1, RowParams(), [])
    sampler.admit(2, RowParams(min_new_tokens=1, stop_ids=(3,)), [])
    sampler.admit(3, RowParams(top_logprobs=2), [])
    sampler.admit(4, RowParams(temperature=0.7), [])
    assert sampler.plain_greedy([1]) and not sampler.plain_greedy([1, 2])
    assert not sampler.plain_greedy([3]) and not sampler.plain_greedy([4])
    # greedy(): the same rows here (no constrained row: those need a grammar, test_constrained)
    assert sampler.greedy([1]) and not sampler.greedy([1, 2]) and not sampler.greedy([1, 3])
    with pytest.raises(ValueError, match="not all greedy"):
        sampler.launch_tokens([1, 2], mx.array([5, 6], dtype=mx.int32))
    sampler.sample([2], mx.zeros((1, 32)))  # its one masked step
    assert sampler.plain_greedy([1, 2])
    got = sampler.launch_tokens([2, 1], mx.array([7, 9], dtype=mx.int32)).resolve()
    assert got.tokens == [7, 9] and got.logprobs is None
    assert sampler.generated[1] == 1 and sampler.generated[2] == 2
    with pytest.raises(ValueError, match="tokens"):
        sampler.launch_tokens([1], mx.array([1, 2], dtype=mx.int32))


@pytest.mark.parametrize("bad", [dict(top_logprobs=21), dict(stop_ids=(32,)), dict(top_p=0.0),
                                 dict(logit_bias=((-1, 1.0),)), dict(temperature=-1.0)])
def test_bad_params_are_refused(bad):
    with pytest.raises(ValueError):
        Sampler(32, 2).admit(0, RowParams(**bad), [])


def test_released_rows_cannot_sample():
    sampler = Sampler(8, 2)
    sampler.admit(1, RowParams(), [])
    sampler.release(1)
    with pytest.raises(KeyError):
        sampler.sample([1], mx.zeros((1, 8)))

