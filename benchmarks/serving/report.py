"""The benchmark's report: BENCHMARKS.md (tables, ratios, targets met or missed) and the
throughput-vs-concurrency plot. Text after the NOTES marker in an existing BENCHMARKS.md is
kept, so the other benchmarks' sections (written by hand or by their own commands) survive a
re-run, and so is the block between the FORMATS markers (written by
benchmarks/serving/formats.py, a run of its own). The markdown names the command and the
machine, not the date: the run's timestamp stays in results.json."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

OURS, THEIRS, PEER = "mlx-actor-serve", "mlx_lm.server", "vllm-mlx"
NOTES = "<!-- notes: kept when the benchmark rewrites this file -->"
FORMATS = ("<!-- formats:begin -->", "<!-- formats:end -->")
FINDINGS = Path(__file__).resolve().parents[2] / "docs" / "performance.md"


def _ms(x: float) -> str:
    return "n/a" if x != x else f"{x * 1000:.1f} ms"


def _f(x: float, digits: int = 1) -> str:
    return "n/a" if x != x else f"{x:.{digits}f}"


def _by_c(server: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {row["concurrency"]: row for row in server["sweep"]}


def ratios(results: dict[str, Any]) -> list[dict[str, Any]]:
    ours = _by_c(results["servers"][OURS])
    theirs = _by_c(results["servers"][THEIRS]) if THEIRS in results["servers"] else {}
    bare = {row["batch"]: row for row in results["bare"]["results"]}
    rows = []
    for c, row in ours.items():
        other, ceiling = theirs.get(c), bare.get(c)
        rows.append({
            "concurrency": c,
            "vs_mlx_lm": row["output_tok_s"] / other["output_tok_s"] if other else float("nan"),
            "ttft_vs_mlx_lm": row["ttft_p50_s"] / other["ttft_p50_s"] if other else float("nan"),
            "vs_bare": row["decode_tok_s"] / ceiling["decode_tok_s"] if ceiling else float("nan"),
            "bare_decode_tok_s": ceiling["decode_tok_s"] if ceiling else float("nan")})
    return rows


def targets(results: dict[str, Any]) -> list[tuple[str, str, bool]]:
    rows = {r["concurrency"]: r for r in ratios(results)}
    lo, hi = min(rows), max(rows)
    out = []
    for c in (lo, hi):
        v = rows[c]["vs_bare"]
        out.append((f"served decode tok/s >= 0.95 x bare forward at batch {c}",
                    f"{_f(v, 3)} x", v >= 0.95))
    if THEIRS in results["servers"]:
        for c, need in ((lo, 1.0), (hi, 1.5)):
            v = rows[c]["vs_mlx_lm"]
            out.append((f"throughput >= {need} x mlx_lm.server at concurrency {c}",
                        f"{_f(v, 2)} x", v >= need))
        worst = max(r["ttft_vs_mlx_lm"] for r in rows.values())
        out.append(("TTFT p50 <= mlx_lm.server's (worst concurrency)", f"{_f(worst, 2)} x",
                    worst <= 1.0))
    if PEER in results["servers"]:  # the float32 targets against vllm-mlx
        ours, peer = _by_c(results["servers"][OURS]), _by_c(results["servers"][PEER])
        for c, need in ((lo, 1.1), (hi, 2.0)):
            v = ours[c]["output_tok_s"] / peer[c]["output_tok_s"] if c in peer else float("nan")
            out.append((f"throughput >= {need} x vllm-mlx at concurrency {c}", f"{_f(v, 2)} x",
                        v >= need))
    tput = [row["output_tok_s"] for row in results["servers"][OURS]["sweep"]]
    drops = [f"{a:.0f}->{b:.0f}" for a, b in zip(tput, tput[1:]) if b < a]
    out.append(("throughput never drops as concurrency rises", ", ".join(drops) or "no drop",
                not drops))
    p = results["servers"][OURS]["prefix"]
    out.append(("shared-prefix TTFT <= 0.1 x cold", f"{_f(p['ratio'], 3)} x",
                p["ratio"] <= 0.1))
    return out


def write_markdown(results: dict[str, Any], path: Path, plot: Path) -> str:
    m = results["machine"]
    lines = [
        "# Benchmarks", "",
        "Every table here is headed by the command that regenerates it (run from the "
        "repository root) and the machine it ran on; its raw JSON keeps the run's timestamp. "
        "What bounds each path, and what was tried and did not help, is in "
        f"[docs/performance.md]({_rel(FINDINGS, path)}).", "",
        f"Measured by `{results['command']}` on {machine_text(m)}. Model "
        f"`{results['model']}`, BLAS `{os.path.basename(str(results['blas']))}` for every party "
        f"(ours, mlx_lm.server, bare loop). Prompts of {results['prompt_tokens']} tokens, exactly "
        f"{results['output_tokens']} output tokens (EOS ignored), greedy. Raw numbers: "
        f"`{_rel(plot.parent / 'results.json', path)}`.", "",
        f"![throughput vs concurrency]({_rel(plot, path)})", "",
        "## Throughput and latency by concurrency", "",
        "Closed loop: `c` clients, two waves of `c` requests (at least 4). Output tok/s is all "
        "output tokens over the level's wall time (prefill included). Steady decode tok/s "
        "counts tokens while a whole wave is decoding (median over the waves): the served "
        "counterpart of the bare loop at batch `c`. ITL is the gap between streamed chunks.", "",
        "| c | server | output tok/s | steady decode tok/s | TTFT p50 | TTFT p99 | ITL p50 "
        "| ITL p99 | errors |", "|---|---|---|---|---|---|---|---|---|"]
    for name, server in results["servers"].items():
        for r in server["sweep"]:
            lines.append(f"| {r['concurrency']} | {name} | {_f(r['output_tok_s'])} | "
                         f"{_f(r['decode_tok_s'])} | {_ms(r['ttft_p50_s'])} | "
                         f"{_ms(r['ttft_p99_s'])} | {_ms(r['itl_p50_s'])} | "
                         f"{_ms(r['itl_p99_s'])} | {r['errors']} |")
    lines += ["", "## Ratios", "",
              "| c | ours / mlx_lm.server (output tok/s) | TTFT p50 ours / mlx_lm.server "
              "| ours steady decode / bare decode | bare decode tok/s |",
              "|---|---|---|---|---|"]
    for r in ratios(results):
        lines.append(f"| {r['concurrency']} | {_f(r['vs_mlx_lm'], 2)} | "
                     f"{_f(r['ttft_vs_mlx_lm'], 2)} | {_f(r['vs_bare'], 3)} | "
                     f"{_f(r['bare_decode_tok_s'])} |")
    lines += ["", "## Shared prefix", "",
              "One request with a 2,000-token prefix (cold), then different 32-token suffixes "
              "after the same prefix, one at a time.", "",
              "| server | cold TTFT | cached-prefix TTFT p50 | ratio |", "|---|---|---|---|"]
    for name, server in results["servers"].items():
        p = server["prefix"]
        lines.append(f"| {name} | {_ms(p['cold_ttft_s'])} | {_ms(p['hit_ttft_p50_s'])} | "
                     f"{_f(p['ratio'], 3)} |")
    lines += ["", "## Prefill interference", "",
              "Decoding streams, then long prompts arriving together: the streams' token gaps "
              "before and while the long prompts are in.", "",
              "| server | streams | long prompts | ITL p50 before | ITL p50 during | ITL p99 "
              "during | ITL max during | long-prompt TTFT p50 |",
              "|---|---|---|---|---|---|---|---|"]
    for name, server in results["servers"].items():
        i = server["interference"]
        lines.append(f"| {name} | {i['streams']} | {i['long_prompts']} x "
                     f"{i['long_prompt_tokens']} | {_ms(i['itl_before_p50_s'])} | "
                     f"{_ms(i['itl_during_p50_s'])} | {_ms(i['itl_during_p99_s'])} | "
                     f"{_ms(i['itl_during_max_s'])} | {_ms(i['long_ttft_p50_s'])} |")
    lines += ["", "## Bare forward loop", "", "| batch | prefill tok/s | decode step median | "
              "decode tok/s |", "|---|---|---|---|"]
    for r in results["bare"]["results"]:
        lines.append(f"| {r['batch']} | {_f(r['prefill_tok_s'])} | "
                     f"{_f(r['step_ms_median'], 2)} ms | {_f(r['decode_tok_s'])} |")
    lines += ["", "## Targets", "", "| target | measured | met |", "|---|---|---|"]
    lines += [f"| {t} | {v} | {'yes' if ok else 'NO'} |" for t, v, ok in targets(results)]
    text = "\n".join(lines) + "\n"
    old = path.read_text() if path.exists() else ""
    head, _, kept = old.partition(NOTES)
    block = formats_block(head)
    path.write_text(text + "\n" + (block + "\n\n" if block else "") + NOTES + (kept or "\n"))
    return text


def machine_text(m: dict[str, Any]) -> str:
    """The machine a run's markdown names: CPU, cores, system, Python (no date)."""
    return f"{m['cpu']}, {m['cores']} cores, {m['system']}, Python {m['python']}"


