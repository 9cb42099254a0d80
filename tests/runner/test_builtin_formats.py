"""Format variants of the built-ins (models/formats.py): affine 2-8 bit, mxfp4, nvfp4, mxfp8, bf16
and fp16 checkpoints made by mlx-lm's converter, cached and built atomically like the base,
loadable, and still varied."""

import dataclasses
import json
import os
import re
import statistics
import subprocess
import sys

import mlx.core as mx
import mlx.nn as nn
import pytest

from models import builtin, formats
from models.formats import Format
from protocol.config import BUILTIN_NAME
from tests.support.formats import EXTENDED as SERVED_EXTENDED

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # every load below is local; never reach for the hub

PROMPTS = ["Hello world", "def fibonacci(n):", "人工智能是"]
QUANTIZED = {  # name -> (mode, bits, group size, dtype of norms, and of affine scales and biases)
    "qwen3-tiny-4bit": ("affine", 4, 64, mx.float32),
    "qwen3-tiny-8bit": ("affine", 8, 64, mx.float32),
    "qwen3-tiny-4bit-bf16": ("affine", 4, 64, mx.bfloat16),
    "qwen3-tiny-4bit-g32": ("affine", 4, 32, mx.float32),
    "qwen3_5-tiny-4bit": ("affine", 4, 64, mx.float32),
    "gemma3-tiny-4bit": ("affine", 4, 64, mx.float32),
    "qwen3-tiny-3bit": ("affine", 3, 64, mx.float32),
    "qwen3-tiny-6bit-g32": ("affine", 6, 32, mx.float32),
    "qwen3-tiny-mxfp4": ("mxfp4", 4, 32, mx.float32),
    "qwen3-tiny-nvfp4": ("nvfp4", 4, 16, mx.float32),
    "qwen3-tiny-mxfp8-fp16": ("mxfp8", 8, 32, mx.float16),
}
HALF = {"qwen3-tiny-bf16": mx.bfloat16, "qwen3_5-tiny-bf16": mx.bfloat16,
        "qwen3-tiny-fp16": mx.float16}
FAST = {"qwen3-tiny-4bit", "qwen3-tiny-8bit", "qwen3-tiny-bf16"}  # the rest build or decode slowly


# Models whose checks here belong to the extended matrix (their continuations' variety, stored
# format and dtype): those only it serves (tests/e2e/test_formats.py's EXTENDED), and the other
# scale dtype and group sizes, which no served test takes.
EXTENDED = SERVED_EXTENDED | {"qwen3-tiny-mxfp8-fp16", "qwen3-tiny-4bit-g32",
                              "qwen3-tiny-6bit-g32"}


def cases(names, extended=()):
    return [pytest.param(n, marks=(*([] if n in FAST else [pytest.mark.slow]),
                                   *([pytest.mark.matrix] if n in extended else [])))
            for n in names]


def stored_dtypes(directory) -> dict[str, mx.Dtype]:
    return {k: v.dtype for k, v in mx.load(str(directory / "model.safetensors")).items()}


