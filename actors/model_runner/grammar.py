"""Constrained decoding (issue L): a request's constraint (a JSON schema, any JSON object, a
regex, a Lark/EBNF grammar) compiled by llguidance for this model's tokenizer, one matcher per
constrained row, and a step's allowed-token masks applied to the batch's logits in MLX.

llguidance over xgrammar and outlines-core: it reads the tokenizer.json we ship, needs no torch,
and on this CPU builds Qwen's 151,936-token tokenizer once (~1 s), compiles a JSON schema in ~1
ms and computes a row's next mask in 5-200 us (`benchmarks/kernels`-style numbers in the L note).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache

import llguidance
import mlx.core as mx
import numpy as np

KINDS = ("json_schema", "json_object", "regex", "lark")


class GrammarError(ValueError):
    """A constraint the grammar library refuses, with its reason."""


@dataclass(frozen=True)
class Constraint:
    kind: str  # one of KINDS
    source: str  # the schema (JSON text), the regex or the grammar; "" for json_object


# No free whitespace between JSON tokens (a schema's "x-guidance" may ask for it): a model that
# likes spaces, or a random one, would otherwise pad forever; separators as json.dumps writes.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _grammar(kind: str, source: str) -> str:
    if kind == "json_schema":
        try:
            json.loads(source)
        except ValueError as e:
            raise GrammarError(f"json_schema is not JSON: {e}") from None
        return llguidance.LLMatcher.grammar_from_json_schema(source, defaults=JSON_OPTIONS)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}',
                                                             defaults=JSON_OPTIONS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(source)
    if kind == "lark":
        return llguidance.LLMatcher.grammar_from_lark(source)
    raise GrammarError(f"unknown constraint kind {kind!r} (one of {', '.join(KINDS)})")


@lru_cache(maxsize=256)
def compile_constraint(kind: str, source: str) -> str:
    """The llguidance grammar of a constraint, checked; cached by (kind, source). GrammarError
    names what the library refused."""
    try:
        grammar = _grammar(kind, source)
    except GrammarError:
        raise
    except ValueError as e:  # a schema that is not a JSON object
        raise GrammarError(f"{kind} refused: {e}") from None
    message = llguidance.LLMatcher.validate_grammar(grammar, None)
    if message and not message.startswith("WARNING"):
        raise GrammarError(f"{kind} refused: {message}")
    return grammar


class Grammars:
    """The tokenizer llguidance masks with (built once: ~1 s for Qwen's vocabulary) and the
    matchers of constrained rows."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_id: int):
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size,
                                                eos_token=eos_id)

    def matcher(self, constraint: Constraint) -> llguidance.LLMatcher:
        m = llguidance.LLMatcher(self.tokenizer,
                                 compile_constraint(constraint.kind, constraint.source))
        if m.is_error():
            raise GrammarError(f"{constraint.kind} refused: {m.get_error()}")
        return m

    def masks(self, matchers: list[llguidance.LLMatcher]) -> np.ndarray:
        """[len(matchers), words] int32: bit t of a row set where token t is allowed next."""
        words = (self.vocab_size + 31) // 32
        out = np.zeros((len(matchers), words), dtype=np.int32)
        for k, m in enumerate(matchers):
            row = out[k]
            m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        return out


def allowed(bitmask: np.ndarray, vocab: int) -> mx.array:
    """The bit masks as a [rows, vocab] bool array (bit t of word t // 32)."""
    words = mx.array(bitmask.view(np.uint32))
    ids = mx.arange(vocab, dtype=mx.uint32)
    bits = mx.right_shift(words[:, ids // 32], ids % 32)
    return (bits & 1).astype(mx.bool_)


def apply_masks(logits: mx.array, bitmask: np.ndarray) -> mx.array:
    """logits [rows, vocab] with every token the masks forbid at -inf."""
    keep = allowed(bitmask, logits.shape[-1])
    return mx.where(keep, logits, mx.array(-mx.inf, dtype=logits.dtype))
