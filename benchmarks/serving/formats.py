"""Served throughput of one model stored in several formats (float32, 8-bit, 4-bit, bf16): this
server against mlx_lm.server on each checkpoint, beside each format's memory-bandwidth ceiling
and the resident memory of our model runner, all measured in one run (machines are noisy: only
ratios from one run are compared).

    python -m benchmarks.serving.formats [--model qwen3-small] [--formats f32 8bit 4bit bf16]
        [--model-path DIR [DIR ...]] [--concurrency 1 16] [--prompt-tokens 128]
        [--output-tokens 64] [--waves 1] [--min-requests 2] [--skip-mlx-lm]
        [--mlx-lm-formats 4bit ...] [--client openai|lean]
        [--json docs/bench/formats.json] [--markdown BENCHMARKS.md]

Each checkpoint in turn: our graph, then mlx_lm.server, each alone on the machine, driven
through the OpenAI streaming endpoint as benchmarks/serving/run.py's sweep is (closed loop,
--waves waves of `c` requests per level, exactly --output-tokens out). While our graph still
serves, its model runner's RSS is read from /proc. Roofline: a decode step at batch 1 reads
every weight once (tied embeddings once, as the LM head; the embedding lookup is one row), so
bandwidth / weight bytes bounds tok/s at c = 1, with the bandwidth of a numpy sum over 1 GiB
measured at the start. Writes JSON (with the run's timestamp), and the block between the
formats markers of BENCHMARKS.md, headed by the command and the machine (the main benchmark
keeps that block when it rewrites the file).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from benchmarks.serving.load import PromptMaker, Target, closed_loop, summarize
from benchmarks.serving.report import (OURS, THEIRS, _f, _ms, _rel, machine_text,
                                       put_formats_block)
from benchmarks.serving.run import machine
from benchmarks.serving.servers import mlx_lm_server, ours
from harness.graph import ROOT

NAN = float("nan")
MIB = 2**20
F32 = "f32"
_FLOATS = {"F32": "f32", "BF16": "bf16", "F16": "f16"}  # safetensors dtype -> format name
# The format targets: (format, ratio, concurrency: lowest / highest measured, ">=" or "<=", bound).
TARGETS = [
    ("4bit", "vs_f32", "lo", ">=", 2.5), ("4bit", "vs_f32", "hi", ">=", 1.3),
    ("4bit", "vs_mlx_lm", "lo", ">=", 5.0), ("4bit", "vs_mlx_lm", "hi", ">=", 5.0),
    ("4bit", "rss_vs_f32", None, "<=", 0.7),
    ("8bit", "vs_f32", "lo", ">=", 1.5),
    ("bf16", "vs_f32", "lo", ">=", 1.0), ("bf16", "vs_f32", "hi", ">=", 1.0),
    ("f32", "vs_mlx_lm", "hi", ">=", 2.0), ("f32", "vs_mlx_lm", "lo", ">=", 1.1),
]  # fmt: skip
_CLIENTS = {"openai": "official `openai` client",
            "lean": "lean client (`benchmarks/serving/lean_client.py`)"}
_TARGET_TEXT = {"vs_f32": "c={c} output tok/s {op} {need}x float32's",
                "vs_mlx_lm": "c={c} output tok/s {op} {need}x mlx_lm.server's (same checkpoint)",
                "rss_vs_f32": "runner RSS {op} {need}x float32's"}


# ---- the checkpoints: bytes and format, from the files alone ----

def read_weights(model_dir: str | Path) -> dict[str, Any]:
    """Bytes of a checkpoint's arrays, from its safetensors headers (nothing is loaded): all of
    them, those a decode step reads per token, and the float type holding most of them."""
    tensors: dict[str, dict] = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        with open(file, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        header.pop("__metadata__", None)
        tensors.update(header)
    nbytes = {k: t["data_offsets"][1] - t["data_offsets"][0] for k, t in tensors.items()}
    # With an LM head of its own, the embedding table is only looked up (one row per token).
    untied = any("lm_head" in k for k in nbytes)
    floats = Counter()
    for k, t in tensors.items():
        floats[_FLOATS.get(t["dtype"], "")] += nbytes[k]
    floats.pop("", None)
    return {"stored_bytes": sum(nbytes.values()),
            "read_bytes_per_token": sum(n for k, n in nbytes.items()
                                        if not (untied and "embed_tokens" in k)),
            "float": floats.most_common(1)[0][0] if floats else "?"}


def format_of(model_dir: str | Path, weights: dict[str, Any]) -> str:
    """"4bit", "8bit", "bf16", "f32", ...; "4bit-bf16" for bf16 scales and norms."""
    quant = json.loads((Path(model_dir) / "config.json").read_text()).get("quantization")
    if not quant:
        return weights["float"]
    return f"{quant['bits']}bit" + ("" if weights["float"] == F32 else f"-{weights['float']}")


def checkpoints(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(name, directory) of each checkpoint: the built-in's variants, or the given ones."""
    if args.model_path:
        return [(Path(p).expanduser().resolve().name, str(Path(p).expanduser()))
                for p in args.model_path]
    from models.builtin import ensure_builtin

    names = [args.model if f == F32 else f"{args.model}-{f}" for f in args.formats]
    return [(n, str(ensure_builtin(n, progress=True))) for n in names]


