"""Per-request token selection for a batch of rows, vectorized in MLX.

`Sampler.sample(rows, logits)` applies, per row and in this order:
1. penalties over the row's history: repetition first (HF: over prompt + generated tokens, a
   positive logit is divided by p, a negative one multiplied), then frequency and presence
   (OpenAI: generated tokens only, `logit -= f * count + p * (count > 0)`);
2. logit_bias, added;
3. stop_ids at -inf while fewer than min_new_tokens tokens were generated; a constrained row
   (a JSON schema, a regex, a grammar: grammar.py) instead gets every token its grammar forbids
   at -inf (its stop ids only where the grammar may end: the grammar decides when it ends);
4. greedy rows (temperature 0) take the argmax. Sampled rows are divided by their temperature,
   then filtered (filters.py): top_k, top_p (on the top_k-renormalized distribution), min_p;
   then one exact sample from the softmax of what is left: a Gumbel-max draw (noise over the
   whole vocabulary). Inside kernel_draws() (the runner's CPU steps) the compiled kernels do
   both instead: each row's filters as one threshold found in a histogram of its values, and
   its draw from one uniform (on the CPU MLX's Gumbel noise is scalar code, 26 ms a step at 16
   rows of 151,936 tokens, and top_p's sort and logsumexp ~57 ms; the kernels 1.6 and ~3 ms).
The chosen token joins the row's history, so the next call sees it.

Where every row of a step is greedy() (plain greedy rows, and greedy rows whose only rule is
their grammar's mask), the runner's greedy head finds the tokens without the logits
(cpu/greedy_head.py; the masks from greedy_masks()) and launch_tokens() records them.

Logprobs are the model's raw distribution, vLLM's default: log_softmax of the logits exactly as
passed in, before every step above, so they do not depend on the sampling parameters.

Seeds: a seeded row's i-th generated token uses Gumbel noise from `row_key(seed, i)` alone, so it
is the same whatever rows share the batch, in any order, at any step.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Sequence

import mlx.core as mx
import numpy as np

from actors.model_runner.filters import apply_filters
from actors.model_runner.grammar import RowMatchers, apply_masks
from actors.model_runner.thread_flag import ThreadFlag

MAX_TOP_LOGPROBS = 20
# The compiled kernels, inside kernel_draws() (the runner's CPU steps).
_kernels: ThreadFlag = ThreadFlag(None)
_U64 = (1 << 64) - 1


@dataclass(frozen=True)
class RowParams:
    temperature: float = 0.0  # 0 = greedy (argmax)
    top_p: float = 1.0  # nucleus: smallest set with cumulative prob >= top_p
    top_k: int = 0  # 0 = off
    min_p: float = 0.0  # drop tokens with prob < min_p * max prob
    repetition_penalty: float = 1.0  # HF, over prompt + generated tokens
    frequency_penalty: float = 0.0  # OpenAI, over generated tokens only
    presence_penalty: float = 0.0  # OpenAI, over generated tokens only
    logit_bias: tuple[tuple[int, float], ...] = ()
    seed: int = -1  # >= 0: reproducible draws
    min_new_tokens: int = 0  # until reached, stop_ids get -inf
    stop_ids: tuple[int, ...] = ()
    top_logprobs: int = 0  # 0..20 alternatives to report
    logprobs: bool = False  # report the chosen token's logprob
    constraint: str | None = None  # a compiled grammar the output must match (grammar.py)


@dataclass
class Sampled:
    tokens: list[int]
    logprobs: list[float] | None  # raw log_softmax at the chosen id, every row; None: none asked
    top_ids: list[list[int]] | None  # per row, its top_logprobs best ids, best first
    top_logprobs: list[list[float]] | None


@dataclass
class Pending:
    """A sample not read back yet: lazy MLX arrays, so the caller can queue more work behind
    them (the runner builds its next step first) before resolve() waits for the values."""

    tokens: mx.array  # int32 [rows]
    logprobs: mx.array | None = None  # [rows]
    top_ids: mx.array | None = None  # [rows, kmax], best first
    top_logprobs: mx.array | None = None
    keep: list[int] | None = None  # per row, how many of the top alternatives it asked for

    def arrays(self) -> list[mx.array]:
        return [a for a in (self.tokens, self.logprobs, self.top_ids, self.top_logprobs)
                if a is not None]

    def resolve(self) -> Sampled:
        mx.eval(self.arrays())
        chosen = self.logprobs.tolist() if self.logprobs is not None else None
        top_ids = top_lps = None
        if self.top_ids is not None:
            ids, vals = self.top_ids.tolist(), self.top_logprobs.tolist()
            top_ids = [row[:k] for row, k in zip(ids, self.keep)]
            top_lps = [row[:k] for row, k in zip(vals, self.keep)]
        return Sampled(self.tokens.tolist(), chosen, top_ids, top_lps)


@contextmanager
def kernel_draws(kernels) -> Iterator[None]:
    """Greedy rows' argmax and sampled rows' filters and draw by `kernels` (argmax,
    filter_floor, categorical) on this thread inside the block (None: MLX's argmax,
    filters.py and the Gumbel-max)."""
    with _kernels.holding(kernels):
        yield


def _argmax(x: mx.array) -> mx.array:
    """mx.argmax(x, axis=-1), through the kernel inside kernel_draws() (MLX's is scalar code
    on the CPU: 2.2 ms over 16 rows of 151,936; a bf16 row's float32 copy has its order)."""
    kernels = _kernels.get()
    if kernels is None:
        return mx.argmax(x, axis=-1)
    return kernels.argmax(x if x.dtype == mx.float32 else x.astype(mx.float32))


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _U64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _U64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _U64
    return x ^ (x >> 31)


def row_key(seed: int, index: int) -> mx.array:
    """The PRNG key of a seeded row's `index`-th generated token. MLX has no fold_in and splitting
    a key `index` times costs O(index) per step, so (seed, index) is hashed (splitmix64, a
    bijection) into the 64-bit seed of a fresh threefry key."""
    return mx.random.key(_splitmix64(_splitmix64(seed & _U64) ^ index))


def _check(params: RowParams, vocab: int) -> None:
    p = params
    ids = [i for i, _ in p.logit_bias] + list(p.stop_ids)
    problems = [
        (p.temperature < 0, "temperature < 0"), (not 0 < p.top_p <= 1, "top_p not in (0, 1]"),
        (p.top_k < 0, "top_k < 0"), (not 0 <= p.min_p <= 1, "min_p not in [0, 1]"),
        (p.repetition_penalty <= 0, "repetition_penalty <= 0"),
        (not 0 <= p.top_logprobs <= MAX_TOP_LOGPROBS, "top_logprobs not in [0, 20]"),
        (any(not 0 <= i < vocab for i in ids), "token id outside the vocabulary"),
    ]
    bad = [why for failed, why in problems if failed]
    if bad:
        raise ValueError(f"bad sampling params: {', '.join(bad)}")


class Sampler:
    """Per-row params and history for request-pool rows 0..max_rows (the runner's row 0 is
    padding). Rows in one `sample` call are distinct."""

    def __init__(self, vocab_size: int, max_rows: int, seed: int | None = None,
                 grammar: RowMatchers | None = None):
        self.vocab = vocab_size
        self.grammar = grammar  # None: constraints are refused (no tokenizer to mask with)
        self.params: dict[int, RowParams] = {}
        n = max_rows + 1
        # numpy columns make the per-call fast-path test a few vectorized lookups.
        self.live = np.zeros(n, bool)
        self.plain = np.zeros(n, bool)  # greedy, no penalty, no bias, no logprobs
        # Greedy and constrained, nothing else: the argmax over what the grammar allows, which
        # the greedy head finds from the masks without the logits.
        self.masked = np.zeros(n, bool)
        self.generated = np.zeros(n, np.int64)  # tokens generated so far
        self.mask_until = np.zeros(n, np.int64)  # stop_ids masked while generated < this
        # Dense histories only for rows with a penalty: [V] float32 counts of generated tokens,
        # and [V] bool prompt tokens where the repetition penalty is on.
        self.counts: dict[int, mx.array] = {}
        self.prompt_seen: dict[int, mx.array] = {}
        # Unseeded rows draw from this key, advanced every call (reproducible only in tests).
        if seed is None:
            seed = int.from_bytes(os.urandom(8), "little")
        self.key = mx.random.key(seed)
        self.full_calls = 0  # calls that took the full path (tests check the fast path)

    def admit(self, row: int, params: RowParams, prompt: Sequence[int],
              output: Sequence[int] = ()) -> None:
        """(Re)set the row. `output`: tokens it already generated (a resumed request), so its
        penalties, min_new_tokens and seeded draws go on where they stopped."""
        _check(params, self.vocab)
        p = params
        if p.constraint is not None:
            if self.grammar is None:
                raise ValueError("a constrained row, and no tokenizer to build its grammar with")
            self.grammar.admit(row, p.constraint, output)
        elif self.grammar is not None:
            self.grammar.release(row)
        penalized = p.repetition_penalty != 1 or p.frequency_penalty or p.presence_penalty
        self.params[row] = p
        self.live[row] = True
        greedy = not (p.temperature > 0 or penalized or p.logit_bias or p.logprobs
                      or p.top_logprobs)
        self.plain[row] = greedy and p.constraint is None
        self.masked[row] = greedy and p.constraint is not None
        self.generated[row] = len(output)
        self.mask_until[row] = p.min_new_tokens if p.stop_ids else 0
        self.counts.pop(row, None)
        self.prompt_seen.pop(row, None)
        if penalized:
            out = np.asarray(output, np.int64)
            self.counts[row] = mx.array(np.bincount(out, minlength=self.vocab).astype(np.float32))
            if p.repetition_penalty != 1:
                seen = np.zeros(self.vocab, bool)
                seen[np.asarray(prompt, np.int64)] = True
                self.prompt_seen[row] = mx.array(seen)

    def release(self, row: int) -> None:
        self.params.pop(row, None)
        self.counts.pop(row, None)
        self.prompt_seen.pop(row, None)
        self.live[row] = False
        if self.grammar is not None:
            self.grammar.release(row)

    def sample(self, rows: list[int], logits: mx.array) -> Sampled:
        """logits [len(rows), V] for those rows, in that order."""
        return self.launch(rows, logits).resolve()

    def launch(self, rows: list[int], logits: mx.array) -> Pending:
        """sample() without reading the values back. The rows' histories advance now, so
        the next launch for them may come before this one is resolved."""
        idx = self._admitted(rows)
        if logits.shape != (len(rows), self.vocab):
            raise ValueError(f"logits {logits.shape} for {len(rows)} rows x {self.vocab}")
        if self._plain(idx):
            self.generated[idx] += 1  # plain greedy: one argmax, no copies
            return Pending(_argmax(logits).astype(mx.int32))
        return self._sample_full(rows, idx, logits)

    def plain_greedy(self, rows: list[int]) -> bool:
        """Whether every row's next token is the argmax of the raw logits (greedy, no
        penalty, bias, logprobs or masked stop ids): then the logits themselves are not
        needed, only their argmax."""
        return self._plain(np.asarray(rows, np.int64))

    def _plain(self, idx: np.ndarray) -> bool:
        return bool(self.live[idx].all() and self.plain[idx].all()
                    and (self.generated[idx] >= self.mask_until[idx]).all())

    def greedy(self, rows: list[int]) -> bool:
        """Whether every row's next token is an argmax the greedy head can find: plain greedy
        rows, and greedy rows whose only rule is their grammar's mask (greedy_masks())."""
        idx = np.asarray(rows, np.int64)
        return bool(self.live[idx].all() and (self.masked[idx] | (
            self.plain[idx] & (self.generated[idx] >= self.mask_until[idx]))).all())

    def greedy_masks(self, rows: list[int]) -> np.ndarray | None:
        """uint32 [len(rows), words] bit masks of the tokens each row may draw next (all for
        unconstrained rows), or None where no row is constrained. Reads the constrained rows'
        last tokens into their matchers (once per step, as process() does)."""
        held = np.flatnonzero(self.masked[np.asarray(rows, np.int64)])  # every greedy step
        if not held.size:
            return None
        bits = self.grammar.next_masks([rows[i] for i in held],
                                       [self.params[rows[i]].stop_ids for i in held])
        out = np.full((len(rows), bits.shape[1]), 0xFFFFFFFF, np.uint32)
        out[held] = bits.view(np.uint32)
        return out

    def launch_tokens(self, rows: list[int], tokens: mx.array) -> Pending:
        """The rows' argmax tokens (int32 [len(rows)]) found without their logits, for rows
        that are greedy() (constrained ones: over their masks); their histories advance as in
        launch()."""
        idx = self._admitted(rows)
        if not self.greedy(rows):
            raise ValueError(f"rows {rows} are not all greedy")
        if tokens.shape != (len(rows),):
            raise ValueError(f"tokens {tokens.shape} for {len(rows)} rows")
        tokens = tokens.astype(mx.int32)
        self.generated[idx] += 1
        if self.grammar is not None:
            self.grammar.drew(rows, tokens)
        return Pending(tokens)

    def _admitted(self, rows: list[int]) -> np.ndarray:
        idx = np.asarray(rows, np.int64)
        if not self.live[idx].all():
            raise KeyError(f"rows {[r for r in rows if not self.live[r]]} were not admitted")
        return idx

    def process(self, rows: list[int], logits: mx.array) -> mx.array:
        """Steps 1-3 of the module docstring from the rows' current history: float32 logits
        [n, V] before temperature. Changes nothing but the constrained rows' matchers, which read
        the token each drew last."""
        x = logits.astype(mx.float32)
        ps = [self.params[r] for r in rows]
        pen = [i for i, r in enumerate(rows) if r in self.counts]
        if pen:
            at = mx.array(pen)
            sub = x[at]
            counts = mx.stack([self.counts[rows[i]] for i in pen])
            seen = counts > 0
            if any(rows[i] in self.prompt_seen for i in pen):
                none = mx.zeros((self.vocab,), mx.bool_)
                seen = seen | mx.stack([self.prompt_seen.get(rows[i], none) for i in pen])
            rep, freq, pres = (_col([getattr(ps[i], f) for i in pen]) for f in
                               ("repetition_penalty", "frequency_penalty", "presence_penalty"))
            sub = mx.where(seen, mx.where(sub > 0, sub / rep, sub * rep), sub)
            sub = sub - freq * counts - pres * (counts > 0)
            x[at] = sub
        bias = [(i, t, v) for i, p in enumerate(ps) for t, v in p.logit_bias]
        if bias:
            r, t, v = zip(*bias)
            x = x.at[mx.array(r), mx.array(t)].add(mx.array(v, mx.float32))
        masked = [(i, t) for i, (row, p) in enumerate(zip(rows, ps))
                  if self.generated[row] < self.mask_until[row] and p.constraint is None
                  for t in p.stop_ids]
        if masked:
            r, t = zip(*masked)
            x[mx.array(r), mx.array(t)] = -mx.inf
        held = [i for i, p in enumerate(ps) if p.constraint is not None]
        if held:
            bits = self.grammar.next_masks([rows[i] for i in held],
                                           [ps[i].stop_ids for i in held])
            if len(held) == len(rows):
                x = apply_masks(x, bits)
            else:
                at = mx.array(held)
                x[at] = apply_masks(x[at], bits)
        return x

    def _sample_full(self, rows: list[int], idx: np.ndarray, logits: mx.array) -> Pending:
        self.full_calls += 1
        ps = [self.params[r] for r in rows]
        x = self.process(rows, logits)
        drawn = [i for i, p in enumerate(ps) if p.temperature > 0]
        # The greedy rows' argmax (the filters never drop the max: greedy = argmax here); a
        # step whose rows are all drawn takes none (2 ms over 16 rows of 151,936 on the CPU).
        tokens = _argmax(x) if len(drawn) < len(rows) else None
        if drawn:
            at = mx.array(drawn)
            xs = (x if tokens is None else x[at]) / _col([ps[i].temperature for i in drawn])
            picked = self._draw([rows[i] for i in drawn], [ps[i] for i in drawn], xs)
            if tokens is None:
                tokens = picked
            else:
                tokens[at] = picked
        tokens = tokens.astype(mx.int32)
        out = Pending(tokens)
        kmax = min(max(p.top_logprobs for p in ps), self.vocab)
        if any(p.logprobs or p.top_logprobs for p in ps):
            out.logprobs, out.top_ids, out.top_logprobs = score(logits, tokens, kmax)
            out.keep = [p.top_logprobs for p in ps] if kmax else None
        self._record(rows, idx, tokens)
        return out

    def _draw(self, rows: list[int], ps: list[RowParams], xs: mx.array) -> mx.array:
        """One token per row of xs (the drawn rows' tempered logits) from the softmax of what
        its filters keep: through the compiled kernels inside kernel_draws() (a threshold per
        row, one uniform per row), else filters.py and the Gumbel-max of xs plus noise over
        the whole vocabulary."""
        # Past the vocabulary top_k is off: clipped there, a huge one cannot wrap in int32.
        top_k = np.minimum(np.array([p.top_k for p in ps], np.int64), self.vocab)
        top_p = np.array([p.top_p for p in ps], np.float32)
        min_p = np.array([p.min_p for p in ps], np.float32)
        kernels = _kernels.get()
        if kernels is None:
            xs = apply_filters(xs, top_k, top_p, min_p)
            noise = self._random(rows, ps, (self.vocab,),
                                 lambda shape, key: mx.random.gumbel(shape, key=key))
            return mx.argmax(xs + noise, axis=-1)
        xs = xs.astype(mx.float32)
        floor = None
        if (top_k > 0).any() or (top_p < 1).any() or (min_p > 0).any():
            with np.errstate(divide="ignore"):
                log_min_p = np.log(min_p)  # log 0 = -inf: off
            floor = kernels.filter_floor(xs, mx.array(top_k.astype(np.int32)), mx.array(top_p),
                                         mx.array(log_min_p))
        u = self._random(rows, ps, (), lambda shape, key: mx.random.uniform(shape=shape, key=key))
        return kernels.categorical(xs, u, floor)

    def _random(self, rows: list[int], ps: list[RowParams], shape: tuple[int, ...],
                draw) -> mx.array:
        """draw((n, *shape), key): one row per drawn row, in order. Seeded rows each draw
        from their own key; the others share one draw from the advancing key."""
        free = [i for i, p in enumerate(ps) if p.seed < 0]
        seeded = [i for i, p in enumerate(ps) if p.seed >= 0]
        parts = []
        if free:
            self.key, sub = mx.random.split(self.key)
            parts.append(draw((len(free), *shape), sub))
        parts += [draw((1, *shape), row_key(ps[i].seed, int(self.generated[rows[i]])))
                  for i in seeded]
        got = parts[0] if len(parts) == 1 else mx.concatenate(parts)
        order = free + seeded  # row j of got belongs to drawn row order[j]
        if order != sorted(order):
            got = got[mx.array(np.argsort(order))]
        return got

    def _record(self, rows: list[int], idx: np.ndarray, tokens: mx.array) -> None:
        self.generated[idx] += 1
        if self.grammar is not None:
            self.grammar.drew(rows, tokens)
        for i, row in enumerate(rows):
            if row in self.counts:  # lazily: the token is not read back here
                self.counts[row] = self.counts[row].at[tokens[i]].add(1.0)


def score(logits: mx.array, chosen: mx.array,
          k: int) -> tuple[mx.array, mx.array | None, mx.array | None]:
    """The raw log_softmax of logits [n, V] at each row's chosen id, and its k best ids and
    logprobs, best first (None, None when k is 0). Generated tokens and prompt tokens are
    scored by this same code."""
    raw = logits.astype(mx.float32)
    lp = raw - mx.logsumexp(raw, axis=-1, keepdims=True)
    chosen_lp = mx.take_along_axis(lp, chosen.astype(mx.int32)[:, None], axis=-1)[:, 0]
    if not k:
        return chosen_lp, None, None
    if k == 1:  # lm-eval's logprobs=1: an argmax, not a partition of the vocabulary
        top = mx.argmax(lp, axis=-1, keepdims=True)
        return chosen_lp, top, mx.take_along_axis(lp, top, axis=-1)
    top = mx.argpartition(-lp, kth=k - 1, axis=-1)[:, :k]
    vals = mx.take_along_axis(lp, top, axis=-1)
    order = mx.argsort(-vals, axis=-1)
    return (chosen_lp, mx.take_along_axis(top, order, axis=-1),
            mx.take_along_axis(vals, order, axis=-1))


def _col(values: list[float]) -> mx.array:
    return mx.array(values, mx.float32)[:, None]

