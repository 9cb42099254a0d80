"""The runner with every CPU patch off: what it runs on Metal and CUDA, where MLX's own kernels
are the fast path. Driven by the real scheduler core (tests/support/drive.py) on the dense
(qwen3-tiny), the hybrid (qwen3_5-tiny) and a 4-bit (qwen3-tiny-4bit) built-in model: the greedy
tokens are mlx-lm's, and none of the patches ran.

What is off, and how (actors/model_runner/cpu/__init__.py install(), runner.py):

- by its `runtime.*` switch (PLAIN below): the skinny matmuls (skinny_matmul=false), fast math
  (fast_math=false), the stored-format weight strategies (weights="mlx": MLX's quantized_matmul
  and its own products for every kind; it also leaves the compiled kernels unloaded, so the
  decode attention kernel, the page-pool kv_write kernel, the norm/RoPE kernels, the few-node
  Qwen3 layers and the kernels' argmax/sampling draws are all off), the greedy head
  (greedy_head=false), the compiled decode forward (compile_decode=false), the chunked
  gated-delta recurrence and shifted convolutions (linear_prefill=false: mlx-lm's own
  recurrence), MLX's buffer cache limit (buffer_cache_mib=0) and the stream-thread pinning
  (pin_stream=false; an actor-level patch the runner core never reaches anyway);
- by the device check: mlx.core.default_device() answers a GPU device while the runner is built
  and driven (as in a Metal or CUDA process; the arrays still live on this CPU). Every patch
  checks `mx.default_device() == mx.cpu` as its second gate, and runner.queue_blocks (read the
  last step back before queueing the next one) has no switch but this check.

Not off, by design: head.py's last-position cut of the LM head (installed on every device, a
GPU process runs it too), and the BLAS library loaded for the whole test process by
tests/conftest.py before MLX was imported (it only serves MLX's CPU matmuls, the oracle's
too; a GPU process does not use it). mlx-lm's module globals that an earlier test's runner
pointed at our dispatchers (attention, SwiGLU, SiLU, the gated-delta ops) are put back to
mlx-lm's own first, as in a fresh process; the test then checks that nothing set them again.

That nothing ran is counted, not assumed: every function of the compiled kernels' module
(mas_kernels) and every Python entry point of the patches is wrapped with a counter for the
run; a control run with the default config on the CPU shows the same counters do move."""

from __future__ import annotations

import sys
from collections import Counter
from contextlib import contextmanager
from functools import wraps

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models import activations, base

from actors.model_runner import chunked_delta, compiled_decode, cpu
from actors.model_runner.cpu import attention, fastmath, greedy_head, skinny, weights
from actors.model_runner.runner import ModelRunner
from harness.oracle import Oracle
from models.builtin import ensure_builtin
from models.info import read_model_info
from protocol.config import RuntimeConfig
from tests.support.drive import check_all, run

PLAIN = RuntimeConfig(skinny_matmul=False, fast_math=False, weights="mlx", greedy_head=False,
                      compile_decode=False, linear_prefill=False, buffer_cache_mib=0,
                      pin_stream=False)
GPU = mx.Device(mx.gpu)
PROMPTS = ["Hello world", "def f(x):\n    return",
           "The quick brown fox jumps over the lazy dog. " * 6]
TOKENS = 16


@pytest.fixture(scope="module", params=["qwen3-tiny", "qwen3_5-tiny", "qwen3-tiny-4bit"])
def model(request, model_cache):
    path = str(ensure_builtin(request.param, cache_dir=model_cache, progress=False))
    return path, Oracle(path), read_model_info(path)


def _arrivals(oracle):
    ids = [oracle.tokenizer.encode(p) for p in PROMPTS]
    # Two rows at once, a third joining while they decode; the long prompt (~60 tokens) runs
    # in chunks of 16 beside the decoding rows.
    return {0: [("a", ids[0], TOKENS), ("b", ids[1], TOKENS)], 2: [("c", ids[2], TOKENS)]}


# -- counting what ran ------------------------------------------------------------------------


def _ours() -> dict[str, tuple[object, object]]:
    """mlx-lm's module globals the patches replace: name -> (mlx-lm's own, ours...)."""
    return {"scaled_dot_product_attention": (base.scaled_dot_product_attention,
                                             (fastmath.attention, attention.attention)),
            "swiglu": (activations.swiglu, (fastmath.swiglu,)),
            "precise_swiglu": (activations.precise_swiglu, (fastmath.precise_swiglu,)),
            "nn": (nn, (fastmath._nn,))}


