"""Many clients at once: this server with its default config against the bare mlx-lm forward
doing the same work, and mlx_lm.server, from 1 to 256 concurrent streams; per actor, the CPU
time per output token and the memory.

    python -m benchmarks.serving.crowd [--model qwen3-small | --model-path DIR]
        [--concurrency 1 16 64 128 256] [--prompt-tokens 128] [--output-tokens 128]
        [--mlx-lm-max 128] [--json docs/bench/crowd.json] [--markdown BENCHMARKS.md]

At each level `c`, c clients each send one streamed /v1/completions request of
prompt_tokens words and exactly output_tokens tokens (one wave, all sent at once). The bare
forward (benchmarks/kernels/forward.py) does the same work at batch c: the c prompts
prefilled together, then the decode steps, tokens read back every step; its rate is
c * output_tokens over both. The actors' CPU time is /proc's utime + stime over the level,
divided by the output tokens; RSS is read at the end of each level.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks.serving.load import PromptMaker, Target, closed_loop, summarize
from benchmarks.serving.run import add_model_args, machine, resolve_model
from benchmarks.serving.servers import mlx_lm_server, ours
from harness.graph import ROOT
from harness.procs import children, title

ACTORS = ("launch", "tokenizer", "scheduler", "runner", "detokenizer")
TICK = 100  # clock ticks per second of /proc/<pid>/stat (Linux's USER_HZ)


def actor_pids(launcher: int) -> dict[str, int]:
    """The graph's processes by their titles (mas-launch, mas-tokenizer, ...)."""
    pids = {"launch": launcher}
    for pid in children(launcher):
        try:
            name = title(pid)
        except OSError:
            continue  # gone while we looked
        if name.startswith("mas-"):
            pids[name[4:]] = pid
    return pids


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return float("nan")


def bare(model_dir: str, args: argparse.Namespace) -> dict[int, dict[str, Any]]:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        subprocess.run([sys.executable, "-m", "benchmarks.kernels.forward", "--model-path",
                        model_dir, "--batch-sizes", *map(str, args.concurrency),
                        "--prompt-tokens", str(args.prompt_tokens), "--output-tokens",
                        str(args.output_tokens), "--blas", args.blas, "--json", f.name],
                       check=True, cwd=ROOT)
        rows = json.loads(Path(f.name).read_text())["results"]
    out = {}
    for r in rows:
        wall = r["prefill_s"] + r["decode_s"]
        out[r["batch"]] = {**r, "output_tok_s": round(r["batch"] * args.output_tokens / wall, 1)}
    return out


async def sweep(target: Target, prompts: dict[int, list[str]], args: argparse.Namespace,
                pids: dict[str, int] | None = None) -> list[dict[str, Any]]:
    out = []
    await closed_loop(target, prompts[min(prompts)][:1], 1, 8)  # warm-up
    for c, batch in prompts.items():
        if c > args.max_level.get(target.name, c):
            continue
        before = {a: cpu_s(p) for a, p in (pids or {}).items()}
        samples, wall = await closed_loop(target, batch, c, args.output_tokens)
        row = summarize(samples, wall, c)
        if pids:
            tokens = max(1, row["output_tokens"])
            row["cpu_us_per_token"] = {a: round(1e6 * (cpu_s(p) - before[a]) / tokens, 1)
                                       for a, p in pids.items()}
            row["rss_mib"] = {a: rss_mib(p) for a, p in pids.items()}
        print(f"{target.name} c={c}: {row['output_tok_s']:.0f} tok/s, TTFT p50 "
              f"{row['ttft_p50_s']:.2f} s, errors {row['errors']}", file=sys.stderr)
        out.append(row)
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serving.crowd",
                                description=__doc__.split("\n\n")[0])
    add_model_args(p)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64, 128, 256])
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--mlx-lm-max", type=int, default=128,
                   help="the highest level mlx_lm.server is driven at (0: not at all)")
    p.add_argument("--json", default="", help="write the results here")
    p.add_argument("--markdown", default="", help="update this file's crowd section")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.max_level = {"mlx_lm.server": args.mlx_lm_max}
    model_dir = resolve_model(args)
    from models.info import read_model_info
    from models.tokenizer import load_tokenizer

    maker = PromptMaker(load_tokenizer(model_dir))
    prompts = {c: [maker.make(args.prompt_tokens, seed=1000 * c + k) for k in range(c)]
               for c in args.concurrency}
    from actors.model_runner.cpu import blas

    report: dict[str, Any] = {"machine": machine(), "model": Path(model_dir).name,
                              "blas": blas.find(args.blas) or "bundled",
                              "when": time.strftime("%Y-%m-%d %H:%M"), "args": sys.argv[1:],
                              "prompt_tokens": args.prompt_tokens,
                              "output_tokens": args.output_tokens}
    report["bare"] = bare(model_dir, args)
    with ours(model_dir, args.blas, args.set) as target:
        pids = actor_pids(target.pid)
        info = target.base_url.removesuffix("/v1") + "/server_info"
        with urllib.request.urlopen(info, timeout=30) as f:
            got = json.loads(f.read())
        report["max_running_requests"] = got["max_running_requests"]
        report["max_running_requests_why"] = got.get("max_running_requests_why", "")
        report["ours"] = asyncio.run(sweep(target, prompts, args, pids))
    if args.mlx_lm_max:
        eos = read_model_info(model_dir).eos_ids
        with mlx_lm_server(model_dir, args.blas, eos) as target:
            report["mlx_lm"] = asyncio.run(sweep(target, prompts, args))
    text = json.dumps(report, indent=2, default=str)
    if args.json:
        Path(args.json).write_text(text + "\n")
    if args.markdown:
        write_markdown(Path(args.markdown), report)
    print(text if not args.json else f"wrote {args.json}")
    return 0


