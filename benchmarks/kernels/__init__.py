"""Bare-forward and CPU kernel benchmarks: no server, one process."""
