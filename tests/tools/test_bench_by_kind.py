"""`python -m benchmarks` picks the benchmark by the model's kind and hands it the rest of
the command line (the benchmarks themselves are run by hand: they time things)."""

from __future__ import annotations

import pytest

from benchmarks.serving import hybrid, run
from benchmarks import __main__ as bench


@pytest.mark.parametrize("model, picked", [("qwen3_5-tiny", "hybrid"), ("qwen3-tiny", "run")])
def test_the_model_kind_picks_the_benchmark(model_cache, monkeypatch, model, picked):
    calls = []
    monkeypatch.setattr(hybrid, "main", lambda argv: calls.append(("hybrid", argv)) or 0)
    monkeypatch.setattr(run, "main", lambda argv: calls.append(("run", argv)) or 0)
    assert bench.main(["--model", model, "--repeats", "1"]) == 0
    assert calls == [(picked, ["--model", model, "--repeats", "1"])]
