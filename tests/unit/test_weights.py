"""Weights as stored (cpu/weights.py): each weight kind gets the strategy `runtime.weights` asks
for, every strategy computes the product MLX's own kernels compute, a resident upcast that
does not fit is refused naming the key, and missing kernels are said, not hidden."""

from __future__ import annotations

import platform
import shutil

import mlx.core as mx
import mlx.nn as nn
import pytest

from actors.model_runner.cpu import skinny, weights
from actors.model_runner.loading import load_model
from models.builtin import ensure_builtin
from protocol.config import RuntimeConfig

STRATEGIES = ["mlx", "jit", "resident", "auto"]
PROMPT = mx.array([[3, 14, 159, 2653, 5897, 9323, 8462]])


@pytest.fixture(scope="module")
def tiny(model_cache):
    return ensure_builtin("qwen3-tiny", model_cache, progress=False)


def quantized(path, bits=4, group=64):
    model = load_model(str(path))
    nn.quantize(model, group_size=group, bits=bits)
    return model


def bf16(path):
    model = load_model(str(path))
    model.set_dtype(mx.bfloat16)
    return model


@pytest.mark.parametrize("bits,group", [(4, 64), (8, 32), (3, 64)])
def test_every_strategy_gives_mlx_logits(tiny, bits, group):
    reference = quantized(tiny, bits, group)(PROMPT)
    for strategy in STRATEGIES:
        model = quantized(tiny, bits, group)
        plan = weights.install(model, RuntimeConfig(weights=strategy))
        kind = f"affine-{bits}bit-g{group}"
        assert list(plan.kinds) == [kind] and plan.kinds[kind].layers > 0
        got = model(PROMPT)
        assert mx.allclose(got, reference, atol=2e-3, rtol=1e-3).item(), strategy
        assert mx.array_equal(mx.argmax(got, -1), mx.argmax(reference, -1)).item()
        one = model(PROMPT[:, :1])  # one row: jit takes MLX's kernel, the others their own
        assert mx.allclose(one, reference[:, :1], atol=2e-3, rtol=1e-3).item(), strategy


def test_bf16_strategies_give_mlx_logits(tiny):
    reference = bf16(tiny)(PROMPT).astype(mx.float32)
    for strategy in STRATEGIES:
        model = bf16(tiny)
        plan = weights.install(model, RuntimeConfig(weights=strategy))
        assert plan.kinds["bfloat16"].strategy == (
            "kernel" if strategy == "auto" and plan.kernels else
            "jit" if strategy == "auto" else strategy)
        got = model(PROMPT).astype(mx.float32)
        # bf16 activations: a few units in the last place of bf16 between summation orders.
        assert mx.mean(mx.argmax(got, -1) == mx.argmax(reference, -1)).item() >= 6 / 7


def test_resident_layers_become_float32_layers(tiny):
    model = quantized(tiny)
    plan = weights.install(model, RuntimeConfig(weights="resident"))
    layers = [m for _, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Embedding))]
    assert layers and all(m.weight.dtype == mx.float32 for m in layers)
    assert not any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))
                   for _, m in model.named_modules())
    # The float32 paths take them: the skinny matmul switches them like any float32 layer.
    assert skinny.apply(model) == len(layers)
    assert plan.kinds["affine-4bit-g64"].resident_bytes == sum(m.weight.nbytes for m in layers)


def test_resident_that_does_not_fit_is_refused_naming_the_key(tiny):
    model = quantized(tiny)
    with pytest.raises(ValueError, match="runtime.weight_memory_budget_mib"):
        weights.install(model, RuntimeConfig(weights="resident", weight_memory_budget_mib=1))


def test_float32_model_is_left_alone(tiny):
    model = load_model(str(tiny))
    before = {type(m) for _, m in model.named_modules()}
    plan = weights.install(model, RuntimeConfig(weights="auto"))
    assert {k: p.strategy for k, p in plan.kinds.items()} == {"float32": "float32"}
    assert {type(m) for _, m in model.named_modules()} == before
    assert plan.missing == ""  # nothing the kernels would have taken: nothing to warn about


def test_missing_kernels_are_said_and_jit_serves(tiny, monkeypatch):
    monkeypatch.setattr(weights, "load_kernels", lambda: (None, "no mas_kernels here"))
    model = quantized(tiny)
    plan = weights.install(model, RuntimeConfig(weights="auto"))
    assert plan.missing == "no mas_kernels here" and plan.kernels == ""
    assert plan.kinds["affine-4bit-g64"].strategy == "jit"
    assert plan.log_fields()["kernels"] == "off"


def test_skinny_leaves_other_formats_to_weights(tiny):
    model = bf16(tiny)
    assert skinny.apply(model) == 0


def test_kernels_are_built_where_a_compiler_is():
    """`make setup` builds native/ where a C++ compiler and x86-64 are: a build that failed
    silently would leave every stored format on the fallback, and the kernel tests skipped."""
    if platform.machine() not in ("x86_64", "AMD64") or not shutil.which("g++"):
        pytest.skip("no x86-64 C++ compiler here: the fallback serves (tested above)")
    module, why = weights.load_kernels()
    assert module is not None, why
    assert module.isa() in ("avx512", "avx2", "scalar")
