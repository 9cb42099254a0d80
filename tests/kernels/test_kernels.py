"""The compiled CPU kernels (native/, module mas_kernels) against MLX's own results.

Every instruction-set path this CPU has is checked against float32 `x @ dequantize(w).T` and
`mx.quantized_matmul`, within the float32 summation bound (the kernels add in another order).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

mk = pytest.importorskip(
    "mas_kernels", reason="mas_kernels is not built (pip install --no-build-isolation ./native)")
import mlx.core as mx  # noqa: E402

ISAS = [name for name in ("avx512", "avx2", "scalar") if mk.has_isa(name)]
SCALE_DTYPES = (mx.float32, mx.float16, mx.bfloat16)
ROWS = (1, 2, 7, 16, 33, 64, 300)
OUTS = (1, 3, 257, 1792)
EPS = 2.0**-24


def make_quantized(n: int, k: int, group_size: int, bits: int, dtype=mx.float32):
    w = (mx.random.normal((n, k)) * 0.05).astype(dtype)
    return mx.quantize(w, group_size=group_size, bits=bits)


def dequantized(wq, scales, biases, group_size, bits, magnitude=False):
    """float32 weights; with magnitude, |scale| * q + |bias| (bounds each term's rounding)."""
    s, b = scales.astype(mx.float32), biases.astype(mx.float32)
    if magnitude:
        s, b = mx.abs(s), mx.abs(b)
    return mx.dequantize(wq, s, b, group_size=group_size, bits=bits)


def assert_close(y, ref, bound, k):
    """|y - ref| within both sides' float32 summation error: 2 * k * eps * (|x| @ |w|)."""
    assert y.dtype == mx.float32 and y.shape == ref.shape, (y.dtype, y.shape, ref.shape)
    y, ref, bound = np.array(y), np.array(ref), np.array(bound)
    tol = 2 * (k + 2) * EPS * bound + 1e-30
    bad = np.abs(y - ref) > tol
    assert not bad.any(), (
        f"{bad.sum()} of {bad.size} differ, worst {np.max(np.abs(y - ref) / tol):.2f} x tolerance")


@pytest.mark.parametrize("bits,group_size", list(itertools.product((4, 8), (32, 64, 128))))
def test_affine_qmm_matches_dequantized_product(isa, bits, group_size):
    mx.random.seed(bits * 1000 + group_size)
    k = 2 * group_size
    for n, dtype in itertools.product(OUTS, SCALE_DTYPES):
        wq, s, b = make_quantized(n, k, group_size, bits, dtype)
        w = dequantized(wq, s, b, group_size, bits)
        wabs = dequantized(wq, s, b, group_size, bits, magnitude=True)
        for m in ROWS:
            x = mx.random.normal((m, k))
            y = mk.affine_qmm(x, wq, s, b, group_size, bits)
            assert_close(y, x @ w.T, mx.abs(x) @ wabs.T, k)


@pytest.mark.parametrize("bits", (4, 8))
def test_affine_qmm_matches_quantized_matmul(isa, bits):
    mx.random.seed(bits)
    for m, n, k, gs, dtype in ((1, 1792, 640, 64, mx.float32), (3, 257, 256, 32, mx.bfloat16),
                               (16, 96, 512, 128, mx.float16), (40, 33, 384, 64, mx.float32)):
        wq, s, b = make_quantized(n, k, gs, bits, dtype)
        x = mx.random.normal((m, k))
        ref = mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=gs, bits=bits)
        wabs = dequantized(wq, s, b, gs, bits, magnitude=True)
        assert_close(mk.affine_qmm(x, wq, s, b, gs, bits), ref.astype(mx.float32),
                     mx.abs(x) @ wabs.T, k)


