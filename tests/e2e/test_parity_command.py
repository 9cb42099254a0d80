"""`python -m harness.parity`: the served-vs-mlx-lm check as a command (for a GPU, where CI does
not run), on the tiny built-in."""

from __future__ import annotations

import pytest

from harness import parity
from models.builtin import ensure_builtin
from harness.oracle import Oracle

pytestmark = pytest.mark.slow


def test_the_command_passes_a_served_model_and_names_the_runners_device(model_cache, capsys):
    assert parity.main(["--models", "qwen3-tiny", "--modes", "batched", "--tokens", "6"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| qwen3-tiny |")]
    assert [r.split(" | ")[2] for r in rows] == ["batched", "alone"]
    for row in rows:
        cells = row.strip("| ").split(" | ")
        assert cells[3] == "cpu" and cells[4:] == ["equal"] * len(parity.PROMPTS), row
    assert "0 failure(s)" in out


def test_a_token_other_than_mlx_lms_fails(model_cache):
    oracle = Oracle(str(ensure_builtin("qwen3-tiny", cache_dir=model_cache, progress=False)))
    ids = oracle.tokenizer.encode(parity.PROMPTS[0])
    ref = oracle.greedy(ids, 4)
    assert parity.verdict(oracle, ids, ref, ref) == "equal"
    wrong = ref[:2] + [(ref[2] + 1) % 1000] + ref[3:]
    assert parity.verdict(oracle, ids, wrong, ref).startswith("FAIL: token 2 differs")
    assert parity.verdict(oracle, ids, ref[:3], ref).startswith("FAIL: length differs")
