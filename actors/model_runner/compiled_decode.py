"""The decode forward replayed by mx.compile instead of built op by op in Python every step.

Why: at one request a decode step's graph (~550 nodes on qwen3-small) takes 0.8-0.9 ms of
Python to build on an idle machine, 1.4-1.8 ms where the kernels and the other actors share
its two cores; a compiled call replays the traced graph in 0.25-0.4 ms. With two processes
busy beside it, the bare pipelined 4-bit step took 6.1 ms compiled against 6.8 ms built
(docs/performance.md, "Graph nodes per step").

What is traced: the model's forward over the decode batch as a function of everything that
changes between steps: the tokens, the positions' arrays (RoPE offsets, page table, mask, keys
per row, write index), every attention layer's K/V pool and every recurrent layer's state
parts (a hybrid model's conv windows and SSM states). It returns the forward's output, the
head's input where the greedy head captured it, and the pools and states written. The weights
are constants of the trace. A new shape (positions, table width, pool pages) is a new trace,
so the table's width is rounded up to a power of two pages while compiled
(Positions.round_pages): a long generation retraces about log2(pages) times, not every 16
tokens.

Bit for bit the eager forward: traced with MLX's compile mode no_fuse (mas_kernels sets it),
so the replay runs the same primitives on the same inputs; fusion would let the C compiler
contract a multiply and an add into one rounding.

Only where every cache is the decode batch's paged K/V or its batched recurrent state (dense
and hybrid models, not sliding windows), on one rank, with the compiled kernels built (for the
mode switch). A hybrid step's eager build takes 2.4-2.6 ms of Python at one row of
qwen3_5-small (a 13.3 ms step), 2.0-2.2 compiled; served, within noise either way, but the
same path for every model the decode batch holds in its own layout. A step that cannot trace
(some part of the forward reads a value back, say) turns it off for the runner, logged once
(`runner.compiled_decode_off`), and runs eagerly; the step itself never fails for it.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn

from actors.logs import get_logger
from actors.model_runner.cpu import greedy_head
from actors.model_runner.decode_batch import BatchedKV, BatchedStates, DecodeBatch
from actors.model_runner.kv_pages import pool_in_place
from protocol.messages import LAYER_FULL, LAYER_RECURRENT

PLAIN, REPLACE, KEEP = "plain", "replace", "keep"  # the head: none captured, greedy, kept


class CompiledDecode:
    def __init__(self, model: nn.Module, batch: DecodeBatch, kernels: Any):
        self.model, self.batch, self.kernels = model, batch, kernels
        self._fns: dict[tuple[str, bool], Callable] = {}  # per head mode and in_place
        self._head_module: dict[str, Any] = {}
        self.off: str | None = None  # why it stopped, once it did
        self.calls = 0
        self.traces = 0  # forwards traced (each new shape and head mode)
        self._got: greedy_head.Captured | None = None  # the head context of the call
        batch.positions.round_pages = True

    @staticmethod
    def why_not(kernels: Any, kinds: list[str] = ()) -> str | None:
        """Why the runner cannot compile its decode forward, or None; `kinds`: the model's
        layer kinds (layers.py)."""
        if kernels is None or not hasattr(kernels, "set_compile_fusion"):
            return "the compiled kernels are not built"
        if os.environ.get("MLX_DISABLE_COMPILE"):
            return "MLX_DISABLE_COMPILE is set"
        # Sliding windows and other caches batch as mlx-lm's merged caches, whose Python reads
        # values: such a model never traces, and page rounding would only widen its tables.
        if any(k not in (LAYER_FULL, LAYER_RECURRENT) for k in kinds):
            return "a layer keeps a cache other than full attention or a recurrent state"
        return None

    def stop(self, why: str) -> None:
        self.off = why
        self._fns.clear()  # their traces go with them
        self.batch.positions.round_pages = False

    def takes(self) -> bool:
        """Whether this step's decode forward can run compiled."""
        caches = self.batch.caches
        return self.off is None and bool(caches) and all(_traceable(c) for c in caches)

    def __call__(self, inputs: mx.array, got: greedy_head.Captured | None) -> mx.array | None:
        """The forward's output for `inputs` [positions, 1], as self.model(inputs,
        cache=batch.caches) inside the runner's head context would give it, `got` filled; None
        where the step is the eager forward's: it does not take it, or it failed to trace,
        which turns it off (logged) with everything the trace touched as it was."""
        if not self.takes():
            return None
        mode = PLAIN if got is None else REPLACE if got.replace else KEEP
        kv = [c for c in self.batch.caches if isinstance(c, BatchedKV)]
        recurrent = [c for c in self.batch.caches if isinstance(c, BatchedStates)]
        p = self.batch.positions
        heads = sorted({c.keys.shape[0] for c in kv})
        writes = [p.writes(h) for h in heads]
        pools = [a for c in kv for a in (c.keys, c.values)]
        states = [list(c.cache) for c in recurrent]
        step = (p.offset, p.table, p.mask, p.keys_per_row)
        head = None if got is None else (got.module, got.hidden, got.placeholder)
        # The pool writes' in_place is part of the trace: a graph for each.
        key = (mode, pool_in_place.get())
        fn = self._fns.get(key)
        if fn is None:
            fn = self._fns[key] = mx.compile(self._traced(mode, heads))
        self._got = got
        self.kernels.set_compile_fusion(False)
        try:
            outs = fn(inputs, *step, *writes, *pools, *(a for parts in states for a in parts))
        except Exception as e:  # noqa: BLE001 - any failure to trace means: run it eagerly
            for c, k, v in zip(kv, pools[0::2], pools[1::2]):
                c.keys, c.values, c.fetched = k, v, None
            for c, parts in zip(recurrent, states):
                c.cache = parts
            if got is not None:
                got.module, got.hidden, got.placeholder = head
            self.stop(repr(e))
            get_logger().warning("runner.compiled_decode_off", reason=repr(e))
            return None
        finally:
            self.kernels.set_compile_fusion(True)
            self._got = None
            # A trace left its placeholders where the forward reads: the step's own arrays.
            p.offset, p.table, p.mask, p.keys_per_row = step
            p.replace_writes(dict(zip(heads, writes)))
        self.calls += 1
        out, rest = outs[0], outs[1:]
        if mode != PLAIN:
            got.module, got.hidden, rest = self._head_module[mode], rest[0], rest[1:]
            if mode == REPLACE:
                got.placeholder = out
        _place(kv, recurrent, rest)
        for c in kv:
            c.fetched = None
        return out

    def _traced(self, mode: str, heads: list[int]) -> Callable:
        batch, model = self.batch, self.model

        def forward(tokens, offset, table, mask, counts, *arrays):
            self.traces += 1
            p = batch.positions
            kv = [c for c in batch.caches if isinstance(c, BatchedKV)]
            recurrent = [c for c in batch.caches if isinstance(c, BatchedStates)]
            writes = arrays[:len(heads)]
            p.offset, p.table, p.mask, p.keys_per_row = offset, table, mask, counts
            p.replace_writes(dict(zip(heads, writes)))
            _place(kv, recurrent, arrays[len(heads):])
            out = model(tokens, cache=batch.caches)
            written = [a for c in kv for a in (c.keys, c.values)]
            written += [a for c in recurrent for a in c.cache]
            if mode == PLAIN:
                return [out, *written]
            got = self._got
            if got.hidden is None or (mode == REPLACE and out is not got.placeholder):
                raise ValueError("the model's output is not its LM head's")
            self._head_module[mode] = got.module
            return [out, got.hidden, *written]

        return forward


def _place(kv: list[BatchedKV], recurrent: list[BatchedStates], arrays: Any) -> None:
    """Hand the layers their arrays, laid out as the trace takes and returns them: each K/V
    pool's keys and values, then each recurrent layer's parts. A recurrent layer gets a new
    list: the step's own list stays as it was, for a trace that fails."""
    pools, states = arrays[:2 * len(kv)], arrays[2 * len(kv):]
    for i, c in enumerate(kv):
        c.keys, c.values = pools[2 * i], pools[2 * i + 1]
    for c in recurrent:
        n = len(c.cache)
        c.cache, states = list(states[:n]), states[n:]
    if len(states):
        raise ValueError(f"{len(states)} arrays left over after placing the layers' caches")


def _traceable(cache: Any) -> bool:
    """A layer cache the trace takes as inputs and outputs: the paged K/V, a recurrent state once every part exists (a part no row has yet is made by the model: a
    different graph). BatchedStates never sets mlx-lm's paddings or lengths."""
    if isinstance(cache, BatchedKV):
        return True
    return isinstance(cache, BatchedStates) and all(a is not None for a in cache.cache)
