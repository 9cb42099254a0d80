"""The paired format benchmark's pure parts, nothing served: totals and per-pair ratios from
hand-built samples, the order the formats take turns in, its table, and its argument errors."""

from __future__ import annotations

import asyncio

import pytest

import benchmarks.serving.paired as paired
from benchmarks.serving.load import Sample


def sample(tokens: int, seconds: float, at: float = 0.0) -> Sample:
    return Sample(sent=at, tokens=tokens, ended=at + seconds)


def test_totals_and_per_pair_ratios_against_the_first_format():
    runs = {"f32": [sample(100, 2.0), sample(100, 1.0), sample(100, 4.0)],
            "4bit": [sample(100, 1.0), sample(100, 0.25), sample(100, 2.0)]}
    got = paired.summarize(["f32", "4bit"], runs)
    assert got["formats"]["f32"]["output_tok_s"] == pytest.approx(300 / 7.0)
    assert got["formats"]["4bit"]["output_tok_s"] == pytest.approx(300 / 3.25)
    r = got["ratios"]["4bit"]
    assert r["of_totals"] == pytest.approx(7.0 / 3.25)
    assert r["pairs"] == pytest.approx([2.0, 4.0, 2.0])
    assert r["pair_median"] == pytest.approx(2.0)
    assert (r["pair_q1"], r["pair_q3"]) == (pytest.approx(2.0), pytest.approx(3.0))
    assert "f32" not in got["ratios"]
    table = paired.markdown({"command": "c", "date": "d", "pairs": 3, "prompt_tokens": 8,
                             "output_tokens": 100, **got})
    assert "| 4bit | 3 | 92.3 | 2.15 | 2.00 (2.00-3.00) |" in table
    assert "| f32 | 3 | 42.9 | 1.00 |  |" in table


def test_the_formats_take_turns_first_and_second_alternating(monkeypatch):
    order = []

    async def fake_one(target, prompt, max_tokens, first=lambda: None):
        order.append((target, prompt, max_tokens))
        return sample(max_tokens, 1.0)

    monkeypatch.setattr(paired, "one_lean", fake_one)
    runs = asyncio.run(paired.take_turns({"a": "A", "b": "B"}, ["p0", "p1", "p2"], 16, 1))
    assert order == [("A", "p0", 8), ("B", "p0", 8),  # warmup, one short request each
                     ("A", "p0", 16), ("B", "p0", 16), ("B", "p1", 16), ("A", "p1", 16),
                     ("A", "p2", 16), ("B", "p2", 16)]
    assert [len(v) for v in runs.values()] == [3, 3]


def test_a_failed_request_ends_the_run_naming_the_format(monkeypatch):
    async def failing(target, prompt, max_tokens, first=lambda: None):
        s = sample(0, 1.0)
        s.error = "HTTP 500" if target == "B" else ""
        return s

    monkeypatch.setattr(paired, "one_lean", failing)
    with pytest.raises(RuntimeError, match="b: HTTP 500"):
        asyncio.run(paired.take_turns({"a": "A", "b": "B"}, ["p0"], 16, 0))


@pytest.mark.parametrize("argv,message", [(["--formats", "f32"], "at least two formats"),
                                          (["--pairs", "0"], "--pairs must be at least 1")])
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        paired.parse_args(argv)
    assert message in capsys.readouterr().err
