"""The serving benchmark: this server vs mlx_lm.server vs a bare forward loop
(`python -m benchmarks.serving`), and the smaller serving measurements beside it."""
