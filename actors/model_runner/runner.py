"""The model runner's core: one ForwardBatch in, one StepResult out. Runs on the MLX thread.

Per step, in this order (docs/architecture.md, section 4): the batch's ops on the pools,
released rows, admissions, the rows that keep decoding, the prefill chunks, the decode forward
(with the last prompt token of every prompt that completes in this step), then each sampled
token into token_buf.

This file is the step's order only. What each row holds between steps and token_buf (the
runner side of the FutureMap): rows.py. The KV and state pools and the ops on them:
storage.py. Layer kinds: layers.py. The overlap pipeline and its before-host-sync hook:
pipeline.py. Sampling: sampling.py. CPU patches: cpu/.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from actors.model_runner import cpu
from actors.model_runner.compiled_decode import CompiledDecode
from actors.model_runner.cpu import greedy_head, head, weights
from actors.model_runner.grammar import RowMatchers, grammars_for
from actors.model_runner.layers import Layers, classify
from actors.model_runner.pipeline import before_host_sync
from actors.model_runner.prompt_scores import PendingScores, score_chunk
from actors.model_runner.rows import Rows, StepError
from actors.model_runner.sampling import Pending, RowParams, Sampled, Sampler
from actors.model_runner.kv_pages import PAGE, KvPages
from actors.model_runner.storage import Pools, StatePool
from protocol import messages as m
from protocol.codec import unpack_ids
from protocol.config import RuntimeConfig

__all__ = ["Launched", "ModelRunner", "StepError"]


@dataclass
class Launched:
    """A step queued on the MLX stream, its results not read back yet."""

    step: int
    rows: list[int]  # the rows that sample, in the batch's (and the StepResult's) order
    parts: list[Pending]  # the samples, in the order they were drawn
    pick: list[int] | None  # rows[i] is drawn sample pick[i]; None: the same order
    started: float
    scores: list[PendingScores]  # per ForwardBatch.score_rows entry


class ModelRunner:
    def __init__(self, model: nn.Module, max_rows: int, kv_slots: int = 0, state_slots: int = 0,
                 vocab_size: int = 0, eos_ids: list[int] = (),
                 runtime: RuntimeConfig = RuntimeConfig(), tokenizer_dir: str | None = None,
                 compile_decode: bool | None = None):
        """kv_slots: the KV budget in tokens, whole pages of it and the scratch page held at
        most (0: no bound). tokenizer_dir: where tokenizer.json is, for constrained rows'
        grammars (none: a constrained row is refused). compile_decode: runtime.compile_decode
        unless given (the actor turns it off with tensor parallelism)."""
        self.model = model
        self.layers = Layers.of(classify(model))  # first: a model it cannot serve is refused
        self.eos_ids = tuple(eos_ids)
        vocab = vocab_size or self._vocab_width()
        grammar = None
        if tokenizer_dir is not None and self.eos_ids:
            grammar = RowMatchers(partial(grammars_for, tokenizer_dir, vocab, self.eos_ids[0]))
        self.sampler = Sampler(vocab, max_rows, grammar=grammar)
        self.cpu = cpu.install(model, runtime, self.sampler.vocab)
        kv = KvPages(self.layers.full, kv_slots // PAGE + 1 if kv_slots else None)
        if self.layers.full:
            cache = make_prompt_cache(model)
            model(mx.array([[0]]), cache=cache)
            kv.open(cache)
        states = StatePool(state_slots) if self.layers.stateful and state_slots else None
        # Hybrid models keep the head's input with a prompt's snapshot (storage.py) and sample
        # an exact repeat from it, through the head module found here.
        self.head = greedy_head.find_head(model) if states is not None else None
        self.pools = Pools(self.layers, kv, states)
        self.rows = Rows(max_rows, kv)
        self.compiled = None
        kernels = weights.compiled_kernels(runtime)
        if (runtime.compile_decode if compile_decode is None else compile_decode) \
                and CompiledDecode.why_not(kernels, self.layers.kinds) is None:
            self.compiled = CompiledDecode(model, self.rows.decode, kernels)
        # MLX's CPU eval runs a graph as it is queued and returns only when a few operations
        # are left: a step queued before the last one is read back would be done first, and
        # every token would reach its client a step late (a prefix hit's first token: 40 ->
        # 22 ms on qwen3_5-small). So on the CPU the last step is read back once the new
        # step's graph is built (its tail ran behind the building), before it is queued.
        self.queue_blocks = mx.default_device() == mx.cpu
        # Except a plain decode step of a compiled attention-only model (_queues_early): a few
        # dozen nodes, so queueing it waits only for the last step's tail, and then the stream
        # goes from one step to the next with no gap for reading back and sending (the pool
        # writes are in place: cpu/attention.py). qwen3-small-4bit served at one request:
        # +4-6% tokens/s (paired 3 s windows, one graph).
        self.early_queue = (self.queue_blocks and self.compiled is not None
                            and not self.layers.stateful)

    def _vocab_width(self) -> int:
        return self.model(mx.array([[0]])).shape[-1]

    def step(self, batch: m.ForwardBatch) -> m.StepResult:
        return self.finish(self.launch(batch))

    def launch(self, batch: m.ForwardBatch) -> Launched:
        """Queue the step's work on the MLX stream and return without reading anything back,
        so the caller can launch the next step (its inputs are this step's lazy tokens in
        token_buf) before finish() waits for this one. Where building the step has to wait
        for values, pipeline.before_host_sync() runs first."""
        early = self._queues_early(batch)
        with self.cpu.steps(in_place=True):
            started = time.perf_counter()
            for op in batch.ops:
                self.pools.apply(op, self.rows)
            self._release(batch.release_rows)
            self._admit(batch)
            decoding = [r for r, f in zip(batch.rows, batch.future) if f]
            if batch.hold_decode:
                # The decoding rows sit the step out: nothing parks, nothing runs for them.
                if decoding:
                    raise StepError(f"rows {decoding} decode in a step that holds decoding")
            else:
                self.pools.park(self.rows.parking(decoding), self.rows)
                self.rows.keep_decoding(decoding)
            scores: list[PendingScores] = []
            parts = self._forward(batch, scores)
            return self._queue(batch, parts, started, scores, early)

    def _queues_early(self, batch: m.ForwardBatch) -> bool:
        """Whether the step is queued before the last one is read back (early_queue): only
        the decoding rows of the last step, decoding again, and nothing else that touches the
        pools (ops, admissions, releases, joins, parked rows) with MLX's own operations, which
        would copy a pool the last step still holds."""
        return (self.early_queue and self.compiled.off is None and not batch.ops
                and not batch.admit_rows and not batch.release_rows and not batch.score_rows
                and not batch.hold_decode and all(batch.future)
                and set(batch.rows) == self.rows.decode.decoding
                and not any(r in self.rows.waiting for r in batch.rows))

    def finish(self, launched: Launched) -> m.StepResult:
        """Wait for a launched step and read its tokens (and logprobs) back."""
        got = [p.resolve() for p in launched.parts]
        tokens = [t for g in got for t in g.tokens]
        order = range(len(tokens)) if launched.pick is None else launched.pick
        extra = {}
        if any(g.logprobs is not None for g in got):
            columns = _logprob_columns(got)
            extra = {name: [col[i] for i in order] for name, col in columns.items()}
        if launched.scores:
            extra["scores"] = [s.resolve() for s in launched.scores]
        return m.StepResult(step=launched.step, rows=launched.rows,
                            tokens=[tokens[i] for i in order],
                            forward_s=time.perf_counter() - launched.started, **extra)

    # -- rows in and out -----------------------------------------------------------------------

    def _release(self, rows: list[int]) -> None:
        self.rows.release(rows)
        for row in rows:
            self.sampler.release(row)

    def _admit(self, batch: m.ForwardBatch) -> None:
        n = len(batch.admit_rows)
        states = batch.admit_states or [-1] * n
        generated = batch.admit_generated or [0] * n
        tokens = batch.admit_tokens or [b""] * n
        # strict: columns of unequal length are a StepError's ValueError, not rows dropped.
        for row, params, state, output_len, ids in zip(batch.admit_rows, batch.admit_params,
                                                       states, generated, tokens, strict=True):
            self._admit_sampling(row, params, output_len, unpack_ids(ids))
            self.rows.admit(row, state)

    def _admit_sampling(self, row: int, p: m.SamplingParams, generated: int,
                        ids: list[int]) -> None:
        """ids: every token so far (prompt + output) when the penalties need them, else []."""
        cut = len(ids) - generated if ids else 0
        output = ids[cut:] if ids else [0] * generated
        stops = (() if p.ignore_eos else self.eos_ids) + tuple(p.stop_token_ids)
        self.sampler.admit(row, RowParams(
            temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p,
            repetition_penalty=p.repetition_penalty, frequency_penalty=p.frequency_penalty,
            presence_penalty=p.presence_penalty,
            logit_bias=tuple(zip(p.bias_ids, p.bias_values)), seed=p.seed,
            min_new_tokens=p.min_new_tokens, stop_ids=stops, top_logprobs=p.top_logprobs,
            logprobs=p.logprobs,
            constraint=p.constraint or None), ids[:cut], output=output)

    # -- the forward ---------------------------------------------------------------------------

    def _forward(self, batch: m.ForwardBatch,
                 scores: list[PendingScores]) -> list[tuple[list[int], Pending]]:
        """Every prompt chunk, then the decode forward: (the rows sampled, their lazy
        samples), in the order drawn. The scored chunks' prompt scores go to `scores`, in
        the batch's score_rows order."""
        scored = {row: (first, next_id) for row, first, next_id in
                  zip(batch.score_rows, batch.score_start, batch.score_next, strict=True)}
        if len(scored) != len(batch.score_rows):
            raise StepError("a row is scored twice in one step")
        by_row: dict[int, PendingScores] = {}
        parts: list[tuple[list[int], Pending]] = []
        joining: dict[int, int] = {}  # row -> its last prompt token, run in the decode forward
        decodes = bool(self.rows.decode_rows) and not batch.hold_decode
        done: list[tuple[int, list[Any]]] = []  # prompts sampled on their own
        ids = unpack_ids(batch.input_ids)
        at = 0
        # strict: a batch whose columns disagree fails its step instead of running short.
        for row, n, start, future, sample in zip(batch.rows, batch.input_lens, batch.start_pos,
                                                 batch.future, batch.sample, strict=True):
            if future:
                continue
            chunk = ids[at:at + n]
            if len(chunk) != n:
                raise StepError(f"row {row} brings {n} input ids; input_ids holds {len(ids)}")
            cache, kept = self._chunk_cache(row, start)
            if row in scored:
                got = self._prefill_scored(row, cache, chunk, start, sample, *scored[row],
                                           by_row, done)
            else:
                got = self._prefill(row, cache, kept, chunk, start, sample, decodes, joining,
                                    done)
            at += n
            if got is not None:
                parts.append(([row], got))
        if at != len(ids):
            raise StepError(f"input_ids holds {len(ids)} ids; the rows bring {at}")
        if decodes:
            parts.append((list(self.rows.decode_rows), self._decode(joining)))
        for row, cache in done:  # they decode from the next step on
            self.rows.wait_to_decode(row, cache)
        if set(by_row) != set(scored):
            raise StepError(f"rows {sorted(set(scored) - set(by_row))} are to be scored but "
                            "run no prompt chunk in this step")
        scores += [by_row[row] for row in batch.score_rows]
        return parts

    def _queue(self, batch: m.ForwardBatch, parts: list[tuple[list[int], Pending]],
               started: float, scores: list[PendingScores], early: bool = False) -> Launched:
        """Put the sampled tokens into token_buf in the batch's row order and queue the step
        on the MLX stream. Pool writes are lazy scatters: evaluated with each step, or every
        step would chain onto the last and keep its arrays alive until a later read."""
        pending = []
        out_rows = [r for r, s in zip(batch.rows, batch.sample) if s]
        drawn = [r for rows, _ in parts for r in rows]
        where = {r: i for i, r in enumerate(drawn)}
        pick = [where[r] for r in out_rows]
        if pick == list(range(len(drawn))):
            pick = None
        if out_rows:
            tokens = mx.concatenate([got.tokens for _, got in parts])
            if pick is not None:
                tokens = tokens[mx.array(pick)]
            self.rows.record(out_rows, tokens)
            pending.append(self.rows.token_buf)
            pending += [got.arrays() for _, got in parts]
        pending += [s.arrays() for s in scores]
        # The pools last: MLX orders a graph's evaluation by walking from its outputs, so each
        # row's reads of a pool array come before the next row's write takes the array over
        # (MLX's path copies an array it cannot take over).
        pending += self.pools.arrays()
        if self.queue_blocks and not early:
            before_host_sync()
        mx.async_eval(pending)
        return Launched(batch.step, out_rows, [got for _, got in parts], pick, started, scores)

    def _decode(self, joining: dict[int, int]) -> Pending:
        rows, batch = self.rows.decode_rows, self.rows.decode
        inputs = self.rows.resolve_futures(joining)
        with self._head(rows) as head_out:
            out = None if self.compiled is None else self.compiled(inputs, head_out)
            if out is None:  # not compiled in this step
                out = self.model(inputs, cache=batch.caches)
        batch.advance()
        live = batch.live_index()  # None: no hole or parked row ran beside them
        return self._sample(rows, out, head_out, live)

    @property
    def head_input(self) -> bool:
        """Whether snapshots keep the head's input (ModelLayers.head_input)."""
        return self.head is not None

    def _head(self, rows: list[int]) -> AbstractContextManager[greedy_head.Captured | None]:
        """Where every row is greedy (plain, or constrained by its grammar's mask alone) and
        the greedy head stands in for the model's LM head (cpu/greedy_head.py), the forward's
        head only hands over its input; where snapshots keep the head's input, the head
        records it and runs."""
        if self.cpu.greedy is not None and self.sampler.greedy(rows):
            return greedy_head.capture()
        if self.head is not None:
            return greedy_head.capture(replace=False)
        return nullcontext()

    def _sample(self, rows: list[int], out: mx.array, got: greedy_head.Captured | None,
                live: mx.array | None = None) -> Pending:
        """The rows' samples from a forward's output (its last position); `live` picks the
        rows that sample out of the batch."""
        x = None if got is None else got.hidden[:, -1, :]
        if x is not None and live is not None:
            x = x[live]
        tokens, masks = None, None
        if got is not None and got.replace:
            if out is not got.placeholder:  # install() probed this; a model changed since
                raise StepError("the model's output is not its LM head's (greedy head)")
            masks = self.sampler.greedy_masks(rows)
            tokens = self.cpu.greedy.tokens(x, masks)
        if x is not None and self.head is not None:
            # A masked argmax is not the token a later plain hit on this input would draw.
            self.rows.keep_head_input(rows, x, tokens if masks is None else None)
        if tokens is not None:
            return self.sampler.launch_tokens(rows, tokens)
        logits = out[:, -1, :]
        return self.sampler.launch(rows, logits if live is None else logits[live])

    def _chunk_cache(self, row: int, start: int) -> tuple[list[Any], list[mx.array] | None]:
        """The row's caches for a prompt chunk at `start` (fresh ones, filled from the pools,
        for a prompt's first chunk), and what a restored state kept of the head's input."""
        cache, kept = self.rows.prompt_cache(row), None
        if cache is None or start == 0:
            cache, kept = self._new_prompt_cache(row, start)
        self._check_chunk_start(row, cache, start)
        return cache, kept

    @staticmethod
    def _fill(cache: list[Any]) -> None:
        """A chunk that samples nothing: its caches are evaluated now, its logits never."""
        before_host_sync()
        mx.eval([c.state for c in cache])

    def _prefill(self, row: int, cache: list[Any], kept: list[mx.array] | None, ids: list[int],
                 start: int, sample: bool, decodes: bool, joining: dict[int, int],
                 done: list[tuple[int, list[Any]]]) -> Pending | None:
        """Run a prompt chunk. Where rows decode in this step (`decodes`), the last chunk's
        last token is left to the decode forward (added to `joining`): its logits then come
        out of the batched LM head, ~1 ms more per row there. With nothing decoding, the chunk
        runs whole with the head on its last position only (one pass over the weights, not
        the two of a chunk and then a one-token forward)."""
        if not ids:
            return self._sample_kept(row, cache, kept, done)
        if not sample:
            self.model(mx.array(ids)[None], cache=cache)
            self._fill(cache)
            return None
        self.rows.end_prompt(row)
        # An empty cache (a one-token prompt, nothing cached) cannot join a batch either.
        if not decodes or (start == 0 and len(ids) == 1):
            with head.last_only(), self._head([row]) as head_out:
                out = self.model(mx.array(ids)[None], cache=cache)
            done.append((row, cache))  # joins the batch after this step's decode forward
            return self._sample([row], out, head_out)
        if len(ids) > 1:
            self.model(mx.array(ids[:-1])[None], cache=cache)  # logits never evaluated
        self.rows.join_decode(row, cache)
        joining[row] = ids[-1]
        return None

    def _prefill_scored(self, row: int, cache: list[Any], ids: list[int], start: int,
                        sample: bool, first: int, next_id: int,
                        scores: dict[int, PendingScores],
                        done: list[tuple[int, list[Any]]]) -> Pending | None:
        """A prompt chunk whose tokens are scored (prompt_scores.py): the LM head over every
        position, and the chunk runs on its own even where rows decode (its last position's
        logits are at hand, so the sample needs no decode row)."""
        if sample:
            self.rows.end_prompt(row)
        # The head's input is recorded where snapshots keep it; the LM head itself always runs.
        context = greedy_head.capture(replace=False) if self.head is not None else nullcontext()
        with context as head_out:
            out = self.model(mx.array(ids)[None], cache=cache)
        k = self.sampler.params[row].top_logprobs
        scores[row] = score_chunk(out[0], ids, start, first, next_id, k)
        if not sample:
            self._fill(cache)
            return None
        done.append((row, cache))  # joins the batch after this step's decode forward
        return self._sample([row], out, head_out)

    def _sample_kept(self, row: int, cache: list[Any], kept: list[mx.array] | None,
                     done: list[tuple[int, list[Any]]]) -> Pending:
        """A row whose whole prompt the scheduler found cached with the head's input after it
        (an exact repeat): its first token from the head alone, no forward. `kept`: what its
        restored state held there, [input] or [input, the greedy head's token]."""
        if not kept or self.head is None:
            raise StepError(f"row {row}: no prompt tokens to run and no head input kept "
                            "with its state")
        x, token = kept[0], kept[1] if len(kept) > 1 else None
        self.rows.end_prompt(row)
        done.append((row, cache))  # joins the batch when it first decodes
        if token is not None and self.sampler.plain_greedy([row]):
            # The greedy head's answer on this very input, kept with it: the same argmax.
            self.rows.keep_head_input([row], x[None], token[None])
            return self.sampler.launch_tokens([row], token[None])
        with self._head([row]) as head_out:
            out = self.head.apply(x.reshape(1, 1, -1))
        return self._sample([row], out, head_out)

    def _check_chunk_start(self, row: int, cache: list[Any], start: int) -> None:
        """A chunk continues where the row's caches end. Only attention caches count
        positions: a model of recurrent layers alone has nothing to compare."""
        if not self.layers.attention:
            return
        offset = cache[self.layers.attention[0]].offset
        if offset != start:
            raise StepError(f"row {row}: prompt chunk at {start}, cache holds {offset}")

    def _new_prompt_cache(self, row: int,
                          start: int) -> tuple[list[Any], list[mx.array] | None]:
        """Fresh caches for a new prompt, filled from the pools: the cached prefix's KV (if the
        scheduler found one) and the recurrent state (cleared or copied by the ops); and what
        that state kept of the head's input, if anything (storage.HEAD_INPUT)."""
        cache = make_prompt_cache(self.model)
        kept = self.pools.restore(row, cache, start, self.rows.pages.get(row, []),
                                  self.rows.state.get(row))
        self.rows.start_prompt(row, cache)
        return cache, kept


def _logprob_columns(got: list[Sampled]) -> dict[str, list]:
    """The StepResult's logprob columns over every sample, in drawn order. Samples drawn
    without logprobs (plain greedy rows beside rows that asked) fill their rows with 0.0 and
    no alternatives."""
    columns: dict[str, list] = {"logprobs": [], "top_ids": [], "top_logprobs": []}
    for g in got:
        n = len(g.tokens)
        columns["logprobs"] += g.logprobs or [0.0] * n
        columns["top_ids"] += g.top_ids or [[]] * n
        columns["top_logprobs"] += g.top_logprobs or [[]] * n
    return columns
