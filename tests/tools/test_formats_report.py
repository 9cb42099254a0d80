"""The format benchmark's pure parts, nothing served: ratios and the format targets from a
hand-built result, weight bytes from safetensors headers, and its BENCHMARKS.md block (written
in place of an older one, kept by the main benchmark's rewrite, notes untouched)."""

from __future__ import annotations

import json
import math

import mlx.core as mx
import pytest

from benchmarks.serving.formats import (format_of, markdown, median_rounds, parse_args, ratios,
                                        read_weights, targets)
from benchmarks.serving.report import (FORMATS, NOTES, OURS, THEIRS, put_formats_block,
                                       write_markdown)


def make_entry(name: str, fmt: str, ours: dict[int, float], theirs: dict[int, float] | None,
               rss_mib: float, ceiling: float = 100.0) -> dict:
    sweep = lambda rates: {"sweep": [{"concurrency": c, "output_tok_s": v}  # noqa: E731
                                     for c, v in rates.items()]}
    servers = {OURS: sweep(ours)} | ({THEIRS: sweep(theirs)} if theirs else {})
    return {"name": name, "format": fmt, "servers": servers, "runner": {"rss_mib": rss_mib},
            "ceiling_tok_s": ceiling}


def make_results() -> dict:
    return {"concurrency": [1, 16], "formats": [
        make_entry("m", "f32", {1: 10.0, 16: 100.0}, {1: 8.0, 16: 40.0}, rss_mib=1000.0),
        # 4-bit: 3x float32 at c=1 (met), 1.2x at c=16 (missed), 6x and 4x mlx_lm.server.
        make_entry("m-4bit", "4bit", {1: 30.0, 16: 120.0}, {1: 5.0, 16: 30.0}, rss_mib=600.0),
        make_entry("m-8bit", "8bit", {1: 14.0, 16: 110.0}, None, rss_mib=800.0)]}


def test_ratios_compare_with_float32_and_mlx_lm_on_the_same_checkpoint():
    rows = {r["format"]: r for r in ratios(make_results())}
    four = rows["4bit"]
    assert four["vs_f32"] == {1: pytest.approx(3.0), 16: pytest.approx(1.2)}
    assert four["vs_mlx_lm"] == {1: pytest.approx(6.0), 16: pytest.approx(4.0)}
    assert four["rss_vs_f32"] == pytest.approx(0.6) and four["of_ceiling"] == pytest.approx(0.3)
    assert rows["f32"]["vs_mlx_lm"][16] == pytest.approx(2.5)
    assert math.isnan(rows["8bit"]["vs_mlx_lm"][1])  # mlx_lm.server did not run it


def test_targets_met_and_missed_and_unmeasured_ones_left_out():
    found = {(t["format"], t["target"]): t for t in targets(make_results())}
    met = lambda fmt, text: found[(fmt, text)]["met"]  # noqa: E731
    assert met("4bit", "c=1 output tok/s >= 2.5x float32's")
    assert not met("4bit", "c=16 output tok/s >= 1.3x float32's")
    assert met("4bit", "c=1 output tok/s >= 5.0x mlx_lm.server's (same checkpoint)")
    assert not met("4bit", "c=16 output tok/s >= 5.0x mlx_lm.server's (same checkpoint)")
    assert met("4bit", "runner RSS <= 0.7x float32's")
    assert not met("8bit", "c=1 output tok/s >= 1.5x float32's")  # 1.4x
    assert met("f32", "c=16 output tok/s >= 2.0x mlx_lm.server's (same checkpoint)")
    assert met("f32", "c=1 output tok/s >= 1.1x mlx_lm.server's (same checkpoint)")  # 1.25x
    assert found[("8bit", "c=1 output tok/s >= 1.5x float32's")]["measured"] == pytest.approx(1.4)
    assert not [k for k in found if k[0] == "bf16"]  # not measured: no row
    assert not [k for k in found if k[0] == "8bit" and "mlx_lm" in k[1]]


def test_weight_bytes_from_the_headers(tmp_path):
    embed, layer = mx.zeros((32, 8)), mx.zeros((8, 8), dtype=mx.bfloat16)
    mx.save_safetensors(str(tmp_path / "model.safetensors"),
                        {"model.embed_tokens.weight": embed, "model.layers.0.w.weight": layer},
                        metadata={"format": "mlx"})
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    tied = read_weights(tmp_path)
    # Tied: the embedding table is read once per token, as the LM head.
    assert tied["stored_bytes"] == tied["read_bytes_per_token"] == embed.nbytes + layer.nbytes
    assert format_of(tmp_path, tied) == "f32"  # most bytes are float32
    head = mx.zeros((32, 8))
    mx.save_safetensors(str(tmp_path / "model-2.safetensors"), {"lm_head.weight": head})
    untied = read_weights(tmp_path)
    assert untied["stored_bytes"] == embed.nbytes + layer.nbytes + head.nbytes
    assert untied["read_bytes_per_token"] == layer.nbytes + head.nbytes  # lookup: one row
    (tmp_path / "config.json").write_text(json.dumps({"quantization": {"bits": 4}}))
    assert format_of(tmp_path, untied) == "4bit"


