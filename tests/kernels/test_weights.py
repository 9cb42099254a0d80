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
# More rows than any kind's JIT_ROWS: "jit" dequantizes for this one.
LONG = mx.array([[(7 * i * i + 3) % 1000 for i in range(40)]])


@pytest.fixture(scope="module")
def tiny(model_cache):
    return ensure_builtin("qwen3-tiny", model_cache, progress=False)


def quantized(path, bits=4, group=64, mode="affine"):
    model = load_model(str(path))
    nn.quantize(model, group_size=group, bits=bits, mode=mode)
    return model


def bf16(path):
    model = load_model(str(path))
    model.set_dtype(mx.bfloat16)
    return model


@pytest.mark.parametrize("mode,bits,group", [
    ("affine", 4, 64), ("affine", 8, 32), ("affine", 3, 64), ("affine", 6, 64),
    ("mxfp4", 4, 32), ("nvfp4", 4, 16), ("mxfp8", 8, 32),
])  # fmt: skip
def test_every_strategy_gives_mlx_logits(tiny, mode, bits, group):
    # Few rows (jit: MLX's kernel), many (jit: dequantized), one row.
    prompts = (PROMPT, LONG, PROMPT[:, :1])
    reference = [quantized(tiny, bits, group, mode)(p) for p in prompts]
    for strategy in STRATEGIES:
        model = quantized(tiny, bits, group, mode)
        plan = weights.install(model, RuntimeConfig(weights=strategy))
        kind = f"{mode}-{bits}bit-g{group}"
        assert list(plan.kinds) == [kind] and plan.kinds[kind].layers > 0
        for prompt, want in zip(prompts, reference):
            got = model(prompt)
            # The floating-point modes' sums in another order: 5e-5 apart (measured).
            assert mx.allclose(got, want, atol=2e-3, rtol=1e-3).item(), (strategy, prompt.shape)
            assert mx.array_equal(mx.argmax(got, -1), mx.argmax(want, -1)).item()


@pytest.mark.parametrize("mode,bits,group", [
    ("affine", 2, 32), ("affine", 3, 64), ("affine", 5, 128), ("affine", 6, 64),
    ("mxfp4", 4, 32), ("nvfp4", 4, 16), ("mxfp8", 8, 32),
])  # fmt: skip
def test_jit_dequantizes_from_its_kinds_row_count(mode, bits, group):
    """Below JIT_ROWS rows a jit layer computes what MLX's kernel does, bit for bit; from
    there the float32 product of the dequantized weight."""
    layer = nn.QuantizedLinear.from_linear(nn.Linear(256, 96), group, bits, mode=mode)
    layer.__class__ = weights._class_for(nn.QuantizedLinear, "jit")
    rows = weights.JIT_ROWS[(mode, bits)]
    w = mx.dequantize(layer.weight, layer.scales, layer.get("biases"), group_size=group,
                      bits=bits, mode=mode, dtype=mx.float32)
    for n in (1, rows - 1, rows, rows + 5):
        x = mx.random.normal((n, 256))
        if n < rows:
            want = mx.quantized_matmul(x, layer.weight, layer.scales, layer.get("biases"),
                                       group_size=group, bits=bits, mode=mode)
        else:
            want = x @ w.T
        assert mx.array_equal(layer(x), want + layer.bias).item(), n


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_half_precision_jit_and_resident_keep_the_models_dtype(tiny, dtype):
    """bf16/fp16 weights upcast (jit: per product; resident: once) give MLX's own logits, in
    the model's dtype: a float32 result would carry the rest of the model into float32."""
    def half():
        model = load_model(str(tiny))
        model.set_dtype(dtype)
        return model

    reference = half()
    for strategy in ["jit", "resident"]:
        model = half()
        plan = weights.install(model, RuntimeConfig(weights=strategy))
        kind = str(dtype).removeprefix("mlx.core.")
        assert plan.kinds[kind].strategy == strategy
        assert (plan.kinds[kind].resident_bytes > 0) == (strategy == "resident")
        for prompt in (PROMPT, PROMPT[:, :1]):
            got, want = model(prompt), reference(prompt)
            assert got.dtype == dtype, strategy
            # MLX's half matmul sums in float32 and rounds once, as the upcast does.
            assert mx.mean(mx.abs(got - want) > 0).item() < 1e-3, (strategy, prompt.shape)


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


@pytest.mark.parametrize("half", ["bf16", "bf16-4bit"])
def test_float32_activations_give_the_upcast_models_logits(tiny, half):
    """runtime.activations = "float32": the stored weights stay as they are, everything else
    runs in float32, as mlx-lm on the checkpoint upcast to float32 does."""
    def checkpoint():
        model = bf16(tiny)
        if half == "bf16-4bit":  # 4-bit with bf16 scales, as mlx-community's are
            nn.quantize(model, group_size=64, bits=4)
        return model

    upcast = checkpoint()
    upcast.set_dtype(mx.float32)
    for strategy in STRATEGIES:
        model = checkpoint()
        weights.install(model, RuntimeConfig(weights=strategy, activations="float32"))
        stored = [m for _, m in model.named_modules() if isinstance(m, weights._Stored)]
        if strategy != "resident":  # resident layers are float32 layers now
            assert stored and all(m.weight.dtype != mx.float32 for m in stored)
        norms = [m.weight for name, m in model.named_modules() if name.endswith("norm")]
        assert norms and all(w.dtype == mx.float32 for w in norms)
        for prompt in (PROMPT, LONG, PROMPT[:, :1]):
            got, want = model(prompt), upcast(prompt)
            assert got.dtype == mx.float32, strategy
            assert mx.allclose(got, want, atol=2e-4, rtol=1e-4).item(), (strategy, prompt.shape)
            assert mx.array_equal(mx.argmax(got, -1), mx.argmax(want, -1)).item()


def test_float32_activations_size_the_kv_at_four_bytes():
    from models.info import ModelInfo
    from models.sizing import kv_bytes_per_token
    from protocol.config import Config

    info = ModelInfo(path="m", name="m", context_length=64, eos_ids=[], vocab_size=10,
                     model_type="qwen3", kv_bytes_per_token=1024, kv_value_bytes=2)
    assert kv_bytes_per_token(Config(), info) == 1024
    wide = Config(runtime=RuntimeConfig(activations="float32"))
    assert kv_bytes_per_token(wide, info) == 2048
    f32 = ModelInfo(path="m", name="m", context_length=64, eos_ids=[], vocab_size=10,
                    model_type="qwen3", kv_bytes_per_token=2048, kv_value_bytes=4)
    assert kv_bytes_per_token(wide, f32) == 2048


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


@pytest.mark.parametrize("bits", [4, 3])
def test_resident_that_does_not_fit_is_refused_naming_the_key(tiny, bits):
    model = quantized(tiny, bits)
    with pytest.raises(ValueError, match="runtime.weight_memory_budget_mib"):
        weights.install(model, RuntimeConfig(weights="resident", weight_memory_budget_mib=1))
    # The need is counted exactly, odd bits too (a uint32 holds 10 and a fraction 3-bit
    # values): one MiB short is refused, the need rounded up fits.
    need = weights.install(quantized(tiny, bits), RuntimeConfig(weights="resident"))
    need = sum(p.resident_bytes for p in need.kinds.values())
    with pytest.raises(ValueError, match="runtime.weight_memory_budget_mib"):
        weights.install(model, RuntimeConfig(weights="resident",
                                             weight_memory_budget_mib=need // 2**20))
    weights.install(model, RuntimeConfig(weights="resident",
                                         weight_memory_budget_mib=-(-need // 2**20)))


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
