"""A quantized embedding's lookup as one graph node (mas_kernels.quantized_rows, used by
cpu/weights.py's kernel-strategy QuantizedEmbedding): mx.dequantize's values bit for bit for
4 and 8 bits, group sizes 32/64/128, float32 and bfloat16 scales, in the scales' type or in
float32; ids past the table read as zeros rather than stray memory; bad arguments named; and
the runner's installed embedding giving mlx-lm's very rows in one node."""

from __future__ import annotations

import re

import numpy as np
import pytest

mk = pytest.importorskip(
    "mas_kernels", reason="mas_kernels is not built (pip install --no-build-isolation ./native)")
import mlx.core as mx  # noqa: E402


def _table(bits: int, group: int, dtype: mx.Dtype, vocab: int = 300, k: int = 256):
    w = mx.random.normal((vocab, k), key=mx.random.key(bits * 1000 + group)) * 0.1
    q, scales, biases = mx.quantize(w, group_size=group, bits=bits)
    return q, scales.astype(dtype), biases.astype(dtype)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("bits", [4, 8])
def test_rows_are_mlx_dequantize_bit_for_bit(bits, group, dtype):
    q, scales, biases = _table(bits, group, dtype)
    ids = mx.array([0, 299, 17, 17, 5], dtype=mx.int32)
    want = mx.dequantize(q[ids], scales[ids], biases[ids], group_size=group, bits=bits)
    got = mk.quantized_rows(q, scales, biases, ids, group, bits)
    assert got.dtype == want.dtype == dtype
    assert mx.array_equal(got, want).item()
    # float32: as the runner's float32 lookups of a bf16-scaled table (scales widened first).
    want = mx.dequantize(q[ids], scales[ids].astype(mx.float32), biases[ids].astype(mx.float32),
                         group_size=group, bits=bits)
    got = mk.quantized_rows(q, scales, biases, ids, group, bits, True)
    assert got.dtype == want.dtype == mx.float32 and mx.array_equal(got, want).item()


def test_ids_past_the_table_are_zero_rows():
    q, scales, biases = _table(4, 64, mx.float32, vocab=10)
    got = np.array(mk.quantized_rows(q, scales, biases, mx.array([3, 10, -1], mx.int32), 64, 4))
    want = np.array(mx.dequantize(q[3:4], scales[3:4], biases[3:4], group_size=64, bits=4))
    np.testing.assert_array_equal(got[0], want[0])
    assert not got[1:].any()


def test_bad_arguments_raise():
    q, scales, biases = _table(4, 64, mx.float32)
    ids = mx.array([1, 2], mx.int32)
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        mk.quantized_rows(q, scales, biases, ids, 64, 3)
    with pytest.raises(ValueError, match="group_size must divide"):
        mk.quantized_rows(q, scales, biases, ids, 96, 4)
    with pytest.raises(ValueError, match="scales and biases must be"):
        mk.quantized_rows(q, scales, biases.astype(mx.bfloat16), ids, 64, 4)
    with pytest.raises(ValueError, match="scales and biases must be"):
        mk.quantized_rows(q, scales.astype(mx.float16), biases.astype(mx.float16), ids, 64, 4)
    with pytest.raises(ValueError, match="ids must be int32"):
        mk.quantized_rows(q, scales, biases, ids.astype(mx.int64), 64, 4)
    with pytest.raises(ValueError, match="w must be uint32"):
        mk.quantized_rows(q.astype(mx.int32), scales, biases, ids, 64, 4)


@pytest.mark.parametrize("activations", ["model", "float32"])
@pytest.mark.parametrize("name", ["qwen3-tiny-4bit", "qwen3-tiny-8bit"])
def test_the_installed_embedding_is_mlx_lms_in_one_node(name, activations, model_cache, tmp_path):
    """The runner's install: with the model's activations, mlx-lm's lookup; with float32
    ones and bf16 scales (as mlx-community ships them), the lookup of the scales widened to
    float32 (weights.py's float32 lookups). Both one node."""
    from actors.model_runner import cpu
    from actors.model_runner.loading import load_model
    from models.builtin import ensure_builtin
    from protocol.config import RuntimeConfig

    path = str(ensure_builtin(name, cache_dir=model_cache, progress=False))
    stock, model = load_model(path), load_model(path)
    if activations == "float32":
        for m in (stock, model):
            e = m.model.embed_tokens
            e.scales, e.biases = e.scales.astype(mx.bfloat16), e.biases.astype(mx.bfloat16)
    cpu.install(model, RuntimeConfig(activations=activations), model.args.vocab_size)
    ids = mx.array([[0, 5, 151, model.args.vocab_size - 1]], dtype=mx.int32)
    got = model.model.embed_tokens(ids)
    e = stock.model.embed_tokens
    if activations == "float32":
        flat = ids.flatten()
        want = mx.dequantize(e.weight[flat], e.scales[flat].astype(mx.float32),
                             e.biases[flat].astype(mx.float32), group_size=e.group_size,
                             bits=e.bits).reshape(1, 4, -1)
    else:
        want = e(ids)
    mx.export_to_dot(str(tmp_path / "lookup.dot"), got)  # the graph, before it is evaluated
    ops = re.findall(r'label ="([^"]+)"', (tmp_path / "lookup.dot").read_text())
    assert ops.count("MasQuantizedRows") == 1 and "LeftShift" not in ops, ops
    assert got.shape == want.shape and got.dtype == want.dtype == mx.float32
    assert mx.array_equal(got, want).item()
    # No ids: an empty lookup of the right shape, as mlx-lm's.
    assert model.model.embed_tokens(mx.zeros((1, 0), dtype=mx.int32)).shape == (1, 0, e.dims)
