"""Where a decode step's milliseconds go, and how far each part is from its roofline.

    python -m benchmarks.kernels.profile [--model qwen3-small] [--formats f32 4bit]
        [--batch 1 16] [--context 256]

For each format and batch: the whole decode step of the patched model (the runner's CPU layer
installed, its decode batch of `batch` rows of `--context` tokens, in the runner's step
context), then its parts with the same shapes and the same patched modules, each part one
graph as in the step (its nodes dispatched together, one evaluation): every linear layer's
product, the LM head, the attention core of every layer (softmax(QK^T)V over the batch's KV,
through the runner's dispatch: the decode attention kernel where it is built), sampling
(greedy, the runner's sampler), and building the step's graph in Python. "rest" is the step
minus the products, the head and the attention core (norms, RoPE, residuals, KV writes, the
embedding, and MLX's few microseconds per graph node); sampling follows the step, and the
graph build overlaps the previous step in the runner's pipeline (unless it waits for values:
fast math's NumPy calls evaluate the graph up to them). Rooflines: the bytes each part
reads at the machine's memory bandwidth (a NumPy sum, measured here), and the float32 GEMM
rate of the BLAS at that batch (measured here on the model's largest weight shape).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable

from actors.model_runner.cpu import blas
from benchmarks.kernels.skinny import median_ms


def bandwidth_gbs() -> float:
    import numpy as np

    a = np.ones(1 << 28, np.float32)  # 1 GiB
    best = min(_seconds(lambda: a.sum()) for _ in range(3))
    return a.nbytes / best / 1e9


def _seconds(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def linears(model) -> list[tuple[str, Any]]:
    import mlx.nn as nn

    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, (nn.Linear, nn.QuantizedLinear)) and "lm_head" not in name]


def head_of(model) -> tuple[Callable, Any]:
    inner = getattr(model, "model", model)
    if getattr(model, "lm_head", None) is not None:
        return model.lm_head, model.lm_head
    return inner.embed_tokens.as_linear, inner.embed_tokens


def weight_bytes(module) -> int:
    return sum(v.nbytes for _, v in _leaves(module.parameters()))


def _leaves(tree, prefix=""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _leaves(v, f"{prefix}.{k}")
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from _leaves(v, f"{prefix}.{i}")
    else:
        yield prefix, tree


def profile(model, installed, batch: int, context: int, repeat: int,
            vocab: int) -> dict[str, Any]:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from actors.model_runner.decode_batch import BatchedKV, standalone
    from actors.model_runner.sampling import RowParams, Sampler

    # The runner's decode batch: `batch` rows of `context` tokens each. Its lengths are not
    # advanced, so every timed step writes the same column and sees the same context.
    decode = None
    for row in range(1, batch + 1):
        prompt = make_prompt_cache(model)
        mx.eval(model(mx.array([[5] * context]), cache=prompt))
        decode = decode or standalone(prompt)
        decode.join_copy(row, prompt)
    token_buf = mx.full((batch + 1,), 7, dtype=mx.int32)

    def step():
        with installed.steps():  # the runner's context: fast math, the attention kernel
            return model(decode.inputs(token_buf), cache=decode.caches)

    parts: dict[str, float] = {"step": median_ms(step, repeat)}
    build = []
    for _ in range(repeat):
        start = time.perf_counter()
        out = step()
        build.append(time.perf_counter() - start)
        mx.eval(out)
    parts["graph build (Python)"] = 1000 * statistics.median(build)
    layers = linears(model)
    hidden, inputs = {}, []
    for _, m in layers:
        k = m.weight.shape[1] * (32 // m.bits if hasattr(m, "bits") else 1)
        inputs.append((m, hidden.setdefault(k, mx.random.normal((batch, 1, k)))))

    def products():  # every layer's product in one graph, as in the step (one eval, not 56)
        with installed.steps():
            return [m(x) for m, x in inputs]

    parts["linear layers"] = median_ms(products, repeat)
    head, head_module = head_of(model)
    x = mx.random.normal((batch, 1, model.args.hidden_size))
    parts["LM head"] = median_ms(lambda: head(x), repeat)
    if installed.greedy is not None:  # what the runner's plain greedy steps run instead
        from actors.model_runner.cpu import greedy_head

        def greedy_step():
            with installed.steps(), greedy_head.capture() as got:
                model(decode.inputs(token_buf), cache=decode.caches)
            return installed.greedy.tokens(got.hidden[:, -1, :])

        parts["step, greedy head"] = median_ms(greedy_step, repeat)
        parts["greedy head"] = median_ms(lambda: installed.greedy.tokens(x[:, -1, :]), repeat)
    attn = [c for c in decode.caches if isinstance(c, BatchedKV)]
    if attn:
        kv, positions = attn[0], decode.positions
        heads = model.args.num_attention_heads
        q = mx.random.normal((batch, heads, 1, kv.keys.shape[-1]), dtype=kv.keys.dtype)
        from actors.model_runner.cpu import attention

        def core():  # the runner's dispatch over what each layer's cache handed out last
            with installed.steps():  # (the kernel where it fits), every layer in one graph
                return [attention.attention(q, c.fetched[0], c.fetched[1], c, 0.1,
                                            positions.mask) for c in attn]

        step()  # each layer's cache.fetched: the K and V of a step, as the kernel checks
        parts["attention core"] = median_ms(core, repeat)
    sampler = Sampler(vocab, batch)
    for row in range(1, batch + 1):
        sampler.admit(row, RowParams(), [])
    logits = mx.random.normal((batch, vocab))
    parts["sampling (greedy)"] = median_ms(
        lambda: sampler.launch(list(range(1, batch + 1)), logits).arrays(), repeat)
    # The graph build overlaps the previous step in the runner; sampling follows the step.
    named = sum(v for k, v in parts.items()
                if k not in ("step", "graph build (Python)", "sampling (greedy)",
                             "step, greedy head", "greedy head", "rest"))
    parts["rest"] = parts["step"] - named
    # One token's K or V in a layer: kv_heads x dim (the pool is [kv_heads, pages, page, dim]).
    kv_bytes = sum(batch * (context + 1) * c.keys.shape[0] * c.keys.shape[-1] * c.keys.itemsize
                   * 2 for c in attn)
    return {"parts": parts,
            "bytes": {"linear layers": sum(weight_bytes(m) for _, m in layers),
                      "LM head": weight_bytes(head_module), "attention core": kv_bytes}}


def gemm_gflops(model, batch: int, repeat: int) -> float:
    """float32 GEMM rate through the BLAS at this batch, on the model's MLP up shape."""
    import mlx.core as mx

    k, n = model.args.hidden_size, model.args.intermediate_size
    x, w = mx.random.normal((batch, k)), mx.random.normal((n, k))
    ms = median_ms(lambda: x @ w.T, repeat)
    return 2 * batch * k * n / ms / 1e6


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.kernels.profile")
    p.add_argument("--model", default="qwen3-small", help="a built-in (models/builtin.py)")
    p.add_argument("--formats", nargs="+", default=["f32", "4bit"])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--repeat", type=int, default=15)
    p.add_argument("--blas", default="auto")
    p.add_argument("--activations", default="model", choices=["model", "float32"],
                   help="runtime.activations (bf16/fp16 checkpoints)")
    args = p.parse_args(argv)
    blas.load(args.blas)
    from actors.model_runner import cpu
    from actors.model_runner.loading import load_model
    from models.builtin import ensure_builtin
    from protocol.config import RuntimeConfig

    gbs = bandwidth_gbs()
    print(f"{args.model}, BLAS {blas.in_use()}, context {args.context}, memory bandwidth "
          f"{gbs:.1f} GB/s (NumPy sum), median of {args.repeat}")
    for fmt in args.formats:
        name = args.model if fmt == "f32" else f"{args.model}-{fmt}"
        model = load_model(str(ensure_builtin(name, progress=True)))
        vocab = model.args.vocab_size
        installed = cpu.install(model, RuntimeConfig(activations=args.activations), vocab)
        for b in args.batch:
            got = profile(model, installed, b, args.context, args.repeat, vocab)
            rate = gemm_gflops(model, b, args.repeat)
            print(f"\n{fmt} batch {b}: float32 GEMM {rate:.0f} GFLOP/s at this batch")
            print(f"  {'part':<22} {'ms':>8} {'bytes MiB':>10} {'at bandwidth ms':>16}")
            for name, ms in got["parts"].items():
                nbytes = got["bytes"].get(name)
                floor = f"{nbytes / gbs / 1e6:16.2f}" if nbytes else " " * 16
                mib = f"{nbytes / 2**20:10.1f}" if nbytes else " " * 10
                print(f"  {name:<22} {ms:8.2f} {mib} {floor}")


if __name__ == "__main__":
    main()
