"""The whole graph on the format variants of the built-ins (affine 3, 4, 8 bits, mxfp4, nvfp4,
mxfp8, bf16, fp16: models/formats.py), each served by `model.path`: greedy token ids, alone and
batched, equal mlx_lm.generate on the same checkpoint, with the strategy runtime.weights = auto
picks for each weight kind (cpu/weights.py)."""

from __future__ import annotations

import os

import pytest

from actors.model_runner.cpu.weights import load_kernels
from harness.graph import Graph
from harness.parity import PROMPTS, batched_then_alone
from models.builtin import ensure_builtin
from protocol.client import Client
from harness.oracle import Oracle
from tests.support.formats import EXTENDED

pytestmark = pytest.mark.slow

MAX_NEW = 16
KERNELS = load_kernels()[0] is not None
KINDS = {  # variant -> the weight kinds the runner must report (runner.weights)
    "qwen3-tiny-4bit": {"affine-4bit-g64"},
    "qwen3-tiny-8bit": {"affine-8bit-g64"},
    "qwen3-tiny-bf16": {"bfloat16"},
    "qwen3_5-tiny-4bit": {"affine-4bit-g64"},
    "qwen3-tiny-4bit-bf16": {"affine-4bit-g64"},
    # Formats the compiled kernels do not cover: served by "jit" (MLX's kernel for few rows,
    # dequantized for more: prefill and, for mxfp8 and fp16, batched decode).
    "qwen3-tiny-3bit": {"affine-3bit-g64"},
    "qwen3-tiny-mxfp4": {"mxfp4-4bit-g32"},
    "qwen3-tiny-nvfp4": {"nvfp4-4bit-g16"},
    "qwen3-tiny-mxfp8": {"mxfp8-8bit-g32"},
    "qwen3-tiny-fp16": {"float16"},
}
KERNEL_KINDS = {"affine-4bit-g64", "affine-8bit-g64", "bfloat16"}
# The format of mlx-community checkpoints of bf16 models: 4-bit weights, bf16 scales and
# activations. Measured with runtime.weights auto (kernel) and jit ("mlx" matches): over these
# prompts 2 of 4 differ from mlx-lm within 16 tokens (3 of 4 within 32) where mlx-lm's top-2 gap
# is 0.25 to 0.75: bf16 logits step by 1/8 to 1/4 here, and the runner's products round
# differently from MLX's bf16 quantized_matmul. mlx-lm's is the less precise one: on the CPU that
# kernel sums half-precision activations coarsely (measured on 7x1024 @ 1024x512: its mean
# error against the exact float32 sum is 22x that of the correctly rounded product for affine
# 4-bit, 7x for mxfp4 and nvfp4; "jit", which dequantizes to float32, gives the correctly
# rounded product bit for bit).
BF16_SCALES = pytest.mark.xfail(strict=True, reason="4-bit with bf16 scales: the runner's products "
                                "round differently from MLX's bf16 quantized_matmul")
# `make test` serves one format of each path (the kernels' 4-bit, 8-bit, bf16, a hybrid, and
# mxfp8 for jit); the other jit formats and the xfail are the extended matrix.
CASES = [pytest.param(n, marks=(*([BF16_SCALES] if n == "qwen3-tiny-4bit-bf16" else []),
                                *([pytest.mark.matrix] if n in EXTENDED else [])))
         for n in KINDS]


