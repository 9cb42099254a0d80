"""Constrained decoding, the runner's side: the llguidance tokenizer of the served
model, one matcher per constrained row, and a step's allowed-token masks applied to the batch's
logits in MLX. What a constraint is and how it compiles: actors/constraints.py.

llguidance over xgrammar and outlines-core (benchmarks/kernels/grammar_libs.py on this CPU,
Qwen's 151,936-token vocabulary): it compiles a schema in 0.3-4.5 ms where outlines-core takes
0.2-3 s (and drops integer bounds) and xgrammar 13-94 ms cold; its masks take 11-16 us where
the others take ~1-2 us, which is small beside a step of tens of ms; and it needs no torch
(xgrammar imports it: a 5 GB install here).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path
from typing import Callable, Sequence

import llguidance
import mlx.core as mx
import numpy as np

from actors.constraints import GrammarError
from actors.model_runner.pipeline import before_host_sync


class Grammars:
    """The tokenizer llguidance masks with (built once: ~1 s for Qwen's vocabulary) and the
    matchers of constrained rows."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_id: int):
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size,
                                                eos_token=eos_id)

    def matcher(self, grammar: str) -> llguidance.LLMatcher:
        """A matcher at the start of a compiled grammar (constraints.compile_constraint)."""
        m = llguidance.LLMatcher(self.tokenizer, grammar)
        if m.is_error():
            raise GrammarError(f"grammar refused: {m.get_error()}")
        return m

    def masks(self, matchers: list[llguidance.LLMatcher],
              ends: Sequence[Sequence[int]] = ()) -> np.ndarray:
        """[len(matchers), words] int32: bit t of a row set where token t is allowed next.
        ends[k]: the ids that end row k (its EOS ids and stop_token_ids), allowed wherever
        the grammar allows its one EOS: the text may end there. A matcher in error (it
        cannot be, when every token came through its masks) lets the row end, nothing else."""
        words = (self.vocab_size + 31) // 32
        out = np.zeros((len(matchers), words), dtype=np.int32)
        eos = self.tokenizer.eos_token
        flat = out.view(np.uint32)
        for k, m in enumerate(matchers):
            row = out[k]
            if m.is_error():
                _set(flat[k], eos)
            else:
                m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
            if ends and (flat[k, eos // 32] >> (eos % 32)) & 1:
                for t in ends[k]:
                    _set(flat[k], t)
        return out


def _set(words: np.ndarray, token: int) -> None:
    words[token // 32] |= np.uint32(1 << (token % 32))


@lru_cache(maxsize=4)
def grammars_for(model_dir: str, vocab_size: int, eos_id: int) -> Grammars:
    """One Grammars per served tokenizer and process: a runner rebuilt after a failed step
    keeps it (the tokenizer takes ~1 s to build)."""
    return Grammars((Path(model_dir) / "tokenizer.json").read_text(), vocab_size, eos_id)


class RowMatchers:
    """The sampler's constrained rows: one matcher each, made off the MLX thread, and the
    token each row drew last, not read back yet.

    A row's next mask depends on the token it drew in the step before; with overlap that
    token is a future when the next step is built. next_masks() waits where the pipeline
    reads the last step back anyway (before_host_sync), so a constrained step costs that
    overlap and the masks' own microseconds, and a step without constrained rows nothing."""

    def __init__(self, load: Callable[[], Grammars]):
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self._load = load
        # The tokenizer is built (~1 s, in the background) at the first constrained row, not
        # here: it holds ~240 MB (qwen3-small's vocabulary), which a server that never sees a
        # constrained request should not pay (the 4-bit runner's RSS went from 0.65x to 0.72x
        # of float32's while it was built at start).
        self._grammars: Future | None = None
        self.matchers: dict[int, Future | llguidance.LLMatcher] = {}
        self.unread: dict[int, tuple[mx.array, int]] = {}

    def admit(self, row: int, grammar: str, output: Sequence[int] = ()) -> None:
        """A matcher for the row, advanced over what it generated already (a resumed row)."""
        self.release(row)
        if self._grammars is None:
            self._grammars = self._pool.submit(self._load)
        self.matchers[row] = self._pool.submit(self._make, grammar, list(output))

    def _make(self, grammar: str, output: list[int]) -> llguidance.LLMatcher:
        m = self._grammars.result().matcher(grammar)
        for t in output:
            m.consume_token(t)
        return m

    def release(self, row: int) -> None:
        self.matchers.pop(row, None)
        self.unread.pop(row, None)

    def drew(self, rows: Sequence[int], tokens: mx.array) -> None:
        """Sampled rows' tokens (lazy, [len(rows)]); the constrained ones are read later."""
        if not self.matchers:  # every full-path sample passes here
            return
        for i, row in enumerate(rows):
            if row in self.matchers:
                self.unread[row] = (tokens, i)

    def next_masks(self, rows: Sequence[int], ends: Sequence[Sequence[int]]) -> np.ndarray:
        """The bit masks of `rows` (all constrained) for the token each draws next."""
        if any(r in self.unread for r in rows):
            before_host_sync()  # the last step is read back first: its tokens are ready
        values: dict[int, list[int]] = {}
        matchers = []
        for row in rows:
            m = self.matchers[row]
            if isinstance(m, Future):
                m = self.matchers[row] = m.result()
            if row in self.unread:
                tokens, i = self.unread.pop(row)
                got = values.get(id(tokens))
                if got is None:
                    got = values[id(tokens)] = tokens.tolist()
                if not m.is_stopped():  # stopped: only an end was allowed, and it came
                    m.consume_token(got[i])
            matchers.append(m)
        return self._grammars.result().masks(matchers, ends)


def _keep(bitmask: np.ndarray, vocab: int) -> np.ndarray:
    """uint8 [rows, vocab]: 1 where the masks allow the token (bit t of word t // 32)."""
    return np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :vocab]


def allowed(bitmask: np.ndarray, vocab: int) -> mx.array:
    """The bit masks as a [rows, vocab] bool array."""
    return mx.array(_keep(bitmask, vocab)).astype(mx.bool_)


def apply_masks(logits: mx.array, bitmask: np.ndarray) -> mx.array:
    """logits [rows, vocab] with every token the masks forbid at -inf. Unpacked by NumPy and
    added, not selected: MLX's CPU `where` over [8, 151936] took 4.8 ms, a gather of the
    words 16 ms, this 1.4 ms. (keep - 1) * 3e38 * 10 is 0 or overflows to exactly -inf."""
    keep = mx.array(_keep(bitmask, logits.shape[-1])).astype(mx.float32)
    return logits + ((keep - 1.0) * 3e38 * 10).astype(logits.dtype)
