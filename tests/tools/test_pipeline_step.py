"""benchmarks/kernels/pipeline_step.py: the in-process step beside the bare loop."""

from __future__ import annotations

import pytest

from benchmarks.kernels import pipeline_step

pytestmark = pytest.mark.slow


def test_every_part_of_a_full_batch_decode_step_is_timed(model_cache, capsys):
    assert pipeline_step.main(["--model", "qwen3-tiny", "--batch", "2", "--prompt-tokens", "16",
                               "--output-tokens", "12"]) == 0
    rows = [line.strip("| ").split(" | ") for line in capsys.readouterr().out.splitlines()
            if line.startswith("| 2 |")]
    assert [r[1] for r in rows] == ["compiled", "eager"]
    for r in rows:
        bare, parts, ratio = float(r[2]), [float(x) for x in r[3:-1]], float(r[-1])
        assert bare > 0 and all(x >= 0 for x in parts), r
        schedule, launch, queue, finish, on_result, step = parts
        # each step's wall time holds each of its parts (so do their medians), and the launch
        # holds its queueing
        assert step >= max(schedule, launch, finish, on_result) and launch > 0, r
        assert launch >= queue > 0, r
        assert ratio == pytest.approx(step / bare, rel=0.02, abs=0.01), r
