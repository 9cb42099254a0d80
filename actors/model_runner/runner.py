"""The model runner's core: one ForwardBatch in, one StepResult out. Runs on the MLX thread.

Memory (the scheduler only sees row ids, KV slot ids and state slot ids):
- `token_buf[row]`: the token each request-pool row sampled last. A future input resolves here.
- Working copies: a prefilling row keeps its own per-layer mlx-lm caches until its last prompt
  chunk runs; rows that decode share one batched cache per layer (BatchKVCache / ArraysCache,
  left padded), so a decode step is one forward of shape [rows, 1].
- Storage of record (memory.py): the KV pool by KV slot, the state pool by state slot.
- Layer kinds (layers.py): full attention (KV pool), sliding window (its window lives in the
  working copies only: no KV pool, so no KV ops for such a model), recurrent (state pool).

Per step, in this order: the batch's ops (DESIGN section 5), released rows, admissions, the
prefill chunks, the decode forward (with the last prompt token of every prompt that completes in
this step), then the recurrent state of every row that ran is written through to its state
slot.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from protocol import messages as m
from protocol.codec import unpack_ids
from actors.model_runner.layers import classify
from actors.model_runner.storage import KvPool, StatePool
from actors.model_runner.cpu import fastmath, head, skinny
from actors.model_runner.sampling import Pending, RowParams, Sampler


@dataclass
class Launched:
    """A step queued on the MLX stream, its results not read back yet."""

    step: int
    rows: list[int]  # the rows that sample, in the batch's (and the StepResult's) order
    parts: list[Pending]  # the samples, in the order they were drawn
    pick: list[int] | None  # rows[i] is drawn sample pick[i]; None: the same order
    started: float


class StepError(RuntimeError):
    """The batch contradicts the runner's state: a scheduler bug, reported, never hidden."""