def _patched_globals() -> list[str]:
    """mlx-lm model modules' globals that point at one of the patches' dispatchers now."""
    from mlx_lm.models import gated_delta

    found = [f"{mod.__name__}.{name}"
             for mod in list(sys.modules.values()) if mod is not None
             and mod.__name__.startswith("mlx_lm.models.")
             for name, (_, ours) in _ours().items()
             if any(getattr(mod, name, None) is o for o in ours)]
    if getattr(gated_delta.gated_delta_ops, "_mas_chunked", False):
        found.append("mlx_lm.models.gated_delta.gated_delta_ops")
    return found


def _restore_mlx_lm(monkeypatch) -> None:
    """mlx-lm's own functions back where an earlier runner in this process pointed its module
    globals at our dispatchers (a fresh GPU process starts with mlx-lm's own). Every one of
    these globals, changed or not, gets its present value back after the test, whatever a
    runner built in the test sets there."""
    from mlx_lm.models import gated_delta

    for mod in [m for m in list(sys.modules.values())
                if m is not None and m.__name__.startswith("mlx_lm.models.")]:
        for name, (stock, ours) in _ours().items():
            if hasattr(mod, name):
                now = getattr(mod, name)
                monkeypatch.setattr(mod, name, stock if any(now is o for o in ours) else now)
    current = gated_delta.gated_delta_ops
    monkeypatch.setattr(gated_delta, "gated_delta_ops",
                        current.reference if getattr(current, "_mas_chunked", False)
                        else current)


def _count(monkeypatch, calls: Counter, owner, name: str, label: str, when=None) -> None:
    fn = getattr(owner, name)

    @wraps(fn)
    def counted(*args, **kwargs):
        if when is None or when(*args, **kwargs):
            calls[label] += 1
        return fn(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)


def _count_patches(monkeypatch) -> tuple[Counter, list, list[ModelRunner]]:
    """(calls per patch entry point, each cpu.install()'s Installed, each runner built)."""
    calls: Counter = Counter()
    kernels, _ = weights.load_kernels()
    if kernels is not None:
        for name in dir(kernels):
            if not name.startswith("_") and name not in ("mx", "annotations") \
                    and callable(getattr(kernels, name)):
                _count(monkeypatch, calls, kernels, name, f"mas_kernels.{name}")
    # The patches' own Python paths, kernels or not.
    for owner, names in (
            (skinny, ["_product"]),  # the (W @ x.T).T products
            (fastmath, ["attention", "swiglu", "silu", "precise_swiglu", "softmax", "_exp_neg"]),
            (attention, ["attention"]),
            (chunked_delta, ["chunked_gated_delta"]),
            (chunked_delta.ShiftedConv1d, ["__call__"]),
            (greedy_head.GreedyHead, ["tokens"]),
            (compiled_decode.CompiledDecode, ["__call__"]),
            (weights, ["_dequantized", "_make_resident"]),  # "jit" and "resident"
            (mx, ["set_cache_limit"])):
        for name in names:
            _count(monkeypatch, calls, owner, name, f"{owner.__name__}.{name}")
    # Stored-format layers: any strategy but MLX's own ("mlx") is a patch.
    for name in ("_quantized_product", "_dense_product"):
        _count(monkeypatch, calls, weights, name, f"weights.{name}(not mlx)",
               when=lambda module, x, strategy: strategy != "mlx")
        _count(monkeypatch, calls, weights, name, f"weights.{name}(mlx)",
               when=lambda module, x, strategy: strategy == "mlx")
    installed: list = []
    install = cpu.install
    monkeypatch.setattr(cpu, "install",
                        lambda *a, **kw: installed.append(install(*a, **kw)) or installed[-1])
    runners: list[ModelRunner] = []
    init = ModelRunner.__init__

    def recorded(self, *args, **kwargs):
        init(self, *args, **kwargs)
        runners.append(self)

    monkeypatch.setattr(ModelRunner, "__init__", recorded)
    return calls, installed, runners


@contextmanager
def _on_a_gpu(monkeypatch):
    """mx.default_device() answers a GPU device, as in a Metal or CUDA process."""
    with monkeypatch.context() as m:
        m.setattr(mx, "default_device", lambda: GPU)
        yield


