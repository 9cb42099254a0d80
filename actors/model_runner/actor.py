"""The model-runner actor. MLX arrays and streams belong to the thread that made them, so one
thread (the MLX thread) loads the model and runs every step; the asyncio shell only moves
messages between the inbox, that thread and the scheduler."""

from __future__ import annotations

import asyncio
import os
import queue
import threading
import time
import traceback
from typing import Callable

import mlx.core as mx
import msgspec

from actors.model_runner import tensor_parallel
from actors.model_runner.cpu import cores
from actors.model_runner.cpu.weights import load_kernels
from actors.model_runner.loading import load_model
from actors.model_runner.pipeline import Pipeline
from actors.model_runner.runner import ModelRunner
from actors.shell import Shell, run_actor
from protocol.transport import actor_name
from actors.model_runner.kv_pages import PAGE
from models.sizing import buffer_cache_bytes, kv_capacity, state_capacity, workspace_bytes
from protocol import messages as m
from models.info import ModelInfo
from protocol.config import Config, RuntimeConfig

_STOP = object()
# How long a launched step waits for the next batch before it is read back, where the
# scheduler built one (ForwardBatch.follows).
FOLLOW_S = 0.005


class MlxThread(threading.Thread):
    def __init__(self, shell: Shell, loop: asyncio.AbstractEventLoop):
        super().__init__(name="mlx", daemon=True)
        self.shell, self.loop, self.log = shell, loop, shell.log
        self.inbox: queue.Queue = queue.Queue()
        self.loaded = loop.create_future()
        self.last_sent = 0.0
        self.rank = shell.rank  # only rank 0 sends results
        self.watchdog = tensor_parallel.Watchdog(shell.cfg.runner.step_timeout_s)
        self.cores: dict = {}  # what pin_cores() did, for the runner.cores log
        self._pinned: tuple[int, cores.Cores] | None = None  # the stream thread and its plan
        self._repinned = 0.0  # when repin() last looked

    def _runner(self, model) -> ModelRunner:
        cfg, info = self.shell.cfg, self.shell.model
        runner = ModelRunner(model, cfg.scheduler.max_running_requests,
                             kv_slots=kv_capacity(cfg, info),
                             state_slots=state_capacity(cfg, info), vocab_size=info.vocab_size,
                             eos_ids=info.eos_ids, runtime=runtime_of(cfg, info),
                             tokenizer_dir=info.path,
                             # Traced on one rank: the ranks' collectives are not replayed.
                             compile_decode=cfg.runtime.compile_decode and cfg.runner.tp == 1)
        # The scheduler sized its state slots from config.json (ModelInfo.state_layers); the
        # runner found the layers in the model itself. Serving on a disagreement would resume
        # recurrent or sliding-window layers from nothing after a prefix hit: refuse to start.
        stateful = runner.layers.stateful
        if len(stateful) != info.state_layers:
            raise ValueError(f"{info.path}: config.json implies {info.state_layers} recurrent-"
                             f"state or sliding-window layers, the model has {len(stateful)}")
        return runner

    def run(self) -> None:
        try:
            group = tensor_parallel.join(self.shell.cfg, self.shell.addrs, self.shell.replica,
                                         self.rank)
            model = load_model(self.shell.model.path)
            if group is not None:
                tensor_parallel.shard(model, group)
            self.model, self.runner = model, self._runner(model)
            # After a first forward (the runner's probe of the vocabulary width), so MKL's
            # threads and the kernels' pool exist to be pinned.
            self.cores = self.pin_cores()
        except Exception as e:
            self.loop.call_soon_threadsafe(self.loaded.set_exception, e)
            return
        self.loop.call_soon_threadsafe(self.loaded.set_result, None)
        self.serve_or_die()

    def serve_or_die(self) -> None:
        """serve_steps(); if it raises, the actor dies."""
        try:
            self.serve_steps()
        except Exception as e:  # noqa: BLE001 - see below
            # What the loop itself raises, outside a step (the pipeline turns a step's failure
            # into an error result): rebuilding the runner after a failed step, say. A thread
            # that ended quietly would leave every request waiting on a graph that looks up:
            # the actor dies instead, and the launcher stops the graph saying why.
            self.log.error("runner.mlx_thread_failed", error=repr(e),
                           traceback="".join(traceback.format_exception(e)))
            message = f"the MLX thread failed: {e!r}"
            self.loop.call_soon_threadsafe(
                lambda: asyncio.ensure_future(die(self.shell, message)))

    def serve_steps(self) -> None:
        """Run the batches the inbox brings until _STOP."""
        self.stats = Utilisation(self.log, self.shell.cfg.log.stats_interval_s,
                                 lambda: self.runner.pools.kv.held())
        # With overlap the scheduler sends step N+1 before it has step N's result: wait that
        # long for it before reading step N back, so N+1 is built while N computes.
        follow_s = FOLLOW_S if self.shell.cfg.scheduler.overlap else 0.0
        pipeline = Pipeline(self)
        while True:
            self.watchdog.waiting(not pipeline.busy)
            try:
                batch = self.inbox.get(timeout=follow_s if pipeline.busy else self.stats.interval)
            except queue.Empty:
                self.watchdog.waiting(False)
                if pipeline.busy:
                    pipeline.flush()
                else:
                    self.stats.maybe_report()
                    self.repin()
                continue
            self.watchdog.waiting(False)
            if batch is _STOP:
                pipeline.flush()
                self.stats.maybe_report(final=True)  # the last stretch, however short
                return
            pipeline.launch(batch)
            if not batch.follows:  # nothing comes before its result: no wait for a next step
                pipeline.flush()

    def pin_cores(self) -> dict:
        """A core of its own for MLX's stream thread (cpu/cores.py), where that applies;
        returns the runner.cores log's fields."""
        kernels, _ = load_kernels()
        why = cores.why_not(self.shell.cfg, kernels)
        if why:
            return {"pinned": False, "reason": why}
        # why_not checked what plan() needs (one runner process here, two CPUs or more).
        plan = cores.plan(os.sched_getaffinity(0), self.shell.cfg.runners_here())
        try:
            done = cores.pin(kernels, plan)
        except Exception as e:  # noqa: BLE001 - never fatal: the runner serves unpinned
            return {"pinned": False, "reason": f"pinning failed: {e!r}"}
        self._pinned = (done["stream_thread"], plan)
        return {"pinned": True, "stream_core": plan.stream, "other_cores": sorted(plan.others),
                **done}

    def repin(self) -> None:
        """Threads the stream thread made since pin_cores() (they inherit its core), moved
        to the others: once per stats interval, while idle."""
        now = time.perf_counter()
        if self._pinned is None or now - self._repinned < self.stats.interval:
            return
        self._repinned = now
        try:
            moved = cores.repin(*self._pinned)
        except Exception as e:  # noqa: BLE001 - an exception here would end the MLX thread
            self.log.warning("runner.cores_repin_failed", error=repr(e))
            self._pinned = None
            return
        if moved:
            self.log.info("runner.cores_repinned", threads=moved)

    def reset(self) -> None:
        """The runner's memory may be half-updated: drop every row's state. With tensor
        parallelism the ranks may no longer agree (a lost peer, a failure on one rank only),
        so the rank dies instead and the graph stops."""
        if self.shell.cfg.runner.tp > 1:
            message = f"rank {self.rank}: a step failed, the ranks may disagree"
            self.loop.call_soon_threadsafe(lambda: asyncio.ensure_future(die(self.shell,
                                                                            message)))
            return
        self.runner = None  # the old pool goes before the new one is allocated
        self.runner = self._runner(self.model)

    def send(self, result: m.StepResult, started: float) -> None:
        self.watchdog.beat()
        if self.rank == 0:  # the other ranks computed the same result
            self.loop.call_soon_threadsafe(self.shell.send_now, "scheduler", result)
        # Launched steps overlap: count each stretch of wall time once.
        now = time.perf_counter()
        self.stats.step(now - max(started, self.last_sent), len(result.tokens))
        self.last_sent = now