LEAN = ("launch", "tokenizer", "scheduler", "detokenizer")


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a and b else "n/a"


def render(report: dict[str, Any]) -> str:
    """The section of BENCHMARKS.md: rates against the bare forward and mlx_lm.server, and
    what each actor costs."""
    bare_rows = {int(k): v for k, v in report["bare"].items()}
    theirs = {r["concurrency"]: r for r in report.get("mlx_lm", [])}
    m = report["machine"]
    blas = f", BLAS `{Path(str(report['blas'])).name}`" if report.get("blas") else ""
    lines = [f"Measured by `python -m benchmarks.serving.crowd {' '.join(report['args'])}` on "
             f"{m['cpu']}, {m['cores']} cores, Python {m['python']}{blas}. Model "
             f"`{report['model']}`, default config: max_running_requests = "
             f"{report['max_running_requests']} ({report['max_running_requests_why']}). "
             f"Prompts of {report['prompt_tokens']} tokens, exactly {report['output_tokens']} "
             "output tokens, one wave of `c` streamed requests per level; the bare forward "
             "prefills the same number of prompts as one batch, then decodes.", "",
             "| c | ours tok/s | bare tok/s | ours / bare | mlx_lm.server tok/s | ours / "
             "mlx_lm.server | TTFT p50 s | ITL p50 ms | errors (ours, mlx_lm) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in report["ours"]:
        c, bare_rate = r["concurrency"], bare_rows.get(r["concurrency"], {}).get("output_tok_s")
        other = theirs.get(c, {})
        lines.append(f"| {c} | {r['output_tok_s']:.0f} | {bare_rate or 'n/a'} | "
                     f"{_ratio(r['output_tok_s'], bare_rate)} | "
                     f"{other.get('output_tok_s', float('nan')):.0f} | "
                     f"{_ratio(r['output_tok_s'], other.get('output_tok_s'))} | "
                     f"{r['ttft_p50_s']:.2f} | {1000 * r['itl_p50_s']:.1f} | "
                     f"{r['errors']}, {other.get('errors', 'n/a')} |")
    lines += ["", "CPU time per output token (us) and RSS (MiB) at the end of each level, per "
              "process; \"lean\" is the launcher, tokenizer, scheduler and detokenizer together.",
              "", "| c | " + " | ".join(f"{a} us" for a in (*LEAN, "lean", "runner")) + " | "
              + " | ".join(f"{a} MiB" for a in (*LEAN, "lean", "runner")) + " |",
              "|---" * (2 * len(LEAN) + 5) + "|"]
    for r in report["ours"]:
        cpu, rss = r["cpu_us_per_token"], r["rss_mib"]
        cells = [f"{cpu.get(a, 0):.0f}" for a in LEAN] + [
            f"{sum(cpu.get(a, 0) for a in LEAN):.0f}", f"{cpu.get('runner', 0):.0f}"]
        cells += [f"{rss.get(a, 0):.0f}" for a in LEAN] + [
            f"{sum(rss.get(a, 0) for a in LEAN):.0f}", f"{rss.get('runner', 0):.0f}"]
        lines.append(f"| {r['concurrency']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_markdown(path: Path, report: dict[str, Any]) -> None:
    """Replace the section for this model between its markers (added at the end if new). The
    section names the command and the machine; the run's timestamp stays in the JSON."""
    begin, end = (f"<!-- crowd {report['model']}:{edge} -->" for edge in ("begin", "end"))
    section = f"{begin}\n{render(report)}{end}"
    text = path.read_text() if path.is_file() else ""
    if begin in text and end in text:
        text = text[:text.index(begin)] + section + text[text.index(end) + len(end):]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    path.write_text(text)


if __name__ == "__main__":
    sys.exit(main())
