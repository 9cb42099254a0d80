"""A core of its own for MLX's stream thread; every other thread of the graph on the rest.

Why: on the CPU every kernel of a step runs on MLX's stream thread, one after another; the
kernels' pool workers (and MKL's) help inside a product, and wait for it between products. So
the stream thread's time is the step's time. Left to the OS scheduler, each wake-up of
another actor (a token to send on, an HTTP chunk to write) or of the runner's own Python
thread lands on whichever core, and where it preempts the stream thread the whole step
waits, while a preempted pool worker costs nothing (the stream thread takes its tasks). On 2
cores, qwen3-small-4bit served at one request, paired 3 s windows in one graph
(docs/performance.md, "Pinning: a core for the stream thread"): +12-14% tokens/s with the stream thread
alone on one core and everything else on the other, +6% with only the stream thread pinned;
float32 +3%.

What is pinned, once the runner has loaded and run a first forward (so MKL's threads and the
kernels' pool exist): the stream thread to the lowest allowed CPU; every other thread of the
runner, the pool's workers (now and once made: mas_kernels.set_worker_cpus) and every thread
of the other actor processes (the launcher's children named mas-*, and the launcher) to the
others. A thread made later inherits its maker's CPUs, so one the stream thread makes (a
BLAS's new thread) would share its core: repin() moves those, at each utilisation report.

Only where it helps and cannot hurt: `runtime.pin_stream` (default on), Linux, MLX on the
CPU, the compiled kernels built (they find the stream thread), one runner process on the
machine (ranks and replicas here already split the cores: entry.share_cores) and at least two
allowed CPUs. Never fatal: a thread or process that cannot be pinned (gone, not ours) is
skipped and counted.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from actors.titles import children, title


@dataclass(frozen=True)
class Cores:
    stream: int  # the stream thread's core
    others: frozenset[int]  # everything else's


def plan(allowed: set[int] | frozenset[int], runners_here: int) -> Cores | None:
    """The cores, or None where pinning does not apply (one CPU, several runner processes)."""
    if runners_here != 1 or len(allowed) < 2:
        return None
    stream = min(allowed)
    return Cores(stream, frozenset(allowed) - {stream})


def why_not(cfg: Any, kernels: Any) -> str | None:
    """Why the runner does not pin (None: it does)."""
    if not cfg.runtime.pin_stream:
        return "runtime.pin_stream is off"
    if not sys.platform.startswith("linux") or not hasattr(os, "sched_setaffinity"):
        return "thread affinity is Linux's"
    if mx.default_device() != mx.cpu:
        return "MLX runs on the GPU"
    if kernels is None or not hasattr(kernels, "stream_thread_id"):
        return "the compiled kernels are not built"
    if cfg.runners_here() != 1:
        return "several runner processes share the machine"
    if len(os.sched_getaffinity(0)) < 2:
        return "one CPU"
    return None


def stream_thread(kernels: Any) -> int:
    """The id of the thread MLX's default CPU stream runs on (call on the runner's MLX
    thread)."""
    tid = kernels.stream_thread_id()
    mx.eval(tid)
    return int(tid.item())


def pin(kernels: Any, cores: Cores) -> dict[str, int]:
    """Pin as the module says; returns what was pinned, for the runner's log."""
    # Thread counts come from the CPUs the first caller may use: fixed now, before that
    # caller (the stream thread) may use one. The kernels' pool is made lazily; MKL sizes its
    # team at its first threaded call, which a product of this size is.
    kernels.set_threads(kernels.threads())
    mx.eval(mx.ones((256, 512)) @ mx.ones((512, 256)))
    stream = stream_thread(kernels)
    kernels.set_worker_cpus(sorted(cores.others))
    os.sched_setaffinity(stream, {cores.stream})
    threads = _pin_threads(os.getpid(), cores.others, skip=stream)
    actors = sum(1 for pid in _siblings() if _pin_threads(pid, cores.others))
    return {"stream_thread": stream, "threads": threads, "actors": actors}


def repin(stream: int, cores: Cores) -> int:
    """Every thread of this process but the stream thread that may run on the stream's core
    (after pin(), those the stream thread made since: they inherit its core), moved to the
    others; returns how many."""
    return _pin_threads(os.getpid(), cores.others, skip=stream, only_on=cores.stream)


def _threads(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


def _pin_threads(pid: int, cpus: frozenset[int], skip: int | None = None,
                 only_on: int | None = None) -> int:
    """The threads of `pid` but `skip` (those that may run on CPU `only_on`, if given) moved
    to `cpus`; returns how many."""
    pinned = 0
    for tid in _threads(pid):
        if tid == skip:
            continue
        try:
            if only_on is None or only_on in os.sched_getaffinity(tid):
                os.sched_setaffinity(tid, cpus)
                pinned += 1
        except OSError:  # gone since listed, or not ours
            pass
    return pinned


def _siblings() -> list[int]:
    """The other actor processes: the launcher (the parent) and its other children, those
    titled mas-* (actors/titles.py), so a test or tool that started the runner is left
    alone."""
    parent, me = os.getppid(), os.getpid()
    return [p for p in [parent, *children(parent)] if p != me and title(p).startswith("mas-")]