# ---- the machine: memory bandwidth and the runner's memory ----

def bandwidth(gib: float = 1.0, repeats: int = 3) -> float:
    """Bytes/s one numpy sum streams from memory, best of `repeats` over `gib` GiB of float32
    (far beyond the caches): the same kind of streaming read as a decode step's weights."""
    data = np.ones(int(gib * 2**30) // 4, np.float32)
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.nbytes / best


def _descendants(pid: int) -> list[int]:
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])  # after (comm)
        except (ValueError, OSError, IndexError):  # not a process, or one that just ended
            continue
    found, todo = [], [pid]
    while todo:
        here = todo.pop()
        kids = [p for p, parent in parents.items() if parent == here]
        found += kids
        todo += kids
    return found


def _status_mib(pid: int, field: str) -> float:
    try:
        line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines()
                    if x.startswith(field + ":"))
    except (OSError, StopIteration):
        return NAN
    return int(line.split()[1]) / 1024  # kB


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").glob("*"):
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    return inodes


def runner_memory() -> dict[str, Any]:
    """RSS of the model runner of the graph this process started (the only one of ours running
    then). Every actor is a multiprocessing spawn child with the same command line: the runner
    is the one holding its ipc inbox, a unix socket whose path ends in /runner."""
    if not Path("/proc/net/unix").exists():
        return {"pid": 0, "found_by": "no /proc: not measured", "rss_mib": NAN, "hwm_mib": NAN}
    pids = _descendants(os.getpid())
    rows = [line.split() for line in Path("/proc/net/unix").read_text().splitlines()[1:]]
    inbox = {r[6] for r in rows if len(r) > 7 and r[7].endswith("/runner")}
    runner = [p for p in pids if _socket_inodes(p) & inbox]
    how = "the process holding the runner's ipc inbox"
    if not runner:
        sizes = {p: _status_mib(p, "VmRSS") for p in pids}
        runner = [max((p for p in pids if sizes[p] == sizes[p]), key=sizes.get, default=0)]
        how = "NOT identified: the graph's largest child"
    pid = runner[0]
    return {"pid": pid, "found_by": how, "rss_mib": _status_mib(pid, "VmRSS"),
            "hwm_mib": _status_mib(pid, "VmHWM")}


# ---- serving ----

def make_prompts(model_dir: str, args: argparse.Namespace) -> dict[int, list[str]]:
    """Prompts per concurrency level, the same for every server and format (key 0: warmup)."""
    from models.tokenizer import load_tokenizer

    maker = PromptMaker(load_tokenizer(model_dir))
    p = args.prompt_tokens
    levels = {c: [maker.make(p, seed=1000 * c + k)
                  for k in range(max(args.min_requests, args.waves * c))]
              for c in args.concurrency}
    return {0: [maker.make(p, seed=1)], **levels}


