"""Serving, fuzz and kernel benchmarks: run from the repository root, never installed."""
