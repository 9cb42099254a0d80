"""The model runner's core: one ForwardBatch in, one StepResult out. Runs on the MLX thread.

Memory layout (the runner's own business; the scheduler only sees row ids):
- `token_buf[row]`: the token each request-pool row sampled last. A future input resolves here.
- A prefilling row keeps its own per-layer mlx-lm caches until its last prompt chunk runs.
- Rows that decode share one batched cache per layer (mlx-lm's BatchKVCache / ArraysCache, left
  padded), so a decode step is a single forward of shape [rows, 1]. The decode working set is
  exactly the step's future rows: a row the scheduler stopped listing is dropped from it.
"""

from __future__ import annotations

import time
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from protocol import messages as m
from protocol.codec import unpack_ids
from actors.model_runner.sampling import sample_tokens


class StepError(RuntimeError):
    """The batch contradicts the runner's state: a scheduler bug, reported, never hidden."""


class ModelRunner:
    def __init__(self, model: nn.Module, max_rows: int):
        self.model = model
        self.token_buf = mx.zeros((max_rows + 1,), dtype=mx.int32)  # row 0 is padding
        self.temperature = [0.0] * (max_rows + 1)
        self.prefilling: dict[int, list[Any]] = {}  # row -> per-layer caches, mid-prompt
        self.decode_rows: list[int] = []  # row order of the batched cache
        self.decode_cache: list[Any] | None = None

    def step(self, batch: m.ForwardBatch) -> m.StepResult:
        t0 = time.perf_counter()
        self._release(batch.release_rows)
        for row, params in zip(batch.admit_rows, batch.admit_params):
            self.temperature[row] = params.temperature
        self._keep_decoding([r for r, f in zip(batch.rows, batch.future) if f])

        sampled: dict[int, mx.array] = {}
        if self.decode_rows:
            sampled.update(self._decode())
        ids = unpack_ids(batch.input_ids)
        at = 0
        for row, n, start, fut, smp in zip(batch.rows, batch.input_lens, batch.start_pos,
                                           batch.future, batch.sample):
            if fut:
                continue
            token = self._prefill(row, ids[at:at + n], start, smp)
            at += n
            if token is not None:
                sampled[row] = token

        out_rows = [r for r, s in zip(batch.rows, batch.sample) if s]
        if out_rows:
            tokens = mx.concatenate([sampled[r].reshape(-1) for r in out_rows])
            self.token_buf[mx.array(out_rows)] = tokens
            token_list = tokens.tolist()
        else:
            token_list = []
        return m.StepResult(step=batch.step, rows=out_rows, tokens=token_list,
                            forward_s=time.perf_counter() - t0)

    def _release(self, rows: list[int]) -> None:
        """The scheduler freed these rows: drop their prompt caches and decode state."""
        for row in rows:
            self.prefilling.pop(row, None)
        gone = set(rows) & set(self.decode_rows)
        if gone:
            self._keep_decoding([r for r in self.decode_rows if r not in gone])

    # -- decode --------------------------------------------------------------------------------

    def _keep_decoding(self, rows: list[int]) -> None:
        """Shrink the batched cache to the rows this step decodes."""
        missing = set(rows) - set(self.decode_rows)
        if missing:
            raise StepError(f"rows {sorted(missing)} decode but were never prefilled")
        if set(rows) == set(self.decode_rows):
            return
        if not rows:
            self.decode_rows, self.decode_cache = [], None
            return
        wanted = set(rows)
        keep = [i for i, r in enumerate(self.decode_rows) if r in wanted]
        index = mx.array(keep)
        for c in self.decode_cache:
            c.filter(index)
        self.decode_rows = [self.decode_rows[i] for i in keep]

    def _decode(self) -> dict[int, mx.array]:
        rows = mx.array(self.decode_rows)
        inputs = self.token_buf[rows][:, None]
        logits = self.model(inputs, cache=self.decode_cache)[:, -1, :]
        temps = [self.temperature[r] for r in self.decode_rows]
        tokens = sample_tokens(logits, temps)
        return {r: tokens[i] for i, r in enumerate(self.decode_rows)}

    # -- prefill -------------------------------------------------------------------------------

    def _prefill(self, row: int, ids: list[int], start: int, sample: bool) -> mx.array | None:
        if start == 0:
            self.prefilling[row] = make_prompt_cache(self.model)
        cache = self.prefilling.get(row)
        if cache is None:
            raise StepError(f"row {row}: prompt chunk at {start} without its earlier chunks")
        logits = self.model(mx.array(ids)[None], cache=cache)
        if not sample:
            mx.eval([c.state for c in cache])
            return None
        token = sample_tokens(logits[:, -1, :], [self.temperature[row]])
        del self.prefilling[row]
        self._join_decode(row, cache)
        return token

    def _join_decode(self, row: int, cache: list[Any]) -> None:
        merged = [type(c).merge([c]) for c in cache]
        if self.decode_cache is None:
            self.decode_cache = merged
        else:
            for batched, new in zip(self.decode_cache, merged):
                batched.extend(new)
        self.decode_rows.append(row)
