"""Benchmark a running server with an external client nobody here wrote: GuideLLM (vLLM project).

Its numbers are a cross-check on ours (benchmarks/serving/load.py): a different client, its own
synthetic prompts, its own definitions of TTFT and ITL. It drives the server's OpenAI endpoint
only, so it works against any running server, ours or another.

Set up once, in a venv of its own (guidellm pins its own transformers and pulls in torch, which
must not touch .venv; the CUDA torch wheel from PyPI makes this venv ~6 GB):

    python3 -m venv .venv-extbench
    echo '*' > .venv-extbench/.gitignore      # keep it out of git, as newer venvs do
    .venv-extbench/bin/pip install 'guidellm==0.8.*'

Then, with a server already up
(e.g. `launch --config configs/qwen.toml --set server.http_port=8011`):

    .venv/bin/python -m benchmarks.serving.external --url http://127.0.0.1:8011 --model qwen3-tiny \
        --tokenizer .cache/models/qwen3-tiny-<hash> --out bench-out/guidellm \
        --concurrency 1 4 16 --prompt-tokens 256 --output-tokens 128 --seconds 20

--tokenizer is the local model directory: guidellm sizes its synthetic prompts with it, and
HF_HUB_OFFLINE=1 makes sure it never tries the hub. Output length is forced by guidellm itself:
it sends max_tokens with ignore_eos=true, which both our endpoints accept.
Writes guidellm.json, guidellm.csv, guidellm-console.txt, scenario.json and summary.json to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

SETUP = ("python3 -m venv {v} && echo '*' > {v}/.gitignore && "
         "{v}/bin/pip install 'guidellm==0.8.*'")


def scenario(a: argparse.Namespace, out: Path) -> dict:
    """A guidellm scenario file: one concurrent-streams benchmark per --concurrency value."""
    # Either limit may end a level; guidellm stops at whichever comes first.
    limits = [{"kind": "max_duration", "seconds": a.seconds}]
    if a.requests:
        limits.append({"kind": "max_requests", "count": a.requests})
    return {
        "spec": {
            "backend": {"kind": "openai_http", "target": a.url.rstrip("/"), "model": a.model,
                        # plain completions: a chat template would add tokens to the prompt
                        "request_format": f"/v1/{a.endpoint}"},
            "tokenizer": {"kind": "huggingface_auto", "model": str(Path(a.tokenizer).resolve())},
            "profile": {"kind": "concurrent"},
            "data": [{"kind": "synthetic_text", "prompt_tokens": a.prompt_tokens,
                      "output_tokens": a.output_tokens}],
            "constraints": limits,
            "outputs": [{"kind": "json", "path": str(out / "guidellm.json")},
                        {"kind": "csv", "path": str(out / "guidellm.csv")},
                        {"kind": "console"}],
        },
        "benchmarks": [{"profile.streams": c} for c in a.concurrency],
    }


def summarize(report: dict) -> list[dict]:
    """The headline figures per concurrency level, as guidellm computed them (successful
    requests only for latencies; throughput over the whole level, as its console shows it)."""
    rows = []
    for b in report["benchmarks"]:
        m = b["metrics"]
        ok = lambda k: m[k]["successful"]  # noqa: E731
        rows.append({
            "concurrency": b["config"]["strategy"]["streams"],
            "ok": m["request_totals"]["successful"], "errors": m["request_totals"]["errored"],
            "req_per_s": m["requests_per_second"]["successful"]["mean"],
            "out_tok_per_s": m["output_tokens_per_second"]["total"]["mean"],
            "ttft_p50_ms": ok("time_to_first_token_ms")["median"],
            "ttft_p95_ms": ok("time_to_first_token_ms")["percentiles"]["p95"],
            "itl_p50_ms": ok("inter_token_latency_ms")["median"],
            "itl_p95_ms": ok("inter_token_latency_ms")["percentiles"]["p95"],
            "out_tokens_p50": ok("output_token_count")["median"],
        })
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", required=True, help="server base URL, without /v1")
    p.add_argument("--model", required=True, help="model name the server answers to")
    p.add_argument("--tokenizer", required=True, help="local directory with tokenizer.json")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--venv", default=".venv-extbench", help="venv that holds guidellm")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--seconds", type=float, default=20.0, help="time limit per level")
    p.add_argument("--requests", type=int, default=0, help="request limit per level (0: none)")
    p.add_argument("--endpoint", choices=["completions", "chat/completions"],
                   default="completions")
    a = p.parse_args(argv)

    exe = Path(a.venv) / "bin" / "guidellm"
    if not exe.exists():
        sys.exit(f"guidellm not found at {exe}. Install it in its own venv:\n  "
                 + SETUP.format(v=a.venv))
    a.out.mkdir(parents=True, exist_ok=True)
    scen = a.out / "scenario.json"
    scen.write_text(json.dumps(scenario(a, a.out), indent=2))

    # Offline: the tokenizer is a local directory; anything else would be a silent hub fetch.
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    cmd = [str(exe), "run", "--config", str(scen), "--disable-progress"]
    with open(a.out / "guidellm-console.txt", "w") as log:
        # Stream its console through, so a long sweep shows it is alive, and keep a copy.
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
        for line in proc.stdout:
            sys.stdout.write(line)
            log.write(line)
        if proc.wait() != 0:
            sys.exit(f"guidellm failed (exit {proc.returncode}); see {log.name}")

    rows = summarize(json.loads((a.out / "guidellm.json").read_text()))
    (a.out / "summary.json").write_text(json.dumps(
        {"tool": "guidellm", "prompt_tokens": a.prompt_tokens,
         "output_tokens": a.output_tokens, "levels": rows}, indent=2))
    print(f"\nguidellm summary ({a.prompt_tokens} prompt / {a.output_tokens} output tokens)")
    print(f"{'conc':>4} {'ok':>5} {'err':>4} {'req/s':>7} {'out tok/s':>9} "
          f"{'TTFT p50/p95 ms':>16} {'ITL p50/p95 ms':>15}")
    for r in rows:
        print(f"{r['concurrency']:>4} {r['ok']:>5} {r['errors']:>4} {r['req_per_s']:>7.2f} "
              f"{r['out_tok_per_s']:>9.1f} {r['ttft_p50_ms']:>7.1f}/{r['ttft_p95_ms']:<8.1f} "
              f"{r['itl_p50_ms']:>6.1f}/{r['itl_p95_ms']:<8.1f}")
    print(f"report: {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
