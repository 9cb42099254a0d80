"""The correctness oracle: mlx-lm itself, on the same model directory and prompt ids."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm import stream_generate
from mlx_lm.utils import load_model, load_tokenizer

NEAR_TIE = 1e-4

# mlx_lm.load's tokenizer, one per distinct set of tokenizer files, EOS ids and model type
# for the whole test run: transformers takes ~1.6 s to build a 151k-rank BPE tokenizer, far
# more than loading a test model, and the suite builds dozens of oracles over a few bases.
_tokenizers: dict[str, Any] = {}


def _tokenizer(path: Path, config: dict[str, Any]) -> Any:
    """What mlx_lm.load(path) pairs with the model: load_tokenizer with the config's EOS."""
    h = hashlib.sha256(json.dumps([config.get("model_type"), config.get("eos_token_id")],
                                  sort_keys=True).encode())
    for f in sorted(path.iterdir()):  # what load_tokenizer reads (weights and config aside)
        if (f.is_file() and f.name not in ("config.json", "model.safetensors.index.json")
                and f.suffix in (".json", ".jsonl", ".jinja", ".txt", ".tiktoken", ".model")):
            h.update(f.name.encode() + b"\0" + f.read_bytes())
    key = h.hexdigest()
    if key not in _tokenizers:
        _tokenizers[key] = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    return _tokenizers[key]


# Loaded models and greedy continuations, for the whole test run: many test modules ask the
# same model for the same prompts (each mode of a matrix, each module its own oracle), and
# greedy decoding is deterministic. Keyed by the model folder (built-ins are named by a hash
# of their spec) and upcast.
_models: dict[tuple[str, bool], tuple[Any, Any]] = {}
# (model, prompt) -> (max_tokens of the longest run asked so far, its tokens)
_greedy: dict[tuple[str, bool, tuple[int, ...]], tuple[int, list[int]]] = {}


class Oracle:
    def __init__(self, path: str, upcast: bool = False):
        """upcast: the checkpoint's floating parameters in float32 (scales of quantized ones
        too), the oracle of runtime.activations = "float32"."""
        self.key = (str(Path(path).resolve()), upcast)
        if self.key not in _models:
            model, config = load_model(Path(path))
            if upcast:
                model.set_dtype(mx.float32)
            _models[self.key] = model, _tokenizer(Path(path), config)
        self.model, self.tokenizer = _models[self.key]

    def greedy(self, prompt_ids: list[int], max_tokens: int) -> list[int]:
        """mlx_lm's greedy token ids, EOS included when it stops there. A longer run for the
        same prompt answers a shorter one: greedy decoding's first n tokens do not depend on
        how many follow."""
        key = (*self.key, tuple(prompt_ids))
        if _greedy.get(key, (-1,))[0] < max_tokens:
            _greedy[key] = max_tokens, [r.token for r in stream_generate(
                self.model, self.tokenizer, mx.array(prompt_ids), max_tokens=max_tokens)]
        return _greedy[key][1][:max_tokens]

    def top2(self, ids: list[int]) -> tuple[list[int], float]:
        """The two best next tokens after `ids` and their logit gap."""
        logits = self.model(mx.array(ids)[None])[0, -1].astype(mx.float32)
        order = mx.argsort(-logits)[:2].tolist()
        return order, float(logits[order[0]] - logits[order[1]])

    def prompt_logprobs(self, ids: list[int]) -> tuple[list[float], list[int]]:
        """mlx-lm's own log_softmax over the prompt in one forward: each position's token's
        logprob given the tokens before it (from position 1), and the argmax before each."""
        logits = self.model(mx.array(ids)[None])[0].astype(mx.float32)
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        chosen = mx.take_along_axis(lp[:-1], mx.array(ids[1:])[:, None], axis=-1)[:, 0]
        return chosen.tolist(), mx.argmax(lp[:-1], axis=-1).tolist()

    def check(self, prompt_ids: list[int], got: list[int], ref: list[int]) -> None:
        """got must equal ref; where they first differ, the reference must be at a near-tie
        (top-2 gap below 1e-4) and `got` must have taken the other of the two."""
        if got == ref:
            return
        i = next((k for k, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
        if i == len(got) or i == len(ref):
            raise AssertionError(f"length differs: got {len(got)} tokens, mlx-lm {len(ref)}\n"
                                 f"got {got}\nref {ref}")
        best, gap = self.top2(prompt_ids + ref[:i])
        assert gap < NEAR_TIE and set(best) == {got[i], ref[i]}, (
            f"token {i} differs: got {got[i]}, mlx-lm {ref[i]}, top-2 {best} gap {gap:.3g}")