def runtime_of(cfg: Config, info: ModelInfo) -> RuntimeConfig:
    """The runtime config with the buffer cache's limit resolved for this model."""
    return msgspec.structs.replace(cfg.runtime,
                                   buffer_cache_mib=buffer_cache_bytes(cfg, info) >> 20)


class Utilisation:
    """Per interval: the fraction of wall time the runner spent running steps, and steps/s.
    With overlap the next step is already queued when one ends, so busy stays near 1."""

    def __init__(self, log, interval: float, held: Callable[[], dict] = dict):
        """held: what the runner holds of the KV pool now (KvPages.held)."""
        self.log, self.interval, self.held = log, interval, held
        self._reset(time.perf_counter())

    def _reset(self, now: float) -> None:
        self.since, self.busy, self.steps, self.tokens = now, 0.0, 0, 0

    def step(self, seconds: float, tokens: int) -> None:
        self.busy += seconds
        self.steps += 1
        self.tokens += tokens
        self.maybe_report()

    def maybe_report(self, final: bool = False) -> None:
        """Log the interval once it is over (`final`: at shutdown, however short it was)."""
        now = time.perf_counter()
        wall = now - self.since
        if wall < self.interval and not (final and self.steps and wall > 0):
            return
        if self.steps:
            self.log.info("runner.utilisation", busy_fraction=round(self.busy / wall, 4),
                          idle_fraction=round(1 - self.busy / wall, 4), busy_s=round(self.busy, 4),
                          wall_s=round(wall, 4), steps=self.steps,
                          steps_per_s=round(self.steps / wall, 2),
                          tokens_per_s=round(self.tokens / wall, 2),
                          # Live arrays vs freed buffers MLX keeps for reuse: RSS counts both,
                          # a leak grows the first.
                          mlx_active_mib=round(mx.get_active_memory() / 2**20, 1),
                          mlx_cache_mib=round(mx.get_cache_memory() / 2**20, 1),
                          **self.held())
        self._reset(now)