@pytest.mark.parametrize("m", (1, 5, 70))
def test_affine_qmm_long_rows(isa, m):
    """K past the kernels' 2048-value blocks, and a group count past one scale block."""
    mx.random.seed(m)
    k, gs = 4096 + 1280, 32
    wq, s, b = make_quantized(37, k, gs, 4, mx.bfloat16)
    x = mx.random.normal((m, k))
    w = dequantized(wq, s, b, gs, 4)
    assert_close(mk.affine_qmm(x, wq, s, b, gs, 4), x @ w.T,
                 mx.abs(x) @ dequantized(wq, s, b, gs, 4, magnitude=True).T, k)


@pytest.mark.parametrize("bits", (4, 8))
@pytest.mark.parametrize("m", (1, 3))
def test_affine_qmm_float32_scales_past_a_scale_block(isa, bits, m):
    """float32 scales of 37 groups a row: one whole block of 32 widened, then 5 (a partial
    vector); one row of x takes 4-bit's sum form on AVX2."""
    mx.random.seed(37 * bits + m)
    k, gs = 37 * 32, 32
    wq, s, b = make_quantized(45, k, gs, bits, mx.float32)
    assert s.dtype == mx.float32
    x = mx.random.normal((m, k))
    assert_close(mk.affine_qmm(x, wq, s, b, gs, bits), x @ dequantized(wq, s, b, gs, bits).T,
                 mx.abs(x) @ dequantized(wq, s, b, gs, bits, magnitude=True).T, k)


DENSE = {"bf16": (mx.bfloat16, "bf16_matmul"), "f32": (mx.float32, "f32_matmul")}


@pytest.mark.parametrize("kind", DENSE)
def test_dense_matmul_matches_float32_product(isa, kind):
    dtype, op = DENSE[kind]
    mx.random.seed(7)
    for k in (1, 31, 32, 33, 100, 640, 2049, 4100):
        for n in (1, 3, 257):
            w = (mx.random.normal((n, k)) * 0.05).astype(dtype)
            wf = w.astype(mx.float32)
            for m in ROWS if k <= 640 else (1, 6, 33):
                x = mx.random.normal((m, k))
                assert_close(getattr(mk, op)(x, w), x @ wf.T, mx.abs(x) @ mx.abs(wf).T, k)


@pytest.mark.parametrize("kind", DENSE)
def test_dense_matmul_wide(isa, kind):
    dtype, op = DENSE[kind]
    mx.random.seed(8)
    w = (mx.random.normal((1792, 640)) * 0.05).astype(dtype)
    wf = w.astype(mx.float32)
    for m in (1, 16, 64):
        x = mx.random.normal((m, 640))
        assert_close(getattr(mk, op)(x, w), x @ wf.T, mx.abs(x) @ mx.abs(wf).T, 640)


def test_leading_dims_and_empty_rows():
    wq, s, b = make_quantized(40, 128, 64, 4)
    x = mx.random.normal((2, 3, 128))
    y = mk.affine_qmm(x, wq, s, b, 64, 4)
    assert y.shape == (2, 3, 40)
    assert_close(y.reshape(6, 40), mk.affine_qmm(x.reshape(6, 128), wq, s, b, 64, 4),
                 mx.ones((6, 40)), 0)
    assert mk.affine_qmm(mx.zeros((0, 128)), wq, s, b, 64, 4).shape == (0, 40)
    wb = mx.random.normal((40, 128)).astype(mx.bfloat16)
    assert mk.bf16_matmul(x, wb).shape == (2, 3, 40)
    assert mk.bf16_matmul(mx.random.normal((128,)), wb).shape == (40,)


