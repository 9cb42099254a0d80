"""The runner process's entry point: load the configured BLAS before anything imports mlx
(see blas.py), then start the actor."""

from __future__ import annotations

from actors.model_runner import blas


def main(cfg, addrs, model) -> None:
    blas.load(cfg.runtime.blas)
    from actors.model_runner.actor import main as run

    run(cfg, addrs, model)