def _patch_calls(calls: Counter) -> dict[str, int]:
    """The counted calls that were a patch (MLX's own products through the stored layers are
    counted too, apart: "(mlx)")."""
    return {k: n for k, n in calls.items() if n and not k.endswith("(mlx)")}


def test_every_patch_off_gives_mlx_lm_tokens_and_runs_no_patch(model, monkeypatch):
    path, oracle, info = model
    arrivals = _arrivals(oracle)
    _restore_mlx_lm(monkeypatch)
    assert _patched_globals() == []
    calls, installed, runners = _count_patches(monkeypatch)
    with _on_a_gpu(monkeypatch):
        got, sched = run(path, info, arrivals, depth=2, chunk=16, runtime=PLAIN)
    check_all(oracle, arrivals, got)
    # The long prompt ran in chunks beside decoding rows: a later chunk (start > 0) in a step
    # that also decodes.
    assert any(any(b.future) and any(start > 0 and not fut
                                     for start, fut in zip(b.start_pos, b.future))
               for b in sched.batches)

    assert _patch_calls(calls) == {}
    assert _patched_globals() == []
    [runner] = runners
    [done] = installed
    assert runner.cpu is done
    assert (done.skinny_layers, done.skinny_kernels, done.fast_math_globals,
            done.decode_attention, done.norm_rope_modules, done.qwen3_layers,
            done.buffer_cache_mib, done.greedy_head_mib, done.greedy, done.chunked_delta,
            done.delta_kernel, done.shifted_convs) == (0, False, 0, False, 0, 0, 0, 0.0, None,
                                                       False, False, 0)
    assert {p.strategy for p in done.weights.kinds.values()} <= {"float32", "mlx"}
    assert done.weights.kernels == ""
    assert runner.compiled is None and not runner.queue_blocks and not runner.early_queue
    if "4bit" in path:  # the quantized layers did multiply, through MLX's own kernel
        assert calls["weights._quantized_product(mlx)"] > 0
        assert {p.strategy for p in done.weights.kinds.values()} == {"mlx"}


def test_the_counters_see_the_patches_on_the_cpu(model, monkeypatch):
    """The control: the default config on the CPU, counted the same way, runs patches (so
    an empty count above is not a counter that sees nothing)."""
    path, oracle, info = model
    ids = oracle.tokenizer.encode(PROMPTS[2])
    arrivals = {0: [("a", ids, 4), ("b", ids[:20], 4)]}
    _restore_mlx_lm(monkeypatch)
    calls, installed, runners = _count_patches(monkeypatch)
    got, _ = run(path, info, arrivals, depth=2, chunk=16)
    check_all(oracle, arrivals, got)
    ran = _patch_calls(calls)
    assert ran, "no patch ran with the default config on the CPU"
    if weights.load_kernels()[0] is not None:
        assert any(k.startswith("mas_kernels.") for k in ran), ran
    [done] = installed
    assert done.skinny_layers or done.fast_math_globals or done.decode_attention
    assert runners[0].queue_blocks


def test_a_gpu_device_alone_turns_the_cpu_patches_off(model, monkeypatch):
    """The default config in a process whose device is a GPU: every cpu/ patch is off
    without its switch, by the device check alone. Only linear_prefill's stays (mlx-lm's
    gated-delta recurrence is ops-based on every device but Metal, where mlx-lm takes its own
    Metal kernel instead): in blocks of matrix products, not through the compiled kernel."""
    from actors.model_runner.loading import load_model

    path, _, info = model
    _restore_mlx_lm(monkeypatch)
    with _on_a_gpu(monkeypatch):
        runner = ModelRunner(load_model(path), 2, kv_slots=256,
                             state_slots=4 if info.state_layers else 0)
    done = runner.cpu
    assert (done.skinny_layers, done.fast_math_globals, done.decode_attention,
            done.norm_rope_modules, done.qwen3_layers, done.buffer_cache_mib,
            done.greedy_head_mib, done.delta_kernel) == (0, 0, False, 0, 0, 0, 0.0, False)
    assert {p.strategy for p in done.weights.kinds.values()} <= {"float32", "mlx"}
    assert runner.compiled is None and not runner.queue_blocks
    assert _patched_globals() == ["mlx_lm.models.gated_delta.gated_delta_ops"]
    assert done.chunked_delta and (done.shifted_convs > 0) == bool(info.state_layers)