@pytest.mark.parametrize("name, parsed", [
    ("qwen3-tiny-4bit", ("qwen3-tiny", Format(4, 64, "float32"))),
    ("qwen3_5-tiny-8bit-g128", ("qwen3_5-tiny", Format(8, 128, "float32"))),
    ("gemma3-tiny-bf16", ("gemma3-tiny", Format(None, 64, "bfloat16"))),
    ("qwen3-small-4bit-g32-bf16", ("qwen3-small", Format(4, 32, "bfloat16"))),
    ("qwen3-tiny-3bit", ("qwen3-tiny", Format(3, 64, "float32"))),
    ("qwen3-tiny-2bit-g32", ("qwen3-tiny", Format(2, 32, "float32"))),
    ("qwen3-tiny-5bit-fp16", ("qwen3-tiny", Format(5, 64, "float16"))),
    ("qwen3-tiny-6bit-g128-bf16", ("qwen3-tiny", Format(6, 128, "bfloat16"))),
    ("qwen3-tiny-mxfp4", ("qwen3-tiny", Format(4, 32, "float32", "mxfp4"))),
    ("qwen3-tiny-mxfp4-g32", ("qwen3-tiny", Format(4, 32, "float32", "mxfp4"))),
    ("qwen3_5-tiny-nvfp4-bf16", ("qwen3_5-tiny", Format(4, 16, "bfloat16", "nvfp4"))),
    ("gemma3-tiny-mxfp8-fp16", ("gemma3-tiny", Format(8, 32, "float16", "mxfp8"))),
    ("qwen3-tiny-fp16", ("qwen3-tiny", Format(None, 64, "float16"))),
    ("qwen3-tiny", None), ("llama-4bit", None), ("qwen3-tiny-bf16-4bit", None),
    ("qwen3-tiny-g32", None), ("qwen3-tiny-fp8", None), ("qwen3-tiny-mxfp4-4bit", None),
    ("qwen3-tiny-bf16-fp16", None), ("qwen3-tiny-int4", None),
])  # fmt: skip
def test_variant_names(name, parsed):
    assert builtin.parse_variant(name) == parsed


@pytest.mark.parametrize("name, why", [
    ("qwen3-tiny-7bit", "takes .* bits, not 7"),
    ("qwen3-tiny-16bit", "not 16"),
    ("qwen3-tiny-3bit-g48", "not 48"),
    ("qwen3-tiny-mxfp4-g64", "mxfp4 quantizes in groups of 32, not 64"),
    ("qwen3-tiny-nvfp4-g32", "nvfp4 quantizes in groups of 16, not 32"),
    ("qwen3-tiny-mxfp8-g16-bf16", "mxfp8 quantizes in groups of 32, not 16"),
])  # fmt: skip
def test_impossible_variants_are_refused_naming_the_variant(name, why):
    with pytest.raises(ValueError, match=f"^'{name}': .*{why}"):
        builtin.parse_variant(name)


def test_config_accepts_exactly_the_variants_that_parse():
    """protocol/config.py's BUILTIN_NAME refuses at config time what the converter could not
    make: the two grammars must agree on every name."""
    parts = ["", "-2bit", "-3bit", "-4bit", "-5bit", "-6bit", "-7bit", "-8bit", "-mxfp4",
             "-nvfp4", "-mxfp8", "-fp8"]
    groups = ["", "-g16", "-g32", "-g64", "-g128", "-g48"]
    dtypes = ["", "-bf16", "-fp16", "-fp32"]
    for base in [*builtin.BUILTINS, "llama"]:
        for name in (base + p + g + d for p in parts for g in groups for d in dtypes):
            try:
                valid = name in builtin.BUILTINS or builtin.parse_variant(name) is not None
            except ValueError:
                valid = False
            assert bool(re.match(BUILTIN_NAME, name)) == valid, name


def test_old_variant_folders_keep_their_names():
    """A cached variant is found by its folder's name: adding kinds of variants must not
    rename the folders of those built before (that would rebuild them all)."""
    assert formats.FORMAT_VERSION == 1
    assert formats.variant_hash("0123456789") == "9e8b0ccbd1"


def test_unknown_names_and_groups_are_refused_before_building(tmp_path):
    with pytest.raises(KeyError, match="-4bit"):
        builtin.ensure_builtin("qwen3-tiny-int4", tmp_path)
    with pytest.raises(ValueError, match="not 48"):
        builtin.ensure_builtin("qwen3-tiny-4bit-g48", tmp_path)
    with pytest.raises(ValueError, match="groups of 16"):
        builtin.ensure_builtin("qwen3-tiny-nvfp4-g64", tmp_path)
    # mlx-lm would leave every layer 64 wide in float32 and call the result 4-bit.
    with pytest.raises(ValueError, match="groups of 128 do not divide"):
        builtin.ensure_builtin("qwen3-tiny-4bit-g128", tmp_path)
    assert not list(tmp_path.iterdir())