async def sweep(target: Target, prompts: dict[int, list[str]], output_tokens: int,
                bar: tqdm, label: str, client: str) -> dict[str, Any]:
    done = lambda: bar.update(1)  # noqa: E731
    await closed_loop(target, prompts[0], 1, 8, done, client_kind=client)
    levels = []
    for c in (c for c in prompts if c):
        bar.set_postfix_str(f"{label}, {target.name}, c={c}")
        samples, wall = await closed_loop(target, prompts[c], c, output_tokens, done,
                                          client_kind=client)
        levels.append(summarize(samples, wall, c))
    return {"sweep": levels}


def wants_mlx_lm(args: argparse.Namespace, entry: dict[str, Any]) -> bool:
    chosen = set(args.mlx_lm_formats)
    return not args.skip_mlx_lm and (not chosen or bool({entry["name"], entry["format"]} & chosen))


def serve(entry: dict[str, Any], args: argparse.Namespace, prompts: dict[int, list[str]],
          bar: tqdm) -> dict[str, Any]:
    """One round on the checkpoint: our graph (and its runner's memory after the sweep), then
    mlx_lm.server when asked; each alone on the machine."""
    path, label = entry["path"], entry["name"]
    got: dict[str, Any] = {"servers": {}}
    bar.set_postfix_str(f"{label}, starting {OURS}")
    with ours(path, args.blas, args.set) as target:
        got["servers"][OURS] = asyncio.run(sweep(target, prompts, args.output_tokens, bar,
                                                 label, args.client))
        got["runner"] = runner_memory()
    if wants_mlx_lm(args, entry):
        from models.info import read_model_info

        bar.set_postfix_str(f"{label}, starting {THEIRS}")
        with mlx_lm_server(path, args.blas, read_model_info(path).eos_ids) as target:
            got["servers"][THEIRS] = asyncio.run(sweep(target, prompts, args.output_tokens,
                                                       bar, label, args.client))
    return got