async def tell_layers(shell: Shell, runner: ModelRunner) -> None:
    """Only the runner loads the model, so only it can say what each layer keeps (and whether
    snapshots keep the head's input); the scheduler waits for this before it decides its
    prefix cache and says Ready."""
    kinds = runner.layers.kinds
    shell.log.info("runner.layers", kinds=kinds, head_input=runner.head_input)
    await shell.send("scheduler", m.ModelLayers(kinds=kinds, head_input=runner.head_input))


async def watch_steps(shell: Shell, mlx: MlxThread) -> None:
    """A rank stuck in a step (a peer died or hung inside a collective) dies loudly, so the
    launcher stops the graph and every open request gets its error. Its MLX thread cannot be
    interrupted there: the process exits without it."""
    while True:
        await asyncio.sleep(min(1.0, mlx.watchdog.timeout_s / 4))
        late = mlx.watchdog.stalled_for()
        if late:
            shell.log.error("runner.stalled", rank=mlx.rank, seconds=round(late, 1))
            await die(shell, f"rank {mlx.rank} stalled: no step finished for {late:.1f} s "
                             f"(runner.step_timeout_s = {mlx.watchdog.timeout_s:g})")


async def die(shell: Shell, message: str) -> None:
    """Tell the launcher why, then exit at once: the MLX thread may be blocked in a
    collective, where nothing can stop it."""
    shell.log.error("runner.rank_failed", error=message)
    try:
        await asyncio.wait_for(
            shell.send("launcher", m.ActorFailed(actor=shell.name, message=message)), 1.0)
    finally:
        os._exit(1)


async def serve(shell: Shell) -> None:
    inbox = shell.bind_inbox(m.RunnerInbox)
    mlx = MlxThread(shell, asyncio.get_running_loop())
    mlx.start()
    await mlx.loaded
    tp = shell.cfg.runner.tp
    others = [actor_name("runner", shell.replica, k) for k in range(1, tp)] if mlx.rank == 0 \
        else []
    watch = None
    if tp > 1:
        shell.log.info("runner.rank", rank=mlx.rank, tp=tp, backend=shell.cfg.runner.backend)
        watch = asyncio.ensure_future(watch_steps(shell, mlx))
    # What the CPU patches did (cpu/__init__.py): the BLAS in use, the flags, the counts.
    installed = mlx.runner.cpu
    shell.log.info("runner.blas", **installed.log_fields())
    shell.log.info("runner.weights", **installed.weights.log_fields())
    shell.log.info("runner.cores", **mlx.cores)
    shell.log.info("runner.ready", max_running_requests=shell.cfg.scheduler.max_running_requests,
                   kv_slots=kv_capacity(shell.cfg, shell.model), why=shell.model.sizing or None,
                   # The one KV pool: the budget in pages, and what the arrays hold so far.
                   kv_page_tokens=PAGE, kv_pages=mlx.runner.pools.kv.budget_pages(),
                   workspace_mib=workspace_bytes(shell.cfg, shell.model) >> 20,
                   **mlx.runner.pools.kv.held(),
                   # Whether decode forwards may run compiled (compiled_decode.py); a model
                   # whose caches are not all paged K/V still runs them eagerly.
                   compiled_decode=mlx.runner.compiled is not None,
                   # cpu, or gpu on Metal and CUDA, where MLX's own kernels are the fast path.
                   device=mx.default_device().type.name)
    if installed.weights.missing:
        shell.log.warning("runner.kernels_missing", reason=installed.weights.missing,
                          fallback="jit")
    if mlx.rank == 0:
        await tell_layers(shell, mlx.runner)
    plan = installed.weights
    await shell.ready(model=shell.model.name,
                      weights=", ".join(f"{k}: {p.strategy}" for k, p in plan.kinds.items()),
                      resident_bytes=str(sum(p.resident_bytes for p in plan.kinds.values())))
    try:
        while True:
            frames = await inbox.recv_frames()
            for frame in frames:  # the other ranks first, in the order received
                for name in others:
                    shell.send_now(name, frame)
            for msg in map(inbox.dec.decode, frames):
                match msg:
                    case m.ForwardBatch():
                        mlx.inbox.put(msg)
                    case m.Shutdown():
                        return
    finally:
        if watch is not None:
            watch.cancel()
        mlx.inbox.put(_STOP)
        await asyncio.to_thread(mlx.join, 5.0)


def main(cfg, addrs, model, name: str = "runner") -> None:
    run_actor(name, cfg, addrs, model, serve)
