"""Which constrained-decoding library is fastest for our Qwen3 tokenizer on this CPU:
llguidance (what actors/model_runner/grammar.py uses), xgrammar and outlines-core.

For each library, with the served model's tokenizer.json (151,936-token vocabulary):
  tokenizer  building the library's view of the vocabulary (llguidance.LLTokenizer;
             xgrammar.TokenizerInfo.from_huggingface, the HF tokenizer load timed apart;
             outlines_core.Vocabulary from tokenizer.json's byte-level tokens);
  compile    a JSON schema to a matcher at its start: a small one, it without maxLength
             ("small-free") and a 30-property one;
             cold (no cache) and warm (the library's own cache: xgrammar only);
  mask       the next-token bitmask (int32 words, bit t = token t) at each step of a walk
             over the tokens of a valid instance, fresh matcher per walk: p50 / p99 / max;
  advance    consuming one token.
Times: median (min-max) over --reps runs; masks over every step of --walks walks.

Not the project's environment: xgrammar imports torch (its matcher module does, even with a
NumPy bitmask; PyPI's Linux torch brings CUDA wheels, a ~5 GB venv), so a separate venv:
    python3.11 -m venv /tmp/gramvenv
    /tmp/gramvenv/bin/pip install llguidance xgrammar outlines-core numpy tokenizers transformers
    /tmp/gramvenv/bin/python benchmarks/kernels/grammar_libs.py [--tokenizer-dir DIR] [--json OUT]
A library that does not import is skipped, and said so.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is read from the local directory
EOS, STOPS = 151643, [151643, 151645]  # Qwen3's <|endoftext|>, <|im_end|>
SEPARATORS = (", ", ": ")  # as the project's JSON_OPTIONS and json.dumps: no free whitespace

SMALL = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
         "properties": {"name": {"type": "string", "maxLength": 8},
                        "age": {"type": "integer", "minimum": 0, "maximum": 150}}}
ITEM = {"type": "object", "additionalProperties": False, "required": ["x", "tags"],
        "properties": {"x": {"type": "number", "minimum": -5, "maximum": 5},
                       "tags": {"type": "array",
                                "items": {"type": "string", "pattern": "^[a-z]{2,5}$"}}}}
# All 30 required: optional properties make outlines' regex (and its index) combinatorial.
BIG = {"type": "object", "additionalProperties": False,
       "properties": {f"p{i}": ITEM for i in range(30)}, "required": [f"p{i}" for i in range(30)]}
# (schema, a valid instance). "small-free": the small one without maxLength, which is what
# makes a string's masks expensive in llguidance and xgrammar (a bounded repetition).
SCHEMAS = {"small": (SMALL, {"name": "Bob", "age": 42}),
           "small-free": ({**SMALL, "properties": {**SMALL["properties"],
                                                   "name": {"type": "string"}}},
                          {"name": "Bob", "age": 42}),
           "big": (BIG, {f"p{i}": {"x": i % 10 - 4.5, "tags": ["abc", "de"][: i % 3]}
                         for i in range(30)})}


def byte_level_bytes(token: str) -> bytes:
    """A byte-level BPE token (GPT-2's printable stand-ins for bytes) as its bytes."""
    if not hasattr(byte_level_bytes, "table"):
        keep = [*range(33, 127), *range(161, 173), *range(174, 256)]  # bytes shown as themselves
        rest = [b for b in range(256) if b not in keep]  # the others shift to 256, 257, ...
        byte_level_bytes.table = {chr(b): b for b in keep} | {chr(256 + k): b
                                                              for k, b in enumerate(rest)}
    return bytes(byte_level_bytes.table[c] for c in token)


class LLGuidance:
    def __init__(self, d: Path, vocab: int):
        import llguidance
        self.llg, self.text, self.vocab = llguidance, (d / "tokenizer.json").read_text(), vocab

    def tokenizer(self):
        self.tok = self.llg.LLTokenizer(self.text, n_vocab=self.vocab, eos_token=EOS)

    def compile(self, schema: str, warm: bool):
        # No cache of its own (the project lru_caches the grammar text); building the matcher
        # is where the grammar is compiled against the tokenizer.
        opts = {"whitespace_flexible": False, "item_separator": SEPARATORS[0],
                "key_separator": SEPARATORS[1]}
        g = self.llg.LLMatcher.grammar_from_json_schema(schema, defaults=opts)
        return g, self.matcher(g)

    def matcher(self, g):
        m = self.llg.LLMatcher(self.tok, g)
        assert not m.is_error(), m.get_error()
        return m

    def mask(self, m, buf): m.unsafe_compute_mask_ptr(buf.ctypes.data, buf.nbytes)  # runner's
    def advance(self, m, t): return m.consume_token(t)


class XGrammar:
    def __init__(self, d: Path, vocab: int):
        import transformers
        import xgrammar
        self.xgr, self.vocab = xgrammar, vocab
        start = time.perf_counter()
        self.hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(d / "tokenizer.json"))
        self.hf_load_ms = (time.perf_counter() - start) * 1e3

    def tokenizer(self):
        info = self.xgr.TokenizerInfo.from_huggingface(self.hf, vocab_size=self.vocab,
                                                       stop_token_ids=STOPS)
        self.compiler = self.xgr.GrammarCompiler(info, max_threads=os.cpu_count() or 1)

    def compile(self, schema: str, warm: bool):
        if not warm:
            self.compiler.clear_cache()
        g = self.compiler.compile_json_schema(schema, any_whitespace=False,
                                              separators=SEPARATORS)
        return g, self.matcher(g)

    def matcher(self, g): return self.xgr.GrammarMatcher(g)
    def mask(self, m, buf): m.fill_next_token_bitmask(buf[None])  # NumPy works, as torch
    def advance(self, m, t): return m.accept_token(t)


