"""The runner process's entry point: load the configured BLAS before anything imports mlx
(see cpu/blas.py), then start the actor. The launcher calls preflight() before it starts any
process, so a BLAS that is not there fails the launch, not the runner."""

from __future__ import annotations

from actors.model_runner.cpu import blas


def preflight(cfg) -> None:
    """OSError/ValueError when the runner could not start with this config (imports no MLX)."""
    blas.find(cfg.runtime.blas)


def main(cfg, addrs, model, name: str = "runner") -> None:
    """`name`: "runner", or "runner-K" for rank K of a tensor-parallel runner."""
    blas.load(cfg.runtime.blas)
    from actors.model_runner.actor import main as run

    run(cfg, addrs, model, name)
