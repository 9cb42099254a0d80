"""Writes the small local lm-evaluation-harness tasks in eval/tasks (README "Evaluating a
model"): 100 multiple-choice sums and 20 completions to generate, deterministic, so a run is
the same everywhere. Run from the repository root: python eval/make_tasks.py"""

import json
import random
from pathlib import Path

HERE = Path(__file__).parent / "tasks"


def main() -> None:
    rng = random.Random(1234)
    with open(HERE / "sums_mc.jsonl", "w") as f:
        for _ in range(100):
            a, b = rng.randint(2, 49), rng.randint(2, 49)
            wrong = rng.sample([a + b + d for d in (-10, -2, -1, 1, 2, 10)], 3)
            choices = [a + b, *wrong]
            rng.shuffle(choices)
            f.write(json.dumps({"question": f"What is {a} plus {b}?",
                                "choices": [str(c) for c in choices],
                                "answer": choices.index(a + b)}) + "\n")
    with open(HERE / "count_gen.jsonl", "w") as f:
        for _ in range(20):
            start = rng.randint(1, 90)
            f.write(json.dumps({"question": f"Count on from {start}: {start}, {start + 1},",
                                "answer": f" {start + 2}"}) + "\n")


if __name__ == "__main__":
    main()