class OutlinesCore:
    def __init__(self, d: Path, vocab: int):
        import outlines_core
        from outlines_core.json_schema import build_regex_from_schema
        self.oc, self.to_regex = outlines_core, build_regex_from_schema
        self.model_vocab = json.loads((d / "tokenizer.json").read_text())["model"]["vocab"]

    def tokenizer(self):
        # Vocabulary.from_pretrained downloads from the hub; offline we hand it the tokens'
        # bytes. Special tokens stay out: EOS is given apart, the others are not JSON.
        tokens: dict[bytes, list[int]] = {}
        for text, i in self.model_vocab.items():
            tokens.setdefault(byte_level_bytes(text), []).append(i)
        self.vocabulary = self.oc.Vocabulary(EOS, tokens)

    def compile(self, schema: str, warm: bool):
        # The index (every DFA state x every token) is the compile; no cache. Its regex has
        # "[ ]?" between JSON tokens (no exact separators) and ignores integer/number bounds.
        g = self.oc.Index(self.to_regex(schema), self.vocabulary)
        return g, self.matcher(g)

    def matcher(self, g): return self.oc.Guide(g)
    def mask(self, m, buf): m.write_mask_into(buf.ctypes.data, buf.size, 4)  # clears it too
    def advance(self, m, t): return m.advance(t, return_tokens=False) or True  # raises if not


LIBS = {"llguidance": LLGuidance, "xgrammar": XGrammar, "outlines-core": OutlinesCore}


