"""Only the runner holds MLX and the model: the launcher, tokenizer, scheduler and detokenizer
stay small while they serve (the tokenizer renders chat templates with jinja2, never
transformers), so a 16 GB machine keeps its memory for the model."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from openai import OpenAI

from models.builtin import ensure_builtin

LEAN = ("tokenizer", "scheduler", "detokenizer")
HEAVY = ("mlx", "mlx_lm", "transformers", "torch", "numpy")


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_only_the_runner_maps_mlx_and_the_rest_fit_half_a_gigabyte(graph):
    client = OpenAI(base_url=f"{graph.http}/v1", api_key="none")
    chat = client.chat.completions.create(
        model="qwen3-tiny", messages=[{"role": "user", "content": "Hello there"}],
        max_tokens=8, temperature=0)
    assert chat.choices[0].message.content
    text = client.completions.create(model="qwen3-tiny", prompt="Once upon a time",
                                     max_tokens=8, temperature=0)
    assert text.choices[0].text
    pids = graph.actor_pids()
    for name in LEAN:
        maps = Path(f"/proc/{pids[name]}/maps").read_text()
        assert "libmlx" not in maps, f"the {name} process loaded MLX"
    assert "libmlx" in Path(f"/proc/{pids['runner']}/maps").read_text()
    sizes = {name: _rss_mib(pids[name]) for name in LEAN}
    sizes["launcher"] = _rss_mib(graph.proc.pid)
    assert sum(sizes.values()) <= 512, sizes


PROBE = """
import sys
from models.tokenizer import load_decoder, load_tokenizer
tok = load_tokenizer(sys.argv[1])
ids = tok.apply_chat_template([{"role": "user", "content": "hi"}])
assert tok.decode(ids) and load_decoder(sys.argv[1])(ids) == tok.decode(ids)
import actors.tokenizer.actor, actors.scheduler.actor, actors.detokenizer.actor, launch.cli
heavy = sorted({m.split(".")[0] for m in sys.modules} & set(sys.argv[2:]))
print(",".join(heavy))
"""


@pytest.mark.parametrize("builtin", ["qwen3-tiny", "qwen3_5-tiny"])
def test_the_lean_actors_import_no_mlx_transformers_or_numpy(model_cache, builtin):
    path = ensure_builtin(builtin, cache_dir=model_cache, progress=False)
    got = subprocess.run([sys.executable, "-c", PROBE, str(path), *HEAVY], capture_output=True,
                         text=True, timeout=120)
    assert got.returncode == 0, got.stderr[-2000:]
    assert got.stdout.strip() == "", f"imported: {got.stdout.strip()}"