def median_rounds(entry: dict[str, Any]) -> None:
    """The entry's figures from its rounds (entry["rounds"]): per server and level the level
    of the round with the median output tok/s (the lower one of an even count), each keeping
    every round's output tok/s; the runner's memory of the last round. The rounds alternate
    the formats, so a ratio of medians compares formats under the same spread of load."""
    rounds = entry["rounds"]
    entry["runner"] = rounds[-1]["runner"]
    for server in rounds[0]["servers"]:
        levels = []
        for i, level in enumerate(rounds[0]["servers"][server]["sweep"]):
            runs = sorted((r["servers"][server]["sweep"][i] for r in rounds),
                          key=lambda row: row["output_tok_s"])
            levels.append({**runs[(len(runs) - 1) // 2],
                           "rounds_output_tok_s": [r["servers"][server]["sweep"][i]
                                                   ["output_tok_s"] for r in rounds]})
        entry["servers"][server] = {"sweep": levels}


# ---- ratios and targets (pure: results in, numbers out) ----

def _tok_s(entry: dict[str, Any] | None, server: str, c: int) -> float:
    rows = (entry or {}).get("servers", {}).get(server, {}).get("sweep", [])
    return next((r["output_tok_s"] for r in rows if r["concurrency"] == c), NAN)


def _div(a: float, b: float) -> float:
    return a / b if b == b and b else NAN


def ratios(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Per format: ours / float32 ours and ours / mlx_lm.server (output tok/s) at each level,
    runner RSS / float32's, and c=1 output tok/s as a share of its roofline ceiling."""
    levels = results["concurrency"]
    base = next((e for e in results["formats"] if e["format"] == F32), None)
    rss = lambda e: e["runner"]["rss_mib"] if e else NAN  # noqa: E731
    rows = []
    for e in results["formats"]:
        ours_ = {c: _tok_s(e, OURS, c) for c in levels}
        rows.append({
            "name": e["name"], "format": e["format"],
            "vs_f32": {c: _div(ours_[c], _tok_s(base, OURS, c)) for c in levels},
            "vs_mlx_lm": {c: _div(ours_[c], _tok_s(e, THEIRS, c)) for c in levels},
            "rss_vs_f32": _div(rss(e), rss(base)),
            "of_ceiling": _div(_tok_s(e, OURS, 1), e["ceiling_tok_s"])})
    return rows


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The format targets for the formats measured, each with its measured ratio and whether it
    was met; a target whose ratio was not measured in this run is left out."""
    lo, hi = min(results["concurrency"]), max(results["concurrency"])
    out = []
    for r in ratios(results):
        for fmt, metric, end, op, need in TARGETS:
            c = lo if end == "lo" else hi
            value = r[metric] if end is None else r[metric][c]
            if fmt != r["format"] or value != value:
                continue
            out.append({"name": r["name"], "format": fmt, "measured": value,
                        "target": _TARGET_TEXT[metric].format(c=c, op=op, need=need),
                        "met": value >= need if op == ">=" else value <= need})
    return out


# ---- the report ----

def markdown(results: dict[str, Any], json_path: Path, md_path: Path) -> str:
    m, lo, hi = results["machine"], min(results["concurrency"]), max(results["concurrency"])
    lines = [
        "## Stored formats", "",
        f"Measured by `{results['command']}` on {machine_text(m)}. Model `{results['model']}`, "
        f"BLAS `{os.path.basename(str(results['blas']))}` for both servers. Prompts of "
        f"{results['prompt_tokens']} tokens, exactly {results['output_tokens']} output tokens, "
        f"greedy, {results['waves']} wave(s) of `c` requests per level (at least "
        f"{results.get('min_requests', 2)} requests), streamed by the "
        f"{_CLIENTS[results.get('client', 'openai')]}. Memory bandwidth "
        f"{results['bandwidth_bytes_s'] / 1e9:.1f} GB/s (numpy sum over 1 GiB, best of 3); the "
        "c=1 ceiling is that over the weight bytes a decode step reads (tied embeddings once). "
        f"Runner RSS after the sweep. Raw numbers: `{_rel(json_path, md_path)}`."
        + _rounds_note(results), "",
        f"| format | weights MiB | c=1 ceiling tok/s | server | c={lo} out tok/s | c={hi} out "
        f"tok/s | c={hi} TTFT p50 | runner RSS MiB |", "|---|---|---|---|---|---|---|---|"]
    for e in results["formats"]:
        for server in e["servers"]:
            first = server == OURS
            lines.append(
                f"| {e['format']} (`{e['name']}`) | "
                f"{_f(e['weights']['stored_bytes'] / MIB) if first else ''} | "
                f"{_f(e['ceiling_tok_s']) if first else ''} | {server} | "
                f"{_f(_tok_s(e, server, lo))} | {_f(_tok_s(e, server, hi))} | "
                f"{_ms(_row(e, server, hi).get('ttft_p50_s', NAN))} | "
                f"{_rss(e['runner']) if first else ''} |")
    lines += ["", f"| format | ours / float32 c={lo} | ours / float32 c={hi} | ours / "
              f"mlx_lm.server c={lo} | ours / mlx_lm.server c={hi} | runner RSS / float32 | "
              "c=1 / ceiling |", "|---|---|---|---|---|---|---|"]
    for r in results["ratios"]:
        lines.append(f"| {r['format']} | {_f(r['vs_f32'][lo], 2)} | {_f(r['vs_f32'][hi], 2)} | "
                     f"{_f(r['vs_mlx_lm'][lo], 2)} | {_f(r['vs_mlx_lm'][hi], 2)} | "
                     f"{_f(r['rss_vs_f32'], 2)} | {_f(r['of_ceiling'], 2)} |")
    lines += ["", "| format | target | measured | met |", "|---|---|---|---|"]
    lines += [f"| {t['format']} | {t['target']} | {_f(t['measured'], 2)} x | "
              f"{'yes' if t['met'] else 'NO'} |" for t in results["targets"]]
    lines += ["", "| format | server | c | output tok/s | steady decode tok/s | TTFT p50 | "
              "ITL p50 | errors |", "|---|---|---|---|---|---|---|---|"]
    for e in results["formats"]:
        for server, data in e["servers"].items():
            lines += [f"| {e['format']} | {server} | {r['concurrency']} | {_f(r['output_tok_s'])} "
                      f"| {_f(r['decode_tok_s'])} | {_ms(r['ttft_p50_s'])} | "
                      f"{_ms(r['itl_p50_s'])} | {r['errors']} |" for r in data["sweep"]]
    return "\n".join(lines) + "\n"


def _rounds_note(results: dict[str, Any]) -> str:
    n = results.get("rounds", 1)
    if n < 2:
        return ""
    lo = min(results["concurrency"])
    each = "; ".join(
        f"{e['format']} " + " / ".join(_f(v) for v in _row(e, OURS, lo)["rounds_output_tok_s"])
        for e in results["formats"])
    return (f" Every figure is the median of {n} rounds, each round serving every format in "
            f"turn (c={lo} output tok/s of ours per round: {each}).")


def _rss(runner: dict[str, Any]) -> str:
    found = runner["found_by"].startswith("the process")
    return _f(runner["rss_mib"], 0) + ("" if found else f" ({runner['found_by']})")


def _row(entry: dict[str, Any], server: str, c: int) -> dict[str, Any]:
    return next((r for r in entry["servers"][server]["sweep"] if r["concurrency"] == c), {})


# ---- the run ----

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serving.formats",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3-small", help="built-in model whose variants run")
    p.add_argument("--formats", nargs="+", default=[F32, "8bit", "4bit", "bf16"],
                   help="variants of --model (models/formats.py); f32 is the built-in itself")
    p.add_argument("--model-path", nargs="+", default=[],
                   help="local checkpoints of one model instead, named by their directory")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--waves", type=int, default=1, help="waves of c requests per level")
    p.add_argument("--rounds", type=int, default=1,
                   help="rounds serving every format in turn; figures are the rounds' medians")
    p.add_argument("--min-requests", type=int, default=2,
                   help="requests per level at least (one c = 1 request is one noisy sample)")
    p.add_argument("--blas", default="auto", help="runtime.blas for both servers")
    p.add_argument("--skip-mlx-lm", action="store_true", help="only this server")
    p.add_argument("--mlx-lm-formats", nargs="+", default=[],
                   help="formats (or checkpoint names) mlx_lm.server runs; default: all")
    p.add_argument("--set", action="append", default=[], help="launch --set for our server")
    p.add_argument("--client", choices=["openai", "lean"], default="openai",
                   help="the streaming client of both servers (load.py): the official openai "
                        "one, or lean_client.py's, a third of its CPU on the shared cores")
    p.add_argument("--json", default=str(ROOT / "docs" / "bench" / "formats.json"))
    p.add_argument("--markdown", default=str(ROOT / "BENCHMARKS.md"))
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, got {args.rounds}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from actors.model_runner.cpu import blas

    args.concurrency = sorted(set(args.concurrency))
    command = "python -m benchmarks.serving.formats " + " ".join(
        argv if argv is not None else sys.argv[1:])
    print("bench: memory bandwidth ...", file=sys.stderr, flush=True)
    bytes_s = bandwidth()
    entries = []
    for name, path in checkpoints(args):
        weights = read_weights(path)
        entries.append({"name": name, "path": path, "format": format_of(path, weights),
                        "weights": weights, "servers": {}, "rounds": [],
                        "ceiling_tok_s": bytes_s / weights["read_bytes_per_token"]})
    results: dict[str, Any] = {
        "command": command.strip(), "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": machine(), "model": " ".join(args.model_path) or args.model,
        "blas": blas.find(args.blas) or "bundled", "prompt_tokens": args.prompt_tokens,
        "output_tokens": args.output_tokens, "concurrency": args.concurrency,
        "waves": args.waves, "min_requests": args.min_requests, "client": args.client,
        "rounds": args.rounds,
        "bandwidth_bytes_s": bytes_s,
        "formats": entries}
    prompts = make_prompts(entries[0]["path"], args)  # one model: one tokenizer
    per_server = sum(len(v) for v in prompts.values())
    total = args.rounds * sum(per_server * (1 + wants_mlx_lm(args, e)) for e in entries)
    with tqdm(total=total, unit="req", desc="formats") as bar:
        for _ in range(args.rounds):
            for entry in entries:
                entry["rounds"].append(serve(entry, args, prompts, bar))
    for entry in entries:
        median_rounds(entry)
    results["ratios"], results["targets"] = ratios(results), targets(results)
    json_path, md_path = Path(args.json), Path(args.markdown)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(results, indent=1))
    text = markdown(results, json_path, md_path)
    put_formats_block(md_path, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