def test_non_contiguous_inputs():
    mx.random.seed(3)
    wq, s, b = make_quantized(64, 256, 64, 4, mx.bfloat16)
    w = dequantized(wq, s, b, 64, 4)
    wabs = dequantized(wq, s, b, 64, 4, magnitude=True)
    base = mx.random.normal((256, 9))
    # Views MLX makes without copying: a transpose, a strided slice, a slice of a batch.
    for x in (base.T, mx.random.normal((5, 512))[:, ::2], mx.random.normal((2, 7, 256))[:, 1:4]):
        y = mk.affine_qmm(x, wq, s, b, 64, 4)
        assert_close(y, x @ w.T, mx.abs(x) @ wabs.T, 256)
    # Strided weights (every other row) and scales.
    wq2, s2, b2 = wq[::2], s[::2], b[::2]
    x = mx.random.normal((3, 256))
    assert_close(mk.affine_qmm(x, wq2, s2, b2, 64, 4), x @ w[::2].T, mx.abs(x) @ wabs[::2].T, 256)
    wb = mx.random.normal((128, 64)).astype(mx.bfloat16)
    x = mx.random.normal((3, 128))
    assert_close(mk.bf16_matmul(x, wb.T), x @ wb.T.astype(mx.float32).T,
                 mx.abs(x) @ mx.abs(wb.astype(mx.float32)), 128)


def test_lazy_graph_composes():
    """Several layers built lazily and evaluated once, mixed with ordinary MLX ops."""
    mx.random.seed(4)
    layers = [make_quantized(256, 256, 64, 4, mx.bfloat16) for _ in range(3)]
    wb = (mx.random.normal((100, 256)) * 0.05).astype(mx.bfloat16)
    x = mx.random.normal((4, 256))
    h, ref = x, x
    for wq, s, b in layers:
        h = mx.maximum(mk.affine_qmm(h * 0.5, wq, s, b, 64, 4), 0.0) + h
        ref = mx.maximum((ref * 0.5) @ dequantized(wq, s, b, 64, 4).T, 0.0) + ref
    out = mk.bf16_matmul(h, wb)
    ref = ref @ wb.astype(mx.float32).T
    mx.eval(out, ref)
    np.testing.assert_allclose(np.array(out), np.array(ref), rtol=1e-4, atol=1e-4)


def test_compile_and_streams():
    """Traced by mx.compile, and run on a CPU stream other than the default."""
    mx.random.seed(6)
    wq, s, b = make_quantized(300, 256, 64, 4)
    wb = (mx.random.normal((50, 256)) * 0.05).astype(mx.bfloat16)

    def f(x):
        return mk.bf16_matmul(mx.maximum(mk.affine_qmm(x, wq, s, b, 64, 4), 0.0)[:, :256], wb)

    x = mx.random.normal((3, 256))
    ref = np.array(f(x))
    np.testing.assert_array_equal(np.array(mx.compile(f)(x)), ref)
    with mx.stream(mx.new_stream(mx.cpu)):
        out = f(x)
    np.testing.assert_array_equal(np.array(out), ref)


def test_threads_do_not_change_results():
    mx.random.seed(5)
    wq, s, b = make_quantized(1000, 512, 64, 4)
    wb = mx.random.normal((1000, 512)).astype(mx.bfloat16)
    x = mx.random.normal((20, 512))
    before = mk.threads()
    try:
        outs = []
        for n in (1, 2, 3):
            mk.set_threads(n)
            outs.append((np.array(mk.affine_qmm(x, wq, s, b, 64, 4)),
                         np.array(mk.bf16_matmul(x[:3], wb))))
    finally:
        mk.set_threads(before)
    for q, f in outs[1:]:
        np.testing.assert_array_equal(q, outs[0][0])
        np.testing.assert_array_equal(f, outs[0][1])