def test_block_replaces_the_old_one_keeps_notes_and_survives_the_main_rewrite(tmp_path):
    doc = tmp_path / "BENCHMARKS.md"
    doc.write_text(f"# Benchmarks\n\nold tables\n\n{NOTES}\n\n## Notes\nby hand\n")
    put_formats_block(doc, "## Stored formats\nfirst run\n")
    text = doc.read_text()
    assert text.index(FORMATS[0]) < text.index("first run") < text.index(NOTES)
    put_formats_block(doc, "## Stored formats\nsecond run\n")
    text = doc.read_text()
    assert "first run" not in text and text.count(FORMATS[0]) == text.count(FORMATS[1]) == 1
    assert text.startswith("# Benchmarks\n\nold tables\n") and text.endswith("## Notes\nby hand\n")
    write_markdown(main_results(), doc, tmp_path / "throughput.png")
    text = doc.read_text()
    assert "old tables" not in text and "second run" in text
    assert text.index("## Targets") < text.index(FORMATS[0]) < text.index(NOTES)
    assert text.endswith(f"{NOTES}\n\n## Notes\nby hand\n")


def main_results() -> dict:
    """The smallest result the main benchmark's report renders: our server alone."""
    row = {"concurrency": 1, "output_tok_s": 10.0, "decode_tok_s": 11.0, "ttft_p50_s": 0.1,
           "ttft_p99_s": 0.2, "itl_p50_s": 0.05, "itl_p99_s": 0.06, "errors": 0}
    nan = float("nan")
    return {"command": "python -m benchmarks.serving", "date": "today", "model": "m",
            "machine": {"cpu": "cpu", "cores": 2, "system": "linux", "python": "3.11"},
            "blas": "bundled", "prompt_tokens": 8, "output_tokens": 8, "concurrency": [1],
            "bare": {"results": [{"batch": 1, "decode_tok_s": 11.0, "prefill_tok_s": 100.0,
                                  "step_ms_median": 90.0}]},
            "servers": {OURS: {"sweep": [row], "prefix": {
                "cold_ttft_s": 1.0, "hit_ttft_p50_s": 0.05, "ratio": 0.05},
                "interference": {"streams": 1, "long_prompts": 1, "long_prompt_tokens": 8,
                                 "itl_before_p50_s": nan, "itl_during_p50_s": nan,
                                 "itl_during_p99_s": nan, "itl_during_max_s": nan,
                                 "long_ttft_p50_s": nan}}}}


def test_rounds_give_the_median_round_of_each_level_and_say_so(tmp_path):
    """--rounds: each server's level is the round with the median output tok/s (the lower of
    an even count), every round's figure kept and shown; the runner's memory is the last
    round's."""
    def round_(rates: dict[int, float], rss: float) -> dict:
        entry = make_entry("m", "4bit", rates, {1: 5.0, 16: 30.0}, rss_mib=rss)
        entry["runner"]["found_by"] = "the process"
        for server in entry["servers"].values():
            for row in server["sweep"]:  # ttft: a field that must come with the chosen round
                row.update(ttft_p50_s=row["output_tok_s"] / 1000, decode_tok_s=1.0,
                           itl_p50_s=0.01, errors=0)
        return {"servers": entry["servers"], "runner": entry["runner"]}

    entry = {**make_entry("m", "4bit", {}, None, rss_mib=0.0), "weights": {"stored_bytes": 1}, "rounds": [
        round_({1: 30.0, 16: 90.0}, 600.0), round_({1: 10.0, 16: 120.0}, 610.0),
        round_({1: 20.0, 16: 100.0}, 620.0), round_({1: 40.0, 16: 80.0}, 630.0)]}
    median_rounds(entry)
    ours = {r["concurrency"]: r for r in entry["servers"][OURS]["sweep"]}
    assert ours[1]["output_tok_s"] == 20.0 and ours[16]["output_tok_s"] == 90.0
    assert ours[1]["rounds_output_tok_s"] == [30.0, 10.0, 20.0, 40.0]
    assert ours[16]["ttft_p50_s"] == 0.09 and entry["runner"]["rss_mib"] == 630.0
    assert entry["servers"][THEIRS]["sweep"][0]["output_tok_s"] == 5.0
    results = make_results()
    results["formats"] = [entry]
    results.update(rounds=4, command="x", date="d", machine={"cpu": "c", "cores": 2,
                   "system": "s", "python": "3"}, model="m", blas="b", prompt_tokens=8,
                   output_tokens=8, waves=1, bandwidth_bytes_s=1e9)
    results["ratios"], results["targets"] = ratios(results), targets(results)
    text = markdown(results, tmp_path / "f.json", tmp_path / "B.md")
    assert "median of 4 rounds" in text and "4bit 30.0 / 10.0 / 20.0 / 40.0" in text
    with pytest.raises(SystemExit):
        parse_args(["--rounds", "0"])