def formats_block(text: str) -> str:
    """The formats block of `text`, markers included; "" when it has none."""
    begin, end = FORMATS
    inside, found, _ = text.partition(begin)[2].partition(end)
    return begin + inside + end if found else ""


def put_formats_block(path: Path, body: str) -> None:
    """Write `body` between the FORMATS markers of the file at `path`: in place of the block
    there, else just before the notes (else at the end), so the rest of the file is untouched."""
    old = path.read_text() if path.exists() else ""
    block = f"{FORMATS[0]}\n{body.strip()}\n{FORMATS[1]}"
    if formats_block(old):
        new = old.replace(formats_block(old), block, 1)
    elif NOTES in old:
        head, _, kept = old.partition(NOTES)
        new = head + block + "\n\n" + NOTES + kept
    else:
        new = old + ("\n" if old and not old.endswith("\n") else "") + block + "\n"
    path.write_text(new)


def _rel(target: Path, doc: Path) -> str:
    return os.path.relpath(target.resolve(), doc.resolve().parent)


def write_plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    for name, server in results["servers"].items():
        xs = [r["concurrency"] for r in server["sweep"]]
        ax.plot(xs, [r["output_tok_s"] for r in server["sweep"]], marker="o", label=name)
    bare = results["bare"]["results"]
    ax.plot([r["batch"] for r in bare], [r["decode_tok_s"] for r in bare], linestyle="--",
            color="grey", label="bare mlx-lm forward (decode only)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(results["concurrency"], [str(c) for c in results["concurrency"]])
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"{results['model']}: {results['prompt_tokens']} in, "
                 f"{results['output_tokens']} out")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