def test_bad_arguments_raise():
    wq, s, b = make_quantized(8, 128, 64, 4)
    x = mx.random.normal((2, 128))
    with pytest.raises(ValueError, match="bits"):
        mk.affine_qmm(x, wq, s, b, 64, 3)
    with pytest.raises(ValueError, match="group_size"):
        mk.affine_qmm(x, wq, s, b, 16, 4)
    with pytest.raises(ValueError, match="does not match"):
        mk.affine_qmm(mx.random.normal((2, 64)), wq, s, b, 64, 4)
    with pytest.raises(ValueError, match="float32"):
        mk.affine_qmm(x.astype(mx.float16), wq, s, b, 64, 4)
    with pytest.raises(ValueError, match="dtype of scales"):
        mk.affine_qmm(x, wq, s, b.astype(mx.float16), 64, 4)
    with pytest.raises(ValueError, match="scales and biases"):
        mk.affine_qmm(x, wq, s[:, :1], b[:, :1], 64, 4)
    with pytest.raises(ValueError, match="bfloat16"):
        mk.bf16_matmul(x, mx.zeros((8, 128)))
    with pytest.raises(ValueError, match="does not match"):
        mk.bf16_matmul(x, mx.zeros((8, 64), dtype=mx.bfloat16))
    with pytest.raises(ValueError, match="float32"):
        mk.f32_matmul(x, mx.zeros((8, 128), dtype=mx.bfloat16))
    with pytest.raises(ValueError, match="unknown path"):
        mk.set_isa("neon")
    with pytest.raises(ValueError):
        mk.set_threads(0)


def test_isa_reports_a_known_path():
    assert mk.isa() in ISAS
    assert mk.has_isa("scalar")
    missing = [name for name in ("avx512", "avx2") if not mk.has_isa(name)]
    for name in missing:
        with pytest.raises(ValueError, match="no " + name):
            mk.set_isa(name)


@pytest.mark.slow  # runs objdump
def test_no_string_moves_in_the_product_tiles():
    """GCC turns a loop that copies a row's scales (widen_scales) into `rep movsq`, whose
    start-up cost was ~27% of a one-row 4-bit product on AVX2; CMakeLists.txt's
    -fno-tree-loop-distribute-patterns keeps it a loop. A build without the flag fails here."""
    import shutil
    import subprocess

    if shutil.which("objdump") is None or not any(mk.has_isa(n) for n in ("avx2", "avx512")):
        pytest.skip("no objdump, or no x86 SIMD path built")
    listing = subprocess.run(["objdump", "-d", "-C", "--no-show-raw-insn", mk._ext.__file__],
                             capture_output=True, text=True, check=True).stdout
    function, moving = "", set()
    for line in listing.splitlines():
        if line.endswith(">:"):
            function = line
        elif "rep movs" in line and "::avx" in function and any(
                t in function for t in ("sum_tile<", "direct_tile<", "decode_tile<")):
            moving.add(function.split("<", 1)[1][:120])
    assert not moving, sorted(moving)


