"""Format variants of the built-ins: the float32 built-in converted by mlx-lm's own converter
(`mlx_lm.convert`) into the formats people download: affine 2 to 8 bits, the floating-point
modes (mxfp4, nvfp4, mxfp8), bfloat16 and float16.

    <builtin>-4bit, -3bit, ...          affine quantization, 2, 3, 4, 5, 6 or 8 bits, groups of 64
    <builtin>-4bit-g32, -2bit-g128      another group size (32, 64 or 128)
    <builtin>-mxfp4, -nvfp4, -mxfp8     floating-point modes, each with its one group size
                                        (32, 16, 32): -mxfp4-g32 is -mxfp4, -mxfp4-g64 is refused
    <builtin>-bf16, -fp16               bfloat16 or float16 weights
    <builtin>-4bit-bf16, -mxfp4-fp16    quantized, with everything else in bfloat16 or float16

The quantized variants without -bf16/-fp16 keep the built-in's float32 for everything the
converter does not quantize (scales, biases, norms), so the activations stay float32.
mlx-community checkpoints of bf16 models are of the `-4bit-bf16` kind: bfloat16 scales, biases
and activations. A variant is cached beside its base, named by the variant and a hash of the
base's spec hash and FORMAT_VERSION, so a changed base rebuilds it; it is built atomically, as
the base is. This module knows formats only: models/builtin.py names the bases and builds
both.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import re
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Collection

# Bump when the conversion itself changes: every cached variant then rebuilds. (The variant's
# name is part of its folder's name, so a new kind of variant needs no bump.)
FORMAT_VERSION = 1
AFFINE_BITS = (2, 3, 4, 5, 6, 8)  # what mx.quantize packs in affine mode
GROUP_SIZES = (32, 64, 128)
# The floating-point modes: (bits, the one group size mx.quantize takes for them).
MODES = {"mxfp4": (4, 32), "nvfp4": (4, 16), "mxfp8": (8, 32)}
DTYPES = {"bf16": "bfloat16", "fp16": "float16"}
_NAME = re.compile(r"(?P<base>.+?)"
                   r"(?:-(?:(?P<bits>\d+)bit|(?P<mode>mxfp4|nvfp4|mxfp8))(?:-g(?P<group>\d+))?)?"
                   r"(?:-(?P<dtype>bf16|fp16))?")
GRAMMAR = ("<builtin>-4bit (2, 3, 4, 5, 6, 8 bits), -4bit-g32 (groups 32, 64, 128), -mxfp4, "
           "-nvfp4, -mxfp8, -bf16, -fp16, -4bit-bf16, -mxfp4-fp16, ...")


@dataclass(frozen=True)
class Format:
    bits: int | None = None  # quantization bits; None: not quantized
    group_size: int = 64  # quantization group (weights sharing one scale, and bias in affine)
    dtype: str = "float32"  # all not quantized: affine scales and biases, norms, activations
    mode: str = "affine"  # mlx's quantization mode: affine, mxfp4, nvfp4, mxfp8


def parse(name: str, bases: Collection[str]) -> tuple[str, Format] | None:
    """(base, format) of a variant name of one of `bases`; None when `name` is not one.
    ValueError for a variant of a known base in bits or a group size mlx cannot quantize to."""
    match = _NAME.fullmatch(name)
    if (not match or match["base"] not in bases
            or not (match["bits"] or match["mode"] or match["dtype"])):
        return None
    dtype = DTYPES[match["dtype"]] if match["dtype"] else "float32"
    group = int(match["group"]) if match["group"] else None
    if match["mode"]:
        bits, only = MODES[match["mode"]]
        if group not in (None, only):
            raise ValueError(f"{name!r}: {match['mode']} quantizes in groups of {only}, "
                             f"not {group}")
        return match["base"], Format(bits, only, dtype, match["mode"])
    if match["bits"] and int(match["bits"]) not in AFFINE_BITS:
        raise ValueError(f"{name!r}: affine quantization takes {AFFINE_BITS} bits, "
                         f"not {match['bits']}")
    if (group or 64) not in GROUP_SIZES:
        raise ValueError(f"{name!r}: quantization groups are {GROUP_SIZES}, not {group}")
    bits = int(match["bits"]) if match["bits"] else None
    return match["base"], Format(bits, group or 64, dtype)


def variant_hash(base_hash: str) -> str:
    return hashlib.sha256(f"{base_hash}/{FORMAT_VERSION}".encode()).hexdigest()[:10]


def check_groups(name: str, fmt: Format, shapes: dict[str, tuple[int, ...]]) -> None:
    """mlx-lm silently leaves float32 a layer whose input width its group does not divide: refuse
    that instead of building a model that is only partly in the format its name says. `shapes`:
    the base's weight shapes by parameter path."""
    if fmt.bits is None:
        return
    odd = sorted(p for p, s in shapes.items() if len(s) == 2 and s[-1] % fmt.group_size)
    if odd:
        raise ValueError(f"{name!r}: groups of {fmt.group_size} do not divide the input width "
                         f"of {odd[0]} {shapes[odd[0]]} ({len(odd)} such weights)")


def convert(source: Path, out: Path, fmt: Format, marker: dict, progress: bool) -> None:
    """mlx_lm.convert of the float32 built-in at `source` into `out` (which must not exist), with
    the base's tokenizer files, and a config.json that says the dtype and which variant this is."""
    from mlx_lm import convert as mlx_lm_convert

    # The converter prints its steps: to stderr (the launcher's stdout carries its ready line).
    with contextlib.redirect_stdout(sys.stderr if progress else io.StringIO()):
        mlx_lm_convert(hf_path=str(source), mlx_path=str(out), quantize=fmt.bits is not None,
                       q_bits=fmt.bits, q_group_size=fmt.group_size if fmt.bits else None,
                       q_mode=fmt.mode, dtype=fmt.dtype)
    # The converter saves the tokenizer again through transformers, which drops settings (Qwen3.5's
    # ignore_merges) and adds others: the variant gets the base's files, byte for byte.
    for file in out.iterdir():
        if file.name not in ("config.json", "README.md") and not file.name.startswith("model"):
            file.unlink()
    for file in source.iterdir():
        if file.name != "config.json" and not file.name.startswith("model"):
            shutil.copy(file, out / file.name)
    path = out / "config.json"
    config = json.loads(path.read_text())
    # The converter copies the source's torch_dtype even when it casts the weights.
    config.update(torch_dtype=fmt.dtype, dtype=fmt.dtype, mlx_actor_serve=marker)
    path.write_text(json.dumps(config, indent=4))
