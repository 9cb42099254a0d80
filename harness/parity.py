"""Served greedy tokens against mlx_lm.generate, as a command: the e2e tests' oracle check
(harness/oracle.py) for where CI cannot run it, i.e. on a GPU (MLX's CUDA or Metal kernels
instead of this project's CPU ones) or on a checkpoint of the user's own.

    python -m harness.parity [--models qwen3-tiny qwen3-tiny-4bit ...] [--model-path DIR ...]
                             [--tokens 16] [--modes batched overlap-off chunked]

Each model is served by `launch` once per mode. In each, the prompts go in together (batched)
and then one by one (alone, which hits the prefix cache the batch filled). A prompt passes when
its tokens equal mlx-lm's, or first differ where mlx-lm's top two logits are within 1e-4 and
ours took the other one. Exit status 1 when any prompt fails.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

import mlx.core as mx

from harness.graph import Graph
from models.builtin import ensure_builtin
from protocol.client import AsyncClient, Client
from harness.oracle import Oracle

PROMPTS = [
    "Hello world",
    "中文的自然语言处理很有趣，我们今天来讨论",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "A longer prompt about many things. " * 40,
]
BASE = ("scheduler.max_running_requests=8",)  # every mode: all prompts in one batch
MODES = {  # mode -> launch overrides beside model.path and BASE
    "batched": (),
    "overlap-off": ("scheduler.overlap=false",),
    # The long prompt (~280 tokens) prefills in five chunks, beside the others' decode.
    "chunked": ("scheduler.chunked_prefill_size=64",),
}
DEFAULT_MODELS = ["qwen3-tiny", "qwen3-tiny-4bit", "qwen3-tiny-8bit", "qwen3-tiny-bf16",
                  "qwen3_5-tiny", "qwen3_5-tiny-4bit"]


def batched_then_alone(address: str, tokens: int) -> tuple[list, list]:
    """Every prompt's reply from the graph at `address`: all sent together, then one at a time
    (which hits the prefix cache the batch filled)."""
    async def together() -> list:
        async with AsyncClient(address) as client:
            return await asyncio.gather(*[client.generate(p, max_new_tokens=tokens)
                                          for p in PROMPTS])

    batched = asyncio.run(asyncio.wait_for(together(), 600))
    with Client(address, timeout=300) as client:
        alone = [client.generate(p, max_new_tokens=tokens) for p in PROMPTS]
    return batched, alone


def serve(path: str, overrides: tuple[str, ...], tokens: int) -> tuple[list, list, str]:
    """Token ids of every prompt, batched then alone, and the device the runner said it ran on."""
    g = Graph(f"model.path={path}", *BASE, *overrides)
    try:
        batched, alone = batched_then_alone(g.address, tokens)
        ready = g.wait_for("runner.ready")
    finally:
        code = g.stop()
    if code != 0:
        raise RuntimeError(f"the graph exited with status {code}")
    return ([r.token_ids for r in batched], [r.token_ids for r in alone],
            ready[0].get("device", "?") if ready else "?")


def verdict(oracle: Oracle, ids: list[int], got: list[int], ref: list[int]) -> str:
    try:
        oracle.check(ids, got, ref)
    except AssertionError as e:
        return "FAIL: " + str(e).splitlines()[0]
    return "equal" if got == ref else "near-tie"


def check_model(name: str, path: str, modes: list[str], tokens: int) -> list[dict]:
    oracle = Oracle(path)
    refs = [(ids, oracle.greedy(ids, tokens))
            for ids in (oracle.tokenizer.encode(p) for p in PROMPTS)]
    rows = []
    for mode in modes:
        batched, alone, device = serve(path, MODES[mode], tokens)
        for how, got in (("batched", batched), ("alone", alone)):
            results = [verdict(oracle, ids, g, ref) for (ids, ref), g in zip(refs, got)]
            rows.append({"model": name, "mode": mode, "how": how, "device": device,
                         "results": results})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="*", default=None, help="built-in models (models/formats.py "
                   "variants included); default: the tiny dense and hybrid ones in four formats")
    p.add_argument("--model-path", nargs="*", default=[], help="local mlx-lm model directories")
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--modes", nargs="*", default=list(MODES), choices=list(MODES))
    args = p.parse_args(argv)
    names = args.models if args.models is not None else ([] if args.model_path else DEFAULT_MODELS)
    targets = [(n, str(ensure_builtin(n, progress=False))) for n in names]
    targets += [(d, d) for d in args.model_path]
    print(f"mlx {mx.__version__}, this process's device {mx.default_device()}")
    print("| model | mode | requests | runner device | " +
          " | ".join(f"prompt {k}" for k in range(len(PROMPTS))) + " |")
    print("|---|---|---|---|" + "---|" * len(PROMPTS))
    failed = 0
    for name, path in targets:
        try:
            rows = check_model(name, path, args.modes, args.tokens)
        except Exception as e:  # one model that cannot be served does not hide the others
            print(f"| {name} | - | - | - | error: {type(e).__name__}: {e} |", flush=True)
            failed += 1
            continue
        for r in rows:
            failed += sum(v.startswith("FAIL") for v in r["results"])
            print(f"| {r['model']} | {r['mode']} | {r['how']} | {r['device']} | "
                  + " | ".join(r["results"]) + " |", flush=True)
    print(f"{failed} failure(s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
