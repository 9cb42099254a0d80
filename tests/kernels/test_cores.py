"""A core of its own for MLX's stream thread (actors/model_runner/cpu/cores.py), and the two
kernel calls it rests on: stream_thread_id and set_worker_cpus."""

from __future__ import annotations

import os
import threading

import pytest

from actors.model_runner.cpu import cores
from protocol.config import load_config

linux = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux affinity")
two_cpus = pytest.mark.skipif(not hasattr(os, "sched_getaffinity")
                              or len(os.sched_getaffinity(0)) < 2, reason="needs 2+ CPUs")


def test_the_plan_gives_the_lowest_cpu_to_the_stream_and_the_rest_to_everything_else():
    assert cores.plan({3, 1, 7}, 1) == cores.Cores(1, frozenset({3, 7}))
    assert cores.plan({0, 1}, 1) == cores.Cores(0, frozenset({1}))
    assert cores.plan({5}, 1) is None  # one CPU: nothing to split
    assert cores.plan({0, 1, 2, 3}, 2) is None  # ranks or replicas here split the cores


class _Kernels:
    def stream_thread_id(self):  # what why_not looks for
        raise AssertionError("why_not must not run the kernels")


def test_why_not_names_what_stops_it():
    on = load_config(None)
    assert on.runtime.pin_stream  # the default
    off = load_config(None, ["runtime.pin_stream=false"])
    assert cores.why_not(off, _Kernels()) == "runtime.pin_stream is off"
    if not hasattr(os, "sched_setaffinity"):
        assert "Linux" in cores.why_not(on, _Kernels())
        return
    import mlx.core as mx

    if mx.default_device() != mx.cpu:
        assert cores.why_not(on, _Kernels()) == "MLX runs on the GPU"
        return
    assert cores.why_not(on, None) == "the compiled kernels are not built"
    two = load_config(None, ["scheduler.dp=2"])
    assert cores.why_not(two, _Kernels()) == "several runner processes share the machine"
    expected = None if len(os.sched_getaffinity(0)) >= 2 else "one CPU"
    assert cores.why_not(on, _Kernels()) == expected


def _affinity(tid: int) -> set[int]:
    return os.sched_getaffinity(tid)


@linux
@two_cpus
def test_repin_moves_threads_that_inherited_the_stream_core_and_leaves_the_stream_thread():
    allowed = os.sched_getaffinity(0)
    plan = cores.plan(allowed, 1)
    me = threading.get_native_id()
    started, release = threading.Event(), threading.Event()
    made: list[int] = []

    def child():
        made.append(threading.get_native_id())
        started.set()
        release.wait(10)

    # repin moves every other thread of the process that may run on the stream core: put
    # them all back afterwards.
    masks = {int(t): _affinity(int(t)) for t in os.listdir("/proc/self/task")}
    os.sched_setaffinity(0, {plan.stream})  # this thread stands in for the stream thread
    try:
        t = threading.Thread(target=child)
        t.start()  # inherits this thread's one CPU
        started.wait(10)
        assert _affinity(made[0]) == {plan.stream}
        moved = cores.repin(me, plan)
        assert moved >= 1
        assert _affinity(made[0]) == set(plan.others)
        assert _affinity(me) == {plan.stream}  # the stream thread stays
        assert cores.repin(me, plan) == 0  # nothing left to move
        release.set()
        t.join()
    finally:
        release.set()
        for tid, mask in masks.items():
            try:
                os.sched_setaffinity(tid, mask)
            except OSError:
                pass


@linux
def test_the_stream_thread_id_is_the_thread_that_runs_the_kernels():
    mk = pytest.importorskip("mas_kernels")
    import mlx.core as mx

    if mx.default_device() != mx.cpu:
        pytest.skip("the stream thread is the CPU stream's")
    first = cores.stream_thread(mk)
    assert first != threading.get_native_id()  # not the caller: MLX's stream thread
    assert str(first) in os.listdir("/proc/self/task")  # a thread of this process
    assert cores.stream_thread(mk) == first  # one stream, one thread
    # Each call is its own node: a compiled function would not merge two.
    a, b = mk.stream_thread_id(), mk.stream_thread_id()
    mx.eval(a, b)
    assert a.item() == b.item() == first and a.dtype == mx.int32 and a.shape == ()


@linux
@two_cpus
def test_set_worker_cpus_pins_the_pools_workers_now_and_later_and_refuses_a_bad_cpu():
    mk = pytest.importorskip("mas_kernels")
    import mlx.core as mx

    allowed = sorted(os.sched_getaffinity(0))
    before = mk.threads()

    def workers() -> list[int]:
        return [int(t) for t in os.listdir("/proc/self/task")
                if _affinity(int(t)) == {allowed[-1]}]

    x = mx.random.normal((1, 2048))
    w = mx.quantize(mx.random.normal((4096, 2048)), 64, 4)
    try:
        mk.set_threads(1)
        mk.set_threads(2)  # a fresh pool: its worker is made after the call below
        mk.set_worker_cpus([allowed[-1]])
        mx.eval(mk.affine_qmm(x, *w))  # 2 threads: the pool and its worker are made
        assert workers(), "the new worker runs on the CPU given"
        mk.set_worker_cpus(allowed[:1])  # and an existing worker moves
        assert not workers()
        assert any(_affinity(int(t)) == {allowed[0]} for t in os.listdir("/proc/self/task"))
        with pytest.raises(ValueError, match="no CPU 100000"):
            mk.set_worker_cpus([100000])
        with pytest.raises(ValueError, match="no CPU -1"):
            mk.set_worker_cpus([-1])
    finally:
        mk.set_worker_cpus(allowed)
        mk.set_threads(before)