def ms(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def walk(lib, g, ids: list[int], walks: int, words: int) -> dict:
    """Mask and advance times (us) over `walks` walks of `ids` then EOS, each walk with a
    fresh matcher (lazy per-matcher caches count, as for a new request), checking that the
    mask allows every token."""
    buf = np.zeros(words, dtype=np.int32)
    bits, clock = buf.view(np.uint32), time.perf_counter
    steps = [[] for _ in range(len(ids) + 1)]  # mask us, by step
    advances, totals = [], []
    for _ in range(walks):
        m, t0 = lib.matcher(g), clock()
        for k, t in enumerate([*ids, EOS]):
            start = clock()
            lib.mask(m, buf)
            steps[k].append((clock() - start) * 1e6)
            if not (bits[t >> 5] >> (t & 31)) & 1:
                raise RuntimeError(f"token {t} (step {k}) not allowed by the mask")
            if t != EOS:
                start = clock()
                ok = lib.advance(m, t)
                advances.append((clock() - start) * 1e6)
                assert ok is not False, f"token {t} refused"
        totals.append((clock() - t0) * 1e3)  # the bit checks are in it too: a few us
    masks = [x for step in steps for x in step]
    p50, p99 = np.percentile(masks, [50, 99])
    return {"tokens": len(ids), "mask_p50_us": p50, "mask_p99_us": p99, "mask_max_us": max(masks),
            "advance_p50_us": statistics.median(advances),
            "walk_ms": f"{totals[0]:.3g} / {statistics.median(totals[1:] or totals):.3g}",
            "mask_by_step_us": [statistics.median(x) for x in steps]}


def bench(name: str, d: Path, vocab: int, reps: int, walks: int, ids: dict) -> dict:
    lib = LIBS[name](d, vocab)
    out = {"tokenizer_ms": spread([ms(lib.tokenizer) for _ in range(reps)])}
    if hasattr(lib, "hf_load_ms"):
        out["hf_tokenizer_load_ms"] = lib.hf_load_ms
    for label, (schema, _) in SCHEMAS.items():
        text = json.dumps(schema)
        out[f"compile_{label}_cold_ms"] = spread([ms(lambda: lib.compile(text, False))
                                                  for _ in range(reps)])
        if name == "xgrammar":  # the only one with a compile cache
            out[f"compile_{label}_warm_ms"] = spread([ms(lambda: lib.compile(text, True))
                                                      for _ in range(reps)])
        g, _ = lib.compile(text, True)
        out[f"walk_{label}"] = walk(lib, g, ids[label], walks, (vocab + 31) // 32)
    return out


def table(results: dict, ids: dict) -> str:
    rows = [("tokenizer build, ms", "tokenizer_ms", None)]
    for s in SCHEMAS:
        rows += [(f"{s}: compile cold, ms", f"compile_{s}_cold_ms", None),
                 (f"{s}: compile warm, ms", f"compile_{s}_warm_ms", None)]
        rows += [(f"{s} ({len(ids[s])} tok): {what}", f"walk_{s}", key) for key, what in (
            ("mask_p50_us", "mask p50, us"), ("mask_p99_us", "mask p99, us"),
            ("mask_max_us", "mask max, us"), ("advance_p50_us", "advance p50, us"),
            ("walk_ms", "walk 1st / later, ms"))]

    def cell(r: dict, key: str, sub: str | None) -> str:
        v = r.get(key, "(no cache)") if "error" not in r else "failed"
        v = v[sub] if sub and isinstance(v, dict) else v
        if isinstance(v, dict):
            return f"{v['median']:.3g} ({v['min']:.3g}-{v['max']:.3g})"
        return v if isinstance(v, str) else f"{v:.3g}"

    width = max(len(label) for label, _, _ in rows)
    lines = [" | ".join([" " * width] + [f"{n:<26}" for n in results])]
    lines += [" | ".join([f"{label:<{width}}"] + [f"{cell(r, key, sub):<26}"
                                                  for r in results.values()])
              for label, key, sub in rows]
    return "\n".join(lines)


def main():
    models = os.path.expanduser("~/.cache/mlx-actor-serve/models/qwen3-*/tokenizer.json")
    found = sorted(glob.glob(models))
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokenizer-dir", default=str(Path(found[0]).parent) if found else None)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--walks", type=int, default=20)
    p.add_argument("--libs", nargs="+", default=list(LIBS), choices=list(LIBS))
    a = p.parse_args()
    if not a.tokenizer_dir:
        p.error("no qwen3-* model in ~/.cache/mlx-actor-serve/models: give --tokenizer-dir")
    d = Path(a.tokenizer_dir)
    config = d / "config.json"
    vocab = json.loads(config.read_text()).get("vocab_size", 151936) if config.exists() else 151936
    # The instances tokenized as a model would write them (BPE, no special tokens).
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    ids = {k: tok.encode(json.dumps(v, separators=SEPARATORS), add_special_tokens=False).ids
           for k, (_, v) in SCHEMAS.items()}
    print(f"tokenizer {d} (vocab {vocab}), {os.cpu_count()} CPUs, reps {a.reps}, walks {a.walks}")
    results = {}
    for name in a.libs:
        try:
            results[name] = bench(name, d, vocab, a.reps, a.walks, ids)
        except ImportError as e:
            print(f"skipping {name}: not importable ({e})")
        except Exception as e:  # a library refusing a schema or a token: say so, go on
            print(f"{name} failed: {type(e).__name__}: {e}")
            results[name] = {"error": f"{type(e).__name__}: {e}"}
    if results:
        print(table(results, ids))
        if "hf_tokenizer_load_ms" in results.get("xgrammar", {}):
            print(f"(xgrammar's input, not in its tokenizer build: HF tokenizer load "
                  f"{results['xgrammar']['hf_tokenizer_load_ms']:.0f} ms)")
    if a.json:
        Path(a.json).write_text(json.dumps({"tokenizer_dir": str(d), "vocab": vocab,
                                            "results": results}, indent=1, default=float))


if __name__ == "__main__":
    main()
