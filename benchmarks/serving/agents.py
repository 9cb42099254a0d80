"""Coding-agent sessions at once: the real Claude Code CLI, several conversations of a few turns
each against one served model; per turn, the time to first token and how much of the prompt
the prefix cache served.

    python -m benchmarks.serving.agents [--model qwen3-chat-small] [--sessions 8] [--turns 3]
        [--max-output-tokens 1024] [--set KEY=VALUE ...] [--out agents.json]

Every session has its own HOME and working folder and runs `claude -p` then `claude -p
--continue` (turns - 1 times), one turn after the other; the sessions all start together. The
default model is qwen3-small's weights with replies that end by themselves (qwen3-chat-small):
Claude Code takes a reply cut at a token cap for an error and resends it. Each session talks
through its own recording proxy; a turn's numbers are those of its first /v1/messages request
(the one carrying the new prompt; a reply cut at max_output_tokens makes Claude Code send up to
three "resume" requests more, counted in `requests`). TTFT is from the request reaching the
proxy to the first content_block_delta leaving the server (message_delta for an empty reply);
"reply" is that request's whole reply, "CLI run" the whole `claude` command.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.serving.run import machine
from harness.agents import CLAUDE_CODE, AgentsUnavailable, ClaudeSession, install
from harness.graph import start_graph, stop_graph
from harness.proxy import RecordingProxy, anthropic_usage
from models.builtin import ensure_builtin

PROMPTS = ("Write a Python function that reverses a string.", "Now add type hints.",
           "Now add a docstring and a doctest.")
FIRST_TOKEN = b'"content_block_delta"'
EMPTY_REPLY = b'"message_delta"'  # a reply whose first token ended it: its end is its first


def converse(bin_dir: Path, upstream: str, model: str, turns: int) -> list[dict]:
    """One session's turns, each as the numbers of its first request and the CLI's run."""
    rows = []
    with RecordingProxy(upstream) as proxy, ClaudeSession(bin_dir, proxy.url, model) as session:
        for k in range(turns):
            start = len(proxy.exchanges)
            turn = session.ask(PROMPTS[k % len(PROMPTS)], timeout=3600)
            sent = proxy.since(start, "/v1/messages")
            row = {"turn": k + 1, "exit": turn.code, "seconds": round(turn.seconds, 3),
                   "requests": len(sent)}
            if sent:
                u = anthropic_usage(sent[0].response)
                cached = u.get("cache_read_input_tokens", 0)
                ttft = sent[0].seconds_to(FIRST_TOKEN)
                row.update(ttft_s=sent[0].seconds_to(EMPTY_REPLY) if ttft is None else ttft,
                           reply_s=round(sent[0].ended - sent[0].started, 3), cached_tokens=cached,
                           prompt_tokens=cached + u.get("input_tokens", 0)
                           + u.get("cache_creation_input_tokens", 0))
            rows.append(row)
    return rows


def p90(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=10, method="inclusive")[8] if len(xs) > 1 else xs[0]


def summarize(sessions: list[list[dict]], turns: int) -> list[dict]:
    out = []
    for k in range(1, turns + 1):
        rows = [r for s in sessions for r in s if r["turn"] == k and r.get("ttft_s") is not None]
        if not rows:
            out.append({"turn": k, "sessions": 0})
            continue
        ttft = [r["ttft_s"] for r in rows]
        prompt = sum(r["prompt_tokens"] for r in rows)
        cached = sum(r["cached_tokens"] for r in rows)
        out.append({"turn": k, "sessions": len(rows),
                    "requests": sum(r["requests"] for r in rows),
                    "exit_nonzero": sum(r["exit"] != 0 for r in rows),
                    "prompt_tokens_median": statistics.median(r["prompt_tokens"] for r in rows),
                    "cached_fraction": round(cached / prompt, 4) if prompt else 0.0,
                    "ttft_median_s": round(statistics.median(ttft), 4),
                    "ttft_p90_s": round(p90(ttft), 4),
                    "reply_median_s": round(statistics.median(r["reply_s"] for r in rows), 3),
                    "cli_median_s": round(statistics.median(r["seconds"] for r in rows), 3)})
    first = out[0].get("ttft_median_s")
    for row in out:
        if first and row.get("ttft_median_s") is not None:
            row["ttft_vs_turn1"] = round(row["ttft_median_s"] / first, 4)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serving.agents",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3-chat-small", help="built-in model name")
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--max-output-tokens", type=int, default=1024,
                   help="limits.max_output_tokens (a bound on a rare long reply)")
    p.add_argument("--set", action="append", default=[], help="extra launch --set overrides")
    p.add_argument("--out", help="write the results here as JSON")
    args = p.parse_args(argv)
    try:
        bin_dir = install()
    except AgentsUnavailable as e:
        print(f"agents: {e}", file=sys.stderr)
        return 2
    ensure_builtin(args.model, progress=True)
    graph = start_graph(f"model.builtin={args.model}",
                        f"limits.max_output_tokens={args.max_output_tokens}", *args.set)
    t0 = time.monotonic()
    try:
        with ThreadPoolExecutor(args.sessions) as pool:
            sessions = list(pool.map(lambda _: converse(bin_dir, graph.http, graph.model,
                                                        args.turns), range(args.sessions)))
    finally:
        stop_graph(graph.proc)
    wall = time.monotonic() - t0
    rows = summarize(sessions, args.turns)
    print(f"{args.sessions} Claude Code sessions ({CLAUDE_CODE}) x {args.turns} turns on "
          f"{args.model}, {wall:.0f} s")
    print("| turn | sessions | requests | CLI exit != 0 | prompt tokens (median) | cached | "
          "TTFT median | TTFT p90 | TTFT vs turn 1 | reply (median) | CLI run (median) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if not r["sessions"]:
            print(f"| {r['turn']} | 0 |" + " |" * 9)
            continue
        print(f"| {r['turn']} | {r['sessions']} | {r['requests']} | {r['exit_nonzero']} | "
              f"{r['prompt_tokens_median']:.0f} | {r['cached_fraction']:.1%} | "
              f"{r['ttft_median_s']:.2f} s | {r['ttft_p90_s']:.2f} s | "
              f"{r.get('ttft_vs_turn1', float('nan')):.3f} | {r['reply_median_s']:.1f} s | "
              f"{r['cli_median_s']:.1f} s |")
    if args.out:
        Path(args.out).write_text(json.dumps(
            {"model": args.model, "agent": CLAUDE_CODE, "sessions": args.sessions,
             "turns": args.turns, "max_output_tokens": args.max_output_tokens,
             "wall_s": round(wall, 1), "machine": machine(), "by_turn": rows,
             "by_session": sessions}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
