"""The runner process's entry point: load the configured BLAS before anything imports mlx
(see cpu/blas.py), then start the actor. The launcher calls preflight() before it starts any
process, so a BLAS that is not there fails the launch, not the runner."""

from __future__ import annotations

import os

from actors.model_runner.cpu import blas

# What sets the compute threads of the BLAS (MKL's OpenMP, OpenBLAS) and of our kernels.
THREAD_VARIABLES = ("MKL_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def preflight(cfg) -> None:
    """OSError/ValueError when the runner could not start with this config (imports no MLX)."""
    blas.find(cfg.runtime.blas)


def main(cfg, addrs, model, name: str = "runner") -> None:
    """`name`: "runner", or "runner-K" for rank K of a tensor-parallel runner."""
    share = share_cores(cfg)
    blas.load(cfg.runtime.blas)
    if share is not None:
        try:
            import mas_kernels  # the compiled kernels' own pool (native/), when built
        except ImportError:
            pass
        else:
            mas_kernels.set_threads(share)
    from actors.model_runner.actor import main as run

    run(cfg, addrs, model, name)


def share_cores(cfg) -> int | None:
    """Runner ranks and replicas on one machine split its cores: each takes its share of
    compute threads (the BLAS's set here, before it loads; our kernels' by the caller).
    Measured on 2 cores with runner.tp = 2: each rank with threads for every core made a
    decode step 5.7x slower (51 vs 9 ms), the threads of one rank spinning on the cores the
    other needed. A variable the user set wins. Returns the share, or None with one runner
    process."""
    procs = cfg.runners_here()
    if procs == 1:
        return None
    share = max(1, (os.cpu_count() or 1) // procs)
    for var in THREAD_VARIABLES:
        os.environ.setdefault(var, str(share))
    return share