def test_folder_is_named_by_variant_and_base_spec(monkeypatch, tmp_path):
    """A changed base spec is a new folder for its variants too; the converter is not run
    again for a folder that is there."""
    made = []

    def fake_build(name, spec, directory, progress=True):
        directory.mkdir(parents=True)

    def fake_convert(source, out, fmt, marker, progress):
        made.append(out)
        out.mkdir()

    monkeypatch.setattr(builtin, "build_model_dir", fake_build)
    monkeypatch.setattr(formats, "convert", fake_convert)
    spec = builtin.BUILTINS["qwen3-tiny"]
    first = builtin.ensure_builtin("qwen3-tiny-4bit", tmp_path)
    assert first.name == f"qwen3-tiny-4bit-{formats.variant_hash(builtin.spec_hash(spec))}"
    assert builtin.ensure_builtin("qwen3-tiny-4bit", tmp_path) == first and len(made) == 1
    monkeypatch.setitem(builtin.BUILTINS, "qwen3-tiny", dataclasses.replace(spec, embed_std=0.03))
    second = builtin.ensure_builtin("qwen3-tiny-4bit", tmp_path)
    assert second != first and len(made) == 2


def test_cached_variant_is_returned_without_converting(loaded, model_cache, monkeypatch):
    directory, _, _ = loaded("qwen3-tiny-4bit")
    before = (directory / "model.safetensors").stat().st_mtime_ns

    def refuse(*args):
        raise AssertionError("converted again")

    monkeypatch.setattr(formats, "convert", refuse)
    assert builtin.ensure_builtin("qwen3-tiny-4bit", model_cache, progress=False) == directory
    assert (directory / "model.safetensors").stat().st_mtime_ns == before
    assert not [p for p in model_cache.iterdir() if ".building-" in p.name]