@pytest.mark.parametrize("name", CASES)
def test_served_greedy_equals_mlx_lm_alone_and_batched(model_cache, name):
    path = ensure_builtin(name, cache_dir=model_cache, progress=False)
    g = Graph(f"model.path={path}", "scheduler.max_running_requests=8")
    try:
        batched, alone = batched_then_alone(g.address, MAX_NEW)
        weights = g.wait_for("runner.weights")
        ready = g.wait_for("actor.ready", actor="runner")
    finally:
        assert g.stop() == 0
    assert weights and set(weights[0]["strategies"]) == KINDS[name], weights
    # The ready line names each kind's strategy and the float32 bytes kept resident.
    assert ready and ready[0]["resident_bytes"] == "0", ready
    assert ready[0]["weights"] == ", ".join(f"{k}: {s}" for k, s in
                                            weights[0]["strategies"].items()), ready
    for kind, strategy in weights[0]["strategies"].items():
        assert strategy == ("kernel" if KERNELS and kind in KERNEL_KINDS else "jit"), weights
    assert weights[0]["resident_mib"] == 0 and weights[0]["stored_mib"] > 0, weights
    oracle = Oracle(str(path))
    for prompt, b, a in zip(PROMPTS, batched, alone):
        ids = oracle.tokenizer.encode(prompt)
        ref = oracle.greedy(ids, MAX_NEW)
        assert b.prompt_tokens == a.prompt_tokens == len(ids)
        oracle.check(ids, b.token_ids, ref)
        oracle.check(ids, a.token_ids, ref)
    # The continuations are varied, so matching proves something.
    assert len({tuple(r.token_ids) for r in batched}) == len(PROMPTS)


@pytest.mark.parametrize("name", ["qwen3-tiny-bf16", "qwen3-tiny-4bit-bf16"])
def test_float32_activations_serve_the_upcast_checkpoints_tokens(model_cache, name):
    """runtime.activations = "float32" on bf16 checkpoints (bf16 weights; 4-bit weights with
    bf16 scales, whose bf16-activation run is the strict xfail above): the weights stay as
    stored and the greedy tokens are mlx-lm's on the checkpoint upcast to float32."""
    path = ensure_builtin(name, cache_dir=model_cache, progress=False)
    g = Graph(f"model.path={path}", "runtime.activations=float32",
              "scheduler.max_running_requests=8")
    try:
        batched, alone = batched_then_alone(g.address, MAX_NEW)
        weights = g.wait_for("runner.weights")
    finally:
        assert g.stop() == 0
    assert weights[0]["activations"] == "float32" and set(weights[0]["strategies"]) == KINDS[name]
    oracle = Oracle(str(path), upcast=True)
    for prompt, b, a in zip(PROMPTS, batched, alone):
        ids = oracle.tokenizer.encode(prompt)
        ref = oracle.greedy(ids, MAX_NEW)
        oracle.check(ids, b.token_ids, ref)
        oracle.check(ids, a.token_ids, ref)
    assert len({tuple(r.token_ids) for r in batched}) == len(PROMPTS)


def _shadow_kernels(tmp_path, monkeypatch) -> None:
    """The graph's processes find a mas_kernels that cannot be imported, as on a machine where
    `make setup` had no compiler to build it."""
    shadow = tmp_path / "shadow" / "mas_kernels"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text(
        'raise ImportError("simulated: native/ was not built (no C++ compiler)")\n')
    path = os.environ.get("PYTHONPATH", "")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(shadow.parent), path])))


@pytest.mark.parametrize("how", ["runtime.weights=jit", "no kernels built"])
def test_fallback_serves_the_same_tokens(model_cache, tmp_path, monkeypatch, how):
    """The fallback, forced by the config key or because the kernels are not there, serves
    mlx-lm's greedy tokens; without kernels the launch says what is missing."""
    path = ensure_builtin("qwen3-tiny-4bit", cache_dir=model_cache, progress=False)
    overrides = [f"model.path={path}"]
    if how == "no kernels built":
        _shadow_kernels(tmp_path, monkeypatch)
    else:
        overrides.append(how)
    g = Graph(*overrides)
    try:
        with Client(g.address, timeout=60) as client:
            got = [client.generate(p, max_new_tokens=MAX_NEW) for p in PROMPTS[:2]]
        weights = g.wait_for("runner.weights")
        missing = g.events("runner.kernels_missing")
    finally:
        assert g.stop() == 0
    assert weights[0]["strategies"] == {"affine-4bit-g64": "jit"}
    if how == "no kernels built":
        assert missing and "simulated: native/ was not built" in missing[0]["reason"]
    else:
        assert not missing  # asked for by the config: nothing to warn about
    oracle = Oracle(str(path))
    for prompt, r in zip(PROMPTS, got):
        ids = oracle.tokenizer.encode(prompt)
        oracle.check(ids, r.token_ids, oracle.greedy(ids, MAX_NEW))