class ModelRunner:
    def __init__(self, model: nn.Module, max_rows: int, kv_slots: int = 0, state_slots: int = 0,
                 vocab_size: int = 0, eos_ids: list[int] = (), skinny_matmul: bool = True,
                 fast_math: bool = True):
        self.model = model
        self._layers(classify(model))  # first: a model it cannot serve is refused as it is
        self.skinny_layers = skinny.apply(model) if skinny_matmul else 0
        if fast_math:
            fastmath.install(model)
        self.fast_math = fast_math
        self.eos_ids = tuple(eos_ids)
        self.sampler = Sampler(vocab_size or self._vocab_width(), max_rows)
        head.install(model, self.sampler.vocab)
        self.kv_pool = KvPool(self.full, kv_slots) if kv_slots else None
        self.states = (StatePool(self._state_shapes(), state_slots)
                       if self.linear and state_slots else None)
        self.token_buf = mx.zeros((max_rows + 1,), dtype=mx.int32)  # row 0 is padding
        self.row_state: dict[int, int] = {}  # row -> its live state slot
        self.prefilling: dict[int, list[Any]] = {}  # row -> per-layer caches, mid-prompt
        self.pending_load: dict[int, list[int]] = {}  # row -> KV slots of its cached prefix
        self.decode_rows: list[int] = []  # row order of the batched cache
        self.decode_cache: list[Any] | None = None
        # Rows that stopped decoding but are not released yet (finished while a step was in
        # flight, or being retracted): their KV may still be saved for the prefix cache.
        self.parked: dict[int, list[Any]] = {}

    def _layers(self, kinds: list[str]) -> None:
        self.kinds = kinds
        self.full = [i for i, k in enumerate(kinds) if k == m.LAYER_FULL]
        self.linear = [i for i, k in enumerate(kinds) if k == m.LAYER_RECURRENT]
        # Layers whose caches keep K/V and count positions in `offset` (prompt-chunk checks).
        self.attention = [i for i, k in enumerate(kinds) if k in (m.LAYER_FULL, m.LAYER_SLIDING)]
        # Layers the pools cannot restore a prefix of: their KV ops are refused.
        self.unpooled = [i for i, k in enumerate(kinds)
                         if k not in (m.LAYER_FULL, m.LAYER_RECURRENT)]

    def _vocab_width(self) -> int:
        return self.model(mx.array([[0]])).shape[-1]

    def _admit(self, row: int, p: m.SamplingParams, generated: int, tokens: bytes) -> None:
        ids = unpack_ids(tokens)
        cut = len(ids) - generated if ids else 0
        stops = (() if p.ignore_eos else self.eos_ids) + tuple(p.stop_token_ids)
        self.sampler.admit(row, RowParams(
            temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p,
            repetition_penalty=p.repetition_penalty, frequency_penalty=p.frequency_penalty,
            presence_penalty=p.presence_penalty,
            logit_bias=tuple(zip(p.bias_ids, p.bias_values)), seed=p.seed,
            min_new_tokens=p.min_new_tokens, stop_ids=stops, top_logprobs=p.top_logprobs,
            logprobs=p.logprobs), ids[:cut], output=ids[cut:] if ids else [0] * generated)

    def _state_shapes(self) -> dict[int, list[tuple[tuple[int, ...], Any]]]:
        """One probe token through a fresh cache tells the shape of each linear layer's state."""
        cache = make_prompt_cache(self.model)
        mx.eval(self.model(mx.array([[0]]), cache=cache))
        return {i: [(a.shape[1:], a.dtype) for a in cache[i].cache] for i in self.linear}

    def step(self, batch: m.ForwardBatch) -> m.StepResult:
        return self.finish(self.launch(batch))

    def launch(self, batch: m.ForwardBatch, before_wait: Callable[[], None] | None = None
               ) -> Launched:
        """Queue the step's work on the MLX stream and return without reading anything back,
        so the caller can launch the next step (its inputs are this step's lazy tokens in
        token_buf) before finish() waits for this one. Where building the step must wait for
        values (NumPy softmax, a prompt chunk's caches), before_wait runs first, once."""
        with fastmath.active(self.fast_math, before_wait):
            return self._launch(batch)

    def _launch(self, batch: m.ForwardBatch) -> Launched:
        t0 = time.perf_counter()
        for op in batch.ops:
            self._apply(op)
        self._release(batch.release_rows)
        n = len(batch.admit_rows)
        for row, params, state, generated, tokens in zip(
                batch.admit_rows, batch.admit_params, batch.admit_states or [-1] * n,
                batch.admit_generated or [0] * n, batch.admit_tokens or [b""] * n):
            self._admit(row, params, generated, tokens)
            if state >= 0:
                self.row_state[row] = state
        self._keep_decoding([r for r, f in zip(batch.rows, batch.future) if f])

        parts: list[tuple[list[int], Pending]] = []  # sampled rows and their lazy results
        joining: dict[int, int] = {}  # row -> its last prompt token, run in the decode forward
        done: list[tuple[int, list[Any]]] = []  # prompts sampled on their own: decode from next step
        ids = unpack_ids(batch.input_ids)
        at = 0
        for row, n, start, fut, smp in zip(batch.rows, batch.input_lens, batch.start_pos,
                                           batch.future, batch.sample):
            if fut:
                continue
            got = self._prefill(row, ids[at:at + n], start, smp, joining, done)
            at += n
            if got is not None:
                parts.append(([row], got))
        if self.decode_rows:
            parts.append((list(self.decode_rows), self._decode(joining)))
        for row, cache in done:
            self._join_decode(row, cache)

        # Pool writes are lazy scatters: evaluated with each step, or every step would chain
        # onto the last and keep its arrays alive until a later read.
        pending = [p.all_arrays() for p in (self.kv_pool, self.states) if p is not None]
        out_rows = [r for r, s in zip(batch.rows, batch.sample) if s]
        drawn = [r for rows, _ in parts for r in rows]
        where = {r: i for i, r in enumerate(drawn)}
        pick = [where[r] for r in out_rows]
        pick = None if pick == list(range(len(drawn))) else pick
        if out_rows:
            tokens = mx.concatenate([got.tokens for _, got in parts])
            self.token_buf[mx.array(out_rows)] = tokens if pick is None else tokens[
                mx.array(pick)]
            pending += [self.token_buf, *(got.arrays() for _, got in parts)]
        mx.async_eval(pending)
        return Launched(batch.step, out_rows, [got for _, got in parts], pick, t0)

    def finish(self, launched: Launched) -> m.StepResult:
        """Wait for a launched step and read its tokens (and logprobs) back."""
        got = [p.resolve() for p in launched.parts]
        tokens = [t for g in got for t in g.tokens]
        order = range(len(tokens)) if launched.pick is None else launched.pick
        extra = {}
        if any(g.logprobs is not None for g in got):
            n = [len(g.tokens) for g in got]
            columns = {"logprobs": [x for g, k in zip(got, n) for x in g.logprobs or [0.0] * k],
                       "top_ids": [x for g, k in zip(got, n) for x in g.top_ids or [[]] * k],
                       "top_logprobs": [x for g, k in zip(got, n)
                                        for x in g.top_logprobs or [[]] * k]}
            extra = {name: [col[i] for i in order] for name, col in columns.items()}
        return m.StepResult(step=launched.step, rows=launched.rows,
                            tokens=[tokens[i] for i in order],
                            forward_s=time.perf_counter() - launched.started, **extra)

    # -- ops -----------------------------------------------------------------------------------

    def _apply(self, op: m.Op) -> None:
        if op.kind == m.OpKind.CLEAR:
            self._need(self.states, "state").clear(op.dst)
        elif op.kind in (m.OpKind.COPY, m.OpKind.SNAPSHOT):
            self._need(self.states, "state").copy(op.src, op.dst)
        elif op.kind == m.OpKind.KV_SAVE:
            self._kv_op_allowed("save")
            self._save_kv(op.dst, op.start, unpack_ids(op.slots))
        elif op.kind == m.OpKind.KV_LOAD:
            self._kv_op_allowed("load")
            # Used when the row's first chunk runs in this step: the row may first be released
            # from its previous request below.
            self.pending_load[op.dst] = unpack_ids(op.slots)
        elif op.kind == m.OpKind.DONATE:
            if self.row_state.get(op.dst) != op.src:
                raise StepError(f"row {op.dst} donates state slot {op.src}, but its live state "
                                f"is {self.row_state.get(op.dst)}")
            del self.row_state[op.dst]
        else:
            raise StepError(f"unknown op kind {op.kind}")

    def _kv_op_allowed(self, what: str) -> None:
        """A sliding-window layer keeps only its window, so the pool cannot give a prefix of
        it back: the scheduler runs such a model with the prefix cache off."""
        if self.unpooled:
            kinds = sorted({self.kinds[i] for i in self.unpooled})
            raise StepError(f"KV {what}, but layers {self.unpooled} ({', '.join(kinds)}) "
                            "cannot be restored from the KV pool")

    def _need(self, pool: Any, what: str) -> Any:
        if pool is None:
            raise StepError(f"a {what} op, but this runner has no {what} pool")
        return pool

    def _save_kv(self, row: int, start: int, slots: list[int]) -> None:
        pool = self._need(self.kv_pool, "KV")
        end = start + len(slots)
        if row in self.prefilling or row in self.parked:
            caches, index, pad = self.prefilling.get(row) or self.parked[row], 0, 0
        elif row in self.decode_rows:
            caches, index = self.decode_cache, self.decode_rows.index(row)
            fastmath.before_wait()
            pad = int(caches[self.full[0]].left_padding[index].item())
        else:
            raise StepError(f"KV save for row {row}, which holds no KV")
        for layer in self.full:
            c = caches[layer]
            keys = c.keys[index, :, pad + start:pad + end, :].transpose(1, 0, 2)
            values = c.values[index, :, pad + start:pad + end, :].transpose(1, 0, 2)
            pool.save(layer, slots, keys, values)

    def _release(self, rows: list[int]) -> None:
        """The scheduler freed these rows: drop their caches and decode state."""
        for row in rows:
            self.prefilling.pop(row, None)
            self.parked.pop(row, None)
            self.row_state.pop(row, None)
            self.sampler.release(row)
        gone = set(rows) & set(self.decode_rows)
        if gone:
            self._keep_decoding([r for r in self.decode_rows if r not in gone], park=False)

    # -- decode --------------------------------------------------------------------------------

    def _keep_decoding(self, rows: list[int], park: bool = True) -> None:
        """Shrink the batched cache to the rows this step decodes; the others are parked
        (released rows are simply dropped)."""
        missing = set(rows) - set(self.decode_rows)
        if missing:
            raise StepError(f"rows {sorted(missing)} decode but were never prefilled")
        if set(rows) == set(self.decode_rows):
            return
        fastmath.before_wait()  # mlx-lm's extract and filter read the paddings back
        wanted = set(rows)
        if park:
            for i, r in enumerate(self.decode_rows):
                if r not in wanted:
                    self.parked[r] = [c.extract(i) for c in self.decode_cache]
        if not rows:
            self.decode_rows, self.decode_cache = [], None
            return
        keep = [i for i, r in enumerate(self.decode_rows) if r in wanted]
        index = mx.array(keep)
        for c in self.decode_cache:
            c.filter(index)
        self.decode_rows = [self.decode_rows[i] for i in keep]

    def _decode(self, joining: dict[int, int]) -> Pending:
        rows = mx.array(self.decode_rows)
        if joining:
            self.token_buf[mx.array(list(joining))] = mx.array(list(joining.values()),
                                                               dtype=mx.int32)
        inputs = self.token_buf[rows][:, None]
        logits = self.model(inputs, cache=self.decode_cache)[:, -1, :]
        self._write_states(self.decode_rows, self.decode_cache)
        return self.sampler.launch(self.decode_rows, logits)

    # -- prefill -------------------------------------------------------------------------------

    def _prefill(self, row: int, ids: list[int], start: int, sample: bool,
                 joining: dict[int, int], done: list[tuple[int, list[Any]]]) -> Pending | None:
        """Run a prompt chunk. Where rows decode in this step, the last chunk's last token is
        left to the decode forward (added to `joining`): its logits then come out of the
        batched LM head, ~1 ms more per row there. With nothing decoding, the chunk runs whole
        with the head on its last position only (one pass over the weights, not the two of
        a chunk and then a one-token forward)."""
        cache = self.prefilling.get(row)
        if cache is None or start == 0:
            cache = self._new_prompt_cache(row, start)
        if cache[self.attention[0]].offset != start if self.attention else False:
            raise StepError(f"row {row}: prompt chunk at {start}, cache holds "
                            f"{cache[self.attention[0]].offset}")
        if not sample:
            self.model(mx.array(ids)[None], cache=cache)  # logits unused: never evaluated
            self._write_states([row], cache)
            fastmath.before_wait()
            mx.eval([c.state for c in cache])
            return None
        del self.prefilling[row]
        # An empty cache (a one-token prompt, nothing cached) cannot join a batch either.
        if not self.decode_rows or (start == 0 and len(ids) == 1):
            with head.last_only():
                logits = self.model(mx.array(ids)[None], cache=cache)
            self._write_states([row], cache)
            done.append((row, cache))  # joins the batch after this step's decode forward
            return self.sampler.launch([row], logits[:, -1, :])
        if len(ids) > 1:
            self.model(mx.array(ids[:-1])[None], cache=cache)  # logits never evaluated
        self._join_decode(row, cache)
        joining[row] = ids[-1]
        return None

    def _new_prompt_cache(self, row: int, start: int) -> list[Any]:
        """Fresh caches for a new prompt: the cached prefix's KV from the pool (if the scheduler
        found one) and the recurrent state from the row's state slot (cleared or copied)."""
        slots = self.pending_load.pop(row, [])
        if len(slots) != start:
            raise StepError(f"row {row}: prompt starts at {start} with {len(slots)} cached slots")
        cache = make_prompt_cache(self.model)
        if slots:
            pool = self._need(self.kv_pool, "KV")
            for layer in self.full:
                keys, values = pool.load(layer, slots)
                c = cache[layer]
                c.keys = keys.transpose(1, 0, 2)[None]
                c.values = values.transpose(1, 0, 2)[None]
                c.offset = len(slots)
        if self.states is not None and row in self.row_state:
            for layer in self.linear:
                cache[layer].cache = self.states.read(layer, [self.row_state[row]])
        self.prefilling[row] = cache
        return cache

    def _write_states(self, rows: list[int], caches: list[Any]) -> None:
        """Write the recurrent state through to the rows' state slots, so a snapshot, a copy
        or a donation the scheduler orders later sees exactly the state after this step."""
        if self.states is None:
            return
        slots = [self.row_state[r] for r in rows if r in self.row_state]
        if len(slots) != len(rows):
            return  # rows without a state slot (prefix caching off): nothing to keep
        for layer in self.linear:
            self.states.write(layer, slots, caches[layer].cache)

    def _join_decode(self, row: int, cache: list[Any]) -> None:
        merged = [type(c).merge([c]) for c in cache]
        if self.decode_cache is None:
            self.decode_cache = merged
        else:
            for batched, new in zip(self.decode_cache, merged):
                batched.extend(new)
        self.decode_rows.append(row)