@pytest.mark.slow
def test_concurrent_variant_builds_agree(tmp_path):
    """Two processes race to build a variant (and its base) into one empty cache."""
    code = ("import sys; from models import builtin; "
            "print(builtin.ensure_builtin('qwen3-tiny-8bit', sys.argv[1], progress=False))")
    command = [sys.executable, "-c", code, str(tmp_path)]
    racers = [subprocess.Popen(command, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [racer.communicate(timeout=180)[0].strip() for racer in racers]
    assert all(racer.returncode == 0 for racer in racers)
    assert outputs[0] == outputs[1] and os.path.basename(outputs[0]).startswith("qwen3-tiny-8bit-")
    assert len(list(tmp_path.iterdir())) == 2  # the variant and its base, no scratch left


@pytest.mark.parametrize("name", cases(QUANTIZED, EXTENDED))
def test_quantized_variant_says_its_format_and_loads_quantized(loaded, name):
    mode, bits, group, dtype = QUANTIZED[name]
    directory, model, tokenizer = loaded(name)
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in directory.iterdir()}
    config = json.loads((directory / "config.json").read_text())
    expected = {"group_size": group, "bits": bits, "mode": mode}
    assert config["quantization"] == config["quantization_config"] == expected
    assert config["torch_dtype"] == config["dtype"] == str(dtype).removeprefix("mlx.core.")
    assert config["mlx_actor_serve"]["builtin"] == name
    stored = stored_dtypes(directory)
    assert [d for k, d in stored.items() if k.endswith("embed_tokens.weight")] == [mx.uint32]
    assert {d for k, d in stored.items() if k.endswith("norm.weight")} == {dtype}
    # Affine scales and biases are in the model's dtype; the floating-point modes' scales are
    # 8-bit exponents (or e4m3 for nvfp4), and they have no biases.
    scales = {d for k, d in stored.items() if k.endswith((".scales", ".biases"))}
    assert scales == ({dtype} if mode == "affine" else {mx.uint8})
    assert any(k.endswith(".biases") for k in stored) == (mode == "affine")
    linears = [m for _, m in model.named_modules() if isinstance(m, nn.Linear)]
    quantized = [m for _, m in model.named_modules() if isinstance(m, nn.QuantizedLinear)]
    assert quantized and not linears  # every projection is quantized, none left float
    assert {(m.mode, m.bits, m.group_size) for m in quantized} == {(mode, bits, group)}
    assert isinstance(model.model.embed_tokens, nn.QuantizedEmbedding)  # and the tied LM head


@pytest.mark.parametrize("name", cases(["qwen3-tiny-4bit", "qwen3_5-tiny-bf16"]))
def test_tokenizer_files_are_the_bases(loaded, model_cache, name):
    """Not transformers' re-save, which drops Qwen3.5's ignore_merges and adds local paths."""
    directory, _, _ = loaded(name)
    base = builtin.ensure_builtin(builtin.parse_variant(name)[0], model_cache, progress=False)
    files = sorted(p.name for p in base.iterdir() if p.name.startswith("tokenizer"))
    assert files == sorted(p.name for p in directory.iterdir() if p.name.startswith(("tok", "chat")))
    assert all((base / f).read_bytes() == (directory / f).read_bytes() for f in files)


@pytest.mark.parametrize("name", cases(HALF, EXTENDED))
def test_half_variant_stores_its_dtype(loaded, name):
    directory, model, _ = loaded(name)
    dtype = HALF[name]
    config = json.loads((directory / "config.json").read_text())
    assert config["torch_dtype"] == config["dtype"] == str(dtype).removeprefix("mlx.core.")
    assert "quantization" not in config
    stored = stored_dtypes(directory)
    # mlx-lm keeps the gated-delta decay rates (A_log) in float32, as in real Qwen3.5 checkpoints.
    assert {k for k, d in stored.items() if d != dtype} <= {
        k for k in stored if k.endswith("A_log")}
    assert model.model.embed_tokens.weight.dtype == dtype


def greedy(model, prompt_ids: list[int], steps: int) -> tuple[list[int], list[float]]:
    from mlx_lm.generate import generate_step

    tokens, gaps = [], []
    for token, logprobs in generate_step(mx.array(prompt_ids), model, max_tokens=steps):
        top2 = mx.sort(logprobs.astype(mx.float32))[-2:]
        gaps.append((top2[1] - top2[0]).item())
        tokens.append(int(token))
    return tokens, gaps


@pytest.mark.parametrize("name", cases([*QUANTIZED, *HALF], EXTENDED))
def test_greedy_continuations_stay_varied(loaded, name):
    """Quantizing random weights does not collapse them to one repeated token. (It does change
    the function: a 4-bit variant's greedy tokens differ from its float32 base's within the first
    token or two, so a variant is checked against mlx-lm on itself, never against its base.)"""
    _, model, tokenizer = loaded(name)
    continuations, gaps = [], []
    for prompt in PROMPTS:
        tokens, step_gaps = greedy(model, tokenizer.encode(prompt), steps=32)
        continuations.append(tuple(tokens))
        gaps += step_gaps
        assert len(set(tokens)) >= 12, (prompt, tokenizer.decode(tokens))
    assert len(set(continuations)) == len(PROMPTS)
    assert statistics.median(gaps) > 0.3
    if not name.endswith(("-bf16", "-fp16")):
        # float32 activations: winners as clear as the base's (measured over these 96 steps: the
        # smallest gap 2.5e-3 to 0.04, none under 1e-3).
        assert sum(gap < 1e-3 for gap in gaps) <= 2
    # bfloat16 logits are multiples of 1/16 to 1/4 at these sizes: exact ties are part of the
    # format (measured: 8 to 10 of these 96 steps have a top-2 gap of exactly 0).
