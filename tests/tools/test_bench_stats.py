"""The benchmark's own arithmetic: percentiles, the steady decode rate of a wave, and prompts of
exactly the asked token length with the real Qwen tokenizer."""

from __future__ import annotations

import math

import pytest

from benchmarks.serving.load import PromptMaker, Sample, pct, steady_decode_rate, summarize
from models.builtin import ensure_builtin
from models.tokenizer import load_tokenizer


def test_percentiles_interpolate_and_skip_nan():
    assert pct([3.0, 1.0, 2.0, float("nan")], 50) == 2.0
    assert pct([0.0, 10.0], 99) == pytest.approx(9.9)
    assert math.isnan(pct([], 50))


def test_steady_rate_counts_only_while_every_stream_decodes():
    # Two streams at 10 tokens/s each; the second starts 1 s later and ends 1 s later.
    a = Sample(sent=0.0, chunks=[0.1 * i for i in range(1, 51)])  # 0.1 .. 5.0
    b = Sample(sent=1.0, chunks=[1.0 + 0.1 * i for i in range(1, 51)])  # 1.1 .. 6.0
    assert steady_decode_rate([a, b]) == pytest.approx(20.0, rel=0.03)
    assert math.isnan(steady_decode_rate([Sample(0.0, [1.0]), Sample(0.0, [2.0])]))


def test_summary_takes_the_median_wave_and_counts_errors():
    fast = [Sample(0.0, [0.05 * i for i in range(1, 41)], tokens=40) for _ in range(2)]
    slow = [Sample(0.0, [0.1 * i for i in range(1, 41)], tokens=40)]
    broken = Sample(0.0, [], error="APIConnectionError")
    row = summarize(fast + slow + [broken], wall=10.0, concurrency=1)
    assert row["errors"] == 1 and row["first_error"] == "APIConnectionError"
    assert row["output_tokens"] == 120 and row["output_tok_s"] == pytest.approx(12.0)
    assert row["decode_tok_s"] == pytest.approx(20.0, rel=0.05)  # median of 20, 20, 10


def test_prompts_have_exactly_the_asked_length(model_cache):
    path = ensure_builtin("qwen3-tiny", cache_dir=model_cache, progress=False)
    tokenizer = load_tokenizer(str(path))
    maker = PromptMaker(tokenizer)
    for n, seed in ((1, 0), (256, 1), (2000, 2)):
        text = maker.make(n, seed)
        assert len(tokenizer.encode(text)) == n
    assert maker.make(64, 5) == maker.make(64, 5) != maker.make(64, 6)


def test_targets_against_vllm_mlx_appear_only_when_it_ran():
    from benchmarks.serving.report import OURS, PEER, targets

    def server(rates: dict[int, float]) -> dict:
        return {"sweep": [{"concurrency": c, "output_tok_s": v} for c, v in rates.items()],
                "prefix": {"ratio": 0.05}}

    results = {"servers": {OURS: server({1: 30.0, 16: 150.0})},
               "bare": {"results": [{"batch": 1, "decode_tok_s": 30.0},
                                    {"batch": 16, "decode_tok_s": 150.0}]}}
    results["servers"][OURS]["sweep"][0]["decode_tok_s"] = 30.0
    results["servers"][OURS]["sweep"][1]["decode_tok_s"] = 150.0
    assert not any("vllm-mlx" in name for name, _, _ in targets(results))
    results["servers"][PEER] = server({1: 25.0, 16: 100.0})
    rows = {name: (value, met) for name, value, met in targets(results) if "vllm-mlx" in name}
    assert rows == {"throughput >= 1.1 x vllm-mlx at concurrency 1": ("1.20 x", True),
                    "throughput >= 2.0 x vllm-mlx at concurrency 16": ("1.50 x", False)}
