"""The family test matrix: a tiny random model of each architecture family (models/builtin.py
FAMILIES, from mlx-lm's own classes) through the runner core and the real scheduler core in
every oracle mode: a request alone, batched, staggered with chunked prefill, overlapped
(depth 2), prefix cache off and on (hits and misses), retraction under a tiny KV budget. Every
request's tokens must be mlx_lm.generate's greedy ones (harness/oracle.py)."""

import json
from pathlib import Path

import mlx.core as mx
import pytest

from actors.model_runner.cpu import weights
from actors.model_runner.loading import load_model
from actors.model_runner.runner import ModelRunner
from models.builtin import FAMILIES, ensure_builtin
from models.info import layer_kinds, read_model_info
from protocol.config import RuntimeConfig
from harness.oracle import Oracle
from tests.support.drive import check_all, run

pytestmark = pytest.mark.slow

# The layer kinds the runner classifies each family's mlx-lm caches as (layers.classify).
KINDS = {
    "llama-tiny": ["full"] * 2,
    "qwen2-tiny": ["full"] * 2,
    "qwen3_moe-tiny": ["full"] * 2,
    "phi3-tiny": ["full"] * 2,
    "gpt_oss-tiny": ["sliding", "full"] * 2,
    "ministral3-tiny": ["full"] * 2,
    "deepseek_v3-tiny": ["full"] * 2,
    "deepseek_v32-tiny": ["other:CacheList"] * 2,
}
assert sorted(KINDS) == sorted(FAMILIES)

PROMPTS = ["Hello world", "中文的自然语言处理", "def f(x):\n    return", "🎉🚀 emoji",
           "The quick brown fox jumps over the lazy dog. " * 6]

# Each family with the default runtime (the compiled kernels where built), and the latent-
# attention family also with MLX's own kernels only. DeepSeek's latent attention stores the kv
# latent as "keys" and the RoPE key as "values" and attends over the latent with an additive
# mask of its own: the decode-attention kernel must stand aside there (cpu/attention.py); it
# once took it, and these tests found that (wrong tokens from the second one on).
VARIANTS = {**{name: (name, RuntimeConfig()) for name in sorted(FAMILIES)},
            "deepseek_v3-tiny-no-kernels": ("deepseek_v3-tiny", RuntimeConfig(weights="mlx"))}


# Plain full-attention families beside llama (the same paths through the runner) are the
# extended matrix; `make test` keeps one of each cache layout and the MoE, MLA and sliding ones.
EXTENDED = {"qwen2-tiny", "phi3-tiny", "ministral3-tiny"}


@pytest.fixture(scope="module", params=[
    pytest.param(n, marks=pytest.mark.matrix) if n in EXTENDED else n for n in sorted(VARIANTS)])
def family(request, model_cache):
    """(built-in name, path, oracle, info, runtime)."""
    name, runtime = VARIANTS[request.param]
    path = str(ensure_builtin(name, cache_dir=model_cache, progress=False))
    return name, path, Oracle(path), read_model_info(path), runtime


def test_layer_kinds_agree_with_the_config(family):
    """The runner's kinds (from the caches mlx-lm builds) are the ones pinned above, and
    config.json says the same layers are sliding (models/info.py: the actor refuses to start
    where they differ)."""
    name, path, _, info, _ = family
    runner = ModelRunner(load_model(path), 2)
    assert runner.layers.kinds == KINDS[name]
    assert info.model_type == FAMILIES[name].config["model_type"]
    assert info.state_layers == len(runner.layers.stateful)
    config = json.loads((Path(path) / "config.json").read_text())
    # config.json tells windows and recurrent layers, not cache types: an "other" cache
    # (a CacheList of KV caches) grows with the context as a full layer does.
    told = ["full" if kind.startswith("other") else kind for kind in KINDS[name]]
    assert layer_kinds(lambda key, default=None: config.get(key, default)) == told


def _staggered(oracle):
    ids = [oracle.tokenizer.encode(p) for p in PROMPTS]
    # One request alone for three steps, then a long prompt (~60 tokens: four chunks of 16,
    # past gpt-oss's 32-token window) prefilled beside running decodes, rows reused.
    return {0: [("alone", ids[0], 8)], 3: [("long", ids[4], 8), ("b", ids[1], 4)],
            4: [("c", ids[2], 6)], 7: [("d", ids[3], 5)]}


@pytest.mark.parametrize("depth", [1, 2], ids=["plain", "overlap"])
def test_staggered_chunked_batch_matches_mlx_lm(family, depth):
    _, path, oracle, info, runtime = family
    arrivals = _staggered(oracle)
    got, _ = run(path, info, arrivals, depth=depth, chunk=16, runtime=runtime)
    check_all(oracle, arrivals, got)


@pytest.mark.parametrize("prefix", [False, True], ids=["prefix-off", "prefix-on"])
def test_repeated_prompts_match_mlx_lm(family, prefix):
    """The same prompt again, and a shared system prompt with different endings: with the
    prefix cache on, the repeats hit (the first of each misses); off, all run from scratch."""
    name, path, oracle, info, runtime = family
    enc = oracle.tokenizer.encode
    same = enc("The quick brown fox " * 5)
    system = enc("You are a helpful assistant. " * 7)  # 42 tokens: past gpt-oss's window
    arrivals = {0: [("same1", same, 6), ("sys-a", system + enc(" Q: 1+1?"), 5)],
                10: [("same2", same, 6), ("sys-b", system + enc(" Q: why?"), 5)]}
    got, sched = run(path, info, arrivals, depth=2, prefix=prefix, chunk=16, runtime=runtime)
    check_all(oracle, arrivals, got)
    cached = {rid: f.cached_tokens for rid, f in sched.finished.items()}
    if not prefix or any(kind.startswith("other") for kind in KINDS[name]):
        # Layers the pools cannot restore (DeepSeek-V3.2's CacheList): the scheduler turns
        # the tree off (prefix_plan) and every request runs from scratch.
        assert set(cached.values()) == {0}
        return
    assert cached["same1"] == 0 and cached["sys-a"] == 0  # misses
    assert cached["same2"] > 0 and cached["sys-b"] >= 32  # hits
    assert sched.memory.hits >= 2


@pytest.mark.parametrize("depth", [1, 2], ids=["plain", "overlap"])
def test_retraction_under_a_tiny_kv_budget_keeps_tokens_identical(family, depth):
    _, path, oracle, info, runtime = family
    ids = [oracle.tokenizer.encode(p * 8)[:16] for p in PROMPTS]
    # Three requests of 16 + 20 tokens in 72 slots and no output reserve: all are admitted,
    # run out of slots while decoding, and the least advanced are retracted and recomputed.
    arrivals = {0: [("a", ids[0], 20), ("b", ids[1], 20), ("c", ids[2], 20)],
                4: [("d", ids[3], 20)]}
    got, sched = run(path, info, arrivals, depth=depth, kv_slots=72, reserve=0,
                     runtime=runtime)
    assert sched.retractions > 0, "the budget was meant to force retraction"
    check_all(oracle, arrivals, got)
