"""The greedy head over a quantized LM head's own codes (mas_kernels.greedy_head_quantized,
cpu/greedy_head.py): integer products over mlx's affine 4-bit and 8-bit layout, scaled per
group, with a bound on x's quantization and the float rounding; the surviving rows multiplied
exactly. It must give the exact argmax of x @ dequantize(W).T on every path, for every group
size, near-ties, masks and bf16 logits; the runner must use it for a 4-bit and an 8-bit
checkpoint and keep mlx-lm's greedy tokens."""

from __future__ import annotations

import numpy as np
import pytest

mk = pytest.importorskip(
    "mas_kernels", reason="mas_kernels is not built (pip install --no-build-isolation ./native)")
import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
from mlx_lm.models import qwen3  # noqa: E402

from actors.model_runner.cpu import greedy_head, head  # noqa: E402


def quantize(w: np.ndarray, group: int, bits: int) -> greedy_head.Quantized:
    codes, scales, biases = mx.quantize(mx.array(w.astype(np.float32)), group_size=group,
                                        bits=bits)
    return greedy_head.Quantized(codes, scales, biases, group, bits)


def dequantized(q: greedy_head.Quantized) -> np.ndarray:
    """W in float64 from the codes, scale * q + bias without rounding (mx.dequantize rounds
    each weight to float32)."""
    words = np.array(q.codes)
    shifts = np.arange(32 // q.bits, dtype=np.uint32) * q.bits
    values = ((words[:, :, None] >> shifts) & ((1 << q.bits) - 1)).reshape(len(words), -1)
    scales = np.repeat(np.array(q.scales.astype(mx.float32), np.float64), q.group_size, axis=1)
    biases = np.repeat(np.array(q.biases.astype(mx.float32), np.float64), q.group_size, axis=1)
    return values * scales + biases


def tokens(x: mx.array, q: greedy_head.Quantized, bf16_logits=False, allowed=None,
           screen=True) -> np.ndarray:
    """The kernel's tokens; with `screen` the float16 table goes along (AVX2 screens with it,
    the other paths read the float32 one under the bound that covers it)."""
    p = greedy_head.prepare_quantized(q, screen=screen)
    assert (p.screen is not None) == screen
    return np.array(mk.greedy_head_quantized(x, q.codes, p.table, p.stats, q.group_size, q.bits,
                                             bf16_logits, allowed, p.screen))


def exact_argmax(bits: int, group: int, n: int, k: int, m: int, screen: bool) -> None:
    rng = np.random.default_rng(n + k + m + bits + group)
    w = rng.standard_normal((n, k)) * rng.uniform(0.01, 0.2, (n, 1))
    x = mx.array((rng.standard_normal((m, k)) * rng.uniform(0.5, 4, (m, 1))).astype(np.float32))
    q = quantize(w, group, bits)
    want = (np.array(x, np.float64) @ dequantized(q).T).argmax(axis=1)
    np.testing.assert_array_equal(tokens(x, q, screen=screen), want)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
# Up to 12 rows AVX-512 takes the direct path (codes as they lie), more its transposed blocks.
@pytest.mark.parametrize("n, k, m", [(1000, 256, 3), (4099, 512, 17), (37, 128, 9),
                                     (1000, 256, 1), (4099, 512, 1), (37, 128, 1),
                                     (1000, 256, 12), (4099, 512, 13)])
def test_equals_the_exact_argmax(isa, bits, group, n, k, m):
    exact_argmax(bits, group, n, k, m, screen=True)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("n, k, m", [(4099, 512, 1), (4099, 512, 13)])
def test_the_float32_table_screens_alike(isa, bits, group, n, k, m):
    """Without the float16 table (AVX-512's way, and AVX2's where a value does not fit)."""
    exact_argmax(bits, group, n, k, m, screen=False)


@pytest.mark.parametrize("bits", [4, 8])
def test_the_float16_tables_rounding_cannot_drop_the_winner(isa, bits):
    """x exactly on the screening's integer levels (no quantization error, so the bound is the
    float rounding and the weights' own error alone), and two rows whose float16 scales and
    biases reverse their order: per value (all codes the largest, `top`) row 1 is 2e-4 * top
    above row 0 exactly and as far below it in float16, 20 times the rest of the bound. Only a
    bound that counts the table's rounding keeps row 1 for the exact products."""
    n, k, group = 32, 128, 64
    ones = (1 << 32) - 1  # every value of every word 15 (4-bit) or 255 (8-bit)
    codes = np.full((n, k * bits // 32), ones, np.uint32)
    top = float((1 << bits) - 1)
    scales = np.full((n, k // group), 0.5, np.float32)
    biases = np.zeros((n, k // group), np.float32)
    scales[1] = 1.0 + 4e-4  # float16: 1.0 (its spacing there is 2^-10)
    scales[0] = 1.0
    biases[0] = 2e-4 * top  # per value: row 0 top * (1 + 2e-4), row 1 top * (1 + 4e-4)
    q = greedy_head.Quantized(mx.array(codes), mx.array(scales), mx.array(biases), group, bits)
    p = greedy_head.prepare_quantized(q, screen=True)
    assert np.array(p.screen.astype(mx.float32))[0, 0, 0, 1] == 1.0  # row 1's scale rounded
    x = mx.ones((1, k))
    logits = np.array(x, np.float64) @ dequantized(q).T
    assert logits[0].argmax() == 1 and logits[0, 1] - logits[0, 0] < 1e-3 * logits[0, 1]
    assert tokens(x, q).tolist() == [1]


@pytest.mark.parametrize("bits", [4, 8])
def test_near_ties_are_decided_by_the_exact_products(isa, bits):
    """Rows equal but for one code, of a group whose scale is tiny: their logits differ by far
    less than any screening error, so only the exact products can order them."""
    rng = np.random.default_rng(bits)
    k, n = 256, 3000
    q = quantize(rng.standard_normal((n, k)) * 0.05, 64, bits)
    codes, scales, biases = np.array(q.codes), np.array(q.scales), np.array(q.biases)
    top = 2 * n // 3
    for a in (codes, scales, biases):
        a[top - 1] = a[top]
    scales[top - 1:top + 1, 0] *= 1e-3
    codes[top - 1, 0] ^= 1  # value 0 of row top - 1 one step away from row top's
    q = greedy_head.Quantized(mx.array(codes), mx.array(scales), mx.array(biases), 64, bits)
    x_np = dequantized(q)[top] * 3
    # Row top's value 0 is the larger (mlx's scales may be negative): it wins.
    x_np[0] = (4.0 if codes[top, 0] & 1 else -4.0) * np.sign(scales[top, 0])
    x = mx.array(x_np[None].astype(np.float32))
    logits = np.array(x, np.float64) @ dequantized(q).T
    assert 0 < logits[0, top] - logits[0, top - 1] < 1e-3 * abs(logits[0, top])
    assert tokens(x, q).tolist() == [logits.argmax()] == [top]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("m", [1, 4])
def test_masks_give_the_argmax_over_the_allowed_rows(isa, bits, m):
    rng = np.random.default_rng(11 + m)
    n, k = 5000, 256
    q = quantize(rng.standard_normal((n, k)) * 0.05, 64, bits)
    x = mx.array(rng.standard_normal((m, k)).astype(np.float32))
    logits = np.array(x, np.float64) @ dequantized(q).T
    allowed = rng.random((m, n)) < 0.01
    allowed[np.arange(m), logits.argmax(axis=1)] = False  # the unmasked winners are forbidden
    if m > 1:
        allowed[m - 1] = False  # nothing allowed: token 0
    words = np.packbits(np.pad(allowed, ((0, 0), (0, 5024 - n))), axis=1,
                        bitorder="little").view(np.uint32)
    want = np.where(allowed, logits, -np.inf).argmax(axis=1)
    if m > 1:
        want[m - 1] = 0
    np.testing.assert_array_equal(tokens(x, q, allowed=mx.array(words)), want)


def test_bf16_logits_take_the_argmax_of_the_rounded_logits(isa):
    rng = np.random.default_rng(8)
    q = quantize(rng.standard_normal((20000, 128)) * 0.05, 64, 4)
    x = mx.array(rng.standard_normal((48, 128)).astype(np.float32)).astype(mx.bfloat16)
    exact = (np.array(x.astype(mx.float32), np.float64) @ dequantized(q).T).astype(np.float32)
    rounded = np.array(mx.array(exact).astype(mx.bfloat16).astype(mx.float32))
    assert sum(int((r == r.max()).sum() > 1) for r in rounded) >= 2  # shared maxima occur
    got = tokens(x.astype(mx.float32), q, bf16_logits=True)
    np.testing.assert_array_equal(got, rounded.argmax(axis=1))


def test_every_simd_path_screens_a_quantized_head(isa):
    """AVX2 has a vectorized screening as AVX-512 VNNI has (the runner then takes the greedy
    head for 4-bit and 8-bit heads); only the scalar path leaves them to the model's product."""
    assert mk.qhead_fast() == (isa != "scalar")
    # The float16 table is prepared exactly where the head's path reads it.
    head = greedy_head.GreedyHead(quantize(np.zeros((32, 128)), 64, 4), mk)
    assert (head.prepared.screen is not None) == mk.qhead_half_table()
    if isa != "avx512":  # AVX-512 without VNNI screens on AVX2's path
        assert mk.qhead_half_table() == (isa == "avx2")


def test_bad_arguments_raise():
    q = quantize(np.zeros((100, 256)), 64, 4)
    p = greedy_head.prepare_quantized(q)
    call = mk.greedy_head_quantized
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        call(mx.zeros((2, 256)), q.codes, p.table, p.stats, 64, 3)
    with pytest.raises(ValueError, match="group_size must be 32, 64 or 128"):
        call(mx.zeros((2, 256)), q.codes, p.table, p.stats, 16, 4)
    with pytest.raises(ValueError, match="K must be a multiple"):
        call(mx.zeros((2, 192)), q.codes, p.table, p.stats, 64, 4)
    with pytest.raises(ValueError, match="codes must be uint32"):
        call(mx.zeros((2, 128)), q.codes, p.table, p.stats, 64, 4)
    with pytest.raises(ValueError, match="table must be float32"):
        call(mx.zeros((2, 256)), q.codes, p.table[:, :2], p.stats, 64, 4)
    with pytest.raises(ValueError, match="stats must be float32"):
        call(mx.zeros((2, 256)), q.codes, p.table, p.stats[:2], 64, 4)
    with pytest.raises(ValueError, match="screen must be float16 of the table's shape"):
        call(mx.zeros((2, 256)), q.codes, p.table, p.stats, 64, 4, screen=p.table)
    with pytest.raises(ValueError, match="screen must be float16 of the table's shape"):
        call(mx.zeros((2, 256)), q.codes, p.table, p.stats, 64, 4,
             screen=p.table[:, :1].astype(mx.float16))


def _model(bits: int, group: int = 64, hidden: int = 128) -> nn.Module:
    mx.random.seed(3)
    m = qwen3.Model(qwen3.ModelArgs(
        model_type="qwen3", hidden_size=hidden, num_hidden_layers=1, intermediate_size=256,
        num_attention_heads=4, rms_norm_eps=1e-6, vocab_size=500, num_key_value_heads=2,
        max_position_embeddings=128, rope_theta=1e4, head_dim=32, tie_word_embeddings=True))
    nn.quantize(m, group_size=group, bits=bits)
    head.install(m, 500)
    return m


def test_probe_takes_the_heads_the_kernel_covers():
    four = _model(4)
    probed = greedy_head.probe(four, quantized=True)
    assert isinstance(probed.weight, greedy_head.Quantized) and not probed.bf16_logits
    assert probed.weight.codes is four.model.embed_tokens.weight and probed.weight.bits == 4
    assert greedy_head.probe(four) is None  # not asked for (the kernel's scalar path)
    assert greedy_head.probe(_model(8), quantized=True).weight.bits == 8
    assert greedy_head.probe(_model(3), quantized=True) is None  # 3-bit: no kernel
    assert greedy_head.probe(_model(4, hidden=64), quantized=True) is None  # K % 128


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen3-small-4bit",
                                  pytest.param("qwen3-small-8bit", marks=pytest.mark.matrix)])
def test_a_quantized_checkpoint_keeps_mlx_lms_tokens_through_it(name, model_cache, monkeypatch):
    """The runner core on a 4-bit and an 8-bit checkpoint (a head the kernel covers): greedy
    decode steps go through the quantized greedy head (its direct path, up to 12 rows), and the
    tokens are mlx-lm's."""
    from actors.model_runner.cpu.greedy_head import GreedyHead
    from models.builtin import ensure_builtin
    from models.info import read_model_info
    from harness.oracle import Oracle
    from tests.support.drive import check_all, run

    if not mk.qhead_fast():
        pytest.skip("the quantized greedy head is used where AVX-512 VNNI is")
    calls = []
    original = GreedyHead.tokens
    monkeypatch.setattr(GreedyHead, "tokens", lambda self, x, allowed=None: calls.append(
        (isinstance(self.weight, greedy_head.Quantized), x.shape[0]))
        or original(self, x, allowed))
    path = str(ensure_builtin(name, cache_dir=model_cache, progress=False))
    oracle = Oracle(path)
    texts = ["Hello world", "def f(x):\n    return", "中文的自然语言处理", "One two three. " * 12,
             "The river", "import numpy", "1, 2, 3,", "Once upon", "SELECT *"]
    ids = [oracle.tokenizer.encode(p) for p in texts]
    arrivals = {0: [("a", ids[0], 12), ("b", ids[1], 6)], 2: [("c", ids[2], 10)],
                3: [(rid, ids[k], 9) for k, rid in enumerate("defghi", start=3)],
                40: [("z", ids[3], 8)]}  # alone, after the others: one-row steps
    got, _ = run(path, read_model_info(path), arrivals, max_rows=12, chunk=64)
    check_all(oracle, arrivals, got)
    assert calls and all(quantized for quantized, _ in calls)
    # Every decode step, one row (alone) to nine.
    assert {1, 9} <= {rows for _, rows in calls}