def one_row_cases():
    """Rows of x for one-row 4-bit products (AVX2 takes them in integers, q4_pieces.inc): groups
    of very different sizes, zero groups, a group whose largest |x| is a power of two, exact
    halves; then rows outside the integer form's range (the sum form takes those)."""
    rng = np.random.default_rng(11)
    k = 512
    spread = rng.standard_normal(k) * np.repeat(10.0 ** rng.integers(-12, 12, k // 32), 32)
    zeros = rng.standard_normal(k)
    zeros[64:192] = 0.0
    edges = rng.standard_normal(k)
    edges[::64] = 128.0  # X's top of range
    edges[1::64] = -64.0
    edges[2::64] = 0.5 + 2.0**-17  # half way between two steps, and just past
    halves = np.round(rng.standard_normal(k) * 4) / 2
    tiny = rng.standard_normal(k) * 1e-25
    huge = rng.standard_normal(k) * 1e25
    mixed = rng.standard_normal(k)
    mixed[100] = 3e-38  # a lone tiny value beside normal ones: within range, kept
    return {"spread": spread, "zeros": zeros, "edges": edges, "halves": halves, "tiny": tiny,
            "huge": huge, "mixed": mixed}


@pytest.mark.parametrize("group_size", (32, 64, 128))
def test_one_row_4bit_products_within_the_bound(isa, group_size):
    """Every row of one_row_cases within the float32 summation bound of the exact product (as
    every other product here), for every scale dtype."""
    mx.random.seed(group_size)
    for dtype in SCALE_DTYPES:
        wq, s, b = make_quantized(257, 512, group_size, 4, dtype)
        w = dequantized(wq, s, b, group_size, 4)
        wabs = dequantized(wq, s, b, group_size, 4, magnitude=True)
        for name, row in one_row_cases().items():
            x = mx.array(row.astype(np.float32))[None]
            exact = (np.array(x).astype(np.float64) @ np.array(w).astype(np.float64).T)
            assert_close(mk.affine_qmm(x, wq, s, b, group_size, 4), mx.array(exact.astype(np.float32)),
                         mx.abs(x) @ wabs.T, 512), (name, dtype)


def test_one_row_4bit_non_finite_x(isa):
    """A NaN or an infinity in x makes every output that the float32 product makes non-finite
    non-finite too (an infinity may come out as NaN: the sum form's inf * 0 and inf - inf)."""
    mx.random.seed(12)
    wq, s, b = make_quantized(64, 256, 64, 4)
    w = dequantized(wq, s, b, 64, 4)
    for bad in (float("nan"), float("inf"), -float("inf")):
        row = np.random.default_rng(1).standard_normal(256).astype(np.float32)
        row[70] = bad
        x = mx.array(row)[None]
        y, ref = np.array(mk.affine_qmm(x, wq, s, b, 64, 4)), np.array(x @ w.T)
        assert not np.isfinite(ref).any()
        assert not np.isfinite(y).any(), bad


def test_one_row_4bit_k_not_whole_chunks(isa):
    """K = 96 with groups of 32: not a whole number of 64-value chunks (the sum form runs)."""
    mx.random.seed(13)
    wq, s, b = make_quantized(33, 96, 32, 4)
    x = mx.random.normal((1, 96))
    assert_close(mk.affine_qmm(x, wq, s, b, 32, 4), x @ dequantized(wq, s, b, 32, 4).T,
                 mx.abs(x) @ dequantized(wq, s, b, 32, 4, magnitude=True).T, 96)


def test_one_row_threads_do_not_change_results():
    mx.random.seed(14)
    wq, s, b = make_quantized(1000, 1536, 64, 4)
    x = mx.random.normal((1, 1536))
    before = mk.threads()
    try:
        outs = []
        for n in (1, 2, 3):
            mk.set_threads(n)
            outs.append(np.array(mk.affine_qmm(x, wq, s, b, 64, 4)))
    finally:
        mk.set_threads(before)
    for q in outs[1:]:
        np.testing.assert_array_equal(q, outs[0])


@pytest.mark.parametrize("group_size", (32, 64, 128))
def test_one_row_4bit_as_accurate_as_float32(isa, group_size):
    """The integer form keeps x to about float32's own precision: against the exact (float64)
    product, its rms error is within 4 eps of |x| @ |w| (measured 0.9-1.3 on AVX2; float32
    summation's worst case is K eps; the low byte plane misplaced gave ~150)."""
    mx.random.seed(20 + group_size)
    wq, s, b = make_quantized(1792, 1536, group_size, 4)
    w64 = np.array(dequantized(wq, s, b, group_size, 4)).astype(np.float64)
    errors, sizes = [], []
    for _ in range(6):
        x = mx.random.normal((1, 1536)) * mx.exp(mx.random.normal((1, 1536)))
        x64 = np.array(x).astype(np.float64)
        errors.append(np.array(mk.affine_qmm(x, wq, s, b, group_size, 4)) - x64 @ w64.T)
        sizes.append(np.abs(x64) @ np.abs(w64).T)
    rms = lambda e: float(np.sqrt(np.mean(np.square(e))))  # noqa: E731
    assert rms(errors) <= 4 * EPS * rms(sizes), rms(errors) / (EPS * rms(sizes))
